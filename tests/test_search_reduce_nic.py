"""The tail of the unit that ends a stage's order (step_end_bound.final_reduce_tail) with its
reduce-scatters and HSDP all-reduces sharing the rank's NIC (perf10, issue 11 item 7): the flow
shop took the fsdp and the dp_replicate streams as two machines at full speed side by side; the
rank timeline runs both as network collectives at their max-min fair share of one NIC
(schedule.unit_sim.StreamSim.comm), so from the first copy-in on they take at least the two
queues' least time (search.nic_bounds.two_queues_s). On the 405B example's
``pp 8 x dp_replicate 64 x cp 4 x tp 8, vpp 1, hsdp`` stage 0's tail bound rose from 398 ms to
590 ms against 632 ms simulated (less the optimizer step), its refined step bound from 8.438 s to
8.631 s (exact 8.767 s).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import config_from_dict
from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates
from meshplan.search.step_end_bound import final_reduce_tail
from test_search_reduce_wait import row_bounds
from test_search_vppsplit import SMALL14


def test_final_tail_counts_the_nic_the_two_reduction_queues_share():
    """pp 2 x dp_replicate 2 x dp_shard 2 x cp 2 x tp 4 (HSDP, vpp 1) on 8 DGX H100 nodes: a node
    holds one (cp, tp) block of 8 ranks, so the layer's reduce-scatter over fsdp = dp_shard x cp (4
    ranks, 4 apart) and its all-reduce over dp_replicate (2 ranks, 16 apart) both cross the network.
    Each stage's last unit (micro-batch 15's backward) reduces its 7 layers after its end: per layer
    copy-in ci, reduce-scatter rs, all-reduce ar. By hand from the tables: demands d = NIC s / s,
    both above 0.5, so together each gets half the NIC and runs at r = 0.5 / d of its speed; the two
    queues of 7 calls take at least T = 7 rs + 7 ar - min(k_a 7 rs, k_b 7 ar), k = (r_a + r_b - 1) / r
    (nic_bounds.two_queues_s), and at least the NIC's 7 (rs_nic + ar_nic); the reductions end no
    earlier than ci + T after the unit. Less the 7 copy-ins (counted in the stage's busy time) that
    is the tail bound: 3.021 ms, where the flow shop gave 2.516 ms, both under the simulated tail
    less the copy-ins (3.878 ms: latency-bound calls the rates do not see)."""
    cfg = config_from_dict({"model": SMALL14, "cluster": {"system": "dgx-h100", "nodes": 8},
                            "training": {"global_batch": 64, "seq_len": 2048},
                            "search": {"micro_batch": [1], "recompute": ["full"], "pp": [2], "tp": [4], "cp": [2]}},
                           require_mesh=False)
    c = enumerate_candidates(cfg)
    i = int(np.flatnonzero((c.vpp == 1) & (c.sh == SHARDING.index("hsdp")) & (c.dps == 2) & (c.rf == 0))[0])
    assert c.label(i) == "pp 2 x dp_replicate 2 x dp_shard 2 x cp 2 x tp 4, mb 1, full, vpp 1, hsdp"
    _, _, st, u, cm, cp = row_bounds(cfg, c, i, 2)
    ci, rs, ar = float(cp["in"][0]), float(cm["fsdp_rs"][0]), float(cm["hsdp_ar"][0])
    rs_nic, ar_nic = float(cm["fsdp_rs_nic"][0]), float(cm["hsdp_ar_nic"][0])
    assert st.n_chunk.tolist() == [[7, 7]] and 0.5 < rs_nic / rs <= 1 and 0.5 < ar_nic / ar <= 1
    r_a, r_b = 0.5 / (rs_nic / rs), 0.5 / (ar_nic / ar)
    k_a, k_b = (r_a + r_b - 1) / r_a, (r_a + r_b - 1) / r_b
    queues = max(7 * rs + 7 * ar - min(k_a * 7 * rs, k_b * 7 * ar), 7 * (rs_nic + ar_nic))
    by_hand = ci + queues - 7 * ci
    flow_shop = rs + ar + 6 * max(ci + rs, ar) - 6 * ci  # FSDP2's one reduce-scatter in flight (rs_wait)
    assert np.isclose(final_reduce_tail(np.array(7), ci, rs, ar, True), flow_shop, rtol=1e-12)
    assert np.isclose(by_hand, 3.021e-3, atol=1e-6) and np.isclose(flow_shop, 2.516e-3, atol=1e-6)
    cc = candidate_config(cfg, c, i)
    plan = build_plan(cc, cons.Constraints((), cons.usable_bytes(cc.cluster, cc.training)), memory=False,
                      reports=False)
    sim = step_time(plan, Overlap())
    for k in (0, 1):
        assert np.isclose(u["tail"][0, k], by_hand, rtol=1e-12)
        assert u["tail"][0, k] <= sim.units.get(k, 0, "B", sim.units.spec.m - 1).tail_s - 7 * ci
