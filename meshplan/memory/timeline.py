"""Per-rank memory timeline of one training step: events, running totals by kind, the
peak (when, what dominates it) and the headroom against HBM and the reserve.

One timeline per pipeline stage (the distinct rank roles: every rank of a stage holds the
same bytes up to ``ceil`` padding). Events follow the planned schedule
(:mod:`meshplan.memory.schedule`): init (persistent state, NCCL buffers, workspace), the
forward and backward passes of every model chunk for every micro-batch, the optimizer
step. What each pass allocates and frees is in :mod:`meshplan.memory.passes`; the sizes and
their sources are in :mod:`meshplan.memory.sizes`; the stated parameters are
:class:`~meshplan.spec.memory.MemoryOptions` (config table ``[memory]``).

Kinds (:data:`KINDS`): ``params``, ``master``, ``optimizer``, ``grads`` (persistent state,
:func:`~meshplan.memory.state.state_bytes`, by sharding axis), ``comm_buffers`` (NCCL's,
and DeepEP's under the deepep dispatcher: :mod:`meshplan.memory.deepep_buffers`; outside PyTorch's
allocator), ``userbuffers`` (Transformer Engine's under Megatron-LM's ``--tp-comm-overlap``:
:mod:`meshplan.memory.userbuffers`; outside it too), ``workspace`` (cuBLAS), ``fragmentation`` (allowance),
``gathered_params`` (FSDP all-gathers), ``grad_buffers`` (unsharded gradients,
reduce-scatter inputs, buckets), ``activations`` (saved for backward and recomputed),
``temporaries`` (working sets, logits, optimizer-step temporaries).

Storage is run-length: a pass is built once per distinct shape (first backward, last
backward, already-gathered units...) and repeated, so 80 layers x 64 micro-batches stay a
few templates and a table of passes (:class:`~meshplan.memory.passtable.PassTable`, one
row per pass); :meth:`Timeline.events` expands them on demand. Which template each pass
repeats and the peak are computed on arrays (:mod:`meshplan.memory.passtable`,
:mod:`meshplan.memory.peakscan`), equal to
the pass-by-pass model (:mod:`meshplan.memory.reference`, ``reference=True``). The timeline is the
steady state (second step on): optimizer state exists from the start; FSDP's sharded
gradients appear at their first reduce-scatter and are freed at ``zero_grad``.

Compare with PyTorch's trackers via :func:`tracker_to_kinds` and :data:`COMPARISON_GROUPS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Optional

import numpy as np

from meshplan.units import GiB, counted, human_bytes
from meshplan.memory.constraints import usable_hbm_bytes
from meshplan.memory import reference as ref
from meshplan.memory.allocator import AllocatorConfig
from meshplan.memory.passes import KINDS, UNTRACKED_KINDS
from meshplan.memory.reserved import Reserved, reserved_of
from meshplan.memory import peakscan as fast
from meshplan.memory.passtable import Pass, PassTable, pass_table
from meshplan.memory.peakscan import template_stats
from meshplan.memory.schedule import stage_op_arrays, stage_ops
from meshplan.memory.wlag import cooldown_lag_levels, head_lag_bytes, lag_hold_bytes
from meshplan.pipeline.registry import get
from meshplan.pipeline.unshard_window import (TORCH_WINDOW, pipeline_window, released_after, unshards,
                                              unshards_before, unshards_first)
from meshplan.memory.sizes import CommonSizes, common_sizes, stage_sizes
from meshplan.spec.mesh_words import mesh_text, schedule_words

_K = {k: i for i, k in enumerate(KINDS)}
__all__ = ["UNTRACKED_KINDS"]  # re-exported: kinds PyTorch's caching allocator never sees (meshplan.memory.passes)
#: Coarse groups for comparing with a tracker: params, grads, optimizer, activations, temporaries.
COMPARISON_GROUPS = {"params": ("params", "master", "gathered_params"), "grads": ("grads", "grad_buffers"),
                     "optimizer": ("optimizer",), "activations": ("activations",),
                     "temporaries": ("temporaries", "workspace")}
#: PyTorch tracker categories per meshplan kind: FSDPMemTracker (``_FSDPRefType``) and
#: MemTracker (``_MemRefType``), torch/distributed/_tools. FSDP2 keeps fp32 sharded
#: parameters, so ``master`` has no category there.
TRACKER_CATEGORIES = {"params": ("Sharded Param", "Parameter", "Buffer"),
                      "gathered_params": ("Unsharded Param", "All Gather"),
                      "grads": ("Sharded Grad", "Gradient"), "grad_buffers": ("Unsharded Grad", "Reduce Scatter"),
                      "optimizer": ("OptState", "Optstate"), "activations": ("Activation", "Inputs"),
                      "temporaries": ("Temp",)}


def tracker_to_kinds(categories: dict[str, float]) -> dict[str, float]:
    """A tracker's bytes per category (e.g. FSDPMemTracker's peak snapshot summed over
    devices) as bytes per meshplan kind; unknown categories go to ``other``.

    >>> tracker_to_kinds({"Sharded Param": 10, "All Gather": 2, "Unsharded Param": 4, "Temp": 1, "Other": 3})
    {'params': 10, 'gathered_params': 6, 'temporaries': 1, 'other': 3}
    """
    where = {c: k for k, cats in TRACKER_CATEGORIES.items() for c in cats}
    out: dict[str, float] = {}
    for cat, n in categories.items():
        k = where.get(cat, "other")
        out[k] = out.get(k, 0) + n
    return out


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (``delta_bytes`` > 0) or free (< 0) of ``kind`` on one rank."""

    t_index: int
    phase: str
    layer: Optional[int]
    microbatch: Optional[int]
    kind: str
    delta_bytes: int
    label: str


