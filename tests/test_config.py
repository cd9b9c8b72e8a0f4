"""``SkipConfig``: one frozen, checked object for SkipReduce's settings.

``skip_reduce``, ``value_and_grad`` and ``comm_stats`` take it as
``config=``; the keyword options build the same object, so both spellings
give the same transformation, the same bytes and the same fingerprint.
"""

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_rank

import skipreduce_jax as sr

OPTIONS = dict(skip_ratio=0.5, min_size=0, seed=7, warmup_steps=2, chunks_per_rank=2,
               comm_dtype=jnp.bfloat16, accumulate_dtype=jnp.float32)


def test_the_fields_are_skip_reduces_options():
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


# ---------------------------------------------------------------------------
# The collectives read a config's ring settings.
# ---------------------------------------------------------------------------

COLLECTIVES = ["skip_psum", "skip_pmean", "skip_pmean_and_left_out", "contribution_mask",
               "skip_psum_scatter", "scatter_contribution_mask"]
RING = dict(num_skip=3, chunks_per_rank=2, bucket_bytes=512, layout="units",
            accumulate_dtype=jnp.float32, comm_dtype=jnp.bfloat16)


SCATTERS = ("skip_psum_scatter", "scatter_contribution_mask")


def _keywords(api, settings):
    """``settings`` (a SkipConfig's ring fields) as ``api``'s keywords: those it reads.

    A reduce-scatter's blocks are whole rows: it reads no ``chunks_per_rank``
    or ``layout`` (and refuses them as keywords).
    """
    assert set(settings) <= set(sr.RingOptions.__annotations__)
    unread = ("chunks_per_rank", "layout") if api in SCATTERS else ()
    return {k: v for k, v in settings.items() if k not in unread}


def _tree(n, rng):
    return {"w": rng.normal(size=(n, 16, 6)).astype(np.float32),
            "b": rng.normal(size=(n, 24)).astype(np.float32)}


def _on_ranks(api, tree, **kwargs):
    key = jax.random.key(5)
    return per_rank(lambda t: getattr(sr, api)(t, "i", key=key, **kwargs), tree, n=8)


