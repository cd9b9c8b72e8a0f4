"""Data-parallel training on scikit-learn's digits with SkipReduce.

Trains one small MLP (same initialisation, same data order) with five ways of
averaging the gradients over the data-parallel ranks, at a 50% skip ratio by
default (k = 4 of the N - 1 = 7 reduce-scatter steps skipped on 8 ranks):

* ``all-reduce``: a full all-reduce (``skip_reduce(num_skip=0)`` is exactly
  ``lax.pmean``), the baseline;
* ``static``: static SkipReduce, which always drops the same ranks for a given
  gradient element (biased);
* ``random``: Random SkipReduce, which draws the dropped ranks anew at every
  step (unbiased);
* ``selective``: Random SkipReduce with the first layer and the biases fully
  reduced;
* ``random+ef``: Random SkipReduce with error feedback (what a rank's gradient
  lost to skipping is added to its next gradient).

With ``--data non-iid`` each rank sees mostly two classes (95% of its samples
by default), as when data is sharded by source. Static skipping then always
averages the same ranks, hence the same classes, into a given weight. Here the
whole output layer lies in one ring slot, which on 8 ranks with k = 4 is
always summed over ranks 4-7 only: classes 6 and 7, which only rank 3 holds,
reach the output layer only through the 5% of samples ranks 4-7 draw from all
classes, and their test accuracy drops (the table's "worst class" column).
Random skipping draws the dropped ranks anew at every step, so every rank
reaches every weight equally often and accuracy stays close to the baseline.

The model is written with ``flax.linen`` because its parameters are a plain
pytree of arrays: they pass through ``jax.jit``, ``jax.shard_map`` and optax
unchanged, which is all the ``skipreduce_jax`` training helpers need.

Runs on 8 simulated CPU devices unless several accelerators are present::

    python examples/train_digits.py                # IID and non-IID
    python examples/train_digits.py --non-iid --steps 300

It prints a results table per data distribution and writes ``digits.png``
(test accuracy and loss per step) and ``digits.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common

_common.simulate_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402
from tqdm import tqdm  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

AXIS = "data"
NUM_CLASSES = 10
# Leaves with fewer elements than this are fully reduced by the `selective`
# variant: the biases (at most 256 elements, under 1% of the gradient bytes),
# while every weight matrix (>= 2,560 elements) may be skipped. The authors'
# 100k threshold plays the same role in models with millions of parameters.
SELECTIVE_MIN_SIZE = 1024
LABELS = {"iid": "IID", "non-iid": "non-IID"}


class MLP(nn.Module):
    """A multilayer perceptron: ReLU hidden layers, then class logits.

    Attributes:
      hidden: the width of each hidden layer.
      classes: the number of output logits.
    """

    hidden: Sequence[int] = (256, 256)
    classes: int = NUM_CLASSES

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


@dataclasses.dataclass(frozen=True)
class Digits:
    """The digits data set, split, and how the ranks sample from it.

    Attributes:
      x_train: float32 [n_train, 64] pixel intensities scaled to [0, 1].
      y_train: int32 [n_train] labels.
      x_test: float32 [n_test, 64].
      y_test: int32 [n_test].
      rank_pools: per rank, the training indices it mostly draws from (all
        of them for IID data).
      major_fraction: the probability that a sample comes from the rank's pool
        rather than from the whole training set.
      non_iid: whether the ranks' pools differ.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    rank_pools: tuple[np.ndarray, ...]
    major_fraction: float
    non_iid: bool

    @property
    def n_ranks(self) -> int:
        """The number of data-parallel ranks the data was prepared for."""
        return len(self.rank_pools)


def rank_classes(rank: int) -> tuple[int, int]:
    """The two classes a rank mostly sees with non-IID data.

    Ranks 0-4 cover the ten classes once; further ranks cycle round again.
    """
    first = (2 * rank) % NUM_CLASSES
    return first, first + 1


