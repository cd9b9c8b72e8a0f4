"""skipreduce_jax.MultiSteps around skip_reduce: local accumulators, one reduction per step.

A user's ``skipreduce_jax.MultiSteps(optax.chain(skip_reduce(...), ...), k)`` goes
unchanged through ``init_opt_state``, ``data_parallel``, ``make_train_step``
and ``skipreduce_jax.nnx``: each rank accumulates its local gradients in a
per-rank ``acc_grads`` and the wrapped optimizer (with the ring) runs once
per k micro-steps.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._runtime import hlo as _hlo

N, K, D = 8, 3, 64


def _loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)


def _data(micro_steps, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(size=(D, 16)).astype(np.float32) * 0.3,
              "v": rng.normal(size=(16, 4)).astype(np.float32) * 0.3}
    x = rng.normal(size=(micro_steps, rows, D)).astype(np.float32)
    y = rng.normal(size=(micro_steps, rows, 4)).astype(np.float32)
    return params, list(zip(x, y, strict=True))


def _local_step(tx):
    def step(params, opt_state, batch):
        loss, grads = sr.local_value_and_grad(_loss, "data")(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "data")
    return step


def _run(tx, params, batches, mesh):
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.data_parallel(_local_step(tx), mesh, "data", batch_argnums=2,
                            donate_argnums=(0, 1))
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    return params, opt_state, step


def _reference(inner, params, batches, k):
    """optax's own MultiSteps on one device, over the mean gradient."""
    tx = optax.MultiSteps(inner, k)
    state = tx.init(params)

    @jax.jit
    def step(p, s, batch):
        updates, s = tx.update(jax.grad(_loss)(p, batch), s, p)
        return optax.apply_updates(p, updates), s

    for batch in batches:
        params, state = step(params, state, batch)
    return params, state


def test_k0_equals_optax_multisteps_over_the_mean_gradient():
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2 * K)
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                      optax.adamw(1e-2)), K)
    got, state, _ = _run(tx, params, batches, mesh)
    want, ref_state = _reference(optax.adamw(1e-2), params, batches, K)
    for name in params:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                                   rtol=1e-5, atol=1e-6)
    # optax's state tree, field for field; the accumulator one row per rank.
    assert isinstance(state, optax.MultiStepsState)
    assert int(state.gradient_step) == int(ref_state.gradient_step) == 2
    assert int(state.mini_step) == int(ref_state.mini_step) == 0
    assert int(state.inner_opt_state[0].count) == 2  # skip_reduce ran twice
    for name in params:
        assert state.acc_grads[name].shape == (N, *params[name].shape)
        assert state.acc_grads[name].sharding.is_equivalent_to(
            NamedSharding(mesh, P("data")), 3)
    spec = sr.state_specs(state, "data")
    assert spec.acc_grads == {"w": P("data"), "v": P("data")}
    assert spec.gradient_step == P() and spec.inner_opt_state[0].count == P()


def test_make_train_step_multisteps_equals_its_microbatches():
    """k micro-steps of MultiSteps == one step of microbatches=k."""
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(K, rows=2 * N)
    chain = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), optax.sgd(0.5))
    # Rank r's rows of the whole batch, split in K pieces: micro-step j holds
    # piece j of every rank.
    whole = tuple(np.stack([b[i] for b in batches]).reshape(K, N, -1, b_dim)
                  .transpose(1, 0, 2, 3).reshape(N * K * 2, b_dim)
                  for i, b_dim in ((0, D), (1, 4)))
    placed = sr.replicate(params, mesh)
    step = sr.make_train_step(_loss, chain, mesh, "data", microbatches=K, donate=False)
    want, _, _ = step(placed, sr.init_opt_state(chain, placed, mesh, "data"), whole)
    tx = sr.MultiSteps(chain, K)
    state = sr.init_opt_state(tx, placed, mesh, "data")
    step = sr.make_train_step(_loss, tx, mesh, "data", donate=False)
    got = placed
    for batch in batches:
        got, state, _ = step(got, state, batch)
    for name in params:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]),
                                   rtol=1e-5, atol=1e-6)


