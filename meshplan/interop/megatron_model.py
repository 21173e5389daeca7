"""Megatron-LM's model flags <-> :class:`~meshplan.spec.model.ModelSpec` (one home for both
directions; :mod:`meshplan.interop.megatron` reads and writes the rest of the arguments).

Flag names from ``megatron/training/arguments.py`` and ``TransformerConfig``
(megatron/core/transformer/transformer_config.py) at NVIDIA/Megatron-LM d98e8a6: every
ModelSpec field has its flag (``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size``,
``--num-attention-heads``, ``--kv-channels`` or the MLA dims, ``--group-query-attention``
``--num-query-groups``, ``--vocab-size``, ``--normalization``, ``--norm-epsilon``,
``--position-embedding-type``, ``--rotary-base``, ``--max-position-embeddings``, ``--swiglu``,
``--untie-embeddings-and-output-weights``, ``--disable-bias-linear``, ``--add-qkv-bias``,
``--qk-layernorm``, ``--num-experts``, ``--moe-router-topk``, ``--moe-ffn-hidden-size``,
``--moe-shared-expert-intermediate-size`` (the shared experts' total width),
``--moe-layer-freq``, ``--moe-router-num-groups`` and ``--moe-router-group-topk`` (group-limited
routing), ``--use-rope-scaling`` with ``--rope-scaling-factor``: Llama 3.1's RoPE
scaling, whose other constants Megatron-LM fixes in ``RotaryEmbedding._apply_scaling``,
megatron/core/models/common/embeddings/rotary_pos_embedding.py: low_freq_factor 1,
high_freq_factor 4, original_max_position_embeddings 8192).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import ValidationError

from meshplan import catalog
from meshplan.errors import ConfigError, printable
from meshplan.interop.common import ImportOptions, model_option
from meshplan.interop.megatron_deepspeed_args import SPELLINGS
from meshplan.spec.axes.tp import padded_vocab
from meshplan.spec.model import ModelSpec

#: Megatron-LM's multi-latent attention arguments (arguments.py) and the ModelSpec field of each:
#: ``--qk-head-dim`` is the no-RoPE part of the q/k head, ``--qk-pos-emb-head-dim`` the RoPE part.
MLA_ARGS = {"--q-lora-rank": "q_lora_rank", "--kv-lora-rank": "kv_lora_rank", "--qk-head-dim": "qk_nope_head_dim",
            "--qk-pos-emb-head-dim": "qk_rope_head_dim", "--v-head-dim": "v_head_dim"}
MLA_FLAGS = ("--multi-latent-attention", *MLA_ARGS)
#: Group-limited routing (TransformerConfig ``moe_router_num_groups``, ``moe_router_group_topk`` at d98e8a6;
#: default None: none) as ModelSpec ``n_group``, ``topk_group``.
GROUP_FLAGS = {"--moe-router-num-groups": "n_group", "--moe-router-group-topk": "topk_group"}
MODEL_FLAGS = {"--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups",
               "--group-query-attention", "--kv-channels", "--swiglu", "--untie-embeddings-and-output-weights",
               "--normalization", "--position-embedding-type", "--max-position-embeddings", "--vocab-size",
               "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--num-experts", "--moe-router-topk",
               "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size", "--moe-layer-freq", "--rotary-base",
               "--norm-epsilon", "--use-rope-scaling", "--rope-scaling-factor", *MLA_FLAGS, *GROUP_FLAGS,
               "--use-rotary-position-embeddings"}
#: Model flags whose value changes no size or cost (ModelSpec ``rope_theta``, ``norm_eps``) and Megatron-LM's
#: default of each (arguments.py ``--rotary-base`` type int, default 10000; TransformerConfig ``layernorm_epsilon``
#: ``--norm-epsilon``, default 1e-5; d98e8a6): unset in the arguments, a catalog model still matches, with a note.
CARRIED = {"--rotary-base": ("rope_theta", 10000.0), "--norm-epsilon": ("norm_eps", 1e-5)}
#: GPT-2's BPE vocabulary: 50257 tokens (Radford et al. 2019, section 2.2: "The vocabulary is
#: expanded to 50,257"), the ``len(self.tokenizer.encoder)`` of Megatron-LM's ``_GPT2BPETokenizer``
#: (megatron/training/tokenizer/tokenizer.py) with its gpt2-vocab.json; Megatron-LM pads it in
#: ``_vocab_size_with_padding`` to a multiple of ``--make-vocab-size-divisible-by`` x tp
#: (``training.vocab_pad_divisor``, :func:`meshplan.spec.axes.tp.padded_vocab`).
GPT2_VOCAB = 50257
#: pretrain_gpt.py's ``args_defaults={'tokenizer_type': 'GPT2BPETokenizer'}``: without
#: ``--tokenizer-type`` a GPT run tokenizes with GPT-2's BPE.
GPT2_TOKENIZER = "GPT2BPETokenizer"
#: The RoPE scaling Megatron-LM applies under ``--use-rope-scaling`` (d98e8a6 ``_apply_scaling``'s fixed
#: arguments; ``--rope-scaling-factor``, default 8.0, sets the factor), as RopeScaling fields.
MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position": 8192}


def _dense_layers(freq: Any, layers: Optional[int]) -> int:
    """Leading dense layers from ``--moe-layer-freq`` (Megatron-LM: an integer N, every N-th
    layer MoE, or a Python list expression of 1 (MoE) and 0 (dense) per layer): 1, or
    ``[0]*K+[1]*M`` with K + M layers (DeepSeek's first K dense layers), the forms ModelSpec
    represents; anything else is a ConfigError naming the flag.

    >>> _dense_layers("1", 61), _dense_layers("[0]*3+[1]*58", 61)
    (0, 3)
    """
    text = str(freq).replace(" ", "")
    m = re.fullmatch(r"\[0\]\*([0-9]{1,9})\+\[1\]\*([0-9]{1,9})", text)
    if text == "1":
        return 0
    if m and layers is not None and int(m.group(1)) + int(m.group(2)) == layers:
        return int(m.group(1))
    raise ConfigError("--moe-layer-freq", f"{printable(text)[:60]!r}: meshplan plans the first K layers dense and "
                      f"the rest MoE; give 1 or '[0]*K+[1]*M' with K + M = --num-layers ({layers})")


def int_flag(args: dict, flag: str) -> Optional[int]:
    """The whole number >= 1 a flag gives, or None when absent; ConfigError naming the flag."""
    v = args.get(flag)
    if v is None:
        return None
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise ConfigError(flag, f"{v!r} is not a whole number (a shell variable meshplan could not resolve?); "
                          f"write the number") from None
    if n < 1:
        raise ConfigError(flag, f"{n} must be >= 1")
    return n


def num_flag(args: dict, flag: str, default: int) -> int:
    """:func:`int_flag` with a default that is a number."""
    n = int_flag(args, flag)
    return default if n is None else n


def model_table(args: dict, opts: ImportOptions, notes: list[str]) -> dict:
    """[model] table of Megatron-LM arguments ``args``: ``--model`` (``opts``) or the model flags.
    With ``--model``, the script's own ``--max-position-embeddings`` is kept beside the model
    (``max_position``): how far the run's positions reach is a training setting, not the model's
    shape (newcomer trial 31 #2: Llama-3-70B's catalog 8192 replaced the script's 131072, then a
    note asked to raise it)."""
    if opts.model:
        given = sorted(f for f in MODEL_FLAGS if f in args and f != "--max-position-embeddings")
        if given:
            notes.append(f"--model {opts.model} replaces the model flags {', '.join(given)}")
        rows = int_flag(args, "--max-position-embeddings")
        return model_option(opts.model) | ({"max_position": rows} if rows else {})
    vocab = int_flag(args, "--vocab-size") or gpt2_vocab(args, notes)
    need = [f for f in ("--num-layers", "--hidden-size", "--num-attention-heads") if f not in args]
    need += [] if vocab else ["--vocab-size"]
    if need:
        why = " (Megatron-LM takes the vocabulary size from its tokenizer, so its arguments often lack it; meshplan " \
              "knows GPT2BPETokenizer's)" if "--vocab-size" in need else ""
        raise ConfigError("--model", f"the arguments lack the model flag{'s' * (len(need) > 1)} {', '.join(need)}"
                          f"{why}; give --model CATALOG_NAME or --model path/config.json, or add "
                          f"{'them' if len(need) > 1 else 'it'} to the arguments")
    h, heads = num_flag(args, "--hidden-size", 0), num_flag(args, "--num-attention-heads", 0)  # both given: checked above
    swiglu = bool(args.get("--swiglu"))
    ffn = int_flag(args, "--ffn-hidden-size") or (int(4 * h * 2 / 3 / 64) * 64 if swiglu else 4 * h)
    kv = int_flag(args, "--num-query-groups") if args.get("--group-query-attention") else None
    norm = str(args.get("--normalization", "LayerNorm"))
    if norm not in ("LayerNorm", "RMSNorm"):
        raise ConfigError("--normalization", f"{norm!r}; meshplan plans LayerNorm or RMSNorm")
    # --use-rotary-position-embeddings: Megatron-LM's legacy RoPE switch, which sets the type to rope
    # (arguments.py:1626-1627 at d98e8a6)
    pos = "rope" if args.get("--use-rotary-position-embeddings") else str(args.get("--position-embedding-type",
                                                                                   "learned_absolute"))
    model = {"name": "megatron-args", "layers": int_flag(args, "--num-layers"), "hidden": h, "ffn": ffn,
             "gated_mlp": swiglu, "q_heads": heads, "kv_heads": kv, "head_dim": int_flag(args, "--kv-channels"),
             "vocab": vocab,
             "tied_embeddings": not args.get("--untie-embeddings-and-output-weights", False),
             "norm": norm.lower(), "linear_bias": not args.get("--disable-bias-linear", False),
             "qkv_bias": bool(args.get("--add-qkv-bias")), "qk_norm": bool(args.get("--qk-layernorm")),
             "position_embedding": "learned" if pos == "learned_absolute" else "alibi" if pos == "alibi" else "rope",
             "max_position": num_flag(args, "--max-position-embeddings", 0),
             "rope_theta": float(int_flag(args, "--rotary-base") or 0) or None if pos not in ("learned_absolute", "alibi")
             else None,
             "norm_eps": _eps(args), "rope_scaling": _scaling(args)}
    if pos == "learned_absolute" and not model["max_position"]:
        model["max_position"] = int_flag(args, "--seq-length") or 0  # Megatron-LM: at least the sequence length
        notes.append(f"--max-position-embeddings not given: learned positions for --seq-length "
                     f"{model['max_position']}")
    if args.get("--multi-latent-attention"):  # the latent and head dims replace --kv-channels and query groups
        model |= {"head_dim": None, "kv_heads": None, **{f: int_flag(args, a) for a, f in MLA_ARGS.items()}}
    experts = int_flag(args, "--num-experts")
    if experts:
        model |= {"experts": experts, "top_k": num_flag(args, "--moe-router-topk", 2),
                  "expert_ffn": int_flag(args, "--moe-ffn-hidden-size")}
        shared = int_flag(args, "--moe-shared-expert-intermediate-size")
        if shared:
            model |= {"shared_experts": 1, "shared_expert_ffn": shared}
        if "--moe-layer-freq" in args:
            model["dense_layers"] = _dense_layers(args["--moe-layer-freq"], int_flag(args, "--num-layers"))
        model |= {f: int_flag(args, a) for a, f in GROUP_FLAGS.items()}
    model = {k: v for k, v in model.items() if v is not None}
    return _as_catalog(model, notes)


def gpt2_vocab(args: dict, notes: list[str]) -> Optional[int]:
    """:data:`GPT2_VOCAB` where the arguments tokenize with GPT-2's BPE and give no ``--vocab-size``:
    ``--tokenizer-type GPT2BPETokenizer``, or no ``--tokenizer-type`` (pretrain_gpt.py's default)
    with a ``--vocab-file`` named ``gpt2-vocab.json``; a note says so, with the padded size at the
    arguments' tp. None otherwise (another tokenizer's size is in its files).

    >>> notes = []
    >>> gpt2_vocab({"--vocab-file": "data/gpt2-vocab.json", "--tensor-model-parallel-size": "8"}, notes), notes[0]
    (50257, "--vocab-size not given: GPT-2's vocabulary, 50257 tokens (--vocab-file data/gpt2-vocab.json, pretrain_gpt.py's GPT2BPETokenizer), padded as Megatron-LM pads it to 51200 (a multiple of --make-vocab-size-divisible-by 128 x tp 8)")
    >>> gpt2_vocab({"--tokenizer-type": "HuggingFaceTokenizer", "--vocab-file": "gpt2-vocab.json"}, []) is None
    True
    """
    kind, path = args.get("--tokenizer-type"), args.get("--vocab-file")
    named = isinstance(path, str) and path.replace("\\", "/").rsplit("/", 1)[-1] == "gpt2-vocab.json"
    if kind != GPT2_TOKENIZER and not (kind is None and named):
        return None
    divisor = num_flag(args, "--make-vocab-size-divisible-by", 128)
    tp = num_flag(args, "--tensor-model-parallel-size", 1)
    said = f"--tokenizer-type {kind}" + (f", --vocab-file {printable(path)[:80]}" if path else "") if kind else \
        f"--vocab-file {printable(str(path))[:80]}, pretrain_gpt.py's {GPT2_TOKENIZER}"
    notes.append(f"--vocab-size not given: GPT-2's vocabulary, {GPT2_VOCAB} tokens ({said}), padded as Megatron-LM "
                 f"pads it to {padded_vocab(GPT2_VOCAB, divisor, tp)} (a multiple of --make-vocab-size-divisible-by "
                 f"{divisor} x tp {tp})")
    return GPT2_VOCAB


def _eps(args: dict) -> Optional[float]:
    """``--norm-epsilon`` as a number > 0, None when absent; ConfigError naming the flag."""
    v = args.get("--norm-epsilon")
    try:
        eps = None if v is None else float(v)
    except (TypeError, ValueError):
        eps = -1.0
    if eps is not None and not 0 < eps < 1:
        raise ConfigError("--norm-epsilon", f"{printable(str(v))[:40]!r} is not a norm epsilon; give a small number "
                          f"> 0 (Megatron-LM's default 1e-5)")
    return eps


def _scaling(args: dict) -> Optional[dict]:
    """RopeScaling fields of ``--use-rope-scaling`` (factor ``--rope-scaling-factor``, default
    8.0; the rest :data:`MEGATRON_ROPE_SCALING`), None without it; ConfigError naming the flag."""
    if not args.get("--use-rope-scaling"):
        return None
    v = args.get("--rope-scaling-factor", 8.0)
    try:
        factor = float(v)
    except (TypeError, ValueError):
        factor = 0.0
    if not 1 <= factor <= 1e4:
        raise ConfigError("--rope-scaling-factor", f"{printable(str(v))[:40]!r} is not a RoPE scaling factor; give a "
                          f"number >= 1 (Megatron-LM's default 8, Llama 3.1's)")
    return {"factor": factor, **MEGATRON_ROPE_SCALING}


def _as_catalog(model: dict, notes: list[str]) -> dict:
    """``{"catalog": name}`` when the flags give a catalog model's architecture exactly
    (:meth:`~meshplan.spec.model.ModelSpec.architecture`: ``--kv-channels`` equal to hidden /
    heads is a catalog model's unset head_dim), or all but the :data:`CARRIED` fields and the
    RoPE scaling they leave unset: then a note names the Megatron-LM default that differs from
    the catalog's value (the plan is the same: none changes a cost). ``--max-position-embeddings``
    is how far the run's positions reach, a training setting (:func:`model_table`, as with
    ``--model``): a catalog model it alone differs from is matched, ``{"catalog": name,
    "max_position": N}`` (newcomer trial 49: ``--max-position-embeddings 32768`` made an inline
    model, which ``compare`` then refused beside the catalog's)."""
    try:
        spec = ModelSpec(**model)
    except ValidationError:
        return model  # config_from_dict reports it with the field's name
    unset = {field for field, _ in CARRIED.values() if getattr(spec, field) is None}
    unset |= {"rope_scaling"} if spec.rope_scaling is None else set()
    arch = lambda m: {k: v for k, v in m.architecture().items() if k not in unset | {"max_position"}}
    mine = arch(spec)
    for name in catalog.names("model"):
        ref = catalog.model(name)
        if arch(ref) != mine:
            continue
        differ = [(f"{flag} (Megatron-LM's default {default:g}; {name}: {getattr(ref, field):g})",
                   f"{flag} {getattr(ref, field):g}") for flag, (field, default) in CARRIED.items()
                  if field in unset and getattr(ref, field) not in (None, default)]
        if spec.n_group is None and ref.n_group is not None:  # group-limited routing: no size, so it matched
            differ.append((f"--moe-router-num-groups (Megatron-LM's default: plain top-k routing; {name}: n_group "
                           f"{ref.n_group}, topk_group {ref.topk_group})", " ".join(
                               f"{a} {getattr(ref, f)}" for a, f in GROUP_FLAGS.items())))
        if "rope_scaling" in unset and ref.rope_scaling is not None:
            differ.append((f"--use-rope-scaling (Megatron-LM's default: off; {name}: Llama 3.1's RoPE scaling, "
                           f"factor {ref.rope_scaling.factor:g})", " ".join(_scaling_flags(ref))))
        rows = {} if spec.max_position in (0, ref.max_position) else {"max_position": spec.max_position}
        reach = (f", with max_position {spec.max_position} (--max-position-embeddings; the catalog's "
                 f"{ref.max_position})" if rows else "")
        if not differ:
            notes.append(f"the model flags give catalog model {name} exactly{reach}")
        else:
            said = ", ".join(d for d, _ in differ)
            same = ("the same costs but a deepep dispatch's bytes" if spec.n_group is None and ref.n_group is not None
                    else "the same costs")
            notes.append(f"the model flags give catalog model {name}{reach} but not {said}: planned as {name} "
                         f"({same}); add {' '.join(a for _, a in differ)} to train it")
        return {"catalog": name} | rows
    return model


def unstated(m: ModelSpec, args: dict) -> dict[str, None]:
    """The fields of ``m`` that it leaves unset and Megatron-LM arguments ``args`` (parsed) do
    not state either: a :data:`CARRIED` field without its flag, ``rope_scaling`` without
    ``--use-rope-scaling``. Arguments with a catalog model's layout read back as that model
    (:func:`_as_catalog`), whose values for these fields no flag wrote, so an export's round
    trip sets them back to unset (None) before comparing: Megatron-LM runs its own default there
    (``--rotary-base`` 10000), not the catalog's.

    >>> m = ModelSpec(**{**catalog.model("mixtral-8x7b").model_dump(), "name": "my-moe", "rope_theta": None})
    >>> unstated(m, {"--num-layers": "32"}), unstated(m, {"--rotary-base": "10000", "--use-rope-scaling": True})
    ({'rope_theta': None, 'rope_scaling': None}, {})
    """
    args = {SPELLINGS.get(k, k): v for k, v in args.items()}  # Megatron-DeepSpeed's spellings of them too
    out = {field: None for flag, (field, _) in CARRIED.items() if getattr(m, field) is None and flag not in args}
    return out | ({"rope_scaling": None} if m.rope_scaling is None and not args.get("--use-rope-scaling") else {})


def _scaling_flags(m: ModelSpec) -> list[str]:
    """``--use-rope-scaling --rope-scaling-factor F`` for ``m.rope_scaling`` (none without it);
    ConfigError when a constant other than the factor is not Megatron-LM's fixed one."""
    rs = m.rope_scaling
    if rs is None:
        return []
    other = {k: getattr(rs, k) for k, v in MEGATRON_ROPE_SCALING.items() if getattr(rs, k) != v}
    if other:
        raise ConfigError("--to", f"model.rope_scaling {', '.join(f'{k} {v:g}' for k, v in other.items())}: Megatron-LM "
                          f"fixes low_freq_factor 1, high_freq_factor 4 and original_max_position 8192 (only "
                          f"--rope-scaling-factor is a flag); use Llama 3.1's values or another framework")
    return ["--use-rope-scaling", f"--rope-scaling-factor {rs.factor:g}"]


def _rotary_base(theta: float) -> int:
    """``model.rope_theta`` as Megatron-LM's ``--rotary-base`` (``type=int``), or ConfigError."""
    if theta != int(theta):
        raise ConfigError("--to", f"model.rope_theta {theta:g} is not a whole number: Megatron-LM's --rotary-base "
                          f"takes an integer")
    return int(theta)


#: ``--position-embedding-type`` of each ``model.position_embedding``: Megatron-LM's ``rope`` and
#: ``learned_absolute``; ``alibi`` is BigScience's Megatron-DeepSpeed's (its ``PositionEmbeddingType``),
#: which Megatron-LM's parser refuses.
POSITION_FLAG = {"rope": "rope", "learned": "learned_absolute", "alibi": "alibi"}


def model_flags(m: ModelSpec, seq_len: int) -> list[str]:
    """Megatron-LM's flags of model ``m`` (the inverse of :func:`model_table`);
    ``--max-position-embeddings`` at least ``seq_len`` (Megatron-LM asserts it)."""
    heads = (["--multi-latent-attention"] + [f"{a} {getattr(m, f)}" for a, f in MLA_ARGS.items()
                                              if getattr(m, f) is not None]) if m.is_mla else [f"--kv-channels {m.d_head}"]
    out = [f"--num-layers {m.layers}", f"--hidden-size {m.hidden}", f"--ffn-hidden-size {m.ffn}",
           f"--num-attention-heads {m.q_heads}", *heads, f"--vocab-size {m.vocab}",
           f"--normalization {'RMSNorm' if m.norm == 'rmsnorm' else 'LayerNorm'}",
           f"--position-embedding-type {POSITION_FLAG[m.position_embedding]}"]
    out += [f"--rotary-base {_rotary_base(m.rope_theta)}"] if m.rope_theta is not None else []
    out += [f"--norm-epsilon {m.norm_eps:g}"] if m.norm_eps is not None else []
    out += _scaling_flags(m)
    out += [f"--max-position-embeddings {max(m.max_position, seq_len)}"] if m.max_position else []
    out += ["--group-query-attention", f"--num-query-groups {m.kv_heads}"] if m.kv_heads else []
    out += ["--swiglu"] * m.gated_mlp + ["--untie-embeddings-and-output-weights"] * (not m.tied_embeddings)
    out += ["--disable-bias-linear"] * (not m.linear_bias) + ["--add-qkv-bias"] * m.qkv_bias
    out += ["--qk-layernorm"] * m.qk_norm
    if m.is_moe:
        out += [f"--num-experts {m.experts}", f"--moe-router-topk {m.top_k}"]
        out += [f"--moe-ffn-hidden-size {m.expert_ffn}"] if m.expert_ffn else []  # Megatron: default ffn
        if m.shared_experts:
            out.append(f"--moe-shared-expert-intermediate-size {(m.shared_expert_ffn or m.moe_ffn) * m.shared_experts}")
        if m.dense_layers:  # DeepSeek's leading dense layers, quoted for the shell
            out.append(f"--moe-layer-freq '[0]*{m.dense_layers}+[1]*{m.layers - m.dense_layers}'")
        out += [f"{a} {getattr(m, f)}" for a, f in GROUP_FLAGS.items() if getattr(m, f) is not None]
    return out
