"""``data_parallel``: your own step, jitted and mapped over the data axes.

``jax.jit`` around ``jax.shard_map(..., check_vma=True)``, manual over the
data axes only; arguments are placed before the call (batches split,
per-rank state by rows, the rest replicated). See :func:`data_parallel`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.guards import callback_error, host_checks_traced
from skipreduce_jax._optax.per_rank import per_rank_names
from skipreduce_jax._ring import shards as _shards
from skipreduce_jax._steps.count import counting_over, global_count
from skipreduce_jax._steps.replay import MEAN_COUNT, RANK_KEY, mark, tracing_for_replay
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import varying_axes

AxisNames = str | tuple[str, ...]


class PerRank(NamedTuple):
    """Marks a value as per rank in :func:`data_parallel`'s inputs or outputs.

    Each leaf is split (inputs) or concatenated (outputs) along its leading
    dimension over the data axes, as the batch is: inside the step a rank
    sees its own rows; outside, the rows of every rank in order. A scalar
    needs a leading axis, e.g. ``PerRank(loss[None])``.

    Attributes:
      value: a pytree of arrays.
    """

    value: PyTree

    per_rank_fields = ("value",)


def as_tuple(axis_name: AxisNames) -> tuple[str, ...]:
    """``axis_name`` as a tuple of axis names."""
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def mesh_axes(mesh: jax.sharding.Mesh, axis_name: AxisNames, *, api: str
              ) -> tuple[str, ...]:
    """``axis_name`` as a tuple, refused unless every name is a mesh axis."""
    axes = as_tuple(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if not axes or missing:
        raise ValueError(
            f"{api}: axis_name={axis_name!r} is not an axis of the mesh, whose "
            f"axes are {tuple(mesh.axis_names)}. Pass the data axis, e.g. "
            f"axis_name={mesh.axis_names[0]!r}, or a tuple (outer, inner) of "
            "mesh axes for hierarchical SkipReduce.")
    return axes


def data_spec(axes: tuple[str, ...]) -> P:
    """The spec that splits a leading dimension over ``axes``."""
    return P(axes[0] if len(axes) == 1 else axes)


def rank_key(key: jax.Array, axis_name: AxisNames = "data") -> jax.Array:
    """``key`` folded with this rank's index over the data axes.

    Every rank sees the same replicated key: fold the rank in before dropout
    so each rank draws its own mask. With hierarchical axes ``(outer,
    inner)`` the index is ``outer * L + inner``, the batch's split order.

    Args:
      key: a replicated PRNG key (typed or raw ``uint32[2]``).
      axis_name: the data axis, or a tuple of axes.

    Returns:
      A key that differs per rank (typed varying over ``axis_name``).

    Example::

        def local_step(params, batch, key):
            key = rank_key(key, "data")  # before any dropout
            ...
    """
    if tracing_for_replay():  # value_and_grad's loss: folded in the body
        return mark(RANK_KEY, key)
    index = 0
    for axis in as_tuple(axis_name):
        size = checks.axis_size(axis, api="rank_key")
        index = index * size + lax.axis_index(axis)
    return jax.random.fold_in(key, index)


def markers(axes: tuple[str, ...]) -> dict[str, Callable[[Any, bool], Any]]:
    """What the library's markers in a replayed loss become on a rank."""
    return {MEAN_COUNT: lambda count, varying: global_count(count, axes, varying),
            RANK_KEY: lambda key, _: rank_key(key, axes)}


def per_rank_flags(tree: Any) -> list[bool]:
    """One bool per leaf of ``tree`` (in ``tree_leaves`` order): per rank?"""
    return [bool(name) for name in jax.tree_util.tree_leaves(per_rank_names(tree))]


def copy_to(x: Any, sharding: NamedSharding) -> jax.Array:
    """A copy of ``x`` placed with ``sharding`` that never aliases ``x``."""
    if jax.process_count() == 1:
        # device_put alone can reuse a single-device buffer as one replica.
        return jax.device_put(jnp.copy(x), sharding)
    if _is_global(x):
        return jax.jit(jnp.copy, out_shardings=sharding)(x)
    return _from_host(x, sharding)


