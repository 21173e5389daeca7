"""meshplan against torchtitan's published H100 runs: NOT the development set (no constant of
the model is fitted to these; ../shared/reference/published-runs-dev.md is the development set).

Sources (pytorch/torchtitan, read at b5bcd76): ``benchmarks/llama3_h100_202412_torchtitan.md``
(Tables 1-6: torch 1963fc8, torchao eab345c, torchtitan 9dec370, Dec 2024) and
``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (torch 38410cf9, torchtitan 820504e,
June 2025). Hardware of both: Grand Teton, 8 H100 per host fully connected with NVLink, **H100
96 GB HBM2e, 2.4 TB/s, default 500 W power limit**, 400 Gb/s RDMA per GPU. TPS/GPU is read at
iteration 90. Settings not in the tables come from the presets of the torchtitan commit each
run used: seq_len 8192 (train_configs llama3_{8b,70b,405b}.toml at 9dec370 and 820504e), PP
micro-batches = pp degree (9dec370 ``pipelining_utils.build_pipeline_schedule``: the default of
``pipeline_parallel_microbatches``), float8 tensorwise with the float8 all-gather and the
precomputed scales (the 405B preset at 9dec370; torchtitan refuses the float8 all-gather with
rowwise).

**GPU.** That H100 (96 GB HBM2e, 500 W) has no datasheet: torchtitan's own footnote says its
peak "is between SXM and NVL, and we don't know its exact value". The runs are planned on catalog
node ``grand-teton-h100`` (8 GPUs on NVLink, one 400 Gb/s NIC per GPU) of GPU
``h100-hbm2e-96gb-500w``, which holds what is published of that part: 96 GB, HBM2e 2.4 TB/s
(torchtitan's pages) and one kernel measured on it, torch's fused AdamW on 'H100 (HBM2E, 500W)'
(pytorch/pytorch PR #119842: 3.564 ms for a 1/128 shard of Llama 2 70B in bf16, 14 B a
parameter: 2.117 TB/s), the bandwidth of every memory-bound kernel (norms: H100 SXM5's Liger fit
x 2.117 / 2.97); and three bf16 torch.matmul GEMMs on Meta's 'H100 500W' (pytorch/FBGEMM PR
#2546: 546-585 TFLOP/s at 8192^3, 65536x8192x7168, 65536x3584x8192, 0.77-0.81 of H100 SXM5's
table there): its bf16 GEMMs are the SXM5's points x 0.797. What is not published keeps the
700 W H100 SXM5's value, marked in the catalog: the peaks, SMs, fp8 GEMM and attention rows,
the NVLink and NIC curves. So the float8 GEMMs and attention are still those of a faster GPU
(upper bounds). The table's last column splits stage 0's kernels by the data that times them;
the sources are printed above it.
``--node dgx-h100`` plans the runs on the 700 W SXM5 instead: every number quoted below before
"On the part" was computed so, and that option reproduces them.

Rows: tokens/s per GPU (torchtitan's TPS/GPU: tokens of the global batch / step / GPUs),
published and predicted, error = predicted / published - 1, and the step's parts on its
critical stage (:meth:`meshplan.schedule.step_summary.StepTime.parts_s`). With ``--async-gain``
the published and predicted async TP gains.

**What was checked (8B at tp 8, 12 sequences, the async TP run of 2025-06).** Per layer torch's
TP issues what the table counts: an all-gather of the ``[12, 8192, 4096]`` bf16 activation
(805 MB) before the attention and the MLP (``PrepareModuleInput`` Shard(1) -> Replicate), a
reduce-scatter after wo and w2 (``RowwiseParallel(output_layouts=Shard(1))``), their mirrors in
backward; 1.935 ms each on the NVLink4 ring curve (busbw 364 GB/s at that size; D6: all-gather
358 GB/s at 8 GiB). torchtitan 820504e and 9dec370 set no inductor comm reordering, so the
vanilla collectives block, as modelled. FSDP runs over dp_shard across nodes (NICs), not the
NVLink TP uses. GEMMs run at M = 98,304 rows (the gathered sequence), N / 8: 368-711 TFLOP/s on
the catalog's table. Two sourced mechanisms were missing and are now modelled: the layout copies
of SP on dim 1 at batch > 1 (:mod:`meshplan.compute.dtensor_sp`, +139 ms per step there) and
op-level SAC under TP, which saves the reduce-scatters but replays the all-gathers (+124 ms of
exposed tp, and wk, wo, w3 and the elementwise ops recomputed instead of the attention).
torchao's float8 tensorwise TP (torchao eab345c ``float8/float8_tensor_parallel.py``:
``PrepareFloat8ModuleInput`` casts to float8 before the Shard(1) -> Replicate all-gather,
``Float8RowwiseParallel`` casts the output gradient before the mirror all-gather) is modelled
(``training.fp8_recipe``, :func:`meshplan.compute.dtensor_sp.float8_tp`): the fp8tw rows' 192
all-gathers per step at 8B move 402,653,184 B instead of 805,306,368 B (0.978 ms instead of
1.935 ms), exposed tp 627.0 -> 443.4 ms; the 70B rows' 4939.0 -> 3714.7 ms. The rowwise rows
keep torch's plain TP (torchtitan 820504e ``enable_float8_tensorwise_tp``), all in bf16. The
memory plans the gathered buffers (the forward's input, the backward's output gradient) at 1 B a
value too (:mod:`meshplan.memory.workingset`). The amax of each float8 cast of a DTensor shard
(``tensor_to_amax``'s ``torch.max`` on a Shard DTensor is a Partial max, all-reduced over tp
before the scale divides by it) is modelled (:mod:`meshplan.compute.float8`, tp all-reduce rows
of fp64): 4 forward casts and 7 output-gradient casts per layer and the 4 op-level AC replays,
blocking, 15.1 us each on the table's NVLink curve: 480 x 15.1 us = 7.2 ms a step at 8B (fp8tw
exposed tp 443.4 -> 450.6 ms). Not checked in a trace.

**The FSDP-only rows (T1, T3).** Tables 1-6 ran torchtitan 9dec370, whose presets (and
``config_manager.py``'s default) set ``model.norm_type = "rmsnorm"``: torchtitan's own Python
``RMSNorm`` (``models/norms.py``), which eager torch runs kernel by kernel (36 B an element
forward, 92 B backward, against 4 B and 6 B fused; ``training.torch_norm``,
:func:`meshplan.compute.torch_eager.rmsnorm_bytes`). Modelled: T1 FSDP's step 1882 -> 2103 ms
(+51.1% -> +35.2%), T3's +58.4% -> +41.4%, and the published compile gain of T1 (+15.7%) is now
predicted at +18.1% (was +5.7%). The optimizer there is torch's foreach AdamW (9dec370
``optimizer.py``: ``"foreach": not fused``, ``--optimizer.fused`` a store_true flag, default
false), so the T rows' TOMLs say ``[optimizer] fused = false`` (``training.optimizer_impl =
"foreach"``): eight passes, 80 B a parameter against the fused step's 28
(:func:`meshplan.schedule.optimizer_step.foreach_adam_bytes`), +17.6 ms a step at T1's 1.0e9
parameters a rank (Triad 2.97 TB/s): T1 +35.2% -> +34.1%, +38.0% -> +36.6%, +52.5% -> +50.4%;
T3 (0.063e9 a rank) +1 ms. The async TP runs (820504e) ran its default, fused. At 9dec370 only
the TransformerBlocks are compiled (``parallelisms/parallelize_llama.py`` ``apply_compile``;
``train.py``'s loss compile commented out, "compiling loss function causes CUDA errors"), so the
T rows' TOMLs say ``[compile] components = ["model"]`` (``training.torch_compile_loss = false``)
and the compiled rows run the fp32 cross entropy eagerly (16384 x 128256 logits at 24 B more
each, +17.0 ms) and the final norm kernel by kernel (as torchtitan still does today: its
``apply_compile`` compiles the blocks alone; 118 B more an element, +2.7 ms): T1 compile
+36.6% -> +35.1%, compile+fp8 +50.4% -> +48.2%, T3 +44.1% -> +42.4%, +59.0% -> +56.5%; the T1
compile gain is now predicted at +16.6% (published +15.7%). ``--itemise T1`` splits the three
T1 steps by kernel kind: the published step is longer in all three
(723, 639, 526 ms), although their GEMMs differ (1171 ms bf16, 665 ms float8); their attention
(FA2) is the same 382 ms, the compiled rows' memory-bound kernels the same 162 ms, and the
float8 row adds 97.4 ms of torchao's amax, casts and transposed copies: (d) below. What is
known of the rest, none of it modelled then: (a) the GPU: its HBM2e at 2.4 TB/s (torchtitan's
number) against the catalog GPU's 3.35 TB/s HBM3 would add 184 / 64 / 103 ms to the memory-bound
kernels (float8's included) at the same fraction of the bandwidth (a what-if then; now the
part's measured bandwidth is modelled: "On the part" below); its clocks under the 500 W cap,
which set its GEMMs and attention, are not published; (b) the eager head and (c) the foreach optimizer, now modelled (above);
(d) the float8 rows' casts, now modelled (:mod:`meshplan.compute.float8`, torchao eab345c and
its roofline's pass count under compile: per activation an amax pass and a cast writing both
layouts, 6 B an element in bf16; the float8-gathered weights copied transposed for the
data gradient, 2 B; op-level AC replays the input casts, not their amaxes): 7.28 GB a layer
per micro-batch at T1's 16,384 rows, +97 ms a step (T1 fp8 +48.2% -> +37.7%, T3 fp8 +56.5% ->
+45.2%), plus the precompute's read of the fp32 weight shards after the optimizer (1.1 ms) and
its all-reduce, now after it (was spread over the backward as a per-step reduction).
FSDP2's pre-all-gather casts of the fp32 weight shards (torchao eab345c ``fsdp_pre_all_gather``,
eager, 21 B an element) delay each layer's all-gather (T1 +215.9 us a gather, A8 +98.7 us) and
under TP the precompute's amaxes are all-reduced over tp too (896 B, a step-end event): T1 fp8
+37.7% -> +37.4%, the other float8 rows within 0.1 point (mean |error| 44.51% -> 44.48%). The
float8 input copies kept for backward (1 B a value, the memory timeline) move no row's peak:
every row recomputes (op-level or full AC), which replays the casts.
Rowwise (per-row scales, plain TP) casts the gathered tensors on every tp rank, 8 B an element
(A8 fp8rw +85.7% -> +59.8%, A70 fp8rw +76.2% -> +56.7%). Not checked in a trace.
Rowwise's casts along tp-sharded rows (row-parallel inputs and weights, column-parallel output
gradients and weights) all-reduce their scale vectors over tp (torchao's amax of a sharded DTensor,
as tensorwise's; :mod:`meshplan.compute.float8`): A8 fp8rw +31.6% -> +30.5%, async +30.7% -> +29.6%,
A70 fp8rw +30.4% -> +30.1%, async +30.7% -> +30.3% (mean |error| 17.1% -> 17.0%). Not checked in a trace.

**On the part** (grand-teton-h100; ``--node dgx-h100`` gives the numbers before). The
memory-bound kernels at the measured 2.117 TB/s instead of Triad's 2.97 (mean |error| 44.5% ->
35.1%), then the bf16 GEMMs at 0.797 of the SXM5's rates (-> 30.0%): the three T1 steps 2121 /
1819 / 1397 ms -> 2633 / 2209 / 1546 ms (+34.1% -> +8.0%, +35.1% -> +11.2%, +37.4% -> +24.2%),
A70 bf16 +27.5% -> +7.3%, A8 bf16 +27.4% -> +8.6%; every row closer, none below the published
rate. Then (issue 11 item 2) the cap on the other tensor-core kernels: the float8 GEMMs at 0.840 of
the SXM5's cuBLASLt table, the ratio of the same FBGEMM PR's fp8 GEMMs on 'H100 500W' (its Triton
row-wise kernel, 1083-1141 TFLOP/s at the three shapes, 0.80-0.87 of the table there; not torchao's
kernel, so the ratio mixes cap and kernel), and the attention at the bf16 GEMMs' 0.797, DERIVED (D),
an assumption (no attention kernel under a power cap is published; FA2 may draw less than a GEMM
and slow less): mean |error| 29.4% -> 17.1%, T1 +8.0 / +11.2 / +24.2% -> +4.2 / +6.5 / +9.4%, T2
+36.0 / +24.8 / +67.3 / +74.1% -> +13.5 / +2.8 / +36.2 / +40.8%, float8 rows +9.4-31.6%; every row
still above the published rate. The T1 bf16 rows' 0.11 / 0.15 s a step (16,384 tokens a GPU:
16384 / 5762 - 16384 / 6001.5 = 0.113 s, 16384 / 6667 - 16384 / 7103.3 = 0.151 s) is left to what
no source here names.

**The FSDP2 root (every row).** Both revisions predate torchtitan's own end units (83e6941, #1094):
``apply_fsdp`` wraps each block, then ``fully_shard(model)`` alone (9dec370
``parallelisms/parallelize_llama.py:325-339``, 820504e ``models/llama3/parallelize_llama.py:344-367``),
so embedding, final norm and output are one unit, the root's, which FSDP2 keeps gathered from its
forward to its backward and reduces in its final callback, waited for (``training.fsdp_root_unit``,
set by :func:`load_row`; :attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`). Before, the
later units were planned, which hid the head's gather and reduce-scatter: T1 exposed fsdp 8.7 ->
18.5 ms (the first all-gather 2.10 GB, the last reduce-scatter 4.20 GB fp32), T1 +4.2 / +6.5 / +9.4%
-> +3.9 / +6.2 / +9.0%, T3 +9.6 / +12.2 / +15.6% -> +9.2 / +11.7 / +14.9%, T4 +12.0% -> +11.8%, T5
(pp) unchanged; mean |error| 17.6% -> 17.3% (``--node dgx-h100`` 44.2% -> 43.9%). The rest of the
train step was read against the timeline and found modelled or free in the published window
(docs/fidelity.md: "Every torchtitan row is predicted fast"); T1's gap, 107 / 144 / 159 ms a step
(eager / compile / compile+fp8), grows as the kernels get faster: not a per-step term.

**NCCL's SMs on the network (nc52fixC).** The cross-node collectives hold their NCCL channels'
SMs too (:func:`meshplan.schedule.row_shares.nccl_net_channels`, read in NVIDIA/nccl 5067397: two
rings per NIC, 8 NICs a node, 16 of the 132 SMs; before, only NVLink collectives were charged):
the multi-node rows' kernels run slower beside the FSDP collectives, T3 +9.2 / +11.7 / +14.9% ->
+8.2 / +10.4 / +13.6% (T3's 26.8 ms of SM contention a step), T4 +11.8% -> +11.2%, T5 1F1B
+25.5% -> +25.1%, the A70 and A8 rows 0.2-1.2 points lower; the single-node rows (T1, T2)
unchanged; mean |error| 17.3% -> 16.7% (``--node dgx-h100`` 43.9% -> 43.0%).

**Context parallelism (T2).** torchtitan 9dec370 runs torch's ``context_parallel``
(``--experimental.context_parallel_rotate_method`` default ``"allgather"``; SDPA limited to the
flash and efficient backends), whose ring attention calls SDPA once per K/V chunk and merges
the calls in fp32, and sums dQ, dK, dV in fp32 in backward (torch
``distributed/tensor/experimental/_attention.py``, read at 0123248a; the Dec 2024 commit
1963fc8 not checked): now modelled (:mod:`meshplan.compute.ring_attention`, compiled pass
count): T2 cp2 +28.1% -> +24.8%, cp4 +71.7% -> +67.3%, cp8 +78.7% -> +74.1% (mean |error|
29.9% -> 29.4%; ``--node dgx-h100`` 44.3% -> 43.9%). Then its SDPA calls one by
one (:func:`meshplan.compute.ring_attention.ring_seconds`): per layer each rank issues one causal
(L, L) call and cp - 1 unmasked (L, L/2) or (L/2, L) at L = s / cp = 32,768 on every T2 row, each
rated at its own loop length (FA2's forward loops over the keys, its backward over the queries:
flash-attention's launch templates), where one causal lookup at S = s was taken before: the
unmasked forward at FA2's 370 against the causal 335 TFLOP/s (held from 16k), so T2 cp2 +2.8% ->
+4.4%, cp4 +36.2% -> +39.9%, cp8 +40.8% -> +45.6%: further from the published steps, as the
source has it. Then the block one cp rank's, the slowest of all by SDPA plus ring kernels
(:func:`meshplan.compute.ring_attention.slowest_rank`; before, rank 0's calls with rank cp - 1's
bytes): on T2 every rank's calls rate the same (rows held from 16k) and compiled the bytes tie,
so rank 0's, (cp - 1) n_kv B under rank cp - 1's count before, which took its half dK/dV adds at
the whole's 10 B (9 B): T2 cp2 +4.4% -> +4.5%,
cp4 +39.9% -> +40.0%, cp8 +45.6% -> +45.8%. Then the ring's collectives the table's
(``training.cp_attention = "ring"``, :func:`meshplan.spec.axes.cp.ring_rows`, read in torch 2.13's
``_context_parallel/_attention.py``): per layer K and V after ``repeat_kv`` (32 heads, 4 x the
8B's bytes) all-gathered beside the first SDPA call, again in backward, and the fp32 dK, dV
shifted cp times, each beside the next SDPA backward call but the last, exposed (1.07 GB at L
32,768, 2.93 ms over NVLink; 32 layers: 93.9 ms a step on every T2 row, 0.2-0.8% of its step;
the gathers and the other shifts fit beside their SDPA steps, their NCCL SMs slowing them): T2
cp2 +4.5% -> +3.4%, cp4 +40.0% -> +38.7%, cp8 +45.8% -> +44.9%. That 93.9 ms was the same on
every row because only each layer's last shift was exposed and a shift moves the rank's own
s / cp = 32,768 tokens' fp32 dK, dV whatever cp. But the T2 rows are compiled (torchtitan 9dec370
``apply_compile``: each TransformerBlock, ``fullgraph=True``), so AOTAutograd traces the ring into
the block's graphs, where every functional collective is followed by ``wait_tensor`` at once
(torch ``_functional_collectives.py`` ``_maybe_wrap_tensor``) and inductor's scheduler decides
where each wait runs: on torch 2.13 (``reorder_for_peak_memory`` on, its default; CPU, fake
process group, d 128, cp 2, 4, 8) the forward's gather still runs beside the first call, but the
backward's gather and every dK/dV shift are waited for at once
(:func:`meshplan.schedule.ring_timeline.compiled_ring_backward`; torch 1963fc8 not read): exposed
cp 93.9 ms -> 234.9 / 516.2 / 1078.6 ms at cp 2 / 4 / 8 (the gather of cp x 32,768 tokens' K, V
and cp shifts, a layer), less the NCCL SMs' slowing of the SDPA calls they no longer overlap: T2
cp2 +3.4% -> +2.5%, cp4 +38.7% -> +36.6%, cp8 +44.9% -> +42.1% (mean |error| 17.3% -> 17.0%;
``--node dgx-h100`` 44.0% -> 43.7%). The issue's +45.8% is not the ring's traffic. Checked and not
modelled: (i) nothing else of the calls: torch 2.13's ring
issues the same calls as the Dec 2024 one; (ii) the published steps are not linear
in cp: per GPU the attention work doubles from row to row (32,768 local tokens against a
sequence twice as long) while the published step goes 8.42 -> 12.90 -> 30.60 -> 59.80 s
(x1.53, x2.37, x1.95): cp2 -> cp4 more than doubles, which no per-token cost explains; nothing
here names the cause. Every T2 row's calls have the same shapes (L = 32,768: one causal L x L and
cp - 1 unmasked L x L/2 or L/2 x L, each rated from the catalog's FA2 rows at its loop length), so
no per-call rate differs between cp 2 and cp 4; what grows with cp at constant L is the ring's
traffic (now all counted: 0.23 -> 1.08 s a step) and its kernels (1.0 -> 1.6 s of memory-bound
work): the published step less the predicted rest of the step leaves the attention 1.21 / 1.03 /
1.44 / 1.47 x the predicted FA2 time at cp 1 / 2 / 4 / 8, not sourceable here. Also read, no change:
torch's SDPA takes the flash backend (its bundled FA2) before the efficient one, the two
torchtitan allows under CP (9dec370 ``utils.py`` ``get_train_context``; the priority order of
``sdp_utils.cpp`` not read at 1963fc8), so every ring step calls
``aten._scaled_dot_product_flash_attention`` and its backward; load balance (round-robin chunks)
and the all-gather rotation are the defaults (``_ContextParallelOptions``); the merge and the
dQ, dK, dV sums are fp32 (``convert_to_f32``) and the dK, dV go round the ring in fp32, cast back
once after the last shift. (iii) The 500 W cap on attention and float8 GEMMs: now modelled ("On the
part" above).

**Float8 tensorwise under TP, the bytes torchao moves** (pytorch/ao 6243040, June 2025, the
torchao of the A rows; the same code at eab345c for T4/T5). Read in ``float8_tensor_parallel.py``
(lines 47-176), ``float8_linear.py`` (``matmul_with_hp_or_float8_args``), ``float8_ops.py`` and
``distributed_utils.py``, and torchtitan 820504e ``parallelize_llama.py`` (``apply_tp``: the three
float8 styles; ``apply_compile``: ``fullgraph=True`` per block, so the TP hooks' casts are compiled;
``_save_list``: ``aten.max`` saved). Already modelled and checked again: the block inputs cast on
the sequence shard before the float8 gather (amax all-reduced over tp), the row-parallel inputs
cast on their K shard (amax over tp), every Linear's output gradient cast in backward by
``NoopFwToFloat8BwDynamic`` (7 a layer, amax over tp), no weight cast (FSDP2 gathers float8 with
the precomputed scale), the transposed copies ``preprocess_addmm`` makes (weight for the data
gradient, gathered input and gathered output gradient for the weight gradient). Two counts were
wrong and are now as the source has them: (1) ``float8_mm`` writes its output in the original
dtype (``output_dtype = a._orig_dtype``, ``torch._scaled_mm(out_dtype=...)``), so a float8
GEMM's memory roofline counts ``M N`` at 2 B (:func:`meshplan.compute.gemm_points.gemm_bytes`):
the tp-local data gradients of wk and wv (98,304 x 4,096 x 128 at 8B) 196 -> 387 us: A8 fp8tw
+16.6% -> +15.9%, async +23.7% -> +22.9%, A70 fp8tw +12.3% -> +11.8%, async +9.9% -> +9.3%, T4
+9.5% -> +9.0%, rowwise rows -0.3 to -0.7 points; (2) the SP layout copies of the float8 gathers
(batch > 1) copy Float8Tensors, ``float8_cat`` over the uint8 ``_data`` (``float8_ops.py`` lines
252-286): 1 B an element (:func:`meshplan.compute.float8.sp_gather_in_float8`), 805 MB instead of
1.61 GB a copy at 8B: A8 fp8tw +15.9% -> +20.1%, async +22.9% -> +26.3%, A70 fp8tw +11.8% ->
+14.9%, async +9.3% -> +11.6%, T4 +9.0% -> +12.0%, async +17.3% -> +19.8%, T5 +23.8 / +18.5% ->
+25.6 / +20.1%: further from the published rates, as the source has it. What the float8 TP rows
still miss is not found in the runtime's source: their predicted GEMMs are 1.80x (A8: 1218 ->
676 ms) and 2.00x (A70: 15848 -> 7924 ms) faster than bf16, and the tp-local shapes sit where the
catalog's H100 float8 points (S3: cubes, 1024x2145x1024, 6144x12288x12288, 802816x192x768) have
nothing: K 512 / 1,024 (wo forward, wq data gradient), N 128-512; XLA's sm_90 GEMM tables hold
bf16 and f32 only. DeepGEMM's block-scaled float8 on H800 (reference S5: 751 TFLOP/s at M 4,096,
N 32,768, K 512 against 1,265-1,426 at K 7,168-16,384) shows short-K float8 GEMMs far below the
long-K rate, but it is another kernel and GPU: not taken as a rate.

**Left (not modelled; no fitted constant).** (1) The GPU: its attention at 500 W is not
published (taken at the bf16 GEMMs' ratio, D), nor torchao's own float8 kernels there (FBGEMM's
Triton one is). (2) Async TP, modelled as torch fuses it at 38410cf9 (:mod:`meshplan.compute.asynctp`): the
forward's gathers and reduce-scatters, the backward's gathered output gradients, and under AC the
replayed gathers with the GEMMs recomputed beside them (op-level SAC: wk and w3 alone); the
backward's column-parallel reduce-scatters stay blocking, the returned gathered tensors still
cost the weight gradients a layout copy, and full AC replays no MLP reduce-scatter; float8
rowwise (``recipe_name``: ``training.fp8_recipe``) fuses its reduce-scatters only (bf16 gathers,
cast after). Predicted savings on the part 0.45 s per step at 8B bf16 and 3.80 s at 70B bf16
(dgx-h100: 0.38 s, 3.35 s; the memory-bound copies and replayed GEMMs async TP removes take
longer on the part) against 0.25 s and 2.32 s published (+14-20% against +6-16% with bf16 or
tensorwise, whose gathers move float8); rowwise 0.12 s and 0.88 s (dgx-h100: 0.09 s, 0.78 s) against
0.18 s and 1.10 s (+4-5% against +4-6%: A70 +4.4%, A8 +4.8%: 5,072.0 / 4,839.1). The model was
audited against torch's source (:mod:`meshplan.compute.asynctp`'s docstring: the two-stream
schedule, whose replay is :func:`~meshplan.compute.asynctp.fused_seconds`; copy-engine pulls within
3% of the ring step it takes; the barriers, 3 or 2 + 2 (tp - 1) a call, 2.6 ms a step at 8B at
most; the extra kernels): one kernel was missing, the restride of wo's input before its fused
reduce-scatter (:func:`~meshplan.compute.asynctp.restride_bytes`, 201 MB a layer at 8B: +3.0 ms a
step; 70B twice a layer under full AC), 8B bf16 +20.3% -> +20.1%, 70B +17.1% -> +16.9% (dgx-h100
+20.9% -> +20.8%, +18.6% -> +18.4%). Nothing else the source shows accounts for predicting about
twice the published bf16 gains. Then (issue 11, nc55 #5) a micro-level measurement on the part: the
GEMMs beside torch's copy-engine pulls run 9.55% slower, 20.7 us a call (yifuwang/symm-mem-recipes
README, "8xH100 (special version with HBM2e, at 500W)": a Triton GEMM fed by copy-engine pulls against
the same GEMM alone, six 70B / 105B rows, least squares; :func:`~meshplan.compute.asynctp.copy_engine_terms`,
bf16 only): A70 bf16 gain +16.1% -> +12.9% (saving 3.662 -> 3.021 s against 2.317 published), A8 bf16
+19.1% -> +17.1% (0.429 -> 0.390 s against 0.252), the float8 rows and ``--node dgx-h100`` unchanged;
mean |error| 16.7% -> 16.5%. Left, not sourced: 0.70 s at 70B, 0.14 s at 8B (docs/fidelity.md, "Async
TP at the micro level": where the predicted saving lies, what measurement would settle it). Not
modelled: two pieces' GEMMs at once on torch's two streams, the pieces' wave quantization (the bf16
GEMM table has no M above 4,096), the copy-engine pull's own rate under a GEMM (the ring step's). Left,
on the baseline's side: op-level
SAC replays wo and the scatters' layout copies in the compiled vanilla rows, which AOTAutograd's
partitioner drops as full AC's w_down (:func:`meshplan.compute.recompute.full_ac_not_replayed`;
the reduce-scatter's output is saved, so nothing in backward reads them): 73.6 ms of the vanilla
8B step against 29.1 ms of the async one (gain +20.1% -> about +18%). Seen on torch 2.13 on CPU
(aot_eager, ``min_cut_rematerialization_partition``; not 38410cf9): a block of 4 mms under
torchtitan's op policy, checkpointed and compiled, re-runs in backward the second mm, which
relu's backward reads, not the fourth, which no backward op reads.

**Float8 at the micro level** (issue 11): torchao's float8 microbenchmark on the part
(``benchmarks/float8_micro.py``) showed the float8 backward GEMMs planned too fast: the catalog's fp8
rows are fast-accumulation rates, torchao runs the data- and weight-gradient GEMMs without it; x 1.286
there (kernels.toml ``fp8_no_fast_accum_slowdown``, derived from that table alone): every float8 row
0.8-11.2 points lower (T1 fp8 +9.0% -> +2.1%, A8 fp8tw +19.2% -> +13.5%, T5 1F1B +25.1% -> +13.9%), the
bf16 rows and ``--node dgx-h100`` unchanged; mean |error| 16.5% -> 12.3% (docs/fidelity.md).

**Memory** (the last column). Tables 1-5 publish torchtitan's logged memory, the caching
allocator's peak *reserved* bytes (9dec370 ``train.py`` line 393, ``metrics.py`` line 62:
``reserved_bytes.all.peak``) of the rank it logs (``run_llama_train.sh`` line 14: ``LOG_RANK`` 0,
so stage 0), which holds the allocator's cached and fragmented segments too. The column gives
it, then meshplan's simulated reserved peak of stage 0 (:mod:`meshplan.memory.allocator` on the
timeline, :mod:`meshplan.memory.reserved`; ``expandable_segments:True`` as the launch script sets,
``run_llama_train.sh`` line 22, which the importer states; ``meshplan memory``'s reserved peak), then
the peak incl. communication buffers of the most loaded stage (the memory timeline's peak over every
kind, :attr:`~meshplan.memory.timeline.Timeline.peak`; not the allocator's allocated peak, which leaves
the buffers out: the names of :mod:`meshplan.memory.reserved`). The eager fp32 loss of 9dec370
(``train.py`` lines 131-134, ``del pred`` at 307) is planned as torch runs it (the importer states
``memory.cross_entropy = "torch"``; measured on CPU by tests/test_loss_memory.py): the logits' fp32 ``.float()`` copy beside the kept
log-softmax in forward, and in backward the nll and log-softmax gradients beside it, 3 fp32 logits
at once; before, Megatron's in-place loss was taken (fp32 logits kept, one bf16 gradient).
T2's 32,768 tokens a rank x 128,256 fp32 logits are 15.66 GiB each: its peak moves from the
head's forward to the loss's backward, 44.3 / 44.5 / 44.5 / 44.3 -> 67.8 / 68.0 / 68.0 / 67.8 GiB
(published 83.9 / 84.2 / 84.0 / 84.5 reserved); T1 55.4 -> 67.2 (82.4 / 77.0 / 76.8), T3 44.9 ->
56.6 (67.0 / 62.0 / 61.8), T4 35.9 -> 55.4 GiB (71.9 / 67.6; loss_parallel at tp 8, 4 fp32
logit shards at once); T5's peak is in a layer's backward (58.2 / 47.5 GiB, published 82.5 /
72.7), unchanged. The async TP runs (820504e) compile the loss (stated ``compiled``: the bf16 logits
kept, one bf16 gradient, no fp32 logits; measured on CPU inductor): A70 35.9 -> 32.9-35.0 GiB,
A8 61.1 -> 58.2 GiB (not published). The peaks incl. communication buffers are 17.5% under the
published reserved bytes on average (34.7% at worst; 18.5% before the FSDP2 root unit). The
simulated allocator, whose rules are read in torch's source and nothing of which is fitted to these
rows, predicts the reserved bytes: T1 79.7 / 79.7 / 79.2, T2 85.0 / 85.0 / 85.1 / 87.6, T3 65.6 /
65.6 / 65.2, T4 65.2 / 65.2, T5 65.7 / 61.0 GiB: mean |error| 5.7%, max 20.4% (T5 1F1B), within 3.7%
on T2 and on the eager T1 and T3 rows (-3.3%, -2.1%), the compiled T1 and T3 rows over by 3.1-5.8%.
The FSDP2 root unit (above: embedding, norm and output, 2.10 GB gathered from the step's start to
its end) raised T1-T3 by 2.9-3.0 GiB, T4 by 0.7 (tp 8 shards both ends): mean 5.3% -> 5.7%, the
eager rows -6.9%, -6.4% -> -3.3%, -2.1%, the compiled ones from within 2.5% to over. What stays
under is where TP (T4: -9.3%, -3.6%) and the pipeline (T5: -20.4%, -16.1%) allocate tensors the
kind-level timeline does not list one by one (eager norms' temporaries, DTensor redistributions, the
pipeline's send and receive buffers), and those the allocator caches per stream (NCCL's internal
streams, the pipeline's P2P) that it keeps on the
compute stream: no row was measured allocated, so the split is not known.

Not expressible: Interleaved 1F1B's split of Table 5 (the split points are not published: v 2
assumed, marked), and Table 6's context-parallel 405B rows are skipped (CP with PP and async TP:
see the printed list).

Run: PYTHONPATH=. .venv/bin/python benchmarks/torchtitan_h100.py [--write DIR] [--only ID] [--itemise ID] [--async-gain]
[--node NODE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from meshplan import catalog
from meshplan.compute.measured import kernel_data
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of

#: The runs' node: Grand Teton, 8 H100 96 GB HBM2e at 500 W (catalog ``h100-hbm2e-96gb-500w``);
#: ``--node dgx-h100`` plans them on the 700 W H100 SXM5 instead (the numbers before that entry).
NODE = "grand-teton-h100"


@dataclass(frozen=True)
class Row:
    """One published row: ``id``, flavor, GPUs, degrees (dp_shard, tp, pp, cp), local batch,
    seq_len, AC mode ("op" = selective per op, "full"), compile, float8 ("", "tensorwise",
    "rowwise"), async TP, PP schedule, published TPS/GPU, a note, and the published memory
    (``published_gib``, Tables 1-5's "Memory(GiB)": torchtitan 9dec370 logs
    ``max_reserved_gib``, the caching allocator's ``reserved_bytes.all.peak``,
    ``torchtitan/metrics.py`` line 62 and ``train.py`` line 393; 0: not published)."""

    id: str
    flavor: str
    gpus: int
    fsdp: int
    tp: int
    pp: int
    cp: int
    local_batch: int
    seq_len: int
    ac: str
    compile: bool
    float8: str
    async_tp: bool
    published_tps: float
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    note: str = ""
    published_gib: float = 0.0


ROWS = (
    # Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, selective AC (per op)
    Row("T1 FSDP", "8B", 8, 8, 1, 1, 1, 2, 8192, "op", False, "", False, 5762, published_gib=82.4),
    Row("T1 FSDP+compile", "8B", 8, 8, 1, 1, 1, 2, 8192, "op", True, "", False, 6667, published_gib=77.0),
    Row("T1 FSDP+compile+fp8", "8B", 8, 8, 1, 1, 1, 2, 8192, "op", True, "tensorwise", False, 8532, published_gib=76.8),
    # Table 2: 8B, 8 GPUs, FSDP + CP + compile + float8, local batch 1, full AC
    Row("T2 cp1 32k", "8B", 8, 8, 1, 1, 1, 1, 32768, "full", True, "tensorwise", False, 3890, published_gib=83.9),
    Row("T2 cp2 64k", "8B", 8, 4, 1, 1, 2, 1, 65536, "full", True, "tensorwise", False, 2540, published_gib=84.2),
    Row("T2 cp4 128k", "8B", 8, 2, 1, 1, 4, 1, 131072, "full", True, "tensorwise", False, 1071, published_gib=84.0),
    Row("T2 cp8 256k", "8B", 8, 1, 1, 1, 8, 1, 262144, "full", True, "tensorwise", False, 548, published_gib=84.5),
    # Table 3: 8B, 128 GPUs, FSDP, local batch 2, selective AC
    Row("T3 FSDP", "8B", 128, 128, 1, 1, 1, 2, 8192, "op", False, "", False, 5605, published_gib=67.0),
    Row("T3 FSDP+compile", "8B", 128, 128, 1, 1, 1, 2, 8192, "op", True, "", False, 6514, published_gib=62.0),
    Row("T3 FSDP+compile+fp8", "8B", 128, 128, 1, 1, 1, 2, 8192, "op", True, "tensorwise", False, 8380,
        published_gib=61.8),
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, compile + float8, local batch 16, full AC
    Row("T4 2D", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "tensorwise", False, 829, published_gib=71.9),
    Row("T4 2D+asyncTP", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "tensorwise", True, 876, published_gib=67.6),
    # Table 5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, compile + float8 + async TP, local batch 32, full AC
    Row("T5 1F1B", "405B", 512, 8, 8, 8, 1, 32, 8192, "full", True, "tensorwise", True, 100, published_gib=82.5),
    Row("T5 Interleaved1F1B", "405B", 512, 8, 8, 8, 1, 32, 8192, "full", True, "tensorwise", True, 128,
        schedule="Interleaved1F1B", stages_per_rank=2, note="v 2 assumed: split points not published",
        published_gib=72.7),
    # async TP 2025-06: 70B, 256 GPUs, FSDP 32 x TP 8, compile, full AC, local batch 16
    Row("A70 bf16", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "", False, 597.3),
    Row("A70 bf16 async", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "", True, 652.4),
    Row("A70 fp8tw", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "tensorwise", False, 809.8),
    Row("A70 fp8tw async", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "tensorwise", True, 942.4),
    Row("A70 fp8rw", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "rowwise", False, 599.6,
        note="torchtitan#1207: rowwise vanilla TP slow"),
    Row("A70 fp8rw async", "70B", 256, 32, 8, 1, 1, 16, 8192, "full", True, "rowwise", True, 624.8),
    # async TP 2025-06: 8B, 64 GPUs, FSDP 8 x TP 8, compile, per-op SAC, local batch 12
    Row("A8 bf16", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "", False, 4378),
    Row("A8 bf16 async", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "", True, 4809.4),
    Row("A8 fp8tw", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "tensorwise", False, 5078.1),
    Row("A8 fp8tw async", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "tensorwise", True, 5570.1),
    Row("A8 fp8rw", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "rowwise", False, 3708.5,
        note="torchtitan#1207: rowwise vanilla TP slow"),
    Row("A8 fp8rw async", "8B", 64, 8, 8, 1, 1, 12, 8192, "op", True, "rowwise", True, 3914.9),
)

#: Table 6 (405B, TP 8 x PP 8 x CP, 1F1B, local batch 8): not run (module docstring).
SKIPPED = ("T6 405B 4D (FSDP x CP x TP 8 x PP 8, seq 32k-256k): CP beside PP and async TP at 512 GPUs "
           "is not checked here",)


def toml_of(r: Row) -> str:
    """The torchtitan job TOML (keys of torchtitan's job_config.py as meshplan's importer
    reads them) that the row describes."""
    lines = ["[model]", 'name = "llama3"', f'flavor = "{r.flavor}"']
    if r.id.startswith("T"):  # Tables 1-6 ran torchtitan 9dec370: its presets' norm_type
        lines += ['norm_type = "rmsnorm"']
    if r.float8:
        lines += ['converters = ["float8"]']
    lines += ["", "[training]", f"local_batch_size = {r.local_batch}", f"seq_len = {r.seq_len}", "max_norm = 1.0",
              "", "[parallelism]", "data_parallel_replicate_degree = 1",
              f"data_parallel_shard_degree = {r.fsdp}", f"tensor_parallel_degree = {r.tp}",
              f"pipeline_parallel_degree = {r.pp}", f"context_parallel_degree = {r.cp}",
              f"enable_async_tensor_parallel = {str(r.async_tp).lower()}"]
    if r.pp > 1:
        per_mb = r.local_batch // r.pp  # 9dec370: micro-batches = pp degree
        lines += [f'pipeline_parallel_schedule = "{r.schedule}"', f"pipeline_parallel_microbatch_size = {per_mb}"]
        if r.stages_per_rank > 1:
            lines += [f"pipeline_parallel_layers_per_stage = {_layers_per_stage(r)}"]
    if r.id.startswith("T"):  # 9dec370's unset --optimizer.fused (false): foreach AdamW
        lines += ["", "[optimizer]", "fused = false"]
    # 9dec370 compiled the TransformerBlocks alone (train.py's loss compile commented out)
    parts = '["model"]' if r.id.startswith("T") else '["model", "loss"]'
    lines += ["", "[compile]", f"enable = {str(r.compile).lower()}", f"components = {parts}", "",
              "[activation_checkpoint]"]
    lines += ['mode = "selective"', 'selective_ac_option = "op"'] if r.ac == "op" else [f'mode = "{r.ac}"']
    if r.float8:
        tw = r.float8 == "tensorwise"
        lines += ["", "[quantize.linear.float8]", f"enable_fsdp_float8_all_gather = {str(tw).lower()}",
                  f"precompute_float8_dynamic_scale_for_fsdp = {str(tw).lower()}", 'filter_fqns = ["output"]']
        if not tw:
            lines += ['recipe_name = "rowwise"']
    return "\n".join(lines) + "\n"


def _layers_per_stage(r: Row) -> int:
    """Layers per stage for ``stages_per_rank`` stages on each of pp ranks (126 layers for 405B)."""
    layers = {"8B": 32, "70B": 80, "405B": 126}[r.flavor]
    return -(-layers // (r.pp * r.stages_per_rank))


@dataclass
class Result:
    row: Row
    tps: float = 0.0
    mfu: float = 0.0
    parts_ms: dict = field(default_factory=dict)
    by_source_ms: dict = field(default_factory=dict)
    fits: Optional[bool] = None
    peak_gib: float = 0.0
    error: str = ""
    reserved_gib: float = 0.0


#: Kernel kinds by the catalog data that times them (kernels.toml, the node's GPU): on
#: ``h100-hbm2e-96gb-500w`` memory-bound kernels stream at the bandwidth measured on that part
#: (S12), GEMMs and attention take the 700 W H100 SXM5's rows (none of that part published).
SOURCE_OF_KIND = {"memory": "memory-bound", "gemm": "GEMM", "attention": "attention"}


def by_source(plan) -> dict[str, float]:
    """Seconds per step of stage 0's layer, embedding and head ops by the kind of data that
    times them (:data:`SOURCE_OF_KIND`; ops of other kinds left out), micro-batches included."""
    out: dict[str, float] = {}
    for ch in chunk_costs(plan, workload_of(plan))[0]:
        for cost in [*ch.layers, *(x for x in (ch.embed, ch.head) if x is not None)]:
            for o in cost.ops:
                if o.kind in SOURCE_OF_KIND:
                    k = SOURCE_OF_KIND[o.kind]
                    out[k] = out.get(k, 0.0) + o.seconds * plan.micro_batches
    return out


def load_row(path: Path, r: Row, node: str = NODE):
    """The row's config: its TOML imported on catalog node ``node``, with ``training.fsdp_root_unit``
    set: both revisions the runs name (9dec370, 820504e) predate torchtitan's own end units
    (83e6941, #1094) and wrap the embedding, the final norm and the output in the FSDP2 root
    (:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`); a job TOML has no key for it.
    And ``[memory] kv_expanded``: both predate ff0829c (v0.2.2), so their llama3 repeats K and V to the
    q heads before SDPA (9dec370 ``models/llama/model.py`` ``repeat_kv``), where the import plans the
    KV heads of its later revision (:func:`meshplan.interop.torchtitan_tables.kv_heads_read`)."""
    cfg = load_any(path, "torchtitan", ImportOptions(cluster=node, nodes=r.gpus // 8))
    return replace(cfg, training=cfg.training.model_copy(update={"fsdp_root_unit": True}),
                   memory=cfg.memory.model_copy(update={"kv_expanded": True}))


def predict(r: Row, folder: Path, node: str = NODE) -> Result:
    """Import the row's TOML and run meshplan's step model on it, on catalog node ``node``."""
    path = folder / (r.id.replace(" ", "_").replace("+", "-") + ".toml")
    path.write_text(toml_of(r))
    try:
        plan = build_plan(load_row(path, r, node))
        st = step_time(plan)
    except ConfigError as e:
        return Result(r, error=str(e))
    per_gpu = st.tokens_per_s / st.world
    return Result(r, per_gpu, st.mfu, {k: v * 1e3 for k, v in st.parts_s().items()},
                  {k: v * 1e3 for k, v in by_source(plan).items()},
                  fits=plan.feasible, peak_gib=plan.timeline.peak.total_bytes / 2**30,
                  reserved_gib=plan.timelines[0].reserved_memory().reserved_bytes / 2**30)


def sources_lines(node: str) -> list[str]:
    """Where every prediction's GPU constants come from: the node's GPU entry (gpus.toml) and
    its measured kernel data (kernels.toml), with their sources."""
    g = catalog.system(node, 1).gpu
    data = kernel_data(g.name)
    out = [f"gpu {g.name}: {g.hbm_gb:g} GB, HBM {g.hbm_bandwidth_tb_per_s:g} TB/s, bf16 peak "
           f"{g.peak_tflops['bf16']:g} TFLOP/s, {g.sms} SMs (`meshplan catalog gpu {g.name}`: each value's source)"]
    if data is not None:
        out.append(f"kernels: memory-bound at {data.stream_bytes_per_s / 1e12:.3f} TB/s; sources: {data.source}")
    return out


def table(results: list[Result]) -> list[str]:
    """Markdown rows: published vs predicted TPS/GPU, error, MFU, parts (ms)."""
    out = ["| row | published TPS/GPU | predicted | error | MFU (pred, bf16 or fp8 peak) | step parts (ms) | "
           "kernels (ms, stage 0; sources above) | memory GiB: published reserved peak / predicted reserved peak "
           "(stage 0) / predicted peak incl. communication buffers (most loaded stage) |",
           "|---|---:|---:|---:|---:|---|---|---:|"]
    for x in results:
        if x.error:
            out.append(f"| {x.row.id} | {x.row.published_tps:,.1f} | - | - | - | {x.error} | - | - |")
            continue
        pub = f"{x.row.published_gib:.1f}" if x.row.published_gib else "-"
        parts = ", ".join(f"{k} {v:.1f}" for k, v in x.parts_ms.items())
        srcs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(x.by_source_ms.items()))
        err = x.tps / x.row.published_tps - 1
        out.append(f"| {x.row.id}{' *' if x.row.note else ''} | {x.row.published_tps:,.1f} | {x.tps:,.1f} | "
                   f"{err:+.1%} | {x.mfu:.1%} | {parts} | {srcs} | {pub} / {x.reserved_gib:.1f} / {x.peak_gib:.1f} |")
    return out


def step_s(r: Row, tps: float) -> float:
    """Seconds per step at ``tps`` tokens/s per GPU: the global batch's tokens
    (local batch x seq_len x dp_shard) over the GPUs, over ``tps``."""
    return r.local_batch * r.seq_len * r.fsdp / r.gpus / tps


def gains(results: list[Result]) -> list[str]:
    """Published vs predicted async TP gains for the rows that come in vanilla/async pairs, as
    a TPS ratio and as the seconds per step async TP saves (the ratio also moves with the
    step's other parts; the seconds are what the TP model alone decides)."""
    by = {x.row.id: x for x in results}
    out = ["| pair | published gain | predicted gain | published saving (s/step) | predicted saving (s/step) |",
           "|---|---:|---:|---:|---:|"]
    for x in results:
        twin = by.get(x.row.id + " async") or by.get(x.row.id + "+asyncTP")
        if twin is None or x.error or twin.error:
            continue
        r = x.row
        pub = step_s(r, r.published_tps) - step_s(r, twin.row.published_tps)
        pred = step_s(r, x.tps) - step_s(r, twin.tps)
        out.append(f"| {r.id} | {twin.row.published_tps / r.published_tps - 1:+.1%} | {twin.tps / x.tps - 1:+.1%} | "
                   f"{pub:.3f} | {pred:.3f} |")
    return out


def itemise(r: Row, folder: Path, node: str = NODE) -> list[str]:
    """The row's predicted step on stage 0 by kind of kernel (ms per step: the layers', the
    embedding's and the head's ops of :func:`~meshplan.schedule.workload.chunk_costs`, times the
    micro-batches), the optimizer step and the rest (pipeline bubble, exposed communication,
    FSDP2's copies, SM sharing), against the published step, on catalog node ``node``."""
    path = folder / "itemise.toml"
    path.write_text(toml_of(r))
    plan = build_plan(load_row(path, r, node))
    st, m = step_time(plan), plan.micro_batches
    kinds: dict[str, float] = {}
    for ch in chunk_costs(plan, workload_of(plan))[0]:
        for cost in [*ch.layers, *(x for x in (ch.embed, ch.head) if x is not None)]:
            for o in cost.ops:
                k = "GEMM" if o.kind == "gemm" else "attention" if o.kind == "attention" else \
                    "float8 amax, casts, transposes" if o.name.startswith("float8 ") else \
                    "norm kernels" if " norm" in f" {o.name}" else \
                    "other memory-bound" if o.kind == "memory" else o.kind
                kinds[k] = kinds.get(k, 0.0) + o.seconds * m
    kinds["optimizer step (and float8 precompute)"] = sum(
        e.end_s - e.start_s for e in st.post_events
        if e.stage == 0 and e.name in ("optimizer step", "float8 weight amax (precompute)"))
    kinds["rest (bubble, exposed comm, FSDP copies, SM sharing)"] = st.step_s - sum(kinds.values())
    pub = step_s(r, r.published_tps)
    out = [f"{r.id}: published step {pub * 1e3:.0f} ms, predicted {st.step_s * 1e3:.0f} ms "
           f"(gap {(pub - st.step_s) * 1e3:+.0f} ms)"]
    out += [f"  {k:54s} {v * 1e3:9.1f} ms" for k, v in kinds.items()]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))  # the whole first paragraph
    ap.add_argument("--write", help="keep the rows' torchtitan TOMLs in this folder")
    ap.add_argument("--only", help="rows whose id starts with this")
    ap.add_argument("--itemise", metavar="ID", help="the step of the rows whose id starts with ID by kind of kernel")
    ap.add_argument("--async-gain", action="store_true",
                    help="only the rows with and without async TP of each pair, and the gains")
    ap.add_argument("--node", default=NODE, help=f"catalog node to plan the runs on (default {NODE}: the runs' "
                    "96 GB HBM2e H100 at 500 W; dgx-h100: the 700 W H100 SXM5)")
    a = ap.parse_args(argv)
    if a.node not in catalog.names("node"):
        ap.error(f"--node: unknown catalog node {a.node!r}; known: {', '.join(catalog.names('node'))}")
    if a.itemise:
        with tempfile.TemporaryDirectory() as tmp:
            for r in (r for r in ROWS if r.id.startswith(a.itemise)):
                print("\n".join(itemise(r, Path(tmp), a.node)))
        return 0
    rows = [r for r in ROWS if not a.only or r.id.startswith(a.only)]
    if a.async_gain:  # a row and its twin with async TP
        ids, base = {r.id for r in ROWS}, lambda r: r.id.removesuffix(" async").removesuffix("+asyncTP")
        rows = [r for r in rows if {base(r) + " async", base(r) + "+asyncTP"} & ids]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.write or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = [predict(r, folder, a.node) for r in rows]
    gpu_name = catalog.system(a.node, 1).gpu.name
    print(f"torchtitan H100 runs (96 GB HBM2e, 500 W) planned on catalog {a.node} ({gpu_name}): not the dev set")
    print("\n".join(sources_lines(a.node)))
    print("\n".join(table(results)))
    errs = [abs(x.tps / x.row.published_tps - 1) for x in results if not x.error]
    if errs:
        print(f"mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%} over {len(errs)} rows")
    print("\n".join(gains(results)))
    for r in rows:
        if r.note:
            print(f"* {r.id}: {r.note}")
    for s in SKIPPED:
        print(f"skipped: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
