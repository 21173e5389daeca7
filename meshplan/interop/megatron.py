"""Megatron-LM arguments <-> meshplan tables.

Flag names from ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM at d98e8a6; most
flags are the fields of ``ModelParallelConfig``, ``TransformerConfig`` and ``TrainingConfig``
turned into ``--dashed-names`` by its ``ArgumentGroupFactory``) and the rank order of
``megatron/core/parallel_state.py`` (``order="tp-cp-ep-dp-pp"``, tp fastest). Read from an
arguments file (one or more flags a line) or a launch script: lines joined at ``\\``, a
quoted string spanning lines read whole (``GPT_ARGS="`` of Megatron-LM's
``examples/pretrain_gpt.sh``), comments dropped, ``NAME=value`` shell variables and ``NAME=(...)``
arrays expanded where they are used, as bash does (:mod:`~meshplan.interop.shell_words`: ``$(...)`` kept
whole, an ``if`` read where its test compares known strings), then every ``--flag [value]`` token pair
collected (``--recompute-modules`` takes one or more values). The options between a launcher
(``torchrun``, ``python -m torch.distributed.run`` or ``.launch``) and its script are the
launcher's, not Megatron-LM's: its ``--nnodes`` gives the node count when ``--nodes`` is not
given (a note says which one is used when both are), the others are neither read nor listed.
A flag given twice keeps its last value, as Megatron-LM's argparse parser does (a launch
script often appends overrides to a shared list), with a note naming both values when they
differ. A flag that is a near miss of one meshplan reads (``--sequence-paralel``;
:func:`~meshplan.interop.typos.near_miss`) or, not being one of Megatron-LM's 877 flags, of any
of them (``--lr-decay-stlye``; :mod:`~meshplan.interop.megatron_known`) is an error naming the
likely flag, as Megatron-LM's own parser (``allow_abbrev=False``) refuses it; other flags are
listed, those Megatron-LM does not have in a note of their own.

This module reads; the ``[training]``, ``[memory]`` and ``[reliability]`` keys of the runtime's,
Megatron-DeepSpeed's and the precision flags are gathered in :mod:`~meshplan.interop.megatron_tables`,
the cluster's node count, NVLS and GPU in :mod:`~meshplan.interop.megatron_cluster`; the flags one
at a time are in :mod:`~meshplan.interop.megatron_flags`, the
pipeline split both ways in :mod:`~meshplan.interop.megatron_pipeline`, the model flags both
ways in :mod:`~meshplan.interop.megatron_model`, and the writer (``export --to megatron``) in
:mod:`~meshplan.interop.megatron_write`, whose names are importable from here too.

======================================== ===================================================
Megatron-LM                              meshplan
======================================== ===================================================
--tensor/pipeline-model-parallel-size,   mesh [pp, dp, cp, tp] (dp = world / (tp*cp*pp); named dp_shard
                                           where zero3 shards the parameters over it, as DeepSpeed's
                                           ZeRO-3 and torchtitan imports name it),
--context-parallel-size,                   ep and etp (--expert-tensor-parallel-size,
--expert-model-parallel-size               default tp as Megatron)
--sequence-parallel                      mesh.sequence_parallel
--use-distributed-optimizer              sharding zero1 (else none: DDP); with
                                           --use-torch-fsdp2 / --use-megatron-fsdp (before
                                           Megatron-LM af28b5a: --use-custom-fsdp) the
                                           --data-parallel-sharding-strategy (no_shard none,
                                           optim zero1, optim_grads zero2, optim_grads_params
                                           zero3; default optim_grads_params); no_shard and
                                           optim with training.megatron_fsdp (Megatron FSDP,
                                           not DDP and the distributed optimizer); Megatron FSDP
                                           written with --use-distributed-optimizer (its optimizer:
                                           :data:`~meshplan.interop.megatron_flags.FSDP_OPTIMIZER`)
--deepspeed --zero-stage N               Megatron-DeepSpeed: sharding none/zero1/zero2/zero3 under
                                           DeepSpeed's engine (:mod:`~meshplan.interop.megatron_deepspeed`;
--no-pipeline-parallel                     stage 2 and 3 need --no-pipeline-parallel, pp 1)
--recompute-activations,                 recompute selective / full (--recompute-method and
--recompute-granularity,                   --recompute-num-layers: partial full recompute is
--checkpoint-activations                   planned as full, with a note); --checkpoint-activations full
--num-layers-per-virtual-pipeline-stage, mesh.virtual_stages, pp_schedule interleaved_1f1b
--num-virtual-stages-per-pipeline-rank
--decoder-first/last-pipeline-num-layers mesh.pp_layer_split (with virtual stages each stage's layers
                                           a multiple of vpp, as Megatron-Core's TransformerConfig requires)
--account-for-embedding-in-pipeline-split mesh.pp_layer_split: the embedding and the loss each
  and --account-for-loss-in-pipeline-split  count as a layer, (layers + 2) / (pp x vpp) per virtual
                                           stage (both flags together; Llama 3's split)
--micro-batch-size, --global-batch-size  training.micro_batch, global_batch (default micro x dp)
--seq-length                             training.seq_len
--bf16, --fp16                           compute/param dtype (fp32 main parameters kept)
--fp8-format                             training.linear_dtype fp8 (Transformer Engine's linears; activations,
                                         attention, output layer and router in bf16 or fp16)
--fp8-param-gather                       training.fp8_param_gather (with --fp8-format and the distributed optimizer)
--accumulate-allreduce-grads-in-fp32     grad_reduce_dtype fp32 (forced by --bf16 unless --grad-reduce-in-bf16;
                                         else the parameter dtype)
--tp-comm-overlap                        training.tp_comm_overlap
--use-precision-aware-optimizer,         training.grad_dtype / grad_reduce_dtype, optimizer_dtype, master_dtype
  --main-grads-dtype, --exp-avg(-sq)-dtype, (:mod:`~meshplan.interop.megatron_precision`, which also reads
  --main-params-dtype                      --transformer-impl local, PYTORCH_CUDA_ALLOC_CONF and notes the
                                           flags that change memory or communication unplanned)
--attention-backend (default auto),      training.flash_attention: flash, fused, auto true; unfused, local false
  --use-flash-attn                         (:mod:`~meshplan.interop.megatron_attention`); exported as the user's
                                           --attention-backend where it agrees, else --use-flash-attn / unfused
--moe-token-dispatcher-type alltoall     what the plan models (ep's all-to-all dispatch): written so; another value
                                           where it communicates is a ConfigError naming the flag, an absent one a
                                           note (Megatron-LM's default: allgather)
--cp-comm-type p2p, all_gather           training.cp_attention p2p (Megatron-LM's default, also when absent:
                                           Transformer Engine's ring), allgather; a2a and a2a+p2p are refused at cp > 1
--moe-token-dispatcher-type flex,        training.moe_dispatcher deepep (also the deprecated --moe-enable-deepep;
  --moe-flex-dispatcher-backend deepep     hybridep and ncclep are refused where ep x etp > 1)
--overlap-grad-reduce,                   training.overlap_grad_reduce / overlap_param_gather with none / zero1
  --overlap-param-gather                   (Megatron-LM's DDP buffers); written with Megatron FSDP (zero2; zero3
                                           both), which forces them and the step models
--no-overlap-p2p-communication,         training.pp_p2p_overlap false (unset: on, Megatron-LM's default: the
  --overlap-p2p-communication-warmup-flush interleaved steady state's sends and receives not waited for),
                                           pp_p2p_overlap_warmup_flush (the warm-up and cool-down too)
--ddp-bucket-size                        memory.grad_bucket_elements with none / zero1 and --overlap-grad-reduce
                                           (Megatron-LM's DDP buckets; unset max(40e6, 1e6 x dp)); elsewhere a note
                                           (Megatron-LM's DDP ignores it without overlap; Megatron FSDP makes each
                                           layer a unit whatever it is and only buckets the ends by it: ignored)
--max-position-embeddings                written as max(model.max_position, --seq-length) (Megatron-LM's assertion)
--moe-expert-capacity-factor,            training.moe_capacity_factor; absent or < 0: moe_dropless (Megatron-LM's
  --moe-pad-expert-input-to-capacity       default); meshplan plans the padded E x C buffer (without the padding
                                           flag Megatron-LM sends only the routed copies: a note says so);
                                           with flex + deepep the kept copies unpadded, the padding flag refused
--no-bias-swiglu-fusion (with --swiglu)  memory.fused_glu false (unset: Megatron-LM's fused bias-SwiGLU, the
                                           default of framework megatron)
--hidden-dropout, --attention-dropout    memory.dropout: on unless both are 0.0 (Megatron-LM's TransformerConfig:
  (default 0.1 each)                       0.1 each); meshplan has one switch for both (the residual and
                                           embedding masks, and the attention-score mask of non-flash attention);
                                           a note names a flag left at its default and the flags that turn it off
--clip-grad (default 1.0)                training.grad_clip (0: false, no norm computed),
                                           grad_clip_norm (the value, > 0)
--save-interval                          [reliability] checkpoint_interval_steps (iterations between saves), which
                                           ``meshplan reliability`` sets beside the optimal interval
--ckpt-format (default torch_dist)       not planned; written fsdp_dtensor with Megatron FSDP, which asserts it
                                           (a mismatch on import is a note), else carried as given (fsdp_dtensor
                                           dropped), as --async-save needs torch_dist, torch_dcp or fsdp_dtensor
--async-save                             not planned, carried; a note where Megatron-LM d98e8a6 would not save
                                           asynchronously (format torch; no --use-persistent-ckpt-worker)
CUDA_DEVICE_MAX_CONNECTIONS (environment) not a flag: a Megatron FSDP export's header (a comment line) says to
                                           unset it, as Megatron-LM asserts it is not 1 there
                                           (:data:`~meshplan.interop.megatron_flags.FSDP_ENV`); with tp or cp > 1
                                           before Blackwell to export it as 1, as it asserts there; a launch
                                           script's export of it is read into a note, its other exports listed
                                           as not used (:mod:`~meshplan.interop.megatron_env`)
--no-gradient-accumulation-fusion        not planned (the plan times the fused accumulation, Megatron-LM's
                                           default): a note; not written, carried from the user's arguments
(Megatron-LM's own linears)              training.framework megatron (its backward order), megatron_runtime core
                                           (today's get_batch, timers, p2p syncs; 2022 under --deepspeed)
--no-create-attention-mask-in-dataloader training.dataloader_attention_mask false (unset: the mask travels with
                                           every batch, Megatron-LM's default); written back under core
--num-layers, --hidden-size, ...         the model, field by field (or --model); --rotary-base and --norm-epsilon
                                           are model.rope_theta and norm_eps, --use-rope-scaling (factor
                                           --rope-scaling-factor) model.rope_scaling (unset: a catalog model still
                                           matches, with a note naming Megatron-LM's default where it differs)
--tokenizer-type GPT2BPETokenizer, or    model.vocab 50257 (GPT-2's) when --vocab-size is absent, padded by
  none with --vocab-file gpt2-vocab.json   vocab_pad_divisor x tp as Megatron-LM (``megatron_model.gpt2_vocab``)
======================================== ===================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from meshplan.errors import ConfigError
from meshplan.interop import megatron_flags as flags
from meshplan.interop.megatron_cluster import fabric_nvls, gpu_name, launcher_nnodes, with_nvls
from meshplan.interop.megatron_dispatch import FLAGS as DISPATCH_FLAGS
from meshplan.interop.megatron_attention import FLAG as ATTENTION, MDS_FLASH
from meshplan.interop.megatron_deepspeed import FLAGS as DEEPSPEED_FLAGS, deepspeed_engine, ds_path
from meshplan.interop import megatron_deepspeed_args as mds
from meshplan.interop.megatron_env import NVLS_ENV, import_note
from meshplan.interop.megatron_flags import PARALLEL
from meshplan.interop.megatron_mesh import TP_PP_DP, degrees, mesh_table, with_instances
from meshplan.interop import megatron_precision as precision
from meshplan.interop.megatron_known import foreign_flags_note, misspelt_flag
from meshplan.interop.common import (Imported, ImportOptions, cluster_table, model_is_moe, model_layers,
                                     seq_len_of)
from meshplan.interop.launch import parse_launch
from meshplan.interop.megatron_model import MODEL_FLAGS, int_flag as _int, model_table, num_flag as _num, unstated
from meshplan.interop.megatron_pipeline import accounted_split, read_pipeline
from meshplan.interop.megatron_recompute import recompute as read_recompute
from meshplan.interop.megatron_tables import (deepspeed_training, ds_config_keys, memory_keys, reliability_keys,
                                              runtime_training)
from meshplan.interop.megatron_write import exported_model, write, write_notes

#: What the modules split by concern export under this one (tests, :mod:`~meshplan.interop.foreign`, :mod:`~meshplan.interop.export` and
#: :mod:`~meshplan.interop.export_formats`).
__all__ = ["PARALLEL", "USED", "accounted_split", "exported_model", "parse_args", "read", "unstated", "write", "write_notes"]


#: Flags that take no value (store_true in arguments.py), so the next token is not theirs.
SWITCHES = {"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations", "--bf16", "--fp16",
            "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention", "--disable-bias-linear",
            "--add-qkv-bias", "--qk-layernorm", "--use-flash-attn", "--accumulate-allreduce-grads-in-fp32",
            "--tp-comm-overlap", "--use-torch-fsdp2", "--use-megatron-fsdp", "--use-custom-fsdp",
            "--overlap-grad-reduce",
            "--overlap-param-gather", "--use-mcore-models", "--no-masked-softmax-fusion", "--standalone",
            "--multi-latent-attention", "--grad-reduce-in-bf16", "--no-bias-swiglu-fusion",
            "--moe-pad-expert-input-to-capacity", "--use-rope-scaling", "--no-gradient-accumulation-fusion",
            "--deepspeed", "--checkpoint-activations", "--no-pipeline-parallel", *flags.P2P_FLAGS, *precision.SWITCHES,
            *mds.SWITCHES, *MDS_FLASH}


USED = set(PARALLEL) | MODEL_FLAGS | {TP_PP_DP} | {
    "--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--use-megatron-fsdp",
    "--use-custom-fsdp",
    "--data-parallel-sharding-strategy", "--recompute-activations", "--recompute-granularity", "--recompute-method",
    "--recompute-modules", "--recompute-num-layers", "--num-layers-per-virtual-pipeline-stage",
    "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--micro-batch-size",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--global-batch-size", "--seq-length", "--bf16", "--fp16", "--fp8-format", "--accumulate-allreduce-grads-in-fp32",
    "--tp-comm-overlap", "--make-vocab-size-divisible-by", "--use-flash-attn", ATTENTION, "--nnodes", "--grad-reduce-in-bf16",
    "--clip-grad", "--hidden-dropout", "--attention-dropout", "--no-bias-swiglu-fusion",
    "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity", *DISPATCH_FLAGS,
    flags.NO_MASK, "--cp-comm-type", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "--ckpt-format",
    "--save-interval", *flags.P2P_FLAGS, *DEEPSPEED_FLAGS, *precision.FLAGS, *mds.FLAGS, *MDS_FLASH}


#: Megatron-LM flags (its parser at d98e8a6: 877 flags) within three edits of a flag meshplan reads, so
#: never taken for a misspelling of it (``--vocab-file`` is two edits from ``--vocab-size``).
NEAR_FLAGS = {"--fp4-format", "--vocab-file", "--moe-router-dtype", "--num-channels", "--save"}


def parse_args(text: str) -> dict[str, Any]:
    """Megatron-LM's ``--flag value`` pairs of an arguments file or launch script (module
    docstring); a switch maps to True; the last occurrence wins.

    >>> parse_args("--tensor-model-parallel-size 4 --bf16 --seq-length=4096 --lr 1e-4")
    {'--tensor-model-parallel-size': '4', '--bf16': True, '--seq-length': '4096', '--lr': '1e-4'}
    """
    return parse_launch(text, SWITCHES)[0]


def read(text: str, opts: ImportOptions, base: Optional[Path] = None) -> Imported:
    """meshplan tables of Megatron-LM arguments (module docstring); ``base``: the script's folder,
    where a Megatron-DeepSpeed ds config's path resolves (:mod:`~meshplan.interop.megatron_deepspeed`)."""
    repeated: dict[str, list[Any]] = {}
    exported: dict[str, str] = {}
    args, launcher = parse_launch(text, SWITCHES, repeated, exported)
    _check_words(args)
    dialect = mds.is_megatron_deepspeed(args)  # its parser's flags, not Megatron-LM's (megatron_deepspeed_args)
    notes = mds.foreign_note(args) if dialect else foreign_flags_note(args, USED, SWITCHES)
    notes += [f"{flag} given {len(vals)} times ({', '.join(map(str, vals))}): planned with the last, "
             f"{vals[-1]}, as Megatron-LM's argparse keeps it" for flag, vals in repeated.items() if len(set(vals)) > 1]
    # Megatron-DeepSpeed's model flags in Megatron-LM's spelling, its notes in its own (megatron_deepspeed_args)
    before = len(notes)
    model = model_table(mds.lm_model_args(args, notes) if dialect else args, opts, notes)
    notes[before:] = [mds.respelt(n) for n in notes[before:]] if dialect else notes[before:]
    cluster, world = cluster_table(opts, "Megatron-LM", launcher_nnodes(launcher | args, opts, notes))
    cluster = with_nvls(cluster, exported, notes)
    deg, dp = degrees(args, model, world, int(cluster["nodes"]))
    layers = model_layers(model)
    deepspeed = deepspeed_engine(args, deg["pp"], notes, base)  # Megatron-DeepSpeed's --deepspeed --zero-stage N
    ds_file = ds_path(args, base)[1] if deepspeed else None  # its ds config, where the path resolves
    sharding = deepspeed.get("sharding", flags.sharding(args))
    mesh = with_instances(args, mesh_table(args, deg, dp, sharding), sharding, notes)  # dp_replicate: instances
    mesh |= read_pipeline(args, deg["pp"], layers)
    micro = _num(args, "--micro-batch-size", 1)
    seq = seq_len_of(opts.seq_len, args.get("--seq-length") if opts.seq_len else _int(args, "--seq-length"),
                     "--seq-length", "the arguments", notes)
    dtype, fp8 = _dtype(args)
    flags.check_positions(model, seq, "--seq-len" if opts.seq_len else "--seq-length", notes)
    ds_keys = ds_config_keys(ds_file, str(deepspeed.get("sharding")), dtype, micro if "--micro-batch-size" in args else None,
                       notes)
    micro = ds_keys[2] or micro
    training = {"global_batch": _num(args, "--global-batch-size", micro * dp), "seq_len": seq, "micro_batch": micro,
                "sharding": sharding, **read_recompute(args, layers // deg["pp"], notes, mesh.get("virtual_stages", 1)),
                "param_dtype": dtype, "compute_dtype": dtype, **({"linear_dtype": "fp8"} if fp8 else {}),
                "grad_reduce_dtype": "fp32" if args.get("--accumulate-allreduce-grads-in-fp32") or (
                    dtype == "bf16" and not args.get("--grad-reduce-in-bf16")) else "param",
                "tp_comm_overlap": bool(args.get("--tp-comm-overlap")), "framework": "megatron",
                "vocab_pad_divisor": _num(args, "--make-vocab-size-divisible-by", 128),
                **flags.grad_clip(args)}
    if deepspeed:
        training, mesh = deepspeed_training(args, training, mesh, deepspeed, ds_keys[0], deg["pp"], layers, notes)
    training = runtime_training(args, training, mesh, bool(deepspeed), deg, model_is_moe(model), sharding, dtype, notes)
    fsdp = (sharding not in ("none", "zero1") and not deepspeed) or any(
        args.get(f) for f in (*flags.FSDP_FLAGS, "--use-torch-fsdp2"))
    notes += import_note(exported, gpu_name(cluster), deg["tp"], deg["cp"], fsdp, bool(launcher))
    unused = _unused(args, exported, cluster, ds_file)
    memory = memory_keys(args, training, ds_keys[1], exported, notes)
    tables = {"model": model, "cluster": cluster, "training": training, "mesh": mesh}
    tables |= {"memory": memory} if memory else {}
    tables |= reliability_keys(args, notes)
    return Imported("megatron", tables, unused, tuple(notes))


def _check_words(args: dict) -> None:
    """Refuse what Megatron-LM's parser refuses before planning: a "--flag value" word (a quoted
    array element: argparse takes it for a positional argument and exits), then a near miss of a
    flag meshplan reads or of any of Megatron-LM's or Megatron-DeepSpeed's
    (:func:`~meshplan.interop.megatron_known.misspelt_flag`, :func:`~meshplan.interop.megatron_deepspeed_args.mds_flags`)."""
    for flag in args:  # a "--flag value" word: argparse's positional (shell_words), Megatron-LM exits
        if any(c.isspace() for c in flag):
            raise ConfigError(flag.split()[0], f"{flag!r} reaches pretrain_gpt.py as one word (a quoted \"${{ARR[@]}}\" "
                              f"keeps each array element whole); Megatron-LM's argparse takes a word holding a space "
                              f"for a positional argument and exits (unrecognized arguments: {flag}); fix: write "
                              f"it as two words, or expand the array unquoted, ${{ARR[@]}}, as Megatron-LM's examples do")
    for flag in args:  # near misses of a flag meshplan reads, or of any of Megatron-LM's (megatron_known)
        typo = misspelt_flag(flag, USED, SWITCHES | NEAR_FLAGS | mds.mds_flags()[0])
        if typo is not None:
            raise typo


def _dtype(args: dict) -> tuple[str, bool]:
    """(the parameters' and compute dtype, whether Transformer Engine's fp8 runs beside it):
    ``--fp16``, ``--bf16`` (also implied by ``--fp8-format``), else fp32. Both ``--bf16`` and
    ``--fp16`` is the error Megatron-LM's ``arguments.py`` asserts (one dtype)."""
    if args.get("--bf16") and args.get("--fp16"):  # arguments.py: assert not args.bf16 (and the reverse)
        raise ConfigError("--fp16", "given with --bf16; Megatron-LM refuses both (arguments.py asserts one dtype): "
                          "keep one")
    fp8 = bool(args.get("--fp8-format"))  # Transformer Engine's fp8 runs beside --bf16 (or --fp16)
    return ("fp16" if args.get("--fp16") else "bf16" if args.get("--bf16") or fp8 else "fp32"), fp8


def _unused(args: dict, exported: dict[str, str], cluster: dict, ds_file: Optional[Path]) -> tuple[str, ...]:
    """The flags meshplan does not read and the exported variables it does not honour (Megatron
    FSDP's; NVLS where the fabric has it or a resolved cluster says; the caching allocator's
    configuration where it is read), for the import's "does not use" line."""
    used = USED | ({"--deepspeed_config", "--deepspeed-config"} if ds_file is not None else set())
    honoured = (flags.FSDP_ENV,) + ((NVLS_ENV,) if cluster.get("fabric") or not fabric_nvls(cluster) else ()) \
        + ((precision.ALLOC_ENV,) if precision.alloc_conf(exported) else ())
    return tuple(k for k in args if k not in used) + tuple(f"export {k}" for k in exported if k not in honoured)
