"""``summary.md`` of a ``meshplan validate`` run, for a person: per world what ran, whether it
matched, each difference, the predicted-against-measured table with how to read it
(:data:`READING`), the staged measurements' lines and, for a failed run, who failed and what was
left. The comparison it prints is :mod:`meshplan.runtime.validation.evidence`'s; the staged
evidence (:mod:`meshplan.runtime.validation.staged`) as a section per world (:func:`world_lines`)
and a table across worlds (:func:`cross_world_lines`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from meshplan.runtime.execution.worker import write_atomic
from meshplan.runtime.validation.breakdown import KERNEL_PARTS, SUSPECT_FACTOR, in_step_ratios, suspect
from meshplan.runtime.validation.coverage import everywhere
from meshplan.runtime.validation.evidence import CHECKPOINT_BYTES_TOLERANCE
from meshplan.runtime.validation.memcheck import KIND_TOLERANCE
from meshplan.runtime.validation.op_order import order_lines
from meshplan.runtime.validation.options import world_timeout_s
from meshplan.runtime.validation.host import line as host_line
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
    gate += (f"; checkpoint bytes per rank not more than {CHECKPOINT_BYTES_TOLERANCE:.0%} under the plan; "
             f"an FSDP2 run's parameters (memory max: params) within {KIND_TOLERANCE:.0%} of the plan")
    lines = [f"# meshplan validate: {'PASSED' if ok else 'FAILED'}", "",
             f"Config `{config.path}`, worlds {list(opt.worlds)}, {opt.steps} timed steps per world, "
             f"wall-clock limit {', '.join(f'{world_timeout_s(opt, w)[0]:g}' for w in opt.worlds)} s per world. Checked: {gate}.", "", *gap_lines(results)]
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
        lines += [f"- {g['line']}" for g in r.get("not_exercised", [])] + ([""] if r.get("not_exercised") else [])
        comp = r.get("comparison")
        if comp:
            lines += ["Differences:" if comp["differences"] else "No differences in collectives or groups.", ""]
            lines += [f"- {d}" for d in comp["differences"]] + [""]
            if comp.get("op_order"):
                lines += order_lines(comp["op_order"])
            lines += ["| quantity | predicted | measured (slowest rank) | rank | error | note |", "|---|---|---|---|---|---|"]
            for row in comp["predicted_vs_measured"]:
                err = "n/a" if row["error"] is None else f"{row['error']:+.0%}"
                lines.append(f"| {row['quantity']} | {_fmt(row['predicted'], row['unit'])} | "
                             f"{_fmt(row['measured'], row['unit'])} | {row['rank']} | {err} | {row['note']} |")
            lines += ["", comp["prediction_note"], "", *READING, ""]
            if comp.get("calibration_note"):
                lines += [comp["calibration_note"], ""]
            if comp.get("calibration_line"):
                lines += [comp["calibration_line"], ""]
            if comp.get("staged"):
                lines += world_lines(comp["staged"], r.get("elapsed_s"), comp["predicted_vs_measured"])
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


def gap_lines(results: list[dict]) -> list[str]:
    """The lines under the verdict naming the config's axes that no world ran at degree > 1
    (:func:`meshplan.runtime.validation.coverage.everywhere`): a PASSED run did not check them.

    >>> r = dict(world=4, not_exercised=[dict(axis="dp_shard", line="not exercised: dp_shard (FSDP) 128 -> 1")])
    >>> gap_lines([r])
    ['Not checked by this run (an axis at degree 1 in every world):', '', '- not exercised: dp_shard (FSDP) 128 -> 1', '']
    """
    gaps = everywhere(results)
    if not gaps:
        return []
    return ["Not checked by this run (an axis at degree 1 in every world):", "", *[f"- {g['line']}" for g in gaps], ""]


def _us(s) -> str:
    return "n/a" if s is None else f"{s * 1e6:.0f} us"


def _gbs(b) -> str:
    return "n/a" if b is None else f"{b / 1e9:.3g} GB/s"


def _err(e) -> str:
    return "n/a" if e is None else f"{e:+.0%}"


def largest_busbw(staged: dict) -> list[dict]:
    """The largest size's curve row of each (axis, op)."""
    top: dict[tuple, dict] = {}
    for r in staged["curves"]:
        k = (r["axis"], r["op"])
        if k not in top or r["size_bytes"] > top[k]["size_bytes"]:
            top[k] = r
    return [top[k] for k in sorted(top)]


