"""The words a bash launch script hands its commands, as bash makes them (newcomer trial 34
findings 1 and 3): :func:`lex` cuts the text into raw words (quotes kept, ``\\``-newline joined,
comments dropped, ``$(...)``, ``${...}`` and backquotes kept whole, ``(`` ``)`` ``;`` ``|`` ``&``
and newlines as operators); :func:`expand` makes a raw word's fields from the variables seen so
far; :mod:`meshplan.interop.shell_run` runs the script's commands on these words (assignments,
``if``). What bash does, from the Bash Reference Manual (3.5 Shell Expansions, 3.5.7 Word Splitting,
6.7 Arrays):

- ``NAME=(a b "c d")`` is an array of three words; ``NAME+=(...)`` appends; it is used where it
  is expanded, never where it is defined;
- ``"${NAME[@]}"`` gives each element as one word (``"--num-workers 1"`` stays one word, which
  argparse then takes for a positional argument, as it does every word holding a space that no
  option names: CPython ``Lib/argparse.py`` ``_parse_optional``, "if it contains a space, it was
  meant to be a positional");
- an unquoted ``${NAME[@]}`` or ``$NAME`` is split at blanks, without quote removal
  (``"--split '99,1,0'"`` gives ``--split`` and ``'99,1,0'``, quotes and all);
- ``$(...)`` and a variable the script does not set are kept as written, one word (their value is
  known only when the script runs).
"""

from __future__ import annotations

import re
from typing import Union

from meshplan.errors import ConfigError

#: Operators: words of their own outside quotes.
OPERATORS = "();|&<>"
#: A variable, a bracketed one with its index or default, ``$1``.
_VAR = re.compile(r"\$(?:\{(?P<b>[A-Za-z_][A-Za-z0-9_]*|[0-9]+)(?P<idx>\[[@*]\])?(?P<rest>[^}]*)\}"
                  r"|(?P<n>[A-Za-z_][A-Za-z0-9_]*|[0-9]))")

Value = Union[str, list[str]]


def _closing(text: str, i: int, opening: str) -> int:
    """The index just past what opens at ``text[i]`` (``'``, ``"``, a backquote, ``$(``, ``${``),
    quotes and nesting respected; -1 when it never closes."""
    if opening == "'":
        j = text.find("'", i + 1)
        return -1 if j < 0 else j + 1
    close = {'"': '"', "`": "`", "$(": ")", "${": "}"}[opening]
    inner = ("$(", "${", "`") if opening == '"' else ("$(", "${", '"', "'") + (("`",) if opening != "`" else ())
    j, depth = i + len(opening), 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
        elif c == close:
            depth -= 1
            if depth == 0:
                return j + 1
            j += 1
        elif opening == "$(" and c == "(":
            depth, j = depth + 1, j + 1
        else:
            sub = next((o for o in inner if text.startswith(o, j)), None)
            end = _closing(text, j, sub) if sub else j + 1
            if end < 0:
                return -1
            j = end
    return -1


def lex(text: str) -> list[tuple[str, int]]:
    """(raw word or operator, line number from 1) of ``text``; a newline is the word ``"\\n"``.

    >>> [w for w, _ in lex('A=(--x 1 "--y 2") # c\\nB=$(scontrol show x | head -n 1) `id -u`')]
    ['A=', '(', '--x', '1', '"--y 2"', ')', '\\n', 'B=$(scontrol show x | head -n 1)', '`id -u`']
    """
    out: list[tuple[str, int]] = []
    word, i, line = "", 0, 1
    start = 1

    def flush():
        nonlocal word
        if word:
            out.append((word, start))
        word = ""

    while i < len(text):
        c = text[i]
        if c == "\\" and text.startswith("\\\n", i):
            i, line = i + 2, line + 1
            continue
        if c == "\\":
            start = start if word else line
            word += text[i:i + 2]
            i += 2
            continue
        if c in " \t\r":
            flush()
            i += 1
            continue
        if c == "\n" or (c == "#" and not word):
            flush()
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
            if j < len(text):
                out.append(("\n", line))
            i, line = j + 1, line + 1
            continue
        opening = next((o for o in ("$(", "${", "'", '"', "`") if text.startswith(o, i)), None)
        if opening is not None:
            end = _closing(text, i, opening)
            if end < 0:
                lines = text.split("\n")
                first = lines[min(line, len(lines)) - 1].strip()[:60]
                what = "quotation" if opening in "'\"`" else f"{opening}...{ {'$(': ')', '${': '}'}[opening] }"
                raise ConfigError("megatron", f"cannot split {first!r} (line {line}) into words (No closing {what}); "
                                  f"close the quote or give the flags without it")
            start = start if word else line
            word += text[i:end]
            line += text.count("\n", i, end)
            i = end
            continue
        if c in OPERATORS:
            flush()
            out.append((c, line))
            i += 1
            continue
        start = start if word else line
        word += c
        i += 1
    flush()
    return out


def _lookup(m: re.Match, env: dict[str, Value], fields: bool) -> list[str] | None:
    """The value of the variable ``m`` matched (:data:`_VAR`): an array's elements with ``[@]``
    (``fields``: as separate words) or its first, a scalar as one string, ``${X:-d}`` as ``d``
    where ``X`` is a positional parameter the script is not given; None when unknown."""
    name = m.group("b") or m.group("n")
    rest = m.group("rest") or ""
    if rest and not rest.startswith(":-"):
        return None  # ${X#pat}, ${X/a/b}, ...: not evaluated
    v = env.get(name)
    if v is None:
        if rest.startswith(":-") and name.isdigit():
            return [unquote(rest[2:])]
        return None
    if isinstance(v, list):
        if m.group("idx"):
            return list(v) if fields else [" ".join(v)]
        return v[:1]
    return [v]


