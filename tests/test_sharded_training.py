"""Sharded training: params sharded over fast axes by the compiler,
SkipReduce over the slow replica axis (HSDP / multi-slice layouts).

make_train_step on a mesh with more axes is manual over the replica axis
only: the loss is plain GSPMD code, params and optimizer state keep their
shardings, and only the gradient reduction over "replica" changes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import xla_steps
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

LAYOUTS = {
    "4x2-explicit": ((4, 2), ("replica", "fsdp"), AxisType.Explicit,
                     {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}),
    "4x2-auto": ((4, 2), ("replica", "fsdp"), AxisType.Auto,
                 {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}),
    "2x2x2": ((2, 2, 2), ("replica", "fsdp", "tensor"), AxisType.Auto,
              {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")}),
}
D_IN, HIDDEN, D_OUT, BATCH = 32, 256, 8, 32


def _setup(name, axis_type=None):
    shape, axes, default_type, specs = LAYOUTS[name]
    axis_type = axis_type or default_type
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
    rng = np.random.default_rng(0)
    host = {"w1": rng.normal(size=(D_IN, HIDDEN)) * 0.2, "b1": np.zeros(HIDDEN),
            "w2": rng.normal(size=(HIDDEN, D_OUT)) * 0.1}
    params = {k: jax.device_put(v.astype(np.float32), NamedSharding(mesh, specs[k]))
              for k, v in host.items()}
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.tanh(x @ rng.normal(size=(D_IN, D_OUT))).astype(np.float32)
    return mesh, specs, params, (x, y)


def _loss(p, batch):  # plain GSPMD code
    x, y = batch
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _train(name, tx, steps):
    mesh, specs, params, batch = _setup(name)
    opt_state = sr.init_opt_state(tx, params, mesh, "replica")
    step = sr.make_train_step(_loss, tx, mesh, "replica")
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
    assert step._cache_size() == 1  # outputs fed back compile nothing new
    return mesh, specs, params, opt_state, step, batch


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_num_skip_zero_equals_xlas_gspmd_step(name):
    tx = optax.chain(sr.skip_reduce("replica", num_skip=0), optax.adam(1e-2))
    mesh, specs, params, _, _, batch = _train(name, tx, 20)
    # XLA's own step, plain GSPMD code (on Auto axes: under Explicit ones a
    # matmul over a sharded contraction needs an out_sharding in user code).
    ref_mesh, _, ref, _ = _setup(name, AxisType.Auto)
    xb = tuple(jax.device_put(a, NamedSharding(ref_mesh, P("replica"))) for a in batch)
    ref = xla_steps(_loss, optax.adam(1e-2), ref, xb, ref_mesh, 20)
    for k in params:
        assert params[k].sharding.is_equivalent_to(  # layouts kept
            NamedSharding(mesh, specs[k]), params[k].ndim), k
        local = params[k].addressable_shards[0].data.shape  # each device: its shard
        assert local == _local_shape(params[k].shape, specs[k], mesh), k
        np.testing.assert_allclose(np.asarray(params[k]), np.asarray(ref[k]),
                                   rtol=1e-4, atol=1e-5)


def _local_shape(shape, spec, mesh):
    dims = list(shape)
    for i, entry in enumerate(spec):
        for a in (entry if isinstance(entry, tuple) else (entry,)) if entry else ():
            dims[i] //= mesh.shape[a]
    return tuple(dims)


@pytest.mark.parametrize("name", ["4x2-explicit", "4x2-auto", "2x2x2"])
def test_random_replicas_stay_bit_identical(name):
    # On 2x2x2 the leaves are sharded over different axes (b1 over tensor only).
    tx = optax.chain(sr.skip_reduce("replica", skip_ratio=0.5, min_size=0),
                     optax.sgd(0.05, momentum=0.9))
    mesh, specs, params, opt_state, _, _ = _train(name, tx, 5)
    sr.assert_replicated(params, mesh)
    sr.assert_replicated(opt_state, mesh)
    for k in params:
        assert params[k].sharding.is_equivalent_to(
            NamedSharding(mesh, specs[k]), params[k].ndim)


def test_error_feedback_bookkeeping_is_exact():
    """World normalization: sum_r g_r = N * mean + sum_r residual_r."""
    name, n = "4x2-auto", 4
    tx = sr.skip_reduce("replica", num_skip=2, min_size=0, error_feedback=True)
    mesh, specs, params, batch = _setup(name)
    opt_state = sr.init_opt_state(optax.chain(tx, optax.sgd(1.0)), params, mesh, "replica")
    residual = opt_state[0].residual
    for k in params:  # one row per replica rank, sharded like the param
        assert residual[k].shape == (n,) + params[k].shape
        assert residual[k].sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *specs[k])), residual[k].ndim)
    step = sr.make_train_step(_loss, optax.chain(tx, optax.sgd(1.0)), mesh, "replica")
    before = {k: np.asarray(v) for k, v in params.items()}  # params are donated
    new, opt_state, _ = step(params, opt_state, batch)
    x, y = batch
    rows = BATCH // n
    grads = [jax.grad(_loss)(before,
                             (x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]))
             for r in range(n)]
    residual = opt_state[0].residual
    for k in params:
        mean = before[k] - np.asarray(new[k])  # sgd(1.0): -update
        total = sum(np.asarray(g[k]) for g in grads)
        np.testing.assert_allclose(total, n * mean + np.asarray(residual[k]).sum(0),
                                   rtol=1e-4, atol=1e-5)
        assert residual[k].sharding.is_equivalent_to(
            NamedSharding(mesh, P("replica", *specs[k])), residual[k].ndim)


def _gspmd_text(name):
    mesh, _, params, batch = _setup(name, AxisType.Auto)
    xb = tuple(jax.device_put(a, NamedSharding(mesh, P("replica"))) for a in batch)
    with jax.set_mesh(mesh):
        step = jax.jit(lambda p, b: jax.tree_util.tree_map(
            lambda w, g: w - 0.1 * g, p, jax.grad(_loss)(p, b)))
        return step.lower(params, xb).compile().as_text()


def _by_axis(text, mesh):
    """Bytes per device per step: over the replica axis, and over the others.

    On the (4, 2) mesh a replica group has 4 devices and an fsdp group 2; the
    ring's permutes must cross the replica axis only.
    """
    ops = sr.collective_traffic(text).ops
    permutes = [line for line in text.splitlines()
                if re.search(r"= .*collective-permute(-start)?\(", line)]
    pairs = [tuple(map(int, p)) for line in permutes
             for p in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])]
    coords = [np.unravel_index(i, mesh.devices.shape) for i in range(mesh.size)]
    assert all(coords[a][1] == coords[b][1] for a, b in pairs)  # same fsdp index
    replica = sum(o.bytes_per_device for o in ops
                  if o.kind == "collective-permute" or o.group_size == mesh.shape["replica"])
    other = sum(o.bytes_per_device for o in ops if o.kind != "collective-permute"
                and o.group_size != mesh.shape["replica"])
    return replica, other


@pytest.mark.parametrize("k", [0, 2])
def test_bytes_over_the_replica_axis_are_the_formula(k):
    name, n = "4x2-explicit", 4
    tx = optax.chain(sr.skip_reduce("replica", num_skip=k, min_size=0), optax.sgd(0.1))
    mesh, specs, params, opt_state, step, batch = _train(name, tx, 1)
    text = step.lower(params, opt_state, batch).compile().as_text()
    local = sum(int(np.prod(_local_shape(p.shape, specs[key], mesh))) * 4
                for key, p in params.items())
    loss_bytes = 2 * (n - 1) / n * 4  # the loss pmean
    replica, other = _by_axis(text, mesh)
    assert replica == pytest.approx((2 * (n - 1) - k) / n * local + loss_bytes)
    # Over fsdp: the model's own (a matmul contracting over a sharded
    # dimension), no more than XLA's own step sends there.
    _, gspmd_other = _by_axis(_gspmd_text(name), mesh)
    assert other <= gspmd_other


def test_a_param_sharded_over_the_replica_axis_names_the_fix():
    """FSDP over the replica axis needs skip_reduce(params_sharded=True)."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    batch = (np.ones((8, 8), np.float32), np.ones((8, 4), np.float32))

    def loss(p, b):
        return jnp.mean((b[0] @ p["w"] - b[1]) ** 2)

    tx = optax.chain(sr.skip_reduce("replica", num_skip=1, min_size=0), optax.sgd(0.1))
    params = {"w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P("replica")))}
    opt_state = sr.init_opt_state(tx, params, mesh, "replica")
    step = sr.make_train_step(loss, tx, mesh, "replica")
    with pytest.raises(ValueError, match=r"its 1/4 block.*Pass params_sharded=True"):
        step(params, opt_state, batch)
    # Split over the replica axis on another dimension: gathered silently
    # otherwise, so refused.
    params = {"w": jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, P(None, "replica")))}
    with pytest.raises(ValueError, match=r"sharded over \['replica'\].*not along its "
                                         r"leading dimension"):
        sr.init_opt_state(tx, params, mesh, "replica")