def _from_host(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host value placed on a multi-process sharding, shard by shard."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])


def replicated_sharding(x: Any, mesh: jax.sharding.Mesh) -> NamedSharding:
    """``P()`` on ``mesh``, spelled as jit spells its replicated outputs."""
    return NamedSharding(mesh, P(*[None] * np.ndim(x)))


def _place_replicated(x: Any, mesh: jax.sharding.Mesh,
                      axes: tuple[str, ...]) -> Any:
    """``x`` copied to every device, unless on ``mesh`` and split over no axis of ``axes``."""
    spec = _spec_of(x, mesh)
    if isinstance(x, jax.Array) and spec is not None and not set(
            _shards.spec_axes(spec)) & set(axes):
        return x
    sharding = replicated_sharding(x, mesh)
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding,
                                                                x.ndim):
        return x
    return copy_to(x, sharding)


def place_batch(x: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...], *,
                process_local: bool = True) -> Any:
    """``x`` split along its leading dimension over ``axes``.

    A multi-process host array is this process's part of the global batch,
    or with ``process_local=False`` the whole of it.
    """
    sharding = NamedSharding(mesh, data_spec(axes))
    if isinstance(x, jax.Array) and (x.sharding.is_equivalent_to(sharding, x.ndim)
                                     or _split_over(x, mesh, axes)):
        return x
    if _is_global(x):
        return jax.jit(lambda v: v, out_shardings=sharding)(x)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    if process_local:
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return _from_host(x, sharding)


def _split_over(x: Any, mesh: jax.sharding.Mesh, axes: tuple[str, ...]) -> bool:
    """Whether ``x``'s rows are split over ``axes`` first, and over them nowhere else."""
    spec = _spec_of(x, mesh)
    if not _leads_with(spec, axes):
        return False
    rest = set(_shards.spec_axes(P(*spec[1:])))
    return not set(axes) & (set(as_tuple(spec[0])[len(axes):]) | rest)


def _check_not_split(path: Any, x: Any, argnum: int, mesh: jax.sharding.Mesh,
                     axes: tuple[str, ...], *, api: str) -> None:
    """Refuses an argument split over the data axes other than by rows."""
    spec = _spec_of(x, mesh)
    split = sorted(set(_shards.spec_axes(spec)) & set(axes))
    if split:
        first = axes[0] if len(axes) == 1 else axes
        raise ValueError(
            f"{api}: argument {argnum} at {jax.tree_util.keystr(path) or 'the root'} "
            f"is sharded over {split} (spec {spec}), a data axis, but not along "
            f"its leading dimension first, over every data axis {axes}. Shard "
            "params over the data axes by "
            f"rows (P({first!r}, ...): FSDP, each rank its block; "
            f"shard_params(params, mesh, {first!r})), over the other mesh axes "
            "only, or replicate them over the data axes.")


def _deleted(x: Any) -> bool:
    """Whether ``x`` is a concrete array whose buffers are gone (donated)."""
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and x.is_deleted())


