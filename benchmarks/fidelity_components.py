"""Per-component step of the development set's SP + selective runs (D2: 22B on 8 A100, D4: 175B on
64 A100; ../shared/reference/published-runs-dev.md) beside Calculon's (issue 11: which components
differ and why). Diagnostic only: nothing here feeds the model.

meshplan: the critical stage's per-layer forward, backward and recompute compute per micro-batch
(:func:`meshplan.compute.layer.layer_cost`; its memory-bound ops on their own line), summed over the
stage's layers and micro-batches; embedding and head; the exposed communication per stream and the
optimizer step of :func:`meshplan.schedule.steptime.step_time`; "pipeline idle" is the rest of the
step (bubble and the blocking pp sends' waits, without the transfer itself, which "pp" counts; the
per-chunk get_batch and timers; under pp the p2p calls' syncs, 3.1 ms of D4's stage 0).

Calculon: ``calculon llm models/<m>.json validation/seqsel/tab5/<m>_seqsel.json systems/a100_80g.json
out.json`` at calculon-ai/calculon caa4b11 (run with pandas and psutil stubbed; they are not used by
``llm``), the keys named in :data:`CALCULON`. Calculon has no embedding or output layer: its ``fw``
and ``bw`` are the transformer blocks only.

D5 itemised (``--layer``): one 22B layer (tp 8, micro-batch 4, Korthikanti Table 4) kernel by kernel
in each pass, each op's time and how it was obtained (shape and rate with its source points, or bytes
and bandwidth), then the stage's tp collectives (size, seconds per call, algbw, the curve they were
read from), each pass's compute by group with the rest of its unit, the tp collectives' waits
(:func:`layer_summary`), and the layer's forward and backward with them, against the published times.

Run: PYTHONPATH=. .venv/bin/python benchmarks/fidelity_components.py [--layer [RECOMPUTE [sp]]]
"""

from __future__ import annotations

import fidelity

import sys
from dataclasses import replace

from meshplan.compute.batch_input import GET_BATCH_CADENCES
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.schedule.steptime import layer_unit_times, step_time
from meshplan.schedule.workload import chunk_costs, workload_of

#: Calculon's stats (seconds per step), from the command in the module docstring: fw_time,
#: bw_time, recompute_time, tp_comm_exposed_time, recomm_exposed_time, pp_comm_exposed_time,
#: bubble_time, optim_step_time, total_time.
CALCULON = {
    "D2 22B SP + selective": {
        "layers x micro-batches": 48, "fw": 0.246756, "bw": 0.445671, "recompute": 0.048464, "tp": 0.307043,
        "tp recompute": 0.066004, "pp": 0.0, "bubble": 0.0, "optimizer": 0.022732, "total": 1.136670},
    "D4 175B SP + selective": {
        "layers x micro-batches": 12 * 64, "fw": 3.333491, "bw": 6.347705, "recompute": 0.318525, "tp": 2.487064,
        "tp recompute": 0.535712, "pp": 0.115054, "bubble": 0.478973, "optimizer": 0.021540, "total": 13.638064},
}


def components(run: fidelity.Run) -> dict:
    """meshplan's step of ``run`` by component (seconds per step, critical stage)."""
    plan = fidelity.plan_of(run.config)
    st = step_time(plan)
    s, m = st.critical_stage, plan.micro_batches
    chunks = chunk_costs(plan, workload_of(plan))[s]
    layers = [c for ch in chunks for c in ch.layers]
    rec = sum(c.seconds(recompute=True) for c in layers) * m
    out = {"layers x micro-batches": len(layers) * m,
           "fw": sum(c.forward_s for c in layers) * m,
           "bw": sum(c.backward_s for c in layers) * m - rec, "recompute": rec,
           "memory-bound (in fw/bw/re)": sum(o.seconds for c in layers for o in c.ops if o.kind == "memory") * m,
           "embedding + head": sum(x.seconds() for ch in chunks for x in (ch.embed, ch.head) if x is not None) * m,
           "tp": st.exposed_s.get("tp", 0.0), "pp": st.exposed_s.get("pp", 0.0), "dp": st.exposed_s.get("dp", 0.0),
           "optimizer": sum(e.end_s - e.start_s for e in st.post_events if e.stage == s and e.name == "optimizer step"),
           "total": st.step_s}
    known = sum(out[k] for k in ("fw", "bw", "recompute", "embedding + head", "tp", "pp", "dp", "optimizer"))
    out["pipeline idle and rest"] = st.step_s - known
    return out


def layer_plan(recompute: str = "none", sp: bool = False):
    """The plan of a D5 experiment: the 22B config with ``recompute`` and sequence parallelism
    ``sp`` (as :func:`fidelity.predict_layer` builds it)."""
    cfg = load_config(fidelity.HERE / "megatron-22b_8xa100_tp8_sp-selective.toml")
    return build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": recompute}),
                              mesh=cfg.mesh.model_copy(update={"sequence_parallel": sp})))


