"""The time-to-accuracy benchmark's bookkeeping (smoothing, target, speedup)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import time_to_accuracy as tta  # noqa: E402


def _result(times, accs, nbytes=100.0):
    losses = [1.0 - a for a in accs]
    return dict(history=dict(time=times, acc=accs, loss=losses),
                formula_bytes=nbytes)


def test_smoothed_is_a_trailing_mean():
    assert tta.smoothed([0.0, 0.3, 0.6, 0.9], 3) == pytest.approx(
        [0.0, 0.15, 0.3, 0.6])
    assert tta.smoothed([0.5, 0.7], 1) == [0.5, 0.7]


def test_target_and_speedup_use_smoothed_curves():
    t = [0.0, 2.0, 4.0, 6.0, 8.0]
    results = {
        # A lucky last evaluation (0.99) does not set the target.
        "all-reduce": _result(t, [0.1, 0.90, 0.95, 0.95, 0.99]),
        "random": _result(t, [0.1, 0.95, 0.97, 0.97, 0.96], nbytes=60.0),
        "slow": _result(t, [0.1, 0.5, 0.6, 0.7, 0.8], nbytes=1.0),
    }
    target = tta.summarize(results, tolerance=0.0, window=3)
    assert target == pytest.approx((0.95 + 0.95 + 0.99) / 3)
    assert results["all-reduce"]["time_to_target"] == 8.0
    # random's smoothed curve: 0.1, 0.525, 0.673, 0.963, 0.967.
    assert results["random"]["time_to_target"] == 6.0
    assert results["random"]["speedup"] == pytest.approx(8.0 / 6.0)
    assert results["random"]["bytes_ratio"] == pytest.approx(0.6)
    assert results["slow"]["time_to_target"] is None
    assert results["slow"]["speedup"] is None
    # The loss target (here 1 - accuracy) is reached at the same times.
    assert results["random"]["time_to_loss"] == 6.0
    assert results["random"]["speedup_loss"] == pytest.approx(8.0 / 6.0)
    # Raw curves (window 1): the baseline's last value is the target.
    tta.summarize(results, tolerance=0.0, window=1)
    assert results["random"]["time_to_target"] is None
