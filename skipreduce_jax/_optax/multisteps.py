"""``MultiSteps``: optax's gradient accumulation, one reduction per update.

Around ``skip_reduce``, optax's ``MultiSteps`` would run the ring on every
micro-step, over an accumulator built by ``tx.init`` the same on every rank.
:class:`MultiSteps` holds optax's class (its public methods only) and
has another ``update``:

- ``acc_grads`` is per-rank state: one row per rank (a leading axis of size
  1 inside ``shard_map``, stacked along the data axes outside), placed by
  ``init_opt_state``, ``state_specs`` and ``data_parallel`` like the
  error-feedback residuals, in the params' layout over other mesh axes;
- the wrapped optimizer, and so the ring, runs inside a ``lax.cond`` taken
  on the micro-step that applies the update. The state is optax's
  ``MultiStepsState``, and each applied update is optax's for the mean of
  the ranks' gradients.

A plain ``optax.MultiSteps`` around ``skip_reduce`` is refused where its
state is built (``init_opt_state``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from skipreduce_jax._checks import check_int
from skipreduce_jax._optax.per_rank import per_rank_fields, per_rank_zeros
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import cast_varying, varying_axes, vma_checked


def is_local_accumulator(node: Any) -> bool:
    """Whether ``node`` is a ``MultiStepsState`` summing local gradients."""
    return isinstance(node, optax.MultiStepsState) and bool(per_rank_fields(node))


def place_accumulators(opt_state: Any, axes: tuple[str, ...]) -> Any:
    """``opt_state`` with each local accumulator made one row per rank.

    Runs where ``tx.init`` does in ``init_opt_state`` (inside ``shard_map``).
    """
    def place(node):
        if not is_local_accumulator(node):
            return node
        return node._replace(acc_grads=jax.tree_util.tree_map(
            lambda a: per_rank_zeros(jnp.shape(a), a.dtype, axes), node.acc_grads))

    return jax.tree_util.tree_map(place, opt_state, is_leaf=is_local_accumulator)


def check_owner(tx: Any, opt_state: Any, *, api: str) -> None:
    """Refuses local accumulators that ``tx``'s own update cannot reach.

    Raises:
      ValueError: if ``opt_state`` holds a local accumulator and ``tx`` is not
        a :class:`MultiSteps` whose own state it is (optax's class, or one made
        by ``.gradient_transformation()`` or put inside ``optax.chain``).
    """
    nodes = [n for n in jax.tree_util.tree_leaves(opt_state, is_leaf=is_local_accumulator)
             if is_local_accumulator(n)]
    if not nodes:
        if api == "make_train_step" and isinstance(opt_state, optax.MultiStepsState):
            raise ValueError(
                f"{api}: the optimizer is a MultiSteps whose chain holds no skip_reduce. "
                "make_train_step's gradients are each rank's own and skip_reduce is what "
                "reduces them: put it first in the chain, e.g. skipreduce_jax.MultiSteps("
                "optax.chain(skip_reduce(axis_name, ...), optax.sgd(...)), k).")
        return
    own = len(nodes) == 1 and nodes[0] is opt_state
    if own and isinstance(tx, MultiSteps):
        return
    if own and isinstance(tx, optax.MultiSteps):
        raise ValueError(
            f"{api}: the optimizer is an optax.MultiSteps around skip_reduce. optax's "
            "update would run the ring on every micro-step over a replicated accumulator; "
            "use skipreduce_jax.MultiSteps, optax's class with the same arguments and "
            "state, whose ranks accumulate their local gradients and reduce once per "
            "update: tx = skipreduce_jax.MultiSteps(optax.chain(skip_reduce(...), ...), k).")
    raise ValueError(
        f"{api}: the optimizer holds a MultiSteps around skip_reduce that is not the "
        "optimizer itself (made by .gradient_transformation(), or inside optax.chain). "
        "Each rank accumulates its local gradients, and only the MultiSteps object's own "
        "update can reduce them once per accumulated step: pass the MultiSteps object as "
        "the optimizer, e.g. tx = skipreduce_jax.MultiSteps(optax.chain(skip_reduce(...), "
        "...), k), or accumulate with make_train_step(..., microbatches=k).")


class MultiSteps:
    """``optax.MultiSteps`` whose ranks accumulate locally and reduce once.

    The same arguments, state (``optax.MultiStepsState``) and use as optax's
    class; around ``skip_reduce`` (built with :func:`init_opt_state`) each
    rank sums its own gradients and the wrapped optimizer, with its ring,
    runs once per ``every_k_schedule`` micro-steps. Around anything else it
    is optax's ``MultiSteps``, which it holds and calls.

    Args:
      opt: the wrapped optimizer, e.g. ``optax.chain(skip_reduce(...), ...)``.
      every_k_schedule: micro-steps per update: a positive int, or a function
        of the update count (``state.gradient_step``) returning one.
      use_grad_mean: average the accumulated gradients (optax's default);
        ``False`` sums them.
      should_skip_update_fn: optax's ``(updates, gradient_step, params) ->
        (bool scalar, state)``; a micro-step any rank rejects is rejected on
        every rank.
      **optax_options: further keywords of ``optax.MultiSteps`` (e.g.
        ``accumulator_dtype``), passed to it.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import skipreduce_jax as sr
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> tx = sr.MultiSteps(optax.chain(
      ...     sr.skip_reduce("data", num_skip=0), optax.sgd(0.1)), 4)
      >>> params = sr.replicate({"w": jnp.zeros(3)}, mesh)
      >>> sr.init_opt_state(tx, params, mesh, "data").acc_grads["w"].shape
      (8, 3)
    """

    def __init__(self, opt: optax.GradientTransformation,
                 every_k_schedule: int | Callable[[jax.Array], jax.Array],
                 use_grad_mean: bool = True,
                 should_skip_update_fn: optax.ShouldSkipUpdateFunction | None = None,
                 **optax_options: Any):
        if not callable(every_k_schedule):
            check_int(every_k_schedule, "every_k_schedule", api="MultiSteps", minimum=1,
                      allowed="a positive int (or a schedule: a function of the gradient step)")
        self._optax = optax.MultiSteps(opt, every_k_schedule, use_grad_mean,
                                       should_skip_update_fn, **optax_options)
        self.inner_opt = optax.with_extra_args_support(opt)
        self.every_k_schedule = every_k_schedule
        self.use_grad_mean = use_grad_mean
        self.should_skip_update_fn = should_skip_update_fn or _never_skip

    def init(self, params: PyTree) -> optax.MultiStepsState:
        """Optax's state; :func:`init_opt_state` places its accumulators per rank."""
        return self._optax.init(params)

    def has_updated(self, state: optax.MultiStepsState) -> jax.Array:
        """Whether the last ``update`` applied the wrapped optimizer."""
        return self._optax.has_updated(state)

    def gradient_transformation(self) -> optax.GradientTransformation:
        """``init`` and ``update`` as an ``optax.GradientTransformation``."""
        return optax.GradientTransformation(self.init, self.update)

    def update(self, updates: PyTree, state: optax.MultiStepsState, params: PyTree | None = None,
               **extra_args: Any) -> tuple[PyTree, optax.MultiStepsState]:
        """Optax's update, with local accumulators and one reduction per step."""
        if not is_local_accumulator(state):
            return self._optax.update(updates, state, params, **extra_args)
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        rows = treedef.flatten_up_to(state.acc_grads)
        axes = _accumulator_axes(rows)
        _check_rows(leaves, rows, axes)
        k_steps = (self.every_k_schedule(state.gradient_step) if callable(self.every_k_schedule)
                   else self.every_k_schedule)
        skip, skip_state = self.should_skip_update_fn(updates, state.gradient_step, params)
        if (skip.dtype, skip.shape) != (jnp.bool_, ()):
            raise ValueError(
                "MultiSteps: should_skip_update_fn must return a boolean scalar "
                f"array, but it returned one of dtype {skip.dtype} and shape {skip.shape}.")
        # Each rank judged its own gradient: skip everywhere if any rank says so.
        skip, skip_state = jax.tree_util.tree_map(lambda x: _agree(x, axes), (skip, skip_state))
        n = state.mini_step  # optax's accumulation: a running mean (Welford) or a sum
        acc = treedef.unflatten([r[0] + (g - r[0]) / (n + 1) if self.use_grad_mean else g + r[0]
                                 for g, r in zip(leaves, rows, strict=True)])
        emit = state.mini_step == k_steps - 1

        def apply(acc, inner):  # the ring runs here, once per k micro-steps
            out, new = self.inner_opt.update(optax.tree.cast_like(acc, updates), inner,
                                             params=params, **extra_args)
            return out, jax.tree_util.tree_map(lambda n, s: n.astype(s.dtype), new, inner)

        shapes, _ = jax.eval_shape(apply, acc, state.inner_opt_state)

        def hold(acc, inner):
            return jax.tree_util.tree_map(_zeros, shapes), inner

        new_updates, inner = lax.cond(emit & ~skip, apply, hold, acc, state.inner_opt_state)
        next_step = optax.safe_increment(state.mini_step) % k_steps
        acc_rows = jax.tree_util.tree_map(
            lambda a, r: jnp.where(skip, r, jnp.where(emit, 0, a[None])).astype(r.dtype),
            acc, state.acc_grads)
        return new_updates, optax.MultiStepsState(
            mini_step=jnp.where(skip, state.mini_step, next_step),
            gradient_step=jnp.where(emit & ~skip, optax.safe_increment(state.gradient_step),
                                    state.gradient_step),
            inner_opt_state=inner,
            acc_grads=acc_rows,
            skip_state=skip_state)


def _never_skip(*_: Any, **__: Any) -> tuple[jax.Array, tuple[()]]:
    return jnp.array(False), ()


def _accumulator_axes(rows: list[jax.Array]) -> tuple[str, ...]:
    """The data axes: those the per-rank accumulator rows vary over."""
    axes = sorted(set().union(*(varying_axes(r) for r in rows))) if rows else []
    if not axes:
        raise ValueError(
            "MultiSteps around skip_reduce: the accumulated gradients (acc_grads) are not typed "
            "per rank. Call the update inside the library's steps (make_train_step, "
            "data_parallel, skipreduce_jax.nnx) or a jax.shard_map with check_vma=True, and "
            "build the state with skipreduce_jax.init_opt_state(tx, params, mesh).")
    return tuple(axes)


def _agree(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x``'s largest value over the ranks it differs on (``any`` for bools)."""
    over = tuple(a for a in axes if a in varying_axes(x)) if vma_checked(axes[0]) else axes
    if not over:
        return x
    if x.dtype == jnp.bool_:
        return lax.pmax(x.astype(jnp.int32), over) > 0
    return lax.pmax(x, over)


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of ``shape``, typed varying where its type says so."""
    mat = getattr(shape, "manual_axis_type", None)
    axes = tuple(sorted(mat.varying)) if mat is not None else ()
    return cast_varying(jnp.zeros(shape.shape, shape.dtype), axes)


def _check_rows(leaves: list[jax.Array], rows: list[jax.Array],
                axes: tuple[str, ...]) -> None:
    """Refuses an accumulator that is not one row of this rank's own."""
    local = vma_checked(axes[0])
    for g, r in zip(leaves, rows, strict=True):
        invariant = local and axes[0] not in varying_axes(r)
        if tuple(r.shape) == (1,) + tuple(g.shape) and not invariant:
            continue
        raise ValueError(
            "optax.MultiSteps around skip_reduce: the accumulated gradients (acc_grads) of "
            f"a gradient of shape {tuple(g.shape)} have local shape {tuple(r.shape)}"
            + (f", replicated (invariant) over {axes[0]!r}" if invariant else "")
            + f"; each rank needs one row of its own, {(1,) + tuple(g.shape)}. The state "
            "was made by tx.init (the same accumulator on every rank) or for other params. "
            "Build it with skipreduce_jax.init_opt_state(tx, params, mesh) (with NNX, "
            "skipreduce_jax.nnx.init_optimizer(model, tx, mesh)).")
