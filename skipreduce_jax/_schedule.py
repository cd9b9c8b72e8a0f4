"""The static SkipReduce schedule: who contributes to which element.

A buffer of ``N * C * m`` elements is viewed as ``[N slots, C columns, m]``.
The ring moves N *ring chunks*; ring chunk ``c`` carries, in column ``j``, the
piece of slot ``(c + offsets[j]) % N``. ``offsets`` is all zeros for static
SkipReduce and drawn from the shared key for Random SkipReduce, independently
per column ("sub-chunk").

Reduce-scatter runs ``T = N - 1 - k`` ppermute steps. At step ``t`` rank ``r``
adds its own piece of ring chunk ``(r + T - t) % N`` to the accumulator it just
received from rank ``r - 1``. After ``T`` steps rank ``r`` holds ring chunk
``r`` summed over ranks ``r - T, ..., r``:

        ring chunk c is summed over ranks  c, c-1, ..., c-T    (N - k ranks)
        and drops the contributions of     c+1, ..., c+k       (k ranks, mod N)

With uniform random offsets, a slot's ring chunk is uniform over ``0..N-1``,
so every rank's contribution to every element is dropped with probability
``k / N``, while the send/receive pattern never changes. The dropped ranks of
one element are always ``k`` neighbours on the ring; only which neighbours
changes from key to key.

Everything here is index arithmetic on tiny arrays; the ring, the error
feedback of the optax transformation and the tests all ask this one object.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# The smallest sub-chunk the default granularity creates, and the most
# sub-chunks per slot it uses.
MIN_SUBCHUNK_ELEMENTS = 256
MAX_CHUNKS_PER_RANK = 64


def default_chunks_per_rank(slot_elements: int) -> int:
    """Sub-chunks per ring slot used when the caller does not choose.

    About one per ``MIN_SUBCHUNK_ELEMENTS`` elements of the slot, at least 1
    and at most ``MAX_CHUNKS_PER_RANK``, so that one slot's elements are not
    dropped together.

    Args:
        slot_elements: elements in one of the N ring slots.

    Returns:
        The number of independently randomized sub-chunks per slot.
    """
    return max(1, min(MAX_CHUNKS_PER_RANK, slot_elements // MIN_SUBCHUNK_ELEMENTS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SkipSchedule:
    """Which ring chunk each (slot, sub-chunk) rides in, and who it drops.

    Attributes:
        axis_size: N, the number of ranks on the ring.
        num_skip: k, the number of reduce-scatter steps skipped.
        chunks_per_rank: C, the sub-chunks per slot that are placed independently.
        randomized: whether ``offsets`` came from a key (False: all zero).
        offsets: int32[C]; ring chunk ``c`` carries slot ``(c + offsets[j]) % N``
            in column ``j``.
    """

    axis_size: int = dataclasses.field(metadata=dict(static=True))
    num_skip: int = dataclasses.field(metadata=dict(static=True))
    chunks_per_rank: int = dataclasses.field(metadata=dict(static=True))
    randomized: bool = dataclasses.field(metadata=dict(static=True))
    offsets: jax.Array

    @property
    def num_contributors(self) -> int:
        """N - k: how many ranks are summed into every element."""
        return self.axis_size - self.num_skip

    @property
    def reduce_scatter_steps(self) -> int:
        """N - 1 - k: ppermute steps of the reduce-scatter."""
        return self.axis_size - 1 - self.num_skip

    def slots_in_chunk(self, chunk: jax.Array | int) -> jax.Array:
        """int32[C]: the slot that ring chunk ``chunk`` carries in each column."""
        return (chunk + self.offsets) % self.axis_size

    def chunk_of_slot(self) -> jax.Array:
        """int32[N, C]: the ring chunk that carries slot ``s`` in column ``j``."""
        slots = jnp.arange(self.axis_size, dtype=jnp.int32)[:, None]
        return (slots - self.offsets[None, :]) % self.axis_size

    def contributes(self, rank: jax.Array | int) -> jax.Array:
        """bool[N, C]: whether ``rank``'s value of (slot, column) is summed."""
        lag = (self.chunk_of_slot() - rank) % self.axis_size
        return lag <= self.reduce_scatter_steps

    def contribution_matrix(self) -> jax.Array:
        """bool[N ranks, N slots, C]: ``[r, s, j]`` is True if rank r is summed."""
        ranks = jnp.arange(self.axis_size, dtype=jnp.int32)
        return jax.vmap(self.contributes)(ranks)

    def element_mask(self, rank: jax.Array | int, size: int) -> jax.Array:
        """bool[size]: ``contributes(rank)`` expanded to a flat padded buffer.

        Args:
            rank: the rank whose contributions are asked about.
            size: the padded buffer length, a multiple of ``N * C``.

        Returns:
            A flat mask, True where ``rank``'s element is part of the sum.
        """
        per_piece = size // (self.axis_size * self.chunks_per_rank)
        mask = self.contributes(rank)[:, :, None]
        return jnp.broadcast_to(mask, mask.shape[:2] + (per_piece,)).reshape(size)


def make_schedule(
        axis_size: int,
        *,
        num_skip: int,
        chunks_per_rank: int = 1,
        key: jax.Array | None = None,
        randomize: bool = True,
) -> SkipSchedule:
    """Builds the schedule for one buffer.

    Args:
        axis_size: N, ranks on the ring.
        num_skip: k in ``[0, N - 1]``, reduce-scatter steps skipped.
        chunks_per_rank: sub-chunks per slot, each placed independently.
        key: a typed PRNG key, identical on every rank. Needed when
            ``randomize`` and ``num_skip > 0``; ignored otherwise.
        randomize: False gives static SkipReduce (all offsets zero).

    Returns:
        The :class:`SkipSchedule`.

    Example:
        >>> s = make_schedule(4, num_skip=1, key=jax.random.key(0))
        >>> s.contribution_matrix().sum(axis=0).tolist()
        [[3], [3], [3], [3]]
    """
    def is_int(value):
        return isinstance(value, (int, np.integer)) and not isinstance(
            value, (bool, np.bool_))

    for name, value in (("axis_size", axis_size),
                        ("chunks_per_rank", chunks_per_rank)):
        if not is_int(value) or value < 1:
            raise ValueError(f"make_schedule: {name}={value!r} must be a "
                             "positive int.")
    if not is_int(num_skip) or not 0 <= num_skip <= axis_size - 1:
        raise ValueError(f"make_schedule: num_skip={num_skip!r} must be an int "
                         f"in [0, {axis_size - 1}] for axis_size={axis_size}.")
    axis_size, num_skip, chunks_per_rank = (int(axis_size), int(num_skip),
                                            int(chunks_per_rank))
    randomized = bool(randomize) and num_skip > 0
    if randomized:
        if key is None:
            raise ValueError("key=None: Random SkipReduce needs a PRNG key.")
        offsets = jax.random.randint(
                key, (chunks_per_rank,), 0, axis_size, dtype=jnp.int32)
    else:
        offsets = jnp.zeros((chunks_per_rank,), jnp.int32)
    return SkipSchedule(axis_size, num_skip, chunks_per_rank, randomized, offsets)
