"""meshplan against MosaicML LLM Foundry's published A100 FSDP runs: NOT the development set (no
constant of the model is fitted to these; ../shared/reference/published-runs-dev.md is the
development set). A diagnostic: nothing in meshplan was changed to reduce the errors printed here.

Source (mosaicml/llm-foundry, read at 8c8dd48f72168c5d51e2f7b151595892a8fba43d, July 2025):
``scripts/train/benchmarking/README.md``, the tables "A100 80GB with 1600 Gbps node-node
interconnect (RoCE)" and "A100 40GB with 1600 Gbps node-node interconnect (RoCE)"; their rows were
written by b2a43a1477a45f40f4086a1c72f851b0ab42d0ac ("Update_pretrain_benchmarks (#543)", Oct 2023;
``git blame``). Columns used: model, SeqLen, # GPUs, MFU, HFU, MicroBatchSize, GradAccum,
Throughput (T/s/GPU), MP Mode, Sharding Strategy (FULL_SHARD in every row used), Activation
Checkpointing. The README's MFU is ``(6 N + 12 n_layers d_model s) x tokens/s / (GPUs x 312e12)``
(N: every parameter, embeddings included; attention FLOPs not halved for causality); HFU is 4/3 of it
with activation checkpointing.

What the runs ran (b2a43a1: ``scripts/train/benchmarking/submit_benchmarks.py``, ``sweep.sh``,
``scripts/train/yamls/pretrain/mpt-{7b,13b,30b,70b}.yaml``, ``llmfoundry/models/mpt/configuration_mpt.py``):
llm-foundry branch v0.3.0 in image mosaicml/pytorch:2.1.0_cu121 (torch 2.1, FSDP1), Composer;
MPT blocks: LayerNorm (``norm_type = low_precision_layernorm``, set by ``mod_parameters``), GELU MLP
with expansion_ratio 4 (no gate), biases (``no_bias`` default false, the yamls leave it), full
multi-head attention (no GQA), ``attn_impl = triton`` (``--attn_impl`` default: llm-foundry's Triton
flash attention), ``alibi`` default **false**, so ``learned_pos_emb`` true: a learned position
table of max_seq_len rows (the NumParams column grows by d_model per token of seq: 7B 6,654,664,704
at 1024 against 6,658,859,008 at 2048), the output layer tied to the token embedding (MPT's
``F.linear(x, wte.weight)``), vocab 50,368. Composer FSDP: FULL_SHARD, one FSDP unit per MPTBlock,
``limit_all_gathers`` true, activation checkpointing (when on) per block, non-reentrant; optimizer
Composer's ``DecoupledAdamW``; ``precision = amp_bf16``; FSDP ``mixed_precision`` from the MP Mode
column: ``DEFAULT`` (Composer: param_dtype bf16, reduce_dtype fp32) or ``PURE`` (param and reduce in
bf16); the sharded flat parameters stay fp32 in both (the model is built in fp32).

meshplan: ``meshplan step`` of each row's TOML (:func:`toml_of`, model by fields, catalog node
``dgx-a100``: 8 A100-SXM 80GB, NVLink3, 8 x 200 Gb/s NICs = 1600 Gb/s a node; the 40GB rows on
``dgx-a100-40gb``, DGX A100 320GB: the same with 8 A100-SXM 40GB). Approximations,
every one printed by the script (:data:`APPROXIMATIONS`). Per row: tokens/s per GPU predicted
and published, error = predicted / published - 1, meshplan's MFU (its own FLOP count: causal half
attention, no embedding GEMM) beside the README's MFU, the step's parts on stage 0, and the
stage-0 kernels by kind (ms per step, every micro-batch): GEMM, attention, memory-bound, the
optimizer step, FSDP2's copies and the rest (exposed fsdp, SM sharing).

**What it gives** (12 rows, 8-128 GPUs): every row but one predicted faster than published, mean
|error| 7.9%, max +13.2% (70B on 128 A100 40GB; +10.8% for 7B on 8 A100 80GB, the largest of the
80 GB rows); 30B on 8 GPUs -1.6%, 13B at seq 4096 +1.2%. The README's MFU of the predicted rates is
53-71% against the published 49-64%. (Before nc52fixC charged the network collectives' NCCL channels
their SMs, 16 rings of the A100's 108 over 8 HDR NICs, the multi-node rows' compute 0.5-4.4% shorter:
mean |error| 8.8%, max +15.7%, 70B on 32 A100 80GB +14.2%.) The checks that hold the rows to the README (NumParams equals
meshplan's parameter count of each model by fields; the MFU formula gives each row's MFU) are in
tests/test_llmfoundry_bench.py.

**Where the error sits** (the step's parts and kernels printed per row). The predicted step is
78-92% GEMM, 3-11% attention, 3-8% memory-bound kernels; exposed FSDP is under 0.6% of the step
on every row, 0.07-0.23% on the multi-node ones (70B at 32 GPUs: a layer's 1.61 GB bf16
all-gather takes 8.4 ms on the dgx-a100 ring curve, busbw 185 GB/s, against about 30 ms of
forward a layer at micro-batch 2), and the optimizer under 1%. Were every other part as
predicted, the published steps imply GEMMs at 214-233 TFLOP/s (69-75% of the 312 peak) on
the rows with the larger errors, where meshplan's catalog rates give 242-252 (from cuBLASLt
fp16 points measured under CUDA 12.5 with random operands, Azure ND A100 v4, ceiling the MAMF
271.2 TFLOP/s; the runs used torch 2.1 with CUDA 12.1). The error does not follow the FSDP
traffic: 7B at 64 and 128 GPUs err alike (+10.2%, +11.5%) though the ring doubles, and 70B errs
less at 64 GPUs with micro-batch 8 (+9.3%) than at 32 with micro-batch 2 (+14.3%). So the gap is carried by the compute (the GEMMs' rate, or a cost per
kernel or per FSDP unit that meshplan does not model: FSDP1's hooks, ``limit_all_gathers``'
rate limiter and Composer's loop), not by FSDP's exposed communication or the optimizer. One
approximation moves the errors by 0.4-7 points (printed as a what-if, not applied): FSDP2's copies,
which FSDP1 does not make on the compute stream (its fp32 gradient cast under DEFAULT runs on its
post-backward stream; removing them raises every error). The 40 GB part's slower HBM, a what-if
while the catalog held only the 80 GB part, is planned now (``dgx-a100-40gb``: 1.36 TB/s measured
streaming against 1.70, the 80 GB part's GEMM and attention rates): it lowers the 40 GB rows'
errors by 1.5-1.9 points (mean |error| of those 5 rows 12.7% -> 11.0%, of all 12 rows 9.5% ->
8.8%), printed row by row against the same rows on ``dgx-a100`` (:func:`on_80gb`).

**Memory.** 30B on 8 A100 80GB at micro-batch 3 with activation checkpointing ran, but meshplan's
timeline puts its peak at 69.9 GiB, over the 67.1 GiB usable with the default 10% reserve
(``training.memory_reserve``): the table marks it ``(over 80 GB)``. The 40 GB rows' peaks, 18-25 GiB,
fit the 40 GB part's 33.5 GiB usable (36 GB: 90% of 40 GB).

Run: PYTHONPATH=. .venv/bin/python benchmarks/llmfoundry_a100.py [--only ID] [--write DIR]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.plan import build_plan, table_key, table_stage
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of

NODE = "dgx-a100"
#: The 40 GB rows' node: DGX A100 320GB, 8 A100-SXM 40GB, the same NVLink3 and NICs as ``NODE``.
NODE_40GB = "dgx-a100-40gb"
SOURCE = ("mosaicml/llm-foundry 8c8dd48 scripts/train/benchmarking/README.md (rows of b2a43a1, Oct 2023); "
          "models: scripts/train/yamls/pretrain/mpt-*.yaml at b2a43a1")

#: MPT by fields (b2a43a1 ``scripts/train/yamls/pretrain/mpt-<size>.yaml``: d_model, n_heads,
#: n_layers, expansion_ratio 4, vocab_size 50368): (layers, d_model, heads).
MPT = {"7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}


@dataclass(frozen=True)
class Row:
    """One published row: ``id``, model size, seq_len, GPUs, micro-batch, grad accumulation,
    activation checkpointing, FSDP MP mode, GPU memory (80 or 40 GB), published tokens/s per GPU,
    published MFU and HFU (%), and the NumParams column (every parameter, the position table of
    seq_len rows included)."""

    id: str
    size: str
    seq_len: int
    gpus: int
    micro_batch: int
    accum: int
    ac: bool
    mp: str
    gb: int
    published_tps: float
    published_mfu: float
    published_hfu: float
    params: int


ROWS = (
    # A100 80GB table (one node each, except 70B)
    Row("7b s2048 8g", "7b", 2048, 8, 6, 2, False, "DEFAULT", 80, 4641, 64.23, 64.23, 6658859008),
    Row("7b s4096 8g AC", "7b", 4096, 8, 16, 2, True, "DEFAULT", 80, 3684, 54.84, 73.12, 6667247616),
    Row("13b s2048 8g", "13b", 2048, 8, 2, 3, False, "DEFAULT", 80, 2262, 59.57, 59.57, 12853954560),
    Row("13b s4096 8g AC", "13b", 4096, 8, 10, 3, True, "DEFAULT", 80, 2060, 57.62, 76.82, 12864440320),
    Row("30b s2048 8g AC", "30b", 2048, 8, 3, 21, True, "DEFAULT", 80, 916, 55.3, 73.74, 29975214080),
    Row("70b s2048 32g AC", "70b", 2048, 32, 2, 16, True, "PURE", 80, 373, 48.56, 64.75, 64862437376),
    Row("70b s2048 64g AC", "70b", 2048, 64, 8, 4, True, "PURE", 80, 410, 53.33, 71.1, 64862437376),
    # A100 40GB table: the multi-node FSDP rows (planned on NODE_40GB)
    Row("7b s2048 64g AC 40GB", "7b", 2048, 64, 18, 1, True, "PURE", 40, 3665, 50.73, 67.64, 6658859008),
    Row("7b s2048 128g AC 40GB", "7b", 2048, 128, 18, 1, True, "PURE", 40, 3623, 50.14, 66.85, 6658859008),
    Row("13b s2048 64g AC 40GB", "13b", 2048, 64, 16, 1, True, "PURE", 40, 1976, 52.04, 69.39, 12853954560),
    Row("30b s2048 128g AC 40GB", "30b", 2048, 128, 6, 1, True, "PURE", 40, 865, 52.25, 69.66, 29975214080),
    Row("70b s2048 128g AC 40GB", "70b", 2048, 128, 4, 1, True, "PURE", 40, 376, 48.91, 65.21, 64862437376),
)

APPROXIMATIONS = (
    "FSDP1 (torch 2.1, FlatParameter per MPTBlock) planned as FSDP2 (meshplan's only torch FSDP): the same "
    "per-block all-gather / reduce-scatter bytes, but FSDP2's copy-out after each all-gather and copy-in before "
    "each reduce-scatter are charged on the compute stream (FSDP1 gathers into the flat parameter in place and, "
    "under DEFAULT, casts the flat gradient to fp32 on its post-backward stream, torch 2.1 _post_backward_hook's "
    "flat_param.grad.to(handle._reduce_dtype), not on the compute stream: the 'FSDP2 copies' column is what this "
    "adds to the compute stream)",
    "attention: llm-foundry's Triton flash attention (attn_impl triton) timed with the catalog's "
    "flash-attention rates for the A100 (no measurement of that Triton kernel in the catalog)",
    "optimizer: Composer's DecoupledAdamW (a per-parameter loop of eager ops) as torch's foreach AdamW "
    "(training.optimizer_impl = \"foreach\", eight passes over the fp32 state)",
    "LayerNorm: low_precision_layernorm (bf16 LayerNorm under autocast) as meshplan's fused layernorm",
    "network: RoCE, 1600 Gb/s a node (README) planned on dgx-a100's 8 x 200 Gb/s HDR InfiniBand curves",
    "40GB rows: planned on dgx-a100-40gb (A100-SXM 40GB: 1.555 TB/s datasheet, 1.36 TB/s measured streaming, "
    "peak judged against 40 GB); its GEMM and attention rates and its nccl curves are the 80 GB part's and "
    "dgx-a100's (not measured on the 40 GB part: the catalog entries say so)",
    "MP mode PURE (the 70B rows of the 80GB table, every 40GB row): their Precision column says 'bf16' "
    "(Composer has no "
    "such precision: read as amp_bf16); reduce in bf16 (training.reduce_dtype = \"bf16\")",
    "mixed precision: fp32 sharded parameters (training.param_dtype = \"fp32\", master_weights), gathered "
    "and computed in bf16, gradients kept in fp32",
    "Composer's microbatching, data loading, logging and the eval loader are not modelled",
)


def node_of(r: Row) -> str:
    """The catalog node of row ``r``: :data:`NODE` for the 80 GB table, :data:`NODE_40GB` for the 40 GB one."""
    return NODE if r.gb == 80 else NODE_40GB


def toml_of(r: Row, node: Optional[str] = None) -> str:
    """The meshplan TOML of row ``r``: MPT by fields, FULL_SHARD over all GPUs
    (``dp_shard`` = GPUs), global batch = GPUs x micro-batch x accumulation, on ``node``
    (default :func:`node_of`)."""
    layers, d, heads = MPT[r.size]
    reduce = "fp32" if r.mp == "DEFAULT" else "bf16"
    return "\n".join([
        "[model]", f'name = "mpt-{r.size}"', f"layers = {layers}", f"hidden = {d}", f"ffn = {4 * d}",
        "gated_mlp = false", f"q_heads = {heads}", "vocab = 50368", "tied_embeddings = true",
        'norm = "layernorm"', "linear_bias = true", 'position_embedding = "learned"', f"max_position = {r.seq_len}",
        f'source = "{SOURCE}"', "",
        "[cluster]", f'system = "{node or node_of(r)}"', f"nodes = {r.gpus // 8}", "",
        "[training]", f"global_batch = {r.gpus * r.micro_batch * r.accum}", f"seq_len = {r.seq_len}",
        f"micro_batch = {r.micro_batch}", 'sharding = "zero3"', 'param_dtype = "fp32"', 'compute_dtype = "bf16"',
        'grad_dtype = "fp32"', f'reduce_dtype = "{reduce}"', f'recompute = "{"full" if r.ac else "none"}"',
        "flash_attention = true", 'optimizer_impl = "foreach"', 'framework = "torch"', "",
        "[mesh]", 'names = ["dp_shard"]', f"shape = [{r.gpus}]", ""])


@dataclass
class Result:
    row: Row
    tps: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    step_ms: float = 0.0
    parts_ms: dict = field(default_factory=dict)
    kinds_ms: dict = field(default_factory=dict)
    gemm_flops: float = 0.0
    fits: Optional[bool] = None
    peak_gib: float = 0.0
    error: str = ""

    @property
    def err(self) -> float:
        """predicted / published tokens/s per GPU - 1."""
        return self.tps / self.row.published_tps - 1


def kinds_ms(plan, st) -> tuple[dict[str, float], float]:
    """Stage 0's step by kind, ms per step, and its GEMMs' executed FLOP per step: its layer,
    embedding and head ops (every micro-batch, recompute included) as GEMM, attention and
    memory-bound kernels, the optimizer step, FSDP2's copies (the collective table's ``copy_s``),
    the exposed communication (the parts line's) and the rest (SM sharing with NCCL's kernels:
    :func:`meshplan.schedule.comm_times.nccl_sm_share`)."""
    out = {"GEMM": 0.0, "attention": 0.0, "memory-bound": 0.0}
    gemm_flops = 0.0
    for ch in chunk_costs(plan, workload_of(plan))[0]:
        for cost in [*ch.layers, *(x for x in (ch.embed, ch.head) if x is not None)]:
            for o in cost.ops:
                k = "GEMM" if o.kind == "gemm" else "attention" if o.kind == "attention" else "memory-bound"
                out[k] += o.seconds * plan.micro_batches
                gemm_flops += o.hardware_flops * plan.micro_batches if k == "GEMM" else 0.0
    out["optimizer"] = sum(e.end_s - e.start_s for e in st.post_events if e.stage == 0 and e.name == "optimizer step")
    out["FSDP2 copies"] = sum(r.copy_s * r.per_step for r in plan.collectives[table_key(table_stage(0, 1))])
    out["exposed comm"] = sum(v for k, v in st.parts_s().items() if k.startswith("exposed"))
    rest = st.step_s - sum(out.values())
    out["SM sharing, other"] = rest if abs(rest) > 1e-6 else 0.0  # no float noise printed as -0
    return {k: v * 1e3 for k, v in out.items()}, gemm_flops


def predict(r: Row, folder: Path, node: Optional[str] = None) -> Result:
    """Write the row's TOML in ``folder``, plan it on ``node`` (default :func:`node_of`) and run
    meshplan's step model on it."""
    path = folder / (r.id.replace(" ", "_") + (f"_{node}" if node else "") + ".toml")
    path.write_text(toml_of(r, node))
    try:
        plan = build_plan(load_config(path))
        st = step_time(plan)
    except ConfigError as e:
        return Result(r, error=str(e))
    tl = plan.timeline  # the peak against the node's own GPU's usable bytes
    kinds, gemm_flops = kinds_ms(plan, st)
    return Result(r, st.tokens_per_s / st.world, st.mfu, st.hfu, st.step_s * 1e3,
                  {k: v * 1e3 for k, v in st.parts_s().items()}, kinds, gemm_flops,
                  fits=tl.peak.total_bytes <= tl.usable_bytes, peak_gib=tl.peak.total_bytes / 2**30)


