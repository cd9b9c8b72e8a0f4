"""Hierarchical FSDP compiled (not run) for a 4-slice TPU v5e pod and 2 x 8 H100s.

Params sharded over every device (``P(("slow", "fast"))``): each gradient is
reduce-scattered in full within a slice or node, then by the skipped scatter
over the slow axis. Needs the pods extra: ``make check-pods``.
"""

import functools
import pathlib
import sys

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_pods  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from benchmarks import pods  # noqa: E402
from skipreduce_jax._ring import traffic as _traffic  # noqa: E402

pytestmark = test_pods.pytestmark
AXES = (pods.SLOW, pods.FAST)


def _params(mesh):
    loss_fn, shapes = pods.mlp(1024, 4)
    specs = jax.tree_util.tree_map(lambda _: P(AXES), shapes)
    return loss_fn, shapes, pods._placed(shapes, mesh, specs)


@functools.cache
def _xla(platform):
    """XLA's own step with the same layout: plain jit, the batch over all devices."""
    return test_pods.xla_step_collectives(platform, _params)


def _slow(found, kinds):
    return sum(c.bytes_per_device for c in found if c.slow and c.kind in kinds)


def _fast(found, kind):
    return sum(c.bytes_per_device for c in found if not c.slow and c.kind == kind)


@pytest.mark.parametrize("platform, k", test_pods.CASES)
def test_hierarchical_fsdp_skips_over_the_slow_axis_only(platform, k):
    mesh = test_pods._mesh(platform)
    n, inner = mesh.shape[pods.SLOW], mesh.shape[pods.FAST]
    loss_fn, shapes, params = _params(mesh)
    tx = optax.chain(sr.skip_reduce(pods.SLOW, inner_axis=pods.FAST, num_skip=k,
                                    min_size=0, params_sharded=True), optax.sgd(0.1))
    step = sr.make_train_step(loss_fn, tx, mesh, AXES)
    state = jax.eval_shape(tx.init, shapes)
    state = pods._placed(state, mesh, sr.state_specs(state, AXES))
    found = pods.collectives(
        step.lower(params, state, pods._batch(mesh, 1024, 32)).compile().as_text(),
        pods.mesh_nodes(mesh))
    whole = test_pods._param_bytes()
    # Over the slow axis, the gradients' 1/L: a reduce-scatter at k = 0, the
    # skipped scatter's transfers otherwise, (N-1-k)/N of it either way.
    scatters = (("reduce-scatter", "dcn-reduce_scatter") if k == 0
                else ("collective-permute", "dcn-one_to_one"))
    assert _slow(found, scatters) == pytest.approx(
        _traffic.reduce_scatter_bytes(whole / inner, n, k), rel=0.01, abs=64)
    # The full reduce-scatter over the fast axis stays inside each slice or
    # node (one per weight, not an all-reduce); no gradient is all-reduced.
    if k:
        assert _slow(found, ("reduce-scatter", "dcn-reduce_scatter")) == 0
    assert not [c for c in found if c.reduces and c.bytes_per_device > 0.01 * whole]
    assert _fast(found, "reduce-scatter") == pytest.approx(
        _traffic.reduce_scatter_bytes(whole, inner), rel=0.01)
    # The params' all-gather: once, no more than XLA's step gathers; in all,
    # at least k/N of the gradients' 1/L less than XLA's step sends.
    xla = _xla(platform)
    gathers = ("all-gather", "dcn-all_gather")
    assert 0 < _slow(found, gathers) <= 1.01 * _slow(xla, gathers)
    assert pods.slow_bytes(found) <= pods.slow_bytes(xla) - 0.99 * k / n * whole / inner


def _temporaries(platform, gather):
    mesh = test_pods._mesh(platform)
    loss_fn, shapes = pods.mlp(2048, 8)
    params = pods._placed(shapes, mesh, jax.tree_util.tree_map(lambda _: P(AXES), shapes))
    tx = optax.chain(sr.skip_reduce(pods.SLOW, inner_axis=pods.FAST, num_skip=0,
                                    min_size=0, params_sharded=True), optax.sgd(0.1))
    step = sr.make_train_step(loss_fn, tx, mesh, AXES, gather=gather)
    state = jax.eval_shape(tx.init, shapes)
    state = pods._placed(state, mesh, sr.state_specs(state, AXES))
    compiled = step.lower(params, state, pods._batch(mesh, 2048, 8)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_per_leaf_gathering_cuts_the_tpu_peak():
    """README's figures: 128 MiB of params, FSDP over all 64 chips."""
    whole, per_leaf = (_temporaries("tpu", g) for g in ("whole", "per_leaf"))
    assert per_leaf < 0.4 * whole
    # On 2 x 8 H100s XLA starts every forward gather early: no saving.
    assert _temporaries("gpu", "per_leaf") >= 0.9 * _temporaries("gpu", "whole")
