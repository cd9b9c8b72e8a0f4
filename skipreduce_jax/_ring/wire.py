"""The wire: how a ring piece crosses a hop, and what it costs.

A :class:`Wire` encodes a piece for a hop and decodes it on arrival; each
hop adds in ``added`` (float32, or wider), so only the crossing is narrow.
It owns its byte count (read by ``comm_stats`` and the cost model) and its
overflow rule. :func:`make_wire` is the one place a ``comm_dtype``
becomes a wire:

- ``None``: the sum's own dtype crosses (the gather sends the leaves');
- ``jnp.bfloat16``, ``jnp.float16``: rounded to it once per hop;
- ``jnp.float8_e4m3fn``, ``jnp.float8_e5m2``: each block of at most 256
  elements of a piece's rows scaled to float8's range by its largest
  magnitude, the float32 scale sent beside it (about 1.6% more bytes).

XLA:CPU sends 16-bit float collectives as float32; narrow values therefore
cross bit-cast into uint32 words (on CPU only, decided at lowering).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from skipreduce_jax import _checks as checks

Move = Callable[[jax.Array], jax.Array]

# The float8 wire scales blocks of at most this many elements, each block's
# float32 scale crossing as one more uint32 word.
SCALE_BLOCK = 256


def summed_dtype(dtype: Any, accumulate_dtype: np.dtype | None) -> np.dtype:
    """The dtype values of ``dtype`` are added in: the promotion with ``accumulate_dtype``.

    Never narrower than the leaf (float32 leaves with a float16
    ``accumulate_dtype`` are still summed in float32). Non-floating leaves
    are summed as they are.
    """
    if accumulate_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
        return np.dtype(jax.dtypes.canonicalize_dtype(
            jnp.promote_types(dtype, accumulate_dtype)))
    return np.dtype(dtype)


def _to_words(x: jax.Array) -> jax.Array:
    """``x``'s last axis as uint32 words (padded with zeros to whole words)."""
    per_word = 4 // x.dtype.itemsize
    pad = -x.shape[-1] % per_word
    if pad:
        x = jnp.concatenate([x, jnp.zeros_like(x, shape=x.shape[:-1] + (pad,))], -1)
    return lax.bitcast_convert_type(
        x.reshape(x.shape[:-1] + (-1, per_word)), jnp.uint32)


def _from_words(words: jax.Array, dtype: Any, size: int) -> jax.Array:
    """The first ``size`` values of ``dtype`` in the last axis of ``words``."""
    values = lax.bitcast_convert_type(words, dtype)
    return values.reshape(words.shape[:-1] + (-1,))[..., :size]


