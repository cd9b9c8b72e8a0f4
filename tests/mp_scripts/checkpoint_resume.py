"""Multi-process check: a resumed run is bit-identical to an uninterrupted one.

Run twice with the same DIR (every process must get the same one)::

    python -m skipreduce_jax.launch -n 2 -d 2 checkpoint_resume.py DIR train
    python -m skipreduce_jax.launch -n 2 -d 2 checkpoint_resume.py DIR resume

``train`` runs 2T steps of Random SkipReduce with error feedback and a
warmup, saving after step T and after step 2T. ``resume`` (new processes)
asks for the latest step on process 0 alone, builds everything afresh,
restores step T, checks that each residual row is
on its own rank's device, runs T more steps and compares every array with
checkpoint 2T, bit for bit. Asserts inside (exit code 1 on a difference) and
prints ``RESULT <mode> ok`` per process.
"""

import sys

from skipreduce_jax import initialize

directory, mode = sys.argv[1], sys.argv[2]
initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from skipreduce_jax import checkpoint  # noqa: E402

T = 3
n = jax.device_count()
mesh = jax.make_mesh((n,), ("data",))
# min_size=100: "b" (32 elements) is never skipped; its residual is empty.
tx = optax.chain(
    sr.skip_reduce("data", num_skip=2, seed=11, min_size=100, warmup_steps=1,
                   error_feedback=True),
    optax.adam(0.05))


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def batch(step):
    """The global batch of ``step``, the same on every process, sharded."""
    rng = np.random.default_rng(step)
    arrays = (rng.normal(size=(n * 4, 8)).astype(np.float32),
              rng.normal(size=(n * 4, 32)).astype(np.float32))
    sharding = NamedSharding(mesh, P("data"))
    return tuple(jax.make_array_from_callback(a.shape, sharding,
                                              lambda i, a=a: a[i])
                 for a in arrays)


def fresh(seed):
    key = jax.random.key(seed)
    params = sr.replicate({"w": jax.random.normal(key, (8, 32)) * 0.3,
                           "b": jnp.zeros(32)}, mesh)
    return params, sr.init_opt_state(tx, params, mesh, "data")


def run(params, opt_state, start, stop):
    step_fn = sr.make_train_step(loss_fn, tx, mesh, "data")
    for i in range(start, stop):
        params, opt_state, _ = step_fn(params, opt_state, batch(i))
    return params, opt_state


def assert_equal(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.sharding == w.sharding, (g.sharding, w.sharding)
        w_shards = {s.device: s for s in w.addressable_shards}
        for s in g.addressable_shards:
            assert s.index == w_shards[s.device].index
            np.testing.assert_array_equal(np.asarray(s.data),
                                          np.asarray(w_shards[s.device].data))


if mode == "train":
    params, opt_state = fresh(0)
    params, opt_state = run(params, opt_state, 0, T)
    checkpoint.save(directory, T, params, opt_state)
    params, opt_state = run(params, opt_state, T, 2 * T)
    checkpoint.save(directory, 2 * T, params, opt_state)
elif mode == "resume":
    if jax.process_index() == 0:  # one process alone may ask
        assert checkpoint.latest_step(directory) == 2 * T
    params, opt_state = fresh(99)
    step, params, opt_state = checkpoint.restore(
        directory, params_like=params, opt_state_like=opt_state, step=T)
    assert step == T and int(opt_state[0].count.addressable_data(0)) == T
    assert opt_state[0].residual["b"].shape == (n, 0)
    devices = list(mesh.devices.flat)
    residual = opt_state[0].residual["w"]
    assert residual.shape == (n, 8, 32)
    assert len(residual.addressable_shards) == jax.local_device_count()
    for s in residual.addressable_shards:
        rank = devices.index(s.device)
        assert s.index[0] == slice(rank, rank + 1)  # own row on own device
        assert np.any(np.asarray(s.data) != 0)
    params, opt_state = run(params, opt_state, T, 2 * T)
    like_params, like_state = fresh(0)
    _, want_params, want_state = checkpoint.restore(
        directory, params_like=like_params, opt_state_like=like_state, step=2 * T)
    assert_equal(params, want_params)
    assert_equal(opt_state, want_state)
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"RESULT {mode} ok process={jax.process_index()} devices={n}")
