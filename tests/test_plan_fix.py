"""``meshplan plan`` of a mesh over memory ends with a ``fix:`` line (issue 11 follow-up): each
variant's peak is the plan of the config edited by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.interop.keymaps import keymap_of
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB
from tests.cli_run import plan_file, run_main
from tests.configs import TP4_MB2, job_toml, seed_mb2_toml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _gib(plan) -> str:
    return f"{plan.timeline.peak.total_bytes / GiB:.1f} GiB"


def _step(plan) -> str:
    return f"step {step_time(plan).step_s:.1f} s"


def _tight(plan) -> str:
    """``; tight: F GiB = P% of the usable U GiB free, under 15%`` by hand: free = usable - peak, under
    0.15 x usable (the search's headroom rule; newcomer trial 27 #C marks such a variant)."""
    usable, peak = plan.timeline.usable_bytes, plan.timeline.peak.total_bytes
    assert usable - peak < 0.15 * usable
    free = usable - peak
    return f"; tight: {free / GiB:.1f} GiB = {free / usable:.1%} of the usable {usable / GiB:.1f} GiB free, under 15%"


def _tight_or_not(plan) -> bool:
    """Whether free = usable - peak is under 0.15 x usable, by hand."""
    usable, peak = plan.timeline.usable_bytes, plan.timeline.peak.total_bytes
    return usable - peak < 0.15 * usable


def _layer(cfg, k):
    """``cfg`` at torchtitan's per-layer AC, every ``k``-th layer in full, planned."""
    return build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "layer", "ac_freq": k})))


def _meshed(cfg, names, shape):
    """``cfg`` with its mesh's names and shape edited by hand, planned."""
    return build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": names, "shape": shape})))


def test_fix_lists_each_variant_with_the_peak_its_own_plan_gives(tmp_path):
    """tests/configs.py TP4_MB2 (dp_shard 16 x tp 4, micro-batch 2) peaks at 121.5 > 79.11 x 0.9 = 71.2 GiB.
    Its tp x2 variant is the seed's mesh at micro-batch 2 (configs.seed_mb2_toml: dp_shard 8 x tp 8, all
    else equal) and its micro_batch 1 variant the seed's tp-4 file, examples/seed-64gpu-tp4.toml: the
    printed peaks are those files' plans'; recompute full, pp x2 and cp 2 (from dp_shard: 8 x cp 2 x tp 4;
    seq 8192 splits into 2 x 2 chunks) are the file edited by hand, pp x2 left out as it raises the peak.
    Those that fit are listed fastest first, each with its own plan's step, a tight one marked (trial 16
    #1 added the steps and the cp variant). (Before the runtime's device total, the seed's tp-4 file was
    the case: 69.7 > 67.1 GiB.)"""
    p = plan_file(TP4_MB2)
    cfg = p.config
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    (tmp_path / "seed-mb2.toml").write_text(seed_mb2_toml())
    seed, mb1 = plan_file(tmp_path / "seed-mb2.toml"), plan_file(EXAMPLES / "seed-64gpu-tp4.toml")
    piped = _meshed(cfg, ["pp", "dp_shard", "tp"], [2, 8, 4])
    cp2 = _meshed(cfg, ["dp_shard", "cp", "tp"], [8, 2, 4])
    assert not p.feasible and full.feasible and seed.feasible and mb1.feasible and not piped.feasible and cp2.feasible
    assert p.timeline.usable_bytes == 79.11 * 2**30 * 0.9
    # pp x2: 163.8 GiB, above the mesh's own 121.5 GiB (stage 0 holds its 40 layers gathered from forward
    # to backward, reshard_after_forward unset being false at pp > 1): no fix, left out
    # cpmem: cp 2's peak 74,996,686,848 -> 75,003,518,976 B (69.8 -> 69.9 GiB), from the head's backward to layer
    # 79's attention core step, which holds torch's ring buffers (memory.cp_buffers; 2 x 4096 local tokens, 16 q
    # heads): the gathered K/V 2 B x 2 x 8192 x 16 x 256 = 128 MiB, fp32 dQ 4 x 8192 x 16 x 128 = 64 MiB, four fp32
    # dK/dV buffers of 4 x 2 x 8192 x 16 x 256 / 2 = 128 MiB: 704 MiB beside its 72 MiB of gradients. kvheads: the
    # ring's K/V at the 2 local KV heads the SDPA reads ([memory] kv_expanded false), the gathered K/V and the dK/dV
    # buffers an eighth, so that step falls under the head's backward again: 69.9 -> 69.8 GiB (read from the model)
    assert (_gib(p), _gib(full), _gib(seed), _gib(mb1), _gib(piped), _gib(cp2)) == \
        ("121.5 GiB", "25.3 GiB", "69.1 GiB", "69.7 GiB", "163.8 GiB", "69.8 GiB")
    steps = [step_time(x).step_s for x in (full, seed, mb1, cp2)]
    assert steps == sorted(steps)  # the order the line lists them in
    # per-layer AC (layerac): ac_freq 2 checkpoints 40 of the 80 layers, each keeping its 64 MiB input
    # (2 x 8192 x 8192 x 2 B / tp 4) for its 1.27 GiB of activations (101.26 / 80): 121.5 - 40 x 1.20 =
    # 73.4 GiB (73.5 with the replayed layer at the peak) > 71.2 GiB: only full fits, no per-layer option
    l2 = _layer(cfg, 2)
    assert not l2.feasible and _gib(l2) == "73.5 GiB"
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits; {_step(full)}); tp x2 (dp_shard 8 x "
                             f"tp 8) -> peak {_gib(seed)} (fits; {_step(seed)}{_tight(seed)}); micro_batch 1 -> peak "
                             f"{_gib(mb1)} (fits; {_step(mb1)}{_tight(mb1)}); cp 2 (dp_shard 8 x cp 2 x tp 4) -> "
                             f"peak {_gib(cp2)} (fits; {_step(cp2)}{_tight(cp2)}) (usable 71.2 GiB)")


