"""Which leaves ``skip_reduce`` may skip: ``selective``, ``by_path``, ``exclude``.

A leaf is skipped only when ``selective`` allows it and it has at least
``min_size`` elements; every other leaf gets a full all-reduce. The flags are
Python bools, known at trace time, so each choice compiles to its own program.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_API = "skip_reduce"


class UnmatchedPatternWarning(UserWarning):
    """An :func:`exclude` pattern matches no leaf path, so it excludes nothing."""


class PathSelector:
    """Selects leaves by their tree path: ``predicate(path, leaf) -> bool``.

    ``path`` is ``jax.tree_util.keystr`` of the leaf's path, for example
    ``"['params']['Embed_0']['embedding']"``. True allows skipping.
    """

    def __init__(self, predicate: Callable[[str, Any], bool]):
        self.predicate = predicate

    def __call__(self, tree: Any) -> Any:
        def flag(path, leaf):
            path = jax.tree_util.keystr(path)
            value = self.predicate(path, leaf)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(
                    f"{_API}: the selective predicate returned {value!r} for "
                    f"{path}; it must return a bool (True: skipping allowed), "
                    "e.g. bool(re.search(...)).")
            return bool(value)

        return jax.tree_util.tree_map_with_path(flag, tree)


def by_path(predicate: Callable[[str, Any], bool]) -> PathSelector:
    """A ``selective`` argument that decides from each leaf's path.

    Args:
      predicate: ``(path: str, leaf) -> bool``; True allows skipping.

    Returns:
      A selector applied to the gradient tree (no params needed).

    Example:
      >>> from skipreduce_jax import by_path
      >>> sel = by_path(lambda path, leaf: "embed" not in path.lower())
      >>> sel({"embed": 1.0, "dense": 2.0})
      {'dense': True, 'embed': False}
    """
    return PathSelector(predicate)


def exclude(*patterns: str) -> PathSelector:
    """Full all-reduce for leaves whose path matches any regex in ``patterns``.

    A pattern that matches no path of the tree it is applied to warns
    (:class:`UnmatchedPatternWarning`), listing a few of the paths.

    Args:
      *patterns: regular expressions searched in the path string, e.g.
        ``"Embed"``, ``"Conv_0"``.

    Returns:
      A ``selective`` argument for ``skip_reduce``.

    Raises:
      ValueError: if a pattern is not a valid regular expression.

    Example:
      >>> from skipreduce_jax import exclude
      >>> exclude("Embed")({"Embed_0": 1.0, "Dense_0": 2.0})
      {'Dense_0': True, 'Embed_0': False}
    """
    return _Excluded([_compile(p) for p in patterns])


def _compile(pattern: Any) -> re.Pattern:
    if not isinstance(pattern, (str, re.Pattern)):
        raise TypeError(f"exclude: pattern {pattern!r} must be a str (a regular "
                        "expression searched in each leaf's path).")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(
            f"exclude: pattern {pattern!r} is not a valid regular expression ({e}). "
            "Fix the regex, or pass re.escape(text) to match text literally.") from None


class _Excluded(PathSelector):
    """:func:`exclude`'s selector: warns about patterns that match no path."""

    def __init__(self, compiled: list[re.Pattern]):
        self.compiled = compiled
        super().__init__(lambda path, leaf: not any(c.search(path) for c in compiled))

    def __call__(self, tree: Any) -> Any:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
        unmatched = [c.pattern for c in self.compiled if not any(c.search(p) for p in paths)]
        if paths and unmatched:
            shown = ", ".join(paths[:4]) + (f", ... ({len(paths)} leaves)"
                                            if len(paths) > 4 else "")
            warnings.warn(
                f"exclude: no leaf path matches {', '.join(map(repr, unmatched))}, "
                f"which excludes nothing; the paths are {shown}. Fix the pattern "
                "(a regex searched in each path) or drop it.",
                UnmatchedPatternWarning, stacklevel=2)
        return super().__call__(tree)


def check_selective(selective: Any, *, api: str = _API) -> Any:
    """Refuses a ``selective`` pytree without entries (at construction)."""
    if selective is not None and not callable(selective) and not \
            jax.tree_util.tree_leaves(selective):
        raise ValueError(f"{api}: selective={selective!r} has no entries.")
    return selective


def needs_params(selective: Any) -> bool:
    """Whether ``selective`` is a callable of the params (not a path selector)."""
    return callable(selective) and not isinstance(selective, PathSelector)


def skippable(selective: Any, min_size: int, updates: Any, params: Any) -> list[bool]:
    """One Python bool per leaf of ``updates`` (in ``tree_leaves`` order): may it be skipped.

    ``selective``: None (every leaf), a pytree (or prefix) of bools, a callable
    of ``params``, or a :class:`PathSelector`; leaves under ``min_size`` never are.
    """
    leaves = jax.tree_util.tree_leaves(updates)
    if selective is None:
        flags = [True] * len(leaves)
    else:
        if isinstance(selective, PathSelector):
            mask = selective(updates)
        elif callable(selective):
            if params is None:
                raise ValueError(
                    f"{_API}: selective is a callable of params, but update() got "
                    "params=None. Call tx.update(grads, state, params) (optax.chain "
                    "passes them through), or use skipreduce_jax.by_path(...) which "
                    "needs no params.")
            mask = selective(params)
        else:
            mask = selective
        try:
            mask = jax.tree_util.tree_map(
                lambda m, sub: jax.tree_util.tree_map(lambda _: m, sub),
                mask, updates)
        except ValueError as e:
            raise ValueError(
                f"{_API}: selective does not match the gradient tree: it "
                "must have the same structure (or a prefix of it) with a "
                f"bool per leaf. {e}") from e
        flags = jax.tree_util.tree_leaves(mask)
        for flag in flags:
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(
                    f"{_API}: selective gave {flag!r}; every entry must be a "
                    "Python bool (True: skipping allowed, False: full "
                    "all-reduce), known at trace time.")
    return [bool(f) and math.prod(np.shape(leaf)) >= min_size for f, leaf in zip(flags, leaves)]
