"""torchtitan's ``[checkpoint]`` as far as meshplan reads it: the steps between saves of a job
that saves (``enable = true``), which ``meshplan reliability`` sets beside the optimal interval
(meshplan's ``[reliability] checkpoint_interval_steps``); the rest of the table is the user's,
carried by :mod:`meshplan.interop.torchtitan_carry`.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.errors import ConfigError

#: torchtitan's ``[checkpoint]`` defaults (torchtitan/config/job_config.py, ``class Checkpoint``):
#: ``enable = False`` (no checkpoint is saved), ``interval = 500`` steps between saves.
CHECKPOINT_INTERVAL_DEFAULT = 500

#: ``checkpoint.enable``'s name before pytorch/torchtitan cd337db (#1607, 2025-08-22:
#: "Refactor ``checkpoint.enable_checkpoint -> checkpoint.enable``"), which job TOMLs of that
#: time still spell (newcomer trial 29's).
OLD_ENABLE = "enable_checkpoint"

#: ``checkpoint.interval_type`` of torchtitan's argparse job config (torchtitan/config_manager.py
#: before its dataclass config: "Checkpointing interval unit of measurement ['step', 'seconds']",
#: ``--checkpoint.interval`` "in steps or seconds depending on --checkpoint.interval_type"; gone by
#: 391ddd3, whose ``interval`` is "Checkpointing interval in steps"): with this value the interval is
#: seconds, not the steps meshplan plans, so it is not read (the keys listed unused).
SECONDS_INTERVAL = "seconds"


def read_checkpoint(d: dict) -> tuple[dict[str, Any], set[str]]:
    """(meshplan's [reliability] table, the keys read) of a job whose ``checkpoint.enable`` is
    true (or its older name :data:`OLD_ENABLE`): ``checkpoint_interval_steps`` = ``checkpoint.interval``
    (torchtitan's default 500); nothing, and the keys left unused, when the job saves no checkpoint.
    ConfigError naming the key.

    >>> table, keys = read_checkpoint({"checkpoint": {"enable": True, "interval": 100}})
    >>> table, sorted(keys)
    ({'checkpoint_interval_steps': 100}, ['checkpoint.enable', 'checkpoint.interval'])
    >>> table, keys = read_checkpoint({"checkpoint": {"enable_checkpoint": True, "interval": 200}})
    >>> table, sorted(keys)
    ({'checkpoint_interval_steps': 200}, ['checkpoint.enable_checkpoint', 'checkpoint.interval'])
    >>> read_checkpoint({"checkpoint": {"interval": 100}})
    ({}, set())
    >>> read_checkpoint({"checkpoint": {"enable_checkpoint": True, "interval_type": "seconds", "interval": 600}})
    ({}, set())
    """
    ck = d.get("checkpoint", {})
    if not isinstance(ck, dict):
        return {}, set()
    enable = "enable" if "enable" in ck or OLD_ENABLE not in ck else OLD_ENABLE
    if ck.get(enable) is not True or ck.get("interval_type") == SECONDS_INTERVAL:
        return {}, set()
    n = ck.get("interval", CHECKPOINT_INTERVAL_DEFAULT)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError("checkpoint.interval", f"{n!r}: give the steps between checkpoint saves, a whole number >= 1")
    return {"checkpoint_interval_steps": n}, {f"checkpoint.{enable}"} | ({"checkpoint.interval"} if "interval" in ck else set())


def checkpoint_note(d: dict) -> Optional[str]:
    """The import's note on a ``[checkpoint]`` table whose interval meshplan does not read: a job
    that saves no checkpoint (``enable`` false or absent, torchtitan's default) or counts its
    interval in seconds (:data:`SECONDS_INTERVAL`), so the unused list naming ``checkpoint.enable``
    and ``checkpoint.interval`` says why, beside docs/foreign-configs.md's "with enable = true the
    interval is read" (newcomer trial nc55 #14); None where :func:`read_checkpoint` reads the
    interval or the table has neither key.

    >>> print(checkpoint_note({"checkpoint": {"enable": False, "interval": 500}}))
    checkpoint: enable = false (torchtitan's default): the job saves no checkpoint, so checkpoint.enable and checkpoint.interval are listed unused; with enable = true meshplan reads the interval as [reliability] checkpoint_interval_steps (meshplan reliability sets it beside the optimal interval)
    >>> checkpoint_note({"checkpoint": {"enable": True, "interval": 500}}) is None
    True
    """
    ck = d.get("checkpoint", {})
    if not isinstance(ck, dict) or read_checkpoint(d)[0]:
        return None
    enable = OLD_ENABLE if OLD_ENABLE in ck and "enable" not in ck else "enable"
    keys = [f"checkpoint.{k}" for k in (enable, "interval", "interval_type") if k in ck]
    if "interval" not in ck and enable not in ck:
        return None
    listed = " and ".join(keys) if len(keys) < 3 else ", ".join(keys[:-1]) + " and " + keys[-1]
    why = (f"interval_type = {SECONDS_INTERVAL!r}: the interval counts seconds, not the steps meshplan plans"
           if ck.get(enable) is True else
           f"{enable} = {str(ck[enable]).lower()} (torchtitan's default)" if enable in ck else
           f"{enable} unset (torchtitan's default, false)")
    why += "" if ck.get(enable) is True else ": the job saves no checkpoint"
    return (f"checkpoint: {why}, so {listed} {'are' if len(keys) > 1 else 'is'} listed unused; with {enable} = true "
            f"meshplan reads the interval as [reliability] checkpoint_interval_steps (meshplan reliability sets it "
            f"beside the optimal interval)")


def without_interval(d: dict) -> dict:
    """``d`` without the [checkpoint] keys :func:`read_checkpoint` reads (a table left empty
    dropped): what another target does not carry when it writes the interval itself.

    >>> without_interval({"checkpoint": {"enable": True, "interval": 100}, "job": {"a": 1}})
    {'job': {'a': 1}}
    """
    keys = {k.partition(".")[2] for k in read_checkpoint(d)[1]}
    ck = {k: v for k, v in d.get("checkpoint", {}).items() if k not in keys}
    return {k: v for k, v in d.items() if k != "checkpoint"} | ({"checkpoint": ck} if ck else {})


def in_users_spelling(user: dict, written: dict) -> dict:
    """``written`` (an export's tables) with ``checkpoint.enable`` spelled as the user's job
    TOML ``user`` spells it: :data:`OLD_ENABLE` where the file has that and no ``enable``, so an
    export of an older file does not hold both names.

    >>> in_users_spelling({"checkpoint": {"enable_checkpoint": True}}, {"checkpoint": {"enable": True, "interval": 9}})
    {'checkpoint': {'interval': 9, 'enable_checkpoint': True}}
    """
    ck = user.get("checkpoint", {})
    if not isinstance(ck, dict) or OLD_ENABLE not in ck or "enable" in ck or "checkpoint" not in written:
        return written
    table = dict(written["checkpoint"])
    table[OLD_ENABLE] = table.pop("enable")
    return written | {"checkpoint": table}
