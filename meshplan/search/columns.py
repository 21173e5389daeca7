"""The columns of the search's candidates: the searched values of recompute, sharding and the
pipeline schedule (:data:`RECOMPUTE`, :data:`SHARDING`, :data:`PIPELINE`), one row per candidate
as numpy arrays (:class:`Candidates`), and the names a row's mesh and schedule take
(:func:`axis_shown`, :func:`candidate_schedule`). The space they span is
:mod:`meshplan.search.space`; the rules that reject rows :mod:`meshplan.search.reasons`; a
row's plan input :mod:`meshplan.search.candidate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from math import prod
from typing import Mapping, Optional

import numpy as np

from meshplan.pipeline.registry import get
from meshplan.spec.axes.registry import AXES, search_axes
from meshplan.spec.mesh import Schedule
from meshplan.spec.mesh_words import data_axis, mesh_text, sharding_shown, with_experts

#: Searched recompute policies (the ``rc`` column); ``layer`` and ``block`` last, so that adding
#: them kept the others' codes: torchtitan's per-layer AC at :data:`LAYER_AC_FREQ`, and
#: Megatron-LM's block recompute (``--recompute-method block --recompute-num-layers n``: the first
#: n layers of each model chunk checkpointed in full, the others keeping everything), whose n the
#: exact planner picks per row, the smallest that fits (:mod:`meshplan.search.block_recompute`;
#: :attr:`Candidates.rn`).
RECOMPUTE = ("none", "selective", "full", "op", "layer", "block")

#: The ``rc`` codes whose rows checkpoint some layers in full and keep everything on the others
#: (``layer``, ``block``): the bounds take each such layer both ways (:func:`bound_recompute`).
MIXED = (RECOMPUTE.index("layer"), RECOMPUTE.index("block"))

#: The ``ac_freq`` a searched ``layer`` row runs: torchtitan's default per-layer selective AC,
#: ``selective_ac_option = "2"`` (every second layer checkpointed in full; torchtitan's
#: ``ActivationCheckpoint`` config, torchtitan/config/job_config.py).
LAYER_AC_FREQ = 2


def bound_recompute(rc: np.ndarray, policy: str) -> np.ndarray:
    """``rc`` with ``layer`` and ``block`` (:data:`MIXED`: some layers in full, the others keeping
    everything) replaced by the uniform ``policy`` a bound takes for it: the step-time lower bound times a layer both ways,
    ``none`` and ``full``, and counts full's on the layers a chunk surely replays
    (:func:`meshplan.search.layer_bounds.unit_bounds`, :mod:`meshplan.search.layer_replays`);
    the memory bounds take ``none`` and ``full`` and each field's smaller and larger of the two
    (:func:`meshplan.search.bounds.bounds`).

    A ``block`` row's step bound counts the replays of its least n (:attr:`Candidates.rm`,
    :func:`meshplan.search.layer_replays.replayed_layers`), no more than any n the planner picks.

    >>> bound_recompute(np.array([0, 2, 4, 5]), "none").tolist(), bound_recompute(np.array([4, 5]), "full").tolist()
    ([0, 2, 0, 0], [2, 2])
    """
    return np.where(np.isin(rc, MIXED), RECOMPUTE.index(policy), rc)
#: Searched shardings (the ``sh`` column); zero2 last, so that adding it kept the others' codes.
SHARDING = ("zero1", "zero3", "hsdp", "zero2")

#: The searched shardings DeepSpeed's ZeRO-1/2 engine runs (``training.zero12_engine``).
ZERO12 = (SHARDING.index("zero1"), SHARDING.index("zero2"))

#: The searched shardings whose parameters FSDP2 shards (zero3, hsdp): the ones
#: ``training.fp8_all_gather`` and ``training.grad_accumulation`` apply to.
FSDP_SHARDINGS = tuple(i for i, s in enumerate(SHARDING) if s in ("zero3", "hsdp"))

#: The schedule the search plans a candidate with by default (a candidate with vpp > 1 runs
#: its ``chunked`` order, interleaved 1F1B).
SEARCHED = Schedule.ONE_F_ONE_B

#: Values of the ``ps`` column: the default family, then the V-shaped schedules, then ZB-H1
#: (one chunk per rank; added last, so that the others kept their codes) (``[search] pp_schedules``).
PIPELINE = ("1f1b", "zbv", "dualpipev", "zb_h1")

#: The :data:`PIPELINE` codes whose chunk map is a V (stage 0 holds the model's first and last
#: chunk: the head's stage is 0) and which take vpp 2: ZB-V, DualPipeV.
V_CODES = (PIPELINE.index("zbv"), PIPELINE.index("dualpipev"))

#: The :data:`PIPELINE` code of ZB-H1 (vpp 1, 1F1B's chunk map).
ZB_H1_CODE = PIPELINE.index("zb_h1")


@dataclass(frozen=True)
class Candidates:
    """One row per candidate; every column an int64 array. ``rc`` indexes
    :data:`RECOMPUTE`, ``sh`` indexes :data:`SHARDING`; ``rf``: reshard_after_forward (1/0),
    ``ov``: tp_comm_overlap (1/0), ``us``: the stages' layers by :func:`ends_short_split` (1)
    or the default split (0; :func:`stage_split`); ``ps`` indexes :data:`PIPELINE` (the
    pipeline schedule). The degree columns are the registered axes' search columns
    (:func:`meshplan.spec.axes.registry.search_axes`); one registered without an attribute
    here sits in ``more``. ``moe``: the model has routed experts (which FSDP2 may shard where
    the dense parameters are not: :attr:`replicated`). ``rd``: ``reshard_after_forward``'s
    default at the row (1/0), :meth:`~meshplan.spec.training.TrainingSpec.reshard_default` of
    its pp under the search's training (:func:`meshplan.search.space.reshard_defaults`: false
    under torch's FSDP2 with pp > 1); None: true on every row (FSDP2's own default). ``hz``: DeepSpeed
    ZeRO++ hpZ's ``zero_hpz_partition_size`` at the row (:func:`meshplan.search.space.hpz_applies`;
    1: no secondary partition); None: the config's on every zero3 row. ``rn``: a ``block`` row's
    ``recompute_num_layers`` n once the exact planner has picked it (0 before, and on every other
    row; :mod:`meshplan.search.block_recompute`); None: no ``block`` row. ``rk``: the layers of the
    row's largest model chunk (what n counts against; set with ``rn``). ``rm``: a ``block`` row's
    least n, the smallest whose memory lower bound fits (:func:`meshplan.search.block_bounds.least_block`,
    set by :func:`meshplan.search.estimate.estimate`; 0 before, and on every other row): the n the
    exact planner's bisection starts at and the replays its step lower bound counts."""

    pp: np.ndarray
    dpr: np.ndarray
    dps: np.ndarray
    cp: np.ndarray
    tp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mb: np.ndarray
    rc: np.ndarray
    vpp: np.ndarray
    sh: np.ndarray
    rf: np.ndarray
    ov: np.ndarray
    us: np.ndarray
    ps: np.ndarray
    more: Mapping[str, np.ndarray] = field(default_factory=dict)
    moe: bool = False
    rd: Optional[np.ndarray] = None
    hz: Optional[np.ndarray] = None
    rn: Optional[np.ndarray] = None
    rk: Optional[np.ndarray] = None
    rm: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return int(self.pp.size)

    def take(self, idx) -> "Candidates":
        cols = {f.name: getattr(self, f.name)[idx] for f in fields(self)
                if f.name not in ("more", "moe", "rd", "hz", "rn", "rk", "rm")}
        return Candidates(**cols, more={k: v[idx] for k, v in self.more.items()}, moe=self.moe,
                          rd=None if self.rd is None else self.rd[idx], hz=None if self.hz is None else self.hz[idx],
                          rn=None if self.rn is None else self.rn[idx], rk=None if self.rk is None else self.rk[idx],
                          rm=None if self.rm is None else self.rm[idx])

    def block_layers(self, i: int) -> int:
        """Row ``i``'s block recompute n (:attr:`rn`; 0 where not picked, or not a ``block`` row)."""
        return 0 if self.rn is None else int(self.rn[i])

    def recompute_word(self, i: int) -> str:
        """Row ``i``'s recompute as the search prints it: :data:`RECOMPUTE`'s name, a ``block`` row's
        with its n of the layers of its largest model chunk once picked, ``block 5/10``."""
        word = RECOMPUTE[self.rc[i]]
        if word != "block" or not self.block_layers(i) or self.rk is None:
            return word
        return f"block {self.block_layers(i)}/{int(self.rk[i])}"

    def hpz(self, i: int) -> int:
        """Row ``i``'s hpZ g (:attr:`hz`; 1 where the column is None)."""
        return 1 if self.hz is None else int(self.hz[i])

    def degree(self, column: str) -> np.ndarray:
        """The degree column of a registered axis by its search column name (``tp``,
        ``dps``, or a column in ``more``)."""
        return self.more[column] if column in self.more else getattr(self, column)

    @property
    def fsdp2(self) -> np.ndarray:
        """FSDP2 shards the parameters (zero3 or hsdp), the column the ep axis's
        ``expert_dim1`` rule reads (:func:`meshplan.spec.axes.ep._fsdp2`)."""
        return (self.sh == SHARDING.index("zero3")) | (self.sh == SHARDING.index("hsdp"))

    @property
    def fsdp2_over_data(self) -> np.ndarray:
        """FSDP2 over a data axis: :attr:`fsdp2` with dp_replicate x dp_shard x cp > 1, the condition
        of :func:`meshplan.plan_runtime.runtime_warnings` (``fsdp x dp_replicate > 1``) that the
        search's rule ``v-reshard`` reads (:func:`meshplan.pipeline.vshape.reshard_defect`)."""
        return self.fsdp2 & (self.fsdp * self.dpr > 1)

    @property
    def reshard_varied(self) -> np.ndarray:
        """The rows the search varies ``training.reshard_after_forward`` on: FSDP-sharded parameters
        (zero3 or hsdp with dp_shard x cp > 1, or a MoE model's experts sharded over efsdp); the
        other rows carry true, which gathers nothing there
        (:func:`meshplan.search.space.enumerate_candidates`)."""
        return reshard_acts(self.fsdp2, self.dps, self.cp, self.tp, self.ep, self.etp, self.moe)

    @property
    def reshard_default(self) -> np.ndarray:
        """``reshard_after_forward``'s default at each row (1/0): :attr:`rd`, else 1."""
        return np.ones_like(self.rf) if self.rd is None else self.rd

    def reshard_setting(self, i: int) -> Optional[bool]:
        """Row ``i``'s ``reshard_after_forward`` where it acts (:attr:`reshard_varied`, read for the
        one row: the tie rule calls this per candidate), else None: without FSDP over a data axis the
        row carries true, which gathers nothing."""
        acts = reshard_acts(int(self.sh[i]) in FSDP_SHARDINGS, int(self.dps[i]), int(self.cp[i]), int(self.tp[i]),
                            int(self.ep[i]), int(self.etp[i]), self.moe)
        return bool(self.rf[i]) if acts else None

    def reshard_default_at(self, i: int) -> bool:
        """Row ``i``'s :attr:`reshard_default`."""
        return True if self.rd is None else bool(self.rd[i])

    def reshard_tag(self, i: int) -> str:
        """Row ``i``'s :func:`reshard_word` against its default (:meth:`reshard_default_at`)."""
        return reshard_word(self.reshard_setting(i), self.reshard_default_at(i))

    @property
    def sp(self) -> np.ndarray:
        """Sequence parallel: on exactly where tp > 1."""
        return self.tp > 1

    @property
    def dp(self) -> np.ndarray:
        """Batch data-parallel degree: dp_replicate x dp_shard (cp excluded)."""
        return self.dpr * self.dps

    @property
    def fsdp(self) -> np.ndarray:
        """Dense shard degree: dp_shard x cp."""
        return self.dps * self.cp

    @property
    def efsdp(self) -> np.ndarray:
        """Expert shard degree: dp_shard x cp x tp / (ep x etp) (integer where valid)."""
        return np.maximum(self.dps * self.cp * self.tp // (self.ep * self.etp), 1)

    @property
    def replicated(self) -> np.ndarray:
        """hsdp rows that shard nothing: dp_shard x cp 1 and, for a MoE model, no expert shard
        (dp_shard x cp x tp <= ep x etp, :attr:`efsdp` 1), so the parameters, gradients and optimizer
        state are replicated over dp_replicate: DDP. Named ``ddp`` (:meth:`sharding_word`);
        under ``framework = "torch"`` the search rejects them (rule ``replicate``,
        :mod:`meshplan.search.reasons`). The same condition as the enumeration's FSDP-sharded
        rows (:func:`meshplan.search.space.enumerate_candidates`, negated)."""
        experts = self.moe & (self.dps * self.cp * self.tp > self.ep * self.etp)
        return (self.sh == SHARDING.index("hsdp")) & (self.fsdp == 1) & ~experts

    def sharding_word(self, i: int) -> str:
        """Row ``i``'s sharding as the search names it: :data:`SHARDING`'s name, ``ddp`` where an
        hsdp row shards nothing (:attr:`replicated`, :func:`meshplan.spec.mesh_words.sharding_shown`)."""
        return sharding_shown(SHARDING[self.sh[i]], bool(self.replicated[i]))

    def label(self, i: int) -> str:
        """``pp 16 x dp_shard 128 x tp 8, mb 1, full, vpp 1, zero3`` (the mesh as
        :func:`meshplan.spec.mesh_words.mesh_text` prints it, a MoE row's expert mesh by
        :func:`~meshplan.spec.mesh_words.with_experts`: ``ep 16 (efsdp 4, etp 1)``), then ``, keep gathered``
        or ``, resharded`` where reshard_after_forward is off the row's default (:meth:`reshard_tag`),
        ``, tp overlap``, ``, short end stages`` and ``, hpZ 8`` (:attr:`hz` above 1) where they apply;
        the sharding by :meth:`sharding_word` (``ddp`` for an hsdp row that shards nothing)."""
        names, degs = zip(*((n, int(self.degree(col.column)[i])) for n, col in search_axes()))
        mesh = mesh_text(names, degs, SHARDING[self.sh[i]])
        if self.moe:  # the routed experts' mesh where the dense one does not imply it
            mesh = with_experts(mesh, int(self.ep[i]), int(self.etp[i]), int(self.efsdp[i]))
        tag = self.reshard_tag(i)
        extra = "".join(t for on, t in ((tag, f", {tag}"), (self.ov[i], ", tp overlap"),
                                         (self.us[i], ", short end stages"), (self.ps[i], f", {PIPELINE[self.ps[i]]}"),
                                         (self.hpz(i) > 1, f", hpZ {self.hpz(i)}"))
                        if on)
        return (f"{mesh}, mb {int(self.mb[i])}, {self.recompute_word(i)}, vpp {int(self.vpp[i])}, "
                f"{self.sharding_word(i)}{extra}")


def reshard_acts(fsdp2, dps, cp, tp, ep, etp, moe: bool):
    """Whether ``reshard_after_forward`` changes what a mesh gathers (arrays or ints): FSDP2 shards
    the parameters (``fsdp2``: sharding zero3 or hsdp) over a data axis, dp_shard x cp > 1, or a MoE
    model's experts over efsdp (dp_shard x cp x tp > ep x etp). Elsewhere the setting gathers
    nothing: the search does not vary it (:attr:`Candidates.reshard_varied`) and the tie rule and
    labels count no value of it (:func:`reshard_word`, :func:`meshplan.compare.sides.plan_tie_key`).

    >>> reshard_acts(True, 8, 1, 1, 1, 1, False), reshard_acts(True, 1, 1, 8, 1, 1, False), reshard_acts(True, 1, 1, 8, 4, 1, True)
    (True, False, True)
    """
    return fsdp2 & ((dps * cp > 1) | (moe & (dps * cp * tp > ep * etp)))


def reshard_word(reshard: Optional[bool], default: bool) -> str:
    """A row's tag for ``reshard_after_forward`` (``reshard``; None where it acts on nothing: no FSDP
    over a data axis): ``keep gathered`` (false) or ``resharded`` (true) where it is off the mesh's
    ``default`` (:meth:`~meshplan.spec.training.TrainingSpec.reshard_default`: true, false under
    torch's FSDP2 with pp > 1), else "". The search's labels and knobs column print it.

    >>> reshard_word(False, True), reshard_word(True, False), reshard_word(False, False), reshard_word(True, True)
    ('keep gathered', 'resharded', '', '')
    >>> reshard_word(None, False)
    ''
    """
    if reshard is None or reshard == default:
        return ""
    return "resharded" if reshard else "keep gathered"


def axis_shown(name, sharding: str) -> str:
    """A search axis's name in a candidate's mesh: the data axis ``dp_shard`` is ``dp`` under
    ZeRO-1/2 (:func:`meshplan.spec.mesh_words.data_axis`), as ``plan`` prints the mesh a Megatron-LM
    or DeepSpeed config imports to (the search columns keep ``dp_shard``; ``--json``'s ``mesh``
    keys and the text follow this rule, :func:`meshplan.spec.mesh_words.mesh_text`).

    >>> axis_shown("dp_shard", "zero2"), axis_shown("dp_shard", "zero3"), axis_shown("tp", "zero1")
    ('dp', 'dp_shard', 'tp')
    """
    return data_axis(sharding) if str(name) == "dp_shard" else str(name)


def candidate_schedule(vpp: int, ps: int = 0) -> Schedule:
    """The schedule of a candidate with ``vpp`` chunks per rank and schedule column ``ps``:
    :data:`SEARCHED` with vpp 1, its ``chunked`` order (interleaved 1F1B) with vpp > 1; the
    zero-bubble one ``ps`` names (:data:`PIPELINE`: a V-shaped one at vpp 2, ZB-H1 at vpp 1).

    >>> candidate_schedule(1), candidate_schedule(2), candidate_schedule(2, 1), candidate_schedule(1, 3)
    (<Schedule.ONE_F_ONE_B: '1f1b'>, <Schedule.INTERLEAVED_1F1B: 'interleaved_1f1b'>, <Schedule.ZBV: 'zbv'>, <Schedule.ZB_H1: 'zb_h1'>)
    """
    return Schedule(PIPELINE[ps]) if ps else get(SEARCHED).for_chunks(vpp)


def world_of(c: Candidates, i: int) -> int:
    """Ranks of candidate ``i``: the product of its dense degrees (expert axes re-factor them)."""
    return prod(int(c.degree(col.column)[i]) for n, col in search_axes() if not AXES[n].expert)
