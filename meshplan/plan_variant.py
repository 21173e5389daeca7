"""A plan's variant for its ``fix:`` lines (:mod:`meshplan.plan_fix`, :mod:`meshplan.plan_fix_nodes`):
the config's mesh with other degrees, written in the config's own form (names + shape, or
Megatron's order + degrees), its words, and the variant re-planned by
:func:`meshplan.plan.build_plan` (the same rules and memory timeline as the plan).

>>> from meshplan.keymap import OWN
>>> mesh_words({"pp": 1, "dp_shard": 2, "tp": 4}, OWN)
'dp_shard 2 x tp 4'
"""

from __future__ import annotations

from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.keymap import KeyMap
from meshplan.plan import Plan, build_plan

#: The data axes a variant takes its degrees from (and grows with the nodes), first found first.
DATA_AXES = ("dp_shard", "dp")


def variant_mesh(plan: Plan, degrees: dict[str, int]):
    """The config's mesh spec with ``degrees`` (axes added where absent: pp outermost, tp
    innermost, SP on with tp > 1)."""
    spec = plan.spec
    sp = spec.sequence_parallel or degrees.get("tp", 1) > 1
    if spec.names is not None:
        return spec.model_copy(update={"names": list(degrees), "shape": list(degrees.values()),
                                       "sequence_parallel": sp})
    names = [n for n in (spec.order or "").split("-") if n]  # Megatron's order, fastest first
    if "tp" in degrees and "tp" not in names:  # a new tp first, a new cp right after tp, a new pp last
        names.insert(0, "tp")
    if "cp" in degrees and "cp" not in names:
        names.insert(names.index("tp") + 1 if "tp" in names else 0, "cp")
    if "pp" in degrees and "pp" not in names:
        names.append("pp")
    return spec.model_copy(update={"degrees": dict(degrees), "sequence_parallel": sp, "order": "-".join(names)})


def mesh_words(degrees: dict[str, int], keys: KeyMap) -> str:
    """``dp_shard 2 x tp 4``: the axes of degree > 1, each in ``keys``' words."""
    return " x ".join(f"{keys.axis(n)} {d}" for n, d in degrees.items() if d > 1)


def tried(cfg: Config) -> Plan | str:
    """The plan of ``cfg``, or why it is refused (the error it raises, or its first reason)."""
    try:
        p = build_plan(cfg, reports=False)
    except (ConfigError, ValueError) as e:
        return str(e)
    return p if isinstance(p, Plan) else (p.reasons[0] if p.reasons else "refused")


def planned(cfg: Config) -> Optional[Plan]:
    """The plan of ``cfg`` (None where it does not resolve or is refused)."""
    p = tried(cfg)
    return p if isinstance(p, Plan) else None


#: Every data axis whose ranks a sharded variant folds into one dp_shard (ZeRO and FSDP shard over
#: the whole data axis; a replica axis of DDP holds none of the state's shards).
ALL_DATA_AXES = ("dp_replicate", "dp", "dp_shard")


def folded(degrees: dict[str, int]) -> dict[str, int]:
    """``degrees`` with its data axes folded into one ``dp_shard`` at the first one's place, so that
    a sharded variant shards over every data rank (newcomer trial 27 #A: DDP over ``dp_replicate 32``
    with ``sharding = "zero3"`` kept the replica axis and sharded nothing).

    >>> folded({"dp_replicate": 32}), folded({"dp_replicate": 4, "dp_shard": 8, "tp": 2}), folded({"pp": 2, "tp": 8})
    ({'dp_shard': 32}, {'dp_shard': 32, 'tp': 2}, {'pp': 2, 'tp': 8})
    """
    data = [n for n in degrees if n in ALL_DATA_AXES]
    total = 1
    for n in data:
        total *= degrees[n]
    out: dict[str, int] = {}
    for n, d in degrees.items():
        if n not in data:
            out[n] = d
        elif "dp_shard" not in out:
            out["dp_shard"] = total
    return out


def resplit(degrees: dict[str, int], k: int) -> Optional[dict[str, int]]:
    """``degrees`` with ``k`` times fewer replicas and ``k`` times larger shards (HSDP's
    ``dp_replicate`` / k, ``dp_shard`` x k; the data ranks and the world kept), None where
    dp_replicate does not split by k or the mesh has no dp_shard.

    >>> resplit({"dp_replicate": 32, "dp_shard": 8}, 2), resplit({"dp_replicate": 3, "dp_shard": 8}, 2)
    ({'dp_replicate': 16, 'dp_shard': 16}, None)
    """
    r = degrees.get("dp_replicate", 1)
    if "dp_shard" not in degrees or r % k or r < k:
        return None
    return degrees | {"dp_replicate": r // k, "dp_shard": degrees["dp_shard"] * k}
