"""skip_psum_scatter: each rank's own block, summed over exactly N - k ranks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import line_mesh
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr


def _run(fn, x, n, *extra):
    """fn(x[r], *extra) on rank r; outputs stacked per rank."""
    mesh = line_mesh(n)
    xs = jax.device_put(x, NamedSharding(mesh, P("i")))
    f = jax.jit(jax.shard_map(
        lambda v, *e: jax.tree_util.tree_map(lambda a: a[None], fn(v[0], *e)),
        mesh=mesh, in_specs=(P("i"),) + (P(),) * len(extra), out_specs=P("i")))
    return f, (xs,) + extra


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_num_skip_zero_equals_psum_scatter(n, dtype):
    x = np.random.default_rng(n).integers(-50, 50, size=(n, 3 * n, 5)).astype(dtype)
    f, args = _run(lambda v: sr.skip_psum_scatter(v, "i", key=None, num_skip=0), x, n)
    ref, _ = _run(lambda v: lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True),
                  x, n)
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(ref(*args)))


@pytest.mark.parametrize("randomize", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_every_block_sums_exactly_its_contributors(randomize, k):
    n, rows = 8, 13  # 13 rows: padded to 16, two rows per block
    x = np.random.default_rng(k).normal(size=(n, rows, 6)).astype(np.float32)
    tree = {"w": x, "b": x[:, :, 0]}

    def fn(v, key):
        out = sr.skip_psum_scatter(v, "i", key=key, num_skip=k, randomize=randomize)
        mask = sr.scatter_contribution_mask(v, "i", key=key, num_skip=k,
                                            randomize=randomize)
        return out, mask

    mesh = line_mesh(n)
    xs = jax.tree_util.tree_map(lambda a: jax.device_put(a, NamedSharding(mesh, P("i"))),
                                tree)
    f = jax.jit(jax.shard_map(
        lambda v, key: jax.tree_util.tree_map(
            lambda a: a[None], fn(jax.tree_util.tree_map(lambda a: a[0], v), key)),
        mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i")))
    for seed in range(3):
        out, mask = jax.tree_util.tree_map(np.asarray, f(xs, jax.random.key(seed)))
        for name in ("w", "b"):
            m = mask[name]                          # [rank, rows, ...]
            counts = m.sum(0)
            assert np.all(counts == n - k)
            want = np.where(m, tree[name], 0).sum(0)  # summed over contributors
            padded = np.concatenate([want, np.zeros((16 - rows,) + want.shape[1:])])
            np.testing.assert_allclose(out[name].reshape(padded.shape), padded,
                                       rtol=1e-5, atol=1e-5)
            for r in range(n):  # each owner always sums itself
                assert m[r, 2 * r: 2 * r + 2].all()


def test_static_ignores_the_key_and_random_is_uniform():
    n, k, keys = 8, 3, 300
    x = jnp.zeros((n, n, 1))

    def mask_of(v, key, randomize):
        return sr.scatter_contribution_mask(v, "i", key=key, num_skip=k,
                                            randomize=randomize)

    def masks(randomize):
        f, args = _run(lambda v, key: mask_of(v, key, randomize), np.zeros((n, n, 1)),
                       n, jax.random.key(0))
        return np.stack([np.asarray(f(args[0], jax.random.key(s)))[:, :, 0]
                         for s in range(keys)])  # [key, rank, block]

    static = masks(False)
    assert (static == static[0]).all()
    rand = masks(True)
    left_out = 1 - rand.mean(0)                 # [rank, block]
    own = np.eye(n, dtype=bool)
    assert np.all(left_out[own] == 0)
    # Each other rank is left out with probability k / (N - 1) = 3/7.
    sd = np.sqrt(3 / 7 * 4 / 7 / keys)
    assert np.all(np.abs(left_out[~own] - k / (n - 1)) < 5 * sd)
    del x


@pytest.mark.parametrize("randomize", [False, True])
def test_traffic_and_one_program_for_every_key(randomize):
    n, size = 8, 1000
    mesh = line_mesh(n)

    def fn(v, key):
        return sr.skip_psum_scatter(v, "i", key=key, num_skip=3, randomize=randomize)

    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("i"), P()),
                              out_specs=P("i")))
    x = jax.ShapeDtypeStruct((n * size,), jnp.float32,
                             sharding=NamedSharding(mesh, P("i")))
    texts = {f.lower(x, jax.random.key(s)).compile().as_text() for s in (0, 1)}
    assert len(texts) == 1  # the key is data: one program
    traffic = sr.collective_traffic(texts.pop())
    assert traffic.count("all-reduce") == traffic.count("reduce-scatter") == 0
    padded = -(-size // n) * n * 4
    assert traffic.bytes_per_device() == pytest.approx((n - 1 - 3) / n * padded)


def test_bad_input():
    n = 4
    f, args = _run(lambda v: sr.skip_psum_scatter(v, "i", key=None, num_skip=4),
                   np.zeros((n, 4)), n)
    with pytest.raises(ValueError, match=r"num_skip=4 is outside \[0, 3\]"):
        f(*args)
    f, args = _run(lambda v: sr.skip_psum_scatter(v[0], "i", key=None, num_skip=0),
                   np.zeros((n, 4)), n)
    with pytest.raises(ValueError, match="scalar leaf"):
        f(*args)
