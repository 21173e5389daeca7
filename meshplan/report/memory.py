"""Terminal report of the memory timeline: per-stage peaks, bytes per kind at the peak, the
passes of one step aggregated (repeated passes shown once with their count) and the events
around the peak. Sizes in GiB (2^30 B) and MiB when printed; SI bytes inside.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from meshplan.memory.headroom import retry_warning
from meshplan.compute.recompute import op_replays_ep
from meshplan.compute.routing import balance_note
from meshplan.memory.timeline import KINDS, Timeline
from meshplan.plan import Plan
from meshplan.report import shown
from meshplan.spec.mesh_words import schedule_words
from meshplan.spec.recompute_words import recompute_words
from meshplan.spec.wording import kind_words, reduce_words, runtime
from meshplan.units import GiB, MiB, counted, dtype_bytes

KIND_NOTES = {
    "params": "persistent parameters (state_bytes, by sharding axis)",
    "master": "fp32 master copy",
    "optimizer": "optimizer moments",
    "grads": "gradients kept for the step (FSDP: sharded, from the first reduce-scatter)",
    "comm_buffers": "NCCL buffers per communicator (outside PyTorch's allocator)",
    "userbuffers": "Transformer Engine's userbuffers of --tp-comm-overlap (outside PyTorch's allocator)",
    "workspace": "cuBLAS workspace",
    "fragmentation": "allocator allowance (stated fraction)",
    "gathered_params": "FSDP all-gathered layers (current + prefetched)",
    "grad_buffers": "unsharded gradients, reduce-scatter inputs, buckets",
    "activations": "saved for backward (recompute policy) and recomputed",
    "temporaries": "working sets, logits, optimizer-step temporaries",
}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _shown(plan: Plan, all_stages: bool) -> list[Timeline]:
    tls = plan.timelines
    if all_stages or len(tls) <= 4:
        return list(tls)
    keep = {0, plan.timeline.stage, len(tls) - 1}
    return [tl for tl in tls if tl.stage in keep]


def _prefetch(training, memory) -> str:
    """``prefetch 1 unit(s), `` (the caption's FSDP all-gather prefetch) where the parameters are
    sharded and gathered (zero3, hsdp); under DeepSpeed's ZeRO-3 the live cap its prefetch runs up
    to, and its bucket (:meth:`~meshplan.spec.memory.MemoryOptions.deepspeed_prefetch_bytes`;
    :func:`~meshplan.spec.deepspeed_memory.deepspeed_ahead_bytes`), none at a bucket of 0; empty
    under DDP and ZeRO-1/2, which gather nothing."""
    ds = memory.deepspeed_prefetch_bytes(training)
    if ds is not None:
        n = dtype_bytes(training.param_dtype)
        if not ds[0]:
            return "prefetch none (stage3_prefetch_bucket_size 0), "
        return (f"prefetch up to {ds[1] // n:,} parameters live (stage3_max_live_parameters; "
                f"stage3_prefetch_bucket_size {ds[0] // n:,}), ")
    return f"prefetch {memory.prefetch_layers} unit(s), " if training.sharding in ("zero3", "hsdp") else ""


def timeline_table(plan: Plan, all_stages: bool = False) -> Table:
    """One row per stage (first, most loaded and last when there are more than four)."""
    o, t = plan.config.memory, plan.config.training
    tab = Table(title="Memory timeline per rank, one training step (meshplan memory CONFIG for the events)",
                title_justify="left",
                caption=f"activations: {recompute_words(t, runtime(t, plan.config.origin), replays_ep=op_replays_ep(plan.config.model, t))}; "
                        f"{_prefetch(t, o)}"
                        f"{reduce_words(t, plan.config.origin, o.fsdp_reduce_for(t, plan.pp))}, NCCL "
                        f"{o.comm_bytes_per_group / MiB:g} MiB per communicator, workspace {o.workspace_bytes / MiB:g} "
                        f"MiB, fragmentation {o.fragmentation_fraction:.0%}; set them in \\[memory]",
                caption_justify="left")
    for col in ("stage", "peak (GiB)", "when", "dominated by (GiB)", "headroom (GiB)", "usable (GiB)"):
        tab.add_column(col, justify="right" if "GiB)" in col and "dominated" not in col else "left")
    top = plan.timeline.stage
    for tl in _shown(plan, all_stages):
        p = tl.peak
        style = "red" if not tl.fits else ("bold" if tl.stage == top else "")
        tab.add_row(f"{tl.stage}{' *' if tl.stage == top else ''}", _gib(p.total_bytes), p.where(),
                    ", ".join(f"{k} {v / GiB:.2f}" for k, v in p.dominant()), _gib(tl.headroom_bytes),
                    _gib(tl.usable_bytes), style=style)
    return tab


def kind_notes(plan: Plan) -> dict[str, str]:
    """What each memory kind holds, in the words of the plan's runtime (DeepSpeed's under
    DeepSpeed: :func:`meshplan.spec.wording.kind_words`, its partition over the ranks the state is
    sharded over, the fsdp axis: dp x cp, :mod:`meshplan.memory.state`), else :data:`KIND_NOTES`."""
    deepep = ({"comm_buffers": "NCCL buffers per communicator and, on the stages with MoE layers, DeepEP's NVL and "
                               "RDMA buffers and workspace (outside PyTorch's allocator)"}
              if plan.config.training.moe_dispatcher == "deepep" and plan.config.model.is_moe else {})
    t = plan.config.training
    master = {"master": f"master copy in {t.master_dtype} (training.master_dtype)"} if t.master_dtype != "fp32" else {}
    return KIND_NOTES | deepep | master | kind_words(t, plan.config.origin, plan.mesh.degree("fsdp"))


def kinds_table(tl: Timeline, notes: dict[str, str] = KIND_NOTES) -> Table:
    """Bytes per kind at the peak and the largest each reaches in the step; ``notes``: each
    kind's "what" (:func:`kind_notes`)."""
    tab = Table(title=f"Stage {tl.stage}: bytes per kind at the peak (event {tl.peak.t_index}) and their maxima",
                title_justify="left")
    for col in ("kind", "at peak (GiB)", "share", "max in step (GiB)", "what"):
        tab.add_column(col, justify="left" if col in ("kind", "what") else "right")
    total = tl.peak.total_bytes or 1
    for k in KINDS:
        at, mx = tl.peak.by_kind[k], tl.max_by_kind[k]
        if at or mx:
            tab.add_row(k, _gib(at), f"{at / total:.0%}", _gib(mx), notes[k])
    tab.add_row("[bold]total[/]", f"[bold]{_gib(tl.peak.total_bytes)}[/]", "", "", "")
    return tab


