"""A pjit loop's code keeps its meaning under ``value_and_grad``, or is refused.

The cases a new user met adopting two flax pjit codebases: a loss closing
over the batch, a data axis of size 1 beside ``fsdp``, params sharded over
Auto axes without ``param_specs``, gradient accumulation in the step, the
mesh taken from ``jax.set_mesh``, and optax's ``MultiSteps`` left as the
user's object. Each test fails on the code before its fix.
"""

import ast
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import popcount
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8
PACKAGE = pathlib.Path(sr.__file__).parent


def _data(rows=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 16)).astype(np.float32)
    params = {"w": rng.normal(size=(16, 4)).astype(np.float32),
              "b": np.zeros(4, np.float32)}
    return params, x


def _loss(p, x):
    err = x @ p["w"] + p["b"] - 1.0
    return jnp.mean(err ** 2), {"mean_err": jnp.mean(err)}


AXIS_TYPES = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                                     ids=["auto", "explicit"])


def _mesh(axis_type=AxisType.Auto):
    return jax.make_mesh((N,), ("data",), axis_types=(axis_type,))


def _auto_mesh():
    return _mesh()


def _closure_forms(x, wt):
    """The ways a step's loss closes over its batch (x, wt)."""
    def get_loss_fn(batch):  # the LM codebase's pattern
        return lambda p: _weighted(p, *batch)

    def nested(batch):
        inner = get_loss_fn(batch)
        return lambda p: inner(p)

    return {"get_loss_fn": get_loss_fn((x, wt)),
            "in_the_step": lambda p: _weighted(p, x, wt),  # flax lm1b's
            "partial": functools.partial(_weighted, x=x, wt=wt),
            "default": lambda p, x=x, wt=wt: _weighted(p, x, wt),
            "nested": nested((x, wt))}


def _weighted(p, x, wt):
    err = jnp.sum((x @ p["w"] + p["b"] - 1.0) ** 2, axis=-1)
    return (jnp.sum(err * wt) / sr.mean_count(jnp.sum(wt)),
            {"count": jnp.sum(wt), "err": sr.PerRank(err)})


@AXIS_TYPES
@pytest.mark.parametrize("form", ["get_loss_fn", "in_the_step", "partial", "default",
                                  "nested"])
