"""nccl-tests text outputs written from published rows (shared/reference/public-microbenchmarks.md
section 4), for ``meshplan calibrate``'s tests: tests/data/nccl/*_s15.txt, *_s3.txt, *_s18.txt.
Each row's time is derived from the published busbw (nccl-tests doc/PERFORMANCE.md:
t = busbw_factor * S / busbw, algbw = S / t) and printed with nccl-tests' column widths and
rounding (src/util.cu, getFloatStr); in-place columns repeat the out-of-place ones."""

from __future__ import annotations

from pathlib import Path

from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_protocols import REFERENCE_STEP_S
from meshplan.comm.nccl_tests import float_str
from meshplan.comm.row import Path as CommPath

DATA = Path(__file__).parent / "data" / "nccl"
K, M, G = 2**10, 2**20, 2**30
#: name -> (program, hosts (one per rank), GPU, published rows (size B, busbw GB/s), source)
PUBLISHED = {
    "all_reduce_perf_8xa100_s15.txt": (
        "all_reduce_perf", ["dgx-a100-01"] * 8, "NVIDIA A100-SXM4-80GB",
        [(32 * K, 1.31), (M, 18.0), (4 * M, 72.3), (8 * M, 109.9), (32 * M, 138.5), (128 * M, 176.9),
         (512 * M, 222.7), (G, 229.0), (16 * G, 234.9)], "S15 (stas00/ml-engineering network README)"),
    "all_reduce_perf_8xh200_s3.txt": (
        "all_reduce_perf", ["nd-h200-v5-0"] * 8, "NVIDIA H200",
        [(K, 0.06), (64 * K, 3.72), (M, 52.96), (4 * M, 138.44), (16 * M, 240.41), (64 * M, 368.11),
         (256 * M, 432.24), (G, 467.58), (8 * G, 479.98)], "S3 (Azure ND H200 v5, NCCL 2.20.5, NVLS)"),
    "all_reduce_perf_2x8a100_s18.txt": (
        "all_reduce_perf", ["ndmv4-0"] * 8 + ["ndmv4-1"] * 8, "NVIDIA A100-SXM4-80GB",
        [(K, 1.875 * K / 35.85e-6 / 1e9), (G, 183.82), (4 * G, 188.18)],
        "S18 (mscclpp docs/performance-ndmv4.md, 1 KB: 35.85 us)"),
    "all_reduce_perf_2x1a100_s18.txt": (
        "all_reduce_perf", ["ndmv4-0", "ndmv4-1"], "NVIDIA A100-SXM4-80GB", [(G, 18.65)],
        "S18 (2 nodes x 1 GPU)"),
}
HEAD = "# " + "  ".join("{:>%d}" % w for w in (10, 12, 8, 6, 6, 7, 6, 6, 6, 7, 6, 6, 6)) + " "


def published_text(program: str, hosts: list[str], gpu: str, rows, source: str) -> str:
    """nccl-tests stdout (one process per GPU) for ``rows`` of (size, busbw GB/s)."""
    op, n = "all-reduce", len(hosts)
    lines = [f"# written by tests/nccl_published.py from {source}",
             "# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703",
             f"# Collective test starting: {program}",
             f"# nThread 1 nGpus 1 minBytes {rows[0][0]} maxBytes {rows[-1][0]} step: 2(factor) warmup iters: 5 "
             "iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0", "#", "# Using devices"]
    local: dict[str, int] = {}
    for r, h in enumerate(hosts):
        d = local[h] = local.get(h, -1) + 1
        lines.append(f"#  Rank {r:2d} Group {0:2d} Pid {41233 + 17 * r:6d} on {h:>10s} device {d:2d} "
                     f"[0000:{0x18 + 2 * d:02x}:00] {gpu}")
    lines += ["#", HEAD.format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                               "algbw", "busbw", "#wrong"),
              HEAD.format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                          "(GB/s)", "")]
    for size, bus in rows:
        t = busbw_factor(op, n) * size / (bus * 1e9)
        body = f"  {float_str(t * 1e6, 7)}  {float_str(size / t / 1e9, 6)}  {float_str(bus, 6)}  {0:6g}"
        lines.append(f"{size:12d}  {size // 4:12d}  {'float':>8s}  {'sum':>6s}  {-1:6d}" + body + body)
    lines += ["# Out of bounds values : 0 OK", f"# Collective test concluded: {program}", ""]
    return "\n".join(lines)


