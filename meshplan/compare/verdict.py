"""Side-by-side comparison of two plans of one workload (the seed's tensor 8 against
tensor 4): local GEMM shapes and their efficiency, peak memory, bytes per link, exposed
communication, step time, and a verdict with its reasons, as rows of one table
(:func:`rows`). Its outputs (the ``--json`` document, the HTML page, the rejected plan's
evidence folder) are :mod:`meshplan.compare.output`.

The workload is the model, the cluster, the [training] fields that say what the step
computes (global batch, sequence length, dtypes, optimizer ...) and the [memory] assumptions
(NCCL buffers, fragmentation ...); both sides must share it
(:func:`check_workload`: a one-line error names the first field that differs). A plan is the
mesh and its knobs (:data:`~meshplan.spec.training.PLAN_KNOBS`: micro_batch, recompute,
sharding ..., the [mesh] schedule, virtual stages, layer split, and
:data:`~meshplan.spec.memory.MEMORY_KNOBS`: prefetch depth, when FSDP reduces): each
knob that differs is a row of the table, and the verdict says when the difference is not the
mesh's alone.

Verdict rule (stated, no hidden weights): a mesh that does not fit (infeasible plan or
memory peak above usable HBM) loses to one that fits; between two that fit, the search's
order decides (:func:`meshplan.search.rank.decide`, one rule in one home): the shorter
predicted step wins when it is shorter by more than 1% (:data:`~meshplan.search.rank.TIE`,
below the model's resolution); within 1%, the mesh with fewer axes of degree > 1, then the
lower tp*pp*cp*ep, then the lower tp, then the lower peak memory (more headroom), so that
``compare top1.toml row4.toml`` of rows the search exported agrees with the search's order;
the reason names the criterion that decided with both values. Two
configs of the same mesh with the same knobs are reported as identical: nothing is chosen
or rejected; nor when the rule finds two plans that fit equal on every criterion (``equal``:
the same step, simplicity and peak, e.g. a plan and its own Megatron-LM export imported back).
When neither mesh fits, nothing is chosen either (``none_fit``, identical plans or not; each
side's reasons are given and the CLI exits 1, as ``meshplan plan`` does for an infeasible mesh).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from meshplan.compare.kernels import choice_lines
from meshplan.compute.gemm import gemm_efficiency
from meshplan.config import Differences, config_differences
from meshplan.errors import ConfigError
from meshplan.mesh.layers import stage_layers
from meshplan.pipeline.registry import get as get_schedule
from meshplan.plan import Infeasible, Plan
from meshplan.schedule.rank_timeline import Overlap
from meshplan.mesh.validity import degrees
from meshplan.schedule.steptime import StepTime, step_time, workload_of
from meshplan.search.rank import RULE_LINE, TIE, decide, simplicity_of
from meshplan.spec.wording import mesh_text
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
    simplicity: tuple[int, int, int] = (0, 0, 0)

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
        """The mesh as every output names it (:func:`meshplan.spec.wording.mesh_text`: the axes of
        degree > 1, ep and etp among them, the data axis named by the sharding): a plan spelled
        ``dp_shard 4 x tp 2`` and its Megatron-LM export imported back (``dp 4 x tp 2``) print the
        same words; "unresolved" without a mesh."""
        m = self.plan.mesh
        if not m:
            return "unresolved"
        return mesh_text(m.layout.names, m.layout.shape, self.plan.config.training.sharding, m.ep, m.etp)

    @property
    def mesh_key(self) -> str:
        """:attr:`mesh_text` with a lone data axis named ``dp`` whatever the sharding names it
        (``dp_shard 4 x tp 2`` under zero3 and ``dp 4 x tp 2`` under zero1 are one mesh: the
        sharding is a knob of its own), a lone ``dp_replicate`` too."""
        data = ("dp", "dp_shard", "dp_replicate")
        words = self.mesh_text.split(" x ")
        if sum(w.split(" ")[0] in data for w in words) != 1:
            return self.mesh_text
        return " x ".join("dp " + w.split(" ")[1] if w.split(" ")[0] in data else w for w in words)


@dataclass(frozen=True)
class Comparison:
    """``winner`` and ``rejected`` are "" when the two plans are the same (``identical``: the
    same mesh and knobs), when the rule finds them equal (``equal``) or when neither fits
    (``none_fit``, which an identical pair may be too); ``rule``: the verdict rule in
    words; ``decided_by``: the criterion that chose the winner, with both values, in the
    search's words (:func:`meshplan.search.rank.decide`; ``fits where the other does not``
    when one side is infeasible; "" without a winner); ``knobs``: (field, A's value, B's value) of each plan knob that differs
    (:attr:`meshplan.config.Differences.knobs`)."""

    a: Side
    b: Side
    winner: str
    rejected: str
    reasons: tuple[str, ...]
    rule: str = ""
    identical: bool = False
    none_fit: bool = False
    knobs: tuple[tuple[str, Any, Any], ...] = ()
    decided_by: str = ""
    equal: bool = False

    @property
    def verdict(self) -> str:
        """The verdict line's words (the CLI's and the HTML page's): ``A (rejected: B)``, or
        why nothing is chosen."""
        if self.identical:
            return "identical plans; neither fits" if self.none_fit else "identical plans"
        if self.none_fit:
            return "neither mesh fits"
        if self.equal:
            return "equal (no criterion separates them)"
        return f"{self.winner} (rejected: {self.rejected})"


def rule_text() -> str:
    """The verdict rule in words (the module docstring's): fit first, then the search's order
    (:data:`meshplan.search.rank.RULE_LINE`)."""
    return ("a mesh that does not fit (infeasible, or its memory peak above usable HBM) loses to one that fits; "
            f"between two that fit, the search's {RULE_LINE}")


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
    gpu, w = plan.config.cluster.gpu, workload_of(plan)  # each GEMM in its dtype (float8 Linears: fp8)
    gemms = tuple((g.name, g.m, g.n, g.k, gemm_efficiency(gpu, g.m, g.n, g.k, w.gemm_dtype(g.name))[0])
                  for g in plan.gemms)
    links: dict[str, float] = {}
    for r in plan.stage(0).collectives:  # each row's bytes on the links it uses (a ring across nodes: its hops
        for kind, b in zip(("nvlink", "network"), r.link_bytes):  # inside a node on NVLink)
            if b and r.path.kind != "local":
                links[kind] = links.get(kind, 0.0) + b * r.per_step
    tl = plan.timeline
    st = step_time(plan, overlap or Overlap())
    deg = degrees(plan.mesh, plan.config.training, plan.vpp)  # the search's columns (pp, dpr, dps, cp, tp, ep, etp)
    return Side(name, plan, plan.feasible, plan.reasons, st.step_s, st.mfu, tl.peak.total_bytes,
                tl.usable_bytes, gemms, links, dict(st.exposed_s), st, simplicity_of(deg.degree))


def _fit(s: Side) -> tuple[float, float]:
    """(step_s, peak_bytes) of a side that fits (:func:`side_of` sets both for every Plan)."""
    if s.step_s is None or s.peak_bytes is None:
        raise ValueError(f"{s.name}: no step time or peak memory (not a resolved plan)")
    return s.step_s, s.peak_bytes


def check_workload(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible,
                   names: tuple[str, str] = ("A", "B")) -> Differences:
    """The two configs' :class:`~meshplan.config.Differences`; a ConfigError naming the first
    workload field that differs and its two values (a comparison weighs plans of one workload
    on one cluster: a faster GPU or a larger batch is not a better mesh)."""
    d = config_differences(plan_a.config, plan_b.config)
    d = Differences(d.workload, tuple(k for k in d.knobs if k[0] != "mesh.pp_layer_split"
                                      or _split(plan_a, k[1]) != _split(plan_b, k[2])))
    if d.workload:
        where, va, vb = d.workload[0]
        more = f" (and {len(d.workload) - 1} more workload fields)" if len(d.workload) > 1 else ""
        ca, cb = plan_a.config.cluster, plan_b.config.cluster
        hint = (f"give both the same [cluster] ({names[0]} is on {ca.name}, {names[1]} on {cb.name}), or run "
                f"meshplan step on each to compare clusters" if where.startswith("cluster.") else
                f"give both the same {where}; only the mesh and the plan's knobs (micro_batch, recompute, "
                f"sharding ...) may differ")
        raise ConfigError("compare", f"{where} differs: {names[0]} {_short(va)}, {names[1]} {_short(vb)}{more}; "
                                     f"compare weighs two plans of one workload: {hint}")
    return d


def _split(plan: Plan | Infeasible, split: Optional[list[int]]) -> Optional[list[int]]:
    """``mesh.pp_layer_split`` as it acts: None (unset) when the plan's stages are the even
    split the same mesh gets without one, so an explicit ``[12, ..., 12]`` equal to the
    default is no knob that differs."""
    if split is None or not isinstance(plan, Plan):
        return split
    cfg = plan.config
    even = stage_layers(cfg.model.layers, plan.pp, plan.vpp,
                        virtual_stage=get_schedule(plan.spec.pp_schedule).virtual_stage)
    return None if even == plan.stages else split


def _short(v: Any) -> str:
    """A config value for a one-line message: tables and long lists abridged."""
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def compare(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible, names: tuple[str, str] = ("A", "B"),
            overlap: Optional[Overlap] = None) -> Comparison:
    """Compare two plans of one workload (see the module docstring for the rule); a ConfigError
    when the workloads differ (:func:`check_workload`)."""
    knobs = check_workload(plan_a, plan_b, names).knobs
    a, b = side_of(names[0], plan_a, overlap), side_of(names[1], plan_b, overlap)
    rule = rule_text()
    if same_mesh(plan_a, plan_b) and not knobs:
        what = f"{a.name} and {b.name} are" if a.name != b.name else f"both configs ({a.name}) are"
        none = not (a.feasible or b.feasible)  # the same plan that does not fit: exit 1, as plan does
        return Comparison(a, b, "", "", (f"{what} the same plan (mesh {a.mesh_text}, the same knobs) of one "
                                         f"workload: nothing to choose; give two meshes or plans of the workload",)
                          + (_infeasible_lines(a, b) if none else ()), rule, identical=True, none_fit=none)
    why, by_memory = [], True  # decided by memory (a plan that does not fit, or the peak among tied steps)
    if a.feasible != b.feasible:
        win, lose = (a, b) if a.feasible else (b, a)
        decided = "fits where the other does not"
        why.append(f"{lose.name} ({lose.mesh_text}) is infeasible: " + "; ".join(lose.reasons))
        if lose.step_s and win.step_s and lose.step_s < win.step_s:
            why.append(f"{lose.name} would predict a {1 - lose.step_s / win.step_s:.0%} shorter step "
                       f"({lose.step_s:.3f} s vs {win.step_s:.3f} s) if it fit: " + _to_fit(win, lose, knobs, win is a))
    elif not a.feasible:
        return Comparison(a, b, "", "", _infeasible_lines(a, b) + tuple(_evidence_lines(a, b, knobs, True)), rule,
                          none_fit=True, knobs=knobs)
    else:
        decision = _decide(a, b)
        if decision is None:
            return Comparison(a, b, "", "", (_equal_line(a, b),) + tuple(_evidence_lines(a, b, knobs)), rule,
                              knobs=knobs, equal=True)
        win, lose, decided = decision
        by_memory = decided.startswith("lower peak memory")
        why.append(_decision_line(win, lose, decided))
    why += _evidence_lines(a, b, knobs, memory_first=by_memory)
    return Comparison(a, b, win.name, lose.name, tuple(why), rule, knobs=knobs, decided_by=decided)


def _infeasible_lines(a: Side, b: Side) -> tuple[str, ...]:
    """Each side's ``<name> (<mesh>) is infeasible: <reasons>``, once when both are one file."""
    return tuple(dict.fromkeys(f"{s.name} ({s.mesh_text}) is infeasible: " + "; ".join(s.reasons) for s in (a, b)))


def _decide(a: Side, b: Side) -> Optional[tuple[Side, Side, str]]:
    """(winner, rejected, criterion) of two sides that fit, by the search's order
    (:func:`meshplan.search.rank.decide`); None when no criterion separates them."""
    (sa, pa), (sb, pb) = _fit(a), _fit(b)
    first, decided = decide([sa, sb], [a.simplicity, b.simplicity], [pa, pb])
    if first is None:
        return None
    return (a, b, decided) if first == 0 else (b, a, decided)


def _equal_line(a: Side, b: Side) -> str:
    """Why an equal pair has no verdict: the values of every criterion, one for both."""
    (s, p), (axes, mp, tp) = _fit(a), a.simplicity
    return (f"{a.name} and {b.name} are equal on every criterion of the search's rule (step {s:.3f} s, {axes} axes "
            f"of degree > 1, tp*pp*cp*ep {mp}, tp {tp}, peak memory {p / GiB:.1f} GiB): nothing to choose")


def _decision_line(win: Side, lose: Side, decided: str) -> str:
    """The verdict's first reason: ``A predicts a 4.8% shorter step (...)`` when the steps are
    more than 1% apart, else ``step times within 1% (...): A is listed first by the search's tie
    rule: fewer axes of degree > 1 (2 vs 3)``."""
    ws, ls = _fit(win)[0], _fit(lose)[0]
    if decided.startswith("shorter step by more than"):
        return f"{win.name} predicts a {1 - ws / ls:.1%} shorter step ({ws:.3f} s vs {ls:.3f} s)"
    return (f"step times within {TIE:.0%} ({win.name} {ws:.3f} s, {lose.name} {ls:.3f} s): {win.name} is listed "
            f"first by the search's tie rule: {decided}")


def _knob_text(knobs: tuple[tuple[str, Any, Any], ...], a_first: bool) -> str:
    """``training.recompute full against none, ...``: each knob's value on A's side against
    B's, or B's against A's when not ``a_first``."""
    return ", ".join(f"{k} {_knob(x if a_first else y)} against {_knob(y if a_first else x)}" for k, x, y in knobs)


def _knob(v: Any) -> str:
    """A knob's value as its TOML spelling (``true``, ``40, 40``; ``unset`` for None)."""
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return f"[{', '.join(map(str, v))}]" if len(v) <= 8 else f"[{len(v)} values]"
    return str(v)


def _to_fit(win: Side, lose: Side, knobs: tuple = (), win_is_a: bool = True) -> str:
    """What would make the faster plan ``lose`` (resolved, infeasible) fit, true of the two
    plans compared: when ``win`` fits with a larger tensor degree and the same knobs, a larger
    tp is a way to fit (``win`` shows it) that gives up the shorter step; when knobs differ too,
    ``win`` fits with its mesh and those knobs together, named as such; else larger tp is one of
    the untried ways."""
    mw, ml = win.plan.mesh, lose.plan.mesh
    tw, tl = (mw.degree("tp") if mw else 1), (ml.degree("tp") if ml else 1)
    if knobs:
        mesh = (f"the same mesh and " if win.mesh_key == lose.mesh_key
                else f"{win.mesh_text} against {lose.mesh_text} and ")
        full = lose.plan.config.training.recompute == "full"
        return (f"{win.name} fits with {mesh}{_knob_text(knobs, win_is_a)}, but gives up that step; to keep it, "
                f"{lose.name} needs another axis (cp, pp), a larger tensor degree, "
                f"{'' if full else 'more recompute, '}or more memory")
    if tw > tl:
        return (f"a larger tensor degree fits ({win.name}, tp {tw} against tp {tl}) but gives up that step; "
                f"to keep it, {lose.name} needs another axis (cp, pp) or more memory")
    return "it needs another axis (cp, pp), a larger tensor degree or more memory"


#: A part of the step (compute, bubble, exposed <stream>) whose difference between the two
#: plans is under this fraction of the longer step is not a reason: 0.1%, a tenth of the
#: search's tie band, where no verdict is decided.
PART_FLOOR = 0.001
#: A GEMM's efficiency difference under one percentage point is not a reason (79% vs 78%
#: printed for 0.4 points apart).
GEMM_FLOOR = 0.01


def _evidence_lines(a: Side, b: Side, knobs: tuple = (), memory_first: bool = False) -> list[str]:
    """The reasons under the verdict: the knobs (with the mesh or alone), then the step's parts
    that differ by their seconds, largest first (:func:`_part_lines`), then peak memory and the
    bytes each rank sends; ``memory_first``: the verdict was decided by memory (a plan that
    does not fit, or steps within the tie band), so peak memory comes before the parts."""
    out = []
    if knobs and a.mesh_key == b.mesh_key:
        same = a.mesh_text if a.mesh_text == b.mesh_text else f"{a.name} {a.mesh_text}, {b.name} {b.mesh_text}"
        out.append(f"same mesh ({same}); the plans differ in {_knob_text(knobs, True)} ({a.name} against "
                   f"{b.name}): the difference comes from these knobs, not from the mesh")
    elif knobs:
        out.append(f"the meshes differ ({a.name} {a.mesh_text}, {b.name} {b.mesh_text}) and so do "
                   f"{_knob_text(knobs, True)} ({a.name} against {b.name}): the difference is theirs together, "
                   f"not the mesh's alone")
    memory = []
    if a.peak_bytes and b.peak_bytes and a.usable_bytes:
        memory.append(f"peak memory: {a.name} {a.peak_bytes / GiB:.1f} GiB, {b.name} {b.peak_bytes / GiB:.1f} GiB "
                      f"(usable {a.usable_bytes / GiB:.1f} GiB)")
    out += memory + _part_lines(a, b) if memory_first else _part_lines(a, b) + memory
    for kind in sorted(set(a.link_bytes) | set(b.link_bytes)):
        out.append(f"{kind} bytes sent per rank per step: {a.name} {_gb(a, kind)}, {b.name} {_gb(b, kind)}")
    return out


def _part_lines(a: Side, b: Side) -> list[str]:
    """The parts of each plan's step on its critical stage (:meth:`StepTime.parts_s`: compute,
    bubble, exposed <stream>, adding up to the step) that differ by at least :data:`PART_FLOOR`
    of the longer step, ordered by the seconds of the difference, largest first; under the
    compute line, what sets compute by the seconds of its effect, largest first: each kernel choice
    the two frameworks make differently (:mod:`meshplan.compare.kernels`: the attention kernel,
    fused QKV, Megatron-LM's own kernels ..., its seconds at least the floor; listed after the
    parts when the compute part itself is under it) and the GEMMs whose efficiency differs by
    :data:`GEMM_FLOOR` or more. The cp128k pair (dp_shard 2 x cp 8 x tp 8 with SP, x cp 16 x tp 4): ``exposed tp``
    10175.3 ms against 4492.7 ms comes first, the GEMMs 0.4 points apart are left out."""
    if a.step is None or b.step is None:
        return []
    pa, pb = a.step.parts_by_stream(), b.step.parts_by_stream()
    floor = PART_FLOOR * max(a.step.step_s, b.step.step_s)
    gap = {k: pb.get(k, 0.0) - pa.get(k, 0.0) for k in dict.fromkeys([*pa, *pb])}
    out, choices = [], choice_lines(a, b, floor)
    for k in sorted((k for k in gap if abs(gap[k]) >= floor), key=lambda k: -abs(gap[k])):
        out.append(f"{_part_named(a, b, k)}: {a.name} {pa.get(k, 0.0) / MS:.1f} ms, {b.name} "
                   f"{pb.get(k, 0.0) / MS:.1f} ms ({gap[k] / MS:+.1f} ms)")
        if k == "compute":  # what sets it: the framework's kernel choices and the GEMMs, by seconds
            out += [line for _, line in sorted(choices + _gemm_lines(a, b), key=lambda x: -x[0])]
            choices = []
    return out + [line for _, line in sorted(choices, key=lambda x: -x[0])]  # choices that cancel in compute


def _part_named(a: Side, b: Side, part: str) -> str:
    """``part`` as the step text names it (:meth:`StepTime.part_named`: the stream follows the
    engine, ``exposed ZeRO data-parallel`` under DeepSpeed), both names where the engines differ
    (``exposed fsdp (B: ZeRO data-parallel)``: A's name, then B's)."""
    na, nb = (s.step.part_named(part) if s.step is not None else part for s in (a, b))
    return na if na == nb else f"{na} ({b.name}: {nb})"


def _gemm_lines(a: Side, b: Side) -> list[tuple[float, str]]:
    """(seconds, line) for every GEMM both plans run (all the model's named GEMMs: wq, wk, wv, wo, w_gate,
    w_up, w_down, the router's and experts', MLA's, the head's output) whose efficiency differs
    by :data:`GEMM_FLOOR` or more, ordered by the seconds of its effect (:func:`_gemm_step_s`'s
    difference), largest first. The cp128k pair: wk and wv at 42% against 78% (128 local
    output features at tp 8, 256 at tp 4) are listed, not only wq, wo, w_up, w_down."""
    ea = {g[0]: g for g in a.gemms}
    kept = []
    for name, m, n, k, eff in b.gemms:
        if name in ea:
            _, m2, n2, k2, e2 = ea[name]
            if f"{e2:.0%}" == f"{eff:.0%}" or abs(e2 - eff) < GEMM_FLOOR:  # explains no difference
                continue
            effect = abs(_gemm_step_s(b, name) - _gemm_step_s(a, name))
            kept.append((effect, f"{name}: {a.name} ({m2},{n2},{k2}) at {e2:.0%} of peak, {b.name} ({m},{n},{k}) "
                                 f"at {eff:.0%}"))
    return kept


def _gemm_step_s(s: Side, name: str) -> float:
    """Seconds of GEMM ``name``'s forward in one step of ``s``'s critical stage at the efficiency
    shown: 2 M N K x count FLOP / (the dtype's dense peak x efficiency) per layer, times the
    stage's layers and the micro-batches (its backward's two GEMMs share its FLOP, so the order
    this gives is the step's). The layer is the plan's (:attr:`Plan.gemms`, the last layer's);
    the head's ``output`` GEMM runs once per micro-batch."""
    plan, eff = s.plan, {g[0]: g[4] for g in s.gemms}[name]
    if isinstance(plan, Infeasible) or s.step is None or eff <= 0:
        return 0.0
    g = next(x for x in plan.gemms if x.name == name)
    peak = plan.config.cluster.gpu.peak_flops(workload_of(plan).gemm_dtype(name))
    layers = 1 if name == "output" else sum(len(chunk) for chunk in plan.stages[s.step.critical_stage])  # head once
    return g.flops / (peak * eff) * layers * plan.micro_batches


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
    (fraction), peak memory (B), bytes sent per rank per step by link class, and each GEMM's
    local (M, N, K) and efficiency."""
    out = [Row("mesh", "mesh", c.a.mesh_text, c.b.mesh_text)]
    out += [Row(k, k, x, y, _knob, "unset") for k, x, y in c.knobs]
    out += [Row("feasible", "feasible", c.a.feasible, c.b.feasible),
            Row("step time (s)", "step time (s)", c.a.step_s, c.b.step_s, "{:.3f}".format),
            Row("MFU", "MFU (fraction of peak)", c.a.mfu, c.b.mfu, "{:.1%}".format),
            Row("peak memory (GiB)", "peak memory (B)", c.a.peak_bytes, c.b.peak_bytes, lambda x: f"{x / GiB:.1f}")]
    for kind in sorted(set(c.a.link_bytes) | set(c.b.link_bytes)):
        out.append(Row(f"{kind} GB/rank/step", f"{kind} bytes sent per rank per step", _sent(c.a, kind),
                       _sent(c.b, kind), lambda x: f"{x / GB:.1f}"))
    ga, gb = {g[0]: g for g in c.a.gemms}, {g[0]: g for g in c.b.gemms}
    both = c.a.resolved and c.b.resolved  # both resolved: the GEMMs they share; else the resolved one's, "-" beside
    for name in dict.fromkeys([*ga, *gb]):
        if (name in ga and name in gb) or not both:
            out.append(Row(f"{name} (M,N,K) eff", f"{name} (M,N,K) efficiency", _gemm(ga.get(name)),
                           _gemm(gb.get(name)), _g))
    return out


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


def _gemm(g) -> Optional[dict]:
    return None if g is None else {"m": g[1], "n": g[2], "k": g[3], "efficiency": g[4]}


def _gb(s: Side, kind: str) -> str:
    """``s.gb_sent(kind)`` with its unit, "-" alone for an unresolved mesh."""
    v = s.gb_sent(kind)
    return v if v == "-" else f"{v} GB"


def _g(g: dict) -> str:
    return f"({g['m']},{g['n']},{g['k']}) {g['efficiency']:.0%}"
