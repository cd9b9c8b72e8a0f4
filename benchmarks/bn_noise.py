r"""Where the skipped error of a BatchNorm CNN's convs lies.

``convergence.py``'s ``cnn-bn`` workload (N ranks, BatchNorm statistics over
the data axis) is trained with the all-reduce for ``--warmup`` steps; then,
at each of the next ``--steps`` batches, every rank's local gradient goes
through ``skip_reduce`` (Random, skip ratio 0.5) with ``exact_radial`` off
and on. Per conv kernel it prints how much of the update's error (against
the exact mean, each channel's part along its weights removed) lies along
the layer's mean input patch ``mu`` (measured from the batch), and the mean
``|mu . error|`` per channel: how far one step moves the batch mean of the
channel that BatchNorm then subtracts, which its running mean must follow.
For scale, the same for a random unit direction and for the exact mean
itself::

    python benchmarks/bn_noise.py --ranks 4 --seed 8
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import convergence as cv  # noqa: E402

import skipreduce_jax as sr  # noqa: E402


def mean_patch(x: np.ndarray) -> np.ndarray:
    """The batch's mean 3x3 'SAME' patch of ``x`` [B, H, W, C], flattened."""
    h, w = x.shape[1:3]
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    return np.stack([[padded[:, i:i + h, j:j + w].mean((0, 1, 2)) for j in range(3)]
                     for i in range(3)]).reshape(-1)


def along(error: np.ndarray, direction: np.ndarray, kernel: np.ndarray
          ) -> tuple[float, float]:
    """How much of ``error`` [F, C] lies along ``direction`` [F], per channel.

    Each channel's part along its own weights is removed from both first
    (``exact_radial`` makes it exact; plain Random leaves it). Returns the
    share of the error's energy along the direction and the mean absolute
    dot product of the unit direction and each channel's error.
    """
    unit_w = kernel / np.linalg.norm(kernel, axis=0)
    error = error - unit_w * (unit_w * error).sum(0)
    d = direction[:, None] - unit_w * (unit_w * direction[:, None]).sum(0)
    d /= np.linalg.norm(d, axis=0)
    share = ((d * error).sum(0) ** 2).sum() / (error ** 2).sum()
    return share, np.abs(direction / np.linalg.norm(direction) @ error).mean()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    cv.start_runtime(max(8, args.ranks))
    n = args.ranks
    mesh = jax.make_mesh((n,), (cv.AXIS,), devices=jax.devices()[:n])
    work = cv.make_workload("cnn-bn", args.seed, args.warmup + args.steps, n)
    tx = cv.make_optimizer("sgd", work.lr["sgd"], sr.skip_reduce(cv.AXIS, num_skip=0))
    params, state = sr.replicate(work.params, mesh), sr.replicate(work.model_state, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, cv.AXIS)
    steps = jax.device_put(tuple(a[:args.warmup] for a in work.train),
                           NamedSharding(mesh, P(None, cv.AXIS)))
    params, _, state, _ = cv.make_chunk_step(work.loss, tx, mesh, opt_state)(
        params, opt_state, state, steps)
    grad_fn = sr.local_value_and_grad(work.loss, cv.AXIS, has_aux=True)
    reducers = {radial: sr.skip_reduce(cv.AXIS, skip_ratio=0.5, min_size=0,
                                       exact_radial=radial, seed=args.seed)
                for radial in (False, True)}

    def step(p, s, batch, count):
        _, g = grad_fn(p, s, batch)
        out = {"exact": jax.lax.pmean(g, cv.AXIS)}
        for radial, r in reducers.items():
            st = r.init(p)._replace(count=count)
            out[f"radial={radial}"] = r.update(g, st, p)[0]
        return out

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(cv.AXIS), P()),
                                out_specs=P()))
    model = cv.BNCNN(axis_name=None)
    host_p, host_s = jax.device_get(params), jax.device_get(state)
    inputs = jax.jit(lambda p, s, x: model.apply(
        {**p, **s}, x, train=True, mutable=["batch_stats", "intermediates"],
        capture_intermediates=True)[1]["intermediates"])
    rng = np.random.default_rng(0)
    rows: dict[tuple[str, str], list[float]] = {}
    for t in range(args.warmup, args.warmup + args.steps):
        batch = tuple(a[t] for a in work.train)
        out = jax.device_get(run(params, state, jax.device_put(
            batch, NamedSharding(mesh, P(cv.AXIS))), np.int32(t)))
        seen = jax.device_get(inputs(host_p, host_s, batch[0]))
        layer_in = {"Conv_0": np.asarray(batch[0]).reshape(-1, 8, 8, 1),
                    "Conv_1": np.maximum(seen["BatchNorm_0"]["__call__"][0], 0)}
        for name, x in layer_in.items():
            mu = mean_patch(np.asarray(x))
            rand = rng.normal(size=mu.shape)
            kernel = np.asarray(host_p["params"][name]["kernel"])
            kernel = kernel.reshape(-1, kernel.shape[-1])
            exact = np.asarray(out["exact"]["params"][name]["kernel"]).reshape(kernel.shape)
            for radial in (False, True):
                got = np.asarray(out[f"radial={radial}"]["params"][name]["kernel"])
                for label, direction in (("mean input", mu), ("random", rand)):
                    share, moved = along(got.reshape(kernel.shape) - exact, direction, kernel)
                    what = f"{label}, exact_radial={radial}"
                    rows.setdefault((name, f"share of the error's energy along {what}"),
                                    []).append(share)
                    rows.setdefault((name, f"mean abs dot product with the error, {what}"),
                                    []).append(moved)
            rows.setdefault((name, "cosine of the uniform direction and the mean input"),
                            []).append(mu.sum() / np.sqrt(mu.size) / np.linalg.norm(mu))
            rows.setdefault((name, "mean abs dot product of the mean input and the exact mean"),
                            []).append(np.abs(mu / np.linalg.norm(mu) @ exact).mean())
    print(f"cnn-bn, N = {n}, seed {args.seed}, steps {args.warmup}-"
          f"{args.warmup + args.steps - 1} (after {args.warmup} all-reduce steps)\n")
    print("| kernel | quantity | mean over steps |\n|---|---|---:|")
    for (name, what), values in rows.items():
        print(f"| {name} | {what} | {np.mean(values):.3f} |")


if __name__ == "__main__":
    main()
