"""The per-rank protocol shared by ``skip_reduce`` and ``skipreduce_jax.contrib``.

A NamedTuple state names its per-rank fields in a ``per_rank_fields`` class
attribute (each leaf a row of size 1 per rank inside ``shard_map``); an
``optax.MultiStepsState`` around such state has a per-rank ``acc_grads``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from skipreduce_jax._vma import cast_varying, varying_axes, vma_checked


def check_local(leaves: Sequence[jax.Array], axis_name: str,
                inner_axis: str | None = None, *, api: str) -> None:
    """Refuses gradients that autodiff already summed over the data axes.

    Under ``check_vma=False`` the types cannot tell, and nothing is checked.
    """
    if not vma_checked(axis_name):
        return
    axes = {axis_name} | ({inner_axis} if inner_axis else set())
    for leaf in leaves:
        missing = axes - varying_axes(leaf)
        if inner_axis is not None and missing == {inner_axis}:
            raise ValueError(
                f"{api}: got a gradient of shape {leaf.shape} that is local "
                f"over {axis_name!r} but already summed over the inner axis "
                f"{inner_axis!r}: the local gradients were taken over "
                f"{axis_name!r} only. With hierarchical SkipReduce pass "
                f"axis_name=({axis_name!r}, {inner_axis!r}) to make_train_step, "
                "init_opt_state, shard_batch, state_specs and local_grad / "
                "local_value_and_grad.")
        if missing:
            raise ValueError(
                f"{api}: got a gradient of shape {leaf.shape} that is "
                f"replicated (invariant) over {sorted(missing)}: it was already "
                "reduced. Usually autodiff summed it, because the params were "
                "replicated inside shard_map; reducing again would "
                "double-count. Compute local gradients with "
                "skipreduce_jax.local_grad / local_value_and_grad (they cast "
                "params to varying first), or jax.grad(loss)(lax.pcast(params, "
                "axis, to='varying'), ...). It can also come from replicated "
                "optimizer state, e.g. the accumulated gradients of an "
                "optax.MultiSteps around skip_reduce made by tx.init: build the "
                "state with skipreduce_jax.init_opt_state(tx, params, mesh), "
                "which gives each rank an accumulator of its own.")


def per_rank_zeros(shape: Sequence[int], dtype: Any, axes: tuple[str, ...]
                   ) -> jax.Array:
    """Zeros of ``(1, *shape)``, typed varying over ``axes`` where ``shard_map`` checks it."""
    zeros = jnp.zeros((1,) + tuple(shape), dtype)
    try:
        checked = vma_checked(axes[0])
    except NameError:  # outside shard_map: nothing to type
        return zeros
    return cast_varying(zeros, axes) if checked else zeros


def per_rank_fields(node: Any) -> tuple[str, ...]:
    """The per-rank field names of a NamedTuple state (else ``()``)."""
    if isinstance(node, optax.MultiStepsState):
        return ("acc_grads",) if _holds_per_rank(node.inner_opt_state) else ()
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return tuple(getattr(type(node), "per_rank_fields", ()))
    return ()


def _holds_per_rank(tree: Any) -> bool:
    """Whether ``tree`` holds a state declaring per-rank fields."""
    nodes = jax.tree_util.tree_leaves(tree, is_leaf=lambda n: bool(per_rank_fields(n)))
    return any(per_rank_fields(n) for n in nodes)


def per_rank_names(tree: Any) -> Any:
    """``tree`` with each leaf replaced by its per-rank field's name, or ``""`` (states nest)."""
    def visit(node):
        fields = per_rank_fields(node)
        if not fields:
            return ""
        return node._replace(**{
            name: (jax.tree_util.tree_map(lambda _, n=name: n, child)
                   if name in fields else per_rank_names(child))
            for name, child in zip(node._fields, node, strict=True)})

    return jax.tree_util.tree_map(visit, tree,
                                  is_leaf=lambda n: bool(per_rank_fields(n)))


def per_rank_leaves(opt_state: Any) -> Iterator[tuple[str, Any]]:
    """``(field name, leaf)`` for every leaf of every per-rank field."""
    names = jax.tree_util.tree_leaves(per_rank_names(opt_state))
    for name, leaf in zip(names, jax.tree_util.tree_leaves(opt_state), strict=True):
        if name:
            yield name, leaf
