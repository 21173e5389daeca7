"""DeepSpeed ZeRO++ (issue 11; meshplan/comm/zeropp.py, read in deepspeedai/DeepSpeed edaa722) on
DeepSpeed's ZeRO-3 of today: hpZ's secondary partition and groups, qwZ's int8 gathers, qgZ's
hierarchical int4 all-to-alls, their memory, checks, and the DeepSpeed JSON keys.

The workload of every test but the last: Llama 3 8B (32 layers of 218,112,000 parameters; every
weight dim a multiple of 16, so no padding), bf16, seq 4096, micro-batch 1, on dgx-h100 nodes with
the data axis the whole world (dp_shard 8 x nodes) and 2 micro-batches a step."""

from __future__ import annotations

import json

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.comm_streams import comm_kind
from meshplan.schedule.comm_times import CommTimes
from meshplan.schedule.steptime import step_time
from meshplan.search.driver import search
from meshplan.search.space import SHARDING, candidate_config

LAYER = 218_112_000


def _cfg(nodes: int = 2, names=("dp_shard",), shape=None, **training):
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": nodes},
        "mesh": {"names": list(names), "shape": list(shape or [8 * nodes])},
        "training": {"global_batch": 16 * nodes, "seq_len": 4096, "sharding": "zero3", "zero3_engine": "deepspeed",
                     **training}})


def _rows(cfg, phase, op, cadence=""):
    return [r for r in build_plan(cfg).stage(0).collectives
            if (r.phase, r.op) == (phase, op) and cadence in r.cadence and "every layer" in r.cadence]


def test_hpz_and_qwz_gathers_bytes_groups_and_counts():
    """2 nodes x 8, hpZ g = 8 and qwZ. Each layer's gather is int8: 218,112,000 B (1 B a parameter,
    half the bf16 gather's 436,224,000). Forward: micro-batch 0 over all 16 ranks (no secondary
    tensor yet, partition_parameters.py all_gather_coalesced), 32 a step; micro-batch 1 over the
    secondary group, ranks 0-7 (groups.py: consecutive world ranks), 32 a step. Backward: every pass
    over ranks 0-7, 32 a micro-batch. Scales (CUDAQuantizer: ceil(numel / 8000) groups, here already
    dividing numel / 8): over 16 ranks a partition of 13,632,000 elements, 1,704 groups; over 8 ranks
    27,264,000, 3,408 groups; 4 B each, gathered: 1,704 x 4 x 16 = 3,408 x 4 x 8 = 109,056 B. A rank
    sends 15/16 of the full group's gather: 204,480,000 B."""
    cfg = _cfg(zero_hpz_partition_size=8, zero_quantized_weights=True)
    fwd, back = _rows(cfg, "forward", "all-gather"), _rows(cfg, "backward", "all-gather")
    got = {(r.group_size, r.example_ranks, r.size_bytes, r.dtype, r.per_microbatch, r.per_step) for r in fwd + back}
    assert got == {(16, tuple(range(16)), LAYER, "int8", 0, 32), (8, tuple(range(8)), LAYER, "int8", 0, 32),
                   (8, tuple(range(8)), LAYER, "int8", 32, 64)}
    assert all("109,056 B fp32 scales" in r.cadence for r in fwd + back)
    full = next(r for r in fwd if r.group_size == 16)
    assert full.sent_bytes == LAYER * 15 / 16 and full.path.kind == "network"
    assert all(r.path.kind == "nvlink" for r in fwd + back if r.group_size == 8)


