"""Megatron-LM's full flag list, as its own parser builds it, for meshplan/catalog/megatron_flags.toml.

Usage (a Megatron-LM source tree at the commit, torch installed, e.g. meshplan's test venv)::

    git -C Megatron-LM archive d98e8a64dd megatron | tar -x -C /tmp/mlm
    python tools/megatron_flag_list.py /tmp/mlm d98e8a64dd > meshplan/catalog/megatron_flags.toml

It calls ``megatron.training.arguments.add_megatron_arguments`` on an ``argparse.ArgumentParser``
(what ``parse_args`` does, ``allow_abbrev=False``) and lists every ``--`` option string of the parser:
the flags written out in arguments.py and those its ``ArgumentGroupFactory`` makes from the config
dataclasses' fields, which reading the file's ``add_argument`` calls would miss. Switches are the
options that take no value (``nargs == 0``: store_true / store_false / store_const).

Only to import arguments.py on a machine without a GPU stack: torch's own triton check is run
before the stub below; ``triton`` (imported unguarded by megatron/core) is a stub module;
``torch.compile`` is the identity (the fused kernels are never run); ``typing.override`` (Python
3.12) is the identity on 3.11. None of it changes which options the parser declares.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import sys
import types
import typing
from unittest import mock

STUBBED = ("triton",)


class _StubModule(types.ModuleType):
    """A module whose every public attribute is a MagicMock."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return mock.MagicMock(name=f"{self.__name__}.{name}")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import :data:`STUBBED` packages (and their submodules) as :class:`_StubModule`."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBBED else None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__, module.__version__ = [], "99.0.0"
        return module

    def exec_module(self, module):
        pass


def megatron_parser(tree: str) -> argparse.ArgumentParser:
    """Megatron-LM's argument parser, imported from the source ``tree``."""
    import torch
    import torch.utils._triton
    torch.utils._triton.has_triton_package()  # cached before the stub exists: torch keeps its own paths
    torch.utils._triton.has_triton()
    torch.compile = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)  # type: ignore[assignment]
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _Stubs())
    sys.path.insert(0, tree)
    from megatron.training.arguments import add_megatron_arguments
    parser = argparse.ArgumentParser(allow_abbrev=False)
    return add_megatron_arguments(parser)


def flag_table(parser: argparse.ArgumentParser, commit: str) -> str:
    """The TOML text: ``source``, then ``flags`` and ``switches``, each sorted."""
    options = {s: a for s, a in parser._option_string_actions.items() if s.startswith("--")}
    flags = sorted(options)
    switches = sorted(s for s, a in options.items() if a.nargs == 0)
    listed = lambda names: "[\n" + "".join(f'  "{n}",\n' for n in names) + "]\n"
    return (f"# Every option of Megatron-LM's parser: {len(flags)} flags, {len(switches)} of them switches (no value).\n"
            f"# Written by tools/megatron_flag_list.py; do not edit by hand.\n"
            f'source = "NVIDIA/Megatron-LM {commit}, megatron/training/arguments.py add_megatron_arguments '
            f'(argparse, allow_abbrev=False)"\n'
            f"flags = {listed(flags)}switches = {listed(switches)}")


if __name__ == "__main__":
    sys.stdout.write(flag_table(megatron_parser(sys.argv[1]), sys.argv[2]))
