"""Findings of newcomer trial 16: each test failed on main before its fix."""

from __future__ import annotations

import json
from pathlib import Path

from cli_run import run_main as _main

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "examples" / "mini_2x4_tp2-dp4.toml"  # one dgx-h100 node, 8 ranks
#: dgx-h100's compute HCAs in catalog order (meshplan/catalog: mlx5_0, 3, 4, 5, 6, 9, 10, 11)
HCAS = "=mlx5_0:1,mlx5_3:1,mlx5_4:1,mlx5_5:1,mlx5_6:1,mlx5_9:1,mlx5_10:1,mlx5_11:1"


# 1 ------------------------------------------------------------------ NIC scope and the binding line

def test_place_and_launch_give_every_rank_the_node_nics_by_default(tmp_path, capsys):
    """NCCL wants the same NCCL_IB_HCA on every rank of a node (NVIDIA/nccl#1478) and every NIC to
    use PXN: by default ranks 0 and 5 both get the 8 HCAs; rank 5 still names its nearest NIC, mlx5_9
    (GPU 5's PCIe switch). ``--nic-scope rank`` gives rank 5 mlx5_9 alone, with a note saying what it
    trades. The cores print as the command the rank runs, not as ``numactl ... | taskset ...``."""
    assert _main("place", MINI, "--rank", 5) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("rank 5:"))
    assert line.strip() == (f'rank 5: node 0 LOCAL_RANK 5 RANK 5 GPU 5 (cuda:5) socket 1 NIC mlx5_9; run as: '
                            f'CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7" CUDA_DEVICE_ORDER="PCI_BUS_ID" '
                            f'NCCL_IB_HCA="{HCAS}" numactl '
                            f'--physcpubind=70-83 --membind=1 PROGRAM (or, cores only: taskset -c 70-83 PROGRAM)')
    assert "|" not in line and "note: --nic-scope rank" not in out
    assert _main("place", MINI, "--rank", 5, "--nic-scope", "rank") == 0
    out = capsys.readouterr().out
    assert 'NCCL_IB_HCA="=mlx5_9:1" numactl' in out
    assert "note: --nic-scope rank gives each rank only the HCA under its PCIe switch" in out and "PXN" in out
    assert _main("launch", MINI, "--out", tmp_path / "run", "--", "python", "train.py") == 0
    rows = json.loads((tmp_path / "run" / "bindings.json").read_text())
    assert {r["env"]["NCCL_IB_HCA"] for r in rows} == {HCAS} and rows[5]["nic"] == "mlx5_9"
    assert all("NCCL_CROSS_NIC" not in r["env"] for r in rows)  # non-blocking spine: NCCL's default 2 (test_launch)
    assert "note: --nic-scope" not in capsys.readouterr().out
    for cmd in ("place", "launch"):  # refused before planning or writing
        argv = (MINI, "--nic-scope", "gpu") + (("--out", tmp_path / "bad", "--", "python", "t.py") if cmd == "launch" else ())
        assert _main(cmd, *argv) == 2
        assert capsys.readouterr().err.strip() == "error: --nic-scope: 'gpu' is not one of node, rank"
    assert not (tmp_path / "bad").exists()


def test_help_says_why_node_scope_is_the_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    for cmd in ("place", "launch"):
        assert _main(cmd, "--help") == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "node (default: every compute NIC of the node, the same list for all its ranks, as NCCL expects" in \
            text.replace("│ ", "").replace(" │", ""), cmd


# 2 ------------------------------------------------------------------ calibrate says which busbw column it keeps

def _slower_in_place(tmp_path: Path) -> Path:
    """The 8 x H200 log with its 8 GiB row set to the trial's numbers: out-of-place busbw 369.66 GB/s,
    in-place 366.00 (algbw = busbw / 1.75, nccl-tests' all-reduce factor 2 (8 - 1) / 8; time = size / algbw)."""
    src = (ROOT / "tests" / "data" / "nccl" / "all_reduce_perf_8xh200_s3.txt").read_text()
    old = next(x for x in src.splitlines() if x.split()[:1] == ["8589934592"])
    size = 8589934592
    cols = [f"{size / (b / 1.75) / 1e3:.1f}  {b / 1.75:.2f}  {b:.2f}       0" for b in (369.66, 366.00)]
    new = f"  {size}    2147483648     float     sum      -1  {cols[0]}  {cols[1]}"
    path = tmp_path / "ar.txt"
    path.write_text(src.replace(old, new))
    return path


