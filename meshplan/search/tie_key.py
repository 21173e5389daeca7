"""The tie key of the search's order (:mod:`meshplan.search.rank`): one candidate's mesh
(:func:`simplicity_of`: axes of degree > 1, ``tp * pp * cp * ep``, tp) then its settings off
their default (:func:`knob_key`), smaller first; :func:`simplicity` reads it off a search
candidate, :func:`tie_key` off any mesh (``meshplan compare``'s plans). :data:`KEY_TERMS` names
each position when it decides a pair, :func:`knob_words` the settings a key holds.
"""

from __future__ import annotations

from typing import Callable, Optional

from meshplan.pipeline.registry import get
from meshplan.search.columns import PIPELINE, RECOMPUTE, Candidates
from meshplan.search.reshard_key import reshard_key, reshard_value
from meshplan.spec.mesh import Schedule
from meshplan.spec.axes.registry import search_axes


#: Recompute policies by what they replay in backward, cheapest first (the tie rule's order):
#: none; Megatron-LM's selective (the attention core); torchtitan's op-level SAC (every op but
#: the saved mms, SDPA and reduce-scatters); torchtitan's per-layer AC (every ``ac_freq``-th
#: layer in full: half of them at its default 2); Megatron-LM's block recompute (the first n
#: layers of each chunk in full, n short of the chunk: :mod:`meshplan.search.block_recompute`);
#: full (every layer).
RECOMPUTE_BY_COST = ("none", "selective", "op", "layer", "block", "full")


def _on_off(v: int) -> str:
    return "on" if v else "off"


#: A plan's pipeline schedule outside the search's (:data:`PIPELINE`: 1F1B and its
#: interleaved order, ZBV, DualPipeV, ZB-H1), e.g. GPipe: off the default, after those.
OTHER_SCHEDULE = len(PIPELINE)


def _schedule_word(v: int) -> str:
    return PIPELINE[v] if v < len(PIPELINE) else "another schedule"


#: Each position of a tie key (:func:`simplicity`: the mesh's :func:`simplicity_of`, then
#: :func:`knob_key`): what the criterion is called when it decides a pair
#: (:func:`meshplan.search.rank.decide`), the words of :data:`meshplan.search.rank.RULE_LINE`,
#: and how its value is printed.
KEY_TERMS: tuple[tuple[str, Callable[[int], str]], ...] = (
    ("fewer axes of degree > 1", str), ("lower tp*pp*cp*ep", str), ("lower tp", str),
    ("fewer settings off their default", str), ("cheaper recompute", lambda v: RECOMPUTE_BY_COST[v]),
    ("no tp overlap", _on_off), ("fewer virtual stages", str),
    ("reshard_after_forward at the mesh's default", reshard_value),
    ("the even layer split", lambda v: "short end stages" if v else "even"),
    ("the default pipeline schedule", lambda v: _schedule_word(v)))


def simplicity_of(degree: Callable[[str], int]) -> tuple[int, int, int]:
    """(axes of degree > 1, tp * pp * cp * ep, tp) of one mesh, ``degree(column)`` giving the
    degree of each searched axis by its search column (``pp``, ``dpr``, ``dps``, ``cp``, ``tp``,
    ``ep``, ``etp``); smaller is simpler. :func:`simplicity` reads a search candidate,
    :func:`meshplan.compare.sides.side_of` a plan's mesh.

    >>> deg = {"pp": 4, "dps": 8, "tp": 2}
    >>> simplicity_of(lambda col: deg.get(col, 1))
    (3, 8, 2)
    """
    axes = sum(int(degree(col.column) > 1) for _, col in search_axes())
    mp = degree("tp") * degree("pp") * degree("cp") * degree("ep")
    return axes, mp, degree("tp")


def implied_vpp(schedule: int) -> int | None:
    """The virtual stages a schedule of :data:`PIPELINE` index ``schedule`` fixes by itself: 2
    for a V-shaped one (ZB-V, DualPipeV: two chunks per rank, :attr:`PipelineSchedule.chunks
    <meshplan.pipeline.base.PipelineSchedule.chunks>`), None for 1F1B and its interleaved order,
    for ZB-H1 (vpp 1: no vpp setting either) and for :data:`OTHER_SCHEDULE`, whose vpp is set apart. torchtitan sets no vpp for a V-shape:
    ``pipeline_parallel_schedule = "ZBVZeroBubble"`` (or ``"DualPipeV"``) alone builds 2 x pp model
    parts (:data:`meshplan.interop.torchtitan_tables.V_SCHEDULES`, as ``import`` reads it), and
    torch's ZB-V and DualPipeV take exactly two stages per rank, so that vpp 2 is no setting of its own.

    >>> implied_vpp(0), implied_vpp(PIPELINE.index("zbv")), implied_vpp(PIPELINE.index("dualpipev"))
    (None, 2, 2)
    >>> implied_vpp(PIPELINE.index("zb_h1"))
    """
    return get(Schedule(PIPELINE[schedule])).chunks if 0 < schedule < len(PIPELINE) else None


