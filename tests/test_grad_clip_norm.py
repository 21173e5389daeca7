"""The gradient-clipping bound survives import and export (newcomer trial 17 #1): Megatron-LM's
``--clip-grad 0.3`` was read as ``grad_clip = true`` alone and the export listed it as
``--clip-grad 0.3 -> dropped`` (Megatron-LM then clips at its default 1.0). The value is now
``training.grad_clip_norm``, read from ``--clip-grad``, torchtitan's ``training.max_norm`` and
DeepSpeed's ``gradient_clipping`` and written back to each. Round trips are real: the written
file is imported again and compared field by field (:func:`meshplan.interop.roundtrip.differences`)."""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, reimport_options, user_source
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences

EX = Path(__file__).resolve().parents[1] / "examples"
MEGATRON = EX / "megatron_llama3-8b_16xh100_tp2-pp2.args"
DEEPSPEED = EX / "deepspeed_zero2_16xh100.json"
TORCHTITAN = EX / "torchtitan_llama3-8b_8xh100.toml"


def _back(cfg, to: str, tmp_path: Path, user=None, source: str = "test") -> tuple[str, list[str], object]:
    """(text, header, the config imported back) of ``export --to to``."""
    text, header = export(cfg, to, source, user)
    out = tmp_path / f"back.{ {'deepspeed': 'json', 'megatron': 'args'}.get(to, 'toml') }"
    out.write_text(text)
    return text, header, load_any(out, to, reimport_options(cfg, to))


@pytest.mark.parametrize("given,clip,norm,written", [
    ("0.3", True, 0.3, "--clip-grad 0.3"),
    ("3e-1", True, 0.3, "--clip-grad 0.3"),  # the same number in another spelling: not listed as rewritten
    ("1.0", True, 1.0, "--clip-grad 1.0"),
    ("0", False, None, "--clip-grad 0"),
])
def test_megatron_clip_grad_value_is_carried(tmp_path, given, clip, norm, written):
    """--clip-grad X is read as grad_clip (X > 0) and grad_clip_norm X; the export from the
    user's arguments writes X and lists no --clip-grad line; the meshplan TOML the import writes
    holds X, and its own export (no user file) writes it too; both read back as the same plan."""
    src = tmp_path / "clip.sh"
    src.write_text(MEGATRON.read_text() + f"--clip-grad {given}\n")
    cfg = load_any(src, "megatron", ImportOptions(cluster="dgx-h100", nodes=2))
    assert (cfg.training.grad_clip, cfg.training.grad_clip_norm) == (clip, norm)
    text, header, back = _back(cfg, "megatron", tmp_path, user_source(src), str(src))
    assert [x for x in text.splitlines() if x.startswith("--clip-grad")] == [written]
    assert not [h for h in header if "--clip-grad" in h or "grad_clip" in h], header
    assert differences(cfg, back) == []
    toml_text, _ = export(cfg, "meshplan", str(src))
    (tmp_path / "clip.toml").write_text(toml_text)
    mine = load_config(tmp_path / "clip.toml")
    assert (mine.training.grad_clip, mine.training.grad_clip_norm) == (clip, norm)
    text, header, back = _back(mine, "megatron", tmp_path)
    assert [x for x in text.splitlines() if x.startswith("--clip-grad")] == [written]
    assert differences(mine, back) == []


def test_megatron_without_clip_grad_writes_none():
    """No --clip-grad: Megatron-LM's default 1.0, grad_clip_norm unset, and the export writes no flag."""
    cfg = load_any(MEGATRON, "megatron", ImportOptions(cluster="dgx-h100", nodes=2))
    assert (cfg.training.grad_clip, cfg.training.grad_clip_norm) == (True, None)
    text, _ = export(cfg, "megatron", "test")
    assert not [x for x in text.splitlines() if x.startswith("--clip-grad")]


def test_deepspeed_gradient_clipping_value_round_trips(tmp_path):
    """gradient_clipping 0.3 -> grad_clip_norm 0.3 -> gradient_clipping 0.3 (the writer wrote 1.0),
    with and without the user's JSON, and --clip-grad 0.3 in a Megatron-LM export of the same plan."""
    src = tmp_path / "ds.json"
    src.write_text(json.dumps(json.loads(DEEPSPEED.read_text()) | {"gradient_clipping": 0.3}))
    opts = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=8192)
    cfg = load_any(src, "deepspeed", opts)
    assert cfg.training.grad_clip_norm == 0.3
    for user in (None, user_source(src)):
        text, header, back = _back(cfg, "deepspeed", tmp_path, user, str(src))
        assert json.loads(text)["gradient_clipping"] == 0.3
        assert not [h for h in header if "gradient_clipping" in h or "grad_clip" in h], header
        assert back.training.grad_clip_norm == 0.3
    text, _ = export(cfg, "megatron", "test")
    assert "--clip-grad 0.3" in text.splitlines()


def test_torchtitan_max_norm_value_round_trips(tmp_path):
    """max_norm 0.5 -> grad_clip_norm 0.5 -> max_norm 0.5 in a torchtitan export without the
    user's file (it wrote none: torchtitan's 1.0), --clip-grad 0.5 in a Megatron-LM one."""
    src = tmp_path / "tt.toml"
    src.write_text(TORCHTITAN.read_text().replace("steps = 1000", "steps = 1000\nmax_norm = 0.5"))
    cfg = load_any(src, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    assert (cfg.training.grad_clip, cfg.training.grad_clip_norm) == (True, 0.5)
    text, header, back = _back(cfg, "torchtitan", tmp_path)
    assert tomllib.loads(text.split("\n\n", 1)[1])["training"]["max_norm"] == 0.5
    assert back.training.grad_clip_norm == 0.5 and not [h for h in header if "grad_clip" in h], header
    full = replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"}))  # Megatron-LM has no op SAC
    text, _ = export(full, "megatron", "test")
    assert "--clip-grad 0.5" in text.splitlines()


def test_clip_norm_without_clipping_is_one_line_error():
    """grad_clip = false with a grad_clip_norm is a contradiction: one line naming both fields."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": {"global_batch": 8, "seq_len": 4096, "grad_clip": False, "grad_clip_norm": 0.3},
                          "mesh": {"names": ["dp_shard"], "shape": [8]}})
    msg = str(e.value)
    assert "\n" not in msg and "grad_clip_norm 0.3" in msg and "grad_clip = true" in msg, msg
