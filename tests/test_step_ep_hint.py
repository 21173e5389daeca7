"""The step's ep ``hint:`` line (meshplan/schedule/ep_hint.py) and the plan's ``axis ep:`` line, on a
small DeepSeek-V3-like MoE (tests/data/hf/deepseek-v3-mini/config.json: DeepSeek-V3's config.json
keys, MLA, 1 dense + 7 MoE layers, 64 routed experts, top-8, 1 shared) under Megatron-LM with
ZeRO-1 on 4 dgx-h100 (8 GPUs a node): dp 32 x ep 32, whose ep group spans 4 nodes, against ep
inside a node. Each hinted step is compared with ``step`` of the config edited by hand."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.plan_moe import ep_span
from meshplan.report.search import row_mesh
from meshplan.schedule.ep_hint import ep_hint
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import rebuilt_step
from meshplan.schedule.waits import bubble_wait
from meshplan.units import step_seconds
from tests.cli_run import run_main

MINI = Path(__file__).parent / "data" / "hf" / "deepseek-v3-mini" / "config.json"


def _toml(tmp_path: Path, shape: list[int], *, hf: Path = MINI, nodes: int = 4, world: int = 0,
          global_batch: int = 256, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(f'[model]\nhf_config = "{hf}"\n\n[cluster]\nsystem = "dgx-h100"\nnodes = {nodes}\n\n'
                    f'[training]\nglobal_batch = {global_batch}\nseq_len = 4096\nmicro_batch = 1\nsharding = "zero1"\n'
                    'recompute = "none"\nframework = "megatron"\n\n'
                    f'[mesh]\nnames = ["dp_shard", "ep"]\nshape = {shape}\n' + (f"world = {world}\n" if world else ""))
    return path


def _lines(path: Path) -> list[str]:
    p = build_plan(load_config(path))
    st = step_time(p)
    return ep_hint(p, st, rebuilt_step(p, step_time), bubble_wait(st))


def _step_out(path: Path, capsys) -> str:
    """What ``meshplan step`` prints for the config."""
    capsys.readouterr()
    assert run_main("step", path) == 0
    return capsys.readouterr().out


def _step_line(path: Path, capsys) -> str:
    """``step`` of the config as the CLI prints it: its first line's step, as a hint prints it."""
    out = _step_out(path, capsys)
    assert out.startswith("step ") and out.split()[2] == "ms"  # "step 532.21 ms (..."
    return step_seconds(float(out.split()[1]) / 1e3)


def test_ep_across_nodes_is_told_ep_inside_a_node_with_the_exact_edit(tmp_path, capsys):
    """dp 32 x ep 32 on 4 nodes: rank 0's ep group is ranks 0-31, 32 / 8 = 4 nodes, 8 on each. The
    ep values below 32 whose group fits a node are the divisors of 8: 8, 4, 2; each divides the 64
    experts and the block dp 32, so efsdp = 32 / ep = 4, 8, 16. Each re-plan's step is `step` of the
    config with mesh.shape edited so, and each is more than 1% shorter."""
    job = _toml(tmp_path, [32, 32])
    p = build_plan(load_config(job))
    assert ep_span(p.mesh, p.placement) == (4, 8)
    line, = _lines(job)
    assert line.startswith("hint: ep 32 spans 4 nodes (8 of its ranks on each: its all-to-alls cross the NICs) and "
                           "costs the critical stage ")
    # sharding zero1: the experts' data axis is edp (Megatron's expert data-parallel group, as plan and
    # groups name it; the hint said efsdp before newcomer trial nc62 #3)
    for ep, efsdp in ((8, 4), (4, 8), (2, 16)):
        edited = _step_line(_toml(tmp_path, [32, ep], name=f"ep{ep}.toml"), capsys)
        assert f"ep {ep} (edp {efsdp}, etp 1; mesh.shape [32, {ep}]) (step {edited}, " in line
    assert _step_line(job, capsys) == step_seconds(step_time(p).step_s)