def test_a_loss_closing_over_the_batch_runs_on_each_ranks_rows(axis_type, form):
    """Before: every rank computed the whole batch, and Random 'matched'."""
    params, x = _data()
    wt = (np.random.default_rng(1).random(64) < 0.7).astype(np.float32)
    mesh = _mesh(axis_type)

    @functools.partial(jax.jit, static_argnums=3)
    def closing(p, x, wt, k):
        return sr.value_and_grad(_closure_forms(x, wt)[form], mesh, "data", step=3,
                                 has_aux=True, num_skip=k, min_size=0)(p)

    @functools.partial(jax.jit, static_argnums=3)
    def passing(p, x, wt, k):
        return sr.value_and_grad(_weighted, mesh, "data", step=3, has_aux=True,
                                 num_skip=k, min_size=0)(p, x, wt)

    with jax.set_mesh(mesh):
        x = jax.device_put(x, P("data"))
        (value, aux), grads = closing(params, x, wt, 0)
        skipped = closing(params, x, wt, 4)
        as_argument = passing(params, x, wt, 4)
    (ref, ref_aux), ref_grads = jax.value_and_grad(_weighted, has_aux=True)(
        params, np.asarray(x), wt)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    assert float(aux["count"]) == float(ref_aux["count"])
    np.testing.assert_allclose(aux["err"].value, ref_aux["err"].value, rtol=1e-5)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-6)
    # With skipping the ranks held their own rows' gradients: the drops show,
    # exactly as when the batch is passed as an argument.
    assert np.abs(np.asarray(skipped[1]["w"]) - np.asarray(grads["w"])).max() > 1e-2
    for a, b in zip(jax.tree.leaves(skipped[1]), jax.tree.leaves(as_argument[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@AXIS_TYPES
def test_a_placed_batch_closed_over_as_a_constant_is_split(axis_type):
    """A global batch the step closes over (not a jit argument) is its rows."""
    params, x = _data()
    mesh = _mesh(axis_type)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    loss = lambda p: _loss(p, x)[0]  # noqa: E731

    @functools.partial(jax.jit, static_argnums=1)
    def step(p, k):
        return sr.value_and_grad(loss, mesh, "data", step=3, num_skip=k, min_size=0)(p)

    @functools.partial(jax.jit, static_argnums=2)
    def passing(p, x, k):
        return sr.value_and_grad(lambda p, x: _loss(p, x)[0], mesh, "data", step=3,
                                 num_skip=k, min_size=0)(p, x)

    with jax.set_mesh(mesh):
        value, grads = step(params, 0)
        skipped, as_argument = step(params, 4)[1], passing(params, x, 4)[1]
    ref, ref_grads = jax.value_and_grad(lambda p: _loss(p, np.asarray(x))[0])(params)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(skipped), jax.tree.leaves(as_argument), strict=True):
        np.testing.assert_array_equal(a, b)
    assert np.abs(np.asarray(skipped["w"]) - np.asarray(grads["w"])).max() > 1e-2


class _Holder:  # not a pytree: its attribute is out of any closure's reach
    pass


def _closed_over_cases(params, x):
    """Losses holding arrays where no rule could split them: each exact anyway."""
    wt = np.linspace(0.5, 1.5, 64).astype(np.float32)
    scale = np.linspace(0.5, 1.5, 16).astype(np.float32)

    def held(p, x):
        holder = _Holder()
        holder.x = x
        return sr.value_and_grad(lambda p: _loss(p, holder.x)[0], mesh, "data",
                                 step=0, num_skip=0, min_size=0)(p)

    def weights_beside_batch(p, x):
        loss = lambda p, x: jnp.mean(jnp.sum((x @ p["w"]) ** 2, -1) * wt)  # noqa: E731
        return sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0, min_size=0)(p, x)

    def several_leading_dimensions(p, x):
        return sr.value_and_grad(lambda p: _loss(p, x * scale)[0], mesh, "data",
                                 step=0, num_skip=0, min_size=0)(p)

    mesh = _auto_mesh()
    return mesh, {
        "held": (held, lambda p: _loss(p, x)[0]),
        "weights_beside_batch": (weights_beside_batch,
                                 lambda p: jnp.mean(jnp.sum((x @ p["w"]) ** 2, -1) * wt)),
        "several_leading_dimensions": (several_leading_dimensions,
                                       lambda p: _loss(p, x * scale)[0]),
    }


@pytest.mark.parametrize("case", ["held", "weights_beside_batch", "several_leading_dimensions"])
def test_arrays_closed_over_anywhere_keep_their_meaning(case):
    """Before: refused (out of reach, a global array beside the batch, no guess)."""
    params, x = _data()
    mesh, cases = _closed_over_cases(params, x)
    step, plain = cases[case]
    with jax.set_mesh(mesh):
        value, grads = jax.jit(step)(params, jax.device_put(x, P("data")))
    ref, ref_grads = jax.value_and_grad(plain)(params)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-5)


def test_layout_code_beside_an_array_out_of_reach_on_explicit_axes():
    params, x = _data()
    mesh = _mesh(AxisType.Explicit)

    with jax.set_mesh(mesh):
        @jax.jit
        def step(p, x):
            holder = _Holder()
            holder.x = x

            def loss(p):
                y = jax.sharding.reshard(holder.x @ p["w"], P("data"))
                return jnp.mean(y ** 2)

            return sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0,
                                     min_size=0)(p)

        value, grads = step(params, jax.device_put(x, P("data")))
    ref, ref_grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-5)


def test_a_loss_with_nothing_to_split_warns_and_is_exact():
    """A host (numpy) batch closed over reaches every rank whole: not silent."""
    params, x = _data()
    mesh = _auto_mesh()

    @jax.jit
    def step(p):
        return sr.value_and_grad(lambda p: _loss(p, x)[0], mesh, "data", step=0,
                                 num_skip=4, min_size=0)(p)

    with pytest.warns(sr.NothingSkippedWarning, match=r"nothing is split"):
        value, grads = step(params)
    ref, ref_grads = jax.value_and_grad(lambda p: _loss(p, x)[0])(params)
    np.testing.assert_allclose(value, ref, rtol=1e-6)  # right, but not data-parallel
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-6)


