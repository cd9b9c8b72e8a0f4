"""A loss written for ``jax.jit``, run on each rank's rows without patching.

:func:`value_and_grad` and :func:`make_train_step` compute each rank's
local gradient inside a ``shard_map`` that is manual over the data axes.
Code written for a plain ``jax.jit`` step cannot always be traced there:

- ``jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))`` with a
  ``spec`` naming a data axis: JAX refuses it, since inside the body the
  data axes are Manual;
- flax's partitioning boxes constrain what they unbox, and they do so
  whenever a mesh is set (inside a ``shard_map`` one always is).

So :func:`per_rank` traces the loss *outside* the manual context, under
the mesh the caller's step sees, on the shapes of one rank's arguments
(``jax.make_jaxpr``), and evaluates that jaxpr inside the body. Each
sharding constraint is applied there with the data axes dropped from its
spec (a rank holds its own rows; what is left lays the value out over the
compiler's axes). Control flow (``scan``, ``while``, ``cond``), ``jax.jit``
and ``jax.checkpoint`` are replayed through their public functions, so the
constraints inside them are respelled too. Nothing in JAX or flax is
replaced: the user's functions run as they are, once, at trace time.

:func:`mean_count` needs the data axes, which do not exist outside the
body: while the loss is traced it leaves a marker (a ``jax.jit`` of the
identity with a known name) that the replay turns into the global count.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.extend.core import Literal, Var
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax._vma import varying_axes

# Markers: what the library's own functions leave in a traced loss where
# they need the data axes, which exist only in the body.
MEAN_COUNT = "skipreduce_mean_count"  # mean_count: the count made global
RANK_KEY = "skipreduce_rank_key"      # rank_key: a key folded with the rank
# The mesh axis that holds the ranks while a loss is traced as one rank's
# jit sees it under Explicit axes (see trace).
_RANKS = "skipreduce_ranks"
# True while a loss is traced for replay: the markers are left.
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "skipreduce_tracing_for_replay", default=False)


def tracing_for_replay() -> bool:
    """Whether a loss is being traced by :func:`trace` (markers are left)."""
    return _TRACING.get()


def mark(name: str, x: Any) -> Any:
    """``x``, marked ``name`` for the replay (a ``jax.jit`` of the identity)."""
    return jax.jit(_IDENTITY[name])(x)


def _identity(name: str) -> Callable[[Any], Any]:
    def identity(x):
        return x

    identity.__name__ = identity.__qualname__ = name
    return identity


_IDENTITY = {name: _identity(name) for name in (MEAN_COUNT, RANK_KEY)}


class Traced(NamedTuple):
    """A loss traced on one rank's shapes: its jaxpr and what replays it."""

    jaxpr: Any            # the ClosedJaxpr's open jaxpr
    consts: list[Any]     # the arrays the loss closes over
    at: list[int]         # positions of the array leaves among the arguments'
    out_tree: Any
    in_varying: list[bool]   # per array leaf: is it a batch leaf?


