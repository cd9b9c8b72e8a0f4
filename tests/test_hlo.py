"""Traffic read from compiled programs equals the SkipReduce formula."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import line_mesh
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr


def _compiled_text(fn, n, size, dtype=jnp.float32):
    mesh = line_mesh(n)
    x = jax.ShapeDtypeStruct((n * size,), dtype,
                             sharding=NamedSharding(mesh, P("i")))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return jax.jit(f).lower(x).compile().as_text()


def _traffic(fn, n, size, dtype=jnp.float32):
    return sr.collective_traffic(_compiled_text(fn, n, size, dtype))


@pytest.mark.parametrize("n", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("gather", ["native", "ring"])
@pytest.mark.parametrize("unrolled", [True, False])
def test_skip_psum_traffic_matches_formula(n, gather, unrolled, monkeypatch):
    if not unrolled:
        monkeypatch.setattr(sr._ring.ring, "MAX_UNROLLED_STEPS", 1)
    size = 1000  # not a multiple of n * chunks: padding is counted
    for k in range(n):
        traffic = _traffic(
            lambda v, k=k: sr.skip_psum(v, "i", key=jax.random.key(0), num_skip=k,
                                   chunks_per_rank=4, gather=gather), n, size)
        padded = -(-size // (4 * n)) * 4 * n * 4  # bytes
        assert traffic.count("all-reduce") == 0
        assert traffic.count("reduce-scatter") == 0
        total = traffic.bytes_per_device()
        assert total == pytest.approx((2 * (n - 1) - k) / n * padded)
        permute = traffic.bytes_per_device("collective-permute")
        if gather == "ring":
            assert traffic.count("all-gather") == 0
            assert permute == pytest.approx((2 * (n - 1) - k) / n * padded)
        else:
            assert permute == pytest.approx((n - 1 - k) / n * padded)


def test_ring_psum_traffic_equals_full_ring_and_psum_is_all_reduce():
    n, size = 8, 4096
    ring = _traffic(lambda v: sr.ring_psum(v, "i"), n, size)
    psum = _traffic(lambda v: lax.psum(v, "i"), n, size)
    assert ring.count("all-reduce") == 0
    assert ring.bytes_per_device() == pytest.approx(2 * (n - 1) / n * size * 4)
    assert psum.count("all-reduce") == 1
    assert psum.bytes_per_device() == pytest.approx(ring.bytes_per_device())


def test_bfloat16_accumulated_in_float32_sends_float32_then_bfloat16():
    n, size = 4, 1024
    t = _traffic(lambda v: sr.skip_psum(v, "i", key=None, num_skip=1,
                                        randomize=False, chunks_per_rank=1,
                                        accumulate_dtype=jnp.float32),
                 n, size, jnp.bfloat16)
    assert t.bytes_per_device("collective-permute") == (n - 2) * size // n * 4
    assert t.bytes_per_device("all-gather") == (n - 1) * size // n * 2


def test_native_collectives_are_counted_by_their_formulas():
    n, size = 4, 4096
    rs = _traffic(lambda v: lax.psum_scatter(v, "i", tiled=True), n, size)
    ag = _traffic(lambda v: lax.all_gather(v, "i", tiled=True)[:size], n, size)
    assert rs.bytes_per_device("reduce-scatter") == (n - 1) / n * size * 4
    assert ag.bytes_per_device("all-gather") == (n - 1) * size * 4


def test_combined_all_reduce_counts_every_output():
    n = 4
    text = _compiled_text(
        lambda v: (lax.pmean(v[:40], "i"), lax.pmean(v.reshape(-1, 4), "i")),
        n, 2000)
    traffic = sr.collective_traffic(text)
    assert traffic.bytes_per_device("all-reduce") == pytest.approx(
        2 * (n - 1) / n * (40 + 2000) * 4)


def test_parser_rejects_non_program():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        sr.collective_traffic("not hlo")


_ASYNC_PROGRAM = """HloModule m, num_partitions=4
%add (p0: f32[], p1: f32[]) -> f32[] {
  %p0 = f32[] parameter(0)
  %p1 = f32[] parameter(1)
  ROOT %add = f32[] add(%p0, %p1)
}
ENTRY %main (p0: f32[1024], p1: f32[1024]) -> (f32[1024], f32[1024]) {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[1024]{0} parameter(1)
  %ars = (f32[1024]{0}, f32[1024]{0}) all-reduce-start(%p0, %p1), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %ard = (f32[1024]{0}, f32[1024]{0}) all-reduce-done(%ars)
}
"""  # noqa: E501


def test_async_combined_all_reduce_and_empty_groups():
    # GPU programs: all-reduce-start returns its outputs only (unlike the
    # other -start ops), and replica_groups={} means every device.
    two_outputs = 2 * (2 * 4096 * 3 / 4)
    assert sr.collective_traffic(_ASYNC_PROGRAM).bytes_per_device() == two_outputs
    everyone = _ASYNC_PROGRAM.replace("replica_groups={{0,1,2,3}}", "replica_groups={}")
    assert sr.collective_traffic(everyone).bytes_per_device() == two_outputs


def test_scalar_operands_count_and_async_context_words_do_not():
    n = 4
    text = _compiled_text(lambda v: (lax.psum(v[:1].sum(), "i")[None],
                                     lax.psum(v[:37], "i")),
                          n, 100)
    assert sr.collective_traffic(text).bytes_per_device("all-reduce") == (
        pytest.approx(2 * (n - 1) / n * (1 + 37) * 4))
    # An async collective-permute returns (input, output, context words).
    start = ("  %cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) "
             "collective-permute-start(%p0), "
             "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}\n"
             "  ROOT %cpd = f32[1024]{0} collective-permute-done(%cps)\n")
    program = _ASYNC_PROGRAM.split("  %ars")[0] + start + "}\n"
    program = program.replace("-> (f32[1024], f32[1024])", "-> f32[1024]")
    assert sr.collective_traffic(program).bytes_per_device() == 4096


# Replica-group formats, as this jax version prints them (tests/hlo_texts/*.txt
# hold instruction lines copied from compiled programs).
_TEXTS = pathlib.Path(__file__).parent / "hlo_texts"
_F32 = 4


def _ring(nbytes, g):
    return 2 * (g - 1) / g * nbytes


@pytest.mark.parametrize("name, expected", [
    ("explicit_lists.txt", [  # (kind, group size, bytes per device)
        ("all-reduce", 4, _ring(8 * _F32, 4)),
        ("all-reduce", 2, _ring(8 * _F32, 2)),
        ("reduce-scatter", 4, 3 / 4 * 32 * _F32),  # 32 reduced, 8 kept
        ("all-gather", 2, 1 / 2 * 16 * _F32),
        ("collective-permute", 2, 8 * _F32),
        ("all-to-all", 4, 3 / 4 * 32 * _F32),
    ]),
    ("iota.txt", [
        ("all-reduce", 2, _ring(256 * _F32, 2)),  # [4,2]<=[8]
        ("collective-permute", 2, 64 * _F32),
        ("all-gather", 2, 1 / 2 * 128 * _F32),  # [4,2]<=[2,2,2]T(0,2,1)
    ]),
    ("mesh_axes.txt", [
        ("all-reduce", 8, _ring(512 * _F32, 8)),  # mesh[...=8,...=1] {axis_0}
        ("all-reduce", 4, _ring(512 * _F32, 4)),
        ("all-reduce", 2, _ring(512 * _F32, 2)),  # with device_ids=(...)
        ("all-reduce", 4, _ring(512 * _F32, 4)),
        ("all-gather", 4, 3 / 4 * 1024 * _F32),
        ("all-to-all", 2, 1 / 2 * 256 * _F32),  # sub-axis {'axis_1':(2)2}
    ]),
])
def test_every_replica_group_format_gives_its_group_size(name, expected):
    ops = sr.collective_traffic((_TEXTS / name).read_text()).ops
    assert [(op.kind, op.group_size) for op in ops] == [e[:2] for e in expected]
    for op, (_, _, nbytes) in zip(ops, expected, strict=True):
        assert op.bytes_per_device == pytest.approx(nbytes)


def _gspmd_step_text(shape, batch_axes, axis_type):
    mesh = jax.make_mesh(shape, ("d", "m")[:len(shape)],
                         axis_types=(axis_type,) * len(shape))
    w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32,
                             sharding=NamedSharding(mesh, P(batch_axes)))

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    return jax.jit(step).lower(w, x).compile().as_text()


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("shape, batch_axes, group", [
    ((8,), "d", 8), ((4, 2), ("d", "m"), 8), ((4, 2), "d", 4), ((4, 2), "m", 2)])
def test_gspmd_data_parallel_step_sends_the_gradient_all_reduce(
        shape, batch_axes, group, axis_type):
    # Plain jax.jit over a sharded batch: the [32, 16] f32 gradient is
    # all-reduced over the batch axes; its groups print as mesh axes.
    text = _gspmd_step_text(shape, batch_axes, axis_type)
    assert "replica_groups=mesh[" in text
    traffic = sr.collective_traffic(text)
    assert traffic.count("all-reduce") == 1
    assert [op.group_size for op in traffic.ops] == [group]
    assert traffic.bytes_per_device() == pytest.approx(_ring(32 * 16 * _F32, group))


def _live_texts():
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    spec = P(("a", "b"))
    x = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=NamedSharding(mesh, spec))

    def shard_map_text(fn):
        f = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
        return jax.jit(f).lower(x).compile().as_text()

    yield "list", shard_map_text(lambda v: lax.psum(v, "a")), [("all-reduce", 4)]
    yield "list", shard_map_text(lambda v: lax.psum_scatter(v, "b", tiled=True)), [
        ("reduce-scatter", 2)]
    yield "list", shard_map_text(lambda v: lax.all_gather(v, "a", tiled=True)[:32]), [
        ("all-gather", 4)]
    yield "list", shard_map_text(lambda v: lax.ppermute(v, "b", [(0, 1), (1, 0)])), [
        ("collective-permute", 2)]
    yield "list", shard_map_text(
        lambda v: lax.all_to_all(v.reshape(4, -1), "a", 0, 0, tiled=True).ravel()), [
        ("all-to-all", 4)]
    auto = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(AxisType.Auto,) * 3)
    y = jax.ShapeDtypeStruct((16, 16), jnp.float32,
                             sharding=NamedSharding(auto, P(("y", "z"))))
    reshard = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(auto, P("x")))
    yield "]<=[2,2,2]T(", reshard.lower(y).compile().as_text(), [
        ("collective-permute", 2), ("all-gather", 2)]
    y = jax.ShapeDtypeStruct((16, 16), jnp.float32,
                             sharding=NamedSharding(auto, P(("x", "y"))))
    transpose = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(auto, P(None, "z")))
    yield "mesh[", transpose.lower(y).compile().as_text(), None


def test_live_programs_of_every_format_are_read():
    formats = set()
    for fmt, text, expected in _live_texts():
        assert fmt == "list" or fmt in text
        formats.add(fmt)
        ops = sr.collective_traffic(text).ops
        assert ops and all(op.bytes_per_device > 0 for op in ops)
        if expected is not None:
            assert [(op.kind, op.group_size) for op in ops] == expected
    assert len(formats) == 3


_ONE_OP = """HloModule m, num_partitions=8, replica_count={replicas}
ENTRY %main (p0: f32[1024]) -> f32[1024] {{
  %p0 = f32[1024]{{0}} parameter(0)
  ROOT %op = f32[1024]{{0}} {op}
}}
"""


def _one_op(op, replicas=1):
    return _ONE_OP.format(op=op, replicas=replicas)


@pytest.mark.parametrize("groups", [
    "mesh['x'=8] {'y'}",  # no such axis
    "mesh['x'=4,'y'=2] {'x':(2)3}",  # sub-axis does not divide the axis
    "[2,4]<=[4,3]",  # sizes do not match
    "mesh['x'=16] {'x'}",  # more devices than the program has
    "{{0,1},{2,3,4,5}}",  # groups of different sizes
    "{{0,8}}",  # no device 8
    "groups(0,1,2,3)",  # a format not known
])
def test_unknown_replica_groups_raise_and_name_the_instruction(groups):
    line = (f"all-reduce(%p0), channel_id=1, replica_groups={groups}, "
            "use_global_device_ids=true")
    with pytest.raises(ValueError, match="format not understood.*" + re.escape(line)):
        sr.collective_traffic(_one_op(line))


def test_collectives_without_groups_or_not_counted_raise():
    for op in ("all-reduce(%p0), channel_id=1, to_apply=%add",
               "collective-permute(%p0), channel_id=1, source_target_pairs=[0,1]",
               "ragged-all-to-all(%p0, %p0, %p0, %p0, %p0, %p0), replica_groups={}"):
        with pytest.raises(ValueError, match=re.escape(op.split("(")[0])):
            sr.collective_traffic(_one_op(op))


def test_replica_groups_across_partitions_without_global_ids():
    # A channel_id without use_global_device_ids: the groups list replicas,
    # each group also spans every partition (here 2 replicas x 8 partitions).
    op = "all-reduce(%p0), channel_id=1, replica_groups={{0},{1}}, to_apply=%add"
    traffic = sr.collective_traffic(_one_op(op, replicas=2))
    assert traffic.ops[0].group_size == 8
    assert traffic.bytes_per_device() == _ring(4096, 8)


def test_async_wrapped_collective_is_counted_once():
    program = """HloModule m, num_partitions=8
