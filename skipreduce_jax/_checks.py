"""Argument checks, one place for every public function.

Each check names the function (``api``), the argument, what was passed and
what is allowed, and returns the value as a plain Python type, so that equal
settings compare (and fingerprint) equal. Booleans are never accepted as
ints, nor ints as booleans. The checks share their arguments: ``value`` is
what the caller passed, ``name`` the argument's name, and ``api`` the
public function, named first in the message.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _prefix(api: str | None) -> str:
    return f"{api}: " if api else ""


def check_bool(value: Any, name: str, *, api: str | None = None,
               meaning: str = "") -> bool:
    """``bool(value)``; refuses anything that is not a (numpy) bool.

    ``meaning``: what True means, e.g. ``"True: multiply by N / (N - k)"``.
    """
    if not isinstance(value, (bool, np.bool_)):
        extra = f" ({meaning})" if meaning else ""
        raise TypeError(f"{_prefix(api)}{name}={value!r} must be a bool{extra}.")
    return bool(value)


def check_int(value: Any, name: str, *, api: str | None = None,
              minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False,
              type_error: type[Exception] = TypeError,
              allowed: str = "", what: str = "") -> int | None:
    """``int(value)`` (a Python or numpy integer) in ``[minimum, maximum]``.

    A bound of None is no bound; ``allow_none`` accepts None. A non-int
    raises ``type_error``, a value out of range ValueError. ``allowed``:
    what the message allows (default from the bounds); ``what``: appended.
    """
    if value is None and allow_none:
        return None
    ok = not isinstance(value, (bool, np.bool_))
    if ok:
        try:
            number = operator.index(value)
        except TypeError:
            ok = False
    in_range = ok and (minimum is None or number >= minimum) and (
            maximum is None or number <= maximum)
    if in_range:
        return int(number)
    if not allowed:
        allowed = (f"an int in [{minimum}, {maximum}]" if None not in (minimum, maximum)
                   else {None: "an int", 0: "a non-negative int", 1: "a positive int"}.get(
                       minimum, f"an int >= {minimum}"))
    if allow_none and "None" not in allowed:
        allowed += " or None"
    error = ValueError if ok else type_error
    raise error(f"{_prefix(api)}{name}={value!r} must be {allowed}"
                f"{' ' + what if what else ''}.")


def check_real(value: Any, name: str, *, api: str | None = None,
               minimum: float | None = 0.0, maximum: float | None = None,
               positive: bool = False) -> float:
    """``float(value)`` (any real number, not a bool), finite, in ``[minimum, maximum]``.

    A bound of None is no bound; ``positive`` also refuses zero.
    """
    prefix = _prefix(api)
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{prefix}{name} must be a real number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{prefix}{name} must be a real number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{prefix}{name} must be finite, got {value!r}")
    if positive and not number > 0:
        raise ValueError(f"{prefix}{name} must be > 0, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{prefix}{name} must be >= {minimum:g}, got {value!r}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{prefix}{name} must be <= {maximum:g}, got {value!r}")
    return number


def check_choice(value: Any, name: str, choices: dict[str, str], *,
                 api: str | None = None) -> str:
    """``value`` if it is one of ``choices`` (a name -> meaning mapping)."""
    if not isinstance(value, str) or value not in choices:
        options = " or ".join(
            f"{c!r}" + (f" ({meaning})" if meaning else "")
            for c, meaning in choices.items())
        raise ValueError(f"{_prefix(api)}{name}={value!r} must be {options}.")
    return value


def check_num_skip(num_skip: Any, n: int, *, api: str | None = None,
                   n_name: str = "an axis") -> int:
    """``int(num_skip)``: k, the reduce-scatter steps to skip, in ``[0, n - 1]``.

    ``n``: the number of ranks; ``n_name``: what it is, for the message
    (``"an axis"``, ``"n"``).
    """
    prefix = _prefix(api)
    if isinstance(num_skip, (bool, np.bool_)) or not isinstance(
            num_skip, (int, np.integer)):
        raise TypeError(
            f"{prefix}num_skip={num_skip!r} must be a Python int (the number "
            f"of reduce-scatter steps to skip), in [0, {n - 1}] for "
            f"{n_name} of size {n}.")
    if not 0 <= num_skip <= n - 1:
        raise ValueError(
            f"{prefix}num_skip={num_skip} is outside [0, {n - 1}] for "
            f"{n_name} of size {n}: at most N - 1 = {n - 1} reduce-scatter "
            "steps exist.")
    return int(num_skip)


def check_axis_name(axis_name: Any, *, api: str, argument: str = "axis_name"
                    ) -> str:
    """Checks that ``axis_name`` is one mesh axis name (a str)."""
    if not isinstance(axis_name, str):
        raise TypeError(
            f"{api}: {argument}={axis_name!r} must be the name (a str) of one "
            "mesh axis.")
    return axis_name


def axis_size(axis_name: Any, *, api: str, argument: str = "axis_name") -> int:
    """The size of a bound axis, with an error that says how to bind it."""
    check_axis_name(axis_name, api=api, argument=argument)
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        reduced = (" If the gradients come from skipreduce_jax.value_and_grad "
                   "(or skipreduce_jax.nnx.value_and_grad), they are already "
                   "reduced: take skip_reduce out of the optimizer."
                   if api.startswith("skip_reduce") else "")
        raise NameError(
            f"{api}: {argument}={axis_name!r} is not a bound axis. Call {api} "
            f"inside jax.shard_map(f, mesh=mesh, ...) whose mesh has an axis "
            f"named {axis_name!r}.{reduced}") from e


def axes_pair(axis_name: Any, inner_axis: Any, *, api: str) -> tuple[int, int]:
    """Sizes ``(N, L)`` of the bound outer and inner axes (L = 1 without one).

    Refuses an ``inner_axis`` that is also ``axis_name``.
    """
    n = axis_size(axis_name, api=api)
    if inner_axis is None:
        return n, 1
    check_distinct_axes(axis_name, inner_axis, api=api)
    return n, axis_size(inner_axis, api=api, argument="inner_axis")


def check_distinct_axes(axis_name: Any, inner_axis: Any, *, api: str) -> None:
    """Refuses hierarchical settings that name one axis twice."""
    if inner_axis is not None and inner_axis == axis_name:
        raise ValueError(
            f"{api}: inner_axis={inner_axis!r} is also axis_name. Name two "
            "different mesh axes: axis_name the slow (skipped) one, inner_axis "
            "the fast one.")


def check_float_dtype(value: Any, name: str, *, api: str, none: str,
                      example: str) -> np.dtype | None:
    """``value``, None or a floating-point dtype, as the dtype JAX computes in.

    (float64 is float32 unless jax_enable_x64 is on.) The message says what
    None means (``none``, e.g. ``"add in the gradients' dtype"``) and
    suggests ``example``, e.g. ``"jnp.float32"``.

    Example:
      >>> import jax.numpy as jnp
      >>> from skipreduce_jax._checks import check_float_dtype
      >>> check_float_dtype(jnp.bfloat16, "comm_dtype", api="skip_psum",
      ...                   none="send the gradients' dtype", example="jnp.bfloat16")
      dtype(bfloat16)
    """
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(f"{_prefix(api)}{name}={value!r} is not a dtype. Pass None "
                        f"({none}) or e.g. {example}.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{_prefix(api)}{name}={value!r} is not a floating-point "
                        f"dtype. Pass None or e.g. {example}.")
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
