"""The search's step bound counts the wait after each chunk's last backward with pp > 1 (issue 11,
item 7): torch's ``PipelineStage.perform_reduce_grad`` copies each FSDP unit's gradient in,
reduce-scatters it (and all-reduces it over dp_replicate with HSDP), and holds the compute stream
until all are done (grad_reduce.perform_reduce_grad), on every chunk but the one whose last
backward ends the stage's order. Before, the bound left that wait out and sat at 0.50-0.75 of the
exact step on the 405B example's interleaved FSDP/HSDP candidates: the ranking planned 1,612 of
them exactly."""

from __future__ import annotations

import numpy as np

from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.unit_sim import Overlap
from meshplan.schedule.steptime import step_time
from meshplan.search.memory import Tables, stage_layout, state
from meshplan.search.pipeline import pipeline_bound
from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates
from meshplan.search.comm_bounds import comm_times, fsdp_copies
from meshplan.search.layer_bounds import unit_bounds
from meshplan.search.time_tables import TimeTables
from test_search import config
from test_search_vppsplit import SMALL14


def row_bounds(cfg, c, i: int, pp: int):
    """Candidate ``i``'s search terms as the vectorised bound sees them: (its one-row columns, time
    tables, stage layout at ``pp``, unit bounds, comm times, FSDP copy times)."""
    g = c.take(np.array([i]))
    tt = TimeTables(cfg, Tables(cfg))
    st = stage_layout(cfg, g, pp)
    u = unit_bounds(cfg, tt, g, st, state(cfg, tt.tables, g, st))
    return g, tt, st, u, comm_times(cfg, tt, g), fsdp_copies(cfg, tt.tables, g)


def _units(w: float, red: float = 0.0) -> dict:
    one = np.ones((1, 2))
    zero = np.zeros((1, 2))
    return {"f_core": one, "b_core": 2 * one, "emb_f": zero, "emb_b": zero, "head_f": zero, "head_b": zero,
            "p2p": np.zeros((1, 1)), "tail": zero, "end": zero, "b_red": red * one, "b_wait": w * one}


def test_wait_on_the_interleaved_dag_by_hand():
    # interleaved 1F1B, p 2, m 2, v 2, F 1, B 2, no sends. Stage 0 runs F0c0 F1c0 F0c1 F1c1 B0c1
    # B1c1 B0c0 B1c0, stage 1 F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 B0c0 B1c0: both end with chunk 0, so
    # chunk 1's last backward (B1c1) waits w on each. Stage 1: F0c0 [1, 2], F1c0 [2, 3], F0c1
    # [3, 4], B0c1 [4, 6], F1c1 [6, 7], B1c1 [7, 9 + w]; stage 0: B0c1 [6, 8], B1c1 [9 + w,
    # 11 + 2w]; stage 1: B0c0 [9 + w, 11 + w], B1c0 [11 + 2w, 13 + 2w]; stage 0: B0c0 [11 + 2w,
    # 13 + 2w], B1c0 [13 + 2w, 15 + 2w]. The step: 15 + 2w (15 without the wait).
    assert pipeline_bound(_units(0.0), 2, 2)[0] == 15.0
    assert pipeline_bound(_units(0.5), 2, 2)[0] == 16.0
    # the copy-ins alone (b_red) on the chunk that ends the stage run after its send: nothing added
    # to that unit; on chunk 1's last backward the larger of the two
    assert pipeline_bound(_units(0.0, red=0.25), 2, 2)[0] == 15.5
    assert pipeline_bound(_units(0.5, red=0.25), 2, 2)[0] == 16.0


