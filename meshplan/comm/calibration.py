"""The calibration file: alpha-beta fits per link class (:mod:`meshplan.comm.linkfit`, from
nccl-tests outputs read by :mod:`meshplan.comm.nccl_tests`) written, read, named in the
outputs and applied to a cluster.

Calibration file (TOML, one table per link class ``nvlink``, ``pcie`` or ``nic``)::

    [link.nic]
    latency_us = 20.0            # alpha per call of `op` over `ranks` ranks
    bandwidth_gb_per_s = 40.0    # beta: bus bandwidth per rank (per NIC for "nic")
    op = "all-reduce"
    ranks = 8
    residual = 0.001             # RMS relative residual of the fit
    points = 31
    source = "nccl-tests all_reduce_perf 2026-03-02, 8 nodes x 1 GPU"
    gpu = "NVIDIA H100 80GB HBM3"  # optional: the GPU model the ranks ran on, as nccl-tests names it
    backend = "gloo"             # optional: what measured it when not NCCL (bench comm on a CPU host)
    nics_per_node = 4            # optional, nic: the NICs per node its busbw was split over when
                                 # not one per rank (meshplan calibrate --nics-per-host or --system)

    [[link.nic.curve]]           # optional, one per nccl-tests run: its busbw at every logged size
    op = "all-reduce"            # the keys of a catalog curve (catalog/nccl.toml, BusbwCurve)
    ranks = 8                    # but line_gb_per_s: the rate it is read against is the class's
    nodes = 8                    # calibrated one (calibration_kinds.read_rate), set when applied
    sizes_bytes = [1024, 2048]
    busbw_gb_per_s = [0.05, 0.1]
    source = "nccl-tests 2.17.6 all-reduce over 8 ranks on 8 host(s), file a.txt"
    latency_us = 20.0            # optional: the run's own fitted alpha per call

``gpu`` is what nccl-tests prints for each rank (``cudaDeviceProp.name``,
:func:`meshplan.comm.nccl_tests_run.gpus_of`); files written before it was recorded, or from
output that does not name one, have none and read as "GPU not recorded". What plan, step,
search and compare print about a calibration file (its header line, where each fit came
from, the warnings for another GPU model or a NIC figure above line rate, the note for links
left uncalibrated) is :mod:`meshplan.comm.calibration_notes`'s.

``backend = "gloo"`` (``meshplan bench comm`` without a GPU) says the numbers are torch's gloo
over TCP (loopback inside a host, the testbed's veth links between its nodes), not NVLink or a
NIC: :func:`apply_calibration` refuses them for a cluster whose collectives run on NCCL or RCCL
and applies them to a gloo cluster (the CPU testbed's) only.

``nic`` is per NIC: a run with one GPU per node, each rank's traffic crossing one NIC, or a
run of k GPUs per node whose busbw ``meshplan calibrate --link nic`` split over their k NICs,
or over the N NICs ``nics_per_node`` records (:mod:`meshplan.comm.calibrate_file`); a figure above
the cluster's catalog NIC line rate is warned
(:func:`meshplan.comm.calibration_warnings.nic_rate_warnings`). Applying a
calibration writes the bandwidth, the per-step latency ``latency_us / steps(op, ranks)`` (the
meaning of :class:`LinkSpec.latency_us`) and marks the class ``calibrated``:
:func:`meshplan.comm.nccl_algorithms.collective_time` then times it as
``steps(op', n') * latency_us / steps(op, ranks) + busbw_factor(op', n') * S / beta`` with no
NCCL base latency or protocol choice and no NVLS or tree (the fit holds whatever algorithm
NCCL ran), so the measured op over the measured ranks is predicted at the fit itself
(``latency_us`` per call, never less) and no algorithm beats the fitted bus bandwidth; other
ops and rank counts scale alpha per algorithm step.

``curve`` (``meshplan calibrate`` writes one per file: the logged busbw at every size, the
slower of out-of-place and in-place): :func:`apply_calibration` puts the class's curve of the
fitted op and rank count into the node's ``busbw`` (``nvlink`` or ``nic``), and a calibrated
class is then read on it exactly as a catalog curve (:func:`meshplan.comm.alphabeta.measured_time`)
at every size, so the fitted op over the fitted ranks is predicted at the logged busbw at each
logged size (S15 on A100: the alpha-beta line alone is 12.5% slow at 16 GiB); above the largest
size the curve continues along its last segment, below the smallest it is latency-bound (from
the fit's alpha at S = 0, or held at the smallest logged time where that alpha exceeds it),
continuous at both ends (:func:`meshplan.comm.nccl_algorithms.collective_time`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshplan.comm.alphabeta import OPS, step_latency
from meshplan.comm.calibration_kinds import (NIC_PATTERNS, RING_OPS, nic_curves, nvls_kept, own_runs, pattern_of, read_rate,
                                             scaled_curve)
from meshplan.comm.linkfit import LINK_CLASSES, LinkFit
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_STRING, MAX_WORLD, bound_message
from meshplan.spec.cluster import BusbwCurve, ClusterSpec
from meshplan.units import GB, US


class LoggedCurve(BaseModel):
    """One ``[[link.<class>.curve]]`` of a calibration file: a logged nccl-tests run's busbw at
    each size, the keys of a catalog :class:`~meshplan.spec.cluster.BusbwCurve` (and checked as
    one) without its line rate: the run's line rate is not in nccl-tests' output, and the rate a
    calibrated class's curve is read against is its calibrated one
    (:func:`~meshplan.comm.calibration_kinds.read_rate`), which :func:`apply_calibration` gives
    it (:meth:`read_at`). ``line_gb_per_s`` in a file ``meshplan calibrate`` wrote before 2026-12
    (the fit's busbw, not a line rate) is read and ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    op: str = Field(default="all-reduce", max_length=64)
    ranks: int
    nodes: int = 1
    sizes_bytes: list[int]
    busbw_gb_per_s: list[float]
    source: str = Field(max_length=MAX_STRING)
    line_gb_per_s: Optional[float] = Field(default=None, exclude=True)  # older files: ignored
    latency_us: Optional[float] = Field(default=None, ge=0, le=BOUNDS["latency_us"].value)  # the run's own alpha

    @model_validator(mode="before")
    @classmethod
    def _from_curve(cls, data: Any) -> Any:
        """A :class:`BusbwCurve` given in code (``meshplan calibrate``'s own) as its logged keys."""
        return data.model_dump(include=set(cls.model_fields) - {"line_gb_per_s"}) \
            if isinstance(data, BusbwCurve) else data

    @model_validator(mode="after")
    def _check(self):
        self.read_at(1.0)  # BusbwCurve's checks: sizes increasing, busbw in bounds, one per size
        return self

    def read_at(self, line_gb_per_s: float, calibrated: bool = False) -> BusbwCurve:
        """This curve as a :class:`BusbwCurve` read against ``line_gb_per_s``; a ValueError with
        BusbwCurve's first complaint where the keys are not a curve."""
        try:
            return BusbwCurve.model_validate({**self.model_dump(), "line_gb_per_s": line_gb_per_s,
                                              "calibrated": calibrated})
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ValueError(f"{where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}") from None


class CalibratedLink(BaseModel):
    """One ``[link.<class>]`` table of a calibration file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    latency_us: float = Field(ge=0, le=BOUNDS["latency_us"].value)
    bandwidth_gb_per_s: float = Field(gt=0, le=BOUNDS["bandwidth_gb_per_s"].value)
    op: Optional[str] = Field(default=None, max_length=64)
    ranks: Optional[int] = Field(default=None, ge=2, le=MAX_WORLD)
    residual: Optional[float] = Field(default=None, ge=0)
    points: Optional[int] = Field(default=None, ge=0, le=1 << 30)
    source: str = Field(max_length=MAX_STRING)
    gpu: Optional[str] = Field(default=None, min_length=1, max_length=128)
    backend: Optional[Literal["nccl", "rccl", "gloo"]] = None
    curve: list[LoggedCurve] = Field(default_factory=list, max_length=256)
    nics_per_node: Optional[int] = Field(default=None, ge=1, le=MAX_WORLD)

    def fitted_curve(self) -> Optional[LoggedCurve]:
        """The first ``curve`` of the fitted ``op`` over the fitted ``ranks`` (the run the fit
        came from), None when there is none."""
        return next((c for c in self.curve if c.op == self.op and c.ranks == self.ranks), None)

    def split_nics(self, curve: Optional[LoggedCurve | BusbwCurve]) -> int:
        """The NICs per node a ``nic`` fit's busbw was split over: ``nics_per_node`` when
        given, else one per rank of ``curve``'s run (ranks / nodes; 1 without a curve)."""
        return self.nics_per_node or (curve.ranks // curve.nodes if curve is not None else 1)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gb_per_s * GB

    @property
    def step_latency_us(self) -> float:
        """Per-step latency: ``latency_us / steps(op, ranks)``; the per-call figure when
        ``op`` or ``ranks`` is not given."""
        if self.op is None or self.ranks is None:
            return self.latency_us
        return step_latency(self.latency_us, self.op, self.ranks)


#: What a gloo measurement of each link class ran over (``meshplan bench comm`` without a GPU).
GLOO_MEDIUM = {"nvlink": "loopback TCP inside one host", "pcie": "loopback TCP inside one host",
               "nic": "TCP over the testbed's veth links"}


def measured_over(link: str, backend: Optional[str]) -> str:
    """``link`` as measured: ``nvlink (gloo: loopback TCP inside one host, not NVLink)`` for a
    gloo run, ``link`` itself for NCCL (nccl-tests, or bench comm on GPUs)."""
    if backend != "gloo":
        return link
    hardware = {"nvlink": "NVLink", "pcie": "PCIe", "nic": "an RDMA NIC"}.get(link, link)
    return f"{link} (gloo: {GLOO_MEDIUM.get(link, 'TCP')}, not {hardware})"


def calibration_toml(fits: list[LinkFit], source: str | Mapping[str, str], backend: Optional[str] = None,
                     curves: Optional[Mapping[str, list[BusbwCurve]]] = None,
                     nics_per_node: Optional[Mapping[str, int]] = None) -> str:
    """The calibration file for ``fits`` (one table per link class), ``source`` naming the
    measurement (tool, date, machines), one for all or per link class (``meshplan calibrate``:
    each class's own file), and each fit's GPU model when known; ``backend`` "gloo" when gloo
    measured it (written, and said in a comment: such a file calibrates only a gloo cluster);
    ``curves``: per link class the measured busbw curves, each a ``[[link.<class>.curve]]``;
    ``nics_per_node``: per link class the NICs per node a split busbw was divided by, where
    not one per rank (``meshplan calibrate --nics-per-host``)."""
    out = ["# meshplan calibration: alpha-beta per link class fitted from nccl-tests (meshplan.comm.calibration)"]
    if backend == "gloo" or any(f.backend == "gloo" for f in fits):
        out.append("# measured with gloo over TCP, no GPU: not NVLink or NIC figures; --calibration takes it only "
                   "for a gloo cluster (the CPU testbed)")
    nics = dict(nics_per_node or {})
    for f in fits:
        out += [f"\n[link.{f.link}]", f"latency_us = {f.latency_s / US:.4g}",
                f"bandwidth_gb_per_s = {f.bandwidth_bytes_per_s / GB:.4g}", f'op = "{f.op}"',
                f"ranks = {f.n_ranks}", f"residual = {f.rms_residual:.3g}", f"points = {f.points}",
                f"source = {json.dumps(source if isinstance(source, str) else source[f.link])}"]
        out += [f"gpu = {json.dumps(f.gpu)}"] if f.gpu else []
        out += [f'backend = "{f.backend or backend}"'] if f.backend or backend else []
        out += [f"nics_per_node = {nics[f.link]}"] if f.link in nics else []
        for c in (curves or {}).get(f.link, []):
            out += [f"\n[[link.{f.link}.curve]]", f'op = "{c.op}"', f"ranks = {c.ranks}", f"nodes = {c.nodes}",
                    f"sizes_bytes = {c.sizes_bytes}",
                    "busbw_gb_per_s = [" + ", ".join(f"{b:.6g}" for b in c.busbw_gb_per_s) + "]",
                    f"source = {json.dumps(c.source)}"]
            out += [f"latency_us = {c.latency_us:.4g}"] if c.latency_us is not None else []
    return "\n".join(out) + "\n"


def load_calibration(path) -> dict[str, CalibratedLink]:
    """Read a calibration file: ``{link class: CalibratedLink}``. Unknown link classes,
    unknown keys and bad values are ConfigErrors naming ``--calibration: file: link.<class>.<key>``
    (a file that is not TOML: ``--calibration: file: not valid TOML``)."""
    p = Path(path)
    text = read_text_limited(p, "--calibration", FILE_BYTES["calibration"],
                             "give the calibration TOML that bench comm or calibrate wrote")
    where = f"--calibration: {p.name}"  # the option and the file, each named once
    doc = parse_toml(text, p.name, "--calibration")
    extra = sorted(set(doc) - {"link"})
    if extra or not isinstance(doc.get("link"), dict):
        raise ConfigError(where, f"expected only [link.<class>] tables (got {extra or 'no [link]'}); "
                                 f"use classes {', '.join(LINK_CLASSES)}")
    out = {}
    for name, table in doc["link"].items():
        if name not in LINK_CLASSES:
            raise ConfigError(f"{where}: link.{name}", f"unknown link class; use one of {', '.join(LINK_CLASSES)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: link.{name}", "must be a table [link.<class>] with latency_us, "
                                                      "bandwidth_gb_per_s and source; see meshplan.comm.calibration")
        try:
            out[name] = CalibratedLink(**table)
        except ValidationError as err:
            first = err.errors()[0]
            key = ".".join(str(x) for x in first["loc"])
            why = bound_message(first) or first["msg"]
            raise ConfigError(f"{where}: link.{name}.{key}", f"{why}; see meshplan.comm.calibration") from None
    for name, c in out.items():
        if c.op is not None and c.op not in OPS:
            raise ConfigError(f"{where}: link.{name}.op", f"unknown op '{c.op}'; use one of {', '.join(OPS)}")
    return out


def load_calibrations(paths) -> dict[str, CalibratedLink]:
    """Several ``--calibration`` files as one (a path alone: :func:`load_calibration`): each
    link class from the file that has it, the common case a 1-node file (``nvlink``) beside a
    2-node one (``nic``); a class in two files is a ConfigError naming both (which of two fits
    of one link stands is the user's to choose: ``meshplan calibrate`` keeps one per class), a file
    given twice one naming it."""
    if isinstance(paths, (str, Path)):
        return load_calibration(paths)
    out: dict[str, CalibratedLink] = {}
    came: dict[str, str] = {}
    seen: set = set()
    for p in paths:
        if Path(p).resolve() in seen:  # (its classes would read as set by both of it and itself)
            raise ConfigError("--calibration", f"{p} given twice; give each file once")
        seen.add(Path(p).resolve())
        for name, c in load_calibration(p).items():
            if name in out:
                raise ConfigError(f"--calibration: link.{name}", f"set by both {came[name]} and {Path(p).name}; give "
                                  "each link class in one file only (drop the table from one, or calibrate its logs "
                                  "together)")
            out[name], came[name] = c, Path(p).name
    return out


def apply_calibration(cluster: ClusterSpec, calib: dict[str, CalibratedLink]) -> ClusterSpec:
    """A new cluster whose link figures come from ``calib``: ``nvlink`` -> the node's fabric,
    ``pcie`` -> its PCIe link (bandwidth, per-step latency); ``nic`` -> every NIC's rate
    (GB/s x 8 = Gb/s) and every network tier's per-step latency. The calibrated link classes
    lose the catalog's measured busbw curves (``nvlink`` the "nvlink" and "nvls" curves, ``nic``
    the "nic" curve): the user's own fit replaces them, and the user's own curve of the fitted
    run (:meth:`CalibratedLink.fitted_curve`, marked ``calibrated``) becomes the "nvlink" or
    "nic" curve. The NIC patterns the fitted run did not measure, the send/recv pair "p2p" and
    the one-rank-per-node all-reduce "nic1", are never replaced by it: a run of their own
    pattern in the file sets them, else the catalog's curve is kept, scaled by the measured over
    the catalog busbw of the fitted run's pattern (:mod:`meshplan.comm.calibration_kinds`). A gloo
    measurement (``backend = "gloo"``) on a cluster whose library is not gloo is a ConfigError naming the table. Each calibrated class is marked ``calibrated`` (timed on
    the fit alone: module docstring). Other fields are kept.

    Per op (:func:`~meshplan.comm.calibration_kinds.sets_ops`): a ``nic`` table with logged curves
    whose fit is not a ring op's (an alltoall_perf or sendrecv_perf run alone) leaves the NIC rate,
    the network latency and the catalog's ring curves as they are and sets only its own ops
    (:func:`op_curves`); beside a ring fit, all-to-all reads the file's all-to-all curve, else the
    catalog's. A ``nic`` table without curves (a file of before them) is applied as before: its
    fit sets every op. An ``nvlink`` or ``pcie`` table's logged runs of ops other than its fit's set
    those ops, each on its own curve at its own fitted alpha (:func:`_own_op_curves`)."""
    _refuse_gloo(cluster, calib)
    node = cluster.node
    per_op = {k: v for k, v in calib.items() if k == "nic" and v.curve}  # new files: each op from its own run
    calib = {k: v for k, v in calib.items() if k not in per_op or v.op in RING_OPS}  # what sets rate and latency
    upd: dict[str, Any] = {"busbw": _calibrated_curves(node, calib, per_op)}
    for name, field in (("nvlink", "fabric"), ("pcie", "pcie")):
        if name in calib:
            c = calib[name]
            upd[field] = getattr(node, field).model_copy(update={
                "bandwidth_gb_per_s": c.bandwidth_gb_per_s, "latency_us": c.step_latency_us,
                "calibrated": True, "source": f"calibrated: {c.source}"})
    network = cluster.network
    if "nic" in calib:
        c = calib["nic"]
        if not node.nics:
            raise ConfigError("--calibration: link.nic", f"node {node.name} has no NIC; drop [link.nic] or add NICs")
        upd["nics"] = [n.model_copy(update={"rate_gbit_per_s": c.bandwidth_gb_per_s * 8}) for n in node.nics]
        network = [t.model_copy(update={"latency_us": c.step_latency_us, "calibrated": True})
                   for t in cluster.network]
    sources = "; ".join(f"{k}: {v.source}" for k, v in {**per_op, **calib}.items())
    return cluster.model_copy(update={"node": node.model_copy(update=upd), "network": network,
                                      "source": f"{cluster.source} (calibrated: {sources})".strip()})


def _refuse_gloo(cluster: ClusterSpec, calib: dict[str, CalibratedLink]) -> None:
    """ConfigError for a link class measured with gloo (``backend = "gloo"``) on a cluster whose
    collective library is not gloo, naming the table."""
    for name, c in calib.items():
        if c.backend == "gloo" and cluster.collective_library != "gloo":
            raise ConfigError(f"--calibration: link.{name}", f"measured with gloo ({GLOO_MEDIUM.get(name, 'TCP')}, "
                              f"{c.bandwidth_gb_per_s:g} GB/s), not with {cluster.collective_library} on the "
                              f"{cluster.name} {name}; calibrate the GPUs (nccl-tests + meshplan calibrate, or bench "
                              "comm on a GPU host) or plan a gloo cluster")


def _calibrated_curves(node, calib: dict[str, CalibratedLink], per_op: dict[str, CalibratedLink]) -> dict[str, BusbwCurve]:
    """The node's busbw curves after :func:`apply_calibration`: the calibrated classes' catalog
    curves dropped ("nvlink" and "nvls" for nvlink; "nic", "p2p" and "nic1" for nic); a ``per_op``
    nic table's own ops (:func:`op_curves`); each class's fitted run's curve read against its
    calibrated rate, its other ops' own curves and NVLS ring curves; the NIC patterns the fit did
    not measure (:mod:`meshplan.comm.calibration_kinds`)."""
    dropped = {"nvlink": ("nvlink", "nvls"), "nic": ("nic", "p2p", "nic1")}
    gone = {c for name in calib for c in dropped.get(name, ())}
    busbw = {k: v for k, v in node.busbw.items() if k not in gone}
    if "nic" in per_op and node.nics:  # all-to-all (and send/recv) from the file's own runs of them
        busbw.update(op_curves(per_op["nic"], node, "nic" in calib))
    for name, c in calib.items():  # read against the class's calibrated rate (the fit's beta)
        curve = c.fitted_curve() if name in dropped else None
        if curve is not None:  # a nic curve of k ranks per node ran on k (or nics_per_node) NICs of a node
            line = read_rate(c.bandwidth_gb_per_s, c.split_nics(curve), curve.op, curve.ranks, curve.nodes, name)
            busbw[name] = curve.read_at(line, calibrated=True)
        busbw.update(_own_op_curves(name, c, node))
        busbw.update(_nvls_ring_curves(name, c, node))
    if "nic" in calib and node.nics:  # the NIC patterns the fit did not measure (calibration_kinds)
        busbw.update(_other_nic_curves(calib["nic"], busbw.get("nic"), node))
    return busbw


def op_curves(c: CalibratedLink, node, ring: bool) -> dict[str, BusbwCurve]:
    """The ``nic`` table ``c``'s curves of the ops it sets beside the ring fit (``ring``: its fit
    is of a ring op and sets the NIC rate, else the NIC rate stays ``node``'s catalog one):
    "a2a" from its all-to-all run over more than 2 ranks, read against the NIC rate as applied
    (:func:`~meshplan.comm.calibration_kinds.read_rate`); without one, beside a ring fit, the
    catalog's "nic" curve kept for all-to-all at the catalog NIC rate; and, without a ring fit,
    "p2p" from its send/recv pair run (with a ring fit :func:`_other_nic_curves` sets it)."""
    catalog_gb = node.nics[0].rate_gbit_per_s / 8
    rate = c.bandwidth_gb_per_s if ring else catalog_gb
    out: dict[str, BusbwCurve] = {}
    for x in c.curve:
        key = {"nic": "a2a" if x.op == "all-to-all" else None, "p2p": None if ring else "p2p"}.get(
            pattern_of(x.op, x.ranks, x.nodes))
        if key is not None and key not in out:
            out[key] = x.read_at(read_rate(rate, c.split_nics(x), x.op, x.ranks, x.nodes), calibrated=True)
    if ring and "a2a" not in out and "nic" in node.busbw:
        out["a2a"] = scaled_curve(node.busbw["nic"], 1.0, rate, catalog_gb, "all-to-all: no alltoall_perf run in "
                                  "the file, the catalog's curve at its NIC rate")
    return out


def _own_op_curves(name: str, c: CalibratedLink, node) -> dict[str, BusbwCurve]:
    """``"<class> <op>"``: an ``nvlink`` or ``pcie`` table ``c``'s runs of the ops other than its
    fit's (:func:`~meshplan.comm.calibration_kinds.own_runs`), each read against the class's
    calibrated rate (the fit's beta: the logged busbw at the path's full rate) and at its own fitted
    alpha; PCIe's only on a node without NICs, the one where a path runs on PCIe
    (:func:`meshplan.comm.row.groups_path`)."""
    if name == "pcie" and node.nics:
        return {}
    return {f"{name} {op}": x.read_at(read_rate(c.bandwidth_gb_per_s, 1, x.op, x.ranks, x.nodes, name), calibrated=True)
            for op, x in own_runs(name, c.op, c.curve).items()}


def _nvls_ring_curves(name: str, c: CalibratedLink, node) -> dict[str, BusbwCurve]:
    """``"nvlink all-gather"`` and ``"nvlink reduce-scatter"`` on a node whose all-reduce runs on
    NVLS (``fabric.nvls``) when ``c`` is an ``nvlink`` all-reduce fit without runs of those ops
    (:func:`~meshplan.comm.calibration_kinds.nvls_kept`): the catalog's ring curve ("nvlink"),
    scaled so that at the calibrated rate it reads the catalog's busbw (``scaled_curve`` at r 1:
    line x fit / catalog rate). Newcomer nc33: an 8 x H100 all_reduce_perf fit (468.84 GB/s, on
    NVLS) timed tp's 64 MiB all-gather at 434.7 GB/s busbw instead of the ring's 325.7. A fit at or below
    the catalog ring's busbw at its largest size holds no NVLS gain and still sets them, so a measured
    fabric slower than the catalog's never reads the catalog's ring."""
    kept = nvls_kept(name, c.op, c.curve)
    if not kept or not getattr(node.fabric, "nvls", False) or "nvlink" not in node.busbw:
        return {}
    if node.busbw["nvlink"].busbw_gb_per_s[-1] >= c.bandwidth_gb_per_s:  # a fit no faster than the ring is no
        return {}  # NVLS gain: it stands for the ring ops (a measured fabric slower than the catalog's stays slower)
    ring = scaled_curve(node.busbw["nvlink"], 1.0, c.bandwidth_gb_per_s, node.fabric.bandwidth_gb_per_s,
                        "an all-reduce fit on NVLS does not time the ring's all-gather and reduce-scatter")
    return {f"nvlink {op}": ring for op in kept}


def _other_nic_curves(c: CalibratedLink, own: Optional[BusbwCurve], node) -> dict[str, BusbwCurve]:
    """:func:`~meshplan.comm.calibration_kinds.nic_curves` of the ``nic`` table ``c`` whose
    applied own curve is ``own``, against ``node``'s catalog NIC curves and NIC rate."""
    fitted = c.fitted_curve()
    others = [x.read_at(read_rate(c.bandwidth_gb_per_s, c.split_nics(x), x.op, x.ranks, x.nodes))
              for x in c.curve if x is not fitted]  # read as catalog curves: the fit is not theirs
    catalog_nic = {k: node.busbw[k] for k in NIC_PATTERNS if k in node.busbw}
    return nic_curves(own, others, c.bandwidth_gb_per_s, catalog_nic, node.nics[0].rate_gbit_per_s / 8)
