"""flax nnx and linen models: 8 losses."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from held_out_losses._registry import P, case

R = np.random.default_rng(11)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, T, D, V, C = 16, 6, 8, 9, 4
D_ = P("data")
TOK = R.integers(1, V, (B, T)).astype(np.int32); TGT = R.integers(0, V, (B, T)).astype(np.int32)
LENS = R.integers(2, T + 1, B).astype(np.int32)
Y = R.integers(0, C, B).astype(np.int32)

# 39 nnx Transformer block: Embed, MultiHeadAttention (causal), LayerNorm, Dropout (rngs in state), split/merge
class NNXLM(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.att = nnx.MultiHeadAttention(2, D, qkv_features=8, decode=False, dropout_rate=0.0, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.ff = nnx.Linear(D, D, rngs=rngs)
    def __call__(self, tok, deterministic=False):
        h = self.emb(tok)
        mask = nnx.combine_masks(nnx.make_causal_mask(tok), nnx.make_attention_mask(tok > 0, tok > 0))
        h = h + self.att(self.ln1(h), mask=mask, deterministic=True)
        h = h + self.drop(nnx.gelu(self.ff(self.ln2(h))), deterministic=deterministic)
        return self.emb.attend(h)
_lm = NNXLM(nnx.Rngs(0, dropout=1))
LM_G, LM_P, LM_R = nnx.split(_lm, nnx.Param, ...)
def nnx_lm(params, rest, tok, tgt):
    m = nnx.merge(LM_G, params, rest, copy=True)
    lg = m(tok)
    w = (tok > 0).astype(jnp.float32)
    per = optax.softmax_cross_entropy_with_integer_labels(lg, tgt)
    return jnp.sum(per * w) / jnp.sum(w), {"rng": nnx.state(m, nnx.RngState), "ppl_tok": jnp.exp(per)}
TOK0 = TOK.copy(); TOK0[:, -1] = 0
case("nnx_transformer_mha_dropout_split_merge", nnx_lm,
     [("p", LM_P, None), ("c", LM_R, None), ("b", TOK0, D_), ("b", TGT, D_)], has_aux=True)

# 40 nnx CNN: Conv, BatchNorm(use_running_average=True), max_pool, Linear; eval-mode stats as a non-param arg
IMG = nrm(B, 6, 6, 2)
class NNXCNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(2, 4, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.c2 = nnx.Conv(4, 4, (3, 3), strides=(2, 2), padding="VALID", rngs=rngs)
        self.out = nnx.Linear(4, C, rngs=rngs)
    def __call__(self, x):
        x = nnx.relu(self.bn(self.c1(x)))
        x = nnx.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
        x = nnx.relu(self.c2(x))
        return self.out(x.mean((1, 2)))
_cnn = NNXCNN(nnx.Rngs(2))
_cnn.bn.mean.set_value(jnp.asarray(nrm(4, scale=.1))); _cnn.bn.var.set_value(jnp.asarray(np.abs(nrm(4)) + .5))
CNN_G, CNN_P, CNN_S = nnx.split(_cnn, nnx.Param, ...)
def nnx_cnn(params, stats, x, y):
    m = nnx.merge(CNN_G, params, stats)
    lg = m(x)
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(), {"acc": jnp.mean(lg.argmax(-1) == y)}
case("nnx_conv_batchnorm_eval_maxpool", nnx_cnn, [("p", CNN_P, None), ("c", CNN_S, None), ("b", IMG, D_), ("b", Y, D_)], has_aux=True)

# 41 nnx BatchNorm in train mode: updated batch stats (nnx.BatchStat) returned in aux
XF = nrm(B, D)
class NNXBN(nnx.Module):
    def __init__(self, rngs):
        self.l = nnx.Linear(D, 6, rngs=rngs); self.bn = nnx.BatchNorm(6, momentum=0.8, rngs=rngs); self.o = nnx.Linear(6, C, rngs=rngs)
    def __call__(self, x): return self.o(nnx.relu(self.bn(self.l(x))))
_bnm = NNXBN(nnx.Rngs(3))
BN_G, BN_P, BN_S = nnx.split(_bnm, nnx.Param, nnx.BatchStat)
def nnx_bn(params, stats, x, y):
    m = nnx.merge(BN_G, params, stats, copy=True)
    lg = m(x)
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(), nnx.state(m, nnx.BatchStat)
case("nnx_batchnorm_train_batchstat_aux", nnx_bn, [("p", BN_P, None), ("c", BN_S, None), ("b", XF, D_), ("b", Y, D_)], has_aux=True)

# 42 nnx RNN(LSTMCell) over embedded tokens with seq_lengths, last valid hidden state classifier
class NNXRNN(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(V, D, rngs=rngs)
        self.rnn = nnx.RNN(nnx.LSTMCell(D, 6, rngs=rngs), return_carry=True, rngs=rngs)
        self.o = nnx.Linear(6, C, rngs=rngs)
    def __call__(self, tok, lens):
        (c, h), ys = self.rnn(self.emb(tok), seq_lengths=lens)
        return self.o(h), ys
_rnn = NNXRNN(nnx.Rngs(4))
RNN_G, RNN_P, RNN_R = nnx.split(_rnn, nnx.Param, ...)
def nnx_rnn(params, rest, tok, lens, y):
    lg, ys = nnx.merge(RNN_G, params, rest, copy=True)(tok, lens)
    m = jnp.arange(T)[None] < lens[:, None]
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean() + 0.01 * jnp.sum(ys ** 2 * m[..., None]) / m.sum()
case("nnx_lstm_rnn_seq_lengths", nnx_rnn, [("p", RNN_P, None), ("c", RNN_R, None), ("b", TOK, D_), ("b", LENS, D_), ("b", Y, D_)])

# 43 linen sst2-style: Embed, Bidirectional RNN with seq_lengths (flip_sequences per row), Dense
class SST2(nn.Module):
    @nn.compact
    def __call__(self, tok, lens):
        h = nn.Embed(V, D)(tok)
        bi = nn.Bidirectional(nn.RNN(nn.LSTMCell(5)), nn.RNN(nn.GRUCell(5)))
        out = bi(h, seq_lengths=lens)
        last = jnp.take_along_axis(out, (lens - 1)[:, None, None], 1)[:, 0]
        return nn.Dense(1)(last)[:, 0]
SST = SST2()
SST_P = jax.tree.map(np.asarray, SST.init(jax.random.PRNGKey(5), TOK[:2], LENS[:2])["params"])
YB = (R.random(B) < .5).astype(np.float32)
def sst2(p, tok, lens, y):
    lg = SST.apply({"params": p}, tok, lens)
    return optax.sigmoid_binary_cross_entropy(lg, y).mean(), {"acc": jnp.mean((lg > 0) == (y > 0.5))}
case("linen_sst2_bidirectional_seq_lengths", sst2, [("p", SST_P, None), ("b", TOK, D_), ("b", LENS, D_), ("b", YB, D_)], has_aux=True)

# 44 linen nn.vmap ensemble of heads (variable_axes params 0), disagreement in aux
class Head(nn.Module):
    @nn.compact
    def __call__(self, x): return nn.Dense(C)(nn.tanh(nn.Dense(6)(x)))
class Ensemble(nn.Module):
    @nn.compact
    def __call__(self, x):
        E = nn.vmap(Head, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, out_axes=0, axis_size=3)
        return E()(x)
ENS = Ensemble()
ENS_P = jax.tree.map(np.asarray, ENS.init(jax.random.PRNGKey(6), XF[:2])["params"])
def ens(p, x, y):
    lg = ENS.apply({"params": p}, x)  # (3, B, C)
    per = jax.vmap(lambda l: optax.softmax_cross_entropy_with_integer_labels(l, y))(lg)
    probs = jax.nn.softmax(lg).mean(0)
    return per.mean(), {"per_member": per.mean(1), "disagree": jnp.mean(jnp.any(lg.argmax(-1) != lg[0].argmax(-1)[None], 0)),
                        "ens_nll": -jnp.mean(jnp.log(jnp.take_along_axis(probs, y[:, None], 1)))}
case("linen_vmap_ensemble_heads", ens, [("p", ENS_P, None), ("b", XF, D_), ("b", Y, D_)], has_aux=True)

# 45 imagenet-style ResNet block: Conv(strides), BatchNorm train (mutable), max_pool, weight decay on kernels only
class ResBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        x = nn.Conv(4, (3, 3), (1, 1), use_bias=False)(x)
        x = nn.relu(norm()(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        r = x
        y = nn.Conv(4, (3, 3), use_bias=False)(x)
        y = norm(scale_init=nn.initializers.zeros)(y)
        x = nn.relu(r + y)
        return nn.Dense(C)(jnp.mean(x, (1, 2)))
RES = ResBlock()
_rv = RES.init(jax.random.PRNGKey(7), IMG[:2], False)
RES_P = jax.tree.map(np.asarray, _rv["params"]); RES_S = jax.tree.map(lambda a: np.asarray(a) + 0.05, _rv["batch_stats"])
def resnet(p, bs, x, y):
    lg, upd = RES.apply({"params": p, "batch_stats": bs}, x, True, mutable=["batch_stats"])
    flat = traverse_util.flatten_dict(p)
    wd = sum(jnp.sum(v ** 2) for k, v in flat.items() if k[-1] == "kernel")
    oh = optax.smooth_labels(jax.nn.one_hot(y, C), 0.1)
    return optax.softmax_cross_entropy(lg, oh).mean() + 5e-4 * 0.5 * wd, (upd["batch_stats"], {"top1": jnp.mean(lg.argmax(-1) == y)})
case("linen_resnet_bn_maxpool_kernel_wd", resnet, [("p", RES_P, None), ("c", RES_S, None), ("b", IMG, D_), ("b", Y, D_)], has_aux=True)

# 46 linen conv VAE decoder with ConvTranspose, Bernoulli likelihood, reparam via make_rng
class ConvVAE(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(4, (3, 3), strides=(2, 2))(x))
        h = h.reshape(h.shape[0], -1)
        mu, lv = nn.Dense(3)(h), nn.Dense(3)(h)
        z = mu + jnp.exp(0.5 * lv) * jax.random.normal(self.make_rng("noise"), mu.shape)
        d = nn.Dense(3 * 3 * 4)(z).reshape(-1, 3, 3, 4)
        d = nn.ConvTranspose(2, (3, 3), strides=(2, 2))(nn.relu(d))
        return d, mu, lv
CVAE = ConvVAE()
CVAE_P = jax.tree.map(np.asarray, CVAE.init({"params": jax.random.PRNGKey(8), "noise": jax.random.PRNGKey(9)}, IMG[:2])["params"])
BIMG = (R.random((B, 6, 6, 2)) < .3).astype(np.float32)
def cvae(p, x, key):
    lg, mu, lv = CVAE.apply({"params": p}, x, rngs={"noise": key})
    rec = optax.sigmoid_binary_cross_entropy(lg, x).sum((1, 2, 3))
    kl = -0.5 * jnp.sum(1 + lv - mu ** 2 - jnp.exp(lv), -1)
    return jnp.mean(rec + kl), {"rec": rec.mean(), "kl": kl.mean()}
case("linen_conv_vae_convtranspose_make_rng", cvae, [("p", CVAE_P, None), ("b", BIMG, D_), ("c", jax.random.PRNGKey(10), None)], has_aux=True)