%wrapped (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %a2a = f32[1024]{0} all-to-all(%p), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
}
ENTRY %main (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %start = ((f32[1024]{0}), f32[1024]{0}) async-start(%p0), calls=%wrapped
  ROOT %done = f32[1024]{0} async-done(%start), calls=%wrapped
}
"""
    assert sr.collective_traffic(program).bytes_per_device() == 7 / 8 * 4096


def test_a_conditional_counts_the_branch_that_sends_the_most():
    """Only one branch runs: the bytes are those of the largest branch."""
    n, size = 4, 256

    def fn(v):
        def shift(s):
            return lambda x: lax.ppermute(x, "i", [(r, (r + s) % n) for r in range(n)])

        small = lambda x: shift(1)(x[: size // 2]).sum() + x  # noqa: E731
        large = lambda x: shift(2)(x) + x  # noqa: E731
        return lax.switch(lax.axis_index("i") % 2, [small, large], v)

    traffic = _traffic(fn, n, size)
    assert traffic.bytes_per_device() == pytest.approx(size * 4)


_TPU_ASYNC_FUSION = """HloModule m, num_partitions=8

%start (p: f32[1,4096]) -> (f32[1,4096], f32[8,4096]) {
  %p = f32[1,4096]{1,0} parameter(0)
  %ag = f32[8,4096]{1,0} all-gather(%p), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %s = (f32[1,4096]{1,0}, f32[8,4096]{1,0}) custom-call(%p, %ag), custom_call_target="AsyncCollectiveStart"
}

