"""Each table of a TOML config to its spec (:mod:`meshplan.config` reads the file and checks the
tables together): pydantic's errors as one line naming the field, with the likely key for a
misspelt one and the right table for a misplaced one (:func:`build`); [model] from the catalog,
a Hugging Face ``config.json`` or its fields (:func:`read_model`); [cluster] from a catalog
system or its tables (:func:`read_cluster`); a catalog's or file reader's error re-raised
under the config's field.
"""

from __future__ import annotations

import difflib
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from meshplan import catalog
from meshplan.errors import ConfigError, closest, printable
from meshplan.limits import MAX_WORLD, bound_message, over
from meshplan.spec.cluster import ClusterSpec, NodeSpec
from meshplan.spec.hf import model_from_hf_config
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
        return f'"{got}" {gone} (the values: {msg.removeprefix("Input should be ")})'
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


def read_model(t: dict, base: Path | None) -> ModelSpec:
    t = dict(t)
    if "catalog" in t and "hf_config" in t:
        raise ConfigError("model", "give either catalog or hf_config, not both")
    if "catalog" in t:
        if not isinstance(t["catalog"], str):
            raise ConfigError("model.catalog", f"give a catalog model name (got a {type(t['catalog']).__name__}); "
                                               f"known: {', '.join(catalog.names('model'))}")
        with _as_field("model.catalog"):
            entry = catalog.model(t.pop("catalog")).model_dump()
        return build(ModelSpec, {**entry, **t}, "model")
    if "hf_config" in t:
        given = t.pop("hf_config")
        if not isinstance(given, str):
            raise ConfigError("model.hf_config", f"give a path string (got {given!r})")
        src = Path(given)
        src = src if src.is_absolute() or base is None else base / src
        where = "" if Path(given).is_absolute() or base is None else " (relative to the TOML file's folder)"
        with _as_field("model.hf_config", where):
            entry = model_from_hf_config(src).model_dump()
        return build(ModelSpec, {**entry, **t}, "model")
    return build(ModelSpec, t, "model")


def read_cluster(t: dict) -> ClusterSpec:
    t = dict(t)
    if isinstance(t.get("gpu"), dict) and "kernels" in t["gpu"]:  # GPUSpec.kernels: set by the run, not written
        raise ConfigError("cluster.gpu.kernels", "not a key of a GPU table; list measured kernel tables in "
                                                 "[kernels] files = [...] (or pass --kernels FILE)")
    if "system" in t:
        name = t.pop("system")
        if "nodes" not in t:
            raise ConfigError("cluster.nodes", "required with system; give the number of nodes")
        gpu, fabric, nodes, nic = t.pop("gpu", None), t.pop("fabric", None), t.pop("nodes"), t.pop("nic", None)
        if not isinstance(name, str):
            raise ConfigError("cluster.system", f"give a catalog node name (got a {type(name).__name__}); "
                                                f"known: {', '.join(catalog.names('node'))}")
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ConfigError("cluster.nodes", f"must be a whole number of nodes, at least 1; got {nodes!r}")
        if nodes > MAX_WORLD:
            raise ConfigError("cluster.nodes", over("nodes", nodes))
        with _as_field("cluster.system"):
            cluster = catalog.system(name, nodes)
        if gpu is not None:
            with _as_field("cluster.gpu"):
                cluster = cluster.model_copy(update={"gpu": catalog.gpu(gpu) if isinstance(gpu, str)
                                                     else build(type(cluster.gpu), gpu, "cluster.gpu")})
        if fabric is not None:
            cluster = _with_fabric(cluster, fabric, name)
        if nic is not None:
            node = build(NodeSpec, _with_nics(cluster.node.model_dump(), nic), "cluster.nic")
            cluster = cluster.model_copy(update={"node": node})
        if t:
            raise ConfigError(f"cluster.{sorted(t)[0]}", "unknown key beside system; allowed: system, nodes, gpu, "
                                                         "fabric, nic")
        return cluster
    if isinstance(t.get("gpu"), str):
        with _as_field("cluster.gpu"):
            t["gpu"] = catalog.gpu(t["gpu"]).model_dump()
    t = _named_parts(t)
    if "nic" in t:
        if not isinstance(t.get("node"), dict):
            raise ConfigError("cluster.nic", "sets every NIC of the node: give the node too (node = \"dgx-h200\" or "
                                             "a [cluster.node] table)")
        t["node"] = _with_nics(t["node"], t.pop("nic"))
    return build(ClusterSpec, t, "cluster")


