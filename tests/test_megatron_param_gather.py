"""What the next forward waits for of Megatron-LM's distributed-optimizer parameter all-gather under
``--overlap-param-gather`` with virtual stages (issue 11, trial 28: Mixtral 8x22B on 512 H100).

Source (NVIDIA/Megatron-LM d98e8a6): with the interleaved schedule ``align_param_gather`` is on by
default (arguments.py ``--no-align-param-gather``), so training.py sets ``param_sync_func`` to each
chunk's ``start_param_sync``; ``forward_backward_pipelining_with_interleaving`` calls it for chunks 0
and 1 before the first forward (schedules.py:1219-1221), which issues every bucket group of the chunk,
dense buffers then expert buffers, in bucket order; bucket 0 holds the chunk's last parameters
(``_compute_default_per_buffer_param_layout`` iterates them in reverse), so the embedding's and layer
0's pre-hooks (``_make_forward_pre_hook``, ``finish_param_sync`` with ``skip_next_bucket_dispatch``)
wait for chunk 0's whole gather; chunk k + 1's is issued at chunk k's first micro-batch
(schedules.py:1341-1353) and runs beside its forwards.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.overlap_policy import megatron_reduce_line
from meshplan.schedule.steptime import step_time
from meshplan.search.comm_bounds import comm_times
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates
from meshplan.search.step_end_bound import stage_end_bound
from meshplan.search.time_tables import TimeTables
from meshplan.search.timing import step_lower_bound
from nccl_published import ndr_ring_s
from test_search import MOE, config
from tests.configs import MIXTRAL_8X22B

#: /work/trial28/job.toml as `meshplan import megatron` wrote it: Mixtral 8x22B (tests/configs.py's shape;
#: the import's linear_bias and qkv_bias false are the defaults, its norm_eps 1e-5 changes no size), 64 DGX
#: H100, pp 8 x vpp 7 (one layer a chunk), dp 32, tp 2 + SP, ep 8, the distributed optimizer, both overlaps
TRAINING = {"global_batch": 1024, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1", "recompute": "selective",
            "param_dtype": "bf16", "compute_dtype": "bf16", "grad_reduce_dtype": "fp32", "framework": "megatron",
            "vocab_pad_divisor": 128, "moe_dropless": True, "overlap_grad_reduce": True, "flash_attention": True}
MESH = {"names": ["pp", "dp", "tp", "ep", "etp"], "shape": [8, 32, 2, 8, 1], "sequence_parallel": True,
        "virtual_stages": 7, "pp_schedule": "interleaved_1f1b"}


def _plan(overlap_param_gather: bool):
    return build_plan(config_from_dict({"model": MIXTRAL_8X22B, "cluster": {"system": "dgx-h100", "nodes": 64},
                                        "training": {**TRAINING, "overlap_param_gather": overlap_param_gather},
                                        "mesh": MESH}))


def test_interleaved_overlap_param_gather_exposes_chunk_zero_by_hand():
    """Stage 0 holds layers 0, 8, ..., 48, one a chunk, and the embedding in chunk 0. Per rank:
    experts 8 / ep 8 = 1 routed expert a layer, 3 x 6144 x 16384 = 301,989,888 elements (etp 1).
    Dense: the embedding 32768 x 6144 / tp 2 = 100,663,296; a layer's attention (6144^2 x 2 + 6144 x
    1024 x 2) / 2 = 44,040,192, the router 6144 x 8 = 49,152 and two norms 2 x 6144 = 12,288:
    44,101,632. Megatron buckets only pipeline rank 0's chunk 0 (megatron_buckets.megatron_bucketed),
    B = max(40e6, 1e6 x 32) = 4e7: dense chunk 0, 100,663,296 + 44,101,632 = 144,764,928 = 3 x 4e7 +
    24,764,928, the 6 other chunks one bucket each of 44,101,632; experts chunk 0 7 x 4e7 + 21,989,888,
    the others one of 301,989,888 each (bf16: x 2 B in the table). The expert group (8 ranks, one per
    node, one NIC each: 50 GB/s) moves 7/8 of each bucket through its NIC: chunk 0's 603,979,776 B is
    >= 603,979,776 x 7/8 / 50e9 = 10.57 ms at line rate. Exposed: chunk 0's buckets, each at its own
    size's seconds, dense then expert; off, all of it, and nothing else moves. On the catalog's NIC
    curve (47.10 GB/s per NIC: tests/nccl_published.py ndr_ring_s), a ring of 8 at LL's 6.6 + 7 x
    2.7 us: experts 7 x (25.5 us + 7/8 x 80,000,000 B / 47.10 GB/s = 1,511.8 us) + 842.6 us for the
    43,979,776 B bucket = 11.43 ms (11.41 while chunk 0's bytes were timed at the 80 MB bucket's
    busbw); dense over dp 32 (4 ranks a node on 4 NICs, 6.6 + 31 x 2.7 us): 3 x 501.7 + 345.0 us = 1.85 ms."""
    on, off = _plan(True), _plan(False)
    assert on.stages[0] == [[0], [8], [16], [24], [32], [40], [48]]
    expert_layer, dense_layer, emb = 3 * 6144 * 16384, (6144 * 6144 * 2 + 6144 * 1024 * 2) // 2 + 6144 * 8 + 2 * 6144, 32768 * 6144 // 2
    assert (expert_layer, dense_layer) == (301_989_888, 44_101_632)
    rows = {ax: [r for r in on.stage(0).collectives if r.axis == ax and r.phase == "step" and r.op == "all-gather"]
            for ax in ("dp", "efsdp")}
    first = {ax: [r for r in rs if "model chunk 0" in r.cadence] for ax, rs in rows.items()}
    assert sorted((r.size_bytes, r.per_step) for r in first["dp"]) == [(2 * 24_764_928, 1), (2 * 40_000_000, 3)]
    assert sorted((r.size_bytes, r.per_step) for r in rows["dp"] if r not in first["dp"]) == [(2 * dense_layer, 6)]
    assert sorted((r.size_bytes, r.per_step) for r in first["efsdp"]) == [(2 * 21_989_888, 1), (2 * 40_000_000, 7)]
    assert sorted((r.size_bytes, r.per_step) for r in rows["efsdp"] if r not in first["efsdp"]) == [(2 * expert_layer, 6)]
    assert sum(r.size_bytes * r.per_step for r in rows["efsdp"]) == 2 * 7 * expert_layer
    assert sum(r.size_bytes * r.per_step for r in rows["dp"]) == 2 * (emb + 7 * dense_layer)
    g = {ax: sum(r.time_s * r.per_step for r in rs) for ax, rs in rows.items()}
    g0 = {ax: sum(r.time_s * r.per_step for r in rs) for ax, rs in first.items()}
    bucket = next(r for r in rows["efsdp"] if r.size_bytes == 80_000_000)
    busbw = bucket.size_bytes * 7 / 8 / bucket.time_s
    assert (bucket.group_size, bucket.path.nic_bandwidth_bytes_per_s) == (8, 50e9) and 0.9 * 50e9 < busbw <= 50e9
    st_on, st_off = step_time(on), step_time(off)
    gathers = [(e.stream, e.end_s - e.start_s) for e in st_on.post_events
               if e.stage == 0 and e.name == "param all-gather (per step)"]
    assert [k for k, _ in gathers] == ["dp", "efsdp"]
    for k, dur in gathers:
        assert dur == pytest.approx(g0[k], rel=1e-9)
    assert 2 * expert_layer * 7 / 8 / 50e9 <= dict(gathers)["efsdp"]
    efsdp = 7 * ndr_ring_s(8, 1, 2 * 40_000_000) + ndr_ring_s(8, 1, 2 * 21_989_888)
    dense = 3 * ndr_ring_s(32, 4, 2 * 40_000_000) + ndr_ring_s(32, 4, 2 * 24_764_928)
    assert dict(gathers) == {"efsdp": pytest.approx(efsdp, rel=1e-9), "dp": pytest.approx(dense, rel=1e-9)}
    assert (round(efsdp * 1e3, 2), round(dense * 1e3, 2)) == (11.43, 1.85)
    # off: the whole gather after the optimizer step; every other part the same
    assert st_off.step_s - st_on.step_s == pytest.approx(sum(g[k] - g0[k] for k in g), rel=1e-6)
    assert "chunk 0" in megatron_reduce_line(on.config.training, vpp=7)


def test_pipeline_ranks_after_the_first_reduce_each_chunk_in_one_bucket():
    """Megatron-LM turns bucketing off on pipeline ranks > 0 and for every local chunk after the
    first (megatron_buckets.megatron_bucketed): the same Mixtral plan's stage 1 (layers 1, 9, ..., 49)
    reduce-scatters and all-gathers each chunk's buffer in one call: dense 44,101,632 elements x fp32
    4 B = 176,406,528 B reduced, x bf16 2 B = 88,203,264 B gathered, 7 of each; experts 301,989,888 x
    4 = 1,207,959,552 B and x 2 = 603,979,776 B, 7 of each. Exposed under --overlap-param-gather
    (interleaved): chunk 0's one bucket, 1/7 of each stream's seconds (the 7 calls are alike)."""
    on = _plan(True)
    rows = sorted((r.axis, r.op, r.size_bytes, r.per_step) for r in on.stage(1).collectives if r.phase == "step"
                  and r.axis in ("dp", "efsdp"))
    assert rows == [("dp", "all-gather", 88_203_264, 1), ("dp", "all-gather", 88_203_264, 6),
                    ("dp", "reduce-scatter", 176_406_528, 1), ("dp", "reduce-scatter", 176_406_528, 6),
                    ("efsdp", "all-gather", 603_979_776, 1), ("efsdp", "all-gather", 603_979_776, 6),
                    ("efsdp", "reduce-scatter", 1_207_959_552, 1), ("efsdp", "reduce-scatter", 1_207_959_552, 6)]
    g = {ax: sum(r.time_s * r.per_step for r in on.stage(1).collectives if r.phase == "step" and r.axis == ax
                 and r.op == "all-gather") for ax in ("dp", "efsdp")}
    gathers = [(e.stream, e.end_s - e.start_s) for e in step_time(on).post_events
               if e.stage == 1 and e.name == "param all-gather (per step)"]
    assert [k for k, _ in gathers] == ["dp", "efsdp"]
    for k, dur in gathers:
        assert dur == pytest.approx(g[k] / 7, rel=1e-9)


@pytest.mark.parametrize("moe", [False, True])
def test_search_bound_of_the_chunk_zero_gather_stays_below_the_exact_step(moe):
    """The search's step-end bound (search.step_end_bound: the optimizer step and, with virtual
    stages, chunk 0's fewest dense elements over the stage's as the share of one whole-stage
    all-gather call) is at most each stage's exact optimizer step + exposed parameter all-gather,
    and the step's lower bound at most the exact step; pp 2 x vpp 2 over 16 GPUs (dp 8), the small
    dense model (8 layers: 2 a chunk, the embedding in stage 0's chunk 0, the head in stage 1's
    chunk 1) and the small MoE one (4 layers, the first dense). Tight where chunk 0 holds only
    layers of one kind (the dense model's stage 1: its share is 2 layers / (4 layers + head) in both):
    within 5%; the first-bucket bound it replaces, G / buckets, gave 2629.1 us against 2943.8 (0.89)."""
    cfg = config(2, hbm_gb=80.0, model=MOE if moe else None, micro_batch=[1], recompute=["selective"],
                 sharding=["zero1"], pp=[2], vpp=[2], tp=[1],
                 training={"framework": "megatron", "sharding": "zero1", "overlap_grad_reduce": True,
                           "overlap_param_gather": True})
    c = enumerate_candidates(cfg)
    i = int(np.flatnonzero((c.vpp == 2) & (c.pp == 2) & (c.sh == SHARDING.index("zero1")) & (c.fsdp == 8))[0])
    g = c.take(np.array([i]))
    tt = TimeTables(cfg, Tables(cfg))
    st = stage_layout(cfg, g, 2)
    s = state(cfg, tt.tables, g, st)
    end, _ = stage_end_bound(cfg, tt, g, st, s, comm_times(cfg, tt, g))
    cc = candidate_config(cfg, c, i)
    plan = build_plan(cc, cons.Constraints((), cons.usable_bytes(cc.cluster, cc.training)), memory=False,
                      reports=False)
    res = step_time(plan)
    exact = [sum(e.end_s - e.start_s for e in res.post_events if e.stage == k and e.name in
                 ("optimizer step", "param all-gather (per step)")) for k in range(2)]
    assert all(end[0, k] <= exact[k] * (1 + 1e-9) for k in range(2)), (end, exact)
    assert float(step_lower_bound(cfg, tt, g, st, s)[0]) <= res.step_s * (1 + 1e-9)
    if not moe:
        assert end[0, 1] >= 0.95 * exact[1]
