"""The two compression baselines of the SkipReduce paper, as optax transforms.

Both are drop-in replacements for :func:`skipreduce_jax.skip_reduce`: the
first element of an ``optax.chain``, called inside ``jax.shard_map`` (with
``check_vma=True`` or ``False``) where ``axis_name`` is bound, taking each
rank's LOCAL gradients and returning averaged gradients that are identical on
every rank::

    tx = optax.chain(topk_reduce("data", density=0.01), optax.adam(1e-3))
    tx = optax.chain(powersgd_reduce("data", rank=4), optax.adam(1e-3))
    opt_state = skipreduce_jax.init_opt_state(tx, params, mesh, "data")
    step = skipreduce_jax.make_train_step(loss_fn, tx, mesh, "data")

* :func:`topk_reduce`: top-k sparsification with error memory (Aji and
  Heafield 2017; Lin et al. 2018, without momentum correction). Each rank adds
  its memory to its gradient, keeps the ``density`` fraction of largest
  magnitude, all-gathers the (value, index) pairs, scatter-adds them into a
  dense sum and divides by N. What it did not send stays in its memory.
* :func:`powersgd_reduce`: rank-r PowerSGD with error feedback (Vogels,
  Karimireddy and Jaggi 2019). Each matrix M (a >= 2-D leaf reshaped to 2-D)
  is replaced by ``P Q^T`` from one power-iteration step with a warm-started
  Q: two all-reduces of the small factors instead of one of M.

Their per-rank state (the top-k memory, the PowerSGD error) varies over the
data axis: it has a leading axis of size 1 inside ``shard_map`` and is stored
stacked to ``[N, ...]`` outside, sharded ``P(axis)``, like the error-feedback
residuals of ``skip_reduce``. The state classes declare those fields in
``per_rank_fields``, so :func:`skipreduce_jax.state_specs`,
:func:`skipreduce_jax.init_opt_state` and :func:`skipreduce_jax.make_train_step`
place them without further help.

:func:`topk_comm_bytes` and :func:`powersgd_comm_bytes` give the bytes each
device sends per step, with the ring formulas that
``skipreduce_jax.collective_traffic(text).bytes_per_device()`` applies to the
compiled program.

References:
  Aji, Heafield. Sparse Communication for Distributed Gradient Descent.
  EMNLP 2017. Lin, Han, Mao, Wang, Dally. Deep Gradient Compression. ICLR
  2018. Vogels, Karimireddy, Jaggi. PowerSGD: Practical Low-Rank Gradient
  Compression for Distributed Optimization. NeurIPS 2019.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import skipreduce_jax as sr
from skipreduce_jax import _collectives as coll

__all__ = [
    "PowerSGDState",
    "TopKState",
    "full_comm_bytes",
    "powersgd_comm_bytes",
    "powersgd_reduce",
    "topk_comm_bytes",
    "topk_reduce",
]


class TopKState(NamedTuple):
    """State of :func:`topk_reduce`.

    Attributes:
      count: int32 step counter.
      memory: with ``error_feedback`` (else ``optax.EmptyState()``): per
        leaf, what this rank has not sent yet, added to its next gradient.
        Each leaf has a leading axis of size 1 inside ``shard_map`` (stacked
        to N along the data axis outside; see
        :func:`skipreduce_jax.state_specs`).
    """

    count: jax.Array
    memory: Any

    # Placed per rank by skipreduce_jax.state_specs.
    per_rank_fields = ("memory",)


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd_reduce`.

    Attributes:
      count: int32 step counter; plain all-reduce while ``count <
        warmup_steps``.
      q: one float32 ``[m, rank]`` factor per compressed leaf (in the order
        of ``jax.tree_util.tree_leaves``), the warm start of the next power
        iteration. Identical on every rank.
      error: with ``error_feedback`` (else ``()``): one array per compressed
        leaf, shaped like it with a leading axis of size 1 inside
        ``shard_map``: what this rank's gradient lost to the low-rank
        approximation, added back next step. Per rank.
    """

    count: jax.Array
    q: tuple[jax.Array, ...]
    error: tuple[jax.Array, ...]

    # Placed per rank by skipreduce_jax.state_specs.
    per_rank_fields = ("error",)


# ----------------------------------------------------------------------------
# Shared helpers.
# ----------------------------------------------------------------------------


