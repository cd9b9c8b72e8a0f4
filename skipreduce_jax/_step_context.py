"""What user code traced inside our ``shard_map`` bodies may keep from pjit code.

The library runs the user's step (its loss, its flax modules) inside a
``shard_map`` that is manual over the data axes. Two things written for a
plain ``jax.jit`` step break there, and :func:`step_body` makes both work
while such a body is traced:

- ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))`` with
  the global mesh (or a bare ``spec``) naming a data axis. JAX refuses it:
  the data axes are Manual in the body's mesh. Inside a per-rank body the
  constraint means the rank's part laid out as ``spec`` says over the
  other axes, so it is respelled for the body's mesh: the manual axes are
  dropped from ``spec``; what is left constrains the value over the
  compiler's Auto axes (``with_sharding_constraint``) and sets its layout
  over Explicit ones (``jax.sharding.reshard``, which is how Explicit axes
  spell a layout). With every axis manual there is nothing left to lay
  out, and the value is returned as it is.
- flax linen ``DenseGeneral`` with several ``features`` (or contracted
  axes) under ``nn.with_partitioning`` / ``nn.with_logical_partitioning``.
  Its initializer builds the flat rank-2 kernel, boxes it with the names
  of the full-rank kernel and unboxes it before reshaping; ``unbox``
  constrains the rank-2 value with the longer spec, and JAX refuses it
  whenever a mesh is set. ``Module.param`` re-runs the initializer under
  ``jax.eval_shape`` on every apply to check shapes, so the apply fails
  too. In the body a box whose names outnumber its value's dimensions is
  unboxed without the constraint; flax constrains the reshaped kernel
  when it unboxes it (this happens in plain ``jax.jit`` under
  ``jax.set_mesh`` as well, without this library).

Both are patched only while a body is traced (a context variable says
which thread is inside one) and restored when the last body in progress
ends. Code that imported the function itself (``from jax.lax import
with_sharding_constraint``) bypasses the respelling and meets JAX's error:
call it as ``jax.lax.with_sharding_constraint`` or spell the spec without
the data axes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax._shards import spec_axes

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "skipreduce_step_body", default=False)
_LOCK = threading.Lock()
_DEPTH = 0
# (owner, attribute name, original, replacement) while patched.
_PATCHES: list[tuple[Any, str, Any, Any]] = []
_ORIGINAL_WSC = jax.lax.with_sharding_constraint


def step_body(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, traced with pjit-style sharding code made to work per rank.

    Wrap every ``shard_map`` body that runs user code (the step's loss,
    flax modules) with it: inside, ``jax.lax.with_sharding_constraint`` of
    the global mesh's shardings is respelled for the body's mesh, and
    flax's partitioned ``DenseGeneral`` kernels initialise (see the module
    docstring). Outside the call nothing is changed.

    Args:
      fn: the body, called with the ``shard_map``'s arguments.

    Returns:
      A function with ``fn``'s signature.

    Example::

        body = jax.shard_map(step_body(local_step), mesh=mesh, ...)
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _inside_step():
            return fn(*args, **kwargs)

    return wrapped


@contextlib.contextmanager
def _inside_step() -> Iterator[None]:
    _install()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _uninstall()


def _install() -> None:
    global _DEPTH
    with _LOCK:
        _DEPTH += 1
        if _DEPTH > 1:
            return
        _patch(jax.lax, "with_sharding_constraint", _with_sharding_constraint)
        meta = sys.modules.get("flax.core.meta")
        spmd = sys.modules.get("flax.linen.spmd")
        for cls in (getattr(meta, "Partitioned", None),
                    getattr(spmd, "LogicallyPartitioned", None)):
            if cls is not None and "unbox" in vars(cls):
                _patch(cls, "unbox", _unbox_checking_rank(vars(cls)["unbox"]))


def _uninstall() -> None:
    global _DEPTH
    with _LOCK:
        _DEPTH -= 1
        if _DEPTH:
            return
        while _PATCHES:
            owner, name, original, replacement = _PATCHES.pop()
            if getattr(owner, name, None) is replacement:  # else replaced since
                setattr(owner, name, original)


def _patch(owner: Any, name: str, replacement: Any) -> None:
    _PATCHES.append((owner, name, getattr(owner, name), replacement))
    setattr(owner, name, replacement)


def _unbox_checking_rank(unbox: Callable[..., Any]) -> Callable[..., Any]:
    """Flax's ``unbox``, without the constraint on a box of fewer dimensions."""

    @functools.wraps(unbox)
    def checked(self, apply_constraint=True):
        ndim = getattr(self.value, "ndim", None)
        if _ACTIVE.get() and ndim is not None and len(self.names) > ndim:
            return self.value  # DenseGeneral's flat kernel, reshaped next
        return unbox(self, apply_constraint)

    return checked


