"""layout="units": kernels packed output unit first, the ring unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank, popcount
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._ring.buckets import plan_buckets

N = 8
# A Dense-like tree: kernels [in, out], a bias, a conv kernel [h, w, in, out].
SHAPES = {"b": (48,), "k": (40, 48), "conv": (3, 3, 4, 24)}


def _tree(seed=0):
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(np.float32)
            for name, shape in SHAPES.items()}


def _per_rank_bits():
    """Rank r holds 2**r in every element: a sum's bits name its ranks."""
    return {name: np.broadcast_to((2.0 ** np.arange(N)).reshape(
        (N,) + (1,) * len(shape)), (N,) + shape).astype(np.float32)
        for name, shape in SHAPES.items()}


def test_units_layout_packs_the_last_axis_first_and_round_trips():
    tree = _tree()
    flat = plan_buckets(tree, group_size=N, chunks_per_rank=1)
    units = plan_buckets(tree, group_size=N, chunks_per_rank=1, layout="units")
    assert [(b.size, b.padded_size) for b in units.buckets] == [
        (b.size, b.padded_size) for b in flat.buckets]
    leaves = jax.tree_util.tree_leaves(tree)
    for bucket in units.buckets:
        buffer = np.asarray(units.pack(leaves, bucket))
        start = 0
        for i in bucket.leaf_indices:
            leaf = leaves[i]
            run = buffer[start:start + leaf.size]
            want = np.moveaxis(leaf, -1, 0).ravel() if leaf.ndim >= 2 else leaf
            np.testing.assert_array_equal(run, want)
            start += leaf.size
    back = units.unpack([units.pack(leaves, b) for b in units.buckets],
                        fill=lambda i: None)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, tree)


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match=r"layout='rows' must be 'flat'.*or 'units'"):
        plan_buckets(_tree(), group_size=N, layout="rows")
    with pytest.raises(ValueError, match=r"skip_reduce: layout='rows'"):
        sr.skip_reduce("data", num_skip=1, layout="rows")


def test_num_skip_zero_equals_pmean_exactly():
    grads = {k: np.stack([_tree(r)[k] for r in range(N)]) for k in SHAPES}
    tx = optax.chain(sr.skip_reduce("i", num_skip=0, min_size=0, layout="units"),
                     optax.sgd(1.0))

    def f(g):
        out = tx.update(g, tx.init(g))[0]
        return out, jax.tree_util.tree_map(lambda x: -lax.pmean(x, "i"), g)

    out, ref = per_rank(f, grads, n=N)
    jax.tree_util.tree_map(np.testing.assert_array_equal, out, ref)


@pytest.mark.parametrize("layout", ["flat", "units"])
def test_one_output_unit_drops_the_same_ranks_with_units(layout):
    # Whole slots (chunks_per_rank=1): 8 slots of ~1/8 of the buffer. With
    # "units" an output unit's weights are contiguous, so at most the units
    # on the 7 slot edges see two sets of ranks; in the flat layout a
    # unit's weights are strided over the rows and cross every slot.
    def f(g):
        return sr.skip_psum(g, "i", key=jax.random.key(3), num_skip=4,
                            chunks_per_rank=1, layout=layout)

    out = per_rank(f, _per_rank_bits(), n=N)
    for name in ("k", "conv"):
        sums = np.rint(out[name][0]).astype(np.int64)
        assert (popcount(sums) == N - 4).all()
        units = sums.reshape(-1, sums.shape[-1])
        sets = [len(np.unique(units[:, j])) for j in range(units.shape[1])]
        split = sum(s > 1 for s in sets)
        if layout == "units":
            assert max(sets) <= 2 and split <= N - 1, sets
        else:
            assert split > N - 1, sets


def test_mask_left_out_and_error_feedback_follow_the_layout():
    key = jax.random.key(5)
    grads = {k: np.stack([_tree(r)[k] for r in range(N)]) for k in SHAPES}

    def f(g):
        kw = dict(key=key, num_skip=3, chunks_per_rank=2, layout="units")
        mean, left = sr.skip_pmean_and_left_out(g, "i", **kw)
        mask = sr.contribution_mask(g, "i", **kw)
        want = jax.tree_util.tree_map(
            lambda x, m: lax.psum(jnp.where(m, x, 0), "i") / (N - 3), g, mask)
        return mean, left, mask, want, g

    mean, left, mask, want, g = per_rank(f, grads, n=N)
    for name in SHAPES:
        np.testing.assert_allclose(mean[name], want[name], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(left[name], np.where(mask[name], 0, g[name]))
        # Every element sums N - k ranks.
        assert (mask[name].sum(0) == N - 3).all()


def test_units_layout_sends_the_same_bytes():
    mesh = jax.make_mesh((N,), ("data",))
    shapes = {"k": (256, 512), "b": (512,)}
    grads = {k: jax.ShapeDtypeStruct((N,) + s, jnp.float32,
                                     sharding=NamedSharding(mesh, P("data")))
             for k, s in shapes.items()}
    sent = {}
    for layout in ("flat", "units"):
        tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, layout=layout)
        state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})

        def f(g, state, tx=tx):
            return tx.update(jax.tree_util.tree_map(lambda x: x[0], g), state)[0]

        step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()),
                                     out_specs=P(), check_vma=False))
        text = step.lower(grads, state).compile().as_text()
        sent[layout] = sr.collective_traffic(text).bytes_per_device()
    assert sent["units"] == sent["flat"] > 0
    stats = {layout: sr.comm_stats(
        {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}, N,
        skip_ratio=0.5, min_size=0, layout=layout) for layout in ("flat", "units")}
    assert stats["units"] == stats["flat"]


def test_the_layout_is_part_of_the_settings_fingerprint():
    def fingerprint(**kw):
        tx = sr.skip_reduce("data", num_skip=1, **kw)
        return int(tx.init({"w": jnp.zeros(3)}).fingerprint)

    assert fingerprint(layout="flat") == fingerprint()
    assert fingerprint(layout="units") != fingerprint()