def kernel_error(staged: dict) -> Optional[float]:
    """Median relative error (measured / predicted - 1) over the world's kernel rows."""
    errs = [r["error"] for r in staged["kernels"] if r["error"] is not None]
    return statistics.median(errs) if errs else None


def checkpoint_error(staged: dict) -> Optional[float]:
    """Relative error of the busiest rank's DCP bytes against its predicted share."""
    rows = [r for r in staged["checkpoint"] if r["measured_bytes"] is not None]
    if not rows:
        return None
    top = max(rows, key=lambda r: r["measured_bytes"])
    return top["bytes_error"]


def world_lines(staged: dict, elapsed_s: Optional[float] = None, rows: Optional[list] = None) -> list[str]:
    """The staged sections of one world in ``summary.md`` (``elapsed_s``: the launch's wall
    time, to show the curves' share of it)."""
    lines = ["### Message curves (predicted against measured)", ""]
    if staged["curves"]:
        of = f" of the launch's {elapsed_s:.0f} s" if elapsed_s else ""
        lines += [f"Each axis's collectives timed over 1 KiB..4 MiB after the steps, every group of the axis at once "
                  f"({staged['curve_wall_s'] or 0:.1f} s{of}); predicted by the comm model on the axis's path "
                  "(meshplan.comm.row.path_time). busbw = algbw x busbw factor (nccl-tests).", "",
                  "| axis | op | ranks | size (B) | predicted | measured | error | busbw predicted | busbw measured |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['axis']} | {r['op']} | {r['n_ranks']} | {r['size_bytes']} | {_us(r['predicted_time_s'])} | "
                  f"{_us(r['measured_time_s'])} | {_err(r['error'])} | {_gbs(r['predicted_busbw_bytes_per_s'])} | "
                  f"{_gbs(r['measured_busbw_bytes_per_s'])} |" for r in staged["curves"]]
    else:
        lines.append("none: " + "; ".join(m for m in staged["missing"] if m.startswith("message")))
    s = staged["skew_summary"]
    lines += ["", "### Rank arrival skew at every collective of the recorded step", "",
              "The recorded step is step 0, the first: its skew includes first-step costs (lazy set-up on some "
              f"ranks). Predicted slack: {staged['skew_prediction']}. Clock: {staged['skew_clock']}.", ""]
    if s["count"]:
        lines += [f"{s['count']} collective calls: skew median {_us(s['median_s'])}, p90 {_us(s['p90_s'])}, max "
                  f"{_us(s['max_s'])} (predicted 0); last to arrive most often: rank {s['last_rank']} "
                  f"({s['last_count']} of {s['count']}, {s['last_share']:.0%}).", "",
                  "| axis | calls | median | p90 | max |", "|---|---|---|---|---|"]
        lines += [f"| {a} | {v['count']} | {_us(v['median_s'])} | {_us(v['p90_s'])} | {_us(v['max_s'])} |"
                  for a, v in s["by_axis"].items()]
    else:
        lines.append("no group collectives recorded")
    lines += ["", "### Local kernels, per call (predicted by the kernel-efficiency model against measured)", ""]
    if staged["kernels"]:
        lines += kernel_lines(staged["kernels"], in_step_ratios(rows or []))
    lines += ["", "### Checkpoint per rank (DCP save and load)", ""]
    if staged["checkpoint"]:
        lines += ["| rank | bytes predicted | bytes measured | error | save predicted | save | load predicted | load |",
                  "|---|---|---|---|---|---|---|---|"]
        fmt = lambda v: "n/a" if v is None else f"{v * 1e3:.1f} ms"
        num = lambda v: "n/a" if v is None else f"{v:.0f}"
        lines += [f"| {r['rank']} | {num(r['predicted_bytes'])} | {num(r['measured_bytes'])} | "
                  f"{_err(r['bytes_error'])} | {fmt(r['predicted_save_s'])} | {fmt(r['save_s'])} | {fmt(r['predicted_load_s'])} | "
                  f"{fmt(r['load_s'])} |" for r in staged["checkpoint"]]
    else:
        lines.append("none: " + "; ".join(m for m in staged["missing"] if m.startswith("checkpoint")))
    return lines + [""]


