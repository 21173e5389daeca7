"""Why a pipeline's idle exceeds its closed form: the stage that takes the longest per micro-batch.

A schedule's closed-form bubble (``spec.sched.bubble(p, m, v)``: 1F1B's ``(p - 1) / m`` idle/ideal,
Narayanan et al. SC'21 section 2.2.1) holds for stages of equal time per micro-batch. With unequal
stages the steady state runs at the pace of the longest one and every other stage idles its
shortfall on every micro-batch, so a short stage's idle grows with m while the closed form
shrinks (Llama 3 8B at tp 2 x pp 2 under Megatron-LM, m 32: stage 0, the embedding and 16
layers, idles 0.1778 of its busy time against the closed form's 0.0312, waiting for stage 1,
16 layers and the 128,256-vocab output layer and loss).

Where the bubble line's measured idle/ideal is more than :data:`IMBALANCE_FACTOR` times the
closed form, :func:`imbalance_clause` names the stage(s) with the longest forward + backward per
micro-batch (its units' busy time in the simulated pipeline, :attr:`ArrayResult.busy_s`, over
m: compute and the communication exposed inside its units), its excess over the mean stage,
what it holds of the model's ends (the output layer and loss, or the embedding, with their
compute per micro-batch, :mod:`meshplan.compute.embed_head`) and the knob that makes an end
stage lighter: ``mesh.pp_layer_split`` (torchtitan's ``module_fqns_per_model_part``), Megatron-LM's
``--decoder-first/last-pipeline-num-layers`` or its ``--account-for-embedding-in-pipeline-split``
with ``--account-for-loss-in-pipeline-split`` (:mod:`meshplan.interop.megatron_pipeline`; meshplan
reads the two together), which ``meshplan search`` tries at pp >= 3 (Llama 3's split, the first
and last stage one layer lighter: :mod:`meshplan.spec.search`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.mesh.layers import ends_short_split
from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.spec.mesh_words import stage_list

#: The bubble line explains the idle by the longest stage when the measured idle/ideal exceeds
#: the closed form for uniform stages by more than this factor (issue 11's newcomer trial:
#: 0.1778 against 0.0312, 5.7 times). A judgement, not a measured constant: at up to twice the
#: closed form, p2p transfers and FSDP waits can account for the difference; beyond it the
#: stages' times differ.
IMBALANCE_FACTOR = 2.0

#: Stages whose time per micro-batch is within this relative tolerance of the longest tie with it.
TIE_REL = 1e-9


def closed_form(spec) -> Optional[float]:
    """The schedule's closed-form bubble (idle/ideal) for uniform stages without p2p time, or None
    where there is none: pp 1, a schedule that splits the backward (its bubble depends on the F,
    B, W unit times) or no closed form for this m (interleaved 1F1B with torch's other rounds:
    NaN). 1F1B at p 4, m 8: 0.375 (handed case C11)."""
    if spec.p == 1 or spec.sched.splits_backward:
        return None
    x = spec.sched.bubble(spec.p, spec.m, spec.v)
    return None if x != x else x


#: The most units (p x m x v x the passes F, B and W) the step's text simulates on uniform stages
#: (:func:`uniform_line`); above it the line is left out. Measured with
#: :func:`~meshplan.pipeline.fast.simulate_arrays` on 2 loaded cores: 3,072 units 0.05 s for zbv and
#: dualpipev, 1,024 units 0.004 s for 1F1B; 393,216 units of zbv 5.0 s, so a cap keeps ``step``'s
#: own time (issue 11 item 4: at most 1 s at pp 128 x 4,096 micro-batches) from paying for a check.
UNIFORM_MAX_UNITS = 4096


def uniform_units(spec) -> tuple[float, float, float]:
    """(F, B, W) seconds per micro-batch and stage of the uniform-stage simulation: F 1, B 2 (the
    backward twice the forward, Narayanan et al. SC'21 section 3; handed case C11's 1F1B), or, for
    a schedule that splits the backward, F = B = W = 1 (Qi et al. 2023, "Zero Bubble Pipeline
    Parallelism", section 3: their handcrafted schedules' analysis takes the three equal)."""
    return (1.0, 1.0, 1.0) if spec.sched.splits_backward else (1.0, 2.0, 0.0)


def uniform_line(spec) -> list[str]:
    """The schedule alone, simulated (:func:`~meshplan.pipeline.fast.simulate_arrays`, the
    reference's times) on ``spec``'s p, m and v with every stage the same (:func:`uniform_units`)
    and no p2p time, under both definitions (idle/ideal, idle/total on the busiest stage); [] at
    pp 1 or above :data:`UNIFORM_MAX_UNITS`. Handed case C11, 1F1B at p 4, m 8:

    >>> print(uniform_line(PipelineSpec("1f1b", p=4, m=8))[0])
    bubble simulated on uniform stages (the schedule alone: every stage F 1, B 2 per micro-batch, no p2p time): 0.3750 as idle/ideal, 0.2727 as idle/total
    """
    bubble = uniform_bubble(spec)
    if bubble is None:
        return []
    f, b, w = uniform_units(spec)
    units = f"F {f:g}, B {b:g}" + (f", W {w:g}" if spec.sched.splits_backward else "")
    return [f"bubble simulated on uniform stages (the schedule alone: every stage {units} per micro-batch, no p2p "
            f"time): {bubble[0]:.4f} as idle/ideal, {bubble[1]:.4f} as idle/total"]


def uniform_bubble(spec) -> Optional[tuple[float, float]]:
    """(idle/ideal, idle/total) of the schedule alone simulated on uniform stages, as
    :func:`uniform_line` prints them (``step --json``'s ``bubble_uniform_stages``); None at pp 1
    or above :data:`UNIFORM_MAX_UNITS`. 1F1B at p 4, m 8: 3/8 and 3/11.

    >>> [round(x, 4) for x in uniform_bubble(PipelineSpec("1f1b", p=4, m=8))]
    [0.375, 0.2727]
    """
    f, b, w = uniform_units(spec)
    passes = 3 if spec.sched.splits_backward else 2
    if spec.p == 1 or spec.p * spec.m * spec.v * passes > UNIFORM_MAX_UNITS:
        return None
    r = simulate_arrays(PipelineSpec(spec.schedule, p=spec.p, m=spec.m, v=spec.v, forward_s=f, backward_s=b,
                                     weight_s=w))
    return r.bubble, r.bubble_of_total


def measured_idle(st) -> float:
    """The idle/ideal the bubble line prints for the stage it explains: the busiest stage's
    (the schedule's measure) where the step ends there, else the critical stage's idle over
    its other time, from the rounded parts as :func:`meshplan.schedule.step_lines._other_stage_clause` prints it."""
    res = st.pipeline
    if res.busiest_stage == st.critical_stage:
        return res.bubble
    shown = st.shown_ms()
    idle, step = float(shown["bubble"]), float(shown["step"])
    return idle / (step - idle)


def imbalance_clause(st) -> str:
    """``; stage 1 takes the longest forward+backward per micro-batch: ...`` (module docstring)
    where the measured idle exceeds :data:`IMBALANCE_FACTOR` x the closed form and a stage takes
    longer than the mean; else empty. Times in ms to 0.01, the excess also as % of the mean."""
    res = st.pipeline
    x = closed_form(res.spec)
    if x is None or measured_idle(st) <= IMBALANCE_FACTOR * x:
        return ""
    per = [b / res.spec.m for b in res.busy_s]
    top, mean = max(per), sum(per) / len(per)
    if round((top - mean) * 1e5) <= 0:
        return ""
    longest = [s for s, t in enumerate(per) if t >= top * (1 - TIE_REL)]
    many = len(longest) > 1
    return (f"; {stage_list(longest)} take{'' if many else 's'} the longest forward+backward per micro-batch"
            f"{' each' if many else ''}: {top * 1e3:.2f} ms, {(top - mean) * 1e3:.2f} ms ({top / mean - 1:.1%}) over "
            f"the mean stage's {mean * 1e3:.2f} ms{_holds(st, longest)}; "
            f"{_knob(longest, res.spec.p, _ends_split_news(st))}")


def _holds(st, stages: list[int]) -> str:
    """``; it holds the output layer and loss (17.16 ms of it)``: the model's ends on ``stages``
    (:class:`~meshplan.schedule.unit_sim.ChunkCosts` ``head`` and ``embed``) with their compute
    per micro-batch; empty where they hold neither."""
    parts = []
    for s in stages:
        for what, attr in (("the embedding", "embed"), ("the output layer and loss", "head")):
            costs = [getattr(ch, attr) for ch in st.units.chunks[s] if getattr(ch, attr) is not None]
            if costs:
                who = f"stage {s}" if len(stages) > 1 else "it"
                parts.append(f"{who} holds {what} ({sum(c.seconds() for c in costs) * 1e3:.2f} ms of it)")
    return "; " + ", ".join(parts) if parts else ""


def _ends_split_news(st) -> bool:
    """Whether Llama 3's split (:func:`~meshplan.mesh.layers.ends_short_split` of the plan's layers,
    pp and vpp) would be news to this plan: False where ``meshplan search`` tries it (pp >= 3) and
    the plan's own first and last stages already hold no more layers than it gives them (the
    split is the plan's, or lighter at the ends: DeepSeek-V3's example, [3, 4 x 14, 2] at pp 16,
    is exactly it), or where the search tries none at that pp (None: the default split is it)."""
    p, v = st.pipeline.spec.p, st.pipeline.spec.v
    if p < 3:
        return True
    per = [sum(len(c.layers) for c in chunks) for chunks in st.units.chunks]
    split = ends_short_split(sum(per), p, v)
    return split is not None and (per[0] > split[0] or per[-1] > split[-1])


def _knob(stages: list[int], p: int, ends_news: bool = True) -> str:
    """The knob that makes ``stages`` lighter: an end stage by Megatron-LM's flag for that end,
    any stage by ``mesh.pp_layer_split``; Llama 3's split that ``meshplan search`` tries named
    only where it is lighter at the ends than the plan's (``ends_news``: :func:`_ends_split_news`)."""
    search = ", which `meshplan search` tries at pp >= 3 (Llama 3's split: first and last stage one layer lighter)" \
        if ends_news else " (the first and last stages already hold no more layers than Llama 3's split, which " \
                          "`meshplan search` tries, gives them)"
    account = "--account-for-embedding-in-pipeline-split with --account-for-loss-in-pipeline-split"
    if stages == [p - 1] or stages == [0]:
        end = "last" if stages == [p - 1] else "first"
        return (f"a lighter {end} stage evens the pipeline: mesh.pp_layer_split (Megatron-LM: "
                f"--decoder-{end}-pipeline-num-layers, or {account}){search}")
    return f"mesh.pp_layer_split evens the stages{search}"
