"""meshplan config -> Megatron-LM arguments (``export --to megatron``): the inverse of
:func:`meshplan.interop.megatron.read`, with the header notes of an export and the config as
its re-import gives it back. Flag names as in :mod:`meshplan.interop.megatron`'s table.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.megatron_attention import FLASH_V2, WRITTEN
from meshplan.interop.megatron_deepspeed_args import SOURCE as MDS_SOURCE, mds_model_flags
from meshplan.interop.megatron_deepspeed import deepspeed_flags, deepspeed_note, recompute_flags
from meshplan.spec.recompute_modules import flags as recompute_module_flags
from meshplan.interop.megatron_dispatch import GROUPED, dispatcher_flags
from meshplan.interop.megatron_env import env_note
from meshplan.interop.megatron_flags import (NO_MASK, DROPOUT, FSDP_CKPT, FSDP_ENV, FSDP_OPTIMIZER, FSDP_OVERLAP,
                                             SHARDING)
from meshplan.interop.megatron_mesh import ORDERS, TP_PP_DP
from meshplan.interop.megatron_model import model_flags
from meshplan.interop.megatron_pipeline import write_pipeline
from meshplan.interop.tomlout import mesh_spec, resolved
from meshplan.spec.axes import MEGATRON_AXES


def write(cfg: Config) -> list[str]:
    """Megatron-LM arguments of ``cfg``, one flag (with its value) per item (the inverse of
    :func:`read`). ConfigError naming what Megatron-LM cannot express: a mesh order other
    than tp-cp-ep-dp-pp or (``--use-tp-pp-dp-mapping``) tp-cp-ep-pp-dp, a layer split other than first/last stage and even middle."""
    mesh = resolved(cfg)
    t, m = cfg.training, cfg.model
    deg = _degrees(cfg, mesh)
    deepspeed = deepspeed_flags(t)  # Megatron-DeepSpeed's engine, in place of Megatron-LM's sharding flags
    mds = deepspeed is not None  # so Megatron-DeepSpeed's parser: its spellings, no Megatron-LM-only knob
    if mds:
        mds_refusals(t, deg.get("cp", 1))
    out = (mds_model_flags(model_flags(m, t.seq_len)) if mds else model_flags(m, t.seq_len)) + \
        _parallel_flags(cfg, mesh, deg, mds)
    out += deepspeed if deepspeed else sharding_flags(t.sharding, t.megatron_fsdp)
    out += ["--overlap-grad-reduce"] * t.overlap_grad_reduce + ["--overlap-param-gather"] * t.overlap_param_gather
    out += ["--no-overlap-p2p-communication"] * (t.pp_p2p_overlap is False)
    out += ["--overlap-p2p-communication-warmup-flush"] * t.pp_p2p_overlap_warmup_flush
    out += [NO_MASK] * (t.megatron_core and not t.core_attention_mask)
    bucket = cfg.memory.grad_bucket_elements
    out += [f"--ddp-bucket-size {bucket}"] * bool(bucket and t.overlap_grad_reduce and t.sharding in ("none", "zero1"))
    if t.recompute in ("layer", "op"):
        what = f"every {t.ac_freq}-th layer in full" if t.recompute == "layer" else "op-level SAC"
        raise ConfigError("--to", f"Megatron-LM has no flag for torchtitan's recompute {t.recompute!r} ({what}; "
                          f"--recompute-method block recomputes the first n layers of each model chunk: "
                          f"training.recompute_num_layers): set training.recompute to full or selective")
    out += recompute_flags(t.recompute, bool(deepspeed), t.recompute_num_layers)
    out += recompute_module_flags(t.recompute_modules) * (t.recompute == "selective")
    out += [f"--micro-batch-size {t.micro_batch}", f"--global-batch-size {t.global_batch}",
            f"--seq-length {t.seq_len}", f"--make-vocab-size-divisible-by {t.vocab_pad_divisor}"]
    out += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(t.compute_dtype, [])
    out += ["--fp8-format hybrid"] * (t.linear_dtype == "fp8") + ["--fp8-param-gather"] * t.fp8_param_gather
    # Megatron-LM reduces bf16 runs' gradients in fp32 unless told otherwise; DeepSpeed's engine as its config says
    out += ["--accumulate-allreduce-grads-in-fp32"] * (t.gradient_reduce_dtype == "fp32" and not deepspeed)
    out += ["--grad-reduce-in-bf16"] * (t.gradient_reduce_dtype == "bf16" and "--bf16" in out and not deepspeed)
    return out + _last_flags(cfg, bool(deepspeed))


def _degrees(cfg: Config, mesh) -> dict[str, int]:
    """Each Megatron-LM axis's degree (dp the one data axis). ConfigError where Megatron-LM cannot
    express the mesh: two data axes or hsdp, an axis it has not (:data:`~meshplan.spec.axes.MEGATRON_AXES`),
    an order other than its tp-cp-ep-dp-pp (outermost first pp, dp, cp, tp) or, under
    ``--use-tp-pp-dp-mapping``, tp-cp-ep-pp-dp (dp, pp, cp, tp; dense meshes only)."""
    t = cfg.training
    axes = list(mesh.layout.names)
    data = [a for a in axes if a in ("dp", "dp_shard", "dp_replicate")]
    if (len(data) > 1 and not _instances(cfg, mesh)) or t.sharding == "hsdp":
        raise ConfigError("--to", f"Megatron-LM has one data-parallel axis; the mesh has {data} ({t.sharding})")
    if len(data) > 1:  # dp_replicate x dp_shard under zero1: one dp of their product, the instances flag
        i = axes.index("dp_replicate")
        return {**_degrees_of(axes[:i] + ["dp_shard"] + axes[i + 2:], mesh, {"dp_shard": "dp"}),
                "dp": mesh.layout.degree("dp_replicate") * mesh.layout.degree("dp_shard")}
    return _degrees_of(axes, mesh, dict.fromkeys(data, "dp"))


def _instances(cfg: Config, mesh) -> int:
    """The ``--num-distributed-optimizer-instances`` of a zero1 (distributed optimizer, not Megatron
    FSDP) mesh with dp_replicate just outside dp_shard: dp_replicate's degree, Megatron-LM's partial
    distributed optimizer (:func:`~meshplan.interop.megatron_mesh.with_instances`, its inverse); 0 otherwise."""
    axes = list(mesh.layout.names)
    if [a for a in axes if a in ("dp", "dp_replicate", "dp_shard")] != ["dp_replicate", "dp_shard"] or \
            axes.index("dp_shard") != axes.index("dp_replicate") + 1:
        return 0
    t = cfg.training
    return mesh.layout.degree("dp_replicate") if t.sharding == "zero1" and not t.megatron_fsdp else 0


def _degrees_of(names: list[str], mesh, rename: dict[str, str]) -> dict[str, int]:
    """Each Megatron-LM axis's degree of the mesh axes ``names`` (``rename``: the data axis to dp),
    checked against Megatron-LM's two orders (:func:`_degrees`)."""
    axes = [rename.get(a, a) for a in names]
    stray = [a for a in axes if a not in MEGATRON_AXES]
    if stray:
        raise ConfigError("--to", f"Megatron-LM has no axis {stray[0]!r}")
    if axes not in ([a for a in order if a in axes] for order in ORDERS.values()):
        raise ConfigError("--to", f"mesh order {axes} is neither Megatron-LM's tp-cp-ep-dp-pp (outermost first pp, "
                          f"dp, cp, tp) nor its tp-cp-ep-pp-dp ({TP_PP_DP}: dp, pp, cp, tp); reorder the mesh to "
                          f"export it")
    if _mapped(axes) and mesh.ep > 1:
        raise ConfigError("--to", f"mesh order {axes} (dp outside pp: Megatron-LM's {TP_PP_DP}) with ep {mesh.ep} "
                          f"is not planned by meshplan; put pp outermost")
    return {a: mesh.layout.degree(b) for a, b in zip(axes, names)}


