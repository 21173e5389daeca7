"""Fidelity of the step-time model on the development set (issue 11 item 6;
../shared/reference/published-runs-dev.md): Korthikanti et al. 2022 (arXiv 2205.05198),
Tables 3-5, Megatron-LM on DGX A100.

D1-D4: per run, the published step time, Calculon's published prediction (Isaev et al.,
SC'23; ``calculon llm-validation`` at calculon-ai/calculon caa4b11), meshplan's prediction
(``meshplan step`` of the config in benchmarks/fidelity/), both errors, mean and max |error|.
D5: the 22B per-layer forward and backward times of five experiments (tp 8, micro-batch 4).
Nothing is fitted to these numbers: every constant comes from the catalog (kernels.toml,
gpus.toml, nodes.toml) with its source; the sources each prediction used are printed.

Run: PYTHONPATH=. .venv/bin/python benchmarks/fidelity.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.linkfit import fit_alpha_beta
from meshplan.comm.nccl_tests import BenchRow

from meshplan.compute.measured import kernel_data
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import layer_unit_times, step_time

HERE = Path(__file__).parent / "fidelity"


@dataclass(frozen=True)
class Run:
    """One published run: id, config file, published step (s), Calculon's prediction (s)."""

    run: str
    config: str
    published_s: float
    calculon_s: float


#: published-runs-dev.md, D1-D4 (Korthikanti Table 5) and Calculon's predictions.
RUNS = (
    Run("D1 22B full recompute", "megatron-22b_8xa100_tp8_full-recompute.toml", 1.42, 1.40),
    Run("D2 22B SP + selective", "megatron-22b_8xa100_tp8_sp-selective.toml", 1.10, 1.14),
    Run("D3 175B full recompute", "megatron-175b_64xa100_tp8-pp8-vpp3_full-recompute.toml", 18.13, 18.03),
    Run("D4 175B SP + selective", "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml", 13.75, 13.64),
)

#: D5 (Korthikanti Table 4): (recompute, sequence parallel) -> (forward ms, backward ms).
LAYER_22B = {
    ("none", False): (7.7, 11.9), ("none", True): (7.2, 11.8), ("full", False): (7.7, 19.5),
    ("selective", False): (7.7, 13.2), ("selective", True): (7.2, 13.1),
}


#: Diagnostic only (not the model's default): 8x A100 NVLink all-reduce busbw measured by
#: nccl-tests (public-microbenchmarks.md 4a, S15: stas00/ml-engineering network README), size
#: (B) -> busbw (GB/s), 4 MiB..1 GiB: the range around these runs' TP messages (50-100 MB).
S15_ALL_REDUCE = {4 << 20: 72.3, 8 << 20: 109.9, 32 << 20: 138.5, 128 << 20: 176.9, 512 << 20: 222.7,
                  1 << 30: 229.0}


def s15_calibration() -> dict:
    """An nvlink calibration fitted (alpha-beta, :func:`meshplan.comm.linkfit.fit_alpha_beta`)
    to :data:`S15_ALL_REDUCE`: what the step would be with collectives at measured busbw."""
    rows = [BenchRow("all-reduce", 8, size, size * 1.75 / (bw * 1e9), 0.0, bw * 1e9)
            for size, bw in S15_ALL_REDUCE.items()]
    fit = fit_alpha_beta(rows, "nvlink")
    return {"nvlink": CalibratedLink(latency_us=fit.latency_s * 1e6, bandwidth_gb_per_s=fit.bandwidth_bytes_per_s / 1e9,
                                     op="all-reduce", ranks=8, source="S15 A100 nccl-tests all_reduce 4 MiB-1 GiB")}


def plan_of(config: str, calibration: Optional[dict] = None):
    """The plan of a development-set config (its cluster recalibrated when ``calibration``)."""
    cfg = load_config(HERE / config)
    if calibration:
        cfg = replace(cfg, cluster=apply_calibration(cfg.cluster, calibration))
    return build_plan(cfg)


