"""The warnings plan, step, search and compare print under a calibration file's header line
(:func:`meshplan.comm.calibration_notes.calibration_line`): a fit measured on another GPU model,
and a ``nic`` figure above the line rate of the cluster's NICs.

``gpu`` is what nccl-tests prints for each rank (``cudaDeviceProp.name``,
:func:`meshplan.comm.nccl_tests_run.gpus_of`); files written before it was recorded, or from
output that does not name one, have none and read as "GPU not recorded". A link's NVLink
generation, NICs and their PCIe path come with the GPU model, so a fit measured on one model
describes another's links only by accident: :func:`gpu_warnings` names each calibrated class
whose model is not the cluster's catalog GPU (compared by model name, :func:`same_gpu`), and
plan, step, search and compare print those lines (text and ``--json``) under
:func:`~meshplan.comm.calibration_notes.calibration_line`. They warn rather than refuse: the fit
is still a measurement, a what-if on other links is a fair question, and the name match is by
model family only.

A ``nic`` figure above the line rate of the cluster's catalog NICs holds several NICs'
traffic (:func:`nic_rate_warnings`).
"""

from __future__ import annotations

import re
from typing import Optional

from meshplan import catalog
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_kinds import host_share
from meshplan.config_tables import nic_override_gbit
from meshplan.spec.cluster import ClusterSpec
from meshplan.units import human_bytes



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
    none for link classes without a recorded GPU (:func:`~meshplan.comm.calibration_notes.calibration_line` says so) or
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
    was split over, as :func:`~meshplan.comm.calibration_replaced.logged_at` reads it) where it is above ``line_gb_per_s``, in words, with
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
