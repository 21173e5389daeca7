"""The registered parallel axes: :class:`Axis` names them (the names a config writes) and
:data:`AXES` maps each to its :class:`~meshplan.spec.axes.base.AxisDef`, built in the axis
family's own module (``pp``, ``dp`` (dp_replicate, dp), ``fsdp`` (dp_shard), ``cp``, ``tp``
(+SP), ``ep`` (ep, etp)). The order of :data:`AXES` is the canonical mesh order, outermost
first (torchtitan ``ParallelDims``), dense axes then expert axes. Later layers loop over it:
the validity rules (:func:`rules`), the search's columns (:func:`search_axes`), the ways each
tensor dimension is split (:func:`divisor`: the local shapes, the activation memory, the
search's bounds), the collective table's row builders (``AxisDef.rows``), the default
placement weights (:func:`placement_weights`), the foreign vocabularies.

>>> [str(a) for a in AXES]
['pp', 'dp_replicate', 'dp', 'dp_shard', 'cp', 'tp', 'ep', 'etp']
>>> [r.key for r in rules()]  # doctest: +NORMALIZE_WHITESPACE
['expert_block', 'heads', 'torch_kv_heads', 'ffn', 'vocab', 'expert_ffn', 'layers', 'experts', 'expert_dim1',
 'megatron_moe_sp', 'torch_etp', 'seq_cp', 'megatron_cp_attention', 'torch_cp_flex',
 'seq_tp', 'batch']
>>> [c.column for _, c in search_axes()]
['pp', 'dpr', 'dps', 'cp', 'tp', 'ep', 'etp']
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Callable

from meshplan.spec.axes import cp, dp, ep, fsdp, pp, tp
from meshplan.spec.axes.base import AxisDef, Dim, Rule, SearchColumn


class Axis(StrEnum):
    """Parallel axes by the name a config gives them (``mesh.names``, ``[mesh.degrees]``). A
    StrEnum: ``Axis("tp") is Axis.TP`` and a member formats as its name, so it indexes
    anything keyed by the name.

    >>> Axis("dp_shard") is Axis.DP_SHARD, f"{Axis.TP}"
    (True, 'tp')
    """

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP = "dp"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EP = "ep"
    ETP = "etp"


AXES: dict[Axis, AxisDef] = {
    Axis.PP: pp.PP,
    Axis.DP_REPLICATE: dp.DP_REPLICATE,
    Axis.DP: dp.DP,
    Axis.DP_SHARD: fsdp.DP_SHARD,
    Axis.CP: cp.CP,
    Axis.TP: tp.TP,
    Axis.EP: ep.EP,
    Axis.ETP: ep.ETP,
}


def rules() -> list[Rule]:
    """Every registered axis's rules in the plan's order of checks (:attr:`Rule.order`)."""
    return sorted((r for a in AXES.values() for r in a.rules), key=lambda r: r.order)


def search_axes() -> list[tuple[Axis, SearchColumn]]:
    """(axis, search column) of every searched axis, in mesh order: the dense axes, then the
    expert axes."""
    cols = [(name, a.search, a.expert) for name, a in AXES.items() if a.search is not None]
    return [(n, c) for n, c, e in cols if not e] + [(n, c) for n, c, e in cols if e]


#: Every tensor dimension, in :class:`Dim` order (iterating the enum itself is slow).
DIMS = tuple(Dim)


def divisor(dim: Dim, degree: Callable[[str], Any], sequence_parallel: bool = False) -> Any:
    """Ways ``dim`` is split on one rank: the product of ``degree(name)`` over the registered
    axes whose :attr:`AxisDef.divides` names it (``degree``: a mesh's degree by axis name,
    1 for an axis the mesh lacks, as an int; or the search's degree columns, numpy arrays,
    which give an array). ``sequence (SP)`` counts only under ``sequence_parallel``.

    >>> deg = {"cp": 2, "tp": 4, "ep": 8}
    >>> [divisor(d, lambda a: deg.get(a, 1), True) for d in (Dim.SEQUENCE, Dim.SP_SEQUENCE, Dim.HEADS, Dim.EXPERTS)]
    [2, 4, 4, 8]
    >>> divisor(Dim.SP_SEQUENCE, lambda a: deg.get(a, 1))
    1
    """
    if dim is Dim.SP_SEQUENCE and not sequence_parallel:
        return 1
    out: Any = 1
    for name, a in AXES.items():
        if dim in a.divides:
            out *= degree(str(name))
    return out


def divisors(degree: Callable[[str], Any], sequence_parallel: bool = False) -> dict[Dim, Any]:
    """:func:`divisor` of every :class:`Dim` at once, reading each axis's degree once.

    >>> deg = {"cp": 2, "tp": 4}
    >>> d = divisors(lambda a: deg.get(a, 1), True)
    >>> d[Dim.SEQUENCE], d[Dim.SP_SEQUENCE], d[Dim.FFN], d[Dim.BATCH]
    (2, 4, 4, 1)
    """
    out: dict[Dim, Any] = dict.fromkeys(DIMS, 1)
    for name, a in AXES.items():
        if a.divides:
            k = degree(str(name))
            for d in a.divides:
                if d is not Dim.SP_SEQUENCE or sequence_parallel:
                    out[d] = out[d] * k
    return out


def placement_weights() -> dict[str, float]:
    """Default placement weights of every axis (and the derived axes each brings), heaviest
    first; equal weights keep the registry's order (tp before etp, cp before sp).

    >>> list(placement_weights())[:4]
    ['tp', 'etp', 'cp', 'sp']
    """
    pairs = [(k, w) for a in AXES.values() for k, w in a.weights.items()]
    return dict(sorted(pairs, key=lambda kw: -kw[1]))


def foreign_names(framework: str) -> dict[str, str]:
    """``{foreign name: meshplan axis}`` for ``framework`` (``torchtitan`` or ``megatron``).

    >>> foreign_names("torchtitan")["fsdp"], foreign_names("megatron")["dp"]
    ('dp_shard', 'dp')
    """
    return {f: str(name) for name, a in AXES.items() for f in getattr(a, framework)}
