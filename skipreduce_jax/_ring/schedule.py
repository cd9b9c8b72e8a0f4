"""The static SkipReduce schedule: who contributes to which element.

A buffer of ``N * C * m`` elements is viewed as ``[N slots, C columns, m]``.
The ring moves N *ring chunks*; ring chunk ``c`` carries, in column ``j``, the
piece of slot ``(c + offsets[j]) % N``. ``offsets`` is all zeros for static
SkipReduce and drawn from the shared key for Random SkipReduce, independently
per column ("sub-chunk"). The reduce-scatter runs ``N - 1 - k`` steps, after
which ring chunk ``c`` is summed over ranks ``c, c-1, ..., c-(N-1-k)`` and
drops ranks ``c+1, ..., c+k`` (mod N). Balanced Random (``phase``) moves the
windows ``N - k`` ranks on per step of a period (:func:`ring_period`). The
derivations are in ``docs/design.md`` ("Who is summed: the schedule").

Everything here is index arithmetic on tiny arrays; the ring, the error
feedback of the optax transformation and the tests all ask this one object.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from skipreduce_jax._checks import check_bool, check_int

# The default granularity: the smallest sub-chunk, the most sub-chunks per slot.
MIN_SUBCHUNK_ELEMENTS = 256
MAX_CHUNKS_PER_RANK = 64


def ring_period(axis_size: int, num_skip: int) -> int:
    """L = N / gcd(N, N - k): the steps after which balanced windows repeat.

    Example:
        >>> from skipreduce_jax import ring_period
        >>> ring_period(8, 4), ring_period(8, 2), ring_period(7, 3), ring_period(8, 0)
        (2, 4, 7, 1)
    """
    return axis_size // math.gcd(axis_size, axis_size - num_skip)


def scatter_period(axis_size: int, num_skip: int) -> int:
    """The same for the skipped reduce-scatter: N - 1 others, N - 1 - k summed.

    Example:
        >>> from skipreduce_jax import scatter_period
        >>> scatter_period(8, 4), scatter_period(8, 0)
        (7, 1)
    """
    others, summed = axis_size - 1, axis_size - 1 - num_skip
    return others // math.gcd(others, summed) if others else 1


def balanced_draw(key: jax.Array, step: jax.Array | int, period: int
                  ) -> tuple[jax.Array, jax.Array]:
    """The key and phase of ``step`` under a balanced schedule of ``period``.

    Args:
        key: the run's key, identical on every rank.
        step: the step index (an int or int32 scalar).
        period: :func:`ring_period` or :func:`scatter_period`; 1 gives
            ``(fold_in(key, step), 0)``, a fresh draw every step.

    Returns:
        ``(fold_in(key, step // period), step % period)``: pass both to
        :func:`make_schedule` (or ``skip_psum``'s ``key`` and ``phase``).
    """
    period = check_int(period, "period", api="balanced_draw", minimum=1, type_error=ValueError)
    step = jnp.asarray(step, jnp.int32)
    return jax.random.fold_in(key, step // period), step % period


def _check_phase(phase: Any, api: str, modulus: int) -> jax.Array:
    """``phase % modulus`` as an int32 scalar (the products using it cannot wrap)."""
    if isinstance(phase, bool) or not (
            isinstance(phase, int) or (hasattr(phase, "dtype") and jnp.ndim(phase) == 0
                                       and jnp.issubdtype(phase.dtype, jnp.integer))):
        raise TypeError(f"{api}: phase={phase!r} must be an int or an integer "
                        "scalar array (the step's place in its balanced period, "
                        "from balanced_draw); 0 uses the key's own draw.")
    if isinstance(phase, int):
        return jnp.int32(phase % max(modulus, 1))
    return jnp.asarray(phase, jnp.int32) % max(modulus, 1)


def _checked(axis_size: Any, num_skip: Any, randomize: Any, key: Any, api: str
             ) -> tuple[int, int, bool]:
    """``make_schedule``'s and ``make_scatter_schedule``'s common arguments."""
    axis_size = check_int(axis_size, "axis_size", api=api, minimum=1, type_error=ValueError)
    num_skip = check_int(num_skip, "num_skip", api=api, minimum=0, maximum=axis_size - 1,
                         type_error=ValueError, what=f"for axis_size={axis_size}")
    randomized = check_bool(randomize, "randomize", api=api) and num_skip > 0
    if randomized and key is None:
        raise ValueError("key=None: Random SkipReduce needs a PRNG key.")
    return axis_size, num_skip, randomized


def default_chunks_per_rank(slot_elements: int) -> int:
    """Sub-chunks per slot by default: one per ``MIN_SUBCHUNK_ELEMENTS`` elements.

    At least 1 and at most ``MAX_CHUNKS_PER_RANK``, so that one slot's elements
    are not left out together.
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
        offsets: int32[C]; ring chunk ``c`` carries slot ``(c + offsets[j]) % N`` in column ``j``.
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

        ``size`` is the buffer's length, a multiple of ``N * C``; True where
        ``rank``'s element is part of the sum.
        """
        per_piece = size // (self.axis_size * self.chunks_per_rank)
        mask = self.contributes(rank)[:, :, None]
        return jnp.broadcast_to(mask, mask.shape[:2] + (per_piece,)).reshape(size)


def make_schedule(axis_size: int, *, num_skip: int, chunks_per_rank: int = 1,
                  key: jax.Array | None = None, randomize: bool = True,
                  phase: jax.Array | int = 0) -> SkipSchedule:
    """Builds the schedule for one buffer.

    Args:
        axis_size: N, ranks on the ring.
        num_skip: k in ``[0, N - 1]``, reduce-scatter steps skipped.
        chunks_per_rank: sub-chunks per slot, each placed independently.
        key: a typed PRNG key, identical on every rank. Needed when
            ``randomize`` and ``num_skip > 0``; ignored otherwise.
        randomize: False gives static SkipReduce (all offsets zero).
        phase: the step's place in its balanced period (:func:`balanced_draw`):
            every offset moves back by ``phase * (N - k)``, so the windows of
            summed ranks move ``N - k`` ranks per phase. 0: the key's draw.

    Example:
        >>> import jax
        >>> from skipreduce_jax import make_schedule
        >>> s = make_schedule(4, num_skip=1, key=jax.random.key(0))
        >>> s.contribution_matrix().sum(axis=0).tolist()
        [[3], [3], [3], [3]]
    """
    api = "make_schedule"
    axis_size, num_skip, randomized = _checked(axis_size, num_skip, randomize, key, api)
    chunks_per_rank = check_int(chunks_per_rank, "chunks_per_rank", api=api,
                                minimum=1, type_error=ValueError)
    phase = _check_phase(phase, api, axis_size)
    if randomized:
        offsets = jax.random.randint(key, (chunks_per_rank,), 0, axis_size, dtype=jnp.int32)
        offsets = (offsets - phase * (axis_size - num_skip)) % axis_size
    else:
        offsets = jnp.zeros((chunks_per_rank,), jnp.int32)
    return SkipSchedule(axis_size, num_skip, chunks_per_rank, randomized, offsets)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScatterSchedule:
    """Who is summed into each rank's own block of a skipped reduce-scatter.

    Rank ``o`` receives its block summed over itself and the ranks ``o - s`` for
    ``s`` in ``shifts`` (mod N): ``N - 1 - k`` sends of 1/N of the buffer each.
    Static: ``shifts = 1..N-1-k``, the nearest predecessors (the same k ranks are
    always left out). Random: a key-chosen subset of ``1..N-1``, the same on every
    rank, so every other rank is left out of every block with probability ``k / (N - 1)``.

    Attributes:
        axis_size: N, the number of ranks.
        num_skip: k, the sends skipped.
        randomized: whether ``shifts`` came from a key.
        shifts: int32[N - 1 - k], the distances of the summed predecessors.
    """

    axis_size: int = dataclasses.field(metadata=dict(static=True))
    num_skip: int = dataclasses.field(metadata=dict(static=True))
    randomized: bool = dataclasses.field(metadata=dict(static=True))
    shifts: jax.Array

    @property
    def num_contributors(self) -> int:
        """N - k: how many ranks are summed into every element."""
        return self.axis_size - self.num_skip

    def contributes(self, rank: jax.Array | int) -> jax.Array:
        """bool[N blocks]: whether ``rank``'s value of each block is summed."""
        blocks = jnp.arange(self.axis_size, dtype=jnp.int32)
        lag = (blocks - rank) % self.axis_size
        return (lag == 0) | jnp.any(lag[:, None] == self.shifts[None, :], axis=1)


def make_scatter_schedule(axis_size: int, *, num_skip: int,
                          key: jax.Array | None = None,
                          randomize: bool = True,
                          phase: jax.Array | int = 0) -> ScatterSchedule:
    """Builds the schedule of a skipped reduce-scatter.

    Args:
        axis_size: N, ranks on the axis.
        num_skip: k in ``[0, N - 1]``.
        key: a typed PRNG key identical on every rank (Random only).
        randomize: False: always the ``N - 1 - k`` nearest predecessors.
        phase: the step's place in its balanced period (:func:`balanced_draw`
            with :func:`scatter_period`): the key orders the N - 1 others,
            and phase p sums the ``N - 1 - k`` from place ``p (N - 1 - k)`` on
            (cyclically), so over the period each is summed equally often.

    Example:
        >>> from skipreduce_jax import make_scatter_schedule
        >>> s = make_scatter_schedule(4, num_skip=1, randomize=False)
        >>> s.shifts.tolist(), s.contributes(0).tolist()
        ([1, 2], [True, True, True, False])
    """
    api = "make_scatter_schedule"
    axis_size, num_skip, randomized = _checked(axis_size, num_skip, randomize, key, api)
    sends = axis_size - 1 - num_skip
    phase = _check_phase(phase, api, axis_size - 1)
    if randomized:
        order = jax.random.permutation(key, axis_size - 1).astype(jnp.int32)
        places = (phase * sends + jnp.arange(sends, dtype=jnp.int32)) % (axis_size - 1)
        shifts = jnp.sort(order[places]) + 1
    else:
        shifts = jnp.arange(1, sends + 1, dtype=jnp.int32)
    return ScatterSchedule(axis_size, num_skip, randomized, shifts)