def test_the_users_function_is_left_as_it_is():
    params, x = _data()
    mesh = _auto_mesh()
    wt = np.ones(64, np.float32)
    seen = {}

    @jax.jit
    def step(p, x, wt):
        loss = _closure_forms(x, wt)["in_the_step"]
        seen["cells"] = [c.cell_contents for c in loss.__closure__]
        out = sr.value_and_grad(loss, mesh, "data", step=0, has_aux=True, num_skip=4,
                                min_size=0)(p)
        after = [c.cell_contents for c in loss.__closure__]
        assert all(c is d for c, d in zip(after, seen["cells"], strict=True))
        assert {id(x), id(wt)} <= {id(c) for c in after}
        return out

    with jax.set_mesh(mesh):
        step(params, x, wt)


def test_a_closed_over_array_that_is_not_the_batch_is_allowed():
    params, x = _data()
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        @jax.jit
        def step(p, x, scale):
            loss = lambda p, x: _loss(p, x * scale)[0]  # noqa: E731
            return sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0,
                                     min_size=0)(p, x)

        value, grads = step(params, x, jnp.ones(16))
    ref, ref_grads = jax.value_and_grad(lambda p, x: _loss(p, x)[0])(params, x)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("param_specs", [None, P(None, "fsdp")], ids=["types", "given"])
def test_a_data_axis_of_size_one_beside_fsdp(param_specs):
    """Before: XLA's partitioner failed (RET_CHECK), at num_skip=0 too."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, N, 1),
                             ("data", "fsdp", "tensor"))
    w = jax.device_put(jnp.linspace(-1, 1, 128).reshape(16, 8),
                       NamedSharding(mesh, P(None, "fsdp")))
    x = jax.device_put(jnp.linspace(0, 2, 256).reshape(16, 16),
                       NamedSharding(mesh, P("data")))
    loss = lambda w, x: jnp.mean((x @ w - 1) ** 2)  # noqa: E731
    with jax.set_mesh(mesh):
        value, grads = jax.jit(lambda w, x: sr.value_and_grad(
            loss, mesh, "data", step=0, num_skip=0, min_size=0,
            param_specs=param_specs)(w, x))(w, x)
    ref, ref_grads = jax.value_and_grad(loss)(np.asarray(w), np.asarray(x))
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-5, atol=1e-6)


def test_hsdp_params_on_auto_axes_without_param_specs_warn():
    """Before: twice the bytes over the replica axis, without a word."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    w = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P(None, "fsdp")))
    x = jax.device_put(jnp.ones((16, 16)), NamedSharding(mesh, P("replica")))
    loss = lambda w, x: jnp.mean((x @ w - 1) ** 2)  # noqa: E731
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match=r"layout over \['fsdp'\]"):
        jax.jit(lambda w, x: sr.value_and_grad(loss, mesh, "replica", step=0,
                                               num_skip=2, min_size=0)(w, x))(w, x)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_equal_the_whole_batch_at_k0(microbatches):
    params, x = _data()
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        (value, aux), grads = jax.jit(lambda p, x: sr.value_and_grad(
            _loss, mesh, "data", step=0, has_aux=True, num_skip=0, min_size=0,
            microbatches=microbatches)(p, x))(params, x)
    (ref, _), ref_grads = jax.value_and_grad(_loss, has_aux=True)(params, x)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    assert aux["mean_err"].shape == (microbatches,)  # one entry per micro-batch
    for k in params:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


def test_microbatches_reduce_once_per_step():
    """Before: accumulating in the loop reduced every micro-step (k x the bytes)."""
    params, x = _data(128)
    mesh = _auto_mesh()
    params = {"w": np.ones((256, 64), np.float32)}
    x = np.ones((128, 256), np.float32)
    loss = lambda p, x: jnp.mean((x @ p["w"]) ** 2)  # noqa: E731

    def sent(microbatches):
        fn = jax.jit(lambda p, x: sr.value_and_grad(
            loss, mesh, "data", step=0, num_skip=4, min_size=0, check=False,
            microbatches=microbatches)(p, x))
        with jax.set_mesh(mesh):
            text = fn.lower(params, x).compile().as_text()
        return sr.collective_traffic(text).bytes_per_device()

    # The ring's bytes once; each micro-batch's global mean adds one scalar psum.
    assert sent(1) > 0
    assert 0 <= sent(4) - sent(1) <= 3 * 2 * 4


