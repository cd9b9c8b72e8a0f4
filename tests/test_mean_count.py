"""``mean_count``: a loss over a global count, exact per rank (a property test).

At k = 0 ``value_and_grad`` equals ``jax.value_and_grad`` on the global
batch for a mean, a masked (padded) mean, a weighted mean and a sum over a
constant count, whatever the padding and weights (hypothesis draws them,
some ranks' rows all padding included). The aux holds what such a step
reports: the token count (float and int), the summed loss and a mean; each
equals ``jax.value_and_grad``'s aux.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import skipreduce_jax as sr

N, ROWS = 8, 32
MESH = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Auto,))


def _err(w, x):
    return jnp.sum((x @ w - 1.0) ** 2, axis=-1)


LOSSES = {
    "mean": lambda w, x, m: jnp.mean(_err(w, x)),
    "masked mean": lambda w, x, m: jnp.sum(m * _err(w, x)) / sr.mean_count(jnp.sum(m)),
    "weighted mean": lambda w, x, m: (jnp.sum((1 + 3 * m) * _err(w, x))
                                      / sr.mean_count(jnp.sum(1 + 3 * m))),
    "sum over a constant": lambda w, x, m: jnp.sum(_err(w, x)) / sr.mean_count(float(ROWS)),
}


@pytest.mark.parametrize("kind", sorted(LOSSES))
@settings(max_examples=4, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=ROWS, max_size=ROWS).filter(any),
       seed=st.integers(0, 2**16))
def test_exact_at_k0_against_jax_value_and_grad(kind, mask, seed):
    def loss(w, x, m):
        err = _err(w, x)
        aux = {"tokens": jnp.sum(m), "int_tokens": jnp.sum(m > 0),
               "loss_sum": jnp.sum(m * err), "mean_err": jnp.mean(err)}
        return LOSSES[kind](w, x, m), aux

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, 5)).astype(np.float32)
    w = rng.normal(size=(5, 3)).astype(np.float32)
    m = np.asarray(mask, np.float32)
    with jax.set_mesh(MESH):
        (value, aux), grads = jax.jit(lambda w, x, m: sr.value_and_grad(
            loss, MESH, "data", step=0, num_skip=0, min_size=0, has_aux=True)(w, x, m))(
                w, x, m)
    (ref, ref_aux), ref_grads = jax.value_and_grad(loss, has_aux=True)(w, x, m)
    np.testing.assert_allclose(value, ref, rtol=2e-5)
    assert int(aux["int_tokens"]) == int(ref_aux["int_tokens"])
    for k in ("tokens", "loss_sum", "mean_err"):
        np.testing.assert_allclose(aux[k], ref_aux[k], rtol=2e-5)
    np.testing.assert_allclose(grads, ref_grads, rtol=2e-5, atol=1e-5)
