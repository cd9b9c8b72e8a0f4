"""pjit-style sharding code in the loss (``_replay``), with nothing patched.

A ``with_sharding_constraint`` with a ``NamedSharding`` of the global mesh,
and flax linen ``DenseGeneral`` kernels with several features under
``nn.with_partitioning`` / ``nn.with_logical_partitioning``, as a plain
``jax.jit`` training step has them, run in ``value_and_grad`` (whose loss
is traced as plain jit code and replayed per rank) and give what the step
without them gives. In the per-rank steps (``data_parallel``,
``make_train_step``), where such code cannot be traced, they are refused
with the fix.
"""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

# name: (shape, axes, axis type, data axis, the batch's global spec, w1's spec)
MESHES = {
    "data-8": ((8,), ("data",), AxisType.Explicit, "data", P("data"), P()),
    "4x2-explicit": ((4, 2), ("replica", "fsdp"), AxisType.Explicit, "replica",
                     P(("replica", "fsdp")), P(None, "fsdp")),
    "4x2-auto": ((4, 2), ("replica", "fsdp"), AxisType.Auto, "replica",
                 P(("replica", "fsdp")), P(None, "fsdp")),
    # Replicated params: data_parallel leaves fsdp Explicit inside (reshard).
    "4x2-explicit-replicated": ((4, 2), ("replica", "fsdp"), AxisType.Explicit,
                                "replica", P(("replica", "fsdp")), P()),
}
D_IN, HIDDEN, BATCH, STEPS = 8, 16, 32, 3


def _setup(name):
    shape, axes, axis_type, data, batch_spec, w1_spec = MESHES[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(axis_type,) * len(axes))
    rng = np.random.default_rng(0)
    specs = {"w1": w1_spec, "w2": P()}
    host = {"w1": rng.normal(size=(D_IN, HIDDEN)) * 0.3,
            "w2": rng.normal(size=(HIDDEN,)) * 0.3}
    params = {k: jax.device_put(v.astype(np.float32), NamedSharding(mesh, specs[k]))
              for k, v in host.items()}
    x = rng.normal(size=(BATCH, D_IN)).astype(np.float32)
    y = np.sin(x.sum(1)).astype(np.float32)
    return mesh, data, batch_spec, params, (x, y)


def _loss_fn(mesh, batch_spec, constrained):
    def loss(p, batch):
        x, y = batch
        if constrained:  # as a pjit step writes it, with the global mesh
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, batch_spec))
        h = jnp.tanh(x @ p["w1"])
        if constrained:
            h = jax.lax.with_sharding_constraint(
                h, NamedSharding(mesh, P(batch_spec[0], None)))
        return jnp.mean((h @ p["w2"] - y) ** 2)

    return loss


def _data_parallel_step(loss, tx, mesh, data):
    def local_step(params, opt_state, batch):
        value, grads = sr.local_value_and_grad(loss, data)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, data)

    return sr.data_parallel(local_step, mesh, data, batch_argnums=2)


def _train(name, api, constrained):
    mesh, data, batch_spec, params, batch = _setup(name)
    tx = optax.chain(sr.skip_reduce(data, num_skip=0), optax.adam(1e-2))
    loss = _loss_fn(mesh, batch_spec, constrained)
    step = (sr.make_train_step(loss, tx, mesh, data) if api == "make_train_step"
            else _data_parallel_step(loss, tx, mesh, data))
    opt_state = sr.init_opt_state(tx, params, mesh, data)
    losses = []
    for _ in range(STEPS):
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    return {k: np.asarray(v) for k, v in params.items()}, losses


