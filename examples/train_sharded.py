"""Sharded training: an NNX transformer over (fsdp, tensor), SkipReduce over replica.

The byte-level language model of ``train_lm.py`` (same corpus, same
batches), written with ``flax.nnx`` and its parameters annotated with
``nnx.with_partitioning``: the token embedding and every kernel are sharded
over both ``fsdp`` and ``tensor``, the positional embedding and some biases
over ``tensor``; the LayerNorms are replicated. The mesh is ``(replica,
fsdp, tensor)`` on 8 simulated CPU devices (``--mesh 2,2,2`` or ``--mesh
4,2,1``), as in HSDP or multi-slice training: the compiler handles the fast
``fsdp`` and ``tensor`` axes (the model is plain GSPMD code), and only the
gradient reduction over the slow ``replica`` axis is SkipReduce's. Each
device reduces its own shard over ``replica``; nothing crosses the other
axes for it.

The same model (same initialisation, same batches) is trained once per
variant, with ``skipreduce_jax.nnx`` (``init_optimizer``,
``local_value_and_grad``, ``data_parallel``):

``allreduce``
    ``skip_reduce("replica", num_skip=0)``: exactly XLA's ``pmean``.
``random``
    Random SkipReduce at ``--skip-ratio`` on every leaf of at least
    ``--min-size`` elements (0: every leaf, kernels included).
``selective``
    The same with the embeddings and the LayerNorms fully reduced
    (``sr.exclude("embed", "ln_")``).

It prints each device's parameter bytes against the replicated layout, the
bytes each device sends per step over the replica axis, read from the
compiled step (``sr.collective_traffic``) and compared with XLA's own step
(a plain ``jax.jit`` GSPMD step of the same model, whose gradient
reductions over ``replica`` are all-reduces), and the validation loss of
each variant::

    python examples/train_sharded.py                 # about 2 CPU-minutes
    python examples/train_sharded.py --mesh 4,2,1 --steps 300

It writes ``sharded.json`` and ``sharded.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _common

_common.simulate_cpu_devices(8)  # before jax initialises

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import train_lm  # noqa: E402
from flax import nnx  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_lm import (  # noqa: E402
    VOCAB_SIZE,
    load_corpus,
    make_optimizer,
    train_batches,
    val_windows,
)

import skipreduce_jax as sr  # noqa: E402
import skipreduce_jax.nnx as srnnx  # noqa: E402

AXES = ("replica", "fsdp", "tensor")
REPLICA = AXES[0]
VARIANTS = ("allreduce", "random", "selective")
LABELS = {
    "allreduce": "all-reduce (pmean)",
    "random": "Random SkipReduce",
    "selective": "Selective (embeddings, LayerNorm full)",
}
# Module names of the embeddings and LayerNorms, for sr.exclude.
SELECTIVE_EXCLUDE = ("embed", "ln_")
_KINDS = "collective-permute|all-gather|reduce-scatter|all-reduce|all-to-all"
_COLLECTIVE = re.compile(rf"=\s*\S.*?\s({_KINDS})(-start)?\(")


# ----------------------------------------------------------------------------
# Model: the parameters carry their layout (nnx.with_partitioning).
# ----------------------------------------------------------------------------


def _sharded(init: Any, *axes: str | None) -> Any:
    return nnx.with_partitioning(init, axes)


class Block(nnx.Module):
    """Pre-LayerNorm block: causal self-attention, then an MLP.

    Kernels are sharded over ``("fsdp", "tensor")`` (into the block) or
    ``("tensor", "fsdp")`` (out of it), the biases into the block over
    ``tensor``; the LayerNorms and the output biases are replicated.
    """

    def __init__(self, width: int, heads: int, rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        zeros = nnx.initializers.zeros
        into = dict(kernel_init=_sharded(normal, "fsdp", "tensor"),
                    bias_init=_sharded(zeros, "tensor"), rngs=rngs)
        out = dict(kernel_init=_sharded(normal, "tensor", "fsdp"), rngs=rngs)
        self.heads = heads
        self.ln_attn = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, **into)
        self.proj = nnx.Linear(width, width, **out)
        self.ln_mlp = nnx.LayerNorm(width, rngs=rngs)
        self.fc = nnx.Linear(width, 4 * width, **into)
        self.out = nnx.Linear(4 * width, width, **out)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        qkv = self.qkv(self.ln_attn(x))
        q, k, v = jnp.split(qkv.reshape(batch, length, 3 * self.heads, -1), 3, axis=2)
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(h.reshape(batch, length, width))
        return x + self.out(nnx.gelu(self.fc(self.ln_mlp(x))))


class ByteTransformer(nnx.Module):
    """Decoder-only transformer over bytes, output head tied to the embedding.

    Parameters: ``tok_embed`` (vocabulary over ``fsdp``, width over
    ``tensor``), ``pos_embed`` (width over ``tensor``), ``blocks`` and
    ``ln_final``.
    """

    def __init__(self, width: int, layers: int, heads: int, max_len: int,
                 rngs: nnx.Rngs):
        normal = nnx.initializers.normal(0.02)
        self.tok_embed = nnx.Embed(VOCAB_SIZE, width, rngs=rngs,
                                   embedding_init=_sharded(normal, "fsdp", "tensor"))
        # Positions over fsdp too abort XLA's partitioner inside the step (a
        # partial-manual shard_map; jax 0.10.2): their width over tensor only.
        self.pos_embed = nnx.Param(
            _sharded(normal, None, "tensor")(rngs.params(), (max_len, width)))
        self.blocks = nnx.List([Block(width, heads, rngs) for _ in range(layers)])
        self.ln_final = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tok_embed(tokens) + self.pos_embed[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.tok_embed.attend(self.ln_final(x))


def lm_loss(model: ByteTransformer, tokens: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) over ``tokens[:, 1:]``."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# ----------------------------------------------------------------------------
# Set-up.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run; see ``--help`` for the meanings."""

    mesh: tuple[int, int, int] = (2, 2, 2)
    steps: int = 150
    batch: int = 16
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 15
    weight_decay: float = 0.1
    skip_ratio: float = 0.5
    min_size: int = 0
    eval_every: int = 25
    val_windows: int = 64
    train_mb: float = 1.0
    val_mb: float = 0.125
    check_steps: int = 5
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS


