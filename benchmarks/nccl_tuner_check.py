"""The comm model against nccl-tests and against NCCL's own tuner model (issue 11).

For each collective size class of the development set (benchmarks/fidelity.py: Megatron 22B
and 175B on DGX A100; TP all-reduce / reduce-scatter / all-gather over 8 GPUs on NVSwitch,
pp send/recv and the embedding all-reduce across nodes) and for the small-message and
2-node rows of public-microbenchmarks.md 4b, one line: size, link, the measured busbw (S15
and S3 for the 8-GPU all-reduce, linear in S between their sizes as the model reads its own
curve; S18 for the rest), meshplan's busbw (:func:`meshplan.comm.nccl_algorithms.collective_time`
on the dgx-a100 curves) and NCCL's tuner model with the protocol it picks.

NCCL's tuner model (NVIDIA/nccl src/graph/tuning.cc at 5067397, v2.30.7;
public-microbenchmarks.md 4e [S20]): per algorithm a and protocol p,
``time_us = lat[a][p] + S / (1000 * algbw[a][p])``, the fastest (a, p) wins
(``ncclTopoGetAlgoTime``). Its inputs besides the constants of :data:`TUNER`: the
topology search's channels and per-channel bandwidth. On one DGX A100: 12 channels of
20 GB/s (src/graph/topo.h ``SM80_NVLINK_BW`` 20.0 per NVLink x 12 NVLinks = 240 GB/s;
src/graph/search.cc ``speedArrayIntra``: 20 is the first speed whose 12 channels fill 240).
Across DGX A100 nodes (8 HDR NICs of 25 GB/s): 8 channels of 24 GB/s (D, assumed: one
channel per NIC, 24 the first ``speedArrayInter`` entry under the NIC's 25 GB/s); AMD CPUs
(llMaxBws row 1, net overhead 2 us); the IB plugin's ``latencyInter`` 0.

What it showed (2026-12-04, issue 11's "LL's latency with Simple's measured bandwidth, the tree
at the ring's bandwidth"):

- At a curve's own rank count the latency meshplan adds is the one it takes off the
  measurement, so the protocol behind it cancels: every dev-set collective (tp over 8 GPUs on
  the 8-GPU curve, pp send/recv and the embedding all-reduce on the 2-rank curves) is the
  measured curve itself, beside the other sweep S3 (since 2026-12-06 the curve holds all 20 of
  S15's rows: 96 MiB 175.1 GB/s, 48 MiB 158.9, 7.1 MB 100.5, 3.5 MB 60.8; S3 with all 24 of its
  rows since 2026-12-07: 171.6, 153.6, 86.0, 67.3, where its 9 quoted rows read 184.8, 157.4,
  88.2, 67.4). NCCL's tuner model's times are 21-33% shorter than both at 3.5-100 MB (a selection
  model, not a time model): no reason to take its bandwidths.
- Small messages: NCCL runs LL there and its LL latency is the right one (1 KB all-reduce over
  8 A100: meshplan 15.9 us, S18 16.96, tuner 15.0).
- Away from the curve's rank count (ZeRO-3, 384-1,536 ranks) the pairing matters: with Simple's
  latency on every ring step the 1,536-GPU ZeRO-3 step goes from 43.5 to 61.8 s. NCCL's own
  model charges the network latency only on the 2(nodes-1) inter-node steps; meshplan's LL
  latency on every step lands within 3-8% of it for the ZeRO-3 all-gathers (rows below), the
  Simple one would be about 4x over it. The tree at the ring's bandwidth: NCCL caps the tree at
  17.8 GB/s per channel against the ring's 24 beyond 2 Ampere nodes; meshplan's 1.2 GB
  all-reduce over 1,536 GPUs is 24% under the tuner's (13.2 against 17.2 ms). Neither has a
  measurement at those rank counts to decide it; taking the tuner's tree ratio moves the ZeRO-3
  steps 59.0 / 39.5 / 43.5 s to 59.0 / 39.8 / 44.7 s and nothing in fidelity.py or
  torchtitan_h100.py.
- Not the dev set: over 2 x 8 A100 a 1 KB all-gather is timed on the hierarchical algorithm at
  20.6 us against S18's 33.74 (NCCL 2.30.7 runs it on the ring there: tuning.cc takes PAT only
  with one GPU a node, NVLS and CollNet only with a SHARP network; tuner 37.3 us); no benchmark
  here moves if it is left out.

This is a diagnostic: nothing here feeds the model. Run:
PYTHONPATH=. .venv/bin/python benchmarks/nccl_tuner_check.py
"""

from __future__ import annotations

import math

from meshplan.catalog import busbw_curve
from meshplan.comm.alphabeta import busbw_factor
from meshplan.comm.nccl_algorithms import collective_time

