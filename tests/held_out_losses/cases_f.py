"""More dtype/key-impl paths."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from held_out_losses._registry import P, case

R = np.random.default_rng(8)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, D, C, N, M = 16, 5, 4, 12, 4
D_ = P("data")
X = nrm(B, D); Y = R.integers(0, C, B).astype(np.int32)
MLP = {"a": nrm(D, 8, scale=.5), "o": nrm(8, C, scale=.5)}

# 59 FNO with complex weights, the spectral filter (complex, from params) returned in aux for logging
U = nrm(B, N, 2); UT = nrm(B, N, 2)
FNO = {"wr": nrm(M, 2, 2, scale=.3), "wi": nrm(M, 2, 2, scale=.3)}
def fno_aux(p, u, ut):
    w = p["wr"] + 1j * p["wi"]
    uf = jnp.fft.rfft(u, axis=1)
    out = jnp.zeros_like(uf).at[:, :M].set(jnp.einsum("bmi,mio->bmo", uf[:, :M], w))
    v = jnp.fft.irfft(out, n=N, axis=1)
    return jnp.mean((v - ut) ** 2), {"filter": w, "energy": jnp.mean(jnp.abs(out) ** 2, 0)}
case("fno_complex_filter_in_aux", fno_aux, [("p", FNO, None), ("b", U, D_), ("b", UT, D_)], has_aux=True)

# 60 MaxText-style dropout with an unsafe_rbg / rbg key
def rbg_drop(p, x, y, key):
    h = jax.nn.relu(x @ p["a"])
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean()
case("dropout_unsafe_rbg_key", rbg_drop, [("p", MLP, None), ("b", X, D_), ("b", Y, D_), ("c", jax.random.key(1, impl="unsafe_rbg"), None)])
case("dropout_rbg_key", rbg_drop, [("p", MLP, None), ("b", X, D_), ("b", Y, D_), ("c", jax.random.key(1, impl="rbg"), None)])

# 61 fp8 params-derived aux (amax cast to float8 for a scaling history)
def fp8_aux(p, x, y):
    lg = jnp.tanh(x @ p["a"]) @ p["o"]
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(), {
        "w_amax_fp8": jnp.max(jnp.abs(p["a"])).astype(jnp.float8_e4m3fn), "w_bf16": p["o"].astype(jnp.bfloat16)}
case("fp8_and_bf16_param_derived_aux", fp8_aux, [("p", MLP, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 62 dropout with the key carried through lax.scan over layers (key not returned)
L = {"ws": nrm(3, 8, 8, scale=.4), "a": nrm(D, 8, scale=.5), "o": nrm(8, C, scale=.5)}
def scan_layers_drop(p, x, y, key):
    def layer(carry, w):
        h, k = carry
        k, sub = jax.random.split(k)
        h = jax.nn.relu(h @ w)
        h = jnp.where(jax.random.bernoulli(sub, 0.9, h.shape), h / 0.9, 0.0)
        return (h, k), jnp.mean(h)
    (h, k), means = lax.scan(layer, (jnp.tanh(x @ p["a"]), key), p["ws"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean(), {"act_means": means}
case("scan_over_layers_key_in_carry_dropout", scan_layers_drop, [("p", L, None), ("b", X, D_), ("b", Y, D_), ("c", jax.random.PRNGKey(4), None)], has_aux=True)

