"""Alpha-beta cost model for ring all-reduce, SkipReduce and hierarchical SkipReduce.

This module predicts the communication time of one gradient all-reduce, and of
SkipReduce at a given number of skipped reduce-scatter steps, from three link
constants. It can also calibrate those constants from benchmark measurements and
check the predictions against another run. It depends only on numpy and the
standard library.

Model
-----
A ring all-reduce over ``n`` ranks of a buffer of ``B`` bytes per rank is a
reduce-scatter of ``n - 1`` steps followed by an all-gather of ``n - 1`` steps;
every step sends one chunk of ``B / n`` bytes to the next rank. SkipReduce with
``k`` skipped steps (``0 <= k <= n - 1``) runs only ``n - 1 - k`` reduce-scatter
steps, so per rank it takes ``2 (n - 1) - k`` steps and sends
``(2 (n - 1) - k) * B / n`` bytes, a fraction ``(2 (n - 1) - k) / (2 (n - 1))`` of
the full ring. ``k = 0`` is the ordinary ring all-reduce; ``k = n - 1`` leaves only
the all-gather, ``(n - 1) / n * B`` bytes.

The time of one collective call is::

    seconds = call_overhead + steps * alpha + bytes_per_rank_on_wire / bandwidth

where ``alpha`` is the per-step latency (s), ``bandwidth`` the per-rank link
bandwidth (bytes/s) and ``call_overhead`` a constant per call (s): dispatch,
synchronisation and the local reduction setup. The three constants form a
:class:`LinkModel`.

Hierarchical SkipReduce runs on a mesh with a fast inner axis of size ``L``
(devices of one host) and a slow outer axis of size ``N`` (hosts), as three
calls in sequence:

1. reduce-scatter over the inner axis on ``inner_link``: ``L - 1`` steps,
   ``(L - 1) / L * B`` bytes per device;
2. SkipReduce all-reduce over the outer axis on the ``B / L`` shard on
   ``outer_link``: ``2 (N - 1) - k`` steps, ``(2 (N - 1) - k) * B / (L * N)``
   bytes per device;
3. all-gather over the inner axis on ``inner_link``, the same as step 1.

An axis of size 1 issues no call and costs nothing, so ``L = 1`` reduces to the
flat model on ``outer_link``. ``outer_link.bandwidth`` is what one device gets on
the slow network while all ``L`` devices of its host send at once (the host NIC
bandwidth divided by ``L`` when they share one NIC).

Assumptions and limits
----------------------
* Bandwidth-bound ring: every rank sends one chunk per step and all links run in
  parallel at the same speed; the slowest link is what ``bandwidth`` describes.
* No congestion, no contention between jobs, no topology (switch hops,
  oversubscription, NVLink vs PCIe paths), no in-network reduction (SHARP).
* No overlap with compute: the prediction is the exposed time of the call.
* Chunk padding when ``B`` is not divisible by ``n`` and the cost of the local
  additions are ignored (the latter is folded into ``alpha`` when fitted).
* NCCL and gloo pipeline each step into smaller pieces and may choose tree or
  other algorithms for a native ``psum``; the fitted ``alpha`` and
  ``call_overhead`` are therefore effective values for the measured setup, not
  wire latencies, and do not transfer to other message sizes far outside the
  fitted range, other group sizes or other backends without re-checking.
* Group size: every ``n`` must be an integer ``>= 1``. A group of one rank
  communicates nothing: 0 steps, 0 bytes, predicted time 0 (no call overhead),
  and a traffic fraction of 1.0. There is no upper limit on ``n``.

Skip ratio
----------
A skip ratio ``r`` in ``[0, 1]`` is turned into a step count by rounding half up::

    k = floor(r * (n - 1) + 0.5), clipped to [0, n - 1]

so for ``n = 8``: ``r = 0.5 -> k = 4``, ``r = 0 -> k = 0``, ``r = 1 -> k = 7``.
``k / (n - 1)`` maps back to the same ``k``.

Calibration
-----------
Record each benchmark point as a :class:`Measurement` ``(n, num_skip, nbytes,
seconds, kind)``: ``nbytes`` is the full gradient buffer size per rank (not the
bytes on the wire), ``seconds`` the wall time of one call (e.g. the median over
repeats) and ``kind`` one of ``'skip'`` (SkipReduce with ``num_skip`` skipped
steps), ``'ring'`` (the ppermute ring all-reduce) or ``'psum'`` (the backend's
native all-reduce); the last two must have ``num_skip = 0`` and are modelled as a
ring. Write them to a JSON file, either a list of objects or an object with a
``"measurements"`` list, e.g.::

    {"measurements": [
        {"n": 8, "num_skip": 0, "nbytes": 4000000, "seconds": 0.0041, "kind": "ring"},
        {"n": 8, "num_skip": 4, "nbytes": 4000000, "seconds": 0.0029, "kind": "skip"}
    ]}

Other keys in each object are ignored; ``num_skip`` may be omitted for
``'ring'`` and ``'psum'``. :func:`fit_link_model` solves a non-negative least
squares problem for ``(call_overhead, alpha, 1 / bandwidth)``; :func:`validate`
compares a model with another set of points. To separate ``alpha`` from
``bandwidth`` vary the message size; to separate ``alpha`` from
``call_overhead`` vary ``num_skip`` or ``n``. Fit different kinds separately
when they use different code paths (``--kind`` in the CLI).

Command line
------------
``python -m skipreduce_jax.cost {predict,target,fit,check} ...``; see ``--help``
of each subcommand. Sizes accept decimal (``KB``, ``MB``, ``GB``, ``TB``) and
binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) units; times accept ``s``, ``ms``,
``us`` and ``ns`` (a bare number is seconds). Every subcommand prints aligned
plain-text tables, or JSON with ``--json``.

* ``predict``: time of ring all-reduce and SkipReduce at each ``--k`` or
  ``--ratio`` with speedups; hierarchical with ``--inner L --inner-gbit X``
  (then ``--gbit`` is each device's outer bandwidth: in the second example
  every GPU has its own 25 Gbit/s NIC; with one NIC per host of L devices,
  pass the NIC's rate / L)::

      python -m skipreduce_jax.cost predict --n 8 --size 100MB --gbit 100 \\
          --alpha 10us --overhead 50us --k 0 2 4 7
      python -m skipreduce_jax.cost predict --n 16 --params 25M --dtype bfloat16 \\
          --gbit 25 --inner 8 --inner-gbit 2400 --ratio 0 0.5 1

* ``target``: the smallest ``k`` (and its skip ratio) that meets ``--time``::

      python -m skipreduce_jax.cost target --n 64 --size 1GB --gbit 100 --time 150ms

* ``fit``: calibrate a :class:`LinkModel` from a measurement file, print it and
  the residuals, optionally check it against another file and save it::

      python -m skipreduce_jax.cost fit measurements.json --check other.json \\
          --save link.json

* ``check``: predicted vs measured for a given model (``--model link.json`` or
  link flags)::

      python -m skipreduce_jax.cost check other.json --model link.json

``predict``, ``target`` and ``check`` accept ``--model FILE`` (a file written by
``fit --save``) instead of ``--gbit``/``--gbyte``, ``--alpha`` and
``--overhead``.
"""

from __future__ import annotations

import argparse
import dataclasses
import fractions
import json
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = [
    "DTYPE_BYTES",
    "KINDS",
    "LinkModel",
    "Measurement",
    "Validation",
    "fit_link_model",
    "hierarchical_bytes",
    "load_link_model",
    "load_measurements",
    "main",
    "parse_count",
    "parse_seconds",
    "parse_size",
    "predict_allreduce",
    "predict_hierarchical",
    "predict_hierarchical_allreduce",
    "predict_measurement",
    "predict_skipreduce",
    "required_num_skip",
    "required_num_skip_hierarchical",
    "required_skip_ratio",
    "ring_allreduce_bytes",
    "save_link_model",
    "save_measurements",
    "skip_ratio_to_num_skip",
    "skipreduce_bytes",
    "skipreduce_steps",
    "traffic_fraction",
    "validate",
]

