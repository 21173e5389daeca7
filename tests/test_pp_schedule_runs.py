"""training.pp_schedule_runs: torchtitan's gradient accumulation under pp runs the pipeline
schedule once per accumulation step (its train step calls ``schedule.step()`` per step, each
over ``local_batch_size / microbatch_size`` micro-batches), and torch 2.13's
``PipelineStage.perform_reduce_grad`` reduce-scatters the FSDP gradients and reshards the
parameters at the end of every call. So each run fills and drains the pipeline and starts
from sharded parameters; Megatron-LM runs one schedule over all the step's micro-batches.

Counts below are derived by hand from the 1F1B order (torch's Schedule1F1B, p 2):
stage 0 runs F0 F1 B0 B1 (one warm-up forward), stage 1 F0 B0 F1 B1. With
reshard_after_forward true a layer unit is gathered whenever a pass finds it sharded, and
stays gathered after a backward (gradient sync off until the run's last): stage 0 gathers
F0, F1, B0 (2 forward + 1 backward per run), stage 1 F0, B0, B1 (1 + 2); so is stage 0's
embedding, its own unit resharded as the layers (torchtitan's units at every pp); stage 1's
[norm, output] is never resharded after forward: 1 forward gather per run. One reduce-scatter
per unit per run.
"""

import dataclasses
import json
import math

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.pipeline_exposure import run_shift
from meshplan.schedule.steptime import step_time

from tests.test_memory_timeline import TINY, MEM

PP2 = dict(names=["pp", "dp_shard"], shape=[2, 2], world=4)


def plan_of(runs=1, global_batch=8, mesh=PP2, model=TINY, schedule="1f1b", **training):
    t = {**dict(global_batch=global_batch, seq_len=8, micro_batch=1, sharding="zero3", param_dtype="fp32",
                recompute="none", pp_schedule_runs=runs), **training}
    cfg = {"model": model, "cluster": {"system": "dgx-h100", "nodes": 1}, "training": t,
           "mesh": {**mesh, "pp_schedule": schedule}, "memory": MEM}
    return build_plan(config_from_dict(cfg))


def fsdp_counts(plan, stage):
    """{(label, phase, op): per_step} of a stage's FSDP rows."""
    return {(r.cadence, r.phase, r.op): r.per_step for r in plan.collectives[f"stage {stage}"]
            if r.axis == "dp_shard"}


def test_table_counts_every_run_by_hand():
    # reshard_after_forward written true: the counts below re-gather after each forward (unset is false under pp)
    p = plan_of(runs=2, reshard_after_forward=True)  # 8 sequences / dp 2 = 4 micro-batches: 2 runs of 2
    assert (p.micro_batches, p.schedule_runs, p.run_micro_batches) == (4, 2, 2)
    s0, s1 = fsdp_counts(p, 0), fsdp_counts(p, 1)
    layers = 1  # TINY has 2 layers: one per stage
    assert s0[("every layer", "forward", "all-gather")] == 2 * 2 * layers
    assert s0[("every layer", "backward", "all-gather")] == 2 * 1 * layers
    assert s1[("every layer", "forward", "all-gather")] == 2 * 1 * layers
    assert s1[("every layer", "backward", "all-gather")] == 2 * 2 * layers
    ends = {0: {("per root (embedding)", "forward", "all-gather"): 2 * 2,
                ("per root (embedding)", "backward", "all-gather"): 2 * 1,
                ("per root (embedding)", "backward", "reduce-scatter"): 2},
            1: {("per root (norm/output)", "forward", "all-gather"): 2,
                ("per root (norm/output)", "backward", "reduce-scatter"): 2}}
    for k, s in enumerate((s0, s1)):
        assert s[("every layer", "backward", "reduce-scatter")] == 2
        assert {key: s[key] for key in s if key[0].startswith("per root")} == ends[k]
    # one schedule of 4 (Megatron's way, runs 1): stage 0 F0 F1 B0 F2 B1 F3 B2 B3 gathers in F0 F1
    # (F2 and F3 find the unit left gathered by B0 and B1) and in B0 B1 B2; one reduce-scatter
    one = fsdp_counts(plan_of(runs=1, reshard_after_forward=True), 0)
    assert [one[("every layer", ph, op)] for ph, op in (("forward", "all-gather"), ("backward", "all-gather"),
                                                        ("backward", "reduce-scatter"))] == [2, 3, 1]


