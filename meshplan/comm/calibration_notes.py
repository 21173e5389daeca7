"""What plan, step, search and compare print about a calibration file
(:mod:`meshplan.comm.calibration`): the header line under the title, where each link class's
fit came from and which collectives it sets, the ``--json`` entry, and the notes for link
classes timed at line rate for lack of a measured curve or a fit, and for RoCEv2 NICs timed on
an InfiniBand curve.

The warnings for a fit measured on another GPU model or above the node's NIC line rate are in
:mod:`meshplan.comm.calibration_warnings`; the catalog figure each calibrated link class
replaced, as lines and as fields, in :mod:`meshplan.comm.calibration_replaced`.
"""

from __future__ import annotations

from typing import Optional

from meshplan import catalog
from meshplan.comm.calibration import CalibratedLink
from meshplan.comm.calibration_kinds import NVLS_KEPT_WORDS, RING_OPS, nvls_kept, ops_words, own_runs, sets_ops
from meshplan.comm.calibration_replaced import replaced_fields, replaced_lines
from meshplan.comm.calibration_warnings import gpu_warnings, nic_rate_warnings
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


def calibration_doc(path, calib: dict[str, CalibratedLink], cluster: Optional[ClusterSpec] = None) -> dict:
    """The ``calibration`` entry of the plan, step, search and compare ``--json`` documents
    and of compare's evidence: the file, the header line (:func:`calibration_line`), per link
    class its bus bandwidth (bytes/s), per-call latency (s), source and GPU model (None when not
    recorded), SI, where each fit came from (``origin``, :func:`fit_origin_lines`), the catalog
    figure each replaced on ``cluster``'s node (``replaced``, :func:`~meshplan.comm.calibration_replaced.replaced_lines`; ``replaced_links``, the
    same as fields: :func:`~meshplan.comm.calibration_replaced.replaced_fields`) and the GPU
    warnings against ``cluster`` (:func:`~meshplan.comm.calibration_warnings.gpu_warnings`, :func:`~meshplan.comm.calibration_warnings.nic_rate_warnings`); both [] without one."""
    return {"file": str(path), "line": calibration_line(path, calib), "origin": fit_origin_lines(calib, cluster),
            "replaced": replaced_lines(calib, cluster) if cluster is not None else [],
            "replaced_links": replaced_fields(calib, cluster) if cluster is not None else [],
            "links": {name: {"bandwidth_bytes_per_s": c.bandwidth_bytes_per_s, "latency_s": c.latency_us / 1e6,
                             "source": c.source, "gpu": c.gpu} for name, c in calib.items()},
            "warnings": gpu_warnings(path, calib, cluster) + nic_rate_warnings(path, calib, cluster)
            if cluster is not None else []}


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
