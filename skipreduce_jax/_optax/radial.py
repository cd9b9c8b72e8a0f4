"""Exact channel components: each output channel's weights and mean input.

A layer before a normalization with batch statistics over the data axis
(BatchNorm with ``axis_name``) is invariant to each output channel's scale and
shift, so the all-reduced gradient has no component along the channel's
weights nor along its mean input patch; skipping leaves a residue in both
that nothing pulls back (``docs/design.md``, "Normalization layers"). This
module replaces both components per channel by their exact means (one small
all-reduce of two floats per output channel), the uniform direction (every
fan-in element equal) standing for the mean input of non-negative inputs.
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
                 params: Sequence[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    """The skipped ``means`` (one per kernel, ``(..., C)``) with two components per channel exact.

    Per channel c, ``m + sum_d (mean_r(g_r . d_c) - m . d_c) d_c`` over the two
    directions ``d_c`` of :func:`channel_directions` of ``params``; ``g_r`` are
    the ``local`` gradients that entered the ring, averaged over ``axes``.
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