def test_wait_is_the_flow_shop_of_the_simulated_reductions():
    """On the 14-layer workload over 16 GPUs (pp 4, vpp 2; stage 1 holds 2 layers per chunk), an
    HSDP candidate (dp_replicate 2 x dp_shard 2): stage 1's last backward of chunk 1 lasts its other backwards plus its wait, which
    the bound gives as copy-in + reduce-scatter + all-reduce of one layer + (n - 1) x the
    longest of the three (n = 2 layers: three serial streams, identical jobs). Under FSDP2's one
    reduce-scatter in flight (grad_reduce.rs_buffer_wait, torch 2.13 _fsdp_param_group.py 639-658) a
    copy-in waits for the reduce-scatter before, so copy-in and reduce-scatter are one stage: ci + rs +
    ar + max(ci + rs, ar) = 80.76 + 258.38 + 265.32 + 339.15 = 943.62 us (878.79 us with max(ci, rs, ar))."""
    cfg = config(2, model=SMALL14, micro_batch=[1], recompute=["full"], pp=[4])
    c = enumerate_candidates(cfg)
    hsdp = np.flatnonzero((c.vpp == 2) & (c.sh == SHARDING.index("hsdp")) & (c.dps > 1) & (c.dpr > 1) & (c.rf == 0))
    assert len(hsdp)
    i = int(hsdp[0])
    g, tt, st, u, cm, cp = row_bounds(cfg, c, i, 4)
    ci, rs, ar = float(cp["in"][0]), float(cm["fsdp_rs"][0]), float(cm["hsdp_ar"][0])
    assert st.n_chunk[0, 1] == 2 and rs > 0 and ar > 0
    assert np.isclose(u["b_wait"][0, 1], ci + rs + ar + max(ci + rs, ar))
    cc = candidate_config(cfg, c, i)
    plan = build_plan(cc, cons.Constraints((), cons.usable_bytes(cc.cluster, cc.training)), memory=False,
                      reports=False)
    res = step_time(plan, Overlap()).pipeline
    f, dur = res.flat, res.end - res.start
    m = int(res.spec.m)
    unit = lambda mb: dur[np.flatnonzero((f.stage == 1) & (f.kind == 1) & (f.chunk == 1) & (f.mb == mb))[0]]
    waited = unit(m - 1) - unit(0)
    # a lower bound of the simulated wait, and nearly all of it
    assert 0.9 * waited <= u["b_wait"][0, 1] <= waited * (1 + 1e-9), (u["b_wait"][0, 1], waited)


def test_backward_chain_adds_the_tp_collective_after_the_weight_gradients_under_torch():
    """layer_timeline._block_backward without Overlap.tp or tp_grad (torch, tp_comm_overlap off):
    each block's weight gradients run, then its input-gradient TP collective, and the next block
    waits for it; Megatron-LM (tp_grad) runs the collective beside the weight gradients. One
    layer, recompute none, no CP/EP: input gradients 3 + 5 (attention, MLP), weight gradients 2
    + 4, TP collectives 1 each (gather before, reduce-scatter after, tp 2 with SP): serial
    (1 + 3 + 2 + 1) + (1 + 5 + 4 + 1) = 18; beside: (1 + 3 + max(2, 1)) + (1 + 5 + max(4, 1)) = 16."""
    from meshplan.search.layer_bounds import chains
    from meshplan.search.time_tables import OP_FIELDS

    one = lambda v: np.array([float(v)])
    o = {k: one(0) for k in OP_FIELDS}
    o.update(bi_attn=one(3), bi_mlp=one(5), bw_attn=one(2), bw_mlp=one(4))
    cm = {k: one(0) for k in ("tp_ar", "cp_ag", "cp_rs", "ep")}
    cm["tp_sp"] = cm["tp_ag"] = one(1)  # tp_ag: the gathers before the blocks (float8 ones apart)
    cm["amax_f"] = cm["amax_b"] = one(0)  # no float8 amax all-reduces (bf16 GEMMs; fp8rest added the keys)
    c = type("C", (), {"ov": np.array([0]), "rc": np.array([0]), "cp": np.array([1])})()  # cp 1: no CP
    assert chains(c, o, cm, False, np.array([True]))[1].tolist() == [18.0]
    assert chains(c, o, cm, False, np.array([False]))[1].tolist() == [16.0]