def make_mesh(shape: Sequence[int]) -> jax.sharding.Mesh:
    """A ``(replica, fsdp, tensor)`` mesh (Auto axes: GSPMD code as it is)."""
    count = math.prod(shape)
    devices = jax.devices()
    if len(devices) < count:  # e.g. one accelerator: the simulated CPUs
        devices = jax.devices("cpu")
    return jax.make_mesh(tuple(shape), AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices[:count])


@nnx.jit(static_argnums=0)
def _create(config: Config) -> ByteTransformer:
    model = ByteTransformer(config.d_model, config.layers, config.heads,
                            config.seq_len, nnx.Rngs(config.seed))
    state = nnx.state(model)
    nnx.update(model, lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return model


def create_model(config: Config, mesh: jax.sharding.Mesh) -> ByteTransformer:
    """The model, its parameters created sharded as annotated.

    The NNX pattern: under ``jax.set_mesh``, a jitted constructor constrains
    the state to ``nnx.get_partition_spec`` of its annotations.
    """
    with jax.set_mesh(mesh):
        return _create(config)


def reduce_kwargs(variant: str, config: Config) -> dict[str, Any]:
    """The :func:`skipreduce_jax.skip_reduce` arguments of one variant.

    Those of ``train_lm.py``, except that Selective also fully reduces the
    LayerNorms.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}.")
    kwargs = train_lm.reduce_kwargs("random" if variant == "selective" else variant, config)
    if variant == "selective":
        kwargs["selective"] = sr.exclude(*SELECTIVE_EXCLUDE)
    return kwargs


def _train_step(model: ByteTransformer, optimizer: nnx.Optimizer,
                tokens: jax.Array) -> jax.Array:
    # One replica's rows; skip_reduce inside optimizer.update averages.
    loss, grads = srnnx.local_value_and_grad(lm_loss, REPLICA)(model, tokens)
    optimizer.update(model, grads)
    return lax.pmean(loss, REPLICA)


def make_train_step(mesh: jax.sharding.Mesh) -> Any:
    """``step(model, optimizer, tokens) -> loss``, updating both in place."""
    return srnnx.data_parallel(_train_step, mesh, REPLICA, batch_argnums=2,
                               donate_argnums=(0, 1))


def gspmd_step(model: ByteTransformer, tx: optax.GradientTransformation,
               mesh: jax.sharding.Mesh) -> tuple[Any, Any, Any]:
    """XLA's own step: plain ``jax.jit`` of the whole batch (GSPMD).

    Returns:
      ``(step, params, opt_state)``, ``step(params, opt_state, tokens) ->
      (params, opt_state, loss)`` on the pure ``nnx.Param`` state; tokens
      sharded over ``replica``.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, tokens):
        return lm_loss(nnx.merge(graphdef, params, rest, copy=True), tokens)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        opt_state = jax.jit(tx.init)(params)
    return step, params, opt_state


