"""examples/lm1b_lm.py: a step shaped like flax's lm1b example, plain and adopted.

At k = 0 the SkipReduce step equals lm1b's own step (the loss and every
metric, the token count included, with dropout on) on both of its layouts:
8 ranks on ``data``, and lm1b's default ``data=1, fsdp=8`` (FSDP: SkipReduce
over ``fsdp``, the params sharded over it). Accuracy counts
each position whose argmax is right, so equal counts need each row's logits,
dropout mask included, to be lm1b's. The two steps differ in one line.
"""

import difflib
import inspect
import sys

import numpy as np
import pytest
from test_pjit_lm import ROOT, _body

sys.path.insert(0, str(ROOT / "examples"))
pytest.importorskip("flax.linen")
lm1b_lm = pytest.importorskip("lm1b_lm")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data", "fsdp"])
def test_k0_step_equals_lm1bs_step_metrics_and_counts_included(layout):
    results = lm1b_lm.main(["--mesh", layout, "--steps", "3", "--skip-ratio", "0",
                            "--d-model", "32"])
    for plain, adopted in zip(results["plain"], results["skipreduce"], strict=True):
        assert plain["denominator"] == adopted["denominator"]
        assert plain["accuracy"] == adopted["accuracy"]
        np.testing.assert_allclose(adopted["loss"], plain["loss"], rtol=1e-5)


@pytest.mark.slow  # trains both variants: test-slow, in CI
@pytest.mark.parametrize("layout", ["data", "fsdp"])
def test_random_skipping_trains(layout):
    """On fsdp (lm1b's default) the params stay sharded: FSDP, its reduce-scatter skipped."""
    results = lm1b_lm.main(["--mesh", layout, "--steps", "6", "--d-model", "32"])
    losses = [h["loss"] / h["denominator"] for h in results["skipreduce"]]
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    plain = results["plain"][-1]["loss"] / results["plain"][-1]["denominator"]
    assert losses[-1] != pytest.approx(plain, rel=1e-6)  # it skipped


def test_the_skipreduce_step_differs_in_at_most_three_lines():
    plain, adopted = _body(lm1b_lm.plain_step), _body(lm1b_lm.skipreduce_step)
    changed = [line for line in difflib.unified_diff(plain, adopted, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    # The grad line, replaced; plus the import: three. No helper in the loss.
    assert "import skipreduce_jax as sr" in inspect.getsource(lm1b_lm)
    assert len(changed) + 1 <= 3, changed
    assert any("sr.value_and_grad(" in line for line in changed), changed
    joined = "\n".join(adopted)
    assert "def loss_fn(params):" in joined and "grad_fn(state.params)" in joined
    assert "mean_count" not in joined and "PerRank" not in joined and "dropout" in joined


def test_the_guide_shows_the_diff_as_it_is():
    plain, adopted = _body(lm1b_lm.plain_step), _body(lm1b_lm.skipreduce_step)
    diff = [line for line in difflib.unified_diff(plain, adopted, lineterm="", n=1)
            if not line.startswith(("+++", "---", "@@"))]
    guide = (ROOT / "docs" / "guides" / "jit-loop.md").read_text()
    block = guide.split("```diff\n")[-1].split("```")[0]
    assert block.splitlines() == diff[1:]
