"""The ``hint:`` line of a step whose critical stage idles in the pipeline bubble: when that idle
(:meth:`~meshplan.schedule.step_summary.StepTime.parts_s` ``bubble``, the step's parts line and
the bubble line's ``is its idle, ... of the step``) holds :data:`~meshplan.schedule.verdict.HINT_SHARE`
of the step or more, the config re-planned with the knobs that shrink a bubble (:func:`bubble_knobs`),
those that fit memory with a step shorter by more than :data:`~meshplan.spec.search.TIE` (1%,
:func:`~meshplan.schedule.verdict.clearly_faster`, the rule of every ``hint:`` line) listed, the
fastest :data:`MAX_SHOWN` first, each with its step, its change against this step, its own bubble
share and its peak; when none helps, a ``note: no bubble hint`` line naming each knob tried and
why it was dropped (:func:`no_hint_note`).

The knobs, each on its own, as a practitioner turns them (Narayanan et al. SC'21 2.2: the
1F1B bubble ``(p - 1) / m`` over ``v`` chunks per rank and ``m`` micro-batches; Qi et al. 2023,
arXiv 2401.10241: split backward):

- interleaved virtual stages: ``mesh.virtual_stages`` 2 and 4 (above the config's) under
  ``interleaved_1f1b`` (bubble ``(p - 1) / (v m)``), from 1F1B, GPipe or interleaved 1F1B;
- more micro-batches at the same global batch: half ``training.micro_batch`` when it is > 1;
- all the step's micro-batches in one schedule run where torchtitan's accumulation splits them
  (``training.pp_schedule_runs`` 1: :func:`_one_run`);
- the zero-bubble schedules meshplan runs (:mod:`meshplan.pipeline.zb_h1`, :mod:`meshplan.pipeline.zbv`, and
  :mod:`meshplan.pipeline.dualpipev`, whose bubble run without DeepSeek's overlap is ZB-V's ``(p - 1) / (6 m)``)
  under framework torch (Megatron-LM runs neither: :func:`meshplan.pipeline.registry.check_framework`),
  a schedule whose runtime is known to run this plan differently (its
  :meth:`~meshplan.pipeline.base.PipelineSchedule.warnings`) left out, ZB-V and DualPipeV with FSDP2
  over a data axis and ``reshard_after_forward`` true tried with it false (``, training.reshard_after_forward
  = false`` in the knob's words: the fix of their warning, torchtitan's default under pp),
  and all three left out under activation checkpointing, which torch's split backward is reported to
  run far slower (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_warning`: torchtitan issue #773,
  pytorch issue #136766);
- fewer stages on the same world: pp / 2 with the freed factor on the data axis (its per-stage
  layer split merged pairwise), which halves the micro-batches per stage as well.

Where the layers, the schedule's micro-batch rule or memory refuse a knob, its re-plan does not
resolve or fit, and it is not listed. Each knob is stepped before its memory is planned
(:class:`~meshplan.schedule.verdict.Rebuilt`): only the clearly faster ones have their memory
timelines planned, fastest first, until :data:`MAX_SHOWN` fit (:func:`fastest`; the line is the
one of re-planning every knob whole).
"""

from __future__ import annotations

import json
from typing import Callable, Optional

from meshplan.interop.torchtitan_tables import default_split
from meshplan.memory.constraints import usable_bytes
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.split_backward_ac import split_backward_ac_warning
from meshplan.plan import Plan
from meshplan.schedule.hint_facts import Hint, HintLine, knob_of
from meshplan.schedule.verdict import HINT_SHARE, Replanned, clearly_faster, knob_outcome
from meshplan.spec.search import TIE
from meshplan.spec.mesh import MeshSpec, Schedule
from meshplan.units import GiB, counted, step_seconds

#: Re-plans shown at most on the line (the fastest first).
MAX_SHOWN = 3
#: Data axes that take pp's freed factor, the first present in the config's mesh.
_DATA = ("dp_shard", "dp", "dp_replicate")

