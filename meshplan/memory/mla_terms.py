"""Multi-head latent attention's own activation terms (DeepSeek-V2/V3), bytes on one rank of one
micro-batch, for :func:`meshplan.memory.activations.layer_terms`: the latents the replicated down
projections and latent norms keep (:func:`mla_latent_terms`) and the K/V storages the attention
keeps (:func:`mla_kv_terms`). Notation as :mod:`meshplan.memory.activations`: ``c_q``/``c_kv`` the
latent widths, ``r`` the RoPE head dim, ``d = d_nope + r`` the q/k head dim, ``d_v`` the value's.

Where the runtime keeps more than the tensors' own sizes (measured with FSDPMemTracker and the
saved tensors of autograd's graph, one rank of ``tests/data/validate_dense_mla_cp2_tp2sp.toml`` at
world 4: hidden 256, 8 heads, ``c_q`` 96, ``c_kv`` 64, ``d`` 16 + 8, ``d_v`` 16, 32 tokens, cp 2 x
tp 2 + SP, fp32; the activations' maximum 13.3% above the plan before these terms):

- v is a view. ``LatentAttention.forward`` (``runtime/execution/mla.py``) takes ``k_nope, v =
  torch.split(kv, ...)`` of the ``wkv_b`` output, so the attention keeps the whole ``(b, s, a/t,
  d_nope + d_v)`` output (torchtitan's DeepSeek-V3 attention splits it the same way); under
  all-gather CP ``ContextParallel._gather_cat`` (``runtime/execution/cp.py``) returns
  ``full[..., :d]`` and ``full[..., d:]`` of the permute-and-reshape copy of the all-gather output,
  so v keeps the whole sequence's ``(b, s, a/t, d + d_v)`` buffer: 20,480 B a layer measured
  (32 x 4 x 40 x 4 B) where v alone is 8,192. Megatron-LM's MLA takes ``value.contiguous()``
  (``megatron/core/transformer/multi_latent_attention.py`` at 003b4ce, ``qkv_up_proj_and_rope_apply``):
  its own ``d_v``, so none of this under ``framework = "megatron"``.
- k under all-gather CP: a view of the same buffer, kept by a fused kernel as it is (counted in the
  buffer); torch's math SDPA (``flash_attention = false``) keeps its own ``k * scale`` beside it.
- The latent norms (``q_a_norm``, ``kv_a_norm``) keep their normalised input ``x * rstd`` with
  ``[memory] unfused_norm`` (torch's decomposed ``rms_norm`` on CPU), as the attention and MLP norms
  do: 6,144 + 4,096 B a layer measured (16 tokens x 96 and x 64 x 4 B).
"""

from __future__ import annotations

from meshplan.memory.layer_dims import LayerDims, LocalSizes, Term

#: Names of the MLA latent terms (:func:`mla_latent_terms`), freed by the up/down projections' backward.
MLA_LATENT_TERMS = ("q latent (q_a output)", "q_b input (q_a norm output)",
                    "kv latent and rope key (kv_a output)", "kv_b input (kv_a norm output)",
                    "q_a norm normalised input (x*rstd)", "kv_a norm normalised input (x*rstd)")
#: Names of the MLA K/V terms (:func:`mla_kv_terms`) beside ``k``, freed by the attention core.
MLA_KV_TERMS = ("v (a view of the wkv_b output)", "v (a view of the gathered K/V buffer)",
                "k and v (views of the gathered K/V buffer)")


