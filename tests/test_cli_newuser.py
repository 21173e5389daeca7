"""What a new user's first trial found (helper trial of the README on a fresh clone): each is
one line and the exit code the README documents."""

import re
from pathlib import Path

import pytest

from meshplan import cli
from meshplan.errors import ConfigError
from tests.cli_run import run_captured
from tests.configs import TP4_MB2

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*args):
    return run_captured(*args)  # in-process: the exit status and output the console script gives


def test_unknown_schedule_is_one_line_exit_2():
    r = _run("step", EXAMPLES / "seed-64gpu.toml", "--schedule", "foo")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --schedule: unknown schedule 'foo'; use gpipe, 1f1b, interleaved_1f1b, zb_h1, "
                                "zbv, dualpipev, or torch.distributed.pipelining's GPipe, 1F1B, Interleaved1F1B, "
                                "InterleavedZeroBubble (= zb_h1, one stage per rank), ZBVZeroBubble, DualPipeV "
                                "(any case)")


def test_plan_of_a_mesh_that_does_not_fit_says_why_on_stderr():
    # tests/configs.py TP4_MB2: peak 121.5 GiB at the head's forward > 79.11 GiB x 0.9 = 71.2 GiB usable
    r = _run("plan", TP4_MB2)
    assert r.returncode == 1
    assert r.stderr.startswith("infeasible: peak 121.5 GiB at forward of the head (micro-batch 1) on stage 0")
    assert "> 71.2 GiB usable (79.1 GiB - 10% reserve)" in r.stderr


def test_plan_json_refused_before_the_report(tmp_path):
    out = tmp_path / "p.json"
    out.write_text("keep me")
    r = _run("plan", EXAMPLES / "seed-64gpu.toml", "--json", out)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"error: --json: {out} exists; choose another path or pass --force to replace it"
    assert out.read_text() == "keep me"


def test_torch_commands_without_torch_name_the_install(monkeypatch):
    from meshplan.cli import common
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as e:
        common._require_torch("validate")
    assert e.value.field == "torch" and "pip install torch==2.13.0" in str(e.value)


def test_search_with_no_feasible_mesh_says_so_in_one_line(tmp_path):
    """zero1 only under framework torch on 8 GPUs, pp 1, tp 1 or 2, micro_batch 1 or 2, global
    batch 12: 4 candidates (dp 8 or 4 x mb 1 or 2). 12 / (mb x dp) is whole only for dp 4, mb 1
    (3 micro-batches): rule 'batch' rejects the other 3, rule 'framework' (zero1 under torch) that
    one. No table, order rule or exactness line, no GEMM capacity note (GEMM width is not why);
    one line with the rules, their counts and the fix of the first; exit 1 (README: search exits 1
    when no candidate fits, as plan does for an infeasible mesh)."""
    from typer.testing import CliRunner

    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                    '[training]\nglobal_batch = 12\nseq_len = 4096\nframework = "torch"\n'
                    '[search]\nsharding = ["zero1"]\npp = [1]\ncp = [1]\ndp_replicate = [1]\ntp = [1, 2]\n'
                    'micro_batch = [1, 2]\nrecompute = ["full"]\n')
    r = CliRunner().invoke(cli.app, ["search", str(path)], env={"COLUMNS": "1000"})
    assert r.exit_code == 1, r.output
    lines = r.output.splitlines()
    assert ("no feasible mesh: of 4 candidates rule 'batch' rejected 3 (global_batch not divisible by micro_batch "
            "* dp), 'framework' 1; fix: set training.global_batch to a multiple of micro_batch x dp for some [search] "
            "micro_batch and dp") in lines, r.output
    for gone in ("top 0", "the top is exact", "narrower GEMMs", "order: by predicted step time", "best rejected"):
        assert gone not in r.output, gone
    assert "  feasible: 0" in lines
    # --json holds the same verdict as data, --html shows it instead of an empty table; exit 1 too
    import html
    import json

    from tests.test_cli_json import validate
    r = CliRunner().invoke(cli.app, ["search", str(path), "--json", str(tmp_path / "s.json"), "--html",
                                     str(tmp_path / "s.html")], env={"COLUMNS": "1000"})
    assert r.exit_code == 1, r.output
    doc = json.loads((tmp_path / "s.json").read_text())
    text_line = next(x for x in lines if x.startswith("no feasible mesh"))
    assert doc["no_feasible_mesh"] == {
        "candidates": 4, "undecided": 0, "line": text_line,
        "rules": [{"rule": "batch", "rejected": 3, "text": "global_batch not divisible by micro_batch * dp"},
                  {"rule": "framework", "rejected": 1, "text": "zero1 under framework torch: no torch engine shards "
                                                               "the optimizer alone (torchtitan cannot run it)"}],
        "fix": "set training.global_batch to a multiple of micro_batch x dp for some [search] micro_batch and dp",
        "widened": None}  # no candidate rejected for memory: the search is not widened over cp
    assert doc["top"] == [] and validate("search", doc) == []
    page = (tmp_path / "s.html").read_text()
    assert "No feasible mesh" in page and html.escape(text_line) in page and "; exit 1" in page
    assert "by predicted step time</h2>" not in page and "Top 0" not in page