def _is_global(x: Any) -> bool:
    """Whether ``x`` is an array spanning other processes' devices too."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _check_rows(path: Any, leaf: Any, ranks: int, axes: tuple[str, ...], *,
                api: str) -> None:
    """Refuses per-rank state that does not hold one row per rank."""
    if np.ndim(leaf) and not np.shape(leaf)[0] % ranks:
        return
    raise ValueError(
        f"{api}: the per-rank state at {jax.tree_util.keystr(path)} has shape "
        f"{np.shape(leaf)}; it needs one row per rank over {list(axes)} "
        f"({ranks}). Build optimizer state with skipreduce_jax.init_opt_state("
        "tx, params, mesh) (with NNX, skipreduce_jax.nnx.init_optimizer(model, "
        "tx, mesh)): tx.init alone makes a single row.")


def check_batch(tree: Any, ranks: int, axes: tuple[str, ...], *, api: str,
                name: str, or_else: str, traced: bool = False) -> None:
    """Refuses batch leaves whose leading dimension does not split over the ranks.

    ``or_else`` is the other fix; ``traced``: global arrays inside ``jax.jit``.
    """
    processes = jax.process_count()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        where = (f"{api}: {name} has a leaf at "
                 f"{jax.tree_util.keystr(path) or 'the root'} of shape {np.shape(leaf)}")
        if not np.ndim(leaf):
            raise ValueError(
                f"{where}, a scalar: it has no leading dimension to split over "
                f"the {ranks} ranks of {list(axes)}. Give each batch leaf a "
                f"leading batch dimension, or {or_else}.")
        rows = np.shape(leaf)[0] * (1 if traced or _is_global(leaf) else processes)
        if rows % ranks:
            raise ValueError(
                f"{where}: its leading dimension must split evenly over the "
                f"{ranks} ranks of {list(axes)}. Pass a global batch whose size "
                f"is a multiple of {ranks} (drop or pad the last one), or {or_else}.")


def _check_outputs(with_paths: Sequence[tuple[Any, Any]],
                   flags: Sequence[bool], axes: tuple[str, ...],
                   describe: Callable[[Any], str], *, api: str) -> None:
    """Refuses outputs declared replicated that differ per rank."""
    axis = axes[0] if len(axes) == 1 else axes
    for (path, leaf), per_rank in zip(with_paths, flags, strict=True):
        vary = [a for a in axes if a in varying_axes(leaf)]
        if per_rank or not vary:
            continue
        raise ValueError(
            f"{api}: {describe(path)} varies over {vary} (each rank computed "
            "its own value), but the step returns it replicated. Reduce it "
            f"over the data axes inside the step: lax.pmean(x, {axis!r}) for "
            f"a loss or metric; nnx.BatchNorm(..., axis_name={axis!r}) or "
            f"linen nn.BatchNorm(axis_name={axis!r}) for batch statistics; "
            f"lax.all_gather(x, {axis!r}, tiled=True, to='invarying') for "
            "per-example values; for parameters, put "
            f"skip_reduce({axes[0]!r}, ...) first in the optimizer. Or "
            "return it per rank, wrapped in skipreduce_jax.PerRank(x) (rows "
            "of every rank concatenated along the leading dimension).")


def positions(argnums: Any, name: str, *, api: str) -> tuple[int, ...]:
    try:
        values = tuple(argnums)
    except TypeError:
        values = (argnums,)
    for v in values:
        checks.check_int(v, name, api=api, minimum=0,
                         allowed="a non-negative int or a sequence of them")
    return tuple(int(v) for v in values)


def _default_describe(path: Any) -> str:
    return f"the output at {jax.tree_util.keystr(path) or 'the root'}"


class DataParallelStep:
    """The callable :func:`data_parallel` returns (with ``lower`` as ``jax.jit``'s)."""

    def __init__(self, step_fn, mesh, axes, batch_argnums, static_argnums,
                 donate_argnums, *, api, describe=_default_describe,
                 manual_axes=None):
        self._step_fn = step_fn
        # "unsharded": the data axes and every axis no argument is sharded over.
        self._manual_rule = manual_axes
        self._manual = set(axes if manual_axes in (None, "unsharded") else manual_axes)
        self._mesh = mesh
        self._axes = axes
        self._batch = batch_argnums
        self._static = static_argnums
        self._donate = donate_argnums
        self._api = api
        self._describe = describe
        self._jitted = jax.jit(self._traced, static_argnums=static_argnums,
                               donate_argnums=donate_argnums)
        self._waits = False  # traced with a host check: wait for each call

    def __call__(self, *args, **kwargs):
        return self._enter(args, kwargs, self._run)

    def _enter(self, args: tuple, kwargs: dict, run: Callable[[tuple], Any]) -> Any:
        """Checks and places ``args``, then ``run(args)`` under the step's mesh."""
        if kwargs:
            raise TypeError(
                f"{self._api}: pass the step's arguments positionally (got "
                f"keyword arguments {sorted(kwargs)}); batch_argnums, "
                "static_argnums and donate_argnums count positions.")
        self._check_live(args)
        args = self._place(args)
        with _mesh_context(self._mesh):
            return run(args)

    def _run(self, args: tuple) -> Any:
        """Runs the jitted step, raising a host check's error as it was (not wrapped)."""
        traced = host_checks_traced()
        try:
            out = self._jitted(*args)
            self._waits = self._waits or host_checks_traced() != traced
            return jax.block_until_ready(out) if self._waits else out
        except jax.errors.JaxRuntimeError as wrapped:
            error = callback_error(wrapped)
            if error is None:
                raise
            raise error from None

    def _check_live(self, args: tuple) -> None:
        """Refuses deleted arrays (donated to an earlier call): JAX may crash on them."""
        for i, arg in enumerate(args):
            dead = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(arg)
                    if i not in self._static and _deleted(x)]
            if not dead:
                continue
            path, leaf = dead[0]
            why = (f"this step donates argument {i} (donate_argnums="
                   f"{self._donate}), so the previous call consumed it"
                   if i in self._donate else
                   "it was donated to an earlier call (of another step or jitted "
                   "function) or deleted")
            use = ("Pass the objects as the previous call left them (it updates "
                   "them in place; keep a snapshot as jax.tree.map(jnp.copy, "
                   "nnx.state(model)))" if self._api.endswith("nnx.data_parallel") else
                   "Pass the arrays the previous call returned (e.g. params, "
                   "opt_state, loss = step(params, opt_state, batch))")
            keep = ("build the step with make_train_step(..., donate=False)"
                    if self._api == "make_train_step" else
                    f"leave {i} out of donate_argnums" if i in self._donate else
                    "pass a copy to the call that donates it")
            raise ValueError(
                f"{self._api}: argument {i} at "
                f"{jax.tree_util.keystr(path) or 'the root'} (shape {leaf.shape}) "
                f"is a deleted array: {why}. {use}, or, to keep the inputs, {keep}.")

    def lower(self, *args, **kwargs):
        """Places ``args`` and lowers the step (``jax.jit(...).lower``)."""
        return self._enter(args, kwargs, lambda placed: self._jitted.lower(*placed))

    def _cache_size(self) -> int:
        return self._jitted._cache_size()

    def _place(self, args: tuple) -> tuple:
        mesh, axes, api = self._mesh, self._axes, self._api
        ranks = math.prod(mesh.shape[a] for a in axes)
        for i in self._batch + self._static:
            if i >= len(args):
                raise ValueError(
                    f"{api}: argnum {i} (in batch_argnums or static_argnums) "
                    f"is out of range for a call with {len(args)} arguments.")
        placed = list(args)
        for i, arg in enumerate(args):
            if i in self._static:
                continue
            with_paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
            if i in self._batch:
                check_batch(arg, ranks, axes, api=api,
                            name=f"argument {i} (in batch_argnums)",
                            or_else="move the argument out of batch_argnums")
                new = [x if isinstance(x, jax.ShapeDtypeStruct) else
                       place_batch(x, mesh, axes) for _, x in with_paths]
            else:
                new = []
                for (path, x), per_rank in zip(with_paths, per_rank_flags(arg),
                                               strict=True):
                    if isinstance(x, jax.ShapeDtypeStruct):
                        new.append(x)
                    elif per_rank:
                        _check_rows(path, x, ranks, axes, api=api)
                        new.append(place_batch(x, mesh, axes,
                                               process_local=False))
                    elif _split_over(x, mesh, axes):
                        new.append(x)  # this rank's block (FSDP / ZeRO shards)
                    else:
                        _check_not_split(path, x, i, mesh, axes, api=api)
                        new.append(_place_replicated(x, mesh, axes))
            if any(a is not b for (_, a), b in zip(with_paths, new,
                                                   strict=True)):
                placed[i] = jax.tree_util.tree_unflatten(treedef, new)
        # Spelled as the step's outputs come back: without trailing Nones when
        # leaves are laid out over the compiler's axes, else one entry per dim.
        stripped = any(set(_shards.spec_axes(s)) - set(axes) for i, a in enumerate(placed)
                       if i not in self._static and i not in self._batch
                       for s in map(lambda x: _spec_of(x, mesh) or P(),
                                    jax.tree_util.tree_leaves(a)))
        placed = [a if i in self._static else jax.tree_util.tree_map(
            lambda x: _respell(x, mesh, stripped), a) for i, a in enumerate(placed)]
        # Each leaf's layout, for the trace that follows.
        self._specs = [None if i in self._static else
                       [_spec_of(x, mesh) for x in jax.tree_util.tree_leaves(a)]
                       for i, a in enumerate(placed)]
        return tuple(placed)

    def _traced(self, *args):
        dynamic = [i for i in range(len(args)) if i not in self._static]
        arg_specs = [(self._specs[i] if self._specs else None)
                     or [None] * len(jax.tree_util.tree_leaves(args[i]))
                     for i in dynamic]
        manual = self._manual
        if self._manual_rule == "unsharded":
            used = {a for i, specs in zip(dynamic, arg_specs, strict=True)
                    if i not in self._batch for s in specs if s is not None
                    for a in _shards.spec_axes(s)}
            manual = {a for a in self._mesh.axis_names
                      if a in self._axes or a not in used}
        full = list(args)

        def step(*dynamic_args):
            for i, value in zip(dynamic, dynamic_args, strict=True):
                full[i] = value
            return self._step_fn(*full)

        return run_per_rank(step, self._mesh, self._axes, [args[i] for i in dynamic],
                            arg_specs, batch=[dynamic.index(i) for i in self._batch],
                            manual=manual, api=self._api, describe=self._describe)


