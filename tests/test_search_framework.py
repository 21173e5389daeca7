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
    ({"framework": "megatron"}, 0),                                  # Megatron-LM's distributed optimizer
    ({"sharding": "zero1", "zero12_engine": "deepspeed"}, 0),        # DeepSpeed's ZeRO-1 under torch
])
def test_zero1_rejected_under_torch_by_name(training, rejected):
    """pp 1, tp 1 or 2 on 8 GPUs: zero1 on dp_shard 8 and on dp_shard 4 x tp 2 (2 rows; under
    megatron tp overlap doubles the tp 2 one: 3), zero3 on both with and without
    reshard_after_forward (4; megatron: 6). Only torch without DeepSpeed's engine rejects the
    zero1 rows, under the rule 'framework'."""
    cfg = config(training, pp=[1], tp=[1, 2])
    c = enumerate_candidates(cfg)
    megatron = training.get("framework") == "megatron"
    assert (int((c.sh == ZERO1).sum()), len(c)) == ((3, 9) if megatron else (2, 6))
    code = first_reason(cfg, c)
    assert int((code == CODE["framework"]).sum()) == rejected
    assert ((code == CODE["framework"]) == ((c.sh == ZERO1) & bool(rejected))).all()


def test_torch_search_top_exports_to_torchtitan(tmp_path):
    """The same space searched under torch: no zero1 row in the top, a note names the rule and
    the fix, and row 1 exports to torchtitan (it used to rank zero1, which torchtitan refuses)."""
    from meshplan.interop.foreign import export

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
