"""Text and JSON reports of a search across frameworks (:class:`~meshplan.search.frameworks.CrossResult`,
``meshplan search --framework a,b``).

Text: what was searched (the model, cluster and batch; each framework with what its runtime runs),
one table of the rows of every framework in one order, each naming its framework (the cells
of :func:`meshplan.report.search.top_table`: mesh, micro-batch, recompute, vpp, sharding, knobs, peak,
step, MFU, tokens/s), the order rule, what placed row 1 before row 2, what makes the top faster than #2
(:func:`explanation`: the step's parts, led by the framework difference where they differ), then per
framework its candidates per outcome and its own fastest row or, where none fits, the line naming
the rules that rejected the most. JSON (``search --json``'s schema, ``meshplan.search.driver/v1``, its
across-frameworks form, marked by ``frameworks_searched``): ``top``, each row
as ``search --json`` writes one (:func:`meshplan.report.search.row`, with its ``input``) and its
``framework``; ``top_vs_runner_up`` with ``framework_difference``; ``frameworks``, each framework's
whole ``search --json`` document.
"""

from __future__ import annotations

from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from meshplan import __version__
from meshplan.report.search import SCHEMA, knobs, row, row_mesh, search_to_dict
from meshplan.report.search_fix import infeasible_line
from meshplan.report.search_lines import peak_cell
from meshplan.memory.constraints import usable_bytes
from meshplan.search.candidate import candidate_config
from meshplan.search.driver import describe
from meshplan.search.explain import Explanation, explain, relative
from meshplan.search.frameworks import FRAMEWORKS, CrossResult, Row, framework_difference
from meshplan.search.rank import RULE_LINE
from meshplan.spec.accuracy import mfu_caveat
from meshplan.units import GiB

COLUMNS = ("#", "framework", "mesh", "mb", "recompute", "vpp", "sharding", "knobs", "peak GiB", "step s", "MFU",
           "tokens/s")


def explanation(x: CrossResult) -> Optional[Explanation]:
    """Row 1 against row 2 (:func:`meshplan.search.explain.explain` on their step parts, each
    described under its own framework's config), naming the fastest row where the rule listed a
    slower one first; None with fewer than two rows or a row without its parts."""
    if len(x.rows) < 2:
        return None
    a, b = x.rows[0], x.rows[1]
    if a.exact.breakdown is None or b.exact.breakdown is None:
        return None
    k = min(range(len(x.rows)), key=lambda j: (x.rows[j].step, j))
    return explain(a.exact.breakdown, b.exact.breakdown, _describe(a), _describe(b),
                   fastest_step_s=x.rows[k].step, fastest_row=k + 1,
                   tie_criterion=x.decided_by if k else "")


def _describe(r: Row) -> dict:
    return describe(r.result.config, r.result.candidates, r.result.est, r.exact)


def explanation_line(x: CrossResult) -> Optional[str]:
    """The line on the top against #2: the framework difference first where they differ
    (:func:`~meshplan.search.frameworks.framework_difference`), then the step's parts."""
    e = explanation(x)
    if e is None:
        return None
    fw = framework_difference(x.rows[0], x.rows[1])
    return f"{fw}; {e.line()}" if fw else f"same framework ({x.rows[0].framework}); {e.line()}"


def table_rows(x: CrossResult) -> list[list[str]]:
    """The cells of every row (:data:`COLUMNS`)."""
    out = []
    for k, r in enumerate(x.rows, 1):
        res, e = r.result, r.exact
        d = row(res, e)
        usable = usable_bytes(res.config.cluster, res.config.training)
        out.append([str(k), r.framework, row_mesh(d), str(d["micro_batch"]), d["recompute_shown"], str(d["virtual_stages"]),
                    res.candidates.sharding_word(e.index), knobs(d), peak_cell(res, e, usable), f"{e.step_s:.3f}",
                    f"{e.mfu:.1%}", f"{e.tokens_per_s:,.0f}"])
    return out


