"""Saving and resuming a data-parallel run with orbax-checkpoint.

A checkpoint holds the params and the whole optimizer state, including each
:class:`~skipreduce_jax.SkipReduceState` (step count, key data, settings
fingerprint, error-feedback residuals one row per rank). Resuming from it
continues the run exactly as if it had never stopped::

    save(ckpt_dir, step, params, opt_state)
    ...
    # A new process: same tx, same mesh.
    params = replicate(init_params(), mesh)
    opt_state = init_opt_state(tx, params, mesh, "data")
    step, params, opt_state = restore(ckpt_dir, params_like=params,
                                      opt_state_like=opt_state)

In a multi-process run every process calls :func:`save` and :func:`restore`
with the same directory, on a file system all of them see. Requires
``orbax-checkpoint`` (``pip install skipreduce_jax[checkpoint]``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from skipreduce_jax import _checks as checks
from skipreduce_jax._optax.per_rank import per_rank_names
from skipreduce_jax._optax.transform import SkipConfig, SkipReduceState
from skipreduce_jax._types import PyTree

__all__ = ["latest_step", "restore", "save"]

# Checkpoint items: two array trees and a small JSON record of the
# skip_reduce settings, read (and checked) before any array is loaded.
_PARAMS = "params"
_OPT_STATE = "opt_state"
_SETTINGS = "skip_reduce"


def _manager(directory: str | os.PathLike[str], *, create: bool,
             max_to_keep: int | None = None) -> ocp.CheckpointManager:
    path = os.path.abspath(os.fspath(directory))
    if not create and not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist.")
    options = ocp.CheckpointManagerOptions(create=create, max_to_keep=max_to_keep,
                                           enable_async_checkpointing=False)
    handlers = {_PARAMS: ocp.StandardCheckpointHandler(),
                _OPT_STATE: ocp.StandardCheckpointHandler(),
                _SETTINGS: ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


def _skip_states(opt_state: Any) -> list[tuple[str, SkipReduceState]]:
    """Every SkipReduceState in ``opt_state`` with its path, in tree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda n: isinstance(n, SkipReduceState))
    return [(jax.tree_util.keystr(path), node) for path, node in flat
            if isinstance(node, SkipReduceState)]


def _without_empty(tree: Any) -> Any:
    """``tree`` with zero-size leaves (which orbax refuses) replaced by None."""
    return jax.tree_util.tree_map(lambda x: None if np.size(x) == 0 else x, tree)


def _with_empty(restored: Any, like: Any) -> Any:
    """Puts back the zero-size leaves of ``like`` that ``_without_empty`` left out."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    stored = iter(jax.tree_util.tree_leaves(restored))

    def empty(x):
        value = np.zeros(np.shape(x), x.dtype)
        return jax.make_array_from_callback(value.shape, x.sharding, lambda index: value[index])

    return jax.tree_util.tree_unflatten(
        treedef, [empty(x) if np.size(x) == 0 else next(stored) for x in leaves])


def _residual_shapes(state: SkipReduceState) -> list[list[int]]:
    """The shapes of the per-rank leaves: the error-feedback residuals."""
    return [list(np.shape(x)) for x in jax.tree_util.tree_leaves(state.residual)]


def _rows(state: SkipReduceState) -> int | None:
    """The ranks the per-rank leaves hold rows for (None: there are none)."""
    shapes = _residual_shapes(state)
    return int(shapes[0][0]) if shapes else None


def _value(leaf: Any) -> int | None:
    """A scalar's value, read from this process's copy; None if abstract."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return None
    if isinstance(leaf, jax.Array):
        leaf = leaf.addressable_data(0)
    return int(np.asarray(leaf))


def _settings(opt_state: Any) -> dict[str, Any]:
    return {"skip_reduce": [
        {"path": path, "fields": list(SkipReduceState._fields),
         "fingerprint": _value(state.fingerprint), "residual_rows": _rows(state),
         "residual_shapes": _residual_shapes(state)}
        for path, state in _skip_states(opt_state)]}


