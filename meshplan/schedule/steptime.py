"""Step time of a :class:`~meshplan.plan.Plan`: unit timelines (:mod:`meshplan.schedule.rank_timeline`)
put through the pipeline simulation (:mod:`meshplan.pipeline.simulate`), then the step-level
collectives and the optimizer step; critical path, exposed communication per axis, bubble,
tokens/s, MFU and HFU, and the Chrome/Perfetto trace of the predicted timeline.

Pipeline sends block their stage under Megatron-LM (:func:`blocking_p2p`): each call holds its
stage until the peer stage posts its side and the transfer ends (``hold``); of a hold only the
transfers (``k x p2p``) are exposed on "pp", the wait for the peer is bubble (:func:`pp_hold_split`,
:meth:`StepTime.parts_s`). Each
stage ends at its last unit plus that unit's communication tail (or its blocking call), then (in order) the
per-step gradient reduction when it was not overlapped, the optimizer step and the
ZeRO-1/2 parameter all-gather (``Overlap.param_gather``: its buckets after the first hidden
behind the next step's first forward unit, the remainder exposed: :func:`param_gather_exposed_s`). The optimizer step is memory-bound: it reads
all persistent state of the rank (:mod:`meshplan.memory.state`) and writes all but the
gradients, at achievable bandwidth (:func:`meshplan.compute.ops.optimizer_bandwidth`). Step time = the latest stage end.

MFU uses model FLOP (:func:`meshplan.compute.ops.sequence_model_flops` x global batch: causal
half attention, no recompute); HFU the FLOP each rank executes (recompute, full non-flash
attention, replicated KV heads, padded vocabulary), both over ``step x world x peak``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import numpy as np

from meshplan.comm.collectives import fsdp_gather_flags
from meshplan.comm.deepspeed_zero12 import check_schedule
from meshplan.compute import asynctp, float8
from meshplan.pipeline.simulate import stage_order
from meshplan.compute.gemm import GemmTable
from meshplan.compute.routing import RoutingOptions
from meshplan.compute.shapes import local_split
from meshplan.compute.ops import (
    Cost,
    Workload,
    embedding_cost,
    float8_gemms,
    framework_kernels,
    flop_gap,
    head_cost,
    issue_floor,
    layer_cost,
    layer_workload,
    megatron_batch_cost,
    megatron_stage_step_cost,
    optimizer_bandwidth,
    sequence_model_flops,
)
from meshplan.errors import ConfigError
from meshplan.mesh.layers import last_stage
from meshplan.mesh.tpsplit import local_numel
from meshplan.pipeline.fast import KINDS, ArrayResult, Flat, simulate_arrays
from meshplan.pipeline.registry import check_framework, get as get_schedule
from meshplan.pipeline.simulate import Event, PipelineSpec, write_trace
from meshplan.plan import Infeasible, Plan, run_reasons, runtime_warnings, table_key, table_stage
from meshplan.schedule.rank_timeline import (
    ChunkCosts,
    CommTimes,
    Overlap,
    UnitSim,
    backward_unit,
    forward_unit,
    nccl_sm_share,
)
from meshplan.spec.axes.base import Dim
from meshplan.spec.mesh import Schedule
from meshplan.spec.wording import fold_streams, mesh_text, recompute_words, runtime, schedule_words, stream_words
from meshplan.units import counted, dtype_bytes


def workload_of(plan, dropout: bool = False) -> Workload:
    """The per-rank :class:`~meshplan.compute.ops.Workload` of a plan's mesh and training
    contract. ``dropout``: GPT-style dropout, also on when the config's ``[memory] dropout`` is.
    Megatron-LM (``training.framework``) projects Q, K and V with one GEMM and, with fp32
    gradients, accumulates the weight gradients into them inside the GEMM (its
    ``gradient_accumulation_fusion``, on by default). ``training.tp_comm_overlap`` with sequence
    parallelism and tp > 1: the framework's decomposed TP GEMMs (:mod:`meshplan.compute.asynctp`)."""
    t, mesh = plan.config.training, plan.mesh
    dropout = dropout or plan.config.memory.dropout
    split = local_split(mesh)  # the dims each registered axis divides, as the plan's shapes
    async_tp = t.framework if t.tp_comm_overlap and mesh.sequence_parallel and split[Dim.HEADS] > 1 else ""
    return Workload(seq_len=t.seq_len, micro_batch=t.micro_batch, tp=split[Dim.HEADS], cp=split[Dim.SEQUENCE],
                    sp=mesh.sequence_parallel, ep=split[Dim.EXPERTS], etp=split[Dim.EXPERT_FFN], dtype=t.compute_dtype,
                    recompute=t.recompute, flash=t.flash_attention, dropout=dropout,
                    vocab_pad_divisor=t.vocab_pad_divisor, routing=RoutingOptions.of(t), **framework_kernels(t),
                    **float8_gemms(plan.config.model, t), async_tp=async_tp)


def chunk_costs(plan, w: Workload, table: Optional[GemmTable] = None) -> list[list[ChunkCosts]]:
    """``[stage][chunk]`` compute per micro-batch (one layer_cost per distinct layer kind)."""
    model, gpu, t = plan.config.model, plan.config.cluster.gpu, plan.config.training
    cache: dict[tuple, Cost] = {}

    def cost(i: int, s: int) -> Cost:
        key = (model.is_moe_layer(i), t.layer_recomputed(position[s][i]))  # torchtitan per-layer AC
        if key not in cache:
            cache[key] = layer_cost(model, gpu, layer_workload(w, key[1]), layer=i, table=table)
        return cache[key]

    position = [{i: k for k, i in enumerate(i for chunk in chunks for i in chunk)} for chunks in plan.stages]
    v, last = plan.vpp, last_stage(plan.stages)  # last: 0 under a V-shaped schedule
    batch = megatron_batch_cost(gpu, w) if w.megatron_ops else None  # every chunk, every stage (2755bcb)
    return [[ChunkCosts(layers=tuple(cost(i, s) for i in layers), moe=tuple(model.is_moe_layer(i) for i in layers),
                        embed=embedding_cost(model, gpu, w) if (s, c) == (0, 0) else None,
                        head=head_cost(model, gpu, w, table) if (s, c) == (last, v - 1) else None,
                        batch=batch)
             for c, layers in enumerate(chunks)] for s, chunks in enumerate(plan.stages)]


