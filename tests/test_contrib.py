"""skipreduce_jax.contrib: top-k with error memory and PowerSGD."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import line_mesh, per_rank
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax import contrib

N = 8


def _int_grads(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Integer-valued float32 per-rank gradients: every sum below is exact."""
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-64, 64, size=(N,) + s).astype(np.float32)
            for k, s in shapes.items()}


SHAPES = {"w": (24, 10), "b": (10,), "conv": (3, 3, 4, 8)}


# ----------------------------------------------------------------------------
# Top-k.
# ----------------------------------------------------------------------------


def test_topk_with_density_one_is_pmean():
    grads = _int_grads(0, SHAPES)
    txs = [contrib.topk_reduce("i", density=1.0, per_leaf=p) for p in (True, False)]

    def f(local):
        results = [tx.update(local, tx.init(local)) for tx in txs]
        return ([out for out, _ in results], lax.pmean(local, "i"),
                [state.memory for _, state in results])

    outs, mean, memories = per_rank(f, grads, n=N)
    for out, memory in zip(outs, memories, strict=True):
        for key in grads:
            np.testing.assert_array_equal(out[key], mean[key])
            np.testing.assert_array_equal(memory[key], 0)


def test_topk_bookkeeping_loses_nothing():
    """N * (sum of outputs) + memories left = sum of all local gradients."""
    steps = 3
    per_step = [_int_grads(s, SHAPES) for s in range(steps)]
    stacked = {k: np.stack([g[k] for g in per_step], 1) for k in SHAPES}
    tx = contrib.topk_reduce("i", density=0.1, min_size=20)  # "b" goes dense

    def f(local):
        state = tx.init(jax.tree_util.tree_map(lambda x: x[0], local))
        outs = []
        for t in range(steps):
            out, state = tx.update(
                jax.tree_util.tree_map(lambda x, t=t: x[t], local), state)
            outs.append(out)
        delivered = jax.tree_util.tree_map(lambda *o: sum(o), *outs)
        return delivered, jax.tree_util.tree_map(lambda m: m[0], state.memory)

    delivered, memory = per_rank(f, stacked, n=N)
    for key in SHAPES:
        total = stacked[key].sum(axis=(0, 1))
        np.testing.assert_array_equal(delivered[key][0] * N
                                      + memory[key].sum(0), total)
        for r in range(1, N):  # outputs identical on every rank
            np.testing.assert_array_equal(delivered[key][r], delivered[key][0])
    assert np.all(memory["b"] == 0)          # dense leaf: nothing held back
    assert np.count_nonzero(memory["w"]) > 0  # sparse leaf: some held back


def test_topk_sends_the_largest_entries():
    g = np.zeros((N, 100), np.float32)
    g[:, 7] = 50.0
    g[:, 42] = -80.0
    g[:, 3] = np.arange(N)  # smaller than both
    tx = contrib.topk_reduce("i", density=0.02)  # k = 2

    def f(local):
        out, state = tx.update(local, tx.init(local))
        return out, state.memory[0]

    out, memory = per_rank(f, g, n=N)
    expected = np.zeros(100, np.float32)
    expected[7], expected[42] = 50.0, -80.0
    np.testing.assert_array_equal(out, np.broadcast_to(expected, (N, 100)))
    np.testing.assert_array_equal(memory[:, 3], np.arange(N))


def test_topk_outputs_are_replica_identical_with_random_floats():
    rng = np.random.default_rng(3)
    grads = {"w": rng.normal(size=(N, 300, 7)).astype(np.float32)}
    tx = contrib.topk_reduce("i", density=0.05, per_leaf=False)

    def f(local):
        return tx.update(local, tx.init(local))[0]

    out = per_rank(f, grads, n=N)["w"]
    for r in range(1, N):
        np.testing.assert_array_equal(out[r], out[0])


