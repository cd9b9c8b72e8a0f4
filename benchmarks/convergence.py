r"""Steps to a target: how many more steps SkipReduce needs than the all-reduce.

The speed claims of SkipReduce rest on it needing about as many steps as the
all-reduce. This script measures that in one process on ``--ranks`` (8)
simulated CPU devices. Every variant trains the same model from the same
initialization on the same batches (per seed), and the validation loss is
measured every ``--eval-every`` steps. Per workload, optimizer and seed:

* the **target** is the all-reduce's validation loss at 2/3 of its run
  (``--target-fraction``); for ``mlp-named``, the all-reduce's smoothed
  validation loss at step 200: the mean of the three evaluations that end
  there (``TARGET_RULES``);
* **steps to target** is the first evaluation at which a variant's
  validation loss (smoothed the same way where the target is) is at or
  below it ("never" if not within ``--steps``);
* each variant's steps are divided by the all-reduce's and by the
  **information bound**'s: an all-reduce whose ranks each use only
  ``(N - k) / N`` of their batch. Skipping k of N contributions to every
  element can at best cost what dropping that share of the batch costs, so
  the bound's own ratio to the all-reduce (the *half-batch cost* column at
  a 50% skip ratio) states the batch regime of the row: near 1, the batch
  is past its critical size and dropping contributions is nearly free;
  near N / (N - k), every sample counts;
* the final validation loss and accuracy are compared at equal steps.

The table reports the median over ``--seeds`` and every seed's value.

Variants (``--variants``): ``all-reduce`` (``skip_reduce(num_skip=0)``,
exactly ``lax.pmean``), ``bound`` (the information bound above),
``random`` (Random SkipReduce with the defaults: balanced schedules, sub-chunks
of about 256 elements), ``random-iid`` (``balanced=False``: the paper's
schedule, drawn afresh every step), ``random-c1`` and ``random-c4`` (``chunks_per_rank``
1 and 4; ``random-cK`` for any K), ``random-units`` (``layout="units"``: each
kernel packed output unit first, so one unit's weights share their drop;
``random-units-cK`` with ``chunks_per_rank=K``; ``-iid`` after any of these
for ``balanced=False``), ``static`` (``randomize=False``),
``random+ef`` (error feedback), ``random+efB`` (partial error feedback: a
fraction B, e.g. 0.25, of what was left out comes back at the next step;
:func:`partial_feedback`), ``random-sel`` (Random with the
workload's selective rule: for ``cnn-bn``, every Conv and BatchNorm leaf on
a full all-reduce), ``random-radial`` (``exact_radial=True``: each output
channel's update along its weights exact, vectors fully reduced; the default
where the params hold a BatchNorm), ``random-noradial`` (``exact_radial=False``),
``random-wW`` (W full all-reduce warm-up steps first),
``random-wW-fv`` (the same, then AdamW's second moment frozen: 1-bit Adam's
recipe without its compression) and ``all-reduce-fvW`` (the all-reduce with
the second moment frozen after W steps: the control for ``-fv``),
``random-bf16`` (Random with ``comm_dtype=jnp.bfloat16``: 16-bit on the
wire, float32 in each hop), ``random-f8`` (``comm_dtype=jnp.float8_e4m3fn``:
blocks of 256 scaled to float8) and ``psum-bf16`` (the baseline a JAX user
writes: ``lax.pmean`` of the gradients cast to bfloat16, cast back). Every
skipped variant uses ``min_size=0``: every leaf may be skipped.

Workloads (``--workloads``):

* ``mlp``: a GELU MLP 64-512-512-16 on a 16-class synthetic task (inputs
  drawn from a normal distribution, labels from a random teacher network
  with label noise; numpy, from the seed), 64 samples per rank;
* ``mlp-named``: the same MLP, He-normal with the last layer scaled by 0.1,
  on scikit-learn's ``make_classification`` (12,000 samples of 64
  features, 16 classes, standardized; 10,000 train, 2,000 validate), 64
  samples per rank. Its JSON also holds, at every evaluation, the loss and
  accuracy on the whole training set (``full_train_*``) and the parameters'
  norm (``weight_norm``);
* ``mlp-noniid``: the MLP on the teacher task, but each rank samples only
  ``2 * 16 / N`` of the classes (each class on two ranks);
* ``cnn-bn``: a small CNN with BatchNorm (``flax.linen``, statistics
  averaged over the data axis with ``axis_name``) on scikit-learn's bundled
  8x8 digits; evaluation uses the running statistics. Its JSON also holds,
  at every evaluation, the conv kernel and bias norms and the validation
  loss and accuracy with the running statistics recomputed on the whole
  training set at the current weights (``recal_val_*``);
* ``lm``: the byte-level transformer of ``examples/train_lm.py`` (imported:
  its model, corpus and batches), shrunk to one block of width 64.

Optimizers (``--optimizers``): ``sgd`` (momentum 0.9; ``--momentum``) and
``adamw``, at learning rates per workload (``--lr`` overrides both).

The step is written by hand: ``skipreduce_jax.local_value_and_grad`` inside
``jax.shard_map`` with ``check_vma=True``, ``skip_reduce`` first in the
optimizer, ``state_specs`` for its state, and ``--eval-every`` steps per
call in a ``lax.scan`` (BatchNorm's statistics ride in the carry)::

    python benchmarks/convergence.py                       # mlp, sgd, 1 seed
    python benchmarks/convergence.py --workloads mlp --optimizers sgd,adamw --seeds 0,1,2
    python benchmarks/convergence.py --workloads cnn-bn --variants all-reduce,random,random-sel

It prints a markdown table and writes ``convergence_<tag>.json`` and
``convergence_<tag>.png`` (median validation loss per step) to ``--out``
(``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax.cost import skip_ratio_to_num_skip

ROOT = pathlib.Path(__file__).resolve().parents[1]
AXIS = "data"
WORKLOADS = ("mlp", "mlp-named", "mlp-noniid", "cnn-bn", "lm", "digits-mlp", "lm-wide",
             "mlp-deep")
# Added to judge error_feedback="auto"'s rule on workloads it was not fitted
# on (docs/records/convergence.md says which were held out from which rule).
HELD_OUT = ("digits-mlp", "lm-wide", "mlp-deep")
OPTIMIZERS = ("sgd", "adamw")
VARIANTS = ("all-reduce", "bound", "random", "random-iid", "random-c1", "random-c4", "static",
            "random+ef", "random-sel", "random-radial", "random-noradial",
            "random-bf16", "psum-bf16", "random+efauto", "random-f8")
DEFAULT_VARIANTS = VARIANTS[:VARIANTS.index("random-sel")]
LABELS = {
    "all-reduce": "all-reduce",
    "bound": "information bound",
    "random": "Random (the defaults: balanced)",
    "random-iid": "Random, balanced=False (the paper's)",
    "static": "static",
    "random+ef": "Random + error feedback",
    "random+efauto": "Random, error_feedback=\"auto\"",
    "random-sel": "Random, selective",
    "random-radial": "Random, exact radial components",
    "random-noradial": "Random, exact_radial=False",
    "random-bf16": "Random, comm_dtype=bfloat16",
    "random-f8": "Random, comm_dtype=float8_e4m3fn",
    "psum-bf16": "lax.pmean of bfloat16 gradients",
}
# random[-units][-cK][-iid]: layout="units", chunks_per_rank=K, balanced=False.
_GRAIN = re.compile(r"random(-units)?(?:-c([1-9][0-9]*))?(-iid)?$")
# random-wW: W full all-reduce steps first; -fv: then AdamW's second moment
# frozen (1-bit Adam's recipe, without its compression).
_WARMUP = re.compile(r"random-w([1-9][0-9]*)(-fv)?$")
# all-reduce-fvW: the all-reduce with the variance frozen after W steps (the
# control: what freezing does without skipping).
_FROZEN = re.compile(r"all-reduce-fv([1-9][0-9]*)$")
# random+efB: partial error feedback, a fraction B in (0, 1) of what was left
# out delivered at the next step (partial_feedback).
_PARTIAL_EF = re.compile(r"random\+ef(0\.[0-9]*[1-9])$")
# random+efgT: error feedback while the steps overshoot rarely (gated_feedback,
# the share of overshooting steps below T; T = 0.6 without a number).
_GATED_EF = re.compile(r"random\+efg(0\.[0-9]*[1-9])?$")
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
NUM_CLASSES_MLP = 16
# Workloads whose target is not read at ``--target-fraction``: the all-reduce's
# validation loss at STEP, smoothed as the mean of the EVALUATIONS
# evaluations that end there; every variant's curve is smoothed the same way.
TARGET_RULES: dict[str, tuple[int, int]] = {"mlp-named": (200, 3), "digits-mlp": (200, 3),
                                          "lm-wide": (200, 3), "mlp-deep": (200, 3)}


def label(variant: str) -> str:
    """The long name of a variant."""
    if variant in LABELS:
        return LABELS[variant]
    match = _GRAIN.match(variant)
    if match:
        return ", ".join(["Random"] + [text for text, on in (
            ("layout='units'", match.group(1)),
            (f"chunks_per_rank={match.group(2)}", match.group(2)),
            ("balanced=False", match.group(3))) if on])
    match = _FROZEN.match(variant)
    if match:
        return f"all-reduce, AdamW's variance frozen after {match.group(1)} steps"
    match = _PARTIAL_EF.match(variant)
    if match:
        return f"Random + error feedback of {match.group(1)} of what was left out"
    match = _GATED_EF.match(variant)
    if match:
        return ("Random + error feedback while under "
                f"{match.group(1) or '0.6'} of the steps overshoot")
    match = _WARMUP.match(variant)
    if match:
        frozen = ", then AdamW's variance frozen" if match.group(2) else ""
        return f"Random, {match.group(1)} all-reduce warm-up steps{frozen}"
    return LABELS[variant]


def check_variant(variant: str) -> str:
    """``variant`` if it is known, else a ValueError naming the choices."""
    if variant not in VARIANTS and not any(
            p.match(variant) for p in (_GRAIN, _WARMUP, _FROZEN, _PARTIAL_EF, _GATED_EF)):
        raise ValueError(f"unknown variant {variant!r}; choose from "
                         f"{', '.join(VARIANTS)}, random[-units][-cK][-iid], "
                         "random-wW[-fv], all-reduce-fvW (K, W >= 1), random+efB "
                         "(0 < B < 1) or random+efg[T] (0 < T < 1).")
    return variant


# ----------------------------------------------------------------------------
# Workloads.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its data and its learning rates.

    Attributes:
      name: one of :data:`WORKLOADS`.
      params: host initial parameters.
      model_state: host non-trained state (BatchNorm statistics) or ``{}``.
      loss: ``(params, model_state, batch) -> (loss, model_state)`` on one
        rank's batch, in training mode.
      metrics: ``(params, model_state, batch) -> (loss, accuracy)`` on one
        rank's share of the validation set, in evaluation mode.
      train: host arrays (a tuple) ``[steps, N * B, ...]``: rank r's B
        samples of every step are columns ``r * B:(r + 1) * B``.
      val: host arrays, rows a multiple of N.
      batch_per_rank: B.
      lr: the learning rate of each optimizer.
      selective: the ``selective`` rule of the ``random-sel`` variant.
      diagnostics: ``(params, model_state, mesh) -> dict`` of floats
        recorded at every evaluation, or None.
    """

    name: str
    params: Any
    model_state: Any
    loss: Callable[..., tuple[jax.Array, Any]]
    metrics: Callable[..., tuple[jax.Array, jax.Array]]
    train: tuple[np.ndarray, ...]
    val: tuple[np.ndarray, ...]
    batch_per_rank: int
    lr: dict[str, float]
    selective: Any = None
    diagnostics: Callable[[Any, Any, Any], dict[str, Any]] | None = None