def test_microbatches_drop_other_ranks_each_step():
    """One reduction per accumulated step, its key from that step."""
    mesh = _auto_mesh()
    rows = jnp.asarray([[2.0 ** r] for r in range(N) for _ in range(2)])
    w = jnp.ones((1, 256))

    def grads(step):
        with jax.set_mesh(mesh):
            return jax.jit(lambda w, x: sr.value_and_grad(
                lambda w, x: jnp.sum(w * x), mesh, "data", step=step, num_skip=4,
                min_size=0, microbatches=2)(w, x)[1])(w, rows)

    a, b = np.asarray(grads(3)), np.asarray(grads(4))
    assert not np.array_equal(a, b)
    # Each element sums N - k ranks' rows (two micro-batches of one row each).
    assert (popcount(np.rint(a * (N - 4)).astype(np.int64)) == N - 4).all()


@AXIS_TYPES
def test_the_mesh_comes_from_set_mesh_and_the_axis_from_a_one_axis_mesh(axis_type):
    params, x = _data()
    mesh = _mesh(axis_type)
    with jax.set_mesh(mesh):
        value, _ = jax.jit(lambda p, x: sr.value_and_grad(
            lambda p, x: _loss(p, x)[0], step=0, num_skip=0, min_size=0)(p, x))(params, x)
    np.testing.assert_allclose(value, _loss(params, x)[0], rtol=1e-6)


def test_no_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="no mesh. Pass mesh=, or call the step under "
                                         "jax.set_mesh"):
        sr.value_and_grad(lambda p: p, None, "data", step=0)
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"))
    with pytest.raises(ValueError, match="no batch argument's type says which axis "
                                         "splits its rows .*pass axis_name="):
        sr.value_and_grad(lambda p, x: jnp.sum(p * x), mesh, step=0, num_skip=0)(
            jnp.ones(4), jnp.ones((8, 4)))


@pytest.mark.parametrize("spec, found", [(P("data"), "data"), (P("model"), "model"),
                                         (P(("data", "model")), None)])
