"""The reasons under ``meshplan compare``'s verdict (:func:`evidence_lines`): the knobs that
differ (:func:`knob_text`), the parts of the step that differ by their seconds, largest first,
with what sets compute (the frameworks' kernel choices, :mod:`meshplan.compare.kernels`, and the
GEMMs whose efficiency differs, and with the same kernel choices the kernel kinds whose seconds differ
most, :mod:`meshplan.schedule.kernel_kinds`), then peak memory and the bytes each rank sends
(each side's stage whose ranks send the most, :mod:`meshplan.schedule.stage_traffic`, named).
"""

from __future__ import annotations

from typing import Any

from meshplan.compare.differences import knob
from meshplan.compare.engine_grads import GRAD_DTYPE, engine_grad_dtype
from meshplan.compare.kernels import choice_lines, choice_seconds
from meshplan.compare.sides import Side
from meshplan.compute.measured import host_pace_label
from meshplan.plan import Infeasible
from meshplan.schedule.kernel_kinds import kernel_kinds_s, largest_kinds
from meshplan.schedule.stage_traffic import WHICH
from meshplan.schedule.steptime import workload_of
from meshplan.schedule.workload import plan_step_gemms
from meshplan.units import MS, GiB


def knob_text(knobs: tuple[tuple[str, Any, Any], ...], a_first: bool) -> str:
    """``training.recompute full against none, ...``: each knob's value on A's side against
    B's, or B's against A's when not ``a_first``."""
    return ", ".join(f"{k} {knob(x if a_first else y)} against {knob(y if a_first else x)}" for k, x, y in knobs)


#: A part of the step (compute, bubble, exposed <stream>) whose difference between the two
#: plans is under this fraction of the longer step is not a reason: 0.1%, a tenth of the
#: search's tie band, where no verdict is decided.
PART_FLOOR = 0.001
#: A GEMM's efficiency difference under one percentage point is not a reason (68% vs 69%
#: printed for wo 0.98 points apart on the cp128k pair).
GEMM_FLOOR = 0.01


def evidence_lines(a: Side, b: Side, knobs: tuple = (), memory_first: bool = False) -> list[str]:
    """The reasons under the verdict: the knobs (with the mesh or alone), then the step's parts
    that differ by their seconds, largest first (:func:`_part_lines`), then peak memory and the
    bytes each rank sends; ``memory_first``: the verdict was decided by memory (a plan that
    does not fit, or steps within the tie band), so peak memory comes before the parts."""
    out = []
    if knobs and a.mesh_key == b.mesh_key:
        same = a.mesh_text if a.mesh_text == b.mesh_text else f"{a.name} {a.mesh_text}, {b.name} {b.mesh_text}"
        out.append(f"same mesh ({same}); the plans differ in {knob_text(knobs, True)} ({a.name} against "
                   f"{b.name}): the difference comes from these knobs, not from the mesh")
    elif knobs:
        out.append(f"the meshes differ ({a.name} {a.mesh_text}, {b.name} {b.mesh_text}) and so do "
                   f"{knob_text(knobs, True)} ({a.name} against {b.name}): the difference is theirs together, "
                   f"not the mesh's alone")
    if any(k[0] == GRAD_DTYPE for k in knobs):
        out.append(engine_grad_dtype(a.plan.config.training, b.plan.config.training) or "")
    memory = []
    if a.peak_bytes and b.peak_bytes and a.usable_bytes:
        memory.append(f"peak memory: {a.name} {a.peak_bytes / GiB:.1f} GiB, {b.name} {b.peak_bytes / GiB:.1f} GiB "
                      f"(usable {a.usable_bytes / GiB:.1f} GiB)")
    out += memory + _part_lines(a, b) if memory_first else _part_lines(a, b) + memory
    return out + [_sent_line(a, b, kind) for kind in sorted(set(a.link_bytes) | set(b.link_bytes))]


def _sent_line(a: Side, b: Side, kind: str) -> str:
    """``network bytes sent per rank per step (the stage whose ranks send the most): A 1049.9 GB
    (stage 1), B 1214.8 GB (stage 1)``: each side's figure on its own busiest stage
    (:mod:`meshplan.schedule.stage_traffic`, a MoE model's dense stage 0 sending no ep traffic);
    without the stages where neither side has a pipeline."""
    staged = a.stage_of(kind) or b.stage_of(kind)

    def one(s: Side) -> str:
        where = s.stage_of(kind)
        return f"{s.name} {_gb(s, kind)}" + (f" ({where})" if where else "")

    which = f" ({WHICH})" if staged else ""
    return f"{kind} bytes sent per rank per step{which}: {one(a)}, {one(b)}"


