"""Times lax.psum, ring_psum and skip_psum (k = 0..N-1) inside jax.shard_map.

Every variant is a jitted ``jax.shard_map`` over all devices of a 1-D mesh
``("data",)``, summing one float32 buffer of ``size`` elements per rank:

* ``psum``: ``lax.psum`` (the backend's native all-reduce; gloo on CPU across
  processes),
* ``ring``: :func:`skipreduce_jax.ring_psum` (N - 1 ppermute steps, then the
  gather),
* ``skip-s k``: :func:`skipreduce_jax.skip_psum` with ``randomize=False``
  (static SkipReduce), k = 0..N-1,
* ``skip-r k``: the same with ``randomize=True`` (Random SkipReduce; the key
  is an argument of the call, a new one per round, as in training),
* with ``--comm-dtypes float32,bfloat16``, each of ``psum``, ``ring`` and
  ``skip-* k`` again with a 16-bit wire (rows ending in ``bf16``):
  ``lax.psum`` of the buffer cast to bfloat16 (the baseline a JAX user
  writes; XLA:CPU widens it to a float32 all-reduce, so on CPU hosts it
  sends float32), and ``comm_dtype=jnp.bfloat16`` for the ring and
  SkipReduce (16-bit words on the wire, packed in pairs as ``uint32`` on
  CPU, each hop adding in float32),
* with ``--breakdown``, the parts of ``ring_psum`` alone: one ppermute ring
  step (size/N elements), the same step as ``--pieces`` ppermutes, the
  native all_gather of the N chunks, and Random's reorder pass; and two
  probes of whether XLA runs a computation while a collective is in
  flight: the ppermute step and the reorder, independent of each other, in
  one program, with the reorder as one fusion and as ``--overlap-pieces``
  fusions. On XLA:CPU they overlap only in pieces: its thunk executor hands
  work to a second thread only when more than 8 operations are ready at
  once.

After compiling and ``--warmup`` calls of each variant, ``--rounds`` rounds
are timed; within a round every variant runs once, in an order shuffled per
round, so that machine noise (other jobs on the machine) hits all variants
alike. Each call is timed from a barrier to ``block_until_ready`` of its
output. In multi-process mode every process times its call, and a call's time
is the largest over the processes (the call is done when the last process has
its result). The table shows the median and the interquartile range (IQR) of
those times, the ratios of the medians to ``psum`` and to ``ring``, the
theoretical ratio (2(N-1)-k)/(2(N-1)), and the bytes each device sends per
call, read from the compiled program with
:func:`skipreduce_jax.collective_traffic` and checked against
(2(N-1)-k)/N of the padded buffer.

Two modes:

* in-process (default): ``--devices D`` simulated CPU devices in this process
  (``XLA_FLAGS=--xla_force_host_platform_device_count=D`` is set before JAX
  is imported)::

      .venv/bin/python benchmarks/collectives.py --devices 8

* multi-process: started with the ``SKIPREDUCE_*`` environment of
  ``python -m skipreduce_jax.launch`` (or by ``benchmarks/cluster.py``); each
  process calls :func:`skipreduce_jax.initialize` and contributes its local
  devices; only process 0 prints and writes files::

      .venv/bin/python -m skipreduce_jax.launch -n 4 benchmarks/collectives.py

Outputs (in ``--out``, default ``benchmarks/results/``):
``collectives_<tag>.json`` (metadata, one row per variant and size, and
``measurements``: records that :func:`skipreduce_jax.cost.load_measurements`
reads, of the float32 rows) and ``collectives_<tag>.png`` (time vs k with the theory line).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Make ``import skipreduce_jax`` work when the script is run from a checkout
# without the package installed.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

DEFAULT_SIZES = "1M,4M,16M,32M"
# In-process, the "network" is memcpy on the same few cores and large sizes
# take minutes per variant; the default there stops at 4M.
DEFAULT_SIZES_IN_PROCESS = "1M,4M"
DEFAULT_OUT = _REPO_ROOT / "benchmarks" / "results"
AXIS = "data"


# ----------------------------------------------------------------------------
# Arguments.
# ----------------------------------------------------------------------------


def parse_sizes(text: str) -> list[int]:
    """Parses comma-separated element counts with binary suffixes (``4M`` = 4 * 2**20).

    Each count is read by :func:`skipreduce_jax.cost.parse_binary_count`.
    That imports jax, so in this script call it only after :func:`configure`.

    Args:
        text: e.g. ``"1M,4M,16M"``.

    Returns:
        The element counts, in order.

    Raises:
        argparse.ArgumentTypeError: for a count that does not parse.
    """
    from skipreduce_jax.cost import parse_binary_count

    try:
        return [parse_binary_count(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_count(count: int) -> str:
    """Formats an element count with the largest exact binary suffix."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if count % scale == 0:
            return f"{count // scale}{unit}"
    return str(count)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        description="Time lax.psum, ring_psum and skip_psum (k = 0..N-1) over all devices.")
    p.add_argument("--devices", type=int, default=8,
                   help="simulated CPU devices in in-process mode (default 8; ignored "
                        "in multi-process mode)")
    # Parsed in main, after configure(): the parser imports jax.
    p.add_argument("--sizes", default=None,
                   help=f"float32 elements per rank, comma-separated, binary suffixes "
                        f"K/M/G/T = 2**10/20/30/40, e.g. 16M = 16 * 2**20 (default "
                        f"{DEFAULT_SIZES} multi-process, {DEFAULT_SIZES_IN_PROCESS} "
                        "in-process)")
    p.add_argument("--ks", type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                   default=None, help="skip counts to time (default: all of 0..N-1)")
    p.add_argument("--modes", default="static,random",
                   help="skip_psum variants: static, random or both (default static,random)")
    p.add_argument("--comm-dtypes", default="float32",
                   help="wire dtypes of psum, ring and skip_psum, comma-separated, of "
                        "float32, bfloat16, float16 (default float32)")
    p.add_argument("--gather", choices=("native", "ring"), default="native",
                   help="all-gather of ring_psum/skip_psum (default native)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed rounds; each runs every variant once (default 7)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls of each variant after compiling (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of data and round order")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="directory for the JSON and PNG (default benchmarks/results/)")
    p.add_argument("--tag", default=None,
                   help="file name tag: collectives_<tag>.json/.png (default from the setup)")
    p.add_argument("--meta", default=None,
                   help="JSON object merged into the metadata (the cluster runner passes "
                        "its network setup here)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the parts of ring_psum: one ppermute step of a ring chunk "
                        "(size/N elements), the same step as --pieces ppermutes, and the "
                        "native all_gather of the chunks")
    p.add_argument("--pieces", type=int, default=4,
                   help="with --breakdown: the ring step is also timed as this many ppermutes "
                        "of 1/pieces each, issued together (default 4)")
    p.add_argument("--overlap-pieces", type=int, default=16,
                   help="with --breakdown: the reorder beside the ppermute step is also timed "
                        "as this many independent fusions (default 16)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-check", action="store_true",
                   help="skip the check that ring_psum and skip_psum k=0 equal psum")
    return p


