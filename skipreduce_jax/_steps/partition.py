"""The data axis, partitioned: a loss for the global batch, run per rank, meaning kept.

:func:`value_and_grad` traces the user's loss once on the global arguments,
as ``jax.jit`` sees them, and :func:`evaluate` runs that jaxpr inside a
``shard_map`` manual over the data axes. Every value is either *whole* (the
global array, the same on every rank) or *split*: its dimension ``dim`` is
cut into N blocks over the data axes, rank ``r`` holding block ``r``. Each
primitive does on those pieces what it does on the global arrays:

- elementwise operations, broadcasts, reshapes, transposes, slices and
  contractions that keep the split dimension whole run locally;
- a reduction or contraction over the split dimension reduces locally, then
  sums over the data axes (a mean divides by the global count, as the
  traced jaxpr already does);
- a whole value that meets a split one gives the rank its block (no
  communication): random bits, ``iota`` and closed-over arrays are made
  whole, so a dropout mask is ``jax.jit``'s, row by row;
- anything else that crosses rows (a sort, top-k or cumsum along them,
  ``x @ x.T`` over them, a max over them, an index into them, a
  ``jax.custom_vjp``) gathers its split operands (``all_gather``) and runs
  whole: exact, at the bytes :class:`PartitionReport` counts.

The gradient rule (``value_and_grad``): the params enter cast to varying, so
each rank's gradient is its own contribution; every rank holds the global
loss, cast to varying and divided by N before it is differentiated. JAX's
typed autodiff then transposes each collective into its dual, and the ranks'
gradients sum to ``jax.value_and_grad``'s, once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.extend.random import threefry2x32_p
from jax.sharding import NamedSharding

from skipreduce_jax._steps.replay import constrain
from skipreduce_jax._vma import varying_axes

Layout = int | None  # the split dimension, or None: whole


@dataclasses.dataclass
class PartitionReport:
    """What the partitioning gathered: one entry per primitive computed whole.

    ``gathered[name]`` is the number of elements all-gathered (per rank,
    received) for primitive ``name``; ``value_and_grad.report`` shows it.
    """

    axes: tuple[str, ...]
    ranks: int
    gathered: dict[str, int] = dataclasses.field(default_factory=dict)
    # The mesh the loss was traced under: JAX traces a custom rule lazily,
    # and caches it, so it is traced under that mesh, not the body's.
    trace_mesh: Any = dataclasses.field(default_factory=lambda: jax.sharding.AbstractMesh((), ()))
    # Every variable's piece and layout, shared by the nested jaxprs (each
    # variable is its own object): a custom rule traced later may close over
    # a value of the loss, which is then found here.
    env: dict[Any, tuple[Any, Layout]] = dataclasses.field(default_factory=dict, repr=False)

    def note(self, name: str, elements: int) -> None:
        self.gathered[name] = self.gathered.get(name, 0) + elements


# Operations that act element by element on operands of one shape (scalars
# broadcast): a split operand stays split, a whole one gives its block.
ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type cbrt ceil clamp
complex conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or population_count pow real reduce_precision
rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh
sqrt square stop_gradient sub tan tanh xor clz square random_wrap random_unwrap
""".split())


def evaluate(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
             layouts: Sequence[Layout], report: PartitionReport,
             const_layouts: Sequence[Layout] | None = None,
             lazy: bool = False) -> tuple[list[Any], list[Layout]]:
    """``jaxpr`` (global shapes) on the pieces ``args`` laid out as ``layouts``.

    ``consts`` are whole unless ``const_layouts`` says otherwise; ``lazy``:
    outputs may be :class:`Lazy` (for a jaxpr inlined in another).
    """
    env = report.env

    def read(v):
        return (v.val, None) if isinstance(v, Literal) else env[v]

    const_layouts = const_layouts or [None] * len(consts)
    for v, c, layout in zip(jaxpr.constvars, consts, const_layouts, strict=True):
        env[v] = (c, layout)
    for v, x, layout in zip(jaxpr.invars, args, layouts, strict=True):
        env[v] = (x, layout)
    for eqn in jaxpr.eqns:
        vals, ins = zip(*map(read, eqn.invars)) if eqn.invars else ((), ())
        outs, out_layouts = apply(eqn, list(vals), list(ins), report)
        for v, x, layout in zip(eqn.outvars, outs, out_layouts, strict=True):
            env[v] = (x, layout)
    pairs = [read(v) for v in jaxpr.outvars]
    return ([x if lazy else _made(x) for x, _ in pairs], [layout for _, layout in pairs])


