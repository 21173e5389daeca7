"""Issue 4 items 1 and 3: readiness, concurrency and edge load on the seed example."""

import pytest

from meshplan.comm.alphabeta import busbw_factor
from meshplan.schedule.linkload import concurrency, edge_loads
from meshplan.schedule.readiness import timings
from meshplan.plan import build_plan
from meshplan.config import load_config
from meshplan.schedule.steptime import step_time


@pytest.fixture(scope="module")
def seed():
    from tests.conftest import EXAMPLES
    p = build_plan(load_config(EXAMPLES / "seed-64gpu.toml"))
    return p, step_time(p)


def test_nic_load_is_four_shard_groups(seed):
    p, st = seed
    rows = [r for r in p.collectives["stage 0"] if r.path.kind == "network"]
    # one member of each dp_shard group per node; GPUs 0-3 share nic0: 4 groups per NIC
    per_group = sum(r.size_bytes * busbw_factor(r.op, r.group_size) * r.per_step for r in rows)
    loads = {e.edge: e for e in edge_loads(p, st)}
    nic0 = loads["node 0 NIC nic0 (rail 0)"]
    assert nic0.bytes_per_step == pytest.approx(4 * per_group)
    assert nic0.capacity_bytes_per_s == 400e9 / 8
    assert not nic0.fits  # the FSDP traffic of 4 GPUs on one 400 Gb/s NIC does not hide behind compute
    # shard groups stay on their rail: nothing goes up to the spine
    assert not [e for e in loads if "uplink" in e]
    nv = loads["rank 0 nvlink4"]
    tp = [r for r in p.collectives["stage 0"] if r.path.kind == "nvlink"]
    assert nv.bytes_per_step == pytest.approx(sum(r.size_bytes * busbw_factor(r.op, 8) * r.per_step for r in tp))
    assert nv.fits


def test_timings_blocking_and_prefetched(seed):
    _, st = seed
    t = {(x.stream, x.phase, x.op): x for x in timings(st)}
    tp = t[("tp", "forward", "all-gather")]
    assert tp.slack_s == pytest.approx(0.0)  # the next GEMM waits on it
    rs = t[("fsdp", "backward", "reduce-scatter")]
    assert rs.deadline_s > rs.ready_s + rs.duration_s  # only the optimizer step waits on it
    assert rs.slack_s > 0


def test_fsdp_and_tp_run_concurrently(seed):
    _, st = seed
    c = concurrency(st)
    assert c[("fsdp", "tp")] > 0


def test_cross_rail_groups_use_spine():
    from meshplan.config import config_from_dict
    # tp outermost: dp_shard groups (stride 1) are inside a node; tp groups (stride 2) span... use a
    # placement where shard groups mix local GPUs: rank_to_gpu swaps two GPUs of node 1
    perm = list(range(16))
    perm[8], perm[9] = perm[9], perm[8]
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 16, "seq_len": 2048, "param_dtype": "fp32"},
         "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 8], "rank_to_gpu": perm}}
    p = build_plan(config_from_dict(d))
    loads = {e.edge: e for e in edge_loads(p, step_time(p))}
    # rank 0 (node 0 GPU 0, rail 0) and rank 8 (node 1 GPU 1, rail 1) share a shard group: via the spine
    # (both nodes sit under one leaf of the 32-node scalable unit: its uplinks, 2 nodes x 400 Gb/s)
    up = "rail {} uplinks to spine (nodes 0-1)"
    assert up.format(0) in loads and up.format(1) in loads
    assert up.format(2) not in loads
    assert loads[up.format(0)].capacity_bytes_per_s == 2 * 400e9 / 8


# The link report on arrays (StepTime.stage_detail) against the per-event loops it replaced,
# over the whole event list of StepTime.trace_events (issue 11 item 4: the 16,384-GPU step).

