"""Megatron-LM's training and memory flags, one (or one pair) at a time, read into meshplan's
[training] and [memory] keys, with the values meshplan plans and Megatron-LM's defaults;
:func:`meshplan.interop.megatron.read` assembles them (the flag table is its module
docstring) and :mod:`~meshplan.interop.megatron_write` writes them back. Flag names and
defaults from ``megatron/training/arguments.py`` and ``TransformerConfig`` at
NVIDIA/Megatron-LM d98e8a6.
"""

from __future__ import annotations

import math

from meshplan import catalog
from meshplan.errors import ConfigError, printable
from meshplan.interop.megatron_dispatch import dispatcher, grouped_note, is_deepep, overlap_note
from meshplan.interop.megatron_model import int_flag as _int

#: Megatron-LM's parallel-size flags -> meshplan's axes (arguments.py at d98e8a6); dp has none: Megatron-LM
#: infers it as world / (tp x cp x pp).
PARALLEL = {"--tensor-model-parallel-size": "tp", "--pipeline-model-parallel-size": "pp",
            "--context-parallel-size": "cp", "--expert-model-parallel-size": "ep",
            "--expert-tensor-parallel-size": "etp"}
#: ``--cp-comm-type`` (p2p, all_gather, a2a, a2a+p2p; default p2p: TransformerConfig ``cp_comm_type`` and
#: arguments.py ``--cp-comm-type`` at d98e8a6) -> ``training.cp_attention`` for the values meshplan plans:
#: Transformer Engine's p2p ring and its all-gather CP. The MoE dispatcher's flags:
#: :mod:`meshplan.interop.megatron_dispatch`.
CP_COMM = {"p2p": "p2p", "all_gather": "allgather"}
#: What each other value runs, for the one-line refusal.
CP_TYPES = {"a2a": "scatters the heads over cp (DeepSpeed Ulysses's all-to-all)",
            "a2a+p2p": "runs Ulysses all-to-all inside and a K/V ring across cp groups"}
#: The overlap flags a Megatron FSDP export writes per --data-parallel-sharding-strategy: what the plan
#: assumes and ``MegatronFSDP.__init__`` forces anyway (:func:`meshplan.schedule.steptime.config_overlap`).
FSDP_OVERLAP = {"optim_grads": ["--overlap-grad-reduce"],
                "optim_grads_params": ["--overlap-grad-reduce", "--overlap-param-gather"]}
#: Megatron-LM's dropout flags and their default probability (TransformerConfig ``hidden_dropout`` and
#: ``attention_dropout``, 0.1 each, at d98e8a6).
DROPOUT = {"--hidden-dropout": 0.1, "--attention-dropout": 0.1}
#: Megatron FSDP's switch at d98e8a6 (``use_megatron_fsdp``, megatron/training/config/common_config.py:92)
#: and its name before af28b5a (2025-08-21, "Decouple Custom FSDP"), which renamed ``--use-custom-fsdp``;
#: d98e8a6 keeps ``use_custom_fsdp`` only as a deprecated DistributedDataParallelConfig field it sets itself.
FSDP_FLAGS = ("--use-megatron-fsdp", "--use-custom-fsdp")
#: The checkpoint format Megatron FSDP requires: arguments.py at NVIDIA/Megatron-LM d98e8a6, lines
#: 1169-1170, ``assert args.ckpt_format == "fsdp_dtensor"`` ("Megatron-FSDP requires the `fsdp_dtensor`
#: checkpointing format") under ``--use-megatron-fsdp``; lines 1675-1676 assert the converse. The default
#: is ``torch_dist`` (training_config.py:486), which ``--use-torch-fsdp2`` accepts (arguments.py:1042).
FSDP_CKPT = "fsdp_dtensor"
#: The optimizer flag a Megatron FSDP export writes beside ``--use-megatron-fsdp``: at d98e8a6
#: arguments.py:1124-1135 turns it on itself for Megatron-FSDP v1 (``--megatron-fsdp-version``,
#: default 1, arguments.py:3158; "Megatron-FSDP v1 is only compatible with --use-distributed-optimizer",
#: since NVIDIA/Megatron-LM ab43d43, 2026-04-10) and asserts it off for v2, which the export never
#: names; from af28b5a (2025-08-21, the flag's name) to ab43d43 nothing set it, and the guide of
#: af28b5a (docs/source/api-guide/custom_fsdp.md) lists it among the flags that enable Megatron FSDP.
#: ``--no-gradient-accumulation-fusion``, listed there too, is not written: Megatron-LM asserted it
#: only under ``--use-custom-fsdp`` (d165a85, 2025-02-26, zero2/zero3) and af28b5a made that a
#: warning; at d98e8a6 docs/user-guide/features/megatron_fsdp.md calls the fusion "used by default"
#: with Megatron FSDP, and the plan times it fused (:func:`accumulation_fusion`).
FSDP_OPTIMIZER = "--use-distributed-optimizer"
#: The environment variable Megatron FSDP needs unset (or above 1): arguments.py:1166-1167 at d98e8a6
#: (``assert os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS') != "1"`` under ``--use-megatron-fsdp``,
#: whatever tp and cp; since af28b5a), while Megatron-LM's launch scripts (examples/gpt3/
#: train_gpt3_175b_distributed.sh) export it as 1 and its Megatron FSDP ones
#: (examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh) unset it. With tp or cp > 1 before
#: Blackwell arguments.py:1453-1465 warns that tp and cp prefer 1 (docs/user-guide/features/
#: megatron_fsdp.md: "May slightly affect TP and CP performance").
FSDP_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"
#: ``--data-parallel-sharding-strategy`` (Megatron FSDP) as ``training.sharding``.
SHARDING = {"no_shard": "none", "optim": "zero1", "optim_grads": "zero2", "optim_grads_params": "zero3"}