KINDS: tuple[str, ...] = ("skip", "ring", "psum")
"""Measurement kinds understood by :class:`Measurement`."""

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "fp64": 8,
    "f64": 8,
    "float32": 4,
    "fp32": 4,
    "f32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "f16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element for the ``--dtype`` names accepted by the CLI."""


# --------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------


def _check_int(name: str, value: Any, minimum: int) -> int:
    """Returns ``value`` as an int, raising if it is not an integer ``>= minimum``."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if ivalue < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {ivalue}")
    return ivalue


def _check_real(name: str, value: Any, *, positive: bool = False) -> float:
    """Returns ``value`` as a float, raising if it is negative, NaN or infinite.

    With ``positive=True`` zero is rejected too.
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        fvalue = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(fvalue):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not fvalue > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if fvalue < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return fvalue


def _check_num_skip(num_skip: Any, n: int, n_name: str = "n") -> int:
    k = _check_int("num_skip", num_skip, 0)
    if k > n - 1:
        raise ValueError(f"num_skip must be in [0, {n_name} - 1] = [0, {n - 1}], got {k}")
    return k


# --------------------------------------------------------------------------
# Link model
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """Alpha-beta constants of one kind of link.

    One collective call that takes ``steps`` sequential steps and sends
    ``nbytes`` bytes per rank costs
    ``call_overhead + steps * alpha + nbytes / bandwidth`` seconds.

    Attributes:
        alpha: Latency per step in seconds, ``>= 0``.
        bandwidth: Bandwidth per rank in bytes per second, finite and ``> 0``.
        call_overhead: Constant cost of one call in seconds, ``>= 0``.

    Example:
        >>> link = LinkModel.from_gbit(100, alpha=10e-6)
        >>> link.bandwidth
        12500000000.0
        >>> link.time(steps=14, nbytes=1.25e9)
        0.10014
    """

    alpha: float
    bandwidth: float
    call_overhead: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "alpha", _check_real("alpha", self.alpha))
        object.__setattr__(
            self, "bandwidth", _check_real("bandwidth", self.bandwidth, positive=True)
        )
        object.__setattr__(
            self, "call_overhead", _check_real("call_overhead", self.call_overhead)
        )

    @classmethod
    def from_gbit(
        cls, gbit_per_s: float, alpha: float = 0.0, call_overhead: float = 0.0
    ) -> LinkModel:
        """Builds a model from a bandwidth in Gbit/s (``1e9`` bits per second).

        Args:
            gbit_per_s: Bandwidth per rank in Gbit/s, ``> 0``.
            alpha: Latency per step in seconds.
            call_overhead: Constant cost per call in seconds.

        Returns:
            The link model, with ``bandwidth = gbit_per_s * 1e9 / 8`` bytes/s.

        Example:
            >>> LinkModel.from_gbit(400).bandwidth
            50000000000.0
        """
        g = _check_real("gbit_per_s", gbit_per_s, positive=True)
        return cls(alpha=alpha, bandwidth=g * 1e9 / 8.0, call_overhead=call_overhead)

    @classmethod
    def from_gbyte(
        cls, gbyte_per_s: float, alpha: float = 0.0, call_overhead: float = 0.0
    ) -> LinkModel:
        """Builds a model from a bandwidth in GB/s (``1e9`` bytes per second).

        Args:
            gbyte_per_s: Bandwidth per rank in GB/s, ``> 0``.
            alpha: Latency per step in seconds.
            call_overhead: Constant cost per call in seconds.

        Returns:
            The link model, with ``bandwidth = gbyte_per_s * 1e9`` bytes/s.

        Example:
            >>> LinkModel.from_gbyte(25).bandwidth
            25000000000.0
        """
        g = _check_real("gbyte_per_s", gbyte_per_s, positive=True)
        return cls(alpha=alpha, bandwidth=g * 1e9, call_overhead=call_overhead)

    @property
    def gbit_per_s(self) -> float:
        """Bandwidth in Gbit/s."""
        return self.bandwidth * 8.0 / 1e9

    def time(self, steps: float, nbytes: float) -> float:
        """Predicts the time of one call.

        Args:
            steps: Number of sequential steps, ``>= 0``.
            nbytes: Bytes sent per rank on the wire, ``>= 0``.

        Returns:
            ``call_overhead + steps * alpha + nbytes / bandwidth`` in seconds.

        Example:
            >>> LinkModel(alpha=1e-6, bandwidth=1e9, call_overhead=5e-6).time(4, 1e6)
            0.001009
        """
        s = _check_real("steps", steps)
        b = _check_real("nbytes", nbytes)
        return self.call_overhead + s * self.alpha + b / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        """Returns the constants as a JSON-serialisable dict.

        Returns:
            ``{"alpha": ..., "bandwidth": ..., "call_overhead": ...}``.

        Example:
            >>> LinkModel(alpha=1e-6, bandwidth=1e9).to_dict()
            {'alpha': 1e-06, 'bandwidth': 1000000000.0, 'call_overhead': 0.0}
        """
        return {
            "alpha": self.alpha,
            "bandwidth": self.bandwidth,
            "call_overhead": self.call_overhead,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinkModel:
        """Builds a model from :meth:`to_dict` output.

        Args:
            data: Mapping with ``alpha`` and ``bandwidth`` (bytes/s) and
                optionally ``call_overhead``; other keys are ignored.

        Returns:
            The link model.

        Example:
            >>> LinkModel.from_dict({"alpha": 0, "bandwidth": 1e9}).bandwidth
            1000000000.0
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"link model must be a JSON object, got {type(data).__name__}")
        missing = [key for key in ("alpha", "bandwidth") if key not in data]
        if missing:
            raise ValueError(f"link model is missing key(s) {missing}")
        return cls(
            alpha=data["alpha"],
            bandwidth=data["bandwidth"],
            call_overhead=data.get("call_overhead", 0.0),
        )


def save_link_model(path: str | os.PathLike[str], model: LinkModel) -> None:
    """Writes a link model to a JSON file.

    Args:
        path: Destination file.
        model: The model to write.

    Returns:
        None.

    Example:
        >>> save_link_model("link.json", LinkModel.from_gbit(100))  # doctest: +SKIP
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"model": model.to_dict()}, f, indent=2)
        f.write("\n")


def load_link_model(path: str | os.PathLike[str]) -> LinkModel:
    """Reads a link model from a JSON file.

    The file holds either the constants directly or an object with a
    ``"model"`` key (as written by :func:`save_link_model` and by
    ``fit --json``).

    Args:
        path: File to read.

    Returns:
        The link model.

    Example:
        >>> load_link_model("link.json")  # doctest: +SKIP
        LinkModel(alpha=1e-05, bandwidth=12500000000.0, call_overhead=0.0)
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, Mapping) and "model" in data:
        data = data["model"]
    return LinkModel.from_dict(data)


# --------------------------------------------------------------------------
# Byte and step formulas
# --------------------------------------------------------------------------


