"""Adopting SkipReduce in flax NNX code: a CNN with BatchNorm and Dropout.

A small convolutional network (two 3x3 convolutions, each followed by
``nnx.BatchNorm``, average pooling, ``nnx.Dropout`` and two linear layers)
learns scikit-learn's bundled 8x8 digits over the ranks of a data-parallel
mesh (8 simulated CPU devices unless several accelerators are present),
trained with ``nnx.Optimizer`` and measured with ``nnx.MultiMetric``.

The file holds the step twice, so that the two can be compared line by line:

:func:`plain_setup`
    What a flax user writes today: ``nnx.jit`` on a global batch sharded over
    ``"data"``; XLA inserts the gradient all-reduce itself.
:func:`skipreduce_setup`
    The same step with SkipReduce (about 10 lines differ): written for one
    rank's rows and run by ``skipreduce_jax.nnx.data_parallel``; the
    gradients are local (``skipreduce_jax.nnx.local_value_and_grad``),
    ``skip_reduce`` averages them, skipping half of the ring (Random
    SkipReduce, ``skip_ratio=0.5``, ``min_size=0``). BatchNorm reduces its
    statistics over ``"data"``, each rank draws its own dropout mask, and
    the metrics see every rank's logits.

BatchNorm's scale and bias and the convolutions that feed them keep a full
all-reduce (``selective=exclude("bn", "conv")``): with statistics averaged
over the data axis, skipped convolutions drift and evaluation with the
running statistics collapsed (benchmarks/convergence.md); they are a few
thousand elements here, so the linear layers carry the saving.

Variants: ``plain`` (XLA's all-reduce), ``skipreduce`` (Random SkipReduce)
and ``skipreduce+ef`` (with error feedback)::

    python examples/nnx_cnn_digits.py
    python examples/nnx_cnn_digits.py --steps 400 --variants plain,skipreduce+ef

It prints test accuracy and loss during training and a table at the end.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import _common

_common.simulate_cpu_devices(8)  # before jax initialises

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_digits import batch_indices, make_data  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
import skipreduce_jax.nnx as srnnx  # noqa: E402

VARIANTS = ("plain", "skipreduce", "skipreduce+ef")
LABELS = {
    "plain": "nnx.jit, XLA all-reduce",
    "skipreduce": "Random SkipReduce",
    "skipreduce+ef": "Random SkipReduce + error feedback",
}
# Full all-reduce for BatchNorm's scale and bias and the convolutions feeding them.
UNSKIPPED = sr.exclude("bn", "conv")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run; see ``--help`` for the meanings."""

    steps: int = 200
    batch_per_rank: int = 16
    width: int = 16
    dropout: float = 0.25
    lr: float = 3e-3
    skip_ratio: float = 0.5
    eval_every: int = 25
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS


class CNN(nnx.Module):
    """Two conv + BatchNorm + ReLU blocks, 2x2 average pooling, two linears.

    Args:
      config: ``width`` (channels of the first conv) and ``dropout``.
      axis_name: the axis BatchNorm reduces its statistics over: None under
        ``nnx.jit`` (the batch is global), the data axis in a per-rank step.
      rngs: parameter initialisation and the dropout stream.
    """

    def __init__(self, config: Config, *, axis_name: str | None,
                 rngs: nnx.Rngs):
        width = config.width
        self.conv1 = nnx.Conv(1, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, axis_name=axis_name, rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(2 * width, axis_name=axis_name, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)
        self.linear1 = nnx.Linear(2 * width * 16, 128, rngs=rngs)
        self.linear2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], 8, 8, 1)
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.relu(self.bn2(self.conv2(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2)).reshape(x.shape[0], -1)
        x = self.dropout(nnx.relu(self.linear1(self.dropout(x))))
        return self.linear2(x)


def loss_fn(model: CNN, x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over the rows given, and the logits."""
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits


def make_metrics() -> nnx.MultiMetric:
    """Accuracy and mean loss, accumulated over steps until ``reset``."""
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                           loss=nnx.metrics.Average("loss"))


def gather(x: jax.Array) -> jax.Array:
    """Every rank's rows in rank order, typed replicated (for metrics)."""
    return lax.all_gather(x, "data", tiled=True, to="invarying")


@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, x: jax.Array,
              y: jax.Array) -> None:
    """Adds a test batch to ``metrics`` (``model.eval()`` first)."""
    loss, logits = loss_fn(model, x, y)
    metrics.update(loss=loss, logits=logits, labels=y)


# ----------------------------------------------------------------------------
# The two steps: README.md shows the lines that differ.
# ----------------------------------------------------------------------------


def plain_setup(mesh, config):
    """The model, its optimizer and flax's step under ``nnx.jit``."""
    model = CNN(config, axis_name=None, rngs=nnx.Rngs(config.seed))
    tx = optax.adamw(config.lr)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state = nnx.state((model, optimizer))
    nnx.update((model, optimizer), jax.device_put(state, NamedSharding(mesh, P())))

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model, optimizer, metrics, x, y):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, logits), grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    return model, optimizer, train_step