def _timings_loop(st, stage=0):
    from meshplan.schedule.readiness import Timing, _op_of
    events = st.trace_events(detail=True, stage=stage)
    compute = sorted((e for e in events if e.stream == "compute"), key=lambda e: e.start_s)
    opt = next((e.start_s for e in events if "optimizer" in e.name), max(e.end_s for e in events))
    seen, out = set(), []
    for e in sorted(events, key=lambda e: e.start_s):
        if e.stream in ("compute", "p2p") or e.stream.startswith("stage"):
            continue
        unit = e.args.get("unit", "")
        phase = "forward" if unit.startswith("F") else "backward" if unit[:1] in ("B", "W") else "step"
        # the per-step reduction's pieces inside the last backward: the table's step rows (not ZeRO-2's per-mb ones)
        inside = phase == "backward" and e.name.startswith("grad reduce") and not st.units.comms[stage].mb_reduce_s
        table = st.units.comms[stage].reduce_phases_by.get(e.stream, ())  # the rows' phase where they have one
        phase = (next(iter(table)) if len(table) == 1 else "step") if inside else phase
        key = (e.stream, phase, _op_of(e.name))
        if key in seen or not key[2]:
            continue
        seen.add(key)
        words = e.name.split()
        if e.stream in ("fsdp", "efsdp") and "AG" in words:
            dl = next((c.start_s for c in compute if c.name == words[-1] and c.start_s >= e.start_s), e.end_s)
        elif e.stream == "cp":  # the Q projection (or its input gradient) it runs beside, in its own unit
            dl = next((c.end_s for c in compute if c.args.get("unit") == unit and c.start_s >= e.start_s
                       and c.name.endswith((" Q proj", " Q proj B"))), e.end_s)
        elif e.stream in ("dp_replicate", "dp") and "all-gather" in e.name or e.name.startswith("param all-gather"):
            dl = e.end_s  # ZeRO-1's parameter all-gather after the optimizer ends the step
        elif "RS" in words or "norm-grad" in e.name or e.stream in ("dp_replicate", "dp") \
                or e.name.startswith("grad reduce"):  # the per-step reduction's part over tp, pp or efsdp
            dl = opt
        else:
            dl = e.end_s
        # a layer's SP norm-weight gradient all-reduces are one event of the table's calls per layer
        # (nc54 #9; tests/test_nc54b_step_rows.py derives 161 / 80 for Llama-3-70B)
        calls = st.units.comms[stage].async_calls if "norm-grad" in e.name else 1.0
        out.append(Timing(e.stream, phase, key[2], e.start_s, dl, e.end_s - e.start_s,
                          "in the last backward" if inside else "", calls or 1.0))
    return out


def _concurrency_loop(st, stage=0):
    ev = sorted((e for e in st.trace_events(detail=True, stage=stage) if e.stream != "compute"
                 and e.end_s > e.start_s), key=lambda e: e.start_s)
    out, active = {}, []
    for e in ev:
        active = [a for a in active if a.end_s > e.start_s]
        for a in active:
            if a.stream != e.stream:
                key = tuple(sorted((a.stream, e.stream)))
                out[key] = out.get(key, 0.0) + min(a.end_s, e.end_s) - e.start_s
        active.append(e)
    return out


def _pp_plan(framework):
    from meshplan.config import config_from_dict
    return build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3",
                     "recompute": "selective", "framework": framework},
        "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [4, 2, 4], "sequence_parallel": True,
                 "pp_schedule": "interleaved_1f1b", "virtual_stages": 2}}))


def test_zero1_parameter_all_gather_ends_the_step():
    """ZeRO-1 all-gathers the updated parameters after the optimizer step: nothing later waits
    on it but the step's end, so its deadline is its own end (slack 0, all exposed), never the
    optimizer's start (before it is even issued: a negative slack)."""
    from meshplan.config import config_from_dict
    p = build_plan(config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
        "training": {"global_batch": 16, "seq_len": 2048, "sharding": "zero1"},
        "mesh": {"names": ["dp"], "shape": [16]}}))
    st = step_time(p)
    t = {(x.stream, x.phase, x.op): x for x in timings(st)}
    ag = t[("dp", "step", "all-gather")]
    opt = next(e for e in st.post_events if e.stage == 0 and "optimizer" in e.name)
    assert ag.ready_s >= opt.end_s - 1e-12  # issued after the optimizer step
    assert ag.deadline_s == pytest.approx(ag.ready_s + ag.duration_s) and ag.slack_s == pytest.approx(0.0)
    assert ag.deadline_s == pytest.approx(st.step_s)
    assert all(x.slack_s >= -1e-12 for x in t.values() if x.stream == "dp")


