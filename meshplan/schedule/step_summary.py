"""The predicted step as a result (:class:`StepTime`, built by
:func:`meshplan.schedule.steptime.step_time`): step time, critical stage and path, its parts
(compute + bubble + exposed communication, :meth:`StepTime.parts_s`) printed so they add up
(:meth:`StepTime.shown_ms`), the FSDP waits apart from the schedule's bubble, tokens/s, MFU and
HFU, the printable lines (built in :mod:`meshplan.schedule.step_lines`) and the Chrome/Perfetto
trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

import numpy as np

from meshplan.compute.flops import megatron_throughput, torchtitan_mfu
from meshplan.pipeline.fast import ArrayResult
from meshplan.pipeline.simulate import Event
from meshplan.pipeline.trace import write_trace
from meshplan.schedule.fsdp_waits import pipeline_without_fsdp_waits
from meshplan.schedule.host_pace_line import host_not_binding
from meshplan.schedule.pipeline_exposure import unit_exposure, last_tail_s, stage_bubble
from meshplan.schedule.step_lines import summary_lines
from meshplan.schedule.unit_times import UnitTimes
from meshplan.spec.wording import fold_streams
from meshplan.units import counted, rounded_to_total


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
    mesh_text: str = ""  # the mesh as every output prints it (mesh_words.mesh_text), on the first line
    tt_flops_per_token: float = 0.0  # torchtitan's MFU FLOP per token (flops.torchtitan_flops_per_token); 0: no line
    tt_peak_flops: float = 0.0  # the peak torchtitan divides by (flops.torchtitan_peak_flops), FLOP/s
    mg_flops: float = 0.0  # Megatron-LM's --log-throughput FLOP per iteration (flops.megatron_flops_per_iteration); 0: no line
    compute_peak_flops: float = 0.0  # the compute dtype's dense peak where peak_dtype is another (fp8 Linears); 0: same
    compute_dtype: str = ""  # that compute dtype (TrainingSpec.compute_dtype)
    tt_words: str = ""  # how torchtitan counted tt_flops_per_token (flops.torchtitan_flops_words)

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

    @property
    def torchtitan_mfu(self) -> Optional[float]:
        """The MFU torchtitan would log for this predicted step (:func:`~meshplan.compute.flops.torchtitan_mfu`:
        its FLOP per token, tokens per second per GPU and bf16 peak), a fraction; None where the
        config is not framework torch."""
        if not self.tt_flops_per_token:
            return None
        return torchtitan_mfu(self.tt_flops_per_token, self.tokens, self.step_s, self.world, self.tt_peak_flops)

    def torchtitan_line(self) -> list[str]:
        """``torchtitan's MFU formula: 36.52% (...)``: :attr:`torchtitan_mfu` with its inputs, two decimals as
        torchtitan logs ``mfu(%)``, and the tokens/s per GPU its log's ``tps`` would read; none where it is None."""
        mfu = self.torchtitan_mfu
        if mfu is None:
            return []
        tps = self.tokens / (self.step_s * self.world)
        return [f"torchtitan's MFU formula: {mfu * 100:.2f}% (what its log's mfu would read: "
                f"{self.tt_flops_per_token:,.0f} FLOP/token ({self.tt_words}) x {tps:,.0f} tokens/s per GPU "
                f"(its log's tps) / its {self.tt_peak_flops / 1e12:,.0f} "
                f"TFLOP/s bf16 peak, whatever the dtype)"]

    @property
    def megatron_throughput(self) -> Optional[float]:
        """The throughput per GPU Megatron-LM's ``--log-throughput`` would log for this predicted step,
        FLOP/s (:func:`~meshplan.compute.flops.megatron_throughput`; its log prints /1e12, TFLOP/s/GPU);
        None where the config is not framework megatron."""
        return megatron_throughput(self.mg_flops, self.step_s, self.world) if self.mg_flops else None

    def megatron_line(self) -> list[str]:
        """``Megatron-LM's --log-throughput formula: 412.3 TFLOP/s/GPU (...)``: :attr:`megatron_throughput`
        with its inputs, one decimal as Megatron logs it; none where it is None."""
        tput = self.megatron_throughput
        if tput is None:
            return []
        return [f"Megatron-LM's --log-throughput formula: {tput / 1e12:.1f} TFLOP/s/GPU (what its log's throughput "
                f"per GPU would read: {self.mg_flops:.4e} FLOP per iteration (num_floating_point_operations: 3 x "
                f"GEMMs, causal-half attention and logits over the padded vocabulary, recompute not counted) / "
                f"(step {self.step_s:.4f} s x {self.world:,} GPUs))"]

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
        return s, {k: self.runs * x for k, x in unit_exposure(res, s, self.units, keys, idx, {}).items()}

    def parts_s(self) -> dict[str, float]:
        """The step on the critical stage s split into parts that add up to :attr:`step_s`,
        seconds (every part >= 0; streams that expose nothing left out):

        - ``compute``: s's pipeline units less the communication exposed inside them (GEMMs,
          attention, memory-bound ops, recompute, copies on the compute stream), every
          schedule run, plus the optimizer step;
        - ``bubble``: s's compute stream idle: before its first unit, between units (a receive
          wait beyond its transfer), the part of each blocking call's hold spent waiting for its
          partner stage (:func:`~meshplan.schedule.pipeline_exposure.pp_hold_split`), and with ``training.pp_schedule_runs`` > 1 each
          later run's idle (its :func:`~meshplan.schedule.pipeline_exposure.run_shift` less run 1's busy and exposed time);
        - ``exposed <stream>``: :attr:`exposed_s` (pp: the transfers only, and a tied
          embedding's per-step gradient all-reduce between the first and last stage, which runs
          over pp; each per-step reduction on the group it runs on:
          :func:`~meshplan.schedule.comm_streams.step_stream`).

        D4 (Korthikanti et al. 2022 175B, Megatron-LM interleaved 1F1B p 8 x v 3, 64
        micro-batches, dp 1): compute 11,165.84 + bubble 676.31 + exposed tp 1,400.30 (1,394.47 in
        the units, 5.73 get_batch's tp broadcasts, 0.10 the coalesced SP all-reduce) + pp 158.19 (340 transfers of 0.4156 ms, and
        16.88 the tied embedding's all-reduce) = 13,400.64 ms (tests/test_step_parts.py)."""
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
        (largest remainder, :func:`~meshplan.units.rounded_to_total`: every part within 0.01 ms of its
        value), so the exposed-communication line, the parts line and the HTML report print
        the same number for the same quantity (a part of 8.605 ms is 8.60 or 8.61 in all)."""
        if "shown" not in self._trace_cache:
            total = round(self.step_s * 1e5)
            cents = rounded_to_total({k: v * 1e5 for k, v in self.parts_s().items()}, total)
            self._trace_cache["shown"] = {k: f"{c / 100:.2f}" for k, c in {"step": total, **cents}.items()}
        return dict(self._trace_cache["shown"])

    def parts_line(self) -> str:
        """``step on stage 0 = compute 11165.84 + bubble 676.31 + exposed tp 1400.30 + ... =
        13400.64 ms``: :meth:`parts_s` as :meth:`shown_ms` prints them (they add up to the
        printed step)."""
        shown = self.shown_ms()
        terms = " + ".join(f"{self.part_named(k)} {v}" for k, v in shown.items() if k != "step")
        return f"step on stage {self.critical_stage} = {terms} = {shown['step']} ms"

    def host_wait_s(self) -> float:
        """Seconds per step the critical stage's compute stream waits for the host to issue
        its blocks (eager DTensor TP: :meth:`meshplan.schedule.unit_sim.StreamSim.host_pace`),
        every schedule run; :meth:`parts_s`'s ``compute`` holds them."""
        res, s = self.pipeline, self.critical_stage
        keys, idx = self.unit_index if self.unit_index else self.units.index(res.flat)
        waits = np.array([self.units.by_key(k).host_wait_s for k in keys])[idx[res.stage_slice(s)]]
        return self.runs * float(waits.sum())

    def contention_s(self) -> float:
        """Seconds per step that :meth:`parts_s`'s ``compute`` on the critical stage holds beyond
        its kernels' own time: kernels slowed while collectives hold their SM share
        (:meth:`meshplan.schedule.unit_sim.StreamSim.compute`, the share from
        :func:`~meshplan.schedule.comm_times.nccl_sm_share`), every schedule run; the part of a
        slowdown an overlapped collective outlasts is in that stream's exposure. Printed by
        :func:`~meshplan.schedule.contention_line.contention_line`."""
        res, s = self.pipeline, self.critical_stage
        keys, idx = self.unit_index if self.unit_index else self.units.index(res.flat)
        slow = np.array([self.units.by_key(k).contention_s for k in keys])[idx[res.stage_slice(s)]]
        return self.runs * float(slow.sum())

    def host_line(self) -> list[str]:
        """``host: ...`` when the device waits for the host's issue (:meth:`host_wait_s`), naming
        the per-block pace and its source (the catalog's, or ``your kernels file FILE``:
        :attr:`~meshplan.compute.ops.Workload.dtensor_host_source`); a kernels file's pace that the
        device never waits for, ``host: pace 2.00/2.50 ms a block (forward/backward) from your
        kernels file FILE: not binding (...)`` (:func:`~meshplan.schedule.host_pace_line.host_not_binding`), so the user sees it was
        applied; none otherwise (the catalog's pace not binding is no news)."""
        wait = self.host_wait_s()
        if round(wait * 1e5) <= 0:
            return host_not_binding(self)
        w = self.units.w
        f, b = w.dtensor_host_s
        return [f"host: compute on stage {self.critical_stage} includes {wait * 1e3:.2f} ms per step waiting for the host "
                f"to issue its blocks: eager DTensor TP issues a block in {f * 1e3:.2f} ms forward, {b * 1e3:.2f} ms "
                f"backward ({w.dtensor_host_source}), longer than "
                f"its kernels and collectives take; training.torch_compile = true traces DTensor away"]

    def without_fsdp_waits(self) -> Optional[ArrayResult]:
        """The pipeline simulated again without the units' FSDP waits, built once
        (:func:`~meshplan.schedule.fsdp_waits.pipeline_without_fsdp_waits`); None with pp 1 or no
        such wait. Its bubble is the schedule's alone; the difference in ``step_s`` is what the
        FSDP waits add to the pipeline (:meth:`lines`)."""
        if "no_fsdp" not in self._trace_cache:
            self._trace_cache["no_fsdp"] = pipeline_without_fsdp_waits(self)
        return self._trace_cache["no_fsdp"]

    def lines(self) -> list[str]:
        """Printable summary with the definitions named (:func:`~meshplan.schedule.step_lines.summary_lines`)."""
        return summary_lines(self)

    def recompute_s(self, stage: Optional[int] = None) -> float:
        """Seconds of recomputed forward ops per micro-batch on ``stage`` (default: the
        critical one), summed over its layers (:func:`meshplan.compute.layer.layer_cost`)."""
        s = self.critical_stage if stage is None else stage
        return sum(c.seconds(recompute=True) for ch in self.units.chunks[s] for c in ch.layers)

    def recompute_step_s(self) -> float:
        """Seconds of recomputed forward ops per step on the critical stage: :meth:`recompute_s`
        x the micro-batches x the schedule runs (what :meth:`recompute_line` prints per step)."""
        return self.recompute_s() * self.pipeline.spec.m * self.runs

    def recompute_line(self) -> str:
        """The recompute policy in its framework's words and what it costs per step."""
        t, m = self.recompute_name, self.pipeline.spec.m * self.runs
        return (f"recompute: {t}: {self.recompute_s() * 1e3:.3f} ms per micro-batch on stage {self.critical_stage}, "
                f"{self.recompute_step_s() * 1e3:.2f} ms per step ({counted(m, 'micro-batch')})")

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
