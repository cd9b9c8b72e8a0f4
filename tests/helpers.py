"""Shared test helpers: run a per-rank function under shard_map."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def xla_steps(loss: Callable[[Any, Any], Any], tx: Any, params: Any, batch: Any,
              mesh: jax.sharding.Mesh, steps: int) -> Any:
    """XLA's own step, ``steps`` times: plain ``jax.jit`` of grad and ``tx``.

    ``params`` and ``batch`` are placed on ``mesh`` already; XLA inserts and
    schedules every reduction itself. Returns the params.
    """
    import optax

    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)

        @jax.jit
        def step(p, s):
            updates, s = tx.update(jax.grad(loss)(p, batch), s, p)
            return optax.apply_updates(p, updates), s

        for _ in range(steps):
            params, state = step(params, state)
    return params


def line_mesh(n: int, axis: str = "i") -> jax.sharding.Mesh:
    """A 1-D mesh over the first ``n`` devices."""
    return jax.make_mesh((n,), (axis,), devices=jax.devices()[:n])


def per_rank(
    fn: Callable[..., Any],
    per_rank_args: Any,
    *,
    n: int,
    axis: str = "i",
    check_vma: bool = True,
    replicated_args: Any = (),
) -> Any:
    """Runs ``fn(local_args, *replicated_args)`` on each of ``n`` ranks.

    ``per_rank_args`` leaves have a leading axis of size ``n``; rank r gets
    slice r (without the leading axis). The result comes back stacked per rank
    (leading axis ``n``), so tests can compare what each rank computed.
    """
    mesh = line_mesh(n, axis)
    sharded = jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P(axis))), per_rank_args)
    replicated = jax.tree_util.tree_map(
        lambda a: jax.device_put(a, NamedSharding(mesh, P())), replicated_args)

    def body(local, rep):
        local = jax.tree_util.tree_map(lambda a: a[0], local)
        out = fn(local, *rep)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()),
                      out_specs=P(axis), check_vma=check_vma)
    out = jax.jit(f)(sharded, replicated)
    return jax.tree_util.tree_map(np.asarray, out)


def sharded_updates(tx: Any, grads: np.ndarray, mesh: jax.sharding.Mesh, spec: P,
                    steps: int) -> np.ndarray:
    """``steps`` updates of FSDP blocks: ``[device, step, ...]``.

    ``grads[d]`` is device d's whole local gradient of one leaf ``"w"``,
    whose param (zeros) is split over ``spec`` by rows.
    """
    def f(g, p):
        state = tx.init({"w": p})
        out = []
        for _ in range(steps):
            u, state = tx.update({"w": g[0]}, state, {"w": p})
            out.append(u["w"])
        return jax.numpy.stack(out)[None]

    g = jax.device_put(grads, NamedSharding(mesh, spec))
    p = jax.device_put(np.zeros(grads.shape[1:], grads.dtype), NamedSharding(mesh, spec))
    return np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, spec),
                                            out_specs=spec))(g, p))


def popcount(values: np.ndarray) -> np.ndarray:
    """Number of set bits of each (non-negative, integer-valued) element."""
    ints = np.asarray(values).astype(np.int64)
    count = np.zeros_like(ints)
    while np.any(ints):
        count += ints & 1
        ints >>= 1
    return count


def bit_inputs(n: int, size: int, dtype=np.float32) -> np.ndarray:
    """Rank r holds 2**r everywhere: a sum's bits name its contributors."""
    return np.broadcast_to(
        (2.0 ** np.arange(n))[:, None], (n, size)).astype(dtype)


def launcher_results(stdout: str) -> dict[int, dict[str, str]]:
    """Parses the ``RESULT key=value ...`` lines of collective.py by process."""
    results = {}
    for match in re.finditer(r"^\[p(\d+)\] RESULT (.*)$", stdout, re.M):
        results[int(match.group(1))] = dict(kv.split("=", 1) for kv in match.group(2).split())
    return results


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs (a zombie counts as dead)."""
    try:
        import psutil
    except ImportError:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
        except OSError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_all_dead(pids: list[int], within: float = 5.0) -> None:
    """Asserts that no process of ``pids`` runs (and kills any that does)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.1)
    left = [pid for pid in pids if pid_alive(pid)]
    for pid in left:  # do not leave them behind even when failing
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes still running after the launcher or job ended: {left}"


_COLLECTIVE = ("all_reduce", "collective_permute", "all_gather", "reduce_scatter",
               "all_to_all")


def zero_size_collectives(lowered_text: str) -> list[str]:
    """The collectives of a lowered (not yet optimized) program with a zero-size array.

    XLA drops them when it optimizes at jax 0.10.2 (0.11.2's XLA:CPU crashes
    on them), so the StableHLO before optimization is read: each op's types
    run to the line that says ``-> tensor<...>``.
    """
    found, current = [], None
    for line in lowered_text.splitlines():
        if current is None and any(f"stablehlo.{op}" in line for op in _COLLECTIVE):
            current = []
        if current is not None:
            current.append(line)
            if "->" in line:
                op = "\n".join(current)
                if re.search(r"tensor<(?:[0-9]+x)*0x", op):
                    found.append(op.strip()[:200])
                current = None
    return found


# jax 0.10.2's flags in testing, the coming defaults (`make test-next-jax`
# turns them on). Where the library does not yet hold under one, its test
# is an expected failure naming why, and the README says so.
SCAN3 = bool(jax.config.jax_scan3)
REMAT3 = bool(jax.config.jax_remat3)
under_scan3_ring = pytest.mark.xfail(
    SCAN3, strict=True, raises=NotImplementedError,
    reason="jax_scan3: JAX 0.10.2 cannot differentiate its Scan3 (no vjp_fwd), and "
           "gather='ring' is a lax.scan")
under_scan3_while = pytest.mark.xfail(
    SCAN3, strict=True, raises=ValueError,
    reason="jax_scan3: JAX 0.10.2 expands a scan into a while loop whose counter Ref "
           "sits on one device beside the mesh's arrays ('incompatible devices')")
under_remat3_per_leaf = pytest.mark.xfail(
    REMAT3, strict=True, raises=AssertionError,
    reason="jax_remat3: gather='per_leaf' gathers again in the backward through "
           "jax.checkpoint, whose new form XLA:CPU schedules without the saving")