def test_one_micro_batch_is_singular_in_step_output(tmp_path, capsys):
    """global_batch 8 = micro_batch 1 x dp 8: one micro-batch per step. step's recompute line
    (full recompute) read '(1 micro-batches)'; now '(1 micro-batch)'; no '1 micro-batches' anywhere."""
    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                    '[training]\nglobal_batch = 8\nseq_len = 4096\nrecompute = "full"\n'
                    '[mesh]\nnames = ["dp_shard"]\nshape = [8]\n')
    with pytest.raises(SystemExit) as done:
        cli.main(["step", str(path)])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert re.search(r"ms per step \(1 micro-batch\)$", out, re.M), out
    assert not re.search(r"\b1 micro-batches", out)


def test_report_default_goes_under_out_and_is_never_overwritten(tmp_path, monkeypatch, capsys):
    """Newcomer finding (issue 11 item 5): `report CFG` wrote NAME.html into the current folder,
    while README says defaults go under out/; now out/report/NAME.html, refused when it exists
    (exit 2, the file kept) unless --force."""
    monkeypatch.chdir(tmp_path)
    cfg = EXAMPLES / "mini_2x4_tp2-dp4.toml"

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            cli.main(["report", str(cfg), *argv])
        return e.value.code or 0, capsys.readouterr()

    rc, out = run()
    page = tmp_path / "out" / "report" / "mini_2x4_tp2-dp4.html"
    assert rc == 0 and out.out == "wrote out/report/mini_2x4_tp2-dp4.html\n" and page.exists()
    assert not (tmp_path / "mini_2x4_tp2-dp4.html").exists()
    rc, out = run()  # uxsmall: the rerun replaces meshplan's own unchanged page (fileio.owned)
    assert rc == 0 and out.out == "wrote out/report/mini_2x4_tp2-dp4.html\n"
    page.write_text("keep me")
    rc, out = run()
    assert rc == 2 and out.err == ("error: --out: out/report/mini_2x4_tp2-dp4.html exists; choose another path or "
                                   "pass --force to replace it (meshplan replaces only what it wrote under out/ "
                                   "itself, unchanged since)\n")
    assert page.read_text() == "keep me"
    rc, out = run("--force")
    assert rc == 0 and page.read_text().startswith("<!DOCTYPE html>")


# Newcomer trial 4 (issue 11) ------------------------------------------------------------------

def _cfg(tmp_path, training: str, mesh: str, nodes: int = 1, model: str = 'catalog = "llama3-8b"') -> Path:
    p = tmp_path / "c.toml"
    p.write_text(f'[model]\n{model}\n[cluster]\nsystem = "dgx-h100"\nnodes = {nodes}\n[training]\nseq_len = 4096\n'
                 f'{training}\n[mesh]\n{mesh}\n')
    return p


