"""The commands of a bash launch script run as far as their words go (newcomer trial 34 findings 1
and 3): :func:`run` cuts :func:`~meshplan.interop.shell_words.lex`'s words into commands, takes
assignments (``NAME=``, ``NAME=(...)``, ``NAME+=``, ``export``/``declare``) into the variables and
hands every other word over as :func:`~meshplan.interop.shell_words.expand` makes it; an ``if`` is
read where its test compares known strings (:func:`_test`), refused otherwise. Word splitting and
expansion live in :mod:`meshplan.interop.shell_words`; what bash does with them is cited there.
"""

from __future__ import annotations

import re

from meshplan.errors import ConfigError
from meshplan.interop.shell_words import Value, expand, lex

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
