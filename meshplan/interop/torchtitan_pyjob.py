"""torchtitan Python job config (a ``config_registry.py`` function, read statically by
:mod:`meshplan.interop.torchtitan_py`) -> the job TOML layout the TOML reader reads
(:func:`meshplan.interop.torchtitan.read`), which maps it onto meshplan: one home for each
torchtitan setting's meaning. Only the names differ, by revision (pytorch/torchtitan):

============================================ ============================================
config_registry.py (``Trainer.Config(...)``)  job TOML key read
============================================ ============================================
model_spec=model_registry("8B") of            model.name = "llama3" (the module model_registry is
  ``from . import model_registry`` in           imported from: the file's folder, or
  ``torchtitan/models/llama3/``                 ``torchtitan.models.<name>``), model.flavor = "8B"
hf_assets_path                                model.hf_assets_path
training=TrainingConfig(k=v), parallelism=,   training.k, parallelism.k, compile.k, checkpoint.k,
  compile=, checkpoint=, optimizer=             optimizer.k (9810191: the same field names as v0.2.2)
activation_checkpoint=                        activation_checkpoint.k (9810191's
  ActivationCheckpointConfig(k=v)               ``ActivationCheckpointConfig``, v0.2.2's table)
model_converters=ModelConvertersContainer.    model.converters ["quantize.linear.float8"] and
  Config(converters=[Float8LinearConverter.     quantize.linear.float8.k (9810191)
  Config(k=v)])
---- b5bcd76 (the newest torchtitan read) ---- ------------------------------------------
training.max_context_length L                 training.seq_len L (73aed7f, #4121, folded [B, L] into
                                                [T]: planned as T / L sequences of L tokens)
training.num_tokens_per_microbatch_per_dp_    parallelism.pipeline_parallel_microbatch_size T / L,
  rank T, parallelism.num_pp_microbatches m     training.local_batch_size m T / L (m: pp > 1 only)
training.num_tokens_per_train_step G          training.global_batch_size G / L (-1: -1)
compile.enable_async_tensor_parallel          parallelism.enable_async_tensor_parallel
activation_checkpoint=SelectiveAC.Config(),   activation_checkpoint.mode selective with option
  FullAC.Config(), MemoryBudgetAC.Config(),     "op" (per-op SAC: c5d93d1), full, memory_budget
  None                                          (refused), none; unset: SelectiveAC (trainer.py:108)
model_registry(..., moe_comm_backend=)       parallelism.expert_parallel_comm_backend (7cec166)
model_registry(..., converters=[Float8Linear  as 9810191's converters; filter_fqns "lm_head" (the
  Converter.Config(...)])                       output Linear's name since b3cf840) as "output"
============================================ ============================================

The revision planned (``training.op_sac_policy``): a file in 9810191's names is planned as
238fa99 (9810191's parent, whose model code 9810191 keeps), one in b5bcd76's as b5bcd76 (one
``wqkv`` GEMM, context parallelism only under flex attention); a file in neither's is read as
b5bcd76 with a note, one mixing both is an error naming a field of each. Keyword arguments of the
classes read are checked against their fields at 9810191 and b5bcd76 (:data:`FIELDS`,
``torchtitan/config/configs.py``, ``distributed/activation_checkpoint.py``,
``components/quantization/float8.py``): another is an error, as torchtitan's dataclasses raise.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.errors import ConfigError, closest
from meshplan.interop import torchtitan
from meshplan.interop.common import Imported, ImportOptions
from meshplan.interop.torchtitan_batch import BatchKeys, context_length, fold_tokens
from meshplan.interop.torchtitan_float8 import LINEAR_CONVERTERS
from meshplan.interop.torchtitan_py import Built, Opaque, function_tree, imported_from

#: Fields of the classes read, at 9810191 and b5bcd76 (module docstring).
FIELDS = {
    "TrainingConfig": "local_batch_size global_batch_size seq_len num_tokens_per_microbatch_per_dp_rank "
                      "num_tokens_per_train_step max_context_length max_norm steps enable_cpu_offload "
                      "disable_cuda_graphs dtype mixed_precision_param mixed_precision_reduce gc_freq gc_debug",
    "ParallelismConfig": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                         "enable_fsdp_symm_mem tensor_parallel_degree enable_sequence_parallel spmd_backend "
                         "disable_loss_parallel enable_async_tensor_parallel pipeline_parallel_degree "
                         "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                         "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                         "pipeline_parallel_schedule pipeline_parallel_schedule_csv "
                         "pipeline_parallel_microbatch_size num_pp_microbatches "
                         "pipeline_parallel_expert_parallel_overlap context_parallel_degree "
                         "context_parallel_load_balancer context_parallel_ptrr_mask_key "
                         "context_parallel_rotate_method expert_parallel_degree expert_tensor_parallel_degree "
                         "expert_parallel_comm_backend",
    "CompileConfig": "enable enable_async_tensor_parallel components backend",
    "ActivationCheckpointConfig": "mode selective_ac_option per_op_sac_force_recompute_mm_shapes_by_fqns early_stop "
                                  "memory_budget visualize_memory_budget_pareto preserve_rng_state "
                                  "determinism_check debug",
    "SelectiveAC.Config": "preserve_rng_state determinism_check debug force_recompute_mm_shapes_by_fqns",
    "FullAC.Config": "preserve_rng_state determinism_check debug",
    "MemoryBudgetAC.Config": "preserve_rng_state determinism_check debug memory_budget "
                             "visualize_memory_budget_pareto",
    # config.activation_checkpoint.k = v on torchtitan's default object, of 9810191 or b5bcd76
    "activation_checkpoint": "mode selective_ac_option per_op_sac_force_recompute_mm_shapes_by_fqns early_stop "
                             "memory_budget visualize_memory_budget_pareto preserve_rng_state determinism_check debug "
                             "force_recompute_mm_shapes_by_fqns",
    "Float8LinearConverter.Config": "enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp "
                                    "recipe_name filter_fqns emulate model_compile_enabled",
}
#: The fields of torchtitan's ``Trainer.Config`` (``torchtitan/trainer.py``: 9810191 lines 57-76, b5bcd76
#: lines 70-91): another keyword is an error, as the dataclass raises.
TRAINER_FIELDS = ("model_spec hf_assets_path dump_folder profiling profiler metrics tokenizer dataloader model_converters "
                  "optimizer lr_scheduler training parallelism checkpoint activation_checkpoint compile comm validator "
                  "debug override loss").split()
#: Trainer.Config field -> the class it holds, where meshplan reads its fields.
SECTIONS = {"training": "TrainingConfig", "parallelism": "ParallelismConfig", "compile": "CompileConfig"}
#: b5bcd76's names (module docstring), each marking a file in its layout; 9810191's: OLD.
NEW = {"training.num_tokens_per_microbatch_per_dp_rank", "training.max_context_length",
       "training.num_tokens_per_train_step", "parallelism.num_pp_microbatches", "compile.enable_async_tensor_parallel"}
OLD = {"training.local_batch_size", "training.seq_len", "training.global_batch_size",
       "parallelism.pipeline_parallel_microbatch_size", "parallelism.enable_async_tensor_parallel"}
#: activation_checkpoint's class (b5bcd76) -> [activation_checkpoint] of the job TOML.
AC_CLASSES = {"SelectiveAC.Config": {"mode": "selective", "selective_ac_option": "op"}, "FullAC.Config": {"mode": "full"},
              "MemoryBudgetAC.Config": {"mode": "memory_budget"}}
#: The starts of the TOML reader's notes on v0.2.2's converter names (torchtitan_float8's
#: float8_tp_of and mixed_note), which say nothing of a config registry's Float8LinearConverter.
TOML_NAME_NOTES = ("float8 TP off: torchtitan enables it for the converter named", 'model.converters "float8" with')
#: Where an error the TOML reader names by its key points in a config_registry.py.
RENAMED = {"model.name": "model_spec", "model.flavor": "model_spec", "model.hf_assets_path": "hf_assets_path",
           "model.converters": "model_spec converters"}
RENAMED_NEW = {"training.local_batch_size": "training.num_tokens_per_microbatch_per_dp_rank",
               "training.seq_len": "training.max_context_length",
               "training.global_batch_size": "training.num_tokens_per_train_step",
               "parallelism.pipeline_parallel_microbatch_size": "parallelism.num_pp_microbatches",
               "parallelism.enable_async_tensor_parallel": "compile.enable_async_tensor_parallel",
               "parallelism.expert_parallel_comm_backend": "model_spec moe_comm_backend"}


def _kwargs(value, field: str, cls: str | None = None) -> dict:
    """The keyword arguments of the object a field holds (``Built``), checked against
    ``cls``'s fields (:data:`FIELDS`); ConfigError naming the field otherwise."""
    if isinstance(value, Opaque):
        raise ConfigError(field, f"{value.source[:60]!r} is not read without running the file; write "
                          f"{field}={cls or 'Config'}(...) with literal arguments")
    if not isinstance(value, Built) or value.args:
        raise ConfigError(field, f"{value!r} is not a config object; write {field}={cls or 'Config'}(key=value, ...)")
    known = FIELDS.get(cls or value.name, "").split()
    for key in value.kwargs if known else ():
        if key not in known:
            near = closest(key, known)
            raise ConfigError(f"{field}.{key}", f"not a field of torchtitan's {cls or value.name} (9810191 or b5bcd76)"
                              + (f"; did you mean {near}?" if near else "; see its torchtitan/config/configs.py"))
    return value.kwargs