@pytest.mark.parametrize("name", ["4x2-explicit", "4x2-auto"])
def test_the_batch_may_be_split_over_the_fsdp_axis_too(name):
    """shard_batch(batch, mesh, ("replica", "fsdp")): P(("replica", "fsdp"))."""
    tx = optax.chain(sr.skip_reduce("replica", num_skip=0), optax.sgd(0.1))
    mesh, specs, params, batch = _setup(name)
    placed = sr.shard_batch(batch, mesh, ("replica", "fsdp"))
    assert placed[0].sharding.spec == P(("replica", "fsdp"))
    opt_state = sr.init_opt_state(tx, params, mesh, "replica")
    step = sr.make_train_step(_loss, tx, mesh, "replica")
    before = {k: np.asarray(v) for k, v in params.items()}
    new, _, loss = step(params, opt_state, placed)
    assert placed[0].sharding.spec == P(("replica", "fsdp"))  # not re-placed
    grads = jax.grad(_loss)(before, batch)
    for k in before:
        np.testing.assert_allclose(np.asarray(new[k]), before[k] - 0.1 * grads[k],
                                   rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_exact_radial_on_sharded_leaves(name):
    # One SGD step of lr 1: each channel's move along its weights equals the
    # all-reduce's (k = 0), with the leaves sharded by the compiler.
    moves = {}
    for kw in (dict(num_skip=0), dict(skip_ratio=0.5, exact_radial=True)):
        tx = optax.chain(sr.skip_reduce("replica", min_size=0, **kw), optax.sgd(1.0))
        mesh, specs, start, batch = _setup(name)
        host = jax.device_get(start)
        _, _, params, opt_state, _, _ = _train(name, tx, 1)
        sr.assert_replicated(params, mesh)
        for k in params:
            assert params[k].sharding.is_equivalent_to(
                NamedSharding(mesh, specs[k]), params[k].ndim)
        new = jax.device_get(params)
        moves[len(kw)] = {k: np.sum((new[k] - host[k]) * host[k], axis=0) if host[k].ndim > 1
                          else new[k] - host[k] for k in new}
    for k in moves[1]:
        np.testing.assert_allclose(moves[2][k], moves[1][k], rtol=1e-4, atol=1e-6)