def make_data(non_iid: bool, n_ranks: int, seed: int, *,
              major_fraction: float = 0.95,
              test_fraction: float = 0.25) -> Digits:
    """Loads the digits (bundled with scikit-learn) and splits them.

    Args:
      non_iid: give each rank mostly the two classes of :func:`rank_classes`.
      n_ranks: the number of data-parallel ranks.
      seed: seeds the stratified train/test split.
      major_fraction: with ``non_iid``, the fraction of a rank's samples drawn
        from its two classes; the rest come from all classes.
      test_fraction: the share of the 1,797 images held out for testing.

    Returns:
      The :class:`Digits`.
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y)
    everything = np.arange(len(y_train))
    if non_iid:
        pools = tuple(everything[np.isin(y_train, rank_classes(r))]
                      for r in range(n_ranks))
    else:
        pools = (everything,) * n_ranks
        major_fraction = 1.0
    return Digits(x_train, y_train, x_test, y_test, pools, major_fraction,
                  non_iid)


def batch_indices(data: Digits, steps: int, batch_per_rank: int,
                  seed: int) -> np.ndarray:
    """Training indices of every step's global batch.

    Args:
      data: the data set and the ranks' pools.
      steps: the number of steps.
      batch_per_rank: samples per rank per step.
      seed: seeds the draws; the same seed gives every variant the same data.

    Returns:
      int [steps, n_ranks * batch_per_rank]; columns ``[r * B:(r + 1) * B]``
      are rank r's samples, the layout ``shard_batch`` splits over the ranks.
    """
    rng = np.random.default_rng(seed)
    shape = (steps, batch_per_rank)
    everything = np.arange(len(data.y_train))
    per_rank = []
    for pool in data.rank_pools:
        own = rng.choice(pool, size=shape)
        anywhere = rng.choice(everything, size=shape)
        per_rank.append(np.where(rng.random(shape) < data.major_fraction, own,
                                 anywhere))
    return np.concatenate(per_rank, axis=1)


def variants(skip_ratio: float = 0.5) -> dict[str, dict[str, Any]]:
    """The ``skip_reduce`` keyword arguments of each variant, by name.

    ``min_size`` defaults to 100,000, more than any leaf of this model, so the
    variants pass a small value. ``selective`` keeps the first layer (which
    sees every input pixel) and the biases (``SELECTIVE_MIN_SIZE``) on a full
    all-reduce, the usual exclusions of sensitive and cheap tensors, and skips
    the two larger weight matrices: 80% of the gradient.

    Args:
      skip_ratio: the fraction of reduce-scatter steps skipped.

    Returns:
      An ordered dict from variant name to ``skip_reduce`` kwargs.
    """
    return {
        "all-reduce": dict(num_skip=0, min_size=0),
        "static": dict(skip_ratio=skip_ratio, randomize=False, min_size=0),
        "random": dict(skip_ratio=skip_ratio, min_size=0),
        "selective": dict(skip_ratio=skip_ratio, min_size=SELECTIVE_MIN_SIZE,
                          selective=sr.exclude("Dense_0")),
        "random+ef": dict(skip_ratio=skip_ratio, min_size=0,
                          error_feedback=True),
    }


def cross_entropy(model: nn.Module, params: Any,
                  batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``model`` on ``(images, labels)``."""
    images, labels = batch
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits,
                                                           labels).mean()


def make_evaluate(
    model: nn.Module, data: Digits, device: Any,
) -> Callable[[Any], tuple[float, float, list[float]]]:
    """A jitted test-set evaluation of replicated params, on one device.

    Args:
      model: the model.
      data: holds the test set.
      device: where the test set lives and the evaluation runs.

    Returns:
      ``evaluate(params) -> (accuracy, loss, per_class_accuracy)``: two
      floats and a list of one float per class.
    """
    images = jax.device_put(data.x_test, device)
    labels = jax.device_put(data.y_test, device)
    counts = jax.device_put(np.bincount(data.y_test, minlength=NUM_CLASSES),
                            device)

    @jax.jit
    def metrics(params, images, labels, counts):
        logits = model.apply(params, images)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits,
                                                               labels).mean()
        correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        per_class = jnp.zeros(NUM_CLASSES).at[labels].add(correct)
        return correct.mean(), loss, per_class / jnp.maximum(counts, 1)

    def evaluate(params):
        local = jax.tree_util.tree_map(
            lambda a: next(s.data for s in a.addressable_shards
                           if s.device == device), params)
        acc, loss, per_class = metrics(local, images, labels, counts)
        return float(acc), float(loss), np.asarray(per_class).tolist()

    return evaluate


