"""Exact channel components: each output channel's weights and mean input.

A layer followed by a normalization with batch statistics shared over the
data axis (BatchNorm with ``axis_name``) is invariant to each output
channel's scale and shift. So the all-reduced gradient has no component
along that channel's weights, and its shift part (the channel's bias
gradient, the sum of the normalization's input gradients) is zero. Each
rank's own gradient has both: along the weights, and the mean input patch
times that rank's share of the zero bias gradient. Skipping leaves a
zero-mean residue in both that nothing pulls back: the channel norms
random-walk, each step moves the batch mean of the normalized channel, and
the running statistics go stale. On the digits CNN of
``benchmarks/convergence.py`` (``benchmarks/bn_noise.py``), 73% of the
first conv's skipped error lay along its mean input (11% along a random
direction), and 8% of the second's (1.4%).

This module replaces two components per channel by their exact means (one
small all-reduce of two floats per output channel): along the weights, and
along the uniform direction (every fan-in element equal), which stands for
the mean input where inputs are non-negative (pixels, ReLU outputs; cosine
0.97-0.998 there). The result is exact for every other layer too: two more
exact directions per channel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax


def radial_ok(leaf: jax.ShapeDtypeStruct | jax.Array) -> bool:
    """True for a kernel (two or more axes, the last the output channels)."""
    return len(leaf.shape) >= 2


def _along(x: jax.Array, d: jax.Array) -> jax.Array:
    """Per output channel (last axis): the dot product of ``x`` and ``d``."""
    return jnp.sum(x * d, axis=tuple(range(x.ndim - 1)))


def _unit(d: jax.Array, floor: jax.Array | float = 0.0) -> jax.Array:
    """Each channel of ``d`` scaled to norm 1; zero where its norm is <= floor."""
    norm = jnp.sqrt(_along(d, d))
    return jnp.where(norm > floor, d / jnp.where(norm > floor, norm, 1), 0)


def channel_directions(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per output channel, two orthonormal directions: its weights, its mean.

    The first is ``w_c / |w_c|``; the second the uniform direction (every
    fan-in element equal) less its part along the first. Either is zero
    where it does not exist (zero weights; weights within 1e-3 of uniform).
    """
    radial = _unit(w)
    uniform = jnp.ones_like(w) / math.sqrt(math.prod(w.shape[:-1]))
    return radial, _unit(uniform - _along(uniform, radial) * radial, 1e-3)


def exact_radial(means: Sequence[jax.Array], local: Sequence[jax.Array],
                 params: Sequence[jax.Array], axes: tuple[str, ...]
                 ) -> list[jax.Array]:
    """``means`` with two components per channel made exact.

    Args:
      means: the skipped means, one per kernel (shape ``(..., C)``).
      local: this rank's gradients that entered the ring, shaped alike.
      params: the kernels themselves (the directions), shaped alike.
      axes: the data axes the exact mean runs over.

    Returns:
      One array per kernel: ``m + sum_d (mean_r(g_r . d_c) - m . d_c) d_c``
      per channel c, over the two orthonormal directions ``d_c`` of
      :func:`channel_directions`.
    """
    if not means:
        return []
    directions = [channel_directions(w.astype(jnp.float32)) for w in params]
    exact = lax.pmean([[_along(g.astype(jnp.float32), d) for d in ds]
                       for g, ds in zip(local, directions)], axes)
    out = []
    for m, ds, rs in zip(means, directions, exact):
        m32 = m.astype(jnp.float32)
        fixes = [(r - _along(m32, d)) * d for d, r in zip(ds, rs)]
        out.append((m32 + sum(fixes)).astype(m.dtype))
    return out
