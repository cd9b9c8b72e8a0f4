"""skip_reduce as an optax transformation."""

import re

import chex
import flax.linen as nn
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

N = 8


def _reduce_once(tx, grads_per_rank, *, params=None, check_vma=True, steps=1):
    """Runs ``steps`` updates of ``tx`` on fixed per-rank gradients."""
    def f(grads, params):
        state = tx.init(params)
        outs = []
        for _ in range(steps):
            out, state = tx.update(grads, state, params)
            outs.append(out)
        return outs

    params = jax.tree_util.tree_map(lambda g: jnp.zeros(g.shape[1:], g.dtype),
                                    grads_per_rank) if params is None else params
    return per_rank(f, grads_per_rank, n=N, check_vma=check_vma,
                    replicated_args=(params,))


def test_num_skip_zero_equals_pmean_exactly_in_a_chain():
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(N, 300, 7)).astype(np.float32),
             "b": rng.normal(size=(N, 5)).astype(np.float32)}
    tx = optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                     optax.sgd(1.0))
    reference = optax.chain(optax.sgd(1.0))

    def f(g, params):
        out = tx.update(g, tx.init(params), params)[0]
        want = reference.update(lax.pmean(g, "data"), reference.init(params))[0]
        return out, want

    out, want = per_rank(f, grads, n=N, axis="data",
                         replicated_args=(jax.tree_util.tree_map(
                             lambda g: np.zeros(g.shape[1:], g.dtype), grads),))
    for o, w in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(o, w)


def test_contributor_counts_and_divisor():
    # The mean of the N - k ranks summed; error feedback divides by N, as
    # every value is delivered once, now or later. With k = 1 a sum of
    # N - 1 of the bits is no multiple of N - 1: the wrong divisor shows.
    x = {"w": bit_inputs(N, 4096)}
    for error_feedback, count in ((False, N - 1), (True, N)):
        tx = sr.skip_reduce("i", num_skip=1, min_size=0,
                            error_feedback=error_feedback)
        (out,) = _reduce_once(tx, x)
        sums = out["w"] * count
        np.testing.assert_allclose(sums, np.rint(sums), atol=1e-3)
        assert np.all(popcount(np.rint(sums)) == N - 1)
        np.testing.assert_array_equal(out["w"], out["w"][:1].repeat(N, 0))


@pytest.mark.parametrize("ratio, n, k", [(0.5, 8, 4), (0.2, 8, 1), (0.5, 4, 2),
                                         (0.0, 8, 0), (1.0, 8, 7), (0.3, 2, 0),
                                         (0.5, 2, 1)])
def test_skip_ratio_rounds_half_up(ratio, n, k):
    assert sr.comm_stats({"w": jnp.zeros(10**6)}, n, skip_ratio=ratio).num_skip == k
    if n == 8:
        tx = sr.skip_reduce("i", skip_ratio=ratio, min_size=0)
        (out,) = _reduce_once(tx, {"w": bit_inputs(N, 2048)})
        assert np.all(popcount(np.rint(out["w"] * (N - k))) == N - k)


def test_key_changes_every_step_and_is_seeded():
    x = {"w": bit_inputs(N, 4096)}
    tx = sr.skip_reduce("i", num_skip=3, min_size=0)
    a = _reduce_once(tx, x, steps=2)
    b = _reduce_once(tx, x, steps=2)
    c = _reduce_once(sr.skip_reduce("i", num_skip=3, min_size=0, seed=1), x, steps=2)
    np.testing.assert_array_equal(a[0]["w"], b[0]["w"])  # deterministic
    assert not np.array_equal(a[0]["w"], a[1]["w"])      # step count moves
    assert not np.array_equal(a[0]["w"], c[0]["w"])      # seed matters


