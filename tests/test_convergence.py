"""The convergence benchmark: target, steps to it, ratios, and a tiny run."""

import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import convergence as cv  # noqa: E402


def _history(losses, every=10):
    return dict(step=[every * i for i in range(len(losses))], val_loss=list(losses),
                val_acc=[1.0 - v for v in losses], train_loss=list(losses))


def _run(variant, seed, losses, **key):
    group = dict(workload="mlp", optimizer="sgd", ranks=8, skip_ratio=0.5)
    group.update(key)
    return dict(group, variant=variant, seed=seed, history=_history(losses))


def test_target_is_the_loss_nearest_the_fraction_of_the_run():
    history = _history([3.0, 2.0, 1.5, 1.2, 1.0, 0.9, 0.8])  # steps 0..60
    assert cv.target_of(history, 2 / 3) == (40, 1.0)
    # Halfway between two evaluations: the earlier one.
    assert cv.target_of(_history([3.0, 2.0, 1.0, 0.5]), 0.5) == (10, 2.0)
    assert cv.target_of(history, 1.0) == (60, 0.8)


def test_steps_to_is_the_first_evaluation_at_or_below_the_target():
    history = _history([3.0, 1.1, 0.9, 1.2, 0.8])
    assert cv.steps_to(history, 1.0) == 20
    assert cv.steps_to(history, 0.9) == 20  # at the target counts
    assert cv.steps_to(history, 0.5) is None


def test_ratio_and_median_treat_never_as_infinite():
    assert cv.ratio(30, 20) == 1.5
    assert cv.ratio(None, 20) == math.inf
    assert cv.ratio(30, None) is None
    assert cv.median([2.0, None, 1.0, 3.0]) == 2.0
    assert cv.median([1.0, 2.0]) == 1.5
    assert cv.median([1.0, math.inf]) == math.inf
    assert cv.median([1.0, math.inf, math.inf]) == math.inf
    assert cv.median([None]) is None


def test_summarize_on_synthetic_curves():
    fast = [3.0, 2.0, 1.5, 1.2, 1.0, 0.9, 0.8]       # the all-reduce: target 1.0 at 40
    runs = [_run("all-reduce", 0, fast), _run("all-reduce", 1, fast),
            _run("bound", 0, [3.0, 2.2, 1.7, 1.3, 1.1, 1.0, 0.9]),   # 50
            _run("bound", 1, [3.0, 2.2, 1.7, 1.3, 1.1, 1.05, 0.99]),  # 60
            _run("random", 0, [3.0, 2.1, 1.6, 1.3, 1.05, 0.95, 0.9]),  # 50
            _run("random", 1, [3.0, 2.1, 1.6, 1.3, 1.05, 1.01, 1.01]),  # never
            _run("all-reduce", 0, [3.0, 1.0, 0.5, 0.4], optimizer="adamw")]
    rows = {(r["optimizer"], r["variant"]): r for r in cv.summarize(runs, 2 / 3)}
    base, bound, rand = (rows["sgd", v] for v in ("all-reduce", "bound", "random"))
    assert base["targets"] == [1.0, 1.0] and base["target_step"] == [40, 40]
    assert base["steps"] == [40, 40] and base["vs_allreduce"] == [1.0, 1.0]
    assert bound["steps"] == [50, 60]
    assert bound["vs_allreduce"] == [1.25, 1.5]
    assert bound["half_batch_cost"] == base["half_batch_cost"] == pytest.approx(1.375)
    assert rand["steps"] == [50, None]
    assert rand["vs_allreduce"] == [1.25, math.inf]
    assert rand["vs_bound"] == [1.0, math.inf]
    assert rand["steps_median"] == math.inf  # one seed in two never gets there
    assert rand["final_loss"] == [0.9, 1.01]
    assert rand["final_acc_median"] == pytest.approx(1 - (0.9 + 1.01) / 2)
    # A group without a bound run has no bound ratios and no regime.
    adam = rows["adamw", "all-reduce"]
    assert adam["steps"] == [20] and adam["vs_bound"] == [None]
    assert adam["half_batch_cost"] is None
    # The markdown table names every variant and writes "never".
    table = cv.markdown_table(list(rows.values()))
    assert "| mlp | sgd | 8, 0.5 | 1.38 | Random (the defaults: balanced) | 50, never |" in table
    assert table.count("\n") == 2 + len(rows) - 1


