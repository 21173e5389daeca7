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
from tests.configs import job_toml

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


def _layer(cfg, k):
    """``cfg`` at torchtitan's per-layer AC, every ``k``-th layer in full, planned."""
    return build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "layer", "ac_freq": k})))


def _meshed(cfg, names, shape):
    """``cfg`` with its mesh's names and shape edited by hand, planned."""
    return build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": names, "shape": shape})))


def test_fix_lists_each_variant_with_the_peak_its_own_plan_gives():
    """seed-64gpu-tp4 (dp_shard 16 x tp 4) peaks at 69.7 > 67.1 GiB. Its tp x2 variant is the
    seed's own mesh, examples/seed-64gpu.toml (dp_shard 8 x tp 8, all else equal): the printed
    peak is that file's plan's; recompute full, pp x2 and cp 2 (from dp_shard: 8 x cp 2 x tp 4;
    seq 8192 splits into 2 x 2 chunks) are the file edited by hand, pp x2 left out as it raises
    the peak. Those that fit are listed fastest first, each with its own plan's step (trial 16 #1
    added the steps and the cp variant: the line was recompute full; tp x2 in the knobs' order)."""
    p = plan_file(EXAMPLES / "seed-64gpu-tp4.toml")
    cfg = p.config
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    seed = plan_file(EXAMPLES / "seed-64gpu.toml")
    piped = _meshed(cfg, ["pp", "dp_shard", "tp"], [2, 8, 4])
    cp2 = _meshed(cfg, ["dp_shard", "cp", "tp"], [8, 2, 4])
    assert not p.feasible and full.feasible and seed.feasible and not piped.feasible and cp2.feasible
    # pp x2: reshard_after_forward unset is false at pp > 1 (rafpp), so stage 0 holds its 40 layers'
    # and the embedding's parameters gathered over dp_shard from forward to backward: 40 x 855.65M /
    # tp 4 x 2 B (15.94 GiB) + 128256 x 8192 / 4 x 2 B (0.49 GiB) = 16.43 GiB where the resharded
    # plan holds 0.80 GiB: 97.27 - 0.80 + 16.43 = 112.9 GiB
    assert (_gib(full), _gib(seed), _gib(piped), _gib(cp2)) == ("22.0 GiB", "43.3 GiB", "112.9 GiB", "44.5 GiB")
    steps = [step_time(x).step_s for x in (full, seed, cp2)]
    assert steps == sorted(steps)  # the order the line lists them in
    # per-layer AC (layerac): 80 layers; ac_freq 16 checkpoints 5 (15, 31, .., 79) and replays the last
    # at the peak (67.1 GiB, over); 15 checkpoints 5 too (14, 29, .., 74) and fits at 66.7 GiB. The seed
    # cluster's step is bound by its 2 NICs: the same 172.4 s as full's, listed after it (knob order)
    l15, l16 = _layer(cfg, 15), _layer(cfg, 16)
    assert l15.feasible and not l16.feasible and _gib(l15) == "66.7 GiB"
    assert step_time(l15).step_s == step_time(full).step_s
    # pp x2 raises the peak (112.9 > 69.7 GiB): no fix, left out
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits; {_step(full)}); recompute layer ac_freq "
                             f"15 (every 15th layer of a stage in full) -> peak 66.7 GiB (fits; {_step(l15)}{_tight(l15)}); tp x2 (dp_shard 8 x "
                             f"tp 8) -> peak {_gib(seed)} (fits; {_step(seed)}); cp 2 (dp_shard 8 x cp 2 x tp 4) -> "
                             f"peak {_gib(cp2)} (fits; {_step(cp2)}) (usable 67.1 GiB)")