# ----------------------------------------------------------------------------
# Variants.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One collective to time.

    Attributes:
        name: the row label, e.g. ``"skip-r k=2"``.
        kind: ``"psum"``, ``"ring"`` or ``"skip"`` (the cost-model kind), or
            ``"part"`` for a piece of the ring (``--breakdown``).
        num_skip: k (0 for psum and ring).
        randomize: for ``skip``: Random (True) or static (False) SkipReduce.
        comm_dtype: what crosses the network: ``"float32"`` (the buffer's
            own dtype), ``"bfloat16"`` or ``"float16"``.
    """

    name: str
    kind: str
    num_skip: int = 0
    randomize: bool = False
    comm_dtype: str = "float32"

    @property
    def mode(self) -> str:
        """``"psum"``, ``"ring"``, ``"static"``, ``"random"`` or the part's name."""
        if self.kind == "part":
            return self.name
        if self.kind != "skip":
            return self.kind
        return "random" if self.randomize else "static"


PERMUTE_STEP = "1 ppermute step"
PERMUTE_PIECES = "1 step in pieces"
ALL_GATHER = "all_gather"
REORDER = "Random's reorder"
BESIDE = "step + reorder"
BESIDE_PIECES = "step + reorder in pieces"


WIRE_DTYPES = {"float32": "", "bfloat16": " bf16", "float16": " f16"}
"""``--comm-dtypes`` choices and the suffix of their rows' names."""


def make_variants(n: int, ks: Sequence[int] | None, modes: Sequence[str],
                  breakdown: bool = False,
                  comm_dtypes: Sequence[str] = ("float32",)) -> list[Variant]:
    """psum, ring, then skip_psum for every k and mode (and the ring's parts).

    Args:
        n: the axis size N.
        ks: skip counts (None: 0..N-1).
        modes: any of ``"static"`` and ``"random"``.
        breakdown: add one ppermute step and the all_gather of ring_psum,
            the reorder pass Random SkipReduce adds after its gather, and
            the step and the reorder side by side in one program.
        comm_dtypes: wire dtypes (``WIRE_DTYPES``); psum, ring and every
            skip_psum row are made once per dtype, float32 first.

    Returns:
        The variants in table order.
    """
    ks = list(range(n)) if ks is None else list(ks)
    bad = [k for k in ks if not 0 <= k <= n - 1]
    if bad:
        raise SystemExit(f"--ks {bad} outside [0, {n - 1}] for N = {n}")
    unknown = [d for d in comm_dtypes if d not in WIRE_DTYPES]
    if unknown or not comm_dtypes:
        raise SystemExit(f"--comm-dtypes {list(comm_dtypes)}: each one of "
                         f"{', '.join(WIRE_DTYPES)}")
    for mode in modes:
        if mode not in ("static", "random"):
            raise SystemExit(f"--modes: unknown mode {mode!r} (static, random)")
    variants = []
    for dtype in sorted(set(comm_dtypes), key=list(WIRE_DTYPES).index):
        end = WIRE_DTYPES[dtype]
        variants += [Variant("psum" + end, "psum", comm_dtype=dtype),
                     Variant("ring" + end, "ring", comm_dtype=dtype)]
        for mode in modes:
            for k in ks:
                tag = "s" if mode == "static" else "r"
                variants.append(Variant(f"skip-{tag} k={k}{end}", "skip", k,
                                        mode == "random", dtype))
    if breakdown:
        variants += [Variant(PERMUTE_STEP, "part"), Variant(PERMUTE_PIECES, "part"),
                     Variant(ALL_GATHER, "part"), Variant(REORDER, "part"),
                     Variant(BESIDE, "part"), Variant(BESIDE_PIECES, "part")]
    return variants