def run_variant(
    name: str,
    tx_kwargs: dict[str, Any],
    data: Digits,
    *,
    steps: int = 150,
    batch_per_rank: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    eval_every: int = 10,
    mesh: jax.sharding.Mesh | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Trains the MLP with one gradient reduction and tracks test metrics.

    Every variant with the same ``data`` and ``seed`` starts from the same
    initialisation and sees the same batches.

    Args:
      name: the variant's name (the progress bar's label).
      tx_kwargs: keyword arguments of ``skipreduce_jax.skip_reduce``.
      data: from :func:`make_data`, for ``mesh``'s number of ranks.
      steps: training steps.
      batch_per_rank: samples per rank per step.
      lr: the Adam learning rate.
      seed: seeds the initialisation, the batches and ``skip_reduce``.
      eval_every: evaluate the test set every this many steps (and at the
        start and the end).
      mesh: a 1-D mesh with axis ``"data"``; by default
        ``_common.data_mesh()``.
      progress: show a progress bar.

    Returns:
      ``dict(name, history, final_acc, final_loss, class_acc)``:
      ``history`` holds the lists ``step``, ``acc``, ``loss`` (test) and
      ``train_loss`` (the mean over ranks of the last step's batch loss,
      None at step 0);
      ``class_acc`` is the final test accuracy per class.
    """
    mesh = mesh or _common.data_mesh(AXIS)
    if mesh.shape[AXIS] != data.n_ranks:
        raise ValueError(f"data is for {data.n_ranks} ranks, the mesh has "
                         f"{mesh.shape[AXIS]}")
    model = MLP()
    params = model.init(jax.random.key(seed), data.x_train[:1])
    tx = optax.chain(sr.skip_reduce(AXIS, seed=seed, **tx_kwargs),
                     optax.adam(lr))
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, AXIS)
    step = sr.make_train_step(functools.partial(cross_entropy, model), tx,
                              mesh, AXIS)
    evaluate = make_evaluate(model, data, mesh.devices.flat[0])
    order = batch_indices(data, steps, batch_per_rank, seed)

    history: dict[str, list[Any]] = dict(step=[], acc=[], loss=[],
                                         train_loss=[])
    train_loss, class_acc = None, []
    for t in tqdm(range(steps + 1), desc=f"{name:>10}", disable=not progress,
                  leave=False, ncols=80):
        if t % eval_every == 0 or t == steps:
            acc, loss, class_acc = evaluate(params)
            for key, value in zip(history, (t, acc, loss, train_loss)):
                history[key].append(value)
        if t < steps:
            batch = (data.x_train[order[t]], data.y_train[order[t]])
            params, opt_state, loss_value = step(
                params, opt_state, sr.shard_batch(batch, mesh, AXIS))
            # Waiting for every step keeps one step in flight: dozens of
            # queued collective programs can deadlock XLA's simulated CPU
            # devices when they outnumber the cores.
            train_loss = float(loss_value)
    return dict(name=name, history=history, final_acc=history["acc"][-1],
                final_loss=history["loss"][-1], class_acc=class_acc)


def param_shapes(seed: int = 0) -> Any:
    """The MLP's parameter pytree as ``jax.ShapeDtypeStruct`` leaves."""
    model = MLP()
    return jax.eval_shape(model.init, jax.random.key(seed),
                          jnp.zeros((1, 64), jnp.float32))


