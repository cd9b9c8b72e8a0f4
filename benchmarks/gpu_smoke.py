"""One-GPU check: skip_reduce and the collectives on one device, and their local costs.

With one GPU there is no ring (N = 1): nothing is sent, so this measures only
what runs on the device itself. Every time is the median of ``--repeats``
timed calls after one untimed call, each ended by ``jax.block_until_ready``
(wall clock, ``time.perf_counter``); passes of a few microseconds are timed
``--loop`` times inside one program (a ``lax.fori_loop``) and divided, so
that the launch of the program is spread over them.

- ``collectives``: ``psum``, ``ring_psum`` and ``skip_psum`` (float32 and
  ``comm_dtype=bfloat16``) on a 1-device axis: no hop, only packing,
  unpacking and the casts.
- ``train``: a training step of two MLPs with ``skip_reduce`` (Random,
  error feedback; k = 0 on one device) against the same step whose
  gradients go through ``lax.pmean`` (XLA's all-reduce, a no-op on one
  device): the local overhead of masks, packing and unpacking.
- ``hops``: the local arithmetic of a ring of 8 ranks' reduce-scatter,
  emulated on one device with the send left out: per hop, float32
  ``received + own`` against ``comm_dtype=bfloat16``'s round to bfloat16
  before the send and add in float32 after it (an optimization barrier
  stands where the send would be).
- ``reorder``: Random SkipReduce's reorder pass (``put_in_slot_order``,
  the schedule of a ring of 8, drawn at run time) over whole buffers,
  against an element-wise pass (``x + 1``) over the same buffer; both read
  and write the buffer once, so bandwidth = 2 x bytes / time.

Prints JSON and writes it to ``--out``. On a CPU it runs as well (smaller
``--sizes-mb`` for a rehearsal).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._ring import ring as _ring
from skipreduce_jax._ring.buckets import plan_buckets

RING = 8  # ranks of the emulated ring (hops, reorder)


def _time(fn: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
    """Median seconds of ``fn(*args)`` (one untimed call first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def collectives(mesh: jax.sharding.Mesh, sizes: Sequence[int], repeats: int) -> dict:
    report = {}
    for size in sizes:
        x = jax.device_put(jnp.ones((1, size), jnp.float32), NamedSharding(mesh, P("data")))
        fns = {
            "psum": lambda v: lax.psum(v, "data"),
            "ring_psum": lambda v: sr.ring_psum(v, "data"),
            "skip_psum": lambda v: sr.skip_psum(v, "data", key=jax.random.key(0),
                                                num_skip=0),
            "skip_psum_bf16": lambda v: sr.skip_psum(v, "data", key=jax.random.key(0),
                                                     num_skip=0, comm_dtype=jnp.bfloat16),
        }
        for name, fn in fns.items():
            f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"),
                                      out_specs=P("data")))
            assert float(f(x)[0, 0]) == 1.0, name
            report[f"{name}_{size}_ms"] = 1e3 * _time(f, (x,), repeats)
    return report


def _mlp(rng: np.random.Generator, sizes: Sequence[int]) -> dict:
    return {f"w{i}": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}


def _loss(params: dict, batch: tuple) -> jax.Array:
    h = batch[0]
    names = sorted(params, key=lambda k: int(k[1:]))
    for name in names[:-1]:
        h = jax.nn.relu(h @ params[name])
    return optax.softmax_cross_entropy_with_integer_labels(
        h @ params[names[-1]], batch[1]).mean()


def train(mesh: jax.sharding.Mesh, models: dict, steps: int, repeats: int) -> dict:
    pmean = optax.stateless(lambda g, params=None: jax.tree_util.tree_map(
        lambda x: lax.pmean(x, "data"), g))
    reductions = {
        "allreduce": pmean,
        "skip_reduce": sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                      error_feedback=True),
    }
    report = {}
    for model, (sizes, rows) in models.items():
        rng = np.random.default_rng(0)
        init = _mlp(rng, sizes)
        batch = sr.shard_batch((rng.normal(size=(rows, sizes[0])).astype(np.float32),
                                rng.integers(0, sizes[-1], rows)), mesh)
        report[f"{model}_params"] = int(sum(p.size for p in init.values()))
        for name, reduction in reductions.items():
            tx = optax.chain(reduction, optax.adam(1e-3))
            params = sr.replicate(init, mesh)
            opt_state = sr.init_opt_state(tx, params, mesh)
            step = sr.make_train_step(_loss, tx, mesh, donate=False)
            losses = []
            for _ in range(steps):
                params, opt_state, loss = step(params, opt_state, batch)
                losses.append(float(loss))
            assert losses[-1] < losses[0], (model, name, losses)
            report[f"{model}_{name}_first_loss"] = losses[0]
            report[f"{model}_{name}_last_loss"] = losses[-1]
            report[f"{model}_{name}_step_ms"] = 1e3 * _time(
                lambda *a, step=step: step(*a)[2], (params, opt_state, batch), repeats)
        report[f"{model}_skip_over_allreduce"] = (report[f"{model}_skip_reduce_step_ms"]
                                                  / report[f"{model}_allreduce_step_ms"])
    return report


