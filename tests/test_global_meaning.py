"""A loss means under ``sr.value_and_grad`` what it means under ``jax.jit``.

Each loss below is written for the global batch, as for
``jax.value_and_grad``, with none of the library's helpers (``mean_count``,
``PerRank``, ``rank_key``). At ``num_skip=0`` the value, every aux leaf and
every gradient equal ``jax.value_and_grad``'s on the global arrays (plain
``jax.jit``, no mesh), on a mesh of Auto axes and one of Explicit axes; with
skipping on, the same loss runs, the replicas agree bit for bit and the
gradients change. Cases that crossed rows per rank before (sums, masked
means, batch statistics, maxima, dropout masks, in-batch negatives, top-k,
custom_vjp rules, callbacks) are each here.
"""

import functools

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import under_scan3_ring, zero_size_collectives
from jax import lax
from jax.experimental import sparse as jsparse
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N, B, D, H, C = 8, 64, 12, 16, 10
RNG = np.random.default_rng(0)
X = RNG.normal(size=(B, D)).astype(np.float32)
LABELS = RNG.integers(0, C, size=B).astype(np.int32)
MASK = (np.arange(B) < 40).astype(np.float32)  # the last three ranks: all padding
PARAMS = {"w": (RNG.normal(size=(D, H)) * 0.3).astype(np.float32),
          "b": np.zeros(H, np.float32),
          "v": (RNG.normal(size=(H, C)) * 0.3).astype(np.float32)}
CLASS_WEIGHTS = RNG.uniform(0.5, 2.0, size=C).astype(np.float32)
SCALE = RNG.uniform(0.5, 1.5, size=B).astype(np.float32)  # closed over; B rows, not the batch
KEY = jax.random.key(7)


def _hidden(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def _xent(p, x, y):
    logits = _hidden(p, x) @ p["v"]
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def _sum(p, x, y):
    return jnp.sum((x @ p["w"] - 1.0) ** 2)


def _masked_mean(p, x, y, m):
    err = _xent(p, x, y)
    return jnp.sum(m * err) / jnp.sum(m)


def _divided_plus_decay(p, x, y):
    return jnp.sum(_xent(p, x, y)) / 64.0 + 1e-3 * jnp.sum(p["w"] ** 2)


def _halved(p, x, y):
    return 0.5 * (jnp.sum(_xent(p, x, y)) / 64.0) + jnp.sum(_xent(p, x, y)) / (2 * 64.0)


def _variance(p, x, y):
    return jnp.var(x @ p["w"])


def _standardized_target(p, x, y):
    t = y.astype(jnp.float32)
    t = (t - t.mean()) / t.std()
    return jnp.mean((_hidden(p, x) @ p["v"][:, 0] - t) ** 2)


def _aux_statistics(p, x, y):
    err = _xent(p, x, y)
    h = _hidden(p, x)
    return jnp.mean(err), {"max": jnp.max(err), "vdot": jnp.vdot(h, h),
                           "median": jnp.median(err), "rows": err,
                           "flat_sum": jnp.sum(h.reshape(-1)),
                           "count": jnp.count_nonzero(err > 2.0).astype(jnp.float32),
                           "int_count": jnp.sum(err > 2.0),
                           "jit_count": jax.jit(lambda e: jnp.sum(e > 1.0))(err)}


def _class_weighted(p, x, y, cw):
    return jnp.mean(cw[y] * _xent(p, x, y))


def _closed_over_scale(p, x, y):
    return jnp.mean(SCALE * _xent(p, x, y))


def _dropout_passed(p, x, y, key):
    h = _hidden(p, x)
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    loss = jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(h @ p["v"]), y[:, None], 1))
    return loss, keep


def _dropout_closed_over(p, x, y):
    return _dropout_passed(p, x, y, KEY)


def _batch_normalized(p, x, y):
    h = x @ p["w"]
    h = (h - h.mean(0)) / jnp.sqrt(h.var(0) + 1e-5)
    return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(jax.nn.relu(h) @ p["v"]),
                                         y[:, None], 1))


class _BN(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.Dense(H)(x)
        x = linen.BatchNorm(use_running_average=False)(x)
        return linen.Dense(C)(jax.nn.relu(x))


_BN_VARS = _BN().init(jax.random.key(0), X)


def _flax_batchnorm(p, x, y):
    logits, updates = _BN().apply({"params": p, "batch_stats": _BN_VARS["batch_stats"]},
                                  x, mutable=["batch_stats"])
    loss = jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))
    return loss, updates["batch_stats"]


