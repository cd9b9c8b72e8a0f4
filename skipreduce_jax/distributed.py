"""Starting JAX's multi-process runtime: the one call a script makes first.

:func:`initialize` connects this process to the others of a multi-process
job, then JAX sees the devices of all processes (``jax.devices()``) and
collectives inside ``jax.shard_map`` cross process boundaries; a script
written for the launcher also runs on its own, as a single process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Final, NamedTuple

__all__ = [
    "ENV_COORDINATOR", "ENV_GLOO_INTERFACE", "ENV_LAUNCHER_PID", "ENV_LOCAL_DEVICES",
    "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "LAUNCHER_DEFAULTS", "ProcessInfo", "cluster_detected",
    "gloo_interface_in_use", "initialize", "launcher_env_present", "process_info",
]

logger = logging.getLogger(__name__)

#: ``host:port`` of the coordinator service (run by process 0).
ENV_COORDINATOR: Final = "SKIPREDUCE_COORDINATOR"
#: Total number of processes of the job.
ENV_NUM_PROCESSES: Final = "SKIPREDUCE_NUM_PROCESSES"
#: Id of this process, ``0 <= id < SKIPREDUCE_NUM_PROCESSES``.
ENV_PROCESS_ID: Final = "SKIPREDUCE_PROCESS_ID"
#: Number of CPU devices this process creates.
ENV_LOCAL_DEVICES: Final = "SKIPREDUCE_LOCAL_DEVICES"
#: Network interface gloo binds to, as the ``gloo_interface`` argument.
ENV_GLOO_INTERFACE: Final = "SKIPREDUCE_GLOO_INTERFACE"
#: Pid of the launcher; on Linux the process is killed when the launcher dies.
ENV_LAUNCHER_PID: Final = "SKIPREDUCE_LAUNCHER_PID"

_LAUNCHER_VARS: Final = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, ENV_LOCAL_DEVICES)

#: Keyword arguments of ``jax.distributed.initialize`` for launcher-started
#: processes, unless overridden by ``initialize(**kwargs)``. JAX's own defaults
#: are sized for large clusters; the launcher's processes share one machine:
#:
#: * ``initialization_timeout=120``: every process must have connected to the
#:   coordinator within 2 minutes (many processes importing JAX on few cores).
#: * ``heartbeat_timeout_seconds=20``: a process that stops sending heartbeats
#:   (crashed, killed, hung in C++) is declared dead after 20 s; the others fail.
#: * ``shutdown_timeout_seconds=300`` (JAX's default): at exit a process waits
#:   for the others at the shutdown barrier, so processes of a clean job may
#:   finish up to 5 minutes apart. A process that calls ``sys.exit(code)``
#:   waits there too; one that fails by an uncaught exception ends at once.
LAUNCHER_DEFAULTS: Final[Mapping[str, int]] = {
    "initialization_timeout": 120,
    "heartbeat_timeout_seconds": 20,
    "shutdown_timeout_seconds": 300,
}

_LOOPBACK_HOSTS: Final = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})

# The interface the gloo factory bound to, once the CPU backend was created.
_gloo_bound_interface: str | None = None
_initialized: bool = False


class ProcessInfo(NamedTuple):
    """Where this process sits in the job.

    Attributes:
        process_index: ``jax.process_index()``, 0 for the coordinator.
        process_count: ``jax.process_count()``.
        local_device_count: ``jax.local_device_count()``.
    """

    process_index: int
    process_count: int
    local_device_count: int


def launcher_env_present(environ: Mapping[str, str] | None = None) -> bool:
    """Tells whether this process was started by ``skipreduce_jax.launch``.

    Args:
        environ: Environment to look at; ``os.environ`` if ``None``.

    Returns:
        ``True`` if :data:`ENV_COORDINATOR` is set (the other launcher
        variables are then required by :func:`initialize`).

    Example:
        >>> from skipreduce_jax.distributed import launcher_env_present
        >>> launcher_env_present({"SKIPREDUCE_COORDINATOR": "127.0.0.1:1234"})
        True
    """
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_COORDINATOR))


def initialize(*, gloo_interface: str | None = None, **kwargs: Any) -> None:
    """Connects this process to the other processes of the job.

    Call it once, first thing, before any other JAX use (``jax.devices()``,
    creating arrays, jitting): JAX fixes its device list when the backend
    starts. A second call is a no-op. What it does depends on the environment:

    1. **Started by** ``python -m skipreduce_jax.launch`` (:data:`ENV_COORDINATOR`
       and friends set): :data:`ENV_LOCAL_DEVICES` CPU devices, gloo
       collectives over TCP, and ``jax.distributed.initialize`` with the
       launcher's coordinator, process count and id and the timeouts of
       :data:`LAUNCHER_DEFAULTS`. An uncaught exception ends the process at
       once with status 1 (past JAX's exit-time shutdown barrier, at which
       ``sys.exit(1)`` still waits), and on Linux it dies with the launcher.
    2. **A cluster JAX knows** (SLURM, Open MPI, Cloud TPU, Kubernetes, or
       ``JAX_COORDINATOR_ADDRESS`` set), or any keyword argument given: plain
       ``jax.distributed.initialize(**kwargs)``, which detects the rest itself.
    3. **Nothing of the above**: nothing is initialised and the script runs as
       a single process with its local devices (``jax.process_count()`` is 1).

    Args:
        gloo_interface: Network interface (``"eth0"``, ``"lo"``, ...) the gloo
            CPU collectives bind to, instead of the address the host name
            resolves to (often 127.0.0.1, unreachable from other hosts).
            ``None`` reads :data:`ENV_GLOO_INTERFACE`; if that is unset too,
            gloo keeps its default. Checked (it must exist and, on Linux, have
            an address) even where no multi-process runtime is started.
        **kwargs: Passed to ``jax.distributed.initialize``. Under the launcher
            they override its values and :data:`LAUNCHER_DEFAULTS` (e.g.
            ``heartbeat_timeout_seconds=60``); otherwise any keyword forces the
            call even when no cluster is detected.

    Raises:
        ValueError: If ``gloo_interface`` names no interface of this host (or
            one without an address), or a launcher environment variable is
            malformed.
        RuntimeError: If the JAX backend was already started, or the installed
            JAX does not offer what ``gloo_interface`` needs.

    Example:
        >>> import jax
        >>> from skipreduce_jax.distributed import initialize
        >>> initialize()  # doctest: +SKIP
        >>> jax.process_count()  # doctest: +SKIP
        2
    """
    global _initialized
    if _initialized:
        return
    interface = gloo_interface
    if interface is None:
        interface = os.environ.get(ENV_GLOO_INTERFACE) or None
    if interface is not None:
        _check_interface(interface, from_env=gloo_interface is None)

    import jax
    from jax._src import xla_bridge

    launched = launcher_env_present()
    if not (launched or kwargs or cluster_detected()):
        logger.info("No launcher environment (%s) and no cluster detected: running as a "
                    "single process.", ENV_COORDINATOR)
        _initialized = True
        return
    settings = _launcher_settings(os.environ) if launched else {}
    _check_backend_not_started(xla_bridge)
    if launched:
        _exit_on_uncaught_exception()
        _die_with_launcher(os.environ.get(ENV_LAUNCHER_PID))
        jax.config.update("jax_num_cpu_devices", settings.pop("local_devices"))
        if jax.config.jax_cpu_collectives_implementation is None:  # not so in jax 0.10
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if "coordinator_address" in kwargs:
            # Bind where the caller's coordinator is, not where ours was.
            settings.pop("coordinator_bind_address", None)
        kwargs = {**LAUNCHER_DEFAULTS, **settings, **kwargs}
    if interface is not None:
        _install_gloo_interface(interface)
    jax.distributed.initialize(**kwargs)
    _initialized = True


def process_info() -> ProcessInfo:
    """Returns this process's index, the process count and its device count.

    Returns:
        A :class:`ProcessInfo`. Starts the JAX backend if it is not running
        yet, so call :func:`initialize` before.

    Example:
        >>> from skipreduce_jax import process_info
        >>> info = process_info()
        >>> info.process_index < info.process_count
        True
    """
    import jax

    return ProcessInfo(jax.process_index(), jax.process_count(), jax.local_device_count())


def gloo_interface_in_use() -> str | None:
    """Returns the interface gloo was bound to by ``gloo_interface``.

    Returns:
        The interface name once the CPU backend was created with gloo
        collectives bound by :func:`initialize`; ``None`` if gloo uses its
        default address or the backend has not started yet.
    """
    return _gloo_bound_interface


def _launcher_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Reads the launcher variables into ``jax.distributed.initialize`` kwargs."""
    missing = [name for name in _LAUNCHER_VARS if not environ.get(name)]
    if missing:
        raise ValueError(
            f"{ENV_COORDINATOR} is set but {', '.join(missing)} is not: start the script "
            "with `python -m skipreduce_jax.launch -n P SCRIPT`, or unset "
            f"{ENV_COORDINATOR} to run it as a single process.")

    def as_int(name: str, low: int) -> int:
        raw = environ[name]
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} must be an integer >= {low}.") from None
        if value < low:
            raise ValueError(f"{name}={raw!r} must be an integer >= {low}.")
        return value

    coordinator = environ[ENV_COORDINATOR]
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{ENV_COORDINATOR}={coordinator!r} must be of the form HOST:PORT.")
    num_processes = as_int(ENV_NUM_PROCESSES, 1)
    process_id = as_int(ENV_PROCESS_ID, 0)
    if process_id >= num_processes:
        raise ValueError(f"{ENV_PROCESS_ID}={process_id} must be smaller than "
                         f"{ENV_NUM_PROCESSES}={num_processes}.")
    settings: dict[str, Any] = {
        "coordinator_address": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
        "local_devices": as_int(ENV_LOCAL_DEVICES, 1),
        # The launcher names every parameter: don't let a surrounding SLURM or
        # Open MPI environment override (or add local_device_ids to) them.
        "cluster_detection_method": "deactivate",
    }
    if host in _LOOPBACK_HOSTS:
        # All processes are on this machine: serve the coordinator on loopback
        # only, instead of JAX's default of every address ([::]:PORT).
        settings["coordinator_bind_address"] = coordinator
    return settings