def _cp_plan():
    from tests.conftest import ROOT
    return build_plan(load_config(ROOT / "tests" / "data" / "validate_llama8b_cp2_fsdp.toml"))


@pytest.mark.parametrize("which", ["seed", "pp-torch", "pp-megatron", "cp"])
def test_arrays_equal_the_event_loops(seed, which):
    p, st = seed if which == "seed" else (lambda q: (q, step_time(q)))(
        _cp_plan() if which == "cp" else _pp_plan(which.split("-")[1]))
    for stage in sorted({0, st.critical_stage}):
        assert timings(st, stage) == _timings_loop(st, stage)
        got, ref = concurrency(st, stage), _concurrency_loop(st, stage)
        assert got.keys() == ref.keys() and ref
        assert all(got[k] == pytest.approx(ref[k], rel=1e-9) for k in ref)
        events = st.trace_events(detail=True, stage=stage)
        compute_s = sum(e.end_s - e.start_s for e in events if e.stream == "compute" and "unit" in e.args)
        assert edge_loads(p, st, stage)[0].interval_s == pytest.approx(compute_s, rel=1e-12)


# Issue 11 (links): a ring that spans nodes sends (g-1)/g of a rank's ring bytes to its NVLink
# neighbour and 1/g through a NIC (g = the group's ranks per node; NCCL's multi-node rings leave
# each node once per channel). Bytes derived by hand from Llama 3 8B's shapes.

#: Llama 3 8B (h 4096, ffn 14336, 32 heads of 128, 8 KV heads, vocab 128,256): elements of one
#: FSDP layer unit (wq, wk, wv, wo, w1, w2, w3, two norms) and of the root unit (embedding,
#: output layer, final norm); every dim 0 divides by 16, so no FSDP padding.
LAYER_NUMEL = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096   # 218,112,000
ROOT_NUMEL = 2 * 128256 * 4096 + 4096                                             # 1,050,677,248
EMB_NUMEL = 128256 * 4096                            # the embedding's own FSDP2 unit: 525,336,576


def _dp_plan(nodes: int, global_batch: int, shape: int):
    from meshplan.config import config_from_dict
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": nodes},
         "training": {"global_batch": global_batch, "seq_len": 4096},
         "mesh": {"names": ["dp_shard"], "shape": [shape]}}
    p = build_plan(config_from_dict(d))
    return p, {e.edge: e for e in edge_loads(p, step_time(p))}


def _zero3_buffer_bytes_per_step(micro_batches: int) -> int:
    """S summed over a step's FSDP calls: per micro-batch each of the 32 layer units gathered in
    forward and again in backward (bf16, resharded after forward) and its gradient
    reduce-scattered (fp32); the ends as torchtitan's two units, each gathered once and reduced
    once per micro-batch, the embedding's (resharded after forward) gathered again in backward."""
    layers = 32 * micro_batches * (2 * LAYER_NUMEL * 2 + LAYER_NUMEL * 4)
    root = micro_batches * (ROOT_NUMEL * 2 + ROOT_NUMEL * 4 + EMB_NUMEL * 2)
    return layers + root


