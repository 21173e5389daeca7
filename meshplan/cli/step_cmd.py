"""step: the scheduled rank timeline of one mesh: step time and its parts, the TP-overlap and
network verdicts, the critical path, collective readiness and the load on each physical edge."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from meshplan.spec.accuracy import mfu_caveat
from meshplan.cli.common import (
    CONFIG_HELP,
    CalibrationOpt,
    KernelsOpt,
    TopologyOpt,
    _echo,
    _in_file,
    _exit_infeasible,
    _infeasible,
    _json_option,
    _refuse_existing,
    _write_doc,
    _wrote,
)
from meshplan.cli.foreign_opts import Foreign, foreign_options
from meshplan.cli.loading import _calibrated, _calibration, _kernels, _load
from meshplan.cli.schedule_opt import layer_split, refusal, renamed, rule_error
from meshplan.cli.step_links import print_links
from meshplan.compute.gemm import load_gemm_table
from meshplan.compute.megatron_core import runtime_followed
from meshplan.compute.routing import balance_note
from meshplan.compute.table_use import as_json as table_json, gemm_shapes, table_use
from meshplan.comm.calibration_notes import roce_note, uncalibrated_note
from meshplan.errors import ConfigError, check_number
from meshplan.fileio import check_destination
from meshplan.plan import Infeasible
from meshplan.reliability import configured_reliability, job_interval, train_time
from meshplan.interop.keymaps import keymap_of
from meshplan.plan_fix import memory_fix
from meshplan.report.json_docs import envelope, step_doc, step_infeasible_doc
from meshplan.schedule.bubble_hint import bubble_hint
from meshplan.schedule.cp_hint import cp_hint
from meshplan.schedule.ep_hint import ep_hint
from meshplan.schedule.ep_routing import routing_caveat
from meshplan.schedule.reshard_note import reshard_default_note
from meshplan.schedule.host_hint import host_hint
from meshplan.schedule.link_hint import link_bound_hint
from meshplan.schedule.overlap_policy import deepspeed_prefetch_line, megatron_reduce_line
from meshplan.schedule.steptime import step_time
from meshplan.schedule.tp_hint import tp_hint
from meshplan.report.plan_warnings import plan_warnings
from meshplan.schedule.tp_overlap_lines import ideal_tp_overlap_line, tp_overlap_line
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.verdict import network_verdict, rebuilt_step
from meshplan.schedule.waits import bubble_wait
from meshplan.schedule.workload import plan_ops
from meshplan.spec.mesh import parse_schedule
from meshplan.spec.mesh_words import schedule_words


def _overlap(overlap_tp: bool, no_prefetch: bool):
    return Overlap(tp=overlap_tp, fsdp_prefetch=not no_prefetch)


@foreign_options()
def step(config: Path = typer.Argument(..., help=CONFIG_HELP),
         trace: Optional[Path] = typer.Option(None, "--trace", help="write the predicted timeline (Chrome/Perfetto JSON)"),
         overlap_tp: bool = typer.Option(False, "--overlap-tp", help="with training.tp_comm_overlap off: run each block's TP "
                                         "collectives beside its whole GEMMs (a what-if, not a bound: it can "
                                         "expose more tp than training.tp_comm_overlap's decomposed GEMMs) and print "
                                         "its exposed tp, compute and step against blocking TP (the hints stay the "
                                         "config as written); with it on, ignored "
                                         "(a note says so): the config's model, the runtimes' decomposed GEMMs, runs"),
         no_prefetch: bool = typer.Option(False, "--no-prefetch", help="no FSDP all-gather prefetch"),
         gemm_table: Optional[Path] = typer.Option(None, "--gemm-table", help="measured GEMM times (bench gemm's CSV; bench attention's "
                                                   "JSON for attention): a row times the plan's GEMMs of exactly its "
                                                   "shape and dtype, before the catalog, never interpolated (for "
                                                   "interpolated points: bench gemm --grid with --kernels); a 'gemm "
                                                   "table:' line says how many of the plan's GEMM shapes it timed, a "
                                                   "warning when none, or when measured on the CPU or another GPU; a "
                                                   "row faster than the GPU's peak x max_gemm_fraction is refused, one "
                                                   "under 1% of the shape model's rate or whose seconds and tflops "
                                                   "disagree warned"),
         schedule: Optional[str] = typer.Option(None, "--schedule", help="gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv or dualpipev, "
                                                                        "or torch.distributed.pipelining's name (1F1B, "
                                                                        "Interleaved1F1B, InterleavedZeroBubble = "
                                                                        "zb_h1 at one stage per rank, "
                                                                        "ZBVZeroBubble, ...; any case), as "
                                                                        "mesh.pp_schedule takes (zbv and dualpipev: "
                                                                        "virtual_stages 2, a V); it replaces the "
                                                                        "config's mesh.pp_schedule before the plan's "
                                                                        "rules (micro-batches, virtual stages, memory); "
                                                                        "at pp 1 a note says it changes nothing"),
         tokens: Optional[float] = typer.Option(None, "--tokens", help="tokens to train (15e12): a 'train time:' line, "
                                                "their days at the step's tokens/s and at meshplan reliability's "
                                                "goodput ([search] storage and restart; the job's checkpoint interval "
                                                "where the config gives it); --json train_time, seconds"),
         json_path: Optional[Path] = _json_option("step"),
         force: bool = typer.Option(False, "--force", help="replace existing --trace and --json files"),
         calibration: CalibrationOpt = None,
         kernels: KernelsOpt = None,
         topology: TopologyOpt = None,
         foreign: Foreign = Foreign()):
    """Scheduled rank timeline: step time and its parts on the critical stage (compute + bubble + exposed
    communication), critical path, exposed communication, bubble (FSDP waits apart under pp; a line under it gives the
    schedule alone simulated on uniform stages, idle/ideal and idle/total, up to 4,096 units; --json
    bubble_uniform_stages, and the closed form beside the bubble line, bubble_closed_form), MFU (under framework torch also
    'torchtitan's MFU formula: X%', what torchtitan's log would read: its FLOP per token (its dense formula, or
    get_moe_model_nparams_and_flops for an MoE or MLA model), tps and bf16 peak; --json torchtitan_mfu, null otherwise; under framework megatron, 'Megatron-LM's
    --log-throughput formula: X TFLOP/s/GPU', what its log's throughput per GPU would read; --json
    megatron_throughput_flops_per_s, null otherwise, and a 'megatron runtime:' line: the Megatron-LM generation the step
    models, 2022 (2755bcb; training.megatron_runtime unset) or core (d98e8a6), what the other differs in, the key, and
    what the config asks for that 2022 lacks (RoPE, SwiGLU, GQA, --overlap-grad-reduce, TE, fp8...); --json
    megatron_runtime); how much of the
    critical stage's bubble waits for communication another stage exposes (an MoE's ep all-to-alls behind a dense
    first stage); when the step is network-bound (exposed communication and that wait half the step or more), a
    verdict naming the communication and its cause; under that, where FSDP's re-gathers expose 15% of the step or
    more, a 'hint:' line with the verdict's knobs re-planned, those that fit with a step more than 1% shorter
    (meshplan.spec.search.TIE: a smaller gain is a tie, a judgement, not the model's measured error; so in every 'hint:');
    at 1 micro-batch per step reshard_after_forward = false alone (the other knobs do not apply), else a 'note: no fsdp
    hint' line saying why. Each 'hint:' line is in --json's hints too: stream, share of the step, each knob with its
    step (s) and peak (bytes). Where the pipeline's
    idle exceeds the closed form for uniform stages more than twice, the bubble line names the stage with the longest
    forward+backward per micro-batch, the output layer and loss or embedding it holds, and the knob for a lighter
    end stage. Under eager DTensor TP a 'host:' line gives the time the device waits for the host to issue
    the blocks (--json host_wait_s), and where that is 15% of the step or more a 'hint:' line the step
    re-planned with training.torch_compile = true. An 'SM contention:' line gives the compute time that is kernels
    slowed by the collectives they overlap, NVLink and network alike (their NCCL channels hold SMs; --json sm_contention_s): a
    --calibration of the link moves compute by its change only. Where the critical stage idles in the pipeline bubble 15% of the
    step or more, a 'hint:' line with the bubble's knobs re-planned (interleaved virtual stages 2 and 4, half the
    micro-batch, the zero-bubble schedules zb_h1, zbv and dualpipev under torch, pp / 2 with the data axis doubled),
    the fastest 3 that fit with a step more than 1% shorter, each with its step, its change and its bubble;
    when none helps, a 'note: no bubble hint' line naming each knob tried and why it was dropped (its peak
    where it does not fit, its step where it is not more than 1% shorter, refused or infeasible). Where exposed tp is 15% of the step or more without training.tp_comm_overlap, a
    'hint:' line with it re-planned as the framework runs it (torch: with torch_compile, which async TP needs),
    shown only when that step is more than 1% shorter, else a 'note: no tp hint' line with the re-plan's step and
    why; with it on, the mesh re-planned at tp / 2, tp / 4, ... (the data axis doubled), else a 'note: no tp hint'
    line naming what the overlap leaves exposed and each move's outcome (a foreign CONFIG's 'hint:' and 'fix:' lines name its own keys where it has them). Where the ep group spans
    nodes and its all-to-alls (exposed ep and the bubble's wait for it) cost the critical stage 15% of the step or
    more, a 'hint:' line with each smaller valid ep whose group fits a node (ep x etp dividing its GPUs; efsdp
    re-factored) re-planned, the fastest 3 that fit with a step more than 1% shorter, each with its mesh edit, step
    and peak; else a 'note: no ep hint' line saying why and pointing to search. Where a link (NVLink, a
    NIC, a rail uplink) is busy 80% of its window (the edge-load table's) or more, one line names it, the
    collectives that load it and, for FSDP's, the FSDP knobs re-planned (those that fit, more than 1% shorter);
    for ep's, it points to the ep line.
    Under --overlap-tp the verdict and 'hint:' lines are the config as written (TP blocking; a note says so): a
    hint's step is what step prints for the config with it set. The load on each NVLink, NIC and rail uplink is checked against stage 0's compute time
    (named in its header; a rail's uplinks are node 0's leaf's: what every node under it sends across the spine,
    the ring hops that leave its scalable unit or change rail, as place counts them, against its nodes x the NIC
    rate); where a NIC or uplink does not fit, a line 'where the NICs' traffic goes:' says, from
    the timeline, how much of it runs while no compute runs, how much of that is exposed and how much runs while
    the compute waits for another stream (blocking tp; with async TP re-planned). Where another stage's ranks send
    more (a MoE model's expert stages beside a dense stage 0), that stage's table follows, labelled, whether or not
    its links fit; --json's sent_bytes_per_step is that stage's (sent_bytes_stage). The collectives' readiness list
    gives each in the plan table's phase, a per-step row issued inside the last backward with '(issued in the
    last backward)' and, with pp > 1, a 'not listed:' line for the pp send/recv, counted in exposed pp. Each
    'concurrent:' line names two streams whose collectives run at once and what sharing NICs cost them in the
    timeline (ms per step their collectives ran longer: while several run on one NIC each runs at its max-min fair
    share of it, the earlier slowed by the later too; under torch FSDP2's reduce-scatters run on their own stream
    beside its all-gathers; --json nic_sharing_s), or 'nothing charged'. A mesh that does not fit exits 1
    with its reasons after one line 'step would be X s ... if it fit'. A line 'kernels: ...' names the kernel data
    the step was timed with (the catalog's, or --kernels files laid over it, and --gemm-table's file with how many of
    the plan's GEMM shapes it timed); with RoCEv2 NICs ([cluster] nic = { transport = "roce" }) a note: how they are
    timed (the node's InfiniBand curve read against their line rate, an assumption) and how to calibrate them."""

    if tokens is not None:
        check_number("--tokens", tokens, 1.0, 1e18, "tokens")
    schedule = _refuse_step_options(schedule, trace, json_path, force)
    p = _load(config, topology, calibration=calibration, fmt=foreign.fmt, opts=foreign.options(),
              kernels=kernels, schedule=schedule)  # the plan's rules judge --schedule's schedule
    refused = rule_error(p, schedule) if schedule is not None else None
    if refused is not None:
        raise refused
    cal = _calibration(calibration, p.config.cluster)
    kd = _kernels(p.config.cluster)
    if isinstance(p, Infeasible):
        _write_doc(json_path, {**_calibrated(envelope("step", p, step_s=None), cal), "kernels": kd}, force)
        _exit_infeasible(p)
    table = load_gemm_table(gemm_table) if gemm_table else None
    ops = plan_ops(p, table) if table is not None or p.config.cluster.gpu.kernels else []
    use = table_use(ops, table, p.config.cluster.gpu) if table is not None else None
    kd = _kernels(p.config.cluster, gemm_shapes(ops)) if ops else kd  # a kernels file's points against them
    kd = _with_table(kd, use, p.config.cluster.gpu)
    unscheduled = schedule if schedule is not None and p.mesh.degree("pp") == 1 else None
    schedule = None if unscheduled else schedule  # pp 1: nothing to schedule (as --overlap-tp at tp 1)
    ideal_tp = overlap_tp and not p.config.training.tp_comm_overlap  # with it on, the config's model runs alone
    st = _step_with(p, _overlap(ideal_tp, no_prefetch), table, schedule)
    if not p.feasible:
        _exit_would_be(p, st, json_path, {**_calibrated(step_infeasible_doc(p, st), cal), "kernels": kd}, force)
    for line in st.lines():
        _echo(line)
    _echo(mfu_caveat())  # once, under the MFU line: predicted, with the measured error by setting
    if (mg := runtime_followed(p.config.model, p.config.training)) is not None:
        _echo(mg["line"])  # the Megatron-LM generation the step models
    days = _train_time(p, st, tokens)
    for line in plan_warnings(p):  # tight, and the measured-error setting it lies in (as plan and its page)
        _echo(line)
    _echo_balance(p)
    # the config as written (TP blocking): --overlap-tp's whole-GEMM overlap is no setting a hint could give
    ideal_differs = ideal_tp and p.mesh.degree("tp") > 1
    written = _step_with(p, _overlap(False, no_prefetch), table, schedule) if ideal_differs else st
    _print_overlap_notes(p, st, overlap_tp, no_prefetch, table, schedule, unscheduled, written)
    _echo_kernels(p, kd, use)

    # re-plans take their schedule from their config (--schedule is in p's already), so a knob may change it;
    # each is stepped as `step` steps the config with the knob set (no --overlap-tp: a hint is a setting)
    again = rebuilt_step(p, lambda alt: _step_with(alt, _overlap(False, no_prefetch), table, None))
    bw = bubble_wait(st)  # once: the verdict's lines and the JSON's most_exposed_stage both use it
    verdict = _written_verdict(p, st, written, again, bw)
    for line in verdict:  # a hint's settings in a foreign file's own keys
        _echo(_in_file(p, line) if line.startswith("hint:") else line)
    _echo_critical_path(st)
    print_links(p, st, lambda alt: _step_with(alt, _overlap(ideal_tp, no_prefetch), table, None))
    if trace:
        _wrote(st.write_trace(trace, force=force))
    doc = _calibrated(step_doc(p, st, verdict, str(trace) if trace else None, bw=bw), cal)
    _write_doc(json_path, {**doc, "kernels": kd, "train_time": days.fields() if days else None}, force)


def _train_time(p, st, tokens: Optional[float]):
    """--tokens' :class:`~meshplan.reliability.TrainTime` at ``st``'s tokens/s, its line printed
    (None without --tokens)."""
    if tokens is None:
        return None
    days = train_time(tokens, st.tokens_per_s, configured_reliability(p, job_interval(p.config, st.step_s)))
    _echo(days.line(p.config.search.goodput_inputs()))
    return days


def _refuse_step_options(schedule: Optional[str], trace: Optional[Path], json_path: Optional[Path],
                         force: bool) -> Optional[str]:
    """--schedule in its canonical spelling (a one-line error for an unknown one), after refusing
    an unwritable --trace and an existing --json before the planning."""
    if schedule is not None:
        try:
            schedule = str(parse_schedule(schedule))
        except ValueError as e:
            raise ConfigError("--schedule", str(e)) from None
    if trace:
        check_destination(trace, "--trace", force)
    _refuse_existing(json_path, force, "--json")
    return schedule


def _exit_would_be(p, st, json_path: Optional[Path], doc: dict, force: bool) -> None:
    """A mesh that does not fit: the step it would take, labelled so, its --json ``doc``, exit 1."""
    sched = schedule_words(st.pipeline.spec.schedule, st.pipeline.spec.p)  # "no pipeline" at pp 1
    _echo(f"step would be {st.step_s:.3f} s ({sched}, MFU {st.mfu:.1%}) if it fit; "
               f"it does not fit")
    _echo(mfu_caveat())
    _echo_balance(p)
    _write_doc(json_path, doc, force)
    _infeasible(p)  # plan's verdict lines: the reasons, then the knobs that bring the peak under (nc50 #10)
    fix = memory_fix(p, keymap_of(p.config))
    if fix:
        _echo(fix, err=True)
    raise typer.Exit(1)


def _echo_kernels(p, kd: dict, use) -> None:
    """The uncalibrated-link and RoCE notes, the kernels' line and a --gemm-table's line and warnings."""
    for note in (uncalibrated_note(p.config.cluster), roce_note(p.config.cluster)):
        if note:
            _echo(note)
    _echo(kd["line"])
    if use is not None:
        _echo(kd["gemm_table"]["line"])
        for w in kd["gemm_table"]["warnings"]:
            _echo(f"warning: {w}", err=True)


def _written_verdict(p, st, written, again, bw) -> list[str]:
    """The verdict and hint lines of the config as written (``written``; ``bw``: ``st``'s bubble
    wait), headed by a note where --overlap-tp's step ``st`` is another."""
    verdict = _verdict(p, written, again, bubble_wait(written) if written is not st else bw)
    if verdict and written is not st:
        verdict = [f"note: the verdict and hint lines below are the config as written, TP blocking (step "
                   f"{written.shown_ms()['step']} ms), not --overlap-tp's whole-GEMM overlap: a hint's step is what "
                   f"step prints for the config with it set"] + verdict
    return verdict


def _echo_critical_path(st) -> None:
    """The critical path's entries, the first 12 and last 6 of a longer one."""
    path = st.critical_path()
    _echo(f"critical path ({len(path)} entries{', first 12 and last 6' if len(path) > 18 else ''}):")
    for line in (path if len(path) <= 18 else path[:12] + ["..."] + path[-6:]):
        _echo(f"  {line}")


def _echo_balance(p) -> None:
    """An MoE plan's routing assumption and the key that changes it, once (:func:`balance_note`)."""
    if (note := balance_note(p.config.model, p.config.training)) is not None:
        _echo(f"note: {note}")


def _verdict(p, st, again, bw) -> list[str]:
    """The verdict and ``hint:`` lines of ``st``, the step of ``p`` as written, ``again`` its
    re-plans (:func:`rebuilt_step`); the link line points to the FSDP knobs where an earlier line
    re-planned them (the FSDP hint or the verdict's cause), and to the ep line where there is one."""
    net = network_verdict(p, st, again, bw=bw)
    listed = any(line.startswith(("cause:", "hint: exposed")) for line in net)
    ep = ep_hint(p, st, again, bw)
    reshard = reshard_default_note(p)
    lines = ([reshard] if reshard else []) + (net + host_hint(p, st, again) + bubble_hint(p, st, again) + tp_hint(p, st, again) + cp_hint(p, st, again) + ep
             + link_bound_hint(p, st, again, knobs_listed=listed, ep_listed=bool(ep)))
    caveat = routing_caveat(p)
    if caveat is None:
        return lines
    at = next((i + 1 for i, x in enumerate(lines) if "most on ep" in x or x.startswith("hint: ep ")), len(lines))
    return lines[:at] + [caveat] + lines[at:]


def _print_overlap_notes(p, st, overlap_tp: bool, no_prefetch: bool, table, schedule: Optional[str],
                         unscheduled: Optional[str], blocking) -> None:
    """The lines under step's summary: the TP overlap line (the config's model against blocking TP,
    or with ``--overlap-tp`` the whole-GEMM overlap against ``blocking``, the step with TP
    blocking), Megatron's gradient-reduce note, and a note for each of ``--schedule`` and
    ``--overlap-tp`` that changes nothing or is ignored."""
    tp = tp_overlap_line(p, st, lambda alt: _step_with(alt, _overlap(False, no_prefetch), table, schedule))
    if overlap_tp and not tp:
        tp = ideal_tp_overlap_line(p, st, blocking)
    if tp:
        _echo(tp)
    if megatron_reduce_line(p.config.training, p.vpp):
        _echo(megatron_reduce_line(p.config.training, p.vpp))
    if not no_prefetch and (ds := deepspeed_prefetch_line(p.config, p.stage(0).collectives)):
        _echo(ds)
    if unscheduled:
        _echo(f"note: --schedule {unscheduled} changes nothing: pp 1 has no pipeline to schedule")
    if overlap_tp and p.mesh.degree("tp") < 2:
        _echo("note: --overlap-tp changes nothing: tp 1 has no TP collectives")
    elif overlap_tp and p.config.training.tp_comm_overlap:
        _echo("note: --overlap-tp ignored: training.tp_comm_overlap is on, and the config's model of it (the line "
              "above) is what the step runs; --overlap-tp (whole-GEMM overlap) applies with it off")


def _with_table(kd: dict, use, gpu) -> dict:
    """The ``kernels`` entry with ``--gemm-table``'s use: its line names the table and how many
    of the plan's GEMM shapes it timed, and ``gemm_table`` holds the counts
    (:func:`meshplan.compute.table_use.as_json`); ``kd`` itself without a table."""
    if use is None:
        return kd
    line = f"{kd['line']}; GEMMs first from --gemm-table {use.path} ({use.matched} of {len(use.gemm_shapes)} shapes)"
    return {**kd, "line": line, "gemm_table": table_json(use, gpu)}


def _step_with(p, overlap, table, schedule: Optional[str]):
    """``step_time`` of ``p``; with ``--schedule`` given, the schedule's own refusal (ZB-V
    without virtual_stages 2, interleaved 1F1B with m not a multiple of p, a chunked mesh
    under a one-chunk schedule) names ``--schedule``, the value that brought it."""
    try:
        return step_time(p, overlap, table=table, schedule=schedule)
    except ConfigError as e:
        if schedule is None or e.field not in ("mesh.pp_schedule", "mesh.virtual_stages"):
            raise
        raise (refusal(schedule, len(p.stages), p.micro_batches, p.vpp, p.config.training, p.config.model.layers,
                       layer_split(p.config)) or renamed(e, schedule)) from None
