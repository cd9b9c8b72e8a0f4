"""The sharded-step benchmark's arguments, byte split, summary and one tiny run."""

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import sharded_step as ss  # noqa: E402


def test_defaults_and_bad_arguments():
    assert ss.parse_args([]).devices == 8
    args = ss.parse_args(["--layout", "fsdp"])
    assert (args.devices, args.skip_ratio, args.k0_target, args.slack) == (4, 0.5, 1.05, 0.05)
    for bad in (["--skip-ratio", "0"], ["--rounds", "0"], ["--devices", "1"],
                ["--warmup", "-1"]):
        with pytest.raises(SystemExit):
            ss.parse_args(bad)


_TAIL = ", use_global_device_ids=true, to_apply=%add"


@pytest.mark.parametrize("groups, expected", [
    ("{{0,1},{2,3},{4,5},{6,7}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("{}", [list(range(8))]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) {'axis_1'}",
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'b'}", [[3, 2], [1, 0]]),
])
def test_replica_groups_in_every_form(groups, expected):
    line = f"%r = f32[8]{{0}} all-reduce(%x), channel_id=1, replica_groups={groups}{_TAIL}"
    assert ss.collective_groups(line, 8) == expected


def test_permute_pairs_and_refusals():
    line = ("%p = f32[16]{0} collective-permute(%x), channel_id=1, "
            "source_target_pairs={{0,2},{2,0},{1,3},{3,1}}")
    assert ss.collective_groups(line, 4) == [[0, 2], [2, 0], [1, 3], [3, 1]]
    with pytest.raises(ValueError, match="replica ids"):
        ss.collective_groups("%r = f32[8]{0} all-reduce(%x), replica_groups={{0,1}}", 2)
    with pytest.raises(ValueError, match="sub-axes"):
        ss.collective_groups("%r = f32[8]{0} all-reduce(%x), replica_groups="
                             f"mesh['a'=4] {{'a':(1)2}}{_TAIL}", 4)


def _module(*lines):
    return "\n".join(["HloModule jit_step, num_partitions=4",
                      "ENTRY %main (p: f32[64]) -> f32[64] {", *lines, "}"])


def test_cross_host_bytes_split_by_group():
    # Hosts {0, 1} and {2, 3}: the first all-reduce stays in a host.
    text = _module(
        f"  %a = f32[64]{{0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1}},{{2,3}}}}"
        f"{_TAIL}",
        f"  %b = f32[32]{{0}} all-reduce(%a), channel_id=2, replica_groups={{{{0,2}},{{1,3}}}}"
        f"{_TAIL}",
        "  %c = f32[64]{0} collective-permute(%a), channel_id=3, "
        "source_target_pairs={{0,2},{2,0},{1,3},{3,1}}",
        "  ROOT %d = f32[64]{0} collective-permute(%c), channel_id=4, "
        "source_target_pairs={{0,2},{2,0},{1,3},{3,1}}")
    out = ss.cross_host_bytes(text, [0, 0, 1, 1])
    assert out == {"total": 256 + 128 + 2 * 256, "cross_host": 128 + 2 * 256,
                   "intra_host": 256}
    # The same op shapes inside and across hosts cannot be told apart: refused.
    text = _module(
        f"  %a = f32[64]{{0}} all-reduce(%p), channel_id=1, replica_groups={{{{0,1}},{{2,3}}}}"
        f"{_TAIL}",
        f"  ROOT %b = f32[64]{{0}} all-reduce(%a), channel_id=2, replica_groups="
        f"{{{{0,2}},{{1,3}}}}{_TAIL}")
    with pytest.raises(ValueError, match="cannot tell"):
        ss.cross_host_bytes(text, [0, 0, 1, 1])


def _traffic(cross, intra=0.0):
    return {"total": cross + intra, "cross_host": cross, "intra_host": intra}


