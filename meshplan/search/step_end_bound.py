"""Each stage's step-end ops for the bound, per candidate: the optimizer step at HBM bandwidth,
ZeRO-1/2's exposed parameter all-gather and ZeRO-1's gradient reduce-scatter
(:func:`stage_end_bound`, the vectorised counterpart of :func:`meshplan.schedule.step_end.stage_end`,
through the same :func:`~meshplan.schedule.optimizer_step.optimizer_step_s` and
:func:`~meshplan.schedule.step_end.param_gather_exposed_s`, the gather's calls as the collective
table's: :func:`per_step_gather`).
"""

from __future__ import annotations

import numpy as np

from meshplan.compute.kernel_time import optimizer_bandwidth
from meshplan.comm.megatron_buckets import split_buckets
from meshplan.config import Config
from meshplan.mesh.tpsplit import experts_apart_degrees
from meshplan.schedule.optimizer_step import ZEROED_GRAD_BUFFER, optimizer_step_s
from meshplan.schedule.step_end import param_gather_exposed_s
from meshplan.search.memory import Stages, fp8_param_rows
from meshplan.search.nic_bounds import two_queues_s
from meshplan.search.space import SHARDING, ZERO12, Candidates
from meshplan.search.time_tables import TimeTables, coll_times
from meshplan.units import dtype_bytes


def stage_end_bound(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict, cm: dict):
    """(optimizer step + ZeRO-1's exposed parameter all-gather, ZeRO-1's gradient
    reduce-scatter) per stage, seconds (:func:`meshplan.schedule.step_end.stage_end`)."""
    t, gpu = cfg.training, cfg.cluster.gpu
    zeroed = np.isin(c.sh, [i for i, k in enumerate(SHARDING) if k in ZEROED_GRAD_BUFFER])[:, None]
    opt = optimizer_step_s(s["params"], s["grads"], s["master"], s["optimizer"], t, optimizer_bandwidth(gpu), zeroed)
    zero1 = (c.sh == SHARDING.index("zero1"))[:, None]
    # zero1 and zero2 gather the updated parameters once per step (Megatron-LM's distributed
    # optimizer, DeepSpeed's all_gather_dp_groups); zero2 reduces in the backward (not counted)
    zero12 = np.isin(c.sh, ZERO12)[:, None]
    # the middle stages' table is stage 0's or their own: the smaller of the two
    mid = lambda a: np.where(st.last, a, np.minimum(a, a[:, :1]))  # noqa: E731
    numel = mid(s["dense_numel"])
    n = np.broadcast_to(c.fsdp[:, None], numel.shape).ravel()
    stride = np.broadcast_to(c.tp[:, None], numel.shape).ravel()
    g_fsdp, g_efsdp, calls, numel_fsdp = per_step_gather(cfg, tt, c, s)
    gather = mid(g_fsdp + g_efsdp)
    if t.overlap_param_gather:  # Megatron-LM's --overlap-param-gather (step_end.param_gather_exposed_s): without
        # virtual stages the mean call of all the stage's buckets, both axes' (what the first forward covers
        # left out, as the exact gathers' max(gather / buckets, gather - first forward) may leave it); with
        # them chunk 0's share of the fsdp axis's elements, at least its fewest dense ones (memory.state),
        # and none of the experts' (chunk 0 may hold no MoE layer)
        share = s["chunk0_dense_numel_min"] / np.maximum(numel_fsdp, 1)
        gather = np.where(c.vpp[:, None] > 1, param_gather_exposed_s(mid(g_fsdp), 1, 0.0, share),
                          mid(param_gather_exposed_s(g_fsdp + g_efsdp, calls, np.inf)))
    # in the dtype the zero1 plan reduces in (TrainingSpec.zero12_reduce_dtype: grad_reduce_dtype,
    # DeepSpeed's model dtype, else reduce_dtype), the collective table's
    red = coll_times(tt, "reduce-scatter", n, numel.ravel() * dtype_bytes(t.zero12_reduce_dtype),
                     stride).reshape(numel.shape)
    return opt + np.where(zero12, gather, 0.0), np.where(zero1, red, 0.0)


