"""Realistic losses, written as for ``jax.jit``, not for skipreduce_jax.

Each is a loss as a user writes it for ``jax.value_and_grad`` inside their
own jitted step, on the global batch: contrastive (CLIP, SimCLR, MoCo,
Barlow twins, VICReg, SwAV, DINO), RL (PPO, REINFORCE, GRPO, DPO, returns),
LM (masked token losses, packed attention, RoPE/SwiGLU, CTC, MoE), GAN and
WGAN-GP, diffusion, VAE/VQ-VAE, ranking and metric learning, flax linen
models (BatchNorm, Dropout, nn.scan, attention), custom VJPs/JVPs, scans,
callbacks, sorts, top-k and gathers over the rows of the batch.
tests/test_realistic_losses.py checks that ``skipreduce_jax.value_and_grad``
at ``num_skip=0`` equals ``jax.value_and_grad`` on every one.

``CASES[name] = dict(loss=fn, args=[(role, value, spec)], has_aux=bool, ...)``:

- role: ``"p"`` the params (their positions are ``argnums``), ``"b"`` a batch
  argument (placed with ``spec`` on the mesh), ``"c"`` any other argument
  (a key, a table, a flag), passed as it is.
- value: numpy arrays (or pytrees of them), or a :class:`Lazy` (flax params,
  PRNG keys) that :func:`resolve` builds on first use, so that importing this
  module computes nothing with JAX.
- optional: ``tol="bf16"`` (looser tolerance), ``meshes`` (mesh kinds it is
  written for; default both), ``ref_under_mesh`` (the reference also runs
  under the mesh, on the placed args: the loss uses sharding APIs),
  ``static_args`` (the ``"c"`` args are Python values closed over, not
  traced), ``make_loss`` (called with the jitted step's args, returns the
  loss: it closes over values of the step), ``call_args`` (the positions of
  the step's args the loss takes).
"""

import functools
from functools import partial

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P


class Lazy:
    """A value built on first use (flax params, a PRNG key), not at import."""

    def __init__(self, make):
        self.make = make

    @functools.cached_property
    def value(self):
        return self.make()


def resolve(value):
    """``value``, built if it is a :class:`Lazy`."""
    return value.value if isinstance(value, Lazy) else value


def prng_key(seed):
    """A raw ``jax.random.PRNGKey(seed)``, made on first use."""
    return Lazy(lambda: jax.random.PRNGKey(seed))


def typed_key(seed):
    """A typed ``jax.random.key(seed)``, made on first use."""
    return Lazy(lambda: jax.random.key(seed))


def init_params(module, seed, *inputs):
    """A flax linen module's params, as numpy arrays, made on first use."""
    return Lazy(lambda: jax.tree.map(
        np.asarray, module.init(jax.random.PRNGKey(seed), *inputs)["params"]))


B, D, C, T, V, E, H = 64, 6, 5, 8, 11, 6, 7
R = np.random.default_rng(0)


def nrm(*s, scale=1.0):
    return (R.normal(size=s) * scale).astype(np.float32)


X = nrm(B, D)
Y = R.integers(0, C, B).astype(np.int32)
LIN = {"w": nrm(D, C, scale=0.5), "b": nrm(C, scale=0.1)}
XT = nrm(B, T, D)
TOK = R.integers(0, V, (B, T)).astype(np.int32)
TGT = R.integers(0, V, (B, T)).astype(np.int32)
TMASK = (R.random((B, T)) < 0.7).astype(np.float32)
TMASK[3] = 0.0  # one all-padding row
LM = {"emb": nrm(V, E, scale=0.5), "out": nrm(E, V, scale=0.5)}


def lin(p, x):
    return x @ p["w"] + p["b"]


def per_xent(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(lin(p, x), y)


CASES = {}


def case(name, loss, args, has_aux=False, **kw):
    CASES[name] = dict(loss=loss, args=args, has_aux=has_aux, **kw)


def pb(*extra):
    return [("p", LIN, None), ("b", X, P("data")), ("b", Y, P("data")), *extra]


# 1 label smoothing
case("label_smoothing", lambda p, x, y: optax.softmax_cross_entropy(
    lin(p, x), optax.smooth_labels(jax.nn.one_hot(y, C), 0.1)).mean(), pb())


# 2 z-loss
def z_loss(p, x, y):
    lg = lin(p, x)
    lse = jax.nn.logsumexp(lg, -1)
    nll = lse - jnp.take_along_axis(lg, y[:, None], -1)[:, 0]
    return jnp.mean(nll) + 1e-2 * jnp.mean(lse ** 2)


case("z_loss", z_loss, pb())


# 3 masked LM token loss with int tokens, take_along_axis, aux counts and per-row
def masked_lm(p, tok, tgt, m):
    h = jnp.tanh(p["emb"][tok])
    logp = jax.nn.log_softmax(h @ p["out"], -1)
    nll = -jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    loss = jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1)
    return loss, {"ntok": jnp.sum(m).astype(jnp.int32), "row_nll": jnp.sum(nll * m, 1)}


case("masked_lm_take_along", masked_lm,
     [("p", LM, None), ("b", TOK, P("data")), ("b", TGT, P("data")), ("b", TMASK, P("data"))],
     has_aux=True)


# 4 optax integer xent with where mask (class 0 = ignore)
def optax_where(p, x, y):
    per = per_xent(p, x, y)
    m = y != 0
    return jnp.sum(jnp.where(m, per, 0.0)) / jnp.maximum(jnp.sum(m), 1)


case("optax_int_xent_where", optax_where, pb())

# 5 per-example weights as extra batch arg
WTS = R.random(B).astype(np.float32)
case("per_example_weights", lambda p, x, y, w: jnp.sum(w * per_xent(p, x, y)) / jnp.sum(w),
     pb(("b", WTS, P("data"))))


# 6 NaN-safe division per row (rows with empty mask)
def nan_safe(p, x, m):
    v = jnp.einsum("btd,d->bt", x, p["w"][:, 0])
    num = jnp.sum(v ** 2 * m, 1)
    den = jnp.sum(m, 1)
    per = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    return jnp.mean(per)


case("nan_safe_div", nan_safe, [("p", LIN, None), ("b", XT, P("data")), ("b", TMASK, P("data"))])

# 7 EMA teacher via stop_gradient, teacher passed as non-batch arg (16-row leaf)
MLP = {"a": nrm(D, 16, scale=0.4), "o": nrm(16, C, scale=0.4)}
TEACH = {"a": nrm(D, 16, scale=0.4), "o": nrm(16, C, scale=0.4)}


def mlp(p, x):
    return jnp.tanh(x @ p["a"]) @ p["o"]


def ema_teacher(p, t, x):
    tgt = jax.lax.stop_gradient(jax.nn.softmax(mlp(t, x)))
    return jnp.mean(optax.softmax_cross_entropy(mlp(p, x), tgt))


case("ema_teacher_stopgrad", ema_teacher,
     [("p", MLP, None), ("c", TEACH, None), ("b", X, P("data"))])

# 8 causal attention einsum
ATT = {"q": nrm(D, D, scale=0.5), "k": nrm(D, D, scale=0.5), "v": nrm(D, D, scale=0.5)}
YT = nrm(B, T, D)


def causal_attn(p, x, y):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    mask = jnp.tril(jnp.ones((T, T), bool))
    s = jnp.where(mask[None], s, -1e9)
    o = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v)
    return jnp.mean((o - y) ** 2)


case("causal_attention", causal_attn,
     [("p", ATT, None), ("b", XT, P("data")), ("b", YT, P("data"))])

# 9 vmap over examples inside the loss
case("vmap_per_example", lambda p, x, y: jnp.mean(jax.vmap(
    lambda xi, yi: optax.softmax_cross_entropy_with_integer_labels(lin(p, xi), yi))(x, y)), pb())

# 10 RNN via lax.scan over time
RNN = {"wx": nrm(D, H, scale=0.4), "wh": nrm(H, H, scale=0.3), "wo": nrm(H, 1, scale=0.5)}
YR = nrm(B, 1)


def rnn_scan(p, x, y):
    def cell(h, xt):
        h = jnp.tanh(xt @ p["wx"] + h @ p["wh"])
        return h, jnp.sum(h, -1)
    h, hs = lax.scan(cell, jnp.zeros((x.shape[0], H)), jnp.swapaxes(x, 0, 1))
    return jnp.mean((h @ p["wo"] - y) ** 2) + 1e-2 * jnp.mean(hs ** 2)


case("rnn_scan_time", rnn_scan, [("p", RNN, None), ("b", XT, P("data")), ("b", YR, P("data"))])


# 11 RNN via fori_loop
def rnn_fori(p, x, y):
    def body(t, h):
        return jnp.tanh(x[:, t] @ p["wx"] + h @ p["wh"])
    h = lax.fori_loop(0, T, body, jnp.zeros((x.shape[0], H)))
    return jnp.mean((h @ p["wo"] - y) ** 2)


case("rnn_fori_loop", rnn_fori, [("p", RNN, None), ("b", XT, P("data")), ("b", YR, P("data"))])


# 12 jax.checkpoint blocks (plain and with a policy)
def ckpt(p, x, y):
    blk = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))
    blk2 = jax.checkpoint(lambda h, w: jax.nn.gelu(h @ w),
                          policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    h = blk(x, p["a"])
    h = blk2(h, jnp.eye(16) * 0.9 + 0.01)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y))


