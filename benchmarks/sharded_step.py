r"""One sharded training step's wall time: XLA's own step against SkipReduce.

Two layouts of a communication-heavy MLP (``--d-in``-``--hidden``-``--d-out``,
GELU, about 4.2 M float32 params by default, a small batch, SGD with
momentum), each with four variants timed side by side:

* ``--layout hsdp``: a mesh ``(replica, fsdp)`` with ``replica`` = hosts and
  ``fsdp`` = the devices of one host (``jax.devices()`` grouped by process),
  params sharded over ``fsdp`` (``w1`` ``P(None, "fsdp")``, ``b1``
  ``P("fsdp")``, ``w2`` ``P("fsdp", None)``), the batch split over
  ``replica``. ``xla`` is plain ``jax.jit`` of the step on those
  NamedShardings (GSPMD: it all-reduces each device's gradient shard over
  ``replica``); ``skipreduce k=0`` and ``random`` are
  :func:`skipreduce_jax.make_train_step` over ``"replica"`` with
  ``skip_reduce("replica", num_skip=0)`` (the all-reduce) and with
  ``skip_ratio=--skip-ratio`` (Random SkipReduce).
* ``--layout fsdp``: a 1-D mesh ``("data",)`` over every device (one per
  host), params ``P("data")`` (:func:`skipreduce_jax.shard_params`).
  ``xla`` is plain ``jax.jit`` with params sharded ``P("data")``, gathered
  for the loss by a sharding constraint (GSPMD: an all-gather of the params,
  a reduce-scatter of the gradients); ``skipreduce k=0`` and ``random`` are
  ``make_train_step`` with ``skip_reduce("data", ..., params_sharded=True)``
  (the all-gather, then ``skip_psum_scatter``).

Two more variants measure how much of XLA's step is cross-host
communication. ``no cross-host`` is XLA's step without it: every replica
trains on the same rows (a batch of one replica's size, replicated), so its
gradients need no reduction, with the same arithmetic per device (``fsdp``:
params replicated too, so nothing is gathered); ``1 - no cross-host / xla``
counts everything the communication adds (XLA:CPU runs collectives and
arithmetic one after the other, so nothing is hidden). ``collectives
alone`` runs XLA's cross-host collectives of the step on buffers of the same
shapes and layouts, and nothing else (:func:`_collectives_alone`);
``collectives alone / xla`` counts the transfers alone. The two differ by
what XLA's step does around its collectives (for HSDP on the emulated
cluster, likely the gradients it computes transposed and transposes back
after the all-reduce: ``benchmarks/README.md``).

Every variant is compiled and called ``--warmup`` times, then ``--rounds``
rounds are timed; within a round every variant runs once, in an order
shuffled per round (the same on every process), so that noise from other
jobs on the machine hits all alike. A call is timed from a barrier (a tiny
psum over every device) to ``block_until_ready``, and a call's time is the
largest over the processes. Each variant carries its own params and
optimizer state from call to call (donated, as in training).

The bytes each device sends per step are read from each compiled program
(:func:`skipreduce_jax.collective_traffic`), and split by whether an op's
groups span more than one host (:func:`cross_host_bytes`). The targets
checked: ``skipreduce k=0`` at most ``--k0-target`` (1.05) times XLA's step;
``random`` at most its cross-host bytes ratio to XLA's + ``--slack`` (0.05)
times XLA's step, which applies when XLA's step is at least
``--min-comm`` (80%) cross-host communication by both measures. After the rounds the params
of ``xla`` and ``skipreduce k=0`` (the same steps from the same start) are
compared.

Two modes:

* In one process (smoke tests): ``--devices`` simulated CPU devices, a
  "host" being ``--per-host`` consecutive devices (hsdp) or one device
  (fsdp); the "network" is a memory copy::

      python benchmarks/sharded_step.py --layout hsdp --devices 8 --hidden 256

* One process per host (``python -m skipreduce_jax.launch -n 2 -d 2`` or
  ``benchmarks/cluster.py --local-devices 2 --script
  benchmarks/sharded_step.py``): each process calls
  :func:`skipreduce_jax.initialize`, a host is a process, and only process 0
  prints and writes.

Process 0 prints a markdown table and writes ``sharded_step_<tag>.json`` and
``sharded_step_<tag>.png`` to ``--out`` (``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# Make ``import skipreduce_jax`` and ``benchmarks`` work from a checkout.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import skipreduce_jax as sr  # noqa: E402
from benchmarks.collectives import Harness, fmt_load, source_version  # noqa: E402
from skipreduce_jax import distributed  # noqa: E402

DEFAULT_OUT = _REPO_ROOT / "benchmarks" / "results"
LAYOUTS = ("hsdp", "fsdp")
XLA, LOCAL, ALONE = "xla", "no cross-host", "collectives alone"
K0, RANDOM = "skipreduce k=0", "random"
VARIANTS = (XLA, LOCAL, ALONE, K0, RANDOM)
_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)"
    r"(-start)?\(")


# ----------------------------------------------------------------------------
# Arguments.
# ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        description="Time one sharded training step: XLA's own (GSPMD) step against "
                    "SkipReduce k=0 and Random SkipReduce (hsdp or fsdp layout).")
    p.add_argument("--layout", choices=LAYOUTS, default="hsdp",
                   help="hsdp: mesh (replica=hosts, fsdp=devices per host); fsdp: "
                        "params P('data') over one device per host (default hsdp)")
    p.add_argument("--devices", type=int, default=None,
                   help="simulated CPU devices in one process (default 8 for hsdp, 4 for "
                        "fsdp; ignored in multi-process mode)")
    p.add_argument("--per-host", type=int, default=2,
                   help="hsdp in one process: devices per simulated host (the fsdp axis; "
                        "default 2). Multi-process: each process's devices")
    p.add_argument("--d-in", type=int, default=512, help="MLP input width (default 512)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden width (default 4096)")
    p.add_argument("--d-out", type=int, default=512, help="output width (default 512)")
    p.add_argument("--batch", type=int, default=2,
                   help="rows per replica (per data rank) per step (default 2: little "
                        "arithmetic per gradient byte)")
    p.add_argument("--skip-ratio", type=float, default=0.5,
                   help="Random SkipReduce's skip_ratio (default 0.5)")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default 1e-3)")
    p.add_argument("--rounds", type=int, default=9, help="timed rounds (default 9)")
    p.add_argument("--warmup", type=int, default=2,
                   help="calls of each variant before timing (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k0-target", type=float, default=1.05,
                   help="target for skipreduce k=0 / xla (default 1.05)")
    p.add_argument("--slack", type=float, default=0.05,
                   help="random's target: cross-host bytes ratio + this (default 0.05)")
    p.add_argument("--min-comm", type=float, default=0.8,
                   help="random's target applies when this share of XLA's step is "
                        "cross-host communication (default 0.8)")
    p.add_argument("--label", default="",
                   help="describes the network in the title and JSON, e.g. '500 Mbit/s'")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="output folder (default benchmarks/results/)")
    p.add_argument("--tag", default=None,
                   help="result name suffix (default <layout>_p<processes>x<devices>)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and checks the arguments (``SystemExit`` naming a bad one)."""
    args = build_parser().parse_args(argv)
    for name in ("d_in", "hidden", "d_out", "batch", "rounds", "per_host"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        raise SystemExit(f"--warmup={args.warmup}: must be >= 0")
    if not 0.0 < args.skip_ratio <= 1.0:
        raise SystemExit(f"--skip-ratio={args.skip_ratio}: must be in (0, 1]")
    if args.devices is None:
        args.devices = 8 if args.layout == "hsdp" else 4
    if args.devices < 2:
        raise SystemExit(f"--devices={args.devices}: must be >= 2")
    return args


# ----------------------------------------------------------------------------
# The mesh and the model.
# ----------------------------------------------------------------------------


def start_runtime(args: argparse.Namespace) -> bool:
    """Joins the multi-process job, or asks for simulated devices; multi-process?"""
    multiprocess = distributed.launcher_env_present() or bool(
        os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if not multiprocess and _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", args.devices)
    sr.initialize()
    return jax.process_count() > 1


def build_mesh(layout: str, per_host: int) -> tuple[Mesh, list[int]]:
    """The mesh (Auto axes) and the host of each of its devices, in mesh order.

    In a multi-process job a host is a process and ``jax.devices()`` is
    grouped by process; in one process a host is ``per_host`` consecutive
    devices (hsdp) or one device (fsdp).

    Raises:
      SystemExit: if the devices do not fill the layout.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(devices)
    processes = jax.process_count()
    if layout == "fsdp":
        grid, names = np.array(devices), ("data",)
        hosts = [d.process_index if processes > 1 else i for i, d in enumerate(devices)]
    else:
        width = jax.local_device_count() if processes > 1 else per_host
        if n % width or n // width < 2 or width < 2:
            raise SystemExit(f"hsdp: {n} devices do not make >= 2 hosts of {width} >= 2 "
                             "devices (--devices, --per-host or --local-devices)")
        grid, names = np.array(devices).reshape(n // width, width), ("replica", "fsdp")
        hosts = [d.process_index if processes > 1 else i // width
                 for i, d in enumerate(devices)]
    mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    return mesh, hosts


def param_specs(layout: str) -> dict[str, P]:
    """The params' layout: over ``fsdp`` (hsdp) or by rows over ``data`` (fsdp)."""
    if layout == "hsdp":
        return {"w1": P(None, "fsdp"), "b1": P("fsdp"), "w2": P("fsdp", None)}
    return {"w1": P("data"), "b1": P("data"), "w2": P("data")}


def host_params(args: argparse.Namespace) -> dict[str, np.ndarray]:
    """The initial params (the same on every process)."""
    rng = np.random.default_rng([args.seed, 1])
    return {
        "w1": (rng.standard_normal((args.d_in, args.hidden)) / math.sqrt(args.d_in)
               ).astype(np.float32),
        "b1": np.zeros(args.hidden, np.float32),
        "w2": (rng.standard_normal((args.hidden, args.d_out)) / math.sqrt(args.hidden)
               ).astype(np.float32),
    }


def host_batch(args: argparse.Namespace, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` inputs and regression targets (the same on every process)."""
    rng = np.random.default_rng([args.seed, 2])
    x = rng.standard_normal((rows, args.d_in)).astype(np.float32)
    w = rng.standard_normal((args.d_in, args.d_out)) / math.sqrt(args.d_in)
    return x, np.tanh(x @ w).astype(np.float32)


def loss_fn(params: dict[str, jax.Array], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Mean squared error of the MLP."""
    x, y = batch
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def place(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """Host arrays as global arrays with ``specs`` (every process passes all)."""
    return jax.tree_util.tree_map(
        lambda x, spec: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, spec), lambda index: x[index]), tree, specs)


# ----------------------------------------------------------------------------
# The variants.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    """One compiled program with its own carried inputs.

    Attributes:
      name: the label.
      step: the jitted function; after :func:`make_variants`, its compiled
        executable (called directly, so that the timed calls compile nothing).
      args: its arguments: ``(params, opt_state, batch)`` for a training step.
      carried: how many leading outputs replace the leading arguments after
        each call (2 for a step: params and optimizer state, donated).
      text: the compiled program's text.
    """

    name: str
    step: Callable[..., Any]
    args: tuple[Any, ...]
    carried: int = 2
    text: str = ""

    def __call__(self) -> Any:
        out = self.step(*self.args)
        if self.carried:
            self.args = tuple(out[:self.carried]) + self.args[self.carried:]
        return out


def _xla_step(tx: optax.GradientTransformation, mesh: Mesh,
              gather: dict[str, P] | None) -> Callable[..., Any]:
    """Plain ``jax.jit`` of the step; ``gather``: constrain params to it for the loss."""
    def step(params, state, batch):
        def loss(p):
            if gather is not None:  # FSDP: whole params in the loss, blocks updated
                p = {k: lax.with_sharding_constraint(v, NamedSharding(mesh, gather[k]))
                     for k, v in p.items()}
            return loss_fn(p, batch)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return jax.jit(step, donate_argnums=(0, 1))


def _init_like_params(opt: optax.GradientTransformation, params: dict[str, jax.Array],
                      mesh: Mesh) -> Any:
    """``opt.init(params)`` with each param's state sharded like the param.

    (Left to ``jit``, a multi-process job replicates it, and the step's
    outputs then come back in another layout than the compiled step takes.)
    """
    def sharding(path, _):
        key = getattr(path[-1], "key", None) if path else None
        return params[key].sharding if key in params else NamedSharding(mesh, P())

    shardings = jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(opt.init, params))
    return jax.jit(opt.init, out_shardings=shardings)(params)


def _collectives_alone(layout: str, mesh: Mesh, params: dict[str, jax.Array]
                       ) -> Callable[..., Any]:
    """XLA's cross-host collectives of the step alone, on buffers like the params.

    hsdp: the all-reduce of each device's gradient shard over ``replica``.
    fsdp: the all-gather of the param blocks and the all-reduce of the whole
    gradients (XLA:CPU reduces FSDP gradients so, then slices; it has no
    reduce-scatter pass). ``check_vma=False``: every psum moves data.
    """
    specs = {k: v.sharding.spec for k, v in params.items()}
    if layout == "hsdp":
        def alone(blocks):
            return jax.tree_util.tree_map(lambda b: lax.psum(b, "replica"), blocks)

        return jax.jit(jax.shard_map(alone, mesh=mesh, in_specs=(specs,), out_specs=specs,
                                     check_vma=False))
    whole = {k: P() for k in specs}

    def gather_and_reduce(blocks, grads):
        gathered = {k: lax.all_gather(b, "data", tiled=True) for k, b in blocks.items()}
        return gathered, {k: lax.psum(g, "data") for k, g in grads.items()}

    return jax.jit(jax.shard_map(gather_and_reduce, mesh=mesh, in_specs=(specs, whole),
                                 out_specs=(whole, whole), check_vma=False))


def make_variants(args: argparse.Namespace, mesh: Mesh) -> list[Variant]:
    """The variants of ``args.layout`` (:data:`VARIANTS`), compiled, from the same start."""
    layout = args.layout
    axis = "replica" if layout == "hsdp" else "data"
    ranks = mesh.shape[axis]
    specs = param_specs(layout)
    params0 = host_params(args)
    x, y = host_batch(args, ranks * args.batch)
    batch = place((x, y), mesh, (P(axis), P(axis)))
    # One replica's rows on every replica: no gradient reduction needed.
    local_batch = place((x[:args.batch], y[:args.batch]), mesh, (P(), P()))
    opt = optax.sgd(args.lr, momentum=0.9)
    sharded = layout == "fsdp"
    whole = {k: P() for k in specs}

    def initial(host):
        if sharded:  # FSDP's layout as the library spells it
            return sr.shard_params(host, mesh, axis)
        return place(host, mesh, specs)

    variants = []
    with jax.set_mesh(mesh):
        for name in VARIANTS:
            if name == ALONE:
                params = initial(params0)
                buffers = (params,) if not sharded else (params, place(params0, mesh, whole))
                variants.append(Variant(name, _collectives_alone(layout, mesh, params),
                                        buffers, carried=0))
            elif name in (XLA, LOCAL):
                local = name == LOCAL
                params = (place(params0, mesh, whole) if local and sharded
                          else initial(params0))
                state = _init_like_params(opt, params, mesh)
                step = _xla_step(opt, mesh, whole if sharded and not local else None)
                variants.append(Variant(name, step, (params, state,
                                                     local_batch if local else batch)))
            else:
                reduce = (dict(num_skip=0) if name == K0
                          else dict(skip_ratio=args.skip_ratio))
                tx = optax.chain(sr.skip_reduce(axis, min_size=0, params_sharded=sharded,
                                                **reduce), opt)
                params = initial(params0)
                state = sr.init_opt_state(tx, params, mesh, axis)
                step = sr.make_train_step(loss_fn, tx, mesh, axis)
                variants.append(Variant(name, step, (params, state, batch)))
        for v in variants:
            v.step = v.step.lower(*v.args).compile()
            v.text = v.step.as_text()
    return variants


# ----------------------------------------------------------------------------
# Bytes: every collective, and the part that crosses hosts.
# ----------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


# An iota device list: [dims] with an optional transpose T(perm).
_IOTA_IDS = r"\[([\d,]+)\](?:T\(([\d,]+)\))?"


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """The device ids of ``[dims]T(perm)``, flat."""
    shape = _ints(dims)
    order = _ints(perm) if perm else list(range(len(shape)))
    return np.arange(math.prod(shape)).reshape(shape).transpose(order).reshape(-1)


def collective_groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of one compiled collective instruction.

    A collective-permute's groups are its source-target pairs. Replica groups
    are read in the three forms XLA prints: explicit lists (``{{0,2},{1,3}}``;
    ``{}`` is every device), iota lists (``[2,4]<=[4,2]T(1,0)``) and mesh axes
    (``mesh['a'=4,'b'=2] {'a'}``). Device ids are positions in the program's
    device assignment (the mesh's devices in order).

    Raises:
      ValueError: for a form not understood here (quoting the instruction).
    """
    def refuse(why: str) -> ValueError:
        return ValueError(f"collective_groups: {why}: {line.strip()[:300]}")

    if "use_global_device_ids=true" not in line and "collective-permute" not in line:
        raise refuse("replica ids, not global device ids")
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if pairs:
        return [_ints(g) for g in re.findall(r"\{([\d,]+)\}", pairs.group(1))]
    text = line.split("replica_groups=", 1)[1] if "replica_groups=" in line else ""
    if text.startswith("{}"):
        return [list(range(devices))]
    explicit = re.match(r"\{((?:\{[\d,]*\},?)+)\}", text)
    if explicit:
        return [_ints(g) for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    iota = re.match(rf"\[([\d,]+)\]<={_IOTA_IDS}", text)
    if iota:
        return _iota(iota.group(2), iota.group(3)).reshape(_ints(iota.group(1))[0], -1).tolist()
    mesh = re.match(rf"mesh\[([^\]]*)\](?:,\s*device_ids=\((?:{_IOTA_IDS}|([\d,]+))\))?"
                    r"\s*\{([^{}]*)\}", text)
    if mesh:
        axes = [(a.strip().strip("'\""), int(s)) for a, s in
                (item.rsplit("=", 1) for item in mesh.group(1).split(","))]
        names = [a.strip().strip("'\"") for a in mesh.group(5).split(",") if a.strip()]
        if any(":" in a for a in names) or any(a not in dict(axes) for a in names):
            raise refuse("sub-axes or unknown axes")
        count = math.prod(s for _, s in axes)
        ids = (_iota(mesh.group(2), mesh.group(3)) if mesh.group(2)
               else np.array(_ints(mesh.group(4))) if mesh.group(4) else np.arange(count))
        order = [i for i, (a, _) in enumerate(axes) if a not in names] + [
            [a for a, _ in axes].index(a) for a in names]
        size = math.prod(dict(axes)[a] for a in names)
        grid = ids.reshape([s for _, s in axes]).transpose(order)
        return grid.reshape(-1, size).tolist()
    raise refuse("replica groups in a form not understood")


def _shape(result: str) -> tuple[int, ...]:
    first = re.search(r"[a-z]+\d*\[([\d,]*)\]", result)
    return tuple(_ints(first.group(1))) if first else ()


def cross_host_bytes(text: str, hosts: Sequence[int]) -> dict[str, float]:
    """Bytes per device per step of a compiled program: all, cross-host, intra-host.

    The bytes of each op are :func:`skipreduce_jax.collective_traffic`'s. An op
    crosses hosts when one of its groups (:func:`collective_groups`) holds
    devices of different hosts. Ops are matched to instructions by kind,
    group size and result shape; if instructions that match one op disagree
    on crossing, it is refused rather than guessed.

    Args:
      text: ``.compile().as_text()`` of the step.
      hosts: the host of each device, in the program's device order.

    Returns:
      ``{"total": ..., "cross_host": ..., "intra_host": ...}``.

    Raises:
      ValueError: for an op whose crossing is ambiguous or an async op.
    """
    crossing: dict[tuple, set[bool]] = {}
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match is None:
            continue
        result, kind, start = match.groups()
        if start:
            raise ValueError(f"cross_host_bytes: async collectives are not matched: "
                             f"{line.strip()[:200]}")
        groups = collective_groups(line, len(hosts))
        size = 2 if kind == "collective-permute" else len(groups[0])
        crosses = any(len({hosts[d] for d in g}) > 1 for g in groups)
        crossing.setdefault((kind, size, _shape(result)), set()).add(crosses)
    out = {"total": 0.0, "cross_host": 0.0, "intra_host": 0.0}
    for op in sr.collective_traffic(text).ops:
        flags = crossing.get((op.kind, op.group_size, tuple(op.shape)))
        if not flags or len(flags) > 1:
            raise ValueError(f"cross_host_bytes: cannot tell whether {op} crosses hosts")
        out["total"] += op.bytes_per_device
        out["cross_host" if next(iter(flags)) else "intra_host"] += op.bytes_per_device
    return out


# ----------------------------------------------------------------------------
# Timing and the summary.
# ----------------------------------------------------------------------------


def nic_counter() -> Callable[[], int] | None:
    """Bytes this host's NIC has sent so far, if gloo's interface is its own.

    On the emulated cluster every host has its own ``veth0``
    (``SKIPREDUCE_GLOO_INTERFACE``); on the loopback interface all processes
    share one counter, so none is read there.
    """
    interface = os.environ.get(distributed.ENV_GLOO_INTERFACE)
    path = Path(f"/sys/class/net/{interface}/statistics/tx_bytes")
    if not interface or interface == "lo" or not path.is_file():
        return None
    return lambda: int(path.read_text())


def time_rounds(h: Harness, variants: Sequence[Variant], rounds: int, warmup: int,
                seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Seconds per call and NIC bytes per call on every process.

    Returns:
      ``[processes, rounds, variants]`` seconds, and the bytes this host's
      NIC sent per call (:func:`nic_counter`; None without one), counted
      from the barrier before the call to the barrier after it: a collective
      completes only once its peers have what it sent, so by then every byte
      of the call has left (the barrier's own few bytes are included).
    """
    for v in variants:
        for _ in range(warmup):
            jax.block_until_ready(v())
    counter = nic_counter()
    times = np.zeros((rounds, len(variants)))
    sent = np.zeros((rounds, len(variants)))
    order = np.random.default_rng([seed, 3])  # the same order on every process
    calls = [(r, i) for r in range(rounds) for i in order.permutation(len(variants))]
    h.barrier()
    before = counter() if counter else 0
    for r, i in calls:
        start = time.perf_counter()
        jax.block_until_ready(variants[i]())
        times[r, i] = time.perf_counter() - start
        h.barrier()
        if counter:
            after = counter()
            sent[r, i], before = after - before, after
    return h.gather_times(times), (h.gather_times(sent) if counter else None)


def summarize(names: Sequence[str], times: np.ndarray, traffic: Sequence[dict[str, float]],
              k0_target: float = 1.05, slack: float = 0.05,
              min_comm: float = 0.8) -> dict[str, Any]:
    """Per-variant statistics, ratios to ``xla`` and the targets.

    Args:
      names: the variants (:data:`VARIANTS`), in the columns' order.
      times: seconds, ``[rounds, variants]``.
      traffic: :func:`cross_host_bytes` of each variant.
      k0_target: the largest ``skipreduce k=0 / xla`` that meets its target.
      slack: ``random``'s target is its cross-host bytes ratio + this.
      min_comm: ``random``'s target applies when at least this share of
        XLA's step is cross-host communication, measured both ways:
        ``comm_fraction`` (1 - ``no cross-host`` / ``xla``) and
        ``collectives_fraction`` (``collectives alone`` / ``xla``).

    Returns:
      ``{"rows": [...], "comm_fraction": ..., "collectives_fraction": ...,
      "random_vs_k0": {...}, "targets": {...}}``; each row has the median,
      IQR, the ratio of medians to ``xla``, the median of per-round ratios
      (``paired_ratio``: a round's variants share its noise) and the bytes,
      also as ratios to ``xla``'s.
    """
    times = np.asarray(times, float)
    col = {name: i for i, name in enumerate(names)}
    med = np.median(times, axis=0)
    base = col[XLA]
    rows = []
    for i, name in enumerate(names):
        q25, q75 = np.percentile(times[:, i], [25, 75])
        t = traffic[i]
        rows.append({
            "name": name, "seconds": float(med[i]), "q25": float(q25), "q75": float(q75),
            "iqr": float(q75 - q25), "times": times[:, i].tolist(),
            "ratio": float(med[i] / med[base]),
            "paired_ratio": float(np.median(times[:, i] / times[:, base])),
            "bytes": t["total"], "cross_host_bytes": t["cross_host"],
            "intra_host_bytes": t["intra_host"],
            "bytes_ratio": _ratio(t["total"], traffic[base]["total"]),
            "cross_host_bytes_ratio": _ratio(t["cross_host"], traffic[base]["cross_host"]),
        })
    comm = 1.0 - rows[col[LOCAL]]["seconds"] / rows[base]["seconds"]
    alone = rows[col[ALONE]]["ratio"]
    k0, rnd = rows[col[K0]], rows[col[RANDOM]]
    vs_k0 = {"ratio": rnd["seconds"] / k0["seconds"],
             "paired_ratio": float(np.median(times[:, col[RANDOM]] / times[:, col[K0]])),
             "cross_host_bytes_ratio": _ratio(rnd["cross_host_bytes"],
                                              k0["cross_host_bytes"])}
    random_target = (rnd["cross_host_bytes_ratio"] + slack
                     if rnd["cross_host_bytes_ratio"] is not None else None)
    targets = {
        "k0": {"target": k0_target, "ratio": k0["ratio"],
               "met": bool(k0["ratio"] <= k0_target)},
        "random": {"target": random_target, "ratio": rnd["ratio"],
                   "applies": bool(min(comm, alone) >= min_comm), "min_comm": min_comm,
                   "met": (bool(rnd["ratio"] <= random_target)
                           if random_target is not None else None)},
    }
    return {"rows": rows, "comm_fraction": float(comm), "collectives_fraction": alone,
            "random_vs_k0": vs_k0, "targets": targets}


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(summary: dict[str, Any]) -> str:
    """The markdown table of :func:`summarize`, with the targets below."""
    lines = ["| variant | step ms (median) | IQR ms | / xla | paired / xla | "
             "MB sent / device | cross-host MB | cross-host / xla |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary["rows"]:
        lines.append(
            f"| {r['name']} | {1e3 * r['seconds']:.1f} | {1e3 * r['iqr']:.1f} | "
            f"{r['ratio']:.3f} | {r['paired_ratio']:.3f} | {r['bytes'] / 1e6:.2f} | "
            f"{r['cross_host_bytes'] / 1e6:.2f} | {_fmt(r['cross_host_bytes_ratio'])} |")
    t = summary["targets"]
    k0, rnd = t["k0"], t["random"]
    lines.append("")
    lines.append(f"cross-host communication: {summary['comm_fraction']:.1%} of XLA's step "
                 f"(1 - {LOCAL} / xla), {summary['collectives_fraction']:.1%} "
                 f"({ALONE} / xla)")
    vs = summary["random_vs_k0"]
    lines.append(f"random / skipreduce k=0: step {vs['ratio']:.3f} (paired "
                 f"{vs['paired_ratio']:.3f}), cross-host bytes "
                 f"{_fmt(vs['cross_host_bytes_ratio'])}")
    lines.append(f"target skipreduce k=0 <= {k0['target']:.2f} x xla: {k0['ratio']:.3f} "
                 f"-> {'met' if k0['met'] else 'NOT met'}")
    verdict = ("met" if rnd["met"] else "NOT met") if rnd["met"] is not None else "n/a"
    if not rnd["applies"]:
        verdict += (f" (does not apply: XLA's step is under {rnd['min_comm']:.0%} "
                    "communication by one of the two measures)")
    lines.append(f"target random <= cross-host bytes ratio + slack = "
                 f"{_fmt(rnd['target'])} x xla: {rnd['ratio']:.3f} -> {verdict}")
    return "\n".join(lines)


def max_deviation(a: Any, b: Any) -> float:
    """The largest |a - b| over the largest |b|, on this process's shards of two trees."""
    worst, scale = 0.0, 0.0
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        ys = {s.device.id: np.asarray(s.data) for s in y.addressable_shards}
        for s in x.addressable_shards:
            ref = ys[s.device.id]
            worst = max(worst, float(np.max(np.abs(np.asarray(s.data) - ref))))
            scale = max(scale, float(np.max(np.abs(ref))))
    return worst / (scale or 1.0)


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    """Step time per variant (median, IQR) and time and bytes ratios to XLA's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    names = [r["name"].replace(" ", "\n", 1) for r in rows]
    pos = np.arange(len(rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    med = np.array([r["seconds"] for r in rows]) * 1e3
    err = np.array([[r["seconds"] - r["q25"], r["q75"] - r["seconds"]] for r in rows]).T * 1e3
    left.bar(pos, med, yerr=err, capsize=4, color="tab:blue")
    left.set_xticks(pos, names, fontsize=8)
    left.set_ylabel("ms per step (median, IQR)")
    left.grid(axis="y", alpha=0.3)
    ratios = [r["ratio"] for r in rows]
    bytes_ratios = [r["cross_host_bytes_ratio"] or 0.0 for r in rows]
    right.bar(pos - 0.2, ratios, 0.4, label="step time / xla")
    right.bar(pos + 0.2, bytes_ratios, 0.4, label="cross-host bytes / xla")
    right.axhline(1.0, color="k", lw=0.8, ls=":")
    right.set_xticks(pos, names, fontsize=8)
    right.legend(fontsize=8)
    right.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------
# Main.
# ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    multiprocess = start_runtime(args)
    h = Harness(args.seed)
    leader = h.process == 0

    def log(message: str) -> None:
        if leader:
            print(message, flush=True)

    mesh, hosts = build_mesh(args.layout, args.per_host)
    num_params = args.d_in * args.hidden + args.hidden + args.hidden * args.d_out
    setup = (f"{h.processes} processes x {jax.local_device_count()} devices" if multiprocess
             else f"{h.n} simulated CPU devices in one process")
    log(f"{args.layout}: mesh {dict(mesh.shape)} ({setup}, {len(set(hosts))} hosts); MLP "
        f"{args.d_in}-{args.hidden}-{args.d_out}: {num_params:,} params "
        f"({4 * num_params / 2**20:.1f} MiB float32); {args.batch} rows per replica; "
        f"{args.rounds} rounds after {args.warmup} warm-up calls"
        + (f"; {args.label}" if args.label else ""))
    t0 = time.perf_counter()
    variants = make_variants(args, mesh)
    traffic = [cross_host_bytes(v.text, hosts) for v in variants]
    log(f"compiled {len(variants)} variants in {time.perf_counter() - t0:.1f} s")
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    everyone, sent = time_rounds(h, variants, args.rounds, args.warmup, args.seed)
    times = everyone.max(axis=0)  # a call is done when the slowest process is
    log(f"timed {args.rounds} rounds in {time.perf_counter() - t0:.1f} s")
    names = [v.name for v in variants]
    deviation = float(h.gather_times(np.array([max_deviation(
        variants[names.index(K0)].args[0], variants[names.index(XLA)].args[0])])).max())
    summary = summarize(names, times, traffic, args.k0_target, args.slack, args.min_comm)
    for i, row in enumerate(summary["rows"]):
        row["times_by_process"] = everyone[:, :, i].tolist()
        if sent is not None:  # [hosts, rounds]: what each host's NIC sent per call
            row["nic_bytes_by_host"] = sent[:, :, i].tolist()
            row["nic_bytes_per_host"] = float(np.median(sent[:, :, i]))
    log("\n" + format_table(summary))
    if sent is not None:
        per_host = len(hosts) // len(set(hosts))
        log(f"NIC bytes per host per call (median over hosts and rounds; the compiled "
            f"programs' bytes x {per_host} device(s) per host in brackets): " + ", ".join(
                f"{r['name']} {r['nic_bytes_per_host'] / 1e6:.2f} MB "
                f"({per_host * r['cross_host_bytes'] / 1e6:.2f})" for r in summary["rows"]))
    log(f"params of skipreduce k=0 vs xla after {args.warmup + args.rounds} steps: max |diff| "
        f"/ max |xla| = {deviation:.1e}")
    if not leader:
        return 0
    tag = args.tag or f"{args.layout}_p{h.processes}x{jax.local_device_count()}"
    meta = {
        "layout": args.layout, "mesh": dict(mesh.shape), "hosts": len(set(hosts)),
        "processes": h.processes, "local_devices": jax.local_device_count(),
        "mode": "multi-process" if multiprocess else "in-process",
        "model": {"d_in": args.d_in, "hidden": args.hidden, "d_out": args.d_out,
                  "params": num_params, "specs": {k: str(v) for k, v in
                                                  param_specs(args.layout).items()}},
        "batch_per_replica": args.batch, "optimizer": f"sgd lr {args.lr:g} momentum 0.9",
        "skip_ratio": args.skip_ratio, "rounds": args.rounds, "warmup": args.warmup,
        "seed": args.seed, "label": args.label, "jax": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "timing": "per call: barrier (tiny psum), then the step until block_until_ready; "
                  "the max over processes; median/IQR over interleaved rounds",
        "load_average_start": load_start, "load_average_end": os.getloadavg(),
        "k0_vs_xla_max_rel_deviation": deviation,
        "source": source_version(),
    }
    log(f"load average (1, 5, 15 min) at start {fmt_load(load_start)}, at end "
        f"{fmt_load(meta['load_average_end'])} on {os.cpu_count()} cores")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"sharded_step_{tag}.json"
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, **summary}, f, indent=1)
        f.write("\n")
    print(f"wrote {json_path}", flush=True)
    if not args.no_plot:
        png = json_path.with_suffix(".png")
        plot(summary, png, f"{args.layout}: mesh {dict(mesh.shape)}, {setup}"
             + (f", {args.label}" if args.label else ""))
        print(f"wrote {png}", flush=True)
    return 0 if deviation < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
