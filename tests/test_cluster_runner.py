"""The emulated cluster's per-host environment (no namespaces are built)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import cluster  # noqa: E402


def test_hosts_keep_freed_memory_by_default(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert cluster.build_parser().parse_args([]).malloc == "keep"
    env = cluster.process_env(2, 4, 47770)
    assert env["GLIBC_TUNABLES"].split(":") == list(cluster.KEEP_MEMORY)
    assert env["SKIPREDUCE_PROCESS_ID"] == "2"
    assert env["SKIPREDUCE_NUM_PROCESSES"] == "4"


def test_keep_goes_after_tunables_already_set(monkeypatch):
    # glibc applies tunables left to right: ours must come last to win.
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_max=7")
    tunables = cluster.process_env(0, 2, 47770)["GLIBC_TUNABLES"].split(":")
    assert tunables == ["glibc.malloc.mmap_max=7", *cluster.KEEP_MEMORY]


def test_glibc_leaves_the_allocator_alone(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert "GLIBC_TUNABLES" not in cluster.process_env(0, 2, 47770, malloc="glibc")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    env = cluster.process_env(0, 2, 47770, malloc="glibc")
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    with pytest.raises(ValueError, match="malloc='tcmalloc'"):
        cluster.process_env(0, 2, 47770, malloc="tcmalloc")


@pytest.mark.parametrize("args", [["--rate", "1xyz"], ["--burst", "big"]])
def test_bad_rate_or_burst_is_a_usage_error(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cluster.build_parser().parse_args(args)
    assert exit_info.value.code == 2
    assert "bad " in capsys.readouterr().err
