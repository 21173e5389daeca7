"""Mesh input: axis names and degrees in canonical or Megatron order, pipeline options
and an optional explicit rank -> GPU permutation."""

from __future__ import annotations

from enum import StrEnum
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

from meshplan.spec.names import Name
from meshplan.limits import BOUNDS, MAX_WORLD, over


class Schedule(StrEnum):
    """Pipeline schedules by the name a config (``mesh.pp_schedule``) or ``meshplan step
    --schedule`` gives. What each one does (op order, chunk-to-virtual-stage map, warm-up,
    bubble, torch class) is its module under :mod:`meshplan.pipeline`, registered in
    :data:`meshplan.pipeline.registry.SCHEDULES`. A StrEnum: ``Schedule("1f1b")`` parses a
    name and a member formats as its name.

    >>> Schedule("interleaved_1f1b") is Schedule.INTERLEAVED_1F1B, f"{Schedule.ZB_H1}"
    (True, 'zb_h1')
    """

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZB_H1 = "zb_h1"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


def _squash(name: str) -> str:
    """``name`` as spellings are compared: lower case, without ``_``, ``-``, ``.`` and spaces,
    without a leading ``schedule`` (torch's class names: ``ScheduleGPipe``).

    >>> _squash("ScheduleInterleaved1F1B"), _squash("ZB-H1"), _squash("interleaved_1f1b")
    ('interleaved1f1b', 'zbh1', 'interleaved1f1b')
    """
    flat = "".join(ch for ch in name.lower() if ch not in "_-. ")
    return flat.removeprefix("schedule") or flat


def multi_stage_refusal(v: int) -> str:
    """The one refusal of torch's InterleavedZeroBubble with ``v > 1`` stages per rank, the same
    words under ``mesh.pp_schedule`` (with ``mesh.virtual_stages``), ``step --schedule`` and a
    torchtitan job's ``parallelism.pipeline_parallel_schedule``. meshplan's ZB-H1 is that class
    at one stage per rank (its order equals torch 2.13's ``_calculate_single_rank_operations``
    there, tests/test_schedule_registry.py); its interleaved order with more is not modelled.

    >>> multi_stage_refusal(2)
    "InterleavedZeroBubble (zb_h1) with 2 stages per rank is not planned by meshplan: it plans torch's ScheduleInterleavedZeroBubble with one stage per rank only (zb_h1, the same order); use Interleaved1F1B, ZBVZeroBubble or DualPipeV, or one stage per rank"
    """
    return (f"InterleavedZeroBubble (zb_h1) with {v} stages per rank is not planned by meshplan: it plans torch's "
            f"ScheduleInterleavedZeroBubble with one stage per rank only (zb_h1, the same order); use Interleaved1F1B, "
            f"ZBVZeroBubble or DualPipeV, or one stage per rank")


#: Why torch's ``ScheduleLoopedBFS`` is refused (newcomer trial nc56 #5), the one sentence of
#: ``mesh.pp_schedule``, ``step --schedule`` and a torchtitan job's ``pipeline_parallel_schedule``. Its
#: order, read in torch 2.13's source (torch/distributed/pipelining/schedules.py,
#: ``ScheduleLoopedBFS._calculate_single_rank_operations``): rank r idles r slots, runs every micro-batch's
#: forward of its first local stage (r), then of each later one (r + pp, ...), idles 2 (pp - 1 - r) slots,
#: then runs the backwards stage by stage in reverse, micro-batches in reverse order. No meshplan schedule
#: runs that order (GPipe's one stage per rank runs its backwards in micro-batch order, and meshplan's
#: simulator, memory timeline and validate take no padded idle slots), so it is not planned rather than
#: planned as something else.
LOOPED_BFS_REFUSAL = ("LoopedBFS (torch ScheduleLoopedBFS) is not planned by meshplan: its order (every local stage's "
                      "forwards of all micro-batches, then their backwards in reverse micro-batch order, holding all "
                      "m x v micro-batch chunks' activations) is not one it models; use interleaved_1f1b (the same "
                      "looped stages, 1F1B order) or gpipe (one stage per rank, forwards then backwards)")


