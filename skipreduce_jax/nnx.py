"""Flax NNX support: local gradients of a Module, optimizers, the step.

Needs ``flax`` (0.11 or later: NNX objects are pytrees and
``nnx.Optimizer.update(model, grads)``). The NNX version of flax's usual
step, data-parallel with SkipReduce::

    import skipreduce_jax as sr
    import skipreduce_jax.nnx as srnnx

    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5), optax.adamw(1e-3))
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data", wrt=nnx.Param)

    def train_step(model, optimizer, batch):        # one rank's rows
        grad_fn = srnnx.local_value_and_grad(loss_fn, "data", has_aux=True)
        (loss, logits), grads = grad_fn(model, batch)
        optimizer.update(model, grads)              # skip_reduce averages
        return lax.pmean(loss, "data")

    step = srnnx.data_parallel(train_step, mesh, "data", batch_argnums=2,
                               donate_argnums=(0, 1))
    loss = step(model, optimizer, numpy_batch)      # model, optimizer updated

Layers that compute batch statistics must reduce them over the data axis
(``nnx.BatchNorm(..., axis_name="data")``; then let no leaf that feeds one
skip without error feedback: :func:`init_optimizer` warns), and metrics updated inside the
step must see reduced values (``lax.pmean``, or ``lax.all_gather(...,
tiled=True, to="invarying")`` for logits and labels): the step refuses
state that still differs per rank, naming it. With a mesh from
``jax.make_mesh`` (Explicit axes), run code that mixes the step's outputs
with new arrays, e.g. ``nnx.MultiMetric.update`` outside the step, under
``jax.set_mesh(mesh)``.

Or keep flax's own step under ``nnx.jit`` and change one line:
:func:`value_and_grad` in place of ``nnx.value_and_grad`` (stateless: the
optimizer stays a plain ``nnx.Optimizer``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from flax import nnx
from flax.nnx.training.optimizer import to_opt_state

from skipreduce_jax import _checks as checks
from skipreduce_jax._grad import build, mean_over_ranks
from skipreduce_jax._norms import batchnorm_modules
from skipreduce_jax._parallel import (
    AxisNames,
    as_tuple,
    build_step,
    positions,
    rank_key,
)
from skipreduce_jax._training import init_opt_state, per_rank_value_and_grad, to_varying

__all__ = ["data_parallel", "init_optimizer", "local_value_and_grad", "value_and_grad"]


def local_value_and_grad(
    loss_fn: Callable[..., Any],
    axis_name: AxisNames = "data",
    *,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    rank_rngs: bool = True,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of a Module that returns LOCAL gradients.

    ``nnx.value_and_grad`` inside the step returns gradients autodiff already
    summed over the data axis (the params are replicated), which
    ``skip_reduce`` refuses. This splits the model, types the ``wrt``
    variables as varying over ``axis_name``, merges and differentiates, so
    each rank gets the gradient of its own loss. Other state the loss
    updates (BatchNorm statistics, RNG counters) is written back to the
    model.

    With ``rank_rngs`` each rank folds its index into the model's RNG
    stream keys (:func:`skipreduce_jax.rank_key`) for the call, so that
    ``nnx.Dropout`` draws a different mask on every rank; the stored keys
    stay replicated and the counters advance alike on every rank. Keys the
    loss gets as arguments (an ``nnx.Rngs`` passed to the step) are not the
    model's: build them from ``skipreduce_jax.rank_key(key, axis_name)``.

    Call it inside the step on a model the step received as an argument: a
    Module closed over from outside cannot be updated inside a trace. A loss
    constraining over the data axes runs as
    :func:`skipreduce_jax.local_value_and_grad` runs it (replayed per rank).

    Args:
      loss_fn: ``loss_fn(model, *args)``, returning a scalar (``(loss, aux)``
        with ``has_aux``).
      axis_name: the data axis, or ``(outer, inner)``.
      wrt: the ``nnx`` filter of the variables to differentiate (match the
        optimizer's ``wrt``).
      has_aux: as for ``nnx.value_and_grad``.
      rank_rngs: per-rank RNG streams during the call (see above).

    Returns:
      ``f(model, *args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), where ``grads`` is an ``nnx.State`` of this rank's
      gradients, ready for ``optimizer.update(model, grads)``.
    """
    axes = as_tuple(axis_name)
    rank_rngs = checks.check_bool(rank_rngs, "rank_rngs",
                                  api="skipreduce_jax.nnx.local_value_and_grad")

    def wrapped(model, *args):
        pure, params, others = _pure(loss_fn, model, wrt, axes, has_aux=has_aux,
                                     rank_rngs=rank_rngs)
        (loss, (aux, rest)), grads = per_rank_value_and_grad(
            pure, (to_varying(params, axes), others, *args), {}, axes, argnums=0,
            has_aux=True)
        nnx.update(model, rest)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _pure(loss_fn: Callable[..., Any], model: Any, wrt: Any,
          axes: tuple[str, ...], *, has_aux: bool, rank_rngs: bool,
          mean_rest: bool = False) -> tuple[Callable[..., Any], Any, tuple[Any, ...]]:
    """``loss_fn(model, *args)`` as a function of the model's states.

    Returns ``(pure, params, others)``: ``pure(params, others, *args)``
    returns ``(loss, (aux, rest))``, ``rest`` being the state the loss
    updates (BatchStat, RngCount, ...), to write back with ``nnx.update``
    (with ``mean_rest``, its float leaves that differ per rank averaged over
    ``axes``). With ``rank_rngs`` the model's RNG keys are folded with the
    rank's index over ``axes`` for the call (and not written back).
    """
    filters = (wrt, nnx.RngKey, ...) if rank_rngs else (wrt, ...)
    graphdef, params, *others = nnx.split(model, *filters)

    # The states are arguments, so that the model merged inside the
    # differentiated function is this trace's own and may be mutated.
    def pure(params, others, *args):
        if rank_rngs:
            keys = jax.tree_util.tree_map(lambda k: rank_key(k, axes), others[0])
            others = (keys, *others[1:])
        local = nnx.merge(graphdef, params, *others, copy=True)
        out = loss_fn(local, *args)
        rest = nnx.split(local, *filters)[-1]  # BatchStat, RngCount, ...
        if mean_rest:
            rest = mean_over_ranks(rest, axes)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, rest)

    return pure, params, tuple(others)


