"""Communication accounting read from a compiled XLA program.

``collective_traffic(compiled_text)`` lists every collective op of the
program, how often it runs (while-loop trip counts multiply), and the bytes
each device sends for it under the usual ring algorithms (``_op``, with
the formulas of ``_ring/traffic.py``). Replica groups are read in every format
XLA prints: explicit lists, iota lists, and the mesh axes that plain
``jax.jit`` programs over sharded inputs (GSPMD) print.

Inside fusions, instructions of one kind with the same ``channel_id``,
result and group size are one collective, counted once (XLA:TPU's async
collective fusions repeat it in their start, update and done computations).
An all-reduce, all-gather or reduce-scatter with a ``channel_id`` but not
``use_global_device_ids=true`` lists replica ids, each group spanning every
partition too. Groups in a format not understood, or a collective whose
traffic is not counted (``ragged-all-to-all``, ``collective-broadcast``),
raise ``ValueError`` naming the instruction: the count is never silently short.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

from skipreduce_jax._ring.traffic import (
    all_gather_bytes,
    reduce_scatter_bytes,
    ring_allreduce_bytes,
)

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_CALLEE = re.compile(r"\b(body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_UNCOUNTED = ("ragged-all-to-all", "collective-broadcast")
_ANY_COLLECTIVE = re.compile(r"\s(" + "|".join(_KINDS + _UNCOUNTED) + r")(?:-start)?\(")
_INTS = r"\d+(?:,\d+)*"
_LIST = re.compile(rf"\{{((?:\{{(?:{_INTS})?\}})(?:,\{{(?:{_INTS})?\}})*)?\}}")
_IOTA = re.compile(rf"\[({_INTS})\]<=\[({_INTS})\](?:T\(({_INTS})\))?")
_NAME = r"""'([^']*)'|"([^"]*)"|([\w.\-]+)"""
_MESH = re.compile(r"mesh\[([^\]]*)\]")
_MESH_AXIS = re.compile(rf"\s*(?:{_NAME})=(\d+)\s*")
_AXIS_REF = re.compile(rf"\s*(?:{_NAME})(?::\((\d+)\)(\d+))?\s*")
_DEVICE_IDS = re.compile(r",\s*device_ids=\(")
_AXES = re.compile(r"\s*\{([^{}]*)\}")
_PARTITIONS = re.compile(r"^HloModule\b.*?\bnum_partitions=(\d+)", re.M)
_REPLICAS = re.compile(r"^HloModule\b.*?\breplica_count=(\d+)", re.M)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program.

    Attributes:
      kind: e.g. ``"collective-permute"`` or ``"all-gather"``.
      dtype: the HLO element type, e.g. ``"f32"``.
      shape: the op's (first) result shape.
      group_size: devices in the op's replica group (2 for a permute).
      count: how many times it runs per call (while-loop trip counts
        multiplied; of a conditional only the branch that sends the most counts).
      bytes_per_device: bytes each device sends per call, all runs included.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    count: int
    bytes_per_device: float


@dataclasses.dataclass(frozen=True)
class Traffic:
    """All collectives of a program.

    Attributes:
      ops: every collective instruction.
    """

    ops: tuple[CollectiveOp, ...]

    def bytes_per_device(self, kind: str | None = None) -> float:
        """Bytes one device sends per call (of one kind of op, or in all)."""
        return sum(op.bytes_per_device for op in self.ops if kind is None or op.kind == kind)

    def count(self, kind: str) -> int:
        """How many ops of ``kind`` run per call."""
        return sum(op.count for op in self.ops if op.kind == kind)

    def by_kind(self) -> dict[str, float]:
        """Bytes per device per call, by kind of op."""
        totals: dict[str, float] = defaultdict(float)
        for op in self.ops:
            totals[op.kind] += op.bytes_per_device
        return dict(totals)


def _split_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    computations: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape_text)]


def _refuse(line: str, why: str) -> ValueError:
    shown = line.strip()
    shown = shown if len(shown) <= 400 else shown[:400] + " ..."
    return ValueError(
        f"collective_traffic: {why}, so the traffic of this instruction cannot be "
        f"counted (pass the unedited .compile().as_text() of a program). "
        f"Instruction: {shown}")


def _attribute(line: str, name: str) -> str | None:
    """The text after ``name=`` in ``line`` (None if the attribute is absent)."""
    match = re.search(rf"[\s,]{name}=", line)
    return None if match is None else line[match.end():]


