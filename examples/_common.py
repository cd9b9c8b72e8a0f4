"""Utilities shared by the examples: simulated devices, the mesh, tables.

Import this module before ``jax``: :func:`simulate_cpu_devices` only takes
effect if it runs before JAX initialises its backends.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(n: int = 8) -> None:
    """Asks XLA for ``n`` host (CPU) devices unless the count is already set.

    The flag only affects the CPU platform: on a machine with accelerators JAX
    still prefers them, and :func:`data_mesh` uses them when there are several.

    Args:
      n: the number of simulated CPU devices.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if _DEVICE_FLAG not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def data_mesh(axis_name: str = "data") -> Any:
    """A 1-D data-parallel mesh over the real devices, or simulated CPU ones.

    With more than one device of the default platform (GPUs, TPUs, or
    simulated CPU devices), all of them are used; with a single accelerator,
    the simulated CPU devices are used instead.

    Args:
      axis_name: the name of the mesh axis.

    Returns:
      A ``jax.sharding.Mesh`` with one axis.
    """
    import jax  # after simulate_cpu_devices()

    devices = jax.devices()
    if len(devices) == 1:
        devices = jax.devices("cpu")
    return jax.make_mesh((len(devices),), (axis_name,), devices=devices)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Formats rows as a plain-text table: first column left, others right.

    Args:
      headers: the column titles.
      rows: one sequence of already formatted cells per row.

    Returns:
      The table, lines joined by newlines (no trailing newline).
    """
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = (c.rjust(w) for c, w in zip(row[1:], widths[1:]))
        return "  ".join([first, *rest])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])
