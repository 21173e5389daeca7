"""Any config in, any config out: the loader behind ``plan``/``step``/
``search`` (and ``meshplan import``), and export with what the target does not express.

Detection (:func:`meshplan.interop.detect.detect`) tells the format where the caller gives no ``--format``.

Export (:func:`export`) writes the target's file and re-imports it: every meshplan field that
comes back different (what the target cannot say, such as ``training.memory_reserve``) is
listed in the header, never dropped silently (the comparison: :mod:`meshplan.interop.roundtrip`).
Whether ``search --export N --to T`` can write a row: :mod:`meshplan.interop.search_export`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

from meshplan import catalog
from meshplan.config import Config, config_from_dict, load_config
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json
from meshplan.spec.cluster import ClusterSpec
from meshplan.interop import (
    deepspeed,
    deepspeed_auto,
    deepspeed_carry,
    deepspeed_write,
    megatron,
    megatron_carry,
    torchtitan,
    torchtitan_carry,
    torchtitan_write,
)
from meshplan.interop.common import FORMATS, Imported, ImportOptions, catalog_model_name, rewritten
from meshplan.interop.detect import MEGATRON_HINT, config_text, detect, python_job_refusal, sbatch_refusal
from meshplan.interop.detect import meshplan_refusal  # import's refusal of a meshplan TOML (nc55 #1)
from meshplan.interop.launch import parse_launch
from meshplan.interop.megatron_env import carried_env
from meshplan.interop.roundtrip import StepOf, differences, step_line
from meshplan.interop.tomlout import cluster_table, dumps, meshplan_tables, model_table
from meshplan.interop.torchtitan_checkpoint import without_interval
from meshplan.interop.torchtitan_custom import sibling_flavors
from meshplan.interop.torchtitan_legacy import current_layout
from meshplan.interop.torchtitan_float8 import Float8Spelling, float8_spelling, spelling_note, spelt, spelt_key
from meshplan.interop.written_paths import written_tables
from meshplan.spec.hf import hf_source
from meshplan.spec.recompute_words import deepspeed_recompute_fix

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
    if fmt == "torchtitan":
        python = python_job_refusal(path, text)
        if python is not None:
            raise python
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
    tables = imp.tables | ({"source": source(fmt)} if source else {})
    config_from_dict(tables, base=p.parent, path=str(p))
    tables = written_tables(tables, out)
    header = (f"meshplan import {fmt} {p}",) + tuple(f"note: {n}" for n in imp.all_notes())
    header += (f"[source]: meshplan export of this file carries {p.name}'s settings meshplan does not plan "
               f"while {p.name} is there",) if source else ()
    return dumps(tables, header), imp


def reimport_options(cfg: Config, to: str) -> ImportOptions:
    """The options that give back what a ``to`` file of ``cfg`` does not hold: the cluster,
    and for DeepSpeed the model and sequence length (torchtitan and Megatron-LM files name
    their model, which is what a round trip checks; a torchtitan file naming a model read through
    its ``model.hf_assets_path``, :attr:`~meshplan.config.Config.source_model`, with ``--model``
    that folder's config.json, which the file's folder, relative to where torchtitan runs, may
    not hold). The cluster by its catalog node (and GPU) where it is that entry unchanged, else whole (a ``[cluster]`` written inline, another
    fabric, measured links: :func:`~meshplan.interop.tomlout.cluster_table` writes it out), the
    ClusterSpec as ``cluster``, never its node's name looked up in the catalog."""
    c, table = cfg.cluster, cluster_table(cfg)
    opts = ImportOptions(cluster=table["system"], nodes=c.nodes, gpu=table.get("gpu")) if "system" in table else \
        ImportOptions(cluster=c, nodes=c.nodes)
    if to == "deepspeed":  # recompute full: no DeepSpeed key (deepspeed_write), the HF Trainer's flag
        return replace(opts, model=catalog_model_name(cfg.model), seq_len=cfg.training.seq_len,
                       gradient_checkpointing=True if cfg.training.recompute == "full" else None)
    hf = hf_source(cfg.model.source) if to == "torchtitan" and cfg.source_model else None
    return replace(opts, model=hf[1]) if hf else opts


