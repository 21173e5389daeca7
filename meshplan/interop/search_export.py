"""``meshplan search --export N --to T``: whether a target can take a row of the search.
Before the search, from the config alone, why a target refuses every row the search can
rank (:func:`search_export_refusal`); after it, why it refuses row ``N``, naming the first
row it takes and the formats that write row ``N`` (:func:`search_row_refusal`, on
:func:`meshplan.interop.export.not_expressed`). ``--export 1b`` names row 1's mesh at another
setting by its label (:func:`export_pick`; :func:`missing_variant`, :func:`search_variant_refusal`).
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.common import FORMATS
from meshplan.interop.export import not_expressed
from meshplan.interop.torchtitan_write import custom_flavor, model_flavor, no_flavor


def search_export_refusal(cfg: Config, to: str) -> str | None:
    """Why export target ``to`` refuses every row ``meshplan search`` of ``cfg`` can rank, known
    from the config before the search runs (``search --export N --to T`` checks it first);
    None when some row may export (a row's own mesh and pipeline are checked after the search,
    :func:`~meshplan.interop.export.export` with :func:`meshplan.plan_runtime.export_refusals`).
    torchtitan: a model without a torchtitan flavor (:func:`~meshplan.interop.torchtitan_write.model_flavor`) nor
    a llama3 flavor of its own (:func:`~meshplan.interop.torchtitan_write.custom_flavor`), or ``[search] sharding`` without one FSDP2 sharding (zero3, hsdp);
    DeepSpeed: ``[search]`` degrees that leave no mesh of one data axis (pp, tp, cp, ep 1), or
    dtypes its config has no key for (:func:`meshplan.interop.deepspeed_write.write`).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 1024}, "search": {"sharding": ["zero1"], "tp": [2, 4]}},
    ...     require_mesh=False)
    >>> search_export_refusal(cfg, "torchtitan")
    'torchtitan shards with FSDP2 (zero3, hsdp); [search] sharding lists zero1 only: add zero3 to search.sharding or export --to megatron'
    >>> search_export_refusal(cfg, "deepspeed")
    'a DeepSpeed config runs ZeRO over one data axis; [search] tp = [2, 4] leaves no such mesh: add 1 to search.tp or export --to megatron'
    >>> search_export_refusal(cfg, "megatron") is None
    True
    """
    o, t = cfg.search, cfg.training
    if to == "torchtitan":
        if model_flavor(cfg.model) is None and not cfg.source_model and custom_flavor(cfg) is None:
            return f"{no_flavor(cfg.model)}; or export --to meshplan or megatron"
        if not {"zero3", "hsdp"} & set(o.sharding):
            return (f"torchtitan shards with FSDP2 (zero3, hsdp); [search] sharding lists {'/'.join(o.sharding)} only: "
                    "add zero3 to search.sharding or export --to megatron")
    if to == "deepspeed":
        for key in ("pp", "tp", "cp", "ep", "dp_replicate"):
            allowed = getattr(o, key)
            if allowed is not None and 1 not in allowed:
                return (f"a DeepSpeed config runs ZeRO over one data axis; [search] {key} = {allowed} leaves no such "
                        f"mesh: add 1 to search.{key} or export --to megatron")
        if t.compute_dtype != t.param_dtype or t.param_dtype == "fp8":
            return (f"DeepSpeed stores parameters in the compute dtype (bf16/fp16 with an fp32 master copy); "
                    f"param_dtype {t.param_dtype} with compute_dtype {t.compute_dtype} has no key: export --to "
                    "megatron or torchtitan")
    return None


def export_pick(text: str) -> tuple[int, str]:
    """``search --export``'s value as (row, letter): a row of the top table from 1 (``"2"``: (2, "")) or
    row 1's mesh at another setting by its label on the line under the table (``"1b"``: (1, "b"),
    :func:`meshplan.search.rank.variant_label`); anything else a one-line error naming --export.

    >>> export_pick("2"), export_pick("1b")
    ((2, ''), (1, 'b'))
    >>> export_pick("2a")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: --export: 2a: only row 1's mesh has its other settings labelled (1a, 1b, 1c at most, on the line under the table)
    """
    m = re.fullmatch(r"(\d+)([a-z]?)", text.strip())
    if m is None:
        raise ConfigError("--export", f"{text!r}: give a row number (1 = the top) or a label of row 1's other "
                          "settings from the line under the table (1a, 1b, 1c)")
    n, letter = int(m[1]), m[2]
    if n < 1:
        raise ConfigError("--export", f"{n}: rows are ranked from 1")
    if letter and n != 1:
        raise ConfigError("--export", f"{text.strip()}: only row 1's mesh has its other settings labelled (1a, 1b, "
                          "1c at most, on the line under the table)")
    return n, letter


def missing_variant(label: str, labels: Sequence[str], rows: int) -> str:
    """Why ``search --export label`` names no variant: the labels the search printed, ``labels``
    (row 1's other settings within 1%), or that it printed none; ``rows``: the rows listed.

    >>> print(missing_variant("1d", ["1a", "1b"], 1))
    1d: the search labels 1a, 1b (row 1's mesh at other settings, on the line under the table); export one of them or a row up to 1
    """
    have = (f"the search labels {', '.join(labels)}" if labels else
            "the search labels none: row 1's mesh has no other setting within 1% of the fastest step")
    return (f"{label}: {have} (row 1's mesh at other settings, on the line under the table); export "
            + ("one of them or " if labels else "") + f"a row up to {rows}")


def search_row_refusal(n: int, rows: Sequence[Config], to: str,
                       refused_of: Callable[[Config], Mapping[str, Sequence[str]]]) -> str | None:
    """Why ``search --export n --to to`` cannot write row ``n`` (from 1) of ``rows`` (the
    search's top, in order), naming the first row it can write, and the other formats that
    write row ``n`` with its ZeRO engine (``training.zero12_engine``, ``zero3_engine``); a
    format that would drop the engine (``--to megatron`` of a ``deepspeed-2021`` ZeRO-3 row:
    Megatron-DeepSpeed's ``--deepspeed`` is written for the current engines only,
    :mod:`meshplan.interop.megatron_deepspeed`) is named as such.
    None when row ``n`` exports. ``refused_of``: :func:`meshplan.plan_runtime.export_refusals` per
    format."""
    cfg = rows[n - 1]
    _, why = not_expressed(cfg, to, refused_of(cfg))
    if why is None:
        return None
    first = next((i for i, c in enumerate(rows, 1) if not_expressed(c, to, refused_of(c))[1] is None), None)
    msg = f"row {n} cannot be written --to {to}: {why}; " + (
        f"row {first} is the first row it takes (--export {first})" if first else
        f"none of the {len(rows)} rows shown exports --to {to}")
    return msg + _other_formats(f"row {n}", cfg, to, refused_of)


def search_variant_refusal(label: str, cfg: Config, to: str,
                           refused_of: Callable[[Config], Mapping[str, Sequence[str]]]) -> str | None:
    """Why ``search --export label --to to`` cannot write the variant ``cfg`` (row 1's mesh at
    another setting, labelled ``label``), with the formats that write it (as
    :func:`search_row_refusal`); None when it exports."""
    _, why = not_expressed(cfg, to, refused_of(cfg))
    if why is None:
        return None
    return f"{label} (row 1's mesh at another setting) cannot be written --to {to}: {why}" + \
        _other_formats(label, cfg, to, refused_of).replace(", or export", "; export", 1)


def _other_formats(what: str, cfg: Config, to: str,
                   refused_of: Callable[[Config], Mapping[str, Sequence[str]]]) -> str:
    """The formats other than ``to`` that write ``cfg`` (``what``: ``row 2``, ``1b``) with its
    ZeRO engine, and those that would drop the engine, as the tail of a refusal line."""
    keep: list[str] = []
    drop: list[str] = []
    for t in FORMATS[1:]:
        lost, no = not_expressed(cfg, t, refused_of(cfg)) if t != to else ([], "")
        if no is None:
            engine = [k for k in lost if k in ("training.zero12_engine", "training.zero3_engine")]
            (drop if engine else keep).append(t)
    msg = f", or export {what} --to {' or '.join(keep)}" if keep else ""
    if drop:
        msg += (f" ({' and '.join(f'--to {t}' for t in drop)} would write {what} without its ZeRO engine, "
                f"{_engine_name(cfg)}" + (": meshplan writes Megatron-DeepSpeed's --deepspeed for DeepSpeed's "
                                          "current engines only)" if "megatron" in drop else ")"))
    return msg


def _engine_name(cfg: Config) -> str:
    """The ZeRO engine ``cfg`` plans with, named for :func:`search_row_refusal`."""
    t = cfg.training
    if t.zero3_engine != "fsdp2" and t.sharding == "zero3":
        return "DeepSpeed's 2021 ZeRO-3" if t.zero3_engine == "deepspeed-2021" else "DeepSpeed's ZeRO-3"
    return f"DeepSpeed's ZeRO-{t.sharding[-1]}" if t.zero12_engine == "deepspeed" else t.sharding
