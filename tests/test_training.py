"""Training-loop helpers: local gradients, state placement, the jitted step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import line_mesh, per_rank
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


def _linear_loss(params, batch):
    # d loss / d w = this rank's batch row sum: local, known, param-free.
    return jnp.sum(params["w"] * batch.sum(0))


def test_local_grad_is_per_rank_and_plain_grad_is_summed():
    x = np.arange(N * 4, dtype=np.float32).reshape(N, 1, 4)

    def f(batch, params):
        local = sr.local_grad(_linear_loss, "i")(params, batch)
        summed = jax.grad(_linear_loss)(params, batch)
        return local["w"], summed["w"]

    local, summed = per_rank(f, x, n=N, replicated_args=({"w": np.ones(4)},))
    np.testing.assert_array_equal(local, x[:, 0])
    np.testing.assert_array_equal(summed, np.broadcast_to(x[:, 0].sum(0), (N, 4)))


def test_local_value_and_grad_has_aux_and_argnums():
    def loss(a, b, batch):
        return jnp.sum(a * b * batch), jnp.sum(batch)

    x = np.arange(N, dtype=np.float32).reshape(N, 1)

    def f(batch, a, b):
        (value, aux), grads = sr.local_value_and_grad(
            loss, "i", argnums=(0, 1), has_aux=True)(a, b, batch)
        return value, aux, grads[0], grads[1]

    value, aux, ga, gb = per_rank(f, x, n=N, replicated_args=(2.0, 3.0))
    np.testing.assert_array_equal(value, 6.0 * x[:, 0])
    np.testing.assert_array_equal(aux, x[:, 0])
    np.testing.assert_array_equal(ga, 3.0 * x[:, 0])
    np.testing.assert_array_equal(gb, 2.0 * x[:, 0])


def test_state_specs_place_only_residuals_per_rank():
    tx = optax.chain(sr.skip_reduce("data", num_skip=2, error_feedback=True),
                     optax.adam(1e-3))
    state = jax.eval_shape(tx.init, {"w": jnp.zeros((3, 2))})
    specs = sr.state_specs(state, "data")
    assert specs[0].residual == {"w": P("data")}
    assert specs[0].count == P() and specs[0].key == P()
    assert all(s == P() for s in jax.tree_util.tree_leaves(
        specs[1], is_leaf=lambda x: isinstance(x, P)))
    hier = sr.state_specs(state, ("host", "local"))
    assert hier[0].residual == {"w": P(("host", "local"))}


def test_error_feedback_residuals_stay_per_rank_in_a_jit_loop():
    """Each rank keeps its own residual across steps; nothing is lost."""
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(0)
    # Integer-valued rows: with lr 1 and N = 8 every sum below is exact.
    batch = rng.integers(-20, 20, size=(N, 2048)).astype(np.float32)
    tx = optax.chain(sr.skip_reduce("data", num_skip=5, min_size=0,
                                    error_feedback=True), optax.sgd(1.0))
    params = sr.replicate({"w": jnp.zeros(2048)}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    assert opt_state[0].residual["w"].sharding.spec[0] == "data"
    step = sr.make_train_step(_linear_loss, tx, mesh, "data", donate=False)
    sharded = sr.shard_batch(batch, mesh, "data")
    steps = 5
    residual_history = []
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, sharded)
        residual_history.append(np.asarray(opt_state[0].residual["w"]))
    assert step._cache_size() == 1
    residual = residual_history[-1]                       # [N, 2048]
    assert residual.shape == (N, 2048)
    assert not np.array_equal(residual[0], residual[1])   # not one broadcast copy
    assert not np.array_equal(residual_history[-2], residual)
    # Delivered (N x the sum of updates) + residuals left = all local grads.
    delivered = -np.asarray(params["w"]) * N
    np.testing.assert_array_equal(delivered + residual.sum(0),
                                  steps * batch.sum(0))


def test_params_identical_on_a_data_model_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4 * 8, 16)).astype(np.float32)
    y = rng.normal(size=(4 * 8, 3)).astype(np.float32)

    def loss_fn(p, batch):
        return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)

    tx = optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0),
                     optax.sgd(0.1))
    params = sr.replicate({"w": jnp.zeros((16, 3))}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    losses = []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state,
                                       sr.shard_batch((x, y), mesh, "data"))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    shards = [np.asarray(s.data) for s in params["w"].addressable_shards]
    assert len(shards) == 8
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])


def test_check_vma_accepts_the_specs_and_rejects_a_wrong_one():
    mesh = line_mesh(N, "data")
    tx = sr.skip_reduce("data", num_skip=2, min_size=0, error_feedback=True)
    params = sr.replicate({"w": jnp.zeros(64)}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    wrong = jax.tree_util.tree_map(lambda _: P(), opt_state)

    def local(params, state, batch):
        grads = sr.local_grad(_linear_loss, "data")(params, batch)
        return tx.update(grads, state)[1]

    batch = sr.shard_batch(np.ones((N, 64), np.float32), mesh, "data")
    specs = sr.state_specs(opt_state, "data")
    ok = jax.jit(jax.shard_map(local, mesh=mesh,
                               in_specs=(P(), specs, P("data")), out_specs=specs,
                               check_vma=True))(params, opt_state, batch)
    assert ok.residual["w"].shape == (N, 64)
    # A residual declared replicated is caught: it varies over 'data'.
    with pytest.raises(ValueError, match="could not infer replication"):
        jax.jit(jax.shard_map(local, mesh=mesh,
                              in_specs=(P(), specs, P("data")), out_specs=wrong,
                              check_vma=True))(params, opt_state, batch)


def _regression_setup(tx, mesh):
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(64, 16)).astype(np.float32),
             "y": rng.normal(size=(64, 4)).astype(np.float32)}
    params = {"w": jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)}
    params = sr.replicate(params, mesh)
    return params, sr.init_opt_state(tx, params, mesh), sr.shard_batch(batch, mesh)


def _mse(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def _squared_mean_error(params, batch):
    # Not a mean over samples: a piece's gradient is not the batch's.
    return jnp.mean(batch["x"] @ params["w"] - batch["y"]) ** 2


@pytest.mark.parametrize("num_skip", [0, 3])
def test_microbatches_accumulate_locally_before_one_reduction(num_skip):
    # microbatches=4 equals one step on a loss that averages the loss of the
    # 4 pieces itself, and differs from the loss of the whole local batch.
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=num_skip, min_size=0),
                     optax.sgd(0.1))

    def piecewise(params, batch):
        pieces = jax.tree_util.tree_map(lambda x: x.reshape((4, -1) + x.shape[1:]),
                                        batch)
        return jnp.mean(jax.vmap(_squared_mean_error, (None, 0))(params, pieces))

    runs = {}
    for name, loss, m in (("micro", _squared_mean_error, 4),
                          ("reference", piecewise, 1),
                          ("whole", _squared_mean_error, 1)):
        params, state, batch = _regression_setup(tx, mesh)
        step = sr.make_train_step(loss, tx, mesh, microbatches=m, donate=False)
        new_params, _, value = step(params, state, batch)
        traffic = sr.collective_traffic(
            step.lower(params, state, batch).compile().as_text())
        runs[name] = (np.asarray(new_params["w"]), float(value),
                      traffic.count("collective-permute"), traffic.count("all-reduce"))
    micro, reference, whole = runs["micro"], runs["reference"], runs["whole"]
    np.testing.assert_allclose(micro[0], reference[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(micro[1], reference[1], rtol=1e-5)
    assert not np.allclose(micro[0], whole[0], rtol=1e-4, atol=1e-5)
    assert micro[2:] == whole[2:]  # one reduction per step either way


def test_microbatches_must_divide_the_local_batch():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0),
                     optax.sgd(0.1))
    params, state, batch = _regression_setup(tx, mesh)
    with pytest.raises(ValueError, match="microbatches=3 equal pieces"):
        sr.make_train_step(_mse, tx, mesh, microbatches=3)(params, state, batch)
    with pytest.raises(ValueError, match="microbatches=0 must be a positive"):
        sr.make_train_step(_mse, tx, mesh, microbatches=0)


def test_plain_init_with_error_feedback_points_to_init_opt_state():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0,
                                    error_feedback=True), optax.sgd(0.1))
    params, _, batch = _regression_setup(tx, mesh)
    with pytest.raises(ValueError, match="init_opt_state"):
        sr.make_train_step(_mse, tx, mesh)(params, tx.init(params), batch)


def test_error_feedback_keeps_no_residual_for_leaves_never_skipped():
    # Excluded and small leaves always get the full all-reduce: their
    # residuals are empty rows, not per-device copies of the leaf.
    mesh = jax.make_mesh((N,), ("data",))
    kw = dict(num_skip=3, min_size=100, error_feedback=True)
    tx = optax.chain(sr.skip_reduce("data", selective=sr.exclude("b"), **kw),
                     optax.sgd(0.1))
    rng = np.random.default_rng(1)
    params = sr.replicate({"w": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
                           "b": jnp.zeros((64,)), "s": jnp.zeros((8,))}, mesh)
    state = sr.init_opt_state(tx, params, mesh)
    shapes = {k: v.shape for k, v in state[0].residual.items()}
    assert shapes == {"w": (N, 16, 64), "b": (N, 0), "s": (N, 0)}

    def loss(p, batch):
        return jnp.sum((batch @ p["w"] + p["b"]) ** 2) + jnp.sum(p["s"] * batch.sum())

    batch = sr.shard_batch(rng.normal(size=(4 * N, 16)).astype(np.float32), mesh)
    params, state, _ = sr.make_train_step(loss, tx, mesh)(params, state, batch)
    assert np.abs(np.asarray(state[0].residual["w"])).max() > 0
    assert {k: v.shape for k, v in state[0].residual.items()} == shapes
    sr.assert_replicated(params, mesh)

    # A state built for other settings is refused with a pointer to the fix.
    other = optax.chain(sr.skip_reduce("data", **{**kw, "min_size": 0}),
                        optax.sgd(0.1))
    with pytest.raises(ValueError, match="other selective/min_size settings"):
        sr.make_train_step(loss, other, mesh)(params, state, batch)


def test_an_optimizer_without_skip_reduce_is_refused():
    # optax.adam alone would apply each rank's own gradient: the step says
    # what is missing instead of failing on out_specs.
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.adam(1e-3)
    params, state, batch = _regression_setup(tx, mesh)
    with pytest.raises(ValueError, match=r"still varies over \['data'\].*"
                       r"skip_reduce\('data', num_skip=0, min_size=0\)"):
        sr.make_train_step(_mse, tx, mesh)(params, state, batch)


def test_axis_names_must_be_mesh_axes():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0),
                     optax.sgd(0.1))
    params, _, _ = _regression_setup(tx, mesh)
    message = r"axis_name='batch' is not an axis of the mesh, whose axes are \('data',\)"
    with pytest.raises(ValueError, match="make_train_step: " + message):
        sr.make_train_step(_mse, tx, mesh, "batch")
    with pytest.raises(ValueError, match="init_opt_state: " + message):
        sr.init_opt_state(tx, params, mesh, "batch")
    with pytest.raises(ValueError, match="shard_batch: " + message):
        sr.shard_batch(np.zeros((N, 2)), mesh, "batch")
    with pytest.raises(TypeError, match="donate='yes' must be a bool"):
        sr.make_train_step(_mse, tx, mesh, donate="yes")
