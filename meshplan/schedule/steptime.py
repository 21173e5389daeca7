"""Step time of a :class:`~meshplan.plan.Plan`: unit timelines (:mod:`meshplan.schedule.rank_timeline`)
put through the pipeline simulation (:mod:`meshplan.pipeline.simulate`), then the step-level
collectives and the optimizer step; critical path, exposed communication per axis, bubble,
tokens/s, MFU and HFU, and the Chrome/Perfetto trace of the predicted timeline.

Each stage ends at its last unit plus that unit's communication tail, then (in order) the
per-step gradient reduction when it was not overlapped, the optimizer step and the
ZeRO-1/2 parameter all-gather (``Overlap.param_gather``: hidden behind the next step's
first forward unit, the remainder exposed). The optimizer step is memory-bound: it reads
all persistent state of the rank (:mod:`meshplan.memory.state`) and writes all but the
gradients, at HBM bandwidth. Step time = the latest stage end.

MFU uses model FLOP (:func:`meshplan.compute.ops.sequence_model_flops` x global batch: causal
half attention, no recompute); HFU the FLOP each rank executes (recompute, full non-flash
attention, replicated KV heads, padded vocabulary), both over ``step x world x peak``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from meshplan.compute.ops import Cost, Workload, embedding_cost, head_cost, layer_cost, sequence_model_flops
from meshplan.compute.gemm import GemmTable
from meshplan.pipeline.simulate import Event, PipelineResult, PipelineSpec, simulate, write_trace
from meshplan.plan import Infeasible, Plan
from meshplan.schedule.rank_timeline import ChunkCosts, CommTimes, Overlap, backward_unit, forward_unit


def workload_of(plan, dropout: bool = False) -> Workload:
    """The per-rank :class:`~meshplan.compute.ops.Workload` of a plan's mesh and training
    contract. ``dropout``: GPT-style dropout (the training spec has no such field yet)."""
    t, mesh = plan.config.training, plan.mesh
    return Workload(seq_len=t.seq_len, micro_batch=t.micro_batch, tp=mesh.degree("tp"), cp=mesh.degree("cp"),
                    sp=mesh.sequence_parallel, ep=mesh.ep, etp=mesh.etp, dtype=t.compute_dtype,
                    recompute=t.recompute, flash=t.flash_attention, dropout=dropout,
                    vocab_pad_divisor=t.vocab_pad_divisor)


def chunk_costs(plan, w: Workload, table: Optional[GemmTable] = None) -> list[list[ChunkCosts]]:
    """``[stage][chunk]`` compute per micro-batch (one layer_cost per distinct layer kind)."""
    model, gpu = plan.config.model, plan.config.cluster.gpu
    cache: dict[bool, Cost] = {}

    def cost(i: int) -> Cost:
        moe = model.is_moe_layer(i)
        if moe not in cache:
            cache[moe] = layer_cost(model, gpu, w, layer=i, table=table)
        return cache[moe]

    p, v = len(plan.stages), plan.vpp
    return [[ChunkCosts(layers=tuple(cost(i) for i in layers), moe=tuple(model.is_moe_layer(i) for i in layers),
                        embed=embedding_cost(model, gpu, w) if (s, c) == (0, 0) else None,
                        head=head_cost(model, gpu, w, table) if (s, c) == (p - 1, v - 1) else None)
             for c, layers in enumerate(chunks)] for s, chunks in enumerate(plan.stages)]


@dataclass(frozen=True)
class StepTime:
    """The predicted step. ``stage_end_s[s]``: when stage s finishes (tails, step-level
    collectives and optimizer included); ``exposed_s``: per stream of the critical stage."""

    pipeline: PipelineResult
    units: dict
    stage_end_s: tuple[float, ...]
    post_events: tuple[Event, ...]
    exposed_s: dict
    model_flops: float
    hardware_flops: float
    tokens: int
    world: int
    peak_flops: float
    example_ranks: tuple[int, ...]
    notes: tuple[str, ...] = ()

    @property
    def step_s(self) -> float:
        return max(self.stage_end_s)

    @property
    def critical_stage(self) -> int:
        return max(range(len(self.stage_end_s)), key=lambda s: self.stage_end_s[s])

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.world * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.step_s * self.world * self.peak_flops)

    def critical_path(self) -> list[str]:
        """Pipeline units on the critical path, then the critical stage's step-end ops."""
        out = [f"stage {e.stage} (rank {self.example_ranks[e.stage]}) {e.name} "
               f"{e.start_s * 1e3:.3f}-{e.end_s * 1e3:.3f} ms (after {e.args.get('via')})"
               for e in self.pipeline.critical_path]
        s = self.critical_stage
        out += [f"stage {s} (rank {self.example_ranks[s]}) {e.name} {e.start_s * 1e3:.3f}-{e.end_s * 1e3:.3f} ms"
                for e in self.post_events if e.stage == s]
        return out

    def lines(self) -> list[str]:
        """Printable summary with the definitions named."""
        p = self.pipeline
        exp = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(self.exposed_s.items()) if v > 0) or "none"
        return [f"step {self.step_s * 1e3:.2f} ms ({p.spec.schedule}, p {p.spec.p}, m {p.spec.m}, v {p.spec.v}); "
                f"critical stage {self.critical_stage}",
                f"bubble {p.bubble:.4f} as idle/ideal, {p.bubble_of_total:.4f} as idle/total "
                f"(busiest stage {p.busiest_stage}, pipeline only)",
                f"exposed communication on stage {self.critical_stage}: {exp}",
                f"tokens/s {self.tokens_per_s:,.0f}; MFU {self.mfu:.1%} (model FLOP: per-op, causal-half "
                f"attention, no recompute); HFU {self.hfu:.1%} (executed FLOP, recompute included)"] + \
            [f"note: {n}" for n in self.notes]

    def trace_events(self, detail: bool = True) -> list[Event]:
        """Pipeline units (and, with ``detail``, every op and collective inside them) shifted
        to their start, pp sends and the step-end ops."""
        out = []
        for e in self.pipeline.events:
            out.append(e)
            if not detail or e.stream != "compute":
                continue
            for ie in self.units[_key(self.pipeline.spec, e)].events:
                if ie.end_s > ie.start_s:
                    out.append(Event(e.stage, ie.stream, ie.name, e.start_s + ie.start_s, e.start_s + ie.end_s,
                                     {"unit": e.name}))
        return out + list(self.post_events)

    def write_trace(self, path: str | Path, detail: bool = True, force: bool = False) -> Path:
        meta = {"generator": "meshplan", "step_ms": self.step_s * 1e3, "mfu": self.mfu, "hfu": self.hfu,
                "bubble_idle_over_ideal": self.pipeline.bubble}
        return write_trace(self.trace_events(detail), path, meta, force=force)