@dataclass(frozen=True)
class Run:
    """``repeats`` repetitions of the passes ``start .. start + period - 1``."""

    start: int
    period: int
    repeats: int


def runs(tl: Timeline) -> list[Run]:
    """Passes grouped where the same pass (period 1) or pair of passes (period 2, e.g.
    1F1B's steady state) repeats."""
    ids = [(p.phase, p.template) for p in tl.passes]
    out, i, n = [], 0, len(ids)
    while i < n:
        best = (1, 1)
        for period in (1, 2):
            r = 1
            while i + (r + 1) * period <= n and ids[i + r * period:i + (r + 1) * period] == ids[i:i + period]:
                r += 1
            if r >= 2 and r * period > best[0] * best[1]:
                best = (period, r)
        out.append(Run(i, *best))
        i += best[0] * best[1]
    return out


def _pass_stats(tl: Timeline) -> list[tuple[int, int]]:
    """(net bytes, max prefix bytes) of every template."""
    out = []
    for entries in tl.templates:
        total, top = 0, 0
        for e in entries:
            total += e[2]
            top = max(top, total)
        out.append((total, top))
    return out


def _mbs(passes) -> str:
    mbs = sorted({p.microbatch for p in passes if p.microbatch is not None})
    if not mbs:
        return ""
    return str(mbs[0]) if len(mbs) == 1 else f"{mbs[0]}..{mbs[-1]}"