def table(results: list[Result]) -> list[str]:
    """Markdown rows: published vs predicted tokens/s per GPU, error, the README's MFU of the
    published and of the predicted rate (its formula is linear in tokens/s: published MFU x
    predicted / published), meshplan's own MFU and HFU (per-op FLOP, causal half attention: about
    4% fewer FLOP a token than the README's at 7B, seq 2048), the step, its parts and its kernels
    by kind."""
    out = ["| row | published T/s/GPU | predicted | error | MFU README formula pub / pred | meshplan MFU / HFU | "
           "step (ms) | step parts (ms) | stage 0 by kind (ms) | peak GiB |",
           "|---|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for x in results:
        r = x.row
        if x.error:
            out.append(f"| {r.id} | {r.published_tps:,} | - | - | - | - | - | {x.error} | - | - |")
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in x.parts_ms.items())
        kinds = ", ".join(f"{k} {v:.0f}" for k, v in x.kinds_ms.items())
        out.append(f"| {r.id} | {r.published_tps:,} | {x.tps:,.0f} | {x.err:+.1%} | {r.published_mfu:.1f}% / "
                   f"{r.published_mfu * (1 + x.err):.1f}% | {x.mfu:.1%} / {x.hfu:.1%} | {x.step_ms:.0f} | {parts} | {kinds} | "
                   f"{x.peak_gib:.1f}{'' if x.fits else f' (over {x.row.gb} GB)'} |")
    return out


