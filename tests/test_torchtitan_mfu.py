"""``step``'s "torchtitan's MFU formula" line and ``--json`` ``torchtitan_mfu``: the MFU torchtitan v0.2.2
(e347b1e) would log for the predicted step, derived here by hand from its formula
(``models/utils.py``:388-431, ``components/metrics.py``:421-428, ``tools/utils.py``:77-144)."""

from __future__ import annotations

import pytest

from configs import NC29_FP8_TOML, job_toml, nc29_bf16_toml
from cli_run import run_cli, step_json as _step
from meshplan.compute.flops import torchtitan_flops_per_token, torchtitan_peak_flops
from meshplan.spec.model import ModelSpec

#: Llama-3-8B's shape at 2 layers, seq 2048, on one DGX H100 as dp_shard 8.
#: Per layer: wq 4096 x 4096 = 16,777,216; wk + wv 2 x 4096 x 1024 = 8,388,608; wo 16,777,216;
#: w1, w2, w3 3 x 4096 x 14336 = 176,160,768; two RMSNorms 8,192: 218,112,000 (x 32 + 2 x 525,336,576
#: + 4,096 = 8,030,261,248, Llama-3-8B's published count). Two layers: 436,224,000; embedding and
#: output 128,256 x 4,096 = 525,336,576 each; final norm 4,096: N = 1,486,901,248, of which
#: 961,564,672 not the embedding. FLOP per token = 6 x 961,564,672 + 12 x l 2 x h 32 x q 128 x t 2048
#: = 5,769,388,032 + 201,326,592 = 5,970,714,624.
SMALL = job_toml({"catalog": "llama3-8b", "layers": 2}, training={"global_batch": 8, "seq_len": 2048},
                 mesh={"names": ["dp_shard"], "shape": [8]})
SMALL_FLOP_PER_TOKEN = 5_970_714_624
#: Llama-3-70B at t 131,072: per layer wq, wo 2 x 8192^2 = 134,217,728, wk + wv 2 x 8192 x 1024 = 16,777,216,
#: MLP 3 x 8192 x 28672 = 704,643,072, norms 16,384: 855,654,400; x 80 = 68,452,352,000, + embedding and
#: output 2 x 128,256 x 8,192 + final norm 8,192: N = 70,553,706,496 (torchtitan logs 70.55B); not the
#: embedding 69,503,033,344. 6 x that = 417,018,200,064; 12 x 80 x 64 x 128 x 131,072 = 1,030,792,151,040.
NC29_FLOP_PER_TOKEN = 1_447_810_351_104


