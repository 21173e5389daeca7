"""Axis vocabulary and order spellings.

Canonical order is outermost first, as torch DeviceMesh: for shape (2, 2, 2) with names
(dp, cp, tp), ``rank = 4*dp + 2*cp + tp``, the last name varies fastest. A Megatron order
string names the fastest-varying axis first (``tp-cp-ep-dp-pp``); it is converted only at
input and output.

The known axes, what each partitions and everything else meshplan knows about it are the
axis registry's (:data:`meshplan.spec.axes.registry.AXES`, one module per axis family).

The vocabulary itself (known axes, torchtitan's and Megatron-LM's names, the ``fsdp``
alias, the close-name check) lives in :mod:`meshplan.spec.axes`, which the config reader
applies; this module converts order spellings.
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.spec.axes import DENSE_AXES, EXPERT_AXES, KNOWN_AXES

__all__ = ["DENSE_AXES", "EXPERT_AXES", "KNOWN_AXES", "from_megatron_order", "megatron_lm_order", "order_words",
           "to_megatron_order"]


def from_megatron_order(order: str) -> tuple[str, ...]:
    """Canonical (outermost-first) names from a Megatron order string (fastest first).

    >>> from_megatron_order("tp-cp-ep-dp-pp")
    ('pp', 'dp', 'ep', 'cp', 'tp')

    Raises ConfigError on an empty or repeated name.
    """
    names = [n.strip() for n in order.split("-")]
    if any(not n for n in names):
        raise ConfigError("mesh.order", f"empty axis name in {order!r}; write names joined by '-', e.g. 'tp-cp-dp-pp'")
    check_unique_axes(names, "mesh.order")
    return tuple(reversed(names))


def to_megatron_order(names: tuple[str, ...] | list[str]) -> str:
    """Megatron order string (fastest first) from canonical names.

    >>> to_megatron_order(("pp", "dp_shard", "tp"))
    'tp-dp_shard-pp'
    """
    return "-".join(reversed(tuple(names)))


#: Megatron-LM's axis names, in its default order: ``initialize_model_parallel(order="tp-cp-ep-dp-pp")``
#: (megatron/core/parallel_state.py at d98e8a6; megatron/training/initialize.py passes that, or
#: "tp-cp-ep-pp-dp" under --use-tp-pp-dp-mapping). Its RankGenerator knows no other name.
MEGATRON_LM_AXES = ("tp", "cp", "ep", "dp", "pp")


def megatron_lm_order(names: tuple[str, ...] | list[str]) -> tuple[str | None, str]:
    """(the order string of canonical ``names`` in Megatron-LM's own axis names, fastest first, or
    None where it has none; the mapping, or why not). dp_replicate outside dp_shard is its one dp
    (``--num-distributed-optimizer-instances`` = dp_replicate: the optimizer sharded over the inner
    dp_shard ranks); ep goes where Megatron-LM's expert grid has it, between cp and dp (meshplan's expert
    grid, (efsdp, ep, etp), is that one, wherever the config names ep); etp is the expert grid's tp, no
    token of the string.

    >>> megatron_lm_order(("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    ('tp-cp-ep-dp-pp', 'dp = dp_replicate x dp_shard')
    >>> megatron_lm_order(("pp", "dp", "ep", "cp", "tp"))
    ('tp-cp-ep-dp-pp', '')
    >>> megatron_lm_order(("dp", "cfg", "pp", "sp", "tp"))
    (None, "Megatron-LM has no axis 'cfg'")
    >>> megatron_lm_order(("dp_shard", "dp_replicate"))
    (None, "dp_shard outside dp_replicate: Megatron-LM's one dp shards its optimizer over the inner ranks")
    """
    dense = [n for n in names if n not in ("ep", "etp")]
    data = [n for n in dense if n in ("dp", "dp_shard", "dp_replicate")]
    stray = [n for n in dense if n not in MEGATRON_LM_AXES and n not in data]
    if stray:
        return None, f"Megatron-LM has no axis {stray[0]!r}"
    if data and data not in (["dp"], ["dp_shard"], ["dp_replicate"], ["dp_replicate", "dp_shard"]):
        return None, f"{' outside '.join(data)}: Megatron-LM's one dp shards its optimizer over the inner ranks"
    if len(data) == 2 and dense.index("dp_shard") != dense.index("dp_replicate") + 1:
        return None, "an axis between dp_replicate and dp_shard: Megatron-LM has one dp"
    order = [n for n in reversed(dense) if n != "dp_replicate" or len(data) == 1]
    order = ["dp" if n in data else n for n in order]
    if "ep" in names:  # Megatron-LM's expert grid: tp (etp), ep, dp, pp
        at = next((i for i, n in enumerate(order) if n in ("dp", "pp")), len(order))
        order.insert(at, "ep")
    mapping = "" if data in ([], ["dp"]) else f"dp = {' x '.join(data)}"
    return "-".join(order), mapping


def order_words(names: tuple[str, ...] | list[str]) -> str:
    """The plan's echo of a mesh's order: Megatron-LM's order string (:func:`megatron_lm_order`), with
    the mapping and meshplan's own spelling (:func:`to_megatron_order`, as ``mesh.order`` takes it)
    where they differ; where Megatron-LM has none, meshplan's spelling and why.

    >>> order_words(("pp", "dp", "ep", "cp", "tp"))
    "Megatron order 'tp-cp-ep-dp-pp'"
    >>> order_words(("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"))
    "Megatron order 'tp-cp-ep-dp-pp' (dp = dp_replicate x dp_shard; as mesh.order, fastest first: 'ep-tp-cp-dp_shard-dp_replicate-pp')"
    >>> order_words(("dp", "cfg", "pp", "sp", "tp"))
    "mesh.order 'tp-sp-pp-cfg-dp' (fastest first; no Megatron-LM order: Megatron-LM has no axis 'cfg')"
    """
    given = to_megatron_order(names)
    order, why = megatron_lm_order(names)
    if order is None:
        return f"mesh.order '{given}' (fastest first; no Megatron-LM order: {why})"
    if order == given:
        return f"Megatron order '{order}'"
    return f"Megatron order '{order}' ({why + '; ' if why else ''}as mesh.order, fastest first: '{given}')"


def check_unique_axes(names, field: str) -> None:
    """Refuse an axis named twice in ``names`` (axis names, outermost first) of config field
    ``field``: :class:`~meshplan.errors.ConfigError` naming the field and the axis."""
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(field, f"axis {n!r} appears twice; name each axis once")
        seen.add(n)
