"""TP communication overlap as the runtimes run it (``training.tp_comm_overlap``): each fused
all-gather + GEMM and GEMM + reduce-scatter is decomposed into pieces along the token rows;
each piece's GEMM (M / pieces rows, timed at that shape by :func:`meshplan.compute.gemm.gemm_time`)
runs while the next piece's transfer is in flight. This module is the one home of which GEMMs are
fused, into how many pieces, what the runtime adds around them, and the pipeline formula; the
ops (:mod:`meshplan.compute.kernel_time`, :mod:`meshplan.compute.layer`) take the pieces' GEMM times and extra kernels from it, the rank
timeline (:mod:`meshplan.schedule.rank_timeline`) the fused op's time and exposed communication.
Sequence parallelism only: both runtimes fuse all-gathers and reduce-scatters (Megatron-LM
refuses ``--tp-comm-overlap`` without ``--sequence-parallel``); without it Megatron-LM's TP
all-reduces keep the timeline's ideal overlap (``Overlap.tp``, ``step --overlap-tp``) and
torch's block (:func:`unfused_overlap`).

**torch** (torchtitan ``enable_async_tensor_parallel``: inductor's
``torch/_inductor/fx_passes/micro_pipeline_tp.py``, which ``post_grad.py`` runs on every compiled
graph, forward and backward, and the ``torch/distributed/_symmetric_memory/__init__.py`` ops).
torchtitan's published async TP runs used torch 38410cf9 (2025-06-14) and torchtitan 820504e
(``models/llama3/parallelize_llama.py``: each TransformerBlock compiled, ``_micro_pipeline_tp``
and ``enable_symm_mem_for_group`` on the tp group, no other inductor option; op-level SAC saves
``reduce_scatter_tensor``). That commit's text is not in the stored index; these rules hold in
each stored version of the pass, from early 2025 (``List`` typing) to torch 2.13, and the one
that changed before 38410cf9 is in: a reduce-scatter whose result is saved for backward fuses
(pytorch#149946; torchtitan 88d8ab3, 2025-04-21, put it back in op SAC's save list "now that
it's supported in core").

- ``fuse_all_gather_matmul``: ``_find_consumer_matmuls`` takes the gathered tensor's users that
  are ``mm`` / ``_scaled_mm``, or ``reshape -> mm -> reshape``, with it as their left operand,
  all of them into one ``fused_all_gather_matmul`` (forward: wq, wk, wv after the attention
  norm's gather; w_gate, w_up after the MLP norm's; a replay under AC: the recomputed ones, under
  op-level SAC wk and w_up alone; backward: wo's and w_down's input gradient from their gathered
  output gradient). A weight gradient reads the gathered tensor through a ``permute`` or as
  the right operand: no consumer; it takes the tensor the fused op returns (``return_A``),
  whose all-gather the pipeline already hid, at the cost of a layout copy with several
  sequences (:mod:`meshplan.compute.dtensor_sp`).
  ``_pipelined_multi_all_gather_and_consume``: the rank copies its shard into its symmetric
  buffer (``copy_shard``, not overlapped: "giving up the chance to overlap mv and b with the
  first shard_consumer"), a barrier, then its own shard's GEMMs, then tp - 1 steps, each
  pulling one peer's shard (a device copy, copy engine) and running its GEMMs, on two
  alternating streams: piece i+1's copy runs beside piece i's GEMMs. **tp pieces**; exposed:
  the shard copy, then each step's copy beyond its piece's GEMM.
- ``fuse_matmul_reduce_scatter``: a reduce-scatter whose input is one matmul's output (forward:
  wo, w_down) becomes ``fused_matmul_reduce_scatter``; ``_pipelined_produce_and_all2all``
  computes the rows for peer (rank + step) into a symmetric buffer, barrier, the peer pulls them,
  tp - 1 steps on two streams, its own rows last (beside the last pull), then one kernel sums
  the tp partial row blocks (reads M x N, writes M / tp x N: exposed on the compute stream).
  **tp pieces**. Backward's input-gradient reduce-scatter of wq/wk/wv (w_gate/w_up) is not fused:
  its input is the sum of their input-gradient matmuls, not one matmul (``_find_producer_matmul``
  accepts mm or reshape-mm-reshape only).
- Nothing else: the collectives the pass leaves block as without it (:func:`unfused_overlap`).
- float8 tensorwise (torchao ``Float8ColwiseParallel`` and ``PrepareFloat8ModuleInput`` cast
  before the gather, ``Float8RowwiseParallel``'s ``_NoopFwToFloat8BwDynamic`` casts the output
  gradient before its gather, ``torchao/float8/float8_tensor_parallel.py``): the gathered float8
  tensors feed ``_scaled_mm`` directly, ``fused_all_gather_scaled_matmul``: the same fusions.
  Rowwise (``training.fp8_recipe``): torchtitan 820504e gives it plain ``ColwiseParallel``
  (bf16 gathers) and the cast inside the Linear stands between gather and ``_scaled_mm``: no
  all-gather fuses (``cast_after_gather`` of :func:`pieces`); its reduce-scatters do (torchao's
  ``matmul_with_hp_or_float8_args`` casts the 3-d input, then reshape -> ``_scaled_mm`` ->
  reshape; rowwise scales in ``fused_scaled_matmul_reduce_scatter``: pytorch#149247, which
  torchtitan#965 names as what rowwise async TP needs). Not modelled: the float8 gathers'
  1-byte elements.

**megatron** (``--tp-comm-overlap``: Transformer Engine userbuffers; defaults of TE's
``transformer_engine/pytorch/module/base.py`` ``initialize_ub``): ``ring_exchange`` for
qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad (num_splits = tp, copy-engine sends, 1 SM): **tp
pieces**, the local chunk's GEMM first (the norm writes straight into the userbuffer: no copy);
``pipeline`` for proj_fprop, fc2_fprop (num_splits 4, 16 SMs of reduce-scatter kernel, and from
TE 2.0 ``set_sm_margin``: the GEMMs run on the other SMs): **4 pieces**, each piece's
reduce-scatter after its GEMM, the last one exposed; ``bulk`` for qkv/fc1 dgrad and wgrad (the
re-gather beside the input-gradient GEMM, the reduce-scatter beside the weight-gradient GEMM:
what the timeline already does for Megatron-LM, ``Overlap.tp_grad``). Not Hopper-only: on
GPUs before compute capability 9.0 (A100) userbuffers run without CUDA multicast, through CUDA IPC
handles, with ``UB_SKIPMC=1`` (NVIDIA/TransformerEngine d0067d0, ``examples/pytorch/comm_gemm_overlap/
README.md`` and ``userbuffers.cu``'s ``__CUDA_ARCH__ >= 900`` multicast kernels; Megatron-LM d98e8a6
checks no compute capability for ``--tp-comm-overlap``), so the search keeps the knob on A100 and
export and launch set the variable (:func:`meshplan.interop.megatron_env.ub_skipmc`). The timing
here is the same on both paths: the IPC path's lower speed is not modelled.

One piece's transfer: a ring all-gather or reduce-scatter of the whole tensor is tp - 1 steps
of one shard each, so a piece's is the collective model's time / (tp - 1); a pipeline split's
reduce-scatter is the whole one's time / 4 (its latency term counted once in four: optimistic).

**torch's fused ops, checked against the source** (38410cf9 is not in the stored index; a stored
mid-2025 ``torch/distributed/_symmetric_memory/__init__.py``, with ``typing.Optional`` and
``_fused_all_gather_matmul_native`` but no last-gather-dim path, and torch 2.13's hold the same
``_pipelined_multi_all_gather_and_consume``, ``_pipelined_produce_and_all2all``,
``_fused_all_gather_matmul_impl`` and ``_fused_matmul_reduce_scatter_impl``):

- Schedule: the all-gather's own GEMMs on the current stream, then step i's pull and GEMMs on
  the backend stream (i odd) or the current one (i even); a pull waits for its stream's earlier
  GEMMs and pulls of the two streams do not overlap (the source's "cp from different streams
  cannot overlap"). The reduce-scatter: per step produce, barrier, pull, barrier on alternating
  streams, its own rows last. With one GEMM on the GPU at a time both give
  :func:`fused_seconds` (tests/test_asynctp_schedule.py replays the issue order).
- Transfers: ``Tensor.copy_`` of contiguous same-dtype tensors of one device is
  ``cudaMemcpyAsync`` (``aten/src/ATen/native/cuda/Copy.cu`` ``copy_device_to_device``, read at
  007aa8ae): copy engines over NVLink, no SMs, so no NCCL SM share is charged to them. Their rate
  stays the ring curve's step: the one copy-engine measurement here, p2pBandwidthLatencyTest's
  unidirectional P2P writes on HGX H100 SXM, 371-377 GB/s (public-microbenchmarks.md S14,
  NVIDIA/nccl#1264; torch pulls, reads, not measured), puts a 100.7 MB piece of Llama 3 8B's
  805 MB gather at 0.267-0.271 ms against the h100-nvlink4-ring step's 0.276 ms (364 GB/s):
  within 3%, no catalog field for it.
- Synchronisation per call: all-gather 3 barriers (one signal-pad write to and wait on each
  peer; 2 before the first pull, 1 after the last GEMM), reduce-scatter 2 + 2 (tp - 1) (those
  of a step hide behind the other stream's work but the first and last), two cross-stream
  waits. Their cost is measured on one GPU only, with the pulls' contention below (the
  regression's intercept, :func:`copy_engine_terms`); elsewhere not modelled (at the fabric's
  NCCL per-step latency, 3.4 us, 3 exposed a call would cost 32 layers x 8 calls x 3 x 3.4 us =
  2.6 ms of the 8B run's 2.6 s step).
- **The GEMMs beside the pulls run slower** (:func:`copy_engine_terms`, :func:`fused_seconds`'
  ``slowdown``): measured on the runs' own part, the 96 GB HBM2e H100 at 500 W on NVSwitch
  (yifuwang/symm-mem-recipes ``symm_mem_recipes/README.md``, 00db684: a persistent Triton GEMM
  consuming an all-gather whose shards the backend stream pulls from each peer's symmetric buffer
  one after another, ``Tensor.copy_``, the copy-engine pull torch's fused ops issue, against the
  same kernel with the data already there, ``triton mm only``; its cuBLAS column agrees with the
  catalog's GEMMs on that part within -5% to +9% at its nine shapes). On the six Llama 3 70B and
  105B rows, whose seven pulls take 20-39% of the GEMM at the ring step's rate (the kernel never
  waits for data), the fused kernel is 9.8-12.4% longer: least squares over the six, fused = 1.0955 x alone + 20.7 us. So a
  piece's GEMM with a pull beside it takes 1.0955 x its time alone, and each call 20.7 us more
  (its barrier, stream waits and progress writes); catalog ``kernels.toml``
  ``copy_engine_gemm_slowdown`` and ``copy_engine_call_s`` of that GPU; on GPUs without them, and
  for float8 GEMMs (the measurement is bf16), nothing is added. Why (HBM, or the power cap with
  the NVLink and copy engines drawing beside the SMs) the data does not say. On that part it
  moves the bf16 rows' predicted saving by 0.64 s a step at 70B (``benchmarks/torchtitan_h100.py
  --async-gain``); the 8B rows' pieces are about as long as their pulls, so less.
- Kernels beyond the GEMMs: the shard copy and the partial sum (:func:`torch_extra_bytes`, at the
  memory-bound kernels' rate although the shard copy is a copy-engine copy), the restride of wo's
  input (:func:`restride_bytes`). Not modelled: the copy of the own shard into the returned
  gathered tensor (``ag_out_needed``: the backward's and the replays' gathers), a copy-engine copy
  beside the last GEMM; the restride of the backward's first gathered gradient where it is the
  compiled graph's input (not checked).
- Not modelled: the GEMMs of two pieces running at once on the two streams (the source's answer
  to the pieces' wave quantization; the catalog's H100 bf16 GEMM table has no M above 4,096,
  so its pieces of M / tp rows rate about as the whole); the copy-engine pull's own rate under a
  GEMM (taken as the ring step's; the same README's 8B rows, whose pulls are 65-74% of the GEMM,
  run 18-70% longer than the kernel alone, more than the contention above explains: consistent with
  pulls of 4.2-16.8 MB shards taking about 13 us + S / 350 GB/s each, if those rows wait for data,
  which the README does not show; at the runs' 100-268 MB shards that would be 6-9% over the ring
  step, not taken).
"""

