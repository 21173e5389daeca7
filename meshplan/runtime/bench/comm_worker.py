"""The per-rank half of ``meshplan bench comm``: run under torchrun, time collectives and
pairwise send/recv with torch.distributed, and let rank 0 write ``raw.json``.

Launched by :func:`meshplan.runtime.bench.comm.run_bench` as::

    torchrun --standalone --nproc-per-node N -m meshplan.runtime.bench.comm_worker \\
        --out DIR --sizes 1024,2048,... [--iters 5 --warmup 1 --budget-s 0.2 --pair-size B]

Backend gloo on CPU tensors, nccl on ``cuda:LOCAL_RANK`` when CUDA is present. Timing
follows nccl-tests (src/common.cu) with one change: ``warmup`` untimed calls, then
``iters`` calls, each timed on its own (clock reads around the call and a device
synchronize); the time column is the fastest call per rank, averaged over the group's
ranks (nccl-tests' default ``-a 1``). nccl-tests divides one clock interval by ``iters``
(a mean); on an oversubscribed CPU host (4 ranks on 2 cores, other jobs) single calls stall
for milliseconds on scheduling. Measured on such a host (three 4-rank runs, 4 KiB-1 MiB):
rms fit residuals 0.13-0.42 with the fastest call against 0.21-0.54 with median or mean,
and one median-based all-reduce fit in six had a non-positive slope. ``raw.json`` keeps
min, median and mean. ``iters`` is cut so that one size takes about ``budget_s`` (the
slowest rank's warm-up call decides, so every rank runs the same count). After the timed
calls one call on known values counts wrong elements (nccl-tests' ``#wrong``).

Groups (:func:`meshplan.runtime.bench.comm.bench_groups`): the ranks of node 0 (link class
``nvlink``, the node's fabric; on a CPU machine loopback TCP) and, when there are several
nodes (netns testbed), for each NIC one rank per node on it (``nic``). On the testbed each
rank first takes NIC ``LOCAL_RANK mod K`` (:func:`meshplan.runtime.testbed.nics.apply_local_nic`:
``GLOO_SOCKET_IFNAME`` and the bound source address, before any process group). Pairs: for
every i < j in turn, a ping-pong of ``pair_size`` bytes; one-way time = fastest round trip / 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from meshplan.atomic_write import write_json_atomic
from meshplan.runtime.bench.comm import bench_groups, chunked
from meshplan.runtime.bench.comm_results import BENCH_OPS
from meshplan.runtime.testbed.nics import apply_local_nic

STATS = {"min": min, "median": statistics.median, "mean": statistics.fmean}
STAT = "min"        # the time column; raw.json keeps all three


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_buffers(op: str, count: int, n: int, idx: int, device) -> tuple:
    """(input, output, expected output) of ``op`` over ``n`` ranks for group member ``idx``;
    ``count`` float32 elements in the full buffer (nccl-tests' size / 4). Values are small
    integers, exact in fp32."""
    per = count // n
    f = dict(dtype=torch.float32, device=device)
    if op == "all-reduce":
        return torch.full((count,), idx + 1.0, **f), None, torch.full((count,), n * (n + 1) / 2, **f)
    if op == "all-gather":
        want = torch.arange(n, **f).repeat_interleave(per) + 1
        return torch.full((per,), idx + 1.0, **f), torch.empty(count, **f), want
    if op == "reduce-scatter":
        return torch.full((count,), idx + 1.0, **f), torch.empty(per, **f), torch.full((per,), n * (n + 1) / 2, **f)
    src = torch.arange(n, **f).repeat_interleave(per)        # all-to-all: chunk j to rank j holds idx*n + j
    return src + idx * n, torch.empty(count, **f), torch.arange(n, **f).repeat_interleave(per) * n + idx


def collective_call(op: str, inp, out, group):
    """A no-argument callable that issues one ``op`` (all-reduce, all-gather, reduce-scatter,
    else all-to-all) on ``group`` with the buffers of :func:`collective_buffers` (``inp``,
    ``out``: float32 tensors of ``count`` and ``count`` or ``count / n`` elements)."""
    if op == "all-reduce":
        return lambda: dist.all_reduce(inp, group=group)
    if op == "all-gather":
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    if op == "reduce-scatter":
        return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
    return lambda: dist.all_to_all_single(out, inp, group=group)


def _group_mean(value: float, group, device, op=dist.ReduceOp.SUM) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.item() / (dist.get_world_size(group) if op == dist.ReduceOp.SUM else 1)


def time_collective(op: str, size_bytes: int, group, idx: int, args, device) -> dict:
    """One nccl-tests row of ``op`` on a ``size_bytes`` buffer: time per call (s, mean over
    the group), iterations run, wrong elements."""
    n = dist.get_world_size(group)
    count, size_bytes = chunked(size_bytes, n)
    inp, out, want = collective_buffers(op, count, n, idx, device)
    call = collective_call(op, inp, out, group)
    t0 = time.perf_counter()
    for _ in range(max(args.warmup, 1)):
        call()
    _sync(device)
    warm = _group_mean((time.perf_counter() - t0) / max(args.warmup, 1), group, device, dist.ReduceOp.MAX)
    iters = max(1, min(args.iters, int(args.budget_s / max(warm, 1e-9))))
    dist.barrier(group=group)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append(time.perf_counter() - t0)
    stats = {k: _group_mean(f(times), group, device) for k, f in STATS.items()}
    inp.copy_(collective_buffers(op, count, n, idx, device)[0])        # all-reduce summed in place: restore
    call()
    _sync(device)
    got = inp if op == "all-reduce" else out
    wrong = int(_group_mean(float((got != want).sum().item()), group, device) * n)
    return {"size_bytes": size_bytes, "count": count, "time_s": stats[STAT], "iters": iters, "wrong": wrong,
            **{f"{k}_s": v for k, v in stats.items()}}


def time_pairs(size_bytes: int, iters: int, device) -> list[list[float]]:
    """One-way seconds per message of ``size_bytes`` between every two ranks: half the fastest
    round trip of a ping-pong timed by the lower rank, one pair at a time while the others
    wait at a barrier; 0 on the diagonal."""
    world, rank = dist.get_world_size(), dist.get_rank()
    buf = torch.zeros(max(size_bytes // 4, 1), dtype=torch.float32, device=device)
    times = torch.zeros(world, world, dtype=torch.float64, device=device)
    for i in range(world):
        for j in range(i + 1, world):
            if rank in (i, j):
                peer, trips = (j if rank == i else i), []
                for _ in range(iters + 1):                     # the first round trip is warm-up
                    t0 = time.perf_counter()
                    if rank == i:
                        dist.send(buf, peer), dist.recv(buf, peer)
                    else:
                        dist.recv(buf, peer), dist.send(buf, peer)
                    _sync(device)
                    trips.append(time.perf_counter() - t0)
                if rank == i:
                    times[i, j] = times[j, i] = min(trips[1:]) / 2
            dist.barrier()
    dist.all_reduce(times)
    return times.cpu().tolist()


def _ranks_info(device, nic) -> list[dict]:
    """Each rank's host, pid, node, NIC and device: on a GPU its model as nccl-tests prints it
    (``cudaDeviceProp.name`` = ``torch.cuda.get_device_name``, e.g. ``NVIDIA H100 80GB HBM3``),
    which ``meshplan calibrate`` and calibration.toml record; ``cpu`` under gloo."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    me = {"rank": dist.get_rank(), "host": socket.gethostname(), "pid": os.getpid(),
          "node": int(os.environ.get("GROUP_RANK", 0)), "device": name,
          "nic": nic["nic"] if nic else None, "addr": nic["addr"] if nic else None}
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, me)
    return got