def test_cp_from_the_data_axis_is_offered_where_it_fits_and_is_faster(tmp_path):
    """Newcomer trial 16 #1: Llama-3-70B at seq 32768, dp_shard 8 x tp 8, recompute none, 8
    dgx-h100 (121.3 GiB > 67.1 GiB usable) printed only recompute full. cp from the data axis: cp
    2 (dp_shard 4) peaks at 69.3 GiB, over; cp 4 (dp_shard 2 x cp 4 x tp 8; 32768 tokens in 2 x 4
    chunks of 4096, 8192 per rank, split 1024 per tp rank by SP) fits at 43.4 GiB, the smallest cp
    that does, and its step is shorter than recompute full's, which replays every layer's forward:
    it is listed first."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("seq_len = 8192", "seq_len = 32768") \
        .replace('system = "seed-8x8-2nic"', 'system = "dgx-h100"').replace('recompute = "selective"', 'recompute = "none"')
    f = tmp_path / "llama3-70b_64xh100_seq32k.toml"
    f.write_text(text)
    p = plan_file(f)
    cfg = p.config
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    cp2, cp4 = _meshed(cfg, ["dp_shard", "cp", "tp"], [4, 2, 8]), _meshed(cfg, ["dp_shard", "cp", "tp"], [2, 4, 8])
    assert (_gib(p), _gib(cp2), _gib(cp4), _gib(full)) == ("121.3 GiB", "69.3 GiB", "43.4 GiB", "25.0 GiB")
    assert not cp2.feasible and cp4.feasible and full.feasible
    assert step_time(cp4).step_s < step_time(full).step_s
    assert memory_fix(p) == (f"fix: cp 4 (dp_shard 2 x cp 4 x tp 8) -> peak 43.4 GiB (fits; {_step(cp4)}); "
                             f"recompute full -> peak 25.0 GiB (fits; {_step(full)}) (usable 67.1 GiB)")
    # under Megatron-LM (bf16 parameters: its default) the same candidate; under DeepSpeed's ZeRO-3, which has no
    # cp, none
    mega = text.replace('recompute = "none"', 'recompute = "none"\nframework = "megatron"') \
        .replace('param_dtype = "fp32"', 'param_dtype = "bf16"')
    (tmp_path / "mega.toml").write_text(mega)
    mline = memory_fix(plan_file(tmp_path / "mega.toml"))
    assert mline.startswith("fix: cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak ")
    # newcomer trial 27 #C: 62.8 of 67.1 GiB, (67.06 - 62.8) / 67.06 = 6.3% free, under 15%: marked tight
    assert mline.startswith("fix: cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak 62.8 GiB (fits; step ") and "; tight: " in mline
    (tmp_path / "ds.toml").write_text(text.replace('recompute = "none"', 'recompute = "none"\nzero3_engine = "deepspeed"'))
    assert "cp " not in memory_fix(plan_file(tmp_path / "ds.toml"))


def test_micro_batch_variant_halves_it(tmp_path):
    """micro_batch 4 and recompute none on the seed (peak 121.3 GiB): recompute full is offered at its
    plan's peak; micro_batch 2 lowers the peak but stays over usable memory, so since newcomer trial 27 #B
    it is not offered (a halved micro-batch that fits is: tests/test_plan_fix_nc27.py, micro_batch 1 at
    63.1 GiB); pp x2 (131.8 GiB) raises it and is left out; cp 2 does not fit, cp 4 (dp_shard 2) does, at
    a longer step than recompute full's (dp_shard 2: 64 micro-batches per step against 16)."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("micro_batch = 1", "micro_batch = 4") \
        .replace('recompute = "selective"', 'recompute = "none"')
    f = tmp_path / "seed-mb4.toml"
    f.write_text(text)
    p = plan_file(f)
    half = build_plan(replace(p.config, training=p.config.training.model_copy(update={"micro_batch": 2})))
    full = build_plan(replace(p.config, training=p.config.training.model_copy(update={"recompute": "full"})))
    assert not p.feasible and not half.feasible and full.feasible
    assert half.timeline.peak.total_bytes < p.timeline.peak.total_bytes  # lowers it, not under usable
    cp2, cp4 = _meshed(p.config, ["dp_shard", "cp", "tp"], [4, 2, 8]), _meshed(p.config, ["dp_shard", "cp", "tp"],
                                                                             [2, 4, 8])
    assert not cp2.feasible and cp4.feasible and step_time(full).step_s < step_time(cp4).step_s
    # the fitting ones first, fastest first (trial 16 #1: steps and the cp variant added; micro_batch 2 now last)
    # micro_batch 2 lowers the peak but not under usable memory: never offered as a fix (newcomer trial 27 #B)
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits; {_step(full)}); cp 4 (dp_shard 2 x cp "
                             f"4 x tp 8) -> peak {_gib(cp4)} (fits; {_step(cp4)}) (usable 67.1 GiB)")
    assert "micro_batch 2" not in memory_fix(p)