from __future__ import annotations

from math import ceil

#: Forward GEMMs fed by the gathered block input (column-parallel; Megatron-LM's fused "qkv").
AG_FORWARD = ("wq", "wk", "wv", "qkv", "w_gate", "w_up")
#: Forward GEMMs whose output is reduce-scattered (row-parallel).
RS_FORWARD = ("wo", "w_down")
#: Backward input-gradient GEMMs fed by the gathered output gradient (row-parallel's dgrad).
AG_BACKWARD = ("wo.dgrad", "w_down.dgrad")
#: TE userbuffers' ``pipeline`` method: num_splits and communication SMs (``initialize_ub`` defaults).
TE_PIPELINE_SPLITS = 4
TE_PIPELINE_SMS = 16
FRAMEWORKS = ("torch", "megatron")
#: Name prefix of the restride copy before wo's fused reduce-scatter (:func:`restride_bytes`).
RESTRIDE = "async-TP restride"


def te_fp8_gathers(model, training, sp: bool) -> bool:
    """Whether a dense layer's tp all-gathers move fp8, 1 byte a value, under Megatron-LM with
    ``--fp8-format`` (``training.linear_dtype = "fp8"``, framework megatron: Transformer Engine's
    linears, per-tensor scaling) and sequence parallelism ``sp``, with or without
    ``--tp-comm-overlap``. NVIDIA/TransformerEngine d0067d0: the layer norm's output is quantized
    before its gather for qkv and fc1 (``pytorch/module/layernorm_linear.py:292-313``), again for
    their weight gradients (776-792), and the output gradient before proj's and fc2's
    input-gradient GEMM (``module/base.py`` ``grad_output_preprocess`` 1718-1749); through
    userbuffers (``--tp-comm-overlap``) ``fill_userbuffers_buffer_for_all_gather`` (base.py:657-677)
    copies the quantized shard's 1-byte ``_data`` into buffers ``initialize_ub`` allocates in uint8
    for every all-gather GEMM when the fp8 mode is on (lines 336-345, 391, 472-476; Megatron-LM
    d98e8a6 ``initialize.py:228-246`` passes ``UserBufferQuantizationMode.FP8`` under ``args.fp8``),
    through NCCL ``gather_along_first_dim`` gathers a ``Float8Quantizer``'s tensor with
    ``_all_gather_fp8`` (``pytorch/distributed.py:1735-1745``). The reduce-scatters stay in the
    compute dtype, and so do the embedding's and the output layer's collectives (Megatron-Core's own
    linears). Dense, non-MLA models only, as :func:`meshplan.compute.dtensor_sp.float8_tp` (an MoE
    layer's MLP is not planned so).

    >>> from meshplan import catalog
    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", linear_dtype="fp8")
    >>> m = catalog.model("llama3-8b")
    >>> te_fp8_gathers(m, t, True), te_fp8_gathers(m, t, False), te_fp8_gathers(m, t.model_copy(update={"linear_dtype": None}), True)
    (True, False, False)
    """
    return (training.framework == "megatron" and training.linear_dtype == "fp8" and sp
            and not model.is_mla and not model.is_moe)


