"""Emulated cluster testbed: namespaces, rails, tbf rate, byte counters, launches and cleanup.

Needs root and ``ip netns``/``tc``; skipped with the reason otherwise, unless
MESHPLAN_REQUIRE_TESTBED=1 (CI), where an unavailable testbed fails. Every testbed here uses
a prefix made from the process id and is removed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from meshplan.errors import ConfigError
from meshplan.runtime.testbed import netns as T
from tests.testbed_gate import needs_testbed
from meshplan.runtime.testbed.launch import launch_per_node, torchrun_argv


PID = os.getpid() % 10**7
RATE_MBIT = 50

# Echo request/reply with a raw socket, for machines without iputils `ping` (bounded: 2 x 1 s).
PING_PY = r"""
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b)); s = (s >> 16) + (s & 0xffff)
    return ~(s + (s >> 16)) & 0xffff
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); s.settimeout(1.0)
ident, ok = os.getpid() & 0xffff, 0
for seq in range(2):
    body = struct.pack("!HH", ident, seq) + b"m" * 56
    s.sendto(struct.pack("!BBH", 8, 0, csum(b"\x08\x00\x00\x00" + body)) + body, (sys.argv[1], 0))
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        try:
            data = s.recv(2048)
        except socket.timeout:
            break
        typ, _, _, i, q = struct.unpack("!BBHHH", data[20:28])
        if typ == 0 and i == ident and q == seq:
            ok += 1
            break
sys.exit(0 if ok == 2 else 1)
"""

# Receiver (node 1) and sender (node 0) of NBYTES over one TCP connection on rail 0.
NBYTES = 2 * 1024 * 1024
RECV_PY = r"""
import socket, sys, time
srv = socket.create_server((sys.argv[1], 47001)); srv.settimeout(10)
conn, _ = srv.accept(); conn.settimeout(10)
got, t0 = 0, None
while got < %d:
    b = conn.recv(1 << 16)
    if not b:
        break
    t0 = t0 or time.monotonic(); got += len(b)
print(got, got * 8 / (time.monotonic() - t0) / 1e6)
""" % NBYTES
SEND_PY = r"""
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 47001), timeout=5); break
    except OSError:
        time.sleep(0.05)
