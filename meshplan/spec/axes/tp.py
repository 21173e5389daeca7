"""Tensor parallelism (``tp``, with ``sequence_parallel`` Megatron-style SP): attention heads,
MLP width and the vocabulary split over tp ranks (column / row parallel linears).

Rules (handed cases C6, C7):

- ``q_heads % tp == 0`` and (``kv_heads % tp == 0`` or ``tp % kv_heads == 0``); when
  tp > kv_heads framework megatron runs Megatron-LM's QKV sub-sharding (TP ranks {2i, 2i+1}
  use KV head i at kv_heads 4, tp 8; each holds 1/tp of the fused QKV weight and all-gathers
  its output over tp every layer: :mod:`meshplan.spec.axes.tp_kv`); under framework torch tp
  past the KV heads is refused (rule ``torch_kv_heads``, :data:`TORCH_KV`: torchtitan
  replicates none); meshplan's own runtime keeps replicated copies with a ``kv_replica``
  gradient all-reduce (:func:`meshplan.comm.tp_grads.kv_replica_grad_numel`) for its dry runs;
- the MLP width divisible by tp (where the model has a dense MLP);
- padded vocabulary = ceil(V / (divisor * tp)) * divisor * tp (Megatron-LM
  ``_vocab_size_with_padding``; divisor 128 under Megatron, 1 under torch, which does not pad
  but shards the rows unevenly where tp does not divide V), a note;
- under SP the local sequence s / cp divisible by tp.
"""

from __future__ import annotations

from math import ceil
from typing import Optional

from meshplan.spec.axes.base import AxisDef, CollectiveKind, Dim, Rule, SearchColumn
from meshplan.spec.axes.tp_kv import qkv_note
from meshplan.spec.model import ModelSpec


def padded_vocab(vocab: int, divisor: int, tp: int) -> int:
    """Vocabulary padded to a multiple of ``divisor * tp``.

    >>> padded_vocab(32002, 128, 2), padded_vocab(128256, 64, 8), padded_vocab(50257, 128, 8)
    (32256, 128512, 51200)
    """
    m = divisor * tp
    return ceil(vocab / m) * m


def heads_reason(model: ModelSpec, tp: int) -> Optional[str]:
    """One-line reason when ``tp`` cannot split the attention heads, else None.

    >>> heads_reason(ModelSpec(layers=1, hidden=5120, ffn=1, q_heads=40, kv_heads=10, vocab=1), 4)
    'kv_heads 10 vs tp 4: need kv_heads % tp == 0 or tp % kv_heads == 0'
    """
    q, kv = model.q_heads, model.n_kv_heads
    if q % tp:
        return f"q_heads {q} is not divisible by tp {tp}"
    if kv % tp and tp % kv:
        return f"kv_heads {kv} vs tp {tp}: need kv_heads % tp == 0 or tp % kv_heads == 0"
    return None


def tp_misfit(model: ModelSpec, tp: int, node_gpus: int) -> Optional[str]:
    """Why ``tp`` cannot be the model's tensor degree on nodes of ``node_gpus`` GPUs (None when
    it can): it must split the attention heads (:func:`heads_reason`'s rule) and the dense MLP
    width (the rules of this axis), and a tp group must fill nodes evenly (``node_gpus % tp``
    or, above one node, ``tp % node_gpus``); the line names the degrees that satisfy all three.

    >>> m = ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=128256)
    >>> print(tp_misfit(m, 3, 8))
    tp 3 does not divide q_heads 64, ffn 28672 or the node's 8 GPUs (tp splits the attention heads and the MLP over its ranks, a group inside a node); use 1, 2, 4 or 8
    >>> tp_misfit(m, 4, 8) is None
    True
    """
    def bad(t: int) -> list[str]:
        out = [f"q_heads {model.q_heads}"] if model.q_heads % t else []
        out += [f"kv_heads {model.n_kv_heads}"] if not out and heads_reason(model, t) else []
        out += [f"ffn {model.ffn}"] if model.ffn % t and (not model.is_moe or model.dense_layers > 0) else []
        return out + ([f"the node's {node_gpus} GPUs"] if node_gpus % t and t % node_gpus else [])

    what = bad(tp)
    if not what:
        return None
    ok = [str(t) for t in range(1, node_gpus + 1) if not bad(t)]
    listed = ", ".join(what[:-1]) + (" or " if len(what) > 1 else "") + what[-1]
    use = "; use " + ", ".join(ok[:-1]) + (" or " if len(ok) > 1 else "") + ok[-1] if ok else ""
    return (f"tp {tp} does not divide {listed} (tp splits the attention heads and the MLP over its ranks, a group "
            f"inside a node){use}")


