"""The collectives on leaves sharded over mesh axes the compiler handles.

A shard_map manual over "replica" only, on a (replica=4, fsdp=2) mesh: each
device reduces its own fsdp shard over "replica", nothing is sent over
"fsdp", and the result keeps the leaf's sharding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N, F = 4, 2
ROWS, COLS = 16, 512
W_SPEC = P(None, "fsdp")


def _mesh(axis_type):
    return jax.make_mesh((N, F), ("replica", "fsdp"), axis_types=(axis_type,) * 2)


def _run(fn, axis_type, x, out_specs, out_sharding=W_SPEC):
    """fn(local x) in a shard_map manual over "replica"; x is [N, ROWS, COLS]."""
    mesh = _mesh(axis_type)
    x = jax.device_put(x.reshape(N * ROWS, COLS),
                       NamedSharding(mesh, P("replica", "fsdp")))
    body = jax.shard_map(fn, in_specs=P("replica"), out_specs=out_specs,
                         axis_names={"replica"})
    if axis_type == AxisType.Explicit:
        # A partial-manual shard_map takes fsdp-sharded values under Auto axes.
        body = jax.sharding.auto_axes(body, axes="fsdp", out_sharding=out_sharding)
    with jax.set_mesh(mesh):
        f = jax.jit(body)
        return f(x), f.lower(x).compile().as_text()


def _values():
    return np.random.default_rng(0).normal(size=(N, ROWS, COLS)).astype(np.float32)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("k", [0, 2])
def test_skip_psum_on_local_shards(axis_type, k):
    x = _values()
    key = jax.random.key(3)

    def fn(local):
        out = sr.skip_psum(local, "replica", key=key, num_skip=k, specs=W_SPEC)
        mask = sr.contribution_mask(local, "replica", key=key, num_skip=k,
                                    specs=W_SPEC)
        return out, jnp.where(mask, local, 0.0)

    (out, kept), text = _run(fn, axis_type, x, (P(), P("replica")),
                             (W_SPEC, P("replica", "fsdp")))
    assert out.sharding.spec == W_SPEC  # keeps the leaf's sharding
    # Every element sums exactly the ranks the mask names: N - k of them.
    np.testing.assert_allclose(
        np.asarray(out), np.asarray(kept).reshape(N, ROWS, COLS).sum(0),
        rtol=1e-5, atol=1e-5)
    counts = (np.asarray(kept).reshape(N, ROWS, COLS) != 0).sum(0)
    assert np.all(counts == N - k)
    if k == 0:
        np.testing.assert_allclose(np.asarray(out), x.sum(0), rtol=1e-5, atol=1e-5)
    # Bytes per device: (2(N-1)-k)/N of the LOCAL shard, nothing over fsdp.
    local_bytes = ROWS * COLS // F * 4
    traffic = sr.collective_traffic(text)
    assert traffic.bytes_per_device() == pytest.approx(
        (2 * (N - 1) - k) / N * local_bytes)
    assert {op.kind for op in traffic.ops} <= {"collective-permute", "all-gather"}


def test_ring_psum_reads_explicit_types_inside():
    """A leaf typed sharded under Explicit axes needs no specs argument."""
    mesh = _mesh(AxisType.Explicit)
    x = jax.device_put(jnp.ones((N * ROWS, COLS)), NamedSharding(mesh, P("replica")))

    def fn(local):
        local = jax.sharding.reshard(local, W_SPEC)  # typed P(None, "fsdp")
        return sr.ring_psum(local, "replica")

    with jax.set_mesh(mesh):
        f = jax.jit(jax.shard_map(fn, in_specs=P("replica"), out_specs=P(),
                                  axis_names={"replica"}))
        out = f(x)
    assert out.sharding.spec == W_SPEC
    np.testing.assert_allclose(np.asarray(out), N)


def test_leaf_sharded_over_the_reduced_axis_is_refused():
    def fn(local):
        return sr.skip_psum(local, "replica", key=jax.random.key(0), num_skip=1,
                            specs=P("replica"))

    with pytest.raises(ValueError, match=r"sharded over \['replica'\], the axis being reduced"):
        _run(fn, AxisType.Auto, _values(), P())


def test_specs_must_name_compiler_axes():
    def fn(local):
        return sr.ring_psum(local, "replica", specs=P(None, "model"))

    with pytest.raises(ValueError, match=r"\['model'\] are not mesh axes"):
        _run(fn, AxisType.Auto, _values(), P())


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_a_traced_phase_reaches_the_local_shards(axis_type):
    # N = 4, k = 2: a period of 2, whose steps sum complementary ranks.
    x = _values()
    key = jax.random.key(3)

    def fn(local):
        outs = []
        for step in range(2):
            k, phase = sr.balanced_draw(key, jnp.int32(step), sr.ring_period(N, 2))
            outs.append(sr.skip_psum(local, "replica", key=k, phase=phase,
                                     num_skip=2, specs=W_SPEC))
        return outs[0] + outs[1]

    out, _ = _run(fn, axis_type, x, P())
    np.testing.assert_allclose(np.asarray(out), x.sum(0), rtol=1e-5, atol=1e-5)
