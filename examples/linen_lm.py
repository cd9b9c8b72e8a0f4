"""Adopting SkipReduce in flax linen code: a byte-level LM with a TrainState.

A small decoder-only transformer (the blocks and the corpus of
``train_lm.py``: Python standard-library source, read offline; here with
dropout) is trained with flax's ``train_state.TrainState`` on windows of
varying length, padded to ``--seq-len`` and weighted by a token mask. The
step takes a dropout key and a static configuration and returns its metrics.
The file holds the step twice, so that the two can be compared line by line:

:func:`plain_setup`
    What a linen user writes today: ``jax.jit`` with ``in_shardings`` that
    split the batch over ``"data"``; XLA inserts the gradient all-reduce.
:func:`skipreduce_setup`
    The same step with SkipReduce (about 10 lines differ), run by
    ``skipreduce_jax.data_parallel`` on one rank's rows: local gradients,
    ``skip_reduce`` first in the optimizer (Random SkipReduce at
    ``--skip-ratio``), a dropout key per rank (``rank_key``), metrics
    averaged with ``lax.pmean``.

The loss normaliser must stay global. The plain step divides the summed
token losses by the batch's token count. A rank that divided by its own
count would weight its tokens by 1 / (its count), not 1 / (the global
count), and the ranks' average would not be the global per-token mean
whenever the ranks hold different numbers of tokens (padding, packing).
``skip_reduce`` averages the ranks' gradients, so each rank divides by
``lax.psum(count, "data") / N``: the average of the ranks' losses (and
gradients) is then exactly the plain step's.

Variants: ``plain`` (XLA's all-reduce) and ``skipreduce``::

    python examples/linen_lm.py
    python examples/linen_lm.py --steps 400 --d-model 128 --layers 4

It prints training loss and accuracy and validation loss during training,
and a table at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Sequence
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
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_lm import VOCAB_SIZE, Block, load_corpus, train_batches, val_windows  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

VARIANTS = ("plain", "skipreduce")
LABELS = {"plain": "jax.jit, XLA all-reduce", "skipreduce": "Random SkipReduce"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run; see ``--help`` for the meanings."""

    steps: int = 150
    batch_per_rank: int = 4
    seq_len: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    dropout: float = 0.1
    lr: float = 3e-3
    label_smoothing: float = 0.0
    skip_ratio: float = 0.5
    min_size: int = 1024
    eval_every: int = 25
    val_windows: int = 128
    train_mb: float = 1.0
    val_mb: float = 0.0625
    seed: int = 0
    variants: tuple[str, ...] = VARIANTS


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The step's static argument (hashable: a new value compiles again).

    Attributes:
      label_smoothing: the weight of the uniform distribution mixed into
        the one-hot targets.
    """

    label_smoothing: float = 0.0


class LM(nn.Module):
    """``train_lm.ByteTransformer`` with dropout after the embedding and blocks.

    Attributes:
      d_model: model width.
      num_layers: transformer blocks.
      num_heads: attention heads per block.
      max_len: longest input sequence.
      dropout: dropout rate.
    """

    d_model: int
    num_layers: int
    num_heads: int
    max_len: int
    dropout: float

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool) -> jax.Array:
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(VOCAB_SIZE, self.d_model, embedding_init=init,
                         name="tok_embed")
        pos = self.param("pos_embed", init, (self.max_len, self.d_model))
        x = embed(tokens) + pos[:tokens.shape[1]]
        for i in range(self.num_layers):
            x = nn.Dropout(self.dropout, deterministic=not train)(x)
            x = Block(self.num_heads, name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(name="ln_final")(x))


def padded_batches(data: np.ndarray, config: Config, batch: int
                   ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``train_lm.train_batches`` windows cut to random lengths and padded.

    Each window keeps between a quarter of ``seq_len`` and all of it, as
    documents of varying length padded to one shape, so the ranks' token
    counts differ from step to step.

    Yields:
      ``(tokens, weights)``: int32 ``(batch, seq_len + 1)`` (0 after the
      end) and float32 ``(batch, seq_len)``, 1 where a target is real.
    """
    rng = np.random.default_rng(config.seed + 1)
    for tokens in train_batches(data, config.steps, batch, config.seq_len,
                                config.seed):
        lengths = rng.integers(config.seq_len // 4, config.seq_len + 1, size=batch)
        weights = np.arange(config.seq_len)[None] < lengths[:, None]
        tokens[:, 1:] *= weights
        yield tokens, weights.astype(np.float32)


def loss_fn(params: Any, apply_fn: Any, batch: tuple[jax.Array, jax.Array],
            key: jax.Array, count: jax.Array, config: LossConfig
            ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed next-byte cross-entropy of the real targets over ``count``.

    Args:
      params: the model's parameters.
      apply_fn: ``LM.apply``.
      batch: ``(tokens, weights)``.
      key: the dropout key.
      count: the normaliser (the number of real targets; see the module
        docstring for the per-rank step).
      config: the static configuration.

    Returns:
      ``(loss, {"loss", "accuracy"})``, both weighted sums over ``count``.
    """
    tokens, weights = batch
    logits = apply_fn({"params": params}, tokens[:, :-1], train=True,
                      rngs={"dropout": key})
    targets = optax.smooth_labels(jax.nn.one_hot(tokens[:, 1:], VOCAB_SIZE),
                                  config.label_smoothing)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)
    correct = logits.argmax(-1) == tokens[:, 1:]
    loss = jnp.sum(losses * weights) / count
    return loss, {"loss": loss, "accuracy": jnp.sum(correct * weights) / count}


# ----------------------------------------------------------------------------
# The two steps: README.md shows the lines that differ.
# ----------------------------------------------------------------------------


def plain_setup(mesh, config, model, params):
    """A ``TrainState`` and the step under ``jax.jit`` with shardings."""
    tx = optax.adamw(config.lr)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def train_step(state, batch, key, loss_config):
        key = jax.random.fold_in(key, state.step)
        count = jnp.sum(batch[1])
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, metrics), grads = grad_fn(state.params, state.apply_fn, batch, key, count,
                                      loss_config)
        return state.apply_gradients(grads=grads), metrics

    train_step = jax.jit(train_step, in_shardings=(replicated, split, replicated),
                         out_shardings=replicated, static_argnums=3, donate_argnums=0)
    return jax.device_put(state, replicated), train_step


def skipreduce_setup(mesh, config, model, params):
    """The same, with SkipReduce; ``train_step`` sees one rank's rows."""
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=config.skip_ratio, min_size=config.min_size),
                     optax.adamw(config.lr))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    state = state.replace(opt_state=sr.init_opt_state(tx, params, mesh, "data"))

    def train_step(state, batch, key, loss_config):
        key = sr.rank_key(jax.random.fold_in(key, state.step), "data")
        count = lax.psum(jnp.sum(batch[1]), "data") / lax.axis_size("data")
        grad_fn = sr.local_value_and_grad(loss_fn, "data", has_aux=True)
        (_, metrics), grads = grad_fn(state.params, state.apply_fn, batch, key, count,
                                      loss_config)
        return state.apply_gradients(grads=grads), lax.pmean(metrics, "data")

    train_step = sr.data_parallel(train_step, mesh, "data", batch_argnums=1,
                                  static_argnums=3, donate_argnums=0)
    return state, train_step


