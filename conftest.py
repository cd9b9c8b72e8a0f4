"""Pytest set-up: 8 simulated CPU devices, configured before JAX initialises.

The docstring examples (tests/test_docstring_examples.py) get nothing
more: each imports what it uses.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
