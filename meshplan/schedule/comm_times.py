"""A stage's collective rows as the rank timeline reads them: each row's seconds per call keyed
(kind, group, phase, op) in :class:`CommTimes`, with the per-step, per-micro-batch, pp, loss and
DeepSpeed figures apart, and the FSDP unit group a row belongs to
(:func:`~meshplan.schedule.row_groups.shard_group`, with the other groups a row is kept under); the SM
share a collective's NCCL kernel takes from compute (:func:`nccl_sm_share`) and the share of its
NICs a network collective holds (:func:`nic_share`), both computed in
:mod:`meshplan.schedule.row_shares`. Each row's kind and
stream: :mod:`meshplan.schedule.comm_streams`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from meshplan.comm import deepspeed, zeropp
from meshplan.comm.deepspeed import CADENCE as DEEPSPEED_CADENCE
from meshplan.comm.fsdp_rows import REUSE_PART
from meshplan.comm.deepspeed_ipg import IPG
from meshplan.comm.deepspeed_zero12 import CADENCE as DEEPSPEED_BUCKET_CADENCE
from meshplan.comm.dp_rows import ZERO2_CADENCE
from meshplan.comm.zeropp_rows import HPZ_FIRST
from meshplan.schedule.comm_streams import BUILT_IN_STREAMS, comm_kind, split_by_stream, step_stream, timeline_axes
from meshplan.schedule.row_groups import row_group, shard_group, slot_op
from meshplan.schedule.row_shares import nccl_sm_share, nic_share  # noqa: F401 (nccl_sm_share: re-exported)
from meshplan.spec.axes.base import Slot
from meshplan.spec.axes.registry import Axis


@dataclass
class CommTimes:
    """Seconds per call of one stage's collectives keyed (kind, group, phase, op); group is
    "layer", "expert", "root" (one root unit), "root_embed" or "root_head" (the embedding's
    and [norm, output]'s units apart, :data:`~meshplan.schedule.row_groups.ROOT_GROUPS`) for shard/replica rows. ``loss_s``: seconds of the loss
    collectives per micro-batch; ``async_s``: per-layer overlapped tp collectives (norm
    weight gradients), ``async_calls`` the calls of the table they stand for per layer (one
    event, :func:`meshplan.schedule.backward_pass._layer_grads`); ``step_reduce_s``/``step_gather_s``: per-step ZeRO-1/2 or DDP
    collectives; ``p2p_s``: one pp send; ``p2p_gather_s``: the tp all-gather after each pp
    receive under Megatron's scatter/gather (0 without); ``other``: rows not understood (not simulated);
    ``layers``: the stage's layers over all its chunks (each chunk's last gradient unit
    issues its layers' pieces of the per-step reduction); ``slots``: (stream, slot) of the
    registered axes with a timeline whose rows the stage has (:func:`timeline_axes`), each
    call's seconds under (stream, "", phase, op) in ``t``; ``host``: (group, phase) -> host
    seconds per unit of DeepSpeed ZeRO-3's list-based calls (``CollectiveRow.host_s``), run on
    the compute stream before the unit's compute; ``kv_s``/``kv_calls``: seconds of one
    all-reduce of a layer's replicated K/V gradients and how many per step (step-end events);
    ``copies``: (group, op) -> compute-stream seconds of FSDP2's copy-out after one all-gather
    of the group's unit and its copy-in before one reduce-scatter (``CollectiveRow.copy_s``,
    :mod:`meshplan.comm.fsdp2`;
    the largest unit's when a group has units of several sizes); ``ddp_buckets``: DDP's gradient
    buckets per step (rows of cadence "(DDP"), which place the per-step reduction's pieces
    (:func:`~meshplan.schedule.grad_reduce.reduce_pieces`); ``gather_buckets``: calls of the per-step parameter all-gather
    (Megatron-LM's buckets under ``training.overlap_grad_reduce``, else 1), of which the next
    forward waits for the first under ``Overlap.param_gather``; ``mb_reduce_s``/``mb_buckets``: seconds and buckets of one
    micro-batch's ZeRO-2 reduce-scatters (rows of cadence :data:`ZERO2_CADENCE`) or DeepSpeed
    ZeRO-2 all-reduces, issued by every gradient unit (DeepSpeed ZeRO-1's per-step all-reduces
    count in ``step_reduce_s`` and ``ddp_buckets``); ``bucket_wait``: the reductions are
    DeepSpeed ZeRO-1/2's (:mod:`meshplan.comm.deepspeed_zero12`), which under ``overlap_comm``
    make the compute stream wait for the previous bucket's all-reduce before it issues the next
    and for the last at the backward's end (``synchronize()``)."""

    t: dict = field(default_factory=dict)
    share: dict = field(default_factory=dict)
    #: NIC share per key as ``share`` (:func:`nic_share`), per kind under (kind,), the per-step
    #: reduction's under ("dp", its stream) (:meth:`nic_share`)
    nic: dict = field(default_factory=dict)
    loss_s: float = 0.0
    async_s: float = 0.0
    async_calls: float = 0.0
    step_reduce_s: float = 0.0
    step_gather_s: float = 0.0
    p2p_s: float = 0.0
    p2p_gather_s: float = 0.0
    other: tuple = ()
    layers: int = 1
    slots: tuple[tuple[str, Slot], ...] = ()
    host: dict = field(default_factory=dict)
    kv_s: float = 0.0
    kv_calls: int = 0
    #: the per-step all-reduce of the float8 weights' amaxes (torchao's precompute, after the optimizer)
    float8_step_s: float = 0.0
    #: its second all-reduce, over tp (tp > 1: the amaxes are Partial over tp too)
    float8_tp_step_s: float = 0.0
    copies: dict = field(default_factory=dict)
    ddp_buckets: int = 0
    gather_buckets: int = 0
    mb_reduce_s: float = 0.0
    mb_buckets: int = 0
    bucket_wait: bool = False
    #: ``step_reduce_s``, ``mb_reduce_s`` and ``step_gather_s`` by the stream that shows them
    #: ({stream: seconds}, :func:`step_stream`: "dp", or the group a per-step row runs on), and the
    #: reduction's collectives by stream ({stream: ops}; "all-reduce" for DDP and DeepSpeed's buckets,
    #: "reduce-scatter" for Megatron-LM's ZeRO-1/2: the one of a stream is named in its events so the
    #: step's collective list shows them, linkload._op_of): each piece and step-end event is split
    #: over them (:meth:`reduce_parts`, :meth:`gather_parts`)
    step_reduce_by: dict = field(default_factory=dict)
    mb_reduce_by: dict = field(default_factory=dict)
    step_gather_by: dict = field(default_factory=dict)
    reduce_ops_by: dict = field(default_factory=dict)
    #: the per-step reduction's table phases by stream ({stream: phases}: "step", or "backward" for
    #: DeepSpeed ZeRO-1's buckets under overlap_comm), as the readiness list prints its pieces
    reduce_phases_by: dict = field(default_factory=dict)
    #: the collective of the shard units' gradient reduction: "all-reduce" for DeepSpeed ZeRO-3
    #: of 2021's gradient buckets (:func:`meshplan.comm.deepspeed.grad_buckets`), else FSDP's
    shard_reduce_op: str = "reduce-scatter"
    #: DeepSpeed ZeRO-3 of 2021's gradient reductions by the module whose hook flushes their
    #: bucket: (group, module) -> (seconds, buckets) per unit (:func:`~meshplan.schedule.deepspeed_layer.ds_backward_layer`)
    ds_flush: dict = field(default_factory=dict)
    #: DeepSpeed ZeRO++ hpZ's micro-batch 0 forward (:data:`meshplan.comm.zeropp_rows.HPZ_FIRST` rows):
    #: its gathers' seconds, NIC and SM shares by key, and its units' secondary copies by (group, op),
    #: in place of ``t``, ``nic``, ``share`` and ``copies`` in :meth:`first_microbatch`
    first: dict = field(default_factory=dict)

    def reduce_parts(self, seconds: float, per_step: bool = False) -> list[tuple[str, float, str]]:
        """``seconds`` of the gradient reduction (a piece, :func:`~meshplan.schedule.grad_reduce.reduce_pieces`,
        or with ``per_step`` the step-end whole of ``step_reduce_s``) as (stream, seconds,
        collective) by the stream of its rows (:func:`split_by_stream`): a piece splits the
        micro-batch's rows when there are (ZeRO-2, whose pieces reduce_pieces places), else the
        per-step ones; the collective, the stream's rows' one all-reduce or reduce-scatter, else "".

        Llama-3-8B at tp 8, dp 1, SP without FSDP: the norms' weight gradients, all over tp:

        >>> c = CommTimes(step_reduce_s=2.0, step_reduce_by={"tp": 2.0}, reduce_ops_by={"tp": {"all-reduce"}})
        >>> c.reduce_parts(0.5)
        [('tp', 0.5, 'all-reduce')]
        """
        by = self.mb_reduce_by if self.mb_reduce_s and not per_step else self.step_reduce_by
        return [(k, x, _one_op(self.reduce_ops_by.get(k, ()))) for k, x in split_by_stream(by, seconds)]

    def gather_parts(self, seconds: float) -> list[tuple[str, float]]:
        """``seconds`` of the per-step parameter all-gather by the stream of its rows (:func:`split_by_stream`)."""
        return split_by_stream(self.step_gather_by, seconds)

    @classmethod
    def from_rows(cls, rows, layers: int = 1, sm_share=None) -> "CommTimes":
        """From a stage's collective rows; ``layers``: transformer layers of the stage;
        ``sm_share``: row -> fraction of the GPU's SMs its NCCL kernel holds while it runs
        (:func:`nccl_sm_share`), kept per key in ``share`` and per kind under (kind,). Each row by
        its kind: hpZ's micro-batch 0 gathers apart (:func:`_hpz_first`), the per-step rows
        (:func:`_step_row`), the FSDP/ZeRO-3 rows (:func:`_shard_row`), the rest per stream
        (:func:`_stream_row`); then the registered axes' slots that have rows."""
        c, other = cls(layers=layers), []
        zp: dict = {}  # ZeRO++'s gathers: key -> (seconds x calls, calls) per step
        for r in rows:
            kind = comm_kind(r)
            if kind == "shard" and HPZ_FIRST in r.cadence:
                _hpz_first(c, r, sm_share)
                continue
            _keep_nic(c.nic, kind, r)
            if sm_share is not None and (f := sm_share(r)) > 0:
                key = (kind, row_group(kind, r), r.phase, slot_op(kind, r))
                c.share[key] = f
                c.share[(kind,)] = max(f, c.share.get((kind,), 0.0))
            c.bucket_wait = c.bucket_wait or DEEPSPEED_BUCKET_CADENCE in r.cadence
            if kind == "step":
                _step_row(c, r)
            elif kind == "other":
                other.append(f"{r.axis} {r.phase} {r.op} ({r.cadence})")
            elif kind == "shard":
                _shard_row(c, zp, r, layers)
            else:
                _stream_row(c, kind, r, layers)
        for key, (num, calls) in zp.items():  # ZeRO++'s gathers: a unit's call, the mean over the step's
            c.t[key] = num / calls
        c.other = tuple(other)
        placed = {k[0] for k in c.t} - BUILT_IN_STREAMS
        if placed:
            c.slots = tuple((tl.stream, x) for tl in timeline_axes().values() if tl.stream in placed for x in tl.slots
                            if (tl.stream, "", x.phase, x.op) in c.t)
        return c

    def get(self, kind: str, phase: str, op: str, group: str = "") -> float:
        return self.t.get((kind, group, phase, op), 0.0)

    def first_microbatch(self) -> "CommTimes":
        """These times as micro-batch 0's forward meets them: hpZ's gathers over the whole group
        and its secondary copies (:attr:`first`; the same object without hpZ)."""
        if not self.first:
            return self
        f = self.first
        kind_max = lambda a, b: {**a, **b, **{k: max(a.get(k, 0.0), x) for k, x in b.items() if len(k) == 1}}
        return replace(self, t={**self.t, **f["t"]}, nic=kind_max(self.nic, f["nic"]),
                       share=kind_max(self.share, f["share"]), copies={**self.copies, **f["copies"]}, first={})

    def nic_share(self, kind: str, phase: str, op: str, group: str = "", stream: str = "") -> float:
        """Share of its NICs a collective of this key holds while it runs (:func:`nic_share`; 0
        off the network): the key's row's (0 where that row stays on NVLink), else, for a key with
        no row, the per-step reduction's rows on ``stream`` (its pieces, kind "dp"), else its kind's
        largest. A key with a row of its own never takes another row's share: Megatron-LM's etp
        all-gather (NVLink, etp 2 in a node) took the ep all-to-all's 0.899 (ep 8 over 2 nodes) when
        its 0 was read as no row (tests/test_nic_sharing.py)."""
        key = (kind, group, phase, op)
        if key in self.nic:
            return self.nic[key]
        return self.nic.get((kind, stream)) or self.nic.get((kind,), 0.0)

    def sm_share(self, kind: str, phase: str, op: str, group: str = "") -> float:
        """Fraction of the SMs a collective of this key holds (its kind's largest when the key
        has no row: the loss and norm-gradient collectives, the per-step reduction pieces)."""
        return self.share.get((kind, group, phase, op), self.share.get((kind,), 0.0))


def _hpz_first(c: CommTimes, r, sm_share) -> None:
    """hpZ's micro-batch 0 forward gather row ``r`` into :attr:`CommTimes.first`: its seconds, NIC
    and SM shares under its key, its secondary copy (``copy_s``) under (group, "all-gather")."""
    f = c.first
    for part in ("t", "nic", "share", "copies"):
        f.setdefault(part, {})
    key = ("shard", shard_group(r.cadence), r.phase, r.op)
    f["t"][key] = r.time_s
    _keep_nic(f["nic"], "shard", r)
    if sm_share is not None and (x := sm_share(r)) > 0:
        f["share"][key] = x
    f["copies"][(key[1], r.op)] = r.copy_s


def _step_row(c: CommTimes, r) -> None:
    """A per-step row ``r`` (kind "step", its stream :func:`step_stream`) into ``c``: a reduction's op
    and phase kept per stream; one micro-batch's reduction (ZeRO-2's, DeepSpeed ZeRO-1/2's bucket
    all-reduces per micro-batch) into ``mb_reduce_s``; else every call of the row (torch's SP norm
    gradients: 3 per norm per step) into the per-step all-gather (a synchronous call's host time,
    DeepSpeed ZeRO-3's persistent gather, runs beside its GPU time: the later of the two ends it)
    or reduction (DDP's and DeepSpeed's buckets counted)."""
    ds = DEEPSPEED_BUCKET_CADENCE in r.cadence
    lab = step_stream(r)
    if r.op != "all-gather":
        c.reduce_ops_by[lab] = c.reduce_ops_by.get(lab, frozenset()) | {r.op}
        c.reduce_phases_by[lab] = c.reduce_phases_by.get(lab, frozenset()) | {r.phase}
    if ZERO2_CADENCE in r.cadence or (ds and r.per_microbatch):  # one micro-batch's
        c.mb_reduce_s += r.time_s * r.per_microbatch
        _add_to(c.mb_reduce_by, lab, r.time_s * r.per_microbatch)
        c.mb_buckets += r.per_microbatch
    elif r.op == "all-gather":  # a synchronous call's host time (DeepSpeed ZeRO-3's persistent
        # gather) runs beside its GPU time: the later of the two ends it
        c.step_gather_s += max(r.time_s, r.host_s) * max(r.per_step, 1)
        _add_to(c.step_gather_by, lab, max(r.time_s, r.host_s) * max(r.per_step, 1))
        c.gather_buckets += max(r.per_step, 1)
    else:
        c.step_reduce_s += r.time_s * max(r.per_step, 1)
        _add_to(c.step_reduce_by, lab, r.time_s * max(r.per_step, 1))
        c.ddp_buckets += max(r.per_step, 1) if "(DDP" in r.cadence or ds else 0


def _stream_row(c: CommTimes, kind: str, r, layers: int) -> None:
    """A row ``r`` of neither the per-step nor the FSDP kinds into ``c``: the KV-cache's, float8's
    per-step scale all-reduces (tp apart), the pp transfers (the largest), the loss collectives and
    the async tp all-reduces per micro-batch (these per layer), else its seconds per call under its
    key (:func:`_keep_row`)."""
    if kind == "kv":
        c.kv_s, c.kv_calls = r.time_s, c.kv_calls + r.per_step
    elif kind == "float8_step" and r.axis == Axis.TP:
        c.float8_tp_step_s += r.time_s * max(r.per_step, 1)
    elif kind == "float8_step":
        c.float8_step_s += r.time_s * max(r.per_step, 1)
    elif kind == "pp":
        c.p2p_s = max(c.p2p_s, r.time_s)
    elif kind == "pp_gather":
        c.p2p_gather_s = max(c.p2p_gather_s, r.time_s)
    elif kind == "loss":
        c.loss_s += r.time_s * r.per_microbatch
    elif kind == "tp_async":
        c.async_s += r.time_s * r.per_microbatch / max(layers, 1)
        c.async_calls += r.per_microbatch / max(layers, 1)
    else:
        _keep_row(c, kind, r)


def _shard_row(c: CommTimes, zp: dict, r, layers: int) -> None:
    """An FSDP/ZeRO-3 row ``r`` (kind "shard") into ``c``: DeepSpeed ZeRO-3 2021's per-parameter
    calls (:func:`_ds_shard_row`), a ``stage3_max_reuse_distance`` part (none: its seconds are a
    share of the unit's, :func:`~meshplan.schedule.rank_timeline.layer_gather`,
    ``Overlap.fsdp_backward``), ZeRO++'s (:func:`_zeropp_row`), DeepSpeed ZeRO-3's reduce-scatters
    per ipg bucket (:mod:`meshplan.comm.deepspeed_ipg`: their seconds summed per layer), else its
    seconds per call and copy-out (:func:`_keep_row`)."""
    if DEEPSPEED_CADENCE in r.cadence:  # per-parameter calls: their sum per unit
        _ds_shard_row(c, r, layers)
    elif REUSE_PART in r.cadence:
        pass  # its seconds are a share of the unit's (rank_timeline.layer_gather, Overlap.fsdp_backward)
    elif zeropp.MARK in r.cadence:
        _zeropp_row(c, zp, r, layers)
    elif IPG in r.cadence:  # DeepSpeed ZeRO-3's reduce-scatters per ipg bucket: their sum per layer
        group = shard_group(r.cadence)
        key = ("shard", group, r.phase, r.op)
        c.t[key] = c.t.get(key, 0.0) + r.time_s * (r.per_microbatch or r.per_step) / (
            max(layers, 1) if group == "layer" else 1)
    else:
        _keep_row(c, "shard", r)


def _keep_row(c: CommTimes, kind: str, r) -> None:
    """Row ``r``'s seconds per call under (kind, group, phase, op), and for an FSDP row its
    copy-out per (group, op), the largest of the rows'."""
    group = row_group(kind, r)
    c.t[(kind, group, r.phase, r.op)] = r.time_s
    if kind == "shard" and r.copy_s:
        c.copies[(group, r.op)] = max(r.copy_s, c.copies.get((group, r.op), 0.0))


def _ds_shard_row(c: CommTimes, r, layers: int) -> None:
    """One DeepSpeed ZeRO-3 2021 row of per-parameter calls (:mod:`meshplan.comm.deepspeed`) into
    ``c``: their seconds and host time summed per unit and call (a layer's per layer); the
    gradient buckets' all-reduces take the unit's reduction slot (named AR in the timeline); a
    gradient reduction's seconds and bucket count kept where its bucket is flushed (``ds_flush``)."""
    group = shard_group(r.cadence)
    # the gradient buckets' all-reduces take the unit's reduction slot (named AR in the timeline)
    op = "reduce-scatter" if r.op == "all-reduce" else r.op
    c.shard_reduce_op = r.op if r.op == "all-reduce" else c.shard_reduce_op
    key, per = ("shard", group, r.phase, op), r.per_microbatch / (max(layers, 1) if group == "layer" else 1)
    c.t[key] = c.t.get(key, 0.0) + r.time_s * per
    c.host[(group, r.phase)] = c.host.get((group, r.phase), 0.0) + r.host_s * per
    if deepspeed.FLUSHED in r.cadence:  # a gradient reduction: where its bucket is flushed
        module = r.cadence.split(deepspeed.FLUSHED)[1].rstrip(")")
        at = (group, DS_ALIAS.get(module, module))
        bucket = r.op == "all-reduce" or "first of its bucket" in r.cadence
        sec, n = c.ds_flush.get(at, (0.0, 0.0))
        c.ds_flush[at] = (sec + r.time_s * per, n + per * bucket)


def _zeropp_row(c: CommTimes, zp: dict, r, layers: int) -> None:
    """One DeepSpeed ZeRO++ row into ``c`` (:mod:`meshplan.comm.zeropp_rows`): an all-gather into
    ``zp``, whose mean over the step's calls is the unit's gather (hpZ: the secondary group's;
    micro-batch 0's forward over every rank is apart, :func:`_hpz_first`); a reduction row (qgZ's
    all-to-alls, the gradients reduce-scattered alone) summed into the unit's reduction, its calls per unit."""
    group = shard_group(r.cadence)
    if r.op == "all-gather":
        num, calls = zp.get(("shard", group, r.phase, r.op), (0.0, 0))
        zp[("shard", group, r.phase, r.op)] = (num + r.time_s * r.per_step, calls + r.per_step)
        return
    key, per = ("shard", group, r.phase, "reduce-scatter"), r.per_microbatch / (max(layers, 1) if group == "layer" else 1)
    c.t[key] = c.t.get(key, 0.0) + r.time_s * per


def _add_to(by: dict, key: str, seconds: float) -> None:
    by[key] = by.get(key, 0.0) + seconds


def _one_op(ops) -> str:
    """The one all-reduce or reduce-scatter of ``ops``, else "" (none, several, another)."""
    (op,) = ops if len(ops) == 1 else ("",)
    return op if op in ("all-reduce", "reduce-scatter") else ""


def _keep_nic(nic: dict, kind: str, r) -> None:
    """Keep row ``r``'s :func:`nic_share` in ``nic`` under its key (the one
    :meth:`CommTimes.from_rows` times it under; 0 kept too, so the key reads as having a row, unless
    another row of the key holds a share), its kind and, for a per-step reduction row, ("dp", its
    stream) (:meth:`CommTimes.nic_share`)."""
    key = (kind, row_group(kind, r), r.phase, slot_op(kind, r))
    if (f := nic_share(r)) <= 0:
        nic.setdefault(key, 0.0)
        return
    nic[key] = f
    nic[(kind,)] = max(f, nic.get((kind,), 0.0))
    if kind == "step" and r.op != "all-gather":
        nic[("dp", step_stream(r))] = max(f, nic.get(("dp", step_stream(r)), 0.0))


#: Parameter modules of torch's layer (separate Q, K, V and gate projections) in the piece that
#: holds their ops.
DS_ALIAS = {"wq": "query_key_value", "wk": "query_key_value", "wv": "query_key_value", "w_gate": "w_up"}


def root_groups(comm: CommTimes) -> tuple[str, str]:
    """Timeline groups of the embedding's and the head's FSDP units: "root_embed" and
    "root_head" when the stage's table has them apart, else both "root" (one root unit)."""
    groups = {k[1] for k in comm.t if k[0] == "shard"}
    return ("root_embed" if "root_embed" in groups else "root", "root_head" if "root_head" in groups else "root")
