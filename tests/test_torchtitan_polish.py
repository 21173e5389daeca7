"""A torchtitan user's report (Llama 3 8B, torchtitan TOML, tp 8, cp 2 or 3): vocabulary padding
only where the framework pads, ``export --to torchtitan`` carrying the user's other settings,
``training.max_norm`` read (clipping on), op-level SAC downgraded at tp > 1 exported as what
the plan modelled, and exact numbers in the sequence-parallel reason.

Expected values by hand: Llama 3's vocabulary 128256 = 2^8 x 501 divides by tp 8 (16032 rows
per rank); Megatron-LM pads it to ceil(128256 / (128 x 8)) x 1024 = 126 x 1024 = 129024 (16128
per rank); seq_len 8192 / cp 3 = 2730.67 tokens per rank.
"""

from __future__ import annotations

import tomllib

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, user_source
from meshplan.interop.foreign import load_any
from meshplan.mesh import validity
from meshplan.compute.shapes import local_shapes
from meshplan.interop.tomlout import resolved

H100x8 = ImportOptions(cluster="dgx-h100", nodes=8)

USER = """\
[job]
dump_folder = "./outputs"
description = "my 8B run"

[model]
name = "llama3"
flavor = "8B"
hf_assets_path = "./assets/hf/Llama-3.1-8B"
converters = ["quantize.linear.mx"]

[optimizer]
name = "AdamW"
lr = 3e-4

[lr_scheduler]
warmup_steps = 200

[metrics]
log_freq = 10

[training]
local_batch_size = 1
seq_len = 8192
max_norm = 0.5
steps = 1000
dataset = "c4"

[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
context_parallel_degree = 2
context_parallel_rotate_method = "allgather"

[checkpoint]
enable = true
interval = 500

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"
"""


def _user(tmp_path, text: str = USER):
    p = tmp_path / "llama3_8b.toml"
    p.write_text(text)
    return p


def _output_rows(cfg) -> int:
    return [g.n for g in local_shapes(cfg.model, cfg.training, resolved(cfg)).gemms if g.name == "output"][0]


def test_torchtitan_does_not_pad_the_vocabulary(tmp_path):
    cfg = load_any(_user(tmp_path), opts=H100x8)
    assert cfg.training.framework == "torch" and cfg.training.vocab_pad_divisor == 1
    assert _output_rows(cfg) == 128256 // 8 == 16032
    v = validity.check(cfg.model, cfg.training, resolved(cfg), cfg.mesh)
    assert not [n for n in v.notes if "vocab" in n]
    # Megatron-LM pads: 129024 rows, 16128 per rank, with its note
    tables = _tables(cfg)
    training = {k: v for k, v in tables["training"].items() if k != "vocab_pad_divisor"}
    mg = config_from_dict({**tables, "training": {**training, "framework": "megatron"}})
    assert mg.training.vocab_pad_divisor == 128 and _output_rows(mg) == 129024 // 8 == 16128
    notes = validity.check(mg.model, mg.training, resolved(mg), mg.mesh).notes
    assert "vocab padded 128256 -> 129024 = ceil(V / (128 * tp 8)) * 1024 (16128 per tp rank); memory and FLOPs " \
           "use 129024, the loss uses 128256" in notes


def test_torch_vocabulary_tp_does_not_divide_is_sharded_unevenly():
    """32002 rows over tp 8: torch.chunk gives ceil(32002 / 8) = 4001 rows to ranks 0-6 and
    32002 - 7 x 4001 = 3995 to rank 7; the plan uses the largest shard."""
    cfg = config_from_dict({"model": {"layers": 2, "hidden": 512, "ffn": 1024, "q_heads": 8, "vocab": 32002},
                            "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 1024},
                            "mesh": {"names": ["dp_shard", "tp"], "shape": [1, 8]}})
    assert _output_rows(cfg) == 4001
    notes = validity.check(cfg.model, cfg.training, resolved(cfg), cfg.mesh).notes
    assert [n for n in notes if "vocab" in n] == [
        "vocab 32002 does not divide by tp 8: the embedding and output rows are sharded unevenly (DTensor, "
        "torch.chunk: 4001 rows on the first ranks, 3995 on the last holding any); memory and FLOPs use the largest "
        "shard (4001 x tp 8 = 32008), the loss uses 32002"]