def test_cp_from_the_data_axis_is_offered_where_it_fits_and_is_faster(tmp_path):
    """Newcomer trial 16 #1: Llama-3-70B at seq 32768, dp_shard 8 x tp 8, recompute none, 8
    dgx-h100 (121.3 GiB > 79.11 x 0.9 = 71.2 GiB usable) printed only recompute full. cp from the
    data axis: cp 2 (dp_shard 4 x cp 2 x tp 8; 32768 tokens in 2 x 2 chunks of 8192, 16384 per rank)
    fits at 69.3 GiB (1.9 GiB = 2.7% free: tight), the smallest cp that does (at the datasheet's 67.1
    GiB usable it did not, and cp 4, then 43.4 GiB, was offered), and its step is shorter than recompute
    full's, which replays every layer's forward: it is listed first; cp 4 is not offered. (cpring: with
    torch's ring CP traffic in the table, spec.axes.cp.ring_rows, cp 4 beside tp 8 spans nodes and its
    K/V gathers and dK/dV shifts through the NICs made it slower than recompute full, 626.4 s; kvheads: torch's
    ring moves K/V at the heads its SDPA reads, the one local KV head under enable_gqa, not the 8 q heads, an
    eighth of the bytes, and cp 4 is 435.5 s, between cp 2 and recompute full; cp 2 stays the fastest and the
    smallest cp that fits, so cp 4 is still not offered.)"""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("seq_len = 8192", "seq_len = 32768") \
        .replace('system = "seed-8x8-2nic"', 'system = "dgx-h100"').replace('recompute = "selective"', 'recompute = "none"')
    f = tmp_path / "llama3-70b_64xh100_seq32k.toml"
    f.write_text(text)
    p = plan_file(f)
    cfg = p.config
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    cp2, cp4 = _meshed(cfg, ["dp_shard", "cp", "tp"], [4, 2, 8]), _meshed(cfg, ["dp_shard", "cp", "tp"], [2, 4, 8])
    # cpmem: cp 4's peak 46,649,753,600 -> 46,662,352,896 B (43.4 -> 43.5 GiB), now at layer 79's attention core
    # step with torch's ring buffers (8192 local tokens, 8 q heads): the gathered K/V 2 B x 32768 x 8 x 256 = 128
    # MiB, its 1/4 concatenated 32 MiB, fp32 dQ 4 x 8192 x 8 x 128 = 32 MiB, four fp32 dK/dV of 64 MiB: 448 MiB;
    # cp 2's stays the head's forward (74,383,212,544 B)
    # kvheads ([memory] kv_expanded false, the default: enable_gqa's SDPA reads the 1 local KV head): the ring's
    # buffers at 1 head, gathered K/V 2 B x 32768 x 1 x 256 = 16 MiB, its 1/4 concatenated 4 MiB, fp32 dQ (q heads)
    # 32 MiB, four fp32 dK/dV of 8 MiB: 84 MiB, 364 MiB (381,681,664 B) less, so the attention core step is
    # 46,662,352,896 - 381,681,664 = 46,280,671,232 B, under the step that peaked before cpmem: cp 4's peak is
    # that one again, 46,649,753,600 B = 43.4 GiB
    assert round(46_662_352_896 - (448 - 84) * 2 ** 20) == 46_280_671_232 < 46_649_753_600
    assert (_gib(p), _gib(cp2), _gib(cp4), _gib(full)) == ("121.3 GiB", "69.3 GiB", "43.4 GiB", "25.0 GiB")
    assert cp2.feasible and cp4.feasible and full.feasible
    # kvheads: cp 4's K/V all-gather per layer and micro-batch an eighth of the 8 q heads' (16 MiB gathered, 12 MiB
    # received, ~0.27 ms through its 50 GB/s NIC where the q heads' took 2.15 ms): it hides under the ring's SDPA
    # steps (8 q heads x 8192^2 x 256 FLOP = 137 GFLOP, ~0.37 ms at 370 TFLOP/s) and its exposed cp falls
    # 181.5 -> 3.9 s; without the repeat_kv copies its compute 384.6 -> 371.3 s: cp 4 626.4 -> 435.5 s, now
    # shorter than recompute full (481.6 s: every layer's forward replayed) and still longer than cp 2 (391.2 s)
    c2, c4, cf = step_time(cp2), step_time(cp4), step_time(full)
    assert round(c4.parts_s()["exposed cp"], 1) == 3.9 and round(c4.parts_s()["compute"], 1) == 371.3
    assert (round(c2.step_s, 1), round(c4.step_s, 1), round(cf.step_s, 1)) == (391.2, 435.5, 481.6)
    assert memory_fix(p) == (f"fix: cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak 69.3 GiB (fits; {_step(cp2)}{_tight(cp2)}); "
                             f"recompute full -> peak 25.0 GiB (fits; {_step(full)}) (usable 71.2 GiB)")
    # under Megatron-LM (bf16 parameters: its default) the same candidate; under DeepSpeed's ZeRO-3, which has no
    # cp, none
    mega = text.replace('recompute = "none"', 'recompute = "none"\nframework = "megatron"') \
        .replace('param_dtype = "fp32"', 'param_dtype = "bf16"')
    (tmp_path / "mega.toml").write_text(mega)
    mline = memory_fix(plan_file(tmp_path / "mega.toml"))
    assert mline.startswith("fix: cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak ")
    # newcomer trial 27 #C: 62.8 of 71.2 GiB, 8.4 GiB = 11.7% free, under 15%: marked tight
    assert mline.startswith("fix: cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak 62.8 GiB (fits; step ") and "; tight: " in mline
    (tmp_path / "ds.toml").write_text(text.replace('recompute = "none"', 'recompute = "none"\nzero3_engine = "deepspeed"'))
    assert "cp " not in memory_fix(plan_file(tmp_path / "ds.toml"))


