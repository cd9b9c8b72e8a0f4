"""The alpha-beta link model and the times it predicts.

For a buffer of ``B`` bytes per rank over ``n`` ranks, the steps and bytes of
each call are those of ``skipreduce_jax._ring.traffic`` (SkipReduce with ``k``
skipped steps: ``2 (n - 1) - k`` steps of ``B / n`` bytes); the time of one
collective call is::

    seconds = call_overhead + steps * alpha + bytes_per_rank_on_wire / bandwidth

where ``alpha`` is the per-step latency (s), ``bandwidth`` the per-rank link
bandwidth (bytes/s) and ``call_overhead`` a constant per call (s): dispatch,
synchronisation and the local reduction setup. The three constants form a
:class:`LinkModel`.

Hierarchical SkipReduce, on a mesh of ``N`` hosts (the slow outer axis) of
``L`` devices each (the fast inner axis), is three calls in sequence: a
reduce-scatter over the inner axis on ``inner_link`` (``L - 1`` steps,
``(L - 1) / L * B`` bytes per device), SkipReduce over the outer axis on the
``B / L`` shard on ``outer_link`` (``2 (N - 1) - k`` steps,
``(2 (N - 1) - k) * B / (L * N)`` bytes per device) and an all-gather over the
inner axis, the same as the reduce-scatter. An axis of size 1 issues no call and
costs nothing, so ``L = 1`` reduces to the flat model on ``outer_link``.
``outer_link.bandwidth`` is what one device gets on the slow network while all
``L`` devices of its host send at once (the host NIC bandwidth divided by ``L``
when they share one NIC).

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
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from typing import Any

from skipreduce_jax._checks import check_int, check_real
from skipreduce_jax._ring.traffic import (
    all_gather_bytes,
    hierarchical_bytes,
    reduce_scatter_bytes,
    skipreduce_bytes,
    skipreduce_steps,
)


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
        >>> from skipreduce_jax.cost import LinkModel
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
        for name in ("alpha", "bandwidth", "call_overhead"):
            value = check_real(getattr(self, name), name, api="LinkModel",
                               positive=name == "bandwidth")
            object.__setattr__(self, name, value)

    @classmethod
    def from_gbit(cls, gbit_per_s: float, alpha: float = 0.0,
                  call_overhead: float = 0.0) -> LinkModel:
        """Builds a model from a bandwidth in Gbit/s (``1e9`` bits per second).

        Args:
            gbit_per_s: Bandwidth per rank in Gbit/s, ``> 0``.
            alpha: Latency per step in seconds.
            call_overhead: Constant cost per call in seconds.

        Returns:
            The link model, with ``bandwidth = gbit_per_s * 1e9 / 8`` bytes/s.

        Example:
            >>> from skipreduce_jax.cost import LinkModel
            >>> LinkModel.from_gbit(400).bandwidth
            50000000000.0
        """
        g = check_real(gbit_per_s, "gbit_per_s", api="LinkModel.from_gbit", positive=True)
        return cls.from_gbyte(g / 8.0, alpha=alpha, call_overhead=call_overhead)

    @classmethod
    def from_gbyte(cls, gbyte_per_s: float, alpha: float = 0.0,
                   call_overhead: float = 0.0) -> LinkModel:
        """Builds a model from a bandwidth in GB/s (``1e9`` bytes per second).

        The arguments are those of :meth:`from_gbit`, with the bandwidth
        ``gbyte_per_s`` in GB/s, ``> 0``.

        Returns:
            The link model, with ``bandwidth = gbyte_per_s * 1e9`` bytes/s.

        Example:
            >>> from skipreduce_jax.cost import LinkModel
            >>> LinkModel.from_gbyte(25).bandwidth
            25000000000.0
        """
        g = check_real(gbyte_per_s, "gbyte_per_s", api="LinkModel.from_gbyte", positive=True)
        return cls(alpha=alpha, bandwidth=g * 1e9, call_overhead=call_overhead)

    @property
    def gbit_per_s(self) -> float:
        """Bandwidth in Gbit/s."""
        return self.bandwidth * 8.0 / 1e9

    def time(self, steps: float, nbytes: float) -> float:
        """Predicts the time of a call of ``steps`` steps that sends ``nbytes`` per rank (``>= 0``).

        Returns:
            ``call_overhead + steps * alpha + nbytes / bandwidth`` in seconds.

        Example:
            >>> from skipreduce_jax.cost import LinkModel
            >>> LinkModel(alpha=1e-6, bandwidth=1e9, call_overhead=5e-6).time(4, 1e6)
            0.001009
        """
        s = check_real(steps, "steps", api="LinkModel.time")
        b = check_real(nbytes, "nbytes", api="LinkModel.time")
        return self.call_overhead + s * self.alpha + b / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        """Returns the constants as a JSON-serialisable dict.

        Example:
            >>> from skipreduce_jax.cost import LinkModel
            >>> LinkModel(alpha=1e-6, bandwidth=1e9).to_dict()
            {'alpha': 1e-06, 'bandwidth': 1000000000.0, 'call_overhead': 0.0}
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LinkModel:
        """Builds a model from :meth:`to_dict` output.

        Args:
            data: Mapping with ``alpha`` and ``bandwidth`` (bytes/s) and
                optionally ``call_overhead``; other keys are ignored.

        Example:
            >>> from skipreduce_jax.cost import LinkModel
            >>> LinkModel.from_dict({"alpha": 0, "bandwidth": 1e9}).bandwidth
            1000000000.0
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"link model must be a JSON object, got {type(data).__name__}")
        missing = [key for key in ("alpha", "bandwidth") if key not in data]
        if missing:
            raise ValueError(f"link model is missing key(s) {missing}")
        return cls(alpha=data["alpha"], bandwidth=data["bandwidth"],
                   call_overhead=data.get("call_overhead", 0.0))


def write_json(path: str | os.PathLike[str], payload: Any) -> None:
    """Writes ``payload`` to ``path`` as indented JSON and a final newline."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def save_link_model(path: str | os.PathLike[str], model: LinkModel) -> None:
    """Writes a link model to a JSON file.

    Args:
        path: Destination file.
        model: The model to write.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, save_link_model
        >>> save_link_model("link.json", LinkModel.from_gbit(100))  # doctest: +SKIP
    """
    write_json(path, {"model": model.to_dict()})


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON in ``path``; a ValueError names the file, where it fails and ``what`` to pass."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            problem = f"{e.msg} at line {e.lineno}, column {e.colno}"
        except UnicodeDecodeError as e:
            problem = f"not UTF-8 text: {e.reason} at byte {e.start}"
    raise ValueError(f"{os.fspath(path)} is not valid JSON ({problem}). Pass {what}.")


