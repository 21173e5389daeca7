"""torchtitan job TOML -> meshplan tables (``meshplan import torchtitan``, and ``plan``/``step``/
``search`` on a job TOML); the writer, the inverse, is :mod:`meshplan.interop.torchtitan_write` and
what an export keeps of the user's own file :mod:`meshplan.interop.torchtitan_carry`.

Key names from torchtitan's ``torchtitan/config/job_config.py`` (pytorch/torchtitan at
e347b1e, 2026-02-15, whose ``torchtitan/config`` is the same as release v0.2.2's (73a0e69, the
last release reading TOML job files: 9810191, 2026-02-23, replaced them with Python config
registries, ``--module``/``--config``, which :mod:`meshplan.interop.torchtitan_pyjob` brings to
these keys); the files meshplan writes are for torchtitan <= v0.2.2, while its runtime rules (flavors, FSDP units, the reshard default) cite b5bcd76;
``JobConfig`` tables ``[model]``,
``[training]``, ``[parallelism]``, ``[activation_checkpoint]``, ``[quantize.linear.float8]``)
and its preset ``torchtitan/models/llama3/train_configs/llama3_8b.toml``. How they map:

============================================== ==============================================
torchtitan                                     meshplan
============================================== ==============================================
model.name + model.flavor (llama3 8B/70B/405B, model.catalog llama3-8b / -70b / -405b,
  deepseek_v3 16B/236B/671B, qwen3 30B-A3B,     deepseek-v2-lite / -v2 / -v3, qwen3-30b-a3b's and
  235B-A22B)                                     -235b-a22b's fields (:mod:`~meshplan.interop.torchtitan_flavors`)
model.flavor registered by the .py beside the   the [model] its TransformerModelArgs build
  job TOML (llama3_args[...] = ..., written by   (:mod:`~meshplan.interop.torchtitan_custom`)
  export for a dense Llama-style model)
model.hf_assets_path (other flavors)           model.hf_config = <path>/config.json
(an MoE model: token-choice, no capacity)      training.moe_dropless = true (:data:`DROPLESS`)
model.converters "quantize.linear.float8"      training.linear_dtype = "fp8": the converted
  (or "float8")                                  Linears' GEMMs in fp8, activations in compute_dtype;
                                                 without "float8" also fp8_tp = false (plain TP)
quantize.linear.float8.filter_fqns,            training.fp8_output_layer (output not filtered),
  .enable_fsdp_float8_all_gather                 fp8_all_gather (with dp_shard > 1, as torchtitan)
quantize.linear.float8.recipe_name "rowwise"   training.fp8_recipe = "rowwise" (unset: tensorwise)
  (or "rowwise_with_gw_hp")
model.norm_type (before 2025) "rmsnorm"        training.torch_norm = "decomposed" (torchtitan's own
  ("fused_rmsnorm": "fused")                     RMSNorm, kernel by kernel when not compiled)
training.local_batch_size                      micro_batch (pp 1); per-rank batch per step
                                                 (pp > 1: per schedule.step(), pp_schedule_runs =
                                                 global / (local x dp) accumulation steps)
parallelism.pipeline_parallel_microbatch_size  micro_batch (pp > 1)
training.global_batch_size (-1: local x dp)    training.global_batch
training.seq_len                               training.seq_len
training.dtype float32 / bfloat16              param_dtype fp32 / bf16 (bf16: no fp32 copy)
training.mixed_precision_param / _reduce       compute_dtype / reduce_dtype
parallelism.*_degree                           mesh [pp, dp_replicate, dp_shard, cp, tp] + ep, etp
  (expert_tensor_parallel_degree: v0.2.2's,      (with ep > 1: etp 1, or tp with a note, infeasible
  removed by torchtitan in c4b409a)              under b5bcd76's rule; else an error: :func:`read_etp`)
parallelism.fsdp_reshard_after_forward         reshard_after_forward ("default": left unset, resolved
                                                 per mesh as not pp: TrainingSpec.reshard_default),
                                                 reshard_head_after_forward (always only):
                                                 :func:`~meshplan.interop.torchtitan_write.reshard_policy`
parallelism.pipeline_parallel_schedule         mesh.pp_schedule (GPipe, 1F1B, Interleaved1F1B;
                                                 ZBVZeroBubble, DualPipeV as zbv, dualpipev;
                                                 InterleavedZeroBubble as zb_h1 at one stage
                                                 per rank, refused with more)
parallelism.module_fqns_per_model_part,        mesh.pp_layer_split (torchtitan's split of layers
  pipeline_parallel_layers_per_stage,            with embedding and output weighted as layers,
  pipeline_parallel_first/last_stage_less_layers generate_llm_fqn_per_model_part)
parallelism.disable_loss_parallel              mesh.loss_parallel
parallelism.context_parallel_rotate_method     training.cp_rotate ("alltoall": torch's ring shifts K/V
                                                 cp - 1 times a pass; "allgather", the default,
                                                 left unset; written back on export)
parallelism.enable_async_tensor_parallel       training.tp_comm_overlap
parallelism.pipeline_parallel_expert_          training.pp_ep_overlap (DualPipeV with ep: the pairs'
  parallel_overlap                               overlap; with AC torchtitan raises: infeasible)
parallelism.expert_parallel_comm_backend       training.moe_dispatcher "deepep" (standard: alltoall;
                                                 deepseek_v3 and llama4 only, ignored with a note
                                                 for qwen3: :mod:`~meshplan.interop.torchtitan_ep`)
compile.enable (+ components model, loss)      training.torch_compile (default off: eager);
                                                 components ["model"]: torch_compile_loss false;
                                                 memory.cross_entropy "torch" (the eager loss's
                                                 fp32 logits) or, loss compiled, "compiled"
(run_train.sh's PYTORCH_CUDA_ALLOC_CONF)       memory.expandable_segments true
parallelism.tensor_parallel_degree > 1         memory.sp_gathered_input true (torch 2.13 DTensor:
                                                 ColwiseParallel(input_layouts=Shard(1)) all-gathers
                                                 in its input hook, so the Linear saves the gathered
                                                 input; e347b1e models/llama3/infra/parallelize.py:
                                                 219-236; under float8 TP the fp8 copy instead:
                                                 :mod:`meshplan.memory.activations`)
(n_kv_heads < n_heads)                         memory.kv_expanded false: since ff0829c (in v0.2.2)
                                                 llama3 passes enable_gqa to SDPA, no repeat_kv
                                                 (e347b1e models/llama3/model/model.py:201, 275, 295;
                                                 torch's flash and cuDNN backends take GQA as is):
                                                 the revision the import plans, 238fa99, is later;
                                                 memory, the repeat_kv copies and torch's ring CP
                                                 traffic follow it (a note at cp > 1 says so:
                                                 :func:`~meshplan.interop.torchtitan_tables.kv_heads_read`)
optimizer.name AdamW / Adam                    training.optimizer adamw / adam
optimizer.implementation "fused" / "foreach"   training.optimizer_impl (unset: "fused", torchtitan's
  (before 2025: optimizer.fused true / false)    default since 2025; 9dec370's unset fused: foreach)
training.max_norm                              training.grad_clip = true whatever its value: the
                                                 train step calls clip_grad_norm_ every step (norm,
                                                 then a multiply by min(max_norm / norm, 1), never
                                                 skipped: torch clip_grads_with_norm_); the value
                                                 as training.grad_clip_norm (unset: 1.0)
activation_checkpoint.mode                     training.recompute: none, full; selective with
  + selective_ac_option                          option "op" -> op (cp 1; else
                                                 selective, with a note), "<k>" -> layer, ac_freq k
checkpoint.interval (with enable true;         [reliability] checkpoint_interval_steps (500 unset);
  enable_checkpoint before cd337db)              export writes it back, in the file's spelling
============================================== ==============================================

The degrees, the [mesh] table and the pipeline's schedule and split are read by
:mod:`meshplan.interop.torchtitan_mesh`; the pipeline split and [activation_checkpoint] are read and
written by :mod:`meshplan.interop.torchtitan_tables`, float8 by :mod:`meshplan.interop.torchtitan_float8`;
torchtitan's pre-2025 float8 spellings are brought to the current layout first
(:mod:`meshplan.interop.torchtitan_legacy`). A key of a table the reader reads ([model],
[training], [parallelism], [activation_checkpoint], [quantize.linear.float8]) that is a near
miss of one it reads (``tensor_parallel_degre``; :func:`~meshplan.interop.typos.misspelt`) is
an error naming the likely key, and so is a read key under another of those tables or
[experimental] (``[training] tensor_parallel_degree`` of older torchtitan); other keys are
listed as unused.

RoPE scaling has no job-config key: torchtitan's llama3 flavors set Llama 3.1's in code
(b5bcd76 ``torchtitan/models/llama3/__init__.py``, ``scaling="llama"`` with ``RoPE.Config``'s
factor 8, low 1, high 4, 8192 original positions), so ``model.rope_scaling`` is neither read nor
written (it costs nothing: :class:`~meshplan.spec.rope.RopeScaling`). Its context is the job's: a flavor at a
``training.seq_len`` above its catalog model's positions is read with ``model.max_position`` = seq_len,
llama3 8B and 70B past 8192 as catalog llama3.1-8b / -70b (Llama 3.1, 131072 positions)
(:func:`~meshplan.interop.torchtitan_flavors.flavor_context`).

Sharding follows torchtitan's parallelize: FSDP2 (zero3) when dp_shard * cp > 1, HSDP when
dp_replicate > 1 too, DDP (none) with dp_replicate alone; sequence parallel with tp > 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from meshplan import catalog
from meshplan.errors import ConfigError, InfeasibleInput
from meshplan.interop.common import (
    Imported,
    ImportOptions,
    cluster_table,
    flatten,
    model_is_mla,
    model_is_moe,
    model_layers,
    positive_int,
    seq_len_of,
    table_model,
)
from meshplan.interop.typos import misspelt
from meshplan.interop.torchtitan_batch import BatchKeys, accumulation_divides, accumulation_note
from meshplan.interop.torchtitan_checkpoint import checkpoint_note, read_checkpoint
from meshplan.interop.torchtitan_ep import read_backend, read_etp
from meshplan.interop.torchtitan_flavors import flavor_context, read_model
from meshplan.interop.torchtitan_float8 import FLOAT8, float8_used, mixed_note, read_float8
from meshplan.interop.torchtitan_legacy import old_float8
from meshplan.interop.torchtitan_mesh import DEGREES, degrees, mesh_table
from meshplan.interop.torchtitan_tables import (
    kv_heads_read,
    read_norm,
    read_compile,
    read_cp_attention,
    read_optimizer,
    read_recompute,
)
from meshplan.spec.axes.tp import tp_misfit

DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
#: torchtitan's ``training.seq_len`` when the job TOML has none (torchtitan/config/job_config.py,
#: ``class Training``: ``seq_len: int = 2048``), and whose it is, as the import's note says.
SEQ_LEN_DEFAULT = (2048, "torchtitan's")
#: Keys the reader uses (everything else is listed as unused).
USED = {"model.name", "model.flavor", "model.converters", "training.local_batch_size",
        "training.global_batch_size", "training.seq_len", "training.dtype", "training.mixed_precision_param",
        "training.mixed_precision_reduce", "activation_checkpoint.mode", "activation_checkpoint.selective_ac_option",
        "parallelism.fsdp_reshard_after_forward", "parallelism.pipeline_parallel_schedule",
        "parallelism.pipeline_parallel_microbatch_size", "parallelism.module_fqns_per_model_part",
        "parallelism.pipeline_parallel_layers_per_stage", "parallelism.pipeline_parallel_first_stage_less_layers",
        "parallelism.pipeline_parallel_last_stage_less_layers", "parallelism.disable_loss_parallel",
        "parallelism.enable_async_tensor_parallel", "compile.enable", "compile.components", "training.max_norm",
        "model.norm_type", "optimizer.name", "optimizer.implementation", "optimizer.fused",
        "parallelism.context_parallel_rotate_method", "parallelism.expert_parallel_comm_backend",
        "parallelism.pipeline_parallel_expert_parallel_overlap"} | \
    {f"parallelism.{k}" for k in DEGREES}
#: torchtitan keys (job_config.py at e347b1e) within three edits of a key the reader reads:
#: none there; a later torchtitan key that close goes here so that it is listed, not refused.
NEAR_KEYS: frozenset[str] = frozenset()
#: Every key a misspelling is checked against (:func:`~meshplan.interop.typos.misspelt`).
READ = USED | FLOAT8 | {"model.hf_assets_path"}


def _training(d: dict, deg: dict[str, int], shard: int, opts: ImportOptions, model: dict,
              notes: list[str], revision: str = "238fa99", batch: BatchKeys = BatchKeys()) -> dict[str, Any]:
    """[training]: batch (torchtitan's global = local x dp unless given), sequence, sharding
    as torchtitan applies it, dtypes, resharding policy, recompute, float8."""
    tr, par = d.get("training", {}), d.get("parallelism", {})
    local = positive_int(tr.get("local_batch_size", 8), "training.local_batch_size")
    gb = tr.get("global_batch_size", -1)
    global_batch = positive_int(gb, "training.global_batch_size") if gb != -1 else local * deg["dp_replicate"] * shard
    micro = positive_int(par.get("pipeline_parallel_microbatch_size", 1),
                         "parallelism.pipeline_parallel_microbatch_size") if deg["pp"] > 1 else local
    fsdp = shard * deg["cp"] > 1
    dp = deg["dp_replicate"] * shard
    accumulation_divides(batch, global_batch, local, micro, deg["pp"], dp)
    accum = global_batch // max(local * dp, 1)
    if deg["pp"] > 1 and accum > 1:
        notes.append(accumulation_note(batch, global_batch, local, micro, deg["pp"], dp))
    if not fsdp and deg["dp_replicate"] > 1 and deg["pp"] * deg["tp"] > 1:
        raise ConfigError("parallelism.data_parallel_replicate_degree", "replicated without sharding (DDP) beside "
                          "pp or tp: torchtitan raises \"DDP has not supported > 1D parallelism\"; shard too "
                          "(data_parallel_shard_degree > 1: HSDP) or drop the other degrees")
    policy = par.get("fsdp_reshard_after_forward", "default")
    if policy not in ("default", "always", "never"):
        raise ConfigError("parallelism.fsdp_reshard_after_forward", f"{policy!r}; use default, always or never")
    dtype = DTYPES.get(tr.get("dtype", "float32"))
    if dtype is None:
        raise ConfigError("training.dtype", f"{tr.get('dtype')!r}; use float32 or bfloat16")
    seq = seq_len_of(opts.seq_len, tr.get("seq_len"), "training.seq_len", "the job TOML", notes, SEQ_LEN_DEFAULT)
    training = {"global_batch": global_batch, "seq_len": seq,
                "micro_batch": micro, "param_dtype": dtype,
                "sharding": ("hsdp" if deg["dp_replicate"] > 1 else "zero3") if fsdp else "none",
                "compute_dtype": _dtype(tr, "mixed_precision_param", "bfloat16"),
                "reduce_dtype": _dtype(tr, "mixed_precision_reduce", "float32"),
                # and [norm, output] (tied: the one end unit) resharded only under "always"
                "reshard_head_after_forward": policy == "always" and fsdp,
                "tp_comm_overlap": bool(par.get("enable_async_tensor_parallel", False))}
    if par.get("pipeline_parallel_expert_parallel_overlap", True) is not True:  # default true (job_config.py:420)
        training["pp_ep_overlap"] = bool(par["pipeline_parallel_expert_parallel_overlap"])
    if policy != "default":  # "default" (not pp_enabled) left unset: TrainingSpec.reshard_default, per mesh
        training["reshard_after_forward"] = policy == "always"
    if deg["pp"] > 1 and accum > 1:
        training["pp_schedule_runs"] = accum
    training |= read_recompute(d, deg, model_is_mla(model), notes)
    training["op_sac_policy"] = revision  # a job TOML is torchtitan <= v0.2.2 (TrainingSpec.torchtitan_v022): 238fa99
    training |= read_compile(d.get("compile", {}), notes)
    if training["tp_comm_overlap"] and not training["torch_compile"]:
        raise ConfigError("parallelism.enable_async_tensor_parallel", "torchtitan raises \"Async TP requires "
                          "torch.compile\" without [compile] enable = true (components with \"model\"): set it, or "
                          "set enable_async_tensor_parallel = false")
    norm = tr.get("max_norm", 1.0)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
        raise ConfigError("training.max_norm", f"{norm!r}; give the gradient-norm bound, a number > 0 (torchtitan's "
                          f"default 1.0)")
    training["grad_clip"] = True  # torchtitan clips every step (module docstring)
    training |= {"grad_clip_norm": float(norm)} if "max_norm" in tr else {}
    if dtype == "bf16":  # training.dtype bfloat16: everything in bf16, no fp32 copy
        training |= {"master_weights": False, "grad_dtype": "bf16", "optimizer_dtype": "bf16"}
    return training | read_float8(d, shard, notes, deg["cp"]) | read_norm(d, notes) | read_optimizer(d, notes) | read_cp_attention(
        par, deg["cp"], notes)


def _dtype(tr: dict, key: str, default: str) -> str:
    """meshplan's dtype of torchtitan's ``[training] key`` (float32 or bfloat16, its choices);
    ConfigError naming the key otherwise."""
    value = tr.get(key, default)
    if value not in DTYPES:
        raise ConfigError(f"training.{key}", f"{value!r}; use float32 or bfloat16")
    return DTYPES[value]


def read(d: dict, base: Path, opts: ImportOptions, custom: Mapping[tuple[str, str], dict] = {},
         revision: str = "238fa99", batch: BatchKeys = BatchKeys()) -> Imported:
    """meshplan tables of a parsed torchtitan job TOML (module docstring); ``base``: the
    file's folder (for a relative ``hf_assets_path``); ``custom``: llama3 flavors of the ``.py``
    beside it (:func:`~meshplan.interop.torchtitan_flavors.read_model`); ``revision``: the
    torchtitan that runs it, ``training.op_sac_policy`` (a job TOML: 238fa99, the code of v0.2.2;
    a Python config registry in b5bcd76's names: b5bcd76, :mod:`~meshplan.interop.torchtitan_pyjob`);
    ``batch``: the batch keys the file spelled, which the batch error and note name
    (:class:`~meshplan.interop.torchtitan_batch.BatchKeys`: b5bcd76's token counts)."""
    mixed = mixed_note(d)  # the raw file's float8 names, before old_float8 brings them to the current layout
    d, old_notes = old_float8(d)
    old_notes += mixed
    typo = misspelt(flatten(d), READ, NEAR_KEYS)
    if typo:
        raise ConfigError(typo[0], f"not a torchtitan key; did you mean {typo[1]}? (meshplan reads that one; "
                          f"misspelt, the setting would stay at its default)")
    _moved(flatten(d))
    notes: list[str] = old_notes
    model, used = read_model(d, base, opts, notes, custom)
    used |= float8_used(d)
    cluster, world = cluster_table(opts, "torchtitan")
    par = d.get("parallelism", {})
    deg = degrees(par)
    read_etp(par, deg, notes)
    dense = deg["pp"] * deg["dp_replicate"] * deg["cp"] * deg["tp"]
    shard = deg["dp_shard"] if deg["dp_shard"] > 0 else world // dense if world % dense == 0 else -1
    if shard < 1:  # the real constraint first: a tp that splits neither the model nor the node (issue 11)
        spec = table_model(model)
        misfit = spec and tp_misfit(spec, deg["tp"], catalog.node(cluster["system"]).gpus)
        if misfit:  # the model's (a tp 3 of 64 heads: infeasible, exit 1), else the node's (malformed, exit 2)
            model_fault = spec is not None and tp_misfit(spec, deg["tp"], deg["tp"]) is not None
            raise (InfeasibleInput if model_fault else ConfigError)("parallelism.tensor_parallel_degree", misfit)
        raise ConfigError("parallelism.data_parallel_shard_degree", f"-1 cannot be inferred: world {world} is not "
                          f"divisible by pp * dp_replicate * cp * tp = {dense}; give --nodes so that the world is a "
                          f"multiple of {dense}")
    if dense * shard != world:  # torchtitan's ParallelDims._validate asserts the product is the world size
        fix = f"data_parallel_shard_degree = {world // dense} or -1" if world % dense == 0 else \
            f"degrees whose product is {world}"
        notes.append(f"parallelism: pp * dp_replicate * dp_shard * cp * tp = {dense * shard}, the world is {world} "
                     f"({cluster['nodes']} node(s)); torchtitan refuses that at start-up (ParallelDims): set "
                     f"parallelism.{fix}")
    tables = {"model": model, "cluster": cluster, "training": _training(d, deg, shard, opts, model, notes, revision, batch),
              "mesh": mesh_table(deg, par, model_layers(model), notes)}
    tables["model"] = flavor_context(model, used, tables["training"]["seq_len"], notes)  # RoPE at the job's length
    # torchtitan's loss, F.cross_entropy(pred.flatten(0, 1).float(), ...): eager unless [compile]
    # compiles it (MemoryOptions.cross_entropy; tests/test_loss_memory.py measures both)
    t = tables["training"]
    compiled = t["torch_compile"] and t.get("torch_compile_loss", True)
    # torchtitan launches with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (9dec370 run_llama_train.sh
    # line 22, b5bcd76 run_train.sh line 43): the simulated allocator's option (MemoryOptions)
    tables["memory"] = {"cross_entropy": "compiled" if compiled else "torch", "expandable_segments": True}
    if deg["tp"] > 1:  # DTensor SP: the Linears keep their all-gathered input (module docstring)
        tables["memory"]["sp_gathered_input"] = True
    tables["memory"] |= kv_heads_read(table_model(tables["model"]), deg["cp"], t["op_sac_policy"], notes)
    if model_is_moe(model):  # torchtitan's MoE has no capacity factor (DROPLESS)
        tables["training"]["moe_dropless"] = True
        notes.append(DROPLESS)
    family = str(d.get("model", {}).get("name", "llama3"))  # torchtitan's default model.name
    tables["training"] |= read_backend(par, model_is_moe(model), notes, family)
    checkpoint, saved = read_checkpoint(d)
    notes += [n for n in [checkpoint_note(d)] if n]  # why its keys are listed unused (nc55 #14)
    tables |= {"reliability": checkpoint} if checkpoint else {}
    unused = tuple(k for k in flatten(d) if k not in USED | used | saved)
    named = {"name": "llama3", "flavor": "debugmodel"} | d.get("model", {})  # torchtitan's defaults
    keys = tuple((k, str(named[k])) for k in ("name", "flavor", "hf_assets_path")) \
        if "model.hf_assets_path" in used else ()  # the model read through hf_assets_path: exported back
    said = par.get("fsdp_reshard_after_forward")  # "default" left unset (_training): the note quotes it where written
    return Imported("torchtitan", tables, unused, tuple(notes), keys,
                    (("parallelism.fsdp_reshard_after_forward", said),) if said == "default" else ())


def _moved(keys) -> None:
    """ConfigError for a key meshplan reads under another table (older torchtitan kept the
    degrees under [training] and pp/cp degrees under [experimental]): misplaced, it would be
    ignored and its setting left at the default.

    >>> _moved(["training.tensor_parallel_degree"])
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: training.tensor_parallel_degree: torchtitan reads this key as parallelism.tensor_parallel_degree (older torchtitan kept it under [training]); move it there
    """
    tables = {r.rpartition(".")[0] for r in READ} | {"experimental"}
    for key in keys:
        table, _, leaf = key.rpartition(".")
        home = [r for r in READ if r.rpartition(".")[2] == leaf and r != key]
        if key not in READ and table in tables and len(home) == 1:
            raise ConfigError(key, f"torchtitan reads this key as {home[0]} (older torchtitan kept it under "
                              f"[{table}]); move it there")


#: The routing of torchtitan's MoE, as the import note says: TokenChoiceTopKRouter picks top_k
#: experts per token and GroupedExperts runs every routed copy (torch._grouped_mm over the
#: per-expert counts), no capacity factor (pytorch/torchtitan 08dc75a
#: ``torchtitan/models/moe/moe.py``).
DROPLESS = ("MoE: torchtitan's token-choice routing computes every routed copy (no capacity factor): planned "
            "dropless (training.moe_dropless = true)")