def skipreduce_steps(n: int, num_skip: int = 0) -> int:
    """Counts the sequential steps of SkipReduce (``num_skip = 0``: ring all-reduce).

    Args:
        n: Number of ranks, ``>= 1``.
        num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Returns:
        ``2 * (n - 1) - num_skip``.

    Example:
        >>> skipreduce_steps(8), skipreduce_steps(8, 7)
        (14, 7)
    """
    n = _check_int("n", n, 1)
    k = _check_num_skip(num_skip, n)
    return 2 * (n - 1) - k


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes each rank sends in a ring all-reduce.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1``.

    Returns:
        ``2 * (n - 1) / n * nbytes``.

    Example:
        >>> ring_allreduce_bytes(800, 8)
        1400.0
    """
    return skipreduce_bytes(nbytes, n, 0)


def skipreduce_bytes(nbytes: float, n: int, num_skip: int) -> float:
    """Bytes each rank sends in SkipReduce with ``num_skip`` skipped steps.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1``.
        num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Returns:
        ``(2 * (n - 1) - num_skip) * nbytes / n``.

    Example:
        >>> skipreduce_bytes(800, 8, 3)
        1100.0
        >>> skipreduce_bytes(800, 8, 7)  # all-gather only
        700.0
    """
    b = _check_real("nbytes", nbytes)
    steps = skipreduce_steps(n, num_skip)
    return steps * b / n


def traffic_fraction(n: int, num_skip: int) -> float:
    """Fraction of ring all-reduce traffic that SkipReduce sends.

    Args:
        n: Number of ranks, ``>= 1`` (``n = 1`` gives 1.0: nothing to save).
        num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.

    Returns:
        ``(2 * (n - 1) - num_skip) / (2 * (n - 1))``, between 0.5 and 1.

    Example:
        >>> traffic_fraction(8, 7)
        0.5
        >>> traffic_fraction(5, 2)
        0.75
    """
    steps = skipreduce_steps(n, num_skip)
    if n == 1:
        return 1.0
    return steps / (2 * (n - 1))


def skip_ratio_to_num_skip(skip_ratio: float, n: int) -> int:
    """Converts a skip ratio into a number of skipped steps.

    The rule rounds half up: ``k = floor(skip_ratio * (n - 1) + 0.5)``, clipped
    to ``[0, n - 1]``.

    Args:
        skip_ratio: Fraction of the ``n - 1`` reduce-scatter steps to skip, in
            ``[0, 1]``.
        n: Number of ranks, ``>= 1``.

    Returns:
        The number of skipped steps ``k``.

    Example:
        >>> skip_ratio_to_num_skip(0.5, 8), skip_ratio_to_num_skip(1.0, 8)
        (4, 7)
        >>> skip_ratio_to_num_skip(0.5, 4)  # 1.5 rounds up
        2
        >>> skip_ratio_to_num_skip(0.7, 46)  # 31.5, also in decimal ratios
        32
    """
    n = _check_int("n", n, 1)
    r = _check_real("skip_ratio", skip_ratio)
    if r > 1:
        raise ValueError(f"skip_ratio must be in [0, 1], got {skip_ratio!r}")
    # Exact arithmetic on the ratio meant (0.7 is 7/10 and 1/6 is 1/6, not
    # the floats next to them), so that 0.7 of 45 steps, 31.5, rounds up.
    # Denominators up to n - 1 keep k / (n - 1) exact for any n up to ~1e8
    # (fractions that close differ by far more than a float's error).
    exact = fractions.Fraction(float(r)).limit_denominator(max(10**6, n - 1))
    k = math.floor(exact * (n - 1) + fractions.Fraction(1, 2))
    return min(max(k, 0), n - 1)


def hierarchical_bytes(
    nbytes: float, n_outer: int, n_inner: int, num_skip: int
) -> tuple[float, float]:
    """Bytes each device sends on each axis in hierarchical SkipReduce.

    Args:
        nbytes: Buffer size per device in bytes, ``>= 0``.
        n_outer: Size of the slow outer axis (hosts), ``>= 1``.
        n_inner: Size of the fast inner axis (devices per host), ``>= 1``.
        num_skip: Skipped outer reduce-scatter steps, in ``[0, n_outer - 1]``.

    Returns:
        ``(inner_bytes, outer_bytes)``: ``2 * (L - 1) / L * nbytes`` for the inner
        reduce-scatter plus all-gather, and
        ``(2 * (N - 1) - num_skip) * nbytes / (L * N)`` for the outer SkipReduce.

    Example:
        >>> hierarchical_bytes(800, 4, 2, 0)
        (800.0, 600.0)
    """
    b = _check_real("nbytes", nbytes)
    n_outer = _check_int("n_outer", n_outer, 1)
    n_inner = _check_int("n_inner", n_inner, 1)
    k = _check_num_skip(num_skip, n_outer, "n_outer")
    inner = 2.0 * (n_inner - 1) / n_inner * b
    outer = skipreduce_bytes(b / n_inner, n_outer, k)
    return inner, outer


# --------------------------------------------------------------------------
# Time predictions
# --------------------------------------------------------------------------


def predict_allreduce(nbytes: float, n: int, link: LinkModel) -> float:
    """Predicts the time of one ring all-reduce.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1`` (``n = 1`` costs 0).
        link: Link constants.

    Returns:
        Seconds: ``call_overhead + 2 (n - 1) alpha + 2 (n - 1) / n * nbytes / bandwidth``.

    Example:
        >>> round(predict_allreduce(1e9, 8, LinkModel.from_gbit(100)), 9)
        0.14
    """
    return predict_skipreduce(nbytes, n, 0, link)


def predict_skipreduce(nbytes: float, n: int, num_skip: int, link: LinkModel) -> float:
    """Predicts the time of one SkipReduce all-reduce.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1`` (``n = 1`` costs 0).
        num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``.
        link: Link constants.

    Returns:
        Seconds: ``call_overhead + (2 (n - 1) - k) * (alpha + nbytes / (n * bandwidth))``.

    Example:
        >>> round(predict_skipreduce(1e9, 8, 7, LinkModel.from_gbit(100)), 9)
        0.07
    """
    if not isinstance(link, LinkModel):
        raise TypeError(f"link must be a LinkModel, got {type(link).__name__}")
    wire = skipreduce_bytes(nbytes, n, num_skip)
    if n == 1:
        return 0.0
    return link.time(skipreduce_steps(n, num_skip), wire)


def _hierarchical_phases(
    nbytes: float,
    n_outer: int,
    n_inner: int,
    num_skip: int,
    outer_link: LinkModel,
    inner_link: LinkModel,
) -> tuple[float, float]:
    """Returns ``(inner_seconds, outer_seconds)`` of hierarchical SkipReduce."""
    if not isinstance(outer_link, LinkModel):
        raise TypeError(f"outer_link must be a LinkModel, got {type(outer_link).__name__}")
    if not isinstance(inner_link, LinkModel):
        raise TypeError(f"inner_link must be a LinkModel, got {type(inner_link).__name__}")
    inner_bytes, _ = hierarchical_bytes(nbytes, n_outer, n_inner, num_skip)
    if n_inner > 1:
        # Reduce-scatter and all-gather, one call each.
        inner = 2.0 * inner_link.time(n_inner - 1, inner_bytes / 2.0)
    else:
        inner = 0.0
    outer = predict_skipreduce(float(nbytes) / n_inner, n_outer, num_skip, outer_link)
    return inner, outer


def predict_hierarchical(
    nbytes: float,
    n_outer: int,
    n_inner: int,
    num_skip: int,
    outer_link: LinkModel,
    inner_link: LinkModel,
) -> float:
    """Predicts the time of hierarchical SkipReduce.

    Inner reduce-scatter, outer SkipReduce on the ``nbytes / n_inner`` shard and
    inner all-gather run one after another; an axis of size 1 costs nothing.

    Args:
        nbytes: Buffer size per device in bytes, ``>= 0``.
        n_outer: Size of the slow outer axis (hosts), ``>= 1``.
        n_inner: Size of the fast inner axis (devices per host), ``>= 1``.
        num_skip: Skipped outer reduce-scatter steps, in ``[0, n_outer - 1]``.
        outer_link: Constants of the slow network, per device.
        inner_link: Constants of the fast intra-host links.

    Returns:
        Seconds for the three calls together.

    Example:
        >>> slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
        >>> round(predict_hierarchical(1e9, 4, 8, 3, slow, fast), 6)
        0.025
    """
    inner, outer = _hierarchical_phases(
        nbytes, n_outer, n_inner, num_skip, outer_link, inner_link
    )
    return inner + outer


def predict_hierarchical_allreduce(
    nbytes: float,
    n_outer: int,
    n_inner: int,
    outer_link: LinkModel,
    inner_link: LinkModel,
) -> float:
    """Predicts the time of a hierarchical all-reduce without skipping.

    Args:
        nbytes: Buffer size per device in bytes, ``>= 0``.
        n_outer: Size of the slow outer axis (hosts), ``>= 1``.
        n_inner: Size of the fast inner axis (devices per host), ``>= 1``.
        outer_link: Constants of the slow network, per device.
        inner_link: Constants of the fast intra-host links.

    Returns:
        Seconds; equal to ``predict_hierarchical(..., num_skip=0, ...)``.

    Example:
        >>> slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
        >>> round(predict_hierarchical_allreduce(1e9, 4, 8, slow, fast), 6)
        0.0325
    """
    return predict_hierarchical(nbytes, n_outer, n_inner, 0, outer_link, inner_link)


def _smallest_k(time_of_k: Callable[[int], float], k_max: int, target: float) -> int | None:
    """Smallest ``k`` in ``[0, k_max]`` with ``time_of_k(k) <= target``.

    ``time_of_k`` must be non-increasing, which holds for the model because
    every term decreases with ``k`` and float rounding is monotone.
    """
    if time_of_k(k_max) > target:
        return None
    lo, hi = 0, k_max  # time_of_k(hi) <= target
    while lo < hi:
        mid = (lo + hi) // 2
        if time_of_k(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def required_num_skip(
    nbytes: float, n: int, link: LinkModel, target_seconds: float
) -> int | None:
    """Finds the fewest skipped steps that meet a communication time target.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1``.
        link: Link constants.
        target_seconds: Time budget for one call in seconds, ``>= 0``.

    Returns:
        The smallest ``k`` in ``[0, n - 1]`` with
        ``predict_skipreduce(nbytes, n, k, link) <= target_seconds``, or None if
        even ``k = n - 1`` is too slow. Its skip ratio is ``k / (n - 1)``
        (:func:`required_skip_ratio`).

    Example:
        >>> link = LinkModel.from_gbit(100)
        >>> required_num_skip(1e9, 8, link, 0.1), required_num_skip(1e9, 8, link, 0.05)
        (4, None)
    """
    n = _check_int("n", n, 1)
    target = _check_real("target_seconds", target_seconds)
    predict_skipreduce(nbytes, n, 0, link)  # validates nbytes and link
    return _smallest_k(lambda k: predict_skipreduce(nbytes, n, k, link), n - 1, target)


def required_skip_ratio(
    nbytes: float, n: int, link: LinkModel, target_seconds: float
) -> float | None:
    """Finds the smallest skip ratio that meets a communication time target.

    Args:
        nbytes: Buffer size per rank in bytes, ``>= 0``.
        n: Number of ranks, ``>= 1``.
        link: Link constants.
        target_seconds: Time budget for one call in seconds, ``>= 0``.

    Returns:
        ``k / (n - 1)`` for ``k = required_num_skip(...)`` (0.0 when ``n = 1``),
        which :func:`skip_ratio_to_num_skip` maps back to ``k``; None if the
        target cannot be met.

    Example:
        >>> required_skip_ratio(1e9, 8, LinkModel.from_gbit(100), 0.1)
        0.5714285714285714
    """
    k = required_num_skip(nbytes, n, link, target_seconds)
    if k is None:
        return None
    return k / (n - 1) if n > 1 else 0.0


def required_num_skip_hierarchical(
    nbytes: float,
    n_outer: int,
    n_inner: int,
    outer_link: LinkModel,
    inner_link: LinkModel,
    target_seconds: float,
) -> int | None:
    """Finds the fewest skipped outer steps that meet a time target, hierarchically.

    Args:
        nbytes: Buffer size per device in bytes, ``>= 0``.
        n_outer: Size of the slow outer axis, ``>= 1``.
        n_inner: Size of the fast inner axis, ``>= 1``.
        outer_link: Constants of the slow network, per device.
        inner_link: Constants of the fast intra-host links.
        target_seconds: Time budget in seconds, ``>= 0``.

    Returns:
        The smallest ``k`` in ``[0, n_outer - 1]`` with
        ``predict_hierarchical(...) <= target_seconds``, or None.

    Example:
        >>> slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
        >>> required_num_skip_hierarchical(1e9, 4, 8, slow, fast, 0.031)
        1
    """
    n_outer = _check_int("n_outer", n_outer, 1)
    target = _check_real("target_seconds", target_seconds)
    predict_hierarchical(nbytes, n_outer, n_inner, 0, outer_link, inner_link)

    def time_of_k(k: int) -> float:
        return predict_hierarchical(nbytes, n_outer, n_inner, k, outer_link, inner_link)

    return _smallest_k(time_of_k, n_outer - 1, target)


# --------------------------------------------------------------------------
# Measurements, fitting and validation
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed collective call, the input of :func:`fit_link_model`.

    Attributes:
        n: Number of ranks in the group, ``>= 2``.
        num_skip: Skipped reduce-scatter steps, in ``[0, n - 1]``; must be 0 for
            kinds ``'ring'`` and ``'psum'``.
        nbytes: Buffer size per rank in bytes (not bytes on the wire), a whole
            number ``>= 0`` (integral floats such as ``4e6`` are converted).
        seconds: Measured time of one call in seconds, ``> 0``.
        kind: ``'skip'``, ``'ring'`` or ``'psum'``; all are modelled as a ring
            with ``num_skip`` skipped steps.

    Example:
        >>> m = Measurement(n=8, num_skip=4, nbytes=800, seconds=1e-3)
        >>> m.steps, m.wire_bytes
        (10, 1000.0)
    """

    n: int
    num_skip: int
    nbytes: int
    seconds: float
    kind: str = "skip"

    def __post_init__(self) -> None:
        n = _check_int("n", self.n, 2)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "num_skip", _check_num_skip(self.num_skip, n))
        nbytes = _check_real("nbytes", self.nbytes)
        if not nbytes.is_integer():
            raise ValueError(f"nbytes must be a whole number of bytes, got {self.nbytes!r}")
        object.__setattr__(self, "nbytes", int(nbytes))
        object.__setattr__(self, "seconds", _check_real("seconds", self.seconds, positive=True))
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.kind != "skip" and self.num_skip != 0:
            raise ValueError(
                f"num_skip must be 0 for kind {self.kind!r}, got {self.num_skip}"
            )

    @property
    def steps(self) -> int:
        """Sequential steps of the call: ``2 (n - 1) - num_skip``."""
        return skipreduce_steps(self.n, self.num_skip)

    @property
    def wire_bytes(self) -> float:
        """Bytes sent per rank: ``steps * nbytes / n``."""
        return skipreduce_bytes(self.nbytes, self.n, self.num_skip)

    def to_dict(self) -> dict[str, Any]:
        """Returns the record as a JSON-serialisable dict.

        Returns:
            ``{"n", "num_skip", "nbytes", "seconds", "kind"}``.

        Example:
            >>> Measurement(4, 1, 1000, 0.5).to_dict()
            {'n': 4, 'num_skip': 1, 'nbytes': 1000, 'seconds': 0.5, 'kind': 'skip'}
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """Builds a record from a JSON object.

        Args:
            data: Mapping with ``n``, ``nbytes``, ``seconds``, optionally
                ``kind`` (default ``'skip'``) and ``num_skip`` (required for kind
                ``'skip'``, default 0 otherwise). Other keys are ignored.

        Returns:
            The measurement.

        Example:
            >>> Measurement.from_dict({"n": 4, "nbytes": 8, "seconds": 1, "kind": "psum"})
            Measurement(n=4, num_skip=0, nbytes=8, seconds=1.0, kind='psum')
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"measurement must be a JSON object, got {data!r}")
        kind = data.get("kind", "skip")
        required = ["n", "nbytes", "seconds"] + (["num_skip"] if kind == "skip" else [])
        missing = [key for key in required if key not in data]
        if missing:
            raise ValueError(f"measurement {dict(data)!r} is missing key(s) {missing}")
        return cls(
            n=data["n"],
            num_skip=data.get("num_skip", 0),
            nbytes=data["nbytes"],
            seconds=data["seconds"],
            kind=kind,
        )


