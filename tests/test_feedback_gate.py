"""skip_reduce(error_feedback="auto"): error feedback while its rule says so."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import line_mesh, per_rank
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._optax import gate as _gate

N = 8
KW = dict(num_skip=4, min_size=0, seed=5)


def _grads(seed=0, size=3000):
    return np.random.default_rng(seed).normal(size=(N, size)).astype(np.float32)


def _one_step(tx, grads, params, gate=None):
    """tx's first update on each rank; ``gate``: (overshooting, nonlinear) set."""
    def f(g, params):
        state = tx.init(params)
        if gate is not None:
            state = state._replace(overshooting=jnp.float32(gate[0]),
                                   nonlinear=jnp.float32(gate[1]))
        out, state = tx.update(g, state, params)
        skip = state.skip if isinstance(state, sr.FeedbackGateState) else state
        return out, skip.residual
    return per_rank(f, grads, n=N, replicated_args=(params,))


@pytest.mark.parametrize("overshooting, nonlinear, feeds", [
    (0.45, 0.01, True),   # SGD, steps rarely overshoot: error feedback
    (0.75, 0.01, False),  # at the edge of stability
    (0.45, 0.9, False),   # an adaptive optimizer (AdamW)
    (1.0, 1.0, False),    # as it starts
])
def test_the_gate_picks_error_feedback_or_random_exactly(overshooting, nonlinear, feeds):
    grads, params = _grads(), np.zeros(3000, np.float32)
    auto = _one_step(sr.skip_reduce("i", error_feedback="auto", **KW), grads, params,
                     (overshooting, nonlinear))
    fed = _one_step(sr.skip_reduce("i", error_feedback=True, **KW), grads, params)
    dropped = _one_step(sr.skip_reduce("i", **KW), grads, params)
    want = fed[0] if feeds else dropped[0]
    np.testing.assert_array_equal(auto[0], want)
    assert not np.array_equal(fed[0], dropped[0])  # the two differ
    if feeds:
        np.testing.assert_array_equal(auto[1], fed[1])
        assert np.any(auto[1] != 0)
    else:  # what was left out is dropped, as Random drops it
        assert not np.any(auto[1])


def test_the_overshoot_mean_counts_steps_that_point_along_the_last():
    state = _gate.init(sr.SkipReduceState(jnp.int32(0), None, None, None),
                       {"w": jnp.zeros(4)})
    p = jnp.zeros(4)

    def step(state, g):  # each step moves the params by e_0
        nonlocal p
        skip = state.skip._replace(count=state.skip.count + 1)
        p = p.at[0].add(1.0)
        return _gate.advance(state, skip, {"w": jnp.asarray(g)}, {"w": p})

    state = step(state, [-2.0, 5, 0, 0])  # the first step has no last step
    assert float(state.overshooting) == 1
    for _ in range(3):  # <g, p_t - p_(t-1)> = -2 < 0: does not overshoot
        state = step(state, [-2.0, 5, 0, 0])
    m = 1 - _gate.MEMORY
    assert float(state.overshooting) == pytest.approx(m ** 3)
    state = step(state, [2.0, 5, 0, 0])  # +2 > 0: overshoots
    assert float(state.overshooting) == pytest.approx(m ** 4 + _gate.MEMORY)


def test_the_overshoot_test_weighs_each_leafs_sample_by_its_size():
    """<g, p_(t+1) - p_t> from SAMPLE elements per leaf, scaled back to all of them.

    Every element moved by +1. The big leaf's gradient, -0.01 on 1024
    elements, outweighs the small leaf's +1 on 4 (-10.24 + 4 < 0: no
    overshoot); its 256 sampled elements alone would not (-2.56 + 4 > 0).
    """
    params = {"big": jnp.zeros(1024), "small": jnp.zeros(4)}
    state = _gate.init(sr.SkipReduceState(jnp.int32(1), None, None, None), params)
    moved = jax.tree_util.tree_map(lambda p: p + 1.0, params)
    g = {"big": jnp.full(1024, -0.01), "small": jnp.ones(4)}
    state = _gate.advance(state, state.skip, g, moved)
    m = 1 - _gate.MEMORY
    assert float(state.overshooting) == pytest.approx(m)
    g = {"big": jnp.full(1024, -0.001), "small": jnp.ones(4)}  # -1.024 + 4 > 0
    state = _gate.advance(state, state.skip, g, jax.tree_util.tree_map(
        lambda p: p + 1.0, moved))
    assert float(state.overshooting) == pytest.approx(m * m + _gate.MEMORY)


