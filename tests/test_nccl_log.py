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
from meshplan.comm.nccl_check import check_against_placement, check_log
from meshplan.comm.nccl_log import parse_nccl_log, read_nccl_log
from meshplan.placement.assign import place, rank_row
from tests.test_cli_json import H100X2

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


# ------------------------------------------------------- global ranks, ids, device indices
#
# Two DGX-H100 hosts a and b; process (host h, GPU g) has pid 100 + 8h + g. Its rank in the
# 16-rank world communicator 0x77 is 8h + g (the order dgx-h100's placement gives: rank 8 is
# host b's GPU 0, whose NIC is mlx5_0); in the 2-rank dp communicator 0xc0ffee of GPU 0 on
# both hosts, host b's process is rank 1. Both processes list [0]mlx5_0 [1]mlx5_3 only.

TWO_NICS = "NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_3:1/IB ; OOB eth0:10.0.0.1<0>"


def _dp_log(b_dev: int = 0, world: bool = True, comm_b: str = "0xa1") -> str:
    """World communicator (when ``world``), then the dp communicator of GPU 0 on a and b; host
    b's network channel goes through NET/IB/``b_dev``, its comm line names ``comm_b``."""
    out = []
    for h, host in enumerate("ab"):
        for g in range(8) if world else ():
            pid = 100 + 8 * h + g
            out += [_line(host, pid, g, f"comm 0x{pid} rank {8 * h + g} nRanks 16 nNodes 2 localRanks 8 "
                                        f"localRank {g} MNNVL 0"),
                    _line(host, pid, g, f"ncclCommInitRank comm 0x{pid} rank {8 * h + g} nranks 16 cudaDev {g} "
                                        f"nvmlDev {g} busId {g + 1}8000 commId 0x77 - Init COMPLETE")]
    for r, host in enumerate("ab"):
        pid, ptr, dev = 100 + 8 * r, ("0xa0", comm_b)[r], (0, b_dev)[r]
        out += [_line(host, pid, 0, TWO_NICS),
                _line(host, pid, 0, f"comm {ptr} rank {r} nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0"),
                _line(host, pid, 0, f"Channel 00/0 : {r}[0] -> {1 - r}[0] [send] via NET/IB/{dev}/GDRDMA"),
                _line(host, pid, 0, f"ncclCommInitRank comm {ptr} rank {r} nranks 2 cudaDev 0 nvmlDev 0 busId 18000 "
                                    "commId 0xc0ffee - Init COMPLETE")]
    return "\n".join(out)


def test_ranks_of_a_smaller_communicator_are_mapped_to_global_ranks(expected):
    """dp rank 1 is global rank 8 (host b, GPU 0, NIC mlx5_0): the right NIC is no difference
    and mlx5_3 is one, named by the global rank."""
    assert expected[8] == "mlx5_0" and expected[1] == "mlx5_3"
    assert check_against_placement(parse_nccl_log(_dp_log(0)), expected) == []
    assert check_against_placement(parse_nccl_log(_dp_log(1)), expected) == [
        "comm 0xc0ffee (2 ranks): rank 8 used mlx5_3 but the placement meant mlx5_0"]


def test_a_log_without_the_world_communicator_cannot_be_checked(expected):
    """Before: dp rank 1 was taken for global rank 1, so the right NIC (mlx5_0) was reported
    as a difference ('placement meant mlx5_3') and the wrong one (mlx5_3) passed."""
    for b_dev in (0, 1):
        with pytest.raises(ConfigError) as err:
            check_against_placement(parse_nccl_log(_dp_log(b_dev, world=False), source="dp.log"), expected)
        assert err.value.field == "dp.log"
        assert err.value.message.startswith("cannot check: no communicator of all 16 ranks in the log (the largest, "
                                            "commId 0xc0ffee, has 2)")
    four = parse_nccl_log(_mini_log([]), source="four.log")  # 4 ranks against a world of 2
    with pytest.raises(ConfigError, match="a communicator of 4 ranks .* but the config's world is 2"):
        check_against_placement(four, {0: "mlx5_0", 1: "mlx5_1"})


