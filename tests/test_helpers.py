"""The test helpers that decide whether a check runs at all: `require` / `skip_or_fail` (a missing
dependency must fail under CI, not skip), `needs_platform`, a scan that no test skips around them, and the
cache key of the converted SmolLM2 folder (a converter change must not be served the folder the old code
wrote)."""

from __future__ import annotations

import ast
import json
import os
import shutil
from pathlib import Path

import helpers
import pytest
from helpers import needs_platform, require, skip_or_fail

# ----------------------------------------------------------------------------------------------------------
# require / skip_or_fail
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["true", "1", "True", "yes"])
def test_missing_dependency_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="no 8 devices.*CI=true"):
        skip_or_fail("no 8 devices")
    with pytest.raises(pytest.fail.Exception, match="needs no_such_module_xyz \\(the reference\\)"):
        require("no_such_module_xyz", "the reference")
    with pytest.raises(pytest.fail.Exception, match="found 1"):
        require(1 == 8, "found 1")


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_missing_dependency_skips_on_a_developer_box(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="no 8 devices") as info:
        skip_or_fail("no 8 devices")
    assert info.value.allow_module_level  # test_lora.py requires its references at module level
    with pytest.raises(pytest.skip.Exception, match="needs no_such_module_xyz \\(the reference\\)"):
        require("no_such_module_xyz", "the reference")
    with pytest.raises(pytest.skip.Exception, match="found 1"):
        require(1 == 8, "found 1")


@pytest.mark.parametrize("value", ["true", None])
def test_what_is_there_passes_through(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert require("json", "stdlib") is json
    assert require(True, "always") is None
    assert needs_platform(True, "always") is None


@pytest.mark.parametrize("value", ["true", None])
def test_what_the_platform_lacks_skips_even_under_ci(monkeypatch, value):
    """glibc's mallopt off Linux: no runner can install it, so CI skips too (test_host_memory.py)."""
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="not on this platform: glibc"):
        needs_platform(False, "glibc's mallopt")


def raw_skips(path: Path) -> list[str]:
    """`name:line what` of each skip in `path` that bypasses `require` / `skip_or_fail` (and so skips under
    CI too): pytest.importorskip, a call of pytest.skip, pytest.mark.skip / skipif (decorator, pytestmark or
    a param's marks), and those imported from pytest. `pytest.skip.Exception` (catching one) is fine."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        what = None
        if isinstance(node, ast.ImportFrom) and node.module == "pytest":
            names = [a.name for a in node.names if a.name in ("skip", "importorskip")]
            what = f"from pytest import {', '.join(names)}" if names else None
        elif isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if node.attr == "importorskip" or dotted.endswith(("mark.skip", "mark.skipif")):
                what = dotted
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("pytest.skip", "skip"):
            what = f"{ast.unparse(node.func)}("
        if what:
            found.append((node.lineno, f"{path.name}:{node.lineno} {what}"))
    return [line for _, line in sorted(found)]


def test_no_test_skips_around_require():
    """Every skip goes through helpers.py: a raw one skips silently under CI (test_vae.py's
    `pytest.importorskip("torch")` did), where a missing dependency must fail."""
    found = [line for path in sorted(helpers.REPO.joinpath("tests").glob("*.py")) if path.name != "helpers.py"
             for line in raw_skips(path)]
    assert not found, "raw skips (use helpers.require / skip_or_fail / needs_platform):\n" + "\n".join(found)


def test_the_skip_scan_finds_each_raw_form(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest\n"
        "from pytest import importorskip, raises\n"
        "torch = pytest.importorskip('torch')\n"
        "pytestmark = pytest.mark.skipif(True, reason='x')\n"
        "@pytest.mark.skip(reason='x')\n"
        "def test_a():\n"
        "    pytest.skip('x')\n"
        "@pytest.mark.parametrize('v', [pytest.param(1, marks=pytest.mark.skip)])\n"
        "def test_b(v):\n"
        "    with pytest.raises(pytest.skip.Exception):\n"
        "        require(False, 'fine')\n"
    )
    assert raw_skips(sample) == [
        "test_sample.py:2 from pytest import importorskip", "test_sample.py:3 pytest.importorskip",
        "test_sample.py:4 pytest.mark.skipif", "test_sample.py:5 pytest.mark.skip",
        "test_sample.py:7 pytest.skip(", "test_sample.py:8 pytest.mark.skip",
    ]


# ----------------------------------------------------------------------------------------------------------
# The converted-SmolLM2 cache key
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def sources_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the converter's sources under a fake repository root (the real files are never edited)."""
    for rel in helpers.CONVERTER_SOURCES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(helpers.REPO / rel, tmp_path / rel)
    monkeypatch.setattr(helpers, "REPO", tmp_path)
    return tmp_path


