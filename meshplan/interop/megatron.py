"""Megatron-LM arguments <-> meshplan tables.

Flag names from ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM at d98e8a6; most
flags are the fields of ``ModelParallelConfig``, ``TransformerConfig`` and ``TrainingConfig``
turned into ``--dashed-names`` by its ``ArgumentGroupFactory``) and the rank order of
``megatron/core/parallel_state.py`` (``order="tp-cp-ep-dp-pp"``, tp fastest). Read from an
arguments file (one or more flags a line) or a launch script: lines joined at ``\\``, a
quoted string spanning lines read whole (``GPT_ARGS="`` of Megatron-LM's
``examples/pretrain_gpt.sh``), comments dropped, ``NAME=value`` shell variables substituted,
then every ``--flag [value]`` token pair collected. The options between a launcher
(``torchrun``, ``python -m torch.distributed.run`` or ``.launch``) and its script are the
launcher's, not Megatron-LM's: its ``--nnodes`` gives the node count when ``--nodes`` is not
given (a note says which one is used when both are), the others are neither read nor listed.
A flag given twice keeps its last value, as Megatron-LM's argparse parser does (a launch
script often appends overrides to a shared list), with a note naming both values when they
differ. A flag that is a near miss of one meshplan reads (``--sequence-paralel``;
:func:`~meshplan.interop.common.near_miss`) is an error naming the likely flag, as
Megatron-LM's own parser (``allow_abbrev=False``) refuses it; other flags are listed.

======================================== ===================================================
Megatron-LM                              meshplan
======================================== ===================================================
--tensor/pipeline-model-parallel-size,   mesh [pp, dp, cp, tp] (dp = world / (tp*cp*pp)),
--context-parallel-size,                   ep and etp (--expert-tensor-parallel-size,
--expert-model-parallel-size               default tp as Megatron)
--sequence-parallel                      mesh.sequence_parallel
--use-distributed-optimizer              sharding zero1 (else none: DDP); with
                                           --use-torch-fsdp2 / --use-megatron-fsdp the
                                           --data-parallel-sharding-strategy (optim zero1,
                                           optim_grads zero2, optim_grads_params zero3)
--recompute-activations,                 recompute selective / full (--recompute-method and
--recompute-granularity                    --recompute-num-layers: partial full recompute is
                                           planned as full, with a note)
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
--accumulate-allreduce-grads-in-fp32     grad_reduce_dtype fp32 (forced by --bf16 unless --grad-reduce-in-bf16;
                                         else the parameter dtype)
--tp-comm-overlap                        training.tp_comm_overlap
--moe-token-dispatcher-type alltoall,    what the plan models (ep's all-to-all dispatch, cp's K/V all-gather): written
  --cp-comm-type all_gather                so; another value where it communicates is a ConfigError naming the flag,
                                           an absent one a note (Megatron-LM's defaults: allgather, p2p)
--overlap-grad-reduce,                   training.overlap_grad_reduce / overlap_param_gather with none / zero1
  --overlap-param-gather                   (Megatron-LM's DDP buffers); written with Megatron FSDP (zero2; zero3
                                           both), which forces them and the step models
--ddp-bucket-size                        memory.grad_bucket_elements with none / zero1 and --overlap-grad-reduce
                                           (Megatron-LM's DDP buckets; unset max(40e6, 1e6 x dp)); elsewhere a note
                                           (Megatron-LM's DDP ignores it without overlap, Megatron FSDP sizes its
                                           communication units by it, which meshplan does not model)
--max-position-embeddings                written as max(model.max_position, --seq-length) (Megatron-LM's assertion)
--moe-expert-capacity-factor,            training.moe_capacity_factor; absent or < 0: moe_dropless (Megatron-LM's
  --moe-pad-expert-input-to-capacity       default); meshplan plans the padded E x C buffer (without the padding
                                           flag Megatron-LM sends only the routed copies: a note says so)
--no-bias-swiglu-fusion (with --swiglu)  memory.fused_glu false (unset: Megatron-LM's fused bias-SwiGLU, the
                                           default of framework megatron)
--hidden-dropout, --attention-dropout    memory.dropout: on unless both are 0.0 (Megatron-LM's TransformerConfig:
  (default 0.1 each)                       0.1 each); meshplan has one switch for both (the residual and
                                           embedding masks, and the attention-score mask of non-flash attention)
--clip-grad (default 1.0)                training.grad_clip (0: false, no norm computed)
(Megatron-LM's own linears)              training.framework megatron (its backward order)
--num-layers, --hidden-size, ...         the model, field by field (or --model); --rotary-base and --norm-epsilon
                                           are model.rope_theta and norm_eps, --use-rope-scaling (factor
                                           --rope-scaling-factor) model.rope_scaling (unset: a catalog model still
                                           matches, with a note naming Megatron-LM's default where it differs)
======================================== ===================================================
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from meshplan import catalog
from meshplan.config import Config
from meshplan.errors import ConfigError, printable
from meshplan.interop.common import Imported, ImportOptions, cluster_table, model_is_moe, model_layers, near_miss
from meshplan.interop.launch import parse_launch
from meshplan.interop.megatron_model import MODEL_FLAGS, int_flag as _int, model_flags, model_table, num_flag as _num
from meshplan.interop.tomlout import mesh_spec, resolved, virtual_split
from meshplan.spec.axes import MEGATRON_AXES

#: Flags that take no value (store_true in arguments.py), so the next token is not theirs.
SWITCHES = {"--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", "--sequence-parallel", "--use-distributed-optimizer", "--recompute-activations", "--bf16", "--fp16",
            "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention", "--disable-bias-linear",
            "--add-qkv-bias", "--qk-layernorm", "--use-flash-attn", "--accumulate-allreduce-grads-in-fp32",
            "--tp-comm-overlap", "--use-torch-fsdp2", "--use-megatron-fsdp", "--overlap-grad-reduce",
            "--overlap-param-gather", "--use-mcore-models", "--no-masked-softmax-fusion", "--standalone",
            "--multi-latent-attention", "--grad-reduce-in-bf16", "--no-bias-swiglu-fusion",
            "--moe-pad-expert-input-to-capacity", "--use-rope-scaling"}
PARALLEL = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
            "--context-parallel-size": "cp", "--expert-model-parallel-size": "ep",
            "--expert-tensor-parallel-size": "etp"}
USED = set(PARALLEL) | MODEL_FLAGS | {
    "--sequence-parallel", "--use-distributed-optimizer", "--use-torch-fsdp2", "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy", "--recompute-activations", "--recompute-granularity", "--recompute-method",
    "--recompute-num-layers", "--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
    "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers", "--micro-batch-size",
    "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
    "--global-batch-size", "--seq-length", "--bf16", "--fp16", "--fp8-format", "--accumulate-allreduce-grads-in-fp32",
    "--tp-comm-overlap", "--make-vocab-size-divisible-by", "--use-flash-attn", "--nnodes", "--grad-reduce-in-bf16",
    "--clip-grad", "--hidden-dropout", "--attention-dropout", "--no-bias-swiglu-fusion",
    "--moe-expert-capacity-factor", "--moe-pad-expert-input-to-capacity", "--moe-token-dispatcher-type",
    "--cp-comm-type", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size"}
#: What meshplan plans for the expert dispatch (an all-to-all over ep) and for context parallelism
#: (the K/V all-gather), as Megatron-LM spells them: ``--moe-token-dispatcher-type`` (choices
#: allgather, alltoall, flex; default allgather) and ``--cp-comm-type`` (p2p, all_gather, a2a,
#: a2a+p2p; default p2p): TransformerConfig ``moe_token_dispatcher_type`` and ``cp_comm_type``,
#: megatron/core/transformer/transformer_config.py, and arguments.py ``--cp-comm-type`` at d98e8a6.
PLANNED_DISPATCHER, PLANNED_CP = "alltoall", "all_gather"
#: What each other value runs instead, for the one-line refusal.
DISPATCHERS = {"allgather": "all-gathers every token over tp x ep and keeps its experts' copies",
               "flex": "runs DeepEP's or HybridEP's fused dispatch kernels"}
CP_TYPES = {"p2p": "passes K/V chunks around a ring, overlapped with attention",
            "a2a": "scatters the heads over cp (DeepSpeed Ulysses's all-to-all)",
            "a2a+p2p": "runs Ulysses all-to-all inside and a K/V ring across cp groups"}
#: The overlap flags a Megatron FSDP export writes per --data-parallel-sharding-strategy: what the plan
#: assumes and ``MegatronFSDP.__init__`` forces anyway (:func:`meshplan.schedule.steptime.config_overlap`).
FSDP_OVERLAP = {"optim_grads": ["--overlap-grad-reduce"],
                "optim_grads_params": ["--overlap-grad-reduce", "--overlap-param-gather"]}
#: Megatron-LM's dropout flags and their default probability (TransformerConfig ``hidden_dropout`` and
#: ``attention_dropout``, 0.1 each, at d98e8a6).
DROPOUT = {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}
#: Megatron-LM flags (its parser at d98e8a6: 877 flags) within three edits of a flag meshplan reads, so
#: never taken for a misspelling of it (``--vocab-file`` is two edits from ``--vocab-size``).
NEAR_FLAGS = {"--fp4-format", "--vocab-file", "--ckpt-format", "--moe-router-dtype", "--num-channels"}
SHARDING = {"no_shard": "none", "optim": "zero1", "optim_grads": "zero2", "optim_grads_params": "zero3"}


def parse_args(text: str) -> dict[str, Any]:
    """Megatron-LM's ``--flag value`` pairs of an arguments file or launch script (module
    docstring); a switch maps to True; the last occurrence wins.

    >>> parse_args("--tensor-model-parallel-size 4 --bf16 --seq-length=4096 --lr 1e-4")
    {'--tensor-model-parallel-size': '4', '--bf16': True, '--seq-length': '4096', '--lr': '1e-4'}
    """
    return parse_launch(text, SWITCHES)[0]


def _clip(args: dict) -> bool:
    """``--clip-grad`` (default 1.0): Megatron-LM's optimizer computes the gradient norm and
    clips only when it is > 0 (``optimizer.py``: ``if self.clip_grad > 0.0``)."""
    v = args.get("--clip-grad")
    if v is None:
        return True
    if v is True:
        raise ConfigError("--clip-grad", "needs a value (Megatron-LM's parser refuses it bare): the norm to clip "
                          "to, or 0 for no clipping")
    try:
        return float(v) > 0.0
    except (TypeError, ValueError):
        raise ConfigError("--clip-grad", f"{v!r} is not a number; give the norm to clip to, or 0 for no "
                          f"clipping") from None


def _check_positions(model: dict, seq: int, flag: str, notes: list[str]) -> None:
    """Megatron-LM asserts ``max_position_embeddings >= seq_length`` (arguments.py). With
    learned positions the table has that many rows, so a longer sequence is a ConfigError
    naming both; with RoPE the plan holds (no table) and a note says Megatron-LM refuses it."""
    spec = model if "catalog" not in model and "hf_config" not in model else None
    if spec is None:
        m = catalog.model(model["catalog"]) if "catalog" in model else None
        if m is None:
            return  # a Hugging Face config: its max_position is not Megatron-LM's flag
        pos, rows = m.position_embedding, m.max_position
    else:
        pos, rows = spec.get("position_embedding", "rope"), spec.get("max_position", 0)
    if not rows or seq <= rows:
        return
    if pos == "learned":
        raise ConfigError(flag, f"{seq} is more than --max-position-embeddings {rows}, the rows of the learned "
                          f"position table (Megatron-LM asserts max_position_embeddings >= seq_length); raise "
                          f"--max-position-embeddings or shorten the sequence")
    notes.append(f"{flag} {seq} is more than --max-position-embeddings {rows}: planned (RoPE has no table), but "
                 f"Megatron-LM asserts max_position_embeddings >= seq_length; raise it to run")


def _dropout(args: dict, notes: list[str]) -> bool:
    """``[memory] dropout`` from ``--hidden-dropout`` and ``--attention-dropout`` (default 0.1
    each, :data:`DROPOUT`): on unless both are 0.0. meshplan has one switch for both; when one
    is 0.0 and the other not, a note says both are planned on. ConfigError naming the flag
    for a value that is not a probability in [0, 1).

    >>> _dropout({}, []), _dropout({"--hidden-dropout": "0.0", "--attention-dropout": "0"}, [])
    (True, False)
    """
    p = {}
    for flag, default in DROPOUT.items():
        v = args.get(flag, default)
        try:
            p[flag] = float(v)
        except (TypeError, ValueError):
            p[flag] = -1.0
        if not 0.0 <= p[flag] < 1.0:
            raise ConfigError(flag, f"{printable(str(v))[:40]!r} is not a dropout probability; give a number in "
                              f"[0, 1) (0.0: no dropout)")
    on = [f for f, v in p.items() if v > 0.0]
    if len(on) == 1:
        off = next(f for f in p if f not in on)
        notes.append(f"{off} 0.0 but {on[0]} {p[on[0]]}: meshplan has one dropout switch ([memory] dropout), "
                     f"planned on for both")
    return bool(on)


def _routing(args: dict, notes: list[str]) -> dict:
    """MoE routing keys of [training] from ``--moe-expert-capacity-factor`` (Megatron-LM's
    TransformerConfig: None, the default, or a negative value is dropless; else tokens over
    ``C = ceil(f x tokens x top_k / experts)`` per expert are dropped). Without
    ``--moe-pad-expert-input-to-capacity`` Megatron-LM sends only the routed copies (at most C
    per expert), while meshplan plans the padded ``E x C`` buffer: a note says so.

    >>> _routing({}, []), _routing({"--moe-expert-capacity-factor": "1.25",
    ...                             "--moe-pad-expert-input-to-capacity": True}, [])
    ({'moe_dropless': True}, {'moe_capacity_factor': 1.25})
    """
    v = args.get("--moe-expert-capacity-factor")
    if v is None:
        return {"moe_dropless": True}
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ConfigError("--moe-expert-capacity-factor", f"{printable(str(v))[:40]!r} is not a number; give the "
                          f"capacity factor (e.g. 1.25), or leave it out for dropless routing") from None
    if f < 0:
        return {"moe_dropless": True}
    if f == 0 or f != f or f == float("inf"):
        raise ConfigError("--moe-expert-capacity-factor", f"{printable(str(v))[:40]!r} leaves no capacity; give a "
                          f"factor > 0 (e.g. 1.25), or leave it out for dropless routing")
    if not args.get("--moe-pad-expert-input-to-capacity"):
        notes.append(f"--moe-expert-capacity-factor {v} without --moe-pad-expert-input-to-capacity: Megatron-LM "
                     f"sends only the routed copies (at most the capacity per expert); planned with the padded "
                     f"experts x capacity buffer, an upper bound")
    return {"moe_capacity_factor": f}


def _comm_types(args: dict, deg: dict[str, int], moe: bool, notes: list[str]) -> None:
    """``--moe-token-dispatcher-type`` and ``--cp-comm-type`` against what meshplan plans
    (:data:`PLANNED_DISPATCHER`, :data:`PLANNED_CP`): another value where it communicates (a
    MoE model with ep x etp > 1; cp > 1) is a ConfigError naming the flag; absent, a note says
    that Megatron-LM's default differs and what is planned. Of a per-layer ``--cp-comm-type``
    list the first value is read."""
    _planned_flag(args, "--moe-token-dispatcher-type", PLANNED_DISPATCHER, DISPATCHERS,
                  moe and deg["ep"] * deg["etp"] > 1,
                  ("allgather, alltoall or flex", "the all-to-all dispatch meshplan plans", "alltoall",
                   "the all-to-all dispatch over ep"), notes)
    _planned_flag(args, "--cp-comm-type", PLANNED_CP, CP_TYPES, deg["cp"] > 1,
                  ("p2p, all_gather, a2a or a2a+p2p", "the K/V all-gather meshplan plans", "the K/V all-gather",
                   "the K/V all-gather of Llama 3's context parallelism"), notes)


def _planned_flag(args: dict, flag: str, planned: str, others: dict[str, str], active: bool,
                  words: tuple[str, str, str, str], notes: list[str]) -> None:
    """One of :func:`_comm_types`' flags: a value that is neither ``planned`` nor one of
    ``others`` (Megatron-LM's choices, its default first, each with what it runs) is a
    ConfigError; where the flag communicates (``active``) another known value is one too, and
    an absent flag a note. ``words``: (Megatron-LM's choices, what meshplan plans, planned as,
    what meshplan plans in full)."""
    choices, plans, planned_as, plans_full = words
    v = args.get(flag)
    if v is not None and v not in (planned, *others):
        raise ConfigError(flag, f"{printable(str(v))[:40]!r} is not {choices}; give {planned} ({plans})")
    if not active:
        return
    if v is None:
        default = next(iter(others))
        notes.append(f"{flag} not given: Megatron-LM's default {default} ({others[default]}); planned as "
                     f"{planned_as}: add {flag} {planned}")
    elif v != planned:
        raise ConfigError(flag, f"{v} {others[v]}, which meshplan does not model (it plans {plans_full}); "
                          f"use {flag} {planned}")


def _overlap_flags(args: dict, sharding: str) -> dict[str, bool]:
    """``--overlap-grad-reduce`` / ``--overlap-param-gather``: with DDP buffers (none, zero1)
    ``training.overlap_grad_reduce`` / ``overlap_param_gather``; under Megatron FSDP (zero2,
    zero3) forced on anyway and planned so (:func:`meshplan.schedule.steptime.config_overlap`):
    no key. What Megatron-LM's ``arguments.py`` asserts (d98e8a6 lines 1024-1029) is refused:
    ``--overlap-param-gather`` without ``--overlap-grad-reduce``, or without the distributed
    optimizer (or Megatron FSDP)."""
    grad, param = bool(args.get("--overlap-grad-reduce")), bool(args.get("--overlap-param-gather"))
    if param and not grad:
        raise ConfigError("--overlap-param-gather", "given without --overlap-grad-reduce, which Megatron-LM asserts "
                          "('Must use --overlap-param-gather with --overlap-grad-reduce'): add it or remove the flag")
    if param and sharding == "none":
        raise ConfigError("--overlap-param-gather", "needs --use-distributed-optimizer (or Megatron FSDP), as "
                          "Megatron-LM asserts: add it or remove the flag")
    if sharding not in ("none", "zero1"):
        return {}
    keys = {"overlap_grad_reduce": grad, "overlap_param_gather": param}
    return {k: True for k, on in keys.items() if on}


def _bucket(args: dict, training: dict, notes: list[str]) -> dict[str, int]:
    """``[memory] grad_bucket_elements`` from ``--ddp-bucket-size`` (arguments.py:3125 at
    d98e8a6, ``DistributedDataParallelConfig.bucket_size``: elements per bucket). Megatron-LM's
    DDP uses it only under ``--overlap-grad-reduce``, its default ``max(40e6, 1e6 x dp)``, and
    sets it to None without (one bucket; ``DistributedDataParallel.__init__``,
    megatron/core/distributed/distributed_data_parallel.py:131-137 at d98e8a6): read with
    none / zero1 and ``training.overlap_grad_reduce``, where meshplan plans those buckets
    (:func:`meshplan.comm.collectives._megatron_bucket_rows`); elsewhere a note says why not."""
    size = _int(args, "--ddp-bucket-size")
    if size is None:
        return {}
    if training["sharding"] not in ("none", "zero1"):
        notes.append(f"--ddp-bucket-size {size} not planned: Megatron FSDP ({training['sharding']}) takes it as its "
                     f"communication-unit size, which meshplan does not model (it plans one layer per FSDP unit)")
        return {}
    if not training.get("overlap_grad_reduce"):
        notes.append(f"--ddp-bucket-size {size} not planned: without --overlap-grad-reduce Megatron-LM's DDP ignores "
                     f"it (one bucket, reduced after the backward)")
        return {}
    return {"grad_bucket_elements": size}


def _nnodes(args: dict, opts: ImportOptions, notes: list[str]) -> Optional[int]:
    """torchrun's ``--nnodes`` of a launch script (None when absent or ``--nodes`` is
    given: then a note when they differ); an elastic range or an unresolved variable asks
    for ``--nodes``."""
    v = args.get("--nnodes")
    if v is None:
        return None
    if opts.nodes is not None:
        if str(v) != str(opts.nodes):
            notes.append(f"--nodes {opts.nodes} used; the launch script's --nnodes {v} is not")
        return None
    if not (str(v).isascii() and str(v).isdigit() and len(str(v)) <= 9) or int(v) < 1:
        raise ConfigError("--nodes", f"the launch script's --nnodes is {v!r}, not a node count; give --nodes N")
    return int(v)


def _sharding(args: dict) -> str:
    if args.get("--use-torch-fsdp2") or args.get("--use-megatron-fsdp"):
        strategy = str(args.get("--data-parallel-sharding-strategy", "optim_grads_params"))
        if strategy not in SHARDING:
            raise ConfigError("--data-parallel-sharding-strategy", f"{strategy!r}; use {', '.join(SHARDING)}")
        return SHARDING[strategy]
    return "zero1" if args.get("--use-distributed-optimizer") else "none"


def _recompute(args: dict, layers_per_stage: int, notes: list[str]) -> str:
    gran = args.get("--recompute-granularity", "selective" if args.get("--recompute-activations") else None)
    if gran is None:
        return "none"
    if gran not in ("full", "selective"):
        raise ConfigError("--recompute-granularity", f"{gran!r}; use full or selective")
    n = _int(args, "--recompute-num-layers")
    method = args.get("--recompute-method")
    if gran == "full" and method == "block" and n is not None and n < layers_per_stage:
        notes.append(f"--recompute-method block --recompute-num-layers {n} recomputes {n} of {layers_per_stage} "
                     f"layers per stage; planned as full recompute of every layer")
    return gran


def _pipeline(args: dict, pp: int, layers: int) -> dict:
    if pp == 1:
        return {}
    per_chunk, vstages = _int(args, "--num-layers-per-virtual-pipeline-stage"), \
        _int(args, "--num-virtual-stages-per-pipeline-rank")
    first, last = _int(args, "--decoder-first-pipeline-num-layers"), _int(args, "--decoder-last-pipeline-num-layers")
    out: dict[str, Any] = {}
    split = None
    if first is not None or last is not None:
        middle = pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if middle < 0 or (middle and rest % middle) or (not middle and rest):
            raise ConfigError("--decoder-first-pipeline-num-layers", f"{layers} layers less first {first} and last "
                              f"{last} do not divide evenly over the other {middle} stages")
        even = rest // middle if middle else 0
        split = [first if first is not None else even] + [even] * (pp - 2) + [last if last is not None else even]
        out["pp_layer_split"] = split
    vpp = vstages or 1
    if per_chunk:
        stage = layers // pp
        if split is not None or layers % pp or stage % per_chunk:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage", f"{per_chunk} does not divide the "
                              f"{layers} layers / pp {pp} per stage")
        vpp = stage // per_chunk
    if split is not None and vpp > 1 and any(n % vpp for n in split):
        # Megatron-Core's TransformerConfig: each stage's layers a multiple of the virtual stages
        raise ConfigError("--decoder-first-pipeline-num-layers", f"layers per stage {split} with {vpp} virtual "
                          f"stages per rank: Megatron-LM needs each a multiple of {vpp}")
    accounted = [f for f in ACCOUNT if args.get(f)]
    if accounted:
        if len(accounted) == 1 or split is not None:
            raise ConfigError(accounted[0], "meshplan reads --account-for-embedding-in-pipeline-split and "
                              "--account-for-loss-in-pipeline-split together, without --decoder-first/last-pipeline-"
                              "num-layers")
        virtual = accounted_split(layers, pp, vpp)
        if isinstance(virtual, str):
            raise ConfigError(accounted[0], virtual)
        out["pp_layer_split"] = virtual
    if vpp > 1:
        out |= {"virtual_stages": vpp, "pp_schedule": "interleaved_1f1b"}
    return out


#: Megatron-LM's switches that count the embedding and the loss as a layer each in the split.
ACCOUNT = ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split")


def accounted_split(layers: int, pp: int, vpp: int):
    """Layers per virtual stage (``chunk * pp + stage``) under both of Megatron-LM's
    ``--account-for-embedding-in-pipeline-split`` and ``--account-for-loss-in-pipeline-split``:
    (layers + 2) / (pp x vpp) slots each, the embedding taking one of the first virtual stage's
    and the loss one of the last's (Megatron-Core TransformerConfig: layers + 2 a multiple of
    pp, and of vpp per rank); a one-line reason otherwise. At one slot the first virtual stage
    builds no transformer layer (the embedding alone) and the last none (the loss alone):
    ``get_num_layers_to_build``, megatron/core/transformer/transformer_block.py:188-202@d98e8a6.
    Llama 3 405B at pp 16, vpp 2 and vpp 8:

    >>> s = accounted_split(126, 16, 2); s[:2], s[-2:], len(s)
    ([3, 4], [4, 3], 32)
    >>> s = accounted_split(126, 16, 8); s[:2], s[-2:], len(s)
    ([0, 1], [1, 0], 128)
    >>> accounted_split(32, 4, 2)
    '32 layers + embedding + loss = 34 are not a multiple of pp 4 x vpp 2'
    """
    slots, left = divmod(layers + 2, pp * vpp)
    if left or slots < 1:
        return f"{layers} layers + embedding + loss = {layers + 2} are not a multiple of pp {pp} x vpp {vpp}"
    if slots == 1 and vpp == 1:  # the first stage would hold the embedding alone
        return (f"{layers} layers + embedding + loss = {layers + 2} over pp {pp} is 1 per stage: the first and "
                f"last stage would hold no layer, which meshplan does not model (a virtual stage may)")
    return [slots - 1] + [slots] * (pp * vpp - 2) + [slots - 1]


def read(text: str, opts: ImportOptions) -> Imported:
    """meshplan tables of Megatron-LM arguments (module docstring)."""
    repeated: dict[str, list[Any]] = {}
    args, launcher = parse_launch(text, SWITCHES, repeated)
    bare = {f[2:] for f in USED}
    for flag in args:
        hit = None if flag in USED or flag in NEAR_FLAGS else near_miss(flag[2:], bare)
        if hit is not None:
            raise ConfigError(flag, f"not a Megatron-LM flag (its parser refuses it); did you mean --{hit}? "
                              f"(meshplan reads that one: misspelt, the setting would stay at its default)")
    notes = [f"{flag} given {len(vals)} times ({', '.join(map(str, vals))}): planned with the last, "
             f"{vals[-1]}, as Megatron-LM's argparse keeps it" for flag, vals in repeated.items() if len(set(vals)) > 1]
    model = model_table(args, opts, notes)
    cluster, world = cluster_table(opts, "Megatron-LM", _nnodes(launcher | args, opts, notes))
    deg = {axis: _num(args, flag, 1) for flag, axis in PARALLEL.items()}
    if "--expert-tensor-parallel-size" not in args:
        deg["etp"] = deg["tp"] if deg["ep"] > 1 else 1  # Megatron: expert tp defaults to tp
    dense = deg["tp"] * deg["cp"] * deg["pp"]
    if world % dense:
        raise ConfigError("--tensor-model-parallel-size", f"tp({deg['tp']}) * cp({deg['cp']}) * pp({deg['pp']}) = "
                          f"{dense} does not divide world {world} (Megatron-LM's rule, dp = world / (tp*cp*pp)); "
                          f"give --nodes so that the world is a multiple of {dense}")
    dp = world // dense
    layers = model_layers(model)
    names = [a for a in ("pp", "dp", "cp", "tp", "ep", "etp") if a == "dp" or (deg[a] > 1)]
    mesh: dict[str, Any] = {"names": names, "shape": [dp if a == "dp" else deg[a] for a in names],
                            "sequence_parallel": bool(args.get("--sequence-parallel"))}
    mesh |= _pipeline(args, deg["pp"], layers)
    micro = _num(args, "--micro-batch-size", 1)
    seq = opts.seq_len or _int(args, "--seq-length")
    if seq is None:
        raise ConfigError("--seq-length", "not in the arguments; add it or give --seq-len")
    if opts.seq_len and "--seq-length" in args:
        notes.append(f"--seq-len {opts.seq_len} replaces --seq-length {args['--seq-length']}")
    if args.get("--bf16") and args.get("--fp16"):  # arguments.py: assert not args.bf16 (and the reverse)
        raise ConfigError("--fp16", "given with --bf16; Megatron-LM refuses both (arguments.py asserts one dtype): "
                          "keep one")
    _check_positions(model, seq, "--seq-len" if opts.seq_len else "--seq-length", notes)
    fp8 = bool(args.get("--fp8-format"))  # Transformer Engine's fp8 runs beside --bf16 (or --fp16)
    dtype = "fp16" if args.get("--fp16") else "bf16" if args.get("--bf16") or fp8 else "fp32"
    training = {"global_batch": _num(args, "--global-batch-size", micro * dp), "seq_len": seq, "micro_batch": micro,
                "sharding": _sharding(args), "recompute": _recompute(args, layers // deg["pp"], notes),
                "param_dtype": dtype, "compute_dtype": dtype, **({"linear_dtype": "fp8"} if fp8 else {}),
                "grad_reduce_dtype": "fp32" if args.get("--accumulate-allreduce-grads-in-fp32") or (
                    dtype == "bf16" and not args.get("--grad-reduce-in-bf16")) else "param",
                "tp_comm_overlap": bool(args.get("--tp-comm-overlap")), "framework": "megatron",
                "vocab_pad_divisor": _num(args, "--make-vocab-size-divisible-by", 128), "grad_clip": _clip(args)}
    if model_is_moe(model):
        training |= _routing(args, notes)
    _comm_types(args, deg, model_is_moe(model), notes)
    training |= _overlap_flags(args, str(training["sharding"]))
    if dtype != "fp32" and not args.get("--use-flash-attn"):
        notes.append("--use-flash-attn not given: planned with flash attention (Transformer Engine's fused "
                     "attention, Megatron-Core's default)")
    unused = tuple(k for k in args if k not in USED)
    memory: dict[str, Any] = {"dropout": True} if _dropout(args, notes) else {}
    memory |= _bucket(args, training, notes)
    if args.get("--no-bias-swiglu-fusion") and args.get("--swiglu"):
        memory["fused_glu"] = False  # unset: fused, Megatron-LM's default (MemoryOptions.fused_glu)
    tables = {"model": model, "cluster": cluster, "training": training, "mesh": mesh}
    tables |= {"memory": memory} if memory else {}
    return Imported("megatron", tables, unused, tuple(notes))


def write(cfg: Config) -> list[str]:
    """Megatron-LM arguments of ``cfg``, one flag (with its value) per item (the inverse of
    :func:`read`). ConfigError naming what Megatron-LM cannot express: a mesh order other
    than tp-cp-ep-dp-pp, a layer split other than first/last stage and even middle."""
    mesh = resolved(cfg)
    t, m = cfg.training, cfg.model
    axes = list(mesh.layout.names)
    data = [a for a in axes if a in ("dp", "dp_shard", "dp_replicate")]
    if len(data) > 1 or t.sharding == "hsdp":
        raise ConfigError("--to", f"Megatron-LM has one data-parallel axis; the mesh has {data} ({t.sharding})")
    axes = ["dp" if a in data else a for a in axes]
    stray = [a for a in axes if a not in MEGATRON_AXES]
    if stray:
        raise ConfigError("--to", f"Megatron-LM has no axis {stray[0]!r}")
    if axes != [a for a in ("pp", "dp", "cp", "tp") if a in axes]:
        raise ConfigError("--to", f"mesh order {axes} is not Megatron-LM's tp-cp-ep-dp-pp (outermost first pp, dp, "
                          f"cp, tp); reorder the mesh to export it")
    deg = {a: mesh.layout.degree(b) for a, b in zip(axes, mesh.layout.names)}
    out = model_flags(m, t.seq_len)
    out += [f"--tensor-model-parallel-size {deg.get('tp', 1)}", f"--pipeline-model-parallel-size {deg.get('pp', 1)}",
            f"--context-parallel-size {deg.get('cp', 1)}"]
    if mesh.ep > 1:
        out += [f"--expert-model-parallel-size {mesh.ep}", f"--expert-tensor-parallel-size {mesh.etp}"]
    out += [f"--moe-token-dispatcher-type {PLANNED_DISPATCHER}"] * m.is_moe
    out += [f"--cp-comm-type {PLANNED_CP}"] * (deg.get("cp", 1) > 1)
    out += ["--sequence-parallel"] * mesh_spec(cfg).sequence_parallel
    out += _write_pipeline(cfg, mesh)
    out += _write_sharding(t.sharding)
    out += ["--overlap-grad-reduce"] * t.overlap_grad_reduce + ["--overlap-param-gather"] * t.overlap_param_gather
    bucket = cfg.memory.grad_bucket_elements
    out += [f"--ddp-bucket-size {bucket}"] * bool(bucket and t.overlap_grad_reduce and t.sharding in ("none", "zero1"))
    if t.recompute in ("layer", "op"):
        what = f"every {t.ac_freq}-th layer in full" if t.recompute == "layer" else "op-level SAC"
        raise ConfigError("--to", f"Megatron-LM has no flag for torchtitan's recompute {t.recompute!r} ({what}; "
                          f"--recompute-method block recomputes the first n layers of each stage): set "
                          f"training.recompute to full or selective")
    if t.recompute != "none":
        out.append(f"--recompute-granularity {t.recompute}")
        out += ["--recompute-method uniform", "--recompute-num-layers 1"] if t.recompute == "full" else []
    out += [f"--micro-batch-size {t.micro_batch}", f"--global-batch-size {t.global_batch}",
            f"--seq-length {t.seq_len}", f"--make-vocab-size-divisible-by {t.vocab_pad_divisor}"]
    out += {"bf16": ["--bf16"], "fp16": ["--fp16"]}.get(t.compute_dtype, [])
    out += ["--fp8-format hybrid"] * (t.linear_dtype == "fp8")
    out += ["--accumulate-allreduce-grads-in-fp32"] * (t.gradient_reduce_dtype == "fp32")
    # Megatron-LM reduces bf16 runs' gradients in fp32 unless told otherwise
    out += ["--grad-reduce-in-bf16"] * (t.gradient_reduce_dtype == "bf16" and "--bf16" in out)
    out += ["--tp-comm-overlap"] * t.tp_comm_overlap + ["--use-flash-attn"] * t.flash_attention
    out += ["--clip-grad 0"] * (not t.grad_clip)  # Megatron-LM's default 1.0 clips
    # Megatron-LM's default dropout is 0.1 (:data:`DROPOUT`): a plan without dropout says 0.0
    out += [] if cfg.memory.dropout else [f"{flag} 0.0" for flag in DROPOUT]
    out += ["--no-bias-swiglu-fusion"] * (m.gated_mlp and cfg.memory.fused_glu is False)
    factor, dropless = t.moe_routing
    if m.is_moe and not dropless:  # Megatron-LM's default (and a plan's unset routing) is dropless
        out += [f"--moe-expert-capacity-factor {factor!r}", "--moe-pad-expert-input-to-capacity"]
    return out


def _write_sharding(sharding: str) -> list[str]:
    """Megatron-LM's flags of ``training.sharding``; zero2 and zero3 with the overlap flags the
    plan assumes (:data:`FSDP_OVERLAP`), which Megatron FSDP turns on for them anyway."""
    if sharding in ("none", "zero1"):
        return ["--use-distributed-optimizer"] * (sharding == "zero1")
    strategy = {v: k for k, v in SHARDING.items()}[sharding]
    return ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {strategy}", *FSDP_OVERLAP[strategy]]


def write_notes(cfg: Config) -> list[str]:
    """Header lines of a Megatron-LM export: ``--max-position-embeddings`` raised to the
    sequence length (Megatron-LM asserts ``max_position_embeddings >= seq_length``) when the
    model's ``max_position`` is shorter. (An MoE plan's routing needs none: unset it is
    dropless, Megatron-LM's own default, :attr:`~meshplan.spec.training.TrainingSpec.moe_routing`,
    and :func:`write` writes the capacity factor of a plan that drops tokens.)"""
    m, seq = cfg.model, cfg.training.seq_len
    out = []
    if m.max_position and seq > m.max_position:
        out.append(f"--max-position-embeddings {seq}: raised from model {m.name}'s max_position {m.max_position} to "
                   f"--seq-length (Megatron-LM asserts max_position_embeddings >= seq_length)")
    return out


def exported_model(cfg: Config) -> Config:
    """``cfg`` as a Megatron-LM export gives it back: its model's ``max_position`` raised to the
    sequence length (:func:`write_notes`), which the re-import check compares against."""
    m, seq = cfg.model, cfg.training.seq_len
    if not m.max_position or seq <= m.max_position:
        return cfg
    return replace(cfg, model=m.model_copy(update={"max_position": seq}))


def _write_pipeline(cfg: Config, mesh) -> list[str]:
    split = virtual_split(cfg, mesh)
    if split is None:
        return []
    pp, vpp = mesh.degree("pp"), mesh_spec(cfg).virtual_stages
    if str(mesh_spec(cfg).pp_schedule) not in ("1f1b", "interleaved_1f1b"):
        raise ConfigError("--to", f"Megatron-LM runs 1F1B (interleaved with virtual stages); schedule "
                          f"{mesh_spec(cfg).pp_schedule} has no flag")
    if vpp > 1:
        if len(set(split)) == 1:
            return [f"--num-layers-per-virtual-pipeline-stage {split[0]}"]
        if split == accounted_split(cfg.model.layers, pp, vpp):  # Llama 3's: the ends counted as layers
            return [f"--num-virtual-stages-per-pipeline-rank {vpp}", *ACCOUNT]
        stages = [[split[c * pp + k] for c in range(vpp)] for k in range(pp)]
        if any(len(set(ch)) > 1 for ch in stages):
            raise ConfigError("--to", f"virtual stages {split} differ within a stage: Megatron-LM's "
                              f"--decoder-first/last-pipeline-num-layers need each stage's layers a multiple of "
                              f"vpp {vpp} (Megatron-Core TransformerConfig), and its --account-for-embedding/loss-"
                              f"in-pipeline-split needs (layers + 2) / (pp x vpp) per virtual stage; meshplan does "
                              f"not write --pipeline-model-parallel-layout")
        split = [sum(ch) for ch in stages]
        return [f"--num-virtual-stages-per-pipeline-rank {vpp}"] + _first_last(split)
    return _first_last(split)


def _first_last(split: list[int]) -> list[str]:
    """``--decoder-first/last-pipeline-num-layers`` of layers per stage ``split``, or ConfigError."""
    middle = split[1:-1]
    if len(set(middle)) > 1:
        raise ConfigError("--to", f"layer split {split}: Megatron-LM sets the first and last stage and spreads the "
                          f"rest evenly; the middle stages differ")
    even = middle[0] if middle else None
    return ([f"--decoder-first-pipeline-num-layers {split[0]}"] if split[0] != even else []) + \
        ([f"--decoder-last-pipeline-num-layers {split[-1]}"] if split[-1] != even else [])