def test_qgz_all_to_all_bytes_per_hop():
    """2 nodes x 8, qgZ (coalesced_collectives.py all_to_all_quant_reduce): each 2-D gradient of M
    elements (M a multiple of 2 x 16) int4 all-to-all'd inside the node (M / 2 B, ranks 0-7) and,
    reduced to its 1/8, across nodes (M / 16 B, ranks 0 and 8). Llama 3 8B's layer: wq, wo (4096 x
    4096: 8,388,608 and 1,048,576 B), wk, wv (1024 x 4096: 2,097,152 and 262,144 B), w_gate, w_up
    (14336 x 4096) and w_down (4096 x 14336: 29,360,128 and 3,670,016 B, keyed apart by their dim 0:
    G = max(dims, 16) = 14,336 scales either way); 2 norms (1-D) reduce-scattered alone over all 16
    ranks, 4096 x 2 B = 8,192 B. Calls a micro-batch: the row's tensors x 32 layers. Across nodes a
    rank sends half its buffer (1 peer of 2): (2 x 262,144 + 2 x 1,048,576 + 3 x 3,670,016) / 2 =
    6,815,744 B a layer, where plain ZeRO-3's bf16 ring reduce-scatter puts 1/8 (a ring's NIC share,
    row.link_bytes) of 436,224,000 x 15/16 B, 51,120,000 B, through the rank's NIC."""
    cfg = _cfg(zero_quantized_gradients=True)
    a2a = _rows(cfg, "backward", "all-to-all")
    intra = sorted((r.size_bytes, r.per_microbatch) for r in a2a if r.example_ranks == tuple(range(8)))
    inter = sorted((r.size_bytes, r.per_microbatch) for r in a2a if r.example_ranks == (0, 8))
    assert intra == [(2_097_152, 64), (8_388_608, 64), (29_360_128, 32), (29_360_128, 64)]
    assert inter == [(262_144, 64), (1_048_576, 64), (3_670_016, 32), (3_670_016, 64)]
    assert all(r.dtype == "int4" and comm_kind(r) == "shard" for r in a2a)
    rs = _rows(cfg, "backward", "reduce-scatter")
    assert [(r.group_size, r.size_bytes, r.per_microbatch) for r in rs] == [(16, 8192, 64)]
    across = sum(r.link_bytes[1] * r.per_microbatch / 32 for r in a2a if r.example_ranks == (0, 8))
    assert across == 6_815_744


def test_qgz_rows_sum_into_the_layer_reduction():
    """The rank timeline keeps one reduction per layer (CommTimes key shard/layer/backward/
    reduce-scatter): under qgZ the sum of the layer's rows, each row's seconds x its calls per layer
    (per micro-batch / 32)."""
    rows = [r for r in build_plan(_cfg(zero_quantized_gradients=True)).stage(0).collectives
            if "every layer" in r.cadence and r.phase == "backward" and r.op != "all-gather"]
    c = CommTimes.from_rows(rows, layers=32)
    assert c.get("shard", "backward", "reduce-scatter", "layer") == pytest.approx(
        sum(r.time_s * r.per_microbatch / 32 for r in rows), rel=1e-12)


def test_one_node_hpz_of_the_node_and_qgz_leave_the_step():
    """On one node (world 8) hpZ with g = 8 gathers over the same 8 ranks as plain ZeRO-3 (its
    secondary group is the whole group), and qgZ falls back to the reduce-scatter
    (stage3.py __avg_scatter_grads: num_nodes > 1 only): qgZ's step is plain ZeRO-3's to the bit;
    hpZ's is longer by its secondary copies alone, on the compute stream of micro-batch 0's forward
    (partition_parameters.py _partition_param_sec 1916-1923: zero_, copy_, then the stream's
    synchronize, one issue floor of 4.7 us, catalog kernels.toml). Per layer (9 tensors, 218,112,000
    elements): 3 x 27,264,000 x 2 B = 163.6 MB, 55.1 us at Triad 2.97 TB/s, below 18 kernels' issue
    floors (84.6 us), + 9 floors: 126.9 us; the embedding (1 tensor, 128,256 x 4096): 3 x 65,667,072 x
    2 B = 394.0 MB, 132.66 us + 4.7 us = 137.36 us; norm + output (2 tensors, 4096 + 525,336,576):
    3 x 65,667,584 x 2 B, 132.66 us, + 9.4 us = 142.06 us. 32 x 126.9 + 137.36 + 142.06 = 4,340.2 us,
    all on the critical path (the forward is compute-bound on NVLink)."""
    base = step_time(build_plan(_cfg(1))).step_s
    assert step_time(build_plan(_cfg(1, zero_hpz_partition_size=8))).step_s - base == pytest.approx(4340.2e-6, abs=1e-7)
    assert step_time(build_plan(_cfg(1, zero_quantized_gradients=True))).step_s == base