@pytest.mark.parametrize("rel", helpers.CONVERTER_SOURCES)
def test_a_converter_change_changes_the_cache_key(sources_copy, rel):
    real = helpers.converted_key()  # the copy has the same names and bytes: the same key
    path = sources_copy / rel
    text = path.read_text()
    path.write_text(text + "\n# a change\n")
    changed = helpers.converted_key()
    assert changed != real and changed.startswith(helpers.gguf_key() + "-")
    path.write_text(text)
    assert helpers.converted_key() == real  # content, not mtime: restoring the file restores the key


def test_a_package_upgrade_changes_the_cache_key(monkeypatch):
    import importlib.metadata

    real = helpers.converted_key()
    versions = {"transformers": "0.0.1"}
    original = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda pkg: versions.get(pkg) or original(pkg))
    assert helpers.converted_key() != real


def test_a_reinstalled_gguf_keeps_its_cache_key(tmp_path, monkeypatch):
    """A fresh clone's `.venv` holds the same wheel with a new mtime: it must reuse the converted folder."""
    copy = tmp_path / helpers.GGUF_NAME
    shutil.copyfile(helpers.gguf_path(), copy)
    monkeypatch.setattr(helpers, "gguf_path", lambda: copy)
    key = helpers.gguf_key()
    os.utime(copy, ns=(1, 1))
    assert helpers.gguf_key() == key
    with open(copy, "r+b") as f:  # one byte of the weights changed: another GGUF, another key
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert helpers.gguf_key() != key


def test_the_gguf_identity_is_part_of_the_cache_key(monkeypatch):
    real = helpers.converted_key()
    monkeypatch.setattr(helpers, "gguf_key", lambda: "1-2")
    assert helpers.converted_key() != real and helpers.converted_key().startswith("1-2-")


def _project_imports(path: Path) -> set[str]:
    """Project modules (converters.*, empatheia_jax.*) a file imports. A module's function-level imports
    count (conservative: a function the conversion calls may run them); a package __init__'s do not, nor
    its `if TYPE_CHECKING:` ones: importing a submodule runs only the __init__'s top level (and
    empatheia_jax/__init__.py imports its heavy modules on first use)."""
    init = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif init and (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            or isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return {n for n in found if n.split(".")[0] in ("converters", "empatheia_jax")}


def _module_file(module: str) -> str | None:
    parts = module.split(".")
    for rel in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
        if (helpers.REPO / rel).is_file():
            return rel
    return None  # a name imported from a package (`from empatheia_jax import x` names x's module below)


def test_the_key_covers_every_project_module_the_converter_imports():
    """The import closure of `empatheia_jax.weights.hf_to_flax` within the project is CONVERTER_SOURCES,
    the package __init__ files and sharding.py (checkpoint_io imports it for load_checkpoint(mesh=), which
    converting never calls). A new import fails this test until it is added to CONVERTER_SOURCES or to this
    list."""
    todo, closure = ["empatheia_jax.weights.hf_to_flax"], set()
    while todo:
        rel = _module_file(todo.pop())
        if rel is None or rel in closure:
            continue
        closure.add(rel)
        # importing a.b.c runs a/__init__.py and a/b/__init__.py too
        parts = rel.split("/")
        for i in range(1, len(parts)):
            init = "/".join(parts[:i]) + "/__init__.py"
            if (helpers.REPO / init).is_file() and init not in closure:
                todo.append(".".join(parts[:i]))
        todo.extend(_project_imports(helpers.REPO / rel))
    not_keyed = {
        "empatheia_jax/__init__.py", "empatheia_jax/models/__init__.py", "empatheia_jax/weights/__init__.py",
        "empatheia_jax/data/__init__.py", "empatheia_jax/sharding.py",
    }
    assert closure - not_keyed == set(helpers.CONVERTER_SOURCES)
