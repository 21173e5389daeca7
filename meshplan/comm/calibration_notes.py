"""What plan, step, search and compare print about a calibration file
(:mod:`meshplan.comm.calibration`): the header line under the title, where each link class's
fit came from, the warnings for a fit measured on another GPU model or above the node's NIC
line rate, the ``--json`` entry, and the note for link classes timed at line rate for lack
of a measured curve or a fit.

``gpu`` is what nccl-tests prints for each rank (``cudaDeviceProp.name``,
:func:`meshplan.comm.nccl_tests_run.gpus_of`); files written before it was recorded, or from
output that does not name one, have none and read as "GPU not recorded". A link's NVLink
generation, NICs and their PCIe path come with the GPU model, so a fit measured on one model
describes another's links only by accident: :func:`gpu_warnings` names each calibrated class
whose model is not the cluster's catalog GPU (compared by model name, :func:`same_gpu`), and
plan, step, search and compare print those lines (text and ``--json``) under
:func:`calibration_line`. They warn rather than refuse: the fit is still a measurement, a
what-if on other links is a fair question, and the name match is by model family only.

A ``nic`` figure above the line rate of the cluster's catalog NICs holds several NICs'
traffic (:func:`nic_rate_warnings`).
"""

from __future__ import annotations

import re
from typing import Optional

from meshplan import catalog
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_replaced import replaced_fields
from meshplan.comm.calibration_kinds import (NVLS_KEPT_WORDS, RING_OPS, host_share, nvls_kept, ops_words, own_runs, per_nic,
                                             sets_ops)
from meshplan.config_tables import nic_override_gbit
from meshplan.spec.cluster import BusbwCurve, ClusterSpec
from meshplan.units import human_bytes


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


def fit_origin_lines(calib: dict[str, CalibratedLink], cluster: Optional[ClusterSpec] = None) -> list[str]:
    """Where each link class's fit came from, as the file records it (``op``, ``ranks``,
    ``points``, ``source``; its fitted run's ``[[link.<class>.curve]]``: nodes and logged sizes),
    one line per class under :func:`calibration_line`; what the file leaves out is said so. ``cluster``:
    the planned one, whose node may have no catalog NIC curve for the ops the file leaves (:func:`sets_line`).

    >>> curve = BusbwCurve(op="all-reduce", ranks=16, nodes=2, line_gb_per_s=40.0, sizes_bytes=[1024, 2**34],
    ...                    busbw_gb_per_s=[0.05, 36.0], source="s")
    >>> fit_origin_lines({"nic": CalibratedLink(latency_us=20, bandwidth_gb_per_s=37.32, op="all-reduce", ranks=16,
    ...                                         points=25, source="nccl-tests 2.17.6, file a.txt", curve=[curve])})
    ["  nic fitted to all-reduce over 16 ranks on 2 nodes: 25 nccl-tests rows, logged sizes 1.00 KiB to 16.00 GiB; source: nccl-tests 2.17.6, file a.txt; sets all-reduce, all-gather and reduce-scatter across nodes; all-to-all stays on the catalog curve; send/recv on the catalog curve scaled by this run's busbw per NIC over the catalog's"]
    >>> fit_origin_lines({"nvlink": CalibratedLink(latency_us=10, bandwidth_gb_per_s=450, source="a")})
    ['  nvlink fitted to op and ranks not recorded: rows not recorded, size range not recorded; source: a; sets all-reduce, all-gather, reduce-scatter and all-to-all on nvlink']
    """
    out = []
    for name, c in calib.items():
        curve = c.fitted_curve()
        run = f"{c.op} over {c.ranks} ranks" if c.op and c.ranks else "op and ranks not recorded"
        run += f" on {curve.nodes} node{'s' if curve.nodes != 1 else ''}" if curve is not None else ""
        rows = f"{c.points} nccl-tests rows" if c.points is not None else "rows not recorded"
        sizes = (f"logged sizes {human_bytes(min(curve.sizes_bytes))} to {human_bytes(max(curve.sizes_bytes))}"
                 if curve is not None and curve.sizes_bytes else "size range not recorded")
        catalog_nic = cluster is None or "nic" in cluster.node.busbw
        out.append(f"  {name} fitted to {run}: {rows}, {sizes}; source: {c.source}; "
                   f"{sets_line(name, c, catalog_nic)}")
    return out


