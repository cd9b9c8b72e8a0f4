"""Hierarchical SkipReduce: full over the fast inner axis, skipped over outer."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import popcount, under_scan3_ring
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

AXES = ("host", "local")


def _grid(hosts, local, size):
    """Device (h, l) holds 2**(h * local + l): the sum's bits name devices."""
    bits = 2.0 ** np.arange(hosts * local).reshape(hosts, local, 1)
    return np.broadcast_to(bits, (hosts, local, size)).astype(np.float32)


def _run(fn, hosts, local, x, *, check_vma=True):
    mesh = jax.make_mesh((hosts, local), AXES)
    xs = jax.device_put(x, NamedSharding(mesh, P(*AXES)))
    f = jax.shard_map(lambda v: fn(v[0, 0])[None, None], mesh=mesh,
                      in_specs=P(*AXES), out_specs=P(*AXES), check_vma=check_vma)
    return np.asarray(jax.jit(f)(xs))


@pytest.mark.parametrize("hosts, local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("randomize", [True, False])
def test_each_element_sums_whole_hosts(hosts, local, randomize):
    x = _grid(hosts, local, 1000)
    for k in range(hosts):
        def fn(v):
            kw = dict(key=jax.random.key(k), num_skip=k, randomize=randomize,
                      inner_axis="local")
            return jnp.stack([sr.skip_psum(v, "host", **kw),
                              sr.contribution_mask(v, "host", **kw)])

        out = _run(fn, hosts, local, x)
        sums, masks = out[:, :, 0].astype(np.int64), out[:, :, 1]
        assert np.all(sums == sums[:1, :1])                # identical everywhere
        group = (1 << local) - 1
        per_host = np.stack([(sums[0, 0] >> (h * local)) & group
                             for h in range(hosts)])       # [hosts, size]
        assert np.all((per_host == 0) | (per_host == group))  # whole hosts
        assert np.all((per_host == group).sum(0) == hosts - k)
        assert np.all(popcount(sums[0, 0]) == (hosts - k) * local)
        for h in range(hosts):                             # mask agrees
            for d in range(local):
                np.testing.assert_array_equal(masks[h, d], per_host[h] == group)


@pytest.mark.parametrize("randomize", [True, False])
def test_left_out_follows_the_mask_with_an_inner_axis(randomize):
    hosts, local = 4, 2
    x = np.random.default_rng(1).normal(size=(hosts, local, 1000)).astype(np.float32)
    for k in range(hosts):
        def fn(v):
            kw = dict(key=jax.random.key(k), num_skip=k, randomize=randomize,
                      inner_axis="local")
            _, left = sr.skip_pmean_and_left_out(v, "host", **kw)
            return jnp.stack([left, jnp.where(sr.contribution_mask(v, "host", **kw),
                                              0.0, v)])

        out = _run(fn, hosts, local, x)
        np.testing.assert_array_equal(out[:, :, 0], out[:, :, 1])
        # Each element drops k of the hosts, on every inner device.
        assert np.all((out[:, :, 0] != 0).sum(0) == k)


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("gather", ["native", pytest.param("ring", marks=under_scan3_ring)])
def test_gradient_is_that_of_psum_of_the_kept_values(check_vma, gather):
    # Every device's cotangent differs; both all-gathers must transpose to
    # sums over their axes, with or without JAX's type checks.
    hosts, local = 4, 2
    rng = np.random.default_rng(3)
    xw = rng.normal(size=(hosts, local, 2, 500)).astype(np.float32)

    def fn(vw):
        v, w = vw
        kw = dict(key=jax.random.key(5), num_skip=2, inner_axis="local")
        mask = sr.contribution_mask(v, "host", **kw)
        skip = lambda v: sr.skip_psum(v, "host", gather=gather, **kw)  # noqa: E731
        ref = lambda v: lax.psum(v * mask, AXES)  # noqa: E731
        return jnp.stack([jax.grad(lambda v, g=g: jnp.sum(w * g(v)))(v)
                          for g in (skip, ref)])

    out = _run(fn, hosts, local, xw, check_vma=check_vma)
    np.testing.assert_allclose(out[:, :, 0], out[:, :, 1], rtol=1e-5, atol=1e-5)
    assert np.abs(out[:, :, 0]).max() > 0.5


def test_hierarchical_pmean_and_k0_equal_psum():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 333)).astype(np.float32)

    def fn(v):
        return jnp.stack([
            sr.skip_psum(v, "host", key=None, num_skip=0, inner_axis="local"),
            sr.skip_pmean(v, "host", key=jax.random.key(0), num_skip=1,
                          inner_axis="local", normalize="world") * 8,
            lax.psum(v, AXES)])

    out = _run(fn, 2, 4, x)
    np.testing.assert_allclose(out[0, 0, 0], out[0, 0, 2], rtol=1e-5, atol=1e-5)
    # k = 1 of 2 hosts: exactly one host's four devices per element.
    host_sums = x.sum(1)
    got = out[0, 0, 1]
    assert np.all(np.isclose(got, host_sums[0], atol=1e-4) |
                  np.isclose(got, host_sums[1], atol=1e-4))


