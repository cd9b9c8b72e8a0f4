"""Sphinx configuration of the skipreduce_jax site (``make docs``)."""

import pathlib
import re
import sys
import zlib

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))

import skipreduce_jax  # noqa: E402

project = "skipreduce_jax"
author = "skipreduce_jax authors"
copyright = "skipreduce_jax authors"
release = version = skipreduce_jax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "_inventories", "_templates", "_data"]
templates_path = ["_templates"]

# Google docstrings; each name is documented where its page says.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
# Shown by name on the API pages (both are described in api/index).
autodoc_type_aliases = {"PyTree": "PyTree", "DTypeLike": "jax.typing.DTypeLike",
                        "Filter": "flax.nnx.filterlib.Filter"}
# A page per public name (docs/api/generated/, written at build time).
autosummary_generate = True
autosummary_imported_members = True

myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath", "deflist"]

html_theme = "furo"
html_title = f"skipreduce_jax {version}"


def _inventory(name: str) -> str:
    """Writes docs/_inventories/<name>.txt as a Sphinx inventory; returns its path.

    The site is built without network access, so the inventories of JAX,
    optax and flax are not downloaded: each text file lists the entries of
    that site's ``objects.inv`` these pages use, as its documentation
    sources define them (``name domain:role uri``, ``$`` standing for the
    name; the file's notes say which sources), and intersphinx reads the
    inventory built from it.
    """
    source = DOCS / "_inventories" / f"{name}.txt"
    lines = [line.split() for line in source.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    body = "".join(f"{obj} {role} 1 {uri} -\n" for obj, role, uri in lines)
    header = (f"# Sphinx inventory version 2\n# Project: {name}\n# Version: \n"
              "# The remainder of this file is compressed using zlib.\n")
    target = DOCS / "_build" / "inventories" / f"{name}.inv"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(header.encode() + zlib.compress(body.encode()))
    return str(target)


intersphinx_mapping = {
    "jax": ("https://docs.jax.dev/en/latest/", _inventory("jax")),
    "optax": ("https://optax.readthedocs.io/en/latest/", _inventory("optax")),
    "flax": ("https://flax.readthedocs.io/en/latest/", _inventory("flax")),
    "flax_linen": ("https://flax-linen.readthedocs.io/en/latest/", _inventory("flax_linen")),
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]



# Sphinx spells an alias of autodoc_type_aliases nested in a union or a
# Callable by its repr, "TypeAliasForwardRef('PyTree')"; these handlers of
# its events spell it by name in signatures and in the typed parameters.
_ALIAS_REPR = re.compile(r"TypeAliasForwardRef\('([\w.]+)'\)")


def _spelled(text):
    return text and _ALIAS_REPR.sub(r"\1", text)


def _signature_by_name(app, what, name, obj, options, signature, return_annotation):
    return _spelled(signature), _spelled(return_annotation)


def _fields_by_name(app, domain, objtype, contentnode):
    from docutils import nodes

    for text in list(contentnode.findall(nodes.Text)):
        if "TypeAliasForwardRef" in text:
            text.parent.replace(text, nodes.Text(_spelled(str(text))))


# Inline code naming an API (``jax.jit``, `lax.psum(x, "data")`, `sr.skip_reduce`)
# links to its entry, here or in JAX's, optax's or flax's docs (the
# inventories above); a name found nowhere stays plain code.
_LINKABLE = re.compile(r"(jax|lax|jnp|optax|flax|nnx|nn|sr|skipreduce_jax)((?:\.\w+)+)(?:\(.*\))?")
_PREFIXES = {"lax": "jax.lax", "jnp": "jax.numpy", "nnx": "flax.nnx", "nn": "flax.linen",
             "sr": "skipreduce_jax"}


def _link_code(app, doctree):
    from docutils import nodes
    from sphinx.addnodes import pending_xref

    for literal in list(doctree.findall(nodes.literal)):
        if isinstance(literal.parent, (nodes.reference, pending_xref)):
            continue
        found = _LINKABLE.fullmatch(literal.astext().strip())
        if found is None:
            continue
        target = _PREFIXES.get(found.group(1), found.group(1)) + found.group(2)
        ref = pending_xref("", refdomain="py", reftype="obj", reftarget=target,
                           refexplicit=True, refwarn=False)
        literal.replace_self(ref)
        ref += literal


def setup(app):
    """Connects the handlers above."""
    app.connect("autodoc-process-signature", _signature_by_name)
    app.connect("object-description-transform", _fields_by_name, priority=900)
    app.connect("doctree-read", _link_code)