def predict(run: Run) -> dict:
    """meshplan's step time for ``run`` and both errors (relative, signed)."""
    st = step_time(plan_of(run.config))
    return {"run": run.run, "published_s": run.published_s, "calculon_s": run.calculon_s, "meshplan_s": st.step_s,
            "meshplan_err": st.step_s / run.published_s - 1, "calculon_err": run.calculon_s / run.published_s - 1}


def predict_s15(run: Run) -> float:
    """Diagnostic: meshplan's step for ``run`` with NVLink collectives at S15's measured busbw."""
    return step_time(plan_of(run.config, s15_calibration())).step_s


def predict_layer(recompute: str, sp: bool, calibration: Optional[dict] = None) -> tuple[float, float]:
    """(forward ms, backward ms) of one 22B layer, tp 8, micro-batch 4, with its collectives."""
    cfg = load_config(HERE / "megatron-22b_8xa100_tp8_sp-selective.toml")
    cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": recompute}),
                  mesh=cfg.mesh.model_copy(update={"sequence_parallel": sp}))
    if calibration:
        cfg = replace(cfg, cluster=apply_calibration(cfg.cluster, calibration))
    f, b = layer_unit_times(build_plan(cfg))
    return f * 1e3, b * 1e3


def sources(gpu: str) -> list[str]:
    """What the compute model of ``gpu`` reads, by term."""
    d = kernel_data(gpu)
    if d is None:
        return [f"{gpu}: no catalog measurements (shape model, datasheet bandwidth)"]
    return [f"GEMM: catalog kernels.toml {gpu} points ({', '.join(sorted(d.gemm))}), Shepard interpolation in "
            f"log2 (M, N, K) (below the points in M, N or K: the edge's rate x the shape model's tile/wave "
            f"efficiency ratio, capped at 1), memory roofline at Triad",
            "attention: non-flash (Megatron 2022): batched QK^T / PV GEMMs from the same points (A100: the 'D S7a' "
            "points, S7a's PyTorch standard attention less its softmax and copies, one rate for all six products; dV "
            "looked up as dK, (s_kv, d, s_q); another batch count than S7a's read on the points' plane, M 262,144, x the shape "
            "model's waves); below head dim 128 on A100 (22B: d 96) the measured head-dim ratio "
            "of AC24 Fig. 7 (QK^T x0.886 at K 96, PV x0.775 at N 96) in place of the shape model's; fused softmax and dropout over the "
            "scores as memory-bound kernels",
            f"bandwidth: Triad {d.stream_bytes_per_s / 1e12:.2f} TB/s (BabelStream, S3); norms "
            f"{d.norm_fixed_s * 1e6:.1f} us + bytes / {d.norm_bytes_per_s / 1e12:.2f} TB/s, least squares over "
            f"the Liger RMSNorm times (S11)",
            f"overheads: kernel issue floor {d.kernel_issue_s * 1e6:.1f} us (S21 + S22); per micro-batch the "
            f"batch's copy to the GPU over the node's PCIe link and, at tp > 1, get_batch's 2 tp broadcasts timed on "
            f"the tp path (compute/batch_input.py); optimizer from its bytes at Triad",
            "collectives: the plan's collective table (comm model of nodes.toml / networks.toml, not this benchmark's); "
            "pp send/recv across nodes on the single-NIC pair curve (S18 2 x 1 A100 HDR alltoall 15.48 GB/s busbw, "
            "catalog nccl.toml ib-hdr-200-1nic-pair)",
            "Megatron-LM 2022 (framework = megatron, megatron_runtime = 2022; NVIDIA/Megatron-LM 2755bcb): blocking pp sends (training."
            "pp_p2p_overlap = false: overlap_p2p_comm came in f9283c5, 2023) "
            "(p2p_communication._communicate: batch_isend_irecv, wait, cuda.synchronize: both stages of a transfer "
            "rendezvous, each call ends at max(own post, peers' posts) + its transfers: sends and receives "
            "beside each other (full duplex), two sends (or receives) through the rank's one NIC sharing it, "
            "their fixed part once (one NCCL group; pipeline/rendezvous.link_load); interleaved steady-state "
            "forward output sent with the next backward's, schedules.py), scatter/gather without SP; the "
            "embedding all-reduced under SP (mpu/layers.py VocabParallelEmbedding); get_batch in every chunk's "
            "forward on every stage (rank 0's copy of the batch, 2 tp broadcasts and their sizes copied to the GPU "
            "and back, causal mask rebuilt: "
            "ones/tril/< 0.5) and the timers' "
            "cuda.synchronize (4 per forward, 2 per backward, one issue floor each); fused QKV "
            "GEMM (transformer.py query_key_value); wgrad accumulated into fp32 main_grad "
            "(layers.py wgrad_gemm_accum_fp32: C read + written in fp32, roofline at Triad); its own kernels "
            "(compute/megatron.py: layer norm backward as apex's persistent FastLayerNormFN at h 6144 / 12288 (3 passes, partial weight/bias gradients and their finalize kernel), causal softmax on the lower triangle, fp32 cross entropy pass by pass, "
            "context permute copy, baddbmm alpha on dQ/dK, QKV split-backward cat, main_grad hooks, embedding "
            "mask/transpose/split/dropout, the empty(1) + 1 delay kernel after each async tp collective launch in "
            "a column-parallel backward, the loss's 22 + 12 tiny kernels per micro-batch); grad buffer /= dp in place before the optimizer (distributed.py "
            "allreduce_gradients): 58 B per parameter; per step (optimizer.py): the bf16 master -> model copy one "
            "copy_ per parameter (no multi-tensor copy for bf16), under SP the sequence_parallel gradients "
            "flattened and copied back one kernel each, the 11 step timers' syncs and the grad norm's .item(); "
            "per pipeline p2p call (schedules.py: one per warm-up forward and steady pair, one per cool-down "
            "backward) its timer's 2 syncs and _communicate's own, one issue floor each (compute/megatron_cost.py "
            "p2p_calls)",
            "GEMM interpolation nodes: measurements of their own shape; the MAMF maximum (S1) is the ceiling only"]