def model_name(framework: str, sequence_parallel: bool) -> str:
    """What ``training.tp_comm_overlap`` is modelled as, in the runtime's words (the one text
    ``plan`` and ``step`` print, :func:`meshplan.schedule.tp_overlap_lines.tp_overlap_line`).

    >>> model_name("megatron", True)
    'Megatron-LM --tp-comm-overlap as Transformer Engine userbuffers run it: decomposed GEMMs (meshplan.compute.asynctp)'
    >>> model_name("megatron", False)
    'TP all-reduces overlapping their block ideally (no sequence parallelism: the runtimes decompose only its all-gathers and reduce-scatters)'
    >>> model_name("torch", False).split(":")[0]
    'nothing decomposed'
    """
    if not sequence_parallel and framework == "torch":
        return ("nothing decomposed: without sequence parallelism torch's micro_pipeline_tp finds no all-gather or "
                "reduce-scatter to fuse, and the TP all-reduces block")
    if not sequence_parallel:
        return ("TP all-reduces overlapping their block ideally (no sequence parallelism: the runtimes decompose only "
                "its all-gathers and reduce-scatters)")
    runtime = {"megatron": "Megatron-LM --tp-comm-overlap as Transformer Engine userbuffers run it",
               "torch": "torchtitan's async TP as torch's micro_pipeline_tp runs it"}[framework]
    return f"{runtime}: decomposed GEMMs (meshplan.compute.asynctp)"


