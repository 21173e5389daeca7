"""``meshplan validate-slice``: several meshes of one workload on the same netns testbed, their
measured step times ordered against the plan's predictions, the losers kept with their evidence.

The seed's comparison in miniature (issue 6 item 5). Each config is run through
:func:`meshplan.runtime.validation.validate.validate` with the same
:class:`~meshplan.runtime.validation.options.Options`
(one world size, ``testbed`` set), so each mesh is scaled, planned for the testbed cluster
(:func:`~meshplan.runtime.testbed.run.testbed_cluster`: ``cpu_testbed.toml`` compute and
loopback inside a node, the testbed's tbf rate between nodes), run with one torchrun per node
namespace (ranks node-major: rank r on node ``r // (W / nodes)``) and compared. A mesh whose
axis order puts tp outermost (``names = ["tp", "dp_shard"]``) has its tp groups spanning the
nodes; the worker builds the DeviceMesh from the same layout, so the placement is real.

One workload: every mesh trains the same number of sequences per step (the global batch):
``G = lcm(micro_batch x dp)`` over the scaled meshes, and a mesh of data degree ``dp`` runs
``G / (micro_batch x dp)`` micro-batches (gradient accumulation), as a Megatron or torchtitan
job keeps ``global_batch`` fixed when it trades data for tensor parallelism. Step times are
then comparable: the same tokens, the same model, different meshes.

Per mesh: predicted step time (:func:`meshplan.schedule.steptime.step_time` with the GEMM table
measured before the run), measured step time (median of the timed steps, slowest rank),
error = measured / predicted - 1, the rank of each among the meshes (1 = fastest), and the
config's own plan at full scale: its peak memory and verdict
(:func:`~meshplan.runtime.validation.slice_choice.full_scale`). The measured-fastest mesh of those
that fit at full scale is *chosen* and kept as ``OUT/<name>-chosen/``; every other mesh is
*rejected* and kept as ``OUT/<name>-rejected/`` (``<name>``: the config's stem; the reason:
infeasible at full scale, a failed run, or slower;
:mod:`~meshplan.runtime.validation.slice_choice`): the validate evidence (``world<W>/`` with
``plan.json``, each rank's ``timings.json`` and trace, ``predicted_vs_measured.csv``), plus
``plan.json``, ``measurements.json`` (times per rank, per-NIC byte counters) and ``summary.md``
saying why it was rejected. A mesh whose run failed is rejected with its fault report and ranks last.
``OUT/slice.json`` and ``OUT/summary.md`` hold the table. Exit code 0 when every mesh ran and
the measured order equals the predicted order, 1 otherwise.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from math import lcm
from pathlib import Path
from typing import Any, Optional

import numpy as np

from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.fileio import check_destination, owned, staged_folder
from meshplan.mesh.resolve import resolved_mesh
from meshplan.runtime.testbed.netns import require_testbed
from meshplan.units import GiB
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import scale_config
from meshplan.runtime.validation.slice_choice import (assign_roles, choose, crossing_axes, folder_name, full_scale,
                                                      kept_line, slice_only_words)
from meshplan.runtime.validation.validate import validate

MARKER = "slice.json"
#: Defaults of the miniature: activations (tokens x hidden) large against the parameters
#: (hidden^2), so that where the tp collectives run matters as much as the FSDP traffic.
SLICE_DEFAULTS: dict[str, Any] = dict(worlds=(8,), layers=2, hidden_div=64, seq_len=512, vocab=128, steps=3, timeout_s=120.0)


@dataclass
class MeshResult:
    """One mesh of the slice."""

    name: str
    config: str
    ran: bool
    message: str
    predicted_s: Optional[float] = None
    measured_s: Optional[float] = None
    error: Optional[float] = None
    predicted_rank: Optional[int] = None
    measured_rank: Optional[int] = None
    collectives_match: Optional[bool] = None
    tp_groups: list = field(default_factory=list)
    nic_bytes: dict = field(default_factory=dict)
    rank_step_s: dict = field(default_factory=dict)
    folder: str = ""
    micro_batches: int = 1
    parts: dict = field(default_factory=dict)  # step part -> [predicted s, measured s] (runtime.breakdown)
    full_feasible: Optional[bool] = None  # the config's own plan at full scale (slice_choice.full_scale)
    full_peak_bytes: Optional[float] = None
    full_usable_bytes: Optional[float] = None
    full_verdict: str = ""
    full_crossing: Optional[list] = None  # axes crossing nodes at full scale (slice_choice.crossing_axes)
    slice_only_crossing: list = field(default_factory=list)  # ... in the slice and not at full scale
    role: str = ""  # chosen / rejected (slice_choice.assign_roles)
    why: str = ""


def _ranks(values: dict[str, Optional[float]]) -> dict[str, Optional[int]]:
    """1 = smallest; None (not measured/predicted) gets no rank."""
    known = sorted((v, n) for n, v in values.items() if v is not None)
    out: dict[str, Optional[int]] = {n: None for n in values}
    out.update({n: i + 1 for i, (_, n) in enumerate(known)})
    return out


def _rank_steps(world_dir: Path, world: int) -> dict[str, float]:
    out = {}
    for r in range(world):
        p = world_dir / f"rank{r}" / "timings.json"
        if p.exists():
            steps = [s["step_s"] for s in json.loads(p.read_text())["steps"] if s["kind"] == "measured"]
            if steps:
                out[f"rank{r}"] = statistics.median(steps)
    return out


def tp_groups(cfg, world: int) -> list[tuple[int, ...]]:
    """The scaled mesh's distinct tp groups (rank lists), to show which nodes they span."""

    mesh = resolved_mesh(cfg.mesh, world)
    return sorted({tuple(mesh.group_of(r, "tp")) for r in range(world)}) if mesh.degree("tp") > 1 else []


