"""Multi-process check: a clean job whose processes end far apart.

Usage: ``uneven_exit.py SECONDS``. Both processes run one collective; then
process 1 works SECONDS longer on the host alone (e.g. writing a report)
before exiting 0. Prints ``RESULT done`` per process.
"""

import sys
import time

from skipreduce_jax import initialize

initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import skipreduce_jax as sr  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",))
sr.assert_replicated(sr.replicate(np.ones(4, np.float32), mesh), mesh)
if jax.process_index() == 1:
    time.sleep(float(sys.argv[1]))
print(f"RESULT done process={jax.process_index()}", flush=True)
