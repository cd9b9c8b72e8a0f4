"""skip_reduce(exact_radial=True): each output channel's update along its
weights and along the uniform direction is the exact mean, vectors are fully
reduced, and the extra bytes are what comm_stats counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8
KERNEL = (3, 3, 4, 16)  # a conv kernel: 16 output channels


def _params():
    w = jax.random.normal(jax.random.key(1), KERNEL)
    w = w.at[..., 3].set(0.0)  # a channel with no direction
    return {"k": w, "b": jnp.zeros(16)}


def _per_rank_grads(key=0):
    ka, kb = jax.random.split(jax.random.key(key))
    return {"k": jax.random.normal(ka, (N,) + KERNEL),
            "b": jax.random.normal(kb, (N, 16))}


def _step(tx, params, mesh):
    def f(g):
        g = jax.tree_util.tree_map(lambda x: x[0], g)
        return tx.update(g, tx.init(params), params)[0]

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))


def _along(x, w):
    return np.sum(np.asarray(x) * np.asarray(w), axis=(0, 1, 2))


def _placed(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def test_each_channel_along_its_weights_and_mean_is_exact_and_the_rest_is_skipped():
    mesh = jax.make_mesh((N,), ("data",))
    params, grads = _params(), _per_rank_grads()
    mean = jax.tree_util.tree_map(lambda g: g.mean(0), grads)
    kw = dict(skip_ratio=0.5, min_size=0, seed=3)
    # The same leaves skipped (exact_radial fully reduces the vector).
    plain = _step(sr.skip_reduce("data", selective={"k": True, "b": False}, **kw),
                  params, mesh)(_placed(grads, mesh))
    exact = _step(sr.skip_reduce("data", exact_radial=True, **kw), params,
                  mesh)(_placed(grads, mesh))
    w, ones = params["k"], np.ones(KERNEL)
    live = np.arange(16) != 3
    np.testing.assert_allclose(_along(exact["k"], w)[live], _along(mean["k"], w)[live],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_along(exact["k"], ones), _along(mean["k"], ones),
                               rtol=1e-4, atol=1e-4)
    # Plain Random is off along both, so the checks above can fail.
    assert np.abs(_along(plain["k"], w) - _along(mean["k"], w))[live].min() > 1e-2
    assert np.abs(_along(plain["k"], ones) - _along(mean["k"], ones)).min() > 1e-2
    # Only the components along each channel's weights and mean moved.
    diff = np.asarray(exact["k"] - plain["k"])
    w_np = np.asarray(w)
    for c in range(16):
        d = diff[..., c].ravel()
        basis = np.linalg.qr(np.stack([ones[..., c].ravel(), w_np[..., c].ravel()], 1))[0]
        if not live[c]:  # zero weights: the mean direction alone
            basis = basis[:, :1]
        np.testing.assert_allclose(d, basis @ (basis.T @ d), atol=1e-5)
    # A vector's one channel direction is itself: fully reduced.
    np.testing.assert_allclose(exact["b"], mean["b"], rtol=1e-5, atol=1e-6)
    skipped = _step(sr.skip_reduce("data", **kw), params, mesh)(_placed(grads, mesh))
    assert not np.allclose(skipped["b"], mean["b"], atol=1e-3)


def test_a_mean_input_shift_is_taken_out():
    # Before a BatchNorm with shared statistics, each rank's gradient holds
    # the mean input patch times its share of the channel's bias gradient,
    # and those shares sum to zero. Non-negative inputs: a positive patch.
    # The shape of a first conv on grey images, as in the digits CNN.
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(5)
    shape = (3, 3, 1, 8)
    w = rng.normal(size=shape).astype(np.float32)
    patch = (0.4 + 0.2 * rng.random(shape[:-1])).astype(np.float32)
    share = rng.normal(size=(N, 1, 1, 1, 8))
    grads = (0.1 * rng.normal(size=(N,) + shape)
             + patch[None, ..., None] * (share - share.mean(0))).astype(np.float32)
    unit = patch / np.linalg.norm(patch)

    def error_along_patch(tx):
        def f(g):
            return tx.update({"w": g[0]}, tx.init({"w": w}), {"w": w})[0]["w"]
        u = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                  out_specs=P()))(_placed(grads, mesh))
        return np.abs(np.tensordot(unit, np.asarray(u) - grads.mean(0), 3)).mean()

    kw = dict(skip_ratio=0.5, min_size=0)
    plain = error_along_patch(sr.skip_reduce("data", **kw))
    exact = error_along_patch(sr.skip_reduce("data", exact_radial=True, **kw))
    assert plain > 0.05
    assert exact < plain / 4


def test_scale_invariant_layer_gets_no_radial_drift():
    # As before a BatchNorm with shared statistics: each rank's gradient has a
    # component along each channel's weights, and they cancel in the sum.
    mesh = jax.make_mesh((N,), ("data",))
    w = np.asarray(jax.random.normal(jax.random.key(2), (32, 8)))
    a = np.asarray(jax.random.normal(jax.random.key(3), (N, 32, 8)))
    unit = w / np.linalg.norm(w, axis=0)
    ortho = a - np.sum(a * unit, axis=1, keepdims=True) * unit
    r = np.asarray(jax.random.normal(jax.random.key(4), (N, 1, 8)))
    grads = ortho + (r - r.mean(0)) * unit

    def radial(tx):
        def f(g):
            u = tx.update({"w": g[0]}, tx.init({"w": w}), {"w": w})[0]["w"]
            return jnp.sum(u * w, axis=0)
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
                                     out_specs=P()))(_placed(grads, mesh))

    kw = dict(skip_ratio=0.5, min_size=0)
    assert np.abs(radial(sr.skip_reduce("data", **kw))).max() > 0.1
    np.testing.assert_allclose(radial(sr.skip_reduce("data", exact_radial=True, **kw)),
                               0.0, atol=1e-4)


def test_extra_bytes_are_two_floats_per_channel_in_the_compiled_step():
    mesh = jax.make_mesh((N,), ("data",))
    params = {"k": jax.random.normal(jax.random.key(0), (64, 1024))}
    kw = dict(skip_ratio=0.5, min_size=0)
    grads = {"k": jax.ShapeDtypeStruct((N, 64, 1024), jnp.float32,
                                       sharding=NamedSharding(mesh, P("data")))}
    sent = {}
    for radial in (False, True):
        tx = sr.skip_reduce("data", exact_radial=radial, **kw)
        text = _step(tx, params, mesh).lower(grads).compile().as_text()
        sent[radial] = sr.collective_traffic(text).bytes_per_device()
        stats = sr.comm_stats(params, N, exact_radial=radial, **kw)
        assert sent[radial] == pytest.approx(stats.bytes_per_device)
    assert sent[True] - sent[False] == pytest.approx(2 * (N - 1) / N * 2 * 4 * 1024)


def test_bad_combinations_are_refused():
    for extra in (dict(error_feedback=True), dict(params_sharded=True)):
        with pytest.raises(ValueError, match="exact_radial=True works with"):
            sr.skip_reduce("data", skip_ratio=0.5, exact_radial=True, **extra)
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, exact_radial=True)

    def f(g):
        return tx.update({"k": g[0]}, tx.init({"k": g[0]}))[0]["k"]

    with pytest.raises(ValueError, match=r"exact_radial=True\): update\(\) got params=None"):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))(
            _placed(jnp.ones((N, 4, 16)), mesh))


def test_default_turns_on_with_linen_batchnorm_names_and_warns_without_params():
    mesh = jax.make_mesh((N,), ("data",))
    params = {"Conv_0": _params(), "BatchNorm_0": {"scale": jnp.ones(16)}}
    grads = {"Conv_0": _per_rank_grads(), "BatchNorm_0": {"scale": jnp.ones((N, 16))}}
    mean = jax.tree_util.tree_map(lambda g: g.mean(0), grads)
    kw = dict(skip_ratio=0.5, min_size=0, seed=3)
    auto = _step(sr.skip_reduce("data", **kw), params, mesh)(_placed(grads, mesh))
    np.testing.assert_allclose(auto["Conv_0"]["b"], mean["Conv_0"]["b"], rtol=1e-5,
                               atol=1e-6)
    w = params["Conv_0"]["k"]
    np.testing.assert_allclose(_along(auto["Conv_0"]["k"], w),
                               _along(mean["Conv_0"]["k"], w), rtol=1e-4, atol=1e-4)
    # Without a BatchNorm in the params the default is plain Random.
    plain = _step(sr.skip_reduce("data", **kw), params["Conv_0"], mesh)(
        _placed(grads["Conv_0"], mesh))
    assert not np.allclose(plain["b"], mean["Conv_0"]["b"], atol=1e-3)
    # comm_stats sees the same default from the gradients' names.
    assert sr.comm_stats(params, N, **kw).bytes_per_device > sr.comm_stats(
        params, N, exact_radial=False, **kw).bytes_per_device
    tx = sr.skip_reduce("data", **kw)

    def no_params(g):
        g = jax.tree_util.tree_map(lambda x: x[0], g)
        return tx.update(g, tx.init(params))[0]

    with pytest.warns(sr.BatchNormWarning, match="update\\(\\) got params=None"):
        jax.jit(jax.shard_map(no_params, mesh=mesh, in_specs=P("data"),
                              out_specs=P()))(_placed(grads, mesh))