@pytest.mark.parametrize("api", ["data_parallel", "make_train_step"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_constraint_naming_the_data_axis_in_a_per_rank_step(name, api):
    """Auto axes: the loss is replayed per rank, its constraints without the
    data axes, and trains as the unconstrained loss does. Explicit axes: a
    constraint there is JAX's assertion of a type, refused with the fix."""
    if MESHES[name][2] == AxisType.Explicit:
        axis = MESHES[name][3]
        with pytest.raises(ValueError, match=f"(?s){api}: the step runs per rank, in a "
                                             rf"shard_map where the data axes \['{axis}'\] "
                                             ".*value_and_grad"):
            _train(name, api, constrained=True)
        return
    (params, losses), (ref, ref_losses) = (_train(name, api, constrained=c)
                                           for c in (True, False))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-6, atol=1e-7)


def _lowered_value_and_grad(loss, mesh, data, params, x, specs):
    @jax.jit
    def step(p, x):
        return sr.value_and_grad(loss, mesh, data, step=0, num_skip=0,
                                 param_specs=specs)(p, x)

    return step.lower(params, x)


def test_a_constraint_naming_the_compiler_axes_is_kept():
    """Over the Auto axes left to the compiler the constraint stays."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def loss(w, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(("replica", "fsdp"))))
        return jnp.mean(x @ w)

    text = _lowered_value_and_grad(loss, mesh, "replica", jnp.ones(4), jnp.ones((16, 4)),
                                   P()).as_text()
    # Inside the manual region: over fsdp, replica dropped.
    assert '<@mesh, [{"fsdp"}, {}]>' in text.replace("sharding_constraint", "")


def test_a_spec_longer_than_the_value_is_refused_as_jax_refuses_it():
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def loss(w, x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("replica", None, None)))
        return jnp.mean(x @ w)

    with pytest.raises(ValueError) as plain:
        jax.jit(jax.value_and_grad(loss)).lower(jnp.ones(4), jnp.ones((16, 4)))
    with pytest.raises(ValueError) as ours:
        _lowered_value_and_grad(loss, mesh, "replica", jnp.ones(4), jnp.ones((16, 4)), P())
    assert str(ours.value).split("\n")[0] == str(plain.value).split("\n")[0]


# The reproducer: DenseGeneral with features=(4, 16) on (., 64) inputs.
RULES = (("embed", "fsdp"), ("heads", None), ("kv", None))


def _dense(logical):
    init = nn.initializers.xavier_uniform()
    kernel_init = (nn.with_logical_partitioning(init, ("embed", "heads", "kv")) if logical
                   else nn.with_partitioning(init, ("fsdp", None, None)))
    return nn.DenseGeneral(features=(4, 16), use_bias=False, kernel_init=kernel_init)


def _dense_setup(logical, axis_type):
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(axis_type,) * 2)
    model = _dense(logical)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, 64)).astype(np.float32)
    y = rng.normal(size=(BATCH, 4, 16)).astype(np.float32)
    boxed = model.init(jax.random.key(0), x[:1])["params"]
    specs = nn.get_partition_spec(boxed)
    if logical:
        specs = nn.logical_to_mesh(specs, RULES)
    assert specs["kernel"] == P("fsdp", None, None)
    params = jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)),
                          nn.unbox(boxed), specs)
    return mesh, model, params, (x, y)


def _dense_loss(model):
    def loss(p, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": p}, x) - y) ** 2)

    return loss


def _plain_jit_steps(logical, tx, steps):
    """The step as plain pjit code writes it (no mesh set: see below)."""
    mesh, model, params, batch = _dense_setup(logical, AxisType.Auto)
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P("replica"))) for a in batch)
    loss = _dense_loss(model)

    @jax.jit
    def step(p, s):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    state, losses = tx.init(params), []
    for _ in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return params, losses


def test_flax_fails_on_its_own_under_a_mesh():
    """The flax behaviour the steps work around, without this library."""
    mesh, model, params, (x, _) = _dense_setup(False, AxisType.Auto)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="only valid for values "
                                                             "of rank at least 3"):
        jax.jit(model.apply)({"params": params}, x)


@pytest.mark.parametrize("api", ["data_parallel", "make_train_step"])
@pytest.mark.parametrize("logical", [False, True], ids=["partitioning", "logical"])
def test_partitioned_dense_general_in_a_per_rank_step(logical, api):
    """Before: refused (flax's unboxing fails under the step's mesh)."""
    steps = 5
    ref, ref_losses = _plain_jit_steps(logical, optax.adam(1e-2), steps)
    mesh, model, params, batch = _dense_setup(logical, AxisType.Auto)
    chain = optax.chain(sr.skip_reduce("replica", num_skip=0), optax.adam(1e-2))
    loss = _dense_loss(model)
    step = (sr.make_train_step(loss, chain, mesh, "replica") if api == "make_train_step"
            else _data_parallel_step(loss, chain, mesh, "replica"))
    opt_state, losses = sr.init_opt_state(chain, params, mesh, "replica"), []
    with nn.logical_axis_rules(RULES):
        for _ in range(steps):
            params, opt_state, value = step(params, opt_state, batch)
            losses.append(float(value))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(params["kernel"]), np.asarray(ref["kernel"]),
                               rtol=1e-4, atol=1e-6)


def _value_and_grad_steps(loss, mesh, data, params, batch, specs, steps):
    """The plain pjit loop with ``sr.value_and_grad`` for the gradient line."""
    tx = optax.adam(1e-2)

    @jax.jit
    def step(p, s, batch, i):
        value, grads = sr.value_and_grad(loss, mesh, data, step=i, num_skip=0,
                                         param_specs=specs)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    state, losses = tx.init(params), []
    with jax.set_mesh(mesh):
        for i in range(steps):
            params, state, value = step(params, state, batch, i)
            losses.append(float(value))
    return params, losses


def _plain_steps(loss, mesh, params, batch, steps):
    """The same loop with jax.value_and_grad: the reference."""
    tx = optax.adam(1e-2)

    @jax.jit
    def step(p, s, batch):
        value, grads = jax.value_and_grad(loss)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    state, losses = tx.init(params), []
    with jax.set_mesh(mesh):
        for _ in range(steps):
            params, state, value = step(params, state, batch)
            losses.append(float(value))
    return params, losses


def _outcome(run):
    try:
        return run(), None
    except Exception as e:  # noqa: BLE001 -- compared with plain jit's
        return None, e


@pytest.mark.parametrize("placed", [False, True], ids=["host-batch", "placed-batch"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_global_named_sharding_constraint_works_in_value_and_grad(name, placed):
    """As plain jit has it: on Auto axes a constraint; on Explicit axes an
    assertion of the value's layout, which holds for a batch placed as it
    says and fails, with JAX's own error, for one that is not."""
    mesh, data, batch_spec, params, batch = _setup(name)
    if placed:
        batch = (jax.device_put(batch[0], NamedSharding(mesh, batch_spec)),
                 jax.device_put(batch[1], NamedSharding(mesh, batch_spec)))
    specs = {"w1": MESHES[name][5], "w2": P()}
    loss = _loss_fn(mesh, batch_spec, True)
    ours, error = _outcome(lambda: _value_and_grad_steps(loss, mesh, data, params, batch,
                                                         specs, STEPS))
    plain, plain_error = _outcome(lambda: _plain_steps(loss, mesh, params, batch, STEPS))
    if plain_error is not None:
        assert error is not None, "plain jit refused this loss, value_and_grad ran it"
        assert type(error) is type(plain_error)
        assert str(error).split("\n")[0] == str(plain_error).split("\n")[0]
        return
    assert error is None, error
    np.testing.assert_allclose(ours[1], plain[1], rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(ours[0][k], plain[0][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_partitioned_dense_general_in_value_and_grad(axis_type):
    steps = 5
    ref, ref_losses = _plain_jit_steps(True, optax.adam(1e-2), steps)
    mesh, model, params, batch = _dense_setup(True, axis_type)
    specs = {"kernel": P("fsdp", None, None)}
    with nn.logical_axis_rules(RULES):
        params, losses = _value_and_grad_steps(_dense_loss(model), mesh, "replica", params,
                                               batch, specs, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(params["kernel"]), np.asarray(ref["kernel"]),
                               rtol=1e-5, atol=1e-6)


def test_an_imported_constraint_and_rank_key_in_value_and_grad():
    """Nothing is patched: ``from jax.lax import ...`` works as well, and
    ``sr.rank_key`` in the loss gives each rank its own key."""
    from jax.lax import with_sharding_constraint

    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    w = jnp.arange(4.0)
    x = jnp.ones((16, 4))

    def loss(w, x, key):
        x = with_sharding_constraint(x, NamedSharding(mesh, P(("replica", "fsdp"))))
        keep = jax.random.bernoulli(sr.rank_key(key, "replica"), 0.5, x.shape)
        return jnp.mean((x * keep) @ w), sr.PerRank(keep[:, :1].astype(jnp.float32))

    @jax.jit
    def step(w, x, key):
        return sr.value_and_grad(loss, mesh, "replica", step=0, num_skip=0, has_aux=True,
                                 batch_argnums=1, param_specs=P())(w, x, key)

    (value, rows), grads = step(w, x, jax.random.key(0))
    rows = np.asarray(rows.value).reshape(4, 4)
    assert len({tuple(r) for r in rows}) > 1  # the ranks drew different masks
    assert np.isfinite(float(value)) and grads.shape == (4,)


# Losses found by a review of the replay: each equals jax.value_and_grad at k = 0.
ROWS, D = 16, 4
W = np.linspace(-1.0, 1.0, D * 3, dtype=np.float32).reshape(D, 3)
X = np.cos(np.arange(ROWS * D, dtype=np.float32)).reshape(ROWS, D)
MASK = (np.arange(ROWS) % 5 > 1).astype(np.float32)
COUNT = np.float32(ROWS)


def _scan_of_a_constant_count(w, x, n):
    def body(c, xi):
        return c + jnp.sum(xi @ w) / sr.mean_count(n), None

    return jax.lax.scan(body, 0.0, x)[0]


def _weighted_sum(w, x, m):
    loss = jnp.sum(m / sr.mean_count(jnp.sum(m)) * jnp.mean((x @ w) ** 2, -1))
    return loss, {"loss": loss, "tokens": jnp.sum(m)}


def _sum_of_means(w, x):
    loss = jnp.sum(jnp.mean((x @ w - 1.0) ** 2, axis=0))
    return loss, {"loss": loss, "per_output": jnp.mean(x @ w, axis=0)}


def _sum_of_sums(w, x):
    h = x @ w
    return jnp.mean(h ** 2), {"s": jnp.sum(x) + jnp.sum(h), "twice": 2.0 * jnp.sum(h)}


REVIEWED = {
    "mean_count of a constant inside scan": (_scan_of_a_constant_count, (W, X, COUNT), (1,)),
    "mean_count of a constant inside cond": (
        lambda w, x, n: jax.lax.cond(w[0, 0] > -100, lambda: jnp.sum(x @ w) / sr.mean_count(n),
                                     lambda: 0.0), (W, X, COUNT), (1,)),
    "a mean_count-weighted sum in aux": (_weighted_sum, (W, X, MASK), None),
    "a sum of means in aux": (_sum_of_means, (W, X), None),
    "sums of sums in aux": (_sum_of_sums, (W, X), None),
    "jnp.mean over as many elements as the global rows": (
        lambda w, x: jnp.mean((x[:, :2] @ w[:2, :1]) ** 2), (W, X), None),
}


@pytest.mark.parametrize("name", sorted(REVIEWED))
def test_reviewed_losses_equal_jax_value_and_grad(name):
    loss, args, batch = REVIEWED[name]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    has_aux = isinstance(jax.eval_shape(loss, *args), tuple)
    try:
        ref = jax.jit(jax.value_and_grad(loss, has_aux=has_aux))(*args)
    except NotImplementedError as e:  # jax_scan3: JAX cannot differentiate a scan yet
        pytest.skip(f"jax.value_and_grad itself fails on this loss: {e}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a mean
        got = jax.jit(lambda *a: sr.value_and_grad(
            loss, mesh, "data", step=0, num_skip=0, min_size=0, has_aux=has_aux,
            batch_argnums=batch)(*a))(*args)
    for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_rank_key_in_a_nested_jit_is_per_rank():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def loss(w, x, key):
        nested = jax.jit(lambda k: jax.random.uniform(sr.rank_key(k, "data")))(key)
        top = jax.random.uniform(sr.rank_key(key, "data"))
        return jnp.mean((x @ w) ** 2), {"nested": nested, "top": top}

    (_, aux), _ = jax.jit(lambda *a: sr.value_and_grad(
        loss, mesh, "data", step=0, num_skip=0, min_size=0, has_aux=True,
        batch_argnums=(1,))(*a))(W, X, jax.random.key(5))
    assert float(aux["nested"]) == float(aux["top"])  # both the mean of 8 draws


def test_per_rank_rows_with_microbatches_keep_the_batch_order():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def loss(w, x):
        h = x @ w
        return jnp.mean(h ** 2), {"h": sr.PerRank(h)}

    (_, aux), _ = jax.jit(lambda *a: sr.value_and_grad(
        loss, mesh, "data", step=0, num_skip=0, min_size=0, has_aux=True,
        microbatches=2)(*a))(W, X)
    # Stacked per micro-batch: micro-batch j holds each rank's rows i with i % 2 == j.
    for j in range(2):
        np.testing.assert_allclose(aux["h"].value[j], (X @ W)[j::2], rtol=1e-5, atol=1e-6)


def test_a_bare_spec_under_set_mesh_and_a_marker_in_custom_vjp():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

    def bare(w, x):
        return jnp.mean(jax.lax.with_sharding_constraint(x @ w, P("data", "model")) ** 2)

    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: sr.value_and_grad(bare, mesh, "data", step=0, num_skip=0,
                                                   param_specs=P())(*a))(W[:, :2], X)
        ref = jax.jit(jax.value_and_grad(bare))(W[:, :2], X)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)

    @jax.custom_vjp
    def normalized(s, n):
        return s / sr.mean_count(n)

    normalized.defvjp(lambda s, n: (normalized(s, n), n), lambda n, g: (g / n, None))
    mesh8 = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    # mean_count inside a custom_vjp: the count, as everywhere (already global).
    loss = lambda w, x, m: normalized(jnp.sum(m[:, None] * (x @ w) ** 2), jnp.sum(m))  # noqa: E731
    got = jax.jit(lambda *a: sr.value_and_grad(
        loss, mesh8, "data", step=0, num_skip=0, min_size=0)(*a))(W, X, MASK)
    ref = jax.value_and_grad(loss)(W, X, MASK)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-6)


@jax.custom_jvp
def _straight_through_round(x):
    return jnp.round(x)


# The rule is not the derivative of round (0 almost everywhere): replayed, it
# must stay the user's rule.
_straight_through_round.defjvp(lambda p, t: (jnp.round(p[0]), t[0]))


@jax.custom_vjp
def _clipped_backward(x):
    return x


_clipped_backward.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))

