"""comm_dtype: 16-bit on the wire, float32 in each hop's addition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bit_inputs, line_mesh, per_rank, popcount
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._ring.traffic import reduce_scatter_bytes, skipreduce_bytes

BF16 = jnp.bfloat16
EPS = {BF16: 2.0**-8, jnp.float16: 2.0**-11}  # unit roundoff


@pytest.mark.parametrize("n", [4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("gather", ["native", "ring"])
@pytest.mark.parametrize("randomize", [True, False])
def test_each_element_sums_n_minus_k_ranks(n, gather, randomize):
    # Partial sums of 2**r stay below 256: exact in bfloat16, so the bits of
    # every element name its contributors, as on a float32 wire.
    x = bit_inputs(n, 1000)
    for k in range(n):
        def f(v, k=k):
            kw = dict(key=jax.random.key(k), num_skip=k, randomize=randomize)
            return (sr.skip_psum(v, "i", gather=gather, comm_dtype=BF16, **kw),
                    sr.contribution_mask(v, "i", **kw))

        out, mask = per_rank(f, x, n=n)
        assert out.dtype == np.float32
        assert np.all(popcount(out) == n - k), (n, k)
        np.testing.assert_array_equal(out, out[:1].repeat(n, 0))
        for r in range(n):
            np.testing.assert_array_equal((out[0].astype(np.int64) >> r) & 1,
                                          mask[r].astype(np.int64))


@pytest.mark.parametrize("comm", [BF16, jnp.float16])
@pytest.mark.parametrize("check_vma", [True, False])
def test_within_rounding_of_the_float32_sum_and_bit_identical(comm, check_vma):
    n, k = 8, 3
    rng = np.random.default_rng(0)
    tree = {"w": rng.normal(size=(n, 37, 29)).astype(np.float32),
            "b": rng.normal(size=(n, 513)).astype(np.float32),
            "s": rng.normal(size=(n,)).astype(np.float32)}

    def f(t):
        kw = dict(key=jax.random.key(5), num_skip=k, bucket_bytes=4 * 2048)
        return (sr.skip_psum(t, "i", comm_dtype=comm, **kw),
                sr.contribution_mask(t, "i", **kw),
                sr.ring_psum(t, "i", comm_dtype=comm),
                sr.skip_pmean(t, "i", comm_dtype=comm, **kw))

    got, mask, ring, mean = per_rank(f, tree, n=n, check_vma=check_vma)
    for name, x in tree.items():
        kept = np.where(mask[name], x, 0).astype(np.float64)
        for out, want, scale in ((got[name], kept.sum(0), 1),
                                 (ring[name], x.sum(0, dtype=np.float64), 1),
                                 (mean[name], kept.sum(0) / (n - k), n - k)):
            np.testing.assert_array_equal(out, out[:1].repeat(n, 0))
            # n - 1 roundings of partial sums, one of the result.
            bound = n * EPS[comm] * np.abs(x).sum(0) / scale
            assert np.all(np.abs(out[0] - want) <= bound), name
            assert not np.array_equal(out[0], want.astype(np.float32))


@pytest.mark.parametrize("randomize", [True, False])
def test_psum_scatter_within_rounding(randomize):
    n, k = 8, 2
    x = np.random.default_rng(1).normal(size=(n, 64, 5)).astype(np.float32)

    def f(v):
        kw = dict(key=jax.random.key(2), num_skip=k, randomize=randomize)
        return (sr.skip_psum_scatter(v, "i", comm_dtype=BF16, **kw),
                sr.skip_psum_scatter(v, "i", **kw))

    got, want = per_rank(f, x, n=n)
    assert got.dtype == np.float32
    bound = n * EPS[BF16] * np.abs(x).sum(0).reshape(got.shape)
    assert np.all(np.abs(got - want) <= bound)
    assert not np.array_equal(got, want)


def test_per_hop_float32_beats_cast_then_reduce_under_cancellation():
    # Large values that cancel across ranks, plus small ones below their
    # bfloat16 spacing: cast-then-reduce rounds every small part away, the
    # ring only those of partial sums that are large at that hop.
    n, size = 8, 4096
    rng = np.random.default_rng(3)
    big = 1000.0 * np.where(np.arange(n) % 2, -1.0, 1.0)[:, None]
    small = rng.uniform(0.5, 1.5, size=(n, size))
    x = (big + small).astype(np.float32)
    exact = x.astype(np.float64).sum(0)

    def f(v):
        return (sr.ring_psum(v, "i", comm_dtype=BF16),
                lax.psum(v.astype(BF16), "i").astype(jnp.float32))

    ring, naive = per_rank(f, x, n=n)
    ring_err, naive_err = (np.abs(o[0] - exact).mean() for o in (ring, naive))
    assert ring_err < 0.75 * naive_err, (ring_err, naive_err)


def _compiled_text(fn, n, size):
    mesh = line_mesh(n)
    x = jax.ShapeDtypeStruct((n * size,), jnp.float32,
                             sharding=NamedSharding(mesh, P("i")))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return jax.jit(f).lower(x).compile().as_text()


@pytest.mark.parametrize("gather", ["native", "ring"])
def test_compiled_cpu_program_sends_half_the_bytes(gather):
    n, size = 8, 4096
    for k in (0, 3, 7):
        text = _compiled_text(lambda v, k=k: sr.skip_psum(
            v, "i", key=jax.random.key(0), num_skip=k, chunks_per_rank=4,
            gather=gather, comm_dtype=BF16), n, size)
        traffic = sr.collective_traffic(text)
        assert traffic.bytes_per_device() == skipreduce_bytes(2 * size, n, k)
        # The 16-bit values cross as uint32 words (XLA:CPU would widen bf16).
        assert "u32[" in text and "bf16[" in text
    scatter = sr.collective_traffic(_compiled_text(lambda v: sr.skip_psum_scatter(
        v, "i", key=jax.random.key(0), num_skip=2, comm_dtype=BF16), n, size))
    assert scatter.bytes_per_device() == reduce_scatter_bytes(2 * size, n, 2)


def test_odd_pieces_are_padded_and_come_back_exact():
    n = 4
    x = bit_inputs(n, 3 * n)  # pieces of 3 elements: one word of padding
    out = per_rank(lambda v: sr.skip_psum(v, "i", key=None, num_skip=1,
                                          randomize=False, chunks_per_rank=1,
                                          comm_dtype=BF16), x, n=n)
    assert np.all(popcount(out) == n - 1)


@pytest.mark.parametrize("comm", [BF16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_derivatives_are_those_of_the_kept_sum(comm):
    n, k = 4, 2
    rng = np.random.default_rng(7)
    x, w = (rng.normal(size=(n, 3000)).astype(np.float32) for _ in range(2))

    def f(args):
        v, w = args
        kw = dict(key=jax.random.key(11), num_skip=k)
        mask = sr.contribution_mask(v, "i", **kw)

        def skip(v):
            return sr.skip_psum(v, "i", comm_dtype=comm, **kw)

        grad = jax.grad(lambda v: jnp.sum(w * skip(v)))(v)
        tangent = jax.jvp(skip, (v,), (w,))[1]
        return grad, tangent, mask, lax.psum(w, "i")

    grad, tangent, mask, w_sum = per_rank(f, (x, w), n=n)
    # d/dv_r sum_j w_j * psum(v * mask)_j = mask_r * psum(w). A 16-bit
    # tangent crosses in 16 bits; float8's crosses unrounded, in float32.
    tol = 1e-5 if jnp.dtype(comm).itemsize == 1 else 2e-2
    np.testing.assert_allclose(grad, np.where(mask, w_sum, 0), rtol=tol, atol=tol)
    kept = np.where(mask, w, 0).sum(0)
    np.testing.assert_allclose(tangent[0], kept, rtol=tol, atol=tol)


def _reduce_step(n, grads, **kw):
    tx = sr.skip_reduce("i", seed=0, min_size=0, **kw)

    def f(g):
        state = tx.init(g)
        out, _ = tx.update(g, state)
        return out

    return per_rank(f, grads, n=n)


def test_skip_reduce_passes_it_and_comm_stats_counts_it():
    n, k = 8, 4
    rng = np.random.default_rng(4)
    grads = {"w": rng.normal(size=(n, 64, 64)).astype(np.float32)}
    wide = _reduce_step(n, grads, num_skip=k)
    narrow = _reduce_step(n, grads, num_skip=k, comm_dtype=BF16)
    np.testing.assert_array_equal(narrow["w"], narrow["w"][:1].repeat(n, 0))
    np.testing.assert_allclose(narrow["w"], wide["w"], atol=n * EPS[BF16] * 4)
    assert not np.array_equal(narrow["w"], wide["w"])
    like = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}
    stats = sr.comm_stats(like, n, num_skip=k, min_size=0, comm_dtype=BF16)
    full = sr.comm_stats(like, n, num_skip=k, min_size=0)
    assert stats.bytes_per_device == skipreduce_bytes(2 * 64 * 64, n, k)
    assert stats.bytes_per_device == full.bytes_per_device / 2
    assert stats.ratio == pytest.approx((2 * (n - 1) - k) / (4 * (n - 1)))


@pytest.mark.parametrize("comm", [BF16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("leaf", [(128, 96), (70592,)])  # rows of 256; of about 260
def test_comm_stats_equals_the_compiled_step(comm, leaf):
    n, k = 8, 4
    shape = (n, *leaf)
    tx = sr.skip_reduce("i", num_skip=k, seed=0, min_size=0, comm_dtype=comm)
    mesh = line_mesh(n)

    def f(g):
        out, _ = tx.update(g[0], tx.init(g[0]))
        return out[None]

    spec = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("i")))
    text = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
                   ).lower(spec).compile().as_text()
    like = jax.ShapeDtypeStruct(shape[1:], jnp.float32)
    stats = sr.comm_stats(like, n, num_skip=k, min_size=0, comm_dtype=comm)
    assert sr.collective_traffic(text).bytes_per_device() == stats.bytes_per_device
    wide = sr.comm_stats(like, n, num_skip=k, min_size=0).bytes_per_device
    if jnp.dtype(comm).itemsize == 1:  # a byte per element, a 4-byte scale per block
        assert wide / 4 < stats.bytes_per_device < wide / 4 * 1.05
    else:
        assert stats.bytes_per_device == wide / 2


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(comm_dtype=jnp.int16), TypeError,
     r"skip_psum: comm_dtype=.*int16.* is not a floating-point dtype"),
    (dict(comm_dtype="bf17"), TypeError, r"comm_dtype='bf17' is not a dtype"),
])
def test_bad_comm_dtype_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        per_rank(lambda v: sr.skip_psum(v, "i", key=None, num_skip=0, **kwargs),
                 np.ones((4, 8), np.float32), n=4)


def test_comm_dtype_wider_than_the_gradient_is_refused():
    x = np.ones((4, 8), BF16)
    with pytest.raises(TypeError, match=r"skip_psum: comm_dtype=float32 is wider "
                       r"than a gradient leaf of dtype bfloat16.*accumulate_dtype"):
        per_rank(lambda v: sr.skip_psum(v, "i", key=None, num_skip=0,
                                        comm_dtype=jnp.float32), x, n=4)
    with pytest.raises(TypeError, match=r"skip_reduce: comm_dtype=.*int8"):
        sr.skip_reduce("i", num_skip=1, comm_dtype=jnp.int8)
    with pytest.raises(TypeError, match=r"comm_stats: comm_dtype=float32 is wider"):
        sr.comm_stats({"w": jax.ShapeDtypeStruct((512, 512), BF16)}, 8,
                      num_skip=2, min_size=0, comm_dtype=jnp.float32)


def test_bfloat16_gradients_added_in_float32_send_bfloat16():
    # accumulate_dtype=float32 alone sends float32 in the reduce-scatter;
    # with comm_dtype=bfloat16 each hop still adds in float32 but sends 16 bits.
    n, size = 4, 1024
    mesh = line_mesh(n)
    x = jax.ShapeDtypeStruct((n * size,), BF16, sharding=NamedSharding(mesh, P("i")))

    def sent(**kw):
        f = jax.shard_map(lambda v: sr.skip_psum(
            v, "i", key=None, num_skip=1, randomize=False, chunks_per_rank=1,
            accumulate_dtype=jnp.float32, **kw), mesh=mesh, in_specs=P("i"),
            out_specs=P("i"))
        text = jax.jit(f).lower(x).compile().as_text()
        return sr.collective_traffic(text).bytes_per_device("collective-permute")

    assert sent() == (n - 2) * size // n * 4
    assert sent(comm_dtype=BF16) == (n - 2) * size // n * 2
    xs = np.random.default_rng(9).normal(size=(n, 2048)).astype(BF16)
    got = per_rank(lambda v: sr.skip_psum(v, "i", key=None, num_skip=0,
                                          comm_dtype=BF16), xs, n=n)
    exact = xs.astype(np.float64).sum(0)
    bound = n * EPS[BF16] * np.abs(xs.astype(np.float64)).sum(0)
    assert got.dtype == BF16 and np.all(np.abs(got[0] - exact) <= bound)


@pytest.mark.parametrize("randomize", [True, False])
def test_inner_axis_sums_whole_hosts(randomize):
    # The inner axis is summed in float32, the outer ring sends bfloat16;
    # sums of distinct powers of two below 256 are exact in both.
    hosts, local, size = 4, 2, 1000
    mesh = jax.make_mesh((hosts, local), ("host", "local"))
    bits = 2.0 ** np.arange(hosts * local).reshape(hosts, local, 1)
    x = jax.device_put(np.broadcast_to(bits, (hosts, local, size)).astype(np.float32),
                       NamedSharding(mesh, P("host", "local")))
    for k in range(hosts):
        def fn(v, k=k):
            return sr.skip_psum(v[0, 0], "host", key=jax.random.key(k), num_skip=k,
                                randomize=randomize, inner_axis="local",
                                comm_dtype=BF16)[None, None]

        f = jax.shard_map(fn, mesh=mesh, in_specs=P("host", "local"),
                          out_specs=P("host", "local"))
        sums = np.asarray(jax.jit(f)(x)).astype(np.int64)
        assert np.all(sums == sums[:1, :1])
        per_host = np.stack([(sums[0, 0] >> (h * local)) & 3 for h in range(hosts)])
        assert np.all((per_host == 0) | (per_host == 3))
        assert np.all((per_host == 3).sum(0) == hosts - k)


# -- the float16 wire's overflow rule ------------------------------------------------

def _overflowing(n=8, size=512, value=2e4):
    """``value`` per rank in the first 64 elements, 1 elsewhere.

    2e4: the ring's partial sums of 4 ranks or more pass float16's 65504.
    """
    x = np.ones((n, size), np.float32)
    x[:, :64] = value
    return x


@pytest.mark.parametrize("gather", ["native", "ring"])
def test_float16_overflow_makes_the_whole_sum_nan_on_every_rank(gather):
    x = _overflowing()

    def f(v, comm):
        kw = dict(key=jax.random.key(0), gather=gather, comm_dtype=comm)
        return (sr.ring_psum(v, "i", gather=gather, comm_dtype=comm),
                sr.skip_psum(v, "i", num_skip=3, **kw),
                sr.skip_pmean(v, "i", num_skip=3, **kw))

    for out in per_rank(lambda v: f(v, jnp.float16), x, n=8):
        assert np.isnan(out).all()  # not Inf in the first 64 elements only
    ring, skipped, mean = per_rank(lambda v: f(v, BF16), x, n=8)
    np.testing.assert_allclose(ring[:, :64], 16e4, rtol=8 * EPS[BF16])
    np.testing.assert_array_equal(ring[:, 64:], 8.0)
    assert np.isfinite(skipped).all() and np.isfinite(mean).all()


@pytest.mark.parametrize("randomize", [True, False])
def test_float16_overflow_in_one_block_makes_every_rank_block_nan(randomize):
    # Only block 0 (rows 0..7) overflows; every rank's block comes back NaN.
    x = np.ones((8, 64, 4), np.float32)
    x[:, :8] = 2e4 if not randomize else 7e4  # Random sends single pieces

    def f(v, comm):
        return sr.skip_psum_scatter(v, "i", key=jax.random.key(1),
                                    num_skip=0 if not randomize else 2,
                                    randomize=randomize, comm_dtype=comm)

    assert np.isnan(per_rank(lambda v: f(v, jnp.float16), x, n=8)).all()
    assert np.isfinite(per_rank(lambda v: f(v, BF16), x, n=8)).all()


def test_skip_reduce_on_an_overflowing_float16_wire():
    x = _overflowing(value=3e4)  # k = 4: partial sums of 3 ranks are sent
    params = np.zeros(512, np.float32)

    def f(g, params, comm, check_finite):
        tx = sr.skip_reduce("i", num_skip=4, min_size=100, comm_dtype=comm,
                            check_finite=check_finite)
        guarded = optax.chain(tx, optax.apply_if_finite(optax.sgd(1.0), 3))
        updates, state = guarded.update(
            {"w": g, "b": g[:8]}, guarded.init({"w": params, "b": params[:8]}))
        return (tx.update({"w": g, "b": g[:8]},
                          tx.init({"w": params, "b": params[:8]}))[0],
                updates, state[1].notfinite_count)

    # The skipped leaf is NaN everywhere, "b" (full all-reduce) as without
    # a wire; check_finite makes every element NaN; apply_if_finite skips
    # the step on every rank and counts it.
    for check_finite in (False, True):
        out, skipped, bad = per_rank(
            lambda g, p, c=check_finite: f(g, p, jnp.float16, c), x, n=8,
            replicated_args=(params,))
        assert np.isnan(out["w"]).all()
        assert np.isnan(out["b"]).all() == check_finite
        np.testing.assert_array_equal(skipped["w"], 0.0)
        assert (bad == 1).all()
    out, _, bad = per_rank(lambda g, p: f(g, p, BF16, True), x, n=8,
                           replicated_args=(params,))
    assert np.isfinite(out["w"]).all() and (bad == 0).all()


F8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
# Each hop rounds a block to float8 once, relative to the block's largest
# magnitude: 2**-4 (e4m3fn) or 2**-3 (e5m2) at most, half that on average.
F8_EPS = {jnp.float8_e4m3fn: 2.0**-4, jnp.float8_e5m2: 2.0**-3}


@pytest.mark.parametrize("comm", F8)
@pytest.mark.parametrize("gather", ["native", "ring"])
def test_float8_wire_scales_blocks_so_small_gradients_survive(comm, gather):
    # Gradients of 1e-4 are below float8_e4m3fn's smallest value (2**-9):
    # cast unscaled, they would all cross as zero.
    n, k = 8, 3
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(n, 5000)) * 1e-4).astype(np.float32)

    def f(v):
        kw = dict(key=jax.random.key(1), num_skip=k)
        return (sr.skip_psum(v, "i", comm_dtype=comm, gather=gather, **kw),
                sr.contribution_mask(v, "i", **kw))

    out, mask = per_rank(f, x, n=n)
    np.testing.assert_array_equal(out, out[:1].repeat(n, 0))
    exact = np.where(mask, x, 0).sum(0)
    err = np.abs(out[0] - exact)
    rel = np.linalg.norm(err) / np.linalg.norm(exact)
    assert rel < F8_EPS[comm], rel
    # Each element within the rounding of its N - k hops and the gather,
    # against the largest partial sum of its block.
    bound = (n - k + 1) * F8_EPS[comm] * np.abs(x).sum(0).max()
    assert err.max() < bound


def test_float8_wire_in_the_reduce_scatter():
    n, k = 8, 2
    rng = np.random.default_rng(3)
    x = rng.normal(size=(n, 64 * n)).astype(np.float32)
    scatter = per_rank(lambda v: sr.skip_psum_scatter(
        v, "i", key=jax.random.key(0), num_skip=k, comm_dtype=jnp.float8_e4m3fn), x, n=n)
    wide = per_rank(lambda v: sr.skip_psum_scatter(
        v, "i", key=jax.random.key(0), num_skip=k), x, n=n)
    rel = np.linalg.norm(scatter - wide) / np.linalg.norm(wide)
    assert 0 < rel < 2.0**-4, rel
