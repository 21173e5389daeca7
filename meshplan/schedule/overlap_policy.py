"""What a config lets overlap, before any timeline is built: :func:`config_overlap` turns the
training contract (framework, engines, ``tp_comm_overlap``, Megatron-LM's overlap flags) into the
:class:`~meshplan.schedule.unit_sim.Overlap` the unit timelines read; :func:`p2p_mode`
chooses how each framework's pipeline sends and receives wait (:func:`blocking_p2p`: whether any
blocks its stage); :func:`megatron_reduce_line` names the gradient
reduction Megatron-LM runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from meshplan.compute import asynctp
from meshplan.pipeline.registry import get as get_schedule
from meshplan.schedule.unit_sim import Overlap
from meshplan.memory.deepspeed_fetch import config_layer_param_bytes, config_reuse
from meshplan.spec.deepspeed_memory import deepspeed_ahead_bytes, deepspeed_prefetch_ahead
from meshplan.spec.mesh import Schedule


class P2PMode(NamedTuple):
    """How a framework's pipeline p2p waits (:func:`p2p_mode`): the fields of
    :class:`~meshplan.pipeline.simulate.PipelineSpec` of the same names."""

    blocking_p2p: bool
    overlap_p2p: bool
    torch_p2p: bool


def p2p_mode(training, schedule: Schedule) -> P2PMode:
    """(``blocking_p2p``, ``overlap_p2p``, ``torch_p2p``) of
    :class:`~meshplan.pipeline.simulate.PipelineSpec` for ``training`` running ``schedule``: the
    one place a framework's pipeline p2p waits are chosen.

    Megatron-LM (``training.framework``) in its schedules (``megatron_p2p``: 1F1B and interleaved
    1F1B) waits on its p2p calls: without ``overlap_p2p_comm`` its ``_communicate`` runs
    ``batch_isend_irecv``, waits on every request and calls ``torch.cuda.synchronize``
    (``batch_p2p_comm = not overlap_p2p_comm``, megatron/training/argument_utils.py:307, and
    ``batch_p2p_sync`` default true, p2p_communication.py:389-425 at NVIDIA/Megatron-LM d98e8a6;
    Megatron-LM 2022 the same), so both stages of a transfer rendezvous
    (:mod:`meshplan.pipeline.simulate`). With ``training.pp_p2p_overlap`` (unset: on, as
    Megatron-LM) the interleaved schedule's steady state is asynchronous (``overlap_p2p``); 1F1B
    never overlaps (Megatron-LM turns it off there, arguments.py:1010-1018, and
    ``forward_backward_pipelining_without_interleaving`` raises if it is set,
    schedules.py:2181-2184). ``pp_p2p_overlap_warmup_flush`` makes every call asynchronous: no
    blocking call left.

    torch 2.13 (``framework = "torch"``) waits where its schedule class does
    (torch/distributed/pipelining/schedules.py): the single-stage ones (``torch_waits``: GPipe,
    1F1B, ``PipelineScheduleSingle._step_microbatches``) wait on each receive right before its
    unit and 1F1B on its fused send + receive calls at once (``_wait_batch_p2p`` right after
    ``_batch_p2p``, lines 1105 and 1127), so they block (``torch_p2p``: the calls of
    :meth:`~meshplan.pipeline.base.PipelineSchedule.torch_p2p_calls`); on a GPU such a wait
    holds the compute stream until the transfer ends (NCCL's ``Work.wait`` makes the current
    stream wait for it), and a transfer runs once both sides' kernels run, each after the compute
    issued before it. The multi-stage runtime (``_PipelineScheduleRuntime._step_microbatches``:
    interleaved 1F1B, ZB-H1, ZB-V, DualPipeV) posts its SEND and RECV actions and waits a receive
    only at the compute that needs it (lines 2528, 2559, 2583), its sends at the step's end
    (2654-2655): asynchronous sends, meshplan's model for them (the receive's own post, where
    torch's ``_add_send_recv`` places it, not modelled).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron")
    >>> [tuple(p2p_mode(t, s)) for s in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B)]
    [(True, False, False), (True, True, False)]
    >>> tuple(p2p_mode(t.model_copy(update={"pp_p2p_overlap": False}), Schedule.INTERLEAVED_1F1B))
    (True, False, False)
    >>> tuple(p2p_mode(t.model_copy(update={"pp_p2p_overlap_warmup_flush": True}), Schedule.INTERLEAVED_1F1B))
    (False, False, False)
    >>> t = TrainingSpec(global_batch=8, seq_len=16)
    >>> [tuple(p2p_mode(t, s)) for s in (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.INTERLEAVED_1F1B)]
    [(True, False, True), (True, False, True), (False, False, False)]
    """
    sched = get_schedule(schedule)
    if training.framework == "torch":
        return P2PMode(sched.torch_waits, False, sched.torch_waits)
    if training.framework != "megatron" or not sched.megatron_p2p:
        return P2PMode(False, False, False)
    if not sched.virtual_stages or training.pp_p2p_overlap is False:
        return P2PMode(True, False, False)
    return P2PMode(False, False, False) if training.pp_p2p_overlap_warmup_flush else P2PMode(True, True, False)


def blocking_p2p(training, schedule: Schedule) -> bool:
    """Whether any pipeline call waits (blocks its stage): :func:`p2p_mode`'s first."""
    return p2p_mode(training, schedule)[0]