def sets_line(name: str, c: CalibratedLink, catalog_nic: bool = True) -> str:
    """Which collectives the ``name`` table ``c`` sets (:func:`~meshplan.comm.calibration_kinds.sets_ops`),
    the others keeping the catalog's curves, or with ``catalog_nic`` false (a node with no catalog NIC curve: an
    inline node, newcomer trial 50 #8) their NIC line rate; a ``nic`` table without logged curves (a file from
    before they were written) sets every op, as it did, and says how to set each from its own run.

    >>> a2a = BusbwCurve(op="all-to-all", ranks=16, nodes=2, line_gb_per_s=50.0, sizes_bytes=[2**30],
    ...                  busbw_gb_per_s=[80.0], source="s")
    >>> c = CalibratedLink(latency_us=32, bandwidth_gb_per_s=43.3, op="all-to-all", ranks=16, source="a", curve=[a2a])
    >>> sets_line("nic", c, catalog_nic=False)
    'sets all-to-all across nodes; all-reduce, all-gather, reduce-scatter and send/recv run at the NIC line rate (the node has no catalog NIC curve), an upper bound'


    >>> sets_line("nic", CalibratedLink(latency_us=20, bandwidth_gb_per_s=34.66, op="all-to-all", ranks=16, source="a"))
    'sets every op across nodes: no logged curve in the file (written before per-op calibration), so its all-to-all fit stands for all; run meshplan calibrate on the logs again to set each op from its own run'
    """
    ops = sets_ops(name, c.op, c.curve)
    if name != "nic":
        own, kept = list(own_runs(name, c.op, c.curve)), nvls_kept(name, c.op, c.curve)
        return (f"sets {ops_words(ops[:4])} on {name}" + (f"; {ops_words(own)} each from its own run" if own else "")
                + (f"; {NVLS_KEPT_WORDS}" if kept else ""))
    if not c.curve:
        return ("sets every op across nodes: no logged curve in the file (written before per-op calibration), so its "
                f"{c.op or 'unrecorded'} fit stands for all; run meshplan calibrate on the logs again to set each op "
                "from its own run")
    rest = [o for o in (*RING_OPS, "all-to-all", "send/recv") if o not in ops]
    scaled = "send/recv" in rest and c.op in RING_OPS  # calibration_kinds.nic_curves: scaled by the fit
    rest = [o for o in rest if not scaled or o != "send/recv"]
    if rest and not catalog_nic:
        return (f"sets {ops_words(ops)} across nodes; {ops_words(rest)} run{'s' if len(rest) == 1 else ''} at the NIC "
                "line rate (the node has no catalog NIC curve), an upper bound")
    return (f"sets {ops_words(ops)} across nodes" + (f"; {ops_words(rest)} stay{'s' if len(rest) == 1 else ''} on the catalog "
                                                  f"curve{'s' if len(rest) > 1 else ''}" if rest else "")
            + ("; send/recv on the catalog curve scaled by this run's busbw per NIC over the catalog's" if scaled
               else ""))


