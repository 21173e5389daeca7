"""Megatron-DeepSpeed's own spellings of the model flags, and how an import tells its arguments from
Megatron-LM's (newcomer trial 52 #1).

microsoft/Megatron-DeepSpeed f4157be ``megatron/arguments.py`` (:data:`SOURCE`) forked Megatron-LM in
2023 and spells the model its own way; its ``parse_args`` is strict (``parser.parse_args()``,
arguments.py:57-60), so a Megatron-LM spelling stops every rank at start-up, and a Megatron-DeepSpeed
spelling read as Megatron-LM's would plan another model:

========================================== ===================================================
Megatron-DeepSpeed (arguments.py line)     meaning (Megatron-LM d98e8a6's spelling)
========================================== ===================================================
--num-key-value-heads N (623-624)          GQA with N kv heads, unset: the query heads (444-445)
                                             (--group-query-attention --num-query-groups N)
--use-rotary-position-embeddings (630)     RoPE, and no learned position table: parse_args sets
                                             add_position_embedding False (314-317)
                                             (--position-embedding-type rope)
--rotary-position-embeddings-theta (634)   the RoPE base, default 10000 (--rotary-base)
--no-position-embedding (640-643)          no position embedding at all (NoPE): meshplan plans
                                             none, so refused without --use-rotary-position-embeddings
--normalization layernorm|rmsnorm (647)    choices lower case (--normalization LayerNorm|RMSNorm)
--layernorm-epsilon (652)                  the norm's epsilon, default 1e-5 (--norm-epsilon)
========================================== ===================================================

``--num-layers``, ``--hidden-size``, ``--ffn-hidden-size`` (unset: 4h, or 2/3 of it rounded down to
64 under ``--swiglu``, arguments.py:286-296, as Megatron-LM), ``--num-attention-heads``,
``--kv-channels``, ``--swiglu``, ``--untie-embeddings-and-output-weights``, ``--disable-bias-linear``
(937-939), ``--max-position-embeddings`` and ``--vocab-size`` are spelt as Megatron-LM spells them
and read as they are. Megatron-LM's model flags that Megatron-DeepSpeed's parser lacks
(:data:`LM_ONLY`) are a ConfigError naming its spelling, or that it has none; so are the
Megatron-DeepSpeed flags that shape the model or the mesh in a way meshplan does not plan
(:data:`UNPLANNED`: DeepSpeed-MoE's ``--num-experts`` above 1, ``--num-experts-switch``,
DeepSpeed-Ulysses' ``--ds-sequence-parallel-size`` above 1), never silently unused.

The dialect (:func:`is_megatron_deepspeed`): ``--deepspeed`` (DeepSpeed's ``add_config_arguments``,
which Megatron-LM's parser does not call) or a flag or value only Megatron-DeepSpeed's parser takes
(:data:`MARKERS`, ``--normalization`` in lower case). A plan declares it by its engines
(:attr:`~meshplan.spec.training_engines.TrainingEngines.megatron_deepspeed`): what ``export --to megatron``
and ``launch`` write in these spellings (:func:`mds_model_flags`).
"""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Any

from meshplan.errors import ConfigError, printable

#: Where every line number of this module points.
SOURCE = "microsoft/Megatron-DeepSpeed f4157be megatron/arguments.py"
#: Megatron-DeepSpeed's flag -> Megatron-LM's flag of the same value (module docstring).
SPELLINGS = {"--num-key-value-heads": "--num-query-groups", "--rotary-position-embeddings-theta": "--rotary-base",
             "--layernorm-epsilon": "--norm-epsilon"}
