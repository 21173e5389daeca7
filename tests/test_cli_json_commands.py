"""``--json`` of the commands that write files or run things (report, import, export, launch,
bench, testbed, validate, validate-slice): each document valid against its schema, with the
files written and their sizes, the values measured or read; ``--json -`` puts the one
document on stdout and the rest of the output on stderr; errors stay one line, exit 2.

The runs are the lightest real ones: world 2, a 2-layer miniature, small sizes (``slow``);
the testbed ones need root and skip with the reason otherwise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from meshplan.cli import main
from meshplan.compute.shapes import backward_gemms
from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from tests.testbed_gate import needs_testbed

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"
MINI = EX / "mini_2x4_tp2-dp4.toml"
DS = EX / "deepspeed_zero2_16xh100.json"
#: A small dense model (2 layers, hidden 64) on 8 GPUs: dp_shard 4 x tp 2.
TINY = ('[model]\nlayers = 2\nhidden = 64\nffn = 128\nq_heads = 4\nkv_heads = 2\nhead_dim = 16\nvocab = 256\n'
        '[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\nglobal_batch = 8\nseq_len = 64\nmicro_batch = 2\n'
        '[mesh]\nnames = ["dp_shard", "tp"]\nshape = [4, 2]\n')


def run(argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def errors(command: str, doc: dict) -> list[str]:
    v = jsonschema.Draft202012Validator(schema_of(command))
    return [f"{list(e.path)}: {e.message}" for e in v.iter_errors(doc)]


def sizes(doc: dict) -> dict[str, int]:
    return {Path(f["path"]).name: f["size_bytes"] for f in doc["files"]}


@pytest.mark.slow  # the report plans, predicts the step and draws the memory plot: about 10 s
def test_report_json_names_the_page_and_its_size(tmp_path, capsys):
    page, doc_path = tmp_path / "mini.html", tmp_path / "report.json"
    rc, _, err = run(["report", MINI, "--out", page, "--json", doc_path], capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("report", doc) == [], err
    assert doc["feasible"] is True and doc["reasons"] == [] and doc["config"] == str(MINI)
    assert doc["files"] == [{"path": str(page), "size_bytes": page.stat().st_size}]
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_import_json_lists_the_unused_fields_and_the_file(tmp_path, capsys):
    out, doc_path = tmp_path / "ds.toml", tmp_path / "import.json"
    rc, _, err = run(["import", "deepspeed", DS, "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b",
                      "--seq-len", "4096", "-o", out, "--json", doc_path], capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("import", doc) == [], err
    # the key of the example that meshplan does not model (tests/test_interop.py reads them by hand;
    # gradient_clipping is training.grad_clip, reduce_bucket_size ZeRO-2's memory.grad_bucket_elements,
    # overlap_comm training.overlap_comm)
    assert doc["unused"] == ["steps_per_print"]
    assert (doc["format"], doc["source"]) == ("deepspeed", str(DS)) and doc["toml"] == out.read_text()
    assert doc["files"] == [{"path": str(out), "size_bytes": len(out.read_bytes())}]
    assert load_config(out).training.global_batch == 256  # micro 1 x accumulation 16 x dp 16


def test_import_json_to_stdout_without_o_keeps_the_toml_in_the_document(tmp_path, capsys):
    rc, out, err = run(["import", "deepspeed", DS, "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b",
                        "--seq-len", "4096", "--json", "-"], capsys)
    doc = json.loads(out)  # stdout is the document alone; the TOML went to stderr
    assert rc == 0 and errors("import", doc) == [] and doc["files"] == []
    assert doc["toml"].startswith(f"# meshplan import deepspeed {DS}\n") and doc["toml"] in err


def test_export_json_lists_what_megatron_does_not_express(tmp_path, capsys):
    out, doc_path = tmp_path / "seed.args", tmp_path / "export.json"
    rc, printed, err = run(["export", EX / "seed-64gpu.toml", "--to", "megatron", "-o", out, "--json", doc_path],
                           capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("export", doc) == [], err
    # the seed keeps fp32 parameters; Megatron-LM keeps bf16 ones with fp32 main parameters
    assert "training.param_dtype: 'fp32' -> 'bf16'" in doc["not_expressed"]
    assert all(f"not expressed in megatron: {x}" in printed for x in doc["not_expressed"])
    assert doc["files"] == [{"path": str(out), "size_bytes": out.stat().st_size}]
    assert "--tensor-model-parallel-size 8" in out.read_text().splitlines()


def test_launch_json_to_stdout_lists_the_four_files(tmp_path, capsys):
    folder = tmp_path / "launch"
    rc, out, err = run(["launch", MINI, "--out", folder, "--json", "-", "--", "python", "train.py"], capsys)
    doc = json.loads(out)  # one document on stdout, the "wrote" and "run:" lines on stderr
    assert rc == 0 and errors("launch", doc) == [], err
    names = ["bind.sh", "torchrun.sh", "job.sbatch", "bindings.json"]
    assert [Path(f["path"]).name for f in doc["files"]] == names
    assert sizes(doc) == {n: (folder / n).stat().st_size for n in names}
    assert doc["nodes"] == 1 and doc["feasible"] is True  # dgx-h100 x 1: the 8 ranks on one node
    assert f"wrote {folder / 'bind.sh'}" in err and f"run: {doc['run']}" in err
    assert len(json.loads((folder / "bindings.json").read_text())) == 8  # one binding per rank
    assert "MESHPLAN_RDZV_ENDPOINT=<node 0 host:port>" in doc["run"]  # no endpoint given: the user sets it
    rc, out, err = run(["launch", MINI, "--out", tmp_path / "l2", "--rdzv-endpoint", "node0:29500", "--json", "-",
                        "--", "python", "train.py"], capsys)
    assert rc == 0 and "MESHPLAN_RDZV_ENDPOINT" not in json.loads(out)["run"]  # given: written into torchrun.sh


def test_errors_stay_one_line_on_stderr_with_json_to_stdout(tmp_path, capsys):
    # the error stays one line on stderr; stdout holds the meshplan.error/v1 document alone (nc55fixB, newcomer
    # trial 55 #8: before it stdout was empty), its line the stderr one
    rc, out, err = run(["export", MINI, "--to", "nope", "-o", tmp_path / "x", "--json", "-"], capsys)
    assert rc == 2 and err.startswith("error: --to: 'nope'") and err.count("\n") == 1
    doc = json.loads(out)
    assert errors("error", doc) == [] and (doc["command"], doc["error"]["line"]) == ("export", err.strip())
    rc, out, err = run(["report", tmp_path / "missing.toml", "--json", "-"], capsys)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1
    assert json.loads(out)["error"]["line"] == err.strip()


@pytest.mark.slow
def test_search_export_refusal_comes_before_the_json_document(tmp_path, capsys):
    rc, out, err = run(["search", MINI, "--top", 2, "--export", 5, "-o", tmp_path / "row.toml", "--json", "-"],
                       capsys)
    # refused before the search runs (--top is known): no search output either, and on stdout the
    # meshplan.error/v1 document alone (nc55fixB), naming --export
    assert rc == 2 and json.loads(out)["error"]["field"] == "--export" and not (tmp_path / "row.toml").exists()
    assert err.splitlines()[-1] == ("error: --export: 5 > --top 2: the search lists 2 row(s); pass --top 5 or export a "
                                    "lower rank")


def test_plan_json_to_stdout_is_the_plan_document(capsys):
    rc, out, err = run(["plan", MINI, "--json", "-"], capsys)
    doc = json.loads(out)
    assert rc == 0 and errors("plan", doc) == [] and doc["world"] == 8
    assert "feasible" in err and "wrote" not in err  # the human report moved to stderr


@pytest.mark.parametrize("argv", [
    ["report", "{cfg}", "--out", "{tmp}/r.html"], ["launch", "{cfg}", "--out", "{tmp}/l"],
    pytest.param(["bench", "gemm", "{cfg}", "--out", "{tmp}/g.csv", "--device", "cpu"], marks=pytest.mark.slow),
    pytest.param(["bench", "attention", "{cfg}", "--out", "{tmp}/a.json", "--device", "cpu"], marks=pytest.mark.slow),
], ids=["report", "launch", "bench-gemm", "bench-attention"])  # bench imports torch: > 10 s on a loaded machine
def test_json_of_a_mesh_that_does_not_resolve_carries_the_verdict(argv, tmp_path, capsys):
    # ep 3 does not divide the 8 ranks of dp_shard 4 x tp 2: the mesh does not resolve, a result
    # (degrees that do not make the world are input errors instead: tests/test_handed_cli.py)
    cfg = tmp_path / "ep3.toml"
    cfg.write_text(MINI.read_text().replace('names = ["dp_shard", "tp"]\nshape = [4, 2]',
                                            'names = ["dp_shard", "tp", "ep"]\nshape = [4, 2, 3]'))
    argv = [a.replace("{cfg}", str(cfg)).replace("{tmp}", str(tmp_path)) for a in argv]
    rc, out, err = run(argv + ["--json", "-"], capsys)
    doc = json.loads(out)
    assert rc == 1 and errors("-".join(argv[:2]) if argv[0] == "bench" else argv[0], doc) == []
    assert doc["feasible"] is False and f"infeasible: {doc['reasons'][0]}" in err
    assert doc["reasons"][0].startswith("ep(3) * etp(1) = 3 does not divide dp_shard(4) * tp(2) = 8")
    assert doc["files"] == ([{"path": argv[3], "size_bytes": Path(argv[3]).stat().st_size}] if argv[0] == "report"
                            else [])


@pytest.mark.parametrize("argv", [["groups", MINI, "--rank", 3], ["step", MINI], ["catalog", "gpu"],
                                  ["place", MINI]], ids=lambda a: a[0])
def test_json_to_stdout_is_the_document_written_to_a_file(argv, tmp_path, capsys):
    path = tmp_path / "doc.json"
    rc, printed, _ = run(argv + ["--json", path], capsys)
    rc_stdout, out, err = run(argv + ["--json", "-"], capsys)
    assert rc == rc_stdout == 0 and json.loads(out) == json.loads(path.read_text())
    assert printed.replace(f"wrote {path}\n", "") == err  # the human output, moved to stderr whole


@pytest.mark.slow
def test_bench_gemm_and_attention_json(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    table, doc_path = tmp_path / "gemm.csv", tmp_path / "gemm.json"
    rc, _, err = run(["bench", "gemm", cfg, "--out", table, "--device", "cpu", "--max-elements", 4096,
                      "--json", doc_path], capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("bench-gemm", doc) == [], err
    plan = build_plan(load_config(cfg))
    # each distinct shape of the plan's GEMMs and of their two backward GEMMs (dX, dW), once
    shapes = {(x.m, x.n, x.k): None for g in plan.gemms for x in [g] + backward_gemms(g)}
    assert [(r["m"], r["n"], r["k"]) for r in doc["rows"]] == list(shapes)
    for r in doc["rows"]:  # 2 M N K flops per call over the measured seconds; M scaled to 4096 // max(N, K)
        assert r["seconds"] > 0 and r["flops_per_s"] == pytest.approx(2 * r["m"] * r["n"] * r["k"] / r["seconds"])
        assert r["scaled_m"] == max(1, min(r["m"], 4096 // max(r["n"], r["k"])))
    assert (doc["device"], doc["dtype"]) == ("cpu", "fp32") and sizes(doc) == {"gemm.csv": table.stat().st_size}
    table, doc_path = tmp_path / "att.json", tmp_path / "attention.json"
    rc, _, err = run(["bench", "attention", cfg, "--out", table, "--device", "cpu", "--repeats", 2,
                      "--json", doc_path], capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("bench-attention", doc) == [], err
    a = doc["attention"]  # micro-batch 2; 4 query and 2 KV heads over tp 2; 64 tokens; head_dim 16
    assert (a["batch"], a["q_heads"], a["kv_heads"], a["seq_q"], a["seq_kv"], a["head_dim"]) == (2, 2, 1, 64, 64, 16)
    assert a["forward_s"] > 0 and a["backward_s"] > 0
    assert json.loads(table.read_text())["rows"][-1]["forward_s"] == a["forward_s"]


def test_bench_gemm_on_the_cpu_says_so_and_writes_under_out(tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    monkeypatch.chdir(tmp_path)
    rc, printed, err = run(["bench", "gemm", cfg, "--device", "cpu", "--max-elements", 256], capsys)
    assert rc == 0, err
    lines = printed.splitlines()
    assert lines[0].startswith("no GPU: timing on the CPU, cpu (") and ", fp32; the table describes this CPU" in lines[0]
    assert lines[-1] == "wrote out/bench/gemm.csv" and (tmp_path / "out" / "bench" / "gemm.csv").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.toml"]  # nothing else in the folder


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bench_comm_json_lists_the_fit_and_every_file(tmp_path, capsys):
    out, doc_path = tmp_path / "bc", tmp_path / "comm.json"
    # 64 KiB and 16 MiB: 256x apart, so the fit's "time grows with size" holds on a loaded
    # machine (64K and 1M, 16x apart, once measured the small size slower under load: no fit, exit 1)
    rc, _, err = run(["bench", "comm", "--nproc", 2, "--sizes", "64K,16M", "--out", out, "--iters", 2,
                      "--budget-s", 0.05, "--timeout-s", 90, "--json", doc_path], capsys)
    doc = json.loads(doc_path.read_text())
    assert rc == 0 and errors("bench-comm", doc) == [], err
    assert doc["sizes_bytes"] == [64 * 1024, 16 * 1024 * 1024] and doc["nproc"] == 2 and doc["testbed"] is None
    assert [(f["link"], f["op"], f["n_ranks"]) for f in doc["fits"]] == [("nvlink", "all-reduce", 2)]
    on_disk = {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert {str(Path(f["path"]).relative_to(out)): f["size_bytes"] for f in doc["files"]} == on_disk
    assert "calibration.toml" in on_disk and "all_reduce_perf.nvlink.txt" in on_disk


@needs_testbed
def test_testbed_up_and_down_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MESHPLAN_TESTBED_DIR", str(tmp_path / "state"))
    prefix = f"j{os.getpid() % 100000}"
    try:
        rc, out, err = run(["testbed", "up", "--nodes", 2, "--nics", 1, "--rate-mbit", 50, "--prefix", prefix,
                            "--json", "-"], capsys)
        up = json.loads(out)
        assert rc == 0 and errors("testbed-up", up) == [], err
        assert up["nodes"] == [{"namespace": f"mp-{prefix}-n{i}", "nics": [{"ifname": "nic0",
                                                                             "address": f"10.77.0.{i + 1}"}]}
                               for i in range(2)]
        assert up["rate_bits_per_s"] == 50e6 and up["fabric_namespace"] == f"mp-{prefix}-fabric"
    finally:
        rc, out, err = run(["testbed", "down", "--prefix", prefix, "--json", "-"], capsys)
    down = json.loads(out)
    assert rc == 0 and errors("testbed-down", down) == [], err
    assert sorted(down["removed"]) == sorted([f"mp-{prefix}-n0", f"mp-{prefix}-n1", f"mp-{prefix}-fabric"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_validate_json_on_stdout_carries_the_verdict_and_the_evidence(tmp_path):
    # world 2 of the mini mesh: tp 2 (+SP) with FSDP2 over 1, one timed step, no probe
    out = tmp_path / "ev"
    cmd = [sys.executable, "-m", "meshplan.cli", "validate", str(MINI), "--worlds", "2", "--steps", "1",
           "--seq-len", "32", "--no-probe", "--out", str(out), "--timeout-s", "120", "--json", "-"]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    doc = json.loads(cp.stdout)  # the one document, the torchrun children's output included elsewhere
    assert cp.returncode == 0 and errors("validate", doc) == [], cp.stderr[-2000:]
    assert (doc["ok"], doc["exit_code"], doc["evidence"], doc["summary"]) == (True, 0, str(out),
                                                                              str(out / "summary.md"))
    assert f"evidence: {out / 'summary.md'}" in cp.stderr and (out / "summary.md").exists()
    [w] = doc["worlds"]
    assert (w["world"], w["ok"], w["stage"], w["errors"]) == (2, True, "compare", [])
    # dp_shard 4 of the config runs at 2 / (tp 2) = 1: PASSED, and said (world 4 runs dp_shard 2)
    gap = "not exercised: dp_shard (FSDP) 4 -> 1; its collectives were not run; --worlds 4 runs dp_shard 2"
    assert doc["not_exercised"] == [gap] and w["not_exercised"] == [gap] and f"  {gap}\n" in cp.stdout + cp.stderr
    assert f"- {gap}" in (out / "summary.md").read_text()
    marker = json.loads((out / "validate.json").read_text())  # the evidence folder says the same
    rows = {r["quantity"]: r for r in marker["worlds"][0]["comparison"]["predicted_vs_measured"]}
    for key, quantity in (("step_s", "step time"), ("peak_memory_bytes", "peak memory")):
        assert w[key] == {k: rows[quantity][k] for k in ("predicted", "measured", "error")}
        assert w[key]["error"] == pytest.approx(w[key]["measured"] / w[key]["predicted"] - 1)


@pytest.mark.slow
@pytest.mark.timeout(400)
@needs_testbed
def test_validate_slice_json_orders_two_meshes(tmp_path, capsys, monkeypatch):
    # two meshes of the mini workload at world 2 on 2 testbed nodes: tp 2 across the nodes, dp 2
    monkeypatch.setenv("MESHPLAN_TESTBED_DIR", str(tmp_path / "state"))
    dp = tmp_path / "mini_dp8.toml"
    dp.write_text(MINI.read_text().replace('names = ["dp_shard", "tp"]\nshape = [4, 2]\nsequence_parallel = true',
                                           'names = ["dp_shard"]\nshape = [8]'))
    prefix = f"v{os.getpid() % 100000}"
    out, doc_path = tmp_path / "slice", tmp_path / "slice.json"
    run(["testbed", "up", "--nodes", 2, "--nics", 1, "--rate-mbit", 50, "--prefix", prefix], capsys)
    try:
        rc, _, err = run(["validate-slice", MINI, dp, "--testbed", prefix, "--world", 2, "--layers", 1,
                          "--seq-len", 64, "--steps", 1, "--timeout-s", 150, "--out", out, "--json", doc_path], capsys)
    finally:
        run(["testbed", "down", "--prefix", prefix], capsys)
    doc = json.loads(doc_path.read_text())
    assert errors("validate-slice", doc) == [] and rc == doc["exit_code"] == (0 if doc["order_matches"] else 1), err
    marker = json.loads((out / "slice.json").read_text())
    assert [m["name"] for m in doc["meshes"]] == [MINI.stem, "mini_dp8"] and doc["chosen"] == marker["chosen"]
    assert all(m["ran"] and m["collectives_match"] for m in doc["meshes"]), doc["meshes"]
    fastest = min(doc["meshes"], key=lambda m: m["measured_s"])
    assert doc["chosen"] == fastest["name"] and fastest["measured_rank"] == 1
    for m in doc["meshes"]:
        assert m["error"] == pytest.approx(m["measured_s"] / m["predicted_s"] - 1)
    assert doc["summary"] == str(out / "summary.md") and (out / "summary.md").exists()
