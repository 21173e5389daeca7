"""Compute model of one rank: FLOP, HBM bytes and time of every op of a transformer layer,
the embedding and the output layer, per micro-batch; MFU and HFU.

Conventions (named so a number lines up with another tool's):

- **GEMMs**: forward shapes from :func:`meshplan.compute.shapes.layer_gemms`; backward is the
  data-gradient GEMM (pass ``backward_input``, "B") and the weight-gradient GEMM (pass
  ``backward_weight``, "W") of :func:`meshplan.compute.shapes.backward_gemms`: 2x forward FLOP.
  Time by :func:`meshplan.compute.gemm.gemm_time` (shape model, or a measured table).
- **Attention core, causal convention**: model FLOP = half of the full ``QK^T`` and ``PV``
  products, ``2 b a s_q s_kv d`` forward (:meth:`meshplan.compute.shapes.Attention.flops` with
  ``causal_half``), backward 2x. Executed (hardware) FLOP: a flash kernel skips the masked
  blocks (the same half) and its backward recomputes ``QK^T`` (5 products instead of 4:
  2.5x forward; FlashAttention-2, Dao 2023, arXiv 2307.08691); a non-flash implementation
  (Megatron-LM 2022) computes the full products and materialises the scores, so its
  softmax and dropout are memory-bound ops over ``b a s_q s_kv`` scores. Flash kernels are
  timed at the published FlashAttention rates of the catalog (:mod:`meshplan.compute.measured`;
  a measured ``GemmTable.attention`` entry first); for a GPU without catalog data, at the GEMM
  ceiling with wave quantization over (batch, heads, 128-query blocks).
- **Memory-bound ops** (norms, residual adds with optional dropout, RoPE, SiLU/GeLU,
  softmax statistics, cross entropy, MoE permutation, linear-bias adds and gradients): time =
  bytes read + written / achievable bandwidth (catalog: BabelStream Triad, norms on the fused
  norm curve; datasheet peak for a GPU without catalog data), each operand once; no FLOP counted for them
  (MFU and HFU count matrix products only, as Korthikanti et al. 2022 appendix A does).
  With sequence parallelism the norms and residual adds see ``tokens / tp`` rows.
- **Overheads** (GPUs with catalog data): every kernel takes at least the host's issue floor
  (:func:`issue_floor`); the embedding carries one per-micro-batch overhead; the optimizer step
  streams its bytes at Triad (:func:`optimizer_bandwidth`).
- **Recompute**: ``selective`` re-runs the attention core forward in backward (Korthikanti
  et al. 2022, section 5); ``full`` re-runs the whole layer forward. Recomputed ops count in
  hardware FLOP and time, never in model FLOP.
- **MFU / HFU**: model FLOP per step / (step time x ranks x dense peak), hardware FLOP
  likewise (Korthikanti et al. 2022, appendix A: model FLOP exclude recompute, hardware
  FLOP include it). Model FLOP are counted per op as above (causal half), unpadded
  vocabulary, each replicated KV head once; not ``6 N T``. :func:`korthikanti_model_flops`
  gives that paper's closed form (full attention) for comparison.

>>> from meshplan import catalog
>>> gpt = catalog.model("megatron-22b")
>>> w = Workload(seq_len=2048, micro_batch=4, tp=1, flash=False)
>>> c = layer_cost(gpt, catalog.gpu("a100-sxm-80gb"), w)
>>> b, s, h = 4, 2048, 6144
>>> c.flops("model", "forward") == 24 * b * s * h * h + 2 * b * s * s * h
True
>>> c.flops("model") == 3 * c.flops("model", "forward")
True
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from math import ceil
from typing import Optional

from meshplan.compute import asynctp, dtensor_sp, float8
from meshplan.compute.gemm import GemmTable, gemm_efficiency, gemm_model, gemm_time, load_gemm_table  # noqa: F401
from meshplan.compute.measured import attention_seconds, bandwidth, kernel_data, memory_kernel_seconds
from meshplan.compute.megatron import (BATCH_SYNCS, COMM_DELAY_OPS, STEP_TIMERS, TIMER_SYNCS, attention_copy_bytes, batch_bytes,
                                       comm_delay_kernels, cross_entropy_bytes, embedding_bytes, hook_params,
                                       loss_kernels, stage_param_tensors,
                                       norm_backward_partial_bytes, norm_backward_passes, persistent_layer_norm,
                                       softmax_bytes)
from meshplan.compute.routing import RoutingOptions, routing
from meshplan.compute.shapes import (ATTENTION_GEMMS, MLA_REPLICATED, Attention, Gemm, attention_shape,
                                     backward_gemms, layer_gemms)
from meshplan.compute.torch_eager import cross_entropy_bytes as torch_cross_entropy_bytes
from meshplan.compute.torch_eager import RMSNORM_ROW_KERNELS, repeat_kv_bytes, rmsnorm_bytes, rope_bytes, \
    swiglu_bytes
from meshplan.spec.cluster import GPUSpec
from meshplan.spec.model import ModelSpec
from meshplan.mesh.tpsplit import local_heads, padded_vocab
from meshplan.units import dtype_bytes

PHASES = ("forward", "backward_input", "backward_weight")
BLOCKS = ("embed", "attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post", "head")
RECOMPUTE = ("none", "selective", "full", "op")  # torchtitan's "layer": "full" or "none" per layer (layer_workload)


@dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-batch: ``micro_batch`` sequences of ``seq_len``
    tokens, split by ``cp`` along the sequence and by ``tp``/``ep``/``etp`` across
    features; ``sp``: sequence parallel; ``dtype`` of activations and of every GEMM but the
    float8 Linears': the GEMMs of the weights named in ``float8_gemms`` run in ``linear_dtype``
    (:meth:`gemm_dtype`; :func:`float8_gemms` of a training contract).
    ``fused_qkv``: Q, K and V projected by one GEMM (:func:`qkv_fused_ops`);
    ``fp32_wgrad_accumulation``: weight-gradient GEMMs accumulate into fp32 main gradients
    (:func:`_gemm_ops`); ``megatron_ops``: Megatron-LM's (2022, NVIDIA/Megatron-LM 2755bcb) own
    kernels around the GEMMs (:mod:`meshplan.compute.megatron`); ``attention_kernels``: the
    fused-attention kernels the framework runs, tried before the catalog's ``prefer`` list
    (:func:`meshplan.compute.measured.attention_seconds`; empty: the catalog's order);
    ``torch_eager``: torch runs the elementwise ops one kernel each, uncompiled
    (:mod:`meshplan.compute.torch_eager`); ``decomposed_norm``: with it, each RMSNorm as
    torchtitan's pre-2025 module's kernels (:func:`~meshplan.compute.torch_eager.rmsnorm_bytes`);
    ``sp_layout_copies``: torch's sequence-parallel
    collectives rearrange a multi-sequence micro-batch (:mod:`meshplan.compute.dtensor_sp`);
    ``async_tp``: the framework ("torch" or "megatron") whose decomposed TP GEMMs run (``training.tp_comm_overlap`` with sequence parallelism,
    :mod:`meshplan.compute.asynctp`), "" for none; ``fp8_rowwise``: the float8 Linears scale
    rowwise (``training.fp8_recipe``), which decides which of torch's gathers fuse;
    ``fp8_all_gather``: FSDP2 gathers them already cast (their casts: :mod:`meshplan.compute.float8`)."""

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    cp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    dtype: str = "bf16"
    recompute: str = "selective"
    flash: bool = True
    dropout: bool = False
    vocab_pad_divisor: int = 128
    routing: RoutingOptions = RoutingOptions()
    fused_qkv: bool = False
    fp32_wgrad_accumulation: bool = False
    megatron_ops: bool = False
    attention_kernels: tuple[str, ...] = ()
    torch_eager: bool = False
    decomposed_norm: bool = False
    eager_loss: bool = False
    decomposed_head_norm: bool = False
    sp_layout_copies: bool = False
    linear_dtype: str = ""
    float8_gemms: frozenset[str] = frozenset()
    fp8_rowwise: bool = False
    fp8_all_gather: bool = False
    async_tp: str = ""

    def gemm_dtype(self, name: str) -> str:
        """The dtype of GEMM ``name`` (a :class:`~meshplan.compute.shapes.Gemm` name, its
        ``.dgrad``/``.wgrad`` and `` (hottest)`` forms too; Megatron-LM's fused ``qkv`` is its
        Q, K and V projections'): ``linear_dtype`` for a float8 Linear's, else ``dtype``.

        >>> w = Workload(seq_len=8, linear_dtype="fp8", float8_gemms=frozenset({"wq", "w_up"}))
        >>> [w.gemm_dtype(n) for n in ("wq.wgrad", "qkv", "qk^T", "output", "expert_w_up (hottest)")]
        ['fp8', 'fp8', 'bf16', 'bf16', 'bf16']
        """
        base = name.split(" ")[0].split(".")[0]
        return self.linear_dtype if ("wq" if base == "qkv" else base) in self.float8_gemms else self.dtype

    def __post_init__(self):
        if self.recompute not in RECOMPUTE + ("layer",):
            raise ValueError(f"recompute {self.recompute!r} is not one of {RECOMPUTE}")

    @property
    def tokens(self) -> int:
        """Tokens per rank per micro-batch: ``micro_batch * seq_len / cp``."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def row_tokens(self) -> int:
        """Rows of norms and residual adds: ``ceil(tokens / tp)`` with sp, else tokens."""
        return ceil(self.tokens / self.tp) if self.sp else self.tokens


@dataclass(frozen=True)
class Op:
    """One kernel of one pass: ``seconds``; ``model_flops`` and ``hardware_flops`` (FLOP);
    ``size_bytes`` read + written in HBM (memory ops); ``recompute`` marks re-run forward
    ops; ``note`` says how the time was obtained."""

    name: str
    block: str
    phase: str
    kind: str
    seconds: float
    model_flops: float = 0.0
    hardware_flops: float = 0.0
    size_bytes: float = 0.0
    recompute: bool = False
    note: str = ""


@dataclass(frozen=True)
class Cost:
    """A list of ops with sums by phase and block."""

    ops: tuple[Op, ...]

    def _sel(self, phase=None, block=None, recompute=None):
        return [o for o in self.ops if phase in (None, o.phase) and block in (None, o.block)
                and recompute in (None, o.recompute)]

    def seconds(self, phase: Optional[str] = None, block: Optional[str] = None,
                recompute: Optional[bool] = None) -> float:
        """Sum of the seconds of the ops of ``phase``, ``block`` and ``recompute`` (None: any),
        added in op order (with a phase and a block: :attr:`_block_seconds`, the same sum)."""
        if phase is not None and block is not None:
            return self._block_seconds.get((phase, block, recompute), 0)
        return sum(o.seconds for o in self._sel(phase, block, recompute))

    @cached_property
    def _block_seconds(self) -> dict:
        """:meth:`seconds` of every (phase, block, recompute or None) at once: one pass files
        each op's seconds under its two keys in op order, and each list is summed as
        :meth:`seconds` sums its selection, so the floats are the same (the search asks ~35
        such sums of each of thousands of layers; a frozen dataclass: never stale). Kept beside
        the selection for the other sums: one table of all 8 selections per op for every call
        (or a memoised selection) took 0.37 s (0.39 s) of Cost.seconds against 0.13 s in a
        profiled Llama-3-405B / 16,384 H100 search (benchmarks/bench_search.py)."""
        lists: dict = {}
        for o in self.ops:
            lists.setdefault((o.phase, o.block, o.recompute), []).append(o.seconds)
            lists.setdefault((o.phase, o.block, None), []).append(o.seconds)
        return {k: sum(v) for k, v in lists.items()}

    def flops(self, which: str = "model", phase: Optional[str] = None) -> float:
        """``which``: "model" or "hardware"."""
        return sum(o.model_flops if which == "model" else o.hardware_flops for o in self._sel(phase))

    @property
    def forward_s(self) -> float:
        return self.seconds("forward")

    @property
    def backward_s(self) -> float:
        """B + W (recompute included)."""
        return self.seconds("backward_input") + self.seconds("backward_weight")

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.ops + other.ops)

    def lines(self) -> list[str]:
        """One printable line per op: phase, block, name, time (us), TFLOP, note."""
        return [f"{o.phase:15s} {o.block:9s} {o.name:22s} {o.seconds * 1e6:9.1f} us "
                f"{o.hardware_flops / 1e12:8.3f} TFLOP {o.note}" for o in self.ops]


def framework_kernels(training) -> dict:
    """The :class:`Workload` fields a training contract's framework sets (``training``: a
    :class:`~meshplan.spec.training.TrainingSpec`): Megatron-LM projects Q, K and V with one
    GEMM (``fused_qkv``) and, with fp32 gradients, accumulates weight gradients into them
    inside the GEMM (``fp32_wgrad_accumulation``: its ``gradient_accumulation_fusion``, on by
    default); torch does neither. Megatron-LM also runs its own kernels around the GEMMs
    (``megatron_ops``, :mod:`meshplan.compute.megatron`). The fused attention is the
    framework's too (``attention_kernels``, :data:`SDPA_KERNELS`): torch runs
    ``F.scaled_dot_product_attention``, whose flash backend is FlashAttention-2 (PyTorch 2.2
    release notes: "FlashAttention-2 support in scaled_dot_product_attention"; torchtitan's
    ``ScaledDotProductAttention`` orders the backends FLASH, EFFICIENT, MATH and puts cuDNN first
    only on compute capability 10.0, ``models/attention.py``), so FA2's published rates, not
    FA3's, on an H100; Megatron-LM keeps the catalog's order (Transformer Engine's fused
    attention: FA3 where the catalog has it). One rule for the step model and the search's bound.
    torch without ``training.torch_compile`` runs its elementwise ops eagerly (``torch_eager``,
    :mod:`meshplan.compute.torch_eager`), and its norms kernel by kernel under ``training.torch_norm =
    "decomposed"`` (``decomposed_norm``); the head's final norm is never compiled
    (``decomposed_head_norm``) and the loss eager unless compiled with ``torch_compile_loss``
    (``eager_loss``; both: torchtitan compiles the TransformerBlocks alone, TrainingSpec); Megatron-LM's own kernels are :mod:`~meshplan.compute.megatron`'s.

    >>> from meshplan.spec.training import TrainingSpec
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="fp32"))
    {'fused_qkv': True, 'fp32_wgrad_accumulation': True, 'megatron_ops': True, 'attention_kernels': (), \
'torch_eager': False, 'decomposed_norm': False, 'eager_loss': False, 'decomposed_head_norm': False, \
'sp_layout_copies': False}
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["torch_eager"]
    True
    >>> framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["attention_kernels"]
    ('FA2',)
    """
    megatron = training.framework == "megatron"
    return {"fused_qkv": megatron, "fp32_wgrad_accumulation": megatron and training.grad_dtype == "fp32",
            "megatron_ops": megatron, "attention_kernels": () if megatron else SDPA_KERNELS,
            "torch_eager": not megatron and not training.torch_compile,
            "decomposed_norm": not megatron and not training.torch_compile and training.torch_norm == "decomposed",
            "eager_loss": not megatron and not (training.torch_compile and training.torch_compile_loss),
            "decomposed_head_norm": not megatron and training.torch_norm == "decomposed",
            "sp_layout_copies": not megatron}


@lru_cache(maxsize=64)
def float8_gemms(model: ModelSpec, training) -> dict:
    """The :class:`Workload` fields of a training contract's float8 Linears: ``linear_dtype``
    and ``float8_gemms``, the names of the weights whose GEMMs run in it
    (:meth:`~meshplan.spec.training.TrainingSpec.float8_linear`, the one rule, over a dense
    and an MoE layer and the output layer of ``model``; the output's dims unpadded, as
    torchtitan does not pad the vocabulary). Empty without ``linear_dtype``.

    >>> from meshplan import catalog
    >>> from meshplan.spec.training import TrainingSpec
    >>> f = float8_gemms(catalog.model("llama3-8b"), TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8"))
    >>> f["linear_dtype"], sorted(f["float8_gemms"])
    ('fp8', ['w_down', 'w_gate', 'w_up', 'wk', 'wo', 'wq', 'wv'])
    """
    if training.linear_dtype is None:
        return {}
    kinds = {model.is_moe_layer(i): i for i in range(model.layers)}
    tensors = [x for i in kinds.values() for x in model.layer_tensors(i)] + model.head_tensors(model.vocab)
    return {"linear_dtype": training.linear_dtype, "fp8_rowwise": training.fp8_recipe == "rowwise",
            "fp8_all_gather": training.fp8_all_gather, "float8_gemms": frozenset(x.name for x in tensors if training.float8_linear(x))}


#: The fused-attention kernels torch's ``scaled_dot_product_attention`` runs on an NVIDIA GPU
#: before compute capability 10.0 (its flash backend: FlashAttention-2; :func:`framework_kernels`).
SDPA_KERNELS = ("FA2",)


def issue_floor(gpu: GPUSpec, seconds: float) -> float:
    """A kernel's time on the step: ``max(kernel seconds, host issue floor)`` (catalog
    ``host.kernel_issue_s``, :mod:`meshplan.compute.measured`); unchanged for a GPU without
    catalog measurements."""
    data = kernel_data(gpu.name)
    return seconds if data is None else max(seconds, data.kernel_issue_s)


def _mem(gpu: GPUSpec, name: str, block: str, phase: str, nbytes: float, recompute=False,
         kind: str = "elementwise") -> Op:
    """A memory-bound kernel: :func:`meshplan.compute.measured.memory_kernel_seconds` of its
    bytes for ``kind`` (a norm's fitted fixed time + bytes at its fitted bandwidth, else Triad,
    never below the issue floor), or the datasheet bandwidth for a GPU without catalog data."""
    data = kernel_data(gpu.name)
    t = memory_kernel_seconds(data, nbytes, gpu.hbm_bandwidth_bytes_per_s, kind)
    if data is None:
        bw, what = gpu.hbm_bandwidth_bytes_per_s, "datasheet"
    else:
        bw = bandwidth(data, kind)
        what = f"fused norm, + {data.norm_fixed_s * 1e6:.1f} us" if kind == "norm" else "Triad"
    return Op(name, block, phase, "memory", t, size_bytes=nbytes, recompute=recompute,
              note=f"{nbytes / 1e6:.1f} MB / {bw / 1e12:.3g} TB/s ({what})")


def optimizer_bandwidth(gpu: GPUSpec) -> float:
    """Bandwidth (B/s) of the fused optimizer step, which streams its state's bytes
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_s`): the catalog's BabelStream Triad
    (multi-tensor Adam reads and writes several arrays per element; S12's fused AdamW on H100,
    ~2.1 TB/s, is below Triad 2.97), or the datasheet bandwidth for a GPU without catalog data.

    >>> from meshplan import catalog
    >>> optimizer_bandwidth(catalog.gpu("a100-sxm-80gb")) / 1e12  # not the 2.039 TB/s datasheet
    1.7
    """
    data = kernel_data(gpu.name)
    return gpu.hbm_bandwidth_bytes_per_s if data is None else data.stream_bytes_per_s


def _gemm_ops(gpu: GPUSpec, g: Gemm, block: str, w: Workload, table, model_scale: float = 1.0,
              weight: bool = True, backward: Optional[list[Gemm]] = None) -> list[Op]:
    """Forward, data-gradient and weight-gradient ops of ``g`` (``backward``: the two gradient
    GEMMs, default :func:`~meshplan.compute.shapes.backward_gemms`); ``model_scale`` scales the
    model FLOP (replicated KV heads, padded vocabulary). With ``w.fp32_wgrad_accumulation``
    the weight gradient of a ``weight`` (not the attention scores' batched products, whose
    second operand is an activation) is :func:`wgrad_accumulate_s`'s."""
    out = []
    dtype = w.gemm_dtype(g.name)  # float8 Linears: fp8 forward, data- and weight-gradient GEMMs
    for gg, phase in zip([g] + (backward or backward_gemms(g)), PHASES):
        n = asynctp.pieces(w.async_tp, w.tp, gg.name, phase, w.fp8_rowwise and dtype == "fp8") if w.sp else 0
        if n:  # async TP: n GEMMs of M / n rows, each at its own shape (and launch floor)
            e = gemm_time(gpu, asynctp.piece_rows(gg.m, n), gg.n, gg.k, dtype, gg.count, table)
            t = n * issue_floor(gpu, e.seconds * asynctp.sm_margin(w.async_tp, gg.name, phase, gpu.sms))
            out.append(Op(gg.name, block, phase, "gemm", t, gg.flops * model_scale, gg.flops,
                          note=f"async TP ({w.async_tp}): {n} pieces of {e.explanation}"))
            continue
        e = gemm_time(gpu, gg.m, gg.n, gg.k, dtype, gg.count, table)
        t, note = e.seconds, e.explanation
        if phase == "backward_weight" and w.fp32_wgrad_accumulation and weight:
            t, how = wgrad_accumulate_s(gpu, gg, dtype, t)
            note += how
        out.append(Op(gg.name, block, phase, "gemm", issue_floor(gpu, t), gg.flops * model_scale,
                      gg.flops, note=note))
    return out


def wgrad_accumulate_s(gpu: GPUSpec, wgrad: Gemm, dtype: str, gemm_s: float) -> tuple[float, str]:
    """(seconds, note) of a weight-gradient GEMM (M = out features, N = in features, K =
    tokens) that accumulates into an fp32 main gradient: Megatron-LM's
    ``gradient_accumulation_fusion`` (``--no-gradient-accumulation-fusion`` turns it off; on by
    default in 2022, with fp32 gradient accumulation: ``megatron/mpu/layers.py``
    ``fused_dense_cuda.wgrad_gemm_accum_fp32(input, grad_output, weight.main_grad)``, a cuBLAS
    GEMM with beta 1 and an fp32 C). Its HBM traffic is the operands in ``dtype`` and C read
    and written in fp32 (8 B per weight element per micro-batch, in place of the 16-bit
    output's 2 B); time ``max(gemm_s, bytes / achievable bandwidth)``, the roofline
    :mod:`meshplan.compute.measured` applies to every GEMM (Triad, or the datasheet bandwidth
    for a GPU without catalog data: :func:`optimizer_bandwidth`).

    >>> from meshplan import catalog
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> g = Gemm("w.wgrad", 1024, 1024, 256)   # 2 (1024*256*2) + 8 * 1024^2 B at Triad 1.7 TB/s
    >>> t, _ = wgrad_accumulate_s(a100, g, "bf16", 1e-6)
    >>> round(t * 1e6, 3), round((2 * 2 * 1024 * 256 + 8 * 1024 * 1024) / 1.7e12 * 1e6, 3)
    (5.551, 5.551)
    """
    nbytes = (dtype_bytes(dtype) * (wgrad.m * wgrad.k + wgrad.k * wgrad.n) + 8 * wgrad.m * wgrad.n) * wgrad.count
    t_mem = nbytes / optimizer_bandwidth(gpu)
    if t_mem > gemm_s:
        return t_mem, f"; fp32 main-grad accumulate: memory-bound, {nbytes / 1e6:.1f} MB"
    return gemm_s, "; fp32 main-grad accumulate (C read + written in fp32: compute-bound)"


def qkv_fused_ops(gpu: GPUSpec, gemms: list[Gemm], w: Workload, table, scales: dict) -> list[Op]:
    """The Q, K and V projections as one column-parallel GEMM of width ``(q + 2 kv) d / tp``
    (Megatron-LM's GPT ``ParallelAttention.query_key_value``, one ``ColumnParallelLinear``:
    ``megatron/model/transformer.py``), its forward, data-gradient and weight-gradient GEMMs
    timed once; each pass's time is shared among the wq, wk, wv ops by their widths (the ops
    keep their names for the timeline's CP split and the column-parallel input gradients).
    ``gemms``: the wq, wk, wv Gemms (same M and K); ``scales``: model-FLOP scale by name."""
    fused = Gemm("qkv", gemms[0].m, sum(g.n for g in gemms), gemms[0].k)
    whole = _gemm_ops(gpu, fused, "attn", w, table)
    out = []
    for g in gemms:
        share = g.n / fused.n
        for gg, op in zip([g] + backward_gemms(g), whole):
            out.append(Op(gg.name, "attn", op.phase, "gemm", op.seconds * share, gg.flops * scales.get(g.name, 1.0),
                          gg.flops, note=f"{share:.0%} of fused QKV: {op.note}"))
    return out


def _flash_ops(gpu: GPUSpec, att: Attention, w: Workload, recompute: bool, table=None) -> list[Op]:
    key = (att.batch, att.q_heads, att.kv_heads, att.seq_q, att.seq_kv, att.head_dim, w.dtype)
    measured = getattr(table, "attention", {}).get(key) if table is not None else None
    if measured is not None:  # a measured fused-attention call (GemmTable.attention)
        fwd, note = att.flops(causal_half=True), f"measured ({getattr(table, 'path', '')})"
        timed = lambda phase, t, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn", phase,
                                                          "attention", issue_floor(gpu, t), model, hw, recompute=rec,
                                                          note=note)  # floored like a measured GEMM (_gemm_ops)
        out = [timed("forward", measured[0], fwd, fwd), timed("backward_input", measured[1], 2 * fwd, 2.5 * fwd)]
        return out + ([timed("backward_input", measured[0], 0.0, fwd, True)] if recompute else [])
    data = kernel_data(gpu.name)
    if data is not None and data.attention:  # published FlashAttention rates (catalog)
        f_s, b_s, how = attention_seconds(data, att, causal=True, prefer=w.attention_kernels)
        fwd = att.flops(causal_half=True)
        rated = lambda phase, t, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn",
                                                          phase, "attention", issue_floor(gpu, t), model, hw,
                                                          recompute=rec, note=how)
        out = [rated("forward", f_s, fwd, fwd), rated("backward_input", b_s, 2 * fwd, 2.5 * fwd)]
        return out + ([rated("backward_input", f_s, 0.0, fwd, True)] if recompute else [])
    peak = gpu.peak_flops(w.dtype)
    tiles = att.batch * att.q_heads * ceil(att.seq_q / 128)
    waves = ceil(tiles / gpu.sms)
    rate = peak * gpu.max_gemm_fraction * tiles / (waves * gpu.sms)
    # q and the output (seq_q rows), k and v (seq_kv rows): q, k of head_dim, v and the output of d_v
    io = dtype_bytes(w.dtype) * att.batch * (att.seq_q * att.q_heads + att.seq_kv * att.kv_heads) * (
        att.head_dim + att.d_v)
    fwd = att.flops(causal_half=True)
    note = (f"flash: {tiles} blocks in {waves} waves, {rate / peak:.1%} of peak (GEMM ceiling x wave "
            f"quantization)")
    mk = lambda phase, model, hw, rec=False: Op("attention" + (" (recompute)" if rec else ""), "attn", phase,
                                                "attention", max(hw / rate, 2 * io / gpu.hbm_bandwidth_bytes_per_s),
                                                model, hw, recompute=rec, note=note)
    out = [mk("forward", fwd, fwd), mk("backward_input", 2 * fwd, 2.5 * fwd)]
    if recompute:
        out.append(mk("backward_input", 0.0, fwd, True))
    return out


def _score_ops(gpu, att: Attention, w: Workload, table, recompute: bool) -> list[Op]:
    """Non-flash attention: full QK^T and PV batched GEMMs, softmax and dropout on scores;
    with ``w.megatron_ops`` Megatron-LM's causal softmax and copies (:mod:`meshplan.compute.megatron`).

    The six batched products per head, (M, N, K), a batch of ``n = batch x heads`` looked up as
    ``(n M, N, K)`` (:mod:`meshplan.compute.measured`): QK^T (s_q, s_kv, d) and its gradients dQ
    (s_q, d, s_kv) and dK (s_kv, d, s_q); PV (s_q, d_v, s_kv) and its gradients dP (s_q, s_kv, d_v)
    and dV = P^T dO (s_kv, d_v, s_q), torch's bmm derivative for the second operand
    (``mat1.transpose(1, 2).bmm(grad)``). dV is taken in that orientation, as dK is: a GEMM and its
    transpose are the same cuBLAS work (column-major, C^T = B^T A^T), and the catalog's A100 rates
    for these products (kernels.toml "D S7a") are one rate for all six, measured together, on the
    (n s, s, d) and (n s, d, s) shapes; the Linear layers' weight-gradient orientation (d_v, s_kv,
    s_q) would put the batch on d_v and read another family of points (210 TFLOP/s against dK's 86.5
    on the 22B layer) for the same work as dK."""
    n = att.batch * att.q_heads
    qk = Gemm("qk^T", att.seq_q, att.seq_kv, att.head_dim, n)
    pv = Gemm("pv", att.seq_q, att.d_v, att.seq_kv, n)
    pv_grads = [Gemm("pv.dgrad", pv.m, pv.k, pv.n, n), Gemm("pv.wgrad", pv.k, pv.n, pv.m, n)]
    scores = n * att.seq_q * att.seq_kv
    b = dtype_bytes(w.dtype)
    sm_f, sm_b = softmax_bytes(att, b, w.megatron_ops)
    fwd_mem = [("softmax", sm_f)] + ([("attention dropout", (2 * b + 1) * scores)] if w.dropout else [])
    bwd_mem = [("softmax backward", sm_b)] + ([("dropout backward", (2 * b + 1) * scores)] if w.dropout else [])
    out = []
    if w.megatron_ops:  # context permute copy; alpha on dQ and dK; the QKV split's backward (compute.megatron)
        f_copies, b_copies = attention_copy_bytes(att, b)
        fwd_mem += f_copies
        bwd_mem += b_copies
    for g, grads in ((qk, None), (pv, pv_grads)):
        ops = _gemm_ops(gpu, g, "attn", w, table, model_scale=0.5, weight=False, backward=grads)  # causal half
        out += [replace(o, phase="backward_input") if o.phase == "backward_weight" else o for o in ops]
    out += [_mem(gpu, name, "attn", "forward", nb) for name, nb in fwd_mem]
    out += [_mem(gpu, name, "attn", "backward_input", nb) for name, nb in bwd_mem]
    if recompute:
        fwd = [o for o in out if o.phase == "forward"]
        out += [replace(o, name=o.name + " (recompute)", phase="backward_input", model_flops=0.0, recompute=True)
                for o in fwd]
    return out


def _elementwise(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """Norms, residual adds (+ dropout), RoPE, activation, MoE permutation: forward and backward."""
    b, h, r, t = dtype_bytes(w.dtype), model.hidden, w.row_tokens, w.tokens
    q_l, kv_l, _ = local_heads(model, w.tp)
    act = 0.0
    for g in gemms:
        if g.name.endswith("w_up"):
            act += g.m * g.n * g.count
        elif g.name == "shared_w_up":
            act += g.m * g.n / (2 if model.gated_mlp else 1)
    res_f = (3 * b + (1 if w.dropout else 0)) * r * h
    res_b = (3 * b if not w.dropout else 2 * b + 1) * r * h
    spec: list[tuple[str, str, float, float]] = [*norm_spec(model, gpu, w, "attn norm", "attn_pre", r),
            ("residual add" + (" + dropout" if w.dropout else ""), "attn_post", res_f, res_b),
            *norm_spec(model, gpu, w, "mlp norm", "mlp_pre", r),
            ("residual add" + (" + dropout" if w.dropout else ""), "mlp_post", res_f, res_b)]
    if model.gated_mlp:  # torch_eager: silu and the multiply apart (compute.torch_eager)
        fwd, bwd = swiglu_bytes(b, w.torch_eager)
        spec += [(name, "mlp", nb * act, 0.0) for name, nb in fwd] + [(name, "mlp", 0.0, nb * act) for name, nb in bwd]
    else:
        spec.append(("gelu", "mlp", 2 * b * act, 3 * b * act))
    # backward: the residual stream's gradient is the sum of two branches (the skip path and the
    # norm's input gradient); autograd accumulates them with one add per fork (torch
    # autograd InputBuffer::accumulate: read both, write one), before each norm's backward
    spec += [("residual grad accumulate", "attn_pre", 0.0, 3 * b * r * h),
             ("residual grad accumulate", "mlp_pre", 0.0, 3 * b * r * h)]
    # RoPE: one fused kernel over q and k, or eagerly three kernels on each (compute.torch_eager);
    # MLA: on each local head's q_pe and on the one shared k_pe (DeepSeek-V2 eq. 13-14)
    roped = ((q_l, 1), model.qk_rope_head_dim or 0) if model.is_mla else \
        ((q_l, kv_l), model.d_head if model.position_embedding == "rope" else 0)
    if roped[1]:
        parts = roped[0] if w.torch_eager else (sum(roped[0]),)
        spec += [(name, "attn", nb * t * heads * roped[1], nb * t * heads * roped[1])
                 for heads in parts for name, nb in rope_bytes(b, w.torch_eager)]
    if model.is_mla:
        spec += _latent_norms(model, b, t)
    if not w.megatron_ops and not model.is_mla:  # torchtitan's repeat_kv before SDPA
        rep_f, rep_b = repeat_kv_bytes(b, q_l, kv_l, t, model.d_head)
        if rep_f:
            spec.append(("repeat_kv", "attn", rep_f, rep_b))
    if any(g.name.startswith("expert_") for g in gemms):  # the dispatch buffer's rows (compute.routing)
        rows = routing(w.routing, max(1, t * w.etp // w.tp), model.top_k, model.experts, w.ep).recv_rows
        nb = 2 * b * rows * h
        spec += [("moe permute", "mlp", nb, nb), ("moe unpermute", "mlp", nb, nb)]
    out = []
    for name, block, f, bw in spec:
        kind = "norm" if name.endswith("norm") else "elementwise"
        out += [_mem(gpu, name, block, phase, nb, kind=kind)
                for phase, nb in (("forward", f), ("backward_input", bw)) if nb > 0]
    return out + norm_finalize_ops(model, gpu, w, (("attn norm", "attn_pre"), ("mlp norm", "mlp_pre")))


def norm_spec(model: ModelSpec, gpu: GPUSpec, w: Workload, name: str, block: str,
              rows: int) -> list[tuple[str, str, float, float]]:
    """One norm over ``rows`` rows of ``model.hidden`` as (name, block, forward bytes, backward
    bytes) kernels: one fused kernel each way (``name``: read and write ``rows x h``; backward
    :func:`norm_backward_bytes`), or under ``w.decomposed_norm`` torchtitan's pre-2025 RMSNorm
    kernel by kernel (:func:`~meshplan.compute.torch_eager.rmsnorm_bytes`, named ``name`` + the
    kernel; per-row kernels of ``rows`` values).

    Llama 3 8B, 16,384 rows of 4,096 in bf16: 67,108,864 elements, forward 36 B each and 16 B
    a row (8 kernels), backward 92 B each and 28 B a row (16 kernels), against 4 B and 6 B fused:

    >>> from meshplan import catalog
    >>> m, g = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")
    >>> w = Workload(seq_len=8192, micro_batch=2, decomposed_norm=True)
    >>> k = norm_spec(m, g, w, "mlp norm", "mlp_pre", 16384)
    >>> len(k), sum(f for *_, f, _ in k) - 36 * 67108864, sum(b for *_, b in k) - 92 * 67108864
    (24, 262144.0, 458752.0)
    >>> norm_spec(m, g, Workload(seq_len=8192, micro_batch=2), "mlp norm", "mlp_pre", 16384)
    [('mlp norm', 'mlp_pre', 268435456, 402653184)]
    """
    b, n = dtype_bytes(w.dtype), rows * model.hidden
    if not w.decomposed_norm:
        return [(name, block, 2 * b * n, norm_backward_bytes(model, gpu, w, rows))]
    fwd, bwd = rmsnorm_bytes(b)
    row_f, row_b = RMSNORM_ROW_KERNELS
    out: list[tuple[str, str, float, float]] = []
    for kernels, count, forward in ((fwd, n, True), (row_f, rows, True), (bwd, n, False), (row_b, rows, False)):
        out += [(f"{name} {k}", block, float(nb * count) if forward else 0.0, 0.0 if forward else float(nb * count))
                for k, nb in kernels]
    return out


def norm_backward_bytes(model: ModelSpec, gpu: GPUSpec, w: Workload, rows: int) -> float:
    """HBM bytes of one norm's backward kernel over ``rows`` rows of ``model.hidden``:
    :func:`~meshplan.compute.megatron.norm_backward_passes` passes of ``rows x h`` (5 for Megatron-LM's
    own layer norm, 3 for one fused kernel) and, for apex's persistent layer norm that Megatron-LM
    2022 runs at its hidden sizes (:func:`~meshplan.compute.megatron.persistent_layer_norm`), the
    partial weight and bias gradients it writes (:func:`~meshplan.compute.megatron.norm_backward_partial_bytes`).

    22B (h 6144) under SP at tp 8, micro-batch 4: 1,024 rows, 3 x 2 B x 1024 x 6144 + 108 x 6144 x 8 B
    of partials on an A100:

    >>> from meshplan import catalog
    >>> w = Workload(seq_len=2048, micro_batch=4, tp=8, sp=True, megatron_ops=True)
    >>> norm_backward_bytes(catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb"), w, 1024)
    43057152
    """
    b, h = dtype_bytes(w.dtype), model.hidden
    persistent = w.megatron_ops and persistent_layer_norm(model.norm, h)
    partial = norm_backward_partial_bytes(h, gpu.sms) if persistent else 0
    return norm_backward_passes(w.megatron_ops, persistent) * b * rows * h + partial


def norm_finalize_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, norms) -> list[Op]:
    """The second kernel of apex's persistent layer norm backward (``ln_bwd_finalize_kernel``) for
    each ``(name, block)`` of ``norms``, under Megatron-LM 2022 at a persistent hidden size
    (:func:`norm_backward_bytes`): it reads the partial weight and bias gradients and writes the two
    gradients (``2 h`` elements of the compute dtype), a memory-bound kernel never below the issue
    floor. Empty otherwise (one kernel, or Megatron's own)."""
    if not (w.megatron_ops and persistent_layer_norm(model.norm, model.hidden)):
        return []
    nb = norm_backward_partial_bytes(model.hidden, gpu.sms) + 2 * dtype_bytes(w.dtype) * model.hidden
    return [_mem(gpu, f"{name} backward finalize", block, "backward_input", nb) for name, block in norms]


def _latent_norms(model: ModelSpec, b: int, t: int) -> list[tuple[str, str, float, float]]:
    """MLA's latent RMSNorms (``q_a_layernorm`` over q_lora_rank, ``kv_a_layernorm`` over
    kv_lora_rank) as memory ops on all ``t`` tokens of the rank (they follow the replicated
    down projections, so sequence parallelism does not shorten them): forward reads the
    latent and writes its normalised copy (2 b t r), backward reads the input and the
    incoming gradient and writes the input gradient (3 b t r), as the layer norms above."""
    out: list[tuple[str, str, float, float]] = []
    for name, r in (("q_a norm", model.q_lora_rank), ("kv_a norm", model.kv_lora_rank)):
        if r:
            out.append((name, "attn", 2 * b * t * r, 3 * b * t * r))
    return out


def _bias_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, moe: bool) -> list[Op]:
    """Linear biases as Megatron-LM's GPT applies them: the QKV bias is a separate add after
    the column-parallel GEMM (read and write ``tokens x local qkv width``); the MLP-up bias is
    fused into the bias-GeLU kernel and the row-parallel (wo, MLP-down) biases into
    bias-dropout-add (no extra forward kernel). Backward: each bias gradient is a sum over
    tokens of its output gradient, a memory-bound read: ``tokens x width`` for the column-parallel
    ones, ``row tokens x h`` (sequence shard with SP) for the row-parallel ones."""
    b, h, t, r = dtype_bytes(w.dtype), model.hidden, w.tokens, w.row_tokens
    q_l, kv_l, _ = local_heads(model, w.tp)
    qkv = t * (q_l + 2 * kv_l) * model.d_head
    out = []
    if model.qkv_bias or model.linear_bias:
        out += [_mem(gpu, "qkv bias add", "attn", "forward", 2 * b * qkv),
                _mem(gpu, "qkv bias grad", "attn", "backward_weight", b * qkv)]
    if model.linear_bias:
        out.append(_mem(gpu, "wo bias grad", "attn", "backward_weight", b * r * h))
        if not moe:
            f = model.ffn // w.tp * (2 if model.gated_mlp else 1)
            out += [_mem(gpu, "mlp up bias grad", "mlp", "backward_weight", b * t * f),
                    _mem(gpu, "mlp down bias grad", "mlp", "backward_weight", b * r * h)]
    return out


def main_grad_hooks(model: ModelSpec, gpu: GPUSpec, w: Workload, layer: int = -1) -> list[Op]:
    """Megatron-LM's main-gradient hooks of one layer per micro-batch
    (:func:`meshplan.compute.megatron.hook_params`): ``main_grad.add_(grad)`` reads the main
    gradient and the gradient and writes the main gradient, ``(2 g + b) x local elements`` (g = 4
    with fp32 main gradients, else the compute dtype's b), one kernel each (:func:`issue_floor`).

    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> ops = main_grad_hooks(gpt, a100, Workload(seq_len=2048, tp=8, fused_qkv=True, fp32_wgrad_accumulation=True))
    >>> [o.name for o in ops]  # doctest: +NORMALIZE_WHITESPACE
    ['attn_norm main_grad add', 'attn_norm_bias main_grad add', 'wq_bias main_grad add',
     'wo_bias main_grad add', 'mlp_norm main_grad add', 'mlp_norm_bias main_grad add',
     'w_up_bias main_grad add', 'w_down_bias main_grad add']
    >>> sorted({o.seconds for o in ops})  # each below the 4.7 us issue floor
    [4.7e-06]
    """
    b, g = dtype_bytes(w.dtype), (4 if w.fp32_wgrad_accumulation else dtype_bytes(w.dtype))
    idx = model.layers - 1 if layer < 0 else layer
    return [_mem(gpu, f"{name} main_grad add", block, "backward_weight", (2 * g + b) * n)
            for name, block, n in hook_params(model, w.tp, w.fused_qkv, idx)]


def comm_delay_ops(gpu: GPUSpec, w: Workload, blocks: tuple[str, ...]) -> list[Op]:
    """Megatron-LM's delay kernels (:func:`meshplan.compute.megatron.comm_delay_kernels`) of the
    column-parallel linear of each of ``blocks`` ("attn": ``query_key_value``; "mlp":
    ``dense_h_to_4h``; "head": the output layer): ``torch.empty(1) + 1`` reads and writes one fp32
    element (8 B), so each takes the issue floor (:func:`issue_floor`).

    >>> from meshplan import catalog
    >>> ops = comm_delay_ops(catalog.gpu("a100-sxm-80gb"), Workload(seq_len=2048, tp=8, sp=True), ("attn", "mlp"))
    >>> [(o.block, o.phase, round(o.seconds * 1e6, 1)) for o in ops]  # doctest: +NORMALIZE_WHITESPACE
    [('attn', 'backward_input', 4.7), ('attn', 'backward_weight', 4.7),
     ('mlp', 'backward_input', 4.7), ('mlp', 'backward_weight', 4.7)]
    """
    return [_mem(gpu, COMM_DELAY_OPS[phase], block, phase, 8.0)
            for block in blocks for phase, n in comm_delay_kernels(w.tp, w.sp).items() for _ in range(n)]


def layer_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, layer: int = -1,
               table: Optional[GemmTable] = None) -> Cost:
    """Every op of transformer layer ``layer`` (-1: the last) on one rank for one micro-batch,
    forward, backward (B and W) and recompute, per the module conventions
    (:func:`layer_costs` under ``w.recompute``)."""
    return layer_costs(model, gpu, w, (w.recompute,), layer, table)[w.recompute]


def layer_costs(model: ModelSpec, gpu: GPUSpec, w: Workload, recomputes: tuple[str, ...], layer: int = -1,
                table: Optional[GemmTable] = None) -> dict[str, Cost]:
    """:func:`layer_cost` of ``w`` under each recompute policy of ``recomputes`` (``w.recompute``
    is not read), by policy. The ops no policy changes (GEMMs, the attention's own ops,
    memory-bound ops, Megatron-LM's kernels) are built once; each policy adds its recompute
    ops where :func:`layer_cost` has them (``selective``: the attention's replay after the
    attention ops; ``full``, ``op``: the forward's replay at the end), so each Cost lists the
    same ops in the same order (the search asks every policy of each shape).

    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> w = Workload(seq_len=2048, micro_batch=4, tp=8, flash=False)
    >>> both = layer_costs(gpt, a100, w, ("none", "full"))
    >>> both["full"] == layer_cost(gpt, a100, replace(w, recompute="full"))
    True
    >>> both["full"].seconds("backward_input", "attn", True) == both["none"].seconds("forward", "attn")
    True
    >>> [o.name for o in both["full"].ops if o.recompute and o.block == "mlp"]  # torch: w_down is not replayed
    ['w_up (recompute)', 'gelu (recompute)']
    """
    for rc in recomputes:
        if rc not in RECOMPUTE + ("layer",):
            raise ValueError(f"recompute {rc!r} is not one of {RECOMPUTE}")
    gemms = layer_gemms(model, w.tp, w.tokens, layer=layer, ep=w.ep, etp=w.etp, routing_options=w.routing)
    _, _, rep = local_heads(model, w.tp)
    ops = []
    qkv = [g for g in gemms if g.name in ("wq", "wk", "wv")] if w.fused_qkv else []
    if len(qkv) == 3:
        ops += qkv_fused_ops(gpu, qkv, w, table, {"wk": 1.0 / rep, "wv": 1.0 / rep})
    for g in gemms:  # a replicated KV head, or MLA's replicated down projection, counts once in model FLOP
        if len(qkv) == 3 and g in qkv:
            continue
        scale = 1.0 / rep if g.name in ("wk", "wv") else 1.0 / w.tp if g.name in MLA_REPLICATED else 1.0
        ops += _gemm_ops(gpu, g, "attn" if g.name in ATTENTION_GEMMS else "mlp", w, table, scale)
    att = attention_shape(model, w.tp, w.cp, w.micro_batch, w.seq_len)
    # the attention's ops with selective recompute: its own ops, then their replay (appended last)
    attn_sel = _flash_ops(gpu, att, w, True, table) if w.flash else _score_ops(gpu, att, w, table, True)
    attn_plain = [o for o in attn_sel if not o.recompute]
    rest = _elementwise(model, gpu, w, gemms) + async_tp_ops(model, gpu, w, gemms) + sp_layout_ops(model, gpu, w, gemms)
    rest += _bias_ops(model, gpu, w, model.is_moe_layer(model.layers - 1 if layer < 0 else layer))
    rest += [_mem(gpu, name, block, phase, nb) for name, block, phase, nb in float8.layer_kernels(
        model, w, gemms, dtype_bytes(w.dtype))]  # torchao's amax, casts and transposed copies
    if w.megatron_ops:
        rest += main_grad_hooks(model, gpu, w, layer)
        moe = model.is_moe_layer(model.layers - 1 if layer < 0 else layer)
        rest += comm_delay_ops(gpu, w, ("attn",) if moe else ("attn", "mlp"))
    order = {b: i for i, b in enumerate(BLOCKS)}
    out = {}
    for rc in recomputes:
        every = ops + (attn_sel if rc == "selective" else attn_plain) + rest
        if rc in ("full", "op"):
            kept = _op_sac_kept(model) if rc == "op" else full_ac_not_replayed(w)
            every += [_replay(o) for o in every if o.phase == "forward" and o.name not in kept
                      and not (rc == "op" and (o.kind == "attention" or o.name.startswith(OP_SAC_NOT_REPLAYED)))]
        out[rc] = Cost(tuple(sorted(every, key=lambda o: (PHASES.index(o.phase), order[o.block]))))
    return out


def async_tp_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """The kernels torch's async TP adds on the compute stream (:func:`meshplan.compute.asynctp.torch_extra_bytes`):
    per block with fused GEMMs, the shard copy before each fused all-gather (forward, and
    backward's gathered output gradient) and the partial sum after each fused reduce-scatter
    (forward); none under Megatron-LM (TE's norm writes into the userbuffer) or without async TP."""
    if w.async_tp != "torch" or not w.sp or w.tp < 2:
        return []
    size = asynctp.torch_extra_bytes(w.tokens, model.hidden, w.tp, dtype_bytes(w.dtype))
    names = {g.name for g in gemms}
    out = []
    fused = lambda name, phase: asynctp.pieces("torch", w.tp, name, phase, _cast_after_gather(w, name)) > 0
    for block, ag, rs in (("attn", "wq", "wo"), ("mlp", "w_up", "w_down")):
        if ag in names and fused(ag, "forward"):
            out.append(_mem(gpu, f"async-TP shard copy ({block})", block, "forward", size["shard copy"]))
        if rs in names:
            out.append(_mem(gpu, f"async-TP partial sum ({rs})", block, "forward", size["partial sum"]))
            if fused(rs + ".dgrad", "backward_input"):
                out.append(_mem(gpu, f"async-TP shard copy ({rs} grad)", block, "backward_input", size["shard copy"]))
    return out


def _cast_after_gather(w: Workload, name: str) -> bool:
    """Whether GEMM ``name`` (a Gemm name or its ``.dgrad``) is a float8 rowwise Linear's, whose
    TP gathers torch does not fuse (:func:`meshplan.compute.asynctp.pieces`)."""
    return w.fp8_rowwise and w.gemm_dtype(name) == "fp8"


def sp_layout_ops(model: ModelSpec, gpu: GPUSpec, w: Workload, gemms: list[Gemm]) -> list[Op]:
    """The layout copies torch's sequence-parallel collectives add on the compute stream when a
    micro-batch holds several sequences (:mod:`meshplan.compute.dtensor_sp`): per dense block
    (attention: wq or Megatron's qkv; MLP: w_up), forward the gather's and the scatter's, backward
    the same two (under torch's async TP: in backward the returned gathered input's and output
    gradient's copies for the weight gradients and the unfused input-gradient scatter's), each
    :func:`~meshplan.compute.dtensor_sp.copy_bytes` of the rank's full ``tokens x hidden``."""
    fw = "torch" if w.sp_layout_copies else ""
    if not dtensor_sp.applies(fw, w.sp, w.tp, w.micro_batch):
        return []
    names = {g.name for g in gemms}
    blocks = tuple(b for b, g in (("attn", ("wq", "qkv")), ("mlp", ("w_up",))) if names & set(g))
    size = dtensor_sp.copy_bytes(w.tokens, model.hidden, dtype_bytes(w.dtype))
    gathers = not any(_cast_after_gather(w, g) for g in ("wq", "qkv", "w_up"))
    return [_mem(gpu, name, block, phase, size)
            for name, block, phase in dtensor_sp.copies(blocks, w.async_tp == "torch", gathers)]


def _replay(o: Op) -> Op:
    """Forward op ``o`` re-run in backward by recompute: ``replace(o, name=o.name + " (recompute)",
    phase="backward_input", model_flops=0.0, recompute=True)``, built directly (a layer has
    dozens, the search asks thousands of layers)."""
    return Op(name=o.name + " (recompute)", block=o.block, phase="backward_input", kind=o.kind, seconds=o.seconds,
              model_flops=0.0, hardware_flops=o.hardware_flops, size_bytes=o.size_bytes, recompute=True, note=o.note)


#: Forward GEMMs of a layer whose outputs torchtitan's op-level selective AC saves (the
#: odd-numbered mms of a Llama block: wq, wk, wv, wo, w1 gate, w3 up, w2 down; GeLU MLP: w_up,
#: w_down), kept by :func:`meshplan.memory.activations.op_sac_terms`.
OP_SAC_SAVED_GEMMS = ("wq", "wv", "w_gate", "w_down")
OP_SAC_SAVED_GEMMS_GELU = ("wq", "wv", "w_up")
#: Forward kernels op-level AC does not replay beside the saved GEMMs and SDPA: async TP's
#: partial sum is part of the fused GEMM + reduce-scatter, whose output the policy saves; the
#: float8 amaxes, whose ``aten.abs`` and ``aten.max`` outputs torchtitan's ``_save_list`` saves
#: "for low precision training" (9dec370 ``parallelisms/parallelize_llama.py``).
OP_SAC_NOT_REPLAYED = ("async-TP partial sum", float8.AMAX)


def full_ac_not_replayed(w: Workload) -> tuple[str, ...]:
    """Forward ops of a dense layer that torch's full AC does not replay: what only feeds the
    MLP's closing reduce-scatter, which the backward never needs (the block's output goes to the
    next layer, and the reduce-scatter's and the residual add's backward need no saved tensor).
    Eager (``torch_eager``): ``torch.utils.checkpoint`` non-reentrant stops the replay once the
    last saved tensor is recomputed ("early stop", on by default; torchtitan 820504e's
    ``ptd_checkpoint_wrapper``), after w_down's mm saved its input: w_down runs, its scatter's
    layout copy and the reduce-scatter do not. Compiled: AOTAutograd's min-cut partitioner puts
    in the backward graph only the recomputed nodes the backward reads, so w_down's GEMM, async
    TP's partial sum after it and the copy go too. Megatron-LM's ``CheckpointFunction`` re-runs the
    whole layer: nothing is left out. The timeline leaves the replayed MLP's closing collective
    out likewise (:func:`meshplan.schedule.layer_timeline.replay_scatters`).

    >>> full_ac_not_replayed(Workload(seq_len=8, megatron_ops=True))
    ()
    >>> full_ac_not_replayed(Workload(seq_len=8, torch_eager=True))
    ('SP layout copy (scatter, mlp)', 'async-TP partial sum (w_down)')
    >>> full_ac_not_replayed(Workload(seq_len=8))[-1]
    'w_down'
    """
    if w.megatron_ops:
        return ()
    return ("SP layout copy (scatter, mlp)", "async-TP partial sum (w_down)") + (() if w.torch_eager else ("w_down",))


def _op_sac_kept(model: ModelSpec) -> tuple[str, ...]:
    """Forward GEMMs whose outputs torchtitan's op-level selective AC saves, so its recompute
    skips them (:func:`meshplan.memory.activations.op_sac_terms`); the attention kernel is
    saved too. Everything else of the forward is recomputed in backward."""
    return OP_SAC_SAVED_GEMMS if model.gated_mlp else OP_SAC_SAVED_GEMMS_GELU


def layer_workload(w: Workload, checkpointed: bool) -> Workload:
    """The workload of one layer under torchtitan's per-layer AC (``recompute = "layer"``):
    ``full`` for a checkpointed layer, ``none`` otherwise; other policies unchanged."""
    return replace(w, recompute="full" if checkpointed else "none") if w.recompute == "layer" else w


def embedding_cost(model: ModelSpec, gpu: GPUSpec, w: Workload) -> Cost:
    """Input embedding on the first stage: lookup (read + write ``tokens x h``), with learned
    positions their own lookup (read + write) and the add, and in backward the dense weight
    gradient torch's ``embedding_dense_backward`` builds for each table: a zero-filled
    ``(table rows) x h`` tensor (``at::zeros``; the rank's ``V_padded / tp`` rows,
    ``max_position`` for learned positions) into which the token rows are scattered (read +
    write ``tokens x h`` per table).
    Memory-bound. With ``w.megatron_ops`` also Megatron-LM's passes around it
    (:func:`meshplan.compute.megatron.embedding_bytes`).

    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> c = embedding_cost(gpt, a100, Workload(seq_len=2048, micro_batch=4, tp=8))
    >>> grad = [o for o in c.ops if o.name == "embedding grad"][0]   # 2 B x (6400 + 2048) x 6144 + 2 scatters
    >>> grad.size_bytes == 2 * (6400 + 2048) * 6144 + 2 * (2 * 2 * 8192 * 6144)
    True
    """
    b, h, t = dtype_bytes(w.dtype), model.hidden, w.tokens
    rows = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp) // w.tp
    learned = model.position_embedding == "learned"
    pos, lookups = (model.max_position, 2) if learned else (0, 1)
    ops = [_mem(gpu, "embedding lookup", "embed", "forward", 2 * b * t * h),
           _mem(gpu, "embedding grad", "embed", "backward_weight", b * (rows + pos) * h + lookups * 2 * b * t * h)]
    if learned:
        ops += [_mem(gpu, "position lookup", "embed", "forward", 2 * b * t * h),
                _mem(gpu, "position add", "embed", "forward", 3 * b * t * h)]
    if w.megatron_ops:
        g = 4 if w.fp32_wgrad_accumulation else b
        ops += [_mem(gpu, name, "embed", phase, nb)
                for name, phase, nb in embedding_bytes(b, g, t, h, w.tp, w.row_tokens, (rows + pos) * h, w.sp, w.dropout,
                                                       lookups, w.micro_batch > 1)]
    data = kernel_data(gpu.name)
    if data is not None and not w.megatron_ops:  # per micro-batch: the batch broadcast (catalog microbatch_overhead_s)
        ops.append(Op("micro-batch overhead", "embed", "forward", "overhead", data.microbatch_overhead_s,
                      note="get_batch: 2 small tp broadcasts at the measured 1 KB latency (catalog)"))
    return Cost(tuple(ops))


def megatron_batch_cost(gpu: GPUSpec, w: Workload) -> Cost:
    """Megatron-LM 2022's per-chunk batch and timer costs (:func:`meshplan.compute.megatron.batch_bytes`,
    :data:`~meshplan.compute.megatron.TIMER_SYNCS`), in every chunk's forward (and the timers'
    syncs in its backward) on every stage: the 2 tp broadcasts at the catalog's
    ``microbatch_overhead_s``, each ``get_batch`` kernel as a memory-bound pass (never below the
    issue floor), and per ``torch.cuda.synchronize`` one issue floor (the GPU drained, the next
    kernel waits at least one launch: a lower bound). Empty for a GPU without catalog data.

    22B, micro-batch 4, seq 2048 on A100: the mask passes 16.8 + 33.6 + 21.0 MB at Triad 1.70 TB/s
    (9.87 + 19.74 + 12.34 us), 4 small kernels at the 4.7 us floor (18.8), 33.92 us of broadcasts, 4 syncs
    (18.8), the broadcast sizes' two copies (:data:`~meshplan.compute.megatron.BATCH_SYNCS`, 9.4):
    122.9 us in forward; 2 syncs (9.4 us) in backward:

    >>> from meshplan import catalog
    >>> c = megatron_batch_cost(catalog.gpu("a100-sxm-80gb"), Workload(seq_len=2048, micro_batch=4, megatron_ops=True))
    >>> round(c.seconds("forward") * 1e6, 1), round(c.seconds("backward_input") * 1e6, 1)
    (122.9, 9.4)
    """
    data = kernel_data(gpu.name)
    if data is None:
        return Cost(())
    ops = [Op("get_batch broadcasts", "embed", "forward", "overhead", data.microbatch_overhead_s,
              note="get_batch: 2 small tp broadcasts at the measured 1 KB latency (catalog)")]
    ops += [_mem(gpu, name, "embed", "forward", nb) for name, nb in batch_bytes(w.micro_batch, w.seq_len)]
    ops += [Op("timer synchronize", "embed", phase, "overhead", n * data.kernel_issue_s,
               note=f"{n} torch.cuda.synchronize, one issue floor each") for phase, n in TIMER_SYNCS.items()]
    ops.append(Op("broadcast_data sizes copies", "embed", "forward", "overhead", BATCH_SYNCS * data.kernel_issue_s,
                  note="torch.cuda.LongTensor(sizes) and sizes_cuda.cpu(), one issue floor each"))
    return Cost(tuple(ops))


def megatron_step_cost(gpu: GPUSpec, tensors: list[tuple[str, int, bool]], sp: bool, per_param_copy: bool,
                       clip: bool, loss_micro_batches: int = 0) -> Cost:
    """Megatron-LM 2022's kernels and host syncs once per step beyond the optimizer's bulk passes
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`), on one rank holding ``tensors``
    (:func:`meshplan.compute.megatron.stage_param_tensors`); empty for a GPU without catalog data:

    - ``per_param_copy`` (bf16 parameters with fp32 master weights): ``optimizer.py``
      ``_copy_main_params_to_model_params`` -> ``_multi_tensor_copy_this_to_that`` without an
      overflow buffer (``_dummy_overflow_buf = None`` for bf16: "We don't have a bfloat16
      implementation") loops ``that_.copy_(this_)``, one kernel per parameter: each takes
      ``max(6 B x elements / Triad, issue floor)``; the bulk stream already counts the bytes, so the
      op is the floors' excess, ``sum max(0, floor - 6 n / Triad)``;
    - ``sp``: ``allreduce_layernorm_grads`` flattens the fp32 main gradients of the
      ``sequence_parallel`` tensors into one buffer (``_flatten_dense_tensors``: one ``cat`` kernel,
      read + write 8 B per element) and copies each back after the all-reduce (``buf.copy_(synced)``:
      one kernel per tensor, 8 B per element, never below the floor);
    - the step's timers (:data:`~meshplan.compute.megatron.STEP_TIMERS`, a
      ``torch.cuda.synchronize`` at each start and stop) and with ``clip`` the gradient norm's
      ``total_norm.item()`` (``clip_grads.py``): one issue floor per sync (as
      :func:`megatron_batch_cost`);
    - on the last stage (``loss_micro_batches``: the micro-batches whose losses it holds) the
      loss averaged over them (``training.py`` ``train_step``: ``sum(losses) / len(losses)``,
      Python's ``sum`` from 0: one add per micro-batch and the division) and ``training_log``'s
      running total (``total_loss_dict.get(key, torch.cuda.FloatTensor([0.0])) + loss``: a
      blocking host-to-device copy and an add): ``n + 3`` issue floors.

    22B at tp 8 (one layer's 12 tensors, 8 of them under 1 M elements): the 8 copies each pay the
    4.7 us floor less their 6 n B at 1.70 TB/s; the 6 sequence_parallel tensors (36,864 elements)
    flatten in one floored kernel and copy back in 6:

    >>> from meshplan import catalog
    >>> from meshplan.compute.megatron import stage_param_tensors
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> c = megatron_step_cost(a100, stage_param_tensors(catalog.model("megatron-22b"), 8, 6400, [0], False, False, 1),
    ...                        sp=True, per_param_copy=True, clip=True)
    >>> small = [6144, 6144, 2304, 6144, 6144, 6144, 3072, 6144]
    >>> round(c.seconds() * 1e6, 3) == round((sum(4.7e-6 - 6 * n / 1.7e12 for n in small) + 4.7e-6
    ...                                         + 6 * 4.7e-6 + 23 * 4.7e-6) * 1e6, 3)
    True
    """
    data = kernel_data(gpu.name)
    if data is None:
        return Cost(())
    floor, bw = data.kernel_issue_s, data.stream_bytes_per_s
    ops = []
    if per_param_copy:
        extra = sum(max(0.0, floor - 6 * n / bw) for _, n, _ in tensors)
        ops.append(Op("master-to-model copy, one kernel per parameter", "head", "step", "overhead", extra,
                      note=f"{len(tensors)} copy_ kernels (bf16: no multi-tensor copy), floors beyond the bulk bytes"))
    if sp:
        shared = [n for _, n, s in tensors if s]
        if shared:
            ops.append(_mem(gpu, "SP gradients flatten (cat)", "head", "step", 8 * sum(shared)))
            ops.append(Op("SP gradients copy back", "head", "step", "memory",
                          sum(issue_floor(gpu, 8 * n / bw) for n in shared), size_bytes=8 * sum(shared),
                          note=f"{len(shared)} copy_ kernels"))
    syncs = 2 * len(STEP_TIMERS) + (1 if clip else 0)
    ops.append(Op("step timers and grad-norm sync", "head", "step", "overhead", syncs * floor,
                  note=f"{syncs} torch.cuda.synchronize / .item(), one issue floor each"))
    if loss_micro_batches:
        n = loss_micro_batches + 3
        ops.append(Op("loss average and log", "head", "step", "overhead", n * floor,
                      note=f"{n} tiny kernels and copies, one issue floor each"))
    return Cost(tuple(ops))


def megatron_stage_step_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, training, layers: list[int], first: bool,
                             last: bool, pp: int, micro_batches: int = 1) -> Cost:
    """:func:`megatron_step_cost` of one pipeline stage's rank (``layers``: its layer indices;
    ``training``: the :class:`~meshplan.spec.training.TrainingSpec`; ``micro_batches`` per step);
    empty unless ``w.megatron_ops``. The per-parameter copy applies to bf16 parameters with
    master weights."""
    if not w.megatron_ops:
        return Cost(())
    rows = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp) // w.tp
    tensors = stage_param_tensors(model, w.tp, rows, layers, first, last, pp)
    per_param = training.param_dtype == "bf16" and training.keeps_master
    return megatron_step_cost(gpu, tensors, w.sp and w.tp > 1, per_param, training.grad_clip,
                              micro_batches if last else 0)


def head_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, table: Optional[GemmTable] = None) -> Cost:
    """Final norm, output GEMM ``(tokens, V_padded / tp, h)`` and vocab-parallel cross
    entropy on the last stage; with ``w.megatron_ops`` the cross entropy, the final norm's
    backward and its main-gradient hooks as Megatron-LM's (:mod:`meshplan.compute.megatron`)."""
    b, h, r = dtype_bytes(w.dtype), model.hidden, w.row_tokens
    pv = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp)
    g = Gemm("output", w.tokens, pv // w.tp, h)
    logits = w.tokens * (pv // w.tp)
    wn = replace(w, decomposed_norm=w.decomposed_norm or w.decomposed_head_norm)  # never compiled (framework_kernels)
    ops = [_mem(gpu, name, "head", phase, nb, kind="norm" if name.endswith("norm") else "elementwise")
           for name, _, f, bw in norm_spec(model, gpu, wn, "final norm", "head", r)
           for phase, nb in (("forward", f), ("backward_input", bw)) if nb > 0]
    ops += norm_finalize_ops(model, gpu, wn, (("final norm", "head"),))
    ops += _gemm_ops(gpu, g, "head", w, table, model_scale=model.vocab / pv)
    if w.megatron_ops:
        fwd_b, bwd_b = cross_entropy_bytes(b)
        ops += [_mem(gpu, "cross entropy", "head", "forward", fwd_b * logits),
                _mem(gpu, "cross entropy", "head", "backward_input", bwd_b * logits)]
    else:  # torch: fused when compiled, else kernel by kernel (compute.torch_eager)
        fwd, bwd = torch_cross_entropy_bytes(b, w.torch_eager or w.eager_loss)
        ops += [_mem(gpu, name, "head", phase, nb * logits)
                for phase, kernels in (("forward", fwd), ("backward_input", bwd)) for name, nb in kernels]
    if w.megatron_ops:  # the final norm's weight (and bias) main-gradient hooks (main_grad_hooks)
        main = 4 if w.fp32_wgrad_accumulation else b
        ops += [_mem(gpu, f"final norm {p} main_grad add", "head", "backward_weight", (2 * main + b) * h)
                for p in (("weight", "bias") if model.norm == "layernorm" else ("weight",))]
        ops += comm_delay_ops(gpu, w, ("head",))  # parallel_lm_logits: the same autograd function
        data = kernel_data(gpu.name)
        if data is not None:  # the loss's tiny kernels (compute.megatron.loss_kernels), one issue floor each
            ops += [Op("loss tiny kernels", "head", phase, "overhead", n * data.kernel_issue_s,
                       note=f"{n} kernels of a few elements per token, one issue floor each")
                    for phase, n in loss_kernels(w.micro_batch).items()]
    return Cost(tuple(ops))


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


#: Why an op's hardware FLOP exceed its model FLOP (:func:`flop_gap`), in printing order.
FLOP_GAP_CAUSES = ("recompute", "flash backward recomputes QK^T", "full attention products (no causal skip)",
                   "padded vocabulary", "replicated KV heads")


def flop_gap(ops) -> dict[str, float]:
    """Hardware minus model FLOP of ``ops`` (iterable of :class:`Op`) by cause, the reasons
    HFU exceeds MFU without any recompute policy: recomputed ops (model FLOP 0); a flash
    kernel's backward, 2.5x its forward against the model's 2x (FlashAttention-2 recomputes
    ``QK^T``); a non-flash kernel's full ``QK^T`` and ``PV`` against the causal half; the
    output layer over the padded vocabulary; wk and wv over replicated KV heads (and MLA's
    replicated down projections). Causes with no gap are left out.

    Llama-3-8B, tp 2, seq 8192, flash, no recompute: only the flash backward, 0.5 x the
    causal-half forward attention FLOP per layer (``tests/test_mfu_hfu.py``)."""
    out: dict[str, float] = {}
    for o in ops:
        d = o.hardware_flops - o.model_flops
        if d <= 0:
            continue
        cause = ("recompute" if o.recompute else FLOP_GAP_CAUSES[1] if o.kind == "attention" else
                 FLOP_GAP_CAUSES[2] if o.name.split(".")[0] in ("qk^T", "pv") else FLOP_GAP_CAUSES[3] if o.block == "head"
                 else FLOP_GAP_CAUSES[4])
        out[cause] = out.get(cause, 0.0) + d
    return {c: out[c] for c in FLOP_GAP_CAUSES if c in out}
