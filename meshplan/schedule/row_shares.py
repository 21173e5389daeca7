"""What one collective-table row holds of the rank's hardware while it runs, as the rank
timeline shares it out (:meth:`meshplan.schedule.comm_times.CommTimes.from_rows`): the share of a
NIC (:func:`nic_share`) and the share of the GPU's SMs its NCCL kernel takes (:func:`nccl_sm_share`).
"""

from __future__ import annotations


def nic_share(row) -> float:
    """Share of a NIC that collective-table ``row`` holds while it runs: the bytes one call puts
    through the busiest NIC its members send by, at the rank's share of that NIC's line rate
    (``path.nic_bandwidth_bytes_per_s``: the NIC's rate over the axis's ranks on it, :func:`~meshplan.comm.row.groups_path`),
    over the call's time, at most 1. The bytes: a send/recv's whole message (the member whose
    peer is on another node sends it all through its NIC, and the ring or pipeline waits for that
    member), any other row's network part of :attr:`~meshplan.comm.row.CollectiveRow.link_bytes`
    (a ring's ``sent / g``: with one NCCL channel leaving by each GPU's NIC, each member's NIC
    carries 1/g of the node's ring bytes). 0 for a row that stays on NVLink or inside the GPU; a
    latency-bound call holds little. Each collective is taken at its own busiest NIC, so two rows
    whose busiest NICs differ are counted as sharing one (rail-aligned nodes, one NIC per GPU:
    a ring crosses every member's NIC, so it meets any other row's busiest).

    An all-gather over 16 ranks on 2 nodes (8 a node) of 1.6 GB in 10 ms, 200 Gb/s NICs: each
    rank's NIC carries 15/16 x 1.6 GB / 8 = 187.5 MB, 7.5 ms at 25 GB/s: 0.75 of the NIC.

    >>> from types import SimpleNamespace as R
    >>> path = R(kind="network", nic_bandwidth_bytes_per_s=25e9, bandwidth_bytes_per_s=200e9)
    >>> nic_share(R(path=path, op="all-gather", split=None, size_bytes=1.6e9, time_s=0.01, link_bytes=(0.0, 1.875e8)))
    0.75
    """
    if row.path.kind != "network" or row.time_s <= 0:
        return 0.0
    rate = row.path.nic_bandwidth_bytes_per_s or row.path.bandwidth_bytes_per_s
    through = row.size_bytes if row.op == "send/recv" and row.split is None else row.link_bytes[1]
    return min(1.0, through / rate / row.time_s) if rate > 0 else 0.0


def nccl_sm_share(cluster):
    """row -> fraction of ``cluster.gpu``'s SMs the row's NCCL kernel holds while it runs:
    ``fabric.nccl_channels / gpu.sms`` for collectives on the node's GPU fabric (path
    ``nvlink``), 0 for the rest (NIC paths: channel counts not in the catalog) and where the
    catalog gives no channel count. NCCL runs one thread block per channel, each resident on
    one SM for the whole collective (NVIDIA/nccl-tests issue #100: 24 channels on an HGX A100,
    108 SMs: 22%)."""
    f = cluster.node.fabric.nccl_channels / cluster.gpu.sms
    return lambda row: f if row.path.kind == "nvlink" else 0.0