def test_ring_across_two_nodes_loads_nvlink_and_nics():
    # the dp16.toml: dp_shard 16 over 2 DGX H100 (8 GPUs, 8 NICs each), 2 micro-batches
    p, loads = _dp_plan(2, 32, 16)
    assert {r.algorithm for r in p.collectives["stage 0"]} == {"ring"}
    sent = 15 / 16 * _zero3_buffer_bytes_per_step(2)   # ring all-gather / reduce-scatter: (n-1)/n S
    assert sent == pytest.approx(118.483891e9, rel=1e-8)  # the rank's 118.5 GB of step --json
    nv = loads["rank 0 nvlink4"]
    assert nv.bytes_per_step == pytest.approx(7 / 8 * sent, rel=1e-12)   # 103.7 GB, was 0.0
    nics = [e for k, e in loads.items() if k.startswith("node 0 NIC")]
    assert len(nics) == 8
    # each rank sends 1/8 of its bytes out of the node; the node's 8 ranks over its 8 NICs
    for e in nics:
        assert e.bytes_per_step == pytest.approx(8 * (sent / 8) / 8, rel=1e-12)   # 14.81 GB
    # per layer and micro-batch: the layer units' three calls plus the ends' five spread over 32 layers
    per_layer = 15 / 16 * (2 * LAYER_NUMEL * 2 + LAYER_NUMEL * 4 + (ROOT_NUMEL * 6 + EMB_NUMEL * 2) / 32)
    assert nv.per_layer_bytes == pytest.approx(7 / 8 * per_layer, rel=1e-12)
    assert nics[0].per_layer_bytes == pytest.approx(per_layer / 8, rel=1e-12)
    # each node holds the ring on all 8 rails: NCCL keeps every channel on its NIC's rail, so
    # nothing goes up to the spine (the two nodes share a leaf)
    assert not [k for k in loads if "uplink" in k]
    # 103.7 GB at 450 GB/s hides behind the step's compute: the verdict reads "fits"
    assert nv.busy_s == pytest.approx(7 / 8 * sent / 450e9, rel=1e-12) and nv.fits


def test_one_node_ring_is_all_nvlink():
    # dp_shard 8 on one node, 2 micro-batches: every byte on NVLink, as before, and no NIC
    p, loads = _dp_plan(1, 16, 8)
    assert list(loads) == ["rank 0 nvlink4"]
    assert loads["rank 0 nvlink4"].bytes_per_step == pytest.approx(7 / 8 * _zero3_buffer_bytes_per_step(2),
                                                                  rel=1e-12)


def test_link_split_of_each_algorithm():
    from meshplan.comm.row import link_bytes
    S = 1e9
    # hierarchical all-reduce, 4 nodes x 8: reduce-scatter and all-gather inside on S, the
    # all-reduce across the 4 nodes on S/8
    assert link_bytes("all-reduce", "hierarchical", 32, S, 4, 8) == pytest.approx((2 * 7 / 8 * S, 2 * 3 / 4 * S / 8))
    # the double binary tree sends the same: chain hops inside, tree edges between nodes
    assert link_bytes("all-reduce", "tree", 32, S, 4, 8) == link_bytes("all-reduce", "hierarchical", 32, S, 4, 8)
    # ring all-reduce: 2 (n-1)/n S, 7/8 of it on NVLink
    assert link_bytes("all-reduce", "ring", 32, S, 4, 8) == pytest.approx((2 * 31 / 32 * S * 7 / 8, 2 * 31 / 32 * S / 8))
    # one rank per node: everything through the NIC
    assert link_bytes("all-gather", "ring", 4, S, 4, 1) == (0.0, 3 / 4 * S)
    # a send/recv moves S once, to one peer: pp 2 with one stage per node, stage 0's activation
    # goes whole through its NIC (and into stage 1's), nothing on NVLink
    assert link_bytes("send/recv", "ring", 2, S, 2, 1) == (0.0, S)
    # pipeline of 4 stages, 2 per node (stages 0,1 | 2,3): node 0's one hop out is stage 1 -> 2, S
    # through stage 1's NIC; stage 0 -> 1 is S on NVLink: per rank of the node (S/2, S/2), a node
    # sending 2 x S/2 = S. (Was (2/3 S, 1/3 S), the chain's 1 crossing of 3 hops averaged over the
    # ranks, so node 0 sent 2/3 S where its boundary rank's NIC carries S.)
    assert link_bytes("send/recv", "ring", 4, S, 2, 2) == pytest.approx((S / 2, S / 2))
    # the cp ring's dK/dV shift, cp 16 over 2 x 8 (ranks 0-7 | 8-15): of node 0's 8 shifts 7 stay on
    # NVLink, 7 -> 8 leaves (as 15 -> 0 leaves node 1): (7/8 S, 1/8 S) per rank (was 14/15 S, 1/15 S)
    assert link_bytes("send/recv", "ring", 16, S, 2, 8) == pytest.approx((7 / 8 * S, S / 8))
    # whatever curve timed it, a send/recv is one message: no hierarchical split
    assert link_bytes("send/recv", "hierarchical", 16, S, 2, 8) == link_bytes("send/recv", "ring", 16, S, 2, 8)
    # all-to-all over 16 = 2 x 8: S/16 to each peer, 7 on the node, 8 on the other
    assert link_bytes("all-to-all", "pairwise", 16, S, 2, 8) == pytest.approx((7 / 16 * S, 8 / 16 * S))


