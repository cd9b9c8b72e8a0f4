"""Error feedback in a jit loop: value_and_grad with a state the loop carries.

The state is ``skip_reduce``'s, made by ``init_state`` and passed back each
step; the steps equal the optax route's (``make_train_step`` with
``skip_reduce(error_feedback=...)`` first in the chain) step by step, and a
loop resumed from a saved state is bit-identical to one that ran through.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8
RNG = np.random.default_rng(0)
# A leaf above min_size, and one below it (left out of skipping): the
# residual of the second is empty.
PARAMS = {"w": (RNG.normal(size=(16, 32)) * 0.3).astype(np.float32),
          "b": np.zeros(32, np.float32)}
X = RNG.normal(size=(64, 16)).astype(np.float32)
Y = np.sin(X @ RNG.normal(size=(16, 32))).astype(np.float32)
OPTIONS = dict(num_skip=4, min_size=100)


def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"]) + p["b"] - y) ** 2)


def _ours(mesh, steps, mode, carried=None, start=0):
    """``steps`` steps from ``carried`` (params, optimizer state, feedback state)."""
    sgd = optax.sgd(0.1, momentum=0.9)
    if carried is None:
        state = sr.value_and_grad(loss_fn, mesh, step=0, error_feedback=mode,
                                  **OPTIONS).init_state(PARAMS)
        carried = (PARAMS, sgd.init(PARAMS), state)
    params, opt_state, state = carried

    @jax.jit
    def step(params, opt_state, batch, i, state):
        grad_fn = sr.value_and_grad(loss_fn, step=i, error_feedback=mode, state=state,
                                    **OPTIONS)
        loss, grads, state = grad_fn(params, batch)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, state

    losses = []
    with jax.set_mesh(mesh):
        batch = jax.device_put((X, Y), P("data"))
        for i in range(start, start + steps):
            params, opt_state, loss, state = step(params, opt_state, batch, i, state)
            losses.append(float(loss))
    return (params, opt_state, state), losses


def _optax_route(mesh, steps, mode):
    tx = optax.chain(sr.skip_reduce("data", error_feedback=mode, **OPTIONS),
                     optax.sgd(0.1, momentum=0.9))
    params = sr.replicate(PARAMS, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    batch = sr.shard_batch((X, Y), mesh)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize("mode", [True, pytest.param("auto", marks=pytest.mark.slow)])
def test_steps_equal_the_optax_routes_with_error_feedback(mode):
    mesh = jax.make_mesh((N,), ("data",))
    (ours, _, state), our_losses = _ours(mesh, 6, mode)
    theirs, their_losses = _optax_route(mesh, 6, mode)
    np.testing.assert_allclose(our_losses, their_losses, rtol=2e-5)
    for k in PARAMS:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6)
    sr.assert_replicated(ours, mesh)
    if mode is True:
        rows = state.residual["w"]
        assert rows.shape == (N, 16, 32) and float(jnp.abs(rows).max()) > 0  # it fed back
    else:  # the gate's statistics moved (it stays shut this early, as the optax route's)
        assert state.skip.residual["w"].shape == (N, 16, 32)
        assert float(state.overshooting) < 1.0


def test_error_feedback_changes_the_steps_and_k0_is_exact():
    mesh = jax.make_mesh((N,), ("data",))
    with jax.set_mesh(mesh):
        batch = jax.device_put((X, Y), P("data"))
        plain = jax.jit(lambda p, b: sr.value_and_grad(loss_fn, step=0, num_skip=4,
                                                       min_size=100)(p, b))
        exact = jax.jit(lambda p, b, s: sr.value_and_grad(
            loss_fn, step=0, num_skip=0, min_size=100, error_feedback=True, state=s)(p, b))
        state = sr.value_and_grad(loss_fn, mesh, step=0, num_skip=0, min_size=100,
                                  error_feedback=True).init_state(PARAMS)
        value, grads, _ = exact(PARAMS, batch, state)
        skipped = plain(PARAMS, batch)[1]
    ref_value, ref_grads = jax.value_and_grad(loss_fn)(PARAMS, (X, Y))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7)
    assert not np.allclose(skipped["w"], ref_grads["w"])  # k = 4 skips at step 0


def test_a_resumed_loop_is_bit_identical():
    """Saved to host arrays and placed again after 2 steps, as a checkpoint does."""
    mesh = jax.make_mesh((N,), ("data",))
    straight, losses = _ours(mesh, 4, True)
    half, first = _ours(mesh, 2, True)
    params, opt_state, state = jax.tree_util.tree_map(np.asarray, half)
    placed = jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)),
        state, sr.state_specs(state, "data"))
    resumed, rest = _ours(mesh, 2, True, carried=(params, opt_state, placed), start=2)
    assert first + rest == losses
    for a, b in zip(jax.tree_util.tree_leaves(resumed), jax.tree_util.tree_leaves(straight),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    # The state is what made them equal: resumed with a fresh one, they part.
    fresh = sr.value_and_grad(loss_fn, mesh, step=0, error_feedback=True,
                              **OPTIONS).init_state(PARAMS)
    (forgot, _, _), _ = _ours(mesh, 2, True, carried=(params, opt_state, fresh), start=2)
    assert not np.array_equal(forgot["w"], straight[0]["w"])


def test_state_is_needed_with_error_feedback_and_refused_without_it():
    mesh = jax.make_mesh((N,), ("data",))
    state = sr.value_and_grad(loss_fn, mesh, step=0, error_feedback=True,
                              **OPTIONS).init_state(PARAMS)
    with jax.set_mesh(mesh):
        batch = jax.device_put((X, Y), P("data"))
        with pytest.raises(ValueError, match="pass state="):
            jax.jit(lambda p, b: sr.value_and_grad(
                loss_fn, step=0, error_feedback=True, **OPTIONS)(p, b))(PARAMS, batch)
        with pytest.raises(ValueError, match=r"state= is error feedback's state"):
            jax.jit(lambda p, b, s: sr.value_and_grad(
                loss_fn, step=0, state=s, **OPTIONS)(p, b))(PARAMS, batch, state)
        with pytest.raises(ValueError, match=r"FeedbackGateState"):
            jax.jit(lambda p, b, s: sr.value_and_grad(
                loss_fn, step=0, state=s, error_feedback="auto", **OPTIONS)(p, b))(
                    PARAMS, batch, state)
    with pytest.raises(ValueError, match="init_state is error feedback's state"):
        sr.value_and_grad(loss_fn, mesh, step=0, **OPTIONS).init_state(PARAMS)


def test_nnx_value_and_grad_carries_the_state():
    from flax import nnx

    import skipreduce_jax.nnx as srnnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(16, 32, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.hidden(x))

    def nnx_loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    mesh = jax.make_mesh((N,), ("data",))
    options = dict(error_feedback=True, num_skip=4, min_size=100)
    with jax.set_mesh(mesh):
        model = MLP(nnx.Rngs(0))
        state = srnnx.value_and_grad(nnx_loss, step=0, **options).init_state(model)
        x, y = jax.device_put((X, Y), P("data"))

        @nnx.jit
        def step(model, x, y, state, i):
            return srnnx.value_and_grad(nnx_loss, step=i, state=state, **options)(model, x, y)

        loss, grads, state = step(model, x, y, state, 0)
        ref_loss, ref_grads = nnx.value_and_grad(nnx_loss)(model, X, Y)
        k0 = {**options, "num_skip": 0}
        fresh = srnnx.value_and_grad(nnx_loss, step=0, **k0).init_state(model)
        exact = srnnx.value_and_grad(nnx_loss, step=0, state=fresh, **k0)
        _, k0_grads, _ = nnx.jit(exact)(model, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(k0_grads["hidden"]["kernel"][...],
                               ref_grads["hidden"]["kernel"][...], rtol=1e-5, atol=1e-7)
    assert not np.allclose(grads["hidden"]["kernel"][...], ref_grads["hidden"]["kernel"][...])
    assert float(jnp.abs(state.residual["hidden"]["kernel"][...]).max()) > 0


@pytest.mark.slow
def test_auto_with_its_gate_open_is_error_feedback():
    """The gate opened (as after some steps of SGD): each step is error_feedback=True's."""
    mesh = jax.make_mesh((N,), ("data",))
    gated = sr.value_and_grad(loss_fn, mesh, step=0, error_feedback="auto",
                              **OPTIONS).init_state(PARAMS)
    gated = gated._replace(overshooting=jnp.zeros_like(gated.overshooting),
                           nonlinear=jnp.zeros_like(gated.nonlinear))
    sgd = optax.sgd(0.1, momentum=0.9)
    (auto, _, _), auto_losses = _ours(mesh, 3, "auto", carried=(PARAMS, sgd.init(PARAMS), gated))
    (fed, _, _), fed_losses = _ours(mesh, 3, True)
    np.testing.assert_allclose(auto_losses, fed_losses, rtol=1e-6)
    for k in PARAMS:
        np.testing.assert_allclose(auto[k], fed[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", [True, "auto"])
def test_error_feedback_under_multisteps_with_a_leaf_left_out(mode):
    """sr.MultiSteps around skip_reduce(error_feedback=...), a bias under min_size."""
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.MultiSteps(optax.chain(sr.skip_reduce("data", error_feedback=mode, **OPTIONS),
                                   optax.sgd(0.1)), 2)
    params = sr.replicate(PARAMS, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    batch = sr.shard_batch((X, Y), mesh)
    losses = []
    for _ in range(4):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    sr.assert_replicated(params, mesh)
    assert int(opt_state.gradient_step) == 2 and losses[2] < losses[0]


@pytest.mark.parametrize("mode", [True, "auto"])
def test_the_first_step_check_runs_with_error_feedback(mode, capsys):
    """check=True compares the step's k=0 twin, without feedback, with jax's."""
    mesh = jax.make_mesh((N,), ("data",))
    state = sr.value_and_grad(loss_fn, mesh, step=0, error_feedback=mode,
                              **OPTIONS).init_state(PARAMS)
    with jax.set_mesh(mesh):
        batch = jax.device_put((X, Y), P("data"))
        value, _, state = jax.jit(lambda p, b, s: sr.value_and_grad(
            loss_fn, step=0, error_feedback=mode, state=s, check=True, **OPTIONS)(p, b))(
                PARAMS, batch, state)
    np.testing.assert_allclose(value, jax.value_and_grad(loss_fn)(PARAMS, (X, Y))[0],
                               rtol=1e-6)
    assert "first-step check" not in capsys.readouterr().out
