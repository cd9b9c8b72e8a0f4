"""skip_reduce(control_variate=...): per-rank deviations that sum to zero,
subtracted before the ring, so that skipping a non-IID rank costs only the
change in its deviation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N, K, SIZE = 8, 4, 1000


def _run(tx, grads, *, seed=0):
    """``grads[t, r]`` per step and rank; each step's output, deviations and
    the reference mean over the summed ranks of ``g - deviation``."""
    def f(g, params):
        def body(state, step):
            t, g_t = step
            rows = not isinstance(state.deviation, optax.EmptyState)
            c = state.deviation[0] if rows else jnp.zeros_like(params)
            sent = g_t - c
            key, phase = sr.balanced_draw(jax.random.key(seed), t, sr.ring_period(N, K))
            summed = sr.contribution_mask(sent, "i", key=key, phase=phase, num_skip=K)
            ref = lax.psum(jnp.where(summed, sent, 0), "i") / (N - K)
            out, state = tx.update(g_t, state)
            return state, (out, state.deviation[0] if rows else c, ref)

        steps = jnp.arange(g.shape[0])
        return lax.scan(body, tx.init(params), (steps, g))[1]

    return per_rank(f, np.moveaxis(grads, 1, 0), n=N,
                    replicated_args=(np.zeros(SIZE, np.float32),))


def _non_iid(steps, *, seed=0, noise=0.1):
    """Each rank's gradient: a large rank-specific offset plus small noise."""
    rng = np.random.default_rng(seed)
    offset = rng.normal(size=(1, N, SIZE)) * 3.0
    return (offset + noise * rng.normal(size=(steps, N, SIZE))).astype(np.float32)


def test_the_mean_is_over_the_summed_ranks_of_gradient_less_deviation():
    grads = _non_iid(6)
    tx = sr.skip_reduce("i", num_skip=K, min_size=0, control_variate=0.5)
    outs, devs, refs = _run(tx, grads)
    np.testing.assert_allclose(outs, refs, rtol=1e-5, atol=1e-5)
    # The deviations are per rank and sum to zero over the ranks.
    assert not np.allclose(devs[:, -1, 0], devs[:, -1, 1])
    np.testing.assert_allclose(devs[:, -1].sum(0), 0.0, atol=1e-4)
    for r in range(1, N):  # the update is the same on every rank
        np.testing.assert_array_equal(outs[r], outs[0])


def test_constant_non_iid_gradients_reach_the_exact_mean():
    # Skipping half the ranks of gradients that differ by rank: plain Random
    # stays off by about the offsets' spread every step; with control
    # variates the deviations learn the offsets and the error vanishes.
    grads = _non_iid(40, noise=0.0)
    mean = grads[0].mean(0)
    errors = {}
    for rate in (None, 0.5):
        tx = sr.skip_reduce("i", num_skip=K, min_size=0, control_variate=rate)
        outs = _run(tx, grads)[0][0]
        errors[rate] = np.abs(outs - mean).max(axis=1)
    assert errors[None][-5:].min() > 0.5
    assert errors[0.5][0] == pytest.approx(errors[None][0])  # deviations start at 0
    assert errors[0.5][-1] < 0.01 * errors[None][-5:].min()


def test_no_skip_and_warmup_give_the_exact_mean_and_train_the_deviations():
    grads = _non_iid(4)
    for kw in (dict(num_skip=0), dict(num_skip=K, warmup_steps=4)):
        tx = sr.skip_reduce("i", min_size=0, control_variate=0.5, **kw)
        outs, devs, _ = _run(tx, grads)
        np.testing.assert_allclose(outs[0], grads.mean(1), rtol=1e-5, atol=1e-5)
        # Every rank is summed: each deviation moves halfway to g_r - mean.
        np.testing.assert_allclose(devs[:, 0], 0.5 * (grads[0] - grads[0].mean(0)),
                                   rtol=1e-4, atol=1e-4)