def _mapped(axes) -> bool:
    """Whether the Megatron-LM axes ``axes`` (outermost first) put dp outside pp: the order
    tp-cp-ep-pp-dp that Megatron-LM runs under :data:`~meshplan.interop.megatron_mesh.TP_PP_DP`.

    >>> _mapped(["dp", "pp", "tp"]), _mapped(["pp", "dp", "tp"]), _mapped(["dp", "tp"])
    (True, False, False)
    """
    return "dp" in axes and "pp" in axes and axes.index("dp") < axes.index("pp")


def _parallel_flags(cfg: Config, mesh, deg: dict[str, int], mds: bool = False) -> list[str]:
    """The parallel sizes (no ``--context-parallel-size`` under Megatron-DeepSpeed, ``mds``: its
    parser has none, :func:`mds_refusals` refuses cp > 1; etp written at ep 1 too where tp > 1 in
    an MoE model: Megatron-LM defaults etp to tp, ``arguments.py:587-588``, so the planned etp is written), the MoE
    dispatcher, the CP communication type (all-gather CP, or Transformer Engine's p2p ring:
    Megatron-LM's default, also what torch's ring becomes), sequence parallelism and the pipeline
    split (:func:`~meshplan.interop.megatron_pipeline.write_pipeline`)."""
    t, m = cfg.training, cfg.model
    out = [f"--tensor-model-parallel-size {deg.get('tp', 1)}", f"--pipeline-model-parallel-size {deg.get('pp', 1)}"]
    out += [] if mds else [f"--context-parallel-size {deg.get('cp', 1)}"]
    n = _instances(cfg, mesh)
    out += [f"--num-distributed-optimizer-instances {n}"] * (n > 1 and not mds)
    out += [f"--expert-model-parallel-size {mesh.ep}"] * (mesh.ep > 1)
    # at ep 1 too: Megatron-LM defaults etp to tp (arguments.py:587-588), so the planned etp is written
    out += [f"--expert-tensor-parallel-size {mesh.etp}"] * (mesh.ep > 1 or (m.is_moe and deg.get("tp", 1) > 1))
    out += [f for f in dispatcher_flags(t.moe_dispatcher) if not (mds and f == GROUPED)] if m.is_moe else []
    # all-gather CP, or Transformer Engine's p2p ring (Megatron-LM's default; also what torch's ring becomes)
    out += [f"--cp-comm-type {'all_gather' if t.cp_attention == 'allgather' else 'p2p'}"] * (deg.get("cp", 1) > 1)
    out += ["--sequence-parallel"] * mesh_spec(cfg).sequence_parallel
    if _mapped(["dp" if a in ("dp", "dp_shard", "dp_replicate") else a for a in mesh.layout.names]):
        if mds:  # Megatron-DeepSpeed's parser has no such flag: its ranks are pp outermost
            raise ConfigError("--to", f"mesh order dp outside pp needs Megatron-LM's {TP_PP_DP}, which "
                              "Megatron-DeepSpeed has not; put pp outermost")
        out.append(TP_PP_DP)
    return out + write_pipeline(cfg, mesh)


