"""torchtitan's float8 tables, read and written, and the older names of them a job TOML may use
(:mod:`meshplan.interop.torchtitan` maps the rest of the job TOML and names the sources).

Float8 as torchtitan at e347b1e applies it (``components/quantization/float8.py``,
``utils.module_filter_fn``): the Linear converter (``[model] converters`` entry ``float8``, or
``quantize.linear.float8`` as its registry names it there) swaps every ``nn.Linear`` whose dims
are multiples of 16 and whose name contains no ``filter_fqns`` entry for torchao's
``Float8Linear``: those GEMMs run in fp8, activations stay in the compute dtype
(``training.linear_dtype``, :meth:`~meshplan.spec.training.TrainingSpec.float8_linear`);
``enable_fsdp_float8_all_gather`` gathers those weights in float8 (``training.fp8_all_gather``);
``recipe_name`` "rowwise" or "rowwise_with_gw_hp" is rowwise scaling (``training.fp8_recipe``,
plain TP collectives), unset tensorwise (float8 TP all-gathers where torchtitan applies them).

Float8 TP (torchao's ``Float8ColwiseParallel`` / ``PrepareFloat8ModuleInput``: the TP gathers in
float8, ``training.fp8_tp``) by the converter's name, as each torchtitan's parallelize tests it
(:func:`float8_tp_of`): ``enable_float8_linear = "float8" in job_config.model.converters`` and
``enable_float8_tensorwise_tp = enable_float8_linear and not float8_is_rowwise``
(``torchtitan/models/llama3/infra/parallelize.py``:77-86 at 73a0e69, tag v0.2.2; the same in
deepseek_v3, qwen3, llama4 and gpt_oss, :data:`PARALLELIZE_LINE`). The registry names the converter
``"float8"`` from 57387af (2025-02-14) to 5b5d468 (2025-09-26), whose parallelize sees it: float8 TP
on (before 57387af ``enable_float8_linear`` switched it on alike, :mod:`meshplan.interop.torchtitan_legacy`);
``"quantize.linear.float8"`` from 8a2686c (2025-09-30) through v0.2.0, v0.2.1, v0.2.2 and 238fa99
(the last commit reading TOML), whose parallelize still tests ``"float8"``: a file naming the new
converter runs its float8 GEMMs under plain TP (gathers in the compute dtype, the casts after
them), ``fp8_tp = false``. A file naming ``"float8"`` beside ``[quantize.linear.float8]`` runs on
neither (from 8a2686c ``_registry_model_converter_cls["float8"]`` is a KeyError,
``protocols/model_converter.py``:62 at 73a0e69; before it the table is ``[float8]``): planned as
``"float8"`` reads, float8 TP on, with a note. torchtitan 9810191 (Python configs:
:mod:`~meshplan.interop.torchtitan_pyjob`) applies float8 TP for any ``Float8LinearConverter``
(``models/llama3/parallelize.py``:90-100 there); b5bcd76 has no float8 TP.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from meshplan.errors import ConfigError

#: [model] converters that swap nn.Linear for Float8Linear: the older name and e347b1e's registry name.
LINEAR_CONVERTERS = ("float8", "quantize.linear.float8")
#: torchtitan's rowwise float8 recipes (820504e ``parallelize_llama.py``: ``float8_is_rowwise``).
ROWWISE_RECIPES = ("rowwise", "rowwise_with_gw_hp")
#: The converter of the routed experts' grouped GEMMs (torchao's MoE training), not modelled.
GROUPED_CONVERTER = "quantize.grouped_mm.float8"
#: The line of each model's ``infra/parallelize.py`` at 73a0e69 (v0.2.2) that tests ``"float8" in
#: job_config.model.converters`` (module docstring).
PARALLELIZE_LINE = {"llama3": 77, "llama4": 93, "qwen3": 87, "deepseek_v3": 76, "gpt_oss": 84}
#: [quantize.linear.float8] keys (Float8Linear of job_config.py), read with the Linear converter.
FLOAT8 = {f"quantize.linear.float8.{k}" for k in ("enable_fsdp_float8_all_gather",
                                                  "precompute_float8_dynamic_scale_for_fsdp", "recipe_name",
                                                  "filter_fqns")}
#: torchao's size filter named in ``filter_fqns`` (``_auto_filter_for_recipe``), not a module name.
AUTO_FILTER = "auto_filter_small_kn"


def filters_output(fqns: list) -> bool:
    """Whether a ``filter_fqns`` list keeps the output layer out of float8: torchtitan's
    ``module_filter_fn`` skips a Linear when an entry is part of its fqn, so an entry that is part
    of ``output`` (:data:`AUTO_FILTER` aside, a size filter, not a name).

    >>> filters_output(["output", "router.gate"]), filters_output(["router.gate"]), filters_output([])
    (True, False, False)
    """
    return any(str(f) in "output" for f in fqns if str(f) != AUTO_FILTER)


def float8_used(d: dict) -> set[str]:
    """The float8 keys the reader uses: [quantize.linear.float8] with a Linear converter."""
    converters = [str(c) for c in d.get("model", {}).get("converters", [])]
    return set(FLOAT8) if any(c in LINEAR_CONVERTERS for c in converters) else set()


def read_float8(d: dict, shard: int, notes: list[str], cp: int = 1) -> dict[str, Any]:
    """training.linear_dtype, fp8_output_layer, fp8_recipe (a ``recipe_name`` "rowwise...";
    unset: tensorwise) and fp8_all_gather of the [model] converters and [quantize.linear.float8]
    (module docstring): the output layer converted unless a ``filter_fqns`` entry is part of its
    name ``output`` (default [] since torchtitan a6524d8, April 2025; its presets filter ``"output"``;
    before it torchtitan never converted the output, and the 2024 ``[float8]`` table is read so,
    :func:`meshplan.interop.torchtitan_legacy.old_float8`); the float8 all-gather never with a
    ``recipe_name`` (an assertion there). ``enable_fsdp_float8_all_gather`` is kept wherever FSDP shards
    (dp_shard x ``cp`` > 1): torchtitan runs it only with dp_shard > 1 (``enable_fsdp_float8_all_gather
    = parallel_dims.dp_shard_enabled and ...``, e347b1e ``components/quantization/float8.py``:87-89;
    ``dp_shard_enabled``: ``dp_shard > 1``, ``distributed/parallel_dims.py``:322-323), the rule
    :meth:`~meshplan.spec.training.TrainingSpec.at_dp_shard` applies to every planned or searched mesh, so a
    mesh with dp_shard 1 is planned with FSDP's gather over cp in the compute dtype and a searched
    (or exported) row with dp_shard > 1 keeps the user's float8 all-gather (nc53 #6)."""
    converters = [str(c) for c in d.get("model", {}).get("converters", [])]
    other = [c for c in converters if c not in LINEAR_CONVERTERS + (GROUPED_CONVERTER,)]
    if other:
        notes.append(f"model.converters {other}: not modelled (meshplan models the float8 Linear converter "
                     f"{LINEAR_CONVERTERS[1]!r} only); planned without {'it' if len(other) == 1 else 'them'}")
    if GROUPED_CONVERTER in converters:
        notes.append(f"{GROUPED_CONVERTER}: the routed experts' float8 grouped GEMMs are not modelled; planned in "
                     f"the compute dtype")
    if not any(c in LINEAR_CONVERTERS for c in converters):
        return {}
    key, f8 = "quantize.linear.float8.", d.get("quantize", {}).get("linear", {}).get("float8", {})
    fqns = f8.get("filter_fqns", [])
    fqns = fqns.split(",") if isinstance(fqns, str) else fqns
    if not isinstance(fqns, list):
        raise ConfigError(key + "filter_fqns", f"{fqns!r}; give a list of module names, e.g. [\"output\"]")
    names = [str(f) for f in fqns if str(f) != AUTO_FILTER]
    # torchtitan's module_filter_fn skips a Linear when a filter_fqns entry is part of its fqn:
    # "output" (or "outp") filters the output layer only; an entry such as "o" or "w" filters
    # more than that, which meshplan does not model (the note below)
    others = [f for f in names if f not in "output" or len(f) < 3]
    notes.append("float8 converter: the converted Linear layers' GEMMs planned in fp8 (training.linear_dtype); "
                 "activations, attention, norms and embeddings in the compute dtype")
    if others or AUTO_FILTER in fqns:
        notes.append(f"filter_fqns {others + [AUTO_FILTER] * (AUTO_FILTER in fqns)}: planned with every Linear whose "
                     f"dims are multiples of 16 converted (meshplan filters the output layer only)")
    if f8.get("recipe_name") == "rowwise_with_gw_hp":
        notes.append("recipe rowwise_with_gw_hp keeps the weight-gradient GEMMs in high precision; planned in fp8")
    out: dict[str, Any] = {"linear_dtype": "fp8", "fp8_output_layer": not filters_output(names)}
    if f8.get("recipe_name") in ROWWISE_RECIPES:
        out["fp8_recipe"] = "rowwise"
    out |= float8_tp_of(d, converters, notes)
    if not f8.get("enable_fsdp_float8_all_gather", False):
        return out
    if f8.get("recipe_name") is not None:
        raise ConfigError(key + "recipe_name", f"{f8['recipe_name']!r} with enable_fsdp_float8_all_gather = true: "
                          f"torchtitan refuses the pair (the float8 all-gather is tensorwise scaling only); "
                          f"remove one")
    if shard * cp == 1:
        notes.append("enable_fsdp_float8_all_gather with data_parallel_shard_degree 1 and no cp: FSDP shards "
                     "nothing (torchtitan's fsdp_enabled is dp_shard > 1 or cp > 1), planned without the float8 "
                     "all-gather")
        return out
    if shard == 1:
        notes.append(f"enable_fsdp_float8_all_gather with data_parallel_shard_degree 1: FSDP gathers the weights over "
                     f"dp_shard x cp = {cp} in the compute dtype, torchtitan turning the float8 all-gather off "
                     f"(parallel_dims.dp_shard_enabled: components/quantization/float8.py:87-89 at e347b1e); kept "
                     f"(training.fp8_all_gather) for meshes with dp_shard > 1, as search and export plan them")
    if not f8.get("precompute_float8_dynamic_scale_for_fsdp", False):
        notes.append("precompute_float8_dynamic_scale_for_fsdp is false: torchao all-reduces each float8 weight's "
                     "amax on its own; planned as one all-reduce of all of them (the precompute)")
    return out | {"fp8_all_gather": True}


