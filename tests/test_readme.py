"""The Python examples of README.md and of every page under docs/ run as written."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                     if "_build" not in p.relative_to(ROOT).parts)]


def _blocks() -> dict[str, str]:
    """Every ```python block by ``page:index``; a block repeated verbatim runs once."""
    blocks: dict[str, str] = {}
    for page in PAGES:
        found = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
        for index, code in enumerate(found):
            if code not in blocks.values():
                blocks[f"{page.relative_to(ROOT)}:{index}"] = code
    return blocks


BLOCKS = _blocks()


def test_readme_has_examples():
    readme = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(readme) >= 1
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("name", list(BLOCKS))
def test_readme_example_runs(name, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[name])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
