"""Compiles training steps for TPU and GPU pods on a CPU machine, and reads them.

Compiled, not run: libtpu and XLA's GPU compiler build the program for a
4-slice TPU v5e pod (``v5e:4x4`` slices, 64 chips) or for 1-2 nodes of 8
H100s (from XLA's reference device spec) without the hardware, from
``jax.ShapeDtypeStruct`` inputs. What the compiled HLO shows is what XLA
would run: which collectives cross the slow axis (the data-center network
between TPU slices, the network between GPU nodes) and how many bytes they
send, whether each runs asynchronously and which compute XLA scheduled
between its start and its done, and ``memory_analysis()`` per device.

Meshes have two axes, ``("slow", "fast")``: slices x chips of a slice, or
nodes x GPUs of a node.

Run ``python benchmarks/pods.py`` in the environment of ``make check-pods``
(``pip install -e '.[pods]'``) to print the schedule study of
``benchmarks/pods.md``.
"""

from __future__ import annotations

import os

# No TPU here: libtpu must neither ask a metadata server nor look for other
# TPU hosts (set before jax is imported, whenever this runs first).
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-16")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import skipreduce_jax as sr  # noqa: E402
from skipreduce_jax._ring import traffic as _traffic  # noqa: E402

SLOW, FAST = "slow", "fast"
H100_SPEC = pathlib.Path(__file__).resolve().parents[1] / "tests" / "pods" / "h100_sxm.txtpb"

# ----------------------------------------------------------------------------
# Topologies and meshes.
# ----------------------------------------------------------------------------


@functools.cache
def tpu_devices(slices: int = 4, topology: str = "v5e:4x4",
                chips_per_host: tuple[int, int, int] = (2, 2, 1)) -> tuple:
    """Compile-only devices of a multi-slice TPU pod (libtpu, no TPU)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name="default",
        chips_per_host_bounds=chips_per_host, num_slices=slices)
    return tuple(topo.devices)


@functools.cache
def gpu_devices(nodes: int = 2, gpus: int = 8,
                spec: pathlib.Path = H100_SPEC) -> tuple:
    """Compile-only devices of ``nodes`` hosts with ``gpus`` GPUs each."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", topology_name="", target_config=spec.read_text(),
        topology=f"1x{nodes}x{gpus}")
    return tuple(topo.devices)


def tpu_mesh(slices: int = 4) -> jax.sharding.Mesh:
    """``(slow=slices, fast=chips per slice)`` over a v5e:4x4 multi-slice pod."""
    from jax.experimental import mesh_utils

    devices = tpu_devices(slices)
    per_slice = len(devices) // slices
    grid = mesh_utils.create_hybrid_device_mesh(
        (1, per_slice), (slices, 1), devices).reshape(slices, per_slice)
    return jax.sharding.Mesh(grid, (SLOW, FAST))


def gpu_mesh(nodes: int = 2, gpus: int = 8) -> jax.sharding.Mesh:
    """``(slow=nodes, fast=gpus)`` over H100 nodes."""
    devices = sorted(gpu_devices(nodes, gpus), key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(devices).reshape(nodes, gpus), (SLOW, FAST))


def node_of(device: Any) -> int:
    """The slow-axis unit a device belongs to: its TPU slice or its GPU host."""
    return device.slice_index if device.platform == "tpu" else device.process_index


# ----------------------------------------------------------------------------
# Reading compiled HLO.
# ----------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_NATIVE = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
           "all-to-all")
# Ops that move no data or only start/finish something: not compute.
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
         "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "send", "recv", "send-done", "recv-done"}
_CALLS = re.compile(r"\b(?:body|calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_PREDICATED = re.compile(r"\b(?:true|false)_computation=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\((\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)\))?"
                          r"\s*\{([^}]*)\}")
