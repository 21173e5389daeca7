"""V-shaped pipeline schedules (ZB-V, DualPipeV) in the plan: layers per stage on the V, the
embedding and the output layer both on stage 0 (parameters per rank), pipeline send/recv per
stage (a V turns on the last rank without a send), the step model's head on stage 0, and the
one-line errors of a V schedule without two chunks per rank."""

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import Infeasible, build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.schedule.workload import chunk_costs, workload_of


def _plan(schedule: str, vpp: int = 2, global_batch: int = 64):
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": global_batch, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                     "param_dtype": "bf16", "compute_dtype": "bf16", "recompute": "selective"},
        "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4], "sequence_parallel": True,
                 "pp_schedule": schedule, "virtual_stages": vpp}}))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_layers_parameters_and_send_recv(schedule):
    """Llama-3-8B (32 layers, vocab 128256, unpadded under framework torch), pp 4 x vpp 2: stage s
    holds virtual stages s and 7 - s of 4 layers each. Stage 0's parameters per tp rank are
    stage 1's plus the embedding and the output layer (128256 x 4096 / tp 4 = 131,334,144
    each) and the final norm (4096, replicated): 262,672,384 more. Send/recv per micro-batch
    each way: 2 on stages 0 and 3, 4 on stages 1 and 2 (looped interleaved: 3, 4, 4, 3)."""
    p = _plan(schedule)
    assert p.stages[0] == [[0, 1, 2, 3], [28, 29, 30, 31]] and p.stages[3] == [[12, 13, 14, 15], [16, 17, 18, 19]]
    assert [p.stage(k).last for k in range(4)] == [True, False, False, False]
    assert p.state[0].params.total - p.state[1].params.total == 2 * 128256 * 4096 // 4 + 4096 == 262_672_384
    assert p.state[1].params.total == p.state[3].params.total
    sends = [[r.per_microbatch for r in p.stage(k).collectives if r.axis == "pp" and r.op == "send/recv"]
             for k in range(4)]
    assert sends == [[2, 2], [4, 4], [4, 4], [2, 2]]
    looped = _plan("interleaved_1f1b")
    assert [[r.per_microbatch for r in looped.stage(k).collectives if r.axis == "pp"][0] for k in range(4)] == \
        [3, 4, 4, 3]


def test_v_step_model_puts_the_head_on_stage_0():
    p = _plan("zbv")
    costs = chunk_costs(p, workload_of(p, False))
    assert costs[0][0].embed is not None and costs[0][1].head is not None
    assert all(c.head is None for s in costs[1:] for c in s) and costs[0][0].head is None
    st = step_time(p, Overlap())
    assert st.pipeline.spec.schedule == "zbv" and st.critical_stage == 0  # the stage with the head is the busiest


def test_v_schedule_needs_two_chunks_and_dualpipev_2p_micro_batches():
    one = _plan("zbv", vpp=1)
    assert isinstance(one, Infeasible) and "ZB-V needs virtual_stages = 2 (two chunks per rank, a V), got 1" in one.reasons
    few = _plan("dualpipev", global_batch=14)  # 14 / dp 2 = 7 micro-batches < 2 pp = 8
    assert isinstance(few, Infeasible)
    assert "DualPipeV needs micro-batches (7) >= 2 pp (8) (torch ScheduleDualPipeV)" in few.reasons
