"""A config table's errors as one line naming the field (:func:`build`: pydantic's errors, with
the likely key for a misspelt one (:func:`spelled`), the right table for a misplaced one, the
allowed values, a number given as text, a value under its floor), and a catalog's or file
reader's error re-raised under the config's field (:func:`as_field`). The tables themselves:
:mod:`meshplan.config_tables`.
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from meshplan.errors import ConfigError, closest, printable
from meshplan.limits import bound_message
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.axes import KNOWN_AXES
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.search import SearchOptions
from meshplan.spec.training import TrainingSpec


def build(cls: type[BaseModel], values: dict, table: str) -> Any:
    """``cls(**values)`` with pydantic errors turned into one-line ConfigErrors."""
    if not isinstance(values, dict):
        raise ConfigError(table, f"must be a table of {cls.__name__} fields (got {type(values).__name__} "
                                 f"{str(values)[:40]!r})")
    try:
        return cls(**values)
    except ValidationError as e:
        raise _one_line(e, cls, table, values) from None


def _home_table(key: str, table: str) -> Optional[str]:
    """The other top-level table that has ``key`` as a field, where exactly one does (a key
    written in the wrong table: ``pp_schedule`` under [training] belongs in [mesh]); else None
    (``micro_batch`` is a field of both [training] and [search]).

    >>> _home_table("pp_schedule", "training"), _home_table("seq_len", "mesh"), _home_table("micro_batch", "mesh")
    ('mesh', 'training', None)
    """
    tables: dict[str, type[BaseModel]] = {"model": ModelSpec, "training": TrainingSpec, "mesh": MeshSpec,
                                          "memory": MemoryOptions, "search": SearchOptions, "cluster": ClusterSpec}
    homes = [name for name, c in tables.items() if name != table.split(".")[0] and key in c.model_fields]
    return homes[0] if len(homes) == 1 else None


def _axis_key(axis: str, values: dict) -> str:
    """The error of a mesh axis written as a key of [mesh] (``etp = 1``, as a note once said): an
    axis's degree goes in ``names``/``shape`` or ``degrees``, with the lines to write.

    >>> _axis_key("etp", {"names": ["dp", "tp", "ep"], "shape": [16, 2, 8], "etp": 1})
    'unknown key in [mesh]; etp is a mesh axis: write names = ["dp", "tp", "ep", "etp"] and shape = [16, 2, 8, 1]'
    >>> _axis_key("cp", {"order": "tp-dp", "degrees": {"tp": 2, "dp": 4}, "cp": 2})
    'unknown key in [mesh]; cp is a mesh axis: write degrees = {tp = 2, dp = 4, cp = 2}'
    """
    d, names, shape, degrees = values.get(axis), values.get("names"), values.get("shape"), values.get("degrees")
    if not isinstance(d, int) or isinstance(d, bool):
        fix = f'add "{axis}" to names and its degree to shape (or {axis} = N to degrees)'
    elif isinstance(names, list) and isinstance(shape, list):
        quoted = ", ".join(f'"{n}"' for n in [*names, axis])
        fix = f"write names = [{quoted}] and shape = [{', '.join(str(x) for x in [*shape, d])}]"
    elif isinstance(degrees, dict):
        fix = "write degrees = {" + ", ".join(f"{k} = {v}" for k, v in (degrees | {axis: d}).items()) + "}"
    else:
        fix = f'add "{axis}" to names and {d} to shape (or {axis} = {d} to degrees)'
    return f"unknown key in [mesh]; {axis} is a mesh axis: {fix}"


def _one_line(e: ValidationError, cls: type[BaseModel], table: str, values: Optional[dict] = None) -> ConfigError:
    errs = e.errors()
    # an unknown key explains a "missing" one (a misspelled required key): report it first
    err = next((x for x in errs if x["type"] == "extra_forbidden"), errs[0])
    loc = ".".join(str(x) for x in err["loc"])
    field = f"{table}.{loc}" if loc else table
    removed = getattr(cls, "REMOVED", {})
    if err["type"] == "extra_forbidden" and loc in removed:
        return ConfigError(field, removed[loc])
    if err["type"] == "extra_forbidden" and table == "mesh" and loc in KNOWN_AXES:
        return ConfigError(field, _axis_key(loc, values or {}))
    if err["type"] == "extra_forbidden":
        home = _home_table(loc, table)
        if home:
            return ConfigError(field, f"unknown key in [{table}]; {loc} belongs in [{home}]: move it there "
                                      f"({home}.{loc})")
        near = closest(loc, cls.model_fields)  # globl_batch: 0.96; the whole list only without one
        return ConfigError(field, f"unknown key in [{table}]; did you mean {near}?" if near else
                           f"unknown key in [{table}]; allowed keys: {', '.join(cls.model_fields)}")
    if err["type"] == "missing":
        return ConfigError(field, f"required key missing in [{table}]")
    msg = err["msg"].removeprefix("Value error, ")
    got = err.get("input")
    bounded = (bound_message(err) or _below_floor(err, field) or spelled(cls, loc, got, msg) or _not_a_value(err, got)
               or _not_a_number(err, loc, got))
    if bounded:
        return ConfigError(field, bounded)
    if err["type"] not in ("value_error",) and not isinstance(got, (dict, list)):
        msg += f" (got {str(got)[:60]!r})" if isinstance(got, str) else f" (got {got!r})"
    elif isinstance(got, (dict, list)) and err["type"] not in ("value_error",):
        msg += f" (got a {'table' if isinstance(got, dict) else 'list'})"
    return ConfigError(field, msg)


def spelled(cls: type[BaseModel], key: str, got, msg: str) -> Optional[str]:
    """Another tool's name ``got`` for a value of field ``key`` of ``cls`` (its ``SPELLINGS``,
    :attr:`meshplan.spec.training_fields.TrainingFields.SPELLINGS`) as meshplan's value, what it is
    and what to set, then the values pydantic lists (``msg``); one meshplan does not model (its
    ``UNMODELLED``) as what it is; None for other inputs.

    >>> from meshplan.spec.training import TrainingSpec
    >>> print(spelled(TrainingSpec, "sharding", "FSDP", "Input should be 'none' or 'zero3'"))
    "FSDP" is "zero3" here (FSDP2 fully_shard: parameters, gradients and optimizer state sharded over the data axis): set sharding = "zero3" (the values: 'none' or 'zero3')
    >>> spelled(TrainingSpec, "sharding", "fdsp", "Input should be ...") is None
    True
    >>> print(spelled(TrainingSpec, "cp_attention", "a2a+p2p", "Input should be 'ring', 'p2p' or 'allgather'")[:60])
    "a2a+p2p" is Megatron-LM's hierarchical CP, Ulysses all-to-a
    """
    if not isinstance(got, str):
        return None
    squashed = "".join(ch for ch in got.lower() if ch not in "_-. +")
    gone = getattr(cls, "UNMODELLED", {}).get(key, {}).get(squashed)  # another tool's value meshplan has no model of
    if gone:
        fix = getattr(cls, "UNMODELLED_FIX", {}).get(key) or f'set {key} to {msg.removeprefix("Input should be ")}'
        return f'"{got}" {gone}; {fix}'
    hit = getattr(cls, "SPELLINGS", {}).get(key, {}).get(squashed)
    if hit is None:
        return None
    value, what, setting = hit
    return f'"{got}" is "{value}" here ({what}): set {setting} (the values: {msg.removeprefix("Input should be ")})'


def _not_a_value(err, got) -> Optional[str]:
    """A string that is none of a Literal field's values (pydantic's ``literal_error``/``enum``)
    as the values, closest first (difflib's ratio, case ignored), with a did-you-mean where
    :func:`~meshplan.errors.closest` finds one; None for other errors (newcomer trial 21 #7).

    >>> print(_not_a_value({"type": "literal_error", "ctx": {"expected": "'none', 'selective', 'full' or 'op'"}}, "ful"))
    "ful" is not one of its values; did you mean 'full'? (the values, closest first: 'full', 'selective', 'none', 'op')
    """
    if err.get("type") not in ("literal_error", "enum") or not isinstance(got, str):
        return None
    values = re.findall(r"'([^']*)'", (err.get("ctx") or {}).get("expected", ""))
    if not values:
        return None
    near = closest(got, values)  # first, where ties in the ratio leave it anywhere
    ranked = sorted(values, key=lambda v: (v != near, -difflib.SequenceMatcher(None, got.lower(), v.lower()).ratio()))
    guess = f"; did you mean {near!r}?" if near else ""
    return f"\"{printable(got)[:40]}\" is not one of its values{guess} (the values, closest first: " \
           f"{', '.join(repr(v) for v in ranked)})"


#: A number written as a string with a size suffix, TOML having none: ``"4k"``, ``"1.5M"``.
_SUFFIXED = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*")

_POWERS = {"": 1, "k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}


def _not_a_number(err, key: str, got) -> Optional[str]:
    """A number field (pydantic's ``int_type``/``float_type``) given a string that reads as a
    number, bare or with a k/M/G suffix (powers of 1024, as sequence lengths are counted: 4k =
    4096), as the line to write instead (newcomer trial 21 #7); None for other inputs.

    >>> print(_not_a_number({"type": "int_type"}, "seq_len", "4k"))
    "4k" is not a number (TOML has no k suffix): write seq_len = 4096 (4 x 1024)
    >>> print(_not_a_number({"type": "int_type"}, "global_batch", "512"))
    "512" is a string: write global_batch = 512, without the quotes
    """
    if err.get("type") not in ("int_type", "int_parsing", "float_type", "float_parsing") or not isinstance(got, str):
        return None
    m = _SUFFIXED.fullmatch(got)
    if m is None:
        return None
    mult = _POWERS[m.group(2).lower()]
    value = float(m.group(1)) * mult
    if err["type"].startswith("int") and value != int(value):
        return None
    shown = int(value) if value == int(value) else value
    key = key.split(".")[-1]
    if mult == 1:
        return f'"{got}" is a string: write {key} = {shown}, without the quotes'
    return f'"{got}" is not a number (TOML has no {m.group(2)} suffix): write {key} = {shown} ({m.group(1)} x {mult})'


def _below_floor(err, field: str) -> Optional[str]:
    """A pydantic ``greater_than``/``greater_than_equal`` error (``Field(gt=0)``) as the bound and
    the fix, instead of pydantic's bare "Input should be greater than 0"; None for other errors.

    >>> _below_floor({"type": "greater_than", "ctx": {"gt": 0}, "input": -8192}, "training.seq_len")
    'must be greater than 0 (got -8192); give training.seq_len a positive value'
    >>> _below_floor({"type": "greater_than_equal", "ctx": {"ge": 1}, "input": 0}, "mesh.tp")
    'must be at least 1 (got 0); give mesh.tp a value >= 1'
    """
    ctx = err.get("ctx") or {}
    if err.get("type") == "greater_than" and "gt" in ctx:
        want, fix = f"greater than {ctx['gt']}", "a positive value" if ctx["gt"] == 0 else f"a value > {ctx['gt']}"
    elif err.get("type") == "greater_than_equal" and "ge" in ctx:
        want, fix = f"at least {ctx['ge']}", f"a value >= {ctx['ge']}"
    else:
        return None
    return f"must be {want} (got {err.get('input')!r}); give {field} {fix}"


@contextmanager
def as_field(field: str, where: str = ""):
    """Re-raise a ConfigError from a catalog or file reader under the config's ``field``
    (``cluster.system: unknown node ...``); a reader's own field (a key of the HF
    config.json) stays in the message. ``where`` follows a missing file's path."""
    try:
        yield
    except ConfigError as e:
        if e.field.startswith(field):
            raise
        msg = e.message if e.field in ("config", "node", "gpu", "model", "network", "nodes", "system", "busbw") \
            else f"{e.field}: {e.message}"
        if where and msg.startswith("no such file"):
            msg = msg.replace(";", where + ";", 1)
        raise ConfigError(field, msg) from None