def float8_tp_of(d: dict, converters: list[str], notes: list[str]) -> dict[str, Any]:
    """``{"fp8_tp": False}`` when ``converters`` name the float8 Linear converter
    ``"quantize.linear.float8"`` but not ``"float8"``, the name torchtitan's parallelize tests
    (module docstring), with a note quoting that test when it acts (tensorwise, tp > 1); {} with
    ``"float8"`` (float8 TP on), and a note when the file names ``[quantize.linear.float8]``
    beside it (``mixed``: the raw file's, :func:`float8_spelling`), a pair no torchtitan reads.

    >>> notes = []
    >>> float8_tp_of({"parallelism": {"tensor_parallel_degree": 2}}, ["quantize.linear.float8"], notes)
    {'fp8_tp': False}
    >>> notes[0][:74]
    'float8 TP off: torchtitan enables it for the converter named "float8" only'
    """
    name = str(d.get("model", {}).get("name", "llama3"))
    line = f"torchtitan/models/{name}/infra/parallelize.py:{PARALLELIZE_LINE.get(name, 77)} at 73a0e69, v0.2.2"
    if LINEAR_CONVERTERS[0] in converters:
        return {}
    tp = d.get("parallelism", {}).get("tensor_parallel_degree", 1)
    if d.get("quantize", {}).get("linear", {}).get("float8", {}).get("recipe_name") not in ROWWISE_RECIPES and \
            isinstance(tp, int) and tp > 1:
        notes.append(f"float8 TP off: torchtitan enables it for the converter named \"float8\" only "
                     f"(enable_float8_linear = \"float8\" in job_config.model.converters, {line}, as from 8a2686c, "
                     f"2025-09-30, to 238fa99), which its registry calls \"quantize.linear.float8\": the tp all-gathers "
                     f"move the compute dtype, each float8 Linear casts after them and all-reduces the amax of a "
                     f"tp-sharded tensor over tp (training.fp8_tp = false)")
    return {"fp8_tp": False}


