"""The names of the types in the public signatures.

``PyTree`` is any pytree of arrays (a dict, tuple, NamedTuple or flax state
of ``jax.Array`` or NumPy leaves); it is ``Any`` to a type checker, and the
API pages show it by name. ``DTypeLike`` is JAX's: ``jnp.bfloat16``,
``"float32"`` or a ``numpy.dtype``.
"""

from typing import Any, TypeAlias

from jax.typing import DTypeLike as DTypeLike

PyTree: TypeAlias = Any
