"""What ``meshplan compare`` writes of a :class:`~meshplan.compare.verdict.Comparison`: the
``--json`` document (:func:`compare_to_dict`), the HTML page (:func:`compare_html`) and the
rejected mesh's evidence folder (:func:`write_evidence`, named by the pair: its plan, predicted trace, a summary
and the table), built under a temporary name and renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from meshplan import __version__
from meshplan.compare.sides import Side
from meshplan.compare.table import gemm_basis, table_rows, table_values
from meshplan.compare.verdict import Comparison, rule_text
from meshplan.fileio import check_destination, staged_folder, write_output
from meshplan.report.html import esc, lines, page, section, table
from meshplan.report.html_pages import plan_sections
from meshplan.report.json_out import write_json


def _side_dict(s: Side) -> dict:
    return {"name": s.name, "mesh": s.mesh_text, "feasible": s.feasible, "reasons": list(s.reasons), "step_s": s.step_s,
            "mfu": s.mfu, "peak_bytes": s.peak_bytes, "usable_bytes": s.usable_bytes,
            "gemms": [{"name": g[0], "m": g[1], "n": g[2], "k": g[3], "efficiency": g[4]} for g in s.gemms],
            "sent_bytes_per_step_by_link": dict(s.link_bytes), "sent_bytes_stage_by_link": dict(s.link_stage),
            "exposed_s": dict(s.exposed_s), "compute_split_s": s.compute_split_s, "headroom": s.headroom or None}


def compare_to_dict(c: Comparison) -> dict:
    """The ``compare --json`` document (schema ``meshplan.compare/v1``): both sides' numbers
    (SI; traffic as bytes each rank sends per step by link class, on the stage whose rank
    sends the most, named in ``sent_bytes_stage_by_link``; ``compute_split_s``, the compute part by
    kernel kind with the SM contention its own part, :attr:`~meshplan.compare.sides.Side.compute_split_s`), the knobs that differ, the
    verdict and the rule, the table as values (:func:`table_values`), and the headroom rule's
    result as the text prints it (:mod:`meshplan.memory.headroom`, one home): each side's
    ``headroom`` (``tight: ...`` or null) and ``headroom_warnings``, the ``warning (NAME): tight:
    ...`` lines (:meth:`~meshplan.compare.verdict.Comparison.headroom_lines`), and ``setting_warnings``, the
    ``warning: NAME lies where ...`` lines (:meth:`~meshplan.compare.verdict.Comparison.setting_lines`)."""
    return {"schema": "meshplan.compare/v1", "meshplan_version": __version__, "a": _side_dict(c.a),
            "b": _side_dict(c.b), "winner": c.winner, "rejected": c.rejected, "identical": c.identical,
            "equal": c.equal, "none_fit": c.none_fit, "reasons": list(c.reasons), "rule": c.rule, "decided_by": c.decided_by,
            "knobs": [{"knob": k, "a": x, "b": y} for k, x, y in c.knobs], "table": table_values(c),
            "headroom_warnings": c.headroom_lines(), "setting_warnings": c.setting_lines()}


def compare_html(c: Comparison, note: str = "") -> str:
    """The comparison as one HTML page: the side-by-side table, the verdict with its reasons
    and rule, then each mesh's plan report (memory plot, Gantt chart, link loads) in two
    columns, A left and B right; ``note``: a header line (``--calibration``'s)."""
    verdict = c.verdict
    decided = [f"decided by: {c.decided_by}"] if c.decided_by else []
    head = section("Side by side", table(["quantity", c.a.name, c.b.name], table_rows(c))
                   + lines([gemm_basis(c)] if gemm_basis(c) else [])
                   + f"<p><b>verdict:</b> {esc(verdict)}</p>" + lines(decided + [f"- {r}" for r in c.reasons]
                                                                       + c.headroom_lines() + c.setting_lines())
                   + lines([f"rule: {c.rule}"]))
    cols = "".join(f"<div><h2>{esc(s.name)}: {esc(s.mesh_text)}</h2>"
                   + "".join(plan_sections(s.plan, s.step, s.name)) + "</div>" for s in (c.a, c.b))
    return page(f"meshplan compare: {c.a.name} vs {c.b.name}", f"verdict: {verdict}; GB = 1e9 B, GiB = 2^30 B" + (f"; {note}" if note else ""),
                [head, f'<div class="cols">{cols}</div>'])


def evidence_folder(c: Comparison, out_dir: str | Path, force: bool = False) -> Path:
    """``out_dir/rejected-<name>-vs-<winner>/``, named by the pair (newcomer trial 23: ``compare a b``
    then ``compare a c`` both wrote ``rejected-a/``, the second replacing the first, meshplan's own
    unchanged output under ``out/``); ConfigError (``--out``) when it exists (not empty) and not
    ``force``, or cannot be written, so the CLI can refuse before printing the report. The same
    pair compared again writes the same folder (replaced under ``out/`` when unchanged, as every
    output there is)."""
    folder = Path(out_dir) / f"rejected-{c.rejected}-vs-{c.winner}"
    if c.rejected:  # none when identical, equal or neither fits
        check_destination(folder, "--out", force, folder=True, create_folders=True, replaced=True)  # in --out, checked first
    return folder


def write_evidence(c: Comparison, out_dir: str | Path, force: bool = False,
                   calibration: Optional[dict] = None) -> list[Path]:
    """Write the rejected mesh's plan, its predicted trace, and a summary of the comparison
    to ``out_dir/rejected-<name>-vs-<winner>/`` (:func:`evidence_folder`), built under a temporary name and renamed into place at
    the end (:func:`meshplan.fileio.staged_folder`: an interrupted or failed run leaves nothing
    that blocks the rerun). ``calibration``: ``--calibration``'s entry
    (:func:`meshplan.comm.calibration_notes.calibration_doc`), named in ``summary.md`` (its line and
    GPU warnings) and held whole in ``comparison.json``, as compare --json holds it. Refuses to
    replace an existing folder unless ``force``. Returns the written paths (under their final
    name)."""
    if not c.rejected:
        return []
    dest = evidence_folder(c, out_dir, force)
    with staged_folder(dest, "--out", force, create_folders=True) as folder:
        names = _write_evidence_files(c, folder, calibration)
    return [dest / n for n in names]


def _write_evidence_files(c: Comparison, folder: Path, calibration: Optional[dict] = None) -> list[str]:
    """The evidence files of :func:`write_evidence` in ``folder``; returns their names."""
    rejected = c.a if c.rejected == c.a.name else c.b
    paths = [write_json(rejected.plan, folder / "plan.json", force=True)]
    if rejected.step is not None:
        paths.append(rejected.step.write_trace(folder / "predicted-trace.json", force=True))
    summary = [f"# Rejected: {rejected.name} ({rejected.mesh_text})", "",
               f"Chosen: {c.winner}, decided by: {c.decided_by}. Rule: {c.rule or rule_text()}.", ""]
    if calibration:  # the links both sides were timed with
        summary += ([f"{calibration['line'][0].upper()}{calibration['line'][1:]}."]
                    + [f"Warning: {w}." for w in calibration["warnings"]]
                    + [f"- {r.strip()}" for r in calibration.get("replaced", [])] + [""])
    summary += ["| quantity | "
               f"{c.a.name} | {c.b.name} |", "|---|---|---|"]
    summary += [f"| {q} | {x} | {y} |" for q, x, y in table_rows(c)]
    summary += ["", gemm_basis(c)] if gemm_basis(c) else []
    summary += ["", "## Reasons", ""] + [f"- {r}" for r in c.reasons] + [f"- {w}" for w in c.headroom_lines() + c.setting_lines()]
    paths.append(_atomic_text(folder / "summary.md", "\n".join(summary) + "\n"))
    paths.append(_atomic_text(folder / "comparison.json", json.dumps(
        {"winner": c.winner, "rejected": c.rejected, "reasons": list(c.reasons), "table": table_values(c),
         **({"calibration": calibration} if calibration else {})}, indent=1)))
    return [p.name for p in paths]


def _atomic_text(path: Path, text: str) -> Path:
    return write_output(path, text, force=True)
