"""``calibration.replaced_links`` of the plan, step, search and compare ``--json`` documents: per calibrated
link class, what :func:`~meshplan.comm.calibration_notes.replaced_lines` prints, as fields (newcomer trial
54 #10: a calibration dashboard had to parse the prose), SI units:

- ``link``, ``op``, ``calibrated_bytes_per_s``: the fit's bus bandwidth, per NIC on ``nic``
  (``per_nic`` true);
- ``logged``: the fitted run's logged busbw at its size nearest the catalog curve's largest
  (``size_bytes``, ``busbw_bytes_per_s`` as nccl-tests printed it, and ``per_nic_bytes_per_s`` on ``nic``:
  x the host share over the NICs it was split over, as
  :func:`~meshplan.comm.calibration_notes.logged_at` reads it), null without a logged curve;
- ``catalog``: the figure it replaced on the cluster's catalog node (``curve``: nodes.toml's busbw curve
  name, null where the catalog has none and the figure is the line rate; ``size_bytes``, ``bytes_per_s``:
  per NIC on ``nic``; ``line_rate_bytes_per_s`` and ``line_rate_from``: ``catalog``, or ``config`` where
  ``[cluster] nic`` set the NICs' rate, which the figure is read against), null for a node not in the
  catalog.
"""

from __future__ import annotations

from typing import Any, Optional

from meshplan import catalog
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_kinds import host_share, per_nic
from meshplan.config_tables import nic_override_gbit
from meshplan.spec.cluster import ClusterSpec
from meshplan.units import GB


def replaced_fields(calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[dict[str, Any]]:
    """One entry per link class of ``calib`` on ``cluster`` (module docstring).

    >>> from meshplan.catalog import system
    >>> [e] = replaced_fields({"nic": CalibratedLink(latency_us=30, bandwidth_gb_per_s=45.0, op="all-reduce",
    ...                                             ranks=16, source="a")}, system("dgx-h100", nodes=2))
    >>> e["calibrated_bytes_per_s"], e["catalog"]["bytes_per_s"], e["catalog"]["line_rate_bytes_per_s"]  # 376 / 8
    (45000000000.0, 47000000000.0, 50000000000.0)
    """
    known = cluster.node.name in catalog.names("node")
    node = catalog.node(cluster.node.name) if known else None
    keys = catalog.entry("node", cluster.node.name).get("busbw", {}) if known else {}
    config = nic_override_gbit(cluster.node.source)
    out = []
    for link, c in calib.items():
        curve = {"nic": node.busbw.get("nic"), "nvlink": node.busbw.get("nvlink")}.get(link) if node is not None else None
        size = curve.sizes_bytes[-1] if curve is not None else None
        out.append({"link": link, "op": c.op, "calibrated_bytes_per_s": c.bandwidth_bytes_per_s,
                    "per_nic": link == "nic", "logged": _logged(link, c, size),
                    "catalog": _catalog(link, node, keys, config) if node is not None else None})
    return out


def _logged(link: str, c: CalibratedLink, size_bytes: Optional[float]) -> Optional[dict[str, Any]]:
    """The fitted run's logged point nearest ``size_bytes`` (its largest where None), None without one."""
    curve = c.fitted_curve()
    if curve is None or not curve.sizes_bytes:
        return None
    at = len(curve.sizes_bytes) - 1 if size_bytes is None else min(
        range(len(curve.sizes_bytes)), key=lambda i: abs(curve.sizes_bytes[i] - size_bytes))
    busbw = curve.busbw_gb_per_s[at] * GB
    share = host_share(curve.op, curve.ranks, curve.ranks // curve.nodes) / c.split_nics(curve)
    return {"size_bytes": curve.sizes_bytes[at], "busbw_bytes_per_s": busbw,
            "per_nic_bytes_per_s": busbw * share if link == "nic" else None}


def _catalog(link: str, node, keys: dict, config_gbit: Optional[float]) -> Optional[dict[str, Any]]:
    """The catalog figure of ``link`` on catalog ``node`` read against its line rate (``config_gbit``,
    ``[cluster] nic``'s Gb/s, in place of the catalog NICs' on ``nic``); None for ``nic`` on a node
    without NICs."""
    if link == "nic" and not node.nics:
        return None
    nic_gbit = node.nics[0].rate_gbit_per_s if node.nics else 0.0
    from_config = link == "nic" and config_gbit is not None and config_gbit != nic_gbit
    nic_gbit = config_gbit if from_config and config_gbit is not None else nic_gbit
    rate = {"nic": nic_gbit / 8, "nvlink": node.fabric.bandwidth_gb_per_s, "pcie": node.pcie.bandwidth_gb_per_s}[link]
    curve = {"nic": node.busbw.get("nic"), "nvlink": node.busbw.get("nvlink")}.get(link)
    size = curve.sizes_bytes[-1] if curve is not None else None
    figure = rate if curve is None or size is None else per_nic(curve, size, rate)  # as replaced_lines prints it
    return {"curve": keys.get(link, link) if curve is not None else None, "size_bytes": size,
            "bytes_per_s": figure * GB, "line_rate_bytes_per_s": rate * GB,
            "line_rate_from": "config" if from_config else "catalog"}


def capacity_words(cluster: ClusterSpec) -> str:
    """What the edge-load table's capacities are on ``cluster`` (newcomer trial 54 #12: under
    ``--calibration`` they are the calibrated busbw fits, which the table did not say): the NVLink
    fabric's and each NIC's bandwidth, each a line rate, or a calibrated busbw fit (per NIC) with the
    line rate it replaced (the catalog node's; a NIC's ``[cluster] nic``'s where the config set one).

    >>> from meshplan.catalog import system
    >>> capacity_words(system("dgx-h100", nodes=2))
    'capacities: nvlink4 450 GB/s per GPU and each NIC 50 GB/s, line rates'
    """
    node = cluster.node
    known = catalog.node(node.name) if node.name in catalog.names("node") else None
    fab = node.fabric
    parts = [f"{fab.name} {fab.bandwidth_gb_per_s:.4g} GB/s per GPU"
             + (f" (the calibrated busbw fit{_line(known.fabric.bandwidth_gb_per_s if known else None)})"
                if fab.calibrated else "")]
    nic = bool(node.nics) and any(t.calibrated for t in cluster.network)  # apply_calibration's mark of [link.nic]
    if node.nics:
        config = nic_override_gbit(node.source)
        line = config / 8 if config is not None else known.nics[0].rate_gbit_per_s / 8 if known and known.nics else None
        parts.append(f"each NIC {node.nics[0].rate_gbit_per_s / 8:.4g} GB/s"
                     + (f" (the calibrated busbw fit per NIC{_line(line)})" if nic else ""))
    if not fab.calibrated and not nic:
        return f"capacities: {' and '.join(parts)}, line rates"
    return (f"capacities: {' and '.join(parts)}: a calibrated link's capacity is its busbw fit, what NCCL's collectives "
            "reached on it, not its line rate")


def _line(gb_per_s: Optional[float]) -> str:
    """``, line rate 450 GB/s`` (nothing where not known)."""
    return f", line rate {gb_per_s:g} GB/s" if gb_per_s is not None else ""