class MLP(nn.Module):
    """GELU hidden layers, then logits.

    Attributes:
      hidden: the hidden widths.
      classes: the number of logits.
      kernel_init: every Dense kernel's initializer (flax's default: LeCun
        normal).
    """

    hidden: tuple[int, ...] = (512, 512)
    classes: int = NUM_CLASSES_MLP
    kernel_init: Callable[..., jax.Array] = nn.linear.default_kernel_init

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.gelu(nn.Dense(width, kernel_init=self.kernel_init)(x))
        return nn.Dense(self.classes, kernel_init=self.kernel_init)(x)


def softmax_metrics(logits: jax.Array, labels: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy and accuracy."""
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


def teacher_data(seed: int, samples: int, dim: int = 64,
                 classes: int = NUM_CLASSES_MLP, hidden: int = 32,
                 noise: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic classification task: normal inputs, teacher-network labels.

    The label is the argmax of a random one-hidden-layer tanh network's
    logits plus Gumbel noise of scale ``noise`` (label noise: the best loss
    is above zero). The teacher is drawn from ``seed``.
    """
    rng = np.random.default_rng([seed, 7])
    w1 = rng.normal(size=(dim, hidden)) / math.sqrt(dim)
    w2 = rng.normal(size=(hidden, classes)) * 3 / math.sqrt(hidden)
    x = rng.normal(size=(samples, dim))
    logits = np.tanh(x @ w1) @ w2 + noise * rng.gumbel(size=(samples, classes))
    return x.astype(np.float32), np.argmax(logits, 1).astype(np.int32)


def rank_pools(labels: np.ndarray, ranks: int, non_iid: bool,
               classes: int) -> list[np.ndarray]:
    """Per rank, the training indices it samples from.

    Non-IID: rank r sees ``2 * classes // ranks`` consecutive classes from
    ``r * classes // ranks`` on (mod ``classes``), so every class sits on
    two ranks.
    """
    everything = np.arange(len(labels))
    if not non_iid:
        return [everything] * ranks
    span = max(1, 2 * classes // ranks)
    pools = []
    for r in range(ranks):
        mine = (r * classes // ranks + np.arange(span)) % classes
        pools.append(everything[np.isin(labels, mine)])
    return pools


def sample_steps(pools: Sequence[np.ndarray], steps: int, batch: int,
                 seed: int) -> np.ndarray:
    """Training indices ``[steps, N * batch]``, rank r's drawn from its pool."""
    rng = np.random.default_rng([seed, 11])
    return np.concatenate([rng.choice(pool, size=(steps, batch)) for pool in pools],
                          axis=1)


def mlp_workload(seed: int, steps: int, ranks: int, *, non_iid: bool = False,
                 batch: int = 64) -> Workload:
    """The MLP on the teacher task (:func:`teacher_data`)."""
    # A pool larger than the samples a run draws: the validation loss keeps
    # falling instead of turning up with overfitting.
    pool = max(2**16, 2 * steps * ranks * batch)
    x, y = teacher_data(seed, pool + 4096)
    xt, yt, xv, yv = x[:pool], y[:pool], x[pool:], y[pool:]
    idx = sample_steps(rank_pools(yt, ranks, non_iid, NUM_CLASSES_MLP), steps,
                       batch, seed)
    model = MLP()
    params = model.init(jax.random.key(seed), xt[:1])

    def loss(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])[0], state

    def metrics(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])

    return Workload("mlp-noniid" if non_iid else "mlp", params, {}, loss, metrics,
                    (xt[idx], yt[idx]), (xv, yv), batch,
                    dict(sgd=0.05, adamw=1e-3))


NAMED_TRAIN_ROWS = 10_000


def named_data(seed: int) -> tuple[np.ndarray, ...]:
    """The named MLP's task: ``make_classification``, standardized, split.

    12,000 samples of 64 features (40 informative, 10 redundant), 16 classes
    of two clusters each, ``class_sep=1.0``, 2% flipped labels, drawn from
    ``seed``; standardized with the training rows' mean and deviation. The
    first 10,000 rows train, the other 2,000 validate.

    Returns:
      ``(x_train, y_train, x_val, y_val)``, float32 and int32.
    """
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=12_000, n_features=64, n_informative=40, n_redundant=10,
        n_classes=NUM_CLASSES_MLP, n_clusters_per_class=2, class_sep=1.0, flip_y=0.02,
        random_state=seed)
    n = NAMED_TRAIN_ROWS
    x = ((x - x[:n].mean(0)) / x[:n].std(0)).astype(np.float32)
    y = y.astype(np.int32)
    return x[:n], y[:n], x[n:], y[n:]