def test_the_data_axis_is_read_from_the_batchs_type(spec, found):
    """Explicit axes: the one axis the batch's rows are split over."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(4, 4)).astype(np.float32), rng.normal(size=(16, 4))
    loss = lambda w, x: jnp.mean((x @ w - 1) ** 2)  # noqa: E731

    def grad_fn(axis):
        return jax.jit(lambda w, x: sr.value_and_grad(loss, axis_name=axis, step=3,
                                                      num_skip=1, min_size=0)(w, x))

    with jax.set_mesh(mesh):
        x = jax.device_put(x.astype(np.float32), spec)
        if found is None:
            with pytest.raises(ValueError, match=r"split over \['data', 'model'\]; "
                                                 "pass axis_name="):
                grad_fn(None)(w, x)
            return
        inferred, named = grad_fn(None)(w, x)[1], grad_fn(found)(w, x)[1]
        with pytest.warns(sr.NothingSkippedWarning, match="nothing is split"):
            other = grad_fn({"data": "model", "model": "data"}[found])(w, x)[1]
    np.testing.assert_array_equal(inferred, named)
    # Over the other axis the batch is whole on every rank: no drops, the exact grads.
    assert np.abs(np.asarray(inferred) - np.asarray(other)).max() > 1e-4


@pytest.mark.parametrize("every_k", [0, -1, 2.0])
def test_multisteps_refuses_an_every_k_that_never_applies(every_k):
    with pytest.raises((ValueError, TypeError), match="every_k_schedule"):
        sr.MultiSteps(optax.sgd(0.1), every_k)


def test_skip_reduce_left_in_the_chain_says_the_grads_are_reduced():
    tx = sr.skip_reduce("data", num_skip=0, min_size=0)
    grads = {"w": jnp.ones(3)}
    with pytest.raises(NameError, match="already reduced: take skip_reduce out"):
        tx.update(grads, tx.init(grads), grads)


def test_mean_count_is_global_in_a_data_parallel_step():
    """Before: a rank whose rows were all padding divided by 0 (NaN update)."""
    mesh = jax.make_mesh((N,), ("data",))
    mask = np.ones(64, np.float32)
    mask[:8] = 0.0  # rank 0: padding only
    x = np.linspace(-1, 1, 64 * 3).reshape(64, 3).astype(np.float32)

    def loss(w, x, mask):
        return jnp.sum(mask * (x @ w) ** 2) / sr.mean_count(jnp.sum(mask))

    def local_step(w, x, mask):
        return jax.lax.pmean(sr.local_grad(loss, "data")(w, x, mask), "data")

    step = sr.data_parallel(local_step, mesh, "data", batch_argnums=(1, 2))
    grads = step(sr.replicate(jnp.ones(3), mesh), *sr.shard_batch((x, mask), mesh))
    ref = jax.grad(loss)(jnp.ones(3), x, mask)
    np.testing.assert_allclose(grads, ref, rtol=1e-5)


_FOREIGN = ("jax", "flax", "optax", "chex")


def _foreign_assignments(tree):
    """Assignments to attributes of imported jax/flax/optax/chex names, or of a
    function's parameters (objects handed in), and ``setattr`` on either."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names
                         if a.name.split(".")[0] in _FOREIGN}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FOREIGN:
            imported |= {a.asname or a.name for a in node.names}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.Lambda)):
            continue
        args = fn.args
        params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        params |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        foreign = (params - {"self", "cls"}) | imported
        for node in ast.walk(fn):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for target in targets:
                base = target
                while isinstance(base, ast.Attribute):
                    base = base.value
                if (isinstance(target, ast.Attribute) and isinstance(base, ast.Name)
                        and base.id in foreign):
                    found.append((node.lineno, ast.unparse(target)))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("setattr", "delattr") and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in foreign):
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_check_finds_a_patch():
    """The scan below can fail: it finds the patterns it looks for."""
    code = ("import jax\nimport optax\n"
            "def f(tx, owner):\n    tx.update = 1\n    setattr(owner, 'x', 2)\n"
            "    jax.lax.psum = None\n")
    assert sorted(line for line, _ in _foreign_assignments(ast.parse(code))) == [4, 5, 6]


def test_no_module_assigns_to_attributes_of_what_it_did_not_make():
    """Nothing patched: no module assigns to jax, flax, optax or a user's objects."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        hits = _foreign_assignments(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(PACKAGE))] = hits
    assert not found, found


def test_per_rank_of_a_scalar_is_the_scalar():
    params, x = _data()
    mesh = _auto_mesh()
    with jax.set_mesh(mesh):
        (value, aux), _ = jax.jit(lambda p, x: sr.value_and_grad(
            lambda p, x: (_loss(p, x)[0], sr.PerRank(_loss(p, x)[0])), mesh, "data",
            step=0, has_aux=True, num_skip=0, min_size=0)(p, x))(params, x)
    np.testing.assert_array_equal(aux.value, value)


def test_a_second_call_outside_jit_compiles_nothing():
    """Before: 47 programs compiled again on an identical second call."""
    params, x = _data()
    mesh = _auto_mesh()
    compiles = []

    def listen(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    grad_fn = sr.value_and_grad(lambda p, x: _loss(p, x)[0], mesh, "data", step=0,
                                num_skip=4, min_size=0)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with jax.set_mesh(mesh):
            first = grad_fn(params, x)
            before = len(compiles)
            second = grad_fn(params, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert before > 0 and len(compiles) == before
    np.testing.assert_array_equal(first[1]["w"], second[1]["w"])


def test_make_train_step_with_multisteps_but_no_skip_reduce_names_the_fix():
    """Before: optax's 'cond branches must have equal output types'."""
    mesh = jax.make_mesh((N,), ("data",))
    params, x = _data()
    tx = sr.MultiSteps(optax.sgd(0.1), 2)
    placed = sr.replicate(params, mesh)
    state = sr.init_opt_state(tx, placed, mesh, "data")
    step = sr.make_train_step(lambda p, x: _loss(p, x)[0], tx, mesh, "data", donate=False)
    with pytest.raises(ValueError, match="holds no skip_reduce"):
        step(placed, state, sr.shard_batch(x, mesh))


