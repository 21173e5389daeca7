"""Unit lower bounds that count the SM contention of FSDP2's layer collectives, for
:func:`meshplan.search.layer_bounds.unit_bounds`: a forward chunk's, beside its prefetched
all-gathers (:func:`forward_sm_bound`), a backward chunk's, beside its all-gathers and
reduce-scatters sharing the NIC (:func:`backward_sm_bound`), and the forward's gather chain with
the copy-outs between (:func:`gather_chain`).

**The rule it rests on** (:mod:`meshplan.schedule.unit_events`, ``_Run._rates``): a kernel runs at
``1 - min(MAX_SM_SHARE, sum of the SM shares of the collectives issued before it that are
running)``, a collective never faster than alone (a network one at ``min(1, share / demand)`` of
its speed, others at 1), the compute stream runs its kernels one at a time in issue order.

**Proof.** Take a window ``[a, b]`` of a unit's compute stream and the kernels that run in it, of
``W`` seconds alone. At each instant the stream runs one kernel or none (idle). A kernel slowed to
rate ``r`` loses ``1 - r`` per second, an idle second loses 1, so ``b - a = W + (loss)``. Let a
*chain* be collectives of SM share ``s`` (``s <= MAX_SM_SHARE``) that run one after another
(disjoint in time, inside the window) and such that every kernel running beside one of them was
issued after it. While a chain member runs beside a kernel the kernel loses at least ``s``; while
it runs beside no kernel the stream is idle. So, pointwise, loss >= ``s [member running] + (1 - s)
[idle]`` (idle: ``1 >= s + (1 - s)``; a kernel: ``loss >= s``), and integrating:
``b - a >= W + s C + (1 - s) I``, ``C`` the members' running time (each at least its seconds alone),
``I`` the window's idle time (at least the seconds of the blocking collectives waited for in it,
each issued after the kernel before it and waited for by the next: the stream idles all of it).

**FSDP2's forward** (:func:`meshplan.schedule.rank_timeline.forward_unit`, prefetch of one layer,
pp 1 without accumulation: every forward gathers): layer ``i``'s all-gather ``AG_i`` is issued
after the copy-out of layer ``i - 1`` (its dependency ``s.last``) and before layer ``i - 1``'s
kernels; layer ``i``'s copy-out waits for it. So ``AG_1 .. AG_{n-1}`` are a chain of the FSDP
all-gather's SM share in the window from ``AG_0``'s start to the last layer's last kernel: each
starts after every kernel issued before it has ended (they precede the copy-out it depends on), and
ends before the next copy-out. ``AG_0`` runs beside no kernel (the embedding's ended before it,
layer 0's copy-out waits for it): ``ag`` idle seconds. Each layer's blocking tp collectives
(torch's tp without async TP: the all-gather opening a block and the reduce-scatter or
all-reduce closing it, :func:`meshplan.schedule.layer_timeline._block`) are idle seconds after
``AG_0``. With ``n`` layers of ``w`` kernel seconds, ``co`` copy-out, ``e`` blocking tp seconds:
``window >= ag + n (w + co) + s (n - 1) ag + (1 - s) n e`` (``ag``'s idle counted whole: it
precedes the chain). The cp ring's own collectives (:func:`meshplan.schedule.ring_timeline.ring_forward`:
a K/V all-gather beside the first SDPA call) are left out: a share ``s_r`` of ``cp_ag`` per layer,
under 1 ms a layer on the 405B example.

The SM share: where the layer's all-gather crosses the network (its NIC seconds > 0:
:func:`~meshplan.search.time_tables.coll_nic_s`), the ring channels' share of the SMs
(:func:`meshplan.schedule.row_shares.nccl_sm_share`: DGX H100 16 / 132); elsewhere 0 (left out).

Hand example (tests/test_search_sm_bound.py): 3 layers, ``ag`` 10 ms, ``w`` 8 ms, ``co`` 0.5 ms,
``e`` 2 ms, ``s`` 0.1: 10 + 3 x 8.5 + 0.1 x 2 x 10 + 0.9 x 3 x 2 = 42.9 ms, where the flow-shop
bound gives max(10 + 3 x 10.5, 3 x 10 + 10.5) = 41.5 ms.
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.schedule.layer_timeline import LAYER_BLOCKS
from meshplan.schedule.row_shares import nccl_net_channels
from meshplan.schedule.unit_sim import MAX_SM_SHARE
from meshplan.search.columns import MIXED
from meshplan.search.space import RECOMPUTE, Candidates


class SmTerms:
    """Per candidate (candidates, 1): ``w`` one dense layer's forward kernel seconds, ``e`` its
    blocking tp collectives' seconds, ``s`` the SM share of its FSDP all-gather (0 where the
    bound does not apply: :func:`sm_terms`); the backward's ``wb``, ``eb`` (its replay's too under
    full recompute), ``sb`` (0 where :func:`backward_sm_bound` does not apply) and ``rho``, the most
    the all-gather and the reduce-scatter progress together per second sharing the NIC
    (:func:`pair_rate`)."""

    def __init__(self, w, e, s, wb=0.0, eb=0.0, sb=0.0, rho=2.0):
        self.w, self.e, self.s, self.wb, self.eb, self.sb, self.rho = w, e, s, wb, eb, sb, rho


def sm_terms(cfg: Config, c: Candidates, cm: dict, od: dict, co: np.ndarray, lazy: np.ndarray,
             rs_wait: np.ndarray) -> SmTerms:
    """The :class:`SmTerms` of the candidates: ``cm`` their collective seconds
    (:func:`~meshplan.search.comm_bounds.comm_times`), ``od`` a dense layer's op seconds
    (:func:`~meshplan.search.layer_chains.layer_ops`), ``co`` FSDP2's layer copy-out (0 where it has
    none: no FSDP2), ``lazy`` the passes gather only when they find the units sharded (pp > 1 or
    accumulation). It applies to dense models under FSDP2 (copy-out > 0) at pp 1 without
    accumulation, torch's blocking tp (no tp_comm_overlap), no per-layer or block AC mix; the
    backward's also at recompute none or full only, with FSDP2's reduce-scatters on their own queue,
    one in flight (``rs_wait``, :func:`~meshplan.search.step_end_bound.fsdp2_rs_wait`), over the
    network."""
    on = (np.asarray(co) > 0) & ~np.asarray(lazy) & (c.ov == 0) & ~np.isin(c.rc, MIXED) & (cm["fsdp_ag_nic"] > 0)
    on &= not cfg.model.is_moe and cfg.training.framework == "torch"
    rings = nccl_net_channels(cfg.cluster)[0] / cfg.cluster.gpu.sms
    on &= 2 * rings <= MAX_SM_SHARE  # the backward's two chains at once below the cap (the proofs' sums)
    w = sum(od[f"f_{b}"] for b in LAYER_BLOCKS)
    e = 2 * (cm["tp_ag"] + np.maximum(cm["tp_sp"], cm["tp_ar"]))  # each block opens and closes (layer_chains)
    col = lambda a: np.asarray(a, dtype=np.float64)[:, None]
    full = c.rc == RECOMPUTE.index("full")
    bon = on & ((c.rc == RECOMPUTE.index("none")) | full) & (cm["fsdp_rs_nic"] > 0) & np.asarray(rs_wait).ravel()
    # backward kernels: input gradients (without the replay: ``bin_``; ``bi_`` at none) and weight
    # gradients, and under full the replayed forward (``br_``), as layer_chains adds them
    wb = sum(np.where(full, od[f"bin_{b}"] + od[f"br_{b}"], od[f"bi_{b}"]) + od[f"bw_{b}"] for b in LAYER_BLOCKS)
    # blocking tp: each block's opening all-gather and closing collective, and the replay's (torch's
    # compiled replay closes no MLP block: layer_timeline.replay_scatters)
    eb = e + np.where(full, 2 * cm["tp_ag"] + np.maximum(cm["tp_sp"], cm["tp_ar"]), 0.0)
    rho = pair_rate(_demand(cm["fsdp_ag_nic"], cm["fsdp_ag"]), _demand(cm["fsdp_rs_nic"], cm["fsdp_rs"]))
    return SmTerms(col(w), col(e), col(np.where(on, rings, 0.0)), col(wb), col(eb), col(np.where(bon, rings, 0.0)),
                   col(rho))


def _demand(nic_s, s) -> np.ndarray:
    """The NIC share a collective holds alone: its NIC seconds over its seconds (time_tables._nic)."""
    return np.divide(nic_s, s, out=np.ones_like(np.asarray(s, dtype=np.float64)), where=np.asarray(s) > 0)


def pair_rate(d1, d2) -> np.ndarray:
    """The most two network collectives of NIC demands ``d1``, ``d2`` progress together per second
    (rates in their seconds alone) while both run: rates ``r <= 1`` with ``r1 d1 + r2 d2 <= 1``
    (max-min shares sum to at most the NIC, each runs at ``min(1, share / demand)``:
    :mod:`meshplan.schedule.unit_events`), the smaller demand filled first.

    >>> float(pair_rate(0.5, 0.5)), float(pair_rate(1.0, 1.0)), round(float(pair_rate(0.8, 0.5)), 3)
    (2.0, 1.0, 1.625)
    """
    lo, hi = np.minimum(d1, d2), np.maximum(d1, d2)
    r1 = np.minimum(1.0, 1.0 / np.maximum(lo, 1e-12))
    return r1 + np.minimum(1.0, np.maximum(1.0 - r1 * lo, 0.0) / np.maximum(hi, 1e-12))


def forward_sm_bound(sm: SmTerms, ag, co, n) -> np.ndarray:
    """A forward chunk of ``n`` layers (``ag``: a layer's all-gather seconds, ``co`` its copy-out),
    seconds, (candidates, pp): ``ag + n (w + co) + s (n - 1) ag + (1 - s) n e`` where the module's
    proof holds (``s`` > 0), else 0; it grows with n."""
    s = sm.s
    val = ag + n * (sm.w + co) + s * np.maximum(n - 1, 0) * ag + (1 - s) * n * sm.e
    return np.where((s > 0) & (n >= 1), val, 0.0)


def gather_chain(ag, co, cf_c, n) -> np.ndarray:
    """FSDP2's forward gather chain (module docstring): ``AG_0``, copy-out 0, ``AG_1``, ..., copy-out
    ``n - 1``, then the last layer's chain: each all-gather is issued after the copy-out before it,
    each copy-out waits for its all-gather: ``n ag + (n - 1) co + cf_c`` (``cf_c`` a layer's chain with
    its copy-out); ``n ag + cf_c`` where ``co`` is 0 (no FSDP2 copy)."""
    return n * ag + np.maximum(n - 1, 0) * co + cf_c


def backward_sm_bound(sm: SmTerms, ag_b, rs, co_b, ci, n) -> np.ndarray:
    """A backward chunk of ``n`` layers (``ag_b``: a layer's backward all-gather, 0 where it keeps the
    forward's; ``rs`` its reduce-scatter; ``co_b``, ``ci`` its copy-out and copy-in), seconds,
    (candidates, pp), where ``sb`` > 0, else 0; it grows with n.

    The window: from the first layer's copy-out to the last layer's copy-in
    (:func:`meshplan.schedule.backward_pass._backward_layers`), ``W = n (wb + co_b + ci)`` of kernels
    (the head's before it, the embedding's after). Two chains of share ``s`` in it (module
    docstring): the all-gathers ``AG_1 .. AG_{n-1}`` (each issued after the copy-out before it, its
    layer's copy-out waiting for it) and the reduce-scatters ``RS_0 .. RS_{n-2}`` (each issued after
    its layer's copy-in, every kernel before it ended; the next copy-in waits for it: FSDP2's one in
    flight). Pointwise loss >= ``s [AG] + s [RS] + (1 - 2 s) [idle]`` (2 s <= MAX_SM_SHARE), so
    ``window >= P + s (2 - rho) T2`` with ``P = W + s Q + (1 - 2 s) n eb``, ``Q = (n - 1)(ag_b + rs)``
    their seconds alone and ``T2`` the time both run: their running times sum to at least ``Q + (2 -
    rho) T2``, as together they progress at most ``rho`` per second (:func:`pair_rate`). And the
    window holds every second either runs, at least ``Q - (rho - 1) T2``. Whatever ``T2``, the window
    is at least the larger of the two, so at least their value where they meet (``P`` where ``P >= Q``).
    The AG's and RS's SM shares are the network rings' (both over the NIC)."""
    s, rho = sm.sb, sm.rho
    m = np.maximum(n - 1, 0)
    q = m * (ag_b + rs)
    p = n * (sm.wb + co_b + ci) + s * q + (1 - 2 * s) * n * sm.eb
    slope = s * (2 - rho)
    meet = p + slope * np.maximum(q - p, 0.0) / np.maximum(slope + rho - 1, 1e-12)
    return np.where((s > 0) & (n >= 1), meet, 0.0)
