"""Utilities shared by the examples: simulated devices, the mesh, tables.

Import this module before ``jax``: :func:`simulate_cpu_devices` only takes
effect if it runs before JAX initialises its backends.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
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


def data_mesh(axis_name: str = "data", *, auto: bool = False) -> Any:
    """A 1-D data-parallel mesh over the real devices, or simulated CPU ones.

    With more than one device of the default platform (GPUs, TPUs, or
    simulated CPU devices), all of them are used; with a single accelerator,
    the simulated CPU devices are used instead.

    Args:
      axis_name: the name of the mesh axis.
      auto: an Auto axis (``jax.sharding.AxisType.Auto``) instead of
        ``jax.make_mesh``'s Explicit one.

    Returns:
      A ``jax.sharding.Mesh`` with one axis.
    """
    import jax  # after simulate_cpu_devices()

    devices = jax.devices()
    if len(devices) == 1:
        devices = jax.devices("cpu")
    types = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,)
    return jax.make_mesh((len(devices),), (axis_name,), devices=devices,
                         axis_types=types)


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


def parse_config(default: Any, argv: Sequence[str] | None, description: str, *,
                 variants: Sequence[str], helps: Mapping[str, str] | None = None
                 ) -> tuple[Any, argparse.ArgumentParser]:
    """A frozen dataclass of settings, one ``--option`` per field.

    Every field but ``variants`` becomes an option of its default's type
    (``batch_per_rank``: ``--batch-per-rank``) and must not be negative;
    ``variants`` is a comma-separated subset of ``variants``.

    Args:
      default: the dataclass instance holding the defaults.
      argv: the arguments (default: ``sys.argv[1:]``).
      description: the ``--help`` text's first line.
      variants: the names ``--variants`` may list.
      helps: help text by field name.

    Returns:
      The settings, and the parser (for ``parser.error`` on further checks).
    """
    helps = helps or {}
    parser = argparse.ArgumentParser(
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in dataclasses.fields(default):
        flag, value = "--" + field.name.replace("_", "-"), getattr(default, field.name)
        if field.name == "variants":
            parser.add_argument(flag, default=",".join(value),
                                help=f"comma-separated subset of {','.join(variants)}")
        else:
            parser.add_argument(flag, type=type(value), default=value,
                                help=helps.get(field.name))
    values = vars(parser.parse_args(argv))
    chosen = tuple(v.strip() for v in values["variants"].split(",") if v.strip())
    if not chosen or set(chosen) - set(variants):
        parser.error(f"--variants: choose from {','.join(variants)}")
    for name, value in values.items():
        if name != "variants" and not isinstance(value, str) and value < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0")
    return dataclasses.replace(default, **{**values, "variants": chosen}), parser
