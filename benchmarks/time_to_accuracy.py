r"""Time to accuracy: SkipReduce against top-k and PowerSGD, communication-bound.

Two workloads (``--workload``), each with little arithmetic per gradient byte:

* ``mlp`` (the default): an MLP on scikit-learn's digits (64 inputs, 10
  classes; by default each image also shifted by one pixel in every
  direction, ``--shift``, see :func:`load_data`) with wide hidden layers
  (2 x 2048 by default: 4.3 M parameters, 17 MB of float32 gradients) and a
  small per-rank batch (16). Scored by test accuracy and test loss.
* ``lm``: the byte-level transformer of ``examples/train_lm.py`` (tied
  embeddings, pre-LayerNorm blocks) on Python standard-library source,
  ``--d-model`` 256, ``--layers`` 2 blocks, ``--heads`` 4, ``--seq-len`` 64,
  4 sequences (256 tokens) per rank, AdamW at lr 1e-3: 1,661,952
  parameters, 6.65 MB of float32 gradients, so a ring all-reduce sends
  9.97 MB per device per step on 4 ranks (160 ms at 500 Mbit/s, against a
  forward and backward pass of about 2.5 GFLOP per rank). ``skip_adamw``
  sends 0.683 of that (every leaf but the embeddings may skip),
  ``random`` 0.667, ``topk`` 0.040, ``powersgd`` 0.026. Scored
  by validation loss (nats per byte, on 128 fixed windows of held-out files)
  and token accuracy; the time to target is that to the all-reduce's final
  validation loss only (next-byte accuracy is reported, not timed: it
  moves too little to time).

One model (same initialization, same batches) is trained for
``--time-budget`` seconds of training time with SGD with momentum 0.9 (the
``mlp``'s default), Adam, or AdamW (the ``lm``'s default; ``--optimizer``;
with Adam, Random SkipReduce needs more steps, see ``benchmarks/README.md``)
after each gradient reduction:

* ``all-reduce``: the baseline, ``skip_reduce(num_skip=0)`` (exactly
  ``lax.pmean``);
* ``skip_adamw`` (needs ``--optimizer adamw``): ``skipreduce_jax.skip_adamw``
  with its defaults (30 full all-reduce steps first, ``min_size=0``) at
  ``--skip-ratio``, with the workload's
  ``selective`` rule: the ``lm``'s embeddings (``train_lm.EMBED_PATTERN``)
  are always fully reduced, the ``mlp``'s first layer;
* ``random``: Random SkipReduce, ``--skip-ratio`` (50%) of the N - 1
  reduce-scatter steps skipped, on every leaf;
* ``selective``: the same, with the workload's ``selective`` rule and every
  leaf under 100k elements fully reduced;
* ``random+ef``: Random SkipReduce with error feedback;
* ``topk``: top-k sparsification (``--density``, 1%) with error memory;
* ``powersgd``: rank-``--rank`` (4) PowerSGD with error feedback, after
  ``--powersgd-warmup`` steps of plain all-reduce;
* ``static`` (only when asked for): static SkipReduce, the same skipped
  steps as ``random`` but always the same ranks dropped per element. It
  shows what randomization costs in a step and what its bias costs in
  accuracy;
* ``random-bf16`` and ``psum-bf16`` (only when asked for): a 16-bit wire
  for the float32 gradients. ``random-bf16`` is ``random`` with
  ``comm_dtype=jnp.bfloat16`` (each hop adds in float32); ``psum-bf16`` is
  ``lax.pmean`` of the gradients cast to bfloat16, the baseline a JAX user
  writes, which XLA:CPU widens to a float32 all-reduce (so on CPU hosts it
  sends as many bytes as ``all-reduce``).

Without ``--variants`` the ``mlp`` runs all but ``static``,
``skip_adamw`` and the 16-bit ones; the ``lm`` runs ``all-reduce``, ``skip_adamw``, ``random``,
``topk`` and ``powersgd``.

The held-out metrics are measured every ``--eval-every`` seconds of training
time. The training clock stops during evaluations, and every step function
is compiled and run twice before its clock starts. One evaluation moves by a
test sample or two, so the curves are smoothed: a mean over ``--smooth`` (3)
consecutive evaluations, placed at their mean time and step, for every curve
alike; a target's crossing is interpolated between two such points. The
script reports, per
variant, the time to reach the baseline's (smoothed) final accuracy (``mlp``
only) and the
speedup over the baseline's own time to it, the same for the baseline's final
test loss (smoother than accuracy) with the steps it took to reach it (how
many more steps a reduction needs: its cost in convergence), the final (raw
and smoothed) and best accuracy (``mlp``) or loss (``lm``), and the bytes
each device sends per step,
twice: from the compiled program (``skipreduce_jax.collective_traffic``, the
ring formulas applied to every collective of the jitted step, minus the
step's own 8-byte loss/clock all-reduce; PowerSGD's and ``skip_adamw``'s
are compiled without warm-up so that only the compressed path is counted) and
from the formulas
(``skipreduce_jax.comm_stats``, ``skipreduce_jax.contrib.topk_comm_bytes``,
``skipreduce_jax.contrib.powersgd_comm_bytes``). Process 0 prints the table
and writes ``<name>.json`` and ``<name>.png`` (accuracy, or the ``lm``'s
validation loss, against training
time) to ``--out``. With ``--parts ROUNDS`` nothing is trained: each variant's whole
step and its reduction alone are timed instead (:func:`time_parts`), and
``<name>.json`` holds the medians.

Two modes:

* In one process (``python benchmarks/time_to_accuracy.py``): ``--devices``
  (8) simulated CPU devices share this machine's cores and memory, so the
  "network" is a memory copy and compute dominates the step time: the
  ranking measures the reductions' computational overhead (ring steps,
  top-k selection, QR), not their bandwidth savings.
* One process per host (the network is real, or emulated slow): every
  process calls :func:`skipreduce_jax.initialize` first and takes its
  settings from the ``SKIPREDUCE_*`` environment variables of
  ``python -m skipreduce_jax.launch`` or another runner, for example::

      python -m skipreduce_jax.launch -n 4 benchmarks/time_to_accuracy.py \
          --time-budget 60 [--workload lm]

  Every process runs the same arguments and the same steps; when to
  evaluate and when to stop is decided from the training clock averaged over
  the processes (it rides in the step's loss all-reduce), so all processes
  agree without an extra collective. Every process evaluates on its own
  replica (so that none waits for another), and only process 0 prints and
  writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import pathlib
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax import contrib, distributed
from skipreduce_jax.cost import ring_allreduce_bytes

ROOT = pathlib.Path(__file__).resolve().parents[1]

AXIS = "data"
NUM_CLASSES = 10
#: The order variants run in (``all-reduce`` first: its final accuracy is the
#: target of the others).
ALL_VARIANTS = ("all-reduce", "skip_adamw", "random", "static", "selective",
                "random+ef", "topk", "powersgd", "random-bf16", "psum-bf16")
#: Variants that run only when ``--variants`` names them.
ON_REQUEST = ("static", "skip_adamw", "random-bf16", "psum-bf16")
#: What runs without ``--variants`` (the ``mlp``'s).
DEFAULT_VARIANTS = tuple(v for v in ALL_VARIANTS if v not in ON_REQUEST)
#: The ``lm``'s default variants.
LM_VARIANTS = ("all-reduce", "skip_adamw", "random", "topk", "powersgd")
#: ``--optimizer`` choices and their default learning rates (the ``mlp``'s).
DEFAULT_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 0.02}
#: The ``lm``'s default learning rates.
LM_LR = {"adam": 1e-3, "adamw": 1e-3, "sgd": 0.3}
#: ``skip_adamw``'s own defaults, read from its signature so they stay its own.
SKIP_ADAMW_DEFAULTS = {
    name: param.default
    for name, param in inspect.signature(sr.skip_adamw).parameters.items()
    if name in ("min_size", "warmup_steps")}
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_STATS_BYTES = 8  # the step's float32 [loss, clock] all-reduce


class MLP(nn.Module):
    """ReLU hidden layers, then class logits.

    Attributes:
      hidden: the width of each hidden layer.
      classes: the number of logits.
    """

    hidden: Sequence[int] = (2048, 2048)
    classes: int = NUM_CLASSES

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.classes)(x)


@dataclasses.dataclass(frozen=True)
class Data:
    """The digits, split 75/25 (stratified).

    Each split is optionally grown by shifted copies (:func:`shifted`).

    Attributes:
      x_train: float32 [n_train, 64] in [0, 1].
      y_train: int32 [n_train].
      x_test: float32 [n_test, 64].
      y_test: int32 [n_test].
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def shifted(images: np.ndarray, radius: int) -> np.ndarray:
    """Every 8x8 image moved by each ``(dy, dx)`` in ``[-radius, radius]^2``.

    The shifted images are zero-filled: ``[(2 radius + 1)^2 * n, 64]``, shift-major.
    """
    r = radius
    padded = np.pad(images.reshape(-1, 8, 8), ((0, 0), (r, r), (r, r)))
    return np.concatenate([
        padded[:, r - dy:r - dy + 8, r - dx:r - dx + 8].reshape(-1, 64)
        for dy in range(-r, r + 1) for dx in range(-r, r + 1)])