def knob_key(recompute: str, tp_overlap: bool, vpp: int, reshard: Optional[bool], short_ends: bool = False,
             schedule: int = 0, reshard_default: bool = True) -> tuple[int, ...]:
    """The settings of one candidate as the tie rule orders them, smaller first: (how many are
    off their default, recompute's place in :data:`RECOMPUTE_BY_COST`, tp overlap, vpp,
    ``reshard_after_forward`` off the mesh's default (:class:`~meshplan.search.reshard_key.ReshardKey`),
    short end stages, the :data:`PIPELINE` schedule's index). ``reshard``: the setting, None where it acts on nothing (no
    FSDP over a data axis); ``reshard_default``: its default at the mesh
    (:meth:`~meshplan.spec.training.TrainingSpec.reshard_default`: false under torch's FSDP2 with
    pp > 1). A V-shaped schedule's vpp 2 (:func:`implied_vpp`) is not counted apart from the
    schedule: ZB-V is one setting, as interleaved 1F1B at vpp 2 is.

    >>> knob_key("selective", True, 6, True), knob_key("none", True, 6, True), knob_key("none", False, 6, True)
    ((3, 1, 1, 6, 0, 0, 0), (2, 0, 1, 6, 0, 0, 0), (1, 0, 0, 6, 0, 0, 0))
    >>> knob_key("none", False, 2, True, schedule=PIPELINE.index("zbv")), knob_key("none", False, 2, True)
    ((1, 0, 0, 2, 0, 0, 1), (1, 0, 0, 2, 0, 0, 0))

    Kept gathered is off the default at pp 1, resharded under torch's FSDP2 with pp > 1:

    >>> knob_key("none", False, 1, False), knob_key("none", False, 1, True, reshard_default=False)
    ((1, 0, 0, 1, 1, 0, 0), (1, 0, 0, 1, 1, 0, 0))
    >>> knob_key("none", False, 1, False, reshard_default=False), knob_key("none", False, 1, None, reshard_default=False)
    ((0, 0, 0, 1, 0, 0, 0), (0, 0, 0, 1, 0, 0, 0))
    """
    rc = RECOMPUTE_BY_COST.index(recompute)
    flags = (rc, int(tp_overlap), int(vpp), reshard_key(reshard, reshard_default), int(short_ends), int(schedule))
    own_vpp = vpp > 1 and vpp != implied_vpp(schedule)  # a V-shape's 2 chunks come with its name
    off = sum(int(x > 0) for x in flags[:2]) + int(own_vpp) + sum(int(x > 0) for x in flags[3:])
    return (int(off),) + flags


def simplicity(c: Candidates, i: int) -> tuple[int, ...]:
    """The tie key of candidate ``i``: the mesh's :func:`simplicity_of` (axes of degree > 1,
    tp * pp * cp * ep, tp), then its settings' :func:`knob_key`; smaller first.

    >>> from meshplan.search.columns import Candidates
    >>> import numpy as np
    >>> one = lambda v: np.array([v])
    >>> c = Candidates(pp=one(4), dpr=one(1), dps=one(8), cp=one(1), tp=one(2), ep=one(1), etp=one(1), mb=one(1),
    ...                rc=one(0), vpp=one(1), sh=one(1), rf=one(1), ov=one(0), us=one(0), ps=one(0))
    >>> simplicity(c, 0)
    (3, 8, 2, 0, 0, 0, 1, 0, 0, 0)
    """
    return tie_key(lambda col: int(c.degree(col)[i]), RECOMPUTE[c.rc[i]], bool(c.ov[i]), int(c.vpp[i]),
                   c.reshard_setting(i), bool(c.us[i]), int(c.ps[i]), c.reshard_default_at(i))


def tie_key(degree: Callable[[str], int], recompute: str, tp_overlap: bool, vpp: int, reshard: Optional[bool],
            short_ends: bool = False, schedule: int = 0, reshard_default: bool = True) -> tuple[int, ...]:
    """The tie key of one mesh and its settings, the one the search orders its candidates by
    (:func:`simplicity`) and ``meshplan compare`` two plans by
    (:func:`meshplan.compare.sides.side_of`): :func:`simplicity_of` ``degree``, then
    :func:`knob_key` of the settings (``reshard`` None where it acts on nothing, weighed against
    ``reshard_default``); smaller first.

    >>> deg = {"pp": 4, "dps": 8, "tp": 2}
    >>> tie_key(lambda col: deg.get(col, 1), "layer", False, 1, True)
    (3, 8, 2, 1, 3, 0, 1, 0, 0, 0)
    """
    return simplicity_of(degree) + knob_key(recompute, tp_overlap, vpp, reshard, short_ends, schedule,
                                            reshard_default)


def knob_words(key: tuple) -> str:
    """The settings a full tie key holds, as a row's label names them (``selective, tp overlap``)."""
    if len(key) < len(KEY_TERMS):
        return ""
    rc, ov, vpp, reshard, short, ps = key[4:10]  # reshard: off the mesh's default, ReshardKey's word
    own_vpp = vpp > 1 and vpp != implied_vpp(ps)  # as knob_key counts it: a V-shape's vpp 2 is its name's
    on = [RECOMPUTE_BY_COST[rc]] + [t for t, x in (("tp overlap", ov), (f"vpp {vpp}", own_vpp),
                                                   (getattr(reshard, "word", "reshard off its default"), reshard),
                                                   ("short end stages", short),
                                                   (_schedule_word(ps), ps)) if x]
    return ", ".join(on)