def test_bound_batches_keep_the_first_share_of_every_rank():
    x = np.arange(2 * 4 * 6).reshape(2, 4 * 6)  # 2 steps, 4 ranks of 6
    (kept,) = cv.shrink_batches((x,), ranks=4, batch=6, keep=3)
    assert kept.shape == (2, 12)
    np.testing.assert_array_equal(kept[0], [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 20])
    assert cv.kept_per_rank(64, 8, 0.5) == 32     # k = 4 of 8
    assert cv.kept_per_rank(64, 4, 0.5) == 32     # k = 2 of 4
    assert cv.kept_per_rank(64, 8, 0.25) == 48    # k = 2 of 8


def test_variant_arguments():
    assert cv.reduce_kwargs("bound", 0.5, 3) == dict(num_skip=0, min_size=0)
    assert cv.reduce_kwargs("random-c4", 0.5, 3)["chunks_per_rank"] == 4
    assert cv.reduce_kwargs("static", 0.5, 3)["randomize"] is False
    assert cv.reduce_kwargs("random+ef", 0.25, 3) == dict(
        skip_ratio=0.25, min_size=0, seed=3, error_feedback=True)
    with pytest.raises(ValueError, match="no selective rule"):
        cv.reduce_kwargs("random-sel", 0.5, 0)
    with pytest.raises(ValueError, match="unknown variant 'random-c0'"):
        cv.reduce_kwargs("random-c0", 0.5, 0)
    with pytest.raises(SystemExit):
        cv.parse_args(["--variants", "fast"])


def test_sixteen_bit_wire_variants(tmp_path):
    assert cv.reduce_kwargs("random-bf16", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, comm_dtype=jnp.bfloat16)
    assert cv.reduce_kwargs("psum-bf16", 0.5, 3) == dict(num_skip=0, min_size=0)
    report = cv.main(["--steps", "5", "--eval-every", "5", "--variants",
                      "random-bf16,psum-bf16", "--out", str(tmp_path), "--tag", "bf16",
                      "--no-plot"])
    runs = {r["variant"]: r for r in report["runs"]}
    for name in ("random-bf16", "psum-bf16"):
        loss = runs[name]["history"]["val_loss"]
        assert loss[1] < loss[0]
        assert runs[name]["history"]["val_loss"] != runs["all-reduce"]["history"]["val_loss"]
    assert runs["random-bf16"]["reduce_kwargs"]["comm_dtype"] == "bfloat16"
    assert runs["random-bf16"]["comm"]["ratio"] == pytest.approx(10 / 28, rel=0.02)
    assert runs["psum-bf16"]["comm"]["ratio"] == 0.5


def test_warm_up_and_frozen_variance_variants():
    assert cv.reduce_kwargs("random-w30", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, warmup_steps=30)
    assert cv.reduce_kwargs("random-w30-fv", 0.5, 3)["warmup_steps"] == 30
    assert cv.reduce_kwargs("all-reduce-fv30", 0.5, 3) == dict(num_skip=0, min_size=0)
    assert [cv.freeze_steps(v) for v in ("random-w30", "random-w30-fv",
                                         "all-reduce-fv20", "random")] == [None, 30, 20, None]
    with pytest.raises(ValueError, match="unknown variant 'random-w0'"):
        cv.check_variant("random-w0")


def test_frozen_adam_is_adamw_until_it_freezes():
    params = {"w": np.ones(5, np.float32)}
    grads = [{"w": np.sin(np.arange(5, dtype=np.float32) * (t + 1))} for t in range(6)]

    def updates(tx):
        state, out = tx.init(params), []
        for g in grads:
            u, state = tx.update(g, state, params)
            out.append(np.asarray(u["w"]))
        return out

    plain = updates(cv.make_optimizer("adamw", 0.1, optax.identity()))
    frozen = updates(cv.make_optimizer("adamw", 0.1, optax.identity(), freeze_after=3))
    for t in range(3):
        np.testing.assert_allclose(frozen[t], plain[t], rtol=1e-6)
    assert not np.allclose(frozen[5], plain[5])


