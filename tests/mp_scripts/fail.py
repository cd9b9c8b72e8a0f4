"""A job that goes wrong: one process fails while the others hang.

Usage: ``fail.py PID_DIR MODE [FAIL_RANK]``. Every process first writes its
pid, and the pid of a grandchild it starts (``sleep``-ing in Python), to
``PID_DIR/p<rank>.pids``. Then, by MODE:

* ``raise``: process FAIL_RANK raises after ``initialize()``; the others
  sleep 300 s.
* ``hang``: all processes sleep 300 s after ``initialize()`` (for --timeout
  and launcher signals); they ignore SIGTERM, as a stuck process may.
* ``nojax``: like ``hang`` but without JAX.
* ``leave``: exits with 0 at once (without JAX), leaving its grandchild.
* ``late``: like ``hang``, but sleeps 3 s before ``initialize()``.
"""

import os
import signal
import subprocess
import sys
import time

pid_dir, mode = sys.argv[1], sys.argv[2]
fail_rank = int(sys.argv[3]) if len(sys.argv) > 3 else -1
rank = int(os.environ["SKIPREDUCE_PROCESS_ID"])

grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
tmp = os.path.join(pid_dir, f"p{rank}.tmp")
with open(tmp, "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}\n")
os.replace(tmp, os.path.join(pid_dir, f"p{rank}.pids"))

if mode == "leave":
    sys.exit(0)
if mode == "late":
    time.sleep(3)
if mode != "nojax":
    from skipreduce_jax.distributed import initialize

    initialize()
    import jax

    if mode != "late":  # (a closed pipe would end it too: no output here)
        print(f"rank {rank} sees {jax.device_count()} devices", flush=True)

if mode == "raise" and rank == fail_rank:
    time.sleep(0.5)
    raise RuntimeError(f"deliberate failure in process {rank}")
if mode in ("hang", "nojax", "late"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
