"""Pipeline stage modules of the runtime model and what each gets before ``PipelineStage``:
context parallelism, tensor / sequence parallelism, expert parallelism, FSDP2, and the
gradient sync of a tied embedding split across the first and last stage.

- :class:`StageModule`: one chunk (virtual stage) of the runtime
  :class:`~meshplan.runtime.execution.model.Transformer`, the full model's own module objects.
- :func:`parallelize_stage`, in the order :func:`meshplan.runtime.execution.parallelize.parallelize`
  uses for the whole model (torchtitan's): cp (:func:`meshplan.runtime.execution.cp.apply_cp`: K and V
  all-gathered over cp in every attention layer of the stage), TP/SP, EP
  (:func:`meshplan.runtime.execution.moe_parallel.apply_ep`: experts over ep, all-to-all dispatch and combine),
  then FSDP2 over ``fsdp`` (dp_shard x cp), routed experts their own unit over ``efsdp``.
- Context parallelism: the first stage embeds this rank's ``s / cp`` tokens (chunks ``i``
  and ``2 cp - 1 - i``, :func:`meshplan.runtime.execution.cp.rank_chunks`); rotary tables (or learned
  positions) at their global positions on every stage; the activation between stages is the
  local (b, s/cp, h), under SP (b, s/cp/tp, h), as the plan's pp rows assume
  (:func:`meshplan.comm.pp_rows.pp_rows`, ``act_bytes`` = b * s/cp * h).
- Tied embeddings (:class:`TiedEmbeddingSync`): the first stage holds ``embedding.weight``,
  the last ``output.weight``, equal at start (both drawn as the single-process model's one
  tensor, :func:`init_stage_weights`). After the schedule, before the optimizer, each of the
  two all-reduces (sum) its gradient with the other over the embedding group (first and last
  rank of the pp group), as Megatron-LM does (``megatron/core/distributed/
  finalize_model_grads.py``, ``_allreduce_word_embedding_grads``), so both take the same
  AdamW step and stay equal. Under FSDP2 each rank holds the same shard of both copies
  (Shard(0) of the same padded rows), so the all-reduce is of the local shard.

Worked example (seq 32, cp 2, tp 2 + SP, micro-batch 1, hidden 256, fp32): stage 0 of cp
rank 1 embeds tokens [8..15, 16..23] (16 tokens), sends its tp shard (1, 8, 256) = 8 KiB to
stage 1, whose attention gathers K/V of all 32 tokens over cp.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from meshplan.mesh.tpsplit import experts_apart
from meshplan.compute.routing import RoutingOptions
from meshplan.runtime.execution.model import Transformer, draw_initial, rope_cos_sin, rope_head_dim
from meshplan.spec.axes.moe_tp import experts_over_tp


class StageModule(nn.Module):
    """One virtual stage of ``full``: ``layers`` (indices), plus the embedding when ``first``
    and the final norm and output layer when ``last``. Modules are ``full``'s own objects.
    ``seq_split``: how many pieces the received activation's sequence dimension is cut into
    (tp under sequence parallelism, where a stage receives its (b, s/cp/tp, h) shard).
    Under cp (``context_parallel`` set by :func:`~meshplan.runtime.execution.cp.apply_cp`) the input
    holds this rank's ``s / cp`` tokens; rotary tables and learned positions are taken at
    their global positions."""

    def __init__(self, full: Transformer, layers: list[int], first: bool, last: bool, seq_split: int = 1):
        super().__init__()
        self.spec, self.vocab, self.kv_heads, self.recompute = full.spec, full.vocab, full.kv_heads, full.recompute
        self.first, self.last, self.seq_split = first, last, seq_split
        if first:
            self.embedding = full.embedding
            if full.spec.position_embedding == "learned":
                self.position_embedding = full.position_embedding
        self.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in layers})
        if last:
            self.final_norm = full.final_norm
            self.output = full.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.shape[1] * (1 if self.first else self.seq_split)  # this rank's tokens: s / cp
        cp = getattr(self, "context_parallel", None)
        pos = cp.positions(local).to(x.device) if cp is not None else torch.arange(local, device=x.device)
        if self.first:
            x = self.embedding(x)
            if self.spec.position_embedding == "learned":
                x = x + self.position_embedding(pos)
        rope = None
        if self.spec.position_embedding == "rope":
            cos, sin = rope_cos_sin(local * (cp.degree if cp else 1), rope_head_dim(self.spec), device=x.device,
                                    dtype=x.dtype)
            rope = (cos[pos], sin[pos]) if cp is not None else (cos, sin)
        for block in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                # early_stop=False: torchtitan's (238fa99 activation_checkpoint.py 45/135/154, b5bcd76 180/285)
                x = torch.utils.checkpoint.checkpoint(block, x, rope, use_reentrant=False, early_stop=False)
            else:
                x = block(x, rope)
        if self.last:
            x = self.output(self.final_norm(x))
        return x


@torch.no_grad()
def init_stage_weights(full: Transformer, seed: int = 0, std: float = 0.02) -> None:
    """:meth:`Transformer.init_weights` for a model of which only some modules are
    materialised (the others stay on ``meta``): every tensor is drawn in the full model's
    order, so each stage holds the single-process model's values. Routed experts held under
    EP keep their rows of the full draw; a tied ``output.weight`` (split from the embedding
    when the stages were materialised) gets the embedding's value."""
    gen = torch.Generator().manual_seed(seed)
    drawn = {}
    for name, p in full.named_parameters(remove_duplicate=False):
        if name == "output.weight" and full.spec.tied_embeddings:
            value = drawn["embedding.weight"]
        else:
            owner = full.get_submodule(name.rpartition(".")[0])
            rows = getattr(owner, "full_rows", p.shape[0])
            value = draw_initial(full, name, p, gen, std)
            if rows != p.shape[0]:
                value = value[owner.offset:owner.offset + p.shape[0]]
            drawn[name] = value
        if p.is_meta:
            continue
        if hasattr(p, "device_mesh"):
            from torch.distributed.tensor import distribute_tensor

            p.to_local().copy_(distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local())
        else:
            p.copy_(value)


