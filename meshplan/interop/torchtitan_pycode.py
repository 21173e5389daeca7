"""A ``Trainer.Config`` tree (:class:`~meshplan.interop.torchtitan_py.Built`) written back as the
Python of a torchtitan ``config_registry.py`` function, with the imports its names need: the
text half of :mod:`meshplan.interop.torchtitan_pywrite`.

Values are written as literals (strings in double quotes, as torchtitan's registries write them),
calls as ``Name(arg, key=value)``, one keyword a line where the call does not fit one short line;
a value the reader kept as source text (:class:`~meshplan.interop.torchtitan_py.Opaque`:
``DATASETS["c4"]``) as that text. Each name the text uses is imported as the source file imports
it, else from where torchtitan defines it at the revision written (:data:`IMPORTS`); a name the
source binds inside its function (``compile_config.enable``) is a one-line error naming the field,
as the written function has no such name.

>>> from meshplan.interop.torchtitan_py import Built
>>> print(code(Built("TrainingConfig", (), {"seq_len": 8192, "dtype": "bfloat16"}), 1))
TrainingConfig(seq_len=8192, dtype="bfloat16")
"""

from __future__ import annotations

import ast
import builtins
import json
from typing import Any

from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_py import Built, Opaque

#: Where torchtitan defines the names a written function uses, by revision: 9810191
#: (``torchtitan/models/llama3/config_registry.py`` imports there, ``torchtitan/config/__init__.py``)
#: and b5bcd76 (the same files there: ``components/checkpointer``, ``components/optimizer`` and
#: ``components/quantization`` became packages; ``ActivationCheckpointConfig`` gave way to the policy
#: classes of ``distributed/activation_checkpoint.py``, c5d93d1).
IMPORTS = {
    "9810191": {"Trainer": "torchtitan.trainer", "TrainingConfig": "torchtitan.config",
                "ParallelismConfig": "torchtitan.config", "CompileConfig": "torchtitan.config",
                "ActivationCheckpointConfig": "torchtitan.config", "CommConfig": "torchtitan.config",
                "DebugConfig": "torchtitan.config", "CheckpointManager": "torchtitan.components.checkpoint",
                "OptimizersContainer": "torchtitan.components.optimizer",
                "LRSchedulersContainer": "torchtitan.components.lr_scheduler",
                "MetricsProcessor": "torchtitan.components.metrics", "Validator": "torchtitan.components.validate",
                "Float8LinearConverter": "torchtitan.components.quantization.float8",
                "ModelConvertersContainer": "torchtitan.protocols.model_converter",
                "ProfilingConfig": "torchtitan.tools.profiling"},
    "b5bcd76": {"Trainer": "torchtitan.trainer", "TrainingConfig": "torchtitan.config",
                "ParallelismConfig": "torchtitan.config", "CompileConfig": "torchtitan.config",
                "CommConfig": "torchtitan.config", "DebugConfig": "torchtitan.config",
                "CheckpointManager": "torchtitan.components.checkpointer",
                "default_adamw": "torchtitan.components.optimizer",
                "LRSchedulersContainer": "torchtitan.components.optimizer",
                "MetricsProcessor": "torchtitan.components.metrics", "Validator": "torchtitan.components.validate",
                "Float8LinearConverter": "torchtitan.components.quantization",
                "SelectiveAC": "torchtitan.distributed.activation_checkpoint",
                "FullAC": "torchtitan.distributed.activation_checkpoint",
                "Profiler": "torchtitan.tools.profiler"},
}
#: A call written on one line when it is at most this long (torchtitan's registries wrap longer ones).
INLINE = 60
#: The longest line a list of literals is packed to.
LINE = 100


