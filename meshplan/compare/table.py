"""``meshplan compare``'s side-by-side table: one :class:`Row` per quantity (mesh, each differing
knob, feasibility, step time, MFU, peak memory, bytes per link class, each GEMM's local shape and
efficiency, the Q, K, V projection where one side fuses it), printed in human units (:func:`table_rows`) or written to ``--json`` in SI
(:func:`table_values`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from meshplan.compare.differences import knob
from meshplan.compare.sides import Side
from meshplan.compare.verdict import Comparison
from meshplan.compute.gemm import gemm_time
from meshplan.compute.shapes import Gemm
from meshplan.plan import Plan
from meshplan.schedule.stage_traffic import WHICH
from meshplan.schedule.workload import plan_step_gemms, workload_of
from meshplan.units import GB, GiB, TFLOPS


@dataclass(frozen=True)
class Row:
    """One quantity of the side-by-side table: ``label`` as printed (human units), ``key`` as in
    ``--json`` (SI units, named), A's and B's values in SI (None: not resolved, printed "-"),
    ``show`` formats one value for printing, ``missing`` is printed for None."""

    label: str
    key: str
    a: Any
    b: Any
    show: Callable[[Any], str] = str
    missing: str = "-"


def rows(c: Comparison) -> list[Row]:
    """The comparison's quantities: mesh, each differing knob, feasibility, step time (s), MFU
    (fraction), peak memory (B), bytes sent per rank per step by link class (under a pipeline
    with the stage they are on: each side's stage whose ranks send the most on that class),
    each GEMM's local (M, N, K) and efficiency, and, where one side fuses Q, K and V into one GEMM
    and the other does not, their FLOP and efficiency side by side (:func:`_projection`)."""
    out = [Row("mesh", "mesh", c.a.mesh_text, c.b.mesh_text)]
    out += [Row(k, k, x, y, knob, "unset") for k, x, y in c.knobs]
    out += [Row("feasible", "feasible", c.a.feasible, c.b.feasible),
            Row("step time (s)", "step time (s)", c.a.step_s, c.b.step_s, "{:.3f}".format),
            Row("MFU", "MFU (fraction of peak)", c.a.mfu, c.b.mfu, "{:.1%}".format),
            Row("peak memory (GiB)", "peak memory (B)", c.a.peak_bytes, c.b.peak_bytes, lambda x: f"{x / GiB:.1f}")]
    for kind in sorted(set(c.a.link_bytes) | set(c.b.link_bytes)):
        out.append(Row(f"{kind} GB/rank/step", f"{kind} bytes sent per rank per step", _sent(c.a, kind),
                       _sent(c.b, kind), lambda x: f"{x / GB:.1f}"))
        if c.a.stage_of(kind) or c.b.stage_of(kind):  # a pipeline: whose bytes (meshplan.schedule.stage_traffic)
            out.append(Row(f"{kind}: stage sending most", f"{kind} bytes sent per rank per step: stage ({WHICH})",
                           _stage(c.a, kind), _stage(c.b, kind)))
    ga, gb = {g[0]: g for g in c.a.gemms}, {g[0]: g for g in c.b.gemms}
    both = c.a.resolved and c.b.resolved  # both resolved: the GEMMs they share; else the resolved one's, "-" beside
    for name in dict.fromkeys([*ga, *gb]):
        if (name in ga and name in gb) or not both:
            out.append(Row(f"{name} (M,N,K) eff", f"{name} (M,N,K) efficiency", _gemm(ga.get(name)),
                           _gemm(gb.get(name)), _g))
    qa, qb = _projection(c.a), _projection(c.b)
    if both and qa is not None and qb is not None and qa["gemms"] != qb["gemms"]:  # fused on one side only
        out.append(Row("Q,K,V projection GFLOP eff", "Q, K, V projection (one fused qkv GEMM, or wq + wk + wv "
                       "summed): FLOP, efficiency", qa, qb, _p))
    return out


def gemm_basis(c: Comparison) -> str:
    """The line under the table that says what its ``(M,N,K) eff`` rows are: each forward GEMM's
    FLOP/s over its dtype's dense peak as the step times it
    (:func:`~meshplan.compute.gemm.gemm_time`), and from which data: the catalog's measured
    points of the GPU and dtype, interpolated (``--kernels`` files laid over them), or the shape
    model where there are none; "" when neither side resolved. Where the sides run their GEMMs in
    different dtypes (``training.linear_dtype`` differs), each side's dtypes by GEMM follow
    (:func:`_side_dtypes`), and so does the peak each side's MFU divides by."""
    sides = [s for s in (c.a, c.b) if isinstance(s.plan, Plan)]
    if not sides:
        return ""
    gpu = sides[0].plan.config.cluster.gpu
    used: dict[tuple[str, str], None] = {}  # (dtype, source), first seen
    for s in sides:
        w = workload_of(s.plan)  # each side's own GEMM dtypes (float8 Linears on one side only)
        for g in plan_step_gemms(s.plan):
            dtype = w.gemm_dtype(g.name)
            used.setdefault((dtype, gemm_time(gpu, g.m, g.n, g.k, dtype, g.count).source), None)
    over = " with the --kernels files laid over them" if gpu.kernels else ""
    words = {"catalog": f"the catalog's {gpu.name} {{0}} points{over}, interpolated",
             "model": f"the shape model (tile and wave quantization; no measured {gpu.name} {{0}} points)"}
    peaks = ", ".join(f"{gpu.peak_flops(d) / TFLOPS:.0f} TFLOP/s {d}" for d in dict.fromkeys(d for d, _ in used))
    dtypes = [_side_dtypes(s) for s in sides]
    per_side = "" if len(set(dtypes)) < 2 else (
        "; each over its own dtype's peak: " + "; ".join(f"{s.name} {d}" for s, d in zip(sides, dtypes))
        + "; MFU over " + ", ".join(f"{s.name}'s {s.plan.config.training.peak_dtype}" for s in sides) + " peak")
    return (f"(M,N,K) eff: forward GEMM FLOP/s over the {peaks} dense peak, as the step times it: "
            + "; ".join(words[src].format(d) for d, src in used) + per_side)


def _side_dtypes(s: Side) -> str:
    """The dtypes ``s``'s forward GEMMs run in, each with the GEMMs in it
    (:meth:`~meshplan.schedule.workload.Workload.gemm_dtype`): ``fp8 wq, wk, wv, wo, w_gate, w_up,
    w_down, bf16 output`` for float8 Linears with the head excluded, ``bf16 every GEMM`` for one dtype."""
    w = workload_of(s.plan)
    by: dict[str, list[str]] = {}
    for g in plan_step_gemms(s.plan):
        by.setdefault(w.gemm_dtype(g.name), []).append(g.name)
    if len(by) == 1:
        return f"{next(iter(by))} every GEMM"
    return ", ".join(f"{d} {', '.join(names)}" for d, names in by.items())


def table_rows(c: Comparison) -> list[tuple[str, str, str]]:
    """(quantity, A, B) rows for printing ("-" for a quantity of an unresolved mesh)."""
    def text(r: Row, v: Any) -> str:
        return r.missing if v is None else r.show(v)

    return [(r.label, text(r, r.a), text(r, r.b)) for r in rows(c)]


def table_values(c: Comparison) -> list[list]:
    """[quantity, A, B] rows for ``--json``: numbers in SI, booleans, knob values as in the
    config, a GEMM as {m, n, k, efficiency}, null where unresolved."""
    return [[r.key, r.a, r.b] for r in rows(c)]


def _sent(s: Side, kind: str) -> Optional[float]:
    """Bytes one rank sends per step on link class ``kind``; None when unresolved."""
    return s.link_bytes.get(kind, 0.0) if s.resolved else None


def _stage(s: Side, kind: str) -> Optional[int]:
    """The stage of ``s``'s ``kind`` bytes (:attr:`~meshplan.compare.sides.Side.link_stage`);
    None when unresolved."""
    return s.link_stage.get(kind, 0) if s.resolved else None


def _projection(s: Side) -> Optional[dict]:
    """The Q, K, V projection of ``s`` as one quantity, so a plan whose framework fuses it into one
    GEMM (Megatron-LM's ``qkv``, :func:`~meshplan.compute.shapes.fused_qkv_gemm`) lines up with one that
    runs wq, wk and wv apart (torch): ``gemms`` (``qkv`` or ``wq+wk+wv``), ``flop`` their forward FLOP
    summed (:attr:`~meshplan.compute.shapes.Gemm.flops`, 2 M N K each) and ``efficiency`` the
    FLOP-weighted one the step times them at: FLOP over the sum of each GEMM's FLOP / efficiency (one
    dtype, so one peak); None without wq, wk and wv (MLA) or a fused qkv.

    wq 2 GFLOP at 50%, wk 2 and wv 4 GFLOP at 75%: 8 / (2 / 0.5 + 6 / 0.75) = 8 / 12, 67%:

    >>> g = (("wq", 1000, 1000, 1000, 0.5), ("wk", 1000, 1000, 1000, 0.75), ("wv", 1000, 2000, 1000, 0.75))
    >>> _p(_projection(Side("A", None, True, (), gemms=g)))
    'wq+wk+wv: 8.0 GFLOP at 67%'
    """
    by = {g[0]: g for g in s.gemms}
    names = ("qkv",) if "qkv" in by else ("wq", "wk", "wv")
    if not all(n in by for n in names):
        return None
    flops = [Gemm(*by[n][:4]).flops for n in names]
    return {"gemms": "+".join(names), "flop": sum(flops),
            "efficiency": sum(flops) / sum(f / by[n][4] for f, n in zip(flops, names))}


def _p(q: dict) -> str:
    return f"{q['gemms']}: {q['flop'] / 1e9:.1f} GFLOP at {q['efficiency']:.0%}"


def _gemm(g) -> Optional[dict]:
    return None if g is None else {"m": g[1], "n": g[2], "k": g[3], "efficiency": g[4]}


def _g(g: dict) -> str:
    return f"({g['m']},{g['n']},{g['k']}) {g['efficiency']:.0%}"
