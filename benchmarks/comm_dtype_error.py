"""Rounding error of ``comm_dtype=bfloat16`` on the convergence study's gradients.

Each rank's gradient comes from the study's workloads (``convergence.py``:
the MLP and the byte-level LM), at the initial parameters and after
``--train`` steps of SGD with the all-reduce. Every reduction is compared
with the float64 mean of the same values (for SkipReduce, of the values its
schedule keeps):

* ``float32``: the ring on a float32 wire (``skip_pmean`` as is);
* ``bf16 ring``: ``comm_dtype=jnp.bfloat16``: 16-bit on the wire, float32
  in each hop, one rounding per hop and one of the result;
* ``cast-then-reduce``: ``lax.pmean(g.astype(jnp.bfloat16))``, cast back
  (for SkipReduce: the kept values cast to bfloat16, then summed);
* ``bf16 grads ring``: the ring on bfloat16 gradients (cast first), each
  hop rounding to bfloat16: what a native 16-bit ring all-reduce (NCCL's)
  does, where XLA:CPU's ``cast-then-reduce`` adds in float32;
* ``skip vs all``: how far SkipReduce's own mean (float32) is from the full
  mean: the error the method already accepts, for scale.

Errors are relative L2 norms ``|got - exact| / |exact|`` over all leaves.
Prints a markdown table and writes JSON::

    python benchmarks/comm_dtype_error.py --ranks 8 --skip-ratio 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup(ranks: int) -> None:
    flag = f"--xla_force_host_platform_device_count={ranks}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))


def per_rank_grads(work, params, step: int, ranks: int):
    """``[N, ...]`` gradients: rank r's loss on its batch of ``step``."""
    import jax
    import numpy as np

    batch = tuple(np.asarray(a[step]) for a in work.train)
    size = work.batch_per_rank

    grad = _grad_fn(work)
    grads = [grad(params, tuple(a[r * size:(r + 1) * size] for a in batch))
             for r in range(ranks)]
    return jax.tree_util.tree_map(lambda *g: np.stack(g), *grads)


_GRADS: dict[int, object] = {}


def _grad_fn(work):
    """The jitted gradient of one rank's loss, one per workload."""
    import jax

    if id(work) not in _GRADS:
        _GRADS[id(work)] = jax.jit(jax.grad(
            lambda p, b: work.loss(p, work.model_state, b)[0]))
    return _GRADS[id(work)]


def train_params(work, steps: int, lr: float, ranks: int):
    """The params after ``steps`` of plain SGD on the all-reduced gradient."""
    import jax

    params = work.params
    for step in range(steps):
        g = per_rank_grads(work, params, step, ranks)
        params = jax.tree_util.tree_map(lambda p, x: p - lr * x.mean(0), params, g)
    return params


def measure(grads, ranks: int, num_skip: int, seed: int) -> dict[str, float]:
    """Relative errors of each reduction of ``grads`` (leaves ``[N, ...]``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import skipreduce_jax as sr
    from skipreduce_jax._ring.buckets import DEFAULT_BUCKET_BYTES

    mesh = jax.make_mesh((ranks,), ("data",), devices=jax.devices()[:ranks])
    kw = dict(key=jax.random.key(seed), num_skip=num_skip)

    def local(g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        mask = sr.contribution_mask(g, "data", **kw)
        # Half the byte cap: the same buckets, so the same schedules.
        g16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), g)
        half = DEFAULT_BUCKET_BYTES // 2
        kept16 = jax.tree_util.tree_map(
            lambda a, m: jnp.where(m, a, 0).astype(jnp.bfloat16), g, mask)
        count = ranks - num_skip
        outs = dict(
            float32=sr.skip_pmean(g, "data", **kw),
            bf16_ring=sr.skip_pmean(g, "data", comm_dtype=jnp.bfloat16, **kw),
            cast_then_reduce=jax.tree_util.tree_map(
                lambda a: (lax.psum(a, "data") / count).astype(jnp.float32), kept16),
            bf16_grads_ring=jax.tree_util.tree_map(
                lambda a: a.astype(jnp.float32),
                sr.skip_pmean(g16, "data", bucket_bytes=half, **kw)),
            same_mask=jax.tree_util.tree_map(
                jnp.array_equal, mask,
                sr.contribution_mask(g16, "data", bucket_bytes=half, **kw)),
            mask=mask)
        return jax.tree_util.tree_map(lambda a: a[None], outs)

    placed = jax.device_put(grads, NamedSharding(mesh, P("data")))
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"),
                                out_specs=P("data")))(placed)
    out = jax.tree_util.tree_map(np.asarray, out)
    masks = out.pop("mask")  # [N, ...]: every rank's
    if not all(np.all(m) for m in jax.tree_util.tree_leaves(out.pop("same_mask"))):
        raise AssertionError("the bfloat16 gradients were bucketed differently")
    out = jax.tree_util.tree_map(lambda a: a[0], out)  # the same on every rank

    def flat(tree):
        return np.concatenate([np.ravel(x).astype(np.float64)
                               for x in jax.tree_util.tree_leaves(tree)])

    exact = flat(jax.tree_util.tree_map(
        lambda a, m: np.where(m, np.asarray(a, np.float64), 0).sum(0)
        / (ranks - num_skip), grads, masks))
    norm = np.linalg.norm(exact)
    errors = {name: float(np.linalg.norm(flat(out[name]) - exact) / norm)
              for name in ("float32", "bf16_ring", "cast_then_reduce",
                           "bf16_grads_ring")}
    full = flat(jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64).mean(0),
                                       grads))
    errors["skip_vs_all"] = float(np.linalg.norm(flat(out["float32"]) - full)
                                  / np.linalg.norm(full))
    return errors


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--skip-ratio", type=float, default=0.5)
    p.add_argument("--workloads", default="mlp,lm")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--train", type=int, default=50,
                   help="SGD steps before the second measurement")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    _setup(args.ranks)
    import convergence

    from skipreduce_jax._ring.traffic import skip_ratio_to_num_skip

    k = skip_ratio_to_num_skip(args.skip_ratio, args.ranks)
    rows = []
    for name in args.workloads.split(","):
        for seed in range(args.seeds):
            work = convergence.make_workload(name, seed, args.train + 1, args.ranks)
            trained = train_params(work, args.train, work.lr["sgd"], args.ranks)
            for when, params in (("init", work.params), (f"step {args.train}", trained)):
                grads = per_rank_grads(work, params, args.train, args.ranks)
                for num_skip in (0, k):
                    rows.append(dict(workload=name, seed=seed, at=when, num_skip=num_skip,
                                     **measure(grads, args.ranks, num_skip, seed)))
    cols = ("float32", "bf16_ring", "cast_then_reduce", "bf16_grads_ring",
            "skip_vs_all")
    print(f"relative L2 error vs the float64 mean of the kept values; N={args.ranks}\n")
    print("| workload | seed | at | k | " + " | ".join(cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['workload']} | {r['seed']} | {r['at']} | {r['num_skip']} | "
              + " | ".join(f"{r[c]:.2e}" for c in cols) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "comm_dtype_error.json"
    report = dict(ranks=args.ranks, skip_ratio=args.skip_ratio, rows=rows)
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")
    return report


if __name__ == "__main__":
    main()
