"""The float8 work torchao adds around each float8 Linear's GEMMs (``training.linear_dtype =
"fp8"`` under ``framework = "torch"``): the amax reductions, the casts to float8 and the
transposed float8 copies the backward's GEMMs need, as memory-bound kernels (HBM bytes read and
written, timed at the catalog's achievable bandwidth by :func:`meshplan.compute.layer.layer_costs`),
and the tp all-reduces of the amax of sharded tensors.

Sources (read, not copied): pytorch/ao at eab345c (Dec 2024, the torchao of torchtitan's
Tables 1-6) ``torchao/float8/float8_linear.py`` (``Float8Linear.forward``: input cast, weight
cast unless FSDP gathered it in float8, ``NoopFwToFloat8BwDynamic`` casting the output
gradient in backward), ``float8_scaling_utils.py`` and ``float8_utils.py``
(``tensor_to_amax`` = ``torch.max(torch.abs(x))``; ``amax_to_scale``; ``to_fp8_saturated``),
``float8_tensor.py`` (``_ToFloat8ConstrFunc``: ``x.to(float32) * scale``, clamp, ``.to(fp8)``),
``float8_ops.py`` (``preprocess_addmm``: ``torch._scaled_mm`` takes a row-major first and a
column-major second operand, so the data-gradient GEMM copies the weight transposed,
``b.t().contiguous().t()``, and the weight-gradient GEMM copies the output gradient
(``a.contiguous()``) and the input transposed), ``fsdp_utils.py``
(``precompute_float8_dynamic_scale_for_fsdp``: after the optimizer, ``torch._foreach_norm(weights,
inf)`` of every local weight shard and one all-reduce of the stacked amaxes; with it FSDP
gathers the weights already cast, ``fsdp_pre_all_gather``), ``float8_tensor_parallel.py``
(``PrepareFloat8ModuleInput``, ``Float8ColwiseParallel``, ``Float8RowwiseParallel``: the cast
of a DTensor shard, whose ``torch.max`` is a Partial max that DTensor all-reduces over tp before
the scale); and ``torchao/testing/float8/roofline_utils.py`` at 955ebb0 (May 2025,
``get_tensor_memory_traffic_ovhd_s``): torchao's own count of the kernels inductor generates
for these casts under ``torch.compile`` (torchao's README: "enable torch.compile for
competitive performance"; torchtitan compiles its blocks).

**Passes per tensor, compiled** (``b`` bytes of a compute-dtype element; torchao's roofline
with ``enable_fusion_modeling`` off, its default: the amax is not fused into the op that
produced the tensor):

- tensorwise, an activation (input, output gradient): 2 passes, the amax (read ``b``; its
  second stage over the partial maxima is a tiny kernel, not counted, as torchao does) and
  the cast writing both layouts (read ``b``, write 1 row-major + 1 column-major): ``2 b + 2``
  per element. Shared inputs are cast once (wq, wk, wv; w_gate, w_up: inductor's CSE of the
  same ops on the same tensor; torchao's TP casts them once before the gather by design).
  Under torchao's float8 TP (sequence parallel, tp > 1) the block inputs and the row-parallel
  output gradients are cast on the rank's sequence shard before the all-gather (amax ``b``,
  cast ``b + 1``: row-major only) and the gathered float8 tensor is copied transposed for the
  weight gradient (read 1, write 1 of the gathered tensor); the layout copy of each such gather
  at batch > 1 (:mod:`meshplan.compute.dtensor_sp`) moves float8 too (:func:`sp_gather_in_float8`);
- tensorwise, a weight: gathered in float8 (``training.fp8_all_gather``) nothing in forward and
  in backward the transposed copy (read 1, write 1); otherwise the amax (``b``), the forward
  cast (``b + 1``) and the backward's cast of the other layout (``b + 1``);
- rowwise (per-row scales, no global amax, no all-reduce): an activation 2 kernels, the cast
  along rows that also writes the tensor transposed in the compute dtype (``2 b + 1``) and the
  transposed copy's cast (``b + 1``); a weight 3 (forward cast ``b + 1``, backward transpose
  ``2 b`` and cast ``b + 1``).

**Rowwise, checked against the versions of torchtitan's rowwise runs** (its 2025-06 async TP
benchmark: torch 38410cf9, torchao built 2025-06-13/14, read at pytorch/ao 6243040):

- Casts: ``matmul_with_hp_or_float8_args`` casts the input and the weight along rows in forward
  and saves both in high precision; in backward the output gradient along rows and the weight
  along the other axis (data gradient), the output gradient and the saved input along the other
  axis (weight gradient): two casts per tensor, one per axis, as counted above with the bytes of
  torchao's roofline (955ebb0). Whether the input's second cast runs in forward (the roofline's
  fused kernel) or in backward from the saved input is the AOTAutograd partitioner's choice, not
  read from a trace.
- GEMMs: the forward's runs torch's CUTLASS rowwise kernel, the backward's cuBLAS's tensorwise
  one with a rescale (:func:`rescale_kernels`); all three take the catalog's cuBLASLt fp8 rows
  (``meshplan/catalog/kernels.toml``, h100-sxm5-80gb: the sources, and what was searched).
- Under plain TP (:func:`rowwise_tp`) a cast whose ``torch.amax(abs(x), dim)`` reduces over a
  tp-sharded dim is a DTensor Partial max, all-reduced over tp before its scale as the tensorwise
  amax is (``tensor_to_amax``, ``amax_to_scale``: the same code for both granularities): in
  forward the row-parallel Linears' inputs (sharded along K: one scale per token) and weights
  (one per output unit), in backward the column-parallel ones' output gradients (sharded along
  N: one per token) and weights (one per input unit): :data:`TOKEN_SCALES`, :data:`WEIGHT_SCALES`
  (:func:`~meshplan.compute.float8_tp_reduces.rowwise_tp_per_layer`; the table's rows: :mod:`meshplan.comm.tp_rows`). Not checked in a trace.

**Eager** (not compiled): each torch op a kernel, each Linear its own casts: amax = ``abs``
(read b, write b) + ``max`` (read b) = ``3 b``; cast = ``to(float32)`` (b + 4) + ``* scale``
(8) + ``clamp`` (8) + ``to(float8)`` (5) = ``b + 25``; the backward's transposed copies 2 B an
element each (weight, output gradient, input). Rowwise eager is counted as compiled, per
Linear (a lower bound: its kernel list is not derived here).

**Memory**: the float8 copies of the inputs that the weight-gradient GEMMs read live from the
forward to the backward, 1 B an element (:func:`saved_copies`; the memory timeline's
:func:`meshplan.memory.workingset.float8_copies`); the output gradients' and the weights' copies are
made and consumed in the backward.

**FSDP2's pre-all-gather cast** (``training.fp8_all_gather``; eab345c ``fsdp_utils.py``
``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``): before each all-gather of a unit
FSDP2 calls the hook on the rank's local shard of every float8 weight, held in the parameter
dtype (the fp32 master under torchtitan), which with the precomputed scale runs
``hp_tensor_and_scale_to_float8`` (``_ToFloat8ConstrFunc.forward``: ``tensor.to(float32) *
scale``, ``to_fp8_saturated``: ``clamp``, ``.to(float8)``) eagerly: FSDP2's hooks run outside
the compiled blocks. Per element of the shard: ``.to(float32)`` no kernel for fp32 (else read
``p``, write 4), ``* scale`` 8, ``clamp`` 8, ``.to(float8)`` 5: 21 B for fp32
(:func:`meshplan.compute.float8_fsdp.pre_all_gather_kernels`). They run in the all-gather's copy-in, on FSDP2's copy-in
stream (:mod:`meshplan.comm.fsdp2`), which the all-gather stream waits for: beside the compute,
before the collective, so the collective table adds their seconds to each fsdp all-gather's time
(:func:`meshplan.compute.float8_fsdp.pre_all_gather_seconds`, in forward and in every backward that gathers again).

**The output layer** (``training.fp8_output_layer``): its casts run eagerly, outside the compiled
blocks, counted in :mod:`meshplan.compute.float8_head` with this module's per-tensor kernels.

Not counted: the casts' tiny scale kernels; Transformer Engine's activation casts under Megatron-LM (its
weight casts, once a step: :func:`meshplan.schedule.step_end.te_fp8_cast_s`);
MoE and MLA layers (their float8 plans are not modelled). The per-step weight amax of the
precompute is :func:`meshplan.compute.float8_fsdp.precompute_bytes`, its all-reduce the table's per-step fsdp row, both
step-end events after the optimizer (:func:`meshplan.schedule.step_end.float8_precompute_s`);
under TP (tp > 1) each weight is a DTensor sharded over (dp_shard, tp), so its
``_foreach_norm`` is Partial on both mesh dims and the ``clamp`` redistributes the stacked
amaxes dim by dim: a second all-reduce of the same bytes over tp follows
(:func:`meshplan.compute.float8_fsdp.precompute_all_reduces`).
"""

