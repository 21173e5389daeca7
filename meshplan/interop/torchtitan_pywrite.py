"""meshplan config -> a torchtitan Python job config (``export --to torchtitan -o JOB.py``): one
function returning the ``Trainer.Config(...)`` torchtitan 9810191 on runs (``--module``/``--config``,
:mod:`meshplan.interop.torchtitan_py`), in the field names of the revision asked for; the inverse of
:func:`meshplan.interop.torchtitan_pyjob.job_dict`, whose table gives each name's meaning.

How: the job tables of the plan (:func:`meshplan.interop.torchtitan_write.write`, v0.2.2's layout),
with a source ``config_registry.py`` function's own settings carried through as a job TOML's are
(:func:`meshplan.interop.torchtitan_carry.carried`: every key meshplan does not read kept, those it
reads the plan's), are set on the source's ``Trainer.Config`` tree field by field
(:func:`planned`): ``training``, ``parallelism``, ``activation_checkpoint``, ``compile``,
``checkpoint``, the float8 converter, ``model_spec`` and (9810191) ``optimizer``; every other field
(``dataloader``, ``lr_scheduler``, ``metrics``, ``validator``, ``loss``, ...) and every keyword of a
set field that meshplan does not read (``training.steps``, ``optimizer.lr``) is written as the
source states it. A function that builds on another (``config = llama3_8b()``) is written whole.

Revisions (pytorch/torchtitan): 9810191's names are v0.2.2's keys, one dataclass per table, float8 as
``model_converters=ModelConvertersContainer.Config(converters=[Float8LinearConverter.Config(...)])``;
b5bcd76's (:data:`FIELDS`, ``torchtitan/config/configs.py`` there) fold the batch into token counts
(``num_tokens_per_microbatch_per_dp_rank`` = micro-batch rows x L, ``num_pp_microbatches``,
``num_tokens_per_train_step`` = global batch x L, ``max_context_length`` L: 73aed7f), take async TP
under ``compile``, the recompute as a class (``SelectiveAC.Config()`` is op-level SAC,
``FullAC.Config()``, None: off; c5d93d1) and the converters in ``model_registry(flavor, converters=...)``
with the output Linear named ``lm_head`` (b3cf840); they have no layer-level SAC, no ETP and no
float8 all-gather key, which are one-line errors or, where the re-import plans otherwise, listed as
not expressed. ``model_registry`` is imported from ``torchtitan.models.<name>`` (absolute, so the
file runs wherever it lies: b5bcd76 imports a ``--module`` path, cfd67d392).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop import torchtitan_carry, torchtitan_write
from meshplan.interop.common import Imported, ImportOptions, flatten
from meshplan.interop.torchtitan import READ
from meshplan.interop.torchtitan_py import Built, Opaque, function_tree
from meshplan.interop.torchtitan_pycode import code, header_code
from meshplan.interop.torchtitan_pytarget import PyTarget
from meshplan.interop.torchtitan_pyjob import job_dict, read_py

#: The fields of the classes written, by revision (``torchtitan/config/configs.py`` at 9810191: TrainingConfig
#: 27-74, ParallelismConfig 84-246, ActivationCheckpointConfig 259-321, CompileConfig 329-336; at b5bcd76:
#: TrainingConfig 36-111, ParallelismConfig 121-282, CompileConfig 294-304; ``Float8LinearConverter.Config``:
#: ``components/quantization/float8.py`` 28-49 at 9810191, 55-71 with ``model_compile_enabled`` of
#: ``quantization/__init__.py``:30 at b5bcd76). A key of the job tables that the revision has no field for is
#: not written; the round trip lists what that changes.
FIELDS = {
    "9810191": {
        "training": "local_batch_size global_batch_size seq_len max_norm steps enable_cpu_offload dtype "
                    "mixed_precision_param mixed_precision_reduce gc_freq gc_debug",
        "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                       "tensor_parallel_degree disable_loss_parallel enable_async_tensor_parallel pipeline_parallel_degree "
                       "module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                       "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                       "pipeline_parallel_schedule pipeline_parallel_schedule_csv pipeline_parallel_microbatch_size "
                       "pipeline_parallel_expert_parallel_overlap context_parallel_degree context_parallel_load_balancer "
                       "context_parallel_rotate_method expert_parallel_degree expert_tensor_parallel_degree "
                       "expert_parallel_comm_backend",
        "compile": "enable components backend",
        "float8": "enable_fsdp_float8_all_gather precompute_float8_dynamic_scale_for_fsdp recipe_name filter_fqns emulate"},
    "b5bcd76": {
        "training": "num_tokens_per_microbatch_per_dp_rank num_tokens_per_train_step max_context_length max_norm steps "
                    "enable_cpu_offload disable_cuda_graphs dtype mixed_precision_param mixed_precision_reduce gc_freq "
                    "gc_debug",
        "parallelism": "data_parallel_replicate_degree data_parallel_shard_degree fsdp_reshard_after_forward "
                       "enable_fsdp_symm_mem tensor_parallel_degree enable_sequence_parallel spmd_backend "
                       "pipeline_parallel_degree module_fqns_per_model_part pipeline_parallel_first_stage_less_layers "
                       "pipeline_parallel_last_stage_less_layers pipeline_parallel_layers_per_stage "
                       "pipeline_parallel_schedule pipeline_parallel_schedule_csv num_pp_microbatches "
                       "context_parallel_degree context_parallel_load_balancer context_parallel_ptrr_mask_key "
                       "expert_parallel_degree",
        "compile": "enable enable_async_tensor_parallel components backend",
        "float8": "recipe_name filter_fqns emulate model_compile_enabled"},
}
#: The class a field is written as where the source has none (torchtitan's own default class,
#: ``Trainer.Config`` at 9810191 trainer.py:57-76, b5bcd76 70-91).
CLASSES = {"training": "TrainingConfig", "parallelism": "ParallelismConfig", "compile": "CompileConfig",
           "checkpoint": "CheckpointManager.Config", "optimizer": "OptimizersContainer.Config",
           "lr_scheduler": "LRSchedulersContainer.Config", "metrics": "MetricsProcessor.Config",
           "validator": "Validator.Config", "comm": "CommConfig", "debug": "DebugConfig",
           "activation_checkpoint": "ActivationCheckpointConfig", "profiling": "ProfilingConfig",
           "profiler": "Profiler.Config"}
#: What torchtitan runs where a written function states none of these (9810191 and b5bcd76 alike:
#: ``Trainer.Config.hf_assets_path``, ``BaseDataLoader.Config`` with ``dataset = ""``,
#: ``TrainingConfig.steps``, the optimizer's ``lr``: 9810191 ``OptimizersContainer.Config.lr``, b5bcd76
#: ``default_adamw(lr=8e-4)``, optimizer.py:378): listed by :func:`unset_note`.
RUN_DEFAULTS = {"hf_assets_path": '"./tests/assets/tokenizer", its test tokenizer',
                "dataloader": "BaseDataLoader.Config(), no dataset", "training.steps": "10000",
                "optimizer.lr": "8e-4"}


def _batch_b5bcd76(tr: dict, par: dict) -> dict:
    """b5bcd76's token counts of the job tables' batch (module docstring; pyjob's ``_folded`` inverse)."""
    ctx, local, pp = tr["seq_len"], tr["local_batch_size"], par.get("pipeline_parallel_degree", 1)
    rows = par.get("pipeline_parallel_microbatch_size", local) if pp != 1 else local
    glob = tr.get("global_batch_size", -1)
    out = {"num_tokens_per_microbatch_per_dp_rank": rows * ctx, "max_context_length": ctx,
           "num_tokens_per_train_step": glob * ctx if glob != -1 else -1}
    out |= {k: v for k, v in tr.items() if k not in ("seq_len", "local_batch_size", "global_batch_size")}
    return out | ({"disable_cuda_graphs": True} if pp != 1 else {})


def _ac(ac: dict, revision: str) -> Any:
    """``activation_checkpoint`` of [activation_checkpoint] ``ac`` at ``revision``."""
    if revision == "9810191":
        return Built("ActivationCheckpointConfig", (), dict(ac))
    mode, option = ac.get("mode", "selective"), str(ac.get("selective_ac_option", "op"))
    if mode == "none":
        return None
    if mode == "full":
        return Built("FullAC.Config")
    if mode == "selective" and option == "op":
        return Built("SelectiveAC.Config")
    raise ConfigError("--torchtitan-revision", f"activation_checkpoint mode {mode!r}, selective_ac_option {option!r}: "
                      f"torchtitan b5bcd76 has op-level SAC (SelectiveAC), FullAC or none (c5d93d1 removed layer "
                      f"SAC); give --torchtitan-revision 9810191, or plan training.recompute op, full or none")


def _float8(tables: dict, revision: str) -> Optional[Built]:
    """The Float8LinearConverter.Config of the job tables (None without float8)."""
    if not tables.get("model", {}).get("converters"):
        return None
    f8 = tables.get("quantize", {}).get("linear", {}).get("float8", {})
    kw = {k: v for k, v in f8.items() if k in FIELDS[revision]["float8"].split()}
    if revision == "b5bcd76":
        if "filter_fqns" in kw:  # the output Linear's name since b3cf840
            kw["filter_fqns"] = ["lm_head" if f == "output" else f for f in kw["filter_fqns"]]
        if kw.get("recipe_name") not in (None, "rowwise", "rowwise_with_gw_hp"):
            kw.pop("recipe_name")  # b5bcd76 has rowwise recipes only: its default, the round trip says what moves
        c = tables.get("compile", {})
        kw["model_compile_enabled"] = bool(c.get("enable")) and "model" in c.get("components", ["model", "loss"])
    return Built("Float8LinearConverter.Config", (), kw)


def planned(tables: dict, revision: str) -> dict[str, Any]:
    """The ``Trainer.Config`` fields of job tables ``tables`` meshplan writes, at ``revision``: the
    sections as ``{key: value}`` (set on the source's object by :func:`_merged`), ``activation_checkpoint``,
    ``model_converters`` and ``model_spec`` as objects (``model_spec``: its flavor and keywords)."""
    names = FIELDS[revision]
    tr, par = dict(tables.get("training", {})), dict(tables.get("parallelism", {}))
    comp = dict(tables.get("compile", {}))
    spec: dict[str, Any] = {}
    if revision == "b5bcd76":
        tr = _batch_b5bcd76(tr, par)
        if par.get("expert_tensor_parallel_degree", 1) != 1:
            raise ConfigError("--torchtitan-revision", f"expert_tensor_parallel_degree "
                              f"{par['expert_tensor_parallel_degree']}: torchtitan b5bcd76 has no ETP (c4b409a "
                              f"removed it); set etp 1 in [mesh], or give --torchtitan-revision 9810191")
        if par.get("enable_async_tensor_parallel"):
            comp["enable_async_tensor_parallel"] = True
        if par.get("expert_parallel_comm_backend", "standard") != "standard":  # 7cec166: a model_registry keyword
            spec["moe_comm_backend"] = par["expert_parallel_comm_backend"]
        if "module_fqns_per_model_part" in par:  # the output Linear's name (pipeline_parallel.py:387, 456)
            par["module_fqns_per_model_part"] = [["lm_head" if m == "output" else m for m in part]
                                                 for part in par["module_fqns_per_model_part"]]
        if par.get("pipeline_parallel_degree", 1) != 1:
            par["num_pp_microbatches"] = tables["training"]["local_batch_size"] // par["pipeline_parallel_microbatch_size"]
    out: dict[str, Any] = {s: {k: v for k, v in d.items() if k in names[s].split()}
                           for s, d in (("training", tr), ("parallelism", par), ("compile", comp)) if d}
    out["checkpoint"] = dict(tables["checkpoint"]) if "checkpoint" in tables else {}
    out["activation_checkpoint"] = _ac(tables.get("activation_checkpoint", {}), revision)
    if revision == "9810191":
        out["optimizer"] = dict(tables.get("optimizer", {}))
    f8 = _float8(tables, revision)
    if f8 is not None and revision == "9810191":
        out["model_converters"] = Built("ModelConvertersContainer.Config", (), {"converters": [f8]})
    elif f8 is not None:
        spec["converters"] = [f8]
    out["model_spec"] = (tables["model"].get("flavor", "debugmodel"), spec)
    if "hf_assets_path" in tables.get("model", {}):
        out["hf_assets_path"] = tables["model"]["hf_assets_path"]
    return out


def _read_keys(field: str) -> set[str]:
    """The keywords of ``field`` that meshplan reads (in either revision's names): set from the
    plan, never carried from the source."""
    keys = {r.partition(".")[2] for r in READ if r.partition(".")[0] == field}
    return keys | {"training": {"num_tokens_per_microbatch_per_dp_rank", "num_tokens_per_train_step",
                                "max_context_length"},
                   "parallelism": {"num_pp_microbatches"}, "compile": {"enable_async_tensor_parallel"}}.get(field, set())


def _merged(src: Any, kw: dict, field: str) -> Optional[Built]:
    """The source's ``field`` object with the plan's keywords ``kw`` set: its other keywords
    kept in place and order, those meshplan reads (:func:`_read_keys`) only as the plan gives
    them; None where nothing is left."""
    mine = src if isinstance(src, Built) else Built("")
    read = _read_keys(field)
    out = {k: kw.get(k, v) for k, v in mine.kwargs.items() if k in kw or k not in read}
    out |= {k: v for k, v in kw.items() if k not in out}
    if not out and not isinstance(src, Built):
        return None
    return Built(mine.name or CLASSES[field], (), out)


def _model_refs(v: Any, where: str = "config") -> Any:
    """``v`` with every ``model_registry(...)`` call in it the written ``model_spec`` local; a field
    set on torchtitan's default object (``config.metrics.log_freq = 1``, a ``Built("")``) named by its
    class (:data:`CLASSES`), a ConfigError naming it where meshplan does not know the class."""
    if isinstance(v, Built):
        if v.name.split(".")[-1] == "model_registry":
            return Opaque("model_spec")
        name = v.name or CLASSES.get(where, "")
        if not name:
            said = f"config.{where}.{next(iter(v.kwargs), '...')} = ..."
            raise ConfigError(where, f"set on torchtitan's default object ({said}), whose class meshplan does not "
                              f"know here: write {where}=ClassName.Config(...) in the source to export it")
        return Built(name, tuple(_model_refs(a, where) for a in v.args),
                     {k: _model_refs(x, f"{where}.{k}") for k, x in v.kwargs.items()})
    if isinstance(v, list):
        return [_model_refs(x, where) for x in v]
    return v


def written_tree(source: Optional[Built], tables: dict, revision: str) -> tuple[Built, Built, list[str]]:
    """(the ``Trainer.Config`` to write, its ``model_spec = model_registry(...)``, the source's fields
    and keywords kept as written) of job tables ``tables`` over the source's tree (module docstring)."""
    tree = copy.deepcopy(source) if source is not None else Built("Trainer.Config")
    plan = planned(tables, revision)
    flavor, spec_kw = plan.pop("model_spec")
    old_spec = tree.kwargs.get("model_spec")
    kept_spec = {k: v for k, v in getattr(old_spec, "kwargs", {}).items() if k not in ("converters", "moe_comm_backend")}
    spec = Built("model_registry", (flavor,), kept_spec | spec_kw)
    kept = [k for k in tree.kwargs if k not in plan and k not in ("model_spec", "model_converters", "hf_assets_path")]
    for field in ("training", "parallelism", "compile", "checkpoint", "optimizer"):
        if field not in plan:
            continue
        src = tree.kwargs.get(field)
        value = _merged(src, plan[field], field)
        kept += [f"{field}.{k}" for k in getattr(src, "kwargs", {}) if k not in _read_keys(field)
                 and value is not None and k in value.kwargs]
        tree.kwargs.pop(field, None) if value is None else tree.kwargs.__setitem__(field, value)
    ac, src = plan["activation_checkpoint"], tree.kwargs.get("activation_checkpoint")
    if isinstance(ac, Built) and isinstance(src, Built) and src.name in ("", ac.name) and src.kwargs:
        ac = Built(ac.name, (), {k: v for k, v in src.kwargs.items() if k not in _read_keys("activation_checkpoint")}
                   | ac.kwargs)
    tree.kwargs["activation_checkpoint"] = ac
    # the source's hf_assets_path stays where the plan names none (--model given: no path read)
    src_path = tree.kwargs.get("hf_assets_path", None)
    kept += ["hf_assets_path"] * (src_path is not None and plan.get("hf_assets_path", src_path) == src_path)
    for field in ("model_converters", "hf_assets_path"):  # the plan's, or none (the source's path kept)
        if field in plan:
            tree.kwargs[field] = plan[field]
        elif field == "model_converters":
            tree.kwargs.pop(field, None)
    first = {} if "model_spec" in tree.kwargs else {"model_spec": None}
    tree.kwargs = {k: _model_refs(v, k) for k, v in (first | tree.kwargs).items()} | \
        {"model_spec": Opaque("model_spec")}  # first, or where the source has it
    return tree, spec, kept


def _canon(v: Any) -> Any:
    """``v`` compared without the order of keywords."""
    if isinstance(v, Built):
        return (v.name, tuple(map(_canon, v.args)), tuple(sorted((k, _canon(x)) for k, x in v.kwargs.items())))
    if isinstance(v, (list, tuple)):
        return tuple(map(_canon, v))
    return repr(v)


def _compared(source: Optional[Built], tree: Built, spec: Built) -> list[str]:
    """``field.key A -> B`` (or ``-> dropped``) for each keyword of the source's written fields
    the written function states otherwise, on one line each."""
    if source is None:
        return []
    out, flat = [], lambda v: code(v, 0, 10 ** 6)
    for field, value in source.kwargs.items():
        new = spec if field == "model_spec" else tree.kwargs.get(field)
        if isinstance(value, Built) and isinstance(new, Built) and value.name in ("", new.name):
            out += [f"{field}.{k} {flat(v)} -> " + (flat(new.kwargs[k]) if k in new.kwargs else "dropped")
                    for k, v in value.kwargs.items() if _canon(v) != _canon(new.kwargs.get(k, Opaque("")))]
        elif field not in tree.kwargs:
            out.append(f"{field} {flat(value)} -> dropped")
        elif _canon(_model_refs(value, field) if field != "model_spec" else value) != _canon(new):
            out.append(f"{field} {flat(value)} -> {flat(new)}")
    return out


def unset_note(tree: Built) -> list[str]:
    """The header note naming each of :data:`RUN_DEFAULTS` the written ``tree`` does not state."""
    def stated(key: str) -> bool:
        field, _, kw = key.partition(".")
        value = tree.kwargs.get(field)
        return field in tree.kwargs if not kw else isinstance(value, Built) and kw in value.kwargs

    unset = [k for k in RUN_DEFAULTS if not stated(k)]
    return [f"note: not stated, set before running (torchtitan's default otherwise): "
            + ", ".join(f"{k} ({RUN_DEFAULTS[k]})" for k in unset)] if unset else []


#: Keys of a torchtitan job TOML (v0.2.2) carried into a Python config: the same field in 9810191 and b5bcd76
#: (``Trainer.Config.hf_assets_path``, ``TrainingConfig.steps``); its other keys are listed, not carried.
TOML_KEPT = ("model.hf_assets_path", "training.steps")


def _toml_kept(toml: dict, tables: dict) -> dict:
    """``tables`` with :data:`TOML_KEPT` of the user's job TOML ``toml`` (the hf folder while the model
    is still the user's: :func:`~meshplan.interop.torchtitan_carry.carried` decides)."""
    carried = flatten(torchtitan_carry.carried(toml, tables)[0])
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in tables.items()}
    for key in TOML_KEPT:
        if key in carried:
            table, _, name = key.partition(".")
            out.setdefault(table, {})[name] = carried[key]
    return out


