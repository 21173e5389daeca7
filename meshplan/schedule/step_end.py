"""What each stage does after its last pipeline unit (:func:`stage_end`): the later schedule
runs, Megatron-LM 2022's p2p calls' host syncs (:func:`megatron_p2p_syncs_s`), the per-step
gradient reduction when not overlapped, the replicated KV heads'
all-reduces, the optimizer step (:func:`_optimizer_s`; under ZeRO-Offload the host step and its copies,
:func:`meshplan.schedule.offload_step.offload_steps`), torchao's float8 amax precompute and
its all-reduces (:func:`float8_precompute_s`), Transformer Engine's fp8 weight casts under
Megatron-LM (:func:`te_fp8_cast_s`), and the ZeRO-1/2 parameter all-gather
(:func:`param_gather_exposed_s`), each a step-end event with its exposure.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from meshplan.comm.megatron_buckets import CHUNK0_MARK
from meshplan.compute import float8_fsdp
from meshplan.compute.kernel_time import issue_floor, optimizer_bandwidth
from meshplan.compute.megatron_cost import megatron_stage_step_cost, p2p_calls, p2p_sync_cost
from meshplan.memory import te_fp8
from meshplan.mesh.layers import last_stage
from meshplan.mesh.tpsplit import KV_REPLICA, local_numel
from meshplan.pipeline.simulate import Event
from meshplan.plan import table_key, table_stage
from meshplan.schedule.offload_step import offload_steps
from meshplan.schedule.optimizer_step import optimizer_step_s
from meshplan.schedule.pipeline_exposure import stage_run_end
from meshplan.schedule.comm_streams import step_stream
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.workload import workload_of
from meshplan.units import dtype_bytes


def _optimizer_s(plan, s: int, memo: Optional[dict] = None) -> float:
    """The optimizer step's bulk passes and, under Megatron-LM, its per-step kernels and syncs
    (:func:`meshplan.compute.megatron_cost.megatron_stage_step_cost`). ``memo``: a dict kept across the
    stages of one plan, which then computes the Megatron-LM part once per distinct stage: it
    depends on the stage's layers only through their sequence of MoE flags
    (:meth:`~meshplan.spec.model.ModelSpec.layer_tensors`) and on whether the stage is the first
    or the last (pp 128 of one dense kind: 3 computations instead of 128)."""
    st, c = plan.state[s], plan.config
    extra = 0.0
    if c.training.framework == "megatron":
        memo = {} if memo is None else memo
        if "workload" not in memo:
            memo["workload"], memo["last"] = workload_of(plan), last_stage(plan.stages)
        layers = [i for chunk in plan.stages[s] for i in chunk]
        key = (tuple(map(c.model.is_moe_layer, layers)), s == 0, s == memo["last"])
        if key not in memo:
            memo[key] = megatron_stage_step_cost(c.model, c.cluster.gpu, memo["workload"], c.training, layers, s == 0,
                                                 s == memo["last"], plan.pp, plan.micro_batches).seconds()
        extra = memo[key]
    return extra + optimizer_step_s(st.bytes_of("params"), st.bytes_of("grads"), st.bytes_of("master"),
                                    st.bytes_of("optimizer"), c.training, optimizer_bandwidth(c.cluster.gpu))


def megatron_p2p_syncs_s(plan, s: int, spec) -> float:
    """Seconds of the host syncs around stage ``s``'s pipeline p2p calls in Megatron-LM
    (:func:`meshplan.compute.megatron_cost.p2p_calls`, :func:`~meshplan.compute.megatron_cost.p2p_sync_cost`:
    in 2022 each call's two timer syncs and ``_communicate``'s own, under Megatron Core
    ``_communicate``'s alone, one issue floor each) under
    ``training.framework = "megatron"`` with its blocking calls (``spec.blocking_p2p`` without
    ``overlap_p2p``: ``pp_p2p_overlap = false``, as Megatron-LM ran before 2023); 0 otherwise.
    Counted once per step after the stage's last unit: on a stage that never waits for a partner
    each sync delays its next unit by the same, where it waits anyway the sync would hide in the
    wait (so at most this much later)."""
    if plan.config.training.framework != "megatron" or not spec.blocking_p2p or spec.overlap_p2p or spec.torch_p2p \
            or plan.config.training.pp_engine == "deepspeed":  # DeepSpeed's p2p.send/recv: no timers
        return 0.0
    core = plan.config.training.megatron_core
    calls = p2p_calls(str(spec.schedule), spec.p, spec.m, spec.v, s, core)
    return p2p_sync_cost(plan.config.cluster.gpu, calls, core).seconds()


def float8_precompute_s(plan, s: int) -> float:
    """Seconds of torchao's ``precompute_float8_dynamic_scale_for_fsdp`` on stage ``s`` after the
    optimizer step (``training.fp8_all_gather``, torchtitan's ``precompute_float8_dynamic_scale_for_fsdp``
    set with it): ``torch._foreach_norm(weights, inf)`` reads the rank's local shard of every
    float8 weight once (:func:`meshplan.compute.float8_fsdp.precompute_bytes`, in the parameters'
    dtype) at the optimizer's bandwidth, never below one issue floor; its all-reduce, the table's
    per-step fsdp row, follows it as a step-end event (exposed fsdp), and under TP the second
    all-reduce of the same amaxes over tp after that (exposed tp,
    :func:`meshplan.compute.float8_fsdp.precompute_all_reduces`). 0 without the float8 all-gather.

    Llama 3 8B on 8 GPUs (dp_shard 8), fp32 parameters: 32 layers x 218,103,808 float8 weight
    elements / 8 x 4 B = 3.49 GB, 1.17 ms at the H100's Triad (2.97 TB/s)."""
    c = plan.config
    if not c.training.fp8_all_gather:
        return 0.0
    tp, shard = plan.mesh.degree("tp"), plan.mesh.degree("fsdp")
    layers = [i for chunk in plan.stages[s] for i in chunk]
    numel = sum(local_numel(t, c.model, tp) for i in layers for t in c.model.layer_tensors(i)
                if c.training.float8_linear(t) and not t.split.startswith("expert")) // shard
    nbytes = float8_fsdp.precompute_bytes(numel, dtype_bytes(c.training.param_dtype))
    return issue_floor(c.cluster.gpu, nbytes / optimizer_bandwidth(c.cluster.gpu))


def te_fp8_cast_s(plan, s: int) -> float:
    """Seconds of stage ``s``'s Transformer Engine fp8 weight casts of one step under Megatron-LM's
    ``--fp8-format`` (:func:`meshplan.memory.te_fp8.cast_bytes` over the stage's fp8 weight values,
    ``StageParams.fp8_params``, and its distributed-optimizer shard of them) at the optimizer's
    bandwidth, never below one issue floor; 0 without TE's fp8. TE casts each weight once a step,
    on its chunk's first micro-batch (``is_first_microbatch``), and reuses the cache on the others;
    under ``--fp8-param-gather`` the optimizer casts the main shard and TE transposes after the
    all-gather. Counted as one compute event at the step's end (the first forward's share of it
    runs on the same stream before that forward's GEMMs; a pipeline's other stages wait on it the
    same under 1F1B's warm-up only where the stage is the slowest: not modelled apart).

    Llama-3-70B, 20 layers a stage at tp 8 on H100: 2,139,095,040 values x (2 + 1 + 1) B =
    8.56 GB, 2.88 ms at the H100's Triad (2.97 TB/s)."""
    c = plan.config
    n = plan.state[s].params.fp8_params
    if not n or not te_fp8.applies(c.training):
        return 0.0
    shard = -(-n // plan.mesh.degree("fsdp"))
    nbytes = te_fp8.cast_bytes(n, shard, c.training, c.cluster.gpu.cuda_sm, dtype_bytes(c.training.param_dtype))
    return issue_floor(c.cluster.gpu, nbytes / optimizer_bandwidth(c.cluster.gpu))


def later_runs_label(runs: int) -> str:
    """``run 2`` or ``runs 2-4``: the schedule runs after the simulated first."""
    return "run 2" if runs == 2 else f"runs 2-{runs}"


def stage_end(plan, s, spec, mine, units, comm: CommTimes, ov, hold: float = 0.0,
               memo: Optional[dict] = None, run_s: float = 0.0, runs: int = 1,
               hold_transfer_s: float = 0.0) -> tuple[float, list[Event], dict]:
    """End of stage s after its last unit (``mine``: its compute events) and the blocking
    send it issues (``hold`` seconds, overlapping its communication tail; of it
    ``hold_transfer_s`` the transfers, exposed on "pp" when the hold outlasts the tail, the
    rest waiting for the partner: bubble, :func:`~meshplan.schedule.pipeline_exposure.pp_hold_split`), with the step-end
    events and their exposure (``memo``: :func:`_optimizer_s`'). ``run_s``: seconds from one
    schedule run to the next (:func:`~meshplan.schedule.pipeline_exposure.run_shift`); the ``runs`` - 1 later runs are shown as one
    event after the stage's first run (``args``: ``later_runs``, ``run_s``)."""
    last = max(mine, key=lambda e: e.end_s)
    u = units.of_event(last)
    t = stage_run_end(mine, units, hold)
    post, exposed = [], ({u.tail_stream: u.tail_s} if u.tail_s >= hold and u.tail_s else
                         ({"pp": hold_transfer_s} if hold_transfer_s else {}))
    if runs > 1:  # each later run ends with the same tail
        exposed = {k: x * runs for k, x in exposed.items()}
        shift = (runs - 1) * run_s
        post.append(Event(s, "compute", f"schedule {later_runs_label(runs)} ({runs - 1} x {run_s * 1e3:.3f} "
                          f"ms, each as run 1)", t, t + shift, {"later_runs": runs - 1, "run_s": run_s}))
        t += shift
    steps = [("pipeline p2p calls' syncs", megatron_p2p_syncs_s(plan, s, spec), "compute")]
    # the per-step reduction by the group each part runs on ("dp": the data axes; the SP norms'
    # all-reduce over tp, the tied embedding's over pp: CommTimes.reduce_parts), one after another
    # each named with its collective where its stream's rows have one (a piece in backward is too,
    # grad_reduce._reduce_piece): step's readiness table lists an event by that word (linkload._op_of)
    steps += [(f"grad reduce: {op} (per step)" if op else "grad reduce (per step)", dur, stream)
              for stream, dur, op in comm.reduce_parts(step_end_reduce_s(comm, ov.grad_reduce), per_step=True)]
    # replicated KV heads: one all-reduce per layer of the reduced K/V gradients, before the optimizer
    steps += [(f"kv replica all-reduce {i}", comm.kv_s, KV_REPLICA) for i in range(comm.kv_calls)]
    # ZeRO-Offload: the host's step and its PCIe copies in place of the GPU's (schedule.offload_step)
    steps += offload_steps(plan, s, mine) or [("optimizer step", _optimizer_s(plan, s, memo), "compute")]
    steps.append(("float8 weight amax (precompute)", float8_precompute_s(plan, s), "compute"))
    steps.append(("TE fp8 weight casts (once per step)", te_fp8_cast_s(plan, s), "compute"))
    steps.append(("float8 amax all-reduce (precompute)", comm.float8_step_s, "fsdp"))
    steps.append(("float8 amax all-reduce over tp (precompute)", comm.float8_tp_step_s, "tp"))
    steps += [("param all-gather (per step)", dur, stream) for stream, dur in _gather_steps(plan, s, mine, comm, ov)]
    for name, dur, stream in steps:
        if dur > 0:
            post.append(Event(s, stream, name, t, t + dur))
            if stream != "compute":
                exposed[stream] = exposed.get(stream, 0.0) + dur
            t += dur
    return t, post, exposed


def _gather_steps(plan, s: int, mine, comm: CommTimes, ov) -> list[tuple[str, float]]:
    """(stream, seconds) of the per-step parameter all-gather that stage ``s`` waits for: all of
    it without ``Overlap.param_gather``; with it and virtual stages (Megatron-LM's interleaved
    schedule) each stream's first-chunk share (:func:`first_chunk_shares`), else what the first
    forward unit does not cover (:func:`param_gather_exposed_s`)."""
    parts = comm.gather_parts(comm.step_gather_s)
    if not ov.param_gather or not comm.step_gather_s:
        return parts
    if len(plan.stages[s]) > 1:
        share = first_chunk_shares(plan, s)
        return [(stream, param_gather_exposed_s(dur, 1, 0.0, share.get(stream, 1.0))) for stream, dur in parts]
    first_f = min((e for e in mine if e.args["kind"] == "F"), key=lambda e: e.start_s)
    return comm.gather_parts(param_gather_exposed_s(comm.step_gather_s, comm.gather_buckets, first_f.dur_s))


def first_chunk_shares(plan, s: int) -> dict[str, float]:
    """{stream: share} of stage ``s``'s per-step parameter all-gather seconds that its first
    chunk's buckets take (the rows :func:`meshplan.comm.megatron_buckets.megatron_bucket_rows`
    marks :data:`~meshplan.comm.megatron_buckets.CHUNK0_MARK`, each bucket at its own size's
    seconds, over all the stream's per-step all-gather rows; by the stream that shows each
    axis's rows, :func:`~meshplan.schedule.comm_streams.step_stream`)."""
    total: dict[str, float] = {}
    first: dict[str, float] = {}
    for r in plan.collectives[table_key(table_stage(s, len(plan.stages)))]:  # no Stage view (memory may be unbuilt)
        if r.phase == "step" and r.op == "all-gather":
            k, dur = step_stream(r), r.time_s * max(r.per_step, 1)
            total[k] = total.get(k, 0.0) + dur
            first[k] = first.get(k, 0.0) + (dur if CHUNK0_MARK in r.cadence else 0.0)
    return {k: first[k] / v for k, v in total.items() if v}


def step_end_reduce_s(comm: CommTimes, overlapped: bool) -> float:
    """Seconds of the per-step reduction (``comm.step_reduce_s``) that run at the step's end:
    all of it when not overlapped (``Overlap.grad_reduce`` off), or when the gradient units'
    pieces carry ZeRO-2's micro-batch reduction instead (``mb_reduce_s``,
    :func:`~meshplan.schedule.grad_reduce.reduce_pieces`: the per-step rows beside it, the SP
    norms' tp all-reduces at the optimizer's reads, would be placed nowhere); else none (the
    last gradient unit's pieces issue it).

    >>> [step_end_reduce_s(CommTimes(step_reduce_s=2.0, mb_reduce_s=m), o) for m, o in ((0, True), (0, False), (1, True))]
    [0.0, 2.0, 2.0]
    """
    return comm.step_reduce_s if comm.mb_reduce_s or not overlapped else 0.0


def param_gather_exposed_s(gather_s, buckets, first_forward_s, first_chunk_share=None):
    """Exposed seconds of the per-step parameter all-gather overlapped with the next step's
    forward (``Overlap.param_gather``: Megatron-LM's ``--overlap-param-gather``; floats or numpy
    arrays, the search's bound calls it too). NVIDIA/Megatron-LM d98e8a6, megatron/core/distributed/
    distributed_data_parallel.py (``_make_forward_pre_hook``, ``start_param_sync``),
    param_and_grad_buffer.py (``finish_param_sync``), pipeline_parallel/schedules.py:1219-1221, 1341-1353.

    Without virtual stages (``first_chunk_share`` None; Megatron-LM sets ``align_param_gather``
    off there): ``buckets`` all-gathers of ``gather_s`` in all, the first issued by the first
    forward pre-hook and waited for, each later one issued when the previous is waited for,
    running during the forward of the previous bucket's layers; what the first forward unit
    (``first_forward_s``) does not cover is exposed: ``max(gather / buckets, gather - first_forward)``.

    With virtual stages (interleaved 1F1B, ``align_param_gather`` on by default): the schedule
    issues every bucket of chunks 0 and 1 (dense, then expert buffers) before the first forward,
    in bucket order, which is the reverse of the layers (bucket 0 holds the chunk's last
    parameters), so the first layers' pre-hooks wait for chunk 0's whole gather; chunk k + 1's is
    issued at chunk k's first micro-batch and runs beside its forwards. Exposed: ``gather x
    first_chunk_share``, chunk 0's buckets' share of the stream's seconds. (Not modelled:
    ``--overlap-param-gather-with-optimizer-step``, which issues chunk 0's gather after chunk 0's
    dense optimizer step, beside the rest of the step.)

    >>> [float(param_gather_exposed_s(10.0, b, f)) for b, f in ((5, 4.0), (5, 20.0), (1, 20.0))]
    [6.0, 2.0, 10.0]
    >>> param_gather_exposed_s(70.0, 56, 0.0, 1 / 7)
    10.0
    """
    if first_chunk_share is not None:
        return gather_s * first_chunk_share
    return np.maximum(gather_s / np.maximum(buckets, 1), gather_s - first_forward_s)