def theory_ratio(n: int, k: int) -> float:
    """Traffic of SkipReduce relative to the full ring: (2(N-1)-k)/(2(N-1))."""
    from skipreduce_jax._ring.traffic import traffic_fraction

    return traffic_fraction(n, k)


def padded_elements(size: int, n: int, variant: Variant) -> int:
    """Elements of the buffer the collective moves, after the ring's padding."""
    if variant.kind in ("psum", "part"):
        return size
    from skipreduce_jax._ring.buckets import plan_buckets

    shape = jax_shape_struct(size)
    chunks = 1 if variant.kind == "ring" else None
    plan = plan_buckets(shape, group_size=n, chunks_per_rank=chunks)
    return sum(b.padded_size for b in plan.buckets)


def jax_shape_struct(size: int) -> Any:
    """A float32 ``ShapeDtypeStruct`` of ``size`` elements."""
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct((size,), jnp.float32)


def wire_width(variant: Variant, platform: str) -> int:
    """Bytes per element on the wire: 2 for a 16-bit wire, else 4.

    ``lax.psum`` of 16-bit values is widened to a float32 all-reduce by
    XLA:CPU (``platform == "cpu"``), so it sends 4 bytes there.
    """
    if variant.comm_dtype == "float32" or (variant.kind == "psum" and platform == "cpu"):
        return 4
    return 2


def expected_wire_bytes(size: int, n: int, variant: Variant, platform: str = "cpu") -> float:
    """(2(N-1)-k)/N of the padded buffer at the wire's width: bytes each device sends.

    For the parts: 1/N of the buffer (one step, also beside the reorder),
    (N-1)/N (all_gather) and nothing (the reorder is local).
    """
    from skipreduce_jax._ring.traffic import all_gather_bytes, skipreduce_bytes

    chunk_bytes = size // n * 4
    if variant.name == REORDER:
        return 0.0
    if variant.name in (PERMUTE_STEP, PERMUTE_PIECES, BESIDE, BESIDE_PIECES):
        return chunk_bytes
    if variant.name == ALL_GATHER:
        return all_gather_bytes(n * chunk_bytes, n)
    width = wire_width(variant, platform)
    return skipreduce_bytes(padded_elements(size, n, variant) * width, n, variant.num_skip)