def trace(fun: Callable[..., Any], args: Sequence[Any], varying: Sequence[bool],
          mesh: Any, axes: tuple[str, ...], specs: Sequence[Any] | None = None,
          parts: int = 1) -> Traced:
    """``fun`` traced under ``mesh`` on the shapes of one rank's ``args``.

    Args:
      fun: the user's function (a loss), written for a plain ``jax.jit``.
      args: the arguments (arrays or shape-dtype structs; other leaves are
        traced as constants).
      varying: per positional argument, whether it differs per rank (the
        batch): which outputs depend on it is worked out from the jaxpr.
      mesh: the step's mesh.
      axes: its data axes.
      specs: for a loss that sets layouts over Explicit axes
        (``jax.sharding.reshard``, ``out_sharding=``), each leaf's layout in
        the caller's step (None: replicated). It is then traced as one
        rank's jit sees it: under ``mesh`` with the data axes of size 1 (the
        ranks moved to an axis of their own, as a mesh keeps its size inside
        ``jax.jit``), its arguments typed with those layouts.
      parts: what the varying leaves' leading dimensions are divided by.

    It is traced with no mesh set, as a plain ``jax.jit`` step without
    ``jax.set_mesh`` has it. A loss that itself reduces over the data axes
    (BatchNorm with ``axis_name``) needs them bound: it is traced again with
    them Manual, where a constraint naming them fails as JAX says. A loss
    that constrains with a bare ``PartitionSpec`` needs a mesh: it is traced
    again under ``mesh`` with every axis Auto.
    """
    leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
    at = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    per_leaf = [v for a, v in zip(args, varying, strict=True)
                for _ in jax.tree_util.tree_leaves(a)]

    def flat(*arrays):
        full = list(leaves)
        for i, a in zip(at, arrays, strict=True):
            full[i] = a
        return fun(*in_tree.unflatten(full))

    abstract = mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh
    one_rank = None if specs is None else jax.sharding.AbstractMesh(
        tuple(1 if a in axes else n for a, n in zip(
            abstract.axis_names, abstract.axis_sizes, strict=True))
        + (math.prod(abstract.shape[a] for a in axes),),
        (*abstract.axis_names, _RANKS), axis_types=(*abstract.axis_types, AxisType.Explicit))
    shapes = [jax.ShapeDtypeStruct(
        _part(np.shape(leaves[i]), parts if per_leaf[i] else 1), leaves[i].dtype,
        weak_type=getattr(leaves[i], "weak_type", False),
        sharding=None if one_rank is None else NamedSharding(one_rank, specs[i] or P()))
        for i in at]

    def traced_under(context, **kwargs):
        with jax.sharding.use_abstract_mesh(context), tracing_markers():
            return jax.make_jaxpr(flat, return_shape=True, **kwargs)(*shapes)

    try:
        closed, out = traced_under(one_rank or jax.sharding.AbstractMesh((), ()))
    except (NameError, RuntimeError) as first:
        # An unbound axis name (the loss's own collective over the data
        # axes), or a bare PartitionSpec (it needs a mesh): traced again with
        # the data axes bound and the mesh set; if that fails too, the first
        # error is the one raised.
        if one_rank:
            raise
        again = (abstract.update_axis_types({a: AxisType.Manual if a in axes else AxisType.Auto
                                             for a in abstract.axis_names}),
                 dict(axis_env=[(a, mesh.shape[a]) for a in axes]))
        if isinstance(first, RuntimeError):
            again = (abstract.update_axis_types({a: AxisType.Auto
                                                 for a in abstract.axis_names}), {})
        try:
            closed, out = traced_under(again[0], **again[1])
        except Exception:
            raise first from None
    in_varying = [per_leaf[i] for i in at]
    return Traced(closed.jaxpr, list(closed.consts), at,
                  jax.tree_util.tree_structure(out), in_varying)