@jax.jit
def _eval_loss(state: Any, tokens: jax.Array) -> jax.Array:
    return lm_loss(nnx.merge(*state), tokens)


def evaluate(model: ByteTransformer, tokens: np.ndarray, mesh: jax.sharding.Mesh
             ) -> float:
    """The mean loss of ``model`` on ``tokens`` (plain GSPMD ``jax.jit``)."""
    with jax.set_mesh(mesh):
        return float(_eval_loss(nnx.split(model), tokens))


# ----------------------------------------------------------------------------
# Accounting: bytes on each device, bytes sent over the replica axis.
# ----------------------------------------------------------------------------


def device_bytes(tree: Any) -> dict[str, int]:
    """Bytes of ``tree`` on one device (its shards) and in the replicated layout."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "addressable_shards")]
    local = [max(s.data.nbytes for s in x.addressable_shards) for x in leaves]
    return dict(per_device=int(sum(local)),
                replicated=int(sum(x.nbytes for x in leaves)),
                sharded_leaves=sum(a < x.nbytes for a, x in zip(local, leaves, strict=True)),
                leaves=len(leaves))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(line: str, kind: str, devices: int) -> list[list[int]]:
    """The device groups of a compiled collective (device ids, not replicas)."""
    if kind == "collective-permute":
        pairs = line.split("source_target_pairs=", 1)[1]
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)
                if a != b]
    text = line.split("replica_groups=", 1)[1]
    if ("channel_id=" in line and "use_global_device_ids=true" not in line
            and kind != "all-to-all"):
        return [list(range(devices))]  # groups of replicas, across every partition
    if text.startswith("{"):
        listed = re.match(r"\{((?:\{[\d,]*\},?)*)\}", text).group(1)
        groups = [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", listed)]
        return groups or [list(range(devices))]
    iota = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if iota:
        return _iota(iota.group(3), iota.group(4)).reshape(
            int(iota.group(1)), int(iota.group(2))).tolist()
    mesh = re.match(r"mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?"
                    r"\s*\{([^}]*)\}", text)
    if mesh is None or ":" in mesh.group(4):
        raise ValueError(f"replica groups not understood: {line.strip()[:200]}")
    axes = re.findall(r"'([^']*)'=(\d+)", mesh.group(1))
    sizes = [int(s) for _, s in axes]
    ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2)
           else np.arange(math.prod(sizes))).reshape(sizes)
    spanned = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in mesh.group(4)]
    kept = [i for i in range(len(axes)) if i not in spanned]
    span = math.prod(sizes[i] for i in spanned)
    return ids.transpose(kept + spanned).reshape(-1, span).tolist()


def traffic_by_axis(text: str, mesh: jax.sharding.Mesh,
                    axis: str = REPLICA) -> dict[str, float]:
    """Bytes each device sends per step, by the mesh axes an op's groups span.

    Every collective of the compiled ``text`` is put in one class: over
    ``axis`` only (its groups differ only in that coordinate), over other
    axes only, or ``mixed``; each class's bytes are
    :func:`skipreduce_jax.collective_traffic` of the program with the other
    classes' collectives left out (loop trip counts still apply). On a
    ``(2, 2, 2)`` mesh every axis has groups of 2: the groups' members, not
    their sizes, tell the axes apart.
    """
    coords = np.stack(np.unravel_index(np.arange(mesh.size), mesh.devices.shape), 1)
    classes = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        spanned = set()
        for group in _groups(line, match.group(1), mesh.size):
            varying = np.ptp(coords[group], axis=0) > 0
            spanned |= {mesh.axis_names[j] for j in np.flatnonzero(varying)}
        classes[i] = ("mixed" if axis in spanned and len(spanned) > 1
                      else axis if axis in spanned else "other")
    out = {}
    for name in (axis, "other", "mixed"):
        kept = [line for i, line in enumerate(lines) if classes.get(i, name) == name]
        out[name] = sr.collective_traffic("\n".join(kept)).bytes_per_device()
    out["total"] = sr.collective_traffic(text).bytes_per_device()
    return out


def local_shapes(model: ByteTransformer) -> Any:
    """The params as ``ShapeDtypeStruct`` s of one device's shards."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.addressable_shards[0].data.shape, x.dtype),
        nnx.state(model, nnx.Param))


