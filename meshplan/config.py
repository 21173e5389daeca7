"""Read a TOML plan input with tables [model], [cluster], [training], [mesh].

Keys are strict: an unknown key is an error naming the key and its table. Every error is a
one-line :class:`~meshplan.errors.ConfigError`.

[model]   ``catalog = "llama3-70b"`` (fields given beside it override the entry), or
          ``hf_config = "path/config.json"`` (relative to the TOML file), or every field.
[cluster] ``system = "dgx-h100"`` and ``nodes = 8`` (a catalog node with its GPU and
          network), optionally ``gpu = "h200-sxm-141gb"`` to swap the GPU; or explicit
          ``[cluster.gpu]``, ``[cluster.node]`` tables.
[training], [mesh]  fields of :class:`TrainingSpec` and :class:`MeshSpec`.
[memory]  optional: fields of :class:`~meshplan.spec.memory.MemoryOptions` (timeline
          parameters: prefetch, buckets, NCCL buffers, workspace, fragmentation).
[search]  optional: fields of :class:`~meshplan.spec.search.SearchOptions` (what
          ``meshplan search`` enumerates); ignored by every other command.
[kernels] optional: ``files = ["my-h100.toml"]``, measured kernel tables in kernels.toml form
          (``meshplan bench gemm --grid``; paths relative to the TOML file) laid over the
          catalog's for the config's GPU (as ``--kernels`` does; :mod:`meshplan.compute.kernel_fragment`).
[reliability] optional: ``checkpoint_interval_steps = 500``, the steps between the job's checkpoint saves
          (torchtitan's ``checkpoint.interval``, Megatron-LM's ``--save-interval``), which
          ``meshplan reliability`` sets beside the optimal interval; ignored by every other command.
[source]  optional, written by ``meshplan import``: ``path`` (relative to the TOML file) and ``format``
          (torchtitan, megatron, deepspeed) of the foreign config it was imported from, whose settings
          meshplan does not plan ``meshplan export`` carries (:mod:`meshplan.interop.source_file`);
          for a torchtitan config registry (.py) ``config``, the function read (``import --config``).

``meshplan search`` reads configs without [mesh] (``require_mesh=False``); every other
command needs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshplan import catalog
from meshplan.config_tables import read_cluster, read_model
from meshplan.config_errors import build
from meshplan.config_mesh import axes_of, megatron_etp, read_mesh, torch_etp
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import FILE_BYTES, MAX_STRING, MAX_TOML_DEPTH, MAX_WORLD, over
from meshplan.spec import recompute_modules
from meshplan.spec.cluster import ClusterSpec
from meshplan.spec.memory import MemoryOptions
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.search import SearchOptions
from meshplan.spec.training import TrainingSpec
from meshplan.spec.training_checks import check_op_sac_policy, megatron_dispatcher, torch_deepep_reason

TABLES = ("model", "cluster", "training", "mesh")
OPTIONAL_TABLES = ("memory", "search", "kernels", "reliability", "source")
#: The foreign formats a [source] table names.
SOURCE_FORMATS = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class Config:
    """The four specs of one plan input; ``path`` is where it was read from (or None);
    ``memory``, ``search``: the optional [memory] and [search] tables (defaults when absent);
    ``mesh`` is None only for a config read with ``require_mesh=False``; its axis names are
    canonical (:func:`meshplan.spec.axes.canonical_names`: ``fsdp`` is ``dp_shard``);
    ``notes``: what the reader decided for the user (an alias renamed, a foreign file's
    fields left unused), printed by the CLI as ``note: ...`` lines; ``origin``: the foreign
    format it was read from (``deepspeed``, ``torchtitan``, ``megatron``; "" for a meshplan
    TOML), whose words the text uses (:mod:`meshplan.spec.wording`); ``kernel_files``: the
    [kernels] table's files, resolved against the TOML's folder (the CLI lays them over the
    catalog's kernel data, :func:`meshplan.cli.loading._measured_cluster`);
    ``checkpoint_interval_steps``: the [reliability] table's ``checkpoint_interval_steps`` (None: not said);
    ``source``: the [source] table, (path resolved against the TOML's folder, format), or None;
    ``source_config``: its ``config``, the function of a torchtitan Python config registry it names (None
    for another file);
    ``source_model``: the foreign file's own keys naming a model it describes by a Hugging Face
    config (a torchtitan job TOML's ``model.name``, ``model.flavor`` and ``model.hf_assets_path`` as
    written), which an export to that format writes back; () otherwise; ``filled_axes``: the axes
    the reader appended to a names + shape (or order + degrees) [mesh] the user did not write (the etp
    default, :func:`~meshplan.config_mesh.megatron_etp`, :func:`~meshplan.config_mesh.torch_etp`), which
    a fix line leaves out of the shape it prints
    in the user's own entries (:func:`meshplan.mesh.resolve.world_error`); ``source_said``: a foreign
    file's own words, ``(dotted key, value as written)``, for a setting the reader left unset for each
    mesh to resolve, where the file wrote it (torchtitan's ``parallelism.fsdp_reshard_after_forward =
    "default"``; a key the file omits is absent), which :mod:`meshplan.schedule.reshard_note` quotes;
    ``fp8_all_gather_asked``: set by :func:`meshplan.plan.build_plan` where it turned the float8
    all-gather off for a mesh of dp_shard 1 (:meth:`~meshplan.spec.training.TrainingSpec.at_dp_shard`):
    the user's True, which a re-plan of another mesh (:class:`meshplan.schedule.verdict.Rebuilt`) restores."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    mesh: MeshSpec | None
    path: str | None = None
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    search: SearchOptions = field(default_factory=SearchOptions)
    notes: tuple[str, ...] = ()
    origin: str = ""
    kernel_files: tuple[str, ...] = ()
    checkpoint_interval_steps: int | None = None
    source: tuple[str, str] | None = None
    source_config: str | None = None
    source_model: tuple[tuple[str, str], ...] = ()
    filled_axes: tuple[str, ...] = ()
    source_said: tuple[tuple[str, str], ...] = ()
    fp8_all_gather_asked: bool = False


def load_config(path: str | Path, require_mesh: bool = True) -> Config:
    """Read and validate a TOML config. Raises ConfigError (one line) on any problem.
    ``require_mesh=False`` accepts a config without [mesh] (``mesh`` is then None)."""
    p = Path(path)
    if "\0" not in str(p) and p.is_dir():
        held = sorted(x.name for x in p.glob("*.toml"))
        inside = f" (it holds {', '.join(held[:3])}{' ...' if len(held) > 3 else ''})" if held else ""
        raise ConfigError("config", f"{str(p)!r} is a directory; give a TOML config file{inside}")
    if "\0" not in str(p) and not p.exists() and not p.is_symlink():
        raise ConfigError("config", f"no file {str(p)!r}; give the path of a TOML config (see examples/)")
    text = read_text_limited(p, "config", FILE_BYTES["config"], "give the path of a TOML config (see examples/)")
    return config_from_dict(parse_toml(text, str(p)), base=p.parent, path=str(p), require_mesh=require_mesh)


def check_values(value: Any, where: str, depth: int = 0) -> None:
    """Bounds every config value shares, before any table is read (:mod:`meshplan.limits`):
    nesting depth, string and list lengths, finite floats, integers exact in a float (each
    field's own bound is checked by its spec). Raises a ConfigError naming the field.

    >>> check_values({"training": {"seq_len": float("inf")}}, "")
    Traceback (most recent call last):
    ...
    meshplan.errors.ConfigError: training.seq_len: inf is not a finite number; give a finite value
    """
    field = where or "config"
    if where and not where.isprintable():
        raise ConfigError(where, "a key with a control character; keys are printable names")
    if depth > MAX_TOML_DEPTH:
        raise ConfigError(field, f"nested {depth} levels deep; {over('toml depth', depth)}")
    if isinstance(value, dict):
        for k, v in value.items():
            if len(k) > MAX_STRING:
                raise ConfigError(field, f"a key of {len(k)} characters; {over('string', len(k))}")
            check_values(v, f"{where}.{k}" if where else k, depth + 1)
    elif isinstance(value, list):
        if len(value) > MAX_WORLD:
            raise ConfigError(field, f"a list of {len(value)} values; the longest, mesh.rank_to_gpu, has one per "
                                     f"rank: {over('world', len(value))}")
        for i, v in enumerate(value):
            check_values(v, f"{field}[{i}]", depth + 1)
    elif isinstance(value, str) and len(value) > MAX_STRING:
        raise ConfigError(field, f"a string of {len(value)} characters; {over('string', len(value))}")
    elif isinstance(value, str) and not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ConfigError(field, f"contains the control character {bad!r}; names, paths and options are "
                                 "printable text (it would be echoed to the terminal)")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(field, f"{value} is not a finite number; give a finite value")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2 ** 53:
        raise ConfigError(field, f"{value} is too large for any field: integers beyond 2^53 are not exact in a "
                                 f"float; see the field's bound in docs/input.md")


def config_from_dict(data: dict[str, Any], base: Path | None = None, path: str | None = None,
                     require_mesh: bool = True) -> Config:
    """Validate an already-parsed config mapping (see :func:`load_config`)."""
    check_values(data, "")
    unknown = set(data) - set(TABLES) - set(OPTIONAL_TABLES)
    if unknown:
        name = sorted(unknown)[0]
        raise ConfigError(name if name.isidentifier() else repr(name),
                          f"unknown table; allowed tables are {list(TABLES + OPTIONAL_TABLES)}")
    for t in OPTIONAL_TABLES:
        if not isinstance(data.get(t, {}), dict):
            raise ConfigError(t, "must be a table")
    for t in TABLES:
        if t == "mesh" and not require_mesh and t not in data:
            continue
        if t not in data:
            raise ConfigError(t, f"missing table [{t}]; every config needs {['[' + x + ']' for x in TABLES]}")
        if not isinstance(data[t], dict):
            raise ConfigError(t, "must be a table")
    mesh, notes = read_mesh(data["mesh"]) if "mesh" in data else (None, ())
    written = axes_of(mesh)
    model, training = read_model(data["model"], base), build(TrainingSpec, data["training"], "training")
    if mesh is not None and training.framework == "megatron":
        mesh, notes = megatron_etp(mesh, notes)
    elif mesh is not None and model.is_moe:
        mesh, notes = torch_etp(mesh, notes)
    _check_routing(model, training)
    notes = (*notes, *recompute_modules.config_notes(model, training))
    if mesh is not None and training.moe_dispatcher == "deepep":
        _check_deepep_group(mesh, training.framework)
    cluster = read_cluster(data["cluster"])
    if training.linear_dtype is not None and training.linear_dtype not in cluster.gpu.peak_tflops:
        raise ConfigError("training.linear_dtype", f"{cluster.gpu.name} has no {training.linear_dtype} peak "
                          f"(float8 GEMMs need fp8 tensor cores, sm89+; its peaks: "
                          f"{', '.join(sorted(cluster.gpu.peak_tflops))}); remove it or plan another GPU")
    search = build(SearchOptions, data.get("search", {}), "search")
    if True in (search.tp_comm_overlap or []) and training.framework == "torch" and not training.torch_compile:
        raise ConfigError("search.tp_comm_overlap", "true under framework \"torch\" is torchtitan's async TP, which "
                          "needs torch.compile: set training.torch_compile = true, or allow only false")
    if "recompute" in search.model_fields_set and "op" in search.recompute and not training.has_op_recompute:
        field = training.op_recompute_blocker
        what = f"{field} \"{getattr(training, field)}\"" + (" (DeepSpeed's ZeRO-1/2)" if field == "zero12_engine" else "")
        raise ConfigError("search.recompute", f"'op' is torchtitan's op-level selective AC, which {what} does not "
                          "have: remove it from the list")
    if "recompute" in search.model_fields_set and "layer" in search.recompute and not training.has_op_recompute:
        field = training.op_recompute_blocker
        raise ConfigError("search.recompute", f"'layer' is torchtitan's per-layer selective AC, searched only where "
                          f"torchtitan runs the rows (framework \"torch\" with FSDP2; here {field} "
                          f"\"{getattr(training, field)}\"): remove it from the list")
    if "recompute" in search.model_fields_set and "block" in search.recompute and training.framework != "megatron":
        raise ConfigError("search.recompute", f"'block' is Megatron-LM's block recompute (--recompute-method block), "
                          f"searched only under training.framework \"megatron\" (here \"{training.framework}\"): "
                          "remove it from the list")
    check_op_sac_policy(training)
    return Config(model=model, cluster=cluster, training=training, mesh=mesh, path=path,
                  memory=build(MemoryOptions, data.get("memory", {}), "memory"), search=search, notes=notes,
                  kernel_files=_kernel_files(data.get("kernels", {}), base),
                  checkpoint_interval_steps=_interval_steps(data.get("reliability", {})),
                  source=_source(data.get("source", {}), base), source_config=_source_config(data.get("source", {})),
                  filled_axes=tuple(n for n in axes_of(mesh) if n not in written))


def _source(t: dict, base: Path | None) -> tuple[str, str] | None:
    """The [source] table: (``path`` relative to the TOML file's folder ``base``, resolved;
    ``format``), None when absent. The file need not exist (export says so when it is gone)."""
    if not t:
        return None
    if set(t) - {"path", "format", "config"}:
        raise ConfigError(f"source.{sorted(set(t) - {'path', 'format', 'config'})[0]}",
                          "unknown key in [source]; allowed keys: path, format, config")
    path, fmt = t.get("path"), t.get("format")
    if not isinstance(path, str) or not path:
        raise ConfigError("source.path", "give the path of the foreign config this TOML was imported from, "
                          "relative to this config (or remove [source])")
    if fmt not in SOURCE_FORMATS:
        raise ConfigError("source.format", f"{fmt!r}; use {', '.join(SOURCE_FORMATS)} (or remove [source])")
    return str(Path(path) if Path(path).is_absolute() or base is None else base / path), fmt


def _source_config(t: dict) -> str | None:
    """The [source] table's ``config``: the function of the torchtitan config registry (a ``.py``) the
    TOML was imported from (``import --config NAME``), which ``export --to torchtitan -o FILE.py`` writes
    back with the file's other values; None when absent."""
    fn = t.get("config")
    if fn is None:
        return None
    if not isinstance(fn, str) or not fn.isidentifier() or t.get("format") != "torchtitan":
        raise ConfigError("source.config", f"{str(fn)[:40]!r}; give the name of the torchtitan config function "
                          f"(format \"torchtitan\") the TOML was imported from, or remove it")
    return fn


def _interval_steps(t: dict) -> int | None:
    """The [reliability] table's ``checkpoint_interval_steps`` (whole number >= 1), None when absent."""
    if set(t) - {"checkpoint_interval_steps"}:
        raise ConfigError(f"reliability.{sorted(set(t) - {'checkpoint_interval_steps'})[0]}",
                          "unknown key in [reliability]; allowed keys: checkpoint_interval_steps")
    n = t.get("checkpoint_interval_steps")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ConfigError("reliability.checkpoint_interval_steps",
                          f"{n!r}: give the steps between checkpoint saves, a whole number >= 1")
    return n


def _kernel_files(t: dict, base: Path | None) -> tuple[str, ...]:
    """The [kernels] table's ``files``, each relative to the TOML file's folder (``base``)."""
    if set(t) - {"files"}:
        raise ConfigError(f"kernels.{sorted(set(t) - {'files'})[0]}", "unknown key in [kernels]; allowed keys: files")
    files = t.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        raise ConfigError("kernels.files", "give a list of paths of kernels TOML files (meshplan bench gemm --grid), "
                                           "relative to this config")
    return tuple(str(Path(f) if Path(f).is_absolute() or base is None else base / f) for f in files)


def _check_deepep_group(spec: MeshSpec, framework: str) -> None:
    """``moe_dispatcher = "deepep"`` on a given mesh: Megatron-LM's flex dispatcher builds its DeepEP
    buffer over the ep x etp ranks (``fused_a2a.get_buffer``, NVIDIA/Megatron-LM d98e8a6), and DeepEP
    has kernel configs for some group sizes only (``Buffer.get_dispatch_config`` asserts ``num_ranks
    in config_map``, deepseek-ai/DeepEP 92fe2de ``deep_ep/buffer.py`` lines 245-259; catalog
    ``deepep.toml`` ``[buffer] group_sizes``): another size fails at its first dispatch; and one rank has
    no group (``MoEFlexTokenDispatcher`` asserts ``TPxEP > 1``, token_dispatcher.py line 1836).
    Framework torch (torchtitan's ``expert_parallel_comm_backend = "deepep"``) dispatches over ep alone and
    refuses ep 1 and etp > 1 (:func:`meshplan.spec.training_checks.torch_deepep_reason`)."""
    deg = dict(zip(spec.names, spec.shape or [])) if spec.names is not None else dict(spec.degrees or {})
    if framework == "torch" and (why := torch_deepep_reason(deg.get("ep", 1), deg.get("etp", 1))):
        raise ConfigError("training.moe_dispatcher", why.removeprefix("deepep: "))
    group = deg.get("ep", 1) * deg.get("etp", 1)
    sizes = catalog.deepep_buffer()["group_sizes"]
    if group == 1:
        raise ConfigError("training.moe_dispatcher", "\"deepep\" needs an ep x etp group of 2 ranks or more "
                          "(Megatron-LM's flex dispatcher asserts TPxEP > 1); give mesh ep > 1 or moe_dispatcher = "
                          "\"alltoall\"")
    if group not in sizes:
        raise ConfigError("training.moe_dispatcher", f"\"deepep\" runs DeepEP over ep {deg.get('ep', 1)} x etp "
                          f"{deg.get('etp', 1)} = {group} ranks, a size DeepEP has no dispatch config for "
                          f"(Buffer.get_dispatch_config: {', '.join(map(str, sizes))}); set mesh ep x etp to one "
                          f"of them or moe_dispatcher = \"alltoall\"")


def _check_routing(model: ModelSpec, training: TrainingSpec) -> None:
    """The MoE routing keys of [training] against the model: only for an MoE model (a key at its
    default, as a dumped TrainingSpec writes it, is no routing choice), and the busiest
    expert's share at least the balanced 1 / experts."""
    keys = [k for k in ("moe_capacity_factor", "moe_dropless", "moe_hottest_expert_share")
            if k in training.model_fields_set and getattr(training, k) != TrainingSpec.model_fields[k].default]
    if keys and not model.is_moe:
        raise ConfigError(f"training.{keys[0]}", f"{model.name} has no experts; remove the MoE routing keys")
    p = training.moe_hottest_expert_share
    if p is not None and p * model.experts < 1 - 1e-9:
        raise ConfigError("training.moe_hottest_expert_share", f"{p} is below the balanced share 1 / experts "
                          f"{model.experts} = {1 / model.experts:.4g}; give a share in [1/experts, 1]")
    if megatron_dispatcher(training):
        _check_dispatcher(model, training)
    if training.moe_dropless and training.moe_capacity_factor is not None:
        raise ConfigError("training.moe_capacity_factor", "dropless routing has no capacity; remove one of "
                          "moe_dropless and moe_capacity_factor")


def _check_dispatcher(model: ModelSpec, training: TrainingSpec) -> None:
    """``moe_dispatcher = "deepep"``: Megatron-LM's flex dispatcher (framework megatron) or torchtitan's
    ``expert_parallel_comm_backend = "deepep"`` (framework torch; the same DeepEP kernels,
    :mod:`meshplan.comm.deepep`), for an MoE model. A capacity factor is planned without the padded buffer (Megatron-LM's TransformerConfig
    refuses ``moe_pad_expert_input_to_capacity`` with the deepep backend, transformer_config.py:1754-1761
    at NVIDIA/Megatron-LM d98e8a6, and passes the router's dropped copies to DeepEP masked:
    :mod:`meshplan.compute.routing`, capacity without padding)."""
    field = "training.moe_dispatcher"
    if not model.is_moe:
        raise ConfigError(field, f"{model.name} has no experts; remove moe_dispatcher")