#: Every spelling of a schedule that meshplan accepts, by :func:`_squash`: its own names, and
#: the names users of other tools type. torch.distributed.pipelining (``get_schedule_class``
#: in ``schedules.py``, case-insensitive, as torchtitan's
#: ``parallelism.pipeline_parallel_schedule``): GPipe, 1F1B, Interleaved1F1B,
#: InterleavedZeroBubble (torch's ZB1P; meshplan plans it as ``zb_h1``, one stage per rank),
#: ZBVZeroBubble, DualPipeV. Qi et al. 2023 (arXiv 2401.10241): ZB-H1, ZB-V. Megatron-LM
#: (``megatron/core/pipeline_parallel/schedules.py``): ``forward_backward_pipelining_without_
#: interleaving`` (1F1B, called PipeDream-Flush by Narayanan et al. SC21, section 2.2.1) and
#: ``..._with_interleaving`` (the interleaved schedule).
SCHEDULE_SPELLINGS: dict[str, Schedule] = {_squash(s.value): s for s in Schedule} | {
    "interleavedzerobubble": Schedule.ZB_H1, "zb1p": Schedule.ZB_H1, "zbvzerobubble": Schedule.ZBV,
    "pipedreamflush": Schedule.ONE_F_ONE_B, "forwardbackwardpipeliningwithoutinterleaving": Schedule.ONE_F_ONE_B,
    "interleaved": Schedule.INTERLEAVED_1F1B, "forwardbackwardpipeliningwithinterleaving": Schedule.INTERLEAVED_1F1B}

#: The accepted names, as an error lists them.
SCHEDULE_NAMES_HELP = (", ".join(Schedule) + ", or torch.distributed.pipelining's GPipe, 1F1B, Interleaved1F1B, "
                       "InterleavedZeroBubble (= zb_h1, one stage per rank), ZBVZeroBubble, DualPipeV (any case)")


def parse_schedule(name) -> Schedule:
    """The schedule ``name`` spells (a :class:`Schedule`, one of its names, or a spelling of
    :data:`SCHEDULE_SPELLINGS`); ValueError listing the accepted names otherwise (the caller
    names the field: ``mesh.pp_schedule``, ``--schedule``).

    >>> parse_schedule("1F1B"), parse_schedule("ZBVZeroBubble"), parse_schedule("InterleavedZeroBubble")
    (<Schedule.ONE_F_ONE_B: '1f1b'>, <Schedule.ZBV: 'zbv'>, <Schedule.ZB_H1: 'zb_h1'>)
    >>> parse_schedule("dualpipe")
    Traceback (most recent call last):
    ValueError: unknown schedule 'dualpipe'; use gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, or torch.distributed.pipelining's GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble (= zb_h1, one stage per rank), ZBVZeroBubble, DualPipeV (any case)
    >>> parse_schedule("ScheduleLoopedBFS")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: LoopedBFS (torch ScheduleLoopedBFS) is not planned by meshplan: its order ...
    """
    if isinstance(name, Schedule):
        return name
    if not isinstance(name, str):
        raise ValueError(f"give a schedule's name as a string (got {str(name)[:60]}); use {SCHEDULE_NAMES_HELP}")
    found = SCHEDULE_SPELLINGS.get(_squash(name))
    if found is None and _squash(name) == "loopedbfs":
        raise ValueError(LOOPED_BFS_REFUSAL)
    if found is None:
        raise ValueError(f"unknown schedule {name[:60]!r}; use {SCHEDULE_NAMES_HELP}")
    return found


