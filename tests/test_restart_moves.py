"""How the restart's head line says the mesh changes (newcomer trial 12, item 2): each axis
that shrinks or grows with its degrees before and after, the axes kept; and why a larger mesh
is refused when no micro-batch count runs on it (it used to give the schedule's reason at 1
micro-batch, a count no one asked for)."""

from meshplan.mesh.resolve import resolve_mesh
from meshplan.plan import run_reasons
from meshplan.restart import restart_on_fewer_nodes
from meshplan.restart_text import axis_moves
from meshplan.spec.mesh import MeshSpec


def test_axis_moves_name_each_axis_with_its_degrees():
    assert axis_moves({"pp": 2, "dp": 4, "tp": 2}, {"pp": 1, "dp": 4, "tp": 2}, ("pp",), {}) == \
        "shrunk: pp 2 -> 1; kept: dp 4, tp 2"
    assert axis_moves({"dp_shard": 24}, {"dp_shard": 8, "tp": 2}, ("dp_shard", "tp"), {}) == \
        "shrunk: dp_shard 24 -> 8; grown: tp 1 -> 2"
    # zero1 prints the data axis dp; ep kept though not among the axes
    assert axis_moves({"pp": 16, "dp_shard": 128}, {"pp": 31, "dp_shard": 32, "cp": 2}, ("pp", "dp_shard", "cp"),
                      {"dp_shard": "dp"}, (("ep", 64),)) == "shrunk: dp 128 -> 32; grown: pp 16 -> 31, cp 1 -> 2; kept: ep 64"


def test_a_larger_mesh_no_micro_batch_count_runs_on_is_refused_at_its_most():
    """pp 2 x dp_shard 16 (32 GPUs), global batch 64, micro_batch 1, torchtitan's gradient
    accumulation as 4 schedule runs; one node of 8 lost: 24 GPUs left. dp 12 allows at most
    64 // 12 = 5 micro-batches a step: 4 runs do not divide 5 (nor 3, 2, 1), and 4 micro-batches
    are 4 runs of 1, fewer than 1F1B's pp 2. dp 8 keeps the contract: 8 micro-batches, 4 runs
    of 2 = pp."""
    m = resolve_mesh(MeshSpec(names=["pp", "dp_shard"], shape=[2, 16]), world=32)
    r = restart_on_fewer_nodes(m, 1, gpus_per_node=8, global_batch=64, micro_batch=1,
                               micro_batch_reasons=lambda pp, k: run_reasons("1f1b", pp, k, 1, 4, "torch"))
    assert run_reasons("1f1b", 2, 4, 1, 4) == ("each of the 4 schedule runs (training.pp_schedule_runs): 1F1B needs "
                                               "micro-batches (1) >= pp (2) (torch Schedule1F1B)",)
    assert r.lines()[0] == (
        "restart: world 32 -> 16 (24 GPUs left); mesh pp 2 x dp_shard 16 -> pp 2 x dp_shard 8 (shrunk: dp_shard 16 -> 8; "
        "kept: pp 2); not pp 2 x dp_shard 12 (24 GPUs): none of 1-5 micro-batches a step runs (5 = global_batch 64 // "
        "(micro_batch 1 x dp 12)); at 5: training.pp_schedule_runs 4 does not divide the step's 5 micro-batches "
        "(global_batch / (micro_batch x dp)); use a divisor of 5")
    assert r.micro_batches == (64 // 16, 8) and r.batch_contract
    assert r.refused[3].startswith("pp 2 x dp_shard 9 (18 GPUs): none of 1-7 micro-batches a step runs (7 = "
                                   "global_batch 64 // (micro_batch 1 x dp 9)); at 7: ")
