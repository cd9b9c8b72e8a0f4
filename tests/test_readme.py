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


# A block's expected output: a comment ``# prints: <a line it prints>``.
PRINTS = re.compile(r"^\s*# prints: (.+)$", re.M)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _matches(expected: str, line: str) -> bool:
    """``line`` is ``expected``, its numbers equal to the printed digits' last place."""
    pattern = "".join(re.escape(part) + ("(" + NUMBER.pattern + ")" if i < len(
        NUMBER.findall(expected)) else "") for i, part in enumerate(NUMBER.split(expected)))
    found = re.fullmatch(pattern, line.strip())
    if found is None:
        return False
    for want, got in zip(NUMBER.findall(expected), found.groups(), strict=True):
        decimals = len(want.partition(".")[2]) if "e" not in want else 6
        if abs(float(got) - float(want)) > 10.0 ** -decimals * 1.01 + 1e-2 * abs(float(want)):
            return False
    return True


def test_expected_output_is_checked():
    assert _matches("loss 0.25, rows (256,)", "loss 0.26, rows (256,)")
    assert not _matches("loss 0.25, rows (256,)", "loss 0.30, rows (256,)")
    assert not _matches("loss 0.25, rows (256,)", "loss 0.25, rows (128,)")


@pytest.mark.parametrize("name", list(BLOCKS))
def test_readme_example_runs(name, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(BLOCKS[name])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for expected in PRINTS.findall(BLOCKS[name]):
        assert any(_matches(expected, line) for line in lines), (
            f"expected a line {expected!r}; printed:\n{result.stdout[-2000:]}")


GUIDES = [ROOT / "docs" / "getting-started.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_every_guide_opens_with_a_block_and_its_output(page):
    """Within its first 80 words of prose, a runnable block that says what it prints."""
    text = page.read_text()
    first = text.find("```python\n")
    assert first >= 0, f"{page.name} has no python block"
    prose = re.sub(r"```.*?```", "", text[:first], flags=re.S)
    assert len(prose.split()) <= 80, f"{page.name}: {len(prose.split())} words before its code"
    block = re.match(r"```python\n(.*?)```", text[first:], flags=re.S).group(1)
    assert PRINTS.search(block), f"{page.name}'s first block has no '# prints:' line"
