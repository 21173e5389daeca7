"""nc59's leftovers (newcomer trial nc59, a long-context practitioner).

#1: ``search``'s no-feasible-mesh fix names Megatron Core's data-loader mask, as ``plan``'s does
(:func:`meshplan.search.widen.unmasked`, :func:`meshplan.report.search_fix.unmasked_words`).

#4: catalog llama3.1-8b / llama3.1-70b (Llama 3.1: Llama 3's sizes, 131072 positions, Llama 3.1's RoPE
scaling; sources in models.toml), what torchtitan's llama3 8B/70B flavors are past Llama 3's 8192
positions, and what a plan of them exports as.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace

from meshplan import catalog
from meshplan.config import config_from_dict
from meshplan.interop.foreign import ImportOptions, load_any
from meshplan.interop.keymaps import keymap_of
from meshplan.interop.torchtitan_flavors import flavor_of
from meshplan.plan import build_plan
from meshplan.plan_fix_mask import SETTING
from meshplan.report.search import timing_line
from meshplan.report.search_fix import infeasible_verdict
from meshplan.search.driver import search
from meshplan.search.widen import mask_bytes, widen
from meshplan.units import GiB
from tests.cli_run import run_cli
from tests.test_nc59_fixes import ARGS

TOML = """[model]
catalog = "llama3.1-8b"
[cluster]
system = "dgx-h100"
nodes = 8
[training]
global_batch = 64
seq_len = 131072
recompute = "full"
sharding = "zero3"
[mesh]
names = ["dp_shard", "cp"]
shape = [8, 8]
"""


def test_llama31_plans_at_131072_without_the_position_note():
    """131072 tokens are within llama3.1-8b's 131072 positions (config.json max_position_embeddings),
    so no 'more than max_position' note, where llama3-8b's 8192 gets one that names llama3.1-8b."""
    d = tomllib.loads(TOML)
    notes = build_plan(config_from_dict(d)).notes
    assert not any("max_position" in n for n in notes)
    d["model"]["catalog"] = "llama3-8b"
    assert any("max_position 8192" in n and "use catalog model llama3.1-8b" in n
               for n in build_plan(config_from_dict(d)).notes)


def test_llama31_exports_as_torchtitan_flavor_and_comes_back(tmp_path, capsys):
    """torchtitan's llama3 8B flavor is Llama 3.1 (RoPE scaling "llama", 131072 positions: b5bcd76
    models/llama3/__init__.py:267): a llama3.1-8b plan exports as flavor 8B with no field 'not
    expressed' (before: model.rope_scaling -> None), and imports back as catalog llama3.1-8b."""
    assert flavor_of(catalog.model("llama3.1-8b")) == ("llama3", "8B")
    assert flavor_of(catalog.model("llama3.1-70b")) == ("llama3", "70B")
    (tmp_path / "l.toml").write_text(TOML)
    code, out, err = run_cli(["export", str(tmp_path / "l.toml"), "--to", "torchtitan", "-o",
                               str(tmp_path / "tt.toml")], capsys)
    assert code == 0, err
    assert "not expressed" not in out + err
    model = tomllib.loads((tmp_path / "tt.toml").read_text())["model"]
    assert (model["name"], model["flavor"]) == ("llama3", "8B")
    code, _, err = run_cli(["import", "torchtitan", str(tmp_path / "tt.toml"), "--cluster", "dgx-h100",
                             "--nodes", "8", "-o", str(tmp_path / "back.toml")], capsys)
    assert code == 0, err
    assert tomllib.loads((tmp_path / "back.toml").read_text())["model"] == {"catalog": "llama3.1-8b"}