def test_each_run_fills_and_drains_the_pipeline():
    """Two runs of 2 take exactly twice one run of 2 before the optimizer (every run repeats the
    first: stage 0 ends each run last and starts the next), and longer than one schedule of 4,
    which fills and drains once."""
    two, half, one = (step_time(plan_of(runs=2)), step_time(plan_of(runs=1, global_batch=4)),
                      step_time(plan_of(runs=1)))
    opt = [e.dur_s for e in half.post_events if e.name == "optimizer step" and e.stage == half.critical_stage][0]
    assert two.runs == 2 and two.pipeline.spec.m == 2 and half.pipeline.spec.m == 2
    assert two.step_s - opt == pytest.approx(2 * (half.step_s - opt), rel=1e-12)
    assert run_shift(half.pipeline, half.units) == pytest.approx(half.step_s - opt, rel=1e-12)
    assert two.step_s > one.step_s
    assert half.exposed_s["fsdp"] > 0 and two.exposed_s == pytest.approx({k: 2 * x for k, x in half.exposed_s.items()})
    assert two.mfu == pytest.approx(one.mfu * one.step_s / two.step_s, rel=1e-12)  # same model FLOP per step
    lines = "\n".join(two.lines())
    assert "(1f1b, p 2, m 2 x 2 runs, v 1)" in lines and "4 micro-batches)" in lines
    assert any(e.name.startswith("schedule run 2 (1 x ") for e in two.post_events)


def test_memory_is_one_run():
    p = plan_of(runs=2)
    assert all(tl.micro_batches == 2 for tl in p.timelines)
    assert any("one of the step's 2 pipeline schedule runs of 2 micro-batches" in n for n in p.timelines[0].notes)
    # a run of 2 holds what the first 2 micro-batches of one schedule of 2 hold: the same peak
    assert [tl.peak.total_bytes for tl in p.timelines] == \
        [tl.peak.total_bytes for tl in plan_of(runs=1, global_batch=4).timelines]


def test_runs_that_do_not_divide_or_break_the_schedule_are_reasons():
    p = plan_of(runs=3)  # 4 micro-batches
    assert isinstance(p, Infeasible)
    assert p.reasons == ("training.pp_schedule_runs 3 does not divide the step's 4 micro-batches (global_batch / "
                         "(micro_batch x dp)); use a divisor of 4",)


def test_runs_are_torchtitans_and_pp_only():
    with pytest.raises(ConfigError, match="pp_schedule_runs 2 is torchtitan's gradient accumulation under pp"):
        plan_of(runs=2, framework="megatron", sharding="none", grad_dtype="fp32")
    p = plan_of(runs=2, mesh=dict(names=["dp_shard"], shape=[2], world=2))
    assert p.schedule_runs == 1 and any("pp_schedule_runs 2 applies with pp > 1" in n for n in p.notes)


def test_torchtitan_export_round_trip():
    """The runs go out as torchtitan's local_batch_size (micro-batches of one schedule.step() x
    microbatch_size) and come back: 32 sequences, dp 4, runs 4: local 2."""
    from pathlib import Path

    from meshplan.interop.torchtitan import ImportOptions, read
    from meshplan.interop.torchtitan_write import write

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 32, "seq_len": 8192, "recompute": "full",
                                         "reshard_after_forward": False, "pp_schedule_runs": 4},
                            "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": "1f1b"}})
    out = write(cfg)
    assert (out["training"]["local_batch_size"], out["training"]["global_batch_size"],
            out["parallelism"]["pipeline_parallel_microbatch_size"]) == (2, 32, 1)
    back = read(out, Path("."), ImportOptions(cluster="dgx-h100", nodes=1)).tables["training"]
    assert (back["global_batch"], back["micro_batch"], back["pp_schedule_runs"]) == (32, 1, 4)


def shared_validate_runs() -> dict:
    """pp 2 x dp_shard 2 in 2 schedule runs at world 4, in the shared 4-rank launch (tests/conftest.py
    ``world4_runs``, tests/validate_runs.py); no in-run probe: nothing here reads it (it runs in
    tests/test_validate.py)."""
    from pathlib import Path

    from meshplan.config import load_config
    from meshplan.runtime.validation.validate import Options

    base = load_config(Path(__file__).parent / "data" / "validate_llama8b_pp2_fsdp.toml")
    cfg = dataclasses.replace(base, training=base.training.model_copy(update={"pp_schedule_runs": 2}))
    return {"pp_schedule_runs2": (cfg, Options(worlds=(4,), layers=4, seq_len=32, vocab=512, steps=1, micro_batches=4,
                                               timeout_s=150, probe=False))}