def shares(results: list[Result]) -> list[str]:
    """Per row, the published step (global batch tokens / GPUs / published tokens/s per GPU)
    against the predicted one, each kind's share of the predicted step, and the GEMM rate
    (executed GEMM FLOP / GEMM time) predicted and implied: what the GEMMs would have to run at
    for the published step were every other part as predicted."""
    out = []
    for x in results:
        if x.error:
            continue
        r = x.row
        pub = r.micro_batch * r.accum * r.seq_len / r.published_tps * 1e3
        kinds = ", ".join(f"{k} {v / x.step_ms:.0%}" for k, v in x.kinds_ms.items())
        gemm_ms = x.kinds_ms["GEMM"]
        implied = x.gemm_flops / ((pub - x.step_ms + gemm_ms) / 1e3) / 1e12
        out.append(f"{r.id}: published step {pub:.0f} ms, predicted {x.step_ms:.0f} ms (gap {pub - x.step_ms:+.0f} "
                   f"ms, {pub / x.step_ms - 1:+.1%}); predicted step = {kinds}; GEMMs {x.gemm_flops / gemm_ms / 1e9:.0f} "
                   f"TFLOP/s predicted, {implied:.0f} implied by the published step")
    return out


def what_ifs(results: list[Result]) -> list[str]:
    """A printed what-if per row, not applied to the table: the step without FSDP2's copies
    (FSDP1's flat parameters need none)."""
    out = []
    for x in results:
        if x.error:
            continue
        r, k = x.row, x.kinds_ms
        pub = r.micro_batch * r.accum * r.seq_len / r.published_tps * 1e3
        out.append(f"{r.id}: without FSDP2 copies error {pub / (x.step_ms - k['FSDP2 copies']) - 1:+.1%}")
    return out


