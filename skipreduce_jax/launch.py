"""Starts a multi-process JAX job on this machine, like ``torchrun`` does.

Usage::

    python -m skipreduce_jax.launch -n 2 --devices-per-process 2 train.py --lr 0.1

starts ``sys.executable train.py --lr 0.1`` twice; the script calls
:func:`skipreduce_jax.distributed.initialize` first, which finds in the
environment where the coordinator is and who this process is. Every line a
process writes (stdout and stderr) is forwarded to the launcher's stdout,
prefixed with ``[p<id>] ``.

The launcher exits with 0 when all processes exit with 0. As soon as one
process fails, or ``--timeout`` passes, it ends all of them (SIGTERM to each
process group, then SIGKILL after :data:`KILL_GRACE_SECONDS`), reports on
stderr which process failed and why, and exits with

* the exit code of the first process that failed (the first to end with a
  non-zero status; the others that failed after it are listed),
* ``128 + N`` if that process was killed by signal ``N``,
* :data:`EXIT_TIMEOUT` (124, as ``timeout(1)``) when ``--timeout`` passed,
* ``128 + N`` when the launcher itself got SIGINT, SIGTERM or SIGHUP (N),
* :data:`EXIT_USAGE` (2) for bad arguments; then nothing is started.

Each process runs in its own session: what it leaves running is killed
when the job ends, also after a clean exit. On Linux, the processes die
with the launcher (see :func:`skipreduce_jax.distributed.initialize`).

Environment of each process (besides the launcher's own): the
``SKIPREDUCE_*`` variables of :mod:`skipreduce_jax.distributed` (gloo on
the loopback interface unless ``SKIPREDUCE_GLOO_INTERFACE`` is set),
``JAX_PLATFORMS=cpu`` unless ``JAX_PLATFORMS`` is set, 127.0.0.1 and
localhost added to ``no_proxy``/``NO_PROXY`` when a proxy is set, and
``PYTHONUNBUFFERED=1``.

On a real cluster, start one process per host with the cluster's own tools
(SLURM, Open MPI, Kubernetes) and call ``initialize`` without the launcher.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Final

from skipreduce_jax._checks import check_int
from skipreduce_jax._runtime.supervisor import EXIT_TIMEOUT as EXIT_TIMEOUT
from skipreduce_jax._runtime.supervisor import KILL_GRACE_SECONDS as KILL_GRACE_SECONDS
from skipreduce_jax._runtime.supervisor import Job, Process
from skipreduce_jax.distributed import (
    ENV_COORDINATOR,
    ENV_GLOO_INTERFACE,
    ENV_LAUNCHER_PID,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = [
    "DEFAULT_TIMEOUT", "EXIT_TIMEOUT", "EXIT_USAGE", "KILL_GRACE_SECONDS", "MAX_TOTAL_DEVICES",
    "PROCESSES_PER_CPU", "LaunchError", "launch", "main",
]

PROG: Final = "python -m skipreduce_jax.launch"

#: Seconds a job may run before it is ended (``--timeout``).
DEFAULT_TIMEOUT: Final = 600.0
#: Most devices (processes x devices per process) one job may ask for.
MAX_TOTAL_DEVICES: Final = 512
#: Most processes per CPU core (``os.cpu_count()``) one job may start.
PROCESSES_PER_CPU: Final = 8
#: Exit status for bad arguments.
EXIT_USAGE: Final = 2


class LaunchError(ValueError):
    """Bad launcher arguments (nothing was started)."""


def launch(script: str | os.PathLike[str], args: Sequence[str] = (), *, num_processes: int,
           devices_per_process: int = 1, timeout: float | None = DEFAULT_TIMEOUT,
           port: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """Runs ``num_processes`` copies of a Python script as one JAX job.

    Blocks until all processes ended; output, failure report and exit
    statuses as described in the module docstring.

    Args:
        script: Path of the Python script each process runs.
        args: Command-line arguments passed to every copy of the script.
        num_processes: Number of processes, at least 1 and at most
            :data:`PROCESSES_PER_CPU` per CPU core.
        devices_per_process: CPU devices each process creates, at least 1;
            ``num_processes * devices_per_process`` is at most
            :data:`MAX_TOTAL_DEVICES`.
        timeout: Seconds after which all processes are ended and
            :data:`EXIT_TIMEOUT` returned; ``None`` waits forever.
        port: TCP port of the coordinator on 127.0.0.1; ``None`` picks a free
            one.
        env: Extra environment variables for the processes, on top of
            ``os.environ`` (the ``SKIPREDUCE_*`` variables win over both).

    Returns:
        0 if all processes exited with 0, else the exit status described in
        the module docstring.

    Raises:
        LaunchError: If an argument is invalid, the script does not exist or
            ``port`` is in use. No process was started then.

    Example:
        >>> from skipreduce_jax.launch import launch
        >>> launch("train.py", ["--steps", "10"],
        ...        num_processes=2, devices_per_process=2)  # doctest: +SKIP
        0
    """
    script = os.fspath(script)
    num_processes, devices_per_process, port = _validate(
        script, num_processes, devices_per_process, timeout, port)
    # Held until the job ends, so that no other program (another launch
    # picking a free port, say) takes the port before process 0 binds it.
    with _reserve_port(port) as reservation:
        job_env = _job_env(reservation.getsockname()[1], num_processes,
                           devices_per_process, env or {})
        command = [sys.executable, script, *args]
        processes = [Process(command, {**job_env, ENV_PROCESS_ID: str(rank)}, f"[p{rank}] ")
                     for rank in range(num_processes)]
        return Job(processes, timeout=timeout, name=PROG).run()


def _job_env(port: int, num_processes: int, devices_per_process: int,
             env: Mapping[str, str]) -> dict[str, str]:
    """The environment every process starts with (before its process id)."""
    base_env = dict(os.environ)
    base_env.update(env)
    base_env.setdefault("JAX_PLATFORMS", "cpu")
    base_env["PYTHONUNBUFFERED"] = "1"
    # All processes meet on 127.0.0.1: gloo on loopback needs no resolvable
    # host name, and no proxy may carry the coordinator's connections. (Only
    # where a proxy is set: JAX warns of a possible hang in every process
    # whenever any *_proxy variable exists, no_proxy included.)
    base_env.setdefault(ENV_GLOO_INTERFACE, _loopback_interface())
    if any(name.lower().endswith("_proxy") and name.lower() != "no_proxy"
           and value for name, value in base_env.items()):
        hosts: list[str] = []
        for name in ("no_proxy", "NO_PROXY"):  # both spellings get the union
            hosts += [h for h in base_env.get(name, "").split(",")
                      if h and h not in hosts]
        hosts += [h for h in ("127.0.0.1", "localhost") if h not in hosts]
        base_env["no_proxy"] = base_env["NO_PROXY"] = ",".join(hosts)
    base_env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    base_env[ENV_NUM_PROCESSES] = str(num_processes)
    base_env[ENV_LOCAL_DEVICES] = str(devices_per_process)
    base_env[ENV_LAUNCHER_PID] = str(os.getpid())
    return base_env


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: parses ``argv`` and calls :func:`launch`.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if ``None``.

    Returns:
        The exit status of :func:`launch`, or :data:`EXIT_USAGE` if the
        arguments are invalid.
    """
    ns = _parser().parse_args(argv)
    try:
        return launch(ns.script, ns.script_args, num_processes=ns.num_processes,
                      devices_per_process=ns.devices_per_process,
                      timeout=ns.timeout if ns.timeout > 0 else None, port=ns.port)
    except LaunchError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr, flush=True)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Run SCRIPT in P processes on this machine as one multi-process "
        "JAX job. The script calls skipreduce_jax.distributed.initialize() first.")
    parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="P",
                        help=f"number of processes (>= 1, <= {PROCESSES_PER_CPU} per CPU core)")
    parser.add_argument("-d", "--devices-per-process", type=int, default=1, metavar="D",
                        help=f"CPU devices per process (>= 1; P*D <= {MAX_TOTAL_DEVICES}; "
                        "default 1)")
    parser.add_argument("--timeout", type=_timeout_arg, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"end all processes after S seconds and exit {EXIT_TIMEOUT} "
                        f"(default {DEFAULT_TIMEOUT:g}; 0: no limit)")
    parser.add_argument("--port", type=int, default=None,
                        help="coordinator port on 127.0.0.1 (default: a free one)")
    parser.add_argument("script", metavar="SCRIPT", help="Python script each process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for SCRIPT")
    return parser


