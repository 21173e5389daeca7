"""The package layout is the architecture: layers in flow order, each importing only earlier
layers; no import cycles; only ``meshplan.runtime`` imports torch; the testbed imports no torch.

The layers (docs/layout.md), earliest first. A module may import modules of its own layer
or of earlier ones. Function-level imports are allowed only where they keep torch out of a
process that does not need it (``cli`` and ``runtime`` importing torch-side modules lazily);
everywhere else an import is at module level, where the layering below sees it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "meshplan"

LAYERS = [
    ["meshplan", "meshplan.errors", "meshplan.units", "meshplan.limits", "meshplan.fileread", "meshplan.atomic_write",
     "meshplan.output_ledger", "meshplan.fileio", "meshplan.keymap"],
    ["meshplan.spec"],
    ["meshplan.catalog"],
    ["meshplan.config", "meshplan.config_errors", "meshplan.config_mesh", "meshplan.config_tables",
     "meshplan.config_toml"],
    ["meshplan.mesh"],
    ["meshplan.interop"],
    ["meshplan.pipeline"],
    ["meshplan.placement"],
    ["meshplan.compute"],
    ["meshplan.memory"],
    ["meshplan.comm"],
    ["meshplan.plan", "meshplan.plan_checks", "meshplan.plan_fidelity", "meshplan.plan_moe", "meshplan.plan_runtime"],
    ["meshplan.schedule"],
    ["meshplan.reliability", "meshplan.checkpoint_bytes", "meshplan.restart", "meshplan.restart_degrees",
     "meshplan.restart_meshes", "meshplan.restart_rank", "meshplan.restart_text", "meshplan.plan_fix",
     "meshplan.plan_fix_cp", "meshplan.plan_fix_ep", "meshplan.plan_fix_mask", "meshplan.plan_fix_nodes", "meshplan.plan_fix_rules", "meshplan.plan_variant", "meshplan.plan_capacity"],
    ["meshplan.search"],
    ["meshplan.report"],
    ["meshplan.compare"],
    ["meshplan.runtime"],
    ["meshplan.cli", "meshplan.__main__"],
]


def layer_of(module: str) -> int:
    """Index of the layer holding ``module`` (longest matching prefix)."""
    best, best_len = -1, -1
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/layout.md")
    return best


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module, at function level, line) for every meshplan/torch import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed, so no edge of the import graph
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.module:
                assert child.level == 0, f"{path}:{child.lineno}: relative import"
                base = child.module
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    out.append((full if _is_module(full) else base, in_function, child.lineno))
            elif isinstance(child, ast.Import):
                out.extend((a.name, in_function, child.lineno) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return [(m, f, ln) for m, f, ln in out if m.split(".")[0] in ("meshplan", "torch")]


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT.parent / rel).with_suffix(".py").exists() or (ROOT.parent / rel / "__init__.py").exists()


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def _imports_torch_transitively() -> set[str]:
    torchy = {m for m, imps in GRAPH.items() if any(i.startswith("torch") and not f for i, f, _ in imps)}
    changed = True
    while changed:
        changed = False
        for m, imps in GRAPH.items():
            if m not in torchy and any(i in torchy and not f for i, f, _ in imps):
                torchy.add(m)
                changed = True
    return torchy


def test_every_module_is_in_a_layer():
    for m in MODULES:
        layer_of(m)


def test_layers_import_only_earlier_layers():
    bad = [f"{m} (layer {layer_of(m)}) imports {i} (layer {layer_of(i)}), line {ln}"
           for m, imps in GRAPH.items() for i, _, ln in imps
           if i.startswith("meshplan") and layer_of(i) > layer_of(m)]
    assert not bad, "\n".join(bad)


def test_function_level_imports_only_keep_torch_lazy():
    """Outside ``cli`` and ``runtime`` no import hides in a function; there, only imports of
    modules that pull in torch (so ``meshplan plan`` never loads torch)."""
    torchy = _imports_torch_transitively()
    bad = []
    for m, imps in GRAPH.items():
        for i, in_function, ln in imps:
            if not in_function:
                continue
            lazy_ok = (m == "meshplan.cli" or m.startswith(("meshplan.cli.", "meshplan.runtime"))) and (
                i.startswith("torch") or i in torchy)
            if not lazy_ok:
                bad.append(f"{m}:{ln} imports {i} inside a function")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    """Over module-level and function-level imports together (a cycle hidden in a function
    is still a cycle)."""
    edges = {m: sorted({i for i, _, _ in imps if i in MODULES and i != m}) for m, imps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in edges[m]:
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for m in sorted(edges):
            if m not in state:
                dfs(m)
    finally:  # restored: a later test's parser depth (tomllib on nested arrays) depends on it
        sys.setrecursionlimit(limit)
    assert not cycles, "\n".join(cycles)


def test_only_runtime_imports_torch():
    bad = [f"{m}:{ln} imports {i}" for m, imps in GRAPH.items() for i, _, ln in imps
           if i.split(".")[0] == "torch" and not m.startswith("meshplan.runtime")]
    assert not bad, "\n".join(bad)


def test_testbed_imports_no_torch():
    torchy = _imports_torch_transitively()
    bad = sorted(m for m in MODULES if m.startswith("meshplan.runtime.testbed") and m in torchy)
    assert not bad, f"the testbed must run without torch: {bad}"


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_each_package_says_what_it_owns(package):
    path = MODULES[package]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{package}: the package docstring says what it owns"
    if package == "meshplan":
        return
    names = [n for n in tree.body if isinstance(n, ast.Assign) and any(
        isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
    assert names, f"{package}: __all__ lists what it exports"
