"""Generic (rule-less) primitives applied to values computed from the params alone."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from held_out_losses._registry import P, case

R = np.random.default_rng(10)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, D, C = 16, 6, 4
D_ = P("data")
X = nrm(B, D); Y = R.integers(0, C, B).astype(np.int32)
LIN = {"w": nrm(D, C, scale=.5), "b": np.zeros(C, np.float32)}
def xent(w, b, x, y): return optax.softmax_cross_entropy_with_integer_labels(x @ w + b, y).mean()

# 68 spectral-norm regularizer: largest singular value of the weight via jnp.linalg.svd
case("svd_spectral_norm_regularizer", lambda p, x, y: xent(p["w"], p["b"], x, y) + 0.1 * jnp.linalg.svd(p["w"], compute_uv=False)[0],
     [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])
# 69 orthogonal weight via matrix exponential of a skew-symmetric parameter (expm)
ORT = {"A": nrm(D, D, scale=.3), "o": nrm(D, C, scale=.5), "b": np.zeros(C, np.float32)}
def ortho(p, x, y):
    S = p["A"] - p["A"].T
    Q = jax.scipy.linalg.expm(S)
    return xent(Q @ p["o"], p["b"], x, y)
case("expm_orthogonal_param", ortho, [("p", ORT, None), ("b", X, D_), ("b", Y, D_)])
# 70 Cayley transform via jnp.linalg.solve on params only
def cayley(p, x, y):
    S = p["A"] - p["A"].T
    I = jnp.eye(D)
    Q = jnp.linalg.solve(I + S, I - S)
    return xent(Q @ p["o"], p["b"], x, y) + 1e-3 * jnp.linalg.slogdet(I + S @ S.T)[1]
case("cayley_solve_slogdet_params", cayley, [("p", ORT, None), ("b", X, D_), ("b", Y, D_)])
# 71 weight-space FFT regularizer (rfft of params)
case("rfft_of_params_regularizer", lambda p, x, y: xent(p["w"], p["b"], x, y) + 0.01 * jnp.sum(jnp.abs(jnp.fft.rfft(p["w"], axis=0)[1:]) ** 2),
     [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])
# 72 custom_vjp applied to the params (gradient clipping inside the forward)
@jax.custom_vjp
def clip_grad(w): return w
clip_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.clip(g, -0.05, 0.05),))
case("custom_vjp_on_params_clip_grad", lambda p, x, y: xent(clip_grad(p["w"]), p["b"], x, y),
     [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])
# 73 QR-orthonormalized projection head (qr on params) then cosine loss
def qr_head(p, x, y):
    Q, _ = jnp.linalg.qr(p["w"])
    return xent(Q, p["b"], x, y)
case("qr_orthonormal_head", qr_head, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])
# 74 conv kernel built from params with reduce_window smoothing (params-only reduce_window)
def smooth_w(p, x, y):
    w = lax.reduce_window(p["w"], 0.0, lax.add, (3, 1), (1, 1), "SAME") / 3.0
    return xent(w, p["b"], x, y)
case("reduce_window_on_params", smooth_w, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])