def build_function(variant: Variant, mesh: Any, gather: str,
                   pieces: int = 4, overlap_pieces: int = 16) -> Callable[..., Any]:
    """The jitted shard_map of one variant, called as ``f(x, key_data)``.

    ``x`` is sharded over the mesh axis (``size`` elements per device) and
    ``key_data`` is a replicated raw ``uint32[2]`` key (used by Random
    SkipReduce only, so that its schedule is computed at run time as in
    training, not folded into constants). The output is replicated (for
    the ppermute parts: sharded). ``pieces``: how many ppermutes the
    ``PERMUTE_PIECES`` part splits one ring step into; ``overlap_pieces``:
    how many independent fusions ``BESIDE_PIECES`` splits the reorder into
    (its outputs stay separate arrays, as a concatenation would be another
    pass).
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import skipreduce_jax as sr

    n = mesh.shape[AXIS]
    ring_perm = [(i, (i + 1) % n) for i in range(n)]
    comm = None if variant.comm_dtype == "float32" else jnp.dtype(variant.comm_dtype)

    def reorder_pieces(x: Any, key: Any, count: int) -> list[Any]:
        # The reorder skip_psum runs for this buffer (same sub-chunks), cut
        # into `count` independent pieces along each sub-chunk.
        from skipreduce_jax._ring import ring as _ring
        from skipreduce_jax._ring.buckets import plan_buckets

        bucket = plan_buckets(jax_shape_struct(x.shape[0]), group_size=n).buckets[0]
        schedule = sr.make_schedule(n, num_skip=1, key=jax.random.wrap_key_data(key),
                                    chunks_per_rank=bucket.chunks_per_rank)
        x = jnp.pad(x, (0, bucket.padded_size - x.shape[0]))
        by_chunk = x.reshape(n, bucket.chunks_per_rank, -1)
        edges = [by_chunk.shape[2] * j // count for j in range(count + 1)]
        return [_ring.put_in_slot_order(by_chunk[:, :, a:b], schedule).reshape(-1)
                for a, b in zip(edges[:-1], edges[1:], strict=True)]

    if variant.name == PERMUTE_STEP:
        def body(x: Any, key: Any) -> Any:
            del key
            return lax.ppermute(x[: x.shape[0] // n], AXIS, ring_perm)
        out_spec = P(AXIS)
    elif variant.name == PERMUTE_PIECES:
        def body(x: Any, key: Any) -> Any:
            del key
            chunk = x[: x.shape[0] // n]
            edges = [chunk.shape[0] * j // pieces for j in range(pieces + 1)]
            return jnp.concatenate([lax.ppermute(chunk[a:b], AXIS, ring_perm)
                                    for a, b in zip(edges[:-1], edges[1:], strict=True)])
        out_spec = P(AXIS)
    elif variant.name == ALL_GATHER:
        def body(x: Any, key: Any) -> Any:
            del key
            return lax.all_gather(x[: x.shape[0] // n], AXIS, tiled=True, to="invarying")
    elif variant.name == REORDER:
        def body(x: Any, key: Any) -> Any:
            return reorder_pieces(x, key, 1)[0]
        out_spec = P(AXIS)
    elif variant.name in (BESIDE, BESIDE_PIECES):
        count = 1 if variant.name == BESIDE else overlap_pieces

        def body(x: Any, key: Any) -> Any:
            # Neither output depends on the other: XLA may run them at once.
            step = lax.ppermute(x[: x.shape[0] // n], AXIS, ring_perm)
            return (step, *reorder_pieces(x, key, count))
        out_spec = (P(AXIS),) * (1 + count)
    elif variant.kind == "psum":
        def body(x: Any, key: Any) -> Any:
            del key
            if comm is None:
                return lax.psum(x, AXIS)
            return lax.psum(x.astype(comm), AXIS).astype(x.dtype)
    elif variant.kind == "ring":
        def body(x: Any, key: Any) -> Any:
            del key
            return sr.ring_psum(x, AXIS, gather=gather, comm_dtype=comm)
    else:
        def body(x: Any, key: Any) -> Any:
            return sr.skip_psum(x, AXIS, key=key if variant.randomize else None,
                                num_skip=variant.num_skip, randomize=variant.randomize,
                                gather=gather, comm_dtype=comm)
    if variant.kind != "part" or variant.name == ALL_GATHER:
        out_spec = P()
    # gather="ring" returns values equal on every rank but typed varying, so
    # the replicated out_specs cannot be checked statically.
    check_vma = not (gather == "ring" and variant.kind in ("ring", "skip"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS), P()),
                                 out_specs=out_spec, check_vma=check_vma))


# ----------------------------------------------------------------------------
# Set-up, barrier, timing.
# ----------------------------------------------------------------------------


def source_version() -> dict[str, Any]:
    """Which library code was measured: git commit, uncommitted files, a hash.

    ``skipreduce_jax_sha256`` hashes every ``.py`` file of the package as it
    is on disk, so runs of the same code (committed or not) share it.
    """
    import hashlib
    import subprocess

    package = _REPO_ROOT / "skipreduce_jax"
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0"
                      + path.read_bytes())
    info: dict[str, Any] = {"skipreduce_jax_sha256": digest.hexdigest()[:16]}

    def git(*cmd: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(_REPO_ROOT), *cmd], capture_output=True,
                                 text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    info["git_commit"] = git("rev-parse", "--short", "HEAD")
    status = git("status", "--porcelain", "--", "skipreduce_jax")
    info["uncommitted"] = [line.split(maxsplit=1)[-1] for line in status.splitlines()
                           if line.strip()] if status else []
    return info


def configure(args: argparse.Namespace) -> bool:
    """Sets up JAX before it starts; returns whether this is multi-process mode."""
    # Read the launcher's variable without importing skipreduce_jax, which
    # imports jax (the device count must be set before that).
    multiprocess = bool(os.environ.get("SKIPREDUCE_COORDINATOR"))
    if not multiprocess:
        if "jax" in sys.modules:
            raise SystemExit("collectives.py: jax was imported before the device count was set")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={args.devices}")
        os.environ["XLA_FLAGS"] = " ".join(flags)
    import skipreduce_jax

    skipreduce_jax.initialize()
    return multiprocess


class Harness:
    """The mesh, the inputs and the barrier shared by all variants."""

    def __init__(self, seed: int) -> None:
        import jax
        from jax import lax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.jax = jax
        self.n = jax.device_count()
        self.mesh = jax.make_mesh((self.n,), (AXIS,))
        self.sharded = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self.seed = seed
        self.process = jax.process_index()
        self.processes = jax.process_count()
        self._ones = jax.make_array_from_callback(
            (self.n,), self.sharded, lambda idx: np.ones((self.n,), np.int32)[idx])
        self._barrier = jax.jit(jax.shard_map(lambda v: lax.psum(v, AXIS), mesh=self.mesh,
                                              in_specs=P(AXIS), out_specs=P()))
        self.barrier()

    def barrier(self) -> None:
        """Returns when every process got here: a tiny psum over all devices."""
        self._barrier(self._ones).block_until_ready()

    def data(self, size: int) -> Any:
        """A sharded float32 array with ``size`` normal values per device."""
        n = self.n

        def shard(idx: tuple[slice, ...]) -> np.ndarray:
            start, stop, _ = idx[0].indices(n * size)
            rng = np.random.default_rng([self.seed, start // size])
            return rng.standard_normal(stop - start, dtype=np.float32)

        return self.jax.make_array_from_callback((n * size,), self.sharded, shard)

    def key(self, round_index: int) -> Any:
        """A replicated raw ``uint32[2]`` key, different per round."""
        value = np.array([self.seed, round_index], np.uint32)
        return self.jax.make_array_from_callback((2,), self.replicated, lambda idx: value[idx])

    def timed_call(self, fn: Callable[..., Any], x: Any, key: Any) -> float:
        """Seconds from the barrier to this process's result being ready."""
        self.barrier()
        start = time.perf_counter()
        self.jax.block_until_ready(fn(x, key))
        return time.perf_counter() - start

    def gather_times(self, times: np.ndarray) -> np.ndarray:
        """Every process's ``times``, stacked: ``[processes, ...]``."""
        if self.processes == 1:
            return times[None]
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(times))


