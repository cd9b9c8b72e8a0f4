"""skip_reduce with params sharded over the data axis (FSDP / ZeRO).

A param whose shard is its 1/N block along the leading axis gets this rank's
block of the mean (a skipped reduce-scatter); replicated params keep the
all-reduce. Steps written by hand here: gather the params, take local
gradients, update the shards.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import xla_steps
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8
PSPEC = {"w": P("data"), "b": P()}


def _loss(p, x, y):
    return jnp.mean((x @ p["w"] - y) ** 2) + jnp.sum(p["b"] ** 2)


def _data():
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(16, 4)).astype(np.float32),
              "b": rng.normal(size=3).astype(np.float32)}
    x = rng.normal(size=(64, 16)).astype(np.float32)
    return params, x, x @ rng.normal(size=(16, 4)).astype(np.float32)


def _step_fns(tx, mesh):
    def init(p):
        return tx.init(p)

    shapes = jax.eval_shape(jax.shard_map(init, mesh=mesh, in_specs=(PSPEC,),
                                          out_specs=P(), check_vma=False),
                            _placed(_data()[0], mesh))
    # Optimizer state of the shards is sharded like them (ZeRO).
    shard_shape = (16 // N, 4)
    ospec = jax.tree_util.tree_map(
        lambda spec, leaf: P("data") if leaf.shape == shard_shape else spec,
        sr.state_specs(shapes, "data"), shapes)

    def step(p, s, x, y):
        whole = {"w": lax.all_gather(p["w"], "data", tiled=True), "b": p["b"]}
        grads = jax.grad(_loss)(sr.to_varying(whole, "data"), x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, grads, updates

    init_f = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=(PSPEC,), out_specs=ospec))
    step_f = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(PSPEC, ospec, P("data"), P("data")),
        out_specs=(PSPEC, ospec, P("data"), P("data"))))
    return init_f, step_f


def _placed(params, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, PSPEC[k])) for k, v in params.items()}


def test_num_skip_zero_equals_xlas_fsdp_step():
    mesh = jax.make_mesh((N,), ("data",))
    params, x, y = _data()
    tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0, params_sharded=True),
                     optax.adamw(1e-2))
    init_f, step_f = _step_fns(tx, mesh)
    p = _placed(params, mesh)
    s = init_f(p)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    # XLA's own FSDP step: plain jit, params sharded over "data".
    ref_tx = optax.adamw(1e-2)

    @jax.jit
    def ref_step(p, s):
        updates, s = ref_tx.update(jax.grad(_loss)(p, xs, ys), s, p)
        return optax.apply_updates(p, updates), s

    ref_p = _placed(params, mesh)
    with jax.set_mesh(mesh):
        ref_s = jax.jit(ref_tx.init)(ref_p)
        for _ in range(20):
            p, s, _, _ = step_f(p, s, xs, ys)
            ref_p, ref_s = ref_step(ref_p, ref_s)
            jax.block_until_ready((p, ref_p))   # one step of each in flight
    assert p["w"].sharding.spec == P("data", None)
    assert p["w"].addressable_shards[0].data.shape == (16 // N, 4)  # 1/N per device
    for k in p:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(ref_p[k]),
                                   rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("randomize", [False, True])
def test_error_feedback_delivers_every_value_once(randomize):
    """World normalization: sum_r g_r = N * update + sum_r residual_r, exactly."""
    mesh = jax.make_mesh((N,), ("data",))
    params, x, y = _data()
    tx = sr.skip_reduce("data", num_skip=3, min_size=0, error_feedback=True,
                        randomize=randomize, params_sharded=True)
    init_f, step_f = _step_fns(optax.chain(tx, optax.sgd(0.1)), mesh)
    p, s = _placed(params, mesh), None
    s = init_f(p)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    _, s, grads, updates = step_f(p, s, xs, ys)
    residual = s[0].residual
    g = {k: np.asarray(v).reshape((N,) + params[k].shape) for k, v in grads.items()}
    r = {k: np.asarray(v) for k, v in residual.items()}
    # updates are -lr * mean: "w" comes back as its blocks, "b" once per rank.
    u = {"w": np.asarray(updates["w"]) / -0.1,
         "b": np.asarray(updates["b"]).reshape(N, 3)[0] / -0.1}
    for k in g:
        np.testing.assert_allclose(g[k].sum(0), N * u[k] + r[k].sum(0),
                                   rtol=1e-5, atol=1e-5)
        left_out = (r[k] != 0).sum(0)      # ranks left out of each element
        assert np.all(left_out == 3)


def test_traffic_is_the_formula():
    """Bytes per step: the param all-gather plus (N-1-k)/N of the gradient."""
    mesh = jax.make_mesh((N,), ("data",))
    params, x, y = _data()
    tx = optax.chain(sr.skip_reduce("data", num_skip=3, min_size=0, params_sharded=True,
                                    selective={"w": True, "b": False}), optax.sgd(0.1))
    init_f, step_f = _step_fns(tx, mesh)
    p = _placed(params, mesh)
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, y))
    traffic = sr.collective_traffic(step_f.lower(p, init_f(p), xs, ys).compile().as_text())
    w_bytes = 16 * 4 * 4
    assert traffic.bytes_per_device("collective-permute") == pytest.approx(
        (N - 1 - 3) / N * w_bytes)
    assert traffic.count("reduce-scatter") == 0
    # The gather of w's shards, and b's full all-reduce (3 floats).
    assert traffic.bytes_per_device("all-gather") == pytest.approx((N - 1) / N * w_bytes)
    assert traffic.bytes_per_device("all-reduce") == pytest.approx(2 * (N - 1) / N * 12)


def test_a_gradient_that_fits_no_param_layout_is_refused():
    mesh = jax.make_mesh((N,), ("data",))

    def f(g, p):
        tx = sr.skip_reduce("data", num_skip=1, min_size=0, params_sharded=True)
        return tx.update({"w": g}, tx.init({"w": p}), {"w": p})[0]["w"]

    g = jax.device_put(jnp.zeros((N * 16, 4)), NamedSharding(mesh, P("data")))
    p = jax.device_put(jnp.zeros((N * 3, 4)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"neither the same shape"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data")))(g, p)


def test_shards_without_params_sharded_name_the_fix():
    mesh = jax.make_mesh((N,), ("data",))

    def f(g, p):
        tx = sr.skip_reduce("data", num_skip=1, min_size=0)
        return tx.update({"w": g}, tx.init({"w": p}), {"w": p})[0]["w"]

    g = jax.device_put(jnp.zeros((N * 16, 4)), NamedSharding(mesh, P("data")))
    p = jax.device_put(jnp.zeros((N * 2, 4)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"its 1/8 block.*Pass params_sharded=True"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P("data")))(g, p)


def _mlp_loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def _mlp():
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(16, 32)) * 0.3, "b1": np.zeros(32),
              "w2": rng.normal(size=(32, 4)) * 0.3}
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = np.sin(x[:, :4])
    return {k: v.astype(np.float32) for k, v in params.items()}, (x, y)


def _fsdp_run(tx, steps, mesh, params, batch):
    params = sr.shard_params(params, mesh, "data")
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(_mlp_loss, tx, mesh, "data")
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    return params, opt_state, step


def test_make_train_step_with_sharded_params_equals_xlas_fsdp_step():
    """Three lines from data parallel: params_sharded=True, shard_params."""
    mesh = jax.make_mesh((N,), ("data",))
    host, batch = _mlp()
    tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0, params_sharded=True),
                     optax.adamw(1e-2))
    params, opt_state, step = _fsdp_run(tx, 20, mesh, host, batch)
    # Each device holds 1/N of the params and of Adam's moments (ZeRO).
    for k in ("w1", "b1", "w2"):
        assert params[k].addressable_shards[0].data.shape[0] == host[k].shape[0] // N
    mu = opt_state[1][0].mu
    assert mu["w1"].addressable_shards[0].data.shape == (16 // N, 32)
    assert step._cache_size() == 1
    # XLA's own FSDP step: plain jit with params P("data") (Auto axes: under
    # Explicit ones the bias add of a batch and a sharded bias needs a reshard).
    auto = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    ref = sr.shard_params(host, auto, "data")
    xb = tuple(jax.device_put(a, NamedSharding(auto, P("data"))) for a in batch)
    ref = xla_steps(_mlp_loss, optax.adamw(1e-2), ref, xb, auto, 20)
    for k in host:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]),
                                   rtol=1e-4, atol=1e-5)


def test_make_train_step_fsdp_random_and_traffic():
    mesh = jax.make_mesh((N,), ("data",))
    host, batch = _mlp()
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                    params_sharded=True), optax.sgd(0.1))
    params, opt_state, step = _fsdp_run(tx, 3, mesh, host, batch)
    sr.assert_replicated(params, mesh)  # b-less leaves: only replicated ones compared
    text = step.lower(params, opt_state, batch).compile().as_text()
    traffic = sr.collective_traffic(text)
    k = 4
    whole = sum(v.size * 4 for v in host.values())
    # FSDP step: the params' all-gather, then (N-1-k)/N of the gradient.
    assert traffic.bytes_per_device("all-gather") == pytest.approx((N - 1) / N * whole)
    assert traffic.bytes_per_device("collective-permute") == pytest.approx(
        (N - 1 - k) / N * whole)
    assert traffic.count("reduce-scatter") == 0
