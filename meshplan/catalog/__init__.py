"""Built-in catalog: GPUs, nodes, inter-node networks and models, as TOML data with sources.

Each file holds tables keyed by name (``gpus.toml``, ``nodes.toml``, ``networks.toml``,
``models.toml``); every entry has a ``source`` naming the public document its numbers come
from. ``nccl.toml`` holds measured nccl-tests bus-bandwidth curves, which a node names per
link class (``busbw = { nvlink = "a100-nvlink3-ring", ... }``); ``deepep.toml`` DeepEP's
published dispatch and combine bandwidths (:func:`deepep_rates`) and its buffers' sizing
constants (:func:`deepep_buffer`). A node entry also names its
``gpu`` and its ``network``, so a system is node + gpu + network:

>>> system("dgx-h100", nodes=8).world
64
>>> node("seed-8x8-2nic").nic_of(5)
1
>>> model("llama3-70b").param_count()
70553706496

Unknown names are a :class:`~meshplan.errors.ConfigError` listing the known ones.

``kernels.toml`` holds measured kernel performance per GPU (GEMM, attention, memory-bound
bandwidth, overheads) with the source of every point; :func:`kernel_data` returns one GPU's
(``None`` for a GPU without measurements) and :mod:`meshplan.compute.measured` reads it.
"""

from __future__ import annotations

import copy
import tomllib
from functools import lru_cache
from importlib import resources
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from meshplan.catalog.unknown import unknown_message
from meshplan.errors import ConfigError
from meshplan.spec.cluster import BusbwCurve, ClusterSpec, GPUSpec, NetworkTier, NodeSpec
from meshplan.spec.model import ModelSpec

__all__ = ["KINDS", "names", "entry", "gpu", "node", "network", "model", "system"]

KINDS = ("gpu", "node", "network", "model")
#: Catalog models of 8192 positions (Llama 3) -> the same sizes at Llama 3.1's 131072 positions with
#: its RoPE scaling (``models.toml``'s sources: Llama 3 paper Table 3, meta-llama/Llama-3.1-*'s config.json).
LONG_CONTEXT = {"llama3-8b": "llama3.1-8b", "llama3-70b": "llama3.1-70b"}
_NODE_LINKS = ("gpu", "network", "collective_library")  # keys of a node entry that are not NodeSpec fields