def _import_line(to: str, opts: ImportOptions, cfg: Config) -> str:
    """The header's ``import with: meshplan import ...`` line; for a cluster carried whole
    (:func:`reimport_options`), the node (``NODE`` where the catalog has none of its name) and
    this plan's ``[cluster]`` to put in the imported TOML, as no option names that cluster."""
    tail = (f" --model {opts.model or 'MODEL'} --seq-len {opts.seq_len}"
            + (" --gradient-checkpointing" if opts.gradient_checkpointing else "") if to == "deepspeed" else
            f" --model {opts.model}" if to == "torchtitan" and opts.model else "")
    if not isinstance(opts.cluster, ClusterSpec):
        return (f"import with: meshplan import {to} FILE --cluster {opts.cluster} --nodes {opts.nodes}"
                + (f" --gpu {opts.gpu}" if opts.gpu else "") + tail)
    node = cfg.cluster.node.name
    known = node in catalog.names("node")
    return (f"import with: meshplan import {to} FILE --cluster {node if known else 'NODE'} --nodes {opts.nodes}"
            f"{tail} -o plan.toml, then replace plan.toml's [cluster] with this plan's ({cfg.cluster.nodes}x {node} "
            + ("differs from the catalog's" if known else "is not a catalog node") + ": export --to meshplan writes it)")


class UserFile(NamedTuple):
    """The foreign config a plan was read from, parsed (``fmt``: torchtitan, deepspeed or
    megatron, the formats whose export carries the user's other settings: :func:`export`);
    of a torchtitan job TOML also how it names float8 (``doc`` holds the current names), which
    a torchtitan export keeps (:func:`meshplan.interop.torchtitan_float8.spelt`); ``name``: how the
    header names the file where it is not the export's source (a meshplan TOML's ``[source]``,
    :func:`meshplan.interop.source_file.carried_source`), "" where it is."""

    fmt: str
    doc: dict
    float8: Float8Spelling = Float8Spelling.CURRENT
    name: str = ""
    env: tuple[tuple[str, str], ...] = ()  # a Megatron-LM launch script's exports (megatron_env.carried_env)


#: Per format that carries: (its ``carried(user, written)``, the names of what it would carry)
#: and its name in the header.
CARRIERS = {"torchtitan": (torchtitan_carry.carried, lambda d: torchtitan_carry.carried(d, {})[1], "torchtitan"),
            "deepspeed": (deepspeed_carry.carried, deepspeed_carry.not_planned, "DeepSpeed"),
            "megatron": (megatron_carry.carried, megatron_carry.not_planned, "Megatron-LM")}


def user_source(path, fmt: str | None = None) -> UserFile | None:
    """The config at ``path`` parsed, when it is a torchtitan job TOML (its older ``[float8]``
    read as ``[quantize.linear.float8]``, the names it used kept in
    :class:`~meshplan.interop.torchtitan_float8.Float8Spelling`), a DeepSpeed JSON or Megatron-LM arguments (their
    flags, :func:`meshplan.interop.megatron.parse_args`) (``fmt`` or detected), else None:
    what :func:`export` carries into a file of the same format."""
    p = Path(path)
    fmt = fmt or detect(p, config_text(p))
    if fmt == "torchtitan":
        raw = parse_toml(config_text(p), str(p))
        return UserFile(fmt, current_layout(raw), float8_spelling(raw))
    if fmt == "deepspeed":
        return UserFile(fmt, parse_json(config_text(p), "config", str(p), "give a DeepSpeed JSON config",
                                        unique_keys=True, hjson=True))
    if fmt == "megatron":
        exported: dict[str, str] = {}
        flags = parse_launch(config_text(p), megatron.SWITCHES, exported=exported)[0]
        return UserFile(fmt, flags, env=tuple(exported.items()))
    return None


