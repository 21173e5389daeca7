"""The nccl-tests text output of an all-to-all over 16 DGX-H100-like hosts x 8 GPUs (128 ranks),
tests/data/nccl/alltoall_perf_16x8h100.txt, for ``meshplan calibrate``'s all-to-all split (newcomer
25, item 2). Written, not captured: ``alltoall_perf -b 64K -e 8G -f 2 -g 1`` in the layout of
NVIDIA/nccl-tests src/util.cu (the all-reduce samples' layout: tests/test_calibration.py), redop
``none`` and root -1 as alltoall.cu prints them, from t = 250 us + (127/128) S / 37.8 GB/s, an
alpha-beta line whose busbw (algbw x (n - 1) / n, nccl-tests doc/PERFORMANCE.md) tends to
37.8 GB/s, the figure the newcomer's own 16-node run printed (37.81)."""

from __future__ import annotations

from pathlib import Path

from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_tests import float_str

FILE = Path(__file__).parent / "data" / "nccl" / "alltoall_perf_16x8h100.txt"
HOSTS, GPUS = 16, 8
ALPHA_S, BETA_BYTES_PER_S = 250e-6, 37.8e9
SIZES = [2**k for k in range(16, 34)]  # 64 KiB .. 8 GiB: count / 128 ranks is whole at every size
HEAD = "# " + "  ".join("{:>%d}" % w for w in (10, 12, 8, 6, 6, 7, 6, 6, 6, 7, 6, 6, 6)) + " "


def alltoall_text(hosts: int = HOSTS, gpus: int = GPUS) -> str:
    """The log over ``hosts`` x ``gpus`` ranks (default the fixture's 16 x 8)."""
    n = hosts * gpus
    lines = ["# nccl-tests version 2.17.6 nccl-headers=22703 nccl-library=22703",
             "# Collective test starting: alltoall_perf",
             f"# nThread 1 nGpus 1 minBytes {SIZES[0]} maxBytes {SIZES[-1]} step: 2(factor) warmup iters: 5 "
             "iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0", "#", "# Using devices"]
    for r in range(n):
        host, d = f"dgx-{r // gpus + 1:02d}", r % gpus
        lines.append(f"#  Rank {r:2d} Group {0:2d} Pid {41233 + 17 * d:6d} on {host:>10s} device {d:2d} "
                     f"[0000:{0x18 + 2 * d:02x}:00] NVIDIA H100 80GB HBM3")
    lines += ["#", HEAD.format("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time",
                               "algbw", "busbw", "#wrong"),
              HEAD.format("(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
                          "(GB/s)", "")]
    f, total = busbw_factor("all-to-all", n), 0.0
    for s in SIZES:
        t = ALPHA_S + f * s / BETA_BYTES_PER_S
        total += s / t * f / 1e9
        body = f"  {float_str(t * 1e6, 7)}  {float_str(s / t / 1e9, 6)}  {float_str(s / t * f / 1e9, 6)}  {0:6g}"
        lines.append(f"{s:12d}  {s // 4:12d}  {'float':>8s}  {'none':>6s}  {-1:6d}" + body + body)
    lines += ["# Out of bounds values : 0 OK", f"# Avg bus bandwidth    : {total / len(SIZES):g} ", "#",
              "# Collective test concluded: alltoall_perf", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # rewrite the fixture
    FILE.write_text(alltoall_text())
