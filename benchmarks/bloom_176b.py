"""BLOOM-176B (BigScience, 2022) against meshplan: an external check, not the development set;
nothing in meshplan is tuned to it.

Published (bigscience-workshop/bigscience 9e64ede, ``train/tr11-176B-ml/README.md``, "Important
checkpoints"): iteration 85376, the end of epoch one on 48 nodes, "elapsed time per iteration (s):
104.70", global batch 2048, "TFLOPs: 149.77" (their 4 x 2 hardware formula, recompute counted).
The run (``tr11-176B-ml.slurm`` and the README): 384 A100 80GB (48 nodes of 8, NVLink, 4 Omni-Path
100 Gb/s links a node), tp 4, pp 12, dp 8, micro-batch 2, seq 2048, 70 layers, hidden 14336, 112
heads, vocabulary padded to 250880, tied embeddings, ALiBi, embedding LayerNorm, bf16,
``--checkpoint-activations`` (every layer recomputed), ZeRO stage 0 with bf16 (DeepSpeed's
BF16_Optimizer), ``--pp-partition-method 'type:transformer|embedding'`` (stage 0: embedding + 5
layers, stages 1-10: 6, stage 11: 5 + the tied embedding), PyTorch 1.11 / CUDA 11.5, DeepSpeed from
a branch of May-June 2022 (read at v0.6.5), ``CUDA_LAUNCH_BLOCKING=1``. The config:
``benchmarks/bloom/bloom-176b_384xa100_tp4-pp12-dp8.toml`` (what it cannot express is listed there).

What the source audit of DeepSpeed v0.6.5 (``runtime/pipe/engine.py``, ``schedule.py``, ``p2p.py``,
``runtime/bf16_optimizer.py``, ``runtime/utils.py``) found against meshplan's Megatron-LM pipeline,
and what this benchmark prints as ``pp_engine = "framework"`` (before) and ``"deepspeed"`` (after,
:mod:`meshplan.compute.deepspeed_pipe`):

- Modelled now: ``BF16_Optimizer.update_hp_grads`` after every micro-batch's backward (the stage's
  fp32 gradients += the bf16 ones cast, 18 B an element: ~39 ms a micro-batch on a 6-layer stage);
  ``PartitionedTensor``: each stage re-gathers its own output over tp before its backward (one
  more all-gather of the 117 MB activation than Megatron-LM's scatter-gather p2p) and every
  rebuild zero-fills and clones the whole tensor; Megatron-LM 2022's p2p timer syncs dropped;
  the sends and receives one blocking call each (``PipelineSpec.serial_p2p``): ``TrainSchedule``
  (engine.py ``train_batch``, schedule.py:182-250) is 1F1B in ``2 (m + p - 1)`` steps whose
  ``p2p.send``/``recv`` are ``dist.send``/``dist.recv`` on torch >= 1.8 (p2p.py:47-85), one tensor
  each, a step's receive and send (or send and receive) in turn, where Megatron-LM's
  ``batch_isend_irecv`` runs a send and a receive at once; a rendezvous simulation of its
  instruction order gives ``(m + p - 1)(F + B)`` without transfer time (Megatron-LM's 1F1B) and
  with it what meshplan's simulation with ``serial_p2p`` gives (582.4 against 582.9 at p 12, m 128,
  F 1, B 3 and 0.05 a transfer; Megatron-LM's calls: 569.75).
- ALiBi (``model.position_embedding = "alibi"``, :func:`meshplan.compute.attention.score_ops`):
  BigScience's ``baddbmm`` takes the bias as its input with beta 1, so torch copies it, expanded,
  into the scores and the GEMM reads them as C: ~1.1 ms a layer a micro-batch (forward and
  recompute), +0.90 s a step under either engine.
- Checked, the same as meshplan already models: activations sent as ``1/tp``
  slices and gathered on arrival, as Megatron-LM's scatter-gather; the tied embedding's gradient
  all-reduced in fp32 between the first and last stages (``_exec_reduce_tied_grads``,
  ``weight._hp_grad``); the data-parallel reduction once per step in bf16
  (``communication_data_type`` for bf16, engine.py:733-742) and the all-gather of the updated
  bf16 parameters (``all_gather_dp_groups``).
- Memory: ``BF16_Optimizer`` (:attr:`meshplan.spec.training.TrainingSpec.bf16_optimizer`, the config's
  zero1 + ``zero12_engine = "deepspeed"`` + fp32 gradients, what a stage 0 bf16 import plans): bf16
  parameters (2 B), fp32 and bf16 gradients whole (4 + 2 B), fp32 master and Adam states over dp 8
  (12 / 8 B), and the step's flattened all-reduce bucket (5e8 x (4 + 2) B); the last line prints the
  peak (43.52 GiB on stage 0, usable 71.3 GiB of the A100 80GB: it fits, as it ran).
- Not modelled (doubtful or small): ``CUDA_LAUNCH_BLOCKING=1`` (each kernel then waits for the
  host's launch: at the 4.7 us issue floor and ~600 kernels a micro-batch on a stage, ~0.4 s a
  step; the README measured "a tiny impact or no impact at all"); the fp32 gradients' flatten, cast
  and copies around the bf16 all-reduce (32 B an element once per step, ~70 ms) and BF16_Optimizer's
  norm, clip and zeroing over the stage's whole fp32 gradients (16 B an element, ~35 ms); GEMM rates
  of cuBLAS in CUDA 11.5 (the catalog's A100 points are CUDA 12.x measurements; none of 2022 is at
  hand); the Omni-Path links (4 x 100 Gb/s a node, one per GPU pair assumed) at line rate, an upper
  bound, for want of an nccl-tests curve of them (the data-parallel, tied-embedding and pipeline
  transfers expose ~8 s of the step); Megatron-LM's get_batch charged on every stage where
  DeepSpeed loads on the first and last only (~0.1 ms a micro-batch).

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/bloom_176b.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import deepspeed_pipe_costs, workload_of

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "bloom" / "bloom-176b_384xa100_tp4-pp12-dp8.toml"
#: tr11-176B-ml README "Important checkpoints", iteration 85376 (48 nodes).
PUBLISHED_S = 104.70


def predict(engine: str):
    """The plan and step time of the BLOOM config with ``training.pp_engine = engine``."""
    cfg = load_config(CONFIG)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"pp_engine": engine}))
    plan = build_plan(cfg)
    return plan, step_time(plan)


def engine_lines(plan) -> list[str]:
    """Per kind of stage (first, middle, last), the engine's ms a micro-batch by group of ops."""
    costs = deepspeed_pipe_costs(plan, workload_of(plan))
    out = []
    for label, s in (("stage 0", 0), ("stage 1", 1), (f"stage {len(costs) - 1}", len(costs) - 1)):
        ops = costs[s].ops if costs[s] is not None else ()
        hp = sum(o.seconds for o in ops if "hp_grad" in o.name)
        regather = sum(o.seconds for o in ops if "re-gather" in o.name)
        other = sum(o.seconds for o in ops) - hp - regather
        out.append(f"  {label:>8}: hp grad accumulation {hp * 1e3:7.2f} ms, output re-gather {regather * 1e3:5.2f} ms, "
                   f"partition/rebuild copies and syncs {other * 1e3:5.2f} ms a micro-batch")
    return out