def _unread(value) -> str | None:
    """The text of the first part of ``value`` read only by running the file (a call, a name it
    does not bind), None for a literal (nested lists and dicts looked into)."""
    if isinstance(value, Opaque):
        return value.source
    if isinstance(value, Built):
        return f"{value.name}(...)"
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((t for t in map(_unread, items) if t is not None), None)


def _literal(value, field: str):
    """A value the job TOML reader reads: a literal (tuples as lists), else a ConfigError naming
    the field."""
    text = _unread(value)
    if text is not None:
        raise ConfigError(field, f"{text[:60]!r} is not read without running the file; write its value as a literal "
                          f"(a number, string, boolean or list)")
    return [_literal(v, field) for v in value] if isinstance(value, (list, tuple)) else value


def _section(value, field: str, cls: str | None = None) -> dict:
    """A section's literal settings, by field; a non-literal one of a field read is refused by
    :func:`_literal` where the TOML reader reads it (here: every one, they are few)."""
    return {k: _literal(v, f"{field}.{k}") for k, v in _kwargs(value, field, cls).items()}


def _model(tree: Built, text: str, path: Path) -> tuple[dict, list]:
    """[model] name and flavor from ``model_spec=model_registry("8B", converters=[...])``; the
    converters given there (b5bcd76)."""
    spec = tree.kwargs.get("model_spec")
    if spec is None:
        return {}, []
    if not isinstance(spec, Built) or not spec.name.endswith("model_registry") or not spec.args:
        raise ConfigError("model_spec", f"{getattr(spec, 'source', None) or getattr(spec, 'name', spec)!s:.60} is not "
                          f"read; write model_spec=model_registry(\"FLAVOR\") (or give --model)")
    flavor = _literal(spec.args[0], "model_spec")
    name = _family(text, path, spec.name.split(".")[0])
    model = {"flavor": flavor} | ({"name": name} if name else {})
    if "moe_comm_backend" in spec.kwargs:  # b5bcd76 models/deepseek_v3/__init__.py:616-629 (7cec166 moved it there)
        model["moe_comm_backend"] = _literal(spec.kwargs["moe_comm_backend"], "model_spec moe_comm_backend")
    return model, spec.kwargs.get("converters") or []


