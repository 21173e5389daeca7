"""Each table of a TOML config to its spec (:mod:`meshplan.config` reads the file and checks the
tables together): [model] from the catalog, a Hugging Face ``config.json`` or its fields
(:func:`read_model`); [cluster] from a catalog system or its tables (:func:`read_cluster`). Each
built by :func:`meshplan.config_errors.build` (pydantic's errors as one line naming the field),
a catalog's or file reader's error re-raised under the config's field
(:func:`meshplan.config_errors.as_field`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from meshplan import catalog
from meshplan.config_errors import as_field, build
from meshplan.errors import ConfigError
from meshplan.limits import MAX_WORLD, over
from meshplan.spec.cluster import ClusterSpec, NICSpec, NodeSpec
from meshplan.spec.hf import model_from_hf_config
from meshplan.spec.model import ModelSpec


def read_model(t: dict, base: Path | None) -> ModelSpec:
    t = dict(t)
    if "catalog" in t and "hf_config" in t:
        raise ConfigError("model", "give either catalog or hf_config, not both")
    if "catalog" in t:
        if not isinstance(t["catalog"], str):
            raise ConfigError("model.catalog", f"give a catalog model name (got a {type(t['catalog']).__name__}); "
                                               f"known: {', '.join(catalog.names('model'))}")
        with as_field("model.catalog"):
            entry = catalog.model(t.pop("catalog")).model_dump()
        return build(ModelSpec, {**entry, **t}, "model")
    if "hf_config" in t:
        given = t.pop("hf_config")
        if not isinstance(given, str):
            raise ConfigError("model.hf_config", f"give a path string (got {given!r})")
        src = Path(given)
        src = src if src.is_absolute() or base is None else base / src
        where = "" if Path(given).is_absolute() or base is None else " (relative to the TOML file's folder)"
        with as_field("model.hf_config", where):
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
        with as_field("cluster.system"):
            cluster = catalog.system(name, nodes)
        if gpu is not None:
            with as_field("cluster.gpu"):
                cluster = cluster.model_copy(update={"gpu": catalog.gpu(gpu) if isinstance(gpu, str)
                                                     else build(type(cluster.gpu), gpu, "cluster.gpu")})
        if fabric is not None:
            cluster = _with_fabric(cluster, fabric, name)
        if nic is not None:
            node = build(NodeSpec, _with_nics(cluster.node.model_dump(), nic), "cluster.nic")
            cluster = cluster.model_copy(update={"node": node})
        if t:
            raise _beside_system(sorted(t)[0], name)
        return cluster
    if isinstance(t.get("gpu"), str):
        with as_field("cluster.gpu"):
            t["gpu"] = catalog.gpu(t["gpu"]).model_dump()
    t = _named_parts(t)
    if "nic" in t:
        if not isinstance(t.get("node"), dict):
            raise ConfigError("cluster.nic", "sets every NIC of the node: give the node too (node = \"dgx-h200\" or "
                                             "a [cluster.node] table)")
        t["node"] = _with_nics(t["node"], t.pop("nic"))
    return build(ClusterSpec, t, "cluster")


#: The keys of the whole-cluster form (no ``system``) that a catalog node takes when named by ``node``.
WHOLE_CLUSTER_KEYS = ("network", "collective_library", "node")


def _beside_system(key: str, name: str) -> ConfigError:
    """The error for ``key`` beside ``system = name``; for a key of the whole-cluster form
    (:data:`WHOLE_CLUSTER_KEYS`: a network engineer's ``network = [...]`` on a catalog node), the fix:
    ``node = name`` in place of ``system``, the catalog node (its GPU kept where ``gpu`` is left out)
    with the key beside it, as docs/input.md's RoCE example writes it (newcomer trial nc61 #3).

    >>> print(_beside_system("network", "dgx-h100"))
    cluster.network: unknown key beside system (allowed: system, nodes, gpu, fabric, nic); fix: write node = "dgx-h100" in place of system = "dgx-h100", the same catalog node and GPU with network beside it (docs/input.md)
    >>> print(_beside_system("colour", "dgx-h100"))
    cluster.colour: unknown key beside system; allowed: system, nodes, gpu, fabric, nic
    """
    if key not in WHOLE_CLUSTER_KEYS:
        return ConfigError(f"cluster.{key}", "unknown key beside system; allowed: system, nodes, gpu, fabric, nic")
    head = f"cluster.{key}", "unknown key beside system (allowed: system, nodes, gpu, fabric, nic); fix: "
    if key == "node":
        return ConfigError(head[0], head[1] + f"give system = \"{name}\" or node = NAME, not both (node with "
                                              "network = ... names a catalog node on another network; docs/input.md)")
    return ConfigError(head[0], head[1] + f"write node = \"{name}\" in place of system = \"{name}\", the same "
                                          f"catalog node and GPU with {key} beside it (docs/input.md)")


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

    A value is checked here, so an error names the key the user wrote, ``cluster.nic.transport``,
    not the NIC list it is copied into (newcomer trial nc61 #5):

    >>> _with_nics(catalog.node("dgx-h200").model_dump(), {"transport": "ethernet"})
    Traceback (most recent call last):
    meshplan.errors.ConfigError: cluster.nic.transport: "ethernet" is "roce" here (an Ethernet NIC that NCCL drives over RDMA, RoCEv2): set transport = "roce" (the values: 'infiniband' or 'roce')
    """
    if not isinstance(given, dict):
        raise ConfigError("cluster.nic", f"must be a table of NIC keys, e.g. nic = {{ transport = \"roce\", "
                                         f"rate_gbit_per_s = 400.0 }} (got {type(given).__name__} {given!r:.40})")
    bad = sorted(set(given) - set(NIC_KEYS))
    if bad:
        raise ConfigError(f"cluster.nic.{bad[0]}", f"unknown key; allowed: {', '.join(NIC_KEYS)}")
    stand_in = {"name": "nic", "gpus": [], "rail": 0, "rate_gbit_per_s": 1.0}  # only to check given's values
    build(NICSpec, {**stand_in, **given}, "cluster.nic")
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
        with as_field("cluster.network"):
            t["network"] = [tier.model_dump() for tier in catalog.network(net)]
    elif net is not None and not isinstance(net, list):
        raise ConfigError("cluster.network", f"give a catalog network name (meshplan catalog network) or a list of "
                                             f"tier tables [{{ name = ..., latency_us = ..., nodes_per_domain = ..., "
                                             f"oversubscription = ... }}, ...] (got {type(net).__name__} {net!r:.40})")
    node = t.get("node")
    if isinstance(node, str):
        with as_field("cluster.node"):
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
        with as_field(f"cluster.node.busbw.{key}"):
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
