r"""Calibrates the alpha-beta cost model on one benchmark run, checks it on others.

Reads result files of ``benchmarks/collectives.py`` (``collectives_*.json``,
e.g. written by ``benchmarks/cluster.py``), fits
:func:`skipreduce_jax.cost.fit_link_model` on the rows of ``--fit`` and
compares its predictions with the rows of ``--check`` through
:func:`skipreduce_jax.cost.validate`. Rows are grouped by code path, since
the cost model has one set of constants per path:

* ``ring``: ``ring_psum`` and static ``skip_psum`` (the ppermute ring, then
  the native all_gather),
* ``random``: Random ``skip_psum`` with k > 0 (the same ring plus the
  shuffling of sub-chunks, which costs time per element; with k = 0 nothing
  is shuffled and the row counts as ``ring``),
* ``psum``: ``lax.psum`` (gloo's own all-reduce; k = 0 only).

Each group gets its own :class:`~skipreduce_jax.cost.LinkModel`. The ``ring``
model is saved with :func:`skipreduce_jax.cost.save_link_model` to ``--save``
(readable by ``python -m skipreduce_jax.cost check FILE --model MODEL``); all
models, residuals and errors go to a report JSON next to it.

The fitted bandwidth belongs to the link rate of the fit run. With
``--scale-rate`` a check run with another rate (``meta.network.rate_bit_per_s``)
is predicted with the bandwidth scaled by the ratio of the rates (the per-step
and per-call constants are kept).

Example::

    .venv/bin/python benchmarks/calibrate.py \
        --fit benchmarks/results/collectives_cal_h4_1gbit_fit.json \
        --check benchmarks/results/collectives_cal_h4_1gbit_check.json \
                benchmarks/results/collectives_cluster_h8_500mbit.json \
        --scale-rate --save benchmarks/results/link_model_1gbit.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.collectives import parse_sizes  # noqa: E402
from skipreduce_jax.cost import (  # noqa: E402
    LinkModel,
    Measurement,
    Validation,
    fit_link_model,
    save_link_model,
    validate,
)

GROUPS: dict[str, tuple[str, ...]] = {
    "ring": ("ring", "static"),
    "random": ("random",),
    "psum": ("psum",),
}
TARGET = 0.10


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured row: the cost-model record plus where it came from.

    Attributes:
        measurement: the :class:`Measurement` (median seconds).
        mode: ``psum``, ``ring``, ``static`` or ``random``.
        source: the file name.
        rate: the link rate of the run in bit/s (None if not an emulated run).
        iqr: the interquartile range of the measured seconds.
    """

    measurement: Measurement
    mode: str
    source: str
    rate: float | None
    iqr: float


