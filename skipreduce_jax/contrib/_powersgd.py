"""PowerSGD (rank r, error feedback, warm start), as an optax transformation.

The method is described in :func:`powersgd_reduce`, its per-rank state (placed
by ``state_specs`` through ``per_rank_fields``) in :class:`PowerSGDState`.

Reference: Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization. NeurIPS 2019.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.per_rank import check_local, per_rank_zeros
from skipreduce_jax._ring import traffic
from skipreduce_jax._types import PyTree
from skipreduce_jax.contrib._common import leaf_bytes, method_settings

_API = "powersgd_reduce"


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd_reduce`.

    Attributes:
      count: int32 step counter; plain all-reduce while ``count < warmup_steps``.
      q: one float32 ``[m, rank]`` factor per compressed leaf (in the order of
        ``jax.tree_util.tree_leaves``), the warm start of the next power iteration.
        Identical on every rank.
      error: with ``error_feedback`` (else ``()``): one array per compressed leaf,
        shaped like it with a leading axis of size 1 inside ``shard_map``: what this
        rank's gradient lost to the low-rank approximation, added back next step.
        Per rank.
    """

    count: jax.Array
    q: tuple[jax.Array, ...]
    error: tuple[jax.Array, ...]

    # Placed per rank by skipreduce_jax.state_specs.
    per_rank_fields = ("error",)


