"""Replica-consistency guards, settings checks, and non-finite handling."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


def _diverged(value, mesh, bad_device: int = 5, delta=1):
    """A 'replicated' array whose copy on one device differs."""
    value = np.asarray(value)
    copies = [jax.device_put(value + delta if i == bad_device else value, d)
              for i, d in enumerate(mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(
        value.shape, NamedSharding(mesh, P()), copies)


def test_assert_replicated_passes_and_catches_a_diverged_leaf():
    mesh = jax.make_mesh((N,), ("data",))
    good = sr.replicate({"a": jnp.arange(10.0), "b": jnp.ones((3, 3))}, mesh)
    sr.assert_replicated(good, mesh)
    bad = dict(good, b=_diverged(np.ones((3, 3), np.float32), mesh))
    with pytest.raises(AssertionError, match=r"\['b'\]"):
        sr.assert_replicated(bad, mesh)


def test_check_replicated_in_shard_map_sees_one_flipped_bit():
    x = np.tile(np.linspace(0, 1, 50, dtype=np.float32), (N, 1))
    x[3, 7] = np.nextafter(x[3, 7], np.float32(2))  # one ulp on one rank

    def f(v):
        return sr.check_replicated({"v": v}, "i"), sr.check_replicated(
            {"w": v[:5]}, "i")

    flipped, untouched = per_rank(f, x, n=N)
    assert not flipped.any() and untouched.all()


def _copies(good, bad, mesh, bad_device: int = 5):
    copies = [jax.device_put(bad if i == bad_device else good, d)
              for i, d in enumerate(mesh.devices.flat)]
    return jax.make_array_from_single_device_arrays(
        good.shape, NamedSharding(mesh, P()), copies)


def _ulps(x, deltas):
    bits = x.view(np.uint32).copy()
    bits[2:2 + len(deltas)] += np.array(deltas, np.int64).astype(np.uint32)
    return bits.view(np.float32)


@pytest.mark.parametrize("good, bad", [
    # Differences that cancel in plain (or position-weighted) sums of words.
    (np.zeros(1024, np.float32), np.ones(1024, np.float32)),
    (np.ones(4096, np.float32), np.full(4096, 0.5, np.float32)),
    (np.arange(1.0, 9.0, dtype=np.float32), -np.arange(1.0, 9.0, dtype=np.float32)),
    (np.arange(1.0, 9.0, dtype=np.float32),
     np.arange(1.0, 9.0, dtype=np.float32) * np.array([-1, 1, -1, 1, 1, 1, 1, 1],
                                                     np.float32)),
    (np.arange(1.0, 9.0, dtype=np.float32),
     _ulps(np.arange(1.0, 9.0, dtype=np.float32), [1, -2, 1])),
], ids=["zeros-ones", "ones-halves", "negated", "two-signs", "ulps-cancel"])
def test_assert_replicated_catches_differences_in_many_words(good, bad):
    mesh = jax.make_mesh((N,), ("data",))
    with pytest.raises(AssertionError, match=r"\['w'\]"):
        sr.assert_replicated({"w": _copies(good, bad, mesh)}, mesh)


def test_check_replicated_sees_the_high_word_of_64_bit_values():
    with jax.enable_x64(True):
        good = np.full(4, 2.0, np.float64)
        bad = good.copy()
        bad.view(np.uint64)[1] ^= np.uint64(1) << np.uint64(40)
        mesh = jax.make_mesh((N,), ("data",))
        with pytest.raises(AssertionError, match=r"\['w'\]"):
            sr.assert_replicated({"w": _copies(good, bad, mesh)}, mesh)


def test_settings_and_seed_mismatch_refused_at_start():
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", num_skip=2, min_size=0)
    params = sr.replicate({"w": jnp.zeros(16)}, mesh)
    state = sr.init_opt_state(tx, params, mesh)  # consistent: no error
    other = sr.skip_reduce("data", num_skip=3, min_size=0).init({"w": 0})
    assert int(other.fingerprint) != int(state.fingerprint)
    bad_settings = state._replace(fingerprint=_diverged(
        np.uint32(state.fingerprint), mesh, delta=np.uint32(1)))
    with pytest.raises(ValueError, match="settings .* differ"):
        sr.check_settings_agree(bad_settings, mesh)
    bad_seed = state._replace(key=_diverged(np.asarray(state.key), mesh,
                                            delta=np.uint32(1)))
    with pytest.raises(ValueError, match="seed differs"):
        sr.check_settings_agree(bad_seed, mesh)


def test_verify_sync_catches_a_desynchronized_key():
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", num_skip=2, min_size=0, verify_sync=True)
    params = sr.replicate({"w": jnp.zeros(64)}, mesh)
    state = sr.init_opt_state(tx, params, mesh)
    step = sr.make_train_step(lambda p, b: jnp.sum(p["w"] * b.sum(0)), tx,
                              mesh, donate=False)
    batch = sr.shard_batch(np.ones((N, 64), np.float32), mesh)
    params, state, _ = step(params, state, batch)  # in sync: fine
    jax.block_until_ready(params)
    bad = state._replace(key=_diverged(np.asarray(state.key), mesh,
                                       delta=np.uint32(7)))
    with pytest.raises(Exception, match=r"key \(seed\) differ across ranks"):
        jax.block_until_ready(step(params, bad, batch))
    # The good state still steps (and replaces the failed run's effect token).
    jax.block_until_ready(step(params, state, batch))


def test_nonfinite_propagates_only_where_its_rank_was_summed():
    x = np.ones((N, 4096), np.float32)
    x[2, :] = np.nan

    def f(v):
        kw = dict(key=jax.random.key(0), num_skip=3)
        return sr.skip_pmean(v, "i", **kw), sr.contribution_mask(v, "i", **kw)

    out, mask = per_rank(f, x, n=N)
    np.testing.assert_array_equal(np.isnan(out[0]), mask[2])
    assert 0 < np.isnan(out[0]).mean() < 1


def test_check_finite_spreads_nan_to_every_element_and_apply_if_finite_skips():
    x = np.ones((N, 4096), np.float32)
    x[2, 10] = np.inf
    tx = sr.skip_reduce("i", num_skip=3, min_size=0, check_finite=True)
    # apply_if_finite goes after skip_reduce: it then sees replicated values.
    guarded = optax.chain(tx, optax.apply_if_finite(optax.sgd(1.0), 3))

    def f(g, params):
        out = tx.update(g, tx.init(params))[0]
        updates, state = guarded.update(g, guarded.init(params), params)
        return out, updates, state[1].notfinite_count

    out, skipped, bad_steps = per_rank(f, x, n=N,
                                       replicated_args=(np.zeros(4096, np.float32),))
    assert np.isnan(out).all()
    np.testing.assert_array_equal(skipped, 0.0)  # the step was skipped
    assert (bad_steps == 1).all()

    clean = np.ones((N, 4096), np.float32)
    out = per_rank(lambda g: tx.update(g, tx.init(g))[0], clean, n=N)
    np.testing.assert_allclose(out, 1.0)


@pytest.mark.parametrize("check_finite", [True, False])
def test_error_feedback_never_stores_a_non_finite_residual(check_finite):
    # Three steps; rank 2's gradient holds a NaN at step 1 only. Every rank
    # keeps its residual through step 1, and step 2 is finite again.
    rng = np.random.default_rng(0)
    g = rng.normal(size=(3, N, 4096)).astype(np.float32)
    g[1, 2, 10] = np.nan
    tx = sr.skip_reduce("i", num_skip=4, min_size=0, error_feedback=True,
                        check_finite=check_finite)

    def f(grads):
        state = tx.init(grads[0])
        outs, residuals = [], []
        for step in range(3):
            out, state = tx.update(grads[step], state)
            outs.append(out)
            residuals.append(state.residual[0])
        return outs, residuals

    outs, residuals = per_rank(f, np.swapaxes(g, 0, 1), n=N)
    assert np.isfinite(outs[0]).all() and np.isfinite(outs[2]).all()
    assert not np.isfinite(outs[1]).all()
    if check_finite:
        assert np.isnan(outs[1]).all()
    assert np.abs(residuals[0]).max() > 0  # something was left out at step 0
    np.testing.assert_array_equal(residuals[1], residuals[0])
    assert np.isfinite(residuals[2]).all()
    assert not np.array_equal(residuals[2], residuals[1])


def test_error_feedback_drops_a_non_finite_value_that_skipping_left_out():
    # Static schedule, N = 8, k = 4: rank 2's value of element e is always
    # left out. A NaN there at step 1 never reaches the update, which is
    # applied; the residual must not keep it, and every other element's
    # bookkeeping stays exact (integer-valued gradients).
    kw = dict(num_skip=4, randomize=False)
    x = np.ones((N, 4096), np.float32)
    mask = per_rank(lambda g: sr.contribution_mask(g, "i", key=None, **kw), x, n=N)
    e = int(np.flatnonzero(~mask[2])[0])
    steps = 3
    g = np.random.default_rng(1).integers(-50, 50, size=(steps, N, 4096))
    g = g.astype(np.float32)
    g[1, 2, e] = np.nan
    tx = sr.skip_reduce("i", min_size=0, error_feedback=True, **kw)

    def f(grads):
        state = tx.init(grads[0])
        delivered = jnp.zeros_like(grads[0])
        for t in range(steps):
            out, state = tx.update(grads[t], state)
            delivered = delivered + out
        return delivered, state.residual[0]

    delivered, residual = per_rank(f, np.swapaxes(g, 0, 1), n=N)
    assert np.isfinite(delivered).all() and np.isfinite(residual).all()
    total = np.nan_to_num(g, nan=0.0).sum(axis=(0, 1))
    total[e] -= g[0, 2, e]  # rank 2's residual at e was swallowed by the NaN
    np.testing.assert_array_equal(delivered[0] * N + residual.sum(0), total)
