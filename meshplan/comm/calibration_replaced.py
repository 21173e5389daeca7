"""The catalog figure each calibrated link class replaced, beside its fit and the busbw its run logged:
the lines plan, step, search and compare print under the calibration header (:func:`replaced_lines`,
the logged point in words: :func:`logged_at`), the edge-load table's capacities in words
(:func:`capacity_words`), and ``calibration.replaced_links`` of their ``--json`` documents
(:func:`replaced_fields`): per calibrated link class, what :func:`replaced_lines` prints, as fields
(newcomer trial 54 #10: a calibration dashboard had to parse the prose), SI units:

- ``link``, ``op``, ``calibrated_bytes_per_s``: the fit's bus bandwidth, per NIC on ``nic``
  (``per_nic`` true);
- ``logged``: the fitted run's logged busbw at its size nearest the catalog curve's largest
  (``size_bytes``, ``busbw_bytes_per_s`` as nccl-tests printed it, and ``per_nic_bytes_per_s`` on ``nic``:
  x the host share over the NICs it was split over, as
  :func:`logged_at` reads it), null without a logged curve;
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
from meshplan.comm.calibration_kinds import RING_OPS, host_share, per_nic
from meshplan.config_tables import nic_override_gbit
from meshplan.spec.cluster import ClusterSpec
from meshplan.units import GB, human_bytes


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


def replaced_lines(calib: dict[str, CalibratedLink], cluster: ClusterSpec) -> list[str]:
    """Per calibrated link class, its calibrated fit (the alpha-beta line's bus bandwidth, not a
    logged number) with, where the file holds the fitted run's logged curve, the busbw it logged at
    the logged size nearest the catalog figure's (:func:`logged_at`), beside the catalog figure it
    replaced on ``cluster``'s node (the catalog entry of that name: nodes.toml and its nccl.toml
    curves), one line each, printed by plan, step, search and compare under the header
    (:func:`~meshplan.comm.calibration_notes.calibration_line`): ``nic`` per NIC against the catalog NIC curve's busbw per NIC at
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