class Validation(NamedTuple):
    """One row of :func:`validate`: a measurement, its prediction and the error.

    Attributes:
        measurement: The measured point.
        predicted: Predicted seconds.
        rel_error: ``(predicted - measured) / measured``; positive means the
            model is too slow (pessimistic).
    """

    measurement: Measurement
    predicted: float
    rel_error: float


def load_measurements(json_path: str | os.PathLike[str]) -> list[Measurement]:
    """Reads measurements from a JSON file.

    Args:
        json_path: File holding a list of measurement objects, or an object
            with a ``"measurements"`` list (other top-level keys are ignored).
            See :meth:`Measurement.from_dict` for the object format.

    Returns:
        The measurements in file order.

    Example:
        >>> load_measurements("bench.json")  # doctest: +SKIP
        [Measurement(n=8, num_skip=0, nbytes=4000000, seconds=0.0041, kind='ring'), ...]
    """
    with open(json_path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, Mapping):
        if "measurements" not in data:
            raise ValueError(
                f"{os.fspath(json_path)}: expected a list or an object with a "
                "'measurements' key"
            )
        data = data["measurements"]
    if not isinstance(data, list):
        raise ValueError(f"{os.fspath(json_path)}: measurements must be a JSON list")
    return [Measurement.from_dict(item) for item in data]