def test_cp_ring_shift_across_two_nodes_sends_one_message_per_node():
    from meshplan.config import config_from_dict
    from meshplan.schedule.netload import network_loads
    # Llama-3-8B, cp 16 over 2 DGX H100 (ranks 0-7 on node 0), seq 32768, micro-batch 1
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 1, "seq_len": 32768, "sharding": "none"},
         "mesh": {"names": ["cp"], "shape": [16]}}
    p = build_plan(config_from_dict(d))
    shifts = [r for r in p.collectives["stage 0"] if r.op == "send/recv"]
    # fp32 dK and dV of the rank's 32768 / 16 = 2048 tokens at the 8 KV heads x 128 the SDPA reads ([memory]
    # kv_expanded false, enable_gqa; 32 q heads with it): 4 x 2 x 2048 x 1024 B
    S = 4 * 2 * 2048 * 8 * 128
    assert {r.size_bytes for r in shifts} == {S} and sum(r.per_step for r in shifts) == 32 * 16  # 16 per layer
    assert all(r.link_bytes == pytest.approx((7 / 8 * S, S / 8)) for r in shifts)
    # node 0 sends one whole S per shift, rank 7's to rank 8, through rank 7's own NIC (its 8th):
    # 512 shifts x 16 MiB = 8.6 GB on it, nothing on the other seven (ranks 0-6 shift on NVLink)
    nics, _ = network_loads(p, shifts, 32)
    assert list(nics) == [7] and nics[7][0] == pytest.approx(32 * 16 * S, rel=1e-12)


def test_pp_send_across_nodes_loads_the_boundary_stages_nic():
    from meshplan.config import config_from_dict
    from meshplan.schedule.netload import network_loads
    # Llama-3-8B, pp 16 over 2 DGX H100 (stages 0-7 on node 0, rank = stage), 16 micro-batches
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 16, "seq_len": 8192, "sharding": "zero3"},
         "mesh": {"names": ["pp"], "shape": [16]}}
    p = build_plan(config_from_dict(d))
    S = 1 * 8192 * 4096 * 2  # the bf16 activation b x s x h one send carries
    for stage, calls in ((0, 16), (7, 2 * 16)):  # stage 0 sends only; 7 sends forward and receives
        rows = [r for r in p.stage(stage).collectives if r.axis == "pp" and r.op == "send/recv"]
        assert {r.size_bytes for r in rows} == {S} and [r.per_step for r in rows] == [calls, calls]
        nics, _ = network_loads(p, rows, 16 * 2, 0, stage)
        # stage 0 talks to stage 1 on NVLink only; stage 7 half its calls (forward: its sends to 8,
        # backward: its receives of 8's gradients) through its own NIC, the 8th: 2 x 32 x S / 2
        assert nics == ({} if stage == 0 else {7: pytest.approx((2 * calls * S / 2, 2 * calls * S / 2 / 32))})


