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

Batch statistics must be reduced over the data axis
(``nnx.BatchNorm(..., axis_name="data")``), and metrics updated in the step
must see reduced values (``lax.pmean``): the step refuses state that still
differs per rank, naming it. With Explicit mesh axes (``jax.make_mesh``),
mix the step's outputs with new arrays (``nnx.MultiMetric.update`` outside
the step) under ``jax.set_mesh(mesh)``. Or keep flax's own ``nnx.jit`` step and use
:func:`value_and_grad` in place of ``nnx.value_and_grad``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import optax
from flax import nnx
from flax.nnx.filterlib import Filter
from flax.nnx.training.optimizer import to_opt_state

from skipreduce_jax import _checks as checks
from skipreduce_jax._ring.config import SkipConfig, SkipOptions
from skipreduce_jax._ring.shards import spec_axes
from skipreduce_jax._steps.grad import build
from skipreduce_jax._steps.parallel import AxisNames, as_tuple, build_step, positions, rank_key
from skipreduce_jax._steps.training import init_opt_state, per_rank_value_and_grad, to_varying
from skipreduce_jax._types import PyTree

__all__ = ["data_parallel", "init_optimizer", "local_value_and_grad", "value_and_grad"]


def local_value_and_grad(
    loss_fn: Callable[..., jax.Array | tuple[jax.Array, PyTree]],
    axis_name: AxisNames = "data",
    *,
    wrt: Filter = nnx.Param,
    has_aux: bool = False,
    rank_rngs: bool = True,
) -> Callable[..., Any]:
    """``nnx.value_and_grad`` of a Module that returns LOCAL gradients.

    As :func:`skipreduce_jax.local_value_and_grad`, of the model's ``wrt``
    variables; other state the loss updates (BatchNorm statistics, RNG
    counters) is written back to the model. With ``rank_rngs`` each rank
    folds its index into the model's RNG keys for the call
    (:func:`skipreduce_jax.rank_key`), so ``nnx.Dropout`` draws its own mask
    on every rank; build keys passed as arguments with ``rank_key(key, axis_name)``.
    Call it inside the step, on a model the step received as an argument.

    Args:
      loss_fn: ``loss_fn(model, *args)``, returning a scalar (``(loss, aux)``
        with ``has_aux``).
      axis_name: the data axis, or ``(outer, inner)``.
      wrt: the ``nnx`` filter of the variables to differentiate.
      has_aux: as for ``nnx.value_and_grad``.
      rank_rngs: kept for the optax route's signature; here the draws are
        the global batch's whatever it is.

    Returns:
      ``f(model, *args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), where ``grads`` is an ``nnx.State`` of this rank's
      gradients, ready for ``optimizer.update(model, grads)``.
    """
    axes = as_tuple(axis_name)
    rank_rngs = checks.check_bool(rank_rngs, "rank_rngs",
                                  api="skipreduce_jax.nnx.local_value_and_grad")

    def differentiate(pure, params, others, args):
        return per_rank_value_and_grad(
            pure, (to_varying(params, axes), others, *args), {}, axes, argnums=0,
            has_aux=True)

    return _on_model(loss_fn, wrt, axes, has_aux, rank_rngs, differentiate)