def unfused_overlap(framework: str) -> bool:
    """Whether the TP collectives ``framework``'s overlap does not decompose still overlap
    compute under ``training.tp_comm_overlap`` (``Overlap.tp`` of the rank timeline).

    Megatron-LM: yes (TE's ``bulk`` method runs the column-parallel input gradient's
    reduce-scatter beside the weight-gradient GEMM; without SP meshplan keeps its ideal overlap
    of the all-reduces). torch: no. micro_pipeline_tp rewrites only the all-gather -> matmul and
    matmul -> reduce-scatter patterns (module docstring); every other TP collective stays a
    functional collective whose ``wait_tensor`` inductor leaves before its first use, because
    ``torch/_inductor/config.py`` ``reorder_for_compute_comm_overlap = False`` by default
    (torchtitan 820504e sets no inductor option besides ``_micro_pipeline_tp``:
    ``models/llama3/parallelize_llama.py`` ``apply_tp``). So the backward's unfused
    reduce-scatters block as with async TP off: torch's autograd runs each column-parallel
    linear's input- and weight-gradient GEMMs in one ``MmBackward`` node before the sum of the
    input gradients reaches the reduce-scatter, and the norm's backward waits for it.

    >>> unfused_overlap("megatron"), unfused_overlap("torch")
    (True, False)
    """
    return framework == "megatron"