class Lazy:
    """A whole value made only where it is used: a rank's block, or all of it.

    Random bits are one: with ``jax_threefry_partitionable`` the bits of
    element ``i`` are a hash of the key and ``i`` alone, so a rank's block
    needs none of the rest; so is an elementwise op of whole values one of
    which is lazy (a dropout mask from its bits). Where such a value meets
    split ones, :func:`take` asks for ``block(dim)``; anything else gets
    ``whole()``.
    """

    def __init__(self, shape: tuple[int, ...], block: Callable[[int], Any],
                 whole: Callable[[], Any]):
        self.shape, self.block, self.whole = shape, block, whole


def _drawn(key: Any, shape: tuple[int, ...], report: PartitionReport) -> Lazy:
    """``random_bits`` of ``key`` (32 bits), drawn per block."""

    def block(dim):
        local = list(shape)
        local[dim] //= report.ranks
        start = (rank_index(report) * local[dim]).astype(np.uint32)
        index = lax.full(local, np.uint32(0), np.uint32)
        for k in range(len(shape)):
            coord = lax.broadcasted_iota(np.uint32, local, k)
            if k == dim:
                coord = coord + start
            index = index + coord * np.uint32(math.prod(shape[k + 1:]))
        data = jax.random.key_data(key)
        hi, lo = threefry2x32_p.bind(data[0], data[1], lax.full_like(index, 0), index)
        return hi ^ lo

    return Lazy(shape, block, lambda: jax.random.bits(key, shape, np.uint32))


def _lazy_elementwise(eqn: Any, vals: list[Any], report: PartitionReport) -> Lazy:
    """An elementwise op of whole values, one of them lazy: lazy too."""
    shape = tuple(eqn.outvars[0].aval.shape)

    def block(dim):
        return _bind(eqn, [take(x, dim, report) if _shape(x) == shape else _made(x)
                           for x in vals])[0]

    return Lazy(shape, block, lambda: _bind(eqn, [_made(x) for x in vals])[0])


def _made(x: Any) -> Any:
    return x.whole() if isinstance(x, Lazy) else x


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, Lazy) else np.shape(x)


def _drawable(eqn: Any, key: Any, layout: Layout, report: PartitionReport) -> bool:
    """Whether ``random_bits`` may be drawn per block (see :class:`Lazy`)."""
    shape = tuple(eqn.params["shape"])
    return (layout is None and eqn.params["bit_width"] == 32 and np.shape(key) == ()
            and jax.config.jax_threefry_partitionable and 0 < math.prod(shape) < 2**32
            and str(jax.random.key_impl(key)) == "threefry2x32"
            and any(n % report.ranks == 0 for n in shape))


def apply(eqn: Any, vals: list[Any], layouts: list[Layout],
          report: PartitionReport) -> tuple[list[Any], list[Layout]]:
    """One equation on pieces: its outputs and their layouts."""
    name = eqn.primitive.name
    _check_differentiable(eqn)
    if name == "random_bits" and _drawable(eqn, vals[0], layouts[0], report):
        return [_drawn(vals[0], tuple(eqn.params["shape"]), report)], [None]
    if name in ELEMENTWISE and any(d is not None for d in layouts):
        return _elementwise(eqn, vals, layouts, report)
    if name in ELEMENTWISE and len(eqn.outvars) == 1 and any(isinstance(x, Lazy) for x in vals):
        return [_lazy_elementwise(eqn, vals, report)], [None]
    if vals and isinstance(vals[0], Lazy) and (name in ("sharding_constraint", "reshard") or (
            name in ("reshape", "broadcast_in_dim")
            and tuple(eqn.outvars[0].aval.shape) == vals[0].shape)):
        # A layout (nnx.Dropout reshards its mask), or its own shape (as
        # jax.random.uniform ends): the value, still made only where used.
        return [vals[0]], [None]
    if name not in _CALLS:  # a call's body meets its lazy inputs itself
        vals = [_made(x) for x in vals]
    rule = _RULES.get(name)
    if rule is not None:
        return rule(eqn, vals, layouts, report)
    if (all(layout is None for layout in layouts) and not _user_rule(eqn)
            and not name.startswith(_SPARSE)):
        return _bind(eqn, vals), [None] * len(eqn.outvars)
    if name in ELEMENTWISE:
        return _elementwise(eqn, vals, layouts, report)
    # Any other primitive (a new one, a call of JAX's next scan, remat or
    # custom_vjp) runs whole on values typed the same on every rank, as it
    # was traced: its own rules then apply unchanged.
    vals = [_invariant(x, d, report, name) for x, d in zip(vals, layouts, strict=True)]
    return _bind(eqn, vals), [None] * len(eqn.outvars)


