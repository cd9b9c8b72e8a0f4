"""``error_feedback="auto"`` step by step: what its gate reads around its opening.

One workload of ``convergence.py``, SGD, N = 8, k = 4, trained one step per
call. Per step: the training loss, whether the gate fed back, its overshoot
mean, the sampled step's norm and its ratio to the mean while shut, and
the residual's norm. Prints the steps around the first opening and writes
every step as JSON.

    .venv/bin/python benchmarks/gate_trace.py --workload lm-wide --seed 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import skipreduce_jax as sr  # noqa: E402
from benchmarks import convergence as conv  # noqa: E402
from skipreduce_jax._optax import gate as _gate  # noqa: E402


def trace(workload: str, seed: int, steps: int) -> list[dict[str, Any]]:
    """One row per step (see the module's docstring)."""
    mesh = jax.make_mesh((8,), (conv.AXIS,), devices=jax.devices()[:8])
    work = conv.make_workload(workload, seed, steps, 8)
    kwargs = conv.reduce_kwargs("random+efauto", 0.5, seed, work.selective)
    tx = conv.make_optimizer("sgd", work.lr["sgd"], sr.skip_reduce(conv.AXIS, **kwargs))
    params = sr.replicate(work.params, mesh)
    model_state = sr.replicate(work.model_state, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, conv.AXIS)
    chunk = conv.make_chunk_step(work.loss, tx, mesh, opt_state)
    rows = []
    for t in range(steps):
        fed = bool(_gate._rule(conv.feedback_gates(opt_state)[0]))  # before it is donated
        xs = jax.device_put(tuple(a[t:t + 1] for a in work.train),
                            NamedSharding(mesh, P(None, conv.AXIS)))
        params, opt_state, model_state, losses = chunk(params, opt_state, model_state, xs)
        gate = conv.feedback_gates(opt_state)[0]
        residual = sum(float(jnp.sum(jnp.asarray(r, jnp.float32) ** 2))
                       for r in jax.tree.leaves(gate.skip.residual)) ** 0.5
        norm = float(np.linalg.norm(np.asarray(gate.last_step)))
        rows.append(dict(step=t, loss=float(losses[0]), fed=fed,
                         overshooting=float(gate.overshooting),
            step_norm=norm, growth=norm / float(gate.calm) if float(gate.calm) else None,
            tripped=bool(gate.tripped), residual_norm=residual))
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="lm-wide", choices=conv.WORKLOADS)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--out", default="benchmarks/results/gate_trace.json")
    args = parser.parse_args(argv)
    conv.start_runtime(8)
    rows = trace(args.workload, args.seed, args.steps)
    first = next((r["step"] for r in rows if r["fed"]), None)
    print(f"first step fed back: {first}")
    print("| step | fed | loss | overshooting | step norm / shut mean | tripped | residual |")
    print("|---:|---|---:|---:|---:|---|---:|")
    for r in rows[max(0, (first or 0) - 3):(first or 0) + 25]:
        growth = "-" if r["growth"] is None else f"{r['growth']:.2f}"
        print(f"| {r['step']} | {r['fed']} | {r['loss']:.3f} | {r['overshooting']:.2f} "
              f"| {growth} | {r['tripped']} | {r['residual_norm']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