def test_calibrate_names_the_busbw_column_it_keeps(tmp_path, capsys):
    """The curve keeps the slower column per size: in-place here (366.00 < 369.66 GB/s at 8 GiB), written
    to the file and said in one line with the reason (torch issues both kinds of collective)."""
    import tomllib
    out = tmp_path / "cal.toml"
    assert _main("calibrate", _slower_in_place(tmp_path), "--out", out) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("busbw columns:"))
    assert line.endswith("here ar.txt at 8.00 GiB: in-place 366.00 GB/s kept (out-of-place 369.66)")
    assert "FSDP2's all-gather; out of place: FSDP2's reduce-scatter" in line
    curve = tomllib.loads(out.read_text())["link"]["nvlink"]["curve"][0]
    assert curve["sizes_bytes"][-1] == 8589934592 and curve["busbw_gb_per_s"][-1] == 366.0


def test_calibrate_help_says_which_column(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    assert _main("calibrate", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "keeps, per size, the slower busbw of the two, since torch issues both" in text


# 3 ------------------------------------------------------------------ compare: knobs that do nothing at the mesh

def _cfg(mesh: dict, **training):
    from meshplan.config import config_from_dict
    return config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 16, "seq_len": 1024, **training}, "mesh": mesh})


def test_compare_skips_knobs_that_do_nothing_at_the_mesh():
    """pp_schedule, virtual stages and schedule runs act only at pp > 1, sequence and loss parallelism
    and tp overlap only at tp > 1: a pp 1 side's 1F1B against a pp 2 side's GPipe is no difference,
    two pp 2 sides' schedules are."""
    from meshplan.compare.differences import config_differences
    dp8 = {"names": ["dp_shard"], "shape": [8]}
    pp2 = {"names": ["pp", "dp_shard"], "shape": [2, 4]}
    tp2 = {"names": ["dp_shard", "tp"], "shape": [4, 2]}
    assert config_differences(_cfg(dp8), _cfg({**pp2, "pp_schedule": "gpipe"})).knobs == ()
    assert config_differences(_cfg(dp8), _cfg({**dp8, "pp_schedule": "gpipe", "virtual_stages": 2,
                                               "sequence_parallel": True, "loss_parallel": False}),
                              ).knobs == ()
    compiled = {"torch_compile": True}  # torchtitan's async TP needs torch.compile
    assert config_differences(_cfg(dp8, **compiled), _cfg(dp8, pp_schedule_runs=2, tp_comm_overlap=True,
                                                          **compiled)).knobs == ()
    assert config_differences(_cfg(pp2), _cfg({**pp2, "pp_schedule": "gpipe"})).knobs == (
        ("mesh.pp_schedule", "1f1b", "gpipe"),)
    assert config_differences(_cfg(pp2), _cfg(pp2, pp_schedule_runs=2)).knobs == (
        ("training.pp_schedule_runs", 1, 2),)
    assert config_differences(_cfg(tp2, **compiled), _cfg({**tp2, "sequence_parallel": True}, tp_comm_overlap=True,
                                                          **compiled)).knobs == (
        ("training.tp_comm_overlap", False, True), ("mesh.sequence_parallel", False, True))


def test_compare_cli_does_not_list_pp_schedule_of_a_mesh_without_pp(tmp_path, capsys):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    text = MINI.read_text()
    a.write_text(text)
    b.write_text(text.replace("[mesh]", '[mesh]\npp_schedule = "gpipe"'))
    _main("compare", a, b)
    out = capsys.readouterr().out
    assert "pp_schedule" not in out