def mixed_note(raw: dict) -> list[str]:
    """The note of a raw job TOML naming the converter ``"float8"`` beside ``[quantize.linear.float8]``
    (module docstring), which no torchtitan runs as written; none otherwise.

    >>> mixed_note({"model": {"converters": ["float8"]}, "quantize": {"linear": {"float8": {}}}})[0][:60]
    'model.converters "float8" with [quantize.linear.float8]: tor'
    """
    model = raw.get("model", {})
    converters = model.get("converters", []) if isinstance(model, dict) else []
    if float8_spelling(raw) is not Float8Spelling.CURRENT or not isinstance(converters, list) \
            or LINEAR_CONVERTERS[0] not in converters:
        return []
    return ["model.converters \"float8\" with [quantize.linear.float8]: torchtitan from 8a2686c (2025-09-30; "
            "v0.2.0-v0.2.2) registers the converter as \"quantize.linear.float8\" only (KeyError 'float8', "
            "torchtitan/protocols/model_converter.py:62 at 73a0e69), and before 5b5d468 reads [float8]; planned as "
            "\"float8\" runs there, with float8 TP (rename the converter for torchtitan v0.2.x: its TP then "
            "gathers in the compute dtype, training.fp8_tp = false)"]


def write_float8(t) -> tuple[list[str], dict[str, Any]]:
    """([model] converters, the [quantize] table) of ``t``'s float8 Linears (the inverse of
    :func:`read_float8`); nothing without ``linear_dtype``."""
    if t.linear_dtype != "fp8":
        return [], {}
    return [LINEAR_CONVERTERS[1]], {"quantize": {"linear": {"float8": {
        "enable_fsdp_float8_all_gather": t.fp8_all_gather,
        "precompute_float8_dynamic_scale_for_fsdp": t.fp8_all_gather,
        "filter_fqns": [] if t.fp8_output_layer else ["output"],
        **({"recipe_name": "rowwise"} if t.fp8_recipe == "rowwise" else {})}}}}


