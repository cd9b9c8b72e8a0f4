"""Adopting SkipReduce in a step shaped like flax's lm1b example.

flax's ``examples/lm1b`` trains a Transformer LM with a ``train_step`` of its
own: the loss closes over the batch (``def loss_fn(params)``), returns the
logits as aux, and the metrics (the weighted loss, accuracy and the token
count ``denominator``) are computed after the step from those logits on the
global batch. Its mesh is ``("data", "fsdp", "tensor")`` with Auto axes, and
its default layout puts every device on ``fsdp`` (``data=1``).

This file holds that step twice, for a line-by-line comparison:

:func:`plain_step`
    The step as lm1b writes it: ``jax.value_and_grad`` of a loss closing over
    the batch; XLA inserts the gradient all-reduce.
:func:`skipreduce_step`
    The same step with ``skipreduce_jax.value_and_grad`` over ``"data"``: the
    ``grad_fn`` line differs, and the import. The loss means what it means
    for ``jax.value_and_grad`` (its token count is the global batch's, its
    dropout mask lm1b's own, row by row), so the metrics, counts included,
    are computed from the logits exactly as before.

``--mesh data`` puts the 8 devices on ``data`` (SkipReduce over 8 ranks);
``--mesh fsdp`` is lm1b's default, ``data=1, fsdp=8``: the params stay
sharded over ``fsdp`` (FSDP), each gathered where the loss uses it, and the
gradients' reduce-scatter over ``fsdp`` skips. The model, state and
data are ``pjit_lm.py``'s (a logically partitioned linen Transformer over
``fsdp``, AdamW, padded windows of Python source)::

    python examples/lm1b_lm.py --mesh data
    python examples/lm1b_lm.py --mesh fsdp --steps 20
"""

from __future__ import annotations

import argparse
import functools
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
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from linen_lm import padded_batches  # noqa: E402
from pjit_lm import LM, Config  # noqa: E402
from train_lm import load_corpus  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

MESHES = {"data": (8, 1, 1), "fsdp": (1, 8, 1)}
AXES = ("data", "fsdp", "tensor")


def weighted_cross_entropy(logits, targets, weights):
    """lm1b's ``compute_weighted_cross_entropy``: the summed loss and weight."""
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets)
    return jnp.sum(losses * weights), jnp.sum(weights)


def compute_metrics(logits, targets, weights):
    """lm1b's metrics: summed loss, correct predictions and the token count."""
    loss, denominator = weighted_cross_entropy(logits, targets, weights)
    accuracy = jnp.sum((logits.argmax(-1) == targets) * weights)
    return {"loss": loss, "accuracy": accuracy, "denominator": denominator}


def plain_step(state, batch, dropout_rng, *, sr_options):
    """lm1b's train_step: jax.value_and_grad of a loss closing over the batch."""
    inputs, weights = batch
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, inputs[:, :-1], train=True,
                                rngs={"dropout": dropout_rng})
        loss, weight_sum = weighted_cross_entropy(logits, inputs[:, 1:], weights)
        return loss / weight_sum, logits

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, logits), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    return state, compute_metrics(logits, inputs[:, 1:], weights)


def skipreduce_step(state, batch, dropout_rng, *, sr_options):
    """The same step; SkipReduce sums the gradients over ``"data"``.

    ``sr_options``: the mesh, the data axis and the skip settings (:func:`train`).
    """
    inputs, weights = batch
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, inputs[:, :-1], train=True,
                                rngs={"dropout": dropout_rng})
        loss, weight_sum = weighted_cross_entropy(logits, inputs[:, 1:], weights)
        return loss / weight_sum, logits

    grad_fn = sr.value_and_grad(loss_fn, step=state.step, has_aux=True, **sr_options)
    (_, logits), grads = grad_fn(state.params)
    state = state.apply_gradients(grads=grads)
    return state, compute_metrics(logits, inputs[:, 1:], weights)


STEPS = {"plain": plain_step, "skipreduce": skipreduce_step}


def make_mesh(layout: str) -> jax.sharding.Mesh:
    """lm1b's mesh, ``(data, fsdp, tensor)`` with Auto axes."""
    devices = jax.devices()
    if len(devices) == 1:
        devices = jax.devices("cpu")
    return jax.make_mesh(MESHES[layout], AXES, devices=devices,
                         axis_types=(AxisType.Auto,) * 3)


def init_state(config: Config, mesh: jax.sharding.Mesh):
    """An AdamW ``TrainState``, params placed by the logical rules over ``fsdp``."""
    model = LM(config.d_model, config.layers, config.heads, config.seq_len, config.dropout)
    rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("vocab", None),
             ("length", None), ("heads", None), ("kv", None), ("mlp", None))

    tx = optax.adamw(config.lr)

    def create(key):
        params = model.init(key, jnp.zeros((1, config.seq_len), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    key = jax.random.key(config.seed)
    shardings = nn.logical_to_mesh_sharding(
        nn.get_partition_spec(jax.eval_shape(create, key)), mesh, rules)
    state = jax.jit(lambda key: nn.unbox(create(key)), out_shardings=shardings)(key)
    return state, shardings


def train(variant: str, layout: str, config: Config, corpus: Any) -> list[dict[str, float]]:
    """Trains one variant; returns the metrics of every step as floats."""
    mesh = make_mesh(layout)
    state, shardings = init_state(config, mesh)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    # SkipReduce over the axis the batch is split over: data, or in lm1b's
    # default layout fsdp, whose params stay sharded (FSDP).
    sr_options = dict(mesh=mesh, axis_name="data" if mesh.shape["data"] > 1 else "fsdp",
                      param_specs=shardings.params, **config.skip_options)
    step = jax.jit(functools.partial(STEPS[variant], sr_options=sr_options),
                   in_shardings=(shardings, batch_sharding, NamedSharding(mesh, P())),
                   out_shardings=(shardings, NamedSharding(mesh, P())),
                   donate_argnums=0)
    history, dropout_rng = [], jax.random.key(config.seed + 1)
    for i, batch in enumerate(padded_batches(
            corpus.train, config, mesh.size * config.batch_per_device), 1):
        state, metrics = step(state, batch, dropout_rng)
        metrics = {k: float(v) for k, v in metrics.items()}
        history.append(metrics)
        if i % config.eval_every == 0 or i == config.steps:
            print(f"  [{variant:>10}] step {i:4d}  loss "
                  f"{metrics['loss'] / metrics['denominator']:.4f}  acc "
                  f"{metrics['accuracy'] / metrics['denominator']:.3f}  "
                  f"tokens {metrics['denominator']:.0f}", flush=True)
    return history


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict[str, float]]]:
    """Trains both variants on ``--mesh``; returns their per-step metrics."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", choices=sorted(MESHES), default="data")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip-ratio", type=float, default=0.5)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--variants", default="plain,skipreduce")
    args = parser.parse_args(argv)
    config = Config(steps=args.steps, skip_ratio=args.skip_ratio, d_model=args.d_model,
                    eval_every=max(1, args.steps // 4), accum=1)
    corpus = load_corpus(int(config.train_mb * 2**20), int(config.val_mb * 2**20))
    results = {v: train(v, args.mesh, config, corpus) for v in args.variants.split(",")}
    for variant, history in results.items():
        last = history[-1]
        print(f"{variant:>10}: final loss {last['loss'] / last['denominator']:.4f}, "
              f"mean tokens per step {np.mean([h['denominator'] for h in history]):.0f}")
    return results


if __name__ == "__main__":
    main()