def memory_line(plan) -> str:
    """The plan's predicted peak (its most loaded stage) against the A100's HBM and the usable share,
    with BF16_Optimizer's state on that stage (:attr:`meshplan.spec.training.TrainingSpec.bf16_optimizer`)."""
    tl = max(plan.timelines, key=lambda t: t.peak.total_bytes)
    gib = 2 ** 30
    return (f"memory (BF16_Optimizer: bf16 params, bf16 + fp32 grads whole, fp32 master + Adam / dp 8): peak "
            f"{tl.peak.total_bytes / gib:.2f} GiB on stage {tl.stage} at {tl.peak.where()}, usable "
            f"{tl.usable_bytes / gib:.2f} GiB of {tl.hbm_bytes / gib:.1f} GiB HBM: "
            f"{'fits' if tl.fits else 'does not fit'}")


def main() -> None:
    print("BLOOM-176B, 384 A100 80GB, tp 4 x pp 12 x dp 8, micro-batch 2, global batch 2048, seq 2048 "
          "(bigscience tr11-176B-ml; external check)")
    print(f"{'pp_engine':>10} | {'published':>9} | {'predicted':>9} {'error':>7} | {'compute':>8} {'bubble':>8} "
          f"{'exposed':>8}")
    plans = {}
    for engine in ("framework", "deepspeed"):
        plan, st = predict(engine)
        plans[engine] = plan
        parts = st.parts_s()
        exposed = sum(v for k, v in parts.items() if k not in ("compute", "bubble"))
        print(f"{engine:>10} | {PUBLISHED_S:>8.2f}s | {st.step_s:>8.2f}s {st.step_s / PUBLISHED_S - 1:>+7.1%} | "
              f"{parts.get('compute', 0.0):>7.2f}s {parts.get('bubble', 0.0):>7.2f}s {exposed:>7.2f}s")
    print("DeepSpeed's PipelineEngine and BF16_Optimizer per micro-batch (pp_engine deepspeed, "
          "meshplan.compute.deepspeed_pipe):")
    for line in engine_lines(plan):
        print(line)
    print(memory_line(plans["deepspeed"]))
    print("parts on the stage where the step ends; exposed: communication the compute waited on. What is left "
          "(CUDA_LAUNCH_BLOCKING, CUDA 11.5 GEMM rates, Omni-Path at line rate): this file's docstring.")


if __name__ == "__main__":
    main()
