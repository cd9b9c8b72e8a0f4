"""``value_and_grad``: SkipReduce where ``jax.value_and_grad`` stood.

Called inside the user's own ``jax.jit`` step, it traces the loss once on
the global arguments, as ``jax.jit`` sees them, and runs that program in a
``jax.shard_map`` manual over the data axes only, partitioned by
:mod:`skipreduce_jax._steps.partition`: every value keeps its global meaning
(sums, means, maxima, batch statistics, dropout masks, ``aux``), each rank
computing its rows. The params enter cast to varying, so each rank's
gradient is its own contribution to the global one, and
:func:`skip_reduce`'s ring, built with the caller's options, sums them. It
keeps no state: the step's key and warm-up come from ``seed`` and the
``step`` the caller passes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import io_callback
from jax.extend.core import jaxprs_in_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.gate import FeedbackGateState
from skipreduce_jax._optax.transform import (
    NothingSkippedWarning,
    SkipConfig,
    SkipReduceState,
    _Config,
    gated_update,
    skip_reduce,
)
from skipreduce_jax._optax.transform import _update as skip_update
from skipreduce_jax._ring import shards as _shards
from skipreduce_jax._ring.config import SkipOptions, skip_config
from skipreduce_jax._steps.micro import accumulate
from skipreduce_jax._steps.parallel import AxisNames, check_batch, mesh_axes, positions
from skipreduce_jax._steps.partition import Lazy, PartitionReport, evaluate, settled, take, varying
from skipreduce_jax._steps.replay import tracing_markers
from skipreduce_jax._steps.training import init_opt_state, state_specs
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import varying_axes

_API = "value_and_grad"


def value_and_grad(
    fun: Callable[..., jax.Array | tuple[jax.Array, PyTree]],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    axis_name: AxisNames | None = None,
    *,
    step: int | jax.Array | optax.MultiStepsState,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    param_specs: PyTree | None = None,
    microbatches: int = 1,
    check: bool = False,
    config: SkipConfig | None = None,
    state: PyTree | None = None,
    **skip_options: Unpack[SkipOptions],
) -> Callable[..., tuple[jax.Array | tuple[jax.Array, PyTree], PyTree]]:
    """``jax.value_and_grad`` whose gradient all-reduce is SkipReduce.

    Use it inside your own ``jax.jit`` step in place of
    ``jax.value_and_grad``; the optimizer, its state and the loop stay as
    they are. It takes and returns global arrays, and the loss means what it
    means under ``jax.jit``: at ``num_skip=0`` the value, every ``aux`` leaf
    and every gradient are ``jax.value_and_grad``'s (sums, masked means,
    batch statistics, maxima, dropout masks, ``jax.custom_vjp`` rules), with
    no helper to call in the loss. Each rank computes its rows of the batch;
    what crosses rows in ways that cannot be split (a sort or top-k over the
    rows, ``x @ x.T``) is gathered and computed whole, and
    ``grad_fn.report`` counts those bytes.

    - The batch: the arguments not in ``argnums`` whose layout splits them
      over ``axis_name`` (Explicit axes: their types; placed arrays: their
      shardings), else (Auto axes inside ``jax.jit``) those whose rows divide
      over the ranks; ``batch_argnums`` names them instead. Whatever is not
      split (class weights, a key, closed-over arrays) is whole on every rank,
      which is exact too.
    - The grads are identical on every rank, in the params' layouts.
    - Under Explicit axes run the step under ``jax.set_mesh(mesh)``; a loss
      written for them (``reshard``, ``out_sharding=``) runs as written.
    - The key and warm-up come from ``seed`` and ``step``, as
      :func:`skip_reduce` derives them from its count. Error feedback
      (``error_feedback=True`` or ``"auto"``) keeps a residual per rank:
      your loop carries it as ``state`` (below).

    Args:
      fun: the loss, as for ``jax.value_and_grad``, written for the global
        batch.
      mesh: the device mesh; None: the mesh of ``jax.set_mesh``.
      axis_name: the data axis; ``(outer, inner)`` for hierarchical
        SkipReduce (the batch is split over both; only ``outer`` skips).
        None: the mesh's only axis, or the one axis the batch arguments'
        types split their rows over (Explicit axes), read at the call.
      step: the training step (an int, or a traced int scalar such as
        ``state.step``). Required. Under ``optax.MultiSteps`` pass its state
        (e.g. ``step=state.opt_state``): each micro-step of an update then
        draws its own drops, and warm-up counts updates.
      has_aux: as for ``jax.value_and_grad``.
      argnums: the params' positions, as for ``jax.value_and_grad``.
      batch_argnums: the positions split over ``axis_name`` (their leading
        dimension, or the one their layout splits); None: found from the
        layouts, as above.
      param_specs: how the params are laid out over the other mesh axes (a
        pytree prefix of ``PartitionSpec`` or ``NamedSharding``, e.g. the
        params' part of the ``in_shardings`` given to ``jax.jit``), so that
        the skipped ring runs on each device's shards and nothing crosses
        those axes. Under Explicit mesh axes it is read from the params'
        types. Under Auto axes, without it, the compiler gathers sharded
        leaves before the ring (the same values, more bytes; a warning says so).
      microbatches: gradient accumulation inside the step, one ring per
        step (:doc:`gradient accumulation </guides/gradient-accumulation>`):
        each rank's row ``i`` goes to micro-batch ``i % microbatches``; the
        value and grads are the mean over micro-batches, each ``aux`` leaf
        comes back stacked, one entry per micro-batch.
      check: at ``step == 0``, compare the value, every ``aux`` leaf and
        every gradient at ``num_skip=0`` with ``jax.value_and_grad`` of the
        global loss on the same batch; if one differs, print its name and
        return the value as NaN. Off by default: compiled into the step (a
        ``lax.cond`` on the step), it made every step 2.4x slower on CPU and
        doubled its temporary memory (:doc:`costs </costs>`). Turn it on for
        a first run, or for one step compiled apart.
      config: the skip settings as a :class:`SkipConfig` (or as keywords).
      state: error feedback's state, which the loop carries from step to
        step (and checkpoints): made once, outside ``jax.jit``, by
        ``value_and_grad(fun, mesh, step=0, <the same options>).init_state(params)``,
        then passed back each step; ``f`` then returns it updated, third.
        Needed with ``error_feedback``, refused without it.
      **skip_options: :func:`skip_reduce`'s options: ``num_skip`` or
        ``skip_ratio``, ``seed``, ``min_size``, ``warmup_steps``, ...

    Returns:
      ``f(*args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), as ``jax.value_and_grad`` returns; ``(value, grads,
      state)`` with ``state``. ``f.report`` is the last trace's
      :class:`skipreduce_jax.PartitionReport`; ``f.init_state(params)``
      makes error feedback's first ``state``.

    Raises:
      ValueError: if ``step`` is missing or not an int scalar, an option
        needs state, ``axis_name`` is not an axis of ``mesh``, a
        ``batch_argnums`` leaf does not split evenly over the ranks, or the
        loss itself reduces over the data axis.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import skipreduce_jax as sr
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def loss_fn(w, x):
      ...     return jnp.mean((x @ w - 1.0) ** 2)
      >>> tx = optax.sgd(0.1)
      >>> @jax.jit
      ... def train_step(w, opt_state, x, step):
      ...     grad_fn = sr.value_and_grad(loss_fn, mesh, "data", step=step,
      ...                                 skip_ratio=0.5, min_size=0)
      ...     loss, grads = grad_fn(w, x)
      ...     updates, opt_state = tx.update(grads, opt_state)
      ...     return optax.apply_updates(w, updates), opt_state, loss
      >>> w, x = jnp.zeros(4), jnp.ones((16, 4))
      >>> with jax.set_mesh(mesh):  # mesh: 8 devices, one axis "data"
      ...     w, opt_state, loss = train_step(w, tx.init(w), x, 0)
      >>> float(loss)
      1.0
    """
    return build(fun, mesh, axis_name, step=step, has_aux=has_aux, argnums=argnums,
                 batch_argnums=batch_argnums, param_specs=param_specs,
                 microbatches=microbatches, check=check, config=config,
                 skip_options=skip_options, state=state)


def build(fun: Callable[..., Any], mesh: Any, axis_name: AxisNames | None, *,
          step: Any, has_aux: bool, argnums: int | Sequence[int],
          batch_argnums: int | Sequence[int] | None, param_specs: Any,
          microbatches: int, skip_options: dict[str, Any],
          config: SkipConfig | None = None, check: bool = False,
          describe: Callable[[int], str] = "argument {}".format,
          state: Any = None) -> Callable[..., Any]:
    """:func:`value_and_grad`'s function; ``describe(i)`` names argument ``i``."""
    mesh = _resolve_mesh(mesh)
    # This function again with some settings changed: one per call shape
    # (argument count, keyword names, data axis), built at its first call.
    settings_given = dict(
        fun=fun, mesh=mesh, axis_name=axis_name, step=step, has_aux=has_aux,
        argnums=argnums, batch_argnums=batch_argnums, param_specs=param_specs,
        microbatches=microbatches, skip_options=skip_options, config=config, check=check,
        describe=describe, state=state)

    def again(**changes):
        return build(**{**settings_given, **changes})
    ints = argnums if isinstance(argnums, Sequence) else (argnums,)
    if any(isinstance(i, (int, np.integer)) and i < 0 for i in ints):
        # As jax counts them: from the end, once a call says how many there are.
        by_arity: dict[int, Callable[..., Any]] = {}

        def from_end(*args, **kwargs):
            n = len(args)
            if n not in by_arity:
                bad = [i for i in ints if not -n <= i < n]
                if bad:
                    raise ValueError(f"{_API}: argnums={argnums!r} is out of range for a "
                                     f"call with {n} positional arguments.")
                fixed = [i % n for i in ints]
                by_arity[n] = again(argnums=fixed if isinstance(argnums, Sequence) else fixed[0])
            inner = by_arity[n]
            out = inner(*args, **kwargs)
            from_end.report = inner.report
            return out

        from_end.report = None
        from_end.init_state = again(argnums=0).init_state
        return from_end
    if axis_name is None and len(mesh.axis_names) > 1:
        # The data axis is the one the batch's rows are split over, as the
        # batch's types say under Explicit axes: read at the first call.
        built: dict[str, Callable[..., Any]] = {}

        def make(axis):
            if axis not in built:
                built[axis] = again(axis_name=axis)
            return built[axis]

        params_at = positions(argnums, "argnums", api=_API)
        given = None if batch_argnums is None else positions(
            batch_argnums, "batch_argnums", api=_API)
        return lambda *args, **kwargs: make(_axis_of_batch(
            [a for i, a in enumerate(args) if i not in params_at and (
                given is None or i in given)], mesh))(*args, **kwargs)
    axes = mesh_axes(mesh, mesh.axis_names[0] if axis_name is None else axis_name, api=_API)
    if len(axes) > 2:
        raise ValueError(f"{_API}: axis_name={axis_name!r} must name one mesh "
                         "axis, or two (outer, inner) for hierarchical SkipReduce.")
    clock, salted = _check_step(step)
    microbatches = checks.check_int(microbatches, "microbatches", api=_API, minimum=1)
    check = checks.check_bool(check, "check", api=_API) and microbatches == 1
    config = _check_options(config, skip_options, state)
    tx = skip_reduce(axes[0], inner_axis=axes[1] if len(axes) == 2 else None,
                     config=config)
    settings = _Config.of(config, axes[0], axes[1] if len(axes) == 2 else None)
    params_at = positions(argnums, "argnums", api=_API)
    given_batch = (None if batch_argnums is None
                   else positions(batch_argnums, "batch_argnums", api=_API))
    both = sorted(set(params_at) & set(given_batch or ()))
    if both:
        raise ValueError(
            f"{_API}: argnums={argnums!r} and batch_argnums={batch_argnums!r} "
            f"share {both}: params are replicated over {axis_name!r}, the "
            "batch is split over it. Take the params out of batch_argnums.")
    single = isinstance(argnums, (int, np.integer))
    ranks = math.prod(mesh.shape[a] for a in axes)
    jitted: dict[Any, Callable[..., Any]] = {}
    by_keywords: dict[Any, Callable[..., Any]] = {}

    def wrapped(*args, **kwargs):
        if kwargs:  # never differentiated; split or whole by their layouts, as others
            names, n = tuple(sorted(kwargs)), len(args)
            if (names, n) not in by_keywords:
                by_keywords[names, n] = again(
                    fun=lambda *a: fun(*a[:n], **dict(zip(names, a[n:], strict=True))))
            inner = by_keywords[names, n]
            out = inner(*args, *(kwargs[k] for k in names))
            wrapped.report = inner.report
            return out
        leaves, tree = jax.tree_util.tree_flatten(args)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return traced(*args)
        # Called outside jit: one compiled program per structure and per
        # value of the arguments that are not arrays or numbers (a flag, a
        # string: static, as Python sees them); the placed arrays' layouts
        # are read before jit hides them.
        dynamic = [_is_array(x) or (isinstance(x, (int, float, complex))
                                    and not isinstance(x, bool)) for x in leaves]
        static = tuple((i, x) for i, (x, d) in enumerate(zip(leaves, dynamic)) if not d)
        key = (tree, static)
        try:
            hash(key)
        except TypeError:  # an unhashable static: traced on every call
            return traced(*args)
        if key not in jitted:
            placed = [_placed_spec(leaf) for leaf in leaves]

            def run(*arrays):
                full, it = list(leaves), iter(arrays)
                for i, d in enumerate(dynamic):
                    full[i] = next(it) if d else leaves[i]
                return traced(*tree.unflatten(full), placed=placed)

            jitted[key] = jax.jit(run)
        return jitted[key](*[x for x, d in zip(leaves, dynamic) if d])

    def traced(*args, placed=None):
        if config.error_feedback and state is None:
            raise ValueError(
                f"{_API}: error_feedback={config.error_feedback!r} keeps a residual per "
                "rank, which your loop carries: pass state=, made once outside jax.jit by "
                "value_and_grad(fun, mesh, step=0, <the same options>).init_state(params); "
                "the function then returns (value, grads, state).")
        for i in params_at + (given_batch or ()):
            if i >= len(args):
                raise ValueError(
                    f"{_API}: argnum {i} (in argnums or batch_argnums) is out "
                    f"of range for a call with {len(args)} arguments.")
        # Params as arrays: a Python number among them is differentiated, not a constant.
        args = tuple(jax.tree_util.tree_map(jnp.asarray, a) if i in params_at else a
                     for i, a in enumerate(args))
        for i in given_batch or ():
            check_batch(args[i], ranks, axes, api=_API, name=describe(i),
                        or_else="leave it out of batch_argnums (whole on every rank)",
                        traced=True)
        if ranks == 1:
            # One rank: the gradient is already the global one.
            out = _accumulated(jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux),
                               args, params_at, given_batch, microbatches, has_aux)
            return out if state is None else (*out, state)
        params = args[params_at[0]] if single else tuple(args[i] for i in params_at)
        if placed is not None:  # the params' leaves among the placed arrays
            starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
            placed_params = [s for i in params_at for s in placed[starts[i]:starts[i + 1]]]
        specs = _param_specs(params, param_specs, mesh, axes,
                             None if placed is None else placed_params)
        program = _Program.trace(fun, args, params_at, given_batch, placed, axes, ranks,
                                 microbatches, check)
        _check_output(program, has_aux)
        wrapped.report = program.report
        treedef = jax.tree_util.tree_structure(params)
        outs, grads, new_state = _run(program, mesh, axes, ranks, clock, salted, specs,
                                      settings, tx, treedef, microbatches, state)
        if check and program.reference is not None:
            exact = settings
            if (settings.resolve_num_skip(mesh.shape[axes[0]]) or settings.comm_dtype is not None
                    or state is not None):
                exact = dataclasses.replace(settings, num_skip=0, skip_ratio=None,
                                            comm_dtype=None, error_feedback=False)
            twin = None if exact is settings else lambda: _run(
                program, mesh, axes, ranks, clock, salted, specs, exact, tx, treedef, 1)[:2]
            _check_first_step(program, outs, grads, clock[0], mesh, treedef, twin)
        value = program.out_tree.unflatten(outs)
        if has_aux:  # a list [value, aux] comes back a tuple, as from jax.value_and_grad
            value = tuple(value)
        out = value, jax.tree_util.tree_unflatten(treedef, grads)
        return out if state is None else (*out, new_state)

    def init_state(params):
        """Error feedback's first ``state`` for ``params`` (outside ``jax.jit``)."""
        if not config.error_feedback:
            raise ValueError(f"{_API}: init_state is error feedback's state; pass "
                             "error_feedback=True or \"auto\" (and the step's other options).")
        devices = mesh if isinstance(mesh, jax.sharding.Mesh) else jax.sharding.get_mesh()
        if not isinstance(devices, jax.sharding.Mesh) or devices.empty:
            raise ValueError(f"{_API}: init_state places the state on devices: pass the "
                             "mesh (jax.make_mesh), or call it under jax.set_mesh(mesh).")
        return init_opt_state(tx, params, devices, axes if len(axes) > 1 else axes[0])

    wrapped.report = None
    wrapped.init_state = init_state
    return wrapped


