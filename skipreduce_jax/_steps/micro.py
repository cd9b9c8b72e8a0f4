"""Micro-batches: local gradients summed over slices of the batch, reduced once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

_API = "value_and_grad"


def accumulate(grad: Callable[..., Any], args: Sequence[Any], batch: Sequence[int],
               microbatches: int, *, has_aux: bool) -> tuple[Any, Any]:
    """``grad(*args)``, or averaged over ``microbatches`` slices of each rank's rows.

    The value is averaged too; each aux leaf comes back stacked, one entry per micro-batch.
    """
    if microbatches == 1:
        return grad(*args)
    for i in batch:
        for leaf in jax.tree_util.tree_leaves(args[i]):
            if np.shape(leaf)[0] % microbatches:
                raise ValueError(
                    f"{_API}: argument {i} has a leaf of shape {np.shape(leaf)} "
                    f"whose rows per rank do not split into microbatches="
                    f"{microbatches}: pass a batch whose rows per rank are a "
                    "multiple of microbatches.")
    micro = tuple(jax.tree_util.tree_map(lambda x: _cut(x, microbatches), args[i])
                  for i in batch)

    def call(part):
        full = list(args)
        for i, leaf in zip(batch, part, strict=True):
            full[i] = leaf
        return grad(*full)

    # The first micro-batch outside the scan: its grads start the carry, so
    # the carry has their types (varying per rank) with no zeros to build.
    first_out, first = call(jax.tree_util.tree_map(lambda x: x[0], micro))

    def body(total, part):
        out, grads = call(part)
        return jax.tree_util.tree_map(jnp.add, total, grads), out

    total, outs = lax.scan(body, first, jax.tree_util.tree_map(lambda x: x[1:], micro))
    outs = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([jnp.asarray(a)[None], b]),
                                  first_out, outs)
    grads = jax.tree_util.tree_map(lambda g: g / microbatches, total)
    if not has_aux:
        return jnp.mean(outs, axis=0), grads
    value, aux = outs
    return (jnp.mean(value, axis=0), aux), grads


def _cut(x: jax.Array, k: int) -> jax.Array:
    """``x``'s rows as ``(k, rows / k, ...)``: row ``i`` in micro-batch ``i % k``."""
    shape = (x.shape[0] // k, k) + x.shape[1:]
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is not None and any(e is not None for e in spec):
        spec = tuple(spec) + (None,) * (x.ndim - len(spec))
        x = jnp.reshape(x, shape, out_sharding=P(spec[0], None, *spec[1:]))
    else:
        x = jnp.reshape(x, shape)
    return jnp.moveaxis(x, 1, 0)