def _tables(cfg) -> dict:
    from meshplan.interop.tomlout import meshplan_tables
    return meshplan_tables(cfg)


def test_export_to_torchtitan_carries_the_users_settings(tmp_path):
    path = _user(tmp_path)
    cfg = load_any(path, opts=H100x8)
    text, head = export(cfg, "torchtitan", str(path), user_source(path))
    out = tomllib.loads(text)
    user = tomllib.loads(USER)
    for table in ("lr_scheduler", "metrics", "checkpoint"):
        assert out[table] == user[table], table
    # [optimizer]: the user's lr carried, name read and written back, the implementation the plan's
    # (unset in the user's file: today's torchtitan default, fused)
    assert out["optimizer"] == {"name": "AdamW", "lr": 3e-4, "implementation": "fused"}
    assert out["job"] == user["job"]  # the user's description kept
    assert (out["training"]["steps"], out["training"]["dataset"], out["training"]["max_norm"]) == (1000, "c4", 0.5)
    assert out["model"]["hf_assets_path"] == "./assets/hf/Llama-3.1-8B"
    assert out["model"]["converters"] == ["quantize.linear.mx"]  # not modelled, still the user's
    assert out["parallelism"]["context_parallel_rotate_method"] == "allgather"
    # what meshplan planned: dp_shard 64 / (cp 2 x tp 8) = 4, global batch 1 x 4
    assert (out["parallelism"]["data_parallel_shard_degree"], out["training"]["global_batch_size"]) == (4, 4)
    # [checkpoint] (enable, interval: all it holds) is read as [reliability] checkpoint_interval_steps 500
    # and written back as the plan's (the same table, above), so no longer "carried unchanged"
    assert (f"carried unchanged from {path}: [lr_scheduler], [metrics], job.dump_folder, "
            "job.description, model.hf_assets_path, optimizer.lr, training.max_norm, training.steps, training.dataset, "
            "parallelism.context_parallel_rotate_method, model.converters ['quantize.linear.mx']") in head
    # the re-import of the carried file gives the same plan: the user's op-level SAC is kept as written
    # (planned at cp 2 as Megatron-LM's selective, which it reads back as), with a note (exportkeep)
    assert [h for h in head if h.startswith("not expressed")] == []
    assert out["activation_checkpoint"] == user["activation_checkpoint"]
    assert [h for h in head if h.startswith("note: activation_checkpoint kept as written")]


def test_export_from_torchtitan_to_megatron_lists_what_is_not_carried(tmp_path):
    path = _user(tmp_path)
    cfg = load_any(path, opts=H100x8)
    text, head = export(cfg, "megatron", str(path), user_source(path))
    line = [h for h in head if h.startswith("not carried to megatron")]
    # [checkpoint] (enable = true, interval = 500) is carried, as --save-interval 500 (roundtrip item 2)
    assert "--save-interval 500" in text.splitlines()
    assert line == ["not carried to megatron: the torchtitan settings meshplan does not plan: [job], "
                    "[lr_scheduler], [metrics], model.hf_assets_path, optimizer.lr, "
                    "training.max_norm, training.steps, training.dataset, "
                    "parallelism.context_parallel_rotate_method, model.converters ['quantize.linear.mx']"]


