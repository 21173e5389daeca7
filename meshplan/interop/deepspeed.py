"""DeepSpeed JSON config <-> meshplan tables (ZeRO data parallelism, no TP/PP).

Key names from DeepSpeed's configuration reference (deepspeed.ai/docs/config-json:
``train_batch_size``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``zero_optimization.stage``, ``bf16.enabled`` (or its old name ``bfloat16.enabled``),
``fp16.enabled``, ``gradient_clipping``). The batch rule is
DeepSpeed's: ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps
* dp`` (any two give the third). ``"auto"`` values (the HF Trainer's) are read as the Trainer fills
them (:mod:`meshplan.interop.deepspeed_auto`: the bucket sizes from the model's hidden size, the
batch from ``--micro-batch`` / ``--grad-accum``), and written back on export.
A DeepSpeed config names neither the model nor the sequence length nor the cluster: they
come from ``--model``, ``--seq-len``, ``--cluster``/``--nodes``.

ZeRO stage 0, 1, 2, 3 -> sharding none, zero1, zero2, zero3 over one data axis ``dp`` (every
rank); bf16/fp16 keep fp32 master weights (DeepSpeed's mixed precision), so the parameters
are stored in bf16/fp16 with an fp32 copy (meshplan's ``master_weights``). bf16 at stage 0 (or at
stage 1 with ``data_types.grad_accum_dtype`` fp32) runs DeepSpeed's ``BF16_Optimizer``, which
partitions the master weights and Adam states as ZeRO-1 does: sharding zero1 with fp32 gradients
(:func:`~meshplan.interop.deepspeed_zero.bf16_optimizer_training`, a note says so).
``gradient_clipping`` > 0 clips the gradient norm (meshplan's ``training.grad_clip``), 0
does not; absent, DeepSpeed's default applies: 1.0 since v0.19.3 (PR #8068, June 2026), 0
before (a note says so). The value given is ``training.grad_clip_norm``; export writes it
(1.0 unset) or 0.0, so either version reads it the same. An ``activation_checkpointing``
section configures ``deepspeed.checkpointing``, which model code calls on whole blocks: recompute ``full`` (a note); without one, ``none``
(DeepSpeed checkpoints nothing unless the model code calls ``deepspeed.checkpointing``; a note
says so); export writes an empty section for ``full``. ``bf16`` and ``fp16`` both enabled is
refused, as DeepSpeed refuses it (:func:`model_dtype`).

A DeepSpeed config runs ZeRO over one data axis: its ``[search]`` table (written on import)
keeps ``meshplan search`` to those meshes (:data:`SEARCH`: pp, dp_replicate, cp, tp, ep, etp
1; no HSDP; sharding zero1, zero2 and zero3 from a config of any stage, each row under the
engine DeepSpeed runs at that stage: :func:`search_table`), the rows ``export --to
deepspeed`` can write; a note says so, and widening ``[search]`` in an imported TOML searches
beyond it.

The ZeRO knobs of stages 1, 2 and 3 (buckets, streams, gradient dtypes, ZeRO-3's prefetch) and
ZeRO++ hpZ are read by :mod:`meshplan.interop.deepspeed_zero`, ZeRO-Offload by
:mod:`meshplan.interop.deepspeed_offload`; the writer (``export
--to deepspeed``) is :mod:`meshplan.interop.deepspeed_write`, and what it carries of the user's
own file :mod:`meshplan.interop.deepspeed_carry`.

A misspelt DeepSpeed key or field (a near miss of one the reader reads, or of a field of the
tables DeepSpeed validates strictly) is an error naming it: :mod:`meshplan.interop.deepspeed_keys`,
which also holds the keys read at every stage (:data:`~meshplan.interop.deepspeed_keys.USED`); any
other key, DeepSpeed's or not, is listed as unused. The batch rule and its ``fix:``:
:mod:`meshplan.interop.deepspeed_batch`.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError
from meshplan.interop.common import Imported, ImportOptions, cluster_table, flatten, model_option
from meshplan.interop.deepspeed_auto import (
    CHECKPOINTING,
    fill_batch,
    fill_dtype,
    fill_hidden,
    hf_recompute,
    hidden_auto,
    hidden_of,
    model_code,
    runs_hf_trainer,
)
from meshplan.interop.deepspeed_batch import batch
from meshplan.interop.deepspeed_keys import USED, misspelt_field, misspelt_key
from meshplan.interop.deepspeed_offload import offload_training, refuse_offload
from meshplan.interop.deepspeed_zero import (
    ZERO3_USED,
    ZERO12_USED,
    bf16_optimizer_training,
    bucket_elements,
    prefetch_memory,
    runs_bf16_optimizer,
    sub_group_note,
    zero3_training,
    zero12_training,
    zero_section,
    zero_stage,
)
from meshplan.spec.mesh_words import data_axis


STAGES = {0: "none", 1: "zero1", 2: "zero2", 3: "zero3"}


#: What a DeepSpeed config (this reader and writer) expresses: one home for ``export --help``, its refusal
#: and ``search``'s rows refused (DeepSpeed's own TP/PP/Ulysses/MoE groups are not read or written).
DS_SCOPE = "ZeRO over one data axis, without TP/PP/CP/EP or HSDP"


def read(d: dict, opts: ImportOptions) -> Imported:
    """meshplan tables of a parsed DeepSpeed config (module docstring)."""
    model = _check_config(d, opts)
    hf_auto = runs_hf_trainer(d, None)  # before any "auto" is filled: the HF Trainer's model code
    hf = hf_auto or bool(opts.gradient_checkpointing)  # its recompute: --gradient-checkpointing
    d, auto_line = fill_hidden(d, hidden_of(model)) if hidden_auto(d) else (d, None)  # the HF Trainer's "auto"
    d = fill_dtype(fill_batch(d, opts.micro_batch, opts.grad_accum), opts.dtype)
    cluster, world = cluster_table(opts, "DeepSpeed")
    stage = zero_stage(d)
    global_batch, micro = batch(d, world)
    dtype = model_dtype(d)
    recompute, notes = hf_recompute(d, opts.gradient_checkpointing) if hf else _recompute(d)
    code, code_line = model_code(hf_auto)
    notes += [code_line] + ([auto_line] if auto_line else [])
    training: dict[str, Any] = {"global_batch": global_batch, "seq_len": opts.seq_len, "micro_batch": micro,
                                "sharding": STAGES[stage], "param_dtype": dtype, "compute_dtype": dtype,
                                **_clip(d, notes), "recompute": recompute, **code}
    bf16_opt = runs_bf16_optimizer(d, stage, dtype)
    training |= _engine_training(d, stage, dtype, bf16_opt, notes)
    tables = {"model": model_option(model), "cluster": cluster, "training": training,
              "mesh": {"names": [data_axis(training["sharding"])], "shape": [world]}}  # dp_shard where ZeRO-3 shards
    used = USED | (ZERO12_USED if stage in (1, 2) and not bf16_opt else set()) | (
        {"communication_data_type", "data_types.grad_accum_dtype"} if bf16_opt else set()) | (
        {"data_types.grad_accum_dtype"} if stage in (1, 3) else set()) | (
        ZERO3_USED if stage == 3 else set())  # stage 2 keeps model-dtype grads anyway
    memory = _memory_table(d, stage, bf16_opt)
    tables |= {"memory": memory} if memory else {}
    tables["search"] = search_table(stage)
    notes.append("meshplan search keeps to what a DeepSpeed config runs, ZeRO over one data axis ([search] "
                 + ", ".join(f"{k} = {v!r}" for k, v in tables["search"].items()).replace("'", '"')
                 + "); import it to a TOML and widen [search] to search other meshes")
    unused = tuple(k for k in flatten(d) if k not in used)
    return Imported("deepspeed", tables, unused, tuple(notes))


def _check_config(d: dict, opts: ImportOptions) -> str:
    """The model option (a catalog name or a config.json path); refuse what cannot be planned before reading ``d``: no ``--model`` or ``--seq-len`` (a DeepSpeed
    config holds neither), a misspelt DeepSpeed key or field (a near miss of one meshplan reads),
    an offloaded ZeRO state (:func:`~meshplan.interop.deepspeed_offload.refuse_offload`)."""
    if not opts.model:
        raise ConfigError("--model", "a DeepSpeed config does not name the model; give --model CATALOG_NAME or a "
                          "config.json path")
    if not opts.seq_len:
        raise ConfigError("--seq-len", "a DeepSpeed config does not hold the sequence length; give --seq-len N")
    typo = misspelt_key(d)
    if typo is not None:
        raise typo
    field_typo = misspelt_field(d)
    if field_typo is not None:
        raise field_typo
    refuse_offload(zero_section(d))
    return opts.model


def _engine_training(d: dict, stage: int, dtype: str, bf16_opt: bool, notes: list[str]) -> dict[str, Any]:
    """The ``[training]`` keys of DeepSpeed's engine at ZeRO ``stage``: its BF16_Optimizer
    (``bf16_opt``: ZeRO-1's sharding, fp32 gradients; a note), the engine without ZeRO (stage 0:
    its search's rows run DeepSpeed's ZeRO, :func:`search_table`), ZeRO-1/2's keys, or ZeRO-3's
    as DeepSpeed >= v0.5.5 runs it (a note naming the 2021 engine's setting)."""
    training: dict[str, Any] = {}
    if bf16_opt:  # BF16_Optimizer: ZeRO-1's sharding, fp32 gradients (deepspeed_zero)
        training |= bf16_optimizer_training(d, dtype)
        notes.append("bf16 at ZeRO stage 0 (or stage 1 with grad_accum_dtype fp32) runs DeepSpeed's BF16_Optimizer: "
                     "fp32 master weights and Adam states partitioned over dp as ZeRO-1, fp32 gradients of every "
                     "parameter beside the bf16 ones (planned as sharding \"zero1\", zero12_engine \"deepspeed\", "
                     "grad_dtype \"fp32\")")
    elif stage == 0:  # DeepSpeed's engine without ZeRO: its search's rows run DeepSpeed's ZeRO (search_table)
        training["zero0_engine"] = "deepspeed"
    elif stage in (1, 2):
        training |= zero12_training(d, dtype)
    training |= offload_training(zero_section(d), stage, notes)  # ZeRO-Offload (memory.offload)
    if stage == 3:
        training |= zero3_training(d, dtype) | {"zero3_engine": "deepspeed"}
        notes.append("ZeRO stage 3 planned as DeepSpeed >= v0.5.5 runs it (training.zero3_engine = \"deepspeed\": "
                     "per-layer coalesced gathers, PR #1188); for DeepSpeed v0.3.13-v0.5.4 (2021) set zero3_engine = "
                     "\"deepspeed-2021\" (one all-gather per parameter tensor; its gradient path follows "
                     "zero_optimization.contiguous_gradients, read into training.contiguous_gradients: absent, false, "
                     "v0.3.13's default, bucket all-reduces; true, the default from v0.4.3, a reduce-scatter per "
                     "gradient)")
        notes.append(sub_group_note(d["zero_optimization"]))
    return training


def _memory_table(d: dict, stage: int, bf16_opt: bool) -> dict[str, Any]:
    """The ``[memory]`` keys of ``d``: the gradient bucket's elements under ZeRO-1/2 (not the
    BF16_Optimizer's) and under ZeRO-3 where ``reduce_bucket_size`` is set, and ZeRO-3's parameter
    coordinator's prefetch and live-parameter limits (memory.unit_events); {} where none."""
    memory: dict[str, Any] = {}
    if (stage in (1, 2) and not bf16_opt) or (stage == 3 and d["zero_optimization"].get("reduce_bucket_size", "auto") != "auto"):
        memory = {"grad_bucket_elements": bucket_elements(d["zero_optimization"])}
    if stage == 3 and prefetch_memory(d["zero_optimization"]):  # DeepSpeed's parameter coordinator (memory.unit_events)
        memory = memory | prefetch_memory(d["zero_optimization"])
    return memory


#: The ``[search]`` table of a DeepSpeed config: the meshes :func:`write` exports (one data
#: axis, dp_shard; the search's shardings without HSDP: :func:`search_table` per stage).
SEARCH: dict[str, list[Any]] = {"pp": [1], "dp_replicate": [1], "cp": [1], "tp": [1], "ep": [1], "etp": [1],
                                 "sharding": ["zero1", "zero2", "zero3"]}


def search_table(stage: int) -> dict[str, list[Any]]:
    """The ``[search]`` table of a DeepSpeed config of ZeRO ``stage`` (:data:`SEARCH`). A DeepSpeed
    user changes ``zero_optimization.stage`` freely, and the same runtime runs each: stages 1, 2
    and 3 search ZeRO-1, ZeRO-2 and ZeRO-3 alike, each row under the engine DeepSpeed runs for it
    (zero1 and zero2 rows DeepSpeed's ZeRO-1/2, ``zero12_engine = "deepspeed"``; zero3 rows its
    ZeRO-3, ``zero3_engine = "deepspeed"``: :attr:`~meshplan.spec.training.TrainingSpec.searched_zero12_engine`
    and ``searched_zero3_engine``). Stage 0 (DeepSpeed's engine without ZeRO, ``zero0_engine =
    "deepspeed"``) searches the same three under the same engines; stage 0 itself is no search row
    (the search has no unsharded candidate: ``meshplan plan`` plans it), which the search says.

    >>> search_table(2)["sharding"], search_table(3)["sharding"], search_table(0)["sharding"]
    (['zero1', 'zero2', 'zero3'], ['zero1', 'zero2', 'zero3'], ['zero1', 'zero2', 'zero3'])
    """
    return {k: list(v) for k, v in SEARCH.items()}


def model_dtype(d: dict) -> str:
    """The model's dtype of DeepSpeed config ``d``: ``bf16`` (``bf16.enabled``, or its old name
    ``bfloat16``: DeepSpeed's ``BFLOAT16`` and ``BFLOAT16_OLD``), ``fp16`` (``fp16.enabled``),
    else ``fp32``. Both enabled is a ConfigError: DeepSpeed refuses it (``runtime/config.py:827-828``
    at edaa722, ``assert not (self.float16_config.enabled and self.bfloat16_config.enabled),
    'bfloat16 and fp16 modes cannot be simultaneously enabled'``).

    >>> model_dtype({"bfloat16": {"enabled": True}}), model_dtype({"fp16": {"enabled": True}}), model_dtype({})
    ('bf16', 'fp16', 'fp32')
    >>> model_dtype({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: bf16.enabled: and fp16.enabled are both true, which DeepSpeed refuses ('bfloat16 and fp16 modes cannot be simultaneously enabled', runtime/config.py); set one of them to false
    """
    key = "bf16" if "bf16" in d else "bfloat16"
    bf16: dict = d[key] if isinstance(d.get(key), dict) else {}
    fp16: dict = d["fp16"] if isinstance(d.get("fp16"), dict) else {}
    for name, table in ((key, bf16), ("fp16", fp16)):  # the HF Trainer's: its --bf16 / --fp16, not in the file
        if table.get("enabled") == "auto":
            raise ConfigError(f"{name}.enabled", f"\"auto\" is filled by the HF Trainer from its --{name[:2]}16 flag "
                              f"(unset: false); pass --dtype {name[:2]}16 (or fp32 for neither flag), or write true or false")
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ConfigError(f"{key}.enabled", "and fp16.enabled are both true, which DeepSpeed refuses ('bfloat16 and "
                          "fp16 modes cannot be simultaneously enabled', runtime/config.py); set one of them to false")
    return "bf16" if bf16.get("enabled") else "fp16" if fp16.get("enabled") else "fp32"


def _recompute(d: dict) -> tuple[str, list[str]]:
    """(``training.recompute``, the import's first notes) of DeepSpeed config ``d``. An
    ``activation_checkpointing`` section configures ``deepspeed.checkpointing.checkpoint``, which
    the model code calls on whole blocks: ``full``. Without one DeepSpeed checkpoints nothing
    unless the model code calls ``deepspeed.checkpointing`` itself, which the JSON cannot say:
    ``none`` (the engine never checkpoints activations on its own: at edaa722 ``runtime/engine.py``
    does not read the section; ``deepspeed.checkpointing.configure``,
    ``runtime/activation_checkpointing/checkpointing.py:1162``, which the model code calls, does),
    with a note saying what was assumed.

    >>> _recompute({"activation_checkpointing": {}})[0], _recompute({})[0]
    ('full', 'none')
    """
    if CHECKPOINTING in d:
        return "full", ["activation_checkpointing configures deepspeed.checkpointing.checkpoint, which the model code "
                        "calls on whole blocks (Megatron-DeepSpeed's --checkpoint-activations): planned with recompute "
                        "= \"full\"; set training.recompute if the model checkpoints otherwise"]
    return "none", ["no activation_checkpointing section: planned without activation checkpointing (recompute = "
                    "\"none\"), as DeepSpeed runs unless the model code calls deepspeed.checkpointing itself; set "
                    "training.recompute if it does"]


def _clip(d: dict, notes: list[str]) -> dict:
    """``training.grad_clip`` (whether DeepSpeed clips the gradient norm: module docstring) and
    ``grad_clip_norm`` (the number given, > 0); ConfigError for a value that is not a number >= 0.

    >>> _clip({"gradient_clipping": 0.3}, []), _clip({"gradient_clipping": 0}, []), _clip({"gradient_clipping": "auto"}, [])
    ({'grad_clip': True, 'grad_clip_norm': 0.3}, {'grad_clip': False}, {'grad_clip': True})
    """
    v = d.get("gradient_clipping")
    if v is None:
        notes.append("gradient_clipping not given: planned with clipping (DeepSpeed >= v0.19.3 clips at 1.0 by "
                     "default; before v0.19.3 it did not: write gradient_clipping 0.0 for that)")
        return {"grad_clip": True}
    if v == "auto":  # the HF Trainer fills it from max_grad_norm (1.0 by default)
        return {"grad_clip": True}
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
        raise ConfigError("gradient_clipping", f"must be a number >= 0 (0: no clipping) or \"auto\"; got {v!r}")
    return {"grad_clip": True, "grad_clip_norm": float(v)} if v > 0 else {"grad_clip": False}