@pytest.mark.parametrize("growth, trips", [(1.0, False), (1.5, False), (4.0, True)])
def test_the_gate_shuts_for_good_when_the_steps_grow_while_it_feeds_back(growth, trips):
    """Shut, the steps have norm 1; open, they grow to ``growth``: beyond 2x it trips."""
    params = {"w": jnp.zeros(8)}
    state = _gate.init(sr.SkipReduceState(jnp.int32(0), None, None, None), params)
    p = jnp.zeros(8)

    def step(state, size):
        nonlocal p
        skip = state.skip._replace(count=state.skip.count + 1)
        p = p.at[0].add(size)
        state = _gate.advance(state, skip, {"w": -jnp.ones(8)}, {"w": p})  # never overshoots
        return state._replace(nonlinear=linear)  # as SGD reads from step 40 on

    linear = jnp.float32(1.0)
    for _ in range(40):
        state = step(state, 1.0)
    assert float(state.calm) == pytest.approx(1.0) and not bool(state.tripped)
    linear = jnp.float32(0.0)
    state = state._replace(nonlinear=linear)  # the rule holds: it opens
    mesh = jax.make_mesh((N,), ("data",))
    is_open = jax.jit(jax.shard_map(lambda s: _gate.is_open(s, ("data",)), mesh=mesh,
                                    in_specs=P(), out_specs=P()))
    assert bool(is_open(state))
    for _ in range(20):
        state = step(state, growth)
    if not trips:  # open all along: the mean of the steps taken shut is kept
        assert float(state.calm) == pytest.approx(1.0)
    assert bool(state.tripped) == trips and bool(is_open(state)) == (not trips)


def test_unexplained_is_zero_for_a_momentum_step_and_large_for_a_normalized_one():
    rng = np.random.default_rng(0)
    last_step, grad = rng.normal(size=(2, 3, 256)).astype(np.float32)
    grad *= np.logspace(-3, 0, 3, dtype=np.float32)[:, None]  # leaves' scales differ
    momentum = 0.9 * last_step - 0.1 * grad
    assert float(_gate.unexplained(momentum, last_step, grad)) < 1e-5
    scale = np.sqrt(grad ** 2 + 1e-8)  # as Adam divides each element
    adam = 0.9 * last_step - 0.1 * grad / scale
    assert float(_gate.unexplained(adam, last_step, grad)) > 0.5
    assert float(_gate.unexplained(momentum, last_step, 0 * grad)) == 1


def test_batchnorm_keeps_the_gate_shut():
    # exact_radial is BatchNorm's remedy, and error feedback would turn it off.
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 4, 16))
    params = {"Conv_0": {"k": kernel, "b": jnp.zeros(16)},
              "BatchNorm_0": {"scale": jnp.ones(16)}}
    rng = np.random.default_rng(2)
    grads = jax.tree_util.tree_map(
        lambda p: rng.normal(size=(N,) + p.shape).astype(np.float32), params)
    auto = _one_step(sr.skip_reduce("i", error_feedback="auto", **KW), grads, params,
                     (0.45, 0.01))
    radial = _one_step(sr.skip_reduce("i", **KW), grads, params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, auto[0], radial[0])
    assert not any(np.any(r) for r in jax.tree_util.tree_leaves(auto[1]))


def test_comm_stats_counts_what_auto_sends():
    # "auto" sends Random's bytes: with BatchNorm, its radial all-reduce too.
    kernel = jnp.zeros((3, 3, 4, 16))
    plain = {"Dense_0": {"kernel": jnp.zeros((64, 32)), "bias": jnp.zeros(32)}}
    batchnorm = {"Conv_0": {"kernel": kernel, "bias": jnp.zeros(16)},
                 "BatchNorm_0": {"scale": jnp.ones(16), "bias": jnp.zeros(16)}}
    for params in (plain, batchnorm):
        stats = {ef: sr.comm_stats(params, N, params=params, error_feedback=ef, **KW)
                 for ef in (False, True, "auto")}
        assert stats["auto"] == stats[False]
    assert stats[True].bytes_per_device < stats[False].bytes_per_device  # no radial


