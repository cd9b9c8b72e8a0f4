"""Tests of the local launcher and of ``skipreduce_jax.distributed.initialize``.

The multi-process tests start ``python -m skipreduce_jax.launch`` (or call
:func:`skipreduce_jax.launch.launch`) on the helper scripts in
``tests/mp_scripts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import assert_all_dead, launcher_results

from skipreduce_jax import distributed, launch
from skipreduce_jax._runtime import supervisor as _supervisor

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "mp_scripts"
COLLECTIVE = SCRIPTS / "collective.py"
ECHO = SCRIPTS / "echo.py"
FAIL = SCRIPTS / "fail.py"

_LAUNCHER_VARS = (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
    distributed.ENV_LOCAL_DEVICES,
    distributed.ENV_GLOO_INTERFACE,
)


def _env() -> dict[str, str]:
    """The environment for launched jobs: this one, without launcher leftovers
    or proxy settings (the jobs only use loopback)."""
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.lower().endswith("_proxy")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("XLA_FLAGS", None)
    return env


def _run_launcher(
    *args: str, timeout: float = 120.0
) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "skipreduce_jax.launch", *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def _wait_for_pids(pid_dir: Path, count: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("p*.pids"))
        if len(files) == count:
            return [int(pid) for f in files for pid in f.read_text().split()]
        time.sleep(0.1)
    reported = len(list(pid_dir.glob("p*.pids")))
    raise AssertionError(f"only {reported} of {count} processes reported their pids")


# --------------------------------------------------------------------------
# Multi-process JAX: device counts and cross-process collectives.


@pytest.mark.slow
@pytest.mark.parametrize("num_processes, devices_per_process", [(2, 2), (4, 1)])
def test_collectives_across_processes(num_processes: int, devices_per_process: int) -> None:
    proc, _ = _run_launcher(
        "-n",
        str(num_processes),
        "--devices-per-process",
        str(devices_per_process),
        "--timeout",
        "100",
        str(COLLECTIVE),
        str(num_processes),
        str(devices_per_process),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Without proxies the launcher sets no *_proxy variable, so JAX does not
    # warn of a possible hang.
    assert "proxy" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    results = launcher_results(proc.stdout)
    assert sorted(results) == list(range(num_processes)), proc.stdout
    n = num_processes * devices_per_process
    for rank, result in results.items():
        assert result["index"] == str(rank)
        assert result["count"] == str(num_processes)
        assert result["devices"] == str(n)
        assert result["local"] == str(devices_per_process)
        assert result["psum"] == str(devices_per_process * num_processes * (num_processes + 1) // 2)
        assert result["gloo"] == "lo"  # the launcher's default: all on 127.0.0.1
    # Shifted values over all processes: every global position exactly once.
    shifted = sorted(int(v) for r in results.values() for v in r["shifted"].split(","))
    assert shifted == list(range(n))


def _gloo_addresses(stdout: str) -> dict[int, str]:
    pattern = r"^\[p\d+\] GLOO_ADDRESSES index=(\d+) (\S*)$"
    return {int(m.group(1)): m.group(2) for m in re.finditer(pattern, stdout, re.M)}


@pytest.mark.slow
def test_gloo_interface_loopback() -> None:
    proc, _ = _run_launcher("-n", "2", "--timeout", "100", str(COLLECTIVE), "2", "1", "lo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = launcher_results(proc.stdout)
    assert sorted(results) == [0, 1], proc.stdout
    assert all(r["gloo"] == "lo" and r["psum"] == "3" for r in results.values())
    if _has_psutil():
        assert _gloo_addresses(proc.stdout) == {0: "127.0.0.1", 1: "127.0.0.1"}, proc.stdout


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


def _non_loopback_interface() -> tuple[str, str] | None:
    """An up interface with an IPv4 address other than loopback, if any."""
    if not _has_psutil():
        return None
    import psutil

    stats = psutil.net_if_stats()
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        for address in addresses:
            if (
                address.family == socket.AF_INET
                and not address.address.startswith("127.")
                and name in stats
                and stats[name].isup
            ):
                return name, address.address
    return None


@pytest.mark.slow
def test_gloo_interface_binds_to_that_address() -> None:
    found = _non_loopback_interface()
    if found is None:
        pytest.skip("needs psutil and a non-loopback network interface with an IPv4 address")
    name, address = found
    proc, _ = _run_launcher("-n", "2", "--timeout", "100", str(COLLECTIVE), "2", "1", name)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(r["gloo"] == name for r in launcher_results(proc.stdout).values()), proc.stdout
    # The gloo connections use the interface's address, not 127.0.0.1.
    assert _gloo_addresses(proc.stdout) == {0: address, 1: address}, proc.stdout


@pytest.mark.slow
def test_single_process_without_launcher() -> None:
    proc = subprocess.run(
        [sys.executable, str(COLLECTIVE), "1", "1"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULT index=0 count=1 devices=1 local=1 shifted=0 psum=1" in proc.stdout


# --------------------------------------------------------------------------
# Failures: fast exit, clear message, nothing left behind.


@pytest.mark.slow
def test_processes_of_a_clean_job_may_end_far_apart() -> None:
    # Process 0 reaches JAX's shutdown barrier 35 s before process 1: more
    # than the 30 s that once aborted every process.
    proc, elapsed = _run_launcher(
        "-n", "2", "--timeout", "150", str(SCRIPTS / "uneven_exit.py"), "35",
        timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[p0] RESULT done" in proc.stdout and "[p1] RESULT done" in proc.stdout
    assert elapsed > 35


@pytest.mark.slow
def test_failing_process_ends_the_job(tmp_path: Path) -> None:
    proc, elapsed = _run_launcher(
        "-n", "2", "--timeout", "200", str(FAIL), str(tmp_path), "raise", "1"
    )
    pids = _wait_for_pids(tmp_path, 2, timeout=1)
    assert_all_dead(pids)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The other process sleeps 300 s; the 3 s kill grace plus startup is all.
    assert elapsed < 30, elapsed
    assert "[p1] RuntimeError: deliberate failure in process 1" in proc.stdout
    assert "process 1 ([p1]" in proc.stderr and "exited with code 1" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_timeout_ends_everything(tmp_path: Path) -> None:
    # The processes ignore SIGTERM (as JAX's preemption handler does): SIGKILL is needed.
    proc, elapsed = _run_launcher("-n", "2", "--timeout", "5", str(FAIL), str(tmp_path), "hang")
    pids = _wait_for_pids(tmp_path, 2, timeout=1)
    assert_all_dead(pids)
    assert proc.returncode == launch.EXIT_TIMEOUT, proc.stdout + proc.stderr
    assert "timeout" in proc.stderr and "--timeout" in proc.stderr, proc.stderr
    assert 5 <= elapsed < 30, elapsed


@pytest.mark.slow
def test_launcher_sigterm_ends_children(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "skipreduce_jax.launch", "-n", "2", str(FAIL), str(tmp_path)]
        + ["nojax"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _wait_for_pids(tmp_path, 2)
        time.sleep(0.3)  # let the children install their SIGTERM-ignoring handler
        start = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert_all_dead(pids)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "received SIGTERM" in stderr
    assert elapsed < 15, elapsed


@pytest.mark.slow
def test_clean_exit_leaves_nothing_behind(tmp_path: Path) -> None:
    proc, elapsed = _run_launcher("-n", "2", str(FAIL), str(tmp_path), "leave")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_all_dead(_wait_for_pids(tmp_path, 2, timeout=1))  # the grandchildren too
    assert elapsed < 15, elapsed


@contextlib.contextmanager
def _failing_job(tmp_path: Path, mode: str) -> Iterator[subprocess.Popen[str]]:
    """The launcher running ``fail.py`` in ``mode``; whatever is left is killed."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "skipreduce_jax.launch", "-n", "2", str(FAIL), str(tmp_path), mode],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if launcher.stdout is not None:
            launcher.stdout.close()
        for f in tmp_path.glob("p*.pids"):
            for pid in f.read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")