#: A word that is one parameter expansion with a default: ``${NAME:-word}`` or ``${NAME-word}``.
_DEFAULTED = re.compile(r"^\$\{[A-Za-z_][A-Za-z0-9_]*:?-(?P<d>[^${}`]*)\}$")


def default_of(word: str) -> str:
    """The default of a word that is one ``${NAME:-d}`` (or ``${NAME-d}``) expansion, quotes
    removed: what bash gives where ``NAME`` is unset (Bash Reference Manual 3.5.3); ``word``
    itself otherwise.

    >>> default_of("${SLURM_NNODES:-128}"), default_of("${N-4}"), default_of("$N"), default_of("16")
    ('128', '4', '$N', '16')
    """
    m = _DEFAULTED.match(word)
    return unquote(m.group("d")) if m else word


def _blank_split(s: str) -> list[str]:
    """``s`` split at blanks (bash's word splitting of an expansion), ``$(...)``, ``${...}`` and
    backquotes kept whole."""
    out: list[str] = []
    cur, i = "", 0
    while i < len(s):
        opening = next((o for o in ("$(", "${", "`") if s.startswith(o, i)), None)
        end = _closing(s, i, opening) if opening else -1
        if end > 0:
            cur, i = cur + s[i:end], end
        elif s[i].isspace():
            out, cur, i = out + ([cur] if cur else []), "", i + 1
        else:
            cur, i = cur + s[i], i + 1
    return out + ([cur] if cur else [])


def unquote(s: str) -> str:
    """``s`` with its quotes removed as bash removes them from a word (no expansion)."""
    out, i = "", 0
    while i < len(s):
        if s[i] == "'":
            j = s.find("'", i + 1)
            j = len(s) if j < 0 else j
            out, i = out + s[i + 1:j], j + 1
        elif s[i] == '"':
            i += 1
        elif s[i] == "\\" and i + 1 < len(s):
            out, i = out + s[i + 1], i + 2
        else:
            out, i = out + s[i], i + 1
    return out


def expand(raw: str, env: dict[str, Value]) -> list[str]:
    """The fields bash makes of the raw word ``raw`` (:func:`lex`) with the variables ``env``
    (module docstring): quotes removed, known variables expanded (split at blanks outside double
    quotes), unknown ones and ``$(...)`` kept as written.

    >>> env = {"A": ["--x 1", "--y"], "P": "pretrain_gpt.py", "U": "--a 'b c'"}
    >>> expand('"${A[@]}"', env), expand('${A[@]}', env), expand('"$P"', env), expand('$U', env)
    (['--x 1', '--y'], ['--x', '1', '--y'], ['pretrain_gpt.py'], ['--a', "'b", "c'"])
    >>> expand('$(scontrol show hostnames "$L" | head -n 1)', env), expand('${N:-8}x', env)
    (['$(scontrol show hostnames "$L" | head -n 1)'], ['${N:-8}x'])
    """
    fields: list[str] = []
    cur, has, i, quoted = "", False, 0, False
    while i < len(raw):
        c = raw[i]
        if c == '"':
            quoted, has, i = not quoted, True, i + 1
            continue
        if c == "'" and not quoted:
            j = raw.find("'", i + 1) % (len(raw) + 1)
            cur, has, i = cur + raw[i + 1:j], True, j + 1
            continue
        if c == "\\" and i + 1 < len(raw):
            keep = quoted and raw[i + 1] not in '"\\$`'
            cur, i = cur + (c if keep else "") + raw[i + 1], i + 2
            continue
        if raw.startswith("$(", i) or c == "`":
            end = _closing(raw, i, "$(" if c == "$" else "`")
            end = len(raw) if end < 0 else end
            cur, i = cur + raw[i:end], end
            continue
        m = _VAR.match(raw, i)
        if m is None:
            cur, i = cur + c, i + 1
            continue
        i = m.end()
        got = _lookup(m, env, True)
        if got is None:
            cur += m.group(0)
        elif quoted:  # "${A[@]}": each element a word, the first and last joined to what is around
            has = True
            for k, g in enumerate(got):
                if k:
                    fields.append(cur)
                    cur = ""
                cur += g
        else:  # split at blanks, what only the run knows ($(...), an unknown ${X}) kept whole
            joined = " ".join(got)
            parts = _blank_split(joined)
            if parts and joined[:1].isspace() and (cur or has):
                fields.append(cur)
                cur, has = "", False
            for k, p in enumerate(parts):
                if k:
                    fields.append(cur)
                    cur, has = "", False
                cur += p
            if parts and joined[-1:].isspace():
                fields.append(cur)
                cur, has = "", False
    if cur or has:
        fields.append(cur)
    return fields


def flag_value(words: tuple[str, ...], flag: str, flag_ends: bool = False) -> str | None:
    """The value the last ``flag`` of a command's ``words`` gives (``--flag value`` or
    ``--flag=value``), or None; with ``flag_ends`` a following word that is itself a flag (``--x``)
    is not its value (``--deepspeed`` as a switch before ``--deepspeed_config PATH``).

    >>> flag_value(("--a", "1", "--a=2"), "--a"), flag_value(("--deepspeed", "--x"), "--deepspeed", True)
    ('2', None)
    """
    found = None
    for i, w in enumerate(words):
        if w == flag and i + 1 < len(words) and not (flag_ends and words[i + 1].startswith("--")):
            found = words[i + 1]
        elif w.startswith(flag + "="):
            found = w.split("=", 1)[1]
    return found
