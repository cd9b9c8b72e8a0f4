"""Runs examples/pjit_lm.py and writes its losses as JSON; compares them with another run's.

    python benchmarks/gpu_pjit.py --out cpu.json -- --mesh one --skip-ratio 0 --steps 20
    python benchmarks/gpu_pjit.py --out gpu.json --compare cpu.json -- (the same)

Everything after ``--`` goes to the example. ``--compare`` reads a file this
script wrote and reports the largest relative difference of every train and
validation loss of each variant (``max_rel_diff``) and whether it is within
``--rtol``; the exit status is 1 if not. ``--precision`` sets
``jax_default_matmul_precision`` (on GPUs float32 matmuls may otherwise use
TF32).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--compare", type=pathlib.Path, default=None)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--precision", default=None, help="e.g. highest")
    args = parser.parse_args(ours)

    import jax
    import pjit_lm  # sets up simulated CPU devices before jax starts

    if args.precision:
        jax.config.update("jax_default_matmul_precision", args.precision)
    results = pjit_lm.main(theirs)
    mesh = pjit_lm.make_mesh(pjit_lm.parse_args(theirs))
    report = {"args": theirs, "precision": args.precision, "jax": jax.__version__,
              "devices": [str(d) for d in mesh.devices.flat],
              "variants": {v: {"history": r["history"], "val_loss": r["val_loss"],
                               "gradient_steps": r["gradient_steps"],
                               "seconds": r["seconds"]} for v, r in results.items()}}
    history = {v: r["history"] for v, r in report["variants"].items()}
    plain, skip = history.get("plain"), history.get("skipreduce")
    if plain and skip:  # [step, train loss, accuracy, val loss]
        report["skipreduce_vs_plain_max_rel_diff"] = _max_rel(plain, skip)
    status = 0
    if args.compare:
        other = json.loads(args.compare.read_text())
        diffs = {v: _max_rel(other["variants"][v]["history"], h)
                 for v, h in history.items()}
        report["compared_with"] = {"file": args.compare.name, "devices": other["devices"],
                                   "jax": other["jax"], "max_rel_diff": diffs,
                                   "rtol": args.rtol,
                                   "within": all(d <= args.rtol for d in diffs.values())}
        status = 0 if report["compared_with"]["within"] else 1
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}, indent=1))
    return status


def _max_rel(a: list, b: list) -> float:
    """The largest relative difference of the losses (columns 1 and 3) of two histories."""
    assert [row[0] for row in a] == [row[0] for row in b], "different evaluation steps"
    return max(abs(x[i] - y[i]) / abs(x[i]) for x, y in zip(a, b) for i in (1, 3))


if __name__ == "__main__":
    sys.exit(main())
