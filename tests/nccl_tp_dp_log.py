"""Writes tests/data/nccl/dgx-h100x2_world16_tp8_dp2_no-comm-lines_rank5-wrong-nic.log: an
NCCL_DEBUG=INFO log (NCCL 2.21 line formats, as the dgx-h100x2_world16_dp2 samples) of 16
processes on two DGX-H100-like hosts (dgx-a, dgx-b; process of global rank 8h + g on GPU g of
host h) with three communicators each, initialised in this order: the world (16 ranks, one
ring 0..7 -> 8..15 -> 0 whose two cross-node hops go through GPU 7's and GPU 0's own NICs),
the tp communicator of its host (8 ranks, tp rank g, ring 0..7 -> 0 over P2P) and the dp
communicator {a GPU g, b GPU g} (dp rank h, both directions through GPU g's own NIC,
NET/IB/g), except the process of global rank 5 (dgx-a GPU 5), whose dp channels go through
NET/IB/0 = mlx5_0 instead of mlx5_9. Each init is bracketed by its ``Init START`` and
``Init COMPLETE`` lines; the ``comm 0x.. rank r nRanks n nNodes ..`` lines are left out (as
when NCCL_DEBUG_SUBSYS drops them), so the dp channel lines come before the dp communicator's
rank is known from any other line. The processes' lines are interleaved phase by phase.

Run ``python tests/nccl_tp_dp_log.py`` to write it again.
"""

from __future__ import annotations

from pathlib import Path

LOG = Path(__file__).parent / "data" / "nccl" / "dgx-h100x2_world16_tp8_dp2_no-comm-lines_rank5-wrong-nic.log"
NICS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
BUS = ["18000", "2a000", "3a000", "5d000", "9a000", "ab000", "ba000", "db000"]
WORLD, TP, DP = "0x7d2f3c1b8e4a9a10", ["0x5a3e11c07b2d4f0a", "0x5a3e11c07b2d4f0b"], "0x1b5e90c2d4f7585"


def _init(ptr: str, rank: int, n: int, g: int, comm_id: str, what: str) -> str:
    return (f"ncclCommInitRankConfig comm {ptr} rank {rank} nranks {n} cudaDev {g} nvmlDev {g} busId {BUS[g]} "
            f"commId {comm_id} - Init {what}")


def _process(h: int, g: int, wrong_nic: bool) -> list[list[str]]:
    """The lines of the process of global rank 8h + g, one list per phase (net, world, tp, dp)."""
    r = 8 * h + g
    ptr = f"0x55c4a1b{0x2c + r:02x}000"
    nets = " ".join(f"[{i}]{n}:1/IB" for i, n in enumerate(NICS))
    world = [_init(ptr, r, 16, g, WORLD, "START")]
    nxt = (r + 1) % 16
    if g < 7:
        world.append(f"Channel 00/0 : {r}[{g}] -> {nxt}[{g + 1}] via P2P/CUMEM/read")
    else:
        world.append(f"Channel 00/0 : {r}[7] -> {nxt}[0] [send] via NET/IB/7/GDRDMA")
    if g == 0:
        world.append(f"Channel 00/0 : {(r - 1) % 16}[7] -> {r}[0] [receive] via NET/IB/0/GDRDMA")
    world.append(_init(ptr, r, 16, g, WORLD, "COMPLETE"))
    tptr = f"0x55d9e3f{0x20 + r:02x}000"
    tp = [_init(tptr, g, 8, g, TP[h], "START"), f"Channel 00/0 : {g}[{g}] -> {(g + 1) % 8}[{(g + 1) % 8}] via "
          "P2P/CUMEM/read", _init(tptr, g, 8, g, TP[h], "COMPLETE")]
    dptr, dev = f"0x55d9e3f{0x40 + r:02x}000", 0 if wrong_nic and r == 5 else g
    dp = [_init(dptr, h, 2, g, f"{DP}{g}", "START"),
          f"Channel 00/0 : {h}[{g}] -> {1 - h}[{g}] [send] via NET/IB/{dev}/GDRDMA",
          f"Channel 00/0 : {1 - h}[{g}] -> {h}[{g}] [receive] via NET/IB/{dev}/GDRDMA",
          _init(dptr, h, 2, g, f"{DP}{g}", "COMPLETE")]
    return [[f"NET/IB : Using {nets} ; OOB ibp26s0:10.1.0.{11 + h}<0>", "Using network IB"], world, tp, dp]


def log_text(wrong_nic: bool = True) -> str:
    """The whole log: per phase, the processes' lines taken in turn."""
    procs = [(h, g, _process(h, g, wrong_nic)) for h in range(2) for g in range(8)]
    out = []
    for phase in range(4):
        depth = max(len(p[phase]) for *_, p in procs)
        for i in range(depth):
            for h, g, p in procs:
                if i < len(p[phase]):
                    pid = 52310 + 37 * (8 * h + g)
                    out.append(f"dgx-{'ab'[h]}:{pid}:{pid + 41} [{g}] NCCL INFO {p[phase][i]}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    LOG.write_text(log_text())