@dataclass(frozen=True)
class Peak:
    """The largest running total: ``total_bytes`` at event ``t_index`` and the bytes per
    kind there (``by_kind``)."""

    total_bytes: int
    t_index: int
    phase: str
    layer: Optional[int]
    microbatch: Optional[int]
    label: str
    by_kind: dict

    def where(self) -> str:
        """``backward of layer 0 (micro-batch 7)``, ``forward of the head``, ..."""
        if self.phase in ("init", "step"):
            return "the optimizer step" if self.phase == "step" else "init"
        if self.layer is not None:
            what = f"layer {self.layer}"
        else:
            first = self.label.split(":")[0].split(" ")[0]
            head = first in ("head", "loss", "output", "final")
            what = "the head" if head else f"the {first}" if first in ("embedding", "root") else "the chunk boundary"
        return f"{self.phase} of {what} (micro-batch {self.microbatch})"

    def dominant(self, n: int = 3) -> list[tuple[str, int]]:
        """The ``n`` largest kinds at the peak, largest first."""
        return sorted(((k, v) for k, v in self.by_kind.items() if v), key=lambda kv: -kv[1])[:n]


@dataclass(frozen=True)
class Timeline:
    """Memory of one rank of pipeline stage ``stage`` over one training step."""

    stage: int
    schedule: str
    micro_batches: int
    passes: PassTable
    templates: tuple[tuple, ...]
    hbm_bytes: float
    reserve: float
    peak: Peak
    max_by_kind: dict
    n_events: int
    title: str = ""
    notes: tuple[str, ...] = field(default=())
    #: ``schedule`` as the output prints it: ``no pipeline`` at pp 1
    #: (:func:`meshplan.spec.mesh_words.schedule_words`)
    pipeline: str = ""
    #: the caching allocator's options (``[memory] expandable_segments``)
    allocator: AllocatorConfig = AllocatorConfig()
    #: its reserved bytes where ``[memory] reserved_verdict`` holds them against usable memory, else None
    reserved: Optional[Reserved] = None

    @property
    def usable_bytes(self) -> float:
        """HBM x (1 - reserve) (:func:`meshplan.memory.constraints.usable_hbm_bytes`)."""
        return usable_hbm_bytes(self.hbm_bytes, self.reserve)

    def reserved_memory(self) -> Reserved:
        """PyTorch's caching allocator on this timeline (:func:`meshplan.memory.reserved.reserved_of`):
        the verdict's where ``[memory] reserved_verdict`` is set, else simulated when asked."""
        return self.reserved if self.reserved is not None else reserved_of(self, self.allocator)

    @property
    def verdict_bytes(self) -> int:
        """The bytes held against usable memory: the peak incl. communication buffers (all kinds;
        :mod:`meshplan.memory.reserved`'s terms), or under
        ``[memory] reserved_verdict`` the allocator's reserved peak plus the communication buffers
        (:attr:`meshplan.memory.reserved.Reserved.device_bytes`)."""
        return self.peak.total_bytes if self.reserved is None else self.reserved.device_bytes

    def verdict_words(self) -> str:
        """:attr:`verdict_bytes` as the ``fix:`` lines print it (GiB, 1 decimal): ``peak 45.1 GiB``,
        or under ``[memory] reserved_verdict`` ``reserved peak 47.3 GiB`` (the allocator's reserved
        peak plus the communication buffers, what decides the fit, not the peak incl. communication
        buffers)."""
        return f"{'peak' if self.reserved is None else 'reserved peak'} {self.verdict_bytes / GiB:.1f} GiB"

    @property
    def headroom_bytes(self) -> float:
        """Usable bytes left at the peak (negative: does not fit); under ``[memory]
        reserved_verdict`` at the reserved peak (:attr:`verdict_bytes`)."""
        return self.usable_bytes - self.verdict_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0

    def reason(self) -> Optional[str]:
        """Why the stage does not fit, or None."""
        if self.fits:
            return None
        usable = f"{self.usable_bytes / GiB:.1f} GiB usable ({self.hbm_bytes / GiB:.1f} GiB - {self.reserve:.0%} reserve)"
        if self.reserved is not None:
            r = self.reserved
            return (f"caching allocator reserves {r.reserved_bytes / GiB:.1f} GiB on stage {self.stage} (allocated peak "
                    f"{r.stats.allocated_peak_bytes / GiB:.1f} GiB) + {r.untracked_bytes / GiB:.1f} GiB communication "
                    f"buffers > {usable} (memory.reserved_verdict)")
        return f"peak {self.peak.total_bytes / GiB:.1f} GiB at {self.peak.where()} on stage {self.stage} > {usable}"

    def summary(self) -> str:
        """One line: peak, when, what dominates it, headroom (under ``[memory] reserved_verdict``
        to the allocator's reserved peak and the communication buffers, :attr:`verdict_bytes`)."""
        p = self.peak
        dom = ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.dominant())
        held = "" if self.reserved is None else f" (reserved {self.verdict_bytes / GiB:.2f} GiB)"
        return (f"stage {self.stage}: peak {p.total_bytes / GiB:.2f} GiB at {p.where()}, event {p.t_index} of "
                f"{self.n_events}; dominated by {dom} GiB; headroom{held} {self.headroom_bytes / GiB:.2f} GiB to "
                f"{self.usable_bytes / GiB:.1f} GiB usable ({self.hbm_bytes / GiB:.1f} GiB HBM - {self.reserve:.0%})")

    def by_group(self, by_kind: Optional[dict] = None) -> dict[str, int]:
        """Bytes per :data:`COMPARISON_GROUPS` group (default: at the peak)."""
        bk = self.peak.by_kind if by_kind is None else by_kind
        return {g: sum(bk.get(k, 0) for k in ks) for g, ks in COMPARISON_GROUPS.items()}

    def events(self) -> Iterator[MemoryEvent]:
        """Every event in order (expanded from the run-length passes)."""
        for p in self.passes:
            for i, (layer, kind, delta, label) in enumerate(self.templates[p.template]):
                yield MemoryEvent(p.first_event + i, p.phase, layer, p.microbatch, kind, delta, label)

    def running(self) -> np.ndarray:
        """Bytes per kind after each event: array (n_events, len(KINDS))."""
        deltas = np.zeros((self.n_events, len(KINDS)))
        for p in self.passes:
            for i, (_, kind, delta, _) in enumerate(self.templates[p.template]):
                deltas[p.first_event + i, _K[kind]] = delta
        return np.cumsum(deltas, axis=0)

    def window(self, t_index: int, before: int = 8, after: int = 3) -> list[MemoryEvent]:
        """Events ``t_index - before .. t_index + after``."""
        lo, hi = t_index - before, t_index + after
        return [e for p in self.passes if p.first_event <= hi and p.first_event + len(self.templates[p.template]) > lo
                for e in self._pass_events(p) if lo <= e.t_index <= hi]

    def _pass_events(self, p: Pass) -> list[MemoryEvent]:
        return [MemoryEvent(p.first_event + i, p.phase, layer, p.microbatch, kind, delta, label)
                for i, (layer, kind, delta, label) in enumerate(self.templates[p.template])]