def test_a_non_iid_least_squares_problem_converges_only_with_control_variates():
    # Rank r fits its own target; the optimum is their mean. Full-batch
    # gradients, SGD: plain Random jitters around it at a floor set by the
    # ranks' spread, control variates converge.
    mesh = jax.make_mesh((N,), ("data",))
    targets = np.random.default_rng(1).normal(size=(N, 256)).astype(np.float32) * 2
    optimum = targets.mean(0)

    def loss(params, target):
        return 0.5 * jnp.sum((params["w"] - target[0]) ** 2)

    distance = {}
    for rate in (None, 0.5):
        tx = optax.chain(sr.skip_reduce("data", num_skip=K, min_size=0,
                                        control_variate=rate), optax.sgd(0.3))
        params = sr.replicate({"w": jnp.zeros(256)}, mesh)
        opt_state = sr.init_opt_state(tx, params, mesh, "data")
        step = sr.make_train_step(loss, tx, mesh, "data")
        batch = sr.shard_batch(targets, mesh, "data")
        for t in range(80):
            params, opt_state, value = step(params, opt_state, batch)
            if t % 10 == 9:  # CPU collectives time out with too many queued
                float(value)
        distance[rate] = float(np.abs(np.asarray(params["w"]) - optimum).max())
    assert distance[None] > 0.1
    assert distance[0.5] < 1e-3


@pytest.mark.parametrize("kw, match", [
    (dict(control_variate=0.0), r"control_variate must be > 0"),
    (dict(control_variate=1.5), r"control_variate must be <= 1"),
    (dict(control_variate=0.5, error_feedback=True), r"pass error_feedback=False"),
    (dict(control_variate=0.5, params_sharded=True), r"pass params_sharded=False"),
    (dict(control_variate=0.5, normalize="world"), r"normalize='contributors'"),
])
def test_bad_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        sr.skip_reduce("i", num_skip=1, **kw)
    with pytest.raises(TypeError, match="control_variate must be a real number"):
        sr.skip_reduce("i", num_skip=1, control_variate=True)


def test_no_extra_bytes_in_the_compiled_step():
    mesh = jax.make_mesh((N,), ("data",))
    params = {"k": jnp.zeros((64, 1024))}
    grads = {"k": jax.ShapeDtypeStruct((N, 64, 1024), jnp.float32,
                                       sharding=NamedSharding(mesh, P("data")))}
    sent = {}
    for rate in (None, 0.2):
        tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, control_variate=rate)
        state = sr.init_opt_state(tx, params, mesh, "data")
        specs = sr.state_specs(state, "data")

        def f(g, state, tx=tx):
            return tx.update(jax.tree_util.tree_map(lambda x: x[0], g), state, params)

        step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), specs),
                                     out_specs=(P(), specs)))
        text = step.lower(grads, state).compile().as_text()
        sent[rate] = sr.collective_traffic(text).bytes_per_device()
    assert sent[0.2] == pytest.approx(sent[None])
    assert sent[None] == pytest.approx(sr.comm_stats(params, N, skip_ratio=0.5,
                                                     min_size=0).bytes_per_device)


def test_exact_radial_stays_exact_with_control_variates():
    w = np.asarray(jax.random.normal(jax.random.key(2), (64, 8)))
    grads = _non_iid(3)[..., :512].reshape(3, N, 64, 8)
    tx = sr.skip_reduce("i", num_skip=K, min_size=0, control_variate=0.1,
                        exact_radial=True)

    def f(g, w):
        state, along, exact = tx.init(w), [], []
        for t in range(g.shape[0]):
            out, state = tx.update(g[t], state, w)
            along.append(jnp.sum(out * w, axis=0))
            exact.append(lax.pmean(jnp.sum(g[t] * w, axis=0), "i"))
        return jnp.stack(along), jnp.stack(exact), state.deviation[0]

    along, exact, devs = per_rank(f, np.moveaxis(grads, 1, 0), n=N,
                                  replicated_args=(w,))
    np.testing.assert_allclose(along, exact, rtol=1e-4, atol=1e-4)
    assert np.abs(devs).max() > 0.1  # the deviations were on


def test_a_non_finite_update_leaves_the_deviations_as_they_were():
    grads = _non_iid(3)
    grads[2, 5, 7] = np.nan  # rank 5, step 2
    tx = sr.skip_reduce("i", num_skip=K, min_size=0, control_variate=0.5,
                        check_finite=True)
    outs, devs, _ = _run(tx, grads)
    assert np.isnan(outs[:, 2]).all() and np.isfinite(outs[:, :2]).all()
    np.testing.assert_array_equal(devs[:, 2], devs[:, 1])
    assert np.isfinite(devs).all()