def _part(shape: tuple[int, ...], parts: int) -> tuple[int, ...]:
    return (shape[0] // parts,) + shape[1:] if parts > 1 else shape


def replay(traced: Traced, markers: dict[str, Callable[[Any, bool], Any]]) -> Callable[..., Any]:
    """The traced loss as a function of (one rank's) arguments, in the body.

    ``markers[name](x, varying)``: what a marker becomes (``varying``:
    whether ``x`` depends on the batch). Closed-over arrays are passed as
    the last argument (``consts``).
    """

    def replayed(*args_and_consts):
        *args, consts = args_and_consts
        leaves = jax.tree_util.tree_leaves(tuple(args))
        arrays = [leaves[i] for i in traced.at]
        outs = _eval(traced.jaxpr, consts, arrays, traced.in_varying, markers)
        return traced.out_tree.unflatten(outs)

    return replayed


def _flags(jaxpr: Any, in_flags: Sequence[bool]) -> list[bool]:
    """Per output of ``jaxpr``: does it depend on an input flagged (the batch)?"""
    flags = dict(zip(jaxpr.invars, in_flags, strict=True))
    for eqn in jaxpr.eqns:
        flags.update(zip(eqn.outvars, _eqn_flags(eqn, _read_flags(eqn, flags)),
                         strict=True))
    return [not isinstance(v, Literal) and flags.get(v, False) for v in jaxpr.outvars]


def _read_flags(eqn: Any, flags: dict[Any, bool]) -> list[bool]:
    return [not isinstance(v, Literal) and flags.get(v, False) for v in eqn.invars]


def _eqn_flags(eqn: Any, in_flags: list[bool]) -> list[bool]:
    """Per output of one equation: does it depend on the batch (or the rank)?"""
    name, p = eqn.primitive.name, eqn.params
    if name in ("jit", "pjit"):
        if p["name"] == RANK_KEY:
            return [True]
        return in_flags[:1] if p["name"] == MEAN_COUNT else _flags(p["jaxpr"].jaxpr, in_flags)
    if name == "remat2":
        return _flags(p["jaxpr"], in_flags)
    if name in ("custom_jvp_call", "custom_vjp_call"):
        inner = p["call_jaxpr"].jaxpr
        if len(inner.invars) == len(in_flags):
            return _flags(inner, in_flags)
    if name == "scan":
        c, n = p["num_consts"], p["num_carry"]
        carry = _scan_carry(p, in_flags)
        out = _flags(p["jaxpr"].jaxpr, in_flags[:c] + carry + in_flags[c + n:])
        return carry + out[n:]
    if name == "while":
        carry, predicate = _while_carry(p, in_flags)
        return [f or predicate for f in carry]
    if name == "cond":
        outs = [_flags(b.jaxpr, in_flags[1:]) for b in p["branches"]]
        return [in_flags[0] or any(col) for col in zip(*outs, strict=True)]
    return [any(in_flags)] * len(eqn.outvars)


def _scan_carry(p: dict[str, Any], in_flags: list[bool]) -> list[bool]:
    """A scan's carry flags: its initial ones, or'd with the body's to a fixed point."""
    c, n = p["num_consts"], p["num_carry"]
    carry = in_flags[c:c + n]
    while True:
        out = _flags(p["jaxpr"].jaxpr, in_flags[:c] + carry + in_flags[c + n:])[:n]
        new = [a or b for a, b in zip(carry, out, strict=True)]
        if new == carry:
            return carry
        carry = new


def _while_carry(p: dict[str, Any], in_flags: list[bool]) -> tuple[list[bool], bool]:
    """A while loop's carry flags (fixed point) and its predicate's flag."""
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    carry = in_flags[cn + bn:]
    while True:
        out = _flags(p["body_jaxpr"].jaxpr, in_flags[cn:cn + bn] + carry)
        new = [a or b for a, b in zip(carry, out, strict=True)]
        if new == carry:
            break
        carry = new
    return carry, _flags(p["cond_jaxpr"].jaxpr, in_flags[:cn] + carry)[0]


@contextlib.contextmanager
def tracing_markers() -> Iterator[None]:
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer,
                          jax.ShapeDtypeStruct))


def _eval(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
          varying: Sequence[bool], markers: dict[str, Callable[[Any, bool], Any]],
          env: dict[Any, Any] | None = None) -> list[Any]:
    """``jax.core.eval_jaxpr``, with constraints respelled and markers counted.

    ``varying``: per input, whether it depends on the batch (for markers).
    ``env``: the values of the enclosing jaxprs' variables, shared with
    this one's (each variable is its own object).
    """
    env = {} if env is None else env
    flags: dict[Any, bool] = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x, f in zip(jaxpr.invars, args, varying, strict=True):
        env[v], flags[v] = x, f
    for eqn in jaxpr.eqns:
        in_flags = _read_flags(eqn, flags)
        # Not under eqn.ctx: it holds the mesh of the trace, not the body's.
        outs = _apply(eqn, [read(v) for v in eqn.invars], in_flags, markers, env)
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, x, f in zip(eqn.outvars, outs, _eqn_flags(eqn, in_flags), strict=True):
            env[v], flags[v] = x, f
    return [read(v) for v in jaxpr.outvars]