def save_measurements(
    json_path: str | os.PathLike[str], measurements: Iterable[Measurement]
) -> None:
    """Writes measurements to a JSON file that :func:`load_measurements` reads.

    Args:
        json_path: Destination file.
        measurements: Records to write.

    Returns:
        None.

    Example:
        >>> ms = [Measurement(8, 0, 4000000, 0.0041, "ring")]
        >>> save_measurements("bench.json", ms)  # doctest: +SKIP
    """
    payload = {"measurements": [m.to_dict() for m in measurements]}
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def predict_measurement(model: LinkModel, measurement: Measurement) -> float:
    """Predicts the time of a measured call under ``model``.

    Args:
        model: Link constants.
        measurement: The call to predict (its ``seconds`` is not used).

    Returns:
        ``model.time(measurement.steps, measurement.wire_bytes)``.

    Example:
        >>> predict_measurement(LinkModel(0.0, 1e3), Measurement(8, 4, 800, 1.0))
        1.0
    """
    return model.time(measurement.steps, measurement.wire_bytes)


# Columns of the design matrix: constant (call_overhead), steps (alpha),
# wire bytes (1 / bandwidth). Candidate supports for non-negative least squares,
# in order of preference: fewer parameters first, call_overhead before alpha.
_SUPPORTS: tuple[tuple[int, ...], ...] = ((2,), (0, 2), (1, 2), (0, 1, 2))


def fit_link_model(
    measurements: Sequence[Measurement],
    *,
    weighting: Literal["relative", "absolute"] = "relative",
    fit_alpha: bool = True,
    fit_overhead: bool = True,
) -> LinkModel:
    """Calibrates a :class:`LinkModel` by non-negative least squares.

    Solves ``seconds ~ call_overhead + steps * alpha + wire_bytes * (1 / bandwidth)``
    over the measurements with all three coefficients ``>= 0`` and
    ``1 / bandwidth > 0``. The non-negative problem is solved exactly by trying
    every support (set of free coefficients) with ``numpy.linalg.lstsq`` and
    keeping the feasible one with the smallest residual; a larger support is
    kept only if it lowers the residual by more than a ``1e-12`` fraction of the
    total sum of squares. If the points cannot separate ``alpha`` from
    ``call_overhead`` (e.g. all share ``n`` and ``num_skip``), the constant goes
    to ``call_overhead`` and ``alpha`` is 0.

    Args:
        measurements: At least one measurement; to determine all three
            constants use at least two message sizes and at least two step
            counts.
        weighting: ``'relative'`` (default) minimises relative residuals,
            dividing each row by its measured seconds, so that small and large
            messages count alike; ``'absolute'`` minimises residuals in seconds.
        fit_alpha: If False, ``alpha`` is fixed at 0.
        fit_overhead: If False, ``call_overhead`` is fixed at 0.

    Returns:
        The fitted link model.

    Raises:
        ValueError: If ``measurements`` is empty, ``weighting`` is unknown, or
            no fit has a positive bandwidth term, or a fit without one (a
            constant or per-step time) explains the points better.

    Example:
        >>> true = LinkModel(alpha=2e-5, bandwidth=1e10, call_overhead=1e-4)
        >>> pts = [Measurement(8, k, b, 1.0) for k in (0, 7) for b in (1e4, 1e8)]
        >>> pts = [dataclasses.replace(m, seconds=predict_measurement(true, m)) for m in pts]
        >>> fit = fit_link_model(pts)
        >>> round(fit.alpha, 9), round(fit.bandwidth / 1e9, 6), round(fit.call_overhead, 9)
        (2e-05, 10.0, 0.0001)
    """
    ms = list(measurements)
    if not ms:
        raise ValueError("measurements must not be empty")
    for m in ms:
        if not isinstance(m, Measurement):
            raise TypeError(f"measurements must hold Measurement records, got {m!r}")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")

    x = np.array([[1.0, float(m.steps), m.wire_bytes] for m in ms], dtype=np.float64)
    y = np.array([m.seconds for m in ms], dtype=np.float64)
    if weighting == "relative":
        w = 1.0 / y
        x = x * w[:, None]
        y = y * w
    # Scale columns to unit norm so that lstsq and the rank test see comparable
    # magnitudes (bytes ~1e9 next to a constant column of ones).
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    total_ss = float(y @ y)
    tol = 1e-12 * total_ss

    allowed = {2} | ({0} if fit_overhead else set()) | ({1} if fit_alpha else set())

    def solve(cols: list[int]) -> tuple[float, np.ndarray] | None:
        """Least squares on ``cols``; None unless every coefficient is >= 0."""
        sub = xs[:, cols]
        if np.linalg.matrix_rank(sub) < len(cols):
            return None
        coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
        if np.any(coef < 0):
            return None
        resid = y - sub @ coef
        return float(resid @ resid), coef

    best: tuple[float, np.ndarray] | None = None
    # Without the bandwidth term: if a constant (or per-step) time explains
    # the points better than any fit with a positive bandwidth, the times do
    # not grow with the bytes and the bandwidth would be made up.
    flat: float | None = None
    for support in _SUPPORTS + ((0,), (1,), (0, 1)):
        if not set(support) <= allowed:
            continue
        solved = solve(list(support))
        if solved is None:
            continue
        sse, coef = solved
        if support[-1] != 2:
            flat = sse if flat is None else min(flat, sse)
        elif coef[-1] > 0 and (best is None or sse < best[0] - tol):
            full = np.zeros(3)
            full[list(support)] = coef / norms[list(support)]
            best = (sse, full)
    if best is None or (flat is not None and flat < best[0] - tol):
        raise ValueError(
            "measurements do not determine a positive bandwidth: time must grow "
            "with the bytes on the wire; include several message sizes large "
            "enough for the transfer to dominate"
        )
    overhead, alpha, inv_bw = (float(v) for v in best[1])
    return LinkModel(alpha=alpha, bandwidth=1.0 / inv_bw, call_overhead=overhead)