@dataclass(frozen=True)
class StepTime:
    """The predicted step. ``stage_end_s[s]``: when stage s finishes (tails, step-level
    collectives and optimizer included); ``exposed_s``: per stream of the critical stage."""

    pipeline: ArrayResult
    units: "UnitTimes"
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
    recompute_name: str = ""
    unit_index: tuple = ()  # (distinct unit keys, key index of every flat unit): UnitTimes.index
    peak_dtype: str = ""  # the dtype of peak_flops (TrainingSpec.peak_dtype: float8 Linears run against the fp8 peak)
    flop_gap: tuple[tuple[str, float], ...] = ()  # (cause, FLOP per step) of hardware - model: compute.ops.flop_gap
    runs: int = 1  # pipeline schedule runs per step (training.pp_schedule_runs): ``pipeline`` is the first
    stream_names: tuple[tuple[str, str], ...] = ()  # (stream, its name in the text): wording.stream_words
    mesh_text: str = ""  # the mesh as every output prints it (wording.mesh_text), on the first line

    def named(self, stream: str) -> str:
        """``stream`` as the text lines name it (:attr:`stream_names`; the JSON keeps the key)."""
        return dict(self.stream_names).get(stream, stream)

    def part_named(self, part: str) -> str:
        """A part of :meth:`parts_s` as the text lines name it: ``exposed <stream>`` with its
        stream :meth:`named` (``exposed ZeRO data-parallel`` under DeepSpeed), the others as keyed."""
        return f"exposed {self.named(part[8:])}" if part.startswith("exposed ") else part

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
        """Pipeline units on the critical path, then the critical stage's step-end ops (built
        once: the step command prints them and writes them to --json)."""
        if "critical_path" not in self._trace_cache:
            self._trace_cache["critical_path"] = self._critical_path_lines()
        return list(self._trace_cache["critical_path"])

    def _critical_path_lines(self) -> list[str]:
        res = self.pipeline
        idx = res.critical_units  # the fields of pipeline.critical_path's events, without the events
        cols = ((idx // res.flat.length).tolist(), res.unit_names(idx), res.start[idx].tolist(),
                res.end[idx].tolist(), res.via_at(idx).tolist())
        out = [f"stage {s} (rank {self.example_ranks[s]}) {name} {t0 * 1e3:.3f}-{t1 * 1e3:.3f} ms "
               f"(after {'p2p' if via else 'stream'})" for s, name, t0, t1, via in zip(*cols)]
        s = self.critical_stage
        out += [f"stage {s} (rank {self.example_ranks[s]}) {e.name} {e.start_s * 1e3:.3f}-{e.end_s * 1e3:.3f} ms"
                for e in self.post_events if e.stage == s]
        return out

    def most_exposed_stage(self) -> Optional[tuple[int, dict]]:
        """The stage whose units expose the most communication (seconds per step, every stream
        but the pp waits, summed over its units), with its exposed seconds per stream as
        :attr:`exposed_s` counts them (pp: its calls' transfers, step-end ops not), when that stage is
        not the critical one and exposes more than it; else None. A MoE model's dense first
        stage can end last while the expert stages spend their time in all-to-alls the critical
        stage never issues."""
        if "most_exposed" not in self._trace_cache:
            self._trace_cache["most_exposed"] = self._most_exposed()
        return self._trace_cache["most_exposed"]

    def _most_exposed(self) -> Optional[tuple[int, dict]]:
        res = self.pipeline
        keys, idx = self.unit_index if self.unit_index else self.units.index(res.flat)
        per_key = np.array([sum(v for k, v in self.units.by_key(key).exposed_s.items() if k != "pp") for key in keys])
        totals = self.runs * np.bincount(np.arange(len(idx)) // res.flat.length, weights=per_key[idx],
                                         minlength=len(self.stage_end_s))
        s = int(np.argmax(totals))
        crit = sum(v for k, v in self.exposed_s.items() if k != "pp")
        if s == self.critical_stage or totals[s] <= crit * (1 + 1e-9):
            return None
        return s, {k: self.runs * x for k, x in _unit_exposure(res, s, self.units, keys, idx, {}).items()}

    def parts_s(self) -> dict[str, float]:
        """The step on the critical stage s split into parts that add up to :attr:`step_s`,
        seconds (every part >= 0; streams that expose nothing left out):

        - ``compute``: s's pipeline units less the communication exposed inside them (GEMMs,
          attention, memory-bound ops, recompute, copies on the compute stream), every
          schedule run, plus the optimizer step;
        - ``bubble``: s's compute stream idle: before its first unit, between units (a receive
          wait beyond its transfer), the part of each blocking call's hold spent waiting for its
          partner stage (:func:`pp_hold_split`), and with ``training.pp_schedule_runs`` > 1 each
          later run's idle (its :func:`run_shift` less run 1's busy and exposed time);
        - ``exposed <stream>``: :attr:`exposed_s` (pp: the transfers only).

        D4 (Korthikanti et al. 2022 175B, Megatron-LM interleaved 1F1B p 8 x v 3, 64
        micro-batches): compute 11,177.23 + bubble 676.52 + exposed tp 1,394.47 + pp 141.31
        (340 transfers of 0.4156 ms) + dp 16.98 = 13,406.51 ms (tests/test_step_parts.py)."""
        if "parts" not in self._trace_cache:
            self._trace_cache["parts"] = self._parts()
        return dict(self._trace_cache["parts"])

    def parts_by_stream(self) -> dict[str, float]:
        """:meth:`parts_s` with the streams the engine names alike as one part (:func:`fold_streams`)."""
        return fold_streams(self.parts_s(), self.stream_names)

    def _parts(self) -> dict[str, float]:
        res, s = self.pipeline, self.critical_stage
        keys, idx = self.unit_index if self.unit_index else self.units.index(res.flat)
        inner = np.array([sum(self.units.by_key(k).exposed_s.values()) for k in keys])[idx[res.stage_slice(s)]]
        post = [e for e in self.post_events if e.stage == s]
        later = [e for e in post if "later_runs" in e.args]
        runs = (later[0].args["later_runs"], later[0].args["run_s"]) if later else (0, 0.0)
        bubble = stage_bubble(res, s, last_tail_s(res, s, self.units), *runs)
        compute = self.runs * (float(res.busy_s[s]) - float(inner.sum()))
        compute += sum(e.dur_s for e in post if e.stream == "compute" and "later_runs" not in e.args)  # the optimizer
        exposed = {f"exposed {k}": v for k, v in sorted(self.exposed_s.items()) if v > 0}
        return {"compute": compute, "bubble": bubble, **exposed}

    def shown_ms(self) -> dict[str, str]:
        """The step and its parts (:meth:`parts_s`) as every line prints them, ms to 0.01:
        ``{"step": ..., "compute": ..., "bubble": ..., "exposed <stream>": ...}``. One rounding
        for all: each part rounded so that the printed parts add up to the printed step
        (largest remainder, :func:`_rounded_to_total`: every part within 0.01 ms of its
        value), so the exposed-communication line, the parts line and the HTML report print
        the same number for the same quantity (a part of 8.605 ms is 8.60 or 8.61 in all)."""
        if "shown" not in self._trace_cache:
            total = round(self.step_s * 1e5)
            cents = _rounded_to_total({k: v * 1e5 for k, v in self.parts_s().items()}, total)
            self._trace_cache["shown"] = {k: f"{c / 100:.2f}" for k, c in {"step": total, **cents}.items()}
        return dict(self._trace_cache["shown"])

    def parts_line(self) -> str:
        """``step on stage 0 = compute 11177.23 + bubble 676.52 + exposed tp 1394.47 + ... =
        13406.51 ms``: :meth:`parts_s` as :meth:`shown_ms` prints them (they add up to the
        printed step)."""
        shown = self.shown_ms()
        terms = " + ".join(f"{self.part_named(k)} {v}" for k, v in shown.items() if k != "step")
        return f"step on stage {self.critical_stage} = {terms} = {shown['step']} ms"

    def without_fsdp_waits(self) -> Optional[ArrayResult]:
        """The pipeline simulated again with every unit shortened by the time its compute
        stream waits inside it for FSDP (:data:`FSDP_STREAMS`: an all-gather not hidden, and
        after a chunk's last backward torch 2.13's ``PipelineStage.perform_reduce_grad``:
        ``_add_reduce_grad`` schedules it right after that backward, and its
        ``_root_post_backward_final_callback`` -> ``FSDPParamGroup.finalize_backward`` makes the
        compute stream wait for the chunk's reduce-scatters before the stage's next unit); None
        with pp 1 or no such wait. Its bubble is the schedule's alone; the difference in
        ``step_s`` is what the FSDP waits add to the pipeline (:meth:`lines`)."""
        if "no_fsdp" not in self._trace_cache:
            self._trace_cache["no_fsdp"] = self._without_fsdp_waits()
        return self._trace_cache["no_fsdp"]

    def _without_fsdp_waits(self) -> Optional[ArrayResult]:
        res = self.pipeline
        if res.spec.p == 1:
            return None
        keys, idx = self.unit_index if self.unit_index else self.units.index(res.flat)
        waits = np.array([sum(v for k, v in self.units.by_key(key).exposed_s.items() if k in FSDP_STREAMS)
                          for key in keys])[idx]
        return pipeline_without(res, waits) if waits.any() else None

    def _fsdp_wait_line(self) -> list[str]:
        """The FSDP waits apart from the schedule's bubble (:meth:`without_fsdp_waits`), in
        seconds on the busiest stage s, which add up: its idle and FSDP-wait time
        ``step - busy_bare[s]`` = the schedule's bubble ``step_bare - busy_bare[s]`` + what the
        waits add to the pipeline ``step - step_bare`` (>= 0: waits only lengthen units), and as
        ratios over the stage's compute without the waits ``busy_bare[s]`` (one denominator, so
        the ratios add up too; the bubble line's idle/ideal counts the waits as busy instead)."""
        bare = self.without_fsdp_waits()
        if bare is None:
            return []
        p, s = self.pipeline, self.pipeline.busiest_stage
        c = float(bare.busy_s[s])
        y, z = bare.step_s - c, p.step_s - bare.step_s
        each = ", each run" if self.runs > 1 else ""
        # each sum printed as its terms rounded to add up (largest remainder, as parts_line)
        ms = _rounded_to_total({"y": y * 1e5, "z": z * 1e5}, round((y + z) * 1e5))
        r = _rounded_to_total({"y": y / c * 1e4, "z": z / c * 1e4}, round((y + z) / c * 1e4))
        return [f"bubble and FSDP waits on stage {s}: {(ms['y'] + ms['z']) / 100:.2f} ms = the schedule's bubble "
                f"{ms['y'] / 100:.2f} ms (simulated without the units' FSDP waits) + {ms['z'] / 100:.2f} ms the FSDP "
                f"waits add (all-gathers not hidden; after each chunk's last backward perform_reduce_grad's "
                f"reduce-scatters, which the compute stream waits for: the pipeline {bare.step_s * 1e3:.2f} -> "
                f"{p.step_s * 1e3:.2f} ms{each}); over its compute without the waits: {(r['y'] + r['z']) / 1e4:.4f} = "
                f"{r['y'] / 1e4:.4f} + {r['z'] / 1e4:.4f}"]

    def _other_stage_clause(self) -> str:
        """Where the bubble ratios' stage (the busiest: the schedule's bubble is measured against
        the most work) is not the critical one (where the step ends, which :meth:`parts_line`
        splits), the clause that ties them, with the critical stage's idle as a fraction of the
        step and of its busy time, from the same simulated timeline as the parts: ``; the step's
        parts below are on stage 0, where the step ends: bubble 32991.72 ms is its idle, 0.7137 of
        the step (2.4933 as idle/ideal)`` (DeepSeek-V3 example, whose schedule's bubble is 0.1217
        idle/ideal on stage 7); else empty."""
        s = self.critical_stage
        if self.pipeline.busiest_stage == s:
            return ""
        shown = self.shown_ms()
        idle, step = float(shown["bubble"]), float(shown["step"])
        return (f"; the step's parts below are on stage {s}, where the step ends: bubble "
                f"{shown['bubble']} ms is its idle, {idle / step:.4f} of the step ({idle / (step - idle):.4f} as "
                f"idle/ideal)")

    def _closed_form_bubble(self) -> str:
        """The schedule's closed-form bubble for uniform stages without p2p time, beside the
        simulated one (handed case C11: 1F1B at p 4, m 8 gives 0.375 idle/ideal, 0.2727
        idle/total); only where it does not depend on the F, B, W unit times (schedules that
        do not split the backward), else empty."""
        spec = self.pipeline.spec
        if spec.p == 1 or spec.sched.splits_backward:
            return ""
        x = spec.sched.bubble(spec.p, spec.m, spec.v)
        if x != x:  # NaN: no closed form for this m (interleaved 1F1B with torch's other rounds)
            return ""
        return f"; closed form for uniform stages: {x:.4f} idle/ideal, {x / (1 + x):.4f} idle/total"

    def lines(self) -> list[str]:
        """Printable summary with the definitions named."""
        p, shown = self.pipeline, self.shown_ms()
        exp = ", ".join(f"{self.named(k)} {shown['exposed ' + k]} ms" for k, v in sorted(self.exposed_s.items())
                        if v > 0) or "none"
        most = self.most_exposed_stage()
        other = [] if most is None else [
            f"most exposed communication: stage {most[0]} (not the critical stage; its units): "
            + ", ".join(f"{self.named(k)} {v * 1e3:.2f} ms" for k, v in sorted(most[1].items()) if v > 0)]
        runs = f" x {self.runs} runs" if self.runs > 1 else ""
        sched = schedule_words(p.spec.schedule, p.spec.p) + (f", p {p.spec.p}" if p.spec.p > 1 else "")
        return [f"step {shown['step']} ms ({sched}, m {p.spec.m}{runs}{f', v {p.spec.v}' if p.spec.p > 1 else ''}); "
                f"critical stage {self.critical_stage}" + (f"; mesh {self.mesh_text}" if self.mesh_text else ""),
                f"bubble {p.bubble:.4f} as idle/ideal, {p.bubble_of_total:.4f} as idle/total "
                f"(the schedule's bubble fraction, on the busiest stage {p.busiest_stage}, pipeline only{', each run' if self.runs > 1 else ''}"
                f"{WAITS_BUSY if self.without_fsdp_waits() is not None else ''}{self._other_stage_clause()})"
                f"{self._closed_form_bubble()}"] + self._fsdp_wait_line() + [
                f"exposed communication on stage {self.critical_stage}: {exp}", self.parts_line()] + other + [
                self.recompute_line(),
                f"tokens/s {self.tokens_per_s:,.0f}; MFU {self.mfu:.1%} (model FLOP: per-op, causal-half "
                f"attention, no recompute); HFU {self.hfu:.1%} (executed FLOP, recompute included{self._gap_text()}); "
                f"of the "
                f"{self.peak_flops / 1e12:,.0f} TFLOP/s {self.peak_dtype} dense peak per GPU".rstrip()] + \
            [f"note: {n}" for n in self.notes]

    def _gap_text(self) -> str:
        """``; above MFU by: flash backward recomputes QK^T 1.1 pp``: each cause of
        :attr:`flop_gap` in percentage points of HFU (so HFU above MFU with recompute none says why)."""
        den = self.step_s * self.world * self.peak_flops
        parts = [f"{c} {f / den * 100:.1f} pp" for c, f in self.flop_gap if f / den >= 5e-4]
        return "; above MFU by: " + ", ".join(parts) if parts else ""

    def recompute_s(self, stage: Optional[int] = None) -> float:
        """Seconds of recomputed forward ops per micro-batch on ``stage`` (default: the
        critical one), summed over its layers (:func:`meshplan.compute.ops.layer_cost`)."""
        s = self.critical_stage if stage is None else stage
        return sum(c.seconds(recompute=True) for ch in self.units.chunks[s] for c in ch.layers)

    def recompute_line(self) -> str:
        """The recompute policy in its framework's words and what it costs per step."""
        t, m = self.recompute_name, self.pipeline.spec.m * self.runs
        r = self.recompute_s()
        return (f"recompute: {t}: {r * 1e3:.3f} ms per micro-batch on stage {self.critical_stage}, "
                f"{r * m * 1e3:.2f} ms per step ({counted(m, 'micro-batch')})")

    def trace_events(self, detail: bool = True, stage: Optional[int] = None) -> list[Event]:
        """Pipeline units (and, with ``detail``, every op and collective inside them) shifted
        to their start, pp sends and the step-end ops; ``stage``: only that stage's (built
        for it alone, and kept: the link-load report asks three times)."""
        if stage is not None and (detail, stage) in self._trace_cache:
            return self._trace_cache[(detail, stage)]
        out = []
        for e in (self.pipeline.events if stage is None else self.pipeline.stage_events(stage)):
            out.append(e)
            if not detail or e.stream != "compute":
                continue
            for ie in self.units.of_event(e).events:
                if ie.end_s > ie.start_s:
                    out.append(Event(e.stage, ie.stream, ie.name, e.start_s + ie.start_s, e.start_s + ie.end_s,
                                     {"unit": e.name}))
        out += [e for e in self.post_events if stage is None or e.stage == stage]
        if stage is not None:
            self._trace_cache[(detail, stage)] = out
        return out

    @cached_property
    def _trace_cache(self) -> dict:
        return {}

    def write_trace(self, path: str | Path, detail: bool = True, force: bool = False) -> Path:
        meta = {"generator": "meshplan", "step_ms": self.step_s * 1e3, "mfu": self.mfu, "hfu": self.hfu,
                "bubble_idle_over_ideal": self.pipeline.bubble}
        return write_trace(self.trace_events(detail), path, meta, force=force,
                           ranks=dict(enumerate(self.example_ranks)))


def _rounded_to_total(values: dict, total: int) -> dict:
    """``values`` rounded to integers that add up to ``total`` (largest remainder: floors,
    then one more to the largest fractions; when the floors already exceed ``total``, one
    less from the smallest), each within 1 of its value when ``total`` is the rounded sum.

    >>> _rounded_to_total({"a": 1.4, "b": 1.4, "c": 1.2}, 4)
    {'a': 2, 'b': 1, 'c': 1}
    """
    out = {k: int(np.floor(v)) for k, v in values.items()}
    order = sorted(values, key=lambda k: out[k] - values[k])  # the largest fraction first
    left = total - sum(out.values())
    for k in (order if left >= 0 else order[::-1])[:abs(left)]:
        out[k] += 1 if left > 0 else -1
    return out


def pipeline_without(res: ArrayResult, waits_s: np.ndarray) -> ArrayResult:
    """``res``'s pipeline simulated again with every flat unit shortened by ``waits_s`` (seconds,
    per flat unit): what the schedule does without those waits (:meth:`StepTime.without_fsdp_waits`).

    Interleaved 1F1B, p 2, m 2, v 2, a chunk's F 0.5 s and B 1 s: stage 0 runs F0.c0 F1.c0 F0.c1
    F1.c1 B0.c1 B1.c1 B0.c0 B1.c0, bubble 1.5 / 6 = (p - 1) / (v m) = 0.25, step 7.5 s. With a
    0.5 s wait after each stage's last backward of chunk 1 (perform_reduce_grad), stage 1's B1.c1
    ends at 5, stage 0's B1.c1 runs 5-6.5, its B0.c0 B1.c0 6.5-8.5: step 8.5 s, bubble (8.5 -
    6.5) / 6.5 = 0.3077; removing the waits gives back the schedule's 0.25:

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> spec = PipelineSpec("interleaved_1f1b", 2, 2, v=2, forward_s=1.0, backward_s=2.0)
    >>> f = simulate_arrays(spec).flat
    >>> waits = np.where((f.kind == 1) & (f.chunk == 1) & (f.mb == 1), 0.5, 0.0)
    >>> r = simulate_arrays(spec, lambda flat: np.where(flat.kind == 0, 0.5, 1.0) + waits)
    >>> r.step_s, round(r.bubble, 4), pipeline_without(r, waits).step_s, pipeline_without(r, waits).bubble
    (8.5, 0.3077, 7.5, 0.25)
    """
    dur = res.end - res.start
    return simulate_arrays(res.spec, lambda f: dur - waits_s)


def stage_bubble(res: ArrayResult, s: int, tail_s: float = 0.0, later_runs: int = 0, run_s: float = 0.0) -> float:
    """Stage s's compute stream idle in the pipeline ``res``, seconds (the ``bubble`` of
    :meth:`StepTime.parts_s`): before its first unit and between units (a receive's wait beyond
    its transfer; the transfer is exposed "pp"), and each blocking call's wait for its partner
    (:func:`pp_hold_split`; the last call's only where its hold outlasts the last unit's
    communication tail ``tail_s``, :func:`last_tail_s`). ``later_runs`` schedule runs after
    the first, ``run_s`` apart (:func:`run_shift`): each idles ``run_s`` less run 1's busy and
    exposed time.

    1F1B p 2, m 2, F 1 s, B 2 s, p2p 0.5 s: stage 1 runs F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5,
    B1 5.5-7.5; stage 0 F0 0-1, F1 1-2, B0 5-7 (stage 1's B0 + 0.5 transfer), B1 8-10: idle 3 + 1
    less the two receives' transfers (exposed "pp") = 3 s; stage 1's: 1.5 - 0.5 = 1 s:

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5))
    >>> stage_bubble(r, 0), stage_bubble(r, 1)
    (3.0, 1.0)
    """
    sl = res.stage_slice(s)
    split = pp_hold_split(res, s)
    wait = res.wait[sl]
    via = res.via_at(np.arange(sl.start, sl.stop)) if wait.any() else np.zeros(len(wait), dtype=bool)
    received = np.where(via, np.minimum(res.spec.p2p_s, wait), 0.0)  # exposed on "pp" (_unit_exposure)
    i = sl.stop - 1
    hold = float(res.hold[i]) if res.hold is not None else 0.0
    last_wait = float(split.wait_s[-1]) if hold and not (tail_s >= hold and tail_s) else 0.0
    bubble = sum([split.lead_wait_s, last_wait] + (wait - received).tolist() + split.wait_s[:-1].tolist())
    if later_runs:  # each later run as run 1, run_s apart: its idle is run_s less run 1's busy and exposed time
        run_end = float(res.end[i]) + max(tail_s, hold)  # run 1 on stage s (_run_end)
        bubble += later_runs * (run_s - (run_end - bubble))
    return bubble


def last_tail_s(res: ArrayResult, s: int, units: "UnitTimes") -> float:
    """Seconds of communication tail after stage s's last unit (flat order) in ``res``."""
    i = res.stage_slice(s).stop - 1
    return units.get(s, int(res.flat.chunk[i]), KINDS[int(res.flat.kind[i])], int(res.flat.mb[i])).tail_s


#: Streams of FSDP's collectives a unit's compute stream can wait for: fsdp (dp_shard x cp),
#: efsdp (the routed experts'), dp_replicate (HSDP's all-reduce after the reduce-scatter).
FSDP_STREAMS = ("fsdp", "efsdp", "dp_replicate")
#: The bubble line's note where units wait for FSDP under pp: idle/ideal counts those waits as
#: busy time (:meth:`StepTime._fsdp_wait_line` shows them apart).
WAITS_BUSY = ", the units' FSDP waits counted as busy"


def _grad_kind(spec: PipelineSpec) -> str:
    return "W" if spec.sched.splits_backward else "B"


class UnitTimes:
    """Unit timelines of a step, one simulation per distinct (stage, chunk, kind, last
    gradient unit, FSDP flags, reduce). FSDP flags (gather layers, gather root): without pp
    every pass gathers (the backward only where the table has a backward all-gather) and
    every gradient pass reduce-scatters; with pp they follow
    :func:`meshplan.comm.collectives.fsdp_gather_flags` and the chunk's last gradient unit,
    and so do they with pp 1 under ``training.grad_accumulation`` ``no_sync`` (parameters
    resharded after every backward) or ``no_sync_unsharded`` (kept gathered).
    A chunk whose costs and stage collectives equal an earlier stage's (the middle stages)
    reuses its timelines: they are pure functions of those inputs, times from the unit start."""

    def __init__(self, spec: PipelineSpec, chunks, comms, w, ov, reshard: bool, fsdp: bool,
                 accumulation: str = "sync", reshard_root: bool = False):
        self.spec, self.chunks, self.comms, self.w, self.ov = spec, chunks, comms, w, ov
        self.cache: dict = {}
        self.shared: dict = {}
        self.flags: dict = {}
        # each stage's chunk whose last gradient unit is the stage's last unit (its FSDP reduce,
        # torch's perform_reduce_grad, is then the stage's tail; rank_timeline.backward_unit)
        self.final = {s: stage_order(spec.schedule, spec.p, spec.m, spec.v, s)[-1].chunk
                      for s in range(spec.p)} if fsdp and spec.p > 1 else {}
        if fsdp and (spec.p > 1 or accumulation != "sync"):
            rab = spec.p == 1 and accumulation == "no_sync"
            for s in range(spec.p):
                lay = fsdp_gather_flags(spec.schedule, spec.p, spec.m, spec.v, s, reshard, rab)
                # the root units: kept gathered unless resharded as the layers (reshard_root:
                # training.reshard_head_after_forward, torchtitan's "always")
                root = fsdp_gather_flags(spec.schedule, spec.p, spec.m, spec.v, s, reshard and reshard_root, rab)
                self.flags[s] = {k: (g, root[k]) for k, g in lay.items()}

    def key(self, s: int, chunk: int, kind: str, mb: int) -> tuple:
        last = kind == _grad_kind(self.spec) and mb == self.spec.m - 1
        gather = self.flags[s].get((chunk, "B" if kind == "W" else kind, mb), (False, False)) \
            if s in self.flags else (True, True)
        return (s, chunk, kind, last, gather, last or not self.flags)

    def by_key(self, k: tuple) -> UnitSim:
        if k not in self.cache:
            s, chunk, kind = k[0], k[1], k[2]
            ch, comm = self.chunks[s][chunk], self.comms[s]
            stage_last = self.final.get(s, 0) == chunk
            twins = self.shared.setdefault(k[2:] + (stage_last,), [])
            sim = next((x for c, m, x in twins if c == ch and m == comm), None)
            if sim is None:
                if kind == "F":
                    sim = forward_unit(ch, comm, self.w, self.ov, gather_layers=k[4][0], gather_root=k[4][1])
                else:
                    uk = "Bx" if kind == "B" and self.spec.sched.splits_backward else kind
                    sim = backward_unit(uk, ch, comm, self.w, self.ov, last_grad_unit=k[3], gather=k[4][0], reduce=k[5],
                                        deferred=self.spec.p > 1, stage_last=stage_last, gather_root=k[4][1])
                twins.append((ch, comm, sim))
            self.cache[k] = sim
        return self.cache[k]

    def get(self, s: int, chunk: int, kind: str, mb: int) -> UnitSim:
        return self.by_key(self.key(s, chunk, kind, mb))

    def of_event(self, e: Event) -> UnitSim:
        return self.get(e.stage, e.args["chunk"], e.args["kind"], e.args["mb"])

    def index(self, f: Flat) -> tuple[list[tuple], np.ndarray]:
        """(the distinct keys of the flat units, the index into them of every flat unit): the
        key :meth:`key` gives each unit, on arrays."""
        sp = self.spec
        last = (f.kind == KINDS.index(_grad_kind(sp))) & (f.mb == sp.m - 1)
        n = len(f.kind)
        gl, gr = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
        red = last.astype(np.int64) if self.flags else np.ones(n, dtype=np.int64)
        fb = np.where(f.kind == KINDS.index("F"), 0, 1)  # W follows its B's flags
        for s, fl in self.flags.items():
            lay, root = np.zeros((sp.v, 2, sp.m), dtype=np.int64), np.zeros((sp.v, 2, sp.m), dtype=np.int64)
            for (c, kind, mb), (g, r) in fl.items():
                lay[c, int(kind != "F"), mb], root[c, int(kind != "F"), mb] = g, r
            sl = slice(s * f.length, (s + 1) * f.length)
            gl[sl], gr[sl] = lay[f.chunk[sl], fb[sl], f.mb[sl]], root[f.chunk[sl], fb[sl], f.mb[sl]]
        code = ((((f.stage * sp.v + f.chunk) * len(KINDS) + f.kind) * 2 + last) * 2 + gl) * 4 + gr * 2 + red
        uniq, inv = _unique_small(code)
        keys = []
        for c in uniq.tolist():
            red_, gr_, gl_ = c & 1, (c >> 1) & 1, (c >> 2) & 1
            c >>= 3
            last_ = c & 1
            c >>= 1
            kind, c = c % len(KINDS), c // len(KINDS)
            keys.append((c // sp.v, c % sp.v, KINDS[kind], bool(last_), (bool(gl_), bool(gr_)), bool(red_)))
        return keys, inv


def _unique_small(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(code, return_inverse=True)`` for non-negative integer codes below a small
    bound (here p v 96: stage, chunk and flag bits), by a table of the codes present instead of
    a sort of every unit (10^6 units at pp 128 x 4,096 micro-batches).

    >>> [a.tolist() for a in _unique_small(np.array([5, 2, 5, 0]))]
    [[0, 2, 5], [2, 1, 2, 0]]
    """
    if not len(code):
        return np.unique(code, return_inverse=True)
    present = np.zeros(int(code.max()) + 1, dtype=bool)
    present[code] = True
    uniq = np.flatnonzero(present)
    rank = np.cumsum(present) - 1
    return uniq, rank[code]


#: Shardings whose gradients live in a contiguous buffer zeroed every step (Megatron-LM's DDP
#: and distributed optimizer, ``zero_grad_buffer``); FSDP2 frees its sharded gradients.
ZEROED_GRAD_BUFFER = ("none", "zero1", "zero2")


def optimizer_step_bytes(params, grads, master, optimizer, training, zero_grads=None):
    """HBM bytes read and written by one rank's optimizer step, as a sum of its passes over the
    persistent state (``params``, ``grads``, ``master``, ``optimizer``: the rank's bytes of each
    kind, :mod:`meshplan.memory.state`; scalars or numpy arrays of any shape):

    - norm (``training.grad_clip``): one read of the gradients (torch ``clip_grad_norm_``'s
      foreach norm; Megatron-LM ``clip_grad_norm_fp32``'s ``multi_tensor_l2norm``);
    - clip: one read and one write of the gradients (``clip_grad_norm_`` multiplies by the
      clamped coefficient; Megatron's ``multi_tensor_scale``; counted as in torch, which
      always scales);
    - update (Adam: apex ``multi_tensor_adam``, torch's fused AdamW, ``training.optimizer_impl =
      "fused"``): reads the copy it updates (the fp32 master when kept, else the parameters), the
      gradients and the optimizer states; writes the copy and the states. Torch's foreach Adam
      (``"foreach"``, :func:`foreach_adam_bytes`) makes eight passes instead;
    - copy (when a master is kept): reads the master, writes the 16-bit parameters (Megatron's
      ``_copy_main_params_to_model_params``);
    - zero (``zero_grads``; None: ``training.sharding`` in :data:`ZEROED_GRAD_BUFFER`, Megatron-LM's
      contiguous main-gradient buffer, ``zero_grad_buffer`` each step; a bool array where the
      search varies the sharding): one write of the gradients. FSDP2 (zero3, hsdp) frees its
      sharded gradients (``zero_grad(set_to_none=True)``): no pass;
    - scale (``training.framework = "megatron"`` with that zeroed buffer): one read and one write
      of the gradients. Megatron-LM divides the whole main-gradient buffer by the data-parallel
      size in place before reducing it, at every dp size, 1 included (NVIDIA/Megatron-LM 2755bcb
      ``megatron/model/distributed.py`` ``allreduce_gradients``: ``buffer_.data /=
      get_data_parallel_world_size()``; ``optimizer/distrib_optimizer.py`` ``reduce_model_grads``:
      ``gbuf.data /= data_parallel_world_size``).

    Megatron's bf16 mixed precision (2 B params, 4 B main grads, 4 B master, 8 B Adam states):
    4 + 8 + 28 + 6 + 4 + 8 = 58 B per parameter; torch's with the same state, 50 B.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16")
    >>> optimizer_step_bytes(2, 4, 4, 8, t), optimizer_step_bytes(2, 4, 4, 8, t.model_copy(update={"framework": "megatron"}))
    (50, 58)
    >>> optimizer_step_bytes(4, 4, 0, 8, t.model_copy(update={"sharding": "zero3", "grad_clip": False, "param_dtype": "fp32"}))
    28
    """
    updated = master if training.keeps_master else params
    norm_clip = 3 * grads if training.grad_clip else 0
    if training.optimizer_impl == "foreach" and training.optimizer in ("adam", "adamw"):
        update = foreach_adam_bytes(updated, grads, optimizer, training.optimizer == "adamw")
    else:
        update = 2 * (updated + optimizer) + grads
    copy = master + params if training.keeps_master else 0
    if zero_grads is None:
        zero_grads = training.sharding in ZEROED_GRAD_BUFFER
    passes = 3 if training.framework == "megatron" else 1  # zero; Megatron also scales by 1/dp (read, write)
    return norm_clip + update + copy + passes * grads * zero_grads


def foreach_adam_bytes(updated, grads, states, decoupled: bool):
    """HBM bytes of torch's foreach Adam/AdamW update (``_multi_tensor_adam``, torch/optim/adam.py;
    read at pytorch/pytorch 005941e, the same passes in AdamW's ``_multi_tensor_adamw``), ``updated``,
    ``grads``, ``states`` the rank's bytes of the updated copy, the gradients and both moments
    (``exp_avg`` and ``exp_avg_sq``, half each). One kernel per pass, each streaming its operands
    (non-capturable path; the step counters and bias corrections are scalars):

    1. ``_foreach_mul_(params, 1 - lr * wd)`` (AdamW's decoupled decay, torchtitan's
       weight_decay 0.1): read and write the copy, 2 ``updated``;
    2. ``_foreach_lerp_(exp_avgs, grads, 1 - beta1)``: ``states`` + ``grads``;
    3. ``_foreach_mul_(exp_avg_sqs, beta2)``: ``states``;
    4. ``_foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)``: ``states`` + ``grads`` (the
       one gradient tensor passed twice, read once from HBM: the same thread loads both);
    5. ``_foreach_sqrt(exp_avg_sqs)``: a new ``exp_avg_sq``-sized temporary, ``states``;
    6. ``_foreach_div_`` by sqrt(1 - beta2^t): ``states``; 7. ``_foreach_add`` of eps: ``states``;
    8. ``_foreach_addcdiv_(params, exp_avgs, denom, step_size)``: 2 ``updated`` + ``states``.

    4 x updated + 7 x states + 2 x grads (2 x updated without the decay): 80 B a parameter with
    fp32 copy, gradients and moments, against 28 B for the fused kernel's one pass.

    >>> foreach_adam_bytes(4, 4, 8, True), foreach_adam_bytes(4, 4, 8, False)
    (80, 72)
    """
    return (4 if decoupled else 2) * updated + 7 * states + 2 * grads


def optimizer_step_s(params, grads, master, optimizer, training, hbm_bandwidth_bytes_per_s, zero_grads=None):
    """Seconds of the optimizer step of one rank: memory-bound, its passes
    (:func:`optimizer_step_bytes`) at ``hbm_bandwidth_bytes_per_s`` (callers pass
    :func:`meshplan.compute.ops.optimizer_bandwidth`: measured Triad, or the datasheet for a GPU
    without catalog data). Scalars or numpy arrays of any shape (the search calls it on
    (candidates, stages) arrays).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="none", param_dtype="bf16")
    >>> optimizer_step_s(2e9, 4e9, 4e9, 8e9, t, 1.7e12) == 50e9 / 1.7e12
    True
    """
    return optimizer_step_bytes(params, grads, master, optimizer, training, zero_grads) / hbm_bandwidth_bytes_per_s


def _ends_of(res: ArrayResult) -> list[list[Event]]:
    """Per stage, its last unit (the first to reach the latest end) and its first forward (the
    first to start earliest): the only events :func:`_stage_end` reads; every stage at once
    (stage-major rows of ``res.flat.length`` units)."""
    p, length = res.flat.p, res.flat.length
    rows = np.arange(p) * length
    last = rows + res.end.reshape(p, length).argmax(axis=1)
    first_f = rows + np.where(res.flat.kind.reshape(p, length) == 0, res.start.reshape(p, length), np.inf).argmin(axis=1)
    evs = res._events(np.stack([last, first_f], axis=1).reshape(-1))
    return [evs[2 * s:2 * s + 2] for s in range(p)]


def call_transfer_s(res: ArrayResult, s: int) -> np.ndarray:
    """Per unit of stage ``s`` (flat order), seconds the blocking call issued after it spends
    on its own transfers: ``k x p2p_s``, ``k`` the larger of the call's sends and receives
    (:func:`meshplan.pipeline.simulate.call_loads`: they share the rank's link; slot
    ``s (L + 2) + position + 1`` of :class:`~meshplan.pipeline.fast.Transfers`); 0 for a call
    without transfers and without blocking sends. A call's hold is its partner's lateness plus
    this (:func:`pp_hold_split`).

    >>> from meshplan.pipeline.fast import simulate_arrays
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5, blocking_p2p=True))
    >>> call_transfer_s(r, 0).tolist(), r.hold[r.stage_slice(0)].tolist()  # F0 F1 B0 B1
    ([0.5, 0.5, 0.5, 0.0], [0.5, 2.5, 1.5, 0.0])

    (F 1 s, B 2 s: stage 0's call after F1, posted at 2.5, meets stage 1's after its B0, posted
    at 4.5: free at 4.5 + 0.5, hold 2.5 = 2 waiting for stage 1 + 0.5 transfer.)
    """
    return call_loads(res)[s, 1:] * res.spec.p2p_s


def call_loads(res: ArrayResult) -> np.ndarray:
    """``k`` of every stage's calls (:func:`call_transfer_s`), shape (p, L + 1): per stage its
    leading call (receives posted before its first unit), then the call after each unit;
    zeros without blocking sends. One count over all transfers (pass it to
    :func:`pp_hold_split` when splitting every stage)."""
    p, length = res.flat.p, res.flat.length
    if res.transfers is None:
        return np.zeros((p, length + 1))
    width = p * (length + 2)  # per stage: the leading slot, a slot after each unit, a trailing one
    sends = np.bincount(res.transfers.send.astype(np.int64), minlength=width)
    recvs = np.bincount(res.transfers.recv.astype(np.int64), minlength=width)
    return np.maximum(sends, recvs).reshape(p, length + 2)[:, :length + 1].astype(float)


class HoldSplit(NamedTuple):
    """Stage s's blocking calls (Megatron-LM 2022's rendezvous, :mod:`meshplan.pipeline.simulate`)
    split into their transfers and the wait for their partner, seconds: ``lead_*`` the call
    before its first unit (free at ``lead_transfer_s + lead_wait_s``), ``transfer_s`` and
    ``wait_s`` (arrays, one per unit, flat order) the call after each unit, ``hold = transfer +
    wait``. All zero with asynchronous sends."""

    lead_transfer_s: float
    lead_wait_s: float
    transfer_s: np.ndarray
    wait_s: np.ndarray


def pp_hold_split(res: ArrayResult, s: int, loads: Optional[np.ndarray] = None) -> HoldSplit:
    """Each blocking call of stage ``s`` as (its transfers on the critical path: ``k x p2p``,
    :func:`call_transfer_s`; the rest of its hold: waiting for the partner stage to post its
    call, pipeline bubble): a call ends at ``max(own post, partner posts) + k p2p``, so a hold
    is the partner's lateness plus ``k p2p``. The step exposes the transfers on "pp"
    (:func:`_unit_exposure`, :func:`_stage_end`), the waits are bubble (:meth:`StepTime.parts_s`).
    ``loads``: :func:`call_loads` (default: counted here).

    >>> from meshplan.pipeline.fast import simulate_arrays
    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> r = simulate_arrays(PipelineSpec("1f1b", p=2, m=2, p2p_s=0.5, blocking_p2p=True))
    >>> h = pp_hold_split(r, 0)  # stage 0: F0 F1 B0 B1 (F 1 s, B 2 s)
    >>> h.transfer_s.tolist(), h.wait_s.tolist()
    ([0.5, 0.5, 0.5, 0.0], [0.0, 2.0, 1.0, 0.0])
    >>> h = pp_hold_split(r, 1)  # stage 1 receives F0 before its first unit: posted at 0, F0 at 1
    >>> h.lead_transfer_s, h.lead_wait_s
    (0.5, 1.0)
    """
    sl = res.stage_slice(s)
    n = sl.stop - sl.start
    if res.hold is None or not n:
        return HoldSplit(0.0, 0.0, np.zeros(n), np.zeros(n))
    xfer = (call_loads(res) if loads is None else loads)[s] * res.spec.p2p_s
    lead_free = float(res.start[sl.start] - res.wait[sl.start])  # the leading call's end (0 without)
    lead = min(lead_free, float(xfer[0]))
    hold = res.hold[sl]
    moved = np.minimum(hold, xfer[1:])
    return HoldSplit(lead, lead_free - lead, moved, hold - moved)


def _unit_exposure(res: ArrayResult, s: int, units: UnitTimes, keys: list, key_idx: np.ndarray, ex: dict) -> dict:
    """``ex`` plus the exposed time of every unit of stage s by stream and, for each unit
    that waited on a p2p receive, ``min(p2p, wait)`` on "pp", and with blocking sends the
    transfers of the stage's calls (its leading call's and every unit's but the last's,
    :func:`pp_hold_split`; the last's: :func:`_stage_end`); added in unit order, so the
    sums are the per-event loop's to the bit."""
    sl = res.stage_slice(s)
    kidx, via = key_idx[sl], res.via_at(np.arange(sl.start, sl.stop))
    streams = sorted({k for key in set(kidx.tolist()) for k in units.by_key(keys[key]).exposed_s})
    for k in streams:
        vals = np.array([units.by_key(key).exposed_s.get(k, 0.0) for key in keys])[kidx]
        if k == "pp":
            vals = np.stack([vals, np.where(via, np.minimum(res.spec.p2p_s, res.wait[sl]), 0.0)], 1)
        ex[k] = sum(vals.reshape(-1).tolist(), ex.get(k, 0.0))
    if "pp" not in streams and via.any():
        waits = np.minimum(res.spec.p2p_s, res.wait[sl][via])
        ex["pp"] = sum(waits.tolist(), ex.get("pp", 0.0))
    if res.hold is not None:  # blocking sends: their transfers (the last call's: _stage_end)
        split = pp_hold_split(res, s)
        if split.lead_transfer_s or split.transfer_s[:-1].any():
            ex["pp"] = sum([split.lead_transfer_s] + split.transfer_s[:-1].tolist(), ex.get("pp", 0.0))
    return ex