def _with_sharding_constraint(x: Any, shardings: Any) -> Any:
    """``jax.lax.with_sharding_constraint``, respelled inside a step body."""
    mesh = jax.sharding.get_abstract_mesh()
    if not _ACTIVE.get() or mesh.empty or AxisType.Manual not in mesh.axis_types:
        return _ORIGINAL_WSC(x, shardings)
    leaves, treedef = jax.tree_util.tree_flatten(x)
    try:  # one sharding per leaf of x (shardings may be a prefix of x)
        per_leaf = treedef.flatten_up_to(jax.tree.broadcast(
            shardings, x, is_leaf=lambda s: s is None or isinstance(s, (P, NamedSharding))))
    except (ValueError, TypeError):
        return _ORIGINAL_WSC(x, shardings)  # JAX's own message
    return treedef.unflatten([_respelled(leaf, s, mesh)
                              for leaf, s in zip(leaves, per_leaf, strict=True)])


def _respelled(x: Any, sharding: Any, mesh: Any) -> Any:
    """One leaf's constraint, for the body's (partly manual) mesh."""
    if isinstance(sharding, NamedSharding):
        theirs = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_sizes, strict=True))
        ours = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
        if theirs != ours:
            raise ValueError(
                "with_sharding_constraint inside a per-rank step: the sharding's "
                f"mesh has axes {theirs}, the step's mesh {ours}. Constrain with "
                "the mesh the step runs on (NamedSharding(mesh, spec)), or a bare "
                "PartitionSpec.")
        spec = sharding.spec
    else:
        spec = sharding if isinstance(sharding, P) else None
    if spec is None or any(a not in mesh.axis_names for a in spec_axes(spec)
                                if a is not P.UNCONSTRAINED):
        return _ORIGINAL_WSC(x, sharding)  # not of this mesh: JAX decides
    if len(spec) > x.ndim:
        raise ValueError(
            f"with_sharding_constraint: the spec {spec} has {len(spec)} entries, "
            f"but the value has shape {tuple(x.shape)} (rank {x.ndim}). Give "
            "at most one entry per dimension.")
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = [a for a, t in types.items() if t == AxisType.Explicit]
    auto = [a for a, t in types.items() if t == AxisType.Auto]
    if explicit:
        current = getattr(getattr(jax.typeof(x), "sharding", None), "spec", P())
        current = list(current) + [None] * (x.ndim - len(current))
        layout = [(current[i] if entry is P.UNCONSTRAINED else entry)
                  for i, entry in enumerate(spec)]
        target = _keeping(layout, explicit)
        if target != _keeping(current, explicit):
            x = jax.sharding.reshard(x, target)
    if auto:
        x = _ORIGINAL_WSC(x, NamedSharding(mesh, _keeping(list(spec), auto)))
    return x


def _keeping(entries: list[Any], axes: list[str]) -> P:
    """The spec of ``entries`` naming only ``axes`` (others dropped)."""
    kept = []
    for entry in entries:
        if entry is None or entry is P.UNCONSTRAINED:
            kept.append(entry)
            continue
        names = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                      if a in axes)
        kept.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*kept)
