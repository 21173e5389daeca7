"""What an export gives back: the meshplan fields in which a config read back from its export
(``meshplan export`` of :mod:`meshplan.interop.export`, then the target's reader) differs
from the config written, as ``table.key: A -> B`` lines (:func:`differences`). The model is
compared by its resolved fields
(:meth:`~meshplan.spec.model.ModelSpec.architecture`), the mesh by what a plan depends on
(:func:`mesh_key`), the MoE routing and the [memory] table as they resolve, so that a value
left unset and the same value given are no difference. Where a caller gives each config's
predicted step (:data:`StepOf`), the step after the round trip and the parts that moved
(:func:`step_line`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Callable, Mapping

from meshplan.config import Config
from meshplan.interop.tomlout import mesh_spec, resolved, virtual_split


def differences(a: Config, b: Config) -> list[str]:
    """The meshplan fields in which ``b`` (a re-imported export) differs from ``a``, as
    ``table.key: A -> B`` lines; the model by its fields (not its name or source), the mesh
    by its degrees, options and layer split, the [memory] table when ``a`` sets it (but
    ``cross_entropy``, the loss of whichever runtime runs the export, ``expandable_segments``,
    the allocator option of its launch script, and ``sp_gathered_input``, what its tensor parallelism
    saves)."""
    out = []
    ma, mb = a.model.architecture(), b.model.architecture()
    out += [f"model.{k}: {ma[k]!r} -> {mb[k]!r}" for k in ma if ma[k] != mb[k]]
    # reshard_after_forward unset as each mesh's pp resolves it (TrainingSpec.at_pp): unset and false under pp agree
    ta, tb = (_routed(c.training.at_pp(resolved(c).degree("pp")), a.model.is_moe) for c in (a, b))
    # op_sac_policy as planned (TrainingSpec.op_sac): unset and a torchtitan import's "238fa99" plan the same SAC
    ta["op_sac_policy"], tb["op_sac_policy"] = a.training.op_sac, b.training.op_sac
    # fp8_tp as it acts (float8 tensorwise Linears under torch at tp > 1): elsewhere true and false plan the same
    ta["fp8_tp"], tb["fp8_tp"] = (c.training.float8_tp_gathers and resolved(c).degree("tp") > 1 for c in (a, b))
    out += [f"training.{k}: {ta[k]!r} -> {tb[k]!r}" for k in ta if ta[k] != tb[k]]
    if a.training.gradient_reduce_dtype != b.training.gradient_reduce_dtype:
        out.append(f"training.grad_reduce_dtype: {a.training.gradient_reduce_dtype!r} -> "
                   f"{b.training.gradient_reduce_dtype!r}")
    if a.training.megatron_core and b.training.megatron_core and \
            a.training.core_attention_mask != b.training.core_attention_mask:
        out.append(f"training.dataloader_attention_mask: {a.training.core_attention_mask!r} -> "
                   f"{b.training.core_attention_mask!r}")
    ka, kb = mesh_key(a), mesh_key(b)
    out += [f"mesh.{k}: {ka[k]!r} -> {kb[k]!r}" for k in ka if ka[k] != kb[k]]
    # the loss's working set is the runtime's (a torchtitan import states torch's, a Megatron-LM one
    # keeps Megatron's): what runs the exported job decides it, no field the export could carry; so
    # does the allocator's PYTORCH_CUDA_ALLOC_CONF, set by the launch script (torchtitan's run_train.sh)
    ma_, mb_ = _memory(a), _memory(b)
    # so does the saved input of a tp GEMM (torch's DTensor keeps the all-gathered one, Megatron-LM gathers again)
    moved = _memory_moved(ma_, mb_.model_copy(update={"cross_entropy": ma_.cross_entropy,
                                                      "expandable_segments": ma_.expandable_segments,
                                                      "sp_gathered_input": ma_.sp_gathered_input}))
    out += [f"memory: {', '.join(moved)}"] if moved else []
    if a.checkpoint_interval_steps != b.checkpoint_interval_steps:  # DeepSpeed's JSON has no save interval
        out.append(f"reliability.checkpoint_interval_steps: {a.checkpoint_interval_steps!r} -> "
                   f"{b.checkpoint_interval_steps!r}")
    return out


def _memory_moved(a, b) -> list[str]:
    """``name = A -> B`` for each [memory] field of ``a`` that ``b`` does not give back (a value
    left at its default: ``default``), in TOML's spelling.

    >>> from meshplan.spec.memory import MemoryOptions
    >>> _memory_moved(MemoryOptions(grad_bucket_elements=16777216, dropout=True), MemoryOptions())
    ['grad_bucket_elements = 16777216 -> default', 'dropout = true -> default']
    """
    fields = type(a).model_fields
    show = lambda k, v: "default" if v == fields[k].default else json.dumps(v)
    da, db = a.model_dump(), b.model_dump()
    return [f"{k} = {show(k, da[k])} -> {show(k, db[k])}" for k in da if da[k] != db[k]]


def _routed(training, moe: bool) -> dict[str, Any]:
    """``training``'s fields but ``grad_reduce_dtype``, the MoE routing as it resolves
    (:attr:`~meshplan.spec.training.TrainingSpec.moe_routing`: a plan's unset routing is the
    dropless routing a re-import states), and without routing keys for a dense model; the
    clipping norm as it resolves (:attr:`~meshplan.spec.training.TrainingSpec.clip_norm`: unset
    is the 1.0 a DeepSpeed export writes); ``cp_attention`` unset where it names the framework's own
    (:attr:`~meshplan.spec.training.TrainingSpec.cp_kind`: Megatron-LM's ``p2p``, which an import of
    ``--cp-comm-type p2p`` states). Without ``megatron_runtime`` (as the loss's ``cross_entropy``:
    the Megatron-LM that runs the export decides the generation, today's Megatron Core or
    Megatron-DeepSpeed's 2022 code; the export's header says so,
    :func:`meshplan.interop.megatron_write.runtime_note`) and ``dataloader_attention_mask``
    (compared by :func:`differences` between two core plans only)."""
    out = training.model_dump(exclude={"grad_reduce_dtype", "moe_capacity_factor", "moe_dropless", "megatron_runtime",
                                       "dataloader_attention_mask"})
    out["grad_clip_norm"] = training.clip_norm
    if training.cp_attention == training.model_copy(update={"cp_attention": None}).cp_kind:
        out["cp_attention"] = None
    if moe:
        factor, dropless = training.moe_routing
        out.update(moe_dropless=dropless, moe_capacity_factor=None if dropless else factor)
    return out


def _memory(cfg: Config):
    """``cfg.memory`` with zero2's gradient bucket as the elements it resolves to (a DeepSpeed
    export writes that number as ``reduce_bucket_size``; unset, it is a default of dp), and
    under ``training.zero12_engine = "deepspeed"``, ``zero3_engine = "deepspeed-2021"`` or
    DeepSpeed's ZeRO-3 DeepSpeed's (default 5e8; a deepspeed-2021 plan re-imported as ZeRO-3
    keeps its bucket); otherwise zero3 and hsdp use no gradient bucket (``[memory]
    grad_bucket_elements``: the non-FSDP shardings'), so theirs is no difference (a ZeRO-3 row
    of a DeepSpeed ZeRO-2 config's search); likewise ZeRO-3's prefetch and live-parameter sizes
    where DeepSpeed's ZeRO-3 does not run (:meth:`~meshplan.spec.memory.MemoryOptions.knob_acts`:
    a ZeRO-2 row of a ZeRO-3 config's search)."""
    unused = {k: None for k in ("deepspeed_prefetch_elements", "deepspeed_max_live_elements",
                                "deepspeed_max_reuse_elements")
              if getattr(cfg.memory, k) is not None and not cfg.memory.knob_acts(k, cfg.training)[0]}  # ZeRO-3's
    t = cfg.training
    if t.zero12_engine == "deepspeed" or t.zero3_engine == "deepspeed-2021" or (
            t.sharding == "zero3" and t.zero3_engine == "deepspeed"):  # DeepSpeed's bucket (grad_bucket_acts)
        return cfg.memory.model_copy(update={"grad_bucket_elements": cfg.memory.deepspeed_bucket_elements()} | unused)
    if unused:
        return _memory(replace(cfg, memory=cfg.memory.model_copy(update=unused)))
    if cfg.training.sharding in ("zero3", "hsdp"):  # FSDP units, no gradient bucket (MemoryOptions)
        return cfg.memory.model_copy(update={"grad_bucket_elements": None})
    if cfg.training.sharding != "zero2":
        return cfg.memory
    return cfg.memory.model_copy(update={"grad_bucket_elements": cfg.memory.bucket_elements(
        resolved(cfg).degree("fsdp"))})


def mesh_key(cfg: Config) -> dict[str, Any]:
    """What of a mesh a plan depends on: the axes of degree > 1 in order (one data axis
    named ``dp`` whatever its spelling), ep, etp, and with tp > 1 sequence and loss
    parallelism, with pp > 1 the schedule and layers per virtual stage."""
    m, spec = resolved(cfg), mesh_spec(cfg)
    data = [a for a in m.layout.names if a in ("dp", "dp_shard", "dp_replicate") and m.layout.degree(a) > 1]
    axes = [("dp" if len(data) == 1 and a in data else a, m.layout.degree(a)) for a in m.layout.names
            if m.layout.degree(a) > 1]
    key: dict[str, Any] = {"axes": axes, "ep": m.ep, "etp": m.etp}
    if m.degree("tp") > 1:
        key |= {"sequence_parallel": spec.sequence_parallel, "loss_parallel": spec.loss_parallel}
    if m.degree("pp") > 1:
        key |= {"pp_schedule": str(spec.pp_schedule), "layers_per_virtual_stage": virtual_split(cfg, m)}
    return key


#: A config's predicted step in seconds with its parts (seconds that add up to it, keyed as
#: ``meshplan step`` prints them: ``compute``, ``bubble``, ``exposed fsdp``, ...:
#: :meth:`meshplan.schedule.step_summary.StepTime.parts_s`), or None
#: (:func:`meshplan.interop.export.export`'s ``step_of``).
StepOf = Callable[[Config], "tuple[float, Mapping[str, float]] | None"]


def step_line(cfg: Config, back: Config, to: str, step_of: StepOf) -> list[str]:
    """``step after the round trip: A s -> B s (+x%; part +d s, ...)`` when the re-imported config
    ``back`` predicts another step than ``cfg`` (both resolved), else nothing; the parts of the
    step that moved (:func:`moved_parts`) say where the fields listed above act.

    >>> steps = {"a": (60.0, {"compute": 50.0, "bubble": 10.0}),
    ...          "b": (80.0, {"compute": 49.0, "bubble": 16.0, "exposed fsdp": 15.0})}
    >>> step_line("a", "b", "megatron", steps.get)[0][:94]
    'step after the round trip: 60.000 s -> 80.000 s (+33.3%; exposed fsdp +15.000 s, bubble +6.000'
    """
    a, b = step_of(cfg), step_of(back)
    if a is None or b is None or a[0] == b[0]:
        return []
    moved = moved_parts(a[1], b[1], a[0])
    return [f"step after the round trip: {a[0]:.3f} s -> {b[0]:.3f} s ({b[0] / a[0] - 1:+.1%}"
            + (f"; {moved}" if moved else "") + f"), from the fields not expressed "
            f"in {to} above (meshplan compare of the config and the {to} file imported back itemises it)"]


def moved_parts(a: Mapping[str, float], b: Mapping[str, float], step_s: float, most: int = 3) -> str:
    """The ``most`` parts of a step (seconds: :data:`StepOf`) that moved most from ``a`` to
    ``b``, largest change first, each by at least 1% of the step ``step_s`` (seconds), as
    ``exposed fsdp +15.036 s, bubble +7.903 s``; a part one side lacks counts as 0 s there.

    >>> moved_parts({"compute": 44.27, "bubble": 6.75, "exposed fsdp": 1.64},
    ...             {"compute": 42.32, "bubble": 14.65, "exposed fsdp": 16.68}, 60.14)
    'exposed fsdp +15.040 s, bubble +7.900 s, compute -1.950 s'
    >>> moved_parts({"compute": 10.0}, {"compute": 10.05}, 10.0)
    ''
    """
    d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in dict.fromkeys([*a, *b])}
    big = sorted((k for k in d if abs(d[k]) >= 0.01 * step_s), key=lambda k: -abs(d[k]))[:most]
    return ", ".join(f"{k} {d[k]:+.3f} s" for k in big)
