r"""Command line of the cost model: ``python -m skipreduce_jax.cost``.

``python -m skipreduce_jax.cost {predict,target,fit,check} ...``: ``predict``
prices ring all-reduce and SkipReduce at each ``--k`` or ``--ratio``
(hierarchically with ``--inner L``), ``target`` finds the smallest ``k`` that
meets ``--time``, ``fit`` calibrates a :class:`LinkModel` on a measurement file
and ``check`` compares a model with one. The ``--help`` of each says more; the
top-level ``--help`` ends with examples. Sizes accept decimal and binary units
(:func:`parse_size`), element counts decimal suffixes (:func:`parse_count`) and
times ``s``, ``ms``, ``us`` and ``ns`` (:func:`parse_seconds`). Every
subcommand prints aligned plain-text tables, or JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from skipreduce_jax._ring.traffic import (
    hierarchical_bytes,
    ring_allreduce_bytes,
    skip_ratio_to_num_skip,
    skipreduce_bytes,
    skipreduce_steps,
    traffic_fraction,
)
from skipreduce_jax._ring.wire import check_comm_dtype, make_wire

from ._fit import KINDS, Measurement, Validation, fit_link_model, load_measurements, validate
from ._model import (
    LinkModel,
    _hierarchical_phases,
    load_link_model,
    predict_allreduce,
    predict_hierarchical,
    predict_hierarchical_allreduce,
    predict_skipreduce,
    required_num_skip,
    required_num_skip_hierarchical,
    save_link_model,
)

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "fp64": 8, "f64": 8, "float32": 4, "fp32": 4, "f32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "f16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1}
"""Bytes per element for the ``--dtype`` names accepted by the CLI."""

_SIZE_UNITS: dict[str, float] = {
    "": 1.0, "b": 1.0, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
    "t": 1e12, "tb": 1e12, "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40}
_COUNT_UNITS: dict[str, float] = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_BINARY_COUNT_UNITS: dict[str, float] = {
    "": 1.0, "k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}
# Seconds are divided by these, so that e.g. "10us" gives exactly 1e-05.
_TIME_DIVISORS: dict[str, float] = {"": 1.0, "s": 1.0, "ms": 1e3, "us": 1e6, "\u00b5s": 1e6,
                                    "ns": 1e9}
_NUMBER_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9]*)\s*$")


def _parse_with_units(name: str, text: str, units: Mapping[str, float]) -> tuple[float, float]:
    """Splits ``text`` into ``(number, unit value)``, raising on bad input."""
    match = _NUMBER_RE.match(str(text))
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"{name}: cannot parse {text!r}; expected a non-negative number with "
                         f"an optional unit out of {sorted(u for u in units if u)}")
    value, scale = float(match.group(1)), units[match.group(2).lower()]
    if not math.isfinite(value * scale):
        raise ValueError(f"{name}: {text!r} is too large")
    return value, scale


def parse_size(text: str) -> int:
    """Parses a byte size such as ``100MB``, ``1.5GiB`` or ``4096``.

    Args:
        text: Number with an optional unit: ``B``, ``KB``/``K``, ``MB``/``M``,
            ``GB``/``G``, ``TB``/``T`` (powers of 1000) or ``KiB``, ``MiB``,
            ``GiB``, ``TiB`` (powers of 1024); case-insensitive.

    Returns:
        The size in bytes, rounded to an integer.

    Example:
        >>> from skipreduce_jax.cost import parse_size
        >>> parse_size("100MB"), parse_size("1KiB"), parse_size("512")
        (100000000, 1024, 512)
    """
    value, scale = _parse_with_units("size", text, _SIZE_UNITS)
    return round(value * scale)


def parse_count(text: str) -> int:
    """Parses a decimal element count such as ``25M`` (25e6) or ``1.3B``.

    The suffixes are decimal, as in model sizes ("a 1.3B model"); for binary
    ones (``4M`` = 4 * 2**20) use :func:`parse_binary_count`.

    Args:
        text: Number with an optional suffix ``K`` (1e3), ``M`` (1e6),
            ``B``/``G`` (1e9) or ``T`` (1e12); case-insensitive.

    Returns:
        The count, rounded to an integer.

    Example:
        >>> from skipreduce_jax.cost import parse_count
        >>> parse_count("25M"), parse_count("1.3B")
        (25000000, 1300000000)
    """
    value, scale = _parse_with_units("params", text, _COUNT_UNITS)
    return round(value * scale)


def parse_binary_count(text: str) -> int:
    """Parses a binary element count such as ``4M`` (4 * 2**20), ``512K`` or ``1000``.

    The suffixes are powers of 1024, as buffer lengths usually are; for
    decimal ones (``25M`` = 25e6) use :func:`parse_count`.

    Args:
        text: Number with an optional suffix ``K`` (2**10), ``M`` (2**20),
            ``G`` (2**30) or ``T`` (2**40); case-insensitive.

    Returns:
        The count; it must come out a whole number (``1.5K`` does, ``0.3K``
        does not).

    Example:
        >>> from skipreduce_jax.cost import parse_binary_count
        >>> parse_binary_count("16M"), parse_binary_count("1.5K"), parse_binary_count("1000")
        (16777216, 1536, 1000)
    """
    value, scale = _parse_with_units("count", text, _BINARY_COUNT_UNITS)
    if not (value * scale).is_integer():
        raise ValueError(f"count: {text!r} is not a whole number of elements")
    return int(value * scale)


def parse_seconds(text: str) -> float:
    """Parses a duration such as ``10us``, ``2.5ms`` or ``0.1``.

    Args:
        text: Number with an optional unit ``s``, ``ms``, ``us`` (or ``µs``) or
            ``ns``; a bare number is seconds.

    Returns:
        The duration in seconds.

    Example:
        >>> from skipreduce_jax.cost import parse_seconds
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
    return (f"{link.gbit_per_s:.4g} Gbit/s ({link.bandwidth / 1e9:.4g} GB/s), alpha "
            f"{_fmt_seconds(link.alpha)}/step, overhead {_fmt_seconds(link.call_overhead)}/call")


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligns cells: the first column left, all others right."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.ljust(w) if i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


