"""Sphinx configuration of the skipreduce_jax site (``make docs``)."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

project = "skipreduce_jax"
author = "skipreduce_jax authors"
copyright = "skipreduce_jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google docstrings; each name is documented where its page says.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
autosummary_generate = False

myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath"]

html_theme = "furo"
html_title = "skipreduce_jax"
