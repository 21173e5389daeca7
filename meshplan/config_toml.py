"""A TOML text parsed, every tomllib failure one :class:`~meshplan.errors.ConfigError` line naming
the file and, where tomllib gives a line, the dotted key set there (a key given twice, a number
written with a k/M/G suffix); read by :func:`meshplan.config.load_config`, the calibration and
foreign-config readers and ``meshplan rank``.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from meshplan.config_errors import _not_a_number
from meshplan.errors import ConfigError
from meshplan.limits import over


def parse_toml(text: str, name: str, field: str = "config") -> dict[str, Any]:
    """``tomllib.loads(text)`` with every failure one ConfigError naming ``field`` and the file
    ``name``: syntax errors, integers past Python's 4,300-digit limit, nesting past the
    interpreter's recursion limit."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(field, f"{name}: not valid TOML ({_given_twice(str(e), text) or _bad_value(str(e), text) or e})"
                          ) from None
    except RecursionError:
        raise ConfigError(field, f"{name}: arrays or tables nested too deeply to read; "
                                 f"{over('toml depth', 'the nesting')}") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise ConfigError(field, f"{name}: not valid TOML ({str(e).splitlines()[0]}); "
                                 f"numbers are bounded (see meshplan/limits.py)") from None


def _given_twice(message: str, text: str) -> str | None:
    """tomllib's "Cannot overwrite a value (at line L, ...)" of a key given twice, with the
    key's dotted name (its table header and the key before ``=`` on line L); None for other
    errors.

    >>> _given_twice("Cannot overwrite a value (at line 3, column 6)", "[training]\\nsteps = 1\\nsteps = 2")
    'training.steps given twice (line 3); keep one'
    """
    m = re.fullmatch(r"Cannot overwrite a value \(at line (\d+), column \d+\)", message)
    lines = text.splitlines()
    if m is None or not 0 < int(m.group(1)) <= len(lines):
        return None
    row = int(m.group(1))
    return f"{_key_at(lines, row)} given twice (line {row}); keep one"


def _key_at(lines: list[str], row: int) -> str:
    """The dotted key set on line ``row`` (1-based): its table header and the key before ``=``."""
    key = lines[row - 1].split("=", 1)[0].strip().replace('"', "").replace("'", "")
    heads = (re.fullmatch(r"\s*\[\[?\s*([\w.\-\"' ]+?)\s*\]\]?\s*(#.*)?", x) for x in reversed(lines[:row - 1]))
    table = next((h.group(1).replace('"', "").replace("'", "") for h in heads if h), None)
    return f"{table + '.' if table else ''}{key}"


def _bad_value(message: str, text: str) -> str | None:
    """Any other tomllib error "(at line L, column C)" on a ``key = value`` line, with the key's
    dotted name and, for a number written with a k/M/G suffix (``seq_len = 4k``), the line to
    write (as for the quoted ``"4k"``, :func:`meshplan.config_errors._not_a_number`); None when
    line L sets no key (newcomer trial 22 #4).

    >>> _bad_value("Expected newline (at line 2, column 11)", "[training]\\nseq_len = 4k")
    'training.seq_len (line 2): Expected newline; "4k" is not a number (TOML has no k suffix): write seq_len = 4096 (4 x 1024)'
    """
    m = re.fullmatch(r"(.*?) ?\(at line (\d+), column \d+\)", message)
    lines = text.splitlines()
    if m is None or not 0 < int(m.group(2)) <= len(lines) or "=" not in lines[int(m.group(2)) - 1]:
        return None
    row = int(m.group(2))
    key = _key_at(lines, row)
    value = lines[row - 1].split("=", 1)[1].split("#", 1)[0].strip()
    fix = _not_a_number({"type": "float_type"}, key, value) if re.search(r"[kKmMgG]$", value) else None
    return f"{key} (line {row}): {m.group(1)}{'; ' + fix if fix else ''}"
