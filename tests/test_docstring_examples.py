"""Every docstring example runs as pasted into a fresh Python session.

Each example runs in an empty namespace (not its module's), so it imports
what it uses and builds its own mesh; only the 8 simulated devices come
from the test set-up.
"""

import doctest
import importlib
import io
import pkgutil

import pytest

import skipreduce_jax

MODULES = ["skipreduce_jax", *(m.name for m in pkgutil.walk_packages(
    skipreduce_jax.__path__, "skipreduce_jax."))]


def _examples() -> dict[str, doctest.DocTest]:
    found = {}
    finder = doctest.DocTestFinder(exclude_empty=True)
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra (orbax for .checkpoint)
            continue
        for test in finder.find(module):
            if test.examples and "__test__" not in test.name:
                found.setdefault(test.name, test)
    return found


EXAMPLES = _examples()


def test_there_are_examples():
    assert len(EXAMPLES) >= 60


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_example_runs_in_a_fresh_session(name):
    test = EXAMPLES[name]
    test.globs = {"__name__": "__example__"}
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = io.StringIO()
    result = runner.run(test, out=out.write)
    assert result.failed == 0, out.getvalue()[-3000:]
