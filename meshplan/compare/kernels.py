"""The compute a framework's kernel choices add to a step, itemised for ``meshplan compare``.

Two plans under different frameworks (``training.framework`` torch against megatron, or
torch with and without ``torch_compile``) run different kernels for the same model: the fused
attention (torch's ``scaled_dot_product_attention`` runs FlashAttention-2 on an H100,
Megatron-LM / Transformer Engine the catalog's first kernel, FlashAttention-3), Q, K and V as
one GEMM, the weight-gradient accumulation inside the GEMM, Megatron-LM's own kernels around
the GEMMs, torch's eager elementwise ops and norms, torch's sequence-parallel layout copies,
torch's context-parallel ring attention's merges (:mod:`meshplan.compute.ring_attention`):
the :class:`~meshplan.compute.ops.Workload` fields that
:func:`~meshplan.compute.kernel_choices.framework_kernels` sets, and with ``training.tp_comm_overlap`` whose
decomposed TP GEMMs run (``async_tp``, :mod:`meshplan.compute.asynctp`) (:data:`CHOICES`, its keys).

Each choice's seconds are counterfactual and add up: on plan B (its mesh, stages and
micro-batches), B's workload with A's value of every differing choice, then each choice
switched to B's value in :data:`CHOICES` order; a choice's seconds are the change it makes to
the compute of B's critical stage per step (every op of its layers, embedding, head and
Megatron-LM's batch ops, times the micro-batches: :func:`stage_compute_s`), so the lines sum
to the compute those choices move (positive: B's choice is slower). Llama-3-70B at 128k
tokens on dp_shard 2 x cp 8 x tp 8 (tests/test_compare.py): torch 126.0 s against
Megatron-LM 85.0 s, of whose 40.2 s of compute the attention kernel (FA2 333/318 TFLOP/s
against FA3 602/559 at S 8192, ``meshplan/catalog/kernels.toml``) is most, 32.4 s.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import MDS_KERNELS
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.units import MS

#: The per-framework compute choices (:func:`meshplan.compute.kernel_choices.framework_kernels`'s
#: fields) and what each is, in words.
CHOICES: dict[str, str] = {
    "attention_kernels": "attention kernel",
    "fused_qkv": "Q, K and V projected by one GEMM (Megatron-LM; torchtitan b5bcd76's wqkv)",
    "fp32_wgrad_accumulation": "weight gradients accumulated into fp32 inside the GEMM (Megatron-LM's "
                               "gradient_accumulation_fusion)",
    "megatron_ops": "Megatron-LM's own kernels around the GEMMs",
    "torch_eager": "elementwise ops one kernel each (torch without torch_compile)",
    "decomposed_norm": "RMSNorm kernel by kernel (torch_norm decomposed, not compiled)",
    "eager_loss": "the loss eager (not compiled)",
    "decomposed_head_norm": "the final norm kernel by kernel (torch_norm decomposed)",
    "sp_layout_copies": "torch's sequence-parallel layout copies",
    "te_ring_attention": "Transformer Engine's p2p ring attention (one call per ring step, each rated at its shape, and its correction kernels)",
    "torch_ring_attention": "torch's context-parallel ring attention (fp32 merges and gradient sums)",
    "async_tp": "TP GEMMs decomposed to overlap their collectives (tp_comm_overlap)",
}


def stage_compute_s(plan, w: Workload, stage: int) -> float:
    """Seconds of compute of ``stage`` per step under workload ``w``: every op of its chunks'
    layers, embedding, head and batch ops (:func:`~meshplan.schedule.workload.chunk_costs`)
    per micro-batch, times ``plan.micro_batches``."""
    per_mb = 0.0
    for ch in chunk_costs(plan, w)[stage]:
        per_mb += sum(c.seconds() for c in ch.layers)
        per_mb += sum(c.seconds() for c in (ch.embed, ch.head, ch.batch) if c is not None)
    return per_mb * plan.micro_batches


def choice_seconds(side_a, side_b) -> list[tuple[str, float]]:
    """(choice, seconds B's value adds to B's critical-stage compute against A's) for every
    :data:`CHOICES` field whose value differs between the two sides' workloads, telescoped
    (module docstring); empty unless both sides resolved a step."""
    if side_a.step is None or side_b.step is None:
        return []
    wa, wb = workload_of(side_a.plan), workload_of(side_b.plan)
    fields = [f for f in CHOICES if getattr(wa, f) != getattr(wb, f)]
    if not fields:
        return []
    stage = side_b.step.critical_stage
    w = replace(wb, **{f: getattr(wa, f) for f in fields})
    before, out = stage_compute_s(side_b.plan, w, stage), []
    for f in fields:
        w = replace(w, **{f: getattr(wb, f)})
        after = stage_compute_s(side_b.plan, w, stage)
        out.append((f, after - before))
        before = after
    return out


def attention_kernel(side) -> str:
    """The fused-attention kernel ``side``'s plan runs (FA2, FA3 ...: the catalog row its
    attention op's note names), or its workload's preference when no catalog row is used."""
    w = workload_of(side.plan)
    for ch in chunk_costs(side.plan, w)[side.step.critical_stage]:
        for c in ch.layers:
            for o in c.ops:
                if o.kind == "attention" and o.note.startswith("fwd "):
                    return o.note.split()[1]
    return "/".join(w.attention_kernels) or "catalog order"


def _value(side, field: str) -> str:
    """A choice's value on ``side``: the attention kernel by name (and whose), else on/off."""
    if field == "attention_kernels":
        kernels = workload_of(side.plan).attention_kernels
        who = ("Megatron-DeepSpeed's flash-attn 2 (--use-flash-attn-v2)" if kernels == MDS_KERNELS
               else "torch's scaled_dot_product_attention" if kernels else "Transformer Engine's fused attention")
        return f"{attention_kernel(side)} ({who})"
    v: Any = getattr(workload_of(side.plan), field)
    if field == "async_tp":  # the framework whose decomposition runs (meshplan.compute.asynctp)
        return {"torch": "torch's micro_pipeline_tp", "megatron": "Transformer Engine's userbuffers"}.get(v, "no")
    return "yes" if v else "no"


def choice_lines(side_a, side_b, floor_s: float) -> list[tuple[float, str]]:
    """(|seconds|, line) of every choice whose seconds reach ``floor_s``: ``attention kernel:
    torch FA2 (torch's scaled_dot_product_attention), megatron FA3 (Transformer Engine's fused
    attention) (-27718.4 ms of compute)``."""
    out = []
    for f, s in choice_seconds(side_a, side_b):
        if abs(s) >= floor_s:
            out.append((abs(s), f"{CHOICES[f]}: {side_a.name} {_value(side_a, f)}, {side_b.name} "
                                f"{_value(side_b, f)} ({s / MS:+.1f} ms of compute)"))
    return out
