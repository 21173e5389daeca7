"""Megatron-LM's ``--recompute-modules`` beyond core_attn (``training.recompute_modules``): the
activations each module does not keep, the forward kernels it replays, the importer and exporter,
and the one-line refusals. What each module does is read in NVIDIA/Megatron-LM d98e8a6 and cited in
:mod:`meshplan.spec.recompute_modules`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron_write import write as megatron_args
from meshplan.memory.activations import layer_terms
from meshplan.memory.layer_dims import LayerDims
from meshplan.memory.workingset import layer_act_sizes
from meshplan.mesh.resolve import resolve_mesh
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.recompute_modules import layer_parts
from meshplan.spec.training import TrainingSpec

#: A small gated layer: s 64, b 1, h 64, 4 q heads and 2 KV heads of 16, f 256, bf16, no dropout.
SMALL = LayerDims(s=64, b=1, h=64, a=4, g=2, d=16, f=256, gated=True, dropout=False)
ARGS = Path(__file__).parent.parent / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"


def _kept(dims: LayerDims, modules: tuple[str, ...], moe: bool = False, mla: bool = False) -> dict[str, int]:
    parts = layer_parts(modules, moe, mla)
    return {t.name: t.size_bytes for t in layer_terms(dims, recompute="selective", flash=True, fused_glu=True,
                                                       framework="megatron", parts=parts)}


def test_dense_layer_bytes_per_module_by_hand():
    """SMALL at tp 1 with flash attention and Megatron-LM's fused SwiGLU (Korthikanti Table 2's terms,
    :mod:`meshplan.memory.activations`), bytes: attn norm input, qkv input, context, mlp norm input,
    w_in input 2 x 64 x 64 = 8,192 each; q 2 x 64 x 4 x 16 = 8,192; k, v 2 x 64 x 2 x 16 = 4,096 each;
    fc1 output 2 x 64 x 2 x 256 = 65,536; w_out input 2 x 64 x 256 = 32,768: 155,648 with core_attn
    (Megatron-LM's default). Without core_attn (``--recompute-modules mlp``) the flash statistics stay,
    4 B x 4 heads x 64 rows = 1,024. ``mlp`` checkpoints the dense MLP with its input, the norm's
    input (transformer_layer.py 992-1011): w_in input, fc1 output and w_out input go, 8,192 + 65,536 +
    32,768 = 106,496, leaving 49,152. ``layernorm`` and ``moe_act`` act on no dense Llama layer
    (the norms are fused into Transformer Engine's GEMMs; no routed experts): nothing changes."""
    assert sum(_kept(SMALL, ("core_attn",)).values()) == 155_648
    assert sum(_kept(SMALL, ("mlp",)).values()) == 155_648 + 1_024 - 106_496
    both = _kept(SMALL, ("core_attn", "mlp"))
    assert sum(both.values()) == 49_152
    assert {"w_in input", "fc1 output (gate, up)", "w_out input"}.isdisjoint(both)
    assert both["mlp norm input"] == 8_192  # the checkpoint's input
    assert _kept(SMALL, ("core_attn", "layernorm", "moe_act")) == _kept(SMALL, ("core_attn",))


def test_separate_norms_discard_their_output():
    """``layernorm`` (output-discarding checkpoint, transformer_layer.py 473-536) on a norm that is a
    module of its own: an MoE layer's pre-MLP norm frees its output, the w_in input (the router's and
    shared experts' saved input), 2 x 64 x 64 = 8,192 B of SMALL's 155,648; MLA's input norm frees the
    qkv input likewise."""
    assert sum(_kept(SMALL, ("core_attn", "layernorm"), moe=True).values()) == 155_648 - 8_192
    assert "w_in input" not in _kept(SMALL, ("core_attn", "layernorm"), moe=True)


def test_mla_up_proj_bytes_by_hand():
    """A small MLA layer: s 8, h 32, 2 heads, q/k head dim 12 (8 no-RoPE + 4 RoPE), v head dim 8,
    q latent 16, kv latent 8, bf16. Kept with core_attn: norms' inputs and GEMM inputs 512 each (x 4),
    q latent 2 x 8 x 16 = 256 and its normalised copy 256, kv latent + rope key 2 x 8 x 12 = 192 and the
    normalised kv latent 128, q and k 2 x 8 x 2 x 12 = 384 each, v and context 2 x 8 x 2 x 8 = 256 each,
    fc1 output 2 x 8 x 128 = 2,048, w_out input 1,024: 7,232. ``mla_up_proj`` (multi_latent_attention.py
    983-988: the up-projections with their fused latent norms and RoPE under CheckpointWithoutOutput, the
    latents as inputs) frees Q, K, V and the two normalised latents: 384 + 384 + 256 + 256 + 128 = 1,408."""
    mla = LayerDims(s=8, b=1, h=32, a=2, g=2, d=12, f=64, gated=True, dropout=False, dv=8, q_lora=16, kv_lora=8,
                    rope=4)
    base = _kept(mla, ("core_attn",), mla=True)
    up = _kept(mla, ("core_attn", "mla_up_proj"), mla=True)
    assert sum(base.values()) == 7_232
    assert sum(up.values()) == 7_232 - 1_408
    assert up["q latent (q_a output)"] == 256 and up["kv latent and rope key (kv_a output)"] == 192


def _moe_act_sizes(modules: tuple[str, ...]) -> int:
    m = catalog.model("mixtral-8x7b")
    t = TrainingSpec(global_batch=8, seq_len=4096, framework="megatron", sharding="zero1",
                     recompute_modules=modules)
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[1]), 1)
    return layer_act_sizes(m, t, mesh, MemoryOptions(), moe=True).saved


