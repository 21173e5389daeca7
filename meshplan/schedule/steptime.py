"""Step time of a :class:`~meshplan.plan.Plan`: unit timelines (:mod:`meshplan.schedule.rank_timeline`)
put through the pipeline simulation (:mod:`meshplan.pipeline.simulate`), then the step-level
collectives and the optimizer step; critical path, exposed communication per axis, bubble,
tokens/s, MFU and HFU, and the Chrome/Perfetto trace of the predicted timeline.

Pipeline sends block their stage under Megatron-LM and torch's single-stage GPipe and 1F1B
(:func:`~meshplan.schedule.overlap_policy.p2p_mode`; with Megatron-LM's
``overlap_p2p_comm``, ``training.pp_p2p_overlap``, the interleaved steady state's are asynchronous and a unit waits
for its input's transfer just before it, the part of that wait up to one transfer exposed on "pp"): each call holds its
stage until the peer stage posts its side and the transfer ends (``hold``); of a hold only the
transfers (``k x p2p``) are exposed on "pp", the wait for the peer is bubble (:func:`~meshplan.schedule.pipeline_exposure.pp_hold_split`,
:meth:`~meshplan.schedule.step_summary.StepTime.parts_s`). Each
stage ends at its last unit plus that unit's communication tail (or its blocking call), then (in order) the
per-step gradient reduction when it was not overlapped, the optimizer step and the
ZeRO-1/2 parameter all-gather (``Overlap.param_gather``: its buckets after the first hidden
behind the next step's first forward unit, the remainder exposed: :func:`~meshplan.schedule.step_end.param_gather_exposed_s`). The optimizer step is memory-bound: it reads
all persistent state of the rank (:mod:`meshplan.memory.state`) and writes all but the
gradients, at achievable bandwidth (:func:`meshplan.compute.kernel_time.optimizer_bandwidth`). Step time = the latest stage end.

MFU uses model FLOP (:func:`meshplan.compute.flops.sequence_model_flops` x global batch: causal
half attention, no recompute); HFU the FLOP each rank executes (recompute, full non-flash
attention, replicated KV heads, padded vocabulary), both over ``step x world x peak``. Under
framework torch, also the MFU torchtitan would log for the predicted step, by its own formula
(:func:`meshplan.compute.flops.torchtitan_mfu`); under framework megatron, the throughput per GPU
Megatron-LM's ``--log-throughput`` would log, by its own formula
(:func:`meshplan.compute.flops.megatron_flops_per_iteration`).

This module runs the whole step (:func:`step_time`); its parts live beside it, in flow order:
:mod:`~meshplan.schedule.workload` (the per-rank workload and chunk costs),
:mod:`~meshplan.schedule.overlap_policy` (what the config lets overlap),
:mod:`~meshplan.schedule.unit_times` (the unit timelines, keyed),
:mod:`~meshplan.schedule.pipeline_exposure` (bubble, exposure and blocking-call accounting over the
simulated pipeline), :mod:`~meshplan.schedule.optimizer_step` and :mod:`~meshplan.schedule.step_end`
(the step-end ops), :mod:`~meshplan.schedule.step_summary` (the :class:`StepTime` result and its
lines), :mod:`~meshplan.schedule.tp_overlap_lines` (the TP-overlap comparison lines).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import numpy as np

from meshplan.comm.deepspeed_zero12 import check_schedule
from meshplan.comm.pp_rows import boundary_links, boundary_seconds
from meshplan.compute.gemm import GemmTable
from meshplan.compute.recompute import op_replays_ep
from meshplan.compute.flops import (flop_gap, megatron_flops_per_iteration, sequence_model_flops,
                                    torchtitan_flops_per_token, torchtitan_flops_words,
                                    torchtitan_peak_flops)
from meshplan.errors import ConfigError
from meshplan.schedule.ep_sync import ep_sync_note
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.pipeline.fast import Flat, simulate_arrays
from meshplan.pipeline.registry import check_framework
from meshplan.pipeline.simulate import PipelineSpec
from meshplan.pipeline.unshard_window import pipeline_window
from meshplan.plan import Infeasible, Plan, table_key, table_stage
from meshplan.plan_runtime import p2p_note, run_reasons, runtime_warnings
from meshplan.schedule.overlap_policy import config_overlap, p2p_mode, plan_overlap  # noqa: F401 (config_overlap: re-exported)
from meshplan.schedule.pipeline_exposure import ends_of, last_hold, last_transfer_s, unit_exposure, call_seconds, run_shift
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes, nccl_sm_share
from meshplan.schedule.backward_pass import backward_unit
from meshplan.schedule.rank_timeline import forward_unit
from meshplan.schedule.unit_sim import ChunkCosts, Overlap
from meshplan.schedule.step_end import later_runs_label, stage_end
from meshplan.schedule.step_summary import StepTime
from meshplan.schedule.unit_times import UnitTimes
from meshplan.schedule.window_unshard import simulate_unshards
from meshplan.schedule.workload import chunk_costs, workload_of
from meshplan.spec.mesh import Schedule
from meshplan.spec.mesh_words import mesh_text
from meshplan.spec.recompute_words import recompute_words
from meshplan.spec.wording import runtime, stream_words
from meshplan.units import counted


def step_time(plan: Plan, overlap: Overlap = Overlap(), *, dropout: bool = False, table: Optional[GemmTable] = None,
              schedule: Optional[str] = None) -> StepTime:
    """Predict one step of a feasible ``plan`` (see the module docstring). ``schedule``
    overrides the config's ``pp_schedule``; ``table``: measured GEMM times. TP collectives
    overlap compute when ``overlap.tp`` or ``training.tp_comm_overlap`` (default: they block)."""
    if isinstance(plan, Infeasible):
        raise ValueError("step_time needs a resolved plan with stages; this one is infeasible: "
                         + "; ".join(plan.reasons))
    cfg, w = plan.config, workload_of(plan, dropout)
    p, v, m = len(plan.stages), plan.vpp, plan.micro_batches
    runs = plan.schedule_runs  # training.pp_schedule_runs: the schedule simulated once, over m / runs micro-batches
    if schedule is not None:  # the config's own schedule was checked by build_plan; this one's rules likewise
        _check_schedule(cfg.training, schedule, p, m, v, runs)
    mr = m // runs
    overlap = plan_overlap(cfg, [r for rows in plan.collectives.values() for r in rows], overlap)
    # each stage's table (plan.table_stage) and layers, read without building Stage views (a
    # plan of the search's step-only path has no memory timelines)
    comms = _stage_comms(plan, p, nccl_sm_share(cfg.cluster))
    chunks = chunk_costs(plan, w, table)
    spec, units = _pipeline_units(plan, schedule, mr, comms, chunks, w, overlap)
    indexed: list = []

    def durations(f: Flat) -> np.ndarray:
        keys, idx = units.index(f)
        indexed[:] = [keys, idx]
        return np.array([units.by_key(k).duration_s for k in keys])[idx]

    res = simulate_unshards(spec, units, durations)  # torch's window re-gathers wait for their UNSHARD
    run_s = run_shift(res, units) if runs > 1 else 0.0
    ends, post, exposed = _stage_ends(plan, res, spec, units, comms, overlap, run_s, runs)
    crit = max(range(p), key=lambda s: ends[s])
    if not indexed:
        indexed[:] = list(units.index(res.flat))
    for k, x in unit_exposure(res, crit, units, indexed[0], indexed[1], {}).items():
        exposed[crit][k] = exposed[crit].get(k, 0.0) + runs * x  # every run exposes what the first does
    model_total, hw, gap = _step_flops(cfg, chunks, m, plan.world, p)
    t = cfg.training
    ranks = tuple(plan.mesh.group_of(0, "pp")) if "pp" in plan.mesh.layout.names else (0,)
    notes = _step_notes(plan, comms, schedule, runs, mr, run_s) + ep_sync_note(plan, crit)
    return StepTime(res, units, tuple(ends), tuple(post), exposed[crit],
                    model_total, hw, t.global_batch * t.seq_len,
                    plan.world, cfg.cluster.gpu.peak_flops(t.peak_dtype), ranks, notes,
                    "; ".join(w for w in (recompute_words(t, runtime(t, cfg.origin), replays_ep=op_replays_ep(cfg.model, t)),
                                          t.block_layers_text(plan.stages)) if w),
                    (indexed[0], indexed[1]), t.peak_dtype, tuple(gap.items()), runs,
                    tuple(stream_words(t, cfg.origin).items()),
                    mesh_text(plan.mesh.layout.names, plan.mesh.layout.shape, t.sharding, plan.mesh.ep, plan.mesh.etp),
                    *_torchtitan_terms(cfg), _megatron_flops(cfg, plan), tt_words=torchtitan_flops_words(cfg.model),
                    compute_peak_flops=cfg.cluster.gpu.peak_flops(t.compute_dtype) if t.peak_dtype != t.compute_dtype
                    else 0.0, compute_dtype=t.compute_dtype)


def _pipeline_units(plan: Plan, schedule: Optional[str], mr: int, comms: list[CommTimes], chunks, w,
                    overlap: Overlap) -> tuple[PipelineSpec, UnitTimes]:
    """(the pipeline to simulate over ``mr`` micro-batches, its units' timelines): the schedule
    (``schedule``, else the config's) with the p2p mode of the framework's runtime (DeepSpeed's
    PipelineEngine: one blocking ``dist.send`` / ``dist.recv`` per transfer, compute.deepspeed_pipe),
    each stage boundary's send seconds and link (:func:`boundary_p2p_s`), and each unit's
    duration from its rank timeline (:class:`~meshplan.schedule.unit_times.UnitTimes`)."""
    cfg, p, v = plan.config, len(plan.stages), plan.vpp
    mode = p2p_mode(cfg.training, Schedule(schedule or plan.spec.pp_schedule))
    # DeepSpeed's PipelineEngine: one blocking dist.send / dist.recv per transfer (compute.deepspeed_pipe)
    serial = mode.blocking_p2p and cfg.training.pp_engine == "deepspeed"
    p2p_s, p2p_link, p2p_pair_s = boundary_p2p_s(plan, comms)
    base = PipelineSpec(Schedule(schedule or plan.spec.pp_schedule), p, mr, v, p2p_s=p2p_s, p2p_link=p2p_link,
                        p2p_pair_s=p2p_pair_s, serial_p2p=serial, **mode._asdict())
    units = UnitTimes(base, chunks, comms, w, overlap, cfg.training.reshard_after_forward,
                      cfg.training.sharding in ("zero3", "hsdp"), cfg.training.grad_accumulation,
                      cfg.training.reshard_head_after_forward, pipeline_window(cfg.training.framework, p))
    spec = PipelineSpec(base.schedule, p, mr, v, p2p_s=base.p2p_s, p2p_link=base.p2p_link,
                        p2p_pair_s=base.p2p_pair_s, serial_p2p=serial, **mode._asdict(),
                        duration=lambda s, u: units.get(s, u.chunk, u.kind, u.mb).duration_s)
    return spec, units


def _stage_ends(plan: Plan, res, spec: PipelineSpec, units: UnitTimes, comms: list[CommTimes], overlap: Overlap,
                run_s: float, runs: int) -> tuple[list, list, list]:
    """Per stage of the simulated pipeline ``res``: (its step end in seconds, the events after its
    last unit, its exposed communication per stream), from :func:`~meshplan.schedule.step_end.stage_end`
    with its last hold and, where the pipeline's calls were timed on shared links, its last transfer."""
    ends, post, exposed = [], [], []
    memo: dict = {}
    loads = call_seconds(res) if res.hold is not None else None
    for s, mine in enumerate(ends_of(res)):
        last_xfer = last_transfer_s(res, s, loads) if loads is not None else 0.0
        end, ev, ex = stage_end(plan, s, spec, mine, units, comms[s], overlap, last_hold(res, s), memo, run_s, runs,
                                 last_xfer)
        ends.append(end)
        post += ev
        exposed.append(ex)
    return ends, post, exposed


def _step_flops(cfg, chunks, m: int, world: int, p: int) -> tuple[float, float, dict]:
    """(the model's FLOP per step, the FLOP the ranks execute, the executed FLOP beyond the model's
    by reason: :func:`_executed_flops`). With ``training.moe_hottest_expert_share`` every rank's
    expert GEMMs are the busiest ep rank's (compute.shapes: the hottest expert's rows), the model
    FLOP the balanced count: the rest of HFU over MFU is that extra work."""
    hw, gap = _executed_flops(chunks, m, world, p)
    t = cfg.training
    model_total = _sequence_flops(cfg.model, t.seq_len) * t.global_batch
    if t.moe_hottest_expert_share and hw - model_total - sum(gap.values()) > 0:
        # every rank's expert GEMMs are the busiest ep rank's (compute.shapes: the hottest expert's
        # rows), the model FLOP the balanced count: the rest of HFU over MFU is that extra work
        gap[HOT_EXPERT_GAP] = hw - model_total - sum(gap.values())
    return model_total, hw, gap


def boundary_p2p_s(plan: Plan, comms: list[CommTimes]) -> tuple:
    """(seconds of one pp send across each stage boundary, :attr:`~meshplan.pipeline.sim_types.PipelineSpec.p2p_s`;
    each boundary's link, :attr:`~meshplan.pipeline.sim_types.PipelineSpec.p2p_link`; seconds of
    two such sends at once, :attr:`~meshplan.pipeline.sim_types.PipelineSpec.p2p_pair_s`): each
    boundary's pairs on their own path at the size of the tables' send/recv rows
    (:func:`meshplan.comm.pp_rows.boundary_seconds`: NVLink where the two stages share a node, the
    sender's NIC where not; :func:`meshplan.comm.pp_rows.boundary_links`), plus the tp all-gather
    rebuilding a receive under Megatron-LM's scatter/gather (``p2p_gather_s``, the same at every
    boundary); two at once (a blocking call's two sends, or two receives, on one link: interleaved
    1F1B's steady call) as one transfer of both sizes on the same path, their two gathers, never
    more than two apart (:func:`meshplan.pipeline.rendezvous.link_load`); one value and no links
    when every boundary takes the same time on the same link (then the simulation's one-value
    path), 0 and no pair time at pp 1."""
    sizes = [r.size_bytes for r in plan.collectives[table_key(0)] if comm_kind(r) == "pp"]
    if len(comms) < 2 or not sizes:
        return max((c.p2p_s + c.p2p_gather_s for c in comms), default=0.0), (), None
    gather = max(c.p2p_gather_s for c in comms)
    one, two = (boundary_seconds(plan.mesh, plan.placement, plan.config.cluster, k * max(sizes)) for k in (1, 2))
    times = [t + gather for t in one.tolist()]
    pairs = [min(t2 + 2 * gather, 2 * t) for t2, t in zip(two.tolist(), times)]
    links = tuple(boundary_links(plan.mesh, plan.placement).tolist())
    if len(set(times)) == 1 and len(set(links)) == 1 and len(set(pairs)) == 1:
        return times[0], (), pairs[0]
    return tuple(times), links, tuple(pairs)


def _stage_comms(plan: Plan, p: int, share) -> list[CommTimes]:
    """Each stage's :class:`CommTimes` from its collective table (:func:`~meshplan.plan.table_stage`)
    and layer count, one per distinct pair: the middle stages share stage 1's table, so at pp 128
    three are built, not 128 (read-only after :meth:`CommTimes.from_rows`)."""
    built: dict[tuple[int, int], CommTimes] = {}
    out = []
    for s in range(p):
        key = (table_stage(s, p), sum(map(len, plan.stages[s])))
        if key not in built:
            built[key] = CommTimes.from_rows(plan.collectives[table_key(key[0])], key[1], share)
        out.append(built[key])
    return out


def _torchtitan_terms(cfg) -> tuple[float, float]:
    """(FLOP per token, peak FLOP/s) of torchtitan's logged MFU under framework torch, its dense or MoE
    formula by the model (:func:`~meshplan.compute.flops.torchtitan_flops_per_token`,
    :func:`~meshplan.compute.flops.torchtitan_peak_flops`); (0, 0) otherwise: no line."""
    if cfg.training.framework != "torch":
        return (0.0, 0.0)
    return torchtitan_flops_per_token(cfg.model, cfg.training.seq_len), torchtitan_peak_flops(cfg.cluster.gpu.name)


def _megatron_flops(cfg, plan: Plan) -> float:
    """FLOP per iteration of Megatron-LM's ``--log-throughput`` under framework megatron
    (:func:`~meshplan.compute.flops.megatron_flops_per_iteration`, over the vocabulary padded as
    Megatron pads it at the plan's tp); 0 otherwise: no line."""
    t = cfg.training
    if t.framework != "megatron":
        return 0.0
    vocab = padded_vocab(cfg.model.vocab, t.vocab_pad_divisor, plan.mesh.degree("tp"))
    return megatron_flops_per_iteration(cfg.model, t.global_batch, t.seq_len, vocab)


def _check_schedule(training, schedule: str, p: int, m: int, v: int, runs: int) -> None:
    """``step --schedule``'s rules, as build_plan checks the config's own (ConfigError naming the
    field otherwise)."""
    check_framework(schedule, training.framework, p, "--schedule")
    check_schedule(training, schedule, p, "--schedule")  # DeepSpeed's ZeRO-1/2 engine: 1F1B only
    bad = run_reasons(schedule, p, m, v, runs, training.framework)
    if bad:
        raise ConfigError("mesh.pp_schedule", bad[0])


#: HFU above MFU's cause under ``training.moe_hottest_expert_share``: the step times every rank as
#: the busiest ep rank (its hottest expert's rows, :func:`meshplan.compute.shapes.layer_gemms`), the
#: model FLOP count balanced routing.
HOT_EXPERT_GAP = "the busiest ep rank's extra expert rows (moe_hottest_expert_share, every rank timed as it)"


def _executed_flops(chunks: list[list[ChunkCosts]], m: int, world: int, p: int) -> tuple[float, dict[str, float]]:
    """(FLOP every rank executes per step, summed over the world: the HFU numerator; the FLOP of
    hardware above model per cause, :func:`meshplan.compute.flops.flop_gap`) from ``[stage][chunk]``
    costs (:func:`~meshplan.schedule.workload.chunk_costs`), ``m`` micro-batches, ``p`` stages."""
    hw = sum(m * sum(sum(x.flops("hardware") for x in ch.layers)
                     + sum(x.flops("hardware") for x in (ch.embed, ch.head) if x is not None) for ch in stage)
             for stage in chunks) * world // p
    gap: dict[str, float] = {}
    for stage in chunks:
        for ch in stage:
            for cause, f in flop_gap(o for x in (*ch.layers, ch.embed, ch.head) if x is not None for o in x.ops).items():
                gap[cause] = gap.get(cause, 0.0) + m * f * world / p
    return hw, gap


def _step_notes(plan: Plan, comms: list[CommTimes], schedule: Optional[str], runs: int, mr: int,
                run_s: float) -> tuple[str, ...]:
    """The step's notes: collectives not simulated, the runtime's warnings for the schedule run,
    the later schedule runs (``runs`` of ``mr`` micro-batches, ``run_s`` apart), DeepSpeed ZeRO-3
    2021's host time and FSDP2's copies on the compute stream."""
    cfg, t, p = plan.config, plan.config.training, len(plan.stages)
    notes = tuple(f"collective not simulated (kind unknown): {o}" for o in sorted({o for c in comms for o in c.other}))
    # plan's notes say it for its own schedule
    notes += runtime_warnings(t, schedule or plan.spec.pp_schedule, plan.mesh, cfg.model)
    notes += p2p_note(t, schedule or plan.spec.pp_schedule, p)
    if runs > 1:
        notes += (f"{runs} pipeline schedule runs of {counted(mr, 'micro-batch')} per step (training.pp_schedule_runs: "
                  f"torchtitan's gradient accumulation under pp): each fills and drains the pipeline, gathers "
                  f"and reduce-scatters the FSDP units; the timeline shows run 1, {later_runs_label(runs)} follow"
                  f"{'s' if runs == 2 else ''} it {run_s * 1e3:.3f} ms apart",)
    host = [sum(v * (c.layers if g == "layer" else 1) for (g, _), v in c.host.items()) for c in comms]
    if any(host):
        notes += (f"DeepSpeed ZeRO-3 (2021) host time on the compute stream: {max(host) * 1e3:.1f} ms per "
                  f"micro-batch (stage {host.index(max(host))}): each per-parameter gather's partition views and list "
                  f"copies issued and its zero fill waited for, each gradient bucket's calls issued "
                  f"(meshplan.comm.deepspeed)",)
    notes += expert_dtype_note(t, cfg.model) + compiled_ring_note(t, plan.mesh.degree("cp"))
    copies = [sum(r.copy_s * r.per_step for r in plan.collectives[table_key(table_stage(s, p))])
              for s in range(p)]
    if any(copies):
        notes += (f"FSDP2 copies on the compute stream: {max(copies) * 1e3:.1f} ms per step (stage "
                  f"{copies.index(max(copies))}): the copy-out after each all-gather and the copy-in before each "
                  f"reduce-scatter (meshplan.comm.fsdp2)",)
    return notes


def compiled_ring_note(t, cp: int) -> tuple[str, ...]:
    """Under ``torch_compile`` with torch's ring attention at ``cp`` > 1: why the exposed cp holds every
    backward ring collective (:func:`meshplan.schedule.ring_timeline.compiled_ring_backward`), where
    eager hides all but each layer's last dK/dV shift (newcomer trial nc59 #2: Llama-3-8B at seq 131072,
    cp 8, exposed cp 49.2 ms eager, 574.5 ms compiled, and no word why).

    >>> from meshplan.spec.training import TrainingSpec
    >>> [len(compiled_ring_note(TrainingSpec(global_batch=8, seq_len=16, **kw), cp)) for kw, cp in (
    ...  ({"torch_compile": True}, 8), ({"torch_compile": True}, 1), ({}, 8), ({"torch_compile": True,
    ...  "cp_attention": "allgather"}, 8))]
    [1, 0, 0, 0]
    """
    if cp <= 1 or t.framework != "torch" or not t.torch_compile or not t.cp_ring:
        return ()
    kv = f"its {cp - 1} K/V shifts" if t.cp_rotate == "alltoall" else "its K/V all-gather"
    return (f"torch.compile and torch's ring attention: each layer's ring backward, traced into the compiled "
            f"block, waits for every cp collective where it is issued ({kv} and its {cp} fp32 dK/dV shifts), so "
            f"all of them are in exposed cp; eager, each runs beside the next SDPA call and only the layer's last "
            f"dK/dV shift is exposed (functional collectives' immediate wait_tensor under tracing, read in "
            f"inductor's generated backward on CPU, not measured on a GPU: "
            f"meshplan.schedule.ring_timeline.compiled_ring_backward)",)


def expert_dtype_note(t, model) -> tuple[str, ...]:
    """Under ``linear_dtype = "fp8"`` with routed experts: the experts' grouped GEMMs are timed in the
    compute dtype (:meth:`~meshplan.spec.training.TrainingSpec.float8_linear` converts ``nn.Linear``
    weights only), as torchtitan's ``quantize.linear.float8`` runs them; its ``quantize.grouped_mm.float8``
    (torchao's fp8 grouped GEMMs of the routed experts) and Megatron-LM's fp8 grouped linear are not
    modelled: the catalog (``kernels.toml``) has no measured fp8 grouped-GEMM rate (newcomer 48)."""
    if t.linear_dtype != "fp8" or not model.is_moe:
        return ()
    conv = ("torchtitan's quantize.grouped_mm.float8 converter" if t.framework == "torch" else
            "Megatron-LM's fp8 grouped linear under --fp8-format")
    return (f"float8: the routed experts' grouped GEMMs are timed in {t.compute_dtype} (the float8 converter "
            f"converts nn.Linear layers only); {conv}, which runs them in fp8, is not modelled: the catalog has "
            f"no measured fp8 grouped-GEMM rate",)


@lru_cache(maxsize=16)
def _cached_flops(model, seq_len: int) -> float:
    return sequence_model_flops(model, seq_len)


def _sequence_flops(model, seq_len: int) -> float:
    """:func:`~meshplan.compute.flops.sequence_model_flops`, once per (model, sequence length)
    (it walks every layer; the search asks for it once per planned candidate)."""
    try:
        return _cached_flops(model, seq_len)
    except TypeError:  # a model with an unhashable field
        return sequence_model_flops(model, seq_len)


def layer_unit_times(plan, dropout: bool = False, overlap: Overlap = Overlap()) -> tuple[float, float]:
    """(forward, backward) seconds of ONE layer of stage 0 for one micro-batch, with its
    blocking collectives: the per-layer figures papers publish (Korthikanti et al. 2022,
    Table 4)."""
    w = workload_of(plan, dropout)
    ch = chunk_costs(plan, w)[0][0]
    one = ChunkCosts(ch.layers[:1], ch.moe[:1])
    comm = CommTimes.from_rows(plan.stage(0).collectives, sm_share=nccl_sm_share(plan.config.cluster))
    overlap = plan_overlap(plan.config, plan.stage(0).collectives, overlap)
    return forward_unit(one, comm, w, overlap).duration_s, backward_unit("B", one, comm, w, overlap).duration_s