def test_a_comm_id_that_is_not_hex_is_a_note(expected):
    rep = parse_nccl_log(_dp_log(0, comm_b="0xzz"), source="x.log")
    # host b's comm line (38) and Init COMPLETE line (40) are skipped with a note; its channel line
    # (39) then fits no communicator of that process
    assert rep.notes == (
        "x.log:38: comm id '0xzz' is not hexadecimal (0x...); line skipped, so this process's rank is missing from "
        "that communicator",
        "x.log:39: 'Channel 00/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA' fits no communicator of this process",
        "x.log:40: comm id '0xzz' is not hexadecimal (0x...); line skipped, so this process's rank is missing from "
        "that communicator")
    dp = next(c for c in rep.communicators if c.comm_id == "0xc0ffee")
    assert sorted(dp.ranks) == [0]
    bad_commid = _dp_log(0).replace("commId 0xc0ffee", "commId c0ffee")
    notes = parse_nccl_log(bad_commid).notes
    assert [n for n in notes if "c0ffee" in n] == [
        f"NCCL log:{ln}: comm id 'c0ffee' is not hexadecimal (0x...); line skipped, so this process's rank is "
        "missing from that communicator" for ln in (36, 40)]


def _split(text: str, count: str) -> str:
    """``_dp_log`` text with the dp communicator made by ncclCommSplit of the world, as NCCL
    prints it since 2.23 (init.cc: no commId; ``count`` e.g. "splitCount 1 " for 2.24-2.29,
    "childCount 1 " for 2.30, "" for 2.23): parent = the process's world comm pointer."""
    for r, pid in ((0, 100), (1, 108)):
        ptr = ("0xa0", "0xa1")[r]
        text = text.replace(f"ncclCommInitRank comm {ptr} rank {r} nranks 2 cudaDev 0 nvmlDev 0 busId 18000 "
                            "commId 0xc0ffee - Init COMPLETE",
                            f"ncclCommSplit comm {ptr} rank {r} nranks 2 cudaDev 0 nvmlDev 0 busId 18000 parent "
                            f"0x{pid} {count}color 0 key {r} - Init COMPLETE")
    return text


@pytest.mark.parametrize("count, comm_id", [("childCount 1 ", "0x77/split 1 color 0"),
                                            ("splitCount 1 ", "0x77/split 1 color 0"), ("", "0x77/color 0")])
def test_split_communicators_without_a_comm_id(expected, count, comm_id):
    """NCCL >= 2.23 prints a split's Init COMPLETE without a commId; its ranks are matched by
    their parents' commId, the split count and the color. Before, those lines were ignored:
    the dp communicator vanished and its wrong NIC (host b through mlx5_3) passed unseen."""
    text = _split(_dp_log(1), count)
    assert "commId 0xc0ffee" not in text
    rep = parse_nccl_log(text)
    dp = rep.communicators[-1]
    assert (dp.comm_id, dp.n_ranks, sorted(dp.ranks)) == (comm_id, 2, [0, 1]) and rep.notes == ()
    assert check_against_placement(rep, expected) == [
        f"comm {comm_id} (2 ranks): rank 8 used mlx5_3 but the placement meant mlx5_0"]
    assert check_against_placement(parse_nccl_log(_split(_dp_log(0), count)), expected) == []


def test_a_split_whose_parent_is_not_in_the_log_is_a_note(expected):
    text = "\n".join(ln for ln in _split(_dp_log(1), "childCount 1 ").splitlines() if not ln.startswith("b:108:")
                     or "nranks 2" in ln or "nRanks 2" in ln or "Channel" in ln or "Using" in ln)
    rep = parse_nccl_log(text, source="x.log")
    assert rep.notes[-1] == ("x.log:38: Init COMPLETE line with a split of comm 0x108 without a commId, and that "
                             "parent's Init COMPLETE is not in this process's output before it; keep the log from "
                             "the parent communicator's init on")
    assert [sorted(c.ranks) for c in rep.communicators] == [[r for r in range(16) if r != 8], [0]]


def test_init_lines_without_a_comm_id_cannot_be_checked(tmp_path, capsys):
    """NCCL before 2.16 prints no commId (``comm 0x.. rank r nranks n cudaDev d busId b - Init
    COMPLETE``): no communicator can be matched across processes; before, the log was
    refused as if it had no Init COMPLETE at all."""
    old = "\n".join(ln.replace("ncclCommInitRank ", "").replace(" commId 0x77", "").replace(" commId 0xc0ffee", "")
                    for ln in _dp_log(0).splitlines())
    with pytest.raises(ConfigError) as err:
        parse_nccl_log(old, source="old.log")
    assert err.value.message.startswith("no communicator reached 'Init COMPLETE' (first old.log:2: no commId (NCCL "
                                        "before 2.16 prints none), so its communicator cannot be matched across "
                                        "processes; log the run with NCCL 2.16 or later)")


