"""Exact radial components: each output channel's update along its weights.

A layer followed by a normalization with batch statistics shared over the
data axis (BatchNorm with ``axis_name``) is invariant to each output
channel's scale, so the all-reduced gradient has no component along that
channel's weights. Each rank's own gradient has one, and skipping leaves a
zero-mean residue there that nothing pulls back: the channel norms
random-walk and the running statistics go stale. This module replaces that
one component per channel by its exact mean (one small all-reduce of a
float per output channel), which removes the drift and is exact for every
other layer too.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def radial_ok(leaf: jax.ShapeDtypeStruct | jax.Array) -> bool:
    """True for a kernel (two or more axes, the last the output channels)."""
    return len(leaf.shape) >= 2


def _along(x: jax.Array, w: jax.Array) -> jax.Array:
    """Per output channel (last axis): the dot product of ``x`` and ``w``."""
    return jnp.sum(x * w, axis=tuple(range(x.ndim - 1)))


def exact_radial(means: Sequence[jax.Array], local: Sequence[jax.Array],
                 params: Sequence[jax.Array], axes: tuple[str, ...]
                 ) -> list[jax.Array]:
    """``means`` with each channel's component along its weights made exact.

    Args:
      means: the skipped means, one per kernel (shape ``(..., C)``).
      local: this rank's gradients that entered the ring, shaped alike.
      params: the kernels themselves (the directions), shaped alike.
      axes: the data axes the exact mean runs over.

    Returns:
      One array per kernel: ``m + ((mean_r(g_r . w_c) - m . w_c) / |w_c|^2) w_c``
      per channel c; a channel whose weights are all zero is left as it was.
    """
    if not means:
        return []
    ws = [w.astype(jnp.float32) for w in params]
    exact = lax.pmean([_along(g.astype(jnp.float32), w) for g, w in zip(local, ws)],
                      axes)
    out = []
    for m, w, r in zip(means, ws, exact):
        m32 = m.astype(jnp.float32)
        norm2 = _along(w, w)
        coef = jnp.where(norm2 > 0, (r - _along(m32, w)) / jnp.where(norm2 > 0, norm2, 1),
                         0.0)
        out.append((m32 + coef * w).astype(m.dtype))
    return out
