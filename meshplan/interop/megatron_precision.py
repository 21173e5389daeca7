"""Megatron-LM flags that change what a rank keeps or sends beyond ``--bf16`` and ``--fp8-format``
(newcomer trial 49 findings 1 and 8), read at NVIDIA/Megatron-LM d98e8a6 and
NVIDIA/TransformerEngine d0067d0:

- ``--use-precision-aware-optimizer`` with ``--main-grads-dtype``, ``--main-params-dtype``,
  ``--exp-avg-dtype``, ``--exp-avg-sq-dtype`` (:func:`precision_keys`): the dtypes are refused
  without the switch, as ``OptimizerConfig.__post_init__`` asserts (``megatron/core/optimizer/
  optimizer_config.py:467-477``), and the switch without ``--use-distributed-optimizer``
  (``optimizer/__init__.py:1057-1060``). bf16 main grads leave ``accumulate_allreduce_grads_in_fp32``
  off (``arguments.py:1209-1217``), so the DDP gradient buffer is in the parameter dtype
  (``grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32``, ``training.py:2635``;
  ``param_and_grad_buffer.py:924``) and so is the data-parallel reduce-scatter: training.grad_dtype
  and grad_reduce_dtype bf16. The moments are TE ``FusedAdam``'s ``exp_avg_dtype`` /
  ``exp_avg_sq_dtype`` (``optimizer/__init__.py:564-570``): training.optimizer_dtype. The master:
  with ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` (main params below fp32, or no fp8, or
  the delayed recipe; ``optimizer_config.py:407-413``) the distributed optimizer keeps no fp32
  shard (``distrib_optimizer.py:421-453``: "main params are held by FusedAdam") and FusedAdam gets
  ``master_weight_dtype = main_params_dtype`` (``__init__.py:571-585``) with
  ``store_param_remainders`` (``OptimizerConfig`` default True, no flag sets it): an fp16 master
  (training.master_dtype fp16), or for fp32 beside bf16 parameters only the 16-bit remainders
  (TE ``fused_adam.py`` 213-215, 414-415, 626: int16); otherwise Megatron's own fp32 shard.
- ``--transformer-impl local`` (:func:`local_keys`): ``gpt_builders.py:35`` and 109-146 build
  ``get_gpt_layer_local_spec``, whose ``LocalSpecProvider`` (``megatron/core/models/backends.py``)
  gives ``ColumnParallelLinear`` / ``RowParallelLinear`` (``tensor_parallel/layers.py``:
  ``tp_comm_buffer_name`` "Not used", no fp8 GEMM) and ``DotProductAttention`` (the unfused
  softmax, ``FusedScaleMaskSoftmax``). Megatron-LM asserts none of fp8 or ``--tp-comm-overlap``
  against it: ``initialize_ub`` still runs (``initialize.py:164-166``) but no GEMM uses its buffers.
  The plan follows: tp_comm_overlap false, no fp8 GEMM, flash_attention false, with a note.
- ``--fp8-param-gather`` (:func:`fp8_param_gather_keys`): training.fp8_param_gather with
  ``--fp8-format`` and the distributed optimizer (``arguments.py:1095-1097`` refuses it otherwise,
  unless an FSDP: Megatron FSDP or torch FSDP2 gather their own way, noted, not planned; under
  ``--use-torch-fsdp2`` with TE >= 2.0 Megatron-LM turns it off, 1051-1056); without ``--fp8-format``
  no TE linear is fp8 (noted, dropped). What it changes: :mod:`meshplan.memory.te_fp8`.
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` exported by the script
  (:func:`alloc_conf`): ``[memory] expandable_segments``.
- The rest change memory or communication in ways meshplan does not plan (:data:`NOT_MODELLED`):
  one note naming them and what each changes (:func:`not_modelled_note`), apart from the list of
  fields meshplan does not use.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError

PAO = "--use-precision-aware-optimizer"
#: The precision-aware optimizer's dtype flags: (default, argparse choices), arguments.py:3671-3684.
DTYPE_FLAGS = {"--main-grads-dtype": ("fp32", ("fp32", "bf16")), "--main-params-dtype": ("fp32", ("fp32", "fp16")),
               "--exp-avg-dtype": ("fp32", ("fp32", "fp16", "bf16", "fp8")),
               "--exp-avg-sq-dtype": ("fp32", ("fp32", "fp16", "bf16", "fp8"))}
#: Flags that change memory or communication in ways the plan does not model: what each changes.
NOT_MODELLED = {
    "--tp-comm-overlap-cfg": "the userbuffers' methods, splits and SMs from its YAML, TE initialize_ub's ub_cfgs; "
                             "planned with TE's defaults",
    "--defer-embedding-wgrad-compute": "the output layer's weight-gradient GEMMs deferred to the pipeline flush, "
                                       "their inputs and output gradients kept until then",
    "--num-distributed-optimizer-instances": "optimizer state sharded over dp / N and kept N times, gradients "
                                             "reduce-scattered within an instance and all-reduced across them",
    "--fp8-recipe": "block scales (mxfp8, blockwise) or a custom recipe; planned as per-tensor scaling",
}
#: --fp8-recipe values the plan's per-tensor fp8 GEMMs model (TransformerConfig.fp8_recipe, default delayed).
PER_TENSOR_RECIPES = ("delayed", "tensorwise")
FP8PG = "--fp8-param-gather"
#: store_true flags among these (the parser's switches).
SWITCHES = {PAO, "--defer-embedding-wgrad-compute", FP8PG}
#: Every flag this module reads (none is listed as unused).
FLAGS = {PAO, "--transformer-impl", FP8PG, *DTYPE_FLAGS, *NOT_MODELLED}
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def _dtypes(args: dict[str, Any]) -> dict[str, str]:
    out = {}
    for flag, (default, choices) in DTYPE_FLAGS.items():
        v = str(args.get(flag, default))
        if v not in choices:  # argparse's choices
            raise ConfigError(flag, f"{v!r} is not one of Megatron-LM's choices {', '.join(choices)}")
        out[flag] = v
    return out


def precision_keys(args: dict[str, Any], param_dtype: str, notes: list[str]) -> dict[str, Any]:
    """[training] keys of the precision-aware optimizer's flags (module docstring); ``param_dtype``
    the imported parameter dtype. Nothing without the switch (the dtype flags then refused).

    >>> precision_keys({PAO: True, "--use-distributed-optimizer": True, "--main-grads-dtype": "bf16",
    ...  "--exp-avg-dtype": "bf16", "--exp-avg-sq-dtype": "bf16", "--main-params-dtype": "fp16"}, "bf16", [])
    {'grad_dtype': 'bf16', 'grad_reduce_dtype': 'bf16', 'optimizer_dtype': 'bf16', 'master_dtype': 'fp16'}
    >>> precision_keys({PAO: True, "--use-distributed-optimizer": True}, "bf16", [])
    {'master_dtype': 'int16'}
    """
    dt = _dtypes(args)
    if not args.get(PAO):
        given = [f for f, v in dt.items() if v != DTYPE_FLAGS[f][0]]
        if given:
            raise ConfigError(given[0], f"{dt[given[0]]} without {PAO}: Megatron-LM asserts it is fp32 then "
                              f"(optimizer_config.py:467-477); fix: add {PAO} or remove {given[0]}")
        return {}
    fsdp = next((f for f in ("--use-megatron-fsdp", "--use-custom-fsdp", "--use-torch-fsdp2") if args.get(f)), None)
    if fsdp:  # Megatron FSDP keeps its own main weights and gradients (--megatron-fsdp-main-*-dtype)
        notes.append(f"changes memory/communication, NOT modelled: {PAO} under {fsdp} (its optimizer's dtypes are "
                     f"planned as fp32)")
        return {}
    if not args.get("--use-distributed-optimizer"):
        raise ConfigError(PAO, "needs --use-distributed-optimizer: Megatron-LM raises \"--use-precision-aware-"
                          "optimizer only supported with distributed optimizer\" (optimizer/__init__.py:1057-1060)")
    out: dict[str, Any] = {}
    if dt["--main-grads-dtype"] == "bf16":
        if args.get("--accumulate-allreduce-grads-in-fp32"):
            raise ConfigError("--main-grads-dtype", "bf16 with --accumulate-allreduce-grads-in-fp32: Megatron-LM "
                              "asserts fp32 then (arguments.py:1209-1211); remove one")
        out |= {"grad_dtype": "bf16", "grad_reduce_dtype": "bf16"}
    m, v = dt["--exp-avg-dtype"], dt["--exp-avg-sq-dtype"]
    if m != "fp32" or v != "fp32":
        wide = max((m, v), key=lambda d: {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}[d])
        out["optimizer_dtype"] = wide
        if m != v:
            notes.append(f"--exp-avg-dtype {m} with --exp-avg-sq-dtype {v}: meshplan keeps one dtype for both Adam "
                         f"moments; planned with {wide} for both (an overestimate of the other)")
    fp8 = bool(args.get("--fp8-format"))
    main = dt["--main-params-dtype"]
    if main != "fp32" or not fp8 or str(args.get("--fp8-recipe", "delayed")) == "delayed":  # held by FusedAdam
        out["master_dtype"] = main if main != "fp32" else "int16" if param_dtype == "bf16" else "fp32"
    return {k: v for k, v in out.items() if not (k == "master_dtype" and v == "fp32")}


def fp8_param_gather_keys(args: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """[training] fp8_param_gather of ``--fp8-param-gather`` (module docstring): true with
    ``--fp8-format`` under the distributed optimizer; under an FSDP a note (not planned); without
    ``--fp8-format`` a note (no fp8 linear to keep); nothing without the switch.

    >>> fp8_param_gather_keys({FP8PG: True, "--fp8-format": "hybrid", "--use-distributed-optimizer": True}, [])
    {'fp8_param_gather': True}
    >>> n = []; fp8_param_gather_keys({FP8PG: True, "--use-distributed-optimizer": True}, n), n[0][:40]
    ({}, '--fp8-param-gather without --fp8-format:')
    """
    if not args.get(FP8PG):
        return {}
    fsdp = next((f for f in ("--use-megatron-fsdp", "--use-custom-fsdp", "--use-torch-fsdp2") if args.get(f)), None)
    if fsdp:
        notes.append(f"changes memory/communication, NOT modelled: {FP8PG} under {fsdp} (its fp8 gathers are planned "
                     f"in the parameter dtype)")
        return {}
    if not args.get("--use-distributed-optimizer"):
        raise ConfigError(FP8PG, "needs --use-distributed-optimizer (or an FSDP): Megatron-LM asserts \"--fp8-param-"
                          "gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or inference "
                          "mode\" (arguments.py:1095-1097)")
    if not args.get("--fp8-format"):
        notes.append(f"{FP8PG} without --fp8-format: no Transformer Engine linear runs fp8, so no parameter is kept "
                     f"in fp8; planned without it")
        return {}
    return {"fp8_param_gather": True}


def local_keys(args: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """[training] keys of ``--transformer-impl local`` (module docstring): tp_comm_overlap and
    flash_attention false, no fp8 GEMM (``linear_dtype`` None: the caller drops it), with a note
    naming what was dropped; nothing for Transformer Engine (the default)."""
    impl = str(args.get("--transformer-impl", "transformer_engine"))
    if impl == "inference_optimized":
        raise ConfigError("--transformer-impl", "inference_optimized is Megatron-LM's inference layer spec; "
                          "meshplan plans training: use transformer_engine or local")
    if impl != "local":
        return {}
    dropped = [w for f, w in (("--tp-comm-overlap", "--tp-comm-overlap (initialize_ub still allocates its buffers, "
                                                    "no GEMM uses them: their memory is not counted)"),
                              ("--fp8-format", "--fp8-format (no fp8 GEMM: the local linears ignore TE's "
                                               "fp8_autocast)")) if args.get(f)]
    notes.append("--transformer-impl local: Megatron-Core's own layers (get_gpt_layer_local_spec: ColumnParallelLinear/"
                 "RowParallelLinear, unfused DotProductAttention), no Transformer Engine module: planned with the "
                 "attention core unfused (flash_attention false)" + (f", without {' and '.join(dropped)}"
                                                                    if dropped else ""))
    return {"tp_comm_overlap": False, "flash_attention": False, "linear_dtype": None, "fp8_param_gather": None}


def not_modelled_note(args: dict[str, Any], instances: bool = False) -> list[str]:
    """One note naming the given flags of :data:`NOT_MODELLED` and what each changes (a per-tensor
    ``--fp8-recipe`` and one instance are what the plan models: not named; nor, with ``instances``,
    the distributed optimizer's instances the mesh holds as dp_replicate,
    :func:`~meshplan.interop.megatron_mesh.with_instances`).

    >>> not_modelled_note({"--fp8-recipe": "delayed", "--num-distributed-optimizer-instances": "1"})
    []
    >>> not_modelled_note({"--defer-embedding-wgrad-compute": True})[0][:70]
    'changes memory/communication, NOT modelled: --defer-embedding-wgrad-co'
    """
    shown = [f"{f} ({why})" for f, why in NOT_MODELLED.items() if f in args and not (
        (f == "--fp8-recipe" and str(args[f]) in PER_TENSOR_RECIPES)
        or (f == "--num-distributed-optimizer-instances" and (str(args[f]) == "1" or instances)))]
    return [f"changes memory/communication, NOT modelled: {'; '.join(shown)}"] if shown else []


def alloc_conf(exported: dict[str, str]) -> dict[str, Any]:
    """[memory] keys of the script's ``export PYTORCH_CUDA_ALLOC_CONF=...``: expandable_segments
    true where it says ``expandable_segments:True`` (torch's option syntax ``key:value``, comma
    separated); nothing otherwise.

    >>> alloc_conf({ALLOC_ENV: "expandable_segments:True"}), alloc_conf({ALLOC_ENV: "max_split_size_mb:512"})
    ({'expandable_segments': True}, {})
    """
    opts = dict(o.split(":", 1) for o in exported.get(ALLOC_ENV, "").strip("'\"").split(",") if ":" in o)
    return {"expandable_segments": True} if opts.get("expandable_segments", "").strip() == "True" else {}