def _check_local(leaves: list[jax.Array], axis_name: str, api: str) -> None:
    """Refuses gradients that autodiff already summed over the data axis."""
    if not coll.vma_checked(axis_name):
        return  # check_vma=False: nothing to check
    for leaf in leaves:
        if axis_name not in coll.varying_axes(leaf):
            raise ValueError(
                f"{api}: got a gradient of shape {leaf.shape} that is "
                f"replicated over {axis_name!r}: autodiff already summed it. "
                "Compute local gradients with skipreduce_jax.local_grad / "
                "local_value_and_grad.")


def _per_rank_zeros(shape: tuple[int, ...], dtype: Any,
                    axis_name: str) -> jax.Array:
    """Zeros with a leading axis of 1, typed varying when the axis is bound."""
    zeros = jnp.zeros((1,) + tuple(shape), dtype)
    try:
        return sr.to_varying(zeros, axis_name)
    except NameError:  # init outside shard_map (e.g. jax.eval_shape)
        return zeros


def _check_fraction(value: Any, name: str, api: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0.0 < value <= 1.0:
        raise ValueError(f"{api}: {name}={value!r} must be a number in (0, 1].")
    return float(value)


def _check_count(value: Any, name: str, api: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
            value < low:
        raise ValueError(f"{api}: {name}={value!r} must be an int >= {low}.")
    return int(value)


def _size(leaf: Any) -> int:
    return math.prod(np.shape(leaf))


def _ring_allreduce_bytes(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes


def full_comm_bytes(params: Any, n: int) -> float:
    """Bytes per device per step of a full ring all-reduce of every leaf.

    ``2 (N - 1) / N * sum(leaf bytes)``.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct`` shaped like the
        gradients.
      n: N, the size of the data axis.

    Returns:
      Bytes each device sends.
    """
    return sum(_ring_allreduce_bytes(_size(x) * np.dtype(x.dtype).itemsize, n)
               for x in jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------
# Top-k.
# ----------------------------------------------------------------------------

_TOPK = "topk_reduce"


@dataclasses.dataclass(frozen=True)
class _TopKConfig:
    axis_name: str
    density: float
    per_leaf: bool
    error_feedback: bool
    min_size: int
    index_dtype: Any

    def groups(self, leaves: list[Any]) -> tuple[list[list[int]], list[int]]:
        """Leaf indices of each sparsified group, and the dense leaves."""
        sparse = [i for i, x in enumerate(leaves) if _size(x) >= self.min_size
                  and _size(x) > 0]
        dense = [i for i, x in enumerate(leaves) if i not in set(sparse)]
        if self.per_leaf:
            return [[i] for i in sparse], dense
        return ([sparse] if sparse else []), dense

    def k(self, size: int) -> int:
        """Elements sent per rank from a group of ``size`` elements."""
        return min(size, max(1, math.ceil(self.density * size)))


def _index_dtype(index_dtype: Any) -> np.dtype:
    """What the indices travel in: int64 is int32 without jax_enable_x64."""
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(index_dtype))
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{_TOPK}: index_dtype={index_dtype!r} must be an "
                        "integer dtype.")
    return dtype


def topk_reduce(
    axis_name: str,
    *,
    density: float = 0.01,
    per_leaf: bool = True,
    error_feedback: bool = True,
    min_size: int = 0,
    index_dtype: Any = jnp.int32,
) -> optax.GradientTransformationExtraArgs:
    """Top-k sparsified gradient averaging with error memory.

    Per step and per group (a leaf, or with ``per_leaf=False`` all sparsified
    leaves flattened into one vector), each rank

    1. adds its memory to its local gradient: ``a = g + m``;
    2. picks the ``k = max(1, ceil(density * size))`` entries of ``a`` of
       largest magnitude (``lax.top_k``);
    3. all-gathers the k values and their int32 indices over ``axis_name``
       (``[N, k]`` each, identical on every rank);
    4. scatter-adds the N rows, one rank at a time in rank order (so every
       rank sums in the same order, bit-identically), and divides by N;
    5. keeps ``a`` with the sent entries zeroed as its new memory.

    So ``N * output + sum_r(new memory_r) = sum_r(a_r)`` exactly up to
    rounding: nothing is lost, only delayed. Leaves with fewer than
    ``min_size`` elements get a plain ``lax.pmean``. With ``density=1`` the
    output is the mean of the local gradients (``lax.pmean``).

    Args:
      axis_name: the data-parallel mesh axis.
      density: the fraction of each group's entries a rank sends, in (0, 1].
      per_leaf: top-k of each leaf separately (True), or of the
        concatenation of all sparsified leaves (False; they are summed in
        their common ``jnp.result_type``).
      error_feedback: keep the unsent remainder (the memory) per rank.
      min_size: leaves with fewer elements are all-reduced in full.
      index_dtype: the dtype the indices travel in.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a :class:`TopKState`.

    Example:
      >>> tx = optax.chain(topk_reduce("data", density=0.01), optax.adam(1e-3))
    """
    if not isinstance(axis_name, str):
        raise TypeError(f"{_TOPK}: axis_name={axis_name!r} must be a str.")
    config = _TopKConfig(
        axis_name, _check_fraction(density, "density", _TOPK), bool(per_leaf),
        bool(error_feedback), _check_count(min_size, "min_size", _TOPK),
        _index_dtype(index_dtype))

    def init_fn(params):
        memory = optax.EmptyState()
        if config.error_feedback:
            memory = jax.tree_util.tree_map(
                lambda p: _per_rank_zeros(np.shape(p), p.dtype, axis_name),
                params)
        return TopKState(jnp.zeros((), jnp.int32), memory)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _topk_update(config, updates, state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _topk_update(config: _TopKConfig, updates: Any,
                 state: TopKState) -> tuple[Any, TopKState]:
    n = coll.axis_size(config.axis_name, api=_TOPK)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    _check_local(leaves, config.axis_name, _TOPK)
    if config.error_feedback:
        memory = treedef.flatten_up_to(state.memory)
        leaves = [g + m[0].astype(g.dtype) for g, m in zip(leaves, memory)]
    groups, dense = config.groups(leaves)
    out: list[Any] = [None] * len(leaves)
    kept: list[Any] = [None] * len(leaves)

    for group in groups:
        dtype = jnp.result_type(*[leaves[i] for i in group])
        flat = jnp.concatenate([leaves[i].astype(dtype).reshape(-1)
                                for i in group])
        k = config.k(flat.size)
        _, idx = lax.top_k(jnp.abs(flat), k)
        vals = flat[idx]
        all_vals = lax.all_gather(vals, config.axis_name, to="invarying")
        all_idx = lax.all_gather(idx.astype(config.index_dtype),
                                 config.axis_name, to="invarying")
        total = jnp.zeros(flat.shape, dtype)
        for r in range(n):  # fixed order: the same float sum on every rank
            total = total.at[all_idx[r]].add(all_vals[r], unique_indices=True)
        mean = total / n
        remainder = flat.at[idx].set(0)
        offset = 0
        for i in group:
            size = leaves[i].size
            shape, leaf_dtype = leaves[i].shape, leaves[i].dtype
            part = slice(offset, offset + size)
            out[i] = mean[part].reshape(shape).astype(leaf_dtype)
            kept[i] = remainder[part].reshape(shape).astype(leaf_dtype)
            offset += size

    if dense:
        reduced = lax.pmean([leaves[i] for i in dense], config.axis_name)
        for i, value in zip(dense, reduced):
            out[i] = value
            kept[i] = jnp.zeros_like(leaves[i])

    new_memory = state.memory
    if config.error_feedback:
        new_memory = jax.tree_util.tree_unflatten(
            treedef, [x[None].astype(m.dtype) for x, m in zip(kept, memory)])
    return (jax.tree_util.tree_unflatten(treedef, out),
            TopKState(state.count + 1, new_memory))


def topk_comm_bytes(params: Any, n: int, **topk_kwargs: Any) -> float:
    """Bytes each device sends per step of :func:`topk_reduce`.

    A ring all-gather of N blocks of k entries sends ``(N - 1) / N`` of its
    ``N * k``-entry result from each device, so per sparsified group::

        (N - 1) * k * (value bytes + index bytes),
        k = max(1, ceil(density * size))

    plus ``2 (N - 1) / N * bytes`` for each leaf below ``min_size`` (a ring
    all-reduce). With N ranks this grows with N, unlike an all-reduce: top-k
    pays off only while ``N * density * (1 + index/value bytes) < 2``.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      n: N, the size of the data axis.
      **topk_kwargs: the keyword arguments of :func:`topk_reduce`.

    Returns:
      Bytes per device per step.

    Example:
      >>> topk_comm_bytes({"w": jnp.zeros((1000, 100))}, 8, density=0.01)
      56000.0
    """
    args = inspect.signature(topk_reduce).bind("data", **topk_kwargs)
    args.apply_defaults()
    a = args.arguments
    config = _TopKConfig(
        "data", _check_fraction(a["density"], "density", _TOPK),
        bool(a["per_leaf"]), bool(a["error_feedback"]),
        _check_count(a["min_size"], "min_size", _TOPK),
        _index_dtype(a["index_dtype"]))
    leaves = jax.tree_util.tree_leaves(params)
    groups, dense = config.groups(leaves)
    sent = 0.0
    for group in groups:
        dtype = jnp.result_type(*[leaves[i].dtype for i in group])
        k = config.k(sum(_size(leaves[i]) for i in group))
        sent += (n - 1) * k * (np.dtype(dtype).itemsize +
                               config.index_dtype.itemsize)
    for i in dense:
        sent += _ring_allreduce_bytes(
            _size(leaves[i]) * np.dtype(leaves[i].dtype).itemsize, n)
    return float(sent)


# ----------------------------------------------------------------------------
# PowerSGD.
# ----------------------------------------------------------------------------

_POWERSGD = "powersgd_reduce"


@dataclasses.dataclass(frozen=True)
class _PowerSGDConfig:
    axis_name: str
    rank: int
    warmup_steps: int
    error_feedback: bool
    min_compression_rate: float
    seed: int

    def compressed(self, leaves: list[Any]) -> list[bool]:
        """One bool per leaf: True when it is compressed to rank ``rank``."""
        flags = []
        for leaf in leaves:
            if np.ndim(leaf) < 2:
                flags.append(False)
                continue
            rows, cols = _matrix_shape(np.shape(leaf))
            low_rank = (rows + cols) * self.rank
            # The QR of P [rows, rank] keeps rank columns only if rows >= rank.
            flags.append(rows >= self.rank and cols >= 1 and rows * cols >=
                         self.min_compression_rate * low_rank)
        return flags


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A >= 2-D shape as (rows, cols): all leading axes times the last one."""
    return math.prod(shape[:-1]), shape[-1]


def powersgd_reduce(
    axis_name: str,
    *,
    rank: int = 4,
    warmup_steps: int = 10,
    error_feedback: bool = True,
    min_compression_rate: float = 2.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """PowerSGD gradient averaging (rank-r, error feedback, warm start).

    Each leaf of two or more dimensions is viewed as a matrix ``[rows,
    cols]`` (all leading axes times the last: a flax ``Dense`` kernel is
    ``[in, out]``) and compressed when ``rows * cols >= min_compression_rate
    * (rows + cols) * rank``; the other leaves (biases, small matrices) get a
    plain ``lax.pmean``. Per step, for each compressed matrix, each rank:

    1. ``M = G + E`` (its local gradient plus its error);
    2. ``P = M Q`` with the shared warm-start ``Q [cols, rank]``; ``P =
       pmean(P)`` (all-reduce 1);
    3. orthonormalizes P (reduced QR; identical input on every rank, so
       identical output);
    4. ``Q = M^T P``; ``Q = pmean(Q)`` (all-reduce 2);
    5. returns ``P Q^T`` (the same on every rank), keeps ``E = M - P Q^T``
       and Q for the next step.

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
      An ``optax.GradientTransformationExtraArgs`` with a
      :class:`PowerSGDState`.

    Example:
      >>> tx = optax.chain(powersgd_reduce("data", rank=4), optax.adam(1e-3))
    """
    if not isinstance(axis_name, str):
        raise TypeError(f"{_POWERSGD}: axis_name={axis_name!r} must be a str.")
    config = _PowerSGDConfig(
        axis_name, _check_count(rank, "rank", _POWERSGD, low=1),
        _check_count(warmup_steps, "warmup_steps", _POWERSGD),
        bool(error_feedback), float(min_compression_rate),
        _check_count(seed, "seed", _POWERSGD))

    def init_fn(params):
        leaves = jax.tree_util.tree_leaves(params)
        flags = config.compressed(leaves)
        key = jax.random.key(config.seed)
        qs, errors = [], []
        for i, (leaf, flag) in enumerate(zip(leaves, flags)):
            if not flag:
                continue
            _, cols = _matrix_shape(np.shape(leaf))
            qs.append(jax.random.normal(jax.random.fold_in(key, i),
                                        (cols, config.rank), jnp.float32))
            if config.error_feedback:
                errors.append(_per_rank_zeros(np.shape(leaf), jnp.float32,
                                              axis_name))
        return PowerSGDState(jnp.zeros((), jnp.int32), tuple(qs), tuple(errors))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _powersgd_update(config, updates, state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _orthonormalize(p: jax.Array) -> jax.Array:
    q, _ = jnp.linalg.qr(p, mode="reduced")
    return q


def _powersgd_update(config: _PowerSGDConfig, updates: Any,
                     state: PowerSGDState) -> tuple[Any, PowerSGDState]:
    coll.axis_size(config.axis_name, api=_POWERSGD)
    axis = config.axis_name
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    _check_local(leaves, axis, _POWERSGD)
    flags = config.compressed(leaves)
    if len(state.q) != sum(flags):
        raise ValueError(
            f"{_POWERSGD}: the state holds {len(state.q)} factors but the "
            f"gradients have {sum(flags)} compressible leaves: was the state "
            "made by tx.init on params shaped like these gradients?")
    picked = [g for g, f in zip(leaves, flags) if f]
    mats = [g.astype(jnp.float32).reshape(_matrix_shape(g.shape))
            for g in picked]
    if config.error_feedback:
        mats = [m + e[0].reshape(m.shape) for m, e in zip(mats, state.error)]

    def full(mats, qs):
        zeros = [jnp.zeros_like(m) for m in mats]
        return lax.pmean(mats, axis), list(qs), zeros

    def compressed(mats, qs):
        ps = lax.pmean([m @ q for m, q in zip(mats, qs)], axis)
        ps = [_orthonormalize(p) for p in ps]
        new_qs = lax.pmean([m.T @ p for m, p in zip(mats, ps)], axis)
        approx = [p @ q.T for p, q in zip(ps, new_qs)]
        return approx, new_qs, [m - a for m, a in zip(mats, approx)]

    if not mats:
        approx, qs, errors = [], [], []
    elif config.warmup_steps > 0:
        approx, qs, errors = lax.cond(state.count < config.warmup_steps, full,
                                      compressed, mats, list(state.q))
    else:
        approx, qs, errors = compressed(mats, list(state.q))

    rest = lax.pmean([g for g, f in zip(leaves, flags) if not f], axis)
    approx_it, rest_it = iter(approx), iter(rest)
    out = [next(approx_it).reshape(g.shape).astype(g.dtype) if f
           else next(rest_it) for g, f in zip(leaves, flags)]
    new_errors = state.error
    if config.error_feedback:
        new_errors = tuple(e.reshape(old.shape) for e, old in
                           zip(errors, state.error))
    return (jax.tree_util.tree_unflatten(treedef, out),
            PowerSGDState(state.count + 1, tuple(qs), new_errors))


def powersgd_comm_bytes(params: Any, n: int, **powersgd_kwargs: Any) -> float:
    """Bytes each device sends per step of :func:`powersgd_reduce` (after
    the warm-up steps).

    Two ring all-reduces per compressed ``[rows, cols]`` leaf, of the float32
    factors ``P [rows, r]`` and ``Q [cols, r]``::

        2 (N - 1) / N * 4 * r * (rows + cols)

    plus ``2 (N - 1) / N * bytes`` for each leaf all-reduced in full. During
    the warm-up steps it is :func:`full_comm_bytes` (with float32 leaves).

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      n: N, the size of the data axis.
      **powersgd_kwargs: the keyword arguments of :func:`powersgd_reduce`.

    Returns:
      Bytes per device per step.

    Example:
      >>> powersgd_comm_bytes({"w": jnp.zeros((1000, 100))}, 8, rank=4)
      30800.0
    """
    args = inspect.signature(powersgd_reduce).bind("data", **powersgd_kwargs)
    args.apply_defaults()
    a = args.arguments
    config = _PowerSGDConfig("data", _check_count(a["rank"], "rank",
                                                  _POWERSGD, low=1),
                             int(a["warmup_steps"]), bool(a["error_feedback"]),
                             float(a["min_compression_rate"]), int(a["seed"]))
    leaves = jax.tree_util.tree_leaves(params)
    sent = 0.0
    for leaf, flag in zip(leaves, config.compressed(leaves)):
        if flag:
            rows, cols = _matrix_shape(np.shape(leaf))
            sent += _ring_allreduce_bytes(4 * config.rank * (rows + cols), n)
        else:
            sent += _ring_allreduce_bytes(
                _size(leaf) * np.dtype(leaf.dtype).itemsize, n)
    return float(sent)