def hops(sizes: Sequence[int], repeats: int, loop: int) -> dict:
    """Per hop of an emulated 8-rank reduce-scatter (no send), float32 vs bfloat16."""
    def body(comm):
        def hop(i, carry):
            acc, pieces = carry
            own = lax.dynamic_index_in_dim(pieces, i % RING, 0, keepdims=False)
            if comm is None:
                received = lax.optimization_barrier(acc)
            else:
                received = lax.optimization_barrier(acc.astype(comm)).astype(jnp.float32)
            return received + own, pieces
        return jax.jit(lambda pieces: lax.fori_loop(
            0, loop, hop, (pieces[0], pieces))[0])

    report = {}
    for size in sizes:  # the bucket, float32 elements; a piece is 1/8 of it
        pieces = jnp.asarray(np.random.default_rng(0).normal(size=(RING, size // RING)),
                             jnp.float32)
        for name, comm in (("float32", None), ("bfloat16", jnp.bfloat16)):
            f = body(comm)
            report[f"hop_{name}_{4 * size >> 20}MiB_bucket_us"] = (
                1e6 * _time(f, (pieces,), repeats) / loop)
        mib = 4 * size >> 20
        report[f"hop_bf16_over_f32_{mib}MiB_bucket"] = (
            report[f"hop_bfloat16_{mib}MiB_bucket_us"]
            / report[f"hop_float32_{mib}MiB_bucket_us"])
    return report


def reorder(sizes: Sequence[int], repeats: int, loop: int) -> dict:
    """Random's reorder pass (8-rank schedule) against ``x + 1``, per pass."""
    report = {}
    for size in sizes:
        bucket = plan_buckets(jax.ShapeDtypeStruct((size,), jnp.float32),
                              group_size=RING).buckets[0]
        x = jnp.zeros((bucket.padded_size,), jnp.float32)
        key = jax.random.key_data(jax.random.key(1))

        def one(x, i, key, chunks=bucket.chunks_per_rank):
            schedule = sr.make_schedule(
                RING, num_skip=1, chunks_per_rank=chunks,
                key=jax.random.fold_in(jax.random.wrap_key_data(key), i))
            by_chunk = x.reshape(RING, chunks, -1)
            return _ring.put_in_slot_order(by_chunk, schedule).reshape(-1)

        passes = {
            "reorder": jax.jit(lambda x, key: lax.fori_loop(
                0, loop, lambda i, y: one(y, i, key), x)),
            "add_one": jax.jit(lambda x, key: lax.fori_loop(
                0, loop, lambda i, y: y + 1.0, x)),
            "reorder_single_call": jax.jit(lambda x, key: one(x, 0, key)),
        }
        mib = 4 * bucket.padded_size >> 20
        for name, f in passes.items():
            per = 1 if name.endswith("single_call") else loop
            seconds = _time(f, (x, key), repeats) / per
            report[f"{name}_{mib}MiB_us"] = 1e6 * seconds
            report[f"{name}_{mib}MiB_GBps"] = 2 * 4 * bucket.padded_size / seconds / 1e9
        report[f"reorder_over_add_one_{mib}MiB"] = (report[f"reorder_{mib}MiB_us"]
                                                    / report[f"add_one_{mib}MiB_us"])
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="64,1024",
                        help="reorder and hop buffers, MiB of float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--loop", type=int, default=50,
                        help="passes per program for the reorder and hop timings")
    parser.add_argument("--steps", type=int, default=100, help="training steps first")
    parser.add_argument("--small", action="store_true",
                        help="small models and buffers (a CPU rehearsal)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("data",), devices=[device])
    buffers = [int(mb) << 18 for mb in args.sizes_mb.split(",")]  # float32 elements
    if args.small:
        models = {"mlp_64x512x10": ((64, 512, 10), 256)}
    else:
        models = {"mlp_64x4096x10": ((64, 4096, 10), 256),
                  "mlp_8x2048": ((2048,) * 9, 512)}
    report = {"device": str(device), "device_kind": device.device_kind,
              "jax": jax.__version__, "repeats": args.repeats, "loop": args.loop}
    for name, part in (
            ("collectives", lambda: collectives(mesh, (1 << 20, 1 << 24), args.repeats)),
            ("train", lambda: train(mesh, models, args.steps, args.repeats)),
            ("hops", lambda: hops(buffers, args.repeats, args.loop)),
            ("reorder", lambda: reorder(buffers, args.repeats, args.loop))):
        start = time.perf_counter()
        report[name] = part()
        report[name]["wall_s"] = time.perf_counter() - start
        print(json.dumps({name: report[name]}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
