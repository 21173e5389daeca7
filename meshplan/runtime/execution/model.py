"""A small Llama-style decoder built from a :class:`~meshplan.spec.model.ModelSpec`, for
dry runs and measured runs of a planned mesh.

Module names mirror meshplan's tensor names, so a recorded collective or a memory snapshot
can be traced back to a row of the plan::

    embedding                                  (vocab, hidden)
    layers.<i>.attn_norm                       RMSNorm or LayerNorm
    layers.<i>.attention.{wq, wk, wv, wo}      Linear, no bias unless the spec says so
    layers.<i>.attention.{wq_a, q_a_norm, wq_b, wkv_a, kv_a_norm, wkv_b, wo}
                                               multi-head latent attention (DeepSeek-V2/V3;
                                               :mod:`meshplan.runtime.execution.mla`)
    layers.<i>.mlp_norm
    layers.<i>.mlp.{w_gate, w_up, w_down}      SwiGLU; a non-gated MLP has w_up, w_down (GELU)
    final_norm
    output                                     Linear (hidden -> vocab), or tied to embedding

meshplan's ``w_in`` is ``w_gate`` + ``w_up`` here and ``w_out`` is ``w_down``.

Attention uses ``scaled_dot_product_attention`` (causal) and reshapes with ``-1`` heads, so
the same code runs on a tensor-parallel shard holding ``q_heads / tp`` heads. Under context
parallelism (:mod:`meshplan.runtime.execution.cp`) it gathers K and V over cp and masks by global
positions.
When ``tp > kv_heads`` (and ``tp % kv_heads == 0``) the model is built with ``tp`` KV heads,
each real head copied ``tp / kv_heads`` times, which is the per-rank layout meshplan assumes
(:func:`meshplan.mesh.tpsplit.local_heads`). The copies start equal (:meth:`Transformer.init_weights`
draws the real heads) and stay equal when their gradients are summed over each replica group
before the optimizer (:mod:`meshplan.runtime.execution.kvsync`).

An MoE layer (``spec.is_moe_layer``) has ``layers.<i>.moe`` (router, routed experts as
stacked weights, shared experts) in place of ``mlp``: :mod:`meshplan.runtime.execution.moe`.
qk-norm and learned positions under sequence parallelism are not built: the constructor or
:func:`~meshplan.runtime.execution.parallelize.parallelize` says so.

>>> spec = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, vocab=100)
>>> m = Transformer(spec)
>>> sum(p.numel() for p in m.parameters()) == spec.param_count()
True
>>> m(torch.zeros(2, 8, dtype=torch.long)).shape
torch.Size([2, 8, 100])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshplan.errors import ConfigError
from meshplan.runtime.execution.kvsync import KV_PARAMS, kv_copies, replicated_kv_value
from meshplan.runtime.execution.mla import LatentAttention, apply_rope
from meshplan.spec.model import ModelSpec


def _norm(spec: ModelSpec, width: int) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(width, eps=1e-5)
    return nn.LayerNorm(width, eps=1e-5)


def rope_cos_sin(seq: int, head_dim: int, theta: float = 500000.0, device=None, dtype=torch.float32):
    """cos and sin tables (seq, head_dim/2) of rotary embeddings (Su et al. 2021)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_head_dim(spec: ModelSpec) -> int:
    """Width RoPE rotates: the head dim, or MLA's decoupled ``qk_rope_head_dim``."""
    return spec.qk_rope_head_dim if spec.is_mla else spec.d_head


