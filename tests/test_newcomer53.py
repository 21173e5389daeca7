"""Newcomer trial 53 (long-context torchtitan: Llama 3.1 8B/70B at 128k, CP, 16 x DGX H200), findings
1, 6 and 8: what a torchtitan v0.2.2 job saves for backward, the float8 all-gather at dp_shard 1,
``-o /dev/null``, and a sequence past Llama 3.1's trained positions.

The job TOMLs are the trial's (tests/data/nc53/tt_70b_128k.toml, tt_8b_128k.toml: torchtitan v0.2.2,
cp 16, float8 Linears with ``enable_fsdp_float8_all_gather``, compile); j8_row1.toml is row 1 of the
trial's search of the 8B import (dp_shard 16 x cp 8, no AC).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cli_run import run_main as _main
from meshplan.config import load_config
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.tomlout import resolved
from meshplan.memory.headroom import tight
from meshplan.memory.sizes import layer_act_sizes
from meshplan.plan import build_plan, with_memory

DATA = Path(__file__).parent / "data" / "nc53"
H200x16 = ImportOptions(cluster="dgx-h200", nodes=16)
MiB = 2**20


def _saved(cfg, **memory) -> int:
    mem = cfg.memory.model_copy(update=memory)
    return layer_act_sizes(cfg.model, cfg.training, resolved(cfg), mem).saved


def test_70b_cp16_tp8_float8_layer_saves_by_hand(tmp_path):
    """Llama 3.1 70B (h 8192, 64 q / 8 KV heads, d 128, ffn 28672), cp 16 x tp 8 with SP, 131,072
    tokens, float8 tensorwise, no AC: the rank's tokens 131072 / 16 = 8192. torchtitan v0.2.2 (e347b1e)
    passes ``enable_gqa`` to SDPA (no repeat_kv since ff0829c): ``[memory] kv_expanded`` stays false;
    tp > 1 with SP keeps the all-gathered GEMM inputs (``sp_gathered_input`` true, DTensor
    ColwiseParallel). The job names the converter "quantize.linear.float8", which v0.2.2's
    parallelize does not take for float8 TP (``"float8" in job_config.model.converters``,
    models/llama3/infra/parallelize.py:77 at 73a0e69): plain TP, so the gathered inputs are bf16 and
    each float8 Linear keeps its fp8 copy besides (compiled: ``meshplan.compute.float8.saved_copies``,
    as at tp 1 in the next test). Per layer, MiB (bf16 2 B, fp8 1 B):

    - attention: norm input 2 x 8192 x 8192 / 8 = 16; gathered bf16 QKV input 2 x 8192 x 8192 = 128
      and its fp8 copy 64; q 2 x 8192 x 8 x 128 = 16; k and v at 1 KV head each 2 x 8192 x 1 x 128
      = 2 + 2; flash lse 4 x 8 x 8192 = 0.25; SDPA output (wo's input) 16 and wo's fp8 copy
      8192 x 1024 = 8: 252.25
    - MLP: norm input 16; gathered bf16 w1/w3 input 128 and its fp8 copy 64; gate, silu output and
      up 3 x 2 x 8192 x 3584 = 3 x 56 = 168; w2's bf16 input (the product) 56 and its fp8 copy 28: 460

    712.25 MiB = 746,848,256 B. Under torchao's float8 TP (the converter "float8", torchtitan 57387af
    to 5b5d468) the gathered inputs would be the fp8 copies cast before the gather and w2's bf16
    product kept by no one: 400.25 MiB, what this test asserted before float8 TP was read by the
    converter's name. The trial's hand count, 428 MiB, assumed that float8 TP and repeated K/V to the
    q heads (q, k, v 48 MiB instead of 20), without the lse."""
    job = tmp_path / "none.toml"  # the trial's j70_none: activation_checkpoint.mode "none"
    job.write_text((DATA / "tt_70b_128k.toml").read_text().replace('mode = "full"', 'mode = "none"'))
    cfg = load_any(job, opts=H200x16)
    assert cfg.memory.sp_gathered_input and not cfg.memory.kv_expanded
    # the cp rows follow kv_expanded too (8 KV heads, as v0.2.2 moves them): the note says so, and that a
    # torchtitan before ff0829c (repeat_kv, 64 q heads) moves 64 / 8 = 8x more
    assert any("K and V at the 8 KV heads" in n and "8x larger: set [memory] kv_expanded = true" in n
               for n in cfg.notes)
    assert not cfg.training.fp8_tp and any("float8 TP off" in n for n in cfg.notes)
    assert _saved(cfg) == int(712.25 * MiB) == 746_848_256
    assert _saved(replace(cfg, training=cfg.training.model_copy(update={"fp8_tp": True}))) == int(400.25 * MiB)
    assert _saved(cfg, kv_expanded=True) - _saved(cfg) == 2 * 2 * 8192 * (8 - 1) * 128 == 28 * MiB


def test_8b_128k_search_row_keeps_kv_at_the_kv_heads():
    """Row 1 of the trial's 8B 128k search, dp_shard 16 x cp 8, tp 1, no AC, float8 (compiled):
    8 KV heads stay 8 (enable_gqa), so the row keeps its place under the 15%-free line; repeated to
    the 32 q heads (the trial's kv_expanded try) k and v would take 2 x 2 x 16384 x (32 - 8) x 128 B
    = 192 MiB more a layer, 32 x 192 MiB = 6 GiB (105.34 -> 111.34 GiB, over the line at 106.9).
    Per layer at 16,384 tokens, h 4096, f 14336, MiB: norm inputs 2 x 128, GEMM inputs (bf16, tp 1)
    2 x 128, q 128, k + v 64, lse 4 x 32 x 16384 = 2, SDPA output 128, gate/silu/up/w2 input
    4 x 448 = 1792, float8 copies (meshplan.compute.float8.saved_copies, compiled) 64 + 64 + 64 +
    224: 3042 MiB."""
    cfg = load_config(DATA / "j8_row1.toml")
    assert not cfg.memory.kv_expanded
    assert _saved(cfg) == 3042 * MiB
    assert _saved(cfg, kv_expanded=True) - _saved(cfg) == 2 * 2 * 16384 * 24 * 128 == 192 * MiB
    plan = with_memory(build_plan(cfg))
    assert all(not tight(tl.verdict_bytes, tl.usable_bytes, 0.15) for tl in plan.timelines)


def test_float8_all_gather_kept_for_dp_shard_and_off_at_1(capsys, tmp_path):
    """torchtitan runs the float8 all-gather only with dp_shard > 1 (e347b1e
    components/quantization/float8.py:87-89, ``parallel_dims.dp_shard_enabled``): the import keeps the
    user's enable_fsdp_float8_all_gather (training.fp8_all_gather true); the plan of cp 16 x tp 8
    (dp_shard 1: FSDP over cp, bf16) gathers in bf16, and the same job at dp_shard 2 (32 nodes) in
    fp8: its fsdp all-gathers move the float8 weights as 1-byte uint8 (the norms stay bf16)."""
    cfg = load_any(DATA / "tt_70b_128k.toml", opts=H200x16)
    assert cfg.training.fp8_all_gather
    assert any("FSDP gathers the weights over dp_shard x cp = 16 in the compute dtype" in n for n in cfg.notes)
    dtypes = lambda p: {r.dtype for r in p.collectives["stage 0"] if r.axis in ("fsdp", "dp_shard") and r.op == "all-gather"}
    assert dtypes(build_plan(cfg, memory=False)) == {"bf16"}
    wide = load_any(DATA / "tt_70b_128k.toml", opts=ImportOptions(cluster="dgx-h200", nodes=32))
    assert dtypes(build_plan(wide, memory=False)) == {"bf16", "uint8"}  # FSDP2 gathers float8 data as uint8


def test_import_writes_to_dev_null_and_warns_past_trained_positions(capsys, tmp_path):
    """``-o /dev/null`` is written through (a character device, not a file taken); at 262,144 tokens the
    note says Llama 3.1 was trained to 131,072 positions."""
    job = tmp_path / "tt_8b_256k.toml"
    job.write_text((DATA / "tt_8b_128k.toml").read_text().replace("seq_len = 131072", "seq_len = 262144"))
    assert _main("import", "auto", job, "--cluster", "dgx-h200", "--nodes", 16, "-o", "/dev/null") == 0
    out = capsys.readouterr()
    assert "262144 is past the 131072 positions Llama 3.1 was trained to" in out.out + out.err
    assert Path("/dev/null").is_char_device()