def memory_timeline(plan, stage: int, reference: bool = False) -> Timeline:
    """Timeline of one rank of pipeline stage ``stage`` of a feasible-so-far ``plan``
    (a :class:`~meshplan.plan.Plan` with its mesh, stages, state and collectives).
    Passes and peak on arrays (:mod:`meshplan.memory.passtable`, :mod:`meshplan.memory.peakscan`); ``reference``: pass by
    pass in Python (:mod:`meshplan.memory.reference`), the same result, slower."""
    return _timeline(plan, stage, _common(plan), reference)


def _common(plan) -> tuple[list[str], CommonSizes]:
    """What every stage's sizes share: the axes with collectives (one NCCL communicator
    each), the layers' and the head's sizes."""
    c = plan.config
    order = {a: i for i, a in enumerate(plan.mesh.all_axes())}
    axes = sorted({r.axis for rows in plan.collectives.values() for r in rows}, key=lambda a: order.get(a, 99))
    return axes, common_sizes(c.model, c.training, plan.mesh, c.memory)


def _timeline(plan, stage: int, common: tuple[list[str], CommonSizes], reference: bool) -> Timeline:
    c = plan.config
    t, opts = c.training, c.memory
    sizes = stage_sizes(c.model, t, plan.mesh, plan.stages, plan.state[stage], opts, common[0], common[1], c.origin,
                        c.cluster.gpu.cuda_sm)
    # one pipeline schedule run (training.pp_schedule_runs): each run starts from sharded parameters
    where = (c.mesh.pp_schedule, stage, len(plan.stages), plan.run_micro_batches, plan.vpp)
    layers = [i for chunk in plan.stages[stage] for i in chunk]
    sizes = replace(sizes, w_lag=lag_hold_bytes(c.model, t, plan.mesh, *where, layers),  # ZB-H1's lagging W
                    head_lag=head_lag_bytes(where[0], where[2], where[4], sizes.logits_grad_temp, sizes.head_loss_saved))
    phase, chunk, mb = stage_op_arrays(*where)
    v_lag = _v_lag(plan, where, phase)  # ZB-V's, DualPipeV's lagging W passes: (bytes per op, most at once)
    lag = None if v_lag is None else v_lag[0]
    # torch's window of unsharded local stages: at vpp > 3 it evicts chunks (interleaved 1F1B only;
    # ZB-V and DualPipeV hold 2 stages a rank, so the F/B ops alone give the same evictions)
    window = pipeline_window(t.framework, len(plan.stages))
    evict = released_after(chunk, window) if plan.vpp > TORCH_WINDOW and sizes.fsdp else None
    # torch's UNSHARD actions (multi-stage schedules): each chunk's all-gathers from the UNSHARD
    # up to 2 distinct chunks ahead of the pass that waits for them
    torch_unshards = sizes.fsdp and sizes.deepspeed_prefetch is None and unshards_first(c.mesh.pp_schedule, window)
    waits, pre = (unshards(chunk, window), unshards_before(chunk, window)) if torch_unshards else (None, None)
    passes, templates = ref.passes(sizes, stage_ops(*where), () if evict is None else evict.tolist(),
                                   () if waits is None else waits.tolist(), pre, () if lag is None else lag.tolist()) \
        if reference else pass_table(sizes, phase, chunk, mb, evict, waits, pre, lag)
    peak_of = _reference_peak if reference else _fast_peak
    passes, n, off, at_peak, kmax = peak_of(passes, templates, opts.fragmentation_fraction)
    p = passes[n]
    layer, kind, delta, label = templates[p.template][off]
    peak = Peak(int(at_peak.sum()), p.first_event + off, p.phase, layer, p.microbatch, label,
                {k: int(at_peak[i]) for i, k in enumerate(KINDS)})
    n_events = passes[-1].first_event + len(templates[-1])
    m = plan.mesh
    title = f"{c.model.name}, {mesh_text(m.layout.names, m.layout.shape, t.sharding, m.ep, m.etp)}"
    tl = Timeline(stage=stage, schedule=c.mesh.pp_schedule, micro_batches=plan.run_micro_batches, passes=passes,
                  templates=tuple(templates), hbm_bytes=c.cluster.gpu.hbm_bytes, reserve=t.memory_reserve,
                  peak=peak, max_by_kind=kmax, n_events=n_events, title=title,
                  notes=_notes(plan, stage, sizes.fsdp, v_lag),
                  pipeline=schedule_words(c.mesh.pp_schedule, len(plan.stages)),
                  allocator=AllocatorConfig(expandable_segments=opts.expandable_segments))
    return replace(tl, reserved=reserved_of(tl, tl.allocator)) if opts.reserved_verdict else tl


