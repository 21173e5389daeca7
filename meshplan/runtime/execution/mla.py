"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1, eqs. 9-19) for the
runtime model, and its tensor-parallel plan: torchtitan's DeepSeek-V3 plan
(``torchtitan/models/deepseek_v3/infra/parallelize.py``, ``apply_non_moe_tp``).

Module names are meshplan's tensor names (:meth:`meshplan.spec.model.ModelSpec.mla_tensors`)::

    attention.wq_a      Linear h -> q_lora_rank           replicated over tp (torchtitan NoParallel)
    attention.q_a_norm  RMSNorm q_lora_rank               replicated
    attention.wq_b      Linear q_lora_rank -> a (nope + rope)   column-parallel (whole heads)
    attention.wq        Linear h -> a (nope + rope)       column-parallel, without query compression
    attention.wkv_a     Linear h -> kv_lora_rank + rope   replicated (the latent and the shared RoPE key)
    attention.kv_a_norm RMSNorm kv_lora_rank              replicated
    attention.wkv_b     Linear kv_lora_rank -> a (nope + v)     column-parallel
    attention.wo        Linear a v -> h                   row-parallel

As in torchtitan, every projection but ``wo`` keeps its output a DTensor
(``use_local_output=False``), so the attention's intermediates are DTensors and autograd
carries their placements: the gradients reaching the replicated down projections and latent
norms are ``Partial`` over tp, and stay so (no activation collective in backward beyond the
attention input's, as for dense attention); their weight gradients are ``Partial`` DTensors,
which FSDP2 all-reduces over tp in its gradient reduction, one all-reduce per parameter
(measured with torch 2.13 on the fake process group: ``tests/test_mla_tp.py``). Under context
parallelism the up-projected K and V of the local heads are gathered over cp in one buffer
(:meth:`meshplan.runtime.execution.cp.ContextParallel.gather_kv`).

>>> from meshplan.spec.model import ModelSpec
>>> spec = ModelSpec(layers=1, hidden=64, ffn=1, q_heads=4, vocab=1, q_lora_rank=16,
...                  kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=4)
>>> att = LatentAttention(spec)
>>> sum(p.numel() for p in att.parameters()) == sum(t.numel for t in spec.mla_tensors())
True
>>> from meshplan.runtime.execution.model import rope_cos_sin
>>> att(torch.zeros(2, 5, 64), rope_cos_sin(5, spec.qk_rope_head_dim)).shape
torch.Size([2, 5, 64])
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (batch, seq, heads, d) by the (seq, d/2)
    tables (:func:`meshplan.runtime.execution.model.rope_cos_sin`); a DTensor ``x`` gets the
    tables as replicated DTensors on its mesh (DTensor refuses plain-tensor operands).
    Rotary embeddings: Su et al. 2021."""
    if isinstance(x, DTensor):
        cos, sin = (DTensor.from_local(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim, run_check=False)
                    for t in (cos, sin))
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LatentAttention(nn.Module):
    """MLA of one layer (module docstring); ``forward(x, rope)``: x (batch, seq, hidden), rope
    the (cos, sin) tables of the seq positions (``model.rope_cos_sin`` of ``qk_rope_head_dim``,
    at this rank's positions under cp). Heads are counted with ``-1`` so a tp shard runs its
    ``a / tp``."""

    def __init__(self, spec):
        super().__init__()
        h, a = spec.hidden, spec.q_heads
        self.nope, self.rope, self.v = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.d_v
        self.kv_rank = spec.kv_lora_rank
        if spec.q_lora_rank is None:
            self.wq = nn.Linear(h, a * (self.nope + self.rope), bias=False)
        else:
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(spec.q_lora_rank, eps=1e-5)
            self.wq_b = nn.Linear(spec.q_lora_rank, a * (self.nope + self.rope), bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank, eps=1e-5)
        self.wkv_b = nn.Linear(self.kv_rank, a * (self.nope + self.v), bias=False)
        self.wo = nn.Linear(a * self.v, h, bias=False)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None) -> torch.Tensor:
        if rope is None:
            raise ValueError("MLA needs the (cos, sin) RoPE tables of qk_rope_head_dim")
        b, s, _ = x.shape
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_pe = torch.split(q.view(b, s, -1, self.nope + self.rope), [self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, *rope)], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_rank, self.rope], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), *rope)  # (b, s, 1, rope): one RoPE key shared by the heads
        kv = self.wkv_b(self.kv_a_norm(kv)).view(b, s, -1, self.nope + self.v)
        k_nope, v = torch.split(kv, [self.nope, self.v], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (_local(t) for t in (q, k, v))  # torchtitan: inner attention on local heads
        cp = getattr(self, "context_parallel", None)  # runtime.cp: K/V of the whole sequence
        if cp is not None:
            k, v = cp.gather_kv(k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cp is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cp.mask(s, q.device))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class NoParallel(ParallelStyle):
    """A module replicated over the tp mesh (torchtitan's ``NoParallel``): its parameters
    become Replicate DTensors, a plain input is taken as Replicate, the output stays a
    DTensor. Autograd then leaves the parameters' gradients ``Partial`` where the output's
    gradient is (the FSDP2 gradient reduction, or the optimizer, reduces them)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def take(mod, inputs, mesh):
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
            return (x, *inputs[1:])

        return distribute_module(module, device_mesh, None, input_fn=take, output_fn=None)


def mla_tp_plan(attention: LatentAttention) -> dict:
    """torchtitan's DeepSeek-V3 TP plan for one MLA (module docstring), keyed below the
    layer (``attention.*``); ``wo``'s output layout is set by the caller's dense plan."""
    plan = {"attention.wkv_a": NoParallel(), "attention.kv_a_norm": NoParallel(),
            "attention.wkv_b": ColwiseParallel(use_local_output=False)}
    if hasattr(attention, "wq"):
        plan["attention.wq"] = ColwiseParallel(use_local_output=False)
    else:
        plan.update({"attention.wq_a": NoParallel(), "attention.q_a_norm": NoParallel(),
                     "attention.wq_b": ColwiseParallel(use_local_output=False)})
    return plan
