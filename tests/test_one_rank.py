"""One rank of a planned mesh on the local device (meshplan.runtime.validation.one_rank, `bench rank`):
the reduced config derived by hand, the prediction's wiring, a CPU run's shape, and the H200 evidence
(benchmarks/gpu_h200/run2, measured 2026-12-04) against today's prediction."""

from __future__ import annotations

import json
import math
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("torch")

from meshplan.compute.layer import layer_cost  # noqa: E402
from meshplan.compute.measured import kernel_data  # noqa: E402
from meshplan.config import config_from_dict  # noqa: E402
from meshplan.runtime.validation.one_rank_plan import RUN_MEMORY, predict, reduced_data  # noqa: E402
from meshplan.schedule.workload import workload_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "benchmarks" / "gpu_h200" / "run2" / "one_rank.json"


def _example(name: str) -> dict:
    return tomllib.loads((ROOT / "examples" / name).read_text())


def test_405b_reduces_to_one_stage_of_the_same_local_shapes():
    data = _example("llama3-405b_16384xh100_tp8-pp16-dp128.toml")
    r = reduced_data(data, 2, "dgx-h200")
    # pp 16 dropped: dp_shard 128 x tp 8 = 1,024 ranks on 128 eight-GPU nodes; one micro-batch of 1 per dp rank
    assert r["mesh"]["names"] == ["dp_shard", "tp"] and r["mesh"]["shape"] == [128, 8]
    assert "pp_layer_split" not in r["mesh"] and r["model"]["layers"] == 2
    assert r["training"]["global_batch"] == 128 and r["cluster"] == {"system": "dgx-h200", "nodes": 128}
    assert {k: r["memory"][k] for k in RUN_MEMORY} == RUN_MEMORY
    assert data["mesh"]["shape"] == [16, 128, 8]  # the caller's mapping is left as it was


