"""An emulated cluster on one Linux machine: N network namespaces on a switch.

Builds N "hosts" (network namespaces ``srbench-h0`` .. ``srbench-h{N-1}``),
each with one NIC ``veth0`` (address ``10.77.0.{i+1}/24``) cabled by a veth
pair to a Linux bridge that lives in its own namespace ``srbench-sw`` (the
"switch"). Each host's NIC egress is shaped by a token bucket::

    tc qdisc add dev veth0 root tbf rate RATE burst BURST latency LATENCY

(``--ingress`` also shapes the switch port towards each host, i.e. the host's
receive side). The burst must hold at least one offloaded 64 KiB packet plus
slack (at least 256 KiB is used; smaller bursts stall TSO/GSO traffic).
Nothing is added to the root namespace: the hosts have no route beyond
10.77.0.0/24, so all traffic stays between the namespaces created here.

Then one JAX process per host is started with ``ip netns exec``, with 1 CPU
device, gloo bound to the host's ``veth0`` (``SKIPREDUCE_GLOO_INTERFACE``) and
the coordinator on host 0's address (``SKIPREDUCE_COORDINATOR=10.77.0.1:PORT``
and the other ``SKIPREDUCE_*`` variables of :mod:`skipreduce_jax.distributed`,
as ``python -m skipreduce_jax.launch`` would set them, which binds to
127.0.0.1 and so cannot span namespaces). By default the processes run
``benchmarks/collectives.py`` in multi-process mode; ``--script`` runs another
script, and arguments after ``--`` are passed to it. ``--local-devices D``
gives each process D simulated CPU devices instead of 1.

Each process keeps the memory it frees (``--malloc keep``, the default):
glibc hands blocks of 32 MiB and more back to the kernel when they are
freed, and XLA:CPU allocates every call's output and temporaries anew, so
without this every call that returns a 64 MiB buffer faults all of its
16,384 pages in again, with four "hosts" doing so at once on the same cores.
That cost lands on whichever variant allocates most, not on the network.
``--malloc glibc`` runs with glibc's defaults. See :data:`KEEP_MEMORY`.

After the job, the tbf counters (bytes, drops) and the TCP retransmissions
of each host are printed. ``--sysctl net.NAME=VALUE`` sets a network setting
in every host namespace (e.g. TCP buffer sizes) to test its effect.

The processes are run by the launcher's supervisor (as ``python -m
skipreduce_jax.launch`` runs its own): their output is prefixed ``[h<i>]``,
and when one fails, ``--timeout`` passes or Ctrl-C/SIGTERM arrives, all of
them are ended and the reason is reported (the process that failed first is
blamed), with the launcher's exit statuses (124 on timeout, ``128 + N`` for
signal ``N``). Everything is torn down at the end, also then (processes:
SIGTERM to each process group, SIGKILL after 3 s, since JAX catches SIGTERM;
then the namespaces are deleted, which removes their links). Leftovers of an
earlier run are removed first.
``--teardown`` only removes leftovers. The namespace names are fixed, so one
run at a time: a machine-wide ``flock`` (``/run/lock/srbench-cluster.lock``)
makes a second run wait (``--lock-wait``) instead of tearing down the first
one's cluster.

Needs root and iproute2 (``ip``, ``tc``); without them it says so and exits
with status 2.

Examples::

    sudo .venv/bin/python benchmarks/cluster.py                  # 4 hosts, 1 Gbit/s
    sudo .venv/bin/python benchmarks/cluster.py --hosts 8 --rate 500mbit --sizes 4M
    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 -- --ks 0,2 --modes static
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

# Make ``import skipreduce_jax`` work when the script is run from a checkout
# without the package installed.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from skipreduce_jax._runtime.supervisor import Job, Process  # noqa: E402
from skipreduce_jax.distributed import (  # noqa: E402
    ENV_COORDINATOR,
    ENV_GLOO_INTERFACE,
    ENV_LAUNCHER_PID,
    ENV_LOCAL_DEVICES,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

DEFAULT_SCRIPT = REPO_ROOT / "benchmarks" / "collectives.py"

PREFIX = "srbench"
SWITCH_NS = f"{PREFIX}-sw"
BRIDGE = "br0"
HOST_NIC = "veth0"
SUBNET = "10.77.0"
LOCK_PATH = Path("/run/lock" if os.path.isdir("/run/lock") else "/tmp") / f"{PREFIX}-cluster.lock"
EXIT_MISSING = 2
MIN_BURST_BYTES = 256 * 1024

# glibc settings of each host's process for --malloc keep: never return
# freed memory to the kernel (no mmap for large blocks, no trimming of the
# heap) and keep one heap for all threads, so that a freed 64 MiB buffer is
# reused by the next call instead of being faulted in again.
KEEP_MEMORY = ("glibc.malloc.mmap_max=0", "glibc.malloc.trim_threshold=4294967295",
               "glibc.malloc.arena_max=1")

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_SIZE_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20}


class ClusterError(RuntimeError):
    """A step of building the emulated network failed."""


# ----------------------------------------------------------------------------
# Parsing tc-style values.
# ----------------------------------------------------------------------------


def rate_bits(text: str) -> float:
    """Bits per second of a tc rate such as ``1gbit`` or ``500mbit``."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"bad rate {text!r}: use e.g. 1gbit, 500mbit ({', '.join(_RATE_UNITS)})")
    return float(match.group(1)) * _RATE_UNITS[unit]


