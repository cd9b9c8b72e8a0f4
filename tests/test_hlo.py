"""Traffic read from compiled programs equals the SkipReduce formula."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from helpers import line_mesh


def _compiled_text(fn, n, size, dtype=jnp.float32):
    mesh = line_mesh(n)
    x = jax.ShapeDtypeStruct((n * size,), dtype,
                             sharding=NamedSharding(mesh, P("i")))
    f = jax.shard_map(fn, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return jax.jit(f).lower(x).compile().as_text()


def _traffic(fn, n, size, dtype=jnp.float32):
    return sr.collective_traffic(_compiled_text(fn, n, size, dtype))


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("gather", ["native", "ring"])
@pytest.mark.parametrize("unrolled", [True, False])
def test_skip_psum_traffic_matches_formula(n, gather, unrolled, monkeypatch):
    if not unrolled:
        monkeypatch.setattr(sr._ring, "MAX_UNROLLED_STEPS", 1)
    size = 1000  # not a multiple of n * chunks: padding is counted
    for k in range(n):
        traffic = _traffic(
            lambda v: sr.skip_psum(v, "i", key=jax.random.key(0), num_skip=k,
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
"""


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
