"""``value_and_grad``: SkipReduce where ``jax.value_and_grad`` stood.

Called inside the user's own ``jax.jit`` step, it is a ``jax.shard_map``
manual over the data axis only: each rank differentiates the loss on its
rows of the batch (the other mesh axes stay with the compiler, so the loss
is plain GSPMD code there), and :func:`skip_reduce`'s reduction, built with
the caller's options, averages the local gradients. It keeps no state: the
step's key and warm-up come from ``seed`` and the ``step`` the caller
passes, as :func:`skip_reduce` derives them from its own step count.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax import _checks as checks
from skipreduce_jax import _shards
from skipreduce_jax._closure import with_args
from skipreduce_jax._config import skip_config
from skipreduce_jax._micro import accumulate
from skipreduce_jax._parallel import (
    AxisNames,
    PerRank,
    check_batch,
    markers,
    mesh_axes,
    per_rank_flags,
    positions,
    run_per_rank,
)
from skipreduce_jax._replay import closed_over, constants, divisor, replay, trace, unfed
from skipreduce_jax._transform import (
    NothingSkippedWarning,
    SkipConfig,
    _Config,
    skip_reduce,
)
from skipreduce_jax._transform import _update as skip_update

_API = "value_and_grad"
_CLOSED_OVER = (
    _API + ": fun closes over {what}. fun runs on each rank's rows of the batch; "
    "{why}: every rank would compute the whole batch and hold the same gradient. "
    "Pass the batch as an argument instead: def loss_fn(params, batch): ... with "
    "grad_fn(params, batch).")
_OUT_OF_REACH = (
    "a closed-over batch is passed to each rank as its rows where the loss holds "
    "it in a closure cell, a default or a functools.partial and either no batch "
    "argument is passed or its layout splits its rows over the data axis; this "
    "one is not (out of reach, or not shown to be the batch), so it would reach "
    "every rank whole")
# Options that keep state from step to step, which a stateless entry point
# cannot carry, and what to do instead.
_STATEFUL = {
    "error_feedback": "error_feedback (True or \"auto\") keeps a residual per rank",
    "params_sharded": "params_sharded=True takes params sharded over the data "
                      "axis (FSDP), whose blocks the step must gather",
    "inner_axis": "inner_axis is given here as axis_name=(outer, inner)",
}
_OPTAX_ROUTE = (
    "Use the optax route, which carries state: optax.chain(skip_reduce(...), "
    "...) in make_train_step, or in a data_parallel step with "
    "local_value_and_grad and init_opt_state.")


def value_and_grad(
    fun: Callable[..., Any],
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    axis_name: AxisNames | None = None,
    *,
    step: Any = None,
    has_aux: bool = False,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    param_specs: Any = None,
    microbatches: int = 1,
    config: SkipConfig | None = None,
    **skip_options: Any,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` whose gradient all-reduce is SkipReduce.

    Use it inside your own ``jax.jit`` step in place of
    ``jax.value_and_grad``; the optimizer, its state and the loop stay as
    they are. It takes and returns global arrays. ``fun`` is traced once as
    plain ``jax.jit`` code and runs on each rank's rows of the batch
    (arguments not in ``argnums``, or ``batch_argnums``; closed-over arrays
    that are the batch too), manual over ``axis_name`` only; the local
    gradients are averaged by :func:`skip_reduce` with ``skip_options``.

    - The grads are identical on every rank, in the params' layouts; at
      ``num_skip=0`` they are ``jax.value_and_grad``'s for a loss that is a
      mean, or that divides by :func:`mean_count` of a count.
    - The value is the mean over ranks; an ``aux`` leaf that is a sum over
      the batch's rows (a count) the sum; :class:`PerRank` leaves every
      rank's rows in the global batch's order.
    - What is refused or warned of, and why (a batch out of reach, a
      divisor of the global batch's size, nothing to split, a
      ``jax.custom_vjp`` beside Explicit layouts): the table in
      :doc:`jit loop </guides/jit-loop>`.
    - Under Explicit axes run the step under ``jax.set_mesh(mesh)``; a loss
      written for them (``reshard``, ``out_sharding=``) runs as written.
    - It keeps no state: the key and warm-up come from ``seed`` and
      ``step``, as :func:`skip_reduce` derives them from its count; options
      that carry state (``error_feedback``) are refused.

    Args:
      fun: the loss, as for ``jax.value_and_grad``, written for the global
        batch.
      mesh: the device mesh; None: the mesh of ``jax.set_mesh``.
      axis_name: the data axis; ``(outer, inner)`` for hierarchical
        SkipReduce (the batch is split over both; only ``outer`` skips).
        None: the mesh's only axis, or the one axis the batch arguments'
        types split their rows over (Explicit axes), read at the call.
      step: the training step (an int, or a traced int scalar such as
        ``state.step``). Required.
      has_aux: as for ``jax.value_and_grad``.
      argnums: the params' positions, as for ``jax.value_and_grad``.
      batch_argnums: positions split over ``axis_name``; None: every
        position not in ``argnums``.
      param_specs: how the params are laid out over the other mesh axes (a
        pytree prefix of ``PartitionSpec`` or ``NamedSharding``, e.g. the
        params' part of the ``in_shardings`` given to ``jax.jit``), so that
        the skipped ring runs on each device's shards and nothing crosses
        those axes. Under Explicit mesh axes it is read from the params'
        types. Under Auto axes, without it, the compiler gathers sharded
        leaves before the ring (the same values, more bytes; a warning says so).
      microbatches: gradient accumulation inside the step, one ring per
        step (:doc:`gradient accumulation </guides/gradient-accumulation>`):
        each rank's row ``i`` goes to micro-batch ``i % microbatches``; each
        ``aux`` leaf comes back stacked, one entry per micro-batch.
      config: the skip settings as a :class:`SkipConfig` (or as keywords).
      **skip_options: :func:`skip_reduce`'s options: ``num_skip`` or
        ``skip_ratio``, ``seed``, ``min_size``, ``warmup_steps``, ...

    Returns:
      ``f(*args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), as ``jax.value_and_grad`` returns.

    Raises:
      ValueError: if ``step`` is missing or not an int scalar, an option
        needs state, ``axis_name`` is not an axis of ``mesh``, or a batch
        leaf does not split evenly over the ranks.

    Example:
      >>> import optax
      >>> def loss_fn(w, x):
      ...     return jnp.mean((x @ w - 1.0) ** 2)
      >>> tx = optax.sgd(0.1)
      >>> @jax.jit
      ... def train_step(w, opt_state, x, step):
      ...     grad_fn = value_and_grad(loss_fn, mesh, "data", step=step,
      ...                              skip_ratio=0.5, min_size=0)
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
                 microbatches=microbatches, config=config, skip_options=skip_options)


def build(fun: Callable[..., Any], mesh: Any, axis_name: AxisNames | None, *,
          step: Any, has_aux: bool, argnums: int | Sequence[int],
          batch_argnums: int | Sequence[int] | None, param_specs: Any,
          microbatches: int, skip_options: dict[str, Any],
          config: SkipConfig | None = None,
          describe: Callable[[int], str] = "argument {}".format,
          state_path: tuple[int, ...] = ()) -> Callable[..., Any]:
    """:func:`value_and_grad`'s function; ``describe(i)`` names argument ``i``.

    ``state_path``: the key path (indices) of the output that is the model's
    state, not the user's aux (its rows are not per example).
    """
    mesh = _resolve_mesh(mesh)
    if axis_name is None and len(mesh.axis_names) > 1:
        # The data axis is the one the batch's rows are split over, as the
        # batch's types say under Explicit axes: read at the first call.
        built: dict[str, Callable[..., Any]] = {}

        def make(axis):
            if axis not in built:
                built[axis] = build(
                    fun, mesh, axis, step=step, has_aux=has_aux, argnums=argnums,
                    batch_argnums=batch_argnums, param_specs=param_specs,
                    microbatches=microbatches, skip_options=skip_options, config=config,
                    describe=describe, state_path=state_path)
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
    step = _check_step(step)
    microbatches = checks.check_int(microbatches, "microbatches", api=_API, minimum=1)
    config = _check_options(config, skip_options)
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

    jitted = []

    def wrapped(*args, **kwargs):
        if not kwargs and not any(isinstance(leaf, jax.core.Tracer)
                                  for leaf in jax.tree_util.tree_leaves(args)):
            # Called outside jit: one compiled program, reused on later calls.
            if not jitted:
                jitted.append(jax.jit(traced))
            return jitted[0](*args)
        return traced(*args, **kwargs)

    def traced(*args, **kwargs):
        if kwargs:
            raise TypeError(
                f"{_API}: pass fun's arguments positionally (got keyword "
                f"arguments {sorted(kwargs)}); argnums and batch_argnums count "
                "positions.")
        for i in params_at + (given_batch or ()):
            if i >= len(args):
                raise ValueError(
                    f"{_API}: argnum {i} (in argnums or batch_argnums) is out "
                    f"of range for a call with {len(args)} arguments.")
        # Params as arrays: a Python number among them is differentiated, not a constant.
        args = tuple(jax.tree_util.tree_map(jnp.asarray, a) if i in params_at else a
                     for i, a in enumerate(args))
        batch = (tuple(i for i in range(len(args)) if i not in params_at)
                 if given_batch is None else given_batch)
        for i in batch:
            check_batch(args[i], ranks, axes, api=_API, name=describe(i),
                        or_else="pass it in neither argnums nor batch_argnums "
                                "(replicated)", traced=True)
        # As jax.value_and_grad returns their grads.
        params = args[params_at[0]] if single else tuple(args[i] for i in params_at)
        if ranks == 1:
            # One rank: the gradient is already the global one (and XLA's
            # partitioner refuses an all-reduce over a size-1 manual axis).
            grad = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
            return accumulate(grad, args, batch, microbatches, has_aux=has_aux)
        specs = _param_specs(params, param_specs, mesh, axes)
        rows = {leaf.shape[0] for i in batch
                for leaf in jax.tree_util.tree_leaves(args[i]) if np.ndim(leaf)}
        # The loss, traced once as the caller's jit sees it, on one rank's
        # (micro-)batch; replayed per rank below.
        loss = fun
        try:
            traced = _trace(loss, args, batch)
            consts = traced.consts
        except Exception:
            try:
                consts = closed_over(loss, args)
            except Exception:
                if any_explicit:
                    raise  # as plain jit refuses it
                consts = None
            if rows and consts:  # did the global batch, closed over, meet a rank's rows?
                _refuse_closed_over_batch([c for c in consts if not _shown_split(c, axes)],
                                          rows)
            if not any_explicit or consts is None:
                raise
            # Code that sets layouts over Explicit axes traces as the caller's
            # jit sees it (for what it closes over), then as one rank's.
            traced = None
        closed = _closed_over_batch(consts, rows, axes, ranks,
                                    traced.jaxpr if traced else None)
        # Under Explicit axes every array it closes over carries the caller's mesh.
        others = [] if traced else [
            c for c in consts if _type_spec(c) is not None and all(c is not b for b in closed)]
        if closed or others:
            # The batch it closes over becomes a split argument, the rest whole.
            check_batch(closed, ranks, axes, api=_API, name="an array fun closes over",
                        or_else="pass it to fun as an argument", traced=True)
            args, batch = (*args, closed, others), (*batch, len(args))
            rows |= {c.shape[0] for c in closed}
            loss = _closing_over(loss, closed + others)
        if traced and (closed or others):
            traced = _trace(loss, args, batch)
        typed = not traced
        if typed:
            try:
                traced = _trace(loss, args, batch, typed=True)
            except Exception:
                # An array it still closes over carries the caller's mesh.
                _refuse_closed_over_batch(closed_over(loss, args), set())
                raise
        _refuse_closed_over_batch(traced.consts, rows)
        if not rows:
            _warn_nothing_split(traced.consts, ranks, axes)
        _warn_global_divisor(traced, rows, ranks)
        # An output no argument feeds (a count from the batch's shapes) is
        # what jax.value_and_grad gives: traced on the global (micro-)batch.
        fixed = unfed(traced)
        fixed = dict(zip(fixed, constants(
            _trace(loss, args, batch, typed=typed, parts=microbatches), fixed),
            strict=True)) if fixed else {}
        return run(traced, step, args, batch, params, specs, fixed)

    def _trace(fun, args, batch, typed=False, parts=None):
        return trace(fun, args, [i in batch for i in range(len(args))], mesh, axes,
                     [_type_spec(x) for x in jax.tree_util.tree_leaves(args)]
                     if typed else None, ranks * microbatches if parts is None else parts)

    any_explicit = jax.sharding.AxisType.Explicit in mesh.axis_types

    def run(traced, step, args, batch, params, specs, fixed):
        """The traced loss per rank (its own gradients), then the ring."""
        grad = jax.value_and_grad(replay(traced, markers(axes)), argnums=argnums,
                                  has_aux=has_aux)
        sample = traced.out_tree.unflatten([0] * traced.out_tree.num_leaves)
        per_rank = per_rank_flags(sample)
        stacked = [v or f for v, f in zip(traced.out_varying, per_rank, strict=True)]
        with_paths = jax.tree_util.tree_flatten_with_path(sample)[0]
        avals = [v.aval for v in traced.jaxpr.outvars]
        for (path, _), f, aval in zip(with_paths, per_rank, avals, strict=True):
            if f and not aval.ndim:
                raise ValueError(
                    f"{_API}: skipreduce_jax.PerRank at {_where(path)} holds a "
                    "scalar. PerRank is for per-example rows (a leading batch "
                    "dimension), which come back as every rank's rows in the "
                    "global batch's order; return a scalar unwrapped (it comes "
                    "back as the mean over ranks).")

        def local(consts, *local_args):
            """One rank's value, aux and gradients: its own, not summed."""
            out, grads = accumulate(lambda *a: grad(*a, consts), local_args, batch,
                                    microbatches, has_aux=has_aux)
            leaves = [_rows_in_order(x, microbatches) if f else x
                      for x, f in zip(jax.tree_util.tree_leaves(out), per_rank, strict=True)]
            return ([PerRank(x[None]) if s else x for x, s in zip(leaves, stacked, strict=True)],
                    PerRank(jax.tree_util.tree_map(lambda g: g[None], grads)))

        def reduce(step, local_params, grads, outs):
            """The ring over the ranks' gradients; the mean of their values."""
            grads = jax.tree_util.tree_map(lambda g: g[0], grads.value)
            state = tx.init(local_params)._replace(count=step)
            grads, _ = skip_update(settings, grads, state, local_params, specs=specs)
            return [lax.psum(x[0], axes) if total else
                    _mean_over_ranks(x[0], path, axes, rows if not _under(path, state_path)
                                     else set())
                    for x, path, total in zip(outs.value, mean_paths, sums, strict=True)], grads

        mean_at = [i for i, (v, f) in enumerate(zip(traced.out_varying, per_rank,
                                                    strict=True)) if v and not f]
        mean_paths = [with_paths[i][0] for i in mean_at]
        # An aux leaf that is a sum over the batch (a count, a summed loss)
        # is summed over the ranks; the value and other leaves averaged.
        sums = [i > 0 and traced.out_sums[i] for i in mean_at]
        rows = {leaf.shape[0] // (ranks * microbatches) for i in batch  # one rank's
                for leaf in jax.tree_util.tree_leaves(args[i]) if np.ndim(leaf)}
        param_layouts = [(s, np.ndim(x)) for s, x in zip(
            specs, jax.tree_util.tree_leaves(params), strict=True)]
        leaf_specs = iter(specs)  # the params' leaves in argnums' order
        specs_at = {i: [next(leaf_specs) for _ in jax.tree_util.tree_leaves(args[i])]
                    for i in params_at}

        def arg_specs(i, a):
            return specs_at.get(i) or [None] * len(jax.tree_util.tree_leaves(a))

        consts = traced.consts
        outs, grads = run_per_rank(
            local, mesh, axes, [consts, *args],
            [[None] * len(consts)] + [arg_specs(i, a) for i, a in enumerate(args)],
            batch=[i + 1 for i in batch], manual=set(axes), api=_API, check_vma=False, retype=True,
            layouts=[None] * len(stacked) + param_layouts)
        outs = [x.value if s else x for x, s in zip(outs, stacked, strict=True)]
        means, grads = run_per_rank(
            reduce, mesh, axes, [step, params, grads, PerRank([outs[i] for i in mean_at])],
            [[None], list(specs), [None] * len(specs), [None] * len(mean_at)],
            batch=[], manual=set(axes), api=_API, retype=True,
            layouts=[None] * len(mean_at) + param_layouts)
        for i, m in zip(mean_at, means, strict=True):
            outs[i] = m
        for i, value in fixed.items():  # aux is stacked per micro-batch
            outs[i] = (value if jnp.shape(value) == jnp.shape(outs[i])
                       else jnp.broadcast_to(value, jnp.shape(outs[i])))
        outs = [jnp.reshape(x, (-1,) + x.shape[2:]) if f else x
                for x, f in zip(outs, per_rank, strict=True)]
        return traced.out_tree.unflatten(outs), grads

    return wrapped


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