def save(directory: str | os.PathLike[str], step: int, params: PyTree, opt_state: PyTree, *,
         max_to_keep: int | None = None) -> None:
    """Writes ``params`` and ``opt_state`` as checkpoint ``step``.

    Blocks until the checkpoint is complete on disk, so the caller may
    donate or overwrite the arrays right after. Every process of a
    multi-process run must call it, with the same arguments.

    Args:
      directory: the checkpoint directory (created if missing); step
        ``step`` goes into its subdirectory ``str(step)``.
      step: the training step, a non-negative int larger than every step
        already saved there.
      params: the params (e.g. replicated on the mesh).
      opt_state: the optimizer state, as :func:`skipreduce_jax.init_opt_state`
        and the train step place it (residuals sharded over the data axis).
      max_to_keep: keep only this many newest checkpoints (None: all).

    Raises:
      TypeError: if ``step`` is not an int (7.9 would be written as 7).
      ValueError: if ``step`` is negative (no step of a directory lists
        it) or not newer than the latest saved step.

    Example:
      >>> from skipreduce_jax.checkpoint import save
      >>> save("/tmp/run1", 100, params, opt_state)  # doctest: +SKIP
    """
    step = checks.check_int(step, "step", api="checkpoint.save", minimum=0,
                            what="(the training step, as the directory's subdirectory name)")
    with _manager(directory, create=True, max_to_keep=max_to_keep) as manager:
        latest = manager.latest_step()
        saved = manager.save(step, args=ocp.args.Composite(**{
            _PARAMS: ocp.args.StandardSave(_without_empty(params)),
            _OPT_STATE: ocp.args.StandardSave(_without_empty(opt_state)),
            _SETTINGS: ocp.args.JsonSave(_settings(opt_state)),
        }))
        manager.wait_until_finished()
    if not saved:
        raise ValueError(
            f"checkpoint step {step} was not saved: {os.fspath(directory)!r} already holds "
            f"step {latest}, and steps must increase. Use a new directory or a larger step.")


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete checkpoint step in ``directory``, or None.

    It only lists the directory (no synchronization between processes), so
    any process may call it alone, e.g. process 0 to log the step.
    """
    if not os.path.isdir(os.fspath(directory)):
        return None
    # Finalized step directories named as save names them (str(step)), the
    # only ones restore reads (orbax would also count e.g. "backup_9").
    steps = [int(path.name) for path in ocp.utils.checkpoint_steps_paths(os.fspath(directory))
             if path.name.isdigit()]
    return max(steps) if steps else None


def _abstract(tree: Any, name: str) -> Any:
    """ShapeDtypeStructs with each leaf's sharding: the restore target."""

    def leaf(path, x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(
                f"restore: {name}{jax.tree_util.keystr(path)} has no sharding (got "
                f"{type(x).__name__}). Pass arrays placed on the mesh (skipreduce_jax.replicate "
                "/ init_opt_state) or jax.ShapeDtypeStruct(shape, dtype, sharding=...).")
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, tree)


# The settings the fingerprint compares: all of skip_reduce's but these.
_NOT_COMPARED = ("seed", "selective", "verify_sync")
_COMPARED = ["axis_name", "inner_axis"] + [
    f.name for f in dataclasses.fields(SkipConfig) if f.name not in _NOT_COMPARED]
_COMPARED_SETTINGS = f"{', '.join(_COMPARED[:-1])} and {_COMPARED[-1]}"


