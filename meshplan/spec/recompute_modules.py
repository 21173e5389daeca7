"""Megatron-LM's selective recompute modules (``training.recompute_modules``, its
``--recompute-modules``): which modules there are, which a layer of a model has, and what each
one discards and replays. The one home of those facts; the memory model
(:func:`meshplan.memory.activations.layer_terms`, :func:`meshplan.memory.workingset.layer_act_sizes`)
and the step model (:func:`meshplan.compute.recompute.module_replays`) read :func:`layer_parts`.

Read in NVIDIA/Megatron-LM d98e8a6:

- ``TransformerConfig.recompute_modules`` (megatron/core/transformer/transformer_config.py
  560-582): default ``["core_attn"]`` (1940-1941); under ``recompute_granularity == "selective"``
  the allowed names (1944-1962), ``moe_act`` only with ``moe_grouped_gemm`` (1964-1967: a
  ValueError) and ``mla_up_proj`` only with ``multi_latent_attention`` (1969-1973: a ValueError).
  ``moe_act``, ``layernorm`` and ``mla_up_proj`` "use output-discarding checkpointing"
  (``tensor_parallel.CheckpointWithoutOutput``: the module runs under no_grad, its output's
  storage is freed once its consumers have run forward, ``discard_output_and_register_recompute``,
  and refilled by a replay just before their backward; what the consumers saved of it is freed
  with it); ``core_attn``, ``mlp``, ``moe`` and ``shared_experts`` use "normal checkpointing"
  (``tensor_parallel.checkpoint``: the module's inputs kept, nothing inside it, the whole
  module's forward replayed before its backward, its tensor-parallel collectives included).
- ``core_attn``: attention.py 392-395 and 446-495 (``_checkpointed_attention_forward``; q, k, v
  kept as the checkpoint's inputs); multi_latent_attention.py 384-392 alike.
- ``layernorm``: transformer_layer.py 473-536: ``input_layernorm`` and ``pre_mlp_layernorm``
  each only where it is a module of its own, not ``IdentityOp``. Transformer Engine's layer specs
  (megatron/core/models/gpt/gpt_layer_specs.py 244-345) fuse the input norm into ``linear_qkv``
  (``TELayerNormColumnParallelLinear``) for standard attention and the pre-MLP norm into
  ``linear_fc1`` of a dense MLP; MLA without ``mla_down_proj_fusion`` (default False,
  transformer_config.py 3338) keeps ``input_layernorm`` and an MoE layer keeps ``pre_mlp_layernorm``
  (the router needs its output). So: the attention norm on MLA layers, the MLP norm on MoE layers,
  nothing on a dense GPT/Llama layer. The norm's output, the input its GEMMs saved, is discarded.
- ``mlp``: transformer_layer.py 537-539 (only ``if not self.is_moe_layer``) and 992-1011: the
  dense MLP (under TE, its fused pre-MLP norm too) checkpointed with its input, the norm's input.
- ``moe``: moe/moe_layer.py 246-250 and 701-717: the whole MoE layer (router, permutation,
  dispatch and combine, routed and shared experts) checkpointed with its input, the pre-MLP
  norm's output.
- ``shared_experts``: moe/moe_layer.py 252-255 and 517-530: the shared experts checkpointed
  with their input (the norm's output, which the router keeps anyway).
- ``moe_act``: moe/experts.py 269-272 and 1019-1030 (``TEGroupedMLP``): the routed experts'
  activation (bias, GLU, the routing-probability multiply) under ``CheckpointWithoutOutput``;
  its input, fc1's output, kept, its output (fc2's input) discarded after fc2's forward.
- ``mla_up_proj``: multi_latent_attention.py 171-174, 455-458 and 983-988: the q and kv
  up-projections (with their fused latent norms) and RoPE under ``CheckpointWithoutOutput``; the
  latents kept, Q, K and V discarded after the core attention.
- Collectives replayed (:func:`replayed_tp_ops`; ``CheckpointFunction`` at random.py 591-672 keeps
  only its arguments, 616-627, and its backward runs ``run_function`` again whole, 652-659, with no
  early stop): ``mlp``'s argument is the pre-MLP norm's output, under TE's fused norm the layer's
  hidden states, the sequence shard ``[s/tp, b, h]`` under SP, so the replayed ``linear_fc1``
  all-gathers it again (TransformerEngine d0067d0 ``pytorch/module/layernorm_linear.py`` 174 and
  283-312; the gathered copy is freed after the forward, 430-435, and gathered once more for the
  weight gradient, 473-475 and 773-790, as without recompute) and ``linear_fc2`` reduce-scatters
  its output again (``pytorch/module/linear.py`` 568-577; all-reduce without SP). ``moe`` replays
  ``custom_forward`` (moe_layer.py 658-699): the shared experts' tp collectives, the dispatcher's
  count exchange, all-to-alls and etp gathers and scatters, as in the forward. ``shared_experts``
  (moe_layer.py 517-530, its argument the norm's output, the sequence shard under SP) the shared
  MLP's all-gather and reduce-scatter (an ``SharedExpertMLP(MLP)`` on the tp group,
  shared_experts.py 102-207), once more inside a ``moe`` replay. ``core_attn`` (q, k, v kept; the
  context-parallel calls inside the core: :mod:`meshplan.spec.axes.cp`), ``layernorm`` and
  ``moe_act`` replay none. ``mla_up_proj`` (:func:`mla_up_gathers`): its
  ``CheckpointWithoutOutput`` keeps its arguments, the latents ``q_compressed`` and
  ``kv_compressed`` after the duplicated down-projections (multi_latent_attention.py 525-610:
  ``TELinear`` with ``parallel_mode="duplicated"`` on the sequence shard), ``[s/tp, b, r]`` under SP,
  and ``k_pos_emb`` already gathered (745-763); the replay (855-988, ``qkv_up_proj_and_rope_apply``)
  runs ``linear_q_up_proj`` (``linear_q_proj`` on the hidden states without a query latent) and
  ``linear_kv_up_proj``, column-parallel ``gather_output=False`` linears, each all-gathering its
  sequence-sharded input over tp again (TransformerEngine d0067d0 ``pytorch/module/linear.py``
  346-349 and 407-412: ``gather_along_first_dim`` of the input when ``parallel_mode == "column"`` and
  ``sequence_parallel``; the fused-norm ``layernorm_linear.py`` 283-312 alike): ``b x s x q_lora_rank`` (or ``h``) and ``b x s x kv_lora_rank`` values. Without
  SP their inputs are whole: no call.
- Nested: a module checkpointed inside ``moe`` (``shared_experts``, ``moe_act``) runs its
  forward once more in ``moe``'s replay and once more in its own (the replay runs the inner
  checkpoint again, which saves only its inputs and replays before its backward).

The other names Megatron-LM allows (``gdn_norm_out``, ``gdp_in_proj``, ``gdp_qkv``: GatedDeltaNet
layers; ``mhc``: hyper-connections) need layers meshplan's models do not have: refused.
"""

