"""What an export of Megatron-LM arguments keeps of the user's own (``meshplan export ARGS
--to megatron``): every flag meshplan does not read (``--lr``, ``--train-iters``,
``--tokenizer-type``, ``--data-path`` ...) carried unchanged after the written ones, as
torchtitan's and DeepSpeed's exports carry their files' other settings
(:func:`meshplan.interop.torchtitan.carried`, :func:`meshplan.interop.deepspeed_carry.carried`);
a flag meshplan reads is the plan's, and one the export writes otherwise or drops
(``--overlap-grad-reduce`` under zero1, planned without overlap) is listed by
:func:`meshplan.interop.common.rewritten`.
"""

from __future__ import annotations

import shlex

from meshplan.interop.megatron import USED


def not_planned(user: dict) -> list[str]:
    """The flags of the user's parsed arguments (:func:`meshplan.interop.megatron.parse_args`)
    that meshplan does not read, in the file's order.

    >>> not_planned({"--num-layers": "32", "--lr": "3e-4", "--use-mcore-models": True})
    ['--lr', '--use-mcore-models']
    """
    return [f for f in user if f not in USED]


def carried(user: dict, written: list[str]) -> tuple[list[str], list[str]]:
    """(``written`` with :func:`not_planned`'s flags appended as the user gave them, those
    flags): a switch bare, a value quoted for the shell where it needs it.

    >>> carried({"--num-layers": "32", "--lr": "3e-4", "--data-path": "a b"}, ["--num-layers 4"])
    (['--num-layers 4', '--lr 3e-4', "--data-path 'a b'"], ['--lr', '--data-path'])
    """
    kept = not_planned(user)
    return written + [f if user[f] is True else f"{f} {shlex.quote(str(user[f]))}" for f in kept], kept


def show(value) -> str:
    """A flag's value as :func:`~meshplan.interop.common.rewritten` lists it: ``(switch)`` for
    a switch, else as given."""
    return "(switch)" if value is True else str(value)
