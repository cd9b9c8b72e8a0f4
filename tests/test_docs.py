"""The API reference names every public name, and the pages name nothing removed."""

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
MODULES = ["skipreduce_jax", "skipreduce_jax.nnx", "skipreduce_jax.contrib",
           "skipreduce_jax.checkpoint", "skipreduce_jax.distributed", "skipreduce_jax.cost"]

# Retired names and files that no page may mention.
RETIRED = ["control_variate", "rank_deviation", "NonIIDWarning", "MonitorState",
           "_monitor.py", "monitor_cost.py", "random+cv"]

# An entry of an API page: an autodoc directive or a hand-written ``py:`` one.
ENTRY = re.compile(r"^\.\. (?:auto\w+|py:\w+):: (skipreduce_jax[\w.]*)\s*$", re.M)


def public_names(module_name: str) -> set[str]:
    """``__all__`` where the module has one, otherwise every name without a leading underscore."""
    module = importlib.import_module(module_name)
    if hasattr(module, "__all__"):
        names = set(module.__all__)
    else:
        names = {name for name in dir(module) if not name.startswith("_")
                 and not inspect.ismodule(getattr(module, name))}
    return names


def documented() -> set[str]:
    return {name for page in API_PAGES for name in ENTRY.findall(page.read_text())}


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_an_api_entry(module_name):
    entries = documented()
    missing = sorted(name for name in public_names(module_name)
                     if f"{module_name}.{name}" not in entries)
    assert not missing, f"not on any docs/api page: {missing}"


def test_every_api_entry_exists():
    for qualified in documented():
        module_name, _, name = qualified.rpartition(".")
        assert hasattr(importlib.import_module(module_name), name), qualified


def test_no_page_mentions_what_was_retired():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    for page in pages:
        if "_build" in page.relative_to(ROOT).parts:
            continue
        text = page.read_text()
        found = [name for name in RETIRED if name in text]
        assert not found, f"{page.relative_to(ROOT)} mentions {found}"