c.sendall(b"x" * %d); c.close()
""" % NBYTES


def _netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _host_links() -> set[str]:
    out = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return {link["ifname"] for link in json.loads(out)}


def _ns_pids(ns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout.split()


def _ping(tb, node: int, addr: str) -> int:
    argv = ["ping", "-c", "2", "-W", "1", addr] if shutil.which("ping") else [sys.executable, "-c", PING_PY, addr]
    return subprocess.run(["ip", "netns", "exec", tb.node_ns(node), *argv], capture_output=True, timeout=10).returncode


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("testbed-state")


@pytest.fixture(scope="module")
def bed(state_dir):
    """A 2-node x 2-NIC testbed at 50 Mbit/s, removed afterwards whatever happens."""
    prefix = f"t{PID}"
    host_before = _host_links()
    try:
        yield T.testbed_up(prefix, 2, 2, RATE_MBIT, state_dir=state_dir), host_before
    finally:
        T.testbed_down(prefix, state_dir=state_dir)
    assert not [ns for ns in _netns() if ns.startswith(f"mp-{prefix}-")]


@pytest.mark.parametrize("args, field", [
    (("t", 0, 1, 10), "nodes"), (("t", 1, 0, 10), "nics"), (("t", 1, 1, 0), "rate_mbit"),
    (("t", 1, 1, -5), "rate_mbit"), (("t", 1, 1, float("nan")), "rate_mbit"), (("t", True, 1, 10), "nodes"),
    (("t", 255, 1, 10), "nodes"), (("t", 1, 1.5, 10), "nics"), (("x" * 13, 1, 1, 10), "prefix"),
    (("a-b", 1, 1, 10), "prefix"), (("../x", 1, 1, 10), "prefix"), (("", 1, 1, 10), "prefix"),
])
def test_bad_input_is_a_config_error(args, field, tmp_path):
    with pytest.raises(ConfigError) as e:
        T.testbed_up(*args, state_dir=tmp_path)
    assert e.value.field == field
    assert not list(tmp_path.iterdir())


def test_names_and_addresses_derive_from_the_prefix():
    tb = T.Testbed("p", 3, 2, 100.0, 32768, "/nonexistent")
    assert tb.namespaces == ["mp-p-n0", "mp-p-n1", "mp-p-n2", "mp-p-fabric"]
    assert (tb.addr(2, 1), tb.master_addr, tb.ifname(1)) == ("10.77.1.3", "10.77.0.1", "nic1")
    argv = torchrun_argv(tb, 1, 4, ["run.py"], master_port=29600)
    assert "--node-rank=1" in argv and "--master-addr=10.77.0.1" in argv and argv[-1] == "run.py"


@needs_testbed
def test_up_creates_namespaces_rails_and_limits_off_the_host(bed, state_dir):
    tb, host_before = bed
    assert set(tb.namespaces) <= set(_netns())
    assert _host_links() == host_before, "the testbed must not touch the host namespace"
    assert T.load_testbed(tb.prefix, state_dir) == tb and tb.status == "up"
    fabric = subprocess.run(["ip", "-n", tb.fabric_ns, "-j", "link"], capture_output=True, text=True).stdout
    ports = {link["ifname"]: link.get("master") for link in json.loads(fabric)}
    assert ports == {"lo": None, "br0": None, "br1": None,
                     "f0r0": "br0", "f1r0": "br0", "f0r1": "br1", "f1r1": "br1"}
    for i in range(2):
        addrs = json.loads(subprocess.run(["ip", "-n", tb.node_ns(i), "-j", "addr"],
                                          capture_output=True, text=True).stdout)
        got = {a["ifname"]: ([x["local"] + "/" + str(x["prefixlen"]) for x in a["addr_info"]], a["operstate"])
               for a in addrs}
        assert got == {"lo": (["127.0.0.1/8"], "UNKNOWN"),
                       "nic0": ([f"10.77.0.{i + 1}/24"], "UP"), "nic1": ([f"10.77.1.{i + 1}/24"], "UP")}
        qdisc = subprocess.run(["tc", "-n", tb.node_ns(i), "qdisc", "show", "dev", "nic1"],
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and f"rate {RATE_MBIT}Mbit" in qdisc
    with pytest.raises(T.TestbedError, match="already exists"):
        T.testbed_up(tb.prefix, 1, 1, 10, state_dir=state_dir)
    assert set(tb.namespaces) <= set(_netns()), "a refused `up` must leave the existing testbed alone"


@needs_testbed
def test_ping_on_rail0_moves_only_rail0_counters(bed):
    tb, _ = bed
    before = T.read_counters(tb)
    assert _ping(tb, 0, tb.addr(1, 0)) == 0
    delta = T.counter_delta(before, T.read_counters(tb))
    assert delta[(0, 0)][0] > 0 and delta[(0, 0)][1] > 0 and delta[(1, 0)][1] > 0
    assert delta[(0, 1)] == (0, 0) and delta[(1, 1)] == (0, 0), delta


@needs_testbed
def test_transfer_runs_at_the_tbf_rate(bed):
    tb, _ = bed
    before = T.read_counters(tb)
    cmds = {0: [sys.executable, "-c", SEND_PY, tb.addr(1, 0)], 1: [sys.executable, "-c", RECV_PY, tb.addr(1, 0)]}
    res = launch_per_node(tb, cmds.__getitem__, timeout_s=15)
    assert res.ok, res.message
    got, mbit = res.results[1].stdout_tail.split()
    assert int(got) == NBYTES
    assert 0.6 * RATE_MBIT <= float(mbit) <= 1.1 * RATE_MBIT, f"{mbit} Mbit/s against a {RATE_MBIT} Mbit/s tbf"
    delta = T.counter_delta(before, T.read_counters(tb))
    assert delta[(0, 0)][0] >= NBYTES and delta[(1, 0)][1] >= NBYTES
    assert delta[(0, 1)] == (0, 0) and delta[(1, 1)] == (0, 0)


@needs_testbed
def test_a_failing_node_is_reported_and_the_others_stopped(bed):
    tb, _ = bed
    cmds = {0: ["sh", "-c", "sleep 30 & sleep 30; wait"], 1: ["sh", "-c", "echo warming; echo boom >&2; exit 3"]}
    t0 = time.monotonic()
    res = launch_per_node(tb, cmds.__getitem__, timeout_s=20, grace_s=1)
    assert time.monotonic() - t0 < 5
    assert not res.ok and not res.timed_out and res.failed_node == 1
    assert res.results[1].returncode == 3 and res.results[1].status == "failed"
    assert "boom" in res.results[1].stderr_tail and "node 1" in res.message and "boom" in res.message
    assert res.results[0].status == "stopped"
    assert all(_ns_pids(ns) == [] for ns in tb.namespaces), "processes left in the testbed"


@needs_testbed
def test_a_hanging_node_is_killed_at_the_timeout(bed):
    tb, _ = bed
    hang = ["sh", "-c", "trap '' TERM; sleep 30 & sleep 30; wait"]     # ignores SIGTERM: needs SIGKILL
    t0 = time.monotonic()
    res = launch_per_node(tb, lambda i: hang if i == 1 else ["true"], timeout_s=1.0, grace_s=0.5)
    assert time.monotonic() - t0 < 4
    assert res.timed_out and not res.ok and res.failed_node is None
    assert [r.status for r in res.results] == ["ok", "timeout"] and "timeout" in res.message
    assert all(_ns_pids(ns) == [] for ns in tb.namespaces), "processes left in the testbed"


@needs_testbed
def test_down_is_idempotent_and_removes_leftovers(tmp_path, capsys):
    prefix = f"d{PID}"
    try:
        assert T.main_up(nodes=1, nics=1, rate_mbit=100, prefix=prefix, state_dir=tmp_path)[0] == 0
        assert "10.77.0.1" in capsys.readouterr().out
        stray = f"mp-{prefix}-n7"                               # as if a crashed `up` left it behind
        subprocess.run(["ip", "netns", "add", stray], check=True, timeout=10)
        sleeper = subprocess.Popen(["ip", "netns", "exec", stray, "sleep", "30"], start_new_session=True)
        time.sleep(0.2)
        assert T.main_down(prefix=prefix, state_dir=tmp_path)[0] == 0
        assert sleeper.wait(timeout=5) != 0, "the process inside a leftover namespace is killed"
        assert not [ns for ns in _netns() if ns.startswith(f"mp-{prefix}-")]
        assert not (tmp_path / f"{prefix}.json").exists()
        assert T.testbed_down(prefix, state_dir=tmp_path) == []
    finally:
        T.testbed_down(prefix, state_dir=tmp_path)


@needs_testbed
def test_a_failed_up_removes_what_it_made(tmp_path, monkeypatch):
    prefix = f"f{PID}"

    def broken_batch(tool, ns, lines):
        if tool == "tc" and ns.startswith(f"mp-{prefix}-"):
            raise T.TestbedError("injected failure")
        return real_batch(tool, ns, lines)

    real_batch = T._batch
    monkeypatch.setattr(T, "_batch", broken_batch)
    try:
        with pytest.raises(T.TestbedError, match="injected"):
            T.testbed_up(prefix, 2, 1, 10, state_dir=tmp_path)
        assert not [ns for ns in _netns() if ns.startswith(f"mp-{prefix}-")]
        assert not list(tmp_path.iterdir())
    finally:
        monkeypatch.undo()
        T.testbed_down(prefix, state_dir=tmp_path)
