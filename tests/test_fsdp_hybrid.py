"""Hierarchical FSDP: params over every device, the slow outer axis skipped.

Params ``P(("outer", "inner"))`` (1/(N L) per device); the gradient is
reduce-scattered in full over the fast inner axis, then by
``skip_psum_scatter`` over the outer one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import sharded_updates, xla_steps
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._ring.traffic import all_gather_bytes, reduce_scatter_bytes

N, L = 4, 2
AXES = ("o", "i")
BLOCKS = P(AXES)


def _mesh(auto=False):
    types = (jax.sharding.AxisType.Auto,) * 2 if auto else None
    return jax.make_mesh((N, L), AXES, axis_types=types)


def _per_device(fn, x):
    """fn(x's block, key) on every device, outputs stacked by device."""
    mesh = _mesh()
    f = jax.jit(jax.shard_map(
        lambda v, key: jax.tree_util.tree_map(lambda a: a[None], fn(v[0], key)),
        mesh=mesh, in_specs=(BLOCKS, P()), out_specs=BLOCKS))
    return lambda key: jax.tree_util.tree_map(
        np.asarray, f(jax.device_put(x, NamedSharding(mesh, BLOCKS)), key))


def test_num_skip_zero_equals_psum_scatter_over_both_axes():
    x = np.random.default_rng(0).integers(-50, 50, size=(N * L, 3 * N * L, 5))
    got = _per_device(lambda v, key: sr.skip_psum_scatter(
        v, "o", inner_axis="i", key=None, num_skip=0), x.astype(np.int32))
    ref = _per_device(lambda v, key: lax.psum_scatter(
        v, AXES, scatter_dimension=0, tiled=True), x.astype(np.int32))
    np.testing.assert_array_equal(got(jax.random.key(0)), ref(jax.random.key(0)))


@pytest.mark.parametrize("randomize", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_every_block_sums_all_inner_and_n_minus_k_outer_ranks(randomize, k):
    rows = 19  # padded to 24: three rows per block
    x = np.random.default_rng(k).normal(size=(N * L, rows, 3)).astype(np.float32)

    def fn(v, key):
        kw = dict(key=key, num_skip=k, randomize=randomize, inner_axis="i")
        return (sr.skip_psum_scatter(v, "o", **kw),
                sr.scatter_contribution_mask(v, "o", **kw))

    f = _per_device(fn, x)
    for seed in range(3):
        out, mask = f(jax.random.key(seed))        # device d = o * L + i
        assert np.all(mask.sum(0) == (N - k) * L)
        # The inner axis is summed in full: both inner ranks alike.
        assert np.all(mask.reshape(N, L, rows, 3) == mask.reshape(N, L, rows, 3)[:, :1])
        want = np.concatenate([np.where(mask, x, 0).sum(0), np.zeros((24 - rows, 3))])
        np.testing.assert_allclose(out.reshape(want.shape), want, rtol=1e-5, atol=1e-5)
        for d in range(N * L):  # every owner sums its own outer rank
            assert mask[d, 3 * d: min(3 * d + 3, rows)].all()


def _loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def _model():
    rng = np.random.default_rng(1)
    params = {"w1": rng.normal(size=(16, 32)) * 0.3, "b1": np.zeros(32),
              "w2": rng.normal(size=(32, 8)) * 0.3, "c": np.zeros(3)}
    x = rng.normal(size=(64, 16)).astype(np.float32)
    return ({k: v.astype(np.float32) for k, v in params.items()},
            (x, np.sin(x[:, :8])))


def _train(tx, host, batch, steps, gather="whole"):
    mesh = _mesh()
    params = sr.shard_params(host, mesh, AXES)
    opt_state = sr.init_opt_state(tx, params, mesh, AXES)
    step = sr.make_train_step(_loss, tx, mesh, AXES, gather=gather)
    batch = sr.shard_batch(batch, mesh, AXES)
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    return params, opt_state, step, batch


def test_num_skip_zero_trains_as_xlas_fsdp_step_over_both_axes():
    host, batch = _model()
    tx = optax.chain(sr.skip_reduce("o", inner_axis="i", num_skip=0, min_size=0,
                                    params_sharded=True), optax.adamw(1e-2))
    params, opt_state, step, _ = _train(tx, host, batch, 20)
    assert step._cache_size() == 1
    for k in ("w1", "b1", "w2"):  # 1/(N L) of each param and of Adam's moments
        assert params[k].sharding.spec[0] == AXES
        assert params[k].addressable_shards[0].data.shape[0] == host[k].shape[0] // (N * L)
    assert opt_state[1][0].mu["w1"].addressable_shards[0].data.shape == (2, 32)
    assert params["c"].sharding.spec == P(None)  # 3 rows: replicated
    # XLA's own step with the same layout.
    auto = _mesh(auto=True)
    ref = sr.shard_params(host, auto, AXES)
    xb = tuple(jax.device_put(a, NamedSharding(auto, BLOCKS)) for a in batch)
    ref = xla_steps(_loss, optax.adamw(1e-2), ref, xb, auto, 20)
    for k in host:
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]),
                                   rtol=1e-4, atol=1e-5)