def test_cli_cannot_check_when_the_world_init_lines_are_unreadable(tmp_path, capsys):
    """Every world Init COMPLETE line has a commId that is not hex: the world communicator is
    gone. Before, the error blamed the log ("no communicator of all 16 ranks ... log the run
    from the world communicator's init on") and the notes naming the lines were never printed."""
    code, out, err = _cli(tmp_path, capsys, _dp_log(1).replace("commId 0x77", "commId 77"))
    lines = err.splitlines()
    assert (code, out, len(lines)) == (2, "", 17)
    assert lines[0] == ("note: run.log:2: comm id '77' is not hexadecimal (0x...); line skipped, so this process's "
                        "rank is missing from that communicator")
    assert lines[-1] == ("error: run.log: cannot check: no 16-rank communicator could be read: 16 of its Init "
                         "COMPLETE lines name none it can be matched by (first run.log:2: comm id '77', not "
                         "hexadecimal (0x...)), so the global ranks are unknown")


def test_a_net_device_index_past_the_listed_devices_says_so(expected):
    """Host b sends through NET/IB/3 but its NCCL listed two devices: no NIC name to compare."""
    rep = parse_nccl_log(_dp_log(3))
    conn = next(c for c in rep.communicators[-1].connections if c.reporter == 1)
    assert (conn.net_dev, conn.nic) == (3, None)
    assert check_against_placement(rep, expected) == [
        "comm 0xc0ffee (2 ranks): rank 8 used NET/IB/3 but its NCCL listed 2 net device(s), mlx5_0, mlx5_3; the "
        "log does not say which NIC that is"]
    no_list = parse_nccl_log(_dp_log(0).replace(TWO_NICS, "NET/IB : No device found."))
    assert check_against_placement(no_list, expected) == [
        f"comm 0xc0ffee (2 ranks): rank {g} used NET/IB/0 but its NCCL listed no net devices (no 'NET/IB : Using' "
        "line from its process); the log does not say which NIC that is" for g in (0, 8)]


def test_processes_outside_the_world_communicator_are_noted(expected):
    """Host b's GPU 0 has no world lines (its output cut): its dp rank is not checked, and said so."""
    text = "\n".join(ln for ln in _dp_log(1).splitlines() if not (ln.startswith("b:108:") and "anks 16" in ln))
    rep = parse_nccl_log(text)
    assert sorted(rep.communicators[0].ranks) == [r for r in range(16) if r != 8]
    assert check_log(rep, expected).unchecked == (
        "comm 0xc0ffee (2 ranks): rank 1 (b:108, GPU 0) is no rank of the log's 16-rank communicator; not checked",)
    assert check_against_placement(rep, expected) == []




def _cli(tmp_path, capsys, log_text: str) -> tuple[int, str, str]:
    from meshplan.cli import main

    (tmp_path / "c.toml").write_text(H100X2)
    (tmp_path / "run.log").write_text(log_text)
    with pytest.raises(SystemExit) as done:
        main(["nccl-check", str(tmp_path / "c.toml"), str(tmp_path / "run.log")])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


def test_cli_cannot_check_without_the_world_communicator(tmp_path, capsys):
    """Exit 2 with one line (exit 1 is a difference found), for the right and the wrong NIC alike."""
    for b_dev in (0, 1):
        assert _cli(tmp_path, capsys, _dp_log(b_dev, world=False)) == (
            2, "", "error: run.log: cannot check: no communicator of all 16 ranks in the log (the largest, commId "
                   "0xc0ffee, has 2), so its ranks are not global ranks; log the run from the world communicator's "
                   "init on (a collective on the default process group, e.g. dist.barrier(), creates it) with "
                   "NCCL_DEBUG=INFO\n")