def run_per_rank(fn: Callable[..., Any], mesh: jax.sharding.Mesh, axes: tuple[str, ...],
                 args: Sequence[Any], arg_specs: Sequence[Sequence[P | None]], *,
                 batch: Sequence[int], manual: set[str], api: str,
                 describe: Callable[[Any], str] = _default_describe,
                 check_vma: bool = True, layouts: Sequence[Any] | None = None,
                 retype: bool = False) -> Any:
    """``fn(*args)`` on every rank of ``axes``: the one per-rank runner, inside jit.

    A ``jax.shard_map`` manual over ``manual`` (the data axes, and any other
    axis no argument is sharded over). ``args[i]`` for ``i`` in ``batch``,
    :class:`PerRank` leaves and leaves whose rows are split over ``axes``
    (``arg_specs``: each leaf's spec on ``mesh``, or None) enter as this rank's
    rows; the rest whole. An abstract trace first finds the outputs: those
    per rank (:class:`PerRank`, or blocks with an argument's layout) come back
    stacked along the leading dimension, the rest replicated, refused if they
    vary. ``layouts``: each output leaf's ``(spec, ndim)`` over the mesh, or
    None; by default, the layout of the argument with the same structure.
    ``retype``: the arguments are typed as the caller's jit has them, not
    placed to match (under Explicit axes, every one of them goes Auto).
    """
    spec = data_spec(axes)
    in_specs = []
    for i, (arg, specs) in enumerate(zip(args, arg_specs, strict=True)):
        flags = per_rank_flags(arg)
        in_specs += [spec if i in batch or f or _leads_with(s, axes) else P()
                     for f, s in zip(flags, specs, strict=True)]
    flat, in_tree = jax.tree_util.tree_flatten(list(args))
    other = [_without(s, manual) for specs in arg_specs for s in specs]
    kept = [(a, s) for i, (a, s) in enumerate(zip(args, arg_specs, strict=True))
            if i not in batch]
    found = {}

    def local(*local_flat):
        with _shards.hints(local_flat, other), counting_over(axes):
            found["in_step"] = True
            out = fn(*in_tree.unflatten(local_flat))
            found["in_step"] = False
        with_paths, found["tree"] = jax.tree_util.tree_flatten_with_path(out)
        found["ndims"] = [np.ndim(leaf) for _, leaf in with_paths]
        found["flags"] = per_rank_flags(out)
        found["layouts"] = (list(layouts) if layouts is not None else _output_layouts(
            found["tree"], [a for a, _ in kept], [s for _, s in kept]))
        blocks = [_leads_with(layout and layout[0], axes) for layout in found["layouts"]]
        found["rows"] = [f or b for f, b in zip(found["flags"], blocks, strict=True)]
        _check_outputs(with_paths, found["rows"], axes, describe, api=api)
        return tuple(leaf for _, leaf in with_paths)

    def probe(*local_flat):
        local(*local_flat)
        return ()

    compiler = [a for a in mesh.axis_names if a not in manual]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = tuple(a for a in (mesh.axis_names if retype else compiler)
                     if types[a] == jax.sharding.AxisType.Explicit)
    # Under Explicit axes a partial-manual shard_map takes sharded leaves
    # only as Auto, and outputs are pinned to their layouts.
    sharded = bool(compiler) and any(
        _without(s, manual) for _, specs in kept for s in specs)

    def mapped(fn, out_specs, out_sharding):
        kwargs = dict(in_specs=tuple(in_specs), out_specs=out_specs,
                      axis_names=manual, check_vma=check_vma)
        if not (explicit and (sharded or retype)):
            return jax.shard_map(fn, mesh=mesh, **kwargs)

        def inner(*a):
            return jax.shard_map(fn, **kwargs)(*a)

        return jax.sharding.auto_axes(inner, axes=explicit, out_sharding=out_sharding)

    # An abstract trace first finds the outputs' structure and layouts.
    try:
        jax.eval_shape(mapped(probe, (), ()), *flat)
    except ValueError as e:
        if not found.get("in_step"):  # the library's own check of the outputs
            raise
        e.add_note(
            f"{api}: the step runs per rank, in a shard_map where the data axes "
            f"{list(axes)} are Manual and each rank holds only its own rows. If "
            "this refuses a sharding set in the step (a with_sharding_constraint, "
            "or flax unboxing a partitioned kernel): constrain with the step's "
            "mesh and without the data axes, put the constraint in the loss given "
            "to local_value_and_grad (replayed per rank on Auto axes), or keep the "
            "step pjit code and take the gradients with skipreduce_jax.value_and_grad.")
        raise
    out_tree = found["tree"]
    out_specs = tuple(spec if r else P() for r in found["rows"])
    full = [_out_spec(layout, ndim, spec if f else None, manual, axes)
            for layout, ndim, f in zip(found["layouts"], found["ndims"],
                                       found["flags"], strict=True)]
    out = mapped(local, out_specs, tuple(full))(*flat)
    if sharded and not explicit:
        out = [lax.with_sharding_constraint(o, NamedSharding(mesh, f))
               for o, f in zip(out, full, strict=True)]
    return out_tree.unflatten(out)


