"""Pytest set-up: 8 simulated CPU devices, configured before JAX initialises.

The docstring examples (tests/test_docstring_examples.py) get nothing
more: each imports what it uses.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU aborts the process when a collective waits 40 s for one of its
# device threads. Two test workers on two cores can starve a thread that
# long (CI saw it once), so the limit is raised; a true deadlock still ends.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_cpu_collective_call_warn_stuck_timeout_seconds=60"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()
