"""A calibration file's fits applied to a cluster (:func:`apply_calibration`): each calibrated
link class's rate and per-step latency replace the catalog's, its own logged run becomes the
class's busbw curve, the ops it ran apart from its fit's set their own curves
(:func:`op_curves`), NVLS nodes keep a ring curve scaled to the fit, and the NIC patterns the fit
did not measure follow it (:mod:`meshplan.comm.calibration_kinds`). The file itself, written, read
and named in the outputs: :mod:`meshplan.comm.calibration` (its module docstring: the format and
why a calibrated class is timed on its fit alone).
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan.comm.calibration import CalibratedLink, GLOO_MEDIUM
from meshplan.comm.calibration_kinds import (NIC_PATTERNS, RING_OPS, nic_curves, nvls_kept, own_runs, pattern_of, read_rate,
                                             scaled_curve)
from meshplan.errors import ConfigError
from meshplan.spec.cluster import BusbwCurve, ClusterSpec


def apply_calibration(cluster: ClusterSpec, calib: dict[str, CalibratedLink]) -> ClusterSpec:
    """A new cluster whose link figures come from ``calib``: ``nvlink`` -> the node's fabric,
    ``pcie`` -> its PCIe link (bandwidth, per-step latency); ``nic`` -> every NIC's rate
    (GB/s x 8 = Gb/s) and every network tier's per-step latency. The calibrated link classes
    lose the catalog's measured busbw curves (``nvlink`` the "nvlink" and "nvls" curves, ``nic``
    the "nic" curve): the user's own fit replaces them, and the user's own curve of the fitted
    run (:meth:`~meshplan.comm.calibration.CalibratedLink.fitted_curve`, marked ``calibrated``) becomes the "nvlink" or
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
