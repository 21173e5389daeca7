"""Transformer Engine's userbuffers on one rank under Megatron-LM's ``--tp-comm-overlap``
(``training.tp_comm_overlap`` with framework megatron, sequence parallelism, tp > 1; newcomer
trial 49 finding 4): allocated once at start-up, outside PyTorch's caching allocator, held for
the run (the memory timeline's init, kind ``userbuffers``: :func:`entry`).

**Shape** (NVIDIA/Megatron-LM d98e8a6 ``megatron/training/initialize.py:217-246``):
``initialize_ub(shape=[seq_length x micro_batch_size / context_parallel_size, hidden_size],
tp_size, quantization_modes=[FP8 if args.fp8 else NONE])``, no ``dtype`` (TE's default
``torch.bfloat16``) and, without ``--tp-comm-overlap-cfg``, no ``ub_cfgs``.

**Buffers** (NVIDIA/TransformerEngine d0067d0 ``transformer_engine/pytorch/module/base.py``
``initialize_ub``): one communicator, each with its own buffer, per GEMM pass of the default
``methods`` (lines 350-360): ring_exchange qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad; pipeline
proj_fprop, fc2_fprop; bulk qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad; external proj_wgrad,
fc2_wgrad: 12 (:data:`AG_PASSES` + :data:`RS_PASSES`). Each buffer's dtype (lines 472-476) is
uint8 where the fp8 mode is on and ``fp8_buf``, by default ``name in layers_all_gather_overlap``
(lines 336-345, 391: the 8 all-gather passes), else bf16. Its bytes
(``common/comm_gemm_overlap/comm_gemm_overlap.cpp``): ``CommOverlapBase::initialize`` (pipeline,
bulk, external; lines 410-425) registers ``shape[0] x shape[1]`` elements; ``CommOverlapP2PBase``
(ring_exchange; lines 805-828) the same for an all-gather (tp chunks of shape[0] / tp rows), and
``(2 tp - 1) / tp`` of it for a reduce-scatter, which no default ring_exchange pass is
(``register_user_buffer_collective`` rounds up to the allocation granularity: not modelled).

Llama-3-70B, seq 8192, micro-batch 1, cp 1 (h 8192): 8192 x 8192 = 67,108,864 elements a buffer;
bf16 12 x 2 B = 1,610,612,736 B (1.5 GiB); with fp8 8 x 1 B + 4 x 2 B = 1,073,741,824 B (1 GiB):

>>> ub_bytes(8192, 1, 1, 8192, False), ub_bytes(8192, 1, 1, 8192, True)
(1610612736, 1073741824)

Not modelled: a ``--tp-comm-overlap-cfg`` YAML's methods and ``fp8_buf`` (the import notes it),
Megatron-LM's second communicator set under ``--first-last-layers-bf16`` with fp8 (lines 230-236).
"""

from __future__ import annotations

from meshplan.units import human_bytes

#: The all-gather GEMM passes (``layers_all_gather_overlap``): uint8 buffers under fp8.
AG_PASSES = ("qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc2_dgrad", "fc2_wgrad")
#: The reduce-scatter GEMM passes (``layers_reduce_scatter_overlap``): bf16 buffers.
RS_PASSES = ("proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad")
#: TE's ``initialize_ub`` ``dtype`` default (bf16), what Megatron-LM leaves it at; uint8 under fp8.
BF16_BYTES, FP8_BYTES = 2, 1


def ub_bytes(seq_len, micro_batch, cp, hidden, fp8: bool):
    """Bytes of one rank's userbuffers (module docstring): ``(seq_len x micro_batch / cp) x
    hidden`` elements a buffer, :data:`RS_PASSES` in bf16, :data:`AG_PASSES` in bf16, or uint8
    under ``fp8``. Scalars or numpy arrays (the search's candidates)."""
    each = (seq_len * micro_batch // cp) * hidden
    return each * (len(RS_PASSES) * BF16_BYTES + len(AG_PASSES) * (FP8_BYTES if fp8 else BF16_BYTES))


def allocated(training, tp: int, sp: bool) -> bool:
    """Whether Megatron-LM runs ``initialize_ub`` for the plan: framework megatron with
    ``tp_comm_overlap`` (which Megatron-LM asserts only with sequence parallelism, ``arguments.py:1441-1442``)
    at tp > 1 under sequence parallelism ``sp``."""
    return training.framework == "megatron" and training.tp_comm_overlap and sp and tp > 1


def entry(model, training, mesh) -> tuple:
    """The memory timeline's init entry of the rank's userbuffers (kind ``userbuffers``), none
    where :func:`allocated` says Megatron-LM runs none."""
    if not allocated(training, mesh.degree("tp"), mesh.sequence_parallel):
        return ()
    fp8 = training.linear_dtype == "fp8"
    cp = mesh.degree("cp")
    rows = training.seq_len * training.micro_batch // cp
    n = ub_bytes(training.seq_len, training.micro_batch, cp, model.hidden, fp8)
    ag = f"{len(AG_PASSES)} all-gather in {'uint8' if fp8 else 'bf16'}"
    return ((None, "userbuffers", n, f"Transformer Engine userbuffers (--tp-comm-overlap): {ag} + {len(RS_PASSES)} "
             f"reduce-scatter in bf16, each [{rows:,}, {model.hidden:,}] (initialize_ub's defaults): "
             f"{human_bytes(n)}"),)