def _family(text: str, path: Path, callee: str = "model_registry") -> str | None:
    """The torchtitan model ``callee`` comes from: the file's folder for ``from . import``,
    ``torchtitan.models.<name>`` otherwise; None where neither says."""
    source = imported_from(text, str(path), callee) or ""
    parts = source.split(".")
    return path.resolve().parent.name if source.startswith(".") else parts[2] if parts[:2] == ["torchtitan", "models"] \
        and len(parts) > 2 else None


def _converters(items, new: bool) -> dict:
    """model.converters and [quantize.linear.float8] of the converters (Float8LinearConverter
    only: another is refused, naming it)."""
    if not items:
        return {}
    if not isinstance(items, list):
        raise ConfigError("model_spec converters", "give a list of converter configs, e.g. "
                          "[Float8LinearConverter.Config()]")
    out: dict = {}
    for c in items:
        name = str(getattr(c, "name", None) or getattr(c, "source", "?"))
        if name.split(".")[-2:] != ["Float8LinearConverter", "Config"]:
            raise ConfigError("model_spec converters", f"{name[:60]}: not planned by meshplan (it plans float8 "
                              f"Linears: Float8LinearConverter.Config)")
        where = "Float8LinearConverter.Config"  # model_compile_enabled: derived from [compile], not a setting
        f8 = {k: _literal(v, f"{where}.{k}") for k, v in _kwargs(c, where, where).items() if k != "model_compile_enabled"}
        if new and isinstance(f8.get("filter_fqns"), list):
            f8["filter_fqns"] = ["output" if f == "lm_head" else f for f in f8["filter_fqns"]]
        # float8 TP: 9810191 applies it for any Float8LinearConverter (find_float8_linear_config,
        # models/llama3/parallelize.py:90-100), as v0.2.2 did for the name "float8"; b5bcd76 has none
        # (no Float8ColwiseParallel under torchtitan/models or distributed): "quantize.linear.float8"
        out = {"model": {"converters": [LINEAR_CONVERTERS[1 if new else 0]]}, "quantize": {"linear": {"float8": f8}}}
    return out