def _respell(x: Any, mesh: jax.sharding.Mesh, stripped: bool) -> Any:
    """``x`` with its layout spelled without trailing Nones, or with all (as outputs are)."""
    spec = _spec_of(x, mesh)
    if spec is None or not isinstance(x, jax.Array):
        return x
    want = (_canonical(spec) if stripped
            else P(*(list(spec) + [None] * (x.ndim - len(spec)))))
    return x if want == spec else jax.device_put(x, NamedSharding(mesh, want))


def _canonical(spec: P) -> P:
    """``spec`` without trailing None entries (as jit spells its outputs)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _spec_of(x: Any, mesh: jax.sharding.Mesh) -> P | None:
    """``x``'s PartitionSpec if it is laid out on ``mesh`` (else None)."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        return sharding.spec
    return None


def _without(spec: P | None, axes: set[str]) -> P | None:
    """``spec`` with the axes in ``axes`` removed (None if nothing is left)."""
    if spec is None:
        return None
    entries = []
    for entry in spec:
        kept = tuple(a for a in as_tuple(entry) if a not in axes) if entry else ()
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries) if any(e is not None for e in entries) else None


def _leads_with(spec: P | None, axes: tuple[str, ...]) -> bool:
    """Whether ``spec`` splits the leading dimension over ``axes`` first."""
    if spec is None or not len(spec) or spec[0] is None:
        return False
    return tuple(as_tuple(spec[0]))[:len(axes)] == axes


