"""Pipeline parallelism in the runtime: the plan's stages as ``torch.distributed.pipelining``
stages, run by the schedule the config names.

- :class:`StageModule`: one chunk (virtual stage) of the runtime
  :class:`~meshplan.runtime.execution.model.Transformer`: the embedding on the first virtual stage, the
  layers ``plan.stages[k][c]`` (module names as in the full model: ``layers.<i>...``), the final
  norm and output layer on the last one. Chunk ``c`` of pipeline rank ``k`` is virtual stage
  ``virtual_stage(c, k)`` of the schedule: ``c * pp + k`` looped (Megatron's interleaved
  assignment, :func:`meshplan.mesh.layers.stage_layers`; the order torch's looped interleaved
  schedule expects), ``k`` and ``2 pp - 1 - k`` V-shaped (ZB-V, DualPipeV: rank 0 holds the
  embedding chunk and the output chunk; torch hands the activation from rank pp - 1's chunk 0
  to its chunk 1 locally, no send).
- Each chunk is parallelised in torchtitan's order (``torchtitan/models/llama3/infra/
  parallelize.py`` then ``distributed/pipeline_parallel.py``): tensor (and sequence)
  parallelism on the ``tp`` sub-mesh with :func:`~meshplan.runtime.execution.tensor_parallel.apply_tp` (the
  embedding, final norm and output where the chunk has them; loss parallel on the last stage
  as the plan's ``mesh.loss_parallel`` says), then FSDP2 where the mesh has a data-parallel
  shard axis (:func:`~meshplan.runtime.execution.parallelize.apply_fsdp`: the embedding and
  [final norm, output] as their own units where present, as torchtitan, every layer, then the
  chunk), then
  :class:`torch.distributed.pipelining.PipelineStage` on the DeviceMesh's ``pp`` group, in
  static mode (input and output shapes given, no shape inference).
- What a stage sends: the residual stream as the TP plan leaves it between layers, a plain
  tensor (row-parallel outputs and the embedding use ``use_local_output``), not a DTensor:
  (micro_batch, seq, hidden), or under SP this tp rank's sequence shard
  (micro_batch, seq / tp, hidden), sent to the peer with the same tp (and data) coordinates
  in the next stage. The next stage's first ``SequenceParallel`` norm wraps it as
  ``Shard(1)`` again. Gradients travel back the same way, same shapes.
- Context parallelism, experts (EP) and tied embeddings on the stages:
  :mod:`meshplan.runtime.execution.pipelined_stage` (the first stage embeds this cp rank's chunks, the
  activation between stages is (b, s/cp[/tp], h); the tied copies' gradients are all-reduced
  over the embedding group after the schedule). :func:`~meshplan.runtime.execution.buildable.unsupported_pipeline` names what is refused.
- :class:`PipelineRunner`: one step = ``schedule.step(tokens, target=labels, losses=...)``
  (``mesh.pp_schedule``: the registered schedule's ``torch_class``, :mod:`meshplan.pipeline`:
  gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B, interleaved_1f1b -> ScheduleInterleaved1F1B,
  zbv -> ScheduleZBVZeroBubble, dualpipev -> ScheduleDualPipeV; those with ``runs_in_validate``)
  with the plan's micro-batch count (``training.pp_schedule_runs`` > 1: that many ``schedule.step``
  calls, each over its share of the micro-batches, as torchtitan accumulates gradients under pp:
  FSDP reduces and reshards after each); the loss function (cross entropy)
  runs on the last stage inside the schedule (under ``loss_parallel()`` when the logits are
  vocabulary-sharded; its collectives are phase ``loss``), backward too; then AdamW.
- Memory (:meth:`PipelineRunner.memory_tracker`): FSDPMemTracker / MemTracker work under a
  schedule once each stage module's tracker entry is restarted before each micro-batch's
  forward (MemTracker refuses a second forward of a root module, "multiple iterative calls").
- :class:`~meshplan.runtime.execution.pipelined_recorder.PipelineRecorder`, how the pipeline's
  point-to-point ops and FSDP's unshards under the schedule are named and phased:
  :mod:`meshplan.runtime.execution.pipelined_recorder` (:func:`~meshplan.runtime.execution.pipelined_recorder.instrument`
  wraps each stage).

The step's times: the whole schedule (forward, loss and backward interleaved across
micro-batches) is reported as ``forward``; ``loss`` and ``backward`` are 0 (they cannot be
separated on one rank without hooks in every micro-batch).
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from meshplan.errors import ConfigError
from meshplan.pipeline.registry import get
from meshplan.runtime.execution.buildable import unsupported_pipeline as unsupported  # callers' name
from meshplan.runtime.execution.kvsync import kv_replica_sync
from meshplan.runtime.execution.model import Transformer
from meshplan.runtime.execution.pipelined_recorder import PipelineRecorder, instrument
from meshplan.runtime.execution.pipelined_stage import (  # noqa: F401
    StageModule,
    init_stage_weights,
    parallelize_stage,
    tied_embedding_sync,
)
from meshplan.runtime.execution.trainstep import adamw


def build_stages(plan: dict, model_spec, training, mesh, dm, vocab: int, seed: int, device: str):
    """(stage modules, PipelineStage objects, schedule, expert DeviceMesh or None) of this
    rank; weights initialised."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    schedule = plan["input"]["mesh"]["pp_schedule"]
    why = unsupported(mesh, training, schedule, model_spec)
    if why:
        raise ConfigError("mesh", why)
    pp = mesh.degree("pp")
    k = dm.get_local_rank("pp")
    stages_layers = plan["mesh"]["stages"]
    vpp = len(stages_layers[k])
    n_virtual = pp * vpp
    tp, cp = mesh.degree("tp"), mesh.degree("cp")
    sp = tp > 1 and mesh.sequence_parallel
    with torch.device("meta"):
        full = Transformer(model_spec, vocab=vocab, tp=tp, recompute=training.recompute == "full")
    modules = []
    sched_obj = get(schedule)  # its chunk map: looped c * pp + k, or a V (zbv, dualpipev)
    for c, layers in enumerate(stages_layers[k]):
        v = int(sched_obj.virtual_stage(c, k, pp, vpp))
        modules.append(StageModule(full, layers, first=v == 0, last=v == n_virtual - 1, seq_split=tp if sp else 1))
    # torchtitan's order: cp, TP, EP on the stage, then FSDP2, then PipelineStage
    expert_mesh = parallelize_stage(modules, mesh, training, dm, loss_parallel(plan, mesh), device)
    init_stage_weights(full, seed)
    b, s, h = training.micro_batch, training.seq_len // cp, model_spec.hidden
    # requires_grad: static mode derives the gradient buffers from these (none without it).
    # Between stages runs the residual stream as apply_tp leaves it: a plain tensor (the
    # row-parallel outputs use_local_output) of this cp rank's s/cp tokens, under SP this
    # rank's sequence shard (b, s/cp/tp, h).
    act = torch.empty(b, s // tp if sp else s, h, device="meta", requires_grad=True)
    group = dm["pp"].get_group()
    pstages = []
    for c, m in enumerate(modules):
        v = int(sched_obj.virtual_stage(c, k, pp, vpp))
        inp = torch.empty(b, s, dtype=torch.long, device="meta") if v == 0 else act
        out = torch.empty(b, s, vocab, device="meta", requires_grad=True) if v == n_virtual - 1 else act
        pstages.append(PipelineStage(m, v, n_virtual, torch.device(device), input_args=(inp,), output_args=(out,),
                                     group=group))
    # training.pp_schedule_runs: the step's micro-batches as that many schedule.step() calls (torchtitan's
    # gradient accumulation under pp), each schedule over its share
    micro = plan["mesh"]["micro_batches"] // training.pp_schedule_runs
    cls = getattr(S, get(schedule).torch_class)
    loss = StageLoss()
    if issubclass(cls, S.PipelineScheduleMulti):  # torch's multi-stage schedules take every local stage
        sched = cls(pstages, micro, loss_fn=loss)
    else:
        if len(pstages) != 1:
            raise ConfigError("mesh.pp_schedule", f"{schedule} runs one stage per rank; vpp is {vpp}")
        sched = cls(pstages[0], micro, loss_fn=loss)
    sched.meshplan_loss = loss
    sched.meshplan_splits_backward = get(schedule).splits_backward
    sched.meshplan_tied = tied_embedding_sync(modules, mesh, dm)
    sched.meshplan_kv = kv_replica_sync(modules, model_spec, mesh)  # tp > kv_heads: KV copies summed
    return modules, pstages, sched, expert_mesh


def loss_parallel(plan: dict, mesh) -> bool:
    """Whether the last stage keeps its logits sharded over the vocabulary (tp > 1 and the
    plan's ``mesh.loss_parallel``, default true)."""
    return mesh.degree("tp") > 1 and bool(plan["input"]["mesh"].get("loss_parallel", True))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy of one micro-batch (the schedule scales gradients by 1 / micro-batches).
    ``logits`` (b, s, V), a DTensor sharded over V under loss parallel (the caller holds
    ``torch.distributed.tensor.parallel.loss_parallel()``); ``labels`` (b, s) int64."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class StageLoss:
    """:func:`loss_fn` as the schedule's ``loss_fn``; ``before`` (when set) runs first, so the
    runner can label the loss's collectives (phase ``loss``, as the plan's table has them)."""

    def __init__(self):
        self.before = None

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.before is not None:
            self.before()
        with record_function("loss"):
            return loss_fn(logits, labels)



class PipelineRunner:
    """The worker's Runner for pp > 1: one schedule step per training step."""


    def __init__(self, modules, pstages, sched, training, mesh, rank, vocab, seed, status, device, micro: int,
                 loss_parallel_on: bool = False):
        self.modules, self.pstages, self.sched = modules, pstages, sched
        self.model = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
        self.training, self.mesh, self.rank = training, mesh, rank
        self.vocab, self.seed, self.status, self.device = vocab, seed, status, device
        self.opt = adamw(self.model.parameters(), training)
        self.micro = micro
        self.has_first = any(s.is_first for s in pstages)
        self.has_last = any(s.is_last for s in pstages)
        self.loss_parallel = self.has_last and loss_parallel_on
        self.rec: Optional[PipelineRecorder] = None
        self.tracker = None  # the MemTracker of memory_tracker(), while the worker uses it
        self.ops: list[tuple[str, int, int]] = []  # this step's computations in order (pipelined_recorder.instrument)
        self._index = 0
        for s in pstages:
            instrument(s, self)
        sched.meshplan_loss.before = lambda: self.set_phase("loss")

    def memory_tracker(self):
        """(tracker, name) for the worker's memory step: FSDPMemTracker on a single FSDP2
        stage module, else MemTracker over every stage module and the optimizer. Each stage
        module's tracker entry is restarted before each of its micro-batch forwards (see
        :func:`instrument`), so the per-module snapshots are the last micro-batch's; the
        peak snapshot covers the whole step. Refused (NotImplementedError, the worker then
        samples the resident set) under a schedule that splits the backward."""
        from torch.distributed._tools.mem_tracker import MemTracker
        from torch.distributed.fsdp import FSDPModule

        # refused before the step: a step that fails inside the schedule leaves FSDP units unsharded
        if getattr(self.sched, "meshplan_splits_backward", False):
            raise NotImplementedError("MemTracker's module hooks break a split backward (torch 2.13: the input-gradient "
                                      "autograd.grad meets their multi-grad hooks, 'A leaf node was passed to "
                                      "_will_engine_execute_node'); ZB-V and DualPipeV are measured by resident set")
        if isinstance(self.model, FSDPModule):
            from meshplan.runtime.execution.memtracker import UnitMemTracker  # units of several modules

            self.tracker, name = UnitMemTracker(self.model, self.opt), "FSDPMemTracker"
        else:
            self.tracker, name = MemTracker(), "MemTracker"
            self.tracker.track_external(self.model, self.opt)
        return self.tracker, name

    def recorder(self) -> PipelineRecorder:
        self.rec = PipelineRecorder()
        return self.rec

    def set_phase(self, phase: str) -> None:
        self.status.set(self._index, phase)
        if self.rec is not None:
            self.rec.phase = phase

    def step(self, index: int, rec=None) -> dict:
        from meshplan.runtime.execution.cp import rank_chunks
        from meshplan.runtime.execution.trainstep import batch

        self._index = index
        if rec is None:
            self.rec = None
        tokens, labels = zip(*(rank_chunks(self.mesh, self.rank,  # cp: this rank's chunks (runtime.cp)
                                           *batch(self.training, self.mesh, self.rank, index, mb, self.vocab, self.seed))
                               for mb in range(self.micro)))
        tokens, labels = torch.cat(tokens).to(self.device), torch.cat(labels).to(self.device)
        losses: list = []
        self.ops = []
        self.set_phase("schedule")  # before the first stage computation (FSDP unshard: label_unshard)
        t_step = time.perf_counter()
        lp = contextlib.nullcontext()
        if self.loss_parallel:  # the last stage's loss and its backward run inside the schedule
            from torch.distributed.tensor.parallel import loss_parallel as lp_ctx

            lp = lp_ctx()
        runs = self.training.pp_schedule_runs  # one schedule.step() per run, as torchtitan accumulates under pp
        with record_function("schedule"), lp:
            for j in range(runs):
                part = slice(j * len(tokens) // runs, (j + 1) * len(tokens) // runs)
                self.sched.step(*((tokens[part],) if self.has_first else ()),
                                **(dict(target=labels[part], losses=losses) if self.has_last else {}))
        t_sched = time.perf_counter() - t_step
        self.set_phase("step")
        self.status.set(index, "optimizer")
        t0 = time.perf_counter()
        with record_function("optimizer"):
            if self.sched.meshplan_tied is not None:  # tied embedding: the two copies' gradients summed
                self.sched.meshplan_tied()
            if self.sched.meshplan_kv is not None:  # replicated KV heads: the copies' gradients summed
                self.sched.meshplan_kv()
            self.opt.step()
            self.opt.zero_grad()
        t_opt = time.perf_counter() - t0
        losses = [x.to_local() if hasattr(x, "to_local") else x for x in losses]  # DTensor under loss parallel
        loss = sum(float(x.detach()) for x in losses) / len(losses) if losses else None
        recorded, self.rec = self.rec is not None, None
        return {"step": index, "step_s": time.perf_counter() - t_step,
                "phases_s": {"forward": t_sched, "loss": 0.0, "backward": 0.0, "optimizer": t_opt},
                "loss": loss, "micro_batches": self.micro, "pipeline_stages": [s.stage_index for s in self.pstages],
                "note": "forward: the whole pipeline schedule (forward, loss, backward of every micro-batch)",
                **({"ops": [list(o) for o in self.ops]} if recorded else {})}


def build_runner(plan: dict, model_spec, training, mesh, dm, rank: int, vocab: int, seed: int, status, device: str):
    """(model for start-up shapes, runner) of this rank for a pp > 1 plan."""
    modules, pstages, sched, expert_mesh = build_stages(plan, model_spec, training, mesh, dm, vocab, seed, device)
    runner = PipelineRunner(modules, pstages, sched, training, mesh, rank, vocab, seed, status, device,
                            plan["mesh"]["micro_batches"], loss_parallel(plan, mesh))
    if expert_mesh is not None:  # the worker checks its groups at start-up
        runner.model.expert_mesh = expert_mesh
    return runner.model, runner