#: A knob: (its words, the ``training`` update, the new mesh spec or None for the config's).
Knob = tuple[str, dict, Optional[MeshSpec]]


def bubble_share(st) -> float:
    """The critical stage's pipeline idle as a share of the step (``parts_s()["bubble"] / step_s``;
    0 without a pipeline)."""
    return st.parts_s().get("bubble", 0.0) / st.step_s if st.pipeline.spec.p > 1 else 0.0


def bubble_hint(plan: Plan, st, alternatives: Optional[Callable[..., Replanned]]) -> list[str]:
    """``hint:`` line for ``st`` (the :class:`~meshplan.schedule.step_summary.StepTime` of
    ``plan``) whose critical stage idles :data:`HINT_SHARE` of the step or more in the pipeline
    bubble: each of :func:`bubble_knobs` re-planned by ``alternatives(update, mesh)``
    (:func:`~meshplan.schedule.verdict.rebuilt_step`), those that fit with a step shorter by more
    than :data:`~meshplan.spec.search.TIE` (:func:`~meshplan.schedule.verdict.clearly_faster`), the
    fastest :data:`MAX_SHOWN`; when none helps the ``note:`` saying why (:func:`no_hint_note`); none
    under the share or without ``alternatives``.
    examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml (1F1B, pp 16, 16 micro-batches): stage
    0 idles 50.3% of a 13.78 s step (tests/test_step_bubble_hint.py)."""
    share = bubble_share(st)
    if alternatives is None or share < HINT_SHARE:
        return []
    knobs = bubble_knobs(plan)
    found = fastest(st, knobs, alternatives)
    p, idle = st.pipeline.spec, st.parts_s()["bubble"]
    head = (f"the pipeline bubble on stage {st.critical_stage} is {share:.1%} of the step ({idle:.2f} s of "
            f"{step_seconds(st.step_s)}; {p.schedule}, pp {p.p}, {counted(plan.micro_batches, 'micro-batch')} per step"
            f"{_runs_words(plan)})")
    if not found:
        return [no_hint_note(plan, st, head, knobs, alternatives)]
    items = [f"{words} (step {step_seconds(s)}, {s / st.step_s - 1:+.1%}, bubble {bubble_share(alt.step):.1%} of it, "
             f"peak {alt.peak_bytes / GiB:.1f} GiB fits)" for s, words, alt in found]
    return [HintLine(f"hint: {head}: shorter with " + "; ".join(items),
                     Hint("bubble", share, tuple(knob_of(words, alt) for _, words, alt in found)))]


def _runs_words(plan: Plan) -> str:
    """`` in 120 schedule runs of 1`` where torchtitan's accumulation splits the step's micro-batches
    (``training.pp_schedule_runs`` > 1), "" otherwise."""
    runs = plan.config.training.pp_schedule_runs
    return f" in {runs} schedule runs of {plan.micro_batches // runs}" if runs > 1 else ""


def no_hint_note(plan: Plan, st, head: str, knobs: list[Knob], alternatives: Callable[..., Replanned]) -> str:
    """The ``note: no bubble hint`` line where the bubble holds :data:`HINT_SHARE` of the step but
    no knob helps (newcomer trial 51 #2; as :func:`meshplan.schedule.tp_hint.silent_note`): each
    knob tried and why it was dropped (:func:`_outcome`: refused or infeasible, its step where it is
    not more than :data:`~meshplan.spec.search.TIE` shorter, its peak where it does not fit), ``; ``
    between them, and the usable memory where one does not fit; or that no knob applies to this
    pipeline (:func:`bubble_knobs`). tests/data/nc52a/a_h100_cp2_edge.toml (Llama-3-405B, pp 16,
    ZeRO-1, Megatron-LM, 30% reserved: 55.4 GiB usable): the bubble is 15.7% of a 39.55 s step,
    virtual stages 2 and 4 peak at 65.5 and 59.0 GiB, pp 8 steps +0.3% (tests/test_step_bubble_hint.py)."""
    if not knobs:
        return (f"note: no bubble hint: {head}, but no knob applies (virtual stages 2 and 4 under 1F1B, GPipe "
                f"or interleaved 1F1B, half a micro-batch above 1, the zero-bubble schedules under framework "
                f"torch, pp / 2 at an even pp)")
    return (f"note: no bubble hint: {head}, but none re-planned fits with a step more than {TIE:.0%} shorter: "
            + knob_outcomes(plan, st, knobs, alternatives))