def _optimizer_s(plan, s: int, memo: Optional[dict] = None) -> float:
    """The optimizer step's bulk passes and, under Megatron-LM, its per-step kernels and syncs
    (:func:`meshplan.compute.ops.megatron_stage_step_cost`). ``memo``: a dict kept across the
    stages of one plan, which then computes the Megatron-LM part once per distinct stage: it
    depends on the stage's layers only through their sequence of MoE flags
    (:meth:`~meshplan.spec.model.ModelSpec.layer_tensors`) and on whether the stage is the first
    or the last (pp 128 of one dense kind: 3 computations instead of 128)."""
    st, c = plan.state[s], plan.config
    extra = 0.0
    if c.training.framework == "megatron":
        memo = {} if memo is None else memo
        if "workload" not in memo:
            memo["workload"], memo["last"] = workload_of(plan), last_stage(plan.stages)
        layers = [i for chunk in plan.stages[s] for i in chunk]
        key = (tuple(map(c.model.is_moe_layer, layers)), s == 0, s == memo["last"])
        if key not in memo:
            memo[key] = megatron_stage_step_cost(c.model, c.cluster.gpu, memo["workload"], c.training, layers, s == 0,
                                                 s == memo["last"], plan.pp, plan.micro_batches).seconds()
        extra = memo[key]
    return extra + optimizer_step_s(st.bytes_of("params"), st.bytes_of("grads"), st.bytes_of("master"),
                                    st.bytes_of("optimizer"), c.training, optimizer_bandwidth(c.cluster.gpu))


