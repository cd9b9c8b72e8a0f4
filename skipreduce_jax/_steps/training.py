"""Training-loop helpers: local gradients, placement and the ready step.

The pattern (params and optimizer state replicated, the batch sharded over
the data axis, the update inside ``jax.shard_map`` with ``check_vma=True``)::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tx = optax.chain(skip_reduce("data", skip_ratio=0.5), optax.adamw(1e-3))
    params = replicate(params, mesh)
    opt_state = init_opt_state(tx, params, mesh, "data")
    step = make_train_step(loss_fn, tx, mesh, "data")
    for batch in batches:
        params, opt_state, loss = step(params, opt_state,
                                       shard_batch(batch, mesh, "data"))

Inside the step, :func:`local_value_and_grad` casts the replicated params to
varying first, so autodiff does not sum the gradients over the data axis:
``skip_reduce`` is then the only reduction. For a step of your own (aux
outputs, keys, a flax ``TrainState``), see :func:`data_parallel`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.guards import leaf_agreement
from skipreduce_jax._optax.multisteps import check_owner, place_accumulators
from skipreduce_jax._optax.per_rank import per_rank_leaves, per_rank_names
from skipreduce_jax._optax.transform import SkipReduceState
from skipreduce_jax._steps.parallel import (
    as_tuple,
    build_step,
    check_batch,
    copy_to,
    data_spec,
    markers,
    mesh_axes,
    place_batch,
    replicated_sharding,
)
from skipreduce_jax._steps.replay import replay, trace
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import cast_varying, varying_axes, vma_checked

AxisNames = str | tuple[str, ...]


def to_varying(tree: PyTree, axis_name: AxisNames) -> PyTree:
    """Types ``tree`` as varying over ``axis_name`` (no data moves).

    Inside ``shard_map`` with ``check_vma=True``, the gradient with respect to
    a replicated value is summed over the mesh axis by autodiff; with respect
    to a varying one it stays local. Leaves already varying are left alone;
    with ``check_vma=False`` nothing changes.
    """
    axes = as_tuple(axis_name)
    if not vma_checked(axes[0]):
        return tree
    return jax.tree_util.tree_map(lambda leaf: cast_varying(leaf, axes), tree)


def local_value_and_grad(
    fun: Callable[..., jax.Array | tuple[jax.Array, PyTree]],
    axis_name: AxisNames,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` that returns this rank's LOCAL gradients.

    ``fun`` runs as written. If JAX refuses its layouts inside the per-rank
    step (a ``with_sharding_constraint`` naming a data axis, flax's
    partitioned ``DenseGeneral``), it is traced as plain jit code on this
    rank's arguments and replayed, each constraint without the data axes
    (Auto axes; see docs/design.md).

    Args:
      fun: the loss, as for ``jax.value_and_grad``.
      axis_name: the data axis (or axes) to keep gradients local over.
      argnums: which arguments to differentiate.
      has_aux: as for ``jax.value_and_grad``.

    Returns:
      A function returning ``(value, grads)`` (``((value, aux), grads)`` with
      ``has_aux``), where value and grads are this rank's, not summed.

    Example (inside the step)::

        loss, grads = local_value_and_grad(loss_fn, "data")(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
    """
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def wrapped(*args, **kwargs):
        args = list(args)
        for i in positions:
            _refuse_nnx(args[i])
            args[i] = to_varying(args[i], axis_name)
        return per_rank_value_and_grad(fun, args, kwargs, as_tuple(axis_name),
                                       argnums=argnums, has_aux=has_aux)

    return wrapped


