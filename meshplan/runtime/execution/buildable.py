"""What the runtime builds, decided without torch: every reason :func:`~meshplan.runtime.execution.parallelize.parallelize`
(:func:`unsupported_reasons`) or the pipelined runtime (:func:`unsupported_pipeline`,
:mod:`meshplan.runtime.execution.pipelined`) refuses a mesh, each with its fix. The builders refuse
by these rules when they run, and ``meshplan validate`` lists them all before any process starts
(:mod:`meshplan.runtime.validation.refusals`), without importing torch.
"""

from __future__ import annotations

from typing import Optional

from meshplan.mesh.resolve import Mesh
from meshplan.pipeline.registry import SCHEDULES, get
from meshplan.pipeline.vshape import RESHARD_DEFECT, RESHARD_FIX, VShaped, reshard_defect
from meshplan.spec.axes.moe_tp import experts_over_tp
from meshplan.spec.training import TrainingSpec

#: The pipeline schedules the pipelined runtime runs (those registered with ``runs_in_validate``).
BUILT_SCHEDULES = tuple(name for name, s in SCHEDULES.items() if s.runs_in_validate)


#: The shardings the runtime builds: DDP, FSDP2, HSDP (:func:`sharding_refusal`).
BUILT_SHARDINGS = ("none", "zero3", "hsdp")


def unsupported_mesh(mesh: Mesh, training: TrainingSpec, pipeline: bool = False, moe: bool = False) -> Optional[str]:
    """Why the runtime cannot build ``mesh`` (the first of :func:`unsupported_reasons`), None when it can."""
    return next(iter(unsupported_reasons(mesh, training, pipeline, moe)), None)


def unsupported_reasons(mesh: Mesh, training: TrainingSpec, pipeline: bool = False, moe: bool = False) -> list[str]:
    """Every reason the runtime cannot build ``mesh``, each with its fix; ``pipeline``: pp > 1 is
    built elsewhere (:mod:`meshplan.runtime.execution.pipelined`; its own limits besides these:
    :func:`pipeline_reasons`); ``moe``: the model has MoE layers. A sharding refused names only
    the shardings this mesh can be built with (:func:`sharding_refusal` of each of
    :data:`BUILT_SHARDINGS`), and a recompute only those its pp builds, never one that another
    check then refuses."""
    if mesh.degree("pp") > 1 and not pipeline:
        return ["pp > 1: pipeline stages are not built by parallelize(); use torch.distributed.pipelining"]
    out = []
    if moe and mesh.degree("cp") > 1:
        out.append("cp > 1 with MoE layers: context parallelism is built for dense models only")
    if training.linear_dtype is not None:
        out.append("linear_dtype fp8: torchtitan's float8 training (torchao Float8Linear) is not built in the runtime "
                   "model (and float8 GEMMs need an sm89+ GPU)")
    if mesh.degree("pp") > 1 and training.recompute in ("layer", "op"):
        out.append(f"recompute {training.recompute!r} (torchtitan selective AC) under pp: the stage modules "
                   "checkpoint all layers or none; use 'full' or 'none'")
    elif mesh.degree("pp") > 1 and training.per_layer_recompute:
        out.append(f"recompute_num_layers {training.recompute_num_layers} (Megatron-LM's block recompute) under pp: the "
                   "stage modules checkpoint all layers or none; remove it (every layer) or use 'none'")
    elif training.recompute == "op":
        out.append("recompute 'op' (torchtitan op-level selective AC): the runtime model checkpoints whole layers "
                   "only; use 'layer', 'full' or 'none'")
    if moe and training.moe_dispatcher == "deepep":
        out.append("moe_dispatcher deepep: the runtime model dispatches with torch's all-to-all (DeepEP's kernels "
                   "need deep_ep on NVLink/RDMA GPUs); set moe_dispatcher = \"alltoall\" to validate the mesh")
    if mesh.etp > 1 and not (mesh.ep == 1 and experts_over_tp("torch", mesh.etp, mesh.degree("tp"))):
        out.append("etp > 1: expert tensor parallelism is built only as torchtitan's at ep 1 (etp = tp); with ep > 1 "
                   "the experts are whole on each ep rank (etp 1)")
    why = sharding_refusal(mesh, training.sharding, moe)
    if why is not None:
        fixes = [s for s in BUILT_SHARDINGS if s != training.sharding and sharding_refusal(mesh, s, moe) is None]
        words = {"none": "none (DDP)", "zero3": "zero3 (FSDP2 over the data axes, as torchtitan)", "hsdp": "hsdp"}
        out.append(f"{why}; " + (f"use {' or '.join(words[s] for s in fixes)}" if fixes else
                                 "no sharding the runtime builds runs this mesh"))
    if mesh.degree("cp") > 1 and training.cp_kind != "allgather":  # last: a fix of the config, not of the mesh
        what = {"ring": "torch's context_parallel ring attention, the default under framework torch",
                "p2p": "Transformer Engine's p2p ring, the default under framework megatron"}[training.cp_kind]
        out.append(f"cp > 1 with training.cp_attention '{training.cp_kind}' ({what}): the runtime builds Llama 3's "
                   "all-gather CP only; set cp_attention = \"allgather\"")
    return out


