"""What JAX's types say about values inside ``shard_map``.

With ``check_vma=True`` JAX types every value as varying or replicated
(invariant) over each manual mesh axis; with ``check_vma=False`` nothing is
typed varying, and collectives cannot rely on the types.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which JAX types ``x`` as varying."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


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


def all_gather_replicated(x: jax.Array, axis_name: str, **kwargs: Any
                          ) -> jax.Array:
    """``lax.all_gather``, typed replicated where JAX tracks the types.

    Under ``check_vma=True`` the result is typed invariant over ``axis_name``
    (as ``psum``'s is), and its transpose takes this rank's slice of a
    replicated cotangent. Under ``check_vma=False`` cotangents may differ per
    rank, so the plain all-gather is used: its transpose is a reduce-scatter,
    as ``psum``'s transpose is a ``psum`` there.
    """
    if axis_name in varying_axes(x):
        return lax.all_gather(x, axis_name, to="invarying", **kwargs)
    return lax.all_gather(x, axis_name, **kwargs)