def _key_name(key: Any) -> str:
    """One step of a tree path, as orbax's metadata tree and ours both name it."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """Each leaf's shape and its path written out, keyed by its path's names."""
    return {tuple(map(_key_name, path)): (tuple(getattr(leaf, "shape", ())),
                                          jax.tree_util.keystr(path))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_arrays(saved: Any, target: Any, name: str, step: int,
                  per_rank: dict[tuple[str, ...], str], fix: str) -> None:
    """Refuses a ``target`` whose leaves or shapes are not those of ``saved`` (orbax metadata).

    ``per_rank`` names the per-rank field of each per-rank leaf, by path; ``fix`` ends the message.
    """
    saved = _shapes(getattr(saved, "tree", saved))
    ours = _shapes(target)
    problems = []
    for path, (shape, where) in ours.items():
        if path not in saved:
            problems.append(f"{name}{where} is not in the checkpoint")
            continue
        stored = saved[path][0]
        if stored == shape:
            continue
        field = per_rank.get(path)
        if field and stored[1:] == shape[1:]:
            raise ValueError(
                f"restore: {name}{where} is per-rank state ({field}, one row per rank): "
                f"checkpoint step {step} has rows for {stored[0]} ranks, {name} for "
                f"{shape[0]}. Per-rank state cannot be split again: resume on the same number "
                f"of data-parallel ranks, with {name} built by skipreduce_jax.init_opt_state.")
        problems.append(f"{name}{where} has shape {shape}, the checkpoint {stored}")
    problems += [f"the checkpoint holds {where}, which {name} lacks"
                 for path, (_, where) in saved.items() if path not in ours]
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ValueError(
            f"restore: checkpoint step {step} does not fit {name}: "
            f"{'; '.join(problems[:4])}{more}. {fix}")


def _read(manager: ocp.CheckpointManager, step: int, directory: Any,
          what: str, **items: Any) -> Any:
    """``manager.restore`` of ``items``, with errors that name the fix."""
    try:
        return manager.restore(step, args=ocp.args.Composite(**items))
    except KeyError as e:
        raise FileNotFoundError(
            f"restore: checkpoint step {step} in {os.fspath(directory)!r} has no {what} "
            f"({e.args[0] if e.args else e}): it was not written by "
            "skipreduce_jax.checkpoint.save, or a part of it was deleted. Restore another step "
            "(step=...).") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"restore: the {what} of checkpoint step {step} in {os.fspath(directory)!r} is "
            f"damaged (not valid JSON: {e}). Restore another step (step=...).") from None
    except ValueError as e:
        raise _unreadable(e, what, step, directory) from None


def _unreadable(error: Exception, what: str, step: int, directory: Any) -> ValueError:
    """The error for files orbax or tensorstore could not read."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ValueError(
        f"restore: the {what} of checkpoint step {step} in {os.fspath(directory)!r} could not "
        f"be read ({first[:300]}): its files are damaged or incomplete. Restore another step "
        "(step=...).")


def _check_settings(saved: dict[str, Any], opt_state_like: Any, step: int) -> None:
    """Refuses a checkpoint whose skip_reduce settings differ from the tx's."""
    saved_states = saved["skip_reduce"]
    like_states = _skip_states(opt_state_like)
    if len(saved_states) != len(like_states):
        raise ValueError(
            f"restore: checkpoint step {step} holds {len(saved_states)} skip_reduce state(s) "
            f"but opt_state_like holds {len(like_states)}: the optimizer is built differently.")
    ours = list(SkipReduceState._fields)
    for entry, (path, state) in zip(saved_states, like_states, strict=True):
        where = f"opt_state{path}"
        fields = entry.get("fields")
        if fields != ours:
            written = ("an earlier version, whose state also held the fields of the retired "
                       "control_variate and monitor options" if fields is None else
                       f"a version whose state has the fields {fields}")
            raise ValueError(
                f"restore: the skip_reduce state at {where} of checkpoint step {step} was "
                f"written by {written}; this version's SkipReduceState has {ours}. Resume it "
                "with the version that wrote it, or start a new run.")
        want = _value(state.fingerprint)
        if want is not None and entry["fingerprint"] != want:
            raise ValueError(
                f"restore: the skip_reduce settings of checkpoint step {step} (fingerprint "
                f"{entry['fingerprint']:#010x} at {where}) differ from those of the optimizer "
                f"in opt_state_like (fingerprint {want:#010x}). Build skip_reduce with the "
                f"same {_COMPARED_SETTINGS} as the run that saved it.")
        rows = _rows(state)
        if entry["residual_rows"] != rows:
            raise ValueError(
                f"restore: checkpoint step {step} has per-rank rows (error-feedback residuals) "
                f"for {entry['residual_rows']} ranks at {where}, opt_state_like for {rows}. "
                "They are per rank: resume on the same number of data-parallel ranks, with "
                "opt_state_like built by skipreduce_jax.init_opt_state (tx.init alone makes "
                "one row).")
        shapes = _residual_shapes(state)
        if entry.get("residual_shapes", shapes) != shapes:
            raise ValueError(
                f"restore: the per-rank rows of checkpoint step {step} at {where} have shapes "
                f"{entry['residual_shapes']}, those of opt_state_like {shapes}: the leaves "
                "skipped differ (selective or min_size changed, or other params). Build "
                "skip_reduce with the selective and min_size of the run that saved it.")


