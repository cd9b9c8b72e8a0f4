"""``examples/train_sharded.py``: an NNX model sharded over (fsdp, tensor),
SkipReduce over the replica axis of a (2, 2, 2) mesh."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_sharded as ts  # noqa: E402

nnx = ts.nnx
CONFIG = ts.Config(mesh=(2, 2, 2), steps=10, batch=8, seq_len=16, d_model=16,
                   layers=1, heads=2, min_size=0, warmup=2)
STEPS = 3
SGD = optax.sgd(0.05, momentum=0.9)  # compiles faster than the demo's AdamW


def _tokens(step):
    rng = np.random.default_rng(step)
    return rng.integers(0, ts.VOCAB_SIZE, (CONFIG.batch, CONFIG.seq_len + 1)).astype(np.int32)


def _specs(model):
    return jax.tree_util.tree_leaves(nnx.get_partition_spec(nnx.state(model, nnx.Param)),
                                     is_leaf=lambda x: isinstance(x, P))


def _train(variant, mesh):
    tx = optax.chain(sr.skip_reduce("replica", **ts.reduce_kwargs(variant, CONFIG)), SGD)
    model = ts.create_model(CONFIG, mesh)
    optimizer = ts.srnnx.init_optimizer(model, tx, mesh, "replica")
    step = ts.make_train_step(mesh)
    losses = [float(step(model, optimizer, _tokens(i))) for i in range(STEPS)]
    return model, optimizer, step, losses


@pytest.fixture(scope="module")
def mesh():
    return ts.make_mesh(CONFIG.mesh)


@pytest.fixture(scope="module")
def allreduce(mesh):
    return _train("allreduce", mesh)


def test_params_keep_their_shardings_and_each_device_holds_its_shards(mesh, allreduce):
    model, optimizer, _, _ = allreduce
    params = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    specs = _specs(model)
    both = 0
    for x, spec in zip(params, specs, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), spec
        split = math.prod(mesh.shape[a] for a in sr_axes(spec))
        assert x.addressable_shards[0].data.nbytes * split == x.nbytes, spec
        if {"fsdp", "tensor"} <= set(sr_axes(spec)):   # the kernels and tok_embed
            both += 1
            assert x.addressable_shards[0].data.nbytes == x.nbytes // 4
    assert both == 1 + 4 * CONFIG.layers
    held = ts.device_bytes(nnx.state(model, nnx.Param))
    assert held["per_device"] < 0.35 * held["replicated"]
    # The momentum lives like its params.
    trace = optimizer.opt_state[1][0].trace
    for x, spec in zip(jax.tree_util.tree_leaves(trace), specs, strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), spec


def sr_axes(spec):
    return [a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))]


def test_num_skip_zero_equals_xlas_gspmd_step(mesh, allreduce):
    model, _, _, losses = allreduce
    step, params, opt_state = ts.gspmd_step(ts.create_model(CONFIG, mesh), SGD, mesh)
    ref = []
    with jax.set_mesh(mesh):
        for i in range(STEPS):
            tokens = jax.device_put(_tokens(i), NamedSharding(mesh, P("replica")))
            params, opt_state, loss = step(params, opt_state, tokens)
            ref.append(float(loss))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)),
                    jax.tree_util.tree_leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_random_replicas_stay_bit_identical_and_send_the_formula(mesh, allreduce):
    model, optimizer, step, losses = _train("random", mesh)
    assert losses != allreduce[3]                  # skipping changed the training
    sr.assert_replicated(nnx.state(model), mesh)   # ... but not the replicas
    sr.assert_replicated(optimizer.opt_state, mesh)
    for x, spec in zip(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)), _specs(model),
                       strict=True):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), spec
    # Bytes over replica: the ring on each device's shards (every leaf, min_size=0).
    kwargs = ts.reduce_kwargs("random", CONFIG)
    sent = ts.traffic_by_axis(step.lower(model, optimizer, _tokens(0)).compile().as_text(), mesh)
    expected = sr.comm_stats(ts.local_shapes(model), 2, **kwargs).bytes_per_device
    assert sent["replica"] == pytest.approx(expected + ts.sr_loss_bytes(2))
    assert sent["mixed"] == 0 and sent["other"] > 0
    # The all-reduce sends the full ring's bytes at most (XLA reduces the
    # replicated LayerNorm gradients on halves split over tensor).
    model, optimizer, step, _ = allreduce
    full = ts.traffic_by_axis(step.lower(model, optimizer, _tokens(0)).compile().as_text(), mesh)
    local = ts.device_bytes(nnx.state(model, nnx.Param))["per_device"]
    assert sent["replica"] < 0.6 * full["replica"] <= 0.6 * (local + ts.sr_loss_bytes(2))


def test_traffic_by_axis_tells_axes_of_equal_size_apart(mesh):
    def program(*ops):
        return "\n".join(["HloModule m, num_partitions=8", "ENTRY %main (p: f32[64]) -> f32[64] {",
                          *[f"  %op{i} = f32[64]{{0}} {op}" for i, op in enumerate(ops)], "}"])

    over_replica = ("all-reduce(%p), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
                    "use_global_device_ids=true")
    over_tensor = ("all-reduce(%p), channel_id=2, replica_groups=[4,2]<=[8], "
                   "use_global_device_ids=true")
    permute = "collective-permute(%p), channel_id=3, source_target_pairs={{0,4},{4,0},{1,1}}"
    iota = ("all-gather(%p), channel_id=4, replica_groups=[4,2]<=[2,2,2]T(1,2,0), "
            "use_global_device_ids=true, dimensions={0}")
    named = ("all-reduce(%p), channel_id=5, replica_groups=mesh['axis_0'=2,'axis_1'=4], "
             "device_ids=([4,2]T(1,0)) {'axis_0'}, use_global_device_ids=true")
    out = ts.traffic_by_axis(program(over_replica, over_tensor, permute, iota, named), mesh)
    # f32[64]: 256 bytes; groups of 2: an all-reduce sends 256, an all-gather 128.
    assert out == {"replica": 256 + 256 + 128, "other": 256 + 256, "mixed": 0,
                   "total": 256 * 4 + 128}
    mixed = "all-reduce(%p), channel_id=1, replica_groups={{0,1,4,5},{2,3,6,7}}"
    assert ts.traffic_by_axis(program(mixed + ", use_global_device_ids=true"), mesh)["mixed"] > 0


@pytest.mark.parametrize("change, message", [
    (["--mesh", "2,2"], "give three positive sizes"),
    (["--mesh", "3,3,1"], "needs 9 devices"),
    (["--batch", "6", "--mesh", "4,2,1"], "must divide by the replica size 4"),
    (["--variants", "random,random"], "distinct names"),
])
def test_bad_arguments_are_usage_errors(change, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ts.parse_args(change)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_writes_the_report(tmp_path):
    args = ["--steps", "20", "--batch", "8", "--seq-len", "16", "--d-model", "16",
            "--layers", "1", "--heads", "2", "--eval-every", "10", "--val-windows", "16",
            "--train-mb", "0.25", "--val-mb", "0.03", "--check-steps", "3",
            "--out", str(tmp_path)]
    report = ts.main(args)
    results = report["results"]
    assert report["gspmd"]["train_loss"] == pytest.approx(
        results["allreduce"]["train_loss"][:3], rel=1e-5)
    for r in results.values():
        assert r["params_kept"] and r["final_val_loss"] < r["evals"][0][1] - 0.5
    assert (results["random"]["bytes"]["replica"] < results["selective"]["bytes"]["replica"]
            < results["allreduce"]["bytes"]["replica"])
    saved = json.loads((tmp_path / "sharded.json").read_text())
    assert saved["results"]["random"]["final_val_loss"] == results["random"]["final_val_loss"]
    assert (tmp_path / "sharded.png").stat().st_size > 0
