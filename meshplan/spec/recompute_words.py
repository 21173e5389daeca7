"""The recompute policy (``training.recompute``) in the words of the runtime the plan models:
torchtitan's activation checkpointing, Megatron-LM's recompute flags, DeepSpeed's activation
checkpointing (:func:`recompute_words`, which
:attr:`~meshplan.spec.training.TrainingSpec.recompute_name` and the plan, memory, step and search
text read), and what an export to a DeepSpeed JSON, which cannot hold the policy, says to apply
instead (:func:`deepspeed_recompute_fix`). Which runtime's words: :func:`meshplan.spec.wording.runtime`.

DeepSpeed's words (deepspeed.ai/docs/config-json, "Activation Checkpointing"):
``deepspeed.checkpointing.checkpoint`` is *activation checkpointing*, which the model code calls
on the blocks it chooses (an ``activation_checkpointing`` section configures it).
"""

from __future__ import annotations

from meshplan.spec.recompute_modules import DEFAULT
from meshplan.spec.wording import DEEPSPEED

#: What each of Megatron-LM's recompute modules replays (:mod:`meshplan.spec.recompute_modules`).
MODULE_WORDS = {"core_attn": "attention core", "moe_act": "routed experts' activation (output discarded)",
                "layernorm": "separate norms (MLA's input norm, MoE layers' pre-MLP norm; output discarded)",
                "mla_up_proj": "MLA up-projections and RoPE (output discarded)", "mlp": "dense MLP",
                "moe": "MoE layer", "shared_experts": "shared experts"}


#: The ep all-to-alls in the op policy's words, by whether its replay issues them again (``replays_ep``).
_OP_EP = {False: " and ep all-to-all outputs saved",
          True: " outputs saved; the ep all-to-alls replayed with the MoE layer (this model's save list at "
                "this op_sac_policy has no all_to_all_single)"}


def recompute_words(training, rt: str, short: bool = False, replays_ep: bool = False) -> str:
    """The recompute policy ``training.recompute`` in runtime ``rt``'s words
    (:func:`meshplan.spec.wording.runtime`): DeepSpeed's (:func:`_deepspeed_recompute`), torch's
    ``selective`` (:func:`_torch_selective`), Megatron-LM's ``selective``
    (:func:`_megatron_selective`), each runtime's ``full`` (:data:`_FULL`) and torchtitan's
    ``layer`` and ``op``. DeepSpeed has no setting of its own for which blocks are checkpointed:
    the model code calls ``deepspeed.checkpointing.checkpoint`` on them. ``replays_ep``: under ``op``,
    whether the policy's save list leaves out the MoE all-to-alls, so the replay issues them again
    (:func:`meshplan.compute.recompute.op_replays_ep`, which the caller asks: v0.2.2's qwen3; newcomer
    trial nc58 #6, whose words said "saved" beside a table that replays them).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="full")
    >>> recompute_words(t, "deepspeed")
    'DeepSpeed activation checkpointing (deepspeed.checkpointing.checkpoint on every transformer layer: its input kept, the layer recomputed in backward)'
    >>> print(recompute_words(t, "torch"))
    torchtitan full activation checkpointing (activation_checkpoint.mode = "full": every TransformerBlock's input kept, the block recomputed in backward)
    >>> recompute_words(t, "megatron").split(":")[0]
    'Megatron-LM full recompute (--recompute-granularity full --recompute-method uniform --recompute-num-layers 1'

    ``short``: the same in a few words, where the output says it in full elsewhere. Megatron-LM's
    block recompute (``recompute_num_layers``) in its flags under any runtime (framework megatron,
    Megatron-DeepSpeed's the same):

    >>> b = TrainingSpec(global_batch=8, seq_len=16, recompute="full", framework="megatron", recompute_num_layers=2)
    >>> recompute_words(b, "megatron")
    'Megatron-LM block recompute (--recompute-granularity full --recompute-method block --recompute-num-layers 2: the first 2 layers of each model chunk keep their input only and are recomputed in backward, the others keep all their activations)'
    """
    if training.recompute == "full" and training.recompute_num_layers is not None:
        n = training.recompute_num_layers
        return (f"Megatron-LM block recompute (--recompute-granularity full --recompute-method block "
                f"--recompute-num-layers {n}: the first {n} layers of each model chunk keep their input only and are "
                f"recomputed in backward, the others keep all their activations)")
    if rt == DEEPSPEED:
        return _deepspeed_recompute(training)
    if rt == "torch" and training.recompute == "selective":
        return _torch_selective(training, short)
    return {"none": "no activation checkpointing",
            "selective": _megatron_selective(training),
            "full": _FULL[rt] if rt in _FULL else _FULL["torch"],
            "layer": f"torchtitan selective AC per layer (mode = \"selective\", selective_ac_option = "
                     f"\"{training.ac_freq}\": every {training.ac_freq} layer(s) checkpointed in full)",
            "op": "torchtitan selective AC per op (mode = \"selective\", selective_ac_option = \"op\": "
                  "matmul outputs saved but every second mm (the MoE router's gate always recomputed), SDPA, tp "
                  f"reduce-scatter{_OP_EP[replays_ep]}, the rest recomputed, tp all-gathers and the "
                  "routed experts' grouped GEMMs included)",
            }[training.recompute]