def test_export_of_a_meshplan_toml_carries_nothing(tmp_path):
    path = _user(tmp_path)
    mine = tmp_path / "plan.toml"
    from meshplan.interop.tomlout import dumps
    mine.write_text(dumps(_tables(load_any(path, opts=H100x8))))
    assert user_source(mine) is None
    text, head = export(load_any(mine), "torchtitan", str(mine), user_source(mine))
    # [optimizer]: what the plan says (AdamW as imported, the fused step), written, not carried
    assert tomllib.loads(text)["optimizer"] == {"implementation": "fused", "name": "AdamW"}
    assert not [h for h in head if "carried" in h]


def test_max_norm_is_read_as_clipping(tmp_path):
    """torchtitan's train step calls clip_grad_norm_ every step whatever max_norm is (the norm,
    then a multiply by min(max_norm / norm, 1)): read as grad_clip, not listed as unused."""
    cfg = load_any(_user(tmp_path), opts=H100x8)
    assert cfg.training.grad_clip
    assert not [n for n in cfg.notes if "training.max_norm" in n]
    assert "training.steps" in cfg.notes[-1]  # the unused list is still there
    with pytest.raises(ConfigError, match=r"^training.max_norm: 'one'; give the gradient-norm bound"):
        load_any(_user(tmp_path, USER.replace("max_norm = 0.5", 'max_norm = "one"')), opts=H100x8)


def test_op_sac_downgraded_at_cp_is_kept_from_the_users_file(tmp_path):
    """selective_ac_option "op" at cp 2 is planned as Megatron-LM's selective recompute (the
    import says so). Exported with the user's file, the file keeps "op" as the user wrote it, with
    a note on what the plan assumed (exportkeep: it wrote mode "none" before); without it (the
    plan alone) the export writes what keeps what the plan kept, "none" with flash attention
    (the same activations but the flash softmax statistics), and a note."""
    path = _user(tmp_path)
    cfg = load_any(path, opts=H100x8)
    assert cfg.training.recompute == "selective"
    text, head = export(cfg, "torchtitan", str(path), user_source(path))
    assert tomllib.loads(text)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert [h for h in head if h.startswith("note: activation_checkpoint kept as written") and h.endswith("cp 2")]
    assert not [h for h in head if h.startswith("note: the plan modelled Megatron-LM's selective recompute")]
    text, head = export(cfg, "torchtitan", str(path))
    assert tomllib.loads(text)["activation_checkpoint"] == {"mode": "none"}
    assert any(h.startswith("note: the plan modelled Megatron-LM's selective recompute (attention core only)")
               and 'written as mode = "none"' in h for h in head)
    # at tp = cp = 1 op-level SAC is planned, and written back as it was
    tp1 = _user(tmp_path, USER.replace("tensor_parallel_degree = 8", "tensor_parallel_degree = 1")
                .replace("context_parallel_degree = 2", "context_parallel_degree = 1"))
    cfg1 = load_any(tp1, opts=H100x8)
    text1, head1 = export(cfg1, "torchtitan", str(tp1), user_source(tp1))
    assert cfg1.training.recompute == "op"
    assert tomllib.loads(text1)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert not [h for h in head1 if h.startswith("note:") or h.startswith("not expressed")]


def test_cp3_reason_prints_the_exact_local_sequence(tmp_path):
    """tp 8 x cp 3 on 72 GPUs: 8192 / 3 = 2730.67 tokens per rank (not floored to 2730)."""
    path = _user(tmp_path, USER.replace("context_parallel_degree = 2", "context_parallel_degree = 3"))
    cfg = load_any(path, opts=ImportOptions(cluster="dgx-h100", nodes=9))
    reasons = validity.check(cfg.model, cfg.training, resolved(cfg), cfg.mesh).reasons
    assert "sequence parallel: local seq = seq_len 8192 / cp 3 = 2730.67 is not a multiple of tp 8" in reasons
    assert not [r for r in reasons if "2730 " in r or "2730)" in r]


def _optimizer_ms(cfg) -> float:
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    st = step_time(build_plan(cfg))
    return sum(e.end_s - e.start_s for e in st.post_events if e.stage == 0 and e.name == "optimizer step") * 1e3