def _check_differentiable(eqn: Any) -> None:
    """Refuses, by name, a JAX primitive object this partitioning cannot run.

    The flags in testing in jax 0.10 (``jax_scan3``, ``jax_remat3``,
    ``jax_custom_vjp3``) make scans, checkpoints and custom rules a
    ``call_hi_primitive`` holding an object. Refused: one whose class leaves
    out its gradient (``Scan3`` has no ``vjp_fwd``), and one called on values
    typed with layouts over Explicit axes, as :func:`_custom_vjp` refuses.
    Found from the objects' classes and types, not from an error text.
    """
    prim = eqn.params.get("_prim")
    if prim is None:
        return
    what = f"{type(prim).__name__} ({eqn.primitive.name}, the form a JAX flag in testing gives it)"
    defined = next((c for c in type(prim).__mro__ if "vjp_fwd" in vars(c)), None)
    if defined is not None and defined.__name__ == "VJPHiPrimitive":
        raise ValueError(
            f"value_and_grad: the loss holds {what}, whose gradient JAX does not define "
            "(jax_scan3 makes lax.scan one). Turn the flag off (e.g. unset JAX_SCAN3) "
            "for this loss.")
    meshes = [getattr(getattr(v.aval, "sharding", None), "mesh", None) for v in eqn.invars]
    if any(m is not None and not m.empty for m in meshes):
        raise ValueError(
            f"value_and_grad: the loss calls {what} on values typed with layouts over "
            "Explicit mesh axes (it sets them: reshard, out_sharding=). Its rules are "
            "typed for those layouts, so they cannot run on the data axis's pieces. Write "
            "the loss without setting layouts, run the step on a mesh of Auto axes, or "
            "turn the flag off.")


def _user_rule(eqn: Any) -> bool:
    """Whether ``eqn`` is a user's rule held as an object (``jax_custom_vjp3``).

    Its forward rule is checked against the types it was traced with, so it
    gets values typed the same on every rank, as :func:`_custom_vjp` gives.
    """
    return "fwd" in getattr(eqn.params.get("_prim"), "params", {})


# ---------------------------------------------------------------- helpers

def rank_index(report: PartitionReport) -> jax.Array:
    return lax.axis_index(report.axes)


def take(x: Any, dim: int, report: PartitionReport) -> Any:
    """The rank's block of whole ``x`` along ``dim`` (no communication)."""
    if isinstance(x, Lazy):
        return x.block(dim)
    size = x.shape[dim] // report.ranks
    return lax.dynamic_slice_in_dim(x, rank_index(report) * size, size, axis=dim)


def gather(x: Any, dim: int, report: PartitionReport, why: str) -> Any:
    """Whole ``x`` from its blocks along ``dim`` (an all-gather)."""
    report.note(why, int(np.prod(x.shape)) * report.ranks)
    return lax.all_gather(varying(x, report), report.axes, axis=dim, tiled=True)


def relayout(x: Any, src: Layout, dst: Layout, report: PartitionReport, why: str) -> Any:
    if src == dst:
        return x
    if src is not None:
        x = gather(x, src, report, why)
    return x if dst is None else take(x, dst, report)


def varying(x: Any, report: PartitionReport) -> Any:
    """``x`` typed varying over the data axes (no data moves)."""
    missing = tuple(a for a in report.axes if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _alike(vals: list[Any]) -> list[Any]:
    """Operands varying over every axis one of them varies over (as jnp does)."""
    arrays = [x for x in vals if hasattr(x, "shape") or isinstance(x, (bool, int, float, complex))]
    union = frozenset().union(*(varying_axes(x) for x in arrays)) if arrays else frozenset()
    if not union:
        return vals
    out = []
    for x in vals:
        is_array = hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))
        missing = tuple(sorted(union - varying_axes(x))) if is_array else ()
        out.append(lax.pcast(x, missing, to="varying") if missing else x)
    return out


def _bind(eqn: Any, vals: list[Any], **changes: Any) -> list[Any]:
    """``eqn``'s primitive on ``vals``; layouts it names over the mesh become constraints."""
    params = {**eqn.params, **changes}
    shardings = [v for v in params.values() if isinstance(v, NamedSharding)]
    params = {k: None if isinstance(v, NamedSharding) else v for k, v in params.items()}
    out = eqn.primitive.bind(*_alike(vals), **eqn.primitive.get_bind_params(params))
    if not eqn.primitive.multiple_results:
        out = [out]
        if shardings and not changes:
            out = [constrain(out[0], shardings[0])]
    return list(out)


def _whole(eqn: Any, vals: list[Any], layouts: list[Layout], report: PartitionReport
           ) -> tuple[list[Any], list[Layout]]:
    """``eqn`` computed whole on every rank, its split operands gathered."""
    name = eqn.primitive.name
    vals = [relayout(x, d, None, report, name) for x, d in zip(vals, layouts, strict=True)]
    return _bind(eqn, vals), [None] * len(eqn.outvars)


def _split(layouts: Sequence[Layout]) -> list[int]:
    return [d for d in layouts if d is not None]


# ---------------------------------------------------------------- rules

