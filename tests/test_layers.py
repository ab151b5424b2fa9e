"""The package's layers, read from its source: every import (module level, inside functions,
under TYPE_CHECKING) points down the layers of docs/architecture.md, and no two modules import
each other, directly or round a longer circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module may import its own layer and the layers below it, never above.
LAYERS = [
    ("kernels",),
    ("config",),
    ("model", "data"),
    ("parallel",),
    ("plan",),
    ("train",),
    ("interop",),
    ("ablation", "cli", "__main__"),
]
# Lower layers that a layer must not import although they sit below it (DESIGN.md: model/
# never imports data/, data/ never imports model/).
FORBIDDEN = {"model": {"data"}, "data": {"model", "parallel"}}


def module_name(path: Path) -> str:
    if path.is_relative_to(ROOT / "kernels"):
        rel = Path("moetrain") / "kernels" / path.relative_to(ROOT / "kernels")
    else:
        rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    files = [*(ROOT / "moetrain").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")]
    return {module_name(f): f for f in files}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from a import b`` counts a.b if it is one)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t != "moetrain":
                out.add(t)
    return out


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank_of(layer: str) -> int:
    for i, names in enumerate(LAYERS):
        if layer in names:
            return i
    raise AssertionError(f"moetrain.{layer} is in no layer of tests/test_layers.py: add it")


def graph() -> dict[str, set[str]]:
    mods = package_modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        if mod == "moetrain":
            continue
        mine = layer_of(mod)
        for dep in deps:
            theirs = layer_of(dep)
            if rank_of(theirs) > rank_of(mine) or theirs in FORBIDDEN.get(mine, ()):
                bad.append(f"{mod} imports {dep}")
    return sorted(bad)


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_imports_point_down_the_layers() -> None:
    assert upward_imports(graph()) == []


def test_no_import_circles() -> None:
    # A package's __init__ re-exporting its modules is not a circle of the modules
    # themselves: drop edges into a package from its own submodules.
    g = graph()
    g = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in g.items()}
    assert circles(g) == []


def test_the_checks_can_fail() -> None:
    g = graph()
    g["moetrain.model.moe"] = g["moetrain.model.moe"] | {"moetrain.parallel.dims"}
    g["moetrain.train.trainer"] = g["moetrain.train.trainer"] | {"moetrain.interop.init"}
    assert upward_imports(g) == [
        "moetrain.model.moe imports moetrain.parallel.dims",
        "moetrain.train.trainer imports moetrain.interop.init",
    ]
    g["moetrain.data.sources"] = g["moetrain.data.sources"] | {"moetrain.data.prepare"}
    g["moetrain.data.prepare"] = g["moetrain.data.prepare"] | {"moetrain.data.sources"}
    assert ["moetrain.data.prepare", "moetrain.data.sources"] in circles(g)


@pytest.mark.parametrize("layer", sorted({layer_of(m) for m in package_modules()} - {"__init__"}))
def test_every_subpackage_has_a_layer(layer: str) -> None:
    rank_of(layer)
