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
    assert cv.reduce_kwargs("random-units", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, layout="units")
    assert cv.reduce_kwargs("random-units-c1-iid", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, layout="units", chunks_per_rank=1,
        balanced=False)
    assert cv.label("random-units-c1") == "Random, layout='units', chunks_per_rank=1"
    assert cv.reduce_kwargs("random-c1-iid", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, chunks_per_rank=1, balanced=False)
    assert cv.reduce_kwargs("random-iid", 0.5, 3)["balanced"] is False
    assert cv.label("random-iid") == "Random, balanced=False (the paper's)"
    assert cv.label("random-c4") == "Random, chunks_per_rank=4"
    with pytest.raises(ValueError, match="unknown variant 'random-units-c0'"):
        cv.reduce_kwargs("random-units-c0", 0.5, 0)
    assert cv.reduce_kwargs("static", 0.5, 3)["randomize"] is False
    assert cv.reduce_kwargs("random+ef", 0.25, 3) == dict(
        skip_ratio=0.25, min_size=0, seed=3, error_feedback=True)
    assert cv.reduce_kwargs("random+efauto", 0.5, 3)["error_feedback"] == "auto"
    with pytest.raises(ValueError, match="no selective rule"):
        cv.reduce_kwargs("random-sel", 0.5, 0)
    with pytest.raises(ValueError, match="unknown variant 'random-c0'"):
        cv.reduce_kwargs("random-c0", 0.5, 0)
    with pytest.raises(SystemExit):
        cv.parse_args(["--variants", "fast"])


@pytest.mark.slow
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


@pytest.mark.slow  # fast-suite time; CI runs it in test-slow
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
def test_tiny_auto_run_records_what_its_rule_reads(tmp_path):
    report = cv.main(["--steps", "4", "--eval-every", "2", "--variants", "random+efauto",
                      "--out", str(tmp_path), "--tag", "tiny", "--no-plot"])
    auto = report["runs"][1]["history"]
    assert "gate_overshooting" not in report["runs"][0]["history"]  # the all-reduce
    for name in ("gate_overshooting", "gate_nonlinear"):
        assert len(auto[name]) == len(auto["step"]) == 3  # steps 0, 2, 4
        # Each starts at 1 and moves once its test has steps to read.
        assert auto[name][0] == 1 and 0 <= auto[name][-1] < 1


@pytest.mark.slow
def test_gate_cost_times_the_three_settings(tmp_path):
    from benchmarks import gate_cost
    out = tmp_path / "cost.json"
    [result] = gate_cost.main(["--workloads", "mlp", "--steps", "2", "--repeats", "1",
                               "--out", str(out)])
    assert set(result["step_ms"]) == set(gate_cost.VARIANTS)
    assert result["step_vs_random"]["random"] == 1
    assert all(v > 0 for v in result["compile_s"].values())
    assert json.loads(out.read_text())["results"][0]["workload"] == "mlp"


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