#: NCCL tuning.cc @5067397 defaults, Ampere (protocol order LL, LL128, Simple); us and GB/s.
TUNER = {
    "base": {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)},
    "nvlink": {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)},
    "net": {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)},
    "ll_max_bw": {1: 87.7, 2: 22.5, 4: 19.0},  # llMaxBws: Ampere N1; AMD N2, N4
    "ring_ll128_per_ch": 20.0, "tree_ll128_per_ch": 20.0,  # perChMaxRingLL128Bws, perChMaxTreeLL128Bws Ampere
    "tree_per_ch": {1: 24.0, 2: 23.6, 4: 17.8},  # perChMaxTreeBws Ampere N1 / N2 / N4
    "net_overhead_us": 2.0,  # getNetOverhead, AMD x86 (x3 for Simple)
    "tree_correction": (  # treeCorrectionFactor[protocol][log2(S / 64)]
        (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
        (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
        (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9)),
}
PROTOS = ("LL", "LL128", "Simple")


def _algbw(algo: str, p: int, op: str, n: int, nodes: int, n_ch: int, bw_ch: float) -> float:
    """tuning.cc ``bandwidths[coll][a][p]`` (GB/s, algbw) for ring / tree on Ampere."""
    key = 1 if nodes == 1 else (2 if nodes == 2 else 4)
    bus = n_ch * bw_ch
    if algo == "ring":
        bus = (min(TUNER["ll_max_bw"][key], bus * .5) if p == 0 else
               min(bus * .92, n_ch * TUNER["ring_ll128_per_ch"]) if p == 1 else bus)
        return bus * n / (2 * (n - 1) if op == "all-reduce" else n - 1)
    bus = min(bus * .92, n_ch * TUNER["tree_per_ch"][key])
    bus = (min(bus / 3.8, TUNER["ll_max_bw"][key]) if p == 0 else
           min(bus * (7 / 9 if nodes == 1 else 120 / 128), n_ch * TUNER["tree_ll128_per_ch"]) if p == 1 else bus)
    return bus * .5


def _latency_us(algo: str, p: int, op: str, n: int, nodes: int) -> float:
    """tuning.cc ``latencies[coll][a][p]``: base + per-step hardware latencies, only the
    inter-node steps at the network's."""
    base, intra = TUNER["base"][algo][p], TUNER["nvlink"][algo][p]
    inter, ppn = TUNER["net"][algo][p], n // nodes
    if algo == "tree":
        return base + 2 * ((ppn - 1) * intra + int(math.log2(nodes)) * inter)
    steps = 2 * (n - 1) if op == "all-reduce" else n - 1
    inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if op == "all-reduce" else nodes - 1)
    if nodes > 1:
        intra = max(intra, TUNER["net_overhead_us"] * (3 if p == 2 else 1))
    return base + (steps - inter_steps) * intra + inter_steps * inter