def _tables(tree: Built, at: str) -> dict:
    """v0.2.2's ``JobConfig(model=Model(...), quantize=Quantize(linear=...))`` as the job TOML's
    tables (torchtitan/config/job_config.py at e347b1e: a dataclass per table, a field per key)."""
    if tree.args:
        raise ConfigError(at or "config", f"{tree.name}(...) with positional arguments; write key=value")
    return {k: _tables(v, f"{at}{k}.") if isinstance(v, Built) else _literal(v, at + k) for k, v in tree.kwargs.items()}


def _activation(tree: Built) -> tuple[dict, str | None]:
    """([activation_checkpoint] of the job TOML, the layout its class marks: "old", "new" or
    None); unset: b5bcd76's SelectiveAC and 9810191's ActivationCheckpointConfig() alike are
    torchtitan's default, left to the reader's revision (:func:`job_dict`)."""
    if "activation_checkpoint" not in tree.kwargs:
        return {}, None
    ac = tree.kwargs["activation_checkpoint"]
    if ac is None:  # b5bcd76: None disables it (activation_checkpoint.py:329-337)
        return {"mode": "none"}, "new"
    if isinstance(ac, Built) and ac.name.endswith("ActivationCheckpointConfig"):
        return _section(ac, "activation_checkpoint", "ActivationCheckpointConfig"), "old"
    cls = next((c for c in AC_CLASSES if isinstance(ac, Built) and (ac.name == c or ac.name.endswith("." + c))), None)
    if cls is None and isinstance(ac, Built) and ac.name == "":  # config.activation_checkpoint.k = v on the default
        keys = _section(ac, "activation_checkpoint", "activation_checkpoint")
        old = {"mode", "selective_ac_option", "per_op_sac_force_recompute_mm_shapes_by_fqns", "early_stop"} & set(keys)
        return keys, "old" if old else None
    if cls is None:
        raise ConfigError("activation_checkpoint", f"{getattr(ac, 'name', None) or getattr(ac, 'source', ac)!s:.60} is "
                          f"not read; write SelectiveAC.Config(), FullAC.Config() or None (b5bcd76), or "
                          f"ActivationCheckpointConfig(mode=...) (9810191)")
    _section(ac, "activation_checkpoint", cls)  # its fields checked; none of them is planned
    return dict(AC_CLASSES[cls]), "new"


