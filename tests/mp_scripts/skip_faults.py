"""Training jobs that go wrong, for the fault tests of SkipReduce.

Usage: ``skip_faults.py MODE PID_DIR`` under the launcher. Every process
first writes its pid to ``PID_DIR/p<rank>.pids``, then trains the model of
``_mp_common`` with ``skip_reduce`` on a 1-D ``data`` mesh of all devices.
By MODE:

* ``kill``: process 1 writes the time to ``PID_DIR/killed_at`` and kills
  itself with SIGKILL after two steps; the others keep stepping (their next
  step needs process 1, so they block or fail until the job is ended).
* ``num_skip``: process 1 builds ``skip_reduce`` with another ``num_skip``
  than the others; ``init_opt_state`` must refuse it before any step.
* ``seed``: the same with another ``seed``.

Each step prints ``STEP <t>``; a process that starts training prints
``TRAINING`` first, so the test can tell that nothing was trained on.
"""

import os
import signal
import sys
import time

mode, pid_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["SKIPREDUCE_PROCESS_ID"])
tmp = os.path.join(pid_dir, f"p{rank}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()}\n")
os.replace(tmp, os.path.join(pid_dir, f"p{rank}.pids"))

from skipreduce_jax.distributed import initialize  # noqa: E402

initialize()

import _mp_common as common  # noqa: E402
import jax  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

n = jax.device_count()
mesh = jax.make_mesh((n,), ("data",))
if mode == "kill":
    tx = common.make_tx()
    steps = 1_000_000
elif mode == "num_skip":
    tx = common.make_tx(num_skip=2 if rank == 1 else 1)
    steps = 1
elif mode == "seed":
    tx = common.make_tx(seed=7 if rank == 1 else 0)
    steps = 1
else:
    raise SystemExit(f"unknown mode {mode!r}")

params = sr.replicate(common.init_params(), mesh)
opt_state = sr.init_opt_state(tx, params, mesh)   # refuses mismatches
print("TRAINING", flush=True)
step = sr.make_train_step(common.loss_fn, tx, mesh)
local = jax.local_device_count()
rows = slice(rank * local * common.ROWS_PER_DEVICE,
             (rank + 1) * local * common.ROWS_PER_DEVICE)
for t in range(steps):
    if mode == "kill" and rank == 1 and t == 2:
        with open(os.path.join(pid_dir, "killed_at"), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = common.global_batch(t % 8, n)
    batch = sr.shard_batch((x[rows], y[rows]), mesh)
    params, opt_state, loss = step(params, opt_state, batch)
    print(f"STEP {t} loss={float(loss):.4f}", flush=True)