def named_mlp_workload(seed: int, steps: int, ranks: int, *, batch: int = 64,
                       last_scale: float = 0.1) -> Workload:
    """The named MLP: GELU 64-512-512-16 on :func:`named_data`.

    He-normal kernels, zero biases, the last layer's kernel scaled by
    ``last_scale``. Every rank draws its ``batch`` samples of every step
    from the 10,000 training rows. Records, at every evaluation, the loss
    and accuracy on the whole training set (``full_train_loss``,
    ``full_train_acc``): the optimization, where the validation loss adds
    the generalization; and the parameters' global norm (``weight_norm``).
    """
    xt, yt, xv, yv = named_data(seed)
    idx = sample_steps(rank_pools(yt, ranks, False, NUM_CLASSES_MLP), steps, batch, seed)
    model = MLP(kernel_init=nn.initializers.he_normal())
    params = model.init(jax.random.key(seed), xt[:1])
    last = f"Dense_{len(model.hidden)}"
    params["params"][last]["kernel"] = params["params"][last]["kernel"] * last_scale

    def loss(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])[0], state

    def metrics(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])

    keep = len(yt) - len(yt) % ranks

    @functools.cache
    def compiled(mesh):
        return evaluator(metrics, mesh), jax.device_put(
            (xt[:keep], yt[:keep]), NamedSharding(mesh, P(AXIS)))

    def diagnostics(p, state, mesh):
        evaluate, train = compiled(mesh)
        loss_, acc = evaluate(p, state, train)
        return dict(full_train_loss=loss_, full_train_acc=acc,
                    weight_norm=math.sqrt(sum(
                        np.sum(np.square(np.asarray(x, np.float64)))
                        for x in jax.tree.leaves(p))))

    return Workload("mlp-named", params, {}, loss, metrics, (xt[idx], yt[idx]), (xv, yv),
                    batch, dict(sgd=0.05, adamw=1e-3), diagnostics=diagnostics)


class BNCNN(nn.Module):
    """Conv-BatchNorm-ReLU twice, 2x2 average pooling, Dense-ReLU, logits.

    Attributes:
      channels: the conv widths.
      momentum: BatchNorm's running-average momentum.
      axis_name: the axis BatchNorm averages its batch statistics over.
    """

    channels: tuple[int, ...] = (8, 16)
    momentum: float = 0.99
    axis_name: str | None = AXIS

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = x.reshape(-1, 8, 8, 1)
        for width in self.channels:
            x = nn.Conv(width, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum,
                             axis_name=self.axis_name if train else None)(x)
            x = nn.relu(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def kernel_norms(params: Any) -> dict[str, float]:
    """The L2 norm of every conv kernel and bias, by module name."""
    out = {}
    for name, module in params["params"].items():
        if name.startswith("Conv"):
            out[f"{name}/kernel"] = jnp.linalg.norm(module["kernel"])
            out[f"{name}/bias"] = jnp.linalg.norm(module["bias"])
    return out


def digits_cnn_workload(seed: int, steps: int, ranks: int, *, batch: int = 16,
                        axis_name: str | None = AXIS) -> Workload:
    """The BatchNorm CNN on scikit-learn's digits (fixed split, seeded order).

    ``axis_name=None``: each rank normalizes with its own batch's statistics
    (the running statistics are then averaged over the ranks every step).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.25, random_state=0,
                                      stratify=y)
    keep = len(yv) - len(yv) % ranks
    xv, yv = xv[:keep], yv[:keep]
    idx = sample_steps(rank_pools(yt, ranks, False, 10), steps, batch, seed)
    model = BNCNN(axis_name=axis_name)
    variables = model.init(jax.random.key(seed), xt[:2], train=False)
    params, state = {"params": variables["params"]}, {
        "batch_stats": variables["batch_stats"]}

    def loss(p, s, b):
        logits, new = model.apply({**p, **s}, b[0], train=True,
                                  mutable=["batch_stats"])
        return softmax_metrics(logits, b[1])[0], new

    def metrics(p, s, b):
        return softmax_metrics(model.apply({**p, **s}, b[0], train=False), b[1])

    exact = BNCNN(momentum=0.0)  # running statistics = this batch's
    keep_t = len(yt) - len(yt) % ranks

    def recalibrate(p, s, xb):
        return exact.apply({**p, **s}, xb, train=True, mutable=["batch_stats"])[1]

    @functools.cache
    def compiled(mesh):
        fresh = jax.jit(jax.shard_map(recalibrate, mesh=mesh,
                                      in_specs=(P(), P(), P(AXIS)), out_specs=P()))
        sharded = NamedSharding(mesh, P(AXIS))
        return (fresh, evaluator(metrics, mesh), jax.device_put(xt[:keep_t], sharded),
                jax.device_put((xv, yv), sharded))

    def diagnostics(p, s, mesh):
        # The validation metrics with the running statistics recomputed on the
        # whole training set at the current weights, and the conv norms.
        fresh, evaluate, train_x, val = compiled(mesh)
        loss, acc = evaluate(p, fresh(p, s, train_x), val)
        return dict(recal_val_loss=loss, recal_val_acc=acc, **kernel_norms(p))

    return Workload("cnn-bn", params, state, loss, metrics, (xt[idx], yt[idx]),
                    (xv, yv), batch, dict(sgd=0.05, adamw=3e-3),
                    selective=sr.exclude("Conv", "BatchNorm"), diagnostics=diagnostics)


def lm_workload(seed: int, steps: int, ranks: int, *, batch: int = 4,
                seq_len: int = 64) -> Workload:
    """``examples/train_lm.py``'s byte transformer: 1 block, width 64."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_lm

    corpus = train_lm.load_corpus(2**19, 2**15)
    model = train_lm.ByteTransformer(64, 1, 4, seq_len)
    tokens = np.stack(list(train_lm.train_batches(
        corpus.train, steps, ranks * batch, seq_len, seed)))
    val = train_lm.val_windows(corpus.val, seq_len, 128, ranks)
    params = model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))

    def loss(p, s, b):
        return train_lm.lm_loss(model, p, b[0]), s

    def metrics(p, s, b):
        logits = model.apply(p, b[0][:, :-1])
        return softmax_metrics(logits, b[0][:, 1:])

    return Workload("lm", params, {}, loss, metrics, (tokens,), (val,), batch,
                    dict(sgd=0.3, adamw=3e-3),
                    selective=sr.exclude(train_lm.EMBED_PATTERN))


