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
from meshplan.interop.export import export, user_source
from meshplan.interop.foreign import load_any
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
    """cp 4: the import plans op-level SAC as Megatron-LM's selective (op is planned at cp = 1
    only; ep and MLA since newcomer trial 48); the export wrote that as mode "none" and listed mode and selective_ac_option as
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
        "as op-level SAC is planned with cp = 1 only and this mesh has cp 4"]
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


#: A DeepSpeed ZeRO-3 config whose activation_checkpointing section (read as recompute full) sets
#: every one of deepspeed.checkpointing's keys (the trial's ds_z3.json).
DS_Z3 = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
         "zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True},
         "gradient_clipping": 1.0, "steps_per_print": 10,
         "activation_checkpointing": {"partition_activations": False, "contiguous_memory_optimization": False,
                                      "cpu_checkpointing": False, "number_checkpoints": None,
                                      "synchronize_checkpoint_boundary": False, "profile": False}}
DS_OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
SECTION = "activation_checkpointing"


def _export_ds(tmp_path: Path, user: dict, recompute: str, ac_freq: int = 1):
    """(written JSON, header, the row's config, the config read back) of ``export --to deepspeed``
    of ``user`` at ``recompute`` (a search row's), with the user's file."""
    import json
    from meshplan.interop.export import reimport_options
    src = tmp_path / "ds_z3.json"
    src.write_text(json.dumps(user))
    cfg = load_any(src, "deepspeed", DS_OPTS)
    row = replace(cfg, training=cfg.training.model_copy(update={"recompute": recompute, "ac_freq": ac_freq}))
    text, header = export(row, "deepspeed", f"search {src} row 1", user_source(src))
    out = tmp_path / "top.json"
    out.write_text(text)
    return json.loads(text), header, row, load_any(out, "deepspeed", reimport_options(row, "deepspeed"))


def test_deepspeed_row_without_recompute_says_the_model_code_decides(tmp_path):
    """Row 1 at recompute none from a config with a section (full): the file has no section (one
    would read back as full), the header's one model-code line says to remove the checkpoint
    calls and why the section's settings went; the file reads back as the row."""
    doc, header, row, back = _export_ds(tmp_path, DS_Z3, "none")
    assert SECTION not in doc
    assert [h for h in header if h.startswith("model code:")] == [
        "model code: recompute none here, full in the DeepSpeed config (its activation_checkpointing section); the "
        "JSON does not turn activation checkpointing off, the model code does: remove its "
        "deepspeed.checkpointing.checkpoint calls (Megatron-DeepSpeed: drop --checkpoint-activations); the section's "
        "settings are dropped: they configure only those calls, and a section reads back as recompute full"]
    assert back.training.recompute == "none" and differences(row, back) == []
    assert not [h for h in header if h.startswith("not expressed")], header


def test_deepspeed_row_with_full_recompute_from_none(tmp_path):
    """The other way: a config without a section (none), a row at full: no section written (no
    DeepSpeed key turns checkpointing on; newcomer trial nc52 #8: the empty section written before
    is ignored by the HF Trainer), the header's one line says where it is set (the HF Trainer's
    --gradient_checkpointing, or deepspeed.checkpointing calls in other model code); read back as
    full with --gradient-checkpointing (reimport_options)."""
    user = {k: v for k, v in DS_Z3.items() if k != SECTION}
    doc, header, row, back = _export_ds(tmp_path, user, "full")
    assert SECTION not in doc and not [h for h in header if h.startswith("model code:")]
    assert [h.split(":")[0] for h in header if "is not a DeepSpeed JSON key" in h] == [
        "activation checkpointing (recompute full) is not a DeepSpeed JSON key"]
    assert back.training.recompute == "full" and differences(row, back) == []


def test_deepspeed_keeps_the_section_where_its_calls_remain(tmp_path):
    """Unchanged (full) the section is carried whole and no line is added; at every 2nd layer the
    model code still calls deepspeed.checkpointing.checkpoint, which the section configures: kept
    (the policy itself is not expressed by the JSON, its own header line says so); no model-code
    line, which is for the none/full switch the file states."""
    doc, header, row, back = _export_ds(tmp_path, DS_Z3, "full")
    assert doc[SECTION] == DS_Z3[SECTION] and not [h for h in header if h.startswith(("model code:", "written"))]
    assert differences(row, back) == []
    doc, header, row, back = _export_ds(tmp_path, DS_Z3, "layer", ac_freq=2)
    assert doc[SECTION] == DS_Z3[SECTION] and not [h for h in header if h.startswith(("model code:", "written"))]
    assert [h.split(" (")[0] for h in header if h.startswith("not expressed")] == [
        "not expressed in deepspeed: training.recompute: 'layer' -> 'full'",
        "not expressed in deepspeed: training.ac_freq: 2 -> 1"]


def _moe_toml(tmp_path: Path, rope: str) -> Path:
    """A meshplan TOML of a Mixtral-like model given by its fields (catalog mixtral-8x7b's layout),
    ``rope`` its rope_theta line or nothing, under Megatron-LM (ep 8 over dp_shard 32)."""
    p = tmp_path / "moe.toml"
    p.write_text('[model]\nname = "my-moe"\nlayers = 32\nhidden = 4096\nffn = 14336\ngated_mlp = true\nq_heads = 32\n'
                 'kv_heads = 8\nhead_dim = 128\nvocab = 32000\ntied_embeddings = false\nnorm = "rmsnorm"\n'
                 f'position_embedding = "rope"\nmax_position = 32768\nnorm_eps = 1e-05\nexperts = 8\ntop_k = 2\n{rope}'
                 '[cluster]\nsystem = "dgx-h100"\nnodes = 4\n[training]\nglobal_batch = 256\nseq_len = 4096\n'
                 'micro_batch = 1\nsharding = "zero3"\nrecompute = "full"\nframework = "megatron"\nparam_dtype = "bf16"\n'
                 '[mesh]\nnames = ["dp_shard", "ep"]\nshape = [32, 8]\n')
    return p


def test_megatron_export_prints_no_rope_change_it_does_not_write(tmp_path):
    """Without model.rope_theta the export writes no --rotary-base (Megatron-LM runs its default,
    arguments.py ``--rotary-base`` type int, default 10000); the header printed
    ``model.rope_theta: None -> 1000000.0`` from the re-import's catalog match (mixtral-8x7b's
    layout), a change no flag wrote: now nothing. The re-import says so in its own note, and
    every other field comes back the same."""
    from meshplan.config import load_config
    from meshplan.interop.export import reimport_options
    cfg = load_config(_moe_toml(tmp_path, ""))
    text, header = export(cfg, "megatron", "moe.toml")
    assert "--rotary-base" not in text and not [h for h in header if "rope" in h], header
    assert not [h for h in header if h.startswith("not expressed")], header
    out = tmp_path / "moe.args"
    out.write_text(text)
    back = load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert [d.split(":")[0] for d in differences(cfg, back)] == ["model.rope_theta"]
    assert [n for n in back.notes if "--rotary-base (Megatron-LM's default 10000; mixtral-8x7b: 1e+06)" in n]


def test_megatron_export_writes_a_given_rope_theta(tmp_path):
    """model.rope_theta 1e6 given: ``--rotary-base 1000000`` written, read back as the same."""
    from meshplan.config import load_config
    from meshplan.interop.export import reimport_options
    cfg = load_config(_moe_toml(tmp_path, "rope_theta = 1000000.0\n"))
    text, header = export(cfg, "megatron", "moe.toml")
    assert "--rotary-base 1000000" in text.splitlines() and not [h for h in header if "rope" in h], header
    out = tmp_path / "moe.args"
    out.write_text(text)
    back = load_any(out, "megatron", reimport_options(cfg, "megatron"))
    assert back.model.rope_theta == 1e6 and differences(cfg, back) == []
