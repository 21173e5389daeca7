"""Every reason ``meshplan validate`` refuses to start, found in one pass before anything runs:
a world size the mesh cannot be re-sized to (:func:`meshplan.runtime.validation.scaling.scale_mesh`,
with the smallest world that works) and each thing the runtime does not build
(:func:`runtime_refusals`). The trial of issue 11 (Mixtral 8x22B) met them one run at a time,
and two fixes suggested were refused by the next check (framework "torch" with Megatron-LM's
overlap keys left in; sharding "none" with tp > 1): each refusal here names a fix that the
other checks accept.
"""

from __future__ import annotations

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Infeasible, Mesh, resolve_mesh
from meshplan.runtime.execution.buildable import pipeline_reasons, unsupported_reasons
from meshplan.runtime.validation.options import Options
from meshplan.runtime.validation.scaling import config_mesh, micro_batch_refusal, scale_config
from meshplan.spec.training_checks import deepspeed_refused_keys, torch_refused_keys


def framework_refusal(cfg: Config) -> list[str]:
    """The refusal of a plan in another framework's order (validate runs torch.distributed), its fix
    naming the keys that framework "torch" refuses in turn
    (:func:`~meshplan.spec.training_checks.torch_refused_keys`): Megatron-LM's only, and its
    ``tp_comm_overlap``, named apart (not Megatron-LM's only: under torch it is async TP, which
    needs torch.compile), and ``moe_dispatcher = "deepep"`` (torch's too, torchtitan's DeepEP backend,
    but the runtime builds torch's all-to-all: :func:`~meshplan.runtime.execution.buildable.unsupported_reasons`).

    >>> from meshplan.config import config_from_dict
    >>> c = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 4096, "sharding": "zero1", "framework": "megatron",
    ...                  "overlap_grad_reduce": True}, "mesh": {"names": ["dp"], "shape": [8]}})
    >>> framework_refusal(c)[0][-97:]
    'set framework = "torch" and remove overlap_grad_reduce (Megatron-LM\\'s only) to validate this mesh'
    """
    t = cfg.training
    if t.framework == "torch":
        return []
    keys = torch_refused_keys(t)
    megatron = [k for k in keys if k not in ("tp_comm_overlap", "pp_engine")]  # tp_comm_overlap: torch's too
    parts = [f"{', '.join(megatron)} (Megatron-LM's only)"] * bool(megatron) + [
        "pp_engine (DeepSpeed's PipelineEngine under Megatron-DeepSpeed)"] * ("pp_engine" in keys) + [
        "tp_comm_overlap (under torch, async TP, which needs torch_compile)"] * ("tp_comm_overlap" in keys) + [
        "moe_dispatcher (torchtitan's DeepEP under torch, but the runtime dispatches with torch's all-to-all)"] * (
        t.moe_dispatcher == "deepep")
    also = f" and remove {' and '.join(parts)}" if parts else ""
    return [f"training.framework is '{t.framework}': validate runs torch.distributed, which issues torch's "
            f"collectives; set framework = \"torch\"{also} to validate this mesh"]