# ----------------------------------------------------------------------------
# Training.
# ----------------------------------------------------------------------------


def train_variant(variant: str, config: Config, mesh: jax.sharding.Mesh,
                  corpus: Any, val_tokens: np.ndarray) -> dict[str, Any]:
    """Trains one variant from the shared initialisation; returns its record.

    Returns:
      A dict with ``evals`` (``[step, val_loss]``), ``train_loss`` (per
      step), ``final_val_loss``, ``bytes`` (:func:`traffic_by_axis` of the
      compiled step), ``expected_replica_bytes``
      (:func:`skipreduce_jax.comm_stats` of the local shards, plus the loss
      ``pmean``), ``params_kept`` (every param still laid out as annotated)
      and ``seconds``.
    """
    n = mesh.shape[REPLICA]
    kwargs = reduce_kwargs(variant, config)
    tx = make_optimizer(config, sr.skip_reduce(REPLICA, **kwargs))
    start = time.perf_counter()
    model = create_model(config, mesh)
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    optimizer = srnnx.init_optimizer(model, tx, mesh, REPLICA)
    step = make_train_step(mesh)
    batches = train_batches(corpus.train, config.steps, config.batch,
                            config.seq_len, config.seed)
    first = next(batches)
    text = step.lower(model, optimizer, first).compile().as_text()
    comm = sr.comm_stats(local_shapes(model), n, **kwargs)
    evals, losses = [[0, evaluate(model, val_tokens, mesh)]], []
    for i, tokens in enumerate(itertools.chain([first], batches), start=1):
        losses.append(float(step(model, optimizer, tokens)))
        if i % config.eval_every == 0 or i == config.steps:
            evals.append([i, evaluate(model, val_tokens, mesh)])
            print(f"  [{variant:>9}] step {i:4d}  train {np.mean(losses[-config.eval_every:]):.4f}"
                  f"  val {evals[-1][1]:.4f} nats/byte", flush=True)
    kept = all(v.sharding.spec == s for v, s in zip(
        jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)),
        jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P)), strict=True))
    return dict(
        label=LABELS[variant],
        reduce_kwargs={k: (v if k != "selective" else f"exclude{SELECTIVE_EXCLUDE}")
                       for k, v in kwargs.items()},
        evals=evals, train_loss=losses, final_val_loss=evals[-1][1],
        bytes=traffic_by_axis(text, mesh),
        expected_replica_bytes=comm.bytes_per_device + sr_loss_bytes(n),
        num_skip=comm.num_skip, params_kept=kept,
        seconds=time.perf_counter() - start)


def sr_loss_bytes(n: int) -> float:
    """Bytes per device of the step's loss ``pmean`` (one f32) over ``n`` ranks."""
    return 2 * (n - 1) / n * 4


def gspmd_reference(config: Config, mesh: jax.sharding.Mesh, corpus: Any
                    ) -> dict[str, Any]:
    """XLA's own step: its bytes, and its losses for ``check_steps`` steps."""
    tx = make_optimizer(config, optax.identity())
    step, params, opt_state = gspmd_step(create_model(config, mesh), tx, mesh)
    tokens = [jax.device_put(t, NamedSharding(mesh, P(REPLICA))) for t in train_batches(
        corpus.train, max(config.check_steps, 1), config.batch, config.seq_len, config.seed)]
    with jax.set_mesh(mesh):
        text = step.lower(params, opt_state, tokens[0]).compile().as_text()
        losses = []
        for batch in tokens[:config.check_steps]:
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
    return dict(bytes=traffic_by_axis(text, mesh), train_loss=losses)


