"""Runs the gallery's scripts: each one's output and figure (``make docs``).

Each script in ``docs/gallery/scripts/`` runs in its own process; its
printed lines go to ``docs/gallery/output/<name>.txt`` and its figure to
``docs/_static/gallery/<name>.png``, which the gallery's pages show.
"""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
FIGURES = HERE.parent / "_static" / "gallery"
OUTPUT = HERE / "output"


def main() -> None:
    """Runs each script; exits naming the first that fails."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    OUTPUT.mkdir(exist_ok=True)
    for script in sorted((HERE / "scripts").glob("*.py")):
        env = {**os.environ, "GALLERY_FIGURE": str(FIGURES / f"{script.stem}.png"),
               "PYTHONPATH": str(HERE.parents[1])}
        env.pop("XLA_FLAGS", None)
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, timeout=600)
        if done.returncode:
            sys.exit(f"{script.name} failed:\n{done.stderr[-3000:]}")
        (OUTPUT / f"{script.stem}.txt").write_text(done.stdout)
        print(f"ran docs/gallery/scripts/{script.name}")


if __name__ == "__main__":
    main()
