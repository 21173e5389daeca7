"""Megatron-DeepSpeed's own flags (microsoft/Megatron-DeepSpeed, ``megatron/arguments.py``), both ways.

``--deepspeed`` with ``--zero-stage N`` hands the data-parallel gradients and the optimizer to
DeepSpeed's engine (``deepspeed.initialize`` with ``--deepspeed_config``) in place of Megatron-LM's
DDP and distributed optimizer: read as ``training.sharding`` none / zero1 / zero2 / zero3 under
DeepSpeed's engine for that stage (``zero0_engine``, ``zero12_engine`` or ``zero3_engine =
"deepspeed"``, the engines a DeepSpeed JSON imports to, :mod:`meshplan.interop.deepspeed`), and
written back as ``--deepspeed --zero-stage N`` by ``export --to megatron`` (never beside
``--use-distributed-optimizer``). Under ``--deepspeed`` Megatron-DeepSpeed builds its model as
``GPTModelPipe``, a ``PipelineModule``, unless ``--no-pipeline-parallel`` is given, at any pp, pp 1
included (microsoft/Megatron-DeepSpeed 0782d75 ``pretrain_gpt.py`` ``model_provider``: ``if
args.deepspeed and not args.no_pipeline_parallel``), and ``deepspeed.initialize`` wraps a
``PipelineModule`` in DeepSpeed's ``PipelineEngine``, whose ``__init__`` asserts ZeRO stage < 2
(microsoft/DeepSpeed 0050fda ``deepspeed/runtime/pipe/engine.py``: "ZeRO-2 and ZeRO-3 are
incompatible with pipeline parallelism"); ``--no-pipeline-parallel`` in turn asserts pp 1
(Megatron-DeepSpeed 060fb40 ``megatron/arguments.py`` ``parse_args``). Without ``--no-pipeline-parallel``
the import sets ``training.pp_engine = "deepspeed"`` (:mod:`meshplan.compute.deepspeed_pipe`: what that
engine and its ``BF16_Optimizer`` run around each micro-batch). So ZeRO-2 and ZeRO-3 need
``--no-pipeline-parallel`` and pp 1: refused by name without it, as is ``--no-pipeline-parallel`` at
pp > 1 and ``--deepspeed`` beside Megatron-LM's own sharding flags; the export writes it beside
``--zero-stage 2`` or ``3``. ``--zero-stage`` has a parser default, 1 (``_add_zero_args``), but
DeepSpeed's engine takes its stage from the ds config, so a script without the flag is refused and
asked for the config's stage. The ds config (``--deepspeed_config PATH``, the flag
DeepSpeed's ``add_config_arguments`` adds; Megatron-DeepSpeed loads that JSON into
``args.deepspeed_config_dict`` and hands it to ``deepspeed.initialize``: microsoft/Megatron-DeepSpeed
f4157be ``megatron/training.py:73-87`` ``_create_ds_config_dict``) is read where its path resolves,
relative to the script's folder (:func:`ds_config`): its ``zero_optimization.stage`` must be
``--zero-stage`` (DeepSpeed's engine runs the JSON's stage, Megatron-DeepSpeed's model code follows
the flag: ``zero.Init`` at 3, ``pretrain_gpt.py``), its reduce dtype, gradient dtype, overlap and
buckets are read as a DeepSpeed JSON's are (:mod:`meshplan.interop.deepspeed_zero`, one home:
:func:`ds_tables`), its ``train_micro_batch_size_per_gpu`` is the micro-batch where
``--micro-batch-size`` is not given (given, they must agree: each iteration Megatron-DeepSpeed sets
the engine's global batch from its own arguments, ``megatron/training.py:1253-1258``
``set_train_batch_size``, which DeepSpeed meets by changing the gradient-accumulation steps and keeps
the JSON's micro-batch, while the data loader yields ``--micro-batch-size`` samples; so the JSON's
``train_batch_size`` and ``gradient_accumulation_steps`` give way to ``--global-batch-size``). A path that does not resolve (a shell variable, a
file not beside the script, a script read as text alone) is a note: the reduce dtype and bucket
are then DeepSpeed's defaults (the model's dtype, 5e8 elements). The export carries the flag as given.

``--checkpoint-activations`` (Megatron-LM before 2022; Megatron-DeepSpeed keeps it, its
deprecation commented out in ``arguments.py`` because DeepSpeed's activation checkpointing relies
on it) checkpoints every transformer layer (chunks of ``--checkpoint-num-layers``, default 1): the
predecessor of ``--recompute-granularity full --recompute-method uniform --recompute-num-layers
1``, read as recompute ``full`` (:func:`recompute_granularity`) and written as itself under
DeepSpeed's engine (:func:`recompute_flags`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop.deepspeed_offload import refuse_offload
from meshplan.interop.deepspeed_partition import pipe_split
from meshplan.interop.deepspeed_zero import (bf16_optimizer_training, bucket_elements, prefetch_memory,
                                             runs_bf16_optimizer, zero3_training, zero12_training, zero_stage)

#: The flags of this module that :mod:`meshplan.interop.megatron` reads.
FLAGS = ("--deepspeed", "--zero-stage", "--checkpoint-activations", "--no-pipeline-parallel", "--pp-partition-method")
#: Megatron-DeepSpeed's switch that builds ``GPTModel`` in place of ``GPTModelPipe`` (no
#: ``PipelineEngine``; pp 1 only): module docstring.
NO_PIPE = "--no-pipeline-parallel"
#: ZeRO stage -> (``training.sharding``, the engine key that names DeepSpeed's engine for it).
STAGES = {0: ("none", "zero0_engine"), 1: ("zero1", "zero12_engine"), 2: ("zero2", "zero12_engine"),
          3: ("zero3", "zero3_engine")}
#: Megatron-LM's own data-parallel sharding flags, which ``--deepspeed`` replaces.
MEGATRON_SHARDING = ("--use-distributed-optimizer", "--use-megatron-fsdp", "--use-custom-fsdp", "--use-torch-fsdp2")


def recompute_granularity(args: dict) -> Optional[str]:
    """``--recompute-granularity`` of parsed arguments, ``selective`` for ``--recompute-activations``,
    ``full`` for ``--checkpoint-activations`` (module docstring); None without any.

    >>> recompute_granularity({"--checkpoint-activations": True}), recompute_granularity({})
    ('full', None)
    """
    given = args.get("--recompute-granularity", "selective" if args.get("--recompute-activations") else None)
    return given if given is not None else "full" if args.get("--checkpoint-activations") else None


def ds_path(args: dict, base: Optional[Path]) -> tuple[Optional[str], Optional[Path]]:
    """``--deepspeed_config`` as given, and the file it names relative to ``base`` (the script's
    folder) where that is a file; (None, None) without the flag.

    >>> ds_path({"--deepspeed_config": "$DS_CONFIG"}, Path("."))
    ('$DS_CONFIG', None)
    """
    given = args.get("--deepspeed_config", args.get("--deepspeed-config"))
    if not given or given is True:
        return None, None
    path = Path(str(given)).expanduser()
    path = path if path.is_absolute() or base is None else base / path
    return str(given), path if base is not None and "$" not in str(given) and path.is_file() else None


def ds_config(path: Path, stage: int) -> dict:
    """The JSON object of the ds config at ``path``; a ConfigError naming the key where it is not
    an object, not JSON, or its ``zero_optimization.stage`` is not ``--zero-stage`` ``stage``."""
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError("--deepspeed_config", f"{path}: not a readable JSON file ({str(e).splitlines()[0][:80]})") \
            from None
    if not isinstance(d, dict):
        raise ConfigError("--deepspeed_config", f"{path}: a DeepSpeed config is a JSON object")
    given = zero_stage(d)
    if given != stage:
        raise ConfigError("zero_optimization.stage", f"{given!r} in {path.name} but --zero-stage {stage}: DeepSpeed's "
                          f"engine runs the JSON's stage while Megatron-DeepSpeed's model code follows --zero-stage; "
                          f"make them agree")
    return d


def ds_tables(d: dict, stage: int, dtype: str, micro: Optional[int]) -> tuple[dict, dict, Optional[int]]:
    """``([training] keys, [memory] keys, micro-batch)`` of ds config ``d`` at ZeRO ``stage`` under
    model dtype ``dtype`` (module docstring): the ZeRO keys as :mod:`meshplan.interop.deepspeed`
    reads them; the micro-batch ``train_micro_batch_size_per_gpu`` where ``micro``
    (``--micro-batch-size``) is None, else ``micro`` (a ConfigError naming the key where they differ).

    >>> ds_tables({"zero_optimization": {"stage": 1, "reduce_bucket_size": 2e8}, "communication_data_type": "fp32",
    ...            "train_micro_batch_size_per_gpu": 2}, 1, "bf16", None)
    ({'zero12_engine': 'deepspeed', 'grad_dtype': 'bf16', 'grad_reduce_dtype': 'fp32'}, {'grad_bucket_elements': 200000000}, 2)
    """
    zero = d.get("zero_optimization", {})
    refuse_offload(zero, optimizer_cpu=False)  # this reader does not read ZeRO-Offload
    training, memory = {}, {}
    if runs_bf16_optimizer(d, stage, dtype):  # BF16_Optimizer (bf16_optimizer_keys)
        training = bf16_optimizer_training(d, dtype)
    elif stage in (1, 2):
        training, memory = zero12_training(d, dtype), {"grad_bucket_elements": bucket_elements(zero)}
    elif stage == 3:
        training = zero3_training(d, dtype)
        memory = prefetch_memory(zero) | ({"grad_bucket_elements": bucket_elements(zero)}
                                          if zero.get("reduce_bucket_size", "auto") != "auto" else {})
    m = d.get("train_micro_batch_size_per_gpu")
    if m is not None and micro is not None and m != micro:
        raise ConfigError("train_micro_batch_size_per_gpu", f"{m!r} in the ds config but --micro-batch-size {micro}: "
                          f"DeepSpeed's engine counts micro-batches with its own; make them agree")
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ConfigError("train_micro_batch_size_per_gpu", f"must be a whole number >= 1; got {m!r}")
    return training, memory, micro if micro is not None else m


def bf16_optimizer_keys(training: dict, notes: list[str]) -> dict:
    """The ``[training]`` keys ``training`` of a Megatron-DeepSpeed script under DeepSpeed's engine,
    with ``BF16_Optimizer`` where the engine runs it: ``--deepspeed --zero-stage 0`` with ``--bf16``
    (BigScience's BLOOM-176B, tr11-176B-ml.slurm: "bf16 must use z0! it implements its own zero stage
    1 equivalent") is sharding zero1 under ``zero12_engine = "deepspeed"`` with fp32 gradients
    (:func:`~meshplan.interop.deepspeed_zero.bf16_optimizer_training`; a resolved ds config's
    ``communication_data_type`` read by :func:`ds_tables`), in place of ``zero0_engine``; a note says so.

    >>> bf16_optimizer_keys({"sharding": "none", "zero0_engine": "deepspeed", "param_dtype": "bf16"}, [])
    {'sharding': 'zero1', 'param_dtype': 'bf16', 'zero12_engine': 'deepspeed', 'grad_dtype': 'fp32'}
    """
    if training.get("zero0_engine") != "deepspeed" or training.get("param_dtype") != "bf16":
        return training
    notes.append("--deepspeed --zero-stage 0 with --bf16 runs DeepSpeed's BF16_Optimizer: fp32 master weights and Adam "
                 "states partitioned over dp as ZeRO-1, fp32 gradients of every parameter beside the bf16 ones "
                 "(planned as sharding \"zero1\", zero12_engine \"deepspeed\", grad_dtype \"fp32\"; exported back "
                 "as --zero-stage 0)")
    return {k: v for k, v in training.items() if k != "zero0_engine"} | {
        "sharding": "zero1", "zero12_engine": "deepspeed", "grad_dtype": "fp32"}


def deepspeed_engine(args: dict, pp: int, notes: list[str], base: Optional[Path] = None) -> dict[str, Any]:
    """``[training]`` keys of Megatron-DeepSpeed's ``--deepspeed --zero-stage N`` (module docstring):
    ``{}`` without ``--deepspeed``; a ConfigError naming the flag for a stage outside 0-3, none
    given, a stage of 2 or more under DeepSpeed's PipelineEngine (without ``--no-pipeline-parallel``,
    at any pp), ``--no-pipeline-parallel`` at pp > 1, or Megatron-LM's own sharding flag beside it.

    >>> deepspeed_engine({"--deepspeed": True, "--zero-stage": "1"}, 4, [])
    {'sharding': 'zero1', 'zero12_engine': 'deepspeed', 'pp_engine': 'deepspeed'}
    >>> deepspeed_engine({"--deepspeed": True, "--zero-stage": "3", "--no-pipeline-parallel": True}, 1, [])["sharding"]
    'zero3'
    >>> deepspeed_engine({"--deepspeed": True, "--zero-stage": "2"}, 4, [])
    Traceback (most recent call last):
    meshplan.errors.ConfigError: --zero-stage: 2 at --pipeline-model-parallel-size 4: DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3 with pipeline parallelism (runtime/pipe/engine.py asserts stage < 2); use --zero-stage 0 or 1, or pp 1 with --no-pipeline-parallel
    """
    if args.get(NO_PIPE) and pp > 1:
        raise ConfigError(NO_PIPE, f"given at --pipeline-model-parallel-size {pp}: Megatron-DeepSpeed asserts pp 1 "
                                   f"without its pipeline (arguments.py); drop it, or use pp 1")
    if not args.get("--deepspeed"):
        return {}
    own = next((f for f in MEGATRON_SHARDING if args.get(f)), None)
    if own:
        raise ConfigError("--deepspeed", f"given with {own}: DeepSpeed's engine (--zero-stage) shards instead of "
                                         f"Megatron-LM's; keep one")
    given = args.get("--zero-stage")
    if given is None:
        raise ConfigError("--zero-stage", "not given with --deepspeed; give --zero-stage N, your --deepspeed_config's "
                                          "zero_optimization.stage")
    if given is True:  # the flag with no value after it (the parser reads it as a switch)
        raise ConfigError("--zero-stage", "given without a value; give --zero-stage N (0, 1, 2 or 3), your "
                                          "--deepspeed_config's zero_optimization.stage")
    stage = int(float(given)) if str(given).replace(".", "", 1).isdigit() else -1
    if stage not in STAGES or float(given) != stage:
        raise ConfigError("--zero-stage", f"{given!r}; use 0, 1, 2 or 3")
    if stage >= 2 and pp > 1:
        raise ConfigError("--zero-stage", f"{stage} at --pipeline-model-parallel-size {pp}: DeepSpeed's PipelineEngine "
                                          f"refuses ZeRO-2 and ZeRO-3 with pipeline parallelism (runtime/pipe/engine.py "
                                          f"asserts stage < 2); use --zero-stage 0 or 1, or pp 1 with {NO_PIPE}")
    if stage >= 2 and not args.get(NO_PIPE):
        raise ConfigError("--zero-stage", f"{stage} without {NO_PIPE}: Megatron-DeepSpeed builds its model as a "
                                          f"PipelineModule even at pp 1 (pretrain_gpt.py), and DeepSpeed's "
                                          f"PipelineEngine refuses ZeRO-2 and ZeRO-3 (runtime/pipe/engine.py asserts "
                                          f"stage < 2); add {NO_PIPE}")
    sharding, engine = STAGES[stage]
    ds, path = ds_path(args, base)
    why = ("a shell variable" if "$" in str(ds) else "no folder: the script's text alone" if base is None
           else f"no such file beside the script, {base / str(ds)}")
    read = (f"; its ZeRO keys, reduce dtype, buckets and micro-batch read from {path}" if path else
            f"; {ds} is not read: its zero_optimization.stage must be {stage}, and its reduce dtype and bucket are "
            f"planned at DeepSpeed's defaults ({why}; meshplan import deepspeed {ds} reads them)" if ds else "")
    pipe = not args.get(NO_PIPE)  # GPTModelPipe under DeepSpeed's PipelineEngine (module docstring)
    notes.append(f"--deepspeed --zero-stage {stage}: planned as DeepSpeed's engine at ZeRO stage {stage} (sharding "
                 f"{sharding}, {engine} = \"deepspeed\"" + (", its PipelineEngine: pp_engine = \"deepspeed\")"
                                                            if pipe else ")") + read)
    return {"sharding": sharding, engine: "deepspeed"} | ({"pp_engine": "deepspeed"} if pipe else {})


def pipe_layer_split(args: dict, training: dict, pp: int, layers: int, mesh: dict, notes: list[str]) -> dict:
    """``{"pp_layer_split": [...]}`` of DeepSpeed's partition of ``GPTModelPipe`` under its
    PipelineEngine (``training`` holds ``pp_engine = "deepspeed"``, pp > 1, no split or virtual
    stages already in ``mesh``) where it is not Megatron-LM's even split
    (:func:`meshplan.interop.deepspeed_partition.pipe_split`, by ``--pp-partition-method`` or
    GPTModelPipe's ``type:transformer``), with a note; ``{}`` otherwise.

    >>> notes = []
    >>> pipe_layer_split({}, {"pp_engine": "deepspeed"}, 12, 70, {}, notes)
    {'pp_layer_split': [6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4]}
    >>> pipe_layer_split({}, {"pp_engine": "deepspeed"}, 8, 96, {}, notes)
    {}
    """
    method = args.get("--pp-partition-method")
    if training.get("pp_engine") != "deepspeed" or pp <= 1 or "pp_layer_split" in mesh or "virtual_stages" in mesh:
        return {}
    given = str(method).strip("'\"") if isinstance(method, str) else "type:transformer"
    split = pipe_split(layers, pp, given)
    if split == [layers // pp] * pp:
        return {}
    notes.append(f"pipeline split {split}: DeepSpeed's PipelineModule partitions GPTModelPipe by "
                 f"partition_method {given!r} (runtime/pipe/module.py, partition_balanced), not evenly")
    return {"pp_layer_split": split}


def deepspeed_flags(training) -> Optional[list[str]]:
    """``--deepspeed --zero-stage N`` for a ``training`` (TrainingSpec) whose sharding runs under
    DeepSpeed's engine (``zero0_engine``, ``zero12_engine`` or ``zero3_engine = "deepspeed"``), in
    place of Megatron-LM's sharding flags, with ``--no-pipeline-parallel`` at stage 2 or 3 (module
    docstring), ``--zero-stage 0`` for DeepSpeed's ``BF16_Optimizer`` (sharding zero1 with bf16 parameters
    and fp32 gradients: :attr:`~meshplan.spec.training.TrainingSpec.bf16_optimizer`); None otherwise."""
    if training.bf16_optimizer:  # bf16 at stage 0 (bf16_optimizer_keys)
        return ["--deepspeed", "--zero-stage 0"]
    stage = next((s for s, (sharding, engine) in STAGES.items() if training.sharding == sharding), None)
    if stage is None or getattr(training, STAGES[stage][1]) != "deepspeed":
        return None
    return ["--deepspeed", f"--zero-stage {stage}"] + [NO_PIPE] * (stage >= 2)  # no PipelineEngine (docstring)


def recompute_flags(recompute: str, deepspeed: bool, block: int | None = None) -> list[str]:
    """Megatron-LM's flags of ``training.recompute`` (none, selective or full); full under
    DeepSpeed's engine as ``--checkpoint-activations`` (module docstring); ``block``
    (``training.recompute_num_layers``) as ``--recompute-method block --recompute-num-layers n``
    under either (Megatron-DeepSpeed's ParallelTransformer has the same ``recompute_method ==
    'block'`` branch, microsoft/Megatron-DeepSpeed megatron/model/transformer.py).

    >>> recompute_flags("full", False), recompute_flags("full", True), recompute_flags("none", True)
    (['--recompute-granularity full', '--recompute-method uniform', '--recompute-num-layers 1'], ['--checkpoint-activations'], [])
    >>> recompute_flags("full", False, 2)
    ['--recompute-granularity full', '--recompute-method block', '--recompute-num-layers 2']
    """
    if recompute == "none":
        return []
    if recompute == "full" and block is not None:
        return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {block}"]
    if recompute == "full" and deepspeed:
        return ["--checkpoint-activations"]
    return [f"--recompute-granularity {recompute}"] + (["--recompute-method uniform", "--recompute-num-layers 1"]
                                                        if recompute == "full" else [])


def deepspeed_note(training) -> list[str]:
    """The header line of a Megatron-LM export under DeepSpeed's engine (:func:`deepspeed_flags`):
    the arguments are for Megatron-DeepSpeed, whose parser has ``--deepspeed`` and ``--zero-stage``
    (Megatron-LM's has neither), the model flags in its spelling
    (:func:`meshplan.interop.megatron_deepspeed_args.mds_model_flags`)."""
    flags = deepspeed_flags(training)
    if flags is None:
        return []
    return [f"{' '.join(flags)}: Megatron-DeepSpeed's flags (Megatron-LM has neither); give --deepspeed_config your "
            f"ds config at that stage; the model flags are written in Megatron-DeepSpeed's spelling (microsoft/"
            f"Megatron-DeepSpeed f4157be megatron/arguments.py: --num-key-value-heads, "
            f"--use-rotary-position-embeddings, --normalization rmsnorm)"]