def restore(directory: str | os.PathLike[str], *, params_like: PyTree, opt_state_like: PyTree,
            step: int | None = None) -> tuple[int, Any, Any]:
    """Reads a checkpoint written by :func:`save`.

    Each restored array gets the shape, dtype and sharding of the matching
    leaf of ``params_like`` / ``opt_state_like`` (replicated params on every
    device, each residual row back on its own rank's device), and the trees
    keep their structure (NamedTuples, ``optax.EmptyState``). Every process
    of a multi-process run must call it, with the same arguments.

    Args:
      directory: the checkpoint directory given to :func:`save`.
      params_like: params placed as the run wants them (their values are
        not used), or ``jax.ShapeDtypeStruct`` leaves with a sharding.
      opt_state_like: the state of a fresh
        :func:`skipreduce_jax.init_opt_state` with the optimizer to resume
        (or ShapeDtypeStructs with shardings; then the fingerprint check
        below is skipped).
      step: the step to read; None reads the latest.

    Returns:
      ``(step, params, opt_state)``.

    Raises:
      FileNotFoundError: if the directory or the step does not exist, or a
        part of the step (an item) is missing.
      ValueError: if a ``skip_reduce`` state's settings fingerprint, residual
        rows (ranks) or residual shapes differ from ``opt_state_like``'s; if
        ``params_like`` or ``opt_state_like`` has other leaves or shapes than
        the checkpoint (each named by path); if the step's files are damaged.

    Example:
      >>> from skipreduce_jax.checkpoint import restore
      >>> step, params, opt_state = restore(
      ...     "/tmp/run1", params_like=params, opt_state_like=opt_state)
      ...     # doctest: +SKIP
    """
    params_target = _abstract(params_like, "params_like")
    opt_target = _abstract(opt_state_like, "opt_state_like")
    with _manager(directory, create=False) as manager:
        if step is None:
            step = manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {os.fspath(directory)!r}.")
        step = checks.check_int(step, "step", api="checkpoint.restore", minimum=0,
                                allow_none=True)
        if step not in manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint step {step} in {os.fspath(directory)!r} "
                f"(steps: {list(manager.all_steps())}).")
        saved = _read(manager, step, directory, "skip_reduce settings record",
                      **{_SETTINGS: ocp.args.JsonRestore()})[_SETTINGS]
        if not isinstance(saved, dict) or not isinstance(saved.get("skip_reduce"), list):
            raise ValueError(
                f"restore: the skip_reduce settings record of checkpoint step {step} in "
                f"{os.fspath(directory)!r} is damaged (no 'skip_reduce' list). Restore another "
                "step (step=...).")
        _check_settings(saved, opt_state_like, step)
        targets = {_PARAMS: _without_empty(params_target),
                   _OPT_STATE: _without_empty(opt_target)}
        try:
            metadata = manager.item_metadata(step)
        except ValueError as e:
            raise _unreadable(e, "arrays", step, directory) from None
        stored = {item: metadata.get(item) for item in targets}
        for item, tree in stored.items():
            if tree is None:
                raise FileNotFoundError(
                    f"restore: checkpoint step {step} in {os.fspath(directory)!r} has no "
                    f"{item} arrays: a part of it was deleted or never written. Restore "
                    "another step (step=...).")
        ranks = {tuple(map(_key_name, path)): field for path, field in
                 jax.tree_util.tree_flatten_with_path(per_rank_names(opt_state_like))[0]
                 if field}
        _check_arrays(stored[_PARAMS], targets[_PARAMS], "params_like", step, {},
                      "Pass params_like built like the params of the run that saved it (the "
                      "same model and shapes).")
        _check_arrays(stored[_OPT_STATE], targets[_OPT_STATE], "opt_state_like", step, ranks,
                      "Build opt_state_like with the optimizer of the run that saved it (the "
                      "same chain, MultiSteps and settings), with skipreduce_jax.init_opt_state.")
        restored = _read(manager, step, directory, "arrays", **{
            item: ocp.args.StandardRestore(target) for item, target in targets.items()})
    return (step, _with_empty(restored[_PARAMS], params_target),
            _with_empty(restored[_OPT_STATE], opt_target))