def export(cfg: Config, to: str, source: str, user: UserFile | None = None,
           warnings: Sequence[str] = (), refused: Mapping[str, Sequence[str]] | None = None,
           step_of: StepOf | None = None) -> tuple[str, list[str]]:
    """(file text, header lines) of ``cfg`` written as ``to``. The header names the source,
    each of ``warnings`` (``warning: ...``: what the framework's runtime does differently,
    :func:`meshplan.plan_runtime.config_warnings`), how to import the file again, and every meshplan
    field the re-imported file does not give back (``not expressed in <to>: ...``, module
    docstring); it opens TOML and
    arguments files as comments (a DeepSpeed JSON has none: the caller prints it). A target
    that cannot hold ``cfg`` is a ConfigError naming ``--to`` and the foreign formats that
    do (each tried: a suggestion is never refused in turn), or saying that none does, with why each
    other refuses it (what to change for one of them: a Mixtral mesh's recompute for Megatron-LM).
    ``user``: the torchtitan job TOML or DeepSpeed JSON ``cfg`` was read from
    (:func:`user_source`): a file of the same format carries its settings meshplan does not
    plan (optimizer, schedule, checkpoints, ``steps_per_print``, ...) unchanged
    (:func:`meshplan.interop.torchtitan_carry.carried`, :func:`meshplan.interop.deepspeed_carry.carried`),
    the header names them; another target lists them, in one line, as not carried. A torchtitan
    file keeps the user's older float8 names with a header note (:func:`meshplan.interop.torchtitan_float8.spelt`,
    :func:`~meshplan.interop.torchtitan_float8.spelling_note`). ``refused``: per target, what its
    runtime refuses in ``cfg`` (:func:`meshplan.plan_runtime.export_refusals`: its pipeline
    schedule, a MoE mesh): that target is refused, and never suggested. ``step_of``: a
    config's predicted step in seconds (None when it does not resolve; the caller's, as this
    layer plans nothing): when fields are not expressed, the header says what they do to the
    step (``step after the round trip: 119.526 s -> 85.047 s ...``,
    :func:`meshplan.interop.roundtrip.step_line`)."""
    if to not in FORMATS:
        raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
    try:
        return _export(cfg, to, source, user, tuple(warnings), refused or {}, step_of)
    except ConfigError as e:
        if e.field != "--to":
            raise
        why = {t: _refusal(cfg, t, source, refused or {}) for t in FORMATS[1:] if t != to}
        others = [t for t, w in why.items() if w is None]
        fix = f"export --to {' or '.join(others)} instead" if others else \
            "torchtitan, Megatron-LM and DeepSpeed all refuse it (" + "; ".join(
                f"--to {t}: {w}" for t, w in why.items()) + "): keep the meshplan TOML or change what they name"
        raise ConfigError("--to", f"{e.message}; {fix}") from None


def not_expressed(cfg: Config, to: str, refused: Mapping[str, Sequence[str]] | None = None
                  ) -> tuple[list[str], str | None]:
    """(the meshplan fields an export of ``cfg`` to ``to`` does not express, as ``table.key``
    (``training.recompute``; ``memory`` for the table), as its header lists them; why ``to``
    refuses ``cfg``, or None): what ``meshplan search`` says of its rows beside
    ``--export N --to T``."""
    try:
        _, head = _export(cfg, to, "search", refused=refused)
    except ConfigError as e:
        if e.field != "--to":
            raise
        return [], e.message
    pre = f"not expressed in {to}: "
    return [h[len(pre):].split(":")[0] for h in head if h.startswith(pre)], None


def _refusal(cfg: Config, to: str, source: str, refused: Mapping[str, Sequence[str]]) -> str | None:
    """Why ``to`` refuses ``cfg`` (its ConfigError's message, the field ``--to`` left out), None when
    ``cfg`` exports to it."""
    try:
        _export(cfg, to, source, refused=refused)
    except ConfigError as e:
        return e.message if e.field == "--to" else str(e)
    return None


