"""Property tests (hypothesis): the SkipReduce invariants on random inputs.

Each example draws a pytree (shapes include scalars and empty leaves; dtypes
float32, bfloat16 and float16), an axis size N in 2..8 (a mesh over the
first N devices), k in [0, N - 1], ``chunks_per_rank``, ``randomize``,
``gather``, ``accumulate_dtype`` and ``bucket_bytes``, and checks on one
compiled program that

* every element of ``skip_psum`` sums exactly N - k ranks, a cyclic run of
  ranks on the ring, and ``contribution_mask`` names exactly those ranks;
* every rank gets the same bits;
* with k = 0, ``skip_psum`` equals ``lax.psum`` bit for bit.

Exactness: rank r holds 2**r, so a sum names its contributors in its bits.
Every partial sum of the ring is a sum of distinct powers of two below
2**N <= 2**8, an integer of at most 8 significant bits: exact in bfloat16
(8-bit significand), float16 (11) and float32 (24). The k = 0 check sums
integers in [-16, 16] over at most 8 ranks (|partial sums| <= 128, also
exact in all three dtypes), so ``psum`` and the ring must agree exactly
whatever the order of additions.

Compilation dominates (one program per example), so examples are few and
shapes small; the file runs in well under a minute on 8 CPU devices.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import per_rank, popcount
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import skipreduce_jax as sr

DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
COLLECTIVE_EXAMPLES = 30
SCHEDULE_EXAMPLES = 40

_settings = dict(deadline=None, database=None, derandomize=True,
                 suppress_health_check=(HealthCheck.too_slow,
                                        HealthCheck.data_too_large))

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple) | \
    st.sampled_from([(), (0,), (3, 0, 2), (37,), (5, 11)])
leaf_specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)),
                      min_size=1, max_size=5)


def _tree(specs: list, make) -> Any:
    """A nested pytree (dict, list, tuple) of leaves made by ``make``."""
    leaves = [make(shape, dtype) for shape, dtype in specs]
    half = len(leaves) // 2
    return {"a": leaves[:half], "b": {"c": tuple(leaves[half:])}}


def _cyclic_run(ranks: np.ndarray, n: int) -> bool:
    """True if the set ``ranks`` is empty or {s, s+1, ..., s+len-1} mod n."""
    ranks = set(int(r) for r in ranks)
    if not ranks:
        return True
    return any({(s + i) % n for i in range(len(ranks))} == ranks for s in ranks)


@pytest.mark.slow
@settings(max_examples=COLLECTIVE_EXAMPLES, **_settings)
@given(specs=leaf_specs, data=st.data(), n=st.integers(2, 8),
       chunks=st.sampled_from([None, 1, 2, 3, 8]), randomize=st.booleans(),
       gather=st.sampled_from(["native", "ring"]),
       accumulate=st.sampled_from([None, jnp.float32]),
       bucket_bytes=st.sampled_from([64, 256, sr.DEFAULT_BUCKET_BYTES]),
       seed=st.integers(0, 2**31 - 1))
def test_contributors_replicas_and_psum(specs, data, n, chunks, randomize,
                                        gather, accumulate, bucket_bytes, seed):
    k = data.draw(st.integers(0, n - 1), label="k")
    rng = np.random.default_rng(seed)
    bits = _tree(specs, lambda shape, dtype: np.broadcast_to(
        (2.0 ** np.arange(n)).reshape((n,) + (1,) * len(shape)),
        (n,) + shape).astype(dtype))
    ints = _tree(specs, lambda shape, dtype: rng.integers(
        -16, 17, size=(n,) + shape).astype(dtype))
    kw = dict(key=jax.random.key(seed), randomize=randomize,
              chunks_per_rank=chunks, bucket_bytes=bucket_bytes)

    def f(args):
        b, i = args
        return (sr.skip_psum(b, "i", num_skip=k, gather=gather,
                             accumulate_dtype=accumulate, **kw),
                sr.contribution_mask(b, "i", num_skip=k, **kw),
                sr.skip_psum(i, "i", num_skip=0, gather=gather,
                             accumulate_dtype=accumulate, **kw),
                lax.psum(i, "i"))

    out, mask, ring0, psum = per_rank(f, (bits, ints), n=n)

    flat = zip(*(jax.tree_util.tree_leaves(t)
                 for t in (bits, out, mask, ring0, psum)))
    for x, o, m, r0, p in flat:
        assert o.shape == x.shape and o.dtype == x.dtype
        assert r0.dtype == x.dtype and m.dtype == np.bool_
        # Replica identity: every rank holds the same result.
        np.testing.assert_array_equal(o, np.broadcast_to(o[:1], o.shape))
        np.testing.assert_array_equal(r0, np.broadcast_to(r0[:1], r0.shape))
        # k = 0 is psum, bit for bit.
        np.testing.assert_array_equal(r0, p)
        if o.size == 0:
            continue
        sums = np.asarray(o[0], np.float64).astype(np.int64).ravel()
        assert np.array_equal(sums.astype(np.float64),
                              np.asarray(o[0], np.float64).ravel())
        assert np.all(popcount(sums) == n - k), (n, k)
        present = np.stack([(sums >> r) & 1 for r in range(n)]).astype(bool)
        np.testing.assert_array_equal(present, m.reshape(n, -1))
        for column in np.unique(present, axis=1).T:  # one check per pattern
            assert _cyclic_run(np.flatnonzero(~column), n), column


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _schedule_arrays(n, k, chunks, randomize, piece, key, other_key):
    """Contribution matrix, element masks of all ranks, and the matrix of
    the same schedule with another key: one compiled program per example."""
    def make(key):
        return sr.make_schedule(n, num_skip=k, chunks_per_rank=chunks, key=key,
                                randomize=randomize)

    schedule = make(key)
    masks = jax.vmap(lambda r: schedule.element_mask(r, n * chunks * piece))(
        jnp.arange(n))
    return (schedule.contribution_matrix(), masks,
            make(other_key).contribution_matrix())


@settings(max_examples=SCHEDULE_EXAMPLES, **_settings)
@given(n=st.integers(2, 8), data=st.data(), chunks=st.integers(1, 8),
       randomize=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_schedule_drops_k_neighbours_per_piece(n, data, chunks, randomize, seed):
    k = data.draw(st.integers(0, n - 1), label="k")
    piece = 3
    matrix, masks, other = map(np.asarray, _schedule_arrays(
        n, k, chunks, randomize, piece, jax.random.key(seed),
        jax.random.key(seed + 1)))
    assert matrix.shape == (n, n, chunks)            # [rank, slot, column]
    np.testing.assert_array_equal(matrix.sum(0), n - k)
    for s in range(n):
        for j in range(chunks):
            assert _cyclic_run(np.flatnonzero(~matrix[:, s, j]), n)
    if not randomize or k == 0:  # static: the key does not matter
        np.testing.assert_array_equal(other, matrix)
    np.testing.assert_array_equal(
        masks.reshape(n, n, chunks, piece),
        np.repeat(matrix[:, :, :, None], piece, 3))
