"""Runs the processes of one job to the end, as one: the launcher's supervisor.

A :class:`Job` starts each :class:`Process` in its own session, forwards
every line it writes (stdout and stderr) to ``sys.stdout`` behind its
prefix, and ends all of them when one fails, the timeout passes or this
process gets SIGINT, SIGTERM or SIGHUP (handled only in the main thread),
with the exit statuses and the report on ``sys.stderr`` that
:mod:`skipreduce_jax.launch` describes. A process that failed because
another one died first is not blamed, only listed.

Used by ``python -m skipreduce_jax.launch`` and ``benchmarks/cluster.py``;
both name the time limit ``--timeout`` on their command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Final

#: Seconds between SIGTERM and SIGKILL when ending processes.
KILL_GRACE_SECONDS: Final = 3.0
#: Exit status when the timeout passed (124, as ``timeout(1)``).
EXIT_TIMEOUT: Final = 124

_POLL_SECONDS: Final = 0.05
_DRAIN_SECONDS: Final = 2.0
_HANDLED_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclasses.dataclass(frozen=True)
class Process:
    """One process of a job.

    Attributes:
        command: The program and its arguments (``argv``).
        env: Its whole environment.
        prefix: Put before each line it writes, e.g. ``"[p0] "``; the report
            names the process by it too (stripped: ``[p0]``).
    """

    command: Sequence[str]
    env: Mapping[str, str]
    prefix: str


class Job:
    """The processes of one run, their output threads and their fate.

    Args:
        processes: What to start; process ``i`` is named "process i" in the
            report.
        timeout: Seconds after which all processes are ended; ``None`` waits
            forever.
        name: Starts each report line (``NAME: ...``), e.g. the program.

    Example:
        >>> import sys
        >>> from skipreduce_jax._runtime.supervisor import Job, Process
        >>> say = [sys.executable, "-c", "print('hi')"]
        >>> Job([Process(say, {}, "[a] ")], timeout=60, name="demo").run()
        [a] hi
        0
    """

    def __init__(self, processes: Sequence[Process], *, timeout: float | None, name: str) -> None:
        self.processes = list(processes)
        self.timeout = timeout
        self.name = name
        self.procs: list[subprocess.Popen[bytes]] = []
        self.readers: list[threading.Thread] = []
        self.out_lock = threading.Lock()
        self.received_signal: int | None = None
        # (rank, exit code) in the order the processes ended.
        self.exits: list[tuple[int, int]] = []
        self.exits_lock = threading.Lock()

    def run(self) -> int:
        """Starts the processes and waits for their end; the exit status."""
        previous = self._install_signal_handlers()
        try:
            self._start()
            status, report = self._wait()
            if report is not None:
                self._report(report)
                self._end_all()
            return status
        finally:
            self._end_all(quiet=True)
            # Output still in the pipes; a process's leftover children may hold a
            # pipe open, so do not wait for EOF forever (the threads are daemons).
            deadline = time.monotonic() + _DRAIN_SECONDS
            for reader in self.readers:
                reader.join(timeout=max(0.0, deadline - time.monotonic()))
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: object) -> None:
            if self.received_signal is None:
                self.received_signal = signum

        # signal.signal returns the handler it replaces.
        return {signum: signal.signal(signum, on_signal) for signum in _HANDLED_SIGNALS}

    def _start(self) -> None:
        for process in self.processes:
            self.procs.append(subprocess.Popen(
                list(process.command), env=dict(process.env), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        for rank, proc in enumerate(self.procs):
            assert proc.stdout is not None
            reader = threading.Thread(target=self._forward, name=f"{self.name}-out{rank}",
                                      args=(self.processes[rank].prefix, proc.stdout), daemon=True)
            reader.start()
            self.readers.append(reader)
            threading.Thread(target=self._record_exit, args=(rank, proc),
                             name=f"{self.name}-wait{rank}", daemon=True).start()

    def _record_exit(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        # One thread per process, blocked in its wait: self.exits lists the
        # processes in the order they ended (see _blame).
        code = proc.wait()
        with self.exits_lock:
            self.exits.append((rank, code))

    def _forward(self, prefix: str, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                # No or broken stdout: keep reading, so that the process never
                # blocks on a full pipe.
                with self.out_lock, contextlib.suppress(AttributeError, OSError, ValueError):
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()

    def _wait(self) -> tuple[int, str | None]:
        count = len(self.procs)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            if self.received_signal is not None:
                name = _signal_name(self.received_signal)
                running = sum(p.poll() is None for p in self.procs)
                return 128 + self.received_signal, (
                    f"received {name}; ending the {running} running process(es).")
            with self.exits_lock:
                exits = list(self.exits)
            failed = [(rank, code) for rank, code in exits if code != 0]
            if failed:
                return self._blame(failed)
            if len(exits) == count:
                return 0, None
            ended = {rank for rank, _ in exits}
            running = [rank for rank in range(count) if rank not in ended]
            if deadline is not None and time.monotonic() >= deadline:
                return EXIT_TIMEOUT, (
                    f"timeout: process(es) {', '.join(map(str, running))} of {count} "
                    f"still running after {self.timeout:g} s (--timeout); ending them.")
            time.sleep(_POLL_SECONDS)

    def _blame(self, failed: list[tuple[int, int]]) -> tuple[int, str]:
        """Status and report for ``failed`` (rank, code), in the order they ended."""
        rank, code = failed[0]
        others = sum(p.poll() is None for p in self.procs)
        if code < 0:
            why, status = f"was killed by {_signal_name(-code)}", 128 - code
        else:
            why, status = f"exited with code {code}", code
        rest = "; ".join(
            [f"process {r} then exited with {c}" for r, c in failed[1:]]
            + [f"ending the {others} other running process(es)" if others
               else "no other process was running"])
        tag = self.processes[rank].prefix.strip()
        who = f"process {rank} ({tag + ', ' if tag else ''}pid {self.procs[rank].pid})"
        return status, f"{who} failed first: it {why}; {rest}."

    def _report(self, message: str) -> None:
        with self.out_lock:
            print(f"{self.name}: {message}", file=sys.stderr, flush=True)

    def _end_all(self, quiet: bool = False) -> None:
        """SIGTERM to every process group, SIGKILL after the grace period.

        Also after a clean exit: what a process left running in its session
        (its group) is killed, so the job leaves nothing behind.
        """
        if not self.procs:
            return
        if not quiet or any(p.poll() is None for p in self.procs):
            for proc in self.procs:
                _kill_group(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + KILL_GRACE_SECONDS
            while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(_POLL_SECONDS)
        # Also for groups whose leader is gone: what it started may live on.
        for proc in self.procs:
            _kill_group(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _kill_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