def _export(cfg: Config, to: str, source: str, user: UserFile | None = None,
            warnings: tuple[str, ...] = (), refused: Mapping[str, Sequence[str]] | None = None,
            step_of: StepOf | None = None) -> tuple[str, list[str]]:
    """:func:`export` without the suggestion of another target: the header (the plan's source,
    its warnings, what a carried file of another format holds that is not carried), the target's
    file (:func:`_torchtitan_file`, :func:`_megatron_file`, :func:`_deepspeed_file`) and what its
    re-import does not express (:func:`_lost_lines`)."""
    if refused and refused.get(to):
        raise ConfigError("--to", refused[to][0])  # it ends with what is refused (export_refusals)
    opts = reimport_options(cfg, to)
    head = [f"meshplan export of {source} ({cfg.model.name} on {cfg.cluster.nodes}x {cfg.cluster.node.name})"]
    head += [f"warning: {w}" for w in warnings]
    source = user.name if user is not None and user.name else source  # the file carried from, as named
    head += _not_carried(cfg, to, user)
    if to == "meshplan":
        return dumps(meshplan_tables(cfg), tuple(head)), head
    head.append(_import_line(to, opts, cfg))
    if to == "torchtitan":
        body, again, lines = _torchtitan_file(cfg, source, user, opts)
    elif to == "megatron":
        body, again, lines = _megatron_file(cfg, source, user, opts)
        cfg = megatron.exported_model(cfg)  # its --max-position-embeddings raised to the sequence (the note)
    else:
        body, again, lines = _deepspeed_file(cfg, source, user, opts)
    head += lines
    head += _lost_lines(cfg, to, body, again, step_of)
    if to == "deepspeed":  # JSON has no comments: the caller prints the header
        return body, head
    return "\n".join(f"# {h}" for h in head) + "\n\n" + body, head


def _not_carried(cfg: Config, to: str, user: UserFile | None) -> list[str]:
    """The line naming the settings of a ``user`` file of another format that meshplan does not
    plan, so not carried to ``to`` (none into a meshplan TOML that keeps the file as [source]; a
    torchtitan checkpoint interval goes as [reliability] or ``--save-interval``)."""
    if user is None or user.fmt == to or (to == "meshplan" and cfg.source):  # [source] kept
        return []
    _, names, label = CARRIERS[user.fmt]
    doc = user.doc
    if user.fmt == "torchtitan" and cfg.checkpoint_interval_steps and to in ("meshplan", "megatron"):
        doc = without_interval(doc)  # carried as [reliability] or --save-interval
    kept = names(doc)
    return [f"not carried to {to}: the {label} settings meshplan does not plan: {', '.join(kept)}"] if kept else []


def _torchtitan_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
    """(the torchtitan TOML of ``cfg``, its re-import, the header's lines): a carried torchtitan
    file's other keys and AC settings kept, its float8 spelling kept, the keys rewritten, the notes
    of :mod:`~meshplan.interop.torchtitan_write` (the torchtitan it is for, etp, the data and
    schedule no meshplan config holds)."""
    head = [torchtitan_write.TARGET_NOTE]  # the torchtitan this file is for, and a newer one
    tables, kept = torchtitan_carry.carried(user.doc, torchtitan_write.write(cfg)) if user is not None and \
        user.fmt == "torchtitan" else (torchtitan_write.write(cfg), [])
    tables, ac_notes = torchtitan_carry.kept_recompute(user.doc, tables, cfg) if user is not None and \
        user.fmt == "torchtitan" else (tables, [])
    spelling = user.float8 if user is not None and user.fmt == "torchtitan" else Float8Spelling.CURRENT
    written = spelt(tables, spelling)  # the user's float8 names kept, the keys listed in them
    if kept:
        head.append(f"carried unchanged from {source}: {', '.join(spelt_key(k, spelling) for k in kept)}")
    head += _rewritten(user and user._replace(doc=spelt(user.doc, spelling)), "torchtitan", source, written)
    head += ac_notes + torchtitan_write.write_notes(cfg, recompute_noted=bool(ac_notes)) \
        + torchtitan_write.etp_note(written.get("parallelism", {}))
    head += spelling_note(spelling, source) if written is not tables else []
    head += torchtitan_write.unset_notes(written)  # the data and schedule no meshplan config holds
    body = dumps(written)
    return body, torchtitan.read(tomllib.loads(body), Path("."), opts, torchtitan_write.flavors_back(cfg)), head


def _megatron_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
    """(Megatron-LM arguments of ``cfg``, their re-import, the header's lines): a carried
    arguments file's other flags kept (a carried switch the plan keeps off dropped), the flags
    rewritten, :func:`~meshplan.interop.megatron_write.write_notes` and its exported variables."""
    head: list[str] = []
    off = megatron_carry.planned_off(cfg.training)  # a carried switch the plan keeps off is dropped
    args, kept = megatron_carry.carried(user.doc, megatron.write(cfg), off) if user is not None and \
        user.fmt == "megatron" else (megatron.write(cfg), [])
    if kept:
        head.append(f"carried unchanged from {source}: {', '.join(kept)}")
    body = "\n".join(args) + "\n"
    head += _rewritten(user, "megatron", source, megatron.parse_args(body), megatron_carry.rewritten_args)
    head += megatron.write_notes(cfg) + carried_env(user.env if user and user.fmt == "megatron" else (), source)
    return body, megatron.read(body, opts), head