def float8_precompute_s(plan, s: int) -> float:
    """Seconds of torchao's ``precompute_float8_dynamic_scale_for_fsdp`` on stage ``s`` after the
    optimizer step (``training.fp8_all_gather``, torchtitan's ``precompute_float8_dynamic_scale_for_fsdp``
    set with it): ``torch._foreach_norm(weights, inf)`` reads the rank's local shard of every
    float8 weight once (:func:`meshplan.compute.float8.precompute_bytes`, in the parameters'
    dtype) at the optimizer's bandwidth, never below one issue floor; its all-reduce, the table's
    per-step fsdp row, follows it as a step-end event (exposed fsdp), and under TP the second
    all-reduce of the same amaxes over tp after that (exposed tp,
    :func:`meshplan.compute.float8.precompute_all_reduces`). 0 without the float8 all-gather.

    Llama 3 8B on 8 GPUs (dp_shard 8), fp32 parameters: 32 layers x 218,103,808 float8 weight
    elements / 8 x 4 B = 3.49 GB, 1.17 ms at the H100's Triad (2.97 TB/s)."""
    c = plan.config
    if not c.training.fp8_all_gather:
        return 0.0
    tp, shard = plan.mesh.degree("tp"), plan.mesh.degree("fsdp")
    layers = [i for chunk in plan.stages[s] for i in chunk]
    numel = sum(local_numel(t, c.model, tp) for i in layers for t in c.model.layer_tensors(i)
                if c.training.float8_linear(t) and not t.split.startswith("expert")) // shard
    nbytes = float8.precompute_bytes(numel, dtype_bytes(c.training.param_dtype))
    return issue_floor(c.cluster.gpu, nbytes / optimizer_bandwidth(c.cluster.gpu))