def _info_nce(p, x, y):
    z = _hidden(p, x)
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    logits = z @ z.T / 0.1
    return -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=1)))


def _hard_mining(p, x, y):
    values, _ = lax.top_k(_xent(p, x, y), 16)
    return jnp.mean(values)


def _argsort_weighted(p, x, y):
    err = _xent(p, x, y)
    rank = jnp.argsort(jnp.argsort(lax.stop_gradient(err)))
    return jnp.mean(err * (1.0 + rank / B))


def _cond_on_batch_mean(p, x, y):
    err = _xent(p, x, y)
    return lax.cond(jnp.mean(err) > 2.0, lambda e: jnp.mean(e ** 2), lambda e: jnp.mean(e), err)


def _graph_pooling(p, x, y):
    graph = jnp.arange(B) // 5  # graphs of 5 nodes: they span ranks
    pooled = jax.ops.segment_sum(_hidden(p, x), graph, num_segments=13)
    return jnp.mean((pooled @ p["v"]) ** 2)


def _halves(p, x, y):
    h = _hidden(p, x)
    return jnp.mean((h[: B // 2] - h[B // 2:]) ** 2)


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))


def _custom_vjp_clip(p, x, y):
    return jnp.mean(_clip_gradient(_hidden(p, x)) ** 2) + jnp.mean(_xent(p, x, y))


def _custom_vjp_on_a_param(p, x, y):
    # The rule on the replicated param itself, not on an activation.
    return jnp.mean(jnp.tanh(x @ _clip_gradient(p["w"]) + p["b"]) @ p["v"])


def _relu_at_zero(p, x, y):
    # Padding rows are zeros and the bias is zero: relu's custom rule at 0.
    x = x * MASK[:, None]
    return jnp.mean(jax.nn.relu(x @ p["w"] + p["b"]) @ p["v"])


def _debug_print(p, x, y):
    loss = jnp.mean(_xent(p, x, y))
    jax.debug.print("loss {}", loss)
    jax.debug.callback(lambda v: None, _xent(p, x, y))
    return loss


def _time_major(p, x, y):
    # x: (T, B, 4), B split over "data" (dimension 1); an RNN over T.
    def step(h, xt):
        h = jnp.tanh(xt @ p["w"][:4] + h @ (p["w"].T @ p["w"]) * 0.1)
        return h, jnp.sum(h, axis=1)
    h, ys = lax.scan(step, jnp.zeros((x.shape[1], H)), x)
    return jnp.mean(h ** 2) + jnp.mean(ys)


def _nan_row_max(p, x, y):
    # One bad example: its loss is left out, and the batch's max says NaN.
    per = jnp.where(jnp.arange(x.shape[0]) == 5, jnp.nan, _xent(p, x, y))
    return jnp.mean(jnp.where(jnp.isnan(per), 0.0, per)), {"max": jnp.max(per),
                                                           "min": jnp.min(per)}


def _key_in_aux(p, x, y, key):
    # A key advanced (noise per pass) and returned for the next step. (A
    # lax loop here: jax 0.10.2 cannot differentiate one under jax_scan3.)
    total = 0.0
    for _ in range(3):
        key, sub = jax.random.split(key)
        total += jnp.mean(_xent(p, x + 0.1 * jax.random.normal(sub, x.shape), y))
    return total, key


def _key_in_aux_fori(p, x, y, key):
    # The same in a lax.fori_loop: the key comes out of the loop's carry.
    def body(i, carry):
        k, total = carry
        k, sub = jax.random.split(k)
        return k, total + jnp.mean(_xent(p, x + 0.1 * jax.random.normal(sub, x.shape), y))
    key, total = lax.fori_loop(0, 3, body, (key, 0.0))
    return total, key


_ADJACENCY = jsparse.BCOO.fromdense(
    (RNG.random((B, B)) < 0.1).astype(np.float32) + np.eye(B, dtype=np.float32))


def _sparse_adjacency(p, x, y):
    # A GCN over the batch's nodes: a closed-over jax.experimental.sparse matrix.
    h = jnp.tanh(_ADJACENCY @ (x @ p["w"]))
    return jnp.mean((_ADJACENCY @ (h @ p["v"])) ** 2)


# name: (loss, extra arguments after (params, x, y), has_aux)
CASES = {
    "sum": (_sum, (), False),
    "masked_mean": (_masked_mean, (MASK,), False),
    "divided_plus_decay": (_divided_plus_decay, (), False),
    "halved": (_halved, (), False),
    "variance": (_variance, (), False),
    "standardized_target": (_standardized_target, (), False),
    "aux_statistics": (_aux_statistics, (), True),
    "class_weighted": (_class_weighted, (CLASS_WEIGHTS,), False),
    "closed_over_scale": (_closed_over_scale, (), False),
    "dropout_passed": (_dropout_passed, (KEY,), True),
    "dropout_closed_over": (_dropout_closed_over, (), True),
    "batch_normalized": (_batch_normalized, (), False),
    "info_nce": (_info_nce, (), False),
    "hard_mining": (_hard_mining, (), False),
    "argsort_weighted": (_argsort_weighted, (), False),
    "cond_on_batch_mean": (_cond_on_batch_mean, (), False),
    "graph_pooling": (_graph_pooling, (), False),
    "halves": (_halves, (), False),
    "custom_vjp_clip": (_custom_vjp_clip, (), False),
    "custom_vjp_on_a_param": (_custom_vjp_on_a_param, (), False),
    "relu_at_zero": (_relu_at_zero, (), False),
    "debug_print": (_debug_print, (), False),
    "nan_row_max": (_nan_row_max, (), True),
    "key_in_aux": (_key_in_aux, (KEY,), True),
    "key_in_aux_fori": (_key_in_aux_fori, (KEY,), True),
    "sparse_adjacency": (_sparse_adjacency, (), False),
}


def _mesh(kind):
    return jax.make_mesh((N,), ("data",), axis_types=(kind,))


def _placed(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _params(name):
    if name == "flax_batchnorm":
        return jax.tree_util.tree_map(np.asarray, _BN_VARS["params"])
    return PARAMS


def _run(loss, mesh, params, batch, extra, has_aux, **options):
    options.setdefault("min_size", 0)
    options.setdefault("num_skip", 0)

    def step(p, x, y, *extra):
        grad_fn = sr.value_and_grad(loss, mesh, "data", step=3, has_aux=has_aux, **options)
        return grad_fn(p, x, y, *extra)

    with jax.set_mesh(mesh):
        params = _placed(mesh, params, P())
        x, y = (_placed(mesh, a, P("data")) for a in batch)
        return jax.jit(step)(params, x, y, *extra)


def _assert_close(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree_util.tree_leaves(want), strict=True):
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert np.shape(g) == np.shape(w), where
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.prng_key):
            assert jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key), where
            g, w = jax.random.key_data(g), jax.random.key_data(w)
        if np.issubdtype(np.asarray(w).dtype, np.inexact):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6, err_msg=where)
        else:
            np.testing.assert_array_equal(g, w, err_msg=where)


