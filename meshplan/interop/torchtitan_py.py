"""A torchtitan ``config_registry.py`` function read without running it: Python's :mod:`ast`
walks the function and builds the dataclass tree it returns, as far as it is written in literals.

torchtitan 9810191 (#2386, 2026-02-23, "Config System Refactor: TOML to Python Dataclass
Registry") replaced the job TOML files with one ``config_registry.py`` per model: each function
returns a ``Trainer.Config(...)`` tree of keyword-only dataclasses (``training=TrainingConfig(...)``,
``parallelism=ParallelismConfig(...)``, ``model_spec=model_registry("8B")``), and
``torchtitan/config/manager.py`` (b5bcd76 lines 48-160) imports the module named by ``--module``
and calls the function named by ``--config``, then lets tyro override single fields
(``--parallelism.tensor_parallel_degree 8``; lines 34-45). A function may also start from
another: ``config = llama3_debugmodel()``, then ``config.model_spec = model_registry(...)``,
``config.parallelism.spmd_backend = "spmd_types"``, ``return config`` (b5bcd76
``models/llama3/config_registry.py`` 83-103).

What is read (nothing is imported or run):

- the function's ``return`` of a call (a :class:`Built`: the called name, positional and keyword
  arguments, each read the same way) or of a name bound to one;
- ``name = <expression>`` in the function or at module level, substituted where the name is used;
  ``config = other()`` of a function of the same file, read recursively, then each
  ``config.a.b = <expression>`` applied in order;
- literals: numbers, strings, booleans, None, lists, tuples, dicts, and arithmetic on numbers
  (``8 * 8192``).

Anything else (a call's result used as a value, ``DATASETS["c4"]``, ``config.compile.enable``)
is an :class:`Opaque` holding its source text: only where meshplan reads that field is it an
error (:mod:`meshplan.interop.torchtitan_pyjob`). Statements that would make the result depend on
a run (``if``, ``for``, ``with``, ``x += 1``, a method call on the config) are a one-line error.

>>> _, tree = function_tree("def job():\\n    return Trainer.Config(training=TrainingConfig(seq_len=2 * 4096))",
...                      "job.py", None)
>>> tree.name, tree.kwargs["training"].kwargs["seq_len"]
('Trainer.Config', 8192)
"""

from __future__ import annotations

import ast
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from meshplan.errors import ConfigError, closest_all

#: How deep ``config = other()`` may chain (and names refer to names) before the reader gives up.
DEPTH = 16
#: Arithmetic read on numbers: ``8 * 8192``, ``2 ** 13``.
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv, ast.Pow: operator.pow}
#: The classes of a whole job config: torchtitan 9810191 on ``Trainer.Config``, v0.2.2's ``JobConfig``.
CONFIG_CLASSES = ("Trainer.Config", "JobConfig")
#: Statements a config function may hold that change nothing read (docstring, imports, asserts,
#: helper definitions, ``pass``).
_INERT = (ast.Import, ast.ImportFrom, ast.Assert, ast.FunctionDef, ast.Pass)


@dataclass
class Built:
    """A call in the tree: ``name`` its dotted callee (``TrainingConfig``, ``Trainer.Config``,
    ``model_registry``), ``args`` its positional and ``kwargs`` its keyword arguments, read."""

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Opaque:
    """A value meshplan cannot know without running the file; ``source``: its text."""

    source: str


def dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a Name/Attribute chain, None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = dotted(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


class _Reader:
    """One file's functions and module-level names, read on demand."""

    def __init__(self, text: str, path: str, context: Optional[Callable[[str], Optional[int]]] = None):
        self.path, self.context = path, context
        try:
            self.module = ast.parse(text, filename=path)
        except (SyntaxError, ValueError, RecursionError) as e:
            line = getattr(e, "lineno", None)
            raise ConfigError("config", f"{path}{f' line {line}' if line else ''}: not valid Python "
                              f"({getattr(e, 'msg', e)}); give the config_registry.py torchtitan runs") from None
        self.functions = {n.name: n for n in self.module.body if isinstance(n, ast.FunctionDef)}
        self.globals = {t.id: n.value for n in self.module.body if isinstance(n, ast.Assign)
                        for t in n.targets if isinstance(t, ast.Name)}
        # module-level configs, ``default_config = JobConfig(...)`` (nc48's file), read like a function's return
        self.configs = [k for k, v in self.globals.items() if isinstance(v, ast.Call) and
                        (dotted(v.func) or "").endswith(CONFIG_CLASSES)]

    def names(self) -> list[str]:
        """The configs ``--config`` may name: public functions and module-level configs."""
        return [n for n in self.functions if not n.startswith("_")] + self.configs

    def fail(self, node: ast.AST, what: str) -> ConfigError:
        return ConfigError("config", f"{self.path} line {getattr(node, 'lineno', '?')}: {what}")

    def value(self, node: ast.AST, env: dict[str, ast.AST], depth: int = 0) -> Any:
        """The value of an expression (module docstring); ``env`` the function's names."""
        if depth > DEPTH:
            raise self.fail(node, f"names refer to names more than {DEPTH} deep; write the value as a literal")
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.value(e, env, depth + 1) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
            return {self.value(k, env, depth + 1): self.value(v, env, depth + 1)
                    for k, v in zip(node.keys, node.values) if k is not None}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.value(node.operand, env, depth + 1)
            return -inner if _number(inner) else Opaque(ast.unparse(node))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = self.value(node.left, env, depth + 1), self.value(node.right, env, depth + 1)
            if _number(a) and _number(b) and not (isinstance(node.op, (ast.Div, ast.FloorDiv)) and b == 0):
                return _OPS[type(node.op)](a, b)
            return Opaque(ast.unparse(node))
        if isinstance(node, ast.Attribute) and node.attr == "max_context_length" and self.context is not None:
            length = self._context(node.value, env, depth)
            if length is not None:
                return length
        if isinstance(node, ast.Name):
            bound = env.get(node.id, self.globals.get(node.id))
            return Opaque(node.id) if bound is None else self.value(bound, env, depth + 1)
        if isinstance(node, ast.Call) and dotted(node.func) and not any(isinstance(a, ast.Starred) for a in node.args) \
                and all(k.arg is not None for k in node.keywords):
            return Built(dotted(node.func) or "", tuple(self.value(a, env, depth + 1) for a in node.args),
                         {k.arg: self.value(k.value, env, depth + 1) for k in node.keywords if k.arg})
        return Opaque(ast.unparse(node))

    def _context(self, owner: ast.AST, env: dict[str, ast.AST], depth: int) -> Optional[int]:
        """``model_spec.max_context_length`` (or ``model_spec.model.max_context_length``) where
        ``model_spec`` is ``model_registry("FLAVOR", ...)``: ``self.context(FLAVOR)``, None unknown."""
        if isinstance(owner, ast.Attribute) and owner.attr == "model":
            owner = owner.value
        spec = self.value(owner, env, depth + 1)
        ok = isinstance(spec, Built) and spec.name.endswith("model_registry") and spec.args and isinstance(spec.args[0], str)
        return self.context(spec.args[0]) if ok and self.context is not None else None

    def function(self, name: str, depth: int = 0) -> Built:
        """The tree function ``name`` returns, its ``config.a.b = ...`` lines applied."""
        fn = self.functions[name]
        if depth > DEPTH:
            raise self.fail(fn, f"{name}() builds on other functions more than {DEPTH} deep")
        env: dict[str, ast.AST] = {}
        sets: list[tuple[ast.AST, str, list[str], ast.AST]] = []
        for stmt in fn.body:
            if isinstance(stmt, _INERT) or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
                continue
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                    path = dotted(target)
                    if path is None:
                        raise self.fail(stmt, f"{ast.unparse(target)} = ...: meshplan reads assignments to a name or "
                                        f"to config.a.b only")
                    if isinstance(target, ast.Name):
                        env[path] = stmt.value
                    else:
                        root, *keys = path.split(".")
                        sets.append((stmt, root, keys, stmt.value))
                continue
            if isinstance(stmt, ast.Return) and stmt.value is not None:
                return self._returned(fn, stmt.value, env, sets, depth)
            raise self.fail(stmt, f"{ast.unparse(stmt).splitlines()[0][:60]!r} is not read: meshplan reads a config "
                            f"function's assignments and its return without running it; write the setting as "
                            f"config.a.b = <literal>, or give the job's values in a function of literals")
        raise self.fail(fn, f"{name}() returns nothing meshplan can read; end it with return Trainer.Config(...)")

    def _origin(self, name: str) -> str:
        return _origin_text(self.module, name)

    def _returned(self, fn: ast.FunctionDef, node: ast.AST, env: dict, sets: list, depth: int) -> Built:
        """The returned tree: a call read directly, or the function another builds on."""
        base = env.get(node.id, node) if isinstance(node, ast.Name) else node
        called = dotted(base.func) if isinstance(base, ast.Call) else None
        if isinstance(base, ast.Call) and called in self.functions and not base.args and not base.keywords:
            tree = self.function(called, depth + 1)
        else:
            tree = self.value(base, env)
        if isinstance(tree, Built) and called and called not in self.functions and not called.endswith("Config") \
                and isinstance(node, ast.Name):
            # a base function of another file (torchtitan_recipes: from torchtitan.models.llama3.config_registry
            # import llama3_debugmodel; b5bcd76 torchtitan_recipes/tests/h100.py 9-17)
            where = self._origin(called.split(".")[0])
            raise self.fail(node, f"{fn.name}() builds on {called}(){where}, which meshplan does not read from "
                            f"{self.path}: import that file with --config {called.split('.')[-1]}, or write the "
                            f"job's Trainer.Config(...) in this one")
        if not isinstance(tree, Built):
            raise self.fail(node, f"{fn.name}() returns {ast.unparse(node)[:60]!r}, not a Trainer.Config(...) call")
        root = node.id if isinstance(node, ast.Name) else None
        for stmt, name, keys, value in sets:
            if name != root:
                continue  # a helper object's attribute: not part of the returned config
            _assign(tree, keys, self.value(value, env), f"{self.path} line {stmt.lineno}")
        return tree


def _origin_text(module: ast.Module, name: str) -> str:
    """`` of <module>`` for a name the file imports, else ``""``."""
    for node in module.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return f" of {'.' * node.level}{node.module or ''}"
    return ""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _assign(tree: Built, keys: list[str], value: Any, where: str) -> None:
    """``config.keys[0]...keys[-1] = value`` on the tree; a field a function did not write is a
    default object (``Built("")``), filled in here."""
    node = tree
    for key in keys[:-1]:
        nxt = node.kwargs.get(key)
        if nxt is None:
            nxt = node.kwargs[key] = Built("")
        if not isinstance(nxt, Built):
            raise ConfigError("config", f"{where}: config.{'.'.join(keys)} sets a field of "
                              f"{nxt!r}, which meshplan cannot read as a config object")
        node = nxt
    node.kwargs[keys[-1]] = value


def config_functions(text: str, path: str) -> list[str]:
    """The configs of a config registry ``--config`` may name (:meth:`_Reader.names`)."""
    return _Reader(text, path).names()


def function_tree(text: str, path: str, name: str | None,
                  context: Optional[Callable[[str], Optional[int]]] = None) -> tuple[str, Built]:
    """(the function's name, the tree config function ``name`` of file text ``text`` returns:
    module docstring);
    ``name`` None: the file's only public function. ConfigError naming ``--config`` when the
    name is missing or not one of them. ``context``: a flavor's ``max_context_length`` (None
    where unknown), the value of ``model_spec.max_context_length``."""
    reader = _Reader(text, path, context)
    names = reader.names()
    if name is None:
        if len(names) != 1:
            listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ConfigError("--config", f"{path} defines {len(names)} config functions ({listed or 'none'}); "
                              f"name the job's, as torchtitan's --config: --config {names[0] if names else 'NAME'}")
        name = names[0]
    if name not in names:
        near = closest_all(name, names)
        raise ConfigError("--config", f"{name!r} is not a function of {path}"
                          + (f"; did you mean {' or '.join(near)}?" if near else f"; give one of {', '.join(names[:12])}"))
    if name in reader.configs:
        return name, reader.value(reader.globals[name], {})
    return name, reader.function(name)


def imported_from(text: str, path: str, name: str) -> str | None:
    """The module ``name`` is imported from (``from . import model_registry``: ``"."``), None
    when the file does not import it."""
    where = _origin_text(_Reader(text, path).module, name)
    return where[len(" of "):] if where else None