def value_and_grad(
    loss_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    step: Any = None,
    wrt: Any = nnx.Param,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    rank_rngs: bool = True,
    param_specs: Any = None,
    config: Any = None,
    **skip_options: Any,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` whose gradient all-reduce is SkipReduce.

    Use it inside your ``nnx.jit`` step in place of ``nnx.value_and_grad``;
    the rest of the step (a plain ``nnx.Optimizer``, metrics) stays as it
    is. It is :func:`skipreduce_jax.value_and_grad` of the model's ``wrt``
    state: ``loss_fn(model, *args)`` runs on each rank's rows of the batch
    arguments (``batch_argnums``, counted as for ``loss_fn``; default:
    every argument after the model), and the grads, an ``nnx.State`` as
    ``nnx.value_and_grad`` returns, are averaged by ``skip_reduce`` with
    ``skip_options`` and identical on every rank. The value and aux are the
    mean over ranks (:class:`skipreduce_jax.PerRank` leaves: every rank's
    rows); divide by :func:`skipreduce_jax.mean_count` of a count from the
    batch. The key comes from ``seed`` and ``step``: no optimizer state
    needs to change.

    Other state the loss updates is written back to the model, as the mean
    over ranks: BatchNorm's running statistics. A BatchNorm without
    ``axis_name`` normalizes each rank's rows with their own statistics
    (PyTorch DDP's default), and its running averages become the mean of
    the ranks'; give it ``axis_name`` set to the data axis for statistics
    of the global batch (then it needs that axis bound outside too). With
    ``rank_rngs`` each rank folds its index into the model's RNG keys for
    the call, so ``nnx.Dropout`` draws its own mask on every rank; the RNG
    counters advance alike.

    Args:
      loss_fn: ``loss_fn(model, *args)``, returning a scalar (``(loss, aux)``
        with ``has_aux``), written for the global batch.
      mesh: the device mesh.
      axis_name: the data axis, or ``(outer, inner)``.
      step: the training step (e.g. ``optimizer.step[...]``). Required.
      wrt: the ``nnx`` filter of the variables to differentiate.
      has_aux: as for ``nnx.value_and_grad``.
      batch_argnums: positions (in ``loss_fn``'s arguments, the model being
        0) split over ``axis_name``; None: every one after the model.
      rank_rngs: per-rank RNG streams during the call (see above).
      param_specs: as for :func:`skipreduce_jax.value_and_grad` (a prefix
        of the ``wrt`` state).
      config: the skip settings as a :class:`skipreduce_jax.SkipConfig`
        (or as keywords).
      **skip_options: :func:`skipreduce_jax.skip_reduce`'s options.

    Returns:
      ``f(model, *args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), ``grads`` an ``nnx.State``.

    Example::

        @nnx.jit
        def train_step(model, optimizer, x, y):
            grad_fn = srnnx.value_and_grad(loss_fn, mesh, "data",
                                           step=optimizer.step[...],
                                           skip_ratio=0.5, min_size=0)
            loss, grads = grad_fn(model, x, y)
            optimizer.update(model, grads)
            return loss
    """
    api = "skipreduce_jax.nnx.value_and_grad"
    axes = as_tuple(axis_name)
    rank_rngs = checks.check_bool(rank_rngs, "rank_rngs", api=api)
    given = (None if batch_argnums is None
             else positions(batch_argnums, "batch_argnums", api=api))
    if given is not None and 0 in given:
        raise ValueError(f"{api}: batch_argnums={batch_argnums!r} holds 0, the "
                         "model; count the batch arguments from 1.")

    def wrapped(model, *args):
        pure, params, others = _pure(loss_fn, model, wrt, axes, has_aux=has_aux,
                                     rank_rngs=rank_rngs)
        # pure(params, others, *args): the loss's argument i is at i + 1.
        batch = (tuple(range(2, len(args) + 2)) if given is None
                 else tuple(i + 1 for i in given))
        (loss, (aux, rest)), grads = build(
            pure, mesh, axis_name, step=step, has_aux=True, argnums=0,
            batch_argnums=batch, param_specs=param_specs, microbatches=1,
            config=config, skip_options=skip_options,
            describe=lambda i: f"loss_fn's argument {i - 1} (the model is 0)",
            state_path=(1, 1))(
                params, others, *args)
        nnx.update(model, rest)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def init_optimizer(
    model: Any,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    wrt: Any = nnx.Param,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)`` whose state is built per rank.

    ``nnx.Optimizer`` runs ``tx.init`` outside any ``shard_map``, so
    ``skip_reduce(error_feedback=True)`` gets a single residual row instead
    of one per rank, and nothing checks that every device built
    ``skip_reduce`` alike. This builds the state with
    :func:`skipreduce_jax.init_opt_state` instead: per-rank rows on their
    devices, replicated state everywhere, settings checked. Its ``update``
    also knows the model's ``nnx.BatchNorm`` layers (with an ``axis_name``)
    by type, which turns ``skip_reduce``'s ``exact_radial`` on by default.

    Args:
      model: the NNX Module.
      tx: the optimizer, ``skip_reduce`` first; or a
        :class:`skipreduce_jax.MultiSteps` around it (each rank accumulates
        its local gradients, reduced once per k micro-steps; see
        :func:`skipreduce_jax.init_opt_state`).
      mesh: the device mesh.
      axis_name: the data axis, as for :func:`data_parallel`.
      wrt: the filter of the variables to optimize.

    Returns:
      An ``nnx.Optimizer`` for ``model``.

    Raises:
      ValueError: if the ``skip_reduce`` seed or settings differ by device.
    """
    optimizer = nnx.Optimizer(model, optax.identity(), wrt=wrt)
    params = nnx.state(model, wrt)
    # skip_reduce's BatchNorm warning, from the layers' types, not their names.
    norms = [path for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.BatchNorm) and node.axis_name is not None]
    with batchnorm_modules(norms):
        state = init_opt_state(tx, params, mesh, axis_name)
    optimizer.tx = _knowing_batchnorms(tx, norms)
    # init_opt_state placed every leaf; flax's eager sharding would place the
    # new Variables again by the params' annotations, which need a mesh
    # context and misfit a residual's extra leading row axis.
    state = jax.tree_util.tree_map(_placed, state,
                                   is_leaf=lambda x: isinstance(x, nnx.Variable))
    optimizer.opt_state = nnx.data(to_opt_state(state))
    return optimizer


def _knowing_batchnorms(tx: optax.GradientTransformation,
                        norms: list[tuple[Any, ...]]) -> optax.GradientTransformation:
    """``tx`` whose update knows the model's BatchNorm layers by type.

    ``skip_reduce(exact_radial=None)`` turns its BatchNorm remedy on from them.
    """
    def update(updates, state, params=None, **extra):
        with batchnorm_modules(norms):
            return tx.update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def _placed(x: Any) -> Any:
    """A Variable ``x`` as one that flax does not shard again on copies."""
    if not isinstance(x, nnx.Variable) or not x.get_metadata().get("eager_sharding"):
        return x
    return type(x)(x.get_value(), **{**x.get_metadata(), "eager_sharding": False})


def data_parallel(
    step_fn: Callable[..., Any],
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    batch_argnums: int | Sequence[int],
    static_argnums: int | Sequence[int] = (),
    donate_argnums: int | Sequence[int] = (),
) -> Callable[..., Any]:
    """:func:`skipreduce_jax.data_parallel` that updates NNX objects in place.

    As ``nnx.jit`` does: the NNX objects passed as arguments (a Module, an
    ``nnx.Optimizer``, ``nnx.Metric`` s; neither batch nor static) are
    updated after the call with what ``step_fn`` left in them, so a step
    written for ``nnx.jit`` only needs its gradients taken with
    :func:`local_value_and_grad` and its returned values reduced.

    Args:
      step_fn: the per-rank step, e.g. ``(model, optimizer, batch) -> loss``.
      mesh: the device mesh.
      axis_name: the data axis; ``(outer, inner)`` for hierarchical mode.
      batch_argnums: positions of the arguments split over the data axes.
      static_argnums: positions passed through as Python values.
      donate_argnums: positions whose buffers the step may reuse.

    Returns:
      A callable ``step(*args)`` returning what ``step_fn`` returns; its
      ``lower`` method lowers it as ``jax.jit``'s does (e.g. to read the
      compiled program's collectives), leaving the objects as they are.
    """
    api = "skipreduce_jax.nnx.data_parallel"
    batch = positions(batch_argnums, "batch_argnums", api=api)
    static = positions(static_argnums, "static_argnums", api=api)
    steps = {}

    def build(graph: tuple[int, ...], names: tuple[str, ...]):
        def with_objects(*args):
            return step_fn(*args), tuple(args[i] for i in graph)

        def describe(path):
            # (output, objects): name an object's leaf by its argument.
            if path[-1:] == (jax.tree_util.GetAttrKey("value"),):
                path = path[:-1]  # a Variable's value: name the Variable
            if path[0].idx == 1:
                return (f"argument {graph[path[1].idx]} ({names[path[1].idx]}) "
                        f"at {jax.tree_util.keystr(path[2:]) or 'the root'}")
            return f"the output at {jax.tree_util.keystr(path[1:]) or 'the root'}"

        return build_step(with_objects, mesh, axis_name,
                          batch_argnums=batch_argnums,
                          static_argnums=static_argnums,
                          donate_argnums=donate_argnums,
                          api=api, describe=describe)

    def built(args):
        graph = tuple(i for i, a in enumerate(args) if isinstance(a, nnx.Pytree)
                      and i not in batch and i not in static)
        names = tuple(type(args[i]).__name__ for i in graph)
        if (graph, names) not in steps:
            steps[graph, names] = build(graph, names)
        return graph, steps[graph, names]

    @functools.wraps(step_fn)
    def step(*args):
        graph, jitted = built(args)
        out, objects = jitted(*args)
        for i, new in zip(graph, objects, strict=True):
            nnx.update(args[i], nnx.state(new))
        return out

    def lower(*args):
        """Lowers the step for ``args`` as ``jax.jit``'s ``lower`` (updates nothing)."""
        return built(args)[1].lower(*args)

    step.lower = lower
    return step