def _counting(calls):
    """A transformation that counts its runs (each device's)."""
    def update(updates, state, params=None):
        jax.debug.callback(lambda: calls.append(1))
        return updates, state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_the_ring_runs_once_per_k_micro_steps():
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2 * K)
    calls = []
    tx = sr.MultiSteps(optax.chain(
        sr.skip_reduce("data", num_skip=4, min_size=0), _counting(calls),
        optax.sgd(0.1)), K)
    _, state, step = _run(tx, params, batches, mesh)
    jax.effects_barrier()
    assert len(calls) == 2 * N  # two accumulated steps, on each device
    assert int(state.inner_opt_state[0].count) == 2
    # In the compiled program every collective over the data axis but the
    # loss's sits in a branch of a conditional: the one taken on the
    # micro-step that applies the update.
    text = step.lower(sr.replicate(params, mesh), state, batches[0]).compile().as_text()
    outside, inside = _collectives_by_place(text)
    assert [line for line in outside if not _SCALAR.match(line)] == []  # the loss only
    assert any("collective-permute" in line for line in inside)
    # Its bytes are one reduction's: those of the chain without MultiSteps.
    plain = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0), optax.sgd(0.1))
    _, plain_state, plain_step = _run(plain, params, batches[:1], mesh)
    plain_text = plain_step.lower(sr.replicate(params, mesh), plain_state,
                                  batches[0]).compile().as_text()
    assert (_hlo.collective_traffic(text).bytes_per_device()
            == _hlo.collective_traffic(plain_text).bytes_per_device())


_SCALAR = re.compile(r"%?[\w.\-]+ = f32\[\] ")  # an instruction whose result is one f32


def _collectives_by_place(text):
    """Collective instructions outside any conditional branch, and inside one."""
    computations, entry = _hlo._split_computations(text)
    found = ([], [])

    def visit(name, in_branch, depth=0):
        for line in computations.get(name, []) if depth < 64 else []:
            if _hlo._ANY_COLLECTIVE.search(line):
                found[in_branch].append(line.strip())
            for _, callee in _hlo._CALLEE.findall(line):
                visit(callee, in_branch, depth + 1)
            branches = _hlo._BRANCHES.search(line)
            for callee in branches.group(1).split(",") if branches else ():
                visit(callee.strip().lstrip("%"), True, depth + 1)

    visit(entry, False)
    return found


def test_flax_train_state_reads_optax_fields():
    """A flax TrainState with MultiSteps: apply_gradients and the metrics as written."""
    train_state = pytest.importorskip("flax.training.train_state")
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2 * K)
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                      optax.sgd(0.5)), K)
    placed = sr.replicate(params, mesh)
    state = train_state.TrainState(step=0, apply_fn=None, params=placed, tx=tx,
                                   opt_state=sr.init_opt_state(tx, placed, mesh, "data"))

    def local_step(state, batch):
        grads = sr.local_grad(_loss, "data")(state.params, batch)
        state = state.apply_gradients(grads=grads)
        return state, state.opt_state.gradient_step, tx.has_updated(state.opt_state)

    step = sr.data_parallel(local_step, mesh, "data", batch_argnums=1)
    updated = []
    for batch in batches:
        state, gradient_step, has_updated = step(state, batch)
        updated.append(bool(has_updated))
    assert updated == [False, False, True] * 2 and int(gradient_step) == 2
    want, _ = _reference(optax.sgd(0.5), params, batches, K)
    for name in params:
        np.testing.assert_allclose(np.asarray(state.params[name]), np.asarray(want[name]),
                                   rtol=1e-5, atol=1e-6)