CASES["flax_batchnorm"] = (_flax_batchnorm, (), True)


# jax.value_and_grad itself cannot differentiate a lax loop under jax_scan3.
_MARKS = {"key_in_aux_fori": under_scan3_ring}


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=_MARKS.get(n, ())) for n in sorted(CASES)])
def test_num_skip_zero_is_jax_value_and_grad(name, kind):
    loss, extra, has_aux = CASES[name]
    params = _params(name)
    want_out, want_grads = jax.jit(jax.value_and_grad(loss, has_aux=has_aux))(
        params, X, LABELS, *extra)
    out, grads = _run(loss, _mesh(kind), params, (X, LABELS), extra, has_aux)
    _assert_close(out, want_out, "value")
    _assert_close(grads, want_grads, "grads")


@pytest.mark.parametrize("name", ["masked_mean", "info_nce", "dropout_passed",
                                  "custom_vjp_clip", "graph_pooling", "flax_batchnorm"])
def test_with_skipping_the_replicas_agree_and_the_grads_change(name):
    loss, extra, has_aux = CASES[name]
    mesh = _mesh(AxisType.Explicit)
    params = _params(name)
    # With the first-step check on (step 3 here: compiled in, not run; the
    # planted test below runs it).
    (out, exact), (skipped_out, skipped) = (
        _run(loss, mesh, params, (X, LABELS), extra, has_aux, num_skip=k, check=True)
        for k in (0, 4))
    _assert_close(skipped_out, out, "value")  # the forward pass is the same
    sr.assert_replicated(skipped, mesh)
    assert any(not np.allclose(a, b) for a, b in zip(
        jax.tree_util.tree_leaves(skipped), jax.tree_util.tree_leaves(exact)))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_dropout_masks_are_jax_jits_row_by_row(kind):
    (_, keep), _ = _run(_dropout_passed, _mesh(kind), PARAMS, (X, LABELS), (KEY,), True)
    (_, want), _ = jax.jit(jax.value_and_grad(_dropout_passed, has_aux=True))(
        PARAMS, X, LABELS, KEY)
    np.testing.assert_array_equal(keep, want)
    assert len({np.asarray(r).tobytes() for r in np.split(np.asarray(keep), N)}) == N


