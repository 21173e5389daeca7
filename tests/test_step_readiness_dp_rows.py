"""`meshplan step`'s readiness table ("collectives on stage 0, first occurrence") lists every
data-parallel collective of the plan's collective table, the per-step gradient reduction that
runs after the last backward included. Newcomer trial 51 (Llama-3-405B, Megatron-LM, ZeRO-1,
tests/data/nc52a/a_h100_cp2.toml): the critical path ended in "grad reduce (per step)" (243 ms)
but the table listed no dp reduce-scatter: the step-end event on the "dp" stream was named
without its collective, and the table keeps an event by its collective's word
(linkload._op_of), so the reduce-scatter (and Megatron-LM DDP's all-reduce) was dropped."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshplan.cli import main
from meshplan.config import config_from_dict, load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.schedule.comm_streams import DATA_STEP_AXES
from meshplan.schedule.readiness import step_rows, timings
from meshplan.schedule.steptime import step_time
from tests.conftest import ROOT

A_H100_CP2 = ROOT / "tests" / "data" / "nc52a" / "a_h100_cp2.toml"

#: The data axes' streams in the readiness table: "dp" (per-step rows, comm_streams.step_stream),
#: FSDP's "fsdp" and HSDP's "dp_replicate" (per-unit rows).
DATA_STREAMS = {"dp", "fsdp", "dp_replicate"}


def _small(framework: str, sharding: str) -> dict:
    """Llama 3 8B on one DGX H100, seq 2048, 4 micro-batches of 1 per data rank, SP over tp 2:
    dp 4 (dp_replicate 2 x dp_shard 2 under hsdp)."""
    names, shape = (["dp_replicate", "dp_shard", "tp"], [2, 2, 2]) if sharding == "hsdp" else (["dp_shard", "tp"], [4, 2])
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 16, "seq_len": 2048, "micro_batch": 1, "sharding": sharding,
                         "framework": framework},
            "mesh": {"names": names, "shape": shape, "sequence_parallel": True}}


#: (op, phase) of each data-axis collective, by hand from the runtimes: DDP one all-reduce of the
#: gradients (torch: buckets in backward; Megatron-LM 2755bcb optimizer.py reduce_model_grads: its
#: contiguous buffer after the last backward, the plan's row phase "backward"); ZeRO-1 (torch,
#: Megatron-LM's distributed optimizer, distrib_optimizer.py 522-565) one reduce-scatter of the
#: gradients and one all-gather of the updated parameters per step; ZeRO-2 the reduce-scatter per
#: micro-batch in backward, the all-gather per step; FSDP (zero3) the forward and backward
#: all-gathers and the backward reduce-scatter; HSDP those and the replicas' backward all-reduce.
WANT = {
    "none": {("all-reduce", "backward")},
    "zero1": {("reduce-scatter", "step"), ("all-gather", "step")},
    "zero2": {("reduce-scatter", "backward"), ("all-gather", "step")},
    "zero3": {("all-gather", "forward"), ("all-gather", "backward"), ("reduce-scatter", "backward")},
    "hsdp": {("all-gather", "forward"), ("all-gather", "backward"), ("reduce-scatter", "backward"),
             ("all-reduce", "backward")},
}


@pytest.mark.parametrize("framework", ["torch", "megatron"])
@pytest.mark.parametrize("sharding", ["none", "zero1", "zero2", "zero3", "hsdp"])
def test_every_sharding_lists_its_data_parallel_rows(framework, sharding):
    """The table's data-axis rows, one per (op, phase), are the plan's collective table's data-axis
    rows' distinct (op, phase), which are :data:`WANT`'s by hand. Before the fix Megatron-LM's
    DDP all-reduce (sharding none) and ZeRO-1 reduce-scatter, which run after the last backward
    (--overlap-grad-reduce off, Megatron-LM's default), were missing: 1 of 1 and 1 of 2 rows."""
    plan = build_plan(config_from_dict(_small(framework, sharding)))
    rows = {(r.op, r.phase) for r in plan.stage(0).collectives if r.axis in DATA_STEP_AXES}
    listed = [(t.op, t.phase) for t in timings(step_time(plan)) if t.stream in DATA_STREAMS]
    assert rows == WANT[sharding]
    assert sorted(listed) == sorted(rows)  # each once: the first occurrence


def test_megatron_ddp_all_reduce_says_where_it_goes_out():
    """Megatron-LM's DDP all-reduce is the plan's "backward" row (its buckets' phase) but runs at
    the step's end, after the last backward (2755bcb optimizer.py 293-310, no overlap): the row
    says so; its deadline is the optimizer step, which waits for it (slack 0)."""
    plan = build_plan(config_from_dict(_small("megatron", "none")))
    st = step_time(plan)
    (t,) = [t for t in timings(st) if t.stream == "dp"]
    (row,) = [r for r in plan.stage(0).collectives if r.axis in DATA_STEP_AXES]
    assert (t.op, t.phase, t.issued) == ("all-reduce", "backward", "at the step end, after the last backward")
    assert t.duration_s == pytest.approx(row.time_s * row.per_step, rel=1e-9)
    assert t.slack_s == pytest.approx(0.0, abs=1e-12)
    opt = next(e for e in st.post_events if e.stage == 0 and e.name == "optimizer step")
    assert t.deadline_s == pytest.approx(opt.start_s, rel=1e-12)


def test_newcomer_405b_zero1_lists_the_reduce_scatter(tmp_path, capsys):
    """tests/data/nc52a/a_h100_cp2.toml (pp 16 x dp 8 x cp 2 x tp 8, ZeRO-1, Megatron-LM): after
    the last backward the step runs, one after another on stage 0, SP's coalesced norm-gradient
    all-reduce over tp, the data axes' gradient reduce-scatter (fsdp = dp x cp = 16 ranks, one a
    node: 12,214,730,752 B fp32 over the NIC ring, the plan's row 243.194 ms), the optimizer and
    the parameter all-gather. So the table lists the dp reduce-scatter ready when the tp
    all-reduce ends, lasting the plan row's time (the critical path's grad reduce event), its
    deadline the optimizer's start: slack 0. The tp all-reduce's row names what it is: Megatron-LM's
    allreduce_layernorm_grads (2755bcb megatron/optimizer/optimizer.py 270-290)."""
    out = tmp_path / "step.json"
    with pytest.raises(SystemExit) as done:
        main(["step", str(A_H100_CP2), "--json", str(out)])
    assert done.value.code == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(doc)) == []  # "rows" in the schema
    listed = {(c["stream"], c["phase"], c["op"]): c for c in doc["collectives"]}
    plan = build_plan(load_config(A_H100_CP2))
    (rs,) = [r for r in plan.stage(0).collectives if r.axis in DATA_STEP_AXES and r.op == "reduce-scatter"]
    assert (rs.axis, rs.group_size, rs.size_bytes, rs.dtype) == ("fsdp", 16, 12_214_730_752, "fp32")
    dp, tp = listed[("dp", "step", "reduce-scatter")], listed[("tp", "step", "all-reduce")]
    assert dp["duration_s"] == pytest.approx(rs.time_s, rel=1e-9) and round(rs.time_s * 1e3, 3) == 243.194
    assert dp["ready_s"] == pytest.approx(tp["ready_s"] + tp["duration_s"], rel=1e-12)
    assert dp["slack_s"] == pytest.approx(0.0, abs=1e-9)
    assert dp["rows"] == "once per step" and "allreduce_layernorm_grads" in tp["rows"]
    line = next(x for x in text.splitlines() if x.split()[:3] == ["dp", "step", "reduce-scatter"])
    assert "243.194" in line and "(rows: once per step)" in line
    tp_line = next(x for x in text.splitlines() if x.split()[:3] == ["tp", "step", "all-reduce"])
    assert "sequence-parallel norm and row-parallel bias weight gradients over tp" in tp_line
    assert "grad reduce: reduce-scatter (per step)" in text  # the critical path names it too
