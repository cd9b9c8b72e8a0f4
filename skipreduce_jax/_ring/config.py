"""SkipReduce's settings: :class:`SkipConfig`, and the ring settings of one call.

The collectives read a config's ring fields (or their keywords) into one
:class:`RingSettings` per call, axes bound and k resolved, which the ring
code takes. A new ring setting is a field here and a keyword of the collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, Unpack

import numpy as np

from skipreduce_jax import _checks as checks
from skipreduce_jax._ring.buckets import DEFAULT_BUCKET_BYTES, LAYOUTS
from skipreduce_jax._ring.selection import check_selective
from skipreduce_jax._ring.traffic import skip_ratio_to_num_skip
from skipreduce_jax._ring.wire import Wire, check_comm_dtype, make_wire
from skipreduce_jax._types import DTypeLike, PyTree

_API = "skip_reduce"


class SkipOptions(TypedDict, total=False):
    """The keywords of :class:`SkipConfig`, as ``**skip_options`` takes them.

    Each is described at :func:`skip_reduce`.
    """

    num_skip: int | None
    skip_ratio: float | None
    seed: int
    randomize: bool
    balanced: bool
    selective: Callable[[PyTree], PyTree] | None
    min_size: int
    warmup_steps: int
    error_feedback: bool | str
    exact_radial: bool | None
    chunks_per_rank: int | None
    bucket_bytes: int
    accumulate_dtype: DTypeLike | None
    check_finite: bool
    params_sharded: bool
    verify_sync: bool
    comm_dtype: DTypeLike | None
    layout: str


class RingOptions(TypedDict, total=False):
    """The ring settings of a :class:`SkipConfig`, as a collective's keywords.

    What :func:`skip_psum` and the other collectives read of a config;
    each is described at :func:`skip_reduce`. Give ``num_skip`` or
    ``skip_ratio`` (resolved against the axis, as ``skip_reduce`` does).
    """

    num_skip: int | None
    skip_ratio: float | None
    randomize: bool
    chunks_per_rank: int | None
    bucket_bytes: int
    accumulate_dtype: DTypeLike | None
    comm_dtype: DTypeLike | None
    layout: str


class CollectiveOptions(RingOptions, total=False):
    """A collective's keywords: the ring settings, and the call's own.

    Each collective takes the ones its documentation lists and refuses the
    others by name.

    Attributes:
      phase: the step's place in a balanced period (:func:`balanced_draw`).
      inner_axis: hierarchical mode: a fast axis summed in full.
      gather: ``"native"`` (``lax.all_gather``) or ``"ring"``.
      specs: the leaves' layouts over the compiler's mesh axes.
      rescale: multiply the sum by N / (N - k).
      normalize: ``"contributors"`` or ``"world"``: what a mean divides by.
    """

    phase: Any
    inner_axis: str | None
    gather: str
    specs: PyTree
    rescale: bool
    normalize: str


@dataclasses.dataclass(frozen=True)
class SkipConfig:
    """SkipReduce's settings, checked once, in one frozen object.

    Its fields are :func:`skip_reduce`'s keyword options (described there),
    without the mesh axes. :func:`skip_reduce`, :func:`value_and_grad` and
    :func:`comm_stats` build one from their keywords, or take one as
    ``config=``, so that one object carries a run's settings to each of
    them; the collectives (:func:`skip_psum` and the others) read its ring
    settings. Give exactly one of ``num_skip`` and ``skip_ratio``;
    ``dataclasses.replace(config, ...)`` derives another, checked again.

    Raises:
      ValueError, TypeError: for a setting out of range, naming it.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> import skipreduce_jax as sr
      >>> config = sr.SkipConfig(skip_ratio=0.5, min_size=0)
      >>> tx = optax.chain(sr.skip_reduce("data", config=config), optax.sgd(0.1))
      >>> round(sr.comm_stats({"w": jnp.zeros((1024, 1024))}, 8, config=config).ratio, 3)
      0.714
    """

    num_skip: int | None = None
    skip_ratio: float | None = None
    seed: int = 0
    randomize: bool = True
    balanced: bool = True
    selective: Callable[[PyTree], PyTree] | None = None
    min_size: int = 100_000
    warmup_steps: int = 0
    error_feedback: bool | str = False
    exact_radial: bool | None = None
    chunks_per_rank: int | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    accumulate_dtype: DTypeLike | None = None
    check_finite: bool = False
    params_sharded: bool = False
    verify_sync: bool = False
    comm_dtype: DTypeLike | None = None
    layout: str = "flat"

    def __post_init__(self):
        # Plain Python values, so that equal settings have equal fingerprints.
        for name, value in _checked(self).items():
            object.__setattr__(self, name, value)

    @property
    def wire(self) -> Wire:
        """How ``comm_dtype`` crosses each hop (see ``_ring/wire.py``)."""
        return make_wire(self.comm_dtype)


SKIP_OPTIONS = tuple(f.name for f in dataclasses.fields(SkipConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SkipConfig)}
# The fields a collective reads; the others are the optimizer's.
RING_OPTIONS = ("num_skip", "skip_ratio", "randomize", "chunks_per_rank",
                "bucket_bytes", "accumulate_dtype", "comm_dtype", "layout")


def skip_config(config: SkipConfig | None, options: dict[str, Any], *,
                api: str) -> SkipConfig:
    """``config``, or the one ``options`` (keywords of ``api``) build; not both."""
    if config is None:
        unknown = sorted(set(options) - set(SKIP_OPTIONS))
        if unknown:
            raise TypeError(f"{api}: unknown options {unknown}; SkipReduce's options "
                            f"are {list(SKIP_OPTIONS)}.")
        _checked(types.SimpleNamespace(**{**_DEFAULTS, **options}), api)  # named errors
        return SkipConfig(**options)
    if not isinstance(config, SkipConfig):
        raise TypeError(f"{api}: config must be a skipreduce_jax.SkipConfig, got "
                        f"{type(config).__name__}.")
    if options:
        raise TypeError(
            f"{api}: pass the settings as config= or as keyword options, not both "
            f"(got config and {sorted(options)}); dataclasses.replace(config, ...) "
            "changes some of them.")
    return config


def config_or_keywords(fun):
    """Gives ``fun`` one checked ``config=``, the one passed or its keywords'.

    Both together are refused, even a keyword at its default. The keywords
    are ``fun``'s documented form; its body reads only ``config``.
    """
    api = fun.__name__
    names = set(SKIP_OPTIONS) & set(inspect.signature(fun).parameters)

    @functools.wraps(fun)
    def call(*args, config=None, **kwargs):
        given = {name: kwargs.pop(name) for name in sorted(names & kwargs.keys())}
        return fun(*args, config=skip_config(config, given, api=api), **kwargs)
    return call


def collective(*takes: str, reads: Sequence[str] = RING_OPTIONS):
    """Makes ``body(x, ring, *, key, ...)`` a public collective.

    The collective is ``(x, axis_name, *, key, config, **options)``.

    ``takes``: the call's own keywords (of :class:`CollectiveOptions`) the
    body accepts; ``reads``: the ring settings it reads. The keywords build
    the config (both together are refused, even at a default); the axes
    meet it once, here, into the :class:`RingSettings` the body gets; any
    other keyword is refused by name.
    """
    def wrap(body):
        api = body.__name__
        own = inspect.signature(body).parameters

        @functools.wraps(body)
        def call(x, axis_name, *, key, config=None, **options):
            given = {name: options.pop(name) for name in RING_OPTIONS if name in options}
            unknown = sorted(set(options) - set(takes)) + sorted(set(given) - set(reads))
            if unknown:
                raise TypeError(
                    f"{api}() got an unexpected keyword argument {unknown[0]!r}: it "
                    f"takes key, config, the ring settings {list(reads)} and "
                    f"{list(takes)}.")
            if config is None and given.get("num_skip") is None and given.get(
                    "skip_ratio") is None:
                raise TypeError(
                    f"{api}: give num_skip= (k, the reduce-scatter steps to skip) or "
                    "config= (a skipreduce_jax.SkipConfig); got neither.")
            inner_axis = options.pop("inner_axis", None)
            if config is None and given.get("num_skip") is not None:
                n, _ = checks.axes_pair(axis_name, inner_axis, api=api)
                checks.check_num_skip(given["num_skip"], n, api=api)
            ring = ring_settings(axis_name, inner_axis, skip_config(config, given, api=api),
                                 api=api)
            return body(x, ring, key=key, **options)

        shown = [inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   annotation=own["x"].annotation),
                 inspect.Parameter("axis_name", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   annotation="str"),
                 own["key"],
                 inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation="SkipConfig | None"),
                 inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD,
                                   annotation=Unpack[CollectiveOptions])]
        call.__signature__ = inspect.Signature(
            shown, return_annotation=inspect.signature(body).return_annotation)
        del call.__wrapped__  # the body's parameters are not the collective's
        return call
    return wrap


def check_ring(values: dict[str, Any], *, api: str) -> dict[str, Any]:
    """The ring settings of ``values`` but k, each checked (plain Python values)."""
    return dict(
        randomize=checks.check_bool(values["randomize"], "randomize", api=api,
                                    meaning="False: static SkipReduce"),
        chunks_per_rank=checks.check_int(
            values["chunks_per_rank"], "chunks_per_rank", api=api, minimum=1,
            allow_none=True, type_error=ValueError, what="(choose from the bucket size)"),
        bucket_bytes=checks.check_int(values["bucket_bytes"], "bucket_bytes", api=api,
                                      minimum=1, type_error=ValueError),
        accumulate_dtype=checks.check_float_dtype(
            values["accumulate_dtype"], "accumulate_dtype", api=api,
            none="add in the gradients' dtype", example="jnp.float32"),
        comm_dtype=check_comm_dtype(values["comm_dtype"], api=api),
        layout=checks.check_choice(values["layout"], "layout", LAYOUTS, api=api))


def _checked(config: Any, api: str = _API) -> dict[str, Any]:
    """``config``'s settings, each checked (and made a plain Python value)."""
    num_skip, skip_ratio = config.num_skip, config.skip_ratio
    if (num_skip is None) == (skip_ratio is None):
        raise ValueError(
            f"{api}: give exactly one of num_skip (an int k) and skip_ratio "
            f"(a fraction in [0, 1]); got num_skip={num_skip!r}, "
            f"skip_ratio={skip_ratio!r}.")
    num_skip = checks.check_int(num_skip, "num_skip", api=api, minimum=0,
                                allow_none=True, type_error=ValueError,
                                allowed="an int >= 0 (or None)",
                                what="(at most N - 1, checked at trace time)")
    if skip_ratio is not None:
        try:
            skip_ratio = checks.check_real(skip_ratio, "skip_ratio", maximum=1.0)
        except (TypeError, ValueError):
            raise ValueError(f"{api}: skip_ratio={skip_ratio!r} must be a number "
                             "in [0, 1].") from None
    # jax.random.key keeps 32 bits without jax_enable_x64: 2**32 + 5 would
    # silently be the key of 5.
    seed = checks.check_int(config.seed, "seed", api=api, minimum=0,
                            maximum=2**32 - 1, type_error=ValueError,
                            allowed="in [0, 2**32) (an int)")
    min_size = checks.check_int(config.min_size, "min_size", api=api, minimum=0,
                                type_error=ValueError)
    warmup_steps = checks.check_int(config.warmup_steps, "warmup_steps", api=api,
                                    minimum=0, type_error=ValueError)
    check_selective(config.selective, api=api)
    flags = {name: checks.check_bool(getattr(config, name), name, api=api) for name in (
        "balanced", "check_finite", "verify_sync", "params_sharded")}
    flags["error_feedback"] = _error_feedback(config, flags["params_sharded"], api)
    exact_radial = config.exact_radial
    if exact_radial is not None:
        exact_radial = checks.check_bool(exact_radial, "exact_radial", api=api)
    if exact_radial and (flags["error_feedback"] or flags["params_sharded"]):
        raise ValueError(
            f"{api}: exact_radial=True works with replicated params and no "
            "error feedback; pass error_feedback=False and params_sharded=False "
            "(error feedback alone also removes the BatchNorm drift).")
    return dict(
        num_skip=num_skip, skip_ratio=skip_ratio, seed=seed, selective=config.selective,
        min_size=min_size, warmup_steps=warmup_steps, exact_radial=exact_radial,
        **check_ring(vars(config), api=api), **flags)