def pieces(framework: str, tp: int, name: str, phase: str, cast_after_gather: bool = False) -> int:
    """Pieces GEMM ``name`` (an op name of :mod:`meshplan.compute.ops`) of ``phase`` is cut into
    under ``framework``'s async TP at ``tp`` (module docstring); 0: not decomposed.
    ``cast_after_gather``: a float8 rowwise Linear's GEMM, whose gathered operand torch casts
    after the gather: not fed by an all-gather, so under torch its all-gathers do not fuse.

    >>> [pieces("torch", 8, n, "forward") for n in ("wq", "wo", "qk^T")]
    [8, 8, 0]
    >>> pieces("megatron", 8, "wo", "forward"), pieces("megatron", 8, "wo.dgrad", "backward_input")
    (4, 8)
    >>> [pieces("torch", 8, n, p, cast_after_gather=True) for n, p in (("wq", "forward"), ("wo", "forward"),
    ...                                                                 ("wo.dgrad", "backward_input"))]
    [0, 8, 0]
    """
    if framework not in FRAMEWORKS or tp < 2:
        return 0
    if framework == "torch" and cast_after_gather and (name in AG_FORWARD or name in AG_BACKWARD):
        return 0
    if phase == "forward" and name in AG_FORWARD:
        return tp
    if phase == "forward" and name in RS_FORWARD:
        return TE_PIPELINE_SPLITS if framework == "megatron" else tp
    if phase == "backward_input" and name in AG_BACKWARD:
        return tp
    return 0