_DEVICE_IOTA = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_IS_SYNC = re.compile(r'"is_sync":(true|false)')
_MEGASCALE_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,]+)\}x')
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a scheduled computation."""

    name: str
    result: str
    opcode: str
    text: str  # everything after the opening parenthesis

    @property
    def operands(self) -> list[str]:
        """Names of the operands (``%name`` before the closing parenthesis)."""
        depth = 1
        for end, char in enumerate(self.text):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return re.findall(r"%([\w.\-]+)", self.text[:end])
        return re.findall(r"%([\w.\-]+)", self.text)

    @property
    def elements(self) -> int:
        """Elements of the (first) result array."""
        arrays = _arrays(self.result)
        return math.prod(arrays[0][1]) if arrays else 0

    @property
    def phase(self) -> str:
        """``"backward"``, ``"forward"`` or ``"other"`` (from the op's metadata)."""
        op_name = _OP_NAME.search(self.text)
        name = op_name.group(1) if op_name else ""
        if "transpose(" in name:
            return "backward"
        return "forward" if "jvp(" in name else "other"

    @property
    def matmul(self) -> bool:
        """A matrix multiply: a dot/convolution, a GEMM fusion or a GEMM call."""
        if self.opcode in ("dot", "convolution"):
            return True
        if self.opcode == "custom-call":
            return bool(re.search(r'custom_call_target="[^"]*(gemm|cublas|matmul)',
                                  self.text))
        # TPU convolution fusions are kOutput fusions; GPU ones name the gemm.
        return self.opcode == "fusion" and (
            "kind=kOutput" in self.text
            or bool(re.search(r"gemm|convolution|dot", self.name)))

    @property
    def compute(self) -> bool:
        """Work of the device's cores (scalar bookkeeping is left out)."""
        return (self.opcode not in _FREE and not self.opcode.endswith(("-start", "-done"))
                and self.elements > 1)


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape_text)]


def _nbytes(arrays: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * _BYTES.get(dtype, 0) for dtype, shape in arrays)


def parse_computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Splits compiled HLO text into computations (in schedule order)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (match := _INSTRUCTION.match(line)):
            computations[current].append(Instruction(*match.groups()))
    if entry is None:
        raise ValueError("parse_computations: no ENTRY computation; pass the text "
                         "of a compiled program (.compile().as_text()).")
    return computations, entry


def _iota_groups(line: str) -> list[list[int]] | None:
    match = _GROUPS_IOTA.search(line)
    if not match:
        return None
    shape = [int(d) for d in match.group(1).split(",")]
    ids = np.arange(math.prod(shape)).reshape([int(d) for d in match.group(2).split(",")])
    if match.group(3):
        ids = ids.transpose([int(d) for d in match.group(3).split(",")])
    return ids.reshape(shape).tolist()


def _mesh_groups(line: str) -> list[list[int]] | None:
    match = _GROUPS_MESH.search(line)
    if not match:
        return None
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    chosen = re.findall(r"'([^']+)'", match.group(3))
    names = [a for a, _ in axes]
    if not axes or len(names) != match.group(1).count("=") or not set(chosen) <= set(names):
        raise ValueError(f"replica groups of a form this reader does not know: "
                         f"{match.group(0)!r}")
    shape = [int(s) for _, s in axes]
    ids = _device_ids(match.group(2), math.prod(shape)).reshape(shape)
    kept = [names.index(a) for a in chosen]
    rest = [i for i in range(len(names)) if i not in kept]
    size = math.prod(ids.shape[i] for i in kept)
    return ids.transpose(rest + kept).reshape(-1, size).tolist()


