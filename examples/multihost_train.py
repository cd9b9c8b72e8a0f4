"""Random SkipReduce on scikit-learn's digits, across several processes.

Every process runs this same script. It joins the job first
(``skipreduce_jax.initialize()``), then builds one data-parallel mesh over
the devices of all processes, with each process's devices side by side. Each
process loads the data itself and draws the same global batches (the same
seed everywhere), but hands ``shard_batch`` only its own rows: those of its
devices. ``skip_reduce`` derives each step's key from its seed and the step
count, so every process drops the same contributions without talking about
it, and the parameters stay bit-identical everywhere (checked at the end with
``assert_replicated``).

On one machine, with the local launcher (2 processes x 2 CPU devices)::

    python -m skipreduce_jax.launch -n 2 -d 2 examples/multihost_train.py
    python -m skipreduce_jax.launch -n 4 examples/multihost_train.py --baseline

As a single plain process it uses 8 simulated CPU devices (or the local
accelerators, if there are several)::

    python examples/multihost_train.py --steps 300

The loss is printed by process 0 only; every process prints a digest of its
final parameters, which must be the same everywhere. ``--baseline`` also
trains with a full all-reduce (``num_skip=0``, exactly ``lax.pmean``) from
the same start on the same batches, for comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Sequence
from typing import Any

from skipreduce_jax.distributed import cluster_detected, initialize, launcher_env_present

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
SIMULATED_DEVICES = 8
AXIS = "data"

if not (launcher_env_present() or cluster_detected()) and _DEVICE_FLAG not in \
        os.environ.get("XLA_FLAGS", ""):
    # A plain single process: simulate several CPU devices. Under the
    # launcher, initialize() sets each process's device count instead; on a
    # cluster (SLURM, Open MPI, ...) each process uses its own devices. JAX
    # reads XLA_FLAGS when its backend starts, which initialize() precedes.
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} "
        f"{_DEVICE_FLAG}={SIMULATED_DEVICES}").strip()
initialize()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import skipreduce_jax as sr  # noqa: E402


class MLP(nn.Module):
    """A multilayer perceptron: ReLU hidden layers, then 10 class logits.

    Attributes:
      hidden: the width of each hidden layer.
    """

    hidden: Sequence[int] = (256, 256)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


MODEL = MLP()


def log(*args: Any) -> None:
    """Prints from process 0 only (every process runs the same script)."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def load_data(seed: int) -> tuple[np.ndarray, ...]:
    """The digits (bundled with scikit-learn), scaled to [0, 1] and split.

    Every process calls this and gets the same arrays.

    Returns:
      ``(x_train, y_train, x_test, y_test)``.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


def make_mesh() -> Mesh:
    """A 1-D ``data`` mesh over all devices, each process's side by side.

    With one process and a single accelerator, the (simulated) CPU devices
    are used instead, so that there is something to reduce over.
    """
    devices = jax.devices()
    if jax.process_count() == 1 and len(devices) == 1:
        devices = jax.devices("cpu")
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (AXIS,))


def own_columns(mesh: Mesh, batch_per_device: int) -> slice:
    """The columns of a global batch that belong to this process's devices.

    ``shard_batch`` gives device d (in mesh order) the columns
    ``[d * B:(d + 1) * B]``; this process holds one contiguous run of devices.
    """
    mine = [i for i, d in enumerate(mesh.devices.flat)
            if d.process_index == jax.process_index()]
    return slice(mine[0] * batch_per_device,
                 (mine[-1] + 1) * batch_per_device)


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Softmax cross-entropy on one device's part of the batch."""
    logits = MODEL.apply(params, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]).mean()


@jax.jit
def _correct(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum(jnp.argmax(MODEL.apply(params, x), -1) == y)


def local_params(params: Any) -> Any:
    """This process's copy of the replicated params, as numpy arrays."""
    return jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)),
                                  params)


