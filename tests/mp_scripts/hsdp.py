"""Multi-process check: HSDP, replicas across processes and FSDP inside each.

Run twice with the same DIR (every process must get the same one)::

    python -m skipreduce_jax.launch -n P -d D hsdp.py DIR train
    python -m skipreduce_jax.launch -n P -d D hsdp.py DIR resume

The mesh is ``("replica", "fsdp")`` with one process per replica; the
params are sharded over ``fsdp`` as ``_mp_common.HSDP_SPECS`` says, and
each process passes only its replica's rows of the batch. ``train`` runs
the cases of ``HSDP_CASES``:

* ``k0`` (``num_skip=0``) and ``random`` (Random SkipReduce): asserts the
  replicas bit-identical; writes ``<case>_p<i>.npz`` (the params put
  together from this process's shards, and the losses) and
  ``<case>_p<i>.json`` (the digest of every shard of the params).
* ``ef``: Random with error feedback and a warmup; saves checkpoints after
  T and 2T steps and writes ``ef_p<i>.json``, digests at 2T.

``resume`` (new processes) restores step T into freshly built state,
checks that every array got the layout of the state it was restored into,
trains T more steps, asserts them bit-identical to checkpoint 2T and writes
``resume_p<i>.json``. Asserts inside (exit code 1 on a difference) and
prints a ``RESULT`` line per process.
"""

import json
import os
import sys

from skipreduce_jax import initialize

directory, mode = sys.argv[1], sys.argv[2]
initialize()

import _mp_common as common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from skipreduce_jax import checkpoint  # noqa: E402

me, processes = jax.process_index(), jax.process_count()
mesh = common.hsdp_mesh(jax.devices(), processes)
# One replica per process: its row of the mesh is its own devices.
assert [{d.process_index for d in row} for row in mesh.devices] == [
    {p} for p in range(processes)], mesh.devices
specs = common.HSDP_SPECS
T = common.HSDP_T
ckpt = os.path.join(directory, "ckpt")


def fresh(case, seed=0):
    """Params, state and step function, as a (re)started job builds them."""
    tx = common.hsdp_tx(case)
    params = common.hsdp_params(mesh, seed)
    return (params, sr.init_opt_state(tx, params, mesh, "replica"),
            sr.make_train_step(common.hsdp_loss, tx, mesh, "replica"))


def run(step_fn, params, opt_state, start, stop):
    losses = []
    for t in range(start, stop):
        x, y = common.hsdp_batch(t, processes)
        rows = slice(me * common.HSDP_ROWS, (me + 1) * common.HSDP_ROWS)
        params, opt_state, loss = step_fn(params, opt_state, (x[rows], y[rows]))
        losses.append(float(loss))
    assert step_fn._cache_size() == 1  # outputs (and restored state) fit the step
    for k, spec in specs.items():  # layouts kept
        assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), k
    return params, opt_state, losses


def write(name, value):
    with open(os.path.join(directory, f"{name}_p{me}.json"), "w") as f:
        json.dump(value, f)


def assert_equal(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        # The step spells P("fsdp", None) as P("fsdp"): the same layout.
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        w_shards = {s.device: s for s in w.addressable_shards}
        for s in g.addressable_shards:
            assert s.index == w_shards[s.device].index
            np.testing.assert_array_equal(np.asarray(s.data),
                                          np.asarray(w_shards[s.device].data))


def check_residuals(opt_state):
    """One residual row per replica, sharded like its param; ours on our devices."""
    residual = opt_state[0].residual
    for k, spec in specs.items():
        leaf = residual[k]
        assert leaf.shape == (processes, *common.hsdp_host_params()[k].shape), k
        assert leaf.sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *spec)), leaf.ndim), (k, leaf.sharding)
        for s in leaf.addressable_shards:
            assert s.index[0] == slice(me, me + 1), (k, s.index)


if mode == "train":
    for case in ("k0", "random"):
        params, opt_state, step_fn = fresh(case)
        params, opt_state, losses = run(step_fn, params, opt_state, 0, common.HSDP_STEPS)
        sr.assert_replicated(params, mesh)
        sr.assert_replicated(opt_state, mesh)
        np.savez(os.path.join(directory, f"{case}_p{me}.npz"), losses=np.array(losses),
                 **common.assembled(params))
        write(case, common.shard_digests(params))

    params, opt_state, step_fn = fresh("ef")
    check_residuals(opt_state)
    params, opt_state, _ = run(step_fn, params, opt_state, 0, T)
    checkpoint.save(ckpt, T, params, opt_state)
    params, opt_state, _ = run(step_fn, params, opt_state, T, 2 * T)
    sr.assert_replicated(params, mesh)
    check_residuals(opt_state)
    checkpoint.save(ckpt, 2 * T, params, opt_state)
    write("ef", common.shard_digests((params, opt_state)))
elif mode == "resume":
    params, opt_state, step_fn = fresh("ef", seed=1)
    like = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state))
    step, params, opt_state = checkpoint.restore(
        ckpt, params_like=params, opt_state_like=opt_state, step=T)
    assert step == T and int(opt_state[0].count.addressable_data(0)) == T
    # Every array comes back with the layout of the one it was restored into.
    assert jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state)) == like
    check_residuals(opt_state)
    assert any(np.any(np.asarray(s.data) != 0)
               for s in opt_state[0].residual["w1"].addressable_shards)
    params, opt_state, _ = run(step_fn, params, opt_state, T, 2 * T)
    like_params, like_state, _ = fresh("ef", seed=2)
    _, want_params, want_state = checkpoint.restore(
        ckpt, params_like=like_params, opt_state_like=like_state, step=2 * T)
    assert_equal(params, want_params)
    assert_equal(opt_state, want_state)
    write("resume", common.shard_digests((params, opt_state)))
else:
    raise SystemExit(f"unknown mode {mode!r}")
print(f"RESULT mode={mode} process={me} devices={jax.device_count()} pid={os.getpid()}")
