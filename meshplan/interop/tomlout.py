"""A small TOML writer and the meshplan TOML of a config, with its layer split written out.

:func:`dumps` writes tables of scalars, lists of scalars and (inline) lists of tables: what
meshplan's specs hold. :func:`meshplan_tables` turns a :class:`~meshplan.config.Config` into
the tables :func:`meshplan.config.config_from_dict` reads back to an equal config: a catalog
model or node by name when the config holds that entry unchanged, every field otherwise; the
mesh with the layer split the plan uses (``pp_layer_split`` per stage, or per virtual stage
with vpp > 1), so an uneven split (126 layers on pp 16) plans as printed; a config's
``[kernels] files`` as absolute paths (the run's ``--kernels`` files are not the config's).

>>> print(dumps({"model": {"catalog": "llama3-8b"}, "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2]}}), end="")
[model]
catalog = "llama3-8b"
<BLANKLINE>
[mesh]
names = ["dp_shard", "tp"]
shape = [4, 2]
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from meshplan import catalog
from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.common import catalog_model_name
from meshplan.mesh.chunk_maps import chunk_map, virtual_counts
from meshplan.mesh.resolve import Infeasible, Mesh, resolve_mesh, world_error
from meshplan.spec.mesh import MeshSpec


def value(v: Any) -> str:
    """One TOML value: strings as basic strings (JSON escapes are TOML escapes), booleans,
    integers, floats (``inf``/``nan`` spelled as TOML does), lists, inline tables.

    >>> value([1, "a", True, 0.5, {"x": 1}])
    '[1, "a", true, 0.5, {x = 1}]'
    """
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"no TOML value for {type(v).__name__}")


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def dumps(tables: dict[str, dict], header: tuple[str, ...] = ()) -> str:
    """Tables as TOML text: ``header`` lines as comments first; within a table, scalars and
    lists first, then sub-tables as ``[table.sub]`` (a table of sub-tables only gets no header
    line of its own: ``[quantize.linear.float8]`` alone); None values left out.

    >>> print(dumps({"quantize": {"linear": {"float8": {"filter_fqns": ["output"]}}}}), end="")
    [quantize.linear.float8]
    filter_fqns = ["output"]
    """
    out = [f"# {h}" for h in header] + ([""] if header else [])
    for name, table in tables.items():
        _table(out, name, table)
    return "\n".join(out).rstrip("\n") + "\n"


def _table(out: list[str], name: str, table: dict) -> None:
    subs = {k: v for k, v in table.items() if isinstance(v, dict) and v}
    keys = [(k, v) for k, v in table.items() if v is not None and k not in subs]
    if keys or not subs:  # a table holding only sub-tables needs no header of its own
        out.append(f"[{name}]")
        out += [f"{_key(k)} = {value(v)}" for k, v in keys]
        out.append("")
    for k, v in subs.items():
        _table(out, f"{name}.{_key(k)}", v)


def mesh_spec(cfg: Config) -> MeshSpec:
    """The config's [mesh]; ConfigError when it has none (exporting needs one)."""
    if cfg.mesh is None:
        raise ConfigError("mesh", "exporting needs a [mesh]; give one, or export a search row (search --export N)")
    return cfg.mesh


def resolved(cfg: Config) -> Mesh:
    """The config's mesh resolved against its cluster; ConfigError (exporting needs a mesh
    that resolves) otherwise."""
    m = resolve_mesh(mesh_spec(cfg), cfg.cluster.world, cfg.cluster.node.gpus)
    bad = world_error(mesh_spec(cfg), cfg.cluster.world, cfg.cluster.node.gpus,
                      filled=cfg.filled_axes) if isinstance(m, Infeasible) else None
    if bad is not None:  # degrees that cannot make the world: the one line that names the fix
        raise bad
    if isinstance(m, Infeasible):
        raise ConfigError("mesh", f"cannot export a mesh that does not resolve: {m.reasons[0]}")
    return m


def virtual_split(cfg: Config, mesh: Mesh) -> Optional[list[int]]:
    """Layers per virtual stage in model order the plan uses (looped: virtual stage ``chunk * pp +
    stage``; under ZB-V and DualPipeV stage s holds virtual stages s and ``2 pp - 1 - s``:
    :func:`~meshplan.mesh.chunk_maps.chunk_map`), or None with pp 1.

    ConfigError when the layers cannot be assigned (the plan's own reason)."""
    pp, vpp = mesh.degree("pp"), mesh_spec(cfg).virtual_stages
    if pp == 1:
        return None
    counts = virtual_counts(cfg.model.layers, pp, vpp, mesh_spec(cfg).pp_layer_split,
                            chunk_map(mesh_spec(cfg).pp_schedule))
    if isinstance(counts, str):
        raise ConfigError("mesh.pp_layer_split", counts)
    return counts


def model_table(cfg: Config) -> dict:
    """[model]: ``catalog = NAME`` for an unchanged catalog entry, else every field (the RoPE
    scaling whole: its defaults are Llama 3.1's, written out rather than ``{}``)."""
    name = catalog_model_name(cfg.model)
    rs = cfg.model.rope_scaling
    return {"catalog": name} if name else cfg.model.model_dump(exclude_defaults=True) | {"name": cfg.model.name} | (
        {"rope_scaling": rs.model_dump()} if rs is not None else {})