class Attention(nn.Module):
    """Grouped-query attention with separate wq, wk, wv, wo projections."""

    def __init__(self, spec: ModelSpec, kv_heads: int):
        super().__init__()
        h, d = spec.hidden, spec.d_head
        bias = spec.qkv_bias or spec.linear_bias
        self.head_dim = d
        self.q_per_kv = spec.q_heads // kv_heads
        self.wq = nn.Linear(h, spec.q_heads * d, bias=bias)
        self.wk = nn.Linear(h, kv_heads * d, bias=bias)
        self.wv = nn.Linear(h, kv_heads * d, bias=bias)
        self.wo = nn.Linear(spec.q_heads * d, h, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)  # -1: local heads on a tp shard
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        cp = getattr(self, "context_parallel", None)  # runtime.cp: K/V of the whole sequence
        if cp is not None:
            k, v = cp.gather_kv(k, v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.q_per_kv > 1:
            k = k.repeat_interleave(self.q_per_kv, dim=1)
            v = v.repeat_interleave(self.q_per_kv, dim=1)
        if cp is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=cp.mask(s, q.device))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU (w_down(silu(w_gate x) * w_up x)) or, non-gated, w_down(gelu(w_up x))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, bias = spec.hidden, spec.ffn, spec.linear_bias
        self.gated = spec.gated_mlp
        if self.gated:
            self.w_gate = nn.Linear(h, f, bias=bias)
        self.w_up = nn.Linear(h, f, bias=bias)
        self.w_down = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))
        return self.w_down(F.gelu(self.w_up(x)))