def test_per_leaf_gathering_trains_the_same():
    host, batch = _model()
    tx = optax.chain(sr.skip_reduce("o", inner_axis="i", num_skip=2, min_size=0,
                                    params_sharded=True), optax.adamw(1e-2))
    whole = _train(tx, host, batch, 4)[0]
    per_leaf = _train(tx, host, batch, 4, gather="per_leaf")[0]
    for k in host:
        np.testing.assert_allclose(np.asarray(per_leaf[k]), np.asarray(whole[k]),
                                   rtol=1e-5, atol=1e-6)


def test_random_traffic_is_the_formula():
    host, batch = _model()
    del host["c"]  # every leaf sharded: all the gradient is reduce-scattered
    k = 2
    tx = optax.chain(sr.skip_reduce("o", inner_axis="i", num_skip=k, min_size=0,
                                    params_sharded=True), optax.sgd(0.1))
    params, opt_state, step, placed = _train(tx, host, batch, 2)
    traffic = sr.collective_traffic(step.lower(params, opt_state, placed).compile().as_text())
    whole = sum(v.size * 4 for v in host.values())
    # Params gathered over all N L devices; the gradient scattered in full
    # over the inner axis, then (N - 1 - k) / N of its 1/L over the outer one.
    assert traffic.bytes_per_device("all-gather") == pytest.approx(
        all_gather_bytes(whole, N * L))
    assert traffic.bytes_per_device("reduce-scatter") == pytest.approx(
        reduce_scatter_bytes(whole, L))
    assert traffic.bytes_per_device("collective-permute") == pytest.approx(
        reduce_scatter_bytes(whole / L, N, k))
    assert traffic.bytes_per_device("all-reduce") <= 16  # the loss and a flag


def test_error_feedback_keeps_exactly_what_was_left_out():
    """sum over devices of g = N L * mean + sum of residuals, per element."""
    host, batch = _model()
    del host["c"]
    mesh = _mesh()
    tx = sr.skip_reduce("o", inner_axis="i", num_skip=1, min_size=0,
                        error_feedback=True, params_sharded=True)
    params = sr.shard_params(host, mesh, AXES)
    state = sr.init_opt_state(tx, params, mesh, AXES)
    specs = sr.state_specs(state, AXES)
    pspec = jax.tree_util.tree_map(lambda _: BLOCKS, host)

    def local(p, s, x, y):
        whole = jax.tree_util.tree_map(lambda b: lax.all_gather(b, AXES, tiled=True), p)
        grads = jax.grad(_loss)(sr.to_varying(whole, AXES), (x, y))
        mean, s = tx.update(grads, s, p)
        return jax.tree_util.tree_map(lambda g: g[None], grads), mean, s

    f = jax.jit(jax.shard_map(local, mesh=mesh,
                              in_specs=(pspec, specs, BLOCKS, BLOCKS),
                              out_specs=(BLOCKS, pspec, specs)))
    grads, mean, state = f(params, state, *sr.shard_batch(batch, mesh, AXES))
    for k in host:
        g = np.asarray(grads[k]).reshape((N * L,) + host[k].shape)
        r = np.asarray(state.residual[k])
        np.testing.assert_allclose(g.sum(0), N * L * np.asarray(mean[k]) + r.sum(0),
                                   rtol=1e-5, atol=1e-5)
        assert np.all((r != 0).sum(0) == L)  # one outer rank, both inner ones


def test_a_param_sharded_over_the_outer_axis_only_is_refused():
    host, batch = _model()
    mesh = _mesh()
    tx = optax.chain(sr.skip_reduce("o", inner_axis="i", num_skip=1, min_size=0,
                                    params_sharded=True), optax.sgd(0.1))
    params = sr.shard_params(host, mesh, "o")
    with pytest.raises(ValueError, match=r"not along its leading dimension first.*"
                       r"shard_params\(params, mesh, \('o', 'i'\)\)"):
        opt_state = sr.init_opt_state(tx, params, mesh, AXES)
        sr.make_train_step(_loss, tx, mesh, AXES)(
            params, opt_state, sr.shard_batch(batch, mesh, AXES))


def test_the_skipped_scatter_averages_to_the_exact_mean_over_its_period():
    # Each block's outer owner is always summed, weighed by the others'
    # chance; over the scatter's period every outer rank weighs alike, so
    # the average update is exactly the mean over all N L devices.
    k, rows = 2, 2
    period = sr.scatter_period(N, k)
    grads = np.random.default_rng(2).normal(size=(N * L, N * L * rows, 3)).astype(np.float32)
    tx = sr.skip_reduce("o", inner_axis="i", num_skip=k, min_size=0, params_sharded=True)
    u = sharded_updates(tx, grads, _mesh(), BLOCKS, period)
    assert period > 1
    for d in range(N * L):
        block = grads[:, d * rows:(d + 1) * rows]
        np.testing.assert_allclose(u[d].mean(0), block.mean(0), rtol=1e-5, atol=1e-5)
        assert not np.allclose(u[d][0], block.mean(0), atol=1e-3)  # one step is skipped
