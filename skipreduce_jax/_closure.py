"""A loss that closes over the batch, made a function of it (nothing patched).

:func:`with_args` copies the function over new cells, defaults and
``functools.partial`` arguments; the user's function is left as it is.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

_DEPTH = 8  # how deep closures of closures are followed


def with_args(fun: Callable[..., Any], targets: Sequence[Any]) -> Callable[..., Any]:
    """``g(*args, values)``: a copy of ``fun`` whose closed-over ``targets[i]`` is ``values[i]``."""
    at = {id(t): i for i, t in enumerate(targets)}

    def g(*args_and_values):
        *args, values = args_and_values
        return _swap(fun, at, values, _DEPTH, {})(*args)

    return g


def _swap(obj: Any, at: dict[int, int], values: Sequence[Any], depth: int,
          seen: dict[int, Any]) -> Any:
    """``obj`` with the targets replaced: itself if it holds none."""
    if id(obj) in at:
        return values[at[id(obj)]]
    if depth == 0 or id(obj) in seen:
        return seen.get(id(obj), obj)
    seen[id(obj)] = obj  # a function that refers to itself keeps itself

    def swap(x):
        return _swap(x, at, values, depth - 1, seen)

    if isinstance(obj, functools.partial):
        out = functools.partial(swap(obj.func), *map(swap, obj.args),
                                **{k: swap(v) for k, v in obj.keywords.items()})
        changed = (out.func is not obj.func
                   or any(a is not b for a, b in zip(out.args, obj.args, strict=True))
                   or any(out.keywords[k] is not v for k, v in obj.keywords.items()))
    elif isinstance(obj, types.FunctionType):
        out, changed = _function(obj, swap)
    elif isinstance(obj, jax.core.Tracer) or not _is_container(obj):
        return obj
    else:
        leaves, treedef = jax.tree_util.tree_flatten(obj)
        new = [swap(x) for x in leaves]
        changed = any(a is not b for a, b in zip(new, leaves, strict=True))
        out = treedef.unflatten(new) if changed else obj
    seen[id(obj)] = out if changed else obj
    return seen[id(obj)]


def _is_container(obj: Any) -> bool:
    """A pytree with children (a tuple, dict, dataclass registered with JAX)."""
    leaves = jax.tree_util.tree_leaves(obj, is_leaf=lambda x: x is not obj)
    return not (len(leaves) == 1 and leaves[0] is obj)


def _function(fn: types.FunctionType, swap: Callable[[Any], Any]) -> tuple[Any, bool]:
    """A copy of ``fn`` over swapped cells and defaults, if any changed."""
    cells = []
    changed = False
    for cell in fn.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell (a name not yet bound)
            cells.append(cell)
            continue
        new = swap(content)
        changed |= new is not content
        cells.append(types.CellType(new) if new is not content else cell)
    defaults = tuple(map(swap, fn.__defaults__ or ()))
    changed |= any(a is not b for a, b in zip(defaults, fn.__defaults__ or (), strict=True))
    kwdefaults = {k: swap(v) for k, v in (fn.__kwdefaults__ or {}).items()}
    changed |= any(kwdefaults[k] is not v for k, v in (fn.__kwdefaults__ or {}).items())
    if not changed:
        return fn, False
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__,
                             defaults or None, tuple(cells) or None)
    out.__kwdefaults__ = kwdefaults or None
    out.__qualname__, out.__module__ = fn.__qualname__, fn.__module__
    out.__dict__.update(fn.__dict__)
    return out, True
