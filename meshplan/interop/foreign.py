"""Any config in: the loader behind ``plan``/``step``/``search`` (and ``meshplan import``), which
reads a meshplan TOML or a torchtitan, Megatron-LM or DeepSpeed config into a
:class:`~meshplan.config.Config`.

Detection (:func:`meshplan.interop.detect.detect`) tells the format where the caller gives no ``--format``.
Any config out (``meshplan export``): :mod:`meshplan.interop.export`.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Callable

from meshplan.config import Config, config_from_dict, load_config
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json
from meshplan.interop import deepspeed, megatron, torchtitan
from meshplan.interop.common import FORMATS, Imported, ImportOptions
from meshplan.interop.detect import MEGATRON_HINT, config_text, detect, is_python_job, sbatch_refusal
from meshplan.interop.tomlout import dumps
from meshplan.interop.detect import meshplan_refusal  # import's refusal of a meshplan TOML (nc55 #1)
from meshplan.interop.torchtitan_custom import sibling_flavors
from meshplan.interop.torchtitan_py import function_tree
from meshplan.interop.torchtitan_pyjob import read_py
from meshplan.interop.written_paths import written_tables


#: Where a torchtitan job TOML and Megatron-LM arguments state the micro-batch and the global batch.
BATCH_FIELDS = {"torchtitan": "training.local_batch_size (and training.global_batch_size)",
                "megatron": "--micro-batch-size (and --global-batch-size)"}


#: Where they state activation checkpointing (``--gradient-checkpointing`` is the HF Trainer's).
RECOMPUTE_FIELDS = {"torchtitan": "activation_checkpoint.mode",
                    "megatron": "--recompute-granularity (and --recompute-method)"}


def read_foreign(path: Path, fmt: str, opts: ImportOptions) -> Imported:
    """Read ``path`` as ``fmt`` (torchtitan, megatron or deepspeed) into meshplan tables.
    ``--micro-batch`` / ``--grad-accum`` fill a DeepSpeed JSON's "auto" batch sizes only: a
    torchtitan or Megatron-LM file states its own (:data:`BATCH_FIELDS`), so either flag there is
    an error naming that field rather than a flag silently ignored; ``--gradient-checkpointing``
    likewise (:data:`RECOMPUTE_FIELDS`)."""
    given = [f for f, v in (("--micro-batch", opts.micro_batch), ("--grad-accum", opts.grad_accum)) if v is not None]
    if given and fmt in BATCH_FIELDS:
        raise ConfigError(given[0], f"only for a DeepSpeed JSON's \"auto\" batch sizes; a {fmt} config states its "
                          f"own: set {BATCH_FIELDS[fmt]} in {path.name}")
    if opts.gradient_checkpointing is not None and fmt in RECOMPUTE_FIELDS:
        raise ConfigError("--gradient-checkpointing", f"only for a DeepSpeed JSON run by the HF Trainer; a {fmt} "
                          f"config states its own activation checkpointing: set {RECOMPUTE_FIELDS[fmt]} in {path.name}")
    text = config_text(path)
    python = fmt == "torchtitan" and is_python_job(path, text)
    if opts.job_config is not None and not python:
        raise ConfigError("--config", f"only for a torchtitan config_registry.py (the function to read); {path.name} is "
                          f"a {fmt} file: drop --config")
    if python:
        return read_py(text, path, opts)
    if fmt == "torchtitan":
        return torchtitan.read(parse_toml(text, str(path)), path.parent, opts, sibling_flavors(path))
    if fmt == "megatron":
        if path.suffix == ".json" or text.lstrip().startswith("{"):  # arguments never open with a brace
            raise ConfigError("config", f"{path} is a JSON file (DeepSpeed?), not Megatron-LM arguments: use "
                              f"meshplan import deepspeed {path}, or --format deepspeed")
        sbatch = None if MEGATRON_HINT.search(text) else sbatch_refusal(path, text)
        if sbatch is not None:  # a Slurm script whose srun runs the launch script (newcomer trial 49)
            raise sbatch
        return megatron.read(text, opts, path.parent)
    if fmt == "deepspeed":
        data = parse_json(text, "config", str(path), "give a DeepSpeed JSON config", unique_keys=True, hjson=True)
        if not isinstance(data, dict):
            raise ConfigError("config", f"{path}: a DeepSpeed config is a JSON object")
        return deepspeed.read(data, opts)
    raise ConfigError("--format", f"{fmt!r}; use {', '.join(FORMATS)}")


def load_any(path, fmt: str | None = None, opts: ImportOptions = ImportOptions(),
             require_mesh: bool = True, foreign: bool = True) -> Config:
    """A Config from a meshplan TOML or a foreign config (``fmt`` or detected); the reader's
    notes and the unused fields end up in ``Config.notes``. ``foreign=False`` (a command
    without the import options): a foreign config is an error saying how to import it."""
    p = Path(path)
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError("--format", f"{fmt!r}; use {', '.join(FORMATS)}")
    fmt = fmt or detect(p, config_text(p))
    if fmt == "meshplan":
        given = [k for k, v in vars(opts).items() if v is not None]
        if given:
            try:
                tomllib.loads(config_text(p))
            except (tomllib.TOMLDecodeError, RecursionError, ValueError):
                load_config(p, require_mesh=require_mesh)  # not valid TOML: its one-line error first
            raise ConfigError(f"--{given[0].replace('_', '-')}", "only for a foreign config; a meshplan TOML says "
                              "its model, cluster and training itself")
        return load_config(p, require_mesh=require_mesh)
    if not foreign:  # a DeepSpeed JSON names neither the model nor the sequence length (import refuses without them)
        extra = " --model M --seq-len S" if fmt == "deepspeed" else ""
        raise ConfigError("config", f"{p} is a {fmt} config; this command reads meshplan TOML: run meshplan import "
                          f"{fmt} {p} --cluster NODE --nodes N{extra} -o plan.toml first (plan, report, groups, memory, step, "
                          f"reliability, search and export read it directly)")
    imp = read_foreign(p, fmt, opts)
    cfg = config_from_dict(imp.tables, base=p.parent, path=str(p), require_mesh=require_mesh)
    return replace(cfg, notes=cfg.notes + imp.all_notes(), origin=fmt, source_model=imp.model_keys,
                   source_said=imp.said)


def import_text(path, fmt: str | None, opts: ImportOptions,
                source: Callable[[str], dict] | None = None, out: Path | None = None) -> tuple[str, Imported]:
    """(meshplan TOML text, the reading) of a foreign config; the tables are validated
    (:func:`meshplan.config.config_from_dict`) before any text is returned. ``source``: the
    ``[source]`` table of the format read (:func:`meshplan.interop.source_file.source_table`);
    ``out``: the TOML's file (None: printed), to which ``model.hf_config`` is written relative
    as ``[source]`` is (:func:`~meshplan.interop.source_file.written_tables`)."""
    p = Path(path)
    fmt = fmt or detect(p, config_text(p))
    if fmt == "meshplan":  # a TOML error or an empty file said first (nc55 #1)
        raise meshplan_refusal(p, config_text(p))
    imp = read_foreign(p, fmt, opts)
    table = source(fmt) if source else {}
    if table and is_python_job(p, config_text(p)):  # the function read, which export -o FILE.py writes back (ttexport)
        table |= {"config": function_tree(config_text(p), str(p), opts.job_config)[0]}
    tables = imp.tables | ({"source": table} if table else {})
    config_from_dict(tables, base=p.parent, path=str(p))
    tables = written_tables(tables, out)
    header = (f"meshplan import {fmt} {p}",) + tuple(f"note: {n}" for n in imp.all_notes())
    header += (f"[source]: meshplan export of this file carries {p.name}'s settings meshplan does not plan "
               f"while {p.name} is there",) if source else ()
    return dumps(tables, header), imp
