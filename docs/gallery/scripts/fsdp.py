"""FSDP: params sharded over the data axis stay sharded.

A two-layer MLP whose weights are split over the 8 ranks of "data" (as
MaxText and flax's gemma example shard them), trained in a ``jax.jit``
step. XLA's FSDP step gathers each weight and reduce-scatters its
gradient; ``sr.value_and_grad`` gathers the same way and skips part of the
reduce-scatter. Bytes are read from the compiled programs.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr


def loss_fn(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


tx = optax.adamw(3e-3)
variants = {
    "XLA FSDP": lambda i: jax.value_and_grad(loss_fn),
    "SkipReduce FSDP, k=4": lambda i: sr.value_and_grad(
        loss_fn, step=i, num_skip=4, min_size=0),
}
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 128)).astype(np.float32)
y = np.sin(x @ rng.normal(size=(128, 16)).astype(np.float32) / 4)
init = {"w1": rng.normal(size=(128, 512)).astype(np.float32) * 0.05,
        "w2": rng.normal(size=(512, 16)).astype(np.float32) * 0.05}
mesh = jax.make_mesh((8,), ("data",))
sent, curves = {}, {}
with jax.set_mesh(mesh):
    xs, ys = jax.device_put((x, y), P("data"))
    for name, grad_fn in variants.items():
        params = jax.device_put(init, P("data"))  # rows of each weight split: FSDP
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, x, y, i, grad_fn=grad_fn):
            loss, grads = grad_fn(i)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        text = step.lower(params, opt_state, xs, ys, 0).compile().as_text()
        sent[name] = sr.collective_traffic(text).bytes_per_device()
        curves[name] = []
        for i in range(100):
            params, opt_state, loss = step(params, opt_state, xs, ys, i)
            curves[name].append(float(loss))
        print(f"{name}: w1 is {jax.typeof(params['w1']).sharding.spec} "
              f"({params['w1'].addressable_shards[0].data.shape} a device), "
              f"{sent[name] / 1e3:.0f} kB sent a device a step, "
              f"loss {curves[name][-1]:.1e} after 100 steps")

fig, ax = plt.subplots(figsize=(5.2, 3.4))
for name, curve in curves.items():
    ax.plot(curve, lw=2, label=f"{name}: {sent[name] / 1e3:.0f} kB a step")
ax.set_yscale("log")
ax.set_xlabel("step")
ax.set_ylabel("training loss")
ax.set_title("MLP, weights sharded over 8 ranks", fontsize=11)
ax.legend(frameon=False, fontsize=9)
fig.savefig(os.environ.get("GALLERY_FIGURE", "fsdp.png"), dpi=150, bbox_inches="tight")
