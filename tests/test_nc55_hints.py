"""Newcomer trial 55 #4 and #9: the FSDP hint at 1 micro-batch (a ``note: no fsdp hint`` saying
why, or a ``hint:`` where a knob that still applies is clearly faster:
:func:`meshplan.schedule.fsdp_knobs.one_batch_knobs`), and every ``hint:`` line's facts as data in
``step --json``'s ``hints`` (:mod:`meshplan.schedule.hint_facts`), built from the numbers the line
prints, never parsed from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.schedule import verdict
from meshplan.schedule.fsdp_knobs import fsdp_knobs, one_batch_knobs
from meshplan.schedule.hint_facts import HintLine, Knob
from meshplan.schedule.verdict import Replanned
from meshplan.units import GiB
from tests.cli_run import run_cli
from tests.conftest import EXAMPLES

#: The trial's Mixtral-8x7B job (jobs/mx.mp.toml, imported from torchtitan) as a meshplan TOML:
#: dp_shard 8 x tp 8 on 8 dgx-h100, global_batch 64 = micro_batch 8 x dp 8, so 1 micro-batch.
MIXTRAL = """[model]
catalog = "mixtral-8x7b"
[cluster]
system = "dgx-h100"
nodes = 8
[training]
global_batch = 64
seq_len = 8192
micro_batch = 8
param_dtype = "fp32"
sharding = "zero3"
compute_dtype = "bf16"
reduce_dtype = "fp32"
recompute = "full"
torch_compile = true
moe_dropless = true
[mesh]
names = ["dp_shard", "tp"]
shape = [8, 8]
sequence_parallel = true
"""


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory):
    """examples/llama3-70b_256xh100_dp32-tp8.toml (dp_shard 32 x tp 8, FSDP2, micro_batch 1,
    reshard_after_forward true) at global_batch 32 = 1 x 32: 1 micro-batch per step."""
    text = (EXAMPLES / "llama3-70b_256xh100_dp32-tp8.toml").read_text()
    assert "global_batch = 512" in text
    path = tmp_path_factory.mktemp("nc55") / "m1.toml"
    path.write_text(text.replace("global_batch = 512", "global_batch = 32"))
    return build_plan(load_config(path))


def _st(fsdp_s: float, step_s: float):
    """A step with ``fsdp_s`` of exposed fsdp in ``step_s`` (hand values: the hint reads no other part)."""
    return SimpleNamespace(exposed_s={"fsdp": fsdp_s}, step_s=step_s, named=lambda s: s)


def test_one_batch_knobs(one_batch):
    # m = 32 / (1 x 32) = 1: the per-micro-batch knobs have nothing to cut, reshard_after_forward false still
    # drops each layer's backward all-gather (FSDP2, reshard true)
    assert one_batch.micro_batches == 1 and fsdp_knobs(one_batch, "fsdp") is None
    why, knobs = one_batch_knobs(one_batch, "fsdp")
    assert knobs == [("training.reshard_after_forward = false", {"reshard_after_forward": False})]
    assert "do not apply at 1 micro-batch (global_batch 32 = micro_batch 1 x dp 32" in why
    assert one_batch_knobs(one_batch, "tp") is None


def test_note_where_no_knob_is_clearly_faster(one_batch):
    # 2.0 s of a 10.0 s step = 20.0% >= 15%; the knob's 9.95 s is -0.5%, within the 1% tie: a note, no hint
    lines = verdict.exposed_hint(one_batch, _st(2.0, 10.0), lambda u: Replanned("step", 9.95, 40 * GiB))
    assert len(lines) == 1 and not isinstance(lines[0], HintLine)
    assert lines[0].startswith("note: no fsdp hint: exposed fsdp is 20.0% of the step (2.0 s of 10.00 s; "
                               "1 micro-batch per step): training.grad_accumulation and a larger")
    assert lines[0].endswith("; reshard_after_forward false: step 9.95 s (-0.5%), not 1% shorter")
    # under 15% (1.4 s of 10 s): nothing
    assert verdict.exposed_hint(one_batch, _st(1.4, 10.0), lambda u: Replanned("step", 5.0, GiB)) == []


def test_hint_with_its_facts_where_the_knob_is_faster(one_batch):
    # 9.0 s against 10.0 s: -10.0%, peak 40 GiB = 42,949,672,960 B
    line, = verdict.exposed_hint(one_batch, _st(2.0, 10.0), lambda u: Replanned("step", 9.0, 40 * GiB))
    assert line == ("hint: exposed fsdp is 20.0% of the step (2.0 s of 10.00 s; 1 micro-batch per step): shorter with "
                    "training.reshard_after_forward = false (step 9.00 s, -10.0%, peak 40.0 GiB fits)")
    assert line.hint.stream == "fsdp" and line.hint.share == pytest.approx(0.2)
    assert line.hint.knobs == (Knob("training.reshard_after_forward = false", 9.0, 42_949_672_960.0),)


def test_mixtral_one_batch_says_why(tmp_path, capsys):
    """The trial's case end to end: fsdp exposed >= 15% at 1 micro-batch now has its note line, in
    the text and in --json's verdict, and the JSON's hints hold the tp hint alone."""
    cfg, out = tmp_path / "mx.toml", tmp_path / "mx.json"
    cfg.write_text(MIXTRAL)
    code, text, err = run_cli(["step", cfg, "--json", out], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(doc)) == []
    assert doc["micro_batches"] == 1 and doc["exposed_s"]["fsdp"] / doc["step_s"] >= 0.15
    note = [v for v in doc["verdict"] if v.startswith("note: no fsdp hint:")]
    assert len(note) == 1 and note[0] in text and "global_batch 64 = micro_batch 8 x dp 8" in note[0]
    assert "reshard_after_forward false: step " in note[0]
    assert not any(v.startswith("hint: exposed fsdp") for v in doc["verdict"])
    assert [h["stream"] for h in doc["hints"]] == ["tp"]


def test_step_json_hints_are_the_lines_numbers(tmp_path, capsys):
    """examples/mini_2x4_tp4-dp2.toml (eager DTensor TP): the host hint (tests/test_host_pace.py),
    its share the JSON's own host wait over its step, its knob's step and peak those the line prints."""
    out = tmp_path / "mini.json"
    code, _, err = run_cli(["step", EXAMPLES / "mini_2x4_tp4-dp2.toml", "--json", out], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(doc)) == []
    host, = [h for h in doc["hints"] if h["stream"] == "host"]
    assert host["share_of_step"] == pytest.approx(doc["host_wait_s"] / doc["step_s"])
    knob, = host["knobs"]
    line, = [v for v in doc["verdict"] if v.startswith("hint: the device waits")]
    assert knob["knob"] == "training.torch_compile = true"
    assert f"step {knob['step_s']:.2f} s ({knob['step_s'] / doc['step_s'] - 1:+.1%}), " \
           f"peak {knob['peak_bytes'] / GiB:.1f} GiB fits" in line
    assert knob["step_s"] < 0.99 * doc["step_s"]  # listed only where more than 1% shorter


def test_the_schema_keeps_older_documents_valid(tmp_path, capsys):
    # hints is optional: a document without it (written before nc55fixB) still validates
    out = tmp_path / "mini.json"
    code, _, _ = run_cli(["step", EXAMPLES / "mini_2x4_tp2-dp4.toml", "--json", out], capsys)
    doc = json.loads(out.read_text())
    doc.pop("hints")
    assert code == 0 and list(jsonschema.Draft202012Validator(schema_of("step")).iter_errors(doc)) == []