# Short names --dtype takes, as the library's dtype names.
_DTYPE_ALIASES = {"fp64": "float64", "f64": "float64", "fp32": "float32", "f32": "float32",
                  "bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp8": "float8_e4m3fn"}


def parse_comm_dtype(text: str) -> str:
    """``--comm-dtype``: a dtype name, if the library's own check takes it as ``comm_dtype``."""
    try:
        dtype = check_comm_dtype(_DTYPE_ALIASES.get(text, text), api="skip_reduce")
    except TypeError as e:
        raise ValueError(f"{text!r}: the library refuses it ({e}) Give a "
                         "floating dtype, e.g. bfloat16 or float16, or leave "
                         "--comm-dtype out.") from None
    if dtype is None or dtype.name not in DTYPE_BYTES:
        raise ValueError(f"{text!r} is not a dtype name; give e.g. bfloat16 or float16.")
    return dtype.name


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


_SECONDS = _arg_type(parse_seconds)


def _add_link_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("link (slow network for hierarchical mode)")
    bw = g.add_mutually_exclusive_group()
    bw.add_argument("--gbit", type=float,
                    help="bandwidth per rank in Gbit/s (with --inner: per device on "
                         "the outer links, e.g. a NIC's rate / L if L devices share it)")
    bw.add_argument("--gbyte", type=float, help="bandwidth per rank in GB/s (as --gbit)")
    bw.add_argument("--model", metavar="FILE", help="link model JSON written by 'fit --save'")
    g.add_argument("--alpha", type=_SECONDS, default=None,
                   help="latency per ring step, e.g. 10us (default 0)")
    g.add_argument("--overhead", type=_SECONDS, default=None,
                   help="constant cost per collective call, e.g. 50us (default 0)")


