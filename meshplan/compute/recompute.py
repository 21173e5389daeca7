"""What a recompute policy replays in a layer's backward (:mod:`meshplan.compute.ops`'
conventions): a forward op re-run (:func:`replay`), the GEMMs torchtitan's op-level selective AC
saves (:func:`op_sac_kept`), the ops full AC leaves out (:func:`full_ac_not_replayed`), and
torchtitan's per-layer AC as a per-layer policy (:func:`layer_workload`).
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.compute import float8, ring_attention
from meshplan.compute.ops import Op, Workload
from meshplan.spec.model import ModelSpec


def replay(o: Op) -> Op:
    """Forward op ``o`` re-run in backward by recompute: ``replace(o, name=o.name + " (recompute)",
    phase="backward_input", model_flops=0.0, recompute=True)``, built directly (a layer has
    dozens, the search asks thousands of layers)."""
    return Op(name=o.name + " (recompute)", block=o.block, phase="backward_input", kind=o.kind, seconds=o.seconds,
              model_flops=0.0, hardware_flops=o.hardware_flops, size_bytes=o.size_bytes, recompute=True, note=o.note,
              steps=o.steps)


#: Forward GEMMs of a layer whose outputs torchtitan's op-level selective AC saves (the
#: odd-numbered mms of a Llama block: wq, wk, wv, wo, w1 gate, w3 up, w2 down; GeLU MLP: w_up,
#: w_down), kept by :func:`meshplan.memory.activations.op_sac_terms`.
OP_SAC_SAVED_GEMMS = ("wq", "wv", "w_gate", "w_down")
OP_SAC_SAVED_GEMMS_GELU = ("wq", "wv", "w_up")
#: Forward kernels op-level AC does not replay beside the saved GEMMs and SDPA: async TP's
#: partial sum is part of the fused GEMM + reduce-scatter, whose output the policy saves; the
#: float8 amaxes, whose ``aten.abs`` and ``aten.max`` outputs torchtitan's ``_save_list`` saves
#: "for low precision training" (9dec370 ``parallelisms/parallelize_llama.py``); torch CP's ring
#: merge, inside the SDPA op whose output the policy saves.
OP_SAC_NOT_REPLAYED = ("async-TP partial sum", float8.AMAX, ring_attention.MERGE)


def full_ac_not_replayed(w: Workload) -> tuple[str, ...]:
    """Forward ops of a dense layer that torch's full AC does not replay: what only feeds the
    MLP's closing reduce-scatter, which the backward never needs (the block's output goes to the
    next layer, and the reduce-scatter's and the residual add's backward need no saved tensor).
    Eager (``torch_eager``): ``torch.utils.checkpoint`` non-reentrant stops the replay once the
    last saved tensor is recomputed ("early stop", on by default; torchtitan 820504e's
    ``ptd_checkpoint_wrapper``), after w_down's mm saved its input: w_down runs, its scatter's
    layout copy and the reduce-scatter do not. Compiled: AOTAutograd's min-cut partitioner puts
    in the backward graph only the recomputed nodes the backward reads, so w_down's GEMM, async
    TP's partial sum after it and the copy go too. Megatron-LM's ``CheckpointFunction`` re-runs the
    whole layer: nothing is left out. The timeline leaves the replayed MLP's closing collective
    out likewise (:func:`meshplan.schedule.layer_timeline.replay_scatters`).

    >>> full_ac_not_replayed(Workload(seq_len=8, megatron_ops=True))
    ()
    >>> full_ac_not_replayed(Workload(seq_len=8, torch_eager=True))
    ('SP layout copy (scatter, mlp)', 'async-TP partial sum (w_down)')
    >>> full_ac_not_replayed(Workload(seq_len=8))[-1]
    'w_down'
    """
    if w.megatron_ops:
        return ()
    return ("SP layout copy (scatter, mlp)", "async-TP partial sum (w_down)") + (() if w.torch_eager else ("w_down",))


def op_sac_kept(model: ModelSpec) -> tuple[str, ...]:
    """Forward GEMMs whose outputs torchtitan's op-level selective AC saves, so its recompute
    skips them (:func:`meshplan.memory.activations.op_sac_terms`); the attention kernel is
    saved too. Everything else of the forward is recomputed in backward."""
    return OP_SAC_SAVED_GEMMS if model.gated_mlp else OP_SAC_SAVED_GEMMS_GELU


def layer_workload(w: Workload, checkpointed: bool) -> Workload:
    """The workload of one layer under torchtitan's per-layer AC (``recompute = "layer"``):
    ``full`` for a checkpointed layer, ``none`` otherwise; other policies unchanged."""
    return replace(w, recompute="full" if checkpointed else "none") if w.recompute == "layer" else w
