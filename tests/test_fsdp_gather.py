"""make_train_step(gather="per_leaf"): FSDP blocks gathered again in the backward.

Each leaf's gathered copy is recomputed (``jax.checkpoint``) instead of kept
between the passes, so the peak holds about one gathered leaf at a time, for
one more all-gather of the params per step. XLA:CPU drops the optimization
barrier that keeps the second gathers apart, so the programs that show it
compile with ``cse_barrier_expander`` disabled.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import under_remat3_per_leaf
from test_fsdp import _mlp as fsdp_mlp
from test_fsdp import _mlp_loss

import skipreduce_jax as sr
from skipreduce_jax._ring import traffic as _traffic

N = 8
REPO = Path(__file__).resolve().parents[1]
# Keeps jax.checkpoint's barrier, so XLA:CPU does not merge the two gathers.
KEEP_BARRIER = {"xla_disable_hlo_passes": "cse_barrier_expander"}
LAYERS, WIDTH, BATCH = 8, 512, 64


def deep_loss(p, batch):
    x, y = batch
    for i in range(LAYERS):
        x = jnp.tanh(x @ p[f"w{i}"])
    return jnp.mean((x - y) ** 2)


def deep_model():
    rng = np.random.default_rng(0)
    params = {f"w{i}": (rng.normal(size=(WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
              for i in range(LAYERS)}
    x = rng.normal(size=(BATCH, WIDTH)).astype(np.float32)
    return params, (x, np.sin(x))


def compiled_steps(tx, mesh, params, batch, compiler_options):
    """``{gather: (step, compiled)}`` for both modes, on FSDP params."""
    placed = sr.shard_params(params, mesh, "data")
    state = sr.init_opt_state(tx, placed, mesh, "data")
    out = {}
    for gather in ("whole", "per_leaf"):
        step = sr.make_train_step(deep_loss, tx, mesh, "data", gather=gather)
        out[gather] = step, step.lower(placed, state, batch).compile(
            compiler_options=compiler_options)
    return out, placed, state


def _sgd_tx(**kwargs):
    return optax.chain(sr.skip_reduce("data", min_size=0, params_sharded=True, **kwargs),
                       optax.sgd(0.1))


_MEMORY_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import jax, test_fsdp_gather as t
mesh = jax.make_mesh((t.N,), ("data",))
params, batch = t.deep_model()
temp = {}
# Random SkipReduce: buckets of one leaf, so each gradient is reduced as it comes.
for name, kw in (("k=0", dict(num_skip=0)), ("random", dict(skip_ratio=0.5, bucket_bytes=2**20))):
    steps, _, _ = t.compiled_steps(t._sgd_tx(**kw), mesh, params, batch, t.KEEP_BARRIER)
    temp[name] = {g: c.memory_analysis().temp_size_in_bytes for g, (_, c) in steps.items()}
print(json.dumps(temp))
"""