#: The keys ``[cluster] nic = { ... }`` may set on every NIC of the node.
NIC_KEYS = ("transport", "rate_gbit_per_s")


def _with_nics(node: dict, given) -> dict:
    """``node`` (a node table) with the keys of ``given`` (``[cluster] nic = { transport = "roce",
    rate_gbit_per_s = 400.0 }``, :data:`NIC_KEYS`) set on each of its NICs, the others kept, and
    its source saying so: a catalog node's NICs on another fabric without writing the node whole.

    >>> n = _with_nics(catalog.node("dgx-h200").model_dump(), {"transport": "roce"})
    >>> {x["transport"] for x in n["nics"]}, {x["rate_gbit_per_s"] for x in n["nics"]}, n["source"][-52:]
    ({'roce'}, {400.0}, "config's [cluster] nic (transport roce) on every NIC")
    >>> _with_nics(catalog.node("dgx-h200").model_dump(), {"speed": 1})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: cluster.nic.speed: unknown key; allowed: transport, rate_gbit_per_s
    """
    if not isinstance(given, dict):
        raise ConfigError("cluster.nic", f"must be a table of NIC keys, e.g. nic = {{ transport = \"roce\", "
                                         f"rate_gbit_per_s = 400.0 }} (got {type(given).__name__} {given!r:.40})")
    bad = sorted(set(given) - set(NIC_KEYS))
    if bad:
        raise ConfigError(f"cluster.nic.{bad[0]}", f"unknown key; allowed: {', '.join(NIC_KEYS)}")
    said = ", ".join(f"{k} {given[k]}" for k in NIC_KEYS if k in given)
    return {**node, "nics": [{**nic, **given} for nic in node.get("nics", [])],
            "source": f"{node.get('source', '')}; config's [cluster] nic ({said}) on every NIC"}


def nic_override_gbit(node_source: str) -> Optional[float]:
    """The ``rate_gbit_per_s`` a config's ``[cluster] nic`` set on every NIC, read back from the
    node source :func:`_with_nics` wrote (``--calibration`` then replaces the NICs' rate with its fit,
    so the config's line rate lives on only there), or None where it set none.

    >>> nic_override_gbit(_with_nics(catalog.node("dgx-h100").model_dump(), {"rate_gbit_per_s": 50.0})["source"])
    50.0
    >>> nic_override_gbit(catalog.node("dgx-h100").source) is None
    True
    """
    said = re.search(r"config's \[cluster\] nic \([^)]*\brate_gbit_per_s ([0-9.eE+]+)", node_source)
    return float(said[1]) if said else None