def blocking_p2p(training, schedule: Schedule) -> bool:
    """Whether pipeline sends block their stage: Megatron-LM (``training.framework``) of 2022,
    whose ``_communicate`` waits on every ``batch_isend_irecv`` request and then calls
    ``torch.cuda.synchronize``, so both stages of a transfer rendezvous
    (:mod:`meshplan.pipeline.simulate`), in the schedules it had (``megatron_p2p``: 1F1B and
    interleaved 1F1B); torch's ``torch.distributed.pipelining`` schedules post their sends
    asynchronously."""
    return training.framework == "megatron" and get_schedule(schedule).megatron_p2p


def _last_hold(res: ArrayResult, s: int) -> float:
    """Seconds stage s's last unit holds its stream for a blocking send (0 without)."""
    return 0.0 if res.hold is None else float(res.hold[res.stage_slice(s)][-1])


def _run_end(mine, units: "UnitTimes", hold: float = 0.0) -> float:
    """End of a stage's pipeline run: its last unit (``mine``: its compute events) and the
    communication tail or blocking send after it (``hold`` seconds), before the step-end ops."""
    last = max(mine, key=lambda e: e.end_s)
    return last.end_s + max(units.of_event(last).tail_s, hold)


def run_shift(res: ArrayResult, units: "UnitTimes") -> float:
    """Seconds from one pipeline schedule run's start to the next's (``training.pp_schedule_runs``):
    the least uniform shift at which every stage is free when its first unit of the next run
    starts, ``max_s (run end_s - first start_s)`` (stage 0 starts the next run when its own run
    ends; stage s's first unit starts ``first start_s`` after it, on the same inputs). Every run
    starts from sharded parameters (``PipelineStage.perform_reduce_grad`` resharded them), so each
    repeats the first."""
    out = 0.0
    for s, mine in enumerate(_ends_of(res)):
        first = float(res.start[res.stage_slice(s)].min())
        out = max(out, _run_end(mine, units, _last_hold(res, s)) - first)
    return out