def run(args, nic=None) -> dict:
    """Measure every group and op, then the pairs; the raw result (rank 0 writes it).
    ``nic``: this rank's testbed NIC (:func:`apply_local_nic`), None elsewhere."""
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    info = _ranks_info(device, nic)
    groups = bench_groups([r["node"] for r in info], [r["nic"] for r in info])
    result = {"backend": args.backend, "world": dist.get_world_size(), "ranks": info, "collectives": [],
              "iters": args.iters, "warmup": args.warmup, "budget_s": args.budget_s}
    for link, ranks in groups:
        pg = dist.new_group(list(ranks)) if len(ranks) < dist.get_world_size() else dist.group.WORLD
        for op in args.ops:
            rows = [None]
            if dist.get_rank() in ranks:
                rows = [[time_collective(op, s, pg, ranks.index(dist.get_rank()), args, device) for s in args.sizes]]
            dist.broadcast_object_list(rows, src=ranks[0])         # the group's rows, also to rank 0
            result["collectives"].append({"op": op, "link": link, "ranks": list(ranks), "rows": rows[0],
                                          "nic": info[ranks[0]]["nic"] if link == "nic" else None})
    result["pairs"] = {"size_bytes": args.pair_size, "iters": args.pair_iters,
                       "one_way_s": time_pairs(args.pair_size, args.pair_iters, device)}
    return result


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
    p.add_argument("--ops", type=lambda s: s.split(","), default=list(BENCH_OPS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=0.2)
    p.add_argument("--pair-size", type=int, default=1 << 20)
    p.add_argument("--pair-iters", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = _args(argv)
    torch.set_num_threads(1)
    nic = apply_local_nic()             # on a testbed: before any process group
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        result = run(args, nic)
        if dist.get_rank() == 0:
            write_json_atomic(args.out / "raw.json", result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
