"""Tensor (and sequence) parallelism of the runtime
:class:`~meshplan.runtime.execution.model.Transformer` (or of a pipeline stage's module) over
the ``tp`` sub-mesh with torch's DTensor ``parallelize_module``, following torchtitan's Llama
plan (models/llama3/infra/parallelize.py ``apply_tp``); run by
:func:`meshplan.runtime.execution.parallelize.parallelize` after context parallelism and
before FSDP2, and per stage by :func:`meshplan.runtime.execution.pipelined_stage.parallelize_stage`.

TP plan (``tp > 1``), with SP / without SP:

====================== ===================================== =============================
module                 with sequence parallelism             without
====================== ===================================== =============================
embedding              Rowwise(in Replicate, out Shard(1))   Rowwise(in Replicate, out Replicate)
attn_norm, mlp_norm,   SequenceParallel                      not split
final_norm
attention, mlp         PrepareModuleInput(Shard(1) -> Rep)   PrepareModuleInput(Rep -> Rep)
wq, wk, wv, w_gate,    Colwise                               Colwise
w_up
wo, w_down             Rowwise(out Shard(1))                 Rowwise(out Replicate)
output                 Colwise(in Shard(1), out Shard(-1))   Colwise(in Replicate, out Shard(-1))
====================== ===================================== =============================

Multi-head latent attention (:mod:`meshplan.runtime.execution.mla`): torchtitan's DeepSeek-V3
plan, the down projections ``wq_a``, ``wkv_a`` and the latent norms replicated (torchtitan's
``NoParallel``), ``wq_b`` / ``wq`` and ``wkv_b`` Colwise with DTensor outputs, ``wo`` as above.

The output layer keeps its logits sharded over the vocabulary (loss parallel: compute the
loss under ``torch.distributed.tensor.parallel.loss_parallel()``) unless
``loss_parallel=False``, where it all-gathers them (``out Replicate``).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshplan.errors import ConfigError
from meshplan.runtime.execution.mla import mla_tp_plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool = True,
             experts_over_tp: bool = False) -> None:
    """Tensor (and sequence) parallelism, in place; see the module docstring's table. ``model``
    may be a pipeline stage: embedding, final norm and output are split where it has them.
    ``experts_over_tp`` (ep 1, etp = tp): MoE layers as torchtitan at ep 1
    (:func:`~meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`), else the tokens split."""
    tp = tp_mesh.size()
    spec = model.spec
    if spec.q_heads % tp:
        raise ConfigError("mesh.tp", f"q_heads {spec.q_heads} is not divisible by tp {tp}")
    if model.kv_heads % tp:
        raise ConfigError("mesh.tp", f"kv_heads {model.kv_heads} is not divisible by tp {tp}")
    if model.vocab % tp:
        raise ConfigError("model.vocab", f"vocab {model.vocab} is not divisible by tp {tp}; pad it")
    if sequence_parallel and spec.position_embedding == "learned":
        raise ConfigError("model.position_embedding", "learned positions with sequence parallelism are not built")
    act = Shard(1) if sequence_parallel else Replicate()
    root = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        root["final_norm"] = SequenceParallel()
    # a pipeline stage module (runtime.pipelined.StageModule) holds only some of the root modules
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if hasattr(model, k)})
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(act, None), desired_input_layouts=(Replicate(), None)),
            **(mla_tp_plan(block.attention) if spec.is_mla else
               {f"attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")}),
            "attention.wo": RowwiseParallel(output_layouts=act),
        }
        if hasattr(block, "moe"):  # router replicated, tokens (etp 1) or experts (etp = tp) split over tp
            from meshplan.runtime.execution.moe_parallel import apply_experts_over_tp, apply_moe_tp

            (apply_experts_over_tp if experts_over_tp else apply_moe_tp)(block.moe, tp_mesh, sequence_parallel)
        else:
            plan.update({"mlp": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
                         "mlp.w_up": ColwiseParallel(), "mlp.w_down": RowwiseParallel(output_layouts=act)})
            if block.mlp.gated:
                plan["mlp.w_gate"] = ColwiseParallel()
        if sequence_parallel:
            plan["attn_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
    if spec.tied_embeddings and hasattr(model, "output") and hasattr(model, "embedding"):  # both Shard(0): tie again
        model.output.weight = model.embedding.weight
