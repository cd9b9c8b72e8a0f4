"""Rounding of bfloat16 / float16 gradients summed with float32 accumulation.

With ``accumulate_dtype=jnp.float32`` the ring adds the narrow values in
float32 and rounds once, to the narrow dtype, after scaling. Against the
float32 reference ``ref`` (a ``lax.psum`` in float32 over the same
contributors, named by ``contribution_mask``, divided by the same count)
each element of the result ``out`` then satisfies::

    |out - ref| <= u |ref| + (2N + 2) 2**-24 sum_r |x_r| / count + s / 2

* ``u |ref|``: the one final rounding to the narrow dtype (at most half an
  ulp), u = 2**-8 for bfloat16 (8-bit significand), 2**-11 for float16.
* ``(2N + 2) 2**-24 sum_r |x_r| / count``: float32 rounding on both sides,
  at most N - 1 additions in the ring, N - 1 in the reference psum, the
  rounded 1/count and the two scalings (2**-24 is float32's unit roundoff).
* ``s / 2``: half the smallest subnormal, for results below the normal range
  (float16 reaches it with values around 1e-2 and cancellation).

Measured on the inputs below (8 ranks, normal values at scales 1e-2, 1 and
1e2): the largest error is 0.98-0.996 of the bound in every case, i.e. the
result is the correctly rounded float32 value; the final rounding alone
comes that close to u |ref|, so the bound cannot be lowered. Accumulating
in the narrow dtype instead (k = 3) exceeds it by up to 186x (bfloat16) and
62x (float16), which ``test_narrow_accumulation_breaks_the_bound`` keeps as
a check that the bound tells the two apart.

NaN/Inf in one rank's gradient: see tests/test_guards.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank
from jax import lax

import skipreduce_jax as sr

N = 8
UNIT_ROUNDOFF = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11}
SCALES = (1e-2, 1.0, 1e2)


def _gradients(dtype: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-rank normal values at three scales; sizes that need padding."""
    rng = np.random.default_rng(seed)
    sizes = (4096, 1000, 37)
    return {f"s{i}": (rng.normal(size=(N, size)) * scale).astype(dtype)
            for i, (size, scale) in enumerate(zip(sizes, SCALES))}


def _reference(x: Any, mask: Any, count: int, axis: str = "i") -> tuple[Any, Any]:
    """float32 psum over the masked contributors / count, and sum |x| / count."""
    def one(v, m):
        v32 = v.astype(jnp.float32)
        return (lax.psum(jnp.where(m, v32, 0.0), axis) / count,
                lax.psum(jnp.abs(v32), axis) / count)

    pairs = jax.tree_util.tree_map(one, x, mask)
    is_pair = lambda p: isinstance(p, tuple)  # noqa: E731
    return (jax.tree_util.tree_map(lambda p: p[0], pairs, is_leaf=is_pair),
            jax.tree_util.tree_map(lambda p: p[1], pairs, is_leaf=is_pair))


def _excess(out: Any, ref: Any, abs_sum: Any, dtype: Any) -> float:
    """The largest |out - ref| / bound over all elements (<= 1: within)."""
    u = UNIT_ROUNDOFF[dtype]
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    worst = 0.0
    for o, r, a in zip(*(jax.tree_util.tree_leaves(t) for t in (out, ref, abs_sum))):
        assert o.dtype == dtype
        o, r, a = (np.asarray(t[0], np.float64) for t in (o, r, a))
        bound = u * np.abs(r) + (2 * N + 2) * 2.0 ** -24 * a + tiny / 2
        worst = max(worst, float((np.abs(o - r) / bound).max()))
    return worst


def _reduce(x: Any, *, num_skip: int, accumulate_dtype: Any) -> tuple:
    """skip_psum (k = 0) or skip_pmean (k > 0), and its float32 reference."""
    def f(v):
        kw = dict(key=jax.random.key(3), num_skip=num_skip, chunks_per_rank=4)
        if num_skip == 0:
            out = sr.skip_psum(v, "i", accumulate_dtype=accumulate_dtype, **kw)
        else:
            out = sr.skip_pmean(v, "i", accumulate_dtype=accumulate_dtype, **kw)
        mask = sr.contribution_mask(v, "i", **kw)
        count = N - num_skip if num_skip else 1
        return (out,) + _reference(v, mask, count)

    return per_rank(f, x, n=N)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("num_skip", [0, 3, 6])
def test_float32_accumulation_is_within_one_final_rounding(dtype, num_skip):
    """skip_psum (k = 0) and skip_pmean (k = 3, 6): within the bound above."""
    out, ref, abs_sum = _reduce(_gradients(dtype), num_skip=num_skip,
                                accumulate_dtype=jnp.float32)
    for leaf in jax.tree_util.tree_leaves(out):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[:1], leaf.shape))
    assert _excess(out, ref, abs_sum, dtype) <= 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_narrow_accumulation_breaks_the_bound(dtype):
    """Without float32 accumulation each ring step rounds: the bound fails."""
    out, ref, abs_sum = _reduce(_gradients(dtype), num_skip=3,
                                accumulate_dtype=None)
    assert _excess(out, ref, abs_sum, dtype) > 10.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_skip_reduce_passes_accumulate_dtype(dtype):
    """skip_reduce(accumulate_dtype=float32) on bfloat16/float16 gradients."""
    k, seed = 3, 5
    tx = sr.skip_reduce("i", num_skip=k, seed=seed, min_size=0,
                        accumulate_dtype=jnp.float32)
    grads = _gradients(dtype, seed=1)

    def f(g):
        updates, _ = tx.update(g, tx.init(g))
        # Step one's key: fold_in(key(seed), 0 // L), phase 0.
        key = jax.random.fold_in(jax.random.key(seed), 0)
        mask = sr.contribution_mask(g, "i", key=key, num_skip=k)
        return (updates,) + _reference(g, mask, N - k)

    out, ref, abs_sum = per_rank(f, grads, n=N)
    assert _excess(out, ref, abs_sum, dtype) <= 1.0
    # The update is a mean over N - k contributors, not a psum.
    scale = np.abs(np.asarray(out["s1"][0], np.float32)).mean()
    assert 0.2 < scale < 2.0, scale


@pytest.mark.parametrize("acc", [jnp.float32, jnp.float16, jnp.bfloat16],
                         ids=["f32", "f16", "bf16"])
def test_float32_gradients_unaffected_by_accumulate_dtype(acc):
    """float32 leaves are summed in float32 whatever accumulate_dtype asks:
    a narrower one never rounds them (the same bits as without it)."""
    x = _gradients(np.float32)
    plain = _reduce(x, num_skip=3, accumulate_dtype=None)[0]
    acc = _reduce(x, num_skip=3, accumulate_dtype=acc)[0]
    for a, b in zip(jax.tree_util.tree_leaves(plain),
                    jax.tree_util.tree_leaves(acc)):
        np.testing.assert_array_equal(a, b)


def test_optax_chain_keeps_the_narrow_dtype():
    """The averaged bfloat16 update stays bfloat16 through an optax chain."""
    tx = optax.chain(sr.skip_reduce("i", num_skip=2, min_size=0,
                                    accumulate_dtype=jnp.float32),
                     optax.sgd(1.0))
    grads = _gradients(jnp.bfloat16)

    def f(g):
        return tx.update(g, tx.init(g))[0]

    out = per_rank(f, grads, n=N)
    for leaf in jax.tree_util.tree_leaves(out):
        assert leaf.dtype == jnp.bfloat16
        assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