def _jax_differentiates_scan():
    """False where JAX itself cannot (``jax_scan3`` at 0.10.2: NotImplementedError)."""
    try:
        jax.grad(lambda w: lax.scan(lambda c, x: (c * w + x, None), 0.0, jnp.ones(3))[0])(1.0)
    except NotImplementedError:
        return False
    return True


@pytest.mark.skipif(not _jax_differentiates_scan(),
                    reason="JAX itself cannot differentiate this scan (jax_scan3 at 0.10.2)")
def test_time_major_batch_split_along_its_layout():
    mesh = _mesh(AxisType.Explicit)
    xs = RNG.normal(size=(5, B, 4)).astype(np.float32)
    want, want_grads = jax.jit(jax.value_and_grad(_time_major))(PARAMS, xs, LABELS)
    with jax.set_mesh(mesh):
        grad_fn = jax.jit(lambda p, x, y: sr.value_and_grad(
            _time_major, mesh, "data", step=0, num_skip=0, min_size=0)(p, x, y))
        got, grads = grad_fn(_placed(mesh, PARAMS, P()), _placed(mesh, xs, P(None, "data")),
                             _placed(mesh, LABELS, P("data")))
    _assert_close(got, want, "value")
    _assert_close(grads, want_grads, "grads")


def test_what_is_gathered_is_reported():
    mesh = _mesh(AxisType.Explicit)
    grad_fn = sr.value_and_grad(_info_nce, mesh, "data", step=0, num_skip=0, min_size=0)
    with jax.set_mesh(mesh):
        jax.jit(lambda p, x, y: grad_fn(p, x, y))(
            _placed(mesh, PARAMS, P()), _placed(mesh, X, P("data")),
            _placed(mesh, LABELS, P("data")))
    assert grad_fn.report.gathered.get("dot_general") == B * H  # z gathered for z @ z.T
    grad_fn = sr.value_and_grad(_masked_mean, mesh, "data", step=0, num_skip=0, min_size=0)
    with jax.set_mesh(mesh):
        jax.jit(lambda p, x, y, m: grad_fn(p, x, y, m))(
            _placed(mesh, PARAMS, P()), _placed(mesh, X, P("data")),
            _placed(mesh, LABELS, P("data")), MASK)
    assert grad_fn.report.gathered == {}  # sums and means: a psum each, nothing gathered


class _SyncedBN(linen.Module):
    @linen.compact
    def __call__(self, x):
        return linen.BatchNorm(use_running_average=False, axis_name="data")(x)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_a_loss_that_reduces_over_the_data_axis_itself_is_refused_by_name(kind):
    def pmean(p, x, y):
        return jnp.mean(lax.pmean(x @ p["w"], "data"))

    variables = {"params": {"BatchNorm_0": {"scale": jnp.ones(H), "bias": jnp.zeros(H)}},
                 "batch_stats": {"BatchNorm_0": {"mean": jnp.zeros(H), "var": jnp.ones(H)}}}

    def synced_batchnorm(p, x, y):
        out, _ = _SyncedBN().apply(variables, x @ p["w"], mutable=["batch_stats"])
        return jnp.mean(out ** 2)

    for loss in (pmean, synced_batchnorm):
        with pytest.raises(ValueError, match=r"reduces over the data axes \['data'\] itself"):
            _run(loss, _mesh(kind), PARAMS, (X, LABELS), (), False)