def _linear_loss(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _train(tx, steps=30):
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(0)
    params = sr.replicate({"w": jnp.zeros((16, 4)), "b": jnp.zeros(4)}, mesh)
    state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(_linear_loss, tx, mesh, "data", donate=False)
    place = NamedSharding(mesh, P("data"))
    for _ in range(steps):
        x = rng.normal(size=(N * 8, 16)).astype(np.float32)
        y = x[:, :4] * 0.5 + rng.normal(size=(N * 8, 4)).astype(np.float32)
        params, state, _ = step(params, state, jax.device_put((x, y), place))
        # One step in flight: XLA:CPU deadlocked here once on two busy cores
        # (seven device threads in an all-reduce, the eighth waiting to start).
        jax.block_until_ready(params)
    return params, state


def test_auto_trains_in_make_train_step_and_equals_the_all_reduce_at_k0():
    auto = sr.skip_reduce("data", num_skip=0, min_size=0, error_feedback="auto")
    params, state = _train(optax.chain(auto, optax.sgd(0.05, momentum=0.9)))
    plain, _ = _train(optax.chain(sr.skip_reduce("data", num_skip=0, min_size=0),
                                  optax.sgd(0.05, momentum=0.9)))
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, plain)
    gate = state[0]
    assert isinstance(gate, sr.FeedbackGateState)
    assert int(gate.skip.count) == 30
    assert 0 < float(gate.overshooting) < 1
    assert float(gate.nonlinear) < 0.3  # SGD: read as linear
    before_last, _ = _train(optax.chain(auto, optax.sgd(0.05, momentum=0.9)), steps=29)
    # The gate keeps a sample of the last params, never a copy of them.
    np.testing.assert_array_equal(gate.previous, _gate._sample(
        jax.tree_util.tree_leaves(before_last)))
    assert gate.previous.size == _gate.SAMPLE * len(jax.tree_util.tree_leaves(params))


def test_auto_skips_and_the_ranks_stay_identical():
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                    error_feedback="auto"), optax.sgd(0.01, momentum=0.9))
    params, state = _train(tx, steps=60)
    # The rule opened (it cannot before about 45 steps): both branches ran.
    assert float(state[0].overshooting) < _gate.OVERSHOOT
    assert any(np.any(np.asarray(r)) for r in jax.tree_util.tree_leaves(state[0].skip.residual))
    for leaf in jax.tree_util.tree_leaves((params, state[0].previous)):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(error_feedback="yes"), TypeError, "error_feedback='yes' must be a bool"),
    (dict(error_feedback="auto", params_sharded=True), ValueError,
     "error_feedback='auto' keeps the last params.*pass error_feedback=True or False"),
    (dict(error_feedback="auto", exact_radial=True), ValueError,
     "exact_radial=True works with replicated params and no error feedback"),
])
def test_bad_settings_are_refused_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        sr.skip_reduce("data", skip_ratio=0.5, **kwargs)


def test_auto_needs_params():
    tx = sr.skip_reduce("i", error_feedback="auto", **KW)
    with pytest.raises(ValueError, match="got params=None; call tx.init\\(params\\)"):
        tx.init(None)

    def f(g, params):
        return tx.update(g, tx.init(params))[0]
    with pytest.raises(ValueError, match="got params=None"):
        per_rank(f, _grads(), n=N, replicated_args=(np.zeros(3000, np.float32),))


def test_value_and_grad_needs_the_state_auto_carries():
    mesh = line_mesh(N, "data")
    grad_fn = sr.value_and_grad(lambda p, x: jnp.sum(p * x), mesh=mesh, axis_name="data",
                                step=0, skip_ratio=0.5, error_feedback="auto")
    with pytest.raises(ValueError, match="error_feedback='auto' keeps a residual per rank.*"
                                         "pass state="):
        grad_fn(jnp.ones(N), jnp.ones(N))


def _toy_loss(params, batch):
    x, y = batch
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.05, 10, 60)


@pytest.mark.parametrize("optimizer, linear", [
    (optax.sgd(0.05), True),
    (optax.chain(optax.clip_by_global_norm(0.1), optax.add_decayed_weights(1e-4),
                 optax.sgd(_SCHEDULE, momentum=0.9)), True),
    (optax.adamw(1e-3), False),
    (optax.rmsprop(1e-3), False),
    (optax.lion(1e-4), False),
])
def test_the_gate_reads_sgd_as_linear_and_adaptive_optimizers_as_not(optimizer, linear):
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(0)
    params = sr.replicate({
        "w1": jnp.asarray(rng.normal(size=(16, 64)) / 4, jnp.float32), "b1": jnp.zeros(64),
        "w2": jnp.asarray(rng.normal(size=(64, 4)) / 8, jnp.float32), "b2": jnp.zeros(4)},
        mesh)
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                    error_feedback="auto"), optimizer)
    state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(_toy_loss, tx, mesh, "data", donate=False)
    place = NamedSharding(mesh, P("data"))
    for _ in range(60):
        x = rng.normal(size=(N * 8, 16)).astype(np.float32)
        y = np.tanh(x[:, :4]) + 0.3 * rng.normal(size=(N * 8, 4)).astype(np.float32)
        params, state, _ = step(params, state, jax.device_put((x, y), place))
    assert (float(state[0].nonlinear) < _gate.NONLINEAR) == linear