def mla_latent_terms(dims: LayerDims, lc: LocalSizes, unfused_norm: bool = False) -> list[Term]:
    """MLA's latents kept for backward: on all ``tok`` tokens of the rank, whole on every tp rank
    (the down projections are replicated): the query latent (``wq_a`` output, the input of
    ``q_a_norm``) and its normalised copy (``wq_b`` input), ``2 c_q`` each a token; the ``wkv_a``
    output, whose first ``c_kv`` columns are ``kv_a_norm``'s input (a view, so the whole ``c_kv + r``
    wide tensor stays) and the normalised latent (``wkv_b`` input); with ``unfused_norm`` each latent
    norm's ``x * rstd`` too (module docstring). None without query compression for the query's.

    >>> dims = LayerDims(s=8, b=1, h=64, a=4, g=4, d=6, f=1, dropout=False, dv=4, q_lora=16, kv_lora=8, rope=2)
    >>> lc = LocalSizes(tok=8, rtok=4, aq=2, akv=2, f=1, seq="s", r="/t")
    >>> [(t.name, t.size_bytes) for t in mla_latent_terms(dims, lc)]  # doctest: +NORMALIZE_WHITESPACE
    [('q latent (q_a output)', 256), ('q_b input (q_a norm output)', 256),
     ('kv latent and rope key (kv_a output)', 160), ('kv_b input (kv_a norm output)', 128)]
    >>> [(t.name, t.size_bytes) for t in mla_latent_terms(dims, lc, unfused_norm=True)][-2:]
    [('kv_b input (kv_a norm output)', 128), ('kv_a norm normalised input (x*rstd)', 128)]
    """
    if not dims.kv_lora:
        return []
    e, rows, S = dims.act_bytes, lc.tok * dims.b, lc.seq
    out = []
    if dims.q_lora:
        out += [Term(MLA_LATENT_TERMS[0], e * rows * dims.q_lora, f"{e}*{S}*b*c_q"),
                Term(MLA_LATENT_TERMS[1], e * rows * dims.q_lora, f"{e}*{S}*b*c_q")]
        out += [Term(MLA_LATENT_TERMS[4], e * rows * dims.q_lora, f"{e}*{S}*b*c_q")] if unfused_norm else []
    out += [Term(MLA_LATENT_TERMS[2], e * rows * (dims.kv_lora + dims.rope), f"{e}*{S}*b*(c_kv+r)"),
            Term(MLA_LATENT_TERMS[3], e * rows * dims.kv_lora, f"{e}*{S}*b*c_kv")]
    return out + ([Term(MLA_LATENT_TERMS[5], e * rows * dims.kv_lora, f"{e}*{S}*b*c_kv")] if unfused_norm else [])


def mla_kv_terms(dims: LayerDims, lc: LocalSizes, k: Term, heads: int, flash: bool, cp_kv: bool) -> list[Term]:
    """K and V as MLA under torch keeps them (module docstring), ``k`` the layer's K term and
    ``heads`` the local heads it is at. Without all-gather CP: ``k`` and v's ``wkv_b`` output,
    ``e s b a (d_nope + d_v) / t``. Under it (``cp_kv``): the whole sequence's buffer ``e s b a (d +
    d_v) / t``, with ``k`` beside it under the math SDPA (``flash`` false), or holding k too (fused).

    4 heads, d 6 (4 + 2), d_v 4, 8 tokens, fp32: the ``wkv_b`` output 4 x 8 x 4 x (4 + 4) = 1,024 B;
    cp 2's buffer 4 x 8 x 4 x (6 + 4) = 1,280 B, which a fused kernel's k shares:

    >>> dims = LayerDims(s=8, b=1, h=64, a=4, g=4, d=6, f=1, dropout=False, dv=4, kv_lora=8, rope=2, act_bytes=4)
    >>> k = Term("k", 4 * 8 * 4 * 6, "")
    >>> [(t.name, t.size_bytes) for t in mla_kv_terms(dims, LocalSizes(8, 8, 4, 4, 1, "s", ""), k, 4, True, False)]
    [('k', 768), ('v (a view of the wkv_b output)', 1024)]
    >>> [(t.name, t.size_bytes) for t in mla_kv_terms(dims, LocalSizes(4, 4, 4, 4, 1, "(s/cp)", ""), k, 4, True, True)]
    [('k and v (views of the gathered K/V buffer)', 1280)]
    >>> [t.size_bytes for t in mla_kv_terms(dims, LocalSizes(4, 4, 4, 4, 1, "(s/cp)", ""), k, 4, False, True)]
    [768, 1280]
    """
    e, b = dims.act_bytes, dims.b
    if not cp_kv:
        wkv_b = e * lc.tok * b * heads * (dims.d - dims.rope + dims.d_v)
        return [k, Term(MLA_KV_TERMS[0], wkv_b, f"{e}*{lc.seq}*b*a*(d_nope+d_v)/t")]
    buffer = e * dims.s * b * heads * (dims.d + dims.d_v)
    if flash:
        return [Term(MLA_KV_TERMS[2], buffer, f"{e}*s*b*a*(d+d_v)/t")]
    return [k, Term(MLA_KV_TERMS[1], buffer, f"{e}*s*b*a*(d+d_v)/t")]
