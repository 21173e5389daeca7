"""The words a bash launch script hands its commands, as bash makes them (newcomer trial 34
findings 1 and 3): :func:`lex` cuts the text into raw words (quotes kept, ``\\``-newline joined,
comments dropped, ``$(...)``, ``${...}`` and backquotes kept whole, ``(`` ``)`` ``;`` ``|`` ``&``
and newlines as operators); :func:`expand` makes a raw word's fields from the variables seen so
far. What bash does, from the Bash Reference Manual (3.5 Shell Expansions, 3.5.7 Word Splitting,
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


_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=(.*)", re.S)
#: Commands that set variables from their words (``export A=1``, ``declare -a X=(...)``).
_SETTERS = ("export", "declare", "local", "readonly", "typeset")
_ENDS = ("\n", ";", "|", "&")


def run(text: str, exported: dict[str, str] | None = None) -> list[str]:
    """The words of ``text``'s commands, in order, as bash hands them over (assignments taken into
    the variables, arrays expanded where used: module docstring); ``exported`` receives each
    ``export NAME=value``: the value expanded, or as written where it holds what only the run knows
    (``${NAME:-1}``, ``$(...)``), so that an export carries it back unchanged. An ``if`` whose branches
    set variables or give flags is read where its test compares known strings (``[[ "$A" == fp8 ]]``,
    ``-z``, ``-n``, ``||``, ``&&``), else refused with its line; one that gives none is skipped.

    >>> run('D=(--nnodes 2 --master_addr $(scontrol show h | head -n 1))\\nM=(--bf16 "--x 1")\\n'
    ...     'torchrun ${D[@]} pretrain_gpt.py "${M[@]}" ${M[@]}')
    ['torchrun', '--nnodes', '2', '--master_addr', '$(scontrol show h | head -n 1)', 'pretrain_gpt.py', \
'--bf16', '--x 1', '--bf16', '--x', '1']
    """
    env: dict[str, Value] = {}
    out: list[str] = []
    try:
        _block(lex(text), env, out, exported if exported is not None else {})
    except RecursionError:
        raise ConfigError("megatron", "quotes, $(...) or if blocks nested too deep to read; give the flags "
                                      "without them") from None
    return out


def _commands(toks: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """``toks`` cut into commands at newlines, ``;``, ``|`` and ``&`` (an array's ``( ... )``
    kept whole across lines)."""
    cmds: list[list[tuple[str, int]]] = [[]]
    depth, k = 0, 0
    while k < len(toks):
        w, n = toks[k]
        depth += (w == "(") - (w == ")")
        if w in "|&" and k + 1 < len(toks) and toks[k + 1][0] == w:  # || and &&: one word (an if's test)
            cmds[-1].append((w + w, n))
            k += 1
        elif w in _ENDS and depth <= 0:
            cmds.append([])
        elif w != "\n":
            cmds[-1].append((w, n))
        k += 1
    return [c for c in cmds if c]


def _block(toks: list[tuple[str, int]], env: dict[str, Value], out: list[str], exported: dict[str, str]) -> None:
    """Run the commands of ``toks`` (:func:`run`): an ``if`` by :func:`_if`, the others by :func:`_command`,
    each part of an ``a && b`` or ``a || b`` list in turn."""
    cmds = _commands(toks)
    k = 0
    while k < len(cmds):
        if cmds[k][0][0] == "if":
            k = _if(cmds, k, env, out, exported)
            continue
        part: list[tuple[str, int]] = []
        for w in cmds[k] + [("&&", 0)]:
            if w[0] in ("&&", "||"):
                if part:
                    _command(part, env, out, exported)
                part = []
            else:
                part.append(w)
        k += 1


def _command(cmd: list[tuple[str, int]], env: dict[str, Value], out: list[str], exported: dict[str, str]) -> None:
    """One command: its leading assignments (and those of ``export`` ...) set, its other words
    expanded onto ``out``."""
    words = [w for w, _ in cmd]
    setter = words[0] in _SETTERS
    i = 1 if setter else 0
    while i < len(words):
        m = _ASSIGN.fullmatch(words[i])
        if m is None:
            if setter and (words[i].startswith("-") or _ASSIGN.fullmatch(words[i]) is None):
                i += 1
                continue
            break
        name, add, raw = m.groups()
        if raw == "" and i + 1 < len(words) and words[i + 1] == "(":
            end = words.index(")", i + 1) if ")" in words[i + 1:] else len(words)
            items = [f for w in words[i + 2:end] for f in expand(w, env)]
            old = env.get(name, [])
            env[name] = (old if isinstance(old, list) else [old]) + items if add else items
            i = end + 1
            continue
        value = " ".join(expand(raw, env))
        env[name] = (str(env.get(name, "")) + value) if add else value
        if words[0] == "export":
            exported[name] = raw if "$" in value or "`" in value else value
        i += 1
    if not setter:
        out.extend(f for w in words[i:] for f in expand(w, env))


def _if(cmds: list[list[tuple[str, int]]], k: int, env: dict[str, Value], out: list[str],
        exported: dict[str, str]) -> int:
    """Read the ``if`` opening at ``cmds[k]`` (module docstring of :func:`run`); the index past its ``fi``."""
    depth, j = 0, k
    parts: list[tuple[list[tuple[str, int]], list[list[tuple[str, int]]]]] = []  # (test, body) per branch
    for j in range(k, len(cmds)):
        cmd = cmds[j]
        w = cmd[0][0]
        if w == "if":
            depth += 1
        if depth == 1 and w in ("if", "elif", "else"):
            test = cmd[1:] if w != "else" else [("true", cmd[0][1])]
            then = next((t for t, (x, _) in enumerate(test) if x == "then"), None)
            body = [test[then + 1:]] if then is not None and then + 1 < len(test) else []
            parts.append((test[:then] if then is not None else test, [c for c in body if c]))
            continue
        if w == "fi":
            depth -= 1
            if depth == 0:
                break
        if depth == 1 and w == "then":
            rest = cmd[1:]
            if rest:
                parts[-1][1].append(rest)
            continue
        parts[-1][1].append(cmd)
    line = cmds[k][0][1]
    bodies = [[t for c in body for t in c + [(";", 0)]] for _, body in parts]
    if not any(_matters(b) for b in bodies):
        return j + 1
    for (cond, _), flat in zip(parts, bodies):
        ok = _test(cond, env)
        if ok is None:
            said = " ".join(w for w, _ in cmds[k])[:70]
            raise ConfigError("megatron", f"line {line}: {said!r} chooses flags or variables by a test meshplan does "
                              f"not evaluate (only string tests of known variables); keep the branch that runs "
                              f"and remove the if")
        if ok:
            _block(flat, env, out, exported)
            break
    return j + 1


def _matters(toks: list[tuple[str, int]]) -> bool:
    """Whether a branch sets a variable or gives a flag (its words otherwise touch no flag)."""
    return any(_ASSIGN.match(w) or w.lstrip("\"'").startswith("--") for w, _ in toks)


def _test(test: list[tuple[str, int]], env: dict[str, Value]) -> bool | None:
    """The truth of an ``if``'s test of known strings (``[[ A == B ]]``, ``[ A != B ]``, ``-z``, ``-n``,
    joined by ``||`` / ``&&``, ``true``), None where it is anything else or names an unknown variable."""
    words = [w for w, _ in test]
    if words == ["true"]:
        return True
    result, op, i = None, None, 0
    while i < len(words):
        if words[i] not in ("[[", "["):
            return None
        end = next((e for e in range(i + 1, len(words)) if words[e] in ("]]", "]")), None)
        if end is None:
            return None
        vals = [expand(w, env) for w in words[i + 1:end]]
        if any(len(v) != 1 or "$" in v[0] for v in vals):
            return None
        v = [x[0] for x in vals]
        if len(v) == 3 and v[1] in ("==", "=", "!="):
            one = (v[0] == v[2]) == (v[1] != "!=")
        elif len(v) == 2 and v[0] in ("-z", "-n"):
            one = (v[1] == "") == (v[0] == "-z")
        else:
            return None
        result = one if op is None else (result or one) if op == "||" else (result and one)
        i = end + 1
        if i < len(words):
            op = words[i]
            if op not in ("||", "&&"):
                return None
            i += 1
    return result
