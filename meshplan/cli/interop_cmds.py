"""import and export: a torchtitan job TOML, Megatron-LM arguments or a DeepSpeed JSON to a
meshplan TOML, and a plan's config back to any of them (:func:`_write_export`, which
``search --export`` uses too)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

import typer

from meshplan.cli.common import (
    CONFIG_HELP,
    _Stdout,
    _echo,
    _json_option,
    _refuse_existing,
    _write_doc,
    _written,
    _wrote,
)
from meshplan.cli.foreign_opts import Foreign, foreign_options
from meshplan.cli.loading import _notes, checked_world_error
from meshplan.errors import ConfigError
from meshplan.fileio import write_output
from meshplan.interop.common import FORMATS
from meshplan.interop.deepspeed import DS_SCOPE
from meshplan.interop.launch_args import flag_lines
from meshplan.interop.export import export
from meshplan.interop.export_formats import UserFile
from meshplan.interop.foreign import import_text, load_any
from meshplan.interop.torchtitan_custom import meshplan_snippet, snippet
from meshplan.interop.torchtitan_pytarget import REVISIONS, PyTarget, source_revision, target
from meshplan.interop.torchtitan_write import custom_flavor
from meshplan.interop.detect import config_text, is_python_job
from meshplan.interop.source_file import carried_source, source_table, with_source_model
from meshplan.plan import Infeasible, build_plan
from meshplan.plan_runtime import config_warnings, export_refusals
from meshplan.report.json_docs import export_doc, import_doc
from meshplan.schedule.steptime import step_time


#: ``export --torchtitan-revision``: which torchtitan file ``--to torchtitan`` writes (torchtitan_pywrite.target).
REVISION_HELP = (f"--to torchtitan: {', '.join(REVISIONS)}: v0.2.2 writes the job TOML, 9810191 or b5bcd76 a Python "
                 "config function in that torchtitan's field names (default by -o: FILE.toml the job TOML, "
                 "FILE.py the Python config in a config_registry.py's own revision, else b5bcd76; -o -: a "
                 "config_registry.py's Python, else the job TOML)")


def _write_export(cfg, to: str, out: Path | _Stdout, source: str, force: bool,
                  user: Optional[UserFile] = None, warnings: Sequence[str] = (),
                  pyjob: Optional[PyTarget] = None) -> tuple[list[str], list[Path]]:
    """Write ``cfg`` as ``to`` to ``out`` (``-o -``: stdout), printing the header (source,
    how to import it, what the format does not express, the torchtitan or DeepSpeed settings
    ``user``'s file carries or not, ``warning:`` lines: :func:`~meshplan.plan_runtime.config_warnings`
    and ``warnings``, e.g. a gone [source] file or ``search --export``'s headroom warning), and beside a
    torchtitan job TOML naming a llama3 flavor of the model's own the ``.py`` registering it (:func:`_flavor_file`);
    ``pyjob``: a torchtitan Python config in place of the job TOML (:func:`~meshplan.interop.torchtitan_pywrite.target`);
    returns the header and the files written."""
    refused = {t: export_refusals(cfg, t) for t in FORMATS}
    text, header = export(replace(cfg, notes=()), to, source, user, [*config_warnings(cfg), *warnings], refused,
                          _step_s, pyjob)
    flavor = custom_flavor(cfg) if to == "torchtitan" and pyjob is None else None
    py = _flavor_file(out, force) if flavor else None  # refused before anything is written
    for line in header[1:]:
        typer.echo(line)
    if isinstance(out, _Stdout):  # Megatron-LM arguments: the flags alone (the header went to stderr above), so
        # `python pretrain_gpt.py $(meshplan export job.toml --to megatron -o -)` takes them as they are
        out.stream.write(flag_lines(text) if to == "megatron" else text)
        out.stream.flush()
        return header, []
    _wrote(write_output(out, text, force=force, field='-o'))
    if py is None or flavor is None:
        return header, [out]
    write_output(py, snippet(flavor, out.name), force=force, field="-o")
    module = f'"{py.stem}"' if py.stem.isidentifier() else "its module name (rename it to a Python name)"
    _echo(f"wrote {py}: torchtitan llama3 flavor {flavor.name!r} (model.flavor of {out.name}); run it before "
          f"training: [experimental] custom_import = {module} with its folder on PYTHONPATH, or append it to "
          f"torchtitan/models/llama3/__init__.py")
    return header, [out, py]


def python_source(config: Path, cfg, function: Optional[str], revision: Optional[str],
                  to: str) -> tuple[Path, Optional[str], bool]:
    """The torchtitan Python config whose values ``export --to torchtitan`` (and ``search --export``)
    keeps, as (file, function, whether it is one): ``config`` itself where it is a torchtitan ``.py``
    (``function``: its ``--config``); else, for ``--to torchtitan``, the ``.py`` an import read, named
    by ``cfg``'s [source] (its ``config`` the function), where it still exists and ``revision`` is
    none or its own (another revision: a note, and the plan alone); else (``config``, ``function``, False)."""
    python = cfg.origin == "torchtitan" and is_python_job(config, config_text(config))
    if not python and to == "torchtitan" and cfg.source is not None and cfg.source_config and \
            Path(cfg.source[0]).is_file():  # an import of a .py: its [source], in its own revision's names
        own = source_revision(Path(cfg.source[0]), cfg.source_config)
        if revision is None or revision == own:
            return Path(cfg.source[0]), cfg.source_config, True
        _echo(f"note: {cfg.source[0]}, the [source] of {config}, is in torchtitan {own}'s names: "
              f"--torchtitan-revision {revision} writes the plan alone, carrying none of its values")
    return config, function, python


def _flavor_file(out: Path | _Stdout, force: bool) -> Path:
    """The ``.py`` beside the job TOML ``out`` that registers its llama3 flavor; a ConfigError naming
    ``-o`` for stdout (two files), for an ``-o`` that is that ``.py`` itself, where the ``.py`` exists
    (without ``--force``), and, with ``--force``, where it exists and is not a flavor file meshplan
    wrote (:func:`~meshplan.interop.torchtitan_custom.meshplan_snippet`: ``-o train.toml --force``
    beside the user's ``train.py``): nothing the user wrote is replaced."""
    if isinstance(out, _Stdout):
        raise ConfigError("-o", "- (stdout) holds one file; this export writes two (the job TOML and the .py "
                          "registering its llama3 flavor): give -o FILE.toml")
    py = out.with_suffix(".py")
    if py == out:
        raise ConfigError("-o", f"{out} is where the .py registering the llama3 flavor goes; name the job TOML "
                          f"{out.with_suffix('.toml')}")
    _refuse_existing(py, force, "-o")
    if force and py.is_file() and not meshplan_snippet(py.read_text(encoding="utf-8", errors="replace")):
        raise ConfigError("-o", f"{py} exists and is no flavor file meshplan wrote (--force replaces only those): "
                          f"move it, or name the job TOML otherwise")
    return py


def _step_s(cfg) -> Optional[tuple[float, dict[str, float]]]:
    """The predicted step of ``cfg`` in seconds and its parts as ``step`` prints them
    (:meth:`~meshplan.schedule.step_summary.StepTime.parts_by_stream`, named by
    :meth:`~meshplan.schedule.step_summary.StepTime.part_named`), None when its mesh does not
    resolve (export's round-trip line)."""
    try:
        p = build_plan(cfg)
        if isinstance(p, Infeasible):
            return None
        st = step_time(p)
        return st.step_s, {st.part_named(k): v for k, v in st.parts_by_stream().items()}
    except ConfigError:  # a pipeline the plan refuses (its own export refusal says so)
        return None


@foreign_options(with_format=False)
def import_cmd(fmt: str = typer.Argument(..., metavar="FORMAT", help="torchtitan, megatron or deepspeed (auto: "
                                         "detect)"),
               source: Path = typer.Argument(..., metavar="FILE", help="the foreign config"),
               out: Optional[Path] = typer.Option(None, "-o", "--out", help="meshplan TOML to write (omitted "
                                                  "or -: print it to stdout)"),
               force: bool = typer.Option(False, "--force", help="replace existing -o and --json files"),
               json_path: Optional[Path] = _json_option("import"),
               foreign: Foreign = Foreign()):
    """Read a torchtitan job TOML (v0.2.2 and before) or Python config registry (9810191 on: a config_registry.py,
    --config NAME its function, read without running it), Megatron-LM arguments (file or launch script) or DeepSpeed
    JSON and write the meshplan TOML. The fields meshplan does not use are listed by name (in the output and its header); the
    TOML's [source] table names the file, so that export of the TOML carries them as export of the file does;
    what the file does not say (the cluster; a DeepSpeed config's model and sequence length) comes from the
    options. Exit 1, nothing written, for a torchtitan tensor_parallel_degree the model refuses where
    data_parallel_shard_degree -1 has nothing to infer (no mesh, no global batch to write)."""

    if fmt not in ("auto",) + FORMATS[1:]:
        raise ConfigError("FORMAT", f"{fmt!r}; use torchtitan, megatron, deepspeed or auto")
    file = out if isinstance(out, Path) else None  # None: printed (no -o, or -o -)
    _refuse_existing(file, force, "-o")
    _refuse_existing(json_path, force, "--json")
    text, imp = import_text(source, None if fmt == "auto" else fmt, foreign.options(),
                            lambda read_as: source_table(source, read_as, file), file)
    if isinstance(out, _Stdout):
        out.stream.write(text)
        out.stream.flush()
    elif file is None:
        typer.echo(text, nl=False)
    else:
        for n in imp.all_notes():
            typer.echo(f"note: {n}")
        _wrote(write_output(file, text, force=force, field='-o'))
    _write_doc(json_path, import_doc(imp.fmt, str(source), imp, text, _written([file] if file else [])), force)


@foreign_options()
def export_cmd(config: Path = typer.Argument(..., help="the plan's " + CONFIG_HELP),
               to: str = typer.Option(..., "--to", help="meshplan, torchtitan, megatron or deepspeed"),
               out: Path = typer.Option(..., "-o", "--out", help="file to write (-: stdout, the header then on "
                                                                   "stderr)"),
               force: bool = typer.Option(False, "--force", help="replace existing -o and --json files (and a "
                                                          "flavor .py beside -o that meshplan wrote)"),
               json_path: Optional[Path] = _json_option("export"),
               revision: Optional[str] = typer.Option(None, "--torchtitan-revision", help=REVISION_HELP),
               name: Optional[str] = typer.Option(None, "--name", help="--to torchtitan, a Python config: the "
                                                  "function's name (default: the source's, else CONFIG's file name)"),
               foreign: Foreign = Foreign()):
    # --help: EXPORT_HELP, given at registration (meshplan.cli.HELP)

    if to not in FORMATS:
        raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
    if to != "torchtitan" and (revision or name):
        raise ConfigError("--torchtitan-revision" if revision else "--name", "is for --to torchtitan only")
    _refuse_existing(out, force, "-o")
    _refuse_existing(json_path, force, "--json")
    cfg = load_any(config, foreign.fmt, foreign.options())
    _notes(cfg)
    bad = None if cfg.origin else checked_world_error(cfg)  # a meshplan TOML: plan's refusal, its fixes checked
    if bad is not None:
        raise bad
    user, gone = carried_source(config, foreign.fmt, cfg)
    cfg = with_source_model(cfg, user)  # a [source] torchtitan file's model names, written back
    py, function, python = python_source(config, cfg, foreign.options().job_config, revision, to)
    pyjob = target(out, revision, name, py, python, function) if to == "torchtitan" else None
    if python and to == "torchtitan" and pyjob is None:  # nc57 #6: the job TOML asked for by -o's suffix
        _echo(f"note: {py.name} is torchtitan's Python config; this job TOML carries none of its other values: "
              f"-o FILE.py writes its function back in its own names, keeping them")
    named = str(config) if py == config else f"{py}, the [source] of {config}"
    header, files = _write_export(cfg, to, out, named, force, user, gone, pyjob)
    _write_doc(json_path, export_doc(str(config), to, header, _written(files)), force)


#: ``export --help``: the DeepSpeed scope is the one string its refusal and ``search`` use.
EXPORT_HELP = (
    "Write a plan's config as a meshplan TOML (its layer split written out), a torchtitan Python config (-o "
    "FILE.py or --torchtitan-revision 9810191/b5bcd76: one function, --name or the source's, returning the "
    "Trainer.Config in that torchtitan's field names; from a config_registry.py in its own names, every value it "
    "states that meshplan does not plan kept as written), a torchtitan job TOML (-o FILE.toml: for torchtitan "
    "<= v0.2.2, the last that reads one; its header's target: line says how to carry its degrees to a newer one; "
    "a dense Llama-style model torchtitan ships no flavor of is written as model.flavor = its name, with FILE's "
    ".py beside it registering that llama3 flavor with the model's sizes, never over a file meshplan did not write, "
    "--force or not), "
    f"Megatron-LM arguments or a DeepSpeed config ({DS_SCOPE}). Every meshplan field the target does not "
    "express is listed (re-imported and compared), with the step before and after when it differs and the parts "
    "of the step that moved most, and "
    "what the framework's runtime is known to run differently as warning lines; a mesh the target cannot "
    "run is refused with the reason. From a torchtitan job TOML, a torchtitan file carries the settings "
    "meshplan does not plan ([optimizer], [lr_scheduler], [checkpoint], training.steps, ...) unchanged, "
    "from a DeepSpeed JSON a DeepSpeed file its keys meshplan does not plan (steps_per_print, optimizer, "
    "scheduler, ...), and from Megatron-LM arguments a Megatron-LM file its flags meshplan does not read "
    "(--lr, --train-iters, ...), as from a meshplan TOML whose [source] (written by import) names such a file, "
    "or a warning line when that file is gone (a torchtitan file with none to carry gets a note naming the "
    "tokenizer folder, dataset, steps and learning rate it does not write, with torchtitan's defaults); every key of that file written with another value or dropped is listed; "
    "another target lists them as not carried. A torchtitan file's older float8 names (converter \"float8\", "
    "[float8]) are kept, with a header note; a Megatron FSDP export says to unset CUDA_DEVICE_MAX_CONNECTIONS, "
    "and with pp > 1 that Megatron-LM runs it as written and which zero1 plan to compare."
)
