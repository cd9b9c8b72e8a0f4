"""The supervisor shared by the launcher and benchmarks/cluster.py, on tiny processes."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
from helpers import assert_all_dead

from skipreduce_jax._runtime import supervisor as _supervisor
from skipreduce_jax._runtime.supervisor import EXIT_TIMEOUT, Job, Process

_ENV = {"PATH": os.environ.get("PATH", "")}
_IGNORE_TERM = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


def test_each_process_has_its_command_env_and_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    code = ("import os, sys; print('out', sys.argv[1], os.environ['WHO']); "
            "print('err', sys.argv[1], file=sys.stderr, flush=True); "
            "sys.stdout.write('no newline ' + sys.argv[1])")
    prefixes = ["[a] ", "[bb] ", "[h2] "]
    processes = [Process(_python(code, f"arg{i}"), {**_ENV, "WHO": f"env{i}"}, prefixes[i])
                 for i in range(3)]
    assert Job(processes, timeout=60, name="demo").run() == 0
    out, err = capsys.readouterr()
    expected = [line for i, prefix in enumerate(prefixes) for line in (
        f"{prefix}out arg{i} env{i}", f"{prefix}err arg{i}", f"{prefix}no newline arg{i}")]
    assert sorted(out.splitlines()) == sorted(expected), out
    assert err == ""


def test_first_failure_ends_the_others(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_supervisor, "KILL_GRACE_SECONDS", 0.5)
    processes = [
        Process(_python(_IGNORE_TERM + "import time; time.sleep(60)"), _ENV, "[h0] "),
        Process(_python("import sys, time; time.sleep(0.3); sys.exit(3)"), _ENV, "[h1] "),
        Process(_python("import time; time.sleep(60)"), _ENV, "[h2] "),
    ]
    job = Job(processes, timeout=60, name="demo")
    start = time.monotonic()
    assert job.run() == 3
    assert time.monotonic() - start < 20
    # SIGTERM ended process 2; process 0 ignores it and needed the SIGKILL.
    assert [p.returncode for p in job.procs] == [-signal.SIGKILL, 3, -signal.SIGTERM]
    err = capsys.readouterr().err
    pid = job.procs[1].pid
    assert err == (f"demo: process 1 ([h1], pid {pid}) failed first: it exited with code 3; "
                   "ending the 2 other running process(es).\n")


def test_killed_process_and_leftovers(capsys: pytest.CaptureFixture[str]) -> None:
    # Process 0 leaves a child running and exits 0; process 1 is killed a moment later.
    leave = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(60)']); print(p.pid, flush=True)")
    kill = "import os, time; time.sleep(0.5); os.kill(os.getpid(), 9)"
    job = Job([Process(_python(leave), _ENV, "[p0] "), Process(_python(kill), _ENV, "")],
              timeout=60, name="demo")
    assert job.run() == 128 + signal.SIGKILL
    out, err = capsys.readouterr()
    assert re.fullmatch(r"demo: process 1 \(pid \d+\) failed first: it was killed by SIGKILL; "
                        r"no other process was running\.\n", err), err
    assert_all_dead([int(out.removeprefix("[p0] "))])


def test_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    quick = Process(_python("pass"), _ENV, "[p0] ")
    slow = Process(_python("import time; time.sleep(60)"), _ENV, "[p1] ")
    start = time.monotonic()
    assert Job([quick, slow], timeout=1.5, name="demo").run() == EXIT_TIMEOUT
    assert time.monotonic() - start < 20
    assert capsys.readouterr().err == (
        "demo: timeout: process(es) 1 of 2 still running after 1.5 s (--timeout); "
        "ending them.\n")
