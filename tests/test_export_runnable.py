"""Exports a user can run as written (newcomer trial 25). ``export CHOSEN --to torchtitan`` of a
meshplan TOML wrote no tokenizer folder, dataset, step count or learning rate, and torchtitan ran
its test tokenizer on c4_test without a word; the export now lists exactly those keys with
torchtitan's defaults (``JobConfig``, torchtitan/config/job_config.py at e347b1e), and an imported
torchtitan file's own values come back through its ``[source]``. Run through the CLI, as the
user ran it."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from meshplan import cli
from tests.configs import torch_op_job

EX = Path(__file__).resolve().parents[1] / "examples"

#: The trial's CHOSEN: Llama-3-70B on 64 dgx-h100, dp_shard 128 x tp 4, framework torch.
CHOSEN = torch_op_job("llama3-70b", nodes=64, global_batch=512, shape=[128, 4])


def _cli(*args: str) -> str:
    r = CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "1000"})
    assert r.exit_code == 0, r.output
    return r.output


def test_torchtitan_export_lists_the_run_keys_it_does_not_write(tmp_path):
    """No torchtitan file to carry from: none of the four keys is in the file, and one note names
    each with the value torchtitan's JobConfig at e347b1e gives it (Model.hf_assets_path
    "./tests/assets/tokenizer", Training.dataset "c4_test", Training.steps 10000, Optimizer.lr 8e-4)."""
    src = tmp_path / "chosen.toml"
    src.write_text(CHOSEN)
    out = _cli("export", str(src), "--to", "torchtitan", "-o", str(tmp_path / "tt.toml"))
    written = tomllib.loads((tmp_path / "tt.toml").read_text())
    assert "hf_assets_path" not in written["model"] and "lr" not in written["optimizer"]
    assert not {"dataset", "steps"} & set(written["training"])
    note = ("note: not written, set before running (torchtitan's default otherwise): model.hf_assets_path "
            "(\"./tests/assets/tokenizer\", its test tokenizer), training.dataset (\"c4_test\", its test slice of C4), "
            "training.steps (10000), optimizer.lr (8e-4)")
    assert note in out.splitlines()
    assert f"# {note}" in (tmp_path / "tt.toml").read_text().splitlines()  # the file says it too


def test_torchtitan_export_names_the_torchtitan_it_is_for(tmp_path):
    """The job TOML is the format of torchtitan <= v0.2.2 (JobConfig at e347b1e, 2026-02-15; 9810191,
    2026-02-23, replaced it with Python configs, --module/--config): the written file's header says so, and
    its [parallelism] degree keys are the field names of b5bcd76's ParallelismConfig
    (torchtitan/config/configs.py:121-293: data_parallel_shard_degree, tensor_parallel_degree, ...), the
    way the header tells a newer torchtitan's user to carry them. CHOSEN: dp_shard 128 x tp 4."""
    src = tmp_path / "chosen.toml"
    src.write_text(CHOSEN)
    out = _cli("export", str(src), "--to", "torchtitan", "-o", str(tmp_path / "tt.toml"))
    text = (tmp_path / "tt.toml").read_text()
    target = [line for line in text.splitlines() if line.startswith("# target: ")]
    assert len(target) == 1 and target[0].startswith("# target: torchtitan <= v0.2.2 (TOML job config, commit "
                                                     "e347b1e); torchtitan from 9810191 (2026-02-23) reads no job TOML")
    assert target[0][2:] in out.splitlines()
    par = tomllib.loads(text)["parallelism"]
    assert (par["data_parallel_shard_degree"], par["tensor_parallel_degree"]) == (128, 4)


def test_round_trip_of_an_imported_torchtitan_file_keeps_them(tmp_path):
    """import the example job (hf_assets_path, dataset "c4", steps 1000, lr 3e-4) -o job.toml, export
    job.toml --to torchtitan: its [source] carries the four values as the file wrote them, no note."""
    src = tmp_path / "tt8b.toml"
    src.write_text((EX / "torchtitan_llama3-8b_8xh100.toml").read_text())
    job = tmp_path / "job.toml"
    _cli("import", "torchtitan", str(src), "--cluster", "dgx-h100", "--nodes", "1", "-o", str(job))
    out = _cli("export", str(job), "--to", "torchtitan", "-o", str(tmp_path / "back.toml"))
    back = tomllib.loads((tmp_path / "back.toml").read_text())
    assert back["model"]["hf_assets_path"] == "./assets/hf/Llama-3.1-8B"
    assert (back["training"]["dataset"], back["training"]["steps"], back["optimizer"]["lr"]) == ("c4", 1000, 3e-4)
    assert "not written, set before running" not in out


#: A small torch job (Llama-3-8B on one dgx-h100) whose [training] writes keys at their default values.
ONE_NODE = torch_op_job("llama3-8b", nodes=1, global_batch=16, shape=[4, 2])


def test_search_export_to_meshplan_plans_the_row(tmp_path):
    """search --export 1 --to meshplan dropped memory_reserve and sharding (equal to their defaults)
    and wrote pp_schedule = "1f1b" at pp 1: the export now keeps every [training] key the job wrote,
    has no pipeline key at pp 1, and plans the row's own step and peak (the search's --json row,
    build_plan + step_time of the export as the search's exact evaluation runs them)."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap

    job, row1 = tmp_path / "job.toml", tmp_path / "row1.toml"
    job.write_text(ONE_NODE)
    _cli("search", str(job), "--export", "1", "--to", "meshplan", "-o", str(row1), "--json", str(tmp_path / "s.json"))
    row = json.loads((tmp_path / "s.json").read_text())["top"][0]
    written = tomllib.loads(row1.read_text())
    user = tomllib.loads(ONE_NODE)["training"]
    assert set(user) <= set(written["training"])
    assert {k: written["training"][k] for k in ("memory_reserve", "sharding", "framework")} == \
        {"memory_reserve": 0.1, "sharding": "zero3", "framework": "torch"}
    assert row["mesh"]["pp"] == 1 and not {"pp_schedule", "virtual_stages", "pp_layer_split"} & set(written["mesh"])
    plan = build_plan(load_config(row1))
    assert (step_time(plan, Overlap()).step_s, plan.timeline.peak.total_bytes) == (row["step_s"], row["peak_bytes"])
