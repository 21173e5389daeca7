"""Model specification: decoder-only transformers, dense and MoE.

Parameter counts follow the layer anatomy of Llama/Mixtral/GPT (Narayanan et al. SC'21,
arXiv 2104.04473, eq. 2 for the dense GPT count; Mixtral config for MoE). Each weight is a
:class:`Tensor` with how tensor parallelism splits it, so per-rank counts are exact rather
than ``total / tp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelSpec(BaseModel):
    """A decoder transformer.

    Sizes are element counts; ``ffn`` is the intermediate width of one MLP (per gate for a
    gated MLP). MoE: ``experts`` > 0 routed experts of width ``expert_ffn`` with ``top_k``
    active, plus ``shared_experts`` always-on experts of width ``shared_expert_ffn``; the
    first ``dense_layers`` layers are dense.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    ffn: int = Field(gt=0)
    gated_mlp: bool = True
    q_heads: int = Field(gt=0)
    kv_heads: Optional[int] = Field(default=None, gt=0)
    head_dim: Optional[int] = Field(default=None, gt=0)
    vocab: int = Field(gt=0)
    tied_embeddings: bool = False
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    linear_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    position_embedding: Literal["rope", "learned"] = "rope"
    max_position: int = Field(default=0, ge=0)
    experts: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    expert_ffn: Optional[int] = Field(default=None, gt=0)
    shared_experts: int = Field(default=0, ge=0)
    shared_expert_ffn: Optional[int] = Field(default=None, gt=0)
    dense_layers: int = Field(default=0, ge=0)
    source: str = ""

    @model_validator(mode="after")
    def _check(self):
        if self.kv_heads is not None and self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim is None and self.hidden % self.q_heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by q_heads {self.q_heads}; give head_dim")
        if self.experts and not 0 < self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..experts ({self.experts}) for an MoE model")
        if self.dense_layers > self.layers:
            raise ValueError(f"dense_layers {self.dense_layers} > layers {self.layers}")
        if self.position_embedding == "learned" and self.max_position <= 0:
            raise ValueError("position_embedding 'learned' needs max_position > 0")
        return self

    # Derived sizes -------------------------------------------------------------------
    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.q_heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.q_heads

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_ffn(self) -> int:
        return self.expert_ffn or self.ffn

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has routed experts."""
        return self.is_moe and layer >= self.dense_layers

    def layer_tensors(self, layer: int) -> list["Tensor"]:
        """Weights of transformer layer ``layer``, with their tensor-parallel split."""
        h, d = self.hidden, self.d_head
        q, kv = self.q_heads * d, self.n_kv_heads * d
        mult = 2 if self.gated_mlp else 1
        norm_n = 2 * h if self.norm == "layernorm" else h
        out = [
            Tensor("attn_norm", norm_n, "replicated"),
            Tensor("wq", h * q + (q if self.qkv_bias or self.linear_bias else 0), "column"),
            Tensor("wk", h * kv + (kv if self.qkv_bias or self.linear_bias else 0), "kv_column"),
            Tensor("wv", h * kv + (kv if self.qkv_bias or self.linear_bias else 0), "kv_column"),
            Tensor("wo", q * h, "row"),
            Tensor("mlp_norm", norm_n, "replicated"),
        ]
        if self.linear_bias:
            out.append(Tensor("wo_bias", h, "replicated"))
        if self.qk_norm:
            out.append(Tensor("qk_norm", 2 * d, "replicated"))
        if self.is_moe_layer(layer):
            f = self.moe_ffn
            out.append(Tensor("router", h * self.experts, "replicated"))
            out.append(Tensor("experts_w_in", self.experts * h * f * mult, "expert_column", expert=True))
            out.append(Tensor("experts_w_out", self.experts * f * h, "expert_row", expert=True))
            if self.shared_experts:
                sf = (self.shared_expert_ffn or f) * self.shared_experts
                out.append(Tensor("shared_w_in", h * sf * mult, "column"))
                out.append(Tensor("shared_w_out", sf * h, "row"))
        else:
            fb = self.ffn if self.linear_bias else 0
            out.append(Tensor("w_in", h * self.ffn * mult + fb * mult, "column"))
            out.append(Tensor("w_out", self.ffn * h, "row"))
            if self.linear_bias:
                out.append(Tensor("w_out_bias", h, "replicated"))
        return out

    def embedding_tensors(self, padded_vocab: int) -> list["Tensor"]:
        """Input embedding (vocab-parallel) and learned positions (replicated)."""
        out = [Tensor("embedding", padded_vocab * self.hidden, "vocab")]
        if self.position_embedding == "learned":
            out.append(Tensor("position_embedding", self.max_position * self.hidden, "replicated"))
        return out

    def head_tensors(self, padded_vocab: int) -> list["Tensor"]:
        """Final norm and output layer; a tied output layer is a copy of the embedding
        (``tied_copy``) that the last pipeline stage keeps when pp > 1, as Megatron does."""
        norm_n = 2 * self.hidden if self.norm == "layernorm" else self.hidden
        return [
            Tensor("final_norm", norm_n, "replicated"),
            Tensor("output", padded_vocab * self.hidden, "vocab", tied=self.tied_embeddings),
        ]

    def param_count(self, padded_vocab: Optional[int] = None) -> int:
        """Total parameters (one copy of a tied embedding). ``padded_vocab`` defaults to vocab.

        >>> tiny = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32,
        ...                  tied_embeddings=True, norm="layernorm")
        >>> tiny.param_count()
        13088
        """
        v = padded_vocab or self.vocab
        n = sum(t.numel for i in range(self.layers) for t in self.layer_tensors(i))
        n += sum(t.numel for t in self.embedding_tensors(v))
        n += sum(t.numel for t in self.head_tensors(v) if not t.tied)
        return n

    def active_param_count(self) -> int:
        """Parameters used per token (MoE: top_k of the routed experts)."""
        total = self.param_count()
        if not self.is_moe:
            return total
        moe_layers = self.layers - self.dense_layers
        mult = 2 if self.gated_mlp else 1
        per_expert = self.hidden * self.moe_ffn * (mult + 1)
        return total - moe_layers * per_expert * (self.experts - self.top_k)


Split = Literal["replicated", "column", "kv_column", "row", "vocab", "expert_column", "expert_row"]


@dataclass(frozen=True)
class Tensor:
    """One weight: ``numel`` elements, split by tensor parallelism as ``split``:

    - ``column``/``row``: divided by tp (Megatron ColumnParallel/RowParallel);
    - ``kv_column``: K or V projection, divided by tp while tp <= kv_heads, else one KV head
      per rank (KV heads replicated tp/kv_heads times);
    - ``vocab``: divided by tp over the padded vocabulary;
    - ``expert_*``: divided by ep (experts) and etp (within an expert);
    - ``replicated``: every tp rank holds all of it (norms, router, biases after a row split).
    ``tied``: the output layer shares the embedding's weight.
    """

    name: str
    numel: int
    split: Split
    expert: bool = False
    tied: bool = False
