"""skipreduce_jax.nnx: flax NNX models, optimizers and metrics in the step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

nnx = pytest.importorskip("flax.nnx")
srnnx = pytest.importorskip("skipreduce_jax.nnx")

N = 8


class MLP(nnx.Module):
    def __init__(self, rngs, axis_name="data", rate=0.25):
        self.linear1 = nnx.Linear(8, 16, use_bias=False, rngs=rngs)  # BatchNorm follows
        self.batch_norm1 = nnx.BatchNorm(16, axis_name=axis_name, rngs=rngs)
        self.dropout = nnx.Dropout(rate, rngs=rngs)
        self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.batch_norm1(self.linear1(x)))))


def _loss(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def _train_step(model, optimizer, metrics, batch):
    # flax's NNX step; only the gradients and the metrics' inputs change.
    x, y = batch
    grad_fn = srnnx.local_value_and_grad(_loss, "data", has_aux=True)
    (loss, logits), grads = grad_fn(model, x, y)
    optimizer.update(model, grads)
    gather = lambda v: lax.all_gather(v, "data", tiled=True, to="invarying")  # noqa: E731
    metrics.update(loss=lax.pmean(loss, "data"), logits=gather(logits), labels=gather(y))
    return lax.pmean(loss, "data")


def _batch():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(32, 8)).astype(np.float32), rng.integers(0, 3, size=32))


def _metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def _reference_step(graphdef, tx):
    # Plain jit on the whole batch, one vmap lane per rank: XLA's own
    # data-parallel step, with the per-rank dropout keys folded the same way.
    @jax.jit
    def step(params, keys, rest, opt_state, x, y):
        xs, ys = (a.reshape((N, -1) + a.shape[1:]) for a in (x, y))

        def total(params):
            def lane(x, y):
                lane_keys = jax.tree_util.tree_map(lambda k: sr.rank_key(k, "data"), keys)
                model = nnx.merge(graphdef, params, lane_keys, rest, copy=True)
                loss, _ = _loss(model, x, y)
                return loss, nnx.split(model, nnx.Param, nnx.RngKey, ...)[-1]
            losses, rests = jax.vmap(lane, axis_name="data")(xs, ys)
            return losses.mean(), jax.tree_util.tree_map(lambda r: r[0], rests)

        (_, rest), grads = jax.value_and_grad(total, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state

    return step


def test_k0_equals_xla_data_parallel_step_with_batchnorm_and_dropout():
    mesh = jax.make_mesh((N,), ("data",))
    sgd = optax.sgd(0.1, momentum=0.9)
    model = MLP(nnx.Rngs(0))
    graphdef, params, keys, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, nnx.RngKey, ...)
    ref_step, ref_opt = _reference_step(graphdef, sgd), sgd.init(params)
    optimizer = nnx.Optimizer(
        model, optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), sgd), wrt=nnx.Param)
    metrics = _metrics()
    step = srnnx.data_parallel(_train_step, mesh, batch_argnums=3, donate_argnums=(0, 1))
    x, y = _batch()
    auto = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))
    placed = jax.device_put((x, y), NamedSharding(auto, P("data")))
    for _ in range(3):
        loss = step(model, optimizer, metrics, (x, y))   # updates all three in place
        params, rest, ref_opt = ref_step(params, keys, rest, ref_opt, *placed)
    assert np.isfinite(float(loss)) and int(optimizer.step[...]) == 3
    assert int(model.dropout.rngs.count[...]) == 3     # counters advance alike
    ref = nnx.merge(graphdef, params, keys, rest)
    for kind in (nnx.Param, nnx.BatchStat):
        for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model, kind)),
                        jax.tree_util.tree_leaves(nnx.state(ref, kind)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Metrics saw the whole batch on every step.
    with jax.set_mesh(mesh):
        assert 0.0 <= float(metrics.compute()["accuracy"]) <= 1.0


def test_random_skipping_with_error_feedback_keeps_replicas_identical():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0,
                                    error_feedback=True),
                     optax.adam(1e-2))
    model = MLP(nnx.Rngs(0))
    # nnx.Optimizer runs tx.init outside the step: one residual row, refused.
    with pytest.raises(ValueError, match=r"init_optimizer\(model, tx, mesh\)"):
        srnnx.data_parallel(_train_step, mesh, batch_argnums=3)(
            model, nnx.Optimizer(model, tx, wrt=nnx.Param), _metrics(), _batch())
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data")
    residual = optimizer.opt_state[0].residual["linear1"]["kernel"][...]
    assert residual.shape == (N, 8, 16) and residual.sharding.spec[0] == "data"
    step = srnnx.data_parallel(_train_step, mesh, batch_argnums=3)
    metrics = _metrics()
    for _ in range(3):
        step(model, optimizer, metrics, _batch())
    residual = np.asarray(optimizer.opt_state[0].residual["linear1"]["kernel"][...])
    assert np.abs(residual).max() > 0 and not np.array_equal(residual[0], residual[1])
    sr.assert_replicated(nnx.state(model), mesh)
    sr.assert_replicated(optimizer.opt_state[1], mesh)


def _sum_and_mask(module, x):
    out = module(x)
    return jnp.sum(out), out != 0


def test_dropout_draws_a_mask_per_rank():
    mesh = jax.make_mesh((N,), ("data",))
    dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))

    def masks(rank_rngs):
        def local(module, x):
            (_, mask), _ = srnnx.local_value_and_grad(
                _sum_and_mask, "data", wrt=nnx.Nothing, has_aux=True,
                rank_rngs=rank_rngs)(module, x)
            return sr.PerRank(mask)
        step = srnnx.data_parallel(local, mesh, batch_argnums=1)
        return np.asarray(step(dropout, np.ones((N, 64), np.float32)).value)

    assert len({row.tobytes() for row in masks(True)}) == N
    assert len({row.tobytes() for row in masks(False)}) == 1
    assert int(dropout.rngs.count[...]) == 2   # the stream advanced in place


def test_batchnorm_without_axis_name_names_the_variable():
    mesh = jax.make_mesh((N,), ("data",))
    model = MLP(nnx.Rngs(0), axis_name=None)
    optimizer = nnx.Optimizer(
        model, optax.chain(sr.skip_reduce("data", num_skip=1, min_size=0), optax.sgd(0.1)),
        wrt=nnx.Param)
    step = srnnx.data_parallel(_train_step, mesh, batch_argnums=3)
    with pytest.raises(ValueError, match=(
            r"argument 0 \(MLP\) at \.batch_norm1\.mean varies over \['data'\].*"
            r"nnx\.BatchNorm\(\.\.\., axis_name='data'\)")):
        step(model, optimizer, _metrics(), _batch())


def test_metrics_outside_the_step_on_explicit_and_auto_meshes():
    # Outputs of a step on an Explicit mesh mixed with new arrays outside it
    # need jax.set_mesh(mesh); on an Auto mesh nothing is needed.
    for types in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((N,), ("data",), axis_types=(types,))
        model = MLP(nnx.Rngs(0))
        optimizer = nnx.Optimizer(
            model, optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0),
                               optax.sgd(0.1)), wrt=nnx.Param)
        step = srnnx.data_parallel(_train_step, mesh, batch_argnums=3)
        metrics = _metrics()
        loss = step(model, optimizer, metrics, _batch())
        outside = nnx.metrics.Average("loss")
        if types == AxisType.Explicit:
            with jax.set_mesh(mesh):
                outside.update(loss=loss)
        else:
            outside.update(loss=loss)
        np.testing.assert_allclose(outside.compute(), loss)


def test_plain_local_grad_points_nnx_modules_to_the_nnx_helper():
    mesh = jax.make_mesh((N,), ("data",))
    step = srnnx.data_parallel(
        lambda m, x: sr.local_value_and_grad(lambda m, x: jnp.sum(m(x)), "data")(m, x)[0],
        mesh, batch_argnums=1)
    with pytest.raises(TypeError, match=r"skipreduce_jax\.nnx\.local_value_and_grad"):
        step(nnx.Linear(8, 2, rngs=nnx.Rngs(0)), np.ones((N, 8), np.float32))


def test_init_optimizer_keeps_partitioned_params_layouts_without_a_mesh_context():
    mesh = jax.make_mesh((2, 2, 2), ("replica", "fsdp", "tensor"),
                         axis_types=(AxisType.Auto,) * 3)
    init = nnx.with_partitioning(nnx.initializers.normal(0.1), ("fsdp", "tensor"))
    with jax.set_mesh(mesh):  # flax shards annotated params as it creates them
        model = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
    tx = optax.chain(sr.skip_reduce("replica", num_skip=1, min_size=0, error_feedback=True),
                     optax.adam(1e-2))
    # Outside the mesh context: the state is placed already, not by flax again.
    optimizer = srnnx.init_optimizer(model, tx, mesh, "replica")
    residual = optimizer.opt_state[0].residual["kernel"][...]
    assert residual.shape == (2, 16, 32)
    assert residual.sharding.spec == P("replica", "fsdp", "tensor")   # a row per rank
    assert optimizer.opt_state[1][0].mu["kernel"][...].sharding.spec == P("fsdp", "tensor")

    def step_fn(model, optimizer, x):
        loss, grads = srnnx.local_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2),
                                                 "replica")(model, x)
        optimizer.update(model, grads)   # kernel sharded, bias replicated
        return lax.pmean(loss, "replica")

    step = srnnx.data_parallel(step_fn, mesh, "replica", batch_argnums=2)
    before = np.asarray(model.kernel[...])
    text = step.lower(model, optimizer, np.ones((8, 16), np.float32)).compile().as_text()
    assert sr.collective_traffic(text).count("all-gather") > 0   # the ring's gather
    np.testing.assert_array_equal(model.kernel[...], before)             # lowering updates nothing
    for _ in range(2):
        assert np.isfinite(float(step(model, optimizer, np.ones((8, 16), np.float32))))
    assert model.kernel[...].sharding.spec == P("fsdp", "tensor")
    sr.assert_replicated(nnx.state(model), mesh)


@pytest.mark.parametrize("exact_radial", [None, False])
def test_batchnorm_found_by_type_turns_exact_radial_on(exact_radial):
    # linear1 feeds a BatchNorm: by default each of its channels moves along
    # its weights exactly as under the all-reduce, and vectors are reduced
    # in full; with exact_radial=False neither holds.
    mesh = jax.make_mesh((N,), ("data",))
    sgd = optax.sgd(0.1)
    tx = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0,
                                    exact_radial=exact_radial), sgd)
    model = MLP(nnx.Rngs(0))
    graphdef, params, keys, rest = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, nnx.RngKey, ...)
    w0 = np.asarray(model.linear1.kernel[...])
    ref, _, _ = _reference_step(graphdef, sgd)(
        params, keys, rest, sgd.init(params),
        *jax.device_put(_batch(), NamedSharding(
            jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,)), P("data"))))
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data")
    step = srnnx.data_parallel(_train_step, mesh, batch_argnums=3)
    if exact_radial is None:
        step(model, optimizer, _metrics(), _batch())
    else:  # the BatchNorm is known by type when the step calls update()
        with pytest.warns(sr.BatchNormWarning):
            step(model, optimizer, _metrics(), _batch())
    radial = np.sum((np.asarray(model.linear1.kernel[...]) - w0) * w0, axis=0)
    want = np.sum((np.asarray(ref["linear1"]["kernel"][...]) - w0) * w0, axis=0)
    bias = np.asarray(model.linear2.bias[...])
    want_bias = np.asarray(ref["linear2"]["bias"][...])
    exact = exact_radial is None
    assert np.allclose(radial, want, rtol=1e-4, atol=1e-6) == exact
    assert np.allclose(bias, want_bias, rtol=1e-5, atol=1e-7) == exact


class _ModelParallelMLP(nnx.Module):
    """An NNX model written for a (data, model) mesh of Explicit axes."""

    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                             rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, kernel_init=nnx.with_partitioning(init, ("model", None)),
                             rngs=rngs)

    def __call__(self, x):
        h = jax.sharding.reshard(self.l1(x), P("data", None))
        return self.l2(nnx.gelu(self.norm(h)))


def test_a_model_written_for_explicit_axes_runs_as_written():
    """Partitioned kernels and a reshard in the forward pass, on make_mesh's axes."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(32, n)).astype(np.float32) for n in (16, 4))

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit(static_argnums=3)
    def ours(model, x, y, k):
        return srnnx.value_and_grad(loss_fn, mesh, "data", step=1, num_skip=k,
                                    min_size=0)(model, x, y)

    with jax.set_mesh(mesh):
        model = _ModelParallelMLP(nnx.Rngs(0))
        x, y = (jax.device_put(a, P("data")) for a in (x, y))
        ref, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, x, y)
        value, grads = ours(model, x, y, 0)
        skipped = ours(model, x, y, 2)[1]
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        assert jax.typeof(a).sharding.spec == jax.typeof(b).sharding.spec
    kernel = jax.tree.leaves(grads)[1]
    assert np.abs(np.asarray(jax.tree.leaves(skipped)[1]) - np.asarray(kernel)).max() > 1e-4


def test_a_constraint_naming_the_data_axis_in_an_nnx_loss_is_replayed():
    """Before: refused inside the per-rank step (the data axis is Manual there)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    x, _ = _batch()

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(8, 16, rngs=rngs)
            self.linear2 = nnx.Linear(16, 3, rngs=rngs)

    def loss(model, x, constrained):
        h = model.linear1(x)
        if constrained:  # as a pjit step writes it, with the global mesh
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("data", None)))
        return jnp.mean((model.linear2(nnx.relu(h)) - 1.0) ** 2)

    def train(constrained):
        model = Net(nnx.Rngs(0))
        tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), optax.adam(1e-2))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        def step(model, optimizer, x):
            grad_fn = srnnx.local_value_and_grad(lambda m, x: loss(m, x, constrained), "data")
            value, grads = grad_fn(model, x)
            optimizer.update(model, grads)
            return lax.pmean(value, "data")

        run = srnnx.data_parallel(step, mesh, batch_argnums=2)
        return [float(run(model, optimizer, x)) for _ in range(3)]

    losses = train(True)
    np.testing.assert_allclose(losses, train(False), rtol=1e-6)
    assert losses[-1] < losses[0]
