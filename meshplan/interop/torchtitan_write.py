"""meshplan config -> torchtitan job TOML (``export --to torchtitan``): the inverse of
:func:`meshplan.interop.torchtitan.read`, key names as in that module's table; the degrees and
sharding torchtitan would build checked against the plan's, the resharding policy
(:func:`reshard_policy`) and the header notes of an export (:func:`write_notes`). The
pipeline split, [activation_checkpoint] and the optimizer are written by
:mod:`meshplan.interop.torchtitan_tables`, float8 by :mod:`meshplan.interop.torchtitan_float8`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.tomlout import mesh_spec, resolved, virtual_split
from meshplan.interop.torchtitan_mesh import DEGREES
from meshplan.interop.torchtitan_custom import Flavor, llama3_flavor, not_llama3, written_flavors
from meshplan.interop.torchtitan_ep import DEEPEP_FAMILIES, write_backend
from meshplan.interop.torchtitan_flavors import flavor_of, flavor_refusal
from meshplan.interop.torchtitan_float8 import write_float8
from meshplan.interop.torchtitan_hf import hf_flavor, hf_note, hf_refusal
from meshplan.interop.torchtitan_tables import (
    SCHEDULES,
    WRITTEN_SCHEDULES,
    model_parts,
    write_optimizer,
    write_recompute,
)
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes import TORCHTITAN_AXES
from meshplan.spec.axes.moe_tp import TORCH_ETP_EP1, torch_etp
from meshplan.spec.hf import hf_source


#: The header line of every torchtitan export (``target:``, before its notes): the torchtitan the job TOML
#: is for, and how to carry its degrees to a newer one. 9810191 (2026-02-23) replaced the TOML job config
#: with Python config functions picked by ``--module``/``--config``; b5bcd76's ``ParallelismConfig``
#: (``torchtitan/config/configs.py``:121-293) keeps the ``*_degree`` fields' names, bar
#: ``expert_tensor_parallel_degree``, while other keys moved (``pipeline_parallel_microbatch_size`` became
#: ``num_pp_microbatches``, :232).
TARGET_NOTE = ("target: torchtitan <= v0.2.2 (TOML job config, commit e347b1e); torchtitan from 9810191 "
               "(2026-02-23) reads no job TOML: there set the [parallelism] *_degree values below as the same-named "
               "fields of ParallelismConfig in its Python config (--module/--config), the other keys by hand")


def reshard_policy(t, pp: int) -> str:
    """torchtitan's ``parallelism.fsdp_reshard_after_forward`` for ``t`` (a
    :class:`~meshplan.spec.training.TrainingSpec`) at pipeline degree ``pp``. torchtitan
    (``torchtitan/distributed/fsdp.py`` at b5bcd76, ``get_fsdp_reshard_after_forward_policy``,
    ``apply_fsdp_to_decoder``; the same in v0.2.2's ``apply_fsdp``, ``llama3/infra/parallelize.py``:319-355 at
    e347b1e) reshards the blocks and the embedding's unit under ``"always"``,
    under ``"default"`` when pp is off, never under ``"never"``, and the ``[norm, output]`` unit
    (tied: the unit of the three) under ``"always"`` only. So: the head resharded ->
    ``"always"``; the blocks resharded as pp says -> ``"default"``; kept -> ``"never"``; the
    blocks resharded under pp with the head kept has no policy: ``"always"`` (it reshards the
    head too; the export's round trip says so). ``reshard_after_forward`` unset is first resolved at
    ``pp`` (:meth:`~meshplan.spec.training.TrainingSpec.at_pp`: false under pp, torchtitan's own
    default), so it writes ``"default"``; a value given that equals torchtitan's default too.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16)
    >>> on, off = (t.model_copy(update={"reshard_after_forward": v}) for v in (True, False))
    >>> [reshard_policy(t, 1), reshard_policy(t, 2), reshard_policy(on, 2), reshard_policy(off, 2),
    ...  reshard_policy(off, 1), reshard_policy(t.model_copy(update={"reshard_head_after_forward": True}), 1)]
    ['default', 'default', 'always', 'default', 'never', 'always']
    """
    t = t.at_pp(pp)
    if t.reshard_head_after_forward:
        return "always"
    if t.reshard_after_forward == (pp == 1):
        return "default"
    return "always" if t.reshard_after_forward else "never"


def write(cfg: Config) -> dict[str, dict]:
    """torchtitan job tables of ``cfg`` (the inverse of :func:`~meshplan.interop.torchtitan.read`). ConfigError naming
    what torchtitan cannot run: a model without a torchtitan flavor, sharding zero1/zero2,
    a mesh order other than torchtitan's, tp without sequence parallel, user-named axes, an etp
    v0.2.2 does not run (:func:`_etp_written`). The file is a job TOML of torchtitan <= v0.2.2
    (``JobConfig`` at e347b1e: :data:`TARGET_NOTE`); ``expert_tensor_parallel_degree``, a key of that
    ``JobConfig`` (``job_config.py``:464) that b5bcd76 no longer has, is written only where it is not
    its default 1: etp = tp with ep > 1, which v0.2.2 runs and b5bcd76 does not (:func:`etp_note`)."""
    mesh = resolved(cfg)
    t = cfg.training
    model = model_table(cfg)
    deg = _write_degrees(cfg, mesh)
    pp, dpn = deg.get("pp", 1), deg.get("dp_replicate", 1) * deg.get("dp_shard", 1)
    etp_on = deg["ep"] > 1 and deg["etp"] > 1  # the key's default is 1, and it acts with ep > 1 only
    par: dict[str, Any] = {k: deg.get(a, 1) for k, a in DEGREES.items() if a != "etp" or etp_on}
    par |= {"fsdp_reshard_after_forward": reshard_policy(t, pp),
            "disable_loss_parallel": not mesh_spec(cfg).loss_parallel,
            "enable_async_tensor_parallel": t.tp_comm_overlap} | write_backend(t.moe_dispatcher) | (
        {} if t.pp_ep_overlap else {"pipeline_parallel_expert_parallel_overlap": False}) | (
        {"context_parallel_rotate_method": "alltoall"} if t.cp_rotate == "alltoall" else {})
    if pp > 1:
        par |= {"pipeline_parallel_schedule": WRITTEN_SCHEDULES.get(str(mesh_spec(cfg).pp_schedule), "")
                or _no_schedule(cfg), "pipeline_parallel_microbatch_size": t.micro_batch,
                "module_fqns_per_model_part": model_parts(virtual_split(cfg, mesh) or [])}
    # pp: one schedule.step() per accumulation step, local_batch_size / microbatch_size micro-batches each
    training = {"local_batch_size": t.global_batch // (dpn * t.pp_schedule_runs) if pp > 1 else t.micro_batch,
                "global_batch_size": t.global_batch, "seq_len": t.seq_len,
                # bf16 storage without an fp32 copy is torchtitan's dtype bfloat16; any fp32 copy is
                # its mixed precision (fp32 FSDP2 shards, bf16 compute)
                "dtype": "bfloat16" if t.param_dtype == "bf16" and not t.keeps_master else "float32",
                "mixed_precision_param": "float32" if t.compute_dtype == "fp32" else "bfloat16",
                "mixed_precision_reduce": "float32"} | ({"max_norm": t.grad_clip_norm} if t.grad_clip_norm else {})
    converters, quantize = write_float8(t)
    if converters:
        model["converters"] = converters
    return {"job": {"description": f"meshplan export: {cfg.model.name} on {cfg.cluster.nodes}x "
                                   f"{cfg.cluster.node.name}"},
            "model": model, "training": training, "parallelism": par,
            "activation_checkpoint": write_recompute(t), "optimizer": write_optimizer(t)} | quantize \
        | ({"compile": {"enable": True, "components": ["model", "loss"] if t.torch_compile_loss else ["model"]}}
           if t.torch_compile else {}) \
        | ({"checkpoint": {"enable": True, "interval": cfg.checkpoint_interval_steps}}
           if cfg.checkpoint_interval_steps else {})



#: HF ``model_type`` -> torchtitan's model of that architecture and its flavors at e347b1e (v0.2.2, whose job
#: TOML is written; the registries ``torchtitan/models/<name>/__init__.py``, each flavor one size; debug flavors
#: left out): b5bcd76's but llama3 1B and 3B, which b5bcd76 added;
#: another dense HF model runs under the experiment ``transformers_modeling_backend`` (flavor "full",
#: ``[hf_transformers] model`` = the Hugging Face id); an MoE one there only at Qwen3-30B-A3B's sizes
#: (:data:`~meshplan.interop.torchtitan_hf.NO_MODEL`).
TORCHTITAN_MODELS = {"llama": ("llama3", "8B, 70B, 405B"),
                     "deepseek_v2": ("deepseek_v3", "16B, 236B, 671B"),
                     "deepseek_v3": ("deepseek_v3", "16B, 236B, 671B"),
                     "qwen3": ("qwen3", "0.6B, 1.7B, 4B, 8B, 14B, 32B"),
                     "qwen3_moe": ("qwen3", "30B-A3B, 235B-A22B"), "gpt_oss": ("gpt_oss", "20b, 120b")}


def model_table(cfg: Config) -> dict[str, Any]:
    """torchtitan's [model] of ``cfg``: the keys of the torchtitan job TOML that read the model
    through ``model.hf_assets_path`` (:attr:`~meshplan.config.Config.source_model`: name, flavor and
    that folder, as the user wrote them), else the flavor torchtitan ships whose model is the plan's
    (:func:`~meshplan.interop.torchtitan_flavors.flavor_of`: llama3, deepseek_v3, qwen3 30B-A3B, 235B-A22B), else
    for a model read from a Hugging Face config.json the flavor of its model_type and sizes
    (:func:`~meshplan.interop.torchtitan_hf.hf_flavor`), else for a dense Llama-style model a llama3
    flavor of its own, which the ``.py`` beside the file registers (:func:`custom_flavor`), else a
    ConfigError naming ``--to`` and what to set (:func:`no_flavor`)."""
    if cfg.source_model:  # the user's own keys first
        return dict(cfg.source_model)
    flavor = model_flavor(cfg.model)
    if flavor is not None:
        return {"name": flavor[0], "flavor": flavor[1]}
    custom = custom_flavor(cfg)
    if custom is not None:
        return {"name": "llama3", "flavor": custom.name}
    raise ConfigError("--to", no_flavor(cfg.model))


def custom_flavor(cfg: Config) -> Optional[Flavor]:
    """The llama3 flavor an export of ``cfg`` registers beside the job TOML
    (:func:`~meshplan.interop.torchtitan_custom.llama3_flavor`): None where the file names the model
    otherwise (the user's own keys, a flavor torchtitan ships: :func:`model_table`) or where llama3's
    args cannot state it (:func:`~meshplan.interop.torchtitan_custom.not_llama3`)."""
    if cfg.source_model or model_flavor(cfg.model) is not None:
        return None
    return llama3_flavor(cfg.model)


def model_flavor(model) -> tuple[str, str] | None:
    """torchtitan's (name, flavor) of ``model``: the flavor whose model it is
    (:func:`~meshplan.interop.torchtitan_flavors.flavor_of`), else for a model read from a Hugging
    Face config.json the flavor of its model_type and sizes (:func:`_hf_key`); None when neither."""
    return flavor_of(model) or _hf_key(model)


def _hf_key(model) -> tuple[str, str] | None:
    """torchtitan's (name, flavor) of ``model`` told by its config.json's model_type and sizes, None
    for a model of no config.json or of no flavor."""
    hf = hf_source(model.source)
    return hf_flavor(hf[0], model) if hf else None


def flavors_back(cfg: Config) -> dict[tuple[str, str], dict[str, Any]]:
    """The llama3 flavor an export of ``cfg`` registers (:func:`custom_flavor`), as its round trip
    reads it back from the written snippet (:func:`~meshplan.interop.torchtitan_custom.written_flavors`)."""
    return written_flavors(custom_flavor(cfg))


def no_flavor(model) -> str:
    """Why a torchtitan file cannot name ``model`` and what to set: the flavors meshplan maps with the
    nearest and its differing fields (:func:`~meshplan.interop.torchtitan_flavors.flavor_refusal`), or for a model
    of a Hugging Face config the torchtitan model of its architecture (:data:`TORCHTITAN_MODELS`) with
    its flavors, its folder as ``model.hf_assets_path``, in the job TOML an export then writes it back from;
    a dense GQA model no flavor is and no llama3 flavor can state (the only refusal of a model_type llama,
    whose flavors would name another model) with why not (:func:`~meshplan.interop.torchtitan_custom.not_llama3`).

    >>> from meshplan.spec.model import ModelSpec
    >>> m = ModelSpec(name="q", layers=2, hidden=64, ffn=64, q_heads=4, vocab=8,
    ...               source="Hugging Face config.json (model_type qwen3) from /m/q/config.json")
    >>> print(no_flavor(m))
    torchtitan knows a model by [model] name and flavor; model 'q' (Hugging Face config /m/q/config.json, model_type qwen3) has none meshplan can tell: set model.name = "qwen3" with its flavor (0.6B, 1.7B, 4B, 8B, 14B, 32B) and model.hf_assets_path = "/m/q" in a torchtitan job TOML and export from that file

    A model_type whose flavors meshplan tells by size, or that torchtitan has no model of, is
    refused with why (:func:`~meshplan.interop.torchtitan_hf.hf_refusal`).
    """
    hf = hf_source(model.source)
    if hf is None or hf[0] == "llama":  # a dense GQA model refused a llama3 flavor of its own too: why (not_llama3)
        why = None if model.is_moe or model.is_mla else not_llama3(model)
        return flavor_refusal(model) + (f"; nor can llama3's TransformerModelArgs state it: {why}" if why else "")
    model_type, path = hf
    why = hf_refusal(model_type, model)
    if why is not None:
        return (f"model {model.name!r} (Hugging Face config {path}, model_type {model_type}) has no torchtitan "
                f"[model] name and flavor: {why}")
    folder = str(Path(path).parent)
    arch, flavors = TORCHTITAN_MODELS.get(model_type, ("transformers_modeling_backend", ""))
    which = f"with its flavor ({flavors})" if flavors else \
        "with flavor \"full\" and [hf_transformers] model = its Hugging Face id (torchtitan's HF backend, dense models)"
    return (f"torchtitan knows a model by [model] name and flavor; model {model.name!r} (Hugging Face config {path}, "
            f"model_type {model_type}) has none meshplan can tell: set model.name = \"{arch}\" {which} and "
            f"model.hf_assets_path = \"{folder}\" in a torchtitan job TOML and export from that file")


def write_notes(cfg: Config, recompute_noted: bool = False) -> list[str]:
    """Header notes of a torchtitan export: a recompute policy torchtitan has no option for,
    written as the nearest one (:func:`~meshplan.interop.torchtitan_tables.write_recompute`),
    unless ``recompute_noted`` (the user's own [activation_checkpoint] kept, with its note:
    :func:`meshplan.interop.torchtitan_carry.kept_recompute`); torchtitan's pre-2025 norm, which
    today's torchtitan has no key for; the model.name and flavor told from a Hugging Face config.json's
    sizes (:func:`~meshplan.interop.torchtitan_hf.hf_note`); a llama3 flavor of the model's own, registered
    by the ``.py`` beside the file (:func:`custom_flavor`)."""
    t = cfg.training
    key = None if cfg.source_model or flavor_of(cfg.model) else _hf_key(cfg.model)
    src = hf_source(cfg.model.source)
    out = [f"note: {hf_note(src[0], cfg.model, key)}"] if key and src else []
    custom = custom_flavor(cfg)
    out += [f"note: model.flavor {custom.name!r} is no flavor torchtitan ships: the .py file of this file's name "
            f"registers it in llama3_args (torchtitan/models/llama3/__init__.py at e347b1e) with this model's sizes; "
            f"keep it beside this file (meshplan reads it back from there)"] if custom else []
    out += [f"note: training.torch_norm \"decomposed\" is torchtitan's pre-2025 RMSNorm (model.norm_type = "
           f"\"rmsnorm\", a key torchtitan removed); the torchtitan written here runs nn.RMSNorm"] \
        if t.torch_norm == "decomposed" else []
    out += [f"note: training.op_sac_policy \"b5bcd76\" plans torchtitan b5bcd76's op-level SAC (one wqkv mm, saved "
            f"whole); the torchtitan <= v0.2.2 this file is for saves wq and wv and recomputes wk (238fa99's policy, "
            f"meshplan's default)"] if t.recompute == "op" and t.op_sac_policy == "b5bcd76" and not cfg.model.is_mla else []
    family = model_table(cfg).get("name", "llama3") if t.moe_dispatcher == "deepep" and cfg.model.is_moe else None
    out += [f"note: expert_parallel_comm_backend = \"deepep\" is written, but torchtitan's {family} parallelize ignores "
            f"it (only {' and '.join(DEEPEP_FAMILIES)} read it, e347b1e): this file runs the standard all-to-all, "
            f"which meshplan plans with training.moe_dispatcher = \"alltoall\""] \
        if family is not None and family not in DEEPEP_FAMILIES else []
    if t.recompute != "selective" or recompute_noted:
        return out
    written = write_recompute(t)["mode"]
    return out + [
        f"note: the plan modelled Megatron-LM's selective recompute (attention core only), which torchtitan "
        f"has no option for ({_op_words(cfg)}); "
        f"written as mode = \"{written}\", " + ("the same activations kept but the flash softmax statistics, "
        "attention not replayed" if written == "none" else "without flash attention the nearest that keeps "
        "no more than the plan")]


#: The torchtitan keys of a run's data and schedule, which a meshplan config does not hold, with what
#: torchtitan runs where the job TOML has none (``JobConfig`` of ``torchtitan/config/job_config.py`` at
#: e347b1e: ``Model.hf_assets_path``, ``Training.dataset``, ``Training.steps``, ``Optimizer.lr``): an export
#: without the user's torchtitan file to carry them from lists the absent ones (:func:`unset_notes`).
RUN_DEFAULTS = {"model.hf_assets_path": '"./tests/assets/tokenizer", its test tokenizer',
                "training.dataset": '"c4_test", its test slice of C4',
                "training.steps": "10000", "optimizer.lr": "8e-4"}


def unset_notes(tables: dict) -> list[str]:
    """The header note listing each key of :data:`RUN_DEFAULTS` the torchtitan job ``tables`` do not
    write (none carried from the user's file: :func:`meshplan.interop.torchtitan_carry.carried`), with the
    value torchtitan then runs silently; none when every one is written.

    >>> print(unset_notes({"model": {"hf_assets_path": "/m"}, "training": {"steps": 5, "dataset": "c4"}})[0])
    note: not written, set before running (torchtitan's default otherwise): optimizer.lr (8e-4)
    >>> unset_notes({"model": {"hf_assets_path": "/m"}, "training": {"steps": 5, "dataset": "c4"},
    ...              "optimizer": {"lr": 3e-4}})
    []
    """
    unset = [k for k in RUN_DEFAULTS if k.partition(".")[2] not in tables.get(k.partition(".")[0], {})]
    return [f"note: not written, set before running (torchtitan's default otherwise): "
            + ", ".join(f"{k} ({RUN_DEFAULTS[k]})" for k in unset)] if unset else []


def _op_words(cfg: Config) -> str:
    """Why the plan is not torchtitan's op-level SAC, as :func:`write_notes` says it: where
    :func:`meshplan.plan_checks` refuses ``recompute = "op"`` (cp > 1) that rule;
    elsewhere that the config chose ``selective`` and ``op`` plans at this mesh."""
    m = cfg.mesh
    deg = dict(zip(m.names, m.shape)) if m is not None and m.names and m.shape else {}
    if deg.get("cp", 1) > 1:
        return f"op-level SAC \"op\" is planned with cp = 1 only, and this mesh has cp {deg['cp']}"
    return ("training.recompute is \"selective\"; torchtitan's op-level SAC plans at this mesh: set "
            "training.recompute = \"op\" to plan what torchtitan runs")


def _write_degrees(cfg: Config, mesh: Mesh) -> dict[str, int]:
    """torchtitan's degree of each of its axes for ``cfg``'s mesh (a ``dp`` axis is
    dp_replicate under DDP, dp_shard otherwise); ConfigError when torchtitan would build
    another mesh or sharding."""
    t = cfg.training
    axes = list(mesh.layout.names)
    foreign = [a for a in axes if a not in TORCHTITAN_AXES and a != "dp"]
    if foreign:
        raise ConfigError("--to", f"torchtitan has no mesh axis {foreign[0]!r} (its axes: pp, dp_replicate, "
                          f"dp_shard, cp, tp, ep, etp)")
    if t.sharding in ("zero1", "zero2"):
        raise ConfigError("--to", f"torchtitan shards with FSDP2 (zero3, hsdp) or replicates (none); sharding "
                          f"{t.sharding} has no torchtitan key")
    dp = "dp_replicate" if t.sharding == "none" else "dp_shard"
    axes = [dp if a == "dp" else a for a in axes]
    canon = [a for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if a in axes]
    if axes != canon:
        raise ConfigError("--to", f"mesh order {axes} is not torchtitan's (pp, dp_replicate, dp_shard, cp, tp "
                          f"outermost first); reorder the mesh to export it")
    deg = {a: mesh.layout.degree(b) for a, b in zip(axes, mesh.layout.names)}
    deg["ep"], deg["etp"] = mesh.ep, _etp_written(cfg, mesh, deg)
    shard = deg.get("dp_shard", 1) * deg.get("cp", 1)  # torchtitan's fsdp axis: FSDP2 where it is > 1
    both = deg.get("dp_replicate", 1) > 1 and shard > 1
    if t.sharding == "hsdp" and deg.get("dp_replicate", 1) > 1 and shard == 1:
        alone = len([a for a in axes if deg.get(a, 1) > 1]) == 1
        raise ConfigError("--to", "sharding hsdp with dp_shard x cp 1 shards nothing (ddp over dp_replicate); "
                          "torchtitan applies FSDP2 only where dp_shard x cp > 1, and otherwise DDP, " + (
                              "meshplan's sharding none: set training.sharding = \"none\" to export it" if alone else
                              "which it refuses beside pp or tp (\"DDP has not supported > 1D parallelism\"): move "
                              "dp_replicate's degree to dp_shard (zero3) to export it"))
    if (shard > 1 and t.sharding == "none") or both != (t.sharding == "hsdp"):
        raise ConfigError("--to", f"sharding {t.sharding} over {axes} is not what torchtitan applies (FSDP2 on "
                          f"dp_shard x cp, HSDP with dp_replicate too, DDP on dp_replicate alone)")
    if t.sharding == "none" and deg.get("dp_replicate", 1) > 1 and deg.get("pp", 1) * deg.get("tp", 1) > 1:
        raise ConfigError("--to", "DDP (sharding none) beside pp or tp: torchtitan raises \"DDP has not supported > "
                          "1D parallelism\"; shard (zero3 or hsdp) to export it")
    if deg.get("tp", 1) > 1 and not mesh_spec(cfg).sequence_parallel:
        raise ConfigError("--to", "torchtitan runs tp with sequence parallel (v0.2.2, whose job TOML this is, has no key "
                          "to turn it off: llama3/infra/parallelize.py:181-233 at e347b1e); set "
                          "mesh.sequence_parallel = true")
    return deg


def _etp_written(cfg: Config, mesh: Mesh, deg: dict[str, int]) -> int:
    """The etp of ``mesh`` as torchtitan v0.2.2 runs it (``ParallelDims`` at e347b1e,
    ``torchtitan/distributed/parallel_dims.py``): with ep > 1, etp 1 (experts whole on each ep rank, the
    tp ranks splitting the tokens) or etp = tp (``ExpertTensorParallel`` over ep x etp), as its
    ``_validate`` asserts (:58-59, "Currently we only support ETP=TP or ETP=1"); its ``efsdp = dp_shard x
    cp x tp / (etp x ep)`` (:138) is the resolved mesh's own rule (``(dp_shard * cp * tp) % (ep * etp)``,
    checked before); at ep 1 an MoE
    model's experts over tp whatever the key (``apply_moe_ep_tp``, ``llama4/infra/parallelize.py``:
    559-563, as at b5bcd76: :data:`~meshplan.spec.axes.moe_tp.TORCH_ETP_EP1`). ConfigError naming ``--to``
    for another etp. b5bcd76 runs etp 1 with ep > 1 only (:data:`~meshplan.spec.axes.moe_tp.TORCH_ETP`):
    :func:`etp_note` says so where the file has etp = tp."""
    ep, etp, tp = mesh.ep, mesh.etp, deg.get("tp", 1)
    if ep > 1 and etp not in (1, tp):
        raise ConfigError("--to", f"etp {etp} with tp {tp} and ep {ep}: torchtitan v0.2.2 runs etp 1 or tp with ep > 1 "
                          "(ParallelDims, parallel_dims.py:58-59 at e347b1e); set etp 1 in [mesh] to export it")
    if cfg.model.is_moe and ep == 1 and etp != torch_etp(1, tp):
        raise ConfigError("--to", f"etp {etp} with tp {tp} at ep 1: {TORCH_ETP_EP1}; set etp {tp} in [mesh] "
                          "to export it")
    return etp


def etp_note(par: dict) -> list[str]:
    """The header note of a torchtitan job TOML that writes ``expert_tensor_parallel_degree``
    (``par``: its [parallelism]; :func:`_etp_written`): the one place where the v0.2.2 the file is
    for runs what torchtitan after c4b409a does not, and what meshplan plans of it.

    >>> etp_note({"expert_parallel_degree": 4})
    []
    >>> print(etp_note({"expert_parallel_degree": 4, "tensor_parallel_degree": 4, "expert_tensor_parallel_degree": 4})[0])
    note: expert_tensor_parallel_degree = 4 (= tp, ep 4): torchtitan v0.2.2 shards each routed expert over etp too (ExpertTensorParallel: parallel_dims.py:58-59, llama4/infra/parallelize.py:578-580 at e347b1e), where b5bcd76 has no ETP (c4b409a removed it); `plan` of this file plans v0.2.2's (its import names that torchtitan: training.op_sac_policy = "238fa99"): set etp 1 for a file a torchtitan after c4b409a runs too
    """
    etp = par.get("expert_tensor_parallel_degree", 1)
    if etp == 1:
        return []
    return [f"note: expert_tensor_parallel_degree = {etp} (= tp, ep {par['expert_parallel_degree']}): torchtitan "
            "v0.2.2 shards each routed expert over etp too (ExpertTensorParallel: parallel_dims.py:58-59, "
            "llama4/infra/parallelize.py:578-580 at e347b1e), "
            "where b5bcd76 has no ETP (c4b409a removed it); `plan` of this file plans v0.2.2's (its import names that "
            "torchtitan: training.op_sac_policy = \"238fa99\"): set etp 1 for a file a torchtitan after c4b409a "
            "runs too"]


def _no_schedule(cfg: Config) -> str:
    raise ConfigError("--to", f"schedule {mesh_spec(cfg).pp_schedule} is not one torchtitan's TOML names here; use "
                      f"{', '.join(SCHEDULES.values())}")
