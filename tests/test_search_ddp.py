"""An hsdp row that shards nothing is DDP (newcomer trial 15 #2): with dp_shard x cp 1 the
parameters, gradients and optimizer state are replicated over dp_replicate and the gradients
all-reduced, so the search names it ``ddp``, and under ``framework = "torch"`` rejects it (rule
``replicate``): torchtitan applies FSDP2 only where dp_shard x cp > 1 and otherwise DDP, which
it refuses beside pp or tp ("DDP has not supported > 1D parallelism", parallelize_llama at
pytorch/torchtitan 018740b). Before, such a row (dp_replicate 8 x tp 2, "hsdp") was the search's
row 1 and ``search --export 1 --to torchtitan`` refused it."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.config import load_config
from meshplan.search.columns import SHARDING, Candidates
from meshplan.search.space import CODE, enumerate_candidates, first_reason
from tests.cli_run import run_main

#: Llama-3-8B on 2 dgx-h100 (16 GPUs), hsdp only at pp 1, cp 1, tp 2, micro-batch 1, full
#: recompute: dp_replicate x dp_shard = 8 with dp_replicate > 1, so dp_replicate 2, 4, 8 (dp_shard 4,
#: 2, 1); the two with dp_shard > 1 also kept gathered: 5 candidates.
SEARCH = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 2
[training]
global_batch = 32
seq_len = 8192
{framework}
[search]
sharding = ["hsdp"]
pp = [1]
cp = [1]
tp = [2]
micro_batch = [1]
recompute = ["full"]
"""


def _cfg(tmp_path, framework: str = ""):
    path = tmp_path / "s.toml"
    path.write_text(SEARCH.format(framework=framework))
    return path


def test_hsdp_row_without_a_shard_axis_is_named_ddp(tmp_path):
    """Of the 5 candidates only dp_replicate 8 x tp 2 (dp_shard 1) shards nothing: its label says
    ddp; the other four stay hsdp."""
    c = enumerate_candidates(load_config(_cfg(tmp_path), require_mesh=False))
    labels = sorted(c.label(i) for i in range(len(c)))
    assert len(c) == 5 and c.replicated.tolist().count(True) == 1
    assert labels == ["dp_replicate 2 x dp_shard 4 x tp 2, mb 1, full, vpp 1, hsdp",
                      "dp_replicate 2 x dp_shard 4 x tp 2, mb 1, full, vpp 1, hsdp, keep gathered",
                      "dp_replicate 4 x dp_shard 2 x tp 2, mb 1, full, vpp 1, hsdp",
                      "dp_replicate 4 x dp_shard 2 x tp 2, mb 1, full, vpp 1, hsdp, keep gathered",
                      "dp_replicate 8 x tp 2, mb 1, full, vpp 1, ddp"]


@pytest.mark.parametrize("moe,ep,etp,replicated", [
    (False, 1, 1, True),   # dense: dp_shard x cp 1 shards nothing
    (True, 1, 1, False),   # MoE, experts not tp-split: FSDP2 shards them over tp (efsdp 2)
    (True, 2, 1, True),    # MoE, ep 2 = tp: efsdp 1
    (True, 1, 2, True),    # MoE, etp 2 = tp: efsdp 1
])
def test_replicated_needs_no_expert_shard(moe, ep, etp, replicated):
    """dp_replicate 4 x tp 2, hsdp: efsdp = dp_shard x cp x tp / (ep x etp) = 2 / (ep x etp)."""
    one = lambda v: np.array([v])  # noqa: E731
    c = Candidates(pp=one(1), dpr=one(4), dps=one(1), cp=one(1), tp=one(2), ep=one(ep), etp=one(etp), mb=one(1),
                   rc=one(0), vpp=one(1), sh=one(SHARDING.index("hsdp")), rf=one(1), ov=one(0), us=one(0),
                   ps=one(0), moe=moe)
    assert bool(c.replicated[0]) is replicated and c.take([0]).moe is moe
    assert c.sharding_word(0) == ("ddp" if replicated else "hsdp")


def test_rejected_under_torch_only_by_rule_replicate(tmp_path):
    """Under torch the ddp row is rejected by rule 'replicate' and nothing else is; under megatron
    every hsdp row is rejected by rule 'framework' first (Megatron FSDP's HSDP is not modelled)."""
    cfg = load_config(_cfg(tmp_path), require_mesh=False)
    c = enumerate_candidates(cfg)
    code = first_reason(cfg, c)
    assert ((code == CODE["replicate"]) == c.replicated).all()
    (tmp_path / "m").mkdir()
    mcfg = load_config(_cfg(tmp_path / "m", 'framework = "megatron"'), require_mesh=False)
    assert (first_reason(mcfg, enumerate_candidates(mcfg)) == CODE["framework"]).all()


