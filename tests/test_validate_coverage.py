"""``validate`` says what a small CPU run did not test (newcomer trial: ``validate chosen.toml
--worlds 4`` printed ``mesh: dp_shard = 4 / (tp 4) = 1 (config: dp_shard 128)`` and PASSED with no
word that FSDP never ran). Each axis of degree > 1 in the config that a world runs at degree 1 is
named, with the world that runs it, in the console lines, summary.md and --json; PASSED stays
PASSED. The degrees below follow scale_mesh's rule by hand: the outermost data axis absorbs the
world, ``data = W / (product of the other axes)``, every other axis keeps its degree."""

from __future__ import annotations

import json

from meshplan.config import config_from_dict
from meshplan.report.json_docs import validate_doc
from meshplan.runtime.validation.coverage import everywhere, not_exercised
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.summary import write_summary


def _config(names, shape, nodes, model="llama3-8b", sharding="zero3"):
    return config_from_dict({"model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": nodes},
                             "training": {"global_batch": 1024, "seq_len": 4096, "micro_batch": 1,
                                          "sharding": sharding},
                             "mesh": {"names": names, "shape": shape}})


def test_the_trials_fsdp_128_at_world_4_is_named_with_the_world_that_runs_it():
    """dp_shard 128 x tp 4 on 64 nodes (512 GPUs) at --worlds 4: dp_shard = 4 / (tp 4) = 1; at
    world 8 it is 8 / 4 = 2. tp 4 keeps its degree: not listed."""
    cfg = _config(["dp_shard", "tp"], [128, 4], 64)
    [gap] = not_exercised(cfg, 4, Options(worlds=(4,)))
    assert gap["line"] == ("not exercised: dp_shard (FSDP) 128 -> 1; its collectives were not run; --worlds 8 "
                           "runs dp_shard 2")
    assert (gap["axis"], gap["config_degree"], gap["runs_it"]) == ("dp_shard", 128, {"world": 8, "degree": 2})
    assert not_exercised(cfg, 8, Options(worlds=(8,))) == []  # dp_shard 2 runs its all-gathers
    # validate-slice's option is --world: the line names it
    assert not_exercised(cfg, 4, Options(worlds=(4,), world_option="--world"))[0]["line"].endswith(
        "--world 8 runs dp_shard 2")


def test_hsdp_replicas_ddp_and_cp():
    """dp_replicate 4 x dp_shard 2 x tp 8 (64 GPUs) at world 16: dp_replicate = 16 / (dp_shard 2 x
    tp 8) = 1, world 32 runs it at 2; dp (sharding none) 16 x tp 4 at world 4 is DDP; dp_shard 4
    x cp 2 x tp 2 at world 4: dp_shard 1 but FSDP still shards over cp 2 (fsdp = dp_shard x cp)."""
    [g] = not_exercised(_config(["dp_replicate", "dp_shard", "tp"], [4, 2, 8], 8), 16, Options())
    assert g["line"] == ("not exercised: dp_replicate (HSDP replicas) 4 -> 1; its collectives were not run; "
                         "--worlds 32 runs dp_replicate 2")
    [g] = not_exercised(_config(["dp", "tp"], [16, 4], 8, sharding="none"), 4, Options())
    assert g["line"].startswith("not exercised: dp (DDP) 16 -> 1; its collectives were not run; --worlds 8 runs dp 2")
    [g] = not_exercised(_config(["dp_shard", "cp", "tp"], [4, 2, 2], 2), 4, Options())
    assert g["line"] == ("not exercised: dp_shard (FSDP) 4 -> 1; FSDP's collectives ran over cp 2 alone (fsdp = "
                         "dp_shard x cp); --worlds 8 runs dp_shard 2")


def test_experts_fsdp():
    """Mixtral's dp_shard 32 x ep 8 (32 GPUs): the dense block dp_shard is re-factored as efsdp x
    ep, efsdp = 32 / 8 = 4. At world 8: dp_shard 8, efsdp 8 / 8 = 1; at 16: efsdp 2."""
    cfg = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
                            "training": {"global_batch": 256, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3"},
                            "mesh": {"names": ["dp_shard", "ep"], "shape": [32, 8]}})
    [g] = not_exercised(cfg, 8, Options())
    assert g["line"] == ("not exercised: efsdp (the experts' FSDP) 4 -> 1; its collectives were not run; "
                         "--worlds 16 runs efsdp 2")


def test_passed_stays_passed_with_the_line_in_the_summary_and_the_json(tmp_path):
    """Recorded results of worlds 2 and 4 of the mini mesh (dp_shard 4 x tp 2 on 8 GPUs): world 2
    runs dp_shard 1, world 4 dp_shard 2; the verdict lists no axis, world 2's section does. With
    world 2 alone the line is under the verdict and in --json's top level."""
    cfg = _config(["dp_shard", "tp"], [4, 2], 1)
    opt = Options(worlds=(2, 4))
    res = [{"world": w, "ok": True, "stage": "compare", "message": "collectives match the plan exactly",
            "notes": [], "not_exercised": not_exercised(cfg, w, opt)} for w in (2, 4)]
    line = "not exercised: dp_shard (FSDP) 4 -> 1; its collectives were not run; --worlds 4 runs dp_shard 2"
    assert [g["line"] for g in res[0]["not_exercised"]] == [line] and res[1]["not_exercised"] == []
    assert everywhere(res) == []
    write_summary(tmp_path, cfg, opt, res)
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("# meshplan validate: PASSED") and "Not checked by this run" not in md
    assert f"## world 2: OK\n\ncollectives match the plan exactly\n\n\n- {line}\n" in md
    write_summary(tmp_path, cfg, Options(worlds=(2,)), res[:1])
    lines = (tmp_path / "summary.md").read_text().split("\n")
    assert lines[0] == "# meshplan validate: PASSED" and lines[2].startswith("Config `")
    assert lines[4:7] == ["Not checked by this run (an axis at degree 1 in every world):", "", f"- {line}"]
    doc = validate_doc("mini.toml", 0, res[:1], str(tmp_path), 0, [g["line"] for g in everywhere(res[:1])])
    assert (doc["ok"], doc["not_exercised"], doc["worlds"][0]["not_exercised"]) == (True, [line], [line])
    json.dumps(doc)
