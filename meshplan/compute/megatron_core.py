"""Where Megatron Core (``training.megatron_runtime = "core"``) runs a step differently from
Megatron-LM 2022, the generation the rest of the framework-megatron step model follows
(NVIDIA/Megatron-LM 2755bcb, June 2022: the development set's runs). Read at NVIDIA/Megatron-LM
d98e8a64dd (the commit ``meshplan import megatron`` reads the flags of). Each difference has one
home; this module holds the rules that are not the batch's:

1. ``get_batch`` (``pretrain_gpt.py:110-160``; ``megatron/core/utils.py``
   ``get_batch_on_this_tp_rank``, 2167-2330): only the first model chunk of the first pipeline
   stage and the last chunk of the last stage load a batch (``is_first_or_last_pipeline_stage(vp_stage)``,
   ``training/utils/common_utils.py:515-525``; other chunks return None before any copy); tp rank 0
   copies each tensor to the GPU (``.cuda(non_blocking=True)``, pinned: ``data_samplers.py:115``)
   and broadcasts each over tp on its own, the set depending on the stage (2257-2300), the attention
   mask built by the data loader on the CPU (``core/datasets/gpt_dataset.py:826-874``), so no mask
   kernels run on the GPU. :func:`meshplan.compute.batch_input.core_batch_transfers`; 2022's:
   :func:`~meshplan.compute.batch_input.megatron_batch_transfers` and
   :func:`meshplan.compute.megatron.batch_bytes` in every chunk on every stage.
2. The embedding's output under sequence parallelism (:func:`embedding_reduce_scatter`): reduce-scattered
   into the sequence shards where no learned position embedding is added (``language_model_embedding.py:51-56``,
   ``tensor_parallel/layers.py:367-380``), not all-reduced and split as 2022 did.
3. Timers (2022's: :data:`meshplan.compute.megatron.TIMER_SYNCS`, :data:`~meshplan.compute.megatron.STEP_TIMERS`): ``forward-compute``, ``backward-compute``
   (``pipeline_parallel/schedules.py:494, 552``, ``log_level=2``), ``forward-recv`` and its kin
   (``p2p_communication.py:444-485``, 2) and the step's ``forward-backward`` and ``optimizer``
   (``schedules.py:763``, ``training/training.py:3159``, 1) are ``DummyTimer``s at the default
   ``--timing-log-level`` 0 (``training/config/training_config.py:267``; ``core/timers.py:241-267``
   returns a dummy above the level): none synchronises, where 2022's ``_Timer`` synchronised at each
   start and stop.
4. Pipeline p2p syncs (:data:`CORE_P2P_CALL_SYNCS`): ``_communicate`` synchronises once after its requests
   when ``batch_p2p_comm and batch_p2p_sync`` (``p2p_communication.py:421-424``; ``batch_p2p_sync``
   default True, ``model_parallel_config.py:390-398``; ``batch_p2p_comm = not overlap_p2p_comm``,
   ``training/argument_utils.py:307``): one sync per blocking call, none under the p2p overlap.
   The calls (:func:`meshplan.compute.megatron_cost.p2p_calls` with ``core``): core's
   ``forward_backward_pipelining_without_interleaving`` makes 2022's, the first stage's receives and the
   last's sends returning before ``_communicate``; ``..._with_interleaving`` too, except at m == p, where
   core has no all-warm-up case (``get_pp_rank_microbatches``): the later stages warm up fewer units and
   skip the receive before the cool-down (p 4, m 4, v 2: stages 2 and 3 make 15 and 13 calls, not 18 and 17).

The mask's GPU copy (or tp broadcast buffer) in the memory timeline: :func:`meshplan.memory.sizes.batch_mask_bytes`.

Not changed by the generation (already modelled as core runs them): the DDP buckets' overlapped
reduce-scatter and parameter all-gather (``training.overlap_grad_reduce`` / ``overlap_param_gather``,
d98e8a6), Transformer Engine's p2p CP ring, the QKV sub-sharding, the fp32 main-gradient hooks.
Not modelled (2022's kernels kept under core, each named in the docs' list): Transformer Engine's
fused layer-norm + linear (``TELayerNormColumnParallelLinear``) and its norm kernels, core's loss
kernels and ``--cross-entropy-loss-fusion``, ``get_batch_on_this_cp_rank``'s slicing kernels at
cp > 1, ``clone_scatter_output_in_embedding``'s copy, the distributed optimizer's per-bucket copies.
"""

from __future__ import annotations

#: ``torch.cuda.synchronize`` calls per blocking pipeline p2p call in Megatron Core: ``_communicate``'s
#: own (item 4); 2022's three: :data:`meshplan.compute.megatron_cost.P2P_CALL_SYNCS`.
CORE_P2P_CALL_SYNCS = 1


def embedding_reduce_scatter(core: bool, sp: bool, learned_positions: bool) -> bool:
    """Whether Megatron-LM reduce-scatters the embedding's output over tp (item 2): Megatron Core
    under sequence parallelism when no learned position embedding is added
    (``reduce_scatter_embeddings``, NVIDIA/Megatron-LM d98e8a6
    ``models/common/embeddings/language_model_embedding.py:51-56``; ``VocabParallelEmbedding.forward``,
    ``tensor_parallel/layers.py:367-380``, transposes to ``[s b h]`` and reduce-scatters); otherwise
    it all-reduces (``reduce_from_tensor_model_parallel_region``, 383) and, under SP,
    ``scatter_to_sequence_parallel_region`` keeps its shard without communicating (as 2022 did for
    every model, 2755bcb ``mpu/layers.py`` / ``model/language_model.py``).

    >>> embedding_reduce_scatter(True, True, False), embedding_reduce_scatter(True, True, True)
    (True, False)
    >>> embedding_reduce_scatter(False, True, False), embedding_reduce_scatter(True, False, False)
    (False, False)
    """
    return core and sp and not learned_positions


