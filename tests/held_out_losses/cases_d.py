"""Complex dtypes, keys as data, forward mode, argument structures."""
from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from held_out_losses._registry import P, case

R = np.random.default_rng(21)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, D, C, N = 16, 5, 5, 12
D_ = P("data")
X = nrm(B, D); Y = R.integers(0, C, B).astype(np.int32)
LIN = {"w": nrm(D, C, scale=.6), "b": nrm(C, scale=.1)}
def xent(p, x, y): return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y)

# 47 Fourier neural operator layer: rfft over space, complex spectral weights stored as real/imag, irfft
U = nrm(B, N, 2); UT = nrm(B, N, 2)
M = 4
FNO = {"wr": nrm(M, 2, 2, scale=.3), "wi": nrm(M, 2, 2, scale=.3), "lin": nrm(2, 2, scale=.3)}
def fno(p, u, ut):
    uf = jnp.fft.rfft(u, axis=1)  # (B, N//2+1, 2)
    w = p["wr"] + 1j * p["wi"]
    out = jnp.zeros_like(uf).at[:, :M].set(jnp.einsum("bmi,mio->bmo", uf[:, :M], w))
    v = jnp.fft.irfft(out, n=N, axis=1) + u @ p["lin"]
    return jnp.mean((jax.nn.gelu(v) - ut) ** 2)
case("fno_spectral_conv_real_imag_params", fno, [("p", FNO, None), ("b", U, D_), ("b", UT, D_)])

# 48 same FNO with complex64 parameters (spectral weights are a complex leaf)
FNOC = {"w": (nrm(M, 2, 2, scale=.3) + 1j * nrm(M, 2, 2, scale=.3)).astype(np.complex64), "lin": nrm(2, 2, scale=.3)}
def fno_c(p, u, ut):
    uf = jnp.fft.rfft(u, axis=1)
    out = jnp.zeros_like(uf).at[:, :M].set(jnp.einsum("bmi,mio->bmo", uf[:, :M], p["w"]))
    v = jnp.fft.irfft(out, n=N, axis=1) + u @ p["lin"]
    return jnp.mean((v - ut) ** 2)
case("fno_complex64_param_leaf", fno_c, [("p", FNOC, None), ("b", U, D_), ("b", UT, D_)])

# 49 per-example typed PRNG keys supplied by the input pipeline, placed over "data"
KEYS = jax.random.split(jax.random.key(0), B)
def key_batch(p, x, y, keys):
    noise = jax.vmap(lambda k: jax.random.normal(k, (D,)))(keys)
    keep = jax.vmap(lambda k: jax.random.bernoulli(jax.random.fold_in(k, 1), 0.8, (C,)))(keys)
    lg = (x + 0.1 * noise) @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(jnp.where(keep, lg, -1e4), y).mean()
case("per_example_typed_keys_batch_arg", key_batch, [("p", LIN, None), ("b", X, D_), ("b", Y, D_), ("b", KEYS, D_)])

# 50 raw uint32 seeds (B, 2) inside a dict batch, wrapped in the loss
RAW = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(1), B)))
def raw_keys(p, batch):
    ks = jax.random.wrap_key_data(batch["seed"])
    drop = jax.vmap(lambda k: jax.random.uniform(k, (C,)))(ks) > 0.3
    lg = batch["x"] @ p["w"] + p["b"]
    per = optax.softmax_cross_entropy_with_integer_labels(jnp.where(drop, lg, 0.0), batch["y"])
    return per.mean(), {"kept": jnp.sum(drop, -1)}
case("raw_uint32_seeds_in_dict_batch", raw_keys, [("p", LIN, None), ("b", {"x": X, "y": Y, "seed": RAW}, D_)], has_aux=True)

# 51 sliced score matching: jax.jvp of the score network inside the loss, random projections from a key
SC = {"a": nrm(D, 8, scale=.5), "o": nrm(8, D, scale=.5)}
def ssm(p, x, key):
    score = lambda z: jnp.tanh(z @ p["a"]) @ p["o"]
    v = jax.random.normal(key, x.shape)
    s, jv = jax.jvp(score, (x,), (v,))
    return jnp.mean(jnp.sum(v * jv, -1) + 0.5 * jnp.sum(v * s, -1) ** 2)
case("sliced_score_matching_jvp", ssm, [("p", SC, None), ("b", X, D_), ("c", jax.random.PRNGKey(2), None)])

# 52 FGSM adversarial training: input gradient inside the loss, sign step, clean + adversarial loss
def fgsm(p, x, y):
    gx = jax.grad(lambda z: xent(p, z, y).mean())(x)
    xa = x + 0.1 * jnp.sign(lax.stop_gradient(gx))
    return 0.5 * xent(p, x, y).mean() + 0.5 * xent(p, xa, y).mean()
case("fgsm_adversarial_input_grad", fgsm, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)])