def _int_list(text: str) -> list[int]:
    return [int(d) for d in text.split(",")]


def _closing(text: str, start: int) -> int:
    """Index just past the bracket that closes ``text[start]`` (-1: none)."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack = []
    for i in range(start, len(text)):
        if text[i] in pairs:
            stack.append(pairs[text[i]])
        elif stack and text[i] == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    return -1


def _list_groups(text: str) -> list[list[int]] | None:
    """The groups of ``{{0,1},{2,3}}`` (``{}``: none listed; None: another format)."""
    match = _LIST.match(text)
    if match is None:
        return None
    groups = re.findall(r"\{([\d,]*)\}", match.group(1) or "")
    return [_int_list(g) if g else [] for g in groups]


def _name(match: re.Match) -> str:
    return next(n for n in match.groups()[:3] if n is not None)


def _mesh_group_size(text: str) -> int | None:
    """Devices per group of ``mesh[a=size,...](, device_ids=(...)) {a,'b':(pre)size}``."""
    mesh = _MESH.match(text)
    if mesh is None:
        return None
    sizes = {}
    for item in mesh.group(1).split(","):
        axis = _MESH_AXIS.fullmatch(item)
        if axis is None:
            return None
        sizes[_name(axis)] = int(axis.group(4))
    rest = text[mesh.end():]
    ids = _DEVICE_IDS.match(rest)
    if ids:  # the device order does not change the group size
        end = _closing(rest, ids.end() - 1)
        if end < 0:
            return None
        rest = rest[end:]
    axes = _AXES.match(rest)
    if axes is None:
        return None
    size = 1
    for item in filter(str.strip, axes.group(1).split(",")):
        ref = _AXIS_REF.fullmatch(item)
        if ref is None or _name(ref) not in sizes:
            return None
        name = _name(ref)
        pre, sub = ref.group(4), ref.group(5)
        if sub is not None and sizes[name] % (int(pre) * int(sub)):
            return None
        size *= sizes[name] if sub is None else int(sub)
    return size if math.prod(sizes.values()) % size == 0 else None


def _iota_group_size(text: str) -> int | None:
    """Devices per group of ``[groups,size]<=[dims]T(perm)``."""
    iota = _IOTA.match(text)
    if iota is None:
        return None
    shape, dims = _int_list(iota.group(1)), _int_list(iota.group(2))
    perm = _int_list(iota.group(3)) if iota.group(3) else list(range(len(dims)))
    if len(shape) != 2 or math.prod(shape) != math.prod(dims) or (
            sorted(perm) != list(range(len(dims)))):
        return None
    return shape[1]


def _group_size(line: str, kind: str, devices: int, partitions: int) -> int:
    if kind == "collective-permute":
        pairs = _attribute(line, "source_target_pairs")
        listed = None if pairs is None else _list_groups(pairs)
        if listed is None or any(len(pair) != 2 for pair in listed):
            raise _refuse(line, "source_target_pairs format not understood")
        return 2
    text = _attribute(line, "replica_groups")
    if text is None:
        raise _refuse(line, "replica_groups format not understood: none given")
    listed = _list_groups(text)
    if listed is not None:
        sizes = {len(group) for group in listed}
        if len(sizes) > 1 or 0 in sizes or any(
                d >= devices for group in listed for d in group):
            raise _refuse(line, "replica_groups format not understood: groups of different "
                          "sizes, empty, or naming devices the program does not have")
        size = sizes.pop() if sizes else None
    else:
        mesh = _mesh_group_size(text)
        size = _iota_group_size(text) if mesh is None else mesh
        if size is None or size > devices:
            raise _refuse(line, "replica_groups format not understood")
        if mesh is not None:
            return mesh  # mesh axes name devices, never replicas
    if (kind != "all-to-all" and "channel_id=" in line
            and "use_global_device_ids=true" not in line):
        # Cross-replica-and-partition: groups of replicas, each across every partition.
        return (size or devices // partitions) * partitions
    return size or devices  # no groups listed: all devices


def _op(kind: str, line: str, result: str, asynchronous: bool, count: int,
        devices: int, partitions: int):
    # Compiled HLO prints operands without shapes: everything comes from the
    # result. An async "-start" op other than all-reduce-start returns
    # (inputs..., outputs...); a combined op (several pmeans merged) returns
    # a tuple of outputs, all of which move.
    arrays = _arrays(result)
    if asynchronous and kind != "all-reduce":
        # Trailing scalar context words (u32[]/s32[]) of some async ops.
        while arrays and not arrays[-1][1] and arrays[-1][0] in ("u32", "s32"):
            arrays.pop()
        arrays = arrays[len(arrays) // 2:]
    arrays = arrays or [("", ())]
    group = _group_size(line, kind, devices, partitions)
    nbytes = sum(math.prod(shape) * _DTYPE_BYTES.get(dtype, 0) for dtype, shape in arrays)
    if kind == "collective-permute":
        sent = nbytes
    elif kind == "all-reduce":
        sent = ring_allreduce_bytes(nbytes, group)
    elif kind == "reduce-scatter":  # the result is 1/g of what is reduced
        sent = reduce_scatter_bytes(nbytes * group, group)
    else:  # all-gather, all-to-all: (g - 1) / g of the buffer leaves
        sent = all_gather_bytes(nbytes, group)
    dtype, shape = arrays[0]
    return CollectiveOp(kind, dtype, shape, group, count, sent * count)


def collective_traffic(compiled_text: str) -> Traffic:
    r"""Reads every collective op of a compiled program and its traffic.

    Args:
      compiled_text: ``jax.jit(f).lower(*args).compile().as_text()``.

    Returns:
      A :class:`Traffic` with one :class:`CollectiveOp` per instruction.

    Raises:
      ValueError: the text has no ENTRY computation, or a collective whose
        replica groups (or source-target pairs) are in a format not
        understood, or whose traffic is not counted; the message quotes the
        instruction.

    Example:
      A data-parallel gradient all-reduce of 1024 f32 over 8 devices:

      >>> from skipreduce_jax import collective_traffic
      >>> text = "\n".join([
      ...     "HloModule jit_step, num_partitions=8",
      ...     "ENTRY %main (p: f32[1024]) -> f32[1024] {",
      ...     "  ROOT %g = f32[1024]{0} all-reduce(%p), channel_id=1, "
      ...     "replica_groups=mesh['axis_0'=8] {'axis_0'}, use_global_device_ids=true",
      ...     "}"])
      >>> traffic = collective_traffic(text)
      >>> traffic.ops[0].group_size, traffic.bytes_per_device()
      (8, 7168.0)
    """
    computations, entry = _split_computations(compiled_text)
    if entry is None:
        raise ValueError("collective_traffic: no ENTRY computation found; pass "
                         "the text of a compiled program (.compile().as_text()).")
    ops: list[CollectiveOp] = []
    partitions, replicas = (int(m.group(1)) if m else 1 for m in (
        _PARTITIONS.search(compiled_text), _REPLICAS.search(compiled_text)))
    devices = partitions * replicas
    counted: set[tuple] = set()  # (kind, channel_id, result arrays, group size)

    def visit(name: str, multiplier: int, ops: list[CollectiveOp], depth: int = 0,
              fused: bool = False):
        if depth > 64 or name not in computations:
            return
        for line in computations[name]:
            match = _INSTR.match(line)
            if match is None:
                if _ANY_COLLECTIVE.search(line):
                    raise _refuse(line, "collective instruction format not understood")
                continue
            result, opcode, _ = match.groups()
            kind = opcode.removesuffix("-start")
            if kind in _UNCOUNTED:
                raise _refuse(line, f"{kind} is not counted (its traffic is not "
                              "fixed by its shapes)")
            channel = _CHANNEL.search(line)
            if fused and channel and kind in _KINDS:  # counted once per fusion
                same = (kind, channel.group(1), tuple(_arrays(result)),
                        _group_size(line, kind, devices, partitions))
                if same in counted:
                    continue
                counted.add(same)
            if kind in _KINDS and not opcode.endswith("-done"):
                ops.append(_op(kind, line, result, opcode.endswith("-start"),
                               multiplier, devices, partitions))
            if opcode in ("async-update", "async-done"):
                continue  # the async-start names the same computation: count it once
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                times = int(trip.group(1)) if role == "body" and trip else 1
                visit(callee, multiplier * times, ops, depth + 1, fused or opcode == "fusion")
            branches = _BRANCHES.search(line)
            if branches:
                # One branch runs: count the one that sends the most.
                taken: list[list[CollectiveOp]] = []
                for callee in branches.group(1).split(","):
                    taken.append([])
                    visit(callee.strip().lstrip("%"), multiplier, taken[-1], depth + 1)
                ops.extend(max(taken, key=lambda b: sum(o.bytes_per_device for o in b)))

    visit(entry, 1, ops)
    return Traffic(tuple(ops))