def _last_flags(cfg: Config, deepspeed: bool) -> list[str]:
    """tp overlap and the attention backend (Megatron-DeepSpeed has none: without a flash switch it
    runs its CoreAttention, microsoft/Megatron-DeepSpeed f4157be megatron/model/transformer.py:528-531),
    gradient clipping (Megatron-LM's default 1.0 clips), the checkpoint interval, dropout
    (Megatron-LM's default is 0.1, :data:`DROPOUT`: a plan without dropout says 0.0), the SwiGLU
    fusion, and a dropping MoE router's capacity (Megatron-LM's default, and a plan's unset
    routing, is dropless; under deepep Megatron-LM refuses the padding flag)."""
    t, m = cfg.training, cfg.model
    # Megatron-DeepSpeed has no --attention-backend: without a flash switch it runs its CoreAttention
    # (microsoft/Megatron-DeepSpeed f4157be megatron/model/transformer.py:528-531)
    # and its --use-flash-attn is FlashAttention 1 (--use-flash-attn-v1's alias, arguments.py:927): FA2 is --use-flash-attn-v2
    flash = FLASH_V2 if deepspeed and t.flash_attention else WRITTEN[t.flash_attention]
    out = ["--tp-comm-overlap"] * t.tp_comm_overlap + [flash] * (t.flash_attention or not deepspeed)
    out += ["--clip-grad 0"] * (not t.grad_clip)  # Megatron-LM's default 1.0 clips
    out += [f"--clip-grad {t.grad_clip_norm!r}"] * (t.grad_clip_norm is not None)
    out += [f"--save-interval {cfg.checkpoint_interval_steps}"] * bool(cfg.checkpoint_interval_steps)
    # Megatron-LM's default dropout is 0.1 (:data:`DROPOUT`): a plan without dropout says 0.0
    out += [] if cfg.memory.dropout else [f"{flag} 0.0" for flag in DROPOUT]
    out += ["--no-bias-swiglu-fusion"] * (m.gated_mlp and cfg.memory.fused_glu is False and not deepspeed)
    factor, dropless = t.moe_routing
    if m.is_moe and not dropless:  # Megatron-LM's default (and a plan's unset routing) is dropless
        out += [f"--moe-expert-capacity-factor {factor!r}"]  # deepep: Megatron-LM refuses the padding flag
        out += ["--moe-pad-expert-input-to-capacity"] * (t.moe_dispatcher != "deepep")
    return out