from __future__ import annotations

from math import ceil


#: The tensor a float8 Linear casts as its input, by GEMM name: Linears sharing one input share
#: its cast (compiled), and the block the cast runs in (forward, the TP gather's side).
INPUTS = {"wq": ("attn input", "attn_pre"), "wk": ("attn input", "attn_pre"), "wv": ("attn input", "attn_pre"),
          "wo": ("wo input", "attn"), "w_gate": ("mlp input", "mlp_pre"), "w_up": ("mlp input", "mlp_pre"),
          "w_down": ("w_down input", "mlp")}
#: Inputs torchao's float8 TP casts on the sequence shard before the tp all-gather.
GATHERED_INPUTS = ("attn input", "mlp input")
#: Output gradients cast on the sequence shard before the backward's all-gather (row-parallel Linears),
#: and the backward block they are cast in (before the block, beside the residual's gradient).
GATHERED_GRADS = {"wo": "attn_post", "w_down": "mlp_post"}
#: Name prefix of the amax kernels (:data:`meshplan.compute.recompute.OP_SAC_NOT_REPLAYED`: torchtitan's
#: op-level AC saves ``aten.abs`` and ``aten.max`` outputs, "for low precision training").
AMAX = "float8 amax"
#: Mark of an amax whose tensor is a tp shard: DTensor all-reduces it over tp (the timeline's wait).
OVER_TP = "all-reduced over tp"
#: Row-parallel Linears (torch's ``RowwiseParallel``: input and weight sharded along K); the other
#: :data:`INPUTS` are column-parallel (weight and output gradient sharded along N).
ROW_PARALLEL = ("wo", "w_down")
#: Marks of a rowwise cast whose amax reduces over a tp-sharded dim (:func:`rowwise_tp`): an
#: activation's (one scale per token) and a weight's (one per hidden unit), all-reduced over tp.
TOKEN_SCALES, WEIGHT_SCALES = "token scales over tp", "weight scales over tp"


