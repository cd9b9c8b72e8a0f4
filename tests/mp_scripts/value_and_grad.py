"""Multi-process check: ``value_and_grad`` in a plain jit step, HSDP layout.

Run as::

    python -m skipreduce_jax.launch -n P -d D value_and_grad.py DIR

The mesh is ``("replica", "fsdp")`` with one process per replica, the params
sharded over ``fsdp`` (``_mp_common.HSDP_SPECS``); each process passes only
its replica's rows of the batch. For each case of
``_mp_common.VALUE_AND_GRAD_CASES`` it trains ``HSDP_STEPS`` steps, asserts
the replicas bit-identical and writes ``vg_<case>_p<i>.npz`` (the params
whole and the losses) and ``vg_<case>_p<i>.json`` (the digest of every
shard of the params). Prints a ``RESULT`` line per process.
"""

import os
import sys

from skipreduce_jax import initialize

directory = sys.argv[1]
initialize()

import json  # noqa: E402

import _mp_common as common  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

me, processes = jax.process_index(), jax.process_count()
mesh = common.hsdp_mesh(jax.devices(), processes)
rows = slice(me * common.HSDP_ROWS, (me + 1) * common.HSDP_ROWS)


def batch(t):
    """This process's rows of step t's batch, as global arrays."""
    sharding = NamedSharding(mesh, P("replica"))
    return tuple(jax.make_array_from_process_local_data(sharding, a[rows])
                 for a in common.hsdp_batch(t, processes))


for case in common.VALUE_AND_GRAD_CASES:
    params, losses = common.value_and_grad_run(mesh, case, batch)
    sr.assert_replicated(params, mesh)
    whole = multihost_utils.process_allgather(params, tiled=True)
    np.savez(os.path.join(directory, f"vg_{case}_p{me}.npz"), losses=np.array(losses),
             **whole)
    with open(os.path.join(directory, f"vg_{case}_p{me}.json"), "w") as f:
        json.dump(common.shard_digests(params), f)
print(f"RESULT mode=value_and_grad process={me} devices={jax.device_count()} "
      f"pid={os.getpid()}")
