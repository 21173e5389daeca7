"""Per-component step of the development set's SP + selective runs (D2: 22B on 8 A100, D4: 175B on
64 A100; ../shared/reference/published-runs-dev.md) beside Calculon's (issue 11: which components
differ and why). Diagnostic only: nothing here feeds the model.

meshplan: the critical stage's per-layer forward, backward and recompute compute per micro-batch
(:func:`meshplan.compute.ops.layer_cost`; its memory-bound ops on their own line), summed over the
stage's layers and micro-batches; embedding and head; the exposed communication per stream and the
optimizer step of :func:`meshplan.schedule.steptime.step_time`; "pipeline idle" is the rest of the
step (bubble and the blocking pp sends' waits, without the transfer itself, which "pp" counts).

Calculon: ``calculon llm models/<m>.json validation/seqsel/tab5/<m>_seqsel.json systems/a100_80g.json
out.json`` at calculon-ai/calculon caa4b11 (run with pandas and psutil stubbed; they are not used by
``llm``), the keys named in :data:`CALCULON`. Calculon has no embedding or output layer: its ``fw``
and ``bw`` are the transformer blocks only.

Run: PYTHONPATH=. .venv/bin/python benchmarks/fidelity_components.py
"""

from __future__ import annotations

import fidelity

from meshplan.schedule.steptime import chunk_costs, step_time, workload_of

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


def main() -> None:
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