def _result(name: str, config: str, res: dict, folder: Path, world: int) -> MeshResult:
    comp = res.get("comparison") or {}
    rows = {r["quantity"]: r for r in comp.get("predicted_vs_measured", [])}
    step = rows.get("step time")
    mr = MeshResult(name=name, config=config, ran=step is not None and step.get("measured") is not None,
                    message=res.get("message", ""), nic_bytes=res.get("nic_bytes", {}),
                    rank_step_s=_rank_steps(folder / f"world{world}", world))
    if step:
        mr.predicted_s, mr.measured_s = step.get("predicted"), step.get("measured")
        if mr.predicted_s and mr.measured_s is not None:
            mr.error = mr.measured_s / mr.predicted_s - 1
        mr.collectives_match = not comp.get("differences")
    mr.parts = {q.removeprefix("step part: "): [r["predicted"], r["measured"]] for q, r in rows.items()
                if q.startswith("step part: ")}
    return mr


def _ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def table_lines(results: list[MeshResult]) -> list[str]:
    """The slice table as Markdown rows (also printed): the testbed's predicted and measured step,
    then the config's own plan at full scale (peak GiB per rank, verdict) and the mesh's role."""
    lines = ["| mesh | predicted ms | measured ms | error | predicted rank | measured rank | collectives | "
             "full-scale peak GiB | full scale | role |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r.measured_rank or 99, r.name)):
        err = "-" if r.error is None else f"{r.error:+.0%}"
        coll = "-" if r.collectives_match is None else ("match" if r.collectives_match else "DIFFER")
        peak = ("-" if r.full_peak_bytes is None or r.full_usable_bytes is None else
                f"{r.full_peak_bytes / GiB:.1f} / {r.full_usable_bytes / GiB:.1f}")
        fits = "-" if r.full_feasible is None else ("fits" if r.full_feasible else "INFEASIBLE")
        lines.append(f"| {r.name} | {_ms(r.predicted_s)} | {_ms(r.measured_s)} | {err} | {r.predicted_rank or '-'} | "
                     f"{r.measured_rank or '-'} | {coll} | {peak} | {fits} | {r.role or '-'} |")
    return lines


def parts_lines(results: list[MeshResult]) -> list[str]:
    """Where each mesh's step went (:mod:`meshplan.runtime.validation.breakdown`), predicted / measured ms,
    as Markdown rows; none when no mesh has the split."""
    names = next((list(r.parts) for r in results if r.parts), [])
    if not names:
        return []
    lines = ["| mesh | " + " | ".join(f"{n} (pred / meas ms)" for n in names) + " |", "|---|" + "---|" * len(names)]
    for r in sorted(results, key=lambda r: (r.measured_rank or 99, r.name)):
        cells = [f"{_ms(r.parts[n][0])} / {_ms(r.parts[n][1])}" if n in r.parts else "-" for n in names]
        lines.append(f"| {r.name} | " + " | ".join(cells) + " |")
    return lines


def _order(results: list[MeshResult], key: str) -> list[str]:
    return [r.name for r in sorted(results, key=lambda r: (getattr(r, key) is None, getattr(r, key) or 0.0, r.name))]


def _nic_lines(nic: dict) -> list[str]:
    if not nic:
        return ["(no per-NIC byte counters: the run did not complete)"]
    lines = ["| NIC | tx bytes | rx bytes |", "|---|---|---|"]
    lines += [f"| {k} | {v['tx_bytes']:,} | {v['rx_bytes']:,} |" for k, v in sorted(nic.items())]
    return lines


def _keep(r: MeshResult, run_dir: Path, dest: Path, best: Optional[MeshResult], world: int, testbed: str,
          final: Path) -> None:
    """Move the mesh's validate folder to ``dest`` and write its measurements and summary;
    ``final``: where ``dest`` will be once the slice folder is renamed into place."""
    shutil.move(str(run_dir), str(dest))
    r.folder = str(final)
    wdir = dest / f"world{world}"
    if (wdir / "plan.json").exists():
        shutil.copy2(wdir / "plan.json", dest / "plan.json")
    rejected = r.role != "chosen"
    (dest / "measurements.json").write_text(json.dumps(
        {"schema": "meshplan.slice-mesh/v1", "rejected": rejected, "testbed": testbed, **asdict(r)}, indent=2) + "\n")
    old = (dest / "summary.md").read_text() if (dest / "summary.md").exists() else ""
    head = [f"# {'Rejected' if rejected else 'Chosen'}: {r.name} ({r.config})", "", f"{r.role.capitalize()}: {r.why}.",
            "", f"Full scale (the config's own plan on its cluster, as `meshplan plan` makes it): {r.full_verdict}."]
    if r.slice_only_crossing:
        head += ["", f"Warning: {slice_only_words(r.slice_only_crossing)}."]
    if r.ran and r.measured_s is not None:
        head += ["", f"On the testbed: measured {_ms(r.measured_s)} ms per step (slowest rank, median of the timed "
                 f"steps), measured rank {r.measured_rank}; predicted {_ms(r.predicted_s)} ms (rank "
                 f"{r.predicted_rank})" + ("" if r.error is None else f", error {r.error:+.0%}") + "."]
        if best is not None and rejected and best.measured_s:
            head[-1] += f" The chosen mesh {best.name} measured {_ms(best.measured_s)} ms."
    else:
        head += ["", f"The run did not complete: {r.message}"]
    head += ["", "Per-rank step time (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r.rank_step_s.items()), "",
             f"Bytes per NIC during the run (testbed '{testbed}'):", "", *_nic_lines(r.nic_bytes), "",
             "Files: plan.json, measurements.json, world*/ (validate evidence: rank*/timings.json, traces, "
             "predicted_vs_measured.csv, comparison.json).", "", "---", ""]
    (dest / "summary.md").write_text("\n".join(head) + old.replace("# meshplan validate", "## meshplan validate", 1))


def prepare_slice_out(out: Path, force: bool) -> None:
    """Refuse, before the run, a non-empty ``out`` unless ``force`` and it is a slice folder of
    ours, and an ``out`` that cannot be written; its missing parent folders are made (as
    validate's, newcomer trial 21 #6). The folder is built by
    :func:`meshplan.fileio.staged_folder` (a temporary name renamed at the end: an interrupted
    slice leaves nothing that blocks the rerun)."""
    if out.is_dir() and any(out.iterdir()) and not owned(out):  # a rerun replaces its own, unchanged (out/)
        if not force:
            raise ConfigError("--out", f"{out} exists and is not empty; choose another folder or pass --force")
        if not (out / MARKER).exists():
            raise ConfigError("--out", f"{out} is not a meshplan validate-slice folder (no {MARKER}); --force only "
                              "replaces those")
    check_destination(out, "--out", force, folder=True, create_folders=True, replaced=True)


def common_batch(scaled: list, opt: Options) -> tuple[int, list[int]]:
    """The slice's global batch in sequences, ``lcm(micro_batch x dp) x opt.micro_batches``
    over the scaled configs, and the micro-batches each mesh runs to reach it.

    >>> from types import SimpleNamespace as N
    >>> cfg = lambda dp: N(training=N(micro_batch=1, global_batch=dp))
    >>> common_batch([cfg(2), cfg(4)], Options(micro_batches=1))
    (4, [2, 1])
    """
    k = opt.micro_batches or 1
    per = [c.training.global_batch // k for c in scaled]  # micro_batch x dp of each mesh
    g = lcm(*per) * k
    return g, [g // p for p in per]


def run_slice(configs: list[str], testbed: str, out: Path, opt: Optional[Options] = None, force: bool = False,
              echo=print) -> tuple[int, list[MeshResult]]:
    """Run every config on testbed ``testbed`` (see the module docstring); returns (exit code, results)."""

    opt = opt or Options(**SLICE_DEFAULTS)  # NIC bytes: the steps' (and the probe's) traffic only; the common
    opt = replace(opt, testbed=testbed, curves=False, micro_batches=opt.micro_batches or 1,  # batch's base: 1
                  world_option="--world")  # errors name validate-slice's option, not validate's --worlds
    if len(opt.worlds) != 1:
        raise ConfigError(opt.world_option, f"a slice runs every mesh at one world size, got {list(opt.worlds)}")
    world = opt.worlds[0]
    if len(configs) < 2:
        raise ConfigError("CONFIG", "give at least two configs: a slice compares meshes")
    names = [Path(c).stem for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError("CONFIG", f"config file names must differ (they name the meshes): {names}")
    tb = require_testbed(testbed)
    loaded = [load_config(c) for c in configs]
    for name, c in zip(names[1:], loaded[1:]):  # one workload: only [mesh] differs (as `meshplan compare`)
        if c.model != loaded[0].model or c.training != loaded[0].training or c.cluster.world != loaded[0].cluster.world:
            raise ConfigError("CONFIG", f"{name} and {names[0]} are not one workload: a slice compares meshes, so "
                              "[model], [training] and the cluster size must be the same; only [mesh] may differ")
    scaled = [scale_config(c, world, opt)[0] for c in loaded]  # every mesh must scale before anything runs
    batch, micro = common_batch(scaled, opt)
    full = [full_scale(c) for c in loaded]  # the config's own plan: the job runs at full scale
    prepare_slice_out(out, force)
    final = out
    with staged_folder(final, "--out", force, create_folders=True) as out:  # renamed to --out at the end
        echo(f"slice: {len(configs)} meshes x {world} ranks on testbed '{testbed}' ({tb.nodes} nodes, "
             f"{tb.rate_mbit:g} Mbit/s); model: {opt.layers} layers, hidden / {opt.hidden_div}, seq {opt.seq_len}, "
             f"vocab {opt.vocab}, {opt.steps} timed steps; global batch {batch} sequences of {opt.seq_len} tokens "
             "for every mesh")
        results, runs = [], {}
        per_node = world // tb.nodes
        for name, path, cfg, sc, k, fs in zip(names, configs, loaded, scaled, micro, full):
            groups = [list(g) for g in tp_groups(sc, world)]
            crossing = crossing_axes(resolved_mesh(sc.mesh, world), np.arange(world) // per_node)
            only = [a for a in crossing if fs["full_crossing"] is not None and a not in fs["full_crossing"]]
            echo(f"mesh {name} ({path}): {fs['full_verdict']} ({cfg.cluster.world} GPUs); {k} micro-batch(es) per "
                 "step; tp groups " + (", ".join(
                     f"{g} on node(s) {sorted({x // per_node for x in g})}" for g in groups) or "none"))
            if only:
                echo(f"  warning: {slice_only_words(only)}")
            runs[name] = out / "runs" / name
            runs[name].parent.mkdir(parents=True, exist_ok=True)  # validate refuses an --out whose parent is missing
            _, res = validate(cfg, replace(opt, micro_batches=k), runs[name], echo=lambda s, n=name: echo(f"  {s}"))
            results.append(_result(name, str(path), res[0], runs[name], world))
            r = replace(results[-1], **fs)
            results[-1] = r
            r.tp_groups, r.micro_batches, r.slice_only_crossing = groups, k, only
            echo(f"  step: predicted {_ms(r.predicted_s)} ms, measured {_ms(r.measured_s)} ms" if r.ran else
                 f"  run failed: {r.message}")
        best = decide(results)
        for r in results:
            _keep(r, runs[r.name], out / folder_name(r), best, world, testbed, final / folder_name(r))
        shutil.rmtree(out / "runs", ignore_errors=True)
        same, verdict = order_verdict(results)
        lines = table_lines(results)
        for ln in lines + ([""] + parts_lines(results) if parts_lines(results) else []):
            echo(ln)
        echo(verdict)
        echo(kept_line(results, str(final)))
        _write(out, results, opt, testbed, tb, verdict, same, lines, best, batch)
    return (0 if same else 1), results


def decide(results: list[MeshResult]) -> Optional[MeshResult]:
    """Rank the meshes by predicted and by measured step (1 = fastest), choose one and give
    every mesh its role and reason (:mod:`meshplan.runtime.validation.slice_choice`); returns the
    chosen mesh (None when no mesh ran and fits at full scale)."""
    pr = _ranks({r.name: r.predicted_s for r in results})
    mr = _ranks({r.name: r.measured_s for r in results})
    for r in results:
        r.predicted_rank, r.measured_rank = pr[r.name], mr[r.name]
    best = choose(results)
    assign_roles(results, best)
    return best


def order_verdict(results: list[MeshResult]) -> tuple[bool, str]:
    """Whether every mesh ran and the measured order equals the predicted one, and the line
    saying so (the order of the testbed's steps: the full-scale verdict does not enter it)."""
    pred_order, meas_order = _order(results, "predicted_s"), _order(results, "measured_s")
    same = all(r.ran for r in results) and pred_order == meas_order
    return same, (f"measured order {' < '.join(meas_order)} " + ("EQUALS" if same else "DIFFERS FROM") +
                  f" the predicted order {' < '.join(pred_order)}")


def _write(out: Path, results, opt, testbed, tb, verdict, same, lines, best, batch: int) -> None:
    from meshplan.runtime.execution.worker import write_atomic

    doc = {"schema": "meshplan.slice/v1", "testbed": testbed, "nodes": tb.nodes, "rate_mbit": tb.rate_mbit,
           "global_batch": batch,
           "options": {k: v for k, v in opt.__dict__.items()}, "order_matches": same, "verdict": verdict,
           "chosen": best.name if best else None, "meshes": [asdict(r) for r in results]}
    md = [f"# meshplan validate-slice: {'ORDER AS PREDICTED' if same else 'ORDER NOT AS PREDICTED'}", "",
          f"Testbed '{testbed}': {tb.nodes} nodes, {tb.rate_mbit:g} Mbit/s per NIC (tbf). Every mesh trains "
          f"{batch} sequences of {opt.seq_len} tokens per step (micro-batches: " +
          ", ".join(f"{r.name} {r.micro_batches}" for r in results) + "). Step time: predicted by "
          "meshplan.schedule.steptime.step_time for the testbed cluster with the GEMM table measured before each run; "
          "measured = median of the timed steps on the slowest rank; error = measured / predicted - 1; rank 1 = "
          "fastest.", "", *lines, "", verdict + ".", "",
          *(["Where the time went (profiled step of each mesh's slowest rank: GEMM and attention kernels, waits "
             "on collectives, and the rest, which the model does not time: framework and Python time, and time "
             "descheduled while ranks share cores):", "", *parts_lines(results), ""] if parts_lines(results) else []),
          "Full scale: each config's own plan on its own cluster (as `meshplan plan` makes it), the peak per rank "
          "of its most loaded stage against the usable HBM; a mesh infeasible at full scale is not chosen.", "",
          "Chosen: the measured fastest of the meshes that fit at full scale; each mesh is kept in <name>-<role>/ "
          "with its plan, measurements, per-NIC byte counters and summary:", "",
          *[f"- {r.name} ({r.config}): {r.role}, {r.why}" + ("" if r.why == r.full_verdict else f"; {r.full_verdict}")
            + f"; in {folder_name(r)}/" for r in results],
          *["", *[f"Warning: {r.name}: {slice_only_words(r.slice_only_crossing)}." for r in results
                  if r.slice_only_crossing]] * any(r.slice_only_crossing for r in results),
          ""]
    write_atomic(out / "summary.md", "\n".join(md))
    write_atomic(out / MARKER, json.dumps(doc, indent=2, default=str) + "\n")


def main(configs: list[str], testbed: str, out: Path, opt: Options, force: bool = False) -> int:
    code, _ = run_slice(configs, testbed, out, opt, force)
    print(f"evidence: {out / 'summary.md'}", file=sys.stderr if code else sys.stdout)
    return code
