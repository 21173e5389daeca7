"""The FSDP knobs the step's verdict (``cause:``), its FSDP hint and the link hint re-plan, from
:mod:`meshplan.schedule.verdict` (moved out by nc22fix to keep it under 400 lines): the micro-batches
per step (``global_batch / (micro_batch x dp)``) multiply every layer's all-gather (twice with
``training.reshard_after_forward = true``) and, without a pipeline, its gradient reduce-scatter; the
knobs are ``training.grad_accumulation``, ``training.reshard_after_forward = false`` and a larger
``training.micro_batch``; under DeepSpeed's ZeRO-3 with ``zero_optimization.overlap_comm`` false
(``training.overlap_comm = false``: every all-gather and reduce-scatter on the default stream,
:attr:`~meshplan.spec.training_engines.TrainingEngines.overlaps_comm`) also ``overlap_comm = true``
(newcomer trial 23: the hint named only the micro-batch, 16.23 s, where overlap_comm gave 14.71 s).
"""

from __future__ import annotations

from typing import Optional

from meshplan.plan import Plan
from meshplan.units import counted


def fsdp_knobs(plan: Plan, stream: str) -> Optional[tuple[str, list[tuple[str, dict]]]]:
    """(the cause line, the knobs as (its words, the ``training`` update)) for ``stream``'s
    collectives when they are FSDP's re-gathered every micro-batch without a pipeline (module
    docstring); None otherwise. One list for the verdict and the hint, so both re-plan the same."""
    t, m = plan.config.training, plan.micro_batches
    if stream not in ("fsdp", "efsdp") or t.sharding not in ("zero3", "hsdp") or m < 2:
        return None
    if len(plan.stages) > 1:
        return _pipelined_fsdp_knobs(plan)
    gathers = "all-gathered in forward and again in backward (training.reshard_after_forward = true)" \
        if t.reshard_after_forward else "all-gathered in forward (kept for backward: reshard_after_forward = false)"
    mode: str = t.grad_accumulation
    if mode == "no_sync_unsharded":
        gathers = gathers.replace("all-gathered in forward", "all-gathered in micro-batch 0's forward")
    reduce = "once per micro-batch" if mode == "sync" else f"once per step (training.grad_accumulation = {mode})"
    line = (f"cause: FSDP re-gathers per micro-batch: each layer is {gathers} and its gradients reduce-scattered "
            f"{reduce}, {counted(m, 'micro-batch')} per step (global_batch {t.global_batch} / (micro_batch "
            f"{t.micro_batch} x dp {plan.mesh.dp}))")
    knobs: list[tuple[str, dict]] = []
    if t.zero3_engine == "deepspeed":  # DeepSpeed's ZeRO-3: per-layer calls, none of FSDP2's knobs
        line = (f"cause: DeepSpeed ZeRO-3 all-gathers each layer's parameters in forward and again in backward and "
                f"reduce-scatters its gradients, each micro-batch, {counted(m, 'micro-batch')} per step")
        mode = ""
        if not t.overlaps_comm:  # its gathers and reduce-scatters on the default stream: overlap them
            knobs.append(("training.overlap_comm = true", {"overlap_comm": True}))
    if t.zero3_engine == "deepspeed-2021":  # DeepSpeed 2021: per-parameter calls, none of FSDP2's knobs
        grads = "reduce-scatters every gradient" if t.contiguous_grads else "all-reduces every gradient in buckets"
        line = (f"cause: DeepSpeed ZeRO-3 (2021) all-gathers every parameter tensor in forward and again in backward "
                f"and {grads}, each micro-batch, {counted(m, 'micro-batch')} per step")
        knobs.append(('training.zero3_engine = "fsdp2" (per-layer coalesced calls, as DeepSpeed >= v0.5.5)',
                      {"zero3_engine": "fsdp2"}))
        mode = ""
    for other in {"sync": ("no_sync", "no_sync_unsharded"), "no_sync": ("no_sync_unsharded",)}.get(mode, ()):
        knobs.append((f'training.grad_accumulation = "{other}"', {"grad_accumulation": other}))
    if t.reshard_after_forward and t.zero3_engine == "fsdp2":
        knobs.append(("training.reshard_after_forward = false", {"reshard_after_forward": False}))
    if t.global_batch % (2 * t.micro_batch * plan.mesh.dp) == 0:
        knobs.append((f"training.micro_batch = {2 * t.micro_batch}", {"micro_batch": 2 * t.micro_batch}))
    return line, knobs


