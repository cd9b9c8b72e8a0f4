"""Public collectives: ring_psum, skip_psum, skip_pmean, contribution_mask.

All of them are called where ``axis_name`` is bound (inside ``jax.shard_map``)
and take pytrees. They share one path: check the arguments into one
:class:`RingSettings` (from a :class:`SkipConfig` or the keywords), plan the
buckets, make one :class:`SkipSchedule` per bucket from the shared key, run
the one ring on each bucket, unpack.

Hierarchical SkipReduce (``inner_axis=...``) all-reduces fully over the fast
inner axis and skips only over the slow outer axis: a native reduce-scatter
over the inner axis, the skipped ring over ``axis_name`` on the 1/L shard, a
native all-gather over the inner axis.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Literal, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from skipreduce_jax import _checks as checks
from skipreduce_jax._ring import ring as _ring
from skipreduce_jax._ring import shards as _shards
from skipreduce_jax._ring.buckets import (
    DEFAULT_BUCKET_BYTES,
    BlockPlan,
    BucketPlan,
    concatenate_columns,
    plan_blocks,
    plan_buckets,
)
from skipreduce_jax._ring.config import (
    RING_OPTIONS,
    CollectiveOptions,
    RingSettings,
    SkipConfig,
    collective,
    ring_settings,
    skip_config,
)
from skipreduce_jax._ring.schedule import (
    ScatterSchedule,
    SkipSchedule,
    make_scatter_schedule,
    make_schedule,
)
from skipreduce_jax._ring.wire import check_comm_width, nan_unless_finite
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import all_gather_replicated, cast_varying, varying_axes, vma_checked

Normalize = Literal["contributors", "world"]
NORMALIZE_CHOICES = {"contributors": "divide by the N - k ranks summed",
                     "world": "divide by N"}
GATHER_CHOICES = {"native": "lax.all_gather", "ring": "N - 1 ppermute steps"}
# What a reduce-scatter reads of the ring settings: its blocks are whole rows.
_SCATTER_READS = tuple(n for n in RING_OPTIONS if n not in ("chunks_per_rank", "layout"))


# ----------------------------------------------------------------------------
# Argument checks (trace time).
# ----------------------------------------------------------------------------


def as_typed_key(key: Any, *, api: str) -> jax.Array:
    """Accepts a typed PRNG key or a raw uint32[2] key; returns a typed key."""
    if isinstance(key, jax.Array) or isinstance(key, np.ndarray):
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == jnp.uint32 and key.shape == (2,):
            return jax.random.wrap_key_data(key)
    raise TypeError(
        f"{api}: key={key!r} is not a PRNG key. Pass jax.random.key(seed) (or "
        "a raw uint32[2] jax.random.PRNGKey(seed)), derived from a seed and the "
        "step count so that it is identical on every rank.")


def _check_replicated(value: jax.Array, ring: RingSettings, name: str):
    varying = varying_axes(value) & set(ring.axes)
    if varying:
        raise ValueError(
            f"{ring.api}: {name} varies over {sorted(varying)}. SkipReduce needs the "
            f"same {name} on every rank (derive it from a seed and the step count, "
            "never from axis_index), or ranks would disagree on what to drop.")


def _bucket_keys(ring: RingSettings, key: Any, phase: Any, count: int) -> list[Any]:
    """One key per bucket (None where nothing is drawn); checks key and phase."""
    draws = ring.randomize and ring.num_skip > 0
    if draws or key is not None:
        key = as_typed_key(key, api=ring.api)
        _check_replicated(key, ring, "key")
    if isinstance(phase, jax.Array):
        _check_replicated(phase, ring, "phase")
    return [jax.random.fold_in(key, i) if draws else None for i in range(count)]


def _check_comm_width(ring: RingSettings, leaves: list[jax.Array]):
    """Refuses a ``comm_dtype`` wider than a floating leaf."""
    for leaf in leaves:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            check_comm_width(ring.comm_dtype, leaf.dtype, api=ring.api)


def _check_floating(leaves, api: str):
    for leaf in map(jnp.asarray, leaves):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{api}: got a leaf of dtype {leaf.dtype} and shape {leaf.shape}; "
                "SkipReduce works on floating-point gradients only (float32, "
                "bfloat16, float16). Reduce integer or bool leaves with "
                "ring_psum or lax.psum.")


def _check_not_bool(x: Any, api: str, fix: str = ""):
    for leaf in map(jnp.asarray, jax.tree_util.tree_leaves(x)):
        if leaf.dtype == jnp.bool_:
            raise TypeError(f"{api}: got a bool leaf; cast it to an integer "
                            f"dtype to count{fix}.")


# ----------------------------------------------------------------------------
# The shared path.
# ----------------------------------------------------------------------------


def _plan(tree: Any, ring: RingSettings, key: Any, phase: Any
          ) -> tuple[BucketPlan, list[SkipSchedule]]:
    """Plans the buckets of ``tree`` and makes one schedule per bucket."""
    plan = plan_buckets(tree, group_size=ring.n, slot_divisor=ring.inner,
                        bucket_bytes=ring.bucket_bytes,
                        chunks_per_rank=ring.chunks_per_rank, layout=ring.layout)
    keys = _bucket_keys(ring, key, phase, len(plan.buckets))
    return plan, [make_schedule(ring.n, num_skip=ring.num_skip, key=k, phase=phase,
                                chunks_per_rank=b.chunks_per_rank,
                                randomize=ring.randomize)
                  for b, k in zip(plan.buckets, keys)]


def _reduce(
    tree: Any,
    ring: RingSettings,
    *,
    key: Any,
    phase: Any,
    scale: Any,
    gather: _ring.Gather = "native",
    specs: Any = None,
    with_left_out: bool = False,
    in_place: bool = True,
) -> Any:
    """The shared body of the public reductions.

    With ``with_left_out=True`` it returns ``(result, left_out)``: ``left_out``
    holds this rank's values that the schedule leaves out of the sum (zero
    where they are summed), shaped like ``tree``, i.e. ``tree *
    ~contribution_mask``. It is computed on the packed buffers (see
    :func:`_left_out`). Leaves sharded over the compiler's mesh axes are
    reduced shard by shard (see ``_ring/shards.py``). ``in_place``: how Random's
    slots are put back after the native gather (:func:`_ring.put_in_slot_order`).
    """
    again = functools.partial(_reduce, ring=ring, scale=scale, gather=gather,
                              with_left_out=with_left_out, in_place=in_place)
    sharded = _sharded(tree, ring, specs, key, phase, again,
                       num_outputs=2 if with_left_out else 1)
    if sharded is not None:
        return sharded
    checks.check_choice(gather, "gather", GATHER_CHOICES, api=ring.api)
    tree = jax.tree_util.tree_map(jnp.asarray, tree)
    plan, schedules = _plan(tree, ring, key, phase)
    leaves = jax.tree_util.tree_leaves(tree)
    _check_comm_width(ring, leaves)
    if vma_checked(ring.axis_name):
        # Values typed replicated are summed N times, exactly as psum does.
        leaves = [cast_varying(leaf, ring.axes) for leaf in leaves]
    axis_name, inner_axis = ring.axis_name, ring.inner_axis
    gather_ring = functools.partial(_ring.gather, axis_name=axis_name, method=gather,
                                    in_place=in_place)

    outputs, left_out, checked = [], [], []
    for bucket, schedule in zip(plan.buckets, schedules):
        buffer = plan.pack(leaves, bucket)
        if with_left_out:
            left_out.append(_left_out(buffer, schedule, axis_name, ring.inner))
        wire = ring.wire.of(bucket.dtype)
        acc_dtype = wire.added(bucket.dtype, ring.accumulate_dtype)
        if inner_axis is not None:
            buffer = _scatter_inner(buffer.astype(acc_dtype), inner_axis, ring.inner)
        shard = _ring.reduce_scatter(buffer, schedule, axis_name,
                                     accumulate_dtype=acc_dtype, wire=wire)
        # Scale and cast the 1/N shard, not the whole buffer.
        if scale is not None:
            shard = shard * jnp.asarray(scale, acc_dtype)
        out = wire.gather(gather_ring, shard, schedule, bucket.dtype)
        if inner_axis is not None:
            out = all_gather_replicated(out, inner_axis, tiled=True)
        outputs.append(out)
        checked.append(wire.finite_check())
    outputs = nan_unless_finite(outputs, checked)
    # Zero-size leaves are not packed. Their results get the types the
    # others get (the sum replicated over the reduced axes, what was left
    # out as varying as the input), as lax.cond branches need.
    reduced = set(ring.axes)

    def summed_zeros(i):
        leaf = leaves[i]
        zeros = jnp.zeros(leaf.shape, leaf.dtype)
        return cast_varying(zeros, tuple(sorted(varying_axes(leaf) - reduced)))

    result = plan.unpack(outputs, fill=summed_zeros)
    if not with_left_out:
        return result
    return result, plan.unpack(left_out, fill=lambda i: jnp.zeros_like(leaves[i]))


# Rows of this many elements make the inner reduce-scatter a true one on TPU.
_SCATTER_ROW = 128


def _scatter_inner(buffer: jax.Array, inner_axis: str, inner: int) -> jax.Array:
    """The full reduce-scatter over the inner axis of a flat bucket.

    XLA:TPU compiles the scatter of a 1-D buffer as a full all-reduce and a
    slice (twice the bytes over the slice's links, and merged with the other
    buckets' into one all-reduce after the backward pass); laid out in rows
    of 128 it emits a reduce-scatter (benchmarks/pods.md). Same elements per
    shard either way.
    """
    if buffer.size % (_SCATTER_ROW * inner):
        return lax.psum_scatter(buffer, inner_axis, tiled=True)
    rows = buffer.reshape(-1, _SCATTER_ROW)
    return lax.psum_scatter(rows, inner_axis, tiled=True).reshape(-1)


def _scatter_column(column: jax.Array, n: int, inner_axis: str) -> jax.Array:
    """One leaf's ``[N L, m]`` blocks reduce-scattered in full over the inner axis.

    Device (o, i) keeps blocks ``o' L + i`` of every outer rank o': ``[N, m]``.
    One scatter per leaf: XLA:TPU compiled that of a whole multi-leaf bucket
    as an all-reduce (benchmarks/pods.md).
    """
    inner = column.shape[0] // n
    by_inner = column.reshape(n, inner, -1).swapaxes(0, 1).reshape(inner, -1)
    return _scatter_inner(by_inner.reshape(-1), inner_axis, inner).reshape(n, -1)


def full_psum_scatter(x: jax.Array, axis_name: str, inner_axis: str | None
                      ) -> jax.Array:
    """``lax.psum_scatter`` over ``(axis_name, inner_axis)``, the inner first.

    ``x``'s leading size divides by N L. Device (o, i) gets block
    ``o * L + i``, as from one scatter over both axes, which XLA:TPU
    compiled as an all-reduce within each slice (twice the bytes).
    """
    if inner_axis is None:
        return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    n = checks.axis_size(axis_name, api="full_psum_scatter")
    inner = checks.axis_size(inner_axis, api="full_psum_scatter")
    rows = _scatter_column(x.reshape(n * inner, -1), n, inner_axis)
    block = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)
    return block.reshape((x.shape[0] // (n * inner),) + x.shape[1:])


def _sharded(tree: Any, ring: RingSettings, specs: Any, key: Any, phase: Any,
             reduce: Any, num_outputs: int) -> Any:
    """``reduce(tree, key=, phase=)`` on local shards, or None when no leaf is sharded.

    ``reduce`` returns ``num_outputs`` trees shaped like ``tree`` (a bare
    tree for one).
    """
    leaves, treedef = jax.tree_util.tree_flatten(
        jax.tree_util.tree_map(jnp.asarray, tree))
    per_leaf = _shards.leaf_specs(leaves, treedef, specs, reduced_axes=ring.axes,
                                  api=ring.api)
    if all(s is None for s in per_leaf):
        return None

    # Leaves share packed buffers, whose type varies over the union of their
    # leaves' axes: reduce each set of equally sharded leaves on its own.
    groups: dict[frozenset[str], list[int]] = {}
    for i, spec in enumerate(per_leaf):
        groups.setdefault(frozenset(_shards.spec_axes(spec)), []).append(i)

    # A traced key and phase enter the nested shard_map as arguments.
    extra = [] if key is None else [as_typed_key(key, api=ring.api)]
    traced_phase = isinstance(phase, jax.Array)
    if traced_phase:
        extra.append(phase)

    def local(local_leaves, *args):
        outs = [[None] * len(local_leaves) for _ in range(num_outputs)]
        k = args[0] if key is not None else None
        ph = args[-1] if traced_phase else phase
        for g, members in enumerate(groups.values()):
            # Each group its own schedules (the first keeps the key as is).
            out = reduce([local_leaves[i] for i in members],
                         key=k if k is None or g == 0 else jax.random.fold_in(k, g),
                         phase=ph)
            for res, got in zip(outs, (out,) if num_outputs == 1 else out,
                                strict=True):
                for i, leaf in zip(members, got, strict=True):
                    res[i] = leaf
        return outs[0] if num_outputs == 1 else tuple(outs)

    out = _shards.on_local_shards(local, leaves, per_leaf, *extra,
                                  num_outputs=num_outputs)
    if num_outputs == 1:
        return treedef.unflatten(out)
    return tuple(treedef.unflatten(o) for o in out)


def _left_out(buffer: jax.Array, schedule: SkipSchedule, axis_name: str,
              inner: int) -> jax.Array:
    """This rank's values of a packed buffer that the sum leaves out.

    Rank r's value of (slot s, column j) is left out when s rides in ring
    chunk r - i, i = 1..k. The k * C such pieces are copied into a zero
    buffer in a loop. (A mask over the whole buffer gets fused by XLA into
    each leaf's slice, which then redoes the key arithmetic for every
    element: on CPU about twice the time of the loop for a 4M-element leaf.)
    The buffer is ``[L, N, C, m]``: each of the L inner shards runs the same
    schedule (see :func:`contribution_mask`).
    """
    n, columns = schedule.axis_size, schedule.chunks_per_rank
    pieces = buffer.reshape(inner, n, columns, -1)
    rank = lax.axis_index(axis_name)

    def copy_piece(t, out):
        back, column = t // columns + 1, t % columns
        slot = schedule.slots_in_chunk(rank - back)[column]
        start = (0, slot, column, 0)
        piece = lax.dynamic_slice(pieces, start, (inner, 1, 1, pieces.shape[-1]))
        return lax.dynamic_update_slice(out, piece, start)

    out = lax.fori_loop(0, schedule.num_skip * columns, copy_piece,
                        jnp.zeros_like(pieces))
    return out.reshape(-1)


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def ring_psum(x: PyTree, axis_name: str, **options: Unpack[CollectiveOptions]) -> PyTree:
    """All-reduce (sum) over ``axis_name`` with a ring of ppermute steps.

    Equals ``lax.psum(x, axis_name)`` (exactly for integers; up to the order of
    the floating-point additions otherwise). A reduce-scatter of N - 1
    ``ppermute`` steps, then an all-gather.

    Args:
      x: a pytree of arrays (floating or integer).
      axis_name: the mesh axis to sum over.
      **options: of :class:`CollectiveOptions`, these four (others are refused):
      bucket_bytes: leaves of one dtype are packed into buffers of at most
        this many bytes, one ring per buffer.
      gather: ``"native"`` (``lax.all_gather``; the result is typed replicated
        like ``psum``'s) or ``"ring"`` (N - 1 more ppermute steps; typed varying
        under ``check_vma=True``).
      specs: how each leaf is sharded over the mesh axes this shard_map
        leaves to the compiler: a pytree prefix of ``PartitionSpec`` (or
        None). None reads it from the leaves' types (Explicit axes) and
        otherwise takes them as replicated there. A sharded leaf is reduced
        shard by shard: nothing is sent over those axes and the result keeps
        the leaf's sharding.
      comm_dtype: as in :func:`skip_psum` (floating leaves only).

    Returns:
      The sum over the axis, the same on every rank, with ``x``'s structure.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from skipreduce_jax import ring_psum
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda v: ring_psum(v, "data"), mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
      >>> float(f(x)[0])
      28.0
    """
    unknown = sorted(set(options) - set(_PSUM_OPTIONS))
    if unknown:
        raise TypeError(f"ring_psum() got an unexpected keyword argument {unknown[0]!r}: "
                        f"it takes {list(_PSUM_OPTIONS)}.")
    options = {**_PSUM_OPTIONS, **options}
    _check_not_bool(x, "ring_psum", ", or reduce it with lax.pmax")
    config = skip_config(None, dict(num_skip=0, randomize=False, chunks_per_rank=1,
                                    bucket_bytes=options["bucket_bytes"],
                                    comm_dtype=options["comm_dtype"]), api="ring_psum")
    ring = ring_settings(axis_name, None, config, api="ring_psum")
    return _reduce(x, ring, key=None, phase=0, scale=None, gather=options["gather"],
                   specs=options["specs"])


# ring_psum's keywords and their defaults.
_PSUM_OPTIONS = types.MappingProxyType(dict(
    bucket_bytes=DEFAULT_BUCKET_BYTES, gather="native", specs=None, comm_dtype=None))


@collective("phase", "rescale", "inner_axis", "gather", "specs")
def skip_psum(  # noqa: D417 (ring: documented as axis_name, config, options)
    x: PyTree,
    ring: RingSettings,
    *,
    key: jax.Array | None,
    phase: jax.Array | int = 0,
    rescale: bool = False,
    gather: _ring.Gather = "native",
    specs: PyTree = None,
) -> PyTree:
    """SkipReduce all-reduce: a ring sum that skips ``num_skip`` steps.

    The reduce-scatter runs N - 1 - k steps instead of N - 1, so every element
    of the result is the sum of exactly N - k ranks' values, and each rank
    sends (2(N-1) - k) / (2(N-1)) of a full ring all-reduce. With
    ``randomize=True`` the shared ``key`` picks, per sub-chunk, which slice of
    the buffer rides in which ring chunk, so each rank's value of each element
    is left out with probability k / N; the send pattern never changes.

    Args:
      x: a pytree of floating-point arrays (each rank's local values).
      axis_name: the mesh axis to sum over (the slow one, with
        ``inner_axis``).
      key: a PRNG key identical on every rank (typed, or raw uint32[2]). May
        be None for ``randomize=False`` or ``num_skip=0``. A key that varies
        over the axis is refused at trace time under ``check_vma=True``;
        with ``check_vma=False`` JAX's types cannot tell.
      config: a :class:`SkipConfig`, of which the ring settings are read
        (:class:`RingOptions`: k as ``num_skip`` or ``skip_ratio``,
        ``randomize``, ``chunks_per_rank``, ``bucket_bytes``,
        ``accumulate_dtype``, ``comm_dtype``, ``layout``), not the
        optimizer's. ``randomize=False`` is static SkipReduce: the same k
        ranks are left out for a given element whatever the key (biased;
        for comparison). ``comm_dtype`` is the dtype on the wire over
        ``axis_name`` (an ``inner_axis`` is summed in ``accumulate_dtype``).
      phase: the step's place in a balanced period: with the key and phase
        of :func:`balanced_draw` (period :func:`ring_period`), every rank is
        summed into every element equally often over each period. 0 (the
        default) uses the key's own draw.
      rescale: multiply by N / (N - k), an unbiased estimate of the psum when
        ``randomize=True``.
      inner_axis: hierarchical mode: a second (fast) axis summed in full;
        only ``axis_name`` is skipped.
      gather: ``"native"`` or ``"ring"``, as in :func:`ring_psum`.
      specs: as in :func:`ring_psum`.
      **options: keywords of :class:`CollectiveOptions`: the ring settings
        in place of ``config`` (refused beside it), e.g. ``num_skip=4``, each
        detailed with :ref:`skip_reduce's options <skip-reduce-option-details>`;
        and the call's own: ``phase``, ``rescale``, ``inner_axis``,
        ``gather`` and ``specs`` above. Any other keyword is refused.

    Returns:
      The partial sum, identical on every rank, with ``x``'s structure and
      dtypes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> import skipreduce_jax as sr
      >>> from skipreduce_jax import skip_psum
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def f(g):
      ...   return skip_psum(g, "data", key=jax.random.key(0), num_skip=4)
      >>> grads = jax.device_put(jnp.ones((8, 64)),  # row r: rank r's
      ...                        NamedSharding(mesh, P("data")))
      >>> out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
      ...                             out_specs=P()))(grads)
      >>> out.shape, float(out[0, 0])  # every element sums N - k = 4 ranks
      ((1, 64), 4.0)
      >>> config = sr.SkipConfig(skip_ratio=0.5, chunks_per_rank=1)  # k = 4 of 8
      >>> f = lambda g: skip_psum(g, "data", key=jax.random.key(0), config=config)
      >>> out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
      ...                             out_specs=P()))(grads)
      >>> float(out[0, 0])
      4.0
    """
    _check_floating(jax.tree_util.tree_leaves(x), ring.api)
    scale = _rescale(rescale, ring)
    return _reduce(x, ring, key=key, phase=phase, scale=scale, gather=gather,
                   specs=specs)


@collective("phase", "normalize", "inner_axis", "gather", "specs")
def skip_pmean(x: PyTree, ring: RingSettings, *, key: jax.Array | None,
               **call: Any) -> PyTree:
    """SkipReduce mean: :func:`skip_psum` divided by the contributor count.

    It takes :func:`skip_psum`'s arguments but ``rescale``: ``config`` is a
    :class:`SkipConfig` of which only the ring settings are read (not the
    optimizer's ``seed``, ``min_size``, ``error_feedback``, ...). And
    ``normalize``: ``"contributors"`` divides by the N - k ranks summed
    (keeps the gradient's scale); ``"world"`` divides by N (what the
    authors' NCCL implementation does; shrinks the gradient by (N - k) / N).
    With ``inner_axis`` of size L, the counts are (N - k) L and N L.

    Returns:
      The partial mean, identical on every rank.
    """
    return _pmean(x, ring, key=key, **call)


@collective("phase", "normalize", "inner_axis", "gather", "specs")
def skip_pmean_and_left_out(x: PyTree, ring: RingSettings, *, key: jax.Array | None,
                            **call: Any) -> tuple[PyTree, PyTree]:
    """:func:`skip_pmean`, plus this rank's values the sum left out.

    It takes the arguments of :func:`skip_pmean` (``config``: a
    :class:`SkipConfig`, of which only the ring settings are read). Error
    feedback keeps the second result for the next step; it equals
    ``jnp.where(contribution_mask(x, ...), 0, x)`` with the same arguments.

    Returns:
      ``(mean, left_out)``, both shaped like ``x``: the mean is identical on
      every rank, ``left_out`` is this rank's own.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from skipreduce_jax import skip_pmean_and_left_out
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def f(g):
      ...     mean, left_out = skip_pmean_and_left_out(
      ...         g, "data", key=jax.random.key(0), num_skip=1)
      ...     return mean, left_out  # add left_out to the next step's g
      >>> g = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("data")))
      >>> mean, left_out = jax.jit(jax.shard_map(
      ...     f, mesh=mesh, in_specs=P("data"), out_specs=(P(), P("data"))))(g)
      >>> float(mean[0, 0]), float(left_out.sum())  # 1 of 8 ranks left out
      (1.0, 64.0)
    """
    return _pmean(x, ring, key=key, with_left_out=True, **call)


def _pmean(x: Any, ring: RingSettings, *, key: Any, phase: Any = 0,
           normalize: Normalize = "contributors", gather: _ring.Gather = "native",
           specs: Any = None,
           with_left_out: bool = False, in_place: bool = True) -> Any:
    checks.check_choice(normalize, "normalize", NORMALIZE_CHOICES, api=ring.api)
    _check_floating(jax.tree_util.tree_leaves(x), ring.api)
    count = ring.n - ring.num_skip if normalize == "contributors" else ring.n
    return _reduce(x, ring, key=key, phase=phase, scale=1.0 / (count * ring.inner),
                   gather=gather, specs=specs, with_left_out=with_left_out,
                   in_place=in_place)


def pmean_for_update(x: PyTree, axis_name: str, *, config: SkipConfig, key: Any,
                     phase: Any, inner_axis: str | None, specs: Any, normalize: str,
                     with_left_out: bool = False) -> Any:
    """:func:`skip_pmean` (or ``skip_pmean_and_left_out``) for ``skip_reduce``.

    Its result goes straight into the optimizer's update in the same
    program, so Random's reorder stays an XLA gather, which XLA fuses into
    that update (the collectives' in-place loop cannot be fused). Same
    values, same bytes.
    """
    api = "skip_pmean_and_left_out" if with_left_out else "skip_pmean"
    ring = ring_settings(axis_name, inner_axis, config, api=api)
    return _pmean(x, ring, key=key, phase=phase, normalize=normalize, specs=specs,
                  with_left_out=with_left_out, in_place=False)


@collective("phase", "inner_axis", "specs")
def contribution_mask(
    x: PyTree,
    ring: RingSettings,
    *,
    key: jax.Array | None,
    phase: jax.Array | int = 0,
    specs: PyTree = None,
) -> PyTree:
    """Which of this rank's values :func:`skip_psum` sums.

    ``x`` is the pytree that will be (or was) passed to :func:`skip_psum`;
    the other arguments are those of :func:`skip_psum` that decide who is
    summed (``config``: a :class:`SkipConfig`, of which only the ring
    settings are read). With the same values it asks the same bucket plan
    and schedules, so the two always agree (with ``inner_axis``, a device's
    value is summed when its outer rank's share is). Error feedback keeps
    ``x * ~mask`` for the next step.

    Returns:
      A pytree of bool arrays shaped like ``x``: True where this rank's value
      is part of the sum.
    """
    return _mask(x, ring, key=key, phase=phase, specs=specs)


def _mask(x: Any, ring: RingSettings, *, key: Any, phase: Any, specs: Any = None
          ) -> Any:
    sharded = _sharded(x, ring, specs, key, phase, functools.partial(_mask, ring=ring),
                       num_outputs=1)
    if sharded is not None:
        return sharded
    plan, schedules = _plan(jax.tree_util.tree_map(jnp.asarray, x), ring, key, phase)
    rank = lax.axis_index(ring.axis_name)
    masks = []
    for bucket, schedule in zip(plan.buckets, schedules):
        shard_mask = schedule.element_mask(rank, bucket.padded_size // ring.inner)
        # With an inner axis, each of the L shards follows the same schedule.
        masks.append(jnp.tile(shard_mask, ring.inner) if ring.inner > 1 else shard_mask)
    return plan.unpack(masks, fill=lambda i: jnp.ones(plan.shapes[i], jnp.bool_))


# ----------------------------------------------------------------------------
# The skipped reduce-scatter (FSDP over the data axis).
# ----------------------------------------------------------------------------


def _scatter_plan(x: Any, ring: RingSettings, key: Any, phase: Any
                  ) -> tuple[BlockPlan, list[ScatterSchedule], list[jax.Array]]:
    leaves = [jnp.asarray(leaf) for leaf in jax.tree_util.tree_leaves(x)]
    if any(leaf.ndim == 0 for leaf in leaves):
        raise ValueError(
            f"{ring.api}: got a scalar leaf; a reduce-scatter splits each leaf "
            "along its leading axis. Reduce scalars with lax.psum.")
    # Hierarchical: N * L blocks, block o * L + i for device (o, i), the
    # order of P((axis_name, inner_axis)).
    plan = plan_blocks(x, group_size=ring.n * ring.inner, bucket_bytes=ring.bucket_bytes)
    keys = _bucket_keys(ring, key, phase, len(plan.buckets))
    schedules = [make_scatter_schedule(ring.n, num_skip=ring.num_skip, key=k,
                                       randomize=ring.randomize, phase=phase)
                 for k in keys]
    return plan, schedules, leaves


def _scatter(x: Any, ring: RingSettings, *, key: Any, phase: Any,
             scale: float | None, own_weight: float = 1.0) -> Any:
    """The shared body of the skipped reduce-scatters.

    ``own_weight``: Random only, the weight of each block owner's own value
    in its sum (``skip_reduce`` weighs it so the sum is unbiased).
    """
    _check_not_bool(x, ring.api)
    plan, schedules, leaves = _scatter_plan(x, ring, key, phase)
    _check_comm_width(ring, leaves)
    if vma_checked(ring.axis_name):
        leaves = [cast_varying(leaf, ring.axes) for leaf in leaves]
    rows, checked = [], []
    for bucket, (dtype, _) in enumerate(plan.buckets):
        wire = ring.wire.of(dtype)
        acc_dtype = wire.added(dtype, ring.accumulate_dtype)
        if ring.inner_axis is None:
            buffer = plan.pack(leaves, bucket)  # [N, M]
        else:
            buffer = concatenate_columns([
                _scatter_column(c.astype(acc_dtype), ring.n, ring.inner_axis)
                for c in plan.columns(leaves, bucket)])
        row = _ring.reduce_scatter_to_owners(
            buffer, schedules[bucket], ring.axis_name, accumulate_dtype=acc_dtype,
            wire=wire, own_weight=own_weight)
        if scale is not None:
            row = row * jnp.asarray(scale, acc_dtype)
        rows.append(row.astype(dtype))
        checked.append(wire.finite_check())
    rows = nan_unless_finite(rows, checked, ring.axes)
    def zeros(i):  # a zero-size leaf's block, typed like the others
        block = jnp.zeros(plan.block_shape(i), plan.dtypes[i])
        return cast_varying(block, ring.axes) if vma_checked(ring.axis_name) else block

    return plan.unpack(rows, fill=zeros)


@collective("phase", "rescale", "inner_axis", reads=_SCATTER_READS)
def skip_psum_scatter(  # noqa: D417 (as skip_psum)
    x: PyTree,
    ring: RingSettings,
    *,
    key: jax.Array | None,
    phase: jax.Array | int = 0,
    rescale: bool = False,
) -> PyTree:
    """SkipReduce reduce-scatter: each rank's own block, summed over N - k ranks.

    The reduce-scatter of ``lax.psum_scatter(x, axis_name,
    scatter_dimension=0, tiled=True)``, with k of its N - 1 sends skipped:
    rank r receives block r of every leaf summed over itself and N - 1 - k
    other ranks, and each device sends (N - 1 - k) / N of the buffer instead
    of (N - 1) / N. A leaf of leading size L is padded to ``N * ceil(L / N)``
    rows (block r is rows ``r * ceil(L / N)`` onwards; padding rows are zero).

    Static (``randomize=False``) always sums the ring's N - 1 - k nearest
    predecessors. Random: the shared ``key`` picks which N - 1 - k of the
    other ranks are summed, per buffer, so each is left out with probability
    k / (N - 1); the program is the same for every key (see
    :func:`scatter_contribution_mask`).

    Hierarchical (``inner_axis`` of size L, e.g. FSDP over every device with
    the slow axis outer): the blocks are those of ``lax.psum_scatter`` over
    ``(axis_name, inner_axis)``, N * L of them, device (o, i) owning block
    ``o * L + i`` (the layout ``P((axis_name, inner_axis))``). The buffer is
    first reduce-scattered in full over the fast inner axis, then the skipped
    scatter above runs over ``axis_name`` on 1/L of it: every element sums all
    L inner ranks of N - k outer ones, and (N - 1 - k) / N of 1/L of the
    buffer crosses the slow axis.

    Args:
      x: a pytree of arrays (floating or integer) with a leading axis.
      axis_name: the mesh axis to reduce over.
      key: a PRNG key identical on every rank (None for static or k = 0).
      config: a :class:`SkipConfig`, as in :func:`skip_psum`; a scatter
        reads neither its ``chunks_per_rank`` and ``layout`` nor the
        optimizer's fields. ``randomize=False`` is static: the same ranks
        are left out whatever the key. ``comm_dtype``: each piece crosses
        rounded to it and is added in ``accumulate_dtype`` (float32 when
        None); the owner's block comes back in the leaves' dtype (there is
        no gather). With float16, if any rank's block holds a NaN or Inf (a
        piece beyond 65504 crosses as Inf), every rank's whole block is
        NaN: the ranks agree by one ``pmin`` of a flag (float16 only).
      phase: the step's place in a balanced period (:func:`balanced_draw`
        with :func:`scatter_period`, not :func:`ring_period`: the scatter
        cycles through the N - 1 other ranks); 0: the key's own draw.
      rescale: multiply by N / (N - k).
      inner_axis: hierarchical mode: a second (fast) axis reduced in full.
      **options: as in :func:`skip_psum`: the ring settings but
        ``chunks_per_rank`` and ``layout``, and ``phase``, ``rescale`` and
        ``inner_axis``.

    Returns:
      This rank's blocks, ``[ceil(L / N), ...]`` per leaf (``N L`` blocks in
      hierarchical mode), varying per rank.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from skipreduce_jax import skip_psum_scatter
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def f(g):
      ...     return skip_psum_scatter(g, "data", key=jax.random.key(0), num_skip=0)
      >>> g = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P()))
      >>> out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(),
      ...                             out_specs=P("data")))(g)
      >>> out.shape, np.asarray(out)[0, 0].item()  # block r of the 8-rank sum
      ((8, 16), 8.0)
    """
    return _scatter(x, ring, key=key, phase=phase, scale=_rescale(rescale, ring))


def _rescale(rescale: Any, ring: RingSettings) -> float | None:
    """``rescale``'s factor N / (N - k), or None."""
    checks.check_bool(rescale, "rescale", api=ring.api,
                      meaning="True: multiply the sum by N / (N - k)")
    return ring.n / (ring.n - ring.num_skip) if rescale else None


