"""Bytes each device sends: the one set of traffic formulas.

A ring over N ranks moves a buffer of B bytes in pieces of B / N; SkipReduce
skips k of the reduce-scatter's N - 1 steps. ``comm_stats``, the cost model,
the benchmarks and ``skipreduce_jax.contrib`` all count with these functions
(the reduce-scatter and the all-gather apart where they send different dtypes).
"""

from __future__ import annotations

import fractions
import math

from skipreduce_jax._checks import check_int, check_num_skip, check_real


def _checked(nbytes: float, n: int, num_skip: int, n_name: str = "n") -> tuple[float, int, int]:
    n = check_int(n, n_name, minimum=1)
    k = check_num_skip(num_skip, n, n_name=n_name)
    return check_real(nbytes, "nbytes"), n, k


def skipreduce_steps(n: int, num_skip: int = 0) -> int:
    """Sequential steps of SkipReduce, ``2 * (n - 1) - num_skip`` (0 skipped: ring all-reduce).

    Args:
      n: Number of ranks, ``>= 1``.
      num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Example:
      >>> from skipreduce_jax.cost import skipreduce_steps
      >>> skipreduce_steps(8), skipreduce_steps(8, 7)
      (14, 7)
    """
    _, n, k = _checked(0, n, num_skip)
    return 2 * (n - 1) - k


def reduce_scatter_bytes(nbytes: float, n: int, num_skip: int = 0) -> float:
    """``(n - 1 - num_skip) * nbytes / n``: a ring reduce-scatter skipping ``num_skip`` steps.

    ``nbytes`` is the buffer per rank, in the dtype that is sent.

    Example:
      >>> from skipreduce_jax._ring.traffic import reduce_scatter_bytes
      >>> reduce_scatter_bytes(800, 8, 3)
      400.0
    """
    b, n, k = _checked(nbytes, n, num_skip)
    return (n - 1 - k) * b / n


def all_gather_bytes(nbytes: float, n: int) -> float:
    """``(n - 1) * nbytes / n``: a ring all-gather of an ``nbytes`` result.

    Example:
      >>> from skipreduce_jax._ring.traffic import all_gather_bytes
      >>> all_gather_bytes(800, 8)
      700.0
    """
    b, n, _ = _checked(nbytes, n, 0)
    return (n - 1) * b / n


def skipreduce_bytes(nbytes: float, n: int, num_skip: int) -> float:
    """Bytes each rank sends in SkipReduce: ``(2 * (n - 1) - num_skip) * nbytes / n``.

    Args:
      nbytes: Buffer size per rank in bytes, ``>= 0``.
      n: Number of ranks, ``>= 1``.
      num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Example:
      >>> from skipreduce_jax.cost import skipreduce_bytes
      >>> skipreduce_bytes(800, 8, 3)
      1100.0
      >>> skipreduce_bytes(800, 8, 7)  # all-gather only
      700.0
    """
    return reduce_scatter_bytes(nbytes, n, num_skip) + all_gather_bytes(nbytes, n)


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce: ``2 * (n - 1) / n * nbytes``.

    As :func:`skipreduce_bytes` with ``num_skip = 0``.

    Example:
      >>> from skipreduce_jax.cost import ring_allreduce_bytes
      >>> ring_allreduce_bytes(800, 8)
      1400.0
    """
    return skipreduce_bytes(nbytes, n, 0)


def traffic_fraction(n: int, num_skip: int) -> float:
    """Fraction of ring all-reduce traffic that SkipReduce sends.

    Args:
      n: Number of ranks, ``>= 1`` (``n = 1`` gives 1.0: nothing to save).
      num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Returns:
      ``(2 * (n - 1) - num_skip) / (2 * (n - 1))``, between 0.5 and 1.

    Example:
      >>> from skipreduce_jax.cost import traffic_fraction
      >>> traffic_fraction(8, 7)
      0.5
      >>> traffic_fraction(5, 2)
      0.75
    """
    steps = skipreduce_steps(n, num_skip)
    return steps / (2 * (n - 1)) if n > 1 else 1.0


def hierarchical_bytes(nbytes: float, n_outer: int, n_inner: int, num_skip: int
                       ) -> tuple[float, float]:
    """Bytes each device sends on each axis in hierarchical SkipReduce.

    Args:
      nbytes: Buffer size per device in bytes, ``>= 0``.
      n_outer: Size of the slow outer axis (hosts), ``>= 1``.
      n_inner: Size of the fast inner axis (devices per host), ``>= 1``.
      num_skip: Skipped outer reduce-scatter steps, in ``[0, n_outer - 1]``.

    Returns:
      ``(inner_bytes, outer_bytes)``: :func:`ring_allreduce_bytes` of ``nbytes``
      over ``n_inner``, and :func:`skipreduce_bytes` of ``nbytes / n_inner`` over ``n_outer``.

    Example:
      >>> from skipreduce_jax.cost import hierarchical_bytes
      >>> hierarchical_bytes(800, 4, 2, 0)
      (800.0, 600.0)
    """
    b, n_outer, k = _checked(nbytes, n_outer, num_skip, "n_outer")
    n_inner = check_int(n_inner, "n_inner", minimum=1)
    return ring_allreduce_bytes(b, n_inner), skipreduce_bytes(b / n_inner, n_outer, k)


def skip_ratio_to_num_skip(skip_ratio: float, n: int) -> int:
    """Converts a skip ratio into a number of skipped steps ``k``.

    The rule rounds half up: ``k = floor(skip_ratio * (n - 1) + 0.5)``, clipped
    to ``[0, n - 1]``. The ratio is read as the nearest fraction with a
    denominator up to ``max(10**6, n - 1)``, so decimal ratios round as written.

    Args:
        skip_ratio: Fraction of the ``n - 1`` reduce-scatter steps to skip, in
            ``[0, 1]``.
        n: Number of ranks, ``>= 1``.

    Example:
        >>> from skipreduce_jax.cost import skip_ratio_to_num_skip
        >>> skip_ratio_to_num_skip(0.5, 8), skip_ratio_to_num_skip(1.0, 8)
        (4, 7)
        >>> skip_ratio_to_num_skip(0.5, 4)  # 1.5 rounds up
        2
        >>> skip_ratio_to_num_skip(0.7, 46)  # 31.5, also in decimal ratios
        32
    """
    n = check_int(n, "n", minimum=1)
    r = check_real(skip_ratio, "skip_ratio")
    if r > 1:
        raise ValueError(f"skip_ratio must be in [0, 1], got {skip_ratio!r}")
    # The ratio meant (0.7 is 7/10, not the float next to it), so that 0.7 of
    # 45 steps, 31.5, rounds up; denominators up to n - 1 keep k / (n - 1) exact.
    exact = fractions.Fraction(float(r)).limit_denominator(max(10**6, n - 1))
    k = math.floor(exact * (n - 1) + fractions.Fraction(1, 2))
    return min(max(k, 0), n - 1)