def _part_lines(a: Side, b: Side) -> list[str]:
    """The parts of each plan's step on its critical stage (:meth:`~meshplan.schedule.steptime.StepTime.parts_s`: compute,
    bubble, exposed <stream>, adding up to the step) that differ by at least :data:`PART_FLOOR`
    of the longer step, ordered by the seconds of the difference, largest first; under the
    compute line, what sets compute by the seconds of its effect, largest first: each kernel choice
    the two frameworks make differently (:mod:`meshplan.compare.kernels`: the attention kernel,
    fused QKV, Megatron-LM's own kernels ..., its seconds at least the floor; listed after the
    parts when the compute part itself is under it) and the GEMMs whose efficiency differs by
    :data:`GEMM_FLOOR` or more, and, where the frameworks choose the same kernels, the kernel kinds
    outside the GEMMs whose seconds differ most (:func:`_kind_lines`), then the whole of compute by
    kernel kind (:func:`_split_line`). The cp128k pair (dp_shard 2 x cp 8 x tp 8 with SP, x cp 16 x tp 4): ``exposed tp``
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
        if k == "compute":  # what sets it: by kernel kind, the host's pace, the framework's kernel choices and the GEMMs
            out += [line for _, line in sorted(choices + _host_lines(a, b, floor) + _recompute_lines(a, b, floor)
                                               + _kind_lines(a, b, floor) + _gemm_lines(a, b), key=lambda x: -x[0])]
            out += _split_line(a, b)  # the whole of compute by kernel kind, after what itemises it
            choices = []
    return out + [line for _, line in sorted(choices, key=lambda x: -x[0])]  # choices that cancel in compute


def _split_line(a: Side, b: Side) -> list[str]:
    """The compute line's last reason (a one-item list; none without a step on both sides): each side's compute by kernel kind, seconds per step on its
    critical stage (:attr:`~meshplan.compare.sides.Side.compute_split_s`: the search's line on the
    top names GEMMs, attention, copies on the compute stream, other (memory-bound ops, optimizer
    step); here the SM contention, kernels slowed while collectives' NCCL channels hold SMs, is its
    own part, ``SM contention (NCCL channels)``, not in other; they add up to compute), the kinds
    ordered by their difference, largest first:
    ``of compute by kernel kind (each side's critical stage, per step): GEMMs A 1536.0 ms, B 1600.0 ms
    (+64.0 ms); ...``. Newcomer trial 24: pp 4 vpp 2 against dp_shard 32 x tp 8 (Llama-3-70B) said only
    ``compute +198.7 ms``, all of it in the GEMMs and attention, which :func:`_kind_lines` leaves out."""
    sa, sb = a.compute_split_s, b.compute_split_s
    if sa is None or sb is None:
        return []  # no step on a side: no compute line to end
    kinds = sorted(sa, key=lambda k: -abs(sb[k] - sa[k]))
    return ["of compute by kernel kind (each side's critical stage, per step): " + "; ".join(
        f"{k} {a.name} {sa[k] / MS:.1f} ms, {b.name} {sb[k] / MS:.1f} ms ({round((sb[k] - sa[k]) / MS, 1) + 0.0:+.1f} ms)"
        for k in kinds)]  # + 0.0: a rounding's -0.0 printed +0.0


def _host_lines(a: Side, b: Side, floor: float) -> list[tuple[float, str]]:
    """(seconds, line) under the compute line when the compute stream's wait for the host's issue
    (eager DTensor TP: :meth:`~meshplan.schedule.step_summary.StepTime.host_wait_s`, inside compute)
    differs by ``floor`` or more: ``of compute, waiting for the host ...: A 2219.7 ms, B 43.0 ms (-2176.7 ms)``."""
    if a.step is None or b.step is None:
        return []
    ha, hb = a.step.host_wait_s(), b.step.host_wait_s()
    if abs(hb - ha) < floor:
        return []
    src = host_pace_label(a.step.units.w.dtensor_host_source)  # compare: both sides' kernel data is one
    return [(abs(hb - ha), f"of compute, waiting for the host to issue eager DTensor TP's blocks ({src}): "
                          f"{a.name} {ha / MS:.1f} ms, {b.name} {hb / MS:.1f} ms ({(hb - ha) / MS:+.1f} ms)")]


def _recompute_lines(a: Side, b: Side, floor: float) -> list[tuple[float, str]]:
    """(seconds, line) under the compute line when the two plans' recompute policies differ
    (``training.recompute`` or ``training.ac_freq``) and the forward ops they replay in backward
    per step on the critical stage (:meth:`~meshplan.schedule.step_summary.StepTime.recompute_step_s`,
    what ``meshplan step``'s ``recompute:`` line prints, inside compute) differ by ``floor`` or more:
    ``of compute, recompute (forward replayed in backward): A 2512.5 ms, B 719.1 ms (-1793.4 ms)``.
    The kernel kinds below it (:func:`_kind_lines`) count their replays too. Newcomer trial
    (Llama-3-70B at 32k tokens on 1,024 H200, full against selective): compare listed cp ring
    and silu lines under ``compute -1969.8 ms`` but not the recompute, 3810.6 against 1345.1 ms."""
    if a.step is None or b.step is None or _recompute_policy(a) == _recompute_policy(b):
        return []
    ra, rb = a.step.recompute_step_s(), b.step.recompute_step_s()
    if abs(rb - ra) < floor:
        return []
    return [(abs(rb - ra), f"of compute, recompute (forward replayed in backward): {a.name} {ra / MS:.1f} ms, "
                          f"{b.name} {rb / MS:.1f} ms ({(rb - ra) / MS:+.1f} ms)")]


def _recompute_policy(s: Side) -> tuple:
    """``s``'s recompute policy: (``training.recompute``, ``training.ac_freq``)."""
    t = s.plan.config.training
    return t.recompute, t.ac_freq


def _kind_lines(a: Side, b: Side, floor: float) -> list[tuple[float, str]]:
    """(seconds, line) under the compute line for the 3 kernel kinds outside the GEMMs and the
    attention core whose seconds per step on each side's critical stage differ most, by more than
    ``floor`` (:func:`~meshplan.schedule.kernel_kinds.largest_kinds`, the compute model's op names):
    ``of compute, SP layout copy: row1 0.0 ms, row2 43.4 ms (+43.4 ms)``; none where a framework
    kernel choice differs (:func:`~meshplan.compare.kernels.choice_seconds`: its lines itemise
    the kinds it moves). Newcomer trial: dp_shard 16 x tp 4 against dp_shard 8 x cp 2 x tp 4 said
    only ``compute +91.4 ms``, torch's CP ring merges and SP layout copies of the cp 2 side."""
    if a.step is None or b.step is None or choice_seconds(a, b):
        return []
    kinds = largest_kinds(kernel_kinds_s(a.step), kernel_kinds_s(b.step), floor_s=floor)
    return [(abs(y - x), f"of compute, {k}: {a.name} {x / MS:.1f} ms, {b.name} {y / MS:.1f} ms "
                         f"({(y - x) / MS:+.1f} ms)") for k, x, y in kinds]


def _part_named(a: Side, b: Side, part: str) -> str:
    """``part`` as the step text names it (:meth:`~meshplan.schedule.steptime.StepTime.part_named`: the stream follows the
    engine, ``exposed ZeRO data-parallel`` under DeepSpeed), both names where the engines differ
    (``exposed fsdp (B: ZeRO data-parallel)``: A's name, then B's)."""
    na, nb = (s.step.part_named(part) if s.step is not None else part for s in (a, b))
    return na if na == nb else f"{na} ({b.name}: {nb})"


def _gemm_lines(a: Side, b: Side) -> list[tuple[float, str]]:
    """(seconds, line) for every GEMM both plans run (all the model's named GEMMs: wq, wk, wv, wo, w_gate,
    w_up, w_down, the router's and experts', MLA's, the head's output) whose efficiency differs
    by :data:`GEMM_FLOOR` or more, ordered by the seconds of its effect (:func:`_gemm_step_s`'s
    difference), largest first. The cp128k pair: wk and wv at 38% against 53% (128 local
    output features at tp 8, 256 at tp 4) are listed, not only wq and w_down."""
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
    this gives is the step's). The layer is the plan's (:attr:`~meshplan.plan.Plan.gemms`, the last layer's);
    the head's ``output`` GEMM runs once per micro-batch."""
    plan, eff = s.plan, {g[0]: g[4] for g in s.gemms}[name]
    if isinstance(plan, Infeasible) or s.step is None or eff <= 0:
        return 0.0
    g = next(x for x in plan_step_gemms(plan) if x.name == name)
    peak = plan.config.cluster.gpu.peak_flops(workload_of(plan).gemm_dtype(name))
    layers = 1 if name == "output" else sum(len(chunk) for chunk in plan.stages[s.step.critical_stage])  # head once
    return g.flops / (peak * eff) * layers * plan.micro_batches


def _gb(s: Side, kind: str) -> str:
    """``s.gb_sent(kind)`` with its unit, "-" alone for an unresolved mesh."""
    v = s.gb_sent(kind)
    return v if v == "-" else f"{v} GB"
