"""The adoption examples: flax NNX and linen steps, plain and with SkipReduce.

For each example: with k = 0 the SkipReduce step equals the plain
data-parallel step (XLA's own reductions); with Random SkipReduce every
replica stays bit-identical; docs/guides/nnx.md and linen.md show the lines that differ.
"""

import difflib
import inspect
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

nnx = pytest.importorskip("flax.nnx")
nnx_cnn_digits = pytest.importorskip("nnx_cnn_digits")
linen_lm = pytest.importorskip("linen_lm")

N = 8
STEPS = 3


def _assert_trees_close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


def _trees_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(
        jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))


# ----------------------------------------------------------------------------
# NNX: a CNN with BatchNorm and Dropout.
# ----------------------------------------------------------------------------


def _nnx_run(variant, config, mesh, data, **kwargs):
    """``STEPS`` steps; the model, optimizer, losses and final train metrics."""
    with jax.set_mesh(mesh):
        if variant == "plain":
            model, optimizer, step = nnx_cnn_digits.plain_setup(mesh, config)
        else:
            model, optimizer, step = nnx_cnn_digits.skipreduce_setup(mesh, config, **kwargs)
        metrics = nnx_cnn_digits.make_metrics()
        losses, residuals = [], []
        split = NamedSharding(mesh, P("data"))   # the global batch, as in the example
        for rows in nnx_cnn_digits.batch_indices(data, STEPS, config.batch_per_rank, 0):
            x, y = jax.device_put((data.x_train[rows], data.y_train[rows]), split)
            losses.append(float(step(model, optimizer, metrics, x, y)))
            if kwargs.get("error_feedback"):
                residuals.append(jax.device_get(optimizer.opt_state[0].residual))
        computed = {k: float(v) for k, v in metrics.compute().items()}
    return model, optimizer, losses, computed, residuals


@pytest.fixture(scope="module")
def digits():
    return nnx_cnn_digits.make_data(False, N, 0)


def test_nnx_k0_step_equals_the_plain_nnx_jit_step(digits):
    # No dropout: nnx.jit draws one mask for the global batch, the per-rank
    # step one per rank. BatchNorm's statistics are global in both.
    config = nnx_cnn_digits.Config(width=4, batch_per_rank=4, dropout=0.0, skip_ratio=0.0)
    mesh = jax.make_mesh((N,), ("data",))
    plain = _nnx_run("plain", config, mesh, digits)
    adopted = _nnx_run("skipreduce", config, mesh, digits)
    np.testing.assert_allclose(adopted[2], plain[2], rtol=1e-5)
    for kind in (nnx.Param, nnx.BatchStat):
        _assert_trees_close(nnx.state(adopted[0], kind), nnx.state(plain[0], kind))
    # The metrics saw every rank's logits and labels, as nnx.jit's did.
    assert adopted[3] == pytest.approx(plain[3], rel=1e-5)
    assert int(adopted[1].step[...]) == int(plain[1].step[...]) == STEPS


def test_nnx_random_skipping_with_error_feedback_keeps_replicas_identical(digits):
    config = nnx_cnn_digits.Config(width=4, batch_per_rank=2)   # dropout 0.25, skip 0.5
    mesh = jax.make_mesh((N,), ("data",))
    model, optimizer, losses, _, residuals = _nnx_run(
        "skipreduce", config, mesh, digits, error_feedback=True)
    assert all(np.isfinite(losses))
    sr.assert_replicated(nnx.state(model), mesh)
    sr.assert_replicated(optimizer.opt_state[1], mesh)
    first, last = (r["linear1"]["kernel"][...] for r in (residuals[0], residuals[-1]))
    assert first.shape == (N, 128, 128)
    assert np.abs(first).max() > 0 and not np.array_equal(first[0], first[1])  # per rank
    assert not np.array_equal(first, last)                                     # it moves
    # BatchNorm and the convs are fully reduced: they keep no residual.
    for name in ("bn1", "bn2", "conv1", "conv2"):
        for leaf in jax.tree_util.tree_leaves(residuals[-1][name]):
            assert np.size(leaf) == 0, name


# ----------------------------------------------------------------------------
# linen: a byte-level LM with a TrainState.
# ----------------------------------------------------------------------------


def _lm_config(**changes):
    return linen_lm.Config(**{"batch_per_rank": 2, "seq_len": 16, "d_model": 16, "layers": 1,
                              "heads": 2, "min_size": 0, **changes})


def _lm_mesh():
    # As in the example: jax.jit's in_shardings on an Explicit mesh would
    # all-gather the embedding lookup.
    return jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def _lm_data():
    return np.frombuffer((ROOT / "examples" / "linen_lm.py").read_bytes(), np.uint8)


def _lm_run(variant, config, mesh):
    """``STEPS`` steps; the initial params, final state and each step's metrics."""
    model, params = linen_lm.init(config)
    state, step = linen_lm.setup(variant, mesh, config, model, params)
    key, history = jax.random.key(0), []
    for batch in linen_lm.padded_batches(_lm_data(), config, N * config.batch_per_rank):
        state, metrics = step(state, batch, key, linen_lm.LossConfig(0.1))
        history.append(jax.device_get(metrics))
        if len(history) == STEPS:
            return params, state, history
    raise AssertionError("too few batches")


