"""Pytest set-up for the tests and the docstring examples.

8 simulated CPU devices, configured before JAX initialises, and the names
the docstring examples use (``mesh`` is an 8-device mesh with one axis
``"data"``).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    import skipreduce_jax as sr

    doctest_namespace.update(
        jax=jax, jnp=jnp, np=np, optax=optax, P=P, NamedSharding=NamedSharding,
        sr=sr, mesh=jax.make_mesh((8,), ("data",)))
