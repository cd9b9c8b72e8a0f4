"""Probes XLA:GPU scheduling annotations on the flat 1 x 8 SkipReduce step.

Compiled, not run (as ``benchmarks/pods.py``). XLA's latency-hiding
scheduler keeps the ops of one ``_scheduling_group_id`` together: a
collective's start, the compute annotated with the same id, then its done.
Here the id is set from JAX with ``jax.experimental.xla_metadata``: on ring
steps (``ppermute``) and all-gathers of chosen buckets, and on chosen
backward matmuls of the MLP (the op that produces a value's cotangent, by an
identity with a custom VJP). Ids must be integers, and a combined
collective joins its parts' ids ("0,4", refused): plans with several groups
need ``--no-combining``. Each plan prints ``benchmarks/pods.md``'s columns
for its variants: collectives, async, backward matmuls overlapped, bare,
memory, and how many group ids are left in the compiled HLO.

Run ``python benchmarks/pods_sched_probe.py [plan ...] [--option NAME=VALUE]``
in the environment of ``make check-pods`` (about 45 s a plan). Findings:
``benchmarks/pods.md``, "Flat SkipReduce (1 x 8)".
"""

from __future__ import annotations  # noqa: I001 (pods first: it sets the environment)

import argparse
import contextlib
import functools
import re
from collections.abc import Iterator, Sequence
from typing import Any

import pods  # benchmarks/pods.py (sets the compile-only environment first)

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

from skipreduce_jax._ring import ring as _ring

GROUP = "_scheduling_group_id"
LAYERS, WIDTH, PER_DEVICE, NUM_SKIP = 8, 2048, 64, 4
# Elements of compute that count as hiding a collective (benchmarks/pods.md).
HIDING_ELEMENTS = 64 * 1024


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def tag_cotangent(x: jax.Array, group: str) -> jax.Array:
    """The identity; the op that makes ``x``'s cotangent gets ``group``."""
    del group
    return x


def _tag_fwd(x, group):
    del group
    return x, None


def _tag_bwd(group, _, ct):
    return (set_xla_metadata(ct, **{GROUP: group}),)


tag_cotangent.defvjp(_tag_fwd, _tag_bwd)


def tagged_mlp(matmuls: dict[tuple[str, int], str]):
    """:func:`pods.mlp`, with ``("dX"|"dW", layer) -> group`` on backward matmuls."""

    def make(width: int, layers: int, bias: bool = True):
        _, shapes = _PLAIN_MLP(width, layers, bias)

        def loss_fn(params, batch):
            x, y = batch
            for i in range(layers):
                w = params[f"layer{i}"]["w"]
                if ("dW", i) in matmuls:
                    w = tag_cotangent(w, matmuls["dW", i])
                if ("dX", i) in matmuls:
                    x = tag_cotangent(x, matmuls["dX", i])
                x = x @ w
                x = x + params[f"layer{i}"]["b"] if bias else x
                x = jax.nn.relu(x) if i < layers - 1 else x
            return jnp.mean((x - y) ** 2)

        return loss_fn, shapes

    return make


_PLAIN_MLP = pods.mlp
_ORIGINAL = {"reduce_scatter": _ring.reduce_scatter, "shift": _ring._shift_right,
             "gather": _ring.all_gather_replicated}


@contextlib.contextmanager
def tagged_rings(collectives: dict[tuple[str, int, int], str], buckets: int
                 ) -> Iterator[None]:
    """Tags ``("cp", bucket, step)`` ring steps and ``("ag", bucket, 0)`` gathers.

    Buckets are counted in the order the step traces them (the plan's
    order: bucket 0 holds the biases, bucket i + 1 layer i's weight).
    """
    where = {"bucket": -1, "step": 0, "gathered": -1}

    def scope(key):
        group = collectives.get(key)
        return set_xla_metadata(**{GROUP: group}) if group else contextlib.nullcontext()

    def reduce_scatter(*args, **kwargs):
        where["bucket"] = (where["bucket"] + 1) % buckets
        where["step"] = 0
        return _ORIGINAL["reduce_scatter"](*args, **kwargs)

    def shift(x, axis_name, n):
        where["step"] += 1
        with scope(("cp", where["bucket"], where["step"])):
            return _ORIGINAL["shift"](x, axis_name, n)

    def gather(x, axis_name, **kwargs):
        where["gathered"] = (where["gathered"] + 1) % buckets
        with scope(("ag", where["gathered"], 0)):
            return _ORIGINAL["gather"](x, axis_name, **kwargs)

    _ring.reduce_scatter, _ring._shift_right = reduce_scatter, shift
    _ring.all_gather_replicated = gather
    try:
        yield
    finally:
        _ring.reduce_scatter = _ORIGINAL["reduce_scatter"]
        _ring._shift_right = _ORIGINAL["shift"]
        _ring.all_gather_replicated = _ORIGINAL["gather"]


