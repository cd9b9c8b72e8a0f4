"""skip_adamw: the chain it stands for, its argument checks, the train step."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


def _run(tx, steps=4, rows=64):
    """``steps`` updates of ``tx`` on per-rank gradients; the final params."""
    mesh = jax.make_mesh((N,), ("data",))
    params = sr.replicate({"w": jnp.ones((rows, 8)), "b": jnp.zeros(8)}, mesh)
    state = sr.init_opt_state(tx, params, mesh, "data")
    grads = jax.device_put(
        {"w": jnp.sin(jnp.arange(N * rows * 8, dtype=jnp.float32)).reshape(N * rows, 8),
         "b": jnp.cos(jnp.arange(N * 8, dtype=jnp.float32))},
        NamedSharding(mesh, P("data")))

    def local(params, state, grads):
        for _ in range(steps):
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params

    specs = sr.state_specs(state, "data")
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=P()))(params, state, grads)


def test_equals_the_chain_of_skip_reduce_and_adamw():
    got = _run(sr.skip_adamw(3e-3, axis_name="data", skip_ratio=0.5, seed=7,
                             min_size=0, warmup_steps=2, weight_decay=0.1, b1=0.8))
    want = _run(optax.chain(
        sr.skip_reduce("data", skip_ratio=0.5, seed=7, min_size=0, warmup_steps=2),
        optax.adamw(3e-3, weight_decay=0.1, b1=0.8)))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # Another seed drops other contributions: the chain's seed was used.
    other = _run(sr.skip_adamw(3e-3, axis_name="data", skip_ratio=0.5, seed=9,
                               min_size=0, warmup_steps=2, weight_decay=0.1, b1=0.8))
    assert not np.array_equal(np.asarray(other["w"]), np.asarray(got["w"]))


def test_defaults_are_a_30_step_warm_up_then_skip_reduce_and_adamw_defaults():
    defaults = inspect.signature(sr.skip_adamw).parameters
    assert defaults["warmup_steps"].default == 30 and defaults["min_size"].default == 0
    got = _run(sr.skip_adamw(1e-2, axis_name="data", skip_ratio=0.5), rows=2**14)
    want = _run(optax.chain(sr.skip_reduce("data", skip_ratio=0.5, warmup_steps=30,
                                           min_size=0),
                            optax.adamw(1e-2)), rows=2**14)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(learning_rate=-1.0), ValueError, r"skip_adamw: learning_rate must be >= 0"),
    (dict(learning_rate=True), TypeError, r"skip_adamw: learning_rate must be a real"),
    (dict(axis_name=("data",)), TypeError, r"skip_adamw: axis_name=\('data',\)"),
    (dict(skip_ratio=1.5), ValueError, r"skip_adamw: skip_ratio must be <= 1"),
    (dict(skip_ratio=None), TypeError, r"skip_adamw: skip_ratio=None"),
    (dict(seed=-1), ValueError, r"skip_adamw: seed=-1 must be an int in \[0, "),
    (dict(warmup_steps=1.5), TypeError, r"skip_adamw: warmup_steps=1.5"),
    (dict(min_size=-3), ValueError, r"skip_adamw: min_size=-3"),
    (dict(num_skip=4), TypeError, r"skip_adamw: unexpected argument\(s\) num_skip.*b1"),
])
def test_argument_errors_name_the_api_and_the_argument(kwargs, error, match):
    args = dict(learning_rate=1e-3, axis_name="data", skip_ratio=0.5) | kwargs
    lr = args.pop("learning_rate")
    with pytest.raises(error, match=match):
        sr.skip_adamw(lr, **args)


def test_arguments_are_keyword_only_and_schedules_are_accepted():
    with pytest.raises(TypeError):
        sr.skip_adamw(1e-3, "data", 0.5)
    sr.skip_adamw(optax.linear_schedule(0.0, 1e-3, 10), axis_name="data", skip_ratio=0.5)


def test_trains_in_make_train_step():
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N * 16, 8)).astype(np.float32)
    y = x @ rng.normal(size=(8,)).astype(np.float32)

    def loss_fn(params, batch):
        xb, yb = batch
        return jnp.mean((xb @ params["w"] - yb) ** 2)

    tx = sr.skip_adamw(0.05, axis_name="data", skip_ratio=0.5, min_size=0)
    params = sr.replicate({"w": jnp.zeros(8)}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state, (x, y))
        losses.append(float(loss))
    assert losses[-1] < 0.2 * losses[0]
    sr.assert_replicated(params, mesh)
    assert int(opt_state[0].count) == 30