def load_data(seed: int, shift: int = 0) -> Data:
    """Loads scikit-learn's bundled digits (no download) and splits them.

    With ``shift`` > 0 each split (made first, so that no image has a copy
    on the other side) also holds every image shifted by up to ``shift``
    pixels, zero-filled: 9x the images for 1. The task is harder (the
    accuracy still rises after 60 s instead of sitting on a plateau), and
    the test set is 9x larger (4,050 images instead of 450, where one image
    is 0.22 points of accuracy; the shifted copies of a digit are not
    independent samples, though).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.25, random_state=seed, stratify=y)
    copies = (2 * shift + 1) ** 2
    return Data(shifted(x_train, shift), np.tile(y_train, copies),
                shifted(x_test, shift), np.tile(y_test, copies))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of averaging the gradients.

    Attributes:
      name: the label.
      make: ``() -> optax transform`` (local gradients in, mean out).
      formula_bytes: ``(param shapes, N) -> bytes per device per step``.
      accounting: ``() -> transform`` whose compiled step is read for the
        bytes (``make`` unless its warm-up branch should not be counted).
      whole: ``(steady) -> transform``: the reduction and its optimizer as one
        transform (``skip_adamw``; ``steady``: without the warm-up, as
        ``accounting``), or None: ``make`` then ``--optimizer``
        (:func:`training_transform`).
    """

    name: str
    make: Callable[[], optax.GradientTransformation]
    formula_bytes: Callable[[Any, int], float]
    accounting: Callable[[], optax.GradientTransformation]
    whole: Callable[[bool], optax.GradientTransformation] | None = None


