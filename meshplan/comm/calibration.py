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
NIC: :func:`~meshplan.comm.calibration_apply.apply_calibration` refuses them for a cluster whose
collectives run on NCCL or RCCL and applies them to a gloo cluster (the CPU testbed's) only.

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
slower of out-of-place and in-place): :func:`~meshplan.comm.calibration_apply.apply_calibration`
puts the class's curve of the fitted op and rank count into the node's ``busbw`` (``nvlink`` or ``nic``), and a calibrated
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
from meshplan.comm.linkfit import LINK_CLASSES, LinkFit
from meshplan.config_toml import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_STRING, MAX_WORLD, bound_message
from meshplan.spec.cluster import BusbwCurve
from meshplan.units import GB, US


class LoggedCurve(BaseModel):
    """One ``[[link.<class>.curve]]`` of a calibration file: a logged nccl-tests run's busbw at
    each size, the keys of a catalog :class:`~meshplan.spec.cluster.BusbwCurve` (and checked as
    one) without its line rate: the run's line rate is not in nccl-tests' output, and the rate a
    calibrated class's curve is read against is its calibrated one
    (:func:`~meshplan.comm.calibration_kinds.read_rate`), which
    :func:`~meshplan.comm.calibration_apply.apply_calibration` gives it (:meth:`read_at`). ``line_gb_per_s`` in a file ``meshplan calibrate`` wrote before 2026-12
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