def accuracy(params: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Test accuracy, computed by each process on its own copy of the params."""
    return int(_correct(local_params(params), x, y)) / len(y)


def digest(params: Any) -> str:
    """A short sha256 of this process's copy of the params."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(local_params(params)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def train(name: str, reduce_kwargs: dict[str, Any], args: argparse.Namespace,
          mesh: Mesh, data: tuple[np.ndarray, ...],
          batches: np.ndarray) -> tuple[Any, list[float], float]:
    """Trains from the same start on the same batches; returns the result.

    Args:
      name: the variant's name, for the log.
      reduce_kwargs: ``skip_reduce`` arguments besides the axis and seed.
      args: the command line.
      mesh: the data-parallel mesh.
      data: ``(x_train, y_train, x_test, y_test)``.
      batches: int [steps, global batch] training indices.

    Returns:
      ``(params, losses, seconds per step after the first)``.
    """
    x_train, y_train, x_test, y_test = data
    tx = optax.chain(
        sr.skip_reduce(AXIS, seed=args.seed, **reduce_kwargs),
        optax.adam(args.lr))
    init = jax.jit(MODEL.init)(jax.random.key(args.seed), x_train[:1])
    params = sr.replicate(init, mesh)
    # Also checks that every process built skip_reduce with the same seed and
    # settings: a mismatch is refused here, before any step.
    opt_state = sr.init_opt_state(tx, params, mesh, AXIS)
    step = sr.make_train_step(loss_fn, tx, mesh, AXIS)
    columns = own_columns(mesh, args.batch_per_device)
    losses = []
    start, evaluating = None, 0.0
    for t, indices in enumerate(batches, 1):
        mine = indices[columns]          # only this process's rows
        batch = sr.shard_batch((x_train[mine], y_train[mine]), mesh, AXIS)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))       # the mean over all devices
        if start is None:
            start = time.perf_counter()  # after the first (compiling) step
        if t % args.log_every == 0 or t == len(batches):
            log(f"[{name}] step {t:4d}  loss {losses[-1]:.4f}")
        if args.eval_every and t % args.eval_every == 0 and t < len(batches):
            began = time.perf_counter()  # not part of the step's time
            log(f"[{name}] step {t:4d}  test accuracy "
                f"{accuracy(params, x_test, y_test):.4f}")
            evaluating += time.perf_counter() - began
    per_step = ((time.perf_counter() - start - evaluating)
                / (len(batches) - 1))
    sr.assert_replicated((params, opt_state), mesh)
    return params, losses, per_step


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n", 1)[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=200,
                        help="training steps per variant (>= 2: the first "
                        "compiles and is not timed)")
    parser.add_argument("--batch-per-device", type=int, default=16,
                        help="training examples per device per step")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="Adam learning rate")
    parser.add_argument("--skip-ratio", type=float, default=0.5,
                        help="fraction of the N-1 reduce-scatter steps skipped")
    parser.add_argument("--static", action="store_true",
                        help="static SkipReduce (randomize=False) instead of "
                        "Random SkipReduce")
    parser.add_argument("--seed", type=int, default=0,
                        help="init, batch order and SkipReduce seed")
    parser.add_argument("--baseline", action="store_true",
                        help="also train with a full all-reduce to compare")
    parser.add_argument("--log-every", type=int, default=20,
                        help="print the loss every K steps")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="also print the test accuracy every K steps")
    args = parser.parse_args(argv)
    for name in ("batch_per_device", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is "
                     "not timed)")
    if args.eval_every < 0:
        parser.error("--eval-every must be >= 0 (0: off)")
    if not args.lr > 0:
        parser.error("--lr must be > 0")
    if not 0.0 <= args.skip_ratio <= 1.0:
        parser.error("--skip-ratio must be in [0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Trains Random SkipReduce (and optionally the baseline) and reports."""
    args = parse_args(argv)
    mesh = make_mesh()
    n = mesh.size
    data = load_data(args.seed)
    x_test, y_test = data[2], data[3]
    global_batch = n * args.batch_per_device
    # The same batches in every process: the same seed.
    batches = np.random.default_rng(args.seed).integers(
        0, len(data[1]), size=(args.steps, global_batch))
    skip = dict(skip_ratio=args.skip_ratio, randomize=not args.static,
                min_size=0)  # the default 100k would exclude every leaf here
    name = f"{'static' if args.static else 'random'} {args.skip_ratio:.0%}"
    variants = {name: skip}
    if args.baseline:
        variants = {"all-reduce": dict(num_skip=0, min_size=0), **variants}

    shapes = jax.eval_shape(MODEL.init, jax.random.key(0), data[0][:1])
    log(f"{jax.process_count()} process(es) x {jax.local_device_count()} "
        f"device(s) = {n} data-parallel ranks; global batch {global_batch} "
        f"({args.batch_per_device} per device), {args.steps} steps")
    results = {}
    for variant, kwargs in variants.items():
        params, losses, per_step = train(variant, kwargs, args, mesh, data,
                                         batches)
        stats = sr.comm_stats(shapes, n, **kwargs)
        results[variant] = (accuracy(params, x_test, y_test), losses[-1],
                            stats, per_step)
        # Every process prints its own digest: they must all be equal.
        print(f"process {jax.process_index()}: [{variant}] params "
              f"sha256 {digest(params)}", flush=True)
        log(f"[{variant}] params replicated on all {n} devices of "
            f"{jax.process_count()} process(es): OK (assert_replicated)")

    log("")
    log(f"{'variant':<12} {'k':>2} {'test acc':>9} {'train loss':>11} "
        f"{'bytes/step/device':>18} {'vs all-reduce':>14} {'s/step':>8}")
    for variant, (acc, loss, stats, per_step) in results.items():
        log(f"{variant:<12} {stats.num_skip:>2} {acc:>9.4f} {loss:>11.4f} "
            f"{stats.bytes_per_device:>18,.0f} {stats.ratio:>14.3f} "
            f"{per_step:>8.4f}")
    acc, _, stats, _ = results[name]
    log(f"final test accuracy ({name}): {acc:.4f}")
    log(f"bytes per device per step: {stats.bytes_per_device:,.0f} "
        f"(full all-reduce {stats.full_bytes_per_device:,.0f}; "
        f"{stats.left_out_fraction:.1%} of contributions left out)")


if __name__ == "__main__":
    main()
