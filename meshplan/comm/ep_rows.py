"""The ep rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
the all-to-all dispatch and combine of every MoE layer and, dropless, the count exchange
before each dispatch.

- EP: all-to-all dispatch and combine per MoE layer in forward, and their gradients in
  backward; full recompute replays both (non-reentrant checkpoint: the combine's output is
  saved by the gate multiply), so backward has 4 per MoE layer, and so does Megatron-LM's
  selective ``moe`` module (:func:`meshplan.spec.recompute_modules.moe_replayed`: its checkpoint
  re-runs the whole MoE layer, the count exchange and etp calls included). Each rank dispatches a
  fixed buffer of ``experts x C`` token rows, ``C = ceil(f * T * top_k / experts)`` for the
  ``T`` distinct tokens it routes (:func:`meshplan.compute.routing.routed_tokens`: its own
  ``b*s/cp / tp`` under Megatron-LM, ``b*s/cp * etp/tp`` under torch; capacity
  factor f = ``training.moe_capacity_factor``, default 1: overflowing copies dropped, empty
  slots padded), so the bytes are known before
  routing; torch cannot size an all-to-all by the router's (data-dependent) counts without
  an extra exchange of counts. Equal to ``T * top_k`` rows when experts divides it, the
  balanced-routing size used before (runtime MoE: :mod:`meshplan.runtime.execution.moe`, measured
  with torch 2.13 on gloo). Dropless (the default of both frameworks, ``training.moe_dropless``): the
  buffer is the busiest rank's received rows under the stated ``moe_hottest_expert_share``
  (its all-to-all sets the time every rank waits for); unstated, the expected load of uniform
  routing, ``T * top_k`` rows (``T * top_k / ep`` per peer), the balanced case. Before each
  dispatch the ranks exchange their per-expert counts: under torch one all-to-all of
  ``experts`` int64 per MoE layer in forward (and per replayed layer in backward), no gradient
  (torchtitan's ``_token_count_exchange``), under Megatron-LM an all-gather of them over ep x
  etp (:func:`_count_rows`), rows of cadence :data:`DROPLESS_COUNTS`, timed by the comm model
  (latency-dominated) and placed on the ep stream before each dispatch, which waits for it
  (:func:`meshplan.schedule.comm_streams.comm_kind`; its device-to-host sync is not modelled).
"""

from __future__ import annotations

import numpy as np

from meshplan.comm import deepep
from meshplan.comm.stage_context import StageContext
from meshplan.compute.routing import RoutingOptions, routed_tokens, routing
from meshplan.compute.recompute import op_replays_ep
from meshplan.mesh.layout import grid_groups
from meshplan.spec.recompute_modules import moe_replayed
from meshplan.units import dtype_bytes

#: Cadence of Megatron-LM's etp all-gather and reduce-scatter of the dispatched tokens (:func:`_etp_rows`).
ETP_GATHER = "every MoE layer (etp all-gather of the dispatched tokens, reduce-scatter of the experts' output)"

#: Cadence of the dropless count exchange (:func:`_count_rows`); its elements' dtype and bytes.
DROPLESS_COUNTS = "every MoE layer (per-expert token counts, before the dispatch)"
COUNT_DTYPE, COUNT_BYTES = "int64", 8