def _check_output(program: _Program, has_aux: bool) -> None:
    """Refuses what ``jax.value_and_grad`` refuses, naming it.

    That is, an aux output that is not a pair, a value that is not one real scalar.
    """
    shown = program.out_tree.unflatten(program.closed.out_avals)
    if has_aux:
        if not isinstance(shown, (tuple, list)) or len(shown) != 2:
            raise TypeError(
                f"{_API}: with has_aux=True, fun must return a pair (value, aux), as "
                f"for jax.value_and_grad; it returned {shown}. Return (loss, aux), or "
                "pass has_aux=False.")
        shown = shown[0]
    if not isinstance(shown, jax.core.ShapedArray) or shown.shape != ():
        raise TypeError(
            f"{_API}: fun's value must be a scalar, as for jax.value_and_grad; it "
            f"returned {shown}. Reduce it to one number (e.g. jnp.mean), or return "
            "the rest as aux with has_aux=True.")
    if not jnp.issubdtype(shown.dtype, jnp.floating):
        raise TypeError(
            f"{_API}: fun's value must be real floating point, as for "
            f"jax.value_and_grad; it is {shown.dtype}. Cast it, e.g. "
            "loss.astype(jnp.float32).")


class _Program:
    """The loss traced on the global arguments, and how its inputs are laid out."""

    def __init__(self, flat, closed, out_tree, leaves, at, is_param, layouts, const_layouts,
                 report):
        self.flat = flat              # the loss, of the array leaves
        self.closed = closed          # the jaxpr, on global (micro-batch) shapes
        self.out_tree = out_tree
        self.leaves = leaves          # every leaf of the arguments
        self.at = at                  # the positions of the array leaves
        self.is_param = is_param      # per array leaf
        self.layouts = layouts        # per array leaf: its split dimension or None
        self.const_layouts = const_layouts
        self.report = report
        self.reference = None         # jax.value_and_grad's jaxpr, for the check

    @classmethod
    def trace(cls, fun, args, params_at, given_batch, placed, axes, ranks, microbatches,
              check):
        leaves, in_tree = jax.tree_util.tree_flatten(tuple(args))
        owner = [i for i, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
        at = [k for k, leaf in enumerate(leaves) if _is_array(leaf)]
        is_param = [owner[k] in params_at for k in at]
        layouts, unknown = [], []
        for k, param in zip(at, is_param, strict=True):
            leaf, i = leaves[k], owner[k]
            spec = _shown_spec(leaf, axes) or (placed[k] if placed else None)
            if param or (given_batch is not None and i not in given_batch) or not np.ndim(leaf):
                layouts.append(None)
            elif spec is not None and _split_dim(spec, axes) is not None:
                layouts.append(_split_dim(spec, axes))
            elif given_batch is not None:
                layouts.append(0)
            else:
                layouts.append(None)
                if spec is None and np.shape(leaf)[0] % ranks == 0:
                    unknown.append(len(layouts) - 1)
        # Arguments whose layout nothing shows are the batch where they have
        # its rows: those of the arguments split over the data axes, else the
        # most rows among them (a raw key's 2 words are not a batch of 2).
        # Any choice is exact; a whole argument only costs its work N times.
        shown = {np.shape(leaves[k])[d] for k, d in zip(at, layouts, strict=True)
                 if d is not None}
        rows = shown or {max((np.shape(leaves[at[j]])[0] for j in unknown), default=0)}
        for j in unknown:
            if np.shape(leaves[at[j]])[0] in rows:
                layouts[j] = 0
        parts = ranks * microbatches
        for k, d in zip(at, layouts, strict=True):
            if d is not None and np.shape(leaves[k])[d] % parts:
                raise ValueError(
                    f"{_API}: a batch leaf of shape {np.shape(leaves[k])} splits its "
                    f"dimension {d} over {ranks} ranks and microbatches={microbatches}: "
                    f"pass a batch whose rows are a multiple of {parts}.")

        def shape_of(leaf, d, typed):
            shape = list(np.shape(leaf))
            if d is not None:
                shape[d] //= microbatches
            sharding = getattr(jax.typeof(leaf), "sharding", None) if typed and isinstance(
                leaf, (jax.Array, jax.core.Tracer)) else None
            if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
                sharding = None
            return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype, sharding=sharding,
                                        weak_type=getattr(leaf, "weak_type", False))

        def flat(*arrays):
            full = list(leaves)
            for k, a in zip(at, arrays, strict=True):
                full[k] = a
            return fun(*in_tree.unflatten(full))

        def traced(typed):
            shapes = [shape_of(leaves[k], d, typed) for k, d in zip(at, layouts, strict=True)]
            try:
                with tracing_markers():
                    return jax.make_jaxpr(flat, return_shape=True)(*shapes)
            except NameError:
                _refuse_own_collectives(flat, shapes, axes, ranks)
                raise

        # As a plain jax.jit step sees it with no mesh set; code that sets
        # layouts (reshard, out_sharding=) as the caller's step types it.
        trace_mesh = jax.sharding.AbstractMesh((), ())
        try:
            with jax.sharding.use_abstract_mesh(trace_mesh):
                closed, out = traced(typed=False)
        except Exception:
            closed, out = traced(typed=True)
            trace_mesh = jax.sharding.get_abstract_mesh()
        # A traced array the loss closes over (the step's batch, from a
        # closure) is split as an argument would be: where its layout says,
        # or where it has the split arguments' rows (any rows dividing over
        # the ranks, if none is split).
        rows = {np.shape(leaves[k])[d] for k, d in zip(at, layouts, strict=True) if d is not None}
        const_layouts = []
        for c in closed.consts:
            spec = _shown_spec(c, axes) or _placed_spec(c)
            if spec is not None:
                const_layouts.append(_split_dim(spec, axes))
            elif isinstance(c, jax.core.Tracer) and np.ndim(c) and (
                    np.shape(c)[0] in rows if rows else np.shape(c)[0] % parts == 0):
                const_layouts.append(0)
            else:
                const_layouts.append(None)
        if microbatches > 1 and any(d is not None for d in const_layouts):
            raise ValueError(
                f"{_API}: microbatches={microbatches} with a batch the loss closes over "
                "(split over the data axes): its micro-batches are cut from the "
                "arguments only. Pass the batch as an argument of fun.")
        report = PartitionReport(axes, ranks)
        if not any(d is not None for d in layouts + const_layouts):
            warnings.warn(
                f"{_API}: nothing is split over {axes}: no argument or array the loss "
                "closes over has rows that divide over the ranks (or is laid out "
                "split over them), so every rank computes the whole batch and holds "
                "the same gradient; the result is exact, but skipping changes "
                f"nothing and the work is done {ranks} times. Pass the batch as an "
                "argument (or batch_argnums=).", NothingSkippedWarning, stacklevel=4)
        report.trace_mesh = trace_mesh
        program = cls(flat, closed, jax.tree_util.tree_structure(out), leaves, at, is_param,
                   layouts, const_layouts, report)
        if check:
            try:
                program.reference = _reference(flat, closed, is_param, leaves, at, trace_mesh)
            except Exception as e:  # jax.value_and_grad itself refuses the loss here
                first = (str(e).splitlines() or [""])[0][:200]
                warnings.warn(
                    f"{_API}: the first-step check is off for this loss: "
                    f"jax.value_and_grad of it does not trace as the step's jit code "
                    f"({type(e).__name__}: {first}). Pass check=False to silence this.",
                    CheckSkippedWarning, stacklevel=4)
        return program


