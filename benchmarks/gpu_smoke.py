"""One-GPU smoke check: skip_reduce and the collectives on a CUDA device.

With one GPU there is no ring (N = 1), so this checks that the package
compiles and runs on the GPU backend and reports the step time of the
digits MLP with ``skip_reduce``, and the local (non-communication) cost of
``skip_psum``'s packing and unpacking on the device. Prints JSON.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr


def _time(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    gpu = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("data",), devices=[gpu])
    report = {"device": str(gpu), "jax": jax.__version__}

    # The collectives on a 1-device axis: psum vs ring_psum vs skip_psum.
    for size in (1 << 20, 1 << 24):
        x = jax.device_put(jnp.ones((1, size), jnp.float32),
                           NamedSharding(mesh, P("data")))
        fns = {
            "psum": lambda v: jax.lax.psum(v, "data"),
            "ring_psum": lambda v: sr.ring_psum(v, "data"),
            "skip_psum": lambda v: sr.skip_psum(v, "data", key=jax.random.key(0),
                                                num_skip=0),
        }
        for name, fn in fns.items():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"),
                                      out_specs=P("data")))
            out = f(x)
            assert float(out[0, 0]) == 1.0, name
            report[f"{name}_{size}_ms"] = 1e3 * _time(f, x)

    # A training step of a wide MLP with skip_reduce (k = 0 on one device).
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.normal(size=(64, 4096)) * 0.05, jnp.float32),
              "w2": jnp.asarray(rng.normal(size=(4096, 10)) * 0.05, jnp.float32)}
    x = rng.normal(size=(256, 64)).astype(np.float32)
    y = rng.integers(0, 10, 256)

    def loss_fn(p, batch):
        h = jax.nn.relu(batch[0] @ p["w1"])
        return optax.softmax_cross_entropy_with_integer_labels(
            h @ p["w2"], batch[1]).mean()

    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                    error_feedback=True), optax.adam(1e-3))
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh)
    step = sr.make_train_step(loss_fn, tx, mesh, donate=False)
    batch = sr.shard_batch((x, y), mesh)
    losses = []
    for _ in range(100):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    report["train_first_loss"] = losses[0]
    report["train_last_loss"] = losses[-1]
    report["train_step_ms"] = 1e3 * _time(
        lambda: step(params, opt_state, batch)[2])
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