def test_topk_rejects_summed_gradients():
    tx = contrib.topk_reduce("i")

    def f(local):
        summed = lax.psum(local, "i")  # invariant: already reduced
        return tx.update(summed, tx.init(summed))[0]

    # The message shared with skip_reduce (skipreduce_jax._optax.per_rank.check_local).
    with pytest.raises(ValueError,
                       match=r"^topk_reduce: .* replicated \(invariant\) over \['i'\]"):
        per_rank(f, np.ones((N, 16), np.float32), n=N)


# ----------------------------------------------------------------------------
# PowerSGD.
# ----------------------------------------------------------------------------


def test_powersgd_warmup_is_pmean_then_recovers_rank_one():
    rng = np.random.default_rng(4)
    u, v = rng.normal(size=(40, 1)), rng.normal(size=(1, 30))
    rank_one = (u @ v).astype(np.float32)
    warm = 2
    noise = rng.normal(size=(warm, N, 40, 30)).astype(np.float32)
    bias = rng.normal(size=(N, 30)).astype(np.float32)
    tx = contrib.powersgd_reduce("i", rank=4, warmup_steps=warm)

    def f(noise, bias, m):
        params = {"b": bias, "m": m}
        state = tx.init(params)
        outs, means = [], []
        for t in range(warm):  # warm-up: plain all-reduce of noisy gradients
            g = {"b": bias, "m": sr.to_varying(noise[t], "i")}
            out, state = tx.update(g, state)
            outs.append(out)
            means.append(lax.pmean(g, "i"))
        # The same rank-1 gradient on every rank (still a local value).
        g = {"b": bias, "m": sr.to_varying(m, "i")}
        approx, state = tx.update(g, state)
        return outs, means, approx, state.error[0][0]

    local = (noise.transpose(1, 0, 2, 3), bias)
    outs, means, approx, error = per_rank(lambda a, m: f(*a, m), local, n=N,
                                          replicated_args=(rank_one,))
    for out, mean in zip(outs, means, strict=True):
        np.testing.assert_array_equal(out["m"], mean["m"])
        np.testing.assert_array_equal(out["b"], mean["b"])
    for r in range(N):
        np.testing.assert_allclose(approx["m"][r], rank_one, rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_array_equal(approx["m"][r], approx["m"][0])
        np.testing.assert_array_equal(approx["b"][r], bias.mean(0))
    np.testing.assert_allclose(error, 0, atol=1e-4)


def test_powersgd_error_feedback_and_replica_identity():
    """Compressed: the output plus the mean error is the mean gradient."""
    rng = np.random.default_rng(5)
    grads = {"m": rng.normal(size=(N, 64, 48)).astype(np.float32),
             "conv": rng.normal(size=(N, 3, 3, 16, 32)).astype(np.float32),
             "b": rng.normal(size=(N, 48)).astype(np.float32)}
    tx = contrib.powersgd_reduce("i", rank=2, warmup_steps=0)

    def f(local):
        state = tx.init(local)
        out, state = tx.update(local, state)
        out2, state2 = tx.update(local, state)
        return out, state.error, out2, state2.q, lax.pmean(local, "i")

    out, errors, out2, qs, mean = per_rank(f, grads, n=N)
    assert len(errors) == 2  # "m" and "conv" (as [144, 32]); "b" is 1-D
    for key, error in zip(("conv", "m"), errors, strict=True):  # leaves in sorted order
        mean_error = error[:, 0].mean(0)
        np.testing.assert_allclose(out[key][0] + mean_error, mean[key][0],
                                   atol=1e-5)
        assert np.abs(mean_error).max() > 1e-2  # rank 2 is lossy here
    np.testing.assert_array_equal(out["b"], mean["b"])
    for tree in (out, out2, qs):
        for leaf in jax.tree_util.tree_leaves(tree):
            for r in range(1, N):
                np.testing.assert_array_equal(leaf[r], leaf[0])


# ----------------------------------------------------------------------------
# Traffic, placement, training.
# ----------------------------------------------------------------------------


def _compiled_traffic(tx, shapes):
    mesh = line_mesh(N, "i")
    args = {k: jax.ShapeDtypeStruct((N,) + s, jnp.float32,
                                    sharding=NamedSharding(mesh, P("i")))
            for k, s in shapes.items()}

    def f(local):
        local = jax.tree_util.tree_map(lambda x: x[0], local)
        return tx.update(local, tx.init(local))[0]

    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("i"), out_specs=P()))
    return fn.lower(args).compile().as_text()