def test_ep_inside_a_node_gets_no_ep_line(tmp_path):
    """dp 32 x ep 8: every ep group is one node's 8 ranks (ranks 0-7 on node 0): nothing to move."""
    job = _toml(tmp_path, [32, 8])
    p = build_plan(load_config(job))
    assert ep_span(p.mesh, p.placement) == (1, 8)
    assert _lines(job) == []


def test_no_valid_smaller_ep_names_why_and_points_to_search(tmp_path):
    """27 routed experts at dp 27 x ep 27 (27 of 32 GPUs): the group spans 4 nodes (8, 8, 8, 3 ranks);
    ep 8, 4, 2 do not divide 27 experts, and ep 9 and 3, valid, do not divide a node's 8 GPUs."""
    cfg = json.loads(MINI.read_text()) | {"n_routed_experts": 27, "num_experts_per_tok": 3, "n_group": 1,
                                          "topk_group": 1}
    hf = tmp_path / "c27.json"
    hf.write_text(json.dumps(cfg))
    line, = _lines(_toml(tmp_path, [27, 27], hf=hf, world=27, global_batch=216))
    assert line.startswith("note: no ep hint: ep 27 spans 4 nodes (8 of its ranks on each")
    assert line.endswith("but no smaller ep keeps the group inside a node (experts 27 are not divisible by ep 8; "
                         "experts 27 are not divisible by ep 4; experts 27 are not divisible by ep 2; ep 9, 3 are "
                         "valid but ep x etp does not divide a node's 8 GPUs: some of their groups straddle two "
                         "nodes); `meshplan search` ranks every ep with the other axes re-factored")


def test_step_cli_prints_the_hint_and_the_link_note_points_to_it(tmp_path, capsys):
    out = _step_out(_toml(tmp_path, [32, 32]), capsys)
    hints = [ln for ln in out.splitlines() if ln.startswith(("hint: ep", "note: the step is bound"))]
    assert len(hints) == 2 and hints[0].startswith("hint: ep 32 spans 4 nodes")
    assert hints[1].endswith("ep inside a node cuts its ep traffic: the ep line above")


def test_plan_ep_line_says_why_and_what_the_all_to_all_crosses(tmp_path):
    """ep 32: 64 / 32 = 2 experts per rank; the valid ep divide 64 and the block 32: 1, 2, 4, 8,
    16, 32; its group's 32 - 8 = 24 of 31 peers are on other nodes. ep 8: one node, NVLink."""
    across = build_plan(load_config(_toml(tmp_path, [32, 32]))).constraints.axes["ep"]
    assert across == ("capacity: 64 experts split 32 ways (2 per rank); ep 32 as the config's mesh gives it (chosen "
                      "by the user, or a `meshplan search --export` row): valid ep 1, 2, 4, 8, 16, 32 (ep divides the "
                      "64 experts and ep x etp 1 the dense block dp_shard x cp x tp = 32); its all-to-alls cross the "
                      "NICs: the group spans 4 nodes, 8 ranks on each, so each rank sends to 24 of its 31 peers over "
                      "the network (ep <= 8 keeps the group inside one node)")
    inside = build_plan(load_config(_toml(tmp_path, [32, 8], name="ep8.toml"))).constraints.axes["ep"]
    assert inside.startswith("capacity: 64 experts split 8 ways (8 per rank); ep 8 as the config's mesh gives it")
    assert inside.endswith("its all-to-alls stay inside one node, over NVLink")


