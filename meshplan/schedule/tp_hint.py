"""The ``hint:`` line of a step whose critical stage exposes TP communication (newcomer trial 16
#2): when its exposed tp (:attr:`~meshplan.schedule.step_summary.StepTime.exposed_s` ``tp``, the
parts line's ``exposed tp``) holds :data:`~meshplan.schedule.verdict.HINT_SHARE` of the step or
more and ``training.tp_comm_overlap`` is off, the config re-planned with it on, as the framework
runs it (:mod:`meshplan.compute.asynctp`: Megatron-LM's ``--tp-comm-overlap``, Transformer Engine
userbuffers; torchtitan's ``parallelism.enable_async_tensor_parallel``, which needs
``torch.compile``: torchtitan raises "Async TP requires torch.compile", so under framework torch
``training.torch_compile = true`` is set with it where it is off, and the line names both).

The line is shown only where that re-plan fits with a step shorter by more than
:data:`~meshplan.spec.search.TIE` (1%, :func:`~meshplan.schedule.verdict.clearly_faster`, the
rule of every ``hint:`` line), with its step, its change, its exposed tp and its peak. The runtimes'
overlap decomposes the GEMMs it overlaps, and their smaller pieces run slower
(:mod:`meshplan.compute.asynctp`), so a large exposed tp can give a small gain: Llama-3-70B at
seq 32768, dp_shard 2 x cp 4 x tp 8, full recompute, compiled, global batch 40, exposes 6.03 s of
tp in a 36.83 s step (16.4%), and async TP hides 2.18 s of it but adds 2.33 s of compute: the
step is 0.2% shorter, and no hint is shown but a ``note: no tp hint`` line with the re-plan's step
and why (:func:`silent_note`; ``step --overlap-tp``'s whole-GEMM overlap, 32.65 s, is a
bound no runtime reaches).

With the overlap already on (newcomer trial 57 #8: torchtitan b5bcd76's Llama-3-70B, pp 2 x dp_shard 4
x tp 8 on 8 dgx-h100, async TP on, exposed tp 21.8% of the step) the knob left is the mesh: a
smaller tp, ``tp / k`` for k = 2, 4, ... with the freed factor on the data axis (fewer ranks a
TP collective, on NVLink still, and a larger FSDP group: more memory a GPU and more FSDP traffic,
which the re-plan counts), each re-planned as :mod:`~meshplan.schedule.cp_hint`'s moves are
(:func:`overlapped_hint`). Those that fit with a clearly shorter step are the ``hint:``; else a
``note: no tp hint`` line says what stays exposed with the overlap on (:func:`remaining`) and each
move's outcome.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from meshplan.schedule.bubble_hint import Knob, fastest, knob_outcomes
from meshplan.schedule.cp_hint import mesh_spec, mesh_words
from meshplan.schedule.hint_facts import Hint, HintLine, knob_of
from meshplan.schedule.verdict import HINT_SHARE, Replanned, clearly_faster, knob_outcome
from meshplan.spec.search import TIE
from meshplan.units import GiB, step_seconds


def tp_knobs(training) -> dict:
    """The ``training`` update that turns the framework's TP overlap on: ``tp_comm_overlap``,
    and under framework torch ``torch_compile`` where it is off (async TP needs it).

    >>> from meshplan.spec.training import TrainingSpec
    >>> tp_knobs(TrainingSpec(global_batch=8, seq_len=16))
    {'tp_comm_overlap': True, 'torch_compile': True}
    >>> tp_knobs(TrainingSpec(global_batch=8, seq_len=16, framework="megatron"))
    {'tp_comm_overlap': True}
    """
    compile_too = training.framework == "torch" and not training.torch_compile
    return {"tp_comm_overlap": True} | ({"torch_compile": True} if compile_too else {})


def _runtime(framework: str) -> str:
    """The runtime's own name for the overlap."""
    return {"torch": "torchtitan's async TP, parallelism.enable_async_tensor_parallel, which needs torch.compile",
            "megatron": "Megatron-LM's --tp-comm-overlap, Transformer Engine userbuffers"}.get(framework, framework)


def _exposed_tp(step) -> float:
    """Exposed tp (s) of a re-plan's :class:`~meshplan.schedule.step_summary.StepTime` (0 without one)."""
    return step.exposed_s.get("tp", 0.0) if step is not None else 0.0