def load_link_model(path: str | os.PathLike[str]) -> LinkModel:
    """Reads a link model from a JSON file.

    The file holds either the constants directly or an object with a
    ``"model"`` key (as written by :func:`save_link_model` and by
    ``fit --json``).

    Args:
        path: File to read.

    Example:
        >>> from skipreduce_jax.cost import load_link_model
        >>> load_link_model("link.json")  # doctest: +SKIP
        LinkModel(alpha=1e-05, bandwidth=12500000000.0, call_overhead=0.0)
    """
    data = read_json(path, "a link model, as 'fit --save' writes it")
    if isinstance(data, Mapping) and "model" in data:
        data = data["model"]
    return LinkModel.from_dict(data)


def _check_link(link: Any, name: str, api: str) -> None:
    if not isinstance(link, LinkModel):
        raise TypeError(f"{api}: {name} must be a LinkModel, got {type(link).__name__}")


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
        >>> from skipreduce_jax.cost import LinkModel, predict_skipreduce
        >>> round(predict_skipreduce(1e9, 8, 7, LinkModel.from_gbit(100)), 9)
        0.07
    """
    _check_link(link, "link", "predict_skipreduce")
    wire = skipreduce_bytes(nbytes, n, num_skip)
    if n == 1:
        return 0.0
    return link.time(skipreduce_steps(n, num_skip), wire)


def predict_allreduce(nbytes: float, n: int, link: LinkModel) -> float:
    """Predicts the time of one ring all-reduce (:func:`predict_skipreduce` at k = 0).

    The arguments are those of :func:`predict_skipreduce`, without ``num_skip``.

    Returns:
        Seconds: ``call_overhead + 2 (n - 1) alpha + 2 (n - 1) / n * nbytes / bandwidth``.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, predict_allreduce
        >>> round(predict_allreduce(1e9, 8, LinkModel.from_gbit(100)), 9)
        0.14
    """
    return predict_skipreduce(nbytes, n, 0, link)


def _hierarchical_phases(nbytes: float, n_outer: int, n_inner: int, num_skip: int,
                         outer_link: LinkModel, inner_link: LinkModel) -> tuple[float, float]:
    """Returns ``(inner_seconds, outer_seconds)`` of hierarchical SkipReduce."""
    _check_link(outer_link, "outer_link", "predict_hierarchical")
    _check_link(inner_link, "inner_link", "predict_hierarchical")
    hierarchical_bytes(nbytes, n_outer, n_inner, num_skip)  # checks every argument
    inner = 0.0
    if n_inner > 1:
        inner = (inner_link.time(n_inner - 1, reduce_scatter_bytes(nbytes, n_inner))
                 + inner_link.time(n_inner - 1, all_gather_bytes(nbytes, n_inner)))
    outer = predict_skipreduce(float(nbytes) / n_inner, n_outer, num_skip, outer_link)
    return inner, outer


def predict_hierarchical(nbytes: float, n_outer: int, n_inner: int, num_skip: int,
                         outer_link: LinkModel, inner_link: LinkModel) -> float:
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
        >>> from skipreduce_jax.cost import LinkModel, predict_hierarchical
        >>> slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
        >>> round(predict_hierarchical(1e9, 4, 8, 3, slow, fast), 6)
        0.025
    """
    return sum(_hierarchical_phases(nbytes, n_outer, n_inner, num_skip, outer_link, inner_link))


