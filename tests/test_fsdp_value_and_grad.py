"""FSDP in ``sr.value_and_grad``: params sharded over the data axis stay sharded.

Each block is gathered where the loss uses it and its gradient is the
skipped reduce-scatter, so the grads come back in the params' own layouts,
ready for the user's optimizer. Checked against ``jax.value_and_grad`` on
the global arrays, and the compiled programs against XLA's own FSDP step
(plain ``jax.jit`` with the same shardings): bytes and peak memory.
"""

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SCAN3
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._ring import traffic as _traffic
from skipreduce_jax._runtime import hlo as _hlo

N, B, D, H, C = 8, 64, 16, 32, 8
RNG = np.random.default_rng(3)
PARAMS = {"w": (RNG.normal(size=(D, H)) * 0.3).astype(np.float32),
          "b": (RNG.normal(size=H) * 0.1).astype(np.float32),
          "v": (RNG.normal(size=(H, C)) * 0.3).astype(np.float32)}
# w split along its columns, v along its rows, b replicated.
SPECS = {"w": P(None, "data"), "b": P(), "v": P("data")}
X = RNG.normal(size=(B, D)).astype(np.float32)
Y = RNG.integers(0, C, size=B).astype(np.int32)
KEY = jax.random.key(5)


def xent(p, x, y):
    logits = jnp.tanh(x @ p["w"] + p["b"]) @ p["v"]
    per_example = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1)[:, 0]
    return jnp.mean(per_example) + 1e-3 * jnp.sum(p["w"] ** 2), (per_example, logits)


def with_dropout(p, x, y, key):
    h = jnp.tanh(x @ p["w"] + p["b"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    logits = jnp.where(keep, h / 0.9, 0.0) @ p["v"]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
        logits, y[:, None], 1)[:, 0]), logits


def tied(p, x, y):
    """The same block gathered twice: its two reduce-scatters add up."""
    h = jnp.tanh(x @ p["w"] + p["b"])
    back = h @ p["w"].T  # w used again, transposed
    return jnp.mean((back - x) ** 2) + jnp.mean(h @ p["v"]), back


def _mesh(kind, shape=(N,), names=("data",)):
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(names))


def _placed(mesh, tree, specs):
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs,
                        is_leaf=lambda s: isinstance(s, P))


def _run(loss, kind, *args, specs=SPECS, mesh=None, params=PARAMS, batch_spec=None,
         step=3, **options):
    mesh = mesh or _mesh(kind)
    batch_spec = batch_spec or P("data")
    options.setdefault("min_size", 0)
    if kind == AxisType.Auto:
        options.setdefault("param_specs", specs)
    with jax.set_mesh(mesh):
        p = _placed(mesh, params, specs)
        placed = [jax.device_put(a, NamedSharding(mesh, batch_spec)) if np.ndim(a) else a
                  for a in args]

        @jax.jit
        def run_step(p, *a):
            return sr.value_and_grad(loss, step=jnp.int32(step), has_aux=True, **options)(p, *a)

        return run_step(p, *placed)


def _same_layout(grads, specs):
    def strip(spec):
        spec = list(spec)
        while spec and spec[-1] is None:
            spec.pop()
        return spec
    for name, spec in specs.items():
        assert strip(grads[name].sharding.spec) == strip(spec), (name, grads[name].sharding)