def tp_hint(plan, st, alternatives: Optional[Callable[..., Replanned]]) -> list[str]:
    """``hint:`` line for ``st`` (the :class:`~meshplan.schedule.step_summary.StepTime` of
    ``plan``) whose critical stage exposes :data:`HINT_SHARE` of the step or more on tp with
    ``training.tp_comm_overlap`` off: the config re-planned with :func:`tp_knobs` by
    ``alternatives`` (:func:`~meshplan.schedule.verdict.rebuilt_step`), shown where it fits with a
    step more than 1% shorter (:func:`~meshplan.schedule.verdict.clearly_faster`); otherwise a
    ``note:`` saying why there is no hint (:func:`silent_note`).
    examples/mini_2x4_tp4-dp2.toml compiled (Llama-3-8B, dp_shard 2 x tp 4): exposed tp 1.29 s of
    a 7.93 s step (16.2%); with async TP 7.41 s (tests/test_step_tp_hint.py)."""
    t = plan.config.training
    exposed = st.exposed_s.get("tp", 0.0)
    if t.tp_comm_overlap and not t.megatron_deepspeed:
        return overlapped_hint(plan, st, alternatives)
    if alternatives is None or plan.mesh.degree("tp") < 2 or exposed < HINT_SHARE * st.step_s \
            or t.megatron_deepspeed:  # Megatron-DeepSpeed's parser has no --tp-comm-overlap: no knob to hint
        return []
    update = tp_knobs(t)
    alt = alternatives(update)
    knobs = ", ".join(f"training.{k} = true" for k in update)
    if alt.step_s is None or not clearly_faster(st.step_s, alt.step_s):
        return silent_note(st, alt, knobs, t.framework)
    after = _exposed_tp(alt.step)
    return [HintLine(f"hint: exposed tp is {exposed / st.step_s:.1%} of the step ({exposed:.2f} s of {step_seconds(st.step_s)}): "
                     f"shorter with {knobs} ({_runtime(t.framework)}): step {step_seconds(alt.step_s)} "
                     f"({alt.step_s / st.step_s - 1:+.1%}), exposed tp {exposed:.2f} -> {after:.2f} s, peak "
                     f"{alt.peak_bytes / GiB:.1f} GiB fits", Hint("tp", exposed / st.step_s, (knob_of(knobs, alt),)))]


def silent_note(st, alt: Replanned, knobs: str, framework: str) -> list[str]:
    """The ``note:`` line where exposed tp holds :data:`HINT_SHARE` of the step but its re-plan
    ``alt`` (with ``knobs``) is not more than 1% shorter: its step and change and why, each exposed
    stream that grows (the tp time hidden becomes a wait for it) and the compute it adds (the
    decomposed GEMMs), or its outcome where it has no step. The hints19 trial (Llama-3.1-70B,
    dp_shard 64 x tp 8 on 64 dgx-a100-40gb): exposed tp 4.71 s of 30.05 s, async TP 30.04 s, exposed
    fsdp 2.28 -> 5.47 s (tests/test_link_hint.py)."""
    exposed = st.exposed_s.get("tp", 0.0)
    head = (f"note: no tp hint: exposed tp is {exposed / st.step_s:.1%} of the step ({exposed:.2f} s of "
            f"{step_seconds(st.step_s)}), but {knobs} ({_runtime(framework)}) re-planned")
    if alt.step is None or alt.step_s is None:  # both None together (rebuilt_step)
        return [f"{head}: {knob_outcome(st.step_s, alt)}"]
    on: Any = alt.step  # a StepTime (Replanned types it as object)
    why = [f"exposed tp {exposed:.2f} -> {_exposed_tp(on):.2f} s"]
    grown = {k: v for k, v in on.exposed_s.items() if k != "tp" and v > st.exposed_s.get(k, 0.0) + 5e-3}
    why += [f"exposed {st.named(k)} {st.exposed_s.get(k, 0.0):.2f} -> {v:.2f} s" for k, v in grown.items()]
    extra = on.parts_s()["compute"] - st.parts_s()["compute"]
    if extra >= 5e-3:
        why.append(f"compute +{extra:.2f} s (the decomposed GEMMs and copies)")
    bound = f": the compute stream waits for {', '.join(st.named(k) for k in grown)} instead" if grown else ""
    return [f"{head} gives step {step_seconds(alt.step_s)} ({alt.step_s / st.step_s - 1:+.1%}), not {TIE:.0%} shorter: "
            f"{', '.join(why)}{bound}"]