def literal(v: Any) -> str:
    """Python text of a literal value (strings double-quoted).

    >>> literal(["model", "loss"]), literal(1e-05), literal((1,)), literal(None)
    ('["model", "loss"]', '1e-05', '(1,)', 'None')
    """
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        inner = ", ".join(literal(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{literal(k)}: {literal(x)}" for k, x in v.items()) + "}"
    return repr(v)


def code(v: Any, depth: int, width: int = INLINE) -> str:
    """Python text of value ``v`` at indentation ``depth`` (4 spaces each): :func:`literal`, an
    Opaque's text, a Built call inline where at most ``width`` long, else one argument a line."""
    if isinstance(v, Opaque):
        return v.source
    if isinstance(v, list) and width > INLINE:
        return "[" + ", ".join(code(x, depth, width) for x in v) + "]"
    if isinstance(v, list) and (any(isinstance(x, (Built, Opaque, list)) for x in v) or
                                len(literal(v)) > LINE - 4 * depth):
        pad = "    " * (depth + 1)
        if any(isinstance(x, (Built, Opaque, list)) for x in v):
            return "[\n" + "".join(f"{pad}{code(x, depth + 1)},\n" for x in v) + "    " * depth + "]"
        rows = [""]  # literals packed to the line
        for x in map(literal, v):
            rows[-1:] = [rows[-1] + f"{x}, "] if len(pad + rows[-1] + x) < LINE else [rows[-1], f"{x}, "]
        return "[\n" + "".join(f"{pad}{r.rstrip()}\n" for r in rows if r) + "    " * depth + "]"
    if not isinstance(v, Built):
        return literal(v)
    parts = [code(a, depth + 1, width) for a in v.args] + [f"{k}={code(x, depth + 1, width)}"
                                                           for k, x in v.kwargs.items()]
    inline = f"{v.name}({', '.join(parts)})"
    if len(inline) <= width and "\n" not in inline:
        return inline
    pad = "    " * (depth + 1)
    return f"{v.name}(\n" + "".join(f"{pad}{p},\n" for p in parts) + "    " * depth + ")"


def _opaque_names(v: Any, where: str):
    """(name, field) of every free name an Opaque value in ``v`` uses."""
    if isinstance(v, Opaque):
        try:
            tree = ast.parse(v.source, mode="eval")
        except SyntaxError:
            return
        for n in ast.walk(tree):
            if isinstance(n, ast.Name):
                yield n.id, where
    elif isinstance(v, Built):
        yield from ((v.name.split(".")[0], where),) if v.name else ()
        for a in v.args:
            yield from _opaque_names(a, where)
        for k, x in v.kwargs.items():
            yield from _opaque_names(x, f"{where}.{k}" if where else k)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _opaque_names(x, where)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _opaque_names(x, where)


def _bindings(source_text: str | None, package: str) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> its import line, name -> its module-level assignment) of the source file; a
    relative import made absolute under ``package`` (the model's ``torchtitan.models.<name>``)."""
    if not source_text:
        return {}, {}
    module = ast.parse(source_text)
    imports, assigns = {}, {}
    for node in module.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([package] + ([base] if base else []))
            for a in node.names:
                imports[a.asname or a.name] = f"from {base} import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.Import):
            for a in node.names:
                imports[a.asname or a.name.split(".")[0]] = f"import {a.name}" + (f" as {a.asname}" if a.asname else "")
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    assigns[t.id] = ast.get_source_segment(source_text, node) or ast.unparse(node)
    return imports, assigns


def header_code(tree: Built, fields: dict[str, Any], revision: str, source_text: str | None, package: str,
                function: str) -> list[str]:
    """The import lines (and module-level assignments of the source) the written function
    ``tree`` and its locals ``fields`` need, ``model_registry`` from ``package`` (the model's
    ``torchtitan.models.<name>``, absolute); ConfigError naming the field for a name the source
    binds in its function, which the written one does not have."""
    imports, assigns = _bindings(source_text, package)
    imports["model_registry"] = f"from {package} import model_registry"
    own = IMPORTS[revision]
    lines: list[str] = []
    defs: list[str] = []
    names = list(_opaque_names(tree, ""))
    for k, v in fields.items():
        names += list(_opaque_names(v, k))
    while names:
        name, where = names.pop(0)
        if name in fields or hasattr(builtins, name):
            continue
        if name in imports:
            line = imports[name]
        elif name in own:
            line = f"from {own[name]} import {name}"
        elif name in assigns:
            if assigns[name] not in defs:  # its own names imported in turn
                defs.append(assigns[name])
                names += list(_opaque_names(Opaque(assigns[name].partition("=")[2].strip()), where))
            continue
        else:
            raise ConfigError(where or "config", f"uses {name!r}, which meshplan finds neither imported nor at module level in "
                              f"the source (a name of its function): write the value as a literal there, or bind "
                              f"{name} at module level, to export {function}()")
        if line not in lines:
            lines.append(line)
    return _grouped(lines) + ([""] + defs if defs else [])


def _grouped(lines: list[str]) -> list[str]:
    """``from M import a`` lines of one module joined (``from M import a, b``), sorted.

    >>> _grouped(["from m import b", "import os", "from m import a"])
    ['import os', 'from m import a, b']
    """
    by: dict[str, list[str]] = {}
    plain = []
    for line in lines:
        if line.startswith("from "):
            module, _, name = line[len("from "):].partition(" import ")
            by.setdefault(module, []).append(name)
        else:
            plain.append(line)
    return sorted(plain) + [f"from {m} import {', '.join(sorted(n, key=str.lower))}" for m, n in sorted(by.items())]