def _elementwise(eqn, vals, layouts, report):
    dims = set(_split(layouts))
    if len(dims) > 1:
        return _whole(eqn, vals, layouts, report)
    dim = dims.pop()
    shape = eqn.outvars[0].aval.shape
    # A whole operand gives its block; one of size 1 along the rows broadcasts.
    vals = [take(x, dim, report) if d is None and len(_shape(x)) == len(shape)
            and _shape(x)[dim] == shape[dim] else _made(x)
            for x, d in zip(vals, layouts, strict=True)]
    return _bind(eqn, vals), [dim] * len(eqn.outvars)


def _broadcast_in_dim(eqn, vals, layouts, report):
    (x, *dyn), (d, *_) = vals, layouts
    if d is None or dyn:
        return _whole(eqn, vals, layouts, report)
    out_dim = eqn.params["broadcast_dimensions"][d]
    shape = list(eqn.params["shape"])
    shape[out_dim] = x.shape[d]
    return _bind(eqn, [x], shape=tuple(shape), sharding=None), [out_dim]


def _reshape(eqn, vals, layouts, report):
    (x, *dyn), (d, *_) = vals, layouts
    if d is None or dyn or eqn.params.get("dimensions") is not None:
        return _whole(eqn, vals, layouts, report)
    src = eqn.invars[0].aval.shape
    dst = tuple(eqn.params["new_sizes"])
    lead = math.prod(src[:d])
    n = report.ranks
    for e in range(len(dst)):
        if math.prod(dst[:e]) == lead and dst[e] % n == 0 and (
                dst[e] % src[d] == 0 or src[d] % dst[e] == 0):
            new = list(dst)
            new[e] //= n
            return _bind(eqn, [x], new_sizes=tuple(new), sharding=None), [e]
    return _whole(eqn, vals, layouts, report)


def _transpose(eqn, vals, layouts, report):
    perm = list(eqn.params["permutation"])
    return _bind(eqn, vals), [perm.index(layouts[0])]


def _squeeze(eqn, vals, layouts, report):
    d = layouts[0]
    dims = eqn.params["dimensions"]
    return _bind(eqn, vals), [d - sum(1 for a in dims if a < d)]


def _reduce(collective):
    def rule(eqn, vals, layouts, report):
        d = layouts[0]
        axes = eqn.params["axes"]
        if d not in axes:
            return _bind(eqn, vals), [d - sum(1 for a in axes if a < d)]
        if collective is None:
            return _whole(eqn, vals, layouts, report)
        local = _bind(eqn, vals)[0]
        return [collective(local, report.axes)], [None]
    return rule


def _argreduce(eqn, vals, layouts, report):
    d = layouts[0]
    axes = eqn.params["axes"]
    if d in axes:
        return _whole(eqn, vals, layouts, report)
    return _bind(eqn, vals), [d - sum(1 for a in axes if a < d)]


def _dot_general(eqn, vals, layouts, report):
    (lhs, rhs), (dl, dr) = vals, layouts
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lnd, rnd = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    l_free = [i for i in range(lnd) if i not in lc and i not in lb]
    r_free = [i for i in range(rnd) if i not in rc and i not in rb]

    # A split batch or contracted dimension: the other operand follows it
    # (split there too); a contraction then sums the ranks' partial products.
    ops, dims = [lhs, rhs], [dl, dr]
    for side, (own_batch, own_contract, batch, contract) in enumerate(
            ((lb, lc, rb, rc), (rb, rc, lb, lc))):
        d = dims[side]
        for own, theirs, summed in ((own_batch, batch, False), (own_contract, contract, True)):
            if d is None or d not in own:
                continue
            ops[1 - side] = relayout(ops[1 - side], dims[1 - side], theirs[list(own).index(d)],
                                     report, "dot_general")
            out = _bind(eqn, ops, out_sharding=None)
            if summed:
                return [lax.psum(out[0], report.axes)], [None]
            return out, [list(own).index(d)]
    if dl is not None:  # a free dimension of the lhs; the rhs whole
        rhs = relayout(rhs, dr, None, report, "dot_general")
        return _bind(eqn, [lhs, rhs], out_sharding=None), [len(lb) + l_free.index(dl)]
    return _bind(eqn, [lhs, rhs], out_sharding=None), [len(lb) + len(l_free) + r_free.index(dr)]


def _keeps_rows(eqn, vals, layouts, report, same: Callable[[int], bool]):
    """An op that maps each operand's split dimension to itself, where ``same(d)``."""
    dims = set(_split(layouts))
    if len(dims) != 1 or not same(next(iter(dims))):
        return _whole(eqn, vals, layouts, report)
    d = dims.pop()
    vals = [take(x, d, report) if layout is None and np.ndim(x) > d
            and np.shape(x)[d] == eqn.outvars[0].aval.shape[d] else x
            for x, layout in zip(vals, layouts, strict=True)]
    return _bind(eqn, vals), [d] * len(eqn.outvars)