def _reference(flat, closed, is_param, leaves, at, trace_mesh):
    """``jax.value_and_grad`` of the loss, traced as a jaxpr, and its inputs.

    Traced here, before any per-rank program, as the loss was: JAX traces a
    custom rule once and caches it. It differentiates the loss itself, or,
    where that fails (closed-over arrays typed with the caller's Explicit
    layouts that jax.value_and_grad cannot transpose), the traced program,
    what it closes over passed in as plain jit values.
    """
    vals = [leaves[k] for k in at]
    params = [x for x, p in zip(vals, is_param, strict=True) if p]
    others = [x for x, p in zip(vals, is_param, strict=True) if not p]
    consts = list(closed.consts)

    def differentiated(outputs):
        def value_and_grad(params, others, consts):
            def loss(params):
                full, ps, os = [], iter(params), iter(others)
                for p in is_param:
                    full.append(next(ps) if p else next(os))
                out = outputs(full, consts)
                return out[0], out
            (_, outs), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return [*outs, *grads]
        return value_and_grad

    def shape(x):
        sharding = getattr(jax.typeof(x), "sharding", None) if not trace_mesh.empty else None
        if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
            sharding = None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding,
                                    weak_type=getattr(x, "weak_type", False))

    shapes = jax.tree_util.tree_map(shape, (params, others, consts))
    with jax.sharding.use_abstract_mesh(trace_mesh), tracing_markers():
        # A loss that closes over the step's own values (a batch, typed with
        # the caller's layouts) takes them as inputs, typed as the rest.
        if not any(isinstance(c, jax.core.Tracer) for c in consts):
            try:
                program = differentiated(
                    lambda full, _: jax.tree_util.tree_leaves(flat(*full)))
                return jax.make_jaxpr(program)(*shapes[:2], []), [*params, *others]
            except Exception:  # traced below from the program instead
                pass
        program = differentiated(
            lambda full, consts: jax.core.eval_jaxpr(closed.jaxpr, consts, *full))
        return jax.make_jaxpr(program)(*shapes), [*params, *others, *consts]


