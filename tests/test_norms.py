"""skip_reduce and BatchNorm: exact_radial is on by default when the params
hold a BatchNorm (linen's names, NNX's types); the warning is raised when
skipping reaches the leaves that feed it with that remedy and error feedback
off, and only then."""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

N = 8


def _linen_params():
    # flax.linen's names: Conv_0 feeds BatchNorm_0.
    return {"params": {
        "Conv_0": {"kernel": jnp.zeros((3, 3, 1, 8)), "bias": jnp.zeros(8)},
        "BatchNorm_0": {"scale": jnp.ones(8), "bias": jnp.zeros(8)},
        "Dense_0": {"kernel": jnp.zeros((8, 10))}}}


def _no_warning(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", sr.BatchNormWarning)
        return fn()


OFF = dict(exact_radial=False)


def test_warns_when_leaves_beside_a_batchnorm_may_skip():
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, **OFF)
    with pytest.warns(sr.BatchNormWarning,
                      match=r"(?s)BatchNorm_0.*Conv_0'\]\['bias'\].*error_feedback=True"):
        tx.init(_linen_params())


def test_warns_once_inside_init_opt_state():
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(sr.skip_reduce("data", num_skip=4, min_size=0, **OFF),
                     optax.sgd(0.1))
    with pytest.warns(sr.BatchNormWarning) as record:
        sr.init_opt_state(tx, sr.replicate(_linen_params(), mesh), mesh, "data")
    assert sum(issubclass(r.category, sr.BatchNormWarning) for r in record) == 1


@pytest.mark.parametrize("kwargs", [
    dict(skip_ratio=0.5, min_size=0, selective=sr.exclude("Conv", "Dense")),
    dict(skip_ratio=0.5),                      # min_size: every leaf is small
    dict(num_skip=0, min_size=0),              # no skipping
    dict(skip_ratio=0.0, min_size=0),
    dict(skip_ratio=0.5, min_size=0, warmup_steps=0,
         selective=sr.by_path(lambda path, leaf: "BatchNorm" in path)),
])
def test_no_warning_when_nothing_that_feeds_a_norm_skips(kwargs):
    _no_warning(lambda: sr.skip_reduce("data", **kwargs, **OFF).init(_linen_params()))


def test_no_warning_with_error_feedback_or_without_batchnorm():
    mesh = jax.make_mesh((N,), ("data",))
    params = sr.replicate(_linen_params(), mesh)
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, error_feedback=True)
    _no_warning(lambda: sr.init_opt_state(tx, params, mesh, "data"))
    plain = {"params": {k: v for k, v in _linen_params()["params"].items()
                        if k != "BatchNorm_0"}}
    _no_warning(lambda: sr.skip_reduce("data", skip_ratio=0.5, min_size=0,
                                       **OFF).init(plain))


def test_a_ratio_that_rounds_to_no_skip_does_not_warn():
    # 0.05 of 7 steps rounds to k = 0 once the axis size is known.
    mesh = jax.make_mesh((N,), ("data",))
    tx = sr.skip_reduce("data", skip_ratio=0.05, min_size=0, **OFF)
    _no_warning(lambda: sr.init_opt_state(tx, sr.replicate(_linen_params(), mesh),
                                          mesh, "data"))


nnx = pytest.importorskip("flax.nnx")
srnnx = pytest.importorskip("skipreduce_jax.nnx")


class _Net(nnx.Module):
    # Attribute names that say nothing: only the layer type tells.
    def __init__(self, axis_name, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.BatchNorm(8, axis_name=axis_name, rngs=rngs)


def _trace_update(tx, params, **extra):
    """Traces one ``tx.update`` inside a shard_map over 8 ranks (warnings fire here)."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    state = tx.init(params)
    step = jax.shard_map(lambda p: tx.update(_local(p), state, p, **extra)[0], mesh=mesh,
                         in_specs=P(), out_specs=P())
    jax.jit(step).lower(params)


def _local(tree):  # each rank's own gradient, typed varying
    return jax.tree_util.tree_map(lambda x: jax.lax.pcast(x, "data", to="varying"), tree)


def _unnamed_params():
    # Names that say nothing: "b" is a BatchNorm only if the caller says so.
    return {"a": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)},
            "b": {"scale": jnp.ones(8), "bias": jnp.zeros(8)}}


def test_update_knows_the_batchnorm_paths_it_is_given():
    tx = sr.skip_reduce("data", skip_ratio=0.5, min_size=0, **OFF)
    _no_warning(lambda: _trace_update(tx, _unnamed_params()))
    with pytest.warns(sr.BatchNormWarning, match=r"\['b'\].*\['a'\]\['bias'\]"):
        _trace_update(tx, _unnamed_params(), batchnorm_paths=[("b",)])
    # Through optax.chain, which hands extra arguments on.
    chained = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0, **OFF),
                          optax.sgd(0.1))
    with pytest.warns(sr.BatchNormWarning):
        _trace_update(chained, _unnamed_params(), batchnorm_paths=[("b",)])


def test_the_same_update_gives_the_same_numbers_wherever_it_is_called():
    # exact_radial's default reads only update()'s arguments: the same call
    # inside the NNX helpers' optimizer and outside it is the same program.
    tx = sr.skip_reduce("data", num_skip=4, min_size=0)
    params = _unnamed_params()
    texts = []
    for extra in ({}, {"batchnorm_paths": [("b",)]}, {}):
        mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        state = tx.init(params)
        step = jax.shard_map(lambda p, extra=extra: tx.update(_local(p), state, p, **extra)[0],
                             mesh=mesh, in_specs=P(), out_specs=P())
        texts.append(jax.jit(step).lower(params).as_text())
    assert texts[0] == texts[2] != texts[1]


@pytest.mark.parametrize("axis_name", ["data", None])
def test_nnx_init_optimizer_finds_batchnorm_by_type(axis_name):
    mesh = jax.make_mesh((N,), ("data",))
    model = _Net(axis_name, nnx.Rngs(0))
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0, **OFF),
                     optax.sgd(0.1))
    optimizer = _no_warning(
        lambda: srnnx.init_optimizer(model, tx, mesh, "data", wrt=nnx.Param))
    params = nnx.state(model, nnx.Param)
    if axis_name is None:  # per-rank statistics: nothing drifts
        _no_warning(lambda: _trace_update(optimizer.tx, params))
    else:
        with pytest.warns(sr.BatchNormWarning, match=r"\['b'\].*\['a'\]\['bias'\]"):
            _trace_update(optimizer.tx, params)
    # Fully reducing the layer that feeds it silences it.
    quiet = optax.chain(sr.skip_reduce("data", skip_ratio=0.5, min_size=0, **OFF,
                                       selective=sr.exclude(r"\['a'\]")), optax.sgd(0.1))
    optimizer = srnnx.init_optimizer(model, quiet, mesh, "data", wrt=nnx.Param)
    _no_warning(lambda: _trace_update(optimizer.tx, params))
    sr.assert_replicated(nnx.state(model), mesh)
