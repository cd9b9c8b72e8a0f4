"""skip_reduce(monitor=True): the rank-deviation estimate, read from the update
and the schedule alone, and the training helpers' NonIIDWarning.

The monitor measures what the paper's schedule loses (``balanced=False``);
balanced schedules take that error out over each period and keep no monitor."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax import _monitor

N, K, SIZE, STEPS = 8, 4, 1 << 16, 300


def _gradients(deviation, noise, *, seed=0):
    """Per-rank gradients of ``STEPS`` steps: a mean, a steady deviation per
    rank (``deviation`` times a unit-variance vector, summing to zero over
    the ranks) and fresh noise."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=SIZE).astype(np.float32)
    dev = rng.normal(size=(N, SIZE))
    dev = (deviation * (dev - dev.mean(0))).astype(np.float32)

    def grads(t):
        key = jax.random.fold_in(jax.random.key(seed), t)
        return mean + dev + noise * jax.random.normal(key, (N, SIZE))

    return jnp.asarray(mean), grads


def _train(tx, deviation, noise, *, steps=STEPS, seed=0):
    """Runs ``tx`` for ``steps`` steps; returns the final state and the
    measured ratio: the skipped mean's squared error from the steady
    deviations over its squared norm (both averaged over the last half)."""
    mean, grads = _gradients(deviation, 0.0, seed=seed)
    _, noisy = _gradients(deviation, noise, seed=seed)

    def f(rank):
        def body(carry, t):
            state, err, norm = carry
            g = noisy(t)[rank[0]]
            clean = grads(t)[rank[0]]
            u, state = tx.update(g, state)
            # The error the steady deviations alone cause: the same schedule
            # applied to the noiseless gradients.
            key = jax.random.fold_in(jax.random.key(0), t)
            summed = sr.contribution_mask(clean, "i", key=key, num_skip=K)
            skipped = jax.lax.psum(jnp.where(summed, clean, 0), "i") / (N - K)
            late = t >= steps // 2
            err = err + jnp.where(late, jnp.sum((skipped - mean) ** 2), 0)
            norm = norm + jnp.where(late, jnp.sum(u**2), 0)
            return (state, err, norm), None

        start = (tx.init(jnp.zeros(SIZE)), jnp.float32(0), jnp.float32(0))
        (state, err, norm), _ = jax.lax.scan(body, start, jnp.arange(steps))
        return jax.tree_util.tree_map(lambda x: x[None], (state.monitor, err / norm))

    monitor, measured = per_rank(lambda r: jax.tree_util.tree_map(lambda x: x[0], f(r)),
                                 np.arange(N, dtype=np.int32)[:, None], n=N)
    return _monitor.MonitorState(*[np.asarray(x[0]) for x in monitor]), float(measured[0])


def _tx(**kw):
    return sr.skip_reduce("i", num_skip=K, min_size=0, **{"balanced": False, **kw})


@pytest.mark.parametrize("deviation", [0.5, 1.0])
def test_the_ratio_is_the_skipped_error_of_steady_deviations(deviation):
    monitor, measured = _train(_tx(), deviation, noise=0.5)
    assert measured > 0.01
    assert float(monitor.ratio) == pytest.approx(measured, rel=0.25)
    assert int(monitor.steps) == STEPS


def test_iid_ranks_read_near_zero():
    monitor, measured = _train(_tx(), 0.0, noise=1.0)
    assert measured == 0.0
    assert 0.0 <= float(monitor.ratio) < 0.005


def test_control_variates_bring_the_ratio_down():
    plain, _ = _train(_tx(), 1.0, noise=0.5)
    cv, _ = _train(_tx(control_variate=0.1), 1.0, noise=0.5)
    assert float(plain.ratio) > _monitor.WARN_RATIO
    assert float(cv.ratio) < 0.1 * float(plain.ratio)


def test_no_ratio_before_min_steps_or_without_monitor():
    assert sr.rank_deviation(_tx().init(jnp.zeros(4))) is None
    for kw in (dict(monitor=False), dict(balanced=True), dict(randomize=False),
               dict(error_feedback=True), dict(params_sharded=True)):
        assert isinstance(_tx(**kw).init(jnp.zeros(4)).monitor, optax.EmptyState), kw
    monitor, _ = _train(_tx(), 1.0, noise=0.5, steps=_monitor.MIN_STEPS - 1)
    assert np.isnan(monitor.ratio)
    assert sr.rank_deviation(monitor) is None


