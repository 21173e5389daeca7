"""DeepSpeed's BF16_Optimizer (ZeRO stage 0 with bf16, BLOOM-176B's setting): its memory on one rank,
the DeepSpeed and Megatron-DeepSpeed imports that plan it, and the exports that write it back.
Read in microsoft/DeepSpeed v0.6.5 8164ea9 (``runtime/bf16_optimizer.py:130-220, 343-448``,
``runtime/engine.py:1111-1146``, ``runtime/pipe/engine.py:257-274, 766-780``) and 38327e0
(``engine.py:1008-1025, 1300-1348``, ``bf16_optimizer.py:126-200``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.deepspeed_write import write
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan

from tests.cli_run import run_cli

HERE = Path(__file__).resolve().parent
BLOOM = HERE.parent / "benchmarks" / "bloom" / "bloom-176b_384xa100_tp4-pp12-dp8.toml"
OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)

#: A one-layer model whose parameters count by hand: embedding 128 x 64 = 8,192; q, k, v 3 x 64 x 64 =
#: 12,288; o 4,096; up and down 2 x 64 x 256 = 32,768; two RMSNorms 128; final norm 64; output 8,192
#: (untied): 65,728.
SMALL = """
[model]
layers = 1
hidden = 64
ffn = 256
gated_mlp = false
q_heads = 4
vocab = 128
tied_embeddings = false
norm = "rmsnorm"
linear_bias = false

[cluster]
system = "dgx-a100"
nodes = 1

[training]
global_batch = 8
seq_len = 16
micro_batch = 1
param_dtype = "bf16"
compute_dtype = "bf16"
grad_dtype = "fp32"
sharding = "zero1"
zero12_engine = "deepspeed"
framework = "megatron"
vocab_pad_divisor = 1

[mesh]
names = ["dp"]
shape = [8]
"""


def _events(plan, phase: str, kinds=("grads", "grad_buffers")) -> list[tuple[str, int]]:
    return [(e.kind, e.delta_bytes) for e in plan.timelines[0].events() if e.phase == phase and e.kind in kinds]


def test_bf16_optimizer_memory_of_a_small_model_by_hand(tmp_path):
    """65,728 parameters (SMALL's count) at dp 8. BF16_Optimizer holds: the bf16 parameters,
    flattened, 65,728 x 2 = 131,456 B (bf16_groups_flat); the fp32 gradients of every parameter,
    65,728 x 4 = 262,912 B (fp32_groups_gradients_flat: torch.zeros_like(bf16 flat, float32), whole);
    the fp32 master of the rank's partition, 65,728 / 8 = 8,216 x 4 = 32,864 B
    (fp32_groups_flat_partition); Adam's two fp32 states of that partition, 8,216 x 8 = 65,728 B;
    and the bf16 param.grad autograd writes, kept by update_hp_grads(clear_lp_grads=False) until the
    next backward's clear_lp_grads, 65,728 x 2 = 131,456 B: 9.5 B a parameter (2 + 4 + 2 + 12 / 8),
    624,416 B. No ipg buffer in the backward (ZeRO-1's contiguous_gradients buffer is not
    BF16_Optimizer's); at the step one flattened bucket of the fp32 gradients (min(5e8, 65,728)
    elements x 4 B) and its bf16 cast (x 2 B): 394,368 B, freed after the all-reduce."""
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    cfg = load_config(path)
    assert cfg.training.bf16_optimizer
    plan = build_plan(cfg)
    state = plan.state[0]
    assert state.params.total == 65_728
    assert {i.kind: i.size_bytes for i in state.items} == {"params": 131_456, "grads": 262_912, "master": 32_864,
                                                           "optimizer": 65_728}
    init = [b for k, b in _events(plan, "init", ("params", "grads", "master", "optimizer"))]
    assert sorted(init) == sorted([131_456, 262_912, 32_864, 65_728, 131_456]) and sum(init) == 624_416
    assert not [b for k, b in _events(plan, "backward") if k == "grad_buffers" and b]
    assert _events(plan, "step", ("grad_buffers",)) == [("grad_buffers", 394_368), ("grad_buffers", -394_368)]


def test_zero1_with_bf16_gradients_is_not_bf16_optimizer(tmp_path):
    """The same TOML with grad_dtype bf16 is DeepSpeed's own ZeRO-1 (stage_1_and_2.py: param.grad in
    the model's dtype): no second copy of the gradients, 65,728 x 2 B of them; its ipg buffer (5e8 x
    2 B) and flattened bucket (65,728 x 2 B) in the backward instead of BF16_Optimizer's step bucket."""
    path = tmp_path / "z1.toml"
    path.write_text(SMALL.replace('grad_dtype = "fp32"', 'grad_dtype = "bf16"'))
    plan = build_plan(load_config(path))
    assert not plan.config.training.bf16_optimizer
    assert [b for k, b in _events(plan, "init", ("grads",))] == [131_456]
    assert ("grad_buffers", 500_000_000 * 2 + 65_728 * 2) in _events(plan, "backward")
    assert not _events(plan, "step", ("grad_buffers",))


