"""Any config out: export of a :class:`~meshplan.config.Config` as a meshplan TOML, a torchtitan
job TOML, Megatron-LM arguments or a DeepSpeed JSON, with what the target does not express.

Export (:func:`export`) writes the target's file and re-imports it: every meshplan field that
comes back different (what the target cannot say, such as ``training.memory_reserve``) is
listed in the header, never dropped silently (the comparison: :mod:`meshplan.interop.roundtrip`).
A foreign file the plan was read from (:func:`user_source`) has its other settings carried into a
file of its own format. Each format's file and its re-import: :mod:`meshplan.interop.export_formats`.
Whether ``search --export N --to T`` can write a row: :mod:`meshplan.interop.search_export`.
The loader of any config in: :mod:`meshplan.interop.foreign`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from meshplan import catalog
from meshplan.config import Config, config_from_dict
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import parse_json
from meshplan.spec.cluster import ClusterSpec
from meshplan.interop import deepspeed_carry, megatron, megatron_carry, torchtitan_carry, torchtitan_pywrite
from meshplan.interop.torchtitan_pytarget import PyTarget
from meshplan.interop.common import FORMATS, Imported, ImportOptions, catalog_model_name
from meshplan.interop.detect import config_text, detect, is_python_job
from meshplan.interop.export_formats import UserFile, deepspeed_file, megatron_file, torchtitan_file
from meshplan.interop.launch import parse_launch
from meshplan.interop.roundtrip import StepOf, differences, step_line
from meshplan.interop.tomlout import cluster_table, dumps, meshplan_tables
from meshplan.interop.torchtitan_checkpoint import without_interval
from meshplan.interop.torchtitan_legacy import current_layout
from meshplan.interop.torchtitan_float8 import float8_spelling
from meshplan.spec.hf import hf_source
from meshplan.spec.recompute_words import deepspeed_recompute_fix


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
    if fmt == "torchtitan" and is_python_job(p, config_text(p)):
        return None  # a config_registry.py: nothing of it is carried into a job TOML
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


def _import_line(to: str, opts: ImportOptions, cfg: Config, function: str | None = None) -> str:
    """The header's ``import with: meshplan import ...`` line; for a cluster carried whole
    (:func:`reimport_options`), the node (``NODE`` where the catalog has none of its name) and
    this plan's ``[cluster]`` to put in the imported TOML, as no option names that cluster; ``function``: a
    torchtitan Python config's (``--config``)."""
    tail = (f" --config {function}" if function else "") + (f" --model {opts.model or 'MODEL'} --seq-len {opts.seq_len}"
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


def export(cfg: Config, to: str, source: str, user: UserFile | None = None,
           warnings: Sequence[str] = (), refused: Mapping[str, Sequence[str]] | None = None,
           step_of: StepOf | None = None, py: PyTarget | None = None) -> tuple[str, list[str]]:
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
    :func:`meshplan.interop.roundtrip.step_line`). ``py``: with ``to`` torchtitan, a Python config
    function in place of the job TOML (:func:`meshplan.interop.torchtitan_pywrite.py_file`)."""
    if to not in FORMATS:
        raise ConfigError("--to", f"{to!r}; use {', '.join(FORMATS)}")
    try:
        return _export(cfg, to, source, user, tuple(warnings), refused or {}, step_of, py)
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
            step_of: StepOf | None = None, py: PyTarget | None = None) -> tuple[str, list[str]]:
    """:func:`export` without the suggestion of another target: the header (the plan's source,
    its warnings, what a carried file of another format holds that is not carried), the target's
    file (:func:`~meshplan.interop.export_formats.torchtitan_file`, :func:`~meshplan.interop.export_formats.megatron_file`, :func:`~meshplan.interop.export_formats.deepspeed_file`) and what its
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
    head.append(_import_line(to, opts, cfg, py.name if to == "torchtitan" and py else None))
    if to == "torchtitan" and py is not None:
        body, again, lines = torchtitan_pywrite.py_file(cfg, source, py, opts, user.doc if user is not None and
                                                        user.fmt == "torchtitan" else None)
    elif to == "torchtitan":
        body, again, lines = torchtitan_file(cfg, source, user, opts)
    elif to == "megatron":
        body, again, lines = megatron_file(cfg, source, user, opts)
        cfg = megatron.exported_model(cfg)  # its --max-position-embeddings raised to the sequence (the note)
    else:
        body, again, lines = deepspeed_file(cfg, source, user, opts)
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
