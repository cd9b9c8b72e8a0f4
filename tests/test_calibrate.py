"""benchmarks/calibrate.py: its verdict on synthetic benchmark files."""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import calibrate  # noqa: E402
from skipreduce_jax.cost import LinkModel, Measurement, predict_measurement  # noqa: E402

TRUE = LinkModel(alpha=1e-3, bandwidth=1e8, call_overhead=5e-3)


def _write(path, sizes, n=4, error=0.0):
    """A collectives_*.json with psum, ring and static rows timed by TRUE."""
    rows = []
    for size in sizes:
        for mode, kind, ks in (("psum", "psum", [0]), ("ring", "ring", [0]),
                               ("static", "skip", range(1, n))):
            for k in ks:
                m = Measurement(n=n, num_skip=k, nbytes=4 * size, seconds=1.0,
                                kind=kind)
                seconds = predict_measurement(TRUE, m) * (1 + error)
                rows.append(dict(kind=kind, mode=mode, size=size, num_skip=k,
                                 nbytes=4 * size, seconds=seconds, iqr=0.0))
    path.write_text(json.dumps(dict(meta=dict(n=n), rows=rows)))
    return path


def test_checks_within_and_beyond_the_target(tmp_path):
    fit = _write(tmp_path / "fit.json", [1 << 18, 1 << 20, 1 << 22])
    good = _write(tmp_path / "good.json", [1 << 21], error=0.05)
    bad = _write(tmp_path / "bad.json", [1 << 21], error=0.2)
    assert calibrate.main(["--fit", str(fit), "--check", str(good)]) == 0
    assert calibrate.main(["--fit", str(fit), "--check", str(bad)]) == 1


def test_nothing_checked_is_not_a_pass(tmp_path, capsys):
    fit = _write(tmp_path / "fit.json", [1 << 18, 1 << 20, 1 << 22])
    assert calibrate.main(["--fit", str(fit)]) == 1
    assert "nothing to judge" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--gate 'rnig'"):
        calibrate.main(["--fit", str(fit), "--gate", "rnig"])