@pytest.mark.parametrize("name, feeds", [
    ("4x2-explicit", True),  # the others: test-slow (CI runs them), for the fast suite's time
    *[pytest.param(n, f, marks=pytest.mark.slow) for n, f in (
        ("4x2-explicit", False), ("4x2-auto", False), ("4x2-auto", True),
        ("2x2x2", False), ("2x2x2", True))]])
def test_auto_on_params_sharded_by_the_compiler(name, feeds):
    # HSDP layouts: skip_reduce over "replica", params sharded over fast axes.
    from test_sharded_training import _loss, _setup

    def run(error_feedback, steps=4):
        mesh, specs, params, batch = _setup(name)
        tx = optax.chain(sr.skip_reduce("replica", skip_ratio=0.5, min_size=0,
                                        error_feedback=error_feedback),
                         optax.sgd(0.05, momentum=0.9))
        state = sr.init_opt_state(tx, params, mesh, "replica")
        if error_feedback == "auto" and feeds:  # the gate open from the start
            state = (state[0]._replace(overshooting=jnp.float32(0.3),
                                       nonlinear=jnp.float32(0.0)), *state[1:])
        step = sr.make_train_step(_loss, tx, mesh, "replica")
        for _ in range(steps):
            params, state, _ = step(params, state, batch)
        assert step._cache_size() == 1
        sr.assert_replicated(params, mesh)
        for k in params:
            assert params[k].sharding.is_equivalent_to(
                NamedSharding(mesh, specs[k]), params[k].ndim), k
        return params

    auto, want = run("auto"), run(feeds)
    for k in auto:
        np.testing.assert_array_equal(np.asarray(auto[k]), np.asarray(want[k]), err_msg=k)


def _mlp_loss(p, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)


@pytest.mark.parametrize("width, options, axes, gate_open", [
    pytest.param(320, {}, ("data",), False, marks=pytest.mark.slow),  # bias under min_size
    (320, {}, ("data",), True),                            # the same, the gate open
    pytest.param(32, dict(selective=sr.exclude("b"), min_size=0), ("data",), True,
                 marks=pytest.mark.slow),
    pytest.param(32, {}, ("data",), True, marks=pytest.mark.slow),  # all under min_size
    (320, dict(inner_axis="inner"), ("data", "inner"), True),
], ids=["min_size", "min_size-open", "selective", "small-model", "inner_axis"])
@pytest.mark.filterwarnings("ignore::skipreduce_jax.NothingSkippedWarning")
def test_auto_runs_when_a_leaf_is_left_out_of_skipping(width, options, axes, gate_open):
    """Before: "cond branches must have equal output types" on the first step.

    A leaf left out of skipping has an empty residual; the Random branch
    made it anew, typed the same on every rank, the feedback branch kept it
    typed per rank. Each step here equals error_feedback=True's (gate open)
    or Random's (shut).
    """
    rng = np.random.default_rng(0)
    params = {"w": (rng.normal(size=(width, width)) * 0.1).astype(np.float32),
              "b": np.zeros(width, np.float32)}
    x = rng.normal(size=(64, width)).astype(np.float32)
    mesh = jax.make_mesh((8,), axes) if len(axes) == 1 else jax.make_mesh((4, 2), axes)
    axis = axes[0] if len(axes) == 1 else axes
    results = {}
    for ef in ("auto", gate_open):
        tx = optax.chain(sr.skip_reduce("data", num_skip=1, error_feedback=ef, **options),
                         optax.sgd(0.1))
        state = sr.init_opt_state(tx, params, mesh, axis)
        if ef == "auto" and gate_open:  # as after 45 steps of SGD
            state = (state[0]._replace(overshooting=jnp.zeros_like(state[0].overshooting),
                                       nonlinear=jnp.zeros_like(state[0].nonlinear)),
                     *state[1:])
        step = sr.make_train_step(_mlp_loss, tx, mesh, axis)
        p, losses = params, []
        for _ in range(3):
            p, state, loss = step(p, state, (x, x))
            losses.append(float(loss))
        results[ef] = losses, p
    np.testing.assert_allclose(results["auto"][0], results[gate_open][0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(results["auto"][1]), jax.tree.leaves(results[gate_open][1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