#: The float8 Linear whose torchao TP style casts the tensor each sequence-parallel gather of a
#: block moves, by (block, what is gathered) (:func:`sp_gather_in_float8`).
SP_GATHER_LINEAR = {("attn", "input"): "wq", ("mlp", "input"): "w_up",
                    ("attn", "output grad"): "wo", ("mlp", "output grad"): "w_down"}


def sp_gather_in_float8(model, w, block: str, what: str) -> bool:
    """Whether a sequence-parallel gather of ``block`` ("attn", "mlp") moves float8, so that its
    layout copy at batch > 1 (:mod:`meshplan.compute.dtensor_sp`) is 1 B an element: under
    torchao's float8 TP (:func:`float8_tp`) the block input (``what`` "input") is cast before its
    gather (``PrepareFloat8ModuleInput``) and the row-parallel output gradient ("output grad")
    before the backward's (``Float8RowwiseParallel``'s ``NoopFwToFloat8BwDynamic``), and the
    ``torch.cat`` of the gathered chunks runs on the Float8Tensor: ``float8_cat`` cats the
    ``_data`` viewed as uint8 (pytorch/ao 6243040 ``torchao/float8/float8_ops.py`` lines 252-286;
    ``float8_tensor_parallel.py`` lines 47-176). The scatters move the bf16 outputs and input
    gradients.

    >>> from meshplan import catalog
    >>> from meshplan.compute.ops import Workload
    >>> m, names = catalog.model("llama3-8b"), frozenset(INPUTS)
    >>> w = Workload(seq_len=8192, micro_batch=12, tp=8, sp=True, linear_dtype="fp8", float8_gemms=names)
    >>> sp_gather_in_float8(m, w, "attn", "input"), sp_gather_in_float8(m, w, "mlp", "output grad")
    (True, True)
    >>> sp_gather_in_float8(m, Workload(seq_len=8192, micro_batch=12, tp=8, sp=True), "attn", "input")
    False
    """
    return applies(w) and float8_tp(model, w) and SP_GATHER_LINEAR[(block, what)] in w.float8_gemms