#: Megatron-LM knobs a plan can hold that Megatron-DeepSpeed's parser has no flag for (microsoft/Megatron-DeepSpeed
#: f4157be megatron/arguments.py): the
#: training key (as a test of the plan) -> the flag Megatron-LM writes.
MDS_MISSING = {"tp_comm_overlap": "--tp-comm-overlap", "linear_dtype": "--fp8-format",
               "fp8_param_gather": "--fp8-param-gather", "recompute_modules": "--recompute-modules"}


def mds_refusals(t, cp: int) -> None:
    """ConfigError naming the first knob of a plan written for Megatron-DeepSpeed (under DeepSpeed's
    engine: ``--deepspeed``) that its parser has no flag for: cp > 1 (no ``--context-parallel-size``;
    its sequence parallelism across ranks is DeepSpeed-Ulysses', ``--ds-sequence-parallel-size``,
    which meshplan does not plan), or a :data:`MDS_MISSING` key set (``recompute_modules`` where
    Megatron-LM would need its flag: selective recompute of more than its default, core attention);
    each would stop every rank at start-up."""
    if cp > 1:
        raise ConfigError("mesh.cp", f"{cp}: Megatron-DeepSpeed has no --context-parallel-size ({MDS_SOURCE}; its "
                          f"DeepSpeed-Ulysses is not planned): set cp to 1, or plan Megatron-LM's engines")
    modules = t.recompute == "selective" and bool(recompute_module_flags(t.recompute_modules))
    for key, flag in MDS_MISSING.items():
        if getattr(t, key) not in (None, False) and (key != "recompute_modules" or modules):
            raise ConfigError(f"training.{key}", f"Megatron-DeepSpeed's parser has no {flag} ({MDS_SOURCE}), so "
                              f"every rank would stop at start-up: unset it, or plan Megatron-LM's engines")


def sharding_flags(sharding: str, fsdp: bool = False) -> list[str]:
    """Megatron-LM's flags of ``training.sharding``: Megatron FSDP's ``--data-parallel-sharding-strategy``
    for zero2 and zero3, and for none and zero1 under ``training.megatron_fsdp`` (else DDP, and the
    distributed optimizer for zero1); zero2 and zero3 with the overlap flags the plan assumes
    (:data:`FSDP_OVERLAP`), which Megatron FSDP turns on for them anyway; every Megatron FSDP strategy
    with the distributed optimizer it runs (:data:`FSDP_OPTIMIZER`, which Megatron-LM sets itself at
    d98e8a6 and needed given before ab43d43) and the checkpoint format it requires (:data:`FSDP_CKPT`).

    >>> sharding_flags("zero1"), sharding_flags("zero1", fsdp=True)[:3]
    (['--use-distributed-optimizer'], ['--use-megatron-fsdp', '--use-distributed-optimizer', '--data-parallel-sharding-strategy optim'])
    """
    if sharding in ("none", "zero1") and not fsdp:
        return ["--use-distributed-optimizer"] * (sharding == "zero1")
    strategy = {v: k for k, v in SHARDING.items()}[sharding]
    return ["--use-megatron-fsdp", FSDP_OPTIMIZER, f"--data-parallel-sharding-strategy {strategy}",
            *FSDP_OVERLAP.get(strategy, []), f"--ckpt-format {FSDP_CKPT}"]


