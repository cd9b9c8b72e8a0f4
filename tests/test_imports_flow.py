"""Imports flow one way: foundation -> _ring -> _optax / _runtime -> _steps -> public."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "skipreduce_jax"
# A module may import from its own layer and the layers below it.
RANK = {"_checks": 0, "_types": 0, "_vma": 0, "_ring": 1, "_optax": 2, "_runtime": 2,
        "_steps": 3}
TOP = 4  # nnx, distributed, launch, checkpoint, contrib, cost, the package itself


def _rank(parts):
    """The layer of ``skipreduce_jax.<parts>``."""
    return RANK.get(parts[0], TOP) if parts else TOP


def _imports(path):
    """(line, the dotted names after ``skipreduce_jax``) of each import of the package."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "skipreduce_jax":
                continue
            if len(parts) == 1:  # from skipreduce_jax import a, b
                for alias in node.names:
                    yield node.lineno, [alias.name]
            else:
                yield node.lineno, parts[1:]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "skipreduce_jax":
                    yield node.lineno, parts[1:]


LAYERED = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.relative_to(PACKAGE).parts[0] in RANK
                 or p.relative_to(PACKAGE).parts[0].removesuffix(".py") in RANK)


@pytest.mark.parametrize("path", LAYERED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_a_layer_imports_only_from_below(path):
    own = _rank([path.relative_to(PACKAGE).parts[0].removesuffix(".py")])
    upward = [f"line {line}: skipreduce_jax.{'.'.join(parts)}"
              for line, parts in _imports(path) if _rank(parts) > own]
    assert not upward, upward


def test_every_private_module_is_in_a_layer():
    top = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
           if p.name.startswith("_") and p.name != "__init__.py" and p.name != "__pycache__"}
    assert top == set(RANK)


def test_the_check_can_fail(tmp_path):
    # An upward import is found: a ring module importing the optax layer,
    # or the package itself (whose __init__ imports every layer).
    probe = tmp_path / "probe.py"
    probe.write_text("from skipreduce_jax._optax import transform\n"
                     "from skipreduce_jax import skip_reduce\n"
                     "import skipreduce_jax._steps.grad\n")
    assert [_rank(parts) for _, parts in _imports(probe)] == [
        RANK["_optax"], TOP, RANK["_steps"]]