def test_selective_and_min_size_leaves_equal_pmean_exactly():
    rng = np.random.default_rng(1)
    grads = {"embed": rng.normal(size=(N, 4096)).astype(np.float32),
             "dense": rng.normal(size=(N, 4096)).astype(np.float32),
             "bias": rng.normal(size=(N, 16)).astype(np.float32)}
    selections = [
        {"embed": False, "dense": True, "bias": True},
        lambda params: {"embed": False, "dense": True, "bias": True},
        sr.by_path(lambda path, leaf: "embed" not in path),
        sr.exclude("embed"),
    ]
    for selective in selections:
        tx = sr.skip_reduce("i", num_skip=4, min_size=100, selective=selective)

        def f(g, params):
            return tx.update(g, tx.init(params), params)[0], lax.pmean(g, "i")

        params = {k: np.zeros(v.shape[1:], np.float32) for k, v in grads.items()}
        out, mean = per_rank(f, grads, n=N, replicated_args=(params,))
        np.testing.assert_array_equal(out["embed"], mean["embed"])  # unselected
        np.testing.assert_array_equal(out["bias"], mean["bias"])    # < min_size
        assert not np.allclose(out["dense"], mean["dense"])         # skipped


def test_selective_callable_needs_params():
    tx = sr.skip_reduce("i", num_skip=1, selective=lambda p: p)
    with pytest.raises(ValueError, match="got params=None"):
        per_rank(lambda g: tx.update(g, tx.init(g))[0], np.ones((N, 4)), n=N)


def test_selective_must_be_python_bools():
    tx = sr.skip_reduce("i", num_skip=1, selective={"w": jnp.array(True)})
    with pytest.raises(TypeError, match="must be a Python bool"):
        per_rank(lambda g: tx.update(g, tx.init(g))[0], {"w": np.ones((N, 4))},
                 n=N)


def test_warmup_switches_without_recompiling():
    rng = np.random.default_rng(2)
    grads = rng.normal(size=(N, 8192)).astype(np.float32)
    tx = sr.skip_reduce("i", num_skip=4, min_size=0, warmup_steps=3)
    mesh = line_mesh(N)

    @chex.assert_max_traces(n=1)  # one trace (and compilation), both paths
    def f(g, state):
        out, state = tx.update(g[0], state)
        return out, state, lax.pmean(g[0], "i")

    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P()),
                                 out_specs=(P(), P(), P())))
    g = jax.device_put(grads, NamedSharding(mesh, P("i")))
    state = sr.replicate(tx.init(grads[0]), mesh)
    exact = []
    for _ in range(6):
        out, state, mean = step(g, state)
        exact.append(bool(np.array_equal(np.asarray(out), np.asarray(mean))))
    assert exact == [True, True, True, False, False, False]


@pytest.mark.parametrize("error_feedback", [False, True])
def test_warmup_with_a_zero_size_leaf_on_a_data_model_mesh(error_feedback):
    # Both lax.cond branches must type the unpacked zero-size leaf (and its
    # residual) alike, also where the gradients vary over another axis.
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tx = sr.skip_reduce("data", num_skip=1, min_size=0, warmup_steps=1,
                        error_feedback=error_feedback)
    params = {"w": jnp.zeros((16,)), "z": jnp.zeros((0,))}
    spec = P(("data", "model"))

    def f(g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        state = tx.init(params)
        for _ in range(2):  # a full all-reduce, then a skipped one
            out, state = tx.update(g, state, params)
        return jax.tree_util.tree_map(lambda a: a[None], out)

    g = {"w": jnp.arange(8 * 16.0).reshape(8, 16), "z": jnp.zeros((8, 0))}
    out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))(
        jax.device_put(g, NamedSharding(mesh, spec)))
    assert out["z"].shape == (8, 0) and out["w"].shape == (8, 16)


def test_error_feedback_bookkeeping_is_exact():
    # Integer-valued gradients, N = 8: every sum and division by N is exact.
    rng = np.random.default_rng(3)
    steps = 6
    grads = rng.integers(-50, 50, size=(steps, N, 3000)).astype(np.float32)
    tx = sr.skip_reduce("i", num_skip=5, min_size=0, error_feedback=True)

    def f(g, params):
        state = tx.init(params)
        delivered = jnp.zeros_like(params)
        for t in range(steps):
            out, state = tx.update(g[t], state)
            delivered = delivered + out
        return delivered, state.residual[0]

    per_rank_grads = np.moveaxis(grads, 1, 0)  # [N, steps, size]
    delivered, residual = per_rank(f, per_rank_grads, n=N,
                                   replicated_args=(np.zeros(3000, np.float32),))
    total = grads.sum(axis=(0, 1))
    np.testing.assert_array_equal(delivered[0] * N + residual.sum(0), total)
    assert np.any(residual != 0)
    assert not np.array_equal(residual[0], residual[1])  # per rank


