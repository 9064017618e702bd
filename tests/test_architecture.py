"""The package layout is the architecture: imports flow one way, with no circle, lazy or type-only.

Read from the source with `ast` (no module is imported), every `import` counts: top-level, inside a
function, under `if TYPE_CHECKING:`; and an import of a module runs the `__init__` of each package above it
that is not already a package of the importer, so that is an edge too. docs/design.md "Layers" gives the
reasons for the order. Each checker takes the tree's root, so the self-tests run it on small trees that
break one rule each and see it reported.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

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


def module_files(repo: Path = REPO) -> dict[str, Path]:
    mods = {}
    for root in ROOTS:
        for path in sorted((repo / root).rglob("*.py")):
            name = ".".join(path.relative_to(repo).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def _packages(name: str) -> list[str]:
    """`a.b.c` -> [a, a.b, a.b.c]: what importing it runs, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _imported(node: ast.AST, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules an import statement names (before the packages above them are added)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
    return subs if len(subs) == len(node.names) else [base, *subs]


def import_edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the project's modules it imports}. `from pkg import sub` / `import pkg.sub` is an edge to
    pkg.sub and to pkg (whose `__init__` runs first), unless pkg is a package of the importer itself (its
    `__init__` ran before the importer did)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = set(_packages(name))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, package, mods):
                while target and target not in mods:  # `import a.b.c` of a module a.b.c, or a name in a.b
                    target = target.rpartition(".")[0]
                if target:
                    edges[name].update(p for p in _packages(target) if p in mods and p not in own)
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


# ----------------------------------------------------------------------------------------------------------
# The three rules, each a list of what breaks it in the tree at `repo` (empty: kept)
# ----------------------------------------------------------------------------------------------------------


def import_circles(repo: Path = REPO) -> list[str]:
    """One line per circle: its edges."""
    edges = import_edges(module_files(repo))
    return [" / ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c) for c in cycles(edges)]


def command_line_imports(repo: Path = REPO) -> list[str]:
    """Library modules importing converters/, data/ or configs/."""
    edges = import_edges(module_files(repo))
    return sorted(f"{a} -> {b}" for a, bs in edges.items() if a.startswith("empatheia_jax")
                  for b in bs if b.split(".")[0] in OUTSIDE)


def upward_imports(repo: Path = REPO) -> list[str]:
    """Library modules importing a layer above their own."""
    edges = import_edges(module_files(repo))
    return sorted(f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, bs in edges.items()
                  if a.startswith("empatheia_jax") for b in bs
                  if b.startswith("empatheia_jax") and layer_of(b) > layer_of(a))


def test_every_library_module_has_a_layer():
    unplaced = [m for m in module_files() if m.startswith("empatheia_jax") and layer_of(m) is None]
    assert not unplaced, f"modules outside every layer of LAYERS: {unplaced}"


def test_no_import_circle():
    found = import_circles()
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_library_never_imports_the_command_lines_above_it():
    found = command_line_imports()
    assert not found, "the library imports converters/, data/ or configs/:\n" + "\n".join(found)


def test_imports_flow_down_the_layers():
    found = upward_imports()
    assert not found, "imports up the layers:\n" + "\n".join(found)


# ----------------------------------------------------------------------------------------------------------
# The checks can fail: small trees (the real layer names) that each break one rule
# ----------------------------------------------------------------------------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """`files` ({path: source}) under `root`, with an empty `__init__.py` in every folder that lacks one."""
    for rel, source in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for folder in {p.parent for p in root.rglob("*.py")}:
        while folder != root:
            (folder / "__init__.py").touch()
            folder = folder.parent
    return root


LEGAL = {  # the library importing down and sideways, a command line importing the library: nothing to report
    "empatheia_jax/__init__.py": "def __getattr__(name):\n    from empatheia_jax.serve import chat\n",
    "empatheia_jax/logs.py": "",
    "empatheia_jax/models/llama.py": "from empatheia_jax import logs\nfrom ..data import schema\n",
    "empatheia_jax/models/lora.py": "from . import llama\n",
    "empatheia_jax/data/schema.py": "",
    "empatheia_jax/serve/chat.py": "from empatheia_jax.models import llama, lora\n",
    "converters/export_hf.py": "import empatheia_jax\nfrom empatheia_jax.serve.chat import run\n",
    "configs/tiny.py": "from configs import base\n",
    "configs/base.py": "",
}
LAZY = "def merge():\n    from empatheia_jax.serve import chat\n    return chat\n"
TYPE_ONLY = "import typing\nif typing.TYPE_CHECKING:\n    from empatheia_jax.serve.chat import run\n"

# case: (the checker that must report it, what it reports, the files that break the rule)
BROKEN = {
    "upward import": (
        upward_imports, "empatheia_jax.models.llama (layer 3) -> empatheia_jax.train.trainer (layer 5)",
        {"empatheia_jax/models/llama.py": "from empatheia_jax.train import trainer\n",
         "empatheia_jax/train/trainer.py": ""}),
    "library imports converters/": (
        command_line_imports, "empatheia_jax.data.schema -> converters.dreamtalk",
        {"empatheia_jax/data/schema.py": "import converters.dreamtalk\n", "converters/dreamtalk.py": ""}),
    "library imports configs/": (
        command_line_imports, "empatheia_jax.train.config -> configs.tiny",
        {"empatheia_jax/train/config.py": "def load():\n    from configs import tiny\n"}),
    "upward import inside a function": (
        upward_imports, "empatheia_jax.models.vae (layer 3) -> empatheia_jax.serve.chat (layer 6)",
        {"empatheia_jax/models/vae.py": LAZY}),
    "upward import for type hints": (
        upward_imports, "empatheia_jax.models.vae (layer 3) -> empatheia_jax.serve.chat (layer 6)",
        {"empatheia_jax/models/vae.py": TYPE_ONLY}),
    "circle through a package __init__": (  # cli imports reference.card: reference/__init__ runs first
        import_circles, "empatheia_jax.cli -> empatheia_jax.reference",
        {"empatheia_jax/cli.py": "from empatheia_jax.reference import card\n\n\ndef main(): ...\n",
         "empatheia_jax/reference/__init__.py": "from empatheia_jax.cli import main\n",
         "empatheia_jax/reference/card.py": ""}),
}


def test_a_legal_tree_reports_nothing(tmp_path):
    root = write_tree(tmp_path, LEGAL)
    assert import_circles(root) == command_line_imports(root) == upward_imports(root) == []


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_checks_can_fail(tmp_path, case):
    """A legal tree with one rule broken: the checker the real test runs reports that import."""
    checker, reported, files = BROKEN[case]
    root = write_tree(tmp_path, {**LEGAL, **files})
    found = checker(root)
    assert any(reported in line for line in found), (case, found)
    others = [c(root) for c in (import_circles, command_line_imports, upward_imports) if c is not checker]
    assert others == [[], []], (case, others)  # and nothing else: each case breaks only its rule


def test_the_real_graph_and_layers():
    """The reader sees the real tree's lazy import; the cycle finder finds a circle; the layers' order."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    edges = import_edges(module_files())
    assert "empatheia_jax.serve.load" in edges["empatheia_jax"]  # lazy, inside __getattr__
    assert layer_of("empatheia_jax.train.trainer") > layer_of("empatheia_jax.models.llama")
    assert layer_of("empatheia_jax") == len(LAYERS) - 1