def _json(tmp_path, name: str, d: dict):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1, **d}))
    return path


def test_import_of_a_stage0_bf16_json_plans_bf16_optimizer(tmp_path):
    """bf16 at ZeRO stage 0 (38327e0 engine.py:1017-1021: grad_accum_dtype unset is fp32 without
    ZeRO; 1347-1348: BFLOAT16), and bf16 at stage 1 with grad_accum_dtype fp32 (1316-1318), run
    BF16_Optimizer: sharding zero1 under DeepSpeed's engine, fp32 gradients, reduced in
    communication_data_type (unset bf16: engine.py:939-950). Stage 0 in fp16 stays DeepSpeed without
    ZeRO (FP16_Optimizer, full state)."""
    cfg = load_any(_json(tmp_path, "z0", {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}), opts=OPTS)
    t = cfg.training
    assert (t.sharding, t.zero12_engine, t.grad_dtype, t.gradient_reduce_dtype, t.bf16_optimizer) == (
        "zero1", "deepspeed", "fp32", "bf16", True)
    z1 = load_any(_json(tmp_path, "z1", {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                                         "data_types": {"grad_accum_dtype": "fp32"},
                                         "communication_data_type": "fp32"}), opts=OPTS).training
    assert (z1.bf16_optimizer, z1.gradient_reduce_dtype) == (True, "fp32")
    f16 = load_any(_json(tmp_path, "f16", {"zero_optimization": {"stage": 0}, "fp16": {"enabled": True}}),
                   opts=OPTS).training
    assert (f16.sharding, f16.zero0_engine, f16.bf16_optimizer) == ("none", "deepspeed", False)


def test_stage0_bf16_accumulation_in_bf16_is_one_line_error(tmp_path):
    """grad_accum_dtype bf16 at stage 0 with bf16 is BF16_Optimizer accumulating in bf16, which
    DeepSpeed refuses without its PipelineEngine (38327e0 engine.py:1333-1343) and meshplan does
    not model: a ConfigError naming the key and the fix."""
    path = _json(tmp_path, "acc", {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
                                   "data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ConfigError, match=r"data_types.grad_accum_dtype: bf16 with bf16.enabled at ZeRO stage 0 .* "
                                          r"remove it"):
        load_any(path, opts=OPTS)


def test_toml_zero0_engine_with_bf16_is_one_line_error(tmp_path, capsys):
    """A TOML of DeepSpeed without ZeRO in bf16 describes no run DeepSpeed makes (it runs
    BF16_Optimizer, or at v0.6.5 without the pipeline raises NotImplementedError, engine.py:1016-1019):
    one line naming the field and meshplan's spelling of BF16_Optimizer."""
    path = tmp_path / "z0.toml"
    path.write_text(SMALL.replace('sharding = "zero1"\nzero12_engine = "deepspeed"',
                                  'sharding = "none"\nzero0_engine = "deepspeed"'))
    rc, out, err = run_cli(["plan", str(path)], capsys)
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc != 0 and "Traceback" not in err and len(line) == 1
    assert 'zero0_engine "deepspeed" with bf16 parameters is DeepSpeed\'s BF16_Optimizer' in line[0]
    assert 'sharding = "zero1", zero12_engine = "deepspeed", grad_dtype = "fp32"' in line[0]


def test_export_round_trip_of_bf16_optimizer(tmp_path):
    """Import, export --to deepspeed, import again: ZeRO stage 0 with bf16 written back (no
    data_types, no ZeRO-1 bucket keys: BF16_Optimizer reads none), communication_data_type kept
    where given; the second import plans the same training."""
    src = _json(tmp_path, "z0", {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True},
                                 "communication_data_type": "fp32"})
    first = load_any(src, opts=OPTS)
    out = write(first)
    assert out["zero_optimization"] == {"stage": 0} and out["bf16"] == {"enabled": True}
    assert out["communication_data_type"] == "fp32" and "data_types" not in out
    again = load_any(_json(tmp_path, "again", {k: v for k, v in out.items() if k != "train_batch_size"}), opts=OPTS)
    keys = ("sharding", "zero12_engine", "grad_dtype", "gradient_reduce_dtype", "bf16_optimizer")
    assert [getattr(again.training, k) for k in keys] == [getattr(first.training, k) for k in keys]