def test_warm_up_and_non_finite_updates_leave_the_monitor_as_it_was():
    tx = _tx(warmup_steps=3)

    def f(g):
        state = tx.init(jnp.zeros(SIZE))
        for _ in range(3):
            _, state = tx.update(g, state)
        warm = state.monitor.steps
        _, state = tx.update(g, state)
        _, bad = tx.update(g.at[0].set(jnp.nan), state)
        return (jnp.stack([warm, state.monitor.steps, bad.monitor.steps]),
                jnp.all(bad.monitor.sketch == state.monitor.sketch))

    g = np.random.default_rng(0).normal(size=(N, SIZE)).astype(np.float32)
    steps, same = per_rank(f, g, n=N)
    assert steps[0].tolist() == [0, 1, 1]
    assert bool(same[0])


def test_the_monitor_sends_no_bytes():
    mesh = jax.make_mesh((N,), ("data",))
    params = {"k": jnp.zeros((64, 1024))}
    grads = {"k": jax.ShapeDtypeStruct((N, 64, 1024), jnp.float32,
                                       sharding=NamedSharding(mesh, P("data")))}
    sent = {}
    for monitor in (False, True):
        tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, monitor=monitor,
                            balanced=False)
        state = tx.init(params)

        def f(g, state, tx=tx):
            return tx.update(jax.tree_util.tree_map(lambda x: x[0], g), state)

        step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                     out_specs=(P(), P())))
        text = step.lower(grads, state).compile().as_text()
        sent[monitor] = sr.collective_traffic(text).bytes_per_device()
    assert sent[True] == sent[False]
    assert sent[False] == pytest.approx(sr.comm_stats(params, N, skip_ratio=0.5,
                                                      min_size=0).bytes_per_device)


def _least_squares(non_iid):
    """A linear regression; non-IID: each rank's loss also has its own
    linear term (as a label skew gives), summing to zero over the ranks."""
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(256, 16)).astype(np.float32)
    skew = rng.normal(size=(N, 1, 256, 16)).astype(np.float32)
    skew = 2.0 * (skew - skew.mean(0)) * non_iid

    def batch(t):
        x = rng.normal(size=(N * 32, 256)).astype(np.float32)
        return x, x @ w_true, skew

    return batch


@pytest.mark.parametrize("non_iid", [False, True])
def test_the_training_step_warns_once_on_non_iid_ranks(non_iid):
    mesh = jax.make_mesh((N,), ("data",))

    def loss(params, b):
        x, y, skew = b
        return jnp.mean((x @ params["w"] - y) ** 2) + jnp.sum(skew[0] * params["w"])

    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0, balanced=False),
                     optax.sgd(0.01))
    params = sr.replicate({"w": jnp.zeros((256, 16))}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss, tx, mesh)
    batch = _least_squares(non_iid)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(251):
            params, opt_state, value = step(params, opt_state, batch(t))
            float(value)  # the state is ready when the next step looks
    ratio = sr.rank_deviation(opt_state)
    found = [w for w in caught if issubclass(w.category, sr.NonIIDWarning)]
    assert not [w for w in caught if w not in found]
    if non_iid:
        assert ratio > _monitor.WARN_RATIO
        assert len(found) == 1
        assert "control_variate=0.1" in str(found[0].message)
    else:
        assert ratio < _monitor.WARN_RATIO / 5
        assert not found


def test_the_nnx_step_reads_the_monitor_out_of_its_variables():
    nnx = pytest.importorskip("flax.nnx")
    srnnx = pytest.importorskip("skipreduce_jax.nnx")
    mesh = jax.make_mesh((N,), ("data",))
    model = nnx.Linear(256, 16, rngs=nnx.Rngs(0))
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0, balanced=False),
                     optax.sgd(0.01))
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data")
    batch = _least_squares(True)

    def train_step(model, optimizer, b):
        x, y, skew = b
        loss = lambda m: (jnp.mean((m(x) - y) ** 2)  # noqa: E731
                          + jnp.sum(skew[0] * m.kernel[...]))
        value, grads = srnnx.local_value_and_grad(loss, "data")(model)
        optimizer.update(model, grads)
        return jax.lax.pmean(value, "data")

    step = srnnx.data_parallel(train_step, mesh, batch_argnums=2)
    with pytest.warns(sr.NonIIDWarning, match="control_variate=0.1"):
        for t in range(251):
            float(step(model, optimizer, batch(t)))
    assert sr.rank_deviation(optimizer.opt_state) > _monitor.WARN_RATIO


@pytest.mark.parametrize("kw", [{}, dict(control_variate=0.1, warmup_steps=2)])
def test_the_monitor_never_changes_the_update(kw):
    grads = np.random.default_rng(0).normal(size=(6, N, 4096)).astype(np.float32)

    def f(g):
        out = []
        for monitor in (False, True):
            tx = _tx(monitor=monitor, **kw)
            state = tx.init(jnp.zeros(4096))
            for t in range(6):
                u, state = tx.update(g[t], state)
            out.append(u)
        return jnp.stack(out)

    outs = per_rank(f, np.moveaxis(grads, 1, 0), n=N)
    np.testing.assert_array_equal(outs[:, 1], outs[:, 0])