def per_step_gather(cfg: Config, tt: TimeTables, c: Candidates, s: dict):
    """ZeRO-1/2's per-step parameter all-gather of each stage as the collective table has it
    (:func:`meshplan.comm.dp_rows._unsharded_rows`), (candidates, pp) arrays: (seconds over fsdp,
    seconds over efsdp, calls of both, elements over fsdp). The routed experts ride in the dense
    gather over fsdp unless they are apart (:func:`~meshplan.mesh.tpsplit.experts_apart_degrees`:
    ep > 1 or etp != tp), then over efsdp (ranks ``ep x etp`` apart); DeepSpeed's engine gathers
    its one flat group over fsdp. Under ``training.overlap_grad_reduce`` a zero1 row's gather is
    Megatron-LM's buckets of each axis (:func:`~meshplan.comm.megatron_buckets.split_buckets`, the
    bucket of the fsdp degree for both, as :func:`~meshplan.comm.megatron_buckets.bucket_sizes`) on
    stage 0 without virtual stages, the only stage whose every chunk Megatron buckets
    (:func:`~meshplan.comm.megatron_buckets.megatron_bucketed`); else one call per axis, no
    slower than the table's calls of its chunks (one per chunk, or chunk 0's buckets at vpp > 1);
    an axis of one rank or no elements has none (the table adds no row). Under ``--fp8-param-gather``
    (:func:`~meshplan.search.memory.fp8_param_rows`) the fsdp axis's elements at 1 B each, a lower
    bound of the table's two buffers (TE's fp8 parameters at 1 B, the rest at the parameter dtype's)."""
    t = cfg.training
    expert = s["expert_numel"]
    apart = experts_apart_degrees(c.ep, c.efsdp, c.fsdp)[:, None] & (t.zero12_engine != "deepspeed")
    numel_fsdp = s["dense_numel"] + np.where(apart, 0, expert) if cfg.model.is_moe else s["dense_numel"]
    stage0 = np.arange(numel_fsdp.shape[1])[None, :] == 0
    bucketed = (c.sh == SHARDING.index("zero1"))[:, None] & t.overlap_grad_reduce & stage0 & (c.vpp[:, None] == 1)
    out, calls = [], np.zeros(numel_fsdp.shape, dtype=np.int64)
    axes = ((c.fsdp, c.tp, numel_fsdp),) + (((c.efsdp, c.ep * c.etp, np.where(apart, expert, 0)),)
                                            if cfg.model.is_moe else ())
    pg = np.broadcast_to(fp8_param_rows(cfg, c)[:, None], numel_fsdp.shape)
    for ranks, apart_of, numel in axes:
        n = np.broadcast_to(ranks[:, None], numel.shape).ravel()
        stride = np.broadcast_to(apart_of[:, None], numel.shape).ravel()
        per = np.where(pg, 1, dtype_bytes(t.param_dtype)) if ranks is c.fsdp else dtype_bytes(t.param_dtype)
        at = lambda k: coll_times(tt, "all-gather", n, np.ravel(k * per),  # noqa: E731
                                  stride).reshape(numel.shape)
        full, rest = np.zeros_like(numel), numel  # a row not bucketed: one call of all, its ``rest``
        if bucketed.any():
            bucket = cfg.memory.bucket_elements(c.fsdp)[:, None]
            full, rest = split_buckets(numel, bucket)
            full, rest = np.where(bucketed, full, 0), np.where(bucketed, rest, numel)
        out.append(at(rest) + (full * at(np.where(full > 0, bucket, 0)) if full.any() else 0.0))
        calls += ((ranks[:, None] > 1) & (numel > 0)) * (full + (rest > 0))
    out += [np.zeros(numel_fsdp.shape)] * (2 - len(out))  # a dense model: nothing over efsdp
    return out[0], out[1], calls, numel_fsdp


def fsdp2_rs_wait(cfg: Config, c: Candidates) -> np.ndarray:
    """Per row of ``c``: whether its FSDP reduce-scatters run on FSDP2's own queue with one in flight
    (``Overlap.fsdp_rs_queue``, :func:`meshplan.schedule.overlap_policy.config_overlap`: framework torch
    under ``zero3_engine = "fsdp2"``, the engine :func:`meshplan.search.candidate.sharding_knobs` gives
    the row: fsdp2 outside sharding zero3, ``searched_zero3_engine`` on it)."""
    t = cfg.training
    if t.framework != "torch":
        return np.zeros(len(c), dtype=bool)
    return (c.sh != SHARDING.index("zero3")) | (t.searched_zero3_engine == "fsdp2")