def ep_rows(add, c: StageContext) -> None:
    """The stage's ep rows (the table's builder for ep): the dispatch and combine all-to-alls of
    every MoE layer, their gradients and a recomputed layer's replay (full AC, Megatron-LM's ``moe``,
    op-level SAC where its policy does not save them: :func:`meshplan.compute.recompute.op_replays_ep`), of the routing model's
    received rows (:func:`meshplan.compute.routing.routing`), and dropless, the count exchange
    (:func:`_count_rows`); under Megatron-LM at etp > 1 the etp all-gather and reduce-scatter
    (:func:`_etp_rows`). With ep 1 only those of Megatron-LM at etp > 1 (its count exchange and etp
    collectives, or the deepep dispatcher's calls over the etp ranks), else none."""
    t, mesh, m = c.training, c.mesh, c.model
    dt = t.compute_dtype
    moe = sum(m.is_moe_layer(i) for i in c.layers)
    if not moe:
        return
    # full, Megatron's moe, or an op-level SAC policy that does not save the all-to-alls (238fa99's Qwen3)
    replayed = sum(m.is_moe_layer(i) and (c.layer_recomputed(k) or moe_replayed(t, True) or op_replays_ep(m, t))
                   for k, i in enumerate(c.layers))
    tokens, gathered = routed_tokens(t.micro_batch * c.seq_local, mesh.degree("tp"), mesh.etp, t.framework)
    ro = RoutingOptions.of(t)
    rows = routing(ro, tokens, m.top_k, m.experts, mesh.ep).recv_rows
    if gathered > 1 and t.moe_dispatcher != "deepep":
        _etp_rows(add, c, gathered * rows * m.hidden * dtype_bytes(dt), moe + replayed)
        if mesh.ep <= 1 and ro.dropless:  # Megatron-LM exchanges its counts at ep 1 too (over the etp ranks)
            _count_rows(add, c, moe, replayed)
    deepep_group = t.moe_dispatcher == "deepep" and mesh.ep * mesh.etp > 1  # tp_ep: at ep 1 too (deepep.group_reason)
    if mesh.ep <= 1 and not deepep_group:
        return
    if t.moe_dispatcher == "deepep":
        _deepep_rows(add, c, tokens, moe, replayed)
        return
    a2a = rows * m.hidden * dtype_bytes(dt)
    add("ep", "forward", "all-to-all", a2a, dt, 2 * moe, "every MoE layer (dispatch, combine)", "expert GEMMs")
    add("ep", "backward", "all-to-all", a2a, dt, 2 * moe + 2 * replayed, "every MoE layer", "expert GEMMs")
    if ro.dropless:  # the per-expert counts, no gradient (a replayed forward exchanges them again)
        _count_rows(add, c, moe, replayed)


def _etp_rows(add, c: StageContext, size: int, backward: int) -> None:
    """Megatron-LM's etp collectives of every MoE layer (framework megatron, etp > 1, the alltoall
    dispatcher; NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/moe/token_dispatcher.py``):
    ``dispatch_postprocess`` all-gathers the tokens the rank received from the ep all-to-all over the
    expert tensor-parallel group (``gather_from_sequence_parallel_region(..., group=self.tp_group)``,
    :741-751; ``self.tp_group = pg_collection.expt_tp``, :86), so each local expert's GEMM takes its
    etp ranks' rows, and ``combine_preprocess`` reduce-scatters the experts' partial output back
    (``reduce_scatter_to_sequence_parallel_region``, :824-833; in the router probabilities' dtype,
    the compute dtype unless ``--moe-router-dtype`` is set, which meshplan does not model) before the
    combine all-to-all. ``size``: the gathered buffer, ``etp x`` the rank's received rows ``x h`` in the
    compute dtype (nccl-tests' size of both). Backward: the reduce-scatter's gradient is an all-gather
    and the all-gather's a reduce-scatter (tensor_parallel/mappings.py), one each per MoE layer, and a
    recomputed layer's replay issues both again: ``backward`` calls each. The probabilities' own
    all-to-all and all-gather (one value per row) are not listed."""
    dt, moe = c.training.compute_dtype, sum(c.model.is_moe_layer(i) for i in c.layers)
    for op in ("all-gather", "reduce-scatter"):
        add("etp", "forward", op, size, dt, moe, ETP_GATHER, "expert GEMMs" if op == "all-gather" else "combine")
        add("etp", "backward", op, size, dt, backward, ETP_GATHER, "expert GEMMs")


def _count_rows(add, c: StageContext, moe: int, replayed: int) -> None:
    """The dropless dispatch's count exchange, before each dispatch of ``moe`` MoE layers in
    forward and of the ``replayed`` ones again in backward; no gradient, none in the combine or
    the backward all-to-alls (they reuse the split sizes). torch (torchtitan's
    ``_token_count_exchange``, pytorch/torchtitan b5bcd76 ``torchtitan/models/common/token_dispatcher.py``
    lines 245-273): one ``all_to_all_single`` of the ``experts`` int64 counts over ep, ``experts / ep``
    to each peer: ``8 E`` bytes. Megatron-LM (``MoEAlltoAllTokenDispatcher.preprocess``,
    NVIDIA/Megatron-LM d98e8a6 ``megatron/core/transformer/moe/token_dispatcher.py`` lines 541-590):
    ``gather_from_sequence_parallel_region`` of the ``E`` counts over ``tp_ep_group``, the ep x etp
    ranks of one expert-data-parallel slot, wherever ``ep_size > 1 or tp_size > 1`` (line 557; its
    ``tp_size`` is the etp group's, so at ep 1 too where etp > 1): an all-gather of ``8 E ep etp`` bytes (output); its
    drop-and-pad path (``--moe-pad-expert-input-to-capacity``, a capacity plan) exchanges nothing.
    A few hundred bytes to a few hundred KB: the comm model's latency term sets the time
    (:func:`meshplan.comm.row.path_time` on the group's path). The device-to-host copy of the split sizes that
    follows is not modelled."""
    m, mesh = c.model, c.mesh
    if c.training.framework != "megatron":
        add("ep", "forward", "all-to-all", m.experts * COUNT_BYTES, COUNT_DTYPE, moe, DROPLESS_COUNTS, "dispatch")
        add("ep", "backward", "all-to-all", m.experts * COUNT_BYTES, COUNT_DTYPE, replayed, DROPLESS_COUNTS,
            "the replayed dispatch")
        return
    rank0, groups = tp_ep_group(mesh)
    size = m.experts * COUNT_BYTES * len(rank0)
    add("ep", "forward", "all-gather", size, COUNT_DTYPE, moe, DROPLESS_COUNTS, "dispatch", ranks=rank0, groups=groups)
    add("ep", "backward", "all-gather", size, COUNT_DTYPE, replayed, DROPLESS_COUNTS, "the replayed dispatch",
        ranks=rank0, groups=groups)