def mean_abs_error(results: list[Result]) -> float:
    """Mean |predicted / published - 1| over ``results``."""
    return sum(abs(x.err) for x in results) / len(results)


def on_80gb(results: list[Result], before: list[Result]) -> list[str]:
    """The 40 GB rows on :data:`NODE_40GB` (the table) against the same rows planned on the 80 GB
    part (:data:`NODE`, the approximation before the catalog held the 40 GB part): per row the
    error and step on each, then the mean |error| of those rows and of every row, both ways. A
    diagnostic: whatever the direction, nothing is tuned to it."""
    now = {x.row.id: x for x in results if not x.error}
    pairs = [(b, now[b.row.id]) for b in before if not b.error and b.row.id in now]
    if not pairs:
        return []
    out = [f"40GB rows on {NODE_40GB} against {NODE} (the 80 GB part, as planned before):"]
    for b, a in pairs:
        out.append(f"{a.row.id}: error {b.err:+.1%} -> {a.err:+.1%} (step {b.step_ms:.0f} -> {a.step_ms:.0f} ms, "
                   f"memory-bound {b.kinds_ms['memory-bound']:.0f} -> {a.kinds_ms['memory-bound']:.0f} ms, "
                   f"peak {a.peak_gib:.1f} GiB {'fits' if a.fits else 'over'} 40 GB)")
    out.append(f"mean |error| of these {len(pairs)} rows {mean_abs_error([b for b, _ in pairs]):.1%} -> "
               f"{mean_abs_error([a for _, a in pairs]):.1%}")
    was = {b.row.id: b for b, _ in pairs}
    every = [x for x in results if not x.error]
    out.append(f"mean |error| of all {len(every)} rows {mean_abs_error([was.get(x.row.id, x) for x in every]):.1%} -> "
               f"{mean_abs_error(every):.1%}")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--write", help="keep the rows' meshplan TOMLs in this folder")
    ap.add_argument("--only", help="rows whose id starts with this")
    a = ap.parse_args(argv)
    rows = [r for r in ROWS if not a.only or r.id.startswith(a.only)]
    if not rows:
        ap.error(f"--only: no row id starts with {a.only!r}; ids: {', '.join(r.id for r in ROWS)}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(a.write or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = [predict(r, folder) for r in rows]
        before = [predict(r, folder, NODE) for r in rows if node_of(r) != NODE]
    print(f"LLM Foundry MPT A100 FSDP runs planned on catalog {NODE} (80GB rows) and {NODE_40GB} (40GB rows): "
          "not the dev set")
    print(f"source: {SOURCE}")
    print("\n".join(table(results)))
    errs = [abs(x.err) for x in results if not x.error]
    if errs:
        worst = max((x for x in results if not x.error), key=lambda x: abs(x.err))
        print(f"mean |error| {sum(errs) / len(errs):.1%}, max {abs(worst.err):.1%} ({worst.row.id}) "
              f"over {len(errs)} row{'s' if len(errs) > 1 else ''}")
    print("\n".join(shares(results)))
    print("\n".join(on_80gb(results, before)))
    print("what-ifs (not applied above):")
    print("\n".join(what_ifs(results)))
    print("approximations (what they ran that meshplan's knobs do not express exactly):")
    print("\n".join(f"- {s}" for s in APPROXIMATIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