def test_no_variant_fits_gives_the_fewest_nodes(tmp_path):
    """Llama-3-70B on one node (dp_shard 1 x tp 8): even recompute full peaks at 133.6 GiB; with it,
    2 nodes (dp_shard 2) do not fit, 3 cannot split the global batch 512, 4 (dp_shard 4) fit."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("nodes = 8", "nodes = 1").replace("[8, 8]", "[1, 8]")
    f = tmp_path / "one-node.toml"
    f.write_text(text)
    p = plan_file(f)
    cfg = load_config(f)

    def at(nodes: int):
        return build_plan(replace(cfg, cluster=cfg.cluster.model_copy(update={"nodes": nodes}),
                                  training=cfg.training.model_copy(update={"recompute": "full"}),
                                  mesh=cfg.mesh.model_copy(update={"shape": [nodes, 8]})))
    assert not at(1).feasible and not at(2).feasible and at(4).feasible
    # the fix first, the variant over usable memory after it as none (newcomer trial 27 #B)
    assert memory_fix(p) == (f"fix: does not fit even at the most memory-saving settings on 1 node: 4 nodes would "
                             f"(recompute full, dp_shard 4 x tp 8: peak {_gib(at(4))}); over the usable 67.1 GiB, no fix "
                             f"alone: recompute full -> peak {_gib(at(1))}")


def test_plan_cli_prints_fix_after_the_verdict(capsys):
    """The fix follows the ``infeasible:`` line on stderr; exit 1; a mesh that fits prints none."""
    assert run_main("plan", EXAMPLES / "seed-64gpu-tp4.toml") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith("infeasible: peak 69.7 GiB") and err[-1].startswith("fix: recompute full -> peak 22.0")
    assert run_main("plan", EXAMPLES / "seed-64gpu.toml") == 0
    assert "fix:" not in capsys.readouterr().err


def test_no_sync_is_offered_back_to_sync(tmp_path):
    """Newcomer (zero3knobs item 2): ``grad_accumulation = "no_sync"`` keeps every unit's unsharded
    gradients through the step and the plan no longer fits; the fix line named every knob but
    the one that caused it. The seed with no_sync peaks at 71.8 GiB > 67.1 GiB; its
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
    # per-layer AC (layerac): ac_freq 5 (16 of the 80 layers) fits at 67.0 GiB, 6 (13) does not
    l5, l6 = _layer(p.config, 5), _layer(p.config, 6)
    assert l5.feasible and not l6.feasible and _gib(l5) == "67.0 GiB"
    assert step_time(l5).step_s == step_time(full).step_s  # the same NIC-bound step, listed after full
    assert memory_fix(p) == (f"fix: recompute full -> peak 47.7 GiB (fits; {_step(full)}); recompute layer ac_freq 5 "
                             f"(every 5th layer of a stage in full) -> peak 67.0 GiB (fits; {_step(l5)}{_tight(l5)}); grad_accumulation sync -> "
                             f"peak 43.3 GiB (fits; {_step(seed)}); cp 2 (dp_shard 4 x cp 2 x tp 8) -> peak 59.2 GiB "
                             f"(fits; {_step(cp2)}{_tight(cp2)}) (usable 67.1 GiB)")
    # sync itself offers no such variant
    assert "grad_accumulation" not in (memory_fix(plan_file(EXAMPLES / "seed-64gpu-tp4.toml")) or "")


