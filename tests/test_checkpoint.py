"""Checkpointing: a resumed run is bit-identical to one that never stopped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skipreduce_jax as sr
from skipreduce_jax import checkpoint

N = 8
T = 4  # steps before the checkpoint; the run then goes on to 2T
REPO = Path(__file__).resolve().parents[1]
RESUME_SCRIPT = REPO / "tests" / "mp_scripts" / "checkpoint_resume.py"
RESUME_SCRIPT_T = 3  # T of checkpoint_resume.py: it saves steps T and 2T


def _make_tx(num_skip: int = 5, error_feedback: bool | str = True,
             min_size: int = 0, selective: Any = None) -> Any:
    # Random SkipReduce with error feedback (the residuals carry state) and a
    # warmup that ends before the checkpoint: steps 2..2T-1 skip.
    return optax.chain(
        sr.skip_reduce("data", num_skip=num_skip, seed=7, min_size=min_size,
                       selective=selective,
                       warmup_steps=2, error_feedback=error_feedback),
        optax.adam(0.05))


def _loss(params: Any, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) + params["b"] - y) ** 2)


def _init_params(seed: int) -> dict[str, jax.Array]:
    key = jax.random.key(seed)
    return {"w": jax.random.normal(key, (16, 64)) * 0.3, "b": jnp.zeros(64)}


def _batch(step: int, mesh: jax.sharding.Mesh) -> Any:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(N * 4, 16)).astype(np.float32)
    y = rng.normal(size=(N * 4, 64)).astype(np.float32)
    return sr.shard_batch((x, y), mesh, "data")


def _fresh(mesh: jax.sharding.Mesh, *, seed: int = 0, **tx_kwargs) -> tuple:
    """New tx, params, state and step function, as a restarted job builds."""
    tx = _make_tx(**tx_kwargs)
    params = sr.replicate(_init_params(seed), mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    return tx, params, opt_state, sr.make_train_step(_loss, tx, mesh, "data")


def _run(step_fn, params, opt_state, mesh, start: int, stop: int) -> tuple:
    for i in range(start, stop):
        params, opt_state, loss = step_fn(params, opt_state, _batch(i, mesh))
        jax.block_until_ready(loss)  # keep the queue of steps short
    return params, opt_state


def _host(tree: Any) -> Any:
    return jax.tree_util.tree_map(np.asarray, tree)


def _assert_trees_equal(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def uninterrupted(mesh, tmp_path_factory) -> tuple[Path, Any, Any, Any]:
    """2T steps in one go, saved at step T on the way; host copies."""
    directory = tmp_path_factory.mktemp("ckpt")
    _, params, opt_state, step_fn = _fresh(mesh)
    params, opt_state = _run(step_fn, params, opt_state, mesh, 0, T)
    checkpoint.save(directory, T, params, opt_state)
    saved_state = _host(opt_state)
    # The step donates its inputs: save must be complete before this.
    params, opt_state = _run(step_fn, params, opt_state, mesh, T, 2 * T)
    return directory, saved_state, _host(params), _host(opt_state)


def test_resume_is_bit_identical_with_error_feedback_and_warmup(mesh, uninterrupted):
    directory, _, final_params, final_state = uninterrupted
    # A restarted job: new objects, params initialised from another seed.
    _, params, opt_state, step_fn = _fresh(mesh, seed=123)
    step, params, opt_state = checkpoint.restore(
        directory, params_like=params, opt_state_like=opt_state)
    assert step == T
    assert int(opt_state[0].count) == T
    params, opt_state = _run(step_fn, params, opt_state, mesh, T, 2 * T)
    _assert_trees_equal(_host(params), final_params)
    _assert_trees_equal(_host(opt_state), final_state)
    assert step_fn._cache_size() == 1  # restored placement matches the step's


@pytest.mark.slow
def test_resume_with_error_feedback_auto_restores_its_rule(mesh, tmp_path):
    _, params, opt_state, step_fn = _fresh(mesh, error_feedback="auto")
    params, opt_state = _run(step_fn, params, opt_state, mesh, 0, T)
    checkpoint.save(tmp_path, T, params, opt_state)
    params, opt_state = _run(step_fn, params, opt_state, mesh, T, 2 * T)
    final_params, final_state = _host(params), _host(opt_state)
    _, params, opt_state, step_fn = _fresh(mesh, seed=123, error_feedback="auto")
    _, params, opt_state = checkpoint.restore(tmp_path, params_like=params,
                                              opt_state_like=opt_state)
    assert isinstance(opt_state[0], sr.FeedbackGateState)
    assert float(opt_state[0].nonlinear) < 1  # the rule's mean, not its start
    params, opt_state = _run(step_fn, params, opt_state, mesh, T, 2 * T)
    _assert_trees_equal(_host(params), final_params)
    _assert_trees_equal(_host(opt_state), final_state)


def test_resume_with_a_leaf_that_is_never_skipped(mesh, tmp_path):
    # min_size=100: "b" (64 elements) always gets the full all-reduce and
    # keeps an empty [N, 0] residual, an array orbax does not store.
    _, params, opt_state, step_fn = _fresh(mesh, min_size=100)
    assert opt_state[0].residual["b"].shape == (N, 0)
    params, opt_state = _run(step_fn, params, opt_state, mesh, 0, T)
    checkpoint.save(tmp_path, T, params, opt_state)
    final = _host(_run(step_fn, params, opt_state, mesh, T, 2 * T))
    _, params, opt_state, step_fn = _fresh(mesh, seed=123, min_size=100)
    step, params, opt_state = checkpoint.restore(
        tmp_path, params_like=params, opt_state_like=opt_state)
    assert step == T and opt_state[0].residual["b"].shape == (N, 0)
    _assert_trees_equal(_host(_run(step_fn, params, opt_state, mesh, T, 2 * T)),
                        final)
    assert step_fn._cache_size() == 1


def test_restored_state_and_placement(mesh, uninterrupted):
    directory, saved_state, _, _ = uninterrupted
    _, params_like, state_like, _ = _fresh(mesh)
    _, params, opt_state = checkpoint.restore(
        directory, params_like=params_like, opt_state_like=state_like)
    _assert_trees_equal(_host(opt_state), saved_state)
    for got, like in zip(jax.tree_util.tree_leaves((params, opt_state)),
                         jax.tree_util.tree_leaves((params_like, state_like))):
        assert got.sharding == like.sharding
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.is_fully_replicated

    residual = opt_state[0].residual["w"]
    saved = saved_state[0].residual["w"]
    assert residual.shape == (N, 16, 64)
    assert np.any(saved != 0) and not np.array_equal(saved[0], saved[1])
    devices = list(mesh.devices.flat)
    shards = sorted(residual.addressable_shards, key=lambda s: s.index[0].start)
    assert len(shards) == N
    for r, shard in enumerate(shards):
        assert shard.index[0] == slice(r, r + 1)
        assert shard.device == devices[r]   # rank r's row on rank r's device
        np.testing.assert_array_equal(np.asarray(shard.data)[0], saved[r])


def test_abstract_targets_and_latest_step(mesh, uninterrupted, tmp_path):
    directory, saved_state, _, _ = uninterrupted
    assert checkpoint.latest_step(directory) == T
    assert checkpoint.latest_step(tmp_path / "none") is None
    # Only directories that save writes count, as for restore(step=None).
    (tmp_path / "backup_9").mkdir()
    (tmp_path / "7.orbax-checkpoint-tmp-1").mkdir()
    assert checkpoint.latest_step(tmp_path) is None
    tx, params, state, _ = _fresh(mesh)
    as_abstract = lambda t: jax.tree_util.tree_map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    step, _, opt_state = checkpoint.restore(
        directory, params_like=as_abstract(params),
        opt_state_like=as_abstract(state), step=T)
    assert step == T
    _assert_trees_equal(_host(opt_state), saved_state)


def test_round_trip_without_error_feedback_keeps_empty_state(mesh, tmp_path):
    _, params, opt_state, step_fn = _fresh(mesh, error_feedback=False)
    params, opt_state = _run(step_fn, params, opt_state, mesh, 0, 3)
    assert isinstance(opt_state[0].residual, optax.EmptyState)
    checkpoint.save(tmp_path, 3, params, opt_state)
    _, like_params, like_state, _ = _fresh(mesh, error_feedback=False)
    step, got_params, got_state = checkpoint.restore(
        tmp_path, params_like=like_params, opt_state_like=like_state)
    assert step == 3
    assert isinstance(got_state[0], sr.SkipReduceState)
    assert isinstance(got_state[0].residual, optax.EmptyState)
    assert isinstance(got_state[1][1], optax.EmptyState)
    _assert_trees_equal(_host(got_state), _host(opt_state))
    _assert_trees_equal(_host(got_params), _host(params))


@pytest.mark.parametrize("tx_kwargs", [dict(num_skip=3), dict(error_feedback=False)],
                         ids=["num_skip", "error_feedback"])
def test_restore_refuses_other_settings(mesh, uninterrupted, tx_kwargs):
    directory = uninterrupted[0]
    _, params, opt_state, _ = _fresh(mesh, **tx_kwargs)
    with pytest.raises(ValueError, match=r"skip_reduce settings of checkpoint "
                       r"step 4 \(fingerprint 0x[0-9a-f]{8} at opt_state\[0\]\) "
                       r"differ"):
        checkpoint.restore(directory, params_like=params, opt_state_like=opt_state)


def test_restore_refuses_a_state_of_other_fields(mesh, uninterrupted, tmp_path):
    # A checkpoint of an earlier version records no fields: its state also
    # held those of the retired control_variate and monitor options.
    directory = tmp_path / "earlier"
    shutil.copytree(uninterrupted[0], directory)
    (settings,) = directory.glob(f"{T}/skip_reduce/metadata")
    saved = json.loads(settings.read_text())
    for entry in saved["skip_reduce"]:
        del entry["fields"]
    settings.write_text(json.dumps(saved))
    _, params, opt_state, _ = _fresh(mesh)
    with pytest.raises(ValueError, match=r"state at opt_state\[0\] of checkpoint "
                       r"step 4 was written by an earlier version.*Resume it with "
                       r"the version that wrote it"):
        checkpoint.restore(directory, params_like=params, opt_state_like=opt_state)


def test_restore_refuses_residuals_of_other_leaves(mesh, uninterrupted):
    # selective is not in the fingerprint (it may be a callable); excluding
    # "b" now gives it an empty residual where the checkpoint has a full one.
    _, params, opt_state, _ = _fresh(mesh, selective=sr.exclude("b"))
    with pytest.raises(ValueError, match=r"rows of checkpoint step 4 at "
                       r"opt_state\[0\] have shapes .*selective or min_size"):
        checkpoint.restore(uninterrupted[0], params_like=params,
                           opt_state_like=opt_state)


def test_restore_refuses_another_number_of_ranks(uninterrupted):
    directory = uninterrupted[0]
    small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    tx = _make_tx()
    params = sr.replicate(_init_params(0), small)
    opt_state = sr.init_opt_state(tx, params, small, "data")
    with pytest.raises(ValueError, match=r"rows .* for 8 ranks .* for 4"):
        checkpoint.restore(directory, params_like=params, opt_state_like=opt_state)


def test_bad_calls(mesh, uninterrupted, tmp_path):
    directory = uninterrupted[0]
    _, params, opt_state, _ = _fresh(mesh)
    with pytest.raises(ValueError, match=r"step 4 was not saved.*steps must "
                       "increase"):
        checkpoint.save(directory, T, params, opt_state)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint step 5"):
        checkpoint.restore(directory, params_like=params,
                           opt_state_like=opt_state, step=5)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        checkpoint.restore(tmp_path / "missing", params_like=params,
                           opt_state_like=opt_state)
    with pytest.raises(TypeError, match=r"params_like\['b'\] has no sharding"):
        checkpoint.restore(directory, params_like=_host(params),
                           opt_state_like=opt_state)


@pytest.mark.slow
def test_resume_across_two_processes(tmp_path):
    """Train, stop, resume in new processes: bit-identical (2 x 2 devices)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SKIPREDUCE_") and k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO),
                                                      env.get("PYTHONPATH")]))
    env["JAX_PLATFORMS"] = "cpu"
    directory = str(tmp_path / "ckpt")
    for mode in ("train", "resume"):
        proc = subprocess.run(
            [sys.executable, "-m", "skipreduce_jax.launch", "-n", "2", "-d", "2",
             "--timeout", "150", str(RESUME_SCRIPT), directory, mode],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=200)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        for p in range(2):
            assert f"[p{p}] RESULT {mode} ok" in proc.stdout, proc.stdout
    assert checkpoint.latest_step(directory) == 2 * RESUME_SCRIPT_T