def test_children_exit_at_initialize_when_the_launcher_is_gone(tmp_path: Path) -> None:
    # The launcher is SIGKILLed before its processes reach initialize(): they
    # exit there instead of joining process 0's coordinator headless.
    with _failing_job(tmp_path, "late") as launcher:
        pids = _wait_for_pids(tmp_path, 2)
        launcher.kill()
        launcher.wait()
        assert_all_dead(pids[0::2], within=30)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux only")
def test_launcher_sigkill_ends_initialized_children(tmp_path: Path) -> None:
    with _failing_job(tmp_path, "hang") as launcher:
        assert launcher.stdout is not None
        initialized = 0
        for line in launcher.stdout:  # until both processes passed initialize()
            initialized += " sees " in line
            if initialized == 2:
                break
        pids = _wait_for_pids(tmp_path, 2)
        launcher.kill()
        launcher.wait()
        children = pids[0::2]  # not the grandchildren: they are not JAX processes
        assert_all_dead(children)


@pytest.mark.slow
def test_exit_code_and_signal_of_first_failure(capfd: pytest.CaptureFixture[str]) -> None:
    args = ["--fail-rank", "1", "--code", "3"]
    code = launch.launch(ECHO, args, num_processes=2, env=_env(), timeout=60)
    assert code == 3
    err = capfd.readouterr().err
    assert "process 1 ([p1]" in err and "exited with code 3" in err, err

    args = ["--fail-rank", "0", "--signal", "SIGKILL"]
    code = launch.launch(ECHO, args, num_processes=2, env=_env(), timeout=60)
    assert code == 128 + signal.SIGKILL
    err = capfd.readouterr().err
    assert "process 0 ([p0]" in err and "killed by SIGKILL" in err, err


