"""Top-k sparsification with error memory, as an optax transformation.

The method is described in :func:`topk_reduce`, its per-rank state (placed by
``state_specs`` through ``per_rank_fields``) in :class:`TopKState`.

Reference: Aji, Heafield. Sparse Communication for Distributed Gradient
Descent. EMNLP 2017; Lin, Han, Mao, Wang, Dally. Deep Gradient Compression.
ICLR 2018 (here without momentum correction).
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
from skipreduce_jax._types import DTypeLike, PyTree
from skipreduce_jax.contrib._common import leaf_bytes, leaf_size, method_settings

_API = "topk_reduce"


class TopKState(NamedTuple):
    """State of :func:`topk_reduce`.

    Attributes:
      count: int32 step counter.
      memory: with ``error_feedback`` (else ``optax.EmptyState()``): per leaf, what
        this rank has not sent yet, added to its next gradient. Each leaf has a
        leading axis of size 1 inside ``shard_map`` (stacked to N along the data
        axis outside; see :func:`skipreduce_jax.state_specs`).
    """

    count: jax.Array
    memory: PyTree

    # Placed per rank by skipreduce_jax.state_specs.
    per_rank_fields = ("memory",)


@dataclasses.dataclass(frozen=True)
class _TopKConfig:
    axis_name: str
    density: float
    per_leaf: bool
    error_feedback: bool
    min_size: int
    index_dtype: np.dtype

    @classmethod
    def make(cls, axis_name: Any, density: Any, per_leaf: Any,
             error_feedback: Any, min_size: Any, index_dtype: Any
             ) -> _TopKConfig:
        """Checks the arguments of :func:`topk_reduce`."""
        return cls(
            checks.check_axis_name(axis_name, api=_API),
            checks.check_real(density, "density", api=_API, maximum=1.0, positive=True),
            checks.check_bool(per_leaf, "per_leaf", api=_API),
            checks.check_bool(error_feedback, "error_feedback", api=_API),
            checks.check_int(min_size, "min_size", api=_API, minimum=0),
            _index_dtype(index_dtype))

    def groups(self, leaves: list[Any]) -> tuple[list[list[int]], list[int]]:
        """Leaf indices of each sparsified group, and the dense leaves."""
        sparse = [i for i, x in enumerate(leaves) if leaf_size(x) >= max(self.min_size, 1)]
        dense = sorted(set(range(len(leaves))) - set(sparse))
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
        raise TypeError(f"{_API}: index_dtype={index_dtype!r} must be an "
                        "integer dtype, e.g. jnp.int32.")
    return dtype


def topk_reduce(axis_name: str, *, density: float = 0.01, per_leaf: bool = True,
                error_feedback: bool = True, min_size: int = 0,
                index_dtype: DTypeLike = jnp.int32) -> optax.GradientTransformationExtraArgs:
    """Top-k sparsified gradient averaging with error memory.

    A drop-in replacement for :func:`skipreduce_jax.skip_reduce`: the first
    element of an ``optax.chain``, called inside ``jax.shard_map`` where
    ``axis_name`` is bound, on each rank's LOCAL gradients. Per step and per
    group (a leaf, or with ``per_leaf=False`` all sparsified leaves flattened
    into one vector), each rank

    1. adds its memory to its local gradient: ``a = g + m``;
    2. picks the ``k = max(1, ceil(density * size))`` entries of ``a`` of largest magnitude;
    3. all-gathers the k values and their indices (``[N, k]`` each, the same on every rank);
    4. scatter-adds the N rows in rank order (so every rank sums bit-identically), divides by N;
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
      index_dtype: the integer dtype the indices travel in.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a :class:`TopKState`.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from skipreduce_jax.contrib import topk_reduce
      >>> tx = optax.chain(topk_reduce("data", density=0.01), optax.adam(1e-3))
      >>> state = topk_reduce("data").init({"w": jnp.zeros((4, 3))})
      >>> state.memory["w"].shape  # one row per rank
      (1, 4, 3)
    """
    config = _TopKConfig.make(axis_name, density, per_leaf, error_feedback, min_size, index_dtype)

    def init_fn(params):
        memory = optax.EmptyState()
        if config.error_feedback:
            memory = jax.tree_util.tree_map(
                lambda p: per_rank_zeros(np.shape(p), p.dtype, (axis_name,)), params)
        return TopKState(jnp.zeros((), jnp.int32), memory)

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        return _topk_update(config, updates, state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _topk_update(config: _TopKConfig, updates: Any, state: TopKState) -> tuple[Any, TopKState]:
    n = checks.axis_size(config.axis_name, api=_API)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    check_local(leaves, config.axis_name, api=_API)
    if config.error_feedback:
        memory = treedef.flatten_up_to(state.memory)
        leaves = [g + m[0].astype(g.dtype) for g, m in zip(leaves, memory, strict=True)]
    groups, dense = config.groups(leaves)
    out: list[Any] = [None] * len(leaves)
    kept: list[Any] = [None] * len(leaves)

    for group in groups:
        dtype = jnp.result_type(*[leaves[i] for i in group])
        flat = jnp.concatenate([leaves[i].astype(dtype).reshape(-1) for i in group])
        _, idx = lax.top_k(jnp.abs(flat), config.k(flat.size))
        all_vals = lax.all_gather(flat[idx], config.axis_name, to="invarying")
        all_idx = lax.all_gather(idx.astype(config.index_dtype), config.axis_name, to="invarying")
        total = jnp.zeros(flat.shape, dtype)
        for r in range(n):  # fixed order: the same float sum on every rank
            total = total.at[all_idx[r]].add(all_vals[r], unique_indices=True)
        mean = total / n
        remainder = flat.at[idx].set(0)
        ends = np.cumsum([leaves[i].size for i in group])
        for i, end in zip(group, ends):
            leaf = leaves[i]
            part = slice(int(end) - leaf.size, int(end))
            out[i] = mean[part].reshape(leaf.shape).astype(leaf.dtype)
            kept[i] = remainder[part].reshape(leaf.shape).astype(leaf.dtype)

    if dense:
        reduced = lax.pmean([leaves[i] for i in dense], config.axis_name)
        for i, value in zip(dense, reduced, strict=True):
            out[i] = value
            kept[i] = jnp.zeros_like(leaves[i])

    new_memory = state.memory
    if config.error_feedback:
        new_memory = jax.tree_util.tree_unflatten(
            treedef, [x[None].astype(m.dtype) for x, m in zip(kept, memory, strict=True)])
    return jax.tree_util.tree_unflatten(treedef, out), TopKState(state.count + 1, new_memory)


def topk_comm_bytes(params: PyTree, n: int, **topk_kwargs: Any) -> float:
    """Bytes each device sends per step of :func:`topk_reduce`.

    Per sparsified group, a ring all-gather of the N ranks' k entries::

        (N - 1) * k * (value bytes + index bytes),  k = max(1, ceil(density * size))

    plus :func:`full_comm_bytes` of the leaves below ``min_size``. This grows with N,
    unlike an all-reduce: top-k pays off only while
    ``N * density * (1 + index/value bytes) < 2``.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      n: N, the size of the data axis.
      **topk_kwargs: the keyword arguments of :func:`topk_reduce`.

    Example:
      >>> import jax.numpy as jnp
      >>> from skipreduce_jax.contrib import topk_comm_bytes
      >>> topk_comm_bytes({"w": jnp.zeros((1000, 100))}, 8, density=0.01)
      56000.0
    """
    config = _TopKConfig.make(**method_settings(topk_reduce, topk_kwargs, api="topk_comm_bytes"))
    leaves = jax.tree_util.tree_leaves(params)
    groups, dense = config.groups(leaves)
    sent = 0.0
    for group in groups:
        dtype = jnp.result_type(*[leaves[i].dtype for i in group])
        k = config.k(sum(leaf_size(leaves[i]) for i in group))
        entry_bytes = np.dtype(dtype).itemsize + config.index_dtype.itemsize
        sent += traffic.all_gather_bytes(n * k * entry_bytes, n)
    for i in dense:
        sent += traffic.ring_allreduce_bytes(leaf_bytes(leaves[i]), n)
    return float(sent)
