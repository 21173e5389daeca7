"""An export to torchtitan keeps the float8 names of the user's job TOML (newcomer trial, issue 11
follow-up). pytorch/torchtitan renamed the float8 Linear converter and its table: ``"float8"`` and
``[float8]`` (57387af, 2025-02-15) became ``quantize.dense.float8`` (5b5d468, 2025-09-26) and
``"quantize.linear.float8"`` / ``[quantize.linear.float8]`` (8a2686c, 2025-09-30); neither side
reads the other's names, so rewriting them broke the files of users on the older torchtitan."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from cli_run import run_main as _main

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.torchtitan_float8 import Float8Spelling, float8_spelling

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchtitan_llama3-8b_8xh100.toml"
#: The plan's float8 table: FSDP2 over 8 GPUs gathers the float8 weights; the output layer filtered.
PLANNED = {"precompute_float8_dynamic_scale_for_fsdp": True, "enable_fsdp_float8_all_gather": True,
           "filter_fqns": ["output"]}
NOTE = "note: float8 written as"


def _job(tmp_path, converters: str, table: str, keys: str) -> Path:
    """The torchtitan example with a float8 converter line and table added."""
    text = EXAMPLE.read_text().replace('flavor = "8B"\n', f'flavor = "8B"\n{converters}\n')
    path = tmp_path / "job.toml"
    path.write_text(text + f"\n[{table}]\n{keys}\n" * bool(table))
    return path


def _export(tmp_path, job: Path, capsys, *command) -> tuple[dict, list[str]]:
    out = tmp_path / "out.toml"
    assert _main(*(command or ("export", job, "--to", "torchtitan")), "-o", out, "--cluster", "dgx-h100",
                 "--nodes", 1) == 0
    said = capsys.readouterr().out.splitlines()
    text = out.read_text()
    return tomllib.loads(text), [line[2:] for line in text.splitlines() if line.startswith("# ")] or said


KEYS = "enable_fsdp_float8_all_gather = true\nprecompute_float8_dynamic_scale_for_fsdp = true\nfilter_fqns = [\"output\"]"


#: The converter alone: torchtitan's Float8 defaults (no float8 all-gather, no filter), planned so.
DEFAULTS = {"enable_fsdp_float8_all_gather": False, "precompute_float8_dynamic_scale_for_fsdp": False,
            "filter_fqns": []}


@pytest.mark.parametrize("converters, table, keys, switch, planned", [
    ('converters = ["float8"]', "float8", KEYS, False, PLANNED),  # torchtitan 57387af to 5b5d468
    ('converters = "float8"', "float8", KEYS, False, PLANNED),  # its older comma-separated string
    ('converters = ["float8"]', "", "", False, DEFAULTS),  # the converter alone
    # 2024: the switch, no converter, no filter_fqns (torchtitan then skipped the output layer, as planned)
    ("", "float8", "enable_float8_linear = true\nenable_fsdp_float8_all_gather = true\n"
     "precompute_float8_dynamic_scale_for_fsdp = true", True, PLANNED),
])
def test_older_float8_names_are_kept(tmp_path, capsys, converters, table, keys, switch, planned):
    doc, header = _export(tmp_path, _job(tmp_path, converters, table, keys), capsys)
    assert doc["model"]["converters"] == ["float8"]
    assert doc["float8"] == ({"enable_float8_linear": True} if switch else {}) | planned
    assert not switch or list(doc["float8"])[0] == "enable_float8_linear"
    assert "quantize" not in doc
    assert [h for h in header if h.startswith("not expressed")] == []  # read back as the same plan
    notes = [h for h in header if h.startswith(NOTE)]
    assert len(notes) == 1 and 'reads only "quantize.linear.float8" and [quantize.linear.float8]' in notes[0]
    assert ("enable_float8_linear = true" in notes[0]) == switch
    rewritten = [h for h in header if h.startswith("written otherwise than")]
    assert rewritten == [f"written otherwise than {tmp_path / 'job.toml'} (the plan's value or spelling): "
                         f"parallelism.data_parallel_shard_degree -1 -> 8"]
    carried = [h for h in header if h.startswith("carried unchanged")][0]
    assert ("float8.precompute_float8_dynamic_scale_for_fsdp" in carried) == bool(table)
    assert "quantize.linear" not in carried


def test_current_names_are_written_for_current_files_and_meshplan_tomls(tmp_path, capsys):
    job = _job(tmp_path, 'converters = ["quantize.linear.float8"]', "quantize.linear.float8", KEYS)
    doc, header = _export(tmp_path, job, capsys)
    assert doc["model"]["converters"] == ["quantize.linear.float8"]
    assert doc["quantize"] == {"linear": {"float8": PLANNED}} and "float8" not in doc
    assert [h for h in header if h.startswith(NOTE)] == []
    # a meshplan TOML of the same plan imported from the older file carries that file (its [source],
    # trial 17): its older names are kept, as from the file itself
    toml = tmp_path / "plan.toml"
    assert _main("import", "torchtitan", _job(tmp_path, 'converters = ["float8"]', "float8", KEYS), "--cluster",
                 "dgx-h100", "--nodes", 1, "-o", toml) == 0
    out = tmp_path / "from_toml.toml"
    assert _main("export", toml, "--to", "torchtitan", "-o", out) == 0
    doc = tomllib.loads(out.read_text())
    assert doc["model"]["converters"] == ["float8"] and NOTE in out.read_text()
    # without [source] (a TOML written by hand) there is no user file: current names
    toml.write_text(toml.read_text().split("\n[source]\n")[0])
    out = tmp_path / "from_bare_toml.toml"
    assert _main("export", toml, "--to", "torchtitan", "-o", out) == 0
    doc = tomllib.loads(out.read_text())
    assert doc["model"]["converters"] == ["quantize.linear.float8"] and "float8" not in doc
    assert NOTE not in out.read_text()


def test_search_export_keeps_the_older_names(tmp_path, capsys):
    job = _job(tmp_path, 'converters = ["float8"]', "float8", KEYS)
    out = tmp_path / "row1.toml"
    assert _main("search", job, "--cluster", "dgx-h100", "--nodes", 1, "--export", 1, "--to", "torchtitan",
                 "-o", out) == 0
    doc = tomllib.loads(out.read_text())
    assert doc["model"]["converters"] == ["float8"] and "quantize" not in doc
    assert doc["float8"]["enable_fsdp_float8_all_gather"] is True
    assert f"# {NOTE} search {job} row 1 names it" in out.read_text()


@pytest.mark.parametrize("raw, want", [
    ({"model": {"converters": ["float8"]}, "quantize": {"linear": {"float8": {}}}}, Float8Spelling.CURRENT),
    ({"model": {"converters": ["quantize.linear.float8"]}, "float8": {}}, Float8Spelling.CURRENT),
    ({"model": {"converters": "float8,other"}}, Float8Spelling.CONVERTER),
    ({"float8": {"enable_float8_linear": False}}, Float8Spelling.SWITCH),
    ({"model": {"converters": 3}, "quantize": 1}, Float8Spelling.CURRENT),  # malformed: the reader names it
    ({}, Float8Spelling.CURRENT),
])
def test_float8_spelling_of_a_file(raw, want):
    """A file that names the current converter or table anywhere is current (a mixed file runs on
    neither torchtitan as it is; its export is today's)."""
    assert float8_spelling(raw) is want


@pytest.mark.parametrize("converters, table, keys, fp8_tp", [
    # v0.2.0-v0.2.2 (8a2686c on): parallelize.py:77 tests "float8" in model.converters: false, plain TP
    ('converters = ["quantize.linear.float8"]', "quantize.linear.float8", KEYS, False),
    ('converters = ["quantize.linear.float8"]', "quantize.linear.float8", 'recipe_name = "rowwise"', False),
    # 57387af to 5b5d468: the registry's "float8", which the same test sees: float8 TP
    ('converters = ["float8"]', "float8", KEYS, True),
    # before 57387af: enable_float8=job_config.float8.enable_float8_linear (parallelize_llama.py:63 at 57387af^)
    ("", "float8", "enable_float8_linear = true", True),
    # "float8" beside the current table: no torchtitan runs it as written; planned as "float8" reads
    ('converters = ["float8"]', "quantize.linear.float8", KEYS, True),
])
def test_float8_tp_follows_the_converter_name(tmp_path, converters, table, keys, fp8_tp):
    text = _job(tmp_path, converters, table, keys).read_text().replace("tensor_parallel_degree = 1",
                                                                       "tensor_parallel_degree = 2")
    job = tmp_path / "tp2.toml"
    job.write_text(text)
    cfg = load_any(job, opts=ImportOptions(cluster="dgx-h100", nodes=1))
    t = cfg.training
    assert t.linear_dtype == "fp8" and t.fp8_tp is fp8_tp
    assert t.float8_tp_gathers is (fp8_tp and t.fp8_recipe == "tensorwise")
    # the note quoting torchtitan's test where it turns float8 TP off (tensorwise at tp 2)
    off = [n for n in cfg.notes if "float8 TP off" in n]
    assert len(off) == (not fp8_tp and "rowwise" not in keys)
    assert all("parallelize.py:77 at 73a0e69, v0.2.2" in n for n in off)
