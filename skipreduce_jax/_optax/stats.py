"""``comm_stats``: what one step of ``skip_reduce`` sends, from the formulas.

It plans the same buckets ``skip_reduce`` would (padding included) and
counts them with the one set of traffic formulas in ``_ring/traffic.py``; the
tests check it against the bytes read from compiled programs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.transform import _Config
from skipreduce_jax._ring import traffic
from skipreduce_jax._ring.buckets import plan_buckets
from skipreduce_jax._ring.config import SkipConfig, skip_config
from skipreduce_jax._ring.selection import needs_params
from skipreduce_jax._ring.wire import check_comm_width, summed_dtype
from skipreduce_jax._types import PyTree


class CommStats(NamedTuple):
    """What one step of :func:`skip_reduce` costs in communication.

    Attributes:
      num_skip: k for this axis size.
      bytes_per_device: bytes each device sends per step (over ``axis_name``).
      full_bytes_per_device: the same for a full ring all-reduce of every leaf.
      ratio: ``bytes_per_device / full_bytes_per_device``.
      left_out_fraction: the fraction of all (rank, element) contributions
        left out of the sum per step (``dropped_fraction`` is an alias).
      skipped_elements: gradient elements that go through SkipReduce.
      total_elements: all gradient elements.
    """

    num_skip: int
    bytes_per_device: float
    full_bytes_per_device: float
    ratio: float
    left_out_fraction: float
    skipped_elements: int
    total_elements: int

    @property
    def dropped_fraction(self) -> float:
        """Alias of ``left_out_fraction`` (its earlier name)."""
        return self.left_out_fraction


def comm_stats(grads: PyTree, axis_size: int, *, params: PyTree = None,
               config: SkipConfig | None = None, **skip_reduce_kwargs: Any) -> CommStats:
    """Bytes per device per step of :func:`skip_reduce` vs a full all-reduce.

    Counts ring traffic (SkipReduce's of the padded buffer) once the
    ``warmup_steps`` full all-reduces are over. With ``inner_axis`` it counts
    traffic over ``axis_name`` only, on the 1/L shards (pass ``inner_size=L``).

    Args:
      grads: a pytree of arrays or ``jax.ShapeDtypeStruct`` shaped like the gradients.
      axis_size: N, the size of ``axis_name``.
      params: passed to a callable ``selective`` (required then).
      config: the settings as a :class:`SkipConfig` (or as keywords).
      **skip_reduce_kwargs: the arguments of :func:`skip_reduce`, and
        ``inner_size`` (L, the size of ``inner_axis``; required with it).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from skipreduce_jax import comm_stats
      >>> grads = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
      >>> stats = comm_stats(grads, 8, num_skip=4, min_size=0)
      >>> round(stats.ratio, 3)  # 10/14 for large leaves without padding
      0.714
    """
    api = "comm_stats"
    inner = skip_reduce_kwargs.pop("inner_size", None)
    axis_name = skip_reduce_kwargs.pop("axis_name", "data")
    inner_axis = skip_reduce_kwargs.pop("inner_axis", None)
    config = _Config.of(skip_config(config, skip_reduce_kwargs, api=api), axis_name, inner_axis)
    for name, value in (("axis_size", axis_size),
                        ("inner_size", 1 if inner is None else inner)):
        checks.check_int(value, name, api=api, minimum=1, type_error=ValueError)
    if (config.inner_axis is None and inner not in (None, 1)) or (
            config.inner_axis is not None and inner is None):
        raise ValueError(
            f"{api}: pass inner_axis and inner_size together (got inner_axis="
            f"{config.inner_axis!r}, inner_size={inner!r}): the traffic over "
            "axis_name is counted on shards of 1/inner_size of each leaf.")
    if needs_params(config.selective) and params is None:
        raise ValueError(f"{api}: selective is a callable of the params; pass "
                         "them as comm_stats(..., params=params).")
    inner = 1 if inner is None else int(inner)
    n = int(axis_size)
    k = config.resolve_num_skip(n)
    leaves = jax.tree_util.tree_leaves(grads)
    # With k = 0 every leaf takes the plain pmean, as in update(). The params'
    # layout is the gradients' (exact_radial=None looks for a BatchNorm in it).
    like = grads if params is None else params
    skippable = [s and k > 0 for s in config.skippable(grads, like)]
    sizes = [math.prod(np.shape(x)) for x in leaves]
    full_bytes = sum(s * np.dtype(x.dtype).itemsize for s, x in zip(sizes, leaves)) / inner
    picked = [x for x, s in zip(leaves, skippable) if s]
    plan = plan_buckets(picked, group_size=n, slot_divisor=inner, bucket_bytes=config.bucket_bytes)
    for x in picked:
        check_comm_width(config.comm_dtype, x.dtype, api=api)

    def ring_bytes(b):
        # Each hop sends one [C, m] piece of the 1/inner shard, as the wire encodes it.
        wire, rows = config.wire.of(b.dtype), b.chunks_per_rank
        columns = b.padded_size // (n * rows * inner)
        def buffer_bytes(phase):
            return n * wire.piece_bytes(rows, columns, b.dtype, config.accumulate_dtype,
                                        phase=phase)
        return (traffic.reduce_scatter_bytes(buffer_bytes("scatter"), n, k)
                + traffic.all_gather_bytes(buffer_bytes("gather"), n))

    skip_sent = sum(ring_bytes(b) for b in plan.buckets)
    rest_bytes = sum(s * summed_dtype(x.dtype, config.accumulate_dtype).itemsize
                     for s, x, ok in zip(sizes, leaves, skippable) if not ok) / inner
    if config.radial(like):  # two float32 per output channel, all-reduced
        rest_bytes += sum(2 * 4 * np.shape(x)[-1] for x in picked) / inner
    sent = skip_sent + traffic.ring_allreduce_bytes(rest_bytes, n)
    full = traffic.ring_allreduce_bytes(full_bytes, n)
    skipped = sum(s for s, ok in zip(sizes, skippable) if ok)
    total = sum(sizes)
    # One rank (N = 1) sends nothing, with or without skipping.
    return CommStats(k, sent, full, sent / full if full else 1.0,
                     k / n * skipped / total if total else 0.0, skipped, total)
