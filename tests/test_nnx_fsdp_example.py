"""examples/nnx_fsdp_lm.py: flax's gemma-shaped NNX loop (FSDP) adopted in a few lines.

The params and AdamW's state stay sharded over ``fsdp``; at ``num_skip=0``
every loss and metric equals the plain step's (XLA's own FSDP reductions).
"""

import dataclasses
import difflib
import inspect
import pathlib
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

nnx_fsdp_lm = pytest.importorskip("nnx_fsdp_lm")
CONFIG = dataclasses.replace(nnx_fsdp_lm.Config(), steps=3, batch=16, seq_len=16, width=64,
                             layers=1, train_mb=0.25)


def _changed_lines(a, b) -> int:
    """``+`` and ``-`` lines of ``diff -u`` between two step bodies (def lines aside)."""
    body = [inspect.getsource(f).splitlines()[1:] for f in (a, b)]
    return sum(1 for line in difflib.unified_diff(*body, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---")))


def test_adopted_in_at_most_5_lines():
    # The import of skipreduce_jax.nnx, and the step's lines.
    assert _changed_lines(nnx_fsdp_lm.plain_step, nnx_fsdp_lm.skipreduce_step) + 1 <= 5


def _spec(x):
    return jax.typeof(x).sharding.spec


@pytest.fixture(scope="module")
def runs():
    mesh = nnx_fsdp_lm.make_mesh()
    batches = nnx_fsdp_lm.batches_of(CONFIG)
    return {name: nnx_fsdp_lm.train(name, config, mesh, batches) for name, config in (
        ("plain", CONFIG), ("exact", dataclasses.replace(CONFIG, skip_ratio=0.0)),
        ("skipped", CONFIG))}


@pytest.mark.slow  # trains 3 runs, or compiles 2 steps: test-slow, in CI
def test_equal_to_plain_at_k0_with_params_and_state_sharded(runs):
    plain, exact = runs["plain"], runs["exact"]
    np.testing.assert_allclose(exact["losses"], plain["losses"], rtol=2e-5)
    for name in plain["metrics"]:
        np.testing.assert_allclose(exact["metrics"][name], plain["metrics"][name], rtol=2e-5)
    model, optimizer = exact["model"], exact["optimizer"]
    assert _spec(model.blocks[0].qkv[...]) == P("fsdp", "tensor")
    assert _spec(model.blocks[0].down[...]) == P("tensor", "fsdp")
    assert _spec(optimizer.opt_state[0].mu["blocks"][0]["up"][...]) == P("fsdp", "tensor")
    ref = jax.tree.leaves(nnx_state(plain["model"]))
    for a, b in zip(jax.tree.leaves(nnx_state(model)), ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # trains 3 runs, or compiles 2 steps: test-slow, in CI
def test_skipping_changes_the_update_and_keeps_the_layout(runs):
    skipped = runs["skipped"]
    assert np.isfinite(skipped["losses"]).all()
    assert skipped["losses"][0] == pytest.approx(runs["plain"]["losses"][0], rel=1e-5)
    assert skipped["losses"][-1] != pytest.approx(runs["plain"]["losses"][-1], rel=1e-6)
    assert _spec(skipped["model"].embed[...]) == P("fsdp", "tensor")


def nnx_state(model):
    from flax import nnx
    return nnx.state(model, nnx.Param)


@pytest.mark.slow  # trains 3 runs, or compiles 2 steps: test-slow, in CI
def test_adopted_step_memory_is_within_1_25x_of_plain():
    """Compiled temporary memory of the two steps, at skip ratio 0.5.

    Before: 3x, with the qkv split (jnp.split) gathered whole and each
    dropout mask drawn whole (nnx.Dropout reshards its mask).
    """
    from flax import nnx
    from jax.sharding import NamedSharding

    config = dataclasses.replace(nnx_fsdp_lm.Config(), steps=1, train_mb=0.25)
    mesh = nnx_fsdp_lm.make_mesh()
    tokens = nnx_fsdp_lm.batches_of(config)[0]
    temp = {}
    for name, step in (("plain", nnx_fsdp_lm.plain_step),
                       ("skipreduce", nnx_fsdp_lm.skipreduce_step)):
        model, optimizer, metrics, rngs = nnx_fsdp_lm.setup(config, mesh)
        with jax.set_mesh(mesh):
            t = jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))
            compiled = nnx.jit(step).lower(model, optimizer, metrics, t, rngs).compile()
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["skipreduce"] <= 1.25 * temp["plain"], temp