#: The overlap's name in each runtime, where the line names the key already.
_SHORT = {"torch": "torchtitan's async TP", "megatron": "Megatron-LM's --tp-comm-overlap"}
#: Data axes that take a smaller tp's freed factor, the first present in the config's mesh.
_DATA = ("dp_shard", "dp", "dp_replicate")


def remaining(framework: str, sequence_parallel: bool) -> str:
    """What a step's exposed tp is with ``training.tp_comm_overlap`` on: the collectives the
    runtime's overlap does not decompose and the parts of the decomposed ones left on the compute
    stream (the rules of :mod:`meshplan.compute.asynctp`, :func:`~meshplan.compute.asynctp.unfused_overlap`).

    >>> remaining("torch", True).split(" (")[0]
    "torch's micro_pipeline_tp leaves the backward's input-gradient reduce-scatters of wq/wk/wv and w_gate/w_up blocking"
    """
    if not sequence_parallel:
        return "without sequence parallelism no TP collective is decomposed: its all-reduces " + (
            "block" if framework == "torch" else "overlap only their own block")
    if framework == "torch":
        return ("torch's micro_pipeline_tp leaves the backward's input-gradient reduce-scatters of wq/wk/wv and "
                "w_gate/w_up blocking (each the sum of several matmuls, not one), and each fused op's shard copy "
                "and the transfers longer than their pieces' GEMMs exposed (meshplan.compute.asynctp)")
    return ("Transformer Engine's userbuffers leave each pipelined reduce-scatter's last piece and the ring "
            "transfers longer than their pieces' GEMMs exposed (meshplan.compute.asynctp)")


def tp_moves(plan) -> list[Knob]:
    """``tp / k`` for k = 2, 4, ... (tp 1 the last), the freed factor on the first data axis of
    the mesh (none without one: the world would change)."""
    deg = plan.axis_degrees()
    tp, data = deg.get("tp", 1), next((a for a in _DATA if a in deg), None)
    out: list[Knob] = []
    k = 2
    while data is not None and tp % k == 0:
        moved = {**deg, "tp": tp // k, data: deg[data] * k}
        out.append((mesh_words(moved), {}, mesh_spec(plan, moved)))
        k *= 2
    return out


def overlapped_hint(plan, st, alternatives: Optional[Callable[..., Replanned]]) -> list[str]:
    """With ``training.tp_comm_overlap`` on and exposed tp :data:`HINT_SHARE` of the step or more:
    the ``hint:`` line of the :func:`tp_moves` that fit with a clearly shorter step (fastest first,
    :func:`~meshplan.schedule.bubble_hint.fastest`), each with its exposed tp and peak; else a
    ``note: no tp hint`` line naming what stays exposed (:func:`remaining`) and each move's
    outcome. Newcomer trial 57's new_registry.py llama3_70b (tests/test_tp_overlapped_hint.py)."""
    t = plan.config.training
    exposed = st.exposed_s.get("tp", 0.0)
    if alternatives is None or plan.mesh.degree("tp") < 2 or exposed < HINT_SHARE * st.step_s:
        return []
    head = (f"exposed tp is {exposed / st.step_s:.1%} of the step ({exposed:.2f} s of {step_seconds(st.step_s)}) "
            f"with training.tp_comm_overlap already on ({_SHORT.get(t.framework, t.framework)})")
    knobs = tp_moves(plan)
    found = fastest(st, knobs, alternatives) if knobs else []
    if not found:
        tried = (f"; none of a smaller tp re-planned fits with a step more than {TIE:.0%} shorter: "
                 + knob_outcomes(plan, st, knobs, alternatives)) if knobs else "; the mesh has no data axis to take a smaller tp's factor"
        return [f"note: no tp hint: {head}: {remaining(t.framework, plan.mesh.sequence_parallel)}{tried}"]
    items = [f"{words} (step {step_seconds(s)}, {s / st.step_s - 1:+.1%}, exposed tp {_exposed_tp(alt.step):.2f} s, "
             f"peak {alt.peak_bytes / GiB:.1f} GiB fits)" for s, words, alt in found]
    return [HintLine(f"hint: {head}: shorter with " + "; ".join(items),
                     Hint("tp", exposed / st.step_s, tuple(knob_of(words, alt) for _, words, alt in found)))]