@pytest.mark.parametrize("other", [((N,), ("data",)), ((4,), ("batch",))],
                         ids=["other-axis-name", "four-devices"])
def test_a_constraint_of_another_mesh_in_a_step_names_both_meshes(other):
    """Before: JAX's manual-axis errors quoting a spec of the step's making."""
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((N,), ("batch",), axis_types=auto)
    shape, names = other
    foreign = jax.make_mesh(shape, names, devices=jax.devices()[:shape[0]], axis_types=auto)
    tx = optax.chain(sr.skip_reduce("batch", num_skip=0, min_size=0), optax.sgd(0.1))

    def loss(p, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(foreign, P(names[0])))
        return jnp.mean((x @ p) ** 2)

    del tx
    step = jax.jit(sr.value_and_grad(loss, mesh, "batch", step=0, num_skip=0))
    with pytest.raises(ValueError, match="the sharding's mesh has axes .* the step's mesh"):
        step(jnp.ones((4, 2)), jnp.ones((16, 4)))


def test_nnx_value_and_grad_names_the_losss_own_argument():
    """Before: 'argument 3' for the loss's y (its argument 2), named as the batch.

    Without batch_argnums, y (60 rows, not split) is whole on every rank
    and exact; named as the batch, it is refused by its own position.
    """
    nnx = pytest.importorskip("flax.nnx")
    import skipreduce_jax.nnx as srnnx

    mesh = jax.make_mesh((N,), ("data",))
    model = nnx.Linear(6, 3, rngs=nnx.Rngs(0))
    x, y = np.ones((64, 6), np.float32), np.ones((60, 3), np.float32)

    def loss(model, x, y):
        return jnp.mean(model(x)) + jnp.mean(y)

    match = r"loss_fn's argument 2 \(the model is 0\)"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        nnx.jit(lambda m, x, y: srnnx.value_and_grad(loss, mesh, "data", step=0,
                                                     num_skip=0, batch_argnums=(1, 2))(
            m, x, y))(model, x, y)


def test_multisteps_state_from_train_state_create_names_init_opt_state():
    """Before: 'sub got incompatible shapes for broadcasting: (16,), (2,)'."""
    mesh = jax.make_mesh((N,), ("data",))
    params, x = _data()
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                   optax.sgd(0.1)), 2)
    placed = sr.replicate(params, mesh)
    state = tx.init(params)  # what TrainState.create builds
    step = sr.make_train_step(lambda p, x: _loss(p, x)[0], tx, mesh, "data", donate=False)
    with pytest.raises(ValueError, match="init_opt_state"):
        step(placed, state, sr.shard_batch(x, mesh))


@AXIS_TYPES
def test_counts_and_sums_in_aux_are_global(axis_type):
    """Before: a count in aux came back as the mean over ranks (252 for 2016)."""
    mesh = _mesh(axis_type)
    params, x = _data()
    mask = (np.arange(64) % 3 > 0)

    def loss(p, x, mask):
        err = jnp.sum((x @ p["w"] + p["b"] - 1.0) ** 2, axis=-1)
        total = jnp.sum(mask * err)
        ntokens = jnp.sum(mask)
        aux = {"ntokens": ntokens.astype(jnp.float32), "count": ntokens.astype(jnp.int32),
               "loss_sum": total, "mean_err": jnp.mean(err)}
        return total / sr.mean_count(ntokens), aux

    ref = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x, mask)
    with jax.set_mesh(mesh):
        ours = jax.jit(sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0,
                                         has_aux=True))(params, x, mask)
    (value, aux), grads = ours
    (ref_value, ref_aux), ref_grads = ref
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    assert int(aux["count"]) == int(ref_aux["count"]) == int(mask.sum())
    for k in ("ntokens", "loss_sum", "mean_err"):
        np.testing.assert_allclose(aux[k], ref_aux[k], rtol=1e-5)
    for k in grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)