def test_gpipe_at_pp_1_is_planned_as_gradient_accumulation(capsys):
    """Before, mesh.pp_schedule = "gpipe" at pp 1 ran every micro-batch's forward first in the memory
    timeline (the mini example: 373.5 GiB at micro-batch 15 instead of 39.24 GiB); pp 1 has no
    pipeline, so it is planned as 1F1B's order (forward and backward per micro-batch), with a note."""
    from meshplan.plan import build_plan
    a = build_plan(_cfg({"names": ["dp_shard"], "shape": [8]}))
    b = build_plan(_cfg({"names": ["dp_shard"], "shape": [8], "pp_schedule": "gpipe"}))
    assert a.feasible and b.feasible and b.timelines[0].peak.total_bytes == a.timelines[0].peak.total_bytes
    assert b.notes[0] == ("mesh.pp_schedule gpipe applies with pp > 1; with pp 1 each micro-batch is its own forward "
                          "and backward (gradient accumulation), planned so")
    assert not any("pp_schedule" in n for n in a.notes)


# 4 ------------------------------------------------------------------ selective under torch; your mesh as given

def test_plan_and_step_say_once_what_selective_is_under_torch(capsys):
    """Under framework torch, recompute "selective" is Megatron-LM's attention-core recompute, which
    torchtitan cannot run: plan says it once in full (the activations line; the train line names it
    briefly), step once (its recompute line), each with the nearest torchtitan setting, mode = "none" with
    flash attention (what export --to torchtitan writes)."""
    from meshplan.spec.recompute_words import recompute_words
    from meshplan.spec.training import TrainingSpec
    full = recompute_words(TrainingSpec(global_batch=8, seq_len=16, recompute="selective"), "torch")
    assert full.endswith('; the nearest torchtitan setting is mode = "none" (the same activations kept, and the flash '
                         'softmax statistics too; the attention not replayed: what export --to torchtitan writes)')
    assert recompute_words(TrainingSpec(global_batch=8, seq_len=16, recompute="selective", flash_attention=False),
                           "torch").endswith('is mode = "full" (without flash attention the nearest that keeps no '
                                             'more than this plan: what export --to torchtitan writes)')
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "sel.toml"
        cfg.write_text(MINI.read_text().replace('recompute = "none"', 'recompute = "selective"'))
        for cmd in ("plan", "step"):
            assert _main(cmd, cfg) in (0, 1)
            text = " ".join(capsys.readouterr().out.split())
            assert text.count("the nearest torchtitan setting is") == 1, cmd
            assert text.count("which torchtitan has no option for") <= 1 and text.count("has no such option") == 1


def test_search_plans_your_mesh_as_given_when_no_candidate_runs_it():
    """The trial's MoE job read only "recompute selective is not searched": the line now also gives the mesh's
    own step, planned as given with the search's model (build_plan + step_time(plan, Overlap())), and where
    that step would rank: 1 + the feasible candidates with a shorter exact step (this space is small enough
    that the search planned each of them, so the rank is one number), without adding it to the candidates."""
    from dataclasses import replace
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.search.driver import search
    from meshplan.search.reasons import OK
    cfg = load_config(MINI)
    cfg = replace(cfg, training=cfg.training.model_copy(update={"recompute": "selective"}),
                  search=cfg.search.model_copy(update={"tp": [2], "pp": [1], "cp": [1], "micro_batch": [1]}))
    r = search(cfg, workers=1)
    st = step_time(build_plan(cfg), Overlap())
    feasible = [i for i in range(len(r.candidates)) if r.code[i] == OK]
    assert all(i in r.exact and r.exact[i].step_s is not None for i in feasible)  # every one planned
    rank = 1 + sum(r.exact[i].step_s < st.step_s for i in feasible)
    assert r.configured.status == "absent" and r.configured.index is None
    assert r.configured.line() == (
        "your mesh (dp_shard 4 x tp 2) is not among the candidates: recompute selective is not searched (searched "
        f"with the rest of the mesh: {r.configured.reason.split('mesh: ')[1].split(';')[0]}; widen [search] "
        f"recompute); planned as given (not searched): {st.step_s:.3f} s, {st.tokens_per_s:,.0f} tokens/s, would "
        f"rank #{rank} of {len(feasible)} feasible by step time")
    assert len(r.candidates) == len(search(replace(cfg, mesh=None), workers=1).candidates)  # not added
