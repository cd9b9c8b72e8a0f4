"""The one ring: a reduce-scatter of N - 1 - k ppermute steps, then a gather.

Every variant (full ring, static and random SkipReduce, hierarchical) runs
this code; they differ only in the :class:`SkipSchedule` they pass. See
``_ring/schedule.py`` for the invariant. The code follows the ring of JAX's
shard_map notebook: an explicit accumulator that moves one rank to the right
per step, and index arithmetic for which chunk is where.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from skipreduce_jax._ring.schedule import ScatterSchedule, SkipSchedule, make_schedule
from skipreduce_jax._ring.wire import Wire, send_narrow
from skipreduce_jax._vma import all_gather_replicated

Gather = Literal["native", "ring"]

MAX_UNROLLED_STEPS = 16  # longer rings run in a fori_loop: flat compile time


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
    wire: Wire,
) -> jax.Array:
    """Runs the skipped reduce-scatter of ``schedule`` over ``axis_name``.

    ``buffer``: this rank's flat buffer of ``N * C * m`` elements, added in
    ``accumulate_dtype``; each hop's ``[C, m]`` accumulator crosses as
    ``wire`` encodes it, and the receiver adds its own piece to what
    arrives. Returns ``[C, m]``: ring chunk ``rank``, summed over ``N - k``
    ranks.
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

    shift = functools.partial(_shift_right, axis_name=axis_name, n=n)

    def body(step, acc):
        return wire.hop(shift, acc) + own_piece(step)

    return _loop(last, body, own_piece(0))


def reduce_scatter_to_owners(
    buffer: jax.Array,
    schedule: ScatterSchedule,
    axis_name: str,
    *,
    accumulate_dtype: jnp.dtype,
    wire: Wire,
    own_weight: float = 1.0,
) -> jax.Array:
    """A skipped reduce-scatter that leaves each rank its own block.

    Static schedules run the ring above (ring chunk r is block r, summed over
    r's ``N - 1 - k`` nearest predecessors). Random ones send each summed
    piece straight to its owner: at step t every rank sends its piece of
    block ``rank + s_t`` over a shift of ``s_t``, one of the N - 1 static
    shifts chosen by ``lax.switch`` on the shared key. Both send
    ``(N - 1 - k) / N`` of the buffer; on a physical ring or torus a shift of
    s crosses s links, on a switched network any shift runs at full rate.

    ``buffer`` is ``[N, M]``, row b this rank's values of block b; the other
    arguments are :func:`reduce_scatter`'s, and ``own_weight`` (Random only;
    the ring of static ones adds every piece alike): the owner's own piece
    enters the sum times this (the others always with weight 1). Returns
    ``[M]``: block ``rank``, summed over ``N - k`` ranks, itself included.
    """
    n = schedule.axis_size
    if not schedule.randomized:
        ring = make_schedule(n, num_skip=schedule.num_skip, randomize=False)
        return reduce_scatter(buffer.reshape(-1), ring, axis_name,
                              accumulate_dtype=accumulate_dtype,
                              wire=wire).reshape(-1)
    rank = lax.axis_index(axis_name)
    pieces = buffer.astype(accumulate_dtype)

    def send(shift):
        def move(piece):
            return lax.ppermute(piece, axis_name,
                                perm=[(i, (i + shift) % n) for i in range(n)])
        return functools.partial(wire.hop, move)

    branches = [send(shift) for shift in range(1, n)]

    def body(step, acc):
        shift = schedule.shifts[step - 1]
        piece = lax.dynamic_index_in_dim(pieces, (rank + shift) % n, 0,
                                         keepdims=False)
        return acc + lax.switch(shift - 1, branches, piece)

    own = lax.dynamic_index_in_dim(pieces, rank, 0, keepdims=False)
    if own_weight != 1.0:
        own = own * jnp.asarray(own_weight, accumulate_dtype)
    return _loop(n - 1 - schedule.num_skip, body, own)


def gather(
    shard: jax.Array,
    schedule: SkipSchedule,
    axis_name: str,
    *,
    method: Gather,
    packed: bool = False,
    in_place: bool = True,
) -> jax.Array:
    """Gathers every rank's reduced ring chunk and puts slots back in order.

    ``shard``: ``[C, m]``, ring chunk ``rank`` as :func:`reduce_scatter`
    left it. ``method``: ``"native"``, ``lax.all_gather`` (typed replicated
    under ``check_vma=True``, as ``psum``'s result is); ``"ring"``, N - 1
    ppermute steps (the same values on every rank, typed varying).
    ``packed``: send ``shard`` (narrower than 32 bits) with
    :func:`send_narrow`. ``in_place``: see :func:`put_in_slot_order`.
    Returns the flat reduced buffer of ``N * C * m`` elements, in slot order.
    """
    n = schedule.axis_size
    def move(x, how):
        return send_narrow(how, x) if packed else how(x)

    if method == "native":
        by_chunk = move(shard, functools.partial(all_gather_replicated,
                                                 axis_name=axis_name))
        return put_in_slot_order(by_chunk, schedule,
                                 in_place=in_place).reshape(-1)
    rank = lax.axis_index(axis_name)
    # zeros_like keeps the shard's varying type, as the loop carry needs.
    out = _place(jnp.zeros_like(shard, shape=(n,) + shard.shape), shard, rank,
                 schedule)

    def body(step, carry):
        held, out = carry
        held = move(held, functools.partial(_shift_right, axis_name=axis_name,
                                            n=n))
        # After `step` shifts this rank holds ring chunk rank - step.
        return held, _place(out, held, (rank - step) % n, schedule)

    # Always a loop, even for short rings: XLA updates a loop-carried buffer
    # in place, while unrolled updates rewrite the whole buffer per step
    # (measured 1.3x slower on 4 CPU devices at 64 MiB).
    _, out = lax.fori_loop(1, n, body, (shard, out))
    return out.reshape(-1)