def _v_lag(plan, where: tuple, phase: np.ndarray) -> Optional[tuple[np.ndarray, int]]:
    """Under a V-shaped schedule the output-gradient bytes each op holds for the lagging W passes
    (``where``: schedule, stage, pp, micro-batches, vpp; ``phase`` per op, 1 backward): at each
    backward pass its W's level (:func:`meshplan.memory.wlag.cooldown_lag_levels`), 0 on the
    forwards (none runs while a W lags); and the most chunk passes lagging at once. None for other
    schedules."""
    c, (schedule, stage, pp, m, vpp) = plan.config, where
    got = cooldown_lag_levels(c.model, c.training, plan.mesh, schedule, stage, pp, m, vpp, plan.stages[stage])
    if got is None:
        return None
    lag = np.zeros(len(phase), np.int64)
    lag[phase == 1] = got[0]
    return lag, got[1]


def _allowance(fraction: float, at_peak: np.ndarray) -> tuple:
    """The fragmentation event appended to init: ``fraction`` of the peak's total bytes."""
    return (None, "fragmentation", int(fraction * int(at_peak.sum())), f"allocator allowance {fraction:.0%} of the peak")


def _reference_peak(passes: PassTable, templates: list, fraction: float) -> tuple:
    """(passes, peak pass, offset, bytes per kind there, max per kind), pass by pass; with a
    fragmentation ``fraction`` the init template (``templates[0]``, changed in place) ends
    with its allowance and the passes are scanned again."""
    n, off, at_peak, kmax = ref.scan(passes, templates)
    if fraction:
        templates[0] = templates[0] + (_allowance(fraction, at_peak),)
        passes = passes.shifted(1)
        n, off, at_peak, kmax = ref.scan(passes, templates)
    return passes, n, off, at_peak, kmax