def runtime_refusals(cfg: Config, mesh: Mesh, pipelined: bool = True) -> list[str]:
    """Every reason the runtime cannot build the scaled ``cfg``'s resolved ``mesh``, each with
    its fix: the framework and engines, :func:`meshplan.runtime.execution.buildable.unsupported_reasons`,
    and for pp > 1 (``pipelined``: the config is the scaled one) the pipeline's own,
    :func:`meshplan.runtime.execution.buildable.pipeline_reasons`, whatever else is refused."""
    t = cfg.training
    out = framework_refusal(cfg)
    keys = deepspeed_refused_keys(t)  # refused with the DeepSpeed engine gone
    also = f" and remove {', '.join(keys)} (DeepSpeed's only)" if keys else ""
    if t.zero3_engine != "fsdp2":
        out.append(f"training.zero3_engine is '{t.zero3_engine}': validate shards parameters with torch's FSDP2; "
                   f"set zero3_engine = \"fsdp2\"{also} to validate this mesh")
    if t.zero12_engine != "megatron":
        out.append(f"training.zero12_engine is '{t.zero12_engine}': validate runs torch.distributed, not DeepSpeed's "
                   f"ZeRO-1/2 engine; remove {', '.join(['zero12_engine'] + keys)} to validate this mesh")
    out += unsupported_reasons(mesh, t, pipeline=True, moe=cfg.model.is_moe)
    if cfg.model.qk_norm:  # the runtime model raises at build time (execution/model.py Transformer), after torchrun
        out.append("model.qk_norm is true: validate's model has no per-head RMSNorm of q and k (Qwen3's qk-norm); "
                   "set qk_norm = false in a copy to validate this mesh (the norms' parameters and kernels are "
                   "small; the collectives are the same)")
    if cfg.model.position_embedding == "alibi":
        out.append("model.position_embedding is 'alibi': validate's model runs RoPE or learned positions, not an "
                   "ALiBi bias on the scores; set position_embedding = \"rope\" to validate this mesh")
    if pipelined and mesh.degree("pp") > 1:  # the pipeline's own, beside the others
        out += pipeline_reasons(mesh, t, config_mesh(cfg).pp_schedule, cfg.model)
    return out


def refusals(config: Config, opt: Options) -> list[ConfigError]:
    """Every refusal of a validate run of ``config`` over ``opt.worlds``, one ConfigError each:
    each world that cannot be scaled (its own line, naming the smallest world that can) or whose
    pipeline refuses ``--micro-batches`` (:func:`~meshplan.runtime.validation.scaling.micro_batch_refusal`), then each
    reason the runtime cannot build the mesh, once, with the worlds it holds for. A world that
    cannot be scaled is checked on the config's own mesh (its degrees other than the data axis
    are the same), so its other refusals come in the same run."""
    spec = config_mesh(config)
    base = resolve_mesh(spec, spec.world or config.cluster.world)
    errors: list[ConfigError] = []
    worlds: dict[str, list[int]] = {}
    for w in opt.worlds:
        try:
            cfg, _ = scale_config(config, w, opt)
            mesh, pipelined = resolve_mesh(config_mesh(cfg), w), True
            refused = micro_batch_refusal(config, w, opt)  # a --micro-batches the schedule refuses
            errors += [ConfigError("--micro-batches", refused)] if refused else []
        except ConfigError as e:
            errors.append(e)
            cfg, mesh, pipelined = config, base, False  # the scaled model is what the pipeline checks
        if isinstance(mesh, Infeasible):
            continue
        for why in runtime_refusals(cfg, mesh, pipelined):
            worlds.setdefault(why, []).append(w)
    return errors + [ConfigError(refused_field(why), f"world{'s' * (len(ws) > 1)} {', '.join(map(str, ws))}: the "
                                 f"runtime cannot build this mesh: {why}; validate a mesh without it (the plan itself "
                                 f"does not need the runtime)") for why, ws in worlds.items()]


#: The field a runtime refusal names, by its reason's first words (:func:`runtime_refusals`); the
#: others are the mesh's (newcomer trial 48 #5: float8 was refused naming ``mesh``).
REFUSED_FIELDS = (("linear_dtype", "training.linear_dtype"), ("recompute", "training.recompute"),
                  ("training.framework", "training.framework"), ("training.zero3_engine", "training.zero3_engine"),
                  ("training.zero12_engine", "training.zero12_engine"), ("sharding", "training.sharding"),
                  ("model.position_embedding", "model.position_embedding"), ("model.qk_norm", "model.qk_norm"))


def refused_field(why: str) -> str:
    """The field of the refusal ``why`` (:data:`REFUSED_FIELDS`), ``mesh`` for a degree's.

    >>> refused_field("linear_dtype fp8: torchtitan's float8 training ..."), refused_field("cp > 1 with MoE layers")
    ('training.linear_dtype', 'mesh')
    """
    return next((field for words, field in REFUSED_FIELDS if why.startswith(words)), "mesh")