def _target_line(target: PyTarget, model: str) -> str:
    return (f"target: torchtitan {target.revision} on (a Python config: {target.name}() returns its Trainer.Config in "
            f"{target.revision}'s field names): run it with --module MODULE --config {target.name}, MODULE this file's "
            f"module path on PYTHONPATH (torchtitan from cfd67d392, 2026-03-05); torchtitan 9810191 imports only its "
            f"own registries: add the function to torchtitan/models/{model}/config_registry.py and give --module {model}")


def py_file(cfg: Config, source: str, target: PyTarget, opts: ImportOptions,
            toml: Optional[dict] = None) -> tuple[str, Imported, list[str]]:
    """(the Python job config of ``cfg``, its re-import, the header's lines): module docstring. The
    header names what was carried from the source function, what of it is written otherwise, the
    notes of :func:`~meshplan.interop.torchtitan_write.write_notes` and what no value states
    (:func:`unset_note`); from a torchtitan job TOML (``toml``, parsed), the keys meshplan does not
    plan that it holds, not carried (v0.2.2's keys are not all 9810191's or b5bcd76's fields). ConfigError
    naming ``-o`` for a model whose flavor torchtitan does not ship (the job TOML's flavor file has
    no Python-config counterpart here)."""
    custom = torchtitan_write.custom_flavor(cfg)
    if custom is not None:
        raise ConfigError("-o", f"model.flavor {custom.name!r} is no flavor torchtitan ships and a Python config "
                          f"cannot register one here: give -o FILE.toml (a job TOML, with the .py registering it)")
    written = torchtitan_write.write(cfg)
    text, tree, doc = None, None, None
    if target.path is not None:
        text = target.path.read_text(encoding="utf-8", errors="replace")
        _, tree = function_tree(text, str(target.path), target.function)
        doc = job_dict(copy.deepcopy(tree), text, target.path, [])[0]
    tables, _ = torchtitan_carry.carried(doc, written) if doc is not None else (written, [])
    if toml is not None and doc is None:  # a job TOML's: the keys both revisions have the same field for
        tables = _toml_kept(toml, tables)
    tables, ac_notes = torchtitan_carry.kept_recompute(doc, tables, cfg) if doc is not None else (tables, [])
    out, spec, kept = written_tree(tree, tables, target.revision)
    model = tables["model"].get("name", "llama3")
    head = [_target_line(target, model)]
    head += [f"carried unchanged from {source}: {', '.join(kept)}"] if kept else []
    done = set(flatten(tables))
    lost = [k for k in torchtitan_carry.carried(toml, written)[1] if k not in done] if toml is not None and \
        target.path is None else []
    head += [f"not carried from {source} (torchtitan v0.2.2's keys; write them in the function by hand): "
             f"{', '.join(lost)}"] if lost else []
    moved = _compared(tree, out, spec)
    head += [f"written otherwise than {source} (the plan's value or spelling): {', '.join(moved)}"] if moved else []
    notes = torchtitan_write.write_notes(cfg, recompute_noted=bool(ac_notes))
    head += ac_notes + [n for n in notes if not n.startswith('note: training.op_sac_policy "b5bcd76"')]
    head += unset_note(out)
    imports = header_code(out, {"model_spec": spec}, target.revision, text, f"torchtitan.models.{model}",
                          target.function or target.name)
    body = "\n".join(imports) + f"\n\n\ndef {target.name}() -> Trainer.Config:\n" + \
        f"    model_spec = {code(spec, 1)}\n    return {code(out, 1)}\n"
    again = read_py(body, Path(f"{target.name}.py"), replace(opts, job_config=target.name))
    return body, again, head