def _warn_global_divisor(traced: Any, rows: set[int], ranks: int) -> None:
    """Warns of a loss divided by the global batch's rows (``/ 64.0``).

    The loss runs on each rank's rows and the value is their mean over
    ranks: a rank's sum divided by the global row count comes back 1/N of
    ``jax.value_and_grad``'s, gradients too.
    """
    d = divisor(traced, 0)
    if d is None or not any(d == r for r in rows) or any(d == r // ranks for r in rows):
        return
    warnings.warn(
        f"{_API}: the loss is divided by {d:g}, the global batch's rows, but it runs "
        f"on each rank's {int(d) // ranks} rows and comes back as the mean over "
        f"ranks: its value and gradients would be 1/{ranks} of jax.value_and_grad's. "
        f"Divide by skipreduce_jax.mean_count({d:g}) (exact), or use jnp.mean.",
        GlobalDivisorWarning, stacklevel=4)


def _warn_nothing_split(consts: Sequence[Any], ranks: int, axes: tuple[str, ...]) -> None:
    """Warns of a loss with nothing to split: no batch argument, no batch closed over."""
    host = [tuple(c.shape) for c in consts
            if isinstance(c, np.ndarray) and c.ndim and c.shape[0] % ranks == 0]
    hint = (f" It closes over host arrays of shapes {host}: if one is the batch, "
            f"pass it as an argument, or place it with its rows split over {axes} "
            "(jax.device_put(x, NamedSharding(mesh, P(axis))))." if host else "")
    warnings.warn(
        f"{_API}: nothing is split over {axes}: fun takes no batch argument and "
        "closes over no traced or placed batch, so every rank computes the same "
        "loss on the same data and holds the same gradient; skipping changes "
        f"nothing and the work is done {ranks} times.{hint}",
        NothingSkippedWarning, stacklevel=4)


class GlobalDivisorWarning(UserWarning):
    """A loss divided by the global batch's size where it runs per rank."""


def _closed_over_batch(consts: Sequence[Any], rows: set[int], axes: tuple[str, ...],
                       ranks: int, jaxpr: Any = None) -> list[Any]:
    """The arrays ``fun`` closes over that are its batch.

    With batch arguments (``rows``, their leading dimensions): those whose
    layout shows their rows split over the data axes (a placed array, an
    Explicit type); another with the batch's leading dimension is refused
    later, not split on a guess. With none: every closed-over traced (or
    placed) array whose leading dimension divides by the ranks, if they
    share one leading dimension and none is indexed into (a table, not
    rows); else refused.
    """
    closed = [c for c in consts if np.ndim(c) and (
        isinstance(c, jax.core.Tracer) or _shown_split(c, axes))]
    if rows:
        return [c for c in closed if c.shape[0] in rows and _shown_split(c, axes)]
    closed = [c for c in closed if c.shape[0] % ranks == 0]
    indexed = _indexed(jaxpr, consts) if jaxpr is not None else set()
    tables = [c for c in closed if id(c) in indexed]
    if tables:
        raise ValueError(_CLOSED_OVER.format(
            what="arrays of shapes " + ", ".join(str(tuple(c.shape)) for c in closed),
            why=f"the one of shape {tuple(tables[0].shape)} is indexed into (a table, "
                "not rows of the batch), so which of them are the batch is not "
                "guessed: taken whole"))
    if len({c.shape[0] for c in closed}) > 1:
        raise ValueError(_CLOSED_OVER.format(
            what="arrays of shapes " + ", ".join(str(tuple(c.shape)) for c in closed),
            why="with no batch argument whose leading dimension tells which of them "
                "are the batch, none is split: taken whole"))
    return closed


def _shown_split(x: Any, axes: tuple[str, ...]) -> bool:
    """Does ``x``'s layout (placed, or an Explicit type) split its rows over ``axes``?"""
    sharding = getattr(x, "sharding", None)
    spec = (sharding.spec if isinstance(x, jax.Array) and isinstance(sharding, NamedSharding)
            else _type_spec(x))
    return bool(spec is not None and len(spec)
                and set(_shards.spec_axes(P(spec[0]))) & set(axes))


def _indexed(jaxpr: Any, consts: Sequence[Any]) -> set[int]:
    """The ids of ``consts`` a gather or dynamic slice of ``jaxpr`` indexes into."""
    of = {v: id(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
    found = set()

    def visit(jaxpr, names):
        for eqn in jaxpr.eqns:
            ins = [None if isinstance(v, Literal) else v for v in eqn.invars]
            if eqn.primitive.name in ("gather", "dynamic_slice") and ins[0] in names:
                found.add(names[eqn.invars[0]])
            for sub in jax.tree_util.tree_leaves(
                    list(eqn.params.values()),
                    is_leaf=lambda x: hasattr(x, "jaxpr") or hasattr(x, "eqns")):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
                    visit(inner, {w: names[v] for v, w in zip(ins, inner.invars)
                                  if v is not None and v in names})

    visit(jaxpr, of)
    return found


def _refuse_closed_over_batch(consts: Sequence[Any], rows: set[int]) -> None:
    """Refuses a batch the loss still closes over (its traced ``consts``).

    What :func:`with_args` could not reach (a global, an object's
    attribute) reaches every rank whole: each rank would compute the whole
    batch and hold the same gradient. ``rows``: the global batch's leading
    dimensions (empty: no batch argument).
    """
    closed = [c for c in consts if isinstance(c, jax.core.Tracer)]
    for leaf in closed:
        if not np.ndim(leaf) or (rows and leaf.shape[0] not in rows):
            continue
        raise ValueError(_CLOSED_OVER.format(
            what=f"a traced array of shape {tuple(leaf.shape)}"
            + (" with the batch's leading dimension" if rows else ""),
            why=_OUT_OF_REACH))


def _closing_over(fun: Callable[..., Any], arrays: list[Any]) -> Callable[..., Any]:
    """``fun`` taking the ``arrays`` it closes over as two last arguments."""
    g = with_args(fun, arrays)
    return lambda *a: g(*a[:-2], (*a[-2], *a[-1]))


def _type_spec(x: Any) -> P | None:
    """``x``'s layout, as its type shows it under Explicit axes (else None)."""
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        return None
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    return P(*getattr(sharding.spec, "partitions", sharding.spec))


def _rows_in_order(x: jax.Array, microbatches: int) -> jax.Array:
    """A PerRank leaf, stacked per micro-batch, as the rank's rows in order.

    Micro-batch ``j`` holds the rank's rows ``i`` with ``i % microbatches ==
    j`` (see ``_micro``): ``(k, rows / k, ...)`` back to ``(rows, ...)``.
    """
    if microbatches == 1:
        return x
    return jnp.reshape(jnp.moveaxis(x, 0, 1), (-1,) + x.shape[2:])


def _under(path: Any, prefix: tuple[int, ...]) -> bool:
    """Is key ``path`` under the sequence indices ``prefix``?"""
    return bool(prefix) and tuple(getattr(k, "idx", None)
                                  for k in path[:len(prefix)]) == prefix


def _where(path: Any) -> str:
    return jax.tree_util.keystr(path) or "the root"


def _mean_over_ranks(leaf: Any, path: Any, axes: tuple[str, ...],
                     rows: set[int]) -> Any:
    """One value or aux leaf that differs per rank: its mean over ranks.

    A leaf whose leading dimension is that of a rank's batch looks per
    example (logits, per-token losses): its mean over ranks mixes the rows
    of different examples, so it is averaged with a warning naming PerRank.
    """
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise ValueError(
            f"{_API}: the aux output at {_where(path)} ({leaf.dtype}) differs "
            "per rank and is not a float, so it has no mean over ranks. Return "
            "it as a float, or per rank, wrapped in skipreduce_jax.PerRank(x) "
            "(rows of every rank concatenated).")
    if np.ndim(leaf) and leaf.shape[0] in rows:
        warnings.warn(
            f"{_API}: the aux output at {_where(path)} of local shape "
            f"{leaf.shape} has a row per example of this rank's batch; it "
            "comes back as the mean over ranks of those rows, not one row "
            "per example. For every rank's rows (global batch order) "
            "return skipreduce_jax.PerRank(x); for a mean, reduce it in "
            "the loss (e.g. jnp.mean(x)).", stacklevel=5)
    return lax.pmean(leaf, axes)


def _param_specs(params: Any, given: Any, mesh: jax.sharding.Mesh,
                 axes: tuple[str, ...]) -> list[P | None]:
    """One spec over the compiler's axes per param leaf (None: replicated)."""
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
        if named & set(axes):
            raise ValueError(
                f"{_API}: a param of shape {tuple(leaf.shape)} is sharded over "
                f"{sorted(named & set(axes))} (spec {spec}), the data axis: the "
                "params must be replicated over it (any layout over the other "
                "mesh axes). For FSDP over the data axis use make_train_step "
                "with skip_reduce(..., params_sharded=True).")
        unknown = named - set(mesh.axis_names)
        if unknown:
            raise ValueError(f"{_API}: param_specs names {sorted(unknown)}, not "
                             f"axes of the mesh {tuple(mesh.axis_names)}.")
        out.append(spec if named else None)
    return out


def _check_step(step: Any) -> Any:
    if step is None:
        raise ValueError(
            f"{_API}: pass step=, the training step (e.g. step=state.step; a "
            "traced int is fine). The key of each step's drops comes from seed "
            "and step, and warm-up from step: it keeps no state of its own.")
    step = jnp.asarray(step)
    if step.shape != () or not jnp.issubdtype(step.dtype, jnp.integer):
        raise ValueError(
            f"{_API}: step must be an int scalar (e.g. state.step), got an "
            f"array of shape {step.shape} and dtype {step.dtype}.")
    return step.astype(jnp.int32)


def _check_options(config: SkipConfig | None, options: dict[str, Any]) -> SkipConfig:
    """The skip settings, refused where they need state from step to step."""
    if "inner_axis" in options:
        raise ValueError(f"{_API}: {_STATEFUL['inner_axis']}.")
    config = skip_config(config, options, api=_API)
    for name, why in _STATEFUL.items():
        if getattr(config, name, False):
            raise ValueError(
                f"{_API}: {why}, and value_and_grad keeps no state from step to "
                f"step. {_OPTAX_ROUTE}")
    return config