def _close(a, b, tol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("loss,extra", [(xent, ()), (with_dropout, (KEY,)), (tied, ())],
                         ids=["xent", "dropout", "tied"])
def test_exact_and_in_the_params_layout(kind, loss, extra):
    (value, aux), grads = _run(loss, kind, X, Y, *extra, num_skip=0)
    (ref_value, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(
        PARAMS, X, Y, *extra)
    _close(value, ref_value)
    jax.tree.map(_close, aux, ref_aux)
    jax.tree.map(_close, grads, ref_grads)
    _same_layout(grads, SPECS)  # the grads keep the params' layouts


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_microbatches(kind):
    (value, _), grads = _run(xent, kind, X, Y, num_skip=0, microbatches=2)
    # Rank r's row i goes to micro-batch i % 2: rows r*8 + i of the global batch.
    rows = [np.concatenate([np.arange(r * 8, r * 8 + 8)[j::2] for r in range(N)])
            for j in range(2)]
    ref = [jax.value_and_grad(xent, has_aux=True)(PARAMS, X[i], Y[i]) for i in rows]
    _close(value, np.mean([r[0][0] for r in ref]))
    jax.tree.map(lambda g, a, b: _close(g, (a + b) / 2), grads, ref[0][1], ref[1][1])


def test_skipping_sums_n_minus_k_blocks_unbiased():
    """Every rank with the same rows: any N - k of N contributions give the same mean.

    This holds only if the skipped reduce-scatter hands each rank its own
    block, weighed to an unbiased mean; with rows that differ the grads change.
    """
    same = np.tile(X[:B // N], (N, 1)), np.tile(Y[:B // N], N)
    (_, _), exact = _run(xent, AxisType.Explicit, *same, num_skip=0)
    (_, _), skipped = _run(xent, AxisType.Explicit, *same, num_skip=4)
    jax.tree.map(lambda a, b: _close(a, b, 1e-5), skipped, exact)
    (_, _), exact = _run(xent, AxisType.Explicit, X, Y, num_skip=0)
    (_, _), skipped = _run(xent, AxisType.Explicit, X, Y, num_skip=4)
    for name in ("w", "v", "b"):
        assert not np.allclose(skipped[name], exact[name], atol=1e-4), name


# A deeper model for bytes and memory: 4 layers of 256 x 256, each split by rows.
DEEP = [(RNG.normal(size=(256, 256)) / 16).astype(np.float32) for _ in range(4)]
DEEP_X = RNG.normal(size=(B, 256)).astype(np.float32)


def deep_loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def _programs(**options):
    # Auto axes: XLA's own FSDP step (plain jax.jit) is the baseline; under
    # Explicit axes the loss would need out_sharding= on its contractions.
    mesh = _mesh(AxisType.Auto)
    specs = [P("data")] * len(DEEP)
    tx = optax.adamw(1e-3)
    with jax.set_mesh(mesh):
        p = _placed(mesh, DEEP, specs)
        x = jax.device_put(DEEP_X, NamedSharding(mesh, P("data")))
        opt = tx.init(p)

        def compiled(grad):
            def step(p, o, x):
                v, g = grad(p, x)
                u, o = tx.update(g, o, p)
                return optax.apply_updates(p, u), o, v
            return jax.jit(step).lower(p, opt, x).compile()

        return (compiled(jax.value_and_grad(deep_loss)),
                compiled(sr.value_and_grad(deep_loss, step=jnp.int32(3), min_size=0,
                                           param_specs=specs, **options)))


def test_bytes_follow_the_formula_and_memory_stays_fsdp():
    gathered = 4 * sum(w.size for w in DEEP)  # float32
    plain, exact = _programs(num_skip=0)
    _, skipped = _programs(skip_ratio=0.5)
    ours = _hlo.collective_traffic(exact.as_text()).by_kind()
    # The params' gathers are the layout's own, once per leaf and step; the
    # grads' reduce-scatter is the formula's.
    assert ours["all-gather"] == pytest.approx(_traffic.all_gather_bytes(gathered, N))
    assert ours["reduce-scatter"] == pytest.approx(
        _traffic.reduce_scatter_bytes(gathered, N, 0))
    assert ours.get("all-reduce", 0) < 64  # the loss's value, no gradient
    skip = _hlo.collective_traffic(skipped.as_text()).by_kind()
    assert "reduce-scatter" not in skip
    assert skip["all-gather"] == ours["all-gather"]
    assert skip["collective-permute"] == pytest.approx(
        _traffic.reduce_scatter_bytes(gathered, N, N // 2), rel=1e-3)
    fsdp_formula = (_traffic.all_gather_bytes(gathered, N)
                    + _traffic.reduce_scatter_bytes(gathered, N, 0))
    assert skip["all-gather"] + skip["collective-permute"] <= 0.75 * fsdp_formula
    # Peak memory: no whole copy of the params or grads beyond XLA's own step.
    temp = [c.memory_analysis().temp_size_in_bytes for c in (plain, exact, skipped)]
    assert max(temp[1:]) <= 1.25 * temp[0], temp


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_fsdp_with_tensor_parallel(kind):
    mesh = _mesh(kind, (4, 2), ("data", "tensor"))
    specs = {"w": P("data", "tensor"), "b": P("tensor"), "v": P("tensor", "data")}
    (value, aux), grads = _run(xent, kind, X, Y, mesh=mesh, specs=specs, num_skip=0,
                               axis_name="data")
    (ref_value, ref_aux), ref_grads = jax.value_and_grad(xent, has_aux=True)(PARAMS, X, Y)
    _close(value, ref_value)
    jax.tree.map(_close, grads, ref_grads)
    _same_layout(grads, specs)
    (_, _), skipped = _run(xent, kind, X, Y, mesh=mesh, specs=specs, num_skip=2,
                           axis_name="data")
    assert not np.allclose(skipped["w"], ref_grads["w"], atol=1e-4)


def test_hsdp_skips_over_data_only_and_over_both():
    """(data, fsdp): params sharded over fsdp; the batch over both."""
    mesh = _mesh(AxisType.Explicit, (2, 4), ("data", "fsdp"))
    specs = {"w": P(None, "fsdp"), "b": P(), "v": P("fsdp")}
    ref = jax.value_and_grad(xent, has_aux=True)(PARAMS, X, Y)
    batch = P(("data", "fsdp"))
    (value, _), grads = _run(xent, AxisType.Explicit, X, Y, mesh=mesh, specs=specs,
                             batch_spec=batch, axis_name="data", num_skip=0)
    _close(value, ref[0][0])
    jax.tree.map(_close, grads, ref[1])
    _same_layout(grads, specs)
    # Over both: params sharded over (data, fsdp), only the outer axis skips.
    both = {"w": P(None, ("data", "fsdp")), "b": P(), "v": P(("data", "fsdp"))}
    (value, _), grads = _run(xent, AxisType.Explicit, X, Y, mesh=mesh, specs=both,
                             batch_spec=batch, axis_name=("data", "fsdp"), num_skip=0)
    _close(value, ref[0][0])
    jax.tree.map(_close, grads, ref[1])
    _same_layout(grads, both)
    (_, _), skipped = _run(xent, AxisType.Explicit, X, Y, mesh=mesh, specs=both,
                           batch_spec=batch, axis_name=("data", "fsdp"), num_skip=1)
    assert not np.allclose(skipped["v"], ref[1]["v"], atol=1e-4)


def test_refused_by_name():
    mesh = _mesh(AxisType.Explicit, (2, 4), ("data", "fsdp"))
    inner_only = {"w": P(None, "fsdp"), "b": P(), "v": P("fsdp")}
    with pytest.raises(ValueError, match="exactly"):
        _run(xent, AxisType.Explicit, X, Y, mesh=mesh, specs=inner_only,
             batch_spec=P(("data", "fsdp")), axis_name=("data", "fsdp"), num_skip=0)
    with pytest.raises(ValueError, match="exact_radial=True"):
        _run(xent, AxisType.Explicit, X, Y, num_skip=2, exact_radial=True)
    with pytest.raises(ValueError, match="params_sharded=True is not an option"):
        _run(xent, AxisType.Explicit, X, Y, num_skip=2, params_sharded=True)


class Model(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(init(rngs.params(), (D, H)), out_sharding=(None, "data"))
        self.v = nnx.Param(init(rngs.params(), (H, C)), out_sharding=("data", None))
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        # As flax's gemma example writes its contractions under Explicit axes.
        h = jnp.einsum("bd,dh->bh", x, self.w, out_sharding=P("data"))
        return jnp.einsum("bh,hc->bc", self.drop(jnp.tanh(h)), self.v, out_sharding=P("data"))


def test_nnx_optimizer_keeps_its_shards():
    import skipreduce_jax.nnx as srnnx

    mesh = _mesh(AxisType.Explicit)

    def loss(model, x, y):
        logits = model(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    with jax.set_mesh(mesh):
        results = []
        for grad in (nnx.value_and_grad, lambda f: srnnx.value_and_grad(
                f, step=jnp.int32(0), num_skip=0, min_size=0)):
            model = Model(nnx.Rngs(0))
            state = nnx.state(model)
            sharded = jax.tree.map(lambda a, s: jax.reshard(a, s), state,
                                   nnx.get_partition_spec(state))
            nnx.update(model, sharded)
            opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
            x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (X, Y))

            @nnx.jit
            def step(model, opt, x, y, grad=grad):
                value, grads = grad(loss)(model, x, y)
                opt.update(model, grads)
                return value

            values = [float(step(model, opt, x, y)) for _ in range(3)]
            results.append((values, np.asarray(model.w[...])))
            assert jax.typeof(model.w[...]).sharding.spec == P(None, "data")
            mu = opt.opt_state[0].mu["w"][...]
            assert jax.typeof(mu).sharding.spec == P(None, "data")
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-4, atol=1e-5)


def test_the_guides_fsdp_block_runs(capsys):
    """docs/guides/sharded.md, "FSDP in your own jax.jit step": its code, as printed."""
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides"
            / "sharded.md").read_text()
    start = text.index("```python\n", text.index("## FSDP in your own")) + len("```python\n")
    exec(compile(text[start:text.index("```", start)], "sharded.md", "exec"), {})
    assert capsys.readouterr().out.split() == ["P(None,", "'data')", "P('data',", "None)"]


def test_nnx_on_auto_axes_reads_the_sharding_metadata():
    """Auto axes carry no layout inside jit: the params' out_sharding metadata says it."""
    import skipreduce_jax.nnx as srnnx

    mesh = _mesh(AxisType.Auto)

    def loss(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(
            jnp.tanh(x @ model.w[...]) @ model.v[...], y).mean()

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
                                       state, nnx.get_partition_spec(state)))
        grad = srnnx.value_and_grad(loss, step=jnp.int32(0), num_skip=0, min_size=0)
        step = nnx.jit(lambda m, x, y: grad(m, x, y))
        value, grads = step(model, X, Y)
        text = step.lower(model, X, Y).compile().as_text()
    (ref_value, ref_grads) = nnx.value_and_grad(loss)(model, X, Y)
    _close(value, ref_value)
    _close(grads["w"][...], ref_grads["w"][...])
    _close(grads["v"][...], ref_grads["v"][...])
    assert _hlo.collective_traffic(text).count("reduce-scatter") == 2  # w and v, as FSDP


def test_outside_jit_the_placed_params_say_their_layout():
    """Called on placed arrays outside jit (Auto axes): no param_specs needed."""
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
        p = _placed(mesh, PARAMS, SPECS)
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (X, Y))
        grad_fn = sr.value_and_grad(xent, step=0, has_aux=True, num_skip=0, min_size=0)
        (value, _), grads = grad_fn(p, x, y)
    (ref_value, _), ref_grads = jax.value_and_grad(xent, has_aux=True)(PARAMS, X, Y)
    _close(value, ref_value)
    jax.tree.map(_close, grads, ref_grads)
    _same_layout(grads, SPECS)


@jax.custom_vjp
def _clip_grad(x):
    return x


_clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))
STACK = {"stack": (RNG.normal(size=(3, D, D)) * 0.3).astype(np.float32),
         "w": (RNG.normal(size=(D, D)) * 0.3).astype(np.float32)}
STACK_SPECS = {"stack": P(None, "data"), "w": P("data")}
WHERE_USED = {
    "scan over stacked layers": lambda p, x: jnp.mean(jax.lax.scan(
        lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"])[0] @ p["w"]),
    "checkpoint": lambda p, x: jnp.mean(jax.checkpoint(lambda x: jnp.tanh(x @ p["w"]))(x) ** 2),
    "custom_vjp on the param": lambda p, x: jnp.mean(x @ _clip_grad(p["w"])),
    "cond": lambda p, x: jax.lax.cond(jnp.mean(x) > 0, lambda: jnp.mean(x @ p["w"]),
                                      lambda: jnp.mean(x @ p["w"].T)),
    "nested jit": lambda p, x: jnp.mean(jax.jit(lambda w, x: jnp.tanh(x @ w))(p["w"], x)),
    "elementwise on the param": lambda p, x: (jnp.mean(x @ (p["w"] * 2 + 1))
                                             + 1e-3 * jnp.sum(p["stack"] ** 2)),
    "the param in aux": lambda p, x: (jnp.mean(x @ p["w"]), p["w"][0]),
}


FAST = ("scan over stacked layers", "custom_vjp on the param")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in WHERE_USED])
def test_fsdp_params_used_inside_control_flow_and_rules(name):
    """Blocks gathered inside scan, checkpoint, cond, jit and custom_vjp: exact."""
    loss = WHERE_USED[name]
    aux = isinstance(jax.eval_shape(loss, STACK, X), tuple)
    mesh = _mesh(AxisType.Explicit)
    if SCAN3 and name.startswith("scan"):
        # JAX cannot differentiate its Scan3 (no vjp_fwd): refused by name.
        with jax.set_mesh(mesh), pytest.raises(ValueError, match="jax_scan3"):
            jax.jit(lambda p, x: sr.value_and_grad(loss, step=0, num_skip=0, min_size=0)(
                p, x))(_placed(mesh, STACK, STACK_SPECS), X)
        return
    ref = jax.value_and_grad(loss, has_aux=aux)(STACK, X)
    with jax.set_mesh(mesh):
        p = _placed(mesh, STACK, STACK_SPECS)
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        got = jax.jit(lambda p, x: sr.value_and_grad(
            loss, step=0, num_skip=0, has_aux=aux, min_size=0)(p, x))(p, x)
    jax.tree.map(_close, got, ref)
    _same_layout(got[1], STACK_SPECS)


@pytest.mark.parametrize("num_skip", [0, 4])
def test_the_first_step_check_passes_with_fsdp_params(num_skip, capsys):
    """check=True compares the exact step (its k=0 twin when skipping) with jax's."""
    (value, _), _ = _run(xent, AxisType.Explicit, X, Y, num_skip=num_skip, check=True, step=0)
    (ref_value, _), _ = jax.value_and_grad(xent, has_aux=True)(PARAMS, X, Y)
    _close(value, ref_value)  # not NaN: no leaf differs
    assert "first-step check" not in capsys.readouterr().err