def _refuse_own_collectives(flat, shapes, axes, ranks):
    """Refuses a loss that reduces over the data axes itself (it traces with them bound)."""
    try:
        with tracing_markers():
            jax.make_jaxpr(flat, axis_env=[(a, ranks) for a in axes])(*shapes)
    except NameError:
        return  # another name is unbound: the user's own error
    raise ValueError(
        f"{_API}: the loss reduces over the data axes {list(axes)} itself (a "
        "collective naming them: lax.pmean or psum, flax BatchNorm(axis_name=...)). "
        "Written for the global batch, as for jax.value_and_grad, it needs none: a "
        "mean or a batch statistic is already over the whole batch. Drop the "
        "axis_name (or the collective).") from None


def _run(program, mesh, axes, ranks, step, salted, specs, settings, tx, treedef,
         microbatches, state=None):
    """The partitioned loss per rank (its own gradients), then the ring.

    ``step``: int32[2], the count and the micro-step (folded into the key
    where ``salted``). ``specs``: per param leaf, its spec over the
    compiler's axes and the dimension it is split along over the data axes
    (FSDP), or None.
    """
    closed, report = program.closed, program.report
    specs, dims = [s for s, _ in specs], [d for _, d in specs]
    consts = list(closed.consts)
    passed = [i for i, c in enumerate(consts) if isinstance(c, (jax.Array, jax.core.Tracer))]
    leaves = [program.leaves[k] for k in program.at]
    params = [x for x, p in zip(leaves, program.is_param, strict=True) if p]
    others = [x for x, p in zip(leaves, program.is_param, strict=True) if not p]
    layouts = program.layouts
    other_layouts = [d for d, p in zip(layouts, program.is_param, strict=True) if not p]
    const_layouts = [program.const_layouts[i] for i in passed]
    found: dict[str, list[Any]] = {}

    def spec(d):
        return P() if d is None else P(*([None] * d), axes)

    state_leaves, state_def = jax.tree_util.tree_flatten(state)
    state_specs_ = jax.tree_util.tree_leaves(
        state_specs(state, axes) if state is not None else [],
        is_leaf=lambda x: isinstance(x, P))

    def unpack(flat):
        n, m, c = len(params), len(others), len(passed)
        local_params, local_others = flat[:n], flat[n:n + m]
        local_consts = flat[n + m:n + m + c]
        full_consts = list(consts)
        for i, c in zip(passed, local_consts, strict=True):
            full_consts[i] = c
        return local_params, local_others, full_consts

    def forward(param_vals, other_vals, full_consts):
        vals, ps, os = [], iter(param_vals), iter(other_vals)
        for p in program.is_param:
            vals.append(next(ps) if p else next(os))
        report.gathered.clear()
        outs, out_layouts = evaluate(closed.jaxpr, full_consts, vals, layouts, report,
                                     program.const_layouts)
        # An output the jaxpr holds as a literal (a count from the shapes): an array.
        outs = [jnp.asarray(x, v.aval.dtype) for x, v in zip(outs, closed.jaxpr.outvars,
                                                              strict=True)]
        found["layouts"] = out_layouts
        return outs

    reduce = _Reduction(settings, tx, treedef, params, specs, dims, report,
                        mesh.shape[axes[0]], salted)

    def probe(step, *flat):
        local_params, local_others, full_consts = unpack(flat)
        forward(reduce.whole(local_params, step),
                _micro_slice(local_others, other_layouts, microbatches, 0), full_consts)
        return ()

    def body(step, *flat):
        local_params, local_others, full_consts = unpack(flat)
        varying_params = [x if d is not None else varying(x, report)
                          for x, d in zip(local_params, dims, strict=True)]

        def objective(pv, micro_others):
            # A loss typed invariant is differentiated as it is: each rank's
            # gradient is its share. One that varies (it holds values every
            # rank computed whole) counts 1/N on each. An FSDP block is
            # gathered where it is used; its gradient comes back reduced.
            outs = forward(reduce.whole(pv, step), micro_others, full_consts)
            loss = outs[0]
            return (loss / ranks if set(axes) & varying_axes(loss) else loss), outs

        grad = jax.value_and_grad(objective, has_aux=True)
        if microbatches == 1:
            (_, outs), g = grad(varying_params, local_others)
        else:
            def one(total, j):
                (_, outs), g = grad(varying_params, _micro_slice(
                    local_others, other_layouts, microbatches, j))
                return jax.tree_util.tree_map(jnp.add, total, g), outs

            (_, first), g = grad(varying_params, _micro_slice(
                local_others, other_layouts, microbatches, 0))
            g, rest = lax.scan(one, g, jnp.arange(1, microbatches))
            outs = [jnp.concatenate([x[None], r]) for x, r in zip(first, rest, strict=True)]
            g = [x / microbatches for x in g]
            outs[0] = jnp.mean(outs[0], axis=0)
        outs = [settled(x, report) if d is None or (microbatches > 1 and i == 0) else x
                for i, (x, d) in enumerate(zip(outs, found["layouts"], strict=True))]
        local_state = None if state is None else jax.tree_util.tree_unflatten(
            state_def, flat[len(flat) - len(state_leaves):])
        g, new_state = reduce.replicated(g, local_params, step, local_state)
        return outs, g, jax.tree_util.tree_leaves(new_state)

    flat = [*params, *others, *[consts[i] for i in passed], *state_leaves]
    in_specs = (P(), *map(spec, dims), *map(spec, other_layouts), *map(spec, const_layouts),
                *state_specs_)
    jax.eval_shape(_mapped(probe, mesh, axes, in_specs, (), ()), step, *flat)
    out_layouts = found["layouts"]
    if microbatches > 1:  # aux stacked per micro-batch (the value is their mean)
        out_layouts = [None] + [None if d is None else d + 1 for d in out_layouts[1:]]
    out_specs = ([spec(d) for d in out_layouts], list(map(spec, dims)), state_specs_)
    full = ([spec(d) for d in out_layouts],
            [_with_data(s, d, axes, g.ndim) for s, d, g in zip(specs, dims, params, strict=True)],
            state_specs_)
    outs, grads, new_state = _mapped(body, mesh, axes, in_specs, out_specs, full)(step, *flat)
    report.env.clear()  # the pieces of this trace: not kept past it
    compiler = [a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if a not in axes and t == jax.sharding.AxisType.Auto and mesh.shape[a] > 1]
    if compiler and isinstance(mesh, jax.sharding.Mesh):
        grads = [g if s is None and d is None else lax.with_sharding_constraint(
                     g, NamedSharding(mesh, _with_data(s, d, axes, g.ndim)))
                 for g, s, d in zip(grads, specs, dims, strict=True)]
    return outs, grads, (None if state is None
                         else jax.tree_util.tree_unflatten(state_def, new_state))