def test_a_mesh_smaller_than_a_node_uses_part_of_it():
    data = _example("mini_2x4_tp2-dp4.toml")
    data["mesh"] = {"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 2]}
    r = reduced_data(data, 1)
    assert r["mesh"]["world"] == 4 and r["cluster"]["nodes"] == 1  # 4 of dgx-h100's 8 GPUs


def test_prediction_is_the_layer_cost_and_the_tracked_peak():
    cfg = config_from_dict(reduced_data(_example("seed-64gpu.toml"), 4, "dgx-h200"))
    plan, p = predict(cfg)
    w = workload_of(plan)
    cost = layer_cost(cfg.model, cfg.cluster.gpu, w)
    # eager DTensor TP at tp 8: the forward's 3.12 ms of kernels wait for the host's 4.65 ms a block
    # (kernels.toml [host]); the backward's kernels (6.53 ms) take longer than its 5.37 ms
    assert w.dtensor_host_s == (4.65e-3, 5.37e-3) and cost.seconds("forward") < 4.65e-3
    assert p.forward_s == 4.65e-3
    assert p.backward_s == cost.seconds("backward_input") + cost.seconds("backward_weight") > 5.37e-3
    assert p.kernels_s == (cost.seconds("forward"), p.backward_s)  # the kernels alone: the evidence's rows' "kernels"
    peak = plan.timelines[0].peak
    # the fake process group has no NCCL buffers and max_memory_allocated no fragmentation
    assert p.peak_allocated_bytes == peak.total_bytes - peak.by_kind.get("comm_buffers", 0) \
        - peak.by_kind.get("fragmentation", 0)
    assert p.gpu == "h200-sxm-141gb"


def test_bench_rank_refuses_a_rank_outside_the_reduced_mesh(tmp_path, capsys):
    from tests.cli_run import run_main

    code = run_main("bench", "rank", ROOT / "examples" / "mini_2x4_tp2-dp4.toml", "--rank", "8",
                    "--out", tmp_path / "r.json")
    assert code == 2 and capsys.readouterr().err.strip().splitlines()[-1] == "error: --rank: 8 is outside 0..7"
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_cpu_run_times_every_block(tmp_path):
    from meshplan.runtime.validation.one_rank import run

    data = _example("mini_2x4_tp2-dp4.toml")
    data["model"] = {"name": "tiny", "layers": 4, "hidden": 128, "ffn": 256, "q_heads": 4, "kv_heads": 2, "vocab": 512}
    data["training"]["seq_len"] = 128
    ev = run(data, layers=3, device="cpu", system=None, warmup=1, steps=2)
    assert len(ev["per_step"]) == 2
    for step in ev["per_step"]:
        assert len(step["forward"]) == 3 and len(step["backward"]) == 3  # one span per block
        assert step["step_s"] > sum(step["forward"]) + sum(step["backward"])
    assert ev["rows"]["peak_allocated_bytes"]["measured"] is None  # not measured on the CPU


def test_h200_evidence_against_todays_prediction():
    """The H200 run's FSDP-only Llama 3 8B (dp_shard 8, 4 layers, seq 8192): the device's
    per-layer forward and backward (host-issue time well under the device's, so the kernels'
    own) within 5% of today's prediction from the catalog's H200 tables (M1)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_measure import RUNS, merge

    runs = {name: (path, over, layers) for name, path, over, layers in RUNS}
    ev = next(e for e in json.loads(EVIDENCE.read_text()) if e["name"] == "llama3-8b dp_shard8, no recompute")
    path, over, layers = runs[ev["name"]]
    assert ev["host"]["forward_issue_s"] < 0.5 * ev["host"]["blocks_forward_s"]
    cfg = config_from_dict(reduced_data(merge(tomllib.loads((ROOT / path).read_text()), over), layers, "dgx-h200"))
    _, p = predict(cfg)
    f, b = ev["rows"]["forward_s"]["measured"], ev["rows"]["backward_s"]["measured"]
    assert math.isclose(f, p.forward_s, rel_tol=0.05) and math.isclose(b, p.backward_s, rel_tol=0.05)


#: The H200 runs where the host's issue of eager DTensor TP set the pace (their device time per block
#: well above the kernels'): both passes of the 8B tp 4 run, the forward of the 70B tp 8 run at
#: micro-batch 1 (its backward ran at its kernels' time).
HOST_BOUND = {"llama3-70b tp8 x dp_shard8 (seed), no recompute": ("forward",),
              "llama3-8b tp4 x dp_shard2 (SP), no recompute": ("forward", "backward")}


def _evidence_runs():
    for run in ("run2", "run3"):
        yield from json.loads((ROOT / "benchmarks" / "gpu_h200" / run / "one_rank.json").read_text())


def test_dtensor_host_pace_is_the_h200_measurement():
    """kernels.toml [host] dtensor_tp_block_{forward,backward}_s are the mean per-block device
    time of the host-bound passes of runs 2 and 3 (:data:`HOST_BOUND`; 48 forward, 24 backward
    blocks), to the catalog's three figures."""
    blocks: dict = {"forward": [], "backward": []}
    for ev in _evidence_runs():
        for phase in HOST_BOUND.get(ev["name"], ()):
            blocks[phase] += [t for step in ev["per_step"] for t in step[phase]]
    assert (len(blocks["forward"]), len(blocks["backward"])) == (48, 24)  # 2 runs x 3 steps x 4 blocks a mesh
    data = kernel_data("h200-sxm-141gb")
    for phase, got in zip(("forward", "backward"), data.dtensor_tp_block_s):
        assert got == pytest.approx(sum(blocks[phase]) / len(blocks[phase]), rel=5e-3)


def test_host_pace_derivation_gives_the_catalogs_values_from_runs_2_and_3():
    """meshplan.runtime.validation.host_pace over the shipped evidence: the host-bound passes it
    finds are :data:`HOST_BOUND` (picked by hand when the catalog's values were derived), and
    their blocks' means are kernels.toml's 4.65e-3 and 5.37e-3 s (to its three figures)."""
    from meshplan.runtime.validation.host_pace import host_bound_passes, host_table

    evidence = list(_evidence_runs())
    for ev in evidence:
        assert host_bound_passes(ev) == HOST_BOUND.get(ev["name"], ()), ev["name"]
    table, line = host_table(evidence)
    assert table == {"dtensor_tp_block_forward_s": pytest.approx(4.65e-3, rel=5e-3),
                     "dtensor_tp_block_backward_s": pytest.approx(5.37e-3, rel=5e-3)}
    assert line == "host pace: forward 4.65 ms (48 blocks), backward 5.37 ms (24 blocks)"
    seed = [ev for ev in evidence if ev["name"] == "llama3-70b tp8 x dp_shard8 (seed), no recompute"]
    assert host_table(seed)[0] is None  # its backward ran at its kernels' time: no [host] table from it alone


def test_host_bound_reads_the_kernels_alone_when_the_prediction_holds_the_pace():
    """Evidence written since the host pace predicts max(kernels, pace): run 3's 8B tp 4 passes,
    predicted at the pace (4.65 and 5.37 ms), are within 10% of their measurements (4.59, 4.76 ms),
    so only the rows' ``kernels`` (1.74 and 3.55 ms) show that the device ran slower than its kernels."""
    from meshplan.runtime.validation.host_pace import host_bound_passes

    run3 = json.loads((ROOT / "benchmarks" / "gpu_h200" / "run3" / "one_rank.json").read_text())
    ev = next(ev for ev in run3 if ev["name"] == "llama3-8b tp4 x dp_shard2 (SP), no recompute")
    for key, pace in (("forward_s", 4.65e-3), ("backward_s", 5.37e-3)):
        ev["rows"][key]["predicted"] = max(ev["rows"][key]["predicted"], pace)
    assert host_bound_passes(ev) == ()
    ev["rows"]["forward_s"]["kernels"], ev["rows"]["backward_s"]["kernels"] = 1.7358649171308285e-3, 3.549472428378356e-3
    assert host_bound_passes(ev) == ("forward", "backward")


def test_a_kernels_files_host_pace_reaches_the_prediction(tmp_path):
    """bench rank --kernels: the seed's 70B tp 8 forward (3.12 ms of kernels) is predicted at the
    file's 9 ms a block instead of the catalog's 4.65 ms; the backward at the file's 10 ms (its
    6.53 ms of kernels below it); the kernels' own times unchanged."""
    from meshplan.compute.kernel_fragment import with_kernel_files

    path = tmp_path / "host.toml"
    path.write_text('[gpu.h200-sxm-141gb]\nsource = "test host"\n\n[host]\n'
                    "dtensor_tp_block_forward_s = 9e-3\ndtensor_tp_block_backward_s = 10e-3\n")
    cfg = config_from_dict(reduced_data(_example("seed-64gpu.toml"), 4, "dgx-h200"))
    _, catalog = predict(cfg)
    gpu, _ = with_kernel_files(cfg.cluster.gpu, [path])
    _, p = predict(replace(cfg, cluster=cfg.cluster.model_copy(update={"gpu": gpu})))
    assert catalog.forward_s == 4.65e-3 and (p.forward_s, p.backward_s) == (9e-3, 10e-3)
    assert p.kernels_s == catalog.kernels_s and p.kernels_s[1] < 10e-3


def test_bench_rank_refuses_a_kernels_file_of_another_gpu_before_the_run(tmp_path, capsys):
    from tests.cli_run import run_main

    path = tmp_path / "host.toml"
    path.write_text('[gpu.h200-sxm-141gb]\nsource = "s"\n\n[host]\n'
                    "dtensor_tp_block_forward_s = 9e-3\ndtensor_tp_block_backward_s = 10e-3\n")
    code = run_main("bench", "rank", ROOT / "examples" / "mini_2x4_tp4-dp2.toml", "--device", "cpu",
                    "--kernels", path, "--out", tmp_path / "r.json")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: --kernels:") and "describes GPU h200-sxm-141gb" in err
    assert "the config uses h100-sxm5-80gb" in err and not (tmp_path / "r.json").exists()


def test_bench_rank_kernels_out_refuses_the_cpu(tmp_path, capsys):
    from tests.cli_run import run_main

    code = run_main("bench", "rank", ROOT / "examples" / "mini_2x4_tp4-dp2.toml", "--device", "cpu",
                    "--kernels-out", tmp_path / "host.toml", "--out", tmp_path / "r.json")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith("error: --kernels-out: the device is the CPU")
    assert not (tmp_path / "host.toml").exists() and not (tmp_path / "r.json").exists()


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU (CI has none)")
def test_gpu_bench_rank_writes_the_host_pace_it_measured(tmp_path, capsys):
    """On a GPU, Llama-3-8B at dp_shard 2 x tp 4, eager (host-bound in both passes on the H200):
    --kernels-out holds host_pace.host_table of the evidence the run wrote, and reads back as
    --kernels does; where a pass was not host-bound, no file and a line saying why."""
    from meshplan.compute.kernel_fragment import load_fragment
    from meshplan.runtime.validation.host_pace import host_table
    from tests.cli_run import run_main

    out, kernels = tmp_path / "r.json", tmp_path / "host.toml"
    assert run_main("bench", "rank", ROOT / "examples" / "mini_2x4_tp4-dp2.toml", "--layers", "4",
                    "--out", out, "--kernels-out", kernels) == 0
    table, line = host_table([json.loads(out.read_text())])
    if table is None:
        assert f"--kernels-out: not written: {line}" in capsys.readouterr().out and not kernels.exists()
        return
    assert load_fragment(kernels).host_pace_s == tuple(table.values()) and line in capsys.readouterr().out


def test_h200_runs_against_prediction_with_host_pace():
    """Each H200 run's per-layer forward and backward against today's prediction (kernels, or
    the eager DTensor TP host's pace where longer): the FSDP-only 8B and the 70B at micro-batch 2
    (device-bound) within 6%; the host-bound forwards within 10% (the pace is their mean); the
    70B tp 8 backward, which the device set (6.0 ms of kernels against the host's 5.37 ms),
    within 6%. Not the 405B (its large GEMMs ran 6-21% faster than the catalog's sustained rates)
    nor the 8B tp 4 backward (runs 2 and 3: 6.70 and 4.76 ms, the pace between them)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_measure import RUNS, merge

    runs = {name: (path, over, layers) for name, path, over, layers in RUNS}
    checked = 0
    for ev in _evidence_runs():
        if ev["name"].startswith("llama3-405b"):
            continue
        path, over, layers = runs[ev["name"]]
        _, p = predict(config_from_dict(reduced_data(merge(tomllib.loads((ROOT / path).read_text()), over), layers,
                                                    "dgx-h200")))
        f, b = ev["rows"]["forward_s"]["measured"], ev["rows"]["backward_s"]["measured"]
        assert f == pytest.approx(p.forward_s, rel=0.10 if "forward" in HOST_BOUND.get(ev["name"], ()) else 0.06)
        if "backward" not in HOST_BOUND.get(ev["name"], ()):
            assert b == pytest.approx(p.backward_s, rel=0.06)
        checked += 1
    assert checked == 8


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA GPU (CI has none)")
def test_gpu_rank_runs_and_measures_memory():
    from meshplan.runtime.validation.one_rank import run

    data = _example("seed-64gpu.toml")
    data["model"] = {"catalog": "llama3-8b"}
    data["mesh"] = {"names": ["dp_shard"], "shape": [8]}
    data["training"]["recompute"] = "none"
    ev = run(data, layers=2, device="cuda", system="auto", warmup=1, steps=2)
    assert ev["rows"]["peak_allocated_bytes"]["measured"] > 0
    assert abs(ev["rows"]["forward_s"]["error"]) < 0.25


def test_peak_without_what_the_harness_holds():
    """Run 3's 8B tp 4 x dp_shard 2 row (benchmarks/gpu_h200/run3/one_rank.json): the rank held
    1,034,438,500 B besides its parameters and optimizer state between steps, of which the plan
    counts its one 32 MiB cuBLAS workspace: 1,000,884,068 B are the harness's, taken off the
    measured 10,351,091,200 B. Not measured (CPU): nothing."""
    from meshplan.runtime.validation.one_rank import _without_harness

    row = dict(predicted=10_000_000_000, measured=10_351_091_200)
    out = _without_harness(row, dict(other_bytes=1_034_438_500), dict(workspace=33_554_432))
    assert out["harness_held_bytes"] == 1_000_884_068
    assert out["measured_without_harness"] == 9_350_207_132
    assert out["error_without_harness"] == pytest.approx(-0.0649792868)
    assert _without_harness(dict(predicted=1, measured=None), {}, {}) == {}