def _error_feedback(config: Any, params_sharded: bool, api: str) -> bool | str:
    """``error_feedback``: a bool, or "auto" (with replicated params)."""
    if isinstance(config.error_feedback, str) and config.error_feedback == "auto":
        if params_sharded:
            raise ValueError(
                f"{api}: error_feedback='auto' keeps the last params, replicated; "
                "with params_sharded=True pass error_feedback=True or False.")
        return "auto"
    return checks.check_bool(config.error_feedback, "error_feedback", api=api,
                             meaning='or "auto": while its measured rule says so')


@dataclasses.dataclass(frozen=True)
class RingSettings:
    """What one collective call runs with: its bound axes and ring settings.

    Built by :func:`ring_settings`, checked; ``n`` and ``inner`` are the
    sizes N and L of ``axis_name`` and ``inner_axis`` (1 without), and
    ``num_skip`` is k, resolved against N. ``api`` names the call in errors.
    """

    api: str
    axis_name: str
    inner_axis: str | None
    n: int
    inner: int
    num_skip: int
    randomize: bool
    chunks_per_rank: int | None
    bucket_bytes: int
    accumulate_dtype: np.dtype | None
    comm_dtype: np.dtype | None
    layout: str

    @property
    def wire(self) -> Wire:
        """How ``comm_dtype`` crosses each hop (see ``_ring/wire.py``)."""
        return make_wire(self.comm_dtype)

    @property
    def axes(self) -> tuple[str, ...]:
        """The reduced axes: ``axis_name``, then ``inner_axis`` if any."""
        return (self.axis_name,) + ((self.inner_axis,) if self.inner_axis else ())


def ring_settings(axis_name: Any, inner_axis: Any, config: SkipConfig, *,
                  api: str) -> RingSettings:
    """The :class:`RingSettings` of one call of ``api``: ``config``'s, axes bound."""
    n, inner = checks.axes_pair(axis_name, inner_axis, api=api)
    num_skip = resolve_num_skip(config.num_skip, config.skip_ratio, n, api=api)
    return RingSettings(api, axis_name, inner_axis, n, inner, num_skip,  # k resolved
                        **{name: getattr(config, name) for name in RING_OPTIONS[2:]})


def resolve_num_skip(num_skip: Any, skip_ratio: float | None, n: int, *, api: str) -> int:
    """The k of ``n`` ranks: ``skip_ratio`` of N - 1 steps (rounded half up), or ``num_skip``."""
    if skip_ratio is not None:
        return skip_ratio_to_num_skip(skip_ratio, n)
    return checks.check_num_skip(num_skip, n, api=api)