def layer_lines(recompute: str = "none", sp: bool = False) -> list[str]:
    """D5: one 22B layer's ops (``Cost.lines``: pass, block, name, us, TFLOP, how timed), its
    stage's tp collectives (less get_batch's broadcasts, once per chunk: not the layer's), each
    pass by group (:func:`layer_summary`) and the layer's forward and backward with them (ms)
    beside Table 4."""
    plan = layer_plan(recompute, sp)
    layer = chunk_costs(plan, workload_of(plan))[0][0].layers[0]
    out = layer.lines()
    for r in plan.stage(0).collectives:
        if r.axis == "tp" and r.phase in ("forward", "backward") and r.cadence not in GET_BATCH_CADENCES.values():
            out.append(f"collective {r.phase:8s} {r.op:14s} {r.size_bytes / 1e6:8.1f} MB {r.time_s * 1e6:8.1f} us "
                       f"algbw {r.size_bytes / r.time_s / 1e9:6.1f} GB/s ({r.path.note}, {r.algorithm})")
    f, b = layer_unit_times(plan)
    out += layer_summary(layer, f, b)
    pf, pb = fidelity.LAYER_22B[(recompute, sp)]
    out.append(f"layer forward {f * 1e3:.2f} ms (published {pf}), backward {b * 1e3:.2f} ms (published {pb})")
    return out


def op_group(op) -> str:
    """The summary's group of one op: the attention's batched products (QK^T, PV and their
    gradients and replays), the other GEMMs, or the memory-bound kernels."""
    if op.kind == "memory":
        return "memory-bound"
    if op.kind == "gemm" and op.block == "attn" and op.name.startswith(("qk^T", "pv")):
        return "attention bmm"
    return op.kind


#: The layer's passes as its ops' phases (the backward with its recompute).
PASSES = {"forward": ("forward",), "backward": ("backward_input", "backward_weight")}


def pass_groups(layer, phases: tuple) -> dict:
    """Seconds of ``layer``'s ops of ``phases`` by :func:`op_group`."""
    groups: dict[str, float] = {}
    for o in layer.ops:
        if o.phase in phases:
            groups[op_group(o)] = groups.get(op_group(o), 0.0) + o.seconds
    return groups


def layer_summary(layer, forward_s: float, backward_s: float) -> list[str]:
    """D5 by group: each pass's compute (ms) by :func:`op_group` and the rest of the pass's
    unit (``forward_s``, ``backward_s``: the layer's
    :func:`~meshplan.schedule.steptime.layer_unit_times`): the waits for its tp collectives
    and, where one overlaps compute (the backward's), the compute its NCCL kernel's SMs slow."""
    out = []
    for (label, phases), unit_s in zip(PASSES.items(), (forward_s, backward_s)):
        groups = pass_groups(layer, phases)
        parts = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(groups.items()))
        out.append(f"summary {label:8s} {parts}; tp waits + SM contention "
                   f"{(unit_s - sum(groups.values())) * 1e3:.3f} (ms; unit {unit_s * 1e3:.3f})")
    return out


def main() -> None:
    if "--layer" in sys.argv:
        rest = sys.argv[sys.argv.index("--layer") + 1:]
        print("\n".join(layer_lines(rest[0] if rest else "none", "sp" in rest[1:])))
        return
    for run in (fidelity.RUNS[1], fidelity.RUNS[3]):
        ours, theirs = components(run), CALCULON[run.run]
        n = ours["layers x micro-batches"]
        print(f"\n{run.run}: published {run.published_s:.2f} s, meshplan {ours['total']:.3f} s, Calculon "
              f"{theirs['total']:.3f} s ({n} layer passes on the critical stage)")
        print(f"{'component (s per step)':34s} {'meshplan':>9s} {'Calculon':>9s} {'per layer-mb ms':>16s}")
        rows = [("layer forward compute", "fw", "fw"), ("layer backward compute", "bw", "bw"),
                ("recompute", "recompute", "recompute"), ("  of which memory-bound", "memory-bound (in fw/bw/re)", None),
                ("embedding + output layer", "embedding + head", None), ("tp exposed", "tp", "tp"),
                ("tp exposed in recompute", None, "tp recompute"), ("pp exposed", "pp", "pp"),
                ("bubble / pipeline idle", "pipeline idle and rest", "bubble"), ("optimizer step", "optimizer", "optimizer"),
                ("step", "total", "total")]
        for label, a, b in rows:  # "-": the tool has no such term (Calculon's memory time is inside its compute)
            x = ours.get(a, 0.0) if a else None
            y = theirs.get(b, 0.0) if b else None
            cell = lambda v, w, scale: f"{v * scale:{w}.3f}" if v is not None else f"{'-':>{w}s}"
            print(f"{label:34s} {cell(x, 9, 1)} {cell(y, 9, 1)} {cell(x, 7, 1e3 / n)} {cell(y, 8, 1e3 / n)}")


if __name__ == "__main__":
    main()
