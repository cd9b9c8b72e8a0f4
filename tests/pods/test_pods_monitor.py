"""The rank-deviation monitor compiled (not run) for H100s and TPU v5e chips:
it sends no bytes and needs no temporary memory there."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import test_pods  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from benchmarks import monitor_cost  # noqa: E402

pytestmark = test_pods.pytestmark

ELEMENTS = 4_000_000


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_the_monitor_costs_no_bytes_and_no_memory(platform):
    off, on = (monitor_cost.measure(ELEMENTS, 0, m, platform) for m in (False, True))
    assert on["sent_mib"] == off["sent_mib"]
    shapes = monitor_cost.leaf_shapes(ELEMENTS)
    formula = sr.comm_stats({k: monitor_cost.zeros(s) for k, s in shapes.items()}, 8,
                            skip_ratio=0.5, min_size=0).bytes_per_device
    assert off["sent_mib"] == pytest.approx(formula / 2**20)
    assert on["temp_mib"] <= off["temp_mib"] + 0.5