def test_random_replicas_stay_bit_identical():
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2 * K)
    tx = sr.MultiSteps(optax.chain(
        sr.skip_reduce("data", skip_ratio=0.5, min_size=0, error_feedback=True),
        optax.sgd(0.1, momentum=0.9)), K)
    got, state, _ = _run(tx, params, batches, mesh)
    sr.assert_replicated(got, mesh)
    sr.assert_replicated(state._replace(acc_grads=(), inner_opt_state=(
        state.inner_opt_state[0]._replace(residual=()), state.inner_opt_state[1:])), mesh)
    # Nested per-rank fields: the accumulator and skip_reduce's residual.
    spec = sr.state_specs(state, "data")
    assert spec.inner_opt_state[0].residual == {"w": P("data"), "v": P("data")}
    assert state.inner_opt_state[0].residual["w"].shape == (N, D, 16)
    # Each rank's accumulator is its own (reset after each applied update).
    _, more = _data(1, seed=1)
    step = sr.data_parallel(_local_step(tx), mesh, "data", batch_argnums=2)
    _, state, _ = step(got, state, more[0])
    rows = np.asarray(state.acc_grads["w"])
    assert int(state.mini_step) == 1
    assert not any(np.array_equal(rows[0], rows[r]) for r in range(1, N))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_hsdp_replica_axis_keeps_the_params_layout(axis_type):
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(axis_type,) * 2)
    specs = {"w": P(None, "fsdp"), "v": P("fsdp", None)}
    host, batches = _data(2 * K)
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in host.items()}
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("replica", num_skip=0, min_size=0),
                                      optax.adam(1e-2)), K)
    opt_state = sr.init_opt_state(tx, params, mesh, "replica")
    for k in params:  # one row per replica rank, sharded like the param
        assert opt_state.acc_grads[k].sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *specs[k])), 3), k
    step = sr.make_train_step(_loss, tx, mesh, "replica")
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    assert step._cache_size() == 1
    want, _ = _reference(optax.adam(1e-2), host, batches, K)
    for k in params:
        assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), 2), k
        assert opt_state.acc_grads[k].sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *specs[k])), 3), k
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(want[k]),
                                   rtol=1e-5, atol=1e-6)
    assert int(opt_state.gradient_step) == 2


def test_nnx_optimizer():
    nnx = pytest.importorskip("flax.nnx")
    srnnx = pytest.importorskip("skipreduce_jax.nnx")
    mesh = jax.make_mesh((N,), ("data",))
    _, batches = _data(2 * K)

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(D, 4, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def train_step(model, optimizer, batch):
        loss, grads = srnnx.local_value_and_grad(loss_fn, "data")(model, *batch)
        optimizer.update(model, grads)
        return lax.pmean(loss, "data")

    model = Model(nnx.Rngs(0))
    ref_model = Model(nnx.Rngs(0))
    reference = nnx.Optimizer(ref_model, optax.MultiSteps(optax.sgd(0.1), K), wrt=nnx.Param)
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                      optax.sgd(0.1)), K)
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data")
    step = srnnx.data_parallel(train_step, mesh, "data", batch_argnums=2)
    for batch in batches:
        step(model, optimizer, batch)
        reference.update(ref_model, nnx.grad(loss_fn)(ref_model, *batch))
    assert int(optimizer.opt_state.gradient_step[...]) == 2
    assert optimizer.opt_state.acc_grads["linear"]["kernel"][...].shape == (N, D, 4)
    np.testing.assert_allclose(np.asarray(model.linear.kernel[...]),
                               np.asarray(ref_model.linear.kernel[...]),
                               rtol=1e-5, atol=1e-6)


def test_should_skip_update_fn_skips_on_every_rank():
    """A rank's non-finite gradient skips the micro-step everywhere."""
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2)
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0),
                                      optax.sgd(0.1)), 2,
                          should_skip_update_fn=optax.skip_not_finite)
    x, y = batches[0]
    x = x.copy()
    x[5, 0] = np.nan  # rank 2's rows (2 per rank)
    placed = sr.replicate(params, mesh)
    got, state, _ = _run(tx, params, [(x, y)], mesh)
    assert int(state.mini_step) == 0 and int(state.gradient_step) == 0
    assert bool(state.skip_state["should_skip"])
    assert int(state.skip_state["num_not_finite"]) > 0
    np.testing.assert_array_equal(np.asarray(state.acc_grads["w"]), 0)
    for name in params:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(placed[name]))