def skipreduce_setup(mesh, config, *, error_feedback=False):
    """The same, with SkipReduce; ``train_step`` sees one rank's rows."""
    model = CNN(config, axis_name="data", rngs=nnx.Rngs(config.seed))
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=config.skip_ratio, min_size=0,
                                    selective=UNSKIPPED, error_feedback=error_feedback),
                     optax.adamw(config.lr))
    optimizer = srnnx.init_optimizer(model, tx, mesh, "data")

    def train_step(model, optimizer, metrics, x, y):
        grad_fn = srnnx.local_value_and_grad(loss_fn, "data", has_aux=True)
        (loss, logits), grads = grad_fn(model, x, y)
        optimizer.update(model, grads)
        loss, logits, y = lax.pmean(loss, "data"), gather(logits), gather(y)
        metrics.update(loss=loss, logits=logits, labels=y)
        return loss

    train_step = srnnx.data_parallel(train_step, mesh, "data", batch_argnums=(3, 4),
                                     donate_argnums=(0, 1))
    return model, optimizer, train_step


# ----------------------------------------------------------------------------
# The loop, the same for both.
# ----------------------------------------------------------------------------


def setup(variant: str, mesh: jax.sharding.Mesh, config: Config):
    """``(model, optimizer, train_step)`` of one of :data:`VARIANTS`."""
    if variant == "plain":
        return plain_setup(mesh, config)
    if variant in ("skipreduce", "skipreduce+ef"):
        return skipreduce_setup(mesh, config,
                                error_feedback=variant == "skipreduce+ef")
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}.")


def evaluate(model: CNN, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Test accuracy and loss (BatchNorm's running statistics, no dropout)."""
    metrics = make_metrics()
    model.eval()
    eval_step(model, metrics, x, y)
    model.train()
    return {k: float(v) for k, v in metrics.compute().items()}


def train(variant: str, config: Config, mesh: jax.sharding.Mesh,
          data: Any) -> dict[str, Any]:
    """Trains one variant; call under ``jax.set_mesh(mesh)``.

    Every variant starts from the same initialisation and sees the same
    batches.

    Args:
      variant: one of :data:`VARIANTS`.
      config: the run configuration.
      mesh: the 1-D ``"data"`` mesh.
      data: ``train_digits.make_data``'s split.

    Returns:
      A dict: ``history`` (``[step, train loss, train accuracy, test loss,
      test accuracy]`` per evaluation), ``test_accuracy``, ``test_loss`` and
      ``seconds``.
    """
    start = time.perf_counter()
    model, optimizer, train_step = setup(variant, mesh, config)
    metrics = make_metrics()
    batch_sharding = NamedSharding(mesh, P("data"))
    indices = batch_indices(data, config.steps, config.batch_per_rank,
                            config.seed)
    history = []
    for step, rows in enumerate(indices, 1):
        x, y = jax.device_put((data.x_train[rows], data.y_train[rows]),
                              batch_sharding)
        train_step(model, optimizer, metrics, x, y)
        if step % config.eval_every and step != config.steps:
            continue
        seen = {k: float(v) for k, v in metrics.compute().items()}
        metrics.reset()
        test = evaluate(model, data.x_test, data.y_test)
        history.append([step, seen["loss"], seen["accuracy"], test["loss"],
                        test["accuracy"]])
        print(f"  [{variant:>13}] step {step:4d}  train loss {seen['loss']:.4f} "
              f"acc {seen['accuracy']:.3f}  test loss {test['loss']:.4f} "
              f"acc {test['accuracy']:.3f}", flush=True)
    return dict(history=history, test_loss=history[-1][3],
                test_accuracy=history[-1][4],
                seconds=time.perf_counter() - start)


HELP = {
    "steps": "training steps per variant",
    "batch_per_rank": "images per rank per step",
    "width": "channels of the first conv",
    "dropout": "dropout rate",
    "lr": "AdamW learning rate",
    "skip_ratio": "fraction of the N-1 reduce-scatter steps skipped",
    "eval_every": "steps between evaluations",
    "seed": "init and batch order",
}


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parses the command line into a :class:`Config`."""
    config, parser = _common.parse_config(
        Config(), argv, __doc__.split("\n\n")[0], variants=VARIANTS, helps=HELP)
    if min(config.steps, config.batch_per_rank, config.width, config.eval_every) < 1:
        parser.error("--steps, --batch-per-rank, --width and --eval-every must be >= 1")
    if config.dropout >= 1.0 or config.skip_ratio > 1.0:
        parser.error("--dropout must be in [0, 1) and --skip-ratio in [0, 1]")
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Trains every variant and prints a table; returns the results by name."""
    config = parse_args(argv)
    mesh = _common.data_mesh("data")
    n = mesh.shape["data"]
    data = make_data(False, n, config.seed)
    results = {}
    # An Explicit mesh (jax.make_mesh): code mixing the steps' outputs with
    # new arrays, e.g. the metrics, runs under it.
    with jax.set_mesh(mesh):
        for variant in config.variants:
            results[variant] = train(variant, config, mesh, data)
    params = nnx.state(CNN(config, axis_name=None, rngs=nnx.Rngs(0)), nnx.Param)
    # exact_radial: on in training, where init_optimizer finds the BatchNorms
    # by type; comm_stats sees only the names, so it is told.
    comm = sr.comm_stats(params, n, skip_ratio=config.skip_ratio, min_size=0,
                         selective=UNSKIPPED, exact_radial=True)
    rows = [[LABELS[v], f"{r['test_accuracy']:.4f}", f"{r['test_loss']:.4f}",
             "1.000" if v == "plain" else f"{comm.ratio:.3f}", f"{r['seconds']:.1f}"]
            for v, r in results.items()]
    print(f"\n{n} ranks, global batch {n * config.batch_per_rank}, "
          f"{config.steps} steps, skip ratio {config.skip_ratio} (k = {comm.num_skip})")
    print(_common.format_table(
        ["variant", "test acc", "test loss", "bytes vs all-reduce", "wall s"], rows))
    return results


if __name__ == "__main__":
    main()