def _out_spec(layout: tuple[P | None, int] | None, ndim: int, data: P | None,
              manual: set[str], axes: tuple[str, ...]) -> P:
    """The full spec of an output leaf of ``ndim`` dimensions.

    ``layout``: the (spec, ndim) of the argument leaf it comes from; ``data``:
    the data axes' spec of a per-rank leaf, its rows over the data axes first.
    """
    spec, base = layout if layout is not None else (None, ndim)
    if data is None and _leads_with(spec, axes):
        return _canonical(spec)
    spec = _without(spec, manual)
    entries = list(spec or ()) + [None] * (base - len(spec or ()))
    if data is None:
        return _canonical(P(*entries))
    if ndim == base + 1:
        return _canonical(P(data[0], *entries))
    head = entries[0] if entries else None
    axes = tuple(as_tuple(data[0])) + (tuple(as_tuple(head)) if head else ())
    return _canonical(P(axes[0] if len(axes) == 1 else axes, *entries[1:]))


def _output_layouts(out_tree: Any, args: Sequence[Any], arg_specs: Sequence[Any]
                    ) -> list[tuple[P | None, int] | None]:
    """Per output leaf: the layout of the argument with its subtree's structure, or None."""
    by_structure = {}
    for arg, specs in zip(args, arg_specs, strict=True):
        structure = jax.tree_util.tree_structure(arg)
        if specs and structure.num_nodes > 1:  # a container, not one array
            by_structure.setdefault(structure, [
                (s, np.ndim(leaf))
                for s, leaf in zip(specs, jax.tree_util.tree_leaves(arg), strict=True)])
    dummy = out_tree.unflatten([0] * out_tree.num_leaves)
    layouts = []

    def visit(node):
        structure = jax.tree_util.tree_structure(node)
        if structure.num_leaves == 0:
            return
        if structure in by_structure:
            layouts.extend(by_structure[structure])
        elif structure.num_nodes == 1:  # a leaf
            layouts.append(None)
        else:
            for child in jax.tree_util.tree_flatten(node, is_leaf=lambda n: n is not node)[0]:
                visit(child)

    visit(dummy)
    return layouts


