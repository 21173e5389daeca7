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
    ranks = 8
    nodes = 8
    line_gb_per_s = 40.0         # the rate the curve is read against: the class's bandwidth_gb_per_s,
                                 # x ranks / nodes for nic (a node's NICs, one per rank),
                                 # x nics_per_node where the file gives it
    sizes_bytes = [1024, 2048]
    busbw_gb_per_s = [0.05, 0.1]
    source = "nccl-tests 2.17.6 all-reduce over 8 ranks on 8 host(s), file a.txt"

``gpu`` is what nccl-tests prints for each rank (``cudaDeviceProp.name``,
:func:`meshplan.comm.nccl_tests.gpus_of`); files written before it was recorded, or from
output that does not name one, have none and read as "GPU not recorded". A link's NVLink
generation, NICs and their PCIe path come with the GPU model, so a fit measured on one model
describes another's links only by accident: :func:`gpu_warnings` names each calibrated class
whose model is not the cluster's catalog GPU (compared by model name, :func:`same_gpu`), and
plan, step, search and compare print those lines (text and ``--json``) under
:func:`calibration_line`. They warn rather than refuse: the fit is still a measurement, a
what-if on other links is a fair question, and the name match is by model family only.

``backend = "gloo"`` (``meshplan bench comm`` without a GPU) says the numbers are torch's gloo
over TCP (loopback inside a host, the testbed's veth links between its nodes), not NVLink or a
NIC: :func:`apply_calibration` refuses them for a cluster whose collectives run on NCCL or RCCL
and applies them to a gloo cluster (the CPU testbed's) only.

``nic`` is per NIC: a run with one GPU per node, each rank's traffic crossing one NIC, or a
run of k GPUs per node whose busbw ``meshplan calibrate --link nic`` split over their k NICs,
or over the N NICs ``nics_per_node`` records (:mod:`meshplan.comm.calibrate`); a figure above
the cluster's catalog NIC line rate is warned (:func:`nic_rate_warnings`). Applying a
calibration writes the bandwidth, the per-step latency ``latency_us / steps(op, ranks)`` (the
meaning of :class:`LinkSpec.latency_us`) and marks the class ``calibrated``:
:func:`meshplan.comm.alphabeta.collective_time` then times it as
``steps(op', n') * latency_us / steps(op, ranks) + busbw_factor(op', n') * S / beta`` with no
NCCL base latency or protocol choice and no NVLS or tree (the fit holds whatever algorithm
NCCL ran), so the measured op over the measured ranks is predicted at the fit itself
(``latency_us`` per call, never less) and no algorithm beats the fitted bus bandwidth; other
ops and rank counts scale alpha per algorithm step.

``curve`` (``meshplan calibrate`` writes one per file: the logged busbw at every size, the
slower of out-of-place and in-place): :func:`apply_calibration` puts the class's curve of the
fitted op and rank count into the node's ``busbw`` (``nvlink`` or ``nic``), and a calibrated
class is then read on it exactly as a catalog curve (:func:`meshplan.comm.alphabeta.measured_time`)
between its smallest and largest size, so the fitted op over the fitted ranks is predicted at
the logged busbw at each logged size (S15 on A100: the alpha-beta line alone is 12.5% slow at
16 GiB); outside the logged sizes the alpha-beta fit times it
(:func:`meshplan.comm.alphabeta.collective_time`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshplan import catalog
from meshplan.comm.alphabeta import OPS, steps
from meshplan.comm.linkfit import LINK_CLASSES, LinkFit
from meshplan.config import parse_toml
from meshplan.errors import ConfigError
from meshplan.fileread import read_text_limited
from meshplan.limits import BOUNDS, FILE_BYTES, MAX_STRING, MAX_WORLD, bound_message
from meshplan.spec.cluster import BusbwCurve, ClusterSpec
from meshplan.units import GB, US, human_bytes


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
    curve: list[BusbwCurve] = Field(default_factory=list, max_length=256)
    nics_per_node: Optional[int] = Field(default=None, ge=1, le=MAX_WORLD)

    def fitted_curve(self) -> Optional[BusbwCurve]:
        """The first ``curve`` of the fitted ``op`` over the fitted ``ranks`` (the run the fit
        came from), None when there is none."""
        return next((c for c in self.curve if c.op == self.op and c.ranks == self.ranks), None)

    def split_nics(self, curve: Optional[BusbwCurve]) -> int:
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
        return self.latency_us / max(steps(self.op, self.ranks), 1)


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
                    f"line_gb_per_s = {c.line_gb_per_s:.4g}", f"sizes_bytes = {c.sizes_bytes}",
                    "busbw_gb_per_s = [" + ", ".join(f"{b:.6g}" for b in c.busbw_gb_per_s) + "]",
                    f"source = {json.dumps(c.source)}"]
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


def measured_on(c: CalibratedLink) -> str:
    """What ``c`` was measured on, as the outputs say it: its GPU model, ``gloo, no GPU``, or
    ``GPU not recorded`` (a file from before the model was recorded, or output without one)."""
    return c.gpu or ("gloo, no GPU" if c.backend == "gloo" else "GPU not recorded")


def calibration_line(path, calib: dict[str, CalibratedLink]) -> str:
    """The header line plan, step, search and compare print when ``--calibration`` changed
    their numbers: the file as given, what it was measured on (:func:`measured_on`: once when
    all link classes say the same, else per class) and each calibrated link class's bandwidth,
    in the file's order.

    >>> calibration_line("cal.toml", {"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=450, source="a"),
    ...                               "nic": CalibratedLink(latency_us=20, bandwidth_gb_per_s=45.25, source="b")})
    'links calibrated from cal.toml (GPU not recorded): nvlink 450 GB/s, nic 45.25 GB/s'
    >>> calibration_line("h.toml", {"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=440, source="a",
    ...                                                      gpu="NVIDIA H200"),
    ...                             "nic": CalibratedLink(latency_us=20, bandwidth_gb_per_s=45, source="b")})
    'links calibrated from h.toml: nvlink 440 GB/s on NVIDIA H200, nic 45 GB/s (GPU not recorded)'
    """
    def on(c: CalibratedLink) -> str:
        return f" on {c.gpu}" if c.gpu else f" ({measured_on(c)})"

    if len({on(c) for c in calib.values()}) == 1:
        links = ", ".join(f"{name} {c.bandwidth_gb_per_s:.4g} GB/s" for name, c in calib.items())
        return f"links calibrated from {path}{on(next(iter(calib.values())))}: {links}"
    return f"links calibrated from {path}: " + ", ".join(f"{name} {c.bandwidth_gb_per_s:.4g} GB/s{on(c)}"
                                                          for name, c in calib.items())


def fit_origin_lines(calib: dict[str, CalibratedLink]) -> list[str]:
    """Where each link class's fit came from, as the file records it (``op``, ``ranks``,
    ``points``, ``source``; its fitted run's ``[[link.<class>.curve]]``: nodes and logged sizes),
    one line per class under :func:`calibration_line`; what the file leaves out is said so.

    >>> curve = BusbwCurve(op="all-reduce", ranks=16, nodes=2, line_gb_per_s=40.0, sizes_bytes=[1024, 2**34],
    ...                    busbw_gb_per_s=[0.05, 36.0], source="s")
    >>> fit_origin_lines({"nic": CalibratedLink(latency_us=20, bandwidth_gb_per_s=37.32, op="all-reduce", ranks=16,
    ...                                         points=25, source="nccl-tests 2.17.6, file a.txt", curve=[curve])})
    ['  nic fitted to all-reduce over 16 ranks on 2 nodes: 25 nccl-tests rows, logged sizes 1.00 KiB to 16.00 GiB; source: nccl-tests 2.17.6, file a.txt']
    >>> fit_origin_lines({"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=450, source="a")})
    ['  nvlink fitted to op and ranks not recorded: rows not recorded, size range not recorded; source: a']
    """
    out = []
    for name, c in calib.items():
        curve = c.fitted_curve()
        run = f"{c.op} over {c.ranks} ranks" if c.op and c.ranks else "op and ranks not recorded"
        run += f" on {curve.nodes} node{'s' if curve.nodes != 1 else ''}" if curve is not None else ""
        rows = f"{c.points} nccl-tests rows" if c.points is not None else "rows not recorded"
        sizes = (f"logged sizes {human_bytes(min(curve.sizes_bytes))} to {human_bytes(max(curve.sizes_bytes))}"
                 if curve is not None and curve.sizes_bytes else "size range not recorded")
        out.append(f"  {name} fitted to {run}: {rows}, {sizes}; source: {c.source}")
    return out


def _families(name: str) -> set[str]:
    """Model tokens of a GPU name: a few letters then 2 to 4 digits and an optional letter
    (``a100``, ``h200``, ``gb200``, ``mi300x``, ``l40s``), lowercased; memory sizes (``80gb``),
    form factors (``sxm4``) and vendors are not."""
    return {t for t in re.findall(r"[a-z0-9]+", name.lower()) if re.fullmatch(r"[a-z]{1,3}[0-9]{2,4}[a-z]?", t)}


def same_gpu(measured: str, catalog: str) -> bool:
    """Whether nccl-tests' GPU name ``measured`` is the catalog GPU ``catalog``: they share a
    model token (:func:`_families`). A name without one (``cuda:0``) matches nothing.

    >>> same_gpu("NVIDIA H100 80GB HBM3", "h100-sxm5-80gb"), same_gpu("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb")
    (True, True)
    >>> same_gpu("NVIDIA A100-SXM4-80GB", "h100-sxm5-80gb"), same_gpu("NVIDIA H200", "h100-sxm5-80gb")
    (False, False)
    >>> same_gpu("NVIDIA GB200", "b200-gb200-186gb"), same_gpu("AMD Instinct MI300X", "mi300x-oam-192gb")
    (True, True)
    """
    return bool(_families(measured) & _families(catalog))


def gpu_warnings(path, calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[str]:
    """One line per GPU model of ``calib`` that is not ``cluster``'s catalog GPU
    (:func:`same_gpu`), naming the file, its link classes measured on that model and both GPUs;
    none for link classes without a recorded GPU (:func:`calibration_line` says so) or
    measured with gloo."""
    by_gpu: dict[str, list[str]] = {}
    for name, c in calib.items():
        if c.gpu and c.backend != "gloo" and not same_gpu(c.gpu, cluster.gpu.name):
            by_gpu.setdefault(c.gpu, []).append(name)
    return [f"--calibration {path}: {' and '.join(links)} measured on {gpu} ({catalog_words(gpu)}), but cluster "
            f"{cluster.name} has {cluster.gpu.name}: these are another machine's links; calibrate on this cluster's "
            "GPUs (nccl-tests + meshplan calibrate) or plan a cluster of the measured GPU" for gpu, links in by_gpu.items()]


def catalog_words(measured: str) -> str:
    """The catalog GPU(s) a measured device name is (:func:`same_gpu`), in the catalog's ids, so
    a warning names both GPUs in the same kind of name as the cluster's.

    >>> catalog_words("NVIDIA A100-SXM4-80GB"), catalog_words("NVIDIA L4"), catalog_words("NVIDIA A100")
    ('catalog a100-sxm-80gb', 'no catalog GPU', 'catalog a100-sxm-40gb or a100-sxm-80gb')
    """
    ids = [g for g in catalog.names("gpu") if same_gpu(measured, g)]
    sized = [g for g in ids if (m := re.search(r"(\d+)gb$", g)) and re.search(rf"\b{m.group(1)}\s*GB", measured, re.I)]
    ids = sized or ids  # the part of the measured memory where its name gives one (A100 40GB / 80GB)
    return f"catalog {' or '.join(ids)}" if ids else "no catalog GPU"


def calibration_doc(path, calib: dict[str, CalibratedLink], cluster: Optional[ClusterSpec] = None) -> dict:
    """The ``calibration`` entry of the plan, step, search and compare ``--json`` documents
    and of compare's evidence: the file, the header line (:func:`calibration_line`), per link
    class its bus bandwidth (bytes/s), per-call latency (s), source and GPU model (None when not
    recorded), SI, where each fit came from (``origin``, :func:`fit_origin_lines`), and the GPU warnings against ``cluster`` (:func:`gpu_warnings`; [] without
    one)."""
    return {"file": str(path), "line": calibration_line(path, calib), "origin": fit_origin_lines(calib),
            "links": {name: {"bandwidth_bytes_per_s": c.bandwidth_bytes_per_s, "latency_s": c.latency_us / 1e6,
                             "source": c.source, "gpu": c.gpu} for name, c in calib.items()},
            "warnings": gpu_warnings(path, calib, cluster) + nic_rate_warnings(path, calib, cluster)
            if cluster is not None else []}


def nic_rate_warnings(path, calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[str]:
    """One line when ``calib``'s ``nic`` bandwidth (per NIC) is above the line rate of the
    catalog NICs of ``cluster``'s node (its catalog entry by name; none for a node not in the
    catalog): a NIC carries at most its line rate, so the fit holds several NICs' traffic
    (a file of ``meshplan calibrate --link nic`` from before it split a multi-GPU node's busbw
    over its NICs); and one when its curve's run had k > 1 ranks per node, split over k NICs
    (or the ``nics_per_node`` it gives), but the cluster's node has another number of NICs."""
    c = calib.get("nic")
    curve = c.fitted_curve() if c is not None else None
    ranks = curve.ranks // curve.nodes if curve is not None else 1
    per = c.split_nics(curve) if c is not None else 1
    how = (f"one per rank of its {per}-GPU-per-node run" if per == ranks
           else f"nics_per_node, of its {ranks}-GPU-per-node run")
    split = [f"--calibration {path}: nic was split over {per} NICs per node ({how}), but {cluster.node.name} has "
             f"{len(cluster.node.nics)}: its per-NIC figure is not this node's"
             ] if ranks > 1 and per != len(cluster.node.nics) else []
    if c is None or c.backend == "gloo" or cluster.node.name not in catalog.names("node"):
        return split
    rates = [n["rate_gbit_per_s"] for n in catalog.entry("node", cluster.node.name).get("nics", [])]
    if not rates or c.bandwidth_gb_per_s * 8 <= max(rates):
        return split
    return split + [f"--calibration {path}: nic {c.bandwidth_gb_per_s:.4g} GB/s per NIC is {c.bandwidth_gb_per_s * 8 / max(rates):.1f}x "
            f"the {max(rates):g} Gb/s line rate of {cluster.node.name}'s NICs: it holds several NICs' traffic; "
            "calibrate the run again with its '#  Rank' lines (meshplan calibrate splits a node's busbw over its "
            "ranks' NICs)"]


def apply_calibration(cluster: ClusterSpec, calib: dict[str, CalibratedLink]) -> ClusterSpec:
    """A new cluster whose link figures come from ``calib``: ``nvlink`` -> the node's fabric,
    ``pcie`` -> its PCIe link (bandwidth, per-step latency); ``nic`` -> every NIC's rate
    (GB/s x 8 = Gb/s) and every network tier's per-step latency. The calibrated link classes
    lose the catalog's measured busbw curves (``nvlink`` the "nvlink" and "nvls" curves, ``nic``
    the "nic" curve and the single-NIC curves "p2p" (cross-node send/recv pair) and "nic1" (one
    rank per node), which run over one NIC):
    the user's own fit replaces them, and the user's own curve of the fitted run
    (:meth:`CalibratedLink.fitted_curve`) becomes the "nvlink" or "nic" curve. A gloo
    measurement (``backend = "gloo"``) on a cluster whose library is not gloo is a ConfigError naming the table. Each calibrated class is marked ``calibrated`` (timed on
    the fit alone: module docstring). Other fields are kept."""
    for name, c in calib.items():
        if c.backend == "gloo" and cluster.collective_library != "gloo":
            raise ConfigError(f"--calibration: link.{name}", f"measured with gloo ({GLOO_MEDIUM.get(name, 'TCP')}, "
                              f"{c.bandwidth_gb_per_s:g} GB/s), not with {cluster.collective_library} on the "
                              f"{cluster.name} {name}; calibrate the GPUs (nccl-tests + meshplan calibrate, or bench "
                              "comm on a GPU host) or plan a gloo cluster")
    node, tag = cluster.node, "calibrated: {}"
    upd: dict[str, Any] = {}
    dropped = {"nvlink": ("nvlink", "nvls"), "nic": ("nic", "p2p", "nic1")}
    gone = {c for name in calib for c in dropped.get(name, ())}
    upd["busbw"] = {k: v for k, v in node.busbw.items() if k not in gone}
    for name, c in calib.items():  # read against the class's calibrated rate (the fit's beta)
        curve = c.fitted_curve() if name in dropped else None
        if curve is not None:  # a nic curve of k ranks per node ran on k (or nics_per_node) NICs of a node
            per = c.split_nics(curve) if name == "nic" else 1
            upd["busbw"][name] = curve.model_copy(update={"line_gb_per_s": c.bandwidth_gb_per_s * per})
    for name, field in (("nvlink", "fabric"), ("pcie", "pcie")):
        if name in calib:
            c = calib[name]
            upd[field] = getattr(node, field).model_copy(update={
                "bandwidth_gb_per_s": c.bandwidth_gb_per_s, "latency_us": c.step_latency_us,
                "calibrated": True, "source": tag.format(c.source)})
    network = cluster.network
    if "nic" in calib:
        c = calib["nic"]
        if not node.nics:
            raise ConfigError("--calibration: link.nic", f"node {node.name} has no NIC; drop [link.nic] or add NICs")
        upd["nics"] = [n.model_copy(update={"rate_gbit_per_s": c.bandwidth_gb_per_s * 8}) for n in node.nics]
        network = [t.model_copy(update={"latency_us": c.step_latency_us, "calibrated": True})
                   for t in cluster.network]
    sources = "; ".join(f"{k}: {v.source}" for k, v in calib.items())
    return cluster.model_copy(update={"node": node.model_copy(update=upd), "network": network,
                                      "source": f"{cluster.source} (calibrated: {sources})".strip()})


def uncalibrated_note(cluster: ClusterSpec) -> Optional[str]:
    """The note step prints when a link class its collectives can run on has neither a
    measured busbw curve in the catalog (``nvlink`` for several GPUs per node, ``nic`` for
    several nodes) nor a ``--calibration`` fit: such a link is timed at its line rate, an
    upper bound (on 8x A100 S15's busbw tops out at 234.9 of 300 GB/s, 78%). None when every
    used class is measured, and for gloo (the testbed, timed on its own latency figures).

    >>> from meshplan.catalog import system
    >>> uncalibrated_note(system("dgx-a100", nodes=2)) is None
    True
    >>> uncalibrated_note(system("mi300x-azure-nd-v5", nodes=2))  # doctest: +ELLIPSIS
    'note: links uncalibrated: mi300x-azure-nd-v5 infinity-fabric-mesh (448 GB/s) and NIC (400 Gb/s) ... (meshplan calibrate)'
    """
    node = cluster.node
    if cluster.collective_library == "gloo":
        return None
    missing = []
    if node.gpus > 1 and not node.fabric.calibrated and "nvlink" not in node.busbw:
        missing.append(f"{node.fabric.name} ({node.fabric.bandwidth_gb_per_s:g} GB/s)")
    if cluster.nodes > 1 and node.nics and "nic" not in node.busbw and not (cluster.network and cluster.network[0].calibrated):
        missing.append(f"NIC ({node.nics[0].rate_gbit_per_s:g} Gb/s)")
    if not missing:
        return None
    verb = "has" if len(missing) == 1 else "have"
    return (f"note: links uncalibrated: {node.name} {' and '.join(missing)} {verb} no measured busbw curve in the "
            "catalog (catalog/nccl.toml), so collectives on them run at line rate, an upper bound; measure them with "
            "nccl-tests and pass --calibration (meshplan calibrate)")
