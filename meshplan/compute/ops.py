"""Compute model of one rank: FLOP, HBM bytes and time of every op of a transformer layer,
the embedding and the output layer, per micro-batch; MFU and HFU.

This module holds what the others share: the rank's workload (:class:`Workload`), one kernel
(:class:`Op`) and a list of them (:class:`Cost`); the kernels a framework chooses are
:mod:`~meshplan.compute.kernel_choices`'s. The model itself, by concern:
:mod:`~meshplan.compute.kernel_time` (one kernel's time: issue floor, memory-bound op, GEMM
ops), :mod:`~meshplan.compute.attention` (the attention core), :mod:`~meshplan.compute.elementwise`
(norms, residual adds, activations, RoPE, biases), :mod:`~meshplan.compute.megatron_cost`
(Megatron-LM's own kernels and syncs as ops), :mod:`~meshplan.compute.recompute` (what a recompute
policy replays), :mod:`~meshplan.compute.layer` (one transformer layer),
:mod:`~meshplan.compute.embed_head` (the embedding and the output layer) and
:mod:`~meshplan.compute.flops` (model FLOP, MFU and HFU).

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
  (:func:`~meshplan.compute.kernel_time.issue_floor`); the batch's transfers to the GPU per micro-batch (:mod:`~meshplan.compute.batch_input`); the optimizer step
  streams its bytes at Triad (:func:`~meshplan.compute.kernel_time.optimizer_bandwidth`).
- **Recompute**: ``selective`` re-runs the attention core forward in backward (Korthikanti
  et al. 2022, section 5), and the forward kernels of the other modules of
  ``Workload.recompute_modules`` (Megatron-LM's ``--recompute-modules``:
  :func:`meshplan.compute.recompute.module_replays`; without ``core_attn`` the core is not
  re-run); ``full`` re-runs the whole layer forward. Recomputed ops count in
  hardware FLOP and time, never in model FLOP.
- **MFU / HFU**: model FLOP per step / (step time x ranks x dense peak), hardware FLOP
  likewise (Korthikanti et al. 2022, appendix A: model FLOP exclude recompute, hardware
  FLOP include it). Model FLOP are counted per op as above (causal half), unpadded
  vocabulary, each replicated KV head once; not ``6 N T``. :func:`~meshplan.compute.flops.korthikanti_model_flops`
  gives that paper's closed form (full attention) for comparison.

>>> from meshplan import catalog
>>> from meshplan.compute.layer import layer_cost
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

from dataclasses import dataclass
from functools import cached_property
from math import ceil
from typing import Optional

from meshplan.compute.routing import RoutingOptions

PHASES = ("forward", "backward_input", "backward_weight")
BLOCKS = ("embed", "attn_pre", "attn", "attn_post", "mlp_pre", "mlp", "mlp_post", "head")
RECOMPUTE = ("none", "selective", "full", "op")  # torchtitan's "layer": "full" or "none" per layer (layer_workload)


@dataclass(frozen=True)
class Workload:
    """What one rank computes per micro-batch: ``micro_batch`` sequences of ``seq_len``
    tokens, split by ``cp`` along the sequence and by ``tp``/``ep``/``etp`` across
    features; ``sp``: sequence parallel; ``dtype`` of activations and of every GEMM but the
    float8 Linears': the GEMMs of the weights named in ``float8_gemms`` run in ``linear_dtype``
    (:meth:`gemm_dtype`; :func:`~meshplan.compute.kernel_choices.float8_gemms` of a training contract).
    ``fused_qkv``: Q, K and V projected by one GEMM (:func:`~meshplan.compute.kernel_time.qkv_fused_ops`;
    Megatron-LM's, or torchtitan b5bcd76's ``wqkv``: :attr:`~meshplan.spec.training_knobs.TrainingKnobs.fuses_qkv`);
    ``fp32_wgrad_accumulation``: weight-gradient GEMMs accumulate into fp32 main gradients
    (:func:`~meshplan.compute.kernel_time.gemm_ops`); ``megatron_ops``: Megatron-LM's (2022, NVIDIA/Megatron-LM 2755bcb) own
    kernels around the GEMMs (:mod:`meshplan.compute.megatron`); ``attention_kernels``: the
    fused-attention kernels the framework runs, tried before the catalog's ``prefer`` list
    (:func:`meshplan.compute.measured.attention_seconds`; empty: the catalog's order);
    ``torch_eager``: torch runs the elementwise ops one kernel each, uncompiled
    (:mod:`meshplan.compute.torch_eager`); ``dtensor_host_s``: the host's (forward, backward)
    seconds to issue one transformer block under eager DTensor TP (torch, tp > 1, no
    torch.compile: :func:`meshplan.schedule.workload.workload_of`), zero otherwise, and
    ``dtensor_host_source`` where it comes from (the catalog or a kernels file); the device
    cannot run a block faster (:meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`); ``decomposed_norm``: with it, each RMSNorm as
    torchtitan's pre-2025 module's kernels (:func:`~meshplan.compute.torch_eager.rmsnorm_bytes`);
    ``sp_layout_copies``: torch's sequence-parallel
    collectives rearrange a multi-sequence micro-batch (:mod:`meshplan.compute.dtensor_sp`);
    ``async_tp``: the framework ("torch" or "megatron") whose decomposed TP GEMMs run (``training.tp_comm_overlap`` with sequence parallelism,
    :mod:`meshplan.compute.asynctp`), "" for none, ``copy_engine_gemm`` its GEMMs' slowdown beside the
    pulls and seconds a call (:func:`~meshplan.compute.asynctp.copy_engine_terms`); ``fp8_rowwise``: the float8 Linears scale
    rowwise (``training.fp8_recipe``); ``fp8_tp``: torchao's float8 TP styles apply to the
    tensorwise ones (``training.fp8_tp``); both decide which of torch's gathers fuse
    (:attr:`plain_tp_float8`);
    ``fp8_all_gather``: FSDP2 gathers them already cast (their casts: :mod:`meshplan.compute.float8`);
    ``torch_ring_attention``: at cp > 1 torch's context-parallel ring attention merges and
    accumulates its calls' results (:mod:`meshplan.compute.ring_attention`) with K and V at the heads the SDPA
    reads (``kv_expanded``, ``[memory] kv_expanded``: :func:`meshplan.spec.axes.tp.sdpa_kv_heads`; it also
    decides torchtitan's ``repeat_kv`` copies, :mod:`meshplan.compute.elementwise`), ``cp_alltoall`` its K/V
    rotated by all-to-all (``training.cp_rotate``: compiled, every step's concatenation runs); ``te_ring_attention``:
    at cp > 1 Transformer Engine's p2p ring (Megatron-LM's default ``--cp-comm-type``) runs the
    rank's attention as ``cp`` calls, one per ring step, each rated at its own shape as torch's are
    (:func:`meshplan.compute.te_ring.te_rank`: each step's call and TE's correction kernels by step); ``moe_tp_ops``:
    the forward collectives over tp of an MoE layer's MLP block, in issue order (their mirrors
    in backward; :func:`meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`, set by
    :func:`meshplan.schedule.workload.workload_of`): none where the routed experts issue nothing
    over tp and the layer has no shared expert; torchtitan's two reduce-scatters at ep 1, etp = tp,
    SP with shared experts; ``framework``: the training
    contract's (``torch`` or ``megatron``), whose Q, K and V widths the GEMMs take
    (:func:`meshplan.compute.shapes.qkv_local_features`: Megatron-LM's QKV sub-sharding past the KV heads);
    ``megatron_core``: with ``megatron_ops``, the step follows Megatron Core where it differs from
    2022 (``training.megatron_runtime = "core"``, :mod:`meshplan.compute.megatron_core`), and
    ``core_attention_mask``: its data loader's attention mask travels with the batch
    (``training.dataloader_attention_mask``); ``embed_reduce_scatter``: Megatron-LM reduce-scatters
    the embedding's output over tp instead of all-reducing it
    (:func:`meshplan.compute.megatron_core.embedding_reduce_scatter`, set by
    :func:`meshplan.schedule.workload.workload_of`, which knows the model); ``op_sac_policy``: the
    torchtitan commit whose op-level selective AC ``recompute = "op"`` follows
    (``training.op_sac_policy``, :func:`meshplan.compute.recompute.op_sac_fuses_qkv`);
    ``shared_beside_combine``: an MoE layer's shared experts run while DeepEP's combine is in flight
    (torchtitan's ``DeepEPMoE``, framework torch with ``moe_dispatcher = "deepep"``:
    :func:`meshplan.comm.deepep.shared_forward_s`); ``no_grad_bda``: Megatron-LM 2022's TorchScript
    bias-dropout-add runs without autograd in full recompute's ``no_grad`` forward and writes no
    dropout mask there (:func:`meshplan.compute.recompute.no_grad_forward`; not under a DeepSpeed
    engine, pipeline or ZeRO (:func:`meshplan.spec.wording.zero_runtime`), whose Megatron-DeepSpeed
    calls it under ``torch.enable_grad()``: bigscience-workshop/Megatron-DeepSpeed 06dc2d7
    ``megatron/model/transformer.py`` ``ParallelTransformerLayer.forward``; nor Core, not read);
    ``op_replays_ep``: an MoE layer's op-level SAC replay
    issues the EP dispatch and combine again (their outputs not in the policy's save list: torchtitan
    238fa99's Qwen3, :func:`meshplan.compute.recompute.op_sac_saves_all_to_all`, set by
    :func:`meshplan.schedule.workload.workload_of`, which knows the model)."""

    seq_len: int
    micro_batch: int = 1
    tp: int = 1
    cp: int = 1
    sp: bool = False
    ep: int = 1
    etp: int = 1
    dtype: str = "bf16"
    recompute: str = "selective"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    flash: bool = True
    dropout: bool = False
    vocab_pad_divisor: int = 128
    routing: RoutingOptions = RoutingOptions()
    fused_qkv: bool = False
    fp32_wgrad_accumulation: bool = False
    megatron_ops: bool = False
    attention_kernels: tuple[str, ...] = ()
    torch_eager: bool = False
    dtensor_host_s: tuple[float, float] = (0.0, 0.0)
    dtensor_host_source: str = ""
    decomposed_norm: bool = False
    eager_loss: bool = False
    decomposed_head_norm: bool = False
    sp_layout_copies: bool = False
    linear_dtype: str = ""
    float8_gemms: frozenset[str] = frozenset()
    fp8_rowwise: bool = False
    fp8_tp: bool = True
    fp8_all_gather: bool = False
    async_tp: str = ""
    copy_engine_gemm: tuple[float, float] = (0.0, 0.0)
    torch_ring_attention: bool = False
    cp_alltoall: bool = False
    kv_expanded: bool = False
    te_ring_attention: bool = False
    moe_tp_ops: tuple[str, ...] = ()
    framework: str = "torch"
    megatron_core: bool = False
    core_attention_mask: bool = False
    embed_reduce_scatter: bool = False
    op_sac_policy: str = "238fa99"
    shared_beside_combine: bool = False
    no_grad_bda: bool = False
    op_replays_ep: bool = False

    @property
    def plain_tp_float8(self) -> bool:
        """The float8 Linears run under torch's plain TP (rowwise, or tensorwise with ``fp8_tp``
        false): gathers in the compute dtype, cast after them, none fused by async TP.

        >>> Workload(seq_len=8, fp8_rowwise=True).plain_tp_float8, Workload(seq_len=8, fp8_tp=False).plain_tp_float8
        (True, True)
        """
        return self.fp8_rowwise or not self.fp8_tp

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
    ops; ``note`` says how the time was obtained; ``table_key``: the key a measured table
    (``--gemm-table``, :class:`meshplan.compute.gemm.GemmTable`) is looked up by, ``(M, N, K,
    dtype)`` for a GEMM, the ``GemmTable.attention`` key for fused attention, () for others;
    ``steps``: on Transformer Engine's p2p ring, the op's seconds at each of the ring's cp steps
    as (beside the step's send, after its wait) (:mod:`meshplan.compute.te_ring`), () for others."""

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
    table_key: tuple = ()
    steps: tuple = ()


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
        """``which``: "model" or "hardware". Each (which, phase) summed once per Cost, in op
        order (the same float on every call): the step and the search's step parts ask it of
        every layer, and a plan's layers of one kind share their Cost
        (:func:`meshplan.schedule.workload.chunk_costs`)."""
        memo = self._flops_memo
        key = (which, phase)
        if key not in memo:
            memo[key] = sum(o.model_flops if which == "model" else o.hardware_flops for o in self._sel(phase))
        return memo[key]

    @cached_property
    def _flops_memo(self) -> dict:
        """:meth:`flops` by (which, phase), filled as asked (a frozen dataclass: never stale)."""
        return {}

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