def compile_plan(plan: dict[tuple, str], compiler_options: dict | None = None) -> Any:
    """The 1 x 8 SkipReduce step of pods.md with the groups of ``plan``."""
    matmuls = {k: v for k, v in plan.items() if k[0] in ("dX", "dW")}
    rings = {k: v for k, v in plan.items() if k[0] in ("cp", "ag")}
    pods.mlp = tagged_mlp(matmuls)
    try:
        with tagged_rings(rings, buckets=LAYERS + 1):
            return pods.compile_skipreduce_step(
                pods.gpu_mesh(1, 8), NUM_SKIP, width=WIDTH, layers=LAYERS,
                per_device=PER_DEVICE, compiler_options=compiler_options, min_size=0)
    finally:
        pods.mlp = _PLAIN_MLP


def counts(compiled: Any) -> dict[str, Any]:
    """pods.md's columns for one compiled step, and the groups that survived."""
    mesh = pods.gpu_mesh(1, 8)
    s = pods.schedule("1 x 8 H100", "probe", compiled, mesh)
    ops = [c for c in s.collectives if c.bytes_per_device >= pods.MIN_LISTED_BYTES]
    live = [c for c in ops if c.asynchronous and not c.is_sync]
    hidden = {i.name for c in live for i in c.overlap
              if i.matmul and i.phase == "backward"}
    bare = [c for c in ops if not (c.asynchronous and not c.is_sync)
            or not any(i.elements > HIDING_ELEMENTS for i in c.overlap)]
    text = compiled.as_text()
    grouped = sorted({m for m in re.findall(GROUP + r'="([^"]*)"', text)})
    return {"collectives": len(ops), "async": f"{len(live)}/{len(ops)}",
            "bwd matmuls": f"{len(hidden)}/{s.backward_matmuls}",
            "bare": f"{len(bare)}/{len(ops)}",
            "memory MiB": round(s.memory / 2**20, 1), "groups left": len(grouped)}


def _weights(layer: int) -> int:
    return layer + 1  # bucket of a layer's weight (bucket 0: the biases)


def _sliding() -> dict[tuple, str]:
    """Bucket L's 3 ring steps under the 3 matmuls after dW_L (dX_L, dW_L-1, dX_L-1).

    Groups are numbered by their matmul (ids must be integers); the group
    of dX_L-1 also holds the first step of bucket L-1.
    """
    plan: dict[tuple, str] = {}
    for layer in range(LAYERS - 1, 0, -1):
        b = _weights(layer)
        # The batch (layer 0's input) has no cotangent.
        after = [("dX", layer), ("dW", layer - 1), ("dX", layer - 1)][:3 if layer > 1 else 2]
        for step, matmul in enumerate(after, start=1):
            group = str(2 * matmul[1] + (matmul[0] == "dW"))
            plan[matmul] = group
            plan["cp", b, step] = group
    return plan


PLANS: dict[str, dict[tuple, str]] = {
    "none": {},
    # Q1: does one group reach the compiled start/done and the gemm?
    "one-group": {("cp", _weights(7), 1): "1", ("dX", 7): "1"},
    # The last layer's ring under the first three dX matmuls.
    "last-under-dX": {("cp", _weights(7), s): str(s) for s in (1, 2, 3)}
    | {("dX", 8 - s): str(s) for s in (1, 2, 3)},
    "sliding": _sliding(),
}


def _value(text: str) -> bool | int | str:
    if text in ("true", "false"):
        return text == "true"
    return int(text) if text.lstrip("-").isdigit() else text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="*", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--option", action="append", default=[],
                        help="an XLA option NAME=VALUE, passed to compile()")
    parser.add_argument("--no-combining", action="store_true",
                        help="add pods.NO_COMBINING (a combined collective joins the "
                        "ids of its parts, which XLA refuses)")
    parser.add_argument("--dump", default=None, help="write each compiled HLO here")
    args = parser.parse_args(argv)
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.option)} or None
    if args.no_combining:
        options = (options or {}) | pods.NO_COMBINING["gpu"]
    for name in args.plans:
        compiled = compile_plan(PLANS[name], options)
        if args.dump:
            with open(f"{args.dump}/{name}.hlo", "w") as f:
                f.write(compiled.as_text())
        print(name, counts(compiled), flush=True)


if __name__ == "__main__":
    main()