def piece_rows(m: int, n_pieces: int) -> int:
    """Rows of one piece: ``ceil(M / pieces)`` (SP makes M a multiple of tp)."""
    return ceil(m / n_pieces)


def sm_margin(framework: str, name: str, phase: str, sms: int) -> float:
    """Slowdown of a piece's GEMM from SMs the runtime keeps for its communication kernel:
    ``sms / (sms - 16)`` for TE's ``pipeline`` reduce-scatter GEMMs (``set_sm_margin``, TE >= 2.0
    default for non-ring methods), else 1 (copy-engine transfers)."""
    if framework == "megatron" and phase == "forward" and name in RS_FORWARD and sms > TE_PIPELINE_SMS:
        return sms / (sms - TE_PIPELINE_SMS)
    return 1.0


def torch_extra_bytes(tokens: int, hidden: int, tp: int, dtype_bytes: int) -> dict[str, float]:
    """HBM bytes of the kernels torch's fused ops add on the compute stream, per fused op:
    ``shard copy`` (each all-gather+matmul: its shard read and written, ``tokens / tp x hidden``)
    and ``partial sum`` (each matmul+reduce-scatter: tp partial blocks of ``tokens / tp x hidden``
    read, one written).

    >>> torch_extra_bytes(8192, 4096, 8, 2)
    {'shard copy': 16777216.0, 'partial sum': 75497472.0}
    """
    shard = tokens / tp * hidden * dtype_bytes
    return {"shard copy": 2.0 * shard, "partial sum": shard * (tp + 1)}


def restride_bytes(name: str, m: int, k: int, dtype_bytes: int, micro_batch: int, inductor_writes: bool) -> int:
    """HBM bytes (read + written) of the copy inductor puts before the fused reduce-scatter of
    row-parallel GEMM ``name`` (its left operand ``m x k``: tokens x in-features / tp) to give
    that operand the order the fused op wants: ``fuse_matmul_reduce_scatter`` wraps it in
    ``inductor_prims.force_stride_order`` with ``restride_A_for_fused_matmul_reduce_scatter``'s
    strides (the scatter dim, the sequence, outermost), so that ``_fused_matmul_reduce_scatter_impl``'s
    ``A.movedim(scatter_dim, 0)`` is contiguous (torch 2.13 ``_inductor/fx_passes/micro_pipeline_tp.py``
    ``fuse_matmul_reduce_scatter``, ``distributed/_symmetric_memory/__init__.py``; the same in the
    stored mid-2025 version of the latter). Where inductor's own kernel writes the operand it
    writes it in that order (free): w_down's input (SiLU x up), and wo's where an inductor kernel
    writes it last (``inductor_writes``: a float8 Linear's cast of it; torch's ring attention under
    CP, whose fp32 merge of the SDPA calls ends in a cast, ``meshplan.compute.ring_attention``).
    Otherwise wo's input is the attention kernel's output (torchtitan 820504e
    ``models/llama3/model.py`` ``Attention.forward``: ``output.transpose(1, 2).contiguous().view(bs,
    seqlen, -1)``), an extern kernel's fixed ``[batch, seq, heads, head_dim]`` layout: with more
    than one sequence a micro-batch that order is not the sequence-outermost one, so it is
    copied, ``2 m k`` elements; with one sequence both orders are the same bytes (0).

    Llama 3 8B at tp 8, 12 sequences of 8,192: wo's input 98,304 x 512 bf16, 201 MB moved:

    >>> restride_bytes("wo", 98304, 512, 2, 12, False), restride_bytes("wo", 98304, 512, 2, 1, False)
    (201326592, 0)
    >>> restride_bytes("w_down", 98304, 1792, 2, 12, False), restride_bytes("wo", 98304, 512, 1, 12, True)
    (0, 0)
    """
    if name != "wo" or micro_batch < 2 or inductor_writes:
        return 0
    return 2 * m * k * dtype_bytes


