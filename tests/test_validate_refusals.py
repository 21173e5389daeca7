"""validate's refusals (meshplan.runtime.validation.refusals), decided before anything runs: each
names a fix that the config checks and the other refusals accept. Review of stop 41's source diff."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.runtime.validation.refusals import framework_refusal
from meshplan.spec.training import TrainingSpec
from meshplan.spec.training_checks import MEGATRON_ONLY


def _cfg(training: dict, names: list[str], shape: list[int], model: str = "llama3-8b", **mesh):
    return config_from_dict({"model": {"catalog": model}, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 64, "seq_len": 4096, **training},
                             "mesh": {"names": names, "shape": shape, **mesh}})


def test_megatron_only_keys_have_one_home():
    """spec.training_checks.MEGATRON_ONLY is the one list: TrainingSpec refuses each key at its
    Megatron-LM value under framework "torch" in that key's line, and validate's framework refusal
    names the keys a Megatron-LM plan sets, in the list's order. By hand: the plan below sets
    overlap_grad_reduce true, overlap_param_gather true and pp_p2p_overlap false (megatron_fsdp
    and the warmup flush left at their defaults), so those three, in that order."""
    for key, (value, line) in MEGATRON_ONLY.items():
        with pytest.raises(ValueError) as e:  # pydantic's ValidationError is a ValueError
            TrainingSpec(global_batch=8, seq_len=16, **{key: value})
        assert line.format(framework="torch") in str(e.value)
    cfg = _cfg({"sharding": "zero1", "framework": "megatron", "overlap_grad_reduce": True,
                "overlap_param_gather": True, "pp_p2p_overlap": False}, ["pp", "dp"], [2, 4])
    assert framework_refusal(cfg) == [
        "training.framework is 'megatron': validate runs torch.distributed, which issues torch's collectives; set "
        "framework = \"torch\" and remove overlap_grad_reduce, overlap_param_gather, pp_p2p_overlap (Megatron-LM's "
        "only) to validate this mesh"]


def test_refusals_are_decided_without_torch(tmp_path):
    """validate's refusals import what the runtime builds from runtime/execution/buildable.py, which
    imports no torch (refusals.py imported parallelize inside a function, loading torch for every
    check). A fresh interpreter lists the refusals of a zero1 mesh and has not loaded torch: by hand,
    dp 8 under zero1 is refused (ZeRO-1/2 not built), and of none, zero3, hsdp the mesh builds none
    (dense, tp = cp = 1) and zero3 (hsdp needs a dp_replicate axis)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from meshplan.config import config_from_dict\n"
            "from meshplan.mesh.resolve import resolve_mesh\n"
            "from meshplan.runtime.validation.refusals import config_mesh, runtime_refusals\n"
            "cfg = config_from_dict({'model': {'catalog': 'llama3-8b'}, 'cluster': {'system': 'dgx-h100', "
            "'nodes': 1}, 'training': {'global_batch': 64, 'seq_len': 4096, 'sharding': 'zero1'}, "
            "'mesh': {'names': ['dp'], 'shape': [8]}})\n"
            "print(runtime_refusals(cfg, resolve_mesh(config_mesh(cfg), 8)))\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.splitlines() == [
        "[\"sharding 'zero1': ZeRO-1/2 (a sharded optimizer) is not built; use none (DDP) or zero3 (FSDP2 over the "
        "data axes, as torchtitan)\"]", "False"]


