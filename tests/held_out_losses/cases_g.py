"""MaxText-ish primitives: checkpoint_name policies, ragged_dot MoE, unique dedupe, device_put in loss, approx_max_k."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding

from held_out_losses._registry import P, case, mesh

R = np.random.default_rng(9)
def nrm(*s, scale=1.0): return (R.normal(size=s) * scale).astype(np.float32)
B, T, D, C, V, E = 16, 4, 6, 4, 9, 3
D_ = P("data")
X = nrm(B, D); Y = R.integers(0, C, B).astype(np.int32)
TOK = R.integers(0, V, (B, T)).astype(np.int32); TGT = R.integers(0, V, (B, T)).astype(np.int32)

# 63 MaxText-style remat: checkpoint_name on MLP activations, save_only_these_names policy, scanned decoder layers
LMW = {"emb": nrm(V, D, scale=.5), "wi": nrm(2, D, 8, scale=.3), "wo": nrm(2, 8, D, scale=.3)}
def mt_remat(p, tok, tgt):
    def layer(h, w):
        wi, wo = w
        a = checkpoint_name(jax.nn.gelu(h @ wi), "mlpwi")
        o = checkpoint_name(a @ wo, "mlpwo")
        return h + o, None
    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("mlpwo"))
    h, _ = lax.scan(layer, p["emb"][tok], (p["wi"], p["wo"]))
    lg = h @ p["emb"].T
    return optax.softmax_cross_entropy_with_integer_labels(lg, tgt).mean()
case("maxtext_checkpoint_name_policy_scan_layers", mt_remat, [("p", LMW, None), ("b", TOK, D_), ("b", TGT, D_)])

# 64 dropless MoE: sort tokens by expert, lax.ragged_dot with group sizes, unsort
MOE = {"r": nrm(D, E, scale=.5), "w": nrm(E, D, D, scale=.3)}
XT = nrm(B, T, D); YT = nrm(B, T, D)
def ragged_moe(p, x, y):
    tok = x.reshape(-1, D)
    lg = tok @ p["r"]
    ex = jnp.argmax(lg, -1)
    gate = jnp.max(jax.nn.softmax(lg), -1)
    order = jnp.argsort(ex)
    sizes = jnp.bincount(ex, length=E).astype(jnp.int32)
    out = lax.ragged_dot(tok[order], p["w"], sizes)
    out = jnp.zeros_like(out).at[order].set(out) * gate[:, None]
    return jnp.mean((out.reshape(x.shape) - y) ** 2), {"sizes": sizes}
case("ragged_dot_dropless_moe", ragged_moe, [("p", MOE, None), ("b", XT, D_), ("b", YT, D_)], has_aux=True)

# 65 deduplicate repeated example ids in the batch: jnp.unique(return_inverse, return_counts, size=) -> 1/count weights
IDS = R.integers(0, 6, B).astype(np.int32)
LIN = {"w": nrm(D, C, scale=.5), "b": np.zeros(C, np.float32)}
def dedupe(p, x, y, ids):
    u, inv, cnt = jnp.unique(ids, return_inverse=True, return_counts=True, size=B, fill_value=-1)
    w = 1.0 / cnt[inv.reshape(-1)]
    per = optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y)
    return jnp.sum(w * per) / jnp.sum(w), {"n_unique": jnp.sum(u >= 0)}
case("unique_inverse_counts_dedupe_weights", dedupe, [("p", LIN, None), ("b", X, D_), ("b", Y, D_), ("b", IDS, D_)], has_aux=True)

# 66 approx_max_k retrieval loss: approximate top-k negatives from an item table
ITEMS = nrm(32, C, scale=.5)
def retrieval(p, x, y):
    q = x @ p["w"]
    s = q @ ITEMS.T
    vals, idx = lax.approx_max_k(s, 5)
    pos = jnp.take_along_axis(s, y[:, None], 1)
    return jnp.mean(jax.nn.logsumexp(jnp.concatenate([pos, vals], 1), -1) - pos[:, 0]), {"top": idx}
YI = R.integers(0, 32, B).astype(np.int32)
case("approx_max_k_retrieval_negatives", retrieval, [("p", LIN, None), ("b", X, D_), ("b", YI, D_)], has_aux=True)

# 67 jax.device_put with a sharding inside the loss (as a layout hint), Auto mesh
def devput(p, x, y):
    h = jax.device_put(jnp.tanh(x @ p["w"]), NamedSharding(mesh("auto"), P("data", None)))
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
case("device_put_sharding_in_loss_auto", devput, [("p", LIN, None), ("b", X, D_), ("b", Y, D_)], kinds=("auto",))