def test_mean_count_and_rank_key_are_not_needed_but_still_work():
    """The old helpers: mean_count is the count, rank_key the key (already global)."""
    def loss(p, x, y, m, key):
        keep = jax.random.bernoulli(sr.rank_key(key, "data"), 0.9, (x.shape[0], H))
        err = jnp.mean(jnp.where(keep, _hidden(p, x), 0.0) ** 2, axis=1)
        return jnp.sum(m * err) / sr.mean_count(jnp.sum(m))

    def plain(p, x, y, m, key):
        keep = jax.random.bernoulli(key, 0.9, (x.shape[0], H))
        err = jnp.mean(jnp.where(keep, _hidden(p, x), 0.0) ** 2, axis=1)
        return jnp.sum(m * err) / jnp.sum(m)

    want = jax.jit(jax.value_and_grad(plain))(PARAMS, X, LABELS, MASK, KEY)
    got = _run(loss, _mesh(AxisType.Explicit), PARAMS, (X, LABELS), (MASK, KEY), False)
    _assert_close(got, want, "")


@functools.cache
def _microbatched_reference():
    def loss(p, x, y):
        return jnp.mean(_xent(p, x, y)), jnp.max(_xent(p, x, y))

    parts = [(X.reshape(N, -1, 2, D)[:, :, j].reshape(-1, D),
              LABELS.reshape(N, -1, 2)[:, :, j].reshape(-1)) for j in range(2)]
    outs = [jax.value_and_grad(loss, has_aux=True)(PARAMS, *part) for part in parts]
    return loss, outs


def test_microbatches_are_the_mean_over_global_micro_batches():
    loss, outs = _microbatched_reference()
    (value, aux), grads = _run(loss, _mesh(AxisType.Auto), PARAMS, (X, LABELS), (), True,
                               microbatches=2)
    np.testing.assert_allclose(value, np.mean([o[0][0] for o in outs]), rtol=1e-5)
    np.testing.assert_allclose(aux, [o[0][1] for o in outs], rtol=1e-5)
    _assert_close(grads, jax.tree_util.tree_map(lambda a, b: (a + b) / 2, outs[0][1], outs[1][1]),
                  "grads")


def _forgets_the_psum(eqn, vals, layouts, report):
    """A planted bug: a sum over the rows without its psum (each rank's own sum)."""
    d = layouts[0]
    if d is None or d not in eqn.params["axes"]:
        return sr._steps.partition._RULES_BEFORE_PLANT["reduce_sum"](eqn, vals, layouts, report)
    out = eqn.primitive.bind(*vals, **eqn.params)
    return [out], [None]


@pytest.fixture
def planted(monkeypatch):
    from skipreduce_jax._steps import partition as _partition

    monkeypatch.setattr(sr, "_partition", _partition, raising=False)
    monkeypatch.setattr(_partition, "_RULES_BEFORE_PLANT", dict(_partition._RULES), raising=False)
    monkeypatch.setitem(_partition._RULES, "reduce_sum", _forgets_the_psum)


@pytest.mark.parametrize("num_skip", [0, 4])
def test_the_first_step_check_names_a_planted_mismatch(planted, num_skip, capfd):
    mesh = _mesh(AxisType.Explicit)

    def run(step, check=True):  # off by default: on here
        def train_step(p, x, y, m):
            return sr.value_and_grad(_masked_mean, mesh, "data", step=step, check=check,
                                     num_skip=num_skip, min_size=0)(p, x, y, m)
        with jax.set_mesh(mesh):
            value, _ = jax.jit(train_step)(
                _placed(mesh, PARAMS, P()), _placed(mesh, X, P("data")),
                _placed(mesh, LABELS, P("data")), MASK)
            return float(value)

    assert np.isnan(run(0))
    assert "first-step check found the value different" in capfd.readouterr().err
    wrong = run(1)  # after the first step the check does not run
    assert not np.isnan(wrong)
    assert not np.isclose(wrong, _masked_mean(PARAMS, X, LABELS, MASK), rtol=1e-3)
    assert not np.isnan(run(0, check=False))  # and check=False leaves it out
    assert "first-step check" not in capfd.readouterr().err


