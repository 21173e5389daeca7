"""The pp rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
the pipeline's sends and receives, Megatron-LM's scatter/gather of them over tp, and the tied
embedding's gradient all-reduce between the first and last stage.

- PP: per micro-batch, one send of the activation for every chunk that is not the model's
  last and one receive for every chunk that is not its first (``2 vpp - first - last``), in
  forward, and the same for gradients in backward. The tensor sent is the residual stream as
  the TP plan leaves it between layers: a plain tensor (row-parallel outputs are local), so
  with SP each tp rank sends its own sequence shard (b * s/tp * h) to its peer of the next
  stage, and without SP every tp rank sends the whole (b, s, h) activation (no Megatron
  scatter/gather across tp): measured with ``torch.distributed.pipelining`` 2.13.
  With cp the activation is this rank's b * s/cp * h (its two chunks; /tp under SP).
- Tied embeddings with pp > 1 (embedding on the first stage, its copy as the output layer on
  the last): once per step, after the schedule, the two copies' gradients are all-reduced
  (sum) over the embedding group, the first and last rank of a pp group (Megatron-LM
  ``finalize_model_grads._allreduce_word_embedding_grads``); the buffer is the rank's local
  gradient (:func:`_tied_grad_bytes`), since FSDP2 has already reduced it over the data axes
  (``meshplan.runtime.execution.pipelined_stage``, measured with torch 2.13 on gloo).
"""

from __future__ import annotations

from meshplan.comm.stage_context import StageContext
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import fsdp_padded_numel, padded_vocab
from meshplan.pipeline.registry import get as get_schedule
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


def pp_rows(add, c: StageContext) -> None:
    """The stage's pp rows (the table's builder for pp; none with pp 1): the sends and receives
    of each micro-batch (:meth:`~meshplan.pipeline.base.PipelineSchedule.p2p_per_microbatch`),
    under Megatron-LM's scatter/gather (:func:`scatter_gather`) 1/tp of the activation each
    and a tp all-gather per receive, and the tied embedding's gradient all-reduce."""
    t, mesh, m = c.training, c.mesh, c.model
    dt = t.compute_dtype
    pp = mesh.degree("pp")
    if pp <= 1:
        return
    tp = mesh.degree("tp")
    sg = scatter_gather(t, mesh, c.act_bytes)
    sent = c.act_bytes / (tp if mesh.sequence_parallel or sg else 1)
    # one send per chunk whose next virtual stage is on another rank, one receive per chunk whose
    # previous one is (the schedule's chunk map: looped 2 vpp - first - last; a V turns locally on pp - 1)
    n = get_schedule(c.schedule).p2p_per_microbatch(pp, c.vpp, c.stage)
    add("pp", "forward", "send/recv", sent, dt, n, "every micro-batch per chunk boundary", "next stage's forward")
    add("pp", "backward", "send/recv", sent, dt, n, "every micro-batch per chunk boundary",
        "previous stage's backward")
    if sg:  # each receive is the 1/tp slice a tp peer also received: all-gathered over tp
        add("tp", "forward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
            "the received chunk's forward")
        add("tp", "backward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
            "the received chunk's backward")
    if m.tied_embeddings and (c.first or c.last) and not (c.first and c.last):  # first and last pp rank
        pp0 = mesh.group_of(0, "pp")
        add("pp", "step", "all-reduce", _tied_grad_bytes(c), t.grad_dtype, 0,
            "once per step (tied embedding gradients, first and last stage)", "optimizer step", depth=0,
            per_step=1, ranks=(pp0[0], pp0[-1]))


#: Cadence of the tp all-gather rebuilding a pp receive (read by the rank timeline's comm_kind).
SCATTER_GATHER_CADENCE = "pp receive, scatter/gather"


def scatter_gather(training: TrainingSpec, mesh: Mesh, act_bytes: int) -> bool:
    """Whether pipeline sends use Megatron-LM's scatter/gather: each of the tp ranks sends
    ``1/tp`` of the activation over the pp link and the receivers all-gather the slices over
    tp (NVLink inside a node): Megatron-LM 2022 ``_communicate``
    (``--scatter-gather-tensors-in-pipeline``, on by default) with tp > 1, without sequence
    parallelism (its activation is already split over tp) and when the activation's elements
    divide by tp (else it sends the whole tensor). torch's pipelining sends the whole tensor.
    """
    tp = mesh.degree("tp")
    elements = act_bytes // max(dtype_bytes(training.compute_dtype), 1)
    return training.framework == "megatron" and tp > 1 and not mesh.sequence_parallel and elements % tp == 0


def _tied_grad_bytes(c: StageContext) -> int:
    """Bytes of one rank's gradient of a tied embedding copy (padded vocab x hidden split
    over tp, then dim 0 over fsdp under FSDP2: ``ceil(rows / fsdp)`` rows; a last shard of
    uneven rows is smaller) in the main-gradient dtype ``training.grad_dtype`` (Megatron-LM
    all-reduces the fp32 main gradients, like the data-parallel reduction beside it)."""
    t, mesh = c.training, c.mesh
    tp = mesh.degree("tp")
    emb = c.model.embedding_tensors(padded_vocab(c.model.vocab, t.vocab_pad_divisor, tp))[0]
    fsdp = mesh.degree("fsdp") if t.sharding in ("zero3", "hsdp") else 1
    return fsdp_padded_numel(emb, c.model, fsdp, tp) // fsdp * dtype_bytes(t.grad_dtype)