def _on_model(loss_fn: Callable[..., Any], wrt: Any, axes: tuple[str, ...], has_aux: bool,
              rank_rngs: bool, differentiate: Callable[..., Any]) -> Callable[..., Any]:
    """``f(model, *args)``: ``differentiate(pure, params, others, args)`` of the model's states.

    ``pure(params, others, *args)`` returns ``(loss, (aux, rest))``; ``rest``,
    the state the loss updates, is written back. With ``rank_rngs`` the RNG
    keys are folded with the rank's index for the call (not written back).
    """
    filters = (wrt, nnx.RngKey, ...) if rank_rngs else (wrt, ...)

    def wrapped(model, *args):
        args_in = args
        graphdef, params, *others = nnx.split(model, *filters)
        # Other NNX objects among the arguments (an nnx.Rngs passed to the
        # loss): their states are arguments too, and what the loss changes
        # in them (RNG counts) is written back, as nnx.value_and_grad does.
        nodes = [nnx.split(a) if isinstance(a, nnx.Pytree) else None for a in args]
        args = tuple(a if n is None else n[1] for a, n in zip(args, nodes, strict=True))

        # The states are arguments, so that the model merged inside the
        # differentiated function is this trace's own and may be mutated.
        def pure(params, others, *args):
            if rank_rngs:
                keys = jax.tree_util.tree_map(lambda k: rank_key(k, axes), others[0])
                others = (keys, *others[1:])
            local = nnx.merge(graphdef, params, *others, copy=True)
            objects = [a if n is None else nnx.merge(n[0], a, copy=True)
                       for a, n in zip(args, nodes, strict=True)]
            out = loss_fn(local, *objects)
            loss, aux = out if has_aux else (out, None)
            changed = [None if n is None else nnx.state(o)
                       for o, n in zip(objects, nodes, strict=True)]
            return loss, (aux, (nnx.split(local, *filters)[-1], changed))

        (loss, (aux, (rest, changed))), grads, *state = differentiate(
            pure, params, tuple(others), args)
        nnx.update(model, rest)
        for a, written in zip(args_in, changed, strict=True):
            if written is not None:
                nnx.update(a, written)
        return (((loss, aux) if has_aux else loss), grads, *state)

    return wrapped


