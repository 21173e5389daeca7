"""``meshplan search`` proposes only what the config's framework runs (issue searchfw):
zero1 under ``framework = "torch"`` (no torch engine shards the optimizer state alone:
FSDP2 shards the parameters too, torchtitan has no key) is rejected by the rule ``framework``
unless DeepSpeed's engine runs it; a zero1 candidate without a data axis is its zero3 twin's
run and is not listed twice; ``search --export --to T`` refuses, before the search, a target that
refuses every row."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.search.driver import search
from meshplan.search.space import CODE, SHARDING, candidate_config, enumerate_candidates, first_reason

ZERO1 = SHARDING.index("zero1")


def config(training: dict | None = None, **opts):
    return config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 16, "seq_len": 4096, **(training or {})},
                             "search": {"cp": [1], "dp_replicate": [1], "micro_batch": [1], "recompute": ["full"],
                                        "vpp": [1], **opts}}, require_mesh=False)


@pytest.mark.parametrize("training,rejected", [
    ({}, 2),                                                         # torch: Megatron's distributed optimizer has no engine
    ({"framework": "megatron"}, 3),                                  # Megatron-LM: zero3 kept gathered (zero1 runs)
    ({"sharding": "zero1", "zero12_engine": "deepspeed"}, 0),        # DeepSpeed's ZeRO-1 under torch
])
def test_zero1_rejected_under_torch_by_name(training, rejected):
    """pp 1, tp 1 or 2 on 8 GPUs: zero1 on dp_shard 8 and on dp_shard 4 x tp 2 (2 rows; under
    megatron tp overlap doubles the tp 2 one: 3), zero3 on both with and without
    reshard_after_forward (4; megatron: 6), zero2 under DeepSpeed's engine (2). Only torch without
    DeepSpeed's engine rejects the zero1 rows, under the rule 'framework'; under megatron the rule
    rejects the zero3 rows kept gathered instead (1 at tp 1, 2 at tp 2: Megatron FSDP reshards)."""
    cfg = config(training, pp=[1], tp=[1, 2])
    c = enumerate_candidates(cfg)
    megatron, deepspeed = training.get("framework") == "megatron", "zero12_engine" in training
    # DeepSpeed's engine: its zero2 rows too (one per mesh, as zero1)
    assert (int((c.sh == ZERO1).sum()), len(c)) == ((3, 9) if megatron else (2, 8) if deepspeed else (2, 6))
    code = first_reason(cfg, c)
    assert int((code == CODE["framework"]).sum()) == rejected
    bad = (c.sh == SHARDING.index("zero3")) & (c.rf == 0) if megatron else (c.sh == ZERO1) & bool(rejected)
    assert ((code == CODE["framework"]) == bad).all()


def test_torch_search_top_exports_to_torchtitan(tmp_path):
    """The same space searched under torch: no zero1 row in the top, a note names the rule and
    the fix, and row 1 exports to torchtitan (it used to rank zero1, which torchtitan refuses)."""
    from meshplan.interop.export import export

    cfg = config(pp=[1], tp=[1, 2])
    r = search(cfg, workers=1)
    assert r.top and all(r.candidates.sh[e.index] != ZERO1 for e in r.top)
    assert r.counts()["framework"] == 2
    assert any("rule 'framework'" in n and "zero12_engine" in n for n in r.notes)
    text, _ = export(candidate_config(cfg, r.candidates, r.top[0].index), "torchtitan", "search row 1")
    assert "[parallelism]" in text


@pytest.mark.parametrize("framework,before,after", [("megatron", 13, 11), ("torch", 8, 7)])
def test_no_data_axis_zero1_is_not_listed_twice(framework, before, after):
    """pp 2 on 8 GPUs with tp 1, 2, 4 (dp_shard 4, 2, 1), zero1 and zero3, mb 1, full, vpp 1.
    zero1: one row per mesh, two where tp overlap is searched (megatron, tp > 1): 5 (torch 3);
    zero3: reshard_after_forward both ways where dp_shard > 1, times tp overlap: 2 + 4 + 2 = 8
    (torch 2 + 2 + 1 = 5). pp 2 x tp 4 has no data axis: its zero1 rows (megatron 2, torch 1)
    are its zero3 rows' run and left out: 11 (torch 7). The zero3 twin kept is the one the tie
    rule prefers: the same peak, and a step no longer (FSDP2 zeroes no gradient buffer)."""
    cfg = config({"framework": framework}, pp=[2], tp=[1, 2, 4], sharding=["zero1", "zero3"])
    c = enumerate_candidates(cfg)
    assert len(c) == after and before - after == (2 if framework == "megatron" else 1)
    assert not ((c.sh == ZERO1) & (c.fsdp == 1)).any()
    twins = np.flatnonzero((c.fsdp == 1) & (c.sh == SHARDING.index("zero3")))
    assert len(twins) == before - after
    if framework == "megatron":
        for i in twins:
            three = candidate_config(cfg, c, int(i))
            one = replace(three, training=three.training.model_copy(update={"sharding": "zero1"}))
            p3, p1 = build_plan(three), build_plan(one)
            assert p3.timeline.peak.total_bytes == p1.timeline.peak.total_bytes
            assert step_time(p3).step_s <= step_time(p1).step_s


def test_export_target_refusing_every_row_is_refused_before_searching(tmp_path, capsys):
    """[search] sharding zero1 only: torchtitan (FSDP2 only) refuses every row; said before the
    search runs (no search header), naming --to and the fix."""
    from meshplan.cli import main

    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                    '[training]\nglobal_batch = 16\nseq_len = 4096\n[search]\nsharding = ["zero1"]\n')
    with pytest.raises(SystemExit) as done:
        main(["search", str(path), "--export", "1", "--to", "torchtitan", "-o", str(tmp_path / "r.toml")])
    cap = capsys.readouterr()
    assert done.value.code == 2 and cap.err.strip().splitlines()[-1] == (
        "error: --to: torchtitan shards with FSDP2 (zero3, hsdp); [search] sharding lists zero1 only: add zero3 to "
        "search.sharding or export --to megatron"), cap.err
    assert "candidates" not in cap.out and not (tmp_path / "r.toml").exists()


def test_deepspeed_zero2_config_searches_its_own_stage():
    """examples/deepspeed_zero2_16xh100.json (ZeRO stage 2, DeepSpeed's engine) on 2 x 8 H100
    with Llama 3 8B at 4,096 tokens: its [search] is one data axis (dp_shard 16) with zero1, zero2
    and zero3; 4 micro-batches x 3 policies (none, selective, full; not torchtitan's op, which
    DeepSpeed's engine does not have) x (zero1 + zero2 + zero3 with and without
    reshard_after_forward, each at DeepSpeed ZeRO++ hpZ g 1 and 8: the data axis is the world of 2
    nodes, search/space.py hpz_applies) = 12 x 6 = 72 candidates (60 without zero2). The config's
    own run (zero2, mb 1, no recompute: the JSON has no activation_checkpointing section) is one
    of them, planned as `meshplan step` plans the config: 5797.53 ms (5798.09 before torch's batch copy
    replaced the 52 us per micro-batch; 6018.68 ms when the reader
    took a JSON without the section as selective recompute). (kvheads: no repeat_kv copies, [memory]
    kv_expanded false, HF's SDPA reading the 8 KV heads: 2 ops a layer of 2 x 4096 x (32 + 8) x 128 x 2 B =
    83,886,080 B, 28.24 us at 2.97 TB/s, x 32 layers x 16 micro-batches = 28.92 ms: 5797.53 -> 5768.61 ms.)"""
    import dataclasses
    from pathlib import Path

    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any

    path = Path(__file__).parent.parent / "examples" / "deepspeed_zero2_16xh100.json"
    cfg = load_any(path, opts=ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096))
    assert cfg.search.sharding == ["zero1", "zero2", "zero3"] and cfg.training.sharding == "zero2"
    c = enumerate_candidates(cfg)
    z2 = SHARDING.index("zero2")
    assert len(c) == 72 and int((c.sh == z2).sum()) == 12 and not c.rf[c.sh == z2].min() == 0
    own = int(np.flatnonzero((c.sh == z2) & (c.mb == 1) & (c.rc == 0))[0])  # RECOMPUTE[0]: none
    mine = build_plan(cfg)
    row = build_plan(candidate_config(cfg, c, own))
    assert row.config.training == mine.config.training
    assert step_time(row).step_s == step_time(mine).step_s == pytest.approx(5.76861, abs=5e-6)
    assert round(5.79753 - 2 * 32 * 16 * 83_886_080 / 2.97e12, 5) == 5.76861   # kvheads (docstring)
    r = search(dataclasses.replace(cfg, search=cfg.search.model_copy(update={"top": 5})), workers=1)
    # one data axis, one mesh: one row (searchtie: rows are distinct meshes); zero2 among the placed
    assert len(r.top) == 1 and any(r.candidates.sh[e.index] == z2 for e in r.placed)


@pytest.mark.slow
@pytest.mark.parametrize("training,zero2_rows", [
    ({"sharding": "zero2", "zero12_engine": "deepspeed", "overlap_comm": False}, 120),
    ({"sharding": "zero2", "zero12_engine": "deepspeed", "overlap_comm": True}, 120),
    # a stage 3 JSON: its zero1/zero2 rows at stage 1/2's defaults; it enumerates tp 8 and pp 8 too
    ({"sharding": "zero3", "zero3_engine": "deepspeed"}, 152),
], ids=["zero2", "zero2-overlap", "zero3"])
def test_deepspeed_zero2_bounds_hold_for_every_candidate(training, zero2_rows):
    """SMALL on 8 GPUs under DeepSpeed's ZeRO-1/2 engine (the config at zero2, overlap_comm off
    and on; or at zero3 under DeepSpeed's ZeRO-3, whose zero1/zero2 rows run ZeRO-1/2 with
    overlap_comm off, DeepSpeed's default below stage 3, and its hsdp rows FSDP2 with fp32
    gradients: before the bounds took each row's training, 107 of its plans fell outside them):
    every candidate planned exactly; the search's verdicts are build_plan's (DeepSpeed's engine
    refuses cp, ep and, for ZeRO-2 or overlap_comm, pp > 1: rule 'engine', build_plan a
    ConfigError), its step and memory bounds hold on every one, zero2 included (bound / step on
    them: largest 0.882 and 0.891, median 0.837 and 0.858), and its top is the exhaustive exact
    ranking."""
    from meshplan.errors import ConfigError
    from test_search import exhaustive_rows
    from meshplan.search.space import OK
    from test_search import config as small

    cfg = small(1, 6.0, training=training, micro_batch=[1, 2], recompute=["selective", "full"], top=6)
    r = search(cfg, workers=1)
    c, m = r.candidates, cfg.search.memory_margin
    z2 = SHARDING.index("zero2")
    assert int((c.sh == z2).sum()) == zero2_rows
    steps, peaks, ratios = {}, {}, []
    for i in range(len(c)):
        try:
            p = build_plan(candidate_config(cfg, c, i))
        except ConfigError:
            assert r.code[i] == CODE["engine"], c.label(i)
            continue
        assert r.code[i] != CODE["engine"], c.label(i)
        if r.code[i] == CODE["replicate"]:  # ddp (hsdp sharding nothing) under torch: the search's own rule, no bound
            assert c.replicated[i]
            continue
        if not p.feasible:
            assert r.code[i] != OK, c.label(i)
            continue
        step = step_time(p).step_s
        if r.code[i] == OK:
            steps[i], peaks[i] = step, p.timeline.peak.total_bytes
        assert r.est.step_lo[i] <= step * (1 + 1e-9), c.label(i)
        assert r.est.peak_lo[i] / (1 + m) <= p.timeline.peak.total_bytes <= r.est.peak_hi[i] * (1 + m), c.label(i)
        if c.sh[i] == z2:
            ratios.append(r.est.step_lo[i] / step)
    assert [e.index for e in r.top] == exhaustive_rows(r, steps, 6, peaks)
    assert max(ratios) >= 0.87 and np.median(ratios) >= 0.83


def test_deepspeed_zero12_engine_runs_1f1b_only():
    """DeepSpeed's ZeRO-1/2 engine (PipelineEngine.train_batch always runs TrainSchedule, 1F1B
    over one chunk per stage) on 8 GPUs, pp 1 or 2, tp 1, vpp 1 or 2, 1F1B and ZB-V: 16
    candidates, by sharding: zero1 and zero2 one each at pp 1, three each at pp 2 (vpp 1; vpp 2
    interleaved; vpp 2 ZB-V), zero3 8 (the same 4 meshes, reshard_after_forward both ways).
    Rule 'engine' rejects zero2 at pp 2 (3, as before) and now zero1 at pp 2 with vpp 2 (2,
    interleaved 1F1B and ZB-V: it used to rank them); zero1 at pp 2 vpp 1 stays. The zero3 rows run
    DeepSpeed's own ZeRO-3 (zero3_engine "deepspeed", not FSDP2): its pipeline engine refuses ZeRO-3
    and it re-gathers in backward, so 7 of the 8 are rejected too (the 6 at pp 2, and pp 1 kept
    gathered), 12 in all. build_plan refuses the rejected zero1 rows naming mesh.pp_schedule and
    plans the kept one."""
    from meshplan.errors import ConfigError

    cfg = config({"sharding": "zero1", "zero12_engine": "deepspeed"}, pp=[1, 2], tp=[1], vpp=[1, 2],
                 pp_schedules=["1f1b", "zbv"])
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    engine = code == CODE["engine"]
    assert len(c) == 16 and int(engine.sum()) == 12
    assert int((engine & (c.sh == SHARDING.index("zero2"))).sum()) == 3
    z3 = c.sh == SHARDING.index("zero3")
    assert np.flatnonzero(z3 & ~engine).tolist() == np.flatnonzero(z3 & (c.pp == 1) & (c.rf == 1)).tolist()
    assert int((z3 & engine).sum()) == 7
    rejected = np.flatnonzero(engine & (c.sh == ZERO1))
    assert sorted((int(c.pp[i]), int(c.vpp[i]), int(c.ps[i])) for i in rejected) == [(2, 2, 0), (2, 2, 1)]
    for i in rejected:
        with pytest.raises(ConfigError) as e:
            build_plan(candidate_config(cfg, c, int(i)))
        assert e.value.field == "mesh.pp_schedule" and "TrainSchedule" in e.value.message
    kept = int(np.flatnonzero((c.sh == ZERO1) & (c.pp == 2) & (c.vpp == 1))[0])
    assert code[kept] != CODE["engine"] and build_plan(candidate_config(cfg, c, kept)).feasible


def test_step_schedule_option_refuses_what_deepspeed_engine_cannot_run():
    """step --schedule under DeepSpeed's ZeRO-1/2 engine: gpipe at pp 2 is refused naming
    --schedule (TrainSchedule is 1F1B); 1f1b is planned."""
    from meshplan.errors import ConfigError

    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 16, "seq_len": 4096, "sharding": "zero1",
                                         "zero12_engine": "deepspeed", "recompute": "full"},
                            "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4]}})
    p = build_plan(cfg)
    with pytest.raises(ConfigError) as e:
        step_time(p, schedule="gpipe")
    assert e.value.field == "--schedule" and e.value.message.startswith("gpipe with pp 2 under training.zero12_engine")
    assert step_time(p, schedule="1f1b").step_s == step_time(p).step_s


def test_megatron_search_rejects_the_rows_megatron_cannot_run(tmp_path, capsys):
    """Under framework megatron, dp 8 on one node (pp, tp, cp 1; mb 1, full), zero3 and hsdp with
    and without reshard_after_forward: 4 candidates. Megatron FSDP, what --export --to megatron
    writes for zero3, reshards every layer after its forward (Megatron-LM keeps parameters
    gathered only under --use-torch-fsdp2), and meshplan neither plans nor writes Megatron FSDP's
    HSDP: rule 'framework' rejects the zero3 row kept gathered (0.913 s, which used to rank first
    with a 'not expressed' line) and both hsdp rows; the one left (0.927 s) exports whole. The
    text counts them with the rule's Megatron words, --json under counts.framework. Under torch all
    4 rank (2 rows: one per mesh), none rejected by the rule."""
    import json

    from meshplan.cli import main
    from meshplan.interop.export import export
    from meshplan.report.search import export_lines
    from meshplan.search.reasons import MEGATRON_REFUSED

    space = {"pp": [1], "tp": [1], "dp_replicate": [1, 2], "sharding": ["zero3", "hsdp"]}
    r = search(config({"framework": "megatron"}, **space), workers=1)
    assert [r.candidates.label(e.index) for e in r.top] == ["dp_shard 8, mb 1, full, vpp 1, zero3"]
    assert [round(e.step_s, 3) for e in r.top] == [0.927] and r.counts()["framework"] == 3
    rejected = sorted(r.candidates.label(i) for i in np.flatnonzero(r.code == CODE["framework"]))
    assert rejected == ["dp_replicate 2 x dp_shard 4, mb 1, full, vpp 1, hsdp",
                        "dp_replicate 2 x dp_shard 4, mb 1, full, vpp 1, hsdp, keep gathered",
                        "dp_shard 8, mb 1, full, vpp 1, zero3, keep gathered"]
    assert export_lines(r) == []
    _, head = export(candidate_config(r.config, r.candidates, r.top[0].index), "megatron", "search")
    assert not [h for h in head if h.startswith("not expressed in megatron")]
    torch = search(config({}, **space), workers=1)
    # two meshes (dp_shard 8; dp_replicate 2 x dp_shard 4), one row each (searchtie), all 4 placed
    assert len(torch.top) == 2 and len(torch.placed) == 4 and torch.counts()["framework"] == 0
    assert export_lines(torch) == []
    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                    'global_batch = 16\nseq_len = 4096\nframework = "megatron"\n[search]\npp = [1]\ntp = [1]\n'
                    'cp = [1]\ndp_replicate = [1, 2]\nmicro_batch = [1]\nrecompute = ["full"]\nvpp = [1]\n'
                    'sharding = ["zero3", "hsdp"]\n')
    with pytest.raises(SystemExit) as done:
        main(["search", str(path), "--json", str(tmp_path / "s.json")])
    assert done.value.code == 0
    out = capsys.readouterr().out.replace("\n", " ")
    assert f"rejected, rule 'framework' ({MEGATRON_REFUSED}): 3" in " ".join(out.split()), out
    assert json.loads((tmp_path / "s.json").read_text())["counts"]["framework"] == 3


def test_megatron_search_kept_gathered_only_has_no_feasible_mesh():
    """[search] reshard_after_forward = [false] with zero3 only under framework megatron: every
    candidate kept gathered, all rejected by rule 'framework'; the one line names the rule with
    its Megatron words and the Megatron fix (not torch's zero12_engine one)."""
    from meshplan.report.search_fix import infeasible_verdict
    from meshplan.search.reasons import MEGATRON_REFUSED

    cfg = config({"framework": "megatron"}, pp=[1], tp=[1], sharding=["zero3"], reshard_after_forward=[False])
    r = search(cfg, workers=1)
    v = infeasible_verdict(r)
    assert not r.top and v is not None
    assert v["rules"] == [{"rule": "framework", "rejected": 1, "text": MEGATRON_REFUSED}]
    assert v["fix"].startswith("let search.reshard_after_forward include true") and "zero12_engine" not in v["fix"]
