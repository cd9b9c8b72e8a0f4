"""Adopting SkipReduce in a production-style pjit loop: a partitioned linen LM.

A decoder-only byte-level Transformer (the corpus of ``train_lm.py``: Python
standard-library source, read offline) written the way large linen LMs are:

- every kernel is a ``DenseGeneral`` with multi-dimensional features (the
  attention's ``(heads, head_dim)``), annotated with
  ``nn.with_logical_partitioning``; logical axis rules map ``"embed"`` to
  the ``"fsdp"`` mesh axis, and ``nn.logical_to_mesh_sharding`` turns the
  annotations into the state's shardings;
- a flax ``TrainState`` whose optimizer is ``optax.MultiSteps`` (gradient
  accumulation over ``--accum`` micro-steps), with metrics read from
  ``state.opt_state`` (``gradient_step``, the norm of ``acc_grads``);
- ``jax.jit(step, in_shardings=..., out_shardings=..., donate_argnames=...)``
  with ``with_sharding_constraint(batch, NamedSharding(mesh, P(...)))`` in
  the step;
- a token-weighted loss over padded windows (``linen_lm.padded_batches``):
  the summed token losses divided by the batch's token count.

``--mesh hsdp`` trains on a ``(replica=4, fsdp=2)`` mesh (parameters
sharded over ``"fsdp"``, replicated over ``"replica"``, the batch split over
both), ``--mesh dp`` on one ``replica`` axis of 8 devices, ``--mesh one`` on
a single device (an accelerator where there is one; no ring, so the two steps
agree). The file holds the step twice, so that the two can be compared line
by line:

:func:`plain_step`
    What the loop does today: ``jax.value_and_grad`` on the global batch;
    XLA inserts the gradient all-reduce.
:func:`skipreduce_step`
    The same step with ``skipreduce_jax.value_and_grad`` over ``"replica"``
    in place of ``jax.value_and_grad`` (Random SkipReduce at
    ``--skip-ratio``, the key from ``state.step``), and the token count
    through ``skipreduce_jax.mean_count``: each rank sees its rows of the
    batch, and a loss divided by that rank's own count would weight its
    tokens by the wrong normaliser whenever the ranks hold different
    numbers of real tokens. ``param_specs=shardings.params`` (the params'
    part of ``in_shardings``) lets the ring run on each device's ``"fsdp"``
    shards: Auto axes do not carry the layout inside ``jax.jit``. Three
    lines differ, and the import.

Everything else (model, state, shardings, ``MultiSteps``, metrics, loop) is
shared. Each micro-step's gradients are reduced once (``MultiSteps`` then
accumulates the reduced gradients)::

    python examples/pjit_lm.py
    python examples/pjit_lm.py --mesh dp --steps 200

It prints training loss, accuracy and validation loss during training, and a
table at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import _common

_common.simulate_cpu_devices(8)  # before jax initialises

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from linen_lm import padded_batches  # noqa: E402
from train_lm import VOCAB_SIZE, load_corpus, val_windows  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

VARIANTS = ("plain", "skipreduce")
LABELS = {"plain": "jax.jit, XLA all-reduce", "skipreduce": "Random SkipReduce"}
MESHES = {"hsdp": {"replica": 4, "fsdp": 2}, "dp": {"replica": 8}, "one": {"replica": 1}}


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run; see ``--help`` for the meanings."""

    mesh: str = "hsdp"
    steps: int = 120
    accum: int = 2
    batch_per_device: int = 2
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    dropout: float = 0.1
    skip_ratio: float = 0.5
    min_size: int = 1024
    eval_every: int = 20
    val_windows: int = 128
    train_mb: float = 1.0
    val_mb: float = 0.0625
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS

    @property
    def skip_options(self) -> dict[str, Any]:
        """:func:`skipreduce_jax.skip_reduce`'s options of this run."""
        return dict(skip_ratio=self.skip_ratio, min_size=self.min_size, seed=self.seed)


HELP = {
    "mesh": "hsdp: (replica=4, fsdp=2); dp: (replica=8); one: (replica=1), one device",
    "steps": "micro-steps (optimizer updates: steps / accum)",
    "accum": "micro-steps accumulated per update (optax.MultiSteps)",
    "batch_per_device": "windows per device per micro-step",
    "skip_ratio": "fraction of the replica ring's reduce-scatter steps skipped",
    "min_size": "leaves with fewer elements always get a full all-reduce",
    "dropout": "dropout rate in training (embeddings, attention and MLP outputs)",
}


# ----------------------------------------------------------------------------
# The model: DenseGeneral kernels with logical partitioning annotations.
# ----------------------------------------------------------------------------