@collective("phase", "inner_axis", reads=_SCATTER_READS)
def scatter_contribution_mask(
    x: PyTree,
    ring: RingSettings,
    *,
    key: jax.Array | None,
    phase: jax.Array | int = 0,
) -> PyTree:
    """Which of this rank's values :func:`skip_psum_scatter` sums.

    It takes the pytree passed to :func:`skip_psum_scatter` and the same
    arguments (``config``: a :class:`SkipConfig`, of which only the ring
    settings are read), and asks the same block plan and schedules, so the
    two always agree; with ``inner_axis`` (summed in full) a value is summed
    when its outer rank's is.

    Returns:
      A pytree of bool arrays shaped like ``x``: True where this rank's value
      is summed into its owner's block (padding rows excluded).
    """
    return scatter_mask(x, ring, key=key, phase=phase)


def scatter_mask(x: Any, ring: RingSettings, *, key: Any, phase: Any) -> Any:
    """:func:`scatter_contribution_mask` with its :class:`RingSettings`."""
    plan, schedules, leaves = _scatter_plan(x, ring, key, phase)
    rank = lax.axis_index(ring.axis_name)
    per_block = {i: jnp.repeat(s.contributes(rank), ring.inner)  # block o * L + i
                 for (_, indices), s in zip(plan.buckets, schedules) for i in indices}

    def mask(i, leaf):
        if i not in per_block:
            return jnp.ones(leaf.shape, jnp.bool_)
        rows = plan.block_shape(i)[0]
        by_row = jnp.repeat(per_block[i], rows)[:leaf.shape[0]]
        return jnp.broadcast_to(by_row.reshape((-1,) + (1,) * (leaf.ndim - 1)),
                                leaf.shape)

    return jax.tree_util.tree_unflatten(
        plan.treedef, [mask(i, leaf) for i, leaf in enumerate(leaves)])