# -- errors that say what differs and the fix -------------------------------------

@pytest.mark.parametrize("step, error, match", [
    (7.9, TypeError, r"checkpoint\.save: step=7\.9 must be a non-negative int"),
    (-1, ValueError, r"checkpoint\.save: step=-1 must be a non-negative int"),
    (True, TypeError, r"checkpoint\.save: step=True must be"),
], ids=["float", "negative", "bool"])
def test_save_refuses_a_step_that_is_not_a_non_negative_int(mesh, tmp_path, step,
                                                           error, match):
    _, params, opt_state, _ = _fresh(mesh, error_feedback=False)
    with pytest.raises(error, match=match):
        checkpoint.save(tmp_path, step, params, opt_state)
    assert checkpoint.latest_step(tmp_path) is None and not any(tmp_path.iterdir())
    checkpoint.save(tmp_path, np.int64(7), params, opt_state)  # numpy ints are ints
    assert checkpoint.latest_step(tmp_path) == 7


def _placed(mesh, tree):
    return sr.replicate(tree, mesh)


def test_restore_names_the_leaves_that_differ(mesh, uninterrupted):
    directory = uninterrupted[0]
    _, params, opt_state, _ = _fresh(mesh)
    other_shape = _placed(mesh, {"w": jnp.zeros((16, 32)), "b": jnp.zeros(64)})
    with pytest.raises(ValueError, match=r"^restore: checkpoint step 4 does not fit "
                       r"params_like: params_like\['w'\] has shape \(16, 32\), the "
                       r"checkpoint \(16, 64\)\. Pass params_like built like the "
                       r"params of the run that saved it") as raised:
        checkpoint.restore(directory, params_like=other_shape, opt_state_like=opt_state)
    assert "strict=False" not in str(raised.value)
    other_tree = _placed(mesh, {"w": jnp.zeros((16, 64)), "b": jnp.zeros(64),
                                "c": jnp.zeros(3)})
    with pytest.raises(ValueError, match=r"params_like\['c'\] is not in the "
                       r"checkpoint") as raised:
        checkpoint.restore(directory, params_like=other_tree, opt_state_like=opt_state)
    assert "partial_restore" not in str(raised.value)
    tx = optax.chain(sr.skip_reduce("data", num_skip=5, seed=7, min_size=0,
                                    warmup_steps=2, error_feedback=True),
                     optax.sgd(0.05, momentum=0.9))
    with pytest.raises(ValueError, match=r"does not fit opt_state_like: "
                       r"opt_state_like\[1\]\[0\]\.trace\['b'\] is not in the "
                       r"checkpoint.*Build opt_state_like with the optimizer of the "
                       r"run that saved it") as raised:
        checkpoint.restore(directory, params_like=params,
                           opt_state_like=sr.init_opt_state(tx, params, mesh, "data"))
    assert "partial_restore" not in str(raised.value)