def config_overlap(training, overlap: Overlap = Overlap()) -> Overlap:
    """``overlap`` with what the config turns on: ``tp`` for ``training.tp_comm_overlap`` under
    Megatron-LM (``--tp-comm-overlap``; torch's async TP fuses some collectives and the others
    block: :func:`meshplan.compute.asynctp.unfused_overlap`), ``tp_grad`` for
    ``training.framework = "megatron"``; and
    what Megatron-LM 2022 cannot do: overlap the per-step gradient reductions with the backward
    (``grad_reduce`` off: 2755bcb ``megatron/training.py`` ``train_step`` calls
    ``optimizer.reduce_model_grads`` after ``forward_backward_func`` returns, and it runs the SP
    gradients' all-reduce, the local DDP buffer's all-reduce over dp and the tied embedding's
    all-reduce one after the other, each between timer syncs; ``model/distributed.py``'s hooks
    only accumulate into the main-gradient buffer; today's Megatron-LM does the same unless
    ``--overlap-grad-reduce``, default off). With ``training.overlap_grad_reduce``
    (``--overlap-grad-reduce`` on its DDP buffers, sharding none or zero1) ``grad_reduce`` stays
    on: the buffer's buckets (:func:`meshplan.comm.megatron_buckets.megatron_bucket_rows`) are
    reduced as their gradients are ready in the last backward, which the timeline places as
    DDP's (:func:`meshplan.schedule.grad_reduce.reduce_pieces`); ``training.overlap_param_gather``
    turns ``param_gather`` on (:func:`~meshplan.schedule.step_end.param_gather_exposed_s`). Except under
    sharding zero2, zero3 and hsdp, which Megatron-LM runs with Megatron FSDP
    (``--use-megatron-fsdp``): there ``MegatronFSDP.__init__`` turns ``overlap_grad_reduce`` on
    (and ``overlap_param_gather`` for ``optim_grads_params``) whatever the flags say, each
    FSDP unit's reduce-scatter issued asynchronously after its backward and the next unit's
    all-gather prefetched (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py
    lines 326-337 at NVIDIA/Megatron-LM d98e8a6): ``grad_reduce`` stays on
    (:func:`megatron_reduce_line`), with none of FSDP2's copies on the compute stream
    (:func:`meshplan.comm.fsdp2.compute_stream_copies`). Under ``training.zero12_engine = "deepspeed"``,
    ``grad_reduce`` is ``training.overlap_comm``. Under ``training.zero3_engine = "deepspeed"``
    without overlap_comm (:attr:`~meshplan.spec.training.TrainingSpec.overlaps_comm`; DeepSpeed's
    stage-3 default is on) both ``fsdp_prefetch`` and ``grad_reduce`` are off: DeepSpeed then
    issues its all-gathers and reduce-scatters on the default stream (deepspeedai/DeepSpeed edaa722
    ``runtime/zero/parameter_offload.py:189-190``, ``runtime/zero/stage3.py:335-336``), where
    each runs between the compute kernels and blocks them, a prefetch included. FSDP2 (framework torch,
    ``zero3_engine = "fsdp2"``) issues its reduce-scatters on their own stream (``fsdp_rs_queue``:
    torch 2.13 ``_fsdp_param_group.py`` lines 89-92, ``_fsdp_collectives.py`` lines 362-363 and 607-611);
    Megatron FSDP's and DeepSpeed's ZeRO-3 keep one queue in the model. Megatron-DeepSpeed
    (``framework = "megatron"`` with ``zero3_engine = "deepspeed"`` at zero3) hands the backward and
    the gradient reductions to DeepSpeed's engine, not Megatron-LM's post-backward ``reduce_model_grads``
    (microsoft/Megatron-DeepSpeed f4157be ``megatron/core/pipeline_parallel/schedules.py:265-266``
    ``model.backward``, ``megatron/training.py:728-729`` ``if not args.deepspeed:
    optimizer.reduce_model_grads``): ``grad_reduce`` there follows DeepSpeed's ``overlap_comm``, as
    under torch (:func:`_deepspeed_zero3`)."""
    if training.framework == "torch" and training.zero3_engine == "fsdp2":
        overlap = replace(overlap, fsdp_rs_queue=True)
    if training.tp_comm_overlap and not overlap.tp and asynctp.unfused_overlap(training.framework):
        overlap = replace(overlap, tp=True)
    if training.framework == "megatron":
        overlap = replace(overlap, tp_grad=True, grad_reduce=overlap.grad_reduce and (
            megatron_fsdp(training) or training.overlap_grad_reduce or _deepspeed_zero3(training)),
            param_gather=overlap.param_gather or (training.overlap_param_gather and training.sharding == "zero1"))
    if training.zero3_engine == "deepspeed" and training.sharding == "zero3" and not training.overlaps_comm:
        overlap = replace(overlap, fsdp_prefetch=False, grad_reduce=False)  # all on the default stream
    if training.zero12_engine == "deepspeed" and overlap.grad_reduce != training.overlaps_comm:
        # DeepSpeed ZeRO-1/2: its reductions run on a side stream under overlap_comm only, else
        # on the compute stream (comm.deepspeed_zero12); whatever the framework runs the model
        overlap = replace(overlap, grad_reduce=training.overlaps_comm)
    if training.zero3_engine == "deepspeed-2021" and overlap.grad_reduce:
        # DeepSpeed ZeRO-3 of 2021: every module's fetch ends in torch.cuda.synchronize()
        # (stage3.py _synchronize_communication), which waits for the reductions in flight (the
        # layers' buckets are placed between those fetches: deepspeed_layer.ds_backward_layer)
        overlap = replace(overlap, grad_reduce=False)
    return overlap


