"""The note on what the ep rows model for a model with group-limited (node-limited) routing, or
under the deepep dispatcher (:mod:`meshplan.comm.deepep`)
(newcomer trial 22 #3): DeepSeek-V3 routes each token to its top 8 of 256 experts chosen within
the top ``topk_group`` = 4 of ``n_group`` = 8 expert groups (DeepSeek-AI, 'DeepSeek-V3 Technical
Report', arXiv 2412.19437, section 2.1.2: "each token will be sent to at most M = 4 nodes";
config.json ``topk_method noaux_tc``, ``n_group 8``, ``topk_group 4``; ModelSpec ``n_group``,
``topk_group``). An all-to-all dispatch sends ``top_k`` copies of each token whatever the groups
(:mod:`meshplan.comm.ep_rows`); the deepep dispatcher sends one per destination node and its bytes
follow the groups (:mod:`meshplan.comm.deepep`). The step says which in one line beside the ep
verdict or hint, and the search under its table where a row shown has ep > 1, so the ep traffic
figure is read with it.
"""

from __future__ import annotations

from typing import Optional

from meshplan.comm.deepep import describe, keep_share
from meshplan.compute.routing import routed_tokens
from meshplan.plan import Plan
from meshplan.plan_moe import ep_span

def routing_caveat(plan: Plan) -> Optional[str]:
    """The ``note:`` line for a plan at ep > 1 whose model has group-limited routing or whose
    dispatcher is deepep, else None: what the ep rows model (:func:`routing_note`), with the ep
    group's node span from the placement."""
    mesh = plan.mesh
    if mesh.ep < 2:
        return None
    flex = plan.config.training.moe_dispatcher == "deepep"
    t = plan.config.training  # routed per rank, as ep_rows
    tokens = routed_tokens(plan.tokens_per_microbatch, mesh.degree("tp"), mesh.etp, t.framework)[0]
    keep = keep_share(plan.config.training, plan.config.model, tokens, mesh.ep) if plan.config.model.experts else 1.0
    return routing_note(plan.config.model, mesh.ep, plan.config.training.moe_dispatcher,
                        ep_span(mesh, plan.placement, flex)[0], keep, mesh.etp)


def routing_note(model, ep: int, dispatcher: str = "alltoall", nodes: Optional[int] = None,
                 keep: float = 1.0, etp: int = 1) -> Optional[str]:
    """The ``note:`` line for ``model`` (a :class:`~meshplan.spec.model.ModelSpec`) at ``ep`` > 1
    (step's plan, or the search's widest ep shown): under the deepep dispatcher what
    :func:`meshplan.comm.deepep.describe` says is modelled (``nodes``: the ep x etp group's node span;
    None: the search's rows, which differ); under alltoall, for a model with group-limited routing
    (``n_group``, ``topk_group``), that the all-to-all's bytes do not depend on it; else None."""
    if not model.experts or ep < 2:
        return None
    if dispatcher == "deepep":
        if nodes is None:
            return ("note: ep rows are DeepEP's dispatch and combine (training.moe_dispatcher deepep): a token "
                    "crosses once to each other destination node and fans out over NVLink there, the expected "
                    "copies from top_k, experts, the group's node span and the routing groups (uniform routing), "
                    "timed at DeepEP's published bandwidths (catalog deepep.toml)")
        return "note: " + describe(model, ep, nodes, keep, etp)
    if model.n_group is None:
        return None
    n, k = model.n_group, model.topk_group
    return (f"note: ep all-to-all bytes are planned for plain top-k routing ({model.top_k} copies of each token, "
            f"to any of the {model.experts} experts); {model.name}'s group-limited routing (n_group {n}, "
            f"topk_group {k}: experts from {k} of {n} groups, at most {k} nodes per token in DeepSeek-V3) changes "
            f"no byte of an all-to-all, which sends one copy per routed expert; training.moe_dispatcher = "
            f"\"deepep\" (framework megatron) plans DeepEP's dispatch, one copy per destination node")