from __future__ import annotations

from typing import Optional

from meshplan.errors import ConfigError

#: The modules meshplan models (module docstring), Megatron-LM's spelling.
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
#: Those Megatron-LM checkpoints with ``CheckpointWithoutOutput`` (output discarded, input kept).
OUTPUT_DISCARDING = ("moe_act", "layernorm", "mla_up_proj")
#: Megatron-LM's other names (transformer_config.py 1944-1962) and the layers they need.
UNMODELLED = {"gdn_norm_out": "GatedDeltaNet attention", "gdp_in_proj": "GatedDeltaProduct attention",
              "gdp_qkv": "GatedDeltaProduct attention", "mhc": "hyper-connections (enable_mhc_connections)"}
#: Megatron-LM's default (transformer_config.py 1940-1941).
DEFAULT = ("core_attn",)


def check_names(modules: tuple[str, ...]) -> Optional[str]:
    """The one-line reason ``modules`` is refused (no module, an unknown or unmodelled name, a
    repeat), None when it is a list meshplan plans.

    >>> check_names(("core_attn", "mlp")) is None
    True
    >>> print(check_names(("core_attn", "ffn")))
    'ffn' is not a Megatron-LM recompute module; use core_attn, moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts
    """
    if not modules:
        return "is empty; give one or more of " + ", ".join(MODULES) + " (Megatron-LM's default: core_attn)"
    for m in modules:
        if m in UNMODELLED:
            return f"'{m}' recomputes parts of {UNMODELLED[m]}, which meshplan's models do not have; use " + \
                ", ".join(MODULES)
        if m not in MODULES:
            return f"{m[:40]!r} is not a Megatron-LM recompute module; use " + ", ".join(MODULES)
    if len(set(modules)) < len(modules):
        return "names a module twice; give each once"
    return None