@dataclasses.dataclass(frozen=True)
class _PowerSGDConfig:
    axis_name: str
    rank: int
    warmup_steps: int
    error_feedback: bool
    min_compression_rate: float
    seed: int

    @classmethod
    def make(cls, axis_name: Any, rank: Any, warmup_steps: Any,
             error_feedback: Any, min_compression_rate: Any, seed: Any
             ) -> _PowerSGDConfig:
        """Checks the arguments of :func:`powersgd_reduce`."""
        return cls(
            checks.check_axis_name(axis_name, api=_API),
            checks.check_int(rank, "rank", api=_API, minimum=1),
            checks.check_int(warmup_steps, "warmup_steps", api=_API, minimum=0),
            checks.check_bool(error_feedback, "error_feedback", api=_API),
            checks.check_real(min_compression_rate, "min_compression_rate", api=_API),
            checks.check_int(seed, "seed", api=_API, minimum=0))

    def compressed(self, leaves: list[Any]) -> list[bool]:
        """One bool per leaf: True when it is compressed to rank ``rank``."""
        flags = []
        for leaf in leaves:
            rows, cols = _matrix_shape(np.shape(leaf)) if np.ndim(leaf) >= 2 else (0, 0)
            low_rank = (rows + cols) * self.rank
            # The QR of P [rows, rank] keeps rank columns only if rows >= rank.
            flags.append(rows >= self.rank and cols >= 1 and rows * cols >=
                         self.min_compression_rate * low_rank)
        return flags


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A >= 2-D shape as (rows, cols): all leading axes times the last one."""
    return math.prod(shape[:-1]), shape[-1]


def powersgd_reduce(axis_name: str, *, rank: int = 4, warmup_steps: int = 10,
                    error_feedback: bool = True, min_compression_rate: float = 2.0,
                    seed: int = 0) -> optax.GradientTransformationExtraArgs:
    """PowerSGD gradient averaging (rank-r, error feedback, warm start).

    A drop-in replacement for :func:`skipreduce_jax.skip_reduce`, used as
    :func:`topk_reduce` is (on each rank's LOCAL gradients). Each leaf of two
    or more dimensions is viewed as a matrix ``[rows, cols]`` (all leading
    axes times the last: a flax ``Dense`` kernel is ``[in, out]``) and
    compressed when ``rows * cols >= min_compression_rate * (rows + cols) *
    rank``; the other leaves (biases, small matrices) get a plain
    ``lax.pmean``. Per step, for each compressed matrix, each rank:

    1. ``M = G + E`` (its local gradient plus its error);
    2. ``P = pmean(M Q)`` with the shared warm-start ``Q [cols, rank]`` (all-reduce 1);
    3. orthonormalizes P (reduced QR: the same input, so output, on every rank);
    4. ``Q = pmean(M^T P)`` (all-reduce 2);
    5. returns ``P Q^T`` (the same on every rank), keeps ``E = M - P Q^T`` and Q.

    For the first ``warmup_steps`` steps every leaf gets a plain
    ``lax.pmean`` (and E stays 0). Both paths are compiled once;
    ``lax.cond`` picks one per step. Computation is in float32.

    Args:
      axis_name: the data-parallel mesh axis.
      rank: r, the rank of the approximation.
      warmup_steps: steps of plain all-reduce before compressing.
      error_feedback: keep the per-rank error E.
      min_compression_rate: compress a leaf only if its size is at least this
        many times that of its two factors (as PyTorch's PowerSGD hook).
      seed: seeds the initial Q (the same on every rank).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a :class:`PowerSGDState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from skipreduce_jax.contrib import powersgd_reduce
      >>> tx = optax.chain(powersgd_reduce("data", rank=4), optax.adam(1e-3))
      >>> state = powersgd_reduce("data", rank=4).init(
      ...     {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)})
      >>> state.q[0].shape, state.error[0].shape  # "b" is not compressed
      ((32, 4), (1, 64, 32))
    """
    config = _PowerSGDConfig.make(axis_name, rank, warmup_steps,
                                  error_feedback, min_compression_rate, seed)

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        flags = config.compressed(leaves)
        key = jax.random.key(config.seed)
        qs, errors = [], []
        for i, (leaf, flag) in enumerate(zip(leaves, flags, strict=True)):
            if not flag:
                continue
            _, cols = _matrix_shape(np.shape(leaf))
            qs.append(jax.random.normal(jax.random.fold_in(key, i),
                                        (cols, config.rank), jnp.float32))
            if config.error_feedback:
                errors.append(per_rank_zeros(np.shape(leaf), jnp.float32, (axis_name,)))
        return PowerSGDState(jnp.zeros((), jnp.int32), tuple(qs), tuple(errors))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _powersgd_update(config, updates, state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _powersgd_update(config: _PowerSGDConfig, updates: Any,
                     state: PowerSGDState) -> tuple[Any, PowerSGDState]:
    axis = config.axis_name
    checks.axis_size(axis, api=_API)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    check_local(leaves, axis, api=_API)
    flags = config.compressed(leaves)
    if len(state.q) != sum(flags):
        raise ValueError(
            f"{_API}: the state holds {len(state.q)} factors but the gradients have "
            f"{sum(flags)} compressible leaves: was the state made by tx.init on params "
            "shaped like these gradients?")
    mats = [g.astype(jnp.float32).reshape(_matrix_shape(g.shape))
            for g, f in zip(leaves, flags, strict=True) if f]
    if config.error_feedback:
        mats = [m + e[0].reshape(m.shape) for m, e in zip(mats, state.error, strict=True)]

    def full(mats, qs):
        return lax.pmean(mats, axis), list(qs), [jnp.zeros_like(m) for m in mats]

    def compressed(mats, qs):
        ps = lax.pmean([m @ q for m, q in zip(mats, qs, strict=True)], axis)
        ps = [jnp.linalg.qr(p, mode="reduced")[0] for p in ps]  # orthonormalized
        new_qs = lax.pmean([m.T @ p for m, p in zip(mats, ps, strict=True)], axis)
        approx = [p @ q.T for p, q in zip(ps, new_qs, strict=True)]
        return approx, new_qs, [m - a for m, a in zip(mats, approx, strict=True)]

    if not mats:
        approx, qs, errors = [], [], []
    elif config.warmup_steps > 0:
        approx, qs, errors = lax.cond(state.count < config.warmup_steps, full,
                                      compressed, mats, list(state.q))
    else:
        approx, qs, errors = compressed(mats, list(state.q))

    rest = lax.pmean([g for g, f in zip(leaves, flags, strict=True) if not f], axis)
    approx_it, rest_it = iter(approx), iter(rest)
    out = [next(approx_it).reshape(g.shape).astype(g.dtype) if f
           else next(rest_it) for g, f in zip(leaves, flags, strict=True)]
    new_errors = state.error
    if config.error_feedback:
        new_errors = tuple(e.reshape(old.shape) for e, old in zip(errors, state.error, strict=True))
    return (jax.tree_util.tree_unflatten(treedef, out),
            PowerSGDState(state.count + 1, tuple(qs), new_errors))


def powersgd_comm_bytes(params: PyTree, n: int, **powersgd_kwargs: Any) -> float:
    """Bytes each device sends per step of :func:`powersgd_reduce`, after warm-up.

    Two ring all-reduces per compressed ``[rows, cols]`` leaf, of the float32
    factors ``P [rows, r]`` and ``Q [cols, r]``: ``2 (N - 1) / N * 4 * r * (rows + cols)``,
    plus :func:`full_comm_bytes` of the other leaves. During the warm-up steps it
    is :func:`full_comm_bytes` (with float32 leaves).

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      n: N, the size of the data axis.
      **powersgd_kwargs: the keyword arguments of :func:`powersgd_reduce`.

    Example:
      >>> import jax.numpy as jnp
      >>> from skipreduce_jax.contrib import powersgd_comm_bytes
      >>> powersgd_comm_bytes({"w": jnp.zeros((1000, 100))}, 8, rank=4)
      30800.0
    """
    config = _PowerSGDConfig.make(**method_settings(
        powersgd_reduce, powersgd_kwargs, api="powersgd_comm_bytes"))
    leaves = jax.tree_util.tree_leaves(params)
    sent = 0.0
    for leaf, flag in zip(leaves, config.compressed(leaves), strict=True):
        if flag:  # the float32 P [rows, r] and Q [cols, r]
            nbytes = 4 * config.rank * sum(_matrix_shape(np.shape(leaf)))
        else:
            nbytes = leaf_bytes(leaf)
        sent += traffic.ring_allreduce_bytes(nbytes, n)
    return float(sent)