def _megatron_selective(training) -> str:
    """``recompute = "selective"`` in Megatron-LM's words: ``--recompute-activations`` for the
    default modules (core attention), else ``--recompute-granularity selective
    --recompute-modules`` with what each replays (:data:`MODULE_WORDS`). With flash attention
    the flash forward is replayed in backward: Megatron-Core wraps the core attention in
    ``tensor_parallel.checkpoint`` whenever ``recompute_granularity == "selective"`` and
    ``"core_attn"`` is in ``recompute_modules`` (the default), whatever the backend
    (megatron/core/transformer/attention.py at d98e8a6, ``checkpoint_core_attention``); only the
    legacy model (megatron/legacy/model/transformer.py, removed in 8de8238) skipped the
    checkpoint on its ``--use-flash-attn`` path.

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, recompute="selective")
    >>> _megatron_selective(t.model_copy(update={"flash_attention": False}))
    'Megatron-LM selective recompute (--recompute-activations: attention core)'
    >>> _megatron_selective(t.model_copy(update={"recompute_modules": ("core_attn", "mlp")}))
    'Megatron-LM selective recompute (--recompute-granularity selective --recompute-modules core_attn mlp: attention core, dense MLP)'
    """
    core = ("attention core; flash kernels included: Megatron-Core checkpoints core_attn for every attention "
            "backend, megatron/core/transformer/attention.py" if training.flash_attention else "attention core")
    modules = tuple(training.recompute_modules)
    return f"Megatron-LM selective recompute (--recompute-activations: {core})" if modules == DEFAULT else (
        f"Megatron-LM selective recompute (--recompute-granularity selective --recompute-modules {' '.join(modules)}: "
        + ", ".join(MODULE_WORDS[m] for m in modules) + ")")


def _torch_selective(training, short: bool) -> str:
    """``recompute = "selective"`` under torch: the same model, Megatron-LM's core-attention
    recompute, which torchtitan has no option for (its selective AC,
    ``activation_checkpoint.mode = "selective"``, is ``op`` or ``layer``: :data:`_TORCH_SELECTIVE`);
    ``short``: :data:`_TORCH_SELECTIVE_SHORT`.

    >>> from meshplan.spec.training import TrainingSpec
    >>> print(_torch_selective(TrainingSpec(global_batch=8, seq_len=16, recompute="selective"), False))
    attention-core recompute, modelled as Megatron-LM's selective recompute (--recompute-activations): the attention core's forward (the flash kernel) replayed in backward, its softmax statistics not kept, the other activations kept; torchtitan has no such option: its selective AC (activation_checkpoint.mode = "selective") is recompute "op" (selective_ac_option = "op") or "layer" (selective_ac_option = "<ac_freq>"); the nearest torchtitan setting is mode = "none" (the same activations kept, and the flash softmax statistics too; the attention not replayed: what export --to torchtitan writes)
    """
    if short:
        return _TORCH_SELECTIVE_SHORT
    return _TORCH_SELECTIVE.format(_TORCH_CORE[training.flash_attention], _TORCH_NEAREST[training.flash_attention])


#: ``recompute = "selective"`` under torch: what meshplan models (Megatron-LM's core-attention
#: recompute, Korthikanti et al. 2022 section 5: the attention core's forward replayed in backward,
#: its score tensors not kept, :func:`meshplan.memory.activations.layer_terms` and
#: :mod:`meshplan.compute.ops`), said to be Megatron-LM's, since torchtitan has no such option:
#: its ``[activation_checkpoint] mode = "selective"`` takes ``selective_ac_option = "op"``
#: (op-level SAC, meshplan's ``op``) or a layer frequency (meshplan's ``layer``;
#: torchtitan/distributed/activation_checkpoint.py, pytorch/torchtitan at e347b1e).
_TORCH_SELECTIVE = ("attention-core recompute, modelled as Megatron-LM's selective recompute "
                    "(--recompute-activations): {}, the other activations kept; torchtitan has no such option: its "
                    "selective AC (activation_checkpoint.mode = \"selective\") is recompute \"op\" "
                    "(selective_ac_option = \"op\") or \"layer\" (selective_ac_option = \"<ac_freq>\"); the "
                    "nearest torchtitan setting is {}")
