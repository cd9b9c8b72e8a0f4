"""Bucket planning, packing and unpacking (``_ring/buckets.py``)."""

import jax
import jax.numpy as jnp
import numpy as np

from skipreduce_jax._ring.buckets import OWN_BUCKET_FRACTION, plan_buckets


def _tree(sizes, dtype=np.float32):
    rng = np.random.default_rng(0)
    return {f"l{i}": rng.normal(size=s).astype(dtype) for i, s in enumerate(sizes)}


def _leaf_groups(plan):
    return [list(b.leaf_indices) for b in plan.buckets]


def test_large_leaf_gets_its_own_bucket_and_small_ones_share():
    cap = 4000
    big = int(cap * OWN_BUCKET_FRACTION) // 4  # exactly at the threshold
    tree = _tree([(10,), (big,), (7, 3), (big - 1,)])
    plan = plan_buckets(tree, group_size=4, bucket_bytes=cap)
    # Leaves 0, 2 and 3 (under the threshold) share; leaf 1 is alone.
    assert sorted(_leaf_groups(plan)) == [[0, 2, 3], [1]]


def test_own_bucket_is_packed_without_a_copy():
    tree = _tree([(16,), (64, 32)])
    plan = plan_buckets(tree, group_size=4, bucket_bytes=4 * 64 * 32)
    leaves = jax.tree_util.tree_leaves(tree)
    own = next(b for b in plan.buckets if b.leaf_indices == (1,))
    ops = {e.primitive.name for e in
           jax.make_jaxpr(lambda *ls: plan.pack(ls, own))(*leaves).eqns}
    assert ops <= {"reshape"}, ops


def test_pack_unpack_round_trip_keeps_every_leaf_in_place():
    tree = {**_tree([(3, 5), (300,), (1,), (40, 2)]),
            "half": np.arange(17, dtype=np.float16)}
    for cap in (64, 1024, 10**6):
        plan = plan_buckets(tree, group_size=4, bucket_bytes=cap)
        leaves = jax.tree_util.tree_leaves(tree)
        buffers = [plan.pack(leaves, b) for b in plan.buckets]
        for b, buf in zip(plan.buckets, buffers):
            assert buf.shape == (b.padded_size,) and buf.dtype == b.dtype
            assert b.padded_size % (4 * b.chunks_per_rank) == 0
            # The padding is zero.
            assert not np.any(np.asarray(buf[b.size:]))
        back = plan.unpack(buffers, fill=lambda i: jnp.zeros(plan.shapes[i],
                                                             plan.dtypes[i]))
        jax.tree_util.tree_map(np.testing.assert_array_equal, back, tree)


def test_zero_size_leaves_are_not_packed():
    tree = {"a": np.zeros((0, 3), np.float32), "b": np.ones(5, np.float32)}
    plan = plan_buckets(tree, group_size=2)
    assert _leaf_groups(plan) == [[1]]
