"""Side-by-side comparison of two meshes of one workload (the seed's tensor 8 against
tensor 4): local GEMM shapes and their efficiency, peak memory, bytes per link, exposed
communication, step time, and a verdict with its reasons. The rejected mesh and its
evidence are written to an output folder.

Verdict rule (stated, no hidden weights): a mesh that does not fit (infeasible plan or
memory peak above usable HBM) loses to one that fits; between two that fit, the shorter
predicted step wins when it is shorter by more than ``tie_fraction`` (default 2%, below the
model's resolution); within that band, the lower peak memory wins (more headroom). Two
configs of the same mesh are reported as identical: nothing is chosen or rejected. When
neither mesh fits, nothing is chosen either (``none_fit``; each side's reasons are given and
the CLI exits 1, as ``meshplan plan`` does for an infeasible mesh).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from meshplan import __version__
from meshplan.compute.gemm import gemm_efficiency
from meshplan.fileio import check_destination, staged_folder, write_output
from meshplan.plan import Infeasible, Plan
from meshplan.report.html import esc, lines, page, section, table
from meshplan.report.html_pages import plan_sections
from meshplan.report.json_out import write_json
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.steptime import StepTime, step_time
from meshplan.units import GB, MS, GiB


@dataclass(frozen=True)
class Side:
    """One mesh's numbers. ``link_bytes``: bytes one rank sends per step by link class,
    "nvlink" and "network" (stage 0's table: size x busbw factor x count, each row split over
    the links it uses, :attr:`~meshplan.comm.collectives.CollectiveRow.link_bytes`); ``exposed_s``: exposed communication of
    the critical stage by stream; ``gemms``: (name, M, N, K, efficiency)."""

    name: str
    plan: Plan | Infeasible
    feasible: bool
    reasons: tuple[str, ...]
    step_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_bytes: Optional[float] = None
    usable_bytes: Optional[float] = None
    gemms: tuple = ()
    link_bytes: dict = field(default_factory=dict)
    exposed_s: dict = field(default_factory=dict)
    step: Optional[StepTime] = None

    @property
    def resolved(self) -> bool:
        """Whether the mesh resolved to a plan (groups, stages, collectives); an unresolved one
        has no quantity to show ("-" in every row)."""
        return not isinstance(self.plan, Infeasible)

    def gb_sent(self, kind: str) -> str:
        """GB one rank sends per step on link class ``kind``, or "-" when unresolved."""
        return f"{self.link_bytes.get(kind, 0) / GB:.1f}" if self.resolved else "-"

    @property
    def mesh_text(self) -> str:
        m = self.plan.mesh
        return " x ".join(f"{n} {d}" for n, d in zip(m.layout.names, m.layout.shape)) if m else "unresolved"


@dataclass(frozen=True)
class Comparison:
    """``winner`` and ``rejected`` are "" when the two meshes are the same (``identical``) or
    when neither fits (``none_fit``); ``rule``: the verdict rule in words."""

    a: Side
    b: Side
    winner: str
    rejected: str
    reasons: tuple[str, ...]
    rule: str = ""
    identical: bool = False
    none_fit: bool = False


def rule_text(tie_fraction: float = 0.02) -> str:
    """The verdict rule in words (the module docstring's)."""
    return (f"a mesh that does not fit (infeasible, or its memory peak above usable HBM) loses to one that fits; "
            f"between two that fit, the shorter predicted step wins when it is shorter by more than "
            f"{tie_fraction:.0%}; within {tie_fraction:.0%}, the lower peak memory (more headroom) wins")


_SPELLING = {"names", "shape", "order", "degrees"}


def same_mesh(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible) -> bool:
    """Whether two plans have the same mesh: equal [mesh] tables, or the same resolved
    layout (names, degrees, ep, etp) spelled differently with every other [mesh] field equal.

    >>> from meshplan.config import config_from_dict
    >>> from meshplan.plan import build_plan
    >>> base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...         "training": {"global_batch": 8, "seq_len": 1024}}
    >>> a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2]}}))
    >>> b = build_plan(config_from_dict({**base, "mesh": {"order": "tp-dp_shard", "degrees": {"tp": 2, "dp_shard": 4}}}))
    >>> c = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4]}}))
    >>> same_mesh(a, b), same_mesh(a, c)
    (True, False)
    """
    ma, mb = plan_a.spec, plan_b.spec
    if ma == mb:
        return True
    if plan_a.mesh is None or plan_b.mesh is None:
        return False
    la, lb = plan_a.mesh, plan_b.mesh
    return ((la.layout.names, la.layout.shape, la.ep, la.etp) == (lb.layout.names, lb.layout.shape, lb.ep, lb.etp)
            and ma.model_dump(exclude=_SPELLING) == mb.model_dump(exclude=_SPELLING))


def side_of(name: str, plan: Plan | Infeasible, overlap: Optional[Overlap] = None) -> Side:
    """Numbers of one plan; the step time only for a plan that resolved its stages."""
    if isinstance(plan, Infeasible):
        return Side(name, plan, False, plan.reasons)
    gpu, dt = plan.config.cluster.gpu, plan.config.training.compute_dtype
    gemms = tuple((g.name, g.m, g.n, g.k, gemm_efficiency(gpu, g.m, g.n, g.k, dt)[0]) for g in plan.gemms)
    links: dict[str, float] = {}
    for r in plan.stage(0).collectives:  # each row's bytes on the links it uses (a ring across nodes: its hops
        for kind, b in zip(("nvlink", "network"), r.link_bytes):  # inside a node on NVLink)
            if b and r.path.kind != "local":
                links[kind] = links.get(kind, 0.0) + b * r.per_step
    tl = plan.timeline
    st = step_time(plan, overlap or Overlap())
    return Side(name, plan, plan.feasible, plan.reasons, st.step_s, st.mfu, tl.peak.total_bytes,
                tl.usable_bytes, gemms, links, dict(st.exposed_s), st)


def _fit(s: Side) -> tuple[float, float]:
    """(step_s, peak_bytes) of a side that fits (:func:`side_of` sets both for every Plan)."""
    if s.step_s is None or s.peak_bytes is None:
        raise ValueError(f"{s.name}: no step time or peak memory (not a resolved plan)")
    return s.step_s, s.peak_bytes


def compare(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible, names: tuple[str, str] = ("A", "B"),
            tie_fraction: float = 0.02, overlap: Optional[Overlap] = None) -> Comparison:
    """Compare two plans of one workload (see the module docstring for the rule)."""
    a, b = side_of(names[0], plan_a, overlap), side_of(names[1], plan_b, overlap)
    rule = rule_text(tie_fraction)
    if same_mesh(plan_a, plan_b):
        what = f"{a.name} and {b.name} are" if a.name != b.name else f"both configs ({a.name}) are"
        return Comparison(a, b, "", "", (f"{what} the same mesh ({a.mesh_text}): nothing to choose; "
                                         f"give two meshes of the workload",), rule, identical=True)
    why = []
    if a.feasible != b.feasible:
        win, lose = (a, b) if a.feasible else (b, a)
        why.append(f"{lose.name} ({lose.mesh_text}) is infeasible: " + "; ".join(lose.reasons))
        if lose.step_s and win.step_s and lose.step_s < win.step_s:
            why.append(f"{lose.name} would predict a {1 - lose.step_s / win.step_s:.0%} shorter step "
                       f"({lose.step_s:.3f} s vs {win.step_s:.3f} s) if it fit: " + _to_fit(win, lose))
    elif not a.feasible:
        return Comparison(a, b, "", "", tuple(f"{s.name} ({s.mesh_text}) is infeasible: " + "; ".join(s.reasons)
                                              for s in (a, b)) + tuple(_evidence_lines(a, b)), rule, none_fit=True)
    else:
        (sa, pa), (sb, pb) = _fit(a), _fit(b)
        (fast, fs), (slow, ss) = ((a, sa), (b, sb)) if sa <= sb else ((b, sb), (a, sa))
        gap = ss / fs - 1
        if gap > tie_fraction:
            win, lose = fast, slow
            why.append(f"{fast.name} predicts a {1 - fs / ss:.1%} shorter step "
                       f"({fs:.3f} s vs {ss:.3f} s)")
        else:
            win, lose = (a, b) if pa <= pb else (b, a)
            why.append(f"step times within {tie_fraction:.0%} ({sa:.3f} s vs {sb:.3f} s): "
                       f"{win.name} has more memory headroom")
    why += _evidence_lines(a, b)
    return Comparison(a, b, win.name, lose.name, tuple(why), rule)


def _to_fit(win: Side, lose: Side) -> str:
    """What would make the faster mesh ``lose`` (resolved, infeasible) fit, true of the two
    meshes compared: when ``win`` fits with a larger tensor degree, a larger tp is a way to fit
    (``win`` shows it) that gives up the shorter step; else larger tp is one of the untried ways."""
    mw, ml = win.plan.mesh, lose.plan.mesh
    tw, tl = (mw.degree("tp") if mw else 1), (ml.degree("tp") if ml else 1)
    if tw > tl:
        return (f"a larger tensor degree fits ({win.name}, tp {tw} against tp {tl}) but gives up that step; "
                f"to keep it, {lose.name} needs another axis (cp, pp) or more memory")
    return "it needs another axis (cp, pp), a larger tensor degree or more memory"


def _evidence_lines(a: Side, b: Side) -> list[str]:
    out = []
    if a.gemms and b.gemms:
        ea = {g[0]: g for g in a.gemms}
        for name, m, n, k, eff in b.gemms:
            if name in ea and name in ("wq", "w_up", "w_down", "wo"):
                _, m2, n2, k2, e2 = ea[name]
                if f"{e2:.0%}" == f"{eff:.0%}":  # the same efficiency explains no difference
                    continue
                out.append(f"{name}: {a.name} ({m2},{n2},{k2}) at {e2:.0%} of peak, {b.name} ({m},{n},{k}) at {eff:.0%}")
    if a.peak_bytes and b.peak_bytes and a.usable_bytes:
        out.append(f"peak memory: {a.name} {a.peak_bytes / GiB:.1f} GiB, {b.name} {b.peak_bytes / GiB:.1f} GiB "
                   f"(usable {a.usable_bytes / GiB:.1f} GiB)")
    for kind in sorted(set(a.link_bytes) | set(b.link_bytes)):
        out.append(f"{kind} bytes sent per rank per step: {a.name} {_gb(a, kind)}, {b.name} {_gb(b, kind)}")
    for s in (a, b):
        if s.exposed_s:
            ex = ", ".join(f"{k} {v / MS:.1f} ms" for k, v in sorted(s.exposed_s.items()) if v > 0)
            out.append(f"exposed communication {s.name}: {ex or 'none'}")
    return out


def table_rows(c: Comparison) -> list[tuple[str, str, str]]:
    """(quantity, A, B) rows for printing."""
    def f(x, fmt):
        return "-" if x is None else fmt(x)

    rows = [("mesh", c.a.mesh_text, c.b.mesh_text),
            ("feasible", str(c.a.feasible), str(c.b.feasible)),
            ("step time (s)", f(c.a.step_s, "{:.3f}".format), f(c.b.step_s, "{:.3f}".format)),
            ("MFU", f(c.a.mfu, "{:.1%}".format), f(c.b.mfu, "{:.1%}".format)),
            ("peak memory (GiB)", f(c.a.peak_bytes, lambda x: f"{x / GiB:.1f}"),
             f(c.b.peak_bytes, lambda x: f"{x / GiB:.1f}"))]
    for kind in sorted(set(c.a.link_bytes) | set(c.b.link_bytes)):
        rows.append((f"{kind} GB/rank/step", c.a.gb_sent(kind), c.b.gb_sent(kind)))
    ga, gb = {g[0]: g for g in c.a.gemms}, {g[0]: g for g in c.b.gemms}
    both = c.a.resolved and c.b.resolved  # both resolved: the GEMMs they share; else the resolved one's, "-" beside
    for name in dict.fromkeys([*ga, *gb]):
        if (name in ga and name in gb) or not both:
            rows.append((f"{name} (M,N,K) eff", _g(ga[name]) if name in ga else "-", _g(gb[name]) if name in gb else "-"))
    return rows


def _side_dict(s: Side) -> dict:
    return {"name": s.name, "mesh": s.mesh_text, "feasible": s.feasible, "reasons": list(s.reasons), "step_s": s.step_s,
            "mfu": s.mfu, "peak_bytes": s.peak_bytes, "usable_bytes": s.usable_bytes,
            "gemms": [{"name": g[0], "m": g[1], "n": g[2], "k": g[3], "efficiency": g[4]} for g in s.gemms],
            "sent_bytes_per_step_by_link": dict(s.link_bytes), "exposed_s": dict(s.exposed_s)}


def compare_to_dict(c: Comparison) -> dict:
    """The ``compare --json`` document (schema ``meshplan.compare/v1``): both sides' numbers
    (SI; traffic as bytes each rank sends per step by link class), the verdict and the rule."""
    return {"schema": "meshplan.compare/v1", "meshplan_version": __version__, "a": _side_dict(c.a),
            "b": _side_dict(c.b), "winner": c.winner, "rejected": c.rejected, "identical": c.identical,
            "none_fit": c.none_fit, "reasons": list(c.reasons), "rule": c.rule,
            "table": [list(r) for r in table_rows(c)]}


def compare_html(c: Comparison) -> str:
    """The comparison as one HTML page: the side-by-side table, the verdict with its reasons
    and rule, then each mesh's plan report (memory plot, Gantt chart, link loads) in two
    columns, A left and B right."""
    verdict = ("identical meshes" if c.identical else "neither mesh fits" if c.none_fit
               else f"{c.winner} (rejected: {c.rejected})")
    head = section("Side by side", table(["quantity", c.a.name, c.b.name], table_rows(c))
                   + f"<p><b>verdict:</b> {esc(verdict)}</p>" + lines([f"- {r}" for r in c.reasons])
                   + lines([f"rule: {c.rule}"]))
    cols = "".join(f"<div><h2>{esc(s.name)}: {esc(s.mesh_text)}</h2>"
                   + "".join(plan_sections(s.plan, s.step, s.name)) + "</div>" for s in (c.a, c.b))
    return page(f"meshplan compare: {c.a.name} vs {c.b.name}", f"verdict: {verdict}; GB = 1e9 B, GiB = 2^30 B",
                [head, f'<div class="cols">{cols}</div>'])


def _gb(s: Side, kind: str) -> str:
    """``s.gb_sent(kind)`` with its unit, "-" alone for an unresolved mesh."""
    v = s.gb_sent(kind)
    return v if v == "-" else f"{v} GB"


def _g(g) -> str:
    return f"({g[1]},{g[2]},{g[3]}) {g[4]:.0%}"


def evidence_folder(c: Comparison, out_dir: str | Path, force: bool = False) -> Path:
    """``out_dir/rejected-<name>/``; ConfigError (``--out``) when it exists (not empty) and not
    ``force``, or cannot be written, so the CLI can refuse before printing the report."""
    folder = Path(out_dir) / f"rejected-{c.rejected}"
    if not (c.identical or c.none_fit):
        check_destination(folder, "--out", force, folder=True)
    return folder


def write_evidence(c: Comparison, out_dir: str | Path, force: bool = False) -> list[Path]:
    """Write the rejected mesh's plan, its predicted trace, and a summary of the comparison
    to ``out_dir/rejected-<name>/``, built under a temporary name and renamed into place at
    the end (:func:`meshplan.fileio.staged_folder`: an interrupted or failed run leaves nothing
    that blocks the rerun). Refuses to replace an existing folder unless ``force``. Returns
    the written paths (under their final name)."""
    if c.identical or c.none_fit:
        return []
    dest = evidence_folder(c, out_dir, force)
    with staged_folder(dest, "--out", force) as folder:
        names = _write_evidence_files(c, folder)
    return [dest / n for n in names]


def _write_evidence_files(c: Comparison, folder: Path) -> list[str]:
    """The evidence files of :func:`write_evidence` in ``folder``; returns their names."""
    rejected = c.a if c.rejected == c.a.name else c.b
    paths = [write_json(rejected.plan, folder / "plan.json", force=True)]
    if rejected.step is not None:
        paths.append(rejected.step.write_trace(folder / "predicted-trace.json", force=True))
    summary = [f"# Rejected: {rejected.name} ({rejected.mesh_text})", "",
               f"Chosen: {c.winner}. Rule: {c.rule or rule_text()}.", "", "| quantity | "
               f"{c.a.name} | {c.b.name} |", "|---|---|---|"]
    summary += [f"| {q} | {x} | {y} |" for q, x, y in table_rows(c)]
    summary += ["", "## Reasons", ""] + [f"- {r}" for r in c.reasons]
    paths.append(_atomic_text(folder / "summary.md", "\n".join(summary) + "\n"))
    paths.append(_atomic_text(folder / "comparison.json", json.dumps(
        {"winner": c.winner, "rejected": c.rejected, "reasons": list(c.reasons),
         "table": [list(r) for r in table_rows(c)]}, indent=1)))
    return [p.name for p in paths]


def _atomic_text(path: Path, text: str) -> Path:
    return write_output(path, text, force=True)