def _others(tree: Built, done: set[str]) -> dict:
    """The literal settings of the Trainer.Config fields meshplan does not read, by field (so
    that the import lists them as unused); calls and names there are skipped."""
    out: dict = {}
    for name, value in tree.kwargs.items():
        if name in done:
            continue
        if isinstance(value, Built):
            leaves = {k: v for k, v in value.kwargs.items() if isinstance(v, (str, int, float, bool))}
            out |= {name: leaves} if leaves else {}
        elif isinstance(value, (str, int, float, bool)):
            out.setdefault("job", {})[name] = value
    return out


def _optimizer(tree: Built, notes: list[str]) -> dict:
    """[optimizer] of ``optimizer=``: 9810191's OptimizersContainer.Config(name=...,
    implementation=...) as it is (``name`` unset: torchtitan's AdamW), b5bcd76's ``default_adamw(...)``
    AdamW (components/optimizer/optimizer.py:378-398: its keywords, ``lr`` first, AdamW's own); their
    literal keywords meshplan does not read listed unused, as a job TOML's ``[optimizer] lr``."""
    opt = tree.kwargs.get("optimizer")
    if opt is None:
        return {}
    if isinstance(opt, Built):  # its literals kept, so those meshplan does not read (lr) are listed unused (nc57 #9)
        kept = {k: v for k, v in opt.kwargs.items() if isinstance(v, (str, int, float, bool))}
        if opt.name.split(".")[-1] == "default_adamw":  # its keywords are AdamW's optimizer_kwargs: none read
            return {"name": "AdamW"} | {k: v for k, v in kept.items() if k not in ("name", "implementation", "fused")}
        if dropped := [k for k in opt.kwargs if k not in kept]:  # param_groups=[...]: which optimizer is not read
            notes.append(f"optimizer {opt.name}'s {', '.join(dropped)} not read: planned as "
                         f"{kept.get('name', 'AdamW')}")
        return kept
    notes.append(f"optimizer {getattr(opt, 'name', None) or getattr(opt, 'source', '?')!s:.60} not read: planned as "
                 f"torchtitan's default AdamW")
    return {}


def _layout(old: list[str], new: list[str]) -> str:
    """The revision planned: 238fa99 for 9810191's names, b5bcd76 for b5bcd76's (module docstring)."""
    if old and new:  # the old name in the new one's table where there is one (nc57 #4: training's beside training's)
        near, beside = next(((o, n) for n in new for o in old if o.split(".")[0] == n.split(".")[0]), (old[0], new[0]))
        raise ConfigError(near, f"torchtitan 9810191's name beside b5bcd76's {beside} (73aed7f renamed the batch "
                          f"keys, c5d93d1 the activation checkpoint classes): write the file in one torchtitan's names")
    return "238fa99" if old else "b5bcd76"


