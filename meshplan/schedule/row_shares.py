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


#: NCCL @5067397 src/graph/paths.cc:918: NCCL_P2P_PER_CHANNEL_NET_BW, GB/s one send/recv channel
#: to a remote peer is sized for (default 14).
P2P_PER_CHANNEL_NET_GB_PER_S = 14.0
#: NCCL @5067397 src/graph/connect.cc:476 (``bwIntra > 45.0``): the inter-node ring speed above
#: which sm90+ doubles fewer than 16 channels; search.cc:1057 sm90SpeedArrayInter's 48 GB/s is
#: the one above it, picked for a NIC of 48 GB/s or more (NDR 400 Gb/s: 50 GB/s).
SM90_DOUBLING_NIC_GB_PER_S = 48.0


def nccl_net_channels(cluster) -> tuple[int, int]:
    """(ring channels, send/recv channels per peer) NCCL runs over the network on
    ``cluster``'s node, each one thread block of the collective's kernel (the proxy thread drives
    the NIC; the block copies or reduces between the user buffers and the network staging
    buffers), read from NVIDIA/nccl @5067397:

    - rings: the topology search lays one ring per NIC (src/graph/search.cc:827 ``NET n -> GPU a
      -> .. -> NET n``, stopping once channels x speed reach the GPU's bandwidth, :1185), the
      communicator doubles them (src/graph/connect.cc:457 ``nChannels * 2``), and on sm90+ with
      a NIC of 48 GB/s or more doubles fewer than 16 again (connect.cc:475-478); a large
      collective uses them all (src/enqueue.cc:2093 drops channels only while ``nBytes < nc x
      threads x threshold``). ``2 x NICs``, x2 on that rule, at most MAXCHANNELS 64
      (src/include/device.h:91). NCCL_MIN/MAX_NCHANNELS (connect.cc:331) are taken as unset.
    - send/recv to a remote peer: ``max(local NICs, ceil(NIC GB/s / 14))`` rounded up to a
      power of 2 (src/graph/paths.cc:943-950, 989), all of them for a large message
      (src/enqueue.cc:921-926).

    DGX H100 (8 NDR NICs, 50 GB/s): rings 2 x 8 = 16, send/recv ceil(50 / 14) = 4. A 4-NIC
    A100 node (HDR, 25 GB/s, sm80): rings 2 x 4 = 8, send/recv ceil(25 / 14) = 2.

    >>> from types import SimpleNamespace as R
    >>> ndr = [R(rate_gbit_per_s=400.0, gpus=[k]) for k in range(8)]
    >>> nccl_net_channels(R(node=R(nics=ndr), gpu=R(cuda_sm=90)))
    (16, 4)
    >>> nccl_net_channels(R(node=R(nics=ndr[:4]), gpu=R(cuda_sm=90)))
    (16, 4)
    >>> hdr = [R(rate_gbit_per_s=200.0, gpus=[2 * k, 2 * k + 1]) for k in range(4)]
    >>> nccl_net_channels(R(node=R(nics=hdr), gpu=R(cuda_sm=80)))
    (8, 2)
    """
    nics = cluster.node.nics
    if not nics:
        return 0, 0
    gb = max(n.rate_gbit_per_s for n in nics) / 8  # NIC line rate, GB/s
    rings = 2 * len(nics)
    if cluster.gpu.cuda_sm >= 90 and gb >= SM90_DOUBLING_NIC_GB_PER_S and rings < 16:
        rings *= 2
    local = max(1, sum(1 for n in nics if 0 in n.gpus))
    per_peer = max(local, -(-int(gb) // int(P2P_PER_CHANNEL_NET_GB_PER_S)))
    return min(64, rings), 1 << (per_peer - 1).bit_length()


def nccl_sm_share(cluster):
    """row -> fraction of ``cluster.gpu``'s SMs the row's NCCL kernel holds while it runs: NCCL
    runs one thread block per channel, each resident on one SM for the whole collective
    (NVIDIA/nccl-tests issue #100: 24 channels on an HGX A100, 108 SMs: 22%). On the node's GPU
    fabric (path ``nvlink``) ``fabric.nccl_channels / gpu.sms`` (0 where the catalog gives no
    count); over the network the channels of :func:`nccl_net_channels` (rings; a send/recv's
    per-peer channels) over ``gpu.sms``: DGX H100 16 / 132 = 12.1%, a send/recv 4 / 132 = 3.0%;
    0 inside the GPU."""
    sms = cluster.gpu.sms
    f = cluster.node.fabric.nccl_channels / sms
    ring, p2p = (c / sms for c in nccl_net_channels(cluster))

    def share(row) -> float:
        if row.path.kind == "nvlink":
            return f
        if row.path.kind == "network":
            return p2p if row.op == "send/recv" else ring
        return 0.0
    return share