def validate(model: LinkModel, measurements: Iterable[Measurement]) -> list[Validation]:
    """Compares predictions with measured times.

    Args:
        model: Link constants, e.g. fitted on another run.
        measurements: Measured points.

    Returns:
        One :class:`Validation` ``(measurement, predicted, rel_error)`` per point,
        with ``rel_error = (predicted - measured) / measured``.

    Example:
        >>> round(validate(LinkModel(0.0, 1e3), [Measurement(8, 4, 800, 0.8)])[0].rel_error, 12)
        0.25
    """
    if not isinstance(model, LinkModel):
        raise TypeError(f"model must be a LinkModel, got {type(model).__name__}")
    rows = []
    for m in measurements:
        predicted = predict_measurement(model, m)
        rows.append(Validation(m, predicted, (predicted - m.seconds) / m.seconds))
    return rows


# --------------------------------------------------------------------------
# Parsing and formatting helpers
# --------------------------------------------------------------------------

_SIZE_UNITS: dict[str, float] = {
    "": 1.0,
    "b": 1.0,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2.0**10,
    "mib": 2.0**20,
    "gib": 2.0**30,
    "tib": 2.0**40,
}
_COUNT_UNITS: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
# Seconds are divided by these, so that e.g. "10us" gives exactly 1e-05.
_TIME_DIVISORS: dict[str, float] = {
    "": 1.0,
    "s": 1.0,
    "ms": 1e3,
    "us": 1e6,
    "\u00b5s": 1e6,
    "ns": 1e9,
}
_NUMBER_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9]*)\s*$")


def _parse_with_units(name: str, text: str, units: Mapping[str, float]) -> tuple[float, float]:
    """Splits ``text`` into ``(number, unit value)``, raising on bad input."""
    match = _NUMBER_RE.match(str(text))
    if not match or match.group(2).lower() not in units:
        raise ValueError(
            f"{name}: cannot parse {text!r}; expected a non-negative number with "
            f"an optional unit out of {sorted(u for u in units if u)}"
        )
    value = float(match.group(1))
    if not math.isfinite(value * units[match.group(2).lower()]):
        raise ValueError(f"{name}: {text!r} is too large")
    return value, units[match.group(2).lower()]


def parse_size(text: str) -> int:
    """Parses a byte size such as ``100MB``, ``1.5GiB`` or ``4096``.

    Args:
        text: Number with an optional unit: ``B``, ``KB``/``K``, ``MB``/``M``,
            ``GB``/``G``, ``TB``/``T`` (powers of 1000) or ``KiB``, ``MiB``,
            ``GiB``, ``TiB`` (powers of 1024); case-insensitive.

    Returns:
        The size in bytes, rounded to an integer.

    Example:
        >>> parse_size("100MB"), parse_size("1KiB"), parse_size("512")
        (100000000, 1024, 512)
    """
    value, scale = _parse_with_units("size", text, _SIZE_UNITS)
    return round(value * scale)


def parse_count(text: str) -> int:
    """Parses an element count such as ``25M`` or ``1.3B``.

    Args:
        text: Number with an optional suffix ``K`` (1e3), ``M`` (1e6),
            ``B``/``G`` (1e9) or ``T`` (1e12); case-insensitive.

    Returns:
        The count, rounded to an integer.

    Example:
        >>> parse_count("25M"), parse_count("1.3B")
        (25000000, 1300000000)
    """
    value, scale = _parse_with_units("params", text, _COUNT_UNITS)
    return round(value * scale)


def parse_seconds(text: str) -> float:
    """Parses a duration such as ``10us``, ``2.5ms`` or ``0.1``.

    Args:
        text: Number with an optional unit ``s``, ``ms``, ``us`` (or ``µs``) or
            ``ns``; a bare number is seconds.

    Returns:
        The duration in seconds.

    Example:
        >>> parse_seconds("10us"), parse_seconds("2.5ms"), parse_seconds("0.1")
        (1e-05, 0.0025, 0.1)
    """
    value, divisor = _parse_with_units("time", text, _TIME_DIVISORS)
    return value / divisor


def _fmt_seconds(seconds: float) -> str:
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds / 1e-9:.4g} ns"


def _fmt_bytes(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.4g} B"


def _fmt_speedup(speedup: float | None) -> str:
    return "n/a" if speedup is None else f"{speedup:.3f}x"


def _fmt_link(link: LinkModel) -> str:
    return (
        f"{link.gbit_per_s:.4g} Gbit/s ({link.bandwidth / 1e9:.4g} GB/s), "
        f"alpha {_fmt_seconds(link.alpha)}/step, overhead {_fmt_seconds(link.call_overhead)}/call"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligns cells: the first column left, all others right."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _add_link_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("link (slow network for hierarchical mode)")
    bw = g.add_mutually_exclusive_group()
    bw.add_argument("--gbit", type=float,
                    help="bandwidth per rank in Gbit/s (with --inner: per device on "
                         "the outer links, e.g. a NIC's rate / L if L devices share it)")
    bw.add_argument("--gbyte", type=float, help="bandwidth per rank in GB/s (as --gbit)")
    bw.add_argument("--model", metavar="FILE", help="link model JSON written by 'fit --save'")
    g.add_argument(
        "--alpha", type=_arg_type(parse_seconds), default=None,
        help="latency per ring step, e.g. 10us (default 0)",
    )
    g.add_argument(
        "--overhead", type=_arg_type(parse_seconds), default=None,
        help="constant cost per collective call, e.g. 50us (default 0)",
    )


def _add_size_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("message")
    size = g.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--size", type=_arg_type(parse_size),
        help="buffer size per rank, e.g. 100MB, 1.5GiB, 4096",
    )
    size.add_argument(
        "--params", type=_arg_type(parse_count),
        help="number of gradient elements, e.g. 25M (use with --dtype)",
    )
    g.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPE_BYTES),
        metavar="DTYPE", help="element type for --params (default float32)",
    )


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--n", type=int, required=True,
        help="ranks in the ring (hosts on the outer axis in hierarchical mode), >= 2",
    )
    g = p.add_argument_group("hierarchical mode")
    g.add_argument(
        "--inner", type=int, default=None, metavar="L",
        help="devices per host on the fast inner axis; enables hierarchical mode",
    )
    bw = g.add_mutually_exclusive_group()
    bw.add_argument("--inner-gbit", type=float, help="inner bandwidth per device in Gbit/s")
    bw.add_argument("--inner-gbyte", type=float, help="inner bandwidth per device in GB/s")
    g.add_argument(
        "--inner-alpha", type=_arg_type(parse_seconds), default=0.0,
        help="inner latency per step (default 0)",
    )
    g.add_argument(
        "--inner-overhead", type=_arg_type(parse_seconds), default=0.0,
        help="inner constant cost per call (default 0)",
    )