@lru_cache(maxsize=None)
def _entries(kind: str) -> dict[str, dict[str, Any]]:
    """Parsed ``<kind>s.toml`` (cached; callers must not mutate it)."""
    if kind not in KINDS:
        raise ConfigError("kind", f"unknown catalog kind '{kind}'; known: {', '.join(KINDS)}")
    text = resources.files(__package__).joinpath(f"{kind}s.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=None)
def _kernels() -> dict[str, Any]:
    return tomllib.loads(resources.files(__package__).joinpath("kernels.toml").read_text(encoding="utf-8"))


def kernel_data(gpu_name: str) -> Optional[dict[str, Any]]:
    """Measured kernel data of GPU ``gpu_name`` from ``kernels.toml`` (a deep copy), with
    ``gemm_from`` / ``attention_from`` / ``norm_from`` resolved (that GPU's GEMM points per
    dtype, unless given here, with its ``bmm_head_dim`` table, its attention rows with this GPU's own rows added, or its norm times), ``gemm_scale`` applied
    (per dtype, a factor on those GEMM rates, the point's source key marked), ``attention_scale`` applied
    (a factor on the rates of the rows taken from ``attention_from``, their source marked) and the ``host``
    table added; ``None`` when the catalog has no measurements for that GPU (e.g. a
    user-described GPU or the CPU testbed).

    >>> d = kernel_data("h200-sxm-141gb")
    >>> d["gemm"]["bf16"][0], d["gemm"]["fp8"][0][3], d["host"]["kernel_issue_s"]
    ([1024, 256, 256, 30.067, 'M1'], 290.8, 4.7e-06)
    >>> sorted({r["kernel"] for r in d["attention"]["rows"]}), d["attention"]["prefer"]
    (['FA2', 'FA3', 'SDPA'], ['FA3', 'FA2'])
    >>> d = kernel_data("h100-hbm2e-96gb-500w")   # H100 SXM5's points x the part's ratios
    >>> d["gemm"]["bf16"][0], d["gemm"]["fp8"][0], d["attention"]["rows"][0]["source"]
    ([1024, 256, 256, 19.128, 'S4 x0.797'], [1024, 1024, 1024, 230.244, 'S3 x0.84'], 'S7c x0.797')
    >>> d = kernel_data("a100-sxm-40gb")   # the 80 GB part's GEMMs and head-dim ratios, its own bandwidth
    >>> d["gemm"] == kernel_data("a100-sxm-80gb")["gemm"], d["bmm_head_dim"]["head_dim"], d["stream_tb_per_s"]
    (True, [64, 80, 96, 128], 1.36)
    >>> kernel_data("cpu-core-fp32") is None
    True
    """
    data = _kernels()
    raw = data["gpu"].get(gpu_name)
    if raw is None:
        return None
    out = copy.deepcopy(raw)
    src = out.pop("gemm_from", None)
    if src is not None:  # its GEMM points, and its batched-GEMM head-dim ratios unless given here
        out["gemm"] = {**copy.deepcopy(data["gpu"][src].get("gemm", {})), **out.get("gemm", {})}
        if "bmm_head_dim" in data["gpu"][src]:
            out.setdefault("bmm_head_dim", copy.deepcopy(data["gpu"][src]["bmm_head_dim"]))
    for dt, f in out.pop("gemm_scale", {}).items():  # another GPU's points x a measured ratio (D)
        out["gemm"][dt] = [[m, n, k, rate * f, f"{key} x{f:g}"] for m, n, k, rate, key in out["gemm"][dt]]
    src, f = out.pop("attention_from", None), out.pop("attention_scale", None)
    if src is not None:  # that GPU's rows (x attention_scale, D), then this one's own (measured here), this one's prefer first
        base, own = copy.deepcopy(data["gpu"][src]["attention"]), out.get("attention", {})
        prefer = own.get("prefer", base.get("prefer"))  # neither: every kernel, sorted (measured.kernel_data)
        rows = base.get("rows", []) if f is None else [
            {**r, "tflops": [t * f for t in r["tflops"]], "source": f"{r['source']} x{f:g}"} for r in base.get("rows", [])]
        out["attention"] = {"rows": rows + own.get("rows", []),
                            **({} if prefer is None else {"prefer": prefer})}
    src = out.pop("norm_from", None)
    if src is not None:
        out.update({k: copy.deepcopy(data["gpu"][src][k]) for k in ("norm_rows", "norm_hidden", "norm_ms")})
    out["host"] = copy.deepcopy(data["host"])
    return out


def names(kind: str) -> list[str]:
    """Entry names of one catalog kind: ``"gpu"``, ``"node"``, ``"network"`` or ``"model"``.

    >>> names("gpu")
    ['a100-sxm-40gb', 'a100-sxm-80gb', 'b200-gb200-186gb', 'b200-sxm-180gb', 'h100-hbm2e-96gb-500w', 'h100-sxm5-80gb', 'h200-sxm-141gb', 'h800-sxm-80gb', 'mi300x-oam-192gb']
    """
    return sorted(_entries(kind))


def entry(kind: str, name: str) -> dict[str, Any]:
    """The raw table of entry ``name`` (a deep copy), with its ``source``. An unknown name is a
    ConfigError (:func:`meshplan.catalog.unknown.unknown_message`: a guess only of the same GPU)."""
    table = _entries(kind)
    if not isinstance(name, str) or name not in table:
        held = {n: e["gpu"] for n, e in _entries("node").items()} if kind == "node" else {}
        raise ConfigError(kind, unknown_message(kind, name, sorted(table), held))
    return copy.deepcopy(table[name])


def _build(cls: type[BaseModel], kind: str, name: str, fields: dict[str, Any]):
    try:
        return cls(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{kind} '{name}'", f"catalog entry invalid at {where}: {first['msg']}") from None


def gpu(name: str) -> GPUSpec:
    """A catalog GPU, e.g. ``gpu("h100-sxm5-80gb").peak_flops("bf16")`` = 989.4e12."""
    entry("gpu", name)  # an unknown or non-string name: the error listing the known ones
    return _build(GPUSpec, "gpu", name, {"name": name, **entry("gpu", name)})


@lru_cache(maxsize=None)
def _curves() -> dict[str, dict[str, Any]]:
    """Parsed ``nccl.toml``: measured busbw curves by name (cached; callers copy)."""
    return tomllib.loads(resources.files(__package__).joinpath("nccl.toml").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def deepep_rates() -> dict[str, Any]:
    """DeepEP's published normal-kernel bandwidths (``deepep.toml`` ``[normal]``, with its source;
    cached, callers copy).

    >>> deepep_rates()["internode_dispatch_gb_per_s"]
    [43.0, 58.0, 51.0]
    """
    return _deepep()["normal"]


@lru_cache(maxsize=None)
def deepep_buffer() -> dict[str, Any]:
    """DeepEP's buffer constants and per-group-size kernel configs (``deepep.toml`` ``[buffer]``, with
    its source; cached, callers copy): what :mod:`meshplan.memory.deepep_buffers` sizes a rank's
    ``deep_ep.Buffer`` from.

    >>> b = deepep_buffer()
    >>> b["group_sizes"][7], b["dispatch_nvl_recv_tokens"][7], b["num_sms"]
    (64, 288, 20)
    """
    return _deepep()["buffer"]


@lru_cache(maxsize=None)
def _deepep() -> dict[str, Any]:
    """Parsed ``deepep.toml`` (cached)."""
    return tomllib.loads(resources.files(__package__).joinpath("deepep.toml").read_text(encoding="utf-8"))


def busbw_curve(name: str) -> BusbwCurve:
    """A measured nccl-tests curve of ``nccl.toml``.

    >>> c = busbw_curve("a100-nvlink3-ring")
    >>> (c.op, c.ranks, c.sizes_bytes[-1], c.busbw_gb_per_s[-1])
    ('all-reduce', 8, 17179869184, 234.9)
    """
    if name not in _curves():
        raise ConfigError("busbw", f"unknown busbw curve '{name}'; known: {', '.join(sorted(_curves()))}")
    return _build(BusbwCurve, "busbw curve", name, copy.deepcopy(_curves()[name]))


def curve_name(curve: BusbwCurve) -> Optional[str]:
    """The name of the ``nccl.toml`` curve equal to ``curve`` (None when it is none of them: a
    user's own table or a calibrated one).

    >>> curve_name(busbw_curve("ib-ndr-400-8nic")), curve_name(busbw_curve("ib-ndr-400-8nic").model_copy(update={"ranks": 4}))
    ('ib-ndr-400-8nic', None)
    """
    return next((n for n in sorted(_curves()) if busbw_curve(n) == curve), None)


def node(name: str) -> NodeSpec:
    """A catalog node (without its GPU model; see :func:`system`), its ``busbw`` curve names
    resolved from ``nccl.toml``."""
    fields = {k: v for k, v in entry("node", name).items() if k not in _NODE_LINKS}
    fields["busbw"] = {k: busbw_curve(v) for k, v in fields.get("busbw", {}).items()}
    return _build(NodeSpec, "node", name, {"name": name, **fields})


def network(name: str) -> list[NetworkTier]:
    """The tiers of a catalog network, innermost (rail/leaf) first."""
    tiers = entry("network", name)["tiers"]
    return [_build(NetworkTier, "network", name, t) for t in tiers]


def network_assumed(name: str) -> tuple[str, ...]:
    """The tier values of catalog network ``name`` that its source does not give, each
    ``"tier.field"`` (the entry's ``assumed`` list, networks.toml's header): what ``meshplan catalog
    network`` marks "(assumed)". A name that is no tier's field is a ConfigError (a catalog error).

    >>> network_assumed("seed-rails"), network_assumed("superpod-hdr-su20")
    (('leaf.nodes_per_domain', 'leaf.oversubscription', 'spine.oversubscription'), ())
    """
    e = entry("network", name)
    fields = {f"{t['name']}.{k}" for t in e["tiers"] for k in NetworkTier.model_fields if k != "name"}
    bad = [a for a in e.get("assumed", []) if a not in fields]
    if bad:
        raise ConfigError("network", f"catalog network '{name}': assumed names {bad[0]!r}, no tier's field")
    return tuple(e.get("assumed", []))


def model(name: str) -> ModelSpec:
    """A catalog model, e.g. ``model("mixtral-8x7b").active_param_count()``."""
    return _build(ModelSpec, "model", name, {"name": name, **entry("model", name)})


def system(name: str, nodes: int, network_name: Optional[str] = None) -> ClusterSpec:
    """``nodes`` catalog nodes ``name`` with their GPU and network (or ``network_name``).

    >>> c = system("dgx-a100", nodes=4)
    >>> (c.gpu.name, c.node.gpus, [t.name for t in c.network])
    ('a100-sxm-80gb', 8, ['leaf', 'spine'])
    """
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ConfigError("nodes", f"must be a whole number of nodes, at least 1; got {nodes!r}")
    raw = entry("node", name)
    net = network_name or raw["network"]
    return _build(ClusterSpec, "system", name, dict(
        name=f"{nodes}x {name}",
        gpu=gpu(raw["gpu"]),
        node=node(name),
        nodes=nodes,
        network=network(net),
        collective_library=raw.get("collective_library", "nccl"),
        source=f"catalog: node {name}, gpu {raw['gpu']}, network {net} (see each entry's source)",
    ))
