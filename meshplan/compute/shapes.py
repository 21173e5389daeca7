"""Local GEMM and attention shapes per rank.

A GEMM is (M, N, K): output M x N, reduction over K, ``2*M*N*K`` FLOP. Forward of a linear
layer with weight (K -> N) on M tokens is (M, N, K); its backward is two GEMMs with the
same FLOPs, data-gradient (M, K, N) and weight-gradient (N, K, M) (Narayanan et al. SC'21,
section 3: backward = 2x forward).

Tokens per rank per micro-batch: ``M = micro_batch * seq_len / cp``. With sequence
parallelism the activations between blocks are split over tp, but column-parallel GEMMs
run on the all-gathered M (Korthikanti et al. 2022, section 4.2.2), so M is unchanged.

Seed example (Llama-3-70B, tp 8): the q projection (output width 8192) gives each rank
1024 output features:

>>> from meshplan.spec.model import ModelSpec
>>> m = ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, head_dim=128, vocab=128256)
>>> [g for g in layer_gemms(m, tp=8, tokens=8192) if g.name == "wq"][0]
Gemm(name='wq', m=8192, n=1024, k=8192, count=1)
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil

from meshplan.spec.model import ModelSpec
from meshplan.mesh.tpsplit import local_heads


@dataclass(frozen=True)
class Gemm:
    """One forward GEMM (M, N, K), repeated ``count`` times (e.g. local experts)."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        """Forward FLOP: 2*M*N*K*count."""
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class Attention:
    """Core attention on one rank: batch, local q heads, local KV heads, query and key
    lengths, head dim. FLOP (forward, QK^T and PV): ``4*b*heads*s_q*s_kv*d``, halved for a
    causal mask (the convention named by ``causal_half``)."""

    batch: int
    q_heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int

    def flops(self, causal_half: bool = True) -> float:
        f = 4.0 * self.batch * self.q_heads * self.seq_q * self.seq_kv * self.head_dim
        return f / 2 if causal_half else f


def layer_gemms(model: ModelSpec, tp: int, tokens: int, layer: int = -1,
                ep: int = 1, etp: int = 1) -> list[Gemm]:
    """Forward GEMMs of one transformer layer on one rank for ``tokens`` local tokens.

    ``layer`` selects dense or MoE (-1: the last layer). MoE experts assume balanced
    routing. When etp < tp the tp ranks split their (identical) tokens tp/etp ways before
    dispatch (torchtitan's token-split sequence parallel for experts), so each rank routes
    ``tokens * etp / tp`` distinct tokens and each local expert sees
    ``tokens * etp / tp * ep * top_k / experts`` tokens after the all-to-all; the router
    (replicated over tp) runs on those ``tokens * etp / tp`` tokens too
    (:mod:`meshplan.runtime.execution.moe`).
    """
    h, d = model.hidden, model.d_head
    q_l, kv_l, _ = local_heads(model, tp)
    out = [Gemm("wq", tokens, q_l * d, h), Gemm("wk", tokens, kv_l * d, h),
           Gemm("wv", tokens, kv_l * d, h), Gemm("wo", tokens, h, q_l * d)]
    layer = model.layers - 1 if layer < 0 else layer
    if model.is_moe_layer(layer):
        per_expert = max(1, tokens * etp // tp * ep * model.top_k // model.experts)
        f, n_local = model.moe_ffn // etp, model.experts // ep
        out.append(Gemm("router", max(1, tokens * etp // tp), model.experts, h))  # each rank's own tokens
        if model.gated_mlp:
            out.append(Gemm("expert_w_gate", per_expert, f, h, n_local))
        out += [Gemm("expert_w_up", per_expert, f, h, n_local), Gemm("expert_w_down", per_expert, h, f, n_local)]
        if model.shared_experts:
            sf = (model.shared_expert_ffn or model.moe_ffn) * model.shared_experts // tp
            out += [Gemm("shared_w_up", tokens, sf * (2 if model.gated_mlp else 1), h),
                    Gemm("shared_w_down", tokens, h, sf)]
        return out
    f = model.ffn // tp
    if model.gated_mlp:
        out.append(Gemm("w_gate", tokens, f, h))
    out += [Gemm("w_up", tokens, f, h), Gemm("w_down", tokens, h, f)]
    return out


def expert_capacity(tokens: int, top_k: int, experts: int) -> int:
    """Token copies one expert takes from the ``tokens`` tokens one rank routes: capacity
    factor 1, ``ceil(tokens * top_k / experts)`` (expert capacity of the Switch
    Transformer, Fedus et al. 2021, section 2.2, with top_k copies per token). The runtime MoE (:mod:`meshplan.runtime.execution.moe`) drops copies beyond it and pads the
    rest, so its dispatch buffer is always ``experts x capacity`` tokens.

    >>> expert_capacity(64, 2, 8), expert_capacity(10, 2, 8)
    (16, 3)
    """
    return ceil(tokens * top_k / experts)


def output_gemm(model: ModelSpec, tp: int, tokens: int, padded_vocab: int) -> Gemm:
    """Output layer (logits) on the last stage: (tokens, V_padded / tp, hidden)."""
    return Gemm("output", tokens, padded_vocab // tp, model.hidden)


def attention_shape(model: ModelSpec, tp: int, cp: int, micro_batch: int, seq_len: int) -> Attention:
    """Core attention per rank: local heads from tp, local queries ``seq/cp`` against all
    ``seq`` keys (CP gathers K/V, or ring-passes them: same FLOP)."""
    q_l, kv_l, _ = local_heads(model, tp)
    return Attention(micro_batch, q_l, kv_l, seq_len // cp, seq_len, model.d_head)


def backward_gemms(g: Gemm) -> list[Gemm]:
    """Data-gradient (M, K, N) and weight-gradient (N, K, M) GEMMs of forward GEMM ``g``.

    >>> [(b.name, b.m, b.n, b.k) for b in backward_gemms(Gemm("wq", 8, 4, 2))]
    [('wq.dgrad', 8, 2, 4), ('wq.wgrad', 4, 2, 8)]
    """
    return [Gemm(g.name + ".dgrad", g.m, g.k, g.n, g.count), Gemm(g.name + ".wgrad", g.n, g.k, g.m, g.count)]