def _grad_kind(spec: PipelineSpec) -> str:
    return "W" if spec.schedule == "zb_h1" else "B"


def _key(spec: PipelineSpec, e: Event) -> tuple:
    kind, mb = e.args["kind"], e.args["mb"]
    return (e.stage, e.args["chunk"], kind, kind == _grad_kind(spec) and mb == spec.m - 1)


def _unit_sims(spec, chunks, comms, w, ov) -> dict:
    out = {}
    for s, stage in enumerate(chunks):
        for c, ch in enumerate(stage):
            out[(s, c, "F", False)] = forward_unit(ch, comms[s], w, ov)
            kinds = (("B", "Bx"), ("W", "W")) if spec.schedule == "zb_h1" else (("B", "B"),)
            for pk, uk in kinds:
                for last in (False, True):
                    out[(s, c, pk, last)] = backward_unit(uk, ch, comms[s], w, ov, last_grad_unit=last)
    return out


def _optimizer_s(plan, s: int) -> float:
    st = plan.state[s]
    nbytes = 2 * st.total_bytes - st.bytes_of("grads")
    return nbytes / plan.config.cluster.gpu.hbm_bandwidth_bytes_per_s


def _stage_end(plan, s, spec, mine, units, comm: CommTimes, ov) -> tuple[float, list[Event], dict]:
    """End of stage s after its last unit (``mine``: its compute events), with the step-end
    events and their exposure."""
    last = max(mine, key=lambda e: e.end_s)
    u = units[_key(spec, last)]
    t = last.end_s + u.tail_s
    post, exposed = [], ({u.tail_stream: u.tail_s} if u.tail_s else {})
    steps = [("grad reduce (per step)", 0.0 if ov.grad_reduce else comm.step_reduce_s, "dp"),
             ("optimizer step", _optimizer_s(plan, s), "compute")]
    first_f = min((e for e in mine if e.args["kind"] == "F"), key=lambda e: e.start_s)
    gather = comm.step_gather_s
    steps.append(("param all-gather (per step)", max(0.0, gather - first_f.dur_s) if ov.param_gather else gather, "dp"))
    for name, dur, stream in steps:
        if dur > 0:
            post.append(Event(s, stream, name, t, t + dur))
            if stream != "compute":
                exposed[stream] = exposed.get(stream, 0.0) + dur
            t += dur
    return t, post, exposed


