"""examples/pjit_lm.py: a production-style pjit loop, plain and with SkipReduce.

With k = 0 the SkipReduce step equals the plain ``jax.jit`` step (XLA's own
reductions) over 20 micro-steps on both meshes; with Random SkipReduce the
model trains and every replica stays bit-identical; the two steps differ in
at most five lines, counted from the file.
"""

import ast
import difflib
import inspect
import pathlib
import sys
import textwrap

import jax
import numpy as np
import pytest
from test_sharded_training import _by_axis

import skipreduce_jax as sr

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("flax.linen")
pjit_lm = pytest.importorskip("pjit_lm")


def _config(**changes):
    return pjit_lm.Config(**{"steps": 20, "accum": 2, "batch_per_device": 1, "seq_len": 16,
                             "d_model": 16, "layers": 1, "heads": 2, "min_size": 0,
                             **changes})


def _data():
    return np.frombuffer((ROOT / "examples" / "pjit_lm.py").read_bytes(), np.uint8)


def _run(variant, config):
    """``config.steps`` micro-steps: the initial params, final state and metrics."""
    mesh = pjit_lm.make_mesh(config)
    state, shardings = pjit_lm.init_state(config, mesh)
    params = jax.device_get(state.params)
    step = pjit_lm.compile_step(variant, config, mesh, shardings)
    history = []
    for batch in pjit_lm.padded_batches(_data(), config, mesh.size * config.batch_per_device):
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    assert len(history) == config.steps
    return mesh, params, state, history


@pytest.mark.slow  # 20 steps of the example's LM, twice
@pytest.mark.parametrize("layout", ["hsdp", "dp"])
def test_k0_step_equals_the_plain_jit_step_over_20_steps(layout):
    config = _config(mesh=layout, skip_ratio=0.0)
    _, _, plain, plain_metrics = _run("plain", config)
    _, _, adopted, adopted_metrics = _run("skipreduce", config)
    for a, b in zip(adopted_metrics, plain_metrics, strict=True):
        assert a["gradient_step"] == b["gradient_step"]
        for name in ("loss", "accuracy", "acc_grads_norm"):
            np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert plain_metrics[-1]["gradient_step"] == config.steps // config.accum
    for x, y in zip(jax.tree_util.tree_leaves(adopted.params),
                    jax.tree_util.tree_leaves(plain.params), strict=True):
        assert x.sharding == y.sharding
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)
    assert int(adopted.step) == int(plain.step) == config.steps


@pytest.mark.slow
def test_random_skipping_trains_and_keeps_replicas_identical():
    config = _config(steps=30, skip_ratio=0.5, lr=1e-2)
    mesh, params, state, history = _run("skipreduce", config)
    losses = [float(m["loss"]) for m in history]
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.5, losses
    # Params over fsdp: each replica's shards compared with the others'.
    assert any("fsdp" in str(x.sharding.spec) for x in jax.tree_util.tree_leaves(state.params))
    sr.assert_replicated(state.params, mesh, "replica")
    sr.assert_replicated(state.opt_state, mesh, "replica")
    assert not all(np.array_equal(x, y) for x, y in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(state.params), strict=True))


@pytest.mark.slow
def test_bytes_over_replica_are_the_formula_and_nothing_extra_crosses_fsdp():
    config = _config(skip_ratio=0.5)
    mesh = pjit_lm.make_mesh(config)
    state, shardings = pjit_lm.init_state(config, mesh)
    batch = next(pjit_lm.padded_batches(_data(), config, mesh.size * config.batch_per_device))
    replica, other = {}, {}
    for variant in pjit_lm.VARIANTS:
        # check=False: the step-0 check's branch is in the program, run once.
        step = pjit_lm.compile_step(variant, config, mesh, shardings, check=False)
        text = step.lower(state, batch).compile().as_text()
        replica[variant], other[variant] = _by_axis(text, mesh)
    n = mesh.shape["replica"]
    shards = jax.tree_util.tree_map(   # the ring reduces each device's fsdp shards
        lambda p, s: jax.ShapeDtypeStruct(s.shard_shape(p.shape), p.dtype),
        state.params, shardings.params)
    stats = sr.comm_stats(shards, n, **config.skip_options)
    assert stats.num_skip == 2 and stats.ratio < 0.7
    value_bytes = 3 * 2 * (n - 1) / n * 4   # psums of the loss, accuracy and token count
    assert replica["skipreduce"] == pytest.approx(stats.bytes_per_device + value_bytes)
    # Over fsdp: the model's own gathers and reductions, no more than XLA's step.
    assert other["skipreduce"] <= other["plain"]


def _body(function):
    """A function's source without its ``def`` line and docstring."""
    source = textwrap.dedent(inspect.getsource(function))
    node = ast.parse(source).body[0]
    return source.splitlines()[node.body[1].lineno - 1:node.end_lineno]


def test_the_skipreduce_step_differs_in_at_most_three_lines():
    plain, adopted = _body(pjit_lm.plain_step), _body(pjit_lm.skipreduce_step)
    changed = [line for line in difflib.unified_diff(plain, adopted, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    # The file imports skipreduce_jax for both steps; an adopter adds that line.
    assert "import skipreduce_jax as sr" in inspect.getsource(pjit_lm)
    assert len(changed) + 1 <= 3, changed
    assert any("sr.value_and_grad(" in line for line in changed), changed
    # The mesh layout is the mesh's, not the step's: the same step serves both.
    assert "hsdp" not in "\n".join(plain + adopted)
    assert "mean_count" not in "\n".join(adopted) and "dropout" in "\n".join(adopted)


def test_readme_shows_the_diff_as_it_is():
    plain, adopted = _body(pjit_lm.plain_step), _body(pjit_lm.skipreduce_step)
    diff = [line for line in difflib.unified_diff(plain, adopted, lineterm="", n=1)
            if not line.startswith(("---", "+++", "@@"))]
    block = "```diff\n" + "\n".join(diff) + "\n```"
    assert block in (ROOT / "README.md").read_text(), (
        "README.md's diff of examples/pjit_lm.py is out of date; it should read:\n" + block)


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "tp"], "--mesh: choose from hsdp,dp"),
    (["--d-model", "33", "--heads", "3"], "must be a multiple of --heads 3 and of the fsdp"),
    (["--accum", "0"], "every size and count must be >= 1"),
], ids=["mesh", "fsdp-width", "accum"])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pjit_lm.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
