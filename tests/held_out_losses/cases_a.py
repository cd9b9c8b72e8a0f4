"""optax losses, special functions, sorting, scans: 20 realistic losses."""
import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import optax
from jax import lax

from held_out_losses._registry import P, case

R = np.random.default_rng(123)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, T, D, V, K = 16, 6, 5, 7, 4
D_ = P("data")

# 1 poly-1 loss on LM tokens with smoothed labels and where= token mask (optax.losses.poly_loss_cross_entropy)
LMP = {"emb": nrm(V, D, scale=.5), "out": nrm(D, V, scale=.5)}
TOK = R.integers(0, V, (B, T)).astype(np.int32)
TGT = R.integers(0, V, (B, T)).astype(np.int32)
TM = R.random((B, T)) < 0.75
def poly_lm(p, tok, tgt, m):
    lg = jnp.tanh(p["emb"][tok]) @ p["out"]
    lab = optax.smooth_labels(jax.nn.one_hot(tgt, V), 0.1)
    per = optax.losses.poly_loss_cross_entropy(lg, lab, epsilon=1.0, where=m[..., None].repeat(V, -1))
    per = jnp.where(m, per, 0.0)
    n = jnp.sum(m)
    return per.sum() / jnp.maximum(n, 1), {"ntok": n.astype(jnp.int32),
                                           "acc": jnp.sum((lg.argmax(-1) == tgt) & m) / n}
case("poly1_lm_smooth_where", poly_lm, [("p", LMP, None), ("b", TOK, D_), ("b", TGT, D_), ("b", TM, D_)], has_aux=True)

# 2 multiclass sparsemax loss (sort along classes) + sparsemax support size aux
LIN = {"w": nrm(D, K + 1, scale=.7), "b": nrm(K + 1, scale=.1)}
X = nrm(B, D); Y = R.integers(0, K + 1, B).astype(np.int32)
def sparsemax(p, x, y):
    s = x @ p["w"] + p["b"]
    l = optax.losses.multiclass_sparsemax_loss(s, y)
    return l.mean(), {"support": jnp.sum(optax.projections.projection_simplex(s) > 0, -1)}
