"""Alpha-beta cost model of ring all-reduce, SkipReduce and hierarchical SkipReduce.

One collective call costs ``call_overhead + steps * alpha + bytes / bandwidth``
(a :class:`LinkModel`); SkipReduce with ``k`` of the ``n - 1`` reduce-scatter
steps skipped takes ``2 (n - 1) - k`` steps of ``B / n`` bytes. The model, its
assumptions and limits are described in ``skipreduce_jax.cost._model``.

Predict: :func:`predict_skipreduce`, :func:`predict_hierarchical`. Budget:
:func:`required_num_skip`, :func:`required_skip_ratio`,
:func:`required_num_skip_hierarchical`. Bytes and steps:
:func:`skipreduce_bytes`, :func:`skipreduce_steps`, :func:`traffic_fraction`,
:func:`hierarchical_bytes`, :func:`skip_ratio_to_num_skip`. Calibrate on
benchmark runs: :class:`Measurement`, :func:`fit_link_model`,
:func:`validate`, :func:`predict_measurement`, :func:`load_measurements`,
:func:`save_measurements`, :func:`load_link_model`, :func:`save_link_model`.
Parse command-line quantities: :func:`parse_size`, :func:`parse_count`
(decimal, ``25M`` = 25e6), :func:`parse_binary_count` (binary, ``4M`` =
4 * 2**20), :func:`parse_seconds`. Command line:
``python -m skipreduce_jax.cost {predict,target,fit,check} --help``.

Example:
    >>> from skipreduce_jax.cost import LinkModel, predict_skipreduce
    >>> round(predict_skipreduce(1e9, 8, 7, LinkModel.from_gbit(100)), 9)
    0.07
"""

from typing import TYPE_CHECKING, Any

from skipreduce_jax._ring.traffic import hierarchical_bytes as hierarchical_bytes
from skipreduce_jax._ring.traffic import ring_allreduce_bytes as ring_allreduce_bytes
from skipreduce_jax._ring.traffic import skip_ratio_to_num_skip as skip_ratio_to_num_skip
from skipreduce_jax._ring.traffic import skipreduce_bytes as skipreduce_bytes
from skipreduce_jax._ring.traffic import skipreduce_steps as skipreduce_steps
from skipreduce_jax._ring.traffic import traffic_fraction as traffic_fraction

from ._fit import KINDS as KINDS
from ._fit import Measurement as Measurement
from ._fit import Validation as Validation
from ._fit import fit_link_model as fit_link_model
from ._fit import load_measurements as load_measurements
from ._fit import predict_measurement as predict_measurement
from ._fit import save_measurements as save_measurements
from ._fit import validate as validate
from ._model import LinkModel as LinkModel
from ._model import load_link_model as load_link_model
from ._model import predict_allreduce as predict_allreduce
from ._model import predict_hierarchical as predict_hierarchical
from ._model import predict_hierarchical_allreduce as predict_hierarchical_allreduce
from ._model import predict_skipreduce as predict_skipreduce
from ._model import required_num_skip as required_num_skip
from ._model import required_num_skip_hierarchical as required_num_skip_hierarchical
from ._model import required_skip_ratio as required_skip_ratio
from ._model import save_link_model as save_link_model

if TYPE_CHECKING:
    from .__main__ import DTYPE_BYTES as DTYPE_BYTES
    from .__main__ import main as main
    from .__main__ import parse_binary_count as parse_binary_count
    from .__main__ import parse_count as parse_count
    from .__main__ import parse_seconds as parse_seconds
    from .__main__ import parse_size as parse_size

__all__ = [
    "LinkModel", "Measurement", "fit_link_model", "hierarchical_bytes", "load_link_model",
    "load_measurements", "parse_binary_count", "parse_count", "parse_seconds", "parse_size",
    "predict_hierarchical", "predict_measurement", "predict_skipreduce", "required_num_skip",
    "required_num_skip_hierarchical", "required_skip_ratio", "save_link_model", "save_measurements",
    "skip_ratio_to_num_skip", "skipreduce_bytes", "skipreduce_steps", "traffic_fraction",
    "validate",
]

# The command-line module loads on first use: importing it here would make
# ``python -m skipreduce_jax.cost`` import it twice (and runpy warn).
_FROM_MAIN = ("DTYPE_BYTES", "main", "parse_binary_count", "parse_count", "parse_seconds",
              "parse_size")


def __getattr__(name: str) -> Any:
    if name in _FROM_MAIN:
        from . import __main__

        return getattr(__main__, name)
    if name == "__test__":
        return _examples()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_FROM_MAIN])


def _examples() -> dict[str, str]:
    """The submodules' docstring examples by name; ``doctest.testmod`` runs them as ``__test__``."""
    import doctest

    from . import __main__, _fit, _model

    finder = doctest.DocTestFinder()
    return {test.name: test.docstring for module in (_model, _fit, __main__)
            for test in finder.find(module) if test.examples and test.docstring}