def grad_clip(args: dict) -> dict:
    """``training.grad_clip`` and ``grad_clip_norm`` of ``--clip-grad`` (default 1.0): Megatron-LM's
    optimizer computes the gradient norm and clips only when it is > 0 (``optimizer.py``: ``if
    self.clip_grad > 0.0``); the value given is kept as ``grad_clip_norm``, which an export writes back.

    >>> grad_clip({}), grad_clip({"--clip-grad": "0.3"}), grad_clip({"--clip-grad": "0"})
    ({'grad_clip': True}, {'grad_clip': True, 'grad_clip_norm': 0.3}, {'grad_clip': False})
    """
    v = args.get("--clip-grad")
    if v is None:
        return {"grad_clip": True}
    if v is True:
        raise ConfigError("--clip-grad", "needs a value (Megatron-LM's parser refuses it bare): the norm to clip "
                          "to, or 0 for no clipping")
    try:
        norm = float(v)
    except (TypeError, ValueError):
        raise ConfigError("--clip-grad", f"{v!r} is not a number; give the norm to clip to, or 0 for no "
                          f"clipping") from None
    if not math.isfinite(norm):
        raise ConfigError("--clip-grad", f"{v!r} is not a finite number; give the norm to clip to, or 0 for no "
                          f"clipping")
    return {"grad_clip": True, "grad_clip_norm": norm} if norm > 0.0 else {"grad_clip": False}


def check_positions(model: dict, seq: int, flag: str, notes: list[str]) -> None:
    """Megatron-LM asserts ``max_position_embeddings >= seq_length`` (arguments.py). With
    learned positions the table has that many rows, so a longer sequence is a ConfigError
    naming both; with RoPE the plan holds (no table) and a note says Megatron-LM refuses it."""
    spec = model if "catalog" not in model and "hf_config" not in model else None
    if spec is None:
        m = catalog.model(model["catalog"]) if "catalog" in model else None
        if m is None:
            return  # a Hugging Face config: its max_position is not Megatron-LM's flag
        pos, rows = m.position_embedding, model.get("max_position", m.max_position)  # the script's own, kept
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