def plan_overlap(config, rows, overlap: Overlap = Overlap()) -> Overlap:
    """:func:`config_overlap` of ``config``'s training, and under DeepSpeed ZeRO-3
    (``training.zero3_engine = "deepspeed"`` at sharding zero3, its all-gathers on their own
    stream) the layers its coordinator prefetches ahead (``Overlap.fsdp_ahead``,
    :func:`~meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead`) from ``[memory]
    deepspeed_prefetch_elements`` and ``deepspeed_max_live_elements`` and a layer's all-gather
    bytes (the largest forward ``every layer`` all-gather of ``rows``, the plan's collective
    rows), the coordinator's window sliding module by module (``Overlap.fsdp_slide``: the next
    layer's gather issued during this one) and behind the embedding's and the head's fetches max
    live less that unit (``Overlap.fsdp_start``, as the memory timeline's
    :func:`~meshplan.memory.deepspeed_fetch.deepspeed_prefetch`): a bucket of 0 prefetches nothing (``fsdp_prefetch`` off: every gather issued when
    its layer, or the embedding or head, needs it). The prefetch runs on to the end of the parameter
    that reaches max live (a layer's parameters in trace order,
    :func:`meshplan.memory.deepspeed_fetch.config_layer_param_bytes`, the memory timeline's). Its
    backward all-gathers follow ``[memory] deepspeed_max_reuse_elements`` (``Overlap.fsdp_backward``,
    :func:`meshplan.memory.deepspeed_fetch.config_reuse`, the collective table's)."""
    overlap = config_overlap(config.training, overlap)
    ds = config.memory.deepspeed_prefetch_bytes(config.training)
    reuse = config_reuse(config) if ds is not None else None
    if reuse is not None:
        overlap = replace(overlap, fsdp_backward=reuse.backward)
    if ds is None or not overlap.fsdp_prefetch:
        return overlap
    unit, layer_params = _layer_gather_bytes(rows), config_layer_param_bytes(config)
    ahead = deepspeed_prefetch_ahead(ds, unit, layer_params) if unit else 1.0
    start = tuple(deepspeed_ahead_bytes(ds, end, layer_params) / unit if unit and end else ahead
                  for end in (_root_gather_bytes(rows, "embedding"), _root_gather_bytes(rows, "norm/output")))
    return replace(overlap, fsdp_prefetch=ahead > 0, fsdp_ahead=ahead, fsdp_slide=True, fsdp_start=start)