def _pipelined_fsdp_knobs(plan: Plan) -> Optional[tuple[str, list[tuple[str, dict]]]]:
    """:func:`fsdp_knobs` under a pipeline (FSDP2 only): each chunk's layers all-gathered per
    micro-batch, their gradients reduce-scattered after the chunk's last backward (torchtitan's
    schedules, ``perform_reduce_grad``), so the knobs are ``reshard_after_forward = false`` and a larger
    micro-batch (newcomer trial 22: the hint stayed silent at 24% exposed fsdp under pp 16)."""
    t, m = plan.config.training, plan.micro_batches
    if t.zero3_engine != "fsdp2":
        return None
    gathers = "in forward and again in backward (training.reshard_after_forward = true)" \
        if t.reshard_after_forward else "in forward (kept for backward: reshard_after_forward = false)"
    line = (f"cause: FSDP under pp {len(plan.stages)}: each chunk's layers are all-gathered {gathers} for each of "
            f"{counted(m, 'micro-batch')} per step, their gradients reduce-scattered once per step after the chunk's "
            f"last backward")
    knobs: list[tuple[str, dict]] = []
    if t.reshard_after_forward:
        knobs.append(("training.reshard_after_forward = false", {"reshard_after_forward": False}))
    if t.global_batch % (2 * t.micro_batch * plan.mesh.dp) == 0:
        knobs.append((f"training.micro_batch = {2 * t.micro_batch}", {"micro_batch": 2 * t.micro_batch}))
    return line, knobs


def one_batch_knobs(plan: Plan, stream: str) -> Optional[tuple[str, list[tuple[str, dict]]]]:
    """(why the knobs of :func:`fsdp_knobs` do not apply, the knobs that still do) for ``stream``'s
    FSDP collectives at 1 micro-batch per step, where :func:`fsdp_knobs` has none (newcomer trial
    55 #4: Mixtral-8x7B at dp_shard 8 x tp 8 exposed 15.8% of its step on fsdp and ``step`` said
    nothing); None otherwise. At 1 micro-batch each layer is all-gathered once per forward and its
    gradients reduce-scattered once per step whatever ``grad_accumulation`` (nothing to accumulate),
    and a larger micro_batch is refused (``global_batch = micro_batch x dp`` already). What still
    applies: ``reshard_after_forward = false`` under FSDP2 where it is true (the backward
    all-gather of each layer dropped, its parameters kept gathered from forward to backward), and
    DeepSpeed's ``overlap_comm = true`` or FSDP2's per-layer calls for the DeepSpeed engines, as
    :func:`fsdp_knobs`; a mesh with a smaller shard group (HSDP) is the search's."""
    t = plan.config.training
    if stream not in ("fsdp", "efsdp") or t.sharding not in ("zero3", "hsdp") or plan.micro_batches != 1:
        return None
    knobs: list[tuple[str, dict]] = []
    if t.zero3_engine == "deepspeed" and not t.overlaps_comm:
        knobs.append(("training.overlap_comm = true", {"overlap_comm": True}))
    if t.zero3_engine == "deepspeed-2021":
        knobs.append(('training.zero3_engine = "fsdp2" (per-layer coalesced calls, as DeepSpeed >= v0.5.5)',
                      {"zero3_engine": "fsdp2"}))
    if t.reshard_after_forward and t.zero3_engine == "fsdp2":
        knobs.append(("training.reshard_after_forward = false", {"reshard_after_forward": False}))
    why = (f"training.grad_accumulation and a larger training.micro_batch do not apply at 1 micro-batch (global_batch "
           f"{t.global_batch} = micro_batch {t.micro_batch} x dp {plan.mesh.dp}: one reduce-scatter per step already, "
           f"no larger micro-batch divides the batch); a smaller shard group (HSDP) is meshplan search's")
    return why + ("" if knobs else "; no other knob applies"), knobs