case("multiclass_sparsemax", sparsemax, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 3 multiclass hinge + perceptron + safe xent with a per-class weight vector (5 entries, not divisible by 8)
CW = (R.random(K + 1) + .5).astype(np.float32)
def hinge(p, cw, x, y):
    s = x @ p["w"] + p["b"]
    h = optax.losses.multiclass_hinge_loss(s, y)
    per = optax.losses.multiclass_perceptron_loss(s, y)
    sx = optax.losses.safe_softmax_cross_entropy(s, jax.nn.one_hot(y, K + 1))
    w = cw[y]
    return jnp.sum(w * (h + 0.1 * sx)) / jnp.sum(w), {"perc": per.mean()}
case("multiclass_hinge_classweights", hinge, [("p", LIN, None), ("c", CW, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 4 cosine distance + KL with log targets (teacher log-probs given as batch) + temperature scalar arg
TLP = np.log(jax.nn.softmax(nrm(B, K + 1)).__array__()).astype(np.float32)
Z = nrm(B, K + 1)
def cos_kl(p, temp, x, z, tlp):
    s = x @ p["w"] + p["b"]
    cd = optax.losses.cosine_distance(s, z, epsilon=1e-6).mean()
    kl = optax.losses.kl_divergence_with_log_targets(jax.nn.log_softmax(s / temp), tlp).mean()
    return cd + temp ** 2 * kl
case("cosine_distance_kl_logtargets_temp", cos_kl,
     [("p", LIN, None), ("c", np.float32(2.0), None), ("b", X, D_), ("b", Z, D_), ("b", TLP, D_)])

# 5 listwise ranking softmax loss (optax) with where= and weights, lists of 8 docs
L = 8
F = nrm(B, L, D); REL = R.integers(0, 3, (B, L)).astype(np.float32)
LV = R.random((B, L)) < 0.8; LV[:, 0] = True
QW = (R.random(B) + .5).astype(np.float32)
def rank_sm(p, f, rel, valid, qw):
    s = jnp.einsum("bld,d->bl", f, p["w"][:, 0])
    return optax.losses.ranking_softmax_loss(s, rel, where=valid, weights=qw[:, None] * jnp.ones_like(s))
case("optax_ranking_softmax_where_weights", rank_sm,
     [("p", LIN, None), ("b", F, D_), ("b", REL, D_), ("b", LV, D_), ("b", QW, D_)])

# 6 segmentation: 1x1 conv logits at low res, jax.image.resize bilinear up, dice + CE, pixel accuracy aux
IMGS = nrm(B, 8, 8, 3); SEGY = R.integers(0, 3, (B, 8, 8)).astype(np.int32)
SEGP = {"w": nrm(3, 3, scale=.5), "b": np.zeros(3, np.float32)}
def seg(p, img, y):
    small = jax.image.resize(img, (img.shape[0], 4, 4, 3), "linear")
    lg = jnp.einsum("bhwc,ck->bhwk", small, p["w"]) + p["b"]
    lg = jax.image.resize(lg, (img.shape[0], 8, 8, 3), "bilinear")
    oh = jax.nn.one_hot(y, 3)
    dice = optax.losses.dice_loss(lg, oh, reduction="mean").mean()
    ce = optax.softmax_cross_entropy_with_integer_labels(lg, y).mean()
    return dice + ce, {"pix_acc": jnp.mean(lg.argmax(-1) == y)}
case("segmentation_resize_dice", seg, [("p", SEGP, None), ("b", IMGS, D_), ("b", SEGY, D_)], has_aux=True)

# 7 flax-wmt weighted xent with label smoothing normalizing constant + t5x custom_vjp z-loss, packed segments
@jax.custom_vjp
def xent_zloss(logits, targets, z_loss):
    lse = jsp.special.logsumexp(logits, axis=-1, keepdims=True)
    loss = -jnp.sum(targets * (logits - lse), -1)
    logz = jnp.squeeze(lse, -1)
    tz = z_loss * lax.square(logz)
    return loss + tz, tz
def _xz_fwd(logits, targets, z_loss):
    mx = jnp.max(logits, -1, keepdims=True)
    sh = logits - mx
    sumexp = jnp.sum(jnp.exp(sh), -1, keepdims=True)
    lse = jnp.log(sumexp) + mx
    loss = -jnp.sum(targets * (logits - lse), -1)
    logz = jnp.squeeze(lse, -1)
    tz = z_loss * lax.square(logz)
    return (loss + tz, tz), (logits, targets, z_loss, jnp.exp(sh), sumexp, logz)
def _xz_bwd(res, g):
    g = g[0]
    logits, targets, z_loss, exp_sh, sumexp, logz = res
    dz = g[..., None] * (exp_sh / sumexp - targets + 2 * z_loss * logz[..., None] * exp_sh / sumexp)
    return dz, -g[..., None] * (logits - logz[..., None]), jnp.sum(g * logz ** 2)
xent_zloss.defvjp(_xz_fwd, _xz_bwd)
SEGID = np.sort(R.integers(0, 3, (B, T)), 1).astype(np.int32)  # 0 = padding
def wmt(p, tok, tgt, segid):
    lg = jnp.tanh(p["emb"][tok]) @ p["out"]
    w = (segid > 0).astype(jnp.float32)
    conf, lab_s = 0.9, 0.1
    low = (1 - conf) / (V - 1)
    norm = -(conf * np.log(conf) + (V - 1) * low * np.log(low + 1e-20))
    soft = jax.nn.one_hot(tgt, V) * (conf - low) + low
    loss, z = xent_zloss(lg, soft, 1e-4)
    loss = (loss - norm) * w
    return loss.sum() / w.sum(), {"z": (z * w).sum(), "denom": w.sum()}
case("wmt_t5x_custom_vjp_zloss_packed", wmt,
     [("p", LMP, None), ("b", TOK, D_), ("b", TGT, D_), ("b", SEGID, D_)], has_aux=True)

# 8 Cox partial likelihood: sort by time over the batch, reverse cumlogsumexp risk sets, Breslow ties ignored
TIMES = (R.random(B) * 10).astype(np.float32); EVT = (R.random(B) < .6).astype(np.float32)
def cox(p, x, t, e):
    s = x @ p["w"][:, 0]
    order = jnp.argsort(-t)
    s_o, e_o = s[order], e[order]
    log_risk = lax.cumlogsumexp(s_o, axis=0)
    return -jnp.sum((s_o - log_risk) * e_o) / jnp.maximum(e_o.sum(), 1.0), {"c_events": e.sum().astype(jnp.int32)}
case("cox_partial_likelihood_cumlogsumexp", cox, [("p", LIN, None), ("b", X, D_), ("b", TIMES, D_), ("b", EVT, D_)], has_aux=True)

# 9 Lovasz hinge per image (sort errors along pixels, cumsum Jaccard gradient)
PIX = nrm(B, 12, D); LBL = (R.random((B, 12)) < .4).astype(np.float32)
def lovasz(p, x, lab):
    lg = jnp.einsum("bpd,d->bp", x, p["w"][:, 0])
    signs = 2 * lab - 1
    err = 1 - lg * signs
    order = jnp.argsort(-err, axis=1)
    err_s = jnp.take_along_axis(err, order, 1)
    gt_s = jnp.take_along_axis(lab, order, 1)
    gts = gt_s.sum(1, keepdims=True)
    inter = gts - jnp.cumsum(gt_s, 1)
    union = gts + jnp.cumsum(1 - gt_s, 1)
    jac = 1 - inter / union
    grad = jnp.concatenate([jac[:, :1], jac[:, 1:] - jac[:, :-1]], 1)
    return jnp.mean(jnp.sum(jax.nn.relu(err_s) * lax.stop_gradient(grad), 1))
case("lovasz_hinge_per_image_sort", lovasz, [("p", LIN, None), ("b", PIX, D_), ("b", LBL, D_)])

# 10 linear-chain CRF NLL (forward algorithm scan over time, lengths) + Viterbi decode in aux
NT = 4
CRF = {"w": nrm(D, NT, scale=.5), "trans": nrm(NT, NT, scale=.3)}
XS = nrm(B, T, D); TAGS = R.integers(0, NT, (B, T)).astype(np.int32)
LENS = R.integers(2, T + 1, B).astype(np.int32)
def crf(p, x, tags, lens):
    em = jnp.einsum("btd,dk->btk", x, p["w"])
    mask = jnp.arange(T)[None] < lens[:, None]
    tr = p["trans"]
    # gold score
    e_sc = jnp.sum(jnp.take_along_axis(em, tags[..., None], -1)[..., 0] * mask, 1)
    t_sc = jnp.sum(tr[tags[:, :-1], tags[:, 1:]] * mask[:, 1:], 1)
    def fwd(a, inp):
        e, m = inp
        na = jax.nn.logsumexp(a[:, :, None] + tr[None] + e[:, None, :], 1)
        return jnp.where(m[:, None], na, a), None
    a, _ = lax.scan(fwd, em[:, 0], (jnp.swapaxes(em, 0, 1)[1:], mask.T[1:]))
    logz = jax.nn.logsumexp(a, -1)
    # viterbi
    def vit(d, inp):
        e, m = inp
        sc = d[:, :, None] + tr[None]
        bp = jnp.argmax(sc, 1)
        nd = jnp.max(sc, 1) + e
        return jnp.where(m[:, None], nd, d), jnp.where(m[:, None], bp, jnp.arange(NT)[None])
    d, bps = lax.scan(vit, em[:, 0], (jnp.swapaxes(em, 0, 1)[1:], mask.T[1:]))
    last = jnp.argmax(d, -1)
    def back(tag, bp):
        prev = jnp.take_along_axis(bp, tag[:, None], 1)[:, 0]
        return prev, tag
    first, path = lax.scan(back, last, bps, reverse=True)
    path = jnp.concatenate([first[None], path], 0).T
    acc = jnp.sum((path == tags) * mask) / jnp.sum(mask)
    return jnp.mean(logz - e_sc - t_sc), {"viterbi": path, "tag_acc": acc}
case("crf_forward_viterbi_scan", crf, [("p", CRF, None), ("b", XS, D_), ("b", TAGS, D_), ("b", LENS, D_)], has_aux=True)

# 11 negative binomial NLL with gammaln/xlogy + poisson logpmf aux
COUNTS = R.poisson(3, (B, 3)).astype(np.float32)
NB = {"w": nrm(D, 3, scale=.3), "logr": np.zeros(3, np.float32)}
def negbin(p, x, k):
    mu = jnp.exp(x @ p["w"])
    r = jnp.exp(p["logr"])
    ll = (jsp.special.gammaln(k + r) - jsp.special.gammaln(r) - jsp.special.gammaln(k + 1)
          + jsp.special.xlogy(r, r / (r + mu)) + jsp.special.xlogy(k, mu / (r + mu)))
    return -ll.mean(), {"poisson_ll": jsp.stats.poisson.logpmf(k, mu).mean()}
case("negative_binomial_gammaln", negbin, [("p", NB, None), ("b", X, D_), ("b", COUNTS, D_)], has_aux=True)

# 12 mixture density network: logsumexp with b=, norm.logpdf
MDN = {"pi": nrm(D, 3, scale=.4), "mu": nrm(D, 3, scale=.4), "ls": nrm(D, 3, scale=.2)}
YR = nrm(B)
def mdn(p, x, y):
    logpi = jax.nn.log_softmax(x @ p["pi"])
    mu, ls = x @ p["mu"], x @ p["ls"]
    comp = jsp.stats.norm.logpdf(y[:, None], mu, jnp.exp(ls))
    ll = jsp.special.logsumexp(comp, axis=-1, b=jnp.exp(logpi))
    return -ll.mean()
case("mdn_logsumexp_b_normlogpdf", mdn, [("p", MDN, None), ("b", X, D_), ("b", YR, D_)])

# 13 PixelCNN++ discretized logistic mixture NLL in bits per dim
NM = 3
PCN = {"w": nrm(3, 3 * NM, scale=.3)}
IMG8 = R.integers(0, 256, (B, 4, 4, 1)).astype(np.uint8)
def dlogistic(p, img):
    x = img.astype(jnp.float32) / 127.5 - 1.0
    feats = jnp.concatenate([x, jnp.roll(x, 1, 1), jnp.roll(x, 1, 2)], -1)
    out = feats @ p["w"]
    logit_pi, means, log_s = out[..., :NM], out[..., NM:2 * NM], jnp.maximum(out[..., 2 * NM:], -7.)
    c = x - means
    inv = jnp.exp(-log_s)
    plus, minus = inv * (c + 1 / 255.), inv * (c - 1 / 255.)
    cdf_p, cdf_m = jax.nn.sigmoid(plus), jax.nn.sigmoid(minus)
    log_cdf_plus = plus - jax.nn.softplus(plus)
    log_1m_cdf_min = -jax.nn.softplus(minus)
    cdf_delta = cdf_p - cdf_m
    mid = inv * c
    log_pdf_mid = mid - log_s - 2 * jax.nn.softplus(mid)
    lp = jnp.where(x < -0.999, log_cdf_plus, jnp.where(x > 0.999, log_1m_cdf_min,
         jnp.where(cdf_delta > 1e-5, jnp.log(jnp.maximum(cdf_delta, 1e-12)), log_pdf_mid - np.log(127.5))))
    ll = jax.nn.logsumexp(lp + jax.nn.log_softmax(logit_pi), -1)
    return -jnp.sum(ll) / (img.size * np.log(2.0))
case("pixelcnn_discretized_logistic_bpd", dlogistic, [("p", PCN, None), ("b", IMG8, D_)])

# 14 normalizing flow: per-example Jacobian slogdet (B,3,3) + standard normal logpdf, sign in aux
FL = {"A": nrm(D, 3, 3, scale=.2), "m": nrm(D, 3, scale=.3)}
X3 = nrm(B, 3)
def flow(p, c, x):
    J = jnp.eye(3) + jnp.einsum("bd,dij->bij", c, p["A"])
    z = jnp.einsum("bij,bj->bi", J, x) + c @ p["m"]
    sign, ld = jnp.linalg.slogdet(J)
    ll = jsp.stats.norm.logpdf(z).sum(-1) + ld
    return -ll.mean(), {"neg_det": jnp.sum(sign < 0)}
case("flow_per_example_slogdet", flow, [("p", FL, None), ("b", X, D_), ("b", X3, D_)], has_aux=True)

# 15 curriculum: searchsorted of per-example losses into batch-quantile edges, interp calibration
def curric(p, x, y):
    s = x @ p["w"] + p["b"]
    per = optax.softmax_cross_entropy_with_integer_labels(s, y)
    edges = jnp.quantile(lax.stop_gradient(per), jnp.array([0.25, 0.5, 0.75]))
    bucket = jnp.searchsorted(edges, lax.stop_gradient(per))
    w = jnp.array([1.0, 0.8, 0.6, 0.2])[bucket]
    cal = jnp.interp(lax.stop_gradient(per), jnp.array([0., 1., 2., 4.]), jnp.array([1., .9, .7, .5]))
    dig = jnp.digitize(lax.stop_gradient(per), jnp.array([0.5, 1.5]))
    return jnp.sum(w * cal * per) / jnp.sum(w * cal), {"bucket": bucket, "hist": jnp.bincount(dig, length=3)}
case("searchsorted_interp_curriculum", curric, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 16 FP8 fake quant (current scaling: amax over the batch), reduce_precision, straight-through
MLPQ = {"a": nrm(D, 8, scale=.5), "o": nrm(8, K + 1, scale=.5)}
def fp8(p, x, y):
    def fq(t, amax):
        scale = 224.0 / jnp.maximum(amax, 1e-6)
        q = lax.reduce_precision(t * scale, exponent_bits=4, mantissa_bits=3) / scale
        return t + lax.stop_gradient(q - t)
    xa = fq(x, lax.stop_gradient(jnp.max(jnp.abs(x))))
    wa = fq(p["a"], lax.stop_gradient(jnp.max(jnp.abs(p["a"]))))
    h = jax.nn.relu(xa @ wa)
    h = fq(h, lax.stop_gradient(jnp.max(jnp.abs(h))))
    e4 = jnp.clip(h, -448., 448.).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    h = h + lax.stop_gradient(e4 - h)
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean(), {"amax_h": jnp.max(h)}
case("fp8_fake_quant_batch_amax", fp8, [("p", MLPQ, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 17 AQT-style int8 matmul with preferred_element_type=int32, per-row activation scales, STE
def aqt(p, x, y):
    xs = jnp.max(jnp.abs(x), 1, keepdims=True) / 127.
    ws = jnp.max(jnp.abs(p["a"]), 0, keepdims=True) / 127.
    xq = jnp.round(x / xs).astype(jnp.int8)
    wq = jnp.round(p["a"] / ws).astype(jnp.int8)
    acc = lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    deq = acc.astype(jnp.float32) * xs * ws
    fp = x @ p["a"]
    h = jax.nn.relu(fp + lax.stop_gradient(deq - fp))
    return optax.softmax_cross_entropy_with_integer_labels(h @ p["o"], y).mean(), {"acc_max": jnp.max(acc)}
case("aqt_int8_dot_int32_ste", aqt, [("p", MLPQ, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 18 Sinkhorn OT between batch embeddings and learnable prototypes, while_loop until tolerance
PROT = {"w": nrm(D, 3, scale=.5), "proto": nrm(6, 3, scale=.5)}
def sinkhorn_ot(p, x):
    z = x @ p["w"]
    C = jnp.sum((z[:, None] - p["proto"][None]) ** 2, -1)
    Kmat = jnp.exp(-lax.stop_gradient(C) / 0.5)
    a = jnp.ones(z.shape[0]) / z.shape[0]; b = jnp.ones(6) / 6
    def cond(s):
        u, v, err, it = s
        return (err > 1e-4) & (it < 200)
    def body(s):
        u, v, _, it = s
        u2 = a / (Kmat @ v)
        v2 = b / (Kmat.T @ u2)
        err = jnp.sum(jnp.abs(u2 * (Kmat @ v2) - a))
        return u2, v2, err, it + 1
    u, v, err, it = lax.while_loop(cond, body, (jnp.ones_like(a), jnp.ones_like(b), jnp.inf, 0))
    plan = u[:, None] * Kmat * v[None]
    return jnp.sum(plan * C), {"iters": it, "err": err}
case("sinkhorn_ot_while_tolerance", sinkhorn_ot, [("p", PROT, None), ("b", X, D_)], has_aux=True)

# 19 SSD-style detection: IoU matching to constant anchors, smooth L1, 3:1 hard negative mining per image
NA = 8
ANCH = np.concatenate([R.random((NA, 2)) * .6, R.random((NA, 2)) * .3 + .2], 1).astype(np.float32)  # x,y,w,h
GT = np.concatenate([R.random((B, 2, 2)) * .6, R.random((B, 2, 2)) * .3 + .2], -1).astype(np.float32)
GTC = R.integers(1, 3, (B, 2)).astype(np.int32)
FM = nrm(B, NA, D)
DET = {"cls": nrm(D, 3, scale=.4), "reg": nrm(D, 4, scale=.2)}
def iou(a, b):
    a1, a2 = a[..., :2], a[..., :2] + a[..., 2:]
    b1, b2 = b[..., :2], b[..., :2] + b[..., 2:]
    wh = jnp.clip(jnp.minimum(a2, b2) - jnp.maximum(a1, b1), 0)
    inter = wh[..., 0] * wh[..., 1]
    return inter / (a[..., 2] * a[..., 3] + b[..., 2] * b[..., 3] - inter)
def ssd(p, fm, gt, gtc):
    cl = fm @ p["cls"]; rg = fm @ p["reg"]
    ious = iou(jnp.asarray(ANCH)[None, :, None], gt[:, None, :])  # (B, NA, 2)
    best = jnp.argmax(ious, -1)
    pos = jnp.max(ious, -1) > 0.2
    lab = jnp.where(pos, jnp.take_along_axis(gtc, best, 1), 0)
    tgt = jnp.take_along_axis(gt, best[..., None], 1)
    loc = jnp.sum(optax.huber_loss(rg, (tgt - ANCH) / 0.1, delta=1.0), -1)
    ce = optax.softmax_cross_entropy_with_integer_labels(cl, lab)
    npos = jnp.sum(pos, 1)
    neg_ce = jnp.where(pos, -jnp.inf, lax.stop_gradient(ce))
    rank = jnp.argsort(jnp.argsort(-neg_ce, 1), 1)
    hard = rank < (3 * npos)[:, None]
    tot = jnp.maximum(jnp.sum(npos), 1)
    return (jnp.sum(jnp.where(pos, loc, 0.)) + jnp.sum(jnp.where(pos | hard, ce, 0.))) / tot, {
        "npos": npos, "nhard": jnp.sum(hard)}
case("ssd_anchor_matching_hard_negatives", ssd, [("p", DET, None), ("b", FM, D_), ("b", GT, D_), ("b", GTC, D_)], has_aux=True)

# 20 all-pairs contrastive (Hadsell) over jnp.triu_indices of the batch
def pairs(p, x, y):
    e = x @ p["w"]
    i, j = jnp.triu_indices(x.shape[0], k=1)
    d = jnp.sqrt(jnp.sum((e[i] - e[j]) ** 2, -1) + 1e-9)
    same = (y[i] == y[j]).astype(jnp.float32)
    l = same * d ** 2 + (1 - same) * jax.nn.relu(1.0 - d) ** 2
    return l.mean(), {"n_pos_pairs": jnp.sum(same).astype(jnp.int32)}
case("all_pairs_triu_indices_contrastive", pairs, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