def test_double_reduction_is_refused():
    mesh = line_mesh(N)
    tx = sr.skip_reduce("i", num_skip=2, min_size=0)
    w = jnp.ones((64,))
    x = jax.device_put(jnp.ones((N, 64)), NamedSharding(mesh, P("i")))

    def f(w, x):
        grads = jax.grad(lambda w: jnp.sum(w * x))(w)  # already psummed
        return tx.update(grads, tx.init(w))[0]

    g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
    with pytest.raises(ValueError, match=r"replicated \(invariant\) over \['i'\]"
                       r".*local_value_and_grad"):
        jax.jit(g)(w, x)

    def fixed(w, x):
        grads = sr.local_grad(lambda w: jnp.sum(w * x), "i")(w)
        return tx.update(grads, tx.init(w))[0]

    out = jax.jit(jax.shard_map(fixed, mesh=mesh, in_specs=(P(), P("i")),
                                out_specs=P()))(w, x)
    np.testing.assert_allclose(np.asarray(out), 1.0)  # the mean, not N x it


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "exactly one of num_skip"),
    (dict(num_skip=1, skip_ratio=0.5), "exactly one of num_skip"),
    (dict(skip_ratio=1.5), r"skip_ratio=1.5 must be a number in \[0, 1\]"),
    (dict(num_skip=-1), "num_skip=-1 must be an int >= 0"),
    (dict(num_skip=1, warmup_steps=-1), "warmup_steps=-1 must be a non-negative"),
    (dict(num_skip=1, seed=2**32 + 5), r"seed=4294967301 must be in \[0, 2\*\*32\)"),
    (dict(num_skip=1, seed=-1), r"seed=-1 must be in"),
    (dict(num_skip=1, min_size=1.5), "min_size=1.5 must be a non-negative"),
    (dict(num_skip=1, inner_axis="i"), "inner_axis='i' is also axis_name"),
    (dict(num_skip=1, chunks_per_rank=0), "chunks_per_rank=0 must be a"),
    (dict(num_skip=1, bucket_bytes=0), "bucket_bytes=0 must be a positive"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sr.skip_reduce("i", **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_skip=1, accumulate_dtype="banana"), "accumulate_dtype='banana'"),
    (dict(num_skip=1, accumulate_dtype=jnp.int32), "not a floating-point"),
    (dict(num_skip=1, randomize="no"), "randomize='no' must be a bool"),
])
def test_bad_types_fail_when_built(kwargs, match):
    with pytest.raises(TypeError, match=match):
        sr.skip_reduce("i", **kwargs)


def test_equal_settings_have_equal_fingerprints():
    def fingerprint(**kw):
        return int(sr.skip_reduce("i", **kw).init({"w": jnp.zeros(3)}).fingerprint)

    assert fingerprint(num_skip=4) == fingerprint(num_skip=np.int64(4))
    assert fingerprint(skip_ratio=1) == fingerprint(skip_ratio=1.0)
    dtypes = {fingerprint(num_skip=1, accumulate_dtype=d)
              for d in (jnp.float32, np.float32, "float32", jnp.dtype("float32"))}
    assert len(dtypes) == 1
    assert fingerprint(num_skip=1) != fingerprint(num_skip=2)


def test_by_path_predicate_must_return_a_bool():
    tx = sr.skip_reduce("i", num_skip=1, min_size=0,
                        selective=sr.by_path(lambda p, _: re.search("w", p)))
    grads = np.ones((N, 8), np.float32)
    with pytest.raises(TypeError, match=r"predicate returned None for \['b'\]"):
        per_rank(lambda g: tx.update({"w": g, "b": g}, tx.init({"w": g, "b": g}))[0],
                 grads, n=N)