def _with_data(spec: P | None, dim: int | None, axes: tuple[str, ...], ndim: int) -> P:
    """A param's whole spec: ``spec`` over the compiler's axes, ``dim`` over the data axes."""
    entries = list(spec or ()) + [None] * (ndim - len(spec or ()))
    if dim is not None:
        entries[dim] = axes if len(axes) > 1 else axes[0]
    return P(*entries)


class _Reduction:
    """The gradients' reduction: the skipped ring, and FSDP's skipped reduce-scatter.

    Replicated params: each rank's share of the gradient goes through
    :func:`skip_reduce`'s ring at the end of the step. Params sharded over the
    data axes (FSDP): each block is gathered where the loss uses it, and the
    gradient of that gather is the skipped reduce-scatter, so every layer's
    gradient is reduced as the backward pass reaches it, as XLA's FSDP does.
    """

    def __init__(self, settings, tx, treedef, params, specs, dims, report, n, salted):
        self.tx, self.treedef, self.specs, self.dims = tx, treedef, specs, dims
        self.report, self.settings, self.salted = report, settings, salted
        sharded = any(d is not None for d in dims)
        if sharded and settings.error_feedback:
            raise ValueError(
                f"{_API}: error_feedback with params sharded over the data axes (FSDP) is "
                "not supported: each block's gradient is reduced as the backward pass "
                "reaches it, with no residual to carry. Replicate those params over the "
                "data axes, or drop error_feedback.")
        if sharded and settings.exact_radial:
            raise ValueError(
                f"{_API}: exact_radial=True needs the whole gradient of each leaf, and "
                "params sharded over the data axes (FSDP) have only their blocks. Pass "
                "exact_radial=False, or replicate those params over the data axes.")
        if sharded:
            # Which leaves may skip, decided once on the whole tree (selective,
            # min_size); each part then reduces its leaves with those flags.
            plain = dataclasses.replace(settings, exact_radial=False)
            tree = jax.tree_util.tree_unflatten(treedef, params)
            self.flags = plain.skippable(tree, tree)
            self.num_skip = settings.resolve_num_skip(n)
            if self.num_skip and not any(self.flags):
                warnings.warn(
                    f"{_API}: no leaf may be skipped (each is excluded by selective or "
                    f"smaller than min_size={settings.min_size}), so every step is a "
                    "full reduction. For a small model pass e.g. min_size=0.",
                    NothingSkippedWarning, stacklevel=4)

    def whole(self, pv: list[Any], step: Any) -> list[Any]:
        """The params as the loss sees them: an FSDP block gathered at its first use.

        Later uses take the same gathered copy (one all-gather and one
        reduce-scatter per leaf and step, as XLA's FSDP).
        """
        made: dict[int, Any] = {}

        def gathered(x, d, i):
            if i not in made:
                made[i] = self._gathered(x, d, i, step)
            return made[i]

        def block(x, d, i, dim):
            return take(gathered(x, d, i), dim, self.report)

        return [x if d is None else Lazy(
                    tuple(x.shape[:d]) + (x.shape[d] * self.report.ranks,) + tuple(x.shape[d + 1:]),
                    functools.partial(block, x, d, i), functools.partial(gathered, x, d, i))
                for i, (x, d) in enumerate(zip(pv, self.dims, strict=True))]

    def _gathered(self, shard, dim, index, step):
        axes = self.report.axes

        @jax.custom_vjp
        def gather(shard, step):
            return lax.all_gather(shard, axes, axis=dim, tiled=True)

        def fwd(shard, step):
            return gather(shard, step), (shard, step)

        def bwd(res, ct):
            shard, step = res
            return self._scattered(ct, shard, step, dim, index), None

        gather.defvjp(fwd, bwd)
        return gather(shard, step)

    def _scattered(self, ct, shard, step, dim, index):
        """This rank's block of the summed gradient, its reduce-scatter skipped."""
        skip = self.flags[index]
        settings = dataclasses.replace(
            self.settings, params_sharded=True, exact_radial=False, selective=None,
            min_size=0, num_skip=self.num_skip if skip else 0, skip_ratio=None)
        grad = jnp.moveaxis(ct, dim, 0) * self.report.ranks
        local = jnp.moveaxis(shard, dim, 0)
        # Each leaf its own draw: the leaves' drops are independent.
        (out,), _ = skip_update(settings, [grad], self._state([local], step, index + 1),
                                [local])
        return jnp.moveaxis(out, 0, dim)

    def _state(self, local: Any, step: jax.Array, index: int = 0) -> Any:
        """The ring's state for ``step`` (count, micro-step): its key and count.

        Without error feedback's residual: this state is made afresh each step.
        """
        state = self.tx.init(local)
        if isinstance(state, FeedbackGateState):
            state = state.skip
        state = self._clocked(state._replace(residual=optax.EmptyState()), step)
        if index:
            key = jax.random.fold_in(jax.random.wrap_key_data(state.key), index)
            state = state._replace(key=jax.random.key_data(key))
        return state

    def _clocked(self, state: SkipReduceState, step: jax.Array) -> SkipReduceState:
        """``state`` at ``step``: the count from it, the key salted per micro-step."""
        key = jax.random.wrap_key_data(state.key)
        if self.salted:  # each micro-step of an update its own balanced draws
            key = jax.random.fold_in(key, step[1])
        return state._replace(count=step[0], key=jax.random.key_data(key))

    def replicated(self, grads: list[Any], local_params: list[Any], step: Any,
                   state: Any = None) -> tuple[list[Any], Any]:
        """Every leaf reduced: the ring for replicated params (FSDP's come reduced).

        ``state``: error feedback's (its count and key set from ``step``), and
        the next one returned; None without error feedback.
        """
        ranks = self.report.ranks
        if not any(d is not None for d in self.dims):
            local_tree = jax.tree_util.tree_unflatten(self.treedef, local_params)
            tree = jax.tree_util.tree_unflatten(self.treedef, [x * ranks for x in grads])
            if state is None:
                tree, _ = skip_update(self.settings, tree, self._state(local_tree, step),
                                      local_tree, specs=self.specs)
            elif isinstance(state, FeedbackGateState):
                tree, state = gated_update(self.settings, tree, state._replace(
                    skip=self._clocked(state.skip, step)), local_tree, self.specs)
            else:
                tree, state = skip_update(self.settings, tree, self._clocked(state, step),
                                          local_tree, specs=self.specs)
            return jax.tree_util.tree_leaves(tree), state
        rep = [i for i, d in enumerate(self.dims) if d is None]
        if not rep:
            return grads, None
        settings = dataclasses.replace(
            self.settings, exact_radial=False, min_size=0,
            selective=[self.flags[i] for i in rep])
        local = [local_params[i] for i in rep]
        state = self._state(local, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NothingSkippedWarning)
            reduced, _ = skip_update(settings, [grads[i] * ranks for i in rep], state, local,
                                     specs=[self.specs[i] for i in rep])
        out = list(grads)
        for i, g in zip(rep, reduced, strict=True):
            out[i] = g
        return out, None


