"""Which NCCL algorithm times a collective on a path, and how long it takes
(:func:`collective_time`): the ring on every op, NVLS inside an NVSwitch domain, the double
binary tree and the hierarchical algorithm across nodes, the pairwise all-to-all
(:func:`all_to_all_time`), gloo's ring, and a calibrated link read on its own logged curve.
Each algorithm's time is :mod:`meshplan.comm.alphabeta`'s formula for it
(line rate over NCCL's protocols, or a measured busbw curve); this module picks among them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Optional

from meshplan.comm.alphabeta import (algorithm_time, busbw_factor, own_alpha, rank_factor, read_bytes, ring_time,
                                     steps, tree_time)
from meshplan.comm.nccl_protocols import CALIBRATED, GLOO_RING, NCCL_RING, NVLS, NVLS_GAIN, NVLS_STEPS
from meshplan.spec.cluster import BusbwCurve


def ring_word(op: str) -> str:
    """The ``alg`` word of ``op`` timed by the ring formula: ``pairwise`` for an all-to-all, which
    no library runs as a ring (NCCL: grouped ncclSend/ncclRecv to every peer, ``ncclGroupStart``
    ... ``ncclGroupEnd``, torch's ``ProcessGroupNCCL::alltoall_base``; gloo: one pairwise exchange
    per peer), inside a node as across nodes; ``ring`` for the other ops. Only the word: the
    time stays the ring formula's (S (n-1)/n over the link; newcomer trial nc62 #4: the table said
    ``nvlink ring`` for Mixtral's ep all-to-all inside a node, ``pairwise`` across nodes).

    >>> ring_word("all-to-all"), ring_word("all-gather")
    ('pairwise', 'ring')
    """
    return "pairwise" if op == "all-to-all" else "ring"


def collective_time(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float, kind: str,
                    nvls: bool = False, latency_scale: float = 1.0, nodes: int = 1,
                    intra_bandwidth_bytes_per_s: float = 0.0, library: str = "nccl",
                    curves: Mapping[Any, BusbwCurve] = MappingProxyType({}),
                    nic_bandwidth_bytes_per_s: float = 0.0, ranks_per_node: int = 0,
                    nccl_era: str = "current", calibrated: bool = False) -> tuple[str, float]:
    """(algorithm, seconds): the fastest of the algorithms NCCL can run for ``op`` on a path of
    ``kind`` ("nvlink" inside a node or NVLink domain, "network" across ``nodes`` nodes), each
    timed on the link's measured curve in ``curves`` ("nvlink", "nvls", "nic") when there is
    one, else at its line rate (:mod:`meshplan.comm.alphabeta`, its formulas):

    - ``ring`` (:func:`ring_time`), every op;
    - ``NVLS`` for all-reduce inside an NVSwitch domain with in-switch reduction (``nvls``):
      the ring's bytes on the "nvls" curve scaled to ``n`` GPUs (:func:`rank_factor`), or at
      ``NVLS_GAIN`` x the link rate without one, after :data:`NVLS`'s latency;
    - ``tree`` for all-reduce across nodes (:func:`tree_time`): fewer latency steps;
    - ``hierarchical`` across nodes with ``n / nodes`` > 1 ranks per node: reduce-scatter
      inside the node (NVLink), the op across nodes on 1/g of the buffer, all-gather inside
      (left out for ``nccl_era`` "2021": NCCL 2.8-2.9 ran all-gather and reduce-scatter on
      the ring only, ``tuning.cc`` ``ncclTopoTuneModel`` at v2.9.9-1);
    - send/recv across nodes on the "p2p" curve when there is one (a single GPU's pair
      through its own NIC, slower than a NIC's share of the 8-NIC all-reduce: [S18] 15.48
      against 23.0 GB/s on HDR), else on "nic", at most at the rank's own NIC share
      ``nic_bandwidth_bytes_per_s`` where given: one message between two GPUs leaves through the
      sender's NIC (the catalog's nodes give each GPU its own, ``nic`` in the placement), where a
      group of ``k`` ranks on a node spreads a ring collective over their ``k`` NICs
      (:func:`meshplan.comm.row.groups_path`): a cp ring's dK/dV shift with 2 cp ranks a node
      moves at one NIC's rate, not two; the other ops across nodes with one rank per
      node (``ranks_per_node`` 1: each rank drives its own NIC) on the "nic1" curve when there
      is one ([S18] all-reduce 2 x 1 A100: 18.65 GB/s), else on "nic";
    - ``pairwise`` for all-to-all across nodes (:func:`all_to_all_time`), in place of the ring
      when the rank's own NIC share ``nic_bandwidth_bytes_per_s`` and the group's
      ``ranks_per_node`` are given; its network part on the "a2a" curve when there is one (a
      ``--calibration``'s alltoall_perf run, or the catalog's "nic" curve kept for it beside a
      ring fit, :mod:`meshplan.comm.calibration_kinds`), read as a catalog curve at its run's own
      fitted alpha (:func:`own_alpha`; a ring fit's alpha is the ring's, not the all-to-all's), or,
      for a curve without one (the catalog's kept for it, a file of before it), at NCCL's latency
      (the path's latency scale, or NCCL's own where a ring fit set the network's).

    ``calibrated``: the path's link class carries the user's nccl-tests fit (alpha per call of the
    measured collective, beta its bus bandwidth): the ring alone, timed with :data:`CALIBRATED`
    (no NCCL base latency, no protocol choice), and neither NVLS nor tree, whose gain the fit
    already holds (nccl-tests ran whatever NCCL picked): a calibrated class is never predicted
    faster than its own measurements; the ring is read on the user's own curve of the link
    (``meshplan calibrate`` writes it, :func:`meshplan.comm.calibration_apply.apply_calibration`
    puts it in ``curves``) at every size: continued along its last segment above the largest and
    held latency-bound below the smallest (:func:`~meshplan.comm.alphabeta.measured_time`: the
    fit's alpha where it is below the smallest logged time, else that time), so every logged
    point is met at its own size. A calibrated NIC class's send/recv ("p2p") and
    one-rank-per-node ("nic1") curves are the catalog's scaled to the measurement, or runs of
    their own pattern (:mod:`meshplan.comm.calibration_kinds`), not the fit: the ring on them is
    read as on a catalog curve (NCCL's latency, every size on the curve). A calibrated NVLink (or
    NIC-less PCIe) class's op with a run of its own (``"nvlink <op>"``, ``"pcie <op>"`` in ``curves``,
    :func:`meshplan.comm.calibration_kinds.own_runs`) is the ring on that run's curve, every size, at
    its fitted alpha (:func:`own_alpha`). The hierarchical
    algorithm across nodes stays (its network part on the calibrated link at 1/g of the buffer
    and bandwidth, on the fit).

    ``library`` other than "nccl" or "rccl" (gloo): the ring only, with :data:`GLOO_RING`'s single protocol
    (per step exactly the link's latency, full bandwidth); a reduce-scatter costs an all-reduce
    of its full buffer, since ProcessGroupGloo runs it as one (torch 2.13; measured on the
    testbed: 105 ms against 52 ms for an all-gather of the same 107 kB buffer over 4 ranks).

    >>> collective_time("all-reduce", 8, 1 << 30, 450e9, "nvlink", nvls=True)[0]
    'NVLS'
    >>> collective_time("all-reduce", 64, 4096, 50e9, "network", nodes=64)[0]
    'tree'
    """
    network = kind == "network"
    if library not in ("nccl", "rccl"):  # gloo runs rings only, with one protocol; reduce-scatter as a full all-reduce
        run = "all-reduce" if op == "reduce-scatter" else op
        return ring_word(op), ring_time(run, n, size_bytes, bandwidth_bytes_per_s, network, GLOO_RING, latency_scale)
    op_curve = curves.get(f"{'pcie' if network else 'nvlink'} {op}") if calibrated else None
    if op_curve is not None and n > 1:  # this op's own run on a calibrated NVLink or PCIe class
        return ring_word(op), ring_time(op, n, size_bytes, bandwidth_bytes_per_s, network,
                                        *own_alpha(op_curve, network, latency_scale), op_curve)
    if op == "send/recv" and network and nic_bandwidth_bytes_per_s:  # one message leaves through one NIC
        bandwidth_bytes_per_s = min(bandwidth_bytes_per_s, nic_bandwidth_bytes_per_s)
    link = curves.get("nic" if network else "nvlink")
    if op == "send/recv" and network and "p2p" in curves:
        link = curves["p2p"]
    elif network and ranks_per_node == 1 and "nic1" in curves:
        link = curves["nic1"]
    if op == "all-to-all" and network and nic_bandwidth_bytes_per_s and ranks_per_node and n > 1:
        return "pairwise", _pairwise_time(n, size_bytes, ranks_per_node, nic_bandwidth_bytes_per_s,
                                          intra_bandwidth_bytes_per_s, latency_scale, curves, calibrated)
    own = calibrated and (link is None or link.calibrated)  # the fit's own run, not a scaled catalog curve
    proto = CALIBRATED if own else NCCL_RING
    best = (ring_word(op), ring_time(op, n, size_bytes, bandwidth_bytes_per_s, network, proto, latency_scale,
                                     link))
    if n <= 1:
        return best
    options = _switch_options(op, n, size_bytes, bandwidth_bytes_per_s, kind, nvls, latency_scale, curves, calibrated,
                              link)
    options += _hierarchical_options(op, n, size_bytes, bandwidth_bytes_per_s, network, latency_scale, nodes,
                                     intra_bandwidth_bytes_per_s, curves, nccl_era, calibrated, proto, link)
    for name, t in options:
        if t < best[1]:
            best = (name, t)
    return best


def _pairwise_time(n: int, size_bytes: float, ranks_per_node: int, nic_bandwidth_bytes_per_s: float,
                   intra_bandwidth_bytes_per_s: float, latency_scale: float, curves: Mapping[Any, BusbwCurve],
                   calibrated: bool) -> float:
    """Seconds of :func:`collective_time`'s ``pairwise`` all-to-all across nodes (its docstring):
    on the "a2a" curve at its own fitted alpha where there is one, else NCCL's latency."""
    if "a2a" in curves:  # its own curve at its own fitted alpha (a ring fit's is not its), else NCCL's
        a2a = curves["a2a"]
        proto, scale = (own_alpha(a2a, True, latency_scale) if a2a.latency_us is not None else
                        (NCCL_RING, 1.0 if calibrated else latency_scale))
        return all_to_all_time(n, size_bytes, ranks_per_node, nic_bandwidth_bytes_per_s,
                               intra_bandwidth_bytes_per_s, scale, {**curves, "nic": a2a}, proto)
    return all_to_all_time(n, size_bytes, ranks_per_node, nic_bandwidth_bytes_per_s,
                           intra_bandwidth_bytes_per_s, latency_scale,
                           {k: v for k, v in curves.items() if k != "nic"} if calibrated else curves,
                           CALIBRATED if calibrated else NCCL_RING)


def _switch_options(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float, kind: str, nvls: bool,
                    latency_scale: float, curves: Mapping[Any, BusbwCurve], calibrated: bool,
                    link: Optional[BusbwCurve]) -> list[tuple[str, float]]:
    """:func:`collective_time`'s all-reduce algorithms beside the ring on an uncalibrated path:
    ``NVLS`` inside an NVSwitch domain with in-switch reduction, ``tree`` across nodes."""
    options = []
    if op == "all-reduce" and kind == "nvlink" and nvls and not calibrated:
        sent = busbw_factor(op, n) * size_bytes
        curve = curves.get("nvls")
        bw = bandwidth_bytes_per_s * (rank_factor(curve, n) if curve else NVLS_GAIN)
        options.append(("NVLS", algorithm_time(size_bytes, sent, NVLS_STEPS, False, bw, NVLS, latency_scale, curve, NVLS_STEPS)))
    if op == "all-reduce" and kind == "network" and not calibrated:
        options.append(("tree", tree_time(n, size_bytes, bandwidth_bytes_per_s, True, latency_scale, link)))
    return options


def _hierarchical_options(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float, network: bool,
                          latency_scale: float, nodes: int, intra_bandwidth_bytes_per_s: float,
                          curves: Mapping[Any, BusbwCurve], nccl_era: str, calibrated: bool, proto,
                          link: Optional[BusbwCurve]) -> list[tuple[str, float]]:
    """:func:`collective_time`'s ``hierarchical`` algorithm across nodes with g = n / nodes > 1
    ranks per node (none for ``nccl_era`` "2021"): inside the node on NVLink, across on 1/g."""
    g = n // max(nodes, 1)
    if nccl_era != "2021" and network and nodes > 1 and g > 1 and intra_bandwidth_bytes_per_s and op in ("all-reduce", "all-gather",
                                                                                  "reduce-scatter"):
        intra = intra_bandwidth_bytes_per_s
        inter = ring_time(op, nodes, size_bytes / g, bandwidth_bytes_per_s / g, True, proto, latency_scale,
                          None if calibrated else link)
        local = {"all-reduce": ("reduce-scatter", "all-gather"), "all-gather": ("all-gather",),
                 "reduce-scatter": ("reduce-scatter",)}[op]
        return [("hierarchical", inter + sum(ring_time(o, g, size_bytes, intra, curve=curves.get("nvlink"))
                                             for o in local))]
    return []


def all_to_all_time(n: int, size_bytes: float, ranks_per_node: int, nic_bandwidth_bytes_per_s: float,
                    intra_bandwidth_bytes_per_s: float, latency_scale: float = 1.0,
                    curves: Mapping[str, BusbwCurve] = MappingProxyType({}), latency=NCCL_RING) -> float:
    """Pairwise all-to-all over ``n`` ranks, ``ranks_per_node`` (g) of them on each node: each
    rank sends S/n to every peer at once, the ``(n - g) / n * S`` bound for other nodes
    through its own NIC share ``nic_bandwidth_bytes_per_s`` (the rank's NIC rate divided among
    the ranks that use it) and the ``(g - 1) / n * S`` for its node's peers over NVLink; the
    two run concurrently, so the slower one sets the time (each after NCCL's latency for
    n - 1 network or g - 1 NVLink steps; on the "nic" and "nvlink" curves when given; ``latency``:
    the network part's protocols, :data:`CALIBRATED` on a calibrated NIC class).

    2 nodes x 8 A100, one 25 GB/s HDR NIC per GPU, 1 GiB at line rate: 2^29 B through the NIC,
    21.475 ms, after the Simple ring latency 8.4 + 15 x 14 us = 218.4 us: 21.69 ms; busbw =
    15/16 * 2^30 / 21.69 ms = 46.4 GB/s (nccl-tests measured 37.8 on that machine, [S18]).

    >>> t = all_to_all_time(16, 2**30, 8, 25e9, 300e9)
    >>> round(t * 1e3, 2), round(15 / 16 * 2**30 / t / 1e9, 1)
    (21.69, 46.4)
    """
    if n <= 1 or size_bytes <= 0:
        return 0.0
    g = max(1, min(ranks_per_node, n))
    nic, nvl = curves.get("nic"), curves.get("nvlink")
    out = algorithm_time(size_bytes, (n - g) / n * size_bytes, n - 1, True, nic_bandwidth_bytes_per_s, latency,
                latency_scale, nic, steps(nic.op, nic.ranks) if nic else 0)
    if g > 1 and intra_bandwidth_bytes_per_s:
        out = max(out, algorithm_time(size_bytes, (g - 1) / n * size_bytes, g - 1, False, intra_bandwidth_bytes_per_s,
                             NCCL_RING, 1.0, nvl, steps(nvl.op, nvl.ranks) if nvl else 0))
    return out