def _slice(eqn, vals, layouts, report):
    d, p = layouts[0], eqn.params
    full = eqn.invars[0].aval.shape[d]
    strides = p["strides"]
    if p["start_indices"][d] != 0 or p["limit_indices"][d] != full or (
            strides and strides[d] != 1):
        return _whole(eqn, vals, layouts, report)
    limit = list(p["limit_indices"])
    limit[d] = vals[0].shape[d]
    return _bind(eqn, vals, limit_indices=tuple(limit)), [d]


def _dynamic_slice(eqn, vals, layouts, report):
    d = layouts[0]
    sizes = list(eqn.params["slice_sizes"])
    if d is None or any(layouts[1:]) or sizes[d] != eqn.invars[0].aval.shape[d]:
        return _whole(eqn, vals, layouts, report)
    sizes[d] = vals[0].shape[d]
    return _bind(eqn, vals, slice_sizes=tuple(sizes)), [d]


def _dynamic_update_slice(eqn, vals, layouts, report):
    d = layouts[0] if layouts[0] is not None else layouts[1]
    shape = eqn.invars[1].aval.shape
    if d is None or any(layouts[2:]) or shape[d] != eqn.invars[0].aval.shape[d]:
        return _whole(eqn, vals, layouts, report)
    ops = [relayout(x, layout, d, report, "dynamic_update_slice")
           for x, layout in zip(vals[:2], layouts[:2], strict=True)]
    return _bind(eqn, ops + vals[2:]), [d]


def _pad(eqn, vals, layouts, report):
    d = layouts[0]
    if d is None or layouts[1] is not None or any(eqn.params["padding_config"][d]):
        return _whole(eqn, vals, layouts, report)
    return _bind(eqn, vals), [d]


def _gather_rule(eqn, vals, layouts, report):
    """Indexing: local where the split dimension is a batch of the lookup."""
    (x, idx), (dx, di) = vals, layouts
    dn = eqn.params["dimension_numbers"]
    out_nd = len(eqn.outvars[0].aval.shape)
    idx_nd = len(eqn.invars[1].aval.shape)
    batch_out = [i for i in range(out_nd) if i not in dn.offset_dims]
    idx_dims = [i for i in range(idx_nd) if i != idx_nd - 1]  # the index vector is last

    def out_of_index(j):
        return batch_out[idx_dims.index(j)]

    if dx is not None and dx in dn.operand_batching_dims:
        j = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(dx)]
        idx = relayout(idx, di, j, report, "gather")
        sizes = list(eqn.params["slice_sizes"])
        return _bind(eqn, [x, idx], slice_sizes=tuple(sizes)), [out_of_index(j)]
    if dx is None and di is not None and di < idx_nd - 1:
        if di in dn.start_indices_batching_dims:
            k = dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(di)]
            x = take(x, k, report)
        return _bind(eqn, [x, idx]), [out_of_index(di)]
    window = [i for i in range(len(eqn.invars[0].aval.shape))
              if i not in dn.collapsed_slice_dims and i not in dn.operand_batching_dims]
    if (dx is not None and di is None and dx not in dn.start_index_map and dx in window
            and eqn.params["slice_sizes"][dx] == eqn.invars[0].aval.shape[dx]):
        sizes = list(eqn.params["slice_sizes"])
        sizes[dx] = x.shape[dx]
        return _bind(eqn, [x, idx], slice_sizes=tuple(sizes)), [dn.offset_dims[window.index(dx)]]
    return _whole(eqn, vals, layouts, report)


def _scatter_add(eqn, vals, layouts, report):
    """A scatter-add of split updates into a whole operand: local, then psum."""
    (x, idx, upd), (dx, di, du) = vals, layouts
    dn = eqn.params["dimension_numbers"]
    idx_nd = len(eqn.invars[1].aval.shape)
    upd_nd = len(eqn.invars[2].aval.shape)
    scatter_dims = [i for i in range(upd_nd) if i not in dn.update_window_dims]
    idx_dims = [i for i in range(idx_nd) if i != idx_nd - 1]
    if (dx is not None or du is None or du not in scatter_dims or dn.operand_batching_dims):
        return _whole(eqn, vals, layouts, report)
    j = idx_dims[scatter_dims.index(du)]
    idx = relayout(idx, di, j, report, "scatter-add")
    zeros = lax.full_like(x, 0)
    local = _bind(eqn, [zeros, idx, upd])[0]
    return [x + lax.psum(local, report.axes)], [None]


def _sharding(eqn, vals, layouts, report):
    target = eqn.params.get("sharding", eqn.params.get("dst_sharding"))
    return [constrain(vals[0], target)], [layouts[0]]