def predict_hierarchical_allreduce(nbytes: float, n_outer: int, n_inner: int,
                                   outer_link: LinkModel, inner_link: LinkModel) -> float:
    """Predicts the time of a hierarchical all-reduce without skipping.

    The arguments are those of :func:`predict_hierarchical`, without ``num_skip``; the
    result, in seconds, equals ``predict_hierarchical(..., num_skip=0, ...)``.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, predict_hierarchical_allreduce
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


def required_num_skip(nbytes: float, n: int, link: LinkModel,
                      target_seconds: float) -> int | None:
    """Finds the fewest skipped steps that meet a communication time target.

    The arguments are those of :func:`predict_skipreduce` without ``num_skip``,
    and ``target_seconds``, the time budget for one call in seconds, ``>= 0``.

    Returns:
        The smallest ``k`` in ``[0, n - 1]`` with
        ``predict_skipreduce(nbytes, n, k, link) <= target_seconds``, or None if
        even ``k = n - 1`` is too slow. Its skip ratio is ``k / (n - 1)``
        (:func:`required_skip_ratio`).

    Example:
        >>> from skipreduce_jax.cost import LinkModel, required_num_skip
        >>> link = LinkModel.from_gbit(100)
        >>> required_num_skip(1e9, 8, link, 0.1), required_num_skip(1e9, 8, link, 0.05)
        (4, None)
    """
    api = "required_num_skip"
    n = check_int(n, "n", api=api, minimum=1)
    target = check_real(target_seconds, "target_seconds", api=api)
    predict_skipreduce(nbytes, n, 0, link)  # checks nbytes and link
    return _smallest_k(lambda k: predict_skipreduce(nbytes, n, k, link), n - 1, target)


def required_skip_ratio(nbytes: float, n: int, link: LinkModel,
                        target_seconds: float) -> float | None:
    """Finds the smallest skip ratio that meets a communication time target.

    The arguments are those of :func:`required_num_skip`.

    Returns:
        ``k / (n - 1)`` for ``k = required_num_skip(...)`` (0.0 when ``n = 1``),
        which ``skip_ratio_to_num_skip`` maps back to ``k``; None if the
        target cannot be met.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, required_skip_ratio
        >>> required_skip_ratio(1e9, 8, LinkModel.from_gbit(100), 0.1)
        0.5714285714285714
    """
    k = required_num_skip(nbytes, n, link, target_seconds)
    if k is None:
        return None
    return k / (n - 1) if n > 1 else 0.0


def required_num_skip_hierarchical(nbytes: float, n_outer: int, n_inner: int,
                                   outer_link: LinkModel, inner_link: LinkModel,
                                   target_seconds: float) -> int | None:
    """Finds the fewest skipped outer steps that meet a time target, hierarchically.

    The arguments are those of :func:`predict_hierarchical` without ``num_skip``,
    and the time budget ``target_seconds`` as in :func:`required_num_skip`.

    Returns:
        The smallest ``k`` in ``[0, n_outer - 1]`` with
        ``predict_hierarchical(...) <= target_seconds``, or None.

    Example:
        >>> from skipreduce_jax.cost import LinkModel, required_num_skip_hierarchical
        >>> slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
        >>> required_num_skip_hierarchical(1e9, 4, 8, slow, fast, 0.031)
        1
    """
    api = "required_num_skip_hierarchical"
    n_outer = check_int(n_outer, "n_outer", api=api, minimum=1)
    target = check_real(target_seconds, "target_seconds", api=api)
    predict_hierarchical(nbytes, n_outer, n_inner, 0, outer_link, inner_link)
    return _smallest_k(
        lambda k: predict_hierarchical(nbytes, n_outer, n_inner, k, outer_link, inner_link),
        n_outer - 1, target)