def _apply(eqn: Any, ins: list[Any], in_flags: list[bool],
           markers: dict[str, Callable[[Any, bool], Any]], env: dict[Any, Any]) -> Any:
    """One equation, in the body."""
    name, params = eqn.primitive.name, eqn.params

    def sub(closed, flags):
        return lambda *a: _eval(closed.jaxpr, closed.consts, a, flags, markers, env)

    if name == "sharding_constraint":
        return constrain(ins[0], params["sharding"])
    if name == "reshard":
        return constrain(ins[0], params["dst_sharding"])
    if name in ("jit", "pjit"):
        if params["name"] in markers:
            return [markers[params["name"]](ins[0], in_flags[0])]
        return sub(params["jaxpr"], in_flags)(*ins)
    if name == "scan":
        consts, n = params["num_consts"], params["num_carry"]
        body = sub(params["jaxpr"], in_flags[:consts] + _scan_carry(params, in_flags)
                   + in_flags[consts + n:])

        def step(carry, x):
            out = body(*ins[:consts], *carry, *x)
            return out[:n], out[n:]

        carry, ys = lax.scan(step, ins[consts:consts + n], ins[consts + n:],
                             length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
        return [*carry, *ys]
    if name == "while":
        cn, bn = params["cond_nconsts"], params["body_nconsts"]
        carry, _ = _while_carry(params, in_flags)
        cond = sub(params["cond_jaxpr"], in_flags[:cn] + carry)
        body = sub(params["body_jaxpr"], in_flags[cn:cn + bn] + carry)
        return lax.while_loop(lambda c: cond(*ins[:cn], *c)[0],
                              lambda c: body(*ins[cn:cn + bn], *c),
                              ins[cn + bn:])
    if name == "cond":
        return lax.switch(ins[0], [sub(b, in_flags[1:]) for b in params["branches"]],
                          *ins[1:])
    if name == "remat2":
        inner = params["jaxpr"]
        return jax.checkpoint(
            lambda *a: _eval(inner, (), a, in_flags, markers, env),
            prevent_cse=params["prevent_cse"], policy=params["policy"])(*ins)
    # In a body that types values as varying per rank, operands are made
    # alike first, as jax.numpy's functions do (jaxprs carry no such types).
    ins = _alike(ins)
    if name == "custom_jvp_call" and (_typed(params["call_jaxpr"]) or _varies(ins)) and not any(
            _holds_marker(j) for j in _jaxprs(params)):
        return _custom_jvp(params, ins, in_flags, markers, env)
    if name == "custom_vjp_call" and (_varies(ins) or _typed(params["call_jaxpr"])):
        info = params["call_jaxpr"].jaxpr.debug_info
        where = ("runs in a per-rank step (make_train_step, data_parallel), traced as "
                 "plain jit code for its layouts," if _varies(ins) else
                 "sets layouts over Explicit mesh axes (jax.sharding.reshard, "
                 "out_sharding=)")
        raise ValueError(
            f"{'' if _varies(ins) else 'value_and_grad: '}The loss {where} and calls "
            "a jax.custom_vjp function "
            f"({getattr(info, 'func_src_info', None) or 'its name unknown'}), whose "
            "backward rule JAX types for the trace, not for a rank, so it cannot run "
            "per rank there. Take the gradients with skipreduce_jax.value_and_grad "
            "in a plain jax.jit step on a mesh of Auto axes, where layouts are "
            "constraints, or set no layouts naming the data axes in the loss.")
    if any(_holds_marker(j) for j in _jaxprs(params)):
        raise ValueError(
            f"value_and_grad: skipreduce_jax.mean_count or rank_key is called inside "
            f"a function that JAX keeps whole ({name}: a jax.custom_vjp or "
            "custom_jvp), where the library cannot reach it per rank. Call it "
            "outside that function and pass its result in.")
    # A layout set by the operation (out_sharding=) names the trace's mesh:
    # the operation runs without it, and its output is constrained to it.
    layouts = [v for v in params.values() if isinstance(v, NamedSharding)]
    params = {k: None if isinstance(v, NamedSharding) else v for k, v in params.items()}
    out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(params))
    if layouts and not eqn.primitive.multiple_results:
        out = constrain(out, layouts[0])
    return out


def _varies(ins: list[Any]) -> bool:
    return any(_vma(x) for x in ins)


def _vma(x: Any) -> frozenset[str]:
    return varying_axes(x) if _is_array(x) else frozenset()


def _alike(ins: list[Any]) -> list[Any]:
    """``ins``, each varying over every axis one of them varies over."""
    union = frozenset().union(*map(_vma, ins))
    if not union:
        return ins
    return [lax.pcast(x, tuple(sorted(union - _vma(x))), to="varying")
            if union - _vma(x) and (_is_array(x) or isinstance(x, (bool, int, float, complex)))
            else x for x in ins]