def make_variants(args: argparse.Namespace) -> dict[str, Variant]:
    """Every variant, by name, with the settings of the command line."""

    def skip(**kw: Any) -> tuple[Callable, Callable, Callable]:
        if args.bucket_bytes is not None:
            kw["bucket_bytes"] = args.bucket_bytes
        make = lambda: sr.skip_reduce(AXIS, seed=args.seed, **kw)  # noqa: E731
        formula = lambda shapes, n: sr.comm_stats(  # noqa: E731
            shapes, n, **kw).bytes_per_device
        return make, formula, make

    ratio = args.skip_ratio
    selective = sr.exclude(WORKLOADS[args.workload].selective)
    # skip_adamw's reduction, then the same in the steady state.
    adamw_kw = dict(skip_ratio=ratio, seed=args.seed, selective=selective)
    adamw_reduce = dict(adamw_kw, **SKIP_ADAMW_DEFAULTS)
    adamw_steady = dict(adamw_reduce, warmup_steps=0)
    topk_kw = dict(density=args.density)
    psgd_kw = dict(rank=args.rank, warmup_steps=args.powersgd_warmup,
                   seed=args.seed)
    topk_make = lambda: contrib.topk_reduce(AXIS, **topk_kw)  # noqa: E731
    cast_pmean = lambda: optax.stateless(lambda g, params=None: jax.tree_util.tree_map(  # noqa: E731
        lambda x: lax.pmean(x.astype(jnp.bfloat16), AXIS).astype(x.dtype), g))

    def cast_pmean_bytes(shapes: Any, n: int) -> float:
        # XLA:CPU widens a 16-bit all-reduce to float32.
        width = 4 if jax.devices()[0].platform == "cpu" else 2
        return sum(ring_allreduce_bytes(math.prod(x.shape) * width, n)
                   for x in jax.tree_util.tree_leaves(shapes))

    specs = {
        "all-reduce": skip(num_skip=0, min_size=0),
        # skip_adamw takes no bucket_bytes: the package's default.
        "skip_adamw": (
            lambda: sr.skip_reduce(AXIS, **adamw_reduce),
            lambda shapes, n: sr.comm_stats(shapes, n, **adamw_reduce).bytes_per_device,
            lambda: sr.skip_reduce(AXIS, **adamw_steady),
            lambda steady: sr.skip_adamw(
                args.lr, axis_name=AXIS, **(adamw_steady if steady else adamw_kw))),
        "random": skip(skip_ratio=ratio, min_size=0),
        "static": skip(skip_ratio=ratio, min_size=0, randomize=False),
        "selective": skip(skip_ratio=ratio, selective=selective),
        "random+ef": skip(skip_ratio=ratio, min_size=0, error_feedback=True),
        "topk": (topk_make,
                 lambda shapes, n: contrib.topk_comm_bytes(shapes, n, **topk_kw),
                 topk_make),
        "powersgd": (
            lambda: contrib.powersgd_reduce(AXIS, **psgd_kw),
            lambda shapes, n: contrib.powersgd_comm_bytes(shapes, n, **psgd_kw),
            lambda: contrib.powersgd_reduce(AXIS, **{**psgd_kw, "warmup_steps": 0})),
        "random-bf16": skip(skip_ratio=ratio, min_size=0, comm_dtype=jnp.bfloat16),
        "psum-bf16": (cast_pmean, cast_pmean_bytes, cast_pmean),
    }
    return {name: Variant(name, *spec) for name, spec in specs.items()}


# ----------------------------------------------------------------------------
# Devices, arrays, the step.
# ----------------------------------------------------------------------------