def main() -> None:
    print(f"{'run':26s} {'published':>9s} {'Calculon':>9s} {'meshplan':>9s} {'meshplan err':>12s} {'Calculon err':>12s}"
          f" {'(S15 comm)':>10s} {'err':>7s}")
    rows = [predict(r) for r in RUNS]
    diag = [predict_s15(r) for r in RUNS]
    for r, d in zip(rows, diag):
        print(f"{r['run']:26s} {r['published_s']:9.2f} {r['calculon_s']:9.2f} {r['meshplan_s']:9.3f} "
              f"{r['meshplan_err']:+12.1%} {r['calculon_err']:+12.1%} {d:10.3f} {d / r['published_s'] - 1:+7.1%}")
    for key in ("meshplan_err", "calculon_err"):
        errs = [abs(r[key]) for r in rows]
        print(f"{key.split('_')[0]:9s} mean |error| {sum(errs) / len(errs):.1%}, max {max(errs):.1%}")
    errs = [abs(d / r["published_s"] - 1) for r, d in zip(rows, diag)]
    print(f"(S15 comm: diagnostic, NVLink collectives at nccl-tests busbw fitted 4 MiB-1 GiB; mean |error| "
          f"{sum(errs) / len(errs):.1%}, max {max(errs):.1%})")
    print("\nD5: 22B, one layer, tp 8, micro-batch 4 (ms); last two columns with S15 comm (diagnostic)")
    print(f"{'experiment':22s} {'fwd pub':>8s} {'fwd pred':>9s} {'err':>7s} {'bwd pub':>8s} {'bwd pred':>9s} {'err':>7s}"
          f" {'fwd S15':>8s} {'bwd S15':>8s}")
    for (rec, sp), (pf, pb) in LAYER_22B.items():
        f, b = predict_layer(rec, sp)
        f2, b2 = predict_layer(rec, sp, s15_calibration())
        print(f"{rec + (' + SP' if sp else ''):22s} {pf:8.1f} {f:9.2f} {f / pf - 1:+7.1%} {pb:8.1f} {b:9.2f} "
              f"{b / pb - 1:+7.1%} {f2:8.2f} {b2:8.2f}")
    print("\nsources of every prediction:")
    for line in sources("a100-sxm-80gb"):
        print(f"  {line}")


if __name__ == "__main__":
    main()
