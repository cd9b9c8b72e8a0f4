"""``value_and_grad``: SkipReduce in place of ``jax.value_and_grad`` inside
the user's own ``jax.jit``.

Layouts: a one-axis mesh, and (replica=4, fsdp=2) with params sharded over
fsdp under Explicit and Auto axes (the HSDP layout of
test_sharded_training, whose model and helpers these tests reuse).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_sharded_training import _by_axis, _local_shape, _setup

import skipreduce_jax as sr

LAYOUTS = ["line", "4x2-explicit", "4x2-auto"]


def _layout(name):
    """mesh, param specs over the compiler's axes, params, (x, y) batch."""
    if name == "line":
        mesh, _, params, batch = _setup("4x2-auto")
        mesh = jax.make_mesh((8,), ("replica",))
        params = {k: jax.device_put(np.asarray(v), NamedSharding(mesh, P()))
                  for k, v in params.items()}
        return mesh, dict.fromkeys(params, P()), params, batch
    mesh, specs, params, batch = _setup(name)
    return mesh, specs, params, batch


def _loss(p, batch):
    """Plain GSPMD code on the global batch; aux: a mean and per-example rows."""
    x, y = batch
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    per_example = jnp.mean((h @ p["w2"] - y) ** 2, axis=1)
    return jnp.mean(per_example), {"mean_h": jnp.mean(h),
                                   "rows": sr.PerRank(per_example)}


def _run(name, fun=_loss, step=0, *, has_aux=True, **options):
    mesh, specs, params, batch = _layout(name)
    batch = tuple(jax.device_put(b, NamedSharding(mesh, P("replica"))) for b in batch)
    options.setdefault("min_size", 0)
    if name == "4x2-auto":  # jit's in_shardings will do; Explicit: the types
        options.setdefault("param_specs", {k: NamedSharding(mesh, s)
                                           for k, s in specs.items()})

    def train_step(p, b, s):
        return sr.value_and_grad(fun, mesh, "replica", step=s, has_aux=has_aux,
                                 **options)(p, b)

    with jax.set_mesh(mesh):
        jitted = jax.jit(train_step)
        out = jitted(params, batch, step)
    return mesh, specs, params, batch, out, jitted