ROTARY, NO_POSITION, NORM = "--use-rotary-position-embeddings", "--no-position-embedding", "--normalization"
POSITION = "--position-embedding-type"
#: BigScience's fork (bigscience-workshop/Megatron-DeepSpeed 8387ae1 ``megatron/arguments.py:398-401``,
#: ``megatron/enums.py`` ``PositionEmbeddingType``: absolute, rotary, alibi) spells the positions with
#: Megatron-LM's flag but its own values -> Megatron-LM's value; microsoft's fork has no such flag.
BIGSCIENCE_POSITIONS = {"absolute": "learned_absolute", "rotary": "rope", "alibi": "alibi"}
#: ``--normalization`` choices (arguments.py:647-648) -> Megatron-LM's spelling.
NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
#: Flags only Megatron-DeepSpeed's parser has (beside ``--deepspeed``), which mark its arguments.
MARKERS = ("--deepspeed", "--deepspeed_config", "--zero-stage", "--num-key-value-heads",
           "--rotary-position-embeddings-theta", "--use-flash-attn-v2", "--no-pipeline-parallel",
           "--ds-sequence-parallel-size")
#: Megatron-LM's model flags that Megatron-DeepSpeed's parser refuses -> its own spelling, or why none.
LM_ONLY = {"--group-query-attention": "--num-key-value-heads N", "--num-query-groups": "--num-key-value-heads",
           "--rotary-base": "--rotary-position-embeddings-theta", "--norm-epsilon": "--layernorm-epsilon"}
#: Megatron-LM's model flags with no Megatron-DeepSpeed counterpart at all.
NO_COUNTERPART = ("--add-qkv-bias", "--qk-layernorm", "--use-rope-scaling", "--rope-scaling-factor",
                  "--multi-latent-attention", "--moe-router-topk", "--moe-ffn-hidden-size",
                  "--moe-shared-expert-intermediate-size", "--moe-layer-freq")
#: Megatron-DeepSpeed flags that shape the model or mesh as meshplan does not plan -> (its default, what it runs).
UNPLANNED = {"--num-experts": ("1", "DeepSpeed-MoE experts in every --expert-interval-th layer (default 2), "
                                    "--topk routing (megatron/model/transformer.py)"),
             "--num-experts-switch": (None, "a Switch Transformer MLP"),
             "--ds-sequence-parallel-size": ("1", "DeepSpeed-Ulysses sequence parallelism (all-to-all over the "
                                                  "sequence, arguments.py:98-107)")}
#: The model flags of this module (read, so never listed as unused).
FLAGS = (*SPELLINGS, ROTARY, NO_POSITION, *UNPLANNED, "--topk", "--expert-interval", "--mlp-type")
SWITCHES = (ROTARY, NO_POSITION)


@functools.cache
def mds_flags() -> tuple[frozenset[str], frozenset[str]]:
    """(every flag, the switches) of Megatron-DeepSpeed's parser at f4157be
    (:file:`megatron_deepspeed_flag_list.toml`, written by ``tools/megatron_deepspeed_flag_list.py``).

    >>> len(mds_flags()[0]), "--num-key-value-heads" in mds_flags()[0], "--num-query-groups" in mds_flags()[0]
    (320, True, False)
    """
    text = resources.files(__package__).joinpath("megatron_deepspeed_flag_list.toml").read_text(encoding="utf-8")
    d = tomllib.loads(text)
    return frozenset(d["flags"]), frozenset(d["switches"])


def is_megatron_deepspeed(args: dict) -> bool:
    """Whether parsed arguments ``args`` are Megatron-DeepSpeed's (module docstring).

    >>> is_megatron_deepspeed({"--num-key-value-heads": "8"}), is_megatron_deepspeed({"--normalization": "rmsnorm"})
    (True, True)
    >>> is_megatron_deepspeed({"--normalization": "RMSNorm", "--num-query-groups": "8"})
    False
    """
    return any(args.get(f) not in (None, False) for f in MARKERS) or str(args.get(NORM, "")) in NORMS


def _unplanned(args: dict) -> None:
    """ConfigError naming the first :data:`UNPLANNED` flag given other than its default."""
    for flag, (default, runs) in UNPLANNED.items():
        v = args.get(flag)
        if v is not None and str(v) != default:
            raise ConfigError(flag, f"{printable(str(v))[:40]} runs {runs}, which meshplan does not plan; drop it, "
                              f"or plan the model as a [model] table of its dense layers")


