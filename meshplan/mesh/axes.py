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

__all__ = ["DENSE_AXES", "EXPERT_AXES", "KNOWN_AXES", "from_megatron_order", "to_megatron_order"]


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


def check_unique_axes(names, field: str) -> None:
    """Refuse an axis named twice in ``names`` (axis names, outermost first) of config field
    ``field``: :class:`~meshplan.errors.ConfigError` naming the field and the axis."""
    seen = set()
    for n in names:
        if n in seen:
            raise ConfigError(field, f"axis {n!r} appears twice; name each axis once")
        seen.add(n)
