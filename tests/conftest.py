"""Test set-up: the repository's conftest.py configures 8 simulated CPU devices."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"

# Scripts the multi-process tests launch; not test modules.
collect_ignore_glob = ["mp_scripts/*"]
