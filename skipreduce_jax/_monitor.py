"""The rank-deviation monitor: do the ranks' gradients differ steadily?

Random SkipReduce costs about what the information bound says when each
rank's gradient differs from the mean only by noise. When the ranks hold
different data (non-IID: other classes, other domains), each rank's gradient
also has a steady deviation, and every skip drops some of it: with the
paper's schedule (``balanced=False``) Random then needs far more steps than
the bound, or never gets there (``benchmarks/convergence.md``); balanced
schedules (the default) and ``control_variate`` are the remedies. This
module measures that steady deviation from what every rank already holds,
the update and the schedule, so it sends no bytes. It runs with
``balanced=False`` only: it assumes each step's schedule drawn afresh, and
balanced schedules take the error it measures out over each period.

How. At one piece of the ring let ``z_r = 1[rank r is summed] - (N - k) / N``
and ``u`` the update there (the mean over the ranks summed). The schedule is
drawn afresh every step, independently of the gradients, so with ``K`` the
covariance of ``z`` over the ring's ``N`` windows and ``W = (K^+)^(1/2)``,

    E[(N - k) (W z)_r u] = (K^(1/2) d)_r,

where ``d_r`` is rank r's deviation from the mean of all N. An exponential
average of the left side converges to the steady part of ``K^(1/2) d``, whose
squared norm is ``(N - k)^2`` times that of the skipped mean's error from
steady deviations (``sum_r z_r d_r / (N - k)``, of covariance ``K``); the
noise averages away at a known rate, which is subtracted. Random signs sketch
the per-rank, per-element products into :data:`SKETCH` numbers, so the state
is the same size for every N and model, and replicated.

The result, ``ratio``, is that error's squared norm over the update's: what
skipping adds, beyond the information bound, when the ranks differ steadily.
Measured (``benchmarks/convergence.md``, 8 ranks, skip ratio 0.5): at most
0.011 on every IID workload, 0.26-0.51 on the non-IID MLP, where Random
never reached the all-reduce's loss, and at most 0.017 there with
``control_variate=0.1``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from skipreduce_jax._guards import mix32

SKETCH = 1024  # numbers in the sketch of the per-rank deviations
DECAY = 0.99  # of the exponential averages: about 100 steps remembered
MIN_STEPS = 200  # skipped steps before ``ratio`` is reported
PARTS = 8  # signed sums per piece: more independent views of the same window
SAMPLE = 64  # elements read of each piece (default pieces hold 256 or more)
WARN_RATIO = 0.1  # warn when the ratio exceeds this


class NonIIDWarning(UserWarning):
    """The ranks' gradients differ steadily (see ``skip_reduce``'s ``monitor``)."""


class MonitorState(NamedTuple):
    """The monitor's exponential averages; replicated, the same on every rank.

    Attributes:
      sketch: float32[SKETCH], the average sketch of the per-rank deviations.
      power: float32, the average squared norm of one step's sketch.
      norm: float32, the average squared norm of the update.
      steps: int32, the skipped steps observed.
      ratio: float32, the squared norm of the skipped mean's error from
        steady deviations over the update's (NaN before ``MIN_STEPS``
        skipped steps).
    """

    sketch: jax.Array
    power: jax.Array
    norm: jax.Array
    steps: jax.Array
    ratio: jax.Array


def init() -> MonitorState:
    zero = jnp.zeros((), jnp.float32)
    return MonitorState(jnp.zeros((SKETCH,), jnp.float32), zero, zero,
                        jnp.zeros((), jnp.int32), jnp.full((), jnp.nan, jnp.float32))


def _signs(index: jax.Array, salt: int) -> jax.Array:
    """Fixed pseudo-random +1/-1 (float32) at uint32 positions ``index``.

    One pattern per ``salt``.
    """
    bits = mix32(index + jnp.uint32((salt * 0x9E3779B9) % 2**32)) >> 31
    return 1.0 - 2.0 * bits.astype(jnp.float32)


@functools.cache
def _whitener(n: int, num_skip: int) -> np.ndarray:
    """``(K^+)^(1/2)``, ``K`` the covariance of ``z`` over the N windows.

    Ring chunk ``c`` sums the ranks ``c, c - 1, ..., c - (N - 1 - k)``
    (``SkipSchedule.contributes``; plain numpy here, as this runs at trace
    time, also for compile-only devices), and a piece rides in each chunk
    with probability 1 / N.
    """
    windows = np.zeros((n, n))
    for c in range(n):
        windows[c, [(c - t) % n for t in range(n - num_skip)]] = 1.0
    z = windows - (n - num_skip) / n
    values, vectors = np.linalg.eigh(z.T @ z / n)
    kept = values > 1e-9 * values.max()
    inverse = np.zeros_like(values)
    inverse[kept] = 1 / np.sqrt(values[kept])
    return (vectors * inverse) @ vectors.T


def observe(state: MonitorState, pieces: list[tuple[jax.Array, jax.Array]],
            update_norm: jax.Array, *, n: int, num_skip: int) -> MonitorState:
    """The state after one skipped step.

    Args:
      state: the state before.
      pieces: per bucket, ``(y, summed)``: ``y`` float32[inner * N * C,
        parts], the update's signed sums over each piece (:func:`piece_sums`),
        and ``summed`` bool[N ranks, N, C], which ranks the schedule summed
        into each (slot, column) piece.
      update_norm: the squared norm of the elements the sums read.
      n: N, the ranks.
      num_skip: k.
    """
    whiten = jnp.asarray(_whitener(n, num_skip), jnp.float32)
    step = jnp.zeros((SKETCH,), jnp.float32)
    start = 0
    for b, (y, summed) in enumerate(pieces):
        z = summed.astype(jnp.float32) - (n - num_skip) / n
        w = jnp.einsum("ab,bsj->asj", whiten, z)
        # An inner axis's L copies of the ring follow one schedule.
        y = jnp.sum(y.reshape((-1,) + w.shape[1:] + y.shape[-1:]), axis=0)
        # (rank, part) products, hashed into the sketch with random signs.
        products = w[..., None] * y[None]
        index = jax.lax.iota(jnp.uint32, products.size).reshape(products.shape)
        products = _signs(index, salt=2 * b + 1) * products
        slots = (start + np.arange(products.size)) % SKETCH
        step = step.at[slots].add((n - num_skip) * products.reshape(-1))
        start += products.size
    steps = state.steps + 1
    new = state._replace(
        sketch=DECAY * state.sketch + (1 - DECAY) * step,
        power=DECAY * state.power + (1 - DECAY) * jnp.sum(step**2),
        norm=DECAY * state.norm + (1 - DECAY) * update_norm.astype(jnp.float32),
        steps=steps)
    return new._replace(ratio=_ratio(new, n - num_skip))


def _ratio(state: MonitorState, contributors: int) -> jax.Array:
    """The steady error's squared norm over the update's, from the averages."""
    kept = DECAY ** state.steps.astype(jnp.float32)  # the averages' bias
    debias = 1.0 / jnp.maximum(1.0 - kept, 1e-6)
    # What the average of independent zero-mean steps keeps of their power.
    floor = (1 - DECAY) * (1 + kept) / ((1 + DECAY) * jnp.maximum(1 - kept, 1e-6))
    steady = (jnp.sum(state.sketch**2) * debias**2 - floor * state.power * debias
              ) / jnp.maximum(1.0 - floor, 1e-6)
    norm = contributors**2 * jnp.maximum(state.norm * debias, 1e-30)
    ratio = jnp.maximum(steady, 0.0) / norm
    return jnp.where(state.steps >= MIN_STEPS, ratio, jnp.nan)


def piece_sums(leaves: list[jax.Array], placed: list[tuple[int, int]], *,
               size: int, pieces: int, salt: int) -> tuple[jax.Array, jax.Array]:
    """Signed sums of one bucket of the update per piece, and their squares.

    The bucket is the ring's flat buffer of ``size`` elements, cut into
    ``pieces`` equal pieces (``inner`` copies of N slots of C columns);
    ``placed`` gives each leaf's ``(index, start)`` in it. Of each piece the
    first ``SAMPLE`` elements (all, if fewer), under fixed random signs, are
    summed in ``parts`` interleaved parts (``PARTS``, or fewer if it divides
    the piece's length less well). Leaf by leaf, so that no bucket-sized
    buffer is made.

    Returns:
      ``(sums, squares)``: float32[pieces, parts], and the float32 sum of
      the sampled elements' squares.
    """
    length = size // pieces
    parts = math.gcd(PARTS, length)
    sample = min(length, SAMPLE) // parts * parts
    sums, squares = jnp.zeros((pieces, parts), jnp.float32), jnp.float32(0)

    def add(sums, squares, values, at, before=0):
        """Adds the pieces of ``values`` (``before`` zeros first) from piece ``at``."""
        values = jnp.pad(values, (before, -(before + values.size) % length))
        values = values.reshape(-1, length)
        rows, cols = (jax.lax.broadcasted_iota(jnp.uint32, values.shape, d) for d in (0, 1))
        signs = _signs((rows + at) * length + cols, salt=2 * salt)

        def masked(values, signs):  # fused into one read where XLA fuses
            kept = jnp.where(cols[:, :values.shape[1]] < sample, values, 0)
            return jnp.sum((kept * signs).reshape(len(values), -1, parts), axis=1), \
                jnp.sum(kept**2)

        def sliced(values, signs):  # XLA:CPU copies what it reads: read less
            return masked(values[:, :sample], signs[:, :sample])

        part, sq = jax.lax.platform_dependent(values, signs, cpu=sliced, default=masked)
        return sums.at[at:at + len(values)].add(part), squares + sq

    for index, start in placed:
        flat = jnp.ravel(leaves[index]).astype(jnp.float32)
        piece, lead = divmod(start, length)
        head = min((length - lead) % length, flat.size)
        if head:  # the end of a piece that an earlier leaf began
            sums, squares = add(sums, squares, flat[:head], piece, before=lead)
            piece += 1
        whole = (flat.size - head) // length * length
        if whole:  # whole pieces
            sums, squares = add(sums, squares, flat[head:head + whole], piece)
            piece += whole // length
        if head + whole < flat.size:  # the start of a piece
            sums, squares = add(sums, squares, flat[head + whole:], piece)
    return sums, squares


def rank_deviation(opt_state: Any) -> float | None:
    """The monitor's latest ratio: how much skipping loses to non-IID ranks.

    The squared norm of the skipped mean's error from the ranks' steady
    deviations, over the update's squared norm, estimated by ``skip_reduce``
    from the update and the schedule (``monitor=True``, the default). Near 0
    for IID ranks; above ``WARN_RATIO`` (0.1) Random SkipReduce with
    ``balanced=False`` costs steps beyond the information bound, and the
    default ``balanced=True`` or ``control_variate=0.1`` is the remedy.
    Reading it waits for the step that made ``opt_state``; log it with the
    loss.

    Args:
      opt_state: an optimizer state holding a :class:`SkipReduceState`
        (e.g. of ``optax.chain(skip_reduce(...), ...)``).

    Returns:
      The ratio (the largest, if several ``skip_reduce`` monitor), or None
      if none monitors or fewer than ``MIN_STEPS`` skipped steps were seen.

    Example:
      >>> tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, balanced=False),
      ...                  optax.sgd(0.1))
      >>> print(sr.rank_deviation(tx.init({"w": jnp.zeros(4)})))  # no step yet
      None
    """
    return _largest(ratios(opt_state))


def _largest(ratios: list[Any]) -> float | None:
    """The largest of ``ratios`` that is not NaN (None if none)."""
    values = [float(np.asarray(r.addressable_data(0)) if isinstance(r, jax.Array) else r)
              for r in ratios]
    values = [v for v in values if not math.isnan(v)]
    return max(values) if values else None


def ratios(tree: Any) -> list[Any]:
    """The ``ratio`` of every :class:`MonitorState` in a pytree.

    As arrays, also out of the ``nnx.Variable`` s an NNX optimizer keeps
    them in.
    """
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, MonitorState))
    return [leaf for node in nodes if isinstance(node, MonitorState)
            for leaf in jax.tree_util.tree_leaves(node.ratio)]


def warn_if_non_iid(ratios: list[Any], *, api: str) -> bool:
    """Warns (:class:`NonIIDWarning`) if one of ``ratios`` is above the line.

    Args:
      ratios: ``MonitorState.ratio`` values (read here: this waits for them).
      api: the name the warning starts with.

    Returns:
      True if it warned.
    """
    ratio = _largest(ratios)
    if ratio is None or ratio <= WARN_RATIO:
        return False
    warnings.warn(
        f"{api}: the ranks' gradients differ steadily (non-IID data: each rank "
        f"holds other classes or domains), and skipping drops part of that "
        f"each step: an error of {ratio:.0%} of the update's squared norm, "
        "beyond the information bound's, so Random SkipReduce with "
        "balanced=False needs more steps than the bound. Drop balanced=False "
        "(balanced schedules cancel this error over each period), pass "
        "control_variate=0.1 to skip_reduce, or shuffle the data across "
        "ranks; monitor=False turns the estimate off.",
        NonIIDWarning, stacklevel=4)
    return True