def test_restore_where_only_comm_dtype_changed_names_it(mesh, uninterrupted):
    tx = optax.chain(sr.skip_reduce("data", num_skip=5, seed=7, min_size=0,
                                    warmup_steps=2, error_feedback=True,
                                    comm_dtype=jnp.bfloat16), optax.adam(0.05))
    params = sr.replicate(_init_params(0), mesh)
    with pytest.raises(ValueError, match=r"settings of checkpoint step 4 .* differ.*"
                       r"the same .*accumulate_dtype, check_finite, params_sharded, "
                       r"comm_dtype .*as the run that saved it"):
        checkpoint.restore(uninterrupted[0], params_like=params,
                           opt_state_like=sr.init_opt_state(tx, params, mesh, "data"))


def test_restore_of_multisteps_on_another_number_of_ranks(mesh, tmp_path):
    # acc_grads holds one row per rank, like the residuals the settings record.
    def state(mesh):
        tx = sr.MultiSteps(optax.chain(sr.skip_reduce(
            "data", num_skip=1, min_size=0), optax.sgd(0.1)), 2)
        params = sr.replicate(_init_params(0), mesh)
        return params, sr.init_opt_state(tx, params, mesh, "data")

    checkpoint.save(tmp_path, 1, *state(mesh))
    small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    params, opt_state = state(small)
    with pytest.raises(ValueError, match=r"^restore: opt_state_like\.acc_grads\['b'\] "
                       r"is per-rank state \(acc_grads, one row per rank\): "
                       r"checkpoint step 1 has rows for 8 ranks, opt_state_like for "
                       r"4\..*resume on the same number of data-parallel ranks"):
        checkpoint.restore(tmp_path, params_like=params, opt_state_like=opt_state)


