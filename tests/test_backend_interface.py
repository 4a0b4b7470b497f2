"""The one backend interface: nothing outside ``backends/`` names a concrete backend, the
backends package has no import cycle, and the transformers backend passes the conformance
checks every backend must (the vLLM one runs them in ``tests/test_vllm.py``)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folders and the package each installs as (setup.cfg's package_dir).
PACKAGES = {"dask_kvstate": "dask_kvstate", "plugins": "dask_kvstate.plugins", "graph_opt": "dask_kvstate.graph_opt"}
BACKENDS = "dask_kvstate.backends"


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of ``module`` loads (relative ones resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = module.split(".") if _is_package(path) else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join([*here, *([base] if base else [])])
    # ``from pkg import name``: name may be a submodule; count both, the check wants either.
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def _loads(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules) -> list[str]:
    """The modules an import statement needs run: a ``from pkg import sub`` of a submodule
    needs ``sub``, not ``pkg``'s own body (the package is only its parent)."""
    base, *names = _imported(module, path, node)
    if isinstance(node, ast.Import):
        return [base, *names]
    subs = [name for name in names if name in modules]
    return subs or [base]


def _concrete(name: str) -> bool:
    return name == f"{BACKENDS}.hf" or name.startswith(f"{BACKENDS}.vllm")


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: its body, inside ``if`` / ``try`` too, but
    not in functions and not under ``if TYPE_CHECKING``."""
    out: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If) and not _is_type_checking(node):
            todo += [*node.body, *node.orelse]
        elif isinstance(node, ast.Try):
            todo += [*node.body, *node.orelse, *node.finalbody, *(s for h in node.handlers for s in h.body)]
    return out


def test_no_module_outside_backends_imports_a_concrete_backend():
    offenders = []
    for module, path in _modules().items():
        if module == BACKENDS or module.startswith(BACKENDS + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                bad = sorted({name for name in _imported(module, path, node) if _concrete(name)})
                if bad:
                    offenders.append(f"{module} (line {node.lineno}) imports {', '.join(bad)}")
    assert not offenders, "go through dask_kvstate.backends' functions instead:\n" + "\n".join(offenders)


def _backends_graph(top_level: bool = True) -> dict[str, set[str]]:
    modules = {m: p for m, p in _modules().items() if m == BACKENDS or m.startswith(BACKENDS + ".")}
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = (
            _top_level_imports(tree)
            if top_level
            else [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        )
        names = {name for node in nodes for name in _loads(module, path, node, modules)}
        graph[module] = {name for name in names if name in modules and name != module}
    return graph


def test_the_backends_package_has_no_import_cycle():
    graph = _backends_graph()
    assert graph[f"{BACKENDS}.hf"], "the walk finds hf.py's imports"  # a walk that finds nothing passes anything
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle among the backends modules: {' -> '.join(e.args[1])}")


def test_the_decoding_helpers_and_the_vllm_backend_do_not_import_the_transformers_backend():
    graph = _backends_graph(top_level=False)  # at any level: a lazy import is a cycle deferred
    for module in ("batch", "decoding", "base", "vllm"):
        assert f"{BACKENDS}.hf" not in graph[f"{BACKENDS}.{module}"], f"{module} imports hf"


def test_the_interface_rejects_an_object_that_lacks_its_members():
    from dask_kvstate.backends.base import Backend

    assert not isinstance(object(), Backend)


def test_backend_conformance_of_the_transformers_backend():
    from dask_kvstate.backends import load_backend
    from dask_kvstate.backends.base import Backend
    from dask_kvstate.testing.conformance import check_backend_conformance

    backend = load_backend("tiny-llama")
    assert isinstance(backend, Backend)
    check_backend_conformance(backend, close=True)
    backend.close()  # twice: closing is safe whenever it happens
