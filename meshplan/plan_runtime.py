"""A plan against the runtime of its framework: what torch, Megatron-LM or DeepSpeed refuses or
runs differently from the plan, kept apart from :func:`meshplan.plan.build_plan`, which calls
it, because the step (:mod:`meshplan.schedule.steptime`), the restart search, ``validate``,
``compare`` and ``export`` ask the same questions of a config without building its plan.

- :func:`run_reasons`: the pipeline schedule's micro-batch rules under a framework, per
  schedule run (``training.pp_schedule_runs``).
- :func:`runtime_warnings` (and :func:`config_warnings` of a config): the notes plan and
  step print, compare prints per side and export writes in its header: the schedule's own
  warnings, zero1 without an engine (:data:`ZERO1_WITHOUT_ENGINE`), a sequence past the
  model's positions (:func:`position_warning`), capacity-bound MoE routing under torch
  (:func:`capacity_factor_warning`), a split-backward schedule with activation
  checkpointing under torch
  (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_warning`).
- :func:`export_refusals`: what an export target's runtime refuses in a config its own
  framework runs.
"""

from __future__ import annotations

from meshplan import catalog
from meshplan.config import Config
from meshplan.interop.torchtitan_tables import write_recompute
from meshplan.mesh import resolve
from meshplan.mesh.resolve import Mesh
from meshplan.pipeline.dualpipev import PAIR_OVERLAP_NOT_TIMED
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.registry import reasons as schedule_reasons
from meshplan.pipeline.split_backward_ac import split_backward_ac_warning
from meshplan.spec.axes.cp import megatron_cp_attention_reason
from meshplan.spec.axes.dp import micro_batches
from meshplan.spec.axes.ep import megatron_sp_reason
from meshplan.spec.axes.tp import torch_kv_reason, torch_kv_refused


