"""Findings of newcomer trial 6 (issue 11): each test failed on main before its fix."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_main as _main
from docs_text import command_sections

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("args", [("step", EXAMPLES / "seed-64gpu.toml"),
                                  ("memory", EXAMPLES / "mini_2x4_tp2-dp4.toml")])
def test_closed_stdout_exits_141_quietly_not_as_a_verdict(args, tmp_path):
    # the reader of stdout is gone before the first write (``| head -1`` after its line):
    # click's EPIPE handler used to exit 1, which the README reads as "infeasible"
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "meshplan.cli", *map(str, args)], stdout=w,
                           stderr=subprocess.PIPE, text=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")


@pytest.fixture(scope="module")
def zero_pair(tmp_path_factory):
    """The newcomer's z2.toml and z3.toml: the DeepSpeed example imported at stage 2 and 3."""
    d = tmp_path_factory.mktemp("zero")
    src = (EXAMPLES / "deepspeed_zero2_16xh100.json").read_text()
    assert '"stage": 2' in src
    (d / "ds3.json").write_text(src.replace('"stage": 2', '"stage": 3'))
    for name, js in (("z2", EXAMPLES / "deepspeed_zero2_16xh100.json"), ("z3", d / "ds3.json")):
        assert _main("import", "deepspeed", js, "--cluster", "dgx-h100", "--nodes", 2, "--model", "llama3-8b",
                     "--seq-len", 8192, "-o", d / f"{name}.toml") == 0
    return d / "z2.toml", d / "z3.toml"


def test_compare_zero2_zero3_names_each_mesh_and_one_zero_stream(zero_pair):
    from meshplan.compare import compare
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    c = compare(*(build_plan(load_config(p)) for p in zero_pair), names=("z2", "z3"))
    text = "\n".join(c.reasons)
    # the same ranks, each side's words: dp where ZeRO-2 replicates parameters, dp_shard under ZeRO-3
    assert "same mesh (z2 dp 16, z3 dp_shard 16); the plans differ in training.sharding zero2 against zero3" in text
    # DeepSpeed's one data-parallel stream: one row, both sides' own exposure (z3: 81.1 ms when its
    # gathers copied out every byte, 66.2 ms copying out only the prefetched part; 66.1 ms since nc52fixC:
    # its cross-node gathers and reduce-scatters hold 16 of 132 SMs, the compute beside them a little
    # longer, so 0.1 ms more of them hidden; z2's bucketed reduce-scatters at the step's end unchanged)
    assert [r for r in c.reasons if "exposed" in r] == [
        "exposed ZeRO data-parallel: z2 105.5 ms, z3 66.1 ms (-39.4 ms)"]


def _forward_labels(plan) -> set[str]:
    from itertools import islice
    return {e.label for e in islice(plan.timeline.events(), 3000) if "forward:" in e.label}


def test_forward_working_set_says_sp_only_where_sp_runs(zero_pair):
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    full = zero_pair[1].with_name("z3full.toml")  # dp_shard 16, tp 1: no SP; full recompute's MLP working set
    full.write_text(zero_pair[1].read_text().replace('recompute = "none"', 'recompute = "full"'))
    tp1 = _forward_labels(build_plan(load_config(full)))
    assert all("SP" not in x for x in tp1) and "layer 0 forward: forward working set" in tp1
    tp8 = _forward_labels(build_plan(load_config(EXAMPLES / "seed-64gpu.toml")))  # tp 8 with SP
    assert "layer 0 forward: SP all-gathered input" in tp8


