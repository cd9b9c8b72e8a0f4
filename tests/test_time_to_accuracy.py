"""The time-to-accuracy benchmark's bookkeeping (smoothing, target, speedup)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skipreduce_jax as sr

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks import time_to_accuracy as tta  # noqa: E402


def _result(times, accs, nbytes=100.0):
    losses = [1.0 - a for a in accs]
    steps = [10 * i for i in range(len(times))]
    return dict(history=dict(time=times, step=steps, acc=accs, loss=losses),
                formula_bytes=nbytes)


def test_smoothed_is_a_trailing_mean():
    assert tta.smoothed([0.0, 0.3, 0.6, 0.9], 3) == pytest.approx(
        [0.0, 0.15, 0.3, 0.6])
    assert tta.smoothed([0.5, 0.7], 1) == [0.5, 0.7]


def test_target_and_speedup_use_smoothed_curves():
    t = [0.0, 2.0, 4.0, 6.0, 8.0]
    results = {
        # A lucky last evaluation (0.99) does not set the target.
        "all-reduce": _result(t, [0.1, 0.90, 0.93, 0.93, 0.99]),
        "random": _result(t, [0.1, 0.95, 0.97, 0.97, 0.96], nbytes=60.0),
        "slow": _result(t, [0.1, 0.5, 0.6, 0.7, 0.8], nbytes=1.0),
    }
    target = tta.summarize(results, tolerance=0.0, window=3)
    assert target == pytest.approx((0.93 + 0.93 + 0.99) / 3)
    # A window's mean stands at its mean time: the all-reduce's last one
    # (0.95) at 6 s, and it reaches its own final value there.
    assert results["all-reduce"]["time_to_target"] == pytest.approx(6.0)
    # random's smoothed curve 0.525, 0.673, 0.963 at 1, 2, 4 s crosses 0.95
    # at 2 + 2 * (0.95 - 0.6733) / (0.9633 - 0.6733) s, step 5x that.
    crossing = 2.0 + 2.0 * (0.95 - 2.02 / 3) / (2.89 / 3 - 2.02 / 3)
    assert results["random"]["time_to_target"] == pytest.approx(crossing)
    assert results["random"]["steps_to_target"] == pytest.approx(5 * crossing)
    assert results["random"]["speedup"] == pytest.approx(6.0 / crossing)
    assert results["random"]["bytes_ratio"] == pytest.approx(0.6)
    assert results["slow"]["time_to_target"] is None
    assert results["slow"]["speedup"] is None
    assert results["slow"]["steps_to_loss"] is None
    # The loss target (here 1 - accuracy) is reached at the same places.
    assert results["random"]["time_to_loss"] == pytest.approx(crossing)
    # Raw curves (window 1): the baseline's last value is the target.
    tta.summarize(results, tolerance=0.0, window=1)
    assert results["random"]["time_to_target"] is None


def test_steps_to_target_do_not_depend_on_the_step_rate():
    # Two variants learn the same curve per step; one steps 1.5x faster.
    # Evaluated every 2 s, the faster one is seen at other steps, but both
    # reach the target at the same step, and the speedup is the rate ratio.
    def history(steps_per_second):
        times = [2.0 * i for i in range(40)]
        steps = [steps_per_second * t for t in times]
        accs = [1.0 - np.exp(-s / 60.0) for s in steps]
        return dict(history=dict(time=times, step=steps, acc=accs,
                                 loss=[1.0 - a for a in accs]),
                    formula_bytes=1.0)

    results = {"all-reduce": history(2.0), "fast": history(3.0)}
    tta.summarize(results, tolerance=0.0, window=3)
    base, fast = results["all-reduce"], results["fast"]
    assert fast["steps_to_loss"] == pytest.approx(base["steps_to_loss"], rel=0.01)
    assert fast["speedup_loss"] == pytest.approx(1.5, rel=0.01)


def test_optimizer_choice_and_default_learning_rates():
    assert tta.parse_args(["--optimizer", "adam"]).lr == tta.DEFAULT_LR["adam"]
    args = tta.parse_args([])
    assert (args.optimizer, args.lr) == ("sgd", tta.DEFAULT_LR["sgd"])
    assert tta.parse_args(["--optimizer", "sgd", "--lr", "0.5"]).lr == 0.5
    # SGD with momentum: the second update of a constant gradient g is
    # -lr * (1 + 0.9) * g; Adam's would be -lr (sign-like).
    opt = tta.make_optimizer(args)
    g = jnp.full((3,), 2.0)
    state = opt.init(g)
    _, state = opt.update(g, state)
    second, _ = opt.update(g, state)
    assert second == pytest.approx([-0.02 * 1.9 * 2.0] * 3)
    for bad in (["--lr", "0"], ["--shift", "-1"], ["--parts", "-2"]):
        with pytest.raises(SystemExit):
            tta.parse_args(bad)


@pytest.mark.parametrize("bad, message", [
    (["--smooth", "0"], "--smooth must be >= 1"),
    (["--rank", "0"], "--rank must be >= 1"),
    (["--skip-ratio", "7"], "--skip-ratio must be in [0, 1]"),
    (["--density", "5"], "--density must be in (0, 1]"),
    (["--powersgd-warmup", "-1"], "--powersgd-warmup must be >= 0"),
])
def test_bad_arguments_fail_before_any_training(bad, message, capsys):
    # Otherwise they fail (or give NaN targets) only after the all-reduce
    # has trained for its whole time budget.
    with pytest.raises(SystemExit):
        tta.parse_args(bad)
    assert message in capsys.readouterr().err


def test_resummarize_reads_a_json_without_newer_settings(tmp_path, capsys):
    history = {"time": [1.0, 2.0, 3.0], "step": [10, 20, 30],
               "acc": [0.5, 0.6, 0.7], "loss": [1.0, 0.8, 0.6]}
    results = {name: {"name": name, "history": history, "steps": 30,
                      "step_ms": 100.0, "final_acc": 0.7, "best_acc": 0.7,
                      "final_loss": 0.6, "formula_bytes": 8.0, "hlo_bytes": 8.0}
               for name in ("all-reduce", "random")}
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(
        {"config": {"tolerance": 0.0}, "results": results}))
    assert tta.main(["--resummarize", str(path), "--smooth", "2"]) == 0
    out = capsys.readouterr().out
    assert "records no smooth; taken from the command line" in out
    assert "window 2" in out


def test_shifted_moves_each_pixel_by_each_offset():
    image = np.zeros((1, 64), np.float32)
    image[0, 3 * 8 + 4] = 1.0                     # pixel (3, 4)
    out = tta.shifted(image, 1)
    assert out.shape == (9, 64)
    offsets = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    for copy, (dy, dx) in zip(out, offsets):
        assert np.flatnonzero(copy).tolist() == [(3 + dy) * 8 + 4 + dx]
    np.testing.assert_array_equal(tta.shifted(image, 0), image)
    # Zero-filled at the border: a corner pixel leaves the image.
    corner = np.zeros((1, 64), np.float32)
    corner[0, 0] = 1.0
    assert tta.shifted(corner, 1).sum() == 4.0   # kept by 4 of the 9 shifts


def test_shifted_data_keeps_the_split_and_the_labels():
    plain, grown = tta.load_data(0), tta.load_data(0, shift=1)
    n_test = len(plain.y_test)
    assert grown.x_test.shape == (9 * n_test, 64)
    assert grown.x_train.shape == (9 * len(plain.y_train), 64)
    # Copy 4 is the unshifted one: the same split, no image crosses over.
    np.testing.assert_array_equal(grown.x_test[4 * n_test:5 * n_test],
                                  plain.x_test)
    np.testing.assert_array_equal(grown.y_test, np.tile(plain.y_test, 9))


@pytest.mark.slow
def test_parts_times_the_step_and_the_reduction_alone():
    args = tta.parse_args(["--hidden", "16", "--layers", "1", "--shift", "0",
                           "--variants", "all-reduce,random,powersgd"])
    trainer = tta.Trainer(args, tta.data_mesh())
    variants = tta.make_variants(args)
    parts = tta.time_parts(trainer, [variants[v] for v in args.variants],
                           rounds=1, calls=1)
    assert list(parts) == ["all-reduce", "random", "powersgd"]
    for p in parts.values():
        assert p["step_ms"] > 0 and p["reduction_ms"] > 0
        assert p["rest_ms"] == pytest.approx(p["step_ms"] - p["reduction_ms"])
    table = tta.parts_table(parts)
    assert table.splitlines()[1].split()[2] == "1.000"   # all-reduce / itself


def test_reduction_only_averages_the_per_rank_gradients():
    args = tta.parse_args(["--hidden", "8", "--layers", "1", "--shift", "0"])
    trainer = tta.Trainer(args, tta.data_mesh())
    tx = tta.make_variants(args)["all-reduce"].make()
    params = sr.replicate(trainer.params0, trainer.mesh)
    state = sr.init_opt_state(tx, params, trainer.mesh, tta.AXIS)
    updates, _ = tta.reduction_only(tx, trainer.mesh)(params, state)
    n = trainer.n                     # rank r sends (r + 1) * params
    for u, p in zip(jax.tree_util.tree_leaves(updates),
                    jax.tree_util.tree_leaves(trainer.params0)):
        np.testing.assert_allclose(np.asarray(u), (n + 1) / 2 * p, rtol=1e-6)


def test_static_runs_only_when_asked_and_drops_the_same_ranks_every_step():
    assert "static" not in tta.parse_args([]).variants
    args = tta.parse_args(["--hidden", "8", "--layers", "1", "--shift", "0",
                           "--variants", "static,random"])
    assert args.variants == ["random", "static"]
    trainer = tta.Trainer(args, tta.data_mesh())
    variants = tta.make_variants(args)
    assert (variants["static"].formula_bytes(trainer.params0, trainer.n)
            == variants["random"].formula_bytes(trainer.params0, trainer.n))
    params = sr.replicate(trainer.params0, trainer.mesh)

    def two_steps(name):
        tx = variants[name].make()
        state = sr.init_opt_state(tx, params, trainer.mesh, tta.AXIS)
        reduce = tta.reduction_only(tx, trainer.mesh)
        first, state = reduce(params, state)
        second, _ = reduce(params, state)
        return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves((first, second))]

    leaves = len(jax.tree_util.tree_leaves(trainer.params0))
    static, random = two_steps("static"), two_steps("random")
    for a, b in zip(static[:leaves], static[leaves:]):
        np.testing.assert_array_equal(a, b)      # the same ranks every step
    assert any(not np.array_equal(a, b)
               for a, b in zip(random[:leaves], random[leaves:]))


def test_lm_defaults_and_argument_checks(capsys):
    args = tta.parse_args(["--workload", "lm"])
    assert (args.optimizer, args.lr, args.batch_per_rank) == (
        "adamw", tta.LM_LR["adamw"], 4)
    assert args.variants == ["all-reduce", "skip_adamw", "random", "topk", "powersgd"]
    # The mlp's defaults are unchanged: no skip_adamw, SGD, 16 per rank.
    mlp = tta.parse_args([])
    assert mlp.variants == list(tta.DEFAULT_VARIANTS)
    assert "skip_adamw" not in mlp.variants and mlp.batch_per_rank == 16
    sgd = tta.parse_args(["--workload", "lm", "--optimizer", "sgd",
                          "--variants", "all-reduce,random"])
    assert sgd.lr == tta.LM_LR["sgd"]
    for bad, message in [
        (["--variants", "skip_adamw,all-reduce"], "pass --optimizer adamw"),
        (["--workload", "lm", "--optimizer", "sgd"], "pass --optimizer adamw"),
        (["--d-model", "30"], "--d-model 30 must be a multiple of --heads 4"),
        (["--seq-len", "0"], "--seq-len must be >= 1"),
        (["--workload", "gpt"], "invalid choice: 'gpt'"),
    ]:
        with pytest.raises(SystemExit):
            tta.parse_args(bad)
        assert message in capsys.readouterr().err


def test_lm_size_and_skip_adamw_keep_the_embeddings_whole():
    train_lm = tta.import_train_lm()
    assert tta.WORKLOADS["lm"].selective == train_lm.EMBED_PATTERN

    def shapes(d_model):
        model = train_lm.ByteTransformer(d_model, 2, 4, 64)
        return jax.eval_shape(model.init, jax.random.key(0),
                              jnp.zeros((1, 64), jnp.int32))

    default = shapes(256)              # the sizes the module docstring states
    assert sum(x.size for x in jax.tree_util.tree_leaves(default)) == 1_661_952
    args = tta.parse_args(["--workload", "lm"])
    variants = tta.make_variants(args)
    ratio = (variants["skip_adamw"].formula_bytes(default, 4)
             / variants["all-reduce"].formula_bytes(default, 4))
    assert ratio == pytest.approx(0.683, abs=5e-4)  # the embeddings whole
    # Without the selective rule the embeddings would skip too.
    wide = shapes(512)
    ruleless = sr.comm_stats(wide, 4, skip_ratio=0.5,
                             **tta.SKIP_ADAMW_DEFAULTS).bytes_per_device
    assert variants["skip_adamw"].formula_bytes(wide, 4) > ruleless


def test_training_transform_of_skip_adamw_is_skip_adamw():
    args = tta.parse_args(["--workload", "lm", "--variants", "all-reduce,skip_adamw"])
    variants = tta.make_variants(args)
    params = {"w": jnp.ones((4,))}
    tx = tta.training_transform(variants["skip_adamw"], args)
    # skip_adamw's state: its SkipReduceState first, then AdamW's.
    reference = sr.skip_adamw(args.lr, axis_name=tta.AXIS, skip_ratio=0.5)
    assert (jax.tree_util.tree_structure(tx.init(params))
            == jax.tree_util.tree_structure(reference.init(params)))
    other = tta.training_transform(variants["all-reduce"], args)
    assert len(other.init(params)) == 2       # the reduction, then optax.adamw


@pytest.mark.slow
def test_tiny_lm_run_writes_every_variant(tmp_path):
    argv = ["--workload", "lm", "--d-model", "16", "--heads", "2", "--layers", "1",
            "--seq-len", "8", "--batch-per-rank", "2", "--lr", "0.01",
            "--time-budget", "30", "--max-steps", "3", "--eval-every", "30",
            "--out", str(tmp_path), "--name", "lm"]
    assert tta.main(argv) == 0
    saved = __import__("json").loads((tmp_path / "lm.json").read_text())
    results = saved["results"]
    assert list(results) == list(tta.LM_VARIANTS)
    assert saved["config"]["workload"] == "lm"
    assert saved["config"]["optimizer"] == "adamw"
    assert saved["config"]["target"] == pytest.approx(
        results["all-reduce"]["final_loss_smoothed"])
    for r in results.values():
        assert r["steps"] == 3
        assert np.isfinite(r["final_loss"]) and 0 <= r["final_acc"] <= 1
        assert r["hlo_bytes"] > 0
    history = results["all-reduce"]["history"]
    assert history["loss"][-1] < history["loss"][0]
    # skip_adamw skips every leaf but the embeddings (min_size=0), Random
    # every leaf: in the formula and in the compiled program alike.
    base, adamw, rand = (results[v] for v in ("all-reduce", "skip_adamw", "random"))
    assert adamw["hlo_bytes"] == pytest.approx(adamw["formula_bytes"])
    assert rand["hlo_bytes"] < adamw["hlo_bytes"] < base["hlo_bytes"]
    assert (tmp_path / "lm.png").exists()


def test_16bit_wires_run_only_when_asked_and_count_what_crosses():
    assert not {"random-bf16", "psum-bf16"} & set(tta.parse_args([]).variants)
    args = tta.parse_args(["--hidden", "8", "--layers", "1", "--shift", "0",
                           "--variants", "psum-bf16,random-bf16,random,all-reduce"])
    assert args.variants == ["all-reduce", "random", "random-bf16", "psum-bf16"]
    trainer = tta.Trainer(args, tta.data_mesh())
    variants = tta.make_variants(args)
    nbytes = {name: variants[name].formula_bytes(trainer.params0, trainer.n)
              for name in args.variants}
    assert nbytes["random-bf16"] < 0.51 * nbytes["random"]
    # XLA:CPU widens lax.psum of bfloat16 to float32: no bytes saved there.
    cpu = jax.devices()[0].platform == "cpu"
    assert nbytes["psum-bf16"] == (1 if cpu else 0.5) * nbytes["all-reduce"]
    for name in ("random-bf16", "psum-bf16"):  # the compiled step agrees
        tx = tta.training_transform(variants[name], args, steady=True)
        sent = trainer.hlo_bytes(trainer.compiled_step(tx))
        # On CPU an odd-length piece crosses with one 16-bit zero of padding
        # (docs/costs.md): 20 bytes over the formula's 1540 here.
        padding = 0.02 * nbytes[name] if cpu and name == "random-bf16" else 0
        assert nbytes[name] <= sent <= nbytes[name] + padding, (name, sent)
    params = sr.replicate(trainer.params0, trainer.mesh)

    def reduced(name):
        tx = variants[name].make()
        state = sr.init_opt_state(tx, params, trainer.mesh, tta.AXIS)
        updates, _ = tta.reduction_only(tx, trainer.mesh)(params, state)
        return [np.asarray(u) for u in jax.tree_util.tree_leaves(updates)]

    n = trainer.n                     # rank r sends (r + 1) * params
    cast = reduced("psum-bf16")
    for u, p in zip(cast, jax.tree_util.tree_leaves(trainer.params0)):
        np.testing.assert_allclose(u, (n + 1) / 2 * np.asarray(p), rtol=2e-2, atol=1e-6)
    assert any(not np.array_equal(a, b) for a, b in zip(cast, reduced("all-reduce")))
    narrow, wide = reduced("random-bf16"), reduced("random")
    for a, b in zip(narrow, wide):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-6)
    assert any(not np.array_equal(a, b) for a, b in zip(narrow, wide))