def per_rank_value_and_grad(fun: Callable[..., Any], args: Sequence[Any],
                            kwargs: dict[str, Any], axes: tuple[str, ...], *,
                            argnums: int | Sequence[int], has_aux: bool) -> Any:
    """``jax.value_and_grad(fun)(*args)`` in a per-rank step, as written or replayed.

    Where JAX refuses ``fun`` as written (a ValueError: a layout naming a
    data axis, which is Manual here), it is replayed; if that fails too, the
    first refusal is raised.
    """
    try:
        return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args, **kwargs)
    except ValueError as refused:
        if kwargs:
            raise
        try:
            return jax.value_and_grad(_replayed(fun, args, axes), argnums=argnums,
                                      has_aux=has_aux)(*args)
        except Exception:
            raise refused from None


def _replayed(fun: Callable[..., Any], args: Sequence[Any],
              axes: tuple[str, ...]) -> Callable[..., Any]:
    """``fun`` traced as plain jit code on this rank's ``args`` and replayed."""
    mesh = jax.sharding.get_abstract_mesh()
    traced = trace(fun, args, [any(set(axes) & varying_axes(x)
                                   for x in jax.tree_util.tree_leaves(a)) for a in args],
                   mesh, axes)
    replayed = replay(traced, markers(axes))
    return lambda *a: replayed(*a, traced.consts)


def _refuse_nnx(arg: Any) -> None:
    """Points NNX Modules to the NNX helper (flax is not imported here)."""
    if any(c.__module__.startswith("flax.nnx") for c in type(arg).__mro__):
        raise TypeError(
            f"local_value_and_grad: got a flax NNX {type(arg).__name__}; its "
            "variables cannot be differentiated (or updated) through it as a "
            "plain pytree. Use skipreduce_jax.nnx.local_value_and_grad("
            "loss_fn, axis_name, wrt=nnx.Param), with loss_fn(model, *args).")