def _fast_peak(passes: PassTable, templates: list, fraction: float) -> tuple:
    """:func:`_reference_peak` on arrays (:mod:`meshplan.memory.peakscan`); the allowance
    changes only the init template, so the other templates' stats and the passes' scores
    are kept (:meth:`~meshplan.memory.peakscan.Scores.with_init_event`)."""
    stats = [template_stats(t) for t in templates]
    sc = fast.scores(passes, templates, stats)
    n, off, at_peak, kmax = fast.peak(passes, templates, stats, sc)
    if fraction:
        event = _allowance(fraction, at_peak)
        templates[0] = templates[0] + (event,)
        passes = passes.shifted(1)
        stats[0] = template_stats(templates[0])
        sc = (sc.with_init_event(stats[0][1], "fragmentation", event[2]) if fast.init_only_at_first(passes)
              else fast.scores(passes, templates, stats))
        n, off, at_peak, kmax = fast.peak(passes, templates, stats, sc)
    return passes, n, off, at_peak, kmax


def _notes(plan, stage: int, fsdp: bool, v_lag: Optional[tuple[np.ndarray, int]] = None) -> tuple[str, ...]:
    """Assumptions of this timeline that a reader should see beside its numbers (``v_lag``: a V-shaped
    schedule's lag, :func:`_v_lag`)."""
    c, out = plan.config, []
    # an MoE model's routing assumption: print_memory's one note (meshplan.compute.routing.balance_note)
    sched = get(get(c.mesh.pp_schedule).for_chunks(plan.vpp))
    if sched.frees_at_weight and len(plan.stages) > 1:
        lag = int(sched.lagging_weights(len(plan.stages), plan.run_micro_batches, plan.vpp, stage))
        out.append(f"{sched.name}: activations held till the weight-gradient pass (W), as torch's input-gradient pass "
                   f"frees none; the output gradients of up to {counted(lag, 'lagging W pass')} "
                   "held during each backward (every layer's, the final norm's on the head's stage)")
    elif v_lag is not None:  # ZB-V, DualPipeV (every other split-backward schedule is ZB-H1's branch)
        out.append(_cooldown_note(sched, *v_lag))
    runs = plan.schedule_runs
    if fsdp and len(plan.stages) > 1:
        out.append(f"FSDP reduces once per {'schedule run' if runs > 1 else 'step'}, after each chunk's last backward, "
                   "as torch.distributed.pipelining does (the collective table's count): gathered parameters and "
                   "unsharded gradients held till then")
    if runs > 1:
        out.append(f"one of the step's {runs} pipeline schedule runs of {counted(plan.run_micro_batches, 'micro-batch')} "
                   "(training.pp_schedule_runs); every run repeats it")
    out.append("steady state (second step on); NCCL buffers are outside PyTorch's caching allocator")
    return tuple(out)



