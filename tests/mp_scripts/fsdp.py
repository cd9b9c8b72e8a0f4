"""Multi-process check: FSDP, params sharded by rows over every device.

Run twice with the same DIR (every process must get the same one)::

    python -m skipreduce_jax.launch -n P -d D fsdp.py DIR train
    python -m skipreduce_jax.launch -n P -d D fsdp.py DIR resume

The mesh is ``("data",)`` over all P x D devices, process by process;
``shard_params`` splits each param whose rows divide by P x D (the scalar
``gain`` stays replicated), so each process holds only its devices' rows,
and passes only its devices' rows of the batch. The cases, files and
checks are those of ``hsdp.py`` (``_mp_common.sharded_job``), with
``skip_reduce(..., params_sharded=True)``: ``train`` writes the params of
``k0`` and ``random`` gathered whole and the digests of this process's
shards, and saves the ``ef`` run after T and 2T steps; ``resume`` restores
step T in new processes and asserts T more steps bit-identical to
checkpoint 2T. Adam's moments are sharded like the params (ZeRO); each
residual is ``[ranks, *param shape]``, one row (the whole local gradient's
left-out part) per device.
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

me = jax.process_index()
mesh = common.fsdp_mesh(jax.devices())
ranks = mesh.devices.size
mine = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
# Each process's devices are a contiguous run of the data axis.
assert mine == list(range(mine[0], mine[0] + len(mine))), mine
host = common.fsdp_host_params()


def fresh(case, seed=0):
    """Params, state and step function, as a (re)started job builds them."""
    tx = common.hsdp_tx(case, "data", params_sharded=True)
    params = sr.shard_params(common.fsdp_host_params(seed), mesh, "data")
    for k, leaf in params.items():
        spec = P("data") if k != "gain" else P()
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim), k
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    mu = opt_state[1][0].mu  # ZeRO: Adam's moments are sharded like the params
    assert all(mu[k].sharding == params[k].sharding for k in params)
    return params, opt_state, sr.make_train_step(common.fsdp_loss, tx, mesh, "data")


def check_residuals(opt_state):
    """One row per rank of each whole param's shape; our devices' rows here."""
    residual = opt_state[0].residual
    for k, value in host.items():
        leaf = residual[k]
        assert leaf.shape == (ranks, *value.shape), (k, leaf.shape)
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P("data")),
                                              leaf.ndim), (k, leaf.sharding)
        rows = sorted(s.index[0].start for s in leaf.addressable_shards)
        assert rows == mine, (k, rows)


common.sharded_job(directory, mode, mesh, fresh, check_residuals)