def applies(w) -> bool:
    """Whether torchao's casts run: float8 Linears (``w.float8_gemms``) under torch (Megatron-LM's
    Transformer Engine casts its own way, not modelled)."""
    return w.linear_dtype == "fp8" and bool(w.float8_gemms) and not w.megatron_ops


def float8_tp(model, w) -> bool:
    """torchao's float8 TP styles run (:func:`meshplan.compute.dtensor_sp.float8_tp`'s rule on a
    Workload): tensorwise with ``fp8_tp`` (not :attr:`~meshplan.compute.ops.Workload.plain_tp_float8`),
    sequence parallel, tp > 1, a dense model without MLA. Without them: :func:`tensorwise_plain_tp`."""
    return w.sp and w.tp > 1 and not w.plain_tp_float8 and not model.is_moe and not model.is_mla


def tensorwise_plain_tp(model, w) -> bool:
    """Tensorwise float8 Linears under torch's plain TP (``fp8_tp`` false, tp > 1; dense layers, no
    MLA): each cast after the gathers, as without TP, but the amax of a tp-sharded DTensor is a
    Partial max all-reduced over tp (:func:`~meshplan.compute.float8_tp_reduces.plain_tp_amax_per_layer`; not checked in a trace)."""
    return applies(w) and not w.fp8_rowwise and not w.fp8_tp and w.tp > 1 and not model.is_moe and not model.is_mla


def rowwise_tp(model, w) -> bool:
    """Rowwise float8 Linears under torch's plain TP (tp > 1; dense layers, no MLA, as
    :func:`float8_tp`): casts of tp-sharded rows all-reduce their amaxes (module docstring)."""
    return applies(w) and w.fp8_rowwise and w.tp > 1 and not model.is_moe and not model.is_mla


def activation_kernels(rowwise: bool, eager: bool, b: int, shard: bool) -> list[tuple[str, float]]:
    """(kernel, bytes per element) of one activation's cast (module docstring); ``shard``: cast on
    a tp shard before a float8 all-gather (row-major only; the transposed copy after the gather).

    >>> activation_kernels(False, False, 2, False), activation_kernels(False, False, 2, True)
    ([('amax', 2), ('cast', 4)], [('amax', 2), ('cast', 3)])
    >>> activation_kernels(True, False, 2, False), activation_kernels(False, True, 2, False)
    ([('cast + transpose', 5), ('cast (transposed)', 3)], [('amax', 6), ('cast', 27)])
    """
    if rowwise:
        return [("cast + transpose", 2 * b + 1), ("cast (transposed)", b + 1)]
    if eager:
        return [("amax", 3 * b), ("cast", b + 25)]
    return [("amax", b), ("cast", b + (1 if shard else 2))]


