"""Paths as a meshplan TOML written by ``meshplan import`` names them: the ``[source]`` file
(:func:`meshplan.interop.source_file.source_table`) and ``model.hf_config`` both relative to the
written TOML's folder, where :func:`meshplan.config.load_config` reads a relative one from, or
both absolute when the TOML is printed (newcomer finding: ``hf_config`` was written absolute and
``[source]`` relative).
"""

from __future__ import annotations

import os
from pathlib import Path


def written_path(path: Path, out: Path | None) -> str:
    """``path`` as a TOML written to ``out`` names it: relative to ``out``'s folder, as
    :func:`meshplan.config.load_config` reads a relative ``[source] path`` and ``model.hf_config``;
    absolute when printed (``out`` None: no folder to be relative to).

    >>> written_path(Path("/jobs/hf/config.json"), Path("/jobs/plans/run.toml"))
    '../hf/config.json'
    >>> written_path(Path("/jobs/hf/config.json"), None)
    '/jobs/hf/config.json'
    """
    src = path.resolve()
    return str(src) if out is None else os.path.relpath(src, out.resolve().parent)


def written_tables(tables: dict, out: Path | None) -> dict:
    """``tables`` with ``model.hf_config`` (absolute as the readers give it) named as ``[source]``
    is (:func:`written_path`): relative to the written TOML's folder, absolute when printed."""
    model = tables.get("model", {})
    if not isinstance(model.get("hf_config"), str):
        return tables
    return {**tables, "model": {**model, "hf_config": written_path(Path(model["hf_config"]), out)}}