def _deepspeed_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
    """(the DeepSpeed JSON of ``cfg``, its re-import, the header's lines): a carried config's
    other keys and its activation-checkpointing section kept, the HF Trainer's "auto" kept where
    the plan's value is its fill, the keys rewritten. A DeepSpeed config holds no model: it is
    re-imported with the config's own (a catalog name, or its fields), and with the plan's model
    code (``training.torch_norm``, :func:`~meshplan.interop.deepspeed_auto.model_code`), which it
    does not hold either; ``recompute = "full"`` by ``--gradient-checkpointing``
    (:func:`reimport_options`), the header saying where it is set
    (:func:`~meshplan.interop.deepspeed_carry.checkpointing_line`)."""
    head: list[str] = []
    mine = user if user is not None and user.fmt == "deepspeed" else None
    doc, kept = deepspeed_carry.carried(mine.doc, deepspeed_carry.with_section(
        mine.doc, deepspeed_write.write(cfg), cfg.training.recompute)) if mine is not None \
        else (deepspeed_write.write(cfg), [])
    if mine is not None:  # the HF Trainer's "auto" kept where the plan's value is its fill
        doc = deepspeed_auto.keep_auto(mine.doc, doc, cfg.model.hidden)
    if kept:
        head.append(f"carried unchanged from {source}: {', '.join(kept)}")
    head += _rewritten(user, "deepspeed", source, doc)
    head += deepspeed_carry.recompute_change(mine.doc, cfg.training.recompute) if mine is not None else []
    head += deepspeed_carry.checkpointing_line(cfg.training.recompute)
    body = json.dumps(doc, indent=2) + "\n"
    again = deepspeed.read(deepspeed_auto.fill_hidden(doc, cfg.model.hidden)[0],  # "auto" as the plan's model fills it
                           replace(opts, model=opts.model or catalog.names("model")[0]))
    code = again.tables["training"] | {"torch_norm": cfg.training.torch_norm}  # the model code, as the model: not in it
    return body, replace(again, tables=again.tables | {"model": model_table(cfg), "training": code}), head


def _lost_lines(cfg: Config, to: str, body: str, again: Imported, step_of: StepOf | None) -> list[str]:
    """What the re-import ``again`` of ``body`` does not express of ``cfg``
    (:func:`~meshplan.interop.roundtrip.differences`; a field no Megatron-LM flag states is
    Megatron-LM's default, not a catalog match's: :func:`~meshplan.interop.megatron_model.unstated`),
    each a line (DeepSpeed's recompute with its fix), then what it changes in the step
    (:func:`~meshplan.interop.roundtrip.step_line`)."""
    back = config_from_dict(again.tables)
    if to == "megatron":  # a field no flag states is Megatron-LM's default, not a catalog match's (unstated)
        unset = megatron.unstated(cfg.model, megatron.parse_args(body))
        back = replace(back, model=back.model.model_copy(update=unset))
    lost = differences(cfg, back)
    lines = [f"not expressed in {to}: {d}" + (f" ({deepspeed_recompute_fix(cfg.training)})"
                                              if to == "deepspeed" and d.startswith("training.recompute:") else "")
             for d in lost]
    return lines + (step_line(cfg, back, to, step_of) if lost and step_of is not None else [])


def _rewritten(user: UserFile | None, to: str, source: str, written: dict,
               listed: Callable[[dict, dict], list[str]] = rewritten) -> list[str]:
    """The header line naming every key of the user's ``to`` file that the export writes with
    another value or drops (``listed``: :func:`~meshplan.interop.common.rewritten`, or the
    format's own, :func:`meshplan.interop.megatron_carry.rewritten_args`); none without one."""
    if user is None or user.fmt != to:
        return []
    lost = listed(user.doc, written)
    return [f"written otherwise than {source} (the plan's value or spelling): {', '.join(lost)}"] if lost else []