@pytest.mark.slow  # fast-suite time; CI runs it in test-slow
@under_remat3_per_leaf
def test_per_leaf_peak_memory_is_below_whole():
    """8 layers of 1 MiB, 1/8 per device: the temporaries fall from ~7 MiB to ~2.

    XLA:CPU's memory-minimizing scheduler (a process-wide flag, hence the
    subprocess) runs each gather next to its use; its default scheduler,
    tuned for concurrency, runs them all first.
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                        "--xla_cpu_enable_concurrency_optimized_scheduler=false")
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(REPO / "tests")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = LAYERS * WIDTH * WIDTH * 4
    for case, temp in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        # whole: all gathered params live at the end of the forward pass.
        assert temp["whole"] > 0.8 * model, case
        # per_leaf: a few gathered leaves (1/8 of the model each) at a time.
        assert temp["per_leaf"] < 0.4 * model, case
        assert temp["per_leaf"] < 0.4 * temp["whole"], case


@under_remat3_per_leaf
def test_per_leaf_gathers_the_params_again_in_the_backward_pass():
    """All-gather bytes: (N-1)/N P forward, and again for every leaf the backward reads.

    The first layer's weight is not read by the backward pass (its gradient
    needs only the input), so it is gathered once.
    """
    mesh = jax.make_mesh((N,), ("data",))
    params, batch = deep_model()
    steps, _, _ = compiled_steps(_sgd_tx(skip_ratio=0.5), mesh, params, batch, KEEP_BARRIER)
    leaf = WIDTH * WIDTH * 4
    gathered = {g: sr.collective_traffic(c.as_text()).bytes_per_device("all-gather")
                for g, (_, c) in steps.items()}
    # The gradients take SkipReduce's skipped reduce-scatter (no all-gather).
    params_once = _traffic.all_gather_bytes(LAYERS * leaf, N)
    regathered = _traffic.all_gather_bytes((LAYERS - 1) * leaf, N)
    assert gathered["whole"] == pytest.approx(params_once)
    assert gathered["per_leaf"] == pytest.approx(params_once + regathered)


def _mlp():
    host, batch = fsdp_mlp()
    return dict(host, c=np.ones(3, np.float32)), batch  # c: replicated (3 rows)


def _loss_with_c(p, batch):
    return _mlp_loss(p, batch) + jnp.sum(p["c"] ** 2)


def _trajectory(tx, gather, steps, compiler_options=None, microbatches=1):
    mesh = jax.make_mesh((N,), ("data",))
    host, batch = _mlp()
    params = sr.shard_params(host, mesh, "data")
    state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(_loss_with_c, tx, mesh, "data", gather=gather,
                              microbatches=microbatches)
    run = step
    if compiler_options is not None:
        compiled = step.lower(params, state, batch).compile(compiler_options=compiler_options)

        def run(*args):
            return compiled(*step._place(args))
    losses = []
    for _ in range(steps):
        params, state, loss = run(params, state, batch)
        losses.append(float(loss))
    return {k: np.asarray(v) for k, v in params.items()}, losses


@pytest.mark.parametrize("kwargs", [dict(num_skip=0), dict(skip_ratio=0.5)],
                         ids=["k=0", "random"])
def test_per_leaf_trains_as_whole(kwargs):
    """Same params and losses step by step, with the second gathers kept apart."""
    tx = optax.chain(sr.skip_reduce("data", min_size=0, params_sharded=True, **kwargs),
                     optax.adamw(1e-2))
    ref, ref_losses = _trajectory(tx, "whole", 5)
    got, losses = _trajectory(tx, "per_leaf", 5, KEEP_BARRIER)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got["w1"], _mlp()[0]["w1"])  # it trained


def test_per_leaf_with_microbatches_trains_as_whole():
    tx = _sgd_tx(skip_ratio=0.5)
    ref, _ = _trajectory(tx, "whole", 3, microbatches=2)
    got, _ = _trajectory(tx, "per_leaf", 3, microbatches=2)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_per_leaf_without_sharded_params_changes_nothing():
    """Replicated params: nothing to gather, the same step."""
    mesh = jax.make_mesh((N,), ("data",))
    host, batch = _mlp()
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0), optax.sgd(0.1))
    out = {}
    for gather in ("whole", "per_leaf"):
        params = sr.replicate(host, mesh)
        state = sr.init_opt_state(tx, params, mesh, "data")
        step = sr.make_train_step(_loss_with_c, tx, mesh, "data", gather=gather)
        for _ in range(3):
            params, state, loss = step(params, state, batch)
            float(loss)
        out[gather] = params
    for k in host:
        np.testing.assert_array_equal(np.asarray(out["per_leaf"][k]),
                                      np.asarray(out["whole"][k]))


@pytest.mark.parametrize("bad", ["leaf", "PER_LEAF", None, True])
def test_a_bad_gather_names_the_argument(bad):
    mesh = jax.make_mesh((N,), ("data",))
    with pytest.raises(ValueError, match=r"make_train_step: gather=.* must be 'whole'"):
        sr.make_train_step(_mlp_loss, _sgd_tx(num_skip=0), mesh, "data", gather=bad)
