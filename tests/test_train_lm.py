"""Smoke test of ``examples/train_lm.py``: a tiny byte-level LM trains."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_lm  # noqa: E402

# A tiny configuration: 30 steps of a one-block, width-32 model on 32-byte
# sequences. Over seeds 0-4 the validation loss fell from ln(256) = 5.55 to
# 3.19-3.43 nats/byte for both variants, and Random SkipReduce (k = 4 of 7)
# ended between -0.003 and +0.021 of the all-reduce baseline.
_ARGS = [
    "--steps", "30", "--batch-per-rank", "4", "--seq-len", "32",
    "--d-model", "32", "--layers", "1", "--heads", "2", "--lr", "1e-2",
    "--warmup", "5", "--eval-every", "30", "--val-windows", "64",
    "--train-mb", "0.5", "--val-mb", "0.0625", "--seed", "0",
    "--variants", "allreduce,random", "--no-progress",
]


@pytest.mark.slow
def test_tiny_lm_trains_with_and_without_skipping(tmp_path):
    report = train_lm.main(_ARGS + ["--out", str(tmp_path)])
    base = report["results"]["allreduce"]
    skip = report["results"]["random"]

    for result in (base, skip):
        initial, final = result["evals"][0][1], result["final_val_loss"]
        assert abs(initial - math.log(256)) < 0.2
        assert final < initial - 1.5, result["evals"]
        assert result["bits_per_byte"] == pytest.approx(final / math.log(2))
    # Same init: both start from the same validation loss.
    assert skip["evals"][0] == base["evals"][0]
    # Skipping changed the training (k = 4 of 7 steps on 8 ranks) ...
    assert skip["comm"]["num_skip"] == 4
    assert skip["train_loss"] != base["train_loss"]
    # ... but not the outcome (observed |difference| <= 0.021).
    assert abs(skip["final_val_loss"] - base["final_val_loss"]) < 0.1
    # Baseline is a plain pmean; SkipReduce sends less.
    assert base["comm"]["num_skip"] == 0
    assert skip["comm"]["ratio"] < 0.8

    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["results"]["random"]["final_val_loss"] == skip["final_val_loss"]
    assert (tmp_path / "val_loss.png").stat().st_size > 0


@pytest.mark.parametrize("change, message", [
    (["--heads", "3"], "--d-model 32 must be a multiple of --heads 3"),
    (["--min-size", "-1"], "--min-size and --warmup must be >= 0"),
    (["--variants", "random,random"], "names a variant twice"),
    (["--steps", "1"], "--steps must be >= 2"),
])
def test_bad_arguments_are_usage_errors(change, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_lm.parse_args(_ARGS + change)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
