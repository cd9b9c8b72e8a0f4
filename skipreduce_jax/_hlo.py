"""Communication accounting read from a compiled XLA program.

``collective_traffic(compiled_text)`` lists every collective op of the
program (``jax.jit(f).lower(...).compile().as_text()``), how often it runs
(while-loop trip counts multiply), and the bytes each device sends for it
under the usual ring algorithms:

=================  ==========================================
op                 bytes sent per device
=================  ==========================================
collective-permute its operand
all-gather         (g - 1) / g of its result
reduce-scatter     (g - 1) / g of its operand
all-reduce         2 (g - 1) / g of its operand
all-to-all         (g - 1) / g of its operand
=================  ==========================================

where g is the size of the op's replica group. This is how the tests and
benchmarks check SkipReduce's traffic against the formula.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
    "c128": 16,
}
_KINDS = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce",
          "all-to-all")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"([a-z]+\d*)\[([\d,]*)\]")
_CALLEE = re.compile(
    r"\b(body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_EMPTY = re.compile(r"replica_groups=\{\}")
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
        multiplied; every branch of a conditional is counted, an upper bound).
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
        return sum(op.bytes_per_device for op in self.ops
                   if kind is None or op.kind == kind)

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


def _group_size(line: str, kind: str, devices: int) -> int:
    if kind == "collective-permute":
        return 2
    listed = _GROUPS_LIST.search(line)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    iota = _GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    if _GROUPS_EMPTY.search(line):  # no groups listed: all devices
        return devices
    return 1


def _op(kind: str, line: str, result: str, asynchronous: bool, count: int,
        devices: int):
    # Compiled HLO prints operands without shapes, so everything is derived
    # from the result. An async "-start" op returns (inputs..., outputs...),
    # except all-reduce-start, which returns its outputs as all-reduce does;
    # a combined op (several pmeans merged) returns a tuple of outputs, all
    # of which move.
    arrays = _arrays(result)
    if asynchronous and kind != "all-reduce":
        # Trailing scalar context words (u32[]/s32[]) of some async ops.
        while arrays and not arrays[-1][1] and arrays[-1][0] in ("u32", "s32"):
            arrays.pop()
        arrays = arrays[len(arrays) // 2:]
    arrays = arrays or [("", ())]
    group = _group_size(line, kind, devices)
    nbytes = sum(math.prod(shape) * _DTYPE_BYTES.get(dtype, 0)
                 for dtype, shape in arrays)
    if kind == "collective-permute":
        sent = nbytes
    elif kind == "all-reduce":
        sent = 2 * nbytes * (group - 1) / group
    elif kind == "reduce-scatter":  # the result is 1/g of what is reduced
        sent = nbytes * (group - 1)
    else:
        sent = nbytes * (group - 1) / group
    dtype, shape = arrays[0]
    return CollectiveOp(kind, dtype, shape, group, count, sent * count)


def collective_traffic(compiled_text: str) -> Traffic:
    """Reads every collective op of a compiled program and its traffic.

    Args:
      compiled_text: ``jax.jit(f).lower(*args).compile().as_text()``.

    Returns:
      A :class:`Traffic` with one :class:`CollectiveOp` per instruction.

    Example:
      >>> text = jax.jit(f).lower(x).compile().as_text()
      >>> collective_traffic(text).bytes_per_device("collective-permute")
    """
    computations, entry = _split_computations(compiled_text)
    if entry is None:
        raise ValueError("collective_traffic: no ENTRY computation found; pass "
                         "the text of a compiled program (.compile().as_text()).")
    ops: list[CollectiveOp] = []
    devices = math.prod(int(m.group(1)) if m else 1 for m in (
        _PARTITIONS.search(compiled_text), _REPLICAS.search(compiled_text)))

    def visit(name: str, multiplier: int, depth: int = 0):
        if depth > 64 or name not in computations:
            return
        for line in computations[name]:
            match = _INSTR.match(line)
            if match is None:
                continue
            result, opcode, _ = match.groups()
            kind = opcode.removesuffix("-start")
            if kind in _KINDS and not opcode.endswith("-done"):
                ops.append(_op(kind, line, result, opcode.endswith("-start"),
                               multiplier, devices))
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                times = int(trip.group(1)) if role == "body" and trip else 1
                visit(callee, multiplier * times, depth + 1)
            branches = _BRANCHES.search(line)
            if branches:
                for callee in branches.group(1).split(","):
                    visit(callee.strip().lstrip("%"), multiplier, depth + 1)

    visit(entry, 1)
    return Traffic(tuple(ops))