@pytest.mark.parametrize("name", LAYOUTS)
def test_num_skip_zero_is_jax_value_and_grad(name):
    mesh, specs, params, batch, ((loss, aux), grads), _ = _run(name, num_skip=0)
    # XLA's own, on Auto axes: under Explicit ones a matmul over a sharded
    # contraction needs an out_sharding in user code (inside the entry
    # point the other axes are Auto).
    ref_mesh = jax.make_mesh(mesh.axis_sizes, mesh.axis_names,
                             axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    place = lambda x: jax.device_put(  # noqa: E731
        np.asarray(x), NamedSharding(ref_mesh, x.sharding.spec))
    with jax.set_mesh(ref_mesh):
        (ref_loss, ref_aux), ref = jax.jit(jax.value_and_grad(_loss, has_aux=True))(
            jax.tree_util.tree_map(place, params), jax.tree_util.tree_map(place, batch))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(aux["mean_h"], ref_aux["mean_h"], rtol=1e-5, atol=1e-7)
    # Per-example rows: every rank's, in the order of the global batch.
    assert isinstance(aux["rows"], sr.PerRank)
    np.testing.assert_allclose(aux["rows"].value, ref_aux["rows"].value, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(grads[k], ref[k], rtol=1e-4, atol=1e-6)
        assert grads[k].sharding.is_equivalent_to(  # the params' own layouts
            NamedSharding(mesh, specs[k]), grads[k].ndim), (k, grads[k].sharding)
        local = grads[k].addressable_shards[0].data.shape
        assert local == _local_shape(grads[k].shape, specs[k], mesh), k


def _contributors(name, step, num_skip, *, summed=None, **options):
    """Which replica ranks each gradient element summed, as bits.

    Rank r's share of the gradient of ``w`` is 2**r everywhere (its one
    batch row holds 2**r); the ring scales the sum of the ``summed`` ranks
    (N - k, N in warm-up) by N / summed, powers of two here, exactly.
    """
    mesh, specs, params, _ = _layout(name)
    n = mesh.shape["replica"]
    w = params["w1"]  # (32, 256), sharded over fsdp in the 4x2 layouts
    rows = jnp.asarray([[2.0 ** r] for r in range(n)])

    def loss(w, x):
        return jnp.sum(w * x[:, :, None])

    def train_step(w, x, s):
        return sr.value_and_grad(loss, mesh, "replica", step=s, num_skip=num_skip,
                                 min_size=0, **options)(w, x)[1]

    with jax.set_mesh(mesh):
        x = jax.device_put(rows, NamedSharding(mesh, P("replica")))
        grads = jax.jit(train_step)(w, x, step)
    assert grads.sharding.is_equivalent_to(NamedSharding(mesh, specs["w1"]), 2)
    sr.assert_replicated(grads, mesh)  # Random: bit-identical replicas
    summed = n - num_skip if summed is None else summed
    return np.rint(np.asarray(grads) * summed / n).astype(np.int64), n


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_element_sums_n_minus_k_ranks(name):
    k = 2
    opts = {"param_specs": P(None, "fsdp")} if name == "4x2-auto" else {}
    bits, n = _contributors(name, 5, k, **opts)
    popcount = np.vectorize(lambda b: bin(b).count("1"))(bits)
    assert (popcount == n - k).all()
    assert len(np.unique(bits)) > 1  # the windows differ along the leaf
    again, _ = _contributors(name, 5, k, **opts)
    np.testing.assert_array_equal(bits, again)  # same step, same drops
    other, _ = _contributors(name, 6, k, **opts)
    assert (other != bits).any()  # another step, other drops


def test_warmup_is_decided_from_step():
    bits, n = _contributors("line", 2, 3, summed=8, warmup_steps=3)
    assert (bits == 2 ** n - 1).all()  # step 2 < 3: every rank summed
    bits, n = _contributors("line", 3, 3, warmup_steps=3)
    assert (np.vectorize(lambda b: bin(b).count("1"))(bits) == n - 3).all()


@pytest.mark.parametrize("name", ["4x2-explicit", "4x2-auto"])
@pytest.mark.parametrize("k", [0, 2])
def test_bytes_over_the_replica_axis_are_the_formula(name, k):
    # check=False: the step-0 check's branch is in the program, run once.
    mesh, specs, params, batch, _, jitted = _run(name, num_skip=k, check=False)
    with jax.set_mesh(mesh):
        text = jitted.lower(params, batch, 0).compile().as_text()
    n = mesh.shape["replica"]
    shards = {key: jax.ShapeDtypeStruct(_local_shape(p.shape, specs[key], mesh), p.dtype)
              for key, p in params.items()}  # each device reduces its shards
    local = sum(int(np.prod(s.shape)) * 4 for s in shards.values())
    value_bytes = 2 * (n - 1) / n * 4 * 2  # the loss's and mean_h's pmean
    replica, other = _by_axis(text, mesh)
    stats = sr.comm_stats(shards, n, num_skip=k, min_size=0)
    assert replica == pytest.approx(stats.bytes_per_device + value_bytes)
    assert replica == pytest.approx((2 * (n - 1) - k) / n * local + value_bytes)
    # Over fsdp: the model's own, no more than XLA's own step sends there.
    _, gspmd_other = _by_axis(_xla_text(name), mesh)
    assert other <= gspmd_other


@pytest.mark.parametrize("name", ["line", "4x2-explicit"])
def test_comm_dtype_sends_half_the_bytes_within_rounding(name):
    k = 2
    mesh, specs, params, batch, (_, grads), jitted = _run(
        name, num_skip=k, comm_dtype=jnp.bfloat16, check=False)
    *_, (_, wide), _ = _run(name, num_skip=k)  # same step: same drops
    for key in params:
        assert grads[key].dtype == jnp.float32
        scale = float(np.max(np.abs(wide[key])))
        # Each hop rounds once to bfloat16 (unit roundoff 2**-8).
        np.testing.assert_allclose(grads[key], wide[key], atol=8 * 2.0**-8 * scale)
    assert any((np.asarray(grads[key]) != np.asarray(wide[key])).any() for key in params)
    with jax.set_mesh(mesh):
        text = jitted.lower(params, batch, 0).compile().as_text()
    n = mesh.shape["replica"]
    shards = {key: jax.ShapeDtypeStruct(_local_shape(p.shape, specs[key], mesh), p.dtype)
              for key, p in params.items()}
    value_bytes = 2 * (n - 1) / n * 4 * 2  # the loss's and mean_h's pmean, float32
    if name == "line":
        replica = sr.collective_traffic(text).bytes_per_device()
    else:
        replica, _ = _by_axis(text, mesh)
    half = sr.comm_stats(shards, n, num_skip=k, min_size=0, comm_dtype=jnp.bfloat16)
    full = sr.comm_stats(shards, n, num_skip=k, min_size=0)
    assert half.bytes_per_device == pytest.approx(full.bytes_per_device / 2)
    assert replica == pytest.approx(half.bytes_per_device + value_bytes)


def _xla_text(name):
    """XLA's own program: jax.value_and_grad (value, aux) and an SGD update."""
    mesh, _, params, batch = _setup(name, AxisType.Auto)
    xb = tuple(jax.device_put(a, NamedSharding(mesh, P("replica"))) for a in batch)

    def step(p, b):
        out, grads = jax.value_and_grad(_loss, has_aux=True)(p, b)
        return out, jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, grads)

    with jax.set_mesh(mesh):
        return jax.jit(step).lower(params, xb).compile().as_text()


def test_padded_batches_divide_by_the_global_count():
    """mean_count: exact at k = 0 though ranks hold different token counts."""
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 6, 3)).astype(np.float32)
    mask = (rng.random((8, 6)) < np.linspace(0.1, 0.9, 8)[:, None]).astype(np.float32)
    w = jnp.asarray(rng.normal(size=3).astype(np.float32))

    def loss(w, batch, count=sr.mean_count):
        x, mask = batch
        return jnp.sum(mask * (x @ w) ** 2) / count(jnp.sum(mask))

    ref = jax.value_and_grad(loss)(w, (x, mask))  # the global batch, no mapping

    def grads(fun):
        with jax.set_mesh(mesh):
            return jax.jit(lambda w, b: sr.value_and_grad(
                fun, mesh, "replica", step=0, num_skip=0)(w, b))(w, (x, mask))

    got = grads(loss)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5)
    # Written as for jax.jit, with no mean_count: the same (the count is global).
    plain = grads(lambda w, b: loss(w, b, count=lambda c: c))
    np.testing.assert_allclose(plain[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(plain[1], ref[1], rtol=1e-5)


def test_arguments_not_in_batch_argnums_are_replicated():
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
    x = jnp.arange(8.0)

    def loss(w, x, scale):
        return scale * jnp.mean(w * x)

    with jax.set_mesh(mesh):
        got = jax.jit(lambda w, x, s: sr.value_and_grad(
            loss, mesh, "replica", step=0, num_skip=0, batch_argnums=1)(w, x, s))(
            1.0, x, jnp.float32(3.0))
    ref = jax.value_and_grad(loss)(1.0, x, 3.0)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def _call(mesh, x, axis_name="replica", **options):
    def loss(w, x):
        return jnp.mean(w * x)

    with jax.set_mesh(mesh):
        return jax.jit(lambda w, x: sr.value_and_grad(
            loss, mesh, axis_name, **options)(w, x))(1.0, x)


def test_clear_errors():
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
    x = jnp.arange(8.0)
    with pytest.raises(ValueError, match=r"error_feedback=True keeps a residual per rank.*"
                       r"pass state=.*init_state"):
        _call(mesh, x, step=0, num_skip=1, error_feedback=True)
    with pytest.raises(TypeError, match=r"required keyword-only argument: 'step'"):
        _call(mesh, x, num_skip=1)
    with pytest.raises(ValueError, match=r"step must be an int scalar"):
        _call(mesh, x, step=0.5, num_skip=1)
    with pytest.raises(ValueError, match=r"must split evenly over the 4 ranks"):
        _call(mesh, jnp.arange(10.0), step=0, num_skip=1, batch_argnums=1)
    with pytest.warns(sr.NothingSkippedWarning, match=r"nothing is split"):
        value, grad = _call(mesh, jnp.arange(10.0), step=0, num_skip=1, min_size=0)  # exact
    np.testing.assert_allclose(grad, jnp.mean(jnp.arange(10.0)), rtol=1e-6)
    with pytest.raises(TypeError, match=r"unknown options \['numskip'\]"):
        _call(mesh, x, step=0, numskip=1)
    with pytest.raises(ValueError, match=r"not an axis of the mesh"):
        _call(mesh, x, step=0, num_skip=1, axis_name="data")
    with pytest.raises(ValueError, match=r"param_specs does not match the tree"):
        _call(mesh, x, step=0, num_skip=1, param_specs={"w": P()})
    with pytest.raises(ValueError, match=r"param_specs names \['model'\]"):
        _call(mesh, x, step=0, num_skip=1, param_specs=P("model"))


def test_a_param_sharded_over_the_data_axis_stays_sharded():
    """FSDP over the data axis: the grad keeps the param's layout (test_fsdp_value_and_grad)."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
    w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("replica")))
    x = jnp.arange(64.0).reshape(8, 8) / 64
    loss = lambda w, x: jnp.mean(w * x)  # noqa: E731
    with jax.set_mesh(mesh):
        value, grad = jax.jit(lambda w, x: sr.value_and_grad(
            loss, mesh, "replica", step=0, num_skip=0)(w, x))(w, x)
    ref_value, ref_grad = jax.value_and_grad(loss)(np.arange(8.0, dtype=np.float32), x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6)
    assert grad.sharding.spec == P("replica")


def test_integer_aux_is_the_global_value():
    """A count, an argmax: the global batch's, as jax.value_and_grad gives."""
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])

    def run(aux):
        loss = lambda w, x: (jnp.mean(w * x), aux(x))  # noqa: E731
        with jax.set_mesh(mesh):
            return jax.jit(lambda w, x: sr.value_and_grad(
                loss, mesh, "replica", step=0, num_skip=0, has_aux=True,
                batch_argnums=1)(w, x))(1.0, jnp.arange(8.0))

    (_, count), _ = run(lambda x: jnp.sum(x > 3))
    assert count.dtype == jnp.int32 and int(count) == 4
    (_, where), _ = run(lambda x: jnp.argmax(x).astype(jnp.int32))
    assert int(where) == 7