def local_grad(
    fun: Callable[..., jax.Array | tuple[jax.Array, PyTree]],
    axis_name: AxisNames,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
    """``jax.grad`` that returns this rank's LOCAL gradients.

    See :func:`local_value_and_grad`; this returns only the gradients (and
    ``aux`` with ``has_aux``).
    """
    value_and_grad = local_value_and_grad(fun, axis_name, argnums=argnums,
                                          has_aux=has_aux)

    def wrapped(*args, **kwargs):
        (value, grads) = value_and_grad(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def state_specs(opt_state: PyTree, axis_name: AxisNames = "data") -> PyTree:
    """PartitionSpecs of an optimizer state for the data-parallel step.

    Everything is replicated (``P()``) except per-rank fields, stored with a
    leading dimension of size N, each rank's row on its own device
    (``P(axis_name)``): those a NamedTuple state names in its
    ``per_rank_fields`` (the ``residual`` of :class:`SkipReduceState`), and
    the ``acc_grads`` of a :class:`MultiSteps` around :func:`skip_reduce`.

    Args:
      opt_state: the state (or its ``jax.eval_shape``).
      axis_name: the data axis; a tuple ``(outer, inner)`` for hierarchical
        SkipReduce, whose residuals vary over both.

    Returns:
      A pytree of ``PartitionSpec`` with the structure of ``opt_state``.
    """
    per_rank_spec = data_spec(as_tuple(axis_name))
    return jax.tree_util.tree_map(lambda name: per_rank_spec if name else P(),
                                  per_rank_names(opt_state))


def replicate(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
    """Copies every leaf onto every device of ``mesh`` (``P()``).

    The copy never aliases ``tree``, so the step may donate it. In a
    multi-process job every process must pass the same values.
    """
    return jax.tree_util.tree_map(
        lambda x: copy_to(x, replicated_sharding(x, mesh)), tree)


def shard_params(params: PyTree, mesh: jax.sharding.Mesh,
                 axis_name: AxisNames = "data") -> PyTree:
    """Shards params over the data axis by rows: FSDP / ZeRO's layout.

    A leaf whose leading dimension divides by the axis size is split along
    it (``P(axis_name)``: each device holds 1/N); others (scalars, biases
    of other lengths) are replicated. Train them with
    ``skip_reduce(..., params_sharded=True)`` and :func:`make_train_step`:
    the loss sees whole params (gathered in the forward pass), and the
    optimizer runs on each device's blocks. A leaf already sharded over
    other mesh axes keeps that layout on its other dimensions.

    ``axis_name=(outer, inner)`` shards over both (``P((outer, inner))``)
    for ``skip_reduce(outer, inner_axis=inner, params_sharded=True)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from skipreduce_jax import shard_params
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> p = shard_params({"w": jnp.zeros((16, 4)), "b": jnp.zeros(3)}, mesh)
      >>> p["w"].sharding.spec, p["b"].sharding.spec
      (P('data',), P(None,))
    """
    axes = mesh_axes(mesh, axis_name, api="shard_params")
    if len(axes) > 2:
        raise ValueError(f"shard_params: axis_name={axis_name!r} must name one "
                         "mesh axis, or two (outer, inner) for hierarchical "
                         "SkipReduce.")
    n = math.prod(mesh.shape[a] for a in axes)

    def place(x):
        if np.ndim(x) and np.shape(x)[0] % n == 0:
            return copy_to(x, NamedSharding(mesh, data_spec(axes)))
        return copy_to(x, replicated_sharding(x, mesh))

    return jax.tree_util.tree_map(place, params)


def shard_batch(batch: PyTree, mesh: jax.sharding.Mesh,
                axis_name: AxisNames = "data") -> PyTree:
    """Splits a batch's leading axis over ``axis_name``.

    A tuple splits it over several axes in order, e.g. ``("replica",
    "fsdp")``. In a multi-process run each process passes its own part of
    the global batch; in one process the whole batch.
    """
    axes = mesh_axes(mesh, axis_name, api="shard_batch")
    check_batch(batch, math.prod(mesh.shape[a] for a in axes), axes, api="shard_batch",
                name="batch", or_else="place that leaf with skipreduce_jax.replicate instead")
    return jax.tree_util.tree_map(lambda x: place_batch(x, mesh, axes), batch)


def init_opt_state(tx: optax.GradientTransformation, params: PyTree,
                   mesh: jax.sharding.Mesh, axis_name: AxisNames = "data") -> PyTree:
    """Runs ``tx.init`` so each part of the state lands where the step wants it.

    It also checks, as :func:`check_settings_agree`, that every device built
    :func:`skip_reduce` with the same seed and settings.

    ``tx`` may be :class:`MultiSteps` around it: each rank then accumulates
    its LOCAL gradients in ``acc_grads`` (one row per rank, like the
    error-feedback residuals) and the wrapped optimizer, ring included, runs
    once per k micro-steps. optax's own ``MultiSteps`` around
    ``skip_reduce`` is refused. A ``should_skip_update_fn`` sees each rank's
    gradient; a micro-step is skipped on every rank if any rank's says so,
    and ``skip_state`` holds the largest value over the ranks.

    Args:
      tx: the optimizer (containing :func:`skip_reduce`), or a
        :class:`MultiSteps` around it.
      params: replicated params.
      mesh: the device mesh.
      axis_name: the data axis, as for :func:`state_specs`.

    Returns:
      The state, placed according to :func:`state_specs`.

    Raises:
      ValueError: if the seed or the settings differ between devices, or a
        ``MultiSteps`` around ``skip_reduce`` is optax's class or not ``tx``
        itself (made by ``.gradient_transformation()``, inside ``optax.chain``).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import skipreduce_jax as sr
      >>> from skipreduce_jax import init_opt_state, replicate, state_specs
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> tx = sr.MultiSteps(optax.chain(
      ...     sr.skip_reduce("data", num_skip=0), optax.sgd(0.1)), 4)
      >>> params = replicate({"w": jnp.zeros(3)}, mesh)
      >>> opt_state = init_opt_state(tx, params, mesh, "data")
      >>> opt_state.acc_grads["w"].shape  # one accumulator row per rank
      (8, 3)
      >>> state_specs(opt_state).acc_grads
      {'w': P('data',)}
    """
    axes = mesh_axes(mesh, axis_name, api="init_opt_state")

    def local_init(params):
        state = place_accumulators(tx.init(params), axes)
        _check_per_rank_axes(state, axes, mesh.axis_names)
        return state

    opt_state = build_step(local_init, mesh, axes, batch_argnums=(),
                           static_argnums=(), donate_argnums=(),
                           api="init_opt_state", manual_axes="unsharded")(params)
    check_owner(tx, opt_state, api="init_opt_state")
    check_settings_agree(opt_state, mesh)
    return opt_state


def check_settings_agree(opt_state: PyTree, mesh: jax.sharding.Mesh) -> None:
    """Raises if the :func:`skip_reduce` seed or settings differ by device.

    Args:
      opt_state: a state holding one or more :class:`SkipReduceState`.
      mesh: the mesh the state lives on.

    Raises:
      ValueError: naming what differs (the seed or the settings).
    """
    nodes = [n for n in jax.tree_util.tree_leaves(
        opt_state, is_leaf=lambda n: isinstance(n, SkipReduceState))
             if isinstance(n, SkipReduceState)]
    if not nodes:
        return
    shared = [(n.key, n.fingerprint) for n in nodes]
    flags = jax.jit(jax.shard_map(
        lambda t: leaf_agreement(t, tuple(mesh.axis_names)), mesh=mesh,
        in_specs=P(), out_specs=P(), check_vma=False))(shared)
    for key_ok, settings_ok in flags:
        if not bool(settings_ok):
            raise ValueError(
                "skip_reduce settings (num_skip/skip_ratio, randomize, "
                "balanced, min_size, warmup_steps, error_feedback, ...) differ "
                "between devices or processes. Every process must build the "
                "optimizer with the same arguments.")
        if not bool(key_ok):
            raise ValueError(
                "skip_reduce seed differs between devices or processes: ranks "
                "would drop different contributions. Pass the same seed to "
                "skip_reduce on every process.")


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    axis_name: AxisNames = "data",
    *,
    donate: bool = True,
    microbatches: int = 1,
    gather: str = "whole",
) -> Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree, jax.Array]]:
    """Builds the jitted data-parallel training step.

    ``step(params, opt_state, batch) -> (params, opt_state, loss)``: each
    rank computes local gradients of ``loss_fn(params, local_batch)``,
    ``tx`` (with :func:`skip_reduce` first) averages them, and the update is
    applied. Params stay replicated and bit-identical on every device; the
    returned loss is the mean over ranks. It is :func:`data_parallel` of
    that step; write your own with :func:`data_parallel` for auxiliary
    outputs, a key, a flax ``TrainState`` or NNX objects.

    ``microbatches=m`` averages the local gradients of m equal pieces of
    each rank's batch (a ``lax.scan``), then runs ``tx`` once. To accumulate
    over calls instead, use :class:`MultiSteps` (see :func:`init_opt_state`).

    FSDP (params placed by :func:`shard_params`, ``skip_reduce(...,
    params_sharded=True)``): the loss sees whole params. ``gather="whole"``
    keeps every gathered block for the backward pass (the whole model plus
    the activations at the peak). ``gather="per_leaf"`` gathers each leaf
    again in the backward pass (``jax.checkpoint`` recomputes only the
    gathers, as PyTorch FSDP's ``reshard_after_forward``): the peak can drop
    to about one leaf's gathered copy plus the activations, if the
    compiler's schedule allows (README, "FSDP over the data axis"). With
    ``num_skip > 0`` give ``skip_reduce`` a ``bucket_bytes`` no larger than
    a leaf. Without FSDP-sharded params ``"per_leaf"`` changes nothing.

    Args:
      loss_fn: ``(params, batch) -> scalar`` on one rank's part of the batch.
      tx: the optimizer.
      mesh: the device mesh (other axes than ``axis_name`` see replicated
        params and the same batch shard).
      axis_name: the data axis, as for :func:`data_parallel`.
      donate: donate params and state buffers to the step.
      microbatches: pieces each rank's batch is split into (evenly).
      gather: ``"whole"`` or ``"per_leaf"`` (see above).

    Returns:
      The jitted step (with ``lower`` as ``jax.jit``'s). On simulated CPU
      devices read a result (e.g. ``float(loss)``) at least every few dozen
      steps, or XLA's in-process collectives time out.

    Raises:
      ValueError: if ``axis_name`` is not an axis of ``mesh``, or (at the
        first call) if ``tx`` leaves the gradients unreduced.
    """
    axes = mesh_axes(mesh, axis_name, api="make_train_step")
    donate = checks.check_bool(donate, "donate", api="make_train_step")
    microbatches = checks.check_int(microbatches, "microbatches", api="make_train_step",
                                    minimum=1, type_error=ValueError)
    gather = checks.check_choice(gather, "gather", _GATHER_MODES, api="make_train_step")
    per_leaf = gather == "per_leaf"
    value_and_grad = local_value_and_grad(
        _regathering(loss_fn, axes) if per_leaf
        else lambda whole, _blocks, batch: loss_fn(whole, batch), axes)

    def local_value_and_grads(whole, blocks, batch):
        if microbatches == 1:
            return value_and_grad(whole, blocks, batch)
        pieces = jax.tree_util.tree_map(_split(microbatches), batch)
        first = jax.tree_util.tree_map(lambda x: x[0], pieces)
        rest = jax.tree_util.tree_map(lambda x: x[1:], pieces)

        def add(total, piece):
            return jax.tree_util.tree_map(
                jnp.add, total, value_and_grad(whole, blocks, piece)), None

        total, _ = lax.scan(add, value_and_grad(whole, blocks, first), rest)
        return jax.tree_util.tree_map(lambda x: x / microbatches, total)

    def local_step(params, opt_state, batch):
        whole = jax.tree_util.tree_map(
            lambda p: _stand_in(p, axes) if per_leaf else _gather_block(p, axes), params)
        loss, grads = local_value_and_grads(whole, params, batch)
        check_owner(tx, opt_state, api="make_train_step")
        updates, opt_state = tx.update(grads, opt_state, params)
        _check_reduced(updates, axes, params)
        return (optax.apply_updates(params, updates), opt_state,
                lax.pmean(loss, axes))

    return build_step(local_step, mesh, axes, batch_argnums=2,
                      static_argnums=(), donate_argnums=(0, 1) if donate else (),
                      api="make_train_step", manual_axes="unsharded")


