"""The HF Trainer's "auto" values in a DeepSpeed JSON (newcomer trial 7, issue 11): read as the
Trainer fills them (huggingface/transformers 3a80c16 ``integrations/deepspeed.py``,
``HfTrainerDeepSpeedConfig.trainer_config_finalize``: reduce_bucket_size = h^2,
stage3_prefetch_bucket_size = int(0.9 h^2), stage3_param_persistence_threshold = 10 h; the batch
from the Trainer's command line), and written back as "auto" on export."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.export_formats import UserFile
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan

H = 4096  # llama3-8b's hidden size
OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096, micro_batch=1, grad_accum=16)
HF = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "gradient_clipping": "auto", "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                            "stage3_param_persistence_threshold": "auto"}}
#: ``meshplan search`` of HF on OPTS's workload, its batch flags included.
CLI_OPTS = ["--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096", "--micro-batch", "1",
            "--grad-accum", "16"]


def _write(tmp_path, doc, name="hf"):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return path


def test_auto_reads_as_the_hf_trainer_fills_it(tmp_path):
    """h = 4096: bucket 4096^2 = 16,777,216 and prefetch int(0.9 x 4096^2) = int(15,099,494.4) =
    15,099,494 elements, said in one note line; the batch from --micro-batch 1 --grad-accum 16 on 16
    GPUs: 1 x 16 x 16 = 256. The ipg buffer (contiguous_gradients, DeepSpeed's default) is then
    16,777,216 x 2 B (bf16) = 33,554,432 B, where DeepSpeed's own default bucket made it 5e8 x 2 B:
    the peak is lower by 2 x (5e8 - 16,777,216) = 966,445,568 B."""
    cfg = load_any(_write(tmp_path, HF), opts=OPTS)
    assert (cfg.training.global_batch, cfg.training.micro_batch, cfg.training.grad_clip) == (256, 1, True)
    assert (cfg.memory.grad_bucket_elements, cfg.memory.deepspeed_prefetch_elements) == (16_777_216, 15_099_494)
    line = [n for n in cfg.notes if '"auto"' in n]
    assert line == ['deepspeed: DeepSpeed "auto" read as the HF Trainer fills it (h = 4096, the model\'s hidden size): '
                    'reduce_bucket_size = h^2 = 16,777,216, stage3_prefetch_bucket_size = int(0.9 h^2) = 15,099,494, '
                    'stage3_param_persistence_threshold = 10 h = 40,960 (not modelled)']
    peak = lambda c: build_plan(c).timeline.peak.total_bytes
    no_ipg = dataclasses.replace(cfg, training=cfg.training.model_copy(update={"contiguous_gradients": False}))
    assert peak(cfg) - peak(no_ipg) == H * H * 2
    defaults = dataclasses.replace(cfg, memory=cfg.memory.model_copy(update={"grad_bucket_elements": None,
                                                                          "deepspeed_prefetch_elements": None}))
    assert peak(defaults) - peak(cfg) == 2 * (500_000_000 - H * H) == 966_445_568


def test_stage2_fills_only_the_bucket(tmp_path):
    """At stages 0-2 the Trainer fills reduce_bucket_size alone (the stage3_ keys only under ZeRO-3)."""
    doc = HF | {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    cfg = load_any(_write(tmp_path, doc), opts=OPTS)
    assert cfg.memory.deepspeed_bucket_elements() == 16_777_216 and cfg.memory.deepspeed_prefetch_elements is None
    assert any(n.endswith("reduce_bucket_size = h^2 = 16,777,216") for n in cfg.notes)


@pytest.mark.parametrize("opts, doc, error", [
    ({"micro_batch": None, "grad_accum": None}, {}, 'train_micro_batch_size_per_gpu: "auto" is filled by the HF Trainer '
     "from its --per_device_train_batch_size; pass that value as --micro-batch N"),
    ({"grad_accum": None}, {}, 'gradient_accumulation_steps: "auto" is filled by the HF Trainer from its '
     "--gradient_accumulation_steps; pass that value as --grad-accum N"),
    ({}, {"train_micro_batch_size_per_gpu": 2}, "train_micro_batch_size_per_gpu: is 2 in the file, --micro-batch says "
     "1 (the HF Trainer refuses the mismatch); give one of them"),
    ({}, {"fp16": {"enabled": "auto"}, "bf16": {"enabled": False}}, 'fp16.enabled: "auto" is filled by the HF Trainer '
     "from its --fp16 flag (unset: false); pass --dtype fp16 (or fp32 for neither flag), or write true or false")])
def test_batch_and_dtype_auto_without_a_value_is_a_one_line_error(tmp_path, opts, doc, error):
    with pytest.raises(ConfigError) as e:
        load_any(_write(tmp_path, HF | doc), opts=dataclasses.replace(OPTS, **opts))
    assert str(e.value) == error


def test_auto_determined_by_deepspeeds_rule_needs_no_flag(tmp_path):
    """train_batch_size 256 and gradient_accumulation_steps 16 on 16 GPUs give the micro-batch, 1."""
    doc = HF | {"train_batch_size": 256, "gradient_accumulation_steps": 16}
    cfg = load_any(_write(tmp_path, doc), opts=dataclasses.replace(OPTS, micro_batch=None, grad_accum=None))
    assert (cfg.training.global_batch, cfg.training.micro_batch) == (256, 1)


def test_export_keeps_auto(tmp_path):
    """export --to deepspeed of the imported file writes "auto" back where it was read (bucket,
    prefetch, persistence threshold, clipping) and nothing is lost in the round trip; a plan with
    another bucket writes its number."""
    cfg = load_any(_write(tmp_path, HF), opts=OPTS)
    text, head = export(cfg, "deepspeed", "hf.json", UserFile("deepspeed", HF))
    doc = json.loads(text)
    zero = doc["zero_optimization"]
    assert [zero[k] for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size",
                              "stage3_param_persistence_threshold")] == ["auto"] * 3
    assert doc["gradient_clipping"] == "auto" and doc["optimizer"]["params"]["lr"] == "auto"
    assert not [h for h in head if h.startswith("not expressed")]
    other = dataclasses.replace(cfg, memory=cfg.memory.model_copy(update={"grad_bucket_elements": 200_000_000}))
    assert json.loads(export(other, "deepspeed", "hf.json", UserFile("deepspeed", HF))[0])[
        "zero_optimization"]["reduce_bucket_size"] == 200_000_000


def test_cli_flags_and_one_line_error(tmp_path, capsys):
    """``meshplan import`` of the HF JSON: exit 2 with one line without --micro-batch; with the
    flags, the TOML's global batch is 1 x 16 x 16 = 256 and the "auto" line is a note."""
    from meshplan.cli import main
    path = _write(tmp_path, HF)
    base = ["import", "deepspeed", str(path), "--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b",
            "--seq-len", "4096"]
    with pytest.raises(SystemExit) as done:
        main(base)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.strip().splitlines() == [
        'error: train_micro_batch_size_per_gpu: "auto" is filled by the HF Trainer from its '
        "--per_device_train_batch_size; pass that value as --micro-batch N"]
    with pytest.raises(SystemExit) as done:
        main(base + ["--micro-batch", "1", "--grad-accum", "16", "-o", str(tmp_path / "hf.toml")])
    out = capsys.readouterr().out
    assert (done.value.code or 0) == 0 and "global_batch = 256" in (tmp_path / "hf.toml").read_text()
    assert 'note: deepspeed: DeepSpeed "auto" read as the HF Trainer fills it (h = 4096' in out


@pytest.mark.parametrize("name, fmt, flag, field", [
    ("torchtitan_llama3-8b_8xh100.toml", "torchtitan", "micro_batch", "training.local_batch_size"),
    ("megatron_llama3-8b_16xh100_tp2-pp2.args", "megatron", "grad_accum", "--micro-batch-size")])
def test_batch_flags_refused_where_the_file_states_its_batch(name, fmt, flag, field):
    """Newcomer trial 9: ``--micro-batch 3`` on a torchtitan TOML planned micro-batch 1 without a
    word. The flags fill DeepSpeed's "auto" only; a torchtitan or Megatron-LM file states its own
    batch, so either flag there is a one-line error naming the file's field."""
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / name
    opts = ImportOptions(cluster="dgx-h100", nodes=2, **{flag: 3})
    with pytest.raises(ConfigError) as e:
        load_any(path, opts=opts)
    text = str(e.value)
    assert text.startswith(f"--{flag.replace('_', '-')}: only for a DeepSpeed JSON's \"auto\" batch sizes; a {fmt} ")
    assert field in text and name in text


def test_zero2_variant_of_a_zero3_auto_file_drops_stage3_keys(tmp_path, capsys):
    """Newcomer trial (issue 11 follow-up, finding 1): ``search --export N --to deepspeed`` of a
    ZeRO-2 run of the HF ZeRO-3 file kept ``stage3_param_persistence_threshold`` in the JSON and
    said ``not expressed in deepspeed: memory: {'grad_bucket_elements': 16777216,
    'deepspeed_prefetch_elements': 15099494} -> defaults``. ZeRO-2 reads no stage3_ key
    (DeepSpeed's ZeRO-3 coordinator alone does), so both are dropped, named in the header; the
    bucket, h^2 = 16,777,216, is written back as "auto" and reads back as the same number: the
    [memory] table round-trips and no line says otherwise. The search's rows are distinct meshes
    (9db001f) and this file searches one data axis, so its one row is the zero3 run; with
    ``overlap_comm`` true (as the HF Trainer's ZeRO-3 template sets it) the zero2 run is within 1% of
    the fastest step, a variant of row 1 on the line under the table, and ``--export`` takes its
    label (was: the private ``_write_export`` on a candidate of ``placed``). The exported file
    re-plans to the step the search printed for that variant. (nc52fixC: DeepSpeed ZeRO-3's overlapped
    gathers and reduce-scatters cross the 2 nodes and now hold 16 of the H100's 132 SMs beside the
    compute, row_shares.nccl_net_channels: the zero3 run 6.00 s, more than 1% over the ZeRO-1/2 runs,
    whose bucketed reductions run at the step's end beside no compute. The one row is now the zero2 run
    at micro-batch 1, 5.772 s, first by the search's tie rule among the runs within 1% (zero1 5.760 s is its variant 1a),
    so ``--export 1`` writes it: the same ZeRO-2 run of the ZeRO-3 file, the same keys dropped; as a
    row its batch keys are written as numbers, each named.)"""
    from meshplan.cli import main
    from meshplan.schedule.steptime import step_time
    doc = HF | {"zero_optimization": HF["zero_optimization"] | {"overlap_comm": True}}
    path, out, js = _write(tmp_path, doc), tmp_path / "zero2.json", tmp_path / "s.json"
    with pytest.raises(SystemExit) as done:
        main(["search", str(path), *CLI_OPTS, "--json", str(js), "--export", "1", "--to", "deepspeed",
              "-o", str(out)])
    assert (done.value.code or 0) == 0
    text = " ".join(capsys.readouterr().out.split())
    s = json.loads(js.read_text())
    zero2 = s["top"][0]
    assert [d["sharding"] for d in s["top"]] == ["zero2"] and (zero2["micro_batch"], zero2["mesh"]["dp"]) == (1, 16)
    assert [(d["label"], d["sharding"]) for d in s["top_variants"]][:1] == [("1a", "zero1")]
    assert json.loads(out.read_text())["zero_optimization"] == {"stage": 2, "reduce_bucket_size": "auto",
                                                                "overlap_comm": True}
    assert "not expressed" not in text
    assert (f"written otherwise than search {path} row 1 (the plan's value or spelling): "
            'train_batch_size "auto" -> 256') in text
    assert text.split(" wrote ")[0].endswith(
        'zero_optimization.stage 3 -> 2, zero_optimization.stage3_prefetch_bucket_size "auto" -> dropped, '
        'zero_optimization.stage3_param_persistence_threshold "auto" -> dropped')
    again = load_any(out, opts=dataclasses.replace(OPTS, micro_batch=None, grad_accum=None))
    assert again.training.sharding == "zero2" and again.memory.grad_bucket_elements == H * H
    assert step_time(build_plan(again)).step_s == pytest.approx(zero2["step_s"], rel=1e-9)
    # a format that cannot write the row: one line (torchtitan has no ZeRO-2)
    with pytest.raises(SystemExit) as done:
        main(["search", str(path), *CLI_OPTS, "--export", "1", "--to", "torchtitan", "-o", str(tmp_path / "t.toml")])
    assert done.value.code == 2 and not (tmp_path / "t.toml").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --export: row 1 cannot be written --to torchtitan: torchtitan shards with FSDP2 (zero3, hsdp) or "
        "replicates (none); sharding zero2 has no torchtitan key; none of the 1 rows shown exports --to torchtitan, "
        "or export row 1 --to megatron or deepspeed")