# Layout calls as code written for Explicit axes spells them.
EXPLICIT_LAYOUTS = {
    "out_sharding": lambda h: h,
    "reshard": lambda h: jax.sharding.reshard(h, P("data", None)),
    "reshard_over_model": lambda h: jax.sharding.reshard(h, P(None, "model")),
    "zeros_out_sharding": lambda h: h + jnp.zeros(h.shape, out_sharding=P("data", "model")),
    "gather_out_sharding": lambda h: h + jnp.eye(h.shape[1]).at[jnp.argmax(h, -1)].get(
        out_sharding=P("data", None)),  # a row of a table per example
    "custom_jvp": lambda h: _straight_through_round(h * 4) / 4,
    "custom_jvp_closing": lambda h: _scaled_straight_through(h),
}


def _scaled_straight_through(h):
    """A rule closing over a value the loss computed (not a tracer of the rule's own)."""
    scale = jnp.sqrt(jnp.sum(jnp.ones_like(h)) / h.shape[0])  # equal on every rank

    @jax.custom_jvp
    def f(y):
        return jnp.round(y)

    f.defjvp(lambda p, t: (jnp.round(p[0]), t[0] * scale))
    return f(h * 4) / 4


def _explicit_loss(layout, x, weights):
    """A loss written for a (data, model) mesh of Explicit axes, closing over
    its batch, with a padded-token count in aux."""
    def loss(p):
        h = jnp.einsum("bi,ij->bj", x, p["w1"], out_sharding=P("data", "model"))
        h = jax.nn.softmax(EXPLICIT_LAYOUTS[layout](jax.nn.relu(h)), axis=-1)
        out = jnp.einsum("bj,jk->bk", h, p["w2"], out_sharding=P("data"))
        err = jnp.sum((out - 1.0) ** 2, axis=-1)
        count = jnp.sum(weights)
        return jnp.sum(err * weights) / sr.mean_count(count), {"count": count}
    return loss