def _check_first_step(program, outs, grads, step, mesh, treedef, exact_run):
    """At step 0: the exact step's leaves against ``jax.value_and_grad``'s; raises naming one.

    ``outs``, ``grads``: the step's own flat results, used where the step is
    itself exact; ``exact_run()`` builds its ``num_skip=0`` twin otherwise.
    """
    names = ([f"value{jax.tree_util.keystr(path)}" for path, _ in
              jax.tree_util.tree_flatten_with_path(program.out_tree.unflatten(
                  range(program.out_tree.num_leaves)))[0]]
             + [f"grads{jax.tree_util.keystr(path)}" for path, _ in
                jax.tree_util.tree_flatten_with_path(treedef.unflatten(
                    range(treedef.num_leaves)))[0]])
    names[0] = "the value" if program.out_tree.num_leaves == 1 else "the value (loss)"
    reference, inputs = program.reference

    def compare(_):
        mine_outs, mine_grads = (outs, grads) if exact_run is None else exact_run()
        explicit = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                         if t == jax.sharding.AxisType.Explicit)
        fn = functools.partial(jax.core.eval_jaxpr, reference.jaxpr)
        if explicit and program.report.trace_mesh.empty:  # traced as plain jit code
            fn = jax.sharding.auto_axes(fn, axes=explicit, out_sharding=P())
        ref = fn(list(reference.consts), *inputs)
        mine = [*mine_outs, *mine_grads]
        coarse = _computes_in_16_bits(program.closed.jaxpr)
        bad = jnp.stack([_differs(a, b, coarse) for a, b in zip(mine, ref, strict=True)])
        # A callback with a result the value adds: NaN on a mismatch.
        return io_callback(functools.partial(_report_mismatch, names, outs[0].dtype),
                           jax.ShapeDtypeStruct((), outs[0].dtype), bad)

    zero = lax.cond(step == 0, compare, lambda _: jnp.zeros((), outs[0].dtype), None)
    outs[0] = outs[0] + zero


