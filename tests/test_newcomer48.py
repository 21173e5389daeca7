"""Findings of newcomer trial 48 (a torchtitan MoE user: DeepSeek-V3 16B and Qwen3-30B-A3B on 64 x 8
H100); each test failed before its fix.

#1 (high): torchtitan's own ``deepseek_v3_16b`` job (``tests/data/nc48/tt_dsv3_16b_default.toml``:
selective AC "op", ep 8, local batch 4, seq 4096 on 8 H100) was called infeasible at 115.9 GiB: op-level
SAC with MLA or ep > 1 was planned as Megatron-LM's selective recompute (every activation but the
attention core's kept). It is now planned as torchtitan runs it (pytorch/torchtitan 238fa99, the last
commit that reads TOML job configs: ``distributed/activation_checkpoint.py`` ``_apply_op_sac``, the
``_op_sac_save_list`` of ``models/deepseek_v3/infra/parallelize.py``): every odd-numbered ``aten.mm`` of
the block saved (the router's gate force-recomputed, not counted), SDPA/flex attention's output and
log-sum-exp, the ep ``all_to_all_single`` outputs; the routed experts' ``_grouped_mm`` and the rest
recomputed. The fix line no longer offers cp for an MoE model under framework torch.

#2 (high): a torchtitan Python job config got "cannot tell the format" or "not valid TOML"; then one line
said torchtitan's Python config registry (9810191 on) is not read; since nc55 #7 it is read statically.

#3 (medium): export to torchtitan wrote ``filter_fqns = ["output"]`` for the user's ``["output",
"router.gate"]``; the user's list is kept.

#4 (low-medium): one search row got both the SC'21 ZeRO-3 ("predicted short") and the torchtitan H100
("predicted long") setting warnings; a torch plan on H100 gets its engine's alone.

#5 (low): cosmetic lines (etp fix "= 1 or 1", flavor "16b", validate's field for float8, place's
all-to-all wording, the etp the import note says export writes).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.config import config_from_dict
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.keymaps import keymap_of
from meshplan.memory.workingset import layer_act_sizes
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.plan_fix_cp import MOE_CP, cp_variant

DATA = Path(__file__).parent / "data" / "nc48"

#: A small MoE + MLA model: MLA without a query latent (as DeepSeek-V2-Lite), 1 dense layer, then an
#: MoE layer of 8 experts (top-2, width 16) and one shared expert (width 16).
SMALL = {"name": "tiny-moe-mla", "layers": 2, "dense_layers": 1, "hidden": 64, "ffn": 128, "q_heads": 4,
         "vocab": 256, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
         "experts": 8, "top_k": 2, "expert_ffn": 16, "shared_experts": 1}


def _small(recompute: str):
    return config_from_dict({"model": SMALL, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 2, "seq_len": 16, "micro_batch": 1, "recompute": recompute,
                                          "moe_dropless": True, "compute_dtype": "bf16"},
                             "mesh": {"names": ["dp_shard", "ep"], "shape": [2, 2], "world": 2}})


def test_op_sac_saves_the_mla_moe_layers_odd_mms_attention_and_all_to_alls():
    """#1: per-layer bytes torchtitan's op-level SAC keeps of the small MoE + MLA layer, by hand
    (bf16, 2 B; T = 16 tokens a rank, tp 1, ep 2, flash attention; a = 4 heads, d = 8 + 4 = 12, d_v 8,
    c_kv 16 + r 4; shared expert f 16; h 64). The layer's mms in order (MoE.forward runs the routed
    experts, then the shared one): wq, wkv_a, wkv_b, wo, shared w1, w3, w2 (the router's gate is
    force-recomputed, not counted; the routed experts' _grouped_mm is no aten.mm); the odd ones saved:

    - layer input (the checkpoint's) 2 x 16 x 64 = 2,048
    - wq output 2 x 16 x 4 x 12 = 1,536; wkv_b output 2 x 16 x 4 x (8 + 8) = 2,048
    - attention output 2 x 16 x 4 x 8 = 1,024 and its fp32 log-sum-exp 4 x 16 x 4 = 256
    - shared w1 output 2 x 16 x 16 = 512; shared w2 output 2 x 16 x 64 = 2,048
    - the dispatch's and combine's all_to_all_single outputs: dropless, balanced, 16 x top-2 = 32 copies
      sent and 32 received, 2 x 64 x (32 + 32) = 8,192

    17,664 B in all. Before: ConfigError ('op' ... planned with cp = ep = 1 only)."""
    cfg = _small("op")
    plan = build_plan(cfg)
    moe = layer_act_sizes(cfg.model, cfg.training, plan.mesh, cfg.memory, moe=True)
    assert moe.saved == 2048 + 1536 + 2048 + 1024 + 256 + 512 + 2048 + 8192
    # the dense layer: wq, wkv_a, wkv_b, wo, w1 (128 wide), w3, w2: input, wq, wkv_b, attention, w1, w2
    dense = layer_act_sizes(cfg.model, cfg.training, plan.mesh, cfg.memory)
    assert dense.saved == 2048 + 1536 + 2048 + 1024 + 256 + 2 * 16 * 128 + 2048


def test_op_sac_replays_the_recomputed_mms_and_the_routed_experts():
    """#1, time: the MoE layer's replay under op runs wkv_a, wo, the router's gate, the routed experts'
    three grouped GEMMs and half of the shared expert's fused gate-and-up GEMM (w3; w1 is saved), at
    that half's time; not wq, wkv_b nor the shared w2, whose outputs are saved, nor the attention."""
    m, h100 = catalog.model("deepseek-v2-lite"), catalog.gpu("h100-sxm5-80gb")
    w = Workload(seq_len=4096, micro_batch=4, ep=8, recompute="op")
    c = layer_cost(m, h100, w, layer=1)
    replayed = {o.name.removesuffix(" (recompute)"): o for o in c.ops if o.recompute and o.kind == "gemm"}
    assert set(replayed) == {"wkv_a", "wo", "router", "expert_w_gate", "expert_w_up", "expert_w_down", "shared_w_up"}
    fwd = next(o for o in c.ops if o.name == "shared_w_up" and o.phase == "forward")
    assert replayed["shared_w_up"].seconds == pytest.approx(fwd.seconds / 2)
    assert not any(o.recompute and o.kind == "attention" for o in c.ops)


def test_torchtitans_16b_default_plans_op_sac():
    """#1 on torchtitan's own deepseek_v3_16b (local batch 4 x seq 4096 = T 16,384 tokens a rank, ep 8,
    bf16): the import keeps selective_ac_option "op" as op (before: planned as Megatron-LM's selective,
    with a note), and an MoE layer keeps (MLA without a query latent: a 16 heads, d 192, d_v 128; 2
    shared experts, f 2 x 1408 = 2816; top-6):

    - layer input 2 x 16,384 x 2048 = 67,108,864; wq 2 x 16,384 x 16 x 192 = 100,663,296
    - wkv_b 2 x 16,384 x 16 x 256 = 134,217,728; attention 2 x 16,384 x 16 x 128 = 67,108,864 + lse
      4 x 16,384 x 16 = 1,048,576
    - shared w1 2 x 16,384 x 2816 = 92,274,688; shared w2 67,108,864
    - all-to-alls 2 x 2048 x (98,304 + 98,304) = 805,306,368 (16,384 x top-6 = 98,304 copies each way)

    1,334,837,248 B a layer (1.24 GiB), where Megatron-LM's selective kept 3.1 GiB."""
    cfg = load_any(DATA / "tt_dsv3_16b_default.toml", "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.training.recompute == "op"
    assert not any("op-level SAC" in n for n in cfg.notes)
    plan = build_plan(cfg)
    moe = layer_act_sizes(cfg.model, cfg.training, plan.mesh, cfg.memory, moe=True)
    assert moe.saved == 1_334_837_248


def test_fix_line_offers_no_cp_for_moe_under_torch():
    """#1: the 16B default's fix line offered ``context_parallel_degree 4`` (peak 53.4 GiB), which
    meshplan validate refuses (cp with MoE layers) and torchtitan 238fa99 refuses for the 16B flavour
    (attn_type "flex": NotImplementedError). No cp variant is planned now; where activations
    dominate the peak the line says why."""
    cfg = load_any(DATA / "tt_dsv3_16b_default.toml", "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    plan = build_plan(cfg)
    assert not plan.feasible
    found, why = cp_variant(plan)
    assert found is None and why in ("", MOE_CP)
    line = memory_fix(plan, keymap_of(plan.config)) or ""
    assert line.startswith("fix: ") and "context_parallel" not in line


@pytest.mark.parametrize("fmt, name", [(None, "deepseek_v3_16b_tt.py"), ("torchtitan", "deepseek_v3_16b_tt.py"),
                                       (None, "job.txt")])
def test_a_torchtitan_python_job_config_is_read(tmp_path, fmt, name):
    """#2: torchtitan's Python job config (``tests/data/nc48/deepseek_v3_16b_tt.py.txt``): ``import auto``
    said "cannot tell the format; pass --format ..." and ``import torchtitan`` "not valid TOML
    (Expected '=' ...)"; then a one-line refusal (torchtitan 9810191 replaced the TOML job files). Since
    nc55 #7 it is read without running it (meshplan/interop/torchtitan_py.py): its module-level
    ``default_config = JobConfig(...)`` is v0.2.2's dataclass tree, table by table its job TOML, and so
    is the same text under another name (it imports torchtitan). By hand: deepseek_v3 16B is
    deepseek-v2-lite; local_batch_size 4, seq_len 8192; ep 8 on 8 GPUs, dp_shard -1 = 8 / 1 = 8 (ep
    borrows dp_shard); global batch 4 x 8 = 32; AC full; [quantize] without model.converters converts
    nothing in v0.2.2 (listed unused). The data file is stored as ``.py.txt``: pytest's
    --doctest-modules would import a ``.py`` under tests/."""
    (tmp_path / name).write_text((DATA / "deepseek_v3_16b_tt.py.txt").read_text())
    cfg = load_any(tmp_path / name, fmt, ImportOptions(cluster="dgx-h100", nodes=1))
    t = cfg.training
    assert (cfg.model.name, t.global_batch, t.micro_batch, t.seq_len, t.recompute) == \
        ("deepseek-v2-lite", 32, 4, 8192, "full")
    assert t.linear_dtype is None and cfg.origin == "torchtitan"
    assert any("quantize.linear.float8.filter_fqns" in n for n in cfg.notes)


def _export_full(tmp_path: Path) -> tuple[dict, list[str], object, object]:
    """(written tables, header, config read from the trial's own job, config read back) of ``export
    --to torchtitan`` of ``tests/data/nc48/dsv3_16b_ep8_full.toml`` (AC full, ep 8, float8 Linears
    with ``filter_fqns = ["output", "router.gate"]``, ``expert_tensor_parallel_degree = 1``) on 64
    dgx-h100, unchanged."""
    import tomllib

    from meshplan.interop.export import export, user_source
    src, opts = DATA / "dsv3_16b_ep8_full.toml", ImportOptions(cluster="dgx-h100", nodes=64)
    cfg = load_any(src, "torchtitan", opts)
    text, header = export(cfg, "torchtitan", str(src), user_source(src))
    out = tmp_path / "out.toml"
    out.write_text(text)
    return tomllib.loads(text), header, cfg, load_any(out, "torchtitan", opts)


def test_export_keeps_the_users_float8_filter(tmp_path):
    """#3: the export wrote ``filter_fqns = ["output"]`` and listed ``["output", "router.gate"] ->
    ["output"]``: the exported job would convert the router's gate to float8, which the user kept in
    bf16. The plan models only whether the output layer is filtered (``fp8_output_layer`` false
    either way), so the user's list is kept whole; the file reads back as the same plan."""
    from meshplan.interop.roundtrip import differences
    tables, header, cfg, back = _export_full(tmp_path)
    assert tables["quantize"]["linear"]["float8"]["filter_fqns"] == ["output", "router.gate"]
    assert not any("filter_fqns" in h for h in header if h.startswith("written otherwise"))
    assert cfg.training.linear_dtype == "fp8" and not cfg.training.fp8_output_layer
    assert differences(cfg, back) == []


def test_one_setting_warning_per_row_the_engines_own():
    """#4: search's row 1 and compare's sides (framework torch, FSDP2 over dp_shard 512 across 64
    dgx-h100) printed two setting warnings at once: SC'21 ZeRO-3 "the step predicted short" and
    torchtitan H100 "the step predicted long". The SC'21 runs are DeepSpeed ZeRO-3 on A100; a torch plan
    on H100 runs torchtitan's engine, whose measured runs shard across nodes too (benchmarks/
    torchtitan_h100.py), so that setting alone applies; SC'21's still applies where no torch setting
    does (Megatron-LM; torch on H200 until newcomer trial 51 made H200 a Hopper part whose nearest
    measured evidence is torchtitan's H100 runs, spec/accuracy.hopper). The torchtitan figures are of tokens/s (its tables' TPS/GPU:
    T1 FSDP published 5,762 against 6,001.5 predicted, +4.2%), so its + errors are steps predicted
    SHORT, as SC'21's - errors of the step are: "the step predicted long" was a misreading (session 49)."""
    from meshplan.spec import accuracy
    assert accuracy.settings_of("zero3", "torch", "h100-sxm5-80gb", 64) == (accuracy.TORCHTITAN_H100,)
    line = accuracy.setting_line("row 1", accuracy.settings_of("zero3", "torch", "h100-sxm5-80gb", 64))
    assert "tokens/s predicted high (the step short)" in line and "predicted long" not in line
    assert "the step predicted short" not in line  # SC'21's words are not on this row
    assert accuracy.settings_of("zero3", "megatron", "h100-sxm5-80gb", 64) == (accuracy.ZERO3_SC21,)
    assert accuracy.settings_of("zero3", "torch", "h200-sxm-141gb", 64) == (accuracy.TORCHTITAN_H100,)


def test_export_keeps_etp_1_as_the_import_note_says(tmp_path):
    """#5: the import's note says torchtitan up to v0.2.2 reads ``expert_tensor_parallel_degree``
    (meshplan export keeps it); the export listed it ``1 -> dropped``. It is written as the user had
    it (1: experts whole on each of the ep 8 ranks), and the note says "keeps"."""
    tables, header, cfg, _ = _export_full(tmp_path)
    assert tables["parallelism"]["expert_tensor_parallel_degree"] == 1
    assert not any("expert_tensor_parallel_degree" in h for h in header if h.startswith("written otherwise"))
    assert any("torchtitan up to v0.2.2 reads the key (meshplan export keeps it)" in n for n in cfg.notes)


def test_cosmetics(tmp_path):
    """#5: (a) an etp torchtitan v0.2.2 refuses at tp 1 said "fix: expert_tensor_parallel_degree = 1 or 1";
    now "= 1". (b) flavor "16b" named the known flavors but not the near one; now "did you mean '16B'?".
    (c) validate refused float8 naming field ``mesh``; now ``training.linear_dtype``. (d) place's all-to-all
    line read "396.4 ranks' all-to-all bytes off their NVLink domain ..."; 396.4 is the sum over the 512
    ranks of (n - g)/(n - 1) = 24/31 (ep 32 over 4 nodes of 8), and the line now says so."""
    from meshplan.errors import ConfigError
    from meshplan.placement.explain import _hops
    from meshplan.placement.score import AxisCost
    from meshplan.runtime.validation.options import Options
    from meshplan.runtime.validation.refusals import refusals
    text = (DATA / "tt_dsv3_16b_default.toml").read_text()
    opts = ImportOptions(cluster="dgx-h100", nodes=1)
    (tmp_path / "etp.toml").write_text(text.replace("expert_tensor_parallel_degree = 1", "expert_tensor_parallel_degree = 2"))
    with pytest.raises(ConfigError) as e:
        load_any(tmp_path / "etp.toml", "torchtitan", opts)
    assert str(e.value).endswith("fix: expert_tensor_parallel_degree = 1")
    (tmp_path / "flavor.toml").write_text(text.replace('flavor = "16B"', 'flavor = "16b"'))
    with pytest.raises(ConfigError, match=r"^model\.flavor: .* did you mean '16B'\? else give --model"):
        load_any(tmp_path / "flavor.toml", "torchtitan", opts)
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 1024, "linear_dtype": "fp8"},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    fields = [err.field for err in refusals(cfg, Options(worlds=(2,)))]
    assert fields == ["training.linear_dtype"]
    words = _hops(AxisCost("ep", weight=1.0, network_hops=512 * 24 / 31, spine_hops=0, socket_hops=0.0, kind="all-to-all"))
    assert words.startswith("396.4 (the sum over the ranks of (n - g)/(n - 1), the share of its all-to-all bytes")


def test_fix_line_names_torchtitans_refusal_for_mla_only():
    """tt49: torchtitan (e347b1e, v0.2.2) refuses CP where the attention is not SDPA
    (models/deepseek_v3/infra/parallelize.py:67-73; its DeepSeek flavours set attn_type "flex",
    __init__.py:100, 127, 154), not for MoE as such (Qwen3's MoE flavours run SDPA, qwen3/model/args.py:39):
    the fix line's cp refusal is for the MLA MoE model under torch and quotes torchtitan's words; under
    megatron (Transformer Engine's CP runs MLA) it is not refused; a non-MLA MoE model under torch is offered
    cp (tests/test_newcomer21.py::test_long_sequence_fix_offers_cp_with_moe_layers)."""
    from meshplan.plan_fix_cp import moe_cp_refused
    cfg = load_any(DATA / "tt_dsv3_16b_default.toml", "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    plan = build_plan(cfg)
    assert cfg.model.is_mla and moe_cp_refused(plan)
    assert "Got attn_type='flex'. FlexAttention and varlen attention are not supported with CP." in MOE_CP
    mg = build_plan(replace(cfg, training=cfg.training.model_copy(update={"framework": "megatron",
                                                                          "recompute": "selective"})))
    assert not moe_cp_refused(mg)
    mix = config_from_dict({"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 4096},
                            "mesh": {"names": ["dp_shard"], "shape": [8]}})
    assert mix.model.is_moe and not moe_cp_refused(build_plan(mix))
    # a dense MLA model is no torchtitan flavour; meshplan's runtime runs it with cp (tests/test_mla.py)
    dense = config_from_dict({"model": {"name": "dense-mla", "layers": 4, "hidden": 2048, "ffn": 10944, "q_heads": 16,
                                        "vocab": 102400, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                                        "qk_rope_head_dim": 64, "v_head_dim": 128},
                              "cluster": {"system": "dgx-h100", "nodes": 1},
                              "training": {"global_batch": 8, "seq_len": 4096},
                              "mesh": {"names": ["dp_shard"], "shape": [8]}})
    assert dense.model.is_mla and not dense.model.is_moe and not moe_cp_refused(build_plan(dense))