def kv_heads_local(kv_heads: int, tp: int) -> int:
    """KV heads on one tp rank: ``kv_heads / tp``, or 1 where tp exceeds them (each KV head
    replicated over ``tp / kv_heads`` ranks): the one rule :func:`local_heads` and
    :meth:`meshplan.memory.layer_dims.LayerDims.kv_local` read.

    >>> kv_heads_local(8, 2), kv_heads_local(2, 8)
    (4, 1)
    """
    return kv_heads // tp if tp <= kv_heads else 1


def local_heads(model: ModelSpec, tp: int) -> tuple[int, int, int]:
    """(local q heads, local KV heads, KV replication factor) on one tp rank.

    >>> local_heads(ModelSpec(layers=1, hidden=4096, ffn=1, q_heads=32, kv_heads=4, vocab=1), 8)
    (4, 1, 2)
    """
    kv = model.n_kv_heads
    return model.q_heads // tp, kv_heads_local(kv, tp), 1 if tp <= kv else tp // kv


def sdpa_kv_heads(q_heads, kv_heads, kv_expanded: bool):
    """The local K/V heads torch's attention reads (``q_heads``, ``kv_heads``: one tp rank's,
    :func:`local_heads`; scalars or numpy arrays alike): the q heads where K and V reach it
    repeated (``[memory] kv_expanded`` true: torchtitan's ``repeat_kv`` before SDPA up to
    pytorch/torchtitan ff0829c, v0.2.2, and HF transformers' ``repeat_kv``), else the KV heads
    (false, the default: torchtitan ff0829c and later pass ``enable_gqa=True`` to SDPA,
    ``models/llama3/model/model.py``:201, 275, 295 at e347b1e, whose flash kernel reads the KV
    heads as they are). The one rule the cp rows and the search's cp bounds
    (:func:`meshplan.spec.axes.cp.ring_rows`, :mod:`meshplan.search.comm_bounds`), torch's ring
    kernels and ``repeat_kv`` copies (:mod:`meshplan.compute.ring_attention`,
    :mod:`meshplan.compute.elementwise`) and the memory model's K/V (:mod:`meshplan.memory.cp_buffers`,
    :mod:`meshplan.memory.activations`) read.

    >>> sdpa_kv_heads(8, 1, False), sdpa_kv_heads(8, 1, True)   # Llama-3-70B at tp 8
    (1, 8)
    """
    return q_heads if kv_expanded else kv_heads


def _heads_bad(m, t, d):
    q, kv = m.q_heads, m.n_kv_heads
    return (q % d.tp != 0) | ((kv % d.tp != 0) & (d.tp % kv != 0))


def _heads(m, t, d):
    r = heads_reason(m, d.tp)
    if r:
        return (r,), ()
    q, kv, rep = local_heads(m, d.tp)
    if rep == 1 or t.framework == "torch":  # torch: no copies, rule torch_kv_heads refuses it
        return (), ()
    return (), (qkv_note(m, d.tp, q),)  # framework megatron: its QKV sub-sharding (tp_kv)