def test_megatron_ddp_memory_in_megatron_terms(tmp_path):
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.report.memory import kind_notes
    from meshplan.spec.wording import reduce_words
    args = tmp_path / "mg.args"
    args.write_text((EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text() + "\n--ddp-bucket-size 40000000\n")
    assert _main("import", "megatron", args, "--cluster", "dgx-h100", "--nodes", 2, "-o", tmp_path / "mg.toml") == 0
    plan = build_plan(load_config(tmp_path / "mg.toml"))  # pp 2 x dp 4 x tp 2, zero1, --overlap-grad-reduce
    t = plan.config.training
    words = reduce_words(t, plan.config.origin, plan.config.memory.fsdp_reduce_for(t, plan.pp))
    assert words == ("Megatron DDP gradient reduce-scatter (distributed optimizer) per bucket in the last "
                     "micro-batch's backward (overlap_grad_reduce)")
    assert kind_notes(plan)["grads"] == ("Megatron DDP gradient buffer (main_grad), whole on every rank; "
                                         "the distributed optimizer steps on its own 1/4")


def test_search_counts_each_engine_rule_apart(zero_pair, capsys):
    assert _main("search", zero_pair[1]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  rejected, ")]
    # the 24 zero3 rows kept gathered (12, each at DeepSpeed ZeRO++ hpZ g 1 and 8: the data axis is the
    # world of 2 nodes, search/space.py hpz_applies) are ZeRO-3's rule alone; no zero1/zero2 row breaks ZeRO-1/2's
    assert "  rejected, rule 'engine' (zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, " \
           "cp > 1 or parameters kept gathered): 24" in lines
    assert not any("ZeRO-1/2" in x for x in lines)


def test_minus_one_error_reads_as_a_sentence():
    from meshplan.mesh.resolve import world_error
    from meshplan.spec.mesh import MeshSpec
    e = world_error(MeshSpec(names=["dp_shard", "tp"], shape=[-1, 16]), 8, 8)
    assert str(e) == ("mesh.shape: dp_shard = -1 cannot be inferred: tp 16 does not divide the cluster's 8 GPUs; "
                      "fix: tp 1, 2, 4 or 8 (a divisor of 8), or cluster.nodes = 2 (16 GPUs)")


def test_flags_export_help_names_are_in_the_readme_export_row():
    import re
    from meshplan.cli import HELP
    row = command_sections()["export"]  # the export row's full text, now docs/commands.md's section
    assert row.lstrip().startswith("`export CONFIG")
    flags = set(re.findall(r"--[a-z][a-z-]+", HELP["export"])) - {"--to", "--json", "--force"}
    assert {"--lr", "--train-iters"} <= flags and all(f"`{f}`" in row for f in flags)


def test_deepspeed_zero3_imports_dp_shard_and_round_trips(zero_pair, tmp_path):
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.rank_timeline import Overlap
    from meshplan.schedule.steptime import step_time
    z2, z3 = zero_pair
    assert 'names = ["dp_shard"]' in z3.read_text() and 'names = ["dp"]' in z2.read_text()
    # the old spelling plans identically: one data axis, its name a word, not a different mesh
    old = tmp_path / "z3dp.toml"
    old.write_text(z3.read_text().replace('names = ["dp_shard"]', 'names = ["dp"]'))
    (pa, pb) = (build_plan(load_config(p)) for p in (z3, old))
    assert step_time(pa, Overlap()).step_s == step_time(pb, Overlap()).step_s  # 12.963 s (12.978 s before the copy-out of the prefetched part only)
    assert pa.timeline.peak.total_bytes == pb.timeline.peak.total_bytes
    # export to DeepSpeed and import back: the same [mesh] table
    assert _main("export", z3, "--to", "deepspeed", "-o", tmp_path / "ds.json") == 0
    assert _main("import", "deepspeed", tmp_path / "ds.json", "--cluster", "dgx-h100", "--nodes", 2, "--model",
                 "llama3-8b", "--seq-len", 8192, "-o", tmp_path / "back.toml") == 0
    assert load_config(tmp_path / "back.toml").mesh == load_config(z3).mesh


def test_search_top_against_runner_up_folds_the_zero_stream():
    from meshplan.search.explain import explain
    zero = {"streams": {"fsdp": "ZeRO data-parallel", "dp": "ZeRO data-parallel"}, "layer_passes": 32}
    e = explain({"step": 1.0, "compute": 0.9, "exposed fsdp": 0.1}, {"step": 1.2, "compute": 0.9, "exposed dp": 0.3},
                zero, zero)  # a zero3 top against a zero2 runner-up under DeepSpeed
    assert [(d.shown, d.top_s, d.runner_s) for d in e.parts] == [("exposed ZeRO data-parallel", 0.1, 0.3)]
