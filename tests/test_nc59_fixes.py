"""Newcomer trial nc59 (a long-context practitioner) #1: Megatron Core's data-loader attention mask,
``[b, 1, s, s]`` bool on the GPU through the first chunk's forward (:func:`meshplan.memory.sizes.batch_mask_bytes`),
is the peak of a long-context Megatron-LM job, and the memory ``fix:`` line and the tight warning now
name ``--no-create-attention-mask-in-dataloader`` (:mod:`meshplan.plan_fix_mask`). Before: Llama-3-70B
at seq 262144 was offered only Megatron FSDP (69.0 GiB, tight); at seq 131072 the plan said "tight"
without naming the 16 GiB mask."""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import load_config
from meshplan.interop.foreign import ImportOptions, load_any
from meshplan.interop.keymaps import keymap_of
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.plan_fix_mask import mask_note, mask_variant
from meshplan.report.plan_warnings import plan_warnings
from meshplan.units import GiB

#: Llama-3-70B on 32 dgx-h100 as a Megatron-LM long-context job runs it: tp 8 + SP, cp 8 (TE's p2p
#: ring), the distributed optimizer, full recompute, Megatron Core's get_batch with the loader's mask
#: (no --no-create-attention-mask-in-dataloader).
ARGS = """--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
--group-query-attention --num-query-groups 8 --seq-length {s} --max-position-embeddings {s}
--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256
--tensor-model-parallel-size 8 --sequence-parallel --context-parallel-size {cp} --cp-comm-type p2p
--micro-batch-size 1 --global-batch-size {gb} --bf16 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather --attention-dropout 0 --hidden-dropout 0
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --use-flash-attn
"""


def _load(tmp_path, s: int, cp: int, gb: int, extra: str = ""):
    path = tmp_path / f"l70_{s}.args"
    path.write_text(ARGS.format(s=s, cp=cp, gb=gb) + extra, encoding="utf-8")
    return load_any(path, "megatron", ImportOptions(cluster="dgx-h100", nodes=32))


def _init_bytes(plan) -> int:
    """What stage 0 holds before its first forward event: the persistent state, NCCL buffers and
    cuBLAS workspace (the timeline's init events)."""
    return sum(e.delta_bytes for e in plan.timeline.events() if e.phase == "init")


def test_256k_fix_line_offers_the_mask_flag_first(tmp_path):
    """seq 262144, tp 8 x cp 16 x dp 2: the mask is 1 x 1 x 262144 x 262144 bool = 2^36 B = 64 GiB,
    allocated on top of the init state (get_batch runs before any layer), so the peak is init + 2^36
    exactly (the cp slice, 2^36 / 16 = 4 GiB, replaces it after). Without it the peak is a later event:
    the flag's own plan fits with 15% free, where Megatron FSDP (the only variant offered before) is
    tight; the line lists the flag first (its step is the shorter: no FSDP gathers)."""
    cfg = _load(tmp_path, 262144, 16, 32)
    plan = build_plan(cfg)
    peak = plan.timeline.peak
    assert not plan.feasible and "attention mask" in peak.label
    assert peak.by_kind["temporaries"] == 2 ** 36 == 262144 ** 2
    assert peak.total_bytes == _init_bytes(plan) + 2 ** 36
    bare = build_plan(replace(cfg, training=cfg.training.model_copy(update={"dataloader_attention_mask": False})))
    usable = bare.timeline.usable_bytes
    assert bare.feasible and usable - bare.timeline.verdict_bytes >= 0.15 * usable
    line = memory_fix(plan, keymap_of(cfg))
    assert line.startswith("fix: --no-create-attention-mask-in-dataloader (the data loader's 1 x 1 x 262144 x "
                           f"262144 bool attention mask (64.0 GiB), not built) -> peak "
                           f"{bare.timeline.verdict_bytes / GiB:.1f} GiB (fits; step ")
    assert "--use-megatron-fsdp" in line  # still offered, after it


def test_128k_tight_plan_notes_the_mask(tmp_path):
    """seq 131072, cp 8: the mask 131072^2 B = 2^34 B = 16 GiB on top of the init state is the peak,
    under 15% free; without it the peak falls by more than 1 GiB (:data:`~meshplan.plan_fix_mask.MIN_GAIN`),
    and the plan's warnings carry the note with the flag in the file's words and the flag's own peak."""
    cfg = _load(tmp_path, 131072, 8, 64)
    plan = build_plan(cfg)
    tl = plan.timeline
    assert plan.feasible and tl.peak.total_bytes == _init_bytes(plan) + 2 ** 34
    assert tl.usable_bytes - tl.peak.total_bytes < 0.15 * tl.usable_bytes  # tight
    bare = build_plan(replace(cfg, training=cfg.training.model_copy(update={"dataloader_attention_mask": False})))
    assert tl.peak.total_bytes - bare.timeline.peak.total_bytes > GiB
    note = mask_note(plan)
    assert note.startswith("note: the data loader's 1 x 1 x 131072 x 131072 bool attention mask (16.0 GiB) is on "
                           "the GPU at this mesh's peak")
    assert f"--no-create-attention-mask-in-dataloader -> peak {bare.timeline.verdict_bytes / GiB:.1f} GiB" in note
    assert note in plan_warnings(plan)


