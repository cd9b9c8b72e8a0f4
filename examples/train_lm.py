"""Byte-level language model: full all-reduce vs Random (Selective) SkipReduce.

A small decoder-only transformer (token and learned positional embeddings,
pre-LayerNorm blocks with causal self-attention and an MLP, output head tied
to the token embedding) learns to predict the next byte of Python source code.
The corpus is the ``*.py`` files of the running interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``), so it is available offline;
the files are put in a fixed pseudo-random order and split by file, so no
validation file is seen in training (the generated codec tables of
``encodings/``, near copies of each other, are left out so that they cannot
leak across the split). Results therefore depend slightly on the Python
version.

The same model (same initialisation, same batches in the same order) is
trained data-parallel once per variant:

``allreduce``
    ``skip_reduce("data", num_skip=0, min_size=0)``, exactly a ``pmean``.
``selective``
    Random SkipReduce at ``--skip-ratio`` with the embeddings excluded
    (``selective=exclude("embed")``): the paper's Selective SkipReduce.
``random``
    Random SkipReduce at ``--skip-ratio`` on every leaf of at least
    ``min_size`` elements, embeddings included.

``min_size`` defaults to 1024 here rather than the package's 100_000, which
is meant for large models: in this model no leaf has 100k elements, so that
default would turn SkipReduce into a plain all-reduce. With 1024 every weight
matrix (at least ``d_model**2`` elements) may be skipped, while, at the
default ``--d-model 128``, the bias and LayerNorm vectors (at most
``4 * d_model`` = 512 elements, under 1% of the bytes) always get a full
all-reduce: skipping them would save almost nothing. (At ``--d-model 256``
the MLP's 1024-element bias reaches ``min_size`` and is skipped too.)

It runs on 8 simulated CPU devices unless several real devices are present::

    python examples/train_lm.py       # about 5 CPU-minutes for all 3 variants
    python examples/train_lm.py --steps 1000 --layers 4 --d-model 256

It prints the validation loss (nats per byte and bits per byte) during
training and a table at the end, and writes ``results.json`` and
``val_loss.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import _common

_common.simulate_cpu_devices(8)  # before jax initialises

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

VOCAB_SIZE = 256
AXIS = "data"
# Module names that contain "embed": the token and positional embeddings.
EMBED_PATTERN = "embed"
VARIANTS = ("allreduce", "selective", "random")
LABELS = {
    "allreduce": "all-reduce (pmean)",
    "selective": "Random Selective SkipReduce",
    "random": "Random SkipReduce (all leaves)",
}
# Directories of the standard library left out of the corpus: tests (much
# generated or repetitive data), the codecs (near-identical generated tables),
# the IDLE GUI and third-party packages.
_SKIPPED_DIRS = frozenset({"test", "tests", "encodings", "idlelib",
                           "site-packages", "dist-packages", "__pycache__"})
# The file order (and so the train/validation split) does not depend on
# --seed: every seed sees the same corpus.
_CORPUS_SEED = 1234


# ----------------------------------------------------------------------------
# Data.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Training and validation bytes, split by source file.

    Attributes:
      train: uint8 array of training bytes.
      val: uint8 array of validation bytes.
      train_files: number of files (the last one possibly cut) in ``train``.
      val_files: number of files in ``val``.
      root: the standard-library directory read.
    """

    train: np.ndarray
    val: np.ndarray
    train_files: int
    val_files: int
    root: str


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's ``*.py`` files, sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIPPED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append(rel)
    return [root / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def load_corpus(train_bytes: int, val_bytes: int) -> Corpus:
    """Reads standard-library source into a training and a validation stream.

    The files are shuffled with a fixed seed; validation takes files from the
    front of that order until it has ``val_bytes`` (its last file cut, the
    rest of that file unused), training takes the following files until it
    has ``train_bytes`` (the last file cut). Files are separated by a blank
    line.

    Args:
      train_bytes: size of the training stream.
      val_bytes: size of the validation stream.

    Returns:
      The :class:`Corpus`.

    Raises:
      RuntimeError: the standard library holds too little source.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    order = np.random.default_rng(_CORPUS_SEED).permutation(len(files))
    parts: dict[str, list[bytes]] = {"val": [], "train": []}
    budget = {"val": val_bytes, "train": train_bytes}
    split = "val"
    for index in order:
        data = files[index].read_bytes() + b"\n\n"
        have = sum(map(len, parts[split]))
        parts[split].append(data[:budget[split] - have])
        if have + len(data) >= budget[split]:
            if split == "train":
                break
            split = "train"
    train, val = (np.frombuffer(b"".join(parts[s]), np.uint8)
                  for s in ("train", "val"))
    if len(train) < train_bytes or len(val) < val_bytes:
        raise RuntimeError(
            f"only {len(train) + len(val)} bytes of source under {root}; "
            f"asked for {train_bytes} + {val_bytes}.")
    return Corpus(train, val, len(parts["train"]), len(parts["val"]), str(root))


def train_batches(data: np.ndarray, steps: int, batch: int, seq_len: int,
                  seed: int) -> Iterator[np.ndarray]:
    """Random windows of ``seq_len + 1`` bytes, the same sequence per seed.

    Args:
      data: the training bytes.
      steps: number of batches.
      batch: windows per batch (the global batch).
      seq_len: tokens predicted per window.
      seed: the sampling seed.

    Yields:
      int32 arrays of shape ``(batch, seq_len + 1)``.
    """
    rng = np.random.default_rng(seed)
    offsets = np.arange(seq_len + 1)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        yield data[starts[:, None] + offsets].astype(np.int32)


def val_windows(data: np.ndarray, seq_len: int, max_windows: int,
                multiple: int) -> np.ndarray:
    """Non-overlapping validation windows spread evenly over ``data``.

    Args:
      data: the validation bytes.
      seq_len: tokens predicted per window.
      max_windows: at most this many windows.
      multiple: the count is rounded down to a multiple of this (the number
        of devices).

    Returns:
      int32 array of shape ``(windows, seq_len + 1)``.
    """
    count = min(max_windows, (len(data) - 1) // seq_len)
    count -= count % multiple
    if count == 0:
        raise ValueError(f"validation text too short for {multiple} windows "
                         f"of {seq_len} bytes.")
    stride = (len(data) - 1) // count
    starts = np.arange(count) * stride
    return data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


# ----------------------------------------------------------------------------
# Model.
# ----------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then an MLP.

    Attributes:
      num_heads: attention heads (``d_model`` must be a multiple).
      mlp_ratio: MLP hidden width as a multiple of ``d_model``.
    """

    num_heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        head_dim = width // self.num_heads
        h = nn.LayerNorm(name="ln_attn")(x)
        qkv = nn.Dense(3 * width, name="qkv")(h)
        q, k, v = jnp.split(
            qkv.reshape(batch, length, 3 * self.num_heads, head_dim), 3, axis=2)
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.Dense(width, name="proj")(h.reshape(batch, length, width))
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.gelu(nn.Dense(self.mlp_ratio * width, name="fc")(h))
        return x + nn.Dense(width, name="out")(h)


class ByteTransformer(nn.Module):
    """Decoder-only transformer over bytes, output head tied to the embedding.

    Parameter paths: ``tok_embed`` and ``pos_embed`` (the embeddings),
    ``block_{i}`` (``ln_attn``, ``qkv``, ``proj``, ``ln_mlp``, ``fc``,
    ``out``) and ``ln_final``.

    Attributes:
      d_model: model width.
      num_layers: transformer blocks.
      num_heads: attention heads per block.
      max_len: longest input sequence.
    """

    d_model: int
    num_layers: int
    num_heads: int
    max_len: int

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(VOCAB_SIZE, self.d_model, embedding_init=init,
                         name="tok_embed")
        pos = self.param("pos_embed", init, (self.max_len, self.d_model))
        x = embed(tokens) + pos[:tokens.shape[1]]
        for i in range(self.num_layers):
            x = Block(self.num_heads, name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_final")(x))


def lm_loss(model: ByteTransformer, params: Any, tokens: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) over ``tokens[:, 1:]``."""
    logits = model.apply(params, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()


# ----------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run; see ``--help`` for the meanings."""

    steps: int = 300
    batch_per_rank: int = 4
    seq_len: int = 128
    d_model: int = 128
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    skip_ratio: float = 0.5
    min_size: int = 1024
    eval_every: int = 25
    val_windows: int = 256
    train_mb: float = 4.0
    val_mb: float = 0.25
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS


def reduce_kwargs(variant: str, config: Config) -> dict[str, Any]:
    """The :func:`skipreduce_jax.skip_reduce` arguments of one variant."""
    if variant == "allreduce":
        return dict(num_skip=0, min_size=0)
    kwargs: dict[str, Any] = dict(skip_ratio=config.skip_ratio,
                                  min_size=config.min_size, seed=config.seed)
    if variant == "selective":
        kwargs["selective"] = sr.exclude(EMBED_PATTERN)
    elif variant != "random":
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}.")
    return kwargs


def make_optimizer(config: Config, reducer: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
    """``reducer`` first, then clipping and AdamW with warmup + cosine decay."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, min(config.warmup, config.steps - 1), config.steps,
        end_value=config.lr / 10)
    decay_mask = lambda params: jax.tree_util.tree_map(  # noqa: E731
        lambda p: p.ndim >= 2, params)
    return optax.chain(
        reducer,
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95,
                    weight_decay=config.weight_decay, mask=decay_mask))


def train_variant(variant: str, config: Config, model: ByteTransformer,
                  init_params: Any, corpus: Corpus, mesh: jax.sharding.Mesh,
                  val_tokens: jax.Array, *, progress: bool = True
                  ) -> dict[str, Any]:
    """Trains one variant from ``init_params``; returns its history.

    Args:
      variant: one of :data:`VARIANTS`.
      config: the run configuration.
      model: the model.
      init_params: host (unreplicated) initial parameters, shared by all
        variants.
      corpus: the data.
      mesh: the 1-D data-parallel mesh.
      val_tokens: validation windows, sharded over the mesh.
      progress: show a tqdm bar.

    Returns:
      A dict with ``evals`` (list of ``[step, val_loss]``), ``train_loss``
      (per step), ``final_val_loss``, ``bits_per_byte``, ``seconds`` (wall
      time, compilation and evaluation included), ``cpu_seconds`` (process
      CPU time, all threads), ``step_ms`` (median wall time of a step after
      the first) and ``comm`` (:func:`skipreduce_jax.comm_stats` as a dict).
    """
    n = mesh.shape[AXIS]
    kwargs = reduce_kwargs(variant, config)
    tx = make_optimizer(config, sr.skip_reduce(AXIS, **kwargs))
    comm = sr.comm_stats(init_params, n, **kwargs)
    loss_fn = lambda p, tokens: lm_loss(model, p, tokens)  # noqa: E731
    eval_fn = jax.jit(jax.shard_map(
        lambda p, tokens: jax.lax.pmean(loss_fn(p, tokens), AXIS), mesh=mesh,
        in_specs=(P(), P(AXIS)), out_specs=P()))
    step_fn = sr.make_train_step(loss_fn, tx, mesh, AXIS)

    start, cpu_start = time.perf_counter(), time.process_time()
    params = sr.replicate(init_params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, AXIS)
    batches = train_batches(corpus.train, config.steps,
                            config.batch_per_rank * n, config.seq_len,
                            config.seed)
    evals: list[list[float]] = []
    losses: list[jax.Array] = []
    step_times: list[float] = []

    def evaluate(step: int, bar: tqdm) -> float:
        val = float(eval_fn(params, val_tokens))
        evals.append([step, val])
        recent = [float(x) for x in losses[-config.eval_every:]]
        train = f"{np.mean(recent):.4f}" if recent else "  -   "
        bar.set_postfix(train=train, val=f"{val:.4f}")
        bar.write(f"  [{variant:>9}] step {step:4d}  train {train}  val {val:.4f} "
                  f"nats/byte = {val / math.log(2):.4f} bits/byte")
        return val

    with tqdm(total=config.steps, desc=f"{variant:>9}", disable=not progress,
              leave=True, dynamic_ncols=True) as bar:
        evaluate(0, bar)
        for step, batch in enumerate(batches, start=1):
            t0 = time.perf_counter()
            params, opt_state, loss = step_fn(
                params, opt_state, sr.shard_batch(batch, mesh, AXIS))
            loss.block_until_ready()
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
            bar.update()
            if step % config.eval_every == 0 or step == config.steps:
                evaluate(step, bar)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    final = evals[-1][1]
    return dict(
        label=LABELS[variant],
        reduce_kwargs={k: (v if k != "selective" else f"exclude({EMBED_PATTERN!r})")
                       for k, v in kwargs.items()},
        evals=evals,
        train_loss=[float(x) for x in losses],
        final_val_loss=final,
        bits_per_byte=final / math.log(2),
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        step_ms=1e3 * float(np.median(step_times[1:])),  # after compiling
        comm=comm._asdict(),
    )


def run(config: Config, *, progress: bool = True) -> dict[str, Any]:
    """Loads the data, builds the model and trains every variant.

    Args:
      config: the run configuration.
      progress: show tqdm bars.

    Returns:
      A JSON-serialisable dict: ``config``, ``setup`` (devices, corpus and
      model sizes) and ``results`` (one entry per variant, see
      :func:`train_variant`).
    """
    if config.d_model % config.heads:
        raise ValueError(f"--d-model {config.d_model} is not a multiple of "
                         f"--heads {config.heads}.")
    mesh = _common.data_mesh(AXIS)
    n = mesh.shape[AXIS]
    corpus = load_corpus(int(config.train_mb * 2**20),
                         int(config.val_mb * 2**20))
    model = ByteTransformer(config.d_model, config.layers, config.heads,
                            config.seq_len)
    init_params = jax.device_get(jax.jit(model.init)(
        jax.random.key(config.seed), jnp.zeros((1, config.seq_len), jnp.int32)))
    val_tokens = jax.device_put(
        val_windows(corpus.val, config.seq_len, config.val_windows, n),
        NamedSharding(mesh, P(AXIS)))
    leaves = jax.tree_util.tree_leaves_with_path(init_params)
    setup = dict(
        devices=n,
        platform=mesh.devices.flat[0].platform,
        corpus_root=corpus.root,
        train_bytes=int(len(corpus.train)),
        train_files=corpus.train_files,
        val_bytes=int(len(corpus.val)),
        val_files=corpus.val_files,
        val_tokens=int(val_tokens.shape[0] * config.seq_len),
        global_batch=config.batch_per_rank * n,
        tokens_per_step=config.batch_per_rank * n * config.seq_len,
        parameters=int(sum(np.size(x) for _, x in leaves)),
        embedding_parameters=int(sum(
            np.size(x) for p, x in leaves
            if EMBED_PATTERN in jax.tree_util.keystr(p))),
    )
    results = {}
    for variant in config.variants:
        results[variant] = train_variant(variant, config, model, init_params,
                                         corpus, mesh, val_tokens,
                                         progress=progress)
    return dict(config=dataclasses.asdict(config), setup=setup, results=results)


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def results_table(report: dict[str, Any]) -> str:
    """The final comparison as a plain-text table."""
    results = report["results"]
    base = results.get("allreduce")
    rows = []
    for r in results.values():
        comm = r["comm"]
        delta = (f"{r['final_val_loss'] - base['final_val_loss']:+.4f}"
                 if base else "-")
        rows.append([
            r["label"], f"{r['final_val_loss']:.4f}", f"{r['bits_per_byte']:.4f}",
            delta, f"{comm['num_skip']}", f"{comm['bytes_per_device'] / 1e6:.3f}",
            f"{comm['ratio']:.3f}", f"{comm['left_out_fraction']:.3f}",
            f"{r['step_ms']:.0f}", f"{r['seconds']:.1f}",
            f"{r['cpu_seconds']:.1f}"])
    headers = ["variant", "val loss", "bits/byte", "vs all-reduce", "k",
               "MB/device/step", "ratio", "dropped", "ms/step", "wall s",
               "cpu s"]
    return _common.format_table(headers, rows)


def plot(report: dict[str, Any], path: Path) -> None:
    """Saves validation loss against step as a PNG.

    The left panel shows the loss (nats per byte), the right one each
    variant's difference from the all-reduce baseline (when it ran).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    base = results.get("allreduce")
    fig, axes = plt.subplots(1, 2 if base else 1, figsize=(12 if base else 7, 4.5),
                             squeeze=False)
    loss_ax = axes[0, 0]
    for r in results.values():
        steps, vals = zip(*r["evals"], strict=True)
        label = f"{r['label']} (bytes ratio {r['comm']['ratio']:.2f})"
        loss_ax.plot(steps, vals, marker="o", markersize=3, label=label)
        if base:
            base_vals = [v for _, v in base["evals"]]
            axes[0, 1].plot(steps, np.subtract(vals, base_vals), marker="o",
                            markersize=3, label=label)
    setup, cfg = report["setup"], report["config"]
    loss_ax.set_title(f"byte-level LM on Python stdlib source, {setup['devices']} "
                      f"ranks, skip ratio {cfg['skip_ratio']}", fontsize=10)
    loss_ax.set_ylabel("validation loss (nats/byte)")
    loss_ax.legend(fontsize=8)
    if base:
        axes[0, 1].axhline(0.0, color="gray", linewidth=0.8)
        axes[0, 1].set_title("difference from all-reduce", fontsize=10)
        axes[0, 1].set_ylabel("validation loss - all-reduce (nats/byte)")
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """Parses the command line into a :class:`Config` and the raw namespace."""
    d = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--steps", type=int, default=d.steps, help="training steps per variant")
    add("--batch-per-rank", type=int, default=d.batch_per_rank,
        help="sequences per rank per step")
    add("--seq-len", type=int, default=d.seq_len, help="bytes per sequence")
    add("--d-model", type=int, default=d.d_model, help="model width")
    add("--layers", type=int, default=d.layers, help="transformer blocks")
    add("--heads", type=int, default=d.heads, help="attention heads")
    add("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    add("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    add("--weight-decay", type=float, default=d.weight_decay,
        help="AdamW weight decay (matrices only)")
    add("--skip-ratio", type=float, default=d.skip_ratio,
        help="fraction of the N-1 reduce-scatter steps skipped")
    add("--min-size", type=int, default=d.min_size,
        help="leaves with fewer elements always get a full all-reduce")
    add("--eval-every", type=int, default=d.eval_every,
        help="steps between validation evaluations")
    add("--val-windows", type=int, default=d.val_windows,
        help="validation sequences (at most)")
    add("--train-mb", type=float, default=d.train_mb,
        help="training text, MiB of stdlib source")
    add("--val-mb", type=float, default=d.val_mb,
        help="validation text, MiB of (other) stdlib source")
    add("--variants", default=",".join(d.variants),
        help=f"comma-separated subset of {','.join(VARIANTS)}")
    add("--seed", type=int, default=d.seed,
        help="init, batch order and SkipReduce seed")
    add("--out", type=Path, default=Path("out"), help="output directory")
    add("--no-progress", action="store_true", help="hide progress bars")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_per_rank", "seq_len", "d_model", "layers",
                 "heads", "eval_every", "val_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step compiles and is "
                     "not timed)")
    if args.min_size < 0 or args.warmup < 0:
        parser.error("--min-size and --warmup must be >= 0")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of "
                     f"--heads {args.heads}")
    for name in ("lr", "train_mb", "val_mb"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0.0 <= args.skip_ratio <= 1.0:
        parser.error("--skip-ratio must be in [0, 1]")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = set(variants) - set(VARIANTS)
    if unknown or not variants:
        parser.error(f"--variants: choose from {','.join(VARIANTS)}")
    if len(set(variants)) != len(variants):
        parser.error(f"--variants names a variant twice: {args.variants}")
    config = Config(
        steps=args.steps, batch_per_rank=args.batch_per_rank,
        seq_len=args.seq_len, d_model=args.d_model, layers=args.layers,
        heads=args.heads, lr=args.lr, warmup=args.warmup,
        weight_decay=args.weight_decay, skip_ratio=args.skip_ratio,
        min_size=args.min_size, eval_every=args.eval_every,
        val_windows=args.val_windows, train_mb=args.train_mb,
        val_mb=args.val_mb, seed=args.seed, variants=variants)
    return config, args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the comparison, prints the table and writes JSON and PNG.

    Args:
      argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
      The report written to ``results.json``.
    """
    config, args = parse_args(argv)
    start = time.perf_counter()
    report = run(config, progress=not args.no_progress)
    report["wall_seconds"] = time.perf_counter() - start
    setup = report["setup"]
    print(f"\n{setup['devices']} {setup['platform']} ranks, "
          f"{setup['parameters']:,} parameters "
          f"({setup['embedding_parameters']:,} in embeddings), "
          f"{setup['tokens_per_step']:,} tokens/step, "
          f"{config.steps} steps; train {setup['train_bytes']:,} bytes "
          f"({setup['train_files']} files), validation {setup['val_tokens']:,} "
          f"bytes spread over {setup['val_bytes']:,} held-out bytes "
          f"({setup['val_files']} other files)")
    print(results_table(report))
    print(f"total wall time {report['wall_seconds']:.1f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "val_loss.png")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'val_loss.png'}")
    return report


if __name__ == "__main__":
    main()
