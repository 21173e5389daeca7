"""Axis vocabulary and order spellings.

Canonical order is outermost first, as torch DeviceMesh: for shape (2, 2, 2) with names
(dp, cp, tp), ``rank = 4*dp + 2*cp + tp``, the last name varies fastest. A Megatron order
string names the fastest-varying axis first (``tp-cp-ep-dp-pp``); it is converted only at
input and output.

Known axes and what they partition:

========== ===================================================================
pp          pipeline stages (layers)
dp          data parallel; replicas or ZeRO/FSDP shards per ``training.sharding``
dp_replicate HSDP replica axis (gradients all-reduced)
dp_shard    FSDP/ZeRO shard axis (parameters/gradients/optimizer state sharded)
cp          context parallel (sequence split for attention)
tp          tensor parallel (with ``sequence_parallel`` for Megatron-style SP)
ep          expert parallel; re-factors the dense dp_shard*cp*tp block
etp         expert tensor parallel (1 or tp)
========== ===================================================================

Any other name (``cfg``, ``sp``...) is a user-named axis: it takes part in the rank math but
meshplan assigns it no model semantics. A user-named axis close to a known one (``tq``) is
most likely a slip: :func:`axis_name_warnings` says so, and the plan goes on with it.
"""

from __future__ import annotations

import difflib

from meshplan.errors import ConfigError

DENSE_AXES = ("pp", "dp_replicate", "dp", "dp_shard", "cp", "tp")
EXPERT_AXES = ("ep", "etp")
KNOWN_AXES = DENSE_AXES + EXPERT_AXES


def from_megatron_order(order: str) -> tuple[str, ...]:
    """Canonical (outermost-first) names from a Megatron order string (fastest first).

    >>> from_megatron_order("tp-cp-ep-dp-pp")
    ('pp', 'dp', 'ep', 'cp', 'tp')

    Raises ConfigError on an empty or repeated name.
    """
    names = [n.strip() for n in order.split("-")]
    if any(not n for n in names):
        raise ConfigError("mesh.order", f"empty axis name in {order!r}; write names joined by '-', e.g. 'tp-cp-dp-pp'")
    _check_unique(names, "mesh.order")
    return tuple(reversed(names))


def to_megatron_order(names: tuple[str, ...] | list[str]) -> str:
    """Megatron order string (fastest first) from canonical names.

    >>> to_megatron_order(("pp", "dp_shard", "tp"))
    'tp-dp_shard-pp'
    """
    return "-".join(reversed(tuple(names)))


def _check_unique(names, field: str) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(field, f"axis {n!r} appears twice; name each axis once")
        seen.add(n)


def axis_name_warnings(names, field: str = "mesh.names") -> list[str]:
    """One warning per user-named axis that looks like a slip for a known axis (difflib
    close match, or the same name in another case).

    >>> [w.split("? ")[0] for w in axis_name_warnings(["dp_shard", "tq"])]
    ["mesh.names: 'tq' is not a standard axis; did you mean 'tp'"]
    >>> axis_name_warnings(["dp_shard", "cfg", "tp"])
    []
    """
    out = []
    for n in names:
        if n in KNOWN_AXES:
            continue
        close = [n.lower()] if n.lower() in KNOWN_AXES else difflib.get_close_matches(n.lower(), KNOWN_AXES, n=3,
                                                                                         cutoff=0.5)
        if close:
            quoted = [repr(c) for c in close]
            alts = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
            out.append(f"{field}: {n!r} is not a standard axis; did you mean {alts}? "
                       f"(planned as a user-named axis: rank math only, no model semantics)")
    return out