def test_moe_and_moe_act_routed_bytes_by_hand():
    """Mixtral's MoE layer, 4,096 tokens on one rank (ep 1, dropless, balanced): 8,192 routed rows.
    Kept by the routed experts (:func:`meshplan.memory.workingset.layer_act_sizes`): per row fc1's
    output 2 x 14,336 and fc2's input 14,336 (fused SwiGLU) plus the dispatched input and the expert
    output 2 x 4,096, 2 B each, and the fp32 router logits 4 x 8 per token: 8,192 x 102,400 + 131,072
    = 838,991,872 B. ``moe_act`` (experts.py 1019-1030) frees fc2's input, 8,192 x 14,336 x 2 =
    234,881,024 B; ``moe`` (moe_layer.py 701-717) all of them (Mixtral has no shared experts, whose
    tensors would go too); the layer's input to the MoE block, the norm's output, stays."""
    base = _moe_act_sizes(("core_attn",))
    assert base - _moe_act_sizes(("core_attn", "moe_act")) == 234_881_024
    assert base - _moe_act_sizes(("core_attn", "moe")) == 838_991_872


def _recompute_s(name: str, modules: tuple[str, ...], **kw) -> dict[str, float]:
    w = Workload(seq_len=4096, tp=2, sp=True, framework="megatron", megatron_ops=True, fused_qkv=True,
                 recompute_modules=modules, **kw)
    c = layer_cost(catalog.model(name), catalog.gpu("h100-sxm5-80gb"), w)
    return [(o.name, o.seconds) for o in c.ops if o.recompute], {o.name: o.seconds for o in c.ops
                                                                if o.phase == "forward"}


def test_recompute_time_is_the_modules_forward_kernels():
    """Llama-3-8B at tp 2 (one rank's layer): core_attn replays the attention kernel; ``mlp`` adds the
    MLP's forward as it ran (w_gate, w_up, w_down, the SwiGLU and the norm Transformer Engine fuses into
    fc1), each at its own forward time; without core_attn the attention is not replayed."""
    rec, fwd = _recompute_s("llama3-8b", ("core_attn", "mlp"))
    mlp = ("mlp norm", "w_gate", "w_up", "w_down", "silu x up")
    assert sorted(rec) == sorted((f"{n} (recompute)", fwd[n]) for n in ("attention",) + mlp)
    rec_mlp, _ = _recompute_s("llama3-8b", ("mlp",))
    assert sorted(n for n, _ in rec_mlp) == sorted(f"{n} (recompute)" for n in mlp)


def test_moe_modules_replay_their_kernels_and_nest():
    """DeepSeek-V3's MoE layer: ``moe`` replays the whole MLP block's forward (router, routed and shared
    experts' GEMMs, the activation, the permutations); ``shared_experts`` inside it once more (its
    checkpoint runs again in moe's replay, then replays itself); ``moe_act`` replays the routed experts'
    share of the activation kernel: its bytes by the elements each GEMM feeds, expert_w_up 128 rows x
    2,048 x 256 experts = 67,108,864 against shared_w_up's 4,096 tokens x 2,048 = 8,388,608 (the fused
    gate/up GEMM's 4,096 columns halved), so 8/9 of the kernel's bytes."""
    rec, fwd = _recompute_s("deepseek-v3", ("moe", "shared_experts"), ep=2)
    assert ("expert_w_up (recompute)", fwd["expert_w_up"]) in rec and ("router (recompute)", fwd["router"]) in rec
    rec1, _ = _recompute_s("deepseek-v3", ("moe",), ep=2)
    assert sorted(n for n, _ in rec1) == sorted(f"{o} (recompute)" for o in fwd if o in (
        "router", "expert_w_gate", "expert_w_up", "expert_w_down", "shared_w_up", "shared_w_down", "silu x up",
        "moe permute", "moe unpermute"))
    assert len(rec) == len(rec1) + 3  # shared_w_up, shared_w_down and their activation share again
    w = Workload(seq_len=4096, framework="megatron", megatron_ops=True, recompute_modules=("moe_act",))
    c = layer_cost(catalog.model("deepseek-v3"), catalog.gpu("h100-sxm5-80gb"), w)
    act = next(o for o in c.ops if o.name == "silu x up" and o.phase == "forward")
    part = next(o for o in c.ops if o.name == "silu x up (moe_act) (recompute)")
    assert part.size_bytes == pytest.approx(act.size_bytes * 67_108_864 / (67_108_864 + 8_388_608))