def knob_outcomes(plan: Plan, st, knobs: list[Knob], alternatives: Callable[..., Replanned]) -> str:
    """Each knob tried and why it was dropped (:func:`_outcome`), ``; `` between them, and the
    usable memory where one does not fit: the tail of a ``note: no ... hint`` line (this module's,
    :mod:`meshplan.schedule.cp_hint`'s)."""
    outcomes = [f"{words}: {_outcome(st, update, mesh, alternatives)}" for words, update, mesh in knobs]
    usable = usable_bytes(plan.config.cluster, plan.config.training) / GiB
    room = f" ({usable:.1f} GiB usable per GPU)" if any(o.endswith("does not fit") for o in outcomes) else ""
    return "; ".join(outcomes) + room


def _outcome(st, update: dict, mesh: Optional[MeshSpec], alternatives: Callable[..., Replanned]) -> str:
    """Why one knob is not in the hint (:func:`~meshplan.schedule.verdict.knob_outcome`): with
    :class:`~meshplan.schedule.verdict.Rebuilt`, its step where it is not clearly shorter (its
    memory not planned, as :func:`fastest` leaves it), else its fitted outcome (cached there)."""
    stepped = getattr(alternatives, "stepped", None)
    if stepped is not None:
        first = stepped(update, mesh)
        if first.step_s is not None and not clearly_faster(st.step_s, first.step_s):
            return knob_outcome(st.step_s, Replanned("", first.step_s))
        if first.step_s is not None:
            return knob_outcome(st.step_s, alternatives.fitted(first))  # type: ignore[attr-defined]
    return knob_outcome(st.step_s, alternatives(update, mesh))


def fastest(st, knobs: list[Knob], alternatives: Callable[..., Replanned]) -> list[tuple[float, str, Replanned]]:
    """(step, words, re-plan) of the :data:`MAX_SHOWN` fastest ``knobs`` that fit with a step
    clearly shorter than ``st``'s (:func:`~meshplan.schedule.verdict.clearly_faster`), fastest
    first; steps within a microsecond (ZB-V, DualPipeV) in knob order. With
    :class:`~meshplan.schedule.verdict.Rebuilt` (its ``stepped`` and ``fitted``) each knob is
    stepped without its memory and only the clearly faster ones have it planned, fastest first,
    until :data:`MAX_SHOWN` fit: a stable sort keeps the order of those that fit, so the list is
    the one of re-planning every knob whole (what a plain ``alternatives`` does)."""
    step = getattr(alternatives, "stepped", alternatives)
    fit = getattr(alternatives, "fitted", lambda alt: alt)
    tried = [(alt.step_s, words, alt) for words, update, mesh in knobs
             for alt in (step(update, mesh),) if alt.step_s is not None and clearly_faster(st.step_s, alt.step_s)]
    tried.sort(key=lambda f: round(f[0], 6))
    found: list[tuple[float, str, Replanned]] = []
    for s, words, alt in tried:
        kept = fit(alt)
        if kept.step_s is not None:  # it fits
            found.append((s, words, kept))
        if len(found) == MAX_SHOWN:
            break
    return found