def _add_json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m skipreduce_jax.cost",
        description=(
            "Alpha-beta cost model of ring all-reduce and SkipReduce: one call costs "
            "call_overhead + steps * alpha + bytes_per_rank / bandwidth. SkipReduce "
            "with k skipped of the n-1 reduce-scatter steps takes 2(n-1)-k steps of "
            "B/n bytes. Ignores congestion, topology, in-network reduction and "
            "overlap with compute; fitted constants are effective values."
        ),
        epilog=(
            "examples:\n"
            "  %(prog)s predict --n 8 --size 100MB --gbit 100 --alpha 10us --k 0 2 4 7\n"
            "  %(prog)s predict --n 16 --params 25M --dtype bf16 --gbit 25 "
            "--inner 8 --inner-gbit 2400\n"
            "  %(prog)s target --n 64 --size 1GB --gbit 100 --time 150ms\n"
            "  %(prog)s fit measurements.json --check other.json --save link.json\n"
            "  %(prog)s check other.json --model link.json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "predict",
        help="predicted time of ring all-reduce and SkipReduce at several k",
        description=(
            "Prints the predicted time of a ring all-reduce and of SkipReduce at each "
            "requested k (or skip ratio), with traffic and speedup over the all-reduce. "
            "With --inner L the mesh is n hosts x L devices: inner reduce-scatter, "
            "outer SkipReduce, inner all-gather; speedups are over the hierarchical "
            "all-reduce (k=0). Ratios map to k = floor(ratio*(n-1)+0.5)."
        ),
    )
    _add_mesh_args(p)
    _add_size_args(p)
    _add_link_args(p)
    ks = p.add_mutually_exclusive_group()
    ks.add_argument("--k", type=int, nargs="+", help="numbers of skipped steps")
    ks.add_argument(
        "--ratio", type=float, nargs="+",
        help="skip ratios in [0, 1] (default: every k if n <= 9, else "
        "0 0.1 0.25 0.5 0.75 1)",
    )
    _add_json_arg(p)

    p = sub.add_parser(
        "target",
        help="skip ratio needed to meet a communication time target",
        description=(
            "Finds the smallest k (and skip ratio k/(n-1)) whose predicted time is at "
            "most --time, or reports that even k=n-1 is too slow."
        ),
    )
    _add_mesh_args(p)
    _add_size_args(p)
    _add_link_args(p)
    p.add_argument(
        "--time", type=_arg_type(parse_seconds), required=True,
        help="target time per call, e.g. 50ms",
    )
    _add_json_arg(p)

    p = sub.add_parser(
        "fit",
        help="fit a link model to measurements and print residuals",
        description=(
            "Fits alpha, bandwidth and call overhead by non-negative least squares to "
            "the measurements in FILE (a JSON list of {n, num_skip, nbytes, seconds, "
            "kind} objects, or an object with a 'measurements' list) and prints the "
            "model and the residuals; --check evaluates it on another file."
        ),
    )
    p.add_argument("file", metavar="FILE", nargs="?", help="measurements JSON")
    p.add_argument("--fit", dest="fit_file", metavar="FILE", help="same as FILE")
    p.add_argument("--check", metavar="FILE", help="measurements JSON to validate against")
    p.add_argument(
        "--kind", action="append", choices=KINDS,
        help="use only measurements of this kind (repeatable; default all)",
    )
    p.add_argument(
        "--absolute", action="store_true",
        help="minimise absolute instead of relative residuals",
    )
    p.add_argument("--no-alpha", action="store_true", help="fix alpha at 0")
    p.add_argument("--no-overhead", action="store_true", help="fix the call overhead at 0")
    p.add_argument("--save", metavar="FILE", help="write the fitted model as JSON")
    _add_json_arg(p)

    p = sub.add_parser(
        "check",
        help="predicted vs measured times for a given link model",
        description="Prints predicted vs measured times, with relative errors.",
    )
    p.add_argument("file", metavar="FILE", help="measurements JSON")
    p.add_argument(
        "--kind", action="append", choices=KINDS,
        help="use only measurements of this kind (repeatable; default all)",
    )
    _add_link_args(p)
    _add_json_arg(p)
    return parser


def _link_from_args(args: argparse.Namespace) -> LinkModel:
    if getattr(args, "model", None):
        if args.alpha is not None or args.overhead is not None:
            raise ValueError("--alpha/--overhead cannot be combined with --model")
        return load_link_model(args.model)
    alpha = 0.0 if args.alpha is None else args.alpha
    overhead = 0.0 if args.overhead is None else args.overhead
    if args.gbit is not None:
        return LinkModel.from_gbit(args.gbit, alpha=alpha, call_overhead=overhead)
    if args.gbyte is not None:
        return LinkModel.from_gbyte(args.gbyte, alpha=alpha, call_overhead=overhead)
    raise ValueError("one of --gbit, --gbyte or --model is required")


def _inner_link_from_args(args: argparse.Namespace) -> LinkModel | None:
    if args.inner is None:
        if (args.inner_gbit is not None or args.inner_gbyte is not None
                or args.inner_alpha or args.inner_overhead):
            raise ValueError("--inner-gbit/--inner-gbyte/--inner-alpha/"
                             "--inner-overhead need --inner")
        return None
    if args.inner < 1:
        raise ValueError(f"--inner must be >= 1, got {args.inner}")
    if args.inner_gbit is not None:
        return LinkModel.from_gbit(
            args.inner_gbit, alpha=args.inner_alpha, call_overhead=args.inner_overhead
        )
    if args.inner_gbyte is not None:
        return LinkModel.from_gbyte(
            args.inner_gbyte, alpha=args.inner_alpha, call_overhead=args.inner_overhead
        )
    if args.inner == 1:
        # No inner communication: any constants will do.
        return LinkModel(alpha=0.0, bandwidth=1.0)
    raise ValueError("--inner needs --inner-gbit or --inner-gbyte")


def _nbytes_from_args(args: argparse.Namespace) -> int:
    if args.size is not None:
        return args.size
    return args.params * DTYPE_BYTES[args.dtype]


def _check_cli_n(n: int) -> None:
    if n < 2:
        raise ValueError(f"--n must be >= 2, got {n}")