def test_search_top_exports_to_torchtitan_and_imports_to_the_same_mesh(tmp_path, capsys):
    """Row 1 was dp_replicate 8 x tp 2 ("hsdp", 2.359 s), which --export 1 --to torchtitan refused;
    now it is rejected (counted under its rule) and row 1, dp_replicate 2 x dp_shard 4 x tp 2,
    exports (data_parallel_replicate_degree 2, data_parallel_shard_degree 4, tensor_parallel_degree 2)
    and imports back to that mesh."""
    cfg = _cfg(tmp_path)
    assert run_main("search", cfg, "--export", 1, "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 0
    out = capsys.readouterr().out
    assert "rejected, rule 'replicate' (ddp (hsdp with dp_shard x cp 1) under framework torch: torchtitan shards " \
        "with FSDP2 only" in out
    assert "│ 1 │ dp_replicate 2 x dp_shard 4 x tp 2 " in out and "ddp" not in out.split("order:")[0]
    tt = (tmp_path / "tt.toml").read_text()
    assert ("data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 4\ncontext_parallel_degree = 1\n"
            "tensor_parallel_degree = 2\n") in tt
    assert run_main("import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", 2,
                    "-o", tmp_path / "back.toml") == 0
    back = load_config(tmp_path / "back.toml")
    assert (back.mesh.names, back.mesh.shape, back.training.sharding) == (
        ["dp_replicate", "dp_shard", "tp"], [2, 4, 2], "hsdp")


@pytest.mark.parametrize("names,shape,fix", [
    (["dp_replicate", "tp"], [4, 2], "which it refuses beside pp or tp (\"DDP has not supported > 1D parallelism\"): "
                                     "move dp_replicate's degree to dp_shard (zero3) to export it"),
    (["dp_replicate"], [8], "meshplan's sharding none: set training.sharding = \"none\" to export it"),
])
def test_export_of_an_hsdp_plan_that_shards_nothing_names_ddp(tmp_path, capsys, names, shape, fix):
    """``export --to torchtitan`` of a config with sharding hsdp and dp_shard x cp 1 says what
    the plan is (ddp) and what torchtitan does with it: DDP beside tp is refused; DDP alone is
    torchtitan's run of sharding none. Both also plan (``plan``'s header names the ddp)."""
    path = tmp_path / "d.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                    'global_batch = 8\nseq_len = 1024\nsharding = "hsdp"\nrecompute = "full"\n[mesh]\n'
                    f'names = {names}\nshape = {shape}\nsequence_parallel = true\n'.replace("'", '"'))
    assert run_main("export", path, "--to", "torchtitan", "-o", tmp_path / "tt.toml") != 0
    err = capsys.readouterr().err
    assert err.startswith("error: --to: sharding hsdp with dp_shard x cp 1 shards nothing (ddp over dp_replicate); "
                          "torchtitan applies FSDP2 only where dp_shard x cp > 1, and otherwise DDP, " + fix)
    assert not (tmp_path / "tt.toml").exists()
    run_main("plan", path)
    assert ("sharding hsdp (dp_shard x cp 1: shards nothing, so ddp: replicated over dp_replicate, gradients "
            "all-reduced)") in " ".join(capsys.readouterr().out.split())


def test_hsdp_over_cp_alone_exports_to_torchtitan_and_imports_back(tmp_path, capsys):
    """dp_replicate 2 x cp 2 x tp 2, hsdp, dp_shard 1: torchtitan's FSDP axis is dp_shard x cp = 2
    (``fsdp_enabled``: dp_shard > 1 or cp > 1), so it runs HSDP over (dp_replicate, dp_shard x cp);
    the export, which refused it as "not what torchtitan applies" (it looked at dp_shard alone),
    writes it and the import reads back the same mesh and sharding, planning the same step."""
    path = tmp_path / "h.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                    'global_batch = 8\nseq_len = 4096\nsharding = "hsdp"\nrecompute = "full"\n[mesh]\n'
                    'names = ["dp_replicate", "cp", "tp"]\nshape = [2, 2, 2]\nsequence_parallel = true\n')
    assert run_main("export", path, "--to", "torchtitan", "-o", tmp_path / "tt.toml") == 0
    tt = (tmp_path / "tt.toml").read_text()
    assert ("data_parallel_replicate_degree = 2\ndata_parallel_shard_degree = 1\ncontext_parallel_degree = 2\n"
            "tensor_parallel_degree = 2\n") in tt
    assert run_main("import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", 1,
                    "-o", tmp_path / "back.toml") == 0
    back = load_config(tmp_path / "back.toml")
    assert (back.mesh.names, back.mesh.shape, back.training.sharding) == (["dp_replicate", "cp", "tp"], [2, 2, 2],
                                                                          "hsdp")
    capsys.readouterr()
    steps = []
    for p in (path, tmp_path / "back.toml"):
        assert run_main("step", p) == 0
        steps.append(next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")).split(" ms")[0])
    assert steps[0] == steps[1]


def test_only_ddp_rows_left_is_no_feasible_mesh_with_the_rule_and_its_fix(tmp_path, capsys):
    """[search] dp_replicate = [8] at tp 2 leaves the one ddp row, which rule 'replicate' rejects
    under torch: exit 1, the rule and a fix that reaches FSDP2 (megatron would not help: it
    rejects every hsdp row)."""
    path = _cfg(tmp_path)
    path.write_text(path.read_text() + "dp_replicate = [8]\n")
    assert run_main("search", path) == 1
    err = capsys.readouterr().err
    assert "no feasible mesh: of 1 candidates rule 'replicate' rejected 1 (ddp (hsdp with dp_shard x cp 1)" in err
    assert err.rstrip().endswith("fix: add zero3 to search.sharding or let search.dp_shard or search.cp exceed 1 "
                                 "(FSDP2 shards over them)")