def _root_gather_bytes(rows, end: str) -> int:
    """The forward all-gather bytes of the root unit at ``end`` ("embedding", "norm/output"; the
    one ``root`` unit where the two are together; 0: none on this stage)."""
    sizes = [r.size_bytes for r in rows if r.phase == "forward" and r.op == "all-gather"
             and r.cadence in (f"per root ({end})", "per root")]
    return int(max(sizes, default=0))


def _layer_gather_bytes(rows) -> int:
    """A layer's all-gather bytes: the largest forward ``every layer`` all-gather of ``rows`` (0: none)."""
    return int(max((r.size_bytes for r in rows if r.phase == "forward" and r.op == "all-gather"
                    and r.cadence == "every layer"), default=0))


def _sci(n: int) -> str:
    """An element count as DeepSpeed's configs write it: ``5e7``, ``1.5e8``.

    >>> _sci(50_000_000), _sci(150_000_000), _sci(1000)
    ('5e7', '1.5e8', '1e3')
    """
    return f"{n:.3g}".replace("e+0", "e").replace("e+", "e")


def deepspeed_prefetch_line(config, rows) -> str:
    """Under DeepSpeed ZeRO-3 with ``overlap_comm`` (:func:`plan_overlap`), one line naming the
    prefetch the step models from ``[memory] deepspeed_prefetch_elements`` and
    ``deepspeed_max_live_elements``; empty otherwise.

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 1024, "zero3_engine": "deepspeed"},
    ...     "memory": {"deepspeed_prefetch_elements": 0}, "mesh": {"names": ["dp_shard"], "shape": [8]}})
    >>> deepspeed_prefetch_line(cfg, [])[:97]
    'note: DeepSpeed ZeRO-3 prefetch: none (stage3_prefetch_bucket_size 0): every all-gather is issued'
    """
    t, ds = config.training, config.memory.deepspeed_prefetch_bytes(config.training)
    if ds is None or not t.overlaps_comm:
        return ""
    knobs = config.memory.knob_acts
    bucket, live = knobs("deepspeed_prefetch_elements", t)[1], knobs("deepspeed_max_live_elements", t)[1]
    if bucket == 0:
        return ("note: DeepSpeed ZeRO-3 prefetch: none (stage3_prefetch_bucket_size 0): every all-gather is issued "
                "when its module needs it and the compute waits for it ([memory] deepspeed_prefetch_elements)")
    unit = _layer_gather_bytes(rows)
    ahead = deepspeed_prefetch_ahead(ds, unit, config_layer_param_bytes(config)) if unit else 1.0
    if ahead == 0:
        return (f"note: DeepSpeed ZeRO-3 prefetch: none (stage3_max_live_parameters {_sci(live)} elements hold no "
                f"more than the layer computed, {unit:,} B)")
    return (f"note: DeepSpeed ZeRO-3 prefetch (stage3_prefetch_bucket_size {_sci(bucket)}, max live {_sci(live)} "
            f"elements): {ahead:.2f} layers gathered past the one computed at its start, up to max live, the "
            f"window sliding module by module (the next layer's gather issued during this one; "
            f"meshplan.spec.deepspeed_memory.deepspeed_prefetch_ahead)")