def test_hpz_micro_batch_0_forward_timed_apart():
    """2 nodes x 8, hpZ g = 8, 2 micro-batches. The rank timeline times micro-batch 0's forward
    with the gathers over all 16 ranks (no secondary tensor yet: partition_parameters.py
    all_gather_coalesced 1543-1546) and the secondary copies after them, micro-batch 1's forward
    with the gathers over the node's 8 ranks and no copy (the secondary tensor exists:
    _partition_param_sec returns at 1878): each its own table row, not their mean. A layer's copy:
    126.9 us (test_one_node_hpz_of_the_node_and_qgz_leave_the_step). Micro-batch 0's forward is the
    longer by its copies (4,340.2 us) and its slower gathers where they are exposed, less what its
    kernels lose to SM contention against micro-batch 1's (nc52fixC: its gathers over 16 ranks cross
    the nodes and hold NCCL's 16 network channels, 16 / 132 SMs, micro-batch 1's on NVLink 24 / 132:
    4.839 against 6.814 ms of contention, so micro-batch 0 is 2.584 ms longer, not 4.34 ms or more)."""
    plan = build_plan(_cfg(zero_hpz_partition_size=8))
    fwd = {r.group_size: r for r in _rows(plan.config, "forward", "all-gather")}
    c = CommTimes.from_rows(plan.stage(0).collectives, layers=32)
    first = c.first_microbatch()
    assert c.get("shard", "forward", "all-gather", "layer") == fwd[8].time_s
    assert first.get("shard", "forward", "all-gather", "layer") == fwd[16].time_s > fwd[8].time_s
    assert first.copies[("layer", "all-gather")] == pytest.approx(126.9e-6, abs=1e-10)
    assert c.copies.get(("layer", "all-gather"), 0.0) == 0.0
    st = step_time(plan)
    mb0, mb1 = st.units.get(0, 0, "F", 0), st.units.get(0, 0, "F", 1)
    gathers = lambda u: {round(e.end_s - e.start_s, 12) for e in u.events if e.name.startswith("fsdp AG L")}
    assert gathers(mb0) == {round(fwd[16].time_s, 12)} and gathers(mb1) == {round(fwd[8].time_s, 12)}
    assert mb0.contention_s < mb1.contention_s
    assert mb0.duration_s - mb1.duration_s >= 4340.2e-6 + (mb0.contention_s - mb1.contention_s) - 1e-7


def test_hpz_secondary_partition_in_memory():
    """_partition_param_sec keeps numel / g of every parameter in its dtype: Llama 3 8B's
    8,030,261,248 parameters / 8 x 2 B = 2,007,565,312 B more parameter bytes on every rank, held
    through the step (the init entry; the partition itself is 8,030,261,248 / 16 x 2 B)."""
    plain, hpz = build_plan(_cfg()), build_plan(_cfg(zero_hpz_partition_size=8))
    assert hpz.timeline.max_by_kind["params"] - plain.timeline.max_by_kind["params"] == 2_007_565_312
    assert hpz.timeline.peak.total_bytes - plain.timeline.peak.total_bytes == 2_007_565_312


def test_zeropp_config_errors():
    """ZeRO++ is DeepSpeed's stage-3 engine's; hpZ and qgZ build groups of world ranks, so the data
    axis must be the world and g must divide it: each a one-line error naming the key."""
    with pytest.raises(ConfigError) as e:
        _cfg(zero3_engine="fsdp2", zero_quantized_weights=True)
    assert "zero_quantized_weights is DeepSpeed ZeRO++" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_plan(_cfg(zero_hpz_partition_size=6))
    assert e.value.field == "training.zero_hpz_partition_size" and "6 does not divide the world 16" in e.value.message
    with pytest.raises(ConfigError) as e:
        build_plan(_cfg(names=("dp_shard", "tp"), shape=(8, 2), zero_quantized_gradients=True))
    assert e.value.field == "training.zero_quantized_gradients" and "fsdp 8 of 16 ranks" in e.value.message