def test_summary_ratios_and_targets():
    names = list(ss.VARIANTS)  # xla, no cross-host, collectives alone, k=0, random
    times = np.array([[1.0, 0.1, 0.85, 1.04, 0.70],
                      [1.2, 0.1, 0.95, 1.20, 0.80],
                      [0.9, 0.2, 0.80, 0.99, 0.60]])
    traffic = [_traffic(12.0, 1.0), _traffic(0.0, 1.0), _traffic(12.0), _traffic(12.0, 1.0),
               _traffic(8.0, 1.0)]
    s = ss.summarize(names, times, traffic)
    rows = {r["name"]: r for r in s["rows"]}
    assert rows["random"]["ratio"] == pytest.approx(0.70 / 1.0)
    assert rows["skipreduce k=0"]["paired_ratio"] == pytest.approx(1.04)
    assert rows["random"]["cross_host_bytes_ratio"] == pytest.approx(8 / 12)
    assert rows["random"]["bytes_ratio"] == pytest.approx(9 / 13)
    assert rows["xla"]["iqr"] == pytest.approx(np.subtract(*np.percentile([1, 1.2, .9],
                                                                           [75, 25])))
    assert s["comm_fraction"] == pytest.approx(0.9)
    assert s["collectives_fraction"] == pytest.approx(0.85)
    assert s["random_vs_k0"]["ratio"] == pytest.approx(0.70 / 1.04)
    k0, rnd = s["targets"]["k0"], s["targets"]["random"]
    assert k0["met"] and k0["ratio"] == pytest.approx(1.04)
    assert rnd["target"] == pytest.approx(8 / 12 + 0.05)
    assert rnd["applies"] and rnd["met"]  # 0.70 <= 8/12 + 0.05
    times[:, 4] = [0.75, 0.9, 0.7]
    assert not ss.summarize(names, times, traffic)["targets"]["random"]["met"]
    # Both measures of the communication must reach 80% for random's target.
    times[:, 2] = [0.7, 0.9, 0.7]
    assert not ss.summarize(names, times, traffic)["targets"]["random"]["applies"]
    # A slower k=0 misses its target; a compute-bound step voids random's.
    times[:, 2] = [0.85, 0.95, 0.8]
    times[:, 3] *= 1.1
    times[:, 1] = 0.5
    s = ss.summarize(names, times, traffic)
    assert not s["targets"]["k0"]["met"]
    assert not s["targets"]["random"]["applies"]
    table = ss.format_table(s)
    assert "| random | 750.0 |" in table and "does not apply" in table


def test_a_tiny_hsdp_run_counts_the_bytes(tmp_path):
    """One in-process run on (replica=4, fsdp=2): bytes from the compiled steps."""
    args = ["--layout", "hsdp", "--d-in", "16", "--hidden", "64", "--d-out", "8",
            "--rounds", "1", "--warmup", "0", "--out", str(tmp_path), "--tag", "t",
            "--no-plot"]
    assert ss.main(args) == 0
    result = json.loads((tmp_path / "sharded_step_t.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    n = 4
    local = (16 * 64 + 64 + 64 * 8) * 4 // 2  # each device's fsdp shard, bytes
    ring = 2 * (n - 1) / n
    loss = ring * 4  # the loss's mean over the hosts
    # XLA's and k=0's all-reduce of each shard over the 4 hosts.
    for name in ("xla", "skipreduce k=0"):
        assert rows[name]["cross_host_bytes"] == pytest.approx(ring * local + loss)
    assert rows["no cross-host"]["cross_host_bytes"] == 0
    # The collectives alone: XLA's all-reduce, without the loss's.
    assert rows["collectives alone"]["cross_host_bytes"] == pytest.approx(ring * local)
    # skip_ratio 0.5 of N - 1 = 3 steps: k = 2, (2(N-1) - k) / N of the shard.
    assert rows["random"]["cross_host_bytes"] == pytest.approx(
        (2 * (n - 1) - 2) / n * local + loss)
    assert rows["random"]["intra_host_bytes"] == rows["xla"]["intra_host_bytes"] > 0
    assert result["meta"]["k0_vs_xla_max_rel_deviation"] < 1e-5
    assert result["meta"]["mesh"] == {"replica": 4, "fsdp": 2}
