"""Which torchtitan file ``export --to torchtitan`` writes (:func:`target`): a v0.2.2 job TOML, or a
Python config function in torchtitan 9810191's or b5bcd76's names (:class:`PyTarget`, written by
:mod:`meshplan.interop.torchtitan_pywrite`), from ``--torchtitan-revision``, ``-o``'s suffix and the
source (a ``config_registry.py`` keeps its own revision), with the function's name (``--name``).
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_py import function_tree
from meshplan.interop.torchtitan_pyjob import job_dict

#: The revisions ``--torchtitan-revision`` names: v0.2.2's job TOML, or a Python config in 9810191's or b5bcd76's names.
REVISIONS = ("v0.2.2", "9810191", "b5bcd76")


@dataclass(frozen=True)
class PyTarget:
    """What ``export --to torchtitan`` writes as Python: ``revision`` (9810191 or b5bcd76), the
    function's ``name``, and the source ``config_registry.py`` (``path``, its ``function``) whose
    other settings it keeps, None for a plan or job TOML."""

    revision: str
    name: str
    path: Optional[Path] = None
    function: Optional[str] = None


def source_revision(path: Path, function: Optional[str]) -> Optional[str]:
    """The names a ``config_registry.py`` function is written in (9810191 or b5bcd76, as its import
    plans it: :func:`~meshplan.interop.torchtitan_pyjob.job_dict`); None for v0.2.2's ``JobConfig`` tree."""
    text = path.read_text(encoding="utf-8", errors="replace")
    _, tree = function_tree(text, str(path), function)
    if tree.name.endswith("JobConfig"):
        return None
    return "9810191" if job_dict(tree, text, path, [])[1] == "238fa99" else "b5bcd76"


def target(out: Any, revision: Optional[str], name: Optional[str], config: Path, python_source: bool,
           function: Optional[str]) -> Optional[PyTarget]:
    """The Python file ``export --to torchtitan`` writes, None for a v0.2.2 job TOML. The revision:
    ``--torchtitan-revision``; else ``-o``'s suffix (``.toml``: the job TOML; ``.py``: the source's
    names, b5bcd76's for a plan or job TOML); else (``-o -``) the source's, a job TOML from any
    other. ConfigError naming the option where ``-o``'s suffix says the other format, where a
    ``config_registry.py`` is asked for in another revision's names, or ``--name`` is no Python name
    or is given for a job TOML."""
    if revision is not None and revision not in REVISIONS:
        raise ConfigError("--torchtitan-revision", f"{revision!r}; use {', '.join(REVISIONS)}")
    suffix = out.suffix if isinstance(out, Path) else None
    own = source_revision(config, function) if python_source else None
    rev = revision or ("v0.2.2" if suffix == ".toml" else own or ("b5bcd76" if suffix == ".py" else "v0.2.2"))
    if own and rev != "v0.2.2" and rev != own:  # its other values are in its own revision's classes
        raise ConfigError("--torchtitan-revision", f"{rev}: {config.name} is written in torchtitan {own}'s names, and "
                          f"the values meshplan does not plan are carried as written, in {own}'s classes (an "
                          f"optimizer, a dataloader); give --torchtitan-revision {own}, or import the file (meshplan "
                          f"import) and export that TOML, which carries nothing of it")
    if suffix in (".toml", ".py") and (suffix == ".toml") != (rev == "v0.2.2"):
        want = out.with_suffix(".toml" if rev == "v0.2.2" else ".py")
        raise ConfigError("-o", f"{out}: torchtitan {rev} reads " + ("a job TOML" if rev == "v0.2.2" else
                          "a Python config function") + f"; name it {want.name}")
    if rev == "v0.2.2":
        if name is not None:
            raise ConfigError("--name", "names the function of a torchtitan Python config; a job TOML has none "
                              "(give -o FILE.py)")
        return None
    fn = name or (function_tree(config.read_text(encoding="utf-8", errors="replace"), str(config), function)[0]
                  if python_source else re.sub(r"\W", "_", config.stem))
    fn = fn if not fn[:1].isdigit() else f"job_{fn}"
    if not fn.isidentifier() or keyword.iskeyword(fn):
        raise ConfigError("--name", f"{fn!r} is not a Python function name; give one such as llama3_8b_tp2")
    return PyTarget(rev, fn, config if python_source and own else None, function)