def _add_problem_args(p: argparse.ArgumentParser) -> None:
    """The ring (``--n``, hierarchical mode), the message and the link of predict and target."""
    p.add_argument("--n", type=int, required=True,
                   help="ranks in the ring (hosts on the outer axis in hierarchical mode), >= 2")
    g = p.add_argument_group("hierarchical mode")
    g.add_argument("--inner", type=int, default=None, metavar="L",
                   help="devices per host on the fast inner axis; enables hierarchical mode")
    bw = g.add_mutually_exclusive_group()
    bw.add_argument("--inner-gbit", type=float, help="inner bandwidth per device in Gbit/s")
    bw.add_argument("--inner-gbyte", type=float, help="inner bandwidth per device in GB/s")
    g.add_argument("--inner-alpha", type=_SECONDS, default=0.0,
                   help="inner latency per step (default 0)")
    g.add_argument("--inner-overhead", type=_SECONDS, default=0.0,
                   help="inner constant cost per call (default 0)")

    g = p.add_argument_group("message")
    size = g.add_mutually_exclusive_group(required=True)
    size.add_argument("--size", type=_arg_type(parse_size),
                      help="buffer size per rank, e.g. 100MB, 1.5GiB, 4096")
    size.add_argument("--params", type=_arg_type(parse_count),
                      help="number of gradient elements, e.g. 25M; K/M/G/T = "
                           "1e3/1e6/1e9/1e12, B = G (use with --dtype)")
    g.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES), metavar="DTYPE",
                   help="element type for --params (default float32)")
    g.add_argument("--comm-dtype", default=None, type=_arg_type(parse_comm_dtype),
                   metavar="DTYPE", help="what crosses the network (comm_dtype, a "
                   "floating dtype as the library accepts it, e.g. bfloat16 or float16): "
                   "the ring sends --size (or --params) at this width; not with --inner "
                   "(default: --dtype)")
    _add_link_args(p)


def _add_kind_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", action="append", choices=KINDS,
                   help="use only measurements of this kind (repeatable; default all)")


# Each subcommand's help line and description.
_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "predict": ("predicted time of ring all-reduce and SkipReduce at several k",
                "Prints the predicted time of a ring all-reduce and of SkipReduce at each "
                "requested k (or skip ratio), with traffic and speedup over the "
                "all-reduce. With --inner L the mesh is n hosts x L devices: inner "
                "reduce-scatter, outer SkipReduce, inner all-gather; speedups are over "
                "the hierarchical all-reduce (k=0). Ratios map to "
                "k = floor(ratio*(n-1)+0.5)."),
    "target": ("skip ratio needed to meet a communication time target",
               "Finds the smallest k (and skip ratio k/(n-1)) whose predicted time is at "
               "most --time, or reports that even k=n-1 is too slow."),
    "fit": ("fit a link model to measurements and print residuals",
            "Fits alpha, bandwidth and call overhead by non-negative least squares to "
            "the measurements in FILE (a JSON list of {n, num_skip, nbytes, seconds, "
            "kind} objects, or an object with a 'measurements' list) and prints the "
            "model and the residuals; --check evaluates it on another file."),
    "check": ("predicted vs measured times for a given link model",
              "Prints predicted vs measured times, with relative errors."),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m skipreduce_jax.cost",
        description=(
            "Alpha-beta cost model of ring all-reduce and SkipReduce: one call costs "
            "call_overhead + steps * alpha + bytes_per_rank / bandwidth. SkipReduce "
            "with k skipped of the n-1 reduce-scatter steps takes 2(n-1)-k steps of "
            "B/n bytes. Ignores congestion, topology, in-network reduction and "
            "overlap with compute; fitted constants are effective values."),
        epilog=(
            "examples:\n"
            "  %(prog)s predict --n 8 --size 100MB --gbit 100 --alpha 10us --k 0 2 4 7\n"
            "  %(prog)s predict --n 16 --params 25M --dtype bf16 --gbit 25 "
            "--inner 8 --inner-gbit 2400\n"
            "  %(prog)s target --n 64 --size 1GB --gbit 100 --time 150ms\n"
            "  %(prog)s fit measurements.json --check other.json --save link.json\n"
            "  %(prog)s check other.json --model link.json"),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd = {name: sub.add_parser(name, help=help_line, description=description)
           for name, (help_line, description) in _SUBCOMMANDS.items()}

    _add_problem_args(cmd["predict"])
    ks = cmd["predict"].add_mutually_exclusive_group()
    ks.add_argument("--k", type=int, nargs="+", help="numbers of skipped steps")
    ks.add_argument("--ratio", type=float, nargs="+",
                    help="skip ratios in [0, 1] (default: every k if n <= 9, else "
                         "0 0.1 0.25 0.5 0.75 1)")

    _add_problem_args(cmd["target"])
    cmd["target"].add_argument("--time", type=_SECONDS, required=True,
                               help="target time per call, e.g. 50ms")

    p = cmd["fit"]
    p.add_argument("file", metavar="FILE", nargs="?", help="measurements JSON")
    p.add_argument("--fit", dest="fit_file", metavar="FILE", help="same as FILE")
    p.add_argument("--check", metavar="FILE", help="measurements JSON to validate against")
    _add_kind_arg(p)
    p.add_argument("--absolute", action="store_true",
                   help="minimise absolute instead of relative residuals")
    p.add_argument("--no-alpha", action="store_true", help="fix alpha at 0")
    p.add_argument("--no-overhead", action="store_true", help="fix the call overhead at 0")
    p.add_argument("--save", metavar="FILE", help="write the fitted model as JSON")

    cmd["check"].add_argument("file", metavar="FILE", help="measurements JSON")
    _add_kind_arg(cmd["check"])
    _add_link_args(cmd["check"])
    for p in cmd.values():
        p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return parser