class MeshSpec(BaseModel):
    """Either ``names`` + ``shape`` (outermost first, as DeviceMesh) or ``order`` (a
    Megatron string, fastest first, e.g. ``tp-cp-ep-dp-pp``) + ``degrees``. One degree may
    be -1 (inferred exactly from the world size). ``ep`` and ``etp`` may appear among the
    axes; they re-factor the dense block and do not multiply into the world size.

    ``rank_to_gpu``: optional permutation, element r = global GPU index of rank r
    (default: node-major, rank r on node r // gpus_per_node).
    ``loss_parallel``: cross-entropy on vocabulary-sharded logits (torchtitan's default with
    tp > 1; Megatron's vocab-parallel cross entropy) instead of gathering the logits.
    ``custom_axes``: user-named axes that are close to a known name on purpose (``tq``);
    without it such a name is an error (:func:`meshplan.spec.axes.canonical_names`).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    names: Optional[list[Name]] = None
    shape: Optional[list[int]] = None
    order: Optional[str] = None
    degrees: Optional[dict[Name, int]] = None
    world: Optional[int] = Field(default=None, gt=0, le=MAX_WORLD)
    sequence_parallel: bool = False
    virtual_stages: int = Field(default=1, gt=0, le=BOUNDS["virtual_stages"].value)
    layers_per_virtual_stage: Optional[int] = Field(default=None, gt=0, le=BOUNDS["layers_per_virtual_stage"].value)
    pp_layer_split: Optional[list[int]] = None
    pp_schedule: Schedule = Field(default=Schedule.ONE_F_ONE_B, strict=False)  # names parse to the enum
    rank_to_gpu: Optional[list[int]] = None
    loss_parallel: bool = True
    custom_axes: list[str] = Field(default_factory=list)

    @field_validator("pp_schedule", mode="before")
    @classmethod
    def _schedule_spelling(cls, value):
        """Any spelling :func:`parse_schedule` accepts (``"1F1B"``, ``"ZBVZeroBubble"``)."""
        return parse_schedule(value)

    @field_serializer("pp_schedule")
    def _schedule_name(self, value) -> str:
        """Dumped as its name (also when ``model_copy(update=...)`` left a plain string)."""
        return str(value)

    @model_validator(mode="after")
    def _check(self):
        canonical = self.names is not None or self.shape is not None
        megatron = self.order is not None or self.degrees is not None
        if canonical == megatron:
            raise ValueError("give either names + shape (outermost first) or order + degrees (Megatron, fastest first)")
        if canonical and (self.names is None or self.shape is None):
            raise ValueError("names and shape must both be given, one degree per name")
        if canonical and len(self.names or ()) != len(self.shape or ()):
            raise ValueError(f"{len(self.names or ())} names but {len(self.shape or ())} degrees in shape; give "
                             f"one degree per name")
        if megatron and (self.order is None or self.degrees is None):
            raise ValueError("order and degrees must both be given: order = \"tp-dp_shard\" (Megatron, fastest first) "
                             "with [mesh.degrees] tp = 2, dp_shard = 4; or names + shape (outermost first): "
                             "names = [\"dp_shard\", \"tp\"], shape = [4, 2]")
        degrees = list(self.shape or []) + list((self.degrees or {}).values())
        big = [d for d in degrees if d > MAX_WORLD]
        if big:
            raise ValueError(f"degree {over('world', big[0])}")
        if len(self.names or self.degrees or ()) > 16 or len(self.order or "") > 256:
            raise ValueError("more than 16 axes; meshplan knows 8 (pp, dp_replicate, dp, dp_shard, cp, tp, ep, etp)")
        split = self.pp_layer_split or []
        if any(not 0 <= x <= BOUNDS["layers"].value for x in split) or len(split) > BOUNDS["layers"].value:
            raise ValueError(f"pp_layer_split: at most {BOUNDS['layers'].value} stages of 0..{BOUNDS['layers'].value} "
                             "layers (the layer bound)")
        return self
