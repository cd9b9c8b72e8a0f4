"""``mean_count``: a batch's count made global where the loss runs per rank.

The library's per-rank bodies (``value_and_grad``'s, ``data_parallel``'s)
say which data axes they run over while the user's code is traced;
``mean_count`` reads it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from skipreduce_jax._steps.replay import MEAN_COUNT, mark, tracing_for_replay
from skipreduce_jax._vma import varying_axes, vma_checked

_AXES: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "skipreduce_count_axes", default=None)


def mean_count(count: jax.Array) -> jax.Array:
    """A batch's count as a loss that divides by it must see it on each rank.

    A loss that divides a sum by a count taken from its batch (tokens that
    are not padding, example weights) is exact on the global batch only if
    it divides by the global count: divide by ``mean_count(count)``. The mean
    over ranks of the per-rank losses, and of their gradients, is then the
    global sum over the global count (a rank whose rows are all padding does
    not divide by 0), the same as plain ``jax.value_and_grad`` gives (at
    ``num_skip=0``), padded batches included. A count the same on every rank
    (a constant such as the global batch size, ``mean_count(64.0)``) is
    already global: its share per rank is ``count / N``, with the same effect.

    Args:
      count: an array (e.g. ``jnp.sum(mask)``), computed from this rank's
        rows inside :func:`value_and_grad` or a :func:`data_parallel` step.

    Returns:
      ``lax.pmean(count, data axes)`` inside :func:`value_and_grad` and the library's
      per-rank steps (:func:`data_parallel`, :func:`make_train_step`, ``skipreduce_jax.nnx``),
      else ``count``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import skipreduce_jax as sr
      >>> mesh = jax.make_mesh((8,), ("data",))
      >>> def loss_fn(w, batch):
      ...     x, mask = batch
      ...     return jnp.sum(mask * (x * w) ** 2) / sr.mean_count(jnp.sum(mask))
      >>> x = jnp.arange(16.0)
      >>> mask = (x % 3 > 0).astype(jnp.float32)  # padding: uneven per rank
      >>> plain = jax.value_and_grad(loss_fn)(1.0, (x, mask))
      >>> with jax.set_mesh(mesh):
      ...     skipped = jax.jit(lambda w: sr.value_and_grad(
      ...         loss_fn, mesh, "data", step=0, num_skip=0)(w, (x, mask)))(1.0)
      >>> bool(jnp.allclose(plain[0], skipped[0])), bool(
      ...     jnp.allclose(plain[1], skipped[1]))
      (True, True)
    """
    if tracing_for_replay():
        return mark(MEAN_COUNT, count)
    axes = _AXES.get()
    return count if axes is None else global_count(count, axes)


def global_count(count: Any, axes: tuple[str, ...], varying: bool | None = None) -> Any:
    """:func:`mean_count` in a per-rank body over the data ``axes``.

    ``varying``: whether ``count`` differs per rank (None: from its type).
    """
    count = jnp.asarray(count)
    if varying is None:
        varying = not vma_checked(axes[0]) or bool(varying_axes(count) & set(axes))
    if not varying:
        # The same on every rank: already the global count (a constant such
        # as the global batch size); each rank's share of it is count / N.
        return count / math.prod(lax.axis_size(a) for a in axes)
    return lax.pmean(count, axes)


@contextlib.contextmanager
def counting_over(axes: tuple[str, ...]) -> Iterator[None]:
    """Traces the body inside as a per-rank body over the data ``axes``."""
    token = _AXES.set(axes)
    try:
        yield
    finally:
        _AXES.reset(token)
