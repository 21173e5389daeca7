"""``--json`` documents of the commands other than ``plan`` (:mod:`.json_out`) and ``search``
(:mod:`.search`); ``compare``'s is :func:`meshplan.compare.compare_to_dict`.

Each document names its schema (``"schema": "meshplan.<command>/v1"``), whose JSON Schema
file ships as package data in ``meshplan/schemas/<command>.v1.schema.json`` (read with
:func:`schema_of`). SI units, named in the keys (``_s``, ``_bytes``, ``_bytes_per_s``);
traffic is bytes one rank sends per step (``sent_bytes_per_step``). Infinity and NaN,
which JSON lacks, become null (:func:`to_json`).

>>> to_json({"schema": "meshplan.x/v1", "t_s": float("inf"), "n": [1, 2.5]})
'{\\n "n": [\\n  1,\\n  2.5\\n ],\\n "schema": "meshplan.x/v1",\\n "t_s": null\\n}\\n'
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any, Optional, Sequence

from meshplan import __version__
from meshplan.compute.megatron_core import runtime_followed
from meshplan.mesh.tpsplit import model_groups
from meshplan.placement.score import weights_from_table
from meshplan.plan import Infeasible, Plan
from meshplan.report.json_out import plain_data, timeline_summary
from meshplan.report.plan_warnings import plan_warnings
from meshplan.schedule.link_spill import other_stage_loads
from meshplan.schedule.hint_facts import hint_docs
from meshplan.schedule.linkload import concurrency, edge_loads
from meshplan.schedule.readiness import step_rows, timings
from meshplan.schedule.nic_sharing import nic_waits
from meshplan.schedule.stage_balance import closed_form, uniform_bubble
from meshplan.schedule.stage_traffic import traffic_stage
from meshplan.schedule.timing_rows import timing_rows
from meshplan.schedule.waits import BubbleWait

#: Commands with a ``--json`` document, each with its schema file (a group's commands as
#: ``<group>-<command>``: ``bench-gemm``, ``testbed-up``).
COMMANDS = ("plan", "search", "groups", "memory", "step", "reliability", "compare", "place", "nccl-check", "catalog",
            "calibrate", "report", "validate", "validate-slice", "testbed-up", "testbed-down", "bench-gemm",
            "bench-attention", "bench-comm", "bench-rank", "import", "export", "launch")


def schema_name(command: str) -> str:
    """``meshplan.<command>/v1`` (plan and search keep their historical names)."""
    return {"plan": "meshplan.plan/v1", "search": "meshplan.search.driver/v1"}.get(command, f"meshplan.{command}/v1")


def schema_of(command: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``command``'s ``--json`` document."""
    text = resources.files("meshplan").joinpath("schemas", f"{command}.v1.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def to_json(doc: dict[str, Any]) -> str:
    """Indented, key-sorted JSON text; non-finite floats as null."""
    return json.dumps(_finite(plain_data(doc)), indent=1, sort_keys=True, allow_nan=False) + "\n"


def envelope(command: str, plan: Optional[Plan | Infeasible] = None, **fields: Any) -> dict[str, Any]:
    """The keys every document has: ``schema``, ``meshplan_version``, and for a command that
    resolves a mesh ``config`` (its path), ``feasible`` and ``reasons`` (the verdict)."""
    out: dict[str, Any] = {"schema": schema_name(command), "meshplan_version": __version__}
    if plan is not None:
        out.update(config=plan.config.path, feasible=plan.feasible, reasons=list(plan.reasons))
    out.update(fields)
    return out


def groups_doc(plan: Plan | Infeasible, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s coordinates and its group on every axis; every axis's groups; each axis's
    row-major stride (rank = sum of coordinate x stride, :attr:`meshplan.mesh.layout.Layout.strides`)."""
    mesh = plan.mesh
    if mesh is None:
        return envelope("groups", plan, rank=rank, names=[], shape=[], strides={}, coordinates={}, group_of_rank={},
                        groups={})
    coords = mesh.layout.coords_of(rank)
    extra = model_groups(mesh, plan.config.model, plan.config.training.framework)  # kv_replica (tp > kv_heads)
    mine = {a: [int(r) for r in g[(g == rank).any(axis=1)][0]] for a, g in extra.items()}
    return envelope("groups", plan, rank=rank, names=list(mesh.layout.names), shape=list(mesh.layout.shape),
                    strides={n: int(s) for n, s in zip(mesh.layout.names, mesh.layout.strides)},
                    coordinates={n: int(c) for n, c in zip(mesh.layout.names, coords)},
                    group_of_rank={**{a: [int(r) for r in mesh.group_of(rank, a)] for a in mesh.all_axes()}, **mine},
                    groups={**{a: mesh.groups(a).tolist() for a in mesh.all_axes()},
                            **{a: g.tolist() for a, g in extra.items()}})


def memory_doc(plan: Plan, all_stages: bool, pngs: Sequence[str]) -> dict[str, Any]:
    """The memory timeline summary of each stage shown (most loaded, or all), with the
    persistent state per stage and the PNG files written."""
    shown = plan.timelines if all_stages else (plan.timeline,)
    return envelope("memory", plan, stages=[timeline_summary(tl) | {"allocator": _allocator(tl)} for tl in shown],
                    persistent_bytes={str(s.stage): s.total_bytes for s in plan.state}, pngs=list(pngs))


def _allocator(tl) -> dict[str, Any]:
    """The caching allocator's simulated bytes of one stage (:func:`meshplan.report.memory.reserved_line`)."""
    r = tl.reserved_memory()
    s = r.stats
    return {"reserved_peak_bytes": s.reserved_peak_bytes, "allocated_peak_bytes": s.allocated_peak_bytes,
            "reserved_unallocated_bytes": s.cached_at_peak_bytes, "fragmentation": r.fragmentation,
            "segments": s.segments, "communication_buffer_bytes": r.untracked_bytes, "device_bytes": r.device_bytes,
            "expandable_segments": r.config.expandable_segments, "in_verdict": tl.reserved is not None}


def step_doc(plan: Plan, st, verdict: Sequence[str], trace: Optional[str], *,
             bw: Optional[BubbleWait]) -> dict[str, Any]:
    """The predicted step: time, schedule (null at pp 1), bubble, exposure, the step's parts on the critical
    stage (``step_parts_s``: StepTime.parts_s and the step, as the search's), MFU (and ``torchtitan_mfu``, the
    MFU torchtitan's own formula logs: StepTime.torchtitan_mfu, its dense or MoE formula, null off framework
    torch; ``megatron_throughput_flops_per_s``, what Megatron-LM's --log-throughput logs per GPU, FLOP/s:
    StepTime.megatron_throughput, null off framework megatron; ``megatron_runtime``, the generation it models,
    :func:`meshplan.compute.megatron_core.runtime_followed`), critical path, readiness of
    each collective, concurrency and what sharing NICs cost each stream (``nic_sharing_s``:
    :func:`meshplan.schedule.nic_sharing.nic_waits`, stage 0), load per physical link, bytes each rank sends per step by axis on
    the stage whose ranks send the most (``sent_bytes_stage``,
    :func:`meshplan.schedule.stage_traffic.traffic_stage`: not a MoE model's dense stage 0), the
    network verdict, the ``warnings`` the text prints beside it (:func:`meshplan.report.plan_warnings.plan_warnings`:
    tight, retry, the measured-error setting's note; newcomer trial 51). ``bw``: :func:`meshplan.schedule.waits.bubble_wait`
    of ``st``, as the verdict lines were made with it (computed once by the caller)."""
    p = st.pipeline
    return envelope("step", plan, step_s=st.step_s, schedule=_schedule(st), stages=p.spec.p,
                    micro_batches=p.spec.m, virtual_stages=p.spec.v, critical_stage=st.critical_stage,
                    stage_end_s=list(st.stage_end_s), bubble_idle_over_ideal=p.bubble,
                    bubble_idle_over_total=p.bubble_of_total, **_bubbles(p.spec), exposed_s=dict(st.exposed_s),
                    step_parts_s={"step": st.step_s, **st.parts_s()}, host_wait_s=st.host_wait_s(),
                    sm_contention_s=st.contention_s(),
                    most_exposed_stage=_most_exposed(st, bw), mfu=st.mfu, hfu=st.hfu, torchtitan_mfu=st.torchtitan_mfu,
                    megatron_throughput_flops_per_s=st.megatron_throughput,
                    megatron_runtime=runtime_followed(plan.config.model, plan.config.training),
                    tokens_per_s=st.tokens_per_s, critical_path=st.critical_path(),
                    collectives=[_timing(t, step_rows(plan, t), timing_rows(plan, t)) for t in timings(st)],
                    concurrency_s=[{"streams": list(k), "seconds": v} for k, v in sorted(concurrency(st).items())],
                    nic_sharing_s=[{"stream": a, "beside": b, "seconds": v} for (a, b), v in sorted(nic_waits(st).items())],
                    links=[_link(e) for e in edge_loads(plan, st)], other_stage_links=_other_links(plan, st),
                    sent_bytes_per_step=weights_from_table(plan.stage(traffic_stage(plan)).collectives),
                    sent_bytes_stage=traffic_stage(plan),
                    verdict=list(verdict), hints=hint_docs(verdict), notes=list(st.notes), warnings=plan_warnings(plan),
                    trace=trace)


def _bubbles(spec) -> dict[str, Optional[dict[str, float]]]:
    """The two bubble lines step's text prints under the simulated one, each under both
    definitions (``idle_over_ideal`` x, ``idle_over_total`` x / (1 + x)): ``bubble_closed_form``,
    the schedule's closed form for uniform stages (:func:`~meshplan.schedule.stage_balance.closed_form`),
    and ``bubble_uniform_stages``, the schedule alone simulated on uniform stages
    (:func:`~meshplan.schedule.stage_balance.uniform_bubble`); each null where the text has no line.

    >>> from meshplan.pipeline.simulate import PipelineSpec
    >>> _bubbles(PipelineSpec("1f1b", p=4, m=8))["bubble_closed_form"]
    {'idle_over_ideal': 0.375, 'idle_over_total': 0.2727272727272727}
    """
    x, uniform = closed_form(spec), uniform_bubble(spec)
    pair = None if x is None else (x, x / (1 + x))
    return {name: None if v is None else {"idle_over_ideal": v[0], "idle_over_total": v[1]}
            for name, v in (("bubble_closed_form", pair), ("bubble_uniform_stages", uniform))}


def _schedule(st) -> Optional[str]:
    """The pipeline schedule's name, None at pp 1 (no pipeline to schedule: the text says
    ``no pipeline``, :func:`meshplan.spec.mesh_words.schedule_words`)."""
    spec = st.pipeline.spec
    return None if spec.p == 1 else str(spec.schedule)


def _timing(t, rows: str = "", plan_rows: Sequence = ()) -> dict[str, Any]:
    """One readiness row (:class:`~meshplan.schedule.readiness.Timing`) with its slack; ``calls``
    only where the event merges several of the table's calls; ``issued`` only where a per-step row goes
    out inside the last backward or after it; ``rows`` only on a ``step`` row: the cadences of the plan
    rows it stands for (:func:`~meshplan.schedule.readiness.step_rows`); ``plan_rows``: those rows
    (:func:`~meshplan.schedule.timing_rows.timing_rows`) with the keys ``plan --json`` gives them (axis,
    cadence, size_bytes, group_size, busbw_bytes_per_s, time_s: one call each)."""
    doc = dict(plain_data(t), slack_s=t.slack_s)
    if not doc["issued"]:
        del doc["issued"]
    if doc["calls"] == 1.0:  # only where one event stands for several calls (Timing.calls)
        del doc["calls"]
    doc["plan_rows"] = [{"axis": r.axis, "cadence": r.cadence, "size_bytes": r.size_bytes, "group_size": r.group_size,
                         "busbw_bytes_per_s": r.busbw_bytes_per_s, "time_s": r.time_s} for r in plan_rows]
    return {**doc, "rows": rows} if rows else doc


def _link(e) -> dict[str, Any]:
    """One edge-load row (:class:`~meshplan.schedule.linkload.EdgeLoad`)."""
    return {"edge": e.edge, "bytes_per_step": e.bytes_per_step, "capacity_bytes_per_s": e.capacity_bytes_per_s,
            "busy_s": e.busy_s, "interval_s": e.interval_s, "per_layer_bytes": e.per_layer_bytes,
            "layer_interval_s": e.layer_interval_s, "fits": e.fits}


def _other_links(plan: Plan, st) -> Optional[dict[str, Any]]:
    """The second edge-load table step prints (:func:`meshplan.schedule.link_spill.other_stage_loads`:
    the stage whose ranks send the most, :mod:`meshplan.schedule.stage_traffic`): its stage and
    rows; null where stage 0's links are loaded most (``links`` is stage 0's)."""
    other = other_stage_loads(plan, st)
    return None if other is None else {"stage": other[0], "links": [_link(e) for e in other[1]]}


def _most_exposed(st, bw: Optional[BubbleWait]) -> Optional[dict[str, Any]]:
    """:meth:`StepTime.most_exposed_stage` and what the critical stage's bubble waits for
    (``bw``, :func:`meshplan.schedule.waits.bubble_wait` of ``st``: ``bubble_wait``, null when it
    exposes only pp)."""
    most = st.most_exposed_stage()
    if most is None:
        return None
    wait = None if bw is None else {"stream": bw.stream, "stages": list(bw.stages), "bubble_s": bw.bubble_s,
                                    "wait_s": bw.wait_s, "bare_bubble_s": bw.bare_bubble_s}
    return {"stage": most[0], "exposed_s": dict(most[1]), "bubble_wait": wait}


def step_infeasible_doc(plan: Plan, st) -> dict[str, Any]:
    """A mesh that does not fit: the step it would take (``would_be``), nothing else."""
    return envelope("step", plan, step_s=None, would_be_step_s=st.step_s, schedule=_schedule(st),
                    mfu=None, would_be_mfu=st.mfu)


def reliability_doc(plan: Plan, r, restart) -> dict[str, Any]:
    """The reliability account and the restart on fewer nodes; ``job_interval`` only where the
    config gives the job's checkpoint interval."""
    return envelope("reliability", plan, gpus=r.gpus, rate_per_gpu_day=r.rate_per_gpu_day, mtbf_s=r.mtbf_s,
                    failure_domains=plain_data(r.domains), checkpoint=plain_data(r.checkpoint), write_s=r.write_s,
                    read_s=r.read_s, restart_overhead_s=r.restart_overhead_s, restart_s=r.restart_s,
                    interval_s=r.interval_s, goodput=r.goodput, restart=plain_data(restart),
                    **({"job_interval": r.job_fields()} if r.job else {}))


def place_doc(plan: Plan | Infeasible, choice, bindings: Sequence[dict]) -> dict[str, Any]:
    """The placement: rank -> GPU, weights (bytes each rank sends per step by axis), the
    weak-path score before and after, decisions, warnings, the bindings of the ranks shown."""
    return envelope("place", plan, **choice_fields(choice), bindings=[plain_data(b) for b in bindings])


def choice_fields(c) -> dict[str, Any]:
    """A placement choice as ``place --json`` holds it (``launch --json`` too): rank -> GPU,
    weights (bytes each rank sends per step by axis), the weak-path score before and after,
    the predicted steps (s; null unsearched), decisions (the last one is the choice's line)
    and warnings."""
    def score(s) -> dict[str, Any]:
        return {"total_bytes": s.total, "network_bytes": s.network_bytes, "spine_bytes": s.spine_bytes,
                "socket_bytes": s.socket_bytes}

    return dict(rank_to_gpu=[int(x) for x in c.rank_to_gpu], weights=dict(c.weights),
                weights_unit="sent_bytes_per_step" if c.weights_source != "default" else "relative",
                weights_source=c.weights_source, changed=bool(c.changed), searched=bool(c.searched),
                before=score(c.before), after=score(c.after), step_before_s=c.step_before_s,
                step_after_s=c.step_after_s, decisions=list(c.decisions), warnings=list(c.warnings))


def nccl_check_doc(plan: Plan | Infeasible, log: str, differences: Sequence[str],
                   cannot_check: Sequence[str] = ()) -> dict[str, Any]:
    """``cannot_check``: one line per communicator whose lines could not be attributed to it
    (:class:`meshplan.comm.nccl_check.NcclCheck`); ``matched`` is false when there is one."""
    return envelope("nccl-check", plan, log=log, differences=list(differences), cannot_check=list(cannot_check),
                    matched=not differences and not cannot_check)


def catalog_doc(kind: str, entries: dict[str, dict]) -> dict[str, Any]:
    return envelope("catalog", kind=kind, entries=entries)


def calibrate_doc(fits, notes: Sequence[str], source: str, out: str, runs: Sequence[dict] = ()) -> dict[str, Any]:
    """``calibrate``: the fit each link class kept, the notes, and ``runs``: every file read, kept,
    dropped or not used, as fields (:func:`meshplan.comm.calibrate_table.run_table`)."""
    return envelope("calibrate", fits=[plain_data(f) for f in fits], notes=list(notes), source=source, out=out,
                    runs=list(runs))


def files_doc(files: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    """Files a command wrote: ``[{"path", "size_bytes"}]``, in the order written."""
    return [{"path": p, "size_bytes": int(n)} for p, n in files]


def report_doc(plan: Plan | Infeasible, files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``report``: the verdict and the HTML page written."""
    return envelope("report", plan, files=files_doc(files))


def _pvm(rows: Sequence[dict], quantity: str) -> Optional[dict[str, Any]]:
    """The ``predicted_vs_measured`` row of ``quantity`` as ``{predicted, measured, error}``."""
    row = next((r for r in rows if r.get("quantity") == quantity), None)
    return None if row is None else {k: row.get(k) for k in ("predicted", "measured", "error")}


def validate_doc(config: str, code: int, results: Sequence[dict], evidence: str, node_rank: int,
                 not_exercised: Sequence[str] = ()) -> dict[str, Any]:
    """``validate``: the verdict (``ok``, ``exit_code``), ``not_exercised`` (the lines of the
    config's axes no world ran at degree > 1, :mod:`meshplan.runtime.validation.coverage`), per
    world its stage reached, message, the world's own ``not_exercised`` lines,
    errors (the gated differences of the comparison, or the failure message), step time and
    peak memory predicted against measured (seconds, bytes; ``error`` = measured / predicted
    - 1), whether its measured times are ``reliable`` (the host's load, as its comparison.json's
    ``host``: :func:`meshplan.runtime.validation.host.state`; null where the world never ran) and
    ``unreliable_because`` (newcomer trial 54 #10: only comparison.json carried it), and the
    evidence folder (``summary`` only on node 0, which writes it)."""
    worlds = []
    for r in results:
        comp = r.get("comparison") or {}
        rows = comp.get("predicted_vs_measured", [])
        errors = list(comp["differences"]) if "differences" in comp else ([] if r.get("ok") else [r.get("message", "")])
        worlds.append({"world": r["world"], "ok": bool(r.get("ok")), "stage": r.get("stage"),
                       "message": r.get("message", ""), "errors": errors,
                       "not_exercised": [g["line"] for g in r.get("not_exercised", [])], "step_s": _pvm(rows, "step time"),
                       "peak_memory_bytes": _pvm(rows, "peak memory"), "folder": f"{evidence}/world{r['world']}",
                       "reliable": r["host"].get("reliable") if r.get("host") else None,
                       "unreliable_because": list(r["host"].get("why", [])) if r.get("host") else []})
    return envelope("validate", config=config, ok=code == 0, exit_code=code, node_rank=node_rank, evidence=evidence,
                    summary=f"{evidence}/summary.md" if node_rank == 0 else None, not_exercised=list(not_exercised),
                    worlds=worlds)


def validate_slice_doc(evidence_doc: dict[str, Any], code: int, evidence: str) -> dict[str, Any]:
    """``validate-slice``: the order verdict, the chosen mesh and each mesh's predicted and
    measured step (seconds; rank 1 = fastest), its role and why, and its own plan at full scale
    (feasible, peak and usable bytes per rank, verdict line) and the axes whose groups cross nodes in
    the slice and not at full scale (``slice_only_crossing``), from the evidence folder's ``slice.json``."""
    keep = ("name", "config", "ran", "message", "predicted_s", "measured_s", "error", "predicted_rank",
            "measured_rank", "collectives_match", "micro_batches", "folder", "role", "why", "full_feasible",
            "full_peak_bytes", "full_usable_bytes", "full_verdict", "slice_only_crossing")
    return envelope("validate-slice", ok=code == 0, exit_code=code, testbed=evidence_doc["testbed"],
                    order_matches=evidence_doc["order_matches"], verdict=evidence_doc["verdict"],
                    chosen=evidence_doc["chosen"], global_batch=evidence_doc["global_batch"],
                    meshes=[{k: m.get(k) for k in keep} for m in evidence_doc["meshes"]], evidence=evidence,
                    summary=f"{evidence}/summary.md")


def testbed_up_doc(tb) -> dict[str, Any]:
    """``testbed up``: the testbed made (a :class:`~meshplan.runtime.testbed.netns.Testbed`):
    each node's namespace and NIC addresses, the rate limit (bits/s) and its burst (bytes)."""
    return envelope("testbed-up", prefix=tb.prefix, nodes=[{"namespace": tb.node_ns(i), "nics": [
        {"ifname": tb.ifname(k), "address": tb.addr(i, k)} for k in range(tb.nics_per_node)]} for i in range(tb.nodes)],
        fabric_namespace=tb.fabric_ns, rate_bits_per_s=tb.rate_mbit * 1e6, burst_bytes=tb.burst_bytes,
        state=tb.state_path)


def testbed_down_doc(prefix: str, removed: Sequence[str]) -> dict[str, Any]:
    """``testbed down``: the namespaces removed."""
    return envelope("testbed-down", prefix=prefix, removed=list(removed))


def bench_gemm_doc(plan: Plan | Infeasible, rows, device: str, dtype: str,
                   files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``bench gemm``: each local GEMM shape timed (seconds per call; ``scaled_m``, the M run
    when scaled down, the time scaled back) and the table written."""
    return envelope("bench-gemm", plan, device=device, dtype=dtype, files=files_doc(files),
                    rows=[{"m": r.gemm.m, "n": r.gemm.n, "k": r.gemm.k, "dtype": r.dtype, "seconds": r.seconds,
                           "flops_per_s": r.tflops * 1e12, "device": r.device, "scaled_m": r.scaled_m} for r in rows])


def bench_attention_doc(plan: Plan | Infeasible, row: Optional[dict],
                        files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``bench attention``: the local attention's shape and its forward and backward seconds
    (null for a mesh that does not resolve)."""
    return envelope("bench-attention", plan, attention=None if row is None else dict(row), files=files_doc(files))


def bench_rank_doc(evidence: dict, files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``bench rank``: one rank of the mesh run on this device, its per-layer times and peak
    memory against the plan's (:func:`meshplan.runtime.validation.one_rank.run`'s evidence)."""
    return envelope("bench-rank", config=evidence.get("config"), evidence=evidence, files=files_doc(files))


def bench_comm_doc(nproc: int, sizes: Sequence[int], testbed: Optional[str], fits,
                   files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``bench comm``: the all-reduce alpha-beta fits per link class and the files written."""
    return envelope("bench-comm", nproc=nproc, sizes_bytes=list(sizes), testbed=testbed,
                    fits=[plain_data(f) for f in fits], files=files_doc(files))


def import_doc(fmt: str, source: str, imp, toml: str, files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``import``: the format read, the fields meshplan does not use, the notes and the
    meshplan TOML (its text, and the file when written)."""
    return envelope("import", format=fmt, source=source, unused=list(imp.unused), notes=list(imp.all_notes()),
                    toml=toml, files=files_doc(files))


def export_doc(config: str, to: str, header: Sequence[str], files: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """``export``: the target format, what it does not express (``not expressed in <to>: ...``
    lines of the header) and the file written."""
    pre = f"not expressed in {to}: "
    return envelope("export", config=config, to=to, header=list(header),
                    not_expressed=[h[len(pre):] for h in header if h.startswith(pre)], files=files_doc(files))


def launch_doc(plan: Plan | Infeasible, nodes: int, files: Sequence[tuple[str, int]], run: str,
               choice=None) -> dict[str, Any]:
    """``launch``: the files written (scripts and bindings), the node count, how to run them,
    and the placement bound (:func:`choice_fields`: the choice and the warnings launch prints;
    absent when the mesh does not fit and nothing is placed)."""
    fields = choice_fields(choice) if choice is not None else {}
    return envelope("launch", plan, nodes=nodes, files=files_doc(files), run=run, **fields)
