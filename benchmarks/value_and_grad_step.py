"""The cost of ``sr.value_and_grad`` in a jit step, against ``jax.value_and_grad``.

One training step of an MLP (``--d-in``-``--hidden``-``--d-out``, GELU, SGD)
on 8 simulated CPU devices, jitted three ways with the same shardings:

* ``jax``: ``jax.value_and_grad`` on the global batch; XLA all-reduces.
* ``sr k=0``: ``skipreduce_jax.value_and_grad`` at ``num_skip=0`` (the ring,
  nothing skipped): what the entry point costs where it saves nothing.
* ``sr k=0 check``: the same with ``check=True`` (the step-0 check
  compiled in, a ``lax.cond`` that later steps do not take).
* ``sr random``: Random SkipReduce at ``skip_ratio=0.5``.

Each variant's compile time and its compiled temporary memory
(``memory_analysis()``) are recorded, and the time of its step 0, where the
first-step check runs. Then every variant is warmed up, and ``--rounds``
rounds of steps 1 and later are timed;
within a round each variant runs ``--calls`` steps back to back, in an order
that rotates from round to round, so that a slow spell of the machine falls
on all of them. Reported: the median step time of each and its ratio to
``jax``'s, the median of per-round ratios. Simulated devices share the
host's cores: this measures the local work around the collectives (the
per-rank ``shard_map``, masks, packing), not a network.

    python benchmarks/value_and_grad_step.py --out out/value_and_grad_step.json
    python benchmarks/value_and_grad_step.py --explicit --out out/value_and_grad_step_explicit.json
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


def _loss(params, batch):
    x, y = batch
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _explicit_loss(params, batch):
    """``_loss`` as code for Explicit axes spells it (``out_sharding=``)."""
    x, y = batch
    h = jax.nn.gelu(jnp.einsum("bi,ih->bh", x, params["w1"], out_sharding=P("data"))
                    + params["b1"])
    out = jnp.einsum("bh,ho->bo", h, params["w2"], out_sharding=P("data"))
    return jnp.mean((out + params["b2"] - y) ** 2)


def _steps(mesh, tx, loss):
    def make(grad_fn):
        def step(params, opt_state, batch, count):
            loss, grads = grad_fn(count)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss
        return jax.jit(step, donate_argnums=(0, 1))

    return {
        "jax": make(lambda count: jax.value_and_grad(loss)),
        "sr k=0": make(lambda count: sr.value_and_grad(
            loss, mesh, "data", step=count, num_skip=0, min_size=0)),
        "sr k=0 check": make(lambda count: sr.value_and_grad(
            loss, mesh, "data", step=count, num_skip=0, min_size=0, check=True)),
        "sr random": make(lambda count: sr.value_and_grad(
            loss, mesh, "data", step=count, skip_ratio=0.5, min_size=0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-in", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--d-out", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--explicit", action="store_true",
                        help="an Explicit data axis and a loss that sets layouts "
                             "(out_sharding=), which value_and_grad traces as one "
                             "rank's jit sees it")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    axis_type = AxisType.Explicit if args.explicit else AxisType.Auto
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(axis_type,))
    rng = np.random.default_rng(0)
    shapes = {"w1": (args.d_in, args.hidden), "b1": (args.hidden,),
              "w2": (args.hidden, args.d_out), "b2": (args.d_out,)}
    host_params = {k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32)
                   for k, s in shapes.items()}
    batch = jax.device_put(
        (rng.normal(size=(args.batch, args.d_in)).astype(np.float32),
         rng.normal(size=(args.batch, args.d_out)).astype(np.float32)),
        NamedSharding(mesh, P("data")))
    tx = optax.sgd(1e-3, momentum=0.9)
    steps = _steps(mesh, tx, _explicit_loss if args.explicit else _loss)
    state, compiled = {}, {}
    with jax.set_mesh(mesh):
        for name, step in steps.items():
            params = jax.device_put(host_params, NamedSharding(mesh, P()))
            opt_state = tx.init(params)
            start = time.perf_counter()
            executable = step.lower(params, opt_state, batch, jnp.int32(0)).compile()
            memory = executable.memory_analysis()
            compiled[name] = {"compile_s": time.perf_counter() - start,
                              "temp_bytes": int(getattr(memory, "temp_size_in_bytes", -1))}
            params, opt_state, loss = step(params, opt_state, batch, jnp.int32(0))
            jax.block_until_ready(loss)  # step 0, compiled by jit's own cache
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, batch, jnp.int32(0))
            jax.block_until_ready(loss)
            compiled[name]["step0_ms"] = (time.perf_counter() - start) * 1e3
            for i in range(3):
                params, opt_state, loss = step(params, opt_state, batch, jnp.int32(1 + i))
            jax.block_until_ready(loss)
            state[name] = (params, opt_state)
        times = {name: [] for name in steps}
        names = list(steps)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                params, opt_state = state[name]
                start = time.perf_counter()
                for c in range(args.calls):
                    params, opt_state, loss = steps[name](params, opt_state, batch,
                                                          jnp.int32(1 + c))
                jax.block_until_ready(loss)
                times[name].append((time.perf_counter() - start) / args.calls)
                state[name] = (params, opt_state)
    report = {"jax": jax.__version__, "devices": jax.device_count(),
              "explicit": args.explicit,
              "params": int(sum(np.prod(s) for s in shapes.values())),
              "rounds": args.rounds, "calls": args.calls, "variants": {}}
    base = np.asarray(times["jax"])
    for name, ts in times.items():
        ts = np.asarray(ts)
        report["variants"][name] = {
            "median_ms": float(np.median(ts) * 1e3),
            "ratio_to_jax": float(np.median(ts / base)),
            "ratio_spread": [float(np.min(ts / base)), float(np.max(ts / base))],
            **compiled[name]}
    print(f"{'variant':<16} {'median ms':>10} {'/ jax':>7} {'(min-max)':>13} "
          f"{'step 0 ms':>10} {'compile s':>10} {'temp MiB':>9}")
    for name, row in report["variants"].items():
        print(f"{name:<16} {row['median_ms']:10.2f} {row['ratio_to_jax']:7.3f} "
              f"({row['ratio_spread'][0]:.3f}-{row['ratio_spread'][1]:.3f}) "
              f"{row['step0_ms']:10.2f} {row['compile_s']:10.2f} "
              f"{row['temp_bytes'] / 2**20:9.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
