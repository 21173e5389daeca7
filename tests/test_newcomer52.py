"""Newcomer trial 52 (a Megatron-DeepSpeed user planning Llama-3-70B on A100 40GB and H100):
Megatron-DeepSpeed's own model flags read as its parser reads them (microsoft/Megatron-DeepSpeed
f4157be ``megatron/arguments.py``), its spellings written back by ``export`` and ``launch``, its
``--use-flash-attn-v2`` timed as FlashAttention-2, and notes that say which parser a flag belongs to."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop import megatron
from meshplan.interop.common import ImportOptions
from tests.cli_run import run_cli

DATA = Path(__file__).resolve().parent / "data" / "nc52"
#: The trial's script (tests/data/nc52/mds_pretrain_a100_vocab_rmsnorm.sh): Llama-3-70B's shape in
#: Megatron-DeepSpeed's flags, 4 x 8 A100 40GB, tp 8 x pp 4, --deepspeed --zero-stage 1 with ds_mds.json.
SCRIPT = (DATA / "mds_pretrain_a100_vocab_rmsnorm.sh").read_text()
OPTS = ImportOptions(cluster="dgx-a100-40gb")


def _read(text: str):
    return megatron.read(text, OPTS, DATA)


def test_megatron_deepspeed_gqa_rope_and_rmsnorm_give_llama3_70b():
    """--num-key-value-heads 8 (arguments.py:623), --use-rotary-position-embeddings (630; parse_args
    then drops the learned table, 314-317) and --normalization rmsnorm (647-648) are Llama-3-70B's
    GQA, RoPE and RMSNorm. By hand, per layer: q and o 2 x 8192^2 = 134,217,728, k and v 2 x 8192 x
    (8 x 128) = 16,777,216, the gated MLP 3 x 8192 x 28672 = 704,643,072, two norms 16,384:
    855,654,400 (the trial's per-layer all-gather, 1,711,308,800 B / 2); x 80 = 68,452,352,000,
    plus untied embedding and output 2 x 128256 x 8192 = 2,101,346,304 and the final norm 8192:
    70,553,706,496. Read as the trial found it (kv 64, a learned 4096 x 8192 table) it was
    79.98 B: k and v 2 x 8192 x 7168 x 80 = 9,395,240,960 more, and 33,554,432 positions."""
    imported = _read(SCRIPT)
    cfg = config_from_dict(imported.tables)
    m = cfg.model
    assert (m.q_heads, m.kv_heads, m.norm, m.position_embedding) == (64, 8, "rmsnorm", "rope")
    assert m.param_count() == 70_553_706_496
    unused = " ".join(imported.unused)
    for flag in ("--num-key-value-heads", "--use-rotary-position-embeddings"):
        assert flag not in unused


def test_megatron_lm_s_legacy_rotary_switch_is_rope():
    """Megatron-LM d98e8a6 keeps --use-rotary-position-embeddings as a legacy switch that sets the
    position type to rope (megatron/training/arguments.py:1626-1627): read so there too, not a
    learned table (llama3-8b's 8192 x 4096 = 33,554,432 parameters more)."""
    text = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 128256 --seq-length 8192 "
            "--max-position-embeddings 8192 --use-rotary-position-embeddings --micro-batch-size 1 --bf16")
    model = megatron.read(text, ImportOptions(cluster="dgx-h100", nodes=1)).tables["model"]
    assert model["position_embedding"] == "rope"


@pytest.mark.parametrize("old, new, field, fix", [
    ("--normalization rmsnorm", "--normalization RMSNorm", "--normalization", "write --normalization rmsnorm"),
    ("--num-key-value-heads 8", "--group-query-attention --num-query-groups 8", "--group-query-attention",
     "write --num-key-value-heads N"),
    ("--use-rotary-position-embeddings", "--position-embedding-type rope", "--position-embedding-type",
     "--use-rotary-position-embeddings"),
    ("--swiglu", "--swiglu --num-experts 8", "--num-experts", "DeepSpeed-MoE"),
])
def test_megatron_lm_spellings_in_a_megatron_deepspeed_script_are_errors(old, new, field, fix):
    """Megatron-DeepSpeed's parse_args is strict (arguments.py:57-60) and its choices are lower case
    (647-648): Megatron-LM's spellings stop every rank, so the import says which flag and its
    spelling; DeepSpeed-MoE's --num-experts (experts every --expert-interval-th layer) is not a
    model meshplan plans, and is refused rather than read as Megatron-LM's MoE."""
    assert old in SCRIPT
    with pytest.raises(ConfigError) as e:
        _read(SCRIPT.replace(old, new))
    assert e.value.field == field and fix in e.value.message


def test_trial_script_with_megatron_lm_norm_spelling_is_one_error_line(tmp_path, capsys):
    """The trial's first script gave --normalization RMSNorm to Megatron-DeepSpeed (which refuses it)
    and planned 64/64 kv heads silently; now one error line names the flag and the fix."""
    path = tmp_path / "mds_pretrain_a100_novocabmodel.sh"
    path.write_text(SCRIPT.replace("--normalization rmsnorm", "--normalization RMSNorm"))
    rc, out, err = run_cli(["plan", str(path), "--cluster", "dgx-a100-40gb"], capsys)
    assert rc != 0 and err.count("\n") == 1
    assert err.startswith("error: --normalization: 'RMSNorm' is Megatron-LM's spelling") and "rmsnorm" in err


def _launched_flags(tmp_path, capsys, job: Path) -> list[str]:
    """The ``--flags`` ``meshplan launch`` appends after ``python pretrain_gpt.py`` in torchrun.sh."""
    rc, out, err = run_cli(["launch", str(job), "--out", str(tmp_path / "l"), "--", "python", "pretrain_gpt.py"],
                           capsys)
    assert rc == 0, err
    line = next(w for w in (tmp_path / "l" / "torchrun.sh").read_text().splitlines() if "pretrain_gpt.py" in w)
    return [w for w in line.split("pretrain_gpt.py", 1)[1].split() if w.startswith("--")]


def test_launch_of_a_megatron_deepspeed_plan_writes_only_its_parser_s_flags(tmp_path, capsys):
    """The trial's H100 plan (tests/data/nc52/job_mds_h100.toml: framework megatron, zero1 under
    DeepSpeed's engine with fp32 gradients, i.e. BF16_Optimizer, --deepspeed --zero-stage 0) was
    launched with --normalization RMSNorm, --position-embedding-type rope, --group-query-attention,
    --num-query-groups, --rotary-base, --norm-epsilon and --context-parallel-size, none of which
    Megatron-DeepSpeed f4157be's strict parser has (arguments.py:57-60): every rank would stop. Now
    every appended flag is one of its 320 (tools/megatron_deepspeed_flag_list.py), Llama-3-70B's
    model spelt its way (kv 8, RoPE base 500000, RMSNorm eps 1e-5), FlashAttention-2 as
    --use-flash-attn-v2 (its --use-flash-attn is FA1, arguments.py:927)."""
    from meshplan.interop.megatron_deepspeed_args import mds_flags
    words = _launched_flags(tmp_path, capsys, DATA / "job_mds_h100.toml")
    assert [w for w in words if w not in mds_flags()[0]] == []
    for flag in ("--num-key-value-heads", "--use-rotary-position-embeddings", "--rotary-position-embeddings-theta",
                 "--layernorm-epsilon", "--use-flash-attn-v2", "--normalization"):
        assert words.count(flag) == 1, flag
    assert "--use-flash-attn" not in words and "--context-parallel-size" not in words


def test_megatron_deepspeed_export_reads_back_the_same_model(tmp_path, capsys):
    """export --to megatron of the Megatron-DeepSpeed plan, imported back: the same Llama-3-70B
    (64/8 heads, RoPE 500000, RMSNorm), no 'not expressed' line for the model."""
    out = tmp_path / "mds.args"
    rc, _, err = run_cli(["export", str(DATA / "job_mds_h100.toml"), "--to", "megatron", "-o", str(out)], capsys)
    assert rc == 0, err
    text = out.read_text()
    assert "not expressed in megatron: model" not in text and "--normalization rmsnorm" in text
    imported = megatron.read(text, ImportOptions(cluster="dgx-h100", nodes=32))
    assert imported.tables["model"]["catalog"] == "llama3-70b"


@pytest.mark.parametrize("update, field", [({"training": {"tp_comm_overlap": True}}, "training.tp_comm_overlap"),
                                           ({"mesh": {"names": ["pp", "dp", "cp", "tp"], "shape": [4, 4, 2, 8]}},
                                            "mesh.cp")])
def test_megatron_deepspeed_export_refuses_what_its_parser_lacks(tmp_path, capsys, update, field):
    """Megatron-DeepSpeed has no --tp-comm-overlap and no --context-parallel-size (neither is in
    f4157be megatron/arguments.py): export refuses in one line naming the field."""
    import tomllib
    from meshplan.interop.tomlout import dumps
    doc = tomllib.loads((DATA / "job_mds_h100.toml").read_text())
    doc.pop("source", None)
    for table, keys in update.items():
        doc[table] |= keys
    job = tmp_path / "job.toml"
    job.write_text(dumps(doc, ()))
    rc, _, err = run_cli(["export", str(job), "--to", "megatron", "-o", "-"], capsys)
    assert rc != 0 and err.startswith(f"error: {field}") and err.count("\n") == 1


def test_search_and_step_hint_no_tp_comm_overlap_for_megatron_deepspeed():
    """The search varies tp_comm_overlap under Megatron-LM only, not Megatron-DeepSpeed (no such
    flag): the trial's step hint and search row 1 recommended --tp-comm-overlap."""
    from meshplan.config import load_config
    from meshplan.search.space import overlap_searched
    cfg = load_config(DATA / "job_mds_h100.toml")
    assert cfg.training.megatron_deepspeed and not overlap_searched(cfg.training)
    lm = cfg.training.model_copy(update={"zero12_engine": "megatron", "grad_dtype": None, "pp_engine": "framework"})
    assert overlap_searched(lm)


def test_step_of_megatron_deepspeed_hints_no_tp_comm_overlap(capsys):
    """The trial's step_mds_h100.txt: 'hint: exposed tp is 20.4% of the step ... shorter with
    training.tp_comm_overlap = true (Megatron-LM's --tp-comm-overlap ...)': a knob its runtime lacks."""
    rc, out, err = run_cli(["step", str(DATA / "job_mds_h100.toml")], capsys)
    assert rc == 0, err
    assert "exposed tp" in out and "hint: exposed tp" not in out and "tp_comm_overlap" not in out


def test_megatron_deepspeed_flash_attention_is_timed_as_flash_attention_2():
    """Megatron-DeepSpeed's --use-flash-attn-v2 calls flash_attn.flash_attn_interface.flash_attn_varlen_func
    (f4157be megatron/model/transformer.py:50-55, 409), FlashAttention-2, not Transformer Engine's
    fused attention: on an H100 the causal head-dim-128 row read is FA2's, where the same plan
    under Megatron-LM's engines (distributed optimizer, no DeepSpeed) reads the catalog's FA3."""
    from meshplan.compute.measured import attention_kernel, kernel_data
    from meshplan.compute.kernel_choices import framework_kernels
    from meshplan.config import load_config
    t = load_config(DATA / "job_mds_h100.toml").training
    lm = t.model_copy(update={"zero12_engine": "megatron", "grad_dtype": None, "pp_engine": "framework"})
    h100 = kernel_data("h100-sxm5-80gb")
    assert attention_kernel(h100, 128, framework_kernels(t)["attention_kernels"]) == "FA2"
    assert attention_kernel(h100, 128, framework_kernels(lm)["attention_kernels"]) == "FA3"


def test_megatron_deepspeed_notes_name_its_parser_not_megatron_lm_s():
    """Trial 52 #15: the notes called --num-key-value-heads, --use-flash-attn-v2 and --deepspeed_config
    'not flags of Megatron-LM ... its parser refuses them' in a script read as Megatron-DeepSpeed's,
    whose parser defines them (f4157be megatron/arguments.py:623, 930; DeepSpeed's add_config_arguments),
    and listed --use-flash-attn-v2 as unused while it set flash_attention. Now the foreign-flag note
    is Megatron-DeepSpeed's (a Megatron-LM-only flag such as --tp-comm-overlap is named), the flash
    switch is read, not unused, and the RoPE-base note names its --rotary-position-embeddings-theta
    (default 10000, arguments.py:634-636)."""
    imported = _read(SCRIPT.replace("--sequence-parallel", "--sequence-parallel --tp-comm-overlap"))
    notes = "\n".join(imported.notes)
    assert "not flags of Megatron-LM" not in notes and "--use-flash-attn-v2" not in " ".join(imported.unused)
    foreign = [n for n in imported.notes if n.startswith("not flags of microsoft/Megatron-DeepSpeed f4157be")]
    assert foreign == ["not flags of microsoft/Megatron-DeepSpeed f4157be: --tp-comm-overlap (its parser refuses "
                       "them; BigScience's fork or your training script may add them)"]
    assert imported.tables["training"]["flash_attention"] is True
    assert "add --rotary-position-embeddings-theta 500000 to train it" in notes and "--rotary-base" not in notes
