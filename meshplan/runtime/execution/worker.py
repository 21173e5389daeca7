"""The per-rank program of ``meshplan validate``: torchrun starts one per rank.

``python -m meshplan.runtime.execution.worker --plan-json PLAN --out DIR [--steps 3]``, or
``--jobs FILE``: several such argument lists (same world) run in turn in one launch (:func:`parse_jobs`).

1. ``init_process_group`` (gloo on CPU, NCCL when CUDA is present) with ``--pg-timeout-s``
   on every group (DeviceMesh's sub-groups do not inherit the world group's timeout, so the
   default for new groups is set first, see :func:`_init`);
2. the DeviceMesh of the plan (:func:`~meshplan.runtime.execution.parallelize.init_mesh`), checked
   against meshplan's rank lists *and* against the rank lists written in ``plan.json``;
3. the plan's model (already scaled by ``validate``; ``plan.json`` input.model), split with
   :func:`~meshplan.runtime.execution.parallelize.parallelize`, weights as the single-process model
   (``sharding = "none"``: then wrapped by DDP, :func:`~meshplan.runtime.execution.parallelize.apply_ddp`);
4. the start-up print: coordinates, every group, local shapes of every parameter;
5. steps: step 0 under :class:`~meshplan.runtime.execution.recorder.CollectiveRecorder` (the
   collectives compared with the plan), step 1 for memory (steady state: the optimizer
   state exists), ``--steps`` timed steps, then one step under ``torch.profiler`` (Chrome
   trace with ``record_function`` phases ``forward``, ``loss``, ``backward``, ``optimizer``).

Files under ``DIR/rank<r>/``, each written atomically (temporary file, then rename):
``startup.json``, ``collectives.json`` (with ``expert_counts``, the router's per-expert copies of the
recorded step: :func:`~meshplan.runtime.execution.moe.take_expert_counts`), ``memory.json`` (with the memory
step's ``expert_counts``: the routed rows its MoE working sets hold), ``timings.json``, ``trace.json``,
``checkpoint.json`` (one DCP save and load after the steps, pp 1:
:func:`~meshplan.runtime.execution.checkpoint.measure_dcp`), ``probe.json`` and
``curves.json`` (the plan's collectives, then each axis's message curve, timed after the
steps: :mod:`~meshplan.runtime.validation.probe`),
and ``status.json``, rewritten at every phase (step, phase, state ``running`` / ``error`` /
``done``). ``done`` is written last: a rank's other files count only when it is there.

The step itself, and how its peak memory is measured (``memory.json`` names the method):
:mod:`meshplan.runtime.execution.trainstep`.

Faults for tests: ``--fail-rank R`` (R kills itself with SIGKILL at the start of step
``--fault-step``), ``--hang-rank R`` (R sleeps there, before it writes its status).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from meshplan.mesh.resolve import resolve_mesh
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.runtime.execution.launch import die_with_parent
from meshplan.runtime.execution.model import Transformer
from meshplan.runtime.execution.moe import take_expert_counts
from meshplan.runtime.execution.parallelize import apply_ddp, check_groups, init_mesh, parallelize
from meshplan.runtime.execution.recorder import CollectiveRecorder
from meshplan.runtime.execution.trainstep import Runner, memory_step
from meshplan.runtime.testbed.nics import apply_rank_nic, snapshot_nics
from meshplan.runtime.validation.probe import CURVE_BUDGET_S, run_probe
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


class Status:
    """``status.json`` of one rank: where it is (step, phase), rewritten at each phase."""

    def __init__(self, folder: Path, rank: int):
        self.path, self.rank, self.t0 = folder / "status.json", rank, time.time()
        self.step, self.phase = -1, "start-up"

    def set(self, step: int, phase: str, state: str = "running", error: str = "") -> None:
        self.step, self.phase = step, phase
        write_json(self.path, {"rank": self.rank, "pid": os.getpid(), "state": state, "step": step, "phase": phase,
                               "elapsed_s": round(time.time() - self.t0, 3), "error": error})


def _init(timeout_s: float) -> str:
    """Process group with ``timeout_s`` on every group; returns the device type. In a later job of
    a ``--jobs`` launch the process group exists: only the timeout of the groups still to be made
    (this job's DeviceMesh) is set."""
    import torch.distributed.distributed_c10d as c10d

    # new_group() (used by DeviceMesh for every sub-group) takes _get_default_timeout(backend),
    # not the world group's timeout: set that default so a hung peer ends every group's wait.
    c10d.default_pg_timeout = timedelta(seconds=timeout_s)
    cuda = torch.cuda.is_available()
    if cuda:
        c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        return "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s))
        return "cuda"
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return "cpu"


def load_plan(path: Path):
    """(plan dict, ModelSpec, TrainingSpec, Mesh) from a ``meshplan.plan/v1`` JSON file."""
    plan = json.loads(path.read_text())
    inp = plan["input"]
    model, training = ModelSpec(**inp["model"]), TrainingSpec(**inp["training"])
    mesh = resolve_mesh(MeshSpec(**inp["mesh"]), plan["world"])
    return plan, model, training, mesh


def startup(rank: int, mesh, plan: dict, dm, model) -> dict:
    """This rank's coordinates, groups (DeviceMesh against meshplan and plan.json) and local shapes."""
    diffs = check_groups(dm, mesh)
    if hasattr(model, "expert_mesh"):  # MoE: efsdp, ep, etp of the expert DeviceMesh
        from meshplan.runtime.execution.moe_parallel import check_expert_groups

        diffs += check_expert_groups(model.expert_mesh, mesh)
    groups = {}
    for axis in mesh.all_axes():
        mine = mesh.group_of(rank, axis)
        groups[axis] = mine
        written = [g for g in plan.get("groups", {}).get(axis, []) if rank in g]
        if written != [mine]:
            diffs.append(f"{axis}: plan.json group of rank {rank} is {written}, meshplan says {mine}")
    shapes = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        shapes[name] = {"local": list(local.shape), "global": list(p.shape),
                        "placements": [str(x) for x in getattr(p, "placements", ())]}
    coords = dict(zip(mesh.layout.names, mesh.layout.coords_of(rank)))
    return {"rank": rank, "coordinates": coords, "groups": groups, "group_differences": diffs,
            "local_shapes": shapes}


def print_startup(info: dict) -> None:
    r = info["rank"]
    lines = [f"[rank {r}] coordinates " + ", ".join(f"{k}={v}" for k, v in info["coordinates"].items()),
             f"[rank {r}] groups " + "; ".join(f"{a} {g}" for a, g in info["groups"].items())]
    if info.get("nic"):
        lines.append(f"[rank {r}] nic {info['nic']['nic']} ({info['nic']['addr']}, rail {info['nic']['rail']}) "
                     "from the placement: GLOO_SOCKET_IFNAME")
    for name, s in info["local_shapes"].items():
        if name.startswith("layers.") and not name.startswith("layers.0."):
            continue  # every layer has layer 0's shapes
        lines.append(f"[rank {r}] {name} local {tuple(s['local'])} of {tuple(s['global'])} {' '.join(s['placements'])}")
    lines += [f"[rank {r}] GROUP MISMATCH {d}" for d in info["group_differences"]]
    print("\n".join(lines), flush=True)


def maybe_fault(args, rank: int, step: int) -> None:
    if step != args.fault_step:
        return
    if rank == args.fail_rank:
        print(f"[rank {rank}] injected fault: SIGKILL at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == args.hang_rank:
        print(f"[rank {rank}] injected fault: hanging at step {step}", flush=True)
        while True:
            time.sleep(3600)


def run(args) -> None:
    """One job of this rank (module docstring): start-up (process group, DeviceMesh, the plan's
    model, its start-up print), the steps and their files, then the DCP probe (pp 1) and the
    plan's collectives timed; each phase written to ``status.json``, ``done`` last."""
    rank = int(os.environ["RANK"])
    folder = Path(args.out) / f"rank{rank}"
    status = Status(folder, rank)
    status.set(-1, "start-up")
    plan, model_spec, training, mesh = load_plan(Path(args.plan_json))
    torch.manual_seed(args.seed)

    nic = apply_rank_nic(plan, rank)  # testbed only: GLOO_SOCKET_IFNAME from the placement, before any group
    device = _init(args.pg_timeout_s)
    world = dist.get_world_size()
    if world != mesh.world:
        raise RuntimeError(f"torchrun started {world} ranks but the plan's mesh has {mesh.world}")
    dm = init_mesh(mesh, device)
    vocab = padded_vocab(model_spec.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    model, runner = _build_model(args, plan, model_spec, training, mesh, dm, rank, vocab, status, device)
    info = startup(rank, mesh, plan, dm, model)
    if nic:
        info["nic"] = nic
    write_json(folder / "startup.json", info)
    print_startup(info)
    if mesh.degree("pp") == 1:  # sharding none: DDP over dp on the materialized model (parallelize.apply_ddp)
        trained = apply_ddp(model, dm, mesh) if training.sharding == "none" else model
        runner = Runner(trained, training, mesh, rank, vocab, args.seed, status, device)
    step, timings, prof = _run_steps(args, runner, model, rank, folder, nic, device)
    status.set(step, "writing trace")
    _write_trace(folder, prof)
    write_json(folder / "timings.json", {"rank": rank, "device": device, "threads": torch.get_num_threads(),
                                         "steps": timings})
    if mesh.degree("pp") == 1:  # DCP save and load after the steps (pipeline stages: not measured yet)
        _checkpoint_probe(args, runner, rank, folder, status, step)
    if args.probe_spec:  # the plan's collectives timed after the steps: meshplan.runtime.validation.probe
        _collective_probe(args, rank, folder, status, step)
    dist.barrier()
    status.set(step, "finished", state="done")


def _build_model(args, plan: dict, model_spec: ModelSpec, training: TrainingSpec, mesh, dm, rank: int, vocab: int,
                 status: Status, device: str):
    """(model, runner): with pp > 1 the rank's pipeline stages and their schedule
    (:func:`meshplan.runtime.execution.pipelined.build_runner`); else the whole model built on the
    meta device, split by :func:`~meshplan.runtime.execution.parallelize.parallelize`, materialized on
    ``device`` and initialized from ``args.seed``, and no runner yet (:func:`run` makes it after the
    start-up print, over DDP where ``sharding = "none"``)."""
    tp = mesh.degree("tp")
    if mesh.degree("pp") > 1:  # pipeline stages and schedule: meshplan.runtime.execution.pipelined
        from meshplan.runtime.execution.pipelined import build_runner

        return build_runner(plan, model_spec, training, mesh, dm, rank, vocab, args.seed, status, device)
    with torch.device("meta"):
        model = Transformer(model_spec, vocab=vocab, tp=tp, recompute=training.layer_recomputed)
    parallelize(model, dm, mesh, training, loss_parallel=tp > 1)
    model.to_empty(device=device)
    model.init_weights(seed=args.seed)
    return model, None


def _run_steps(args, runner, model, rank: int, folder: Path, nic, device: str):
    """The job's steps (module docstring, 5.): step 0 recorded (``collectives.json``, with the
    clock after a barrier every rank leaves at about the same moment: the offset between hosts'
    clocks), step 1 for memory (``memory.json``), ``args.steps`` measured, one profiled; on the
    testbed the NIC counters around them (``nic_counters.json``). Returns (the last step's number,
    the steps' timings, the profiler)."""
    timings = []
    nic_before = snapshot_nics(dist.barrier) if nic else None  # testbed: NIC counters around the steps
    step = 0
    dist.barrier()  # every rank leaves it at about the same moment: the offset between hosts' clocks
    clock = {"host": socket.gethostname(), "barrier_exit_s": time.time()}
    maybe_fault(args, rank, step)
    with (runner.recorder() if hasattr(runner, "recorder") else CollectiveRecorder()) as rec:
        timings.append({**runner.step(step, rec), "kind": "recorded"})
    write_json(folder / "collectives.json", {"rank": rank, "step": step, "clock": clock,
                                             "records": [r.__dict__ for r in rec.records],
                                             "expert_counts": take_expert_counts(model)})
    step += 1
    maybe_fault(args, rank, step)
    t, mem = memory_step(runner, step)
    timings.append({**t, "kind": "memory"})
    write_json(folder / "memory.json", {"rank": rank, "step": step, **mem, "expert_counts": take_expert_counts(model)})
    for _ in range(args.steps):
        step += 1
        maybe_fault(args, rank, step)
        timings.append({**runner.step(step), "kind": "measured"})
    step += 1
    maybe_fault(args, rank, step)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        timings.append({**runner.step(step), "kind": "profiled"})
    if nic:
        write_json(folder / "nic_counters.json", {"rank": rank, "steps": len(timings), "before": nic_before,
                                                  "after": snapshot_nics(dist.barrier)})
    return step, timings, prof


def _write_trace(folder: Path, prof) -> None:
    """The profiled step's Chrome trace to ``trace.json``, atomically (a temporary file, then a rename)."""
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".trace.", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / "trace.json")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _checkpoint_probe(args, runner, rank: int, folder: Path, status: Status, step: int) -> None:
    """One DCP save and load of the trained state (:func:`~meshplan.runtime.execution.checkpoint.measure_dcp`)
    to ``checkpoint.json``; a state DCP cannot save is reported there, not fatal to the run's
    other evidence. Rank 0 removes the checkpoint once every rank is done."""
    from meshplan.runtime.execution.checkpoint import measure_dcp

    status.set(step, "checkpoint")
    ck = Path(args.out) / "dcp_probe"
    try:
        rec = measure_dcp(runner.model, runner.opt, ck, rank)
    except Exception as e:  # a state DCP cannot save is reported, not fatal to the run's other evidence
        rec = {"rank": rank, "error": f"{type(e).__name__}: {e}"}
    write_json(folder / "checkpoint.json", rec)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(ck, ignore_errors=True)


def _collective_probe(args, rank: int, folder: Path, status: Status, step: int) -> None:
    """The plan's collectives timed after the steps (:mod:`~meshplan.runtime.validation.probe`,
    ``probe.json``), then with ``args.curve_spec`` each axis's ops over the message sizes
    (``curves.json``, within ``CURVE_BUDGET_S``); each axis's groups made once for both."""
    status.set(step, "collective probe")
    handles: dict = {}  # each axis's groups made once, for the probe and the message curves
    write_json(folder / "probe.json", run_probe(rank, json.loads(Path(args.probe_spec).read_text()),
                                                handles=handles))
    if args.curve_spec:  # message curves: each axis's ops over CURVE_SIZES (meshplan.runtime.validation.staged)
        status.set(step, "message curves")
        write_json(folder / "curves.json", run_probe(rank, json.loads(Path(args.curve_spec).read_text()),
                                                     budget_s=CURVE_BUDGET_S, handles=handles))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="meshplan.runtime.execution.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan-json", required=True, help="plan written by meshplan (schema meshplan.plan/v1)")
    ap.add_argument("--out", required=True, help="folder; this rank writes rank<r>/ inside")
    ap.add_argument("--steps", type=int, default=3, help="timed steps after the recorded and the memory step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pg-timeout-s", type=float, default=60.0, help="timeout of every process group")
    ap.add_argument("--fail-rank", type=int, default=-1, help="test: this rank SIGKILLs itself")
    ap.add_argument("--hang-rank", type=int, default=-1, help="test: this rank sleeps forever")
    ap.add_argument("--fault-step", type=int, default=1, help="step at whose start the fault happens")
    ap.add_argument("--probe-spec", default="",
                    help="JSON list of collectives to time after the steps (meshplan.runtime.validation.probe); empty: none")
    ap.add_argument("--curve-spec", default="",
                    help="JSON list of (axis, op, size) message-curve points timed after the probe; empty: none")
    return ap.parse_args(argv)


def parse_jobs(argv=None) -> list[argparse.Namespace]:
    """The jobs of one launch: ``--jobs FILE``, a JSON list of argument lists (each one job's
    :func:`parse_args` arguments: several planned configs of the same world run in turn on one
    process group, one torch import and rendezvous for all), or one job's arguments."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--jobs", default="")
    known, rest = ap.parse_known_args(argv)
    if not known.jobs:
        return [parse_args(rest)]
    return [parse_args([str(a) for a in job]) for job in json.loads(Path(known.jobs).read_text())]


def run_job(args) -> int:
    """:func:`run` of one job; an exception is written to this rank's ``status.json`` (state
    ``error``, where it happened) and printed; returns the exit code (0 or 1)."""
    rank = int(os.environ.get("RANK", "0"))
    status = Status(Path(args.out) / f"rank{rank}", rank)
    try:
        run(args)
        return 0
    except BaseException as e:
        first = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        try:
            old = json.loads(status.path.read_text())
            status.step, status.phase = old.get("step", -1), old.get("phase", "")
        except (OSError, ValueError):
            pass
        status.set(status.step, status.phase, state="error", error=first)
        traceback.print_exc()
        return 1


def main(argv=None) -> int:
    """Run the jobs (:func:`parse_jobs`) in order; the first that fails ends the launch (its
    peers may be waiting in a collective): the later jobs write no status, "did not start"."""
    die_with_parent()  # a torchrun killed from outside takes this rank with it
    jobs = parse_jobs(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        for job in jobs:
            if run_job(job):
                return 1
        return 0
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
