"""Findings 1, 3, 4 and 8 of newcomer trial 49 (a Megatron-LM core user: Llama-3-70B on 128 x DGX H100,
tp 8 with SP and --tp-comm-overlap, pp 4 x vpp 4, distributed optimizer); each test failed before its fix.
The trial's launch scripts are in ``tests/data/nc49`` (``--nnodes`` written 128 in place of
``${SLURM_NNODES:-128}``).

#1: the precision-aware optimizer's flags, ``--tp-comm-overlap-cfg``, ``--defer-embedding-wgrad-compute``,
``--num-distributed-optimizer-instances``, ``--fp8-param-gather`` and ``PYTORCH_CUDA_ALLOC_CONF`` were
listed as fields meshplan does not use, beside ``--lr``; the dtypes now set the state
(:mod:`meshplan.interop.megatron_precision`, NVIDIA/Megatron-LM d98e8a6), the env line
``[memory] expandable_segments``, the rest one "NOT modelled" note.
#3: fp8 under Megatron-LM/TE was invisible in ``plan`` (the setting line now names the Linear GEMMs' dtype)
and its tp all-gathers moved bf16 (TE quantizes before them: 1 byte a value).
#4: ``--tp-comm-overlap``'s userbuffers were not in the memory timeline (kind ``userbuffers`` now).
#8: ``--transformer-impl local`` was "not used" and the plan ran TE's fp8 and userbuffers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.errors import ConfigError
from meshplan.interop import megatron
from meshplan.interop.common import ImportOptions

DATA = Path(__file__).parent / "data" / "nc49"


def _read(name: str, text: str | None = None):
    return megatron.read(text if text is not None else (DATA / name).read_text(), ImportOptions(cluster="dgx-h100"))


def _state(tables: dict):
    from meshplan.config import config_from_dict
    from meshplan.memory.state import state_bytes
    from meshplan.mesh.layers import stage_layers
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.spec.mesh import MeshSpec
    cfg = config_from_dict(tables)
    mesh = resolve_mesh(MeshSpec(names=["pp", "dp", "tp"], shape=[4, 32, 8]), world=1024)
    return state_bytes(cfg.model, mesh, cfg.training, stage_layers(80, 4))[1]


def test_precision_aware_optimizer_sets_the_state_dtypes():
    """train_variants.sh: --use-precision-aware-optimizer --main-grads-dtype bf16 --main-params-dtype fp16
    --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 under --bf16 and the distributed optimizer (dp 32).
    Megatron-LM d98e8a6: bf16 main grads leave accumulate_allreduce_grads_in_fp32 off (arguments.py:1209-1217),
    so the DDP gradient buffer is bf16 (param_and_grad_buffer.py:924: ``param.dtype`` unless
    grad_reduce_in_fp32) and its reduce-scatter bf16; TE FusedAdam keeps both moments in bf16 and an fp16
    master (optimizer/__init__.py:564-585; the distributed optimizer then keeps no fp32 shard,
    distrib_optimizer.py:421-453). Per element of a stage's N dense parameters: params 2 B + grads 2 B
    (whole) + master 2 B / 32 + moments 2 x 2 B / 32, against 2 + 4 + 4/32 + 8/32 before. Stage 1
    holds 20 layers of Llama-3-70B at tp 8 (no embedding, no head): a layer's linear weights are
    q 8192^2 + k, v 2 x 8192 x 1024 + o 8192^2 + MLP 3 x 8192 x 28672 = 855,638,016, / tp 8 = 106,954,752,
    plus 2 x 8192 norm weights (replicated): N = 20 x 106,971,136 = 2,139,422,720, so
    2 x 2N + ceil(N / 32) x 6 = 8,557,690,880 + 401,141,760 = 8,958,832,640 B."""
    imp = _read("train_variants.sh")
    t = imp.tables["training"]
    assert (t["grad_dtype"], t["grad_reduce_dtype"], t["optimizer_dtype"], t["master_dtype"]) == \
        ("bf16", "bf16", "bf16", "fp16")
    st = _state(imp.tables)
    n = 20 * (855_638_016 // 8 + 2 * 8192)
    assert st.params.total == n == 2_139_422_720
    assert {i.kind: i.bytes_per_element for i in st.items} == {"params": 2, "grads": 2, "master": 2, "optimizer": 4}
    assert st.total_bytes == 2 * 2 * n + -(-n // 32) * 6 == 8_958_832_640
    note = next(x for x in imp.notes if x.startswith("changes memory/communication, NOT modelled"))
    for flag in ("--tp-comm-overlap-cfg", "--defer-embedding-wgrad-compute"):
        assert flag in note and flag not in imp.unused
    # nc61b: --num-distributed-optimizer-instances 2 is now the mesh's dp_replicate (dp 32 = 2 x 16;
    # tests/test_megatron_instances.py), no longer among the unmodelled flags
    assert "--num-distributed-optimizer-instances" not in note + " ".join(imp.unused)
    assert (imp.tables["mesh"]["names"], imp.tables["mesh"]["shape"]) == (["pp", "dp_replicate", "dp_shard", "tp"],
                                                                          [4, 2, 16, 8])
    assert not {"--use-precision-aware-optimizer", "--main-grads-dtype", "--exp-avg-dtype"} & set(imp.unused)


def test_fp32_main_params_keep_int16_remainders():
    """--use-precision-aware-optimizer alone (main params fp32, the default) with bf16 parameters: TE
    FusedAdam's store_param_remainders (Megatron's OptimizerConfig default True, no flag sets it) keeps
    only the 16 low bits of the fp32 master beside each bf16 parameter (TE d0067d0 fused_adam.py
    213-215, 414-415: ``torch.zeros_like(param, dtype=torch.int16)``): 2 B of master, not 4."""
    text = (DATA / "train_llama3_70b.sh").read_text().replace("--use-distributed-optimizer",
                                                                "--use-distributed-optimizer --use-precision-aware-optimizer")
    imp = _read("", text)
    assert imp.tables["training"]["master_dtype"] == "int16"
    assert {i.kind: i.bytes_per_element for i in _state(imp.tables).items}["master"] == 2


@pytest.mark.parametrize("extra, flag", [
    ("--main-grads-dtype bf16", "--main-grads-dtype"),  # optimizer_config.py:467-477 asserts fp32 without it
    ("--use-precision-aware-optimizer --main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32",
     "--main-grads-dtype"),  # arguments.py:1209-1211
    ("--exp-avg-dtype int8", "--exp-avg-dtype")])  # argparse choices fp32 fp16 bf16 fp8
def test_precision_flags_megatron_refuses(extra, flag):
    """What Megatron-LM d98e8a6 refuses is one ConfigError naming the flag."""
    text = (DATA / "train_llama3_70b.sh").read_text().replace("--bf16", f"--bf16 {extra}")
    with pytest.raises(ConfigError) as e:
        _read("", text)
    assert e.value.field == flag


def test_expandable_segments_from_the_env_line():
    """train_exp.sh exports PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: [memory]
    expandable_segments true, and the export is no longer listed as not used."""
    imp = _read("train_exp.sh")
    assert imp.tables["memory"]["expandable_segments"] is True
    assert "export PYTORCH_CUDA_ALLOC_CONF" not in imp.unused


def test_fp8_param_gather_is_read_not_unused():
    """train_fp8pg.sh: --fp8-param-gather and --fp8-recipe delayed. The recipe is per-tensor scaling, what
    the plan's fp8 GEMMs model (not noted). --fp8-param-gather was named in the NOT modelled note until te50
    modelled it (meshplan.memory.te_fp8: the parameters' bytes and the distributed optimizer's all-gather):
    now training.fp8_param_gather, in no note, not unused (its bytes by hand: tests/test_te_fp8.py)."""
    imp = _read("train_fp8pg.sh")
    assert imp.tables["training"]["fp8_param_gather"] is True
    assert not any("--fp8-param-gather" in x or "--fp8-recipe" in x for x in imp.notes)
    assert "--fp8-param-gather" not in imp.unused and "--fp8-recipe" not in imp.unused


def test_transformer_impl_local_plans_without_te():
    """train_local_fp8.sh: --transformer-impl local with --fp8-format hybrid and --tp-comm-overlap. The local
    spec (gpt_builders.py:35, 109-146; backends.py LocalSpecProvider) builds ColumnParallelLinear /
    RowParallelLinear ("tp_comm_buffer_name: Not used") and the unfused DotProductAttention, and Megatron-LM
    asserts neither flag against it: planned with no fp8 GEMM, no TP overlap, no flash attention, one note."""
    imp = _read("train_local_fp8.sh")
    t = imp.tables["training"]
    assert "linear_dtype" not in t and t["tp_comm_overlap"] is False and t["flash_attention"] is False
    assert any(n.startswith("--transformer-impl local") for n in imp.notes)
    assert "--transformer-impl" not in imp.unused


def _tp_rows(linear_dtype, overlap: bool):
    from meshplan import catalog
    from meshplan.comm.collectives import collective_table
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.placement.assign import place
    from meshplan.spec.mesh import MeshSpec
    from meshplan.spec.training import TrainingSpec
    cl = catalog.system("dgx-h100", nodes=1)
    mesh = resolve_mesh(MeshSpec(names=["tp"], shape=[8], sequence_parallel=True), world=8)
    t = TrainingSpec(global_batch=1, seq_len=8192, sharding="none", framework="megatron", megatron_runtime="core",
                     linear_dtype=linear_dtype, tp_comm_overlap=overlap)
    rows = collective_table(catalog.model("llama3-8b"), t, mesh, cl, place(cl, 8), [0, 1], micro_batches=1)
    return {(r.phase, r.dtype): (r.size_bytes, r.per_microbatch) for r in rows if r.axis == "tp" and r.op == "all-gather"}


@pytest.mark.parametrize("overlap", [True, False])
def test_te_fp8_all_gathers_move_one_byte(overlap):
    """#3: under Megatron-LM with --fp8-format, Transformer Engine quantizes before each SP all-gather of
    its linears (TE d0067d0: layernorm_linear.py:292-313 and 776-792, base.py grad_output_preprocess
    1718-1749; through userbuffers initialize_ub's uint8 buffers, base.py:336-345, 391, 472-476, and
    fill_userbuffers_buffer_for_all_gather 657-677; through NCCL distributed.py:1735-1745 _all_gather_fp8).
    Llama 3 8B, two layers on one stage, seq 8192, tp 8: a gathered activation is 8192 x 4096 values,
    67,108,864 B in bf16, 33,554,432 B in fp8. Per layer 2 forward (qkv and fc1 inputs) and 4 backward
    (their re-gathers for the weight gradients, proj's and fc2's output gradients) in fp8: 4 and 8 for
    two layers; the output layer's input gather stays bf16 (Megatron-Core's own linear: 1 forward, and
    backward with the embedding's 2)."""
    rows = _tp_rows("fp8", overlap)
    assert rows[("forward", "fp8")] == (33_554_432, 4) and rows[("backward", "fp8")] == (33_554_432, 8)
    assert rows[("forward", "bf16")] == (67_108_864, 1) and rows[("backward", "bf16")] == (67_108_864, 2)
    assert ("forward", "fp8") not in _tp_rows(None, overlap)


