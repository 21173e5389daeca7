"""The expert-parallel part of a plan (:func:`meshplan.plan.build_plan`): where rank 0's ep group
sits (:func:`ep_span`), a token's copies under the deepep dispatcher for the ep constraint line
(:func:`deepep_ep_copies`) and the routing notes a MoE plan prints (:func:`moe_notes`). Pure
functions of the config, mesh and placement; the plan calls them, the step's ep hint and routing
note read :func:`ep_span` too.
"""

from __future__ import annotations

import numpy as np

from meshplan.comm.deepep import copies as deepep_copies, describe as describe_deepep, keep_share
from meshplan.comm.ep_rows import tp_ep_group
from meshplan.compute.routing import RoutingOptions, balance_note, routed_tokens, routing
from meshplan.config import Config
from meshplan.mesh.resolve import Mesh
from meshplan.placement.assign import Placement
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


def ep_span(mesh: Mesh, placement: Placement, flex: bool = False) -> tuple[int, int]:
    """(nodes, ranks on the busiest of them) of rank 0's ep group under ``placement``, or with ``flex``
    of its ep x etp group (:func:`meshplan.comm.ep_rows.tp_ep_group`, the deepep dispatch's); (1, 1) at ep 1."""
    if mesh.ep < 2:
        return 1, 1
    ranks = list(tp_ep_group(mesh)[0]) if flex else mesh.group_of(0, "ep")
    _, counts = np.unique(placement.node[ranks], return_counts=True)
    return len(counts), int(counts.max())


def deepep_ep_copies(config: Config, mesh: Mesh, nodes: int, tokens: int) -> tuple[float, float, int] | None:
    """Under ``training.moe_dispatcher = "deepep"`` at ep > 1, a token's copies across nodes, its NVLink
    fan-out copies (:func:`meshplan.comm.deepep.copies` over rank 0's ep x etp group on ``nodes`` nodes, of
    the copies the capacity keeps of the tokens a rank dispatches, :func:`meshplan.compute.routing.routed_tokens`
    of its ``tokens`` local tokens) and its routed copies (top_k), for the ep line
    (:func:`meshplan.spec.axes.ep.ep_reason`); else None."""
    m, t = config.model, config.training
    if t.moe_dispatcher != "deepep" or mesh.ep < 2:
        return None
    keep = keep_share(t, m, routed_tokens(tokens, mesh.degree("tp"), mesh.etp, t.framework)[0], mesh.ep)
    c = deepep_copies(m.experts, m.top_k, mesh.ep, nodes, m.n_group, m.topk_group, keep, mesh.etp)
    return c.other_nodes, c.nvlink, m.top_k


def moe_notes(m: ModelSpec, t: TrainingSpec, mesh: Mesh, tokens: int, nodes: int) -> tuple[str, ...]:
    """The notes of a MoE plan: the capacity (or the dropless rows) every ep rank uses, with its
    arithmetic from the ``tokens`` local tokens of a micro-batch, under deepep at ep > 1 what its
    dispatch over ``nodes`` nodes (:func:`ep_span` of the ep x etp group) sends, and the load-balance
    assumption (:func:`meshplan.compute.routing.balance_note`); () for a dense model."""
    if not m.is_moe:
        return ()
    tp, ro = mesh.degree("tp"), RoutingOptions.of(t)
    # compute.routing.routed_tokens: Megatron-LM routes each rank's own sequence shard (its etp ranks
    # then all-gather what they received); torch's tp ranks split their tokens tp/etp ways
    routed, g = routed_tokens(tokens, tp, mesh.etp, t.framework)
    origin = ("" if tp == 1 else f"{tokens} local tokens / tp {tp}" if t.framework == "megatron"
              else f"{tokens} local tokens x etp {mesh.etp} / tp {tp}")
    if t.moe_dispatcher == "deepep" and mesh.ep > 1:  # its bytes replace the all-to-all's and its counts
        own = routed  # each rank dispatches its own tokens to all etp ranks
        head = (f"MoE dropless, tokens per rank T = {origin + ' = ' if origin else ''}{own}" if ro.dropless else
                routing(ro, own, m.top_k, m.experts, mesh.ep).describe(ro, m.top_k, m.experts, mesh.ep, origin))
        notes: tuple[str, ...] = (head + "; " + describe_deepep(m, mesh.ep, nodes, keep_share(t, m, own, mesh.ep),
                                                                 mesh.etp)
                                  + "; no count exchange apart (DeepEP's notify runs inside its dispatch)",)
    else:
        r = routing(ro, routed, m.top_k, m.experts, mesh.ep)
        notes = (r.describe(ro, m.top_k, m.experts, mesh.ep, origin),)
        if g > 1:  # comm.ep_rows._etp_rows
            notes += (f"MoE etp {g} (Megatron-LM): each rank's {r.recv_rows} received rows all-gathered over etp, "
                      f"{g} x {r.recv_rows} = {g * r.recv_rows} rows x hidden {m.hidden} x "
                      f"{dtype_bytes(t.compute_dtype)} B = {g * r.recv_rows * m.hidden * dtype_bytes(t.compute_dtype):,} B "
                      "for the expert GEMMs, and their output reduce-scattered back before the combine (the etp rows)",)
    # the assumption and its key, once (as step, search, memory)
    return notes + tuple(n for n in (balance_note(m, t),) if n)