def _later_runs(runs: int) -> str:
    """``run 2`` or ``runs 2-4``: the schedule runs after the simulated first."""
    return "run 2" if runs == 2 else f"runs 2-{runs}"


def _stage_end(plan, s, spec, mine, units, comm: CommTimes, ov, hold: float = 0.0,
               memo: Optional[dict] = None, run_s: float = 0.0, runs: int = 1,
               hold_transfer_s: float = 0.0) -> tuple[float, list[Event], dict]:
    """End of stage s after its last unit (``mine``: its compute events) and the blocking
    send it issues (``hold`` seconds, overlapping its communication tail; of it
    ``hold_transfer_s`` the transfers, exposed on "pp" when the hold outlasts the tail, the
    rest waiting for the partner: bubble, :func:`pp_hold_split`), with the step-end
    events and their exposure (``memo``: :func:`_optimizer_s`'). ``run_s``: seconds from one
    schedule run to the next (:func:`run_shift`); the ``runs`` - 1 later runs are shown as one
    event after the stage's first run (``args``: ``later_runs``, ``run_s``)."""
    last = max(mine, key=lambda e: e.end_s)
    u = units.of_event(last)
    t = _run_end(mine, units, hold)
    post, exposed = [], ({u.tail_stream: u.tail_s} if u.tail_s >= hold and u.tail_s else
                         ({"pp": hold_transfer_s} if hold_transfer_s else {}))
    if runs > 1:  # each later run ends with the same tail
        exposed = {k: x * runs for k, x in exposed.items()}
        shift = (runs - 1) * run_s
        post.append(Event(s, "compute", f"schedule {_later_runs(runs)} ({runs - 1} x {run_s * 1e3:.3f} "
                          f"ms, each as run 1)", t, t + shift, {"later_runs": runs - 1, "run_s": run_s}))
        t += shift
    steps = [("grad reduce (per step)", 0.0 if ov.grad_reduce else comm.step_reduce_s, "dp")]
    # replicated KV heads: one all-reduce per layer of the reduced K/V gradients, before the optimizer
    steps += [(f"kv replica all-reduce {i}", comm.kv_s, "kv") for i in range(comm.kv_calls)]
    steps.append(("optimizer step", _optimizer_s(plan, s, memo), "compute"))
    steps.append(("float8 weight amax (precompute)", float8_precompute_s(plan, s), "compute"))
    steps.append(("float8 amax all-reduce (precompute)", comm.float8_step_s, "fsdp"))
    steps.append(("float8 amax all-reduce over tp (precompute)", comm.float8_tp_step_s, "tp"))
    first_f = min((e for e in mine if e.args["kind"] == "F"), key=lambda e: e.start_s)
    gather = comm.step_gather_s
    steps.append(("param all-gather (per step)", param_gather_exposed_s(gather, comm.gather_buckets, first_f.dur_s)
                  if ov.param_gather else gather, "dp"))
    for name, dur, stream in steps:
        if dur > 0:
            post.append(Event(s, stream, name, t, t + dur))
            if stream != "compute":
                exposed[stream] = exposed.get(stream, 0.0) + dur
            t += dur
    return t, post, exposed


def param_gather_exposed_s(gather_s: float, buckets: int, first_forward_s: float) -> float:
    """Exposed seconds of the per-step parameter all-gather overlapped with the next step's
    first forward unit (``Overlap.param_gather``: Megatron-LM's ``--overlap-param-gather``):
    ``buckets`` all-gathers of ``gather_s`` in all, issued one after another, the first waited
    for before the forward starts (its first forward pre-hook issues it and waits), each
    later one issued when the previous is waited for and running during the forward of the
    previous bucket's layers; what the first forward unit (``first_forward_s``) does not
    cover is exposed: ``max(gather / buckets, gather - first_forward)``. One bucket: all of it.
    With virtual stages Megatron-LM issues the later chunks' gathers during earlier micro-batches
    (``schedules.py`` ``param_sync_func``, when ``align_param_gather``), which this leaves out:
    an upper bound on the exposure there.

    >>> param_gather_exposed_s(10.0, 5, 4.0), param_gather_exposed_s(10.0, 5, 20.0), param_gather_exposed_s(10.0, 1, 20.0)
    (6.0, 2.0, 10.0)
    """
    return max(gather_s / max(buckets, 1), gather_s - first_forward_s)