def test_bloom_script_imports_bf16_optimizer_and_exports_stage0(tmp_path, capsys):
    """BigScience's tr11-176B-ml command (--deepspeed --zero-stage 0 --bf16, its ds config stage 0
    with bf16: "bf16 must use z0! it implements its own zero stage 1 equivalent") imports as
    BF16_Optimizer, the BLOOM benchmark's setting, and exports back as --zero-stage 0."""
    script = HERE / "data" / "megatron_deepspeed" / "tr11_176b.sh"
    toml = tmp_path / "tr11.toml"
    rc, out, err = run_cli(["import", "megatron", str(script), "--cluster", "dgx-a100", "-o", str(toml)], capsys)
    assert rc == 0, err
    t = load_config(toml).training
    bench = load_config(BLOOM).training
    keys = ("sharding", "zero12_engine", "zero0_engine", "grad_dtype", "pp_engine", "bf16_optimizer")
    assert [getattr(t, k) for k in keys] == [getattr(bench, k) for k in keys] == [
        "zero1", "deepspeed", "ddp", "fp32", "deepspeed", True]
    sh = tmp_path / "tr11_out.sh"
    rc, out, err = run_cli(["export", str(toml), "--to", "megatron", "-o", str(sh)], capsys)
    assert rc == 0, err
    text = sh.read_text()
    assert "--zero-stage 0" in text and "--zero-stage 1" not in text


def test_bloom_peak_with_bf16_optimizer():
    """BLOOM-176B's stage 0 (embedding + 5 layers at tp 4: 3,982,522,880 parameters a rank): at its
    peak the gradients are the fp32 ones and the bf16 ones, 3,982,522,880 x (4 + 2) B = 23.9e9 B
    (22.25 GiB), and it fits the A100 80GB's usable 71.3 GiB (peak 43.52 GiB; 37.96 GiB when it was
    planned as ZeRO-1 with fp32 gradients alone: + 7.42 GiB of bf16 gradients - 1.86 GiB of ZeRO-1's
    ipg buffer and bucket, 2 x 5e8 x 2 B, which BF16_Optimizer does not hold), as BigScience trained it."""
    plan = build_plan(load_config(BLOOM))
    tl = plan.timelines[0]
    assert tl.peak.by_kind["grads"] == 3_982_522_880 * 6
    assert tl.fits and tl.peak.total_bytes / 2 ** 30 == pytest.approx(43.52, abs=0.005)


def test_search_bounds_hold_bf16_optimizer_gradients(tmp_path):
    """A stage 0 bf16 JSON (Llama 3 8B, 16 H100) searched: its zero1 rows run BF16_Optimizer, whose
    bf16 gradients (8.03e9 x 2 B at dp 16, tp 1) the search's state bound now counts, so no row's
    planned peak falls outside its memory bounds (three did: 7.47e10 B planned against 5.87e10-5.91e10
    B, the 1.61e10 B of bf16 gradients missing)."""
    from meshplan.search.driver import search
    cfg = load_any(_json(tmp_path, "z0", {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}), opts=OPTS)
    notes = search(cfg.__class__(**{**cfg.__dict__, "search": cfg.search.model_copy(update={"top": 2})}),
                   workers=1).notes
    assert not [n for n in notes if "outside the memory bounds" in n]
