"""Write plausible (INVENTED) nccl-tests logs in nccl-tests 2.18 text format for a DGX H100 cluster.
alpha-beta: time_us = alpha + S_eff / bw, where S_eff is the bytes the busbw formula implies per rank."""
import sys
BDF = ["0000:18:00", "0000:2a:00", "0000:3a:00", "0000:5d:00", "0000:9a:00", "0000:ab:00", "0000:ba:00", "0000:db:00"]

def fmt_time(t):
    return f"{t:7.0f}" if t >= 10000 else (f"{t:7.1f}" if t >= 100 else f"{t:7.2f}")

def write(path, test, nnodes, alpha_us, busbw_peak, minb=1024, maxb=4 << 30):
    n = nnodes * 8
    op = {"all_gather_perf": "none", "reduce_scatter_perf": "sum", "alltoall_perf": "none"}[test]
    L = []
    L.append("# nccl-tests version 2.18.3 nccl-headers=22703 nccl-library=22703")
    L.append(f"# Collective test starting: {test}")
    L.append(f"# nThread 1 nGpus 1 minBytes {minb} maxBytes {maxb} step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0 unalign: 0")
    L.append("#")
    L.append("# Using devices")
    for r in range(n):
        host = f"gpu-{r // 8 + 1:03d}"
        L.append(f"#  Rank {r:2d} Group  0 Pid {40000 + r:6d} on {host:>10s} device  {r % 8} [{BDF[r % 8]}] NVIDIA H100 80GB HBM3")
    L.append("#")
    L.append("#                                                              out-of-place                       in-place          ")
    L.append("#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong ")
    L.append("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         ")
    s = minb
    tot = 0.0; k = 0
    while s <= maxb:
        count = s // 4 // n
        size = count * 4 * n
        f = (n - 1) / n
        t = alpha_us + size * f / (busbw_peak * 1e3)
        t2 = t * 1.01
        alg, alg2 = size / t / 1e3, size / t2 / 1e3
        bus, bus2 = alg * f, alg2 * f
        L.append(f"{size:12d}  {count:12d}  {'float':>8s}  {op:>6s}  {-1:6d}  {fmt_time(t)}  {alg:6.2f}  {bus:6.2f}  {0:6d}  {fmt_time(t2)}  {alg2:6.2f}  {bus2:6.2f}  {0:6d}")
        tot += bus; k += 1
        s *= 2
    L.append("# Out of bounds values : 0 OK")
    L.append(f"# Avg bus bandwidth    : {tot / k:.4f} ")
    L.append("#")
    L.append(f"# Collective test concluded: {test}")
    L.append("")
    open(path, "w").write("\n".join(L))

d = sys.argv[1]
# 1 node (NVLink 4): invented busbw peaks close to public DGX H100 figures
write(f"{d}/ag_1n.txt", "all_gather_perf", 1, 12.0, 360.0)
write(f"{d}/rs_1n.txt", "reduce_scatter_perf", 1, 12.0, 355.0)
write(f"{d}/a2a_1n.txt", "alltoall_perf", 1, 15.0, 330.0)
# 8 nodes x 8 GPUs over 8 x 400 Gb/s NDR
write(f"{d}/ag_8n.txt", "all_gather_perf", 8, 40.0, 350.0)
write(f"{d}/rs_8n.txt", "reduce_scatter_perf", 8, 40.0, 340.0)
write(f"{d}/a2a_8n.txt", "alltoall_perf", 8, 60.0, 33.0)