def _cmd_predict(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    n = args.n
    _check_cli_n(n)
    nbytes = _nbytes_from_args(args)
    link = _link_from_args(args)
    inner_link = _inner_link_from_args(args)
    requested: list[tuple[int, float | None]]
    if args.k is not None:
        for k in args.k:
            if not 0 <= k <= n - 1:
                raise ValueError(f"--k values must be in [0, n - 1] = [0, {n - 1}], got {k}")
        requested = [(k, None) for k in args.k]
    else:
        ratios = args.ratio
        if ratios is None:
            ratios = (
                [k / (n - 1) for k in range(n)] if n <= 9 else [0, 0.1, 0.25, 0.5, 0.75, 1.0]
            )
        for r in ratios:
            if not 0 <= r <= 1:
                raise ValueError(f"--ratio values must be in [0, 1], got {r}")
        requested = [(skip_ratio_to_num_skip(r, n), float(r)) for r in ratios]
    show_ratio = args.ratio is not None

    payload: dict[str, Any] = {"mode": "flat" if inner_link is None else "hierarchical"}
    lines: list[str] = []
    rows_json: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    if inner_link is None:
        base = predict_allreduce(nbytes, n, link)
        payload.update(
            n=n, nbytes=nbytes, link=link.to_dict(), allreduce_seconds=base,
            allreduce_bytes_per_rank=ring_allreduce_bytes(nbytes, n),
        )
        lines.append(f"ring all-reduce: n={n} ranks, {_fmt_bytes(nbytes)} per rank")
        lines.append(f"link: {_fmt_link(link)}")
        lines.append(
            f"ring all-reduce: {_fmt_seconds(base)}, "
            f"{_fmt_bytes(ring_allreduce_bytes(nbytes, n))} sent per rank"
        )
        headers = ["k", "k/(n-1)", "steps", "bytes/rank", "traffic", "time", "speedup"]
        for k, r in requested:
            t = predict_skipreduce(nbytes, n, k, link)
            wire = skipreduce_bytes(nbytes, n, k)
            frac = traffic_fraction(n, k)
            speedup = base / t if t > 0 else None
            rows_json.append({
                "num_skip": k, "skip_ratio": r, "k_over_n_minus_1": k / (n - 1),
                "steps": skipreduce_steps(n, k), "bytes_per_rank": wire,
                "traffic_fraction": frac, "seconds": t, "speedup": speedup,
            })
            rows.append([
                str(k), f"{k / (n - 1):.3f}", str(skipreduce_steps(n, k)), _fmt_bytes(wire),
                f"{frac:.1%}", _fmt_seconds(t), _fmt_speedup(speedup),
            ])
    else:
        L = args.inner
        base = predict_hierarchical_allreduce(nbytes, n, L, link, inner_link)
        payload.update(
            n_outer=n, n_inner=L, nbytes=nbytes, outer_link=link.to_dict(),
            inner_link=inner_link.to_dict() if L > 1 else None, allreduce_seconds=base,
        )
        lines.append(
            f"hierarchical: {n} hosts x {L} devices, {_fmt_bytes(nbytes)} per device"
        )
        lines.append(f"outer link: {_fmt_link(link)}")
        if L > 1:
            lines.append(f"inner link: {_fmt_link(inner_link)}")
        lines.append(f"hierarchical all-reduce (k=0): {_fmt_seconds(base)}")
        headers = ["k", "k/(n-1)", "outer bytes", "inner time", "outer time", "time", "speedup"]
        for k, r in requested:
            inner_t, outer_t = _hierarchical_phases(nbytes, n, L, k, link, inner_link)
            t = inner_t + outer_t
            inner_b, outer_b = hierarchical_bytes(nbytes, n, L, k)
            speedup = base / t if t > 0 else None
            rows_json.append({
                "num_skip": k, "skip_ratio": r, "k_over_n_minus_1": k / (n - 1),
                "inner_bytes_per_device": inner_b, "outer_bytes_per_device": outer_b,
                "inner_seconds": inner_t, "outer_seconds": outer_t,
                "seconds": t, "speedup": speedup,
            })
            rows.append([
                str(k), f"{k / (n - 1):.3f}", _fmt_bytes(outer_b), _fmt_seconds(inner_t),
                _fmt_seconds(outer_t), _fmt_seconds(t), _fmt_speedup(speedup),
            ])
    if show_ratio:
        headers = ["ratio", *headers]
        rows = [[f"{r:g}", *row] for (_, r), row in zip(requested, rows, strict=True)]
    payload["rows"] = rows_json
    text = "\n".join([*lines, "", _table(headers, rows)])
    return text, payload


def _cmd_target(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    n = args.n
    _check_cli_n(n)
    nbytes = _nbytes_from_args(args)
    link = _link_from_args(args)
    inner_link = _inner_link_from_args(args)
    target = args.time
    if inner_link is None:
        base = predict_allreduce(nbytes, n, link)
        k = required_num_skip(nbytes, n, link, target)

        def time_of_k(kk: int) -> float:
            return predict_skipreduce(nbytes, n, kk, link)

        what = f"ring all-reduce: n={n} ranks, {_fmt_bytes(nbytes)} per rank"
    else:
        L = args.inner
        base = predict_hierarchical_allreduce(nbytes, n, L, link, inner_link)
        k = required_num_skip_hierarchical(nbytes, n, L, link, inner_link, target)

        def time_of_k(kk: int) -> float:
            return predict_hierarchical(nbytes, n, L, kk, link, inner_link)

        what = f"hierarchical: {n} hosts x {L} devices, {_fmt_bytes(nbytes)} per device"
    best = time_of_k(n - 1)
    payload: dict[str, Any] = {
        "n": n, "nbytes": nbytes, "target_seconds": target, "allreduce_seconds": base,
        "min_seconds": best, "num_skip": k,
        "skip_ratio": None if k is None else k / (n - 1),
        "seconds": None if k is None else time_of_k(k),
    }
    lines = [what, f"link: {_fmt_link(link)}"]
    if inner_link is not None and args.inner > 1:
        lines.append(f"inner link: {_fmt_link(inner_link)}")
    lines.append(f"target: {_fmt_seconds(target)}")
    rows = [["all-reduce (k=0)", _fmt_seconds(base)], [f"k={n - 1} (max)", _fmt_seconds(best)]]
    if k is None:
        lines.append(
            f"not reachable: even k={n - 1} (skip ratio 1) takes {_fmt_seconds(best)}"
        )
    else:
        t = time_of_k(k)
        rows.append([f"k={k} (needed)", _fmt_seconds(t)])
        lines.append(
            f"needed: k={k} of {n - 1} (skip ratio {k / (n - 1):.4g}), "
            f"{_fmt_seconds(t)}, speedup {_fmt_speedup(base / t if t > 0 else None)}"
        )
    text = "\n".join([*lines, "", _table(["case", "time"], rows)])
    return text, payload


def _validation_table(results: Sequence[Validation]) -> str:
    headers = ["kind", "n", "k", "nbytes", "measured", "predicted", "rel err"]
    rows = [
        [
            v.measurement.kind, str(v.measurement.n), str(v.measurement.num_skip),
            _fmt_bytes(v.measurement.nbytes), _fmt_seconds(v.measurement.seconds),
            _fmt_seconds(v.predicted), f"{v.rel_error:+.2%}",
        ]
        for v in results
    ]
    errs = np.array([v.rel_error for v in results])
    summary = (
        f"{len(results)} points: mean |rel err| {np.mean(np.abs(errs)):.2%}, "
        f"max |rel err| {np.max(np.abs(errs)):.2%}"
    )
    return _table(headers, rows) + "\n" + summary


def _validation_json(results: Sequence[Validation]) -> list[dict[str, Any]]:
    return [
        {**v.measurement.to_dict(), "predicted": v.predicted, "rel_error": v.rel_error}
        for v in results
    ]


def _load_filtered(path: str, kinds: Sequence[str] | None) -> list[Measurement]:
    ms = load_measurements(path)
    if kinds:
        ms = [m for m in ms if m.kind in kinds]
    if not ms:
        raise ValueError(f"{path}: no measurements" + (f" of kind {list(kinds)}" if kinds else ""))
    return ms


def _cmd_fit(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    if (args.file is None) == (args.fit_file is None):
        raise ValueError("give the measurements file once, as FILE or --fit FILE")
    path = args.file if args.file is not None else args.fit_file
    ms = _load_filtered(path, args.kind)
    model = fit_link_model(
        ms,
        weighting="absolute" if args.absolute else "relative",
        fit_alpha=not args.no_alpha,
        fit_overhead=not args.no_overhead,
    )
    residuals = validate(model, ms)
    payload: dict[str, Any] = {
        "model": model.to_dict(),
        "gbit_per_s": model.gbit_per_s,
        "residuals": _validation_json(residuals),
    }
    lines = [
        f"fitted on {len(ms)} points from {path}"
        + (f" (kind: {', '.join(args.kind)})" if args.kind else ""),
        f"alpha          {model.alpha:.6g} s ({_fmt_seconds(model.alpha)} per step)",
        f"bandwidth      {model.bandwidth:.6g} B/s ({model.gbit_per_s:.4g} Gbit/s)",
        f"call_overhead  {model.call_overhead:.6g} s ({_fmt_seconds(model.call_overhead)})",
        "",
        "residuals:",
        _validation_table(residuals),
    ]
    if args.check:
        check = validate(model, _load_filtered(args.check, args.kind))
        payload["check"] = _validation_json(check)
        lines += ["", f"check against {args.check}:", _validation_table(check)]
    if args.save:
        save_link_model(args.save, model)
        lines += ["", f"model written to {args.save}"]
    return "\n".join(lines), payload


def _cmd_check(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    model = _link_from_args(args)
    results = validate(model, _load_filtered(args.file, args.kind))
    payload = {"model": model.to_dict(), "check": _validation_json(results)}
    text = "\n".join([f"link: {_fmt_link(model)}", "", _validation_table(results)])
    return text, payload


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command-line interface.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if None.

    Returns:
        Exit status 0. Bad arguments exit through ``SystemExit(2)`` with a
        message on stderr, as argparse does.

    Example:
        >>> main(["predict", "--n", "8", "--size", "100MB", "--gbit", "100"])  # doctest: +SKIP
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    commands = {
        "predict": _cmd_predict,
        "target": _cmd_target,
        "fit": _cmd_fit,
        "check": _cmd_check,
    }
    try:
        text, payload = commands[args.command](args)
    except (OSError, TypeError, ValueError) as e:
        parser.error(f"{args.command}: {e}")
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