def step_time(plan: Plan, overlap: Overlap = Overlap(), *, dropout: bool = False, table: Optional[GemmTable] = None,
              schedule: Optional[str] = None) -> StepTime:
    """Predict one step of a feasible ``plan`` (see the module docstring). ``schedule``
    overrides the config's ``pp_schedule``; ``table``: measured GEMM times. TP collectives
    overlap compute when ``overlap.tp`` or ``training.tp_comm_overlap`` (default: they block)."""
    if isinstance(plan, Infeasible):
        raise ValueError("step_time needs a resolved plan with stages; this one is infeasible: "
                         + "; ".join(plan.reasons))
    cfg, w = plan.config, workload_of(plan, dropout)
    p, v, m = len(plan.stages), plan.vpp, plan.micro_batches
    runs = plan.schedule_runs  # training.pp_schedule_runs: the schedule simulated once, over m / runs micro-batches
    if schedule is not None:  # the config's own schedule was checked by build_plan; this one's rules likewise
        check_framework(schedule, cfg.training.framework, p, "--schedule")
        check_schedule(cfg.training, schedule, p, "--schedule")  # DeepSpeed's ZeRO-1/2 engine: 1F1B only
        bad = run_reasons(schedule, p, m, v, runs, cfg.training.framework)
        if bad:
            raise ConfigError("mesh.pp_schedule", bad[0])
    mr = m // runs
    overlap = config_overlap(cfg.training, overlap)
    share = nccl_sm_share(cfg.cluster)
    # each stage's table (plan.table_stage) and layers, read without building Stage views (a
    # plan of the search's step-only path has no memory timelines)
    comms = [CommTimes.from_rows(plan.collectives[table_key(table_stage(s, p))], sum(map(len, plan.stages[s])), share)
             for s in range(p)]
    chunks = chunk_costs(plan, w, table)
    base = PipelineSpec(Schedule(schedule or plan.spec.pp_schedule), p, mr, v,
                        p2p_s=max(c.p2p_s + c.p2p_gather_s for c in comms), blocking_p2p=blocking_p2p(cfg.training, Schedule(schedule or plan.spec.pp_schedule)))
    units = UnitTimes(base, chunks, comms, w, overlap, cfg.training.reshard_after_forward,
                      cfg.training.sharding in ("zero3", "hsdp"), cfg.training.grad_accumulation,
                      cfg.training.reshard_head_after_forward)
    spec = PipelineSpec(base.schedule, p, mr, v, p2p_s=base.p2p_s, blocking_p2p=base.blocking_p2p,
                        duration=lambda s, u: units.get(s, u.chunk, u.kind, u.mb).duration_s)
    indexed: list = []

    def durations(f: Flat) -> np.ndarray:
        keys, idx = units.index(f)
        indexed[:] = [keys, idx]
        return np.array([units.by_key(k).duration_s for k in keys])[idx]

    res = simulate_arrays(spec, durations)
    ends, post, exposed = [], [], []
    memo: dict = {}
    run_s = run_shift(res, units) if runs > 1 else 0.0
    loads = call_loads(res) if res.hold is not None else None
    for s, mine in enumerate(_ends_of(res)):
        last_xfer = float(pp_hold_split(res, s, loads).transfer_s[-1]) if loads is not None else 0.0
        end, ev, ex = _stage_end(plan, s, spec, mine, units, comms[s], overlap, _last_hold(res, s), memo, run_s, runs,
                                 last_xfer)
        ends.append(end)
        post += ev
        exposed.append(ex)
    crit = max(range(p), key=lambda s: ends[s])
    if not indexed:
        indexed[:] = list(units.index(res.flat))
    for k, x in _unit_exposure(res, crit, units, indexed[0], indexed[1], {}).items():
        exposed[crit][k] = exposed[crit].get(k, 0.0) + runs * x  # every run exposes what the first does
    hw = sum(m * sum(sum(x.flops("hardware") for x in ch.layers)
                     + sum(x.flops("hardware") for x in (ch.embed, ch.head) if x is not None) for ch in stage)
             for stage in chunks) * plan.world // p
    gap: dict[str, float] = {}
    for stage in chunks:
        for ch in stage:
            for cause, f in flop_gap(o for x in (*ch.layers, ch.embed, ch.head) if x is not None for o in x.ops).items():
                gap[cause] = gap.get(cause, 0.0) + m * f * plan.world / p
    t = cfg.training
    ranks = tuple(plan.mesh.group_of(0, "pp")) if "pp" in plan.mesh.layout.names else (0,)
    notes = tuple(f"collective not simulated (kind unknown): {o}" for o in sorted({o for c in comms for o in c.other}))
    # plan's notes say it for its own schedule
    notes += runtime_warnings(t, schedule or plan.spec.pp_schedule, plan.mesh, cfg.model)
    if runs > 1:
        notes += (f"{runs} pipeline schedule runs of {counted(mr, 'micro-batch')} per step (training.pp_schedule_runs: "
                  f"torchtitan's gradient accumulation under pp): each fills and drains the pipeline, gathers "
                  f"and reduce-scatters the FSDP units; the timeline shows run 1, {_later_runs(runs)} follow"
                  f"{'s' if runs == 2 else ''} it {run_s * 1e3:.3f} ms apart",)
    host = [sum(v * (c.layers if g == "layer" else 1) for (g, _), v in c.host.items()) for c in comms]
    if any(host):
        notes += (f"DeepSpeed ZeRO-3 (2021) host time on the compute stream: {max(host) * 1e3:.1f} ms per "
                  f"micro-batch (stage {host.index(max(host))}): each per-parameter gather's partition views and list "
                  f"copies issued and its zero fill waited for, each gradient bucket's calls issued "
                  f"(meshplan.comm.deepspeed)",)
    copies = [sum(r.copy_s * r.per_step for r in plan.collectives[table_key(table_stage(s, p))])
              for s in range(p)]
    if any(copies):
        notes += (f"FSDP2 copies on the compute stream: {max(copies) * 1e3:.1f} ms per step (stage "
                  f"{copies.index(max(copies))}): the copy-out after each all-gather and the copy-in before each "
                  f"reduce-scatter (meshplan.comm.fsdp2)",)
    return StepTime(res, units, tuple(ends), tuple(post), exposed[crit],
                    _sequence_flops(cfg.model, t.seq_len) * t.global_batch, hw, t.global_batch * t.seq_len,
                    plan.world, cfg.cluster.gpu.peak_flops(t.peak_dtype), ranks, notes,
                    recompute_words(t, runtime(t, cfg.origin)),
                    (indexed[0], indexed[1]), t.peak_dtype, tuple(gap.items()), runs,
                    tuple(stream_words(t, cfg.origin).items()),
                    mesh_text(plan.mesh.layout.names, plan.mesh.layout.shape, t.sharding, plan.mesh.ep, plan.mesh.etp))


@lru_cache(maxsize=16)
def _cached_flops(model, seq_len: int) -> float:
    return sequence_model_flops(model, seq_len)


def _sequence_flops(model, seq_len: int) -> float:
    """:func:`~meshplan.compute.ops.sequence_model_flops`, once per (model, sequence length)
    (it walks every layer; the search asks for it once per planned candidate)."""
    try:
        return _cached_flops(model, seq_len)
    except TypeError:  # a model with an unhashable field
        return sequence_model_flops(model, seq_len)


def config_overlap(training, overlap: Overlap = Overlap()) -> Overlap:
    """``overlap`` with what the config turns on: ``tp`` for ``training.tp_comm_overlap`` under
    Megatron-LM (``--tp-comm-overlap``; torch's async TP fuses some collectives and the others
    block: :func:`meshplan.compute.asynctp.unfused_overlap`), ``tp_grad`` for
    ``training.framework = "megatron"``; and
    what Megatron-LM 2022 cannot do: overlap the per-step gradient reductions with the backward
    (``grad_reduce`` off: 2755bcb ``megatron/training.py`` ``train_step`` calls
    ``optimizer.reduce_model_grads`` after ``forward_backward_func`` returns, and it runs the SP
    gradients' all-reduce, the local DDP buffer's all-reduce over dp and the tied embedding's
    all-reduce one after the other, each between timer syncs; ``model/distributed.py``'s hooks
    only accumulate into the main-gradient buffer; today's Megatron-LM does the same unless
    ``--overlap-grad-reduce``, default off). With ``training.overlap_grad_reduce``
    (``--overlap-grad-reduce`` on its DDP buffers, sharding none or zero1) ``grad_reduce`` stays
    on: the buffer's buckets (:func:`meshplan.comm.collectives._megatron_bucket_rows`) are
    reduced as their gradients are ready in the last backward, which the timeline places as
    DDP's (:func:`meshplan.schedule.rank_timeline.reduce_pieces`); ``training.overlap_param_gather``
    turns ``param_gather`` on (:func:`param_gather_exposed_s`). Except under
    sharding zero2, zero3 and hsdp, which Megatron-LM runs with Megatron FSDP
    (``--use-megatron-fsdp``): there ``MegatronFSDP.__init__`` turns ``overlap_grad_reduce`` on
    (and ``overlap_param_gather`` for ``optim_grads_params``) whatever the flags say, each
    FSDP unit's reduce-scatter issued asynchronously after its backward and the next unit's
    all-gather prefetched (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py
    lines 326-337 at NVIDIA/Megatron-LM d98e8a6): ``grad_reduce`` stays on
    (:func:`megatron_reduce_line`), with none of FSDP2's copies on the compute stream
    (:func:`meshplan.comm.fsdp2.compute_stream_copies`). Under ``training.zero12_engine = "deepspeed"``,
    ``grad_reduce`` is ``training.overlap_comm``. Under ``training.zero3_engine = "deepspeed"``
    without overlap_comm (:attr:`~meshplan.spec.training.TrainingSpec.overlaps_comm`; DeepSpeed's
    stage-3 default is on) both ``fsdp_prefetch`` and ``grad_reduce`` are off: DeepSpeed then
    issues its all-gathers and reduce-scatters on the default stream (deepspeedai/DeepSpeed edaa722
    ``runtime/zero/parameter_offload.py:189-190``, ``runtime/zero/stage3.py:335-336``), where
    each runs between the compute kernels and blocks them, a prefetch included."""
    if training.tp_comm_overlap and not overlap.tp and asynctp.unfused_overlap(training.framework):
        overlap = replace(overlap, tp=True)
    if training.framework == "megatron":
        overlap = replace(overlap, tp_grad=True, grad_reduce=overlap.grad_reduce and (
            megatron_fsdp(training) or training.overlap_grad_reduce),
            param_gather=overlap.param_gather or (training.overlap_param_gather and training.sharding == "zero1"))
    if training.zero3_engine == "deepspeed" and training.sharding == "zero3" and not training.overlaps_comm:
        overlap = replace(overlap, fsdp_prefetch=False, grad_reduce=False)  # all on the default stream
    if training.zero12_engine == "deepspeed" and overlap.grad_reduce != training.overlaps_comm:
        # DeepSpeed ZeRO-1/2: its reductions run on a side stream under overlap_comm only, else
        # on the compute stream (comm.deepspeed_zero12); whatever the framework runs the model
        overlap = replace(overlap, grad_reduce=training.overlaps_comm)
    if training.zero3_engine == "deepspeed-2021" and overlap.grad_reduce:
        # DeepSpeed ZeRO-3 of 2021: every module's fetch ends in torch.cuda.synchronize()
        # (stage3.py _synchronize_communication), which waits for the reductions in flight (the
        # layers' buckets are placed between those fetches: rank_timeline._ds_backward_layer)
        overlap = replace(overlap, grad_reduce=False)
    return overlap


