"""The docs describe the code as it is: checks that keep docs/design.md and docs/benchmarks.md honest.

- docs/design.md's module map (the fenced block between `<!-- module-map -->` and `<!-- /module-map -->`)
  lists every module of empatheia_jax/, converters/ and data/, and nothing that does not exist. One line
  per entry: the path first, then its one-line contract. Every `.py` file is an entry except
  `__init__.py`; every directory holding Python files is an entry too, written with a trailing `/` (its
  line describes the package, i.e. its `__init__.py`). Other existing paths (data/ed/, configs/) may be
  listed.
- docs/design.md is a reference about the code: it never mentions the working sessions that wrote it.
- No source file under the code folders cites a working session by number (the word followed by a
  number): comments and docstrings cite a section of docs/design.md by name instead. Legitimate uses
  ("the session cache", `scope="session"`, onnxruntime's `InferenceSession`) have no number after the
  word and pass.
- docs/benchmarks.md opens with its current-figures table (the first section after the title).

Reads text only: no import of the package, so it runs in a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DESIGN = REPO / "docs" / "design.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"

MAP_ROOTS = ("empatheia_jax", "converters", "data")
MAP_START, MAP_END = "<!-- module-map -->", "<!-- /module-map -->"

CITATION_ROOTS = ("empatheia_jax", "converters", "data", "configs", "bench", "launch", "tests")
CITATION_FILES = ("Makefile",)
CITATION_SUFFIXES = (".py", ".sh", ".sbatch")

# The word anywhere in design.md; the word followed by a number (space, "-" or "_" between, any case, plural
# too) anywhere in code. Word boundaries keep "possession" and "InferenceSession" out.
SESSION_WORD = re.compile(r"\bsessions?\b", re.IGNORECASE)
SESSION_CITATION = re.compile(r"\bsessions?[\s_-]*\d", re.IGNORECASE)

CURRENT_FIGURES = "Current figures"
FIGURE_COLUMNS = ("benchmark", "figure", "command", "machine", "date")


# --- parsers (pure functions of text, self-tested below) -------------------------------------------------


def parse_module_map(text: str) -> dict[str, str]:
    """{path: contract} from the fenced block between the module-map markers. Raises ValueError when the
    markers or the fence are missing, a line has no contract, or a path is listed twice."""
    if text.count(MAP_START) != 1 or text.count(MAP_END) != 1:
        raise ValueError(f"need exactly one {MAP_START} and one {MAP_END}")
    block = text.split(MAP_START, 1)[1].split(MAP_END, 1)[0].strip()
    if not (block.startswith("```") and block.endswith("```")):
        raise ValueError("the module map is not one fenced block")
    entries: dict[str, str] = {}
    for line in block.splitlines()[1:-1]:
        if not line.strip():
            continue
        path, _, contract = line.strip().partition(" ")
        if not contract.strip():
            raise ValueError(f"module map line without a contract: {line!r}")
        if path in entries:
            raise ValueError(f"module map lists {path} twice")
        entries[path] = contract.strip()
    return entries


def expected_entries(repo: Path, roots: tuple[str, ...] = MAP_ROOTS) -> set[str]:
    """What the map must list: every .py file except __init__.py, and every directory holding a .py file."""
    out: set[str] = set()
    for root in roots:
        for path in (repo / root).rglob("*.py"):
            rel = path.relative_to(repo)
            if "__pycache__" in rel.parts:
                continue
            out.add(rel.parent.as_posix() + "/")
            if path.name != "__init__.py":
                out.add(rel.as_posix())
    return out


def map_problems(listed: dict[str, str], expected: set[str], exists) -> list[str]:
    """Modules missing from the map, and listed paths that do not exist (`exists(path) -> bool`)."""
    problems = [f"missing from the module map: {p}" for p in sorted(expected - set(listed))]
    problems += [f"listed in the module map but not in the tree: {p}" for p in sorted(listed)
                 if not exists(p)]
    return problems


def session_mentions(text: str) -> list[str]:
    """Lines of a document that mention the word "session" (any case), numbered."""
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if SESSION_WORD.search(line)]


def session_citations(text: str) -> list[str]:
    """Lines of a source file that cite a session by number, numbered."""
    return [f"{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
            if SESSION_CITATION.search(line)]


def first_section(text: str) -> tuple[str, list[str]]:
    """(heading, body lines) of the first `## ` section of a Markdown document with one `# ` title."""
    lines = text.splitlines()
    titles = [i for i, line in enumerate(lines) if line.startswith("# ")]
    if not titles or any(line.strip() and not line.startswith("#") and i < titles[0]
                         for i, line in enumerate(lines)):
        raise ValueError("the document does not start with a `# ` title")
    heads = [i for i, line in enumerate(lines) if line.startswith("## ")]
    if not heads:
        raise ValueError("no `## ` section")
    start = heads[0]
    end = next((i for i in heads[1:]), len(lines))
    return lines[start][3:].strip(), lines[start + 1:end]


def table_rows(body: list[str]) -> tuple[list[str], list[list[str]]]:
    """(header cells, data rows) of the first Markdown table in `body`."""
    rows = [line.strip() for line in body if line.strip().startswith("|")]
    if len(rows) < 2 or not set(rows[1].replace("|", "").strip()) <= set("-: "):
        raise ValueError("no Markdown table (header + separator line)")

    def cells(row: str) -> list[str]:
        return [c.strip() for c in row.strip().strip("|").split("|")]

    return cells(rows[0]), [cells(r) for r in rows[2:]]


def figures_problems(text: str) -> list[str]:
    """Why docs/benchmarks.md does not open with a complete current-figures table ([] when it does)."""
    try:
        heading, body = first_section(text)
        header, rows = table_rows(body)
    except ValueError as e:
        return [str(e)]
    problems = []
    if heading != CURRENT_FIGURES:
        problems.append(f"the first section is {heading!r}, not {CURRENT_FIGURES!r}")
    lowered = [h.lower() for h in header]
    for col in FIGURE_COLUMNS:
        if not any(col in h for h in lowered):
            problems.append(f"the table has no {col!r} column (header: {header})")
    if not rows:
        problems.append("the table has no rows")
    for row in rows:
        if len(row) != len(header) or not all(row):
            problems.append(f"a row with an empty or missing cell: {row}")
        elif re.search(r"\b(TODO|TBD|XXX)\b|\?\?", " ".join(row)):
            problems.append(f"a row with a placeholder: {row}")
    return problems


# --- the checks ------------------------------------------------------------------------------------------


def test_module_map_lists_every_module_and_only_existing_paths():
    listed = parse_module_map(DESIGN.read_text())
    problems = map_problems(listed, expected_entries(REPO), lambda p: (REPO / p).exists())
    assert not problems, "docs/design.md module map:\n" + "\n".join(problems)


def test_design_doc_never_mentions_sessions():
    found = session_mentions(DESIGN.read_text())
    assert not found, "docs/design.md mentions sessions (describe the code, not its history):\n" + "\n".join(
        found)


def code_files() -> list[Path]:
    files = [REPO / name for name in CITATION_FILES if (REPO / name).is_file()]
    for root in CITATION_ROOTS:
        files += [p for p in sorted((REPO / root).rglob("*")) if p.suffix in CITATION_SUFFIXES
                  and "__pycache__" not in p.parts]
    return files


def test_no_code_comment_cites_a_session():
    found = [f"{p.relative_to(REPO)}:{hit}" for p in code_files() for hit in session_citations(p.read_text())]
    assert not found, ("session citations in code (cite a docs/design.md section by name instead):\n"
                       + "\n".join(found))


def test_benchmarks_open_with_the_current_figures_table():
    problems = figures_problems(BENCHMARKS.read_text())
    assert not problems, "docs/benchmarks.md:\n" + "\n".join(problems)


# --- every check can fail --------------------------------------------------------------------------------


def test_the_module_map_parser_and_comparison_can_fail(tmp_path):
    doc = "\n".join(["# x", MAP_START, "```", "pkg/            the package", "pkg/a.py        module a",
                     "pkg/gone.py     removed since", "```", MAP_END, ""])
    listed = parse_module_map(doc)
    assert listed == {"pkg/": "the package", "pkg/a.py": "module a", "pkg/gone.py": "removed since"}
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "sub/__init__.py"):
        (tmp_path / "pkg" / name).write_text("")
    expected = expected_entries(tmp_path, ("pkg",))
    assert expected == {"pkg/", "pkg/a.py", "pkg/b.py", "pkg/sub/"}
    problems = map_problems(listed, expected, lambda p: (tmp_path / p).exists())
    assert problems == ["missing from the module map: pkg/b.py", "missing from the module map: pkg/sub/",
                        "listed in the module map but not in the tree: pkg/gone.py"]
    with pytest.raises(ValueError, match="contract"):
        parse_module_map(doc.replace("module a", ""))
    with pytest.raises(ValueError, match="twice"):
        parse_module_map(doc.replace("pkg/gone.py", "pkg/a.py"))
    with pytest.raises(ValueError, match="exactly one"):
        parse_module_map(doc.replace(MAP_END, ""))


def test_the_session_checks_can_fail():
    word = "Ses" + "sion"  # spelled apart so that this file passes its own check
    assert session_mentions(f"# Design\n\n## {word} 3: a heading\nplain\n") == [f"3: ## {word} 3: a heading"]
    assert session_mentions(f"a {word.lower()}-scoped fixture") != []
    assert session_mentions("possession; InferenceSession") == []
    for cited in (f"{word} 12", f"({word.lower()} 3)", f"{word.lower()}-4", f"{word.lower()}s 10-12"):
        assert session_citations(f"x = 1  # see {cited}") != [], cited
    for legit in (f"the {word.lower()} cache", f'scope="{word.lower()}"', f"ort.Inference{word}(path)",
                  f"start_new_{word.lower()}=True", f"a run longer than a {word.lower()}"):
        assert session_citations(legit) == [], legit


def test_the_current_figures_check_can_fail():
    table = ["| benchmark | figure | command | machine / device | date |", "|---|---|---|---|---|",
             "| decode | 35 tok/s | `make bench` | 2-core CPU | 2026-11-22 |"]
    good = "\n".join(["# Benchmarks", "", "intro", "", "## Current figures", "", *table, "", "## Other", "x"])
    assert figures_problems(good) == []
    assert figures_problems(good.replace("## Current figures", "## Input pipeline"))[0].startswith(
        "the first section is")
    assert "no Markdown table" in figures_problems(good.replace("|---|---|---|---|---|", "no table"))[0]
    assert figures_problems(good.replace("35 tok/s", "TODO"))[0].startswith("a row with a placeholder")
    assert figures_problems(good.replace("| 2-core CPU |", "| |"))[0].startswith("a row with an empty")
    assert figures_problems(good.replace("| date |", "| when |"))[0].startswith("the table has no 'date'")
    moved = good.replace("## Current figures", "## Intro\n\n## Current figures")
    assert figures_problems(moved)[0] == "no Markdown table (header + separator line)"