def _bandwidth_link(gbit: float | None, gbyte: float | None, alpha: float,
                    overhead: float) -> LinkModel | None:
    """The link of ``--gbit`` or ``--gbyte`` (whichever is given), or None."""
    if gbit is not None:
        return LinkModel.from_gbit(gbit, alpha=alpha, call_overhead=overhead)
    if gbyte is not None:
        return LinkModel.from_gbyte(gbyte, alpha=alpha, call_overhead=overhead)
    return None


def _link_from_args(args: argparse.Namespace) -> LinkModel:
    if getattr(args, "model", None):
        if args.alpha is not None or args.overhead is not None:
            raise ValueError("--alpha/--overhead cannot be combined with --model")
        return load_link_model(args.model)
    link = _bandwidth_link(args.gbit, args.gbyte, args.alpha or 0.0, args.overhead or 0.0)
    if link is None:
        raise ValueError("one of --gbit, --gbyte or --model is required")
    return link


def _inner_link_from_args(args: argparse.Namespace) -> LinkModel | None:
    if args.inner is None:
        if (args.inner_gbit is not None or args.inner_gbyte is not None
                or args.inner_alpha or args.inner_overhead):
            raise ValueError("--inner-gbit/--inner-gbyte/--inner-alpha/"
                             "--inner-overhead need --inner")
        return None
    if args.inner < 1:
        raise ValueError(f"--inner must be >= 1, got {args.inner}")
    link = _bandwidth_link(args.inner_gbit, args.inner_gbyte, args.inner_alpha,
                           args.inner_overhead)
    if link is not None:
        return link
    if args.inner == 1:
        # No inner communication: any constants will do.
        return LinkModel(alpha=0.0, bandwidth=1.0)
    raise ValueError("--inner needs --inner-gbit or --inner-gbyte")


def _nbytes_from_args(args: argparse.Namespace) -> int:
    nbytes = args.size if args.size is not None else args.params * DTYPE_BYTES[args.dtype]
    comm = args.comm_dtype
    if comm is None:
        return nbytes
    if DTYPE_BYTES[comm] > DTYPE_BYTES[args.dtype]:
        raise ValueError(f"--comm-dtype {comm} is wider than --dtype {args.dtype}: "
                         "pass a narrower one (e.g. bfloat16) or leave it out")
    if args.inner not in (None, 1):
        raise ValueError("--comm-dtype narrows the outer ring only; with --inner "
                         "run the outer axis alone (--n hosts, --size / L)")
    # The same elements, as the wire sends them (skip_psum's comm_dtype).
    elements = nbytes // DTYPE_BYTES[args.dtype]
    return make_wire(np.dtype(comm)).piece_bytes(1, elements, _DTYPE_ALIASES.get(
        args.dtype, args.dtype), None, phase="gather")


def _problem_from_args(
    args: argparse.Namespace,
) -> tuple[int, int, LinkModel, LinkModel | None, str]:
    """``(n, nbytes, link, inner_link, what)`` of predict and target; ``what``: their first line."""
    if args.n < 2:
        raise ValueError(f"--n must be >= 2, got {args.n}")
    n, nbytes, link = args.n, _nbytes_from_args(args), _link_from_args(args)
    inner_link = _inner_link_from_args(args)
    if inner_link is None:
        what = f"ring all-reduce: n={n} ranks, {_fmt_bytes(nbytes)} per rank"
    else:
        what = f"hierarchical: {n} hosts x {args.inner} devices, {_fmt_bytes(nbytes)} per device"
    return n, nbytes, link, inner_link, what