def _line(out: str) -> str:
    lines = [x for x in out.splitlines() if x.startswith("torchtitan's MFU formula: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_small_llama_by_hand(tmp_path, capsys):
    # the count above: a layer, the 2-layer model's N, the 32-layer one's published 8,030,261,248
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096
    n, emb = 2 * layer + 2 * 128256 * 4096 + 4096, 128256 * 4096
    assert (layer, n, 32 * layer + 2 * emb + 4096) == (218_112_000, 1_486_901_248, 8_030_261_248)
    assert SMALL_FLOP_PER_TOKEN == 6 * (n - emb) + 12 * 2 * 32 * 128 * 2048
    doc, out = _step(tmp_path, capsys, SMALL, "small")
    # tokens/s per GPU = global batch 8 x seq 2048 / (step x 8 GPUs); H100 SXM: torchtitan's 989e12
    tps = 8 * 2048 / (doc["step_s"] * 8)
    want = SMALL_FLOP_PER_TOKEN * tps / 989e12
    assert doc["torchtitan_mfu"] == pytest.approx(want, rel=1e-12)
    line = _line(out)
    assert line.startswith(f"torchtitan's MFU formula: {want * 100:.2f}% ")
    assert "5,970,714,624 FLOP/token" in line and f"{tps:,.0f} tokens/s per GPU" in line and "989 TFLOP/s" in line


def test_float8_divides_by_the_bf16_peak(tmp_path, capsys):
    """Newcomer 29: meshplan's MFU of the float8 run is against the fp8 peak; torchtitan's is against
    989e12 (H200) for both, so the faster run has the higher torchtitan MFU, by the ratio of the steps."""
    layer = 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192  # the count above
    n, emb = 80 * layer + 2 * 128256 * 8192 + 8192, 128256 * 8192
    assert (layer, n) == (855_654_400, 70_553_706_496)
    assert NC29_FLOP_PER_TOKEN == 6 * (n - emb) + 12 * 80 * 64 * 128 * 131072
    fp8, out = _step(tmp_path, capsys, NC29_FP8_TOML, "fp8")
    bf16, _ = _step(tmp_path, capsys, nc29_bf16_toml(), "bf16")
    for doc in (fp8, bf16):  # 32 sequences x 131,072 tokens over 256 GPUs
        want = NC29_FLOP_PER_TOKEN * (32 * 131072 / (doc["step_s"] * 256)) / 989e12
        assert doc["torchtitan_mfu"] == pytest.approx(want, rel=1e-12)
    assert fp8["torchtitan_mfu"] / bf16["torchtitan_mfu"] == pytest.approx(bf16["step_s"] / fp8["step_s"], rel=1e-12)
    assert fp8["step_s"] < bf16["step_s"] and fp8["mfu"] < bf16["mfu"]  # meshplan's own MFU: the fp8 peak
    assert "1,447,810,351,104 FLOP/token" in _line(out)


def test_megatron_has_no_line(tmp_path, capsys):
    doc, out = _step(tmp_path, capsys, SMALL.replace("[training]\n", '[training]\nframework = "megatron"\n', 1), "mg")
    assert doc["torchtitan_mfu"] is None
    assert "torchtitan's MFU formula" not in out


@pytest.mark.parametrize("name, tflops", [("h100-sxm5-80gb", 989), ("h200-sxm-141gb", 989), ("h800-sxm-80gb", 989),
                                          ("a100-sxm-80gb", 312), ("b200-gb200-186gb", 2250),
                                          ("mi300x-oam-192gb", 1300), ("h100-pcie-80gb", 756), ("h20", 148),
                                          ("unknown-gpu", 312)])
def test_peak_by_name_as_get_peak_flops(name, tflops):
    """tools/utils.py:91-144: A100 312, H100 SXM 989 (PCIe 756), H200 989, H20 148, B200 2250 (a GB200's
    name holds it), MI300X 1300, anything else the A100's 312."""
    assert torchtitan_peak_flops(name) == tflops * 1e12


def test_flops_per_token_reads_a_head_dim_of_its_own():
    """A dense model whose head dim is not hidden / heads (Qwen3's decoupled ``head_dim``): torchtitan's
    qwen3 counts attention at ``head_dims = 2 x head_dim`` (e347b1e ``models/qwen3/model/args.py``:62-63,
    ``get_moe_model_nparams_and_flops`` with no experts: ``6 (N - N_emb) + 6 l h head_dims t``), as llama3's
    ``2 x (dim // n_heads)`` is its head dim. 2 layers, hidden 64, 4 q / 2 KV heads of 32, SwiGLU ffn 128,
    vocab 100: per layer wq 64 x 128 = 8,192, wk + wv 2 x 64 x 64 = 8,192, wo 8,192, MLP 3 x 64 x 128 =
    24,576, norms 128: 49,280; N = 2 x 49,280 + 2 x 100 x 64 + 64 = 111,424, of which 105,024 not the
    embedding. At t 16: 6 x 105,024 + 6 x 2 x 4 x (2 x 32) x 16 = 630,144 + 49,152 = 679,296 (hidden / heads,
    16, gave 654,720)."""
    model = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, kv_heads=2, head_dim=32, vocab=100)
    assert model.param_count() == 111_424
    assert torchtitan_flops_per_token(model, 16) == 679_296


def test_moe_counts_active_experts_as_help_says(tmp_path, capsys):
    """torchtitan counts an MoE model's FLOP with ``get_moe_model_nparams_and_flops`` (e347b1e
    ``models/utils.py``:434-498: routed experts x top_k // E, router and attention whole, the embedding
    off, ``head_dims`` 2 x head dim as qwen3's and llama4's); this test once asserted no line for an MoE
    (newcomer 48's finding 4 asked for it). Mixtral-8x7B's shape at 2 layers, t 2048: per layer attention
    4096 x (4096 + 2 x 1024 + 4096) = 41,943,040, router 4096 x 8 = 32,768, experts 3 x 8 x 4096 x 14336 =
    1,409,286,144, norms 8,192; N = 2 x 1,451,270,144 + 2 x 32000 x 4096 + 4096 = 3,164,688,384; active
    non-embedding 3,164,688,384 - 131,072,000 - 2,818,572,288 + 2,818,572,288 x 2 // 8 = 919,687,168;
    FLOP/token 6 x 919,687,168 + 6 x 2 x 32 x 256 x 2048 = 5,719,449,600. step --help names the formula."""
    moe = job_toml({"catalog": "mixtral-8x7b", "layers": 2}, training={"global_batch": 8, "seq_len": 2048},
                   mesh={"names": ["dp_shard"], "shape": [8]})
    doc, out = _step(tmp_path, capsys, moe, "moe")
    want = 5_719_449_600 * (8 * 2048 / (doc["step_s"] * 8)) / 989e12
    assert doc["torchtitan_mfu"] == pytest.approx(want, rel=1e-12)
    assert "5,719,449,600 FLOP/token (get_moe_model_nparams_and_flops" in _line(out)
    code, help_text, _ = run_cli(["step", "--help"], capsys)
    assert code == 0
    assert "get_moe_model_nparams_and_flops for an MoE or MLA model" in " ".join(help_text.split())