def write_notes(cfg: Config) -> list[str]:
    """Header lines of a Megatron-LM export (comment lines of the file): ``--max-position-embeddings``
    raised to the sequence length (Megatron-LM asserts ``max_position_embeddings >= seq_length``)
    when the model's ``max_position`` is shorter; the environment Megatron-LM asserts: under Megatron
    FSDP :func:`fsdp_env_note`'s, else :func:`~meshplan.interop.megatron_env.env_note`'s. (An MoE plan's routing needs none: unset it is dropless,
    Megatron-LM's own default, :attr:`~meshplan.spec.training.TrainingSpec.moe_routing`, and
    :func:`write` writes the capacity factor of a plan that drops tokens.)"""
    m, seq = cfg.model, cfg.training.seq_len
    out = []
    if m.max_position and seq > m.max_position:
        out.append(f"--max-position-embeddings {seq}: raised from model {m.name}'s max_position {m.max_position} to "
                   f"--seq-length (Megatron-LM asserts max_position_embeddings >= seq_length)")
    return out + fsdp_env_note(cfg) + fsdp_pp_note(cfg) + env_note(cfg) + deepspeed_note(cfg.training) \
        + runtime_note(cfg.training)


def runtime_note(t) -> list[str]:
    """The header line of a Megatron-LM export of a plan that follows Megatron-LM 2022
    (``training.megatron_runtime`` unset or "2022", :mod:`meshplan.compute.megatron_core`): the flags
    are today's, which Megatron Core runs; nothing for a core plan or under DeepSpeed's engine
    (Megatron-DeepSpeed runs 2022's code).

    >>> from meshplan.spec.training import TrainingSpec
    >>> runtime_note(TrainingSpec(global_batch=8, seq_len=16, framework="megatron"))[0][:61]
    'training.megatron_runtime: this plan follows Megatron-LM 2022'
    >>> runtime_note(TrainingSpec(global_batch=8, seq_len=16, framework="megatron", megatron_runtime="core"))
    []
    """
    if t.framework != "megatron" or t.megatron_core or deepspeed_flags(t) is not None:
        return []
    return ["training.megatron_runtime: this plan follows Megatron-LM 2022 (2755bcb); these flags run on today's "
            "Megatron-LM (Megatron Core), whose get_batch, timers, pipeline syncs and SP embedding differ: plan "
            "the file's import (megatron_runtime = \"core\") to see its step"]


def fsdp_env_note(cfg: Config) -> list[str]:
    """The header line of a Megatron FSDP export (sharding zero2 or zero3, or
    ``training.megatron_fsdp``: what :func:`sharding_flags` writes ``--use-megatron-fsdp`` for)
    on :data:`FSDP_ENV`, which Megatron-LM asserts is not 1 there; with tp or cp > 1 the clause
    that Megatron-LM warns before Blackwell (arguments.py:1453-1465 at d98e8a6). Nothing otherwise,
    nor under DeepSpeed's engine (:func:`~meshplan.interop.megatron_deepspeed.deepspeed_flags`: no
    ``--use-megatron-fsdp`` is written).

    >>> from meshplan.config import config_from_dict
    >>> cfg = lambda sharding: config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100",
    ...     "nodes": 1}, "training": {"global_batch": 8, "seq_len": 4096, "sharding": sharding},
    ...     "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2], "sequence_parallel": True}})
    >>> note = fsdp_env_note(cfg("zero3"))[0]; note[:84], "; with tp 2 it warns" in note, fsdp_env_note(cfg("zero1"))
    ('environment: unset CUDA_DEVICE_MAX_CONNECTIONS (or set it above 1) before launching:', True, [])
    """
    t = cfg.training
    if (t.sharding in ("none", "zero1") and not t.megatron_fsdp) or deepspeed_flags(t) is not None:
        return []  # DeepSpeed's engine (Megatron-DeepSpeed's --deepspeed) shards instead: no --use-megatron-fsdp
    mesh = resolved(cfg)
    tp_cp = {a: mesh.layout.degree(a) for a in ("tp", "cp") if a in mesh.layout.names and mesh.layout.degree(a) > 1}
    return [f"environment: unset {FSDP_ENV} (or set it above 1) before launching: Megatron-LM asserts it is not 1 "
            f"under --use-megatron-fsdp (arguments.py validate_args at d98e8a6), though its other launch scripts "
            f"export it as 1"
            + (f"; with {' and '.join(f'{a} {d}' for a, d in tp_cp.items())} it warns before Blackwell GPUs that "
               f"tp and cp prefer 1 (speed only)" if tp_cp else "")]