def test_micro_batch_variant_halves_it(tmp_path):
    """micro_batch 4 and recompute none on the seed (peak 121.3 GiB > 79.11 x 0.9 = 71.2 GiB usable): recompute
    full and micro_batch 2 are offered at their plans' peaks; pp x2 (139.6 GiB) raises it and is left out; cp 2
    (dp_shard 4) fits, at a longer step than recompute full's (dp_shard 4: 32 micro-batches per step against
    16), and cp 4 is not offered. micro_batch 2 (69.1 GiB) and cp 2 (69.3 GiB) fit the runtime's 71.2 GiB,
    tight (at the datasheet's 67.1 GiB neither did, and cp 4 was offered)."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("micro_batch = 1", "micro_batch = 4") \
        .replace('recompute = "selective"', 'recompute = "none"')
    f = tmp_path / "seed-mb4.toml"
    f.write_text(text)
    p = plan_file(f)
    half = build_plan(replace(p.config, training=p.config.training.model_copy(update={"micro_batch": 2})))
    full = build_plan(replace(p.config, training=p.config.training.model_copy(update={"recompute": "full"})))
    assert not p.feasible and half.feasible and full.feasible
    cp2 = _meshed(p.config, ["dp_shard", "cp", "tp"], [4, 2, 8])
    assert cp2.feasible and step_time(full).step_s < step_time(half).step_s <= step_time(cp2).step_s
    assert (_gib(p), _gib(half), _gib(cp2), _gib(full)) == ("121.3 GiB", "69.1 GiB", "69.3 GiB", "25.0 GiB")
    # the fitting ones first, fastest first (trial 16 #1: steps and the cp variant added)
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits; {_step(full)}); micro_batch 2 -> peak "
                             f"{_gib(half)} (fits; {_step(half)}{_tight(half)}); cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak "
                             f"{_gib(cp2)} (fits; {_step(cp2)}{_tight(cp2)}) (usable 71.2 GiB)")
    # a micro-batch that lowers the peak but not under usable memory is never offered as a fix (newcomer
    # trial 27 #B): at micro_batch 8 its half, micro_batch 4, is this test's 121.3 GiB > 71.2 GiB
    (tmp_path / "seed-mb8.toml").write_text(text.replace("micro_batch = 4", "micro_batch = 8"))
    assert "micro_batch 4" not in memory_fix(plan_file(tmp_path / "seed-mb8.toml"))


def test_no_variant_fits_gives_the_fewest_nodes(tmp_path):
    """Llama-3-70B on one node (dp_shard 1 x tp 8): even recompute full peaks at 133.6 GiB; with it,
    2 nodes (dp_shard 2) fit at 68.8 GiB, under 79.11 x 0.9 = 71.2 GiB usable (at the datasheet's 67.1
    GiB they did not, and 4 nodes were named: 3 cannot split the global batch 512)."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("nodes = 8", "nodes = 1").replace("[8, 8]", "[1, 8]")
    f = tmp_path / "one-node.toml"
    f.write_text(text)
    p = plan_file(f)
    cfg = load_config(f)

    def at(nodes: int):
        return build_plan(replace(cfg, cluster=cfg.cluster.model_copy(update={"nodes": nodes}),
                                  training=cfg.training.model_copy(update={"recompute": "full"}),
                                  mesh=cfg.mesh.model_copy(update={"shape": [nodes, 8]})))
    assert not at(1).feasible and at(2).feasible and at(4).feasible
    assert (_gib(at(1)), _gib(at(2))) == ("133.6 GiB", "68.8 GiB")
    # the fix first, the variant over usable memory after it as none (newcomer trial 27 #B)
    assert memory_fix(p) == (f"fix: does not fit even at the most memory-saving settings on 1 node: 2 nodes would "
                             f"(recompute full, dp_shard 2 x tp 8: peak {_gib(at(2))}); over the usable 71.2 GiB, no fix "
                             f"alone: recompute full -> peak {_gib(at(1))}")