def _import(text: str) -> object:
    d = Path(tempfile.mkdtemp())
    (d / "job.args").write_text(text)
    return load_any(d / "job.args", "megatron", ImportOptions(cluster="dgx-h100", nodes=2))


def test_import_export_round_trip():
    """``--recompute-granularity selective --recompute-modules core_attn mlp`` reads as
    ``recompute_modules = ("core_attn", "mlp")``; export writes the same two flags back, which read
    again to the same training; the default (``--recompute-activations``) writes no module flag."""
    text = ARGS.read_text().replace("--recompute-activations",
                                    "--recompute-granularity selective --recompute-modules core_attn mlp")
    cfg = _import(text)
    assert (cfg.training.recompute, cfg.training.recompute_modules) == ("selective", ("core_attn", "mlp"))
    flags = megatron_args(cfg)
    assert "--recompute-modules core_attn mlp" in flags and "--recompute-granularity selective" in flags
    again = _import("\n".join(flags))
    assert again.training.recompute_modules == ("core_attn", "mlp")
    assert not any(f.startswith("--recompute-modules") for f in megatron_args(_import(ARGS.read_text())))


def _native(**training) -> dict:
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 4096, "framework": "megatron", "sharding": "zero1",
                         "recompute": "selective", **training},
            "mesh": {"names": ["dp", "tp"], "shape": [4, 2]}}


def test_unknown_module_refused_in_one_line():
    """An unknown name, in the native TOML and in Megatron-LM's flag: one line naming the field and
    the names meshplan models."""
    with pytest.raises(ConfigError) as e:
        config_from_dict(_native(recompute_modules=["core_attn", "ffn"]))
    assert str(e.value) == ("training.recompute_modules: 'ffn' is not a Megatron-LM recompute module; use "
                            "core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts")
    with pytest.raises(ConfigError, match=r"^--recompute-modules: core_attn gdn_norm_out: 'gdn_norm_out' recomputes "
                                          r"parts of GatedDeltaNet attention") as e:
        _import(ARGS.read_text().replace("--recompute-activations", "--recompute-granularity selective "
                                         "--recompute-modules core_attn gdn_norm_out"))
    assert "\n" not in str(e.value)


def test_modules_megatron_refuses_or_ignores():
    """As Megatron-LM's TransformerConfig.__post_init__ (transformer_config.py 1964-1973): ``moe_act``
    without grouped-GEMM experts and ``mla_up_proj`` without MLA raise, so the config is refused; a
    module that acts on no layer (``moe`` on dense Llama-3-8B) recomputes nothing there, planned so with
    a note; outside Megatron-LM the key is refused, under full recompute not planned, as Megatron-LM
    reads it only under selective granularity."""
    with pytest.raises(ConfigError, match=r"^training.recompute_modules: moe_act recomputes the routed experts'"):
        config_from_dict(_native(recompute_modules=["moe_act"]))
    with pytest.raises(ConfigError, match=r"^training.recompute_modules: mla_up_proj recomputes"):
        config_from_dict(_native(recompute_modules=["core_attn", "mla_up_proj"]))
    cfg = config_from_dict(_native(recompute_modules=["core_attn", "moe"]))
    assert any(n.startswith("training.recompute_modules moe: no layer of llama3-8b") for n in cfg.notes)
    with pytest.raises(ConfigError, match=r"^training.recompute_modules: is Megatron-LM's --recompute-modules"):
        config_from_dict(_native(recompute_modules=["mlp"], framework="torch", sharding="zero3"))
    full = config_from_dict(_native(recompute_modules=["mlp"], recompute="full"))
    assert "training.recompute_modules mlp not planned: recompute is 'full'" in full.notes[-1]
