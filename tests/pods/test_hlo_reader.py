"""The pod helper's HLO reader on hand-written HLO, and its model (no pods extra
needed)."""
# ruff: noqa: E501 -- lines of HLO text are long

import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks import pods  # noqa: E402

NODE_PAIRS = [[i, i + 8] for i in range(8)]


@pytest.mark.parametrize("text, groups", [
    ("replica_groups={{0,8},{1,9}}, dimensions", [[0, 8], [1, 9]]),
    ("replica_groups=[2,8]<=[16], to_apply", [list(range(8)), list(range(8, 16))]),
    ("replica_groups=[8,2]<=[2,8]T(1,0), to_apply", NODE_PAIRS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0'}, x", NODE_PAIRS),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}, x",
     [list(range(8)), list(range(8, 16))]),
    ("replica_groups=mesh['axis_0'=16,'axis_1'=1] {'axis_0'}, x", [list(range(16))]),
    # Axes over devices in another order: an iota (XLA's FSDP step on GPUs), a list.
    ("replica_groups=mesh['axis_0'=8,'axis_1'=2,'axis_2'=1], device_ids=([2,8]T(1,0)) "
     "{'axis_1'}, dimensions={1}", NODE_PAIRS),
    ("replica_groups=mesh['a'=2,'b'=2], device_ids=(0,2,1,3) {'a'}, x", [[0, 1], [2, 3]]),
    ("source_target_pairs={{0,8},{8,0}}, x", [[0, 8], [8, 0]]),
    ("replica_groups={}, to_apply", [list(range(16))]),
])
def test_replica_group_formats(text, groups):
    assert pods.replica_groups(text, 16) == groups


def test_unknown_replica_group_format_is_refused():
    with pytest.raises(ValueError, match="does not know"):
        pods.replica_groups("replica_groups=mesh['a':(1)2] {'a'}, x", 16)


_SEND = ('is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
         '"xla_megascale_runtime",_xla_host_transfer_rendezvous="%s",'
         '_xla_megascale_target="{1,2,3,4}x{0:15}",_xla_megascale_transfer_type="%s"}')
HLO = f"""HloModule m, is_scheduled=true, num_partitions=16

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {{
  %p = (s32[], f32[256]{{0}}) parameter(0)
  %x = f32[256]{{0}} get-tuple-element(%p), index=1
  %a = token[] after-all()
  %send = (f32[256]{{0}}, u32[], token[]) send(%x, %a), channel_id=1, {_SEND % ("g", "ALL_GATHER")}
  %recv = (f32[1024]{{0}}, u32[], token[]) recv(%a), channel_id=2, {_SEND % ("g", "ALL_GATHER")}
  %fusion.1 = f32[256]{{0}} fusion(%x), kind=kLoop, calls=%f, metadata={{op_name="jit(s)/transpose(jvp())/mul"}}
  %send-done = token[] send-done(%send), channel_id=1
  %recv-done = (f32[1024]{{0}}, token[]) recv-done(%recv), channel_id=2
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[256]{{0}}) tuple(%i, %fusion.1)
}}

ENTRY %main (x: f32[1024,8]) -> f32[1024,8] {{
  %x = f32[1024,8]{{1,0}} parameter(0)
  %all-reduce-start = f32[1024,8]{{1,0}} all-reduce-start(%x), channel_id=3, replica_groups={{{{0,8}},{{1,9}}}}, to_apply=%add, backend_config={{"collective_backend_config":{{"is_sync":false}}}}
  %gemm_fusion_dot.1 = f32[1024,8]{{1,0}} fusion(%x), kind=kCustom, calls=%g, metadata={{op_name="jit(s)/transpose(jvp())/dot_general"}}
  %small = f32[] fusion(%x), kind=kLoop, calls=%h
  %all-reduce-done = f32[1024,8]{{1,0}} all-reduce-done(%all-reduce-start)
  %all-gather = f32[1024,64]{{1,0}} all-gather(%all-reduce-done), replica_groups=[2,8]<=[16], dimensions={{1}}
  %w = (s32[], f32[256]{{0}}) while(%init), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %r = f32[1024,8]{{1,0}} add(%gemm_fusion_dot.1, %x)
}}
"""