case("checkpoint_blocks", ckpt, [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data"))])

# 13 RL: discounted returns via cumsum over time (axis 1)
REW = nrm(B, T)


def rl_returns(p, x, r):
    vals = jnp.einsum("btd,d->bt", x, p["w"][:, 0])
    g = 0.9 ** jnp.arange(T)
    ret = jnp.flip(jnp.cumsum(jnp.flip(r * g, 1), 1), 1) / g
    return jnp.mean((vals - lax.stop_gradient(ret)) ** 2)


case("rl_cumsum_returns", rl_returns,
     [("p", LIN, None), ("b", XT, P("data")), ("b", REW, P("data"))])


# 14 per-example rows in aux
def per_rows_aux(p, x, y):
    lg = lin(p, x)
    per = optax.softmax_cross_entropy_with_integer_labels(lg, y)
    return per.mean(), {"per_example": per, "logits": lg}


case("per_example_rows_aux", per_rows_aux, pb(), has_aux=True)


# 15 argmax accuracy aux (int and float)
def acc_aux(p, x, y):
    lg = lin(p, x)
    pred = jnp.argmax(lg, -1)
    return per_xent(p, x, y).mean(), {
        "acc": jnp.mean((pred == y).astype(jnp.float32)),
        "correct": jnp.sum(pred == y).astype(jnp.int32), "pred": pred}


case("argmax_accuracy_aux", acc_aux, pb(), has_aux=True)

# 16 huber / 17 l2 loss
YC = nrm(B, C)
case("huber", lambda p, x, y: optax.huber_loss(lin(p, x), y, delta=0.5).mean(),
     [("p", LIN, None), ("b", X, P("data")), ("b", YC, P("data"))])
case("optax_l2_loss", lambda p, x, y: optax.l2_loss(lin(p, x), y).sum() / x.shape[0],
     [("p", LIN, None), ("b", X, P("data")), ("b", YC, P("data"))])

# 18 param-norm regularizer
case("param_norm_reg", lambda p, x, y: per_xent(p, x, y).mean() + 1e-2 * sum(
    jnp.linalg.norm(leaf) for leaf in jax.tree.leaves(p)), pb())


# 19 dropout with key arg and bernoulli
def dropout(p, x, y, key):
    h = jnp.tanh(x @ p["a"])
    keep = jax.random.bernoulli(key, 0.8, h.shape)
    h = jnp.where(keep, h / 0.8, 0.0)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean()


case("dropout_bernoulli_key", dropout,
     [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data")), ("c", prng_key(7), None)])

# 20 CLIP contrastive: log_softmax over rows and columns, learnable scale
TXT = nrm(B, D)
CLIP = {"wi": nrm(D, E, scale=0.5), "wt": nrm(D, E, scale=0.5), "scale": np.float32(np.log(5.0))}


def clip_loss(p, img, txt):
    a = img @ p["wi"]
    b = txt @ p["wt"]
    a = a / jnp.linalg.norm(a, axis=-1, keepdims=True)
    b = b / jnp.linalg.norm(b, axis=-1, keepdims=True)
    lg = jnp.exp(p["scale"]) * a @ b.T
    i = jnp.arange(lg.shape[0])
    l1 = -jnp.mean(jax.nn.log_softmax(lg, axis=1)[i, i])
    l2 = -jnp.mean(jax.nn.log_softmax(lg, axis=0)[i, i])
    return (l1 + l2) / 2


case("clip_contrastive_rows", clip_loss,
     [("p", CLIP, None), ("b", X, P("data")), ("b", TXT, P("data"))])

# 21 quantile, 22 median
case("quantile_losses", lambda p, x, y: (jnp.quantile(per_xent(p, x, y), 0.9),
                                         jnp.median(per_xent(p, x, y))), pb(), has_aux=True)
case("median_plus_mean", lambda p, x, y: jnp.median(per_xent(p, x, y)) + per_xent(p, x, y).mean(),
     pb())

# 23 sort-based OHEM, 24 lax.top_k over rows
case("sort_ohem", lambda p, x, y: jnp.sort(per_xent(p, x, y))[::-1][:16].mean(), pb())
case("lax_top_k_rows", lambda p, x, y: lax.top_k(per_xent(p, x, y), 8)[0].mean(), pb())

# 25 segment_sum group-mean
SEG = R.integers(0, 16, B).astype(np.int32)


def seg_mean(p, x, y, s):
    per = per_xent(p, x, y)
    sums = jax.ops.segment_sum(per, s, 16)
    cnt = jax.ops.segment_sum(jnp.ones_like(per), s, 16)
    return jnp.mean(sums / jnp.maximum(cnt, 1))


case("segment_sum_groups", seg_mean, pb(("b", SEG, P("data"))))

# 26 pairwise ranking
REL = R.integers(0, 4, B).astype(np.float32)


def pair_rank(p, x, rel):
    s = x @ p["w"][:, 0]
    diff = s[:, None] - s[None, :]
    m = rel[:, None] > rel[None, :]
    return jnp.sum(jnp.where(m, jax.nn.softplus(-diff), 0.0)) / jnp.maximum(jnp.sum(m), 1)


case("pairwise_ranking", pair_rank, [("p", LIN, None), ("b", X, P("data")), ("b", REL, P("data"))])

# 27 GAN with two models (argnums=(0, 1))
GEN = {"g": nrm(4, D, scale=0.5)}
DIS = {"d": nrm(D, 1, scale=0.5), "c": np.zeros(1, np.float32)}
Z = nrm(B, 4)


def gan(g, d, z, real):
    fake = jnp.tanh(z @ g["g"])
    dr = real @ d["d"] + d["c"]
    df = fake @ d["d"] + d["c"]
    ld = jnp.mean(jax.nn.softplus(-dr)) + jnp.mean(jax.nn.softplus(lax.stop_gradient(df)))
    lg = jnp.mean(jax.nn.softplus(-df))
    return ld + lg, {"ld": ld, "lg": lg}


case("gan_two_models", gan,
     [("p", GEN, None), ("p", DIS, None), ("b", Z, P("data")), ("b", X, P("data"))],
     has_aux=True)


# 28 flax linen MLP with LayerNorm
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.LayerNorm()(x)
        x = nn.relu(x)
        return nn.Dense(C)(x)


LMLP = LinenMLP()
LMLP_P = init_params(LMLP, 0, X[:2])
case("linen_mlp_layernorm", lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
    LMLP.apply({"params": p}, x), y).mean(),
     [("p", LMLP_P, None), ("b", X, P("data")), ("b", Y, P("data"))])


# 29 linen BatchNorm, mutable batch_stats returned in aux
class LinenBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9)(x)
        return nn.Dense(C)(nn.relu(x))


LBN = LinenBN()
_LBN_VARS = Lazy(lambda: LBN.init(jax.random.PRNGKey(1), X[:4]))
LBN_P = Lazy(lambda: jax.tree.map(np.asarray, _LBN_VARS.value["params"]))
LBN_S = Lazy(lambda: jax.tree.map(lambda a: np.asarray(a) + 0.1, _LBN_VARS.value["batch_stats"]))


def linen_bn(p, bs, x, y):
    out, upd = LBN.apply({"params": p, "batch_stats": bs}, x, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), upd["batch_stats"]


case("linen_batchnorm_mutable", linen_bn,
     [("p", LBN_P, None), ("c", LBN_S, None), ("b", X, P("data")), ("b", Y, P("data"))],
     has_aux=True)


# 31 debug print
def dbg(p, x, y):
    loss = per_xent(p, x, y).mean()
    jax.debug.print("realistic_losses debug_print: loss={loss}", loss=loss)
    return loss


case("debug_print", dbg, pb())


# 32 mixed dtype aux
def mixed_aux(p, x, y):
    per = per_xent(p, x, y)
    return per.mean(), {"count": jnp.sum(per > 1.0).astype(jnp.int32),
                        "any_big": jnp.any(per > 3.0),
                        "all_finite": jnp.all(jnp.isfinite(per)), "max": jnp.max(per),
                        "hist": jnp.bincount(y, length=C)}


case("mixed_dtype_aux", mixed_aux, pb(), has_aux=True)


# 33 bf16 compute
def bf16(p, x, y):
    pb16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    h = jnp.tanh(x.astype(jnp.bfloat16) @ pb16["a"])
    lg = (h @ pb16["o"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()


case("bf16_compute", bf16, [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data"))], tol="bf16")

# 34 token ids batch, mean pooled embedding classifier
TOKC = {"emb": nrm(V, E, scale=0.5), "w": nrm(E, C, scale=0.5)}


def tok_cls(p, tok, y):
    h = jnp.mean(p["emb"][tok], 1)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w"], y).mean()


case("token_ids_pool", tok_cls, [("p", TOKC, None), ("b", TOK, P("data")), ("b", Y, P("data"))])

# 35 dict batch
case("dict_batch", lambda p, b: jnp.sum(b["w"] * per_xent(p, b["x"], b["y"])) / jnp.sum(b["w"]),
     [("p", LIN, None), ("b", {"x": X, "y": Y, "w": WTS}, P("data"))])


# 36 dataclass batch
@flax.struct.dataclass
class Batch:
    x: jax.Array
    y: jax.Array


case("dataclass_batch", lambda p, b: per_xent(p, b.x, b.y).mean(),
     [("p", LIN, None), ("b", Batch(X, Y), P("data"))])

# 37 two row counts: 64 examples, 128 context rows (2 per example)
CTX = nrm(2 * B, D)
case("two_row_counts", lambda p, x, ctx, y: per_xent(
    p, x + ctx.reshape(x.shape[0], 2, D).mean(1), y).mean(),
    [("p", LIN, None), ("b", X, P("data")), ("b", CTX, P("data")), ("b", Y, P("data"))])

# 38 time-major (T, B, D) placed P(None, "data")
XTM = np.swapaxes(XT, 0, 1).copy()


def time_major(p, x, y):
    def cell(h, xt):
        h = jnp.tanh(xt @ p["wx"] + h @ p["wh"])
        return h, None
    h, _ = lax.scan(cell, jnp.zeros((x.shape[1], H)), x)
    return jnp.mean((h @ p["wo"] - y) ** 2)


case("time_major_scan", time_major,
     [("p", RNN, None), ("b", XTM, P(None, "data")), ("b", YR, P("data"))])
# same but T=16 (divisible) and mean over time of per-step outputs
XTM16 = nrm(16, B, D)


def time_major_mean(p, x, y):
    h = jnp.tanh(jnp.einsum("tbd,dh->tbh", x, p["wx"]))
    return jnp.mean((jnp.mean(h, 0) @ p["wo"] - y) ** 2) + jnp.mean(jnp.cumsum(h, 0)[-1] ** 2)


case("time_major_T16_cumsum", time_major_mean,
     [("p", RNN, None), ("b", XTM16, P(None, "data")), ("b", YR, P("data"))])

# 39 argnums=(0,1): encoder + head
ENC = {"a": nrm(D, 16, scale=0.4)}
HEAD = {"o": nrm(16, C, scale=0.4), "b": np.zeros(C, np.float32)}
case("argnums_two_trees", lambda e, h, x, y: optax.softmax_cross_entropy_with_integer_labels(
    jnp.tanh(x @ e["a"]) @ h["o"] + h["b"], y).mean(),
    [("p", ENC, None), ("p", HEAD, None), ("b", X, P("data")), ("b", Y, P("data"))])

# 40 closed-over constant table with 64 rows (NOT the batch)
TABLE = nrm(64, D)
PROTO_Y = R.integers(0, 64, B).astype(np.int32)


def proto_loss(p, x, y):
    e = x @ p["w"]                  # (B, C)
    pe = TABLE @ p["w"]             # (64, C) prototypes
    lg = -jnp.sum((e[:, None] - pe[None]) ** 2, -1)
    return (optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
            + jnp.mean(jnp.take(TABLE, y, axis=0) @ p["w"]))


case("closed_const_table64_numpy", proto_loss,
     [("p", LIN, None), ("b", X, P("data")), ("b", PROTO_Y, P("data"))])


# 40b the same table as a jax.Array
@functools.cache
def table_j():
    """TABLE as a concrete jax.Array, as ``jnp.asarray(TABLE)`` at import makes it.

    Made on first use (on the first device, whatever the mesh then), not at
    import, and not as a tracer.
    """
    with jax.ensure_compile_time_eval():
        return jax.device_put(TABLE, jax.devices()[0])


def proto_loss_j(p, x, y):
    pe = table_j() @ p["w"]
    e = x @ p["w"]
    lg = -jnp.sum((e[:, None] - pe[None]) ** 2, -1)
    return (optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
            + 0.1 * jnp.sum(table_j()[:4] @ p["w"]))


case("closed_const_table64_jnp", proto_loss_j,
     [("p", LIN, None), ("b", X, P("data")), ("b", PROTO_Y, P("data"))])


# 40c table built inside the jitted step (a tracer), closed over by the loss
def make_inner_table_loss():
    def outer(p, x, y):
        table = jnp.asarray(TABLE) * 1.0 + jnp.sin(jnp.arange(64.0))[:, None] * 0.1  # tracer

        def loss(p, x, y):
            pe = table @ p["w"]
            e = x @ p["w"]
            lg = -jnp.sum((e[:, None] - pe[None]) ** 2, -1)
            return (optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
                    + 0.05 * jnp.sum(pe[0]))
        return loss
    return outer


CASES["closed_tracer_table64_in_step"] = dict(
    loss=None, make_loss=make_inner_table_loss(),
    args=[("p", LIN, None), ("b", X, P("data")), ("b", PROTO_Y, P("data"))], has_aux=False)

# 40d a class-embedding table of 64 rows passed as a plain (non-batch) argument
CTAB = nrm(64, C, scale=0.3)


def class_table_arg(p, table, x, y):
    return jnp.mean(jnp.sum((lin(p, x) - table[y]) ** 2, -1)) + 1e-2 * jnp.sum(table[:8] @ p["w"].T)


case("table64_passed_as_arg", class_table_arg,
     [("p", LIN, None), ("c", CTAB, None), ("b", X, P("data")), ("b", PROTO_Y, P("data"))])

# 41 PPO with advantage normalization over the batch
ACT = R.integers(0, C, B).astype(np.int32)
OLDLP = (-R.random(B) * 2).astype(np.float32)
ADV = nrm(B)


def ppo(p, x, a, old, adv):
    logp = jax.nn.log_softmax(lin(p, x))
    lp = jnp.take_along_axis(logp, a[:, None], 1)[:, 0]
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    ratio = jnp.exp(lp - old)
    s = jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.2) * adv)
    ent = -jnp.sum(jnp.exp(logp) * logp, -1).mean()
    return -s.mean() - 0.01 * ent, {
        "clipfrac": jnp.mean((jnp.abs(ratio - 1) > 0.2).astype(jnp.float32)),
        "approx_kl": jnp.mean(old - lp)}


case("ppo_clip_advnorm", ppo, [("p", LIN, None), ("b", X, P("data")), ("b", ACT, P("data")),
                               ("b", OLDLP, P("data")), ("b", ADV, P("data"))], has_aux=True)

# 42 DPO
REFC = nrm(B) - 5
REFR = nrm(B) - 5
TOKR = R.integers(0, V, (B, T)).astype(np.int32)


def dpo(p, tc, tr, m, rc, rr):
    def seq_lp(tok):
        h = jnp.tanh(p["emb"][tok])
        lp = jax.nn.log_softmax(h @ p["out"], -1)
        return jnp.sum(jnp.take_along_axis(lp[:, :-1], tok[:, 1:, None], -1)[..., 0] * m[:, 1:], 1)
    z = 0.1 * ((seq_lp(tc) - rc) - (seq_lp(tr) - rr))
    return -jnp.mean(jax.nn.log_sigmoid(z)), {"reward_acc": jnp.mean(z > 0)}


case("dpo", dpo,
     [("p", LM, None), ("b", TOK, P("data")), ("b", TOKR, P("data")), ("b", TMASK, P("data")),
      ("b", REFC, P("data")), ("b", REFR, P("data"))], has_aux=True)

# 43 diffusion: int timesteps, alpha-bar table (numpy const), min-SNR weighting
ABAR = np.cumprod(1 - np.linspace(1e-4, 0.02, 1000)).astype(np.float32)
TS = R.integers(0, 1000, B).astype(np.int32)
EPS = nrm(B, D)
DIF = {"w1": nrm(D + 4, 16, scale=0.4), "w2": nrm(16, D, scale=0.4)}


def diffusion(p, x0, t, eps):
    ab = jnp.asarray(ABAR)[t][:, None]
    xt = jnp.sqrt(ab) * x0 + jnp.sqrt(1 - ab) * eps
    freqs = jnp.exp(-jnp.arange(2) * 2.0)
    ang = t[:, None].astype(jnp.float32) / 1000.0 * freqs[None]
    temb = jnp.concatenate([jnp.sin(ang), jnp.cos(ang)], -1)
    pred = jax.nn.silu(jnp.concatenate([xt, temb], -1) @ p["w1"]) @ p["w2"]
    snr = ab[:, 0] / (1 - ab[:, 0])
    w = jnp.minimum(snr, 5.0) / snr
    return jnp.mean(w * jnp.sum((pred - eps) ** 2, -1))


case("diffusion_min_snr", diffusion, [("p", DIF, None), ("b", X, P("data")), ("b", TS, P("data")),
                                      ("b", EPS, P("data"))])


# 44 triplet batch-hard
def triplet(p, x, y):
    e = x @ p["w"]
    d = jnp.sqrt(jnp.sum((e[:, None] - e[None]) ** 2, -1) + 1e-12)
    same = y[:, None] == y[None]
    eye = jnp.eye(x.shape[0], dtype=bool)
    hp = jnp.max(jnp.where(same & ~eye, d, 0.0), 1)
    hn = jnp.min(jnp.where(~same, d, jnp.inf), 1)
    return jnp.mean(jax.nn.relu(hp - hn + 0.5))


case("triplet_batch_hard", triplet, pb())

# 45 focal loss
case("sigmoid_focal", lambda p, x, y: optax.sigmoid_focal_loss(
    lin(p, x), jax.nn.one_hot(y, C), alpha=0.25, gamma=2.0).sum(-1).mean(), pb())

# 46 distillation KL with temperature, teacher logits as batch input
TLOG = nrm(B, C)


def distill(p, x, y, tl):
    s = lin(p, x)
    kl = optax.kl_divergence(jax.nn.log_softmax(s / 2.0), jax.nn.softmax(tl / 2.0)).mean() * 4.0
    return 0.5 * kl + 0.5 * optax.softmax_cross_entropy_with_integer_labels(s, y).mean()


case("distill_kl_temp", distill, pb(("b", TLOG, P("data"))))

# 47 VAE with reparameterization key
VAE = {"mu": nrm(D, 3, scale=0.4), "lv": nrm(D, 3, scale=0.2), "dec": nrm(3, D, scale=0.4)}


def vae(p, x, key):
    mu, lv = x @ p["mu"], x @ p["lv"]
    z = mu + jnp.exp(0.5 * lv) * jax.random.normal(key, mu.shape)
    rec = z @ p["dec"]
    r = jnp.mean(jnp.sum((rec - x) ** 2, -1))
    kl = jnp.mean(-0.5 * jnp.sum(1 + lv - mu ** 2 - jnp.exp(lv), -1))
    return r + kl, {"rec": r, "kl": kl}


case("vae_reparam_key", vae, [("p", VAE, None), ("b", X, P("data")), ("c", prng_key(3), None)],
     has_aux=True)

# 48 two-tower recommender, in-batch negatives with logQ correction
UID = R.integers(0, 20, B).astype(np.int32)
IID = R.integers(0, 30, B).astype(np.int32)
LOGQ = np.log(R.random(B) * 0.1 + 0.01).astype(np.float32)
TT = {"u": nrm(20, E, scale=0.5), "i": nrm(30, E, scale=0.5)}


def two_tower(p, u, i, lq):
    ue, ie = p["u"][u], p["i"][i]
    s = ue @ ie.T - lq[None, :]
    return optax.softmax_cross_entropy_with_integer_labels(s, jnp.arange(s.shape[0])).mean()


case("two_tower_logq", two_tower, [("p", TT, None), ("b", UID, P("data")), ("b", IID, P("data")),
                                   ("b", LOGQ, P("data"))])

# 49 MoE load-balancing aux loss
MOE = {"r": nrm(D, 4, scale=0.5), "ex": nrm(4, D, D, scale=0.4)}


def moe(p, x, y):
    pr = jax.nn.softmax(jnp.einsum("btd,de->bte", x, p["r"]), -1)
    top = jnp.argmax(pr, -1)
    oh = jax.nn.one_hot(top, 4)
    out = jnp.einsum("bte,edf,btd->btf", oh * pr, p["ex"], x)
    frac = jnp.mean(oh, (0, 1))
    pm = jnp.mean(pr, (0, 1))
    lb = 4 * jnp.sum(frac * pm)
    rz = jnp.mean(jax.nn.logsumexp(jnp.einsum("btd,de->bte", x, p["r"]), -1) ** 2)
    return jnp.mean((out - y) ** 2) + 0.01 * lb + 1e-3 * rz, {
        "lb": lb, "tokens_per_expert": jnp.sum(oh, (0, 1)).astype(jnp.int32)}


case("moe_load_balance", moe,
     [("p", MOE, None), ("b", XT, P("data")), ("b", YT, P("data"))], has_aux=True)


# 50 center loss with class centroids by segment_sum over the batch
def center(p, x, y):
    f = jnp.tanh(x @ p["w"])
    s = jax.ops.segment_sum(f, y, C)
    n = jax.ops.segment_sum(jnp.ones(x.shape[0]), y, C)
    cen = lax.stop_gradient(s / jnp.maximum(n, 1)[:, None])
    return per_xent(p, x, y).mean() + 0.1 * jnp.mean(jnp.sum((f - cen[y]) ** 2, -1))


case("center_loss_segment", center, pb())

# 51 Barlow twins
X2 = X + nrm(B, D, scale=0.1)


def barlow(p, x1, x2):
    z1, z2 = x1 @ p["w"], x2 @ p["w"]
    z1 = (z1 - z1.mean(0)) / z1.std(0)
    z2 = (z2 - z2.mean(0)) / z2.std(0)
    c = z1.T @ z2 / x1.shape[0]
    on = jnp.sum((jnp.diag(c) - 1) ** 2)
    off = jnp.sum(c ** 2) - jnp.sum(jnp.diag(c) ** 2)
    return on + 5e-3 * off


case("barlow_twins", barlow, [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data"))])

# 52 BCE with pos weight
case("sigmoid_bce_posweight", lambda p, x, y: jnp.mean(optax.sigmoid_binary_cross_entropy(
    lin(p, x), jax.nn.one_hot(y, C)) * jnp.where(jax.nn.one_hot(y, C) > 0, 3.0, 1.0)), pb())

# 53 CTC
CTCL = R.integers(1, V, (B, 3)).astype(np.int32)
LPAD = np.zeros((B, T), np.float32)
LPAD[:, -2:] = (R.random((B, 1)) < 0.5)
LABPAD = np.zeros((B, 3), np.float32)


def ctc(p, tok, lpad, lab, labpad):
    lg = jnp.tanh(p["emb"][tok]) @ p["out"]
    return optax.ctc_loss(lg, lpad, lab, labpad).mean()


case("ctc_loss", ctc, [("p", LM, None), ("b", TOK, P("data")), ("b", LPAD, P("data")),
                       ("b", CTCL, P("data")), ("b", LABPAD, P("data"))])

# 54 WGAN-GP: gradient penalty (grad wrt inputs inside the loss)
FAKE = nrm(B, D)
EPSI = R.random((B, 1)).astype(np.float32)


def wgan_gp(p, real, fake, e):
    def critic(z):
        return jnp.tanh(z @ p["a"]) @ p["o"][:, 0]
    xi = e * real + (1 - e) * fake
    g = jax.grad(lambda z: jnp.sum(critic(z)))(xi)
    gp = jnp.mean((jnp.sqrt(jnp.sum(g ** 2, -1) + 1e-12) - 1) ** 2)
    return jnp.mean(critic(fake)) - jnp.mean(critic(real)) + 10 * gp


case("wgan_gradient_penalty", wgan_gp,
     [("p", MLP, None), ("b", X, P("data")), ("b", FAKE, P("data")),
     ("b", EPSI, P("data"))])

# 55 ListNet: softmax over rows (the list is the batch)
case("listnet_softmax_rows", lambda p, x, rel: -jnp.sum(
    jax.nn.softmax(rel) * jax.nn.log_softmax(x @ p["w"][:, 0])),
    [("p", LIN, None), ("b", X, P("data")), ("b", REL, P("data"))])

# 56 contrastive with padded rows masked by -inf
VALID = np.ones(B, bool)
VALID[-5:] = False


def padded_infonce(p, x, x2, valid):
    a, b = x @ p["w"], x2 @ p["w"]
    lg = a @ b.T / 0.5
    lg = jnp.where(valid[None, :], lg, -jnp.inf)
    lp = jax.nn.log_softmax(lg, -1)
    per = -jnp.diagonal(lp)
    return jnp.sum(jnp.where(valid, per, 0.0)) / jnp.sum(valid)


case("padded_infonce_neg_inf", padded_infonce,
     [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data")),
      ("b", VALID, P("data"))])


# 57 gradient reversal (DANN) custom_vjp
@jax.custom_vjp
def grad_reverse(x):
    return x


grad_reverse.defvjp(lambda x: (x, None), lambda _, g: (-0.5 * g,))
DOM = R.integers(0, 2, B).astype(np.float32)


def dann(p, x, y, dom):
    f = jnp.tanh(x @ p["a"])
    cls = optax.softmax_cross_entropy_with_integer_labels(f @ p["o"], y).mean()
    dl = jnp.sum(grad_reverse(f), -1) * 0.3
    return cls + optax.sigmoid_binary_cross_entropy(dl, dom).mean()


case("grad_reversal_custom_vjp", dann, [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data")),
                                        ("b", DOM, P("data"))])

# 58 packed-sequence attention mask from segment ids (MaxText style)
SEGT = np.sort(R.integers(1, 3, (B, T)), 1).astype(np.int32)


def packed_attn(p, x, seg, y):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D)
    m = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((T, T), bool))[None]
    s = jnp.where(m, s, jnp.finfo(jnp.float32).min)
    o = jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v)
    return jnp.mean((o - y) ** 2)


case("packed_segment_attention", packed_attn,
     [("p", ATT, None), ("b", XT, P("data")), ("b", SEGT, P("data")),
      ("b", YT, P("data"))])

# 59 HF-style ignore_index=-100
YIGN = Y.copy()
YIGN[::5] = -100


def hf_ignore(p, x, y):
    lp = jax.nn.log_softmax(lin(p, x))
    valid = y != -100
    safe = jnp.where(valid, y, 0)
    nll = -jnp.take_along_axis(lp, safe[:, None], -1)[:, 0]
    return jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1), {"n": jnp.sum(valid)}


case("hf_ignore_index", hf_ignore,
     [("p", LIN, None), ("b", X, P("data")), ("b", YIGN, P("data"))], has_aux=True)


# 60 global target standardization + lax.cond on a batch statistic
def cond_std(p, x, y):
    t = (y - y.mean(0)) / (y.std(0) + 1e-6)
    err = jnp.mean((lin(p, x) - t) ** 2)
    return lax.cond(err > 1.0, lambda e: jnp.sqrt(e), lambda e: e, err)


case("target_std_and_cond", cond_std, [("p", LIN, None), ("b", X, P("data")), ("b", YC, P("data"))])


# 61 CNN: linen Conv + GroupNorm + avg_pool on NHWC images (uint8 input normalized)
IMG = R.integers(0, 256, (B, 6, 6, 2)).astype(np.uint8)


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.astype(jnp.float32) / 255.0
        x = nn.Conv(4, (3, 3))(x)
        x = nn.GroupNorm(num_groups=2)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        return nn.Dense(C)(x.reshape(x.shape[0], -1))


CNNM = CNN()
CNN_P = init_params(CNNM, 2, IMG[:2])
case("cnn_conv_groupnorm_uint8", lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
    CNNM.apply({"params": p}, x), y).mean(),
    [("p", CNN_P, None), ("b", IMG, P("data")), ("b", Y, P("data"))])


# 62 linen Dropout via rngs={"dropout": key}
class DropMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(0.3, deterministic=not train)(x)
        return nn.Dense(C)(x)


DM = DropMLP()
DM_P = init_params(DM, 3, X[:2], False)
case("linen_dropout_rngs", lambda p, x, y, k: optax.softmax_cross_entropy_with_integer_labels(
    DM.apply({"params": p}, x, True, rngs={"dropout": k}), y).mean(),
    [("p", DM_P, None), ("b", X, P("data")), ("b", Y, P("data")), ("c", prng_key(11), None)])


# 63 typed key (jax.random.key) dropout + new key returned in aux
def typed_key_dropout(p, x, y, key):
    k1, k2 = jax.random.split(key)
    h = jnp.tanh(x @ p["a"])
    h = h * jax.random.bernoulli(k1, 0.7, h.shape) / 0.7
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean(), {
        "next_key_data": jax.random.key_data(k2)}


case("typed_key_dropout_aux_key", typed_key_dropout,
     [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data")), ("c", typed_key(5), None)],
     has_aux=True)


# 64 per-example keys from split, vmap noise
def per_example_noise(p, x, y, key):
    keys = jax.random.split(key, x.shape[0])
    xn = jax.vmap(lambda k, xi: xi + 0.1 * jax.random.normal(k, xi.shape))(keys, x)
    return per_xent(p, xn, y).mean()


case("per_example_split_keys_vmap", per_example_noise, pb(("c", prng_key(9), None)))


# 65 mixup with random permutation of rows and beta lambda
def mixup(p, x, y, key):
    k1, k2 = jax.random.split(key)
    lam = jax.random.beta(k1, 0.4, 0.4)
    perm = jax.random.permutation(k2, x.shape[0])
    xm = lam * x + (1 - lam) * x[perm]
    yo = jax.nn.one_hot(y, C)
    ym = lam * yo + (1 - lam) * yo[perm]
    return optax.softmax_cross_entropy(lin(p, xm), ym).mean()


case("mixup_permutation_beta", mixup, pb(("c", prng_key(21), None)))


# 66 REINFORCE with categorical sampling
def reinforce(p, x, r, key):
    lg = lin(p, x)
    a = jax.random.categorical(key, lg)
    lp = jnp.take_along_axis(jax.nn.log_softmax(lg), a[:, None], 1)[:, 0]
    rew = jnp.take_along_axis(r, a[:, None], 1)[:, 0]
    base = jnp.mean(rew)
    return -jnp.mean(lp * lax.stop_gradient(rew - base)), {"actions": a}


case("reinforce_categorical", reinforce,
     [("p", LIN, None), ("b", X, P("data")), ("b", YC, P("data")),
      ("c", prng_key(4), None)], has_aux=True)


# 67 SimCLR NT-Xent: batch holds two views concatenated (rows [0:32] view 1, [32:64] view 2)
def ntxent(p, x):
    z = x @ p["w"]
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    n = z.shape[0] // 2
    sim = z @ z.T / 0.5
    sim = jnp.where(jnp.eye(2 * n, dtype=bool), -1e9, sim)
    tgt = jnp.concatenate([jnp.arange(n, 2 * n), jnp.arange(0, n)])
    return optax.softmax_cross_entropy_with_integer_labels(sim, tgt).mean()


case("simclr_ntxent_halves", ntxent,
     [("p", LIN, None), ("b", np.concatenate([X[:32], X2[:32]]), P("data"))])


# 68 SwAV sinkhorn (fori_loop over rows/cols normalization)
def swav(p, x, x2):
    protos = p["w"] / jnp.linalg.norm(p["w"], axis=0, keepdims=True)
    s1, s2 = x @ protos, x2 @ protos

    def sinkhorn(s):
        Q = jnp.exp(lax.stop_gradient(s) / 0.5).T
        Q = Q / jnp.sum(Q)

        def body(_, Q):
            Q = Q / jnp.sum(Q, 1, keepdims=True) / Q.shape[0]
            Q = Q / jnp.sum(Q, 0, keepdims=True) / Q.shape[1]
            return Q
        Q = lax.fori_loop(0, 3, body, Q)
        return (Q * Q.shape[1]).T
    q1, q2 = sinkhorn(s1), sinkhorn(s2)
    return -0.5 * jnp.mean(jnp.sum(q1 * jax.nn.log_softmax(s2 / 0.1, 1), 1)
                           + jnp.sum(q2 * jax.nn.log_softmax(s1 / 0.1, 1), 1))


case("swav_sinkhorn_fori", swav, [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data"))])


# 69 VICReg (variance, invariance, covariance over the batch)
def vicreg(p, x, x2):
    z1, z2 = x @ p["w"], x2 @ p["w"]
    inv = jnp.mean((z1 - z2) ** 2)
    std1 = jnp.sqrt(z1.var(0) + 1e-4)
    var = jnp.mean(jax.nn.relu(1 - std1))
    z1c = z1 - z1.mean(0)
    cov = z1c.T @ z1c / (z1.shape[0] - 1)
    off = jnp.sum(cov ** 2) - jnp.sum(jnp.diag(cov) ** 2)
    return 25 * inv + 25 * var + off / z1.shape[1] + 0.01 * jnp.sum(jnp.cov(z2.T))


case("vicreg_cov", vicreg, [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data"))])


# 70 DINO: teacher centering with batch mean, center update returned in aux
CENTER = np.zeros(C, np.float32)


def dino(p, t, x, x2, center):
    s = lin(p, x) / 0.1
    tl = lax.stop_gradient(lin(t, x2))
    tp = jax.nn.softmax((tl - center) / 0.04, -1)
    loss = jnp.mean(jnp.sum(-tp * jax.nn.log_softmax(s, -1), -1))
    return loss, {"new_center": 0.9 * center + 0.1 * jnp.mean(tl, 0)}


case("dino_centering", dino,
     [("p", LIN, None), ("c", {"w": LIN["w"] * 0.9, "b": LIN["b"]}, None),
      ("b", X, P("data")), ("b", X2, P("data")), ("c", CENTER, None)], has_aux=True)

# 71 AUC in aux via argsort ranks; value = BCE
BIN = (R.random(B) < 0.4).astype(np.float32)


def auc_aux(p, x, yb):
    s = x @ p["w"][:, 0]
    loss = optax.sigmoid_binary_cross_entropy(s, yb).mean()
    ranks = jnp.argsort(jnp.argsort(s)).astype(jnp.float32) + 1
    npos = jnp.sum(yb)
    auc = (jnp.sum(ranks * yb) - npos * (npos + 1) / 2) / (npos * (yb.shape[0] - npos))
    return loss, {"auc": auc, "rank_of_first": ranks[0]}


case("auc_argsort_aux", auc_aux,
     [("p", LIN, None), ("b", X, P("data")), ("b", BIN, P("data"))], has_aux=True)

# 72 jax.nn.dot_product_attention (is_causal)
case("nn_dot_product_attention", lambda p, x, y: jnp.mean((jax.nn.dot_product_attention(
    (x @ p["q"])[:, :, None, :], (x @ p["k"])[:, :, None, :], (x @ p["v"])[:, :, None, :],
    is_causal=True)[:, :, 0] - y) ** 2),
    [("p", ATT, None), ("b", XT, P("data")), ("b", YT, P("data"))])


# 73 associative_scan linear recurrence over time (S4/Mamba style)
def assoc_scan(p, x, y):
    a = jax.nn.sigmoid(jnp.einsum("btd,d->bt", x, p["w"][:, 0]))
    bx = jnp.einsum("btd,d->bt", x, p["w"][:, 1])

    def comb(left, right):
        return left[0] * right[0], right[0] * left[1] + right[1]
    _, h = lax.associative_scan(comb, (a, bx), axis=1)
    return jnp.mean((h[:, -1] - y[:, 0]) ** 2) + jnp.mean(h ** 2) * 0.1


case("associative_scan_time", assoc_scan,
     [("p", LIN, None), ("b", XT, P("data")), ("b", YR, P("data"))])


# 74 user custom_jvp safe norm
@jax.custom_jvp
def safe_norm(v):
    return jnp.sqrt(jnp.sum(v ** 2, -1))


@safe_norm.defjvp
def _sn_jvp(primals, tangents):
    (v,), (dv,) = primals, tangents
    n = safe_norm(v)
    return n, jnp.sum(v * dv, -1) / jnp.maximum(n, 1e-6)


case("custom_jvp_safe_norm", lambda p, x, y: jnp.mean((safe_norm(lin(p, x)) - y[:, 0]) ** 2),
     [("p", LIN, None), ("b", X, P("data")), ("b", YR, P("data"))])


# 75 pure_callback on per-example losses (numpy metric), value uses it
def cb_loss(p, x, y):
    per = per_xent(p, x, y)
    srt = jax.pure_callback(lambda a: np.sort(np.asarray(a)).astype(np.float32),
                            jax.ShapeDtypeStruct(per.shape, per.dtype), lax.stop_gradient(per))
    thr = srt[per.shape[0] // 2]
    return jnp.mean(jnp.where(per >= thr, per, 0.0)), {"thr": thr}


case("pure_callback_sorted_thresh", cb_loss, pb(), has_aux=True)

# 76 lax.map over examples with batch_size
case("lax_map_batched", lambda p, x, y: jnp.mean(lax.map(
    lambda a: optax.softmax_cross_entropy_with_integer_labels(lin(p, a[0]), a[1]), (x, y),
    batch_size=16)), pb())


# 77 aux returns the batch itself, a transposed output, a flattened token array, python float, None
def weird_aux(p, tok, tgt, m):
    loss, _ = masked_lm(p, tok, tgt, m)
    return loss, {"tok": tok, "mT": m.T, "flat": m.reshape(-1), "lr": 0.1, "none": None,
                  "sel": m[::9]}


case("aux_batch_transposed_flat", weird_aux,
     [("p", LM, None), ("b", TOK, P("data")), ("b", TGT, P("data")), ("b", TMASK, P("data"))],
     has_aux=True)

# 78 bf16 master params (grads in bf16) and bf16 loss value
LIN_BF = {k: v.astype(jnp.bfloat16) for k, v in LIN.items()}
case("bf16_params_bf16_value", lambda p, x, y: jnp.mean(
    (x.astype(jnp.bfloat16) @ p["w"] + p["b"]) ** 2),
    [("p", LIN_BF, None), ("b", X, P("data")), ("b", Y, P("data"))], tol="bf16")

# 79 unused param leaf and a python-float param
case("unused_leaf_and_python_float",
     lambda p, x, y: per_xent({"w": p["w"], "b": p["b"]}, x, y).mean() * p["t"],
     [("p", {"w": LIN["w"], "b": LIN["b"], "unused": np.ones(3, np.float32), "t": 1.5}, None),
      ("b", X, P("data")), ("b", Y, P("data"))])

# 80 class weights (16 entries, divisible by 8) passed as plain arg: weights[y]
CW16 = (R.random(16) + 0.5).astype(np.float32)
Y16 = R.integers(0, 16, B).astype(np.int32)
W16 = {"w": nrm(D, 16, scale=0.5), "b": np.zeros(16, np.float32)}
case("class_weights16_arg", lambda p, cw, x, y: jnp.sum(
    cw[y] * optax.softmax_cross_entropy_with_integer_labels(lin(p, x), y)) / jnp.sum(cw[y]),
    [("p", W16, None), ("c", CW16, None), ("b", X, P("data")), ("b", Y16, P("data"))])

# 81 batch of 8 rows (1 per rank) and of 128 rows with batch-mean normalization
X8, Y8 = X[:8], Y[:8]
case("batch_8_rows_xent_plus_std", lambda p, x, y: per_xent(p, x, y).mean() + jnp.std(lin(p, x)),
     [("p", LIN, None), ("b", X8, P("data")), ("b", Y8, P("data"))])
X128, Y128 = np.concatenate([X, X2]), np.concatenate([Y, Y])
case("batch_128_rows_median",
     lambda p, x, y: jnp.median(per_xent(p, x, y)) + per_xent(p, x, y)[::3].mean(),
     [("p", LIN, None), ("b", X128, P("data")), ("b", Y128, P("data"))])


# 82 RMSNorm + rotary embeddings + SwiGLU (LLM block), token ids
LLM = {"emb": nrm(V, 8, scale=0.5), "g": np.ones(8, np.float32), "wq": nrm(8, 8, scale=0.3),
       "wk": nrm(8, 8, scale=0.3), "w1": nrm(8, 12, scale=0.3), "w3": nrm(8, 12, scale=0.3),
       "w2": nrm(12, 8, scale=0.3)}


def llm_block(p, tok, tgt, m):
    h = p["emb"][tok]
    h = h * lax.rsqrt(jnp.mean(h ** 2, -1, keepdims=True) + 1e-6) * p["g"]
    pos = jnp.arange(tok.shape[1])[:, None] * jnp.exp(-jnp.arange(4) / 4.0)[None]
    cos, sin = jnp.cos(pos), jnp.sin(pos)

    def rope(v):
        v1, v2 = v[..., :4], v[..., 4:]
        return jnp.concatenate([v1 * cos - v2 * sin, v1 * sin + v2 * cos], -1)
    q, k = rope(h @ p["wq"]), rope(h @ p["wk"])
    s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(8)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    h = h + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s), h)
    h = h + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]
    lg = h @ p["emb"].T
    per = optax.softmax_cross_entropy_with_integer_labels(lg, tgt)
    z = jax.nn.logsumexp(lg, -1)
    return (jnp.sum(per * m) + 1e-4 * jnp.sum(z ** 2 * m)) / jnp.maximum(jnp.sum(m), 1), {
        "acc": jnp.sum((jnp.argmax(lg, -1) == tgt) * m) / jnp.maximum(jnp.sum(m), 1)}


case("llm_rmsnorm_rope_swiglu", llm_block,
     [("p", LLM, None), ("b", TOK, P("data")), ("b", TGT, P("data")), ("b", TMASK, P("data"))],
     has_aux=True)


# 83 linen nn.scan RNN (lifted scan) + nn.remat
class ScanRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        cell = nn.scan(nn.remat(nn.SimpleCell), variable_broadcast="params",
                       split_rngs={"params": False}, in_axes=1, out_axes=1)(features=H)
        carry = jnp.zeros((x.shape[0], H))
        _, ys = cell(carry, x)
        return nn.Dense(1)(ys[:, -1])


SRNN = ScanRNN()
SRNN_P = init_params(SRNN, 4, XT[:2])
case("linen_nn_scan_remat", lambda p, x, y: jnp.mean((SRNN.apply({"params": p}, x) - y) ** 2),
     [("p", SRNN_P, None), ("b", XT, P("data")), ("b", YR, P("data"))])

# 84 linen MultiHeadDotProductAttention with padding mask
MHA = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, out_features=D)
MHA_P = init_params(MHA, 5, XT[:2])


def mha_loss(p, x, m, y):
    mask = nn.make_attention_mask(m > 0, m > 0)
    o = MHA.apply({"params": p}, x, mask=mask)
    return jnp.sum(((o - y) ** 2).mean(-1) * m) / jnp.maximum(m.sum(), 1)


TMASK2 = TMASK.copy()
TMASK2[:, 0] = 1.0
case("linen_mha_padding_mask", mha_loss,
     [("p", MHA_P, None), ("b", XT, P("data")), ("b", TMASK2, P("data")),
      ("b", YT, P("data"))])

# 85 FFT over time (spectral loss)
case("fft_spectral_time", lambda p, x, y: jnp.mean(jnp.abs(jnp.fft.rfft(
    jnp.einsum("btd,d->bt", x, p["w"][:, 0]), axis=1) - jnp.fft.rfft(y[:, :, 0], axis=1)) ** 2),
    [("p", LIN, None), ("b", XT, P("data")), ("b", YT, P("data"))])


# 86 Gaussian NLL with per-example cholesky (batched matrices)
def gauss_nll(p, x, y):
    Lr = jnp.einsum("bd,dij->bij", x, p["L"]) * 0.1 + jnp.eye(3) * 1.5
    cov = Lr @ jnp.swapaxes(Lr, 1, 2)
    ch = jnp.linalg.cholesky(cov)
    r = y[:, :3] - x[:, :3] @ p["m"]
    sol = jax.scipy.linalg.solve_triangular(ch, r[..., None], lower=True)[..., 0]
    logdet = jnp.sum(jnp.log(jnp.diagonal(ch, axis1=1, axis2=2)), -1)
    return jnp.mean(0.5 * jnp.sum(sol ** 2, -1) + logdet)


case("gaussian_nll_cholesky", gauss_nll,
     [("p", {"L": nrm(D, 3, 3, scale=0.3), "m": nrm(3, 3, scale=0.3)}, None),
      ("b", X, P("data")), ("b", YC, P("data"))])


# 87 embedding lookup with jnp.take mode="clip" / out-of-range ids and segment_max pooling
def oov_tokens(p, tok, y):
    tok = tok + 3  # some ids >= V: clipped / filled
    h = jnp.take(p["emb"], tok, axis=0, mode="fill", fill_value=0.0)
    h2 = jnp.take(p["emb"], tok, axis=0, mode="clip")
    pooled = jnp.max(h + h2, 1)
    return optax.softmax_cross_entropy_with_integer_labels(pooled @ p["w"], y).mean()


case("take_fill_clip_oov", oov_tokens,
     [("p", TOKC, None), ("b", TOK, P("data")), ("b", Y, P("data"))])

# 88 loss where batch is one tuple argument (x, y, w) and params second (argnums=1)
case("argnums1_tuple_batch_first",
     lambda b, p: jnp.sum(b[2] * per_xent(p, b[0], b[1])) / jnp.sum(b[2]),
     [("b", (X, Y, WTS), P("data")), ("p", LIN, None)])

# 89 int32 loss components: jnp.sum over int aux and integer division in value
case("value_uses_int_count_division", lambda p, x, y: jnp.sum(per_xent(p, x, y) * (y > 1)) / (
    jnp.sum(y > 1) // 2 * 2 + 1), pb())

# 90 a scalar value from a keepdims mean, squeezed
case("keepdims_mean_squeeze", lambda p, x, y: jnp.squeeze(
    jnp.mean(lin(p, x) ** 2, axis=(0, 1), keepdims=True)), pb())


# 91 handwritten custom_vjp batch-norm whose bwd reduces over rows
@jax.custom_vjp
def bn_manual(h):
    mu = h.mean(0)
    var = h.var(0)
    return (h - mu) / jnp.sqrt(var + 1e-5)


def _bn_fwd(h):
    mu = h.mean(0)
    var = h.var(0)
    inv = 1 / jnp.sqrt(var + 1e-5)
    xh = (h - mu) * inv
    return xh, (xh, inv)


def _bn_bwd(res, g):
    xh, inv = res
    n = g.shape[0]
    dx = inv / n * (n * g - g.sum(0) - xh * jnp.sum(g * xh, 0))
    return (dx,)


bn_manual.defvjp(_bn_fwd, _bn_bwd)
case("custom_vjp_manual_batchnorm", lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
    jnp.tanh(bn_manual(x @ p["a"])) @ p["o"], y).mean(),
    [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data"))])


# 92 custom_vjp with nondiff_argnums (temperature) and a bwd that uses a batch-global scale
@partial(jax.custom_vjp, nondiff_argnums=(1,))
def scaled_grad(h, t):
    return h


def _sg_fwd(h, t):
    return h, jnp.max(jnp.abs(h))


def _sg_bwd(t, amax, g):
    return (g * t / amax,)


scaled_grad.defvjp(_sg_fwd, _sg_bwd)
case("custom_vjp_global_amax_bwd", lambda p, x, y: per_xent(p, scaled_grad(x, 2.0), y).mean(), pb())

# 93 ties across shards: duplicated rows, max/argmax/top_k/sort
XD = np.concatenate([X[:32], X[:32]])
YD = np.concatenate([Y[:32], Y[:32]])


def ties(p, x, y):
    per = per_xent(p, x, y)
    i = jnp.argmax(per)
    return jnp.max(per) + jnp.min(per) + per[i] + lax.top_k(per, 3)[0].sum() + jnp.median(per), {
        "argmax": i, "argmin": jnp.argmin(per), "topk_idx": lax.top_k(per, 3)[1],
        "argsort_head": jnp.argsort(per)[:4]}


case("ties_across_shards", ties,
     [("p", LIN, None), ("b", XD, P("data")), ("b", YD, P("data"))], has_aux=True)


# 94 loss calls an inner jax.jit helper (with static argnum) and a named_call
@partial(jax.jit, static_argnums=2)
def inner_xent(lg, y, n):
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean() * n


case("inner_jit_and_named_call",
     lambda p, x, y: inner_xent(jax.named_call(lin, name="lin")(p, x), y, 2), pb())


# 95 scatter-add by labels (.at[].add), .at[::2].multiply, .at[argmax].set
def scatters(p, x, y):
    per = per_xent(p, x, y)
    counts = jnp.zeros(C).at[y].add(1.0)
    sums = jnp.zeros(C).at[y].add(per)
    per2 = per.at[::2].multiply(0.5).at[jnp.argmax(per)].set(0.0)
    return jnp.mean(sums / jnp.maximum(counts, 1)) + per2.mean()


case("at_add_multiply_set", scatters, pb())


# 96 dynamic_slice over time with a random start, dynamic_update_slice into a buffer
def dyn(p, x, y, key):
    s = jax.random.randint(key, (), 0, T - 4)
    crop = lax.dynamic_slice_in_dim(x, s, 4, axis=1)
    buf = jnp.zeros((x.shape[0], T + 2, D))
    buf = lax.dynamic_update_slice(buf, x, (0, 2, 0))
    v = jnp.einsum("btd,d->bt", crop, p["w"][:, 0])
    return jnp.mean(v ** 2) + jnp.mean(jnp.einsum("btd,d->bt", buf, p["w"][:, 1]) ** 2)


case("dynamic_slice_update_time", dyn,
     [("p", LIN, None), ("b", XT, P("data")), ("b", YR, P("data")),
      ("c", prng_key(8), None)])


# 97 jnp.nonzero(size=) selecting positive rows
def sel_pos(p, x, y):
    per = per_xent(p, x, y)
    (idx,) = jnp.nonzero(y == 2, size=16, fill_value=0)
    valid = jnp.arange(16) < jnp.sum(y == 2)
    return jnp.sum(jnp.where(valid, per[idx], 0.0)) / jnp.maximum(jnp.sum(valid), 1) + per.mean(), {
        "uniq": jnp.unique(y, size=C, fill_value=-1)}


case("nonzero_size_unique", sel_pos, pb(), has_aux=True)


# 98 lax.sort multi-operand: keep lowest-80% losses (co-teaching)
def coteach(p, x, y):
    per = per_xent(p, x, y)
    idx = jnp.arange(per.shape[0])
    sp, si = lax.sort((lax.stop_gradient(per), idx), num_keys=1)
    keep = si[: int(0.8 * per.shape[0])]
    return per[keep].mean()


case("coteaching_lax_sort_multi", coteach, pb())

# 99 optax.losses.ntxent on embeddings with labels
case("optax_ntxent", lambda p, x, y: optax.losses.ntxent(lin(p, x), y, temperature=0.3), pb())

# 100 value from params only; batch only in aux
case("value_params_only_aux_batch", lambda p, x, y: (
    0.01 * sum(jnp.sum(leaf ** 2) for leaf in jax.tree.leaves(p)),
    {"acc": jnp.mean(jnp.argmax(lin(p, x), -1) == y)}), pb(), has_aux=True)


# 101 with_sharding_constraint in the loss (Auto-style code)
def wsc(p, x, y):
    h = lin(p, x)
    h = jax.lax.with_sharding_constraint(h, P("data", None))
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


case("with_sharding_constraint", wsc, pb(), ref_under_mesh=True)


# 102 Explicit-style loss: reshard to replicated for in-batch negatives, einsum out_sharding
def explicit_style(p, a, b):
    za = jnp.einsum("bd,dc->bc", a, p["w"], out_sharding=P("data", None))
    zb = jax.sharding.reshard(b @ p["w"], P(None, None))
    lg = za @ zb.T
    return optax.softmax_cross_entropy_with_integer_labels(lg, jnp.arange(lg.shape[0])).mean()


case("explicit_reshard_out_sharding", explicit_style,
     [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data"))],
     meshes=("explicit",), ref_under_mesh=True)


# 103 linen sow intermediates returned in aux
class Sow(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16)(x))
        self.sow("intermediates", "h", h)
        self.sow("intermediates", "hmean", h.mean())
        return nn.Dense(C)(h)


SOW = Sow()
SOW_P = init_params(SOW, 9, X[:2])


def sow_loss(p, x, y):
    out, st = SOW.apply({"params": p}, x, mutable=["intermediates"])
    return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), st


case("linen_sow_intermediates", sow_loss,
     [("p", SOW_P, None), ("b", X, P("data")), ("b", Y, P("data"))],
     has_aux=True)


# 104 closed-over step tracer batch (loss closes over y from the step)
def make_closed_y():
    def outer(p, x, y):
        def loss(p, x):
            return per_xent(p, x, y).mean() + 0.1 * jnp.mean(
                (y == 1).astype(jnp.float32) * lin(p, x)[:, 0])
        return loss
    return outer


CASES["closes_over_step_labels"] = dict(loss=None, make_loss=make_closed_y(), args=pb(),
                                        has_aux=False, call_args=(0, 1))


# 105 jax.debug.callback logging per-example losses + histogram metric
def dbg_cb(p, x, y):
    per = per_xent(p, x, y)
    jax.debug.callback(lambda a: None, per)
    h, _ = jnp.histogram(lax.stop_gradient(per), bins=4, range=(0.0, 4.0))
    return per.mean(), {"hist": h}


case("debug_callback_histogram", dbg_cb, pb(), has_aux=True)


# 106 python bool / int / str / None positional args (train flag, num classes, mode, optional mask)
def flags_loss(p, x, y, train, ncls, mode, mask):
    lg = lin(p, x)
    if train:
        lg = lg * 0.9
    oh = jax.nn.one_hot(y, ncls)
    per = optax.softmax_cross_entropy(lg, oh)
    if mask is not None:
        per = per * mask
    return per.mean() if mode == "mean" else per.sum()


case("python_bool_int_str_none_args", flags_loss,
     pb(("c", True, None), ("c", C, None), ("c", "mean", None), ("c", None, None)),
     static_args=True)

# 107 memory bank (MoCo queue) of 128 rows passed as an argument, placed P("data")
# (not the batch's rows)
QUEUE = nrm(128, C, scale=0.5)


def moco(p, x, x2, queue):
    q = lin(p, x)
    q = q / jnp.linalg.norm(q, axis=1, keepdims=True)
    k = lax.stop_gradient(lin(p, x2))
    k = k / jnp.linalg.norm(k, axis=1, keepdims=True)
    qn = queue / jnp.linalg.norm(queue, axis=1, keepdims=True)
    lpos = jnp.sum(q * k, 1, keepdims=True)
    lneg = q @ qn.T
    lg = jnp.concatenate([lpos, lneg], 1) / 0.2
    labels = jnp.zeros(lg.shape[0], jnp.int32)
    return optax.softmax_cross_entropy_with_integer_labels(lg, labels).mean(), {
        "new_queue": jnp.concatenate([k, queue[: -k.shape[0]]], 0)}


case("moco_queue_placed_data", moco, [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data")),
                                      ("b", QUEUE, P("data"))], has_aux=True)
# 108 same queue passed as a replicated plain arg
case("moco_queue_replicated_arg", moco,
     [("p", LIN, None), ("b", X, P("data")), ("b", X2, P("data")),
      ("c", QUEUE, None)], has_aux=True)


# 109 aux leaves that are constant arrays created outside the trace
@functools.cache
def const_aux():
    """A concrete jax.Array, ``jnp.arange(5.0)``, made as :func:`table_j` is."""
    with jax.ensure_compile_time_eval():
        return jax.device_put(np.arange(5.0, dtype=np.float32), jax.devices()[0])


case("aux_constant_leaf", lambda p, x, y: (
    per_xent(p, x, y).mean(), {"c": const_aux(), "c2": const_aux() * 2}), pb(), has_aux=True)

# 110 float16 inputs, bool labels
XH = X.astype(np.float16)
YB = (Y > 2)
case("float16_input_bool_labels", lambda p, x, yb: optax.sigmoid_binary_cross_entropy(
    (x.astype(jnp.float32) @ p["w"])[:, 0], yb.astype(jnp.float32)).mean(),
    [("p", LIN, None), ("b", XH, P("data")), ("b", YB, P("data"))])

# 111 params given as a tuple of arrays + a list
case("params_tuple_list", lambda p, x, y: optax.softmax_cross_entropy_with_integer_labels(
    x @ p[0] + p[1][0], y).mean(),
    [("p", (LIN["w"], [LIN["b"]]), None), ("b", X, P("data")), ("b", Y, P("data"))])


# 113 closed-form ridge head on the batch (MetaOptNet/R2D2-style): solve(X^T X + l I, X^T Y)
def ridge_head(p, x, y):
    f = jnp.tanh(x @ p["a"])
    yo = jax.nn.one_hot(y, C)
    A = f.T @ f + 0.5 * jnp.eye(f.shape[1])
    Wc = jnp.linalg.solve(A, f.T @ yo)
    return jnp.mean((f @ Wc - yo) ** 2)


case("ridge_closed_form_solve", ridge_head,
     [("p", MLP, None), ("b", X, P("data")), ("b", Y, P("data"))])


# 114 Gumbel-softmax straight-through with key
def gumbel_st(p, x, y, key):
    lg = lin(p, x)
    g = -jnp.log(-jnp.log(jax.random.uniform(key, lg.shape, minval=1e-6, maxval=1.0)))
    ys = jax.nn.softmax((lg + g) / 0.5)
    yh = jax.nn.one_hot(jnp.argmax(ys, -1), C)
    z = yh - lax.stop_gradient(ys) + ys
    return jnp.mean((z - jax.nn.one_hot(y, C)) ** 2)


case("gumbel_softmax_straight_through", gumbel_st, pb(("c", prng_key(31), None)))

# 115 VQ-VAE: codebook, straight-through, commitment, perplexity in aux
VQ = {"enc": nrm(D, 4, scale=0.5), "cb": nrm(16, 4, scale=0.5), "dec": nrm(4, D, scale=0.5)}


def vqvae(p, x):
    z = x @ p["enc"]
    d = jnp.sum((z[:, None] - p["cb"][None]) ** 2, -1)
    idx = jnp.argmin(d, 1)
    q = p["cb"][idx]
    zq = z + lax.stop_gradient(q - z)
    rec = jnp.mean((zq @ p["dec"] - x) ** 2)
    vq = (jnp.mean((lax.stop_gradient(z) - q) ** 2)
          + 0.25 * jnp.mean((z - lax.stop_gradient(q)) ** 2))
    usage = jnp.mean(jax.nn.one_hot(idx, 16), 0)
    return rec + vq, {"perplexity": jnp.exp(-jnp.sum(usage * jnp.log(usage + 1e-10))), "codes": idx}


case("vqvae_codebook", vqvae, [("p", VQ, None), ("b", X, P("data"))], has_aux=True)

# 116 top-k tokens across the whole flattened (B*T) batch
case("topk_tokens_flattened", lambda p, tok, tgt, m: lax.top_k(
    (masked_lm(p, tok, tgt, m)[1]["row_nll"][:, None] * 0
     + optax.softmax_cross_entropy_with_integer_labels(
         jnp.tanh(p["emb"][tok]) @ p["out"], tgt)).reshape(-1), 50)[0].mean(),
    [("p", LM, None), ("b", TOK, P("data")), ("b", TGT, P("data")), ("b", TMASK, P("data"))])

# 117 masked softmax via jax.nn.softmax(where=)
case("softmax_where_arg", lambda p, x, m: -jnp.mean(jnp.sum(jnp.log(jax.nn.softmax(
    jnp.einsum("btd,d->bt", x, p["w"][:, 0]), axis=-1, where=m > 0) + 1e-9) * (m > 0), -1)),
    [("p", LIN, None), ("b", XT, P("data")), ("b", TMASK2, P("data"))])

# 118 GRPO group-relative advantages: groups of 4 (within a rank), 16 (across ranks), strided groups
REWS = nrm(B)


def grpo(gs, strided):
    def loss(p, x, a, r):
        lp = jnp.take_along_axis(jax.nn.log_softmax(lin(p, x)), a[:, None], 1)[:, 0]
        if strided:
            g = r.reshape(gs, -1)
            adv = ((g - g.mean(0)) / (g.std(0) + 1e-6)).reshape(-1)
        else:
            g = r.reshape(-1, gs)
            adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-6)).reshape(-1)
        return -jnp.mean(jnp.exp(lp - lax.stop_gradient(lp)) * adv), {"adv": adv}
    return loss


for gs, st in ((4, False), (16, False), (4, True)):
    case(f"grpo_groups{gs}{'_strided' if st else ''}", grpo(gs, st),
         [("p", LIN, None), ("b", X, P("data")), ("b", ACT, P("data")), ("b", REWS, P("data"))],
         has_aux=True)

# 119 hard-negative indices into the batch (gather rows across ranks)
NEG = R.permutation(B).astype(np.int32)


def hardneg(p, x, neg):
    e = lin(p, x)
    e = e / jnp.linalg.norm(e, axis=1, keepdims=True)
    pos = jnp.sum(e * jnp.roll(e, 1, 0), 1)
    ng = jnp.sum(e * e[neg], 1)
    return jnp.mean(jax.nn.relu(ng - pos + 0.3))


case("hard_negative_index_rows", hardneg,
     [("p", LIN, None), ("b", X, P("data")), ("b", NEG, P("data"))])

# 120 GNN message passing: node batch (64 rows) and edge list (128 rows) both split over data
EDGES = R.integers(0, B, (128, 2)).astype(np.int32)
GNN = {"w1": nrm(D, 8, scale=0.4), "w2": nrm(8, C, scale=0.4)}


def gnn(p, nodes, edges, y):
    h = nodes @ p["w1"]
    msg = h[edges[:, 0]]
    agg = jax.ops.segment_sum(msg, edges[:, 1], num_segments=nodes.shape[0])
    deg = jax.ops.segment_sum(jnp.ones(edges.shape[0]), edges[:, 1], num_segments=nodes.shape[0])
    h = jax.nn.relu(h + agg / jnp.maximum(deg, 1)[:, None])
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()


case("gnn_edges_128_nodes_64", gnn, [("p", GNN, None), ("b", X, P("data")), ("b", EDGES, P("data")),
                                     ("b", Y, P("data"))])


# 121 eigh of the batch covariance (spectral / whitening loss)
def spectral(p, x):
    z = x @ p["w"]
    zc = z - z.mean(0)
    cov = zc.T @ zc / z.shape[0] + 1e-3 * jnp.eye(z.shape[1])
    ev = jnp.linalg.eigh(cov)[0]
    return jnp.sum((ev - 1.0) ** 2)


case("eigh_batch_covariance", spectral, [("p", LIN, None), ("b", X, P("data"))])


# 122 lax.switch on a batch statistic + fold_in(key, step-like int from batch)
def switchy(p, x, y, key):
    per = per_xent(p, x, y)
    k = jax.random.fold_in(key, jnp.sum(y))
    noise = jax.random.normal(k, per.shape) * 0.01
    i = jnp.clip(jnp.sum(y > 2) // 16, 0, 2)
    return lax.switch(i, [lambda v: v.mean(), lambda v: jnp.max(v), lambda v: jnp.median(v)],
                      per + noise)


case("switch_on_batch_stat_fold_in", switchy, pb(("c", prng_key(41), None)))


# A keyword argument (train=True): passed, never differentiated.
CASES["kwargs_call"] = dict(
    loss=lambda p, x, y, train=False: per_xent(p, x, y).mean() * (0.5 if train else 1.0),
    args=pb(), has_aux=False, kwargs={"train": True})