def kernel_lines(kernels: list[dict], ratios: dict) -> list[str]:
    """The local kernels table: per call the kernel-efficiency model against the time measured
    in the validate process before the launch (the step model's input), and per kernel part
    the same kernels in the profiled step (``ratios``:
    :func:`~meshplan.runtime.validation.breakdown.in_step_ratios`), the pre-launch column marked
    SUSPECT where the two differ by more than 2x, and which the prediction used (nc54 #4).

    >>> ks = [dict(kernel="gemm", shape="4x256x64", predicted_s=1.9e-4, measured_s=6.1e-5, error=-0.68)]
    >>> print(kernel_lines(ks, {"GEMM kernels": (0.02093, 0.00135, 0.0645)})[4])
    | gemm | 4x256x64 | 190 us | 61 us | -68% | 0.065x (1.35 of 20.93 ms a step): SUSPECT |
    """
    lines = ["One call of each kernel, timed in the validate process before the launch (one thread, divided by the "
             "rank's core share); predicted on the testbed's description without the measured table. The step model "
             "uses the measured column (made before the launch, as a prediction must be), not the predicted one: the "
             "`step part` rows count these calls per step (e.g. attention: layers x micro-batches, forward and "
             "backward). `in the profiled step`: the same kernels' time in the profiled step over the measured "
             "column x calls, per part; SUSPECT where they differ by more than "
             f"{SUSPECT_FACTOR:g}x (the pre-launch timing, not the kernel, is then what the step's error traces to).", "",
             "| kernel | shape | predicted per call | measured per call | error | in the profiled step |",
             "|---|---|---|---|---|---|"]
    for r in kernels:
        got = ratios.get(KERNEL_PARTS.get(r["kernel"], ""))
        step = "n/a" if got is None else (f"{got[2]:.2g}x ({got[1] * 1e3:.2f} of {got[0] * 1e3:.2f} ms a step)"
                                          + (": SUSPECT" if suspect(got[2]) else ""))
        lines.append(f"| {r['kernel']} | {r['shape']} | {_us(r['predicted_s'])} | {_us(r['measured_s'])} | "
                     f"{_err(r['error'])} | {step} |")
    bad = [f"{part} {v[2]:.2g}x" for part, v in ratios.items() if suspect(v[2])]
    if bad:
        lines += ["", f"SUSPECT: the pre-launch kernel times differ from the same kernels in the profiled step by more "
                      f"than {SUSPECT_FACTOR:g}x ({', '.join(bad)}); the prediction used the pre-launch (measured) column, "
                      f"so its step parts carry that error (e.g. a host loaded by other work while it timed them)."]
    return lines


def cross_world_lines(staged_by_world: dict[int, dict]) -> list[str]:
    """The top-level table of ``summary.md``: world -> median arrival skew, busbw at the
    largest curve size (per axis and op, predicted / measured), median kernel error and the
    busiest rank's checkpoint bytes error.

    >>> st = dict(skew_summary=dict(median_s=0.0012), kernels=[dict(error=0.5), dict(error=-0.1)],
    ...           checkpoint=[dict(measured_bytes=10, bytes_error=0.02)],
    ...           curves=[dict(axis="tp", op="all-gather", size_bytes=4096, predicted_busbw_bytes_per_s=4e8,
    ...                        measured_busbw_bytes_per_s=2e8)])
    >>> cross_world_lines({2: st})[-1]
    '| 2 | 1200 us | tp all-gather 4096 B: 0.4 / 0.2 GB/s | +20% | +2% |'
    """
    lines = ["## Staged evidence across worlds", "",
             "| world | median arrival skew (predicted 0) | busbw at the largest size (predicted / measured) | "
             "median kernel error | checkpoint bytes error |", "|---|---|---|---|---|"]
    for w, st in sorted(staged_by_world.items()):
        bus = "; ".join(f"{r['axis']} {r['op']} {r['size_bytes']} B: {r['predicted_busbw_bytes_per_s'] / 1e9:.3g} / "
                        f"{r['measured_busbw_bytes_per_s'] / 1e9:.3g} GB/s" for r in largest_busbw(st)) or "n/a"
        lines.append(f"| {w} | {_us(st['skew_summary']['median_s'])} | {bus} | {_err(kernel_error(st))} | "
                     f"{_err(checkpoint_error(st))} |")
    return lines