def test_auto_axes_without_param_specs_still_sum_n_minus_k_ranks():
    """Under Auto axes the layout is unknown in jit: the ring sees whole
    leaves (other windows than on each shard), N - k ranks each, and a
    warning names param_specs."""
    n, k = 4, 2
    mesh, _, params, _ = _layout("4x2-auto")
    rows = jnp.asarray([[2.0 ** r] for r in range(n)])
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match="Pass param_specs="):
        grads = jax.jit(lambda w, x: sr.value_and_grad(
            lambda w, x: jnp.sum(w * x[:, :, None]), mesh, "replica", step=5,
            num_skip=k, min_size=0)(w, x)[1])(params["w1"], rows)
    sr.assert_replicated(grads, mesh)
    bits = np.rint(np.asarray(grads) * (n - k)).astype(np.int64)
    assert (np.vectorize(lambda b: bin(b).count("1"))(bits) == n - k).all()


# The NNX form, in place of nnx.value_and_grad inside nnx.jit.
nnx = pytest.importorskip("flax.nnx")


class _MLP(nnx.Module):
    def __init__(self, *, norm, rngs):
        self.lin1 = nnx.Linear(6, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs) if norm else None
        self.lin2 = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        h = self.lin1(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.lin2(jax.nn.relu(h))


def _nnx_loss(model, x, y):
    per_example = jnp.mean((model(x) - y) ** 2, axis=1)
    return jnp.mean(per_example), sr.PerRank(per_example)


def _nnx_data(n=16):
    rng = np.random.default_rng(3)
    return (rng.normal(size=(n, 6)).astype(np.float32),
            rng.normal(size=(n, 3)).astype(np.float32))


def test_nnx_num_skip_zero_is_nnx_value_and_grad():
    import skipreduce_jax.nnx as srnnx

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    x, y = _nnx_data()
    model = _MLP(norm=False, rngs=nnx.Rngs(0))

    @nnx.jit
    def ref_step(model, x, y):
        return nnx.value_and_grad(_nnx_loss, has_aux=True)(model, x, y)

    @nnx.jit
    def step(model, x, y):
        return srnnx.value_and_grad(_nnx_loss, mesh, "data", step=0, has_aux=True,
                                    num_skip=0)(model, x, y)

    with jax.set_mesh(mesh):
        (loss, rows), grads = step(model, x, y)
    (ref_loss, ref_rows), ref = ref_step(model, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(rows.value, ref_rows.value, rtol=1e-6)
    assert isinstance(grads, nnx.State)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(ref)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_nnx_batchnorm_statistics_are_the_mean_of_the_ranks_and_replicas_agree():
    import skipreduce_jax.nnx as srnnx

    n = 4
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    x, y = _nnx_data()
    model = _MLP(norm=True, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)  # plain

    @nnx.jit
    def train_step(model, optimizer, x, y):
        grad_fn = srnnx.value_and_grad(_nnx_loss, mesh, "data", has_aux=True,
                                       step=optimizer.step[...],
                                       skip_ratio=0.5, min_size=0)
        (loss, _), grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        return loss

    h = np.asarray(model.lin1(jnp.asarray(x)))  # the first step's statistics
    momentum = model.norm.momentum
    with jax.set_mesh(mesh):
        for _ in range(3):
            float(train_step(model, optimizer, x, y))
    assert int(optimizer.step[...]) == 3
    sr.assert_replicated(nnx.state(model), mesh)
    sr.assert_replicated(nnx.state(optimizer), mesh)

    # One step from fresh statistics: each rank's batch mean, averaged.
    model = _MLP(norm=True, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with jax.set_mesh(mesh):
        float(train_step(model, optimizer, x, y))
    rank_means = h.reshape(n, -1, h.shape[1]).mean(1)
    np.testing.assert_allclose(np.asarray(model.norm.mean[...]),
                               (1 - momentum) * rank_means.mean(0), rtol=1e-5, atol=1e-6)


def test_nnx_batch_argnums_counts_from_the_loss_arguments():
    import skipreduce_jax.nnx as srnnx

    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    model = _MLP(norm=False, rngs=nnx.Rngs(0))
    x, y = _nnx_data()

    def loss(model, x, y, scale):
        return scale * _nnx_loss(model, x, y)[0]

    @nnx.jit
    def step(model, x, y, scale):
        return srnnx.value_and_grad(loss, mesh, "data", step=0, num_skip=0,
                                    batch_argnums=(1, 2))(model, x, y, scale)

    with jax.set_mesh(mesh):
        got, _ = step(model, x, y, jnp.float32(2.0))
    np.testing.assert_allclose(got, loss(model, x, y, 2.0), rtol=1e-6)
    with pytest.raises(ValueError, match="holds 0, the model"):
        srnnx.value_and_grad(loss, mesh, "data", step=0, num_skip=0, batch_argnums=0)


def test_hierarchical_axes_split_the_batch_over_both():
    """axis_name=(outer, inner): k = 0 is jax.value_and_grad; with k > 0
    every element sums all inner ranks of N - k outer ones."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    rows = jnp.asarray([[2.0 ** (r // 2)] for r in range(8)])  # outer rank's bit

    def loss(w, x):
        return jnp.mean(w * x[:, :, None])

    def grads(k, fun=loss):
        with jax.set_mesh(mesh):
            return jax.jit(lambda w, x: sr.value_and_grad(
                fun, mesh, ("replica", "fsdp"), step=1, num_skip=k,
                min_size=0)(w, x))(jnp.ones((4, 64)), rows)

    (value, got), ref = grads(0), jax.value_and_grad(loss)(jnp.ones((4, 64)), rows)
    np.testing.assert_allclose(value, ref[0], rtol=1e-6)
    np.testing.assert_allclose(got, ref[1], rtol=1e-6)
    _, skipped = grads(2, lambda w, x: jnp.sum(w * x[:, :, None]))  # rank's bit
    sr.assert_replicated(skipped, mesh)
    bits = np.rint(np.asarray(skipped) * 4 / 2).astype(np.int64)  # /(N-k) L, x2 inner
    assert (np.vectorize(lambda b: bin(b).count("1"))(bits) == 2).all()


def test_per_example_aux_comes_back_global():
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])

    def loss(w, x):
        return jnp.mean(w * x), w * x  # a row per example, not wrapped

    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.arange(8.0), P("replica"))  # the batch, split
        (_, rows), _ = jax.jit(lambda w, x: sr.value_and_grad(
            loss, mesh, "replica", step=0, num_skip=0, has_aux=True)(w, x))(2.0, x)
    np.testing.assert_array_equal(rows, 2.0 * jnp.arange(8.0))  # every row, in order


# The NNX adoption example's step under nnx.jit, with the one line changed.


def _digits_jit_setup(mesh, config):
    """``nnx_cnn_digits.plain_setup`` with ``srnnx.value_and_grad``: nothing else differs."""
    import nnx_cnn_digits as example

    import skipreduce_jax.nnx as srnnx

    model = example.CNN(config, axis_name=None, rngs=nnx.Rngs(config.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(config.lr), wrt=nnx.Param)
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))

    loss_fn = example.loss_fn

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, metrics, x, y):
        grad_fn = srnnx.value_and_grad(loss_fn, mesh, "data", step=optimizer.step[...],
                                       has_aux=True, skip_ratio=config.skip_ratio,
                                       min_size=0, selective=example.UNSKIPPED)
        (loss, logits), grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    return model, optimizer, train_step


def _digits_run(setup, config, mesh, steps=3):
    import nnx_cnn_digits as example

    data = example.make_data(False, mesh.size, 0)
    with jax.set_mesh(mesh):
        model, optimizer, step = setup(mesh, config)
        metrics = example.make_metrics()
        losses = []
        for rows in example.batch_indices(data, steps, config.batch_per_rank, 0):
            x, y = jax.device_put((data.x_train[rows], data.y_train[rows]),
                                  NamedSharding(mesh, P("data")))
            losses.append(float(step(model, optimizer, metrics, x, y)))
        test = example.evaluate(model, data.x_test, data.y_test)
    return model, losses, {k: float(v) for k, v in metrics.compute().items()}, test


@pytest.fixture
def nnx_example(monkeypatch):
    import pathlib

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    return pytest.importorskip("nnx_cnn_digits")


@pytest.mark.slow  # trains the NNX example's CNN twice
def test_nnx_example_step_with_one_line_changed(nnx_example):
    mesh = jax.make_mesh((8,), ("data",))
    config = nnx_example.Config(width=4, batch_per_rank=4, dropout=0.0, skip_ratio=0.0)
    model, losses, metrics, test = _digits_run(_digits_jit_setup, config, mesh)
    ref_model, ref_losses, ref_metrics, ref_test = _digits_run(
        nnx_example.plain_setup, config, mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for kind in (nnx.Param, nnx.BatchStat):
        for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model, kind)),
                        jax.tree_util.tree_leaves(nnx.state(ref_model, kind)), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert metrics == pytest.approx(ref_metrics, rel=1e-5)  # every rank's logits
    assert test == pytest.approx(ref_test, rel=1e-4)
    # Random SkipReduce with dropout: replicas stay bit-identical.
    config = nnx_example.Config(width=4, batch_per_rank=2)
    model, losses, _, _ = _digits_run(_digits_jit_setup, config, mesh)
    sr.assert_replicated(nnx.state(model), mesh)
    assert np.isfinite(losses).all()


@pytest.mark.parametrize("argnums", [0, (0,), (0, 2)])
def test_argnums_as_jax_value_and_grad(argnums):
    mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
    x = jnp.arange(8.0)

    def loss(w, x, b):
        return jnp.mean((w * x + b) ** 2)

    with jax.set_mesh(mesh):
        got = jax.jit(lambda w, x, b: sr.value_and_grad(
            loss, mesh, "replica", step=0, num_skip=0, argnums=argnums,
            batch_argnums=1)(w, x, b))(1.0, x, 0.5)
    ref = jax.value_and_grad(loss, argnums=argnums)(1.0, x, 0.5)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # A keyword argument, outside jit too: passed as jax passes it.
    with jax.set_mesh(mesh):
        got = sr.value_and_grad(loss, mesh, "replica", step=0, num_skip=0, batch_argnums=1)(
            1.0, x, b=0.5)
    ref = jax.value_and_grad(loss)(1.0, x, b=0.5)
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_train_state_and_multisteps_stay_as_written():
    """A flax TrainState with optax.MultiSteps and a metric read from its
    state: only the gradient line changes, and k = 0 is the plain step."""
    from flax.training import train_state

    mesh, _, params, batch = _layout("4x2-explicit")
    batch = tuple(jax.device_put(b, NamedSharding(mesh, P("replica"))) for b in batch)

    def loss_fn(p, b):
        return _loss(p, b)[0]

    def run(gradients):
        @jax.jit
        def step(state, batch):
            grad_fn = gradients(state)
            loss, grads = grad_fn(state.params, batch)
            state = state.apply_gradients(grads=grads)
            return state, loss, state.opt_state.gradient_step

        tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
        with jax.set_mesh(mesh):
            state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
            out = []
            for _ in range(4):
                state, loss, gradient_step = step(state, batch)
                out.append((float(loss), int(gradient_step)))
        return state, out

    plain = run(lambda state: jax.value_and_grad(_loss_on_auto(loss_fn)))
    adopted = run(lambda state: sr.value_and_grad(loss_fn, mesh, "replica", step=state.step,
                                                  num_skip=0, min_size=0))
    assert [g for _, g in adopted[1]] == [g for _, g in plain[1]] == [0, 1, 1, 2]
    np.testing.assert_allclose([v for v, _ in adopted[1]], [v for v, _ in plain[1]],
                               rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(adopted[0].params),
                    jax.tree_util.tree_leaves(plain[0].params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def _loss_on_auto(fun):
    """``fun`` with the mesh's axes Auto (a matmul over a sharded contraction
    needs an out_sharding under Explicit ones)."""
    def loss(p, b):
        return jax.sharding.auto_axes(fun, out_sharding=P())(p, b)
    return loss


@pytest.mark.parametrize("explicit", [False, True])
def test_a_python_number_param_is_differentiated(explicit):
    # Inside the caller's jit a param may be a Python number; its gradient is
    # jax.value_and_grad's, not zero (it is not traced as a constant).
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    loss = lambda w, x: jnp.mean((x * w - 1.0) ** 2)  # noqa: E731
    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    grad_fn = sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0, min_size=0)
    with jax.set_mesh(mesh):
        value, grad = jax.jit(lambda x: grad_fn(2.0, x))(x)
    want_value, want_grad = jax.value_and_grad(loss)(2.0, jnp.arange(16.0))
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


def test_a_python_value_argument_stays_a_python_value():
    # As under jax.value_and_grad in a jit: a Python flag that is neither
    # params nor batch steers Python control flow (it is not traced).
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def loss(w, x, square):
        d = x * w - 1.0
        return jnp.mean(d ** 2 if square else jnp.abs(d))

    x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
    grad_fn = sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0, min_size=0,
                                batch_argnums=1)
    for square in (True, False):
        with jax.set_mesh(mesh):
            got = jax.jit(lambda w, x, s=square: grad_fn(w, x, s))(jnp.float32(2.0), x)
        want = jax.value_and_grad(loss)(jnp.float32(2.0), jnp.arange(16.0), square)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_micro_steps_of_multisteps_draw_their_own_drops():
    """Case 8: a loop that passes one step for every micro-step of an update.

    step=opt_state of optax.MultiSteps: the micro-steps of one update (same
    gradient_step) draw different drops; the same micro-step, the same.
    """
    mesh = jax.make_mesh((8,), ("data",))
    w = np.ones(64, np.float32)
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)

    def grads(step):
        with jax.set_mesh(mesh):
            return np.asarray(jax.jit(lambda w, x, s: sr.value_and_grad(
                lambda w, x: jnp.mean((x @ w) ** 2), step=s, num_skip=4, min_size=0)(w, x))(
                    w, x, step)[1])

    state = tx.init(w)
    first = grads(state)
    second = grads(state._replace(mini_step=jnp.int32(1)))
    assert not np.allclose(first, second)
    np.testing.assert_array_equal(grads(state), first)
    # An int step that repeats repeats its drops: the reason to pass the state.
    np.testing.assert_array_equal(grads(jnp.int32(1)), grads(jnp.int32(1)))
    assert not np.allclose(grads(jnp.int32(0)), grads(jnp.int32(1)))
    with pytest.raises(ValueError, match="MultiSteps"):
        grads(jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize("kind", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_keyword_arguments_are_passed_as_jax_passes_them(kind):
    """A static flag and a split array by keyword: never differentiated, laid out as others."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    rng = np.random.default_rng(3)
    w = rng.normal(size=(4, 2)).astype(np.float32)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    mask = (rng.random(64) < 0.7).astype(np.float32)

    def loss(w, x, *, mask, train):
        err = jnp.sum((x @ w - 1.0) ** 2, axis=-1)
        scale = 2.0 if train else 1.0
        return scale * jnp.sum(mask * err) / jnp.sum(mask)

    ref = jax.value_and_grad(loss)(w, x, mask=mask, train=True)
    with jax.set_mesh(mesh):
        xs, ms = jax.device_put((x, mask), P("data"))
        got = jax.jit(lambda w, x, m: sr.value_and_grad(loss, step=0, num_skip=0, min_size=0)(
            w, x, mask=m, train=True))(w, xs, ms)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-7)


def _check_run(loss, args, split, kind=AxisType.Explicit):
    """value_and_grad with the first-step check, inside jit: its value and grads."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        placed = [jax.device_put(a, P("data")) if s else a for a, s in zip(args, split)]
        return jax.jit(lambda *a: loss(*a))(*placed)


def test_the_check_allows_16_bit_rounding(capsys):
    """A loss computing in bfloat16: the check's tolerance is bfloat16's (was: NaN)."""
    rng = np.random.default_rng(4)
    w = rng.normal(size=(6, 5)).astype(jnp.bfloat16)
    x = rng.normal(size=(64, 6)).astype(np.float32)

    def loss(p, x):
        return jnp.mean((x.astype(jnp.bfloat16) @ p) ** 2)

    value, grads = _check_run(lambda w, x: sr.value_and_grad(
        loss, step=0, num_skip=0, min_size=0, check=True)(w, x), (w, x), (False, True))
    assert np.isfinite(float(value)) and "first-step check" not in capsys.readouterr().out
    ref = jax.value_and_grad(loss)(w, x)[1]
    np.testing.assert_allclose(np.float32(grads), np.float32(ref), atol=2e-2)


def test_the_check_runs_on_a_loss_that_closes_over_the_steps_batch(capsys):
    """Explicit axes: the closed-over labels typed with the step's layout (was: a mesh error)."""
    rng = np.random.default_rng(5)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.integers(0, 5, 64).astype(np.int32)

    def step(w, x, y):
        def loss(w, x):
            return jnp.mean((x @ w)[:, 0] * y.astype(jnp.float32))
        return sr.value_and_grad(loss, step=0, num_skip=0, min_size=0, check=True)(w, x)

    value, grads = _check_run(step, (w, x, y), (False, True, True))
    ref_value, ref_grads = jax.value_and_grad(
        lambda w: jnp.mean((x @ w)[:, 0] * y.astype(jnp.float32)))(w)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-5, atol=1e-7)
    assert "first-step check" not in capsys.readouterr().out


def test_outside_jit_flags_and_strings_are_static():
    """Called eagerly with a bool and a str argument, as jax.value_and_grad takes them."""
    rng = np.random.default_rng(6)
    w = rng.normal(size=(6, 5)).astype(np.float32)
    x = rng.normal(size=(64, 6)).astype(np.float32)

    def loss(w, x, train, reduction):
        y = (x @ w) * (0.5 if train else 1.0)
        return jnp.mean(y ** 2) if reduction == "mean" else jnp.sum(y ** 2)

    mesh = jax.make_mesh((8,), ("data",))
    with jax.set_mesh(mesh):
        grad_fn = sr.value_and_grad(loss, step=0, num_skip=0, min_size=0)
        xs = jax.device_put(x, P("data"))
        for train, reduction in ((True, "mean"), (False, "sum"), (True, "mean")):
            got = grad_fn(w, xs, train, reduction)
            ref = jax.value_and_grad(loss)(w, x, train, reduction)
            np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
            np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-6)