def megatron_fsdp(training) -> bool:
    """Whether Megatron-LM runs ``training``'s sharding with Megatron FSDP (zero2 under
    ``zero12_engine = "megatron"``, zero3 and hsdp under ``zero3_engine = "fsdp2"``:
    ``--use-megatron-fsdp``, :func:`config_overlap`) rather than its DDP buffers (none, zero1)
    or another engine (DeepSpeed's)."""
    if training.sharding == "zero2":
        return training.zero12_engine == "megatron"
    return training.sharding in ("zero3", "hsdp") and training.zero3_engine == "fsdp2"


def _megatron_engine(training) -> bool:
    """Whether Megatron-LM's own code reduces ``training``'s gradients: its DDP buffers (none;
    zero1 under ``zero12_engine = "megatron"``) or Megatron FSDP (:func:`megatron_fsdp`)."""
    ddp = training.sharding == "none" or (training.sharding == "zero1" and training.zero12_engine == "megatron")
    return ddp or megatron_fsdp(training)


def megatron_reduce_line(training) -> str:
    """Under ``training.framework = "megatron"``: which gradient reduction the step models
    (:func:`config_overlap`), one line; empty under another framework.

    >>> from meshplan.spec.training import TrainingSpec
    >>> megatron_reduce_line(TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", framework="megatron"))[:36]
    'note: Megatron FSDP (sharding zero3)'
    >>> megatron_reduce_line(TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", framework="megatron"))[-26:]
    '--overlap-grad-reduce off)'
    """
    if training.framework != "megatron" or not _megatron_engine(training):
        return ""  # DeepSpeed's engines: their own lines (overlap_comm, the 2021 ZeRO-3 synchronize)
    if megatron_fsdp(training):
        return (f"note: Megatron FSDP (sharding {training.sharding}): each unit's gradient reduce-scatter overlaps "
                f"the next unit's backward and the next all-gather is prefetched (MegatronFSDP forces "
                f"overlap_grad_reduce and overlap_param_gather; export writes --overlap-grad-reduce"
                f"{' --overlap-param-gather' if training.sharding != 'zero2' else ''}); no copies on the compute "
                f"stream around them, unlike FSDP2: the parameters are views of the all-gather's bucket and the "
                f"weight-gradient GEMMs write into the reduce-scatter's (meshplan.comm.fsdp2)")
    if training.overlap_grad_reduce:
        gather = (" (--overlap-param-gather: the next forward waits for the first bucket's parameter all-gather, "
                  "the others run beside it)") if training.overlap_param_gather else ""
        return (f"note: Megatron-LM DDP buffers (sharding {training.sharding}, --overlap-grad-reduce): each gradient "
                f"bucket is reduced once its gradients are ready in the last backward, overlapping the rest of it"
                f"{gather}")
    return (f"note: Megatron-LM DDP buffers (sharding {training.sharding}): the gradient reduction runs after the "
            f"last backward, not overlapped (Megatron-LM's default, --overlap-grad-reduce off)")


def tp_overlap_line(plan: Plan, st: StepTime, step_fn: Callable[[Plan], StepTime]) -> str:
    """With ``training.tp_comm_overlap`` on and tp > 1: one line naming what the step model runs
    (:func:`meshplan.compute.asynctp.model_name`) and what it saves and costs on the critical
    stage, against the same plan with the overlap off (TP collectives blocking): exposed tp,
    compute (the pieces' smaller GEMMs and the runtime's copies) and the step, each as
    :meth:`StepTime.shown_ms` prints it; ``st``: the plan's step, ``step_fn``: how the caller
    predicts a step (its other options kept). Else empty. Only the step model reads the field
    (the table, memory and placement do not), so the plan is reused with it off."""
    t = plan.config.training
    if not t.tp_comm_overlap or plan.mesh.degree("tp") < 2:
        return ""
    off = step_fn(replace(plan, config=replace(plan.config, training=t.model_copy(update={"tp_comm_overlap": False}))))
    return _overlap_versus_blocking("training.tp_comm_overlap", asynctp.model_name(t.framework,
                                                                                   plan.mesh.sequence_parallel), st, off)


#: What ``step --overlap-tp`` (``Overlap.tp`` without ``training.tp_comm_overlap``) runs: each
#: block's TP collectives beside its whole GEMMs (:mod:`meshplan.schedule.rank_timeline`), no GEMM
#: decomposed and no copy, the GEMMs slowed only by the SMs the NCCL kernels hold while they run
#: (:func:`~meshplan.schedule.rank_timeline.nccl_sm_share`): a bound no runtime reaches, where the
#: config's knob models the runtimes' decomposed GEMMs.
IDEAL_TP_OVERLAP = ("ideal overlap of whole GEMMs (each block's TP collectives run beside its GEMMs, which slow "
                    "only by the SMs NCCL holds; no runtime decomposes them so: training.tp_comm_overlap models "
                    "the runtime's overlap)")


def ideal_tp_overlap_line(plan: Plan, st: StepTime, blocking: StepTime) -> str:
    """``step --overlap-tp`` on a config without ``training.tp_comm_overlap`` and tp > 1: the
    line :func:`tp_overlap_line` prints for the knob, labelled :data:`IDEAL_TP_OVERLAP`; ``st``:
    the step with ``Overlap.tp``, ``blocking``: the same step without it. Else empty."""
    if plan.config.training.tp_comm_overlap or plan.mesh.degree("tp") < 2:
        return ""
    return _overlap_versus_blocking("--overlap-tp", IDEAL_TP_OVERLAP, st, blocking)


def _overlap_versus_blocking(source: str, what: str, on: StepTime, off: StepTime) -> str:
    """The TP-overlap line: exposed tp, compute and step of ``on`` against ``off`` (blocking),
    each as :meth:`StepTime.shown_ms` prints it, and the milliseconds saved (or cost) per step."""
    on_ms, off_ms = on.shown_ms(), off.shown_ms()
    saved = round(off.step_s * 1e5) - round(on.step_s * 1e5)
    return (f"tp overlap ({source}): {what}; "
            f"exposed tp {on_ms.get('exposed tp', '0.00')} ms (blocking: {off_ms.get('exposed tp', '0.00')} ms), "
            f"compute {on_ms['compute']} ms (blocking: {off_ms['compute']} ms), step {on_ms['step']} ms (blocking: "
            f"{off_ms['step']} ms): {'saves' if saved >= 0 else 'costs'} {abs(saved) / 100:.2f} ms per step"
            f"{_why_nothing_saved(on, off) if saved == 0 else ''}")


def _why_nothing_saved(on: StepTime, off: StepTime) -> str:
    """Why a TP overlap saves 0 ms (:func:`_overlap_versus_blocking`): the critical stage's
    compute stream waits on another stream either way (the one with the most exposed seconds
    in ``on``, named with them), so the tp time hidden turns into waits for it; else the compute
    slowed by the SMs NCCL holds cancels the exposed tp saved; empty when tp exposed nothing."""
    on_ms, off_ms = on.shown_ms(), off.shown_ms()
    others = {k: v for k, v in on.exposed_s.items() if k != "tp" and v > 0}
    if others:
        worst = max(others, key=lambda k: others[k])
        return (f": the step is bound by the {worst} stream (exposed {worst} {on_ms['exposed ' + worst]} ms on "
                f"stage {on.critical_stage}), which the compute stream waits for either way: the tp time hidden "
                f"becomes {worst} wait")
    if "exposed tp" in off_ms:
        return (f": the compute slowed by the SMs NCCL holds ({off_ms['compute']} -> {on_ms['compute']} ms) "
                f"offsets the exposed tp hidden")
    return ""


def layer_unit_times(plan, dropout: bool = False, overlap: Overlap = Overlap()) -> tuple[float, float]:
    """(forward, backward) seconds of ONE layer of stage 0 for one micro-batch, with its
    blocking collectives: the per-layer figures papers publish (Korthikanti et al. 2022,
    Table 4)."""
    w = workload_of(plan, dropout)
    ch = chunk_costs(plan, w)[0][0]
    one = ChunkCosts(ch.layers[:1], ch.moe[:1])
    comm = CommTimes.from_rows(plan.stage(0).collectives, sm_share=nccl_sm_share(plan.config.cluster))
    overlap = config_overlap(plan.config.training, overlap)
    return forward_unit(one, comm, w, overlap).duration_s, backward_unit("B", one, comm, w, overlap).duration_s