class Block(nn.Module):
    """Pre-norm transformer layer: x + attention(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, spec: ModelSpec, kv_heads: int, moe: bool = False):
        super().__init__()
        self.attn_norm = _norm(spec, spec.hidden)
        self.attention = LatentAttention(spec) if spec.is_mla else Attention(spec, kv_heads)
        self.mlp_norm = _norm(spec, spec.hidden)
        if moe:
            from meshplan.runtime.execution.moe import MoE

            self.moe = MoE(spec)
        else:
            self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None) -> torch.Tensor:
        x = x + self.attention(self.attn_norm(x), rope)
        return x + (self.moe if hasattr(self, "moe") else self.mlp)(self.mlp_norm(x))


def initial_value(name: str, shape, gen: "torch.Generator", std: float = 0.02) -> "torch.Tensor":
    """Initial full tensor of parameter ``name``: norm weights 1, norm and other biases 0,
    weights N(0, std) drawn from ``gen`` (so drawing in parameter order reproduces a model)."""
    if "norm" in name:
        return torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
    if name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * std


class Transformer(nn.Module):
    """Decoder from ``spec``. ``vocab``: rows of the embedding and output layer (default
    ``spec.vocab``; pass meshplan's padded vocabulary to match the plan). ``tp``: the
    tensor-parallel degree the model will be split over, used only to copy KV heads when
    ``tp > kv_heads``. ``recompute``: full activation recomputation of every layer
    (non-reentrant ``torch.utils.checkpoint`` with ``early_stop=False``, as torchtitan's
    ``ptd_checkpoint_wrapper`` since 25413d2: 238fa99 ``config/job_config.py`` 675, passed at
    ``distributed/activation_checkpoint.py`` 45, 135, 154; b5bcd76 there 180, 285: the replay re-runs
    the whole block, its closing TP collective too), or a function of the layer's position saying
    which (``TrainingSpec.layer_recomputed``: torchtitan's per-layer AC, every ``ac_freq``-th; at pp 1
    Megatron-LM's block recompute, the rank's first ``recompute_num_layers``)."""

    def __init__(self, spec: ModelSpec, vocab: Optional[int] = None, tp: int = 1,
                 recompute: Union[bool, Callable[[int], bool]] = False):
        super().__init__()
        self.recompute = recompute
        if spec.qk_norm:
            raise ConfigError("model.qk_norm", "the runtime model has no qk-norm yet")
        self.spec = spec
        self.vocab = vocab or spec.vocab
        self.kv_heads = kv_heads_built(spec, tp)
        self.embedding = nn.Embedding(self.vocab, spec.hidden)
        if spec.position_embedding == "learned":
            self.position_embedding = nn.Embedding(spec.max_position, spec.hidden)
        self.layers = nn.ModuleDict({str(i): Block(spec, self.kv_heads, spec.is_moe_layer(i)) for i in range(spec.layers)})
        self.final_norm = _norm(spec, spec.hidden)
        self.output = nn.Linear(spec.hidden, self.vocab, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``tokens`` (batch, seq). Under context parallelism
        (:mod:`meshplan.runtime.execution.cp`) ``tokens`` are this rank's ``seq`` tokens of a sequence of
        ``seq * cp``, at the global positions ``context_parallel.positions(seq)``."""
        x = self.embedding(tokens)
        seq = tokens.shape[1]
        cp = getattr(self, "context_parallel", None)  # runtime.cp: tokens are this rank's chunks
        pos = cp.positions(seq).to(tokens.device) if cp is not None else torch.arange(seq, device=tokens.device)
        rope = None
        if self.spec.position_embedding == "rope":
            cos, sin = rope_cos_sin(seq * (cp.degree if cp else 1), rope_head_dim(self.spec), device=tokens.device,
                                    dtype=x.dtype)
            rope = (cos[pos], sin[pos]) if cp is not None else (cos, sin)
        else:
            x = x + self.position_embedding(pos)
        for k, block in enumerate(self.layers.values()):
            ckpt = self.recompute(k) if callable(self.recompute) else self.recompute
            if ckpt and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False, early_stop=False)
            else:
                x = block(x, rope)
        return self.output(self.final_norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int = 0) -> None:
        """Normal(0, std) weights, ones for norm weights, zeros for biases, drawn for the full
        tensors in a fixed order from ``seed``: every mesh gets the values of the
        single-process model. Call after ``to_empty``; on a sharded (DTensor) parameter each
        rank keeps its own slice (``distribute_tensor(..., src_data_rank=None)``, no
        communication). Routed experts held under EP (``Experts.offset``) draw all
        ``full_rows`` experts and keep their own rows; replicated KV heads (tp > kv_heads)
        draw the real heads and copy them (:func:`~meshplan.runtime.execution.kvsync.replicated_kv_value`)."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            owner = self.get_submodule(name.rpartition(".")[0])
            rows = getattr(owner, "full_rows", p.shape[0])
            full = draw_initial(self, name, p, gen, std)
            if rows != p.shape[0]:
                full = full[owner.offset:owner.offset + p.shape[0]]
            if hasattr(p, "device_mesh"):
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(full)
            else:
                p.copy_(full)


def draw_initial(model: "Transformer", name: str, p, gen: "torch.Generator", std: float) -> torch.Tensor:
    """The full initial value of ``model``'s parameter ``name`` (``p``: the parameter, its
    global shape), drawn from ``gen`` in the single-process model's order: routed experts'
    ``full_rows``, replicated KV heads' real heads copied ``tp / kv_heads`` times."""
    owner = model.get_submodule(name.rpartition(".")[0])
    rows = getattr(owner, "full_rows", p.shape[0])
    r = kv_copies(model)[1]
    if r > 1 and name.endswith(KV_PARAMS):
        full = initial_value(name, (rows // r,) + tuple(p.shape[1:]), gen, std)
        return replicated_kv_value(name, full, model.spec.n_kv_heads, r)
    return initial_value(name, (rows,) + tuple(p.shape[1:]), gen, std)


def kv_heads_built(spec: ModelSpec, tp: int) -> int:
    """KV heads the model holds: ``kv_heads``, or ``tp`` when tp > kv_heads (copies).

    >>> kv_heads_built(ModelSpec(layers=1, hidden=64, ffn=1, q_heads=8, kv_heads=2, vocab=1), 4)
    4
    """
    kv = spec.n_kv_heads
    if tp <= kv:
        return kv
    if tp % kv:
        raise ConfigError("mesh.tp", f"kv_heads {kv} vs tp {tp}: need kv_heads % tp == 0 or tp % kv_heads == 0")
    return tp


@dataclass(frozen=True)
class Scaled:
    """A scaled-down model and the note that says how it was scaled."""

    spec: ModelSpec
    note: str


def scale_model(spec: ModelSpec, layers: Optional[int] = None, hidden_div: int = 1,
                ffn_div: Optional[int] = None, vocab: Optional[int] = None) -> Scaled:
    """Shrink ``spec`` by stated factors, keeping head counts (so tp splits stay valid):
    hidden and head_dim divided by ``hidden_div``, ffn by ``ffn_div`` (default hidden_div),
    ``layers`` and ``vocab`` replaced when given.

    >>> from meshplan import catalog
    >>> s = scale_model(catalog.model("llama3-70b"), layers=2, hidden_div=8, vocab=1024)
    >>> s.spec.hidden, s.spec.d_head, s.spec.q_heads, s.spec.kv_heads, s.spec.ffn, s.spec.layers
    (1024, 16, 64, 8, 3584, 2)
    >>> s.note
    'scaled from llama3-70b: layers 80 -> 2, hidden 8192 -> 1024 (/8), head_dim 128 -> 16, ffn 28672 -> 3584 (/8), vocab 128256 -> 1024'
    """
    ffn_div = ffn_div or hidden_div
    d = spec.d_head
    for name, value, div in (("hidden", spec.hidden, hidden_div), ("head_dim", d, hidden_div),
                             ("ffn", spec.ffn, ffn_div)):
        if div < 1 or value % div:
            raise ConfigError(f"scale.{name}", f"{name} {value} is not divisible by {div}")
    if (d // hidden_div) % 2 and spec.position_embedding == "rope":
        raise ConfigError("scale.head_dim", f"head_dim {d} / {hidden_div} is odd; RoPE needs an even head_dim")
    new_layers = layers or spec.layers
    upd = dict(layers=new_layers, hidden=spec.hidden // hidden_div, ffn=spec.ffn // ffn_div,
               head_dim=d // hidden_div, vocab=vocab or spec.vocab,
               dense_layers=min(spec.dense_layers, new_layers),
               name=f"{spec.name}-scaled")
    if spec.is_mla:  # the latent and head dims scale with hidden; head_dim stays unset
        upd |= {"head_dim": None, **_scaled_mla_dims(spec, hidden_div)}
    for key in ("expert_ffn", "shared_expert_ffn"):
        if getattr(spec, key):
            upd[key] = getattr(spec, key) // ffn_div
    parts = []
    if new_layers != spec.layers:
        parts.append(f"layers {spec.layers} -> {new_layers}")
    if hidden_div != 1:
        parts.append(f"hidden {spec.hidden} -> {upd['hidden']} (/{hidden_div}), head_dim {d} -> {d // hidden_div}"
                     + (", MLA latent and head dims /" + str(hidden_div) if spec.is_mla else ""))
    if ffn_div != 1:
        parts.append(f"ffn {spec.ffn} -> {upd['ffn']} (/{ffn_div})")
    if upd["vocab"] != spec.vocab:
        parts.append(f"vocab {spec.vocab} -> {upd['vocab']}")
    new = ModelSpec(**{**spec.model_dump(), **upd})
    return Scaled(new, f"scaled from {spec.name}: " + (", ".join(parts) or "unchanged"))


#: MLA fields scaled with the hidden size by :func:`scale_model`.
MLA_SCALED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _scaled_mla_dims(spec: ModelSpec, div: int) -> dict:
    """MLA's latent ranks and head dims divided by ``div`` (q_lora_rank only when set); the
    RoPE part must stay even.

    >>> from meshplan import catalog
    >>> _scaled_mla_dims(catalog.model("deepseek-v2-lite"), 8)
    {'kv_lora_rank': 64, 'qk_nope_head_dim': 16, 'qk_rope_head_dim': 8, 'v_head_dim': 16}
    """
    out = {}
    for key in MLA_SCALED:
        value = getattr(spec, key)
        if value is None:
            continue
        if value % div or (key == "qk_rope_head_dim" and (value // div) % 2):
            raise ConfigError(f"scale.{key}", f"{key} {value} / {div} is not a whole (for the RoPE part, even) "
                              "number; choose a smaller hidden_div")
        out[key] = value // div
    return out