def test_search_rows_show_the_expert_mesh_after_the_dense_mesh(tmp_path, capsys):
    """The search's rows on the same workload (pp 1, tp 1-2, ep 8-32, zero1, no recompute, mb 1): the dense
    block dp x tp is 32 ranks, efsdp = 32 / (ep x etp). Every row with ep > 1 prints its expert mesh after
    the dense one, ``; experts efsdp F x ep E x etp T`` (efsdp and etp where > 1), so the label is not read
    as a product past the world (moved by nc22fix's with_experts: was ``dp 32 x ep 8 (efsdp 4, etp 1)``,
    ``dp 32 x ep 32``, ``dp 16 x tp 2 x ep 16 x etp 2``)."""
    job = _toml(tmp_path, [32, 32])
    job.write_text(job.read_text() + "\n[search]\npp = [1]\ncp = [1]\ndp_replicate = [1]\ntp = [1, 2]\nep = [8, 16, 32]\n"
                   'micro_batch = [1]\nrecompute = ["none"]\nsharding = ["zero1"]\ntp_comm_overlap = [false]\n')
    capsys.readouterr()
    assert run_main("search", job, "--json", tmp_path / "s.json") == 0
    text = capsys.readouterr().out
    rows = json.loads((tmp_path / "s.json").read_text())["top"]
    shown = {row_mesh(d): d["expert_mesh"] for d in rows}
    assert shown["dp 32; experts efsdp 4 x ep 8"] == {"efsdp": 4, "ep": 8, "etp": 1}
    assert shown["dp 16 x tp 2; experts efsdp 4 x ep 8"] == {"efsdp": 4, "ep": 8, "etp": 1}
    assert shown["dp 16 x tp 2; experts efsdp 2 x ep 8 x etp 2"] == {"efsdp": 2, "ep": 8, "etp": 2}
    assert shown["dp 32; experts ep 32"] == {"efsdp": 1, "ep": 32, "etp": 1}
    assert shown["dp 16 x tp 2; experts ep 16 x etp 2"] == {"efsdp": 1, "ep": 16, "etp": 2}
    assert "│ 1 │ dp 32; experts efsdp 4 x ep 8 " in text and "dp 16 x tp 2; experts efsdp 2 x ep 8 x etp 2" in text


def test_deepseek_v3_example_is_told_ep_8():
    """examples/deepseek-v3_2048xh100_pp16-ep64-dp128.toml (the newcomer's case, at 2048 GPUs): ep 64
    over dp_shard 128 is ranks 0-63, 8 nodes of 8. ep 8 keeps a group in a node: efsdp = 128 / 8 = 16,
    mesh.shape [16, 128, 8]; the hint's step is the step of the example edited so."""
    path = Path(__file__).parent.parent / "examples" / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"
    cfg = load_config(path)
    p = build_plan(cfg)
    assert ep_span(p.mesh, p.placement) == (8, 8)
    st = step_time(p)
    line, = ep_hint(p, st, rebuilt_step(p, step_time), bubble_wait(st))
    edited = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [16, 128, 8]})))
    assert line.startswith("hint: ep 64 spans 8 nodes (8 of its ranks on each: its all-to-alls cross the NICs)")
    # the example's sharding is zero1: edp, not efsdp (nc62 #3)
    assert (f"shorter with the group inside a node, ep 8 (edp 16, etp 1; mesh.shape [16, 128, 8]) (step "
            f"{step_seconds(step_time(edited).step_s)}, ") in line


def test_ep_inside_a_node_that_does_not_fit_gives_a_note_with_each_outcome(tmp_path):
    """The same dp 32 x ep 32 with memory_reserve 0.81: usable 79.11 GiB (the H100's runtime total) x 0.19
    = 15.0 GiB (it was reserve 0.8, 80e9 B x 0.2 = 14.9 GiB at the datasheet's HBM; at 0.8 now, 15.8 GiB,
    ep 8's 15.3 GiB would fit). Fewer ep
    ranks hold more experts each (64 / 8 = 8 .. 64 / 2 = 32 per rank), so every ep inside a node peaks
    above it while ep 32 fits: no hint, a note with each re-plan's outcome."""
    job = _toml(tmp_path, [32, 32])
    job.write_text(job.read_text().replace('framework = "megatron"\n', 'framework = "megatron"\nmemory_reserve = 0.81\n'))
    p = build_plan(load_config(job))
    assert p.feasible and f"{p.timeline.usable_bytes / 2**30:.1f}" == f"{79.11 * 0.19:.1f}" == "15.0"
    line, = _lines(job)
    assert line.startswith("note: no ep hint: ep 32 spans 4 nodes")
    outcomes = line.split("but no ep inside a node re-planned fits with a step more than 1% shorter (")[1]
    assert [o.split(":")[0] for o in outcomes.split("; ")[:3]] == ["ep 8", "ep 4", "ep 2"]
    assert outcomes.count("does not fit") == 3 and line.endswith("`meshplan search` ranks every ep with the other axes "
                                                                 "re-factored")