def job_dict(tree: Built, text: str, path: Path, notes: list[str]) -> tuple[dict, str, BatchKeys]:
    """(the job TOML layout of the tree a config function returns, the torchtitan revision
    planned: ``training.op_sac_policy``, the batch keys the file spelled); module docstring."""
    if tree.name.endswith("JobConfig"):  # v0.2.2's dataclasses: the job TOML's own tree
        notes.append("a JobConfig(...) tree: torchtitan v0.2.2's job TOML layout, table by table")
        return _tables(tree, ""), "238fa99", BatchKeys()
    if not tree.name.endswith("Config"):
        raise ConfigError("config", f"{path}: the function returns {tree.name}(...), not a Trainer.Config(...)")
    for key in tree.kwargs:
        if key not in TRAINER_FIELDS:
            near = closest(key, TRAINER_FIELDS)
            raise ConfigError(key, "not a field of torchtitan's Trainer.Config (9810191 or b5bcd76)" + (
                f"; did you mean {near}?" if near else f"; its fields: {', '.join(TRAINER_FIELDS)}"))
    d = {s: _section(tree.kwargs[s], s, cls) for s, cls in SECTIONS.items() if s in tree.kwargs}
    model, items = _model(tree, text, path)
    ac, ac_layout = _activation(tree)
    keys = {f"{s}.{k}" for s, kv in d.items() for k in kv}
    old = sorted(keys & OLD) + ["activation_checkpoint"] * (ac_layout == "old") + \
        ["model_converters"] * ("model_converters" in tree.kwargs)
    new = sorted(keys & NEW) + ["activation_checkpoint"] * (ac_layout == "new") + ["model_spec converters"] * bool(items)
    revision = _layout(old, new)
    if "model_converters" in tree.kwargs:
        items = _kwargs(tree.kwargs["model_converters"], "model_converters").get("converters") or []
    d |= _converters(items, revision == "b5bcd76")
    if "moe_comm_backend" in model:  # the EP backend: the job TOML's parallelism key, read_backend's
        d.setdefault("parallelism", {})["expert_parallel_comm_backend"] = model.pop("moe_comm_backend")
    d["model"] = d.get("model", {}) | model
    if "hf_assets_path" in tree.kwargs:
        d["model"]["hf_assets_path"] = _literal(tree.kwargs["hf_assets_path"], "hf_assets_path")
    if isinstance(tree.kwargs.get("checkpoint"), Built):  # enable and interval read, the other literals listed
        ck = tree.kwargs["checkpoint"].kwargs
        d["checkpoint"] = {k: _literal(v, f"checkpoint.{k}") for k, v in ck.items()
                           if k in ("enable", "interval") or isinstance(v, (str, int, float, bool))}
    d |= {"optimizer": opt} if (opt := _optimizer(tree, notes)) else {}
    batch = BatchKeys()
    if revision == "b5bcd76":
        batch = BatchKeys(fold_tokens(d, notes))
        if "enable_async_tensor_parallel" in d.get("compile", {}):
            d["parallelism"]["enable_async_tensor_parallel"] = d["compile"].pop("enable_async_tensor_parallel")
        ac = ac if ac_layout else AC_CLASSES["SelectiveAC.Config"] | ac  # trainer.py:108's default
        _b5bcd76_checks(d, tree, notes)
        if not old and not new:
            notes.append("the file names neither 9810191's batch keys (local_batch_size, seq_len) nor b5bcd76's "
                         "(num_tokens_per_microbatch_per_dp_rank, max_context_length): planned as torchtitan b5bcd76")
    d |= {"activation_checkpoint": ac} if ac else {}
    d |= _others(tree, set(SECTIONS) | {"model_spec", "model_converters", "hf_assets_path", "activation_checkpoint",
                                        "checkpoint", "optimizer"})
    return d, revision, batch