def cluster_table(cfg: Config) -> dict:
    """[cluster]: ``system``/``nodes`` (and ``gpu``) when the cluster is a catalog node
    unchanged, else every field."""
    c = cfg.cluster  # without the run's measured kernel files (a [kernels] table of their own)
    c = c.model_copy(update={"gpu": c.gpu.model_copy(update={"kernels": ()})}) if c.gpu.kernels else c
    if c.node.name in catalog.names("node"):
        base = catalog.system(c.node.name, c.nodes)
        if base == c:
            return {"system": c.node.name, "nodes": c.nodes}
        if c.gpu.name in catalog.names("gpu") and base.model_copy(update={"gpu": catalog.gpu(c.gpu.name)}) == c:
            return {"system": c.node.name, "nodes": c.nodes, "gpu": c.gpu.name}
    return c.model_dump(mode="json")


#: The [mesh] keys of the pipeline, which :func:`meshplan_tables` leaves out at pp 1 (where plan notes that
#: a schedule does not apply).
PIPELINE_KEYS = ("pp_schedule", "virtual_stages", "layers_per_virtual_stage", "pp_layer_split")


def training_table(t) -> dict:
    """[training] of the :class:`~meshplan.spec.training.TrainingSpec` ``t``: every field it was given
    (the user's keys, a search row's settings, the framework's defaults resolved when read), at its
    default value too (``memory_reserve = 0.10``, ``sharding = "zero3"`` as the user wrote them), and
    every field off its default; ``global_batch`` and ``seq_len`` always.

    >>> from meshplan.spec.training import TrainingSpec
    >>> training_table(TrainingSpec(global_batch=8, seq_len=16, memory_reserve=0.1, sharding="zero3", micro_batch=2))
    ... # param_dtype and vocab_pad_divisor: framework torch's, resolved when built  # doctest: +NORMALIZE_WHITESPACE
    {'global_batch': 8, 'seq_len': 16, 'micro_batch': 2, 'param_dtype': 'fp32', 'sharding': 'zero3',
     'memory_reserve': 0.1, 'vocab_pad_divisor': 1}
    """
    full, given = t.model_dump(mode="json"), set(t.model_fields_set) | {"global_batch", "seq_len"}
    return {k: v for k, v in full.items() if k in given} | t.model_dump(mode="json", exclude_defaults=True)


def meshplan_tables(cfg: Config) -> dict[str, dict]:
    """The config as meshplan tables with the layer split written out (module docstring)."""
    mesh = resolved(cfg)
    spec = mesh_spec(cfg).model_dump(mode="json", exclude_defaults=True)
    split = virtual_split(cfg, mesh)
    if split is not None:
        vpp, pp, vs = spec.get("virtual_stages", 1), mesh.degree("pp"), chunk_map(mesh_spec(cfg).pp_schedule)
        per_stage = [sum(split[vs(c, k, pp, vpp)] for c in range(vpp)) for k in range(pp)]
        # per stage when the plan's chunking of it is the default one, else per virtual stage
        spec["pp_layer_split"] = per_stage if virtual_counts(cfg.model.layers, pp, vpp, per_stage, vs) == split \
            else split
    else:  # pp 1: no pipeline, so no pipeline key (the schedule's default is dumped as a name: written otherwise)
        spec = {k: v for k, v in spec.items() if k not in PIPELINE_KEYS}
    spec = _named_etp(spec, mesh)
    tables = {"model": model_table(cfg), "cluster": cluster_table(cfg), "training": training_table(cfg.training),
              "mesh": spec}
    memory = cfg.memory.model_dump(mode="json", exclude_defaults=True)
    kernels = {"files": [str(Path(f).resolve()) for f in cfg.kernel_files]} if cfg.kernel_files else {}
    checkpoint = {"checkpoint_interval_steps": cfg.checkpoint_interval_steps} if cfg.checkpoint_interval_steps else {}
    source = {"path": str(Path(cfg.source[0]).resolve()), "format": cfg.source[1]} if cfg.source else {}
    source |= {"config": cfg.source_config} if cfg.source and cfg.source_config else {}
    return tables | ({"memory": memory} if memory else {}) | ({"kernels": kernels} if kernels else {}) | (
        {"reliability": checkpoint} if checkpoint else {}) | ({"source": source} if source else {})


def _named_etp(spec: dict, mesh: Mesh) -> dict:
    """The [mesh] table ``spec`` with ``etp = 1`` named where ep > 1 beside tp > 1 and the table
    leaves etp out (a search row's mesh, :func:`meshplan.search.candidate.candidate_config`, omits
    degree-1 axes): read back under ``framework = "megatron"`` a missing etp is tp
    (:func:`meshplan.config_mesh.megatron_etp`, Megatron-LM's default), another mesh.

    >>> from types import SimpleNamespace as N
    >>> m = N(ep=8, etp=1, degree=lambda a: {"tp": 2}.get(a, 1))
    >>> _named_etp({"names": ["dp", "tp", "ep"], "shape": [16, 2, 8]}, m)
    {'names': ['dp', 'tp', 'ep', 'etp'], 'shape': [16, 2, 8, 1]}
    """
    if mesh.ep == 1 or mesh.etp != 1 or mesh.degree("tp") == 1:
        return spec
    if "names" in spec and "etp" not in spec["names"]:
        return spec | {"names": [*spec["names"], "etp"], "shape": [*spec["shape"], 1]}
    if "degrees" in spec and "etp" not in spec["degrees"]:
        return spec | {"degrees": spec["degrees"] | {"etp": 1}}
    return spec