_GATHER_MODES = {
    "whole": "every FSDP block gathered once, kept for the backward pass",
    "per_leaf": "each gathered again in the backward pass",
}
_GATHERED = "skipreduce_fsdp_gathered"


def _is_block(param: jax.Array, axes: tuple[str, ...]) -> bool:
    """Is ``param`` this rank's block over the data axes (FSDP)?"""
    vary = varying_axes(param)
    if axes[0] not in vary:
        return False
    if any(a not in vary for a in axes):
        raise ValueError(
            f"make_train_step: a param of local shape {param.shape} is sharded "
            f"over {axes[0]!r} but not over every axis of axis_name={axes}. "
            f"For FSDP with hierarchical SkipReduce shard it over all of them "
            f"(shard_params(params, mesh, {axes})).")
    return True


def _gather_block(param: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """A param whole: gathered if it is this rank's block over the data axes."""
    if not _is_block(param, axes):
        return param
    return lax.all_gather(param, axes if len(axes) > 1 else axes[0], tiled=True)


def _stand_in(param: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Zeros shaped like a block's whole param (never filled), else ``param``."""
    if not _is_block(param, axes):
        return param
    shape = (param.shape[0] * math.prod(lax.axis_size(a) for a in axes),) + param.shape[1:]
    return cast_varying(jnp.zeros(shape, param.dtype), axes)


def _regathering(loss_fn: Callable[[Any, Any], jax.Array],
                 axes: tuple[str, ...]) -> Callable[..., jax.Array]:
    """``loss_fn`` on blocks gathered one by one, and again for the backward."""
    def policy(prim, *_, **params):
        if prim.name == "name":
            return params.get("name") != _GATHERED
        return not (prim.name == "all_gather"
                    and params.get("axis_name") == axes)

    def loss(stand_ins, blocks, batch):
        def whole(stand_in, block):
            if not _is_block(block, axes):
                return stand_in
            gathered = _gather_block(block, axes)
            return _grad_into(checkpoint_name(gathered, _GATHERED), stand_in)
        return loss_fn(jax.tree_util.tree_map(whole, stand_ins, blocks), batch)

    return jax.checkpoint(loss, policy=policy)


@jax.custom_vjp
def _grad_into(value: jax.Array, stand_in: jax.Array) -> jax.Array:
    """``value``, whose gradient goes to ``stand_in`` (no sum over the axis)."""
    del stand_in
    return value


_grad_into.defvjp(lambda value, stand_in: (value, None),
                  lambda _, cotangent: (None, cotangent))


def _check_reduced(updates: Any, axes: tuple[str, ...], params: Any) -> None:
    """Refuses updates that still differ by rank, except FSDP blocks' own."""
    blocks = [axes[0] in varying_axes(p) for p in jax.tree_util.tree_leaves(params)]
    with_paths = jax.tree_util.tree_leaves_with_path(updates)
    if len(blocks) != len(with_paths):
        blocks = [False] * len(with_paths)
    for (path, leaf), block in zip(with_paths, blocks, strict=True):
        varying = [a for a in axes if a in varying_axes(leaf)]
        if not varying or block:
            continue
        where = (f"make_train_step: tx returned an update at "
                 f"{jax.tree_util.keystr(path) or 'the root'} that still "
                 f"varies over {varying}")
        if varying == list(axes[1:2]):  # reduced over the outer axis only
            raise ValueError(
                f"{where}: tx reduces over {axes[0]!r} but not over the "
                f"inner axis of axis_name={axes}. Build "
                f"skip_reduce({axes[0]!r}, inner_axis={axes[1]!r}, ...).")
        raise ValueError(
            f"{where}: the step hands tx each rank's local gradients, and tx "
            f"must average them. Put skip_reduce({axes[0]!r}, ...) first in "
            f"the optax.chain (a plain all-reduce baseline is "
            f"skip_reduce({axes[0]!r}, num_skip=0, min_size=0)).")


def _split(microbatches: int) -> Callable[[jax.Array], jax.Array]:
    def split(x):
        if np.ndim(x) == 0 or x.shape[0] % microbatches:
            raise ValueError(
                f"make_train_step: a batch leaf of local shape {np.shape(x)} "
                f"does not split into microbatches={microbatches} equal "
                "pieces along its leading dimension.")
        return x.reshape((microbatches, -1) + x.shape[1:])
    return split


def _check_per_rank_axes(opt_state: Any, axes: tuple[str, ...],
                         mesh_axes: Sequence[str]) -> None:
    """Refuses per-rank state that varies over more axes than ``axes``."""
    for name, leaf in per_rank_leaves(opt_state):
        vary = varying_axes(leaf)
        extra = [a for a in mesh_axes if a in vary and a not in axes]
        if extra:
            both = tuple(a for a in mesh_axes if a in vary or a in axes)
            raise ValueError(
                f"init_opt_state: the per-rank field {name!r} varies over "
                f"{[a for a in mesh_axes if a in vary]}, but axis_name="
                f"{axes if len(axes) > 1 else axes[0]!r} leaves out {extra}. "
                "With hierarchical SkipReduce pass axis_name=(outer, inner), "
                f"e.g. {both}, here and to make_train_step, shard_batch and "
                "state_specs.")
