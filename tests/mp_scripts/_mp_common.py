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
import json
import os
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


def hsdp_tx(case: str, axis_name: str = "replica", **kwargs: Any) -> Any:
    """The optimizer of an HSDP (or FSDP) check, see :data:`HSDP_CASES`.

    ``kwargs`` go to ``skip_reduce`` too (FSDP: ``params_sharded=True``).
    """
    kwargs.update({"k0": dict(num_skip=0),
                   "random": dict(skip_ratio=0.5),
                   "ef": dict(skip_ratio=0.5, error_feedback=True, warmup_steps=1)}[case])
    return optax.chain(sr.skip_reduce(axis_name, seed=5, min_size=0, **kwargs),
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


# --------------------------------------------------------------------------
# FSDP: params sharded by rows over one data axis that spans every process.


def fsdp_mesh(devices: Any) -> Mesh:
    """The ``("data",)`` mesh over ``devices`` in order: process by process."""
    return Mesh(np.array(devices), ("data",))


def fsdp_host_params(seed: int = 0) -> dict[str, np.ndarray]:
    """HSDP's MLP and a scalar gain (no rows to split: replicated)."""
    return {**hsdp_host_params(seed), "gain": np.array(1.0, np.float32)}


def fsdp_loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """:func:`hsdp_loss` with the output layer scaled by the gain."""
    return hsdp_loss({**params, "w2": params["w2"] * params["gain"]}, batch)


# --------------------------------------------------------------------------
# The train / resume job of hsdp.py and fsdp.py.


def run_steps(step_fn: Any, params: Any, opt_state: Any, start: int, stop: int
              ) -> tuple[Any, Any, list[float]]:
    """Steps ``start..stop-1`` on :func:`hsdp_batch`, this process's rows only.

    Also checks that the step compiled once and kept the params' layouts.
    """
    me, processes = jax.process_index(), jax.process_count()
    like = jax.tree_util.tree_map(lambda x: x.sharding, params)
    losses = []
    for t in range(start, stop):
        x, y = hsdp_batch(t, processes)
        rows = slice(me * HSDP_ROWS, (me + 1) * HSDP_ROWS)
        params, opt_state, loss = step_fn(params, opt_state, (x[rows], y[rows]))
        losses.append(float(loss))
    assert step_fn._cache_size() == 1  # outputs (and restored state) fit the step
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves(like), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim), (path, got.sharding)
    return params, opt_state, losses