def fused_seconds(gemm_s: float, comm_s: float, n_pieces: int, trail: bool = False,
                  slowdown: float = 0.0, call_s: float = 0.0) -> float:
    """Seconds of one fused op: ``n_pieces`` GEMM pieces of ``gemm_s / n_pieces`` each, piece
    i + 1's transfer (``comm_s`` each) beside piece i's GEMM:
    ``g + (n - 1) max(g (1 + slowdown), c) + call_s``, plus one more ``c`` when the last piece's
    transfer follows its GEMM (``trail``: TE's pipeline reduce-scatter). An all-gather's first
    piece is the local shard, beside the first pull, and its last GEMM runs alone; torch's
    reduce-scatter computes the first peer's rows alone and the local rows last, beside the last
    pull: either way n - 1 GEMMs have a transfer beside them, each ``slowdown`` longer, and the
    call adds ``call_s`` (:func:`copy_engine_terms`; 0 and 0: not measured).

    8 pieces of 1 ms GEMM against 0.5 ms transfers: 8 ms (hidden); against 2 ms: 1 + 7 x 2 = 15 ms:

    >>> round(fused_seconds(8e-3, 0.5e-3, 8), 12), round(fused_seconds(8e-3, 2e-3, 8), 12)
    (0.008, 0.015)
    >>> round(fused_seconds(4e-3, 0.5e-3, 4, trail=True), 12)  # 4 x 1 ms + the last 0.5 ms reduce-scatter
    0.0045

    On the 500 W HBM2e H100 (slowdown 0.0955, 20.7 us a call): 1 + 7 x 1.0955 + 0.0207 = 8.6892 ms;
    against 2 ms transfers still 1 + 7 x 2 + 0.0207 = 15.0207 ms:

    >>> round(fused_seconds(8e-3, 0.5e-3, 8, slowdown=0.0955, call_s=20.7e-6) * 1e3, 6)
    8.6892
    >>> round(fused_seconds(8e-3, 2e-3, 8, slowdown=0.0955, call_s=20.7e-6) * 1e3, 6)
    15.0207
    """
    if n_pieces < 1:
        return gemm_s
    g = gemm_s / n_pieces
    return g + (n_pieces - 1) * max(g * (1.0 + slowdown), comm_s) + call_s + (comm_s if trail else 0.0)


def copy_engine_terms(framework: str, float8: bool, data) -> tuple[float, float]:
    """(slowdown, call_s) of :func:`fused_seconds` for ``framework``'s fused ops on a GPU of
    kernel data ``data`` (:class:`~meshplan.compute.measured.KernelData`, or None): the measured
    ``copy_engine_gemm`` of that GPU (module docstring: a bf16 GEMM beside torch's copy-engine
    pulls of one peer's symmetric buffer at a time, and the fixed cost of a call) for torch's
    fused ops with bf16/fp16 GEMMs; (0, 0) for float8 GEMMs (``float8``: the fused Linears run
    float8, not measured), for Megatron-LM's Transformer Engine userbuffers (another runtime, not
    measured) and on GPUs without the measurement.

    >>> from meshplan.compute.measured import kernel_data
    >>> copy_engine_terms("torch", False, kernel_data("h100-hbm2e-96gb-500w"))
    (0.0955, 2.07e-05)
    >>> copy_engine_terms("torch", True, kernel_data("h100-hbm2e-96gb-500w")), copy_engine_terms("torch", False, kernel_data("h100-sxm5-80gb"))
    ((0.0, 0.0), (0.0, 0.0))
    """
    if framework != "torch" or float8 or data is None:
        return (0.0, 0.0)
    return data.copy_engine_gemm


def piece_comm_s(framework: str, collective_s: float, tp: int, reduce_scatter: bool) -> float:
    """One piece's transfer from the collective model's time of the whole collective
    (module docstring): ``/ (tp - 1)`` (ring step), or ``/ 4`` for TE's pipeline reduce-scatter."""
    if reduce_scatter and framework == "megatron":
        return collective_s / TE_PIPELINE_SPLITS
    return collective_s / max(tp - 1, 1)