def _inline(key):
    def rule(eqn, vals, layouts, report):
        closed = eqn.params[key]
        jaxpr, consts = (closed.jaxpr, closed.consts) if hasattr(closed, "consts") else (closed, ())
        return evaluate(jaxpr, consts, vals, layouts, report, lazy=True)
    return rule


def _remat(eqn, vals, layouts, report):
    found = []

    def body(*a):
        outs, out_layouts = evaluate(eqn.params["jaxpr"], (), a, layouts, report)
        found[:] = out_layouts
        return outs

    outs = jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"],
                          policy=eqn.params["policy"])(*vals)
    return list(outs), list(found)


def _custom_jvp(eqn, vals, layouts, report):
    """A ``jax.custom_jvp``: its function and its rule, each partitioned."""
    p = eqn.params
    call, nc = p["call_jaxpr"], p["num_consts"]
    found: list[Layout] = []

    def primal(*xs):
        outs, out_layouts = evaluate(call.jaxpr, call.consts, xs, layouts, report)
        found[:] = out_layouts
        return outs

    f = jax.custom_jvp(primal)

    def rule(primals, tangents):
        outs = primal(*primals)
        with jax.sharding.use_abstract_mesh(report.trace_mesh):
            jaxpr, consts, out_zeros = p["jvp_jaxpr_fun"].call_wrapped(
                *[False] * (len(primals) - nc))
        # A value of the loss the rule closes over is its piece here.
        found_consts = [report.env.get(getattr(c, "val", None)) if isinstance(
            getattr(c, "val", None), jax.extend.core.Var) else None for c in consts]
        consts = [c if f is None else f[0] for c, f in zip(consts, found_consts, strict=True)]
        res, res_layouts = evaluate(jaxpr, consts, [*primals[nc:], *tangents[nc:]],
                                    layouts[nc:] * 2, report,
                                    [None if f is None else f[1] for f in found_consts])
        nonzero = iter(zip(res[len(out_zeros):], res_layouts[len(out_zeros):]))
        out_tangents = []
        for y, layout, zero in zip(outs, found, out_zeros, strict=True):
            if zero:
                out_tangents.append(lax.zeros_like_array(y))
                continue
            t, t_layout = next(nonzero)
            t = relayout(t, t_layout, layout, report, "custom_jvp_call")
            out_tangents.append(_alike([t, y])[0])
        return outs, out_tangents

    f.defjvp(rule)
    outs = f(*vals)
    return list(outs), list(found)


def _custom_vjp(eqn, vals, layouts, report):
    """A ``jax.custom_vjp``, computed whole on values typed the same on every rank.

    Its rule then runs as traced, and sees the global cotangents: JAX's
    typed autodiff sums the ranks' contributions to an invariant value.
    """
    call = eqn.params["call_jaxpr"]
    meshes = [getattr(getattr(a, "sharding", None), "mesh", None) for a in call.in_avals]
    if any(m is not None and not m.empty for m in meshes):
        info = call.jaxpr.debug_info
        raise ValueError(
            "value_and_grad: the loss calls a jax.custom_vjp function "
            f"({getattr(info, 'func_src_info', None) or 'its name unknown'}) on values "
            "typed with layouts over Explicit mesh axes (it sets them: reshard, "
            "out_sharding=). Its backward rule is typed for those layouts, so it cannot "
            "run on the data axis's pieces. Write the loss without setting layouts (it "
            "then runs as plain jit code), or run the step on a mesh of Auto axes.")
    vals = [_invariant(x, d, report, "custom_vjp_call")
            for x, d in zip(vals, layouts, strict=True)]
    outs = _bind(eqn, vals)
    return outs, [None] * len(outs)


def _invariant(x: Any, layout: Layout, report: PartitionReport, why: str) -> Any:
    """Whole ``x`` typed invariant over the data axes (the same on every rank)."""
    if not hasattr(x, "dtype") or not isinstance(jax.typeof(x), jax.core.ShapedArray):
        return x
    if layout is not None:
        report.note(why, int(np.prod(x.shape)) * report.ranks)
        return lax.all_gather(varying(x, report), report.axes, axis=layout, tiled=True,
                              to="invarying")
    if not set(report.axes) & varying_axes(x):
        return x
    report.note(why, int(np.prod(x.shape)))
    if not _is_float(x):
        return _first(x, report.axes)
    return _same(x, report)


def settled(x: Any, report: PartitionReport) -> Any:
    """A whole output, typed invariant: the same on every rank (rank 0's value)."""
    if not set(report.axes) & varying_axes(x):
        return x
    return _first(x, report.axes)