#: Why torchtitan (pytorch/torchtitan b5bcd76, 2026-08-21, the version framework torch follows) needs
#: tp to divide the KV heads: ``set_qkv_linear_sharding`` gives ``wq``, ``wkv`` (built twice, as wk and
#: wv) or the fused ``wqkv`` ``colwise_config()`` (torchtitan/models/common/decoder_sharding.py:182-192),
#: so each tp rank holds 1/tp of the n_kv_heads x head_dim rows of wk and wv, and ``QKVLinear.forward``
#: views its local K and V as whole heads, ``x.view(num_tokens, -1, self.head_dim)`` ("Use -1 instead of
#: n_heads (or n_kv_heads) to infer the actual local heads from sizes as TP may have sharded them",
#: attention.py:698-705; ``FusedQKVLinear`` the same with ``view(num_tokens, -1, self.r_dim,
#: self.head_dim)``, :769-773). No line replicates a KV head: at tp 16 with 8 KV heads a rank holds half
#: a head (64 of 128 features) and the view cannot make heads of it. Megatron-LM runs it: since
#: f7dfb99 (#2565, 2025-12-07; TransformerConfig allows num_query_groups a multiple or a divisor of tp)
#: each rank computes 1/tp of the fused QKV output and all-gathers it over tp, keeping its group's
#: slice (megatron/core/transformer/attention.py:353-366, :1851-1871 at d98e8a6), as meshplan plans
#: it (:mod:`meshplan.spec.axes.tp_kv`).
TORCH_KV = ("torchtitan shards wk/wv colwise over tp and views each rank's slice as whole KV heads (b5bcd76 "
            "decoder_sharding.py:182-192, attention.py:698-705); it replicates no KV head")


def torch_kv_reason(kv: int, tp: int, q: int, megatron: bool = True) -> str:
    """The ``torch_kv_heads`` rule's reason with its fix: the tp degrees torchtitan runs (those
    dividing both kv_heads and q_heads), or (``megatron``) framework megatron.

    >>> print(torch_kv_reason(8, 16, 64))
    framework torch: tp 16 with kv_heads 8: torchtitan shards wk/wv colwise over tp and views each rank's slice as whole KV heads (b5bcd76 decoder_sharding.py:182-192, attention.py:698-705); it replicates no KV head; fix: tp 1, 2, 4 or 8 (a divisor of kv_heads 8), or training.framework = "megatron" (Megatron-LM runs tp > kv_heads)
    """
    ok = [str(x) for x in range(1, kv + 1) if kv % x == 0 and q % x == 0]
    use = ", ".join(ok[:-1]) + (" or " if len(ok) > 1 else "") + ok[-1]
    other = ", or training.framework = \"megatron\" (Megatron-LM runs tp > kv_heads)" if megatron else ""
    return f"framework torch: tp {tp} with kv_heads {kv}: {TORCH_KV}; fix: tp {use} (a divisor of kv_heads {kv}){other}"


def torch_kv_refused(model: ModelSpec, tp: int) -> bool:
    """Whether torchtitan refuses ``tp`` for ``model``: tp past its KV heads (:data:`TORCH_KV`),
    the ``torch_kv_heads`` rule for a config of another framework."""
    kv = model.n_kv_heads
    return kv % tp != 0 and tp % kv == 0


def _torch_kv_bad(m, t, d):
    """Framework torch with tp past the KV heads (a multiple of kv_heads, which the ``heads`` rule
    allows as replicated copies; any other tp not dividing them the ``heads`` rule refuses) (:data:`TORCH_KV`)."""
    kv = m.n_kv_heads
    return (t.framework == "torch") & (kv % d.tp != 0) & (d.tp % kv == 0)


def _torch_kv(m, t, d):
    return ((torch_kv_reason(m.n_kv_heads, d.tp, m.q_heads),) if _torch_kv_bad(m, t, d) else ()), ()


def _ffn_bad(m, t, d):
    return (m.ffn % d.tp != 0) & (not m.is_moe or m.dense_layers > 0)


def _ffn(m, t, d):
    return ((f"ffn {m.ffn} is not divisible by tp {d.tp}",) if _ffn_bad(m, t, d) else ()), ()


def _vocab(m, t, d):
    tp, div = d.tp, t.vocab_pad_divisor
    v = padded_vocab(m.vocab, div, tp)
    if v == m.vocab:
        return (), ()
    if div == 1:
        return (), (f"vocab {m.vocab} does not divide by tp {tp}: the embedding and output rows are sharded "
                    f"unevenly (DTensor, torch.chunk: {v // tp} rows on the first ranks, "
                    f"{m.vocab - (ceil(m.vocab / (v // tp)) - 1) * (v // tp)} on the last holding any); memory and "
                    f"FLOPs use the largest shard ({v // tp} x tp {tp} = {v}), the loss uses {m.vocab}",)
    return (), (f"vocab padded {m.vocab} -> {v} = ceil(V / ({div} * tp {tp})) * {div * tp} ({v // tp} per tp rank); "
                f"memory and FLOPs use {v}, the loss uses {m.vocab}",)