def replaced_lines(calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[str]:
    """Per calibrated link class, its calibrated fit (the alpha-beta line's bus bandwidth, not a
    logged number) with, where the file holds the fitted run's logged curve, the busbw it logged at
    the logged size nearest the catalog figure's (:func:`logged_at`), beside the catalog figure it
    replaced on ``cluster``'s node (the catalog entry of that name: nodes.toml and its nccl.toml
    curves), one line each, printed by plan, step, search and compare under the header
    (:func:`calibration_line`): ``nic`` per NIC against the catalog NIC curve's busbw per NIC at
    its largest size (:func:`~meshplan.comm.calibration_kinds.per_nic`), ``nvlink`` against the
    catalog NVLink curve's busbw there, each else (and ``pcie``) against the catalog line rate; a
    node not in the catalog says so. Newcomer trial 27 #D: the line once called the fit
    "measured" (20.42 GB/s per NIC, its 163.32 GB/s line over 8 NICs) where the log held 21.87
    at that size (174.96 / 8).

    >>> from meshplan.catalog import system
    >>> replaced_lines({"nic": CalibratedLink(latency_us=30, bandwidth_gb_per_s=45.0, op="all-reduce", ranks=16,
    ...                                      source="a")}, system("dgx-h100", nodes=2))
    ['  nic all-reduce busbw 45.00 GB/s per NIC calibrated fit, catalog 47.00 (ib-ndr-400-8nic at 8.00 GiB; line rate 50)']
    """
    name = cluster.node.name
    if name not in catalog.names("node"):
        return [f"  {link} busbw {c.bandwidth_gb_per_s:.2f} GB/s calibrated fit{logged_at(link, c, None)}, no catalog "
                f"figure: node {name} is not a catalog node" for link, c in calib.items()]
    node, keys = catalog.node(name), catalog.entry("node", name).get("busbw", {})
    catalog_gbit = node.nics[0].rate_gbit_per_s if node.nics else None
    config_gbit = nic_override_gbit(cluster.node.source)  # [cluster] nic's: the line the plan reads (nc54 #5)
    if node.nics and config_gbit is not None:
        node = node.model_copy(update={"nics": [n.model_copy(update={"rate_gbit_per_s": config_gbit})
                                                for n in node.nics]})
    out = []
    for link, c in calib.items():
        per = " per NIC" if link == "nic" else ""
        curve = {"nic": node.busbw.get("nic"), "nvlink": node.busbw.get("nvlink")}.get(link)
        size = curve.sizes_bytes[-1] if curve is not None else None
        own = link == "nic" and bool(c.curve) and c.op not in RING_OPS  # per op: it replaced no ring figure
        out.append(f"  {link} {c.op + ' ' if c.op else ''}busbw {c.bandwidth_gb_per_s:.2f} GB/s{per} calibrated fit"
                   f"{logged_at(link, c, size)}, "
                   f"{'the ring ops keep the catalog' + chr(39) + 's ' if own else 'catalog '}"
                   f"{_catalog_figure(link, node, keys, catalog_gbit)}")
    return out


def logged_at(link: str, c: CalibratedLink, size_bytes: Optional[float]) -> str:
    """`` (logged 21.87 at 4.00 GiB = busbw 174.96 / 8 NICs)``: the busbw the fitted run logged (its
    ``[[link.<class>.curve]]``; for ``nic`` the fit's quantity, nccl-tests' busbw per NIC: x the host
    share over the NICs it was split over, :func:`~meshplan.comm.calibration_kinds.host_share`,
    :meth:`CalibratedLink.split_nics`, with that formula) at its logged size nearest ``size_bytes``
    (its largest where None); "" where the file has no logged curve of the fitted run. Trial 28:
    an all-to-all over 2 x 8 H100 logged 64.59 GB/s at 4 GiB, 34.45 per NIC = 64.59 x 8 / 15 (it
    said 8.07 = 64.59 / 8).

    >>> from meshplan.comm.calibration import LoggedCurve
    >>> run = LoggedCurve(op="all-reduce", ranks=32, nodes=4, sizes_bytes=[2**31, 2**32, 2**33],
    ...                   busbw_gb_per_s=[174.34, 174.96, 176.39], source="s")
    >>> c = CalibratedLink(latency_us=41.05, bandwidth_gb_per_s=20.42, op="all-reduce", ranks=32, source="s", curve=[run])
    >>> logged_at("nic", c, 2**32), logged_at("nic", c, None)  # 174.96 / 8 NICs; 176.39 / 8
    (' (logged 21.87 at 4.00 GiB = busbw 174.96 / 8 NICs)', ' (logged 22.05 at 8.00 GiB = busbw 176.39 / 8 NICs)')
    >>> a2a = LoggedCurve(op="all-to-all", ranks=16, nodes=2, sizes_bytes=[2**32], busbw_gb_per_s=[64.59], source="s")
    >>> logged_at("nic", CalibratedLink(latency_us=37.74, bandwidth_gb_per_s=34.66, op="all-to-all", ranks=16,
    ...                                 source="s", curve=[a2a]), 2**33)  # 64.59 x 8 / 15 = 34.448
    " (logged 34.45 at 4.00 GiB = busbw 64.59 x (16 - 8) / (16 - 1), the share of a rank's bytes that leaves its host, through its own NIC)"
    """
    curve = c.fitted_curve()
    if curve is None or not curve.sizes_bytes:
        return ""
    at = len(curve.sizes_bytes) - 1 if size_bytes is None else min(
        range(len(curve.sizes_bytes)), key=lambda i: abs(curve.sizes_bytes[i] - size_bytes))
    busbw, size = curve.busbw_gb_per_s[at], human_bytes(curve.sizes_bytes[at])
    if link != "nic":
        return f" (logged {busbw:.2f} at {size})"
    g, nics = curve.ranks // curve.nodes, c.split_nics(curve)
    share = host_share(curve.op, curve.ranks, g)
    if share == 1.0:
        how = f"busbw {busbw:.2f} / {nics} NICs" if nics > 1 else "busbw"
    else:  # all-to-all: nccl-tests' busbw is per rank, the share (n - g) / (n - 1) of it leaves the host
        n = curve.ranks
        how = (f"busbw {busbw:.2f} x ({n} - {g}) / ({n} - 1){'' if nics == g else f' x {g} / {nics}'}, the share of "
               "a rank's bytes that leaves its host, through its own NIC")
    return f" (logged {busbw * share / nics:.2f} at {size} = {how})"


def _catalog_figure(link: str, node, keys: dict, catalog_gbit: Optional[float] = None) -> str:
    """The catalog figure of ``link`` on catalog ``node`` (a NodeSpec; ``keys``: its nodes.toml
    ``busbw`` curve names), as :func:`replaced_lines` prints it: read against ``node``'s NIC rate, the
    config's where ``[cluster] nic`` set one other than ``catalog_gbit`` (the catalog node's, Gb/s),
    and then said so (newcomer trial 54 #5: the header said "line rate 50" on a config of 50 Gb/s NICs)."""
    if link == "nic" and not node.nics:
        return "none (the node has no NIC)"
    rate = {"nic": node.nics[0].rate_gbit_per_s / 8 if node.nics else 0.0, "nvlink": node.fabric.bandwidth_gb_per_s,
            "pcie": node.pcie.bandwidth_gb_per_s}[link]
    curve = node.busbw.get(link) if link in ("nic", "nvlink") else None
    own = (f" = the config's {rate * 8:g} Gb/s NICs, not the catalog's {catalog_gbit:g} Gb/s" if link == "nic"
           and catalog_gbit is not None and node.nics and node.nics[0].rate_gbit_per_s != catalog_gbit else "")
    if curve is None:
        return f"{rate:g} (line rate{own}; no measured curve in the catalog)"
    size = curve.sizes_bytes[-1]
    return f"{per_nic(curve, size, rate):.2f} ({keys.get(link, link)} at {human_bytes(size)}; line rate {rate:g}{own})"


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
    recorded), SI, where each fit came from (``origin``, :func:`fit_origin_lines`), the catalog
    figure each replaced on ``cluster``'s node (``replaced``, :func:`replaced_lines`; ``replaced_links``, the
    same as fields: :func:`~meshplan.comm.calibration_replaced.replaced_fields`) and the GPU
    warnings against ``cluster`` (:func:`gpu_warnings`); both [] without one."""
    return {"file": str(path), "line": calibration_line(path, calib), "origin": fit_origin_lines(calib, cluster),
            "replaced": replaced_lines(calib, cluster) if cluster is not None else [],
            "replaced_links": replaced_fields(calib, cluster) if cluster is not None else [],
            "links": {name: {"bandwidth_bytes_per_s": c.bandwidth_bytes_per_s, "latency_s": c.latency_us / 1e6,
                             "source": c.source, "gpu": c.gpu} for name, c in calib.items()},
            "warnings": gpu_warnings(path, calib, cluster) + nic_rate_warnings(path, calib, cluster)
            if cluster is not None else []}


def nic_rate_warnings(path, calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[str]:
    """One line when ``calib``'s ``nic`` bandwidth (per NIC) is above the line rate of ``cluster``'s
    NICs before the calibration (``[cluster] nic``'s rate where the config sets one,
    :func:`~meshplan.config_tables.nic_override_gbit`, else its catalog node's; none for another node:
    newcomer trial 54 #5, a 41.38 GB/s fit on NICs typed as 50 Gb/s passed unwarned): a NIC carries at
    most its line rate, so the fit holds several NICs' traffic (a file of ``meshplan calibrate --link
    nic`` from before it split a multi-GPU node's busbw over its NICs) or the config's rate is not the
    NICs'; else one when a point of its logged curves is, per NIC (:func:`_curve_over`); and one when
    its curve's run had k > 1 ranks per node, split over k NICs (or the ``nics_per_node`` it gives),
    but the cluster's node has another number of NICs."""
    c = calib.get("nic")
    curve = c.fitted_curve() if c is not None else None
    ranks = curve.ranks // curve.nodes if curve is not None else 1
    per = c.split_nics(curve) if c is not None else 1
    how = (f"one per rank of its {per}-GPU-per-node run" if per == ranks
           else f"nics_per_node, of its {ranks}-GPU-per-node run")
    split = [f"--calibration {path}: nic was split over {per} NICs per node ({how}), but {cluster.node.name} has "
             f"{len(cluster.node.nics)}: its per-NIC figure is not this node's"
             ] if ranks > 1 and per != len(cluster.node.nics) else []
    known = catalog.entry("node", cluster.node.name).get("nics", []) if cluster.node.name in catalog.names("node") else []
    config = nic_override_gbit(cluster.node.source)  # the config's line rate, which --calibration replaced
    config = None if known and config == max(n["rate_gbit_per_s"] for n in known) else config
    if c is None or c.backend == "gloo" or not (known or config):
        return split
    line = config if config is not None else max(n["rate_gbit_per_s"] for n in known)
    whose = (f"{cluster.node.name}'s NICs as the config's [cluster] nic sets them"
             + (f" (catalog {max(n['rate_gbit_per_s'] for n in known):g} Gb/s)" if known else "")
             if config is not None else f"{cluster.node.name}'s NICs")
    fix = ("check [cluster] nic's rate_gbit_per_s, in gigabits per second (400 Gb/s = 50 GB/s)" if config is not None else
           "calibrate the run again with its '#  Rank' lines (meshplan calibrate splits a node's busbw over its "
           "ranks' NICs)")
    or_rate = ", or that rate is not the NICs'" if config is not None else ""
    if c.bandwidth_gb_per_s * 8 > line:
        return split + [f"--calibration {path}: nic {c.bandwidth_gb_per_s:.4g} GB/s per NIC is "
                        f"{c.bandwidth_gb_per_s * 8 / line:.1f}x the {line:g} Gb/s line rate of {whose}: it holds "
                        f"several NICs' traffic{or_rate}; {fix}"]
    over = _curve_over(c, line / 8)
    return split + ([f"--calibration {path}: nic {over}, above the {line:g} Gb/s line rate of {whose}, which a NIC "
                     "cannot pass, though the fit is not: the curve came from the log's busbw column; check that log's "
                     "rows (nccl-tests' busbw = size / time x factor) and calibrate it again, which refuses a row "
                     f"that is not{'; ' + fix if config is not None else ''}"] if over else [])


def _curve_over(c: CalibratedLink, line_gb_per_s: float) -> Optional[str]:
    """The highest point of ``c``'s logged curves in busbw per NIC (x the host share over the NICs it
    was split over, as :func:`logged_at` reads it) where it is above ``line_gb_per_s``, in words, with
    how many points are; None where none is.

    >>> from meshplan.comm.calibration import LoggedCurve
    >>> run = LoggedCurve(op="all-reduce", ranks=16, nodes=2, sizes_bytes=[2**20, 2**32, 2**33],
    ...                   busbw_gb_per_s=[411.84, 2697.68, 2679.52], source="s")
    >>> _curve_over(CalibratedLink(latency_us=32, bandwidth_gb_per_s=42.43, op="all-reduce", ranks=16, source="s",
    ...                            curve=[run]), 50.0)  # 2697.68 / 8 = 337.21
    'all-reduce curve reaches 337.21 GB/s per NIC at 4.00 GiB (busbw 2697.68 over 8 NICs; 3 of its 3 points above the line)'
    """
    worst, count, total = None, 0, 0
    for curve in c.curve:
        nics, share = c.split_nics(curve), host_share(curve.op, curve.ranks, curve.ranks // curve.nodes)
        for size, busbw in zip(curve.sizes_bytes, curve.busbw_gb_per_s):
            total += 1
            if busbw * share / nics > line_gb_per_s:
                count += 1
                worst = max(worst or (0.0, "", 0, 0.0, 0), (busbw * share / nics, curve.op, size, busbw, nics))
    if worst is None:
        return None
    per, op, size, busbw, nics = worst
    return (f"{op} curve reaches {per:.2f} GB/s per NIC at {human_bytes(size)} (busbw {busbw:.2f} over {nics} NICs; "
            f"{count} of its {total} points above the line)")


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
    a2a_only = "a2a" in node.busbw  # --calibration set all-to-all alone (newcomer trial 50 #8): the ring ops not
    if cluster.nodes > 1 and node.nics and "nic" not in node.busbw and not (cluster.network and cluster.network[0].calibrated):
        missing.append(f"NIC ({node.nics[0].rate_gbit_per_s:g} Gb/s)" + (
            f" for {'all-reduce, all-gather, reduce-scatter' + ('' if 'p2p' in node.busbw else ' and send/recv')} "
            "(--calibration set all-to-all)" if a2a_only else ""))
    if not missing:
        return None
    verb = "has" if len(missing) == 1 else "have"
    return (f"note: links uncalibrated: {node.name} {' and '.join(missing)} {verb} no measured busbw curve in the "
            "catalog (catalog/nccl.toml), so collectives on them run at line rate, an upper bound; measure them with "
            "nccl-tests and pass --calibration (meshplan calibrate)")


def roce_note(cluster: ClusterSpec) -> Optional[str]:
    """The note step prints for RoCEv2 NICs (``NICSpec.transport = "roce"``) whose ``nic`` class
    no ``--calibration`` fit measured: they are timed on the node's ``nic`` curve, measured on
    InfiniBand where it is a catalog curve (every one in ``catalog/nccl.toml`` is), read against
    the NICs' own line rate (:func:`meshplan.comm.alphabeta.measured_time`: its busbw over its
    line, times this rate), or at line rate without a curve; no public nccl-tests size sweep over
    RoCEv2 was found (shared/reference/public-microbenchmarks.md: "RoCE none"), so no RoCE
    efficiency is assumed. None for InfiniBand NICs, one node, or a calibrated NIC class.

    >>> from meshplan.catalog import system
    >>> c = system("dgx-h200", nodes=2)
    >>> roce_note(c) is None
    True
    >>> nics = [n.model_copy(update={"transport": "roce"}) for n in c.node.nics]
    >>> print(roce_note(c.model_copy(update={"node": c.node.model_copy(update={"nics": nics})})))  # doctest: +NORMALIZE_WHITESPACE
    note: NICs RoCEv2 (400 Gb/s): timed on catalog curve ib-ndr-400-8nic, measured on InfiniBand (376 of 400 GB/s
    busbw at 8.00 GiB, 94%), read against their line rate: an assumption, as no public nccl-tests sweep over RoCEv2 was
    found; measure all_reduce_perf (and all_gather_perf) across 2 or more of your nodes and pass --calibration
    (meshplan calibrate)
    """
    node = cluster.node
    roce = [n for n in node.nics if n.transport == "roce"]
    if not roce or cluster.nodes < 2 or (cluster.network and cluster.network[0].calibrated):
        return None
    curve = node.busbw.get("nic")
    name = catalog.curve_name(curve) if curve is not None else None
    if curve is None:
        how = "at line rate (the node has no nic curve), an upper bound"
    elif name is None:
        how = "on the node's own nic curve (its source says what it was measured on), read against their line rate"
    else:
        how = (f"on catalog curve {name}, measured on InfiniBand ({curve.busbw_gb_per_s[-1]:g} of "
               f"{curve.line_gb_per_s:g} GB/s busbw at {human_bytes(curve.sizes_bytes[-1])}, "
               f"{curve.busbw_gb_per_s[-1] / curve.line_gb_per_s:.0%}), read against their line rate: an assumption, "
               f"as no public nccl-tests sweep over RoCEv2 was found")
    return (f"note: NICs RoCEv2 ({roce[0].rate_gbit_per_s:g} Gb/s): timed {how}; measure all_reduce_perf (and "
            f"all_gather_perf) across 2 or more of your nodes and pass --calibration (meshplan calibrate)")
