"""A config to a plan, for every command that resolves a mesh: :func:`_load` (a meshplan TOML,
or a foreign config with the options that fill what it does not say; malformed input a
ConfigError, exit 2), the measured cluster (``--topology``, ``--calibration``, ``--kernels`` and
a config's ``[kernels] files``) and the calibration's header line and JSON entry (plan, step,
search, compare), the kernels' line and entry (:func:`_kernels`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence, Union

import typer

from meshplan.cli.common import _echo
from meshplan.cli.schedule_opt import renamed, scheduled
from meshplan.comm.calibrate_nics import config_nic_warning
from meshplan.comm.calibration import load_calibrations
from meshplan.comm.calibration_apply import apply_calibration
from meshplan.comm.calibration_notes import calibration_doc
from meshplan.compute.kernel_fragment import kernels_line, with_kernel_files
from meshplan.compute.rate_check import kernel_file_rates
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.file_words import file_error
from meshplan.interop.foreign import load_any
from meshplan.interop.world_words import foreign_world_error
from meshplan.mesh.resolve import world_error
from meshplan.mesh.validity import input_error, unresolved_reasons
from meshplan.placement.nccl_env import unread_leaf_oversubscription
from meshplan.placement.node_check import node_warnings
from meshplan.placement.topology import load_topology
from meshplan.placement.topology_node import check_identity_nic_map, node_from_topology, topology_notes
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.plan_fix_rules import mesh_checker

#: ``--calibration``: one file, or several (:func:`~meshplan.comm.calibration.load_calibrations`).
Calibrations = Union[Path, Sequence[Path]]


def _load(config: Path, topology: Optional[Path] = None, calibration: Optional[Calibrations] = None,
          fmt: Optional[str] = None, opts: Optional[ImportOptions] = None,
          unresolved: bool = False, kernels: Optional[list[Path]] = None,
          schedule: Optional[str] = None, quiet: bool = False) -> Plan | Infeasible:
    """Plan of ``config`` (a meshplan TOML, or with ``opts`` given a foreign config, ``fmt``
    or detected, ``opts`` filling what it does not say); ``topology`` (nvidia-smi topo -m text
    or NCCL topology XML) replaces the node's sockets and NIC affinity, ``calibration``
    (meshplan calibration TOML) the link bandwidths and latencies, ``kernels`` (and the
    config's [kernels] files) the GPU's kernel data. Malformed input is a
    ConfigError (exit 2, one line): degrees that cannot make the world
    (:func:`~meshplan.mesh.resolve.world_error`, each fix checked by the plan's rules, a foreign file's in its format's keys:
    :func:`~meshplan.interop.world_words.foreign_world_error`, and every other error of a foreign file too:
    :func:`~meshplan.interop.file_words.file_error`; with ``unresolved``, as ``compare`` plans two
    configs, such a plan is returned, infeasible) and counts that disagree
    (:func:`~meshplan.mesh.validity.input_error`). ``schedule`` (``step --schedule``) replaces
    the config's ``mesh.pp_schedule`` before the plan's rules (:mod:`meshplan.cli.schedule_opt`;
    its refusals name ``--schedule``). ``quiet``: the topology's notes not printed (``compare``'s
    second config: the first printed them)."""

    read = load_any(config, fmt, opts or ImportOptions(), foreign=opts is not None)
    cfg = scheduled(read, schedule)
    _notes(cfg)
    nic_unit = config_nic_warning(cfg.cluster)  # [cluster] nic far below the catalog node's NICs (nc54 #5)
    if nic_unit:
        _echo(nic_unit, err=True)
    leaf_over = unread_leaf_oversubscription(cfg.cluster)  # a 2:1 leaf written on the leaf (nc61 #2)
    if leaf_over:
        _echo(leaf_over, err=True)
    for line in node_warnings(cfg.cluster.node):  # NICs against GPUs and sockets as written (nc61 #4)
        _echo(line, err=True)
    try:
        plan = build_plan(_measured_cluster(cfg, topology, calibration, kernels, quiet))
    except ConfigError as e:
        raise file_error(cfg, e if cfg is read else renamed(e, str(schedule))) from None
    if isinstance(plan, Infeasible) and cfg.mesh is not None:  # malformed, not infeasible: exit 2
        bad = input_error(cfg.model, cfg.training, plan.mesh, cfg.mesh) if plan.mesh is not None else \
            None if unresolved or unresolved_reasons(cfg.model, cfg.training, cfg.mesh) else checked_world_error(cfg)
        if bad is not None:  # a foreign file's in its own keys (the world's by its own words)
            world = foreign_world_error(cfg, bad)
            raise file_error(cfg, bad) if world is bad else world
    return plan


def checked_world_error(cfg) -> Optional[ConfigError]:
    """:func:`~meshplan.mesh.resolve.world_error` of ``cfg``'s mesh with each fix checked by the
    plan's rules (:func:`~meshplan.plan_fix_rules.mesh_checker`), None where its degrees make the
    world; the one refusal of degrees that cannot make it, for ``plan`` (:func:`_load`) and
    ``export`` alike (``export`` was told a ``cluster.nodes`` fix the rules refuse, nc55 #2)."""
    if cfg.mesh is None:
        return None
    return world_error(cfg.mesh, cfg.cluster.world, cfg.cluster.node.gpus, mesh_checker(cfg), cfg.filled_axes)


def _measured_cluster(cfg, topology: Optional[Path] = None, calibration: Optional[Calibrations] = None,
                      kernels: Optional[list[Path]] = None, quiet: bool = False):
    """``cfg`` with its cluster's node replaced by ``topology`` (nvidia-smi topo -m text or
    NCCL topology XML), its links by ``calibration`` (:func:`apply_calibration`) and its GPU's
    kernel data laid over by the config's [kernels] files, then ``kernels`` (``--kernels``,
    :func:`~meshplan.compute.kernel_fragment.with_kernel_files`; a warning line for a file
    measured on the CPU; its GEMM rates checked, :func:`~meshplan.compute.rate_check.kernel_file_rates`); ``cfg`` itself when none is given. The one place plan, report, step,
    reliability, compare and search apply them."""
    if not (topology or calibration or kernels or cfg.kernel_files):
        return cfg
    cluster = cfg.cluster
    for paths, field in ((cfg.kernel_files, "kernels.files"), (kernels or [], "--kernels")):
        gpu, warns = with_kernel_files(cluster.gpu, paths, field)
        for w in warns + kernel_file_rates(gpu, gpu.kernels[len(cluster.gpu.kernels):], field):  # these files
            _echo(f"warning: {w}", err=True)
        cluster = cluster.model_copy(update={"gpu": gpu})
    if topology:
        cluster = cluster.model_copy(update={"node": topology_node(topology, cluster.node, cluster.gpu, quiet)})
    if calibration:
        cluster = apply_calibration(cluster, load_calibrations(calibration))
    return replace(cfg, cluster=cluster)


def topology_node(topology: Path, base, gpu=None, quiet: bool = False):
    """The node ``--topology`` gives over ``base`` for ``gpu`` (:func:`node_from_topology`), printing its
    notes (:func:`topology_notes`) and, in one line, where the index map GPU k -> NIC k lands
    on a farther NIC (:func:`check_identity_nic_map`: the count and the first GPU). The one
    place a command reads a topology; ``quiet``: nothing printed."""
    topo = load_topology(topology)
    node = node_from_topology(topo, base, gpu=gpu)
    if quiet:
        return node
    for n in topology_notes(topo, base, node, gpu=gpu):
        _echo(f"note: {n}", err=True)
    ident = check_identity_nic_map(node)
    if ident:
        _echo(f"warning: the index map GPU k -> NIC k (local_rank % {len(node.nics)}) gives a farther NIC than the "
              f"topology for {len(ident)} of {node.gpus} GPUs ({ident[0]}); the bindings use the topology's",
              err=True)
    return node


def _calibration(calibration: Optional[Calibrations], cluster) -> Optional[dict]:
    """``--calibration``'s entry of the --json documents, its ``line`` the header plan, step,
    search and compare print (:func:`calibration_doc`: ``links calibrated from cal.toml on
    NVIDIA H100 80GB HBM3: nvlink 450 GB/s, nic 45 GB/s``), and print that line, where each fit came
    from (``origin``: ``  nic fitted to all-reduce over 16 ranks on 2 nodes, ...``) and a
    ``warning:`` line per GPU model of the file that is not ``cluster``'s
    (:func:`~meshplan.comm.calibration_warnings.gpu_warnings`), then per link class the catalog
    figure its fit replaced (``replaced``: ``  nic all-reduce busbw 45.00 GB/s per NIC calibrated fit
    (logged 44.97 at 8.00 GiB), catalog 47.00 (...)``,
    :func:`~meshplan.comm.calibration_replaced.replaced_lines`); None without a calibration."""
    if not calibration:
        return None
    shown = calibration if isinstance(calibration, (str, Path)) else " + ".join(str(p) for p in calibration)
    doc = calibration_doc(shown, load_calibrations(calibration), cluster)
    _echo(doc["line"])
    for o in doc["origin"]:
        _echo(o)
    for w in doc["warnings"]:
        _echo(f"warning: {w}")
    for r in doc["replaced"]:
        _echo(r)
    return doc


def _cal_note(cal: Optional[dict], kernels: str = "") -> str:
    """The HTML pages' header note of ``--calibration``: its line, then its GPU warnings; then
    the ``kernels`` line (:func:`_kernels_note`) when given."""
    parts = [cal["line"], *(o.strip() for o in cal["origin"]), *(f"warning: {w}" for w in cal["warnings"]),
             *(r.strip() for r in cal["replaced"])] if cal else []
    return "; ".join(parts + ([kernels] if kernels else []))


def _calibrated(doc: dict, cal: Optional[dict]) -> dict:
    """``doc`` with its ``calibration`` entry when a calibration was given."""
    return {**doc, "calibration": cal} if cal else doc


def _notes(cfg) -> None:
    """The reader's notes (an axis alias renamed, a foreign file's unused fields) on stderr."""
    for n in cfg.notes:
        typer.echo(f"note: {n}", err=True)


def _kernels(cluster, shapes: Optional[dict[str, int]] = None) -> dict:
    """The kernels' entry of the --json documents: ``line`` (``kernels: catalog``, or
    ``kernels: FILE (source line; bf16: N points ...)``, with ``shapes`` the plan's GEMM shapes
    per dtype, :func:`~meshplan.compute.kernel_fragment.kernels_line`) and ``files`` (path, source)."""
    return {"line": kernels_line(cluster.gpu, shapes),
            "files": [{"path": f.path, "source": f.source} for f in cluster.gpu.kernels]}


def _kernels_note(cluster) -> str:
    """Print and return the kernels' line when the run lays measured files over the catalog
    (plan, report, reliability, compare, search; step always prints it); "" with the catalog alone."""
    if not cluster.gpu.kernels:
        return ""
    line = kernels_line(cluster.gpu)
    _echo(line)
    return line
