"""The ``hint:`` line of a step whose device waits for the host (eager DTensor TP: each block
issued through DTensor's Python dispatch at the host's measured pace, kernels.toml ``[host]``;
:meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`): when that wait holds
:data:`~meshplan.schedule.verdict.HINT_SHARE` of the step or more, the same config re-planned
under ``training.torch_compile = true`` (torchtitan's ``[compile]``: compiled blocks trace
DTensor away and fuse the elementwise ops), with its step and peak where it fits with a step shorter
by more than :data:`~meshplan.spec.search.TIE` (1%, :func:`~meshplan.schedule.verdict.clearly_faster`,
the rule of every ``hint:`` line), else why it does not fit or that it is not that much shorter."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from meshplan.schedule.hint_facts import Hint, HintLine, knob_of
from meshplan.schedule.verdict import HINT_SHARE, Replanned, clearly_faster
from meshplan.spec.search import TIE
from meshplan.units import GiB, step_seconds


def host_hint(plan, st, alternatives: Optional[Callable[[dict], Replanned]]) -> list[str]:
    """``hint:`` line for ``st`` (a :class:`~meshplan.schedule.step_summary.StepTime` of ``plan``)
    whose critical stage waits :data:`HINT_SHARE` of the step or more for the host's issue; none
    otherwise or without ``alternatives`` (:func:`~meshplan.schedule.verdict.rebuilt_step`).
    examples/mini_2x4_tp4-dp2.toml (Llama-3-8B, dp_shard 2 x tp 4, eager): 2.22 s of a 10.46 s
    step (21.2%); compiled, 7.93 s (tests/test_host_pace.py)."""
    wait = st.host_wait_s()
    if alternatives is None or wait < HINT_SHARE * st.step_s or plan.config.training.torch_compile:
        return []
    alt = alternatives({"torch_compile": True})
    head = (f"hint: the device waits {wait:.2f} s of the {step_seconds(st.step_s)} step ({wait / st.step_s:.1%}) for the host "
            f"to issue eager DTensor TP's blocks")
    none = Hint("host", wait / st.step_s)  # the line names no knob that helps
    if alt.step_s is None:
        return [HintLine(f"{head}; training.torch_compile = true: {alt.text}", none)]
    if not clearly_faster(st.step_s, alt.step_s):
        return [HintLine(f"{head}; training.torch_compile = true is not more than {TIE:.0%} shorter (step "
                         f"{step_seconds(alt.step_s)}, {alt.step_s / st.step_s - 1:+.1%}: within the {TIE:.0%} tie "
                         f"threshold)", none)]
    return [HintLine(f"{head}; training.torch_compile = true (compiled blocks: DTensor traced away, elementwise ops fused): "
                     f"step {step_seconds(alt.step_s)} ({alt.step_s / st.step_s - 1:+.1%}), peak {alt.peak_bytes / GiB:.1f} "
                     f"GiB fits", replace(none, knobs=(knob_of("training.torch_compile = true", alt),)))]