def dropout(args: dict, notes: list[str]) -> bool:
    """``[memory] dropout`` from ``--hidden-dropout`` and ``--attention-dropout`` (default 0.1
    each, :data:`DROPOUT`): on unless both are 0.0. meshplan has one switch for both; when one
    is 0.0 and the other not, a note says both are planned on; a flag left at its default (0.1)
    is named in a note with the flags that turn dropout off. ConfigError naming the flag
    for a value that is not a probability in [0, 1).

    >>> dropout({}, []), dropout({"--hidden-dropout": "0.0", "--attention-dropout": "0"}, [])
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
    unset = [f for f in on if f not in args]
    if unset:  # newcomer trial 31 #4: dropout planned from the defaults without a word
        notes.append(f"{' and '.join(unset)} not given: Megatron-LM's default {DROPOUT[unset[0]]:g}"
                     f"{' each' * (len(unset) > 1)} (TransformerConfig), planned with dropout ([memory] dropout = "
                     f"true: its masks and kernels); Llama-style runs set --attention-dropout 0 --hidden-dropout 0")
    if len(on) == 1:
        off = next(f for f in p if f not in on)
        notes.append(f"{off} 0.0 but {on[0]} {p[on[0]]}: meshplan has one dropout switch ([memory] dropout), "
                     f"planned on for both")
    return bool(on)


def routing(args: dict, notes: list[str]) -> dict:
    """MoE routing keys of [training] from ``--moe-expert-capacity-factor`` (Megatron-LM's
    TransformerConfig: None, the default, or a negative value is dropless; else tokens over
    ``C = ceil(f x tokens x top_k / experts)`` per expert are dropped). Without
    ``--moe-pad-expert-input-to-capacity`` Megatron-LM sends only the routed copies (at most C
    per expert), while meshplan plans the padded ``E x C`` buffer: a note says so (not under flex with
    deepep, planned unpadded: :mod:`meshplan.compute.routing`).

    >>> routing({}, []), routing({"--moe-expert-capacity-factor": "1.25",
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
    if not args.get("--moe-pad-expert-input-to-capacity") and not is_deepep(args):  # deepep: planned unpadded
        notes.append(f"--moe-expert-capacity-factor {v} without --moe-pad-expert-input-to-capacity: Megatron-LM "
                     f"sends only the routed copies (at most the capacity per expert); planned with the padded "
                     f"experts x capacity buffer, an upper bound")
    return {"moe_capacity_factor": f}


def comm_types(args: dict, deg: dict[str, int], moe: bool, notes: list[str]) -> dict:
    """``--moe-token-dispatcher-type`` (:func:`meshplan.interop.megatron_dispatch.dispatcher`: the
    ``training.moe_dispatcher`` key it gives), ``--moe-grouped-gemm``'s absence where a rank holds several
    experts a layer (:func:`~meshplan.interop.megatron_dispatch.grouped_note`), ``--overlap-moe-expert-parallel-comm``
    (:func:`~meshplan.interop.megatron_dispatch.overlap_note`) and ``--cp-comm-type``
    (:func:`cp_comm_type`)."""
    if moe and (experts := _int(args, "--num-experts")):
        grouped_note(args, experts // deg["ep"], notes)
    overlap_note(args, moe and deg["ep"] * deg["etp"] > 1, notes)
    return dispatcher(args, moe and deg["ep"] * deg["etp"] > 1, notes) | cp_comm_type(args, deg["cp"] > 1)


def cp_comm_type(args: dict, active: bool) -> dict:
    """``training.cp_attention`` of ``--cp-comm-type`` where context parallelism communicates
    (``active``: cp > 1): ``p2p`` (Transformer Engine's ring; absent, Megatron-LM's default: no
    key, which plans it under framework megatron) or ``allgather`` (:data:`CP_COMM`); ``a2a`` and
    ``a2a+p2p`` a ConfigError naming the flag, as is a value Megatron-LM does not have. Of a
    per-layer list the first value is read.

    >>> cp_comm_type({"--cp-comm-type": "all_gather"}, True), cp_comm_type({}, True)
    ({'cp_attention': 'allgather'}, {})
    """
    v, flag = args.get("--cp-comm-type"), "--cp-comm-type"
    if v is None or (v in CP_TYPES and not active):
        return {}
    if v in CP_COMM:
        return {"cp_attention": CP_COMM[v]} if active else {}
    if v not in CP_TYPES:
        raise ConfigError(flag, f"{printable(str(v))[:40]!r} is not p2p, all_gather, a2a or a2a+p2p; give p2p "
                                f"(Megatron-LM's default) or all_gather")
    raise ConfigError(flag, f"{v} {CP_TYPES[v]}, which meshplan does not model (it plans Transformer Engine's p2p "
                            f"ring and all_gather); use {flag} p2p or {flag} all_gather")


def overlap_flags(args: dict, sharding: str) -> dict[str, bool]:
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


#: Megatron-LM's pipeline p2p overlap switches (arguments.py:3118-3120 and model_parallel_config.py:422-428
#: at d98e8a6): ``--no-overlap-p2p-communication`` (store_false, dest overlap_p2p_comm: on by default) and
#: ``--overlap-p2p-communication-warmup-flush`` (default off).
P2P_FLAGS = ("--no-overlap-p2p-communication", "--overlap-p2p-communication-warmup-flush")


def p2p_overlap(args: dict, interleaved: bool) -> dict[str, bool]:
    """``training.pp_p2p_overlap`` (false for ``--no-overlap-p2p-communication``; unset: on, as
    Megatron-LM) and ``pp_p2p_overlap_warmup_flush`` (``--overlap-p2p-communication-warmup-flush``).
    The warm-up flush needs the overlap, which Megatron-LM turns off without interleaving
    (arguments.py:1010-1018), and then ``ModelParallelConfig.__post_init__`` raises
    (model_parallel_config.py:570-575 at d98e8a6): refused in either case.

    >>> p2p_overlap({}, True), p2p_overlap({"--no-overlap-p2p-communication": True}, True)
    ({}, {'pp_p2p_overlap': False})
    >>> p2p_overlap({"--overlap-p2p-communication-warmup-flush": True}, True)
    {'pp_p2p_overlap_warmup_flush': True}
    """
    off, flush = (bool(args.get(f)) for f in P2P_FLAGS)
    if flush and (off or not interleaved):
        why = "--no-overlap-p2p-communication turns that off" if off else \
            "Megatron-LM turns it off without interleaving (no --num-layers-per-virtual-pipeline-stage)"
        raise ConfigError(P2P_FLAGS[1], f"needs Megatron-LM's p2p overlap and {why}; Megatron-LM raises "
                          f"(model_parallel_config.py): remove one of the flags")
    return {"pp_p2p_overlap": False} if off else {"pp_p2p_overlap_warmup_flush": True} if flush else {}


def bucket(args: dict, training: dict, notes: list[str]) -> dict[str, int]:
    """``[memory] grad_bucket_elements`` from ``--ddp-bucket-size`` (arguments.py:3125 at
    d98e8a6, ``DistributedDataParallelConfig.bucket_size``: elements per bucket). Megatron-LM's
    DDP uses it only under ``--overlap-grad-reduce``, its default ``max(40e6, 1e6 x dp)``, and
    sets it to None without (one bucket; ``resolve_ddp_bucket_size``, megatron/training/
    training.py:2179-2194 at d98e8a6): read with none / zero1 and
    ``training.overlap_grad_reduce``, where meshplan plans those buckets
    (:func:`meshplan.comm.megatron_buckets.megatron_bucket_rows`); elsewhere a note says why not.

    Under Megatron FSDP (zero2, zero3) it is ignored, with a note: ``FullyShardedDataParallel``
    makes every ``TransformerLayer`` an FSDP unit (megatron/core/distributed/fsdp/
    mcore_fsdp_adapter.py:166-173), whose parameters form one bucket whatever the size; the size
    only cuts the parameters outside any unit (embedding, final norm, output layer; whole
    parameters, a bucket closed once it holds that many elements: ``_get_parameter_groups``,
    megatron_fsdp/param_and_grad_buffer.py:1827-1874), in each rank's first model chunk (the
    others built with ``disable_bucketing``: training.py:2508-2511 and 2313-2327). meshplan
    plans those ends as one root unit (:func:`meshplan.comm.fsdp_rows.fsdp_units`): the same
    bytes, in one collective where Megatron FSDP at its default size sends the embedding's
    bucket apart. The FSDP
    communication unit (``suggested_communication_unit_size``, megatron_fsdp.py:420-444) is
    max(1e9, 2 x a layer's elements) under optim_grads_params, not the bucket size.

    >>> notes = []; bucket({"--ddp-bucket-size": "1000"}, {"sharding": "zero3"}, notes), notes[0][:39]
    ({}, '--ddp-bucket-size 1000 ignored: Megatro')
    """
    size = _int(args, "--ddp-bucket-size")
    if size is None:
        return {}
    if training["sharding"] not in ("none", "zero1"):
        notes.append(f"--ddp-bucket-size {size} ignored: Megatron FSDP ({training['sharding']}) makes each transformer "
                     f"layer one FSDP unit whatever the size, which only cuts the parameters outside the layers "
                     f"(embedding, final norm, output layer) into buckets; meshplan plans those as one root unit (the "
                     f"same bytes, one collective)")
        return {}
    if not training.get("overlap_grad_reduce"):
        notes.append(f"--ddp-bucket-size {size} not planned: without --overlap-grad-reduce Megatron-LM's DDP ignores "
                     f"it (one bucket, reduced after the backward)")
        return {}
    return {"grad_bucket_elements": size}


def accumulation_fusion(args: dict, notes: list[str]) -> None:
    """``--no-gradient-accumulation-fusion`` (arguments.py:2944 at d98e8a6; the fusion is on by
    default): a note that the plan times Megatron-LM's fused accumulation, each linear's weight
    gradient GEMM adding into its main gradient (:func:`meshplan.compute.kernel_time.wgrad_accumulate_s`),
    not the unfused run's gradient in the compute dtype added by a kernel of its own. The flag
    stays unread (an export to Megatron-LM carries it from the user's arguments).

    >>> notes = []; accumulation_fusion({"--no-gradient-accumulation-fusion": True}, notes); notes[0][:58]
    '--no-gradient-accumulation-fusion: planned with Megatron-L'
    """
    if args.get("--no-gradient-accumulation-fusion"):
        notes.append("--no-gradient-accumulation-fusion: planned with Megatron-LM's default fused accumulation "
                     "(each weight gradient GEMM adds into the main gradient); unfused, each linear's weight "
                     "gradient is written in the compute dtype and added by a kernel of its own, not planned")


def sharding(args: dict) -> str:
    """``training.sharding``: :data:`SHARDING` of ``--data-parallel-sharding-strategy`` (default
    optim_grads_params) under ``--use-megatron-fsdp``, its name before NVIDIA/Megatron-LM af28b5a
    (2025-08) ``--use-custom-fsdp`` (:data:`FSDP_FLAGS`) or ``--use-torch-fsdp2``; else zero1
    with ``--use-distributed-optimizer``, none without.

    >>> sharding({"--use-custom-fsdp": True}), sharding({"--use-distributed-optimizer": True})
    ('zero3', 'zero1')
    """
    if args.get("--use-torch-fsdp2") or any(args.get(f) for f in FSDP_FLAGS):
        strategy = str(args.get("--data-parallel-sharding-strategy", "optim_grads_params"))
        if strategy not in SHARDING:
            raise ConfigError("--data-parallel-sharding-strategy", f"{strategy!r}; use {', '.join(SHARDING)}")
        return SHARDING[strategy]
    return "zero1" if args.get("--use-distributed-optimizer") else "none"


def megatron_fsdp(args: dict, sharding_: str) -> dict[str, bool]:
    """``training.megatron_fsdp`` where it tells the engine apart: sharding none or zero1
    (``--data-parallel-sharding-strategy no_shard`` or ``optim``) under ``--use-megatron-fsdp``
    (or ``--use-custom-fsdp``), which Megatron DDP and its distributed optimizer also run; zero2
    and zero3 are Megatron FSDP anyway (no key).

    >>> megatron_fsdp({"--use-megatron-fsdp": True}, "zero1"), megatron_fsdp({}, "zero1")
    ({'megatron_fsdp': True}, {})
    """
    on = any(args.get(f) for f in FSDP_FLAGS) and sharding_ in ("none", "zero1")
    return {"megatron_fsdp": True} if on else {}


#: Megatron Core's flag that keeps the attention mask out of the batch (``training.dataloader_attention_mask``).
NO_MASK = "--no-create-attention-mask-in-dataloader"


def runtime(args: dict, deepspeed: bool) -> dict:
    """``training.megatron_runtime`` of an imported script: ``core``, the generation of the flags
    read here (NVIDIA/Megatron-LM d98e8a6: its ``pretrain_gpt.py`` runs Megatron Core's
    ``get_batch``, :mod:`meshplan.compute.megatron_core`), with ``dataloader_attention_mask``
    false for :data:`NO_MASK` (``arguments.py:3332-3334``); ``2022`` under ``--deepspeed``
    (Megatron-DeepSpeed's ``pretrain_gpt.py`` keeps 2022's ``get_batch`` with ``broadcast_data``),
    where the mask flag does not exist.

    >>> runtime({}, False), runtime({NO_MASK: True}, False), runtime({}, True)
    ({'megatron_runtime': 'core'}, {'megatron_runtime': 'core', 'dataloader_attention_mask': False}, {'megatron_runtime': '2022'})
    """
    if deepspeed:
        return {"megatron_runtime": "2022"}
    return {"megatron_runtime": "core", **({"dataloader_attention_mask": False} if args.get(NO_MASK) else {})}