def _b5bcd76_checks(d: dict, tree: Built, notes: list[str]) -> None:
    """What b5bcd76 refuses or runs otherwise than the TOML layout says: CUDA graphs with pp
    (trainer.py ``_validate_cuda_graphs``: "CUDA graphs do not support pipeline parallelism yet"),
    TP without sequence parallelism (``enable_sequence_parallel``, not planned by the import);
    the attention kernel (llama3 ``model_registry``'s ``attn_backend="flex"`` default,
    models/llama3/__init__.py:369-376), said in a note."""
    par, tr = d.get("parallelism", {}), d.get("training", {})
    if par.get("pipeline_parallel_degree", 1) != 1 and not tr.get("disable_cuda_graphs", False):
        raise ConfigError("training.disable_cuda_graphs", "False with pipeline_parallel_degree > 1: torchtitan b5bcd76 "
                          "raises \"CUDA graphs do not support pipeline parallelism yet\"; set disable_cuda_graphs=True")
    if par.get("enable_sequence_parallel", True) is not True and par.get("tensor_parallel_degree", 1) != 1:
        raise ConfigError("parallelism.enable_sequence_parallel", "False: meshplan plans torchtitan's tensor parallel "
                          "with sequence parallelism only; set it True (the default) or plan a meshplan TOML with "
                          "[mesh] sequence_parallel = false")
    spec = tree.kwargs.get("model_spec")
    backend = spec.kwargs.get("attn_backend", "flex") if isinstance(spec, Built) else "flex"
    notes.append(f"attention planned with SDPA's kernels; b5bcd76's model_registry runs attn_backend "
                 f"{backend!r} (its default \"flex\": FlexAttention), whose kernel times meshplan does not model")


def read_py(text: str, path: Path, opts: ImportOptions) -> Imported:
    """meshplan tables of the config function ``opts.job_config`` (``--config``; None: the file's
    only one) of torchtitan ``config_registry.py`` text ``text`` at ``path``, through the job TOML
    reader; an error of that reader names the field as the Python file spells it."""
    read_notes: list[str] = []
    name, tree = function_tree(text, str(path), opts.job_config, context_length(_family(text, path), read_notes))
    notes = [f"read {name} of {path.name} without running it (torchtitan's Python job config)"] + read_notes
    d, revision, batch = job_dict(tree, text, path, notes)
    try:
        imp = torchtitan.read(d, path.parent, opts, revision=revision, batch=batch)
    except ConfigError as e:
        renamed = RENAMED.get(e.field) or (RENAMED_NEW.get(e.field) if revision == "b5bcd76" else None)
        if renamed is None:
            raise
        raise type(e)(renamed, e.message) from None
    notes.append(f"planned as torchtitan {revision} runs it (training.op_sac_policy = \"{revision}\")")
    t, tp = imp.tables["training"], d.get("parallelism", {}).get("tensor_parallel_degree", 1)
    if revision == "238fa99" and t.get("linear_dtype") == "fp8" and t.get("fp8_tp", True) and tp != 1:
        notes.append("float8 TP planned on, as 9810191 applies it to any Float8LinearConverter (models/llama3/"
                     "parallelize.py:90-100); a torchtitan from 1786292 (#2963) on has none: set [training] fp8_tp = "
                     "false in the imported TOML for it")
    if t.get("fp8_tp") is False and revision == "b5bcd76":
        notes.append("float8 TP off: torchtitan b5bcd76 has no float8 tensor parallel (no Float8ColwiseParallel): the "
                     "tp all-gathers move the compute dtype (training.fp8_tp = false)")
    # the TOML reader's notes on v0.2.2's converter names, which a Python config does not use
    kept = tuple(n for n in imp.notes if not n.startswith(TOML_NAME_NOTES))
    # b5bcd76's pp check reads disable_cuda_graphs (_b5bcd76_checks): not unused then (nc57 #9)
    checked = {"training.disable_cuda_graphs"} if revision == "b5bcd76" and \
        d.get("parallelism", {}).get("pipeline_parallel_degree", 1) != 1 else set()
    unused = tuple(k for k in imp.unused if k not in checked)
    return Imported(imp.fmt, imp.tables, unused, tuple(notes) + kept, imp.model_keys, imp.said)