def sharding_refusal(mesh: Mesh, sharding: str, moe: bool = False) -> Optional[str]:
    """Why the runtime cannot shard ``mesh`` as ``sharding`` (None when it can): DDP (apply_ddp)
    is plain data parallelism of a dense model without pipeline stages; HSDP replicates over a dp_replicate axis
    (:func:`fsdp_mesh`); ZeRO-1/2 are not built.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> m = resolve_mesh(MeshSpec(names=["dp", "tp"], shape=[2, 2]), world=4)
    >>> [s for s in BUILT_SHARDINGS if sharding_refusal(m, s) is None]
    ['zero3']
    >>> sharding_refusal(resolve_mesh(MeshSpec(names=["pp", "dp"], shape=[2, 2]), world=4), "none")
    "sharding 'none' with pp > 1: DDP is not built on pipeline stages (FSDP2 and HSDP are)"
    """
    if sharding == "none":
        if mesh.degree("tp") > 1:
            return "sharding 'none' with tp > 1: DDP over DTensor TP parameters leaves their gradients None (torch 2.13)"
        if mesh.degree("cp") > 1:
            return "sharding 'none' with cp > 1: DDP is built for plain data parallelism only (tp = cp = 1)"
        if mesh.degree("pp") > 1:
            return "sharding 'none' with pp > 1: DDP is not built on pipeline stages (FSDP2 and HSDP are)"
        return "sharding 'none' with MoE layers: DDP is built for dense models only" if moe else None
    if sharding == "hsdp" and "dp_replicate" not in mesh.layout.names:
        return "sharding 'hsdp' needs a dp_replicate axis to replicate over"
    if sharding not in ("zero3", "hsdp"):
        return f"sharding {sharding!r}: ZeRO-1/2 (a sharded optimizer) is not built"
    return None


def unsupported_pipeline(mesh, training, schedule: str, model_spec=None) -> Optional[str]:
    """Why :mod:`meshplan.runtime.execution.pipelined` cannot run ``mesh`` with pipeline ``schedule``
    (None when it can): the first of :func:`pipeline_reasons` and :func:`unsupported_reasons`."""
    if mesh.degree("pp") <= 1:
        return "pp is 1: use parallelize()"
    moe = model_spec is not None and model_spec.is_moe
    return next(iter(pipeline_reasons(mesh, training, schedule, model_spec)
                     + unsupported_reasons(mesh, training, pipeline=True, moe=moe)), None)


def pipeline_reasons(mesh, training, schedule: str, model_spec=None) -> list[str]:
    """Every reason the pipelined runtime cannot run ``mesh`` (pp > 1) with ``schedule`` besides
    :func:`unsupported_reasons` (which holds under pp too: etp, float8, recompute, sharding)."""
    out = []
    if schedule not in BUILT_SCHEDULES:
        out.append(f"pp_schedule {str(schedule)!r}: only {', '.join(BUILT_SCHEDULES)} are built")
    if (model_spec is not None and model_spec.is_moe and mesh.degree("fsdp") * mesh.degree("dp_replicate") == 1
            and mesh.degree("efsdp") > 1):
        out.append("MoE layers with fsdp 1 and efsdp = tp / ep > 1 under pp: the routed experts would be FSDP2 units "
                   "without an FSDP root on the stage module, which the schedule does not hold back from "
                   "reduce-scattering and resharding every micro-batch (torch 2.13), unlike the plan's table")
    if schedule in BUILT_SCHEDULES and isinstance(get(schedule), VShaped) and reshard_defect(  # torch's runtime
            "torch", mesh.degree("pp"), mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1,
            training.reshard_after_forward):
        out.append(f"{schedule} with FSDP2 over a data axis and reshard_after_forward true: {RESHARD_DEFECT}; "
                   f"fix: {RESHARD_FIX}")
    tied = model_spec is not None and model_spec.tied_embeddings
    if tied and schedule in BUILT_SCHEDULES and get(schedule).last_stage(mesh.degree("pp"), 2) == 0:
        out.append(f"tied embeddings with {schedule}: the embedding and the output layer are two chunks of rank 0 "
                   "(a V); sharing one weight across two pipeline stages is not built")
    elif tied and mesh.degree("pp") > 2:
        out.append("tied embeddings with pp > 2: the embedding group (first and last stage) is no axis of the mesh, "
                   "so the comparison cannot name it; pp = 2 is built")
    return out