class CheckSkippedWarning(UserWarning):
    """:func:`value_and_grad`'s first-step check cannot run for this loss."""


def _computes_in_16_bits(jaxpr: Any) -> bool:
    """Whether the loss rounds anything to a 16-bit float (its sums then reorder coarsely)."""
    for eqn in jaxpr.eqns:
        if any(getattr(v.aval, "dtype", None) in (jnp.bfloat16, jnp.float16)
               for v in eqn.outvars):
            return True
        for sub in jaxprs_in_params(eqn.params):
            if _computes_in_16_bits(sub):
                return True
    return False


def _differs(mine: jax.Array, ref: jax.Array, coarse: bool = False) -> jax.Array:
    """Whether two leaves differ beyond the rounding of a reordered sum.

    ``coarse``: the loss computes in 16-bit floats somewhere, so a float32
    leaf carries their rounding too.
    """
    mine, ref = jnp.asarray(mine), jnp.asarray(ref)
    if not jnp.issubdtype(ref.dtype, jnp.inexact):
        return jnp.any(mine != ref)
    fine = not coarse and jnp.finfo(ref.dtype).bits >= 32
    mine, ref = mine.astype(jnp.float32), ref.astype(jnp.float32)
    scale = jnp.max(jnp.abs(ref), initial=0.0)
    tol = 1e-3 * scale + 1e-5 if fine else 2e-2 * scale + 1e-3
    same_nan = jnp.isnan(mine) == jnp.isnan(ref)
    close = jnp.where(jnp.isnan(ref), True, jnp.abs(mine - ref) <= tol)
    return ~jnp.all(same_nan & close)


def _report_mismatch(names: list[str], dtype: Any, bad: Any) -> np.ndarray:
    """On the host: a message naming the first leaf flagged in ``bad``, and NaN.

    Nothing is raised: the callback runs on one device while the others wait
    in the step's collectives. The value the step returns adds the result,
    so a mismatch makes it NaN, and the message says why.
    """
    bad = np.asarray(bad)
    if not bad.any():
        return np.zeros((), dtype)
    print(f"{_API}: the first-step check found {names[int(np.argmax(bad))]} different "
          f"from jax.value_and_grad of the global loss at num_skip=0 ({int(bad.sum())} of "
          f"{bad.size} leaves differ); the step's value is NaN. The loss holds an "
          "operation the partitioning of the data axis computes wrongly: please report "
          "it, with the loss. value_and_grad(..., check=False) turns the check off.",
          file=sys.stderr, flush=True)
    return np.full((), np.nan, dtype)


def _mapped(fn, mesh, axes, in_specs, out_specs, out_shardings):
    """``jax.shard_map`` manual over ``axes``; Explicit axes go Auto around it."""
    kwargs = dict(in_specs=in_specs, out_specs=out_specs, axis_names=set(axes),
                  check_vma=True)
    explicit = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                     if t == jax.sharding.AxisType.Explicit)
    if not explicit:
        return jax.shard_map(fn, mesh=mesh, **kwargs)

    def inner(*a):
        return jax.shard_map(fn, **kwargs)(*a)

    return jax.sharding.auto_axes(inner, axes=explicit, out_sharding=out_shardings)


def _micro_slice(vals, layouts, microbatches, j):
    """Micro-batch ``j`` of each rank's rows: row ``i`` where ``i % microbatches == j``."""
    if microbatches == 1:
        return vals
    out = []
    for x, d in zip(vals, layouts, strict=True):
        if d is None:
            out.append(x)
            continue
        shape = x.shape[:d] + (x.shape[d] // microbatches, microbatches) + x.shape[d + 1:]
        out.append(lax.dynamic_index_in_dim(jnp.reshape(x, shape), j, axis=d + 1,
                                            keepdims=False))
    return out


def _accumulated(grad, args, params_at, given_batch, microbatches, has_aux):
    batch = (tuple(i for i in range(len(args)) if i not in params_at)
             if given_batch is None else given_batch)
    return accumulate(grad, args, batch, microbatches, has_aux=has_aux)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _split_dim(spec: P, axes: tuple[str, ...]) -> int | None:
    """The dimension ``spec`` splits over the data ``axes`` first (None: none)."""
    for d, entry in enumerate(spec):
        names = tuple(entry) if isinstance(entry, tuple) else (entry,) if entry else ()
        if names[:len(axes)] == axes:
            return d
    return None


def _shown_spec(leaf: Any, axes: tuple[str, ...]) -> P | None:
    """``leaf``'s layout as its type shows it, where the data axes are Explicit."""
    if not isinstance(leaf, (jax.Array, jax.core.Tracer)):
        return None
    sharding = getattr(jax.typeof(leaf), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types, strict=True))
    if any(types.get(a) != jax.sharding.AxisType.Explicit for a in axes):
        return None
    return P(*getattr(sharding.spec, "partitions", sharding.spec))


def _placed_spec(leaf: Any) -> P | None:
    """A placed array's spec (read outside jit, where it is still known)."""
    sharding = getattr(leaf, "sharding", None)
    return sharding.spec if isinstance(leaf, jax.Array) and isinstance(
        sharding, NamedSharding) else None


def _resolve_mesh(mesh: Any) -> Any:
    """``mesh``, or the mesh ``jax.set_mesh`` set; refused if neither."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{_API}: no mesh. Pass mesh=, or call the step under "
                "jax.set_mesh(mesh), whose mesh is then used.")
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise TypeError(f"{_API}: mesh must be a jax.sharding.Mesh (or None for "
                        f"the mesh of jax.set_mesh), got {type(mesh).__name__}.")
    if mesh.empty:
        raise ValueError(f"{_API}: the mesh has no axes; pass the device mesh, "
                         "e.g. jax.make_mesh((jax.device_count(),), ('data',)).")
    return mesh


def _axis_of_batch(batch: Sequence[Any], mesh: Any) -> str:
    """The one mesh axis the batch's rows are split over, by their types."""
    split = {a for leaf in jax.tree_util.tree_leaves(batch) if np.ndim(leaf)
             for spec in [_type_spec(leaf)] if spec is not None and len(spec)
             for a in _shards.spec_axes(P(spec[0]))}
    if len(split) == 1:
        return split.pop()
    seen = (f"the batch's rows are split over {sorted(split)}" if split else
            "no batch argument's type says which axis splits its rows (Auto axes "
            "carry no layout)")
    raise ValueError(
        f"{_API}: the mesh has axes {tuple(mesh.axis_names)} and {seen}; pass "
        "axis_name=, the data axis whose ring SkipReduce skips (e.g. the replica "
        "axis over slow links).")