@pytest.mark.parametrize("damage, error, match", [
    ("truncate", ValueError, r"^restore: the arrays of checkpoint step 4 in .* could "
     r"not be read \(.*\): its files are damaged or incomplete\. Restore another step"),
    ("settings", ValueError, r"^restore: the skip_reduce settings record of checkpoint "
     r"step 4 in .* is damaged \(not valid JSON: .*\)\. Restore another step"),
    ("missing", FileNotFoundError, r"^restore: checkpoint step 4 in .* has no "
     r"opt_state arrays.*Restore another step"),
], ids=["truncated_array", "damaged_settings", "missing_item"])
def test_restore_of_a_damaged_checkpoint(mesh, uninterrupted, tmp_path, damage,
                                         error, match):
    directory = tmp_path / "damaged"
    shutil.copytree(uninterrupted[0], directory)
    step = directory / str(T)
    if damage == "truncate":
        for path in (step / "params").rglob("*"):
            if path.is_file() and path.parent.name == "d":
                path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif damage == "settings":
        (step / "skip_reduce" / "metadata").write_text('{"skip_reduce": [')
    else:
        shutil.rmtree(step / "opt_state")
    _, params, opt_state, _ = _fresh(mesh)
    with pytest.raises(error, match=match):
        checkpoint.restore(directory, params_like=params, opt_state_like=opt_state)
