"""``skip_reduce``: SkipReduce as an optax gradient transformation.

It replaces the data-parallel gradient all-reduce. It runs inside
``jax.shard_map`` (where ``axis_name`` is bound), takes each rank's LOCAL
gradients and returns averaged gradients that are identical on every rank,
so it is the first element of an ``optax.chain``::

    tx = optax.chain(skip_reduce("data", skip_ratio=0.5), optax.adamw(1e-3))

Per step it derives the key from ``seed`` and the step count in its state
(``fold_in``; with balanced schedules, the default, one key per period of
steps and the step's phase in it), so all ranks and processes agree by
construction. Leaves that are not selected for skipping (``selective``),
leaves smaller than ``min_size``, and every leaf during ``warmup_steps`` get
a full ``lax.pmean``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax import gate as _gate
from skipreduce_jax._optax.guards import host_check, leaf_agreement, raise_in_callback
from skipreduce_jax._optax.norms import BatchNormWarning, in_batchnorm, warn_if_batchnorm
from skipreduce_jax._optax.per_rank import check_local, per_rank_zeros
from skipreduce_jax._optax.radial import exact_radial, radial_ok
from skipreduce_jax._ring import collectives as coll
from skipreduce_jax._ring import shards as _shards
from skipreduce_jax._ring.buckets import DEFAULT_BUCKET_BYTES
from skipreduce_jax._ring.config import (
    SKIP_OPTIONS,
    SkipConfig,
    config_or_keywords,
    resolve_num_skip,
    ring_settings,
)
from skipreduce_jax._ring.schedule import (
    balanced_draw,
    ring_period,
    scatter_period,
)
from skipreduce_jax._ring.selection import skippable
from skipreduce_jax._ring.wire import summed_dtype
from skipreduce_jax._types import DTypeLike, PyTree
from skipreduce_jax._vma import pmean_nonempty

_API = "skip_reduce"


class SkipReduceState(NamedTuple):
    """State of :func:`skip_reduce`.

    Attributes:
      count: int32 step counter; the step's key and phase come from it
        (``balanced_draw``: ``fold_in(key, t // L)`` and ``t % L``, L the
        period, ``t = count - warmup_steps``; L = 1 and ``t = count`` with
        ``balanced=False``).
      key: uint32[2] key data made from ``seed``.
      fingerprint: uint32 checksum of the settings (all but ``seed``,
        ``selective`` and ``verify_sync``), so that ranks can check that they
        agree.
      residual: error feedback only (else ``optax.EmptyState()``): what this
        rank's gradient lost to skipping, added back next step. Each leaf has
        a leading axis of size 1 inside ``shard_map`` (one row per rank,
        stacked along the data axis outside; see :func:`state_specs`); a
        leaf that is never skipped (``selective``, ``min_size``) keeps an
        empty row, ``[1, 0]``.
    """

    count: jax.Array
    key: jax.Array
    fingerprint: jax.Array
    residual: PyTree

    # Placed per rank by skipreduce_jax.state_specs.
    per_rank_fields = ("residual",)


@dataclasses.dataclass(frozen=True)
class _Config(SkipConfig):
    """A :class:`SkipConfig` with the mesh axes it reduces over."""

    axis_name: str = "data"
    inner_axis: str | None = None
    # The BatchNorm layers' paths where the caller knows them by type (the
    # NNX helpers pass them to update() as batchnorm_paths=); None: by name.
    batchnorms: tuple[tuple[Any, ...], ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.axis_name, str):
            raise TypeError(f"{_API}: axis_name={self.axis_name!r} must be a mesh axis "
                            "name (str); use inner_axis= for hierarchical mode.")
        checks.check_distinct_axes(self.axis_name, self.inner_axis, api=_API)

    @classmethod
    def of(cls, config: SkipConfig, axis_name: str, inner_axis: str | None) -> _Config:
        return cls(axis_name=axis_name, inner_axis=inner_axis,
                   **{name: getattr(config, name) for name in SKIP_OPTIONS})

    def fingerprint(self) -> int:
        """A checksum of the settings that every rank must share."""
        fields = dataclasses.asdict(self)
        for name in ("seed", "selective", "verify_sync", "batchnorms"):
            fields.pop(name)
        fields["accumulate_dtype"] = str(fields["accumulate_dtype"])
        if fields["comm_dtype"] is None:  # so states saved before it existed match
            fields.pop("comm_dtype")
        else:
            fields["comm_dtype"] = str(fields["comm_dtype"])
        if fields["layout"] == "flat":  # likewise
            fields.pop("layout")
        return zlib.crc32(repr(sorted(fields.items())).encode())

    @property
    def normalize(self) -> str:
        """What divides the skipped sum: N - k summed ranks, or N (error feedback)."""
        return "world" if self.error_feedback else "contributors"

    def resolve_num_skip(self, n: int) -> int:
        return resolve_num_skip(self.num_skip, self.skip_ratio, n, api=_API)

    def radial(self, params: Any) -> bool:
        """Whether ``exact_radial`` applies: as given, or (None) with BatchNorm.

        Error feedback turns it off; ``"auto"`` does not (with BatchNorm it
        stays Random, radial components included).
        """
        if self.exact_radial is not None:
            return self.exact_radial
        return (params is not None and self.error_feedback is not True
                and not self.params_sharded and any(in_batchnorm(params, self.batchnorms)))

    def skippable(self, updates: Any, params: Any) -> list[bool]:
        """One Python bool per leaf: True when the leaf may be skipped."""
        flags = skippable(self.selective, self.min_size, updates, params)
        if self.radial(params):  # a vector's only channel direction is itself
            flags = [f and radial_ok(x) for f, x in
                     zip(flags, jax.tree_util.tree_leaves(updates))]
        return flags


@config_or_keywords
def skip_reduce(
    axis_name: str,
    *,
    config: SkipConfig | None = None,
    num_skip: int | None = None,
    skip_ratio: float | None = None,
    seed: int = 0,
    randomize: bool = True,
    balanced: bool = True,
    selective: PyTree | Callable[[PyTree], PyTree] | None = None,
    min_size: int = 100_000,
    warmup_steps: int = 0,
    error_feedback: bool | str = False,
    exact_radial: bool | None = None,
    inner_axis: str | None = None,
    chunks_per_rank: int | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    accumulate_dtype: DTypeLike | None = None,
    check_finite: bool = False,
    params_sharded: bool = False,
    verify_sync: bool = False,
    comm_dtype: DTypeLike | None = None,
    layout: str = "flat",
) -> optax.GradientTransformationExtraArgs:
    """SkipReduce gradient averaging, in place of the data-parallel all-reduce.

    Give exactly one of ``num_skip`` and ``skip_ratio``. Each option's
    default, when to change it and a recommended value are in
    :ref:`the options table <skip-reduce-options>`, each described in full
    :ref:`below it <skip-reduce-option-details>`; the guides show them in a
    :doc:`jit loop </guides/jit-loop>` and in :doc:`sharded training
    </guides/sharded>`.

    BatchNorm: a skipped leaf that feeds a BatchNorm with statistics over the
    data axis drifts; ``exact_radial`` (on by default there) prevents it, and
    ``init`` warns (:class:`BatchNormWarning`) where nothing does
    (:ref:`skip-reduce-batchnorm`). BatchNorm layers are known by their
    linen names (``BatchNorm_0``), or by the paths ``update`` is given as
    ``batchnorm_paths=`` (the NNX helpers pass those of ``nnx.BatchNorm``).

    Args:
      axis_name: the data-parallel mesh axis (the slow one with
        ``inner_axis``).
      config: all the options below but ``inner_axis``, as one
        :class:`SkipConfig`. Pass none of them as keywords then (refused).
      num_skip: k, the reduce-scatter steps skipped, an int in [0, N - 1].
      skip_ratio: the fraction of the N - 1 reduce-scatter steps to skip,
        rounded half up to k: 0.5 on 8 ranks gives k = 4.
      seed: an int in [0, 2**32), the same on every rank and process; two
        ``skip_reduce`` in one optimizer need different seeds.
      randomize: False is static SkipReduce (biased; for comparison).
      balanced: True balances Random's drops over periods of
        :func:`ring_period` steps; False draws afresh every step (the paper).
      selective: which leaves may be skipped: a pytree of bools, a callable,
        :func:`by_path` or :func:`exclude`.
      min_size: leaves with fewer elements get a full all-reduce; pass 0 for
        small models.
      warmup_steps: a full all-reduce for the first steps, then skipping.
      error_feedback: each rank adds what skipping left out to its next
        step; per-rank state, placed by :func:`state_specs`. ``"auto"``:
        only while a measured rule says so (SGD-type optimizer, steps that
        rarely overshoot, until its steps grow; :class:`FeedbackGateState`);
        it keeps a 256-element sample per leaf of the last params too.
      exact_radial: each output channel's update exact along its weights and
        its mean input; None: on where the params hold a BatchNorm.
      inner_axis: a fast axis summed in full (hierarchical SkipReduce).
      chunks_per_rank: sub-chunks per ring slot, each placed by its own draw
        (see :func:`skip_psum`).
      bucket_bytes: the byte cap of one packed gradient buffer.
      accumulate_dtype: the dtype the sums are added in, e.g.
        ``jnp.float32`` for bfloat16 gradients; it never narrows a leaf.
      check_finite: a NaN or Inf on any rank makes the whole update NaN, for
        ``optax.apply_if_finite`` to skip.
      params_sharded: the params are sharded over ``axis_name`` (FSDP); see
        :doc:`sharded training </guides/sharded>`.
      verify_sync: debugging only: compare the step, key and settings across
        ranks every step and raise if they differ.
      comm_dtype: what the skipped ring sends, e.g. ``jnp.bfloat16`` (half
        the bytes of float32 gradients) or ``jnp.float8_e4m3fn`` (a quarter,
        in blocks of 256 scaled by their largest magnitude, plus a float32
        scale per block). Each hop adds in float32.
      layout: ``"flat"`` (the default) or ``"units"``: how the skipped leaves
        are packed for the ring.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with a
      :class:`SkipReduceState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from skipreduce_jax import skip_reduce
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> tx = optax.chain(skip_reduce("data", skip_ratio=0.5, min_size=0),
      ...                  optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(64)}
      >>> def step(params, local_grads):  # inside jax.shard_map
      ...     opt_state = tx.init(params)  # usually carried across steps
      ...     updates, opt_state = tx.update(local_grads, opt_state, params)
      ...     return optax.apply_updates(params, updates)
      >>> ones = jax.device_put(jnp.ones(8 * 64), NamedSharding(mesh, P("data")))
      >>> grads = {"w": ones}  # each rank's slice: its local gradient
      >>> new = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")),
      ...                             out_specs=P()))(params, grads)
      >>> round(float(new["w"][0]), 6)  # minus lr times the mean of ones
      -0.1

    References:
      Kasan, Abts, Choi, Kim. SkipReduce: (Interconnection) Network
      Sparsity to Accelerate Distributed Machine Learning. MICRO 2025.
    """
    config = _Config.of(config, axis_name, inner_axis)
    if config.error_feedback == "auto":
        return _gated(config)
    warned = []  # the BatchNorm warning, once per transformation

    def init_fn(params):
        return _initial_state(config, params, warned, residual=(
            _residual_rows(config, params) if config.error_feedback else optax.EmptyState()))

    def update_fn(updates, state, params=None, *, batchnorm_paths=None, **extra_args):
        del extra_args
        known = _knowing(config, params, batchnorm_paths, warned)
        return _update(known, updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _gated(config: _Config) -> optax.GradientTransformationExtraArgs:
    """``error_feedback="auto"``: error feedback while ``_gate`` is open, else Random.

    Both branches are the reduction core with a fixed setting; the ranks
    agree on the branch. Where ``exact_radial`` applies (BatchNorm), the
    gate stays shut: error feedback would turn it off.
    """
    feed = dataclasses.replace(config, error_feedback=True)
    warned = []

    def init_fn(params):
        _needs_params(params)
        return _gate.init(_initial_state(config, params, warned,
                                         residual=_residual_rows(feed, params)), params)

    def update_fn(updates, state, params=None, *, batchnorm_paths=None, **extra_args):
        del extra_args
        known = _knowing(config, params, batchnorm_paths, warned)
        return gated_update(known, updates, state, params)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def gated_update(config: _Config, updates: Any, state: _gate.FeedbackGateState, params: Any,
                 specs: list[Any] | None = None) -> tuple[Any, _gate.FeedbackGateState]:
    """``error_feedback="auto"``'s update (``specs`` as for :func:`_update`)."""
    _needs_params(params)
    feed = dataclasses.replace(config, error_feedback=True)
    drop = dataclasses.replace(config, error_feedback=False)

    def dropped():
        out, skip = _update(drop, updates, state.skip, params, specs)
        # Zeros typed as r (an empty residual, a leaf never skipped, as it is).
        return out, skip._replace(residual=jax.tree_util.tree_map(
            lambda r: r if r.size == 0 else jnp.where(True, jnp.zeros((), r.dtype), r),
            skip.residual))

    if drop.radial(params):  # shut for good: the rule is not read
        out, skip = dropped()
        return out, state._replace(skip=skip)
    n, _ = checks.axes_pair(config.axis_name, config.inner_axis, api=_API)
    if config.resolve_num_skip(n) == 0:
        out, skip = dropped()  # nothing to feed back
    else:
        out, skip = lax.cond(_gate.is_open(state, _axes(config)),
                             lambda: _update(feed, updates, state.skip, params, specs),
                             dropped)
    return out, _gate.advance(state, skip, out, params)


def _initial_state(config: _Config, params: Any, warned: list[bool], residual: Any
                   ) -> SkipReduceState:
    """Step 0's state; warns once (``warned``) where Random may skip BatchNorm's inputs.

    That is, where the params hold a BatchNorm and ``exact_radial`` is off.
    """
    if (config.error_feedback is not True and not warned
            and not config.radial(params) and _warn_if_batchnorm(config, params)):
        warned.append(True)
    key = jax.random.key_data(jax.random.key(config.seed))
    return SkipReduceState(jnp.zeros((), jnp.int32), key, jnp.uint32(config.fingerprint()),
                           residual=residual)


def _knowing(config: _Config, params: Any, batchnorm_paths: Any, warned: list[bool]
             ) -> _Config:
    """``config`` told the BatchNorm layers' paths (``update``'s ``batchnorm_paths``).

    The NNX helpers pass them (found by type); ``init`` had only names to go
    by, so the BatchNorm warning, once per transformation, may come here.
    """
    if batchnorm_paths is None:
        return config
    config = dataclasses.replace(config, batchnorms=tuple(tuple(p) for p in batchnorm_paths))
    if (config.error_feedback is not True and not warned and params is not None
            and not config.radial(params) and _warn_if_batchnorm(config, params)):
        warned.append(True)
    return config


def _needs_params(params: Any) -> None:
    if params is None:
        raise ValueError(
            f"{_API}(error_feedback='auto'): its rule reads the params' last step, "
            "but got params=None; call tx.init(params) and "
            "tx.update(grads, state, params) (optax.chain passes them through).")


def _residual_rows(config: _Config, params: Any) -> Any:
    """Zeros, one row per rank, for the leaves that may be skipped.

    Leaves that are never skipped keep nothing: an empty row each. A param
    sharded over the data axis (FSDP) gets a row of its whole local gradient.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    full = jax.tree_util.tree_unflatten(treedef, [
        jax.ShapeDtypeStruct(_gradient_shape(p, config), p.dtype) for p in leaves])
    flags = config.skippable(full, params)
    return jax.tree_util.tree_unflatten(treedef, [
        per_rank_zeros(f.shape if s else (0,), p.dtype, _axes(config))
        for p, f, s in zip(leaves, jax.tree_util.tree_leaves(full), flags)])


def _warn_if_batchnorm(config: _Config, params: Any) -> bool:
    """Warns if skipping may reach leaves feeding a BatchNorm; True if it did."""
    try:
        n, _ = checks.axes_pair(config.axis_name, config.inner_axis, api=_API)
        skipping = config.resolve_num_skip(n) > 0
    except (NameError, ValueError, TypeError):  # init outside shard_map
        skipping = bool(config.num_skip) or bool(config.skip_ratio)
    # An explicit selective is the user's choice of what skips.
    if (not skipping or config.selective is not None
            or not any(in_batchnorm(params, config.batchnorms))):
        return False
    try:
        flags = config.skippable(params, params)
    except (ValueError, TypeError):  # e.g. masked params: update() will check
        return False
    return warn_if_batchnorm(params, flags, api=_API, known=config.batchnorms)


class NothingSkippedWarning(UserWarning):
    """``skip_reduce`` skips no leaf (each below ``min_size`` or excluded)."""


def _axes(config: _Config) -> tuple[str, ...]:
    return (config.axis_name,) + ((config.inner_axis,) if config.inner_axis
                                  else ())


def _check_rows(leaves: list[jax.Array], rows: list[jax.Array],
                skippable: list[bool]) -> None:
    """Refuses residual rows that do not fit the leaves they belong to."""
    for g, r, s in zip(leaves, rows, skippable):
        want = (1,) + tuple(g.shape) if s else (1, 0)
        if tuple(r.shape) != want:
            raise ValueError(
                f"{_API}: the error-feedback residual of a gradient of shape "
                f"{g.shape} has local shape {tuple(r.shape)}, not {want}: the "
                "state was built for other selective/min_size settings or "
                "shapes, or outside shard_map. Build it with "
                "skipreduce_jax.init_opt_state (or tx.init inside shard_map).")


def _check_ring_input(leaves: list[jax.Array], key: jax.Array, phase: jax.Array,
                      axes: tuple[str, ...]) -> None:
    """Refuses what the skipped ring cannot take (before the collectives, which name theirs)."""
    for g in leaves:
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise TypeError(
                f"{_API}: got a gradient of dtype {g.dtype} and shape {g.shape}; "
                "SkipReduce averages floating-point gradients only (float32, "
                "bfloat16, float16). Keep other leaves out of the tree tx updates "
                "(e.g. optax.masked or optax.partition), or split a complex leaf "
                "into its real and imaginary parts.")
    varying = sorted((coll.varying_axes(key) | coll.varying_axes(phase)) & set(axes))
    if varying:
        raise ValueError(
            f"{_API}: the step's key, drawn from the state's key and count, varies "
            f"over {varying}: the SkipReduceState differs per rank, so ranks would "
            "disagree on what to drop. Pass the optimizer state replicated, as "
            "skipreduce_jax.init_opt_state builds and state_specs lays it out "
            "(only per_rank_fields, e.g. error-feedback residuals, hold a row per "
            "rank).")


def _update(config: _Config, updates: Any, state: SkipReduceState, params: Any,
            specs: list[Any] | None = None) -> tuple[Any, SkipReduceState]:
    """The reduction core: local gradients to reduced ones, and the next state.

    ``specs``: the params' layouts over the compiler's axes, one per leaf
    (None: from their types, or from what ``data_parallel`` records).
    """
    n, inner = checks.axes_pair(config.axis_name, config.inner_axis, api=_API)
    num_skip = config.resolve_num_skip(n)
    leaves, treedef = jax.tree_util.tree_flatten(updates)
    check_local(leaves, config.axis_name, config.inner_axis, api=_API)
    skippable = config.skippable(updates, params)
    if num_skip > 0 and leaves and not any(skippable):
        warnings.warn(
            f"{_API}: no leaf may be skipped (each is excluded by selective or "
            f"smaller than min_size={config.min_size}), so every step is a "
            "full all-reduce. For a small model pass e.g. min_size=0.",
            NothingSkippedWarning, stacklevel=2)
    if (config.exact_radial is None and params is None and num_skip > 0
            and not config.error_feedback and any(in_batchnorm(updates, config.batchnorms))):
        warnings.warn(
            f"{_API}: the gradients hold BatchNorm parameters but update() got "
            "params=None, so exact_radial (the remedy for the leaves that feed "
            "a BatchNorm) is off. Call tx.update(grads, state, params).",
            BatchNormWarning, stacklevel=2)
    axes = _axes(config)
    base = jax.random.wrap_key_data(state.key)
    period = ring_period(n, num_skip) if config.balanced else 1
    # Balanced periods start when skipping does, after the warm-up.
    skip_step = (jnp.maximum(state.count - config.warmup_steps, 0)
                 if config.balanced else state.count)
    key, phase = balanced_draw(base, skip_step, period)
    if num_skip > 0:
        _check_ring_input([g for g, s in zip(leaves, skippable) if s], key, phase, axes)
    residuals = (treedef.flatten_up_to(state.residual) if config.error_feedback
                 else None)
    if residuals is not None:
        _check_rows(leaves, residuals, skippable)
        leaves = [g + r[0].astype(g.dtype) if s else g
                  for g, r, s in zip(leaves, residuals, skippable)]
    # Params sharded over the data axis (FSDP) get this rank's block of the
    # mean (a reduce-scatter); the others the all-reduced mean.
    scattered = _scattered(leaves, params, n * inner, config)
    picked = [g for g, s in zip(leaves, skippable) if s]
    picked_scattered = [c for c, s in zip(scattered, skippable) if s]
    # How params are sharded over the compiler's axes, where the training
    # helpers recorded it (their gradients are sharded alike).
    param_specs = specs if specs is not None else _shards.specs_of_params(params)
    picked_specs = (None if param_specs is None or len(param_specs) != len(leaves)
                    else [p for p, s in zip(param_specs, skippable) if s])

    def full(picked):
        out = _full_mean(picked, picked_scattered, config)
        left_out = ([jnp.zeros_like(g) for g in picked] if residuals is not None
                    else None)
        return out, left_out

    def skipped(picked):
        rs = [g for g, c in zip(picked, picked_scattered) if c]
        ar = [g for g, c in zip(picked, picked_scattered) if not c]
        ar_specs = (None if picked_specs is None else
                    [p for p, c in zip(picked_specs, picked_scattered) if not c])
        ar_kw = dict(config=config, key=key, phase=phase, inner_axis=config.inner_axis,
                     specs=ar_specs, normalize=config.normalize)
        if residuals is None:
            ar_out = coll.pmean_for_update(ar, config.axis_name, **ar_kw)
            if config.radial(params):
                ar_out = exact_radial(ar_out, ar, _picked_params(params, skippable),
                                      axes)
        else:
            ar_out, ar_left = coll.pmean_for_update(ar, config.axis_name,
                                                    with_left_out=True, **ar_kw)
        # Its own period; fold_in: the all-reduce's buckets and these draw
        # different keys.
        rs_key, rs_phase = balanced_draw(
            base, skip_step, scatter_period(n, num_skip) if config.balanced else 1)
        rs_key = jax.random.fold_in(rs_key, 1 << 30)
        ring = ring_settings(config.axis_name, config.inner_axis, config, api=_API)
        own, divisor = _owner_weight(n, num_skip, config)
        rs_out = coll._scatter(rs, ring, key=rs_key, phase=rs_phase,
                               scale=1.0 / (divisor * inner), own_weight=own)
        if residuals is None:
            return _merge(picked_scattered, rs_out, ar_out), None
        mask = coll.scatter_mask(rs, ring, key=rs_key, phase=rs_phase)
        rs_left = [jnp.where(m, 0, g) for m, g in zip(mask, rs)]
        return (_merge(picked_scattered, rs_out, ar_out),
                _merge(picked_scattered, rs_left, ar_left))

    if not picked or num_skip == 0:
        reduced, left_out = full(picked)
    elif config.warmup_steps > 0:
        reduced, left_out = lax.cond(
            state.count < config.warmup_steps, full, skipped, picked)
    else:
        reduced, left_out = skipped(picked)

    rest = _full_mean([g for g, s in zip(leaves, skippable) if not s],
                      [c for c, s in zip(scattered, skippable) if not s], config)
    out = _merge(skippable, reduced, rest)

    if config.check_finite:
        # One flag for all ranks: True when every rank's gradient is finite
        # (and, on a float16 wire, every rank's update: no sum overflowed).
        finite = _all_finite(leaves)
        if config.wire.finite_check():
            finite = finite & _all_finite(out)
        finite = lax.pmin(finite.astype(jnp.int32), axes) > 0
        out = [jnp.where(finite, o, jnp.nan).astype(o.dtype) for o in out]
    new_state = state._replace(count=state.count + 1)
    if residuals is not None:
        # The update is identical on every rank, so every rank takes the same
        # branch: a non-finite update (to be skipped, e.g. by apply_if_finite)
        # leaves the residuals as they were; after a finite one, what was left
        # out becomes the residual, except non-finite values, which would come
        # back piece by piece in the steps after.
        applied = _all_finite(out)
        if any(scattered):  # each rank holds other blocks: decide together
            applied = lax.pmin(applied.astype(jnp.int32), axes) > 0
        kept = [r for r, s in zip(residuals, skippable) if not s]
        new = _merge(skippable, [x[None] for x in left_out], kept)
        # A leaf that is never skipped keeps its (empty) residual as it is,
        # typed as given, so that error_feedback="auto"'s two branches agree.
        new = [jnp.where(applied, jnp.where(jnp.isfinite(x), x, 0), r).astype(r.dtype)
               if s else r for x, r, s in zip(new, residuals, skippable)]
        new_state = new_state._replace(residual=jax.tree_util.tree_unflatten(treedef, new))
    if config.verify_sync:
        _verify_sync(state, axes)
    return jax.tree_util.tree_unflatten(treedef, out), new_state


def _owner_weight(n: int, num_skip: int, config: _Config) -> tuple[float, float]:
    """The owner's weight in its block's skipped sum, and what divides the sum.

    A Random skipped reduce-scatter always sums the block's owner and each
    other rank with probability ``(N - 1 - k) / (N - 1)``. Weighing the
    owner by that probability makes every rank's expected weight 1 / N when
    the sum is divided by the ranks summed (the plain mean of the N - k
    summed gives the owner 1 / (N - k)). Error feedback (every value is
    delivered once, now or later) keeps the plain sum over N.
    """
    others = n - 1 - num_skip
    if config.error_feedback:
        return 1.0, n
    if not config.randomize or others == 0:
        return 1.0, n - num_skip
    own = others / (n - 1)
    return own, own + others


def _picked_params(params: Any, skippable: list[bool]) -> list[jax.Array]:
    """The params of the skipped leaves (exact_radial's directions)."""
    if params is None:
        raise ValueError(
            f"{_API}(exact_radial=True): update() got params=None; call "
            "tx.update(grads, state, params) (optax.chain passes them through).")
    return [p for p, s in zip(jax.tree_util.tree_leaves(params), skippable) if s]


def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    """A bool scalar: no NaN or Inf in any of ``arrays`` (True if none)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]
                             or [jnp.array(True)]))


def _merge(flags: list[bool], when_true: list[Any], when_false: list[Any]) -> list[Any]:
    """Interleaves two lists back into the order that ``flags`` split them."""
    true_it, false_it = iter(when_true), iter(when_false)
    return [next(true_it) if f else next(false_it) for f in flags]


def _gradient_shape(param: Any, config: _Config) -> tuple[int, ...]:
    """The shape of a param's local gradient (whole, for an FSDP shard)."""
    shape = tuple(np.shape(param))
    if not config.params_sharded:
        return shape
    try:
        sharded = (coll.vma_checked(config.axis_name)
                   and config.axis_name in coll.varying_axes(param))
    except NameError:  # init outside shard_map: nothing is sharded there
        return shape
    if not sharded or not shape:
        return shape
    n, inner = checks.axes_pair(config.axis_name, config.inner_axis, api=_API)
    return (shape[0] * n * inner,) + shape[1:]


def _scattered(leaves: list[jax.Array], params: Any, n: int,
               config: _Config) -> list[bool]:
    """Per leaf: is its param this rank's shard over the data axis (FSDP)?

    A shard is a param of leading size L / n (typed varying over the data
    axis under check_vma=True) whose gradient has leading size L; n is N,
    or N times the inner axis size in hierarchical mode.
    """
    if not config.params_sharded:
        for g, p in zip(leaves, jax.tree_util.tree_leaves(params)):
            gs, ps = tuple(np.shape(g)), tuple(np.shape(p))
            if gs and ps == (gs[0] // n,) + gs[1:] and gs[0] == n * ps[0] != ps[0]:
                raise ValueError(
                    f"{_API}: a gradient of shape {gs} belongs to a param of "
                    f"shape {ps}, its 1/{n} block: the params are sharded over "
                    f"{config.axis_name!r} (FSDP). Pass params_sharded=True.")
        return [False] * len(leaves)
    if params is None:
        raise ValueError(
            f"{_API}(params_sharded=True): update() got params=None; pass the "
            "param shards, tx.update(grads, state, params) (optax.chain passes "
            "them through).")
    param_leaves = jax.tree_util.tree_leaves(params)
    if len(param_leaves) != len(leaves):
        return [False] * len(leaves)
    flags = []
    for g, p in zip(leaves, param_leaves):
        gs, ps = tuple(np.shape(g)), tuple(np.shape(p))
        flag = bool(gs) and gs != ps and ps == (gs[0] // n,) + gs[1:] and gs[0] % n == 0
        if gs != ps and not flag:
            over = (repr(config.axis_name) if config.inner_axis is None else
                    f"P(({config.axis_name!r}, {config.inner_axis!r})), "
                    "FSDP over every device; a param sharded over one of the "
                    "two data axes only is not supported")
            raise ValueError(
                f"{_API}: a gradient of shape {gs} belongs to a param of shape "
                f"{ps}: neither the same shape (replicated params) nor its "
                f"1/{n} block along the leading axis (params sharded over "
                f"{over}, FSDP).")
        flags.append(flag)
    return flags


def _full_mean(leaves: list[jax.Array], scattered: list[bool],
               config: _Config) -> list[jax.Array]:
    """The full mean: ``lax.pmean``, or ``psum_scatter / N`` for FSDP shards.

    Summed in ``accumulate_dtype`` as the ring does.
    """
    axes = _axes(config)
    wide = [g.astype(summed_dtype(g.dtype, config.accumulate_dtype))
            for g in leaves]
    ar = pmean_nonempty([w for w, c in zip(wide, scattered) if not c], axes)
    n = math.prod(checks.axis_size(a, api=_API) for a in axes) if any(scattered) else 1
    rs = [coll.full_psum_scatter(w, config.axis_name, config.inner_axis) / n
          for w, c in zip(wide, scattered) if c]
    return [m.astype(g.dtype) for m, g in zip(_merge(scattered, rs, ar), leaves)]


def _verify_sync(state: SkipReduceState, axes: tuple[str, ...]) -> None:
    agree = leaf_agreement((state.count, state.key, state.fingerprint), axes)

    def check(count_ok, key_ok, settings_ok, count):
        if not (count_ok and key_ok and settings_ok):
            what = [name for name, ok in (("step count", count_ok),
                                          ("key (seed)", key_ok),
                                          ("settings", settings_ok)) if not ok]
            raise_in_callback(RuntimeError(
                f"{_API}(verify_sync=True): the {', '.join(what)} differ across "
                f"ranks over {list(axes)} at step {int(count)}. Every rank must "
                "use the same seed and settings and restore the same state."))

    host_check(check, *agree, state.count)
