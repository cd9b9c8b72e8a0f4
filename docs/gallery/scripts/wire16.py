"""A jit loop with a 16-bit wire: bytes read from the compiled programs.

One ``jax.jit`` training step three ways: XLA's own (``jax.value_and_grad``,
its all-reduce), ``sr.value_and_grad`` with Random SkipReduce (k = 4 of 8
ranks), and the same with ``comm_dtype=jnp.bfloat16``. Each device's
bytes sent come from the compiled program; then each trains 150 steps.
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


def loss_fn(params, x, y):  # written for the global batch
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


tx = optax.adam(3e-3)


def make_step(grad_fn):
    @jax.jit
    def step(params, opt_state, x, y, i):
        loss, grads = grad_fn(i)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


COLORS = {"XLA all-reduce": "#4C72B0", "Random, float32 wire": "#DD8452",
          "Random, bfloat16 wire": "#55A868"}
variants = {
    "XLA all-reduce": lambda i: jax.value_and_grad(loss_fn),
    "Random, float32 wire": lambda i: sr.value_and_grad(
        loss_fn, step=i, num_skip=4, min_size=0),
    "Random, bfloat16 wire": lambda i: sr.value_and_grad(
        loss_fn, step=i, num_skip=4, min_size=0, comm_dtype=jnp.bfloat16),
}
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 64)).astype(np.float32)
y = np.sin(x @ rng.normal(size=(64, 8)).astype(np.float32))  # harder than it looks
init = {"w1": rng.normal(size=(64, 256)).astype(np.float32) * 0.1,
        "w2": rng.normal(size=(256, 8)).astype(np.float32) * 0.1}
mesh = jax.make_mesh((8,), ("data",))
sent, curves = {}, {}
with jax.set_mesh(mesh):
    xs, ys = jax.device_put((x, y), P("data"))
    for name, grad_fn in variants.items():
        step = make_step(grad_fn)
        params, opt_state = init, tx.init(init)
        text = step.lower(params, opt_state, xs, ys, 0).compile().as_text()
        sent[name] = sr.collective_traffic(text).bytes_per_device()
        curves[name] = []
        for i in range(150):
            params, opt_state, loss = step(params, opt_state, xs, ys, i)
            curves[name].append(float(loss))
base = sent["XLA all-reduce"]
for name in variants:
    print(f"{name}: {sent[name] / base:.3f} of XLA's bytes, "
          f"loss {curves[name][-1]:.4f} after 150 steps")

fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.2))
left.barh(list(variants)[::-1], [sent[n] / base for n in variants][::-1],
          color=[COLORS[n] for n in variants][::-1])
left.set_xlabel("bytes sent per device / XLA's")
for name in variants:
    right.plot(curves[name], lw=1.8, label=name, color=COLORS[name],
               ls="--" if "bfloat16" in name else "-")
right.set_yscale("log")
right.set_xlabel("step")
right.set_ylabel("training loss")
right.legend(frameon=False, fontsize=8)
fig.tight_layout()
fig.savefig(os.environ.get("GALLERY_FIGURE", "wire16.png"), dpi=150, bbox_inches="tight")
