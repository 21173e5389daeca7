"""Megatron-LM 2022's own kernels and host syncs as timed ops (their bytes and counts:
:mod:`meshplan.compute.megatron`): per layer the main-gradient hooks (:func:`main_grad_hooks`)
and the delay kernels after an async tp collective (:func:`comm_delay_ops`); per chunk the batch
and timers (:func:`megatron_batch_cost`); per step the per-parameter copies, the SP gradients'
flatten and copies, the timers and the loss (:func:`megatron_step_cost`,
:func:`megatron_stage_step_cost`).
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.batch_input import core_batch_transfers, megatron_batch_transfers
from meshplan.compute.kernel_time import issue_floor, memory_op
from meshplan.compute.kernel_fragment import kernel_data
from meshplan.compute.megatron_core import CORE_P2P_CALL_SYNCS
from meshplan.compute.megatron import (BATCH_SYNCS, COMM_DELAY_OPS, STEP_TIMERS, TIMER_SYNCS, batch_bytes,
                                       comm_delay_kernels, hook_params, stage_param_tensors)
from meshplan.compute.ops import Cost, Op, Workload
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.spec.cluster import GPUSpec, LinkSpec
from meshplan.spec.model import ModelSpec
from meshplan.units import dtype_bytes


def main_grad_hooks(model: ModelSpec, gpu: GPUSpec, w: Workload, layer: int = -1) -> list[Op]:
    """Megatron-LM's main-gradient hooks of one layer per micro-batch
    (:func:`meshplan.compute.megatron.hook_params`): ``main_grad.add_(grad)`` reads the main
    gradient and the gradient and writes the main gradient, ``(2 g + b) x local elements`` (g = 4
    with fp32 main gradients, else the compute dtype's b), one kernel each (:func:`~meshplan.compute.kernel_time.issue_floor`).

    >>> from meshplan import catalog
    >>> gpt, a100 = catalog.model("megatron-22b"), catalog.gpu("a100-sxm-80gb")
    >>> ops = main_grad_hooks(gpt, a100, Workload(seq_len=2048, tp=8, fused_qkv=True, fp32_wgrad_accumulation=True))
    >>> [o.name for o in ops]  # doctest: +NORMALIZE_WHITESPACE
    ['attn_norm main_grad add', 'attn_norm_bias main_grad add', 'wq_bias main_grad add',
     'wo_bias main_grad add', 'mlp_norm main_grad add', 'mlp_norm_bias main_grad add',
     'w_up_bias main_grad add', 'w_down_bias main_grad add']
    >>> sorted({o.seconds for o in ops})  # each below the 4.7 us issue floor
    [4.7e-06]
    """
    b, g = dtype_bytes(w.dtype), (4 if w.fp32_wgrad_accumulation else dtype_bytes(w.dtype))
    idx = model.layers - 1 if layer < 0 else layer
    return [memory_op(gpu, f"{name} main_grad add", block, "backward_weight", (2 * g + b) * n)
            for name, block, n in hook_params(model, w.tp, w.fused_qkv, idx)]


def comm_delay_ops(gpu: GPUSpec, w: Workload, blocks: tuple[str, ...]) -> list[Op]:
    """Megatron-LM's delay kernels (:func:`meshplan.compute.megatron.comm_delay_kernels`) of the
    column-parallel linear of each of ``blocks`` ("attn": ``query_key_value``; "mlp":
    ``dense_h_to_4h``; "head": the output layer): ``torch.empty(1) + 1`` reads and writes one fp32
    element (8 B), so each takes the issue floor (:func:`~meshplan.compute.kernel_time.issue_floor`).

    >>> from meshplan import catalog
    >>> ops = comm_delay_ops(catalog.gpu("a100-sxm-80gb"), Workload(seq_len=2048, tp=8, sp=True), ("attn", "mlp"))
    >>> [(o.block, o.phase, round(o.seconds * 1e6, 1)) for o in ops]  # doctest: +NORMALIZE_WHITESPACE
    [('attn', 'backward_input', 4.7), ('attn', 'backward_weight', 4.7),
     ('mlp', 'backward_input', 4.7), ('mlp', 'backward_weight', 4.7)]
    """
    return [memory_op(gpu, COMM_DELAY_OPS[phase], block, phase, 8.0)
            for block in blocks for phase, n in comm_delay_kernels(w.tp, w.sp).items() for _ in range(n)]


def megatron_batch_cost(gpu: GPUSpec, w: Workload, host: Optional[LinkSpec] = None, broadcast_s: float = 0.0,
                        keys: tuple[str, ...] = ()) -> Cost:
    """Megatron-LM 2022's per-chunk batch and timer costs (:func:`meshplan.compute.megatron.batch_bytes`,
    :data:`~meshplan.compute.megatron.TIMER_SYNCS`), in every chunk's forward (and the timers'
    syncs in its backward) on every stage: with the node's ``host`` link the batch's copy to the
    GPU and, at tp > 1, the two tp broadcasts of ``broadcast_s`` seconds together
    (:func:`meshplan.compute.batch_input.megatron_batch_transfers`), each ``get_batch`` kernel as
    a memory-bound pass (never below the issue floor), and per ``torch.cuda.synchronize`` one
    issue floor (the GPU drained, the next kernel waits at least one launch: a lower bound).
    Empty for a GPU without catalog data.

    22B, micro-batch 4, seq 2048 on A100: the mask passes 16.8 + 33.6 + 21.0 MB at Triad 1.70 TB/s
    (9.87 + 19.74 + 12.34 us), 4 small kernels at the 4.7 us floor (18.8), 4 syncs (18.8), the
    broadcast sizes' two copies (:data:`~meshplan.compute.megatron.BATCH_SYNCS`, 9.4): 88.94 us in
    forward; with PCIe 4.0 x16 (31.5 GB/s, 5.7 us) the batch's 65,568 B copy adds 2.08 + 5.7 us and
    at tp 8 the broadcasts their given 20 us: 116.72 us; 2 syncs (9.4 us) in backward:

    >>> from meshplan import catalog
    >>> from meshplan.spec.cluster import LinkSpec
    >>> a100, w = catalog.gpu("a100-sxm-80gb"), Workload(seq_len=2048, micro_batch=4, tp=8, megatron_ops=True)
    >>> round(megatron_batch_cost(a100, w).seconds("forward") * 1e6, 2)
    88.94
    >>> c = megatron_batch_cost(a100, w, LinkSpec(name="pcie", bandwidth_gb_per_s=31.5, latency_us=5.7), 20e-6)
    >>> round(c.seconds("forward") * 1e6, 2), round(c.seconds("backward_input") * 1e6, 1)
    (116.72, 9.4)

    Under Megatron Core (``w.megatron_core``; :mod:`meshplan.compute.megatron_core`) only the
    transfers of :func:`meshplan.compute.batch_input.core_batch_transfers` broadcasting ``keys``, on
    the chunks that load a batch: the data loader built the masks on the CPU and the timers do not
    synchronise. The same micro-batch without the mask: tokens, labels and position ids
    8 x 4 x 2048 = 65,536 B each (2.080 + 5.7 us) and the loss mask 32,768 B (1.040 + 5.7):
    3 x 7.780 + 6.740 = 30.08 us, and the broadcasts' 20 us; nothing in backward:

    >>> core = Workload(seq_len=2048, micro_batch=4, tp=8, megatron_ops=True, megatron_core=True)
    >>> c = megatron_batch_cost(a100, core, LinkSpec(name="pcie", bandwidth_gb_per_s=31.5, latency_us=5.7), 20e-6,
    ...                         ("tokens", "position_ids"))
    >>> round(c.seconds("forward") * 1e6, 2), c.seconds("backward_input")
    (50.08, 0)
    """
    data = kernel_data(gpu)
    if data is None:
        return Cost(())
    if w.megatron_core:
        return Cost(tuple(core_batch_transfers(w, host, keys, broadcast_s))) if host is not None else Cost(())
    ops = megatron_batch_transfers(w, host, broadcast_s) if host is not None else []
    ops += [memory_op(gpu, name, "embed", "forward", nb) for name, nb in batch_bytes(w.micro_batch, w.seq_len)]
    ops += [Op("timer synchronize", "embed", phase, "overhead", n * data.kernel_issue_s,
               note=f"{n} torch.cuda.synchronize, one issue floor each") for phase, n in TIMER_SYNCS.items()]
    ops.append(Op("broadcast_data sizes copies", "embed", "forward", "overhead", BATCH_SYNCS * data.kernel_issue_s,
                  note="torch.cuda.LongTensor(sizes) and sizes_cuda.cpu(), one issue floor each"))
    return Cost(tuple(ops))


def megatron_step_cost(gpu: GPUSpec, tensors: list[tuple[str, int, bool]], sp: bool, per_param_copy: bool,
                       clip: bool, loss_micro_batches: int = 0, grad_scaler: bool = False, timers: bool = True) -> Cost:
    """Megatron-LM 2022's kernels and host syncs once per step beyond the optimizer's bulk passes
    (:func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`), on one rank holding ``tensors``
    (:func:`meshplan.compute.megatron.stage_param_tensors`); empty for a GPU without catalog data:

    - ``per_param_copy`` (bf16 parameters with fp32 master weights): ``optimizer.py``
      ``_copy_main_params_to_model_params`` -> ``_multi_tensor_copy_this_to_that`` without an
      overflow buffer (``_dummy_overflow_buf = None`` for bf16: "We don't have a bfloat16
      implementation") loops ``that_.copy_(this_)``, one kernel per parameter: each takes
      ``max(6 B x elements / Triad, issue floor)``; the bulk stream already counts the bytes, so the
      op is the floors' excess, ``sum max(0, floor - 6 n / Triad)``;
    - ``sp``: ``allreduce_layernorm_grads`` flattens the fp32 main gradients of the
      ``sequence_parallel`` tensors into one buffer (``_flatten_dense_tensors``: one ``cat`` kernel,
      read + write 8 B per element) and copies each back after the all-reduce (``buf.copy_(synced)``:
      one kernel per tensor, 8 B per element, never below the floor);
    - with ``timers`` (2022; Megatron Core's are dummies at the default timing level:
      :mod:`meshplan.compute.megatron_core` item 3) the step's timers
      (:data:`~meshplan.compute.megatron.STEP_TIMERS`, a ``torch.cuda.synchronize`` at each start
      and stop) and with ``clip`` the gradient norm's
      ``total_norm.item()`` (``clip_grads.py``): one issue floor per sync (as
      :func:`megatron_batch_cost`);
    - ``grad_scaler`` (fp16: ``optimizer/__init__.py`` gives ``--fp16`` a ``DynamicGradScaler``; bf16 none
      without ``--loss-scale``): ``optimizer.py`` ``_unscale_main_grads_and_check_for_nan`` (lines
      392-412) zeroes ``found_inf`` (``fill_``: one kernel) and reads ``found_inf.item()`` after its
      all-reduce, between the ``optimizer-unscale-and-check-inf`` timer's start and stop: 4 issue
      floors (its unscale pass over the main gradients is a bulk pass, 8 B per parameter,
      :func:`meshplan.schedule.optimizer_step.optimizer_step_bytes`; the 4-byte all-reduce over the
      model-parallel group, like the grad norm's, is not timed: tens of microseconds);
    - on the last stage (``loss_micro_batches``: the micro-batches whose losses it holds) the
      loss averaged over them (``training.py`` ``train_step``: ``sum(losses) / len(losses)``,
      Python's ``sum`` from 0: one add per micro-batch and the division) and ``training_log``'s
      running total (``total_loss_dict.get(key, torch.cuda.FloatTensor([0.0])) + loss``: a
      blocking host-to-device copy and an add): ``n + 3`` issue floors.

    22B at tp 8 (one layer's 12 tensors, 8 of them under 1 M elements): the 8 copies each pay the
    4.7 us floor less their 6 n B at 1.70 TB/s; the 6 sequence_parallel tensors (36,864 elements)
    flatten in one floored kernel and copy back in 6:

    >>> from meshplan import catalog
    >>> from meshplan.compute.megatron import stage_param_tensors
    >>> a100 = catalog.gpu("a100-sxm-80gb")
    >>> c = megatron_step_cost(a100, stage_param_tensors(catalog.model("megatron-22b"), 8, 6400, [0], False, False, 1),
    ...                        sp=True, per_param_copy=True, clip=True)
    >>> small = [6144, 6144, 2304, 6144, 6144, 6144, 3072, 6144]
    >>> round(c.seconds() * 1e6, 3) == round((sum(4.7e-6 - 6 * n / 1.7e12 for n in small) + 4.7e-6
    ...                                         + 6 * 4.7e-6 + 23 * 4.7e-6) * 1e6, 3)
    True
    """
    data = kernel_data(gpu)
    if data is None:
        return Cost(())
    floor, bw = data.kernel_issue_s, data.stream_bytes_per_s
    ops = []
    if per_param_copy:
        extra = sum(max(0.0, floor - 6 * n / bw) for _, n, _ in tensors)
        ops.append(Op("master-to-model copy, one kernel per parameter", "head", "step", "overhead", extra,
                      note=f"{len(tensors)} copy_ kernels (bf16: no multi-tensor copy), floors beyond the bulk bytes"))
    if sp:
        shared = [n for _, n, s in tensors if s]
        if shared:
            ops.append(memory_op(gpu, "SP gradients flatten (cat)", "head", "step", 8 * sum(shared)))
            ops.append(Op("SP gradients copy back", "head", "step", "memory",
                          sum(issue_floor(gpu, 8 * n / bw) for n in shared), size_bytes=8 * sum(shared),
                          note=f"{len(shared)} copy_ kernels"))
    syncs = (2 * len(STEP_TIMERS) if timers else 0) + (1 if clip else 0) + (4 if grad_scaler else 0)
    ops.append(Op("step timers and grad-norm sync", "head", "step", "overhead", syncs * floor,
                  note=f"{syncs} torch.cuda.synchronize / .item(), one issue floor each"))
    if loss_micro_batches:
        n = loss_micro_batches + 3
        ops.append(Op("loss average and log", "head", "step", "overhead", n * floor,
                      note=f"{n} tiny kernels and copies, one issue floor each"))
    return Cost(tuple(ops))


def megatron_stage_step_cost(model: ModelSpec, gpu: GPUSpec, w: Workload, training, layers: list[int], first: bool,
                             last: bool, pp: int, micro_batches: int = 1) -> Cost:
    """:func:`megatron_step_cost` of one pipeline stage's rank (``layers``: its layer indices;
    ``training``: the :class:`~meshplan.spec.training.TrainingSpec`; ``micro_batches`` per step);
    empty unless ``w.megatron_ops``. The per-parameter copy applies to bf16 parameters with
    master weights, the grad scaler's syncs to fp16 parameters, the step timers' syncs to 2022 only
    (not ``w.megatron_core``)."""
    if not w.megatron_ops:
        return Cost(())
    rows = padded_vocab(model.vocab, w.vocab_pad_divisor, w.tp) // w.tp
    tensors = stage_param_tensors(model, w.tp, rows, layers, first, last, pp)
    per_param = training.param_dtype == "bf16" and training.keeps_master
    return megatron_step_cost(gpu, tensors, w.sp and w.tp > 1, per_param, training.grad_clip,
                              micro_batches if last else 0, grad_scaler=training.param_dtype == "fp16",
                              timers=not w.megatron_core)


#: ``torch.cuda.synchronize`` calls per pipeline p2p call of Megatron-LM 2022 (NVIDIA/Megatron-LM 2755bcb):
#: the call's timer start and stop (``p2p_communication.py`` ``timers('forward-send-forward-recv')``
#: and its kin, lines 168-311, every call made with ``timers=timers`` by ``schedules.py``; ``global_vars.py``
#: ``_Timer.start``/``stop`` synchronize, lines 217-229) and ``_communicate``'s own after the requests'
#: waits ("To protect against race condition when using batch_isend_irecv()", line 139).
P2P_CALL_SYNCS = 3


def p2p_calls(schedule: str, p: int, m: int, v: int, s: int, core: bool = False) -> int:
    """Pipeline p2p calls stage ``s`` of ``p`` makes per step in Megatron-LM 2022 (2755bcb ``megatron/schedules.py``,
    ``p2p_communication.py``; ``m`` micro-batches, ``v`` model chunks), each with :data:`P2P_CALL_SYNCS` syncs; 0
    at p 1 (``forward_backward_no_pipelining``) and for a schedule Megatron-LM 2022 does not have.

    - ``interleaved_1f1b`` (``forward_backward_pipelining_with_interleaving``): warm-up ``w = min(m v, 2 (p - s
      - 1) + (v - 1) p)`` (all ``m v`` when m == p); one call after each warm-up forward and one per steady-state
      forward/backward pair (``m v`` in all), one after each cool-down backward (``w``), all made on every
      stage (``send_forward_recv_forward``, ``send_forward_backward_recv_forward_backward``,
      ``send_backward_recv_backward`` check no stage); the leading ``recv_forward`` on every stage but the first
      (which returns None before its timers), and with m == p the ``recv_backward`` before the cool-down on
      every stage but the last: ``m v + w + [s > 0] + [m == p and s < p - 1]``;
    - ``1f1b`` (``forward_backward_pipelining_without_interleaving``): warm-up ``w = min(p - s - 1, m)``,
      ``r = m - w``: per warm-up forward a ``recv_forward`` and a ``send_forward``, one ``recv_forward`` before
      the steady state (r > 0), per steady pair a ``send_forward_recv_backward`` and a
      ``send_backward(_recv_forward)``, per cool-down backward a ``recv_backward`` and a ``send_backward``;
      the first stage skips every receive from and send to its previous stage, the last every send to and
      receive from its next (``is_pipeline_first_stage`` / ``is_pipeline_last_stage`` return before the
      timers).

    Megatron Core (``core``; NVIDIA/Megatron-LM d98e8a64dd ``megatron/core/pipeline_parallel/schedules.py``,
    ``p2p_communication.py``) makes the same calls, with one difference: its interleaved warm-up has no
    ``m == p`` case (``get_pp_rank_microbatches``, 929-987: ``w = min(m v, 2 (p - s - 1) + (v - 1) g)``, ``g``
    ``microbatch_group_size_per_vp_stage``, default p, ``model_parallel_config.py:567-568``), and the
    ``recv_backward`` before the cool-down runs where every unit is warm-up (``are_all_microbatches_in_warmup``,
    1960-1972) on every stage but the last. So: the leading ``recv_forward`` (1543-1547, none on the first
    stage, ``recv_forward`` returns before ``_communicate``, ``p2p_communication.py:440-444``), one call after
    each warm-up forward (1640-1658: ``send_forward_backward_recv_forward_backward`` after the last, else
    ``send_forward_recv_forward``), one per steady pair (1934-1941), one per cool-down backward (2052-2054),
    each on every stage: ``m v + w + [s > 0] + [w = m v and s < p - 1]``. Its 1F1B (2332-2475) is 2022's
    call for call. At p 4, m 4, v 2 stages 2 and 3 warm up 6 and 4 units, not 8: 15 and 13 calls, not 18 and
    17; stages 0 and 1 (w = m v) as 2022.

    GPT-3 175B at p 8, m 64, v 3 (D3/D4): stage 0 warms up 30 units, 192 + 30 calls; stage 7 16, 192 + 16 + 1.
    1F1B at p 4, m 8: the first stage 3 + 5 + 3, a middle one (w 2) 4 + 1 + 12 + 4, the last 1 + 8:

    >>> [p2p_calls("interleaved_1f1b", 8, 64, 3, s) for s in (0, 7)], p2p_calls("interleaved_1f1b", 2, 2, 2, 0)
    ([222, 209], 9)
    >>> [p2p_calls("1f1b", 4, 8, 1, s) for s in (0, 1, 3)], p2p_calls("1f1b", 1, 8, 1, 0), p2p_calls("zb_h1", 4, 8, 1, 0)
    ([11, 21, 9], 0, 0)
    >>> [p2p_calls("interleaved_1f1b", 4, 4, 2, s, core) for core in (False, True) for s in range(4)]
    [17, 18, 18, 17, 17, 18, 15, 13]
    """
    if p <= 1:
        return 0
    first, last = s == 0, s == p - 1
    if schedule == "interleaved_1f1b":
        if not core:
            warm = m * v if m == p else min(m * v, 2 * (p - s - 1) + (v - 1) * p)
            return m * v + warm + int(not first) + int(m == p and not last)
        warm = min(m * v, 2 * (p - s - 1) + (v - 1) * p)
        return m * v + warm + int(not first) + int(warm == m * v and not last)
    if schedule != "1f1b":
        return 0
    warm = min(p - s - 1, m)
    rest = m - warm
    prev, nxt = int(not first), int(not last)  # calls with the previous / the next stage
    return warm * (prev + nxt) + prev * int(rest > 0) + rest * (nxt + prev) + warm * (nxt + prev)


def p2p_sync_cost(gpu: GPUSpec, calls: int, core: bool = False) -> Cost:
    """The host syncs of ``calls`` Megatron-LM pipeline p2p calls (:func:`p2p_calls`), one issue floor per
    ``torch.cuda.synchronize`` (as :func:`megatron_batch_cost`'s timers): ``calls x 3`` floors in 2022,
    ``calls x 1`` under Megatron Core (``core``: :data:`~meshplan.compute.megatron_core.CORE_P2P_CALL_SYNCS`). Their transfers
    and waits are the pipeline simulation's (:mod:`meshplan.pipeline.rendezvous`). Empty for a GPU without
    catalog data or no calls.

    GPT-3 175B stage 0 (222 calls) on A100: 666 syncs x 4.7 us = 3.1302 ms per step:

    >>> from meshplan import catalog
    >>> round(p2p_sync_cost(catalog.gpu("a100-sxm-80gb"), 222).seconds() * 1e3, 4)
    3.1302

    The same calls under Megatron Core, one sync each: 222 x 4.7 us = 1.0434 ms:

    >>> round(p2p_sync_cost(catalog.gpu("a100-sxm-80gb"), 222, core=True).seconds() * 1e3, 4)
    1.0434
    """
    data = kernel_data(gpu)
    if data is None or calls <= 0:
        return Cost(())
    per = CORE_P2P_CALL_SYNCS if core else P2P_CALL_SYNCS
    return Cost((Op("pipeline p2p calls' syncs", "head", "step", "overhead", per * calls * data.kernel_issue_s,
                    note=f"{calls} p2p calls x {per} torch.cuda.synchronize, one issue floor each"),))
