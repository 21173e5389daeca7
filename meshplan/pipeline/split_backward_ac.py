"""Torch's split-backward (zero-bubble) pipeline schedules, zb_h1, zbv and dualpipev
(:attr:`~meshplan.pipeline.base.PipelineSchedule.splits_backward`), under activation checkpointing:
the one source of what plan, step, compare, export and search say of the combination.

- :data:`SPLIT_BACKWARD_AC`, :func:`split_backward_ac_warning` and its opening words
  :func:`split_backward_ac_head`: what torch is reported to do (torchtitan issue #773, pytorch
  issue #136766), printed by plan and step (:func:`meshplan.plan_runtime.runtime_warnings`), the
  search's split-AC note and row warning, and left out by the bubble hint.
- :func:`w_replay_words`: what the step counts of it under each recompute.
- :data:`OP_AC_RAISES` and :func:`op_ac_raises`: op-level selective AC raised in W under torch 2.13,
  the search's rule ``split-op`` (:mod:`meshplan.search.reasons`).

Pure functions of a :class:`~meshplan.spec.training.TrainingSpec`, a schedule name and pp; no torch.
"""

from __future__ import annotations

from meshplan.interop.torchtitan_tables import write_recompute
from meshplan.pipeline.registry import get as get_schedule

#: What torch's split-backward (zero-bubble) schedules are reported to do with activation
#: checkpointing: pytorch/torchtitan issue #773 (open, labelled bug and release_blocking;
#: tianyu-l, 2025-01-03: on 512 GPUs Interleaved1F1B 128 tokens/s per GPU at 33.9% MFU,
#: InterleavedZeroBubble 13 at 3.4% and 89.7 GiB, 94% of HBM; H-Huang, 2025-01-13: slower only
#: with AC, fine without) and pytorch/pytorch issue #136766 (closed; zero bubble with AC ran out of
#: memory before one step, ``stage_backward_input`` keeping the recomputed graph; pytorch PR #138119
#: detaches the output and loss, 50% less memory with AC on a 7B model). No fix of #773's
#: slowdown is reported, so a torch 2.13 run is taken to show it.
SPLIT_BACKWARD_AC = ("torch's zero-bubble schedules with activation checkpointing are reported far slower than "
                     "interleaved 1F1B (torchtitan issue #773, open: 13 vs 128 tokens/s per GPU on 512 GPUs, "
                     "slower only with AC) and have run out of memory (pytorch issue #136766, closed by "
                     "pytorch PR #138119)")


def split_backward_ac_warning(training, schedule, pp: int) -> tuple[str, ...]:
    """One line when framework torch runs a schedule that splits the backward
    (:attr:`~meshplan.pipeline.base.PipelineSchedule.splits_backward`: zb_h1, zbv, dualpipev) at
    pp > 1 under activation checkpointing, i.e. a torchtitan ``[activation_checkpoint] mode`` other
    than none (:func:`~meshplan.interop.torchtitan_tables.write_recompute`: full, layer, op, and
    selective without flash attention): :data:`SPLIT_BACKWARD_AC`, then what the plan's step counts of
    it (:func:`w_replay_words`), then the fix: under recompute op, where torch 2.13 raised in W
    (:func:`op_ac_raises`, the predicate of the search's rule ``split-op``), that the search rejects
    the mesh under that rule and :data:`SPLIT_OP_FIX`; otherwise recompute none or interleaved 1F1B.
    The bubble hint leaves these schedules out then (:mod:`meshplan.schedule.bubble_hint`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="full")
    >>> len(split_backward_ac_warning(t, "zb_h1", 4)), split_backward_ac_warning(t, "interleaved_1f1b", 4)
    (1, ())
    >>> split_backward_ac_warning(t.model_copy(update={"recompute": "selective"}), "zbv", 4)  # flash: mode none
    ()
    >>> print(split_backward_ac_warning(t.model_copy(update={"recompute": "op"}), "zbv", 4)[0].split("group); ")[1])
    meshplan search rejects this mesh (rule 'split-op'); set recompute = "full" or "layer" (or "none" if memory allows), or a schedule that does not split the backward (1f1b, interleaved_1f1b)
    """
    head = split_backward_ac_head(training, schedule, pp)
    if head is None:
        return ()
    raises = op_ac_raises(training.framework, pp, get_schedule(schedule).splits_backward, training.recompute == "op")
    fix = SPLIT_OP_FIX if raises else "set recompute = \"none\" if memory allows, or use interleaved_1f1b"
    return (f"{head}: {SPLIT_BACKWARD_AC}; {w_replay_words(training)}; {fix}",)


