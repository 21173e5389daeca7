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

Multi-head latent attention (DeepSeek-V2/V3, :func:`mla_gemms`) splits as torchtitan's
DeepSeek-V3 TP plan and Megatron-Core's MLA: the down projections ``wq_a`` (hidden ->
q_lora_rank) and ``wkv_a`` (hidden -> kv_lora_rank + qk_rope_head_dim, the latent and the
shared RoPE key) are replicated, every tp rank running them on all its tokens; the up
projections ``wq_b`` (or ``wq`` without query compression) and ``wkv_b`` are column-parallel
over whole heads; ``wo`` is row-parallel. DeepSeek-V3 at tp 8 (16 of the 128 heads per rank):

>>> from meshplan import catalog
>>> [(g.name, g.n, g.k) for g in layer_gemms(catalog.model("deepseek-v3"), tp=8, tokens=4096)][:5]
[('wq_a', 1536, 7168), ('wq_b', 3072, 1536), ('wkv_a', 576, 7168), ('wkv_b', 4096, 512), ('wo', 7168, 2048)]
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.compute.routing import RoutingOptions, expert_capacity, routed_tokens, routing  # noqa: F401 (re-export)
from meshplan.spec.axes.base import Dim
from meshplan.spec.axes.registry import divisors
from meshplan.spec.axes.tp_kv import fused_qkv_local_widths, qkv_gathered
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.mesh.resolve import DERIVED, Mesh
from meshplan.mesh.tpsplit import local_heads, padded_vocab


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
    lengths, q/k head dim ``head_dim`` and value head dim ``v_head_dim`` (0: the same; MLA:
    DeepSeek's 192 and 128). FLOP (forward): ``QK^T`` is ``2*b*heads*s_q*s_kv*d_qk`` and
    ``PV`` ``2*b*heads*s_q*s_kv*d_v``, together ``4*b*heads*s_q*s_kv*d`` when the two dims
    are equal; halved for a causal mask (the convention named by ``causal_half``).

    >>> Attention(1, 16, 16, 4096, 4096, 192, 128).flops() == 2 * 16 * 4096 * 4096 * (192 + 128) / 2
    True
    """

    batch: int
    q_heads: int
    kv_heads: int
    seq_q: int
    seq_kv: int
    head_dim: int
    v_head_dim: int = 0

    @property
    def d_v(self) -> int:
        """Value (and output) head dim."""
        return self.v_head_dim or self.head_dim

    def flops(self, causal_half: bool = True) -> float:
        f = 2.0 * self.batch * self.q_heads * self.seq_q * self.seq_kv * (self.head_dim + self.d_v)
        return f / 2 if causal_half else f


def layer_gemms(model: ModelSpec, tp: int, tokens: int, layer: int = -1,
                ep: int = 1, etp: int = 1, routing_options: RoutingOptions = RoutingOptions(),
                ffn_ways: int = 0, framework: str = "torch") -> list[Gemm]:
    """Forward GEMMs of one transformer layer on one rank for ``tokens`` local tokens;
    ``tp`` splits the heads (and the tokens routed per rank), ``ffn_ways`` the dense MLP's
    and the shared experts' width (0: ``tp``); wq, wk, wv's widths: :func:`qkv_local_features`
    (``framework``: the training contract's).

    ``layer`` selects dense or MoE (-1: the last layer). MoE experts: the rows of the
    busiest rank's local experts under ``routing_options`` (:func:`meshplan.compute.routing.routing`:
    ``ep x C`` each with a capacity; dropless, the hottest expert's rows and the others'
    as two GEMMs when a stated imbalance makes them differ). Each rank routes the ``T`` tokens of
    :func:`meshplan.compute.routing.routed_tokens` (the router's M) and each local expert's GEMM takes
    ``g`` ranks' received rows: under torch the tp ranks split their (identical) tokens tp/etp ways
    before dispatch (``T = tokens x etp / tp``, ``g`` 1; :mod:`meshplan.runtime.execution.moe`),
    under Megatron-LM each rank routes its own sequence shard (``T = tokens / tp``) and its etp ranks
    all-gather what they received (``g = etp``): at capacity factor 1, balanced, each local expert
    sees ``g x ep x ceil(T x top_k / experts)`` rows.
    """
    h = model.hidden
    if model.is_mla:
        out = mla_gemms(model, tp, tokens)
    else:
        q_n, kv_n = qkv_local_features(model, tp, framework)
        out = [Gemm("wq", tokens, q_n, h), Gemm("wk", tokens, kv_n, h),
               Gemm("wv", tokens, kv_n, h), Gemm("wo", tokens, h, q_n)]
    layer = model.layers - 1 if layer < 0 else layer
    if model.is_moe_layer(layer):
        routed, g = routed_tokens(tokens, tp, etp, framework)
        r = routing(routing_options, routed, model.top_k, model.experts, ep)
        f, n_local = model.moe_ffn // etp, model.experts // ep
        out.append(Gemm("router", routed, model.experts, h))  # each rank's own tokens
        groups = [("", max(1, g * r.hot_expert_rows), n_local)]
        if r.other_expert_rows != r.hot_expert_rows and n_local > 1:
            groups = [(" (hottest)", max(1, g * r.hot_expert_rows), 1), ("", g * r.other_expert_rows, n_local - 1)]
        names = (["expert_w_gate"] if model.gated_mlp else []) + ["expert_w_up", "expert_w_down"]
        for suffix, rows, count in groups:
            out += [Gemm(n + suffix, rows, h if n == "expert_w_down" else f, f if n == "expert_w_down" else h, count)
                    for n in names]
        if model.shared_experts:
            sf = (model.shared_expert_ffn or model.moe_ffn) * model.shared_experts // (ffn_ways or tp)
            out += [Gemm("shared_w_up", tokens, sf * (2 if model.gated_mlp else 1), h),
                    Gemm("shared_w_down", tokens, h, sf)]
        return out
    f = model.ffn // (ffn_ways or tp)
    if model.gated_mlp:
        out.append(Gemm("w_gate", tokens, f, h))
    out += [Gemm("w_up", tokens, f, h), Gemm("w_down", tokens, h, f)]
    return out


def qkv_local_features(model: ModelSpec, tp: int, framework: str = "torch") -> tuple[int, int]:
    """(wq, wk) output features on one tp rank (wv's as wk's; not MLA): whole local heads,
    ``q/tp x d`` and ``kv_l x d`` with ``kv_l`` from :func:`local_heads` (one KV head, computed
    on each of the ``tp / kv`` ranks that hold it, past the KV heads); under framework megatron at
    tp > kv_heads Megatron-LM's fused ``linear_qkv`` columns, ``q d / tp`` and ``kv d / tp``
    (:func:`meshplan.spec.axes.tp_kv.fused_qkv_local_widths`: one GEMM of N ``(q + 2 kv) d /
    tp``, no K/V column computed twice).

    Handed case C6 (32 q / 4 KV heads of 128, tp 8): torch's layout 4 x 128 = 512 and 1 x 128 =
    128 (768 a rank); Megatron-LM's 512 and 4 x 128 / 8 = 64 (N 512 + 2 x 64 = 640):

    >>> m = ModelSpec(layers=2, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> qkv_local_features(m, 8), qkv_local_features(m, 8, "megatron"), qkv_local_features(m, 4, "megatron")
    ((512, 128), (512, 64), (1024, 128))
    """
    if qkv_gathered(framework, tp, model.n_kv_heads):
        return fused_qkv_local_widths(model, tp)
    q_l, kv_l, _ = local_heads(model, tp)
    return q_l * model.d_head, kv_l * model.d_head


def fused_qkv_words(model: ModelSpec, tp: int, framework: str) -> str:
    """The line under the plan's GEMM table that says how framework megatron runs wq, wk and wv:
    one fused ``linear_qkv`` GEMM (:func:`meshplan.compute.kernel_time.qkv_fused_ops`) of N their
    widths' sum (:func:`qkv_local_features`), and past the KV heads why wk and wv are narrower
    than one head; "" for framework torch and MLA (no fused QKV).

    >>> m = ModelSpec(layers=2, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> print(fused_qkv_words(m, 8, "megatron"))
    Q, K, V (framework megatron): one fused linear_qkv GEMM per rank, N = wq 512 + wk 64 + wv 64 = 640 = (32 + 2 x 4) x 128 / tp 8: Megatron-LM's QKV sub-sharding splits the fused columns over tp, so wk and wv are each rank's mean share (4 x 128 / 8 = 64) and no K/V column is computed twice
    >>> fused_qkv_words(m, 4, "megatron"), fused_qkv_words(m, 8, "torch")
    ('Q, K, V (framework megatron): one fused linear_qkv GEMM per rank, N = wq 1024 + wk 128 + wv 128 = 1280', '')
    """
    if framework != "megatron" or model.is_mla:
        return ""
    q, kv = qkv_local_features(model, tp, framework)
    out = f"Q, K, V (framework megatron): one fused linear_qkv GEMM per rank, N = wq {q} + wk {kv} + wv {kv} = {q + 2 * kv}"
    if not qkv_gathered(framework, tp, model.n_kv_heads):
        return out
    g, d = model.n_kv_heads, model.d_head
    return (out + f" = ({model.q_heads} + 2 x {g}) x {d} / tp {tp}: Megatron-LM's QKV sub-sharding splits the fused "
            f"columns over tp, so wk and wv are each rank's mean share ({g} x {d} / {tp} = {kv}) and no K/V column is "
            "computed twice")


def fused_qkv_parts(gemms: list[Gemm], fused_qkv: bool) -> list[Gemm]:
    """The wq, wk, wv GEMMs of ``gemms`` that run as one fused GEMM (``fused_qkv``: the workload's,
    Megatron-LM's ``linear_qkv`` or torchtitan b5bcd76's ``wqkv``:
    :attr:`~meshplan.spec.training_knobs.TrainingKnobs.fuses_qkv`), in that order; [] when they are not
    fused (torch at 238fa99, or MLA, which has no wk or wv)."""
    qkv = [g for g in gemms if g.name in ("wq", "wk", "wv")] if fused_qkv else []
    return qkv if len(qkv) == 3 else []


def fused_qkv_gemm(parts: list[Gemm]) -> Gemm:
    """Megatron-LM's fused ``linear_qkv`` GEMM of the wq, wk, wv ``parts`` (same M and K): one
    (M, N, K) with N their widths' sum, ``(q + 2 kv) d / tp`` (:func:`qkv_local_features`).

    Handed case C6 (32 q / 4 KV heads of 128, h 4096, tp 8, 1024 tokens): N = 512 + 64 + 64 = 640:

    >>> m = ModelSpec(layers=2, hidden=4096, ffn=1, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> fused_qkv_gemm(fused_qkv_parts(layer_gemms(m, 8, 1024, framework="megatron"), True))
    Gemm(name='qkv', m=1024, n=640, k=4096, count=1)
    """
    return Gemm("qkv", parts[0].m, sum(g.n for g in parts), parts[0].k)


def step_gemms(gemms: tuple[Gemm, ...] | list[Gemm], fused_qkv: bool) -> list[Gemm]:
    """The forward GEMMs as the step model times them (:func:`meshplan.compute.layer.layer_costs`):
    ``gemms`` with wq, wk and wv replaced, where ``fused_qkv`` fuses them
    (:func:`fused_qkv_parts`), by the one :func:`fused_qkv_gemm` at wq's place. ``compare``'s
    efficiency rows and ``bench gemm``'s shapes are these.

    >>> m = ModelSpec(layers=2, hidden=4096, ffn=16384, q_heads=32, kv_heads=4, head_dim=128, vocab=1)
    >>> [(g.name, g.n) for g in step_gemms(layer_gemms(m, 8, 1024, framework="megatron"), True)][:3]
    [('qkv', 640), ('wo', 4096), ('w_gate', 2048)]
    >>> [g.name for g in step_gemms(layer_gemms(m, 8, 1024), False)][:3]
    ['wq', 'wk', 'wv']
    """
    parts = fused_qkv_parts(list(gemms), fused_qkv)
    if not parts:
        return list(gemms)
    return [fused_qkv_gemm(parts) if g.name == "wq" else g for g in gemms if g not in parts[1:]]


#: MLA GEMMs whose weights every tp rank holds whole (:meth:`ModelSpec._mla_tensors`): each
#: rank computes them on all its tokens, so their model FLOP count once per tp group.
MLA_REPLICATED = ("wq_a", "wkv_a")
#: The attention block's GEMMs, dense and MLA.
ATTENTION_GEMMS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b")


def mla_gemms(model: ModelSpec, tp: int, tokens: int) -> list[Gemm]:
    """Forward GEMMs of multi-head latent attention on one rank (module docstring), heads
    ``a``, local heads ``a / tp``, T ``tokens``:

    - ``wq_a`` (T, q_lora_rank, h) replicated, then ``wq_b`` (T, a/tp (nope + rope), q_lora_rank);
      without query compression one ``wq`` (T, a/tp (nope + rope), h);
    - ``wkv_a`` (T, kv_lora_rank + rope, h) replicated (the RoPE key is shared by the heads);
    - ``wkv_b`` (T, a/tp (nope + v), kv_lora_rank): each head's key (no-RoPE part) and value;
    - ``wo`` (T, h, a/tp v).

    >>> from meshplan import catalog
    >>> [(g.name, g.m, g.n, g.k) for g in mla_gemms(catalog.model("deepseek-v2-lite"), 4, 8)]
    [('wq', 8, 768, 2048), ('wkv_a', 8, 576, 2048), ('wkv_b', 8, 1024, 512), ('wo', 8, 2048, 512)]
    """
    h, a = model.hidden, model.q_heads // tp
    nope, rope, v = model.qk_nope_head_dim or 0, model.qk_rope_head_dim or 0, model.d_v
    kv = model.kv_lora_rank or 0
    if model.q_lora_rank is None:
        out = [Gemm("wq", tokens, a * (nope + rope), h)]
    else:
        out = [Gemm("wq_a", tokens, model.q_lora_rank, h), Gemm("wq_b", tokens, a * (nope + rope), model.q_lora_rank)]
    return out + [Gemm("wkv_a", tokens, kv + rope, h), Gemm("wkv_b", tokens, a * (nope + v), kv),
                  Gemm("wo", tokens, h, a * v)]


def output_gemm(model: ModelSpec, tp: int, tokens: int, padded_vocab: int) -> Gemm:
    """Output layer (logits) on the last stage: (tokens, V_padded / tp, hidden)."""
    return Gemm("output", tokens, padded_vocab // tp, model.hidden)


def attention_shape(model: ModelSpec, tp: int, cp: int, micro_batch: int, seq_len: int) -> Attention:
    """Core attention per rank: local heads from tp, local queries ``seq/cp`` against all
    ``seq`` keys (CP gathers K/V, or ring-passes them: same FLOP)."""
    q_l, kv_l, _ = local_heads(model, tp)
    return Attention(micro_batch, q_l, kv_l, seq_len // cp, seq_len, model.d_head,
                     model.d_v if model.d_v != model.d_head else 0)


@dataclass(frozen=True)
class LocalShapes:
    """One rank's shapes on a mesh: ``split`` (ways each :class:`~meshplan.spec.axes.base.Dim`
    is divided), ``tokens`` per micro-batch (``micro_batch x seq_len / split[sequence]``),
    the forward ``gemms`` of the last layer and the output layer, and the core ``attention``."""

    split: dict[Dim, int]
    tokens: int
    gemms: tuple[Gemm, ...]
    attention: Attention


def local_split(mesh: Mesh) -> dict[Dim, int]:
    """Ways each tensor dimension is divided on one rank of ``mesh``, from the registered
    axes' :attr:`~meshplan.spec.axes.base.AxisDef.divides` (one loop over the dimensions,
    :func:`meshplan.spec.axes.registry.divisors`).

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> s = local_split(resolve_mesh(MeshSpec(names=["dp_shard", "cp", "tp"], shape=[2, 2, 4]), 16))
    >>> s[Dim.SEQUENCE], s[Dim.HEADS], s[Dim.FFN], s[Dim.SP_SEQUENCE], s[Dim.BATCH], s[Dim.EXPERTS]
    (2, 4, 4, 1, 2, 1)
    """
    return divisors(lambda a: own_degree(mesh, a), mesh.sequence_parallel)  # ints: a mesh's degrees


def own_degree(mesh: Mesh, axis: str) -> int:
    """Degree of registered axis ``axis`` itself on ``mesh`` (1 if absent): ``dp`` is the
    one-axis data axis, not the derived dp = replicate x shard of the same name."""
    return mesh.layout.degree(axis) if axis in DERIVED or axis in mesh.layout.names else mesh.degree(axis)


def local_shapes(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> LocalShapes:
    """:class:`LocalShapes` of one rank of ``mesh``: heads and vocab split ``split[heads]``
    and ``split[vocab]`` ways, the MLP ``split[ffn]``, experts ``split[experts]``, an
    expert's width ``split[expert_ffn]``, the sequence ``split[sequence]`` (GEMM rows and
    attention queries; keys and values stay the whole sequence, gathered as CP does).

    Seed mesh (Llama-3-70B, dp_shard 8 x tp 8, b 1, s 8192): 8192 tokens, 1024 q features.

    >>> from meshplan import catalog
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> sh = local_shapes(catalog.model("llama3-70b"), TrainingSpec(global_batch=8, seq_len=8192),
    ...                   resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), 64))
    >>> sh.tokens, [g.n for g in sh.gemms if g.name == "wq"], sh.attention.q_heads
    (8192, [1024], 8)
    """
    split, t = local_split(mesh), training
    heads, ways = split[Dim.HEADS], split[Dim.SEQUENCE]
    tokens = t.micro_batch * t.seq_len // ways
    gemms = layer_gemms(model, heads, tokens, ep=split[Dim.EXPERTS], etp=split[Dim.EXPERT_FFN],
                        routing_options=RoutingOptions.of(t), ffn_ways=split[Dim.FFN], framework=t.framework)
    vocab = split[Dim.VOCAB]
    gemms.append(output_gemm(model, vocab, tokens, padded_vocab(model.vocab, t.vocab_pad_divisor, vocab)))
    return LocalShapes(split, tokens, tuple(gemms), attention_shape(model, heads, ways, t.micro_batch, t.seq_len))


def backward_gemms(g: Gemm) -> list[Gemm]:
    """Data-gradient (M, K, N) and weight-gradient (N, K, M) GEMMs of forward GEMM ``g``.

    >>> [(b.name, b.m, b.n, b.k) for b in backward_gemms(Gemm("wq", 8, 4, 2))]
    [('wq.dgrad', 8, 2, 4), ('wq.wgrad', 4, 2, 8)]
    """
    return [Gemm(g.name + ".dgrad", g.m, g.k, g.n, g.count), Gemm(g.name + ".wgrad", g.n, g.k, g.m, g.count)]