def _type_spec(x: Any) -> P | None:
    """``x``'s layout, as its type shows it under Explicit axes (else None)."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    return P(*getattr(sharding.spec, "partitions", sharding.spec))


def _param_specs(params: Any, given: Any, mesh: jax.sharding.Mesh,
                 axes: tuple[str, ...], placed: list[P | None] | None = None
                 ) -> list[tuple[P | None, int | None]]:
    """Per param leaf: its spec over the compiler's axes, and its FSDP dimension.

    The spec is None where replicated; the dimension is the one it is split
    along over the data axes (None: none). From ``given`` (param_specs),
    else the types (Explicit axes), else the arrays' placements
    (``placed``, read where called outside jit).
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if given is not None:
        given = jax.tree_util.tree_map(  # shardings (jit's in_shardings) too
            lambda s: s.spec if isinstance(s, NamedSharding) else s, given,
            is_leaf=lambda s: s is None or isinstance(s, (P, NamedSharding)))
        specs = _shards.given_specs(leaves, treedef, given, api=_API,
                                    name="param_specs")
    else:
        specs = [getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
                 for x in leaves]
        if placed is not None:
            specs = [s if _shards.spec_axes(s) else p
                     for s, p in zip(specs, placed, strict=True)]
        # Explicit axes show the layout in the types (P() where replicated).
        others = [a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                  if a not in axes and mesh.shape[a] > 1
                  and t != jax.sharding.AxisType.Explicit]
        if others and leaves and not any(_shards.spec_axes(s) for s in specs):
            warnings.warn(
                f"{_API}: the params' layout over {others} is unknown inside "
                "jax.jit (Auto axes carry none), so params sharded over them are "
                "gathered before the ring and their grads come back replicated: "
                "the same values, more bytes. Pass param_specs= (e.g. the params' "
                "part of jit's in_shardings; P() if they are replicated).",
                stacklevel=3)
    out = []
    for leaf, spec in zip(leaves, specs, strict=True):
        named = set(_shards.spec_axes(spec))
        unknown = named - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"{_API}: param_specs names {sorted(unknown)}, not "
                             f"axes of the mesh {tuple(mesh.axis_names)}.")
        if named & set(axes) and not np.size(leaf):  # nothing to split: as replicated
            spec = P(*[None if set(_shards.spec_axes(P(e))) & set(axes) else e
                       for e in spec])
            named = set(_shards.spec_axes(spec))
        dim = _fsdp_dim(leaf, spec, mesh, axes) if named & set(axes) else None
        if dim is not None:  # FSDP: the compiler's axes are the other entries
            spec = P(*[None if d == dim else e for d, e in enumerate(spec)])
            named = set(_shards.spec_axes(spec))
        out.append((spec if named else None, dim))
    return out


def _fsdp_dim(leaf: Any, spec: P, mesh: Any, axes: tuple[str, ...]) -> int:
    """The dimension a param sharded over the data axes (FSDP) is split along."""
    want = axes if len(axes) > 1 else axes[0]
    dims = [d for d, e in enumerate(spec) if set(_shards.spec_axes(P(e))) & set(axes)]
    entry = spec[dims[0]]
    as_tuple = tuple(entry) if isinstance(entry, tuple) else (entry,)
    ranks = math.prod(mesh.shape[a] for a in axes)
    if len(dims) > 1 or as_tuple != axes or leaf.shape[dims[0]] % ranks:
        raise ValueError(
            f"{_API}: a param of shape {tuple(leaf.shape)} has spec {spec} over the "
            f"data axes {list(axes)}: a param sharded over them (FSDP) must split one "
            f"dimension over exactly {want!r}, in one entry of its spec, and that "
            f"dimension must divide by {ranks}. Shard it so (e.g. P({want!r}, ...)), "
            "or replicate it over the data axes.")
    return dims[0]


def _check_step(step: Any) -> tuple[jax.Array, bool]:
    """``step`` as int32[2], the count and the micro-step, and whether it has one.

    An ``optax.MultiStepsState`` (or a state holding one, e.g.
    ``state.opt_state``) gives its ``gradient_step`` and ``mini_step``: each
    micro-step of an update draws its own drops, whatever the loop counts.
    """
    if step is None:
        raise ValueError(
            f"{_API}: pass step=, the training step (e.g. step=state.step; a "
            "traced int is fine). The key of each step's drops comes from seed "
            "and step, and warm-up from step: it keeps no state of its own.")
    multi = [s for s in jax.tree_util.tree_leaves(
        step, is_leaf=lambda s: isinstance(s, optax.MultiStepsState))
        if isinstance(s, optax.MultiStepsState)]
    if len(multi) > 1:
        raise ValueError(f"{_API}: step= holds {len(multi)} optax.MultiStepsState; pass "
                         "the one of the optimizer in use.")
    if multi:
        return jnp.stack([jnp.asarray(multi[0].gradient_step, jnp.int32),
                          jnp.asarray(multi[0].mini_step, jnp.int32)]), True
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise ValueError(
            f"{_API}: step must be an int scalar (e.g. state.step), or the state of "
            f"optax.MultiSteps (state.opt_state); got an array of shape {step.shape} "
            f"and dtype {step.dtype}.")
    return jnp.stack([step.astype(jnp.int32), jnp.int32(0)]), False


def _check_options(config: SkipConfig | None, options: dict[str, Any], state: Any
                   ) -> SkipConfig:
    """The skip settings; error feedback with its state, and only with it."""
    if "inner_axis" in options:
        raise ValueError(f"{_API}: inner_axis is given here as axis_name=(outer, inner).")
    config = skip_config(config, options, api=_API)
    kind = {True: SkipReduceState, "auto": FeedbackGateState}.get(config.error_feedback)
    if state is not None and not isinstance(state, kind or ()):
        raise ValueError(
            f"{_API}: state= is error feedback's state, and got "
            f"{type(state).__name__} with error_feedback={config.error_feedback!r}: "
            "pass the state init_state made with the same options (error_feedback=True "
            "makes a SkipReduceState, \"auto\" a FeedbackGateState).")
    if config.params_sharded:
        raise ValueError(
            f"{_API}: params_sharded=True is not an option here: params sharded over "
            "the data axis (FSDP) are found from their layout (their types under "
            "Explicit axes, else param_specs=). Drop params_sharded.")
    return config
