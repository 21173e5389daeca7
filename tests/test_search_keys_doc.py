"""Newcomer trial 55 #11: docs/input.md's "The `[search]` table" lists every key of ``[search]``
(:class:`meshplan.spec.search.SearchOptions`) once, with an example the config reader accepts and
the default the code has, so the table cannot drift from the code."""

from __future__ import annotations

import re
import tomllib

import pytest

from meshplan.config import config_from_dict
from meshplan.spec.search import SearchOptions
from tests.conftest import EXAMPLES
from tests.docs_text import DOCS

SECTION = "## The `[search]` table"


def _rows() -> dict[str, tuple[str, str, str]]:
    """``{key: (meaning, example, default)}`` of the table's rows (cells split on unescaped ``|``)."""
    text = (DOCS / "input.md").read_text()
    body = text[text.index(SECTION):]
    body = body[:body.find("\n## ", 1)] if "\n## " in body[1:] else body
    rows = {}
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        key, meaning, example, default = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        assert key.startswith("`") and key.endswith("`"), line
        assert key[1:-1] not in rows, f"{key} twice"
        rows[key[1:-1]] = (meaning, example, default)
    return rows


def _toml(value) -> str:
    """A default as TOML writes it: ``true``, ``8``, ``0.5``, ``2000``, ``["1f1b"]``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def test_the_table_has_every_key_once():
    assert list(_rows()) == list(SearchOptions.model_fields)  # the code's order, none missing, none extra


@pytest.mark.parametrize("key", list(SearchOptions.model_fields))
def test_each_default_is_the_codes(key):
    default = SearchOptions.model_fields[key].get_default(call_default_factory=True)
    cell = _rows()[key][2]
    if default is None:
        assert cell.startswith("unset"), (key, cell)
    else:  # the TOML of the code's default, in backticks at the cell's start
        assert cell.startswith(f"`{_toml(default)}`"), (key, cell, _toml(default))


def test_each_example_is_read_by_the_config_reader():
    """Each example, as the one key of ``[search]`` in examples/mini_2x4_tp2-dp4.toml, is read by
    the config reader (strict keys and types) to the value written."""
    base = tomllib.loads((EXAMPLES / "mini_2x4_tp2-dp4.toml").read_text())
    for key, (_, example, _) in _rows().items():
        assert example.startswith(f"`{key} = ") and example.endswith("`"), example
        table = tomllib.loads(example.strip("`"))
        cfg = config_from_dict({**base, "search": table})
        assert getattr(cfg.search, key) == table[key], key
