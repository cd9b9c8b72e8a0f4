"""Test set-up: the repository's conftest.py configures 8 simulated CPU devices."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