def load_points(path: Path, sizes: Sequence[int] | None = None) -> list[Point]:
    """The rows of one ``collectives_*.json`` file (parts of the ring left out)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    meta = data.get("meta", {})
    rate = (meta.get("network") or {}).get("rate_bit_per_s")
    points = []
    for row in data["rows"]:
        if row["kind"] == "part" or (sizes and row["size"] not in sizes):
            continue
        m = Measurement(n=meta["n"], num_skip=row["num_skip"], nbytes=row["nbytes"],
                        seconds=row["seconds"], kind=row["kind"])
        points.append(Point(m, row["mode"], path.name, rate, row["iqr"]))
    return points


def path_of(point: Point) -> str:
    """The code path of a point: Random SkipReduce with k = 0 is the static one."""
    if point.mode == "random" and point.measurement.num_skip == 0:
        return "static"
    return point.mode


def in_group(points: Sequence[Point], group: str) -> list[Point]:
    """The points of one code path (see :data:`GROUPS`)."""
    return [p for p in points if path_of(p) in GROUPS[group]]


def scaled(model: LinkModel, fit_rate: float | None, rate: float | None) -> LinkModel:
    """``model`` with its bandwidth scaled from ``fit_rate`` to ``rate``."""
    if not fit_rate or not rate or fit_rate == rate:
        return model
    return dataclasses.replace(model, bandwidth=model.bandwidth * rate / fit_rate)


def error_table(points: Sequence[Point], results: Sequence[Validation]) -> str:
    """Predicted vs measured, one line per point."""
    head = (f"{'file':<40} {'n':>2} {'mode':<7} {'k':>2} {'MB':>6} {'measured ms':>11} "
            f"{'IQR ms':>7} {'predicted ms':>12} {'error':>7}")
    lines = [head, "-" * len(head)]
    for p, r in zip(points, results, strict=True):
        m = r.measurement
        lines.append(f"{p.source:<40} {m.n:>2} {p.mode:<7} {m.num_skip:>2} "
                     f"{m.nbytes / 1e6:>6.1f} {m.seconds * 1e3:>11.1f} {p.iqr * 1e3:>7.1f} "
                     f"{r.predicted * 1e3:>12.1f} {r.rel_error:>+7.1%}")
    return "\n".join(lines)


def describe(model: LinkModel) -> str:
    """The constants of a model in readable units."""
    return (f"call_overhead {model.call_overhead * 1e3:.1f} ms, alpha "
            f"{model.alpha * 1e3:.2f} ms/step, bandwidth {model.gbit_per_s * 1e3:.0f} Mbit/s "
            f"({model.bandwidth / 1e6:.1f} MB/s)")


def summary(results: Sequence[Validation]) -> dict[str, float]:
    """Largest and mean absolute relative error."""
    errors = [abs(r.rel_error) for r in results]
    return {"max_abs_rel_error": max(errors), "mean_abs_rel_error": sum(errors) / len(errors),
            "points": len(errors)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(description="Fit the cost model on one run, check it on others.")
    p.add_argument("--fit", type=Path, nargs="+", required=True,
                   help="collectives_*.json file(s) to fit on")
    p.add_argument("--check", type=Path, nargs="*", default=[],
                   help="collectives_*.json file(s) to predict")
    p.add_argument("--fit-sizes", type=parse_sizes, default=None,
                   help="only these sizes (float32 elements per rank, binary suffixes "
                        "K/M/G/T = 2**10/20/30/40, e.g. 8M,24M) of the fit files (default all)")
    p.add_argument("--check-sizes", type=parse_sizes, default=None,
                   help="only these sizes of the check files (default all)")
    p.add_argument("--groups", default="ring,random,psum",
                   help="code paths to fit, of ring (ring_psum + static skip_psum), random, "
                        "psum (default all)")
    p.add_argument("--target", type=float, default=TARGET,
                   help="largest acceptable |relative error| of a check (default 0.10)")
    p.add_argument("--gate", default="ring,psum",
                   help="groups whose checks decide the exit status (default ring,psum: the "
                        "alpha-beta model has no term for Random SkipReduce's shuffling)")
    p.add_argument("--scale-rate", action="store_true",
                   help="scale the bandwidth by the ratio of link rates for check runs "
                        "at another rate")
    p.add_argument("--save", type=Path, default=None,
                   help="where to write the ring model (cost.save_link_model format); the "
                        "report goes to <save stem>_report.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Fits, checks, prints and saves; returns 0 if the gated checks meet the target."""
    args = build_parser().parse_args(argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    gate = {g.strip() for g in args.gate.split(",") if g.strip()}
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        raise SystemExit(f"unknown group(s) {unknown}; use {list(GROUPS)}")
    if not gate or not gate <= set(groups):
        raise SystemExit(f"--gate {args.gate!r}: name groups that are fitted "
                         f"(--groups {','.join(groups)})")
    fit_points = [p for path in args.fit for p in load_points(path, args.fit_sizes)]
    check_points = [p for path in args.check for p in load_points(path, args.check_sizes)]
    if not fit_points:
        raise SystemExit("no measurements in the --fit files (or none of --fit-sizes)")
    fit_rates = {p.rate for p in fit_points}
    if len(fit_rates) > 1:
        raise SystemExit(f"--fit files have different link rates "
                         f"{sorted(fit_rates, key=str)}")
    fit_rate = next(iter(fit_rates))

    report: dict[str, Any] = {"fit_files": [str(p) for p in args.fit],
                              "check_files": [str(p) for p in args.check],
                              "fit_sizes": args.fit_sizes, "check_sizes": args.check_sizes,
                              "fit_rate_bit_per_s": fit_rate, "target": args.target,
                              "gate": sorted(gate), "groups": {}}
    worst = 0.0
    checked: set[str] = set()
    for group in groups:
        fit_set = in_group(fit_points, group)
        if not fit_set:
            continue
        model = fit_link_model([p.measurement for p in fit_set])
        print(f"\n=== {group}: fitted on {len(fit_set)} points: {describe(model)}")
        residuals = validate(model, [p.measurement for p in fit_set])
        print(error_table(fit_set, residuals))
        entry: dict[str, Any] = {"model": model.to_dict(), "fit": summary(residuals),
                                 "fit_rows": _rows(fit_set, residuals), "checks": {}}
        for path in args.check:
            check_set = [p for p in in_group(check_points, group) if p.source == path.name]
            if not check_set:
                continue
            rate = check_set[0].rate
            if rate != fit_rate and not args.scale_rate:
                print(f"\n{path.name}: link rate {rate} != fit rate {fit_rate}; "
                      "skipped (pass --scale-rate)")
                continue
            used = scaled(model, fit_rate, rate)
            results = validate(used, [p.measurement for p in check_set])
            stats = summary(results)
            if group in gate:
                worst = max(worst, stats["max_abs_rel_error"])
                checked.add(group)
            note = ("" if used is model
                    else f" (bandwidth scaled to {used.gbit_per_s * 1e3:.0f} Mbit/s)")
            print(f"\n--- check {path.name}{note}: max |error| "
                  f"{stats['max_abs_rel_error']:.1%}, mean {stats['mean_abs_rel_error']:.1%}")
            print(error_table(check_set, results))
            entry["checks"][path.name] = {**stats, "model_used": used.to_dict(),
                                          "rows": _rows(check_set, results)}
        report["groups"][group] = entry
        if group == "ring" and args.save:
            args.save.parent.mkdir(parents=True, exist_ok=True)
            save_link_model(args.save, model)
            print(f"\nwrote {args.save}")

    print("\nsummary (max |relative error| of the predictions):")
    for group, entry in report["groups"].items():
        fit = entry["fit"]["max_abs_rel_error"]
        checks = ", ".join(f"{name} {c['max_abs_rel_error']:.1%}"
                           for name, c in entry["checks"].items()) or "no check"
        print(f"  {group:<7} fit residual {fit:.1%}; {checks}")
    if args.save:
        report_path = args.save.with_name(args.save.stem + "_report.json")
        with open(report_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        print(f"wrote {report_path}")
    if checked != gate:
        print(f"no check of {', '.join(sorted(gate - checked))}: nothing to judge "
              "(pass --check files with these code paths, at the fit's rate or with "
              "--scale-rate)")
        return 1
    verdict = "within" if worst <= args.target else "NOT within"
    print(f"checks of {', '.join(sorted(gate))}: largest |error| {worst:.1%}, {verdict} "
          f"the target of {args.target:.0%}")
    return 0 if worst <= args.target else 1


def _rows(points: Sequence[Point], results: Sequence[Validation]) -> list[dict[str, Any]]:
    return [{**r.measurement.to_dict(), "mode": p.mode, "source": p.source,
             "predicted": r.predicted, "rel_error": r.rel_error}
            for p, r in zip(points, results, strict=True)]


if __name__ == "__main__":
    sys.exit(main())