def test_named_mlp_workload():
    work = cv.named_mlp_workload(0, steps=3, ranks=8)
    xt, yt, xv, yv = cv.named_data(0)
    # The split: 10,000 training rows, standardized on themselves, 2,000 validation rows.
    assert xt.shape == (10_000, 64) and xv.shape == (2_000, 64)
    np.testing.assert_allclose(xt.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(xt.std(0), 1.0, atol=1e-4)
    assert set(np.unique(yt)) == set(range(16))
    from sklearn.datasets import make_classification
    raw, labels = make_classification(
        n_samples=12_000, n_features=64, n_informative=40, n_redundant=10, n_classes=16,
        n_clusters_per_class=2, class_sep=1.0, flip_y=0.02, random_state=0)
    np.testing.assert_array_equal(yv, labels[10_000:])
    scale = raw[:10_000].std(0)
    np.testing.assert_allclose(xv, (raw[10_000:] - raw[:10_000].mean(0)) / scale,
                               rtol=1e-5, atol=1e-5)
    # Batches: 3 steps of 8 ranks x 64 samples, every one a training row.
    assert work.train[0].shape == (3, 512, 64) and work.train[1].shape == (3, 512)
    np.testing.assert_array_equal(work.val[1], yv)
    rows = {r.tobytes() for r in xt}
    assert all(r.tobytes() in rows for r in work.train[0].reshape(-1, 64))
    assert work.batch_per_rank == 64 and work.lr == dict(sgd=0.05, adamw=1e-3)
    # He-normal kernels, zero biases, the last kernel scaled by 0.1.
    layers = work.params["params"]
    assert [layers[f"Dense_{i}"]["kernel"].shape for i in range(3)] == [
        (64, 512), (512, 512), (512, 16)]
    for i, fan_in, scale in ((0, 64, 1.0), (1, 512, 1.0), (2, 512, 0.1)):
        std = float(jnp.std(layers[f"Dense_{i}"]["kernel"]))
        assert std == pytest.approx(scale * math.sqrt(2 / fan_in), rel=0.1)
        assert not np.any(layers[f"Dense_{i}"]["bias"])
    # Near-uniform logits at the start: the whole training set's loss is log 16.
    mesh = jax.make_mesh((8,), ("data",))
    extra = work.diagnostics(sr.replicate(work.params, mesh), {}, mesh)
    assert float(extra["full_train_loss"]) == pytest.approx(math.log(16), abs=0.02)
    norm = math.sqrt(sum(float(jnp.sum(x**2)) for x in jax.tree.leaves(work.params)))
    assert extra["weight_norm"] == pytest.approx(norm, rel=1e-6)


def test_named_mlp_target_is_the_smoothed_loss_at_step_200():
    steps = list(range(0, 310, 10))
    base = [3.0 - 0.01 * s for s in steps]                   # 1.0 at step 200
    base[19], base[21] = 1.4, 0.7                            # steps 190, 210
    dip = [v + 0.2 for v in base]
    dip[15] = 0.8                                            # one low evaluation, at 150
    runs = [_run("all-reduce", 0, base, workload="mlp-named"),
            _run("random", 0, dip, workload="mlp-named"),
            _run("all-reduce", 0, base)]                     # mlp: read at 2/3 of the run
    rows = {(r["workload"], r["variant"]): r for r in cv.summarize(runs, 2 / 3)}
    named = rows["mlp-named", "all-reduce"]
    assert named["target_step"] == [200]
    assert named["targets"][0] == pytest.approx((1.2 + 1.4 + 1.0) / 3)
    assert named["steps"] == [200]
    # Smoothed, the single low evaluation does not reach the target.
    assert rows["mlp-named", "random"]["steps"] == [220]
    assert rows["mlp", "all-reduce"]["targets"] == [1.0]   # raw, step 200 of 300
    assert cv.smooth(_history([3.0, 2.0, 1.0, 0.0]), 3) == dict(
        step=[20, 30], val_loss=[2.0, 1.0])
    # The best is read on the smoothed curve: the low evaluation at 150
    # counts only within its window's mean.
    random = rows["mlp-named", "random"]
    curve = cv.smooth(dict(step=steps, val_loss=dip), 3)
    assert random["best_loss"] == [min(curve["val_loss"])]
    assert random["best_step"] == [curve["step"][int(np.argmin(curve["val_loss"]))]]
    assert cv.lowest(_history([3.0, 1.0, 2.0, 0.5, 0.5]), 1) == (30, 0.5)
    assert cv.lowest(_history([3.0, 1.0, 2.0, 0.5]), 2) == (30, 1.25)
    with pytest.raises(ValueError, match="read at step 200"):
        cv.target_at(_history([3.0, 2.0]), 200, 3)
    with pytest.raises(SystemExit):
        cv.parse_args(["--workloads", "mlp-named", "--steps", "150"])


def test_partial_error_feedback_keeps_a_fraction_of_the_residual():
    # random+efB: error feedback whose residual is scaled by B on the way
    # out, the update by N / (N - (1 - B) k), so that it stays unbiased.
    assert cv.reduce_kwargs("random+ef0.25", 0.5, 3) == dict(
        skip_ratio=0.5, min_size=0, seed=3, error_feedback=True)
    assert cv.label("random+ef0.25") == (
        "Random + error feedback of 0.25 of what was left out")
    for bad in ("random+ef0", "random+ef1.0", "random+ef0.50"):
        with pytest.raises(ValueError, match="unknown variant"):
            cv.check_variant(bad)
    mesh = jax.make_mesh((8,), ("data",))
    grads = jax.device_put({"w": np.random.default_rng(0).normal(size=(8, 24)).astype(
        np.float32)}, NamedSharding(mesh, P("data")))

    def first_step(tx):
        opt_state = sr.init_opt_state(tx, {"w": jnp.zeros(24)}, mesh, "data")
        specs = sr.state_specs(opt_state, "data")

        def local(g, state):
            return tx.update({"w": g["w"][0]}, state, {"w": jnp.zeros(24)})

        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), specs),
                                     out_specs=(P(), specs)))(grads, opt_state)

    def ef():
        return sr.skip_reduce("data", num_skip=4, min_size=0, error_feedback=True, seed=1)

    full_update, full_state = first_step(ef())
    update, state = first_step(cv.partial_feedback(ef(), 0.25, 8, 4))
    np.testing.assert_allclose(update["w"] * (8 - 0.75 * 4), full_update["w"] * 8,
                               rtol=1e-6)
    np.testing.assert_allclose(state.residual["w"], 0.25 * full_state.residual["w"],
                               rtol=1e-6)
    assert np.abs(np.asarray(full_state.residual["w"])).sum() > 0  # something left out