def test_per_layer_ac_at_the_largest_ac_freq_that_fits(tmp_path):
    """Newcomer (layerac): under torchtitan the line offered recompute full, never per-layer AC.
    Llama-3-8B at seq 12288, dp_shard 8, micro-batch 1, no recompute, one dgx-h100 (usable 80 GB x
    0.9 = 72.0 GB). A layer stores, per token, 2 B x (6 x 4096 (both norms' inputs, the qkv input,
    q, the context, w_in's input) + 2 x 1024 (k, v) + 4 x 14336 (gate, silu, up, w_out's input)) =
    2 x 83968 B, and the flash statistics 32 heads x 4 B: 12288 x 168064 = 2,065,170,432 B; one
    checkpointed keeps its input, 12288 x 4096 x 2 B = 100,663,296 B: 1,964,507,136 B less each.
    The peak, 89,006,942,208 B, needs (89,006,942,208 - 72e9) / 1,964,507,136 = 8.66, so 9 of the 32
    layers checkpointed: ac_freq 3 (32 // 3 = 10 layers, peak 89,006,942,208 - 10 x 1,964,507,136 =
    69,361,870,848 B), not 4 (8 layers, 73,290,885,120 B). Fewer layers replayed than full's 32:
    the shorter step of the two, listed first."""
    f = tmp_path / "llama3-8b_8xh100_seq12k.toml"
    f.write_text(job_toml(training={"global_batch": 8, "seq_len": 12288, "micro_batch": 1, "recompute": "none"},
                          mesh={"names": ["dp_shard"], "shape": [8]}))
    p = plan_file(f)
    cfg = p.config
    d = 1_964_507_136
    assert (p.timeline.peak.total_bytes, p.timeline.usable_bytes) == (89_006_942_208, 72e9)
    l3, l4 = _layer(cfg, 3), _layer(cfg, 4)
    assert (l3.timeline.peak.total_bytes, l4.timeline.peak.total_bytes) == (89_006_942_208 - 10 * d,
                                                                            89_006_942_208 - 8 * d)
    assert l3.feasible and not l4.feasible
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    assert step_time(l3).step_s < step_time(full).step_s
    line = memory_fix(p)
    # 72e9 - 69,361,870,848 = 2,638,129,152 B free = 2.5 GiB, 3.7% of usable: under 15%, marked tight
    tight = "tight: 2.5 GiB = 3.7% of the usable 67.1 GiB free, under 15%"
    assert _tight(l3) == f"; {tight}"
    mine = f"recompute layer ac_freq 3 (every 3rd layer of a stage in full) -> peak 64.6 GiB (fits; {_step(l3)}; {tight})"
    assert mine in line and line.index(mine) < line.index(f"recompute full -> peak {_gib(full)} (fits; {_step(full)})")
    # read from a torchtitan TOML: its own keys (selective_ac_option, an int string: every k-th layer)
    tt = replace(p, config=replace(cfg, origin="torchtitan"))
    assert ('activation_checkpoint.mode = "selective", activation_checkpoint.selective_ac_option = "3" (every 3rd '
            'layer of a stage in full) -> peak 64.6 GiB') in memory_fix(tt, keymap_of(tt.config))
    # already at ac_freq 4: the line offers 3; under Megatron-LM (no per-layer AC) none
    at4 = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "layer", "ac_freq": 4})))
    assert "recompute layer ac_freq 3 (" in memory_fix(at4)
    mg = build_plan(replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron"})))
    assert not mg.feasible and "recompute layer" not in memory_fix(mg)
