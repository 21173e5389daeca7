"""The memory ``fix:`` line's expert-parallel variant (newcomer trial nc58 #1): an MoE mesh that
does not fit offered more expert parallelism, the knob that shards the routed experts.

Each rank of an ep group holds ``experts / ep`` of every MoE layer's routed experts (their
parameters, gradients and, unsharded by ZeRO-1/DDP, the copies the optimizer works on); ep does not
take ranks from the dense axes but re-factors the dense block dp_shard x cp x tp (= efsdp x ep x etp,
:mod:`meshplan.spec.axes.ep`), so the dense mesh, its groups and its collectives stay as they are and
only the expert state per rank and the all-to-alls change. The fix's other variants (tp x2, pp x2,
recompute, sharding, cp: :mod:`meshplan.plan_fix`) leave the experts whole on every rank.

:func:`ep_variant` plans the larger ep degrees the rules take (each divides the routed experts, and
ep x etp the dense block: :func:`meshplan.plan_fix_rules.experts_fix`'s rule), smallest first, and
returns the first that fits with 15% of usable memory free (the search's headroom rule,
:func:`meshplan.memory.headroom.tight`), else the first that fits: the fewest ranks in each
all-to-all that fit, so the group stays inside a node where such an ep does. Where none fits, the
one with the lowest peak (the largest planned), which :func:`meshplan.plan_fix.memory_fix` names
as no fix alone when it lowers the peak.

Mixtral-8x7B at pp 4 x dp 64, zero1 (Megatron-LM), no recompute, 32 dgx-h100 (tests/test_nc58_fixes.py):
ep 1 keeps 8 layers x 8 experts x 3 x 4096 x 14336 = 11.27e9 expert parameters on a rank, 6 B each
(bf16 parameter + fp32 gradient) = 63.0 GiB before the optimizer state; ep 2 fits but tight, ep 4
keeps two experts a layer (15.7 GiB of them) and 15% free.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.keymap import OWN, KeyMap
from meshplan.memory.headroom import tight
from meshplan.plan import Plan
from meshplan.plan_fix_rules import with_ep
from meshplan.plan_variant import planned

#: Larger ep degrees planned at most (each a whole build_plan); 256 experts from ep 1: 2 .. 256, 8.
MAX_EP_PLANS = 8


def ep_degrees(experts: int, ep: int, etp: int, block: int) -> list[int]:
    """The ep degrees above ``ep``, smallest first, that divide ``experts`` and whose ep x ``etp``
    divides the dense ``block`` (dp_shard x cp x tp).

    >>> ep_degrees(8, 1, 1, 64), ep_degrees(256, 8, 1, 128), ep_degrees(8, 8, 1, 64), ep_degrees(128, 4, 2, 16)
    ([2, 4, 8], [16, 32, 64, 128], [], [8])
    """
    return [k for k in range(ep + 1, experts + 1) if experts % k == 0 and block % (k * etp) == 0]


def ep_variant(plan: Plan, keys: KeyMap = OWN) -> Optional[tuple[str, Plan]]:
    """(words, plan) of the smallest larger ep that fits with 15% free, else of the smallest that fits
    (module docstring), else of the largest planned (the lowest peak; the caller keeps it only where
    it lowers the peak); None for a dense model, a mesh pinned by ``mesh.rank_to_gpu``, or where no
    larger ep is valid. The words name the degree in ``keys``' words (``--expert-model-parallel-size 4``)
    with the experts per ep rank."""
    cfg, mesh = plan.config, plan.mesh
    if not cfg.model.is_moe or cfg.mesh is None or plan.spec.rank_to_gpu is not None:
        return None
    fits: list[tuple[str, Plan]] = []
    last: Optional[tuple[str, Plan]] = None
    for k in ep_degrees(cfg.model.experts, mesh.ep, mesh.etp, mesh.block_size)[:MAX_EP_PLANS]:
        p = planned(replace(cfg, mesh=with_ep(cfg.mesh, k)))
        if p is None:
            continue
        n = cfg.model.experts // k
        last = (f"{keys.axis('ep')} {k} ({n} expert{'s' if n > 1 else ''} per ep rank; the dense mesh unchanged)", p)
        if not p.feasible:
            continue
        t = p.timeline
        if not tight(t.verdict_bytes, t.usable_bytes, p.config.memory.fragmentation_fraction):
            return last
        fits.append(last)
    return fits[0] if fits else last
