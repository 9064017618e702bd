"""The package layout is the architecture: imports flow one way, with no circle, lazy or type-only.

Read from the source with `ast` (no module is imported), every `import` counts: top-level, inside a
function, under `if TYPE_CHECKING:`. docs/design.md "Layers" gives the reasons for the order.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("empatheia_jax", "converters", "data", "configs")

# Lowest first. A module may import its own layer (without a circle) and the layers below it, never above.
LAYERS = (
    ("empatheia_jax.logs", "empatheia_jax.host_memory", "empatheia_jax.compile_cache",
     "empatheia_jax.sharding", "empatheia_jax.assets"),
    ("empatheia_jax.data",),
    ("empatheia_jax.generators",),
    ("empatheia_jax.models",),
    ("empatheia_jax.weights",),
    ("empatheia_jax.train",),
    ("empatheia_jax.serve",),
    ("empatheia_jax.eval",),
    ("empatheia_jax.cli", "empatheia_jax.reference", "empatheia_jax"),
)
# The offline command lines and dataset tools sit above the library and import it; it never imports them.
OUTSIDE = ("converters", "data", "configs")


def module_files() -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project's modules it imports}. `from pkg import sub` is an edge to pkg.sub alone."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for target in targets:
                while target and target not in mods:  # `import a.b.c` of a module a.b.c, or a name in a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def layer_of(module: str) -> int | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + ".") and prefix != "empatheia_jax":
                best = i
    return best


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_library_module_has_a_layer():
    unplaced = [m for m in module_files() if m.startswith("empatheia_jax") and layer_of(m) is None]
    assert not unplaced, f"modules outside every layer of LAYERS: {unplaced}"


def test_no_import_circle():
    edges = import_edges(module_files())
    found = cycles(edges)
    described = [" / ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in found]
    assert not found, "import circles:\n" + "\n".join(described)


def test_the_library_never_imports_the_command_lines_above_it():
    edges = import_edges(module_files())
    upward = sorted(f"{a} -> {b}" for a, bs in edges.items() if a.startswith("empatheia_jax")
                    for b in bs if b.split(".")[0] in OUTSIDE)
    assert not upward, "the library imports converters/, data/ or configs/:\n" + "\n".join(upward)


def test_imports_flow_down_the_layers():
    edges = import_edges(module_files())
    upward = sorted(f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, bs in edges.items()
                    if a.startswith("empatheia_jax") for b in bs
                    if b.startswith("empatheia_jax") and layer_of(b) > layer_of(a))
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_the_checks_can_fail():
    """The graph reader sees lazy and type-only imports, and the cycle finder finds a circle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges = import_edges(module_files())
    assert "empatheia_jax.serve.load" in edges["empatheia_jax"]  # lazy, inside __getattr__
    assert layer_of("empatheia_jax.train.trainer") > layer_of("empatheia_jax.models.llama")
    assert layer_of("empatheia_jax") == len(LAYERS) - 1
