"""Text and JSON reports of a :class:`~meshplan.search.driver.SearchResult`.

Text: the space searched (axis order and placement named: :mod:`meshplan.report.search_header`),
the top distinct meshes, each at its first setting by the tie rule (mesh, micro-batch, recompute,
vpp, sharding, knobs, peak GiB, step s, MFU, tokens/s, goodput where the rows differ in it:
:func:`top_table`), then every line under
the table from one source, the text's and the HTML page's (:func:`table_lines`): where the
config's own ``[mesh]`` stands and what recompute ``selective`` models
(:mod:`meshplan.report.search_lines`), the order rule (:mod:`meshplan.search.rank`), the top
mesh's other settings within 1%, the headroom tiers (the rows under 15% of usable memory free
listed last, their peak marked ``tight``: :mod:`meshplan.search.headroom`), what makes the top faster than the runner-up
(:mod:`meshplan.search.explain`; where the tie rule listed a slower top first, how much
slower than the fastest, named), the best rejected one with why, and the candidates per
outcome; when no candidate fits, one line instead of the table, the order rule and the
exactness line (:func:`~meshplan.report.search_fix.infeasible_line`). JSON (schema
``meshplan.search.driver/v1``): the same, SI units, with each top candidate's plan input so
``meshplan plan`` can replay it, every candidate the rule placed up to the last row
(``placed``, :func:`placed_rows`) and the top mesh's variants (``top_variants``, each with its ``label``
for ``search --export``: ``1a``, ``1b``, ``1c``), the row warnings of each row shown (``warnings``) and
the first row shown with none (``first_clear_row``: :func:`~meshplan.report.search_clear.clear_to_dict`),
and when no
candidate fits the one line's verdict as data (``no_feasible_mesh``:
:func:`~meshplan.report.search_fix.infeasible_verdict`).
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan import __version__
from meshplan.spec.accuracy import mfu_caveat
from meshplan.interop.deepspeed import DS_SCOPE
from meshplan.interop.export import not_expressed
from meshplan.plan_runtime import export_refusals
from meshplan.report.search_clear import clear_lines, clear_to_dict
from meshplan.report.search_fix import infeasible_line, infeasible_verdict, rule_counts
from meshplan.report.search_header import header_lines
from meshplan.report.search_lines import (configured_lines, goodput_cell, goodput_line, goodput_shared, headroom_lines,
                                         peak_cell, recompute_lines, safer_lines, setting_lines, split_ac_lines,
                                         table_heading, tier_lines, tight, variants_line)
from meshplan.search.driver import SearchResult
from meshplan.search.exact import Exact
from meshplan.search.explain import relative
from meshplan.search.rank import RULE_LINE, mesh_of, variant_label
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import RECOMPUTE, SHARDING, axis_shown, candidate_schedule, reshard_word
from meshplan.memory.constraints import usable_bytes
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.mesh import Schedule
from meshplan.spec.mesh_words import mesh_text, with_experts
from meshplan.spec.wording import DEEPSPEED, zero_runtime
from meshplan.units import GiB

SCHEMA = "meshplan.search.driver/v1"


def row(r: SearchResult, e: Exact) -> dict[str, Any]:
    """One candidate as plain data (SI units): ``mesh`` every searched axis's degree, the data
    axis keyed as the text names it (``dp`` on zero1/zero2 rows, ``dp_shard`` on zero3/hsdp ones:
    :func:`~meshplan.search.columns.axis_shown`); ``step_parts_s`` the step's parts in seconds
    (:func:`~meshplan.search.step_parts.step_breakdown`), ``layer_passes`` a count apart
    (:func:`~meshplan.search.step_parts.layer_passes`)."""
    c, i = r.candidates, e.index
    sharding = SHARDING[c.sh[i]]  # names the data axis (axis_shown): dp under zero1/zero2
    degrees = {axis_shown(n, sharding): c.degree(col.column) for n, col in search_axes()}  # the registered axes
    return {"index": i, "mesh": {k: int(v[i]) for k, v in degrees.items()}, "micro_batch": int(c.mb[i]),
            "recompute": RECOMPUTE[c.rc[i]], "recompute_num_layers": c.block_layers(i) or None,
            "recompute_shown": c.recompute_word(i), "virtual_stages": int(c.vpp[i]), "sharding": sharding,
            "feasible": e.feasible, "reasons": list(e.reasons), "peak_bytes": e.peak_bytes, "step_s": e.step_s,
            "reshard_after_forward": bool(c.rf[i]),
            "reshard_after_forward_default": None if c.reshard_setting(i) is None else c.reshard_default_at(i),
            "tp_comm_overlap": bool(c.ov[i]), "zero_hpz_partition_size": c.hpz(i),
            "ends_short_stages": bool(c.us[i]), "pp_schedule": str(candidate_schedule(int(c.vpp[i]), int(c.ps[i]))),
            "mfu": e.mfu, "tokens_per_s": e.tokens_per_s, "goodput": e.goodput,
            "gemm_efficiency": float(r.est.gemm[i]), "step_lower_bound_s": float(r.est.step_lo[i]),
            "step_parts_s": e.breakdown, "layer_passes": e.layer_passes,
            "expert_mesh": {"efsdp": int(c.efsdp[i]), "ep": int(c.ep[i]), "etp": int(c.etp[i])} if c.moe else None}


def row_mesh(d: dict[str, Any]) -> str:
    """A :func:`row`'s mesh as every output prints it (:func:`meshplan.spec.mesh_words.mesh_text`), a MoE
    row's expert mesh after its ep where the dense mesh does not imply it
    (:func:`meshplan.spec.mesh_words.with_experts`: ``ep 16 (efsdp 4, etp 1)``)."""
    text = mesh_text(tuple(d["mesh"]), tuple(d["mesh"].values()), d["sharding"])
    x = d.get("expert_mesh")
    return with_experts(text, x["ep"], x["etp"], x["efsdp"]) if x else text


def search_to_dict(r: SearchResult) -> dict[str, Any]:
    """The whole result as JSON-able data (see the module docstring)."""
    cfg = r.config
    top = []
    clear = clear_to_dict(r)  # the rows' warnings and the first row shown with none
    usable = usable_bytes(cfg.cluster, cfg.training)
    for k, e in enumerate(r.top):
        d = row(r, e) | {"warnings": clear["row_warnings"][k] if clear else [],
                         "tier": "tight" if tight(r, e, usable) else "clear"}
        cc = candidate_config(cfg, r.candidates, e.index)
        d["input"] = {"training": cc.training.model_dump(), "mesh": cc.mesh.model_dump() if cc.mesh else None}
        top.append(d)
    if top:  # the measured-error setting line the text prints under the table for row 1 (newcomer trial 51)
        top[0]["accuracy_warning"] = next(iter(setting_lines(r)), None)
    return {"schema": SCHEMA, "meshplan_version": __version__, "candidates": len(r.candidates),
            "options": cfg.search.model_dump(), "usable_bytes": r.usable_bytes, "proven": r.proven,
            "below_threshold_kept": r.below_threshold_kept, "wall_s": r.wall_s, "timings_s": r.timings,
            "planned_exactly": len(r.exact), "counts": r.counts(), "top": top, "order_rule": RULE_LINE,
            "placed": placed_rows(r), "top_variants": [row(r, e) | {"label": variant_label(k)}
                                                       for k, e in enumerate(r.variants)],
            "top_vs_runner_up": r.explanation.to_dict() if r.explanation else None,
            "best_rejected": row(r, r.best_rejected) if r.best_rejected else None, "notes": list(r.notes),
            "accuracy_note": mfu_caveat(),
            "first_clear_row": clear, "headroom_tiers": tiers_to_dict(r),
            "no_feasible_mesh": infeasible_verdict(r)} | (
        {"configured": r.configured.to_dict()} if r.configured else {})  # the config's [mesh], where it has one


def tiers_to_dict(r: SearchResult) -> dict[str, Any]:
    """``--json``'s ``headroom_tiers``: ``on`` (``[search] headroom_tier``), ``tight_rows`` (the rows
    shown, 1 = the top, that keep under 15% of the usable memory free: each top row's ``tier``),
    ``moved`` (the candidate indices of the tight rows the order rule put before row 1, listed after
    it), ``line`` (the tier line printed, null where no row shown is tight), ``safer`` (the candidate
    indices of each row shown at its mesh's fastest clear setting and of that mesh's tight first one)."""
    usable = usable_bytes(r.config.cluster, r.config.training)
    line = tier_lines(r)
    return {"on": r.config.search.headroom_tier,
            "tight_rows": [k for k, e in enumerate(r.top, 1) if tight(r, e, usable)],
            "moved": [e.index for e in r.tiered_past], "line": line[0] if line else None,
            "safer": [{"shown": a.index, "tight": b.index} for a, b in r.safer]}


def placed_rows(r: SearchResult) -> list[dict[str, Any]]:
    """Every candidate the tie rule placed up to the last row (:attr:`SearchResult.placed`), each
    a :func:`row` with ``row``: the top table's row of its mesh (the rows are distinct meshes, so a
    mesh's other settings share its row number) and ``listed``: whether it is that row;
    ``peak_bytes`` null where only the step was planned (the ranking plans the memory of the rows,
    of the top mesh's variants and of the twins the tie rule compares by peak)."""
    at = {mesh_of(r.candidates, e.index): k for k, e in enumerate(r.top, 1)}
    shown = {e.index for e in r.top}
    return [row(r, e) | {"row": at.get(mesh_of(r.candidates, e.index)), "listed": e.index in shown}
            | ({} if e.complete else {"peak_bytes": None}) for e in r.placed]


def timing_line(r: SearchResult) -> str:
    """The search's wall time here (``r.wall_s``; the widened search's apart, :mod:`meshplan.search.widen`), for
    stderr: the report (stdout, HTML) holds no measured time, so it is the same on any machine (--json keeps
    ``wall_s`` and ``timings_s``)."""
    more = "".join(f", then {r.timings[f'widen {a}']:.1f} s for the search with every {a} (the fix's)"
                   for a in ("cp", "ep") if f"widen {a}" in r.timings)
    more += (f", then {r.timings['widen mask']:.1f} s for the search without the data loader's attention mask "
             "(the fix's)" if "widen mask" in r.timings else "")
    return (f"timing: the search took {r.wall_s:.1f} s of wall time on this machine{more} (it varies by machine; not "
            "part of the plan or the report)")


#: The top table's columns (:func:`top_table`); ``goodput`` dropped where every row shows the same.
TOP_COLUMNS = ("#", "mesh", "mb", "recompute", "vpp", "sharding", "knobs", "peak GiB", "step s", "MFU", "tokens/s",
               "goodput", "GEMM eff")


def top_table(r: SearchResult) -> tuple[list[str], list[list[str]]]:
    """The top table's columns (:data:`TOP_COLUMNS`) and rows, every cell as printed, one
    source for the text and the HTML page: ``goodput`` left out where every row shown prints the
    same (:func:`meshplan.report.search_lines.goodput_shared`; the goodput line then gives it)."""
    rows = []
    usable = usable_bytes(r.config.cluster, r.config.training)
    for k, e in enumerate(r.top, 1):
        d = row(r, e)
        rows.append([str(k), row_mesh(d), str(d["micro_batch"]), d["recompute_shown"], str(d["virtual_stages"]),
                     r.candidates.sharding_word(e.index), knobs(d), peak_cell(r, e, usable), f"{e.step_s:.3f}",
                     f"{e.mfu:.1%}", f"{e.tokens_per_s:,.0f}", goodput_cell(e.goodput), f"{d['gemm_efficiency']:.1%}"])
    if goodput_shared(r) is None:
        return list(TOP_COLUMNS), rows
    g = TOP_COLUMNS.index("goodput")
    return [c for j, c in enumerate(TOP_COLUMNS) if j != g], [[x for j, x in enumerate(y) if j != g] for y in rows]


def print_search(r: SearchResult, console: Console) -> None:
    """The report of the module docstring on ``console`` (every row of ``r.top``: the line on
    the top against #2 may name any of them)."""
    for line in header_lines(r):
        console.print(line, highlight=False, markup=False)
    mine = configured_lines(r)  # where the config's own [mesh] stands
    if not r.top:  # no table, order rule, goodput or exactness line: they are about rows
        best = rejected_lines(r) if r.best_rejected else []
        for line in [infeasible_line(r)] + mine + best + count_lines(r) + [f"note: {n}" for n in r.notes]:
            console.print(line, highlight=False, markup=False)
        return
    columns, rows = top_table(r)
    tab = Table(title=table_heading(r, len(rows)), title_justify="left")
    for col in columns:
        tab.add_column(col, justify="right" if col not in ("mesh", "recompute", "sharding", "knobs") else "left")
    for cells in rows:
        tab.add_row(*cells)
    console.print(tab)
    notes = [f"note: {n}" for n in r.notes] + [mfu_caveat()]  # the caveat once per output, the table's MFU column
    for line in table_lines(r) + rejected_lines(r) + count_lines(r) + notes:
        console.print(line, highlight=False, markup=False)


def table_lines(r: SearchResult) -> list[str]:
    """Every line printed under the top table, before the best rejected one: where the config's
    own mesh stands, what recompute ``selective`` models, the order rule, the headroom tiers
    (:func:`~meshplan.report.search_lines.tier_lines`), the rows shown at a setting that keeps the
    headroom (:func:`~meshplan.report.search_lines.safer_lines`), the top's other settings
    (:func:`variants_line`), the top against #2, goodput, exactness, the headroom warning, the
    warning on a row 1 that splits the backward under activation checkpointing (:func:`split_ac_lines`),
    the warning on a row 1 in a setting measured less well than the development set (:func:`setting_lines`),
    the one pointer to the first row shown clear of every row warning
    (:func:`~meshplan.report.search_clear.clear_lines`) and what ``--export`` does not express; one
    source for the text and the HTML page."""
    out = configured_lines(r) + recompute_lines(r) + [RULE_LINE] + tier_lines(r) + safer_lines(r) + variants_line(r)
    if r.explanation is not None:
        out.append(r.explanation.line())
    out.append(goodput_line(r))
    if r.proven:
        out.append("the top is exact: every candidate not planned has a step-time lower bound above the last "
                   "one shown")
    return out + headroom_lines(r) + split_ac_lines(r) + setting_lines(r) + clear_lines(r) + export_lines(r)


#: Per export target whose words ``search`` speaks (:func:`export_target`): the rows its file
#: refuses, and why a field its export drops is dropped (the field's ``table.key``).
_REFUSED = {
    DEEPSPEED: f"a DeepSpeed config runs {DS_SCOPE}",
    "megatron": "Megatron-LM's arguments cannot hold them: one data-parallel axis, 1F1B or interleaved 1F1B, "
                "first and last stage apart from an even split; search --export N --to megatron names the reason"}
_DROPPED = {
    DEEPSPEED: {"training.recompute": "DeepSpeed's JSON does not choose activation checkpointing, the model code "
                "does (the export header names the policy to apply; full reads back with import "
                "--gradient-checkpointing, the HF Trainer's --gradient_checkpointing, anything else as none)"},
    # Megatron-LM's one switch that keeps parameters gathered, --torch-fsdp2-no-reshard-after-forward
    # (megatron/training/arguments.py:3218 at d98e8a6), acts under --use-torch-fsdp2 only
    # (get_megatron_ddp_config, megatron/training/training.py:2627-2629), an engine meshplan neither
    # plans nor writes: a row kept gathered is rejected instead (rule 'framework',
    # :data:`meshplan.search.reasons.MEGATRON_REFUSED`), so no field of a row shown is dropped
    "megatron": {}}


def export_target(r: SearchResult) -> str | None:
    """The format whose export ``search`` reports on (:func:`export_lines`): ``deepspeed``
    under DeepSpeed (a DeepSpeed JSON, or its engine: :func:`meshplan.spec.wording.zero_runtime`),
    ``megatron`` under ``training.framework = "megatron"`` otherwise, else None."""
    cfg = r.config
    if zero_runtime(cfg.training, cfg.origin) == DEEPSPEED:
        return DEEPSPEED
    return "megatron" if cfg.training.framework == "megatron" else None


def export_lines(r: SearchResult) -> list[str]:
    """Under DeepSpeed or Megatron-LM (:func:`export_target`), what ``--export N --to T`` of
    each row shown does not write, as the export's header lists it
    (:func:`meshplan.interop.export.not_expressed`: ``training.recompute``, which DeepSpeed's
    JSON does not choose (:data:`_DROPPED`), ...), and the rows T refuses (:data:`_REFUSED`: DeepSpeed tp, pp, cp
    or ep > 1, hsdp; Megatron-LM hsdp, a V-shaped schedule); empty elsewhere or when every row
    exports whole."""
    to = export_target(r)
    if to is None or not r.top:
        return []
    cfg = r.config
    lost: dict[tuple[str, ...], list[int]] = {}
    refused: list[int] = []
    for k, e in enumerate(r.top, 1):
        row_cfg = candidate_config(cfg, r.candidates, e.index)
        fields, why = not_expressed(row_cfg, to, {to: export_refusals(row_cfg, to)})
        if why is not None:
            refused.append(k)
        elif fields:
            lost.setdefault(tuple(fields), []).append(k)
    if not lost and not refused:
        return []
    parts = [f"{_rows(ks)} not expressed: {', '.join(f)}" for f, ks in lost.items()]
    if refused:
        parts.append(f"{_rows(refused)} refused ({_REFUSED[to]})")
    why = "".join(f"; {key}: {text}" for key, text in _DROPPED[to].items() if any(key in f for f in lost))
    return [f"--export N --to {to}: {'; '.join(parts)}{why}"]


def _rows(ks: list[int]) -> str:
    """``row 3`` or ``rows 1, 2, 5``."""
    return f"row {ks[0]}" if len(ks) == 1 else f"rows {', '.join(map(str, ks))}"


def knobs(d: dict) -> str:
    """The searched training knobs that are not the default: ``keep gathered`` or ``resharded``
    (reshard_after_forward off its default at the row's pp, ``reshard_after_forward_default``, null
    where it gathers nothing: :func:`~meshplan.search.columns.reshard_word`), ``tp overlap``,
    ``short ends`` (Llama 3 split), a zero-bubble pipeline schedule (``zbv``, ``dualpipev``, ``zb_h1``), ``hpZ 8``
    (DeepSpeed ZeRO++'s ``zero_hpz_partition_size`` above 1)."""
    default = d.get("reshard_after_forward_default")
    tag = reshard_word(None if default is None else d["reshard_after_forward"], bool(default))
    on = [(tag, bool(tag)), ("tp overlap", d["tp_comm_overlap"]),
          ("short ends", d["ends_short_stages"]), (d.get("pp_schedule", ""), "pp_schedule" in d and Schedule(d["pp_schedule"])
                                    is not candidate_schedule(d["virtual_stages"])),
          (f"hpZ {d.get('zero_hpz_partition_size')}", d.get("zero_hpz_partition_size", 1) > 1)]
    return ", ".join(t for t, x in on if x) or "-"


def rejected_lines(r: SearchResult) -> list[str]:
    """The best rejected candidate and why."""
    b = r.best_rejected
    if b is None:
        return ["best rejected: none rejected for memory, host memory or GEMM efficiency"]
    why = "; ".join(b.reasons) if b.reasons else (
        f"local GEMM efficiency {r.est.gemm[b.index]:.1%} < threshold {r.config.search.min_gemm_efficiency:.0%}")
    out = [f"best rejected: {r.candidates.label(b.index)}: {why}"]
    if b.step_s is not None and r.top and r.top[0].step_s:
        out.append(f"  it would take {b.step_s:.3f} s per step ({relative(b.step_s / r.top[0].step_s - 1, 'the top')}) "
                   f"if it were accepted; peak {b.peak_bytes / GiB:.1f} GiB")
    return out


def outcome_rows(r: SearchResult) -> list[tuple[str, str, str, int]]:
    """Candidates per outcome as ``(key, outcome, why, n)``, the one source of the text's counts
    (:func:`count_lines`) and the HTML page's bars: ``feasible`` (always), ``undecided`` (when
    some are) and each rule that rejected some (:func:`~meshplan.report.search_fix.rule_counts`,
    the ``engine`` rule per engine), its outcome ``rejected, rule 'v-reshard'`` and its why the
    rule's one-line reason. The n add up to the candidates searched."""
    counts = r.counts()
    out = [("feasible", "feasible", "", counts["feasible"])]
    if counts["undecided"]:
        out.append(("undecided", "undecided", "near the memory limit, beyond [search] settle_max", counts["undecided"]))
    return out + [(key, f"rejected, rule '{key}'", text, n) for key, text, n in rule_counts(r)]


def count_lines(r: SearchResult) -> list[str]:
    """Candidates per outcome (:func:`outcome_rows`); they add up to the candidates searched. Each
    rejection line names its rule first, as docs/commands.md, the no-feasible-mesh line, ``--json``'s counts
    and the HTML page's bars do: ``rejected, rule 'v-reshard' (zbv or dualpipev ...): 2,810``."""
    rows = outcome_rows(r)
    return [f"candidates per outcome ({sum(n for *_, n in rows):,} in all):"] + [
        f"  {outcome}{f' ({why})' if why else ''}: {n:,}" for _, outcome, why, n in rows]
