"""What the multi-process scripts and ``tests/test_multiprocess.py`` share.

The bit-pattern inputs, a small flax model, its deterministic data and the
optimizer, so that a launched job and an in-process reference run compute
the same thing, plus a digest of arrays that the test compares across
processes (and with the in-process reference).

Importing this module imports JAX but does not start its backend: a script
calls ``skipreduce_jax.initialize()`` first and may import this after.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import skipreduce_jax as sr

# The scripts run from tests/mp_scripts; the shared test helpers live above.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from helpers import popcount  # noqa: E402,F401  (used as common.popcount)

#: Elements per rank of the bit-pattern checks.
BIT_SIZE = 1000
#: Samples per device per training step.
ROWS_PER_DEVICE = 8
#: Training steps of the replica-identity check.
TRAIN_STEPS = 4
FEATURES = 16
CLASSES = 4


def bit_cases(n: int) -> list[tuple[int, bool]]:
    """(num_skip, randomize) of every bit-pattern case on an axis of size n."""
    return [(k, randomize) for randomize in (False, True) for k in range(n)]


def bit_key(k: int, randomize: bool) -> jax.Array:
    """The key of the bit-pattern check for ``num_skip=k``: a seed and a step."""
    return jax.random.fold_in(jax.random.key(1234), 2 * k + int(randomize))


def bit_values(n: int, size: int = BIT_SIZE) -> np.ndarray:
    """float32 [n, size]: rank r holds 2**r, so a sum's bits name its ranks."""
    return np.broadcast_to((2.0 ** np.arange(n))[:, None],
                           (n, size)).astype(np.float32)


def bit_sums(mesh: Mesh, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``skip_psum`` and ``contribution_mask`` of every case of :func:`bit_cases`.

    Args:
      mesh: a 1-D mesh with axis ``"data"`` of size n.
      x: float32 [n, size] sharded ``P("data")``.

    Returns:
      ``(sums, masks)``: [n, cases, size] float32 and bool, row r computed on
      the device at position r.
    """
    n = mesh.shape["data"]

    def body(v):
        sums, masks = [], []
        for k, randomize in bit_cases(n):
            kw = dict(key=bit_key(k, randomize), num_skip=k,
                      randomize=randomize)
            sums.append(sr.skip_psum(v[0], "data", **kw))
            masks.append(sr.contribution_mask(v[0], "data", **kw))
        return jnp.stack(sums)[None], jnp.stack(masks)[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"),
                                 out_specs=(P("data"), P("data"))))(x)


def hier_sums(mesh: Mesh, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Hierarchical ``skip_psum`` / ``contribution_mask`` of every case.

    Args:
      mesh: a ``("host", "local")`` mesh of H x L devices.
      x: float32 [H, L, size] sharded ``P("host", "local")``.

    Returns:
      ``(sums, masks)``: [H, L, cases, size], the cases of ``bit_cases(H)``.
    """
    axes = ("host", "local")

    def body(v):
        sums, masks = [], []
        for k, randomize in bit_cases(mesh.shape["host"]):
            kw = dict(key=bit_key(k, randomize), num_skip=k,
                      randomize=randomize, inner_axis="local")
            sums.append(sr.skip_psum(v[0, 0], "host", **kw))
            masks.append(sr.contribution_mask(v[0, 0], "host", **kw))
        return jnp.stack(sums)[None, None], jnp.stack(masks)[None, None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(*axes),
                                 out_specs=(P(*axes), P(*axes))))(x)


class MLP(nn.Module):
    """A two-layer perceptron for the training checks."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(CLASSES)(x)


MODEL = MLP()


@functools.cache
def init_params() -> Any:
    """The model's initial parameters (the same in every process), as numpy."""
    params = jax.jit(MODEL.init)(jax.random.key(0), jnp.zeros((1, FEATURES)))
    return jax.device_get(params)


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Softmax cross-entropy of one rank's part of the batch."""
    logits = MODEL.apply(params, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[1]).mean()


def global_batch(step: int, n_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of ``step``: rows ``[d * R:(d + 1) * R]`` go to device d."""
    rng = np.random.default_rng(1000 + step)
    rows = n_devices * ROWS_PER_DEVICE
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    y = np.argmax(x[:, :CLASSES], axis=1).astype(np.int32)  # learnable
    return x, y


def make_tx(*, num_skip: int | None = None, seed: int = 0,
            axis_name: str = "data", **kwargs: Any) -> Any:
    """Random SkipReduce (50% unless ``num_skip`` is given) chained with Adam."""
    if num_skip is None:
        kwargs.setdefault("skip_ratio", 0.5)
    else:
        kwargs["num_skip"] = num_skip
    return optax.chain(
        sr.skip_reduce(axis_name, seed=seed, min_size=0, **kwargs),
        optax.adam(1e-2))


def train(mesh: Mesh, axes: Any, tx: Any,
          batch_for_step: Callable[[int], Any]) -> tuple[Any, Any, list]:
    """A few steps of data-parallel training from :func:`init_params`.

    Args:
      mesh: the device mesh.
      axes: the data axis (or ``(outer, inner)``).
      tx: the optimizer, e.g. from :func:`make_tx`.
      batch_for_step: ``t -> the batch of step t`` placed by ``shard_batch``.

    Returns:
      ``(params, opt_state, losses)`` after :data:`TRAIN_STEPS` steps.
    """
    params = sr.replicate(init_params(), mesh)
    # Every local copy of the freshly replicated params can be read back.
    jax.tree_util.tree_map(np.testing.assert_array_equal, local_copy(params),
                           jax.tree_util.tree_map(np.asarray, init_params()))
    opt_state = sr.init_opt_state(tx, params, mesh, axes)
    step = sr.make_train_step(loss_fn, tx, mesh, axes)
    losses = []
    for t in range(TRAIN_STEPS):
        params, opt_state, loss = step(params, opt_state, batch_for_step(t))
        losses.append(float(loss))
    return params, opt_state, losses


def local_copy(tree: Any) -> Any:
    """This process's first copy of each leaf of a replicated tree, as numpy.

    Also checks that every local copy is bit-identical to the first.
    """
    def first(leaf):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])
        return shards[0]

    return jax.tree_util.tree_map(first, tree)


def digest(tree: Any) -> str:
    """A short sha256 of the bytes, dtypes and shapes of a tree of arrays."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaf = np.ascontiguousarray(leaf)
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape};".encode())
        h.update(leaf.tobytes())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------
