"""Global sizes of one transformer layer's activations (:class:`LayerDims`: tokens, micro-batch,
widths, heads, MLP, dropout, activation bytes, MLA's latent widths), from Korthikanti et al.'s
GPT layer or a :class:`~meshplan.spec.model.ModelSpec`; one rank's share of them
(:class:`LocalSizes`) and one stored tensor (:class:`Term`); what the layer stores at those sizes:
:mod:`meshplan.memory.activations`.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.errors import ConfigError
from meshplan.spec.axes.tp import kv_heads_local
from meshplan.spec.model import ModelSpec


@dataclass(frozen=True)
class Term:
    """One stored tensor: ``size_bytes`` on one rank per micro-batch and its ``formula``."""

    name: str
    size_bytes: int
    formula: str


@dataclass(frozen=True)
class LocalSizes:
    """One rank's share of a layer (:func:`meshplan.memory.activations.layer_terms` builds it)."""

    tok: int   # tokens per rank along the sequence: ceil(s / cp)
    rtok: int  # tokens of an [r] tensor: ceil(tok / t) with sequence parallel, else tok
    aq: int    # query heads per rank
    akv: int   # KV heads per rank
    f: int     # MLP columns per rank (per gate)
    seq: str   # "s" or "(s/cp)" for formulas
    r: str     # "/t" or "" for [r] formulas


@dataclass(frozen=True)
class LayerDims:
    """Global sizes of one transformer layer's activations: ``s`` tokens per sequence,
    ``b`` micro-batch, ``h`` hidden, ``a`` query heads, ``g`` KV heads, ``d`` head dim,
    ``f`` MLP width per gate, ``gated`` MLP, ``dropout`` (attention and residual)."""

    s: int
    b: int
    h: int
    a: int
    g: int
    d: int
    f: int
    gated: bool = False
    dropout: bool = True
    act_bytes: int = 2
    dv: int = 0       # value head dim (0: d); MLA's v_head_dim
    q_lora: int = 0   # MLA query latent width (0: no query compression)
    kv_lora: int = 0  # MLA KV latent width (0: not MLA)
    rope: int = 0     # MLA RoPE key width (qk_rope_head_dim)

    def kv_local(self, tp: int) -> int:
        """KV heads on one tp rank: ``g / tp``, or 1 where tp exceeds ``g`` (each KV head replicated
        over ``tp / g`` ranks: :func:`meshplan.spec.axes.tp.kv_heads_local`, as ``local_heads``).

        >>> LayerDims(s=8, b=1, h=64, a=8, g=2, d=8, f=16).kv_local(1), LayerDims(s=8, b=1, h=64, a=8, g=2, d=8, f=16).kv_local(4)
        (2, 1)
        """
        return kv_heads_local(self.g, tp)

    @property
    def d_v(self) -> int:
        return self.dv or self.d

    @classmethod
    def gpt(cls, s: int, b: int, h: int, a: int, dropout: bool = True) -> "LayerDims":
        """Korthikanti's GPT layer: MHA, 4h GeLU MLP, dropout."""
        return cls(s=s, b=b, h=h, a=a, g=a, d=h // a, f=4 * h, gated=False, dropout=dropout)

    @classmethod
    def from_model(cls, model: ModelSpec, seq_len: int, micro_batch: int, *,
                   dropout: bool = False, layer: int = 0, act_bytes: int = 2) -> "LayerDims":
        """Dims of dense layer ``layer`` of ``model``. ``dropout`` defaults to False (Llama-style
        pretraining); pass True for GPT-style dropout. ``act_bytes``: bytes per activation
        element (2: 16-bit, Table 2). Raises ConfigError for an MoE layer:
        routed-expert activations (top_k token copies, permutation buffers) are not modelled
        here."""
        if model.is_moe_layer(layer):
            raise ConfigError("model.experts", f"layer {layer} is an MoE layer; expert MLP "
                              "activations are not modelled by LayerDims (dense layers only)")
        return cls(s=seq_len, b=micro_batch, h=model.hidden, a=model.q_heads, g=model.n_kv_heads,
                   d=model.d_head, f=model.ffn, gated=model.gated_mlp, dropout=dropout, act_bytes=act_bytes,
                   **mla_dims(model))


def mla_dims(model: ModelSpec) -> dict[str, int]:
    """The MLA fields of :class:`LayerDims` for ``model`` (none for other attention)."""
    if not model.is_mla:
        return {}
    return dict(dv=model.d_v, q_lora=model.q_lora_rank or 0, kv_lora=model.kv_lora_rank or 0,
                rope=model.qk_rope_head_dim or 0)