def parallelize_stage(modules: list[StageModule], mesh, training, dm, loss_parallel_on: bool, device: str):
    """Context, tensor (and sequence), expert parallelism and FSDP2 on each stage module of
    this rank, in place, then its parameters materialised on ``device`` (uninitialised: call
    :func:`init_stage_weights`). Returns the expert DeviceMesh (None without MoE layers);
    every rank builds it (the same sub-groups in the same order)."""
    from meshplan.runtime.execution.cp import apply_cp
    from meshplan.runtime.execution.parallelize import apply_fsdp, fsdp_mesh
    from meshplan.runtime.execution.tensor_parallel import apply_tp

    rank = dist.get_rank()
    tp, cp = mesh.degree("tp"), mesh.degree("cp")
    sp = tp > 1 and mesh.sequence_parallel
    cp_group = dm["cp"].get_group() if cp > 1 else None
    edm = expert_dp = placement = None
    if modules[0].spec.is_moe:
        from meshplan.runtime.execution.moe_parallel import expert_placement_fn, init_expert_mesh

        edm = init_expert_mesh(mesh, dm.device_type)
        placement = expert_placement_fn(modules[0].spec, mesh)
        hsdp = training.sharding == "hsdp" or mesh.degree("dp_replicate") > 1
        expert_dp = edm["dp_replicate", "efsdp"] if hsdp and "dp_replicate" in edm.mesh_dim_names else edm["efsdp"]
    shard = mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1
    for m in modules:
        if edm is not None:
            from meshplan.runtime.execution.moe import set_routing

            set_routing(m, RoutingOptions.of(training))
        if cp > 1:
            apply_cp(m, cp_group, cp, mesh.group_of(rank, "cp").index(rank))
        if tp > 1:
            apply_tp(m, dm["tp"], sp, loss_parallel_on and m.last, experts_over_tp("torch", mesh.etp, tp))
        if edm is not None and mesh.ep > 1:
            from meshplan.runtime.execution.moe_parallel import apply_ep

            apply_ep(m, edm["ep"].get_group(), mesh.ep, mesh.group_of(rank, "ep").index(rank))
        if shard:
            apply_fsdp(m, fsdp_mesh(dm, mesh, training), training.reshard_after_forward, None, expert_dp, placement,
                       reshard_head=training.reshard_head_after_forward, experts_apart=experts_apart(mesh))
        m.to_empty(device=device)
    return edm


class TiedEmbeddingSync:
    """The gradient sync of a tied embedding split across pipeline stages (see the module
    docstring): ``__call__`` all-reduces (sum), over ``group`` (the embedding group: the
    first and last rank of this rank's pp group), the local gradient of each copy this rank
    holds, ``embedding.weight`` on the first stage and ``output.weight`` on the last; one
    all-reduce per step of ``padded_vocab / tp / fsdp x hidden`` elements (the local shard)
    in the parameter dtype. Ranks of middle stages hold neither and issue nothing."""

    def __init__(self, modules: list[StageModule], group):
        self.group = group
        self.params = [m.embedding.weight for m in modules if m.first] + [m.output.weight for m in modules if m.last]

    def __call__(self) -> None:
        for p in self.params:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=self.group)


def tied_embedding_sync(modules: list[StageModule], mesh, dm) -> Optional[TiedEmbeddingSync]:
    """:class:`TiedEmbeddingSync` of this rank when the model ties its embeddings (None
    otherwise). The embedding group is the pp group itself, as pp = 2 has it; pp > 2 is
    refused by :func:`meshplan.runtime.execution.buildable.unsupported_pipeline`."""
    if not modules[0].spec.tied_embeddings:
        return None
    if mesh.degree("pp") != 2:
        raise ValueError(f"tied embeddings need pp = 2 here, not {mesh.degree('pp')}")
    return TiedEmbeddingSync(modules, dm["pp"].get_group())
