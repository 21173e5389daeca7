"""nc59's leftovers (newcomer trial nc59, a long-context practitioner).

#4: catalog llama3.1-8b / llama3.1-70b (Llama 3.1: Llama 3's sizes, 131072 positions, Llama 3.1's RoPE
scaling; sources in models.toml), what torchtitan's llama3 8B/70B flavors are past Llama 3's 8192
positions, and what a plan of them exports as.
"""

from __future__ import annotations

import tomllib

from meshplan import catalog
from meshplan.config import config_from_dict
from meshplan.interop.torchtitan_flavors import flavor_of
from tests.cli_run import run_cli

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
    from meshplan.plan import build_plan
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
