"""Exports keep what the user wrote (newcomer trial 16): an export of an unchanged mesh keeps the
user's own torchtitan [activation_checkpoint] though the plan models it otherwise (op-level SAC at
cp > 1, planned as Megatron-LM's selective recompute), with one note saying what the plan assumed;
only a recompute the plan changed (a search row's) is written otherwise, and said so. Round trips
are real: the written file is imported again and compared field by field."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import export, load_any, user_source
from meshplan.interop.roundtrip import differences

#: Llama-3-70B at seq 32768 on 32 dgx-h100: dp_shard 8 x cp 4 x tp 8, op-level SAC (the trial's job).
TT70 = """[job]
dump_folder = "./outputs"

[model]
name = "llama3"
flavor = "70B"

[optimizer]
name = "AdamW"
lr = 1.5e-4

[training]
local_batch_size = 1
seq_len = 32768
steps = 1000

[parallelism]
data_parallel_shard_degree = {dp}
tensor_parallel_degree = 8
context_parallel_degree = {cp}

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""
OPTS = ImportOptions(cluster="dgx-h100", nodes=32)


def _export_tt(tmp_path: Path, cp: int, training: dict | None = None) -> tuple[dict, list[str], object, object]:
    """(the written torchtitan tables, the header, the config read from the user's file, the
    config read back from the written file) of ``export --to torchtitan`` of TT70 at ``cp``, the
    plan's training fields changed by ``training`` (a search row's)."""
    src = tmp_path / f"tt70-cp{cp}.toml"
    src.write_text(TT70.format(dp=32 // cp, cp=cp))
    cfg = load_any(src, "torchtitan", OPTS)
    if training:
        cfg = replace(cfg, training=cfg.training.model_copy(update=training))
    text, header = export(cfg, "torchtitan", str(src), user_source(src))
    out = tmp_path / "out.toml"
    out.write_text(text)
    return tomllib.loads(text), header, cfg, load_any(out, "torchtitan", OPTS)


def test_torchtitan_export_keeps_op_sac_at_cp4(tmp_path):
    """cp 4: the import plans op-level SAC as Megatron-LM's selective (op is planned at cp = ep = 1
    only); the export wrote that as mode "none" and listed mode and selective_ac_option as
    rewritten. Now the file keeps the user's two keys, one note says what the plan assumed, no key
    is listed as rewritten and nothing as not expressed, and the file reads back as the same plan."""
    tables, header, cfg, back = _export_tt(tmp_path, cp=4)
    assert cfg.training.recompute == "selective"
    assert tables["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not [h for h in header if h.startswith(("written otherwise", "not expressed", "step after"))], header
    notes = [h for h in header if "recompute" in h or "activation_checkpoint" in h]
    assert notes == [
        "note: activation_checkpoint kept as written (mode \"selective\", selective_ac_option \"op\": op-level SAC); "
        "the plan assumed Megatron-LM's selective recompute (attention core recomputed, the other activations kept), "
        "as op-level SAC is planned with cp = ep = 1 and no MLA only and this mesh has cp 4"]
    assert back.training.recompute == "selective" and differences(cfg, back) == []


def test_torchtitan_export_of_op_where_op_plans_needs_no_note(tmp_path):
    """cp 1 (dp_shard 32 x tp 8): op is planned as op and written as op; no note."""
    tables, header, cfg, back = _export_tt(tmp_path, cp=1)
    assert cfg.training.recompute == "op"
    assert tables["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not [h for h in header if "activation_checkpoint" in h or "recompute" in h], header
    assert differences(cfg, back) == []


def test_torchtitan_export_of_a_changed_recompute_says_so(tmp_path):
    """A row that changes the recompute (full, as a search row may) is written as the plan's
    mode "full", and the header lists both of the user's keys as rewritten; no kept note."""
    tables, header, cfg, back = _export_tt(tmp_path, cp=4, training={"recompute": "full"})
    assert tables["activation_checkpoint"] == {"mode": "full"}
    src = tmp_path / "tt70-cp4.toml"
    assert (f"written otherwise than {src} (the plan's value or spelling): activation_checkpoint.mode \"selective\" "
            f"-> \"full\", activation_checkpoint.selective_ac_option \"op\" -> dropped") in header
    assert not [h for h in header if "kept as written" in h]
    assert back.training.recompute == "full" and differences(cfg, back) == []