def _first(x: Any, axes: tuple[str, ...]) -> Any:
    """``x`` of the first rank, typed invariant over ``axes``: its bits, NaN and inf kept.

    (XLA:CPU's ``pmax`` drops NaN: of all-NaN values it gives -inf.)
    """
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(_first(jax.random.key_data(x), axes),
                                        impl=jax.random.key_impl(x))
    if x.dtype == bool:
        return lax.pmax(x.astype(np.uint8), axes).astype(bool)
    if not _is_float(x):
        return lax.pmax(x, axes)
    # Summed in 32 bits at least: exact, and XLA:CPU aborts compiling some
    # 16-bit all-reduces over one axis of two.
    wide = x.dtype if jnp.dtype(x.dtype).itemsize >= 4 else jnp.dtype(jnp.float32)
    first = jnp.where(lax.axis_index(axes) == 0, x.astype(wide), jnp.zeros((), wide))
    return lax.psum(first, axes).astype(x.dtype)


def _same(x: Any, report: PartitionReport) -> Any:
    """A value equal on every rank, typed so: its cotangent's 1/N goes to each rank."""

    @jax.custom_vjp
    def same(a):
        return _first(a, report.axes)

    same.defvjp(lambda a: (_first(a, report.axes), None),
                lambda _, ct: (varying(ct / report.ranks, report),))
    return same(x)


def _is_float(x):
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)  # bfloat16 too


def _scan(eqn, vals, layouts, report):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    consts, carry, xs = vals[:nc], vals[nc:nc + ncarry], vals[nc + ncarry:]
    lc, lcarry, lxs = layouts[:nc], layouts[nc:nc + ncarry], layouts[nc + ncarry:]
    # Scanning over the rows themselves: those sequences go whole.
    xs = [relayout(x, d, None, report, "scan") if d == 0 else x
          for x, d in zip(xs, lxs, strict=True)]
    lxs = [None if d in (None, 0) else d - 1 for d in lxs]
    body = p["jaxpr"]

    def run(carry, lcarry):
        found: list[Layout] = []

        def step(c, x):
            outs, out_layouts = evaluate(body.jaxpr, body.consts, [*consts, *c, *x],
                                         [*lc, *lcarry, *lxs], report)
            found[:] = out_layouts
            return _settle_carry(outs[:ncarry], out_layouts[:ncarry], lcarry, report), \
                outs[ncarry:]

        carry = [varying(x, report) for x in carry]
        out = lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"],
                       unroll=p["unroll"])
        return out, found

    (out_carry, ys), found = _carried(run, carry, lcarry, ncarry, report, "scan")
    return [*out_carry, *ys], [*found["carry"], *(None if d is None else d + 1
                                                  for d in found["layouts"][ncarry:])]


def _while(eqn, vals, layouts, report):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = vals[:cn], vals[cn:cn + bn], vals[cn + bn:]
    lcc, lbc, lcarry = layouts[:cn], layouts[cn:cn + bn], list(layouts[cn + bn:])
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]

    def run(carry, lcarry):
        found: list[Layout] = []

        def cond_fn(c):
            outs, _ = evaluate(cond.jaxpr, cond.consts, [*cconsts, *c], [*lcc, *lcarry], report)
            return outs[0]

        def body_fn(c):
            outs, out_layouts = evaluate(body.jaxpr, body.consts, [*bconsts, *c],
                                         [*lbc, *lcarry], report)
            found[:] = out_layouts
            return _settle_carry(outs, out_layouts, lcarry, report)

        carry = [varying(x, report) for x in carry]
        return lax.while_loop(cond_fn, body_fn, carry), found

    out, found = _carried(run, carry, lcarry, len(carry), report, "while")
    return list(out), found["carry"]


def _settle_carry(outs, out_layouts, lcarry, report):
    """A loop body's carry out, in the layouts it came in with, typed varying."""
    return [varying(relayout(y, d, want, report, "loop carry"), report)
            for y, d, want in zip(outs, out_layouts, lcarry, strict=True)]


def _carried(run, carry, lcarry, ncarry, report, name):
    """``run(carry, lcarry)`` of a loop; a whole carry its body splits starts split.

    Returns the loop's outputs and ``{"carry": the carry's layouts,
    "layouts": the body's output layouts}``.
    """
    lcarry = list(lcarry)
    for _ in range(ncarry + 1):
        out, found = run(carry, lcarry)
        better = [want if want is not None or d is None else d
                  for want, d in zip(lcarry, found[:ncarry], strict=True)]
        if better == lcarry:
            break
        carry = [relayout(x, a, b, report, name)
                 for x, a, b in zip(carry, lcarry, better, strict=True)]
        lcarry = better
    return out, {"carry": lcarry, "layouts": found}