class Float8Spelling(Enum):
    """How a torchtitan job TOML names the float8 Linear converter and its table, by the
    torchtitan that reads it (pytorch/torchtitan history):

    - ``CURRENT``: ``"quantize.linear.float8"`` and ``[quantize.linear.float8]``, registered by
      8a2686c (2025-09-30, #1763; 5b5d468, 2025-09-26, #1701, had ``quantize.dense.float8`` for
      four days) up to e347b1e, where ``register_model_converter`` knows no ``"float8"``;
    - ``CONVERTER``: ``"float8"`` and ``[float8]`` (job_config.py ``class Float8``), from
      57387af (2025-02-15, #823, the ``ModelConverter`` interface) up to 5b5d468, which does not
      read the current names;
    - ``SWITCH``: the same ``[float8]`` with ``enable_float8_linear = true``, torchtitan's switch
      before 57387af, whose argparse-era loader ignores the keys it does not know.
    """

    CURRENT = "quantize.linear.float8"
    CONVERTER = "float8"
    SWITCH = "enable_float8_linear"


def float8_spelling(raw: dict) -> Float8Spelling:
    """The :class:`Float8Spelling` of a parsed torchtitan job TOML as the user wrote it (before
    :func:`meshplan.interop.torchtitan_legacy.current_layout`): ``CURRENT`` when it names the current
    converter or table anywhere, or no float8 at all; else ``SWITCH`` for a ``[float8]`` table
    with ``enable_float8_linear``, ``CONVERTER`` for another ``[float8]`` table or the converter
    ``"float8"`` (a list entry, or in the old comma-separated string).

    >>> float8_spelling({"model": {"converters": "float8"}}), float8_spelling({"float8": {"enable_float8_linear": True}})
    (<Float8Spelling.CONVERTER: 'float8'>, <Float8Spelling.SWITCH: 'enable_float8_linear'>)
    >>> float8_spelling({"model": {"converters": ["float8"]}, "quantize": {"linear": {"float8": {}}}})
    <Float8Spelling.CURRENT: 'quantize.linear.float8'>
    """
    model, old = raw.get("model", {}), raw.get("float8")
    converters = model.get("converters", []) if isinstance(model, dict) else []
    names = [c.strip() for c in converters.split(",")] if isinstance(converters, str) else \
        [c for c in converters if isinstance(c, str)] if isinstance(converters, list) else []
    linear = raw.get("quantize", {}).get("linear", {}) if isinstance(raw.get("quantize"), dict) else {}
    if LINEAR_CONVERTERS[1] in names or (isinstance(linear, dict) and "float8" in linear):
        return Float8Spelling.CURRENT
    if isinstance(old, dict) and "enable_float8_linear" in old:
        return Float8Spelling.SWITCH
    return Float8Spelling.CONVERTER if isinstance(old, dict) or LINEAR_CONVERTERS[0] in names else \
        Float8Spelling.CURRENT