def _assert_same(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("api", COLLECTIVES)
@pytest.mark.parametrize("settings", [RING, dict(RING, randomize=False)],
                         ids=["random", "static"])
def test_a_collective_given_a_config_equals_its_keyword_form(api, settings):
    tree = _tree(8, np.random.default_rng(1))
    config = sr.SkipConfig(**settings, seed=9, min_size=0, error_feedback=True)
    by_config = _on_ranks(api, tree, config=config)
    _assert_same(by_config, _on_ranks(api, tree, **_keywords(api, settings)))
    # The config's settings are read: another k gives another result.
    fewer = _on_ranks(api, tree, config=dataclasses.replace(config, num_skip=1))
    assert any(not np.array_equal(a, b) for a, b in zip(
        jax.tree_util.tree_leaves(fewer), jax.tree_util.tree_leaves(by_config)))


def test_the_config_s_wire_and_layout_are_read():
    tree = _tree(8, np.random.default_rng(2))
    config = sr.SkipConfig(**RING)
    got = _on_ranks("skip_psum", tree, config=config)
    for changed in (dict(comm_dtype=None), dict(layout="flat")):
        other = _on_ranks("skip_psum", tree, config=dataclasses.replace(config, **changed))
        assert not np.array_equal(other["w"], got["w"]), changed


@pytest.mark.parametrize("api", COLLECTIVES)
def test_skip_ratio_is_resolved_against_the_axis_as_skip_reduce_does(api):
    tree = _tree(8, np.random.default_rng(3))
    by_ratio = _on_ranks(api, tree, config=sr.SkipConfig(skip_ratio=0.5))
    _assert_same(by_ratio, _on_ranks(api, tree, num_skip=4))  # 0.5 of 7, half up


@pytest.mark.parametrize("api", COLLECTIVES)
@pytest.mark.parametrize("keyword", [dict(num_skip=2), dict(randomize=False),
                                     dict(bucket_bytes=1024)])
def test_a_config_and_a_ring_keyword_together_are_refused(api, keyword):
    with pytest.raises(TypeError, match=rf"^{api}: pass the settings as config= or as "
                       rf"keyword options, not both \(got config and "
                       rf"\['{next(iter(keyword))}'\]\); dataclasses.replace\(config"):
        getattr(sr, api)(jnp.ones((8, 4)), "i", key=None,
                         config=sr.SkipConfig(num_skip=1), **keyword)


@pytest.mark.parametrize("api", COLLECTIVES)
def test_neither_num_skip_nor_a_config_is_refused(api):
    with pytest.raises(TypeError, match=rf"^{api}: give num_skip= .* or config= "
                                        r"\(a skipreduce_jax.SkipConfig\); got neither"):
        getattr(sr, api)(jnp.ones((8, 4)), "i", key=None)
    with pytest.raises(TypeError, match="config must be a skipreduce_jax.SkipConfig"):
        getattr(sr, api)(jnp.ones((8, 4)), "i", key=None, config={"num_skip": 1})


@pytest.mark.parametrize("api,keyword", [
    (api, keyword) for api in [*COLLECTIVES, "skip_reduce"]
    for keyword in (dict(randomize=True), dict(layout="flat"),
                    dict(bucket_bytes=sr.DEFAULT_BUCKET_BYTES))
    if not (api in SCATTERS and "layout" in keyword)])
def test_a_keyword_at_its_default_beside_a_config_is_refused(api, keyword):
    # Not silently the config's value: a keyword given is refused even where
    # it equals its default (the config here says randomize=False).
    name = next(iter(keyword))
    config = sr.SkipConfig(num_skip=1, randomize=False)
    call = (functools.partial(sr.skip_reduce, "i") if api == "skip_reduce" else
            functools.partial(getattr(sr, api), jnp.ones((8, 4)), "i", key=None))
    with pytest.raises(TypeError, match=rf"^{api}: pass the settings as config= or as "
                       rf"keyword options, not both \(got config and \['{name}'\]\)"):
        call(config=config, **keyword)


@pytest.mark.parametrize("api", COLLECTIVES)
def test_a_collective_shows_its_ring_settings_once_as_options(api):
    """(x, axis_name, *, key, config, **options): every keyword is one **options."""
    params = inspect.signature(getattr(sr, api)).parameters
    assert list(params) == ["x", "axis_name", "key", "config", "options"]
    assert params["config"].default is None
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD


def test_the_collectives_take_at_most_40_parameter_slots():
    names = [*COLLECTIVES, "ring_psum"]
    assert len(set(names)) == 7
    assert sum(len(inspect.signature(getattr(sr, n)).parameters) for n in names) <= 40


@pytest.mark.parametrize("api, keyword", [
    ("skip_psum_scatter", dict(layout="units")),          # a scatter's blocks are rows
    ("skip_psum_scatter", dict(chunks_per_rank=2)),
    ("scatter_contribution_mask", dict(gather="ring")),
    ("contribution_mask", dict(rescale=True)),
    ("skip_psum", dict(normalize="world")),
    ("skip_pmean", dict(rescale=True)),
])
def test_a_keyword_a_collective_would_not_read_is_refused_by_name(api, keyword):
    name = next(iter(keyword))
    with pytest.raises(TypeError, match=rf"^{api}\(\) got an unexpected keyword argument "
                       rf"'{name}': it takes key, config"):
        getattr(sr, api)(jnp.ones((8, 4)), "i", key=None, num_skip=1, **keyword)
    if name not in ("bucket_bytes", "gather", "specs", "comm_dtype"):  # ring_psum's
        with pytest.raises(TypeError, match=rf"^ring_psum\(\) got .* '{name}'"):
            sr.ring_psum(jnp.ones(4), "i", **keyword)


@pytest.mark.parametrize("api", COLLECTIVES)
def test_a_collective_takes_skip_ratio_as_a_keyword(api):
    tree = _tree(8, np.random.default_rng(4))
    _assert_same(_on_ranks(api, tree, skip_ratio=0.5), _on_ranks(api, tree, num_skip=4))