def _packed(move: Move, x: jax.Array) -> jax.Array:
    """``move(x)`` with ``x`` crossing as uint32 words.

    ``move`` may add leading axes (an all-gather) and keeps the last one.
    """
    flat = x.reshape(-1)
    moved = move(_to_words(flat))
    lead = moved.shape[:-1]
    return _from_words(moved, x.dtype, x.size).reshape(lead + x.shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def send_narrow(move: Move, x: jax.Array) -> jax.Array:
    """``move(x)`` (a linear collective) for a value ``x`` narrower than 32 bits.

    On CPU it crosses packed in uint32 words; GPU and TPU send it as it is.
    The tangent crosses unpacked (bits have no derivative), so the map stays
    transposable.
    """
    if x.dtype.itemsize >= 4:
        return move(x)
    return lax.platform_dependent(x, cpu=functools.partial(_packed, move),
                                  default=move)


@send_narrow.defjvp
def _send_narrow_jvp(move, primals, tangents):
    return send_narrow(move, primals[0]), move(tangents[0])


@dataclasses.dataclass(frozen=True)
class Wire:
    """The sum's own dtype on the wire (``comm_dtype=None``)."""

    dtype: np.dtype | None = None  # the comm_dtype, None for this wire

    def of(self, dtype: Any) -> Wire:
        """The wire a bucket of ``dtype`` takes: this one, or for integers the plain one."""
        return self if jnp.issubdtype(dtype, jnp.floating) else Wire()

    def added(self, dtype: Any, accumulate_dtype: np.dtype | None) -> np.dtype:
        """The dtype each hop adds a bucket of ``dtype`` in."""
        return summed_dtype(dtype, accumulate_dtype)

    def hop(self, move: Move, acc: jax.Array) -> jax.Array:
        """``acc`` sent by ``move`` (one reduce-scatter hop), in ``acc``'s dtype."""
        return move(acc)

    def gather(self, gather: Callable[..., jax.Array], shard: jax.Array,
               schedule: Any, dtype: Any) -> jax.Array:
        """``gather(shard, schedule, packed=, in_place=)`` (the ring's all-gather), as ``dtype``.

        A shard summed wider than ``dtype`` crosses as ``dtype``'s bits:
        XLA would otherwise move the cast after the gather and send the wide type.
        """
        dtype = np.dtype(dtype)
        if shard.dtype == dtype:
            return gather(shard, schedule)
        return _gather_bits(gather, dtype, shard, schedule)

    def piece_bytes(self, rows: int, columns: int, dtype: Any,
                    accumulate_dtype: np.dtype | None, *, phase: str) -> int:
        """Bytes of a ``[rows, columns]`` piece of a ``dtype`` bucket on the wire.

        ``phase``: ``"scatter"`` (a hop of the reduce-scatter, the sum's
        dtype) or ``"gather"`` (the all-gather, the leaves' dtype).
        """
        sent = self.added(dtype, accumulate_dtype) if phase == "scatter" else np.dtype(dtype)
        return rows * columns * sent.itemsize

    def finite_check(self) -> bool:
        """Whether a sum can overflow on this wire where float32's would not."""
        return False


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _gather_bits(gather, dtype: np.dtype, shard: jax.Array, schedule: Any) -> jax.Array:
    bits = jnp.dtype(f"uint{8 * dtype.itemsize}")
    out = gather(lax.bitcast_convert_type(shard.astype(dtype), bits), schedule)
    return lax.bitcast_convert_type(out, dtype)


@_gather_bits.defjvp
def _gather_bits_jvp(gather, dtype, primals, tangents):
    shard, schedule = primals
    # The gather form of the reorder: a loop cannot be transposed.
    tangent = gather(tangents[0].astype(dtype), schedule, in_place=False)
    return _gather_bits(gather, dtype, shard, schedule), tangent


@dataclasses.dataclass(frozen=True)
class Rounded(Wire):
    """A 16-bit float on the wire: each hop rounds its sum to it once."""

    def added(self, dtype: Any, accumulate_dtype: np.dtype | None) -> np.dtype:
        return summed_dtype(dtype, np.dtype(jnp.float32) if accumulate_dtype is None
                            else accumulate_dtype)

    def hop(self, move: Move, acc: jax.Array) -> jax.Array:
        return send_narrow(move, acc.astype(self.dtype)).astype(acc.dtype)

    def gather(self, gather, shard, schedule, dtype):
        packed = functools.partial(gather, schedule=schedule, packed=True)
        return packed(shard.astype(self.dtype)).astype(dtype)

    def piece_bytes(self, rows, columns, dtype, accumulate_dtype, *, phase):
        return rows * columns * self.dtype.itemsize

    def finite_check(self) -> bool:
        # float16's largest value is 65504; bfloat16 has float32's range.
        return jnp.finfo(self.dtype).maxexp < jnp.finfo(jnp.float32).maxexp


@dataclasses.dataclass(frozen=True)
class Scaled(Rounded):
    """A float8 on the wire, in blocks scaled by their largest magnitude.

    A hop encodes its float32 sum block by block: the block divided by its
    largest magnitude over float8's largest value, rounded to float8, and
    the scale sent beside it. The receiver decodes and adds in float32.
    Unscaled, float8 would flush a gradient's small values to zero. The
    scale keeps each block's largest value to float8's relative precision
    (2**-4 for e4m3fn), so it cannot overflow.
    """

    def hop(self, move: Move, acc: jax.Array) -> jax.Array:
        return _scaled(self, move, acc).astype(acc.dtype)

    def gather(self, gather, shard, schedule, dtype):
        return _scaled_gather(self, gather, shard, schedule).astype(dtype)

    def piece_bytes(self, rows, columns, dtype, accumulate_dtype, *, phase):
        blocks, size = self.blocks(columns)
        return rows * blocks * (size * self.dtype.itemsize + 4)

    def finite_check(self) -> bool:
        return False

    def blocks(self, m: int) -> tuple[int, int]:
        """How a row of ``m`` elements is cut: ``(blocks, elements per block)``.

        As few blocks of at most :data:`SCALE_BLOCK` as hold the row, equal,
        each a whole number of uint32 words: under 4 elements of padding
        per block, where blocks of 256 would pad a row of 260 to 512.
        """
        blocks = max(1, -(-m // SCALE_BLOCK))
        per_word = 4 // self.dtype.itemsize
        return blocks, -(-m // (blocks * per_word)) * per_word

    def encode(self, x: jax.Array) -> jax.Array:
        """``[..., m]`` values as uint32 words: per block its float8 values, then its scale."""
        blocks, size = self.blocks(x.shape[-1])
        pad = blocks * size - x.shape[-1]
        x = jnp.pad(x.astype(jnp.float32), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
        x = x.reshape(x.shape[:-1] + (blocks, size))
        peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        largest = float(jnp.finfo(self.dtype).max)
        scale = jnp.where(peak > 0, peak / largest, 1.0)
        values = jnp.clip(x / scale, -largest, largest).astype(self.dtype)
        words = jnp.concatenate(
            [_to_words(values), lax.bitcast_convert_type(scale, jnp.uint32)], -1)
        return words.reshape(words.shape[:-2] + (-1,))

    def decode(self, words: jax.Array, size: int) -> jax.Array:
        """The ``size`` float32 values of each row :meth:`encode` made of ``size``."""
        blocks, block = self.blocks(size)
        words = words.reshape(words.shape[:-1] + (blocks, -1))
        values = _from_words(words[..., :-1], self.dtype, block)
        scale = lax.bitcast_convert_type(words[..., -1:], jnp.float32)
        x = values.astype(jnp.float32) * scale
        return x.reshape(x.shape[:-2] + (-1,))[..., :size]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _scaled(wire: Scaled, move: Move, x: jax.Array) -> jax.Array:
    return wire.decode(move(wire.encode(x)), x.shape[-1])


@_scaled.defjvp
def _scaled_jvp(wire, move, primals, tangents):  # rounding has no derivative
    return _scaled(wire, move, primals[0]), move(tangents[0]).astype(jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _scaled_gather(wire: Scaled, gather, shard: jax.Array, schedule: Any) -> jax.Array:
    """The ring's gather of ``shard`` (``[C, m]``, flat ``[N C m]`` out) in float8 blocks."""
    encoded = wire.encode(shard)  # [C, w]
    words = gather(encoded, schedule)
    return wire.decode(words.reshape(-1, encoded.shape[-1]), shard.shape[-1]).reshape(-1)


@_scaled_gather.defjvp
def _scaled_gather_jvp(wire, gather, primals, tangents):
    shard, schedule = primals
    # The gather form of the reorder: a loop cannot be transposed.
    tangent = gather(tangents[0].astype(jnp.float32), schedule, in_place=False)
    return _scaled_gather(wire, gather, shard, schedule), tangent


def make_wire(comm_dtype: np.dtype | None) -> Wire:
    """The wire of a checked ``comm_dtype`` (see :func:`check_comm_dtype`)."""
    if comm_dtype is None:
        return Wire()
    if np.dtype(comm_dtype).itemsize == 1:
        return Scaled(np.dtype(comm_dtype))
    return Rounded(np.dtype(comm_dtype))


def check_comm_dtype(comm_dtype: Any, *, api: str) -> np.dtype | None:
    """Checks ``comm_dtype``: None or a floating dtype (e.g. ``jnp.bfloat16``)."""
    return checks.check_float_dtype(comm_dtype, "comm_dtype", api=api,
                                    none="send the gradients' dtype",
                                    example="jnp.bfloat16, jnp.float16 or jnp.float8_e4m3fn")


def check_comm_width(comm_dtype: np.dtype | None, dtype: Any, *, api: str) -> None:
    """Refuses a checked ``comm_dtype`` (None passes) wider than a floating leaf's."""
    if comm_dtype is not None and np.dtype(comm_dtype).itemsize > np.dtype(dtype).itemsize:
        raise TypeError(
            f"{api}: comm_dtype={np.dtype(comm_dtype).name} is wider than "
            f"a gradient leaf of dtype {np.dtype(dtype).name}: it would send more "
            "bytes, not fewer. Pass comm_dtype=None for these gradients, or a "
            "dtype no wider than theirs (e.g. jnp.bfloat16); to add them in "
            "float32, pass accumulate_dtype=jnp.float32.")


def nan_unless_finite(values: list[jax.Array], checked: list[bool],
                      axes: tuple[str, ...] = ()) -> list[jax.Array]:
    """The ``checked`` values, all NaN if any of them holds an Inf or NaN.

    The overflow rule of a wire whose :meth:`Wire.finite_check` is True: a
    sum beyond float16's range crosses as Inf, and this turns the whole
    result to NaN rather than leave Inf in some elements. ``axes``: where
    the checked values differ per rank (a reduce-scatter's blocks), the ranks
    decide together (one ``pmin`` of a flag); gathered sums are identical on
    every rank and need none.
    """
    picked = [v for v, c in zip(values, checked) if c]
    if not picked:
        return values
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in picked]))
    if axes:
        finite = lax.pmin(finite.astype(jnp.int32), axes) > 0
    return [jnp.where(finite, v, jnp.nan).astype(v.dtype) if c else v
            for v, c in zip(values, checked)]