def _typed(closed: Any) -> bool:
    """Does ``closed`` (a ClosedJaxpr) type its inputs with a mesh's layouts?"""
    return any(not getattr(getattr(a, "sharding", None), "mesh", AbstractMesh((), ())).empty
               for a in closed.in_avals)


def _custom_jvp(params: dict[str, Any], ins: list[Any], in_flags: list[bool],
                markers: dict[str, Callable[[Any, bool], Any]],
                env: dict[Any, Any]) -> list[Any]:
    """A ``jax.custom_jvp`` traced under Explicit axes, in the body.

    Its function and its JVP rule's jaxpr (from the rule the user wrote)
    are replayed like the loss; the rule stays the rule. A value of the
    loss the rule closes over (a tracer of the trace) is its value here.
    """
    call, consts = params["call_jaxpr"], params["num_consts"]
    flags = in_flags[consts:]

    @jax.custom_jvp
    def f(*xs):
        return _eval(call.jaxpr, call.consts, [*ins[:consts], *xs], in_flags, markers, env)

    @f.defjvp
    def f_jvp(primals, tangents):
        traced_on = next((a.sharding.mesh for a in call.in_avals
                          if not a.sharding.mesh.empty), AbstractMesh((), ()))
        with jax.sharding.use_abstract_mesh(traced_on):  # the rule's trace
            jaxpr, jvp_consts, out_zeros = params["jvp_jaxpr_fun"].call_wrapped(
                *[False] * len(primals))
        jvp_consts = [env.get(c.val, c) if isinstance(getattr(c, "val", None), Var)
                      else c for c in jvp_consts]
        out = _eval(jaxpr, jvp_consts, [*primals, *tangents], flags + flags, markers, env)
        out_primals, nonzero = out[:len(out_zeros)], iter(out[len(out_zeros):])
        return out_primals, [jax.numpy.zeros_like(p) if z else next(nonzero)
                             for p, z in zip(out_primals, out_zeros, strict=True)]

    return f(*ins[consts:])


def _jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """The jaxprs an equation's params hold."""
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if hasattr(x, "eqns"):
                yield x
            elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr


def _holds_marker(jaxpr: Any) -> bool:
    return any(e.params.get("name") in _IDENTITY or any(map(_holds_marker, _jaxprs(e.params)))
               for e in jaxpr.eqns)


def constrain(x: Any, sharding: Any) -> Any:
    """A constraint of the caller's mesh, applied to one rank's value.

    The body's mesh has the data axes Manual: they are dropped from the
    spec. What is left constrains ``x`` over the compiler's Auto axes
    (``with_sharding_constraint``) and sets its layout over Explicit ones
    (``jax.sharding.reshard``); with every axis manual ``x`` is returned.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if isinstance(sharding, NamedSharding):
        # A trace under Explicit axes has the data axes (Manual here) of size 1.
        manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                  if t == AxisType.Manual and _RANKS in sharding.mesh.axis_names} | {_RANKS}
        theirs, ours = ({a: n for a, n in zip(m.axis_names, m.axis_sizes, strict=True)
                         if a not in manual} for m in (sharding.mesh, mesh))
        if theirs != ours:
            raise ValueError(
                "with_sharding_constraint in the loss: the sharding's mesh has "
                f"axes {theirs}, the step's mesh {ours}. Constrain with the mesh "
                "the step runs on (NamedSharding(mesh, spec)), or a bare "
                "PartitionSpec under jax.set_mesh(mesh).")
        spec = sharding.spec
    else:
        return lax.with_sharding_constraint(x, sharding)  # JAX decides
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = [a for a, t in types.items() if t == AxisType.Explicit]
    auto = [a for a, t in types.items() if t == AxisType.Auto]
    entries = list(spec) + [None] * (x.ndim - len(spec))
    if explicit:
        current = getattr(getattr(jax.typeof(x), "sharding", None), "spec", P())
        current = list(current) + [None] * (x.ndim - len(current))
        layout = [(current[i] if e is P.UNCONSTRAINED else e)
                  for i, e in enumerate(entries)]
        target = _keeping(layout, explicit)
        if target != _keeping(current, explicit):
            x = jax.sharding.reshard(x, target)
    if auto:
        x = lax.with_sharding_constraint(x, NamedSharding(mesh, _keeping(entries, auto)))
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