def converter_named(d: dict, name: str) -> dict:
    """``d`` (job tables) with its float8 Linear converter in ``model.converters`` spelt ``name``
    (one of :data:`LINEAR_CONVERTERS`), the rest as it is.

    >>> converter_named({"model": {"name": "llama3", "converters": ["float8", "x"]}}, "quantize.linear.float8")
    {'model': {'name': 'llama3', 'converters': ['quantize.linear.float8', 'x']}}
    """
    model = d.get("model", {})
    if not isinstance(model, dict) or not isinstance(model.get("converters"), list):
        return d
    return d | {"model": model | {"converters": [name if c in LINEAR_CONVERTERS else c for c in model["converters"]]}}


def spelt(tables: dict, spelling: Float8Spelling) -> dict:
    """Written torchtitan tables (current names) in ``spelling``: under ``CONVERTER`` and
    ``SWITCH`` the converter ``"float8"`` and ``[quantize.linear.float8]`` as ``[float8]``, in
    the place of ``[quantize]`` (which stays after it with its other tables, if any); under
    ``SWITCH`` that table opens with ``enable_float8_linear = true``. Tables without float8 as
    they are.

    >>> t = {"model": {"converters": ["quantize.linear.float8"]}, "quantize": {"linear": {"float8": {"filter_fqns": []}}},
    ...      "training": {}}
    >>> spelt(t, Float8Spelling.SWITCH)
    {'model': {'converters': ['float8']}, 'float8': {'enable_float8_linear': True, 'filter_fqns': []}, 'training': {}}
    """
    quantize = tables.get("quantize", {})
    linear = quantize.get("linear", {}) if isinstance(quantize, dict) else {}
    if spelling is Float8Spelling.CURRENT or not isinstance(linear, dict) or "float8" not in linear:
        return tables
    switch = {"enable_float8_linear": True} if spelling is Float8Spelling.SWITCH else {}
    rest = {k: v for k, v in linear.items() if k != "float8"}
    quantize = {k: v for k, v in quantize.items() if k != "linear"} | ({"linear": rest} if rest else {})
    out: dict[str, Any] = {}
    for key, value in converter_named(tables, LINEAR_CONVERTERS[0]).items():
        if key != "quantize":
            out[key] = value
            continue
        out["float8"] = switch | linear["float8"]
        out |= {"quantize": quantize} if quantize else {}
    return out


def spelt_key(key: str, spelling: Float8Spelling) -> str:
    """A dotted key of the current [quantize.linear.float8] as :func:`spelt` writes it.

    >>> spelt_key("quantize.linear.float8.filter_fqns", Float8Spelling.CONVERTER)
    'float8.filter_fqns'
    """
    old = "quantize.linear.float8."
    return "float8." + key[len(old):] if spelling is not Float8Spelling.CURRENT and key.startswith(old) else key


def spelling_note(spelling: Float8Spelling, source: str) -> list[str]:
    """The header line of an export written in ``source``'s older float8 names (:func:`spelt`);
    none for the current ones. Under ``SWITCH`` it adds that torchtitan's typed config (c1c2f55,
    2025-04-18, ``ConfigManager._dict_to_dataclass``: "Invalid field names") refuses
    ``enable_float8_linear``, which only the argparse-era loader before it ignores."""
    if spelling is Float8Spelling.CURRENT:
        return []
    names = 'model.converters "float8" and [float8] (torchtitan 57387af to 5b5d468, 2025-02-15 to 2025-09-26)'
    if spelling is Float8Spelling.SWITCH:
        names += (", [float8] opening with enable_float8_linear = true (torchtitan before 57387af; from c1c2f55, "
                  "2025-04-18, torchtitan refuses the key: drop it there)")
    return [f"note: float8 written as {source} names it: {names}; torchtitan since 8a2686c (2025-09-30) reads only "
            f"\"quantize.linear.float8\" and [quantize.linear.float8]: rename both to run this file there"]