def start_runtime(devices: int) -> None:
    """Joins the multi-process job if a runner started one.

    Otherwise asks for ``devices`` simulated CPU devices. Call before any other JAX use.
    """
    single = not (distributed.launcher_env_present()
                  or os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if single and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", devices)
    sr.initialize()


def data_mesh() -> jax.sharding.Mesh:
    """A 1-D mesh over every device of the job.

    The CPU devices are used if the default platform has only one device.
    """
    devices = jax.devices()
    if len(devices) == 1 and jax.process_count() == 1:
        devices = jax.devices("cpu")
    return jax.make_mesh((len(devices),), (AXIS,), devices=devices)


def global_array(host: np.ndarray, mesh: jax.sharding.Mesh,
                 spec: P) -> jax.Array:
    """A global array from a host array every process holds in full."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(host.shape, sharding,
                                        lambda index: host[index])


def replicated_copy(tree: Any, device: Any) -> Any:
    """This process's copy (on ``device``) of replicated arrays."""
    return jax.tree_util.tree_map(
        lambda a: next(s.data for s in a.addressable_shards
                       if s.device == device), tree)


def make_step(loss_fn: Callable[[Any, Any], jax.Array],
              tx: optax.GradientTransformation,
              mesh: jax.sharding.Mesh) -> Callable:
    """The jitted step ``(params, state, batch, clock) -> (params, state, stats)``.

    ``clock`` is float32 [N], each rank holding its process's training time;
    ``stats`` is float32 [2]: the mean loss and the mean clock over the
    ranks, one all-reduce, identical everywhere.
    """

    def local_step(params, opt_state, batch, clock):
        loss, grads = sr.local_value_and_grad(loss_fn, AXIS)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        stats = lax.pmean(jnp.stack([loss, clock[0]]), AXIS)
        return optax.apply_updates(params, updates), opt_state, stats

    def step(params, opt_state, batch, clock):
        specs = sr.state_specs(opt_state, AXIS)
        sharded = jax.shard_map(
            local_step, mesh=mesh, in_specs=(P(), specs, P(AXIS), P(AXIS)),
            out_specs=(P(), specs, P()), check_vma=True)
        return sharded(params, opt_state, batch, clock)

    return jax.jit(step, donate_argnums=(0, 1))


def scores(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accuracy and mean softmax cross-entropy of integer ``labels``."""
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()
    return jnp.mean(jnp.argmax(logits, -1) == labels), loss


def cross_entropy(model: nn.Module, params: Any,
                  batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy on ``(images, labels)``."""
    logits = model.apply(params, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]).mean()


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model and its data: what :class:`Trainer` trains and scores.

    Attributes:
      title: the model and data in a few words (the log and the plot).
      params: host initial parameters.
      loss: ``(params, batch) -> loss`` on one rank's batch (a tuple of
        arrays).
      metrics: ``(params, *held_out) -> (accuracy, loss)``, jittable.
      held_out: host arrays of the test (or validation) set.
      sample: ``(t, rows) -> tuple of host arrays``: step t's global batch,
        ``rows`` rows, the same for every variant and process.
    """

    title: str
    params: Any
    loss: Callable[[Any, Any], jax.Array]
    metrics: Callable[..., tuple[jax.Array, jax.Array]]
    held_out: tuple[np.ndarray, ...]
    sample: Callable[[int, int], tuple[np.ndarray, ...]]


def mlp_workload(args: argparse.Namespace) -> Workload:
    """``--hidden`` x ``--layers`` MLP on the digits (``--shift``)."""
    data = load_data(args.seed, args.shift)
    model = MLP(tuple([args.hidden] * args.layers))
    params = model.init(jax.random.key(args.seed), data.x_train[:1])

    def sample(t: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng((args.seed, t))
        idx = rng.integers(0, len(data.y_train), size=rows)
        return data.x_train[idx], data.y_train[idx]

    widths = "-".join([str(args.hidden)] * args.layers)
    return Workload(f"MLP 64-{widths}-10 on digits", params,
                    lambda p, b: cross_entropy(model, p, b),
                    lambda p, x, y: scores(model.apply(p, x), y),
                    (data.x_test, data.y_test), sample)


#: The ``lm``'s training and validation text (bytes) and validation windows.
LM_TRAIN_BYTES, LM_VAL_BYTES, LM_VAL_WINDOWS = 2**21, 2**17, 128


def import_train_lm() -> Any:
    """``examples/train_lm.py`` as a module, without its device-count flag.

    Importing it asks XLA for 8 CPU devices unless ``XLA_FLAGS`` already
    sets a count; this script sets its own (``--devices``, or one per host),
    and a flag left behind would reach the processes it starts.
    """
    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    flags = os.environ.get("XLA_FLAGS")
    try:
        import train_lm
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags
    return train_lm


def lm_workload(args: argparse.Namespace) -> Workload:
    """``train_lm``'s byte transformer (``--d-model``, ``--layers``, ``--heads``, ``--seq-len``)."""
    train_lm = import_train_lm()
    corpus = train_lm.load_corpus(LM_TRAIN_BYTES, LM_VAL_BYTES)
    model = train_lm.ByteTransformer(args.d_model, args.layers, args.heads,
                                     args.seq_len)
    params = jax.jit(model.init)(jax.random.key(args.seed),
                                 jnp.zeros((1, args.seq_len), jnp.int32))

    def sample(t: int, rows: int) -> tuple[np.ndarray]:
        # One batch of train_lm's sampler seeded by (seed, t): any step alone.
        return (next(train_lm.train_batches(corpus.train, 1, rows, args.seq_len,
                                            (args.seed, t))),)

    def metrics(p: Any, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        return scores(model.apply(p, tokens[:, :-1]), tokens[:, 1:])

    val = train_lm.val_windows(corpus.val, args.seq_len, LM_VAL_WINDOWS, 1)
    return Workload(
        f"byte transformer {args.layers} x d{args.d_model}, {args.seq_len}-byte "
        "sequences of Python source", params,
        lambda p, b: train_lm.lm_loss(model, p, b[0]), metrics, (val,), sample)


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a workload changes in the command line's defaults and the scoring.

    Attributes:
      build: ``args -> Workload``.
      batch_per_rank: ``--batch-per-rank``.
      optimizer: ``--optimizer``.
      lr: ``--lr`` per optimizer.
      variants: ``--variants``.
      targets: the held-out metrics with a time to target (``"acc"``,
        ``"loss"``), the first one plotted.
      selective: the pattern (``skipreduce_jax.exclude``) of the leaves that
        ``selective`` and ``skip_adamw`` always fully reduce.
    """

    build: Callable[[argparse.Namespace], Workload]
    batch_per_rank: int
    optimizer: str
    lr: dict[str, float]
    variants: tuple[str, ...]
    targets: tuple[str, ...]
    selective: str


#: ``--workload`` choices.
WORKLOADS = {
    "mlp": Defaults(mlp_workload, 16, "sgd", DEFAULT_LR, DEFAULT_VARIANTS,
                    ("acc", "loss"), "Dense_0"),
    # "embed": train_lm.EMBED_PATTERN, the token and positional embeddings.
    "lm": Defaults(lm_workload, 4, "adamw", LM_LR, LM_VARIANTS, ("loss",), "embed"),
}


class Trainer:
    """Shared by all variants: the model, data, batches and evaluation."""

    def __init__(self, args: argparse.Namespace, mesh: jax.sharding.Mesh):
        self.args = args
        self.mesh = mesh
        self.n = mesh.shape[AXIS]
        self.workload = WORKLOADS[args.workload].build(args)
        self.params0 = jax.tree_util.tree_map(np.asarray, self.workload.params)
        self.shapes = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params0)
        self.loss_fn = self.workload.loss
        self.eval_device = next(d for d in mesh.devices.flat
                                if d.process_index == jax.process_index())
        self.held_out = tuple(jax.device_put(a, self.eval_device)
                              for a in self.workload.held_out)
        self._metrics = jax.jit(self.workload.metrics)

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(self.params0))

    def batch(self, t: int) -> tuple[jax.Array, ...]:
        """Step t's global batch, the same for every variant and process.

        Rank r's rows are ``[r*B, (r+1)*B)``.
        """
        rows = self.workload.sample(t, self.n * self.args.batch_per_rank)
        return tuple(global_array(a, self.mesh, P(AXIS)) for a in rows)

    def clock(self, seconds: float) -> jax.Array:
        """This process's training time, one entry per rank."""
        return global_array(np.full(self.n, seconds, np.float32), self.mesh,
                            P(AXIS))

    def fresh(self, tx: optax.GradientTransformation) -> tuple[Any, Any]:
        """The initial params and optimizer state, placed on the mesh."""
        params = sr.replicate(self.params0, self.mesh)
        return params, sr.init_opt_state(tx, params, self.mesh, AXIS)

    def evaluate(self, params: Any) -> tuple[float, float]:
        """Test accuracy and loss of this process's replica."""
        acc, loss = self._metrics(replicated_copy(params, self.eval_device),
                                  *self.held_out)
        return float(acc), float(loss)

    def compiled_step(self, tx: optax.GradientTransformation) -> Any:
        """The step for ``tx``, compiled ahead of time."""
        params, state = self.fresh(tx)
        step = make_step(self.loss_fn, tx, self.mesh)
        return step.lower(params, state, self.batch(0),
                          self.clock(0.0)).compile()

    def hlo_bytes(self, compiled: Any) -> float:
        """Bytes per device per step of the reduction, from the program."""
        stats = 2 * (self.n - 1) / self.n * _STATS_BYTES
        return sr.collective_traffic(
            compiled.as_text()).bytes_per_device() - stats


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """The optimizer after the reduction: Adam, AdamW (optax defaults) or SGD, momentum 0.9."""
    if args.optimizer == "adam":
        return optax.adam(args.lr)
    if args.optimizer == "adamw":
        return optax.adamw(args.lr)
    return optax.sgd(args.lr, momentum=0.9)


def training_transform(variant: Variant, args: argparse.Namespace,
                       steady: bool = False) -> optax.GradientTransformation:
    """The variant's reduction and the optimizer (``steady``: as accounted, no warm-up)."""
    if variant.whole is not None:
        return variant.whole(steady)
    reduction = variant.accounting if steady else variant.make
    return optax.chain(reduction(), make_optimizer(args))


def run_variant(trainer: Trainer, variant: Variant,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Trains with one variant for the time budget; returns its record."""
    args = trainer.args
    tx = training_transform(variant, args)
    start = time.perf_counter()
    compiled = trainer.compiled_step(tx)
    compile_s = time.perf_counter() - start
    accounting = compiled if variant.accounting is variant.make else \
        trainer.compiled_step(training_transform(variant, args, steady=True))
    hlo_bytes = trainer.hlo_bytes(accounting)

    # Warm up (caches, allocations, the evaluation's compilation), then start
    # again from the initial state.
    params, state = trainer.fresh(tx)
    for t in range(2):
        params, state, stats = compiled(params, state, trainer.batch(t),
                                        trainer.clock(0.0))
    jax.block_until_ready((params, state, stats))
    trainer.evaluate(params)
    params, state = trainer.fresh(tx)

    history: dict[str, list[float]] = dict(time=[], step=[], acc=[], loss=[],
                                           train_loss=[])

    def record(seconds: float, step: int, train_loss: float | None) -> None:
        acc, loss = trainer.evaluate(params)
        for key, value in zip(history, (seconds, step, acc, loss, train_loss), strict=True):
            history[key].append(value)

    record(0.0, 0, None)
    train_time, last_step, t = 0.0, 0.0, 0
    next_eval = args.eval_every
    while True:
        # Each process sends its clock as it will be after this step (if the
        # step lasts as long as the last one); `shared`, their mean, is
        # identical everywhere, so every process takes the same decisions.
        batch = trainer.batch(t)
        clock = trainer.clock(train_time + last_step)
        start = time.perf_counter()
        params, state, stats = compiled(params, state, batch, clock)
        jax.block_until_ready((params, state))
        loss, shared = np.asarray(stats.addressable_shards[0].data).tolist()
        last_step = time.perf_counter() - start
        train_time += last_step
        t += 1
        done = shared >= args.time_budget or t >= args.max_steps
        if done or shared >= next_eval:
            record(train_time, t, loss)
            next_eval = (math.floor(shared / args.eval_every) + 1) * \
                args.eval_every
        if done:
            break
    log(f"  {variant.name:<10} {t:5d} steps in {train_time:6.1f} s "
        f"(compiled in {compile_s:.1f} s): held-out acc {history['acc'][-1]:.3f}, "
        f"loss {history['loss'][-1]:.4f}")
    return dict(name=variant.name, steps=t, train_time=train_time,
                step_ms=1e3 * train_time / t, compile_s=compile_s,
                final_acc=history["acc"][-1], best_acc=max(history["acc"]),
                final_loss=history["loss"][-1], best_loss=min(history["loss"]),
                formula_bytes=variant.formula_bytes(trainer.shapes, trainer.n),
                hlo_bytes=hlo_bytes, history=history)


def reduction_only(tx: optax.GradientTransformation,
                   mesh: jax.sharding.Mesh) -> Callable:
    """``(params, state) -> (updates, state)``: ``tx`` alone on per-rank gradients.

    The gradients are shaped like ``params`` (rank r's are ``(r + 1) * params``).
    """

    def local(params, state):
        scale = 1.0 + lax.axis_index(AXIS).astype(jnp.float32)
        grads = jax.tree_util.tree_map(
            lambda p: lax.pcast(p, AXIS, to="varying") * scale, params)
        return tx.update(grads, state, params)

    def reduce(params, state):
        specs = sr.state_specs(state, AXIS)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs),
                             out_specs=(P(), specs), check_vma=True)(
                                 params, state)

    return jax.jit(reduce, donate_argnums=1)


def time_parts(trainer: Trainer, variants: Sequence[Variant], rounds: int,
               calls: int = 3) -> dict[str, dict[str, float]]:
    """Median ms of each variant's whole training step and of its reduction alone.

    Both are timed in interleaved rounds (the first is a warm-up).

    The reduction runs in the steady state (``Variant.accounting``: PowerSGD
    without warm-up). "rest" = step - reduction: the forward and backward
    pass and the optimizer, less whatever of them overlaps the reduction.
    """
    args = trainer.args
    batch, clock = trainer.batch(0), trainer.clock(0.0)
    runs = {}
    for v in variants:
        tx = training_transform(v, args, steady=True)
        reduction = v.accounting()
        params = sr.replicate(trainer.params0, trainer.mesh)
        runs[v.name] = dict(
            step=trainer.compiled_step(tx), carry=trainer.fresh(tx),
            reduce=reduction_only(reduction, trainer.mesh), params=params,
            state=sr.init_opt_state(reduction, params, trainer.mesh, AXIS),
            step_s=[], reduce_s=[])
    for rnd in range(rounds + 1):
        for r in runs.values():
            for _ in range(calls):
                start = time.perf_counter()
                out = r["step"](*r["carry"], batch, clock)
                jax.block_until_ready(out)
                r["carry"] = out[:2]
                if rnd:
                    r["step_s"].append(time.perf_counter() - start)
            for _ in range(calls):
                start = time.perf_counter()
                updates, r["state"] = r["reduce"](r["params"], r["state"])
                jax.block_until_ready((updates, r["state"]))
                if rnd:
                    r["reduce_s"].append(time.perf_counter() - start)
    parts = {}
    for name, r in runs.items():
        step, reduce = (1e3 * float(np.median(r[k])) for k in ("step_s",
                                                               "reduce_s"))
        parts[name] = dict(step_ms=step, reduction_ms=reduce,
                           rest_ms=step - reduce)
    return parts


def parts_table(parts: dict[str, dict[str, float]]) -> str:
    """The printed table of :func:`time_parts`, with ratios to the first."""
    base = next(iter(parts.values()))
    lines = [f"{'variant':<11} {'step ms':>8} {'/ first':>8} "
             f"{'reduction ms':>13} {'/ first':>8} {'rest ms':>8}"]
    for name, p in parts.items():
        lines.append(f"{name:<11} {p['step_ms']:8.1f} "
                     f"{p['step_ms'] / base['step_ms']:8.3f} "
                     f"{p['reduction_ms']:13.1f} "
                     f"{p['reduction_ms'] / base['reduction_ms']:8.3f} "
                     f"{p['rest_ms']:8.1f}")
    return "\n".join(lines)


def smoothed(values: Sequence[float], window: int) -> list[float]:
    """The trailing mean over the last ``window`` evaluations (fewer at the start).

    One test-set evaluation moves by a sample or two.
    """
    return [float(np.mean(values[max(0, i + 1 - window):i + 1]))
            for i in range(len(values))]


def reached(history: dict[str, list[float]], target: float, window: int = 1,
            metric: str = "acc") -> tuple[float, float] | None:
    """When the smoothed ``metric`` first reaches ``target``.

    Reaching means accuracy >= or loss <= ``target``; returns ``(time, step)``,
    or None if it never does.

    Each smoothed value stands at the mean time and mean step of its window
    (a trailing mean read at the window's last point would lag by about half
    a window, and by more steps for a faster variant), and the crossing is
    interpolated linearly between the two evaluations around it.
    """
    values = smoothed(history[metric], window)
    times = smoothed(history["time"], window)
    steps = smoothed(history["step"], window)
    sign = 1.0 if metric == "acc" else -1.0
    gaps = [sign * (v - target) for v in values]  # >= 0: reached
    for i, gap in enumerate(gaps):
        if gap >= 0:
            if i == 0:
                return times[0], steps[0]
            f = -gaps[i - 1] / (gap - gaps[i - 1])
            return (times[i - 1] + f * (times[i] - times[i - 1]),
                    steps[i - 1] + f * (steps[i] - steps[i - 1]))
    return None


#: Per held-out metric: the result keys of its time, steps and speedup.
_TARGET_KEYS = {"acc": ("time_to_target", "steps_to_target", "speedup"),
                "loss": ("time_to_loss", "steps_to_loss", "speedup_loss")}


def summarize(results: dict[str, dict[str, Any]], tolerance: float,
              window: int = 1, targets: Sequence[str] = ("acc", "loss")
              ) -> float | None:
    """Adds smoothed final values, times to target, speedups and byte ratios.

    The times are those to the all-reduce's final value of each metric of
    ``targets`` (``"acc"``, ``"loss"``), the speedups are over the
    all-reduce's own times. Returns the first metric's target: the
    all-reduce's smoothed final accuracy minus ``tolerance``, or its final
    loss plus ``tolerance`` (the loss target of an accuracy-first run has
    none).
    """
    for r in results.values():
        r["final_acc_smoothed"] = smoothed(r["history"]["acc"], window)[-1]
        r["final_loss_smoothed"] = smoothed(r["history"]["loss"], window)[-1]
    base = results.get("all-reduce")
    if base is None:
        return None
    slack = {"acc": -tolerance, "loss": 0.0}
    slack[targets[0]] = -tolerance if targets[0] == "acc" else tolerance
    goals = {m: base[f"final_{m}_smoothed"] + slack[m] for m in targets}
    for r in results.values():
        r["bytes_ratio"] = r["formula_bytes"] / base["formula_bytes"]
        for metric, goal in goals.items():
            time_key, steps_key, _ = _TARGET_KEYS[metric]
            when = reached(r["history"], goal, window, metric)
            r[time_key] = None if when is None else when[0]
            r[steps_key] = None if when is None else when[1]
    for r in results.values():
        for metric in goals:
            time_key, _, out = _TARGET_KEYS[metric]
            mine, theirs = r[time_key], base[time_key]
            r[out] = theirs / mine if mine and theirs else None
    return goals[targets[0]]


def results_table(results: dict[str, dict[str, Any]],
                  targets: Sequence[str] = ("acc", "loss")) -> str:
    """The printed table (``targets``: as :func:`summarize`'s)."""

    def opt(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    def col(header: str, key: str, fmt: str) -> tuple[str, Callable]:
        return header, lambda r: opt(r.get(key), fmt)

    if targets[0] == "acc":
        finals = [col("final acc", "final_acc", ".3f"),
                  col("smoothed", "final_acc_smoothed", ".3f"),
                  col("best acc", "best_acc", ".3f")]
    else:
        finals = [col("final loss", "final_loss", ".4f"),
                  col("smoothed", "final_loss_smoothed", ".4f"),
                  col("best loss", "best_loss", ".4f"),
                  col("final acc", "final_acc", ".3f")]
    timed = {"acc": [col("t->acc s", "time_to_target", ".1f"),
                     col("speedup", "speedup", ".2f")],
             "loss": [col("t->loss s", "time_to_loss", ".1f"),
                      col("speedup", "speedup_loss", ".2f"),
                      col("steps->loss", "steps_to_loss", ".0f")]}
    columns = [("variant", lambda r: r["name"]), col("steps", "steps", "d"),
               col("ms/step", "step_ms", ".0f"), *finals,
               *[c for m in targets for c in timed[m]],
               col("bytes/step (formula)", "formula_bytes", ",.0f"),
               col("bytes/step (HLO)", "hlo_bytes", ",.0f"),
               col("vs all-reduce", "bytes_ratio", ".3f")]
    cells = [[h for h, _ in columns]] + [
        [cell(dict(r, name=name)) for _, cell in columns]
        for name, r in results.items()]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row: list[str]) -> str:
        return "  ".join([row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)])

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] +
                     [line(r) for r in cells[1:]])


def plot(results: dict[str, dict[str, Any]], target: float | None,
         path: pathlib.Path, title: str, metric: str = "acc") -> None:
    """Saves test accuracy (or the ``"loss"``) against training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in results.items():
        h = r["history"]
        ax.plot(h["time"], h[metric], marker=".", label=name)
    if target is not None:
        ax.axhline(target, color="gray", ls="--", lw=1,
                   label=f"target {target:.3f}")
    ax.set_xlabel("training time (s, evaluation and compilation excluded)")
    # Zoom on the end of training, where the target is reached.
    if metric == "acc":
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.0 if target is None else max(0.0, target - 0.15), 1.0)
    else:
        ax.set_ylabel("held-out loss (nats)")
        low = min(min(r["history"]["loss"]) for r in results.values())
        if target is not None and math.isfinite(low):
            ax.set_ylim(low - 0.05, target + 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right" if metric == "acc" else "upper right")
    ax.set_title(textwrap.fill(title, 90), fontsize=10)  # long titles: wrap
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp",
                   help="mlp (the wide MLP on digits, the default) or lm "
                   "(examples/train_lm.py's byte transformer)")
    p.add_argument("--variants", default=None,
                   help="comma-separated, from: " + ", ".join(ALL_VARIANTS)
                   + " (default: " + "; ".join(
                       f"{w}: {','.join(d.variants)}" for w, d in WORKLOADS.items())
                   + ")")
    p.add_argument("--time-budget", type=float, default=60.0,
                   help="training seconds per variant (default 60)")
    p.add_argument("--eval-every", type=float, default=2.0,
                   help="evaluate every this many training seconds")
    p.add_argument("--max-steps", type=int, default=1_000_000,
                   help="also stop after this many steps")
    p.add_argument("--hidden", type=int, default=2048,
                   help="mlp: width of each hidden layer (default 2048)")
    p.add_argument("--layers", type=int, default=2,
                   help="hidden layers (mlp) or transformer blocks (lm); "
                   "default 2")
    p.add_argument("--d-model", type=int, default=256,
                   help="lm: model width (default 256)")
    p.add_argument("--heads", type=int, default=4,
                   help="lm: attention heads (default 4)")
    p.add_argument("--seq-len", type=int, default=64,
                   help="lm: bytes predicted per sequence (default 64)")
    p.add_argument("--batch-per-rank", type=int, default=None,
                   help="samples (lm: sequences) per rank per step (default: "
                   + ", ".join(f"{w} {d.batch_per_rank}" for w, d in WORKLOADS.items())
                   + ")")
    p.add_argument("--shift", type=int, default=1,
                   help="also train and test on every digit shifted by up "
                        "to this many pixels (default 1: 9x the images; 0: "
                        "the plain digits)")
    p.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default=None,
                   help="sgd (with momentum 0.9, the mlp's default), adam or "
                   "adamw (the lm's default)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: " + "; ".join(
                       f"{w}: " + ", ".join(f"{k} {v:g}" for k, v in d.lr.items())
                       for w, d in WORKLOADS.items()) + ")")
    p.add_argument("--skip-ratio", type=float, default=0.5)
    p.add_argument("--bucket-bytes", type=int, default=None,
                   help="skip_reduce's bucket_bytes (default: the package's, "
                   "25 MiB)")
    p.add_argument("--density", type=float, default=0.01,
                   help="top-k: fraction of each leaf sent")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    p.add_argument("--powersgd-warmup", type=int, default=10,
                   help="PowerSGD: steps of plain all-reduce first")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="target = the baseline's final accuracy minus this "
                   "(lm: its final loss plus this)")
    p.add_argument("--smooth", type=int, default=3,
                   help="accuracies are trailing means over this many "
                        "evaluations (1: raw)")
    p.add_argument("--parts", type=int, default=0, metavar="ROUNDS",
                   help="instead of training, time each variant's step and "
                        "its reduction alone over this many interleaved "
                        "rounds (writes <name>.json)")
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices when run as one process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path,
                   default=ROOT / "benchmarks" / "results")
    p.add_argument("--name", default="time_to_accuracy",
                   help="base name of the JSON and PNG files")
    p.add_argument("--resummarize", type=pathlib.Path, metavar="JSON",
                   help="train nothing: read the histories of an earlier run's "
                   "JSON and print its table with this version's bookkeeping "
                   "(targets, times and steps to them)")
    args = p.parse_args(argv)
    defaults = WORKLOADS[args.workload]
    if args.variants is None:
        args.variants = ",".join(defaults.variants)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(ALL_VARIANTS))
    if unknown or not names:
        p.error(f"--variants: unknown {unknown}; choose from "
                f"{', '.join(ALL_VARIANTS)}")
    args.variants = [v for v in ALL_VARIANTS if v in names]
    if args.optimizer is None:
        args.optimizer = defaults.optimizer
    if args.lr is None:
        args.lr = defaults.lr[args.optimizer]
    if args.batch_per_rank is None:
        args.batch_per_rank = defaults.batch_per_rank
    if "skip_adamw" in args.variants and args.optimizer != "adamw":
        p.error(f"--variants skip_adamw is AdamW itself; with --optimizer "
                f"{args.optimizer} the others would run another optimizer: "
                "pass --optimizer adamw or leave skip_adamw out")
    for name in ("shift", "parts", "powersgd_warmup"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("max_steps", "hidden", "layers", "d_model", "heads", "seq_len",
                 "batch_per_rank", "rank", "smooth", "devices"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("time_budget", "eval_every", "lr"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.skip_ratio <= 1:
        p.error("--skip-ratio must be in [0, 1]")
    if not 0 < args.density <= 1:
        p.error("--density must be in (0, 1]")
    if args.bucket_bytes is not None and args.bucket_bytes < 1:
        p.error("--bucket-bytes must be >= 1")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads "
                f"{args.heads}")
    return args


def write_json(args: argparse.Namespace, trainer: Trainer,
               payload: dict[str, Any], **config: Any) -> pathlib.Path:
    """Writes ``<out>/<name>.json``: the settings, then ``payload``."""
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v)
                for k, v in vars(args).items()}
    settings.update(ranks=trainer.n, processes=jax.process_count(),
                    platform=trainer.mesh.devices.flat[0].platform,
                    params=trainer.num_params,
                    glibc_tunables=os.environ.get("GLIBC_TUNABLES"), **config)
    path = args.out / f"{args.name}.json"
    with open(path, "w") as f:
        json.dump(dict(config=settings, **payload), f, indent=1)
    return path


def resummarize(path: pathlib.Path, args: argparse.Namespace) -> str:
    """The targets line and table of an earlier run, recomputed from its histories.

    The run's own ``tolerance`` and ``smooth`` settings are used (those of
    ``args`` where an older JSON does not record them).
    """
    with open(path) as f:
        saved = json.load(f)
    config, results = saved["config"], saved["results"]
    settings = {name: config.get(name, getattr(args, name))
                for name in ("tolerance", "smooth")}
    assumed = sorted(set(settings) - set(config))
    # A JSON from before --workload is the mlp's.
    targets = WORKLOADS[config.get("workload", "mlp")].targets
    target = summarize(results, settings["tolerance"], settings["smooth"], targets)
    head = f"{path.name}: "
    if assumed:
        head += (f"(the JSON records no {' or '.join(assumed)}; taken from "
                 "the command line) ")
    if target is not None:
        head += targets_line(results, target, targets) + (
            f" (window {settings['smooth']})")
    return head + "\n" + results_table(results, targets)


def targets_line(results: dict[str, dict[str, Any]], target: float,
                 targets: Sequence[str]) -> str:
    """``accuracy target X, loss target Y`` (``loss target Y`` without accuracy)."""
    if targets[0] == "acc":
        return (f"accuracy target {target:.3f}, loss target "
                f"{results['all-reduce']['final_loss_smoothed']:.4f}")
    return f"loss target {target:.4f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    if args.resummarize is not None:
        print(resummarize(args.resummarize, args))
        return 0
    start_runtime(args.devices)
    lead = jax.process_index() == 0

    def log(message: str) -> None:
        if lead:
            print(message, flush=True)

    mesh = data_mesh()
    trainer = Trainer(args, mesh)
    n = trainer.n
    targets = WORKLOADS[args.workload].targets
    platform = mesh.devices.flat[0].platform
    mode = ("in-process" if jax.process_count() == 1 else
            f"{jax.process_count()} processes")
    log(f"{n} ranks ({mode}, {platform}), {trainer.workload.title}: "
        f"{trainer.num_params:,} params, "
        f"{4 * trainer.num_params / 2**20:.1f} MiB of float32 gradients; "
        f"{args.batch_per_rank} samples/rank/step, {args.optimizer} at lr "
        f"{args.lr:g}, " + ("timing the step's parts" if args.parts else
                            f"{args.time_budget:g} s per variant"))
    if jax.process_count() == 1:
        log("one process: the ranks share this machine, compute (not the "
            "network) dominates the step time")
    variants = make_variants(args)
    if args.parts:
        parts = time_parts(trainer, [variants[v] for v in args.variants],
                           args.parts)
        log(f"\nmedian over {args.parts} rounds of 3 calls each:\n"
            + parts_table(parts))
        if lead:
            write_json(args, trainer, dict(parts=parts))
        return 0
    results = {name: run_variant(trainer, variants[name], log)
               for name in args.variants}
    target = summarize(results, args.tolerance, args.smooth, targets)
    if target is not None:
        loss = results["all-reduce"]["final_loss_smoothed"]
        if targets[0] == "acc":
            head = (f"test accuracy {target + args.tolerance:.3f}"
                    + (f" - {args.tolerance:g}" if args.tolerance else "")
                    + f" and test loss {loss:.4f}")
        else:
            head = (f"held-out loss {loss:.4f}"
                    + (f" + {args.tolerance:g}" if args.tolerance else ""))
        log(f"\ntargets: the all-reduce's final {head} (means of its last "
            f"{args.smooth} evaluations; every curve is smoothed the same way)")
    log(results_table(results, targets))
    if lead:
        json_path = write_json(args, trainer, dict(results=results),
                               target=target)
        png_path = args.out / f"{args.name}.png"
        shift = (f", digits shifted by up to {args.shift} px"
                 if args.shift and args.workload == "mlp" else "")
        plot(results, target, png_path,
             f"{trainer.workload.title} ({trainer.num_params:,} params), {n} "
             f"ranks, {mode}, {args.batch_per_rank} samples/rank/step, "
             f"{args.optimizer}" + shift, metric=targets[0])
        log(f"wrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