# ----------------------------------------------------------------------------
# The loop, the same for both.
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(model: LM, key: jax.Array, seq_len: int) -> Any:
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    return model.init(key, tokens, train=False)["params"]


def init(config: Config) -> tuple[LM, Any]:
    """The model and its initial parameters (on the host)."""
    model = LM(config.d_model, config.layers, config.heads, config.seq_len,
               config.dropout)
    params = _init_params(model, jax.random.key(config.seed), config.seq_len)
    return model, jax.device_get(params)


def setup(variant: str, mesh: jax.sharding.Mesh, config: Config, model: LM,
          params: Any):
    """``(state, train_step)`` of one of :data:`VARIANTS`."""
    if variant == "plain":
        return plain_setup(mesh, config, model, params)
    if variant == "skipreduce":
        return skipreduce_setup(mesh, config, model, params)
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}.")


def train(variant: str, config: Config, mesh: jax.sharding.Mesh,
          corpus: Any) -> dict[str, Any]:
    """Trains one variant from the shared initialisation and batches.

    Args:
      variant: one of :data:`VARIANTS`.
      config: the run configuration.
      mesh: the 1-D ``"data"`` mesh.
      corpus: ``train_lm.load_corpus``'s bytes.

    Returns:
      A dict: ``history`` (``[step, train loss, train accuracy, val loss]``
      per evaluation), ``val_loss`` (nats per byte) and ``seconds``.
    """
    start = time.perf_counter()
    n = mesh.shape["data"]
    model, params = init(config)
    state, train_step = setup(variant, mesh, config, model, params)
    val = val_windows(corpus.val, config.seq_len, config.val_windows, n)
    evaluate = jax.jit(
        lambda params, tokens: optax.softmax_cross_entropy_with_integer_labels(
            model.apply({"params": params}, tokens[:, :-1], train=False),
            tokens[:, 1:]).mean(),
        in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))))
    key, loss_config = jax.random.key(config.seed), LossConfig(config.label_smoothing)
    history, seen = [], []
    batches = padded_batches(corpus.train, config, n * config.batch_per_rank)
    for step, batch in enumerate(batches, 1):
        state, metrics = train_step(state, batch, key, loss_config)
        seen.append(metrics)
        if step % config.eval_every and step != config.steps:
            continue
        mean = {k: float(np.mean([m[k] for m in seen])) for k in seen[0]}
        val_loss = float(evaluate(state.params, val))
        seen = []
        history.append([step, mean["loss"], mean["accuracy"], val_loss])
        print(f"  [{variant:>10}] step {step:4d}  train loss {mean['loss']:.4f} "
              f"acc {mean['accuracy']:.3f}  val {val_loss:.4f} nats/byte "
              f"= {val_loss / math.log(2):.4f} bits/byte", flush=True)
    return dict(history=history, val_loss=history[-1][3],
                seconds=time.perf_counter() - start)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parses the command line into a :class:`Config` (``--help``: the fields)."""
    config, parser = _common.parse_config(
        Config(), argv, __doc__.split("\n\n")[0], variants=VARIANTS)
    if min(config.steps, config.batch_per_rank, config.seq_len, config.d_model,
           config.layers, config.heads, config.eval_every, config.val_windows) < 1:
        parser.error("every size and count must be >= 1")
    if config.d_model % config.heads:
        parser.error(f"--d-model {config.d_model} must be a multiple of --heads {config.heads}")
    if config.skip_ratio > 1.0 or config.dropout >= 1.0:
        parser.error("--skip-ratio must be in [0, 1] and --dropout in [0, 1)")
    return config


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Trains every variant and prints a table; returns the results by name."""
    config = parse_args(argv)
    # Auto axes: under jax.jit's in_shardings on an Explicit mesh, XLA
    # all-gathers the embedding lookup and runs the whole batch everywhere.
    mesh = _common.data_mesh("data", auto=True)
    n = mesh.shape["data"]
    corpus = load_corpus(int(config.train_mb * 2**20), int(config.val_mb * 2**20))
    results = {variant: train(variant, config, mesh, corpus)
               for variant in config.variants}
    comm = sr.comm_stats(init(config)[1], n, skip_ratio=config.skip_ratio,
                         min_size=config.min_size)
    rows = [[LABELS[v], f"{r['val_loss']:.4f}", f"{r['val_loss'] / math.log(2):.4f}",
             "1.000" if v == "plain" else f"{comm.ratio:.3f}", f"{r['seconds']:.1f}"]
            for v, r in results.items()]
    print(f"\n{n} ranks, {n * config.batch_per_rank} windows of up to "
          f"{config.seq_len} bytes per step, {config.steps} steps, skip ratio "
          f"{config.skip_ratio} (k = {comm.num_skip})")
    print(_common.format_table(
        ["variant", "val loss", "bits/byte", "bytes vs all-reduce", "wall s"], rows))
    return results


if __name__ == "__main__":
    main()