def bubble_knobs(plan: Plan) -> list[Knob]:
    """The knobs of the module docstring for ``plan`` (pp > 1; none at pp 1), in its order."""
    if plan.pp < 2:
        return []
    return _interleaved(plan) + _micro_batch(plan) + _one_run(plan) + _zero_bubble(plan) + _fewer_stages(plan)


def _per_stage(plan: Plan) -> Optional[list[int]]:
    """The config's ``pp_layer_split`` as layers per stage (None where it gives none: even stages)."""
    if plan.spec.pp_layer_split is None:
        return None
    return [sum(len(c) for c in chunks) for chunks in plan.stages]


def _split_words(plan: Plan) -> str:
    """``, mesh.pp_layer_split [..]`` where :func:`_per_stage` rewrites the config's split (given
    per virtual stage), else empty."""
    split = _per_stage(plan)
    if split == plan.spec.pp_layer_split:
        return ""
    return (f", mesh.pp_layer_split {split} (layers per stage, each stage's split into the chunks evenly; the "
            f"config's {plan.spec.pp_layer_split} is per virtual stage)")  # the form changes: said (nc57 #9)


def _pipeline(plan: Plan, schedule: Schedule, v: int) -> MeshSpec:
    """The config's mesh spec under ``schedule`` with ``v`` chunks per rank (its split per stage)."""
    return plan.spec.model_copy(update={"pp_schedule": schedule, "virtual_stages": v,
                                        "layers_per_virtual_stage": None, "pp_layer_split": _per_stage(plan)})