def test_cli_prints_the_difference_and_the_notes(tmp_path, capsys):
    assert _cli(tmp_path, capsys, _dp_log(1)) == (
        1, "comm 0xc0ffee (2 ranks): rank 8 used mlx5_3 but the placement meant mlx5_0\n"
           "1 difference(s) between the NCCL log and the placement\n", "")
    code, out, err = _cli(tmp_path, capsys, _dp_log(0, comm_b="0xzz"))
    assert (code, out) == (0, "0 difference(s) between the NCCL log and the placement\n")
    assert err.splitlines()[0] == ("note: run.log:38: comm id '0xzz' is not hexadecimal (0x...); line skipped, so "
                                   "this process's rank is missing from that communicator")


# ---------------------------------------------------------------- world + tp + dp, no comm lines
TP_DP = DATA / "dgx-h100x2_world16_tp8_dp2_no-comm-lines_rank5-wrong-nic.log"  # tests/nccl_tp_dp_log.py
TP_A, DP5 = "0x5a3e11c07b2d4f0a", "0x1b5e90c2d4f75855"


def test_the_tp_dp_fixture_is_what_its_script_writes():
    from tests.nccl_tp_dp_log import log_text

    assert TP_DP.read_text() == log_text()


def test_init_start_brackets_attribute_the_dp_lines(tmp_path, capsys):
    """Issue 11: three communicators per process (world, tp, dp) and no 'comm .. nRanks' lines.
    dgx-a GPU 0's dp lines '0[0] -> 1[0] via NET/IB/0' were pinned on its tp communicator, where
    it is rank 0 too (tp ranks 0 and 1 'connected via NET, not P2P', 4 such lines), and rank 5's
    dp lines fitted nothing (its tp and world rank is 5, its dp rank 0), so its wrong NIC was
    missed. Between Init START and Init COMPLETE they are the dp communicator's: one difference,
    rank 5 (dgx-a GPU 5) on mlx5_0 where the placement has GPU 5's mlx5_9."""
    assert _cli(tmp_path, capsys, TP_DP.read_text()) == (
        1, f"comm {DP5} (2 ranks): rank 5 used mlx5_0 but the placement meant mlx5_9\n"
           "1 difference(s) between the NCCL log and the placement\n", "")
    rep = read_nccl_log(TP_DP)
    tp_a = next(c for c in rep.communicators if c.comm_id == TP_A)
    assert {c.transport for c in tp_a.connections} == {"P2P"} and len(tp_a.connections) == 8
    assert rep.notes == ()
    # the same run with rank 5 on its own NIC: nothing to say
    ok = "\n".join(ln.replace("via NET/IB/0/", "via NET/IB/5/") if ln.startswith("dgx-a:52495:") else ln
                   for ln in TP_DP.read_text().splitlines())
    assert _cli(tmp_path, capsys, ok) == (0, "0 difference(s) between the NCCL log and the placement\n", "")


def test_without_init_start_the_devices_attribute_or_it_cannot_check(tmp_path, capsys):
    """No Init START lines either: each channel line is told by its 'rank[nvmlDev]' pairs. A dp
    line '0[5] -> 1[5]' fits only the dp communicator (in world and tp, rank 1 is GPU 1), so rank
    5's wrong NIC is still found; on dgx-a a process is rank g of both the world and the tp
    communicator, whose rank g + 1 is GPU g + 1 in both, so its 7 world P2P lines (GPU 7's goes
    to dgx-b) and 8 tp lines fit both alike: 15 lines, world and dgx-a's tp cannot be checked
    (dgx-b's tp ranks 0..7 are world ranks 8..15, so its lines fit only tp)."""
    text = "\n".join(ln for ln in TP_DP.read_text().splitlines() if not ln.endswith("Init START"))
    first = next(i for i, ln in enumerate(text.splitlines(), 1) if "Channel" in ln)  # dgx-a GPU 0: 0[0] -> 1[1]
    why = (f"cannot check: 15 channel line(s) fit it and another communicator of their process alike (first "
           f"run.log:{first} (comm {WORLD} or {TP_A})): the log has no 'Init START' or 'comm 0x.. rank .. nRanks' "
           "line opening each communicator's init; log with NCCL_DEBUG_SUBSYS including INIT and "
           "NCCL_RUNTIME_CONNECT=0")
    assert _cli(tmp_path, capsys, text) == (
        1, f"comm {WORLD} (16 ranks): {why}\ncomm {TP_A} (8 ranks): {why}\n"
           f"comm {DP5} (2 ranks): rank 5 used mlx5_0 but the placement meant mlx5_9\n"
           "1 difference(s) between the NCCL log and the placement; 2 communicator(s) cannot be checked\n", "")