def weight_kernels(rowwise: bool, eager: bool, b: int, gathered_fp8: bool) -> list[tuple[str, str, float]]:
    """(kernel, phase, bytes per element) of one weight (module docstring).

    >>> weight_kernels(False, False, 2, True)
    [('transpose', 'backward_input', 2)]
    >>> [x[2] for x in weight_kernels(False, False, 2, False)], [x[2] for x in weight_kernels(True, False, 2, False)]
    ([2, 3, 3], [3, 4, 3])
    """
    if gathered_fp8:
        return [("transpose", "backward_input", 2)]
    if rowwise:
        return [("cast", "forward", b + 1), ("transpose", "backward_input", 2 * b), ("cast (transposed)",
                                                                                       "backward_input", b + 1)]
    if eager:
        return [("amax", "forward", 3 * b), ("cast", "forward", b + 25), ("transpose", "backward_input", 2)]
    return [("amax", "forward", b), ("cast", "forward", b + 1), ("cast (transposed)", "backward_input", b + 1)]


def layer_kernels(model, w, gemms, b: int) -> list[tuple[str, str, str, float]]:
    """(name, block, phase, bytes) of one layer's float8 kernels per micro-batch: each float8
    GEMM's input (once per shared input when compiled), output gradient and weight, at the
    rank's shapes (``gemms``: :func:`meshplan.compute.shapes.layer_gemms`; M = the rank's
    tokens, gathered under SP). An amax over a tp shard carries :data:`OVER_TP` in its name.

    Llama 3 8B, batch 2 x 8192 tokens (M = 16,384), no TP, tensorwise compiled, weights gathered
    in float8: 4 inputs (attention's and MLP's 4096 wide, wo's 4096, w_down's 14336) and 7 output
    gradients (wq 4096, wk and wv 1024, wo 4096, w_gate and w_up 14336, w_down 4096) at 2 + 4 B an
    element; the 7 weights' transposed copies (218,103,808 elements) at 2 B:

    >>> from meshplan import catalog
    >>> from meshplan.compute.ops import Workload
    >>> from meshplan.compute.shapes import layer_gemms
    >>> m, names = catalog.model("llama3-8b"), frozenset(INPUTS)
    >>> w = Workload(seq_len=8192, micro_batch=2, linear_dtype="fp8", float8_gemms=names, fp8_all_gather=True)
    >>> k = layer_kernels(m, w, layer_gemms(m, 1, 16384), 2)
    >>> [(name, nb) for name, _, _, nb in k[:2]]
    [('float8 amax (attn input)', 134217728.0), ('float8 cast (attn input)', 268435456.0)]
    >>> widths = (3 * 4096 + 14336) + (4096 + 2 * 1024 + 4096 + 2 * 14336 + 4096)
    >>> len(k), sum(x[3] for x in k) == 16384 * widths * 6 + 218103808 * 2 == 7281311744
    (29, True)
    """
    if not applies(w):
        return []
    eager, rowwise, tp8, rtp = w.torch_eager, w.fp8_rowwise, float8_tp(model, w), rowwise_tp(model, w)
    ptp = tensorwise_plain_tp(model, w)  # its sharded amaxes carry OVER_TP as float8 TP's
    out: list[tuple[str, str, str, float]] = []
    done: set[str] = set()
    for g in (g for g in gemms if g.name in w.float8_gemms and g.name in INPUTS):
        what, block = INPUTS[g.name]
        row, col = rtp and g.name in ROW_PARALLEL, rtp and g.name not in ROW_PARALLEL
        shared = what in done and (tp8 and what in GATHERED_INPUTS or not eager)
        done.add(what)
        if not shared:  # the input: cast once per shared tensor, per Linear eagerly
            out += _activation(what, block, "forward", g.m, g.k * g.count, w, rowwise, eager, b,
                               tp8 and what in GATHERED_INPUTS, tp8 or (ptp and g.name in ROW_PARALLEL),
                               TOKEN_SCALES if row else "")
        if eager and not rowwise and not (tp8 and what in GATHERED_INPUTS):  # the wgrad's transposed input (mm)
            out.append((f"float8 transpose ({what}, {g.name} wgrad)", _bw_block(block), "backward_input",
                        2.0 * g.m * g.k * g.count))
        grad_block = GATHERED_GRADS.get(g.name, _bw_block(block))
        out += _activation(f"{g.name} output grad", grad_block, "backward_input", g.m, g.n * g.count, w, rowwise,
                           eager, b, tp8 and g.name in GATHERED_GRADS, tp8 or (ptp and g.name not in ROW_PARALLEL),
                           TOKEN_SCALES if col else "")
        if eager and not rowwise and not (tp8 and g.name in GATHERED_GRADS):
            out.append((f"float8 transpose ({g.name} output grad)", _bw_block(block), "backward_input",
                        2.0 * g.m * g.n * g.count))
        for k, phase, nb in weight_kernels(rowwise, eager, b, w.fp8_all_gather and not rowwise):
            mark = OVER_TP if k == "amax" and (tp8 or ptp) else WEIGHT_SCALES if (row and k == "cast") or (
                col and k == "cast (transposed)") else ""
            name = f"float8 {k} ({g.name} weight" + (f", {mark})" if mark else ")")
            out.append((name, _bw_block(block) if phase != "forward" else block, phase, float(nb * g.n * g.k * g.count)))
        out += [(f"float8 rescale ({g.name} {which})", _bw_block(block), phase, float(nb * rows * g.k * g.count))
                for which, phase, nb, rows in rescale_kernels(rowwise, eager, b, g.m, g.n)]
    return out