def cluster_detected() -> bool:
    """Tells whether ``jax.distributed.initialize()`` would find a cluster.

    Mirrors ``jax._src.clusters.ClusterEnv.auto_detect_unset_distributed_params``:
    an explicit ``JAX_COORDINATOR_ADDRESS``, or any cluster type that is not
    opt-in only (SLURM, Open MPI, Cloud TPU, Kubernetes) reporting its
    environment present.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    try:
        from jax._src import clusters

        cluster_types = list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):  # pragma: no cover - other jax versions
        # The variables jax 0.10's detectors look at.
        markers = ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST")
        return any(name in os.environ for name in markers)
    for cluster in cluster_types:
        if getattr(cluster, "opt_in_only_method", False):
            continue
        try:
            if cluster.is_env_present():
                return True
        except Exception:  # noqa: BLE001 - a broken detector is not a cluster.
            logger.debug("Cluster detector %s failed", cluster.__name__, exc_info=True)
    return False


def _exit_on_uncaught_exception() -> None:
    """Makes an uncaught exception print its traceback and end the process with status 1.

    At once, past JAX's exit-time shutdown barrier (where a failed process would wait
    while the others run on), so that the launcher sees the failure and ends the others.
    """
    previous = sys.excepthook

    def excepthook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(OSError, ValueError):
                    if stream is not None:
                        stream.flush()
            interrupted = issubclass(exc_type, KeyboardInterrupt)
            os._exit(128 + signal.SIGINT if interrupted else 1)

    sys.excepthook = excepthook


def _die_with_launcher(launcher_pid: str | None) -> None:
    """On Linux, has the kernel SIGKILL this process when the launcher dies.

    Exits at once if the launcher is already gone (it is no longer the parent).
    """
    if not sys.platform.startswith("linux") or not launcher_pid or not launcher_pid.isdigit():
        return
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - no prctl in libc
        return
    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != int(launcher_pid):
        print(
            f"skipreduce_jax.initialize: the launcher (pid {launcher_pid}) is gone, or this "
            f"process was not started by it (parent pid {os.getppid()}); exiting. Start the "
            "script with `python -m skipreduce_jax.launch`, or unset the SKIPREDUCE_* "
            "variables to run it on its own.", file=sys.stderr, flush=True)
        os._exit(1)


def _check_backend_not_started(xla_bridge: Any) -> None:
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "skipreduce_jax.distributed.initialize() was called after the JAX backend started. "
            "Call it first thing in the script, before jax.devices(), creating arrays or jitting "
            "(also check that no module imported before it does so at import time).")


def _check_interface(interface: str, *, from_env: bool) -> None:
    source = ENV_GLOO_INTERFACE if from_env else "gloo_interface"
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return
    if interface not in names:
        raise ValueError(
            f"{source}={interface!r} is not a network interface of this host; "
            f"available: {', '.join(names) or '(none)'}. Pass one of these, or leave "
            f"gloo_interface and {ENV_GLOO_INTERFACE} unset to keep gloo's default.")
    if _interface_has_address(interface) is False:
        raise ValueError(
            f"{source}={interface!r} has no IPv4 or IPv6 address (is it up and "
            "configured?): gloo binds to an address of the interface.")


def _interface_has_address(interface: str) -> bool | None:
    """Whether ``interface`` has an IP address; None where this cannot be told."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            siocgifaddr = 0x8915  # from <linux/sockios.h>
            fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        return True
    except OSError:
        pass  # no IPv4 address (or no AF_INET socket): try IPv6
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as f:
            return any(line.split()[-1:] == [interface] for line in f)
    except OSError:
        return None