%done (p: f32[1,4096]) -> f32[8,4096] {
  %p = f32[1,4096]{1,0} parameter(0)
  %ag = f32[8,4096]{1,0:S(1)} all-gather(%p), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  ROOT %d = f32[8,4096]{1,0} custom-call(%p, %ag), custom_call_target="AsyncCollectiveDone"
}

%other (p: f32[1,4096]) -> f32[8,4096] {
  %p = f32[1,4096]{1,0} parameter(0)
  ROOT %ag = f32[8,4096]{1,0} all-gather(%p), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}

ENTRY %main (x: f32[1,4096]) -> f32[8,4096] {
  %x = f32[1,4096]{1,0} parameter(0)
  %f1 = (f32[1,4096]{1,0}, f32[8,4096]{1,0}) fusion(%x), kind=kCustom, calls=%start
  %f2 = f32[8,4096]{1,0} fusion(%x), kind=kCustom, calls=%done
  ROOT %f3 = f32[8,4096]{1,0} fusion(%x), kind=kCustom, calls=%other
}
"""  # noqa: E501


def test_a_tpu_async_collective_fusion_counts_its_collective_once():
    # XLA:TPU repeats the all-gather (one channel_id) in the start and done
    # computations of an async collective fusion; another channel is another op.
    traffic = sr.collective_traffic(_TPU_ASYNC_FUSION)
    assert traffic.count("all-gather") == 2
    assert traffic.bytes_per_device() == 2 * 7 * 4096 * 4
    distinct = _TPU_ASYNC_FUSION.replace("channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, "
                                         "dimensions={0}, use_global_device_ids=true\n  ROOT %d",
                                         "channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, "
                                         "dimensions={0}, use_global_device_ids=true\n  ROOT %d")
    assert sr.collective_traffic(distinct).count("all-gather") == 3
