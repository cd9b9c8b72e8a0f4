"""ring_psum, skip_psum, skip_pmean and contribution_mask under shard_map."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bit_inputs, line_mesh, per_rank, popcount, zero_size_collectives
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

SIZES = (2, 4, 8)


def _mixed_tree(n, rng):
    return {
        "w": rng.normal(size=(n, 3, 5)).astype(np.float32),
        "b": rng.normal(size=(n, 7)).astype(np.float32),
        "scalar": rng.normal(size=(n,)).astype(np.float32),
        "empty": np.zeros((n, 0, 4), np.float32),
        "odd": rng.normal(size=(n, 2, 3, 11)).astype(np.float32),
        "half": rng.normal(size=(n, 13)).astype(jnp.bfloat16),
    }


def _assert_tree_close(got, want, rtol=1e-5, atol=1e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        tol = 2e-2 if g.dtype == jnp.bfloat16 else rtol
        np.testing.assert_allclose(np.asarray(g, np.float32),
                                   np.asarray(w, np.float32), rtol=tol,
                                   atol=max(atol, tol))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("gather", ["native", "ring"])
def test_ring_psum_and_k0_equal_psum(n, check_vma, gather):
    tree = _mixed_tree(n, np.random.default_rng(n))
    tree["ints"] = np.arange(n * 9, dtype=np.int32).reshape(n, 9)
    floats = {k: v for k, v in tree.items() if k != "ints"}

    def f(t):
        return (lax.psum(t, "i"), sr.ring_psum(t, "i", gather=gather),
                sr.skip_psum({k: v for k, v in t.items() if k != "ints"}, "i",
                             key=jax.random.key(3), num_skip=0, gather=gather))

    want, ring, skip0 = per_rank(f, tree, n=n, check_vma=check_vma)
    _assert_tree_close(ring, want)
    np.testing.assert_array_equal(ring["ints"], want["ints"])  # exact
    _assert_tree_close(skip0, {k: want[k] for k in floats})
    for leaf in jax.tree_util.tree_leaves(ring):
        np.testing.assert_array_equal(leaf, leaf[:1].repeat(n, 0))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("randomize", [True, False])
def test_exactly_n_minus_k_contributors_and_mask_agrees(n, randomize):
    x = bit_inputs(n, 1000)
    for k in range(n):
        def f(v):
            args = dict(key=jax.random.key(k), num_skip=k, randomize=randomize)
            return sr.skip_psum(v, "i", **args), sr.contribution_mask(v, "i", **args)

        out, mask = per_rank(f, x, n=n)
        assert np.all(popcount(out) == n - k), (n, k)
        np.testing.assert_array_equal(out, out[:1].repeat(n, 0))
        # The schedule's mask names exactly the bits present in the sum.
        for r in range(n):
            np.testing.assert_array_equal((out[0].astype(np.int64) >> r) & 1,
                                          mask[r].astype(np.int64))


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("randomize", [True, False])
def test_left_out_is_exactly_what_the_mask_excludes(n, randomize):
    rng = np.random.default_rng(n)
    # A leaf big enough for its own bucket, two that share one, a scalar.
    tree = {"big": rng.normal(size=(n, 64, 40)), "a": rng.normal(size=(n, 300)),
            "b": rng.normal(size=(n, 7, 3)), "s": rng.normal(size=(n,))}
    tree = jax.tree_util.tree_map(lambda a: a.astype(np.float32), tree)
    for k in range(n):
        def f(t):
            kw = dict(key=jax.random.key(k), num_skip=k, randomize=randomize,
                      bucket_bytes=4 * 2048)
            mean, left = sr.skip_pmean_and_left_out(t, "i", **kw)
            return (mean, left, sr.skip_pmean(t, "i", **kw),
                    sr.contribution_mask(t, "i", **kw))

        mean, left, ref, mask = per_rank(f, tree, n=n)
        jax.tree_util.tree_map(np.testing.assert_array_equal, mean, ref)
        expect = jax.tree_util.tree_map(lambda x, m: np.where(m, 0, x), tree, mask)
        jax.tree_util.tree_map(np.testing.assert_array_equal, left, expect)
        # k ranks' values of every element are left out.
        dropped = jax.tree_util.tree_map(lambda m: (~m).sum(0), mask)
        assert all(np.all(d == k) for d in jax.tree_util.tree_leaves(dropped))


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_ring_gather_puts_random_sub_chunks_where_the_native_one_does(n):
    # Integers, different per element and rank: any misplaced piece shows.
    x = np.random.default_rng(n).integers(-99, 99, size=(n, 5000)).astype(np.float32)
    for k in range(1, n):
        def f(v):
            kw = dict(key=jax.random.key(10 + k), num_skip=k, chunks_per_rank=8)
            return (sr.skip_psum(v, "i", gather="native", **kw),
                    sr.skip_psum(v, "i", gather="ring", **kw))

        native, ring = per_rank(f, x, n=n)
        np.testing.assert_array_equal(ring, native)
        assert not np.array_equal(native[0], x.sum(0))  # something was dropped


@pytest.mark.parametrize("length,block_bytes", [(5, 1 << 17), (12, 16), (96, 64)])
def test_the_reorder_in_place_and_as_a_gather_agree(monkeypatch, length, block_bytes):
    # The collectives roll the moving columns in place, block by block;
    # skip_reduce keeps the gather (fusable into the update). Same values for
    # every key, also where no column moves (k = 0) or every one does, with
    # columns cut in 1 (5), 4 (12: blocks of 3) and 16 (96: blocks of 6).
    from skipreduce_jax._ring import ring as _ring
    from skipreduce_jax._ring.ring import put_in_slot_order

    monkeypatch.setattr(_ring, "ROLL_BLOCK_BYTES", block_bytes)
    n, columns = 4, 8
    x = jnp.asarray(np.random.default_rng(3).normal(size=(n, columns, length)), jnp.float32)
    for seed in range(6):
        for k in range(n):
            s = sr.make_schedule(n, num_skip=k, chunks_per_rank=columns,
                                 key=jax.random.key(seed))
            rolled, gathered = jax.jit(lambda v, s=s: (
                put_in_slot_order(v, s), put_in_slot_order(v, s, in_place=False)))(x)
            np.testing.assert_array_equal(rolled, gathered)
            if k:  # slot s of column j holds ring chunk s - offsets[j]
                slots = (np.arange(n)[:, None] - np.asarray(s.offsets)) % n
                np.testing.assert_array_equal(
                    gathered, np.asarray(x)[slots, np.arange(columns)])


@pytest.mark.parametrize("randomize,check_vma,dtype", [
    (True, True, np.float32),
    (False, True, np.float32),
    # Unchecked types: the all-gather must transpose to a reduce-scatter.
    (True, False, np.float32),
    # Summed in float32, gathered as bfloat16 bits (a custom derivative).
    (True, True, jnp.bfloat16),
])
def test_derivatives_are_those_of_psum_of_the_kept_values(randomize, check_vma,
                                                          dtype):
    # skip_psum is the linear map x -> psum(x * mask): jvp and grad through it
    # are that map's (through the ring, the all-gather and the reorder), and vmap
    # maps it over a batch. Each rank's cotangent differs.
    n, k = 4, 2
    rng = np.random.default_rng(7)
    x, w, t = (rng.normal(size=(n, 3000)).astype(dtype) for _ in range(3))
    wide = None if dtype == np.float32 else jnp.float32

    def f(args):
        v, w, t = args
        kw = dict(key=jax.random.key(11), num_skip=k, randomize=randomize,
                  chunks_per_rank=16)
        skip = lambda v: sr.skip_psum(v, "i", accumulate_dtype=wide, **kw)  # noqa: E731
        ref = lambda v: lax.psum(v * sr.contribution_mask(v, "i", **kw), "i")  # noqa: E731
        grads = [jax.grad(lambda v, g=g: jnp.sum(w * g(v)).astype(jnp.float32))(v)
                 for g in (skip, ref)]
        tangents = [jax.jvp(g, (v,), (t,))[1] for g in (skip, ref)]
        return (*grads, *tangents, jax.vmap(skip)(jnp.stack([v, t])), skip(t))

    out = per_rank(f, (x, w, t), n=n, check_vma=check_vma)
    grad, grad_ref, tangent, tangent_ref, both, skip_t = (
        np.asarray(a, np.float32) for a in out)
    tol = 1e-5 if dtype == np.float32 else 3e-2
    np.testing.assert_allclose(grad, grad_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(tangent, tangent_ref, rtol=tol, atol=tol)
    np.testing.assert_array_equal(both[:, 1], skip_t)  # vmap: one call per item
    sum_w = np.asarray(w, np.float32).sum(0)
    assert not np.allclose(grad, np.broadcast_to(sum_w, grad.shape))  # dropped
    assert np.abs(grad).max() > 0.5  # not a gradient lost to a cast


def _patterns(keys, *, k, randomize, n=8, size=2048, chunks=None):
    """Sums of bit inputs for many keys, computed inside one lax.scan."""
    def f(v, keys):
        def step(carry, key):
            return carry, sr.skip_psum(v, "i", key=key, num_skip=k,
                                       randomize=randomize,
                                       chunks_per_rank=chunks)
        return lax.scan(step, 0, keys)[1]

    out = per_rank(f, bit_inputs(n, size), n=n, replicated_args=(keys,))
    return out[0].astype(np.int64)  # rank 0's view; all ranks agree (above)


def test_static_pattern_ignores_key():
    keys = jax.random.split(jax.random.key(0), 5)
    pats = _patterns(keys, k=3, randomize=False)
    assert np.all(pats == pats[:1])


def test_random_drop_frequency_is_k_over_n():
    n, k, draws = 8, 3, 400
    keys = jax.random.split(jax.random.key(1), draws)
    pats = _patterns(keys, k=k, randomize=True)
    assert not np.all(pats == pats[:1])
    dropped = np.stack([(pats >> r) & 1 == 0 for r in range(n)])  # [r, key, e]
    freq = dropped.mean(axis=1)                                     # [r, e]
    # Binomial(400, 3/8): sd 0.024; 6 sd covers all 16k cells with margin.
    assert np.abs(freq - k / n).max() < 0.15
    assert abs(freq.mean() - k / n) < 0.01


def test_subchunks_are_randomized_independently():
    keys = jax.random.split(jax.random.key(2), 20)
    pats = _patterns(keys, k=4, randomize=True, size=8 * 4 * 256, chunks=4)
    slot0 = pats[:, :4 * 256].reshape(20, 4, 256)
    assert np.all(slot0 == slot0[:, :, :1])  # constant within a sub-chunk
    # ... but sub-chunks of one slot get their own placement.
    assert any(len(np.unique(s[:, 0])) > 1 for s in slot0)


@pytest.mark.parametrize("k", [1, 3])
def test_rescale_and_normalize(k):
    n = 8
    ones = np.ones((n, 100), np.float32)

    def f(v):
        key = jax.random.key(0)
        return (sr.skip_psum(v, "i", key=key, num_skip=k, rescale=True),
                sr.skip_pmean(v, "i", key=key, num_skip=k),
                sr.skip_pmean(v, "i", key=key, num_skip=k, normalize="world"))

    rescaled, contributors, world = per_rank(f, ones, n=n)
    np.testing.assert_allclose(rescaled, n, rtol=1e-6)
    np.testing.assert_allclose(contributors, 1.0, rtol=1e-6)
    np.testing.assert_allclose(world, (n - k) / n, rtol=1e-6)


def test_bfloat16_with_float32_accumulation():
    n = 8
    rng = np.random.default_rng(0)
    x = (1.0 + rng.uniform(0, 1e-2, size=(n, 4096))).astype(jnp.bfloat16)
    exact = np.asarray(x, np.float64).sum(0)

    def f(v):
        return (sr.ring_psum(v, "i"),
                sr.skip_psum(v, "i", key=None, num_skip=0,
                             accumulate_dtype=jnp.float32))

    plain, accumulated = per_rank(f, x, n=n)
    assert accumulated.dtype == jnp.bfloat16
    err_plain = np.abs(np.asarray(plain[0], np.float64) - exact).mean()
    err_acc = np.abs(np.asarray(accumulated[0], np.float64) - exact).mean()
    assert err_acc <= err_plain
    # float32 accumulation: only the final rounding to bfloat16 (8 bits).
    np.testing.assert_allclose(np.asarray(accumulated[0], np.float64), exact,
                               rtol=2 ** -8)


def test_many_buckets_each_exact_and_independent():
    n, k = 8, 2
    tree = {f"leaf{i}": bit_inputs(n, 300 + i) for i in range(5)}

    def f(t):
        return sr.skip_psum(t, "i", key=jax.random.key(5), num_skip=k,
                            bucket_bytes=4 * 700)

    out = per_rank(f, tree, n=n)
    for leaf in out.values():
        assert np.all(popcount(leaf) == n - k)


def test_multi_axis_mesh_other_axis_untouched():
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 64)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("model", "data")))

    def f(v):
        return (sr.skip_psum(v, "data", key=jax.random.key(0), num_skip=0),
                sr.ring_psum(v, "model"))

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("model", "data"),
                              out_specs=(P("model"), P(None, "data"))))
    over_data, over_model = map(np.asarray, g(xs))
    np.testing.assert_allclose(over_data[:, 0], x.sum(1),
                               rtol=1e-5)
    np.testing.assert_allclose(over_model[0], x.sum(0), rtol=1e-5)


def test_skip_over_one_axis_of_two_counts_contributors():
    mesh = jax.make_mesh((2, 4), ("model", "data"))
    x = np.broadcast_to((2.0 ** np.arange(4))[None, :, None], (2, 4, 512))
    xs = jax.device_put(x.astype(np.float32),
                        NamedSharding(mesh, P("model", "data")))

    def f(v):
        return sr.skip_psum(v, "data", key=jax.random.key(1), num_skip=2)

    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("model", "data"),
                                out_specs=P("model")))(xs)
    assert np.all(popcount(np.asarray(out)) == 2)


def test_result_is_typed_replicated_under_check_vma():
    mesh = line_mesh(8)
    x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("i")))
    f = jax.shard_map(
        lambda v: sr.skip_pmean(v, "i", key=jax.random.key(0), num_skip=3),
        mesh=mesh, in_specs=P("i"), out_specs=P(), check_vma=True)
    np.testing.assert_allclose(np.asarray(jax.jit(f)(x)), 1.0)


def test_long_rings_use_a_loop(monkeypatch):
    monkeypatch.setattr(sr._ring.ring, "MAX_UNROLLED_STEPS", 2)
    x = bit_inputs(8, 777)
    for gather in ("native", "ring"):
        out = per_rank(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                              num_skip=2, gather=gather), x, n=8)
        assert np.all(popcount(out) == 6)
        np.testing.assert_array_equal(out, out[:1].repeat(8, 0))


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


def _trace(fn, n=4, x=None):
    x = np.ones((n, 10), np.float32) if x is None else x
    return per_rank(fn, x, n=n)


@pytest.mark.parametrize("num_skip, err, match", [
    (4, ValueError, r"num_skip=4 is outside \[0, 3\]"),
    (-1, ValueError, r"num_skip=-1 is outside"),
    (1.0, TypeError, r"num_skip=1.0 must be a Python int"),
    (True, TypeError, r"num_skip=True must be a Python int"),
])
def test_bad_num_skip(num_skip, err, match):
    with pytest.raises(err, match=match):
        _trace(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                      num_skip=num_skip))


def test_bad_normalize():
    with pytest.raises(ValueError, match=r"normalize='mean' must be"):
        _trace(lambda v: sr.skip_pmean(v, "i", key=jax.random.key(0),
                                       num_skip=1, normalize="mean"))


@pytest.mark.parametrize("key", [None, 0, np.zeros(3, np.uint32)])
def test_bad_key(key):
    with pytest.raises(TypeError, match=r"key=.* is not a PRNG key"):
        _trace(lambda v: sr.skip_psum(v, "i", key=key, num_skip=1))


def test_bad_flags_and_keywords():
    with pytest.raises(TypeError, match=r"skip_psum: rescale='yes' must be a bool"):
        _trace(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                      num_skip=1, rescale="yes"))
    with pytest.raises(TypeError, match=r"skip_pmean_and_left_out\(\) .*'nomalize'"):
        _trace(lambda v: sr.skip_pmean_and_left_out(
            v, "i", key=jax.random.key(0), num_skip=1, nomalize="world"))
    # It takes (and shows) skip_pmean's parameters.
    params = inspect.signature(sr.skip_pmean_and_left_out).parameters
    assert list(params) == list(inspect.signature(sr.skip_pmean).parameters)


def test_leaf_sharded_over_an_explicit_compiler_axis_is_reduced_shard_by_shard():
    # shard_map manual over "data" only; "model" is Explicit (make_mesh's
    # default) and the leaf is typed sharded over it: each device reduces
    # its own shard and the sum keeps the sharding (tests/test_sharded.py).
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, P("data")))

    def f(v):
        v = jax.sharding.reshard(v, P(None, "model"))
        return sr.skip_psum(v, "data", key=jax.random.key(0), num_skip=1)

    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(f, in_specs=P("data"), out_specs=P(),
                                    axis_names={"data"}))(x)
    assert out.sharding.spec == P(None, "model")
    np.testing.assert_allclose(np.asarray(out), 3.0)  # N - k = 3 ranks summed


def test_raw_uint32_key_is_accepted():
    raw = jax.random.PRNGKey(0)
    out = _trace(lambda v: sr.skip_psum(v, "i", key=raw, num_skip=1))
    np.testing.assert_allclose(out, 3.0)


def test_rank_dependent_key_is_rejected():
    def f(v):
        key = jax.random.fold_in(jax.random.key(0), lax.axis_index("i"))
        return sr.skip_psum(v, "i", key=key, num_skip=1)
    with pytest.raises(ValueError, match=r"key varies over \['i'\]"):
        _trace(f)


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_integer_and_bool_leaves_rejected(dtype):
    x = np.ones((4, 10), dtype)
    with pytest.raises(TypeError, match=r"floating-point gradients only"):
        _trace(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                      num_skip=1), x=x)
    with pytest.raises(TypeError, match=r"floating-point gradients only"):
        _trace(lambda v: sr.skip_pmean(v, "i", key=jax.random.key(0),
                                       num_skip=1), x=x)


def test_ring_psum_rejects_bool():
    with pytest.raises(TypeError, match=r"ring_psum: got a bool leaf"):
        _trace(lambda v: sr.ring_psum(v, "i"), x=np.ones((4, 3), np.bool_))


def test_unbound_axis():
    with pytest.raises(NameError, match=r"axis_name='data' is not a bound axis"
                       r".*inside jax.shard_map"):
        _trace(lambda v: sr.skip_psum(v, "data", key=jax.random.key(0),
                                      num_skip=1))
    with pytest.raises(NameError, match=r"not a bound axis"):
        sr.ring_psum(jnp.ones(3), "data")


def test_bad_gather_and_chunks():
    with pytest.raises(ValueError, match=r"gather='tree'"):
        _trace(lambda v: sr.ring_psum(v, "i", gather="tree"))
    with pytest.raises(ValueError, match=r"chunks_per_rank=0"):
        _trace(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                      num_skip=1, chunks_per_rank=0))


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(chunks_per_rank=True), ValueError, r"chunks_per_rank=True must be a"),
    (dict(bucket_bytes=0), ValueError, r"bucket_bytes=0 must be a positive"),
    (dict(accumulate_dtype=jnp.int32), TypeError,
     r"accumulate_dtype=.*int32.* is not a floating-point dtype"),
    (dict(accumulate_dtype="f32x"), TypeError,
     r"accumulate_dtype='f32x' is not a dtype"),
    (dict(randomize="no"), TypeError, r"randomize='no' must be a bool"),
])
def test_bad_sizes_dtypes_and_flags(kwargs, err, match):
    with pytest.raises(err, match=match):
        _trace(lambda v: sr.skip_psum(v, "i", key=jax.random.key(0),
                                      num_skip=1, **kwargs))


def test_numpy_ints_and_python_scalars_are_accepted():
    def f(v):
        kw = dict(key=jax.random.key(0), num_skip=np.int64(1),
                  chunks_per_rank=np.int64(2), bucket_bytes=np.int64(1 << 20))
        tree = {"v": v, "s": 1.0}
        return sr.skip_psum(tree, "i", **kw)["v"], sr.ring_psum(tree, "i")["s"]

    summed, scalar = _trace(f)
    np.testing.assert_allclose(summed, 3.0)
    np.testing.assert_allclose(scalar, 4.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_skip=4), r"num_skip=4 must be an int in \[0, 3\]"),
    (dict(num_skip=1, chunks_per_rank=0), r"chunks_per_rank=0 must be a"),
])
def test_make_schedule_checks_its_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sr.make_schedule(4, key=jax.random.key(0), **kwargs)


_EVERY_COLLECTIVE = {
    "ring_psum": lambda t: sr.ring_psum(t, "i"),
    "skip_psum": lambda t: sr.skip_psum(t, "i", key=jax.random.key(1), num_skip=2),
    "skip_pmean": lambda t: sr.skip_pmean(t, "i", key=jax.random.key(1), num_skip=2),
    "skip_pmean_and_left_out": lambda t: sr.skip_pmean_and_left_out(
        t, "i", key=jax.random.key(1), num_skip=2),
    "skip_psum_scatter": lambda t: sr.skip_psum_scatter(
        {k: v for k, v in t.items() if v.ndim and v.shape[0] % 4 == 0},
        "i", key=jax.random.key(1), num_skip=2),
    "skip_reduce": lambda t: optax.chain(sr.skip_reduce("i", num_skip=2, min_size=0)).update(
        t, optax.chain(sr.skip_reduce("i", num_skip=2, min_size=0)).init(t))[0],
}


@pytest.mark.parametrize("name", sorted(_EVERY_COLLECTIVE))
def test_a_zero_size_leaf_beside_others_crosses_no_collective(name):
    """Zero-size leaves have nothing to reduce: they stay out of every collective.

    XLA:CPU at jax 0.11.2 crashes compiling a zero-size collective beside another.
    """
    n = 4
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(n, 8, 5)).astype(np.float32),
            "empty": np.zeros((n, 0, 4), np.float32),
            "also_empty": np.zeros((n, 8, 0), np.float32)}
    mesh = line_mesh(n)
    fn = jax.jit(jax.shard_map(lambda t: _EVERY_COLLECTIVE[name](
        jax.tree_util.tree_map(lambda x: x[0], t)), mesh=mesh, in_specs=P("i"),
        out_specs=P(), check_vma=False))
    placed = jax.device_put(tree, NamedSharding(mesh, P("i")))
    out = fn(placed)
    assert not zero_size_collectives(fn.lower(placed).as_text())
    assert [x.shape for x in jax.tree_util.tree_leaves(out) if x.size == 0]


def test_zero_size_collectives_are_seen():
    """The reader above can fail: lax.psum of a zero-size array is one."""
    mesh = line_mesh(4)
    fn = jax.jit(jax.shard_map(lambda x: lax.psum(x[0], "i"), mesh=mesh, in_specs=P("i"),
                               out_specs=P(), check_vma=False))
    x = jax.device_put(np.zeros((4, 0, 3), np.float32), NamedSharding(mesh, P("i")))
    assert zero_size_collectives(fn.lower(x).as_text())