def _net_kinds(tl: Timeline, passes) -> str:
    net: dict[str, int] = {}
    for p in passes:
        for _, kind, delta, _ in tl.templates[p.template]:
            net[kind] = net.get(kind, 0) + delta
    parts = [f"{k} {v / GiB:+.2f}" for k, v in sorted(net.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= MiB]
    return ", ".join(parts[:3]) or "0"


def runs_table(tl: Timeline) -> Table:
    """The step as aggregated passes: events, micro-batches, repeats, net change per kind
    per repeat, total after the run and the largest total inside it."""
    tab = Table(title=f"Stage {tl.stage}: one step, {tl.pipeline or tl.schedule}, "
                      f"{counted(tl.micro_batches, 'micro-batch')} "
                      f"({tl.n_events:,} events, repeated passes aggregated)", title_justify="left")
    for col in ("events", "passes", "chunk", "micro-batches", "x", "net per repeat (GiB)", "after (GiB)", "max (GiB)"):
        tab.add_column(col, justify="left" if col in ("passes", "net per repeat (GiB)") else "right")
    stats = _pass_stats(tl)
    cur = 0
    for run in runs(tl):
        group = tl.passes[run.start:run.start + run.period]
        allp = tl.passes[run.start:run.start + run.period * run.repeats]
        top = cur
        for p in allp:
            top = max(top, cur + stats[p.template][1])
            cur += stats[p.template][0]
        last = allp[-1]
        end = last.first_event + len(tl.templates[last.template]) - 1
        peak = allp[0].first_event <= tl.peak.t_index <= end
        tab.add_row(f"{allp[0].first_event}..{end}", "+".join(p.phase for p in group),
                    ",".join(str(c) for c in dict.fromkeys(p.chunk for p in group)), _mbs(allp), str(run.repeats),
                    _net_kinds(tl, group), _gib(cur), _gib(top) + (" peak" if peak else ""),
                    style="bold red" if peak else "")
    return tab


def peak_window_table(tl: Timeline, before: int = 10, after: int = 3) -> Table:
    """Events around the peak with the running total."""
    events = tl.window(tl.peak.t_index, before, after)
    total = tl.peak.total_bytes - sum(e.delta_bytes for e in events if e.t_index <= tl.peak.t_index)
    tab = Table(title=f"Stage {tl.stage}: events around the peak", title_justify="left")
    for col in ("t", "phase", "mb", "layer", "kind", "delta (MiB)", "total (GiB)", "event"):
        tab.add_column(col, justify="left" if col in ("phase", "kind", "event") else "right")
    for e in events:
        total += e.delta_bytes
        tab.add_row(str(e.t_index), e.phase, "" if e.microbatch is None else str(e.microbatch),
                    "" if e.layer is None else str(e.layer), e.kind, f"{e.delta_bytes / MiB:+,.1f}", _gib(total),
                    e.label, style="bold red" if e.t_index == tl.peak.t_index else "")
    return tab


def reserved_line(tl: Timeline) -> str:
    """The caching allocator's simulated reserved peak beside its allocated peak
    (:meth:`~meshplan.memory.timeline.Timeline.reserved_memory`), what torchtitan and Megatron log
    as reserved and allocated, and which the verdict holds against usable memory: the reserved
    peak plus the communication buffers, or the timeline's peak incl. communication buffers (terms:
    :mod:`meshplan.memory.reserved`)."""
    r = tl.reserved_memory()
    s = r.stats
    held = ("the verdict holds it ([memory] reserved_verdict)" if tl.reserved is not None else
            "the verdict holds the peak incl. communication buffers; [memory] reserved_verdict = true holds this")
    return (f"caching allocator (stage {tl.stage}, simulated, expandable_segments "
            f"{'on' if r.config.expandable_segments else 'off'}): reserved peak {_gib(s.reserved_peak_bytes)} GiB "
            f"(torch.cuda.max_memory_reserved) beside the allocated peak {_gib(s.allocated_peak_bytes)} GiB "
            f"(torch.cuda.max_memory_allocated): "
            f"{_gib(s.cached_at_peak_bytes)} GiB ({r.fragmentation:.1%}) reserved and not allocated, cached or "
            f"fragmented, in {s.segments} segments; + {_gib(r.untracked_bytes)} GiB communication buffers = "
            f"{_gib(r.device_bytes)} of {_gib(tl.usable_bytes)} GiB usable; {held}")


def print_memory(plan: Plan, console: Console | None = None, all_stages: bool = False) -> None:
    """``meshplan memory``: stage peaks, then kinds, passes and the peak's events of the
    most loaded stage (every stage with ``all_stages``)."""
    con = console or Console()
    c = plan.config
    con.rule(f"[bold]meshplan memory[/] {shown(c.path or '')}")
    con.print(plan.timeline.title + f", {schedule_words(plan.spec.pp_schedule, plan.pp)}, micro-batch "
              f"{c.training.micro_batch} x seq "
              f"{c.training.seq_len}, sharding {c.training.sharding}, recompute {c.training.recompute}")
    con.print(timeline_table(plan, all_stages))
    for tl in (plan.timelines if all_stages else [plan.timeline]):
        con.print(escape(reserved_line(tl)))
        con.print(kinds_table(tl, kind_notes(plan)))
        con.print(runs_table(tl))
        con.print(peak_window_table(tl))
        for note in tl.notes:
            con.print(f"[dim]note (stage {tl.stage})[/] {escape(note)}")
    if (moe := balance_note(c.model, c.training)) is not None:  # once, whatever the stages shown
        con.print(f"[dim]note[/] {escape(moe)}")
    retry = retry_warning("this mesh", plan.timelines) if plan.feasible else ""
    if retry:  # the verdict fits, the allocator's reserved peak does not (as plan, step and the page say)
        con.print(f"[yellow]{escape(retry)}[/]")
    for r in plan.reasons:
        con.print(f"[bold red]infeasible[/] {r}")
