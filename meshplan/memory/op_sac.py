"""Activation bytes kept by torchtitan's op-level selective activation checkpointing
(``selective_ac_option = "op"``, meshplan's recompute ``op``) per layer and micro-batch on one
rank: the checkpoint's input and the outputs of the ops its policy saves (:func:`op_sac_terms`).
:func:`meshplan.memory.activations.layer_terms` gives them under recompute ``op``; the mm order
and which mms are saved are :mod:`meshplan.compute.recompute`'s.
"""

from __future__ import annotations

from meshplan.compute.recompute import op_sac_fuses_qkv, op_sac_mms, op_sac_saved_mms
from meshplan.memory.layer_dims import LayerDims, LocalSizes, Term


def op_sac_terms(dims: LayerDims, lc: LocalSizes, flash: bool, policy: str = "238fa99") -> list[Term]:
    """Kept by torchtitan's op-level selective AC (``selective_ac_option = "op"``): the
    checkpoint's input, and the outputs of the ops its policy must save: every odd-numbered
    ``aten.mm`` of the layer's forward (the count restarts per layer; every second mm is
    recomputed; :func:`meshplan.compute.recompute.op_sac_mms` gives the order: a Llama block's
    wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down) saves wq, wv, w1 and w2; MLA without a query
    latent wq, wkv_a, wkv_b, wo then the MLP's saves wq, wkv_b, w1, w2; with one wq_a, wkv_a, wo,
    w3), the SDPA kernel (output, ``d_v`` wide per head, and for flash its fp32 log-sum-exp) and
    the reduce-scatters (none at tp 1; with tp > 1 and sequence parallelism wo's and w_down's,
    ``tokens / tp x h`` each; the all-gathers' outputs are not saved: replayed in backward).
    ``dims.f`` 0: no MLP mms (an MoE layer without shared experts; the routed experts' grouped
    GEMMs are recomputed, their all-to-alls' outputs saved: :mod:`meshplan.memory.workingset`).
    Each mm's output at the rank's tokens: wq and wq_b ``a d / t``, wq_a ``c_q`` and wkv_a ``c_kv +
    r`` (replicated down projections), wkv_b ``a (d - r + d_v) / t``, wk ``g d / t``, wv ``g d_v /
    t``, wo and w_down ``h`` (the partial sums before a reduce-scatter), w_gate and w_up ``f / t``.
    Norms, RoPE, SiLU and the residual adds are recomputed. Under torchtitan b5bcd76's policy
    (``policy``, :func:`meshplan.compute.recompute.op_sac_fuses_qkv`) a layer without MLA projects Q,
    K and V with one mm, ``wqkv``, saved whole (``(a d + g d + g d_v) / t``): the attention keeps
    wk's output too, and wv's no longer apart.

    >>> from meshplan.memory.activations import _local
    >>> lc = _local(LayerDims(s=8, b=1, h=16, a=4, g=2, d=4, f=64, gated=True, dropout=False), 1, False, 1)
    >>> [(t.name, t.size_bytes) for t in op_sac_terms(LayerDims(8, 1, 16, 4, 2, 4, 64, True, False), lc, True)]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('layer input (checkpoint)', 256), ('wq output (saved mm)', 256), ('wv output (saved mm)', 128),
     ('attention output (saved SDPA)', 256), ('flash softmax statistics (fp32)', 128),
     ('w_gate output (saved mm)', 1024), ('w_down output (saved mm)', 256)]
    >>> [(t.name, t.size_bytes) for t in op_sac_terms(LayerDims(8, 1, 16, 4, 2, 4, 64, True, False), lc, True,
    ...                                                "b5bcd76")][1:2]
    [('wqkv output (saved mm)', 512)]
    """
    e, b, S, r = dims.act_bytes, dims.b, lc.seq, lc.r
    rows = lc.tok * b
    width = {"wq": (lc.aq * dims.d, "a*d/t"), "wq_b": (lc.aq * dims.d, "a*d/t"), "wq_a": (dims.q_lora, "c_q"),
             "wkv_a": (dims.kv_lora + dims.rope, "(c_kv+r)"), "wk": (lc.akv * dims.d, "g*d/t"),
             "wkv_b": (lc.aq * (dims.d - dims.rope + dims.d_v), "a*(d-r+d_v)/t"), "wv": (lc.akv * dims.d_v, "g*d_v/t"),
             "wo": (dims.h, "h"), "w_gate": (lc.f, "f/t"), "w_up": (lc.f, "f/t"), "w_down": (dims.h, "h"),
             "wqkv": (lc.aq * dims.d + lc.akv * (dims.d + dims.d_v), "(a*d+g*d+g*d_v)/t")}
    mms = op_sac_saved_mms(op_sac_mms(mla=bool(dims.kv_lora), q_lora=bool(dims.q_lora), gated=dims.gated,
                                      mlp=bool(dims.f), fused_qkv=op_sac_fuses_qkv(policy, bool(dims.kv_lora))))
    saved = [Term(f"{n} output (saved mm)", e * rows * width[n][0], f"{e}*{S}*b*{width[n][1]}") for n in mms]
    n_attn = sum(n.startswith("wq") or n.startswith("wk") or n in ("wv", "wo") for n in mms)
    out = [Term("layer input (checkpoint)", e * lc.rtok * b * dims.h, f"{e}*{S}*b*h{r}")] + saved[:n_attn] + [
        Term("attention output (saved SDPA)", e * rows * lc.aq * dims.d_v, f"{e}*{S}*b*a*d_v/t")]
    if flash:
        out.append(Term("flash softmax statistics (fp32)", 4 * lc.aq * rows, f"4*a*{S}*b/t"))
    # with tp > 1 (sequence parallel): the reduce-scatters after wo and w_down, each tokens/tp x h
    scattered = [Term(f"{g} reduce-scatter output (saved)", e * lc.rtok * b * dims.h, f"{e}*{S}*b*h{r}")
                 for g in ("wo", "w_down")] if r else []
    return out + saved[n_attn:] + scattered