def _device_ids(spec: str | None, size: int) -> np.ndarray:
    """The device at each position of a mesh's axes: ``[dims]T(perm)``, a list, or 0..n-1."""
    if spec is None:
        return np.arange(size)
    iota = _DEVICE_IOTA.fullmatch(spec)
    if not iota:
        return np.array([int(d) for d in spec.split(",")])
    dims = [int(d) for d in iota.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if iota.group(2):
        ids = ids.transpose([int(d) for d in iota.group(2).split(",")])
    return ids.reshape(-1)


def replica_groups(line: str, devices: int) -> list[list[int]]:
    """The device groups of a collective: listed, iota, mesh-axes or all."""
    pairs = _PAIRS.search(line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    listed = _GROUPS_LIST.search(line)
    if listed and listed.group(1):
        return [[int(d) for d in g.split(",") if d]
                for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
    for parse in (_iota_groups, _mesh_groups):
        groups = parse(line)
        if groups is not None:
            return groups
    if "replica_groups=" in line and "replica_groups={}" not in line:
        raise ValueError(f"replica groups of a form this reader does not know: {line[:300]}")
    return [list(range(devices))]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program, and what runs while it is in flight.

    Attributes:
      name: the instruction name (of the start op for async pairs).
      kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``,
        ``collective-permute``, ``all-to-all``; a TPU data-center network
        transfer is ``dcn-`` plus its type (``dcn-one_to_one``,
        ``dcn-all_gather``, ``dcn-all_reduce``).
      group_size: devices (TPU: slices) in the op's group.
      bytes_per_device: bytes each device sends per call, runs included (the
        ring formulas of ``skipreduce_jax._ring.traffic`` over ``group_size``).
      count: runs per call (known while-loop trip counts multiplied).
      slow: whether it crosses the slow axis (a group or pair spanning
        nodes, or any DCN transfer).
      asynchronous: a start/done (send/recv-done) pair rather than one op.
      is_sync: the GPU backend's ``is_sync`` flag (None elsewhere).
      overlap: compute instructions scheduled between start and done.
      trip_count_known: False if it sits in a loop of unknown trip count
        (counted once).
    """

    name: str
    kind: str
    group_size: int
    bytes_per_device: float
    count: int
    slow: bool
    asynchronous: bool
    is_sync: bool | None
    overlap: tuple[Instruction, ...]
    trip_count_known: bool = True

    @property
    def reduces(self) -> bool:
        """An all-reduce (native or over the data-center network)."""
        return self.kind in ("all-reduce", "dcn-all_reduce")


def _native_bytes(kind: str, inst: Instruction, group: int) -> float:
    # An async -start returns (inputs..., outputs...), except all-reduce-start,
    # which returns its outputs; trailing u32/s32 scalars are context words.
    arrays = _arrays(inst.result)
    if inst.opcode.endswith("-start") and kind != "all-reduce":
        while arrays and not arrays[-1][1] and arrays[-1][0] in ("u32", "s32"):
            arrays.pop()
        arrays = arrays[len(arrays) // 2:]
    result = _nbytes(arrays)
    if kind == "collective-permute":
        return float(result)
    if kind == "all-reduce":
        return _traffic.ring_allreduce_bytes(result, group)
    if kind == "reduce-scatter":  # the result is 1/g of what is reduced
        return _traffic.reduce_scatter_bytes(result * group, group)
    return _traffic.all_gather_bytes(result, group)  # all-gather, all-to-all


def _dcn_bytes(kind: str, payload: int, slices: int) -> float:
    if kind == "dcn-one_to_one":
        return float(payload)
    if kind == "dcn-all_reduce":
        return _traffic.ring_allreduce_bytes(payload, slices)
    if kind == "dcn-all_gather":  # each slice sends its piece to every other
        return float(payload * (slices - 1))
    if kind == "dcn-reduce_scatter":
        return _traffic.reduce_scatter_bytes(payload, slices)
    raise ValueError(f"a data-center network transfer of a type this reader does "
                     f"not know: {kind!r}")


def _span(body: list[Instruction], first: int, last: int) -> tuple[Instruction, ...]:
    return tuple(i for i in body[first + 1:last] if i.compute)


def _collectives_of(body: list[Instruction], nodes: Sequence[int], count: int,
                    known: bool) -> list[Collective]:
    position = {inst.name: i for i, inst in enumerate(body)}
    done_of = {inst.operands[0]: i for i, inst in enumerate(body)
               if inst.opcode.endswith("-done") and inst.operands}
    found = []
    transfers: dict[str, list[int]] = {}
    for i, inst in enumerate(body):
        kind = inst.opcode.removesuffix("-start")
        if kind in _NATIVE and not inst.opcode.endswith("-done"):
            groups = replica_groups(inst.text, len(nodes))
            slow = any(len({nodes[d] for d in g}) > 1 for g in groups)
            size = 2 if kind == "collective-permute" else len(groups[0])
            asynchronous = inst.opcode.endswith("-start")
            last = done_of.get(inst.name, i) if asynchronous else i
            sync = _IS_SYNC.search(inst.text)
            found.append(Collective(
                inst.name, kind, size, _native_bytes(kind, inst, size) * count,
                count, slow, asynchronous, sync and sync.group(1) == "true",
                _span(body, i, last), known))
        elif inst.opcode in ("send", "recv") and "xla_megascale_runtime" in inst.text:
            key = _RENDEZVOUS.search(inst.text)
            transfers.setdefault(key.group(1) if key else inst.name, []).append(i)
    for indices in transfers.values():
        first = min(indices)
        send = next((body[i] for i in indices if body[i].opcode == "send"), body[first])
        # A ppermute's transfer may name no type.
        kind_of = _MEGASCALE_TYPE.search(send.text)
        kind = "dcn-" + (kind_of.group(1) if kind_of else "ONE_TO_ONE").lower()
        slices = _MEGASCALE_SLICES.search(send.text)
        slices = len(slices.group(1).split(",")) if slices else 2
        payload = _nbytes([a for a in _arrays(send.result) if a[1]] or
                          _arrays(send.result)[:1])
        ends = [j for j, inst in enumerate(body) if inst.opcode.endswith("-done")
                and inst.operands and position.get(inst.operands[0]) in indices]
        found.append(Collective(
            send.name, kind, slices, _dcn_bytes(kind, payload, slices) * count,
            count, True, True, None, _span(body, first, max(ends, default=first)),
            known))
    return found


def collectives(compiled_text: str, nodes: Sequence[int]) -> list[Collective]:
    """Every collective of a compiled program, in schedule order per computation.

    Args:
      compiled_text: ``jax.jit(f).lower(...).compile().as_text()``.
      nodes: the slow-axis unit (node or slice) of each device id used in
        replica groups, e.g. ``[node_of(d) for d in mesh.devices.flat]``.

    Returns:
      One :class:`Collective` per collective instruction (per async pair);
      of a conditional's branches only the one that sends the most (e.g.
      Random SkipReduce's ``lax.switch`` over ring shifts runs one per step).
    """
    computations, entry = parse_computations(compiled_text)
    found: list[Collective] = []

    def visit(name: str, count: int, known: bool, depth: int = 0):
        if depth > 64 or name not in computations:
            return
        body = computations[name]
        found.extend(_collectives_of(body, nodes, count, known))
        for inst in body:
            trip = _TRIP.search(inst.text)
            for callee in _CALLS.findall(inst.text):
                loop = inst.opcode == "while" and f"body=%{callee}" in inst.text
                times = int(trip.group(1)) if loop and trip else 1
                visit(callee, count * times, known and (trip is not None or not loop),
                      depth + 1)
            branches = _BRANCHES.search(inst.text)
            runs = []
            for callee in (branches.group(1).split(",") if branches
                           else _PREDICATED.findall(inst.text)):
                start = len(found)
                visit(callee.strip().lstrip("%"), count, known, depth + 1)
                runs.append(found[start:])
                del found[start:]
            # One branch runs per call: keep the one that sends the most.
            found.extend(max(runs, key=lambda r: sum(c.bytes_per_device for c in r),
                             default=[]))

    visit(entry, 1, True)
    return found


def slow_bytes(found: Sequence[Collective]) -> float:
    """Bytes each device sends per call in collectives over the slow axis."""
    return sum(c.bytes_per_device for c in found if c.slow)


def device_memory(compiled: Any) -> int:
    """Bytes a device holds for the program (from ``memory_analysis()``).

    Arguments, outputs not aliased to them, temporaries and generated code.
    """
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes + m.generated_code_size_in_bytes)


def mesh_nodes(mesh: jax.sharding.Mesh) -> list[int]:
    """The slow-axis unit of each device id of a program compiled for ``mesh``."""
    return [node_of(d) for d in mesh.devices.flat]


# ----------------------------------------------------------------------------
# Programs: collectives under shard_map, and training steps.
# ----------------------------------------------------------------------------


def compile_collective(fn: Callable[[jax.Array], jax.Array], mesh: jax.sharding.Mesh,
                       local_size: int, dtype: Any = jnp.float32) -> Any:
    """Compiles ``fn`` on a ``local_size`` buffer per device, both axes manual."""
    spec = P((SLOW, FAST))
    x = jax.ShapeDtypeStruct((mesh.devices.size * local_size,), dtype,
                             sharding=NamedSharding(mesh, spec))
    f = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec)
    return jax.jit(f).lower(x).compile()


def mlp(width: int, layers: int, bias: bool = True) -> tuple[Callable, dict]:
    """A ReLU MLP regressing ``width`` inputs: ``(loss_fn, param shapes)``.

    Args:
      width: inputs, outputs and hidden units of every layer.
      layers: how many ``width x width`` weight matrices.
      bias: whether each layer also adds a ``(width,)`` bias. The biases
        change how XLA:GPU schedules GSPMD's all-reduces against the backward
        pass (``benchmarks/pods.md``), so the study compiles both.
    """
    weight = jax.ShapeDtypeStruct((width, width), jnp.float32)
    vector = jax.ShapeDtypeStruct((width,), jnp.float32)
    shapes = {f"layer{i}": {"w": weight, "b": vector} if bias else {"w": weight}
              for i in range(layers)}

    def loss_fn(params, batch):
        x, y = batch
        for i in range(layers):
            x = x @ params[f"layer{i}"]["w"]
            x = x + params[f"layer{i}"]["b"] if bias else x
            x = jax.nn.relu(x) if i < layers - 1 else x
        return jnp.mean((x - y) ** 2)

    return loss_fn, shapes


def _placed(shapes: Any, mesh: jax.sharding.Mesh, specs: Any = None) -> Any:
    specs = jax.tree_util.tree_map(lambda _: P(), shapes) if specs is None else specs
    return jax.tree_util.tree_map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                             sharding=NamedSharding(mesh, spec)),
        shapes, specs)


def _batch(mesh: jax.sharding.Mesh, width: int, per_device: int) -> tuple:
    rows = mesh.devices.size * per_device
    sharding = NamedSharding(mesh, P((SLOW, FAST)))
    return tuple(jax.ShapeDtypeStruct((rows, width), jnp.float32, sharding=sharding)
                 for _ in range(2))


def compile_gspmd_step(mesh: jax.sharding.Mesh, width: int = 1024, layers: int = 4,
                       per_device: int = 32, compiler_options: dict | None = None,
                       bias: bool = True) -> Any:
    """XLA's own data parallelism: params replicated, batch over all devices."""
    loss_fn, shapes = mlp(width, layers, bias)
    opt = optax.adam(1e-3)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = _placed(jax.eval_shape(opt.init, shapes), mesh)
    return jax.jit(step, donate_argnums=(0, 1)).lower(
        _placed(shapes, mesh), opt_state, _batch(mesh, width, per_device)
    ).compile(compiler_options)


def compile_skipreduce_step(mesh: jax.sharding.Mesh, num_skip: int, width: int = 1024,
                            layers: int = 4, per_device: int = 32,
                            compiler_options: dict | None = None, bias: bool = True,
                            **skip_kwargs: Any) -> Any:
    """:func:`skipreduce_jax.make_train_step` with ``skip_reduce`` then adam.

    Hierarchical over ``(slow, fast)`` when the slow axis has more than one
    member; flat over ``fast`` on a single node.
    """
    loss_fn, shapes = mlp(width, layers, bias)
    if mesh.shape[SLOW] > 1:
        axes: Any = (SLOW, FAST)
        reduce = sr.skip_reduce(SLOW, num_skip=num_skip, inner_axis=FAST, **skip_kwargs)
    else:
        axes = FAST
        reduce = sr.skip_reduce(FAST, num_skip=num_skip, **skip_kwargs)
    tx = optax.chain(reduce, optax.adam(1e-3))
    step = sr.make_train_step(loss_fn, tx, mesh, axes)
    state = jax.eval_shape(tx.init, shapes)
    state = _placed(state, mesh, sr.state_specs(state, axes))
    return step.lower(_placed(shapes, mesh), state,
                      _batch(mesh, width, per_device)).compile(compiler_options)


# ----------------------------------------------------------------------------
# The schedule study.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How one compiled step schedules its collectives against its compute."""

    config: str
    step: str
    collectives: tuple[Collective, ...]
    backward_matmuls: int
    memory: int
    model: str = "-"

    def _of(self, slow: bool) -> list[Collective]:
        # The loss mean (a few bytes) would only clutter the table.
        return [c for c in self.collectives
                if c.slow == slow and c.bytes_per_device >= MIN_LISTED_BYTES]

    def row(self) -> list[str]:
        """The table row: per axis, collectives, async ones, and overlap."""
        cells = [self.config, self.model, self.step]
        for slow in (True, False):
            ops = self._of(slow)
            kinds = ", ".join(f"{n} {k}" for k, n in _counts(c.kind for c in ops))
            asynchronous = sum(c.asynchronous and not c.is_sync for c in ops)
            cells += [kinds or "-", f"{asynchronous}/{len(ops)}" if ops else "-",
                      _overlap(ops, self.backward_matmuls)]
        cells += [f"{slow_bytes(self.collectives) / 2**20:.2f}",
                  f"{self.memory / 2**20:.1f}"]
        return cells


def _counts(values) -> list[tuple[str, int]]:
    return [(k, len(list(g))) for k, g in itertools.groupby(sorted(values))]


def _overlap(ops: Sequence[Collective], backward_matmuls: int) -> str:
    """Compute in flight with the collectives: backward matmuls among it."""
    if not ops:
        return "-"
    hidden = {i.name for c in ops if c.asynchronous and not c.is_sync for i in c.overlap}
    backward = {i.name for c in ops if c.asynchronous and not c.is_sync
                for i in c.overlap if i.phase == "backward" and i.matmul}
    return f"{len(hidden)} ops; {len(backward)}/{backward_matmuls} bwd matmuls"


# XLA merges independent collectives of one kind up to a byte threshold; a
# threshold of 1 byte leaves each bucket's collectives on their own.
NO_COMBINING = {
    "gpu": {"xla_gpu_reduce_scatter_combine_threshold_bytes": 1,
            "xla_gpu_all_gather_combine_threshold_bytes": 1,
            "xla_gpu_collective_permute_combine_threshold_bytes": 1},
    "tpu": {"xla_jf_crs_combiner_threshold_in_bytes": 1},
}


def schedule(config: str, step: str, compiled: Any, mesh: jax.sharding.Mesh,
             model: str = "-") -> Schedule:
    """Reads one compiled step (``model`` names the model in the table)."""
    text = compiled.as_text()
    computations, entry = parse_computations(text)
    matmuls = sum(i.matmul and i.phase == "backward" for i in computations[entry])
    return Schedule(config, step, tuple(collectives(text, mesh_nodes(mesh))),
                    matmuls, device_memory(compiled), model)


def study(config: str, mesh: jax.sharding.Mesh, num_skip: int, **model: Any
          ) -> list[Schedule]:
    """The GSPMD all-reduce step and the SkipReduce step on one mesh.

    SkipReduce is compiled twice: with XLA's default collective combining,
    and with :data:`NO_COMBINING`. ``model`` goes to :func:`mlp` (``bias``)
    and the step's shapes (``width``, ``layers``, ``per_device``).
    """
    label = "biases" if model.get("bias", True) else "no biases"
    platform = mesh.devices.flat[0].platform
    steps = {
        "XLA all-reduce (GSPMD)": lambda: compile_gspmd_step(mesh, **model),
        f"SkipReduce k={num_skip}": lambda: compile_skipreduce_step(
            mesh, num_skip, min_size=0, **model),
        f"SkipReduce k={num_skip}, no combining": lambda: compile_skipreduce_step(
            mesh, num_skip, min_size=0, compiler_options=NO_COMBINING[platform],
            **model),
    }
    return [schedule(config, step, make(), mesh, label) for step, make in steps.items()]


MIN_LISTED_BYTES = 4096
HEADER = ["pod", "model", "step", "slow-axis collectives", "async", "overlapped compute",
          "fast-axis collectives", "async", "overlapped compute",
          "slow MiB/device", "memory MiB/device"]


def markdown(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table with :data:`HEADER`."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# --pod name: (table name, mesh, k).
PODS = {
    "gpu-1x8": ("1 x 8 H100", lambda: gpu_mesh(1, 8), 4),
    "gpu-2x8": ("2 x 8 H100", lambda: gpu_mesh(2, 8), 1),
    "tpu-4x16": ("4 x v5e:4x4", lambda: tpu_mesh(4), 2),
}


# --biases choice: the models compiled, in table order.
BIASES = {"both": (True, False), "with": (True,), "without": (False,)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--per-device", type=int, default=64)
    parser.add_argument("--only", choices=("gpu", "tpu"), default=None)
    parser.add_argument("--pod", choices=tuple(PODS), default=None,
                        help="compile one pod's rows only")
    parser.add_argument("--biases", choices=tuple(BIASES), default="both",
                        help="the model with a bias per layer, without, or both "
                        "(side by side, the default)")
    args = parser.parse_args(argv)
    configs = [(name, make, k) for key, (name, make, k) in PODS.items()
               if (args.pod or key) == key
               and (args.only is None or key.startswith(args.only))]
    rows = []
    for name, make, k in configs:
        mesh = make()
        for bias in BIASES[args.biases]:
            rows += [s.row() for s in study(
                name, mesh, k, width=args.width, layers=args.layers,
                per_device=args.per_device, bias=bias)]
    print(markdown(rows))


if __name__ == "__main__":
    main()
