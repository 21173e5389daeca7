"""A lower bound on the predicted step time of many search candidates at once, and the
efficiency of their local GEMMs, as numpy arrays.

The bound uses the same numbers as :func:`meshplan.schedule.steptime.step_time`: op times from
:func:`meshplan.compute.layer.layer_costs` (one call per distinct (tp, cp, micro-batch, ep,
etp), every recompute policy from the same ops), collective times from :func:`meshplan.comm.nccl_algorithms.collective_time` on the path
:func:`meshplan.comm.row.axis_path` gives each axis (one call per distinct (stride,
degree): with the canonical order and node-major placement an axis's groups are ranks
``r0 + i * stride``), with the sizes of :func:`meshplan.comm.collectives.collective_table`.
It keeps only what the simulation (:mod:`meshplan.schedule.rank_timeline`, default
:class:`~meshplan.schedule.unit_sim.Overlap`) cannot avoid, so it never exceeds it:

- a layer's **chain**: every compute op in order, the blocking TP collectives before and
  after each block (with SP the all-gather and reduce-scatter, else the all-reduce), the
  blocking EP all-to-alls, the CP exchange beside the Q projection only (the K/V
  all-gather after the K/V projection, before the core attention: ``attention + max(0, ring -
  Q)``; backward the dK/dV reduce-scatter before the K/V projections' input gradients; torch's ring
  attention, :func:`~meshplan.search.layer_chains.chains`: the gather beside its first SDPA step of
  s seconds, ``attention + max(0, AG - s)``, backward ``max(0, AG - s) + (cp - 1) max(0, X - s) + X``
  for its own gather and cp fp32 dK/dV shifts X, the last exposed; Megatron-LM's all-gather CP,
  whose fused QKV GEMM leaves no Q projection apart: the gather, TE's backward gather (a selective
  replay's again) and the reduce-scatter whole; Transformer Engine's p2p ring: each send beside one
  of cp equal steps of the rank's calls, ``max(0, send - s)``), the backward's
  weight-gradient GEMMs as ``max(W, reduce-scatter)``, full recompute's forward replay (under
  torchtitan's per-layer AC, ``layer``, on the layers a stage surely replays: each chunk of n
  layers ``n // ac_freq`` of them, the stage's remaining ``N // ac_freq`` at the smaller increase
  of a chunk: :mod:`~meshplan.search.layer_replays`; the others as no recompute); under
  torchao's float8 TP the tp all-reduces of the casts' amaxes (4 forward, 7 backward per Llama
  layer; the forward's counted as with the float8 all-gather, the fewer), which the casts wait
  for;
- a **unit** (one micro-batch through a chunk of n layers): ``max(AG + n chain,
  n AG + chain)`` forward, ``max(AG + n chain, n AG + (n-2) RS + chain)`` backward, where
  AG, RS are the FSDP all-gather and reduce-scatter of one layer, serial on their stream
  (Megatron FSDP's and DeepSpeed's one queue; FSDP2's all-gathers and reduce-scatters run on two
  streams at once, sharing the NIC: ``n AG + (n-2) RS`` is then the two queues' least time,
  :func:`~meshplan.search.nic_bounds.two_queues_s`, through
  :func:`~meshplan.search.layer_bounds._fsdp_backward`)
  (FSDP2 prefetches one layer; the layer waits for its gather; 0 with pp > 1, and with pp 1
  under ``training.grad_accumulation`` ``no_sync`` or ``no_sync_unsharded``, where a unit
  gathers only when it finds its chunk sharded and reduces once per step: those gathers are
  counted per gathering pass); the all-gather in each weight's gather dtype (float8 Linear
  weights under ``training.fp8_all_gather``); plus the embedding and the
  head (and the loss collectives) where the chunk holds them; where [norm, output] is its own
  unit (torchtitan's units) its pre-backward prefetches the last layer's all-gather, which then
  runs beside the head's backward: a gathering backward of the head's chunk counts its first
  gather less the head's backward time (the stage's other chunks' backwards do not);
  under ``training.reshard_head_after_forward`` (pp 1, ``sync``) each backward first waits
  for that unit's own all-gather and copy-out (:func:`~meshplan.search.gather_passes.head_regathers`), the last layer's gather
  queued behind it;
- FSDP2's **copies on the compute stream** (:func:`~meshplan.search.comm_bounds.fsdp_copies`, :mod:`meshplan.comm.fsdp2`):
  a layer's copy-out after each all-gather its pass waits for (forward; backward with
  ``reshard_after_forward``) before the layer's compute, its copy-in before each reduce-scatter
  after it (every backward with pp 1 under ``sync``, else the chunk's last gradient unit); with
  pp 1 the root unit's copy-out before the embedding (every forward under ``sync``, else
  the forwards that gather it) and copy-in after its gradient (every backward under ``sync``,
  else once); with pp > 1 each end unit's copy-out and copy-in once per step on the stage
  holding it; a MoE layer's routed experts' copy-in (their own unit over efsdp > 1) after each
  backward that reduces them; each counted as compute time serial with the chain;
- **one micro-batch's path**: micro-batch 0 forward through every virtual stage in order and
  back, one p2p send per hop, then stage 0's end (the whole step with one micro-batch);
- the **pipeline**: stage k cannot start before micro-batch 0 went forward through stages
  0..k-1 (each unit + one p2p send), runs all its units one after another, and stage 0
  cannot end before micro-batch m-1's gradient came back through stages k-1..0; the
  bound is the largest over k of ``fill_k + busy_k`` plus the larger of stage k's own
  end (optimizer step at HBM bandwidth, ZeRO-1's exposed parameter all-gather and its
  gradient reduce-scatter issued after the last unit's first layer) and ``drain_k +`` stage
  0's end; with pp > 1 the last unit's tail is at least its chunk's FSDP reductions after it
  (torch's ``perform_reduce_grad``: per layer copy-in, reduce-scatter, HSDP all-reduce on three
  serial streams, the last two sharing the NIC where both cross the network,
  :func:`~meshplan.search.step_end_bound.final_reduce_tail`);
- the **blocking pipeline calls** (torch 2.13's single-stage 1F1B and GPipe, Megatron-LM's 1F1B and
  interleaved 1F1B: :func:`~meshplan.schedule.overlap_policy.p2p_mode`, one schedule run per step):
  a call a stage waits on holds it at least ``k x p2p`` after the unit before it, ``k`` its
  waited transfers sharing the link (the simulator's own calls,
  :func:`meshplan.search.pipeline.call_holds`; ``ceil(k / 2)`` where the boundaries may take
  NVLink and the NIC, which run at once: :func:`~meshplan.search.comm_bounds.p2p_links_apart`):
  the calls between a stage's units join
  ``busy_k``, the one after its last unit is at least beside its tail (the stage's run ends at
  the larger of the two, as ``step_time``'s).

With uneven chunks (the Llama 3 split with vpp > 1) every unit is bounded at its stage's
shortest chunk (``Stages.n_chunk``): each unit term grows with the chunk's layers, so the
bound of a longer chunk's unit is never below it; the chunk with the fewest MoE layers takes
the longest chunk (``n_chunk_hi``) for the others.

Under a split-backward schedule (ZB-V, DualPipeV, ZB-H1: ``Stages.vshape``) only the fill and
every stage's busy time and end are kept (the last unit is a weight gradient; the gradient
returns through input gradients whose bound the units do not separate).

Left out: the **SM contention**, the kernels' slowdown while collectives' NCCL channels hold SMs
(:func:`meshplan.schedule.row_shares.nccl_sm_share`: the NVLink fabric's catalog channels and the
network's rings and send/recv channels, NVIDIA/nccl @5067397; ``step``'s SM contention line,
:meth:`~meshplan.schedule.step_summary.StepTime.contention_s`): every op here takes its own
seconds. Contention only lengthens a kernel (a kernel beside collectives holding a share ``s`` of
the SMs runs at ``1 - s``, never faster), so leaving it out keeps the bound under the step
(tests/test_search_stage_bounds.py checks the 405B stage bounds' tightness against the step less
its contention). Counted only where it is proven to occur: FSDP2's layer all-gathers (forward and
backward) and reduce-scatters over the network at pp 1, each issued before the kernels it runs
beside (:mod:`~meshplan.search.sm_bound`, whose proof also counts the blocking tp waits as idle).

A middle stage's collectives are counted as its own table or stage 0's would count them,
whichever is less, so the bound holds with either convention of
:func:`~meshplan.schedule.steptime.step_time`. Tests check ``bound <= step_time`` on every
feasible candidate of small worlds; the search ranks by the exact step time and uses the
bound only to decide what it need not simulate.

This module combines the unit bounds into the step's (:func:`step_lower_bound`); the parts live
beside it: :mod:`~meshplan.search.time_tables` (op and collective lookups),
:mod:`~meshplan.search.comm_bounds` (collective seconds, FSDP2's copies),
:mod:`~meshplan.search.gather_passes` (which passes gather), :mod:`~meshplan.search.layer_chains`
(layer chains, GEMM efficiency), :mod:`~meshplan.search.layer_bounds` (unit bounds),
:mod:`~meshplan.search.step_end_bound` (the stage's step-end ops).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.pipeline.unshard_window import pipeline_window, unshards_first
from meshplan.search.comm_bounds import p2p_links_apart
from meshplan.search.gather_passes import end_chunk_passes
from meshplan.search.layer_bounds import unit_bounds
from meshplan.search.memory import Stages
from meshplan.search.pipeline import call_holds
from meshplan.search.space import Candidates, candidate_schedule
from meshplan.search.time_tables import TimeTables


def step_lower_bound(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict) -> np.ndarray:
    """Lower bound of :func:`meshplan.schedule.steptime.step_time` per candidate, seconds; ``st``,
    ``s``: :func:`~meshplan.search.memory.stage_layout` and ``state`` of the same group."""
    u = unit_bounds(cfg, tt, c, st, s)
    v = c.vpp[:, None]
    one = v == 1
    r = u["n_long"]  # chunks of n_chunk_hi layers (the Llama 3 split with vpp > 1; else 0)
    empty0, busy = _busy(cfg, c, st, u, v, one, r)
    f0 = u["f_core0"] + u["emb_f"] + one * u["head_f"]       # chunk 0's forward unit on each stage
    b0 = u["b_core0"] + u["emb_b"] + one * u["head_b"]       # chunk 0's backward unit on each stage
    p2p, tail, end = u["p2p"], u["tail"], u["end"]
    # blocking pipeline calls (torch's 1F1B, Megatron-LM's): each call between a stage's units holds
    # it k x p2p past the unit before (busy), the one after its last unit at least beside the tail
    inner, after = call_holds(cfg, c, st.m[:, 0], p2p_links_apart(tt, c))
    busy = busy + inner * p2p
    tail = np.maximum(tail, after * p2p)
    fill = _fill(cfg, c, st, u, f0 + p2p, ~empty0 * u["f_extra"])
    drain = np.cumsum(b0 + p2p, axis=1) - (b0 + p2p)
    own = fill + busy + tail + end
    # the copy-ins of the chunk that ends stage k's order (in ``busy``) run after its last unit has
    # sent its gradient on (grad_reduce.perform_reduce_grad, ``tail``): not before the drain
    via0 = fill + busy - np.maximum(u["b_red"], u["b_red_hi"]) + drain + tail[:, :1] + end[:, :1]
    out = np.maximum(own, via0).max(axis=1)
    # 1F1B: micro-batch 0 forward through every stage and back to stage k, then stage k's
    # units after its first backward ((m - 1) B and (m - w) F), then micro-batch m-1's
    # gradient back to stage 0.
    # (stage k's last gradient unit, with its copy-ins ``b_red``, is one of its backward units)
    path = (f0.sum(axis=1, keepdims=True) + b0.sum(axis=1, keepdims=True) + (st.m - 1) * b0
            + (st.m - st.w_step) * f0 + 2 * (st.k.shape[1] - 1) * p2p + u["b_red"])
    # (its copy-ins after its send: not on the way back to stage 0)
    one_f = np.maximum(path - u["b_red"] + tail[:, :1] + end[:, :1], path - drain + tail + end).max(axis=1)
    # split-backward schedules (V-shaped, ZB-H1): stage k still starts after micro-batch 0's chunk-0 forward through
    # stages 0..k-1 and runs every unit, but its last unit is a weight gradient (tail not
    # bounded here) and the gradient's way back runs input gradients only (no drain bound)
    v_out = (fill + busy + end).max(axis=1)
    path1 = _one_microbatch(c, st, u, v, r)
    return np.where(st.vshape[:, 0], v_out, np.maximum(np.where(c.vpp == 1, np.maximum(out, one_f), out), path1))


def _fill(cfg: Config, c: Candidates, st: Stages, u: dict, hop: np.ndarray, extra: np.ndarray) -> np.ndarray:
    """(candidates, pp) seconds before stage k can start micro-batch 0's forward of its chunk 0: its
    input's arrival, micro-batch 0 forward through stages 0..k-1, each ``hop`` (its chunk-0 forward unit
    and one p2p send) plus ``extra``, the gathering pass's extra (``f_extra``: micro-batch 0's forward
    finds every chunk sharded).

    Where the pass gathers itself (single-stage schedules, Megatron-LM, DeepSpeed) the gathers start
    with it, after the input: ``fill_{k+1} = fill_k + hop_k + extra_k``. Under torch's multi-stage
    schedules (:func:`~meshplan.pipeline.unshard_window.unshards_first`) every stage's chunk 0 is
    UNSHARDed at the step's start (:mod:`meshplan.schedule.window_unshard`): its all-gathers run on the
    FSDP stream while the stage waits for its input (exposed ``max(0, gathers - lead_s)``, ``lead_s``
    the wait), and the forward starts once both are there. On stage 0 (no wait: ``lead_s`` 0) the
    extra stays whole; on a later stage j the forward starts no earlier than its input's arrival and
    runs at least its unit: ``fill_{j+1} = fill_j + hop_j``, the extra left out (whatever of the
    gathers the wait does not hide). Adding it there too (as before) counted gathers the exact
    timeline may hide behind the wait, which a stage k >= 2's fill summed over stages 1..k-1.
    :func:`~meshplan.search.gather_passes.gathering_passes` leaves those passes out of ``busy`` alike."""
    p = st.k.shape[1]
    window = pipeline_window(cfg.training.framework, p)
    cut = np.zeros(len(c), dtype=bool)  # candidates whose later stages' chunk 0 is UNSHARDed ahead
    if window:
        for v, ps in set(zip(c.vpp.tolist(), c.ps.tolist())):
            if unshards_first(candidate_schedule(v, ps), window):
                cut |= (c.vpp == v) & (c.ps == ps)
    first = hop + np.where(cut[:, None] & (np.arange(p) > 0), 0.0, extra)
    return np.cumsum(first, axis=1) - first


def _busy(cfg: Config, c: Candidates, st: Stages, u: dict, v: np.ndarray, one: np.ndarray,
          r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stage 0's first chunk empty, per candidate and stage; each stage's busy seconds): every
    unit's core and the ends' units over ``st.m`` micro-batches, the gathering passes' extras, the
    reductions, and the waits of the chunks that do not end the stage's order. The gathering
    passes: none of a chunk without layers (the Llama 3 split at one slot per virtual stage: stage
    0's first chunk, the head stage's last), and the head's chunk's backwards apart (the only ones
    whose first gather runs beside the head's backward). The v - 1 chunks that do not end the
    stage's order wait for their reductions (``b_wait``): whichever chunk ends it, at least r - 1
    of those hold n_chunk_hi layers (the wait grows with n); ``more_replays``: per-layer AC's
    replays beyond each chunk's fewest (layer_replays)."""
    ends = end_chunk_passes(c, st, pipeline_window(cfg.training.framework, st.k.shape[1]))
    empty0, empty_l = st.first & (st.n_chunk == 0), st.last & (st.n_chunk == 0) & ~one
    g_f = u["g_f"] - empty0 * ends["f0"] - empty_l * ends["fl"]
    g_b = u["g_b"] - empty0 * ends["b0"] - empty_l * ends["bl"]
    g_bh = np.where(one, st.last * g_b, st.last * ~empty_l * ends["bl"])
    w_long = np.maximum(r - 1, 0)
    w_short = v - 1 - w_long
    busy = st.m * ((v - r) * (u["f_core"] + u["b_core"]) + r * (u["f_core_hi"] + u["b_core_hi"])
                   + u["emb_f"] + u["emb_b"] + u["head_f"] + u["head_b"] + u["more_replays"]) \
        + g_f * u["f_extra"] + (g_b - g_bh) * u["b_extra"] + g_bh * u["b_extra_head"] \
        + (v - r) * u["b_red"] + r * u["b_red_hi"] + u["root_extra"] \
        + w_short * (u["b_wait"] - u["b_red"]) + w_long * (u["b_wait_hi"] - u["b_red_hi"])
    return empty0, busy


def _one_microbatch(c: Candidates, st: Stages, u: dict, v: np.ndarray, r: np.ndarray) -> np.ndarray:
    """One micro-batch's path, seconds per candidate: micro-batch 0 runs forward through every
    virtual stage in order (chunk j of stages 0..p-1, then chunk j + 1), each hop one p2p send,
    then backward through all of them in reverse, and stage 0 ends after its backward of chunk 0:
    the whole step when m is 1, and what bounds few micro-batches over many chunks (interleaved
    1F1B, 1 micro-batch on pp 4 x vpp 8: about 3.5x the fill-busy-drain bound)."""
    p = st.k.shape[1]
    one_mb = ((v - r) * (u["f_core"] + u["b_core"]) + r * (u["f_core_hi"] + u["b_core_hi"])
              + u["emb_f"] + u["emb_b"] + u["head_f"] + u["head_b"] + u["more_replays"]).sum(axis=1)
    return one_mb + 2 * (p * c.vpp - 1) * u["p2p"][:, 0] + u["end"][:, 0]