def _deepspeed_zero3(training) -> bool:
    """Whether DeepSpeed's ZeRO-3 engine (``zero3_engine = "deepspeed"``) runs ``training``'s zero3:
    its reductions are the engine's, whatever framework runs the model (:func:`config_overlap`)."""
    return training.zero3_engine == "deepspeed" and training.sharding == "zero3"


def megatron_fsdp(training) -> bool:
    """Whether Megatron-LM runs ``training``'s sharding with Megatron FSDP (zero2 under
    ``zero12_engine = "megatron"``, zero3 and hsdp under ``zero3_engine = "fsdp2"``:
    ``--use-megatron-fsdp``, :func:`config_overlap`) rather than its DDP buffers (none, zero1)
    or another engine (DeepSpeed's): the shardings whose overlap Megatron FSDP forces. Its
    no_shard and optim (none, zero1 under ``training.megatron_fsdp``) keep the overlap flags, as
    the DDP buffers do (``is_delay_grad_reduce``, megatron_fsdp.py:326-337 at d98e8a6): False."""
    if training.sharding == "zero2":
        return training.zero12_engine == "megatron"
    return training.sharding in ("zero3", "hsdp") and training.zero3_engine == "fsdp2"


def _megatron_engine(training) -> bool:
    """Whether Megatron-LM's own code reduces ``training``'s gradients: its DDP buffers (none;
    zero1 under ``zero12_engine = "megatron"``) or Megatron FSDP (:func:`megatron_fsdp`)."""
    ddp = training.sharding == "none" or (training.sharding == "zero1" and training.zero12_engine == "megatron")
    return ddp or megatron_fsdp(training)


def megatron_reduce_line(training, vpp: int = 1) -> str:
    """Under ``training.framework = "megatron"``: which gradient reduction the step models
    (:func:`config_overlap`), one line; empty under another framework. ``vpp``: virtual stages,
    which change what ``--overlap-param-gather`` leaves exposed
    (:func:`meshplan.schedule.step_end.param_gather_exposed_s`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> megatron_reduce_line(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", framework="megatron"))[:36]
    'note: Megatron FSDP (sharding zero3)'
    >>> megatron_reduce_line(TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", framework="megatron"))[-26:]
    '--overlap-grad-reduce off)'
    """
    if training.framework != "megatron" or not _megatron_engine(training):
        return ""  # DeepSpeed's engines: their own lines (overlap_comm, the 2021 ZeRO-3 synchronize)
    if megatron_fsdp(training):
        return (f"note: Megatron FSDP (sharding {training.sharding}): each unit's gradient reduce-scatter overlaps "
                f"the next unit's backward and the next all-gather is prefetched (MegatronFSDP forces "
                f"overlap_grad_reduce and overlap_param_gather; export writes --overlap-grad-reduce"
                f"{' --overlap-param-gather' if training.sharding != 'zero2' else ''}); no copies on the compute "
                f"stream around them, unlike FSDP2: the parameters are views of the all-gather's bucket and the "
                f"weight-gradient GEMMs write into the reduce-scatter's (meshplan.comm.fsdp2)")
    if training.overlap_grad_reduce:
        gather = ((" (--overlap-param-gather with virtual stages: every chunk 0 and 1 bucket's parameter all-gather "
                   "is issued before the next forward, which waits for chunk 0's whole gather; each later chunk's "
                   "runs beside the earlier chunks' forwards)") if vpp > 1 else
                  (" (--overlap-param-gather: the next forward waits for the first bucket's parameter all-gather, "
                   "the others run beside it)")) if training.overlap_param_gather else ""
        return (f"note: Megatron-LM DDP buffers (sharding {training.sharding}, --overlap-grad-reduce): each gradient "
                f"bucket is reduced once its gradients are ready in the last backward, overlapping the rest of it"
                f"{gather}")
    return (f"note: Megatron-LM DDP buffers (sharding {training.sharding}): the gradient reduction runs after the "
            f"last backward, not overlapped (Megatron-LM's default, --overlap-grad-reduce off)")
