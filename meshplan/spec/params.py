"""Parameter counts of a :class:`~meshplan.spec.model.ModelSpec`: the total and, for an MoE
model, the active parameters (those one token passes through) with their definition in words.
Summed over the model's weights (:meth:`~meshplan.spec.model.ModelSpec.layer_tensors`,
``embedding_tensors``, ``head_tensors``), so the count is the layer anatomy's; ``ModelSpec``'s
``param_count``, ``active_param_count`` and ``active_words`` call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from meshplan.units import param_number

if TYPE_CHECKING:
    from meshplan.spec.model import ModelSpec


def param_count(m: "ModelSpec", padded_vocab: Optional[int] = None) -> int:
    """Total parameters of ``m`` (one copy of a tied embedding). ``padded_vocab`` defaults to vocab.

    Four layers of hidden 16, ffn 64, plain MLP, layernorm: attention 4 x 16 x 16 = 1,024, MLP
    2 x 16 x 64 = 2,048, norms 2 x 2 x 16 = 64, so 3,136 a layer and 12,544 for four; embedding
    32 x 16 = 512 (output tied), final norm 2 x 16 = 32: 13,088.

    >>> from meshplan.spec.model import ModelSpec
    >>> tiny = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32,
    ...                  tied_embeddings=True, norm="layernorm")
    >>> param_count(tiny)
    13088
    """
    v = padded_vocab or m.vocab
    n = sum(t.numel for i in range(m.layers) for t in m.layer_tensors(i))
    n += sum(t.numel for t in m.embedding_tensors(v))
    n += sum(t.numel for t in m.head_tensors(v) if not t.tied)
    return n


def active_param_count(m: "ModelSpec", padded_vocab: Optional[int] = None) -> int:
    """Active parameters of ``m``: those one token passes through, the total (:func:`param_count`,
    its embedding and output layer counted the same way) less, in each MoE layer, the routed
    experts it is not sent to (``experts - top_k`` of them); the attention, norms, router,
    shared experts and dense layers all count. A dense model's is its total.

    Mixtral 8x7B (its config.json): 32 x (attention 4096 x (4096 + 2 x 1024 + 4096) = 41,943,040
    + top-2 experts 2 x 3 x 4096 x 14336 = 352,321,536 + router 4096 x 8 = 32,768 + norms 2 x 4096)
    + embedding and output 2 x 32000 x 4096 + final norm 4096 = 12,879,925,248 of 46,702,792,704
    (Mistral AI, "Mixtral of experts", 2023-12-11: "46.7B total parameters but only uses 12.9B
    parameters per token"; arXiv 2401.04088: 47B and 13B). Publishers differ on the input
    embedding, a lookup: DeepSeek-V2-Lite's "2.4B activated" (arXiv 2405.04434) leaves it out,
    2.66 B here with it.

    >>> from meshplan.catalog import model
    >>> active_param_count(model("mixtral-8x7b")), param_count(model("mixtral-8x7b"))
    (12879925248, 46702792704)
    """
    total = param_count(m, padded_vocab)
    if not m.is_moe:
        return total
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.layers))
    per_expert = m.hidden * m.moe_ffn * ((2 if m.gated_mlp else 1) + 1)
    return total - moe_layers * per_expert * (m.experts - m.top_k)


def active_words(m: "ModelSpec", padded_vocab: Optional[int] = None) -> str:
    """``12.88 B active (...)``: :func:`active_param_count` with its definition, for an MoE
    model (empty for a dense one), printed beside the total (:func:`meshplan.units.param_number`).

    >>> from meshplan.catalog import model
    >>> active_words(model("mixtral-8x7b"))[:60]
    '12.88 B active per token (attention, norms, router, the top-'
    """
    if not m.is_moe:
        return ""
    shared = f", {m.shared_experts} shared" if m.shared_experts else ""
    dense = f", {m.dense_layers} dense layer(s)" if m.dense_layers else ""
    return (f"{param_number(active_param_count(m, padded_vocab))} active per token (attention, norms, router, "
            f"the top-{m.top_k} of {m.experts} routed experts{shared}{dense}; embedding and output as in "
            f"the total)")
