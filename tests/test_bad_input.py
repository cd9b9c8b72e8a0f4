"""Bad input gets an error (or a warning) naming the API, the argument and the fix."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr
from skipreduce_jax import launch
from skipreduce_jax.cost import main as cost_main

N = 8


def _loss(params, batch):
    return jnp.mean((batch @ params["w"]) ** 2)


def _setup(mesh):
    tx = optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0), optax.sgd(0.1))
    params = sr.replicate({"w": jnp.ones((4, 2))}, mesh)
    return tx, params, sr.init_opt_state(tx, params, mesh)


# -- arrays a donating step consumed ------------------------------------------

def test_make_train_step_refuses_params_it_donated():
    mesh = jax.make_mesh((N,), ("data",))
    tx, params, opt_state = _setup(mesh)
    step = sr.make_train_step(_loss, tx, mesh)
    batch = np.ones((N, 4), np.float32)
    new_params, new_state, _ = step(params, opt_state, batch)
    with pytest.raises(ValueError, match=r"^make_train_step: argument 0 at \['w'\] "
                       r"\(shape \(4, 2\)\) is a deleted array: this step donates "
                       r"argument 0.*Pass the arrays the previous call returned.*"
                       r"make_train_step\(\.\.\., donate=False\)"):
        step(params, new_state, batch)
    jax.block_until_ready(step(new_params, new_state, batch))  # the returned ones step on


def test_data_parallel_refuses_donated_state_and_names_its_path():
    mesh = jax.make_mesh((N,), ("data",))
    tx, params, opt_state = _setup(mesh)

    def local_step(params, opt_state, batch):
        _, grads = sr.local_value_and_grad(_loss, "data")(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = sr.data_parallel(local_step, mesh, batch_argnums=2, donate_argnums=(0, 1))
    batch = np.ones((N, 4), np.float32)
    new_params, _ = step(params, opt_state, batch)
    with pytest.raises(ValueError, match=r"^data_parallel: argument 1 at \[0\]\.count .*"
                       r"deleted array.*donate_argnums=\(0, 1\).*leave 1 out of "
                       r"donate_argnums"):
        step(new_params, opt_state, batch)
    # A leaf donated elsewhere, in a position this step does not donate.
    plain = sr.data_parallel(local_step, mesh, batch_argnums=2)
    with pytest.raises(ValueError, match=r"argument 0 at \['w'\].*donated to an earlier "
                       r"call.*pass a copy"):
        plain.lower(params, opt_state, batch)


def test_nnx_data_parallel_refuses_a_donated_snapshot():
    nnx = pytest.importorskip("flax.nnx")
    srnnx = pytest.importorskip("skipreduce_jax.nnx")
    mesh = jax.make_mesh((N,), ("data",))
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    tx = optax.chain(sr.skip_reduce("data", num_skip=2, min_size=0), optax.sgd(0.1))
    optimizer = srnnx.init_optimizer(model, tx, mesh)

    def train_step(model, optimizer, x):
        loss, grads = srnnx.local_value_and_grad(
            lambda m, x: jnp.mean(m(x) ** 2), "data")(model, x)
        optimizer.update(model, grads)
        return lax.pmean(loss, "data")

    step = srnnx.data_parallel(train_step, mesh, batch_argnums=2, donate_argnums=(0, 1))
    x = np.ones((N, 4), np.float32)
    step(model, optimizer, x)  # places the model: from now on its arrays are donated
    snapshot = jax.tree_util.tree_map(lambda a: a, nnx.state(model))  # not a copy
    kept = jax.tree_util.tree_map(jnp.copy, nnx.state(model))  # a copy
    step(model, optimizer, x)
    nnx.update(model, snapshot)  # a roll-back to arrays the step consumed
    with pytest.raises(ValueError, match=r"^skipreduce_jax\.nnx\.data_parallel: argument 0 "
                       r"at \.bias\.value .*deleted array.*Pass the objects as the previous "
                       r"call left them.*jnp\.copy.*leave 0 out of donate_argnums"):
        step(model, optimizer, x)
    nnx.update(model, kept)
    jax.block_until_ready(step(model, optimizer, x))


# -- shard_batch: one set of checks with data_parallel --------------------------

def test_shard_batch_refuses_a_scalar_and_an_uneven_batch():
    mesh = jax.make_mesh((N,), ("data",))
    with pytest.raises(ValueError, match=r"^shard_batch: batch has a leaf at the root of "
                       r"shape \(\), a scalar: it has no leading dimension to split over "
                       r"the 8 ranks.*skipreduce_jax\.replicate"):
        sr.shard_batch(np.float32(3.0), mesh)
    with pytest.raises(ValueError, match=r"^shard_batch: batch has a leaf at \['y'\] of "
                       r"shape \(10, 2\): its leading dimension must split evenly over "
                       r"the 8 ranks of \['data'\]\. Pass a global batch whose size is a "
                       r"multiple of 8"):
        sr.shard_batch({"x": np.zeros((16, 2)), "y": np.zeros((10, 2))}, mesh)


def test_data_parallel_refuses_a_scalar_batch_leaf():
    mesh = jax.make_mesh((N,), ("data",))
    step = sr.data_parallel(lambda x: lax.pmean(x.sum(), "data"), mesh, batch_argnums=0)
    with pytest.raises(ValueError, match=r"^data_parallel: argument 0 \(in batch_argnums\) "
                       r"has a leaf at the root of shape \(\), a scalar.*move the argument "
                       r"out of batch_argnums"):
        step(np.float32(1.0))


# -- exclude --------------------------------------------------------------------

def test_exclude_refuses_a_bad_pattern():
    with pytest.raises(ValueError, match=r"^exclude: pattern '\(' is not a valid regular "
                       r"expression \(missing \).*re\.escape"):
        sr.exclude("Embed", "(")
    with pytest.raises(TypeError, match=r"^exclude: pattern 3 must be a str"):
        sr.exclude(3)
    assert sr.exclude(re.escape("("))({"a(b": 1.0, "c": 2.0}) == {"a(b": False, "c": True}


def test_exclude_warns_about_a_pattern_that_matches_nothing():
    grads = {f"Dense_{i}": {"kernel": 1.0} for i in range(6)}
    with pytest.warns(sr.UnmatchedPatternWarning,
                      match=r"^exclude: no leaf path matches 'NoSuchLayer', which excludes "
                      r"nothing; the paths are \['Dense_0'\]\['kernel'\], .*"
                      r"\.\.\. \(6 leaves\)\. Fix the pattern"):
        flags = sr.exclude("Dense_1", "NoSuchLayer")(grads)
    assert [f["kernel"] for _, f in sorted(flags.items())] == [True, False] + [True] * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sr.exclude("Dense")(grads)  # every pattern matches: silent
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", sr.UnmatchedPatternWarning)  # the user can filter it
        sr.exclude("NoSuchLayer")(grads)


# -- skip_reduce names itself, not the collective it calls ----------------------

def _update_in_shard_map(grads, edit_state=lambda state: state):
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0)

    def f(g):
        return tx.update(g, edit_state(tx.init(g)), g)[0]

    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    return jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(grads)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_skip_reduce_refuses_non_floating_gradients_by_name(dtype):
    with pytest.raises(TypeError, match=rf"^skip_reduce: got a gradient of dtype "
                       rf"{jnp.dtype(dtype).name} .*floating-point gradients only.*"
                       r"optax\.masked"):
        _update_in_shard_map(jnp.ones((N, 64), dtype))


def test_skip_reduce_refuses_a_per_rank_key_by_name():
    def per_rank_key(state):
        key = sr.rank_key(jax.random.wrap_key_data(state.key), "data")
        return state._replace(key=jax.random.key_data(key))

    with pytest.raises(ValueError, match=r"^skip_reduce: the step's key, drawn from the "
                       r"state's key and count, varies over \['data'\].*Pass the optimizer "
                       r"state replicated.*init_opt_state"):
        _update_in_shard_map(jnp.ones((N, 64)), per_rank_key)


# -- verify_sync's error, as raised ----------------------------------------------

def test_verify_sync_error_is_raised_plainly_by_the_step():
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", num_skip=2, min_size=0, verify_sync=True)
    params = sr.replicate({"w": jnp.zeros(64)}, mesh)
    state = sr.init_opt_state(tx, params, mesh)
    step = sr.make_train_step(lambda p, b: jnp.sum(p["w"] * b.sum(0)), tx, mesh,
                              donate=False)
    batch = sr.shard_batch(np.ones((N, 64), np.float32), mesh)
    # Each device holds its own key: the ranks are out of step.
    copies = [jax.device_put(np.asarray(state.key) + np.uint32(i), d)
              for i, d in enumerate(mesh.devices.flat)]
    bad = state._replace(key=jax.make_array_from_single_device_arrays(
        (2,), NamedSharding(mesh, P()), copies))
    with pytest.raises(RuntimeError) as raised:
        step(params, bad, batch)  # raised by the call itself, not when read
    assert type(raised.value) is RuntimeError, type(raised.value)
    assert re.match(r"skip_reduce\(verify_sync=True\): the key \(seed\) differ across "
                    r"ranks over \['data'\] at step 0\. Every rank must use the same seed",
                    str(raised.value)), str(raised.value)
    assert "CpuCallback" not in str(raised.value)
    jax.block_until_ready(step(params, state, batch))  # in sync: fine


# -- command lines -----------------------------------------------------------------

def test_cost_fit_names_a_file_that_is_not_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"measurements": [\n  {n: 8}\n]}\n')
    with pytest.raises(SystemExit) as exited:
        cost_main(["fit", str(bad)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert re.search(rf"fit: {re.escape(str(bad))} is not valid JSON \(Expecting property "
                     r"name enclosed in double quotes at line 2, column 4\)\. Pass a JSON "
                     r"list of measurement objects", err), err
    with pytest.raises(SystemExit):
        cost_main(["check", str(tmp_path / "none.json"), "--model", str(bad)])
    err = capsys.readouterr().err
    assert re.search(r"bad\.json is not valid JSON .*Pass a link model", err), err


@pytest.mark.parametrize("wire", ["int8", "uint8", "int32"])
def test_cost_predict_refuses_a_comm_dtype_the_library_refuses(wire, capsys):
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        sr.skip_reduce("data", num_skip=1, comm_dtype=wire)
    with pytest.raises(SystemExit) as exited:
        cost_main(["predict", "--n", "8", "--size", "64M", "--gbit", "10",
                   "--comm-dtype", wire])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument --comm-dtype: '{wire}': the library refuses it" in err
            and "not a floating-point dtype" in err
            and "e.g. bfloat16 or float16, or leave --comm-dtype out" in err), err


def test_cost_predict_prices_the_wires_the_library_accepts(capsys):
    outputs = []
    for wire in ("bfloat16", "bf16", "float16"):
        cost_main(["predict", "--n", "8", "--size", "64M", "--gbit", "10",
                   "--comm-dtype", wire])
        outputs.append(capsys.readouterr().out)
    assert len(set(outputs)) == 1 and "32 MB per rank" in outputs[0], outputs


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "ten"])
def test_launch_refuses_a_timeout_that_is_not_seconds(value, capsys):
    with pytest.raises(SystemExit) as exited:
        launch.main(["-n", "1", "--timeout", value, "job.py"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument --timeout: got '{value}'; give a finite number of seconds >= 0"
            in err and "--timeout 0 for no limit" in err), err


def test_launch_timeout_zero_means_no_limit():
    assert launch._parser().parse_args(["-n", "1", "--timeout", "0", "job.py"]).timeout == 0
    with pytest.raises(launch.LaunchError, match="> 0 seconds and finite"):
        launch.launch("job.py", num_processes=1, timeout=float("inf"))


@pytest.mark.parametrize("loss, has_aux, match", [
    (lambda w, x: jnp.mean((x @ w) ** 2), True, "must return a pair"),
    (lambda w, x: (jnp.mean((x @ w) ** 2), 1.0, 2.0), True, "must return a pair"),
    (lambda w, x: (x @ w) ** 2, False, "must be a scalar"),
    (lambda w, x: ((x @ w) ** 2, {}), True, "must be a scalar"),
    (lambda w, x: jnp.sum(x @ w > 0), False, "real floating point"),
], ids=["aux-missing", "aux-triple", "vector", "vector-with-aux", "int"])
def test_value_and_grad_refuses_what_jax_value_and_grad_refuses(loss, has_aux, match):
    with pytest.raises(TypeError):  # jax's own
        jax.value_and_grad(loss, has_aux=has_aux)(jnp.ones(3), jnp.ones((16, 3)))
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P("data")))
    grad_fn = sr.value_and_grad(loss, mesh, step=0, num_skip=0, min_size=0, has_aux=has_aux)
    with jax.set_mesh(mesh), pytest.raises(TypeError, match=match):
        jax.jit(grad_fn)(jnp.ones(3), x)


def test_value_and_grad_returns_aux_as_a_tuple_like_jax():
    def loss(w, x):
        return [jnp.mean((x @ w) ** 2), {"a": jnp.sum(x)}]
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        out, _ = jax.jit(sr.value_and_grad(loss, mesh, step=0, num_skip=0, min_size=0,
                                           has_aux=True))(jnp.ones(3), x)
    want, _ = jax.value_and_grad(loss, has_aux=True)(jnp.ones(3), jnp.ones((16, 3)))
    assert type(out) is type(want) is tuple and float(out[1]["a"]) == 48.0


@pytest.mark.parametrize("argnums", [-3, (-2,), (0, -2)])
def test_value_and_grad_counts_negative_argnums_from_the_end_like_jax(argnums):
    def loss(w, v, x):
        return jnp.mean((x @ w) ** 2) + jnp.sum(v ** 2)
    mesh = jax.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((16, 3)), NamedSharding(mesh, P("data")))
    w, v = jnp.arange(3.0), jnp.ones(2)
    want = jax.value_and_grad(loss, argnums=argnums)(w, v, jnp.ones((16, 3)))
    grad_fn = sr.value_and_grad(loss, mesh, step=0, num_skip=0, min_size=0, argnums=argnums)
    with jax.set_mesh(mesh):
        got = jax.jit(grad_fn)(w, v, x)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), got, want)
    with pytest.raises(ValueError, match="out of range"):
        sr.value_and_grad(loss, mesh, step=0, num_skip=0, argnums=-4)(w, v, x)