#: The nearest torchtitan setting to :data:`_TORCH_SELECTIVE`, by ``training.flash_attention``: what
#: ``export --to torchtitan`` writes (:func:`meshplan.interop.torchtitan_tables.write_recompute`), the
#: mode that keeps what the plan keeps.
_TORCH_NEAREST = {True: "mode = \"none\" (the same activations kept, and the flash softmax statistics too; the "
                        "attention not replayed: what export --to torchtitan writes)",
                  False: "mode = \"full\" (without flash attention the nearest that keeps no more than this plan: "
                         "what export --to torchtitan writes)"}
#: :data:`_TORCH_SELECTIVE` in a few words, where a longer line of the same output says it in full
#: (``recompute_words(..., short=True)``: plan's train line, before its activations line).
_TORCH_SELECTIVE_SHORT = ("Megatron-LM's attention-core selective recompute, which torchtitan has no option for: "
                          "the activations line says how it is modelled")
#: What :data:`_TORCH_SELECTIVE` replays and drops, by ``training.flash_attention``: with flash
#: the kept score tensor is the fp32 softmax statistics, without it the softmax output (and, with
#: dropout, its mask and output).
_TORCH_CORE = {True: "the attention core's forward (the flash kernel) replayed in backward, its softmax statistics "
                     "not kept",
               False: "the attention core's forward replayed in backward, its softmax output (and dropout tensors) "
                      "not kept"}


#: ``recompute = "full"`` in each runtime's own words: torchtitan wraps every TransformerBlock in
#: ``checkpoint_wrapper`` under ``[activation_checkpoint] mode = "full"`` (``_apply_full_ac``,
#: torchtitan/distributed/activation_checkpoint.py, pytorch/torchtitan at e347b1e); Megatron-LM
#: recomputes every layer with ``--recompute-granularity full --recompute-method uniform
#: --recompute-num-layers 1`` (what ``export --to megatron`` writes, :mod:`meshplan.interop.megatron`).
_FULL = {"torch": "torchtitan full activation checkpointing (activation_checkpoint.mode = \"full\": every "
                  "TransformerBlock's input kept, the block recomputed in backward)",
         "megatron": "Megatron-LM full recompute (--recompute-granularity full --recompute-method uniform "
                     "--recompute-num-layers 1: every layer's input kept, the layer recomputed in backward)"}


def _deepspeed_recompute(training) -> str:
    """:func:`recompute_words` under DeepSpeed."""
    call = "deepspeed.checkpointing.checkpoint"
    return {"none": "no activation checkpointing",
            "selective": f"activation checkpointing of the attention core only (the model code's {call} around "
                         f"it{', flash kernels included' if training.flash_attention else ''})",
            "full": f"DeepSpeed activation checkpointing ({call} on every transformer layer: its input kept, the "
                    f"layer recomputed in backward)",
            "layer": f"DeepSpeed activation checkpointing of every {training.ac_freq} layer(s) ({call} on them)",
            "op": "op-level activation checkpointing (matmul outputs saved but every second mm, SDPA outputs "
                  "saved, the rest recomputed)",
            }[training.recompute]


def deepspeed_recompute_fix(training) -> str:
    """Why a DeepSpeed JSON does not hold ``training.recompute`` and where it goes instead:
    DeepSpeed's JSON does not choose which blocks are checkpointed (the model code calls
    ``deepspeed.checkpointing.checkpoint``, or Megatron-DeepSpeed's ``--checkpoint-activations``
    does, or the HF Trainer's ``--gradient_checkpointing``); meshplan writes no
    ``activation_checkpointing`` section (no key turns checkpointing on: the section only
    configures ``deepspeed.checkpointing``'s calls), ``full`` read back with ``import
    --gradient-checkpointing`` (:func:`meshplan.interop.deepspeed_auto.hf_recompute`), anything
    else as ``none`` (:func:`meshplan.interop.deepspeed._recompute`). What ``export
    --to deepspeed`` appends to ``not expressed in deepspeed: training.recompute ...`` and
    ``meshplan search`` says of such rows.

    >>> from meshplan.spec.training import TrainingSpec
    >>> deepspeed_recompute_fix(TrainingSpec(global_batch=8, seq_len=16, recompute="none"))
    "DeepSpeed's JSON does not choose activation checkpointing, the model code does: apply no activation checkpointing there"
    """
    return (f"DeepSpeed's JSON does not choose activation checkpointing, the model code does: apply "
            f"{_deepspeed_recompute(training)} there")