def test_export_past_the_one_mesh_says_why_and_what_to_do(tmp_path, capsys):
    """``--export 7`` of the HF ZeRO-3 file (one data axis: one distinct mesh, one row) said "the search
    ranked 1 row(s); raise --top or export a lower rank", though --top 10 was already past every mesh:
    the line now says the rows are every distinct mesh found to fit, and where the other settings are."""
    from meshplan.cli import main
    with pytest.raises(SystemExit) as done:
        main(["search", str(_write(tmp_path, HF)), *CLI_OPTS, "--export", "7", "--to", "deepspeed",
              "-o", str(tmp_path / "row7.json")])
    assert done.value.code == 2 and not (tmp_path / "row7.json").exists()
    err = " ".join(capsys.readouterr().err.split())
    assert ("error: --export: 7: the search lists 1 row(s), every distinct mesh it found to fit, so --top lists no "
            "more; a mesh's other settings are on the line under the table (--json top_variants), row 1's labelled 1a, "
            "1b, 1c: export a rank up to 1 or such a label, or narrow [search] (e.g. sharding) so that the setting you "
            "want is a row's") in err


def test_memory_not_expressed_is_listed_as_name_value_items(tmp_path):
    """The [memory] fields a DeepSpeed JSON does not give back are listed as ``name = A -> B``
    items (TOML's spelling, ``default`` for a field left at it), only those that differ: the
    bucket, which round-trips, is not named."""
    cfg = load_any(_write(tmp_path, HF), opts=OPTS)
    mem = dataclasses.replace(cfg, memory=cfg.memory.model_copy(update={"dropout": True,
                                                                        "fragmentation_fraction": 0.15}))
    _, head = export(mem, "deepspeed", "hf.json", UserFile("deepspeed", HF))
    assert [h for h in head if h.startswith("not expressed")] == [
        "not expressed in deepspeed: memory: fragmentation_fraction = 0.15 -> default, dropout = true -> default"]