def header_lines(x: CrossResult) -> list[str]:
    """The workload and the frameworks searched, each with what its runtime runs."""
    first = next(iter(x.results.values()))
    m, t, cl = first.config.model, first.config.training, first.config.cluster
    return [f"{m.name} on {cl.world} GPUs ({cl.nodes} x {cl.node.gpus} {cl.gpu.name}); global batch "
            f"{t.global_batch} x {t.seq_len} tokens; usable {first.usable_bytes / GiB:.1f} GiB per GPU",
            f"frameworks searched, each planned with its own runtime's rules, ranked together "
            f"({len(x.results)}):"] + [f"  {n}: {FRAMEWORKS[n].runs}" for n in x.results]


def framework_lines(x: CrossResult) -> list[str]:
    """Per framework: candidates, how many fit, and its first row (or why none fits); for a
    framework other than row 1's, that row against row 1: its step relative to row 1's and the
    parts that differ most (:meth:`~meshplan.search.explain.Explanation.parts_text`, row 1 first)."""
    out = []
    for n, r in x.results.items():
        c = r.counts()
        head = f"{n}: {len(r.candidates):,} candidates, {c['feasible']:,} feasible"
        if not r.top:
            out.append(f"{head}; {infeasible_line(r)}")
            continue
        at = next((k for k, y in enumerate(x.rows, 1) if y.framework == n), None)
        where = f"row {at}" if at else "not among the rows shown"
        line = f"{head}; its first row {r.candidates.label(r.top[0].index)}, {r.top[0].step_s:.3f} s ({where})"
        top = x.rows[0] if x.rows else None
        first = Row(n, r, r.top[0])
        if top is not None and top.framework != n and top.exact.breakdown and first.exact.breakdown:
            vs = explain(top.exact.breakdown, first.exact.breakdown, _describe(top), _describe(first))
            line += f", {relative(first.step / top.step - 1, 'row 1')}: {vs.parts_text()}"
        out.append(line)
    return out


def print_cross(x: CrossResult, console: Console) -> None:
    """The text report of the module docstring on ``console``."""
    for line in header_lines(x):
        console.print(line, highlight=False, markup=False)
    if x.rows:
        tab = Table(title=f"top {len(x.rows)} across frameworks: by predicted step time; within 1% ordered toward "
                          "fewer axes, lower degrees and fewer settings", title_justify="left")
        for col in COLUMNS:
            tab.add_column(col, justify="left" if col in ("framework", "mesh", "recompute", "sharding", "knobs")
                           else "right")
        for cells in table_rows(x):
            tab.add_row(*cells)
        console.print(tab)
        lines = [RULE_LINE] + ([f"decided by: {x.decided_by}"] if x.decided_by else [])
        vs = explanation_line(x)
        lines += [vs] if vs else []
    else:
        lines = ["no framework has a candidate that fits"]
    for line in lines + framework_lines(x) + [f"note: {n}" for n in x.notes] + [mfu_caveat()]:
        console.print(line, highlight=False, markup=False)


def cross_to_dict(x: CrossResult) -> dict[str, Any]:
    """The JSON document of the module docstring."""
    top = []
    for k, r in enumerate(x.rows, 1):
        cc = candidate_config(r.result.config, r.result.candidates, r.exact.index)
        top.append({"row": k, "framework": r.framework} | row(r.result, r.exact)
                   | {"tier": "tight" if r.tight() else "clear",
                      "input": {"training": cc.training.model_dump(),
                                "mesh": cc.mesh.model_dump() if cc.mesh else None}})
    e = explanation(x)
    vs = None if e is None else e.to_dict() | {
        "framework_difference": framework_difference(x.rows[0], x.rows[1]), "line": explanation_line(x)}
    return {"schema": SCHEMA, "meshplan_version": __version__, "frameworks_searched": list(x.results),  # the if/then form
            "order_rule": RULE_LINE, "decided_by": x.decided_by, "top": top, "top_vs_runner_up": vs,
            "wall_s": x.wall_s, "notes": list(x.notes),
            "frameworks": {n: search_to_dict(r) for n, r in x.results.items()}}
