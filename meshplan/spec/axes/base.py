"""What a parallel axis declares: :class:`AxisDef` (one per axis, built in the axis's own
module under :mod:`meshplan.spec.axes`) and its parts, :class:`Rule`, :class:`SearchColumn`,
:class:`CollectiveKind` and :class:`Timeline` (where its rows run in a layer's timeline).

Everything here is data or a small pure function of numbers, so every later layer can read
it: the mesh validity (:mod:`meshplan.mesh.validity`) and the search's vectorised rules
(:func:`meshplan.search.reasons.first_reason`) call the same :attr:`Rule.bad` predicate, one on
Python ints (:class:`AxisDegrees`), the other on numpy columns (the search's
``Candidates``), which both expose the attributes below:

======== ==================================================================
``pp``   pipeline degree              ``dpr``  dp_replicate degree
``dps``  dp_shard degree (or dp's)    ``dp``   batch data-parallel degree
``cp``   context-parallel degree      ``tp``   tensor-parallel degree
``ep``   expert-parallel degree       ``etp``  expert tensor-parallel degree
``mb``   micro-batch (sequences)      ``vpp``  chunks (virtual stages) per rank
``sp``   sequence parallel on         ``degree(name)``: any registered axis's degree
======== ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Mapping, Optional

#: ``(model, training, degrees) -> (reasons, notes)`` of one rule on one mesh.
Check = Callable[[Any, Any, Any], tuple[tuple[str, ...], tuple[str, ...]]]


class Dim(StrEnum):
    """Tensor dimensions an axis divides on one rank (:attr:`AxisDef.divides`). The
    ways a dimension is split is the product of the degrees of the registered axes that
    declare it (:func:`meshplan.spec.axes.registry.divisor`); what reads each (``batch``,
    ``layers`` and ``param dim 0`` are declared, their readers take the dp, pp and fsdp
    degrees directly):

    ================= ==================================================================
    ``batch``         sequences per step (micro-batches per dp rank: the batch rule)
    ``layers``        the layer stack (pipeline stages; :mod:`meshplan.mesh.layers`)
    ``sequence``      tokens of a sequence on a rank: GEMM rows, attention queries and
                      the activations (:mod:`meshplan.compute.shapes`, :mod:`meshplan.memory`)
    ``sequence (SP)`` the residual stream between blocks, only where the mesh has
                      ``sequence_parallel`` on (norms, dropout, the block's input)
    ``heads``         attention heads (q heads; KV heads, replicated past ``kv_heads``)
    ``ffn``           the dense MLP's width (and the shared experts')
    ``vocab``         the padded vocabulary (embedding, output layer, logits)
    ``experts``       the routed experts
    ``expert_ffn``    a routed expert's width
    ``param dim 0``   every parameter's dim 0 (FSDP2 ``Shard(0)``, padded)
    ================= ==================================================================
    """

    BATCH = "batch"
    LAYERS = "layers"
    SEQUENCE = "sequence"
    SP_SEQUENCE = "sequence (SP)"
    HEADS = "heads"
    FFN = "ffn"
    VOCAB = "vocab"
    EXPERTS = "experts"
    EXPERT_FFN = "expert_ffn"
    PARAM_DIM0 = "param dim 0"


@dataclass(frozen=True)
class Rule:
    """One validity rule of an axis.

    ``key``: the rejection category (the search counts rejections by it); ``order``: where it
    stands in the plan's order of checks (mesh resolution 10, heads 20, widths 30-40, layers
    50, experts 60, sequence 70-80, batch 90; a new rule picks a free number); ``summary``: the
    category's one line in the search's counts; ``bad(model, training, degrees)``: True where
    the rule is broken, written with ``%``, ``//``, ``&`` and ``|`` only, so it runs on ints and
    on numpy columns alike (None: a note-only rule); ``check(model, training, degrees)``: the
    exact plan's reasons (one line each, with the numbers) and notes, or None where the exact
    reason is produced elsewhere (``where`` says by what).
    """

    key: str
    order: int
    summary: str
    bad: Optional[Callable[[Any, Any, Any], Any]]
    check: Optional[Check] = None
    where: str = ""


@dataclass(frozen=True)
class SearchColumn:
    """How ``meshplan search`` enumerates an axis's degree.

    ``column``: the candidates' attribute holding it; ``option``: the ``[search]`` field that
    narrows it (:class:`~meshplan.spec.search.SearchOptions`; absent fields allow every
    value); ``remainder``: the axis takes the world left over by the other dense axes (one
    axis only: dp_shard); ``values(cfg, row)``: for an expert axis (not multiplied into the
    world), its candidate degrees given the dense degrees ``row`` (column -> int) on an MoE
    model (a dense model searches it at 1 only), None for a dense axis (every divisor of the
    remaining world); ``bound(cfg)``: the largest degree
    searched (None: no bound).
    """

    column: str
    option: str
    remainder: bool = False
    values: Optional[Callable[[Any, Mapping[str, int]], list[int]]] = None
    bound: Optional[Callable[[Any], Optional[int]]] = None


@dataclass(frozen=True)
class CollectiveKind:
    """One kind of collective an axis causes, as the collective table
    (:mod:`meshplan.comm.collectives`) lists it: ``op`` (nccl-tests name), ``group`` (the
    axis, possibly derived, whose groups run it), ``phase`` (when: forward, backward, step)
    and ``size`` (what one call carries, in words)."""

    op: str
    group: str
    phase: str
    size: str


class Block(StrEnum):
    """The blocks of a transformer layer a :class:`Slot` names, as the rank timeline
    (:mod:`meshplan.schedule.rank_timeline`) runs them: ``attn`` (the attention block:
    projections, core attention, output projection, with tp's and cp's collectives) and
    ``mlp`` (the MLP or MoE block, with tp's and ep's)."""

    ATTN = "attn"
    MLP = "mlp"


class At(StrEnum):
    """Where a :class:`Slot`'s collective runs relative to its block, in the order the
    timeline's pass runs (in the backward, its blocks' backward in reverse order):

    ============== ======================================================================
    ``before``     issued when the compute reaches the block; the block waits for it
                   (blocking: its whole time is exposed unless another stream delays it)
    ``after``      issued when the block ends; the next compute waits for it (blocking)
    ``overlapped`` issued when the layer's pass ends; nothing waits for it (it runs under
                   the next layer's compute; what still runs when the unit ends is its tail)
    ============== ======================================================================
    """

    BEFORE = "before"
    AFTER = "after"
    OVERLAPPED = "overlapped"


#: Row phases a :class:`Slot` can place (a checkpoint's replay of a recomputed layer
#: places none: rows that count it need their own phase and op, as cp's do).
SLOT_PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Slot:
    """One call per layer of an axis's rows of ``phase`` and ``op`` (a row of its table,
    seconds per call from the row), run ``at`` its place around ``block`` (None for
    ``overlapped``). Two slots of one (phase, op) are two calls per layer, the count a
    "2 per layer" row gives.

    >>> Slot("forward", "all-to-all", At.BEFORE, Block.ATTN).at
    <At.BEFORE: 'before'>
    >>> Slot("loss", "all-reduce", At.AFTER, Block.ATTN)
    Traceback (most recent call last):
    ...
    ValueError: timeline slot: phase 'loss' is not one of forward, backward
    """

    phase: str
    op: str
    at: At
    block: Optional[Block] = None

    def __post_init__(self):
        if self.phase not in SLOT_PHASES:
            raise ValueError(f"timeline slot: phase {self.phase!r} is not one of {', '.join(SLOT_PHASES)}")
        if (self.block is None) != (self.at is At.OVERLAPPED):
            raise ValueError(f"timeline slot: {self.at} needs {'no' if self.at is At.OVERLAPPED else 'a'} block")


@dataclass(frozen=True)
class Timeline:
    """Where an axis's collective rows run in one layer of the rank timeline: its ``slots``
    and the ``stream`` they run on ("": the axis's name; not a built-in stream). The
    exposed time of its rows (the compute's wait on the stream) is reported under the
    stream's name in the step's breakdown. For axes without a hand-written placement only
    (the built-in axes have theirs in :mod:`meshplan.schedule.rank_timeline`)."""

    slots: tuple[Slot, ...]
    stream: str = ""


#: ``rows(add, stage)``: an axis's rows of one stage's collective table. ``stage`` is the
#: stage's context (:class:`meshplan.comm.stage_context.StageContext`: ``model``,
#: ``training``, ``mesh``, ``layers`` (indices), ``first``, ``last``, ``stage``, ``vpp``,
#: ``schedule``, ``micro`` (micro-batches per step), ``seq_local`` (s / the sequence's split),
#: ``act_bytes`` (b x seq_local x h in the compute dtype));
#: ``add(axis, phase, op, size_bytes, dtype, per_microbatch, cadence, waits="", depth=1,
#: per_step=None, ranks=None)`` appends one row (group ``axis``, ``size_bytes`` the nccl-tests
#: buffer of one call, ``per_microbatch`` calls per micro-batch; ``per_step`` calls per step
#: when not ``per_microbatch`` x micro-batches), timed on the axis's path; a row over one
#: rank, of no bytes or of no call is dropped.
RowBuilder = Callable[[Callable[..., None], Any], None]


@dataclass(frozen=True)
class AxisDef:
    """Everything meshplan knows about one parallel axis (the registry's value type).

    ``doc``: what the axis partitions (one line); ``expert``: it re-factors the dense block
    ``dp_shard x cp x tp`` instead of multiplying into the world; ``torchtitan`` /
    ``megatron``: the names those frameworks give it (their mesh dims / order letters);
    ``rules``: its validity rules; ``divides``: the tensor dimensions (:class:`Dim`) it
    divides, read by the local shapes, the memory and the search's bounds; ``shards``: the
    training state it shards; ``collectives``: what it sends; ``rows``: the builder of its
    rows in the collective table (:data:`RowBuilder`; None for the families
    :mod:`meshplan.comm` builds itself, see :data:`meshplan.comm.collectives.LAYER_ROWS`);
    ``timeline``: where those rows run in a layer's timeline (:class:`Timeline`; None for
    the built-in axes, whose streams the rank timeline places by hand; an axis with rows and
    no timeline has them in the table, not in the step); ``search``: its search column
    (None: not searched); ``weights``: placement weights
    (relative traffic, not bytes) of the axis and of the derived axes it brings, used when no
    collective table is given (:mod:`meshplan.placement.score`).
    """

    doc: str
    expert: bool = False
    torchtitan: tuple[str, ...] = ()
    megatron: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    divides: tuple[Dim, ...] = ()
    shards: tuple[str, ...] = ()
    collectives: tuple[CollectiveKind, ...] = ()
    rows: Optional[RowBuilder] = None
    timeline: Optional[Timeline] = None
    search: Optional[SearchColumn] = None
    weights: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AxisDegrees:
    """One mesh's degrees as the rules read them (scalar counterpart of the search's
    candidate columns); ``extra``: degrees of registered axes without an attribute here.

    >>> d = AxisDegrees(pp=2, dpr=1, dps=4, dp=4, cp=1, tp=2, ep=1, etp=1, mb=1, vpp=1, sp=True)
    >>> d.degree("dps"), d.degree("tp"), d.degree("other")
    (4, 2, 1)
    """

    pp: int
    dpr: int
    dps: int
    dp: int
    cp: int
    tp: int
    ep: int
    etp: int
    mb: int
    vpp: int
    sp: bool
    extra: Mapping[str, int] = field(default_factory=dict)

    def degree(self, column: str) -> int:
        """The degree of the axis whose search column (or name) is ``column``; 1 if absent."""
        value = getattr(self, column, None) if column in _COLUMNS else self.extra.get(column, 1)
        return int(value) if value is not None else 1


_COLUMNS = ("pp", "dpr", "dps", "dp", "cp", "tp", "ep", "etp")


def divisors(n: int) -> list[int]:
    """Divisors of ``n``, ascending (the candidate degrees of an axis over ``n`` ranks).

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]