def test_torchtitan_llama3_past_131072_keeps_the_untrained_note(tmp_path, capsys):
    """seq 262144 is past Llama 3.1's 131072 too: catalog llama3.1-8b with max_position 262144 and the
    note that positions past 131072 are untrained (flavor_context, _past_trained)."""
    (tmp_path / "l.toml").write_text(TOML)
    code, _, err = run_cli(["export", str(tmp_path / "l.toml"), "--to", "torchtitan", "-o",
                             str(tmp_path / "tt.toml")], capsys)
    assert code == 0, err
    text = (tmp_path / "tt.toml").read_text().replace("seq_len = 131072", "seq_len = 262144")
    (tmp_path / "tt.toml").write_text(text)
    code, _, err = run_cli(["import", "torchtitan", str(tmp_path / "tt.toml"), "--cluster", "dgx-h100",
                             "--nodes", "8", "-o", str(tmp_path / "back.toml")], capsys)
    assert code == 0, err
    back = (tmp_path / "back.toml").read_text()
    assert tomllib.loads(back)["model"] == {"catalog": "llama3.1-8b", "max_position": 262144}
    assert "262144 is past the 131072 positions Llama 3.1 was trained to" in back


# nc59 #1 (the search's half): the no-feasible-mesh fix names Megatron Core's data-loader mask.

def _long_70b(tmp_path):
    """nc59's Llama-3-70B Megatron-LM job at seq 262144 (tests/test_nc59_fixes.py ARGS: tp 8 + SP,
    cp 16, distributed optimizer, full recompute, the loader's mask on) on 32 dgx-h100, [search]
    narrowed to that mesh (tp 8, cp 16, pp 1, mb 1, full, zero1) so that the search is quick."""
    path = tmp_path / "l70.args"
    path.write_text(ARGS.format(s=262144, cp=16, gb=32), encoding="utf-8")
    cfg = load_any(path, "megatron", ImportOptions(cluster="dgx-h100", nodes=32))
    narrow = {"tp": [8], "cp": [16], "pp": [1], "micro_batch": [1], "recompute": ["full"], "sharding": ["zero1"]}
    return replace(cfg, search=cfg.search.model_copy(update=narrow))


def test_search_no_fit_fix_names_the_mask_flag_and_its_row(tmp_path):
    """The mask is 1 x 1 x 262144 x 262144 bool = 262144^2 B = 2^36 B = 64.0 GiB at micro-batch 1,
    on the GPU on top of the state (plan: init + 2^36, tests/test_nc59_fixes.py), so every candidate
    is rejected for memory; without it the same mesh fits (plan's fix: 56.8 GiB without tp overlap).
    The fix names the flag in the file's words, the bytes, and the row the search without the mask
    finds, first; the other fixes follow."""
    cfg = _long_70b(tmp_path)
    assert mask_bytes(cfg) == 262144 ** 2 == 2 ** 36 == 64 * GiB
    r = widen(search(cfg))
    assert not r.top and r.counts()["memory"] == len(r.candidates) > 0
    w = r.widened_mask
    assert w is not None and w.cp == 16 and w.peak_bytes < r.usable_bytes
    fix = infeasible_verdict(r)["fix"]
    assert fix.startswith("--no-create-attention-mask-in-dataloader (the data loader's 1 x 1 x 262144 x 262144 bool "
                          "attention mask (64.0 GiB), not built): the fastest that fits is " + w.label)
    assert f"peak {w.peak_bytes / GiB:.1f} GiB); or " in fix  # the memory rule's fix after it
    assert "without the data loader's attention mask" in timing_line(r)


def test_no_mask_fix_below_a_gib_or_outside_megatron_core():
    """seq 16384 at micro-batch 1: 16384^2 B = 2^28 B = 256 MiB < 1 GiB (MIN_GAIN): not worth a search;
    framework torch builds no such mask (0 B); a meshplan TOML's words are its own field."""
    d = {"model": {"catalog": "llama3-8b", "max_position": 32768}, "cluster": {"system": "dgx-h100", "nodes": 1},
         "training": {"global_batch": 8, "seq_len": 16384, "framework": "megatron", "megatron_runtime": "core"},
         "mesh": {"names": ["dp", "tp"], "shape": [1, 8]}, "search": {"micro_batch": [2, 1]}}
    assert mask_bytes(config_from_dict(d)) == 16384 ** 2 == 2 ** 28
    d["training"]["seq_len"] = 32768
    cfg = config_from_dict(d)
    assert mask_bytes(cfg) == 32768 ** 2 == 2 ** 30  # the smallest micro-batch, 1
    assert keymap_of(cfg).setting(SETTING) == "training.dataloader_attention_mask = false"
    d["training"] = {"global_batch": 8, "seq_len": 32768}
    assert mask_bytes(config_from_dict(d)) == 0
