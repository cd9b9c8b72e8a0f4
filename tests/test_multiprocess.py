"""SkipReduce across processes, started with ``python -m skipreduce_jax.launch``.

The jobs run the scripts of ``tests/mp_scripts`` (and
``examples/multihost_train.py``) on CPU devices, as 2 processes x 2 devices
and 4 processes x 1 device (HSDP: 2 x 4 and 4 x 2; FSDP: 2 x 2 and 4 x 1).
Each check script asserts inside and prints a ``RESULT`` line per process
with digests of what it computed; the tests
compare them across processes and with the same computation done here, in
one process (``_mp_common`` holds what both sides share). Every job is also
checked to leave no process behind.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from helpers import assert_all_dead, launcher_results
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax import distributed

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "mp_scripts"
CHECKS = SCRIPTS / "skip_checks.py"
FAULTS = SCRIPTS / "skip_faults.py"
EXAMPLE = REPO / "examples" / "multihost_train.py"
LAYOUTS = [(2, 2), (4, 1)]
LAYOUT_IDS = ["2x2", "4x1"]

_spec = importlib.util.spec_from_file_location("_mp_common", SCRIPTS / "_mp_common.py")
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------
# Running jobs.


def _env() -> dict[str, str]:
    """The environment for launched jobs: this one, without launcher leftovers."""
    drop = (
        distributed.ENV_COORDINATOR,
        distributed.ENV_NUM_PROCESSES,
        distributed.ENV_PROCESS_ID,
        distributed.ENV_LOCAL_DEVICES,
        distributed.ENV_GLOO_INTERFACE,
        distributed.ENV_LAUNCHER_PID,
        "XLA_FLAGS",  # conftest's 8 devices are for this process only
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _launch(
    processes: int, devices: int, script: Path, *args: str, timeout: float = 150.0
) -> subprocess.CompletedProcess[str]:
    """Runs ``script`` under the launcher; ``--timeout`` a little below ours."""
    return subprocess.run(
        [sys.executable, "-m", "skipreduce_jax.launch", "-n", str(processes), "-d",
         str(devices), "--timeout", str(timeout - 10), str(script), *args],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _pids(pid_dir: Path, count: int) -> list[int]:
    files = sorted(pid_dir.glob("p*.pids"))
    assert len(files) == count, files
    return [int(f.read_text()) for f in files]


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


# --------------------------------------------------------------------------
# The checks job, once per layout, and the same computations in this process.


@pytest.fixture(scope="module")
def checks_job():
    """Runs ``skip_checks.py`` once per layout; returns ``run(P, D)``."""
    runs: dict[tuple[int, int], Any] = {}

    def run(processes: int, devices: int):
        if (processes, devices) not in runs:
            proc = _launch(processes, devices, CHECKS, str(processes), str(devices))
            results = launcher_results(proc.stdout)
            assert_all_dead([int(r["pid"]) for r in results.values()])
            runs[processes, devices] = proc, results
        proc, results = runs[processes, devices]
        assert proc.returncode == 0, _output(proc)
        assert sorted(results) == list(range(processes)), _output(proc)
        return results

    return run


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """What the checks compute, done on 4 devices of this one process."""
    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(common.bit_values(4), NamedSharding(mesh, P("data")))
    sums, _ = common.bit_sums(mesh, x)
    params, _, losses = common.train(
        mesh, "data", common.make_tx(),
        lambda t: sr.shard_batch(common.global_batch(t, 4), mesh))

    axes = ("host", "local")
    hmesh = Mesh(np.array(devices).reshape(2, 2), axes)
    hx = jax.device_put(common.bit_values(4).reshape(2, 2, -1), NamedSharding(hmesh, P(*axes)))
    hsums, _ = common.hier_sums(hmesh, hx)
    return {
        "bits": common.digest(np.asarray(sums)[0].astype(np.int64)),
        "params": common.digest(common.local_copy(params)),
        "losses": losses,
        "hier_bits": common.digest(np.asarray(hsums)[0, 0].astype(np.int64)),
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_contributor_bits_across_processes(checks_job, reference, layout) -> None:
    """skip_psum over all devices of all processes: exactly N - k bits each.

    The script asserts, for every k in [0, N - 1] and both static and random
    SkipReduce, on each of its devices: N - k bits per element, the mask of
    ``contribution_mask`` equal to the device's bit, and (by all-gathering
    the result over processes) the same result everywhere. Here: all
    processes report the same digest, and it is the one the same program
    gives in one process (the schedule does not depend on the layout).
    """
    results = checks_job(*layout)
    assert {r["bits"] for r in results.values()} == {reference["bits"]}, results


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_training_keeps_replicas_bit_identical(checks_job, reference, layout) -> None:
    """A few skip_reduce + Adam steps, each process passing only its own rows.

    The script asserts ``assert_replicated`` of params and optimizer state,
    that every shard of the batch holds the right rows, that the loss went
    down, and that the params are equal across processes. Here: the params
    digest is the same in every process and bit-identical to that of the
    same training in one process; the losses agree too (they are averaged
    with a native all-reduce, whose order of additions may differ between
    gloo and the in-process one, hence the tolerance).
    """
    results = checks_job(*layout)
    assert {r["params"] for r in results.values()} == {reference["params"]}, results
    assert len({r["losses"] for r in results.values()}) == 1, results
    losses = [float(v) for v in results[0]["losses"].split(",")]
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-6)


def test_hierarchical_outer_axis_is_the_processes(checks_job, reference) -> None:
    """Hierarchical SkipReduce on 2 processes x 2 devices: host = process.

    The script builds the ``("host", "local")`` mesh with one process per
    row and asserts whole hosts summed or dropped (each element sums all 2
    devices of each of the 2 - k hosts kept), the mask, and identity across
    processes. Here: the digests agree with the in-process mesh, and the
    outer axis traffic read from the HLO is the SkipReduce formula
    ``(2 (H - 1) - k) / H`` of the 1/L shard (4096 float32 over L = 2).
    """
    results = checks_job(2, 2)
    hosts, shard_bytes = 2, 4096 * 4 / 2
    traffic = ",".join(
        f"{k}:{(2 * (hosts - 1) - k) / hosts * shard_bytes:g}" for k in range(hosts)
    )
    for result in results.values():
        assert result["hier_bits"] == reference["hier_bits"], results
        assert result["traffic"] == traffic, results


# --------------------------------------------------------------------------
# HSDP: replicas across processes, params sharded over each process's devices.

HSDP = SCRIPTS / "hsdp.py"
HSDP_LAYOUTS = [(2, 4), (4, 2)]
HSDP_IDS = ["2x4", "4x2"]
# k=0 against XLA's step, and Random against the same step in one process:
# the fsdp sums inside a process go through gloo here, so they may round
# differently (by about 1e-7, where Random and k=0 differ by about 0.1).
HSDP_RTOL, HSDP_ATOL = 1e-5, 1e-6


def _train_then_resume(tmp_path_factory: Any, script: Path) -> Any:
    """Runs ``script DIR train``, then ``resume``, once per layout.

    Returns ``run(P, D, mode)``: the job's directory, after checking that the
    ``mode`` job (and ``train`` before it) succeeded on every process.
    """
    runs: dict[tuple[int, int], Any] = {}

    def run(processes: int, devices: int, mode: str) -> Path:
        if (processes, devices) not in runs:
            directory = tmp_path_factory.mktemp(f"{script.stem}{processes}x{devices}")
            done = {}
            for name in ("train", "resume"):
                start = time.monotonic()
                proc = _launch(processes, devices, script, str(directory), name)
                print(f"{script.name} {name} on {processes} x {devices}: "
                      f"{time.monotonic() - start:.1f} s")
                results = launcher_results(proc.stdout)
                assert_all_dead([int(r["pid"]) for r in results.values()])
                done[name] = proc, results
                if proc.returncode:
                    break
            runs[processes, devices] = directory, done
        directory, done = runs[processes, devices]
        for name in ("train", mode):
            assert name in done, f"the {name} job did not run: train failed"
            proc, results = done[name]
            assert proc.returncode == 0, _output(proc)
            assert sorted(results) == list(range(processes)), _output(proc)
            assert {r["mode"] for r in results.values()} == {name}, _output(proc)
        return directory

    return run


@pytest.fixture(scope="module")
def hsdp_job(tmp_path_factory):
    """``hsdp.py`` train then resume, see :func:`_train_then_resume`."""
    return _train_then_resume(tmp_path_factory, HSDP)


def _job_files(directory: Path, name: str, processes: int) -> list[Any]:
    """What each process wrote: ``name_p<i>.npz`` or ``.json``, by process."""
    if name.endswith(".npz"):
        return [dict(np.load(directory / name.replace(".npz", f"_p{i}.npz")))
                for i in range(processes)]
    return [json.loads((directory / name.replace(".json", f"_p{i}.json")).read_text())
            for i in range(processes)]


def _reference(mesh: Mesh, axis: str, params: Any, loss_fn: Any, tx: Any,
               processes: int) -> dict[str, Any]:
    """XLA's own step and the Random SkipReduce run of a sharded check.

    ``xla``: plain ``jax.grad`` of the whole batch and Adam, jitted, on the
    same mesh and layout (``params``: a function of the mesh), the reference
    of k=0; ``random``: ``tx`` through ``make_train_step`` over ``axis``, and
    ``random_digests`` its shards'. Params as numpy, for :data:`HSDP_STEPS`
    steps of ``hsdp_batch(t, processes)``.
    """
    adam = optax.adam(1e-2)
    with jax.set_mesh(mesh):
        p = params(mesh)
        state = jax.jit(adam.init)(p)

        @jax.jit
        def xla_step(p, s, batch):
            loss, grads = jax.value_and_grad(loss_fn)(p, batch)
            updates, s = adam.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss

        losses = []
        for t in range(common.HSDP_STEPS):
            batch = tuple(jax.device_put(a, NamedSharding(mesh, P(axis)))
                          for a in common.hsdp_batch(t, processes))
            p, state, loss = xla_step(p, state, batch)
            losses.append(float(loss))
    xla = {k: np.asarray(v) for k, v in p.items()}

    p = params(mesh)
    state = sr.init_opt_state(tx, p, mesh, axis)
    step = sr.make_train_step(loss_fn, tx, mesh, axis)
    for t in range(common.HSDP_STEPS):
        p, state, _ = step(p, state, common.hsdp_batch(t, processes))
    return {"xla": xla, "losses": losses, "random_digests": common.shard_digests(p),
            "random": {k: np.asarray(v) for k, v in p.items()}}


@functools.cache
def _hsdp_reference(processes: int) -> dict[str, Any]:
    """The k=0 and Random runs of ``hsdp.py`` in this process, on 8 devices."""
    return _reference(common.hsdp_mesh(jax.devices(), processes), "replica",
                      common.hsdp_params, common.hsdp_loss, common.hsdp_tx("random"),
                      processes)


def _assert_close(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=HSDP_RTOL, atol=HSDP_ATOL,
                                   err_msg=k)


def _assert_runs(directory: Path, processes: int, reference: dict[str, Any],
                 case: str) -> None:
    """Each process's params of ``case`` against this process's :func:`_reference`.

    k=0: XLA's step (and its losses); Random: the same run, and not k=0's.
    """
    for got in _job_files(directory, f"{case}.npz", processes):
        losses = got.pop("losses")
        if case == "k0":
            np.testing.assert_allclose(losses, reference["losses"], rtol=HSDP_RTOL)
            _assert_close(got, reference["xla"])
        else:
            _assert_close(got, reference["random"])
            assert not np.allclose(got["w1"], reference["xla"]["w1"], rtol=1e-3)


def _assert_shards_identical(digests: list[dict[str, str]], devices: int) -> None:
    """The same digest of every fsdp shard in every process; ``devices`` each."""
    assert all(d == digests[0] for d in digests), digests
    for k, spec in common.HSDP_SPECS.items():
        shards = [where for where in digests[0] if where.startswith(f"['{k}']@")]
        assert len(shards) == devices, (k, spec, shards)


@pytest.mark.parametrize("layout", HSDP_LAYOUTS, ids=HSDP_IDS)
def test_hsdp_num_skip_zero_equals_gspmd(hsdp_job, layout) -> None:
    """k=0 over 10 steps on (replica across processes, fsdp inside each).

    Each process passes only its replica's rows; the params come back as
    every process holds them, put together from its shards, and equal XLA's
    own step on the whole batch with the same layout, in one process.
    """
    processes, devices = layout
    directory = hsdp_job(processes, devices, "train")
    reference = _hsdp_reference(processes)
    _assert_shards_identical(_job_files(directory, "k0.json", processes), devices)
    _assert_runs(directory, processes, reference, "k0")


@pytest.mark.parametrize("layout", HSDP_LAYOUTS, ids=HSDP_IDS)
def test_hsdp_random_replicas_bit_identical(hsdp_job, layout) -> None:
    """Random SkipReduce (50%): every fsdp shard the same in all processes.

    The job asserts ``assert_replicated`` of params and Adam state over the
    replica axis; here: the digest of each fsdp shard of each param is the
    same in every process, the params are those of the same training in one
    process, and differ from k=0's (some of the ring was skipped).
    """
    processes, devices = layout
    directory = hsdp_job(processes, devices, "train")
    reference = _hsdp_reference(processes)
    _assert_shards_identical(_job_files(directory, "random.json", processes), devices)
    _assert_runs(directory, processes, reference, "random")


@pytest.mark.parametrize("layout", HSDP_LAYOUTS, ids=HSDP_IDS)
def test_hsdp_checkpoint_resume_bit_identical(hsdp_job, layout) -> None:
    """orbax save/restore of sharded params and state with error feedback.

    ``train`` runs 2T steps, saving after T and 2T; ``resume``, in new
    processes, restores step T into fresh state (checking each array's
    layout: params ``P(None, "fsdp")`` / ``P("fsdp")``, residuals
    ``P("replica", None, "fsdp")`` with each process's own row), trains T
    more and asserts them bit-identical to checkpoint 2T. Here: each
    process's digests of every shard of params and state after resuming
    equal those of the run that never stopped; the params' shards agree
    across processes, and each process holds its own residual row.
    """
    from skipreduce_jax import checkpoint  # needs orbax-checkpoint

    processes, devices = layout
    directory = hsdp_job(processes, devices, "resume")
    assert checkpoint.latest_step(directory / "ckpt") == 2 * common.HSDP_T
    uninterrupted = _job_files(directory, "ef.json", processes)
    assert _job_files(directory, "resume.json", processes) == uninterrupted
    _assert_shards_identical(
        [{k[len("[0]"):]: v for k, v in d.items() if k.startswith("[0]")}
         for d in uninterrupted], devices)
    for i, digests in enumerate(uninterrupted):
        rows = {k.split("@")[1].split(",")[0] for k in digests if ".residual[" in k}
        assert rows == {f"{i}:{i + 1}"}, rows


# --------------------------------------------------------------------------
# value_and_grad in a plain jit step: replicas across processes, fsdp inside.


def test_value_and_grad_across_processes(tmp_path) -> None:
    """2 processes x 4 devices: k=0 equals XLA's step in one process (10
    Adam steps); Random's replicas are bit-identical shard by shard and
    close to the same run in one process."""
    processes, devices = 2, 4
    proc = _launch(processes, devices, SCRIPTS / "value_and_grad.py", str(tmp_path))
    assert proc.returncode == 0, _output(proc)
    results = launcher_results(proc.stdout)
    assert_all_dead([int(r["pid"]) for r in results.values()])
    assert sorted(results) == list(range(processes)), _output(proc)
    reference = _hsdp_reference(processes)
    mesh = common.hsdp_mesh(jax.devices(), processes)

    def batch(t):
        return tuple(jax.device_put(a, NamedSharding(mesh, P("replica")))
                     for a in common.hsdp_batch(t, processes))

    random, _ = common.value_and_grad_run(mesh, "random", batch)
    for case, want in (("k0", reference["xla"]),
                       ("random", {k: np.asarray(v) for k, v in random.items()})):
        _assert_shards_identical(_job_files(tmp_path, f"vg_{case}.json", processes),
                                 devices)
        for got in _job_files(tmp_path, f"vg_{case}.npz", processes):
            losses = got.pop("losses")
            if case == "k0":
                np.testing.assert_allclose(losses, reference["losses"], rtol=HSDP_RTOL)
            _assert_close(got, want)
    assert not np.allclose(random["w1"], reference["xla"]["w1"], rtol=1e-3)


# --------------------------------------------------------------------------
# FSDP: params sharded by rows over a data axis spanning every process.

FSDP = SCRIPTS / "fsdp.py"


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):
    """``fsdp.py`` train then resume, see :func:`_train_then_resume`."""
    return _train_then_resume(tmp_path_factory, FSDP)


@functools.cache
def _fsdp_reference(processes: int, devices: int) -> dict[str, Any]:
    """The k=0 and Random runs of ``fsdp.py`` in this process, on P x D devices."""
    mesh = common.fsdp_mesh(jax.devices()[:processes * devices])
    return _reference(
        mesh, "data", lambda m: sr.shard_params(common.fsdp_host_params(), m, "data"),
        common.fsdp_loss, common.hsdp_tx("random", "data", params_sharded=True),
        processes)


def _fsdp_shards(digests: list[dict[str, str]], devices: int) -> dict[str, str]:
    """All processes' shards, checked to be theirs, as one ``path@index`` dict.

    Each process holds ``devices`` row blocks of each sharded param, none of
    another process's; the replicated gain is the same in every process.
    """
    merged: dict[str, str] = {}
    for d in digests:
        for k in ("w1", "b1", "w2"):
            assert len([w for w in d if w.startswith(f"['{k}']@")]) == devices, (k, d)
        assert d["['gain']@"] == digests[0]["['gain']@"], digests
        assert not {w for w in d if w != "['gain']@"} & set(merged), digests
        merged.update(d)
    return merged


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fsdp_num_skip_zero_equals_xlas_fsdp_step(fsdp_job, layout) -> None:
    """k=0 over 10 steps, params sharded by rows over every device.

    Each process holds only its devices' rows of each param (and passes only
    their rows of the batch); gathered whole, the params equal XLA's own
    FSDP step (plain jit, params ``P("data")``) in one process.
    """
    processes, devices = layout
    directory = fsdp_job(processes, devices, "train")
    reference = _fsdp_reference(processes, devices)
    _fsdp_shards(_job_files(directory, "k0.json", processes), devices)
    _assert_runs(directory, processes, reference, "k0")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fsdp_random_shards_bit_identical(fsdp_job, layout) -> None:
    """Random SkipReduce (50%): the same bits as the same run in one process.

    The job asserts ``assert_replicated`` (the gain and Adam's count and
    key, what is replicated); here: the processes' shards together are,
    digest for digest, those of the same training on P x D devices of this
    process (the skipped reduce-scatter only moves data between devices),
    and the params differ from k=0's.
    """
    processes, devices = layout
    directory = fsdp_job(processes, devices, "train")
    reference = _fsdp_reference(processes, devices)
    merged = _fsdp_shards(_job_files(directory, "random.json", processes), devices)
    assert merged == reference["random_digests"]
    _assert_runs(directory, processes, reference, "random")


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_fsdp_checkpoint_resume_bit_identical(fsdp_job, layout) -> None:
    """orbax save/restore of FSDP params, ZeRO moments and EF residuals.

    ``train`` runs 2T steps, saving after T and 2T; ``resume``, in new
    processes, restores step T into fresh state (params and Adam's moments
    ``P("data")`` with each process's rows, residuals ``[ranks, *shape]``
    with its devices' rows), trains T more and asserts them bit-identical
    to checkpoint 2T. Here: each process's digests of its shards of params
    and state after resuming equal those of the run that never stopped.
    """
    from skipreduce_jax import checkpoint  # needs orbax-checkpoint

    processes, devices = layout
    directory = fsdp_job(processes, devices, "resume")
    assert checkpoint.latest_step(directory / "ckpt") == 2 * common.HSDP_T
    uninterrupted = _job_files(directory, "ef.json", processes)
    assert _job_files(directory, "resume.json", processes) == uninterrupted
    _fsdp_shards([{k[len("[0]"):]: v for k, v in d.items() if k.startswith("[0]")}
                  for d in uninterrupted], devices)
    for i, digests in enumerate(uninterrupted):
        rows = {k.split("@")[1].split(",")[0] for k in digests if ".residual['w1']" in k}
        assert rows == {f"{r}:{r + 1}" for r in range(i * devices, (i + 1) * devices)}


# --------------------------------------------------------------------------
# Faults.


def test_killed_process_ends_the_job(tmp_path: Path) -> None:
    """Process 1 is SIGKILLed after 2 steps while process 0 keeps stepping."""
    proc = _launch(2, 2, FAULTS, "kill", str(tmp_path), timeout=120)
    ended = time.time()
    assert_all_dead(_pids(tmp_path, 2))
    since_kill = ended - float((tmp_path / "killed_at").read_text())
    print(f"killed process noticed and job ended {since_kill:.1f} s after the kill")
    # The launcher blames the process that ended first: process 1, not
    # process 0 failing on the dropped gloo connection a moment later.
    assert proc.returncode == 128 + signal.SIGKILL, _output(proc)
    assert "process 1 ([p1]" in proc.stderr, _output(proc)
    assert "killed by SIGKILL" in proc.stderr, _output(proc)
    # Both trained until the kill, and process 0 never finished a step
    # without 1. (Process 0 may fail in step 1 itself: process 1's last
    # messages of that step can still be in flight when it dies.)
    assert "[p0] STEP 0 " in proc.stdout and "[p1] STEP 1 " in proc.stdout, _output(proc)
    assert "[p0] STEP 2 " not in proc.stdout, _output(proc)
    # The launcher notices at once; ending the others takes its SIGTERM grace.
    assert since_kill < 30, since_kill


def test_killed_process_noticed_without_launcher(tmp_path: Path) -> None:
    """Without the launcher (as on separate hosts) process 0 fails by itself.

    The two processes get the launcher's environment but are started here,
    so that nobody ends process 0 for it: it must exit non-zero by itself
    with a clear message, within the heartbeat timeout of
    ``LAUNCHER_DEFAULTS`` plus a margin. Which mechanism fires first depends
    on where process 0 waits: a gloo collective whose TCP peer went away
    fails at once ("Connection closed/reset by peer"); otherwise the
    coordination service declares process 1 dead when its heartbeats stop
    (and aborts process 0).
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    try:
        for rank in range(2):
            env = _env()
            env.update({
                distributed.ENV_COORDINATOR: f"127.0.0.1:{port}",
                distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(rank),
                distributed.ENV_LOCAL_DEVICES: "1",
                "PYTHONUNBUFFERED": "1",
            })
            procs.append(subprocess.Popen(
                [sys.executable, str(FAULTS), "kill", str(tmp_path)], cwd=REPO, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))
        heartbeat = distributed.LAUNCHER_DEFAULTS["heartbeat_timeout_seconds"]
        out0, _ = procs[0].communicate(timeout=heartbeat + 90)
        ended = time.time()
        procs[1].communicate(timeout=10)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert_all_dead(_pids(tmp_path, 2))
    since_kill = ended - float((tmp_path / "killed_at").read_text())
    why = re.search(r"Connection (closed|reset) by peer|stopped sending heartbeats", out0)
    print(f"process 0 ended by itself {since_kill:.1f} s after the kill (heartbeat "
          f"timeout {heartbeat} s), exit {procs[0].returncode}: {why and why.group(0)}")
    assert procs[1].returncode == -signal.SIGKILL
    assert procs[0].returncode != 0, out0
    assert "STEP 1 " in out0 and "STEP 2 " not in out0, out0
    assert why, out0
    assert since_kill < heartbeat + 30, since_kill


@pytest.mark.parametrize(
    "mode, message",
    [
        ("num_skip", "skip_reduce settings (num_skip/skip_ratio"),
        ("seed", "skip_reduce seed differs between devices or processes"),
    ],
)
def test_mismatched_configuration_refused_at_start(tmp_path: Path, mode: str, message: str) -> None:
    """Process 1 builds skip_reduce differently: init_opt_state refuses it."""
    proc = _launch(2, 2, FAULTS, mode, str(tmp_path), timeout=120)
    assert_all_dead(_pids(tmp_path, 2))
    assert proc.returncode == 1, _output(proc)
    assert re.search(rf"^\[p\d\] ValueError: {re.escape(message)}", proc.stdout, re.M), (
        _output(proc)
    )
    assert "exited with code 1" in proc.stderr, _output(proc)
    assert "TRAINING" not in proc.stdout and "STEP" not in proc.stdout, _output(proc)


# --------------------------------------------------------------------------
# The example.


def test_multihost_train_example() -> None:
    """examples/multihost_train.py on 2 processes x 2 devices, a few steps."""
    proc = _launch(2, 2, EXAMPLE, "--steps", "4", "--log-every", "1", timeout=150)
    assert proc.returncode == 0, _output(proc)
    out = proc.stdout
    assert "[p0] 2 process(es) x 2 device(s) = 4 data-parallel ranks" in out, out
    losses = re.findall(r"^\[p(\d)\] \[random 50%\] step +(\d+) +loss (\S+)$", out, re.M)
    assert [(p, int(t)) for p, t, _ in losses] == [("0", t) for t in range(1, 5)], out
    assert all(np.isfinite(float(v)) for _, _, v in losses)
    digests = dict(re.findall(r"^\[p\d\] process (\d): \[random 50%\] params sha256 (\w+)$",
                              out, re.M))
    assert sorted(digests) == ["0", "1"] and len(set(digests.values())) == 1, out
    assert "[p0] [random 50%] params replicated on all 4 devices of 2 process(es): OK" in out
    assert re.search(r"^\[p0\] final test accuracy \(random 50%\): 0\.\d{4}$", out, re.M), out
    assert re.search(r"^\[p0\] bytes per device per step: [\d,]+ \(full all-reduce [\d,]+;",
                     out, re.M), out
    assert not re.search(r"^\[p1\] .*(loss|accuracy|bytes)", out, re.M), out


def test_multihost_train_example_needs_a_timed_step() -> None:
    # One step is the compiling one: no step would be left to time.
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "1"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, _output(proc)
    assert "--steps must be >= 2" in proc.stderr, _output(proc)
