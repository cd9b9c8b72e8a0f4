"""Pytree <-> flat per-dtype buckets, with the padding the ring needs.

Leaves of one dtype are concatenated, in tree order, into buckets of at most
``bucket_bytes``. A leaf of at least a quarter of the cap gets a bucket of its
own, which needs no copy (packing a large leaf costs a pass over its bytes);
leaves are never split. Each bucket is zero-padded to a multiple of
``group_size * chunks_per_rank`` so it splits evenly into ring slots and
sub-chunks. Zero-size leaves are not packed at all.

Layout ``"units"`` packs every leaf of two or more dimensions with its last
axis first (a Dense or Conv kernel's output units), so the values feeding one
output unit are contiguous in the buffer and share the slot or sub-chunk
that holds them: one draw decides, for the whole unit, which ranks are left
out. The sizes, and so the ring and its bytes, are those of ``"flat"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from skipreduce_jax._checks import check_choice
from skipreduce_jax._ring.schedule import default_chunks_per_rank

DEFAULT_BUCKET_BYTES = 25 * 2**20
# How leaves are laid out in a bucket.
LAYOUTS = {"flat": "each leaf in its own order",
           "units": "a kernel's last axis, its output units, first"}
# A leaf of at least this fraction of the cap gets a bucket of its own.
OWN_BUCKET_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One contiguous buffer of same-dtype leaves.

    Attributes:
      dtype: the dtype of every leaf in the bucket.
      leaf_indices: positions of the packed leaves in the flattened tree.
      size: elements before padding.
      padded_size: elements after padding (a multiple of the group size times
        ``chunks_per_rank``).
      chunks_per_rank: sub-chunks per ring slot.
    """

    dtype: np.dtype
    leaf_indices: tuple[int, ...]
    size: int
    padded_size: int
    chunks_per_rank: int


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """How a pytree is packed into buckets; static, computed at trace time.

    ``treedef``, ``shapes`` and ``dtypes`` describe the tree and each leaf;
    ``layout`` is ``"flat"`` (each leaf in its own order) or ``"units"`` (a
    leaf of two or more dimensions with its last axis first).
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    buckets: tuple[Bucket, ...]
    layout: str = "flat"

    def _moved(self, i: int) -> bool:
        """Whether leaf ``i`` is packed with its last axis first."""
        return self.layout == "units" and len(self.shapes[i]) >= 2

    def _flat(self, leaf: jax.Array, i: int) -> jax.Array:
        """Leaf ``i`` as the 1-D run of values it takes in its bucket."""
        return jnp.ravel(jnp.moveaxis(leaf, -1, 0) if self._moved(i) else leaf)

    def _shaped(self, values: jax.Array, i: int) -> jax.Array:
        """The inverse of :meth:`_flat`: leaf ``i``'s run back in its shape."""
        shape = self.shapes[i]
        if not self._moved(i):
            return values.reshape(shape)
        return jnp.moveaxis(values.reshape(shape[-1:] + shape[:-1]), 0, -1)

    def starts(self, bucket: Bucket) -> np.ndarray:
        """Where each leaf of ``bucket`` starts in its flat buffer, then the end."""
        return np.cumsum([0] + [math.prod(self.shapes[i]) for i in bucket.leaf_indices])

    def pack(self, leaves: Sequence[jax.Array], bucket: Bucket) -> jax.Array:
        """Concatenates a bucket's leaves into one padded 1-D buffer."""
        if len(bucket.leaf_indices) == 1 and bucket.padded_size == bucket.size:
            i = bucket.leaf_indices[0]  # no copy, unless the layout moves it
            return self._flat(leaves[i], i)
        # Copy each leaf into place: XLA's CPU concatenate of many operands
        # runs an order of magnitude slower than these in-place updates.
        # The largest leaf goes first: XLA turns the first update of the
        # zero buffer into a pad, a pass over the whole buffer, which is
        # cheapest when most of it is that leaf's values (a 17 MB bucket of
        # summed leaves on CPU: 5.7 ms against 17.8 ms in tree order).
        starts = self.starts(bucket)
        order = sorted(range(len(bucket.leaf_indices)),
                       key=lambda j: starts[j] - starts[j + 1])
        buffer = jnp.zeros((bucket.padded_size,), bucket.dtype)
        for j in order:
            i = bucket.leaf_indices[j]
            leaf = self._flat(leaves[i], i).astype(bucket.dtype)
            buffer = lax.dynamic_update_slice(buffer, leaf, (int(starts[j]),))
        return buffer

    def unpack(
        self,
        buffers: Sequence[jax.Array],
        *,
        fill: Callable[[int], jax.Array],
    ) -> Any:
        """The tree from one ``padded_size`` buffer per bucket (the buffers' dtypes).

        ``fill(i)`` makes the value of leaf ``i``, which was not packed
        (zero-size).
        """
        leaves: list[Any] = [None] * len(self.shapes)
        for bucket, buffer in zip(self.buckets, buffers):
            start = 0
            for i in bucket.leaf_indices:
                size = math.prod(self.shapes[i])
                leaves[i] = self._shaped(buffer[start:start + size], i)
                start += size
        for i, leaf in enumerate(leaves):
            if leaf is None:
                leaves[i] = fill(i)
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def plan_buckets(
    tree: Any,
    *,
    group_size: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    chunks_per_rank: int | None = None,
    slot_divisor: int = 1,
    layout: str = "flat",
) -> BucketPlan:
    """The :class:`BucketPlan` of ``tree`` for a ring over ``group_size`` ranks.

    ``tree`` holds arrays (or anything with ``shape`` and ``dtype``). Every
    bucket, of at most ``bucket_bytes``, is padded to a multiple of
    ``group_size * chunks_per_rank``; ``chunks_per_rank=None`` chooses
    :func:`default_chunks_per_rank` per bucket, after a ring slot is split
    ``slot_divisor`` ways (the inner axis size of hierarchical SkipReduce,
    whose ring runs on a 1/L shard). ``layout``: ``"flat"``, or ``"units"``
    (see the module's docstring); the sizes are the same.
    """
    layout = check_choice(layout, "layout", LAYOUTS, api="plan_buckets")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    buckets = []
    for dtype, indices in _group(shapes, dtypes, bucket_bytes):
        size = sum(math.prod(shapes[i]) for i in indices)
        ranks = group_size * slot_divisor
        chunks = chunks_per_rank or _chunks_without_padding(size, ranks)
        multiple = ranks * chunks
        padded = -(-size // multiple) * multiple
        buckets.append(Bucket(dtype, tuple(indices), size, padded, chunks))
    return BucketPlan(treedef, shapes, dtypes, tuple(buckets), layout)


def _group(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype],
           bucket_bytes: int) -> list[tuple[np.dtype, list[int]]]:
    """Leaf indices per bucket: same dtype, tree order, at most the cap."""
    groups: dict[np.dtype, list[list[int]]] = {}
    open_bucket: dict[np.dtype, list[int]] = {}
    filled: dict[np.dtype, int] = {}
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            continue
        buckets_of_dtype = groups.setdefault(dtype, [])
        if nbytes >= bucket_bytes * OWN_BUCKET_FRACTION:
            # Reduced in place: no copy into a shared buffer and out again.
            buckets_of_dtype.append([i])
            continue
        if dtype not in open_bucket or filled[dtype] + nbytes > bucket_bytes:
            open_bucket[dtype] = []
            buckets_of_dtype.append(open_bucket[dtype])
            filled[dtype] = 0
        open_bucket[dtype].append(i)
        filled[dtype] += nbytes
    return [(dtype, indices) for dtype, lists in groups.items()
            for indices in lists]


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """Leaves split into N blocks along their leading axis, for a reduce-scatter.

    Block r of every leaf goes to rank r. A leaf of leading size L is padded
    with zero rows to ``N * ceil(L / N)``; the leaves of one bucket are laid
    side by side in a ``[N, M]`` buffer, row r holding every leaf's block r.

    ``treedef``, ``shapes`` and ``dtypes`` as in :class:`BucketPlan`;
    ``group_size`` is N; ``buckets``: each buffer's dtype and leaf indices.
    """

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    group_size: int
    buckets: tuple[tuple[np.dtype, tuple[int, ...]], ...]

    def block_shape(self, i: int) -> tuple[int, ...]:
        """The shape of one block of leaf ``i``: ``[ceil(L / N), ...]``."""
        shape = self.shapes[i]
        return (-(-shape[0] // self.group_size),) + shape[1:]

    def pack(self, leaves: Sequence[jax.Array], bucket: int) -> jax.Array:
        """The ``[N, M]`` buffer of one bucket."""
        return concatenate_columns(self.columns(leaves, bucket))

    def columns(self, leaves: Sequence[jax.Array], bucket: int) -> list[jax.Array]:
        """The ``[N, m_i]`` columns of one bucket's buffer, one per leaf."""
        n = self.group_size
        columns = []
        for i in self.buckets[bucket][1]:
            leaf = jnp.asarray(leaves[i])
            pad = n * self.block_shape(i)[0] - leaf.shape[0]
            if pad:
                leaf = jnp.pad(leaf, [(0, pad)] + [(0, 0)] * (leaf.ndim - 1))
            columns.append(leaf.reshape(n, -1))
        return columns

    def unpack(self, rows: Sequence[jax.Array], *,
               fill: Callable[[int], jax.Array]) -> Any:
        """This rank's blocks, from one ``[M]`` row per bucket, as a tree.

        ``fill(i)`` makes the block of leaf ``i`` that was not packed.
        """
        blocks: list[Any] = [None] * len(self.shapes)
        for (_, indices), row in zip(self.buckets, rows):
            start = 0
            for i in indices:
                size = math.prod(self.block_shape(i))
                blocks[i] = row[start:start + size].reshape(self.block_shape(i))
                start += size
        return jax.tree_util.tree_unflatten(
            self.treedef, [fill(i) if b is None else b for i, b in enumerate(blocks)])


def concatenate_columns(columns: Sequence[jax.Array]) -> jax.Array:
    """``[N, m_i]`` columns side by side (no copy for one)."""
    return columns[0] if len(columns) == 1 else jnp.concatenate(columns, axis=1)


def plan_blocks(tree: Any, *, group_size: int,
                bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BlockPlan:
    """The :class:`BlockPlan` of a reduce-scatter over ``group_size`` ranks.

    ``tree``: arrays (or ShapeDtypeStructs) with a leading axis, split over
    the N ranks; buffers of at most ``bucket_bytes``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    dtypes = tuple(np.dtype(x.dtype) for x in leaves)
    buckets = tuple((dtype, tuple(indices))
                    for dtype, indices in _group(shapes, dtypes, bucket_bytes))
    return BlockPlan(treedef, shapes, dtypes, group_size, buckets)


def _chunks_without_padding(size: int, ranks: int) -> int:
    """The default granularity, lowered by up to half if that avoids padding.

    A bucket that splits evenly is packed and unpacked without copies.
    """
    preferred = default_chunks_per_rank(-(-size // ranks))
    for chunks in range(preferred, max(1, preferred // 2) - 1, -1):
        if size % (ranks * chunks) == 0:
            return chunks
    return preferred
