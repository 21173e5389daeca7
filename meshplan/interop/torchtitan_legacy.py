"""Older torchtitan job TOMLs in the current layout: the float8 settings as torchtitan spelled
them before 2025 (the ``[float8]`` table, ``enable_float8_linear``, ``model.converters`` as a
comma-separated string) read as ``[quantize.linear.float8]`` and the converter list
(:func:`old_float8`, with the note the import prints), and the whole file so (:func:`current_layout`,
what an export carries of the user's file). The spelling the user wrote, which an export keeps, is
:func:`meshplan.interop.torchtitan_float8.float8_spelling`; the reader of the current layout is
:mod:`meshplan.interop.torchtitan`.
"""

from __future__ import annotations

from meshplan.errors import ConfigError


def old_float8(d: dict) -> tuple[dict, list[str]]:
    """``d`` in the current layout when it has torchtitan's older float8 settings (before
    5b5d468, 2025-09-26: :class:`~meshplan.interop.torchtitan_float8.Float8Spelling`), with a
    note: the ``[float8]`` table read as ``[quantize.linear.float8]`` (same keys), its
    ``enable_float8_linear = true`` (2024) as the float8 converter, and ``model.converters``
    given as a comma-separated string (``converters = "float8"``, its old string-list form)
    as a list. ConfigError when both tables are given (which one holds is unclear).

    >>> d, notes = old_float8({"model": {"converters": "float8"}, "float8": {"filter_fqns": "output"}})
    >>> d
    {'model': {'converters': ['float8']}, 'quantize': {'linear': {'float8': {'filter_fqns': 'output'}}}}
    """
    model, old, quantize = d.get("model", {}), d.get("float8"), d.get("quantize", {})
    if not isinstance(model, dict) or not isinstance(quantize, dict) or not isinstance(quantize.get("linear", {}), dict):
        return d, []  # malformed: the reader names the field
    if isinstance(model.get("converters"), str):
        model = model | {"converters": [c.strip() for c in model["converters"].split(",") if c.strip()]}
    if not isinstance(old, dict):
        return (d | {"model": model} if "model" in d else d), []
    if "float8" in quantize.get("linear", {}):
        raise ConfigError("float8", "the pre-2025 [float8] table and [quantize.linear.float8] are both given; "
                          "torchtitan reads [quantize.linear.float8]: keep that one")
    old = dict(old)
    converters = model.get("converters", [])
    if old.pop("enable_float8_linear", False) and isinstance(converters, list) and "float8" not in converters:
        model = model | {"converters": [*converters, "float8"]}
    # enable_float8_linear (2024) predates filter_fqns (torchtitan a6524d8, April 2025): its
    # Float8Handler (9dec370 float8.py) converted every Linear but the output (fqn != "output")
    pre_filter = "enable_float8_linear" in d["float8"] and "filter_fqns" not in old
    if pre_filter:
        old["filter_fqns"] = ["output"]
    note = "[float8] read as [quantize.linear.float8] (torchtitan's name for it since 2025; its keys are listed " \
           "under that name)" + (", enable_float8_linear as model.converters = [\"float8\"]"
                                 if "enable_float8_linear" in d["float8"] else "") + \
        ("; the output layer left in the compute dtype, as torchtitan did before filter_fqns (its float8 "
         "converter skipped fqn \"output\")" if pre_filter else "")
    rest = {k: v for k, v in d.items() if k != "float8"}
    return rest | {"model": model, "quantize": quantize | {"linear": quantize.get("linear", {}) | {"float8": old}}}, \
        [note]


def current_layout(d: dict) -> dict:
    """A parsed torchtitan job TOML in the current layout (:func:`old_float8`)."""
    return old_float8(d)[0]
