"""The documentation set that tests check documented strings against: README.md and docs/*.md.

The README keeps the overview, a short command table and the config example; the full text of
each command and the other sections live in docs/ (docs/commands.md: one ``## meshplan COMMAND``
section per command, its signature on the first line after the heading). Tests read them here,
so that a documented string is checked wherever the text now is.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_files() -> list[Path]:
    """README.md first, then docs/*.md in name order."""
    return [README] + sorted(DOCS.glob("*.md"))


def docs_text() -> str:
    """Every documentation file's text, README first, separated by a blank line."""
    return "\n\n".join(p.read_text() for p in doc_files())


def command_sections() -> dict[str, str]:
    """docs/commands.md's ``## meshplan NAME`` sections by NAME (``plan``, ``bench rank``...),
    each the text up to the next ``## `` heading."""
    text = (DOCS / "commands.md").read_text()
    parts = re.split(r"^## meshplan (.+)$", text, flags=re.M)
    return {name.strip(): re.split(r"^## ", body, flags=re.M)[0] for name, body in zip(parts[1::2], parts[2::2])}


def command_signature(name: str) -> str:
    """The signature line of command NAME (``plan CONFIG [--rank R] ...``), the first non-empty
    line of its section."""
    return next(line for line in command_sections()[name].splitlines() if line.strip())
