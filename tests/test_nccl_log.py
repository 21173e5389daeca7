"""NCCL_DEBUG=INFO logs: communicators, rings, trees, transports, NICs, and the check against
the placement.

tests/data/nccl/dgx-h100x2_world16_dp2_*.log: two DGX-H100-like nodes (dgx-a, dgx-b), 16
processes, NCCL 2.21 line formats (init.cc, rings.cc, p2p.cc, net.cc, net_ib.cc), lines of
all processes interleaved. Communicators: the world (16 ranks, commId 0x7d2f3c1b8e4a9a10,
two rings 0..7,15..8 and 0,8,15..9,1..7 whose cross-node hops stay on one rail) and one
two-rank data-parallel communicator per local GPU g = {g, g + 8}. In the "wrong-nic" log
the process of global rank 5 sends its network channels through NET/IB/0 = mlx5_0 instead
of its own mlx5_9.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.catalog import system
from meshplan.errors import ConfigError
from meshplan.comm.nccl_log import check_against_placement, parse_nccl_log, read_nccl_log
from meshplan.placement.assign import place, rank_row

DATA = Path(__file__).parent / "data" / "nccl"
OK = DATA / "dgx-h100x2_world16_dp2_ok.log"
WRONG = DATA / "dgx-h100x2_world16_dp2_rank5-wrong-nic.log"
DGX_NICS = ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]
WORLD = "0x7d2f3c1b8e4a9a10"


@pytest.fixture(scope="module")
def expected():
    p = place(system("dgx-h100", nodes=2), 16)
    return {r: rank_row(p, r)["nic"] for r in range(16)}


def test_world_communicator():
    rep = read_nccl_log(OK)
    assert rep.network == "IB" and rep.notes == ()
    assert len(rep.communicators) == 9
    w = rep.largest()
    assert (w.comm_id, w.n_ranks, w.n_nodes) == (WORLD, 16, 2)
    assert sorted(w.ranks) == list(range(16))
    r13 = w.ranks[13]
    assert (r13.host, r13.cuda_dev, r13.nvml_dev, r13.bus_id) == ("dgx-b", 5, 5, "ab000")
    assert r13.net_devices == tuple(DGX_NICS)
    assert w.rings == ((0, 1, 2, 3, 4, 5, 6, 7, 15, 14, 13, 12, 11, 10, 9, 8),
                       (0, 8, 15, 14, 13, 12, 11, 10, 9, 1, 2, 3, 4, 5, 6, 7))
    assert w.ring_links[5] == ((0, 4, 6), (1, 4, 6)) and w.ring_links[8] == ((0, 9, 0), (1, 0, 15))
    assert w.trees[0] == ((0, (1, 8), -1), (1, (1,), 8))
    assert w.trees[8] == ((0, (9,), 0), (1, (9, 0), -1))
    # 2 channels x (14 P2P hops printed once + 2 NET hops printed by sender and receiver)
    assert len(w.connections) == 36
    assert w.transports(0) == {1: {"P2P"}, 7: {"P2P"}, 8: {"NET"}}
    assert w.transports(5) == {4: {"P2P"}, 6: {"P2P"}}
    # ranks at a ring's node boundary use their own rail's NIC
    assert {r: w.net_nics(r) for r in (0, 1, 7, 8, 9, 15)} == {
        0: {"mlx5_0"}, 1: {"mlx5_3"}, 7: {"mlx5_11"}, 8: {"mlx5_0"}, 9: {"mlx5_3"}, 15: {"mlx5_11"}}
    assert w.net_nics(5) == set()
    send = next(c for c in w.connections if c.src == 7 and c.dst == 15 and c.direction == "send")
    assert (send.channel, send.reporter, send.via, send.net_dev, send.nic) == (0, 7, "NET/IB/7/GDRDMA", 7, "mlx5_11")


def test_data_parallel_communicators():
    rep = read_nccl_log(OK)
    dp = [c for c in rep.communicators if c.n_ranks == 2]
    assert len(dp) == 8
    for c in dp:
        a, b = c.ranks[0], c.ranks[1]
        assert (a.host, b.host) == ("dgx-a", "dgx-b") and a.cuda_dev == b.cuda_dev
        g = a.cuda_dev
        assert c.rings == ((0, 1), (0, 1)) and c.transports(0) == {1: {"NET"}}
        assert c.net_nics(0) == c.net_nics(1) == {DGX_NICS[g]}


def test_placement_check(expected):
    assert check_against_placement(read_nccl_log(OK), expected) == []
    assert check_against_placement(read_nccl_log(WRONG), expected) == [
        "comm 0x1b5e90c2d4f75855 (2 ranks): rank 5 used mlx5_0 but the placement meant mlx5_9"]


def test_intra_node_transport(expected):
    text = OK.read_text().replace("0[0] -> 1[1] via P2P/CUMEM/read", "0[0] -> 1[1] via SHM/direct/direct")
    assert check_against_placement(parse_nccl_log(text), expected) == [
        f"comm {WORLD} (16 ranks): ranks 0 -> 1 on dgx-a connected via SHM/direct/direct, not P2P"]
    assert check_against_placement(parse_nccl_log(text), expected, expected_intra=("P2P", "SHM")) == []


def _line(host, pid, dev, msg):
    return f"{host}:{pid}:{pid + 7} [{dev}] NCCL INFO {msg}"


def _mini_log(conn_lines, done=True):
    """4 ranks on 2 hosts (2 GPUs each), NICs mlx5_0 (GPU 0) and mlx5_1 (GPU 1)."""
    out = []
    for r in range(4):
        host, pid, dev = f"n{r // 2}", 100 + r, r % 2
        out += [_line(host, pid, dev, "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB eth0:10.0.0.1<0>"),
                _line(host, pid, dev, f"comm 0xa{r} rank {r} nRanks 4 nNodes 2 localRanks 2 localRank {dev} MNNVL 0")]
        out += [_line(host, pid, dev, m) for rr, m in conn_lines if rr == r]
        if done:
            out.append(_line(host, pid, dev, f"ncclCommInitRank comm 0xa{r} rank {r} nranks 4 cudaDev {dev} "
                                             f"nvmlDev {dev} busId {dev + 1}8000 commId 0xc0ffee - Init COMPLETE"))
    return "\n".join(out)


def test_pxn_proxy_rank():
    text = _mini_log([(1, "Channel 00/0 : 1[1] -> 3[1] [send] via NET/IB/0(0)/GDRDMA/Shared"),
                      (0, "Channel 00/0 : 0[0] -> 2[0] [send] via NET/IB/0/GDRDMA")])
    rep = parse_nccl_log(text)
    c = rep.largest()
    pxn = next(x for x in c.connections if x.src == 1)
    assert (pxn.proxy_rank, pxn.net_dev, pxn.nic, pxn.transport) == (0, 0, "mlx5_0", "NET")
    assert check_against_placement(rep, {0: "mlx5_0", 1: "mlx5_1", 2: "mlx5_0", 3: "mlx5_1"}) == [
        "comm 0xc0ffee (4 ranks): rank 1 used mlx5_0 (through PXN proxy rank 0) but the placement meant mlx5_1"]


def test_older_formats_and_runtime_connect():
    # NCCL 2.x before nvmlDev: busId in brackets, "Ring 00 : 0 1 2 3", no connIndex
    text = "\n".join([
        _line("h", 1, 0, "comm 0x1 rank 0 nranks 2 cudaDev 0 busId 18000 commId 0xaa - Init COMPLETE"),
        _line("h", 1, 0, "Ring 00 : 0 1"),
        _line("h", 1, 0, "Channel 00 : 0[18000] -> 1[2a000] via P2P/IPC"),
        _line("h", 2, 1, "comm 0x2 rank 1 nranks 2 cudaDev 1 busId 2a000 commId 0xaa - Init COMPLETE"),
    ])
    c = parse_nccl_log(text).largest()
    assert c.rings == ((0, 1),) and c.ranks[0].nvml_dev is None and c.ranks[1].bus_id == "2a000"
    assert c.transports(1) == {0: {"P2P"}} and c.n_nodes is None
    # NCCL_RUNTIME_CONNECT: connections come after both inits; attributed by the line's rank
    text = _mini_log([]) + "\n" + "\n".join([
        _line("n0", 101, 1, "comm 0xb1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0"),
        _line("n0", 101, 1, "ncclCommInitRank comm 0xb1 rank 0 nranks 2 cudaDev 1 nvmlDev 1 busId 28000 "
                            "commId 0xdd - Init COMPLETE"),
        _line("n0", 101, 1, "Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM"),
        _line("n0", 101, 1, "Channel 00/0 : 0[1] -> 1[1] [send] via NET/IB/1/GDRDMA"),
    ])
    rep = parse_nccl_log(text)
    world, dp = rep.communicators
    assert world.transports(1) == {0: {"P2P"}} and dp.net_nics(0) == {"mlx5_1"}
    assert world.net_nics(1) == set()


def test_notes_and_errors():
    text = _mini_log([(0, "Channel 00/0 : 0[0] -> 9[0] [send] via NET/IB/0/GDRDMA")])
    rep = parse_nccl_log(text, source="run.log")
    assert len(rep.notes) == 1 and rep.notes[0].startswith("run.log:3: 'Channel 00/0 : 0[0] -> 9[0]")
    unfinished = parse_nccl_log(_mini_log([]) + "\n" + _line("n0", 100, 0, "comm 0xee rank 0 nRanks 2 nNodes 1 "
                                                                         "localRanks 2 localRank 0 MNNVL 0"))
    assert unfinished.notes == ("n0:100 comm 0xee rank 0 never reached Init COMPLETE",)
    with pytest.raises(ConfigError) as err:
        parse_nccl_log(_mini_log([], done=False), source="run.log")
    assert err.value.field == "run.log" and "NCCL_DEBUG=INFO" in err.value.message
    with pytest.raises(ConfigError, match="LOG: no such file .*missing.log"):
        read_nccl_log(DATA / "missing.log")
