"""The documentation set (README.md + docs/*.md, :mod:`tests.docs_text`): a README a newcomer can
read (two newcomer trials: "README is 1,529 lines, table cells a thousand+ characters"), every
command's full text in docs/commands.md, and every docs/ path the code points users to exists."""

from __future__ import annotations

import re

import typer

from meshplan.cli import app
from tests.docs_text import DOCS, README, ROOT, command_sections, doc_files

#: the newcomer brief's targets: README under about 450 lines, a command-table cell about 300 characters
README_MAX_LINES = 450
CELL_MAX_CHARS = 300


def _table_cells(text: str) -> list[str]:
    """Every cell of every Markdown table row (``| a | b |``), escaped pipes kept inside a cell."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| :]+\|", line):
            cells += [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    return cells


def test_readme_is_short_and_its_cells_are_short():
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    long = [c[:60] for c in _table_cells(text) if len(c) > CELL_MAX_CHARS]
    assert long == []


def test_readme_keeps_the_two_commands_as_ci_and_make_use_them():
    text = README.read_text()
    assert "```\nmake demo\n```" in text and "```\nmake test\n```" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^demo:", (ROOT / "Makefile").read_text(), re.M)


def test_readme_links_every_docs_file_and_each_exists():
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)[)#]", text))
    present = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert linked == present and len(present) == 7


def test_every_top_level_command_has_a_readme_row_and_a_docs_section():
    sections = command_sections()
    readme = README.read_text()
    for name, cmd in typer.main.get_command(app).commands.items():
        if hasattr(cmd, "commands"):  # bench, testbed: groups, a section per row
            assert any(s.startswith(name + " ") for s in sections), name
            assert f"| `{name} " in readme, name
            continue
        assert name in sections, name
        assert sections[name].lstrip().startswith(f"`{name} "), name
        assert re.search(rf"^\| `{re.escape(name)}[ `]", readme, re.M), name


def test_every_docs_path_named_in_the_code_exists():
    """A pointer such as ``(docs/fidelity.md)`` in meshplan/ or its --help names a file that exists
    (a path with a folder under docs/, another project's, is not ours)."""
    named = set()
    for path in (ROOT / "meshplan").rglob("*.py"):
        named |= set(re.findall(r"(?<![\w/.-])docs/[\w-]+\.md", path.read_text()))
    assert {"docs/fidelity.md", "docs/input.md", "docs/commands.md", "docs/conventions.md"} <= named
    assert [n for n in sorted(named) if not (ROOT / n).is_file()] == []


def test_no_code_points_users_to_a_readme_section_that_moved():
    """The moved sections' names after "README" (the README keeps "Fidelity" only as a summary)."""
    moved = ("Input", "Fidelity", "Conventions", "Outputs", "Layout", "Foreign configs", "Use your own")
    hits = []
    for path in (ROOT / "meshplan").rglob("*.py"):
        for m in re.finditer(r"README,? \\?\"(\w[\w ]*)", path.read_text()):
            if m.group(1).startswith(moved):
                hits.append(f"{path.name}: {m.group(0)}")
    assert hits == []


def test_doc_files_are_readme_then_docs():
    files = doc_files()
    assert files[0] == README and [p.parent for p in files[1:]] == [DOCS] * 7


#: the docsplit brief: docs/commands.md had 6 lines over 2,000 characters (search's 13,457); a
#: line of prose or a table row stays within LINE_MAX_CHARS, and only a line that is one quoted
#: output string (a single `...` span, kept verbatim so tests can find it) may reach QUOTE_MAX_CHARS
LINE_MAX_CHARS = 400
QUOTE_MAX_CHARS = 600
_QUOTE_LINE = re.compile(r"\s*(- )?\(?`[^`]+`[).,;:]*")


def _long_lines(text: str) -> list[str]:
    """The lines of TEXT over the limits above, each as its first 60 characters."""
    return [
        line[:60] for line in text.splitlines()
        if len(line) > LINE_MAX_CHARS and not (len(line) <= QUOTE_MAX_CHARS and _QUOTE_LINE.fullmatch(line))
    ]


def test_long_lines_are_caught():
    """The rule itself: a 401-character prose line is long, a 500-character quoted string is not,
    a 601-character one is."""
    assert _long_lines("a " * 200 + "b") == ["a " * 30]
    assert _long_lines("  (`" + "x" * 495 + "`);") == []
    assert len(_long_lines("`" + "x" * 599 + "`")) == 1


def test_no_docs_line_is_too_long():
    long = {p.name: _long_lines(p.read_text()) for p in sorted(DOCS.glob("*.md"))}
    assert {name: lines for name, lines in long.items() if lines} == {}
