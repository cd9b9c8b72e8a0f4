"""What ``error_feedback`` costs in compute: step and compile time, side by side.

Random (``error_feedback=False``), ``True`` and ``"auto"`` train the same
workload in the same process, in turns, so machine noise hits each alike.
The bytes on the wire are the same for all three; this measures the rest:
the residual pass, and for ``"auto"`` its rule (on a 256-element sample
per leaf), its branch and its ``pmin``; and the memory: each variant's
state per device and the compiled step's temporaries. On emulated CPU
devices the ring is cheap: the ratios are those of a step where these
passes weigh the most.

    .venv/bin/python benchmarks/gate_cost.py --workloads mlp-named,lm
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import skipreduce_jax as sr  # noqa: E402
from benchmarks import convergence as conv  # noqa: E402

VARIANTS = ("random", "random+ef", "random+efauto")


def measure(workload: str, optimizer: str, *, steps: int, repeats: int,
            ranks: int = 8, skip_ratio: float = 0.5) -> dict[str, Any]:
    """Median seconds per step (chunks of ``steps``) and compile seconds, per variant."""
    mesh = jax.make_mesh((ranks,), (conv.AXIS,), devices=jax.devices()[:ranks])
    work = conv.make_workload(workload, 0, steps, ranks)
    xs = jax.device_put(tuple(a[:steps] for a in work.train),
                        NamedSharding(mesh, P(None, conv.AXIS)))
    runs = {}
    for variant in VARIANTS:
        kwargs = conv.reduce_kwargs(variant, skip_ratio, 0)
        tx = conv.make_optimizer(optimizer, work.lr[optimizer], sr.skip_reduce(conv.AXIS, **kwargs))
        params = sr.replicate(work.params, mesh)
        opt_state = sr.init_opt_state(tx, params, mesh, conv.AXIS)
        carry = (params, opt_state, sr.replicate(work.model_state, mesh))
        chunk = conv.make_chunk_step(work.loss, tx, mesh, opt_state)
        start = time.perf_counter()
        compiled = chunk.lower(*carry, xs).compile()
        memory = compiled.memory_analysis()
        runs[variant] = dict(compiled=compiled, carry=carry, times=[],
                             compile_s=time.perf_counter() - start,
                             state_mb=_per_device_mb(opt_state),
                             temp_mb=memory.temp_size_in_bytes / 2**20)
    for _ in range(repeats + 1):  # the first round warms up
        for run in runs.values():
            start = time.perf_counter()
            *carry, losses = run["compiled"](*run["carry"], xs)
            jax.block_until_ready(losses)
            run["times"].append(time.perf_counter() - start)
            run["carry"] = tuple(carry)
    step = {v: statistics.median(r["times"][1:]) / steps for v, r in runs.items()}
    return dict(workload=workload, optimizer=optimizer, steps=steps, repeats=repeats,
                step_ms={v: 1e3 * s for v, s in step.items()},
                step_vs_random={v: s / step["random"] for v, s in step.items()},
                compile_s={v: r["compile_s"] for v, r in runs.items()},
                state_mb={v: r["state_mb"] for v, r in runs.items()},
                temp_mb={v: r["temp_mb"] for v, r in runs.items()},
                params_mb=_per_device_mb(work.params) * 1.0)


def _per_device_mb(tree: Any) -> float:
    """MiB of ``tree`` held on one device (its first device's shards)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shards = getattr(leaf, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total / 2**20


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp-named,lm")
    parser.add_argument("--optimizers", default="sgd")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed call")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/gate_cost.json")
    args = parser.parse_args(argv)
    conv.start_runtime(8)
    results = [measure(w, o, steps=args.steps, repeats=args.repeats)
               for w in args.workloads.split(",") for o in args.optimizers.split(",")]
    print("| workload | opt | variant | ms / step | vs Random | compile s "
          "| state MiB / device | temp MiB | params MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for v in VARIANTS:
            print(f"| {r['workload']} | {r['optimizer']} | {v} | {r['step_ms'][v]:.2f} "
                  f"| {r['step_vs_random'][v]:.2f} | {r['compile_s'][v]:.2f} "
                  f"| {r['state_mb'][v]:.2f} | {r['temp_mb'][v]:.2f} | {r['params_mb']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(devices=f"{jax.device_count()} x "
                                              f"{jax.devices()[0].platform}",
                                              results=results), indent=1))
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