def run(config: Config) -> dict[str, Any]:
    """Loads the data, trains every variant and XLA's reference step.

    Returns:
      A JSON-serialisable dict: ``config``, ``setup`` (mesh, parameter and
      per-device bytes), ``gspmd`` (:func:`gspmd_reference`) and
      ``results`` (per variant, :func:`train_variant`).
    """
    mesh = make_mesh(config.mesh)
    corpus = load_corpus(int(config.train_mb * 2**20), int(config.val_mb * 2**20))
    val_tokens = val_windows(corpus.val, config.seq_len, config.val_windows,
                             mesh.shape[REPLICA])
    model = create_model(config, mesh)
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    setup = dict(
        mesh=dict(mesh.shape), platform=mesh.devices.flat[0].platform,
        parameters=int(sum(x.size for _, x in leaves)),
        param_bytes=device_bytes(params),
        specs={jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in leaves},
        train_bytes=int(len(corpus.train)), val_windows=int(len(val_tokens)))
    gspmd = gspmd_reference(config, mesh, corpus)
    results = {v: train_variant(v, config, mesh, corpus, val_tokens)
               for v in config.variants}
    return dict(config=dataclasses.asdict(config), setup=setup, gspmd=gspmd,
                results=results)


# ----------------------------------------------------------------------------
# Reporting.
# ----------------------------------------------------------------------------


def results_table(report: dict[str, Any]) -> str:
    """Bytes over the replica axis and validation loss, per variant."""
    gspmd = report["gspmd"]["bytes"]
    rows = [["XLA's GSPMD step (jax.jit)", "-", "-", f"{gspmd[REPLICA] / 1e3:.1f}",
             "-", "1.000", f"{gspmd['other'] / 1e3:.1f}"]]
    base = report["results"].get("allreduce")
    for r in report["results"].values():
        b = r["bytes"]
        delta = f"{r['final_val_loss'] - base['final_val_loss']:+.4f}" if base else "-"
        rows.append([r["label"], f"{r['final_val_loss']:.4f}", delta,
                     f"{b[REPLICA] / 1e3:.1f}", f"{r['expected_replica_bytes'] / 1e3:.1f}",
                     f"{b[REPLICA] / gspmd[REPLICA]:.3f}", f"{b['other'] / 1e3:.1f}"])
    headers = ["step", "val loss", "vs all-reduce", "replica kB/device",
               "formula kB", "vs XLA", "fsdp/tensor kB"]
    return _common.format_table(headers, rows)


