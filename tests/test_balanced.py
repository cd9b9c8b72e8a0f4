"""Balanced Random schedules (``skip_reduce(balanced=True)``, the default).

One key per period of L = N / gcd(N, N - k) steps; each phase moves the
windows of summed ranks N - k ranks on, so over a period every rank is summed
into every element equally often, and constant per-rank gradients average
to their exact mean.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import per_rank, sharded_updates
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


@pytest.mark.parametrize("n, k, chunks", [(8, 4, 3), (8, 2, 1), (8, 5, 2), (7, 3, 4), (4, 2, 2)])
def test_every_rank_is_summed_equally_often_over_a_period(n, k, chunks):
    period = sr.ring_period(n, k)
    assert period == n // np.gcd(n, n - k)
    key = jax.random.key(3)
    counts = sum(np.asarray(sr.make_schedule(n, num_skip=k, chunks_per_rank=chunks,
                                             key=key, phase=p).contribution_matrix())
                 for p in range(period))
    assert np.all(counts == period * (n - k) // n)
    # Each phase alone is a schedule like any other: N - k ranks per element.
    one = np.asarray(sr.make_schedule(n, num_skip=k, chunks_per_rank=chunks, key=key,
                                      phase=1).contribution_matrix())
    assert np.all(one.sum(0) == n - k)


@pytest.mark.parametrize("n, k", [(8, 4), (8, 1), (5, 2)])
def test_the_scatter_sums_every_other_rank_equally_often_over_its_period(n, k):
    period = sr.scatter_period(n, k)
    key = jax.random.key(1)
    counts = sum(np.stack([np.asarray(sr.make_scatter_schedule(
        n, num_skip=k, key=key, phase=p).contributes(r)) for r in range(n)])
        for p in range(period))
    others = counts[~np.eye(n, dtype=bool)]
    assert np.all(others == period * (n - 1 - k) // (n - 1))
    assert np.all(np.diag(counts) == period)  # the owner always


def _updates(tx, grads, steps):
    def f(g):
        state = tx.init(jnp.zeros(g.shape[-1]))
        out = []
        for _ in range(steps):
            u, state = tx.update(g, state)
            out.append(u)
        return jnp.stack(out)

    return per_rank(f, grads, n=N)[0]


@pytest.mark.parametrize("k", [4, 2])
def test_constant_non_iid_gradients_average_to_the_mean_over_each_period(k):
    grads = np.random.default_rng(0).normal(size=(N, 1 << 14)).astype(np.float32)
    grads += 3 * np.arange(N, dtype=np.float32)[:, None]  # steady deviations
    period = sr.ring_period(N, k)
    mean = grads.mean(0)
    for balanced in (True, False):
        tx = sr.skip_reduce("i", num_skip=k, min_size=0, balanced=balanced)
        u = _updates(tx, grads, 2 * period)
        error = np.abs(u.reshape(2, period, -1).mean(1) - mean).max()
        one_step = np.abs(u[0] - mean).max()
        assert one_step > 1.0  # each step drops k ranks
        if balanced:
            assert error < 1e-4, error
        else:
            assert error > 0.1, error


def test_the_scatter_averages_to_the_exact_mean_over_its_period():
    # params_sharded: rank o gets its block summed over itself and N - 1 - k
    # others, its own value weighed by the others' chance to be summed; over
    # the scatter's period each other rank is summed equally often, so the
    # average is exactly the mean (the owner does not weigh more).
    k, rows = 4, 2
    period = sr.scatter_period(N, k)
    grads = np.random.default_rng(1).normal(size=(N, N * rows, 3)).astype(np.float32)
    tx = sr.skip_reduce("data", num_skip=k, min_size=0, params_sharded=True)
    u = sharded_updates(tx, grads, jax.make_mesh((N,), ("data",)), P("data"), period)
    for o in range(N):
        block = grads[:, o * rows:(o + 1) * rows]
        np.testing.assert_allclose(u[o].mean(0), block.mean(0), rtol=1e-5, atol=1e-5)


def test_balanced_draw_gives_the_period_key_and_the_phase():
    key = jax.random.key(7)
    for step, (block, phase) in {0: (0, 0), 1: (0, 1), 5: (2, 1)}.items():
        got_key, got_phase = sr.balanced_draw(key, step, 2)
        assert int(got_phase) == phase
        np.testing.assert_array_equal(jax.random.key_data(got_key),
                                      jax.random.key_data(jax.random.fold_in(key, block)))


def test_balancing_sends_the_same_bytes():
    mesh = jax.make_mesh((N,), ("data",))
    grads = jax.ShapeDtypeStruct((N, 1 << 16), jnp.float32,
                                 sharding=NamedSharding(mesh, P("data")))
    sent = {}
    for balanced in (True, False):
        tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, balanced=balanced)
        state = tx.init(jnp.zeros(1 << 16))

        def f(g, state, tx=tx):
            return tx.update(g[0], state)[0]

        step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                     out_specs=P(), check_vma=False))
        text = step.lower(grads, state).compile().as_text()
        sent[balanced] = sr.collective_traffic(text).bytes_per_device()
    assert sent[True] == sent[False] > 0


@pytest.mark.parametrize("phase, error, match", [
    (1.5, TypeError, r"phase=1.5 must be an int"),
    (True, TypeError, r"phase=True must be an int"),
    (jnp.zeros(2, jnp.int32), TypeError, r"must be an int or an integer scalar"),
])
def test_a_bad_phase_is_refused(phase, error, match):
    with pytest.raises(error, match=match):
        sr.make_schedule(8, num_skip=2, key=jax.random.key(0), phase=phase)


def test_a_phase_that_varies_over_ranks_is_refused():
    def f(g):
        phase = jax.lax.axis_index("i")
        return sr.skip_psum(g, "i", key=jax.random.key(0), num_skip=2, phase=phase)

    with pytest.raises(ValueError, match=r"phase varies over \['i'\]"):
        per_rank(f, np.zeros((N, 64), np.float32), n=N)


def test_balanced_is_in_the_fingerprint():
    # Ranks (and checkpoints) with other drops are told apart.
    def fingerprint(**kw):
        return int(sr.skip_reduce("data", **kw).init({"w": jnp.zeros(4)}).fingerprint)

    assert fingerprint(skip_ratio=0.5, balanced=False) != fingerprint(skip_ratio=0.5)
    assert fingerprint(num_skip=3, error_feedback=True, balanced=False) != fingerprint(
        num_skip=3, error_feedback=True)


def test_large_phases_reduce_modulo_the_cycle():
    key = jax.random.key(2)
    for n, k in ((8, 4), (7, 3)):
        for phase in (2**31 + 5, 2**40 + 3, jnp.int32(2**31 - 1)):
            want = int(phase) % n
            got = sr.make_schedule(n, num_skip=k, chunks_per_rank=3, key=key, phase=phase)
            ref = sr.make_schedule(n, num_skip=k, chunks_per_rank=3, key=key, phase=want)
            np.testing.assert_array_equal(got.offsets, ref.offsets)
            got = sr.make_scatter_schedule(n, num_skip=k, key=key, phase=phase)
            ref = sr.make_scatter_schedule(n, num_skip=k, key=key, phase=int(phase) % (n - 1))
            np.testing.assert_array_equal(got.shifts, ref.shifts)


def test_the_scatter_refuses_a_bad_phase_and_balanced_draw_a_bad_period():
    with pytest.raises(TypeError, match=r"make_scatter_schedule: phase=0.5"):
        sr.make_scatter_schedule(8, num_skip=2, key=jax.random.key(0), phase=0.5)
    with pytest.raises(ValueError, match=r"period"):
        sr.balanced_draw(jax.random.key(0), 3, 0)


@pytest.mark.parametrize("traced", [False, True])
def test_the_ring_and_its_bookkeeping_agree_at_every_phase(traced):
    x = np.random.default_rng(3).normal(size=(N, 3000)).astype(np.float32)
    key = jax.random.key(5)

    def f(v):
        outs = []
        for p in range(3):
            phase = jnp.int32(p) if traced else p
            kw = dict(key=key, phase=phase, num_skip=3, chunks_per_rank=4)
            out = sr.skip_psum(v, "i", **kw)
            mask = sr.contribution_mask(v, "i", **kw)
            _, left = sr.skip_pmean_and_left_out(v, "i", **kw)
            ref = jax.lax.psum(jnp.where(mask, v, 0), "i")
            outs.append(jnp.stack([out - ref, left - jnp.where(mask, 0, v)]))
        return jnp.stack(outs)

    np.testing.assert_allclose(per_rank(f, x, n=N), 0, atol=1e-4)


def test_an_inner_axis_follows_the_phase():
    # 4 outer x 2 inner ranks, k = 2 of 4: two complementary phases sum
    # every device exactly once.
    mesh = jax.make_mesh((4, 2), ("o", "i"))
    x = np.random.default_rng(4).normal(size=(8, 512)).astype(np.float32)
    key = jax.random.key(9)

    def f(v):
        parts = [sr.skip_psum(v[0], "o", inner_axis="i", key=key, phase=p, num_skip=2)
                 for p in range(sr.ring_period(4, 2))]
        return sum(parts)

    g = jax.shard_map(f, mesh=mesh, in_specs=P(("o", "i")), out_specs=P())
    out = jax.jit(g)(jax.device_put(x, NamedSharding(mesh, P(("o", "i")))))
    np.testing.assert_allclose(np.asarray(out), x.sum(0), rtol=1e-5, atol=1e-4)


def test_balanced_periods_start_after_the_warm_up():
    # 3 warm-up steps (odd), then the first two skipped steps form a period.
    grads = np.random.default_rng(2).normal(size=(N, 4096)).astype(np.float32)
    grads += 3 * np.arange(N, dtype=np.float32)[:, None]
    tx = sr.skip_reduce("i", num_skip=4, min_size=0, warmup_steps=3)
    u = _updates(tx, grads, 5)
    np.testing.assert_allclose(u[:3], np.broadcast_to(grads.mean(0), (3, 4096)), atol=1e-4)
    assert np.abs(u[3] - grads.mean(0)).max() > 1.0
    np.testing.assert_allclose((u[3] + u[4]) / 2, grads.mean(0), atol=1e-4)