def nic_path(cluster, nodes: int, per_node: int) -> CommPath:
    """The path :func:`meshplan.comm.row.axis_path` gives a group of ``nodes`` x ``per_node`` ranks of
    ``cluster``, each rank on its own NIC, every group of the axis at once: per rank min(fabric, the
    node's NICs the groups use / the groups on the node) = min(fabric, ``per_node`` x NIC); a rank's
    own NIC for all-to-all's cross-node bytes; the network tier's latency and calibration."""
    nic = cluster.node.nics[0].bandwidth_bytes_per_s
    return CommPath("network", min(cluster.node.fabric.bandwidth_bytes_per_s, per_node * nic), f"{nodes} nodes",
                    cluster.network[0].latency_s / REFERENCE_STEP_S["network"], nodes=nodes, ranks_per_node=per_node,
                    nic_bandwidth_bytes_per_s=nic, calibrated=cluster.network[0].calibrated)


def ndr_ring_s(n: int, nics: int, size_bytes: float) -> float:
    """By hand, seconds of an uncalibrated ring all-gather or reduce-scatter across the nodes whose
    NIC curve is the NDR 8-NIC one (dgx-h100, dgx-h200: catalog nodes.toml) (``n`` ranks, their ring through ``nics`` of a node's 50 GB/s NICs: the path's bandwidth / 50 GB/s)
    of a ``size_bytes`` buffer (nccl-tests S). The catalog's one point of the 8-NIC curve
    (ib-ndr-400-8nic, S19: all-reduce over 2 x 8 ranks, busbw 376 GB/s at 8 GiB, t = 1.875 x 2^33 /
    376e9 = 42,835.4 us), below which the time runs linearly from NCCL's LL latency for its 30 steps
    (6.6 + 30 x 2.7 = 87.6 us): 1.875 x 2^33 / (42,835.4 - 87.6 us) / 8 = 47.10 GB/s per NIC, whatever
    size it is read at (tests/test_calibrate_nic_share.py). The ring: LL's 6.6 + (n - 1) x 2.7 us, then
    (n - 1) / n x S through ``nics`` x 47.10 GB/s."""
    per_nic = 1.875 * 2**33 / (1.875 * 2**33 / 376e9 - 87.6e-6) / 8
    return (6.6 + (n - 1) * 2.7) * 1e-6 + (n - 1) / n * size_bytes / (nics * per_nic)


def h100_nvlink_s(op: str, n: int, size_bytes: float) -> float:
    """By hand, seconds of an uncalibrated ring ``op`` ("all-gather", "reduce-scatter" or
    "send/recv") over ``n`` ranks inside a dgx-h100 (NVLink 450 GB/s, the catalog's
    h100-nvlink4-ring curve at its own line rate) of a ``size_bytes`` buffer from 1 MiB to 8 GiB.
    The curve's all-reduce rows over 8 ranks, t = 1.75 S / busbw: 64K 1.75 x 65,536 / 2.72e9 =
    42.17 us (the 1M row's 1.75 x 1,048,576 / 43.70e9 = 41.99 us raised to it: a larger buffer is
    never faster), 8G 1.75 x 2^33 / 368e9 = 40,848.9 us, linear in S between 1 MiB and 8 GiB; less
    the curve's own latency, LL's 6.6 + 14 x 0.6 = 15.0 us (14 ring steps), its bandwidth term
    carries 1.75 S. The op: LL's 6.6 + k x 0.6 us (k = n - 1 steps, 1 for send/recv), then its bytes
    sent, (n - 1) / n x S (S for send/recv), at that term's rate."""
    t1, t8 = max(1.75 * M / 43.70e9, 1.75 * 64 * K / 2.72e9), 1.75 * 8 * G / 368e9
    spent = t1 + (t8 - t1) * (size_bytes - M) / (8 * G - M) - 15.0e-6
    k, sent = (1, 1.0) if op == "send/recv" else (n - 1, (n - 1) / n)
    return (6.6 + k * 0.6) * 1e-6 + sent * spent / 1.75


if __name__ == "__main__":  # rewrite the fixtures
    for name, spec in PUBLISHED.items():
        (DATA / name).write_text(published_text(*spec))
