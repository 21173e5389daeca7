"""Megatron-LM's whole flag list (877 flags at NVIDIA/Megatron-LM d98e8a64dd), so that a flag
that is not one of them and is a near miss of one is refused as Megatron-LM's parser
(``argparse``, ``allow_abbrev=False``) refuses it, while a real flag meshplan does not use stays in
the "does not use" note (newcomer trial 23 #4: ``--lr-decay-stlye`` passed silently).

The list is data, :file:`megatron_flag_list.toml` beside this module, written by
``tools/megatron_flag_list.py`` from the parser ``megatron/training/arguments.py``
``add_megatron_arguments`` builds at that commit (the flags written out there and those its
``ArgumentGroupFactory`` makes from the config dataclasses). A flag far from every Megatron-LM
flag is not refused: a training script may add its own (``extra_args_provider``); a note names it.
"""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Iterable, Optional

from meshplan.errors import ConfigError
from meshplan.interop.typos import near_miss

#: The commit the list was taken at (its ``source`` line names it too).
COMMIT = "d98e8a64dd"


@functools.cache
def megatron_flags() -> frozenset[str]:
    """Every ``--flag`` of Megatron-LM's parser at :data:`COMMIT` (:file:`megatron_flag_list.toml`).

    >>> len(megatron_flags()), "--lr-decay-style" in megatron_flags(), "--lr-decay-stlye" in megatron_flags()
    (877, True, False)
    """
    text = resources.files(__package__).joinpath("megatron_flag_list.toml").read_text(encoding="utf-8")
    return frozenset(tomllib.loads(text)["flags"])


def misspelt_flag(flag: str, used: Iterable[str], known: Iterable[str] = ()) -> Optional[ConfigError]:
    """The error for ``flag`` when it is neither a Megatron-LM flag (:func:`megatron_flags`) nor
    one meshplan reads (``used``) or knows from another version (``known``), and is a near miss
    (:func:`~meshplan.interop.typos.near_miss`) of one: a flag meshplan reads first (or one word
    away from it, :func:`word_miss`), then any of Megatron-LM's. None otherwise.

    >>> misspelt_flag("--lr-decay-stlye", ["--seq-length"]).message
    'not a Megatron-LM flag (its parser refuses it); did you mean --lr-decay-style? (a Megatron-LM flag meshplan does not use)'
    >>> misspelt_flag("--lr-decay-style", []), misspelt_flag("--my-own-flag", [])
    (None, None)
    >>> misspelt_flag("--expert-parallel-size", ["--expert-model-parallel-size"]).message
    'not a Megatron-LM flag (its parser refuses it); did you mean --expert-model-parallel-size? (meshplan reads that one: misspelt, the setting would stay at its default)'
    """
    used = set(used)
    if flag in used or flag in megatron_flags() or flag in set(known):
        return None
    hit = near_miss(flag[2:], {f[2:] for f in used}) or word_miss(flag[2:], {f[2:] for f in used})
    if hit is not None:
        return ConfigError(flag, f"not a Megatron-LM flag (its parser refuses it); did you mean --{hit}? "
                           f"(meshplan reads that one: misspelt, the setting would stay at its default)")
    hit = near_miss(flag[2:], {f[2:] for f in megatron_flags()})
    if hit is not None:
        return ConfigError(flag, f"not a Megatron-LM flag (its parser refuses it); did you mean --{hit}? "
                           f"(a Megatron-LM flag meshplan does not use)")
    return None


#: Words whose presence flips a flag's meaning (``--no-create-attention-mask-in-dataloader``): never the
#: one word :func:`word_miss` adds or drops.
NEGATIONS = frozenset({"no", "disable", "not"})


def word_miss(name: str, read: Iterable[str]) -> Optional[str]:
    """The name of ``read`` whose words (split at ``-``) are ``name``'s with one word added or dropped,
    in order, at least two shared, or None: a flag meshplan reads under another framework's or an
    older name (newcomer trial nc58 #2: ``--expert-parallel-size 8`` was noted as a script's own flag
    and the job planned at ep 1; ``--moe-topk 1`` at Megatron-LM's default top-2). Only the flags
    meshplan reads are matched (:func:`misspelt_flag`), where losing the setting changes the plan.

    >>> word_miss("expert-parallel-size", ["expert-model-parallel-size", "seq-length"])
    'expert-model-parallel-size'
    >>> word_miss("moe-topk", ["moe-router-topk"]), word_miss("lr", ["min-lr"]), word_miss("my-own-flag", ["own-flag-x"])
    ('moe-router-topk', None, None)
    >>> word_miss("create-attention-mask-in-dataloader", ["no-create-attention-mask-in-dataloader"]) is None
    True
    """
    words = name.split("-")
    for r in sorted(set(read)):
        other = r.split("-")
        short, long_ = (words, other) if len(words) < len(other) else (other, words)
        if len(long_) - len(short) == 1 and len(short) >= 2 and any(  # not a "no-" switch: the opposite
                long_[:i] + long_[i + 1:] == short and long_[i] not in NEGATIONS for i in range(len(long_))):
            return r
    return None


def foreign_flags_note(flags: Iterable[str], used: Iterable[str], known: Iterable[str] = ()) -> list[str]:
    """A note naming the ``flags`` that are not Megatron-LM's at :data:`COMMIT` (nor read or known
    by meshplan); [] when there are none.

    >>> foreign_flags_note(["--lr", "--my-own-flag"], [])
    ['not flags of Megatron-LM d98e8a64dd: --my-own-flag (its parser refuses them unless your training script adds them)']
    """
    skip = set(used) | set(known) | megatron_flags()
    other = [f for f in flags if f not in skip]
    return [f"not flags of Megatron-LM {COMMIT}: {', '.join(other)} (its parser refuses them unless your training "
            f"script adds them)"] if other else []