def _install_gloo_interface(interface: str) -> None:
    """Makes the CPU backend build its gloo collectives bound to ``interface``.

    JAX's ``make_cpu_client`` builds gloo without ``interface=`` but accepts
    ready-made ``collectives``: the ``"cpu"`` backend factory is re-registered
    (same priority and failure mode) as one that builds them with it. Call it
    before the backend starts. Raises RuntimeError if the JAX internals used
    (as of jax 0.10.2) differ, the ``"cpu"`` factory was already replaced, or
    the CPU collectives are not gloo.
    """
    import inspect

    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    registration = getattr(xla_bridge, "_backend_factories", {}).get("cpu")
    make_cpu_client = getattr(xla_bridge, "make_cpu_client", None)
    make_gloo = getattr(_jax, "make_gloo_tcp_collectives", None)
    gloo_signature = f"{getattr(make_gloo, '__nb_signature__', '')}{make_gloo.__doc__}"
    problems = []
    if not callable(getattr(xla_bridge, "register_backend_factory", None)):
        problems.append("no jax._src.xla_bridge.register_backend_factory")
    params = inspect.signature(make_cpu_client).parameters if callable(make_cpu_client) else {}
    if "collectives" not in params:
        problems.append("jax._src.xla_bridge.make_cpu_client has no collectives= argument")
    fields = ("factory", "priority", "fail_quietly")
    if registration is None or not all(hasattr(registration, field) for field in fields):
        problems.append("no 'cpu' entry in jax._src.xla_bridge._backend_factories")
    elif (registration.factory is not make_cpu_client
          and not hasattr(registration.factory, "skipreduce_gloo_interface")):
        problems.append("the 'cpu' backend factory is no longer jax's make_cpu_client")
    if make_gloo is None or "interface" not in gloo_signature:
        problems.append("jaxlib's make_gloo_tcp_collectives has no interface= argument")
    if not hasattr(jax_distributed, "global_state"):
        problems.append("no jax._src.distributed.global_state")
    if problems:
        raise RuntimeError(
            f"gloo_interface={interface!r} is not supported with jax {jax.__version__} "
            f"(written for jax 0.10.2): {'; '.join(problems)}. Leave gloo_interface and "
            f"{ENV_GLOO_INTERFACE} unset, and make the host name resolve to the address of the "
            "interface instead.")
    if jax.config.jax_cpu_collectives_implementation != "gloo":
        raise RuntimeError(
            f"gloo_interface={interface!r} needs jax_cpu_collectives_implementation='gloo', "
            f"but it is {jax.config.jax_cpu_collectives_implementation!r}. Unset one of the two.")

    def make_cpu_client_on_interface() -> Any:
        global _gloo_bound_interface
        client = jax_distributed.global_state.client
        if client is None:
            return make_cpu_client()
        collectives = make_gloo(distributed_client=client, interface=interface)
        backend = make_cpu_client(collectives=collectives)
        _gloo_bound_interface = interface
        return backend

    make_cpu_client_on_interface.skipreduce_gloo_interface = interface  # type: ignore[attr-defined]

    xla_bridge.register_backend_factory("cpu", make_cpu_client_on_interface,
                                        priority=registration.priority,
                                        fail_quietly=registration.fail_quietly)
    logger.info("gloo CPU collectives will bind to interface %s", interface)
