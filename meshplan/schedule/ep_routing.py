"""The caveat on the ep all-to-all figures of a model with group-limited (node-limited) routing
(newcomer trial 22 #3): DeepSeek-V3 routes each token to its top 8 of 256 experts chosen within
the top ``topk_group`` = 4 of ``n_group`` = 8 expert groups (DeepSeek-AI, 'DeepSeek-V3 Technical
Report', arXiv 2412.19437, section 2.1.2: "each token will be sent to at most M = 4 nodes";
config.json ``topk_method noaux_tc``, ``n_group 8``, ``topk_group 4``). meshplan plans plain top-k
(the catalog's and the Hugging Face reader's ``source`` say so): ``top_k`` copies of each token,
spread over the ep ranks as if any expert could be chosen (:mod:`meshplan.comm.ep_rows`). The
step says so in one line beside the ep verdict or hint, and the search under its table where a row
shown has ep > 1, so the ep traffic figure is read with it.
"""

from __future__ import annotations

import re
from typing import Optional

from meshplan.plan import Plan

#: How the model's ``source`` names the group-limited routing (catalog ``models.toml`` and
#: :mod:`meshplan.spec.hf_families`): ``n_group 8, topk_group 4``.
_GROUPS = re.compile(r"n_group (\d+), topk_group (\d+)")


def routing_groups(source: str) -> Optional[tuple[int, int]]:
    """(n_group, topk_group) named in a model's ``source``, or None.

    >>> routing_groups("the node-limited routing (noaux_tc, n_group 8, topk_group 4) is planned as top-k")
    (8, 4)
    """
    m = _GROUPS.search(source)
    return (int(m.group(1)), int(m.group(2))) if m else None


def routing_caveat(plan: Plan) -> Optional[str]:
    """The ``note:`` line for a plan whose model has group-limited routing at ep > 1, else None."""
    return routing_note(plan.config.model, plan.mesh.ep)


def routing_note(model, ep: int) -> Optional[str]:
    """The ``note:`` line for ``model`` (a :class:`~meshplan.spec.model.ModelSpec`) with group-limited
    routing at ``ep`` > 1 (step's plan, or the search's widest ep shown), else None."""
    groups = routing_groups(model.source or "")
    if not model.experts or ep < 2 or groups is None:
        return None
    n, k = groups
    return (f"note: ep all-to-all bytes are planned for plain top-k routing ({model.top_k} copies of each token, "
            f"to any of the {model.experts} experts); {model.name}'s group-limited routing (n_group {n}, "
            f"topk_group {k}: experts from {k} of {n} groups, at most {k} nodes per token in DeepSeek-V3) is not "
            f"modelled: a plain all-to-all sends the same bytes, a dispatch that sends one copy per node "
            f"(DeepEP) sends fewer across the network")
