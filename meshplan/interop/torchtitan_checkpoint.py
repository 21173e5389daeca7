"""torchtitan's ``[checkpoint]`` as far as meshplan reads it: the steps between saves of a job
that saves (``enable = true``), which ``meshplan reliability`` sets beside the optimal interval
(meshplan's ``[reliability] checkpoint_interval_steps``); the rest of the table is the user's,
carried by :mod:`meshplan.interop.torchtitan_carry`.
"""

from __future__ import annotations

from typing import Any

from meshplan.errors import ConfigError

#: torchtitan's ``[checkpoint]`` defaults (torchtitan/config/job_config.py, ``class Checkpoint``):
#: ``enable = False`` (no checkpoint is saved), ``interval = 500`` steps between saves.
CHECKPOINT_INTERVAL_DEFAULT = 500


def read_checkpoint(d: dict) -> tuple[dict[str, Any], set[str]]:
    """(meshplan's [reliability] table, the keys read) of a job whose ``checkpoint.enable`` is
    true: ``checkpoint_interval_steps`` = ``checkpoint.interval`` (torchtitan's default 500); nothing, and
    the keys left unused, when the job saves no checkpoint. ConfigError naming the key.

    >>> table, keys = read_checkpoint({"checkpoint": {"enable": True, "interval": 100}})
    >>> table, sorted(keys)
    ({'checkpoint_interval_steps': 100}, ['checkpoint.enable', 'checkpoint.interval'])
    >>> read_checkpoint({"checkpoint": {"interval": 100}})
    ({}, set())
    """
    ck = d.get("checkpoint", {})
    if not isinstance(ck, dict) or ck.get("enable") is not True:
        return {}, set()
    n = ck.get("interval", CHECKPOINT_INTERVAL_DEFAULT)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("checkpoint.interval", f"{n!r}: give the steps between checkpoint saves, a whole number >= 1")
    return {"checkpoint_interval_steps": n}, {"checkpoint.enable"} | ({"checkpoint.interval"} if "interval" in ck else set())


def without_interval(d: dict) -> dict:
    """``d`` without the [checkpoint] keys :func:`read_checkpoint` reads (a table left empty
    dropped): what another target does not carry when it writes the interval itself.

    >>> without_interval({"checkpoint": {"enable": True, "interval": 100}, "job": {"a": 1}})
    {'job': {'a': 1}}
    """
    keys = {k.partition(".")[2] for k in read_checkpoint(d)[1]}
    ck = {k: v for k, v in d.get("checkpoint", {}).items() if k not in keys}
    return {k: v for k, v in d.items() if k != "checkpoint"} | ({"checkpoint": ck} if ck else {})