def check_model(modules: tuple[str, ...], moe: bool, mla: bool) -> Optional[str]:
    """The one-line reason Megatron-LM refuses ``modules`` for a model (``moe``: routed experts,
    which meshplan plans as Megatron-LM's grouped GEMM, ``TEGroupedMLP``; ``mla``: multi-head latent
    attention): its two ValueErrors (module docstring); None otherwise.

    >>> print(check_model(("moe_act",), moe=False, mla=False))
    moe_act recomputes the routed experts' activation (TEGroupedMLP, --moe-grouped-gemm) and this model has no experts; Megatron-LM raises ValueError ("moe_act in recompute_modules is only supported with moe_grouped_gemm"): remove it
    """
    if "moe_act" in modules and not moe:
        return ("moe_act recomputes the routed experts' activation (TEGroupedMLP, --moe-grouped-gemm) and this model "
                "has no experts; Megatron-LM raises ValueError (\"moe_act in recompute_modules is only supported with "
                "moe_grouped_gemm\"): remove it")
    if "mla_up_proj" in modules and not mla:
        return ("mla_up_proj recomputes multi-latent attention's up-projections and this model has none; Megatron-LM "
                "raises ValueError (\"mla_up_proj in recompute_modules is only supported with multi_latent_attention\"): "
                "remove it")
    return None


def idle(modules: tuple[str, ...], moe: bool, dense: bool, mla: bool, shared: bool) -> list[str]:
    """The modules of ``modules`` that act on no layer of a model with MoE layers (``moe``), dense
    layers (``dense``), MLA and shared experts: Megatron-LM accepts them and recomputes nothing.

    >>> idle(("core_attn", "layernorm", "moe"), moe=False, dense=True, mla=False, shared=False)
    ['layernorm', 'moe']
    """
    acts = {"core_attn": True, "moe_act": moe, "layernorm": mla or moe, "mla_up_proj": mla, "mlp": dense,
            "moe": moe, "shared_experts": moe and shared}
    return [m for m in modules if not acts[m]]


def layer_parts(modules: tuple[str, ...], moe_layer: bool, mla: bool) -> frozenset[str]:
    """What ``modules`` recompute in one layer (MoE or dense, MLA or not), as parts: ``core_attn``,
    ``attn_norm`` (``layernorm`` on MLA), ``mlp_norm`` (``layernorm`` on an MoE layer),
    ``mla_up_proj``, ``mlp`` (a dense layer's), ``moe``, ``shared_experts``, ``moe_act`` (an MoE
    layer's), each where the module docstring says Megatron-LM applies it.

    >>> sorted(layer_parts(("core_attn", "layernorm", "mlp", "moe_act"), moe_layer=False, mla=False))
    ['core_attn', 'mlp']
    >>> sorted(layer_parts(("layernorm", "mlp", "moe_act"), moe_layer=True, mla=True))
    ['attn_norm', 'mlp_norm', 'moe_act']
    """
    out = {m for m in modules if m in ("core_attn", "mla_up_proj")} if mla else \
        {m for m in modules if m == "core_attn"}
    if "layernorm" in modules:
        out |= ({"attn_norm"} if mla else set()) | ({"mlp_norm"} if moe_layer else set())
    out |= {m for m in modules if m in ("moe", "shared_experts", "moe_act")} if moe_layer else \
        {m for m in modules if m == "mlp"}
    return frozenset(out)


def replayed_tp_ops(parts: frozenset, mlp_ops: list[str], shared_ops: list[str]) -> list[str]:
    """The tp collectives one layer's selective replays (``parts``, :func:`layer_parts`) issue
    again in backward, in issue order (module docstring): the MLP block's forward ones
    (``mlp_ops``: a dense MLP's, or an MoE layer's, :func:`meshplan.spec.axes.moe_tp.moe_mlp_tp_ops`)
    under ``mlp`` or ``moe``, then the shared experts' (``shared_ops``: empty without shared
    experts) under ``shared_experts``, inside ``moe``'s replay and again in their own. The ep
    calls of ``moe``'s replay: :func:`moe_replayed`.

    >>> replayed_tp_ops(frozenset({"core_attn", "mlp"}), ["all-gather", "reduce-scatter"], [])
    ['all-gather', 'reduce-scatter']
    >>> replayed_tp_ops(frozenset({"moe", "shared_experts"}), ["all-gather", "reduce-scatter"], ["all-gather", "reduce-scatter"])
    ['all-gather', 'reduce-scatter', 'all-gather', 'reduce-scatter']
    """
    return (list(mlp_ops) if parts & {"mlp", "moe"} else []) + (list(shared_ops) if "shared_experts" in parts else [])


