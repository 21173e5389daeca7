"""Versioned JSON form of a plan: every group of every axis, every rank's placement.

Schema ``meshplan.plan/v1``: top-level keys ``schema``, ``meshplan_version``, ``input``
(the four specs), ``world``, ``feasible``, ``reasons``, ``notes``, ``mesh`` (its order twice:
``megatron_order`` in meshplan's axis names as ``mesh.order`` takes it, ``megatron_lm_order`` in
Megatron-LM's as the text prints it, null where it has none, ``megatron_lm_order_note`` the
mapping or why not), ``groups``
(axis -> list of rank lists), ``placement`` (per-rank arrays), ``flags``, ``shapes``,
``memory``, ``memory_timeline`` (per stage: peak bytes, when, bytes per kind at the peak and
their maxima, headroom), ``constraints``, ``collectives``; ``input`` also holds the
``[memory]`` parameters; ``megatron_runtime`` (framework megatron, else null) the
Megatron-LM generation the plan models (:func:`meshplan.compute.megatron_core.runtime_followed`). Units are SI (bytes, seconds, bytes/s) and named in keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshplan import __version__
from meshplan.fileio import write_output
from meshplan.compute.megatron_core import runtime_followed
from meshplan.memory.timeline import Timeline
from meshplan.mesh.axes import megatron_lm_order
from meshplan.mesh.tpsplit import model_groups
from meshplan.plan import SCHEMA, Infeasible, Plan
from meshplan.report.plan_warnings import plan_warnings


def plan_to_dict(plan: Plan | Infeasible) -> dict[str, Any]:
    """The plan as plain JSON-able data (see the module docstring). An :class:`Infeasible`
    mesh has the keys up to ``constraints``, and when it was resolved its ``mesh``,
    ``groups``, ``placement`` and ``flags`` with ``stages`` null and the planned keys empty."""
    c = plan.config
    out: dict[str, Any] = {
        "schema": SCHEMA, "meshplan_version": __version__,
        "input": {"model": c.model.model_dump(), "cluster": c.cluster.model_dump(),
                  "training": c.training.model_dump(), "mesh": plan.spec.model_dump(),
                  "memory": c.memory.model_dump()},
        "world": plan.world, "feasible": plan.feasible, "reasons": list(plan.reasons),
        "notes": list(plan.notes), "warnings": plan_warnings(plan), "constraints": plain_data(plan.constraints),
        "megatron_runtime": runtime_followed(c.model, c.training),
    }
    mesh, p = plan.mesh, plan.placement
    if mesh is None or p is None:
        return out
    lm_order, lm_note = megatron_lm_order(mesh.given_names)  # the text's "Megatron order" (mesh.axes.order_words)
    out["mesh"] = {"names": list(mesh.layout.names), "shape": list(mesh.layout.shape),
                   "megatron_order": mesh.megatron_order, "megatron_lm_order": lm_order,
                   "megatron_lm_order_note": lm_note, "ep": mesh.ep, "etp": mesh.etp,
                   "sequence_parallel": mesh.sequence_parallel, "derivation": list(plan.derivation),
                   "stages": plan.stages if isinstance(plan, Plan) else None, "virtual_stages": plan.vpp,
                   "micro_batches": plan.micro_batches}
    out["groups"] = {a: mesh.groups(a).tolist() for a in mesh.all_axes()}
    out["groups"].update({a: g.tolist() for a, g in model_groups(mesh, c.model, c.training.framework).items()})  # kv_replica
    out["placement"] = {k: getattr(p, k).tolist() for k in
                        ("node", "local_gpu", "global_gpu", "socket", "core_first", "core_last", "nic", "rail")}
    out["placement"]["nic_names"] = [n.name for n in c.cluster.node.nics]
    out["flags"] = [plain_data(f) for f in plan.flags]
    if isinstance(plan, Infeasible):
        out.update(shapes={"gemms_forward": [], "attention": None}, memory=[], memory_timeline=[], collectives={})
        return out
    out["shapes"] = {"gemms_forward": [dict(plain_data(g), flops=g.flops) for g in plan.gemms],
                     "attention": plain_data(plan.attention)}
    out["memory"] = [plain_data(s) for s in plan.state]
    out["memory_timeline"] = [timeline_summary(tl) for tl in plan.timelines]
    out["collectives"] = {stage: [dict(plain_data(r), algbw_bytes_per_s=r.algbw_bytes_per_s,
                                       busbw_bytes_per_s=r.busbw_bytes_per_s) for r in rows]
                          for stage, rows in plan.collectives.items()}
    return out


def timeline_summary(tl: Timeline) -> dict[str, Any]:
    """Summary of one stage's memory timeline (the events: ``meshplan memory``)."""
    p = tl.peak
    return {"stage": tl.stage, "schedule": tl.schedule, "n_events": tl.n_events, "peak_bytes": p.total_bytes,
            "peak_t_index": p.t_index, "peak_phase": p.phase, "peak_layer": p.layer, "peak_microbatch": p.microbatch,
            "peak_where": p.where(), "peak_event": p.label, "peak_by_kind_bytes": dict(p.by_kind),
            "max_by_kind_bytes": dict(tl.max_by_kind), "usable_bytes": tl.usable_bytes, "hbm_bytes": tl.hbm_bytes,
            "headroom_bytes": tl.headroom_bytes, "fits": tl.fits}


def plain_data(x: Any) -> Any:
    """``x`` as JSON-able data: dataclasses as dicts of their public fields, dict keys as
    strings, tuples as lists, arrays through ``tolist``, pydantic models through
    ``model_dump``, an infinite float as None (JSON has no infinity); numbers keep their SI units."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain_data(getattr(x, f.name)) for f in dataclasses.fields(x) if not f.name.startswith("_")}
    if isinstance(x, dict):
        return {str(k): plain_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain_data(v) for v in x]
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "model_dump"):
        return x.model_dump()
    if isinstance(x, float) and x == float("inf"):
        return None
    return x


def write_json(plan: Plan | Infeasible, path: str | Path, force: bool = False) -> Path:
    """Write the plan atomically (temp file + rename). Refuses to replace an existing file
    unless ``force`` (ConfigError naming --json)."""
    return write_output(path, json.dumps(plan_to_dict(plan), separators=(",", ":")), force, "--json")