def test_non_iid_ranks_see_two_copies_of_every_class():
    labels = np.arange(160) % 16
    pools = cv.rank_pools(labels, 8, True, 16)
    seen = [set(labels[p].tolist()) for p in pools]
    assert seen[0] == {0, 1, 2, 3} and seen[7] == {14, 15, 0, 1}
    assert all(sum(c in s for s in seen) == 2 for c in range(16))


@pytest.mark.slow
def test_batchnorm_step_equals_the_single_device_step():
    # The hand-written step with BatchNorm over the data axis and a full
    # all-reduce takes the same step as one device on the whole batch.
    mesh = jax.make_mesh((8,), ("data",))
    work = cv.digits_cnn_workload(0, steps=1, ranks=8, batch=4)
    tx = cv.make_optimizer("sgd", 0.1, sr.skip_reduce("data", num_skip=0, min_size=0))
    params = sr.replicate(work.params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = cv.make_chunk_step(work.loss, tx, mesh, opt_state)
    batch = jax.device_put(work.train, NamedSharding(mesh, P(None, "data")))
    new_params, _, new_state, _ = step(params, opt_state,
                                       sr.replicate(work.model_state, mesh), batch)

    single = cv.BNCNN(axis_name=None)
    x, y = work.train[0][0], work.train[1][0]

    def loss(p):
        logits, state = single.apply({**p, **work.model_state}, x, train=True,
                                     mutable=["batch_stats"])
        return cv.softmax_metrics(logits, y)[0], state

    grads, state = jax.grad(loss, has_aux=True)(work.params)
    ref_tx = optax.sgd(0.1, momentum=0.9)
    updates, _ = ref_tx.update(grads, ref_tx.init(work.params), work.params)
    expected = optax.apply_updates(work.params, updates)
    for got, want in zip(jax.tree.leaves((new_params, new_state)),
                         jax.tree.leaves((expected, state)), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-6)


def test_tiny_end_to_end(tmp_path):
    report = cv.main(["--steps", "5", "--eval-every", "5", "--variants", "bound,random+ef",
                      "--out", str(tmp_path), "--tag", "tiny", "--no-plot"])
    # The all-reduce is added: it sets the target.
    assert [r["variant"] for r in report["runs"]] == ["all-reduce", "bound", "random+ef"]
    for r in report["runs"]:
        assert r["history"]["step"] == [0, 5]
        assert r["history"]["val_loss"][1] < r["history"]["val_loss"][0]
    assert [r["batch_per_rank"] for r in report["runs"]] == [64, 32, 64]
    assert [r["comm"]["num_skip"] for r in report["runs"]] == [0, 0, 4]
    saved = json.loads((tmp_path / "tiny.json").read_text())
    assert [r["variant"] for r in saved["summary"]] == ["all-reduce", "bound", "random+ef"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::skipreduce_jax.BatchNormWarning")  # the drift shown
def test_tiny_batchnorm_run_records_norms_and_recalibrated_metrics(tmp_path):
    report = cv.main(["--workloads", "cnn-bn", "--steps", "5", "--eval-every", "5",
                      "--variants", "random-noradial,random", "--out", str(tmp_path),
                      "--no-plot"])
    base, skip, remedied = (r["history"] for r in report["runs"])
    assert {"recal_val_acc", "Conv_0/kernel", "Conv_1/bias"} <= set(skip)
    # BatchNorm makes the conv biases' summed gradient zero: the all-reduce
    # leaves them at their initial zeros (to rounding), skipping moves them,
    # and the default (exact_radial, on with a BatchNorm) does not.
    assert max(base["Conv_0/bias"]) < 1e-6
    assert skip["Conv_0/bias"][-1] > 1e-3
    assert max(remedied["Conv_0/bias"]) < 1e-6