def test_hpz_error_names_the_deepspeed_json_key(tmp_path):
    """A DeepSpeed JSON's hpZ g = 5 on 3 nodes x 8 (world 24, which 5 does not divide:
    groups.py _ensure_divisibility) is refused naming the key the user wrote,
    zero_optimization.zero_hpz_partition_size, not meshplan's training.zero_hpz_partition_size
    (which a meshplan TOML's error keeps: test_zeropp_config_errors)."""
    opts = ImportOptions(cluster="dgx-h100", nodes=3, model="llama3-8b", seq_len=4096)
    path = tmp_path / "z.json"
    path.write_text(json.dumps({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 5}}))
    with pytest.raises(ConfigError) as e:
        build_plan(load_any(path, opts=opts))
    assert e.value.field == "zero_optimization.zero_hpz_partition_size"
    assert "5 does not divide the world 24" in e.value.message


def test_deepspeed_json_keys_round_trip(tmp_path):
    """import deepspeed reads the three keys at stage 3 (no longer refused nor unused) and export
    writes them back; stage 2 does not read them (DeepSpeed passes them to stage 3 only)."""
    opts = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
    zpp = {"zero_hpz_partition_size": 8, "zero_quantized_weights": True, "zero_quantized_gradients": True}
    path = tmp_path / "z.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, **zpp}, "bf16": {"enabled": True}}))
    cfg = load_any(path, opts=opts)
    assert {k: getattr(cfg.training, k) for k in zpp} == zpp
    assert not any("zero_hpz" in n or "zero_quantized" in n for n in cfg.notes)
    back = json.loads(export(cfg, "deepspeed", "x")[0])["zero_optimization"]
    assert {k: back[k] for k in zpp} == zpp


def test_search_bounds_hold_the_zeropp_rows(tmp_path):
    """A stage 3 JSON with hpZ 8, qwZ and qgZ searched on 2 x 8 H100 (one data axis: zero1, zero2,
    zero3): its zero3 rows run ZeRO++ (qwZ and qgZ as given; hpZ varied, the config's 8 and 1:
    search/space.py hpz_applies), its zero1/zero2 rows drop the keys (DeepSpeed reads them at
    stage 3 only). Every row planned exactly lies within the search's bounds: the step bound below
    the step (ZeRO++'s gathers and reductions are not bounded by plain ZeRO-3's), the peak between
    the memory bounds (hpZ's secondary partition, 2,007,565,312 B, in both on its hpZ 8 rows), so the
    search notes neither a bound it broke nor a ranking it cannot vouch for."""
    opts = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
    path = tmp_path / "z.json"
    path.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8,
                                                      "zero_quantized_weights": True, "zero_quantized_gradients": True}}))
    r = search(load_any(path, opts=opts))
    assert not [n for n in r.notes if "outside the memory bounds" in n or "may not be exact" in n]
    c = r.candidates
    zero3 = [i for i in r.exact if SHARDING[c.sh[i]] == "zero3"]
    assert zero3 and {c.hpz(i) for i in range(len(c)) if SHARDING[c.sh[i]] == "zero3"} == {1, 8}
    for i in r.exact:
        t = candidate_config(r.config, c, i).training
        assert t.zero_hpz_partition_size == (c.hpz(i) if i in zero3 else 1)
        assert t.zero_quantized_gradients == (i in zero3)
        e = r.exact[i]
        assert e.step_s is None or e.step_s >= r.est.step_lo[i]
        assert not e.complete or r.est.peak_lo[i] <= e.peak_bytes <= r.est.peak_hi[i]