@AXIS_TYPES
@pytest.mark.parametrize("microbatches", [1, 2])
def test_counts_from_the_batchs_shape_in_aux_are_global(axis_type, microbatches):
    """Before: x.shape[0] in aux came back as one rank's rows (8 for 64)."""
    mesh = _mesh(axis_type)
    params, x = _data()

    def loss(p, x):
        aux = {"rows": x.shape[0], "half": x.shape[0] / 2.0,
               "ones": jnp.sum(jnp.ones(x.shape[0])), "norm": jnp.sum(p["w"] ** 2)}
        return jnp.mean((x @ p["w"] + p["b"] - 1.0) ** 2), aux

    ref = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, x)
    with jax.set_mesh(mesh):
        (value, aux), _ = jax.jit(sr.value_and_grad(
            loss, mesh, "data", step=0, num_skip=0, has_aux=True,
            microbatches=microbatches))(params, x)
    np.testing.assert_allclose(value, ref[0][0], rtol=1e-5)
    for k in ("rows", "half", "ones"):  # each micro-batch's count: global / k
        np.testing.assert_array_equal(aux[k], np.full((microbatches,) * (microbatches > 1),
                                                      ref[0][1][k] / microbatches))
    np.testing.assert_allclose(aux["norm"], np.full(np.shape(aux["norm"]), ref[0][1]["norm"]),
                               rtol=1e-6)
    assert jnp.asarray(aux["rows"]).dtype == jnp.int32


def test_a_loss_divided_by_the_global_batch_size_is_exact():
    """Before: silently 1/N of jax.value_and_grad's value and grads."""
    mesh = _auto_mesh()
    params, x = _data()

    def loss(p, x):
        return jnp.sum((x @ p["w"] - 1.0) ** 2) / 64.0

    with jax.set_mesh(mesh):
        got = jax.jit(sr.value_and_grad(loss, mesh, "data", step=0, num_skip=0))(params, x)
    ref = jax.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[1]["w"], ref[1]["w"], rtol=1e-5, atol=1e-5)


def test_a_closed_over_table_of_the_batchs_length_is_exact():
    """Class weights as long as the batch, indexed by labels: the global meaning."""
    params, x = _data(16)
    labels = np.arange(16) % 4
    weights = np.linspace(0.5, 1.5, 16).astype(np.float32)  # per class, not per row
    mesh = _auto_mesh()

    def loss(p, x, y, table):
        return jnp.mean(table[y] * jnp.sum((x @ p["w"]) ** 2, axis=-1))

    with jax.set_mesh(mesh):
        @jax.jit
        def with_batch_arguments(p, x, y, table):
            return sr.value_and_grad(lambda p, x, y: loss(p, x, y, table), mesh, "data",
                                     step=0, num_skip=0, min_size=0)(p, x, y)

        @jax.jit
        def closing_over_all(p, x, y, table):
            return sr.value_and_grad(lambda p: loss(p, x, y, table), mesh, "data",
                                     step=0, num_skip=0, min_size=0)(p)

        ref = jax.value_and_grad(loss)(params, x, labels, weights)
        for got in (with_batch_arguments(params, x, labels, weights),
                    closing_over_all(params, x, labels, weights)):
            np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
            np.testing.assert_allclose(got[1]["w"], ref[1]["w"], rtol=1e-5, atol=1e-5)


def test_a_closed_over_raw_dropout_key_stays_whole():
    """flax's lm1b step: the batch and a uint32[2] dropout key closed over."""
    params, x = _data()
    mesh = _auto_mesh()

    def step(p, x, key, k):
        def loss(p):
            keep = jax.random.bernoulli(key, 0.9, x.shape)
            return jnp.mean((jnp.where(keep, x, 0.0) @ p["w"] - 1.0) ** 2)
        return sr.value_and_grad(loss, mesh, "data", step=0, num_skip=k, min_size=0)(p)

    key = jax.random.key_data(jax.random.fold_in(jax.random.key(0), 3))
    with jax.set_mesh(mesh):
        value, grads = jax.jit(step, static_argnums=3)(params, x, key, 0)
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    ref, ref_grads = jax.value_and_grad(
        lambda p: jnp.mean((jnp.where(keep, x, 0.0) @ p["w"] - 1.0) ** 2))(params)
    # The mask is jax.jit's global draw.
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(grads["w"], ref_grads["w"], rtol=1e-5, atol=1e-5)