# HSDP: replicas across processes, params sharded over the devices of each.

#: How each param of the HSDP model is sharded over the ``fsdp`` axis.
HSDP_SPECS = {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
HSDP_IN, HSDP_HIDDEN, HSDP_OUT = 16, 64, 4
#: Samples per replica (per process) per step.
HSDP_ROWS = 8


def hsdp_mesh(devices: Any, replicas: int) -> Mesh:
    """The ``("replica", "fsdp")`` mesh: one row of ``devices`` per replica."""
    return Mesh(np.array(devices).reshape(replicas, -1), ("replica", "fsdp"))


def hsdp_host_params(seed: int = 0) -> dict[str, np.ndarray]:
    """The HSDP model's params as float32 numpy, the same in every process."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(HSDP_IN, HSDP_HIDDEN)) * 0.3).astype(np.float32),
        "b1": (rng.normal(size=HSDP_HIDDEN) * 0.1).astype(np.float32),
        "w2": (rng.normal(size=(HSDP_HIDDEN, HSDP_OUT)) * 0.2).astype(np.float32),
    }


def hsdp_params(mesh: Mesh, seed: int = 0) -> dict[str, jax.Array]:
    """:func:`hsdp_host_params` as global arrays sharded by :data:`HSDP_SPECS`."""
    return {k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, HSDP_SPECS[k]),
                                            lambda index, v=v: v[index])
            for k, v in hsdp_host_params(seed).items()}


def hsdp_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error of the MLP (plain GSPMD code)."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def hsdp_batch(step: int, replicas: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of ``step``: rows ``[r * R:(r + 1) * R]`` go to replica r."""
    rng = np.random.default_rng(2000 + step)
    x = rng.normal(size=(replicas * HSDP_ROWS, HSDP_IN)).astype(np.float32)
    y = np.sin(x[:, :HSDP_OUT] + x[:, HSDP_OUT:2 * HSDP_OUT]).astype(np.float32)
    return x, y


#: The HSDP checks: k=0 against GSPMD, Random SkipReduce, and Random with
#: error feedback and a warmup (the checkpointed run).
HSDP_CASES = ("k0", "random", "ef")
#: Steps of the k=0 and Random checks; the ef run saves after T and 2T.
HSDP_STEPS, HSDP_T = 10, 3


def hsdp_tx(case: str) -> Any:
    """The optimizer of an HSDP check, see :data:`HSDP_CASES`."""
    kwargs = {"k0": dict(num_skip=0),
              "random": dict(skip_ratio=0.5),
              "ef": dict(skip_ratio=0.5, error_feedback=True, warmup_steps=1)}[case]
    return optax.chain(sr.skip_reduce("replica", seed=5, min_size=0, **kwargs),
                       optax.adam(1e-2))


def shard_digests(tree: Any) -> dict[str, str]:
    """``path@index`` -> digest of the shard at that index, this process's copies.

    One entry per distinct shard index this process holds (with replicas
    across processes: each fsdp shard of each leaf); also checks that every
    local copy of a shard is bit-identical.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        seen: dict[str, np.ndarray] = {}
        for s in leaf.addressable_shards:
            where = ",".join(f"{i.start or 0}:{i.stop if i.stop is not None else n}"
                             for i, n in zip(s.index, leaf.shape, strict=True))
            data = np.asarray(s.data)
            if where in seen:
                np.testing.assert_array_equal(data, seen[where])
            seen[where] = data
            out[f"{jax.tree_util.keystr(path)}@{where}"] = digest(data)
    return out


def assembled(tree: Any) -> Any:
    """Each leaf put together, as numpy, from this process's shards.

    This process must hold every part of each leaf (with replicas across
    processes, its devices hold all fsdp shards).
    """
    def whole(leaf):
        out = np.full(leaf.shape, np.nan, leaf.dtype)
        for s in leaf.addressable_shards:
            out[s.index] = np.asarray(s.data)
        assert not np.isnan(out).any(), "a part of the leaf is on no local device"
        return out

    return jax.tree_util.tree_map(whole, tree)