def run_all(data: Digits, args: argparse.Namespace,
            mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """Trains every variant on ``data``; adds the communication cost."""
    n = mesh.shape[AXIS]
    shapes = param_shapes(args.seed)
    results = {}
    for name, kwargs in variants(args.skip_ratio).items():
        result = run_variant(name, kwargs, data, steps=args.steps,
                             batch_per_rank=args.batch_per_rank, lr=args.lr,
                             seed=args.seed, eval_every=args.eval_every,
                             mesh=mesh, progress=not args.no_progress)
        # Ring bytes per device, and their ratio to a full ring all-reduce
        # of every gradient (what the baseline sends).
        stats = sr.comm_stats(shapes, n, **kwargs)
        result.update(num_skip=stats.num_skip,
                      bytes_per_device=stats.bytes_per_device,
                      bytes_ratio=stats.ratio)
        results[name] = result
    return results


def results_table(results: dict[str, Any]) -> str:
    """The printed table: accuracy, loss and communication per variant."""
    rows = []
    for name, r in results.items():
        worst = int(np.argmin(r["class_acc"]))
        rows.append((name, f"{r['num_skip']}", f"{r['final_acc']:.3f}",
                     f"{r['final_loss']:.3f}",
                     f"{worst}: {r['class_acc'][worst]:.2f}",
                     f"{r['bytes_per_device']:,.0f}",
                     f"{r['bytes_ratio']:.3f}"))
    return _common.format_table(
        ("variant", "k", "test acc", "test loss", "worst class",
         "bytes/device/step", "vs all-reduce"), rows)


def plot(all_results: dict[str, dict[str, Any]], path: pathlib.Path,
         title: str) -> None:
    """Saves test accuracy and loss per step, a column per distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(all_results)
    fig, axes = plt.subplots(2, cols, figsize=(5.5 * cols, 7), squeeze=False,
                             sharex=True)
    for col, (setting, results) in enumerate(all_results.items()):
        for name, r in results.items():
            h = r["history"]
            axes[0, col].plot(h["step"], h["acc"], label=name)
            axes[1, col].plot(h["step"], h["loss"], label=name)
        axes[0, col].set_title(f"{LABELS[setting]} data")
        axes[0, col].set_ylabel("test accuracy")
        axes[1, col].set_ylabel("test loss")
        axes[1, col].set_xlabel("step")
        axes[1, col].set_yscale("log")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", choices=("iid", "non-iid", "both"), default="both",
                   help="data distribution over the ranks (default: both)")
    p.add_argument("--iid", dest="data", action="store_const", const="iid",
                   help="same as --data iid")
    p.add_argument("--non-iid", dest="data", action="store_const",
                   const="non-iid", help="same as --data non-iid: each rank "
                   "sees mostly two classes")
    p.add_argument("--non-iid-fraction", type=float, default=0.95,
                   help="with non-IID data, the share of a rank's samples "
                   "drawn from its two classes (default: 0.95)")
    p.add_argument("--steps", type=int, default=150,
                   help="training steps per variant (default: 150)")
    p.add_argument("--batch-per-rank", type=int, default=32,
                   help="samples per rank per step (default: 32)")
    p.add_argument("--skip-ratio", type=float, default=0.5,
                   help="fraction of the N-1 reduce-scatter steps skipped "
                   "(default: 0.5, k=4 on 8 ranks)")
    p.add_argument("--lr", type=float, default=1e-3,
                   help="Adam learning rate (default: 0.001)")
    p.add_argument("--eval-every", type=int, default=10,
                   help="test-set evaluation interval in steps (default: 10)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the split, init, batches and skipping")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("out"),
                   help="where digits.png and digits.json go (default: out)")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bars")
    args = p.parse_args(argv)
    for name in ("steps", "batch_per_rank", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.lr > 0:
        p.error("--lr must be > 0")
    for name in ("skip_ratio", "non_iid_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name.replace('_', '-')} must be in [0, 1]")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the demo; returns the exit status."""
    args = parse_args(argv)
    start = time.perf_counter()
    mesh = _common.data_mesh(AXIS)
    n = mesh.shape[AXIS]
    settings = ("iid", "non-iid") if args.data == "both" else (args.data,)
    print(f"{n} ranks on {mesh.devices.flat[0].platform}, {args.steps} steps "
          f"x {args.batch_per_rank} samples per rank, skip ratio "
          f"{args.skip_ratio}")
    all_results = {}
    for setting in settings:
        data = make_data(setting == "non-iid", n, args.seed,
                         major_fraction=args.non_iid_fraction)
        all_results[setting] = run_all(data, args, mesh)
        print(f"\n{LABELS[setting]} data:")
        print(results_table(all_results[setting]))

    args.out.mkdir(parents=True, exist_ok=True)
    title = (f"digits MLP, {n} ranks, skip ratio {args.skip_ratio}, "
             f"{args.batch_per_rank} samples/rank/step")
    plot(all_results, args.out / "digits.png", title)
    config = {k: (str(v) if isinstance(v, pathlib.Path) else v)
              for k, v in vars(args).items()}
    config.update(ranks=n, platform=mesh.devices.flat[0].platform)
    with open(args.out / "digits.json", "w") as f:
        json.dump(dict(config=config, results=all_results), f, indent=1)
    print(f"\nwrote {args.out / 'digits.png'} and {args.out / 'digits.json'} "
          f"in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
