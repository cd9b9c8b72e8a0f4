"""Multi-process check: HSDP, replicas across processes and FSDP inside each.

Run twice with the same DIR (every process must get the same one)::

    python -m skipreduce_jax.launch -n P -d D hsdp.py DIR train
    python -m skipreduce_jax.launch -n P -d D hsdp.py DIR resume

The mesh is ``("replica", "fsdp")`` with one process per replica; the
params are sharded over ``fsdp`` as ``_mp_common.HSDP_SPECS`` says, and
each process passes only its replica's rows of the batch. ``train`` runs
the cases of ``HSDP_CASES``:

* ``k0`` (``num_skip=0``) and ``random`` (Random SkipReduce): asserts the
  replicas bit-identical; writes ``<case>_p<i>.npz`` (the params whole,
  gathered from the shards, and the losses) and
  ``<case>_p<i>.json`` (the digest of every shard of the params).
* ``ef``: Random with error feedback and a warmup; saves checkpoints after
  T and 2T steps and writes ``ef_p<i>.json``, digests at 2T.

``resume`` (new processes) restores step T into freshly built state,
checks that every array got the layout of the state it was restored into,
trains T more steps, asserts them bit-identical to checkpoint 2T and writes
``resume_p<i>.json``. Asserts inside (exit code 1 on a difference) and
prints a ``RESULT`` line per process (``_mp_common.sharded_job``).
"""

import sys

from skipreduce_jax import initialize

directory, mode = sys.argv[1], sys.argv[2]
initialize()

import _mp_common as common  # noqa: E402
import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

me, processes = jax.process_index(), jax.process_count()
mesh = common.hsdp_mesh(jax.devices(), processes)
# One replica per process: its row of the mesh is its own devices.
assert [{d.process_index for d in row} for row in mesh.devices] == [
    {p} for p in range(processes)], mesh.devices
specs = common.HSDP_SPECS


def fresh(case, seed=0):
    """Params, state and step function, as a (re)started job builds them."""
    tx = common.hsdp_tx(case)
    params = common.hsdp_params(mesh, seed)
    for k, spec in specs.items():
        assert params[k].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), k
    return (params, sr.init_opt_state(tx, params, mesh, "replica"),
            sr.make_train_step(common.hsdp_loss, tx, mesh, "replica"))


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


common.sharded_job(directory, mode, mesh, fresh, check_residuals)