def test_outer_axis_traffic_matches_formula():
    hosts, local, size = 4, 2, 4096
    mesh = jax.make_mesh((hosts, local), AXES)
    x = jax.ShapeDtypeStruct((hosts, local, size), jnp.float32,
                             sharding=NamedSharding(mesh, P(*AXES)))
    for k in range(hosts):
        f = jax.shard_map(
            lambda v: sr.skip_psum(v, "host", key=jax.random.key(0), num_skip=k,
                                   inner_axis="local", chunks_per_rank=4),
            mesh=mesh, in_specs=P(*AXES), out_specs=P())
        traffic = sr.collective_traffic(jax.jit(f).lower(x).compile().as_text())
        outer = traffic.bytes_per_device("collective-permute") + sum(
            op.bytes_per_device for op in traffic.ops
            if op.kind == "all-gather" and op.group_size == hosts)
        shard_bytes = size * 4 / local
        assert outer == pytest.approx((2 * (hosts - 1) - k) / hosts * shard_bytes)
        inner = [op for op in traffic.ops if op.group_size == local and
                 op.kind in ("reduce-scatter", "all-gather")]
        assert {op.kind for op in inner} == {"reduce-scatter", "all-gather"}
        assert traffic.count("all-reduce") == 0


def test_skip_reduce_hierarchical_training_keeps_replicas_identical():
    mesh = jax.make_mesh((2, 4), AXES)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * 4, 32)).astype(np.float32)
    y = rng.normal(size=(8 * 4, 4)).astype(np.float32)

    def loss_fn(p, batch):
        return jnp.mean((batch[0] @ p["w"] - batch[1]) ** 2)

    tx = optax.chain(sr.skip_reduce("host", num_skip=1, inner_axis="local",
                                    min_size=0, error_feedback=True),
                     optax.sgd(0.05))
    params = sr.replicate({"w": jnp.zeros((32, 4))}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, AXES)
    assert opt_state[0].residual["w"].shape == (8, 32, 4)
    step = sr.make_train_step(loss_fn, tx, mesh, AXES)
    losses = []
    for _ in range(15):
        params, opt_state, loss = step(params, opt_state,
                                       sr.shard_batch((x, y), mesh, AXES))
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    shards = [np.asarray(s.data) for s in params["w"].addressable_shards]
    for s in shards[1:]:
        np.testing.assert_array_equal(s, shards[0])


def test_bad_axes():
    x = _grid(2, 4, 16)
    with pytest.raises(ValueError, match="inner_axis='host' is also axis_name"):
        _run(lambda v: sr.skip_psum(v, "host", key=jax.random.key(0), num_skip=1,
                                    inner_axis="host"), 2, 4, x)
    with pytest.raises(NameError, match="inner_axis='gpu' is not a bound axis"):
        _run(lambda v: sr.skip_psum(v, "host", key=jax.random.key(0), num_skip=1,
                                    inner_axis="gpu"), 2, 4, x)
    with pytest.raises(NameError, match="axis_name='dcn' is not a bound axis"):
        _run(lambda v: sr.skip_psum(v, "dcn", key=jax.random.key(0), num_skip=1,
                                    inner_axis="local"), 2, 4, x)


def test_step_over_the_outer_axis_only_names_the_fix():
    # Local gradients over "host" alone are summed over "local" by autodiff:
    # the error says to pass both axes, not to use local_grad.
    mesh = jax.make_mesh((2, 4), AXES)
    tx = optax.chain(sr.skip_reduce("host", num_skip=1, inner_axis="local",
                                    min_size=0), optax.sgd(0.05))
    params = sr.replicate({"w": jnp.zeros((8, 2))}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "host")
    batch = sr.shard_batch(np.ones((8, 8), np.float32), mesh, "host")
    step = sr.make_train_step(lambda p, b: jnp.sum(b @ p["w"]), tx, mesh, "host")
    with pytest.raises(ValueError, match=r"already summed over the inner axis "
                       r"'local'.*pass axis_name=\('host', 'local'\)"):
        step(params, opt_state, batch)
    # With error feedback the residuals vary over both axes: init_opt_state
    # is where the mistake shows first.
    tx = optax.chain(sr.skip_reduce("host", num_skip=1, inner_axis="local",
                                    min_size=0, error_feedback=True),
                     optax.sgd(0.05))
    with pytest.raises(ValueError, match=r"init_opt_state: the per-rank field "
                       r"'residual' varies over \['host', 'local'\].*"
                       r"\('host', 'local'\)"):
        sr.init_opt_state(tx, params, mesh, "host")


def test_step_over_both_axes_with_a_flat_skip_reduce_names_the_fix():
    # Local gradients over both axes, reduced over "host" only: the update
    # still varies over "local".
    mesh = jax.make_mesh((2, 4), AXES)
    tx = optax.chain(sr.skip_reduce("host", num_skip=1, min_size=0),
                     optax.sgd(0.05))
    params = sr.replicate({"w": jnp.zeros((8, 2))}, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, AXES)
    batch = sr.shard_batch(np.ones((8, 8), np.float32), mesh, AXES)
    step = sr.make_train_step(lambda p, b: jnp.sum(b @ p["w"]), tx, mesh, AXES)
    with pytest.raises(ValueError, match=r"varies over \['local'\]: tx reduces "
                       r"over 'host' but not over the inner axis.*"
                       r"skip_reduce\('host', inner_axis='local', \.\.\.\)"):
        step(params, opt_state, batch)