def lm_model_args(args: dict, notes: list[str]) -> dict[str, Any]:
    """``args`` (Megatron-DeepSpeed's, :func:`is_megatron_deepspeed`) with its model flags in
    Megatron-LM's spelling (module docstring), for :func:`meshplan.interop.megatron_model.model_table`;
    a ConfigError naming a Megatron-LM spelling its parser refuses, or a flag of :data:`UNPLANNED`.

    >>> a = lm_model_args({"--num-attention-heads": "64", "--num-key-value-heads": "8", ROTARY: True,
    ...                    "--normalization": "rmsnorm", "--layernorm-epsilon": "1e-6"}, [])
    >>> {k: a[k] for k in ("--group-query-attention", "--num-query-groups", "--position-embedding-type",
    ...                    "--normalization", "--norm-epsilon")}
    {'--group-query-attention': True, '--num-query-groups': '8', '--position-embedding-type': 'rope', '--normalization': 'RMSNorm', '--norm-epsilon': '1e-6'}
    >>> lm_model_args({"--normalization": "RMSNorm"}, [])
    Traceback (most recent call last):
    meshplan.errors.ConfigError: --normalization: 'RMSNorm' is Megatron-LM's spelling; Megatron-DeepSpeed's parser refuses it (choices layernorm, rmsnorm: microsoft/Megatron-DeepSpeed f4157be megatron/arguments.py:647-648): write --normalization rmsnorm
    """
    for flag, theirs in LM_ONLY.items():
        if flag in args:
            raise ConfigError(flag, f"Megatron-LM's flag; Megatron-DeepSpeed's parser refuses it ({SOURCE}): write "
                              f"{theirs}")
    other = next((f for f in NO_COUNTERPART if f in args), None)
    if other:
        raise ConfigError(other, f"Megatron-LM's flag, which Megatron-DeepSpeed's parser refuses and has no "
                          f"counterpart of ({SOURCE}); drop it, or plan a Megatron-LM run")
    _unplanned(args)
    norm = str(args.get(NORM, "layernorm"))
    if norm not in NORMS:
        mine = {v: k for k, v in NORMS.items()}.get(norm)
        fix = f"write {NORM} {mine}" if mine else "use layernorm or rmsnorm"
        said = "Megatron-LM's spelling" if mine else "not a norm"
        raise ConfigError(NORM, f"{printable(norm)[:40]!r} is {said}; Megatron-DeepSpeed's parser refuses it "
                          f"(choices layernorm, rmsnorm: {SOURCE}:647-648): {fix}")
    if args.get(NO_POSITION) and not args.get(ROTARY):
        raise ConfigError(NO_POSITION, f"without {ROTARY} Megatron-DeepSpeed runs no position embedding (NoPE), "
                          f"which meshplan does not plan: add {ROTARY}, or drop it (learned positions)")
    pos = args.get(POSITION)
    if pos is not None and str(pos) not in BIGSCIENCE_POSITIONS:
        raise ConfigError(POSITION, f"{printable(str(pos))[:40]!r} is Megatron-LM's value; Megatron-DeepSpeed "
                          f"spells RoPE {ROTARY} ({SOURCE}:630; BigScience's fork: {POSITION} rotary) and learned "
                          f"positions by leaving it out")
    out = {k: v for k, v in args.items() if k not in SPELLINGS and k not in (ROTARY, NO_POSITION, NORM, POSITION)}
    out |= {SPELLINGS[k]: v for k, v in args.items() if k in SPELLINGS} | {NORM: NORMS[norm]}
    heads, kv = args.get("--num-attention-heads"), args.get("--num-key-value-heads")
    if kv is not None and str(kv) != str(heads):  # GQA; equal, or unset: the query heads (arguments.py:444-445)
        out["--group-query-attention"] = True
    elif kv is not None:
        out.pop("--num-query-groups")
    out |= {POSITION: BIGSCIENCE_POSITIONS[str(pos)]} if pos is not None else {}
    out |= {POSITION: "rope"} if args.get(ROTARY) else {}
    return out


