"""The collective benchmark's ring parts and overlap probes compute what
they claim to time."""

import pathlib
import sys

import jax
import numpy as np
import pytest
from helpers import under_scan3_while
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import skipreduce_jax as sr  # noqa: E402
from benchmarks import collectives as cb  # noqa: E402
from skipreduce_jax._ring.buckets import plan_buckets  # noqa: E402
from skipreduce_jax._ring.ring import put_in_slot_order  # noqa: E402

N = 8
SIZE = 8 * 1024  # elements per rank: 4 sub-chunks of 256 per slot


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), (cb.AXIS,))


def _inputs(mesh):
    x = np.random.default_rng(0).standard_normal(N * SIZE).astype(np.float32)
    key = np.array([3, 7], np.uint32)
    return (x, jax.device_put(x, NamedSharding(mesh, P(cb.AXIS))),
            jax.device_put(key, NamedSharding(mesh, P())))


def _per_rank(out):
    """A sharded output as ``[N, elements per rank]``."""
    return np.asarray(out).reshape(N, -1)


def test_breakdown_lists_the_overlap_probes():
    names = [v.name for v in cb.make_variants(N, [0], ["static"], breakdown=True)]
    assert names[-2:] == [cb.BESIDE, cb.BESIDE_PIECES]
    for name in (cb.BESIDE, cb.BESIDE_PIECES):
        # One ring step of traffic; the reorder sends nothing.
        assert cb.expected_wire_bytes(SIZE, N, cb.Variant(name, "part")) == SIZE // N * 4