def _cooldown_note(sched, lag: np.ndarray, most: int) -> str:
    """A V-shaped schedule's cool-down (:func:`meshplan.memory.wlag.cooldown_lag_levels`, ``lag`` per op
    and ``most`` chunk passes at once): how many W passes lag at once and the most output gradients they
    hold (:func:`meshplan.memory.wlag.cooldown_lag_bytes`), both in this peak (the backward passes stand
    at the Ws, each holding its level)."""
    return (f"{sched.name}: activations held till the weight-gradient pass (W), as torch's input-gradient pass "
            f"frees none; the cool-down's lagging W passes, up to {most} at once, hold their chunks' activations and "
            f"{human_bytes(int(lag.max(initial=0)))} of output gradients till W, counted in this peak")


def memory_timelines(plan) -> tuple[Timeline, ...]:
    """:func:`memory_timeline` of every stage."""
    return tuple(stage_timelines(plan))


def stage_timelines(plan) -> Iterator[Timeline]:
    """:func:`memory_timeline` of stage 0, 1, ... one at a time, each planned when asked for (a
    caller that stops at the first stage over usable memory plans no more)."""
    common = _common(plan)
    return (_timeline(plan, k, common, False) for k in range(len(plan.stages)))


def most_loaded(timelines) -> Timeline:
    """The timeline with the highest peak (the earliest stage on a tie)."""
    return max(timelines, key=lambda tl: (tl.peak.total_bytes, -tl.stage))