def plot(report: dict[str, Any], path: Path) -> None:
    """Validation loss per step, and bytes over the replica axis per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, bytes_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, sent = ["XLA GSPMD"], [report["gspmd"]["bytes"][REPLICA]]
    for r in report["results"].values():
        steps, vals = zip(*r["evals"], strict=True)
        loss_ax.plot(steps, vals, marker="o", markersize=3, label=r["label"])
        names.append(r["label"].split(" (")[0])
        sent.append(r["bytes"][REPLICA])
    mesh = report["setup"]["mesh"]
    loss_ax.set_title(f"byte-level NNX LM, mesh {mesh}", fontsize=10)
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("validation loss (nats/byte)")
    loss_ax.legend(fontsize=8)
    loss_ax.grid(alpha=0.3)
    bytes_ax.bar(range(len(sent)), np.asarray(sent) / 1e3)
    bytes_ax.set_xticks(range(len(sent)), names, fontsize=8, rotation=15)
    bytes_ax.set_ylabel("kB per device per step over 'replica'")
    bytes_ax.set_title("read from the compiled steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, Path]:
    """Parses the command line into a :class:`Config` and the output directory."""
    d = Config()
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--mesh", default=",".join(map(str, d.mesh)),
        help="replica,fsdp,tensor sizes (their product: the devices used)")
    add("--steps", type=int, default=d.steps, help="training steps per variant")
    add("--batch", type=int, default=d.batch, help="global batch (sequences)")
    add("--seq-len", type=int, default=d.seq_len, help="bytes per sequence")
    add("--d-model", type=int, default=d.d_model, help="model width")
    add("--layers", type=int, default=d.layers, help="transformer blocks")
    add("--heads", type=int, default=d.heads, help="attention heads")
    add("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    add("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    add("--skip-ratio", type=float, default=d.skip_ratio,
        help="fraction of the N-1 reduce-scatter steps skipped")
    add("--min-size", type=int, default=d.min_size,
        help="leaves with fewer elements always get a full all-reduce")
    add("--eval-every", type=int, default=d.eval_every, help="steps between evaluations")
    add("--val-windows", type=int, default=d.val_windows, help="validation sequences (at most)")
    add("--train-mb", type=float, default=d.train_mb, help="training text, MiB")
    add("--val-mb", type=float, default=d.val_mb, help="validation text, MiB")
    add("--check-steps", type=int, default=d.check_steps,
        help="steps of XLA's GSPMD step, to compare with the all-reduce's losses")
    add("--variants", default=",".join(d.variants),
        help=f"comma-separated subset of {','.join(VARIANTS)}")
    add("--seed", type=int, default=d.seed, help="init, batch order and SkipReduce seed")
    add("--out", type=Path, default=Path("out"), help="output directory")
    args = parser.parse_args(argv)
    try:
        mesh = tuple(int(s) for s in args.mesh.split(","))
    except ValueError:
        mesh = ()
    if len(mesh) != 3 or min(mesh) < 1:
        parser.error(f"--mesh {args.mesh}: give three positive sizes, e.g. 2,2,2")
    if math.prod(mesh) > max(len(jax.devices()), len(jax.devices("cpu"))):
        parser.error(f"--mesh {args.mesh} needs {math.prod(mesh)} devices")
    for name in ("steps", "batch", "seq_len", "d_model", "layers", "heads",
                 "eval_every", "val_windows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    if args.batch % mesh[0]:
        parser.error(f"--batch {args.batch} must divide by the replica size {mesh[0]}")
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.min_size < 0 or args.warmup < 0 or args.check_steps < 0:
        parser.error("--min-size, --warmup and --check-steps must be >= 0")
    if not 0.0 <= args.skip_ratio <= 1.0:
        parser.error("--skip-ratio must be in [0, 1]")
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not variants or set(variants) - set(VARIANTS) or len(set(variants)) != len(variants):
        parser.error(f"--variants: distinct names from {','.join(VARIANTS)}")
    return Config(
        mesh=mesh, steps=args.steps, batch=args.batch, seq_len=args.seq_len,
        d_model=args.d_model, layers=args.layers, heads=args.heads, lr=args.lr,
        warmup=args.warmup, skip_ratio=args.skip_ratio, min_size=args.min_size,
        eval_every=args.eval_every, val_windows=args.val_windows,
        train_mb=args.train_mb, val_mb=args.val_mb, check_steps=args.check_steps,
        seed=args.seed, variants=variants), args.out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the comparison, prints the tables and writes JSON and PNG.

    Args:
      argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
      The report written to ``sharded.json``.
    """
    config, out = parse_args(argv)
    start = time.perf_counter()
    report = run(config)
    report["wall_seconds"] = time.perf_counter() - start
    setup, pb = report["setup"], report["setup"]["param_bytes"]
    print(f"\nmesh {setup['mesh']} ({setup['platform']}), {setup['parameters']:,} "
          f"parameters; each device holds {pb['per_device']:,} of their "
          f"{pb['replicated']:,} bytes ({pb['per_device'] / pb['replicated']:.3f} of "
          f"the replicated layout; {pb['sharded_leaves']} of {pb['leaves']} leaves sharded)")
    print(results_table(report))
    mixed = {k: r["bytes"]["mixed"] for k, r in [("gspmd", report["gspmd"]),
                                                  *report["results"].items()]}
    if any(mixed.values()):
        print(f"bytes of collectives over replica and other axes at once: {mixed}")
    if "allreduce" in report["results"] and config.check_steps:
        ours = report["results"]["allreduce"]["train_loss"][:config.check_steps]
        ref = report["gspmd"]["train_loss"]
        print(f"all-reduce vs XLA's GSPMD step, first {len(ref)} losses: max |diff| "
              f"{max(abs(a - b) for a, b in zip(ours, ref, strict=True)):.2e}")
    print(f"total wall time {report['wall_seconds']:.1f} s")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "sharded.png")
    print(f"wrote {out / 'sharded.json'} and {out / 'sharded.png'}")
    return report


if __name__ == "__main__":
    main()