@pytest.mark.slow
def test_output_is_prefixed(tmp_path: Path) -> None:
    proc, _ = _run_launcher("-n", "3", "-d", "2", str(ECHO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for rank in range(3):
        for text in ("stdout line from", "stderr line from", "last line from"):
            assert any(line.startswith(f"[p{rank}] {text} {rank}") for line in lines), proc.stdout
    assert all(re.match(r"\[p[012]\] ", line) for line in lines), proc.stdout
    envs = [line for line in lines if " env " in line]
    assert len(envs) == 3
    for line in envs:
        assert re.search(r"SKIPREDUCE_COORDINATOR=127\.0\.0\.1:\d+ ", line), line
        assert "SKIPREDUCE_NUM_PROCESSES=3 SKIPREDUCE_LOCAL_DEVICES=2 JAX_PLATFORMS=cpu" in line
        assert "SKIPREDUCE_GLOO_INTERFACE=lo " in line, line
        # No proxy is set here, so no *_proxy variable is added (JAX would
        # warn of a possible hang in every process).
        assert "no_proxy=None" in line, line
    assert proc.stderr == ""


# --------------------------------------------------------------------------
# Bad arguments: non-zero exit, a message, nothing started.


@pytest.mark.slow
def test_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc, _ = _run_launcher(
            "-n", "2", "--port", str(port), str(ECHO), "--marker", str(tmp_path)
        )
    assert proc.returncode == launch.EXIT_USAGE
    assert f"--port {port} is already in use" in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_chosen_port_is_held_until_the_job_ends(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # Another program binds the chosen port after the launcher chose it and
    # before process 0's coordinator binds it (the race, made certain).
    rival_errors: list[int] = []
    run = _supervisor.Job.run

    def run_after_a_rival(job: _supervisor.Job) -> int:
        port = int(job.processes[0].env[distributed.ENV_COORDINATOR].rsplit(":", 1)[1])
        with socket.socket() as rival:
            try:
                rival.bind(("127.0.0.1", port))
                rival.listen()
            except OSError as err:
                rival_errors.append(err.errno)
            return run(job)

    monkeypatch.setattr(_supervisor.Job, "run", run_after_a_rival)
    reservations: list[socket.socket] = []
    reserve = launch._reserve_port

    def recorded(port: int | None) -> socket.socket:
        reservations.append(reserve(port))
        return reservations[-1]

    monkeypatch.setattr(launch, "_reserve_port", recorded)
    code = launch.launch(COLLECTIVE, ["2", "1"], num_processes=2, env=_env(), timeout=100)
    out, err = capfd.readouterr()
    assert rival_errors == [errno.EADDRINUSE]
    assert code == 0, out + err
    assert sorted(launcher_results(out)) == [0, 1], out
    # Released afterwards: the reserving socket is closed.
    assert reservations and all(sock.fileno() == -1 for sock in reservations)


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", str(ECHO)], "-n/--num-processes must be an integer >= 1"),
        (["-n", "2", "-d", "0", str(ECHO)], "--devices-per-process must be an integer >= 1"),
        (["-n", "2", "-d", "1000", str(ECHO)], "2000 devices is more than the limit of 512"),
        (["-n", "100000", str(ECHO)], "processes per CPU core"),
        (["-n", "1", "--port", "70000", str(ECHO)], "--port must be an integer in 1..65535"),
        (["-n", "2", "no_such_script.py"], "SCRIPT 'no_such_script.py' does not exist"),
    ],
)
def test_bad_arguments(args: list[str], message: str, capfd: pytest.CaptureFixture[str]) -> None:
    code = launch.main(args)
    out, err = capfd.readouterr()
    assert code == launch.EXIT_USAGE
    assert message in err, err
    assert err.startswith("python -m skipreduce_jax.launch: error: ")
    assert out == ""


def test_launch_function_validates() -> None:
    with pytest.raises(launch.LaunchError, match="num-processes"):
        launch.launch(ECHO, num_processes=0)
    with pytest.raises(launch.LaunchError, match="--timeout must be > 0"):
        launch.launch(ECHO, num_processes=1, timeout=0)
    with pytest.raises(launch.LaunchError, match="is a directory"):
        launch.launch(SCRIPTS, num_processes=1)


def test_missing_num_processes_is_a_usage_error(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        launch.main([str(ECHO)])
    assert exc.value.code == 2
    assert "-n/--num-processes" in capfd.readouterr().err


# --------------------------------------------------------------------------
# initialize() in this process (jax.distributed.initialize replaced).


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher or cluster variables; initialize() may run again."""
    cluster_vars = (
        "JAX_COORDINATOR_ADDRESS",
        "SLURM_JOB_ID",
        "OMPI_MCA_orte_hnp_uri",
        "KUBERNETES_SERVICE_HOST",
    )
    for name in (*_LAUNCHER_VARS, *cluster_vars):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_initialized", False)
    return monkeypatch


def _record_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    import jax

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    return calls


def test_initialize_single_process_does_nothing(clean_env: pytest.MonkeyPatch) -> None:
    calls = _record_calls(clean_env)
    assert not distributed.launcher_env_present()
    distributed.initialize()
    distributed.initialize()  # a second call is a no-op
    assert calls == []
    info = distributed.process_info()
    assert info.process_index == 0 and info.process_count == 1 and info.local_device_count >= 1


def test_initialize_kwargs_or_cluster_call_jax(clean_env: pytest.MonkeyPatch) -> None:
    from jax._src import xla_bridge

    clean_env.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    calls = _record_calls(clean_env)
    distributed.initialize(coordinator_address="10.0.0.1:1234", num_processes=2, process_id=1)
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}]

    clean_env.setattr(distributed, "_initialized", False)
    for name, value in [
        ("SLURM_JOB_ID", "7"),
        ("SLURM_STEP_NODELIST", "node1"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_PROCID", "0"),
        ("SLURM_LOCALID", "0"),
    ]:
        clean_env.setenv(name, value)
    distributed.initialize()
    assert calls[1:] == [{}]


def test_launcher_settings() -> None:
    env = {
        "SKIPREDUCE_COORDINATOR": "127.0.0.1:4321",
        "SKIPREDUCE_NUM_PROCESSES": "4",
        "SKIPREDUCE_PROCESS_ID": "3",
        "SKIPREDUCE_LOCAL_DEVICES": "2",
    }
    assert distributed._launcher_settings(env) == {
        "coordinator_address": "127.0.0.1:4321",
        "coordinator_bind_address": "127.0.0.1:4321",
        "num_processes": 4,
        "process_id": 3,
        "local_devices": 2,
        "cluster_detection_method": "deactivate",
    }
    with pytest.raises(ValueError, match="SKIPREDUCE_PROCESS_ID=4 must be smaller"):
        distributed._launcher_settings({**env, "SKIPREDUCE_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="SKIPREDUCE_LOCAL_DEVICES='x' must be an integer"):
        distributed._launcher_settings({**env, "SKIPREDUCE_LOCAL_DEVICES": "x"})
    with pytest.raises(ValueError, match="HOST:PORT"):
        distributed._launcher_settings({**env, "SKIPREDUCE_COORDINATOR": "localhost"})
    env.pop("SKIPREDUCE_NUM_PROCESSES")
    with pytest.raises(ValueError, match="SKIPREDUCE_NUM_PROCESSES is not"):
        distributed._launcher_settings(env)


def test_initialize_after_backend_started_fails(clean_env: pytest.MonkeyPatch) -> None:
    import jax

    jax.devices()  # starts the backend
    clean_env.setenv("SKIPREDUCE_COORDINATOR", "127.0.0.1:1")
    clean_env.setenv("SKIPREDUCE_NUM_PROCESSES", "2")
    clean_env.setenv("SKIPREDUCE_PROCESS_ID", "0")
    clean_env.setenv("SKIPREDUCE_LOCAL_DEVICES", "1")
    calls = _record_calls(clean_env)
    with pytest.raises(RuntimeError, match="before jax.devices"):
        distributed.initialize()
    assert calls == []


def test_bad_gloo_interface(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="gloo_interface='no-such-if0' is not a network interface"):
        distributed.initialize(gloo_interface="no-such-if0")
    clean_env.setenv("SKIPREDUCE_GLOO_INTERFACE", "no-such-if1")
    with pytest.raises(ValueError, match="SKIPREDUCE_GLOO_INTERFACE='no-such-if1'"):
        distributed.initialize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="address lookup: Linux only")
def test_gloo_interface_needs_an_address(clean_env: pytest.MonkeyPatch) -> None:
    assert distributed._interface_has_address("lo") is True
    # An interface that exists but has no address (as a down or bare one).
    clean_env.setattr(distributed, "_interface_has_address", lambda name: False)
    with pytest.raises(ValueError, match="gloo_interface='lo' has no IPv4 or IPv6 address"):
        distributed.initialize(gloo_interface="lo")


def test_gloo_interface_factory_checks_jax_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src import xla_bridge

    registered: list[tuple[str, object, dict[str, object]]] = []
    monkeypatch.setattr(
        xla_bridge,
        "register_backend_factory",
        lambda name, factory, **kw: registered.append((name, factory, kw)),
    )
    distributed._install_gloo_interface("lo")
    ((name, factory, kw),) = registered
    assert name == "cpu" and kw == {"priority": 0, "fail_quietly": False}
    assert factory.skipreduce_gloo_interface == "lo"

    # Someone else's cpu factory (or a changed jax): a clear error, no guessing.
    original = xla_bridge._backend_factories["cpu"]
    other = dataclasses.replace(original, factory=lambda: None)
    monkeypatch.setitem(xla_bridge._backend_factories, "cpu", other)
    with pytest.raises(RuntimeError, match=r"'lo' is not supported with jax .*no longer"):
        distributed._install_gloo_interface("lo")
    monkeypatch.setitem(xla_bridge._backend_factories, "cpu", original)

    import jax

    before = jax.config.jax_cpu_collectives_implementation
    jax.config.update("jax_cpu_collectives_implementation", "mpi")
    try:
        with pytest.raises(RuntimeError, match="needs jax_cpu_collectives_implementation='gloo'"):
            distributed._install_gloo_interface("lo")
    finally:
        jax.config.update("jax_cpu_collectives_implementation", before)
    assert len(registered) == 1


@pytest.mark.slow
def test_no_proxy_keeps_the_users_hosts(capfd: pytest.CaptureFixture[str]) -> None:
    # A proxy is set: loopback joins the user's exceptions, in both spellings.
    env = {**_env(), "https_proxy": "http://proxy.invalid:3128", "NO_PROXY": "internal.corp"}
    env.pop("no_proxy", None)
    assert launch.launch(ECHO, [], num_processes=1, env=env, timeout=60) == 0
    line = next(line for line in capfd.readouterr().out.splitlines() if " env " in line)
    hosts = re.search(r"no_proxy=(\S*)", line).group(1).split(",")
    assert {"internal.corp", "127.0.0.1", "localhost"} <= set(hosts), line