def test_all_to_all_across_nodes_sends_each_members_off_node_share():
    from meshplan.config import config_from_dict
    # DeepSeek-V2-Lite, ep 16 = dp_shard 16 over 2 nodes of 8: every rank sends S/16 to each
    # peer, 8 of them on the other node, through its own NIC (one rank per NIC)
    d = {"model": {"catalog": "deepseek-v2-lite"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 16, "seq_len": 2048}, "mesh": {"names": ["dp_shard", "ep"], "shape": [16, 16]}}
    p = build_plan(config_from_dict(d))
    loads = {e.edge: e for e in edge_loads(p, step_time(p))}
    rows = p.collectives["stage 0"]
    # dispatch buffer (dropless, balanced): 2048 tokens x top-6 rows of h 2048 in bf16; dispatch and
    # combine in each of the 26 MoE layers, forward and backward: 104 calls per step; before each
    # forward dispatch the 64 experts' counts, 64 x 8 B int64: 26 calls
    S, C = 2048 * 6 * 2048 * 2, 64 * 8
    assert sum(r.per_step for r in rows if r.axis == "ep" and r.dtype == "bf16") == 104
    assert sum(r.per_step for r in rows if r.axis == "ep" and r.dtype == "int64") == 26
    ring = [r for r in rows if r.axis != "ep"]
    a2a = 104 * S + 26 * C  # bytes each rank sends per step
    nic = loads["node 0 NIC mlx5_0 (rail 0)"].bytes_per_step
    # 8 ranks x 8/16 of each call leave the node, over its 8 NICs; the FSDP rings as in the dp16 case
    assert nic == pytest.approx(8 * (8 / 16 * a2a) / 8 + sum(r.sent_bytes_per_step for r in ring) / 8, rel=1e-12)
    # of each rank's 8 peers on the other node, 7 sit on other rails; those 7/8 went up to the spine
    # (2 x 7/8 x 8 x (8/16 a2a) / 8 on the leaf's rail-0 uplinks) until newcomer 48 (finding 7): NCCL's
    # PXN (default on an NVLink node, NVIDIA/nccl 5067397 src/graph/search.cc:1398-1470) sends each through
    # the NIC on the peer's rail, relayed over NVLink, and the rings stay on their rails: nothing goes up
    assert not [e for e in loads if "uplinks to spine" in e]
    nv = loads["rank 0 nvlink4"].bytes_per_step
    assert nv == pytest.approx(7 / 16 * a2a + 7 / 8 * sum(r.sent_bytes_per_step for r in ring), rel=1e-12)


def test_tree_all_reduce_across_four_nodes():
    from meshplan.config import config_from_dict
    # DDP (sharding none) over 32 = 4 nodes x 8: one bf16 all-reduce of all 8.03e9 gradients per
    # step, on NCCL's double binary tree. Chains inside a node carry 2 (g-1)/g S per rank; the tree
    # edges between nodes 2 (N-1)/N S per node, over its 8 NICs
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
         "training": {"global_batch": 64, "seq_len": 4096, "sharding": "none", "param_dtype": "bf16"},
         "mesh": {"names": ["dp_shard"], "shape": [32]},
         "memory": {"grad_bucket_elements": 10 ** 10}}  # one DDP bucket of every gradient
    p = build_plan(config_from_dict(d))
    [row] = p.collectives["stage 0"]
    S = 2 * (32 * LAYER_NUMEL + ROOT_NUMEL)
    assert (row.op, row.algorithm, row.size_bytes, row.per_step) == ("all-reduce", "tree", S, 1)
    loads = {e.edge: e for e in edge_loads(p, step_time(p))}
    assert loads["rank 0 nvlink4"].bytes_per_step == pytest.approx(2 * 7 / 8 * S, rel=1e-12)
    assert loads["node 0 NIC mlx5_0 (rail 0)"].bytes_per_step == pytest.approx(2 * 3 / 4 * S / 8, rel=1e-12)


