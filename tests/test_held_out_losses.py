"""``value_and_grad`` on 75 losses written apart from the library (tests/held_out_losses).

At ``num_skip=0`` each returns ``jax.value_and_grad``'s value, every aux
leaf (NaN where it is NaN, keys and integers exactly) and every gradient,
inside ``jax.jit`` on 8 devices, on a mesh of Explicit axes and one of
Auto axes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from held_out_losses import CASES
from held_out_losses._registry import mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

pytestmark = pytest.mark.slow

RTOL, ATOL = 1e-4, 1e-5


def _argnums(c):
    params = tuple(i for i, (role, _, _) in enumerate(c["args"]) if role == "p")
    return params[0] if len(params) == 1 else params


def _step(c, value_and_grad):
    def step(*args):
        return value_and_grad(c["loss"], argnums=_argnums(c), has_aux=c["has_aux"])(
            *args, **c["kwargs"])
    return jax.jit(step)


def _place(value, spec, m):
    if isinstance(spec, P):
        return jax.device_put(value, NamedSharding(m, spec))
    return jax.device_put(value, jax.tree.map(lambda s: NamedSharding(m, s), spec,
                                              is_leaf=lambda s: isinstance(s, P)))


def _numpy(a):
    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def _parts(out, has_aux):
    (value, aux), grads = out if has_aux else ((out[0], None), out[1])
    return {"value": value, "aux": aux, "grads": grads}


def _differences(got, want, tol):
    rtol, atol = (2e-2, 2e-2) if tol == "bf16" else (RTOL, ATOL)
    bad = []
    for part in ("value", "aux", "grads"):
        if jax.tree.structure(got[part]) != jax.tree.structure(want[part]):
            bad.append(f"{part}: its tree differs")
            continue
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[part])[0],
                                jax.tree.leaves(want[part]), strict=True):
            leaf = part + jax.tree_util.keystr(path)
            g, w = _numpy(g), _numpy(w)
            if g.shape != w.shape or g.dtype != w.dtype:
                bad.append(f"{leaf}: {g.dtype}{g.shape}, not {w.dtype}{w.shape}")
            elif np.issubdtype(w.dtype, np.inexact) or w.dtype == jnp.bfloat16:
                kind = np.complex128 if np.iscomplexobj(w) else np.float64
                g64, w64 = g.astype(kind), w.astype(kind)
                if not (np.array_equal(np.isnan(g64), np.isnan(w64))
                        and np.allclose(g64, w64, rtol=rtol, atol=atol, equal_nan=True)):
                    bad.append(f"{leaf}: max abs difference "
                               f"{np.nanmax(np.abs(g64 - w64)) if g64.size else 0:.3g}")
            elif not np.array_equal(g, w):
                bad.append(f"{leaf}: {int(np.sum(g != w))} of {g.size} differ")
    return bad


@functools.cache
def _values(name):
    return [v() if getattr(v, "_lazy", False) else v for _, v, _ in CASES[name]["args"]]


@functools.cache
def _reference(name):
    c = CASES[name]
    return _parts(jax.block_until_ready(_step(c, jax.value_and_grad)(*_values(name))),
                  c["has_aux"])


CASE_IDS = [pytest.param(n, k, id=f"{n}-{k}") for n in sorted(CASES) for k in CASES[n]["kinds"]]


def test_there_are_75_losses():
    assert len(CASES) == 75


@pytest.mark.parametrize("name, kind", CASE_IDS)
def test_num_skip_0_equals_jax_value_and_grad(name, kind):
    c, m = CASES[name], mesh(kind)
    want = _reference(name)
    with jax.set_mesh(m):
        placed = [_place(v, spec, m) if role == "b" else v
                  for (role, _, spec), v in zip(c["args"], _values(name))]
        value_and_grad = functools.partial(sr.value_and_grad, step=0, num_skip=0, min_size=0)
        got = _parts(jax.block_until_ready(_step(c, value_and_grad)(*placed)), c["has_aux"])
    assert not _differences(got, want, c["tol"])
