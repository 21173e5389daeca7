"""Model FLOP, MFU and HFU (:mod:`meshplan.compute.ops`' conventions; Korthikanti et al. 2022,
appendix A): one sequence's model FLOP (:func:`sequence_model_flops`), that paper's closed form
and its published 22B measurements (:func:`korthikanti_model_flops`,
:data:`KORTHIKANTI_22B_MEASURED`), utilization (:func:`utilization`) and why hardware FLOP exceed
model FLOP (:func:`flop_gap`).
"""

from __future__ import annotations

from meshplan.compute.shapes import MLA_REPLICATED, attention_shape, layer_gemms
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec


def sequence_model_flops(model: ModelSpec, seq_len: int) -> float:
    """Model FLOP of one sequence, forward + backward, per the module convention: every
    layer's GEMMs and causal-half attention (x3), and the output layer on the unpadded
    vocabulary (x3). Independent of the mesh.

    >>> from meshplan import catalog
    >>> m = catalog.model("megatron-22b")
    >>> f = sequence_model_flops(m, 2048)
    >>> s, L, h, V = 2048, 48, 6144, 51200
    >>> f == 3 * L * (24 * s * h * h + 2 * s * s * h) + 3 * 2 * s * h * V
    True
    """
    total = 0.0
    for i in range(model.layers):
        gemms = layer_gemms(model, 1, seq_len, layer=i)
        total += 3 * sum(g.flops for g in gemms)
        total += 3 * attention_shape(model, 1, 1, 1, seq_len).flops(causal_half=True)
    total += 3 * 2.0 * seq_len * model.hidden * model.vocab
    return total


#: Published development reference (Korthikanti et al. 2022, arXiv 2205.05198, Tables 3-5; 22B
#: model, one DGX A100, tp 8, micro-batch 4, seq 2048; ../shared/reference/public-facts.md):
#: (recompute, sequence parallel) -> (layer forward ms, layer backward ms, step s or None).
#: Printed beside predictions; no constant is fitted to it.
KORTHIKANTI_22B_MEASURED = {  # (recompute, sequence parallel): (layer forward ms, layer backward ms, step s)
    ("none", False): (7.7, 11.9, None),
    ("none", True): (7.2, 11.8, None),
    ("full", False): (7.7, 19.5, 1.42),
    ("selective", False): (7.7, 13.2, None),
    ("selective", True): (7.2, 13.1, 1.10),
}


def korthikanti_model_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int) -> float:
    """Model FLOP per iteration of a GPT model (4h MLP, multi-head attention) in Korthikanti
    et al. 2022, appendix A: ``72 B s L h^2 (1 + s / (6 h) + V / (12 h L))``; it counts the
    full (not causal-halved) attention, so it exceeds :func:`sequence_model_flops` x B by
    ``6 B s^2 h L``.

    >>> round(korthikanti_model_flops(4, 2048, 48, 6144, 51200) / 1e15, 4)
    1.1436
    """
    b, s, L, h, V = batch, seq_len, layers, hidden, vocab
    return 72.0 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def utilization(flops_per_step: float, step_s: float, ranks: int, gpu: GPUSpec, dtype: str = "bf16") -> float:
    """FLOP per step / (step seconds x ranks x dense peak of ``dtype``): MFU with model
    FLOP, HFU with hardware FLOP (Korthikanti et al. 2022, appendix A).

    >>> from meshplan import catalog
    >>> round(utilization(korthikanti_model_flops(4, 2048, 48, 6144, 51200), 1.10, 8,
    ...                   catalog.gpu("a100-sxm-80gb")), 3)
    0.417
    """
    return flops_per_step / (step_s * ranks * gpu.peak_flops(dtype))


#: Why an op's hardware FLOP exceed its model FLOP (:func:`flop_gap`), in printing order. MLA has
#: no KV heads to copy: its gap under tp is the down projections every tp rank runs whole
#: (:data:`meshplan.compute.shapes.MLA_REPLICATED`), named with those the model has.
FLOP_GAP_CAUSES = ("recompute", "flash backward recomputes QK^T", "full attention products (no causal skip)",
                   "padded vocabulary", "replicated KV heads", "replicated MLA down-projections")


def flop_gap(ops) -> dict[str, float]:
    """Hardware minus model FLOP of ``ops`` (iterable of :class:`~meshplan.compute.ops.Op`) by cause, the reasons
    HFU exceeds MFU without any recompute policy: recomputed ops (model FLOP 0); a flash
    kernel's backward, 2.5x its forward against the model's 2x (FlashAttention-2 recomputes
    ``QK^T``); a non-flash kernel's full ``QK^T`` and ``PV`` against the causal half; the
    output layer over the padded vocabulary; wk and wv over replicated KV heads; MLA's
    replicated down projections, named ``replicated MLA down-projections (wq_a, wkv_a)`` with
    those that have a gap (V2-Lite has no wq_a). Causes with no gap are left out.

    Llama-3-8B, tp 2, seq 8192, flash, no recompute: only the flash backward, 0.5 x the
    causal-half forward attention FLOP per layer (``tests/test_mfu_hfu.py``)."""
    out: dict[str, float] = {}
    mla: list[str] = []
    for o in ops:
        d = o.hardware_flops - o.model_flops
        if d <= 0:
            continue
        base = o.name.split(".")[0]
        cause = ("recompute" if o.recompute else FLOP_GAP_CAUSES[1] if o.kind == "attention" else
                 FLOP_GAP_CAUSES[2] if base in ("qk^T", "pv") else FLOP_GAP_CAUSES[3] if o.block == "head"
                 else FLOP_GAP_CAUSES[5] if base in MLA_REPLICATED else FLOP_GAP_CAUSES[4])
        if cause == FLOP_GAP_CAUSES[5] and base not in mla:
            mla.append(base)
        out[cause] = out.get(cause, 0.0) + d
    named = {FLOP_GAP_CAUSES[5]: f"{FLOP_GAP_CAUSES[5]} ({', '.join(n for n in MLA_REPLICATED if n in mla)})"}
    return {named.get(c, c): out[c] for c in FLOP_GAP_CAUSES if c in out}
