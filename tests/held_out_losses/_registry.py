"""The cases' registry: ``case(name, loss, args, ...)`` records one loss.

``args``: ``(role, value, spec)`` per argument; role ``"p"`` params,
``"b"`` batch (placed by ``spec``, a PartitionSpec or a pytree of them),
``"c"`` anything else (passed as it is).
"""

import functools

import jax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

__all__ = ["CASES", "P", "case", "lazy", "mesh"]

CASES: dict[str, dict] = {}


def case(name, loss, args, has_aux=False, tol=None, kinds=("explicit", "auto"), kwargs=None):
    """Records one loss; ``tol="bf16"`` where it computes in 16 bits."""
    assert name not in CASES, name
    CASES[name] = dict(loss=loss, args=args, has_aux=has_aux, tol=tol, kinds=kinds,
                       kwargs=kwargs or {})


@functools.cache
def mesh(kind):
    """The 8-device mesh of one axis, "data", of ``kind`` "explicit" or "auto"."""
    axis = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((8,), ("data",), axis_types=(axis,))


def lazy(f):
    """An argument made at first use (and kept)."""
    f = functools.cache(f)
    f._lazy = True
    return f