def _cmd_predict(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    n, nbytes, link, inner_link, what = _problem_from_args(args)
    requested: list[tuple[int, float | None]]
    if args.k is not None:
        for k in args.k:
            if not 0 <= k <= n - 1:
                raise ValueError(f"--k values must be in [0, n - 1] = [0, {n - 1}], got {k}")
        requested = [(k, None) for k in args.k]
    else:
        ratios = args.ratio
        if ratios is None:
            ratios = [k / (n - 1) for k in range(n)] if n <= 9 else [0, 0.1, 0.25, 0.5, 0.75, 1.0]
        for r in ratios:
            if not 0 <= r <= 1:
                raise ValueError(f"--ratio values must be in [0, 1], got {r}")
        requested = [(skip_ratio_to_num_skip(r, n), float(r)) for r in ratios]

    lines = [what]
    L = args.inner
    if inner_link is None:
        base, ring_bytes = predict_allreduce(nbytes, n, link), ring_allreduce_bytes(nbytes, n)
        payload: dict[str, Any] = {
            "mode": "flat", "n": n, "nbytes": nbytes, "link": link.to_dict(),
            "allreduce_seconds": base, "allreduce_bytes_per_rank": ring_bytes}
        lines += [f"link: {_fmt_link(link)}",
                  f"ring all-reduce: {_fmt_seconds(base)}, {_fmt_bytes(ring_bytes)} sent per rank"]
        headers = ["steps", "bytes/rank", "traffic"]
    else:
        base = predict_hierarchical_allreduce(nbytes, n, L, link, inner_link)
        payload = {
            "mode": "hierarchical", "n_outer": n, "n_inner": L, "nbytes": nbytes,
            "outer_link": link.to_dict(),
            "inner_link": inner_link.to_dict() if L > 1 else None, "allreduce_seconds": base}
        lines.append(f"outer link: {_fmt_link(link)}")
        if L > 1:
            lines.append(f"inner link: {_fmt_link(inner_link)}")
        lines.append(f"hierarchical all-reduce (k=0): {_fmt_seconds(base)}")
        headers = ["outer bytes", "inner time", "outer time"]

    rows_json: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    for k, r in requested:
        if inner_link is None:
            t = predict_skipreduce(nbytes, n, k, link)
            wire, frac = skipreduce_bytes(nbytes, n, k), traffic_fraction(n, k)
            columns = {"steps": skipreduce_steps(n, k), "bytes_per_rank": wire,
                       "traffic_fraction": frac}
            cells = [str(skipreduce_steps(n, k)), _fmt_bytes(wire), f"{frac:.1%}"]
        else:
            inner_t, outer_t = _hierarchical_phases(nbytes, n, L, k, link, inner_link)
            t = inner_t + outer_t
            inner_b, outer_b = hierarchical_bytes(nbytes, n, L, k)
            columns = {"inner_bytes_per_device": inner_b, "outer_bytes_per_device": outer_b,
                       "inner_seconds": inner_t, "outer_seconds": outer_t}
            cells = [_fmt_bytes(outer_b), _fmt_seconds(inner_t), _fmt_seconds(outer_t)]
        speedup = base / t if t > 0 else None
        rows_json.append({"num_skip": k, "skip_ratio": r, "k_over_n_minus_1": k / (n - 1),
                          **columns, "seconds": t, "speedup": speedup})
        rows.append([str(k), f"{k / (n - 1):.3f}", *cells, _fmt_seconds(t),
                     _fmt_speedup(speedup)])
    headers = ["k", "k/(n-1)", *headers, "time", "speedup"]
    if args.ratio is not None:
        headers = ["ratio", *headers]
        rows = [[f"{r:g}", *row] for (_, r), row in zip(requested, rows, strict=True)]
    payload["rows"] = rows_json
    return "\n".join([*lines, "", _table(headers, rows)]), payload


def _cmd_target(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    n, nbytes, link, inner_link, what = _problem_from_args(args)
    target, L = args.time, args.inner
    if inner_link is None:
        base = predict_allreduce(nbytes, n, link)
        k = required_num_skip(nbytes, n, link, target)
        time_of_k = functools.partial(predict_skipreduce, nbytes, n, link=link)
    else:
        base = predict_hierarchical_allreduce(nbytes, n, L, link, inner_link)
        k = required_num_skip_hierarchical(nbytes, n, L, link, inner_link, target)
        time_of_k = functools.partial(predict_hierarchical, nbytes, n, L, outer_link=link,
                                      inner_link=inner_link)
    best = time_of_k(n - 1)
    payload: dict[str, Any] = {
        "n": n, "nbytes": nbytes, "target_seconds": target, "allreduce_seconds": base,
        "min_seconds": best, "num_skip": k,
        "skip_ratio": None if k is None else k / (n - 1),
        "seconds": None if k is None else time_of_k(k)}
    lines = [what, f"link: {_fmt_link(link)}"]
    if inner_link is not None and L > 1:
        lines.append(f"inner link: {_fmt_link(inner_link)}")
    lines.append(f"target: {_fmt_seconds(target)}")
    rows = [["all-reduce (k=0)", _fmt_seconds(base)], [f"k={n - 1} (max)", _fmt_seconds(best)]]
    if k is None:
        lines.append(f"not reachable: even k={n - 1} (skip ratio 1) takes {_fmt_seconds(best)}")
    else:
        t = time_of_k(k)
        rows.append([f"k={k} (needed)", _fmt_seconds(t)])
        lines.append(f"needed: k={k} of {n - 1} (skip ratio {k / (n - 1):.4g}), "
                     f"{_fmt_seconds(t)}, speedup {_fmt_speedup(base / t if t > 0 else None)}")
    return "\n".join([*lines, "", _table(["case", "time"], rows)]), payload


def _validation_table(results: Sequence[Validation]) -> str:
    headers = ["kind", "n", "k", "nbytes", "measured", "predicted", "rel err"]
    rows = [[v.measurement.kind, str(v.measurement.n), str(v.measurement.num_skip),
             _fmt_bytes(v.measurement.nbytes), _fmt_seconds(v.measurement.seconds),
             _fmt_seconds(v.predicted), f"{v.rel_error:+.2%}"] for v in results]
    errs = np.abs([v.rel_error for v in results])
    summary = (f"{len(results)} points: mean |rel err| {np.mean(errs):.2%}, "
               f"max |rel err| {np.max(errs):.2%}")
    return _table(headers, rows) + "\n" + summary


def _validation_json(results: Sequence[Validation]) -> list[dict[str, Any]]:
    return [{**v.measurement.to_dict(), "predicted": v.predicted, "rel_error": v.rel_error}
            for v in results]


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
    model = fit_link_model(ms, weighting="absolute" if args.absolute else "relative",
                           fit_alpha=not args.no_alpha, fit_overhead=not args.no_overhead)
    residuals = validate(model, ms)
    payload: dict[str, Any] = {"model": model.to_dict(), "gbit_per_s": model.gbit_per_s,
                               "residuals": _validation_json(residuals)}
    lines = [
        f"fitted on {len(ms)} points from {path}"
        + (f" (kind: {', '.join(args.kind)})" if args.kind else ""),
        f"alpha          {model.alpha:.6g} s ({_fmt_seconds(model.alpha)} per step)",
        f"bandwidth      {model.bandwidth:.6g} B/s ({model.gbit_per_s:.4g} Gbit/s)",
        f"call_overhead  {model.call_overhead:.6g} s ({_fmt_seconds(model.call_overhead)})",
        "", "residuals:", _validation_table(residuals)]
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
    return "\n".join([f"link: {_fmt_link(model)}", "", _validation_table(results)]), payload


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command-line interface.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if None.

    Returns:
        Exit status 0. Bad arguments exit through ``SystemExit(2)`` with a
        message on stderr, as argparse does.

    Example:
        >>> from skipreduce_jax.cost import main
        >>> main(["predict", "--n", "8", "--size", "100MB", "--gbit", "100"])  # doctest: +SKIP
    """
    parser = _build_parser()
    args = parser.parse_args(argv)
    commands = {"predict": _cmd_predict, "target": _cmd_target, "fit": _cmd_fit,
                "check": _cmd_check}
    try:
        text, payload = commands[args.command](args)
    except (OSError, TypeError, ValueError) as e:
        parser.error(f"{args.command}: {e}")
    print(json.dumps(payload, indent=2) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
