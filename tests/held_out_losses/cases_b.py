"""RL, randomness inside the loss, meta-learning, control flow, graphs: 18 losses."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.experimental import sparse as jsparse

from held_out_losses._registry import P, case

R = np.random.default_rng(7)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, T, D, V, C = 16, 6, 5, 7, 4
D_ = P("data")
X = nrm(B, D); Y = R.integers(0, C, B).astype(np.int32)
LIN = {"w": nrm(D, C, scale=.6), "b": nrm(C, scale=.1)}
MLP = {"a": nrm(D, 8, scale=.5), "ab": np.zeros(8, np.float32), "o": nrm(8, C, scale=.5)}
def mlp(p, x): return jnp.tanh(x @ p["a"] + p["ab"]) @ p["o"]
KEY = jax.random.PRNGKey(3)

# 21 C51 distributional projection (vmap per row, scatter-add onto atoms)
NA, NACT = 11, 3
ZS = np.linspace(-5, 5, NA).astype(np.float32)
C51 = {"w": nrm(D, NACT * NA, scale=.3)}
PNEXT = np.asarray(jax.nn.softmax(nrm(B, NA), -1)); RW = nrm(B); DISC = (0.99 * (R.random(B) < .9)).astype(np.float32)
ACT = R.integers(0, NACT, B).astype(np.int32)
def c51(p, x, a, pn, r, g):
    lg = (x @ p["w"]).reshape(-1, NACT, NA)
    lp = jax.nn.log_softmax(jnp.take_along_axis(lg, a[:, None, None], 1)[:, 0], -1)
    dz = (ZS[-1] - ZS[0]) / (NA - 1)
    def proj(probs, r, g):
        tz = jnp.clip(r + g * ZS, ZS[0], ZS[-1])
        b = (tz - ZS[0]) / dz
        l, u = jnp.floor(b).astype(jnp.int32), jnp.ceil(b).astype(jnp.int32)
        m = jnp.zeros(NA).at[l].add(probs * (u - b + (l == u))).at[u].add(probs * (b - l))
        return m
    tgt = lax.stop_gradient(jax.vmap(proj)(pn, r, g))
    return -jnp.mean(jnp.sum(tgt * lp, -1)), {"q_mean": jnp.mean(jnp.sum(jnp.exp(lp) * ZS, -1))}
case("c51_distributional_projection_vmap", c51,
     [("p", C51, None), ("b", X, D_), ("b", ACT, D_), ("b", PNEXT, D_), ("b", RW, D_), ("b", DISC, D_)], has_aux=True)

# 22 prioritized replay: resample rows of the batch by priority (categorical over rows), IS weights
PRI = (R.random(B) + .1).astype(np.float32); YR = nrm(B)
def per_replay(p, x, y, pri, key):
    idx = jax.random.categorical(key, jnp.log(pri), shape=(x.shape[0],))
    probs = pri / jnp.sum(pri)
    isw = (x.shape[0] * probs[idx]) ** -0.4
    isw = isw / jnp.max(isw)
    td = x[idx] @ p["w"][:, 0] - y[idx]
    return jnp.mean(isw * optax.huber_loss(td)), {"idx": idx, "new_pri": jnp.abs(td) + 1e-3}
case("prioritized_replay_resample_rows", per_replay,
     [("p", LIN, None), ("b", X, D_), ("b", YR, D_), ("b", PRI, D_), ("c", KEY, None)], has_aux=True)

# 23 MAE random masking: uniform noise, argsort along patches, norm_pix_loss
NP_, PD = 8, 4
PATCH = nrm(B, NP_, PD)
MAE = {"enc": nrm(PD, 6, scale=.4), "mask_tok": nrm(6, scale=.1), "pos": nrm(NP_, 6, scale=.1), "dec": nrm(6, PD, scale=.4)}
def mae(p, x, key):
    keep_n = NP_ // 2
    noise = jax.random.uniform(key, x.shape[:2])
    ids_shuffle = jnp.argsort(noise, axis=1)
    ids_restore = jnp.argsort(ids_shuffle, axis=1)
    keep = ids_shuffle[:, :keep_n]
    xk = jnp.take_along_axis(x, keep[..., None], 1)
    enc = jnp.tanh(xk @ p["enc"] + p["pos"][keep])
    full = jnp.concatenate([enc, jnp.broadcast_to(p["mask_tok"], (x.shape[0], NP_ - keep_n, 6))], 1)
    full = jnp.take_along_axis(full, ids_restore[..., None], 1) + p["pos"]
    pred = full @ p["dec"]
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    tgt = (x - mu) / jnp.sqrt(var + 1e-6)
    mask = jnp.ones(x.shape[:2]).at[:, :keep_n].set(0)
    mask = jnp.take_along_axis(mask, ids_restore, 1)
    return jnp.sum(((pred - tgt) ** 2).mean(-1) * mask) / mask.sum(), {"mask": mask.astype(bool)}
case("mae_random_masking_argsort", mae, [("p", MAE, None), ("b", PATCH, D_), ("c", jax.random.key(5), None)], has_aux=True)

# 24 BERT MLM masking inside the loss: 15% select, 80/10/10 with randint random tokens
MASK_ID = V
BERT = {"emb": nrm(V + 1, D, scale=.5), "out": nrm(D, V, scale=.5)}
TOK = R.integers(0, V, (B, T)).astype(np.int32); VALID = R.random((B, T)) < .9
def bert(p, tok, valid, key):
    k1, k2, k3 = jax.random.split(key, 3)
    sel = (jax.random.uniform(k1, tok.shape) < 0.3) & valid
    r = jax.random.uniform(k2, tok.shape)
    rnd = jax.random.randint(k3, tok.shape, 0, V)
    inp = jnp.where(sel & (r < .8), MASK_ID, jnp.where(sel & (r < .9), rnd, tok))
    lg = jnp.tanh(p["emb"][inp]) @ p["out"]
    per = optax.softmax_cross_entropy_with_integer_labels(lg, tok)
    n = jnp.sum(sel)
    return jnp.sum(per * sel) / jnp.maximum(n, 1), {"n_masked": n, "inp": inp}
case("bert_mlm_masking_80_10_10", bert, [("p", BERT, None), ("b", TOK, D_), ("b", VALID, D_), ("c", KEY, None)], has_aux=True)

# 25 nucleus (top-p) sampling inside a REINFORCE loss; sort along vocab, cumsum, categorical
NUC = {"w": nrm(D, V, scale=.8)}
RTAB = nrm(B, V)
def nucleus(p, x, rtab, key):
    lg = x @ p["w"]
    pr = jax.nn.softmax(lax.stop_gradient(lg))
    sp = jnp.sort(pr, -1)[:, ::-1]
    cum = jnp.cumsum(sp, -1)
    cutoff = jnp.min(jnp.where(cum - sp < 0.9, sp, jnp.inf), -1, keepdims=True)
    masked = jnp.where(pr >= cutoff, lax.stop_gradient(lg), -jnp.inf)
    a = jax.random.categorical(key, masked)
    lp = jnp.take_along_axis(jax.nn.log_softmax(lg), a[:, None], 1)[:, 0]
    rew = jnp.take_along_axis(rtab, a[:, None], 1)[:, 0]
    return -jnp.mean(lp * (rew - rew.mean())), {"a": a, "nucleus": jnp.sum(pr >= cutoff, -1)}
case("nucleus_top_p_reinforce", nucleus, [("p", NUC, None), ("b", X, D_), ("b", RTAB, D_), ("c", KEY, None)], has_aux=True)

# 26 MAML: batch of 16 tasks, per-task inner SGD step (vmap of grad), second-order outer loss
XS = nrm(B, 4, D); YS = R.integers(0, C, (B, 4)).astype(np.int32)
XQ = nrm(B, 4, D); YQ = R.integers(0, C, (B, 4)).astype(np.int32)
def maml(p, xs, ys, xq, yq):
    def task_loss(q, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(mlp(q, x), y).mean()
    def adapt(xs, ys, xq, yq):
        g = jax.grad(task_loss)(p, xs, ys)
        q = jax.tree.map(lambda a, b: a - 0.5 * b, p, g)
        return task_loss(q, xq, yq), task_loss(p, xq, yq)
    post, pre = jax.vmap(adapt)(xs, ys, xq, yq)
    return post.mean(), {"pre": pre.mean(), "gain": (pre - post)}
case("maml_second_order_task_batch", maml,
     [("p", MLP, None), ("b", XS, D_), ("b", YS, D_), ("b", XQ, D_), ("b", YQ, D_)], has_aux=True)

# 27 SAM: ascent step from the batch gradient (stop_gradient), loss at the perturbed params
def sam(p, x, y):
    base = lambda q: optax.softmax_cross_entropy_with_integer_labels(mlp(q, x), y).mean()
    l0, g = jax.value_and_grad(base)(p)
    gn = optax.tree.norm(g)
    eps = jax.tree.map(lambda t: lax.stop_gradient(0.05 * t / (gn + 1e-12)), g)
    return base(jax.tree.map(jnp.add, p, eps)), {"loss_clean": l0, "gnorm": gn}
case("sam_perturbed_params", sam, [("p", MLP, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 28 PPO with GAE by a reverse scan over time inside the loss, value clipping, entropy
XT = nrm(B, T + 1, D); RT = nrm(B, T); DONE = R.random((B, T)) < .1
ACTT = R.integers(0, C, (B, T)).astype(np.int32); OLDLP = (-R.random((B, T)) - 1).astype(np.float32); OLDV = nrm(B, T)
PPO = {"pi": nrm(D, C, scale=.4), "v": nrm(D, 1, scale=.4)}
def ppo_gae(p, x, r, done, a, old_lp, old_v):
    v_all = (x @ p["v"])[..., 0]
    v, v_next = v_all[:, :-1], lax.stop_gradient(v_all[:, 1:])
    nd = 1.0 - done.astype(jnp.float32)
    delta = r + 0.99 * v_next * nd - lax.stop_gradient(v)
    def step(gae, inp):
        d, m = inp
        gae = d + 0.99 * 0.95 * m * gae
        return gae, gae
    _, adv = lax.scan(step, jnp.zeros(x.shape[0]), (delta.T, nd.T), reverse=True)
    adv = adv.T
    ret = adv + lax.stop_gradient(v)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    logp = jax.nn.log_softmax(x[:, :-1] @ p["pi"])
    lp = jnp.take_along_axis(logp, a[..., None], -1)[..., 0]
    ratio = jnp.exp(lp - old_lp)
    pg = -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, .8, 1.2) * adv))
    vc = old_v + jnp.clip(v - old_v, -.2, .2)
    vl = 0.5 * jnp.mean(jnp.maximum((v - ret) ** 2, (vc - ret) ** 2))
    ent = -jnp.mean(jnp.sum(jnp.exp(logp) * logp, -1))
    return pg + 0.5 * vl - 0.01 * ent, {"pg": pg, "vl": vl, "ent": ent,
                                        "clipfrac": jnp.mean(jnp.abs(ratio - 1) > .2)}
case("ppo_gae_reverse_scan_value_clip", ppo_gae,
     [("p", PPO, None), ("b", XT, D_), ("b", RT, D_), ("b", DONE, D_), ("b", ACTT, D_), ("b", OLDLP, D_), ("b", OLDV, D_)],
     has_aux=True)

# 29 Dirichlet soft-label noise (per-row gamma draws)
def dirich(p, x, y, key):
    alpha = 1.0 + 6.0 * jax.nn.one_hot(y, C)
    soft = jax.random.dirichlet(key, alpha)
    return optax.softmax_cross_entropy(x @ p["w"] + p["b"], soft).mean()
case("dirichlet_soft_labels_gamma", dirich, [("p", LIN, None), ("b", X, D_), ("b", Y, D_), ("c", KEY, None)])

# 30 reward model (Bradley-Terry) on the last non-pad token of chosen/rejected sequences
RM = {"emb": nrm(V, D, scale=.5), "v": nrm(D, scale=.5)}
TC = R.integers(0, V, (B, T)).astype(np.int32); TR = R.integers(0, V, (B, T)).astype(np.int32)
MC = (np.arange(T)[None] < R.integers(1, T + 1, (B, 1))).astype(np.int32)
MR = (np.arange(T)[None] < R.integers(1, T + 1, (B, 1))).astype(np.int32)
def reward_model(p, tc, mc, tr, mr):
    def score(tok, m):
        r = jnp.tanh(p["emb"][tok]) @ p["v"]
        last = jnp.sum(m, 1) - 1
        return r[jnp.arange(tok.shape[0]), last]
    sc, sr_ = score(tc, mc), score(tr, mr)
    return -jnp.mean(jax.nn.log_sigmoid(sc - sr_)), {"acc": jnp.mean(sc > sr_), "margin": sc - sr_}
case("reward_model_last_token_bt", reward_model,
     [("p", RM, None), ("b", TC, D_), ("b", MC, D_), ("b", TR, D_), ("b", MR, D_)], has_aux=True)

# 31 multi-view augmentation: jnp.repeat and jnp.tile of the batch, groups of 4 consecutive crops
X32 = nrm(32, D)
def views(p, x, key):
    v1 = jnp.repeat(x, 2, axis=0) + 0.1 * jax.random.normal(key, (2 * x.shape[0], x.shape[1]))
    v2 = jnp.tile(x, (2, 1))
    e1, e2 = jnp.tanh(v1 @ p["w"]), jnp.tanh(v2 @ p["w"])
    inv = jnp.mean((e1 - e2) ** 2)
    grp = jnp.mean(e2.reshape(-1, 4, e2.shape[-1]), 1)
    return inv + 0.1 * jnp.mean(grp ** 2) + 0.1 * jnp.mean(jnp.split(e1, 2)[1])
case("repeat_tile_views_group4", views, [("p", LIN, None), ("b", X32, D_), ("c", KEY, None)])

# 32 masked actions: jax.nn.log_softmax(where=legal), entropy over legal moves, optax xent where=
LEGAL = R.random((B, V)) < .6; LEGAL[np.arange(B), R.integers(0, V, B)] = True
EXPERT = np.array([R.choice(np.flatnonzero(r)) for r in LEGAL]).astype(np.int32)
def masked_act(p, x, legal, a):
    lg = x @ p["w"]
    lp = jax.nn.log_softmax(lg, where=legal)
    lp = jnp.where(legal, lp, -1e9)
    ent = -jnp.sum(jnp.where(legal, jnp.exp(lp) * lp, 0.0), -1)
    bc = optax.softmax_cross_entropy_with_integer_labels(lg, a, where=legal)
    return bc.mean() - 0.01 * ent.mean(), {"legal_frac": jnp.mean(legal), "greedy_legal": jnp.all(
        jnp.take_along_axis(legal, jnp.argmax(lp, -1)[:, None], 1))}
case("masked_actions_log_softmax_where", masked_act, [("p", NUC, None), ("b", X, D_), ("b", LEGAL, D_), ("b", EXPERT, D_)], has_aux=True)

# 33 greedy decode with while_loop until every row emitted EOS, then teacher-forced loss on the decode
DEC = {"emb": nrm(V, D, scale=.8), "w": nrm(D, D, scale=.5), "out": nrm(D, V, scale=.8)}
START = R.integers(1, V, B).astype(np.int32); REF = R.integers(0, V, (B, 8)).astype(np.int32)
def decode(p, start, ref):
    sp = lax.stop_gradient(p)
    def cond(s):
        t, toks, done, h = s
        return (t < 8) & ~jnp.all(done)
    def body(s):
        t, toks, done, h = s
        h = jnp.tanh(h @ sp["w"])
        nxt = jnp.argmax(h @ sp["out"], -1)
        nxt = jnp.where(done, 0, nxt)
        return t + 1, toks.at[:, t].set(nxt), done | (nxt == 0), h
    h0 = sp["emb"][start]
    t, toks, done, _ = lax.while_loop(cond, body, (0, jnp.zeros((start.shape[0], 8), jnp.int32), jnp.zeros(start.shape[0], bool), h0))
    m = (jnp.cumsum(toks == 0, 1) - (toks == 0)) == 0
    rew = jnp.mean((toks == ref) * m, 1)
    hs = jnp.tanh(p["emb"][jnp.concatenate([start[:, None], toks[:, :-1]], 1)] @ p["w"])
    lp = jnp.take_along_axis(jax.nn.log_softmax(hs @ p["out"]), toks[..., None], -1)[..., 0]
    return -jnp.mean(jnp.sum(lp * m, 1) * (rew - rew.mean())), {"steps": t, "toks": toks, "all_done": jnp.all(done)}
case("greedy_decode_while_all_done", decode, [("p", DEC, None), ("b", START, D_), ("b", REF, D_)], has_aux=True)

# 34 ogbg-molpcba style: nodes (32 rows) pooled into 16 graphs by segment_sum/segment_max, NaN labels masked
NN_, NG, NTASK = 32, 16, 3
NODES = nrm(NN_, D); N2G = np.sort(R.integers(0, NG, NN_)).astype(np.int32)
GLAB = (R.random((NG, NTASK)) < .5).astype(np.float32); GLAB[R.random((NG, NTASK)) < .3] = np.nan
GNN = {"w": nrm(D, 6, scale=.5), "o": nrm(12, NTASK, scale=.4)}
def ogbg(p, nodes, n2g, lab):
    h = jax.nn.relu(nodes @ p["w"])
    cnt = jax.ops.segment_sum(jnp.ones(nodes.shape[0]), n2g, NG)
    mean = jax.ops.segment_sum(h, n2g, NG) / jnp.maximum(cnt, 1)[:, None]
    mx = jax.ops.segment_max(h, n2g, NG)
    mx = jnp.where(cnt[:, None] > 0, mx, 0.0)
    lg = jnp.concatenate([mean, mx], -1) @ p["o"]
    mask = ~jnp.isnan(lab)
    lab0 = jnp.where(mask, lab, 0.0)
    l = jnp.where(mask, optax.sigmoid_binary_cross_entropy(lg, lab0), 0.0)
    return jnp.sum(l) / jnp.sum(mask), {"labeled_per_task": jnp.sum(mask, 0), "empty_graphs": jnp.sum(cnt == 0)}
case("ogbg_segment_max_pool_nan_labels", ogbg, [("p", GNN, None), ("b", NODES, D_), ("b", N2G, D_), ("b", GLAB, D_)], has_aux=True)

# 35 GCN with a sparse (BCOO) normalized adjacency over the batch's nodes, closed over
A = (R.random((B, B)) < .2).astype(np.float32); A = np.maximum(A, A.T) + np.eye(B, dtype=np.float32)
DEG = A.sum(1); AN = (A / np.sqrt(DEG[:, None] * DEG[None])).astype(np.float32)
ASP = jsparse.BCOO.fromdense(AN)
def gcn(p, x, y):
    h = jax.nn.relu(ASP @ (x @ p["a"] + p["ab"]))
    return optax.softmax_cross_entropy_with_integer_labels(ASP @ (h @ p["o"]), y).mean()
case("gcn_bcoo_sparse_adjacency", gcn, [("p", MLP, None), ("b", X, D_), ("b", Y, D_)])

# 36 confusion matrix (int32 scatter-add with 2-D indices), per-class recall, bool aux
def confusion(p, x, y):
    lg = mlp(p, x)
    pred = jnp.argmax(lg, -1)
    cm = jnp.zeros((C, C), jnp.int32).at[y, pred].add(1)
    rec = jnp.diag(cm) / jnp.maximum(cm.sum(1), 1)
    return optax.softmax_cross_entropy_with_integer_labels(lg, y).mean(), {
        "cm": cm, "balanced_acc": rec.mean(), "all_seen": jnp.all(cm.sum(1) > 0), "first_wrong": jnp.argmax(pred != y)}
case("confusion_matrix_int_aux", confusion, [("p", MLP, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 37 lax.cond / lax.switch on batch statistics whose branches return row-wise vs whole values
def conds(p, x, y):
    per = optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y)
    frac = jnp.mean(y == 0)
    w = lax.cond(frac > 0.9, lambda v: jnp.ones_like(v), lambda v: jax.nn.softmax(lax.stop_gradient(v)) * v.shape[0], per)
    w2 = lax.cond(frac < 0.9, lambda v: jnp.ones_like(v), lambda v: v / v.sum(), per)
    i = jnp.argmax(jnp.bincount(y, length=C)) % 3
    s = lax.switch(i, [lambda v: jnp.full_like(v, 0.5), lambda v: v * 2, lambda v: jnp.sort(v)], per)
    return jnp.mean(w * per) + 0.1 * jnp.mean(w2 * per) + 0.1 * jnp.mean(s), {"branch": i}
case("cond_switch_rowwise_vs_whole_branches", conds, [("p", MLP, None), ("b", X, D_), ("b", Y, D_)], has_aux=True)

# 38 WaveNet-style causal dilated 1-D conv over time + reduce_window moving average
WX = nrm(B, 12, 3); WY = nrm(B, 12, 2)
WN = {"k": nrm(3, 3, 2, scale=.4), "b": np.zeros(2, np.float32)}
def wavenet(p, x, y):
    h = lax.conv_general_dilated(x, p["k"], (1,), [(4, 0)], rhs_dilation=(2,),
                                 dimension_numbers=("NWC", "WIO", "NWC")) + p["b"]
    h = jnp.tanh(h) * jax.nn.sigmoid(h)
    sm = lax.reduce_window(h, 0.0, lax.add, (1, 3, 1), (1, 1, 1), "SAME") / 3.0
    mx = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID")
    return jnp.mean((sm - y) ** 2) + 0.1 * jnp.mean(mx ** 2)
case("wavenet_dilated_conv_reduce_window", wavenet, [("p", WN, None), ("b", WX, D_), ("b", WY, D_)])