def step_time(plan: Plan, overlap: Overlap = Overlap(), *, dropout: bool = False, table: Optional[GemmTable] = None,
              schedule: Optional[str] = None) -> StepTime:
    """Predict one step of a feasible ``plan`` (see the module docstring). ``schedule``
    overrides the config's ``pp_schedule``; ``table``: measured GEMM times."""
    if isinstance(plan, Infeasible):
        raise ValueError("step_time needs a resolved plan with stages; this one is infeasible: "
                         + "; ".join(plan.reasons))
    cfg, w = plan.config, workload_of(plan, dropout)
    p, v, m = len(plan.stages), plan.vpp, plan.micro_batches
    comms = [CommTimes.from_rows(st.collectives, len(st.layers)) for st in map(plan.stage, range(p))]
    chunks = chunk_costs(plan, w, table)
    base = PipelineSpec(schedule or plan.spec.pp_schedule, p, m, v, p2p_s=max(c.p2p_s for c in comms))
    units = _unit_sims(base, chunks, comms, w, overlap)
    spec = PipelineSpec(base.schedule, p, m, v, p2p_s=base.p2p_s,
                        duration=lambda s, u: units[(s, u.chunk, u.kind, u.kind == _grad_kind(base) and u.mb == m - 1)].duration_s)
    res = simulate(spec)
    ends, post, exposed = [], [], []
    by_stage: list[list[Event]] = [[] for _ in range(p)]
    for e in res.events:
        if e.stream == "compute":
            by_stage[e.stage].append(e)
    for s in range(p):
        end, ev, ex = _stage_end(plan, s, spec, by_stage[s], units, comms[s], overlap)
        ends.append(end)
        post += ev
        for e in by_stage[s]:
            for k, val in units[_key(spec, e)].exposed_s.items():
                ex[k] = ex.get(k, 0.0) + val
            if e.args["via"] == "p2p":
                ex["pp"] = ex.get("pp", 0.0) + min(spec.p2p_s, e.args["wait_s"])
        exposed.append(ex)
    crit = max(range(p), key=lambda s: ends[s])
    hw = sum(m * sum(sum(x.flops("hardware") for x in ch.layers)
                     + sum(x.flops("hardware") for x in (ch.embed, ch.head) if x is not None) for ch in stage)
             for stage in chunks) * plan.world // p
    t = cfg.training
    ranks = tuple(plan.mesh.group_of(0, "pp")) if "pp" in plan.mesh.layout.names else (0,)
    notes = tuple(f"collective not simulated (kind unknown): {o}" for o in sorted({o for c in comms for o in c.other}))
    return StepTime(res, units, tuple(ends), tuple(post), exposed[crit],
                    sequence_model_flops(cfg.model, t.seq_len) * t.global_batch, hw, t.global_batch * t.seq_len,
                    plan.world, cfg.cluster.gpu.peak_flops(t.compute_dtype), ranks, notes)


def layer_unit_times(plan, dropout: bool = False, overlap: Overlap = Overlap()) -> tuple[float, float]:
    """(forward, backward) seconds of ONE layer of stage 0 for one micro-batch, with its
    blocking collectives: the per-layer figures papers publish (Korthikanti et al. 2022,
    Table 4)."""
    w = workload_of(plan, dropout)
    ch = chunk_costs(plan, w)[0][0]
    one = ChunkCosts(ch.layers[:1], ch.moe[:1])
    comm = CommTimes.from_rows(plan.stage(0).collectives)
    return forward_unit(one, comm, w, overlap).duration_s, backward_unit("B", one, comm, w, overlap).duration_s