@pytest.mark.parametrize("num_skip", [0, 4])
def test_a_zero_size_leaf_beside_others_crosses_no_collective(num_skip):
    """XLA:CPU at jax 0.11.2 crashes compiling a collective of a zero-size array."""
    mesh = _mesh(AxisType.Explicit)
    params = {**PARAMS, "empty": np.zeros((0, H), np.float32)}

    def loss(p, x, y):
        return jnp.mean(_xent(p, x, y)) + jnp.sum(p["empty"])

    def step(p, x, y):
        return sr.value_and_grad(loss, mesh, "data", step=1, num_skip=num_skip,
                                 min_size=0)(p, x, y)

    with jax.set_mesh(mesh):
        args = (_placed(mesh, params, P()), _placed(mesh, X, P("data")),
                _placed(mesh, LABELS, P("data")))
        value, grads = jax.jit(step)(*args)
        assert not zero_size_collectives(jax.jit(step).lower(*args).as_text())
    assert grads["empty"].shape == (0, H)
    if num_skip == 0:
        want, want_grads = jax.value_and_grad(loss)(params, X, LABELS)
        _assert_close(value, want, "value")
        _assert_close(grads, want_grads, "grads")


def test_make_train_steps_zero_size_leaf_crosses_no_collective():
    mesh = _mesh(AxisType.Auto)
    params = {**PARAMS, "empty": np.zeros((0, H), np.float32)}
    tx = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0), optax.sgd(0.1))

    def loss(p, batch):
        x, y = batch
        return jnp.mean(_xent(p, x, y)) + jnp.sum(p["empty"])

    placed = sr.replicate(params, mesh)
    opt_state = sr.init_opt_state(tx, placed, mesh, "data")
    step = sr.make_train_step(loss, tx, mesh, "data")
    batch = sr.shard_batch((X, LABELS), mesh)
    text = step.lower(placed, opt_state, batch).as_text()
    new, _, _ = step(placed, opt_state, batch)
    assert new["empty"].shape == (0, H)
    assert not zero_size_collectives(text)


def test_the_users_own_shard_map_over_the_data_axis_is_refused_by_name():
    mesh = _mesh(AxisType.Auto)

    def loss(p, x, y):
        total = jax.shard_map(lambda h: lax.psum(jnp.sum(h), "data"), mesh=mesh,
                              in_specs=P("data"), out_specs=P())(_hidden(p, x))
        return total / x.shape[0]

    with pytest.raises(ValueError, match=r"calls a jax.shard_map manual over the data axes"):
        _run(loss, mesh, PARAMS, (X, LABELS), (), False)


def test_each_rank_draws_only_its_rows_of_a_dropout_mask():
    """The bits of a mask's block need none of the rest (threefry, partitionable)."""
    mesh = _mesh(AxisType.Explicit)
    x = np.ones((N * 16, D), np.float32)

    def loss(p, x, key):
        h = _hidden(p, x)
        return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, 0.0) ** 2)

    def step(p, x, key):
        return sr.value_and_grad(loss, mesh, "data", step=1, num_skip=0, min_size=0)(p, x, key)
    with jax.set_mesh(mesh):
        text = jax.jit(step).lower(_placed(mesh, PARAMS, P()), _placed(mesh, x, P("data")),
                                   KEY).compile().as_text()
    assert f"u32[16,{H}]" in text and f"u32[{N * 16},{H}]" not in text


def test_microbatches_with_a_closed_over_batch_are_refused_by_name():
    mesh = _mesh(AxisType.Auto)

    def step(p, x, y):
        return sr.value_and_grad(lambda p: jnp.mean(_xent(p, x, y)), mesh, "data", step=0,
                                 num_skip=0, min_size=0, microbatches=2)(p)

    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"closes over.*as an argument"):
        jax.jit(step)(PARAMS, X, LABELS)


# More losses written for the global batch, each crossing rows its own way
# (rolls, flips, strides, Gram matrices, percentiles, segment maxima, scans
# over the rows). All were exact when first run; kept so they stay so.
MB, MD = 64, 6
MX = RNG.normal(size=(MB, MD)).astype(np.float32)
MY = RNG.integers(0, 4, size=MB).astype(np.int32)
MW = RNG.normal(size=(MD, 4)).astype(np.float32)


def _out(w, x):
    return x @ w