def run_reasons(schedule, pp: int, m: int, v: int, runs: int, framework: str = "torch") -> tuple[str, ...]:
    """The schedule's infeasibility reasons (:func:`meshplan.pipeline.registry.reasons`, under
    ``framework``) for ``m`` micro-batches run as ``runs`` schedules of ``m / runs`` each
    (``training.pp_schedule_runs``, pp > 1 only), or why ``runs`` does not divide ``m``.

    >>> print(run_reasons("1f1b", 4, 6, 1, 4)[0])
    training.pp_schedule_runs 4 does not divide the step's 6 micro-batches (global_batch / (micro_batch x dp)); use a divisor of 6
    >>> print(run_reasons("1f1b", 4, 8, 1, 4)[0])  # 4 runs of 2: fewer than pp
    each of the 4 schedule runs (training.pp_schedule_runs): 1F1B needs micro-batches (2) >= pp (4) (torch Schedule1F1B)
    >>> run_reasons("interleaved_1f1b", 4, 8, 2, 2), run_reasons("interleaved_1f1b", 4, 6, 2, 1, "megatron")
    ((), ('interleaved 1F1B needs micro-batches (6) divisible by pp (4) (Megatron-LM)',))
    """
    if pp == 1 or runs == 1:
        return schedule_reasons(schedule, pp, m, v, framework)
    if m % runs:
        return (f"training.pp_schedule_runs {runs} does not divide the step's {m} micro-batches (global_batch / "
                f"(micro_batch x dp)); use a divisor of {m}",)
    return tuple(f"each of the {runs} schedule runs (training.pp_schedule_runs): {r}"
                 for r in schedule_reasons(schedule, pp, m // runs, v, framework))


def dualpipev_ep_ac_reasons(training, schedule, pp: int, ep: int) -> tuple[str, ...]:
    """Why torchtitan refuses DualPipeV with ep and activation checkpointing: with pp > 1, ep > 1,
    schedule dualpipev and ``training.pp_ep_overlap`` (its ``pipeline_parallel_expert_parallel_overlap``,
    default true, ``job_config.py``:420 at pytorch/torchtitan e347b1e), ``get_dual_pipe_v_flag`` raises
    NotImplementedError("Expert Parallel with DualPipeV and Activation Checkpointing cannot be used
    together") when ``activation_checkpoint.mode`` is not none (``distributed/dual_pipe_v.py``:32-53; the
    qwen3, deepseek_v3 and llama4 parallelizes call it before ``apply_moe_ep_tp``). The mode is the
    export's (:func:`~meshplan.interop.torchtitan_tables.write_recompute`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="full")
    >>> print(dualpipev_ep_ac_reasons(t, "dualpipev", 4, 8)[0][:65])
    framework torch: DualPipeV with ep 8 and activation checkpointing
    >>> dualpipev_ep_ac_reasons(t.model_copy(update={"pp_ep_overlap": False}), "dualpipev", 4, 8)
    ()
    >>> dualpipev_ep_ac_reasons(t, "dualpipev", 4, 1), dualpipev_ep_ac_reasons(t, "zbv", 4, 8)
    ((), ())
    """
    if training.framework != "torch" or pp < 2 or ep < 2 or str(schedule) != "dualpipev" or not training.pp_ep_overlap:
        return ()
    mode = write_recompute(training)["mode"]
    if mode == "none":
        return ()
    return (f"framework torch: DualPipeV with ep {ep} and activation checkpointing (recompute {training.recompute!r}: "
            f"torchtitan activation_checkpoint.mode = \"{mode}\"): torchtitan raises NotImplementedError (\"Expert "
            "Parallel with DualPipeV and Activation Checkpointing cannot be used together\", distributed/"
            "dual_pipe_v.py:32-53 at e347b1e); fix: recompute \"none\" (activation_checkpoint.mode = \"none\"), or "
            "training.pp_ep_overlap = false (parallelism.pipeline_parallel_expert_parallel_overlap = false)",)


def megatron_p2p_reasons(training, schedule, pp: int, vpp: int) -> tuple[str, ...]:
    """Why Megatron-LM refuses its pipeline p2p settings (``training.pp_p2p_overlap``,
    ``pp_p2p_overlap_warmup_flush``) for ``schedule`` at ``pp`` stages and ``vpp`` chunks:
    interleaving at pp 2 without overlap (arguments.py:1005-1009 at NVIDIA/Megatron-LM d98e8a6
    asserts pp > 2: two sends and receives between the same 2 ranks in one batched call), and the
    warm-up flush without interleaving (arguments.py:1010-1018 turns the overlap off, then
    model_parallel_config.py:570-575 raises).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", pp_p2p_overlap=False)
    >>> print(megatron_p2p_reasons(t, "interleaved_1f1b", 2, 2)[0][:56])
    interleaved 1F1B at pp 2 needs Megatron-LM's p2p overlap
    >>> megatron_p2p_reasons(t, "interleaved_1f1b", 4, 2), megatron_p2p_reasons(t, "1f1b", 2, 1)
    ((), ())
    """
    if training.framework != "megatron" or pp < 2:
        return ()
    if get_schedule(schedule).virtual_stages and vpp > 1:
        if pp == 2 and training.pp_p2p_overlap is False:
            return ("interleaved 1F1B at pp 2 needs Megatron-LM's p2p overlap (its arguments.py asserts pp > 2 "
                    "without it: two sends and receives between the same 2 ranks in one call); remove "
                    "training.pp_p2p_overlap = false (--no-overlap-p2p-communication)",)
        return ()
    if training.pp_p2p_overlap_warmup_flush:
        return ("training.pp_p2p_overlap_warmup_flush needs the interleaved schedule: Megatron-LM turns its p2p "
                "overlap off without interleaving and then refuses --overlap-p2p-communication-warmup-flush "
                "(model_parallel_config.py); remove it or set virtual stages",)
    return ()


def p2p_note(training, schedule, pp: int) -> tuple[str, ...]:
    """The line plan and step print for Megatron-LM's pipeline p2p under ``training`` and
    ``schedule`` (``training.pp_p2p_overlap``, :func:`meshplan.schedule.overlap_policy.p2p_mode`):
    under the interleaved schedule how its sends and receives wait, under 1F1B only where the
    config asks for overlap that Megatron-LM turns off; none elsewhere.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron")
    >>> p2p_note(t, "interleaved_1f1b", 4)[0][:59]
    'pipeline p2p: Megatron-LM overlap_p2p_comm on (training.pp_'
    >>> p2p_note(t, "1f1b", 4), p2p_note(t.model_copy(update={"pp_p2p_overlap": True}), "1f1b", 4)[0][-38:]
    ((), 'arguments.py), so every call is waited')
    """
    if training.framework != "megatron" or pp < 2 or not get_schedule(schedule).megatron_p2p:
        return ()
    if not get_schedule(schedule).virtual_stages:
        return () if not training.pp_p2p_overlap else (
            "pipeline p2p: training.pp_p2p_overlap has no effect under 1F1B: Megatron-LM turns overlap_p2p_comm off "
            "without interleaving (its arguments.py), so every call is waited",)
    if training.pp_p2p_overlap is False:
        return ("pipeline p2p: every send/recv call waited, both stages meeting in it (training.pp_p2p_overlap = "
                "false: --no-overlap-p2p-communication, as Megatron-LM before 2023 ran)",)
    if training.pp_p2p_overlap_warmup_flush:
        return ("pipeline p2p: Megatron-LM overlap_p2p_comm with its warm-up flush: every send and receive issued "
                "without waiting, each receive waited for just before the unit that needs it",)
    return ("pipeline p2p: Megatron-LM overlap_p2p_comm on (training.pp_p2p_overlap unset or true; "
            "--no-overlap-p2p-communication turns it off): the steady state's sends and receives issued without "
            "waiting, each receive waited for just before the unit that needs it; the warm-up and cool-down "
            "calls still wait",)


#: The warning of sharding zero1 over a data axis under framework torch without DeepSpeed's
#: engine (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`; the search rejects such
#: candidates, rule ``framework``).
ZERO1_WITHOUT_ENGINE = ("sharding zero1 under framework torch: no torch engine shards the optimizer state alone "
                        "(FSDP2 always shards the parameters, ZeroRedundancyOptimizer runs under DDP; torchtitan "
                        "has neither), so this plan is Megatron-LM's distributed optimizer and meshplan search "
                        "rejects it (rule 'framework'); use sharding zero3 with reshard_after_forward = false "
                        "(ZeRO-2-like), framework = \"megatron\" or zero12_engine = \"deepspeed\" (DeepSpeed's ZeRO-1)")


def runtime_warnings(training, schedule, mesh: Mesh, model=None) -> tuple[str, ...]:
    """What the framework's runtime is known to run differently from the plan of ``mesh``
    under ``schedule`` (the schedule's :meth:`~meshplan.pipeline.base.PipelineSchedule.warnings`,
    FSDP2 over a data axis when ``training.sharding`` is zero3 or hsdp and fsdp x dp_replicate
    > 1, and ``training.reshard_after_forward``), :data:`ZERO1_WITHOUT_ENGINE` for zero1 over a
    data axis where no engine runs it (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`),
    and with ``model`` given :func:`position_warning`: the one source of the lines plan and step
    print as notes, compare prints per side and export writes in its header (:func:`config_warnings`)."""
    data = mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1
    fsdp2 = training.sharding in ("zero3", "hsdp") and data
    zero1 = (ZERO1_WITHOUT_ENGINE,) if training.sharding == "zero1" and data and not training.has_zero1_engine else ()
    positions = position_warning(model, training.seq_len, training.framework) if model is not None else ()
    positions += capacity_factor_warning(model, training) if model is not None else ()
    split_ac = split_backward_ac_warning(training, schedule, mesh.degree("pp"))
    pair = (PAIR_OVERLAP_NOT_TIMED,) if (training.framework == "torch" and str(schedule) == "dualpipev"
                                         and training.pp_ep_overlap and mesh.degree("pp") > 1
                                         and mesh.degree("ep") > 1) else ()
    return positions + zero1 + get_schedule(schedule).warnings(training.framework, mesh.degree("pp"), fsdp2,
                                                                    training.reshard_after_forward) + split_ac + pair


def capacity_factor_warning(model, training) -> tuple[str, ...]:
    """One line for an MoE model under framework torch (torchtitan) with capacity-bound routing
    (``training.moe_capacity_factor`` set or ``moe_dropless = false``,
    :attr:`~meshplan.spec.training.TrainingSpec.moe_routing`): torchtitan's token-choice MoE has no
    capacity factor, every routed copy is computed (pytorch/torchtitan 08dc75a
    ``torchtitan/models/moe/moe.py``; its import says so, :data:`meshplan.interop.torchtitan.DROPLESS`,
    and ``export --to torchtitan`` lists the factor as not expressed), so the plan models a run
    torchtitan does not do (newcomer trial nc62 #8: no line said so).

    >>> from meshplan.spec.training import TrainingSpec
    >>> m = catalog.model("mixtral-8x7b")
    >>> t = lambda **kw: TrainingSpec(global_batch=8, seq_len=16, **kw)
    >>> len(capacity_factor_warning(m, t(moe_capacity_factor=1.25))), capacity_factor_warning(m, t())
    (1, ())
    >>> capacity_factor_warning(m, t(moe_capacity_factor=1.25, framework="megatron"))
    ()
    """
    factor, dropless = training.moe_routing
    if not model.is_moe or dropless or training.framework != "torch":
        return ()
    field = "moe_capacity_factor" if training.moe_capacity_factor is not None else "moe_dropless"
    value = training.moe_capacity_factor if field == "moe_capacity_factor" else "false"
    return (f"training.{field} {value} under framework torch: torchtitan's MoE has no capacity factor (token-choice "
            f"routing computes every routed copy), so this plan (each expert capped at {factor:g} x its even share, "
            "the overflow dropped) models a run torchtitan does not do; remove it (dropless, as torchtitan runs) or set "
            "framework = \"megatron\" (--moe-expert-capacity-factor)",)


def position_warning(model, seq_len: int, framework: str = "torch") -> tuple[str, ...]:
    """One line when ``seq_len`` (tokens) is more than ``model.max_position`` (the positions the
    model was built for; 0: unknown, no line): with RoPE the plan's costs are the same (no
    table), but the model needs RoPE scaling it does not say it has (Llama 3.1's, Dubey et al.
    2024 section 3.4.2, for 8k -> 128k: ``model.rope_scaling``), or past the context its stated
    scaling was built for; learned positions have no row for the later tokens. Under framework
    megatron the RoPE line says that Megatron-LM refuses the run (``assert
    args.max_position_embeddings >= args.seq_length``, arguments.py validate_args at d98e8a6, as
    :func:`meshplan.interop.megatron_flags.check_positions` says on import), and how to set it
    (newcomer trial 49: a catalog llama3-70b at seq_len 32768 got the RoPE line alone).

    >>> from meshplan import catalog
    >>> position_warning(catalog.model("llama3-70b"), 8192), len(position_warning(catalog.model("llama3-70b"), 131072))
    ((), 1)
    """
    rows = model.max_position
    if not rows or seq_len <= rows:
        return ()
    if model.position_embedding == "learned":
        return (f"training.seq_len {seq_len} is more than model {model.name}'s max_position {rows}, the rows of "
                f"its learned position table: no row for the later tokens; shorten training.seq_len or raise "
                f"model.max_position (a larger table)",)
    rs = model.rope_scaling
    assumed = "assuming RoPE scaling the model does not state" if rs is None else \
        f"assuming its RoPE scaling (factor {rs.factor:g} over {rs.original_max_position} positions) holds that far"
    if framework == "megatron":
        return (f"training.seq_len {seq_len} is more than model {model.name}'s max_position {rows}: planned as given "
                f"(RoPE has no table; the cost is the same), {assumed}, but Megatron-LM asserts "
                f"max_position_embeddings >= seq_length: run it with --max-position-embeddings {seq_len} or more "
                f"(export --to megatron writes it so; [model] max_position = {seq_len} says it in the plan) or "
                f"shorten training.seq_len",)
    long = catalog.LONG_CONTEXT.get(model.name)
    use = (f" or use catalog model {long} (Llama 3.1: {catalog.model(long).max_position} positions, RoPE scaled)"
           if long else "")
    return (f"training.seq_len {seq_len} is more than model {model.name}'s max_position {rows}: planned as given "
            f"(RoPE has no table; the cost is the same), {assumed}; set "
            f"model.max_position to the scaled context (e.g. {seq_len}){use} or shorten training.seq_len",)


def config_warnings(config: Config) -> tuple[str, ...]:
    """:func:`runtime_warnings` of ``config``'s mesh (none when it has no [mesh] or its mesh
    does not resolve: nothing runs then), ``reshard_after_forward`` unset resolved at its pp as
    ``build_plan`` does (:meth:`~meshplan.spec.training.TrainingSpec.at_pp`)."""
    mesh = _config_mesh(config)
    if mesh is None or config.mesh is None:  # (the second for mypy: no [mesh] resolves to None)
        return ()
    return runtime_warnings(config.training.at_pp(mesh.degree("pp")), config.mesh.pp_schedule, mesh, config.model)


def _config_mesh(config: Config) -> Mesh | None:
    """``config``'s [mesh] resolved on its cluster, None when it has none or it does not resolve."""
    if config.mesh is None:
        return None
    mesh = resolve.resolve_mesh(config.mesh, config.cluster.world, config.cluster.node.gpus)
    return None if isinstance(mesh, resolve.Infeasible) else mesh


#: The ``training.framework`` whose runtime runs a file exported to each foreign format with a pipeline.
EXPORT_FRAMEWORK = {"megatron": "megatron", "torchtitan": "torch"}


def block_recompute_refusal(training, to: str) -> str:
    """Why export target ``to`` cannot write Megatron-LM's block recompute (``training.recompute_num_layers``
    n: the first n layers of each model chunk checkpointed, the others whole), "" where it can or the
    config has none: torchtitan has no such option (torchtitan/distributed/activation_checkpoint.py:
    ``mode = "full"`` checkpoints every layer; ``selective_ac_option = "<k>"``, in the job TOML meshplan
    writes, checkpoints the blocks whose 1-based count is a multiple of k, ``_layer_sac_count % ac_freq == 0``,
    lines 37-40 at the parent of pytorch/torchtitan 114151ad4, which removed it; at b5bcd76 only
    ``FullAC``, op-level ``SelectiveAC`` and ``MemoryBudgetAC`` remain: none checkpoints the first n layers
    and keeps the rest), and a DeepSpeed
    JSON holds no recompute, which the HF Trainer's ``--gradient_checkpointing`` turns on for every layer.
    Megatron-LM writes it (``--recompute-method block --recompute-num-layers n``), and meshplan's TOML.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", recompute="full", recompute_num_layers=5)
    >>> block_recompute_refusal(t, "megatron"), block_recompute_refusal(t, "torchtitan").split(": ")[-1]
    ('', "torchtitan's runtime refuses block recompute")
    """
    n = training.recompute_num_layers
    if n is None or training.recompute != "full" or to not in ("torchtitan", "deepspeed"):
        return ""
    has = ("torchtitan's activation_checkpoint checkpoints every layer (mode \"full\") or every k-th "
           "(selective_ac_option \"<k>\")" if to == "torchtitan" else
           "a DeepSpeed JSON holds no recompute; the HF Trainer's --gradient_checkpointing checkpoints every layer")
    return (f"training.recompute_num_layers {n} is Megatron-LM's block recompute (the first {n} layers of each model "
            f"chunk checkpointed, the others kept whole): {has}, not the first {n}; export it --to megatron, or set "
            f"recompute_num_layers unset (every layer) or recompute \"none\": {to}'s runtime refuses block recompute")


def export_refusals(config: Config, to: str) -> tuple[str, ...]:
    """What the runtime of export target ``to`` (:data:`EXPORT_FRAMEWORK`) refuses in
    ``config`` although ``config``'s own framework runs it, each reason ending with what is
    refused (the export's one-line error as is): the schedule's micro-batch rules under that
    framework (:func:`run_reasons`, e.g. torch runs interleaved 1F1B at pp 4 with 6
    micro-batches, Megatron-LM needs pp to divide them: "... refuses this pipeline schedule"),
    or Megatron-LM's MoE with tp > 1 without sequence parallelism ("... refuses this MoE mesh
    without sequence parallelism"), or Megatron-LM's CP without flash or fused attention (rule
    ``megatron_cp_attention``: "... refuses CP without flash attention"), or torchtitan's tp past the KV heads, which a megatron plan
    holds as copies (rule ``torch_kv_heads``: "... refuses tp past the KV heads"); empty when they agree, pp is 1, or the mesh does not resolve.

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 6, "seq_len": 4096, "micro_batch": 1},
    ...     "mesh": {"names": ["pp", "tp"], "shape": [4, 2], "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}})
    >>> export_refusals(cfg, "megatron"), export_refusals(cfg, "torchtitan")  # doctest: +NORMALIZE_WHITESPACE
    (("interleaved 1F1B needs micro-batches (6) divisible by pp (4) (Megatron-LM): megatron's runtime refuses
    this pipeline schedule",), ())
    """
    block = block_recompute_refusal(config.training, to)
    if block:
        return (block,)
    target = EXPORT_FRAMEWORK.get(to)
    whole = _config_mesh(config) if to == "torchtitan" and config.training.framework != "torch" else None
    if whole is not None and torch_kv_refused(config.model, whole.degree("tp")):
        spec = config.model  # torchtitan replicates no KV head (rule torch_kv_heads)
        return (f"{torch_kv_reason(spec.n_kv_heads, whole.degree('tp'), spec.q_heads, megatron=False)}: {to}'s "
                "runtime refuses tp past the KV heads",)
    if to == "megatron" and config.model.is_moe and config.mesh is not None and not config.mesh.sequence_parallel:
        whole = _config_mesh(config)  # Megatron-LM's MoE with tp > 1 needs SP whatever config's framework
        if whole is not None and whole.degree("tp") > 1:
            return (f"{megatron_sp_reason(whole.degree('tp'), whole.ep)}: {to}'s runtime refuses this MoE mesh "
                    "without sequence parallelism",)
    if to == "megatron" and not config.training.flash_attention and config.mesh is not None:
        whole = _config_mesh(config)  # Transformer Engine's CP needs its flash or fused backend (rule megatron_cp_attention)
        if whole is not None and whole.degree("cp") > 1:
            return (f"{megatron_cp_attention_reason(whole.degree('cp'))}: {to}'s runtime refuses CP without flash "
                    "attention",)
    mesh = None if target in (None, config.training.framework) else _config_mesh(config)
    if mesh is None or config.mesh is None or target is None or mesh.degree("pp") == 1:
        return ()
    t = config.training
    m = micro_batches(t.global_batch, t.micro_batch, mesh.dp)
    if m == 0:
        return ()
    vpp = config.mesh.virtual_stages
    return tuple(f"{r}: {to}'s runtime refuses this pipeline schedule"
                 for r in run_reasons(config.mesh.pp_schedule, mesh.degree("pp"), m, vpp, t.pp_schedule_runs, target))