def _seq_bad(m, t, d):
    return d.sp & ((t.seq_len // d.cp) % d.tp != 0)


def _exact(num: int, den: int) -> str:
    """``num / den`` as printed in a reason: a whole number as it is, a fraction to 6
    significant digits (never floored).

    >>> _exact(8192, 4), _exact(8192, 3)
    ('2048', '2730.67')
    """
    return str(num // den) if num % den == 0 else f"{num / den:.6g}"


def _seq(m, t, d):
    s, cp, tp = t.seq_len, d.cp, d.tp
    if _seq_bad(m, t, d):
        return (f"sequence parallel: local seq = seq_len {s} / cp {cp} = {_exact(s, cp)} is not a multiple of tp {tp}",), ()
    return (), ()


def max_tp(cfg) -> int:
    """``[search] max_tp``, or the GPUs of one NVLink domain (the node's GPUs when the
    catalog gives no domain size)."""
    node = cfg.cluster.node
    return cfg.search.max_tp or node.nvlink_domain_gpus or node.gpus


TP = AxisDef(
    doc="tensor parallel (with ``sequence_parallel`` for Megatron-style SP)",
    torchtitan=("tp",), megatron=("tp",),
    rules=(Rule("heads", 20, "heads vs tp: q_heads % tp, or kv_heads vs tp", _heads_bad, _heads),
           Rule("torch_kv_heads", 27, "framework torch: tp does not divide kv_heads (torchtitan replicates no KV "
                "head)", _torch_kv_bad, _torch_kv),
           Rule("ffn", 30, "ffn not divisible by tp", _ffn_bad, _ffn),
           Rule("vocab", 35, "vocabulary padded to a multiple of divisor * tp", None, _vocab),
           Rule("seq_tp", 80, "sequence parallel: local seq not divisible by tp", _seq_bad, _seq)),
    divides=(Dim.HEADS, Dim.FFN, Dim.VOCAB, Dim.SP_SEQUENCE),  # past kv_heads: megatron sub-shards QKV (tp_kv)
    shards=("parameters", "gradients", "optimizer state", "activations"),
    collectives=(CollectiveKind("all-reduce", "tp", "forward", "b x s/cp x h activation (no SP)"),
                 CollectiveKind("all-reduce", "tp", "backward",
                                "its gradient (no SP); replicated weights' gradients in FSDP's reduction"),
                 CollectiveKind("all-gather", "tp", "forward", "b x s/cp x h activation (SP; MoE routed outputs)"),
                 CollectiveKind("reduce-scatter", "tp", "forward", "b x s/cp x h activation (SP)"),
                 CollectiveKind("all-gather", "tp", "backward", "its gradient (SP)"),
                 CollectiveKind("reduce-scatter", "tp", "backward", "its gradient (SP)"),
                 CollectiveKind("all-reduce", "tp", "loss", "b x s/cp fp32 (vocab-parallel loss, 3 per micro-batch)"),
                 CollectiveKind("all-reduce", "tp", "step", "replicated weights' gradients (SP norms, router)"),
                 CollectiveKind("all-gather", "tp", "forward",
                                "b x s/cp x (q + 2 kv) d fused QKV output (megatron, tp > kv_heads)"),
                 CollectiveKind("reduce-scatter", "tp", "backward", "its gradient (megatron, tp > kv_heads)"),
                 CollectiveKind("all-reduce", "kv_replica", "step",
                                "a layer's wk/wv gradients over the tp / kv_heads ranks holding one KV head "
                                "(meshplan's own runtime's copies, tp > kv_heads)")),
    search=SearchColumn(column="tp", option="tp", bound=max_tp),
    weights={"tp": 1e5, "sp": 1e4},
)
