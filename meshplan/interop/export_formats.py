"""Each foreign format's file of an export (:func:`meshplan.interop.export.export`), with its
re-import and its header lines: the torchtitan job TOML (:func:`torchtitan_file`), Megatron-LM
arguments (:func:`megatron_file`) and the DeepSpeed JSON (:func:`deepspeed_file`), each keeping
what a carried user file of the same format (:class:`UserFile`) holds that meshplan does not plan,
and naming the keys it writes otherwise (:func:`rewritten_line`).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

from meshplan import catalog
from meshplan.config import Config
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
from meshplan.interop.common import Imported, ImportOptions, rewritten
from meshplan.interop.megatron_env import carried_env
from meshplan.interop.tomlout import dumps, model_table
from meshplan.interop.torchtitan_float8 import Float8Spelling, spelling_note, spelt, spelt_key


class UserFile(NamedTuple):
    """The foreign config a plan was read from, parsed (``fmt``: torchtitan, deepspeed or
    megatron, the formats whose export carries the user's other settings: :func:`~meshplan.interop.export.export`);
    of a torchtitan job TOML also how it names float8 (``doc`` holds the current names), which
    a torchtitan export keeps (:func:`meshplan.interop.torchtitan_float8.spelt`); ``name``: how the
    header names the file where it is not the export's source (a meshplan TOML's ``[source]``,
    :func:`meshplan.interop.source_file.carried_source`), "" where it is."""

    fmt: str
    doc: dict
    float8: Float8Spelling = Float8Spelling.CURRENT
    name: str = ""
    env: tuple[tuple[str, str], ...] = ()  # a Megatron-LM launch script's exports (megatron_env.carried_env)


def torchtitan_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
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
    head += rewritten_line(user and user._replace(doc=spelt(user.doc, spelling)), "torchtitan", source, written)
    head += ac_notes + torchtitan_write.write_notes(cfg, recompute_noted=bool(ac_notes)) \
        + torchtitan_write.etp_note(written.get("parallelism", {}))
    head += spelling_note(spelling, source) if written is not tables else []
    head += torchtitan_write.unset_notes(written)  # the data and schedule no meshplan config holds
    body = dumps(written)
    return body, torchtitan.read(tomllib.loads(body), Path("."), opts, torchtitan_write.flavors_back(cfg)), head


def megatron_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
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
    head += rewritten_line(user, "megatron", source, megatron.parse_args(body), megatron_carry.rewritten_args)
    head += megatron.write_notes(cfg) + carried_env(user.env if user and user.fmt == "megatron" else (), source)
    return body, megatron.read(body, opts), head


def deepspeed_file(cfg: Config, source: str, user: UserFile | None, opts: ImportOptions) -> tuple[str, Imported, list[str]]:
    """(the DeepSpeed JSON of ``cfg``, its re-import, the header's lines): a carried config's
    other keys and its activation-checkpointing section kept, the HF Trainer's "auto" kept where
    the plan's value is its fill, the keys rewritten. A DeepSpeed config holds no model: it is
    re-imported with the config's own (a catalog name, or its fields), and with the plan's model
    code (``training.torch_norm``, :func:`~meshplan.interop.deepspeed_auto.model_code`), which it
    does not hold either; ``recompute = "full"`` by ``--gradient-checkpointing``
    (:func:`~meshplan.interop.export.reimport_options`), the header saying where it is set
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
    head += rewritten_line(user, "deepspeed", source, doc)
    head += deepspeed_carry.recompute_change(mine.doc, cfg.training.recompute) if mine is not None else []
    head += deepspeed_carry.checkpointing_line(cfg.training.recompute)
    body = json.dumps(doc, indent=2) + "\n"
    again = deepspeed.read(deepspeed_auto.fill_hidden(doc, cfg.model.hidden)[0],  # "auto" as the plan's model fills it
                           replace(opts, model=opts.model or catalog.names("model")[0]))
    code = again.tables["training"] | {"torch_norm": cfg.training.torch_norm}  # the model code, as the model: not in it
    return body, replace(again, tables=again.tables | {"model": model_table(cfg), "training": code}), head


def rewritten_line(user: UserFile | None, to: str, source: str, written: dict,
                   listed: Callable[[dict, dict], list[str]] = rewritten) -> list[str]:
    """The header line naming every key of the user's ``to`` file that the export writes with
    another value or drops (``listed``: :func:`~meshplan.interop.common.rewritten`, or the
    format's own, :func:`meshplan.interop.megatron_carry.rewritten_args`); none without one."""
    if user is None or user.fmt != to:
        return []
    lost = listed(user.doc, written)
    return [f"written otherwise than {source} (the plan's value or spelling): {', '.join(lost)}"] if lost else []