def test_linen_k0_step_equals_the_plain_jit_step():
    config = _lm_config(dropout=0.0, skip_ratio=0.0)
    mesh = _lm_mesh()
    _, plain, plain_metrics = _lm_run("plain", config, mesh)
    _, adopted, adopted_metrics = _lm_run("skipreduce", config, mesh)
    # The attention's key bias gets a zero gradient (softmax ignores a shift
    # shared by all keys); Adam turns its float noise into steps of up to lr.
    qkv = ("block_0", "qkv", "bias")
    leaves = [jax.tree_util.tree_flatten_with_path(s.params)[0] for s in (adopted, plain)]
    for (path, a), (_, b) in zip(*leaves, strict=True):
        loose = tuple(k.key for k in path) == qkv
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=STEPS * config.lr if loose else 1e-5)
    _assert_trees_close(adopted_metrics, plain_metrics)
    assert int(adopted.step) == int(plain.step) == STEPS


def test_linen_loss_needs_the_global_token_count():
    # Ranks hold different numbers of real tokens. The ranks' mean gradient
    # is the global one with psum(count) / N, not with each rank's own count.
    config = _lm_config(dropout=0.0)
    mesh = _lm_mesh()
    model, params = linen_lm.init(config)
    batch = next(linen_lm.padded_batches(_lm_data(), config, N * config.batch_per_rank))
    key, loss_config = jax.random.key(0), linen_lm.LossConfig()

    def loss(params, count, batch):
        return linen_lm.loss_fn(params, model.apply, batch, key, count, loss_config)[0]

    def per_rank(params, batch):
        def mean_grad(count):
            grads = sr.local_value_and_grad(loss, "data")(params, count, batch)[1]
            return lax.pmean(grads, "data")
        count = jnp.sum(batch[1])
        return mean_grad(count), mean_grad(lax.psum(count, "data") / N)

    own, shared = sr.data_parallel(per_rank, mesh, batch_argnums=1)(params, batch)
    expected = jax.jit(jax.grad(loss))(params, jnp.sum(batch[1]), batch)
    flat = [np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(g)])
            for g in (own, shared, expected)]
    error = [np.linalg.norm(g - flat[2]) / np.linalg.norm(flat[2]) for g in flat[:2]]
    assert error[1] < 1e-4 and error[0] > 1e-2, error


@pytest.mark.slow
def test_linen_random_skipping_keeps_replicas_identical():
    config = _lm_config(dropout=0.1, min_size=1024)    # skip ratio 0.5: 3 leaves skipped
    mesh = _lm_mesh()
    params, state, history = _lm_run("skipreduce", config, mesh)
    assert all(np.isfinite(m["loss"]) for m in history)
    sr.assert_replicated(state.params, mesh)
    sr.assert_replicated(state.opt_state, mesh)
    assert not _trees_equal(state.params, params)


# ----------------------------------------------------------------------------
# docs/guides/nnx.md and docs/guides/linen.md show the diff of the two setups, as they are.
# ----------------------------------------------------------------------------


def _setup_diff(module):
    plain, adopted = (inspect.getsource(f).splitlines()
                      for f in (module.plain_setup, module.skipreduce_setup))
    lines = list(difflib.unified_diff(plain, adopted, lineterm="", n=len(plain) + len(adopted)))
    return lines[3:]   # without the ---, +++ and @@ headers


@pytest.mark.parametrize("module", [nnx_cnn_digits, linen_lm], ids=lambda m: m.__name__)
def test_the_docs_show_the_diff_and_about_ten_lines_differ(module):
    diff = _setup_diff(module)
    changed = [line for line in diff if line[:1] in "+-"]
    assert len([line for line in changed if line[0] == "+"]) <= 12, changed
    block = "```diff\n" + "\n".join(diff) + "\n```"
    page = ROOT / "docs" / "guides" / {"nnx_cnn_digits": "nnx.md", "linen_lm": "linen.md"}[
        module.__name__]
    assert block in page.read_text(), (
        f"{page.relative_to(ROOT)}'s diff of examples/" + module.__name__ + ".py is out of date; "
        "it should read:\n" + block)


@pytest.mark.parametrize("module, argv, message", [
    (nnx_cnn_digits, ["--steps", "0"], "--steps, --batch-per-rank, --width and --eval-every"),
    (nnx_cnn_digits, ["--variants", "plain,adam"], "--variants: choose from plain,skipreduce"),
    (linen_lm, ["--heads", "3"], "--d-model 64 must be a multiple of --heads 3"),
    (linen_lm, ["--lr", "-1"], "--lr must be >= 0"),
], ids=["nnx-steps", "nnx-variants", "linen-heads", "linen-lr"])
def test_bad_arguments_are_usage_errors(module, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
