"""data_parallel: your own step, jitted and mapped over the data axes."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


def _mse(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)


def _regression(rows=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    y = (x @ rng.normal(size=(16, 4))).astype(np.float32)
    return {"w": jnp.zeros((16, 4))}, (x, y)


def _sgd_step(tx):
    def local_step(params, opt_state, batch, scale):
        loss, grads = sr.local_value_and_grad(_mse, "data")(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map(lambda u: scale * u, updates)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")
    return local_step


def test_host_and_placed_batches_static_args_and_donation():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=3, min_size=0), optax.sgd(0.1))
    step = sr.data_parallel(_sgd_step(tx), mesh, "data", batch_argnums=2,
                            static_argnums=3, donate_argnums=(0, 1))
    params, (x, y) = _regression()
    opt_state = sr.init_opt_state(tx, sr.replicate(params, mesh), mesh)
    # Host params and a host batch are placed by the step itself.
    params, opt_state, loss = step(params, opt_state, (x, y), 1.0)
    assert params["w"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 2)
    old = params["w"]
    placed = sr.shard_batch((x, y), mesh)
    params, opt_state, loss2 = step(params, opt_state, placed, 1.0)
    assert old.is_deleted()                       # donated
    assert not placed[0].is_deleted()             # the batch is not
    assert float(loss2) < float(loss)
    assert step._cache_size() == 1                # host or placed: one compilation
    step(params, opt_state, (x, y), 0.5)          # a new static value compiles again
    assert step._cache_size() == 2


def test_host_and_placed_batches_give_the_same_step():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0), optax.sgd(0.1))
    step = sr.data_parallel(_sgd_step(tx), mesh, batch_argnums=(2,), static_argnums=(3,))
    params, batch = _regression()
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh)
    host = step(params, opt_state, batch, 1.0)
    placed = step(params, opt_state, sr.shard_batch(batch, mesh), 1.0)
    for a, b in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(placed),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_batch_that_does_not_split_names_the_argument():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0), optax.sgd(0.1))
    step = sr.data_parallel(_sgd_step(tx), mesh, batch_argnums=2, static_argnums=3)
    params, (x, y) = _regression(rows=60)
    with pytest.raises(ValueError, match=r"data_parallel: argument 2 \(in batch_argnums\) "
                       r"has a leaf at \[0\] of shape \(60, 16\).*8 ranks"):
        step(params, tx.init(params), (x, y), 1.0)
    with pytest.raises(ValueError, match="share \\[2\\]"):
        sr.data_parallel(_sgd_step(tx), mesh, batch_argnums=2, static_argnums=2)
    with pytest.raises(ValueError, match="axis_name='batch' is not an axis of the mesh"):
        sr.data_parallel(_sgd_step(tx), mesh, "batch", batch_argnums=2)


@pytest.mark.parametrize("kind", ["explicit", "auto", "data_model"])
def test_explicit_auto_and_two_axis_meshes_give_one_result(kind):
    if kind == "data_model":   # the model axis stays with the compiler
        mesh = jax.make_mesh((4, 2), ("data", "model"))
    else:
        types = (AxisType.Explicit if kind == "explicit" else AxisType.Auto,)
        mesh = jax.make_mesh((N,), ("data",), axis_types=types)
    tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), optax.sgd(0.1))
    step = sr.data_parallel(_sgd_step(tx), mesh, batch_argnums=2, static_argnums=3)
    params, (x, y) = _regression()
    opt_state = sr.init_opt_state(tx, sr.replicate(params, mesh), mesh)
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, (x, y), 1.0)
    sr.assert_replicated(params, mesh)
    # k = 0 is the plain data-parallel mean: the same as plain jit on the batch.
    ref = {"w": jnp.zeros((16, 4))}
    for _ in range(3):
        ref = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, ref,
                                     jax.grad(_mse)(ref, (x, y)))
    np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-5, atol=1e-6)


def test_output_that_varies_per_rank_names_its_path_and_per_rank_returns_rows():
    mesh = jax.make_mesh((N,), ("data",))

    def stats(x):
        return {"batch_stats": {"BatchNorm_0": {"mean": jnp.mean(x, 0)}}}

    step = sr.data_parallel(stats, mesh, batch_argnums=0)
    x = np.arange(N * 2 * 3, dtype=np.float32).reshape(N * 2, 3)
    with pytest.raises(ValueError, match=(
            r"data_parallel: the output at \['batch_stats'\]\['BatchNorm_0'\]\['mean'\] "
            r"varies over \['data'\].*lax\.pmean\(x, 'data'\).*"
            r"nnx\.BatchNorm\(\.\.\., axis_name='data'\).*PerRank")):
        step(x)
    means = sr.data_parallel(lambda x: sr.PerRank(jnp.mean(x, 0)[None]), mesh,
                             batch_argnums=0)(x)
    np.testing.assert_allclose(means.value, x.reshape(N, 2, 3).mean(1))
    reduced = sr.data_parallel(lambda x: lax.pmean(jnp.mean(x, 0), "data"), mesh,
                               batch_argnums=0)(x)
    np.testing.assert_allclose(reduced, x.mean(0), rtol=1e-6)


def test_hierarchical_axes_and_rank_keys():
    axes = ("host", "local")
    mesh = jax.make_mesh((2, 4), axes)
    tx = optax.chain(sr.skip_reduce("host", num_skip=1, inner_axis="local", min_size=0,
                                    error_feedback=True), optax.sgd(0.05))

    def local_step(params, opt_state, batch, key):
        key = sr.rank_key(key, axes)
        x, y = batch
        keep = jax.random.bernoulli(key, 0.75, x.shape)
        loss, grads = sr.local_value_and_grad(_mse, axes)(params, (x * keep, y))
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                sr.PerRank(jax.random.key_data(key)[None]))

    step = sr.data_parallel(local_step, mesh, axes, batch_argnums=2)
    params, batch = _regression()
    opt_state = sr.init_opt_state(tx, sr.replicate(params, mesh), mesh, axes)
    for i in range(3):
        params, opt_state, keys = step(params, opt_state, batch, jax.random.key(i))
    residual = opt_state[0].residual["w"]
    assert residual.shape == (N, 16, 4) and residual.sharding.spec[0] == axes
    keys = np.asarray(keys.value)
    assert len({tuple(k) for k in keys}) == N   # a key per rank
    # The rank index is host * 4 + local, the order the batch is split in.
    np.testing.assert_array_equal(
        keys[5], jax.random.key_data(jax.random.fold_in(jax.random.key(2), 5)))
    sr.assert_replicated(params, mesh)


# -- flax linen: a TrainState, an RNG, a static config and metrics -----------------


class Config(NamedTuple):
    dropout: float


def _linen_setup(axis_name):
    linen = pytest.importorskip("flax.linen")
    from flax.training import train_state

    class MLP(linen.Module):
        dropout: float

        @linen.compact
        def __call__(self, x, train):
            x = linen.Dense(16, use_bias=False)(x)  # BatchNorm follows
            x = linen.BatchNorm(use_running_average=not train, axis_name=axis_name)(x)
            x = linen.Dropout(self.dropout, deterministic=not train)(linen.relu(x))
            return linen.Dense(3)(x)

    class TrainState(train_state.TrainState):
        batch_stats: Any

    model = MLP(dropout=0.25)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=32)
    variables = model.init(jax.random.key(0), x[:4], train=False)
    return TrainState, model, variables, (x, y)


def _linen_loss(state, params, batch, key, config):
    x, y = batch
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, x, train=config.dropout > 0,
        rngs={"dropout": key}, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (updates["batch_stats"], logits)


def _linen_step(state, batch, key, config):
    key = sr.rank_key(key, "data")     # a dropout mask per rank
    (loss, (stats, logits)), grads = sr.local_value_and_grad(
        lambda p: _linen_loss(state, p, batch, key, config), "data", has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=stats)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch[1])
    return state, lax.pmean({"loss": loss, "accuracy": accuracy}, "data")


def _linen_reference(state, batch, key, config):
    # Plain jit on the whole batch, one vmap lane per rank: XLA's own
    # data-parallel step, with the same per-rank dropout keys.
    xs, ys = (a.reshape((N, -1) + a.shape[1:]) for a in batch)

    def total(params):
        def lane(x, y):
            return _linen_loss(state, params, (x, y), sr.rank_key(key, "data"), config)
        losses, (stats, _) = jax.vmap(lane, axis_name="data")(xs, ys)
        return losses.mean(), jax.tree_util.tree_map(lambda s: s[0], stats)

    (_, stats), grads = jax.value_and_grad(total, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats)


def test_linen_train_state_k0_equals_xla_data_parallel():
    TrainState, model, variables, batch = _linen_setup("data")
    mesh = jax.make_mesh((N,), ("data",))
    config = Config(dropout=0.25)
    sgd = optax.sgd(0.1, momentum=0.9)
    tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), sgd)
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    ref = TrainState.create(apply_fn=model.apply, params=variables["params"],
                            tx=sgd, batch_stats=variables["batch_stats"])
    step = sr.data_parallel(_linen_step, mesh, batch_argnums=1, static_argnums=3,
                            donate_argnums=0)
    ref_step = jax.jit(_linen_reference, static_argnums=3)
    auto = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    placed = jax.device_put(batch, NamedSharding(auto, P("data")))
    for i in range(3):
        key = jax.random.key(i)
        state, metrics = step(state, batch, key, config)
        ref = ref_step(ref, placed, key, config)
    assert set(metrics) == {"loss", "accuracy"} and int(state.step) == 3
    for got, want in ((state.params, ref.params), (state.batch_stats, ref.batch_stats)):
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_linen_train_state_error_feedback_keeps_replicas_identical():
    TrainState, model, variables, batch = _linen_setup("data")
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0, error_feedback=True),
                     optax.adam(1e-2))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    state = state.replace(opt_state=sr.init_opt_state(tx, sr.replicate(state.params, mesh),
                                                      mesh))
    step = sr.data_parallel(_linen_step, mesh, batch_argnums=1, static_argnums=3)
    for i in range(3):
        state, _ = step(state, batch, jax.random.key(i), Config(dropout=0.25))
    residual = state.opt_state[0].residual["Dense_0"]["kernel"]
    assert residual.shape == (N, 8, 16) and residual.sharding.spec[0] == "data"
    residual = np.asarray(residual)
    assert not np.array_equal(residual[0], residual[1])
    sr.assert_replicated((state.params, state.batch_stats), mesh)


# The params cannot tell per-rank statistics apart: skip_reduce warns.
@pytest.mark.filterwarnings("ignore::skipreduce_jax.BatchNormWarning")
def test_linen_batchnorm_without_axis_name_names_the_path():
    TrainState, model, variables, batch = _linen_setup(None)
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0), optax.sgd(0.1))
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    step = sr.data_parallel(_linen_step, mesh, batch_argnums=1, static_argnums=3)
    with pytest.raises(ValueError, match=r"output at \[0\]\.batch_stats\['BatchNorm_0'\]"
                       r"\['mean'\] varies over \['data'\].*"
                       r"nn\.BatchNorm\(axis_name='data'\)"):
        step(state, batch, jax.random.key(0), Config(dropout=0.25))