def fsdp_pp_note(cfg: Config) -> list[str]:
    """The header line of a Megatron FSDP export with pp > 1 (``export --to megatron`` of a zero3
    plan with a pipeline): Megatron-LM runs it as written. At NVIDIA/Megatron-LM d98e8a6
    ``validate_args`` refuses pp > 1 only under ``--use-torch-fsdp2`` (arguments.py:1034-1035), and
    ``FullyShardedDataParallelV2._validate_config`` only under ``--megatron-fsdp-version 2``
    (mcore_fsdp_adapter.py:627-638); v1, the default (arguments.py:3158), checks neither pp nor
    virtual stages, and ``wrap_model_chunks_with_ddp`` (training.py:2197) wraps each virtual stage's
    model chunk in it as in DDP. Its functional tests (tests/functional_tests/test_cases) run
    Megatron FSDP at pp 1 only, and the usual Megatron-LM pipeline run shards the optimizer
    alone (zero1, ``--use-distributed-optimizer``): the line names that plan, not written, as
    the user's to compare. Nothing without Megatron FSDP or at pp 1.

    >>> from meshplan.config import config_from_dict
    >>> cfg = lambda sharding, pp: config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system":
    ...     "dgx-h100", "nodes": 1}, "training": {"global_batch": 8, "seq_len": 4096, "sharding": sharding},
    ...     "mesh": {"names": ["pp", "dp_shard"], "shape": [pp, 8 // pp]}})
    >>> fsdp_pp_note(cfg("zero3", 2))[0][:75], fsdp_pp_note(cfg("zero1", 2)), fsdp_pp_note(cfg("zero3", 1))
    ('Megatron FSDP (zero3) at pp 2: Megatron-LM d98e8a6 runs it as written (vali', [], [])
    """
    t, mesh = cfg.training, resolved(cfg)
    pp = mesh.layout.degree("pp") if "pp" in mesh.layout.names else 1
    if pp == 1 or (t.sharding in ("none", "zero1") and not t.megatron_fsdp) or deepspeed_flags(t) is not None:
        return []
    vpp = mesh_spec(cfg).virtual_stages
    at = f"pp {pp}" + (f" x vpp {vpp}" if vpp > 1 else "")
    return [f"Megatron FSDP ({t.sharding}) at {at}: Megatron-LM d98e8a6 runs it as written (validate_args refuses "
            f"pp > 1 only under --use-torch-fsdp2, and Megatron FSDP only in its version 2, not the default 1, "
            f"which wraps each virtual stage like DDP), though its own tests run Megatron FSDP at pp 1 only; the "
            f"usual Megatron-LM pipeline run is zero1 (--use-distributed-optimizer): plan training.sharding = "
            f"\"zero1\" and meshplan compare the two before choosing"]


def exported_model(cfg: Config) -> Config:
    """``cfg`` as a Megatron-LM export gives it back: its model's ``max_position`` raised to the
    sequence length (:func:`write_notes`), which the re-import check compares against."""
    m, seq = cfg.model, cfg.training.seq_len
    if not m.max_position or seq <= m.max_position:
        return cfg
    return replace(cfg, model=m.model_copy(update={"max_position": seq}))