def logical_rules(mesh: jax.sharding.Mesh) -> tuple[tuple[str, Any], ...]:
    """Logical axis -> mesh axis: the batch over every axis, ``embed`` over ``fsdp``."""
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    return (("batch", mesh.axis_names), ("embed", fsdp), ("vocab", None),
            ("length", None), ("heads", None), ("kv", None), ("mlp", None))


def _dense(features: int | tuple[int, ...], names: tuple[str, ...], axis: Any = -1,
           use_bias: bool = True, name: str | None = None) -> nn.DenseGeneral:
    init = nn.initializers.normal(0.02)
    return nn.DenseGeneral(
        features, axis=axis, use_bias=use_bias, name=name,
        kernel_init=nn.with_logical_partitioning(init, names),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, names[-1:]))


def _layer_norm(name: str) -> nn.LayerNorm:
    return nn.LayerNorm(name=name,
                        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class Block(nn.Module):
    """Pre-LayerNorm block: causal self-attention, then an MLP.

    The query, key and value kernels are ``(embed, heads, kv)``, the output
    projection ``(heads, kv, embed)``; the projections have no bias.

    Attributes:
      num_heads: attention heads (``d_model`` must be a multiple).
      mlp_ratio: MLP hidden width as a multiple of ``d_model``.
    """

    num_heads: int
    mlp_ratio: int = 4
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        drop = nn.Dropout(self.dropout_rate, deterministic=not train)
        width = x.shape[-1]
        heads = (self.num_heads, width // self.num_heads)
        h = _layer_norm("ln_attn")(x)
        q, k, v = (_dense(heads, ("embed", "heads", "kv"), use_bias=False, name=name)(h)
                   for name in ("query", "key", "value"))
        h = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + drop(_dense(width, ("heads", "kv", "embed"), axis=(-2, -1), use_bias=False,
                            name="out")(h))
        h = _layer_norm("ln_mlp")(x)
        h = nn.gelu(_dense(self.mlp_ratio * width, ("embed", "mlp"), name="fc")(h))
        return x + drop(_dense(width, ("mlp", "embed"), name="proj")(h))


class LM(nn.Module):
    """Decoder-only Transformer over bytes, the output head tied to the embedding.

    Attributes:
      d_model: model width.
      num_layers: transformer blocks.
      num_heads: attention heads per block.
      max_len: longest input sequence.
      dropout_rate: dropout in training (``train=True``, an rng named "dropout").
    """

    d_model: int
    num_layers: int
    num_heads: int
    max_len: int
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(VOCAB_SIZE, self.d_model, name="tok_embed",
                         embedding_init=nn.with_logical_partitioning(init, ("vocab", "embed")))
        pos = self.param("pos_embed", nn.with_logical_partitioning(init, ("length", "embed")),
                         (self.max_len, self.d_model))
        # A one-hot product, not embed(tokens)'s gather: with the table over
        # "fsdp" and the batch over every axis, the gather's gradient makes
        # GSPMD rematerialise the activations in full.
        table = embed.embedding
        x = jax.nn.one_hot(tokens, VOCAB_SIZE, dtype=table.dtype) @ table
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x + pos[:tokens.shape[1]])
        for i in range(self.num_layers):
            x = Block(self.num_heads, dropout_rate=self.dropout_rate, name=f"block_{i}")(x, train)
        return embed.attend(_layer_norm("ln_final")(x))


def token_loss(logits: jax.Array, batch: tuple[jax.Array, jax.Array],
               tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed next-byte cross-entropy of the real targets over ``tokens``.

    Args:
      logits: the model's output on ``windows[:, :-1]``.
      batch: ``(windows, weights)``: int32 ``(batch, seq_len + 1)`` and
        float32 ``(batch, seq_len)``, 1 where a target is real.
      tokens: the normaliser, the number of real targets.

    Returns:
      ``(loss, accuracy)``, both weighted sums over ``tokens``.
    """
    windows, weights = batch
    logits = logits.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:])
    correct = logits.argmax(-1) == windows[:, 1:]
    return jnp.sum(losses * weights) / tokens, jnp.sum(correct * weights) / tokens


def step_metrics(state: train_state.TrainState, loss: jax.Array,
                 accuracy: jax.Array) -> dict[str, jax.Array]:
    """The loss and accuracy, and what ``optax.MultiSteps`` holds."""
    return {"loss": loss, "accuracy": accuracy,
            "gradient_step": state.opt_state.gradient_step,
            "acc_grads_norm": optax.tree.norm(state.opt_state.acc_grads)}


# ----------------------------------------------------------------------------
# The two steps: the only lines that differ.
# ----------------------------------------------------------------------------


def plain_step(state, batch, *, mesh, config, sr_options):
    """One micro-step on the global batch; XLA all-reduces the gradients.

    ``mesh``, ``config`` and ``sr_options`` are the loop's, given to both
    steps alike. Dropout draws its mask from a key folded with the step.
    """
    batch = lax.with_sharding_constraint(batch, NamedSharding(mesh, P(mesh.axis_names)))
    rngs = {"dropout": jax.random.fold_in(jax.random.key(config.seed), state.step)}

    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch[0][:, :-1], train=True, rngs=rngs)
        return token_loss(logits, batch, jnp.sum(batch[1]))

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, accuracy), grads = grad_fn(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, step_metrics(state, loss, accuracy)


def skipreduce_step(state, batch, *, mesh, config, sr_options):
    """The same micro-step; SkipReduce sums the gradients over ``"replica"``.

    ``sr_options`` (:func:`compile_step`): the mesh, the data axis, the skip
    settings and ``param_specs``, the params' part of ``in_shardings``, which
    tells the ring how the params lie over ``"fsdp"`` (Auto axes do not say
    so inside ``jax.jit``), so that it runs on each device's shards.
    """
    batch = lax.with_sharding_constraint(batch, NamedSharding(mesh, P(mesh.axis_names)))
    rngs = {"dropout": jax.random.fold_in(jax.random.key(config.seed), state.step)}

    def loss_fn(params, batch):
        logits = state.apply_fn({"params": params}, batch[0][:, :-1], train=True, rngs=rngs)
        return token_loss(logits, batch, jnp.sum(batch[1]))

    grad_fn = sr.value_and_grad(loss_fn, step=state.step, has_aux=True, **sr_options)
    (loss, accuracy), grads = grad_fn(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, step_metrics(state, loss, accuracy)


STEPS = {"plain": plain_step, "skipreduce": skipreduce_step}


# ----------------------------------------------------------------------------
# State, shardings and the jitted step, the same for both.
# ----------------------------------------------------------------------------


def make_mesh(config: Config) -> jax.sharding.Mesh:
    """The ``--mesh`` layout, Auto axes (GSPMD places the rest).

    Its devices are the first of the default platform (an accelerator), or
    the simulated CPU devices where there are too few of those.
    """
    shape = MESHES[config.mesh]
    size = math.prod(shape.values())
    devices = jax.devices()
    if len(devices) < size:
        devices = jax.devices("cpu")
    return jax.make_mesh(tuple(shape.values()), tuple(shape), devices=devices[:size],
                         axis_types=(AxisType.Auto,) * len(shape))


def make_model(config: Config) -> LM:
    """The model of ``config``."""
    return LM(config.d_model, config.layers, config.heads, config.seq_len, config.dropout)


def create_state(model: LM, tx: optax.GradientTransformation, key: jax.Array,
                 seq_len: int) -> train_state.TrainState:
    """A ``TrainState`` of ``model``'s boxed (logically partitioned) params."""
    params = model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def init_state(config: Config, mesh: jax.sharding.Mesh
               ) -> tuple[train_state.TrainState, Any]:
    """The initial state, placed by the logical rules, and its shardings.

    The optimizer is AdamW in ``optax.MultiSteps``. The state is built once
    abstractly to read its annotations: the params, the AdamW moments and
    the accumulated gradients all take their leaf's mesh sharding. The real
    state is then created in place, unboxed.
    """
    tx = optax.MultiSteps(optax.adamw(config.lr), every_k_schedule=config.accum)
    create = functools.partial(create_state, make_model(config), tx, seq_len=config.seq_len)
    key = jax.random.key(config.seed)
    abstract = jax.eval_shape(create, key)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh,
                                            logical_rules(mesh))
    state = jax.jit(lambda key: nn.unbox(create(key)), out_shardings=shardings)(key)
    return state, shardings


def compile_step(variant: str, config: Config, mesh: jax.sharding.Mesh, shardings: Any,
                 **options: Any):
    """``jax.jit`` of a step with the state's shardings; the state is donated.

    ``options``: more of ``sr.value_and_grad``'s, e.g. ``check=False``.
    """
    batch = NamedSharding(mesh, P(mesh.axis_names))
    sr_options = dict(mesh=mesh, axis_name="replica", param_specs=shardings.params,
                      **config.skip_options, **options)
    step = functools.partial(STEPS[variant], mesh=mesh, config=config, sr_options=sr_options)
    return jax.jit(step, in_shardings=(shardings, batch),
                   out_shardings=(shardings, NamedSharding(mesh, P())),
                   donate_argnames="state")


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


def train(variant: str, config: Config, corpus: Any) -> dict[str, Any]:
    """Trains one variant from the shared initialisation and batches.

    Args:
      variant: one of :data:`VARIANTS`.
      config: the run configuration.
      corpus: ``train_lm.load_corpus``'s bytes.

    Returns:
      A dict: ``history`` (``[step, train loss, train accuracy, val loss]``
      per evaluation), ``val_loss`` (nats per byte), ``gradient_steps``
      (optimizer updates) and ``seconds``.
    """
    start = time.perf_counter()
    mesh = make_mesh(config)
    state, shardings = init_state(config, mesh)
    train_step = compile_step(variant, config, mesh, shardings)
    val = val_windows(corpus.val, config.seq_len, config.val_windows, mesh.size)
    model = make_model(config)
    evaluate = jax.jit(
        lambda params, windows: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": params}, windows[:, :-1]), windows[:, 1:]).mean(),
        in_shardings=(shardings.params, NamedSharding(mesh, P(mesh.axis_names))))
    history, seen = [], []
    for step, batch in enumerate(padded_batches(
            corpus.train, config, mesh.size * config.batch_per_device), 1):
        state, metrics = train_step(state, batch)
        seen.append(metrics)
        if step % config.eval_every and step != config.steps:
            continue
        mean = {k: float(np.mean([m[k] for m in seen])) for k in ("loss", "accuracy")}
        val_loss = float(evaluate(state.params, val))
        seen = []
        history.append([step, mean["loss"], mean["accuracy"], val_loss])
        print(f"  [{variant:>10}] step {step:4d} (update {int(metrics['gradient_step']):3d})  "
              f"train loss {mean['loss']:.4f} acc {mean['accuracy']:.3f}  "
              f"val {val_loss:.4f} nats/byte = {val_loss / math.log(2):.4f} bits/byte",
              flush=True)
    return dict(history=history, val_loss=history[-1][3],
                gradient_steps=int(state.opt_state.gradient_step),
                seconds=time.perf_counter() - start)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parses the command line into a :class:`Config` (``--help``: the fields)."""
    config, parser = _common.parse_config(
        Config(), argv, __doc__.split("\n\n")[0], variants=VARIANTS, helps=HELP)
    if config.mesh not in MESHES:
        parser.error(f"--mesh: choose from {','.join(MESHES)}")
    if min(config.steps, config.accum, config.batch_per_device, config.seq_len,
           config.d_model, config.layers, config.heads, config.eval_every,
           config.val_windows) < 1:
        parser.error("every size and count must be >= 1")
    fsdp = MESHES[config.mesh].get("fsdp", 1)
    if config.d_model % config.heads or config.d_model % fsdp:
        parser.error(f"--d-model {config.d_model} must be a multiple of --heads "
                     f"{config.heads} and of the fsdp axis ({fsdp})")
    if config.skip_ratio > 1.0:
        parser.error("--skip-ratio must be in [0, 1]")
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Trains every variant and prints a table; returns the results by name."""
    config = parse_args(argv)
    corpus = load_corpus(int(config.train_mb * 2**20), int(config.val_mb * 2**20))
    results = {variant: train(variant, config, corpus) for variant in config.variants}
    replicas = MESHES[config.mesh]["replica"]
    create = functools.partial(create_state, make_model(config), optax.sgd(0.0),
                               seq_len=config.seq_len)
    params = jax.eval_shape(lambda key: nn.unbox(create(key).params), jax.random.key(0))
    comm = sr.comm_stats(params, replicas, skip_ratio=config.skip_ratio,
                         min_size=config.min_size)
    rows = [[LABELS[v], f"{r['val_loss']:.4f}", f"{r['val_loss'] / math.log(2):.4f}",
             "1.000" if v == "plain" else f"{comm.ratio:.3f}", str(r["gradient_steps"]),
             f"{r['seconds']:.1f}"] for v, r in results.items()]
    windows = math.prod(MESHES[config.mesh].values()) * config.batch_per_device
    print(f"\nmesh {MESHES[config.mesh]}, {config.steps} micro-steps of {windows} "
          f"windows of up to {config.seq_len} bytes, "
          f"{config.accum} per update; skip ratio {config.skip_ratio} over {replicas} "
          f"replicas (k = {comm.num_skip})")
    print(_common.format_table(
        ["variant", "val loss", "bits/byte", "bytes vs all-reduce", "updates", "wall s"], rows))
    return results


if __name__ == "__main__":
    main()
