"""ZeRO-3 without model parallelism at 384, 768 and 1,536 A100 (issue 11 item 3): published
against meshplan's step time and TFLOP/s per GPU.

Published: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21, arXiv 2104.04473), section 5.2, Table 2, "ZeRO-3 without Model
Parallelism", 174.6B GPT-3 (96 layers, h 12,288, 96 heads, seq 2,048, vocab 51,200), global
batch 1,536: 384 / 768 / 1,536 GPUs, micro-batch 4 / 2 / 1, 144 / 88 / 44 achieved teraFLOP/s
per GPU (training time for 300B tokens 90 / 74 / 74 days). Read in a Markdown transcription of the
paper (its section 5.2, Table 2 whole and the appendix's FLOP count; found with the search tool's
find_string "integrated ZeRO into our codebase", file id 63285939983) and checked against two other
copies of Table 2; the days column agrees with the step below (300e9 / (1536 x 2048) steps).
Section 5.2 says only "We integrated ZeRO into our codebase using the DeepSpeed Python library":
no DeepSpeed version or configuration, so the configs take DeepSpeed's 2021 defaults.

The published step follows from the paper's FLOP count per iteration (eq. 3, activation
recomputation included): F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h)); step = F / (GPUs x
achieved FLOP/s). meshplan's TFLOP/s per GPU uses the same F over its predicted step.

meshplan: ``meshplan step`` of benchmarks/zero3/*.toml (DeepSpeed ZeRO-3 of 2021,
``training.zero3_engine = "deepspeed-2021"``, :mod:`meshplan.comm.deepspeed`) and, for contrast,
the same configs under FSDP2's per-layer gathers (``zero3_engine = "fsdp2"``, the model before
this engine). Nothing is fitted to these numbers.

What the model gives (deepspeed-2021): 60.5 / 41.2 / 43.6 s against the published 81.6 / 66.7 /
66.7 s (-26%, -38%, -35%; 59.0 / 39.5 / 43.5 s before nc52fixC charged the network collectives'
NCCL channels their SMs, 16 rings of the A100's 108 over its 8 HDR NICs); FSDP2's per-layer gathers
give 53.2 / 27.5 / 14.6 s (52.1 / 26.4 / 13.3 s before; their
reduce-scatters overlapped and no copies on the compute stream, as framework megatron's Megatron
FSDP runs them: its parameters are views of the all-gather's bucket and its weight-gradient GEMMs
write into the reduce-scatter's, :mod:`meshplan.comm.fsdp2`; with FSDP2's copy-out and copy-in,
14.9 ms per layer and micro-batch, 53.6 / 27.8 / 14.8 s before nc52fixC, not re-run). The step does not
halve from 768 to 1,536 GPUs: every micro-batch (one per step in all three runs: 1536 / (384 x 4))
issues the same 1,061 all-gathers (96 layers x (4 + 7) + the root's 5), each paying NCCL's ring
latency over the whole group (1,535 steps at 1,536 ranks: 4.15 ms) and the host's n partition views,
n ``get_rank`` calls and n list copies (11.7 ms at 1,536 ranks), and every step ends with the persistent parameters'
gather, whose 770 x n copies the host issues one by one (3.2 / 6.3 / 12.7 s), while the bytes each
GPU sends stay 1.63 TB per step.

What DeepSpeed v0.3.13 (tag 12a53b4, the version of March 2021) does that the model now takes
(:mod:`meshplan.comm.deepspeed`; before: 61.3 / 42.5 / 43.8 s):

- the bucket all-reduces run on the reduction stream where the hooks issue them
  (``overlap_comm``, stage 3's default true), beside the GEMMs of the module whose gradient
  flushed the bucket, the host waiting for the bucket before at each flush and for everything
  at each module's fetch (``deepspeed_layer.ds_backward_layer``; they were waited for at once
  after each layer): 63.7 / 43.8 / 43.2 -> 58.7 / 38.8 / 42.1 s. At 384 and 768 GPUs every
  bucket hides behind its module's GEMMs; at 1,536 w_up's stays 14.7 ms exposed per layer;
- gradients: ``contiguous_gradients`` is false by default for stage 3 until v0.4.3 (c9fee8214,
  2021-07-01), so ``reduce_ipg_grads`` all-reduces flattened 5e8-element buckets
  (``buffered_reduce_fallback``), 5 per layer, not one list-based reduce-scatter per parameter:
  no n views and n copies per call, twice the bytes (-1.4 / -5.6 / -13.9 s). The configs leave
  ``training.contiguous_gradients`` at that default; set true (v0.4.3-v0.5.4's default, the
  per-parameter reduce-scatters) the steps are 61.8 / 44.9 / 55.9 s;
- ``_post_step`` gathers the persistent parameters (norms, biases; partitioned at the backward's
  end) every step, synchronously, with a Python copy per parameter and rank
  (``_allgather_params``): +3.2 / +6.3 / +12.7 s;
- ``_allgather_param`` zero-fills each gathered buffer and calls ``torch.cuda.synchronize()``
  before issuing the all-gather: +0.55 s at every size;
- ``_allgather_param``'s loop over the n partitions also calls ``torch.distributed.get_rank(group)``
  in every iteration (v0.3.13 to v0.5.4), 0.45 of a ``narrow``'s host time
  (``benchmarks/get_rank_cost.py``): 58.7 / 38.8 / 42.1 -> 59.0 / 39.5 / 43.5 s.

What is still missing: the gap to the published step is 22.6 / 27.2 / 23.2 s, nearly flat in the
GPU count while the compute per GPU halves, so it behaves like a term per byte or per call (both
constant per GPU), not like compute or a latency that grows with the group. Closing it with
bandwidth alone would take the 1.63 TB at about 40-46 GB/s (over the model's 12.3 / 13.4 / 15.6 s
of collectives plus the gap, were they all exposed), against the 177 GB/s
nccl-tests measured for an all-gather over 2 x 8 A100 [S18] (the curve the model uses); meshplan
has no measured all-gather or all-reduce of DGX A100 at 48-192 nodes, nor of NCCL 2.8-2.9 (2021),
to say whether the large-scale rings ran that slowly (the paper's section 5.9 reports in-run
"effective bisection bandwidths" on 3,072 GPUs, not a microbenchmark: not used). Not modelled
either, each with its sign: DeepSpeed synchronizes the device at every module's fetch and
prefetches one parameter ahead, so a module's time is max(host issue + its compute, the next
gather), summed over the modules, where the timeline overlaps a layer's gathers with the previous
layer's whole compute; but with the host's issue time serial before each module's compute in both,
host + compute exceeds the next gather in every module at all three sizes (at 1,536 GPUs, forward:
22.5 / 14.3 / 21 / 20.8 ms against gathers of 6.3 / 12.8 / 12.8 / 10.6 ms; estimated from the
plan's block costs split by FLOPs), so the per-layer sum is the same to within 1 ms; but the
layer's gathers, held as one unit prefetched during the layer before, share the one NCCL stream
with the bucket reductions, and at 1,536 GPUs (69 ms of gathers a layer) w_down's bucket, the
first flushed, waits behind them: 26.5 ms per layer where by the hook order it would hide behind
w_down's 20 ms of GEMMs (model long, 2.5 s at 1,536; none at 384 and 768); the
caching allocator's frees and mallocs of a full parameter buffer per gather; the modules' Python
hooks (pre/post-forward and backward functions on every module's inputs and outputs). Nothing here
is fitted: the gap is reported, not absorbed.

Checked against v0.3.13 and NCCL v2.9.9-1 and not taken (issue 11, December 2026):

- DeepSpeed's defaults (``constants.py``: overlap_comm true and contiguous_gradients false for
  stage 3, buckets 5e8, prefetch 5e7, max live 1e9, reuse 1e9, persistence 1e5) are the model's;
  the prefetch's ``max_live_parameters`` test comes before it adds the prefetched weight, so at h
  12,288 it never stops the one-weight-ahead prefetch; ``allreduce_no_retain`` never resets its
  count, but its limit is the bucket's own elements: one all-reduce per bucket, as modelled;
- per step the optimizer's ~2 x 1,160 per-parameter ``.item()`` syncs (``has_overflow_partitioned_
  grads_serial``, ``get_grad_norm_direct``) and ~2,000 releases' ``torch.ones(1).half().to(device)``
  (a synchronous copy that waits for the module's compute, as the next fetch's synchronize does
  anyway): under 0.2 s together; ``see_memory_usage`` returns at once unless forced;
- NCCL of 2021's own cost model (``tuning.cc`` v2.9.9-1) is slower than meshplan's ring and tree
  at 192 nodes: LL128's per-step latency with its 0.92 bandwidth factor instead of LL's latency
  with the measured (Simple) bandwidth, and the tree's bandwidth capped at ``perChMaxTreeBws``
  (16 GB/s a channel on Ampere beyond 2 nodes, against a ring channel of 24 GB/s, assumed): as a
  local experiment 58.7 / 39.6 / 46.3 s before the get_rank term; not taken, as the protocol
  NCCL ran and the topology search's channel speeds are not known here;
- ZeRO-3's prefetch off altogether (DeepSpeed PR #1170, June 2021, not merged, describes an
  off-by-one in the hook registration's tracing; PR #873 says the prefetcher was "essentially
  disabled" when the module order changed after the first iteration; #1453, January 2022,
  rewrote it; not reproduced here for Megatron's GPT): ``meshplan step --no-prefetch`` gives
  66.1 / 47.7 / 50.8 s, still 15-19 s short;
- at 384 GPUs the 12.3 s of collectives hide behind 52 s of GPU compute; to explain the gap
  they would have to run at about 1/6 of the 2 x 8 nccl-tests rate. The published 66.7 s at 768
  and 1,536 GPUs is 1.63 TB per GPU at 24.4 GB/s, one HDR NIC's 25 GB/s to within 3%, with the
  compute hidden under it (81.6 s at 384: the same plus 15 s); that is a reading of end-to-end
  times, not a measurement, and no mechanism found sends each GPU's share of the rings through
  its own NIC (NCCL's rings cross each node boundary once per channel, over the node's 8 NICs).

Run: PYTHONPATH=. .venv/bin/python benchmarks/zero3_sc21.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan, table_key
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.steptime import step_time

HERE = Path(__file__).parent / "zero3"


@dataclass(frozen=True)
class Run:
    """One Table 2 row: GPUs, micro-batch, achieved TFLOP/s per GPU, config file."""

    gpus: int
    micro_batch: int
    tflops: float
    config: str


#: Narayanan et al. SC'21 Table 2, ZeRO-3 without model parallelism, 174.6B parameters.
RUNS = (
    Run(384, 4, 144.0, "gpt3-175b_384xa100_zero3-deepspeed_mb4.toml"),
    Run(768, 2, 88.0, "gpt3-175b_768xa100_zero3-deepspeed_mb2.toml"),
    Run(1536, 1, 44.0, "gpt3-175b_1536xa100_zero3-deepspeed_mb1.toml"),
)


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per iteration, Narayanan et al. eq. 3 (with activation recomputation).

    >>> round(paper_flops(1536, 2048, 96, 12288, 51200) / 1e18, 3)
    4.511
    """
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def predict(run: Run, engine: str) -> dict:
    """meshplan's step of ``run`` under ``engine``, with the host time of DeepSpeed's
    list-based calls (per step) and the exposed communication."""
    cfg = load_config(HERE / run.config)
    # FSDP2's contrast keeps fp32 gradients (the model before this engine); DeepSpeed its fp16 partition
    grads = {"grad_dtype": "fp32"} if engine == "fsdp2" else {}
    cfg = replace(cfg, training=cfg.training.model_copy(update={"zero3_engine": engine, **grads}))
    plan = build_plan(cfg)
    st = step_time(plan)
    layers = sum(map(len, plan.stages[0]))
    comm = CommTimes.from_rows(plan.collectives[table_key(0)], layers)
    m = cfg.model
    flops = paper_flops(cfg.training.global_batch, cfg.training.seq_len, m.layers, m.hidden, m.vocab)
    rows = plan.collectives[table_key(0)]
    return {"step_s": st.step_s, "tflops": flops / (run.gpus * st.step_s) / 1e12,
            "host_s": sum(v * (layers if g == "layer" else 1) for (g, _), v in comm.host.items())
            + sum(r.host_s * r.per_step for r in plan.collectives[table_key(0)] if r.phase == "step"),
            "exposed_s": sum(st.exposed_s.values()), "flops": flops,
            "sent_gb": sum(r.sent_bytes_per_step for r in rows) / 1e9, "calls": sum(r.per_step for r in rows)}


