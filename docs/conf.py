"""Sphinx configuration of fedlore's documentation (``make docs``; warnings are errors).

Sphinx with the furo theme and MyST-Parser, as Flower and pfl-research use: pages are Markdown,
the generated reference (configuration keys from the pydantic models, the CLI from its argparse
parser, the Python API from docstrings) comes from ``_ext/fedlore_docs.py``, sphinx-argparse and
autodoc, so it cannot drift from the code.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

project = "fedlore"
author = "the fedlore developers"
copyright = "2026, the fedlore developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinxarg.ext",
    "fedlore_docs",
    "sphinx-mathjax-offline",  # MathJax served from the built site: it renders offline
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]
root_doc = "index"

myst_enable_extensions = ["colon_fence", "deflist", "dollarmath", "amsmath", "fieldlist"]
myst_heading_anchors = 3

# Every cross-reference must resolve (a broken link or key fails the build), except references
# to Python objects in signatures and docstrings, which name torch, numpy and pydantic types that
# this site does not document.
nitpicky = True
nitpick_ignore_regex = [(r"py:.*", r".*")]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "fedlore"
html_static_path = ["_static"]
html_css_files = ["fedlore.css"]
html_theme_options = {"navigation_with_keys": True}
