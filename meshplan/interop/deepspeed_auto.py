"""The Hugging Face Trainer's ``"auto"`` values in a DeepSpeed JSON, read as the Trainer fills them.

A DeepSpeed config written for the HF Trainer (``TrainingArguments(deepspeed=...)``) says
``"auto"`` where the Trainer fills the value in before ``deepspeed.initialize``
(huggingface/transformers at 3a80c166389f65756701d6afe22bc6ec954603da,
``src/transformers/integrations/deepspeed.py``, class ``HfTrainerDeepSpeedConfig``):

- ``trainer_config_finalize`` fills the keys that depend on the model's hidden size ``h``
  (``model.config.hidden_size``; meshplan's ``[model] hidden`` of ``--model``)
  (:data:`HIDDEN_RULES`): ``zero_optimization.reduce_bucket_size = h * h`` at every stage, and
  at ZeRO stage 3 only ``stage3_prefetch_bucket_size = int(0.9 * h * h)`` and
  ``stage3_param_persistence_threshold = 10 * h`` (at stages 0-2 those two stay ``"auto"``).
  :func:`fill_hidden` reads them so, with one line saying so (``DeepSpeed "auto" read as the HF
  Trainer fills it (h = 4096): reduce_bucket_size = h^2 = 16,777,216 ...``), where they were
  read before as DeepSpeed's own defaults (5e8, 5e7, 1e5). meshplan models the first two
  (``[memory] grad_bucket_elements``, ``deepspeed_prefetch_elements``); the persistence threshold
  of the ZeRO-3 engine an import plans is not modelled (listed as unused, carried on export).
- ``trainer_config_process`` fills the batch keys from the Trainer's command line:
  ``train_micro_batch_size_per_gpu`` from ``--per_device_train_batch_size``,
  ``gradient_accumulation_steps`` from ``--gradient_accumulation_steps``, and ``train_batch_size``
  as world x the two (DeepSpeed's rule), refusing a number that disagrees (``fill_match``).
  meshplan takes those two values from ``--micro-batch`` and ``--grad-accum`` (:func:`fill_batch`);
  an ``"auto"`` the other keys do not determine, without its flag, is a one-line error naming the
  key and the flag.
- ``bf16.enabled`` and ``fp16.enabled`` are filled from ``--bf16`` and ``--fp16`` (``fill_match``
  of ``args.bf16 or args.bf16_full_eval``, ``args.fp16 or args.fp16_full_eval``; both false
  unset): meshplan takes them from ``--dtype`` (:func:`fill_dtype`), an ``"auto"`` without it is a
  one-line error naming the key and the option.
- ``gradient_clipping`` is filled from ``--max_grad_norm`` (1.0 by default): read as clipping on
  (:func:`meshplan.interop.deepspeed._clip`).

``export --to deepspeed`` of a plan read from such a file writes ``"auto"`` back at each of
those keys whose written value is what ``"auto"`` was read as (:func:`keep_auto`), so the file
stays the Trainer's; a plan that changed one (another bucket, no clipping) writes its number.
The batch keys are written as numbers (the Trainer checks them against its arguments).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from meshplan import catalog
from meshplan.errors import ConfigError
from meshplan.interop.common import model_option
from meshplan.spec.hf import model_from_hf_config

#: HF Trainer's hidden-size rules (module docstring): dotted key -> (rule as printed, value of h,
#: whether only at ZeRO stage 3).
HIDDEN_RULES: dict[str, tuple[str, Callable[[int], int], bool]] = {
    "zero_optimization.reduce_bucket_size": ("h^2", lambda h: h * h, False),
    "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9 h^2)", lambda h: int(0.9 * h * h), True),
    "zero_optimization.stage3_param_persistence_threshold": ("10 h", lambda h: 10 * h, True),
}
#: The batch keys the Trainer fills from its command line -> meshplan's flag and the Trainer's.
BATCH_FLAGS = {"train_micro_batch_size_per_gpu": ("--micro-batch", "--per_device_train_batch_size"),
               "gradient_accumulation_steps": ("--grad-accum", "--gradient_accumulation_steps")}


def _stage(d: dict) -> Any:
    zero = d.get("zero_optimization")
    return zero.get("stage", 0) if isinstance(zero, dict) else 0


def hidden_auto(d: dict) -> list[str]:
    """The keys of :data:`HIDDEN_RULES` that DeepSpeed config ``d`` gives as ``"auto"`` and the
    Trainer fills at its stage.

    >>> hidden_auto({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
    ...                                    "stage3_prefetch_bucket_size": "auto"}})
    ['zero_optimization.reduce_bucket_size']
    """
    zero = d.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    return [k for k, (_, _, only3) in HIDDEN_RULES.items()
            if zero.get(k.split(".")[1]) == "auto" and (_stage(d) == 3 or not only3)]


def hidden_of(model: str) -> int:
    """``h``, the hidden size of ``--model`` (a catalog name or a Hugging Face config.json), as
    the Trainer reads ``model.config.hidden_size``."""
    table = model_option(model)
    if "catalog" in table:
        return catalog.model(table["catalog"]).hidden
    return model_from_hf_config(table["hf_config"]).hidden


def fill_hidden(d: dict, hidden: int) -> tuple[dict, Optional[str]]:
    """(``d`` with each ``"auto"`` of :func:`hidden_auto` replaced by the Trainer's value for
    ``hidden``, the line saying so; None when there is none).

    >>> doc, line = fill_hidden({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
    ...                          "stage3_prefetch_bucket_size": "auto"}}, 4096)
    >>> doc["zero_optimization"]
    {'stage': 3, 'reduce_bucket_size': 16777216, 'stage3_prefetch_bucket_size': 15099494}
    >>> line
    'DeepSpeed "auto" read as the HF Trainer fills it (h = 4096, the model\\'s hidden size): reduce_bucket_size = h^2 = 16,777,216, stage3_prefetch_bucket_size = int(0.9 h^2) = 15,099,494'
    """
    keys = hidden_auto(d)
    if not keys:
        return d, None
    zero = dict(d["zero_optimization"])
    said = []
    for key in keys:
        rule, value, _ = HIDDEN_RULES[key]
        name = key.split(".")[1]
        zero[name] = value(hidden)
        said.append(f"{name} = {rule} = {zero[name]:,}" + (" (not modelled)" if "persistence" in name else ""))
    return d | {"zero_optimization": zero}, (f'DeepSpeed "auto" read as the HF Trainer fills it (h = {hidden}, the '
                                             f"model's hidden size): " + ", ".join(said))


def fill_batch(d: dict, micro: Optional[int], accum: Optional[int]) -> dict:
    """``d`` with its batch ``"auto"`` values as the Trainer fills them (module docstring):
    ``train_micro_batch_size_per_gpu`` from ``micro`` (``--micro-batch``),
    ``gradient_accumulation_steps`` from ``accum`` (``--grad-accum``), ``train_batch_size`` left
    to DeepSpeed's rule (removed). A flag that disagrees with the file's number, or an ``"auto"``
    the other keys do not determine and no flag fills, is a ConfigError naming the key and the
    flag.

    >>> fill_batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    ...             "gradient_accumulation_steps": "auto"}, 2, 4)
    {'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 4}
    >>> fill_batch({"train_batch_size": 256, "train_micro_batch_size_per_gpu": "auto",
    ...             "gradient_accumulation_steps": 16}, None, None)
    {'train_batch_size': 256, 'gradient_accumulation_steps': 16}
    >>> fill_batch({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}, None, None)
    Traceback (most recent call last):
    meshplan.errors.ConfigError: train_micro_batch_size_per_gpu: "auto" is filled by the HF Trainer from its --per_device_train_batch_size; pass that value as --micro-batch N
    """
    out = dict(d)
    for key, given in (("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", accum)):
        flag = BATCH_FLAGS[key][0]
        if given is None:
            continue
        if key in out and out[key] != "auto" and out[key] != given:
            raise ConfigError(key, f"is {out[key]!r} in the file, {flag} says {given} (the HF Trainer refuses the "
                              f"mismatch); give one of them")
        out[key] = given
    auto = [k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps") if out.get(k) == "auto"]
    if auto and (out.get("train_batch_size") in (None, "auto") or len(auto) > 1):
        for key in auto:  # not determined by DeepSpeed's rule: the flag says it
            flag, hf = BATCH_FLAGS[key]
            raise ConfigError(key, f"\"auto\" is filled by the HF Trainer from its {hf}; pass that value as {flag} N")
    return {k: v for k, v in out.items() if v != "auto" or k not in (*BATCH_FLAGS, "train_batch_size")}


def fill_dtype(d: dict, dtype: Optional[str]) -> dict:
    """``d`` with ``bf16.enabled`` / ``bfloat16.enabled`` / ``fp16.enabled`` ``"auto"`` as the HF
    Trainer fills them from ``--bf16`` / ``--fp16``, which ``dtype`` (``--dtype``: bf16, fp16,
    fp32) says (module docstring); a given ``dtype`` that disagrees with the file's true or false
    is a ConfigError naming the key (the Trainer refuses the mismatch); ``dtype`` None leaves
    ``"auto"`` to :func:`meshplan.interop.deepspeed.model_dtype`'s error.

    >>> fill_dtype({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, "bf16")
    {'bf16': {'enabled': True}, 'fp16': {'enabled': False}}
    >>> fill_dtype({"bf16": {"enabled": False}}, "bf16")
    Traceback (most recent call last):
    meshplan.errors.ConfigError: bf16.enabled: is false in the file, --dtype says bf16 (the HF Trainer refuses the mismatch); give one of them
    """
    out = dict(d)
    for key in ("bf16", "bfloat16", "fp16"):
        table = out.get(key)
        if dtype is None or not isinstance(table, dict) or "enabled" not in table:
            continue
        want = dtype == key[:2] + "16" if key != "bfloat16" else dtype == "bf16"
        if table["enabled"] == "auto":
            out[key] = {**table, "enabled": want}
        elif bool(table["enabled"]) != want:
            raise ConfigError(f"{key}.enabled", f"is {str(bool(table['enabled'])).lower()} in the file, --dtype says "
                              f"{dtype} (the HF Trainer refuses the mismatch); give one of them")
    return out


def keep_auto(user: dict, written: dict, hidden: int) -> dict:
    """``written`` (a DeepSpeed export) with ``"auto"`` back at each key where the user's file
    ``user`` had it and ``written`` holds what it was read as (:func:`fill_hidden`'s value for
    ``hidden``; ``gradient_clipping``: clipping on); any other key as written.

    >>> user = {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}, "gradient_clipping": "auto"}
    >>> keep_auto(user, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 16777216},
    ...                  "gradient_clipping": 1.0}, 4096)
    {'zero_optimization': {'stage': 2, 'reduce_bucket_size': 'auto'}, 'gradient_clipping': 'auto'}
    >>> keep_auto(user, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 500000000}}, 4096)
    {'zero_optimization': {'stage': 2, 'reduce_bucket_size': 500000000}}
    """
    out = dict(written)
    filled, _ = fill_hidden(user, hidden)
    zero, mine = written.get("zero_optimization"), user.get("zero_optimization")
    if isinstance(zero, dict) and isinstance(mine, dict):
        back = {k: "auto" for k, v in zero.items() if mine.get(k) == "auto" and f"zero_optimization.{k}" in HIDDEN_RULES
                and filled["zero_optimization"].get(k) == v}
        out["zero_optimization"] = zero | back
    if user.get("gradient_clipping") == "auto" and isinstance(written.get("gradient_clipping"), (int, float)) and \
            written["gradient_clipping"] > 0:
        out["gradient_clipping"] = "auto"
    return out


def runs_hf_trainer(d: dict, gradient_checkpointing: Optional[bool]) -> bool:
    """Whether DeepSpeed config ``d`` is run by the HF Trainer: a value ``"auto"`` anywhere in it
    (what only the Trainer fills, module docstring; its model code, :func:`model_code`) or
    ``--gradient-checkpointing`` given (the Trainer's flag: its recompute, :func:`hf_recompute`,
    without changing the model code a file without "auto" is planned with, so that an export's
    round trip, which re-imports ``full`` with the flag, gives back the plan's). Read before any
    ``"auto"`` is filled.

    >>> runs_hf_trainer({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}, None)
    True
    >>> runs_hf_trainer({"train_batch_size": 8}, None), runs_hf_trainer({"train_batch_size": 8}, True)
    (False, True)
    """
    def has_auto(v: Any) -> bool:
        return v == "auto" if not isinstance(v, dict) else any(has_auto(x) for x in v.values())
    return bool(gradient_checkpointing) or has_auto(d)


def model_code(hf: bool) -> tuple[dict, str]:
    """(the ``[training]`` keys of the model code planned, the note line naming it and the key
    that changes it). The HF Trainer (``hf``, :func:`runs_hf_trainer`) trains HF transformers'
    model classes, whose ``LlamaRMSNorm`` is the decomposed norm: ``hidden_states.to(torch.float32)``,
    ``pow(2).mean(-1, keepdim=True)``, ``* torch.rsqrt(variance + eps)``, ``self.weight *
    hidden_states.to(input_dtype)`` (huggingface/transformers at 5dd4a63548857797727ae73eeb6a6e886ea02a3e,
    ``src/transformers/models/llama/modeling_llama.py:60-74``), one kernel each uncompiled (the
    Trainer compiles only with ``--torch_compile``): ``training.torch_norm = "decomposed"``
    (:mod:`meshplan.compute.torch_eager`). The rest of its decoder layer is the eager torch layer
    meshplan plans (SwiGLU ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, SDPA, the same file); its
    RoPE (``rotate_half``) is timed as torchtitan's. Its SDPA reads K and V at the KV heads, ``[memory]
    kv_expanded`` left false (:func:`meshplan.spec.axes.tp.sdpa_kv_heads`: no ``repeat_kv`` copy, memory
    and the cp rows alike): ``sdpa_attention_forward`` repeats them only where ``use_gqa_in_sdpa`` is false,
    else passes ``enable_gqa=True`` (huggingface/transformers 00c238bd
    ``src/transformers/integrations/sdpa_attention.py``), and that is true on CUDA with torch >= 2.5 where
    the attention mask is None, which ``masking_utils.sdpa_mask`` returns for a batch with no padded token
    (00c4411c ``src/transformers/masking_utils.py``, ``allow_is_causal_skip`` and ``_ignore_causal_mask_sdpa``:
    not tracing, padding mask None or all ones, query length = key length), the fixed-length
    sequences meshplan plans; a padded batch gets a mask, ``repeat_kv`` and the math or efficient
    backend (not planned). Otherwise torchtitan's
    model code (torch's fused ``nn.RMSNorm``), with a note naming the key (newcomer trial nc52 #8:
    an HF Trainer config was planned with the fused norm, 33.60 s against 35.80 s decomposed).

    >>> model_code(True)[0], model_code(False)[0]
    ({'torch_norm': 'decomposed'}, {})
    """
    if hf:
        return {"torch_norm": "decomposed"}, (
            "model code: the HF Trainer's, HF transformers' (its LlamaRMSNorm upcasts, squares, averages and "
            "scales in separate kernels: training.torch_norm = \"decomposed\"; set \"fused\" for a model whose "
            "norm is torch's nn.RMSNorm, as torchtitan's)")
    return {}, ("model code: torchtitan's (torch's fused nn.RMSNorm, training.torch_norm = \"fused\"); an HF "
                "transformers model (the HF Trainer's) runs the decomposed LlamaRMSNorm: set training.torch_norm = "
                "\"decomposed\"")


def hf_recompute(d: dict, gradient_checkpointing: Optional[bool]) -> tuple[str, list[str]]:
    """(``training.recompute``, its note) of DeepSpeed config ``d`` run by the HF Trainer. The
    Trainer checkpoints activations only with its ``--gradient_checkpointing``
    (``TrainingArguments.gradient_checkpointing``, default false: ``_inner_training_loop`` calls
    ``self.model.gradient_checkpointing_enable(...)`` when it is set, huggingface/transformers at
    000945a9b726d87a93e61e873b88ff8f3cd411b5 ``src/transformers/trainer.py``), after which
    ``LlamaModel.forward`` runs every decoder layer through ``self._gradient_checkpointing_func``
    (5dd4a63 ``modeling_llama.py``): each layer's input kept, the layer recomputed in backward,
    meshplan's ``full``. meshplan's ``--gradient-checkpointing`` says it (``gradient_checkpointing``).
    An ``activation_checkpointing`` section does not: it configures ``deepspeed.checkpointing``,
    which HF's model code never calls, and the Trainer's DeepSpeed glue does not read it
    (``integrations/deepspeed.py``, ``HfTrainerDeepSpeedConfig``).

    >>> hf_recompute({}, True)[0], hf_recompute({"activation_checkpointing": {}}, None)[0]
    ('full', 'none')
    """
    section = (" (the activation_checkpointing section configures deepspeed.checkpointing, which HF's model code "
               "does not call)") if CHECKPOINTING in d else ""
    if gradient_checkpointing:
        return "full", ["--gradient-checkpointing: the HF Trainer's --gradient_checkpointing checkpoints every decoder "
                        "layer (its input kept, the layer recomputed in backward): recompute = \"full\"" + section]
    return "none", ["the HF Trainer checkpoints activations only with its --gradient_checkpointing, not given here: "
                    "recompute = \"none\" (pass --gradient-checkpointing if the run sets it)" + section]


#: DeepSpeed's activation-checkpointing section (``deepspeed.checkpointing``'s settings).
CHECKPOINTING = "activation_checkpointing"