def tp_ep_group(mesh) -> tuple[tuple[int, ...], np.ndarray]:
    """(rank 0's group, every group) of Megatron-LM's ``tp_ep`` process groups: the ep x etp ranks of
    one expert-data-parallel slot of the expert mesh (:meth:`~meshplan.mesh.resolve.Mesh.expert_grid`,
    etp innermost), the group of its dropless count exchange and of its flex dispatcher."""
    names, grid = mesh.expert_grid()
    groups = grid_groups(grid, [names.index("ep"), names.index("etp")])
    return tuple(int(x) for x in groups[np.flatnonzero((groups == 0).any(axis=1))[0]]), groups


#: The cadence words of the deepep rows (the table's and the timeline's).
DEEPEP_CADENCE = "every MoE layer (deepep dispatch, combine)"


def _deepep_rows(add, c: StageContext, tokens: int, moe: int, replayed: int) -> None:
    """``training.moe_dispatcher = "deepep"``: the dispatch and combine of every MoE layer (and their
    gradients, a replayed layer's again) as DeepEP runs them (:func:`meshplan.comm.deepep.call`:
    ``tokens`` distinct tokens, its own (:func:`meshplan.compute.routing.routed_tokens`), once per destination node
    across nodes, fanned out over NVLink), over the ep x etp ranks of the flex dispatcher's
    ``tp_ep`` group (:func:`tp_ep_group`; the ep axis itself at etp 1), in
    rows of op all-to-all and algorithm ``deepep`` (the timeline's ep stream takes them as the
    all-to-alls), timed per call as the mean of a dispatch and a combine, their bytes per link class
    stated (:attr:`~meshplan.comm.row.CollectiveRow.link_bytes`); ``size`` is what one rank sends per
    call on its bottleneck link, through its NIC across nodes (inside one node: on NVLink), so the
    table's algbw and busbw (the same for a deepep row) compare with that link's rate; the NVLink
    fan-out bytes are in the cadence words. No count exchange: DeepEP's layout and notify run inside
    its dispatch."""
    t, m, mesh = c.training, c.model, c.mesh
    dt = t.compute_dtype
    token_bytes = m.hidden * dtype_bytes(dt)

    keep = deepep.keep_share(t, m, tokens, mesh.ep)  # a capacity's kept share (dropless: 1)
    group = dict(zip(("ranks", "groups"), tp_ep_group(mesh))) if mesh.etp > 1 else {}

    def timer(path, cluster):
        k = deepep.call_on(path, cluster, m, tokens, token_bytes, mesh.ep, keep, mesh.etp)
        size = k.network_bytes if path.kind == "network" else k.nvlink_bytes
        words = (f"{DEEPEP_CADENCE[:-1]}; per call {k.network_bytes / 1e6:,.1f} MB through the NIC, "
                 f"{k.nvlink_bytes / 1e6:,.1f} MB on NVLink)")
        return "deepep", k.time_s, (k.nvlink_bytes, k.network_bytes), size, words

    add("ep", "forward", "all-to-all", token_bytes, dt, 2 * moe, DEEPEP_CADENCE, "expert GEMMs", timer=timer, **group)
    add("ep", "backward", "all-to-all", token_bytes, dt, 2 * moe + 2 * replayed, DEEPEP_CADENCE, "expert GEMMs",
        timer=timer, **group)