def tuner(op: str, n: int, nodes: int, size_bytes: float, n_ch: int, bw_ch: float) -> tuple[str, float]:
    """("algo/proto", seconds) of NCCL's fastest choice (``ncclTopoGetAlgoTime``)."""
    best = ("", math.inf)
    for algo in ("ring", "tree") if op == "all-reduce" else ("ring",):
        for p in range(3):
            lat, bw = _latency_us(algo, p, op, n, nodes), _algbw(algo, p, op, n, nodes, n_ch, bw_ch)
            log = int(math.log2(max(size_bytes // 64, 1)))
            if algo == "tree" and log < 23:
                bw *= TUNER["tree_correction"][p][log]
            if algo == "ring" and p == 2 and nodes > 1 and op == "all-reduce":
                lat *= 1.4  # "Plateau effect of ring", sm80+
            t = (lat + size_bytes / (1000 * bw)) * 1e-6
            if t < best[1]:
                best = (f"{algo}/{PROTOS[p]}", t)
    return best


#: [S3] Azure A100 nccl-tests all_reduce, NCCL 2.18.5 (Azure/AI-benchmarking-guide @3bb66ca
#: Azure_Results/ND_A100_v4_results.md, in-place busbw, fp32): the second 8x A100 sweep, against
#: which the catalog's S15 curve's spread is read. Every row of its table (1K .. 8G, doubling; the
#: table writes 2^17 as "132K"); until 2026-12-07 this held the 9 that public-microbenchmarks.md 4a
#: quotes, so 96 MiB was read on 64M -> 256M (184.8 GB/s) where the 128M row (174.18) gives 171.6.
S3_A100 = {2**10: 0.04, 2**11: 0.08, 2**12: 0.17, 2**13: 0.33, 2**14: 0.67, 2**15: 1.37, 2**16: 2.70,
           2**17: 5.15, 2**18: 10.11, 2**19: 19.24, 2**20: 36.22, 2**21: 53.54, 2**22: 71.43, 2**23: 89.99,
           2**24: 109.22, 2**25: 132.77, 2**26: 166.63, 2**27: 174.18, 2**28: 213.87, 2**29: 221.58,
           2**30: 228.10, 2**31: 230.22, 2**32: 230.48, 2**33: 231.58}


def measured_busbw(points: dict, size_bytes: float, op: str = "all-reduce", n: int = 8) -> float:
    """busbw (GB/s) read from ``points`` (size -> busbw) linear in S in time between sizes."""
    f, xs = busbw_factor(op, n), sorted(points)
    k = max(0, min(len(xs) - 2, sum(1 for x in xs if x <= size_bytes) - 1))
    t0, t1 = (f * xs[i] / points[xs[i]] for i in (k, k + 1))
    t = t0 + (t1 - t0) * (size_bytes - xs[k]) / (xs[k + 1] - xs[k])
    return f * size_bytes / t


CURVES = {"nvlink": busbw_curve("a100-nvlink3-ring"), "nic": busbw_curve("ib-hdr-200-8nic"),
          "p2p": busbw_curve("ib-hdr-200-1nic-pair"), "nic1": busbw_curve("ib-hdr-200-1nic-ring")}
S15 = dict(zip(CURVES["nvlink"].sizes_bytes, CURVES["nvlink"].busbw_gb_per_s))

#: (what, op, ranks, nodes, size_bytes, measured busbw or None and its source)
ROWS = (
    ("D1/D2 22B tp AR/RS/AG", "all-reduce", 8, 1, 100663296, "S15|S3"),
    ("D3/D4 175B tp AR/RS/AG", "all-reduce", 8, 1, 50331648, "S15|S3"),
    ("D2 22B tp AR (grads)", "all-reduce", 8, 1, 7127040, "S15|S3"),
    ("D4 175B tp AR (grads)", "all-reduce", 8, 1, 3538944, "S15|S3"),
    ("22B tp AR (small)", "all-reduce", 8, 1, 32768, "S15|S3"),
    ("22B SP tp RS/AG", "all-gather", 8, 1, 100663296, None),
    ("S18 1 node 1 KB AR", "all-reduce", 8, 1, 1024, ("S18 16.96 us", 1.75 * 1024 / 16.96e3)),
    ("S18 1 node 1 KB AG", "all-gather", 8, 1, 1024, ("S18 12.53 us", .875 * 1024 / 12.53e3)),
    ("S18 1 node 1 GB AR", "all-reduce", 8, 1, 2**30, ("S18", 231.45)),
    ("S18 1 node 1 GB AG", "all-gather", 8, 1, 2**30, ("S18", 253.59)),
    ("S18 2x8 1 KB AR", "all-reduce", 16, 2, 1024, ("S18 35.85 us", 1.875 * 1024 / 35.85e3)),
    ("S18 2x8 1 KB AG", "all-gather", 16, 2, 1024, ("S18 33.74 us", .9375 * 1024 / 33.74e3)),
    ("S18 2x8 1 GB AR", "all-reduce", 16, 2, 2**30, ("S18", 183.82)),
    ("S18 2x8 1 GB AG", "all-gather", 16, 2, 2**30, ("S18", 177.05)),
    ("ZeRO-3 384 dp AG", "all-gather", 384, 48, 301989888, None),
    ("ZeRO-3 1536 dp AG", "all-gather", 1536, 192, 301989888, None),
    ("ZeRO-3 1536 dp AR", "all-reduce", 1536, 192, 1207959552, None),
)


def model_row(op: str, n: int, nodes: int, size: float) -> tuple[str, float]:
    """meshplan's (algorithm, seconds) on a dgx-a100 path: NVLink 300 GB/s inside a node,
    the node's 8 NICs (200 GB/s) for a group of 8 ranks a node across nodes; above 2 nodes
    (the ZeRO-3 rows) with ``nccl_era`` "2021", as benchmarks/zero3_sc21.py plans them."""
    if nodes == 1:
        return collective_time(op, n, size, 300e9, "nvlink", curves=CURVES)
    return collective_time(op, n, size, 200e9, "network", nodes=nodes, intra_bandwidth_bytes_per_s=300e9,
                           curves=CURVES, ranks_per_node=n // nodes, nic_bandwidth_bytes_per_s=25e9,
                           nccl_era="2021" if nodes > 2 else "current")


def main() -> None:
    print(f"{'row':24s} {'op':10s} {'n':>5s} {'size (B)':>11s} {'measured busbw':>22s} {'meshplan':>27s} "
          f"{'NCCL tuner':>31s}")
    for what, op, n, nodes, size, meas in ROWS:
        if meas == "S15|S3":
            m = f"{measured_busbw(S15, size):6.2f} | {measured_busbw(S3_A100, size):6.2f} (S3)"
        else:
            m = "-" if meas is None else f"{meas[1]:6.2f} ({meas[0]})"
        algo, t = model_row(op, n, nodes, size)
        talgo, tt = tuner(op, n, nodes, size, 12 if nodes == 1 else 8, 20.0 if nodes == 1 else 24.0)
        f = busbw_factor(op, n)
        print(f"{what:24s} {op:10s} {n:5d} {size:11d} {m:>22s} {f * size / t / 1e9:7.2f} {t * 1e6:8.1f} "
              f"{algo[:10]:>10s} {f * size / tt / 1e9:7.2f} {tt * 1e6:8.1f} {talgo:>14s}")
    print("busbw in GB/s (nccl-tests: algbw x busbw factor), then time (us) and algorithm; meshplan: "
          "collective_time on the dgx-a100 curves; NCCL tuner: tuning.cc @5067397 with the channels of the module "
          "docstring")


if __name__ == "__main__":
    main()
