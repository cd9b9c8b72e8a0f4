"""Calibrating a :class:`LinkModel` on benchmark measurements, and checking it.

Record each benchmark point as a :class:`Measurement` (``nbytes`` is the full
gradient buffer per rank, not the bytes on the wire; ``seconds`` the wall time
of one call, e.g. the median over repeats) and write them to a JSON file, either
a list of objects or an object with a ``"measurements"`` list, e.g.::

    {"measurements": [
        {"n": 8, "num_skip": 0, "nbytes": 4000000, "seconds": 0.0041, "kind": "ring"},
        {"n": 8, "num_skip": 4, "nbytes": 4000000, "seconds": 0.0029, "kind": "skip"}
    ]}

:meth:`Measurement.from_dict` reads each object; :func:`fit_link_model` fits
the constants to them and :func:`validate` compares a model with another set of
points. Fit different kinds separately when they use different code paths
(``--kind`` in the CLI).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from skipreduce_jax._checks import check_choice, check_int, check_num_skip, check_real
from skipreduce_jax._ring.traffic import skipreduce_bytes, skipreduce_steps

from ._model import LinkModel, _check_link, read_json, write_json

_KIND_MEANINGS: dict[str, str] = {"skip": "SkipReduce with num_skip skipped steps",
                                   "ring": "the ppermute ring all-reduce",
                                   "psum": "the backend's native all-reduce"}

KINDS: tuple[str, ...] = tuple(_KIND_MEANINGS)
"""Measurement kinds understood by :class:`Measurement`."""


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
        >>> from skipreduce_jax.cost import Measurement
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
        api = "Measurement"
        n = check_int(self.n, "n", api=api, minimum=2)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "num_skip", check_num_skip(self.num_skip, n, api=api, n_name="n"))
        nbytes = check_real(self.nbytes, "nbytes", api=api)
        if not nbytes.is_integer():
            raise ValueError(
                f"{api}: nbytes must be a whole number of bytes, got {self.nbytes!r}")
        object.__setattr__(self, "nbytes", int(nbytes))
        object.__setattr__(self, "seconds",
                           check_real(self.seconds, "seconds", api=api, positive=True))
        check_choice(self.kind, "kind", _KIND_MEANINGS, api=api)
        if self.kind != "skip" and self.num_skip != 0:
            raise ValueError(
                f"{api}: num_skip must be 0 for kind {self.kind!r}, got {self.num_skip}")

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

        Example:
            >>> from skipreduce_jax.cost import Measurement
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

        Example:
            >>> from skipreduce_jax.cost import Measurement
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
        return cls(n=data["n"], num_skip=data.get("num_skip", 0), nbytes=data["nbytes"],
                   seconds=data["seconds"], kind=kind)


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
        >>> from skipreduce_jax.cost import load_measurements
        >>> load_measurements("bench.json")  # doctest: +SKIP
        [Measurement(n=8, num_skip=0, nbytes=4000000, seconds=0.0041, kind='ring'), ...]
    """
    data = read_json(json_path, "a JSON list of measurement objects, or an object "
                     "with a 'measurements' list")
    if isinstance(data, Mapping):
        if "measurements" not in data:
            raise ValueError(f"{os.fspath(json_path)}: expected a list or an object with a "
                             "'measurements' key")
        data = data["measurements"]
    if not isinstance(data, list):
        raise ValueError(f"{os.fspath(json_path)}: measurements must be a JSON list")
    return [Measurement.from_dict(item) for item in data]


def save_measurements(json_path: str | os.PathLike[str],
                      measurements: Iterable[Measurement]) -> None:
    """Writes measurements to a JSON file that :func:`load_measurements` reads.

    Args:
        json_path: Destination file.
        measurements: Records to write.

    Example:
        >>> from skipreduce_jax.cost import Measurement, save_measurements
        >>> ms = [Measurement(8, 0, 4000000, 0.0041, "ring")]
        >>> save_measurements("bench.json", ms)  # doctest: +SKIP
    """
    write_json(json_path, {"measurements": [m.to_dict() for m in measurements]})


def predict_measurement(model: LinkModel, measurement: Measurement) -> float:
    """Predicts the time of a measured call under ``model``.

    Args:
        model: Link constants.
        measurement: The call to predict (its ``seconds`` is not used).

    Returns:
        ``model.time(measurement.steps, measurement.wire_bytes)``.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, Measurement, predict_measurement
        >>> predict_measurement(LinkModel(0.0, 1e3), Measurement(8, 4, 800, 1.0))
        1.0
    """
    return model.time(measurement.steps, measurement.wire_bytes)


# Columns of the design matrix: constant (call_overhead), steps (alpha),
# wire bytes (1 / bandwidth). Candidate supports for non-negative least squares,
# in order of preference: fewer parameters first, call_overhead before alpha.
_SUPPORTS: tuple[tuple[int, ...], ...] = ((2,), (0, 2), (1, 2), (0, 1, 2))


def fit_link_model(measurements: Sequence[Measurement], *,
                   weighting: Literal["relative", "absolute"] = "relative",
                   fit_alpha: bool = True, fit_overhead: bool = True) -> LinkModel:
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

    Raises:
        ValueError: If ``measurements`` is empty, ``weighting`` is unknown, or
            no fit has a positive bandwidth term, or a fit without one (a
            constant or per-step time) explains the points better.

    Example:
        >>> from skipreduce_jax.cost import (
        ...     LinkModel, Measurement, fit_link_model, predict_measurement)
        >>> import dataclasses
        >>> true = LinkModel(alpha=2e-5, bandwidth=1e10, call_overhead=1e-4)
        >>> pts = [Measurement(8, k, b, 1.0) for k in (0, 7) for b in (1e4, 1e8)]
        >>> pts = [dataclasses.replace(m, seconds=predict_measurement(true, m)) for m in pts]
        >>> fit = fit_link_model(pts)
        >>> round(fit.alpha, 9), round(fit.bandwidth / 1e9, 6), round(fit.call_overhead, 9)
        (2e-05, 10.0, 0.0001)
    """
    api = "fit_link_model"
    ms = list(measurements)
    if not ms:
        raise ValueError(f"{api}: measurements must not be empty")
    for m in ms:
        if not isinstance(m, Measurement):
            raise TypeError(f"{api}: measurements must hold Measurement records, got {m!r}")
    check_choice(weighting, "weighting", {
        "relative": "minimise relative residuals",
        "absolute": "minimise residuals in seconds"}, api=api)

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
    tol = 1e-12 * float(y @ y)  # of the total sum of squares

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
        raise ValueError(f"{api}: measurements do not determine a positive bandwidth: time "
                         "must grow with the bytes on the wire; include several message "
                         "sizes large enough for the transfer to dominate")
    overhead, alpha, inv_bw = (float(v) for v in best[1])
    return LinkModel(alpha=alpha, bandwidth=1.0 / inv_bw, call_overhead=overhead)


def validate(model: LinkModel, measurements: Iterable[Measurement]) -> list[Validation]:
    """Compares predictions with measured times.

    Args:
        model: Link constants, e.g. fitted on another run.
        measurements: Measured points.

    Returns:
        One :class:`Validation` ``(measurement, predicted, rel_error)`` per point.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, Measurement, validate
        >>> round(validate(LinkModel(0.0, 1e3), [Measurement(8, 4, 800, 0.8)])[0].rel_error, 12)
        0.25
    """
    _check_link(model, "model", "validate")
    rows = []
    for m in measurements:
        predicted = predict_measurement(model, m)
        rows.append(Validation(m, predicted, (predicted - m.seconds) / m.seconds))
    return rows
