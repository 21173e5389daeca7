"""Closed-form estimates of the persistent model state per rank, printed beside the exact
framework accounting of :mod:`meshplan.memory.state` and labelled as what they are:

- **textbook accounting (ZeRO paper)** (:func:`zero_textbook_bytes`): Rajbhandari et al.
  2020 (arXiv 1910.02054, section 5, Figure 1), ``(2 + 2 + K) psi`` with K = 12;
- **Megatron's estimate** (:func:`megatron_estimate`): Megatron-LM
  ``report_theoretical_memory`` (``megatron/training/theoretical_memory_usage.py``),
  which divides everything by tp and leaves out the tied-output copy; printed for
  ``training.framework = "megatron"`` only (it is that run's own log line; beside a torch
  plan's state, many times smaller, a newcomer read it as the plan's), and not for a MoE mesh
  with ep > 1, whose experts it does not split (:func:`megatron_withheld`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec

TEXTBOOK_LABEL = "textbook accounting (ZeRO paper)"
MEGATRON_LABEL = "Megatron-LM report_theoretical_memory estimate (approximation)"
#: Added to :data:`MEGATRON_LABEL` where the plan's sharding is not what the formula models
#: (:func:`megatron_estimate`: zero2, zero3, hsdp).
MEGATRON_AS_IF = "as if run with Megatron-LM's distributed optimizer"


def megatron_withheld(model: ModelSpec, mesh: Mesh) -> Optional[str]:
    """Why ``plan`` does not print :func:`megatron_estimate` for this mesh, or None: a MoE model
    with its routed experts split over ep > 1, which the formula does not see (it counts every
    expert of every MoE layer on every rank, NVIDIA/Megatron-LM
    ``megatron/training/theoretical_memory_usage.py`` at 00caa53a), so its number is off by about
    the factor ep on the experts (DeepSeek-V3 at ep 64: 242.58 GiB for 4 experts per rank).

    >>> from types import SimpleNamespace
    >>> from meshplan import catalog
    >>> m = SimpleNamespace(ep=8, etp=1)  # Mixtral 8x7B at dp_shard 32 x ep 8 (its ep and etp)
    >>> print(megatron_withheld(catalog.model("mixtral-8x7b"), m))
    Megatron-LM report_theoretical_memory estimate: not shown: its formula ignores expert parallelism and counts all 8 experts of every MoE layer on every rank, where ep 8 x etp 1 leaves 1 per rank (the exact count above holds them)
    >>> megatron_withheld(catalog.model("llama3-8b"), m) is None
    True
    """
    if not model.is_moe or mesh.ep <= 1:
        return None
    return (f"Megatron-LM report_theoretical_memory estimate: not shown: its formula ignores expert parallelism and "
            f"counts all {model.experts} experts of every MoE layer on every rank, where ep {mesh.ep} x etp "
            f"{mesh.etp} leaves {model.experts // mesh.ep} per rank (the exact count above holds them)")


@dataclass(frozen=True)
class Estimate:
    """A labelled closed-form estimate: ``size_bytes`` per rank, ``params`` per rank (when
    the formula gives one) and the ``formula`` with its numbers."""

    label: str
    size_bytes: float
    formula: str
    params: Optional[float] = None


def zero_textbook_bytes(params: float, n: int, k: float = 12, *, stage: int, expert_params: float = 0,
                        expert_n: int = 1) -> Estimate:
    """Model-state bytes per rank, textbook accounting (ZeRO paper).

    Rajbhandari et al. 2020 (arXiv 1910.02054), section 5 and Figure 1, psi parameters,
    N ranks, K bytes of optimizer state per parameter (12 for mixed-precision Adam: fp32
    master, momentum, variance), fp16 parameters (2 psi) and gradients (2 psi):
    stage 0 (DDP) ``(2 + 2 + K) psi``; 1 ``4 psi + K psi / N``; 2 ``2 psi + (2 + K) psi / N``;
    3 ``(2 + 2 + K) psi / N``.

    >>> [zero_textbook_bytes(7.5e9, 64, stage=s).size_bytes / 1e9 for s in range(4)]
    [120.0, 31.40625, 16.640625, 1.875]

    MoE (``expert_params`` psi_e > 0): the paper's one group becomes two, the dense
    parameters sharded over N (fsdp) and this rank's routed experts (its ep x etp share)
    over N_e (efsdp), as FSDP2 (torchtitan) and Megatron-Core's expert data parallelism
    shard them: psi becomes ``psi + psi_e`` and psi / N becomes ``psi / N + psi_e / N_e``.
    Mixtral-8x7B at dp_shard 32, ep 8 (efsdp 4), stage 3: 16 x (1,605,636,096 / 32 +
    5,637,144,576 / 4) = 23,351,396,352 B:

    >>> zero_textbook_bytes(1605636096, 32, stage=3, expert_params=5637144576, expert_n=4).size_bytes
    23351396352.0
    """
    forms = {0: (4 + k, 0.0), 1: (4.0, k), 2: (2.0, 2 + k), 3: (0.0, 4 + k)}
    texts = {0: "(2 + 2 + K) {p}", 1: "4 {p} + K {s}", 2: "2 {p} + (2 + K) {s}", 3: "(2 + 2 + K) {s}"}
    if stage not in forms:
        raise ConfigError("stage", f"ZeRO stage {stage} is not one of 0 (DDP), 1, 2, 3")
    u, sh = forms[stage]
    value = u * (params + expert_params) + sh * (params / n + expert_params / expert_n)
    if expert_params:
        form = texts[stage].format(p="(psi + psi_e)", s="(psi / N + psi_e / N_e)")
        given = f"psi {params:g} (dense), N {n}, psi_e {expert_params:g} (routed experts), N_e {expert_n}"
    else:
        form = texts[stage].format(p="psi", s="psi / N")
        given = f"psi {params:g}, N {n}"
    return Estimate(label=f"{TEXTBOOK_LABEL}, ZeRO stage {stage}", size_bytes=value,
                    formula=f"{form} with {given}, K {k:g} = {value:g} B")


def megatron_estimate(model: ModelSpec, mesh: Mesh, training: TrainingSpec) -> Estimate:
    """Megatron-LM's ``compute_weight_and_optimizer_memory`` for the most loaded shard.

    Reproduced from ``megatron/training/theoretical_memory_usage.py``: layer parameters
    ``2h(f * g + n) + 2h * q * (1 + kv/a)`` (g = 3/2 gated, n = 2 LayerNorm / 1 RMSNorm,
    q = a * head_dim, biases and qk-norms ignored; MoE layers use experts x expert width;
    multi-latent attention: its ``q_lora_rank (h + a d_qk + 1) + kv_lora_rank (h + a (d_nope +
    d_v) + 1) + h d_rope + a d_v h``, the MLA weights and latent norms),
    final norm ``n h``, embedding ``h V_padded``; most loaded shard
    ``(block / pp + embedding) / tp`` (+ embedding / tp untied at pp 1); bytes per
    parameter 18, or ``6 + 12 / dp`` with the distributed optimizer (any sharding other
    than ``none`` here), dp = data-parallel degree without cp. It divides norms by tp,
    ignores ep and leaves out the last stage's tied copy: an approximation, shown beside
    the exact count. C9 tiny GPT: 3400 params, 30600 bytes (exact: 3488, 31392).

    The formula models two shardings only: ``none`` (18 B: bf16 parameters, fp32 gradients,
    master and Adam moments on every rank) and Megatron's distributed optimizer, ``zero1``
    (master and moments over dp). Under zero2 (gradients sharded too) and FSDP's zero3 / hsdp
    (parameters as well) its number is not this plan's run: the label then says
    :data:`MEGATRON_AS_IF` and the formula names what the plan shards besides (a Llama 3 70B
    FSDP plan at 58 GiB printed a bare 198.66 GiB, 6.04688 B per parameter, as its estimate).

    MoE: followed as Megatron-LM has it (NVIDIA/Megatron-LM
    ``megatron/training/theoretical_memory_usage.py`` at 00caa53a: every MoE layer holds
    ``moe_ffn_hidden_size x num_experts``, divided by pp and tp only; neither
    ``expert_model_parallel_size`` nor ``expert_tensor_parallel_size`` appears), so on a
    MoE model the formula says that it ignores expert parallelism: Mixtral 8x7B at
    dp_shard 32 x ep 8 comes out 277 GiB against a 24.5 GiB exact state.
    """
    h, a = model.hidden, model.q_heads
    tp, pp, dp = mesh.degree("tp"), mesh.degree("pp"), mesh.degree("dp")
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, tp)
    g = 1.5 if model.gated_mlp else 1.0
    n = 2 if model.norm == "layernorm" else 1
    q = model.d_head * a
    attn = 2 * h * q * (1 + model.n_kv_heads / a)
    if model.is_mla:  # Megatron's multi_latent_attention term: every MLA weight and latent norm once
        attn = sum(t.numel for t in model.mla_tensors())
    dense = 2 * h * (model.ffn * g + n) + attn
    shared = (model.shared_expert_ffn or model.moe_ffn) * model.shared_experts
    moe = 2 * h * (model.moe_ffn * model.experts * g + shared * g + n) + attn
    moe_layers = model.layers - model.dense_layers if model.is_moe else 0
    block = dense * (model.layers - moe_layers) + moe * moe_layers + n * h
    emb = h * pv
    shard = (block / pp + emb) / tp
    untied = ""
    if not model.tied_embeddings and pp == 1:
        shard += emb / tp
        untied = f" + {emb} / tp {tp} (untied output layer at pp 1)"
    per = 18.0 if training.sharding == "none" else 6 + 12 / dp
    moe_note = (f"; ignores expert parallelism (ep {mesh.ep} x etp {mesh.etp}): all {model.experts} experts of "
                f"every MoE layer on every rank, as Megatron-LM's formula counts them" if model.is_moe else "")
    label, as_if = MEGATRON_LABEL, ""
    if training.sharding not in ("none", "zero1"):
        label = f"{MEGATRON_LABEL}, {MEGATRON_AS_IF}"
        more = "gradients" if training.sharding == "zero2" else "gradients and parameters"
        as_if = (f"; this plan's {training.sharding} also shards the {more} over the data axes, "
                 f"which the formula does not count")
    return Estimate(label=label, size_bytes=shard * per, params=shard,
                    formula=f"({block:.0f} / pp {pp} + {emb}) / tp {tp}{untied} = {shard:.0f} params "
                            f"x {per:g} B = {shard * per:.0f} B{moe_note}{as_if}")