def digits_mlp_workload(seed: int, steps: int, ranks: int, *, batch: int = 8) -> Workload:
    """An MLP (one hidden layer of 128) on scikit-learn's digits: real data, over-fits.

    The 1,347 training images are seen again every 17 steps at 8 ranks.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    xt, xv, yt, yv = train_test_split(x, y, test_size=0.25, random_state=1, stratify=y)
    keep = len(yv) - len(yv) % ranks
    xv, yv = xv[:keep], yv[:keep]
    idx = sample_steps(rank_pools(yt, ranks, False, 10), steps, batch, seed)
    model = MLP(hidden=(128,), classes=10)
    params = model.init(jax.random.key(seed), xt[:1])

    def loss(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])[0], state

    def metrics(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])

    return Workload("digits-mlp", params, {}, loss, metrics, (xt[idx], yt[idx]),
                    (xv, yv), batch, dict(sgd=0.05, adamw=1e-3))


def mlp_deep_workload(seed: int, steps: int, ranks: int, *, batch: int = 32) -> Workload:
    """Four hidden layers of 256 on the teacher task, a larger learning rate."""
    pool = max(2**16, 2 * steps * ranks * batch)
    x, y = teacher_data(seed + 1000, pool + 4096)
    xt, yt, xv, yv = x[:pool], y[:pool], x[pool:], y[pool:]
    idx = sample_steps(rank_pools(yt, ranks, False, NUM_CLASSES_MLP), steps, batch, seed)
    model = MLP(hidden=(256,) * 4)
    params = model.init(jax.random.key(seed), xt[:1])

    def loss(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])[0], state

    def metrics(p, state, b):
        return softmax_metrics(model.apply(p, b[0]), b[1])

    return Workload("mlp-deep", params, {}, loss, metrics, (xt[idx], yt[idx]), (xv, yv),
                    batch, dict(sgd=0.1, adamw=1e-3))


def lm_wide_workload(seed: int, steps: int, ranks: int, *, batch: int = 4,
                     seq_len: int = 128) -> Workload:
    """A second text task: 2 pre-LN blocks of width 128 over 128 bytes.

    Standard-library source as :func:`lm_workload`, split differently: its
    validation windows come from files the ``lm`` workload trains on.
    """
    sys.path.insert(0, str(ROOT / "examples"))
    import train_lm

    corpus = train_lm.load_corpus(2**19 + 2**16, 2**15)
    held, train = corpus.train[:2**16], corpus.train[2**16:]
    model = train_lm.ByteTransformer(128, 2, 4, seq_len)
    tokens = np.stack(list(train_lm.train_batches(train, steps, ranks * batch, seq_len,
                                                  seed)))
    val = train_lm.val_windows(held, seq_len, 128, ranks)
    params = model.init(jax.random.key(seed), jnp.zeros((1, seq_len), jnp.int32))

    def loss(p, s, b):
        return train_lm.lm_loss(model, p, b[0]), s

    def metrics(p, s, b):
        return softmax_metrics(model.apply(p, b[0][:, :-1]), b[0][:, 1:])

    return Workload("lm-wide", params, {}, loss, metrics, (tokens,), (val,), batch,
                    dict(sgd=0.05, adamw=1e-3),
                    selective=sr.exclude(train_lm.EMBED_PATTERN))


def make_workload(name: str, seed: int, steps: int, ranks: int) -> Workload:
    """Builds one of :data:`WORKLOADS` for ``seed``."""
    if name == "mlp":
        return mlp_workload(seed, steps, ranks)
    if name == "mlp-named":
        return named_mlp_workload(seed, steps, ranks)
    if name == "mlp-noniid":
        return mlp_workload(seed, steps, ranks, non_iid=True)
    if name == "cnn-bn":
        return digits_cnn_workload(seed, steps, ranks)
    if name == "lm":
        return lm_workload(seed, steps, ranks)
    if name == "digits-mlp":
        return digits_mlp_workload(seed, steps, ranks)
    if name == "lm-wide":
        return lm_wide_workload(seed, steps, ranks)
    if name == "mlp-deep":
        return mlp_deep_workload(seed, steps, ranks)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}.")


# ----------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------


def reduce_kwargs(variant: str, skip_ratio: float, seed: int,
                  selective: Any = None) -> dict[str, Any]:
    """The ``skip_reduce`` arguments of a variant (the bound is an all-reduce)."""
    if variant in ("all-reduce", "bound", "psum-bf16") or _FROZEN.match(variant):
        return dict(num_skip=0, min_size=0)
    kwargs: dict[str, Any] = dict(skip_ratio=skip_ratio, min_size=0, seed=seed)
    grain, warmup = _GRAIN.match(variant), _WARMUP.match(variant)
    if grain:
        if grain.group(1):
            kwargs["layout"] = "units"
        if grain.group(2):
            kwargs["chunks_per_rank"] = int(grain.group(2))
        if grain.group(3):
            kwargs["balanced"] = False
    elif warmup:
        kwargs["warmup_steps"] = int(warmup.group(1))
    elif variant == "static":
        kwargs["randomize"] = False
    elif variant == "random-bf16":
        kwargs["comm_dtype"] = jnp.bfloat16
    elif variant == "random-f8":
        kwargs["comm_dtype"] = jnp.float8_e4m3fn
    elif variant == "random+efauto":
        kwargs["error_feedback"] = "auto"
    elif (variant == "random+ef" or _PARTIAL_EF.match(variant)
          or _GATED_EF.match(variant)):
        kwargs["error_feedback"] = True
    elif variant in ("random-radial", "random-noradial"):
        kwargs["exact_radial"] = variant == "random-radial"
    elif variant == "random-sel":
        if selective is None:
            raise ValueError("random-sel: this workload has no selective rule.")
        kwargs["selective"] = selective
    else:
        check_variant(variant)
    return kwargs


def partial_feedback(reducer: optax.GradientTransformation, fraction: float,
                     ranks: int, num_skip: int) -> optax.GradientTransformation:
    """``reducer`` (error feedback on) with only ``fraction`` of each residual kept.

    Error feedback divides the skipped sum by N and adds what was left out
    to the next step. Keeping ``fraction`` B of it delivers, per element,
    the N - k summed values now and B times the k left out later, so the
    sum is divided by N - (1 - B) k instead to stay unbiased: B = 0 is
    Random without error feedback, B = 1 error feedback. Composed around
    the library's transformation (its state's ``residual`` scaled on the
    way out), not part of the library.
    """
    scale = ranks / (ranks - (1 - fraction) * num_skip)

    def update_fn(updates, state, params=None):
        updates, state = reducer.update(updates, state, params)
        return (jax.tree_util.tree_map(lambda u: u * scale, updates),
                state._replace(residual=jax.tree_util.tree_map(
                    lambda r: r * fraction, state.residual)))

    return optax.GradientTransformation(reducer.init, update_fn)


class GatedState(NamedTuple):
    """:func:`gated_feedback`'s state: the reducer's, the last params, the share."""

    inner: Any
    previous: Any
    overshooting: jax.Array


def gated_feedback(reducer: optax.GradientTransformation, threshold: float,
                   ranks: int, num_skip: int, memory: float = 0.05
                   ) -> optax.GradientTransformation:
    """``reducer`` (error feedback on) with feedback only while steps rarely overshoot.

    A step overshoots when the new reduced gradient points along the last
    step, ``<g_t, p_t - p_(t-1)> > 0`` (the gradient-restart test of
    O'Donoghue and Candes, 2015): the last step went past the minimum along
    its own direction, as at the edge of stability, where a delayed share of
    the gradient destabilizes. ``overshooting``: an exponential mean of that
    test (weight ``memory`` per step), starting at 1. While it is below
    ``threshold``, error feedback (B = 1 of :func:`partial_feedback`); else
    Random (B = 0: residual dropped, the sum divided by N - k). Composed
    around the library's transformation, not part of the library.
    """
    def init_fn(params):
        return GatedState(reducer.init(params), params, jnp.ones((), jnp.float32))

    def update_fn(updates, state, params=None):
        on = (state.overshooting < threshold).astype(jnp.float32)
        updates, inner = reducer.update(updates, state.inner, params)
        scale = ranks / (ranks - (1 - on) * num_skip)
        updates = jax.tree_util.tree_map(lambda u: u * scale, updates)
        inner = inner._replace(residual=jax.tree_util.tree_map(
            lambda r: r * on, inner.residual))
        moved = jax.tree_util.tree_map(lambda p, q: p - q, params, state.previous)
        dot = sum(jnp.vdot(u, d) for u, d in zip(jax.tree_util.tree_leaves(updates),
                                                 jax.tree_util.tree_leaves(moved),
                                                 strict=True))
        started = state.inner.count > 0
        share = jnp.where(started, (1 - memory) * state.overshooting + memory * (dot > 0),
                          state.overshooting)
        return updates, GatedState(inner, params, share)

    return optax.GradientTransformation(init_fn, update_fn)


def freeze_steps(variant: str) -> int | None:
    """After how many steps the variant freezes AdamW's variance (None: never)."""
    frozen, warmup = _FROZEN.match(variant), _WARMUP.match(variant)
    if frozen:
        return int(frozen.group(1))
    return int(warmup.group(1)) if warmup and warmup.group(2) else None


def kept_per_rank(batch: int, ranks: int, skip_ratio: float) -> int:
    """The information bound's batch per rank: ``round(B (N - k) / N)``, >= 1."""
    k = sr.comm_stats(jnp.zeros(ranks), ranks, skip_ratio=skip_ratio,
                      min_size=0).num_skip
    return max(1, round(batch * (ranks - k) / ranks))


def shrink_batches(arrays: Sequence[np.ndarray], ranks: int, batch: int,
                   keep: int) -> tuple[np.ndarray, ...]:
    """Keeps the first ``keep`` of every rank's ``batch`` samples of each step."""
    out = []
    for a in arrays:
        per_rank = a.reshape(a.shape[0], ranks, batch, *a.shape[2:])[:, :, :keep]
        out.append(per_rank.reshape(a.shape[0], ranks * keep, *a.shape[2:]))
    return tuple(out)


class FrozenAdamState(NamedTuple):
    """State of :func:`scale_by_frozen_adam`."""

    count: jax.Array
    mu: Any
    nu: Any


def scale_by_frozen_adam(freeze_after: int, b1: float = 0.9, b2: float = 0.999,
                         eps: float = 1e-8) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` whose second moment stops after ``freeze_after`` steps.

    1-bit Adam's variance freezing (Tang et al., 2021): the second moment is
    estimated during the full all-reduce warm-up only, so the noise of the
    skipped steps cannot inflate it. Its bias correction stops with it.
    """
    def init_fn(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return FrozenAdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        live = count <= freeze_after
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = jax.tree_util.tree_map(lambda new, old: jnp.where(live, new, old),
                                    optax.tree.update_moment_per_elem_norm(
                                        updates, state.nu, b2, 2), state.nu)
        t_nu = jnp.minimum(count, freeze_after).astype(jnp.float32)
        out = jax.tree_util.tree_map(
            lambda m, v: (m / (1 - b1 ** count)) / (jnp.sqrt(v / (1 - b2 ** t_nu)) + eps),
            mu, nu)
        return out, FrozenAdamState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(name: str, lr: float, reducer: optax.GradientTransformation,
                   freeze_after: int | None = None, momentum: float = 0.9
                   ) -> optax.GradientTransformation:
    """``reducer`` first, then SGD with ``momentum`` or AdamW.

    ``freeze_after``: AdamW only; its second moment stops after that many
    steps (:func:`scale_by_frozen_adam`).
    """
    if name == "sgd":
        if freeze_after is not None:
            raise ValueError("freeze_after: AdamW only.")
        return optax.chain(reducer, optax.sgd(lr, momentum=momentum or None))
    if name == "adamw" and freeze_after is not None:
        # optax.adamw's chain, its scale_by_adam replaced.
        return optax.chain(reducer, scale_by_frozen_adam(freeze_after),
                           optax.add_decayed_weights(1e-4),
                           optax.scale_by_learning_rate(lr))
    if name == "adamw":
        return optax.chain(reducer, optax.adamw(lr))
    raise ValueError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}.")


def bfloat16_pmean() -> optax.GradientTransformation:
    """``lax.pmean`` of the gradients cast to bfloat16, cast back.

    The 16-bit baseline a JAX user writes; XLA reduces in bfloat16 (on CPU
    it widens the all-reduce to float32 and rounds the result).
    """
    def update_fn(updates, state, params=None):
        del params
        return jax.tree_util.tree_map(
            lambda g: lax.pmean(g.astype(jnp.bfloat16), AXIS).astype(g.dtype),
            updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def sync_state(tree: Any) -> Any:
    """Averages over the data axis the model-state leaves that differ per rank.

    BatchNorm with ``axis_name`` already returns replicated statistics;
    without it, each rank's running statistics are its own and are averaged
    here, so that every rank keeps the same model.
    """
    def varies(x):
        aval = jax.typeof(x)
        mat = getattr(aval, "mat", None)  # where this jax version keeps the type
        return AXIS in (mat.varying if mat is not None else getattr(aval, "vma", ()))

    return jax.tree_util.tree_map(lambda x: lax.pmean(x, AXIS) if varies(x) else x,
                                  tree)


def make_chunk_step(loss_fn: Callable, tx: optax.GradientTransformation,
                    mesh: jax.sharding.Mesh, opt_state: Any) -> Callable:
    """The jitted ``(params, opt_state, model_state, batches) -> (..., losses)``.

    ``batches`` holds several steps (leading axis); a ``lax.scan`` runs them
    in one call and returns each step's mean training loss.
    """
    grad_fn = sr.local_value_and_grad(loss_fn, AXIS, has_aux=True)

    def local(params, opt_state, model_state, batches):
        def body(carry, batch):
            params, opt_state, model_state = carry
            (loss, new_state), grads = grad_fn(params, model_state, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return (params, opt_state, sync_state(new_state)), lax.pmean(loss, AXIS)

        carry, losses = lax.scan(body, (params, opt_state, model_state), batches)
        return (*carry, losses)

    specs = sr.state_specs(opt_state, AXIS)
    return jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(), specs, P(), P(None, AXIS)),
        out_specs=(P(), specs, P(), P()), check_vma=True), donate_argnums=(0, 1, 2))


def evaluator(metrics: Callable, mesh: jax.sharding.Mesh) -> Callable:
    """The jitted ``(params, model_state, val) -> (loss, accuracy)``, averaged."""
    return jax.jit(jax.shard_map(
        lambda p, s, v: lax.pmean(metrics(p, s, v), AXIS), mesh=mesh,
        in_specs=(P(), P(), P(AXIS)), out_specs=P()))


def feedback_gates(opt_state: Any) -> list[sr.FeedbackGateState]:
    """The ``error_feedback="auto"`` states inside ``opt_state``."""
    def gate(x):
        return isinstance(x, sr.FeedbackGateState)

    return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=gate) if gate(x)]


def train_run(work: Workload, variant: str, optimizer: str, *, mesh: jax.sharding.Mesh,
              skip_ratio: float, seed: int, eval_every: int, lr: float | None = None,
              momentum: float = 0.9) -> dict[str, Any]:
    """Trains one variant; returns its history and final values.

    Returns:
      A dict with ``history`` (``step``, ``val_loss``, ``val_acc``,
      ``train_loss`` per evaluation, and the workload's diagnostics),
      ``reduce_kwargs``,
      ``batch_per_rank``, ``lr``, ``comm`` (``comm_stats``) and ``seconds``.
    """
    ranks = mesh.shape[AXIS]
    kwargs = reduce_kwargs(variant, skip_ratio, seed, work.selective)
    lr = work.lr[optimizer] if lr is None else lr
    freeze_after = freeze_steps(variant)
    reducer = bfloat16_pmean() if variant == "psum-bf16" else sr.skip_reduce(AXIS, **kwargs)
    partial, gated = _PARTIAL_EF.match(variant), _GATED_EF.match(variant)
    if partial:
        reducer = partial_feedback(reducer, float(partial.group(1)), ranks,
                                   skip_ratio_to_num_skip(skip_ratio, ranks))
    if gated:
        reducer = gated_feedback(reducer, float(gated.group(1) or 0.6), ranks,
                                 skip_ratio_to_num_skip(skip_ratio, ranks))
    tx = make_optimizer(optimizer, lr, reducer, freeze_after, momentum)
    train, batch = work.train, work.batch_per_rank
    if variant == "bound":
        keep = kept_per_rank(batch, ranks, skip_ratio)
        train, batch = shrink_batches(train, ranks, batch, keep), keep
    steps = train[0].shape[0]
    start = time.perf_counter()
    params = sr.replicate(work.params, mesh)
    state = sr.replicate(work.model_state, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, AXIS)
    chunk = make_chunk_step(work.loss, tx, mesh, opt_state)
    evaluate = evaluator(work.metrics, mesh)
    val = jax.device_put(work.val, NamedSharding(mesh, P(AXIS)))
    batches = NamedSharding(mesh, P(None, AXIS))
    history: dict[str, list[float]] = dict(step=[], val_loss=[], val_acc=[],
                                           train_loss=[])

    def record(step: int, train_loss: float) -> None:
        loss, acc = evaluate(params, state, val)
        history["step"].append(step)
        history["val_loss"].append(float(loss))
        history["val_acc"].append(float(acc))
        history["train_loss"].append(train_loss)
        for name, value in (work.diagnostics(params, state, mesh)
                            if work.diagnostics else {}).items():
            history.setdefault(name, []).append(float(value))
        for gate in feedback_gates(opt_state):  # what error_feedback="auto" reads
            history.setdefault("gate_overshooting", []).append(float(gate.overshooting))
            history.setdefault("gate_nonlinear", []).append(float(gate.nonlinear))

    record(0, math.nan)
    for lo in range(0, steps, eval_every):
        hi = min(steps, lo + eval_every)
        xs = jax.device_put(tuple(a[lo:hi] for a in train), batches)
        params, opt_state, state, losses = chunk(params, opt_state, state, xs)
        record(hi, float(np.mean(losses)))
    comm = sr.comm_stats(work.params, ranks, **kwargs)._asdict()
    if variant == "psum-bf16":  # the all-reduce's bytes at 2 bytes per float32
        comm = dict(comm, bytes_per_device=comm["bytes_per_device"] / 2, ratio=0.5)
    return dict(history=history,
                reduce_kwargs={k: (v if k not in ("selective", "comm_dtype") else
                                   "workload rule" if k == "selective" else jnp.dtype(v).name)
                               for k, v in kwargs.items()},
                batch_per_rank=batch, lr=lr, comm=comm,
                seconds=time.perf_counter() - start)


# ----------------------------------------------------------------------------
# Steps to target, ratios, medians.
# ----------------------------------------------------------------------------


def target_of(history: dict[str, list[float]], fraction: float) -> tuple[int, float]:
    """The validation loss at the evaluation nearest ``fraction`` of the run.

    Returns:
      ``(step, loss)``.
    """
    steps = history["step"]
    goal = fraction * steps[-1]
    i = min(range(len(steps)), key=lambda j: (abs(steps[j] - goal), steps[j]))
    return steps[i], history["val_loss"][i]


def smooth(history: dict[str, list[float]], window: int) -> dict[str, list[float]]:
    """``step`` and ``val_loss``, each loss the mean of the ``window`` evaluations ending there.

    The first ``window - 1`` evaluations have no such mean and are left out.
    """
    loss = history["val_loss"]
    return dict(step=history["step"][window - 1:],
                val_loss=[float(np.mean(loss[i + 1 - window:i + 1]))
                          for i in range(window - 1, len(loss))])


def target_at(history: dict[str, list[float]], step: int, window: int
              ) -> tuple[int, float]:
    """The smoothed validation loss (:func:`smooth`) at ``step``.

    Returns:
      ``(step, loss)``.

    Raises:
      ValueError: if ``step`` has no smoothed evaluation.
    """
    curve = smooth(history, window)
    if step not in curve["step"]:
        raise ValueError(
            f"the target is read at step {step} (the mean of {window} evaluations), "
            f"but the run evaluated {history['step'][:4]}...{history['step'][-1:]}: "
            f"run at least {step} steps, with --eval-every dividing {step}.")
    return step, curve["val_loss"][curve["step"].index(step)]


def lowest(history: dict[str, list[float]], window: int) -> tuple[int, float]:
    """The lowest smoothed validation loss (:func:`smooth`) and its step.

    Returns:
      ``(step, loss)``; the earliest step where the minimum is tied.
    """
    curve = smooth(history, window)
    i = int(np.argmin(curve["val_loss"]))
    return curve["step"][i], curve["val_loss"][i]


def steps_to(history: dict[str, list[float]], target: float) -> int | None:
    """The first evaluated step whose validation loss is <= ``target``, or None."""
    for step, loss in zip(history["step"], history["val_loss"], strict=True):
        if loss <= target:
            return step
    return None


def ratio(steps: int | None, reference: int | None) -> float | None:
    """``steps / reference``: inf if only ``steps`` is None, None if ``reference`` is."""
    if reference is None or reference == 0:
        return None
    return math.inf if steps is None else steps / reference


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (inf counts as the largest)."""
    known = sorted(v for v in values if v is not None)
    if not known:
        return None
    mid = len(known) // 2
    if len(known) % 2:
        return known[mid]
    low, high = known[mid - 1], known[mid]
    return high if math.isinf(high) else (low + high) / 2


def summarize(runs: Sequence[dict[str, Any]], fraction: float = 2 / 3
              ) -> list[dict[str, Any]]:
    """One row per (workload, optimizer, ranks, skip ratio, variant).

    Args:
      runs: dicts with ``workload``, ``optimizer``, ``ranks``, ``skip_ratio``,
        ``seed``, ``variant`` and ``history``; every seed of a group needs an
        ``all-reduce`` run (its target) and, for the bound ratios, a
        ``bound`` run.
      fraction: where on the all-reduce's run the target is read, for the
        workloads without a :data:`TARGET_RULES` entry.

    Returns:
      Rows with the per-seed lists ``seeds``, ``steps``, ``vs_allreduce``,
      ``vs_bound``, ``final_loss``, ``final_acc``, ``targets``, ``best_loss``
      and ``best_step`` (the lowest validation loss, smoothed as the target
      is, and where it occurs), their medians (``*_median``), and
      ``half_batch_cost`` (the bound's median ratio to the all-reduce in the
      row's group).
    """
    groups: dict[tuple, dict[str, dict[int, dict]]] = {}
    for run in runs:
        key = (run["workload"], run["optimizer"], run["ranks"], run["skip_ratio"])
        groups.setdefault(key, {}).setdefault(run["variant"], {})[run["seed"]] = run
    rows = []
    for key, by_variant in groups.items():
        base = by_variant.get("all-reduce", {})
        rule = TARGET_RULES.get(key[0])
        targets = {s: target_at(r["history"], *rule) if rule else
                   target_of(r["history"], fraction) for s, r in base.items()}

        def steps_to_target(history, target, window=rule[1] if rule else 1):
            return steps_to(smooth(history, window), target)

        def steps_of(variant: str, seed: int, by_variant=by_variant,
                     targets=targets, find=steps_to_target) -> int | None:
            run = by_variant.get(variant, {}).get(seed)
            return None if run is None or seed not in targets else find(
                run["history"], targets[seed][1])

        cost = median([ratio(steps_of("bound", s), steps_of("all-reduce", s))
                       for s in targets if s in by_variant.get("bound", {})])
        for variant, by_seed in by_variant.items():
            seeds = sorted(by_seed)
            best = [lowest(by_seed[s]["history"], rule[1] if rule else 1)
                    for s in seeds]
            row = dict(zip(("workload", "optimizer", "ranks", "skip_ratio"), key,
                           strict=True))
            row.update(
                variant=variant, seeds=seeds,
                targets=[targets[s][1] if s in targets else None for s in seeds],
                target_step=[targets[s][0] if s in targets else None for s in seeds],
                steps=[steps_of(variant, s) for s in seeds],
                final_loss=[by_seed[s]["history"]["val_loss"][-1] for s in seeds],
                final_acc=[by_seed[s]["history"]["val_acc"][-1] for s in seeds],
                best_loss=[b[1] for b in best], best_step=[b[0] for b in best],
                half_batch_cost=cost)
            row["vs_allreduce"] = [ratio(n, steps_of("all-reduce", s))
                                   for n, s in zip(row["steps"], seeds, strict=True)]
            row["vs_bound"] = [ratio(n, steps_of("bound", s)) if "bound" in by_variant
                               else None for n, s in zip(row["steps"], seeds, strict=True)]
            for name in ("steps", "vs_allreduce", "vs_bound", "final_loss", "final_acc",
                         "best_loss"):
                values = [math.inf if name == "steps" and v is None else v
                          for v in row[name]]
                row[f"{name}_median"] = median(values)
            rows.append(row)
    order = {v: i for i, v in enumerate(VARIANTS)}
    rows.sort(key=lambda r: (r["workload"], r["optimizer"], r["ranks"], r["skip_ratio"],
                             order.get(r["variant"], len(order)), r["variant"]))
    return rows


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "never"
    return format(value, spec)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The summary as a markdown table (medians, then every seed's value)."""
    head = ["workload", "opt", "N, ratio", "half-batch cost", "variant",
            "steps to target (seeds)", "median", "/ all-reduce", "/ bound",
            "final val loss", "final acc", "best val loss (median)"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 5 + ["---:"] * 7) + "|"]
    for r in rows:
        steps = ", ".join("never" if s is None else str(s) for s in r["steps"])
        lines.append("| " + " | ".join([
            r["workload"], r["optimizer"], f"{r['ranks']}, {r['skip_ratio']:g}",
            _fmt(r["half_batch_cost"], ".2f"), label(r["variant"]), steps,
            _fmt(r["steps_median"], ".0f"), _fmt(r["vs_allreduce_median"], ".2f"),
            _fmt(r["vs_bound_median"], ".2f"), _fmt(r["final_loss_median"], ".4f"),
            _fmt(r["final_acc_median"], ".3f"), _fmt(r["best_loss_median"], ".4f")]) + " |")
    return "\n".join(lines)


_BASIC = ("step", "val_loss", "val_acc", "train_loss")


def diagnostics_table(runs: Sequence[dict[str, Any]]) -> str:
    """Medians over seeds of the workloads' diagnostics at the end of the run.

    Also the worst validation loss over the second half of the run, which
    shows the spikes of a model evaluated with stale running statistics.
    Empty if no run recorded diagnostics.
    """
    groups: dict[tuple, list[dict[str, list[float]]]] = {}
    for r in runs:
        if set(r["history"]) - set(_BASIC):
            key = (r["workload"], r["optimizer"], r["ranks"], r["skip_ratio"],
                   r["variant"])
            groups.setdefault(key, []).append(r["history"])
    if not groups:
        return ""
    names = list(dict.fromkeys(n for hs in groups.values() for h in hs for n in h
                               if n not in _BASIC))
    lines = ["| workload | opt | variant | final val acc | worst val loss, 2nd half | "
             + " | ".join(names) + " |", "|" + "---|" * 3 + "---:|" * (2 + len(names))]
    for key, hs in groups.items():
        half = [max(v for s, v in zip(h["step"], h["val_loss"], strict=True)
                    if s >= h["step"][-1] / 2) for h in hs]
        cells = [_fmt(median([h["val_acc"][-1] for h in hs]), ".3f"),
                 _fmt(median(half), ".3f")]
        cells += [_fmt(median([h[n][-1] for h in hs if n in h]), ".3f") for n in names]
        lines.append("| " + " | ".join([key[0], key[1], label(key[4]), *cells]) + " |")
    return "\n".join(lines)


def plot(runs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]],
         path: pathlib.Path) -> None:
    """Saves the median validation loss per step and its gap to the all-reduce.

    One column per group: the loss on top (the target dashed), below it the
    median over seeds of each seed's gap to its all-reduce run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def group(r):
        return r["workload"], r["optimizer"], r["ranks"], r["skip_ratio"]

    keys = sorted({group(r) for r in runs})
    fig, axes = plt.subplots(2, len(keys), figsize=(6 * len(keys), 8), squeeze=False,
                             sharex="col")
    for col, key in enumerate(keys):
        top, bottom = axes[0, col], axes[1, col]
        mine = [r for r in runs if group(r) == key]
        base = {r["seed"]: r["history"]["val_loss"] for r in mine
                if r["variant"] == "all-reduce"}
        for variant in dict.fromkeys(r["variant"] for r in mine):
            curves = [r for r in mine if r["variant"] == variant]
            length = min(len(r["history"]["step"]) for r in curves)
            steps = curves[0]["history"]["step"][:length]
            loss = np.median([r["history"]["val_loss"][:length] for r in curves], axis=0)
            top.plot(steps, loss, label=label(variant))
            gaps = [np.subtract(r["history"]["val_loss"][:length],
                                base[r["seed"]][:length]) for r in curves
                    if len(base.get(r["seed"], ())) >= length]
            if gaps:
                bottom.plot(steps, np.median(gaps, axis=0), label=label(variant))
        targets = [t for r in rows if group(r) == key for t in r["targets"]
                   if t is not None]
        if targets:
            target = float(np.median(targets))
            top.axhline(target, color="gray", linestyle="--", linewidth=0.8,
                        label="target (median)")
            # The first fifth of the run is off the scale: the gaps are later.
            early = [r["history"]["val_loss"][len(r["history"]["step"]) // 5]
                     for r in mine]
            top.set_ylim(0.9 * min(min(r["history"]["val_loss"]) for r in mine),
                         max(early + [target]) * 1.05)
        top.set_title(f"{key[0]}, {key[1]}, N={key[2]}, skip ratio {key[3]:g}",
                      fontsize=10)
        top.set_ylabel("validation loss (median over seeds)")
        bottom.axhline(0.0, color="gray", linewidth=0.8)
        bottom.set_ylabel("minus the all-reduce's (median over seeds)")
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------
# Command line.
# ----------------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(t.strip()) for t in text.split(",") if t.strip()]


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(name: str) -> str:
        if name not in choices:
            raise argparse.ArgumentTypeError(
                f"{name!r}: choose from {', '.join(choices)}")
        return name
    return parse


def _variant(name: str) -> str:
    try:
        return check_variant(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--workloads", type=_csv(_choice(WORKLOADS)), default=["mlp"],
        help=f"comma-separated, of {','.join(WORKLOADS)}")
    add("--optimizers", type=_csv(_choice(OPTIMIZERS)), default=["sgd"],
        help="comma-separated, of sgd,adamw")
    add("--seeds", type=_csv(int), default=[0], help="comma-separated seeds")
    add("--ranks", type=_csv(int), default=[8], help="comma-separated, e.g. 4,8")
    add("--skip-ratio", type=_csv(float), default=[0.5],
        help="comma-separated fractions of the N-1 steps skipped, e.g. 0.5,0.25")
    add("--steps", type=int, default=300, help="training steps per run")
    add("--eval-every", type=int, default=10, help="steps between evaluations")
    add("--variants", type=_csv(_variant), default=list(DEFAULT_VARIANTS),
        help=f"comma-separated, of {','.join(VARIANTS)}, "
             "random[-units][-cK][-iid], random-wW[-fv] or all-reduce-fvW")
    add("--lr", type=float, default=None,
        help="learning rate for every run (default: per workload and optimizer)")
    add("--momentum", type=float, default=0.9, help="SGD's momentum (0: none)")
    add("--target-fraction", type=float, default=2 / 3,
        help="the target is the all-reduce's validation loss at this fraction of the run")
    add("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    add("--tag", default="convergence", help="output file name stem")
    add("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1:
        parser.error("--steps and --eval-every must be >= 1")
    if any(n < 2 for n in args.ranks):
        parser.error("--ranks: at least 2")
    if any(not 0 <= r <= 1 for r in args.skip_ratio):
        parser.error("--skip-ratio: each in [0, 1]")
    if not 0 <= args.momentum < 1:
        parser.error("--momentum must be in [0, 1)")
    if not 0 < args.target_fraction <= 1:
        parser.error("--target-fraction must be in (0, 1]")
    for name in ("workloads", "optimizers", "seeds", "ranks", "skip_ratio", "variants"):
        if not getattr(args, name):
            parser.error(f"--{name.replace('_', '-')} is empty")
    for name in args.workloads:
        if name in TARGET_RULES:
            step, window = TARGET_RULES[name]
            if (args.steps < step or step % args.eval_every
                    or step < (window - 1) * args.eval_every):
                parser.error(f"{name}: its target is read at step {step}; use --steps >= "
                             f"{step} and an --eval-every dividing {step}.")
    if "all-reduce" not in args.variants:
        args.variants.insert(0, "all-reduce")  # the target
    return args


def start_runtime(devices: int) -> None:
    """Asks for ``devices`` simulated CPU devices unless XLA_FLAGS sets a count."""
    if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", devices)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every combination, prints the table, writes JSON (and a PNG).

    Returns:
      The report written: ``config``, ``runs`` and ``summary``.
    """
    args = parse_args(argv)
    start_runtime(max(8, *args.ranks))
    devices = jax.devices()
    if len(devices) < max(args.ranks):
        devices = jax.devices("cpu")
    if len(devices) < max(args.ranks):
        raise SystemExit(f"--ranks {max(args.ranks)}: only {len(devices)} devices")
    runs = []
    start = time.perf_counter()
    for ranks in args.ranks:
        mesh = jax.make_mesh((ranks,), (AXIS,), devices=devices[:ranks])
        for name in args.workloads:
            for seed in args.seeds:
                work = make_workload(name, seed, args.steps, ranks)
                for optimizer in args.optimizers:
                    for ratio_ in args.skip_ratio:
                        for variant in args.variants:
                            if variant == "random-sel" and work.selective is None:
                                continue
                            result = train_run(work, variant, optimizer, mesh=mesh,
                                               skip_ratio=ratio_, seed=seed,
                                               eval_every=args.eval_every, lr=args.lr,
                                               momentum=args.momentum)
                            result.update(workload=name, optimizer=optimizer,
                                          ranks=ranks, skip_ratio=ratio_, seed=seed,
                                          variant=variant)
                            runs.append(result)
                            h = result["history"]
                            print(f"{name} {optimizer} N={ranks} r={ratio_:g} seed {seed} "
                                  f"{variant:>12}: val loss {h['val_loss'][-1]:.4f} acc "
                                  f"{h['val_acc'][-1]:.3f} "
                                  f"({result['seconds']:.1f} s)", flush=True)
    rows = summarize(runs, args.target_fraction)
    report = dict(config={k: (str(v) if isinstance(v, pathlib.Path) else v)
                          for k, v in vars(args).items()},
                  devices=f"{len(devices)} x {devices[0].platform}",
                  wall_seconds=time.perf_counter() - start, runs=runs, summary=rows)
    print(markdown_table(rows))
    extra = diagnostics_table(runs)
    if extra:
        print("\n" + extra)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.tag}.json"
    path.write_text(json.dumps(report, indent=1, default=float))
    if not args.no_plot:
        plot(runs, rows, args.out / f"{args.tag}.png")
    print(f"wrote {path}" + ("" if args.no_plot else f" and {path.with_suffix('.png')}"))
    return report


if __name__ == "__main__":
    main()
