"""What the methods of ``skipreduce_jax.contrib`` share.

The dense reference, :func:`full_comm_bytes`; the leaf sizes their byte counts
use; and :func:`method_settings`, which reads a method's keyword arguments.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from skipreduce_jax._ring import traffic
from skipreduce_jax._types import PyTree


def leaf_size(leaf: Any) -> int:
    """Number of elements of an array or ``jax.ShapeDtypeStruct``."""
    return math.prod(np.shape(leaf))


def leaf_bytes(leaf: Any) -> int:
    """Bytes of an array or ``jax.ShapeDtypeStruct`` in its own dtype."""
    return leaf_size(leaf) * np.dtype(leaf.dtype).itemsize


def full_comm_bytes(params: PyTree, n: int) -> float:
    """Bytes each device sends per step in a full ring all-reduce of every leaf.

    ``2 (N - 1) / N * sum(leaf bytes)``, the plain data-parallel step.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct`` shaped like the gradients.
      n: N, the size of the data axis.

    Example:
      >>> import jax.numpy as jnp
      >>> from skipreduce_jax.contrib import full_comm_bytes
      >>> full_comm_bytes({"w": jnp.zeros((1000, 100)), "b": jnp.zeros(100)}, 8)
      700700.0
    """
    nbytes = sum(leaf_bytes(x) for x in jax.tree_util.tree_leaves(params))
    return traffic.ring_allreduce_bytes(nbytes, n)


def method_settings(method: Callable[..., Any], kwargs: dict[str, Any], *,
                    api: str) -> dict[str, Any]:
    """Every argument of ``method`` by name, for ``axis_name="data"`` and ``kwargs``.

    A ``TypeError`` names ``api``, the byte-count function ``kwargs`` were passed to.
    """
    try:
        args = inspect.signature(method).bind("data", **kwargs)
    except TypeError as e:
        raise TypeError(f"{api}: {e}; it takes the keyword arguments of "
                        f"{method.__name__}.") from None
    args.apply_defaults()
    return dict(args.arguments)
