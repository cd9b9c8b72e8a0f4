"""``SkipConfig``: one frozen, checked object for SkipReduce's settings.

``skip_reduce``, ``value_and_grad`` and ``comm_stats`` take it as
``config=``; the keyword options build the same object, so both spellings
give the same transformation, the same bytes and the same fingerprint.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skipreduce_jax as sr

OPTIONS = dict(skip_ratio=0.5, min_size=0, seed=7, warmup_steps=2, chunks_per_rank=2,
               comm_dtype=jnp.bfloat16, accumulate_dtype=jnp.float32)


def test_the_fields_are_skip_reduces_options():
    import inspect
    keywords = set(inspect.signature(sr.skip_reduce).parameters) - {
        "axis_name", "inner_axis", "config"}
    assert keywords == {f.name for f in dataclasses.fields(sr.SkipConfig)}


def test_it_is_frozen_and_checked_when_built():
    config = sr.SkipConfig(**OPTIONS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 1
    with pytest.raises(ValueError, match="give exactly one of num_skip"):
        sr.SkipConfig(min_size=0)
    with pytest.raises(ValueError, match="num_skip=-1"):
        sr.SkipConfig(num_skip=-1)
    with pytest.raises(ValueError, match="seed"):
        dataclasses.replace(config, seed=2**33)
    assert dataclasses.replace(config, seed=8).seed == 8


def test_config_and_keywords_give_the_same_transformation():
    params = {"w": jnp.zeros(4)}
    by_keywords = sr.skip_reduce("data", **OPTIONS).init(params)
    by_config = sr.skip_reduce("data", config=sr.SkipConfig(**OPTIONS)).init(params)
    assert int(by_config.fingerprint) == int(by_keywords.fingerprint)
    np.testing.assert_array_equal(by_config.key, by_keywords.key)
    other = sr.skip_reduce("data", config=sr.SkipConfig(**{**OPTIONS, "chunks_per_rank": 1}))
    assert int(other.init(params).fingerprint) != int(by_keywords.fingerprint)


@pytest.mark.parametrize("api", ["skip_reduce", "value_and_grad", "comm_stats"])
def test_config_and_keywords_together_are_refused(api):
    config = sr.SkipConfig(num_skip=1)
    call = {"skip_reduce": lambda: sr.skip_reduce("data", config=config, min_size=0),
            "value_and_grad": lambda: sr.value_and_grad(
                jnp.sum, jax.make_mesh((8,), ("data",)), step=0, config=config, min_size=0),
            "comm_stats": lambda: sr.comm_stats({"w": jnp.zeros(8)}, 8, config=config,
                                                min_size=0)}[api]
    with pytest.raises(TypeError, match=rf"{api}: pass the settings as config= or as "
                                        r"keyword options, not both .*\['min_size'\]"):
        call()


def test_a_config_of_another_type_is_refused():
    with pytest.raises(TypeError, match="config must be a skipreduce_jax.SkipConfig"):
        sr.skip_reduce("data", config={"num_skip": 1})


def test_comm_stats_takes_the_config():
    grads = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
    config = sr.SkipConfig(**OPTIONS)
    assert sr.comm_stats(grads, 8, config=config) == sr.comm_stats(grads, 8, **OPTIONS)


def test_value_and_grad_takes_the_config():
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(64, 16))
    loss = lambda w, x: jnp.mean((x @ w - 1.0) ** 2)  # noqa: E731
    config = sr.SkipConfig(num_skip=4, min_size=0, seed=3)

    @jax.jit
    def both(w, x):
        return (sr.value_and_grad(loss, mesh, "data", step=5, config=config)(w, x),
                sr.value_and_grad(loss, mesh, "data", step=5, num_skip=4, min_size=0,
                                  seed=3)(w, x))

    with jax.set_mesh(mesh):
        (value, grads), (ref, ref_grads) = both(w, x.astype(np.float32))
    np.testing.assert_array_equal(value, ref)
    np.testing.assert_array_equal(grads, ref_grads)


def test_an_optax_chain_built_from_one_config():
    config = sr.SkipConfig(skip_ratio=0.5, min_size=0)
    tx = optax.chain(sr.skip_reduce("data", config=config), optax.sgd(0.1))
    assert isinstance(tx.init({"w": jnp.zeros(4)})[0], sr.SkipReduceState)
