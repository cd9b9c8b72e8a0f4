r"""Command line of the cost model: ``python -m skipreduce_jax.cost``.

``python -m skipreduce_jax.cost {predict,target,fit,check} ...``; see ``--help``
of each subcommand. Sizes accept decimal (``KB``, ``MB``, ``GB``, ``TB``) and
binary (``KiB``, ``MiB``, ``GiB``, ``TiB``) units; element counts (``--params``)
decimal suffixes (``K`` = 1e3, ``M`` = 1e6, ``B``/``G`` = 1e9, ``T`` = 1e12, see
:func:`parse_count`); times accept ``s``, ``ms``, ``us`` and ``ns`` (a bare
number is seconds). Every subcommand prints aligned plain-text tables, or JSON
with ``--json``.

* ``predict``: time of ring all-reduce and SkipReduce at each ``--k`` or
  ``--ratio`` with speedups; hierarchical with ``--inner L --inner-gbit X``
  (then ``--gbit`` is each device's outer bandwidth: in the second example
  every GPU has its own 25 Gbit/s NIC; with one NIC per host of L devices,
  pass the NIC's rate / L)::

      python -m skipreduce_jax.cost predict --n 8 --size 100MB --gbit 100 \
          --alpha 10us --overhead 50us --k 0 2 4 7
      python -m skipreduce_jax.cost predict --n 16 --params 25M --dtype bfloat16 \
          --gbit 25 --inner 8 --inner-gbit 2400 --ratio 0 0.5 1

* ``target``: the smallest ``k`` (and its skip ratio) that meets ``--time``::

      python -m skipreduce_jax.cost target --n 64 --size 1GB --gbit 100 --time 150ms

* ``fit``: calibrate a :class:`LinkModel` from a measurement file, print it and
  the residuals, optionally check it against another file and save it::

      python -m skipreduce_jax.cost fit measurements.json --check other.json \
          --save link.json

* ``check``: predicted vs measured for a given model (``--model link.json`` or
  link flags)::

      python -m skipreduce_jax.cost check other.json --model link.json

``predict``, ``target`` and ``check`` accept ``--model FILE`` (a file written by
``fit --save``) instead of ``--gbit``/``--gbyte``, ``--alpha`` and
``--overhead``.

The parsers here are also what the benchmarks use: :func:`parse_count` reads
decimal counts, :func:`parse_binary_count` binary ones (``K`` = 2**10), the
element counts of ``benchmarks/collectives.py --sizes``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from skipreduce_jax import _checks as checks
from skipreduce_jax._schedule import skip_ratio_to_num_skip
from skipreduce_jax._traffic import (
    hierarchical_bytes,
    ring_allreduce_bytes,
    skipreduce_bytes,
    skipreduce_steps,
    traffic_fraction,
)

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
# Parsing and formatting
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
_BINARY_COUNT_UNITS: dict[str, float] = {
    "": 1.0, "k": 2.0**10, "m": 2.0**20, "g": 2.0**30, "t": 2.0**40}
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


# Short names --dtype takes, as the library's dtype names.
_DTYPE_ALIASES = {"fp64": "float64", "f64": "float64", "fp32": "float32",
                  "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "f16": "float16", "fp8": "float8_e4m3fn"}


def parse_comm_dtype(text: str) -> str:
    """``--comm-dtype``: a dtype the library takes as ``comm_dtype``, by name.

    The library's own check decides (a floating dtype; float64 is float32
    unless jax_enable_x64 is on), so the command line prices only wires
    that ``skip_psum`` and ``skip_reduce`` accept.
    """
    try:
        dtype = checks.check_comm_dtype(_DTYPE_ALIASES.get(text, text),
                                        api="skip_reduce")
    except TypeError as e:
        raise ValueError(f"{text!r}: the library refuses it ({e}) Give a "
                         "floating dtype, e.g. bfloat16 or float16, or leave "
                         "--comm-dtype out.") from None
    if dtype is None or dtype.name not in DTYPE_BYTES:
        raise ValueError(f"{text!r} is not a dtype name; give e.g. bfloat16 or "
                         "float16.")
    return dtype.name


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
        help="number of gradient elements, e.g. 25M; K/M/G/T = 1e3/1e6/1e9/1e12, "
        "B = G (use with --dtype)",
    )
    g.add_argument(
        "--dtype", default="float32", choices=sorted(DTYPE_BYTES),
        metavar="DTYPE", help="element type for --params (default float32)",
    )
    g.add_argument(
        "--comm-dtype", default=None, type=_arg_type(parse_comm_dtype),
        metavar="DTYPE", help="what crosses the network (comm_dtype, a "
        "floating dtype as the library accepts it, e.g. bfloat16 or float16): "
        "the ring sends --size (or --params) at this width; not with --inner "
        "(default: --dtype)",
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
    nbytes = args.size if args.size is not None else args.params * DTYPE_BYTES[args.dtype]
    comm = getattr(args, "comm_dtype", None)
    if comm is None:
        return nbytes
    if DTYPE_BYTES[comm] > DTYPE_BYTES[args.dtype]:
        raise ValueError(f"--comm-dtype {comm} is wider than --dtype {args.dtype}: "
                         "pass a narrower one (e.g. bfloat16) or leave it out")
    if args.inner not in (None, 1):
        raise ValueError("--comm-dtype narrows the outer ring only; with --inner "
                         "run the outer axis alone (--n hosts, --size / L)")
    # The same elements, each sent at the wire's width (skip_psum's comm_dtype).
    return nbytes * DTYPE_BYTES[comm] // DTYPE_BYTES[args.dtype]


def _problem_from_args(
    args: argparse.Namespace,
) -> tuple[int, int, LinkModel, LinkModel | None]:
    """``(n, nbytes, link, inner_link)`` of ``predict`` and ``target``."""
    if args.n < 2:
        raise ValueError(f"--n must be >= 2, got {args.n}")
    return args.n, _nbytes_from_args(args), _link_from_args(args), _inner_link_from_args(args)


def _cmd_predict(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    n, nbytes, link, inner_link = _problem_from_args(args)
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
    n, nbytes, link, inner_link = _problem_from_args(args)
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
        >>> from skipreduce_jax.cost import main
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
