"""``meshplan validate``: run a planned mesh for real with torchrun and compare it with the plan.

For each world size W (staged: 2, then 4, then 8 ...):

1. **Scale.** The config's mesh is re-sized to W by its outermost data axis
   (dp_replicate, dp or dp_shard, the outermost one of degree > 1): every other axis keeps
   its degree, ``data = W / (product of the others)`` (printed). The model is scaled down by
   stated factors (:func:`~meshplan.runtime.execution.model.scale_model`: layers, hidden / N, vocab);
   the batch is one micro-batch of ``micro_batch`` x ``seq_len`` per data-parallel rank
   unless ``micro_batches`` is given (``global_batch = micro_batch x dp x micro_batches``);
   every dtype is fp32 (CPU); ``recompute = "selective"`` runs as none (the runtime model
   recomputes whole layers or nothing).
2. **Hardware.** On CPU, the cluster is the CPU testbed (``cpu_testbed.toml``: measured core
   GEMM rate, memory bandwidth, gloo loopback bandwidth and latency), one node of W "GPUs"
   = ranks, each with ``min(1, cores / W)`` of a core; NCCL buffers and cuBLAS workspace are 0
   in the memory timeline (gloo and CPU BLAS allocate neither through torch). The plan's own
   local GEMM shapes and its local causal attention (forward, backward) are timed in this
   process (one thread) into a GEMM table (:class:`meshplan.compute.gemm.GemmTable`), divided by the
   core share, and the step-time model uses it. After the steps the worker times each of
   the plan's collectives under the run's load (:mod:`meshplan.runtime.validation.probe`); the
   comparison adds the step-time model re-evaluated with those times ("calibrated" rows).
3. **Plan** (:func:`meshplan.plan.build_plan`) written as ``plan.json``.
4. **Run** ``torchrun --standalone`` of :mod:`meshplan.runtime.execution.worker` (or, with
   ``testbed``, one torchrun per node namespace: :mod:`meshplan.runtime.testbed.run`) with a
   wall-clock limit (:mod:`meshplan.runtime.execution.launch`: nothing is left running, a failed or hung rank is
   named).
5. **Compare** (:mod:`meshplan.runtime.validation.evidence`): collectives of every rank against the
   plan's table (count, group, bytes, dtype), step and phase times against
   :func:`meshplan.schedule.steptime.step_time`, peak memory against the memory timeline, and
   the bytes each rank wrote in a DCP save after the steps against
   :func:`meshplan.reliability.dcp_write_bytes` (save and load times at ``--checkpoint-gbps``).

Evidence folder ``OUT``: ``validate.json`` and ``summary.md`` (all worlds), and per world
``world<W>/``: ``plan.json``, ``gemm_table.json``, ``torchrun.log``, ``rank<r>/`` (the
workers' files), ``collectives.csv``, ``predicted_vs_measured.csv`` and ``.json``,
``comparison.json`` (the world's result: notes, outcome, comparison or fault report). Exit code 0 when every world ran and matched, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Optional

from meshplan.config import Config, load_config
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Infeasible, resolve_mesh
from meshplan.plan import Infeasible as NoPlan
from meshplan.plan import build_plan
from meshplan.report.json_out import write_json
from meshplan.runtime.execution.launch import diagnose, run_torchrun
from meshplan.runtime.testbed.cpu import cpu_cluster
from meshplan.runtime.testbed.nics import nic_rows
from meshplan.runtime.testbed.run import run_on_testbed, testbed_cluster
from meshplan.runtime.validation.kerneltimes import measure_attention, measure_gemms
from meshplan.runtime.validation.probe import probe_spec
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec

DATA_AXES = ("dp_replicate", "dp", "dp_shard")
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", grad_dtype="fp32", optimizer_dtype="fp32", reduce_dtype="fp32")
MARKER = "validate.json"


@dataclass(frozen=True)
class Options:
    """Scale-down factors and run limits of one ``validate`` call."""

    worlds: tuple[int, ...] = (2, 4)
    layers: int = 2
    hidden_div: Optional[int] = None  # None: smallest power of two giving hidden <= 256
    seq_len: int = 64
    vocab: int = 512
    micro_batches: int = 1
    steps: int = 3
    timeout_s: float = 120.0
    pg_timeout_s: Optional[float] = None  # None: timeout_s / 2
    fail_rank: int = -1
    hang_rank: int = -1
    fault_step: int = 1
    tolerance: Optional[float] = None  # relative error allowed on step time and peak memory
    testbed: Optional[str] = None  # prefix of a netns testbed to run across (meshplan.runtime.testbed.run)
    probe: bool = True  # time the plan's collectives in the launch, after the steps (meshplan.runtime.validation.probe)
    checkpoint_bytes_per_s: Optional[float] = None  # one rank's storage bandwidth: predicts DCP save/load times


def scale_mesh(spec: MeshSpec, base_world: int, world: int) -> tuple[MeshSpec, str]:
    """``spec`` re-sized to ``world`` ranks through its outermost data axis (see the module
    docstring); returns the new spec and the derivation line.

    >>> s, why = scale_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), 64, 16)
    >>> s.shape, why
    ([2, 8], 'dp_shard = 16 / (tp 8) = 2 (config: dp_shard 8)')
    """
    mesh = resolve_mesh(spec, base_world)
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "the config's mesh does not resolve: " + "; ".join(mesh.reasons))
    names, shape = list(mesh.layout.names), list(mesh.layout.shape)
    data = [i for i, n in enumerate(names) if n in DATA_AXES]
    if not data:
        raise ConfigError("mesh", f"axes {names} have no data axis ({', '.join(DATA_AXES)}) to scale to other worlds")
    i = next((j for j in data if shape[j] > 1), data[0])
    rest = [f"{n} {d}" for j, (n, d) in enumerate(zip(names, shape)) if j != i and d > 1] or ["1"]
    others = prod(d for j, d in enumerate(shape) if j != i)
    if world % others:
        raise ConfigError("--worlds", f"world {world} is not a multiple of {' * '.join(rest)} = {others}; the "
                          f"data axis {names[i]} absorbs the world size, the other axes keep their degrees")
    why = f"{names[i]} = {world} / ({' * '.join(rest)}) = {world // others} (config: {names[i]} {shape[i]})"
    shape[i] = world // others
    if mesh.ep * mesh.etp > 1:
        names, shape = names + ["ep", "etp"], shape + [mesh.ep, mesh.etp]
    upd = spec.model_dump(exclude={"names", "shape", "order", "degrees", "world", "rank_to_gpu"})
    return MeshSpec(names=names, shape=shape, world=world, **upd), why


def auto_hidden_div(hidden: int, head_dim: int, ffn: int, target: int = 256) -> int:
    """Smallest power of two that divides hidden, head_dim (leaving it even) and ffn and
    brings hidden to ``target`` or below.

    >>> auto_hidden_div(8192, 128, 28672)
    32
    """
    d = 1
    while hidden // d > target:
        nd = d * 2
        if hidden % nd or head_dim % nd or (head_dim // nd) % 2 or ffn % nd:
            break
        d = nd
    return d


def scale_config(config: Config, world: int, opt: Options) -> tuple[Config, list[str]]:
    """The config of one stage: scaled model, mesh, batch, fp32, CPU testbed (see module doc)."""
    from meshplan.runtime.execution.model import scale_model

    m = config.model
    div = opt.hidden_div or auto_hidden_div(m.hidden, m.d_head, m.ffn)
    scaled = scale_model(m, layers=opt.layers, hidden_div=div, vocab=opt.vocab)
    spec = _spec(config)
    mesh_spec, mesh_why = scale_mesh(spec, spec.world or config.cluster.world, world)
    mesh = resolve_mesh(mesh_spec, world)
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "; ".join(mesh.reasons))
    t = config.training
    recompute = "none" if t.recompute == "selective" else t.recompute
    mb = min(t.micro_batch, 2)
    training = TrainingSpec(**{**t.model_dump(), **FP32, "seq_len": opt.seq_len, "micro_batch": mb,
                               "global_batch": mb * mesh.dp * opt.micro_batches, "recompute": recompute})
    if opt.testbed:
        cluster, hw_why = testbed_cluster(opt.testbed, world)
    else:
        cluster, hw_why = cpu_cluster(world)
    from meshplan.runtime.validation.memcheck import TORCH_CPU_MEMORY

    memory = config.memory.model_copy(update={**TORCH_CPU_MEMORY, "optimizer_temp_states": 0})
    notes = [scaled.note + (f" (hidden_div {div} chosen automatically)" if not opt.hidden_div else ""),
             "mesh: " + mesh_why,
             f"batch: micro_batch {t.micro_batch} -> {mb}, seq_len {t.seq_len} -> {opt.seq_len}, global_batch "
             f"{t.global_batch} -> {training.global_batch} = micro_batch {mb} x dp {mesh.dp} x {opt.micro_batches} "
             "micro-batch(es)",
             f"dtypes: all fp32 (config: params {t.param_dtype}, compute {t.compute_dtype}, reduce {t.reduce_dtype})",
             hw_why, "memory timeline: NCCL buffers and cuBLAS workspace 0 (gloo, CPU); optimizer temporaries 0 "
             "(the worker's AdamW is torch's CPU default, one parameter at a time, not foreach); the runtime model's "
             "torch variants (memcheck.TORCH_CPU_MEMORY: fp32 logits, torch cross entropy, no dropout, SP inputs "
             "all-gathered and kept, rms_norm decomposed, K/V repeated before SDPA, embedding gradient over the "
             "whole vocabulary)"]
    if recompute != t.recompute:
        notes.append("recompute 'selective' runs as none (the runtime model has no selective recompute)")
    if t.sharding == "none":
        notes.append("DDP (sharding none): the recorded first step all-reduces every gradient as one bucket "
                     "(torch 2.13, find_unused_parameters=False), as the table says; later steps send the "
                     "rebuilt 1 MiB / 25 MiB buckets")
    cfg = Config(model=scaled.spec, cluster=cluster, training=training, mesh=mesh_spec, path=config.path,
                 memory=memory)
    return cfg, notes


def prepare_out(out: Path, force: bool) -> None:
    """Refuse a non-empty ``out`` unless ``force`` and it is an evidence folder of ours."""
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ConfigError("--out", f"{out} exists and is not empty; choose another folder or pass --force")
        if not (out / MARKER).exists() and not any(out.glob("world*/plan.json")):
            raise ConfigError("--out", f"{out} is not a meshplan validate folder (no {MARKER}); --force only "
                              "replaces those")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _spec(config: Config) -> MeshSpec:
    """``config``'s [mesh] table; ConfigError when it has none."""
    if config.mesh is None:
        raise ConfigError("mesh", "missing table [mesh]; validate runs one mesh")
    return config.mesh


