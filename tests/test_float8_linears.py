"""Float8 training runs the converted Linears' GEMMs in fp8 and nothing else
(``training.linear_dtype``; torchtitan's float8 converter, torchao ``Float8Linear``).

Llama 3 8B (hidden 4096, 32 heads, 8 KV heads of 128, SwiGLU 14336, vocab 128256 unpadded at
tp 1) on 8 H100, FSDP2 over dp_shard 8, from torchtitan's TOML. Per layer, by hand from the
weight shapes: Linears wq 4096 x 4096 + wk, wv 1024 x 4096 + wo 4096 x 4096 + w_gate, w_up
14336 x 4096 + w_down 4096 x 14336 = 218,103,808 elements (every dim a multiple of 16: all
converted); norms 2 x 4096 = 8,192 elements. The unit's all-gather:

- bf16 (no float8, or float8 without ``enable_fsdp_float8_all_gather``):
  (218,103,808 + 8,192) x 2 B = 436,224,000 B;
- float8 all-gather: 218,103,808 x 1 B + 8,192 x 2 B = 218,120,192 B, one uint8 buffer.

Root unit (embedding 128256 x 4096 = 525,336,576, final norm 4,096, output 525,336,576):
bf16 (2 x 525,336,576 + 4,096) x 2 B = 2,101,354,496 B; with the output converted
(``filter_fqns = []``) 525,336,576 x 3 + 4,096 x 2 = 1,576,017,920 B. Float8 scales: one fp32
amax per float8 weight, 7 x 32 = 224 -> 896 B (225 -> 900 B with the output).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.gemm import gemm_time
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.compute.embed_head import head_cost
from meshplan.compute.kernel_time import issue_floor
from meshplan.compute.layer import layer_cost
from meshplan.compute.kernel_choices import float8_gemms
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import write as megatron_args
from meshplan.plan import build_plan
from meshplan.schedule.workload import workload_of
from meshplan.spec.training import TrainingSpec

from tests.test_memory_timeline import EMBED, HEAD, LAYER, plan_of

ROOT = Path(__file__).resolve().parents[1]
TT = ROOT / "examples" / "torchtitan_llama3-8b_8xh100.toml"
MG = ROOT / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"
H100 = catalog.gpu("h100-sxm5-80gb")
LINEARS, NORMS = 218_103_808, 8_192


def titan(tmp_path, float8: bool, gather: bool = False, filters: str = '["output"]', tp: int = 1):
    """The example torchtitan TOML (Llama 3 8B, FSDP2 on 8 H100), with the float8 converter
    and [quantize.linear.float8] as asked, planned."""
    text = TT.read_text().replace("tensor_parallel_degree = 1", f"tensor_parallel_degree = {tp}")
    if float8:
        text = text.replace('flavor = "8B"\n', 'flavor = "8B"\nconverters = ["quantize.linear.float8"]\n')
        text += (f"\n[quantize.linear.float8]\nenable_fsdp_float8_all_gather = {str(gather).lower()}\n"
                 f"precompute_float8_dynamic_scale_for_fsdp = {str(gather).lower()}\nfilter_fqns = {filters}\n")
    f = tmp_path / "t.toml"
    f.write_text(text)
    return build_plan(load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1)))


def rows(plan, op, phase):
    return sorted((r.cadence, r.size_bytes, r.dtype) for r in plan.stage(0).collectives
                  if r.op == op and r.phase == phase and r.axis in ("fsdp", "dp_shard"))


def test_llama3_8b_all_gather_bytes_by_hand(tmp_path):
    # torchtitan's units: the embedding 128256 x 4096 and [norm, output] 4096 + 128256 x 4096 apart
    # (one root before: 2,101,354,496 B in bf16)
    emb, head = ("per root (embedding)", 1_050_673_152, "bf16"), ("per root (norm/output)", 1_050_681_344, "bf16")
    bf16 = [("every layer", (LINEARS + NORMS) * 2, "bf16"), emb, head]
    off = titan(tmp_path, float8=False)
    assert rows(off, "all-gather", "forward") == bf16
    # float8 GEMMs without the float8 all-gather: every weight gathered in bf16, as without float8
    # (the defect was 218,112,000 B in "fp8": norms and embeddings gathered in fp8 too)
    f8 = titan(tmp_path, float8=True)
    assert (f8.config.training.compute_dtype, f8.config.training.linear_dtype) == ("bf16", "fp8")
    assert rows(f8, "all-gather", "forward") == bf16
    assert rows(f8, "all-reduce", "step") == []
    both = titan(tmp_path, float8=True, gather=True)
    assert rows(both, "all-gather", "forward") == [("every layer", LINEARS + NORMS * 2, "uint8"), emb, head]
    assert [r[1:] for r in rows(both, "all-reduce", "step")] == [(224 * 4, "fp32")]
    out = titan(tmp_path, float8=True, gather=True, filters="[]")
    # the float8 output layer (1 B) beside the bf16 final norm: 4096 x 2 + 128256 x 4096 x 1
    assert rows(out, "all-gather", "forward")[1:] == [emb, ("per root (norm/output)", 525_344_768, "uint8")]
    assert [r[1:] for r in rows(out, "all-reduce", "step")] == [(225 * 4, "fp32")]
    # gradients are reduce-scattered in the reduce dtype (fp32) whatever the all-gather
    assert rows(both, "reduce-scatter", "backward") == rows(off, "reduce-scatter", "backward") == [
        ("every layer", (LINEARS + NORMS) * 4, "fp32"), ("per root (embedding)", 2_101_346_304, "fp32"),
        ("per root (norm/output)", 2_101_362_688, "fp32")]


def test_activations_stay_in_the_compute_dtype(tmp_path):
    # tiny model T of test_memory_timeline: its by-hand activation peak, float8 or not, plus under
    # float8 each layer's float8 input copies kept for backward (compute.float8.saved_copies, eager:
    # each Linear its own input_fp8, 1 B a value): wq, wk, wv, wo and w_up 8 x 16, w_down 8 x 64
    assert plan_of(linear_dtype="fp8").timeline.max_by_kind["activations"] == EMBED + 2 * (LAYER + 1152) + HEAD
    assert 8 * (5 * 16 + 64) == 1152
    assert plan_of().timeline.max_by_kind["activations"] == EMBED + 2 * LAYER + HEAD
    # Llama 3 8B, tp 2 with SP: the saved activations are bf16's (op-level AC: the all-gathers'
    # outputs are not saved); the reduce-scatters TP sends too (the all-gathers under tensorwise
    # scaling move float8: tests/test_float8_tp.py)
    off, f8 = titan(tmp_path, float8=False, tp=2), titan(tmp_path, float8=True, gather=True, tp=2)
    assert f8.timeline.max_by_kind["activations"] == off.timeline.max_by_kind["activations"]
    tp = {(r.op, r.size_bytes, r.dtype) for r in f8.stage(0).collectives if r.axis == "tp" and r.op == "reduce-scatter"}
    assert tp == {("reduce-scatter", 1 * 8192 * 4096 * 2, "bf16")}  # SP: b s h x 2 B
    assert tp == {(r.op, r.size_bytes, r.dtype) for r in off.stage(0).collectives if r.axis == "tp"
                  and r.op == "reduce-scatter"}


def test_gemm_dtypes_converted_linear_vs_output_head(tmp_path):
    """wq (8192 tokens x 4096 x 4096) in fp8 in all three passes; the output head (8192 x 128256
    x 4096) and the attention core in bf16 unless the output is converted."""
    p = titan(tmp_path, float8=True)
    w, model = workload_of(p), p.config.model
    ops = {(o.name, o.phase): o for o in layer_cost(model, H100, w).ops}
    for name, (m, n, k) in {"wq": (8192, 4096, 4096), "wq.dgrad": (8192, 4096, 4096),
                            "wq.wgrad": (4096, 4096, 8192)}.items():
        phase = {"wq": "forward", "wq.dgrad": "backward_input", "wq.wgrad": "backward_weight"}[name]
        assert ops[name, phase].seconds == issue_floor(H100, gemm_time(H100, m, n, k, "fp8").seconds)
        assert ops[name, phase].seconds < gemm_time(H100, m, n, k, "bf16").seconds  # fp8 is faster
    head = {o.name: o for o in head_cost(model, H100, w).ops if o.phase == "forward" and o.kind == "gemm"}
    assert head["output"].seconds == issue_floor(H100, gemm_time(H100, 8192, 128256, 4096, "bf16").seconds)
    bf16 = {(o.name, o.phase): o.seconds for o in layer_cost(model, H100, workload_of(titan(tmp_path, False))).ops}
    assert [s for (n, _), s in bf16.items() if not n.startswith("w")] == \
        [o.seconds for (n, _), o in ops.items() if not n.startswith(("w", "float8 "))]  # attention, norms, adds:
    # unchanged; torchao's casts come on top (tests/test_float8_casts.py)
    out = titan(tmp_path, float8=True, filters="[]")
    head = {o.name: o for o in head_cost(model, H100, workload_of(out)).ops if o.phase == "forward"}
    assert head["output"].seconds == issue_floor(H100, gemm_time(H100, 8192, 128256, 4096, "fp8").seconds)


def test_linears_whose_dims_are_not_multiples_of_16_stay():
    # Mixtral 8x7B's router is Linear(4096 -> 8 experts): 8 is no multiple of 16, torchtitan's
    # module_filter_fn skips it; routed experts are GroupedExperts, not Linears
    t = TrainingSpec(global_batch=8, seq_len=16, linear_dtype="fp8")
    names = float8_gemms(catalog.model("mixtral-8x7b"), t)["float8_gemms"]
    assert names == {"wq", "wk", "wv", "wo"}
    assert float8_gemms(catalog.model("mixtral-8x7b"), TrainingSpec(global_batch=8, seq_len=16)) == {}


def test_megatron_fp8_format(tmp_path):
    """--fp8-format hybrid beside --bf16: Transformer Engine's linears in fp8, activations bf16,
    the gradients reduced in fp32 as --bf16 forces (arguments.py); exported back as both flags."""
    f = tmp_path / "m.args"
    f.write_text(MG.read_text().replace("--bf16", "--bf16 --fp8-format hybrid"))
    cfg = load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=2))
    t = cfg.training
    assert (t.param_dtype, t.compute_dtype, t.linear_dtype, t.fp8_output_layer, t.gradient_reduce_dtype) == (
        "bf16", "bf16", "fp8", False, "fp32")
    args = megatron_args(cfg)
    assert "--bf16" in args and "--fp8-format hybrid" in args


def test_float8_on_a_gpu_without_fp8_is_one_line():
    with pytest.raises(ConfigError, match=r"^training.linear_dtype: a100-sxm-80gb has no fp8 peak \(float8 GEMMs "
                                          r"need fp8 tensor cores, sm89\+; its peaks: .*\); remove it or plan another "
                                          r"GPU$"):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100", "nodes": 1},
                          "training": {"global_batch": 8, "seq_len": 2048, "linear_dtype": "fp8"},
                          "mesh": {"names": ["dp_shard"], "shape": [8]}})
