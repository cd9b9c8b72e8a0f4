"""What ``skip_reduce``'s rank-deviation monitor costs: step time and memory.

Compiles one ``skip_reduce`` update (8 simulated CPU devices, skip ratio 0.5)
of a model of a few leaves, with ``monitor=True`` (the default) and
``monitor=False``, and prints, side by side in one run: the median time of
an update over repeats, the compiled program's temporary bytes, and the bytes
sent per device (identical: the monitor reads only the update and the
schedule).

    python benchmarks/monitor_cost.py [--elements 4000000] [--repeats 30]

``--platform gpu`` (8 H100s) or ``tpu`` (8 chips of a v5e:4x4) compiles the
same update for that hardware without it (the pods extra, ``make
check-pods``'s environment) and prints the memory and bytes only: compiled,
not run.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402


def devices(platform: str) -> list:
    """8 devices: simulated CPUs, or compile-only H100s / TPU v5e chips."""
    if platform == "cpu":
        return jax.devices()[:8]
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import pods

    found = pods.gpu_devices(1, 8) if platform == "gpu" else pods.tpu_devices(1)
    return list(found)[:8]


def leaf_shapes(elements: int) -> dict[str, tuple[int, ...]]:
    """The model: a few leaves of ``elements`` in all, in one bucket or several."""
    return {"embed": (elements // 2,), "dense": (elements // 4,),
            "out": (elements // 4 - 1000,), "bias": (1000,)}


def zeros(shape: tuple[int, ...]) -> jax.Array:
    return jnp.zeros(shape, jnp.float32)


def measure(elements: int, repeats: int, monitor: bool, platform: str
            ) -> dict[str, float]:
    """Time (CPU only, median of ``repeats``), temporaries and bytes sent."""
    mesh = jax.sharding.Mesh(np.array(devices(platform)), ("data",))
    shapes = leaf_shapes(elements)
    params = {k: zeros(s) for k, s in shapes.items()}
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, monitor=monitor,
                        balanced=False)  # the monitor watches the paper's schedule
    state = tx.init(params)

    def f(g, state):
        return tx.update(jax.tree_util.tree_map(lambda x: x[0], g), state)

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                 out_specs=(P(), P())))
    shards = NamedSharding(mesh, P("data"))
    specs = {k: jax.ShapeDtypeStruct((8,) + s, jnp.float32, sharding=shards)
             for k, s in shapes.items()}
    state_specs = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, P())), state)
    compiled = step.lower(specs, state_specs).compile()
    result = dict(temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
                  sent_mib=sr.collective_traffic(compiled.as_text()).bytes_per_device()
                  / 2**20)
    if platform != "cpu":
        return result
    rng = np.random.default_rng(0)
    grads = {k: jax.device_put(rng.normal(size=(8,) + s).astype(np.float32), shards)
             for k, s in shapes.items()}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, state = step(grads, state)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return dict(result, ms=1e3 * float(np.median(times[2:])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=4_000_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default="cpu")
    args = parser.parse_args()
    rows = {m: measure(args.elements, args.repeats, m, args.platform)
            for m in (False, True)}
    where = dict(cpu="8 simulated CPU devices", gpu="8 H100s, compiled, not run",
                 tpu="8 TPU v5e chips, compiled, not run")[args.platform]
    print(f"{args.elements} gradient elements ({4 * args.elements / 2**20:.1f} MiB), "
          f"{where}, skip ratio 0.5")
    timed = args.platform == "cpu"
    print("| monitor |" + (" update (ms, median) |" if timed else "")
          + " temporaries (MiB) | sent per device (MiB) |")
    print("|---|" + ("---:|" if timed else "") + "---:|---:|")
    for m, r in rows.items():
        print(f"| {m} |" + (f" {r['ms']:.1f} |" if timed else "")
              + f" {r['temp_mib']:.1f} | {r['sent_mib']:.2f} |")
    if timed:
        print(f"time ratio on/off: {rows[True]['ms'] / rows[False]['ms']:.2f}")


if __name__ == "__main__":
    main()