def _mesh_context(mesh: jax.sharding.Mesh) -> Any:
    """``jax.set_mesh(mesh)`` unless a mesh is already set (or under jit)."""
    if not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    try:
        return jax.set_mesh(mesh)
    except ValueError:  # called inside an outer jit: its context applies
        return contextlib.nullcontext()


def data_parallel(
    step_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    batch_argnums: int | Sequence[int],
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
) -> DataParallelStep:
    """Jits ``step_fn`` and runs it on every rank of the data axes.

    ``step_fn`` is written for ONE rank: its ``batch_argnums`` arguments
    hold this rank's rows, every other argument is the full (replicated)
    value, and ``axis_name`` is bound, so ``skip_reduce`` and ``lax.pmean``
    work. Per-rank state (error-feedback residuals, :class:`PerRank`) holds
    this rank's row. It is ``jax.jit`` around ``jax.shard_map(...,
    check_vma=True)``, manual over ``axis_name`` only.

    Outputs come back replicated, except per-rank state, whose rows are
    stacked along the leading dimension. An output declared replicated that
    differs per rank is refused with its path and the fix.

    Each call places the arguments first: batch leaves (numpy or jax arrays)
    are split along their leading dimension, which must divide by the
    number of ranks (in a multi-process job a host batch is this process's
    part, as for :func:`shard_batch`); per-rank state is split by rows;
    everything else is copied to every device unless already there. An
    argument sharded over other mesh axes keeps that layout (those axes stay
    with the compiler), and one whose rows are split over the data axes
    (FSDP / ZeRO) enters as this rank's block. An output with the structure
    of an argument comes back in its layout, so feeding it back moves
    nothing.

    A loss given to :func:`local_value_and_grad` may hold pjit code (see
    there); in the step's own body, constrain without the data axes.

    The call runs under ``jax.set_mesh(mesh)`` unless a mesh is already set.
    With Explicit mesh axes (``jax.make_mesh``), code outside the step that
    uses its outputs can fail with "Length of device assignment 1 is not
    equal to the size of the mesh": run it under ``jax.set_mesh(mesh)`` too,
    or build the mesh with ``axis_types=(jax.sharding.AxisType.Auto,) * n``.

    Args:
      step_fn: the per-rank step. Its arguments and outputs are pytrees
        (flax ``TrainState`` and NNX objects included); see
        :mod:`skipreduce_jax.nnx` to update NNX objects in place.
      mesh: the device mesh.
      axis_name: the data axis; ``(outer, inner)`` for hierarchical
        SkipReduce (the batch is split over both).
      batch_argnums: positions of the arguments split over the data axes.
      static_argnums: positions passed through as Python values (hashable;
        a new value compiles again), as for ``jax.jit``.
      donate_argnums: positions whose buffers the step may reuse (e.g. the
        params and optimizer state), as for ``jax.jit``.

    Returns:
      A callable taking the step's arguments positionally; its ``lower``
      method lowers it as ``jax.jit``'s does.

    Raises:
      ValueError: if ``axis_name`` is not an axis of ``mesh``, the argnums
        overlap, a batch leaf does not split evenly, per-rank state lacks a
        row per rank, or an output declared replicated varies.

    Example::

        def local_step(params, opt_state, batch, key):
            key = rank_key(key, "data")          # dropout differs per rank
            loss, grads = local_value_and_grad(loss_fn, "data")(
                params, batch, key)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state,
                    lax.pmean(loss, "data"))

        step = data_parallel(local_step, mesh, "data", batch_argnums=2,
                             donate_argnums=(0, 1))
        params, opt_state, loss = step(params, opt_state, numpy_batch, key)
    """
    return build_step(step_fn, mesh, axis_name, batch_argnums=batch_argnums,
                      static_argnums=static_argnums,
                      donate_argnums=donate_argnums, api="data_parallel")


def build_step(step_fn, mesh, axis_name, *, batch_argnums, static_argnums,
               donate_argnums, api: str,
               describe: Callable[[Any], str] = _default_describe,
               manual_axes: Sequence[str] | None = None) -> DataParallelStep:
    """:func:`data_parallel`, with errors naming ``api``; ``manual_axes``: the manual ones."""
    axes = mesh_axes(mesh, axis_name, api=api)
    batch = positions(batch_argnums, "batch_argnums", api=api)
    static = positions(static_argnums, "static_argnums", api=api)
    donate = positions(donate_argnums, "donate_argnums", api=api)
    for name, a, b in (("batch_argnums", batch, static),
                       ("donate_argnums", donate, static)):
        both = sorted(set(a) & set(b))
        if both:
            raise ValueError(
                f"{api}: {name}={a} and static_argnums={b} share {both}; a "
                f"static argument is a Python value, not an array to "
                f"{'split' if name == 'batch_argnums' else 'donate'}.")
    if not callable(step_fn):
        raise TypeError(f"{api}: step_fn={step_fn!r} must be callable.")
    return DataParallelStep(step_fn, mesh, axes, batch, static, donate,
                            api=api, describe=describe,
                            manual_axes=manual_axes)