# 53 robust regression: IRLS-style fori_loop updating a scale from the batch MAD (jnp.percentile), cond on it
YR = nrm(B); YR[::7] += 8.0
def robust(p, x, y):
    r = x @ p["w"][:, 0] - y
    rs = lax.stop_gradient(r)
    def body(i, s):
        mad = jnp.percentile(jnp.abs(rs - jnp.median(rs)), 50.0) / 0.6745
        w = jnp.minimum(1.0, 1.345 * s / jnp.maximum(jnp.abs(rs), 1e-6))
        return lax.cond(mad > 0, lambda: 0.5 * s + 0.5 * mad * jnp.sqrt(jnp.mean(w)), lambda: s)
    s = lax.fori_loop(0, 3, body, jnp.float32(1.0))
    return jnp.mean(optax.huber_loss(r / s, delta=1.345)) * s ** 2, {"scale": s, "p90": jnp.percentile(jnp.abs(rs), 90)}
case("robust_huber_fori_mad_percentile", robust, [("p", LIN, None), ("b", X, D_), ("b", YR, D_)], has_aux=True)

# 54 NamedTuple batch; flax.struct with a static field; a state dict with int/bool leaves; temperature; class weights
class Batch(NamedTuple):
    x: jax.Array
    y: jax.Array
    w: jax.Array
@flax.struct.dataclass
class Cfg:
    temp: jax.Array
    cw: jax.Array
    ncls: int = flax.struct.field(pytree_node=False, default=C)
STATE = {"step": np.int32(7), "train": np.bool_(True), "ema": {"w": LIN["w"] * .9}, "counts": np.zeros(C, np.int32)}
WTS = (R.random(B) + .5).astype(np.float32)
def struct_loss(p, state, cfg, batch):
    lg = (batch.x @ p["w"] + p["b"]) / cfg.temp
    oh = jax.nn.one_hot(batch.y, cfg.ncls)
    per = optax.softmax_cross_entropy(lg, oh) * cfg.cw[batch.y]
    reg = jnp.where(state["train"], 1e-3, 0.0) * jnp.sum((p["w"] - state["ema"]["w"]) ** 2)
    loss = jnp.sum(per * batch.w) / jnp.sum(batch.w) + reg / (1 + state["step"])
    return loss, {"step": state["step"] + 1, "counts": state["counts"] + jnp.bincount(batch.y, length=C),
                  "train": state["train"], "acc": jnp.mean(lg.argmax(-1) == batch.y)}
case("namedtuple_batch_struct_cfg_int_bool_state", struct_loss,
     [("p", LIN, None), ("c", STATE, None), ("c", Cfg(np.float32(1.5), (R.random(C) + .5).astype(np.float32)), None),
      ("b", Batch(X, Y, WTS), D_)], has_aux=True)

# 55 batch dict mixing row leaves with a replicated per-step scalar and vocab mask (placed P())
VMASK = np.ones(C, bool); VMASK[-1] = False
def mixed_batch(p, b):
    lg = jnp.where(b["vocab_mask"], b["x"] @ p["w"] + p["b"], -1e9)
    per = optax.softmax_cross_entropy_with_integer_labels(lg, b["y"])
    return b["scale"] * per.mean()
BM = {"x": X, "y": np.where(Y == C - 1, 0, Y).astype(np.int32), "scale": np.float32(0.7), "vocab_mask": VMASK}
case("dict_batch_with_replicated_scalar_and_mask", mixed_batch,
     [("p", LIN, None), ("b", BM, {"x": D_, "y": D_, "scale": P(), "vocab_mask": P()})])

# 56 zero-size leaves: an empty params leaf (no extra features) and an empty aux leaf
def zero_size(p, x, y):
    extra = x[:, :0] @ p["extra"]
    return xent(p, x, y).mean() + jnp.sum(extra), {"empty": x[:, :0], "none_feats": p["extra"].sum(0)}
case("zero_size_param_and_aux_leaves", zero_size,
     [("p", {**LIN, "extra": np.zeros((0, C), np.float32)}, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 57 a new typed key returned in aux, folded with a batch maximum
def key_aux(p, x, y, key):
    per = xent(p, x, y)
    k = jax.random.fold_in(key, jnp.max(y))
    k1, k2 = jax.random.split(k)
    noise = jax.random.normal(k1, per.shape) * 0.01
    return jnp.mean(per + noise), {"next_key": k2}
case("typed_key_aux_fold_in_batch_max", key_aux, [("p", LIN, None), ("b", X, D_), ("b", Y, D_), ("c", jax.random.key(3), None)], has_aux=True)

# 58 hashed features: uint32 multiplicative hashing of ids into buckets, bincount of bucket usage
IDS = R.integers(0, 10_000, (B, 3)).astype(np.uint32)
HASH = {"emb": nrm(16, 4, scale=.5), "o": nrm(4, C, scale=.5)}
def hashed(p, ids, y):
    h = (ids * np.uint32(2654435761)) >> np.uint32(28)
    b2 = lax.population_count(ids) % 16
    e = p["emb"][h.astype(jnp.int32)].sum(1) + p["emb"][b2.astype(jnp.int32)].mean(1)
    return optax.softmax_cross_entropy_with_integer_labels(e @ p["o"], y).mean(), {
        "usage": jnp.bincount(h.reshape(-1).astype(jnp.int32), length=16)}
case("hashed_uint32_features_bincount", hashed, [("p", HASH, None), ("b", IDS, D_), ("b", Y, D_)], has_aux=True)

