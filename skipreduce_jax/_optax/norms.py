"""BatchNorm under skipping: which leaves belong to a norm, and the warning.

Skipped leaves that feed a BatchNorm random-walk (``benchmarks/convergence.md``);
``skip_reduce``'s ``exact_radial`` removes the drift.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import jax

# flax.linen's module names (BatchNorm_0, ...); NNX layers are known by type.
_BATCHNORM = re.compile(r"BatchNorm")

class BatchNormWarning(UserWarning):
    """Skipping may reach leaves that feed a BatchNorm (see ``skip_reduce``)."""


def _keys(path: tuple[Any, ...]) -> tuple[Any, ...]:
    """A tree path as plain keys: dict keys, sequence indices, attribute names."""
    out = []
    for entry in path:
        for name in ("key", "idx", "name"):
            if hasattr(entry, name):
                out.append(getattr(entry, name))
                break
    return tuple(out)


def in_batchnorm(tree: Any, known: Sequence[tuple[Any, ...]] | None = None) -> list[bool]:
    """Per leaf of ``tree``: is it a parameter of a BatchNorm layer?

    ``known``: the layers' paths, e.g. ``[("bn",)]`` (NNX's, found by type);
    None: linen's names.
    """
    flags = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if known is None:
            flags.append(bool(_BATCHNORM.search(jax.tree_util.keystr(path))))
        else:
            keys = _keys(path)
            flags.append(any(keys[:len(p)] == tuple(p) for p in known))
    return flags


def warn_if_batchnorm(tree: Any, skippable: Sequence[bool], *, api: str,
                      known: Sequence[tuple[Any, ...]] | None = None) -> bool:
    """Warns, returning True, if ``tree`` has BatchNorm leaves and a ``skippable`` other."""
    norm = in_batchnorm(tree, known)
    if not any(norm):
        return False
    paths = [jax.tree_util.keystr(p)
             for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    fed = [p for p, n, s in zip(paths, norm, skippable) if s and not n]
    if not fed:
        return False
    example = next(p for p, n in zip(paths, norm) if n)
    shown = ", ".join(fed[:3]) + (f" and {len(fed) - 3} more" if len(fed) > 3 else "")
    warnings.warn(
        f"{api}: the params hold BatchNorm parameters ({example}) and may skip "
        f"{shown} with exact_radial=False and without error feedback. If a "
        "BatchNorm averages its batch "
        "statistics over the data axis (axis_name=...), the skipped leaves that "
        "feed it random-walk (their summed gradient is zero along its bias and "
        "scale) and evaluation with the running statistics degrades. Leave "
        "exact_radial at its default (or pass True), or pass "
        "error_feedback=True, or selective=skipreduce_jax.exclude(...) naming "
        "the layers that feed a BatchNorm, or use per-rank statistics "
        "(BatchNorm without axis_name). If no skipped leaf feeds a BatchNorm, "
        "silence this with warnings.filterwarnings('ignore', "
        "category=skipreduce_jax.BatchNormWarning).",
        BatchNormWarning, stacklevel=3)
    return True