def reduce_flow_shop_s(n, copy_in_s, rs_s: np.ndarray, ar_s: np.ndarray, rs_wait=False, rs_nic=0.0,
                       ar_nic=0.0) -> np.ndarray:
    """Seconds torch's ``perform_reduce_grad`` takes at least over ``n`` layers of one gradient unit
    (:func:`meshplan.schedule.grad_reduce.perform_reduce_grad`), from the unit's last backward: per
    layer a copy-in (compute stream, ``copy_in_s``), then its reduce-scatter (fsdp stream, ``rs_s``),
    then its HSDP all-reduce (dp_replicate stream, ``ar_s``), each stream serial in layer order.
    ``n`` identical jobs through three serial machines take at least one job's three plus
    ``(n - 1)`` x the longest (a flow shop). The one home of that formula: a chunk's last unit that
    waits for it (``b_wait``, :func:`meshplan.search.layer_bounds.unit_bounds`) and the unit that
    ends a stage's order (:func:`final_reduce_tail`). Arrays broadcast; 0 where ``n`` is 0.

    ``rs_wait`` (per row where an array; FSDP2's one reduce-scatter in flight,
    :func:`meshplan.schedule.grad_reduce.rs_buffer_wait`, torch 2.13 ``_fsdp_param_group.py`` lines
    639-658): a layer's copy-in waits for the previous layer's reduce-scatter, so copy-in and
    reduce-scatter are one machine of ``copy_in_s + rs_s``: ``(ci + rs) + ar + (n - 1) x max(ci + rs, ar)``.

    Seven layers, copy-in 1 ms, reduce-scatter 30 ms, all-reduce 2 ms: 1 + 30 + 2 + 6 x 30 = 213 ms;
    with the wait 31 + 2 + 6 x 31 = 219 ms:

    >>> round(float(reduce_flow_shop_s(np.array(7), 1e-3, 30e-3, 2e-3)) * 1e3, 6)
    213.0
    >>> round(float(reduce_flow_shop_s(np.array(7), 1e-3, 30e-3, 2e-3, rs_wait=True)) * 1e3, 6)
    219.0

    **The NIC both queues share** (``rs_nic``, ``ar_nic``: one reduce-scatter's and one all-reduce's
    NIC seconds, :func:`~meshplan.search.time_tables.coll_nic_s`; 0 off the network). The flow shop
    takes the two collective streams as machines that run at their full speed side by side; the
    rank timeline runs them as network collectives sharing one NIC (:meth:`meshplan.schedule.unit_sim.StreamSim.comm`:
    each at ``min(1, share / demand)`` of its speed, the max-min fair shares of the NIC). Every
    reduce-scatter starts after the first copy-in (its own copy-in, the first on the compute stream
    after the unit's last backward), and the ``n`` reduce-scatters and ``n`` all-reduces are two
    serial queues: from the first copy-in's end they take at least
    :func:`~meshplan.search.nic_bounds.two_queues_s` (the proof there: any other network collective
    running beside them only lowers their rates). So the reductions end no earlier than
    ``copy_in + two_queues_s(n x rs, n x ar)`` after the unit's compute, the larger of the two floors
    is taken. HSDP over dp_replicate 64 with FSDP over cp 4 across nodes (the 405B example's
    ``pp 8 x dp_replicate 64 x cp 4 x tp 8`` shape): both nearly all NIC, so together they run at
    about half speed each, where the flow shop had them at full speed side by side.

    Seven layers, copy-in 1 ms, reduce-scatter 30 ms (NIC 28 ms), all-reduce 20 ms (NIC 19 ms): the
    flow shop 1 + 30 + 20 + 6 x 30 = 231 ms. Sharing the NIC (demands 28 / 30 and 19 / 20, half the NIC
    each) they run at r_a = 15 / 28 and r_b = 10 / 19 of their speed while both run; k_b = (r_a + r_b - 1)
    / r_b = 0.117857 (k_a = 0.115789 over 210 ms saves more), so the two queues take at least 210 + 140 -
    0.117857 x 140 = 333.5 ms (above the NIC's own 7 x (28 + 19) = 329 ms), plus the copy-in: 334.5 ms:

    >>> round(float(reduce_flow_shop_s(np.array(7), 1e-3, 30e-3, 20e-3, False, 28e-3, 19e-3)) * 1e3, 2)
    334.5
    """
    first = np.where(rs_wait, copy_in_s + rs_s, np.maximum(copy_in_s, rs_s))
    longest = np.maximum(first, ar_s)
    shop = copy_in_s + rs_s + ar_s + np.maximum(n - 1, 0) * longest
    if np.any(np.asarray(rs_nic) > 0) and np.any(np.asarray(ar_nic) > 0):  # both on the network somewhere
        shop = np.maximum(shop, copy_in_s + two_queues_s([(n, rs_s, rs_nic)], [(n, ar_s, ar_nic)]))
    return (n >= 1) * shop


def final_reduce_tail(n: np.ndarray, copy_in_s: np.ndarray, rs_s: np.ndarray, ar_s: np.ndarray,
                      rs_wait=False, rs_nic=0.0, ar_nic=0.0) -> np.ndarray:
    """Seconds the reductions of the unit that ends a stage's order (pp > 1: its chunk's last
    gradient unit) run past its compute at least: :func:`reduce_flow_shop_s` less its ``n``
    layers' copy-ins (the step bound counts those in the stage's busy time, ``b_red``), the
    last layer's included; the embedding's and the head's own units only add to it. Arrays
    broadcast; 0 where ``n`` is 0; ``rs_wait``, ``rs_nic``, ``ar_nic`` as :func:`reduce_flow_shop_s`'s.

    Seven layers, copy-in 1 ms, reduce-scatter 30 ms, all-reduce 2 ms: 213 ms less the 7 copy-ins
    = 206 ms (= 30 + 2 + 6 x (30 - 1)):

    >>> round(float(final_reduce_tail(np.array(7), 1e-3, 30e-3, 2e-3)) * 1e3, 6)
    206.0
    """
    return reduce_flow_shop_s(n, copy_in_s, rs_s, ar_s, rs_wait, rs_nic, ar_nic) - n * copy_in_s
