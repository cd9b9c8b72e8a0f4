"""pjit-style sharding code inside the library's steps (``_step_context``).

A ``with_sharding_constraint`` with a ``NamedSharding`` of the global mesh,
and flax linen ``DenseGeneral`` kernels with several features under
``nn.with_partitioning`` / ``nn.with_logical_partitioning``, as a plain
``jax.jit`` training step has them, run in ``data_parallel`` and
``make_train_step`` steps and give what the step without them gives.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax._step_context import step_body

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
def test_a_global_named_sharding_constraint_works_in_the_step(name, api):
    params, losses = _train(name, api, constrained=True)
    ref_params, ref_losses = _train(name, api, constrained=False)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for k in params:
        np.testing.assert_allclose(params[k], ref_params[k], rtol=1e-6, atol=1e-7)


def test_a_constraint_naming_the_compiler_axes_is_kept():
    """Over the Auto axes left to the compiler the constraint stays."""
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def body(x):
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(("replica", "fsdp")))) * 2

    f = jax.jit(jax.shard_map(step_body(body), mesh=mesh, in_specs=P("replica"),
                              out_specs=P("replica"), axis_names={"replica"}))
    with jax.set_mesh(mesh):
        text = f.lower(jnp.ones((16, 4))).as_text()
    # Inside the manual region: over fsdp, replica dropped.
    assert 'sharding_constraint %arg1 <@mesh, [{"fsdp"}, {}]>' in text
    with jax.set_mesh(mesh):
        np.testing.assert_array_equal(f(jnp.ones((16, 4))), 2 * np.ones((16, 4)))


def test_a_spec_longer_than_the_value_names_it():
    mesh = jax.make_mesh((4, 2), ("replica", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def body(x):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("replica", None, None)))

    f = jax.jit(jax.shard_map(step_body(body), mesh=mesh, in_specs=P("replica"),
                              out_specs=P("replica"), axis_names={"replica"}))
    with pytest.raises(ValueError, match=r"spec P\('replica', None, None\) has 3 "
                                         r"entries, but the value has shape \(4, 4\)"):
        with jax.set_mesh(mesh):
            f(jnp.ones((16, 4)))


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
    # Nothing stays patched outside a step.
    assert jax.lax.with_sharding_constraint.__module__ == "jax._src.pjit"
    assert nn.Partitioned.unbox.__module__ == "flax.core.meta"


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
@pytest.mark.parametrize("logical", [False, True], ids=["partitioning", "logical"])
def test_partitioned_dense_general_in_the_hsdp_step(logical, axis_type):
    steps = 5
    tx = optax.adam(1e-2)
    ref, ref_losses = _plain_jit_steps(logical, tx, steps)
    mesh, model, params, batch = _dense_setup(logical, axis_type)
    chain = optax.chain(sr.skip_reduce("replica", num_skip=0), tx)
    step = sr.make_train_step(_dense_loss(model), chain, mesh, "replica")
    opt_state = sr.init_opt_state(chain, params, mesh, "replica")
    losses = []
    with nn.logical_axis_rules(RULES):
        for _ in range(steps):
            params, opt_state, value = step(params, opt_state, batch)
            losses.append(float(value))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(params["kernel"]), np.asarray(ref["kernel"]),
                               rtol=1e-5, atol=1e-6)
    assert params["kernel"].sharding.is_equivalent_to(
        NamedSharding(mesh, P("fsdp", None, None)), 3)


def test_boxed_dense_general_in_a_data_parallel_train_state_step():
    """Boxes kept in a TrainState (flax's pjit guide), logical rules set."""
    steps = 5
    tx = optax.adam(1e-2)
    ref, ref_losses = _plain_jit_steps(True, tx, steps)
    mesh, model, _, batch = _dense_setup(True, AxisType.Auto)
    boxed = model.init(jax.random.key(0), batch[0][:1])["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, RULES)
    boxed = jax.tree.map(jax.device_put, boxed, shardings,
                         is_leaf=lambda b: isinstance(b, nn.Partitioned))
    chain = optax.chain(sr.skip_reduce("replica", num_skip=0), tx)
    state = train_state.TrainState.create(apply_fn=model.apply, params=boxed, tx=chain)
    state = state.replace(opt_state=sr.init_opt_state(chain, boxed, mesh, "replica"))

    def local_step(state, batch):
        value, grads = sr.local_value_and_grad(
            lambda p, b: _dense_loss(model)(p, b), "replica")(state.params, batch)
        return state.apply_gradients(grads=grads), jax.lax.pmean(value, "replica")

    step = sr.data_parallel(local_step, mesh, "replica", batch_argnums=1)
    losses = []
    with nn.logical_axis_rules(RULES):
        for _ in range(steps):
            state, value = step(state, batch)
            losses.append(float(value))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(nn.unbox(state.params)["kernel"]),
                               np.asarray(ref["kernel"]), rtol=1e-5, atol=1e-6)
