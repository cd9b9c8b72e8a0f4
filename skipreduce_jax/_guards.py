"""Replica-consistency checks: cheap collectives that catch divergence.

``check_replicated(tree, axis_name)`` (inside ``shard_map``) reduces every
leaf to two 32-bit checksums of its bit pattern and compares them across the
axis with one ``pmin`` and one ``pmax`` of a vector of ``2 * num_leaves``
words. Its cost is one read of the tree plus two tiny all-reduces (latency
only), so running it every few hundred steps is cheap.
``assert_replicated(tree, mesh)`` wraps it for use outside ``shard_map``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from skipreduce_jax import _collectives as coll


def _checksums(leaf: jax.Array) -> jax.Array:
    """uint32[2]: the sum and the position-weighted sum of the leaf's bits."""
    flat = jnp.ravel(leaf)
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jax.dtypes.prng_key):
        flat = jnp.ravel(jax.random.key_data(flat))
    bits = jnp.dtype(f"uint{8 * flat.dtype.itemsize}")
    words = lax.bitcast_convert_type(flat, bits).astype(jnp.uint32)
    weights = jnp.arange(1, words.size + 1, dtype=jnp.uint32) * jnp.uint32(
        2654435761)  # odd: the weighted sum also changes when words move
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32),
                      jnp.sum(words * weights, dtype=jnp.uint32)])


def leaf_agreement(tree: Any, axis_name: str | tuple[str, ...]) -> Any:
    """Per leaf: True if the leaf is bit-identical on every rank of the axis.

    Args:
      tree: a pytree of arrays (params, optimizer state, a key).
      axis_name: the mesh axis (or axes) to compare over.

    Returns:
      A pytree of bool scalars, typed replicated, with ``tree``'s structure.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    for a in axes:
        coll.axis_size(a, api="check_replicated")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    sums = jnp.stack([_checksums(leaf) for leaf in leaves])
    if coll.vma_checked(axes[0]):
        # Values typed replicated would be compared with themselves for free;
        # cast so that the comparison really crosses the devices.
        missing = tuple(a for a in axes if a not in coll.varying_axes(sums))
        if missing:
            sums = lax.pcast(sums, missing, to="varying")
    same = jnp.all(lax.pmin(sums, axes) == lax.pmax(sums, axes), axis=1)
    return jax.tree_util.tree_unflatten(treedef, list(same))


def check_replicated(tree: Any, axis_name: str | tuple[str, ...]) -> jax.Array:
    """True if every leaf of ``tree`` is bit-identical across ``axis_name``.

    Call inside ``shard_map``, e.g. every K steps on the params.

    Args:
      tree: a pytree of arrays.
      axis_name: the mesh axis (or axes) to compare over.

    Returns:
      A bool scalar, typed replicated.

    Example:
      >>> ok = check_replicated(params, "data")
    """
    flags = jax.tree_util.tree_leaves(leaf_agreement(tree, axis_name))
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def assert_replicated(tree: Any, mesh: jax.sharding.Mesh,
                      axis_name: str | tuple[str, ...] | None = None) -> None:
    """Raises if any leaf of a replicated ``tree`` differs between devices.

    Args:
      tree: a pytree of arrays placed with ``P()`` on ``mesh`` (e.g. params).
      mesh: the device mesh.
      axis_name: the axes to compare over (default: all of the mesh's).

    Raises:
      AssertionError: naming the leaves whose copies differ.
    """
    axes = tuple(mesh.axis_names) if axis_name is None else axis_name
    # The data is declared varying so that shard_map does not assume it equal.
    flags = jax.jit(jax.shard_map(
        lambda t: leaf_agreement(t, axes), mesh=mesh, in_specs=P(),
        out_specs=P(), check_vma=False))(tree)
    paths = [jax.tree_util.keystr(path) for path, ok in
             jax.tree_util.tree_flatten_with_path(flags)[0] if not bool(ok)]
    if paths:
        raise AssertionError(
            f"assert_replicated: these leaves differ between devices over "
            f"{axes}: {', '.join(paths)}. Replicas have diverged (a rank-"
            "dependent key, a non-deterministic op, or a missing reduction).")