def main() -> None:
    print("ZeRO-3 without model parallelism, GPT-3 175B, global batch 1536 (Narayanan et al. SC'21 Table 2)")
    print(f"{'GPUs':>5} {'mb':>3} | {'published':>9} {'TFLOP/s':>7} | {'deepspeed-2021':>14} {'TFLOP/s':>7} "
          f"{'error':>7} {'host':>6} {'exposed':>7} {'calls':>5} {'sent':>7} | {'fsdp2':>7} {'TFLOP/s':>7} {'error':>7}")
    for run in RUNS:
        ds, fs = predict(run, "deepspeed-2021"), predict(run, "fsdp2")
        pub = ds["flops"] / (run.gpus * run.tflops * 1e12)
        print(f"{run.gpus:>5} {run.micro_batch:>3} | {pub:>8.1f}s {run.tflops:>7.0f} | {ds['step_s']:>13.1f}s "
              f"{ds['tflops']:>7.1f} {ds['step_s'] / pub - 1:>+7.1%} {ds['host_s']:>5.1f}s {ds['exposed_s']:>6.1f}s "
              f"{ds['calls']:>5} {ds['sent_gb']:>5.0f}GB | "
              f"{fs['step_s']:>6.1f}s {fs['tflops']:>7.1f} {fs['step_s'] / pub - 1:>+7.1%}")
    print("published step = eq. 3 FLOPs / (GPUs x achieved TFLOP/s); host: DeepSpeed's host time per step (partition "
          "views, list copies issued and zero fills waited for, on the compute stream; the persistent parameters' "
          "copies in the optimizer step); exposed: communication the compute waited on (the persistent gather "
          "included); calls and sent: DeepSpeed's collectives per step and the bytes one GPU sends in them")


if __name__ == "__main__":
    main()