def test_plan_cli_prints_fix_after_the_verdict(capsys):
    """The fix follows the ``infeasible:`` line on stderr; exit 1; a mesh that fits prints none."""
    assert run_main("plan", TP4_MB2) == 1  # tests/configs.py: 121.5 > 71.2 GiB; recompute full: 25.3 GiB
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith("infeasible: peak 121.5 GiB") and err[-1].startswith("fix: recompute full -> peak 25.3")
    assert run_main("plan", EXAMPLES / "seed-64gpu.toml") == 0
    assert "fix:" not in capsys.readouterr().err


def test_no_sync_is_offered_back_to_sync(tmp_path):
    """Newcomer (zero3knobs item 2): ``grad_accumulation = "no_sync"`` keeps every unit's unsharded
    gradients through the step and the plan no longer fits; the fix line named every knob but
    the one that caused it. The seed with no_sync peaks at 71.8 GiB > 79.11 x 0.9 = 71.2 GiB; its
    ``grad_accumulation sync`` variant is the seed's own file (examples/seed-64gpu.toml, sync by
    default): 43.3 GiB, listed among those that fit by its step (recompute full keeps no_sync's
    one reduce-scatter per step and is the faster)."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("[training]", '[training]\ngrad_accumulation = "no_sync"')
    f = tmp_path / "seed-nosync.toml"
    f.write_text(text)
    p = plan_file(f)
    seed = plan_file(EXAMPLES / "seed-64gpu.toml")
    full = build_plan(replace(p.config, training=p.config.training.model_copy(update={"recompute": "full"})))
    cp2 = _meshed(p.config, ["dp_shard", "cp", "tp"], [4, 2, 8])
    assert not p.feasible and seed.feasible and full.feasible and cp2.feasible
    assert (_gib(p), _gib(seed), _gib(full), _gib(cp2)) == ("71.8 GiB", "43.3 GiB", "47.7 GiB", "59.2 GiB")
    assert step_time(full).step_s < step_time(seed).step_s < step_time(cp2).step_s
    # per-layer AC (layerac): one checkpointed layer peaks at 76,775,264,256 B and each more saves
    # 323,223,552 B; usable 79.11 x 2**30 x 0.9 = 76,449,344,126.976 B: 2 layers (76,452,040,704 B) are
    # 2.7 MB over, 3 (76,128,817,152 B = 70.9 GiB) fit: ac_freq 26, the largest k with 80 // k = 3
    # (ac_freq 5, 16 layers at 67.0 GiB, was the largest under the datasheet's 67.1 GiB)
    l1, l26, l27 = _layer(p.config, 41), _layer(p.config, 26), _layer(p.config, 27)
    # d by hand: a layer not checkpointed keeps, per token of the 8192 and tp rank (tp 8, SP; Table 2 tensor by
    # tensor, bf16, nothing recomputed): its input, the QKV input, q, the context, the MLP norm's and w_in's inputs
    # 6 x 2 x 8192 / 8, k and v 2 x 2 x 128 (1 KV head a rank), gate, SiLU output, up and product 4 x 2 x 28672 / 8
    # and the flash statistics 4 B x 64 / 8 heads: 41,504 B; a checkpointed one only its input, 2 x 8192 / 8
    d = 8192 * (6 * 2 * 8192 // 8 + 2 * 2 * 128 + 4 * 2 * 28672 // 8 + 4 * 64 // 8 - 2 * 8192 // 8)
    assert d == 8192 * 39_456 == 323_223_552
    assert (l26.timeline.peak.total_bytes, l27.timeline.peak.total_bytes) == (76_775_264_256 - 2 * d, 76_775_264_256 - d)
    assert l1.timeline.peak.total_bytes == 76_775_264_256
    assert l26.feasible and not l27.feasible and _gib(l26) == "70.9 GiB"
    assert step_time(l26).step_s == step_time(full).step_s  # the same NIC-bound step, listed after full
    # cp 2 at 59.2 GiB: 71.2 - 59.2 = 12.0 GiB = 16.9% free, no longer tight (it was 11.7% of 67.1)
    assert not _tight_or_not(cp2)
    assert memory_fix(p) == (f"fix: recompute full -> peak 47.7 GiB (fits; {_step(full)}); recompute layer ac_freq 26 "
                             f"(every 26th layer of a stage in full) -> peak 70.9 GiB (fits; {_step(l26)}{_tight(l26)}); "
                             f"grad_accumulation sync -> peak 43.3 GiB (fits; {_step(seed)}); cp 2 (dp_shard 4 x cp 2 x "
                             f"tp 8) -> peak 59.2 GiB (fits; {_step(cp2)}) (usable 71.2 GiB)")
    # sync itself offers no such variant
    assert "grad_accumulation" not in (memory_fix(plan_file(TP4_MB2)) or "")


def test_per_layer_ac_at_the_largest_ac_freq_that_fits(tmp_path):
    """Newcomer (layerac): under torchtitan the line offered recompute full, never per-layer AC.
    Llama-3-8B at seq 12288, dp_shard 8, micro-batch 1, no recompute, one dgx-h100 (usable: the H100's
    runtime total 79.11 GiB x 0.9 = 76,449,344,126.976 B = 71.2 GiB; it was 80 GB x 0.9 = 72.0 GB). A layer stores, per token, 2 B x (6 x 4096 (both norms' inputs, the qkv input,
    q, the context, w_in's input) + 2 x 1024 (k, v) + 4 x 14336 (gate, silu, up, w_out's input)) =
    2 x 83968 B, and the flash statistics 32 heads x 4 B: 12288 x 168064 = 2,065,170,432 B; one
    checkpointed keeps its input, 12288 x 4096 x 2 B = 100,663,296 B: 1,964,507,136 B less each.
    The peak, 89,006,942,208 B, needs (89,006,942,208 - 76,449,344,126.976) / 1,964,507,136 = 6.39, so 7
    of the 32 layers checkpointed: ac_freq 4 (32 // 4 = 8 layers, peak 89,006,942,208 - 8 x 1,964,507,136 =
    73,290,885,120 B), not 5 (6 layers, 77,219,899,392 B). (At 72e9 B usable it took 8.66, so ac_freq 3.)
    Fewer layers replayed than full's 32: the shorter step of the two, listed first."""
    f = tmp_path / "llama3-8b_8xh100_seq12k.toml"
    f.write_text(job_toml(training={"global_batch": 8, "seq_len": 12288, "micro_batch": 1, "recompute": "none"},
                          mesh={"names": ["dp_shard"], "shape": [8]}))
    p = plan_file(f)
    cfg = p.config
    d = 1_964_507_136
    assert (p.timeline.peak.total_bytes, p.timeline.usable_bytes) == (89_006_942_208, 79.11 * 2**30 * 0.9)
    l4, l5 = _layer(cfg, 4), _layer(cfg, 5)
    assert (l4.timeline.peak.total_bytes, l5.timeline.peak.total_bytes) == (89_006_942_208 - 8 * d,
                                                                            89_006_942_208 - 6 * d)
    assert l4.feasible and not l5.feasible
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    assert step_time(l4).step_s < step_time(full).step_s
    line = memory_fix(p)
    # 76,449,344,126.976 - 73,290,885,120 = 3,158,459,007 B free = 2.9 GiB, 4.1% of usable: under 15%,
    # marked tight; the peak 73,290,885,120 B = 68.26 GiB
    tight = "tight: 2.9 GiB = 4.1% of the usable 71.2 GiB free, under 15%"
    assert _tight(l4) == f"; {tight}"
    mine = f"recompute layer ac_freq 4 (every 4th layer of a stage in full) -> peak 68.3 GiB (fits; {_step(l4)}; {tight})"
    assert mine in line and line.index(mine) < line.index(f"recompute full -> peak {_gib(full)} (fits; {_step(full)})")
    # read from a torchtitan TOML: its own keys (selective_ac_option, an int string: every k-th layer)
    tt = replace(p, config=replace(cfg, origin="torchtitan"))
    assert ('activation_checkpoint.mode = "selective", activation_checkpoint.selective_ac_option = "4" (every 4th '
            'layer of a stage in full) -> peak 68.3 GiB') in memory_fix(tt, keymap_of(tt.config))
    # already at ac_freq 5: the line offers 4; under Megatron-LM (no per-layer AC) none
    at5 = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "layer", "ac_freq": 5})))
    assert "recompute layer ac_freq 4 (" in memory_fix(at5)
    mg = build_plan(replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron"})))
    assert not mg.feasible and "recompute layer" not in memory_fix(mg)