def test_per_layer_load_counts_pipelined_fsdp_rows():
    """pp 2 x dp_shard 16 on 4 DGX H100, Llama 3 8B, 2 micro-batches; stage 0 (layers 0-15 and
    the embedding) runs F0 F1 B0 B1. Under torch.distributed.pipelining FSDP2 counts per step
    (the table's per_step, per_microbatch 0): each layer unit gathered in F0, F1 (resharded after
    forward) and B0 (kept after backward), reduce-scattered once; the embedding, its own unit as
    torchtitan wraps it at every pp, likewise: gathered in F0, F1 and B0, reduced once. The
    per-layer load spreads those calls over the step's 2 x 16 = 32 layer passes:
    bf16 all-gathers 2 x 218,112,000 B x (32 + 16) / 32, fp32 reduce-scatters 4 x 218,112,000 B x
    16 / 32, the embedding's (2 x 3 + 4) x 525,336,576 B / 32 (6 x before, when it stayed in the
    stage's root unit, gathered once: 975.4 MB, 143.5 MB below); a ring of 16 sends 15/16 of each; 7/8 of it on
    rank 0's NVLink, 1/8 through each node-0 NIC (8 members, 8 NICs), which also carries its pp
    group's sends: 33,554,432 B (b s h bf16) forward and backward, 2 per step each, 4/32 per pass.
    Before, the per-layer figure held only the pp sends (4,194,304 B per NIC)."""
    from meshplan.config import config_from_dict
    p = build_plan(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
                                     "training": {"global_batch": 32, "seq_len": 4096,
                                                  "reshard_after_forward": True},  # unset: false under pp
                                     "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 16]}}))
    dp = sorted((r.phase, r.op, r.size_bytes, r.per_microbatch, r.per_step) for r in p.collectives["stage 0"]
                if r.axis == "dp_shard")
    emb = 128256 * 4096
    assert dp == [("backward", "all-gather", 2 * LAYER_NUMEL, 0, 16), ("backward", "all-gather", 2 * emb, 0, 1),
                  ("backward", "reduce-scatter", 4 * LAYER_NUMEL, 0, 16), ("backward", "reduce-scatter", 4 * emb, 0, 1),
                  ("forward", "all-gather", 2 * LAYER_NUMEL, 0, 32), ("forward", "all-gather", 2 * emb, 0, 2)]
    loads = {e.edge: e for e in edge_loads(p, step_time(p))}
    fsdp = 15 / 16 * (2 * LAYER_NUMEL * 48 / 32 + 4 * LAYER_NUMEL * 16 / 32 + (2 * 3 + 4) * emb / 32)
    pp_sends = 33_554_432 * 4 / 32
    assert loads["rank 0 nvlink4"].per_layer_bytes == pytest.approx(7 / 8 * fsdp, rel=1e-12)  # 1029.3 MB
    nics = [e for k, e in loads.items() if k.startswith("node 0 NIC")]
    assert len(nics) == 8
    for e in nics:
        assert e.per_layer_bytes == pytest.approx(fsdp / 8 + pp_sends, rel=1e-12)  # 151.2 MB, was 4.19 MB


def test_megatron_get_batch_broadcasts_are_listed_and_loaded_on_tp():
    """Megatron-LM 2022's get_batch at tp 8 (Llama 3 8B, one DGX H100, micro-batch 1 x 4096, 8
    micro-batches): two tp broadcasts per micro-batch, the key sizes (5 int64: 40 B) then the
    data (1 x 4097 int64: 32,776 B), each rank sending S once (nccl-tests' broadcast busbw factor 1).
    Rank 0's NVLink carries them beside the tp all-reduces (b s h bf16 = 33,554,432 B, 2 x 7/8 S
    per call, 8 x (2 x 32 + 1 embedding) = 520 calls forward and 520 backward) and the
    vocab-parallel loss's (b s fp32 = 16,384 B, 3 per micro-batch). The readiness list had no
    broadcast (its events' names carried no op word): it now lists the first one, the sizes
    broadcast, issued at the step's start and waited for by the embedding (slack 0)."""
    from meshplan.config import config_from_dict
    p = build_plan(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                                     "training": {"global_batch": 8, "seq_len": 4096, "micro_batch": 1,
                                                  "framework": "megatron"},
                                     "mesh": {"names": ["tp"], "shape": [8]}}))
    st = step_time(p)
    rows = [r for r in p.collectives["stage 0"] if r.op == "broadcast"]
    assert [(r.axis, r.phase, r.size_bytes, r.per_step, r.link_bytes) for r in rows] == [
        ("tp", "forward", 40, 8, (40, 0)), ("tp", "forward", 32_776, 8, (32_776, 0))]
    broadcasts = (40 + 32_776) * 8  # 262,528 B per step
    all_reduces = 2 * 7 / 8 * 33_554_432 * 520 * 2 + 2 * 7 / 8 * 16_384 * 24
    loads = {e.edge: e for e in edge_loads(p, st)}
    assert loads["rank 0 nvlink4"].bytes_per_step == pytest.approx(all_reduces + broadcasts, rel=1e-12)
    [t] = [t for t in timings(st) if t.op == "broadcast"]
    assert (t.stream, t.phase, t.ready_s, t.slack_s) == ("tp", "forward", 0.0, pytest.approx(0.0, abs=1e-15))
    assert t.duration_s == pytest.approx(rows[0].time_s, rel=1e-12)  # the 40 B sizes broadcast
