"""The one ring: a reduce-scatter of N - 1 - k ppermute steps, then a gather.

Every variant (full ring, static and random SkipReduce, hierarchical) runs
this code; they differ only in the :class:`SkipSchedule` they pass. See
``_schedule.py`` for the invariant. The code follows the ring of JAX's
shard_map notebook: an explicit accumulator that moves one rank to the right
per step, and index arithmetic for which chunk is where.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from skipreduce_jax._schedule import SkipSchedule

Gather = Literal["native", "ring"]

# Rings with more steps than this run in a lax.fori_loop instead of being
# unrolled, so that compile time stays flat for large axes.
MAX_UNROLLED_STEPS = 16


def _shift_right(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    return lax.ppermute(x, axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def _loop(num_steps: int, body, init):
    """Runs ``body(step, carry)`` for steps 1..num_steps, unrolled if short."""
    if num_steps <= MAX_UNROLLED_STEPS:
        carry = init
        for step in range(1, num_steps + 1):
            carry = body(step, carry)
        return carry
    return lax.fori_loop(1, num_steps + 1, body, init)


def reduce_scatter(
    buffer: jax.Array,
    schedule: SkipSchedule,
    axis_name: str,
    *,
    accumulate_dtype: jnp.dtype,
) -> jax.Array:
    """Runs the skipped reduce-scatter.

    Args:
      buffer: this rank's flat buffer of ``N * C * m`` elements.
      schedule: the plan for this buffer.
      axis_name: the ring's axis.
      accumulate_dtype: dtype of the accumulator (and of what is sent).

    Returns:
      ``[C, m]``: ring chunk ``rank``, summed over ``N - k`` ranks.
    """
    n, chunks = schedule.axis_size, schedule.chunks_per_rank
    pieces = buffer.reshape(n, chunks, -1)
    columns = jnp.arange(chunks)
    rank = lax.axis_index(axis_name)
    last = schedule.reduce_scatter_steps

    def own_piece(step):
        # This rank's values of the ring chunk it adds to at `step`.
        chunk = (rank + last - step) % n
        if schedule.randomized:
            piece = pieces[schedule.slots_in_chunk(chunk), columns]
        else:  # every column takes slot `chunk`: a plain slice
            piece = lax.dynamic_index_in_dim(pieces, chunk, 0, keepdims=False)
        return piece.astype(accumulate_dtype)

    def body(step, acc):
        return _shift_right(acc, axis_name, n) + own_piece(step)

    return _loop(last, body, own_piece(0))


def gather(
    shard: jax.Array,
    schedule: SkipSchedule,
    axis_name: str,
    *,
    method: Gather,
) -> jax.Array:
    """Gathers every rank's reduced ring chunk and puts slots back in order.

    Args:
      shard: ``[C, m]``, ring chunk ``rank`` as left by :func:`reduce_scatter`.
      schedule: the plan for this buffer.
      axis_name: the ring's axis.
      method: ``"native"`` uses ``lax.all_gather`` (the platform's own
        all-gather; its result is typed replicated over ``axis_name``, as
        ``psum``'s is, so it can leave ``shard_map`` with ``out_specs=P()``
        under ``check_vma=True``). ``"ring"`` uses N - 1 ppermute steps; the
        values are the same on every rank but JAX types them as varying.

    Returns:
      The flat reduced buffer of ``N * C * m`` elements, in slot order.
    """
    n = schedule.axis_size
    if method == "native":
        by_chunk = lax.all_gather(shard, axis_name, to="invarying")
    elif method == "ring":
        rank = lax.axis_index(axis_name)
        start = jnp.zeros((n,) + shard.shape, shard.dtype)
        start = lax.dynamic_update_index_in_dim(start, shard, rank, 0)

        def body(step, carry):
            held, by_chunk = carry
            held = _shift_right(held, axis_name, n)
            # After `step` shifts this rank holds ring chunk rank - step.
            by_chunk = lax.dynamic_update_index_in_dim(
                by_chunk, held, (rank - step) % n, 0)
            return held, by_chunk

        _, by_chunk = _loop(n - 1, body, (shard, start))
    else:
        raise ValueError(f"gather={method!r}: use 'native' or 'ring'.")
    if schedule.randomized:
        columns = jnp.arange(schedule.chunks_per_rank)[None, :]
        by_chunk = by_chunk[schedule.chunk_of_slot(), columns]
    return by_chunk.reshape(-1)