def mla_up_gathers(model, training, tp: int, sp: bool) -> tuple[tuple[str, int], ...]:
    """The tp all-gathers one MLA layer's ``mla_up_proj`` replay issues in backward (module
    docstring), as (which, values per token): the query latent's (``q_lora_rank``; the hidden
    states', ``hidden``, where the model has no query latent: ``linear_q_proj``) and the key/value
    latent's (``kv_lora_rank``); none unless Megatron-LM (framework ``megatron``) runs selective
    recompute with ``mla_up_proj`` on an MLA model at tp > 1 with sequence parallelism.

    >>> from meshplan import catalog
    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", recompute="selective",
    ...                  recompute_modules=["core_attn", "mla_up_proj"])
    >>> mla_up_gathers(catalog.model("deepseek-v3"), t, 8, True), mla_up_gathers(catalog.model("deepseek-v3"), t, 8, False)
    ((('q latent', 1536), ('kv latent', 512)), ())
    >>> mla_up_gathers(catalog.model("deepseek-v2-lite"), t, 2, True)
    (('q (hidden states)', 2048), ('kv latent', 512))
    """
    on = (training.framework == "megatron" and training.recompute == "selective" and model.is_mla and sp and tp > 1
          and "mla_up_proj" in training.recompute_modules)
    if not on:
        return ()
    q = ("q latent", model.q_lora_rank) if model.q_lora_rank else ("q (hidden states)", model.hidden)
    return q, ("kv latent", model.kv_lora_rank)


def moe_replayed(training, moe_layer: bool) -> bool:
    """Whether an MoE layer's dispatch, combine (and their count exchange and etp calls) run again
    in backward under selective recompute: Megatron-LM's ``moe`` module (module docstring).

    >>> from meshplan.spec.training import TrainingSpec
    >>> moe_replayed(TrainingSpec(global_batch=8, seq_len=16, recompute="selective", recompute_modules=["moe"]), True)
    True
    """
    return moe_layer and training.recompute == "selective" and "moe" in training.recompute_modules


def flags(modules: tuple[str, ...]) -> list[str]:
    """Megatron-LM's flag for ``modules``: none for its default (core_attn alone).

    >>> flags(("core_attn",)), flags(("core_attn", "mlp"))
    ([], ['--recompute-modules core_attn mlp'])
    """
    return [] if tuple(modules) == DEFAULT else ["--recompute-modules " + " ".join(modules)]


def config_notes(model, training) -> tuple[str, ...]:
    """Check ``training.recompute_modules`` against ``model`` (a :class:`~meshplan.spec.model.ModelSpec`)
    and the training: set away from the default only under ``framework = "megatron"`` (the modules
    are Megatron-LM's layers) and not refused by Megatron-LM for the model (:func:`check_model`): a
    :class:`~meshplan.errors.ConfigError` naming the field otherwise. Notes: under another
    ``recompute`` they are not planned (Megatron-LM reads them only under ``--recompute-granularity
    selective``; a search row's exported config at recompute full keeps them); the modules
    Megatron-LM accepts but that act on no layer of the model (:func:`idle`) recompute nothing."""
    field, mods = "training.recompute_modules", tuple(training.recompute_modules)
    if mods == DEFAULT:
        return ()
    if training.framework != "megatron":
        raise ConfigError(field, f"is Megatron-LM's --recompute-modules (framework \"megatron\"); framework "
                                 f"{training.framework!r} plans recompute by training.recompute alone: remove it")
    if training.recompute != "selective":
        return (f"training.recompute_modules {' '.join(mods)} not planned: recompute is {training.recompute!r}, and "
                f"Megatron-LM reads --recompute-modules only under --recompute-granularity selective",)
    why = check_model(mods, model.is_moe, model.is_mla)
    if why is not None:
        raise ConfigError(field, why)
    dense = not model.is_moe or model.dense_layers > 0
    off = idle(mods, model.is_moe, dense, model.is_mla, model.shared_experts > 0)
    if not off:
        return ()
    return (f"training.recompute_modules {', '.join(off)}: no layer of {model.name} has {'it' if len(off) == 1 else 'them'} "
            f"as a module of its own (Megatron-LM's Transformer Engine layers), so Megatron-LM recomputes nothing "
            f"there; planned so",)