def test_accumulate_dtype_also_sums_the_full_all_reduces_in_float32():
    # Warmup, k = 0, excluded and small leaves take lax.pmean: it must also
    # add in the wider dtype; comm_stats counts what the program sends.
    n = 4
    grads = {"big": jnp.zeros((4096,), jnp.bfloat16),
             "small": jnp.zeros((64,), jnp.bfloat16)}
    kw = dict(num_skip=1, min_size=1000, accumulate_dtype=jnp.float32)
    tx = sr.skip_reduce("i", **kw)
    mesh = line_mesh(n)

    def f(g):
        g = jax.tree_util.tree_map(lambda x: x[0], g)
        return jax.tree_util.tree_map(lambda x: x[None], tx.update(g, tx.init(g))[0])

    per_rank_grads = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((n,) + x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, P("i"))),
        grads)
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    lowered = step.lower(per_rank_grads).as_text()
    # The all-reduce's operand types, as in "}) : (tensor<64xf32>) -> ...".
    operands = re.findall(r"stablehlo\.all_reduce.*?\}\) : \((.*?)\) ->",
                          lowered, flags=re.S)
    assert operands and all("bf16" not in o and "f32" in o for o in operands)
    traffic = sr.collective_traffic(step.lower(per_rank_grads).compile().as_text())
    stats = sr.comm_stats(grads, n, **kw)
    assert traffic.bytes_per_device() == pytest.approx(stats.bytes_per_device)
    # Without accumulate_dtype the formula counts bfloat16 throughout.
    plain = sr.comm_stats(grads, n, **{**kw, "accumulate_dtype": None})
    assert plain.bytes_per_device < stats.bytes_per_device


def test_num_skip_too_large_for_axis_fails_at_trace_time():
    tx = sr.skip_reduce("i", num_skip=8, min_size=0)
    with pytest.raises(ValueError, match=r"num_skip=8 is outside \[0, 7\]"):
        per_rank(lambda g: tx.update(g, tx.init(g))[0], np.ones((N, 4)), n=N)


def test_comm_stats():
    grads = {"big": jnp.zeros((1 << 20,)), "small": jnp.zeros((1000,))}
    stats = sr.comm_stats(grads, 8, num_skip=4)
    full = 2 * 7 / 8 * (4 << 20 | 4000)
    assert stats.full_bytes_per_device == pytest.approx(full)
    assert stats.bytes_per_device == pytest.approx(
        10 / 8 * (4 << 20) + 14 / 8 * 4000)
    assert stats.dropped_fraction == pytest.approx(0.5 * (1 << 20) / ((1 << 20) + 1000))
    none = sr.comm_stats(grads, 8, num_skip=4, selective={"big": False,
                                                          "small": True})
    assert none.ratio == 1.0 and none.dropped_fraction == 0.0
    # k = 0 runs the plain pmean on unpadded leaves: exactly a full ring.
    zero = sr.comm_stats({"w": jnp.zeros(1001)}, 8, num_skip=0, min_size=0)
    assert zero.ratio == 1.0 and zero.skipped_elements == 0


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