def mds_model_flags(lm: list[str]) -> list[str]:
    """Megatron-LM's model flags ``lm`` (:func:`meshplan.interop.megatron_model.model_flags`) in
    Megatron-DeepSpeed's spelling (module docstring; the inverse of :func:`lm_model_args`): a
    ConfigError naming a flag it has no counterpart of (:data:`NO_COUNTERPART`).

    >>> mds_model_flags(["--num-attention-heads 64", "--normalization RMSNorm", "--position-embedding-type rope",
    ...                  "--rotary-base 500000", "--norm-epsilon 1e-05", "--group-query-attention",
    ...                  "--num-query-groups 8", "--swiglu"])
    ['--num-attention-heads 64', '--normalization rmsnorm', '--use-rotary-position-embeddings', '--rotary-position-embeddings-theta 500000', '--layernorm-epsilon 1e-05', '--num-key-value-heads 8', '--swiglu']
    """
    back = {v: k for k, v in SPELLINGS.items()}
    out = []
    for word in lm:
        flag, _, value = word.partition(" ")
        if flag in NO_COUNTERPART:
            raise ConfigError("--to", f"the model needs Megatron-LM's {flag}, which Megatron-DeepSpeed has no "
                              f"counterpart of ({SOURCE}): plan it under Megatron-LM's engines, or another model")
        if flag == "--group-query-attention" or word in (f"{POSITION} learned_absolute", f"{NORM} LayerNorm"):
            continue  # GQA: the kv heads say it; learned positions and LayerNorm: both forks' defaults
        if flag == POSITION:  # ALiBi: BigScience's fork's --position-embedding-type alibi
            out.append(ROTARY if value == "rope" else word)
        elif flag == NORM:
            out.append(f"{NORM} {value.lower()}")
        else:
            out.append(f"{back.get(flag, flag)} {value}".strip())
    return out


def foreign_note(args: dict) -> list[str]:
    """The note naming the flags of Megatron-DeepSpeed arguments ``args`` that its parser does not
    have (:func:`mds_flags`; torchrun's ``--nnodes`` aside), in place of the Megatron-LM note
    (:func:`meshplan.interop.megatron_known.foreign_flags_note`), which named its real flags
    (``--num-key-value-heads``, ``--use-flash-attn-v2``, ``--deepspeed_config``) as refused.

    >>> foreign_note({"--num-key-value-heads": "8", "--context-parallel-size": "2", "--tp-comm-overlap": True})
    ["not flags of microsoft/Megatron-DeepSpeed f4157be: --context-parallel-size, --tp-comm-overlap (its parser refuses them; BigScience's fork or your training script may add them)"]
    """
    other = [f for f in args if f not in mds_flags()[0] and f != "--nnodes"]
    return [f"not flags of microsoft/Megatron-DeepSpeed f4157be: {', '.join(other)} (its parser refuses them; "
            f"BigScience's fork or your training script may add them)"] if other else []


#: Megatron-LM's words in the model notes (:func:`meshplan.interop.megatron_model.model_table`) -> Megatron-DeepSpeed's
#: (its defaults are Megatron-LM's: RoPE base 10000, arguments.py:634-636; epsilon 1e-5, 652).
NOTE_WORDS = {**{lm: mine for mine, lm in SPELLINGS.items()}, POSITION: ROTARY,
              "Megatron-LM's default": "Megatron-DeepSpeed's default"}


def respelt(note: str) -> str:
    """A model note in Megatron-DeepSpeed's words (:data:`NOTE_WORDS`; ``--group-query-attention``
    dropped, ``--num-key-value-heads`` says GQA).

    >>> respelt("not --rotary-base (Megatron-LM's default 10000; llama3-70b: 500000): add --rotary-base 500000")
    "not --rotary-position-embeddings-theta (Megatron-DeepSpeed's default 10000; llama3-70b: 500000): add --rotary-position-embeddings-theta 500000"
    """
    note = note.replace("--group-query-attention, ", "")
    for lm, mine in NOTE_WORDS.items():
        note = note.replace(lm, mine)
    return note