@pytest.mark.slow
def test_validate_two_schedule_runs_match_the_plan(world4_runs):
    """pp 2 x dp_shard 2 on 4 gloo ranks, 4 micro-batches in 2 runs of Schedule1F1B: every
    collective of every rank (FSDP gathers and reduce-scatters twice, sends and receives per
    micro-batch) equals the plan's, and each step reports the 4 micro-batches."""
    run = world4_runs["pp_schedule_runs2"]
    code, res, out = run.code, run.results, run.out
    r = res[0]
    assert r.get("stage") == "compare", r["message"]
    comp = r["comparison"]
    plan = json.loads((out / "world4" / "plan.json").read_text())
    assert plan["mesh"]["micro_batches"] == 4 and plan["input"]["training"]["pp_schedule_runs"] == 2
    # by hand (module docstring; 2 layers per stage, ranks 0-1 stage 0, 2-3 stage 1): layer units
    # gathered 2 x 2 x 2 forward and 2 x 1 x 2 backward on stage 0, the reverse on stage 1, reduced
    # once per run; stage 0's embedding unit (torchtitan's, resharded as the layers) gathered 2 x 2
    # forward and 2 x 1 backward, stage 1's [norm, output] once per run; each reduced once per run
    fsdp = {(row["phase"], row["op"], row["size_bytes"] == max(r["size_bytes"] for r in comp["collectives"]
                                                               if r["axis"] == "dp_shard")):
            [row[f"rank{k}"] for k in range(4)] for row in comp["collectives"] if row["axis"] == "dp_shard"
            and not (row["op"] != "all-gather" and row["phase"] == "forward")}
    assert fsdp[("forward", "all-gather", True)] == [8, 8, 4, 4]
    assert fsdp[("backward", "all-gather", True)] == [4, 4, 8, 8]
    assert fsdp[("backward", "reduce-scatter", True)] == [4, 4, 4, 4]
    roots = sorted([row[f"rank{k}"] for k in range(4)] for row in comp["collectives"]
                   if row["axis"] == "dp_shard" and row["size_bytes"] < 1e6)
    assert roots == [[0, 0, 2, 2], [0, 0, 2, 2], [2, 2, 0, 0], [2, 2, 0, 0], [4, 4, 0, 0]]
    for row in comp["collectives"]:
        if row["phase"] != "schedule-setup":
            assert [row[f"rank{k}"] for k in range(4)] == [row[f"meshplan_rank{k}"] for k in range(4)], row
    for rank in range(4):
        steps = json.loads((out / "world4" / f"rank{rank}" / "timings.json").read_text())["steps"]
        assert all(s["micro_batches"] == 4 for s in steps)
        assert all((s["loss"] is not None and math.isfinite(s["loss"])) == (rank in (2, 3)) for s in steps)
    assert comp["differences"] == [] and code == 0


# torch 2.13's PipelineStage with FSDP2: every backward runs with gradient sync off
# (stage.py backward_maybe_with_nosync), and after a chunk's last one perform_reduce_grad runs
# each unit's post_backward (copy-in, reduce-scatter) and the final callback, whose waits hold
# the compute stream until every reduce-scatter is done. The pass's send goes out before.

def test_reduce_scatters_wait_for_the_whole_last_backward():
    from meshplan.memory.timeline import KINDS

    # m 1: the first backward is the last; GPipe (F0 B0 on both stages, 1F1B's order at m 1,
    # which torch's Schedule1F1B refuses at m 1 < pp 2)
    p = plan_of(runs=1, global_batch=2, model=dict(TINY, layers=4), schedule="gpipe")
    # every unreduced accumulator (fp32, unsharded) is held at the end of the pass: layer 3104
    # parameters x 4 B = 12416 each, embedding 2048 x 4 = 8192, norm + output (2048 + 16) x 4 =
    # 8256; then the first unit in FSDP's (forward) order copies in its reduce-scatter input
    gb = [tl.running()[:, KINDS.index("grad_buffers")].max() for tl in p.timelines]
    assert gb == [8192 + 2 * 12416 + 8192, 8256 + 2 * 12416 + 12416]
    st = step_time(p)
    for s in (0, 1):
        b = [e for e in st.pipeline.stage_events(s) if e.args.get("kind") == "B"][-1]
        sim = st.units.of_event(b)
        rs = [e for e in sim.events if e.name.startswith("fsdp RS") and e.stream == "fsdp"]
        # the pass's compute: not the reduction's copy-ins after it, nor FSDP2's waits for the reduce-scatter
        # in flight before the next copy-in (grad_reduce.rs_buffer_wait, torch 2.13 _fsdp_param_group.py
        # 639-658), which the tail's copy-ins hold on the compute stream after the pass
        compute_end = max(e.end_s for e in sim.events if e.stream == "compute" and "copy-in" not in e.name
                          and "RS buffer wait" not in e.name)
        assert len(rs) == 3 and min(e.start_s for e in rs) >= compute_end  # root + 2 layers, after the pass
        assert sim.duration_s == pytest.approx(compute_end)  # the send is not held back: the tail is
        assert sim.tail_s >= sum(e.dur_s for e in rs)
    assert st.exposed_s["fsdp"] >= st.units.of_event(
        [e for e in st.pipeline.stage_events(st.critical_stage) if e.args.get("kind") == "B"][-1]).tail_s