def _timeout_arg(text: str) -> float:
    """``--timeout``: a finite number of seconds >= 0 (0: no limit)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(
            f"got {text!r}; give a finite number of seconds >= 0, e.g. "
            f"--timeout {DEFAULT_TIMEOUT:g}, or --timeout 0 for no limit.")
    return seconds


def _validate(script: str, num_processes: int, devices_per_process: int,
              timeout: float | None, port: int | None) -> tuple[int, int, int | None]:
    """Refuses bad arguments; ``num_processes``, ``devices_per_process``, ``port`` as ints."""
    num_processes = _check_int(num_processes, "-n/--num-processes", "an integer >= 1")
    devices_per_process = _check_int(devices_per_process, "--devices-per-process",
                                     "an integer >= 1")
    cpus = os.cpu_count() or 1
    if num_processes > PROCESSES_PER_CPU * cpus:
        raise LaunchError(
            f"-n/--num-processes {num_processes} is more than {PROCESSES_PER_CPU} processes per "
            f"CPU core ({cpus} cores: at most {PROCESSES_PER_CPU * cpus}). Use fewer processes "
            "and more --devices-per-process.")
    total = num_processes * devices_per_process
    if total > MAX_TOTAL_DEVICES:
        raise LaunchError(
            f"{num_processes} processes x {devices_per_process} devices = {total} devices is more "
            f"than the limit of {MAX_TOTAL_DEVICES}. Lower -n/--num-processes or "
            "--devices-per-process.")
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise LaunchError(f"--timeout must be > 0 seconds and finite (or None for no limit), "
                          f"got {timeout!r}.")
    if port is not None:
        port = _check_int(port, "--port", "an integer in 1..65535", maximum=65535)
    if not os.path.isfile(script):
        what = "is a directory, not a file" if os.path.isdir(script) else "does not exist"
        raise LaunchError(f"SCRIPT {script!r} {what} (working directory: {os.getcwd()}).")
    return num_processes, devices_per_process, port


def _check_int(value: object, option: str, allowed: str, *, maximum: int | None = None) -> int:
    """:func:`check_int` (no bools, numpy ints as ints), with the launcher's message."""
    try:
        return check_int(value, option, minimum=1, maximum=maximum, type_error=LaunchError)
    except ValueError:  # LaunchError included: the message names the command-line option
        raise LaunchError(f"{option} must be {allowed}, got {value!r}.") from None


def _loopback_interface() -> str:
    """The name of the loopback interface ("lo" on Linux)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return "lo"
    return next((n for n in ("lo", "lo0") if n in names), "lo")


def _reserve_port(port: int | None) -> socket.socket:
    """Binds, without listening, a socket to ``port`` (``None``: a free one).

    With SO_REUSEADDR, as the coordinator's gRPC server has: the coordinator
    can still bind the port while this socket holds it, but no other program
    gets it until the job ends. (Not SO_REUSEPORT: with it the bind would
    also succeed while another job's coordinator listens on the port.)
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Fails if a socket listens on the port or holds it without
        # SO_REUSEADDR; not for TIME_WAIT leftovers.
        sock.bind(("127.0.0.1", port or 0))
    except OSError as err:
        sock.close()
        in_use = err.errno == errno.EADDRINUSE
        reason = "already in use" if in_use else f"not usable ({err.strerror})"
        raise LaunchError(
            f"--port {port} is {reason} on 127.0.0.1; nothing was started. Pass another "
            "--port, or leave --port out to use a free port."
        ) from None
    return sock


if __name__ == "__main__":
    sys.exit(main())
