"""Step 1 of ``meshplan validate`` (:mod:`meshplan.runtime.validation.validate`): the config of
one world size W. The mesh is re-sized to W by its outermost data axis (:func:`scale_mesh`), the
model scaled down by stated factors (:func:`scale_config`, hidden divisor :func:`auto_hidden_div`),
the batch the fewest micro-batches the pipeline schedule runs (:func:`micro_batches_for`), every
dtype fp32, the cluster the CPU testbed or a netns testbed; each choice comes back as a note."""

from __future__ import annotations

from math import gcd, prod
from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.limits import BOUNDS
from meshplan.mesh.resolve import BLOCK_AXES, Infeasible, Mesh, resolve_mesh, world_error
from meshplan.plan_runtime import run_reasons
from meshplan.pipeline.registry import fewest_micro_batches
from meshplan.pipeline.registry import get as get_schedule
from meshplan.runtime.testbed.cpu import cpu_cluster
from meshplan.runtime.testbed.run import testbed_cluster
from meshplan.runtime.validation.options import Options
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec


DATA_AXES = ("dp_replicate", "dp", "dp_shard")


#: Every dtype field of the CPU run (gloo, fp32 kernels): the gradient reduction's too, which a config's
#: ``grad_reduce_dtype`` (bf16 in newcomer 32's DeepSpeed import) would otherwise keep in the table's rows while
#: the run reduces in fp32 (:attr:`~meshplan.spec.training.TrainingSpec.gradient_reduce_dtype`).
FP32 = dict(param_dtype="fp32", compute_dtype="fp32", grad_dtype="fp32", optimizer_dtype="fp32", reduce_dtype="fp32",
            grad_reduce_dtype="fp32")


def scale_mesh(spec: MeshSpec, base_world: int, world: int, option: str = "--worlds") -> tuple[MeshSpec, str]:
    """``spec`` re-sized to ``world`` ranks through its outermost data axis (see
    :mod:`meshplan.runtime.validation.validate`); returns the new spec and the derivation line.
    A world the other axes do not divide is a ConfigError naming ``option``, the command's
    option that gave it (validate's ``--worlds``, validate-slice's ``--world``).

    >>> s, why = scale_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), 64, 16)
    >>> s.shape, why
    ([2, 8], 'dp_shard = 16 / (tp 8) = 2 (config: dp_shard 8)')
    """
    mesh = resolve_mesh(spec, base_world)
    bad = world_error(spec, base_world) if isinstance(mesh, Infeasible) else None
    if bad is not None:  # degrees that cannot make the world: the one line that names the fix
        raise bad
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "the config's mesh does not resolve: " + "; ".join(mesh.reasons))
    names, shape = list(mesh.layout.names), list(mesh.layout.shape)
    data = [i for i, n in enumerate(names) if n in DATA_AXES]
    if not data:
        raise ConfigError("mesh", f"axes {names} have no data axis ({', '.join(DATA_AXES)}) to scale to other worlds")
    i = next((j for j in data if shape[j] > 1), data[0])
    rest = [f"{n} {d}" for j, (n, d) in enumerate(zip(names, shape)) if j != i and d > 1] or ["1"]
    others = prod(d for j, d in enumerate(shape) if j != i)
    if world % others:
        least = _least_data(mesh, names, shape, i)
        raise ConfigError(option, f"world {world} is not a multiple of {' * '.join(rest)} = {others}; the "
                          f"data axis {names[i]} absorbs the world size, the other axes keep their degrees: the "
                          f"smallest world is {option} {others * least} ({names[i]} {least}), or a multiple of it")
    why = f"{names[i]} = {world} / ({' * '.join(rest)}) = {world // others} (config: {names[i]} {shape[i]})"
    shape[i] = world // others
    _check_expert_block(mesh, names, shape, i, world, option)
    if mesh.ep * mesh.etp > 1:
        names, shape = names + ["ep", "etp"], shape + [mesh.ep, mesh.etp]
    upd = spec.model_dump(exclude={"names", "shape", "order", "degrees", "world", "rank_to_gpu"})
    return MeshSpec(names=names, shape=shape, world=world, **upd), why


