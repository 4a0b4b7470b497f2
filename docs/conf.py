"""Sphinx configuration of the dask-kvstate docs (``make docs``).

The site builds offline: no intersphinx, no remote images, a theme that ships its
assets. Pages are Markdown (MyST) so the benchmark reports the bench command writes are
pages as they stand; the API reference is reStructuredText, because autodoc's output
and the numpydoc docstrings (read by napoleon) are reStructuredText.
"""

from __future__ import annotations

import importlib.util
import re

project = "dask-kvstate"
author = "the dask-kvstate developers"
copyright = "the dask-kvstate developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    # The per-workflow tables of docs/nalar/ are included into guide/benchmarks-nalar.md
    # (with its README), so they are no pages of their own.
    "nalar/**",
    # likewise the vLLM rows' tables, into guide/benchmarks-vllm.md
    "bench/vllm/**",
    # the raw-engine runs' own reports: their tables are in guide/benchmarks-vllm.md
    "bench/beyond-memory/**",
    "bench/agents-vs-raw/**",
    "bench/sessions-vs-raw/**",
    "bench/vs-raw/**",
    # and the transformers kernels' table, in guide/benchmarks-vllm.md and design/backends.md
    "bench/hf-kernels/**",
]

# MyST: heading anchors so `page.md#a-heading` links resolve. No syntax extensions: the
# pages are the GitHub-flavoured Markdown the repository shows, tables included.
myst_heading_anchors = 4

# autodoc + napoleon: numpydoc-style docstrings, members in source order, signatures
# with their type hints in the description (the public API is typed).
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": False}
# The vLLM backend's modules import vLLM; an environment without the vllm extra still
# documents everything else.
autodoc_mock_imports = [] if importlib.util.find_spec("vllm") else ["vllm"]


# numpydoc ends the Parameters section only at the next section header, so a closing
# paragraph written after the parameters (as ``kvs.install`` and the worker plugin do)
# would be read as more parameters. This puts such a paragraph under a Notes header
# before napoleon reads the docstring (priority 400 runs ahead of napoleon's 500).
_PARAMETER_LINE = re.compile(r"^\*{0,2}[A-Za-z_]\w*(\s*,\s*\*{0,2}[A-Za-z_]\w*)*(\s*:.*)?$")


def _prose_after_parameters(app, what, name, obj, options, lines: list[str]) -> None:
    in_parameters = False
    i = 0
    while i < len(lines):
        line = lines[i]
        underline = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.strip() and underline and set(underline) == {"-"}:
            in_parameters = line.strip().lower() in {"parameters", "other parameters"}
            i += 2
            continue
        if in_parameters and line[:1].strip() and not lines[i - 1].strip() and not _PARAMETER_LINE.match(line):
            lines[i:i] = ["Notes", "-----"]
            in_parameters = False
            i += 2
        i += 1


def setup(app) -> None:
    app.connect("autodoc-process-docstring", _prose_after_parameters, priority=400)


html_theme = "pydata_sphinx_theme"
html_title = "dask-kvstate"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
# Unlabelled code blocks are diagrams, trees and shell lines: shown as they are, never
# lexed as Python (a lexing failure would be a warning, and so an error).
highlight_language = "none"