def test_no_mask_no_variant_and_no_note(tmp_path):
    """With the flag given (or a framework other than Megatron Core) nothing builds the mask: no
    variant, no note; the same 128k mesh then fits with its 16 GiB back (not tight, so no note either)."""
    cfg = _load(tmp_path, 131072, 8, 64, "--no-create-attention-mask-in-dataloader\n")
    plan = build_plan(cfg)
    assert not cfg.training.core_attention_mask and mask_variant(plan) == [] and mask_note(plan) is None
    assert not any("attention mask" in w for w in plan_warnings(plan))


def test_meshplan_toml_names_the_field(tmp_path):
    """A meshplan TOML names the field, not the flag."""
    path = tmp_path / "l70.toml"
    path.write_text("""
[model]
catalog = "llama3-70b"
max_position = 262144
[cluster]
system = "dgx-h100"
nodes = 32
[training]
global_batch = 32
seq_len = 262144
sharding = "zero1"
recompute = "full"
param_dtype = "bf16"
framework = "megatron"
megatron_runtime = "core"
[mesh]
names = ["dp", "cp", "tp"]
shape = [2, 16, 8]
sequence_parallel = true
""", encoding="utf-8")
    line = memory_fix(build_plan(load_config(path)))
    assert line.startswith("fix: training.dataloader_attention_mask = false (the data loader's 1 x 1 x 262144 x "
                           "262144 bool attention mask (64.0 GiB), not built) -> peak ")


#: Llama-3-8B at seq 131072 on 8 dgx-h100: dp_shard 8 x cp 8 (cp inside a node, NVLink), torch's ring with
#: the all-to-all rotation, full AC (nc59's l8_a2a.toml).
L8_CP8 = """
[model]
catalog = "llama3-8b"
max_position = 131072
[cluster]
system = "dgx-h100"
nodes = 8
[training]
global_batch = 32
seq_len = 131072
micro_batch = 1
sharding = "zero3"
recompute = "full"
cp_rotate = "alltoall"
{compile}
[mesh]
names = ["dp_shard", "cp"]
shape = [8, 8]
"""


def _row_s(plan, op: str, size: int) -> float:
    """The alpha-beta time of the plan's cp row of ``op`` and ``size`` bytes (all such rows agree)."""
    times = {r.time_s for rows in plan.collectives.values() for r in rows
             if r.axis == "cp" and r.op == op and r.size_bytes == size}
    assert len(times) == 1
    return times.pop()


def test_compiled_ring_exposure_is_every_backward_shift_and_step_says_why(tmp_path):
    """K/V shift: 2 (K, V) x 16384 tokens (131072 / cp 8) x 8 KV heads x 128 x 2 B = 67,108,864 B; dK/dV
    shift in fp32: 134,217,728 B. Eager, each layer's last dK/dV shift is exposed: 32 layers x 4
    micro-batches (32 / dp 8) x t(134 MB). Compiled, every backward shift is waited for at once:
    (cp - 1 = 7) K/V shifts + (cp = 8) dK/dV shifts a layer, 128 x (7 t(67 MB) + 8 t(134 MB)); both within
    1% (NVLink inside the node: nothing shares the link in the model). Only the compiled step notes it."""
    from meshplan.config import load_config
    from meshplan.schedule.steptime import step_time
    steps = {}
    for name, line in (("eager", ""), ("compiled", "torch_compile = true")):
        path = tmp_path / f"{name}.toml"
        path.write_text(L8_CP8.format(compile=line), encoding="utf-8")
        plan = build_plan(load_config(path))
        steps[name] = (plan, step_time(plan))
    plan = steps["eager"][0]
    kv, dkv = _row_s(plan, "send/recv", 2 * 16384 * 8 * 128 * 2), _row_s(plan, "send/recv", 2 * 16384 * 8 * 128 * 4)
    eager, compiled = steps["eager"][1].exposed_s["cp"], steps["compiled"][1].exposed_s["cp"]
    assert abs(eager - 128 * dkv) < 0.01 * eager
    assert abs(compiled - 128 * (7 * kv + 8 * dkv)) < 0.01 * compiled
    said = [n for n in steps["compiled"][1].notes if n.startswith("torch.compile and torch's ring attention")]
    assert len(said) == 1 and "its 7 K/V shifts and its 8 fp32 dK/dV shifts" in said[0]
    assert not any(n.startswith("torch.compile and torch's ring") for n in steps["eager"][1].notes)


def test_ulysses_cp_attention_says_it_is_not_modelled(tmp_path):
    """nc59 #3: ``cp_attention = "ulysses"`` (or "a2a", "a2a+p2p") is an exit-2 error saying what it is and
    that meshplan does not model it, as Megatron-LM's ``--cp-comm-type a2a`` is; a typo keeps the did-you-mean."""
    import pytest
    from meshplan.config import load_config
    from meshplan.errors import ConfigError
    for value, words in (("ulysses", "DeepSpeed-Ulysses's all-to-all over the heads"),
                         ("A2A", "DeepSpeed-Ulysses's all-to-all over the heads"),
                         ("a2a+p2p", "Megatron-LM's hierarchical CP"), ("ringg", "did you mean 'ring'?")):
        path = tmp_path / "c.toml"
        path.write_text(L8_CP8.format(compile="").replace('cp_rotate = "alltoall"', f'cp_attention = "{value}"'),
                        encoding="utf-8")
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert e.value.field == "training.cp_attention" and words in str(e.value)
        assert ("does not model" in str(e.value)) == (value != "ringg")
        # the fix a newcomer asked for (nc60): what to set instead, as the JSON error's "fix" (after "; ")
        from meshplan.cli.error_doc import split_fix
        fix = split_fix(e.value.message)[1] or ""
        assert fix.startswith('set cp_attention = "ring"') == (value != "ringg"), fix