MORE = {
    "norm_over_batch": lambda w, x, y: jnp.linalg.norm(_out(w, x)),
    "one_hot": lambda w, x, y: (
        jnp.mean(jnp.sum(jax.nn.one_hot(y, 4) * jax.nn.log_softmax(_out(w, x)), -1))),
    "roll_rows": lambda w, x, y: jnp.mean((_out(w, x) - jnp.roll(_out(w, x), 1, axis=0)) ** 2),
    "flip_rows": lambda w, x, y: jnp.mean(_out(w, x) * jnp.flip(_out(w, x), 0)),
    "strided": lambda w, x, y: jnp.mean(_out(w, x)[::2] ** 2),
    "gram_features": lambda w, x, y: jnp.sum((_out(w, x).T @ _out(w, x)) ** 2) / 1e3,
    "softmax_over_batch": lambda w, x, y: jnp.sum(jax.nn.softmax(_out(w, x), axis=0) * _out(w, x)),
    "percentile": lambda w, x, y: jnp.percentile(_out(w, x)[:, 0], 90.0),
    "bincount": lambda w, x, y: (
        jnp.mean(_out(w, x)) * jnp.bincount(y, length=4)[0].astype(jnp.float32)),
    "logsumexp_batch": lambda w, x, y: jax.nn.logsumexp(_out(w, x)),
    "std_ddof": lambda w, x, y: jnp.std(_out(w, x), ddof=1),
    "first_row": lambda w, x, y: jnp.sum(_out(w, x)[0] ** 2),
    "last_rows": lambda w, x, y: jnp.sum(_out(w, x)[-3:] ** 2),
    "reshape_pairs": lambda w, x, y: jnp.mean(_out(w, x).reshape(MB // 2, 2, 4).sum(1) ** 2),
    "reshape_flat": lambda w, x, y: jnp.mean(jnp.cumsum(_out(w, x).reshape(-1)) ** 2) / 100,
    "outer_batch": lambda w, x, y: (
        jnp.mean(jnp.tanh(_out(w, x)[:, None, 0] - _out(w, x)[None, :, 0]))),
    "argmax_acc": lambda w, x, y: (
        jnp.mean(_out(w, x) ** 2),
        jnp.mean((jnp.argmax(_out(w, x), -1) == y).astype(jnp.float32))),
    "take_along": lambda w, x, y: (
        -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(_out(w, x)), y[:, None], 1))),
    "optax_xent": lambda w, x, y: (
        optax.softmax_cross_entropy_with_integer_labels(_out(w, x), y).mean()),
    "where_mask": lambda w, x, y: (
        jnp.sum(jnp.where(y[:, None] > 1, _out(w, x), 0.0) ** 2) / jnp.maximum(jnp.sum(y > 1), 1)),
    "clip_by_global": lambda w, x, y: (
        jnp.mean(jnp.clip(_out(w, x), -jnp.max(jnp.abs(_out(w, x))) / 2, None))),
    "sort_hardest": lambda w, x, y: jnp.mean(jnp.sort(jnp.sum(_out(w, x) ** 2, -1))[-8:]),
    "matrix_T_batch": lambda w, x, y: jnp.mean((x.T @ x) @ w),
    "vmap_per_example": lambda w, x, y: jnp.mean(jax.vmap(lambda xi: jnp.sum(jnp.tanh(xi @ w)))(x)),
    "scan_over_batch": lambda w, x, y: (
        lax.scan(lambda c, r: (c + jnp.sum(r @ w) ** 2 / 100, None), 0.0, x)[0]),
    "fori": lambda w, x, y: lax.fori_loop(0, 3, lambda i, c: c + jnp.mean(_out(w, x) * i), 0.0),
    "int_div": lambda w, x, y: jnp.mean(_out(w, x)) + (jnp.sum(y) // 7).astype(jnp.float32),
    "dynamic_index": lambda w, x, y: jnp.sum(_out(w, x)[jnp.argmax(y)] ** 2),
    "searchsorted": lambda w, x, y: (
        jnp.mean(_out(w, x)) * jnp.searchsorted(jnp.sort(x[:, 0]), 0.0).astype(jnp.float32)),
    "expand_tile": lambda w, x, y: jnp.mean(jnp.tile(_out(w, x), (2, 1)) ** 2),
    "concat_self": lambda w, x, y: jnp.mean(jnp.concatenate([_out(w, x), -_out(w, x)], 0) ** 3),
    "stack_axis0": lambda w, x, y: jnp.mean(jnp.stack([_out(w, x), _out(w, x) * 2]) ** 2),
    "pad_rows": lambda w, x, y: jnp.mean(jnp.pad(_out(w, x), ((1, 0), (0, 0))) ** 2),
    "repeat_rows": lambda w, x, y: jnp.mean(jnp.repeat(_out(w, x), 2, axis=0) ** 2),
    "diff_rows": lambda w, x, y: jnp.mean(jnp.diff(_out(w, x), axis=0) ** 2),
    "lax_top_k_cols": lambda w, x, y: jnp.mean(lax.top_k(_out(w, x), 2)[0]),
    "segment_max": lambda w, x, y: (
        jnp.sum(jax.ops.segment_max(_out(w, x)[:, 0], y, num_segments=4))),
    "interleave": lambda w, x, y: jnp.mean(_out(w, x)[::-1][1::3] ** 2),
}


@pytest.mark.slow  # 76 compiles: test-slow, in CI
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("name", sorted(MORE))
def test_more_losses_are_exact(name, kind):
    loss = MORE[name]
    aux = isinstance(jax.eval_shape(loss, MW, MX, MY), tuple)
    ref = jax.value_and_grad(loss, has_aux=aux)(MW, MX, MY)
    mesh = jax.make_mesh((N,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh):
        x, y = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (MX, MY))
        got = jax.jit(lambda w, x, y: sr.value_and_grad(
            loss, step=0, num_skip=0, has_aux=aux, min_size=0)(w, x, y))(MW, x, y)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_bfloat16_values_every_rank_computes_whole_on_a_two_axis_mesh():
    """A bfloat16 aux from the params, and a bfloat16 max over the batch with
    a NaN row, SkipReduce over one axis of two: jax's values (no XLA:CPU abort
    compiling a 16-bit all-reduce, NaN kept), and jax's grads."""
    def loss(w, x):
        per = jnp.tanh(x @ w).astype(jnp.bfloat16)
        per = jnp.where(jnp.arange(x.shape[0])[:, None] == 3, jnp.nan, per)
        clean = jnp.where(jnp.isnan(per), 0, per).astype(jnp.float32)
        return jnp.mean(clean ** 2), {"w": w.astype(jnp.bfloat16), "max": jnp.max(per)}
    w = (RNG.normal(size=(D, H)) * 0.3).astype(np.float32)
    want = jax.jit(jax.value_and_grad(loss, has_aux=True))(w, X)
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"))
    with jax.set_mesh(mesh):
        x = _placed(mesh, X, P(("replica", "fsdp")))
        got = jax.jit(sr.value_and_grad(loss, mesh, "replica", step=0, num_skip=0,
                                        min_size=0, has_aux=True))(w, x)
    assert got[0][1]["w"].dtype == jnp.bfloat16 and np.isnan(float(got[0][1]["max"]))
    _assert_close(got, want, "out")


def test_a_small_argument_beside_the_batch_is_whole_where_nothing_shows_its_layout():
    """A raw uint32[2] key on 2 ranks: not a batch of 2 rows (it has not the batch's)."""
    def loss(w, x, key):
        noise = jax.random.normal(key, (x.shape[0], H))
        return jnp.mean((jnp.tanh(x @ w) - noise) ** 2)
    w, key = PARAMS["w"], jax.random.PRNGKey(2)
    want = jax.jit(jax.value_and_grad(loss))(w, X, key)
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2,), ("data",), axis_types=(kind,), devices=jax.devices()[:2])
        with jax.set_mesh(mesh):
            got = jax.jit(sr.value_and_grad(loss, mesh, step=0, num_skip=0, min_size=0))(
                w, _placed(mesh, X, P("data")), key)
        _assert_close(got, want, kind.name)


def test_a_zero_size_param_placed_over_the_data_axis():
    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"]) ** 2) + jnp.sum(x[:, :0] @ p["extra"])
    p = {"w": PARAMS["w"], "extra": np.zeros((0, 5), np.float32)}
    want = jax.jit(jax.value_and_grad(loss))(p, X)
    mesh = jax.make_mesh((N,), ("data",))
    with jax.set_mesh(mesh):
        placed = {"w": _placed(mesh, p["w"], P(None, "data")),
                  "extra": _placed(mesh, p["extra"], P("data"))}
        got = jax.jit(sr.value_and_grad(loss, mesh, step=0, num_skip=0, min_size=0))(
            placed, _placed(mesh, X, P("data")))
    _assert_close(got, want, "out")
    assert got[1]["w"].sharding.spec == P(None, "data")