def test_gated_error_feedback_is_random_or_error_feedback_by_its_share():
    # random+efgT: error feedback while the share of overshooting steps is
    # below T. The share starts at 1: the first step is Random (residual
    # dropped, the sum over N - k); a threshold above 1 is error feedback.
    assert cv.reduce_kwargs("random+efg", 0.5, 3)["error_feedback"] is True
    assert cv.label("random+efg0.5").endswith("under 0.5 of the steps overshoot")
    with pytest.raises(ValueError, match="unknown variant"):
        cv.check_variant("random+efg1.5")
    mesh = jax.make_mesh((8,), ("data",))
    grads = jax.device_put({"w": np.random.default_rng(1).normal(size=(8, 24)).astype(
        np.float32)}, NamedSharding(mesh, P("data")))
    params = {"w": jnp.zeros(24)}

    def first_step(tx):
        opt_state = sr.init_opt_state(tx, params, mesh, "data")
        specs = sr.state_specs(opt_state, "data")
        return jax.jit(jax.shard_map(
            lambda g, s: tx.update({"w": g["w"][0]}, s, params), mesh=mesh,
            in_specs=(P("data"), specs), out_specs=(P(), specs)))(grads, opt_state)

    def reducer(error_feedback):
        return sr.skip_reduce("data", num_skip=4, min_size=0, seed=1,
                              error_feedback=error_feedback)

    random, _ = first_step(reducer(False))
    gated, state = first_step(cv.gated_feedback(reducer(True), 0.6, 8, 4))
    np.testing.assert_allclose(gated["w"], random["w"], rtol=1e-6)
    assert not np.asarray(state.inner.residual["w"]).any()
    full, full_state = first_step(reducer(True))
    always, state = first_step(cv.gated_feedback(reducer(True), 1.01, 8, 4))
    np.testing.assert_allclose(always["w"], full["w"], rtol=1e-6)
    np.testing.assert_allclose(state.inner.residual["w"], full_state.residual["w"])


@pytest.mark.slow  # fast-suite time; CI runs it in test-slow
def test_held_out_workloads():
    """digits-mlp: real images, an MLP; lm-wide: a second text task, its own split."""
    digits = cv.make_workload("digits-mlp", 0, steps=3, ranks=8)
    assert digits.train[0].shape == (3, 64, 64) and digits.train[1].shape == (3, 64)
    assert digits.val[0].shape[0] % 8 == 0 and set(np.unique(digits.val[1])) == set(range(10))
    train_rows = {r.tobytes() for r in digits.train[0].reshape(-1, 64)}
    assert not train_rows & {r.tobytes() for r in digits.val[0]}  # disjoint split
    assert [x.shape for x in jax.tree.leaves(digits.params)] == [
        (128,), (64, 128), (10,), (128, 10)]
    wide = cv.make_workload("lm-wide", 0, steps=3, ranks=8)
    assert wide.train[0].shape == (3, 32, 129) and wide.val[0].shape[1] == 129
    # Its validation text is the start of the lm workload's training text.
    import train_lm  # examples/, on the path once a workload is made
    lm_train = train_lm.load_corpus(2**19, 2**15).train
    assert wide.val[0][0].astype(np.uint8).tobytes() in lm_train[:2**16].tobytes()
    deep = cv.make_workload("mlp-deep", 0, steps=3, ranks=8)
    assert deep.train[0].shape == (3, 256, 64) and len(jax.tree.leaves(deep.params)) == 10
    assert set(cv.HELD_OUT) <= set(cv.WORKLOADS) and all(w in cv.TARGET_RULES for w in cv.HELD_OUT)


@pytest.mark.slow  # fast-suite time; CI runs it in test-slow
def test_gate_trace_records_each_step(tmp_path):
    from benchmarks import gate_trace
    out = tmp_path / "trace.json"
    rows = gate_trace.main(["--workload", "mlp", "--steps", "3", "--out", str(out)])
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert not any(r["fed"] or r["tripped"] for r in rows)  # shut for about 45 steps
    assert all(r["residual_norm"] == 0 for r in rows)
    assert json.loads(out.read_text()) == rows