def _named_parts(t: dict) -> dict:
    """An inline [cluster] table with the catalog's names resolved where a table or list goes:
    ``network = "superpod-hdr-su20"`` (a catalog network's tiers), ``node = "dgx-a100-40gb"`` (a catalog
    node, and its GPU where ``gpu`` is not given) and ``node.busbw = { nvlink = "a100-nvlink3-ring" }`` (a
    catalog ``nccl.toml`` curve). A
    value of another type (``network``, ``node``, ``node.busbw`` or one of its curves) is a ConfigError
    naming the field and both forms.

    >>> t = _named_parts({"network": "superpod-hdr-su20", "node": {"busbw": {"nvlink": "a100-nvlink3-ring"}}})
    >>> [tier["name"] for tier in t["network"]], t["node"]["busbw"]["nvlink"]["ranks"]
    (['leaf', 'spine'], 8)
    >>> _named_parts({"node": "dgx-h200"})["gpu"]["name"]
    'h200-sxm-141gb'
    >>> _named_parts({"network": 3})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: cluster.network: give a catalog network name (meshplan catalog network) or a list of tier tables [{ name = ..., latency_us = ..., nodes_per_domain = ..., oversubscription = ... }, ...] (got int 3)
    """
    t = dict(t)
    net = t.get("network")
    if isinstance(net, str):
        with _as_field("cluster.network"):
            t["network"] = [tier.model_dump() for tier in catalog.network(net)]
    elif net is not None and not isinstance(net, list):
        raise ConfigError("cluster.network", f"give a catalog network name (meshplan catalog network) or a list of "
                                             f"tier tables [{{ name = ..., latency_us = ..., nodes_per_domain = ..., "
                                             f"oversubscription = ... }}, ...] (got {type(net).__name__} {net!r:.40})")
    node = t.get("node")
    if isinstance(node, str):
        with _as_field("cluster.node"):
            t["node"] = catalog.node(node).model_dump()
            if "gpu" not in t:  # the catalog node's own GPU (newcomer trial 51: node = "dgx-h200" alone)
                t["gpu"] = catalog.gpu(catalog.entry("node", node)["gpu"]).model_dump()
    elif node is not None and not isinstance(node, dict):
        raise ConfigError("cluster.node", f"give a catalog node name (meshplan catalog node) or a [cluster.node] "
                                          f"table (docs/input.md) (got {type(node).__name__} {node!r:.40})")
    elif isinstance(node, dict) and "busbw" in node:
        busbw = node["busbw"]
        if not isinstance(busbw, dict):
            raise ConfigError("cluster.node.busbw", f"give a table of link class -> catalog curve name or measured "
                                                    f"curve, busbw = {{ nvlink = \"a100-nvlink3-ring\" }} (got "
                                                    f"{type(busbw).__name__} {busbw!r:.40})")
        t["node"] = {**node, "busbw": {k: _curve(k, v) for k, v in busbw.items()}}
    return t


def _curve(key: str, value: Any) -> Any:
    """``node.busbw``'s ``key`` entry: a catalog curve's name resolved (:func:`_named_parts`)."""
    if isinstance(value, str):
        with _as_field(f"cluster.node.busbw.{key}"):
            return catalog.busbw_curve(value).model_dump()
    if not isinstance(value, dict):
        raise ConfigError(f"cluster.node.busbw.{key}", f"give a catalog curve name (meshplan/catalog/nccl.toml, e.g. "
                                                       f"\"a100-nvlink3-ring\") or a table of a measured curve (got "
                                                       f"{type(value).__name__} {value!r:.40})")
    return value


def _with_fabric(cluster: ClusterSpec, given, system: str) -> ClusterSpec:
    """``cluster`` with the keys of ``given`` (a [cluster] ``fabric`` table beside ``system``)
    replacing its node's NVLink fabric's, the others kept: ``fabric = { bandwidth_gb_per_s =
    200.0 }`` is the catalog node at another link rate (its busbw curves are then read against
    that rate, :func:`meshplan.comm.alphabeta.measured_time`). Its ``source`` names the
    override unless ``given`` has one.

    >>> from meshplan import catalog
    >>> f = _with_fabric(catalog.system("dgx-h100", 1), {"bandwidth_gb_per_s": 200.0}, "dgx-h100").node.fabric
    >>> f.bandwidth_gb_per_s, f.nvls, f.source
    (200.0, True, "config's [cluster] fabric (bandwidth_gb_per_s) over catalog node dgx-h100's nvlink4 (450 GB/s)")
    """
    if not isinstance(given, dict):
        raise ConfigError("cluster.fabric", f"must be a table of fabric keys, e.g. fabric = {{ bandwidth_gb_per_s = "
                                            f"200.0 }} (got {type(given).__name__} {str(given)[:40]!r})")
    old = cluster.node.fabric
    src = given.get("source") or (f"config's [cluster] fabric ({', '.join(sorted(given))}) over catalog node "
                                  f"{system}'s {old.name} ({old.bandwidth_gb_per_s:g} GB/s)")
    fabric = build(type(old), {**old.model_dump(), **given, "source": src}, "cluster.fabric")
    return cluster.model_copy(update={"node": cluster.node.model_copy(update={"fabric": fabric}),
                                      "source": f"{cluster.source}; NVLink fabric: {src}"})


@contextmanager
def _as_field(field: str, where: str = ""):
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