def assert_same_shards(got: Any, want: Any) -> None:
    """The same structure, layouts and bits, shard by shard on this process."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want),
                    strict=True):
        # The step spells P("fsdp", None) as P("fsdp"): the same layout.
        assert g.sharding.is_equivalent_to(w.sharding, g.ndim), (g.sharding, w.sharding)
        w_shards = {s.device: s for s in w.addressable_shards}
        for s in g.addressable_shards:
            assert s.index == w_shards[s.device].index
            np.testing.assert_array_equal(np.asarray(s.data),
                                          np.asarray(w_shards[s.device].data))


def sharded_job(directory: str, mode: str, mesh: Mesh, fresh: Callable[..., Any],
                check_residuals: Callable[[Any], None]) -> None:
    """``train`` or ``resume`` of a sharded check script (see ``hsdp.py``).

    Args:
      directory: where the job writes its files and checkpoints.
      mode: ``"train"`` or ``"resume"``.
      mesh: the job's mesh.
      fresh: ``(case, seed=0) -> (params, opt_state, step_fn)``, as a
        (re)started job builds them, for a case of :data:`HSDP_CASES`.
      check_residuals: asserts the layout of the ``ef`` state's residuals.
    """
    from jax.experimental import multihost_utils

    from skipreduce_jax import checkpoint

    me, t = jax.process_index(), HSDP_T
    ckpt = os.path.join(directory, "ckpt")

    def write(name, value):
        with open(os.path.join(directory, f"{name}_p{me}.json"), "w") as f:
            json.dump(value, f)

    if mode == "train":
        for case in ("k0", "random"):
            params, opt_state, step_fn = fresh(case)
            params, opt_state, losses = run_steps(step_fn, params, opt_state, 0, HSDP_STEPS)
            sr.assert_replicated(params, mesh)
            sr.assert_replicated(opt_state, mesh)
            # The params whole (gathered over processes where sharded over them).
            whole = multihost_utils.process_allgather(params, tiled=True)
            np.savez(os.path.join(directory, f"{case}_p{me}.npz"), losses=np.array(losses),
                     **whole)
            write(case, shard_digests(params))

        params, opt_state, step_fn = fresh("ef")
        check_residuals(opt_state)
        params, opt_state, _ = run_steps(step_fn, params, opt_state, 0, t)
        checkpoint.save(ckpt, t, params, opt_state)
        params, opt_state, _ = run_steps(step_fn, params, opt_state, t, 2 * t)
        sr.assert_replicated(params, mesh)
        check_residuals(opt_state)
        checkpoint.save(ckpt, 2 * t, params, opt_state)
        write("ef", shard_digests((params, opt_state)))
    elif mode == "resume":
        params, opt_state, step_fn = fresh("ef", seed=1)
        like = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state))
        step, params, opt_state = checkpoint.restore(
            ckpt, params_like=params, opt_state_like=opt_state, step=t)
        assert step == t and int(opt_state[0].count.addressable_data(0)) == t
        # Every array comes back with the layout of the one it was restored into.
        assert jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state)) == like
        check_residuals(opt_state)
        assert any(np.any(np.asarray(s.data) != 0)
                   for s in opt_state[0].residual["w1"].addressable_shards)
        params, opt_state, _ = run_steps(step_fn, params, opt_state, t, 2 * t)
        like_params, like_state, _ = fresh("ef", seed=2)
        _, want_params, want_state = checkpoint.restore(
            ckpt, params_like=like_params, opt_state_like=like_state, step=2 * t)
        assert_same_shards(params, want_params)
        assert_same_shards(opt_state, want_state)
        write("resume", shard_digests((params, opt_state)))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(f"RESULT mode={mode} process={me} devices={jax.device_count()} pid={os.getpid()}")


# --------------------------------------------------------------------------
# value_and_grad inside a plain jax.jit step, on the HSDP layout.

#: skip_reduce's options of the value_and_grad checks, by case.
VALUE_AND_GRAD_CASES = {"k0": dict(num_skip=0), "random": dict(skip_ratio=0.5)}


def value_and_grad_run(mesh: Mesh, case: str, batch: Callable[[int], Any]
                       ) -> tuple[Any, list[float]]:
    """:data:`HSDP_STEPS` steps of a user's ``jax.jit`` step with Adam.

    ``skipreduce_jax.value_and_grad`` stands where ``jax.value_and_grad``
    would, with :data:`VALUE_AND_GRAD_CASES` ``[case]``; ``batch(t)`` is the
    global batch of step t as arrays on ``mesh``. Returns the params and
    the losses.
    """
    adam = optax.adam(1e-2)
    specs = {k: NamedSharding(mesh, s) for k, s in HSDP_SPECS.items()}

    @jax.jit
    def step(params, opt_state, batch, t):
        loss, grads = sr.value_and_grad(
            hsdp_loss, mesh, "replica", step=t, seed=5, min_size=0, param_specs=specs,
            **VALUE_AND_GRAD_CASES[case])(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    with jax.set_mesh(mesh):
        params = hsdp_params(mesh)
        opt_state = jax.jit(adam.init)(params)
        losses = []
        for t in range(HSDP_STEPS):
            params, opt_state, loss = step(params, opt_state, batch(t), t)
            losses.append(float(loss))
    # As for jax.value_and_grad: one more compilation, for the outputs
    # spelling P("fsdp", None) as P("fsdp"); none after.
    assert step._cache_size() == 2
    return params, losses