def _place(out: jax.Array, chunk_values: jax.Array, chunk: jax.Array,
           schedule: SkipSchedule) -> jax.Array:
    """Writes ring chunk ``chunk`` (``[C, m]``) into ``out`` (``[N slots, C, m]``).

    Each column goes to its slot: the ring gather copies every chunk it
    receives anyway, so it puts randomized columns in place for free.
    """
    if not schedule.randomized:
        return lax.dynamic_update_index_in_dim(out, chunk_values, chunk, 0)
    slots = schedule.slots_in_chunk(chunk)

    def put_column(column, out):
        piece = lax.dynamic_slice_in_dim(chunk_values, column, 1, 0)[None]
        return lax.dynamic_update_slice(out, piece, (slots[column], column, 0))

    return lax.fori_loop(0, schedule.chunks_per_rank, put_column, out)


def put_in_slot_order(by_chunk: jax.Array, schedule: SkipSchedule, *,
                      in_place: bool = True) -> jax.Array:
    """Reorders ``[N ring chunks, C, m]`` into ``[N slots, C, m]``.

    A no-op for a static schedule. For a randomized one it moves every
    column whose offset is not zero, and no layout avoids that: the
    all-gather puts rank r's chunk at block r, so a natural-order result
    needs every element of block r to end on rank r, and rank r's chunk
    always sums ranks r - T, ..., r (the static pattern). Randomizing which
    ranks an element drops therefore means moving it after the gather.

    ``in_place=True`` rolls the moving columns within ``by_chunk`` (a loop;
    see :func:`_roll_columns`): the cheaper pass when the result is kept as
    it is. ``in_place=False`` is one XLA gather into a new buffer, which XLA
    can fuse into an element-wise consumer in the same program (an
    optimizer's update), where it then costs no pass of its own. Both give
    the same values.
    """
    if not schedule.randomized:
        return by_chunk
    if not in_place:
        return _gathered_by_slot(by_chunk, schedule.offsets)
    return _roll_columns(by_chunk, schedule.offsets)


# Bytes `_roll_columns` rolls at a time: a block that stays in L2 cache
# (16M float32, N = 4, one core: 7.9 ms; whole 1 MiB columns 10.4 ms).
ROLL_BLOCK_BYTES = 1 << 17


@jax.custom_jvp
def _roll_columns(by_chunk: jax.Array, offsets: jax.Array) -> jax.Array:
    """Rolls column j of ``[N, C, m]`` by ``offsets[j]`` along N, in place.

    Slot s of column j holds ring chunk ``s - offsets[j]``. A loop rolls the
    columns that move ((N - 1) / N of them on average), block by block,
    through a temporary back into the gathered buffer: no second buffer.
    Its length depends on the offsets, which reverse-mode autodiff cannot
    go through, so derivatives take the gather form of the same map.
    """
    n, columns, m = by_chunk.shape
    blocks = 1
    while m % (2 * blocks) == 0 and n * m * by_chunk.dtype.itemsize > ROLL_BLOCK_BYTES * blocks:
        blocks *= 2
    offsets = jnp.repeat(offsets, blocks)
    order = jnp.argsort(offsets == 0, stable=True)  # the moving blocks first

    def roll(i, out):
        column = order[i]
        pieces = lax.dynamic_slice_in_dim(out, column, 1, 1)  # [N, 1, m / blocks]
        rolled = lax.dynamic_slice_in_dim(
            jnp.concatenate([pieces, pieces]), n - offsets[column], n, 0)
        return lax.dynamic_update_slice_in_dim(out, rolled, column, 1)

    cut = by_chunk.reshape(n, columns * blocks, m // blocks)
    return lax.fori_loop(0, jnp.count_nonzero(offsets), roll, cut).reshape(by_chunk.shape)


def _gathered_by_slot(by_chunk: jax.Array, offsets: jax.Array) -> jax.Array:
    """The same reorder as one XLA gather into a new buffer."""
    n, columns = by_chunk.shape[:2]
    slots = jnp.arange(n, dtype=jnp.int32)[:, None]
    return by_chunk[(slots - offsets[None, :]) % n, jnp.arange(columns)[None, :]]


@_roll_columns.defjvp
def _roll_columns_jvp(primals, tangents):
    by_chunk, offsets = primals
    return (_roll_columns(by_chunk, offsets),
            _gathered_by_slot(tangents[0], offsets))