def rescale_kernels(rowwise: bool, eager: bool, b: int, m: int, n: int) -> list[tuple[str, str, int, int]]:
    """(GEMM, phase, bytes per element, rows) of the rescales after a rowwise float8 Linear's two
    backward GEMMs (M tokens, N out features; each output has K columns). torchao's rowwise recipe
    runs them without fast accumulation (``Float8LinearConfig``: only ``gemm_config_output`` sets
    ``use_fast_accum=True``), and ``addmm_float8_unwrapped`` (pytorch/ao ``float8_ops.py``, since
    #1377, 2024-12-04, present in June 2025) then calls cuBLAS's tensorwise kernel with unit scales
    ("The rowwise CUTLASS-based kernel is so slow without fast-accum that we'd rather use the
    tensorwise cuBLAS-based kernel and do the scaling manually afterwards") and multiplies the
    output by ``a_inverse_scale * b_inverse_scale``, an ``(M, 1) x (1, N)`` outer product. Eager:
    the product materialised in fp32 (write 4 B) and ``output *= ...`` (read ``b`` + 4, write
    ``b``): ``2 b + 8`` per output element, both GEMMs. Compiled: one pass over the output (read
    ``b``, write ``b``, the scales read as vectors) for the weight gradient, an output of the
    compiled backward; the data gradient's pass is taken fused into the pointwise op that consumes
    it (the gradient sum or the norm's backward), so not counted. Tensorwise: none.

    >>> rescale_kernels(True, False, 2, 16384, 512), rescale_kernels(True, True, 2, 16384, 512)
    ([('wgrad', 'backward_weight', 4, 512)], [('dgrad', 'backward_input', 12, 16384), ('wgrad', 'backward_weight', 12, 512)])
    >>> rescale_kernels(False, False, 2, 16384, 512)
    []
    """
    if not rowwise:
        return []
    wgrad = [("wgrad", "backward_weight", 2 * b + (8 if eager else 0), n)]
    return ([("dgrad", "backward_input", 2 * b + 8, m)] if eager else []) + wgrad