#: The two generations' revisions and what the other differs in (items 1-4 above), as the
#: runtime line prints them.
GENERATIONS = {
    "2022": ("Megatron-LM 2022 (NVIDIA/Megatron-LM 2755bcb, June 2022: the development set's runs)",
             "get_batch with its mask kernels in every chunk on every stage, timer syncs, three syncs per "
             "pipeline p2p call, the SP embedding all-reduced"),
    "core": ("Megatron Core (NVIDIA/Megatron-LM d98e8a6)",
             "get_batch on the first and last stages only, no mask kernels, no timer syncs, one sync per "
             "blocking p2p call, the SP embedding reduce-scattered"),
}


def core_only_features(model, training) -> list[str]:
    """What ``model`` and ``training`` ask for that Megatron-LM 2022 lacks: none of ``rotary``,
    ``swiglu``, ``num-query-groups``, ``overlap-grad-reduce``, ``overlap-param-gather``, ``fp8``,
    ``transformer_engine`` or ``tp-comm-overlap`` occurs under ``megatron/`` at NVIDIA/Megatron-LM
    2755bcb (``git grep``); its distributed optimizer does (``--use-distributed-optimizer``,
    ``megatron/arguments.py:785``), so ``sharding = "zero1"`` is not listed. Megatron FSDP is
    core's too (``training.megatron_fsdp``).

    >>> from meshplan.spec.model import ModelSpec
    >>> from meshplan.spec.training import TrainingSpec
    >>> m = ModelSpec(name="m", layers=2, hidden=64, ffn=128, q_heads=8, kv_heads=2, vocab=128)
    >>> core_only_features(m, TrainingSpec(global_batch=8, seq_len=16, framework="megatron",
    ...                                    sharding="zero1", overlap_grad_reduce=True))
    ['RoPE (--position-embedding-type rope)', 'SwiGLU (--swiglu)', 'GQA (--num-query-groups 2 of 8 heads)', '--overlap-grad-reduce']
    """
    t = training
    asked = [("RoPE (--position-embedding-type rope)", model.position_embedding == "rope"),
             ("SwiGLU (--swiglu)", model.gated_mlp),
             (f"GQA (--num-query-groups {model.kv_heads} of {model.q_heads} heads)",
              model.kv_heads is not None and model.kv_heads < model.q_heads),
             ("--overlap-grad-reduce", t.overlap_grad_reduce), ("--overlap-param-gather", t.overlap_param_gather),
             ("--tp-comm-overlap", t.tp_comm_overlap), ("fp8 (Transformer Engine)", t.linear_dtype == "fp8"),
             ("Megatron FSDP", t.megatron_fsdp)]
    return [name for name, on in asked if on]


def runtime_followed(model, training) -> dict | None:
    """Which Megatron-LM generation the plan and step model (``training.megatron_runtime``; None
    off framework megatron): ``runtime`` ("2022" or "core"), ``set`` (False: unset, the default
    2022), ``revision``, ``other`` (what the other generation does differently), the
    Megatron-Core-only features the config asks for under 2022 (:func:`core_only_features`) and
    ``line``, the one line plan and step print (the --json's ``megatron_runtime``).

    >>> from meshplan.spec.model import ModelSpec
    >>> from meshplan.spec.training import TrainingSpec
    >>> gpt = ModelSpec(name="g", layers=2, hidden=64, ffn=256, q_heads=8, vocab=128, gated_mlp=False,
    ...                 position_embedding="learned", max_position=16)
    >>> d = runtime_followed(gpt, TrainingSpec(global_batch=8, seq_len=16, framework="megatron"))
    >>> d["runtime"], d["set"], d["core_only_features"]
    ('2022', False, [])
    >>> runtime_followed(gpt, TrainingSpec(global_batch=8, seq_len=16)) is None
    True
    """
    if training.framework != "megatron":
        return None
    runtime = "core" if training.megatron_core else "2022"
    other = "2022" if runtime == "core" else "core"
    asked = core_only_features(model, training) if runtime == "2022" else []
    how = f'training.megatron_runtime = "{runtime}"' if training.megatron_runtime else \
        "training.megatron_runtime unset: the default"
    line = (f"megatron runtime: {GENERATIONS[runtime][0]} ({how}); \"{other}\", {GENERATIONS[other][0]}, differs in: "
            f"{GENERATIONS[other][1]}; set training.megatron_runtime = \"{other}\" to model it")
    if asked:
        line += (f"; this config asks for what Megatron-LM 2022 lacks ({', '.join(asked)}): today's Megatron-LM "
                 f"runs it, so \"core\" is likely the runtime meant")
    return {"runtime": runtime, "set": training.megatron_runtime is not None, "revision": GENERATIONS[runtime][0],
            "other": {"runtime": other, "revision": GENERATIONS[other][0], "differs_in": GENERATIONS[other][1]},
            "core_only_features": asked, "line": line}