def test_an_unplaced_accumulator_names_init_opt_state():
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(1)
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                      optax.sgd(0.1)), K)
    placed = sr.replicate(params, mesh)
    sr.init_opt_state(tx, placed, mesh, "data")
    step = sr.data_parallel(_local_step(tx), mesh, "data", batch_argnums=2)
    with pytest.raises(ValueError, match=re.escape("acc_grads") + ".*init_opt_state"):
        step(placed, tx.init(params), batches[0])  # one accumulator, not N rows


def test_multisteps_that_is_not_the_optimizer_itself_is_refused():
    mesh = jax.make_mesh((N,), ("data",))
    params, _ = _data(1)
    inner = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0), optax.sgd(0.1))
    for tx in (sr.MultiSteps(inner, K).gradient_transformation(),
               optax.chain(sr.MultiSteps(inner, K).gradient_transformation())):
        with pytest.raises(ValueError, match="pass the MultiSteps object"):
            sr.init_opt_state(tx, sr.replicate(params, mesh), mesh, "data")


def test_optax_multisteps_around_skip_reduce_names_the_library_class():
    """optax's own update would reduce every micro-step: refused, naming the fix."""
    mesh = jax.make_mesh((N,), ("data",))
    params, _ = _data(1)
    tx = optax.MultiSteps(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                      optax.sgd(0.1)), K)
    with pytest.raises(ValueError, match="use skipreduce_jax.MultiSteps"):
        sr.init_opt_state(tx, sr.replicate(params, mesh), mesh, "data")
    assert not vars(tx).keys() - vars(optax.MultiSteps(optax.sgd(0.1), K)).keys()


def test_multisteps_without_skip_reduce_is_left_alone():
    mesh = jax.make_mesh((N,), ("data",))
    params, _ = _data(1)
    tx = optax.MultiSteps(optax.sgd(0.1), K)
    state = sr.init_opt_state(tx, sr.replicate(params, mesh), mesh, "data")
    assert state.acc_grads["w"].shape == params["w"].shape
    assert "update" not in vars(tx)
    assert sr.state_specs(state).acc_grads == {"w": P(), "v": P()}


def test_checkpoint_resumes_mid_accumulation_bit_identically(tmp_path):
    checkpoint = pytest.importorskip("skipreduce_jax.checkpoint")
    mesh = jax.make_mesh((N,), ("data",))
    params, batches = _data(2 * K)

    def fresh():
        tx = sr.MultiSteps(optax.chain(
            sr.skip_reduce("data", num_skip=4, min_size=0, error_feedback=True),
            optax.adam(1e-2)), K)
        placed = sr.replicate(params, mesh)
        step = sr.data_parallel(_local_step(tx), mesh, "data", batch_argnums=2)
        return placed, sr.init_opt_state(tx, placed, mesh, "data"), step

    p, s, step = fresh()
    for i, batch in enumerate(batches):
        if i == K + 1:  # one micro-step into the second accumulated step
            checkpoint.save(tmp_path, i, p, s)
        p, s, _ = step(p, s, batch)
    q, fresh_state, step = fresh()
    _, q, r = checkpoint.restore(tmp_path, params_like=q, opt_state_like=fresh_state)
    assert int(r.mini_step) == 1 and np.any(np.asarray(r.acc_grads["w"]) != 0)
    for batch in batches[K + 1:]:
        q, r, _ = step(q, r, batch)
    for a, b in zip(jax.tree_util.tree_leaves((p, s)), jax.tree_util.tree_leaves((q, r)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
