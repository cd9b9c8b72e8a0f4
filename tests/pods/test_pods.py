"""SkipReduce compiled (not run) for a 4-slice TPU v5e pod and 2 x 8 H100s.

Needs the pods extra (libtpu and the CUDA plugin): ``make check-pods``. Elsewhere
these tests skip, saying why; with ``SKIPREDUCE_PODS=1`` (set by ``make
check-pods``) a missing plugin is an error instead.
"""

import functools
import importlib.util
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import skipreduce_jax as sr  # noqa: E402
from benchmarks import pods  # noqa: E402
from skipreduce_jax._ring import traffic as _traffic  # noqa: E402


def _importable(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


MISSING = [name for name in ("libtpu", "jax_plugins.xla_cuda12") if not _importable(name)]
if MISSING and os.environ.get("SKIPREDUCE_PODS"):
    raise RuntimeError(f"SKIPREDUCE_PODS is set but {MISSING} cannot be imported: "
                       "install the pods extra (pip install -e '.[pods]').")
pytestmark = [pytest.mark.pods, pytest.mark.skipif(
    bool(MISSING), reason=f"needs the pods extra ({MISSING} missing): make check-pods")]

LOCAL = 2**20  # float32 elements per device: a 4 MiB buffer, no padding
PLATFORMS = {"tpu": (pods.tpu_mesh, 4), "gpu": (lambda: pods.gpu_mesh(2, 8), 2)}
CASES = [("tpu", 0), ("tpu", 2), ("gpu", 0), ("gpu", 1)]


@pytest.fixture(scope="module", params=PLATFORMS)
def platform(request):
    return request.param


def _mesh(platform):
    return PLATFORMS[platform][0]()


def _collectives(platform, fn):
    mesh = _mesh(platform)
    compiled = pods.compile_collective(fn, mesh, LOCAL)
    return pods.collectives(compiled.as_text(), pods.mesh_nodes(mesh))


def _slow_all_reduces(found):
    return [c for c in found if c.slow and c.reduces]


@pytest.mark.parametrize("platform, k", CASES)
def test_skip_psum_sends_the_formula_over_the_slow_axis(platform, k):
    n = PLATFORMS[platform][1]
    found = _collectives(platform, lambda v: sr.skip_psum(
        v, pods.SLOW, key=jax.random.key(0), num_skip=k))
    assert pods.slow_bytes(found) == pytest.approx((2 * (n - 1) - k) / n * 4 * LOCAL)
    assert pods.slow_bytes(found) == _traffic.skipreduce_bytes(4 * LOCAL, n, k)
    assert not _slow_all_reduces(found)
    assert all(c.asynchronous for c in found if c.slow)


def test_skip_psum_runs_one_dcn_send_per_reduce_scatter_step():
    found = _collectives("tpu", lambda v: sr.skip_psum(
        v, pods.SLOW, key=jax.random.key(0), num_skip=2))
    kinds = sorted(c.kind for c in found)
    assert kinds == ["dcn-all_gather", "dcn-one_to_one"]
    permute = next(c for c in found if c.kind == "dcn-one_to_one")
    assert permute.bytes_per_device == 4 * LOCAL / 4  # f32[64,4096]: one ring chunk


def test_ring_psum_is_the_full_ring_without_an_all_reduce(platform):
    n = PLATFORMS[platform][1]
    found = _collectives(platform, lambda v: sr.ring_psum(v, pods.SLOW))
    assert pods.slow_bytes(found) == _traffic.ring_allreduce_bytes(4 * LOCAL, n)
    assert not _slow_all_reduces(found)


def test_psum_is_read_as_an_all_reduce_over_the_slow_axis(platform):
    n = PLATFORMS[platform][1]
    found = _collectives(platform, lambda v: lax.psum(v, pods.SLOW))
    (reduce,) = _slow_all_reduces(found)
    assert reduce.bytes_per_device == _traffic.ring_allreduce_bytes(4 * LOCAL, n)


@pytest.fixture(scope="module")
def steps(platform):
    mesh = _mesh(platform)
    k = PLATFORMS[platform][1] // 2
    return mesh, pods.compile_gspmd_step(mesh), pods.compile_skipreduce_step(mesh, k)


def _param_bytes(matrices_only=False):
    """Bytes of the test MLP's params (its weight matrices only, or all)."""
    _, shapes = pods.mlp(1024, 4)
    return sum(4 * x.size for x in jax.tree_util.tree_leaves(shapes)
               if x.ndim == 2 or not matrices_only)


def _whole_all_reduce_bytes(platform, nbytes):
    """Slow-axis bytes of an all-reduce over all devices that XLA does not
    split: over the 4 slices (TPU), or one ring over all 16 GPUs."""
    n = 4 if platform == "tpu" else 16
    return _traffic.ring_allreduce_bytes(nbytes, n)


def test_gspmd_step_all_reduces_its_gradients_over_the_slow_axis(platform, steps):
    mesh, gspmd, _ = steps
    found = pods.collectives(gspmd.as_text(), pods.mesh_nodes(mesh))
    assert _slow_all_reduces(found)
    weights = _param_bytes(matrices_only=True)
    if platform == "tpu":
        # Each chip's 1/16 of a weight gradient (reduce-scattered over its
        # slice) goes over the slices; the biases, combined, go whole.
        expected = (_traffic.ring_allreduce_bytes(weights / 16, 4)
                    + _whole_all_reduce_bytes(platform, _param_bytes() - weights))
    else:
        expected = _whole_all_reduce_bytes(platform, _param_bytes())
    assert pods.slow_bytes(found) == pytest.approx(expected, rel=0.01)


def test_skipreduce_step_sends_its_share_over_the_slow_axis(platform, steps):
    mesh, _, skip = steps
    found = pods.collectives(skip.as_text(), pods.mesh_nodes(mesh))
    n, fast = mesh.shape[pods.SLOW], mesh.shape[pods.FAST]
    # The weights go through hierarchical SkipReduce; the biases, under
    # skip_reduce's min_size, get a pmean that XLA all-reduces whole.
    weights = _param_bytes(matrices_only=True)
    expected = (_traffic.hierarchical_bytes(weights, n, fast, n // 2)[1]
                + _whole_all_reduce_bytes(platform, _param_bytes() - weights))
    assert pods.slow_bytes(found) == pytest.approx(expected, rel=0.01)
    assert pods.slow_bytes(found) < 0.7 * pods.slow_bytes(pods.collectives(
        steps[1].as_text(), pods.mesh_nodes(mesh)))


def test_skipreduce_step_memory_is_within_ten_percent_of_gspmd(steps):
    _, gspmd, skip = steps
    assert pods.device_memory(skip) == pytest.approx(pods.device_memory(gspmd), rel=0.10)


def test_the_inner_scatter_is_a_reduce_scatter_not_an_all_reduce(platform, steps):
    """Hierarchical mode's full reduce-scatter over the fast axis compiles to
    reduce-scatters: no bucket-sized all-reduce within a slice or node."""
    mesh, _, skip = steps
    found = pods.collectives(skip.as_text(), pods.mesh_nodes(mesh))
    fast = [c for c in found if not c.slow]
    biggest = max(4 * x.size for x in jax.tree_util.tree_leaves(pods.mlp(1024, 4)[1]))
    assert any(c.kind == "reduce-scatter" for c in fast)
    assert not [c for c in fast if c.kind == "all-reduce" and c.bytes_per_device >= biggest / 2]


@pytest.mark.parametrize("k", [0, 1])
def test_sharded_step_skips_over_the_slow_axis_only(platform, k):
    """HSDP: params sharded over the fast axis, SkipReduce over the slow one.

    make_train_step is manual over the slow axis only: each device rings its
    own 1/F shard over the slow axis, so the slow-axis bytes are
    (2(N-1)-k)/N of the local shard, with no gradient all-reduce crossing it.
    """
    mesh = _mesh(platform)
    n, fast = mesh.shape[pods.SLOW], mesh.shape[pods.FAST]
    loss_fn, shapes = pods.mlp(1024, 4)
    specs = jax.tree_util.tree_map(
        lambda x: jax.sharding.PartitionSpec(*([None] * (x.ndim - 1)), pods.FAST), shapes)
    tx = optax.chain(sr.skip_reduce(pods.SLOW, num_skip=k, min_size=0), optax.sgd(0.1))
    step = sr.make_train_step(loss_fn, tx, mesh, pods.SLOW)
    params = pods._placed(shapes, mesh, specs)
    state = jax.eval_shape(tx.init, shapes)
    state = pods._placed(state, mesh, sr.state_specs(state, pods.SLOW))
    batch = pods._batch(mesh, 1024, 32)
    found = pods.collectives(step.lower(params, state, batch).compile().as_text(),
                             pods.mesh_nodes(mesh))
    local = sum(4 * x.size for x in jax.tree_util.tree_leaves(shapes)) / fast
    loss = _traffic.ring_allreduce_bytes(4, n)
    assert pods.slow_bytes(found) == pytest.approx(
        _traffic.skipreduce_bytes(local, n, k) + loss, rel=0.01)
    if k > 0:  # (k = 0 is skip_reduce's plain pmean: XLA's own all-reduce)
        assert not [c for c in found if c.slow and c.reduces
                    and c.bytes_per_device > 0.01 * local]


def _fsdp_params(mesh):
    """The test MLP with every param sharded by rows over the slow axis (FSDP)."""
    loss_fn, shapes = pods.mlp(1024, 4)
    specs = jax.tree_util.tree_map(lambda _: P(pods.SLOW), shapes)
    return loss_fn, shapes, pods._placed(shapes, mesh, specs)


def _slow_gathers(found):
    return sum(c.bytes_per_device for c in found
               if c.slow and c.kind in ("all-gather", "dcn-all_gather"))


@functools.cache
def _xla_fsdp_collectives(platform):
    """XLA's own FSDP step: plain jit, params P("slow"), the batch over all devices."""
    return xla_step_collectives(platform, _fsdp_params)


def xla_step_collectives(platform, make_params):
    """The collectives of XLA's own SGD step on ``make_params(mesh)``'s layout."""
    mesh = _mesh(platform)
    loss_fn, _, params = make_params(mesh)
    sgd = optax.sgd(0.1)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return optax.apply_updates(params, sgd.update(grads, sgd.init(params))[0]), loss

    compiled = jax.jit(step, donate_argnums=0).lower(
        params, pods._batch(mesh, 1024, 32)).compile()
    return pods.collectives(compiled.as_text(), pods.mesh_nodes(mesh))


@pytest.mark.parametrize("platform, k", CASES)
def test_fsdp_step_over_the_slow_axis_sends_the_formula(platform, k):
    """FSDP over the slow axis: params sharded by rows over it, whole over fast.

    make_train_step(..., "slow") is then manual over both axes (no param is
    sharded over the fast one; each device of a slice or node takes its
    rows of the batch). The slow axis carries the params' all-gather,
    (N-1)/N P, the skipped reduce-scatter of the gradients, (N-1-k)/N P, and
    the loss's mean, and no all-reduce of gradients. XLA's own FSDP step on
    the same mesh gathers the same params and sends at least what k=0 does.
    """
    mesh = _mesh(platform)
    n = mesh.shape[pods.SLOW]
    loss_fn, shapes, params = _fsdp_params(mesh)
    tx = optax.chain(sr.skip_reduce(pods.SLOW, num_skip=k, min_size=0,
                                    params_sharded=True), optax.sgd(0.1))
    step = sr.make_train_step(loss_fn, tx, mesh, pods.SLOW)
    state = jax.eval_shape(tx.init, shapes)
    state = pods._placed(state, mesh, sr.state_specs(state, pods.SLOW))
    found = pods.collectives(
        step.lower(params, state, pods._batch(mesh, 1024, 32)).compile().as_text(),
        pods.mesh_nodes(mesh))
    whole = _param_bytes()
    gather = _traffic.all_gather_bytes(whole, n)
    loss = _traffic.ring_allreduce_bytes(4, n)
    assert _slow_gathers(found) == pytest.approx(gather, rel=0.01)
    assert pods.slow_bytes(found) == pytest.approx(
        gather + _traffic.reduce_scatter_bytes(whole, n, k) + loss, rel=0.01)
    assert not [c for c in found if c.slow and c.reduces and c.bytes_per_device > 0.01 * whole]
    xla = _xla_fsdp_collectives(platform)
    assert _slow_gathers(xla) >= 0.99 * gather
    assert pods.slow_bytes(xla) >= 0.99 * (gather + _traffic.reduce_scatter_bytes(whole, n))
    assert pods.slow_bytes(found) <= pods.slow_bytes(xla) - 0.99 * k / n * whole


def _fsdp_value_and_grad_step(platform, grad):
    """An SGD step on the FSDP layout, compiled; ``grad(loss_fn, specs)`` takes the grads."""
    mesh = _mesh(platform)
    loss_fn, shapes, params = _fsdp_params(mesh)
    specs = jax.tree_util.tree_map(lambda _: P(pods.SLOW), shapes)
    sgd = optax.sgd(0.1)

    def step(params, batch):
        loss, grads = grad(loss_fn, specs)(params, batch)
        return optax.apply_updates(params, sgd.update(grads, sgd.init(params))[0]), loss

    return jax.jit(step, donate_argnums=0).lower(
        params, pods._batch(mesh, 1024, 32)).compile()


@pytest.mark.parametrize("platform, k", CASES)
def test_fsdp_value_and_grad_over_the_slow_axis_sends_the_formula(platform, k):
    """sr.value_and_grad in a plain jit step, params sharded by rows over the slow axis.

    Each block is gathered at its first use and its gradient is the skipped
    reduce-scatter: the slow axis carries the params' all-gather, (N-1)/N P,
    (N-1-k)/N P of the gradients and the loss, no all-reduce of gradients.
    The device memory stays near XLA's own FSDP step's: measured 1.09x
    (k=0) on the TPU pod, 1.2515x on the H100s, where XLA:GPU starts every
    forward gather early and keeps the grads' blocks apart from the update.
    """
    mesh = _mesh(platform)
    n = mesh.shape[pods.SLOW]
    compiled = _fsdp_value_and_grad_step(platform, lambda loss_fn, specs: sr.value_and_grad(
        loss_fn, mesh, pods.SLOW, step=0, num_skip=k, min_size=0, param_specs=specs))
    found = pods.collectives(compiled.as_text(), pods.mesh_nodes(mesh))
    whole = _param_bytes()
    gather = _traffic.all_gather_bytes(whole, n)
    assert _slow_gathers(found) == pytest.approx(gather, rel=0.01)
    assert pods.slow_bytes(found) == pytest.approx(
        gather + _traffic.reduce_scatter_bytes(whole, n, k), rel=0.01)
    assert not [c for c in found if c.slow and c.reduces and c.bytes_per_device > 0.01 * whole]
    xla = _fsdp_value_and_grad_step(platform, lambda loss_fn, _: jax.value_and_grad(loss_fn))
    assert pods.slow_bytes(found) <= pods.slow_bytes(
        pods.collectives(xla.as_text(), pods.mesh_nodes(mesh))) - 0.99 * k / n * whole
    assert pods.device_memory(compiled) <= (1.25 if platform == "tpu" else 1.26) * (
        pods.device_memory(xla))


def _hidden_backward_matmuls(compiled, mesh):
    """(backward matmuls under an async collective, backward matmuls)."""
    schedule = pods.schedule("1 x 8 H100", "-", compiled, mesh)
    hidden = {i.name for c in schedule.collectives if c.asynchronous and not c.is_sync
              for i in c.overlap if i.matmul and i.phase == "backward"}
    return len(hidden), schedule.backward_matmuls


def test_flat_step_runs_every_weight_gradient_matmul_under_a_collective():
    """Flat SkipReduce on 1 x 8 H100s, one 16 MiB bucket per weight.

    XLA runs the dX matmuls first, then hides each dW matmul under a ring
    step of another bucket (benchmarks/pods.md, "the schedule"); combining
    the buckets' collectives into one would leave none hidden.
    """
    mesh = pods.gpu_mesh(1, 8)
    layers = 4
    skip = pods.compile_skipreduce_step(mesh, 4, width=2048, layers=layers,
                                        per_device=64, min_size=0)
    hidden, backward = _hidden_backward_matmuls(skip, mesh)
    assert backward == 2 * layers - 1
    assert hidden >= layers


def test_biases_decide_how_much_of_gspmds_all_reduce_xla_overlaps():
    """XLA:GPU's scheduler, not the algorithm (benchmarks/pods.md).

    With a bias per layer, GSPMD's all-reduces stay in flight over every
    backward matmul but one; without biases XLA runs the dX matmuls first
    with nothing in flight and hides only the dW ones after the first.
    """
    mesh = pods.gpu_mesh(1, 8)
    layers = 4
    counts = [_hidden_backward_matmuls(pods.compile_gspmd_step(
        mesh, width=2048, layers=layers, per_device=64, bias=bias), mesh)
        for bias in (True, False)]
    assert counts == [(2 * layers - 2, 2 * layers - 1), (layers - 1, 2 * layers - 1)]


@pytest.mark.parametrize("platform, k", [("tpu", 0), ("tpu", 2), ("gpu", 0), ("gpu", 1)])
def test_comm_dtype_bfloat16_wire_sends_native_16_bit_at_the_formula(platform, k):
    # GPU and TPU send bfloat16 as it is (CPU packs it in uint32 words).
    mesh, n = _mesh(platform), PLATFORMS[platform][1]
    text = pods.compile_collective(lambda v: sr.skip_psum(
        v, pods.SLOW, key=jax.random.key(0), num_skip=k, comm_dtype=jnp.bfloat16),
        mesh, LOCAL).as_text()
    found = pods.collectives(text, pods.mesh_nodes(mesh))
    assert pods.slow_bytes(found) == _traffic.skipreduce_bytes(2 * LOCAL, n, k)
    # No packing: what crosses is bf16, no uint32 words (TPU's DCN sends
    # and receives carry a u32[] scalar beside them).
    kinds = r"\b(collective-permute|all-gather|send|recv)(-start)?\("
    lines = [line.split(", metadata")[0] for line in text.splitlines()
             if re.search(kinds, line.split("=", 1)[-1])]
    assert lines and not any(re.search(r"u32\[\d", line) for line in lines)
    assert all("bf16[" in line for line in lines)