@pytest.fixture(scope="module")
def found():
    nodes = [d // 8 for d in range(16)]
    return {c.name: c for c in pods.collectives(HLO, nodes)}


def test_async_all_reduce_over_nodes_and_what_overlaps_it(found):
    reduce = found["all-reduce-start"]
    assert (reduce.kind, reduce.slow, reduce.asynchronous, reduce.is_sync) == (
        "all-reduce", True, True, False)
    assert reduce.bytes_per_device == 1024 * 8 * 4  # 2 (g - 1) / g with g = 2
    # The scalar fusion is bookkeeping, not compute.
    assert [(i.name, i.matmul, i.phase) for i in reduce.overlap] == [
        ("gemm_fusion_dot.1", True, "backward")]


def test_synchronous_all_gather_within_a_node(found):
    gather = found["all-gather"]
    assert (gather.slow, gather.asynchronous, gather.group_size) == (False, False, 8)
    assert gather.bytes_per_device == 1024 * 64 * 4 * 7 / 8


def test_dcn_all_gather_in_a_loop_counts_every_trip(found):
    send = found["send"]
    assert (send.kind, send.slow, send.asynchronous, send.count) == (
        "dcn-all_gather", True, True, 3)
    assert send.bytes_per_device == 3 * 256 * 4 * 3  # to 3 slices, 3 trips
    assert [i.name for i in send.overlap] == ["fusion.1"]


def test_slow_bytes_adds_the_ops_that_cross_nodes(found):
    assert pods.slow_bytes(found.values()) == (
        found["all-reduce-start"].bytes_per_device + found["send"].bytes_per_device)


_BRANCHY = """HloModule c, is_scheduled=true, num_partitions=16

%whole (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  ROOT %cp.whole = f32[64]{0} collective-permute(%p), source_target_pairs={{0,8},{8,0}}
}

%half (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %s = f32[32]{0} slice(%p), slice={[0:32]}
  %cp.half = f32[32]{0} collective-permute(%s), source_target_pairs={{0,8},{8,0}}
  ROOT %c = f32[64]{0} concatenate(%cp.half, %cp.half), dimensions={0}
}

ENTRY %main (i: s32[], x: f32[64]) -> f32[64] {
  %i = s32[] parameter(0)
  %x = f32[64]{0} parameter(1)
  ROOT %cond = f32[64]{0} conditional(%i, %x, %x), BRANCHES
}
"""


@pytest.mark.parametrize("branches", [
    "branch_computations={%half, %whole}",
    "true_computation=%half, false_computation=%whole",
])
def test_a_conditional_counts_the_branch_that_sends_the_most(branches):
    found = pods.collectives(_BRANCHY.replace("BRANCHES", branches),
                             [d // 8 for d in range(16)])
    assert [c.name for c in found] == ["cp.whole"]  # one branch runs per call
    assert pods.slow_bytes(found) == 64 * 4


def test_the_model_without_biases_is_the_model_with_zero_biases():
    loss_fn, shapes = pods.mlp(16, 3, bias=False)
    biased_loss_fn, biased_shapes = pods.mlp(16, 3)
    assert [x.shape for x in jax.tree_util.tree_leaves(shapes)] == [(16, 16)] * 3
    keys = iter(jax.random.split(jax.random.key(0), 5))
    params = jax.tree_util.tree_map(
        lambda s: jax.random.normal(next(keys), s.shape), shapes)
    biased = {name: {"w": layer["w"], "b": jnp.zeros(16)} for name, layer in params.items()}
    assert jax.tree_util.tree_structure(biased) == jax.tree_util.tree_structure(biased_shapes)
    batch = (jax.random.normal(next(keys), (4, 16)), jax.random.normal(next(keys), (4, 16)))
    assert loss_fn(params, batch) == biased_loss_fn(biased, batch)
