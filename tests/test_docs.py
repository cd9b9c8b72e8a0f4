"""The API reference names every public name, links resolve, and pages name nothing removed."""

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

# An entry of an API page: an autodoc directive, a hand-written ``py:`` one,
# or a line of an ``autosummary`` table (each gets a page of its own).
ENTRY = re.compile(r"^\.\. (?:auto\w+|py:\w+):: (skipreduce_jax[\w.]*)\s*$", re.M)
SUMMARY = re.compile(r"^\.\. autosummary::\n((?:   .*\n|\n)+)", re.M)
# A markdown link whose target is not a URL: [text](path#anchor).
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md",
         *(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.relative_to(ROOT).parts)]


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
    names = set()
    for page in API_PAGES:
        text = page.read_text()
        names |= set(ENTRY.findall(text))
        for block in SUMMARY.findall(text):
            names |= {line.strip() for line in block.splitlines()
                      if line.strip().startswith("skipreduce_jax")}
    return names


def _anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors MyST gives a page (``myst_heading_anchors``), and explicit labels."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.+)$", text, flags=re.M)
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}
    return slugs | set(re.findall(r"^\(([\w-]+)\)=$", text, flags=re.M))


def _entry_of(obj, name: str, entries: set[str]) -> bool:
    """Whether ``obj`` has an entry, under any public module that exports it as ``name``."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        if getattr(module, name, None) is obj and f"{module_name}.{name}" in entries:
            return True
    return False


@pytest.mark.parametrize("module_name", MODULES)
def test_every_public_name_has_an_api_entry(module_name):
    """A re-exported name has its one entry where it is defined (one page, one anchor)."""
    entries = documented()
    module = importlib.import_module(module_name)
    missing = sorted(name for name in public_names(module_name)
                     if not _entry_of(getattr(module, name), name, entries))
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


def test_every_api_entry_has_a_page_of_its_own():
    """Autosummary generates a page per name: no name is documented inline twice."""
    for page in API_PAGES:
        text = page.read_text()
        assert not re.search(r"^\.\. auto(function|class|exception):: ", text, re.M), page.name
        for block in SUMMARY.findall(text):
            assert ":toctree: generated" in block, page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_internal_links_resolve(page):
    """Every relative link names a file that exists and, after ``#``, one of its headings."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


INVENTORIES = sorted((ROOT / "docs" / "_inventories").glob("*.txt"))


def _resolve(name: str):
    """The object ``name`` spells, importing its longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


@pytest.mark.parametrize("inventory", INVENTORIES, ids=lambda p: p.stem)
def test_the_offline_inventories_name_what_the_installed_packages_hold(inventory):
    """Each entry of docs/_inventories names a real object (no typo sends a link astray)."""
    lines = [line.split() for line in inventory.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines
    for name, role, uri in lines:
        assert role.startswith("py:") and not uri.startswith("http"), (name, role, uri)
        if name.startswith(("flax", "optax", "jax")):
            _resolve(name)
