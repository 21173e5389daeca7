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
from meshplan.placement.choice import weights_from_table
from meshplan.plan import Infeasible, Plan
from meshplan.report.json_out import _plain, _timeline
from meshplan.schedule.linkload import concurrency, edge_loads, timings

#: Commands with a ``--json`` document, each with its schema file.
COMMANDS = ("plan", "search", "groups", "memory", "step", "reliability", "compare", "place", "nccl-check", "catalog",
            "calibrate")


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
    return json.dumps(_finite(_plain(doc)), indent=1, sort_keys=True, allow_nan=False) + "\n"


def envelope(command: str, plan: Optional[Plan | Infeasible] = None, **fields: Any) -> dict[str, Any]:
    """The keys every document has: ``schema``, ``meshplan_version``, and for a command that
    resolves a mesh ``config`` (its path), ``feasible`` and ``reasons`` (the verdict)."""
    out: dict[str, Any] = {"schema": schema_name(command), "meshplan_version": __version__}
    if plan is not None:
        out.update(config=plan.config.path, feasible=plan.feasible, reasons=list(plan.reasons))
    out.update(fields)
    return out


def groups_doc(plan: Plan | Infeasible, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s coordinates and its group on every axis; every axis's groups."""
    mesh = plan.mesh
    if mesh is None:
        return envelope("groups", plan, rank=rank, names=[], shape=[], coordinates={}, group_of_rank={}, groups={})
    coords = mesh.layout.coords_of(rank)
    return envelope("groups", plan, rank=rank, names=list(mesh.layout.names), shape=list(mesh.layout.shape),
                    coordinates={n: int(c) for n, c in zip(mesh.layout.names, coords)},
                    group_of_rank={a: [int(r) for r in mesh.group_of(rank, a)] for a in mesh.all_axes()},
                    groups={a: mesh.groups(a).tolist() for a in mesh.all_axes()})


def memory_doc(plan: Plan, all_stages: bool, pngs: Sequence[str]) -> dict[str, Any]:
    """The memory timeline summary of each stage shown (most loaded, or all), with the
    persistent state per stage and the PNG files written."""
    shown = plan.timelines if all_stages else (plan.timeline,)
    return envelope("memory", plan, stages=[_timeline(tl) for tl in shown],
                    persistent_bytes={str(s.stage): s.total_bytes for s in plan.state}, pngs=list(pngs))


def step_doc(plan: Plan, st, verdict: Sequence[str], trace: Optional[str]) -> dict[str, Any]:
    """The predicted step: time, schedule, bubble, exposure, MFU, critical path, readiness of
    each collective, concurrency, load per physical link, bytes each rank of the critical
    stage sends per step by axis, the network verdict."""
    p = st.pipeline
    return envelope("step", plan, step_s=st.step_s, schedule=str(p.spec.schedule), stages=p.spec.p,
                    micro_batches=p.spec.m, virtual_stages=p.spec.v, critical_stage=st.critical_stage,
                    stage_end_s=list(st.stage_end_s), bubble_idle_over_ideal=p.bubble,
                    bubble_idle_over_total=p.bubble_of_total, exposed_s=dict(st.exposed_s), mfu=st.mfu, hfu=st.hfu,
                    tokens_per_s=st.tokens_per_s, critical_path=st.critical_path(),
                    collectives=[dict(_plain(t), slack_s=t.slack_s) for t in timings(st)],
                    concurrency_s=[{"streams": list(k), "seconds": v} for k, v in sorted(concurrency(st).items())],
                    links=[{"edge": e.edge, "bytes_per_step": e.bytes_per_step,
                            "capacity_bytes_per_s": e.capacity_bytes_per_s, "busy_s": e.busy_s,
                            "interval_s": e.interval_s, "per_layer_bytes": e.per_layer_bytes,
                            "layer_interval_s": e.layer_interval_s, "fits": e.fits} for e in edge_loads(plan, st)],
                    sent_bytes_per_step=weights_from_table(plan.stage(st.critical_stage).collectives),
                    verdict=list(verdict), notes=list(st.notes), trace=trace)


def step_infeasible_doc(plan: Plan, st) -> dict[str, Any]:
    """A mesh that does not fit: the step it would take (``would_be``), nothing else."""
    return envelope("step", plan, step_s=None, would_be_step_s=st.step_s, schedule=str(st.pipeline.spec.schedule),
                    mfu=None, would_be_mfu=st.mfu)


def reliability_doc(plan: Plan, r, restart) -> dict[str, Any]:
    """The reliability account and the restart on fewer nodes."""
    return envelope("reliability", plan, gpus=r.gpus, rate_per_gpu_day=r.rate_per_gpu_day, mtbf_s=r.mtbf_s,
                    failure_domains=_plain(r.domains), checkpoint=_plain(r.checkpoint), write_s=r.write_s,
                    read_s=r.read_s, restart_overhead_s=r.restart_overhead_s, restart_s=r.restart_s,
                    interval_s=r.interval_s, goodput=r.goodput, restart=_plain(restart))


def place_doc(plan: Plan | Infeasible, choice, bindings: Sequence[dict]) -> dict[str, Any]:
    """The placement: rank -> GPU, weights (bytes each rank sends per step by axis), the
    weak-path score before and after, decisions, warnings, the bindings of the ranks shown."""
    def score(s) -> dict[str, Any]:
        return {"total_bytes": s.total, "network_bytes": s.network_bytes, "spine_bytes": s.spine_bytes,
                "socket_bytes": s.socket_bytes}

    c = choice
    return envelope("place", plan, rank_to_gpu=[int(x) for x in c.rank_to_gpu], weights=dict(c.weights),
                    weights_unit="sent_bytes_per_step" if c.weights_source != "default" else "relative",
                    weights_source=c.weights_source, changed=bool(c.changed), searched=bool(c.searched),
                    before=score(c.before), after=score(c.after), step_before_s=c.step_before_s,
                    step_after_s=c.step_after_s, decisions=list(c.decisions), warnings=list(c.warnings),
                    bindings=[_plain(b) for b in bindings])


def nccl_check_doc(plan: Plan | Infeasible, log: str, differences: Sequence[str]) -> dict[str, Any]:
    return envelope("nccl-check", plan, log=log, differences=list(differences), matched=not differences)


def catalog_doc(kind: str, entries: dict[str, dict]) -> dict[str, Any]:
    return envelope("catalog", kind=kind, entries=entries)


def calibrate_doc(fits, notes: Sequence[str], source: str, out: str) -> dict[str, Any]:
    return envelope("calibrate", fits=[_plain(f) for f in fits], notes=list(notes), source=source, out=out)