def not_runnable(cfg: Config, mesh) -> Optional[str]:
    """Why the runtime cannot build the scaled ``cfg``'s resolved ``mesh`` (None when it can):
    :func:`meshplan.runtime.execution.parallelize._unsupported`, and for pp > 1
    :func:`meshplan.runtime.execution.pipelined.unsupported`."""
    from meshplan.runtime.execution.parallelize import _unsupported

    why = _unsupported(mesh, cfg.training, pipeline=True, moe=cfg.model.is_moe)
    if not why and mesh.degree("pp") > 1:
        from meshplan.runtime.execution.pipelined import unsupported

        why = unsupported(mesh, cfg.training, _spec(cfg).pp_schedule, cfg.model)
    return why


def run_world(config: Config, world: int, opt: Options, out: Path, echo=print) -> dict:
    """Scale, plan, run and compare one world size; returns its result dict."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.evidence import compare_world, write_world_evidence

    folder = out / f"world{world}"
    folder.mkdir(parents=True, exist_ok=True)
    cfg, notes = scale_config(config, world, opt)
    plan = build_plan(cfg)
    write_json(plan, folder / "plan.json", force=True)
    for n in notes:
        echo(f"  {n}")
    if isinstance(plan, NoPlan) or not plan.feasible:
        return {"world": world, "ok": False, "stage": "plan", "notes": notes,
                "message": "the scaled plan is infeasible: " + "; ".join(plan.reasons)}
    why = not_runnable(cfg, plan.mesh)
    if why:
        return {"world": world, "ok": False, "stage": "plan", "notes": notes, "message": f"not runnable here: {why}"}
    share = min(1.0, len(os.sched_getaffinity(0)) / world)

    table, rows = measure_gemms(plan, share)
    if cfg.training.flash_attention:
        att, att_rows = measure_attention(plan, share)
        table, rows = replace(table, attention=att), rows + att_rows
    write_json_atomic(folder / "gemm_table.json", {"device": "cpu", "torch": rows and _torch_version(), "rows": rows})
    pg_timeout = opt.pg_timeout_s or max(5.0, opt.timeout_s / 2)
    argv = ["meshplan.runtime.execution.worker", "--plan-json", str(folder / "plan.json"), "--out", str(folder),
            "--steps", str(opt.steps), "--pg-timeout-s", str(pg_timeout), "--fail-rank", str(opt.fail_rank),
            "--hang-rank", str(opt.hang_rank), "--fault-step", str(opt.fault_step)]
    if opt.probe:
        write_json_atomic(folder / "probe_spec.json", probe_spec(plan))
        argv += ["--probe-spec", str(folder / "probe_spec.json")]
    echo(f"  torchrun: {world} ranks, limit {opt.timeout_s:g} s (process-group timeout {pg_timeout:g} s)")
    nic_bytes = None
    if opt.testbed:
        outcome, nic_bytes = run_on_testbed(opt.testbed, world, argv, folder, opt.timeout_s,
                                            env={"PYTHONPATH": _pythonpath()})
    else:
        outcome = run_torchrun(world, argv, folder / "torchrun.log", opt.timeout_s,
                               env={"PYTHONPATH": _pythonpath()})
    result = {"world": world, "notes": notes, "elapsed_s": round(outcome.elapsed_s, 2),
              "returncode": outcome.returncode, "timed_out": outcome.timed_out, "leftover_pids": outcome.leftover_pids}
    if nic_bytes is not None:
        result["nic_bytes"] = nic_bytes
    done = all((folder / f"rank{r}" / "status.json").exists() and
               json.loads((folder / f"rank{r}" / "status.json").read_text()).get("state") == "done"
               for r in range(world))
    if not (outcome.ok and done):
        fault = diagnose(outcome, folder, opt.timeout_s, pg_timeout)
        result.update(ok=False, stage="run", message=fault["message"], fault=fault)
        write_json_atomic(folder / "comparison.json", result)
        return result
    comp = compare_world(plan, folder, table, opt.tolerance, opt.checkpoint_bytes_per_s)
    if opt.testbed:  # bytes per NIC over the steps against the plan (meshplan.runtime.testbed.nics)

        comp["predicted_vs_measured"] += nic_rows(plan, folder, nic_bytes)
    result.update(ok=comp["ok"], stage="compare", message=comp["message"], comparison=comp)
    write_world_evidence(folder, result)
    return result


def _torch_version() -> str:
    import torch

    return torch.__version__


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH", "")
    return root + (os.pathsep + old if old else "")


def validate(config: Config, opt: Options, out: Path, force: bool = False, echo=print) -> tuple[int, list[dict]]:
    """Run every world of ``opt.worlds`` in order; write the evidence folder. Returns
    (exit code, per-world results)."""
    from meshplan.runtime.execution.worker import write_json as write_json_atomic
    from meshplan.runtime.validation.evidence import write_summary

    if not opt.worlds or any(w < 1 for w in opt.worlds):
        raise ConfigError("--worlds", f"{list(opt.worlds)}: give positive world sizes, e.g. 2,4,8")
    if opt.timeout_s <= 0:
        raise ConfigError("--timeout-s", "must be positive")
    for w in opt.worlds:  # every stage must scale, and the runtime must build it, before anything runs
        cfg, _ = scale_config(config, w, opt)
        why = not_runnable(cfg, resolve_mesh(_spec(cfg), w))
        if why:
            raise ConfigError("mesh", f"world {w}: the runtime cannot build this mesh: {why}; validate a mesh "
                              "without it (the plan itself does not need the runtime)")
    prepare_out(out, force)
    results = []
    cores = len(os.sched_getaffinity(0))
    for w in opt.worlds:
        echo(f"world {w}:")
        if w > 4 * cores and not opt.testbed:
            echo(f"  note: {w} ranks on {cores} cores ({w / cores:g} per core): every rank time-shares a core; "
                 "start-up alone takes tens of seconds and step times are dominated by scheduling")
        results.append(run_world(config, w, opt, out, echo))
        echo(f"  {'OK' if results[-1]['ok'] else 'FAILED'}: {results[-1]['message']}")
        for row in (results[-1].get("comparison") or {}).get("predicted_vs_measured", []):
            if row["quantity"] in ("step time", "step time (calibrated)", "peak memory") and row["predicted"]:
                unit = (1e3, "ms") if row["unit"] == "s" else (2.0 ** -20, "MiB")
                echo(f"  {row['quantity']}: predicted {row['predicted'] * unit[0]:.1f} {unit[1]}, measured "
                     f"{row['measured'] * unit[0]:.1f} {unit[1]} ({row['error']:+.0%})")
    ok = all(r["ok"] for r in results)
    write_summary(out, config, opt, results)
    write_json_atomic(out / MARKER, {"schema": "meshplan.validate/v1", "ok": ok, "config": config.path,
                                     "options": opt.__dict__, "worlds": results})
    return (0 if ok else 1), results


def main(config_path: str, opt: Options, out: Path, force: bool = False) -> int:
    code, _ = validate(load_config(config_path), opt, out, force)
    print(f"evidence: {out / 'summary.md'}", file=sys.stderr if code else sys.stdout)
    return code