@under_scan3_while
@pytest.mark.parametrize("pieces", [1, 4])
def test_step_beside_reorder_returns_the_step_and_the_reorder(mesh, pieces):
    x, xs, key = _inputs(mesh)
    name = cb.BESIDE if pieces == 1 else cb.BESIDE_PIECES
    outs = cb.build_function(cb.Variant(name, "part"), mesh, "native",
                             overlap_pieces=pieces)(xs, key)
    assert len(outs) == 1 + pieces
    step = _per_rank(outs[0])
    ranks = x.reshape(N, SIZE)
    # Rank r received the first 1/N of rank r - 1's buffer.
    np.testing.assert_array_equal(step, np.roll(ranks[:, : SIZE // N], 1, axis=0))

    reorder = _per_rank(cb.build_function(cb.Variant(cb.REORDER, "part"), mesh,
                                          "native")(xs, key))
    bucket = plan_buckets(cb.jax_shape_struct(SIZE), group_size=N).buckets[0]
    assert bucket.padded_size == SIZE and bucket.chunks_per_rank > 1
    schedule = sr.make_schedule(N, num_skip=1, key=jax.random.wrap_key_data(key),
                                chunks_per_rank=bucket.chunks_per_rank)
    expected = np.stack([np.asarray(put_in_slot_order(
        ranks[r].reshape(N, bucket.chunks_per_rank, -1), schedule)).reshape(-1)
        for r in range(N)])
    np.testing.assert_array_equal(reorder, expected)
    # Pieces cut every sub-chunk; put back together they are the reorder.
    parts = [_per_rank(out).reshape(N, N, bucket.chunks_per_rank, -1) for out in outs[1:]]
    np.testing.assert_array_equal(np.concatenate(parts, axis=3).reshape(N, SIZE), reorder)
    assert not np.array_equal(reorder, ranks), "the reorder moved nothing"


def test_overlap_summary_reports_the_hidden_share():
    line = cb.overlap_summary(step=0.100, reorder=0.050, one=0.150, pieces=0.100)
    assert "apart 150.0 ms" in line
    assert "150.0 ms (reorder hidden 0%)" in line
    assert "100.0 ms (hidden 100%)" in line
    assert "hidden 50%" in cb.overlap_summary(0.1, 0.05, 0.125, 0.125)


def test_randomization_summary_compares_random_with_static_at_each_k():
    rows = [{"name": name, "kind": kind, "mode": mode, "num_skip": k, "seconds": t}
            for name, kind, mode, k, t in [
                ("psum", "psum", "psum", 0, 1.0),
                ("skip-s k=0", "skip", "static", 0, 1.0),
                ("skip-s k=1", "skip", "static", 1, 0.400),
                ("skip-s k=2", "skip", "static", 2, 0.300),
                ("skip-r k=0", "skip", "random", 0, 1.1),
                ("skip-r k=1", "skip", "random", 1, 0.410),
                ("skip-r k=2", "skip", "random", 2, 0.297)]]
    assert cb.randomization_summary(rows) == (
        "random - static: k=1 +10.0 ms (+2.5%), k=2 -3.0 ms (-1.0%)")
    assert cb.randomization_summary(rows[:4]) is None


@pytest.mark.parametrize("argv, message", [
    (["--devices", "1", "--sizes", "1K"], "a ring needs at least 2 devices"),
    (["--devices", "4", "--sizes", "2", "--breakdown"],
     "every size must be at least N = 4 elements per rank"),
])
def test_refuses_what_it_cannot_run(argv, message):
    import subprocess
    script = pathlib.Path(cb.__file__)
    env = {k: v for k, v in __import__("os").environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, str(script), "--rounds", "1", "--no-plot",
                           *argv], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_16bit_rows_send_what_they_claim_and_sum_within_rounding(mesh):
    variants = cb.make_variants(N, [0, 4], ["random"], comm_dtypes=["bfloat16", "float32"])
    assert [v.name for v in variants] == [
        "psum", "ring", "skip-r k=0", "skip-r k=4",
        "psum bf16", "ring bf16", "skip-r k=0 bf16", "skip-r k=4 bf16"]
    x, xs, key = _inputs(mesh)
    total = x.reshape(N, -1).sum(0)
    platform = mesh.devices.flat[0].platform
    for v in variants:
        fn = cb.build_function(v, mesh, "native")
        sent = sr.collective_traffic(fn.lower(xs, key).compile().as_text())
        assert sent.bytes_per_device() == cb.expected_wire_bytes(SIZE, N, v, platform), v.name
        if v.num_skip == 0:
            got = np.asarray(fn(xs, key))
            tol = 1e-4 if v.comm_dtype == "float32" else N * 2.0**-8
            np.testing.assert_allclose(got, total, atol=tol * np.abs(x).reshape(N, -1)
                                       .sum(0).max(), err_msg=v.name)
    narrow = cb.Variant("skip-r k=4 bf16", "skip", 4, True, "bfloat16")
    assert (cb.expected_wire_bytes(SIZE, N, narrow, "gpu")
            == cb.expected_wire_bytes(SIZE, N, cb.Variant("skip-r k=4", "skip", 4, True)) / 2)
    # lax.psum of bfloat16 sends 16 bits where the backend keeps them.
    psum = cb.Variant("psum bf16", "psum", comm_dtype="bfloat16")
    assert cb.expected_wire_bytes(SIZE, N, psum, "tpu") == cb.expected_wire_bytes(
        SIZE, N, psum, "cpu") / 2


def test_wire_summary_compares_each_16bit_row_with_its_float32_row():
    def row(name, kind, mode, k, dtype, seconds, nbytes):
        return {"name": name, "kind": kind, "mode": mode, "num_skip": k,
                "comm_dtype": dtype, "seconds": seconds, "wire_bytes": nbytes}
    rows = [row("ring", "ring", "ring", 0, "float32", 1.0, 100.0),
            row("skip-r k=2", "skip", "random", 2, "float32", 0.8, 80.0),
            row("ring bf16", "ring", "ring", 0, "bfloat16", 0.6, 50.0),
            row("skip-r k=2 bf16", "skip", "random", 2, "bfloat16", 0.5, 40.0)]
    assert cb.wire_summary(rows) == (
        "16-bit wire / float32 wire: ring bf16 0.600x time, 0.500x bytes; "
        "skip-r k=2 bf16 0.625x time, 0.500x bytes")
    assert cb.wire_summary(rows[:2]) is None
    with pytest.raises(SystemExit, match="--comm-dtypes"):
        cb.make_variants(N, [0], ["random"], comm_dtypes=["int8"])