def test_comm_bytes_match_the_compiled_program():
    shapes = {"w": (500, 40), "b": (40,), "v": (30, 10)}
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32)
              for k, s in shapes.items()}
    for per_leaf, gathered in ((True, 200 + 3), (False, 203)):
        # int64 indices travel as int32 without jax_enable_x64.
        for index_dtype in (jnp.int32, jnp.int64):
            kw = dict(density=0.01, per_leaf=per_leaf, min_size=100,
                      index_dtype=index_dtype)
            text = _compiled_traffic(contrib.topk_reduce("i", **kw), shapes)
            traffic = sr.collective_traffic(text)
            assert traffic.bytes_per_device() == pytest.approx(
                contrib.topk_comm_bytes(params, N, **kw))
            assert traffic.bytes_per_device("all-gather") == (N - 1) * gathered * 8

    kw = dict(rank=4, warmup_steps=0)
    text = _compiled_traffic(contrib.powersgd_reduce("i", **kw), shapes)
    expected = contrib.powersgd_comm_bytes(params, N, **kw)
    assert sr.collective_traffic(text).bytes_per_device() == pytest.approx(
        expected)
    # "w" as factors [500, 4] and [40, 4]; "b" and "v" (too small to gain
    # 2x from rank 4) in full.
    assert expected == pytest.approx(2 * (N - 1) / N * 4 * (4 * 540 + 40 + 300))
    assert contrib.full_comm_bytes(params, N) == 2 * (N - 1) / N * 4 * 20340


def test_state_specs_place_only_per_rank_fields():
    # per_rank_fields is a class attribute, not a field of the state.
    assert contrib.TopKState._fields == ("count", "memory")
    assert contrib.PowerSGDState._fields == ("count", "q", "error")
    params = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    tx = optax.chain(contrib.topk_reduce("data"), contrib.powersgd_reduce("data", rank=1),
                     sr.skip_reduce("data", num_skip=1, error_feedback=True),
                     optax.adam(1e-3))
    specs = sr.state_specs(jax.eval_shape(tx.init, params), "data")
    assert specs[0].memory == {"w": P("data"), "b": P("data")}
    assert specs[0].count == P()
    assert specs[1].error == (P("data"),) and specs[1].q == (P(),)
    assert specs[1].count == P()
    assert specs[2].residual == {"w": P("data"), "b": P("data")}
    assert specs[2].key == P()
    assert all(s == P() for s in jax.tree_util.tree_leaves(
        specs[3], is_leaf=lambda x: isinstance(x, P)))