def value_and_grad(
    loss_fn: Callable[..., jax.Array | tuple[jax.Array, PyTree]],
    mesh: jax.sharding.Mesh | None = None,
    axis_name: AxisNames | None = None,
    *,
    step: int | jax.Array | optax.MultiStepsState,
    wrt: Filter = nnx.Param,
    has_aux: bool = False,
    batch_argnums: int | Sequence[int] | None = None,
    rank_rngs: bool = True,
    param_specs: PyTree | None = None,
    config: SkipConfig | None = None,
    state: PyTree | None = None,
    **skip_options: Unpack[SkipOptions],
) -> Callable[..., tuple[jax.Array | tuple[jax.Array, PyTree], nnx.State]]:
    """``nnx.value_and_grad`` whose gradient all-reduce is SkipReduce.

    Use it inside your ``nnx.jit`` step in place of ``nnx.value_and_grad``.
    As :func:`skipreduce_jax.value_and_grad`, of the model's ``wrt`` state:
    the loss keeps its meaning on the global batch; the grads are an
    ``nnx.State``. Other state the loss updates (BatchNorm's running
    statistics, the RNG counts) is written back as the global batch makes
    it, and dropout draws the global mask.

    Args:
      loss_fn: ``loss_fn(model, *args)``, written for the global batch.
      mesh: the device mesh; None: the mesh of ``jax.set_mesh``.
      axis_name: the data axis, or ``(outer, inner)``; None: as for
        :func:`skipreduce_jax.value_and_grad`.
      step: the training step (e.g. ``optimizer.step[...]``). Required.
      wrt: the ``nnx`` filter of the variables to differentiate.
      has_aux: as for ``nnx.value_and_grad``.
      batch_argnums: positions in ``loss_fn``'s arguments (the model is 0);
        None: those the layouts split, as :func:`skipreduce_jax.value_and_grad`
        finds them. An ``nnx.Rngs`` argument needs none: it is whole, and the
        counts the loss draws are written back.
      rank_rngs: kept for the optax route's signature; here the draws are
        the global batch's whatever it is.
      param_specs: a prefix of the ``wrt`` state. Params sharded over the
        data axis (FSDP, e.g. ``nnx.Param(..., out_sharding=("data", None))``
        on an Explicit mesh) stay sharded: their grads come back in their
        layouts, reduced by the skipped reduce-scatter.
      config: the skip settings as a :class:`skipreduce_jax.SkipConfig`.
      state: error feedback's state, as for
        :func:`skipreduce_jax.value_and_grad`; ``f.init_state(model)`` makes
        the first one (outside ``nnx.jit``).
      **skip_options: :func:`skipreduce_jax.skip_reduce`'s options.

    Returns:
      ``f(model, *args) -> (value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), ``grads`` an ``nnx.State``; ``(value, grads, state)``
      with ``state``.

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
    rank_rngs = checks.check_bool(rank_rngs, "rank_rngs", api=api)
    given = (None if batch_argnums is None
             else positions(batch_argnums, "batch_argnums", api=api))
    if given is not None and 0 in given:
        raise ValueError(f"{api}: batch_argnums={batch_argnums!r} holds 0, the "
                         "model; count the batch arguments from 1.")

    def differentiate(pure, params, others, args):
        # pure(params, others, *args): the loss's argument i is at i + 1.
        # None: found from the arguments' layouts, as sr.value_and_grad does.
        batch = None if given is None else tuple(i + 1 for i in given)
        specs = param_specs if param_specs is not None else _metadata_specs(params, mesh)
        return build(
            pure, mesh, axis_name, step=step, has_aux=True, argnums=0,
            batch_argnums=batch, param_specs=specs, microbatches=1,
            config=config, skip_options=skip_options,
            describe=lambda i: f"loss_fn's argument {i - 1} (the model is 0)",
            state=state)(params, others, *args)

    def init_state(model):
        """Error feedback's first ``state`` for ``model``'s ``wrt`` variables."""
        return build(loss_fn, mesh, axis_name, step=step, has_aux=has_aux, argnums=0,
                     batch_argnums=None, param_specs=None, microbatches=1, config=config,
                     skip_options=skip_options).init_state(nnx.state(model, wrt))

    # The keys stay as they are: the partitioned loss draws the global batch's bits.
    wrapped = _on_model(loss_fn, wrt, (), has_aux, False, differentiate)
    wrapped.init_state = init_state
    return wrapped


def _metadata_specs(params: Any, mesh: Any) -> Any:
    """The params' layouts from their ``out_sharding`` metadata, on Auto axes.

    Explicit axes show the layouts in the types; Auto axes carry none inside
    ``jax.jit``, so the metadata says which params are sharded (FSDP). None
    where it names no axis, or axes that are not the mesh's (logical names).
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh.empty or all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    specs = nnx.get_partition_spec(params)
    named = {a for s in jax.tree_util.tree_leaves(
                 specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
             if isinstance(s, jax.sharding.PartitionSpec) for a in spec_axes(s)}
    return specs if named and named <= set(mesh.axis_names) else None


def init_optimizer(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    wrt: Filter = nnx.Param,
) -> nnx.Optimizer:
    """``nnx.Optimizer(model, tx, wrt=wrt)`` whose state is built per rank.

    The state comes from :func:`skipreduce_jax.init_opt_state` (per-rank
    rows on their devices, settings checked), not ``tx.init``. Its
    ``update`` passes the paths of the model's ``nnx.BatchNorm`` layers
    (with an ``axis_name``, found by type) to ``skip_reduce`` as
    ``batchnorm_paths=``, which turns its ``exact_radial`` on by default
    (a ``tx`` whose ``update`` takes no extra arguments gets none, and
    BatchNorm layers are then known by their linen names only).

    Args:
      model: the NNX Module.
      tx: the optimizer, ``skip_reduce`` first; or a
        :class:`skipreduce_jax.MultiSteps` around it.
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
    # The BatchNorm layers by type, not by name, for skip_reduce's update.
    norms = [path for path, node in nnx.iter_graph(model)
             if isinstance(node, nnx.BatchNorm) and node.axis_name is not None]
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
    """``tx`` whose update tells ``skip_reduce`` the model's BatchNorm layers.

    Their paths go as the extra argument ``batchnorm_paths``, which
    ``optax.chain`` hands to every transformation that takes extra arguments.
    """
    takes = inspect.signature(tx.update).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in takes):
        return tx  # no extra arguments: linen's names only

    def update(updates, state, params=None, **extra):
        return tx.update(updates, state, params, batchnorm_paths=norms, **extra)

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

    As ``nnx.jit`` does: the NNX objects passed as arguments (neither batch
    nor static) are updated after the call with what ``step_fn`` left in them.

    Args:
      step_fn: the per-rank step, e.g. ``(model, optimizer, batch) -> loss``.
      mesh: the device mesh.
      axis_name: the data axis; ``(outer, inner)`` for hierarchical mode.
      batch_argnums: positions of the arguments split over the data axes.
      static_argnums: positions passed through as Python values.
      donate_argnums: positions whose buffers the step may reuse.

    Returns:
      A callable ``step(*args)`` returning what ``step_fn`` returns; its
      ``lower`` method lowers it as ``jax.jit``'s does.
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