def burst_bytes(text: str) -> int:
    """Bytes of a tc burst such as ``256kb`` (tc's kb is KiB) or ``1mb``."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"bad burst {text!r}: use e.g. 256kb, 1mb")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def _checked(parse):
    """An argparse type that keeps the text once ``parse`` accepts it."""
    def check(text: str) -> str:
        parse(text)
        return text
    check.__name__ = parse.__name__  # argparse names it in its error
    return check


def host_ns(i: int) -> str:
    """Namespace of host ``i``."""
    return f"{PREFIX}-h{i}"


def host_address(i: int) -> str:
    """IPv4 address of host ``i``'s NIC."""
    return f"{SUBNET}.{i + 1}"


# ----------------------------------------------------------------------------
# Commands.
# ----------------------------------------------------------------------------


def run(cmd: Sequence[str], *, check: bool = True) -> str:
    """Runs a command and returns its stdout.

    Raises:
        ClusterError: with the command's stderr, if it fails and ``check``.
    """
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def in_ns(ns: str, *cmd: str) -> list[str]:
    """``cmd`` run inside namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *cmd]


def check_prerequisites() -> str | None:
    """What is missing to build the cluster (root, ip, tc), or None."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (run it with sudo)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (iproute2)")
    if missing:
        return "needs " + " and ".join(missing)
    return None


def acquire_lock(wait: float) -> IO[str] | None:
    """Takes the machine-wide lock of this tool, waiting up to ``wait`` seconds.

    The namespaces have fixed names, so two runs at once would tear down each
    other's cluster; a second run waits for the first instead. The lock is an
    ``flock`` on :data:`LOCK_PATH`, released when this process exits (also
    when killed). Returns the open lock file (keep it open), or None on
    timeout.
    """
    handle = open(LOCK_PATH, "a+", encoding="utf-8")
    deadline = time.monotonic() + wait
    announced = False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.close()
                return None
            if not announced:
                handle.seek(0)
                holder = handle.read().strip() or "?"
                print(f"cluster: another cluster.py run (pid {holder}) holds {LOCK_PATH}; "
                      f"waiting up to {wait:g} s for it to finish", flush=True)
                announced = True
            time.sleep(1.0)
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def our_namespaces() -> list[str]:
    """Namespaces of this tool present now (from any run)."""
    out = run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n == SWITCH_NS or re.fullmatch(rf"{PREFIX}-h\d+", n)]


def teardown(log: Any = print) -> None:
    """Removes every namespace of this tool and what runs in it.

    Processes still inside one of them (only ever started by this tool) are
    killed first, so that the namespace really goes away.
    """
    for ns in our_namespaces():
        pids = run(["ip", "netns", "pids", ns], check=False).split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        run(["ip", "netns", "del", ns], check=False)
        log(f"cluster: removed namespace {ns}"
            + (f" (killed {len(pids)} leftover process(es))" if pids else ""))