@pytest.mark.parametrize("make_tx", [
    lambda: contrib.topk_reduce("data", density=0.05),
    lambda: contrib.powersgd_reduce("data", rank=2, warmup_steps=2),
], ids=["topk", "powersgd"])
def test_training_keeps_params_identical_across_devices(make_tx):
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(6)
    x = rng.normal(size=(N * 8, 32)).astype(np.float32)
    y = rng.integers(0, 5, size=N * 8)

    def loss_fn(p, batch):
        h = jnp.tanh(batch[0] @ p["w1"] + p["b1"])
        logits = h @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, batch[1]).mean()

    params = {"w1": rng.normal(size=(32, 64)).astype(np.float32) * 0.2,
              "b1": np.zeros(64, np.float32),
              "w2": rng.normal(size=(64, 5)).astype(np.float32) * 0.2}
    tx = optax.chain(make_tx(), optax.adam(1e-2))
    params = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    per_rank_leaf = jax.tree_util.tree_leaves(
        opt_state[0].memory if isinstance(opt_state[0], contrib.TopKState)
        else opt_state[0].error)[0]
    assert per_rank_leaf.shape[0] == N
    assert per_rank_leaf.sharding.spec[0] == "data"
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    losses = []
    for _ in range(6):
        params, opt_state, loss = step(params, opt_state,
                                       sr.shard_batch((x, y), mesh, "data"))
        losses.append(float(loss))
    assert step._cache_size() == 1
    assert losses[-1] < losses[0]
    sr.assert_replicated(params, mesh)
    for leaf in jax.tree_util.tree_leaves(params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


def test_powersgd_leaves_matrices_with_fewer_rows_than_rank_uncompressed():
    # [2, 100] at rank 4: the QR of P [2, 4] would keep 2 columns only.
    tx = contrib.powersgd_reduce("i", rank=4, warmup_steps=1, min_compression_rate=0.4)
    grads = np.random.default_rng(6).normal(size=(N, 2, 100)).astype(np.float32)

    def f(g):
        state = tx.init(g)
        for _ in range(2):  # the warm-up step, then the compressed path
            out, state = tx.update(g, state)
        return out, lax.pmean(g, "i")

    out, mean = per_rank(f, grads, n=N)
    np.testing.assert_allclose(out, mean, rtol=1e-6, atol=1e-6)  # full mean
    assert contrib.powersgd_comm_bytes({"w": jnp.zeros((2, 100))}, N, rank=4,
                                  min_compression_rate=0.4) == pytest.approx(
        2 * (N - 1) / N * 4 * 200)


def test_powersgd_rejects_summed_gradients():
    tx = contrib.powersgd_reduce("i", rank=1, warmup_steps=0)

    def f(local):
        summed = lax.psum(local, "i")
        return tx.update(summed, tx.init(summed))[0]

    with pytest.raises(ValueError,
                       match=r"^powersgd_reduce: .* replicated \(invariant\) over \['i'\]"):
        per_rank(f, np.ones((N, 16, 8), np.float32), n=N)


@pytest.mark.parametrize("make, error, message", [
    (lambda: contrib.topk_reduce("i", density=0.0), ValueError, "density must be > 0"),
    (lambda: contrib.topk_reduce("i", density=1.5), ValueError, "density must be <= 1"),
    (lambda: contrib.topk_reduce("i", per_leaf=1), TypeError, "per_leaf=1 must be a bool"),
    (lambda: contrib.topk_reduce("i", min_size=-1), ValueError, "min_size=-1 must be"),
    (lambda: contrib.topk_reduce("i", index_dtype=jnp.float32), TypeError, "index_dtype"),
    (lambda: contrib.topk_reduce(0), TypeError, "axis_name=0"),
    (lambda: contrib.topk_comm_bytes({}, N, density=2.0), ValueError, "density"),
    (lambda: contrib.powersgd_reduce("i", rank=0), ValueError, "rank=0 must be a positive"),
    (lambda: contrib.powersgd_reduce("i", warmup_steps=1.0), TypeError, "warmup_steps=1.0"),
    (lambda: contrib.powersgd_reduce("i", min_compression_rate=-1.0), ValueError,
     "min_compression_rate must be >= 0"),
    (lambda: contrib.powersgd_comm_bytes({}, N, rank=True), TypeError, "rank=True"),
])
def test_arguments_are_checked_and_name_the_api(make, error, message):
    with pytest.raises(error, match=r"^(topk|powersgd)_reduce: .*" + message):
        make()


def test_comm_bytes_refuse_unknown_arguments():
    with pytest.raises(TypeError, match=r"^topk_comm_bytes: .*arguments of topk_reduce"):
        contrib.topk_comm_bytes({}, N, densty=0.1)
    with pytest.raises(TypeError, match=r"^powersgd_comm_bytes: .*of powersgd_reduce"):
        contrib.powersgd_comm_bytes({}, N, rnak=2)