def _check_expert_block(mesh: Mesh, names: list[str], shape: list[int], i: int, world: int, option: str) -> None:
    """ConfigError naming ``option`` (the command's world option) where the dense block at
    ``world`` (``shape``, the data axis ``names[i]`` re-sized) does not hold the config's
    ep x etp, which validate keeps (the expert all-to-all as planned): the rule of
    :func:`meshplan.mesh.resolve.resolve_mesh`, (dp_shard * cp * tp) % (ep * etp) == 0, with
    the smallest world that meets it: the data axis a multiple of ep x etp / gcd(ep x etp, the
    rest of the block), the other axes unchanged.

    pp 2 x dp_shard 64 x ep 64 at world 4: dp_shard 2 does not hold ep 64; dp_shard 64, world 128.
    """
    dense = resolve_mesh(MeshSpec(names=names, shape=shape), world)
    experts = mesh.ep * mesh.etp
    if isinstance(dense, Infeasible) or experts == 1 or dense.block_size % experts == 0:
        return
    least = _least_data(mesh, names, shape, i)
    smallest = world // shape[i] * least
    raise ConfigError(option, f"world {world} makes {dense.block_expr} = {dense.block_size}, which ep {mesh.ep} x "
                      f"etp {mesh.etp} = {experts} does not divide (rule: (dp_shard * cp * tp) % (ep * etp) == 0); "
                      f"validate keeps ep and etp at the config's degrees and re-sizes only the data axis {names[i]}: "
                      f"the smallest world that holds ep {mesh.ep} is {option} {smallest} ({names[i]} {least}), or a "
                      f"multiple of it")


def _least_data(mesh: Mesh, names: list[str], shape: list[int], i: int) -> int:
    """The smallest degree of the data axis ``names[i]`` whose dense block holds the config's ep x
    etp (:func:`_check_expert_block`'s rule): ep x etp / gcd(ep x etp, the block's other axes), 1
    without experts. pp 8 x dp x tp 2 with ep 8: 8 / gcd(8, tp 2) = 4."""
    experts = mesh.ep * mesh.etp
    rest = prod(d for j, (n, d) in enumerate(zip(names, shape)) if j != i and n in BLOCK_AXES)
    return experts // gcd(experts, rest)


