"""What JAX's types say about values inside ``shard_map``.

With ``check_vma=True`` JAX types every value as varying or replicated
(invariant) over each manual mesh axis; with ``check_vma=False`` nothing is
typed varying, and collectives cannot rely on the types.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which JAX types ``x`` as varying."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def vma_checked(axis_name: str) -> bool:
    """Whether the enclosing shard_map tracks varying axes (check_vma=True)."""
    return axis_name in varying_axes(lax.axis_index(axis_name))


def cast_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` typed varying over every axis in ``axes`` (no data moves).

    Axes over which ``x`` already varies are left alone. Only for use where
    the types are tracked (check_vma=True), unless ``axes`` is empty.
    """
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def all_gather_replicated(x: jax.Array, axis_name: str, **kwargs: Any) -> jax.Array:
    """``lax.all_gather``, typed replicated (as ``psum``'s result) where JAX tracks the types.

    Under ``check_vma=False`` cotangents may differ per rank, so the plain
    all-gather is used, whose transpose is a reduce-scatter.
    """
    if axis_name in varying_axes(x):
        return lax.all_gather(x, axis_name, to="invarying", **kwargs)
    return lax.all_gather(x, axis_name, **kwargs)


def pmean_nonempty(leaves: list[jax.Array], axes: Any) -> list[jax.Array]:
    """``lax.pmean`` of each leaf; a zero-size leaf's mean is a new empty array.

    XLA:CPU in jax 0.11.2 crashes compiling an all-reduce of a zero-size
    array beside another all-reduce, so none is emitted.
    """
    reduced = set(axes if isinstance(axes, tuple) else (axes,))

    def empty(g):  # typed as pmean's result: varying over the other axes only
        others = tuple(sorted(varying_axes(g) - reduced))
        return cast_varying(jnp.zeros(g.shape, g.dtype), others)

    full = [g for g in leaves if g.size]
    means = iter(lax.pmean(full, axes) if full else [])
    return [next(means) if g.size else empty(g) for g in leaves]
