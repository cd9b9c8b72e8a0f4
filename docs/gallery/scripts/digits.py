"""Digits: an all-reduce and Random SkipReduce, side by side.

An MLP on scikit-learn's digits (shipped with it), 8 simulated CPU devices,
Adam; the same steps with XLA's all-reduce (``skip_ratio=0``) and with
Random SkipReduce at skip ratio 0.5.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from sklearn.datasets import load_digits

import skipreduce_jax as sr

digits = load_digits()
x = (digits.data / 16.0).astype(np.float32)
y = digits.target
order = np.random.default_rng(0).permutation(len(x))
train, test = order[:1536], order[1536:]


def loss_fn(params, batch):
    x, y = batch
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def accuracy(params):
    h = jax.nn.relu(x[test] @ params["w1"] + params["b1"])
    return float(jnp.mean(jnp.argmax(h @ params["w2"] + params["b2"], -1) == y[test]))


mesh = jax.make_mesh((8,), ("data",))
k1, k2 = jax.random.split(jax.random.key(0))
init = {"w1": jax.random.normal(k1, (64, 128)) * 0.1, "b1": jnp.zeros(128),
        "w2": jax.random.normal(k2, (128, 10)) * 0.1, "b2": jnp.zeros(10)}
curves = {}
for name, ratio in (("all-reduce", 0.0), ("Random, skip ratio 0.5", 0.5)):
    tx = optax.chain(sr.skip_reduce("data", skip_ratio=ratio, min_size=0), optax.adam(3e-3))
    params = sr.replicate(init, mesh)
    opt_state = sr.init_opt_state(tx, params, mesh, "data")
    step = sr.make_train_step(loss_fn, tx, mesh, "data")
    batches = np.random.default_rng(1).choice(train, size=(300, 128))
    curves[name] = []
    for i, rows in enumerate(batches):
        params, opt_state, loss = step(params, opt_state, sr.shard_batch((x[rows], y[rows]), mesh))
        if i % 20 == 19:
            curves[name].append((i + 1, accuracy(params)))
    print(f"{name}: test accuracy {curves[name][-1][1]:.3f} after {len(batches)} steps")

fig, ax = plt.subplots(figsize=(5.2, 3.4))
for name, points in curves.items():
    ax.plot(*zip(*points), lw=2, label=name)
ax.set_xlabel("step")
ax.set_ylabel("test accuracy")
ax.set_title("digits MLP, 8 simulated devices", fontsize=11)
ax.legend(frameon=False)
fig.savefig(os.environ.get("GALLERY_FIGURE", "digits.png"), dpi=150, bbox_inches="tight")