def auto_hidden_div(hidden: int, head_dim: int, ffn: int, target: int = 256) -> int:
    """Smallest power of two that divides hidden, head_dim (leaving it even) and ffn and
    brings hidden to ``target`` or below.

    >>> auto_hidden_div(8192, 128, 28672)
    32
    """
    d = 1
    while hidden // d > target:
        nd = d * 2
        if hidden % nd or head_dim % nd or (head_dim // nd) % 2 or ffn % nd:
            break
        d = nd
    return d


def scale_config(config: Config, world: int, opt: Options) -> tuple[Config, list[str]]:
    """The config of one stage: scaled model, mesh, batch, fp32, CPU testbed (see
    :mod:`meshplan.runtime.validation.validate`)."""
    from meshplan.runtime.execution.model import MLA_SCALED, scale_model

    m = config.model
    # MLA: every latent rank and head dim is divided with hidden, so the divisor must divide their gcd
    head = gcd(*(getattr(m, k) for k in MLA_SCALED if getattr(m, k))) if m.is_mla else m.d_head
    div = opt.hidden_div or auto_hidden_div(m.hidden, head, m.ffn)
    scaled = scale_model(m, layers=opt.layers, hidden_div=div, vocab=opt.vocab)
    spec = config_mesh(config)
    mesh_spec, mesh_why = scale_mesh(spec, spec.world or config.cluster.world, world, opt.world_option)
    split = spec.pp_layer_split
    if split is not None and sum(split) != scaled.spec.layers:  # the config's split over the scaled layers
        mesh_spec = mesh_spec.model_copy(update={"pp_layer_split": rescale_split(split, scaled.spec.layers)})
        mesh_why += (f"; pp_layer_split {split} -> {mesh_spec.pp_layer_split} (rescaled to --layers "
                     f"{scaled.spec.layers} in proportion)")
    mesh = resolve_mesh(mesh_spec, world)
    if isinstance(mesh, Infeasible):
        raise ConfigError("mesh", "; ".join(mesh.reasons))
    t = config.training
    recompute = "none" if t.recompute == "selective" else t.recompute
    mb, micro = min(t.micro_batch, 2), opt.micro_batches or micro_batches_for(mesh_spec, mesh, t)
    flash, flash_why = cpu_flash(scaled.spec, t.flash_attention)
    training = TrainingSpec(**{**t.model_dump(), **FP32, "seq_len": opt.seq_len, "micro_batch": mb,
                               "global_batch": mb * mesh.dp * micro, "recompute": recompute, "flash_attention": flash})
    if opt.testbed:
        cluster, hw_why = testbed_cluster(opt.testbed, world, opt.world_option)
    else:
        cluster, hw_why = cpu_cluster(world)
    from meshplan.runtime.validation.memcheck import TORCH_CPU_MEMORY

    memory = config.memory.model_copy(update={**TORCH_CPU_MEMORY, "optimizer_temp_states": None})
    notes = [scaled.note + (f" (hidden_div {div} chosen automatically)" if not opt.hidden_div else ""),
             "mesh: " + mesh_why,
             f"batch: micro_batch {t.micro_batch} -> {mb}, seq_len {t.seq_len} -> {opt.seq_len}, global_batch "
             f"{t.global_batch} -> {training.global_batch} = micro_batch {mb} x dp {mesh.dp} x {micro} "
             "micro-batch(es)" + ("" if opt.micro_batches else _fewest_why(mesh_spec, mesh, t)),
             f"dtypes: all fp32 (config: params {t.param_dtype}, compute {t.compute_dtype}, reduce {t.gradient_reduce_dtype})",
             hw_why, "memory timeline: NCCL buffers and cuBLAS workspace 0 (gloo, CPU); optimizer temporaries those of "
             f"training.optimizer_impl {t.optimizer_impl!r}, the AdamW the worker runs (fused: none; foreach: one "
             "optimizer state); the runtime model's "
             "torch variants (memcheck.TORCH_CPU_MEMORY: fp32 logits, torch cross entropy, no dropout, SP inputs "
             "all-gathered and kept, rms_norm decomposed, K/V repeated before SDPA, embedding gradient over the "
             "whole vocabulary)"]
    if recompute != t.recompute:
        notes.append("recompute 'selective' runs as none (the runtime model has no selective recompute)")
    notes += [flash_why] if flash_why else []
    if t.sharding == "none":  # the recorded first step: one bucket of every gradient (table: one row)
        memory = memory.model_copy(update={"grad_bucket_elements": BOUNDS["bytes"].value})
        notes.append("DDP (sharding none): the recorded first step all-reduces every gradient as one bucket "
                     "(torch 2.13, find_unused_parameters=False), so the plan is made with [memory] "
                     "grad_bucket_elements covering the model; later steps send the rebuilt 1 MiB / 25 MiB "
                     "buckets the table shows by default")
    cfg = Config(model=scaled.spec, cluster=cluster, training=training, mesh=mesh_spec, path=config.path,
                 memory=memory)
    return cfg, notes


def rescale_split(split: list[int], layers: int) -> list[int]:
    """``split`` (layers per stage or per virtual stage) scaled to ``layers`` in proportion (validate's
    ``--layers``): each entry ``floor(s x layers / sum)``, the layers left over one each to the entries of the
    largest remainders (the earlier first on a tie), then an entry left at 0 takes one from the largest entry;
    a ConfigError naming ``--layers`` where fewer layers than entries leave one without a layer.

    >>> rescale_split([23, 24, 24, 23], 4), rescale_split([23, 24, 24, 23], 8), rescale_split([11, 12, 12, 11], 6)
    ([1, 1, 1, 1], [2, 2, 2, 2], [1, 2, 2, 1])
    >>> rescale_split([3, 58], 4)
    [1, 3]
    """
    if layers < len(split):
        raise ConfigError("--layers", f"{layers} layers cannot fill the {len(split)} entries of mesh.pp_layer_split "
                          f"{split} (one layer each at least); give --layers {len(split)} or more")
    total = sum(split)
    out = [s * layers // total for s in split]
    order = sorted(range(len(split)), key=lambda i: (-(split[i] * layers % total), i))
    for i in order[:layers - sum(out)]:
        out[i] += 1
    for i, v in enumerate(out):
        if v == 0:
            out[out.index(max(out))] -= 1
            out[i] = 1
    return out


def cpu_flash(model: ModelSpec, flash: bool) -> tuple[bool, str]:
    """(``training.flash_attention`` of the CPU run, the note saying why it changed or ""): torch's
    CPU flash kernel needs one head dim for q, k and v (``check_head_dim_size_cpp`` in
    ``aten/src/ATen/native/transformers/sdp_utils_cpp.cpp``), so an MLA model with ``d_qk != d_v``
    runs the math SDPA, which keeps the attention scores (torch 2.13+cpu: d 24 with d_v 24 gives
    ``ScaledDotProductFlashAttentionForCpuBackward0``, with d_v 16 the math path's matmuls).

    >>> from meshplan.spec.model import ModelSpec
    >>> mla = ModelSpec(layers=1, hidden=64, ffn=1, q_heads=4, vocab=1, kv_lora_rank=8, qk_nope_head_dim=6,
    ...                 qk_rope_head_dim=2, v_head_dim=4)
    >>> cpu_flash(mla, True)[0], cpu_flash(mla.model_copy(update={"v_head_dim": 8}), True)[0]
    (False, True)
    """
    if not flash or not model.is_mla or model.d_head == model.d_v:
        return flash, ""
    return False, (f"attention: torch's math SDPA (its CPU flash kernel needs d_qk {model.d_head} == d_v "
                   f"{model.d_v}): planned with flash_attention false, the scores kept for backward")


def micro_batches_for(spec: MeshSpec, mesh, training: TrainingSpec) -> int:
    """The fewest micro-batches per step the scaled ``mesh`` runs (``--micro-batches``'s
    default): :func:`meshplan.pipeline.registry.fewest_micro_batches` of ``spec``'s schedule at
    its pp (torch's rules) times ``training.pp_schedule_runs``; 1 at pp 1."""
    pp = mesh.degree("pp")
    if pp == 1:
        return 1
    return fewest_micro_batches(spec.pp_schedule, pp, spec.virtual_stages) * training.pp_schedule_runs


def _fewest_why(spec: MeshSpec, mesh, training: TrainingSpec) -> str:
    """The clause of the batch note saying why this many micro-batches (none at pp 1)."""
    if mesh.degree("pp") == 1:
        return ""
    runs = training.pp_schedule_runs
    per = f" x pp_schedule_runs {runs}" if runs > 1 else ""
    return (f" (the fewest pp_schedule {get_schedule(spec.pp_schedule).name} runs at pp {mesh.degree('pp')}{per}; "
            "--micro-batches N sets them)")


def micro_batch_refusal(config: Config, world: int, opt: Options) -> Optional[str]:
    """Why the pipeline schedule refuses ``opt.micro_batches`` at ``world`` (None when it runs
    them or they are the default): :func:`meshplan.plan_runtime.run_reasons` of the scaled config, with
    the fix (the fewest it runs)."""
    if opt.micro_batches is None:
        return None
    cfg, _ = scale_config(config, world, opt)
    mesh, spec = resolve_mesh(config_mesh(cfg), world), config_mesh(cfg)
    if isinstance(mesh, Infeasible) or mesh.degree("pp") == 1:
        return None
    t = cfg.training
    why = run_reasons(spec.pp_schedule, mesh.degree("pp"), opt.micro_batches, spec.virtual_stages,
                      t.pp_schedule_runs)
    if not why:
        return None
    return (f"{opt.micro_batches} at world {world}: {'; '.join(why)}; give --micro-batches "
            f"{micro_batches_for(spec, mesh, t)} (the fewest it runs), or leave it out")


def config_mesh(config: Config) -> MeshSpec:
    """``config``'s [mesh] table; ConfigError when it has none."""
    if config.mesh is None:
        raise ConfigError("mesh", "missing table [mesh]; validate runs one mesh")
    return config.mesh