def _explicit_setup():
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit, as make_mesh makes them
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 16)).astype(np.float32)
    weights = (rng.random(32) < 0.7).astype(np.float32)
    params = {"w1": jax.device_put(rng.normal(size=(16, 8)).astype(np.float32),
                                   NamedSharding(mesh, P(None, "model"))),
              "w2": jax.device_put(rng.normal(size=(8, 1)).astype(np.float32),
                                   NamedSharding(mesh, P()))}
    x, weights = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, weights))
    return mesh, params, x, weights


@pytest.mark.parametrize("layout", sorted(EXPLICIT_LAYOUTS))
def test_layouts_over_explicit_axes_in_the_loss_run_as_written(layout):
    """Before: JAX refused them (a PartitionSpec without a mesh, Auto axes)."""
    mesh, params, x, weights = _explicit_setup()

    @functools.partial(jax.jit, static_argnums=3)
    def ours(p, x, weights, k):
        return sr.value_and_grad(_explicit_loss(layout, x, weights), step=5, has_aux=True,
                                 axis_name="data", num_skip=k, min_size=0)(p)

    @jax.jit
    def plain(p, x, weights):
        return jax.value_and_grad(_explicit_loss(layout, x, weights), has_aux=True)(p)

    with jax.set_mesh(mesh):
        (value, aux), grads = ours(params, x, weights, 0)
        (ref, ref_aux), ref_grads = plain(params, x, weights)
        skipped = ours(params, x, weights, 2)[1]
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    assert float(aux["count"]) == float(ref_aux["count"])
    for k in grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-6)
        assert jax.typeof(grads[k]).sharding.spec == jax.typeof(ref_grads[k]).sharding.spec
    # Skipping shows: each rank held its own rows' gradient.
    assert np.abs(np.asarray(skipped["w1"]) - np.asarray(grads["w1"])).max() > 1e-3


def test_a_custom_vjp_with_layouts_over_explicit_axes_is_refused_by_name():
    mesh, params, x, weights = _explicit_setup()

    def loss(p, x):
        h = jnp.einsum("bi,ij->bj", x, p["w1"], out_sharding=P("data", "model"))
        h = _clipped_backward(h)
        return jnp.mean(jnp.einsum("bj,jk->bk", h, p["w2"], out_sharding=P("data")))

    # Under jax_custom_vjp3 the rule is a CustomVJPTraced object, refused alike.
    match = r"jax.custom_vjp function \(_clipped_backward|calls CustomVJPTraced"
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(lambda p, x: sr.value_and_grad(loss, step=0, axis_name="data", num_skip=2,
                                               min_size=0)(p, x))(params, x)