def test_framework_fix_names_tp_comm_overlap_which_torch_refuses_uncompiled():
    """A Megatron-LM plan with --tp-comm-overlap (tp_comm_overlap true; framework "megatron" refuses
    torch_compile): framework "torch" refuses tp_comm_overlap without torch.compile, so the fix
    "set framework = torch and remove ..." must name it too (it named only the Megatron-LM keys, and
    the config then failed to load on tp_comm_overlap). By hand: overlap_grad_reduce (MEGATRON_ONLY),
    then tp_comm_overlap, named apart: it is no Megatron-LM-only key (framework torch takes it with
    torch_compile, as async TP), as the message said of both; with both removed, framework torch and sharding zero3 (the sharding
    refusal's fix at tp 2: DDP is refused with tp > 1, hsdp without dp_replicate) nothing is refused."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import config_mesh, runtime_refusals

    meg = {"sharding": "zero1", "framework": "megatron", "overlap_grad_reduce": True, "tp_comm_overlap": True}
    cfg = _cfg(meg, ["dp", "tp"], [4, 2], sequence_parallel=True)
    assert runtime_refusals(cfg, resolve_mesh(config_mesh(cfg), 8)) == [
        "training.framework is 'megatron': validate runs torch.distributed, which issues torch's collectives; set "
        "framework = \"torch\" and remove overlap_grad_reduce (Megatron-LM's only) and tp_comm_overlap (under "
        "torch, async TP, which needs torch_compile) to validate this mesh",
        "sharding 'zero1': ZeRO-1/2 (a sharded optimizer) is not built; use zero3 (FSDP2 over the data axes, as "
        "torchtitan)"]
    fixed = _cfg({"sharding": "zero3", "framework": "torch"}, ["dp", "tp"], [4, 2], sequence_parallel=True)
    assert runtime_refusals(fixed, resolve_mesh(config_mesh(fixed), 8)) == []


def test_pipeline_refusals_come_with_the_others_and_fixes_hold_under_pp():
    """pp 2 x dp 4, 1F1B, zero1, recompute 'layer' (torchtitan's per-layer AC). The pipelined runtime
    builds neither DDP nor per-layer checkpointing on its stages. Before: the one run said only
    "sharding 'zero1' ... use none (DDP) or zero3", and the pipeline's own checks ran only once
    nothing else was refused; following it (sharding none) the next run refused recompute 'layer',
    and the next DDP under pp. By hand: of none, zero3, hsdp the mesh builds zero3 alone (none:
    pp 2 > 1; hsdp: no dp_replicate axis); recompute under pp: 'full' or 'none'. Both in one run;
    with zero3 and recompute full nothing is refused."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import config_mesh, runtime_refusals

    cfg = _cfg({"sharding": "zero1", "recompute": "layer"}, ["pp", "dp"], [2, 4], pp_schedule="1f1b")
    assert runtime_refusals(cfg, resolve_mesh(config_mesh(cfg), 8)) == [
        "recompute 'layer' (torchtitan selective AC) under pp: the stage modules checkpoint all layers or none; use "
        "'full' or 'none'",
        "sharding 'zero1': ZeRO-1/2 (a sharded optimizer) is not built; use zero3 (FSDP2 over the data axes, as "
        "torchtitan)"]
    fixed = _cfg({"sharding": "zero3", "recompute": "full"}, ["pp", "dp"], [2, 4], pp_schedule="1f1b")
    assert runtime_refusals(fixed, resolve_mesh(config_mesh(fixed), 8)) == []


def test_engine_fix_names_the_deepspeed_keys_the_config_refuses_without_it():
    """A DeepSpeed ZeRO-3 plan with overlap_comm (zero_optimization.overlap_comm, which every
    DeepSpeed import may carry): validate's fix "set zero3_engine = fsdp2" left a config that fails
    to load ("overlap_comm is DeepSpeed's ...: set the engine or remove it"). By hand: zero3 keeps
    contiguous_gradients (DeepSpeed ZeRO-3's and FSDP2's sharding alike), so only overlap_comm; under
    zero2 with zero12_engine deepspeed both keys go (contiguous_gradients needs zero3 or DeepSpeed's
    ZeRO-1/2), and zero2 itself is refused (ZeRO-1/2 not built; of none, zero3, hsdp at dp 8: none
    and zero3). With the fixes applied the config loads and nothing is refused."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import config_mesh, runtime_refusals

    ds3 = _cfg({"sharding": "zero3", "zero3_engine": "deepspeed", "overlap_comm": True,
                "contiguous_gradients": True}, ["dp"], [8])
    assert runtime_refusals(ds3, resolve_mesh(config_mesh(ds3), 8)) == [
        "training.zero3_engine is 'deepspeed': validate shards parameters with torch's FSDP2; set zero3_engine = "
        "\"fsdp2\" and remove overlap_comm (DeepSpeed's only) to validate this mesh"]
    ds2 = _cfg({"sharding": "zero2", "zero12_engine": "deepspeed", "overlap_comm": True,
                "contiguous_gradients": True}, ["dp"], [8])
    assert runtime_refusals(ds2, resolve_mesh(config_mesh(ds2), 8)) == [
        "training.zero12_engine is 'deepspeed': validate runs torch.distributed, not DeepSpeed's ZeRO-1/2 engine; "
        "remove zero12_engine, overlap_comm, contiguous_gradients to validate this mesh",
        "sharding 'zero2': ZeRO-1/2 (a sharded optimizer) is not built; use none (DDP) or zero3 (FSDP2 over the data "
        "axes, as torchtitan)"]
    fixed = _cfg({"sharding": "zero3", "contiguous_gradients": True}, ["dp"], [8])
    assert runtime_refusals(fixed, resolve_mesh(config_mesh(fixed), 8)) == []


def test_framework_fix_names_the_deepep_dispatcher_which_torch_refuses():
    """A Megatron-LM MoE plan with --moe-token-dispatcher-type flex and the DeepEP backend
    (moe_dispatcher "deepep"): validate's fix "set framework = torch and remove ..." must name it too.
    Before, it named only overlap_grad_reduce, and the config then failed to load. Since newcomer 48
    (finding 2) framework torch plans "deepep" as torchtitan's expert_parallel_comm_backend, but the
    runtime model dispatches with torch's all-to-all (buildable.unsupported_reasons refuses deepep), so
    the fix names it apart, with that reason. By hand: overlap_grad_reduce (MEGATRON_ONLY), then
    moe_dispatcher; with both removed, framework torch and sharding zero3 the config loads and nothing
    is refused; with deepep kept under torch, the runtime's refusal is the one line."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import config_mesh, runtime_refusals

    meg = {"sharding": "zero1", "framework": "megatron", "overlap_grad_reduce": True, "moe_dispatcher": "deepep"}
    cfg = _cfg(meg, ["dp", "ep"], [8, 8], model="mixtral-8x7b")
    assert framework_refusal(cfg) == [
        "training.framework is 'megatron': validate runs torch.distributed, which issues torch's collectives; set "
        "framework = \"torch\" and remove overlap_grad_reduce (Megatron-LM's only) and moe_dispatcher (torchtitan's "
        "DeepEP under torch, but the runtime dispatches with torch's all-to-all) to validate this mesh"]
    fixed = _cfg({"sharding": "zero3", "framework": "torch"}, ["dp", "ep"], [8, 8], model="mixtral-8x7b")
    assert runtime_refusals(fixed, resolve_mesh(config_mesh(fixed), 8)) == []
    kept = _cfg({"sharding": "zero3", "framework": "torch", "moe_dispatcher": "deepep"}, ["dp", "ep"], [8, 8],
                model="mixtral-8x7b")
    assert runtime_refusals(kept, resolve_mesh(config_mesh(kept), 8)) == [
        "moe_dispatcher deepep: the runtime model dispatches with torch's all-to-all (DeepEP's kernels need deep_ep "
        "on NVLink/RDMA GPUs); set moe_dispatcher = \"alltoall\" to validate the mesh"]


def test_fixes_name_the_session_s_keys_and_alibi_names_its_field():
    """Review rv48. Each fix must leave a config that loads: (1) a DeepSpeed ZeRO-3 plan with ZeRO++
    (zero_hpz_partition_size 8, zero_quantized_weights) was told "set zero3_engine = fsdp2", and the
    ZeRO++ keys are then refused (DeepSpeed's ZeRO-3 alone reads them): the fix names them; (2) a
    Megatron-DeepSpeed plan with DeepSpeed's PipelineEngine and Megatron-LM's recompute modules was
    told "set framework = torch" without pp_engine and recompute_modules, each refused under torch;
    (3) the ALiBi refusal (bloom48) was raised naming the field "mesh" (refused_field's default):
    it names model.position_embedding. By hand, from the rules' words: ZeRO++'s keys in ZEROPP_KEYS'
    order; the framework's keys as torch_refused_keys lists them, pp_engine apart (DeepSpeed's)."""
    from meshplan.mesh.resolve import resolve_mesh
    from meshplan.runtime.validation.refusals import config_mesh, refused_field, runtime_refusals

    zpp = _cfg({"sharding": "zero3", "zero3_engine": "deepspeed", "zero_hpz_partition_size": 8,
                "zero_quantized_weights": True}, ["dp"], [8])
    assert ("set zero3_engine = \"fsdp2\" and remove zero_hpz_partition_size, zero_quantized_weights (DeepSpeed's "
            "only)") in runtime_refusals(zpp, resolve_mesh(config_mesh(zpp), 8))[0]
    mds = _cfg({"sharding": "zero1", "framework": "megatron", "zero12_engine": "deepspeed", "pp_engine": "deepspeed",
                "recompute_modules": ["core_attn", "mlp"]}, ["pp", "dp"], [2, 4])
    assert framework_refusal(mds) == [
        "training.framework is 'megatron': validate runs torch.distributed, which issues torch's collectives; set "
        "framework = \"torch\" and remove recompute_modules (Megatron-LM's only) and pp_engine (DeepSpeed's "
        "PipelineEngine under Megatron-DeepSpeed) to validate this mesh"]
    assert refused_field("model.position_embedding is 'alibi': validate's model runs RoPE") == "model.position_embedding"
