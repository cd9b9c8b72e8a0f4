"""Leaves sharded over mesh axes the compiler handles: the ring on local shards.

In a ``shard_map`` that is manual over the data axis only (``axis_names=``),
a leaf may be sharded over the other mesh axes (FSDP or tensor parallelism
inside a slice or node). The ring flattens and packs leaves, which would make
the compiler gather them over those axes first. Instead the reduction runs in
a nested ``shard_map`` over those axes: each device reduces its own local
shard over the data axis, nothing crosses the other axes, and the result
keeps the input's sharding. Every element still sums N - k ranks of the data
axis, identical on those ranks.

How a leaf is sharded comes from, in order: an explicit ``specs`` argument;
its type (``jax.typeof(x).sharding``, under Explicit axes); else it is taken
as replicated over the compiler's axes. Under Auto axes the type says
nothing, so the training helpers pass the params' specs on (see
:func:`specs_of_params`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

_HINTS: contextvars.ContextVar[dict[int, tuple[Any, P]] | None] = \
    contextvars.ContextVar("skipreduce_shard_hints", default=None)


def spec_axes(spec: P | None) -> tuple[str, ...]:
    """The mesh axes a PartitionSpec names, in order."""
    if spec is None:
        return ()
    return tuple(a for entry in spec if entry is not None
                 for a in (entry if isinstance(entry, tuple) else (entry,)))


def compiler_axes() -> tuple[str, ...]:
    """The axes of the current (abstract) mesh that are not manual here."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    manual = jax.sharding.AxisType.Manual
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types)
                 if t != manual)


def _type_spec(leaf: Any, available: Sequence[str]) -> P | None:
    """The leaf's spec from its type, if it names an axis of ``available``.

    Inside a manual region the type names the manual axes too; those are
    not the compiler's, and are ignored.
    """
    spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
    return spec if set(spec_axes(spec)) & set(available) else None


def leaf_specs(leaves: Sequence[Any], treedef: Any, specs: Any, *,
               reduced_axes: Sequence[str], api: str) -> list[P | None]:
    """One ``PartitionSpec`` per leaf of ``treedef`` (None: not sharded over the compiler's axes).

    ``specs``: as :func:`given_specs` takes it; a leaf it leaves unsharded
    is read from its type. No leaf may be sharded over ``reduced_axes``.
    """
    given = given_specs(leaves, treedef, specs, api=api)
    out = []
    available = compiler_axes()
    for leaf, spec in zip(leaves, given):
        spec = spec if spec_axes(spec) else _type_spec(leaf, available)
        axes = spec_axes(spec)
        reduced = [a for a in axes if a in reduced_axes]
        if reduced:
            raise ValueError(
                f"{api}: a leaf of shape {tuple(leaf.shape)} is sharded over "
                f"{reduced}, the axis being reduced (spec {spec}). That is "
                "FSDP over the data axis itself: its gradients need a "
                "reduce-scatter, not an all-reduce. Shard params over the "
                "other mesh axes only, or replicate them over the data axis.")
        unknown = [a for a in axes if a not in available]
        if unknown:
            raise ValueError(
                f"{api}: a leaf of shape {tuple(leaf.shape)} has spec {spec}, "
                f"but {unknown} are not mesh axes the compiler handles here "
                f"(those are {list(available)}).")
        out.append(spec if axes else None)
    return out


def given_specs(leaves: Sequence[Any], treedef: Any, specs: Any, *, api: str,
                name: str = "specs") -> list[P | None]:
    """``specs`` (None, or a pytree prefix of PartitionSpec / None) per leaf."""
    if specs is None:
        return [None] * len(leaves)
    try:
        given = treedef.flatten_up_to(jax.tree_util.tree_map(
            lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub),
            specs, treedef.unflatten(leaves),
            is_leaf=lambda s: s is None or isinstance(s, P)))
    except ValueError as e:
        raise ValueError(
            f"{api}: {name} does not match the tree: give a pytree (or a "
            f"prefix) of PartitionSpec or None per leaf. {e}") from e
    for spec in given:
        if spec is not None and not isinstance(spec, P):
            raise TypeError(f"{api}: {name} has {spec!r}; each entry must be a "
                            "jax.sharding.PartitionSpec or None.")
    return given


def on_local_shards(fn: Callable[..., Any], leaves: list[Any],
                    specs: list[P | None], *replicated: Any,
                    num_outputs: int = 1) -> Any:
    """Runs ``fn(local_leaves, *replicated)`` on each device's local shards.

    ``fn`` returns ``num_outputs`` lists shaped like ``leaves`` (a bare list
    for one); each keeps its leaf's spec. ``replicated`` arguments (keys)
    enter the nested ``shard_map`` unsharded.
    """
    axes = sorted({a for s in specs for a in spec_axes(s)})
    leaf_in = [P() if s is None else s for s in specs]
    out_specs = leaf_in if num_outputs == 1 else tuple([leaf_in] * num_outputs)
    nested = jax.shard_map(
        fn, in_specs=(leaf_in,) + tuple(P() for _ in replicated),
        out_specs=out_specs, axis_names=set(axes))
    return nested(leaves, *replicated)


@contextlib.contextmanager
def hints(leaves: Sequence[Any], specs: Sequence[P | None]) -> Iterator[None]:
    """Records how traced ``leaves`` are sharded, while a step is traced.

    ``data_parallel`` records the params' specs here (under Auto axes the
    types inside ``shard_map`` do not carry them), and ``skip_reduce`` reads
    them back for the gradients of those params.
    """
    table = dict(_HINTS.get() or {})
    for leaf, spec in zip(leaves, specs):
        if spec_axes(spec):
            table[id(leaf)] = (leaf, spec)  # the leaf is kept: ids stay unique
    token = _HINTS.set(table)
    try:
        yield
    finally:
        _HINTS.reset(token)


def specs_of_params(params: Any) -> list[P | None] | None:
    """The recorded specs of ``params``' leaves (None if none was recorded)."""
    table = _HINTS.get()
    if not table or params is None:
        return None
    found = [table.get(id(leaf), (None, None))[1]
             for leaf in jax.tree_util.tree_leaves(params)]
    return found if any(s is not None for s in found) else None