def saved_copies(model, w, gemms) -> dict[str, int]:
    """Bytes of the float8 copies of a layer's Linear inputs that live from its forward to its
    backward, by input (:data:`INPUTS` names), 1 B an element of the rank's ``M x K`` input
    (``gemms``: :func:`meshplan.compute.shapes.layer_gemms`; M the rank's tokens, gathered under
    SP): compiled, the forward's cast writes the column-major copy the weight-gradient GEMM
    reads (module docstring; rowwise: its transposed cast, also in forward); eagerly
    ``manual_float8_matmul_with_args_in_float8.forward`` saves the row-major ``input_fp8``
    (eab345c ``float8_linear.py``, ``ctx.save_for_backward(input_fp8, weight_fp8_t)``), each
    Linear its own; under torchao's float8 TP the gathered float8 input, cast once before the
    gather. Shared inputs as :func:`layer_kernels` casts them. The weights' float8 copies are not
    kept (gathered in float8: FSDP2's buffer, resharded; otherwise cast again in backward).
    Whether they are saved or recomputed is the recompute policy's (the memory model's). torchao
    since 2025-01 (#1480, ``matmul_with_hp_or_float8_args``) saves the high-precision input
    instead and casts it in backward, eagerly; compiled, where the copy is written is the
    partitioner's choice, taken here as torchao's roofline takes it (not measured).

    >>> from meshplan import catalog
    >>> from meshplan.compute.ops import Workload
    >>> from meshplan.compute.shapes import layer_gemms
    >>> m = catalog.model("llama3-8b")
    >>> w = Workload(seq_len=8192, micro_batch=2, linear_dtype="fp8", float8_gemms=frozenset(INPUTS))
    >>> saved_copies(m, w, layer_gemms(m, 1, 16384))
    {'attn input': 67108864, 'wo input': 67108864, 'mlp input': 67108864, 'w_down input': 234881024}
    """
    if not applies(w):
        return {}
    tp8 = float8_tp(model, w)
    out: dict[str, int] = {}
    for g in (g for g in gemms if g.name in w.float8_gemms and g.name in INPUTS):
        what = INPUTS[g.name][0]
        shared = what in out and (tp8 and what in GATHERED_INPUTS or not w.torch_eager)
        if not shared:
            out[what] = out.get(what, 0) + g.m * g.k * g.count
    return out


def _bw_block(block: str) -> str:
    """The block of a backward kernel of a GEMM whose input is cast in ``block``."""
    return {"attn_pre": "attn", "mlp_pre": "mlp"}.get(block, block)


def _activation(what: str, block: str, phase: str, rows: int, cols: int, w, rowwise: bool, eager: bool, b: int,
                gathered: bool, tp8: bool, scales: str = "") -> list[tuple[str, str, str, float]]:
    """The kernels of one activation of ``rows x cols`` (rows: the rank's tokens, gathered);
    ``gathered``: cast on the sequence shard before a float8 all-gather, then copied transposed;
    ``scales``: the mark of a rowwise cast along tp-sharded rows (its first kernel, the row cast)."""
    n = (ceil(rows / w.tp) if gathered else rows) * cols
    out = []
    for i, (k, nb) in enumerate(activation_kernels(rowwise, eager, b, gathered)):
        mark = OVER_TP if k == "amax" and tp8 else scales if i == 0 else ""
        name = f"float8 {k} ({what}" + (f", {mark})" if mark else ")")
        out.append((name, block, phase, float(nb * n)))
    if gathered:
        out.append((f"float8 transpose ({what}, gathered)", _bw_block(block), "backward_input", 2.0 * rows * cols))
    return out