def torchtitan_layers_per_stage(layers: int, stages: int) -> Optional[int]:
    """The ``parallelism.pipeline_parallel_layers_per_stage`` N from which torchtitan builds ``stages``
    model parts of ``layers`` layers (None where no N does): it cuts ``ceil((layers + 1 + 1) / N)`` parts,
    the embedding and the output each counted as a layer (the first/last_stage_less_layers defaults 1),
    and splits them as :func:`~meshplan.interop.torchtitan_tables.default_split` (pytorch/torchtitan
    e347b1e ``distributed/pipeline_parallel.py`` ``pipeline_module_split``/``generate_llm_fqn_per_model_part``,
    which :func:`meshplan.interop.torchtitan_mesh.read_pipeline` reads). DeepSeek-V3 (61 layers) at pp 8 x 4: 63 / 2.

    >>> torchtitan_layers_per_stage(61, 32), torchtitan_layers_per_stage(94, 16), torchtitan_layers_per_stage(94, 40)
    (2, 6, None)
    """
    return next((n for n in range(1, layers + 3) if -(-(layers + 2) // n) == stages), None)


def _torchtitan_interleaved(plan: Plan, named: str) -> list[Knob]:
    """:func:`_interleaved` in the words of a torchtitan job TOML (newcomer trial 50 #4: it has neither
    ``mesh.virtual_stages`` nor a split of layer counts, ``module_fqns_per_model_part`` taking module names):
    ``parallelism.pipeline_parallel_layers_per_stage = N`` (:func:`torchtitan_layers_per_stage`), re-planned
    with the split torchtitan cuts from it; a v no N gives is left out."""
    out: list[Knob] = []
    for v in (2, 4):
        parts = _torchtitan_parts(plan, Schedule.INTERLEAVED_1F1B, v) if v > plan.vpp else None
        if parts is not None:
            out.append((f"{parts[0]}{named} ({plan.pp * v} stages, {v} per rank; module_fqns_per_model_part "
                        f"removed)", {}, parts[1]))
    return out


def _torchtitan_parts(plan: Plan, schedule: Schedule, v: int) -> Optional[tuple[str, MeshSpec]]:
    """(``parallelism.pipeline_parallel_layers_per_stage = N``, the mesh spec torchtitan builds from it) for
    ``v`` stages per rank under ``schedule``; None where no N gives pp x v parts."""
    layers = plan.config.model.layers
    n = torchtitan_layers_per_stage(layers, plan.pp * v)
    if n is None:
        return None
    return (f"parallelism.pipeline_parallel_layers_per_stage = {n}",
            plan.spec.model_copy(update={"pp_schedule": schedule, "virtual_stages": v, "layers_per_virtual_stage": None,
                                         "pp_layer_split": default_split(plan.pp * v, layers)}))


def _interleaved(plan: Plan) -> list[Knob]:
    sched = plan.spec.pp_schedule
    if sched not in (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.INTERLEAVED_1F1B):
        return []
    if plan.config.origin == "torchtitan":
        return _torchtitan_interleaved(plan, "" if sched == Schedule.INTERLEAVED_1F1B else
                                       ', parallelism.pipeline_parallel_schedule = "Interleaved1F1B"')
    named = "" if sched == Schedule.INTERLEAVED_1F1B else ', mesh.pp_schedule = "interleaved_1f1b"'
    return [(f"mesh.virtual_stages = {v}{named}{_split_words(plan)}", {}, _pipeline(plan, Schedule.INTERLEAVED_1F1B, v))
            for v in (2, 4) if v > plan.vpp]


def _micro_batch(plan: Plan) -> list[Knob]:
    mb = plan.config.training.micro_batch
    if mb < 2:
        return []
    half = mb // 2 if mb % 2 == 0 else 1
    return [(f"training.micro_batch = {half} ({counted(plan.micro_batches * mb // half, 'micro-batch')})",
             {"micro_batch": half}, None)]


def _one_run(plan: Plan) -> list[Knob]:
    """torchtitan's gradient accumulation under pp (``training.pp_schedule_runs`` > 1): each run fills
    and drains the pipeline over m / runs micro-batches, so the bubble is paid runs times; the knob runs
    the step's m micro-batches in the fewest runs r (a divisor of the configured runs) whose m / r the
    schedule takes (:meth:`~meshplan.pipeline.base.PipelineSchedule.refused`: torch's interleaved 1F1B
    needs a multiple of its rounds), at the same global batch and micro-batch. In a torchtitan job TOML
    that is ``training.local_batch_size`` = micro-batch x m / r (global = local x dp x runs); in a
    b5bcd76 config registry (batch in tokens: ``keymaps.keymap_of``) ``parallelism.num_pp_microbatches``
    = m / r (the run's micro-batches; global tokens = dp x runs x m / r x tokens a micro-batch).
    Newcomer trial nc58 #3: DeepSeek-V3 at pp 16, local 1, 120 runs of one micro-batch idled 95% of the
    step with no hint naming the batch keys."""
    t, m = plan.config.training, plan.micro_batches
    sched = get_schedule(plan.spec.pp_schedule)
    runs = next((r for r in range(1, t.pp_schedule_runs) if t.pp_schedule_runs % r == 0
                 and not sched.refused(plan.pp, m // r, t.framework)), None)  # the schedule's micro-batch rule
    if runs is None:
        return []
    each = f"{runs} schedule run{'s' if runs > 1 else ''} of {counted(m // runs, 'micro-batch')}"
    if plan.config.origin != "torchtitan":
        words = f"training.pp_schedule_runs = {runs} ({each})"
    elif t.op_sac_policy == "b5bcd76":  # a b5bcd76 registry: no local_batch_size (nclose's note)
        words = f"parallelism.num_pp_microbatches = {m // runs} (training.pp_schedule_runs {runs}: {each})"
    else:
        words = f"training.local_batch_size = {t.micro_batch * m // runs} (training.pp_schedule_runs {runs}: {each})"
    return [(words, {"pp_schedule_runs": runs}, None)]


def _zero_bubble(plan: Plan) -> list[Knob]:
    t, mesh = plan.config.training, plan.mesh
    if t.framework != "torch" or split_backward_ac_warning(t, Schedule.ZB_H1, plan.pp):
        return []
    fsdp2 = t.sharding in ("zero3", "hsdp") and mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1
    out: list[Knob] = []
    for sched, v in ((Schedule.ZB_H1, 1), (Schedule.ZBV, 2), (Schedule.DUALPIPEV, 2)):
        fix = _runtime_fix(t, get_schedule(sched), plan.pp, fsdp2)
        if sched == plan.spec.pp_schedule or fix is None:
            continue
        chunks = "" if v == plan.vpp else f", mesh.virtual_stages = {v}"
        words = "".join(f", training.{k} = false" for k in fix if k == "reshard_after_forward")
        parts = _torchtitan_parts(plan, sched, v) if plan.config.origin == "torchtitan" and (
            chunks or _split_words(plan)) else None  # torchtitan's words for the parts (_torchtitan_interleaved)
        if parts is not None:
            out.append((f'mesh.pp_schedule = "{sched}", {parts[0]}{words}', fix, parts[1]))
        elif plan.config.origin != "torchtitan" or not (chunks or _split_words(plan)):
            out.append((f'mesh.pp_schedule = "{sched}"{chunks}{_split_words(plan)}{words}', fix,
                        _pipeline(plan, sched, v)))
    return out


def _runtime_fix(t, sched, pp: int, fsdp2: bool) -> Optional[dict]:
    """The training update under which torch runs ``sched`` as planned: none (``{}``) where it has
    no warning; ``reshard_after_forward`` false (and the head's with it) where only that warning,
    :data:`meshplan.pipeline.vshape.RESHARD_DEFECT`, holds (its fix, torchtitan's default under pp);
    None where it warns either way."""
    if not sched.warnings(t.framework, pp, fsdp2, t.reshard_after_forward):
        return {}
    if sched.warnings(t.framework, pp, fsdp2, False):
        return None
    return {"reshard_after_forward": False} | ({"reshard_head_after_forward": False} if t.reshard_head_after_forward
                                               else {})


def _fewer_stages(plan: Plan) -> list[Knob]:
    """pp / 2 with the data axis (the first of :data:`_DATA` in the mesh, else a new ``dp_shard``
    under FSDP or ``dp``, right inside pp) twice as large: the same world. An explicit
    ``rank_to_gpu`` is the user's placement and is not re-planned."""
    if plan.pp % 2 or plan.spec.rank_to_gpu is not None:
        return []
    deg = plan.axis_degrees()
    data = next((n for n in _DATA if n in deg), None)
    if data is None and plan.spec.names is None:  # Megatron's order string names every axis: none added
        return []
    if data is None:  # a new data axis right inside pp (outermost after it, as DeviceMesh orders dp)
        data = "dp_shard" if plan.config.training.sharding in ("zero3", "hsdp") else "dp"
        deg = {n: d for k, v in deg.items() for n, d in ((k, v), (data, 1))[:1 + (k == "pp")]}
    pp, split = plan.pp // 2, _per_stage(plan)
    deg = deg | {"pp": pp, data: deg[data] * 2}
    merged = None if split is None or pp == 1 else [a + b for a, b in zip(split[::2], split[1::2])]
    update: dict = {"pp_layer_split": merged}
    if pp == 1:
        update |= {"virtual_stages": 1, "layers_per_virtual_stage": None}
    # the config's own spec, its degrees replaced (not plan_variant.variant_mesh, which turns SP on with tp > 1)
    axes = {"names": list(deg), "shape": list(deg.values())} if plan.spec.names is not None else {"degrees": deg}
    spec = plan.spec.model_copy(update=axes | update)
    field = f"mesh.shape {spec.shape}" if spec.names is not None else f"mesh.degrees {spec.degrees}"
    if spec.names is not None and spec.names != plan.spec.names:  # a data axis added
        field = f"mesh.names {json.dumps(spec.names)}, {field}"
    split_words = f", mesh.pp_layer_split {spec.pp_layer_split}" if spec.pp_layer_split else ""
    words = f"pp {pp} x {data} {deg[data]} ({field}{split_words})"
    return [(words, {}, spec)]
