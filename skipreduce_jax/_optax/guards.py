"""Replica-consistency checks: cheap collectives that catch divergence.

:func:`check_replicated` compares two 32-bit checksums per leaf across the axis
(one ``pmin``, one ``pmax``); :func:`assert_replicated` wraps it outside ``shard_map``.

An error raised in a host callback (``skip_reduce(verify_sync=True)``'s check)
reaches the caller wrapped in a ``JaxRuntimeError``: :func:`host_check` counts the
programs traced with such a check and :func:`raise_in_callback` keeps the error, so
that the training steps can raise it as it was (:func:`callback_error`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from skipreduce_jax._checks import axis_size
from skipreduce_jax._ring.shards import spec_axes
from skipreduce_jax._types import PyTree
from skipreduce_jax._vma import cast_varying, vma_checked

# Two seeds: two independent 32-bit checksums per leaf.
_SEEDS = (0x2545F491, 0x9E3779B9)

# Errors raised in host callbacks, until a caller unwraps them (a few at most:
# every device raises the same one).
_raised: list[Exception] = []
_raised_lock = threading.Lock()
_host_checks_traced = 0


def host_check(check: Callable[..., None], *args: Any) -> None:
    """``jax.debug.callback(check, *args)``, counted as a traced host check.

    ``check`` raises with :func:`raise_in_callback`.
    """
    global _host_checks_traced
    _host_checks_traced += 1
    jax.debug.callback(check, *args)


def host_checks_traced() -> int:
    """How many host checks have been traced so far (in any program)."""
    return _host_checks_traced


def raise_in_callback(error: Exception) -> NoReturn:
    """Raises ``error`` in a host callback, kept for :func:`callback_error`."""
    with _raised_lock:
        if all(str(e) != str(error) for e in _raised):
            _raised.append(error)
            del _raised[:-8]
    raise error


def callback_error(wrapped: Exception) -> Exception | None:
    """The error :func:`raise_in_callback` kept whose message ``wrapped`` carries.

    Returned without its traceback and forgotten from then on; None if none.
    """
    text = str(wrapped)
    with _raised_lock:
        for error in _raised:
            if str(error) in text:
                _raised.remove(error)
                return error.with_traceback(None)
    return None


def mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that spreads every bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(leaf: jax.Array) -> jax.Array:
    """The leaf's bits as a flat uint32 vector (all of them, 64-bit too)."""
    flat = jnp.ravel(leaf)
    if flat.dtype == jnp.bool_:
        flat = flat.astype(jnp.uint8)
    if jnp.issubdtype(flat.dtype, jax.dtypes.prng_key):
        flat = jnp.ravel(jax.random.key_data(flat))
    if flat.dtype.itemsize >= 4:  # 8-byte values become two words each
        return jnp.ravel(lax.bitcast_convert_type(flat, jnp.uint32))
    bits = jnp.dtype(f"uint{8 * flat.dtype.itemsize}")
    return lax.bitcast_convert_type(flat, bits).astype(jnp.uint32)


def _checksums(leaf: jax.Array) -> jax.Array:
    """uint32[2]: two sums of a keyed hash of each word and its position.

    Each term is a bijection of its word, so copies that differ in one word
    always differ in both sums; the hash is not linear, so differences in
    several words (a negated leaf, zeros against ones, ulps that cancel) do
    not cancel either, except by chance (about 2**-64).
    """
    words = _words(leaf)
    position = jnp.arange(words.size, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(mix32(words ^ mix32(position + jnp.uint32(seed))), dtype=jnp.uint32)
                      for seed in _SEEDS])


def leaf_agreement(tree: PyTree, axis_name: str | tuple[str, ...]) -> Any:
    """Per leaf: True if the leaf is bit-identical on every rank of the axis.

    Args:
      tree: a pytree of arrays (params, optimizer state, a key).
      axis_name: the mesh axis (or axes) to compare over.

    Returns:
      A pytree of bool scalars, typed replicated, with ``tree``'s structure.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    for a in axes:
        axis_size(a, api="check_replicated")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    if not leaves:
        return tree
    sums = jnp.stack([_checksums(leaf) for leaf in leaves])
    if vma_checked(axes[0]):
        # Values typed replicated would be compared with themselves for free.
        sums = cast_varying(sums, axes)
    same = jnp.all(lax.pmin(sums, axes) == lax.pmax(sums, axes), axis=1)
    return jax.tree_util.tree_unflatten(treedef, list(same))


def check_replicated(tree: PyTree, axis_name: str | tuple[str, ...]) -> jax.Array:
    """True if every leaf of ``tree`` is bit-identical across ``axis_name``.

    Call inside ``shard_map``, e.g. every K steps on the params.

    Args:
      tree: a pytree of arrays.
      axis_name: the mesh axis (or axes) to compare over.

    Returns:
      A bool scalar, typed replicated.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from skipreduce_jax import check_replicated
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda w: check_replicated(w, "data"),
      ...                           mesh=mesh, in_specs=P(), out_specs=P()))
      >>> bool(f(jnp.ones(4)))
      True
    """
    flags = jax.tree_util.tree_leaves(leaf_agreement(tree, axis_name))
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def assert_replicated(tree: PyTree, mesh: jax.sharding.Mesh,
                      axis_name: str | tuple[str, ...] | None = None) -> None:
    """Raises if any leaf of a replicated ``tree`` differs between devices.

    Args:
      tree: a pytree of arrays on ``mesh`` (e.g. params), replicated over the
        axes compared; a leaf sharded over other axes is compared shard by shard.
      mesh: the device mesh.
      axis_name: the axes to compare over (default: every mesh axis no leaf is sharded over).

    Raises:
      AssertionError: naming the leaves whose copies differ.
    """
    # Each device compares its own shard, over the axes the leaf is not sharded over.
    specs = jax.tree_util.tree_map(
        lambda x: x.sharding.spec if isinstance(
            getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == mesh
        else P(), tree)
    sharded = {a for spec in jax.tree_util.tree_leaves(
        specs, is_leaf=lambda s: isinstance(s, P)) for a in spec_axes(spec)}
    if axis_name is None:
        axes = tuple(a for a in mesh.axis_names if a not in sharded)
    else:
        axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        both = sorted(set(axes) & sharded)
        if both:
            raise ValueError(
                f"assert_replicated: axis_name={axis_name!r}, but some leaves "
                f"are sharded over {both}: their devices hold different parts.")
    if not axes:
        return
    # The data is declared varying so that shard_map does not assume it equal.
    flags = jax.jit(jax.shard_map(
        lambda t: leaf_agreement(t, axes), mesh=mesh, in_specs=(specs,),
        out_specs=P(), check_vma=False))(tree)
    paths = [jax.tree_util.keystr(path) for path, ok in
             jax.tree_util.tree_flatten_with_path(flags)[0] if not bool(ok)]
    if paths:
        raise AssertionError(
            f"assert_replicated: these leaves differ between devices over "
            f"{axes}: {', '.join(paths)}. Replicas have diverged (a rank-"
            "dependent key, a non-deterministic op, or a missing reduction).")