def check_equal_to_psum(h: Harness, size: int, gather: str) -> dict[str, float]:
    """Max relative deviation of ring_psum and skip_psum k=0 from psum."""
    x = h.data(size)
    key = h.key(0)
    ref = np.asarray(build_function(Variant("psum", "psum"), h.mesh, gather)(x, key)
                     .addressable_shards[0].data)
    scale = float(np.max(np.abs(ref))) or 1.0
    out = {}
    for variant in (Variant("ring", "ring"), Variant("skip-r k=0", "skip", 0, True)):
        got = np.asarray(build_function(variant, h.mesh, gather)(x, key)
                         .addressable_shards[0].data)
        out[variant.name] = float(np.max(np.abs(got - ref))) / scale
    return out


def time_size(h: Harness, size: int, variants: Sequence[Variant], args: argparse.Namespace,
              log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Compiles, warms up and times every variant at one size; one row each."""
    from skipreduce_jax import collective_traffic

    x = h.data(size)
    keys = [h.key(r) for r in range(args.rounds + 1)]
    fns, rows = [], []
    t0 = time.perf_counter()
    for variant in variants:
        fn = build_function(variant, h.mesh, args.gather, args.pieces, args.overlap_pieces)
        compiled = fn.lower(x, keys[0]).compile()
        traffic = collective_traffic(compiled.as_text())
        expected = expected_wire_bytes(size, h.n, variant, h.mesh.devices.flat[0].platform)
        got = traffic.bytes_per_device()
        rows.append({
            "name": variant.name, "kind": variant.kind, "mode": variant.mode,
            "num_skip": variant.num_skip, "comm_dtype": variant.comm_dtype,
            "size": size, "nbytes": size * 4,
            "padded_elements": padded_elements(size, h.n, variant),
            "wire_bytes": got, "expected_wire_bytes": expected,
            "traffic_ok": bool(math.isclose(got, expected, rel_tol=1e-9)),
            "traffic_by_op": traffic.by_kind(),
            "collective_ops": {kind: traffic.count(kind) for kind in traffic.by_kind()},
            "theory_ratio": (theory_ratio(h.n, variant.num_skip)
                             if variant.kind != "part" else None),
        })
        fns.append(fn)
        for _ in range(args.warmup):
            h.jax.block_until_ready(fn(x, keys[0]))
    log(f"  compiled and warmed up {len(variants)} variants in "
        f"{time.perf_counter() - t0:.1f} s")

    times = np.zeros((args.rounds, len(variants)))
    order_rng = np.random.default_rng([args.seed, size])  # the same on every process
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for i in order_rng.permutation(len(variants)):
            times[r, i] = h.timed_call(fns[i], x, keys[r + 1])
    everyone = h.gather_times(times)  # [processes, rounds, variants]
    call_times = everyone.max(axis=0)
    log(f"  timed {args.rounds} rounds in {time.perf_counter() - t0:.1f} s")

    psum_i = next(i for i, v in enumerate(variants) if v.kind == "psum")
    ring_i = next(i for i, v in enumerate(variants) if v.kind == "ring")
    med = np.median(call_times, axis=0)
    for i, row in enumerate(rows):
        col = call_times[:, i]
        q25, q75 = np.percentile(col, [25, 75])
        row.update({
            "seconds": float(med[i]), "q25": float(q25), "q75": float(q75),
            "iqr": float(q75 - q25), "min": float(col.min()), "max": float(col.max()),
            "times": col.tolist(),
            "times_process0": everyone[0, :, i].tolist(),
            "ratio_psum": float(med[i] / med[psum_i]),
            "ratio_ring": float(med[i] / med[ring_i]),
            # Per-round ratios: the variants of one round share its noise.
            "paired_ratio_ring": float(np.median(col / call_times[:, ring_i])),
        })
    return rows


# ----------------------------------------------------------------------------
# Report.
# ----------------------------------------------------------------------------


def format_table(rows: Sequence[dict[str, Any]], rate: float | None = None) -> str:
    """The plain-text table of one size.

    Args:
        rows: the rows of one size.
        rate: the link rate in bit/s, if known: adds the time the bytes sent
            take at that rate ("wire ms") and the measured time over it.
    """
    headers = ["variant", "median ms", "IQR ms", "/psum", "/ring", "theory",
               "MB/dev sent", "expected", "traffic"]
    if rate:
        headers += ["wire ms", "/wire"]
    lines = []
    for row in rows:
        extra = []
        if rate:
            wire = row["wire_bytes"] * 8 / rate
            extra = ([f"{wire * 1e3:.1f}", f"{row['seconds'] / wire:.2f}"] if wire
                     else ["-", "-"])
        lines.append([
            row["name"], f"{row['seconds'] * 1e3:.1f}", f"{row['iqr'] * 1e3:.1f}",
            f"{row['ratio_psum']:.3f}", f"{row['ratio_ring']:.3f}",
            "-" if row["theory_ratio"] is None else f"{row['theory_ratio']:.3f}",
            f"{row['wire_bytes'] / 1e6:.2f}",
            f"{row['expected_wire_bytes'] / 1e6:.2f}", "ok" if row["traffic_ok"] else "MISMATCH",
            *extra,
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [fmt(headers), fmt(["-" * w for w in widths])]
    out += [fmt(line) for line in lines]
    return "\n".join(out)


def breakdown_summary(rows: Sequence[dict[str, Any]], n: int, gather: str) -> str | None:
    """ring_psum against the sum of its parts, if ``--breakdown`` timed them.

    With ``gather="native"`` the parts are N-1 ppermute steps and the
    all_gather; with ``gather="ring"`` they are 2(N-1) ppermute steps.
    """
    by_name = {r["name"]: r for r in rows}
    if PERMUTE_STEP not in by_name or ALL_GATHER not in by_name:
        return None
    step, all_gather = by_name[PERMUTE_STEP]["seconds"], by_name[ALL_GATHER]["seconds"]
    ring, psum = by_name["ring"]["seconds"], by_name["psum"]["seconds"]
    if gather == "ring":
        parts = 2 * (n - 1) * step
        what = f"2(N-1) x one ppermute step {step * 1e3:.1f} ms"
    else:
        parts = (n - 1) * step + all_gather
        what = (f"(N-1) x one ppermute step {step * 1e3:.1f} ms + all_gather "
                f"{all_gather * 1e3:.1f} ms")
    text = (f"breakdown: ring_psum {ring * 1e3:.1f} ms = {ring / parts:.2f} x ({what} "
            f"= {parts * 1e3:.1f} ms); psum {psum * 1e3:.1f} ms")
    if REORDER in by_name:
        reorder = by_name[REORDER]["seconds"]
        text += (f"\n           Random's reorder alone {reorder * 1e3:.1f} ms "
                 f"({reorder / ring:.3f} of ring_psum)")
        if BESIDE in by_name and BESIDE_PIECES in by_name:
            text += "\n" + overlap_summary(step, reorder, by_name[BESIDE]["seconds"],
                                           by_name[BESIDE_PIECES]["seconds"])
    return text


def wire_of(row: dict[str, Any]) -> str:
    """A row's wire dtype (rows written before ``--comm-dtypes`` are float32)."""
    return row.get("comm_dtype", "float32")


def randomization_summary(rows: Sequence[dict[str, Any]]) -> str | None:
    """What Random SkipReduce costs over static at each k both modes ran.

    Args:
        rows: the rows of one size.

    Returns:
        One line (None without both modes at some k >= 1): the difference of
        the medians in ms and relative to static.
    """
    skip = {(r["mode"], r["num_skip"]): r["seconds"] for r in rows
            if r["kind"] == "skip" and wire_of(r) == "float32"}
    cells = []
    for (mode, k), static in skip.items():
        if mode != "static" or k == 0 or ("random", k) not in skip:
            continue
        extra = skip["random", k] - static
        cells.append(f"k={k} {extra * 1e3:+.1f} ms ({extra / static:+.1%})")
    return "random - static: " + ", ".join(cells) if cells else None


def wire_summary(rows: Sequence[dict[str, Any]]) -> str | None:
    """Each 16-bit-wire row against the same collective on a float32 wire.

    Args:
        rows: the rows of one size.

    Returns:
        One line (None without 16-bit rows): per row, its median time over
        the float32 row's and its bytes sent over the float32 row's.
    """
    wide = {(r["kind"], r["mode"], r["num_skip"]): r for r in rows
            if r["kind"] != "part" and wire_of(r) == "float32"}
    cells = []
    for r in rows:
        base = wide.get((r["kind"], r["mode"], r["num_skip"]))
        if wire_of(r) == "float32" or base is None:
            continue
        cells.append(f"{r['name']} {r['seconds'] / base['seconds']:.3f}x time, "
                     f"{r['wire_bytes'] / base['wire_bytes']:.3f}x bytes")
    return ("16-bit wire / float32 wire: " + "; ".join(cells)) if cells else None


def overlap_summary(step: float, reorder: float, one: float, pieces: float) -> str:
    """How much of the reorder hid behind the ppermute step in one program.

    Args:
        step: one ppermute step alone, in seconds.
        reorder: the reorder alone.
        one: both in one program, the reorder as one fusion.
        pieces: both, the reorder as independent fusions.

    Returns:
        One line: the times and the share of the reorder hidden, i.e.
        ``(step + reorder - together) / reorder`` (0: run one after the other,
        1: the reorder fully hidden).
    """
    def hidden(together: float) -> str:
        return f"{(step + reorder - together) / reorder:.0%}" if reorder > 0 else "-"

    return (f"overlap:   step + reorder run apart {(step + reorder) * 1e3:.1f} ms; in one "
            f"program {one * 1e3:.1f} ms (reorder hidden {hidden(one)}), with the reorder "
            f"in pieces {pieces * 1e3:.1f} ms (hidden {hidden(pieces)})")


def fmt_load(load: Sequence[float]) -> str:
    """Formats a load-average triple."""
    return "/".join(f"{v:.1f}" for v in load)


def plot(rows: Sequence[dict[str, Any]], n: int, path: Path, title: str) -> None:
    """Time vs k per size: static and random skip_psum, psum, ring, theory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    narrow = [r for r in rows if r["kind"] == "skip" and wire_of(r) != "float32"]
    rows = [r for r in rows if r["kind"] != "part" and wire_of(r) == "float32"]
    sizes = sorted({r["size"] for r in rows})
    cols = min(len(sizes), 4)
    nrows = -(-len(sizes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False)
    for ax, size in zip(axes.flat, sizes, strict=False):
        at = [r for r in rows if r["size"] == size]
        ring = next(r for r in at if r["kind"] == "ring")
        psum = next(r for r in at if r["kind"] == "psum")
        ks = np.arange(n)
        for mode, marker in (("static", "o"), ("random", "s")):
            pts = sorted((r for r in at if r["mode"] == mode), key=lambda r: r["num_skip"])
            if pts:
                k = [r["num_skip"] for r in pts]
                med = np.array([r["seconds"] for r in pts]) * 1e3
                err = np.array([[r["seconds"] - r["q25"], r["q75"] - r["seconds"]]
                                for r in pts]).T * 1e3
                ax.errorbar(k, med, yerr=err, marker=marker, capsize=3,
                            label=f"skip_psum {mode}")
        for (mode, dtype), marker in ((key, "^") for key in sorted(
                {(r["mode"], wire_of(r)) for r in narrow if r["size"] == size})):
            pts = sorted((r for r in narrow if r["size"] == size and r["mode"] == mode
                          and wire_of(r) == dtype), key=lambda r: r["num_skip"])
            ax.plot([r["num_skip"] for r in pts], [r["seconds"] * 1e3 for r in pts],
                    marker=marker, ls="-.", label=f"skip_psum {mode}, {dtype} wire")
        ax.axhline(psum["seconds"] * 1e3, color="k", ls=":", label="lax.psum")
        ax.axhline(ring["seconds"] * 1e3, color="gray", ls="--", label="ring_psum")
        theory = [ring["seconds"] * 1e3 * theory_ratio(n, k) for k in ks]
        ax.plot(ks, theory, color="tab:red", lw=1, label="ring x (2(N-1)-k)/(2(N-1))")
        ax.set_title(f"{format_count(size)} float32 / rank ({size * 4 / 2**20:.0f} MiB)")
        ax.set_xlabel("k (skipped reduce-scatter steps)")
        ax.set_ylabel("ms per call (median, IQR)")
        ax.set_xticks(ks)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(sizes):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.pieces < 1 or args.overlap_pieces < 1:
        raise SystemExit("--rounds, --pieces and --overlap-pieces must be >= 1 and --warmup >= 0")
    multiprocess = configure(args)

    import jax

    h = Harness(args.seed)
    leader = h.process == 0

    def log(message: str) -> None:
        if leader:
            print(message, flush=True)

    if h.n < 2:
        raise SystemExit(f"N = {h.n}: a ring needs at least 2 devices (--devices, or "
                         "more processes)")
    try:
        args.sizes = parse_sizes(args.sizes or (DEFAULT_SIZES if multiprocess
                                                else DEFAULT_SIZES_IN_PROCESS))
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--sizes: {e}") from None
    if min(args.sizes) < h.n:
        raise SystemExit(f"--sizes: every size must be at least N = {h.n} elements per "
                         "rank (one per ring chunk)")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    comm_dtypes = [d.strip() for d in args.comm_dtypes.split(",") if d.strip()]
    variants = make_variants(h.n, args.ks, modes, args.breakdown, comm_dtypes)
    setup = (f"{h.processes} process(es) x {jax.local_device_count()} device(s)"
             if multiprocess else f"{h.n} simulated CPU devices in one process")
    log(f"N = {h.n} ({setup}); {len(variants)} variants; sizes "
        f"{', '.join(format_count(s) for s in args.sizes)} float32 per rank; "
        f"{args.rounds} rounds after {args.warmup} warm-up calls; gather={args.gather}")

    meta: dict[str, Any] = {
        "n": h.n, "processes": h.processes, "local_devices": jax.local_device_count(),
        "mode": "multi-process" if multiprocess else "in-process",
        "sizes": args.sizes, "rounds": args.rounds, "warmup": args.warmup,
        "gather": args.gather, "seed": args.seed, "jax": jax.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "timing": "per call: barrier (tiny psum), then the call until block_until_ready; "
                  "the max over processes; median/IQR over interleaved rounds",
        "load_average_start": os.getloadavg(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "source": source_version(),
    }
    if args.meta:
        meta.update(json.loads(args.meta))
    src = meta["source"]
    log(f"skipreduce_jax {src['git_commit']} (source sha256 {src['skipreduce_jax_sha256']}"
        + (f", uncommitted: {', '.join(src['uncommitted'])}" if src["uncommitted"] else "")
        + ")")

    if not args.no_check:
        deviations = check_equal_to_psum(h, min(args.sizes), args.gather)
        meta["max_rel_deviation_from_psum"] = deviations
        log("check vs psum (max |diff| / max |psum|): " + ", ".join(
            f"{name} {dev:.1e}" for name, dev in deviations.items()))
        if any(dev > 1e-4 for dev in deviations.values()):
            log("ERROR: ring_psum or skip_psum k=0 differs from psum")
            return 1

    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        log(f"\n== {format_count(size)} float32 per rank ({size * 4 / 1e6:.1f} MB) ==")
        at = time_size(h, size, variants, args, log)
        rows += at
        log(format_table(at, (meta.get("network") or {}).get("rate_bit_per_s")))
        for summary in (randomization_summary(at), wire_summary(at),
                        breakdown_summary(at, h.n, args.gather)):
            if summary:
                log(summary)

    if not leader:
        return 0
    from skipreduce_jax.cost import Measurement

    meta["load_average_end"] = os.getloadavg()
    log(f"\nload average (1, 5, 15 min) at start {fmt_load(meta['load_average_start'])}, "
        f"at end {fmt_load(meta['load_average_end'])} on {os.cpu_count()} cores")
    measurements = [Measurement(n=h.n, num_skip=r["num_skip"], nbytes=r["nbytes"],
                                seconds=r["seconds"], kind=r["kind"]).to_dict()
                    for r in rows if r["kind"] != "part" and wire_of(r) == "float32"]
    tag = args.tag or (f"p{h.processes}x{jax.local_device_count()}" if multiprocess
                       else f"sim{h.n}")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"collectives_{tag}.json"
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows, "measurements": measurements}, f, indent=1)
        f.write("\n")
    print(f"\nwrote {json_path}", flush=True)
    bad = [r["name"] + f" @{format_count(r['size'])}" for r in rows if not r["traffic_ok"]]
    print("traffic check: " + ("every variant sends (2(N-1)-k)/N of its padded buffer"
                               " at its wire's width"
                               if not bad else f"MISMATCH for {', '.join(bad)}"), flush=True)
    if not args.no_plot:
        png_path = json_path.with_suffix(".png")
        title = f"N = {h.n}: {setup}"
        network = meta.get("network") or {}
        if "rate" in network:
            title += f"; emulated {network['rate']} links (tc tbf)"
        plot(rows, h.n, png_path, title)
        print(f"wrote {png_path}", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