@pytest.mark.parametrize("training,mesh,nodes,line", [
    ("global_batch = 1000\nmicro_batch = 1", 'names = ["dp_shard"]\nshape = [256]', 32,
     "error: training.global_batch: 1000 is not divisible by micro_batch 1 x dp 256 = 256; use a multiple of 256 "
     "(768 or 1024)"),
    ("global_batch = 64\nmicro_batch = 3", 'names = ["dp_shard"]\nshape = [8]', 1,
     "error: training.global_batch: 64 is not divisible by micro_batch 3 x dp 8 = 24; use a multiple of 24 (48 or "
     "72), or micro_batch 2 or 4"),
])
def test_global_batch_not_a_whole_number_of_micro_batches_is_input_exit_2(tmp_path, training, mesh, nodes, line):
    r = _run("plan", _cfg(tmp_path, training, mesh, nodes))
    assert (r.returncode, r.stdout, r.stderr) == (2, "", line + "\n")


def test_heads_tp_does_not_divide_stay_infeasible_exit_1(tmp_path):
    """The other side of the convention: valid input whose mesh does not divide the model."""
    r = _run("plan", _cfg(tmp_path, "global_batch = 16\nmicro_batch = 1", 'names = ["dp_shard", "tp"]\nshape = [-1, 3]',
                          3))
    assert r.returncode == 1
    assert r.stderr.splitlines()[0] == "infeasible: q_heads 32 is not divisible by tp 3"


def _titan_tp3(tmp_path) -> Path:
    text = (EXAMPLES / "torchtitan_llama3-8b_8xh100.toml").read_text()
    p = tmp_path / "tt.toml"
    p.write_text(text.replace('flavor = "8B"', 'flavor = "70B"').replace("tensor_parallel_degree = 1",
                                                                          "tensor_parallel_degree = 3"))
    return p


def test_torchtitan_tp3_names_the_tp_rule_first(tmp_path):
    """torchtitan tp 3, Llama 3 70B (64 q heads, ffn 28672) on 8 dgx-h100 nodes: the -1
    dp_shard cannot be inferred (64 / 3), but the fix is tp, not --nodes (6 nodes would give
    'q_heads 64 is not divisible by tp 3'): the line names what tp must divide and the
    degrees that do. A tp that does not divide the model is the mesh's fault: infeasible, exit 1, as the
    same tp in a meshplan TOML (docs/commands.md "Exit codes"; it was exit 2 until nc55 #3)."""
    r = _run("plan", _titan_tp3(tmp_path), "--cluster", "dgx-h100", "--nodes", "8")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.splitlines()[-1] == (
        "infeasible: parallelism.tensor_parallel_degree: tp 3 does not divide q_heads 64, ffn 28672 or the node's 8 "
        "GPUs (tp splits the attention heads and the MLP over its ranks, a group inside a node); use 1, 2, 4 or 8")


def test_tp3_on_8_gpu_nodes_is_not_told_to_reorder_axes(tmp_path):
    """At 6 nodes (world 48 = 16 x 3) tp is already innermost; tp 3 groups straddle nodes in any
    order (8 % 3), so the placement line says that, as a warning, not 'put these axes innermost'."""
    r = _run("plan", _titan_tp3(tmp_path), "--cluster", "dgx-h100", "--nodes", "6")
    assert r.returncode == 1
    assert ("warn tp: tp groups span 2 nodes: tp collectives run every layer over the network; tp(6) = [6,7,8]; "
            "tp 3 does not divide the 8 GPUs of a node, so some groups straddle nodes in any axis order: use degrees "
            "whose product divides 8") in " ".join(r.stdout.split())  # (rich wraps at 160 columns)
    assert "innermost" not in r.stdout
    assert r.stderr.splitlines()[-3] == "infeasible: q_heads 64 is not divisible by tp 3"