#: The end of :func:`split_backward_ac_warning` where :func:`op_ac_raises` holds: the search's rule
#: (:mod:`meshplan.search.reasons`, ``split-op``) and the settings torch 2.13 runs instead: full or
#: per-layer AC (they run, W replaying each checkpointed layer's forward: :func:`w_replay_words`), no
#: AC, or a schedule whose backward is one autograd call (gpipe, 1f1b, interleaved_1f1b). The search's
#: own fix line says the same in its terms (:mod:`meshplan.report.search_fix`).
SPLIT_OP_FIX = ("meshplan search rejects this mesh (rule 'split-op'); set recompute = \"full\" or \"layer\" (or "
                "\"none\" if memory allows), or a schedule that does not split the backward (1f1b, interleaved_1f1b)")


#: Why the search rejects a row with op-level selective AC (recompute ``op``) under a schedule that splits
#: the backward (rule ``split-op``, :func:`op_ac_raises`): measured on torch 2.13 CPU (two checkpointed
#: runtime Blocks, torchtitan's op policy), ``stage_backward_weight`` runs one autograd.grad per parameter
#: group and raised at the second; AReaL PR #916 (areal-project/AReaL, 2026-02) disables op-level AC for
#: V-style schedules as incompatible with split backward.
OP_AC_RAISES = ("zbv, dualpipev or zb_h1 with recompute op (torchtitan selective_ac_option \"op\") under framework "
                "torch: torch 2.13 raised in W (\"Trying to backward an extra time ... selective activation "
                "checkpoint\", measured on CPU: W runs one autograd.grad per parameter group, selective "
                "checkpointing serves one recompute)")


def op_ac_raises(framework, pp, splits_backward, op):
    """Whether torch 2.13 raises in W (:data:`OP_AC_RAISES`): framework torch, pp > 1, a schedule
    that splits the backward (:attr:`~meshplan.pipeline.base.PipelineSchedule.splits_backward`) and
    recompute op; ints and bools, or arrays of them (the search's rule ``split-op`` over its columns).

    >>> op_ac_raises("torch", 2, True, True), op_ac_raises("torch", 1, True, True), op_ac_raises("megatron", 2, True, True)
    (True, False, False)
    """
    return (framework == "torch") & (pp > 1) & splits_backward & op


def w_replay_words(training) -> str:
    """What a split-backward plan's step counts of torchtitan issue #773's slowdown under
    ``training``'s recompute (:data:`SPLIT_BACKWARD_AC`), as measured on torch 2.13 CPU (two
    checkpointed runtime Blocks, :func:`meshplan.memory.wlag.weight_groups`): eager torch with full or
    per-layer AC replays a checkpointed layer's forward once per parameter group in W, which the step
    times (:func:`meshplan.schedule.backward_pass._w_replays`); op-level AC raised in W ("Trying to
    backward an extra time ... selective activation checkpoint": selective checkpointing's cache
    serves one recompute); compiled, and Megatron-LM's selective (torchtitan mode full without flash
    attention, planned as selective), were not measured and get no replays.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="op")
    >>> "raised in W" in w_replay_words(t), "9 for a Llama layer" in w_replay_words(t.model_copy(update={"recompute": "full"}))
    (True, True)
    """
    if training.recompute == "op":
        return ("the predicted step is the schedule's, but torch 2.13 raised in W under op-level AC (\"Trying to "
                "backward an extra time\": selective checkpointing serves one recompute, W runs one per parameter "
                "group)")
    if training.recompute in ("full", "layer") and not training.torch_compile:
        return ("the predicted step counts one cause measured on torch 2.13 (each W replays a checkpointed layer's "
                "forward once per parameter group, 9 for a Llama layer), no other")
    return ("the predicted step is the schedule's without that slowdown (W's forward replays, measured on eager "
            "torch under full AC, not counted here)")


def split_backward_ac_head(training, schedule, pp: int) -> str | None:
    """The words :func:`split_backward_ac_warning` opens with (the schedule, the recompute and its
    torchtitan mode, the framework), None where it has no line; ``meshplan search``'s warning on
    its row 1 uses them alone, its note holding :data:`SPLIT_BACKWARD_AC`.

    >>> from meshplan.spec.training import TrainingSpec
    >>> print(split_backward_ac_head(TrainingSpec(global_batch=8, seq_len=16, recompute="op"), "dualpipev", 2))
    dualpipev with activation checkpointing (recompute 'op': torchtitan activation_checkpoint.mode = "selective") under framework torch
    """
    sched = get_schedule(schedule)
    # framework torch, pp > 1 and a split backward: op_ac_raises's own condition, asked at recompute op
    # (the AC mode is checked next), so the warning and the search's rule split-op hold one verdict
    if not op_ac_raises(training.framework, pp, sched.splits_backward, True):
        return None
    mode = write_recompute(training)["mode"]
    if mode == "none":
        return None
    return (f"{sched.name} with activation checkpointing (recompute {training.recompute!r}: torchtitan "
            f"activation_checkpoint.mode = \"{mode}\") under framework torch")