@pytest.mark.slow
def test_flax_params_stay_bit_identical_over_50_steps():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N * 16, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(N * 16,))
    model = _MLP()
    params = model.init(jax.random.key(0), x[:1])

    def loss_fn(p, batch):
        logits = model.apply(p, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch[1]).mean()

    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0),
                     optax.adamw(1e-3))
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh)
    step = sr.make_train_step(loss_fn, tx, mesh)
    batch = sr.shard_batch((x, y), mesh)
    losses = []
    for _ in range(50):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))  # also keeps the queue of steps short
    assert losses[-1] < losses[0]
    for leaf in jax.tree_util.tree_leaves(params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == N
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


def test_an_empty_tree_passes_through_with_every_option():
    tx = sr.skip_reduce("i", num_skip=2, min_size=0, error_feedback=True,
                        check_finite=True, warmup_steps=1)

    def f(g):
        out, state = tx.update({}, tx.init({}))
        assert out == {} and state.residual == {}
        return g

    np.testing.assert_array_equal(per_rank(f, np.ones((N, 3), np.float32), n=N), 1.0)


def test_comm_stats_checks_its_arguments():
    grads = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
    # One rank sends nothing either way.
    one = sr.comm_stats(grads, 1, skip_ratio=0.5, min_size=0)
    assert (one.num_skip, one.bytes_per_device, one.ratio) == (0, 0.0, 1.0)
    for n in (0, 2.0, None):
        with pytest.raises(ValueError, match=f"comm_stats: axis_size={n!r} must be"):
            sr.comm_stats(grads, n, num_skip=0)
    with pytest.raises(TypeError, match="comm_stats: .*'nm_skip'"):
        sr.comm_stats(grads, 8, nm_skip=1)
    # Without inner_size the hierarchical traffic would be counted on whole
    # leaves instead of 1/L shards.
    with pytest.raises(ValueError, match="pass inner_axis and inner_size together"):
        sr.comm_stats(grads, 4, num_skip=1, inner_axis="local")
    with pytest.raises(ValueError, match="pass inner_axis and inner_size together"):
        sr.comm_stats(grads, 4, num_skip=1, inner_size=2)
    assert sr.comm_stats(grads, 4, num_skip=1, min_size=0, inner_size=1) == (
        sr.comm_stats(grads, 4, num_skip=1, min_size=0))
    with pytest.raises(ValueError, match="inner_size=0 must be"):
        sr.comm_stats(grads, 4, num_skip=1, inner_axis="local", inner_size=0)
    whole = sr.comm_stats(grads, 4, num_skip=1, min_size=0)
    shard = sr.comm_stats(grads, 4, num_skip=1, min_size=0, inner_axis="local",
                          inner_size=2)
    assert shard.bytes_per_device == whole.bytes_per_device / 2
    with pytest.raises(ValueError, match=r"pass them as comm_stats\(\.\.\., params=params\)"):
        sr.comm_stats(grads, 4, num_skip=1, selective=lambda p: {"w": True})
    # Without jax_enable_x64, float64 is float32: what the program sends.
    assert not jax.config.jax_enable_x64
    assert sr.comm_stats(grads, 4, num_skip=1, min_size=0,
                         accumulate_dtype=jnp.float64) == whole


def test_warns_when_nothing_may_be_skipped():
    # The default min_size (100 000) leaves a small model a plain average.
    grads = np.ones((N, 1000), np.float32)
    tx = sr.skip_reduce("i", num_skip=3)
    with pytest.warns(sr.NothingSkippedWarning, match=r"no leaf may be skipped.*"
                      r"min_size=100000.*min_size=0"):
        per_rank(lambda g: tx.update(g, tx.init(g))[0], grads, n=N)
    quiet = sr.skip_reduce("i", num_skip=3, min_size=0)
    per_rank(lambda g: quiet.update(g, quiet.init(g))[0], grads, n=N)


@pytest.mark.parametrize("chunks", [1, 4])
def test_chunks_per_rank_reaches_the_ring(chunks):
    # Each sub-chunk is placed by its own draw: one contributor set per
    # sub-chunk, so a bucket of N slots shows at most N * chunks sets, and
    # skip_reduce's sets are skip_pmean's with the same key and options.
    n, size = N, N * 1024
    grads = bit_inputs(n, size)
    tx = sr.skip_reduce("i", num_skip=4, min_size=0, chunks_per_rank=chunks, balanced=False)

    def f(g):
        out, _ = tx.update(g, tx.init(g))
        key = jax.random.fold_in(jax.random.key(0), 0)
        ref = sr.skip_pmean(g, "i", key=key, num_skip=4, chunks_per_rank=chunks)
        return out, ref

    out, ref = per_rank(f, grads, n=n)
    np.testing.assert_array_equal(out[0], ref[0])
    sets = np.unique(np.rint(out[0] * (n - 4)))
    assert len(sets) <= n * chunks
    assert (popcount(np.rint(out[0] * (n - 4))) == n - 4).all()