def build(hosts: int, rate: str, burst: str, latency: str, ingress: bool,
          sysctls: Sequence[str] = ()) -> None:
    """Creates the switch, the hosts, their cables and the shaping.

    ``sysctls`` (``name=value``, e.g. ``net.ipv4.tcp_slow_start_after_idle=0``)
    are set in every host namespace (``net.*`` settings are per namespace).
    """
    run(["ip", "netns", "add", SWITCH_NS])
    run(["ip", "-n", SWITCH_NS, "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "-n", SWITCH_NS, "link", "set", "lo", "up"])
    for i in range(hosts):
        ns, port = host_ns(i), f"port{i}"
        run(["ip", "netns", "add", ns])
        # Both ends are created directly inside their namespaces.
        run(["ip", "-n", SWITCH_NS, "link", "add", port, "type", "veth",
             "peer", "name", HOST_NIC, "netns", ns])
        run(["ip", "-n", SWITCH_NS, "link", "set", port, "master", BRIDGE])
        run(["ip", "-n", SWITCH_NS, "link", "set", port, "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "-n", ns, "addr", "add", f"{host_address(i)}/24", "dev", HOST_NIC])
        run(["ip", "-n", ns, "link", "set", HOST_NIC, "up"])
        for setting in sysctls:
            run(in_ns(ns, "sysctl", "-q", "-w", setting))
        shaping = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
        run(in_ns(ns, "tc", "qdisc", "add", "dev", HOST_NIC, *shaping))
        if ingress:
            run(in_ns(SWITCH_NS, "tc", "qdisc", "add", "dev", port, *shaping))
    run(["ip", "-n", SWITCH_NS, "link", "set", BRIDGE, "up"])
    # Wait until every host reaches host 0 (the coordinator) through the bridge.
    deadline = time.monotonic() + 10
    for i in range(1, hosts):
        while True:
            ping = subprocess.run(in_ns(host_ns(i), "ping", "-c", "1", "-W", "1",
                                        host_address(0)), capture_output=True)
            if ping.returncode == 0 or shutil.which("ping") is None:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"host {i} cannot reach {host_address(0)} over the bridge")
            time.sleep(0.2)


# ----------------------------------------------------------------------------
# A throughput probe between two hosts.
# ----------------------------------------------------------------------------

_PROBE_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 47999)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); total = 0; start = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if start is None: start = time.perf_counter()
    total += len(b)
print(total * 8 / (time.perf_counter() - start), flush=True)
"""
_PROBE_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 47999)); buf = bytes(1 << 20)
for _ in range(int(sys.argv[2])): c.sendall(buf)
c.close()
"""


def probe_throughput(mib: int) -> float:
    """Goodput host 0 -> host 1 in bit/s: ``mib`` MiB over one TCP stream."""
    server = subprocess.Popen(in_ns(host_ns(1), sys.executable, "-c", _PROBE_SERVER,
                                    host_address(1)), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        server.stdout.readline()
        subprocess.run(in_ns(host_ns(0), sys.executable, "-c", _PROBE_CLIENT,
                             host_address(1), str(mib)), check=True, timeout=60)
        out, _ = server.communicate(timeout=30)
        return float(out.strip())
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def network_stats(hosts: int) -> list[dict[str, int]]:
    """Per host: bytes and drops of the NIC's tbf, and TCP retransmissions.

    Counters since the namespaces were created (the probe's traffic from
    host 0 included).
    """
    stats = []
    for i in range(hosts):
        entry: dict[str, int] = {}
        text = run(in_ns(host_ns(i), "tc", "-s", "qdisc", "show", "dev", HOST_NIC), check=False)
        match = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
        if match:
            entry.update(sent_bytes=int(match.group(1)), packets=int(match.group(2)),
                         dropped=int(match.group(3)), overlimits=int(match.group(4)))
        if shutil.which("nstat"):
            text = run(in_ns(host_ns(i), "nstat", "-asz", "TcpRetransSegs", "TcpOutSegs"),
                       check=False)
            for name, key in (("TcpRetransSegs", "tcp_retransmitted"), ("TcpOutSegs",
                                                                          "tcp_segments_out")):
                found = re.search(rf"^{name}\s+(\d+)", text, re.M)
                if found:
                    entry[key] = int(found.group(1))
        stats.append(entry)
    return stats


def format_stats(stats: Sequence[dict[str, int]]) -> str:
    """One line per host of :func:`network_stats`."""
    lines = []
    for i, entry in enumerate(stats):
        parts = []
        if "sent_bytes" in entry:
            parts.append(f"tbf sent {entry['sent_bytes'] / 1e6:.0f} MB, dropped "
                         f"{entry['dropped']} pkt, overlimits {entry['overlimits']}")
        if "tcp_segments_out" in entry:
            parts.append(f"TCP retransmitted {entry.get('tcp_retransmitted', 0)} of "
                         f"{entry['tcp_segments_out']} segments")
        lines.append(f"cluster: h{i}: " + ("; ".join(parts) or "no counters"))
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Running one process per host.
# ----------------------------------------------------------------------------


def process_env(i: int, hosts: int, port: int, malloc: str = "keep",
                local_devices: int = 1) -> dict[str, str]:
    """Environment of host ``i``'s process.

    Args:
        i: the host (process id).
        hosts: the number of hosts.
        port: the coordinator's port on host 0.
        malloc: ``"keep"`` adds :data:`KEEP_MEMORY` to ``GLIBC_TUNABLES``
            (after any tunables already set, so these win); ``"glibc"``
            leaves the allocator alone.
        local_devices: CPU devices of the process (``SKIPREDUCE_LOCAL_DEVICES``).

    Returns:
        This process's environment plus the SKIPREDUCE_* launcher variables.
    """
    if malloc not in ("keep", "glibc"):
        raise ValueError(f"malloc={malloc!r}: use 'keep' or 'glibc'")
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "grpc_proxy")}
    if malloc == "keep":
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"),
                                                       *KEEP_MEMORY]))
    env.update({
        ENV_COORDINATOR: f"{host_address(0)}:{port}",
        ENV_NUM_PROCESSES: str(hosts),
        ENV_PROCESS_ID: str(i),
        ENV_LOCAL_DEVICES: str(local_devices),
        ENV_GLOO_INTERFACE: HOST_NIC,
        # The process is killed if this runner dies (ip netns exec execs it,
        # so this runner is its parent).
        ENV_LAUNCHER_PID: str(os.getpid()),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                    os.environ.get("PYTHONPATH")])),
    })
    return env


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        description="Run a multi-process JAX benchmark on N network namespaces joined by a "
                    "rate-limited bridge (needs root and iproute2).",
        epilog="Arguments after -- go to the script.")
    p.add_argument("--hosts", type=int, default=4, help="hosts (namespaces), >= 2 (default 4)")
    p.add_argument("--rate", default="1gbit", type=_checked(rate_bits),
                   help="egress rate of each host's NIC, tc syntax (default 1gbit; 8 hosts on "
                        "2 cores need ~500mbit to stay network-bound)")
    p.add_argument("--burst", default="256kb", type=_checked(burst_bytes),
                   help="tbf burst, tc syntax (kb = KiB), at least 256kb (default 256kb)")
    p.add_argument("--latency", default="50ms", help="tbf queue latency (default 50ms)")
    p.add_argument("--ingress", action="store_true",
                   help="also shape the switch port towards each host (its receive side)")
    p.add_argument("--sysctl", action="append", default=[], metavar="NAME=VALUE",
                   help="a net.* sysctl set in every host namespace (repeatable), e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0")
    p.add_argument("--malloc", choices=("keep", "glibc"), default="keep",
                   help="keep: each process keeps freed memory for reuse instead of "
                        "faulting large buffers in on every call (GLIBC_TUNABLES, see "
                        "KEEP_MEMORY); glibc: the allocator's defaults (default keep)")
    p.add_argument("--local-devices", type=int, default=1,
                   help="simulated CPU devices per host process (default 1)")
    p.add_argument("--sizes", default="16M",
                   help="float32 elements per rank, passed to the script (default 16M)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds before the job is killed (default 600)")
    p.add_argument("--port", type=int, default=47770, help="coordinator port on host 0")
    p.add_argument("--script", type=Path, default=DEFAULT_SCRIPT,
                   help="script each host runs (default benchmarks/collectives.py)")
    p.add_argument("--tag", default=None,
                   help="result tag for collectives.py (default cluster_h<N>_<rate>)")
    p.add_argument("--probe-mib", type=int, default=48,
                   help="MiB sent host 0 -> host 1 to measure the shaped rate first "
                        "(0: no probe; default 48)")
    p.add_argument("--lock-wait", type=float, default=900.0,
                   help="seconds to wait while another cluster.py run holds the lock "
                        "(default 900)")
    p.add_argument("--teardown", action="store_true",
                   help="only remove leftovers and exit (refused while a run holds the lock)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="after --: more arguments for the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Builds the cluster, runs the job, tears everything down; the exit status."""
    args = build_parser().parse_args(argv)
    problem = check_prerequisites()
    if problem:
        print(f"cluster.py: {problem}; cannot build the emulated network.", file=sys.stderr)
        return EXIT_MISSING
    if args.teardown:
        lock = acquire_lock(0.0)
        if lock is None:
            print(f"cluster.py: a run holds {LOCK_PATH}; its namespaces are in use, not "
                  "removing them.", file=sys.stderr)
            return 1
        teardown()
        lock.close()
        return 0
    if not 2 <= args.hosts <= 250:
        print("cluster.py: --hosts must be in 2..250", file=sys.stderr)
        return 2
    if args.local_devices < 1:
        print("cluster.py: --local-devices must be at least 1", file=sys.stderr)
        return 2
    rate = rate_bits(args.rate)  # checked by the parser
    if burst_bytes(args.burst) < MIN_BURST_BYTES:
        print(f"cluster.py: --burst {args.burst} is below 256kb: offloaded 64 KiB packets "
              "would stall in the token bucket", file=sys.stderr)
        return 2
    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    if not args.script.is_file():
        print(f"cluster.py: no script {args.script}", file=sys.stderr)
        return 2

    # Outside the job (building, probing, tearing down); while it runs, the
    # supervisor handles these signals itself.
    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    status = 1
    lock: IO[str] | None = None
    try:
        lock = acquire_lock(args.lock_wait)
        if lock is None:
            raise ClusterError(f"another run still held {LOCK_PATH} after {args.lock_wait:g} s")
        teardown()  # leftovers of an earlier run (nobody else holds the lock)
        t0 = time.monotonic()
        bad = [s for s in args.sysctl if not re.fullmatch(r"net\.[\w.\-]+=.+", s)]
        if bad:
            raise ClusterError(f"--sysctl {bad}: use net.NAME=VALUE (per-namespace settings)")
        build(args.hosts, args.rate, args.burst, args.latency, args.ingress, args.sysctl)
        print(f"cluster: {args.hosts} hosts {host_address(0)}..{host_address(args.hosts - 1)} "
              f"on bridge {SWITCH_NS}/{BRIDGE}; egress tbf rate {args.rate} burst {args.burst} "
              f"latency {args.latency}{' (and ingress)' if args.ingress else ''}; "
              f"malloc {args.malloc}; built in {time.monotonic() - t0:.1f} s", flush=True)
        network: dict[str, Any] = {
            "hosts": args.hosts, "rate": args.rate, "rate_bit_per_s": rate,
            "burst": args.burst, "latency": args.latency, "ingress_shaped": args.ingress,
            "sysctl": args.sysctl,
            "malloc": args.malloc,
            "emulation": "network namespaces + veth + Linux bridge + tc tbf",
        }
        if args.probe_mib > 0:
            goodput = probe_throughput(args.probe_mib)
            network["probe_goodput_bit_per_s"] = goodput
            print(f"cluster: probe h0 -> h1: {args.probe_mib} MiB at "
                  f"{goodput / 1e6:.0f} Mbit/s goodput ({goodput / rate:.1%} of {args.rate})",
                  flush=True)
        cmd_args = list(script_args)
        if args.script.resolve() == DEFAULT_SCRIPT.resolve():
            tag = args.tag or f"cluster_h{args.hosts}_{args.rate}"
            cmd_args = ["--sizes", args.sizes, "--rounds", str(args.rounds), "--tag", tag,
                        "--breakdown", "--meta", json.dumps({"network": network}), *cmd_args]
        processes = [Process(in_ns(host_ns(i), sys.executable, str(args.script), *cmd_args),
                             process_env(i, args.hosts, args.port, args.malloc,
                                         args.local_devices), f"[h{i}] ")
                     for i in range(args.hosts)]
        t0 = time.monotonic()
        # Reports a failure, timeout or signal itself, and ends every process.
        status = Job(processes, timeout=args.timeout, name="cluster").run()
        if status == 0:
            print(f"cluster: job finished in {time.monotonic() - t0:.0f} s", flush=True)
            print(format_stats(network_stats(args.hosts)), flush=True)
    except KeyboardInterrupt as err:
        print(f"cluster: interrupted ({err}); tearing down", file=sys.stderr, flush=True)
        status = 130
    except ClusterError as err:
        print(f"cluster: {err}", file=sys.stderr, flush=True)
        status = 1
    finally:
        # No more signal-driven exceptions while cleaning up.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        try:
            if lock is not None:  # without the lock the namespaces are another run's
                teardown(log=lambda m: None)
                left = our_namespaces()
                if left:
                    print(f"cluster: could not remove {left}", file=sys.stderr)
                    status = status or 1
                else:
                    print("cluster: torn down", flush=True)
                lock.close()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return status


if __name__ == "__main__":
    sys.exit(main())
