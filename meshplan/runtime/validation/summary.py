"""``summary.md`` of a ``meshplan validate`` run, for a person: per world what ran, whether it
matched, each difference, the predicted-against-measured table with how to read it
(:data:`READING`), the staged measurements' lines and, for a failed run, who failed and what was
left. The comparison it prints is :mod:`meshplan.runtime.validation.evidence`'s.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.runtime.execution.worker import write_atomic
from meshplan.runtime.validation.host import line as host_line
from meshplan.runtime.validation.staged import cross_world_lines, world_lines
from meshplan.units import MiB


def _fmt(v, unit) -> str:
    if v is None:
        return "n/a"
    if unit == "x":  # a ratio (routerload)
        return f"{v:.3f}"
    return f"{v * 1e3:.2f} ms" if unit == "s" else f"{v / MiB:.2f} MiB"


#: How to read the table, in summary.md.
READING = [
    "How to read the table:",
    "- `step time`, `forward time`, ...: the step-time model before the run (GEMMs and attention timed in "
    "this process, collectives by alpha-beta on the cluster description) against the median of the timed "
    "steps on the slowest rank.",
    "- `(calibrated)`: the same model with each collective's time per call measured by the run's probe: "
    "after the timed steps every collective kind of the plan's table was run on its groups alone, all "
    "groups of an axis at once, under the run's load. A calibrated error that stays large means the gap "
    "is not the cost of the collectives themselves: in a step they also wait for peers that are late "
    "(rank skew, and on a CPU ranks time-sharing cores).",
    "- `collective time (sum)`: the table's calls x time per call, as if none overlapped, against the "
    "time the profiled step's gloo collectives were in flight (waits for peers included).",
    "- `step part: ...`: the profiled step of the slowest rank (a separate step, so its total differs "
    "from the median) split into GEMM kernels, attention kernels, waits on collectives and the rest "
    "(elementwise ops, framework and Python time, the optimizer); predicted parts from the same model "
    "(with the probe's times when there was a probe). `the rest` is what the model does not time: "
    "host overhead, which a GPU hides behind its kernels and a CPU run does not.",
]


def write_summary(out: Path, config, opt, results: list[dict]) -> None:
    """``summary.md``: per world what ran, whether it matched, each difference, the
    predicted-against-measured table and, for a failed run, who failed and what was left."""
    ok = all(r["ok"] for r in results)
    gate = ("collectives, groups, and step time and peak memory within the tolerance "
            f"{opt.tolerance:.0%}" if opt.tolerance is not None else
            "collectives and groups; times and memory are reported, not gated (pass --tolerance to gate them)")
    lines = [f"# meshplan validate: {'PASSED' if ok else 'FAILED'}", "",
             f"Config `{config.path}`, worlds {list(opt.worlds)}, {opt.steps} timed steps per world, "
             f"wall-clock limit {opt.timeout_s:g} s per world. Checked: {gate}.", ""]
    staged = {r["world"]: r["comparison"]["staged"] for r in results if (r.get("comparison") or {}).get("staged")}
    if staged:
        lines += cross_world_lines(staged) + ["", "Per world below: the message curves, the arrival skew, the local "
                                              "kernels and the checkpoint rows (files: world<W>/staged.json and "
                                              "its CSVs).", ""]
    for r in results:
        lines += [f"## world {r['world']}: {'OK' if r['ok'] else 'FAILED'}", "", r["message"], ""]
        if r.get("host"):
            lines += [host_line(r["host"]), ""]
        lines += [f"- {n}" for n in r.get("notes", [])] + [""]
        comp = r.get("comparison")
        if comp:
            lines += ["Differences:" if comp["differences"] else "No differences in collectives or groups.", ""]
            lines += [f"- {d}" for d in comp["differences"]] + [""]
            lines += ["| quantity | predicted | measured (slowest rank) | rank | error | note |", "|---|---|---|---|---|---|"]
            for row in comp["predicted_vs_measured"]:
                err = "n/a" if row["error"] is None else f"{row['error']:+.0%}"
                lines.append(f"| {row['quantity']} | {_fmt(row['predicted'], row['unit'])} | "
                             f"{_fmt(row['measured'], row['unit'])} | {row['rank']} | {err} | {row['note']} |")
            lines += ["", comp["prediction_note"], "", *READING, ""]
            if comp.get("calibration_note"):
                lines += [comp["calibration_note"], ""]
            if comp.get("staged"):
                lines += world_lines(comp["staged"], r.get("elapsed_s"))
        fault = r.get("fault")
        if fault:
            lines += [f"Failed rank(s): {fault['failed_ranks']}. Nothing below is a result:", ""]
            for rank, info in fault["ranks"].items():
                st = info["status"] or {}
                lines.append(f"- rank {rank}: state {st.get('state', 'none')}, last {st.get('phase', '-')} "
                             f"(step {st.get('step', '-')}), files left: {', '.join(info['files']) or 'none'}"
                             + (f"; error: {st['error']}" if st.get("error") else ""))
            lines.append("")
        lines += [f"Files: `world{r['world']}/` (plan.json, torchrun.log with every rank's start-up print, "
                  "rank<r>/ (startup.json: coordinates, groups, local shapes; trace.json), comparison.json"
                  + (", collectives.csv, predicted_vs_measured.csv, staged.json, message_curves.csv, "
                     "arrival_skew.csv, kernels.csv, checkpoint.csv" if comp else "") + ")", ""]
    write_atomic(out / "summary.md", "\n".join(lines))
