"""Adopting SkipReduce in flax NNX code sharded as flax's gemma example is (FSDP).

A small byte-level transformer LM (an embedding, pre-norm attention and MLP
blocks, dropout) reads Python source text. Its mesh is Explicit,
``(fsdp=8, tensor=1)``, with ``fsdp`` the only batch axis: every param and
the AdamW state are split over ``fsdp`` by their ``out_sharding``
metadata, the batch is split over it, and the contractions name their
``out_sharding`` as flax's gemma example writes them. The loop is flax's:
``nnx.jit``, ``nnx.Optimizer(adamw)``, ``nnx.Rngs`` passed into the loss,
and per-example losses and logits into ``nnx.MultiMetric``.

The file holds the step twice, so that the two can be compared line by line:

:func:`plain_step`
    What a flax user writes: ``nnx.value_and_grad``; XLA gathers the params
    and reduce-scatters the gradients.
:func:`skipreduce_step`
    The same step with ``skipreduce_jax.nnx.value_and_grad`` (4 changed
    lines, the import included; leaves under 4096 elements, the norms, keep
    the full reduction). The params and the optimizer state stay
    sharded: each block is gathered where the loss uses it, and its
    gradient is a reduce-scatter that skips ``skip_ratio`` of its ring.

    python examples/nnx_fsdp_lm.py
    python examples/nnx_fsdp_lm.py --steps 200 --skip-ratio 0.5
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import _common

_common.simulate_cpu_devices(8)  # before jax initialises

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_lm import load_corpus, train_batches  # noqa: E402

import skipreduce_jax.nnx as srnnx  # noqa: E402

VARIANTS = ("plain", "skipreduce")


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 60
    batch: int = 32          # global, split over fsdp
    seq_len: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1
    learning_rate: float = 3e-3
    skip_ratio: float = 0.5
    seed: int = 0
    train_mb: float = 2.0
    variants: tuple[str, ...] = VARIANTS


def make_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((jax.device_count(), 1), ("fsdp", "tensor"),
                         axis_types=(AxisType.Explicit,) * 2)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], sharding: tuple[Any, ...]) -> nnx.Param:
    init = nnx.initializers.normal(shape[0] ** -0.5)
    return nnx.Param(init(rngs.params(), shape), out_sharding=sharding)


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        d = config.width
        self.heads = config.heads
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = _param(rngs, (d, 3 * d), ("fsdp", "tensor"))
        self.out = _param(rngs, (d, d), ("tensor", "fsdp"))
        self.up = _param(rngs, (d, 4 * d), ("fsdp", "tensor"))
        self.down = _param(rngs, (4 * d, d), ("tensor", "fsdp"))
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs) -> jax.Array:
        b, t, d = x.shape
        act = P("fsdp")  # activations: the batch split over fsdp
        qkv = jnp.einsum("btd,de->bte", self.norm1(x), self.qkv[...], out_sharding=act)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads)
                   for z in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("bqhc,bkhc->bhqk", q, k, out_sharding=act) / np.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        mixed = jnp.einsum("bhqk,bkhc->bqhc", weights, v, out_sharding=act).reshape(b, t, d)
        x = x + self.dropout(jnp.einsum("btd,de->bte", mixed, self.out[...], out_sharding=act),
                             rngs=rngs)
        h = jax.nn.gelu(jnp.einsum("btd,de->bte", self.norm2(x), self.up[...], out_sharding=act))
        return x + self.dropout(jnp.einsum("bte,ed->btd", h, self.down[...], out_sharding=act),
                                rngs=rngs)


class LM(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs):
        self.embed = _param(rngs, (256, config.width), ("fsdp", "tensor"))
        self.blocks = nnx.List([Block(config, rngs) for _ in range(config.layers)])
        self.norm = nnx.LayerNorm(config.width, rngs=rngs)

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs) -> jax.Array:
        x = self.embed[...].at[tokens].get(out_sharding=P("fsdp"))
        for block in self.blocks:
            x = block(x, rngs)
        return jnp.einsum("btd,vd->btv", self.norm(x), self.embed[...], out_sharding=P("fsdp"))


def loss_fn(model: LM, tokens: jax.Array, rngs: nnx.Rngs):
    """The mean next-byte cross-entropy; aux: per-example losses and logits."""
    logits = model(tokens[:, :-1], rngs)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    per_example = losses.mean(axis=1)
    return per_example.mean(), (per_example, logits)


def make_metrics() -> nnx.MultiMetric:
    return nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                           accuracy=nnx.metrics.Accuracy())


def plain_step(model, optimizer, metrics, tokens, rngs):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, (per_example, logits)), grads = grad_fn(model, tokens, rngs)
    optimizer.update(model, grads)
    metrics.update(loss=per_example, logits=logits, labels=tokens[:, 1:])
    return loss


def skipreduce_step(model, optimizer, metrics, tokens, rngs, skip_ratio=0.5):
    grad_fn = srnnx.value_and_grad(loss_fn, has_aux=True, step=optimizer.step[...],
                                   skip_ratio=skip_ratio, min_size=4096)
    (loss, (per_example, logits)), grads = grad_fn(model, tokens, rngs)
    optimizer.update(model, grads)
    metrics.update(loss=per_example, logits=logits, labels=tokens[:, 1:])
    return loss


def setup(config: Config, mesh: jax.sharding.Mesh):
    """The model (params sharded over fsdp), its optimizer, metrics and rngs."""
    with jax.set_mesh(mesh):
        model = LM(config, nnx.Rngs(config.seed))
        state = nnx.state(model)
        nnx.update(model, jax.tree.map(jax.reshard, state, nnx.get_partition_spec(state)))
        optimizer = nnx.Optimizer(model, optax.adamw(config.learning_rate), wrt=nnx.Param)
    return model, optimizer, make_metrics(), nnx.Rngs(dropout=config.seed + 1)


def train(variant: str, config: Config, mesh: jax.sharding.Mesh,
          batches: np.ndarray) -> dict[str, Any]:
    model, optimizer, metrics, rngs = setup(config, mesh)
    if variant == "plain":
        step = nnx.jit(plain_step)
    else:
        step = nnx.jit(lambda *a: skipreduce_step(*a, skip_ratio=config.skip_ratio))
    losses, start = [], time.perf_counter()
    with jax.set_mesh(mesh):
        split = NamedSharding(mesh, P("fsdp"))
        for tokens in batches:
            losses.append(float(step(model, optimizer, metrics, jax.device_put(tokens, split),
                                     rngs)))
        summary = {k: float(v) for k, v in metrics.compute().items()}
    return dict(losses=losses, metrics=summary, seconds=time.perf_counter() - start,
                model=model, optimizer=optimizer)


def batches_of(config: Config) -> np.ndarray:
    corpus = load_corpus(int(config.train_mb * 2**20), 2**16)
    return np.stack(list(train_batches(corpus.train, config.steps, config.batch,
                                       config.seq_len, config.seed)))


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    config, _ = _common.parse_config(Config(), argv, __doc__.splitlines()[0],
                                     variants=VARIANTS)
    mesh, batches = make_mesh(), batches_of(config)
    results = {}
    for variant in config.variants:
        out = train(variant, config, mesh, batches)
        results[variant] = {k: v for k, v in out.items() if k not in ("model", "optimizer")}
    rows = [(v, f"{r['losses'][0]:.3f}", f"{r['losses'][-1]:.3f}",
             f"{r['metrics']['accuracy']:.3f}", f"{r['seconds']:.1f}")
            for v, r in results.items()]
    print(_common.format_table(("variant", "first loss", "last loss", "train accuracy",
                                "seconds"), rows))
    return results


if __name__ == "__main__":
    main()
