"""Tests for the alpha-beta cost model in skipreduce_jax.cost."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from skipreduce_jax import cost
from skipreduce_jax.cost import (
    LinkModel,
    Measurement,
    fit_link_model,
    hierarchical_bytes,
    load_link_model,
    load_measurements,
    main,
    parse_count,
    parse_seconds,
    parse_size,
    predict_allreduce,
    predict_hierarchical,
    predict_hierarchical_allreduce,
    predict_measurement,
    predict_skipreduce,
    required_num_skip,
    required_num_skip_hierarchical,
    required_skip_ratio,
    ring_allreduce_bytes,
    save_link_model,
    save_measurements,
    skip_ratio_to_num_skip,
    skipreduce_bytes,
    skipreduce_steps,
    traffic_fraction,
    validate,
)

TRUE = LinkModel(alpha=20e-6, bandwidth=12.5e9, call_overhead=100e-6)


def synthetic(
    model: LinkModel,
    *,
    ns: tuple[int, ...] = (4, 8),
    sizes: tuple[int, ...] = (10**4, 10**5, 10**6, 10**7, 10**8),
    noise: float = 0.0,
    seed: int = 0,
    kind: str = "skip",
) -> list[Measurement]:
    """Measurements whose times come from ``model``, with optional log-normal noise."""
    rng = np.random.default_rng(seed)
    out = []
    for n in ns:
        for k in range(n) if kind == "skip" else (0,):
            for b in sizes:
                m = Measurement(n=n, num_skip=k, nbytes=b, seconds=1.0, kind=kind)
                t = predict_measurement(model, m) * float(np.exp(rng.normal(0.0, noise)))
                out.append(dataclasses.replace(m, seconds=t))
    return out


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


# --------------------------------------------------------------------------
# Byte, step and ratio formulas
# --------------------------------------------------------------------------


def test_ring_bytes_hand_computed() -> None:
    assert ring_allreduce_bytes(1000, 4) == 1500.0  # 2 * 3 * 250
    assert ring_allreduce_bytes(800, 8) == 1400.0  # 2 * 7 * 100
    assert ring_allreduce_bytes(123, 1) == 0.0


def test_skipreduce_bytes_hand_computed() -> None:
    assert skipreduce_bytes(1000, 4, 0) == ring_allreduce_bytes(1000, 4)
    assert skipreduce_bytes(1000, 4, 1) == 1250.0  # 5 steps of 250
    # k = n - 1: only the all-gather, (n - 1) / n of the buffer.
    assert skipreduce_bytes(1000, 4, 3) == 750.0
    assert skipreduce_bytes(800, 8, 7) == 700.0
    for n in (2, 3, 16, 4096):
        assert skipreduce_bytes(n * 10, n, n - 1) == pytest.approx((n - 1) * 10)


def test_steps_and_traffic_fraction() -> None:
    assert skipreduce_steps(8) == 14
    assert skipreduce_steps(8, 7) == 7
    assert skipreduce_steps(1) == 0
    assert traffic_fraction(8, 0) == 1.0
    assert traffic_fraction(8, 7) == 0.5
    assert traffic_fraction(5, 2) == 0.75
    assert traffic_fraction(1, 0) == 1.0
    for n in (2, 7, 100):
        for k in range(n):
            assert traffic_fraction(n, k) == pytest.approx(
                skipreduce_bytes(1e6, n, k) / ring_allreduce_bytes(1e6, n)
            )


@pytest.mark.parametrize(
    ("ratio", "n", "k"),
    [
        (0.5, 8, 4),  # 3.5 rounds half up
        (0.0, 8, 0),
        (1.0, 8, 7),
        (0.5, 4, 2),  # 1.5 -> 2
        (0.5, 6, 3),  # 2.5 -> 3, not to the even 2
        (0.5, 2, 1),  # 0.5 -> 1
        (0.25, 11, 3),  # 2.5 -> 3
        (0.3, 5, 1),  # 1.2 -> 1
        (0.375, 5, 2),  # 1.5 -> 2
        (0.2, 8, 1),  # 1.4 -> 1
        (0.9, 2, 1),
        (0.4, 2, 0),
        (1.0, 1, 0),
    ],
)
def test_skip_ratio_rounding(ratio: float, n: int, k: int) -> None:
    assert skip_ratio_to_num_skip(ratio, n) == k


def test_skip_ratio_round_trip() -> None:
    for n in range(2, 130):
        for k in range(n):
            assert skip_ratio_to_num_skip(k / (n - 1), n) == k
    # Also past a million ranks, where fractions of denominator 1e6 are too
    # coarse to tell k / (n - 1) apart.
    for n in (3_000_001, 40_000_001):
        for k in (1, 2, 3, n // 2, n - 2):
            assert skip_ratio_to_num_skip(k / (n - 1), n) == k


def test_hierarchical_bytes_hand_computed() -> None:
    # inner: 2 * (1/2) * 800; outer: 6 steps of 800 / (2 * 4).
    assert hierarchical_bytes(800, 4, 2, 0) == (800.0, 600.0)
    assert hierarchical_bytes(800, 4, 2, 3) == (800.0, 300.0)
    assert hierarchical_bytes(800, 4, 1, 2) == (0.0, skipreduce_bytes(800, 4, 2))


# --------------------------------------------------------------------------
# Time predictions
# --------------------------------------------------------------------------


def test_predict_hand_computed() -> None:
    link = LinkModel.from_gbit(100, alpha=10e-6, call_overhead=50e-6)
    assert link.bandwidth == 12.5e9
    # 50 us + 14 * 10 us + 175 MB / 12.5 GB/s
    assert predict_allreduce(100e6, 8, link) == pytest.approx(0.01419, rel=1e-12)
    # 50 us + 7 * 10 us + 87.5 MB / 12.5 GB/s
    assert predict_skipreduce(100e6, 8, 7, link) == pytest.approx(0.00712, rel=1e-12)
    assert predict_skipreduce(100e6, 8, 0, link) == predict_allreduce(100e6, 8, link)
    assert predict_allreduce(100e6, 1, link) == 0.0


def test_link_model_constructors() -> None:
    assert LinkModel.from_gbit(8).bandwidth == 1e9
    assert LinkModel.from_gbyte(2).bandwidth == 2e9
    assert LinkModel.from_gbit(100).gbit_per_s == pytest.approx(100)
    link = LinkModel(alpha=1e-6, bandwidth=1e9, call_overhead=5e-6)
    assert link.time(4, 1e6) == pytest.approx(5e-6 + 4e-6 + 1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        link.alpha = 0.0  # type: ignore[misc]


@pytest.mark.parametrize("n", [2, 3, 8, 64, 4096])
def test_time_and_bytes_strictly_decrease_with_k(n: int) -> None:
    link = LinkModel.from_gbit(100, alpha=5e-6, call_overhead=20e-6)
    times = [predict_skipreduce(1e8, n, k, link) for k in range(n)]
    sizes = [skipreduce_bytes(1e8, n, k) for k in range(n)]
    assert all(a > b for a, b in zip(times, times[1:]))
    assert all(a > b for a, b in zip(sizes, sizes[1:]))


def test_hierarchical_reduces_to_flat_when_inner_is_one() -> None:
    outer = LinkModel.from_gbit(25, alpha=8e-6, call_overhead=30e-6)
    inner = LinkModel.from_gbit(2400, alpha=1e-6, call_overhead=10e-6)
    for n in (2, 5, 16):
        for k in range(n):
            assert predict_hierarchical(3e7, n, 1, k, outer, inner) == predict_skipreduce(
                3e7, n, k, outer
            )


def test_hierarchical_single_host_is_inner_ring() -> None:
    inner = LinkModel.from_gbit(800, alpha=2e-6)
    outer = LinkModel.from_gbit(1, alpha=1.0, call_overhead=1.0)  # must not matter
    assert predict_hierarchical(1e9, 1, 8, 0, outer, inner) == pytest.approx(
        predict_allreduce(1e9, 8, inner)
    )


def test_hierarchical_hand_computed() -> None:
    slow = LinkModel.from_gbit(100, alpha=1e-5, call_overhead=1e-4)
    fast = LinkModel.from_gbit(800, alpha=1e-6, call_overhead=2e-5)
    # inner: 2 calls * (20 us + 7 * 1 us + 0.875e9 B / 1e11 B/s)
    inner = 2 * (2e-5 + 7e-6 + 0.875e9 / 1e11)
    # outer: 100 us + (6 - k) * (10 us + 1e9 / 32 / 12.5e9)
    for k in range(4):
        outer = 1e-4 + (6 - k) * (1e-5 + 1e9 / 32 / 12.5e9)
        assert predict_hierarchical(1e9, 4, 8, k, slow, fast) == pytest.approx(inner + outer)
    assert predict_hierarchical_allreduce(1e9, 4, 8, slow, fast) == predict_hierarchical(
        1e9, 4, 8, 0, slow, fast
    )


# --------------------------------------------------------------------------
# required_num_skip
# --------------------------------------------------------------------------

# n = 5, nbytes = 5, bandwidth = 1 B/s: time(k) = 8 - k seconds, exactly.
EXACT = LinkModel(alpha=0.0, bandwidth=1.0)


@pytest.mark.parametrize(
    ("target", "k"),
    [(100.0, 0), (8.0, 0), (7.999, 1), (6.0, 2), (4.0, 4), (3.999, None), (0.0, None)],
)
def test_required_num_skip_boundaries(target: float, k: int | None) -> None:
    assert required_num_skip(5, 5, EXACT, target) == k


def test_required_skip_ratio() -> None:
    assert required_skip_ratio(5, 5, EXACT, 6.0) == 0.5
    assert required_skip_ratio(5, 5, EXACT, 4.0) == 1.0
    assert required_skip_ratio(5, 5, EXACT, 8.0) == 0.0
    assert required_skip_ratio(5, 5, EXACT, 3.0) is None
    assert required_num_skip(5, 1, EXACT, 0.0) == 0
    assert required_skip_ratio(5, 1, EXACT, 0.0) == 0.0


def test_required_num_skip_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(2, 300))
        link = LinkModel(
            alpha=float(rng.uniform(0, 1e-4)),
            bandwidth=float(rng.uniform(1e8, 1e11)),
            call_overhead=float(rng.uniform(0, 1e-3)),
        )
        nbytes = float(rng.uniform(0, 1e9))
        target = float(rng.uniform(0, 1.2)) * predict_allreduce(nbytes, n, link)
        times = [predict_skipreduce(nbytes, n, k, link) for k in range(n)]
        expected = next((k for k, t in enumerate(times) if t <= target), None)
        assert required_num_skip(nbytes, n, link, target) == expected


def test_required_num_skip_hierarchical() -> None:
    slow, fast = LinkModel.from_gbit(100), LinkModel.from_gbit(800)
    times = [predict_hierarchical(1e9, 4, 8, k, slow, fast) for k in range(4)]
    assert required_num_skip_hierarchical(1e9, 4, 8, slow, fast, times[2]) == 2
    assert required_num_skip_hierarchical(1e9, 4, 8, slow, fast, times[0]) == 0
    assert required_num_skip_hierarchical(1e9, 4, 8, slow, fast, times[3] * 0.999) is None


# --------------------------------------------------------------------------
# Fitting and validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["relative", "absolute"])
def test_fit_recovers_exact_constants(weighting: str) -> None:
    fit = fit_link_model(synthetic(TRUE), weighting=weighting)  # type: ignore[arg-type]
    assert fit.alpha == pytest.approx(TRUE.alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(TRUE.bandwidth, rel=1e-6)
    assert fit.call_overhead == pytest.approx(TRUE.call_overhead, rel=1e-6)


def test_fit_recovers_constants_with_noise() -> None:
    fit = fit_link_model(synthetic(TRUE, noise=0.01, seed=0))
    assert fit.alpha == pytest.approx(TRUE.alpha, rel=0.05)
    assert fit.bandwidth == pytest.approx(TRUE.bandwidth, rel=0.02)
    assert fit.call_overhead == pytest.approx(TRUE.call_overhead, rel=0.1)


def test_fit_zero_parameter_stays_exactly_zero() -> None:
    true = LinkModel(alpha=0.0, bandwidth=5e9, call_overhead=1e-4)
    fit = fit_link_model(synthetic(true))
    assert fit.alpha == 0.0
    assert fit.bandwidth == pytest.approx(5e9, rel=1e-9)
    assert fit.call_overhead == pytest.approx(1e-4, rel=1e-9)


def test_fit_clips_negative_intercept_to_zero() -> None:
    # A negative constant offset: unconstrained least squares wants a negative
    # call overhead; the fit must keep it at 0 and stay close otherwise.
    base = synthetic(LinkModel(alpha=50e-6, bandwidth=1e9), sizes=(10**5, 10**6, 10**7))
    pts = [dataclasses.replace(m, seconds=m.seconds - 20e-6) for m in base]
    x = np.array([[1.0, m.steps, m.wire_bytes] for m in pts])
    y = np.array([m.seconds for m in pts])
    unconstrained, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    assert unconstrained[0] < 0
    fit = fit_link_model(pts)
    assert fit.call_overhead == 0.0
    assert fit.alpha > 0
    assert fit.bandwidth == pytest.approx(1e9, rel=0.05)


def test_fit_collinear_alpha_goes_to_overhead() -> None:
    # One n and one k: steps are constant, so alpha cannot be told from the
    # per-call constant; the constant goes to call_overhead.
    pts = [m for m in synthetic(TRUE, ns=(8,)) if m.num_skip == 0]
    fit = fit_link_model(pts)
    assert fit.alpha == 0.0
    assert fit.call_overhead == pytest.approx(TRUE.call_overhead + 14 * TRUE.alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(TRUE.bandwidth, rel=1e-6)
    assert all(abs(v.rel_error) < 1e-9 for v in validate(fit, pts))


def test_fit_with_fixed_parameters() -> None:
    true = LinkModel(alpha=30e-6, bandwidth=2e9)
    fit = fit_link_model(synthetic(true), fit_overhead=False)
    assert fit.call_overhead == 0.0
    assert fit.alpha == pytest.approx(30e-6, rel=1e-6)
    fit = fit_link_model(synthetic(TRUE), fit_alpha=False, fit_overhead=False)
    assert fit.alpha == 0.0 and fit.call_overhead == 0.0


def test_fit_errors() -> None:
    with pytest.raises(ValueError, match="measurements"):
        fit_link_model([])
    with pytest.raises(ValueError, match="bandwidth"):
        fit_link_model([Measurement(4, 0, 0, 1e-3), Measurement(8, 2, 0, 2e-3)])
    with pytest.raises(ValueError, match="weighting"):
        fit_link_model(synthetic(TRUE), weighting="l1")  # type: ignore[arg-type]


def test_validate_relative_errors() -> None:
    pts = synthetic(TRUE, ns=(4,), sizes=(10**6,))
    doubled = [dataclasses.replace(m, seconds=2 * m.seconds) for m in pts]
    rows = validate(TRUE, doubled)
    assert len(rows) == len(pts)
    for row, m in zip(rows, doubled):
        measurement, predicted, rel_error = row
        assert measurement is m
        assert predicted == pytest.approx(m.seconds / 2)
        assert rel_error == pytest.approx(-0.5)


# --------------------------------------------------------------------------
# JSON files
# --------------------------------------------------------------------------


def test_measurements_json_round_trip(tmp_path: Path) -> None:
    pts = synthetic(TRUE, ns=(4,), sizes=(1000, 4000)) + synthetic(TRUE, kind="psum")
    path = tmp_path / "m.json"
    save_measurements(path, pts)
    assert load_measurements(path) == pts
    # A bare list works too.
    path.write_text(json.dumps([m.to_dict() for m in pts]))
    assert load_measurements(path) == pts


def test_measurements_json_lenient_and_strict(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(
        json.dumps(
            {
                "backend": "gloo",
                "measurements": [
                    {"n": 4, "nbytes": 4e6, "seconds": 0.01, "kind": "psum", "repeat": 3},
                    {"n": 4, "num_skip": 2, "nbytes": 4000000, "seconds": 0.005},
                ],
            }
        )
    )
    assert load_measurements(path) == [
        Measurement(4, 0, 4_000_000, 0.01, "psum"),
        Measurement(4, 2, 4_000_000, 0.005, "skip"),
    ]
    path.write_text(json.dumps([{"n": 4, "nbytes": 10, "seconds": 0.1}]))
    with pytest.raises(ValueError, match="num_skip"):
        load_measurements(path)
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(ValueError, match="measurements"):
        load_measurements(path)


def test_link_model_json_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "link.json"
    save_link_model(path, TRUE)
    assert load_link_model(path) == TRUE
    assert LinkModel.from_dict(TRUE.to_dict()) == TRUE
    path.write_text(json.dumps(TRUE.to_dict()))
    assert load_link_model(path) == TRUE


# --------------------------------------------------------------------------
# Argument errors
# --------------------------------------------------------------------------

LINK = LinkModel.from_gbit(100)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ring_allreduce_bytes(100, 0), "n"),
        (lambda: skipreduce_bytes(100, -3, 0), "n"),
        (lambda: skipreduce_bytes(100, 8, 8), "num_skip"),
        (lambda: skipreduce_bytes(100, 8, -1), "num_skip"),
        (lambda: skipreduce_bytes(-1, 8, 0), "nbytes"),
        (lambda: skipreduce_bytes(math.nan, 8, 0), "nbytes"),
        (lambda: traffic_fraction(4, 4), "num_skip"),
        (lambda: skip_ratio_to_num_skip(1.5, 8), "skip_ratio"),
        (lambda: skip_ratio_to_num_skip(-0.1, 8), "skip_ratio"),
        (lambda: skip_ratio_to_num_skip(0.5, 0), "n"),
        (lambda: LinkModel(alpha=0.0, bandwidth=0.0), "bandwidth"),
        (lambda: LinkModel(alpha=0.0, bandwidth=-1e9), "bandwidth"),
        (lambda: LinkModel(alpha=-1e-6, bandwidth=1e9), "alpha"),
        (lambda: LinkModel(alpha=0.0, bandwidth=1e9, call_overhead=-1.0), "call_overhead"),
        (lambda: LinkModel.from_gbit(0), "gbit_per_s"),
        (lambda: predict_skipreduce(-5, 8, 0, LINK), "nbytes"),
        (lambda: predict_skipreduce(100, 8, 9, LINK), "num_skip"),
        (lambda: predict_hierarchical(100, 4, 0, 0, LINK, LINK), "n_inner"),
        (lambda: predict_hierarchical(100, 4, 2, 4, LINK, LINK), "num_skip"),
        (lambda: required_num_skip(100, 8, LINK, -1.0), "target_seconds"),
        (lambda: Measurement(1, 0, 100, 1.0), "n"),
        (lambda: Measurement(4, 4, 100, 1.0), "num_skip"),
        (lambda: Measurement(4, 1, 100, 0.0), "seconds"),
        (lambda: Measurement(4, 1, -100, 1.0), "nbytes"),
        (lambda: Measurement(4, 1, 100.5, 1.0), "nbytes"),
        (lambda: Measurement(4, 1, 100, 1.0, kind="ring"), "num_skip"),
        (lambda: Measurement(4, 0, 100, 1.0, kind="nccl"), "kind"),
    ],
)
def test_bad_arguments_name_the_argument(call: Callable[[], Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call()


def test_wrong_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="n"):
        ring_allreduce_bytes(100, 4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="link"):
        predict_allreduce(100, 4, 12.5e9)  # type: ignore[arg-type]


def test_parsers() -> None:
    assert parse_size("100MB") == 100_000_000
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size("4096") == 4096
    assert parse_size("2 kb") == 2000
    assert parse_count("25M") == 25_000_000
    assert parse_count("1.3B") == 1_300_000_000
    assert parse_seconds("10us") == 1e-5
    assert parse_seconds("2.5ms") == 2.5e-3
    assert parse_seconds("3") == 3.0
    for bad in ("-1MB", "10XB", "MB", ""):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="time"):
        parse_seconds("5 min")


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def test_cli_predict_table(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_cli(
        capsys, "predict", "--n", "8", "--size", "100MB", "--gbit", "100",
        "--alpha", "10us", "--overhead", "50us", "--k", "0", "2", "4", "7",
    )
    assert "ring all-reduce: 14.19 ms, 175 MB sent per rank" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[5:]}
    assert rows["0"][-3:] == ["14.19", "ms", "1.000x"]
    assert rows["7"][-3:] == ["7.12", "ms", "1.993x"]  # 14.19 / 7.12
    assert "50.0%" in rows["7"]


def test_cli_predict_ratios_and_params(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_cli(
        capsys, "predict", "--n", "8", "--params", "25M", "--dtype", "float32",
        "--gbit", "100", "--ratio", "0", "0.5", "1", "--json",
    )
    data = json.loads(out)
    assert data["nbytes"] == 100_000_000
    assert [r["num_skip"] for r in data["rows"]] == [0, 4, 7]
    assert data["rows"][2]["seconds"] == pytest.approx(0.007)
    assert data["rows"][2]["speedup"] == pytest.approx(2.0)


def test_cli_predict_hierarchical(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_cli(
        capsys, "predict", "--n", "16", "--params", "25M", "--dtype", "bf16",
        "--gbit", "25", "--inner", "8", "--inner-gbit", "2400", "--ratio", "0", "0.5", "1",
    )
    # inner: 87.5 MB / 300 GB/s; outer: 30 * 50 MB / 128 / 3.125 GB/s.
    assert "hierarchical all-reduce (k=0): 4.042 ms" in out
    assert "1.865x" in out  # 4.0417 / (0.2917 + 1.875)
    out = run_cli(
        capsys, "predict", "--n", "16", "--size", "50MB", "--gbit", "25", "--inner", "1",
        "--k", "15", "--json",
    )
    assert json.loads(out)["rows"][0]["seconds"] == pytest.approx(
        predict_skipreduce(50e6, 16, 15, LinkModel.from_gbit(25))
    )


def test_cli_target(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["target", "--n", "64", "--size", "1GB", "--gbit", "100"]
    out = run_cli(capsys, *args, "--time", "150ms")
    assert "needed: k=6 of 63" in out
    data = json.loads(run_cli(capsys, *args, "--time", "50ms", "--json"))
    assert data["num_skip"] is None and data["skip_ratio"] is None
    assert data["min_seconds"] == pytest.approx(0.07875)


def test_cli_fit_check_and_save(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    train, other = tmp_path / "train.json", tmp_path / "other.json"
    save_measurements(train, synthetic(TRUE))
    save_measurements(other, synthetic(TRUE, ns=(16,), sizes=(10**6,), noise=0.02, seed=3))
    saved = tmp_path / "link.json"
    out = run_cli(capsys, "fit", str(train), "--check", str(other), "--save", str(saved))
    assert "bandwidth      1.25e+10 B/s (100 Gbit/s)" in out
    assert "alpha          2e-05 s (20 us per step)" in out
    assert "call_overhead  0.0001 s (100 us)" in out
    assert "max |rel err| 0.00%" in out  # residuals of a noise-free fit
    assert f"check against {other}" in out
    assert load_link_model(saved).bandwidth == pytest.approx(TRUE.bandwidth)

    data = json.loads(run_cli(capsys, "fit", "--fit", str(train), "--check", str(other), "--json"))
    assert data["model"]["alpha"] == pytest.approx(TRUE.alpha)
    assert len(data["check"]) == 16
    assert max(abs(r["rel_error"]) for r in data["check"]) < 0.1

    out = run_cli(capsys, "check", str(other), "--model", str(saved))
    assert "16 points" in out


def test_cli_fit_kind_filter(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    psum = LinkModel(alpha=5e-6, bandwidth=40e9, call_overhead=30e-6)
    path = tmp_path / "mixed.json"
    save_measurements(path, synthetic(TRUE) + synthetic(psum, kind="psum"))
    for kind, model in (("skip", TRUE), ("psum", psum)):
        data = json.loads(run_cli(capsys, "fit", str(path), "--kind", kind, "--json"))
        assert data["model"]["bandwidth"] == pytest.approx(model.bandwidth, rel=1e-6)
        assert {r["kind"] for r in data["residuals"]} == {kind}
    data = json.loads(run_cli(capsys, "fit", str(path), "--json"))
    assert len(data["residuals"]) == len(load_measurements(path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "--n", "1", "--size", "1MB", "--gbit", "1"], "--n"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "1", "--k", "8"], "--k"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "1", "--ratio", "2"], "--ratio"),
        (["predict", "--n", "8", "--size", "1MB"], "--gbit"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "0"], "gbit_per_s"),
        (["predict", "--n", "8", "--size", "1XB", "--gbit", "1"], "size"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "1", "--inner", "4"], "--inner"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "1", "--inner-overhead", "1s"],
         "--inner-overhead need --inner"),
        (["predict", "--n", "8", "--size", "1MB", "--gbit", "1", "--inner-alpha", "1ms"],
         "--inner-overhead need --inner"),
        (["target", "--n", "8", "--size", "1MB", "--gbit", "1"], "--time"),
        (["fit"], "FILE"),
    ],
)
def test_cli_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_module_runs_as_script() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "skipreduce_jax.cost", "predict", "--n", "4", "--size", "4MB",
         "--gbit", "8", "--k", "3"],
        capture_output=True, text=True, check=True, timeout=60,
    )
    assert "3 ms" in proc.stdout  # 3 steps of 1 MB at 1 GB/s


def test_docstring_examples() -> None:
    result = doctest.testmod(cost)
    assert result.attempted > 20
    assert result.failed == 0


def test_decimal_and_fractional_skip_ratios_round_half_up_exactly():
    # 0.7 * 45 is 31.5 on paper but 31.499... in floats, and 1/6 * 3 is 0.5
    # but 0.49999...: the rule must see the ratio meant.
    from fractions import Fraction
    ratios = {Fraction(p, q) for q in range(1, 13) for p in range(q + 1)}
    ratios |= {Fraction(h, 100) for h in range(101)}
    for n in range(2, 200):
        for ratio in ratios:
            want = (ratio * (n - 1) + Fraction(1, 2)).__floor__()
            assert skip_ratio_to_num_skip(ratio.numerator / ratio.denominator,
                                          n) == want, (ratio, n)


def test_fit_refuses_times_that_do_not_grow_with_bytes() -> None:
    # Latency-bound points (about 1 ms whatever the size): a constant fits
    # them within 1%; a positive bandwidth term would be made up.
    flat = [Measurement(8, 0, b, t) for b, t in ((1e3, 1.01e-3), (1e4, 1.00e-3),
                                                 (1e5, 0.99e-3))]
    with pytest.raises(ValueError, match="do not determine a positive bandwidth"):
        fit_link_model(flat)
