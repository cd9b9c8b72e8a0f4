"""FSDP under ``sr.value_and_grad``: bytes, peak memory and step time against XLA's FSDP step.

An MLP of ``--layers`` square ``--width`` layers (tanh), every weight split
by rows over ``data`` (8 simulated CPU devices, Auto axes), the batch split
over ``data``, AdamW; one jitted step three ways, the same shardings:

* ``xla``: ``jax.value_and_grad`` (GSPMD gathers the params and reduces
  the gradients itself);
* ``sr k=0``: ``skipreduce_jax.value_and_grad`` at ``num_skip=0``;
* ``sr r=0.5``: Random SkipReduce at ``skip_ratio=0.5``.

Recorded per variant: bytes each device sends per step by kind of
collective (from the compiled HLO), the compiled temporary memory
(``memory_analysis()``), and the median step time over ``--rounds`` rounds
that rotate the variants' order. The FSDP formula's bytes (the params'
all-gather plus the gradient's reduce-scatter) are the reference: XLA:CPU
reduces the gradients with an all-reduce, twice that.

    python benchmarks/fsdp_step.py --out benchmarks/results/fsdp_step/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from skipreduce_jax._ring import traffic as _traffic  # noqa: E402
from skipreduce_jax._runtime import hlo as _hlo


def loss_fn(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
    rng = np.random.default_rng(0)
    params = [(rng.normal(size=(args.width,) * 2) / args.width ** 0.5).astype(np.float32)
              for _ in range(args.layers)]
    specs = [P("data")] * args.layers
    tx = optax.adamw(1e-3)
    results = {}
    with jax.set_mesh(mesh):
        variants = {
            "xla": jax.value_and_grad(loss_fn),
            "sr k=0": sr.value_and_grad(loss_fn, step=jnp.int32(3), num_skip=0, min_size=0,
                                        param_specs=specs),
            "sr r=0.5": sr.value_and_grad(loss_fn, step=jnp.int32(3), skip_ratio=0.5,
                                          min_size=0, param_specs=specs),
        }
        p = [jax.device_put(w, NamedSharding(mesh, P("data"))) for w in params]
        x = jax.device_put(rng.normal(size=(args.batch, args.width)).astype(np.float32),
                           NamedSharding(mesh, P("data")))
        opt = tx.init(p)
        steps = {}
        for name, grad in variants.items():
            def step(p, o, x, grad=grad):
                v, g = grad(p, x)
                u, o = tx.update(g, o, p)
                return optax.apply_updates(p, u), o, v
            compiled = jax.jit(step).lower(p, opt, x).compile()
            steps[name] = compiled
            results[name] = dict(
                bytes=_hlo.collective_traffic(compiled.as_text()).by_kind(),
                temp_bytes=compiled.memory_analysis().temp_size_in_bytes)
            jax.block_until_ready(compiled(p, opt, x))
        times = {name: [] for name in steps}
        order = list(steps)
        for r in range(args.rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:
                start = time.perf_counter()
                for _ in range(args.calls):
                    out = steps[name](p, opt, x)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - start) / args.calls)
    nbytes = 4 * sum(w.size for w in params)
    formula = _traffic.all_gather_bytes(nbytes, n) + _traffic.reduce_scatter_bytes(nbytes, n, 0)
    for name, res in results.items():
        res["sent"] = sum(res["bytes"].values())
        res["sent / FSDP formula"] = res["sent"] / formula
        res["temp / xla"] = res["temp_bytes"] / results["xla"]["temp_bytes"]
        res["step_s"] = float(np.median(times[name]))
        res["step / xla"] = float(np.median(np.array(times[name]) / np.array(times["xla"])))
    print(f"{'variant':10} {'sent MB':>8} {'/formula':>8} {'temp MB':>8} {'/xla':>6} "
          f"{'step ms':>8} {'/xla':>6}")
    for name, res in results.items():
        print(f"{name:10} {res['sent'] / 1e6:8.2f} {res['sent / FSDP formula']:8.3f} "
              f"{res['temp_bytes'] / 1e6:8.2f} {res['temp / xla']:6.2f} "
              f"{res['step_s'] * 1e3:8.2f} {res['step / xla']:6.2f}")
    record = dict(config=vars(args), devices=n, jax=jax.__version__,
                  fsdp_formula_bytes=formula, results=results)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