def _cond(eqn, vals, layouts, report):
    index, ops = vals[0], vals[1:]
    if layouts[0] is not None:
        index = relayout(index, layouts[0], None, report, "cond")
    # The first branch traced sets the outputs' layouts; the others follow it.
    target: dict[str, list[Layout]] = {}

    def branch(closed):
        def run(*a):
            outs, out_layouts = evaluate(closed.jaxpr, closed.consts, a, layouts[1:], report)
            want = target.setdefault("layouts", out_layouts)
            return [varying(relayout(y, d, w, report, "cond"), report)
                    for y, d, w in zip(outs, out_layouts, want, strict=True)]
        return run

    outs = lax.switch(index, [branch(b) for b in eqn.params["branches"]], *ops)
    return list(outs), target["layouts"]


def _shard_map(eqn, vals, layouts, report):
    """The user's own ``jax.shard_map``: whole over other axes; over the data axes, refused."""
    manual = set(eqn.params.get("newly_manual_axes", ())) & set(report.axes)
    if manual:
        raise ValueError(
            f"value_and_grad: the loss calls a jax.shard_map manual over the data axes "
            f"{sorted(manual)} (a per-rank computation inside the loss). value_and_grad "
            "runs the loss, written for the global batch, over those axes itself. Write "
            "that part as global jit code (a psum over the rows is a sum over the batch), "
            "or take the per-rank route: make_train_step or data_parallel.")
    vals = [_invariant(x, d, report, "shard_map") for x, d in zip(vals, layouts, strict=True)]
    return _bind(eqn, vals), [None] * len(eqn.outvars)


def _debug_callback(eqn, vals, layouts, report):
    """A callback sees the global values, once (on the first rank)."""
    vals = [relayout(x, d, None, report, eqn.primitive.name)
            for x, d in zip(vals, layouts, strict=True)]
    first = rank_index(report) == 0
    lax.cond(first, lambda *a: (_bind(eqn, list(a)), None)[1], lambda *a: None, *vals)
    return [], []


def _cumulative(eqn, vals, layouts, report):
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d != eqn.params["axis"])


def _sort(eqn, vals, layouts, report):
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d != eqn.params["dimension"])


def _top_k(eqn, vals, layouts, report):
    last = len(eqn.invars[0].aval.shape) - 1
    axis = eqn.params.get("axis", last)
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d != axis)


def _concatenate(eqn, vals, layouts, report):
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d != eqn.params["dimension"])


def _split_rule(eqn, vals, layouts, report):  # jnp.split: pieces along one axis
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d != eqn.params["axis"])


def _rev(eqn, vals, layouts, report):
    return _keeps_rows(eqn, vals, layouts, report, lambda d: d not in eqn.params["dimensions"])


def _guarded(rule):
    """A rule for split operands; whole operands bind as they are."""
    def run(eqn, vals, layouts, report):
        if all(layout is None for layout in layouts):
            return _bind(eqn, vals), [None] * len(eqn.outvars)
        return rule(eqn, vals, layouts, report)
    return run


_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
# jax.experimental.sparse's primitives: their transposes drop per-rank types,
# so they always run on values typed the same on every rank.
_SPARSE = ("bcoo_", "bcsr_")
_RULES: dict[str, Callable[..., Any]] = {
    "broadcast_in_dim": _guarded(_broadcast_in_dim),
    "reshape": _guarded(_reshape),
    "transpose": _guarded(_transpose),
    "squeeze": _guarded(_squeeze),
    "reduce_sum": _guarded(_reduce(lax.psum)),
    "reduce_max": _guarded(_reduce(None)),
    "reduce_min": _guarded(_reduce(None)),
    "reduce_prod": _guarded(_reduce(None)),
    "reduce_and": _guarded(_reduce(None)),
    "reduce_or": _guarded(_reduce(None)),
    "reduce_xor": _guarded(_reduce(None)),
    "argmax": _guarded(_argreduce),
    "argmin": _guarded(_argreduce),
    "dot_general": _guarded(_dot_general),
    "slice": _guarded(_slice),
    "dynamic_slice": _guarded(_dynamic_slice),
    "dynamic_update_slice": _guarded(_dynamic_update_slice),
    "pad": _guarded(_pad),
    "gather": _guarded(_gather_rule),
    "scatter-add": _guarded(_scatter_add),
    "scatter_add": _guarded(_scatter_add),
    "cumsum": _guarded(_cumulative),
    "cumprod": _guarded(_cumulative),
    "cummax": _guarded(_cumulative),
    "cummin": _guarded(_cumulative),
    "cumlogsumexp": _guarded(_cumulative),
    "sort": _guarded(_sort),
    "top_k": _guarded(_top_k),
    "concatenate": _guarded(_concatenate),
    "rev": _guarded(_rev),
    "split": _guarded(_split_rule),
    "sharding_constraint": _sharding,
    "reshard": _sharding,
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "remat2": _remat,
    "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "debug_callback": _debug_callback,
    "shard_map": _shard_map,
    "debug_print": _debug_callback,
}