def test_plan_names_the_linear_dtype():
    """#3: fp8 was invisible in plan's setting line; it now says the Linear GEMMs run in fp8 (and the
    precision-aware optimizer's moments and master where not fp32)."""
    from meshplan.config import config_from_dict
    t = config_from_dict(_read("train_llama3_70b_fp8.sh").tables).training
    assert t.dtype_words == "params bf16, linear GEMMs fp8, grads fp32, reduce fp32"
    t = config_from_dict(_read("train_variants.sh").tables).training
    assert t.dtype_words == "params bf16, grads bf16, reduce bf16, moments bf16, master fp16"


@pytest.mark.parametrize("name, fp8, want", [("train_llama3_70b.sh", False, 1_610_612_736),
                                             ("train_llama3_70b_fp8.sh", True, 1_073_741_824)])
def test_userbuffers_in_the_timeline(name, fp8, want):
    """#4: --tp-comm-overlap's userbuffers were not in the memory timeline. Megatron-LM d98e8a6
    initialize.py:217-246 calls TE's initialize_ub(shape=[seq 8192 x micro-batch 1 / cp 1, hidden 8192]),
    which (TE d0067d0 base.py:336-360, 391, 472-476) registers one buffer per GEMM pass of its 12 default
    methods, 67,108,864 elements each (comm_gemm_overlap.cpp:410-425, 805-828): bf16 12 x 2 B =
    1,610,612,736 B; with fp8 the 8 all-gather buffers uint8: 8 x 1 + 4 x 2 B = 1,073,741,824 B. The
    init of every stage holds them (kind userbuffers, outside PyTorch's allocator), and the search's
    fixed memory counts them too."""
    import numpy as np
    from meshplan.config import config_from_dict
    from meshplan.memory.timeline import UNTRACKED_KINDS
    from meshplan.plan import build_plan
    from meshplan.search.buffer_bounds import userbuffers_bytes
    cfg = config_from_dict(_read(name).tables)
    assert cfg.training.linear_dtype == ("fp8" if fp8 else None)
    plan = build_plan(cfg)
    assert all(tl.max_by_kind["userbuffers"] == want for tl in plan.timelines)
    assert "userbuffers" in UNTRACKED_KINDS
    c = type("C", (), {"tp": np.array([8, 1, 8]), "mb": np.array([1, 1, 1]), "cp": np.array([1, 1, 1]),
                       "ov": np.array([1, 1, 0])})()
    assert userbuffers_bytes(cfg, c).tolist() == [want, 0, 0]


def test_int16_master_needs_bf16_parameters():
    """``master_dtype = "int16"`` is Transformer Engine's ``store_param_remainders``: the 16 low bits of the
    fp32 master, whose 16 high bits are the bf16 parameter (bf16 is fp32's upper half: 1 sign, 8 exponent,
    7 mantissa bits). An fp16 parameter (5 exponent bits) is no half of an fp32, so the remainder cannot
    rebuild the master: one line naming the field and the fix. The importer already writes int16 beside bf16
    only (megatron_precision: ``"int16" if param_dtype == "bf16"``); a bf16 plan keeps 2 B a parameter."""
    from pydantic import ValidationError

    from meshplan.spec.training import TrainingSpec
    with pytest.raises(ValidationError, match='master_dtype "int16".*param_dtype is \'fp16\'.*set param_dtype'):
        TrainingSpec(global_batch=8, seq_len=16, param_dtype="fp16", master_dtype="int16")
    assert TrainingSpec(global_batch=8, seq_len=16, param_dtype="bf16", master_dtype="int16").master_bytes == 2
