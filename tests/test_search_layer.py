"""torchtitan's per-layer AC in the search (searchknobs item 2): ``recompute = "layer"`` at
torchtitan's default frequency (``activation_checkpoint.mode = "selective"``,
``selective_ac_option = "2"``: every second layer checkpointed in full) is searched under
torchtitan where ``[search] recompute`` lists it. Not by default: its step-time bound is none's
(no layer replayed), which made the 405B benchmark plan 891 candidates exactly instead of 70
(CPU 40.4 s against 7.8 s, past the 10 s goal), so it stays opt-in, and the default's note says so."""

from __future__ import annotations

import json

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.search.columns import RECOMPUTE
from meshplan.search.driver import search
from tests.cli_run import run_main

#: Llama-3-8B on one dgx-h100 under torch (torchtitan), seq 4096, global batch 16.
BASE = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 4096}}
#: One mesh: dp_shard 8, micro-batch 1 (the search still tries reshard_after_forward both ways).
ONE = {"micro_batch": [1], "pp": [1], "dp_replicate": [1], "cp": [1], "tp": [1]}


def _cfg(search_table: dict, training: dict | None = None):
    return config_from_dict({**BASE, "training": BASE["training"] | (training or {}), "search": search_table},
                            require_mesh=False)


def test_listed_layer_rows_run_every_second_layer_in_full_and_export_as_torchtitan_does(tmp_path, capsys):
    """Listed alone, every row is "layer": row 1 (dp_shard 8, mb 1, kept gathered) predicts 0.9389 s,
    the step ``meshplan step`` gives its meshplan export (ac_freq = 2 written, 938.90 ms), and the
    torchtitan export writes mode "selective" with selective_ac_option "2"."""
    cfg = tmp_path / "s.toml"
    cfg.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                   'global_batch = 16\nseq_len = 4096\n[search]\nmicro_batch = [1]\npp = [1]\ncp = [1]\ntp = [1]\n'
                   'recompute = ["layer"]\n')
    assert run_main("search", cfg, "--json", tmp_path / "s.json", "--export", 1, "--to", "torchtitan",
                    "-o", tmp_path / "tt.toml") == 0
    assert run_main("search", cfg, "--export", 1, "--to", "meshplan", "-o", tmp_path / "mp.toml") == 0
    capsys.readouterr()
    top = json.loads((tmp_path / "s.json").read_text())["top"][0]
    assert top["recompute"] == "layer" and round(top["step_s"], 4) == 0.9389
    tt = (tmp_path / "tt.toml").read_text()
    assert '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "2"\n' in tt
    assert 'recompute = "layer"\nac_freq = 2\n' in (tmp_path / "mp.toml").read_text()
    assert run_main("step", tmp_path / "mp.toml") == 0
    assert "step 938.90 ms" in capsys.readouterr().out


def test_layer_sits_between_none_and_full():
    """Listed beside none and full at one mesh and micro-batch (dp_shard 8, mb 1, resharded): the
    layer row's exact step lies between none's and full's, at their midpoint (every second layer
    replayed), and the search's bounds for it held (planned exactly, no error)."""
    r = search(_cfg(ONE | {"recompute": ["none", "layer", "full"], "reshard_after_forward": [True]}), workers=1)
    done = [(RECOMPUTE[r.candidates.rc[i]], e.step_s) for i, e in r.exact.items() if e.step_s is not None]
    steps = dict(done)
    assert len(done) == 3 and set(steps) == {"none", "layer", "full"}
    assert steps["none"] < steps["layer"] < steps["full"]
    # 16 of the 32 layers replayed: the midpoint (0.8622 s none, 1.0820 s full, 0.9721 s layer)
    assert steps["layer"] == pytest.approx((steps["none"] + steps["full"]) / 2, rel=1e-3)


def test_default_under_torch_leaves_layer_out_with_a_note():
    r = search(_cfg(ONE), workers=1)
    assert RECOMPUTE.index("layer") not in set(r.candidates.rc.tolist())
    assert any("('layer', every 2nd layer, its default) is searched where [search] recompute lists it" in n
               for n in r.notes)


def test_layer_listed_under_megatron_is_refused():
    with pytest.raises(ConfigError) as e:
        _cfg({"recompute": ["none", "layer"]}, {"framework": "megatron"})
    assert e.value.field == "search.recompute" and "remove it from the list" in str(e.value)