def test_optimizer_implementation_is_read_and_priced(tmp_path):
    """[optimizer] implementation (torchtitan 820504e on, default "fused") or the older fused flag
    (9dec370: default false, ``foreach = not fused``). Per parameter of the rank, fp32 params,
    gradients and both moments (torchtitan's FSDP2, no master copy): clip_grad_norm_ 12 B (norm
    read 4, scale read + write 8); fused AdamW one pass, read p, g, m, v and write p, m, v: 28 B;
    foreach AdamW eight passes (torch ``_multi_tensor_adam``): decay mul_ on p 8, lerp_ m with g
    12, mul_ v 8, addcmul_ v with g 12, sqrt v -> t 8, div_ t 8, add t 8, addcdiv_ p with m, t 16:
    80 B. So the step is 40 B against 92 B a parameter, the same Triad: 2.3 x as long."""
    base = USER.replace("tensor_parallel_degree = 8", "tensor_parallel_degree = 1") \
        .replace("context_parallel_degree = 2", "context_parallel_degree = 1")
    fused = load_any(_user(tmp_path, base), opts=H100x8)
    assert (fused.training.optimizer, fused.training.optimizer_impl) == ("adamw", "fused")  # today's default
    old = load_any(_user(tmp_path, base.replace('name = "AdamW"', 'name = "AdamW"\nfused = false')), opts=H100x8)
    new = load_any(_user(tmp_path, base.replace('name = "AdamW"', 'name = "AdamW"\nimplementation = "foreach"')),
                   opts=H100x8)
    assert old.training.optimizer_impl == new.training.optimizer_impl == "foreach"
    assert _optimizer_ms(new) / _optimizer_ms(fused) == pytest.approx(92 / 40, rel=1e-9)
    with pytest.raises(ConfigError, match=r"^optimizer.fused: torchtitan before 2025 read it"):
        load_any(_user(tmp_path, base.replace('name = "AdamW"', 'fused = true\nimplementation = "fused"')),
                 opts=H100x8)
    with pytest.raises(ConfigError, match=r"^optimizer.implementation: 'for-loop' is not modelled"):
        load_any(_user(tmp_path, base.replace('name = "AdamW"', 'implementation = "for-loop"')), opts=H100x8)
    path = _user(tmp_path, base.replace('name = "AdamW"', 'name = "AdamW"\nfused = false'))
    text, _ = export(load_any(path, opts=H100x8), "torchtitan", str(path), user_source(path))
    assert tomllib.loads(text)["optimizer"] == {"name": "AdamW", "lr": 3e-4, "implementation": "foreach"}


@pytest.mark.parametrize("ac, field, message", [
    ({"mode": "selectiv"}, "activation_checkpoint.mode",
     "'selectiv': did you mean 'selective'? use none, selective or full"),
    ({"mode": "ful"}, "activation_checkpoint.mode", "'ful': did you mean 'full'? use none, selective or full"),
    ({"mode": "memory_budget"}, "activation_checkpoint.mode",  # torchtitan's, not a typo: no guess
     "'memory_budget': not planned by meshplan; use none, selective or full"),
    ({"mode": "selective", "selective_ac_option": "opp"}, "activation_checkpoint.selective_ac_option",
     "'opp'; did you mean 'op'? use \"op\" or a whole number k >= 1 (every k-th layer checkpointed in full)"),
])
def test_activation_checkpoint_typos_get_did_you_mean(ac, field, message):
    """Newcomer finding: mode = "selectiv" got no "did you mean", as the catalog names and mesh axes do."""
    from meshplan.interop.torchtitan_tables import read_recompute
    with pytest.raises(ConfigError) as e:
        read_recompute({"activation_checkpoint": ac}, {}, False, [])
    assert (e.value.field, e.value.message) == (field, message)
