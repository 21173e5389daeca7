"""Emulated multi-node cluster on one Linux machine: network namespaces, rails and rate limits.

Layout for prefix ``P``, ``N`` nodes and ``K`` NICs per node::

    mp-P-fabric   one bridge br<k> per rail, and the fabric end f<i>r<k> of every NIC's veth;
                  also the spine router: br<k> holds rail k's gateway 10.77.<k>.254
    mp-P-n<i>     lo and nic0..nic<K-1>; nic<k> has 10.77.<k>.<i+1>/24 on rail k's bridge;
                  traffic from nic<k>'s address leaves by nic<k> (to another rail: via the spine)

Routes: :mod:`meshplan.runtime.testbed.routes`; running torchrun in every node namespace:
:mod:`meshplan.runtime.testbed.launch`; each rank on its NIC: :mod:`meshplan.runtime.testbed.nics`.

Each veth end has a ``tc`` tbf qdisc at the link rate, so both directions of a NIC are
limited. Nothing is created in the host namespace: a veth is made inside the fabric
namespace with its peer created directly inside the node namespace, and only addresses
inside these namespaces are used. IPv6 is off in every testbed namespace so that no
autoconfiguration traffic moves the byte counters. The state is a JSON file (atomic write,
status ``creating`` then ``up``) that :func:`load_testbed` reads. :func:`testbed_down` kills
the processes inside and deletes every namespace named ``mp-<prefix>-fabric``/``-n<i>``, so
it also removes what a crashed ``up`` left behind, then the state file. Needs root, iproute2.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from meshplan.atomic_write import write_text_atomic
from meshplan.errors import ConfigError
from meshplan.runtime.testbed.routes import add_spine

CMD_TIMEOUT_S = 20.0
MAX_NODES = 253          # the node is the last octet (i + 1) of 10.77.<rail>.<i+1>; .254 is the spine
MAX_NICS = 32
LATENCY_MS = 50          # tbf queue: the longest a packet may wait in the limiter
_PREFIX_RE = re.compile(r"^[A-Za-z0-9_]{1,12}$")


class TestbedError(RuntimeError):
    """A testbed command failed, or the testbed is in a state that forbids the request."""

    __test__ = False


class TestbedUnavailable(TestbedError):
    """This machine cannot host a testbed (not root, not Linux, no ``ip netns`` or ``tc``)."""


@dataclass(frozen=True)
class Testbed:
    """A created testbed: names and addresses derive from these fields."""

    prefix: str
    nodes: int
    nics_per_node: int
    rate_mbit: float
    burst_bytes: int
    state_path: str
    status: str = "up"

    __test__ = False

    @property
    def fabric_ns(self) -> str:
        """Namespace holding the rail bridges."""
        return f"mp-{self.prefix}-fabric"

    def node_ns(self, node: int) -> str:
        """Namespace of emulated node ``node``."""
        return f"mp-{self.prefix}-n{node}"

    @staticmethod
    def ifname(nic: int) -> str:
        """Interface name of NIC ``nic`` inside a node namespace (for GLOO_SOCKET_IFNAME)."""
        return f"nic{nic}"

    def addr(self, node: int, nic: int) -> str:
        """IPv4 address of ``node``'s NIC ``nic`` (on rail ``nic``)."""
        return f"10.77.{nic}.{node + 1}"

    @property
    def master_addr(self) -> str:
        """Address of node 0's nic0: torchrun's static ``--master-addr``."""
        return self.addr(0, 0)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this testbed, nodes first."""
        return [self.node_ns(i) for i in range(self.nodes)] + [self.fabric_ns]


def _state_path(prefix: str, state_dir) -> Path:
    """``<state_dir>/<prefix>.json``; the folder defaults to $MESHPLAN_TESTBED_DIR or /tmp/meshplan-testbed."""
    return Path(state_dir or os.environ.get("MESHPLAN_TESTBED_DIR", "/tmp/meshplan-testbed")) / f"{prefix}.json"


def _write_state(tb: Testbed) -> None:
    """Write the state file atomically (temporary file in the same folder, then rename)."""

    path = Path(tb.state_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"version": 1, **asdict(tb)}, indent=1))


def load_testbed(prefix: str = "t", state_dir=None) -> Testbed:
    """Read the testbed ``prefix`` from its state file (TestbedError when there is none)."""
    _check_prefix(prefix)
    path = _state_path(prefix, state_dir)
    try:
        data = json.loads(path.read_text())
        data.pop("version", None)
        return Testbed(**data)
    except FileNotFoundError:
        raise TestbedError(f"no testbed '{prefix}' ({path} missing); run `meshplan testbed up`") from None
    except (ValueError, TypeError) as e:
        raise TestbedError(f"{path} is not a testbed state file: {e}") from None


def require_testbed(prefix: str, field: str = "--testbed", state_dir=None) -> Testbed:
    """:func:`load_testbed` for a command that needs the testbed: a missing or unreadable
    one is a ConfigError naming ``field`` (one line, exit 2), not a TestbedError."""

    try:
        return load_testbed(prefix, state_dir)
    except TestbedError as e:
        raise ConfigError(field, str(e)) from None


def _run(argv: Sequence[str], *, check: bool = True, stdin: Optional[str] = None,
         timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one command with a timeout; TestbedError names the command and its stderr."""
    try:
        cp = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise TestbedError(f"`{argv[0]}` not found (install iproute2)") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(argv)}` timed out after {timeout:g} s") from None
    if check and cp.returncode != 0:
        raise TestbedError(f"`{' '.join(argv)}` failed (rc {cp.returncode}): {cp.stderr.strip()}")
    return cp


def _batch(tool: str, ns: str, lines: Sequence[str]) -> None:
    """Run ``ip``/``tc`` commands in one process inside namespace ``ns`` (stops at the first error)."""
    if lines:
        _run([tool, "-n", ns, "-batch", "-"], stdin="\n".join(lines) + "\n")


def _check_prefix(prefix) -> None:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ConfigError("prefix", f"{prefix!r} must be 1-12 letters, digits or '_' (no '-': it "
                                    "separates the prefix in namespace names); use e.g. 't'")


def _check_int(name: str, value, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= hi:
        raise ConfigError(name, f"{value!r} must be an integer in 1..{hi}")


def validate_args(prefix, nodes, nics_per_node, rate_mbit) -> None:
    """Raise :class:`ConfigError` for a bad prefix, node count, NIC count or rate."""
    _check_prefix(prefix)
    _check_int("nodes", nodes, MAX_NODES)
    _check_int("nics", nics_per_node, MAX_NICS)
    if (isinstance(rate_mbit, bool) or not isinstance(rate_mbit, (int, float))
            or not math.isfinite(rate_mbit) or not 0.1 <= rate_mbit <= 100_000):
        raise ConfigError("rate_mbit", f"{rate_mbit!r} must be a number of Mbit/s in 0.1..100000")


def testbed_available() -> tuple[bool, str]:
    """``(True, "ok")`` when namespaces, veths, bridges and tbf work here, else ``(False, reason)``."""
    if not sys.platform.startswith("linux"):
        return False, f"needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "needs root for `ip netns` and `tc` (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    probe = f"mp-probe{os.getpid()}"
    try:
        _run(["ip", "netns", "add", probe])
        _batch("ip", probe, ["link add pb0 type bridge", "link add pv0 type veth peer name pv1"])
        _batch("tc", probe, ["qdisc add dev pv0 root tbf rate 10mbit burst 32768 latency 50ms"])
        return True, "ok"
    except TestbedError as e:
        return False, f"`ip netns`/veth/bridge/tbf probe failed: {e}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def _matching_netns(prefix: str) -> list[str]:
    """Namespaces named like this prefix's (``mp-<prefix>-fabric``, ``mp-<prefix>-n<i>``)."""
    pat = re.compile(rf"^mp-{re.escape(prefix)}-(fabric|n\d+)$")
    names = [ln.split()[0] for ln in _run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()]
    return [ns for ns in names if pat.match(ns)]


def _tbf(dev: str, tb: Testbed) -> str:
    return (f"qdisc add dev {dev} root tbf rate {tb.rate_mbit * 1000:.0f}kbit "
            f"burst {tb.burst_bytes} latency {LATENCY_MS}ms")


def _quiet_ns(ns: str) -> None:
    """Bring up lo and switch IPv6 off (no autoconfiguration traffic on the counters)."""
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    if os.path.isdir("/proc/sys/net/ipv6"):
        cmd = ("echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
               "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
        _run(["ip", "netns", "exec", ns, "sh", "-c", cmd])


def _create(tb: Testbed) -> None:
    """Namespaces, bridges, veths, addresses and tbf limits for ``tb``."""
    for ns in tb.namespaces:
        _run(["ip", "netns", "add", ns])
        _quiet_ns(ns)
    fabric, tc_fabric = [], []
    for k in range(tb.nics_per_node):
        # no multicast snooping: a snooping bridge sends IGMP reports on every rail at start-up
        fabric += [f"link add br{k} type bridge mcast_snooping 0", f"link set br{k} up"]
    for i in range(tb.nodes):
        node, tc_node = [], []
        for k in range(tb.nics_per_node):
            end = f"f{i}r{k}"
            fabric += [f"link add {end} type veth peer name {tb.ifname(k)} netns {tb.node_ns(i)}",
                       f"link set {end} master br{k}", f"link set {end} up"]
            node += [f"addr add {tb.addr(i, k)}/24 dev {tb.ifname(k)}", f"link set {tb.ifname(k)} up"]
            tc_node.append(_tbf(tb.ifname(k), tb))
            tc_fabric.append(_tbf(end, tb))
        _batch("ip", tb.fabric_ns, fabric)
        fabric = []
        _batch("ip", tb.node_ns(i), node)
        _batch("tc", tb.node_ns(i), tc_node)
    _batch("ip", tb.fabric_ns, fabric)
    _batch("tc", tb.fabric_ns, tc_fabric)
    add_spine(tb, _batch, _run)


def testbed_up(name_prefix: str, nodes: int, nics_per_node: int, rate_mbit: float, *,
               state_dir=None) -> Testbed:
    """Create the testbed; on any failure remove what was made and re-raise.

    Refuses (TestbedError) when a testbed with this prefix, or leftovers of one, exist.
    """
    validate_args(name_prefix, nodes, nics_per_node, rate_mbit)
    ok, why = testbed_available()
    if not ok:
        raise TestbedUnavailable(why)
    path = _state_path(name_prefix, state_dir)
    left = _matching_netns(name_prefix)
    if path.exists() or left:
        raise TestbedError(f"testbed '{name_prefix}' already exists ({path if path.exists() else left[0]});"
                           f" run `meshplan testbed down --prefix {name_prefix}` first")
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))     # 10 ms of traffic, at least 32 KiB
    tb = Testbed(name_prefix, nodes, nics_per_node, float(rate_mbit), burst, str(path), "creating")
    try:
        _write_state(tb)
        _create(tb)
        tb = Testbed(**{**asdict(tb), "status": "up"})
        _write_state(tb)
    except BaseException:
        try:
            testbed_down(name_prefix, state_dir=state_dir)
        except Exception as e:   # the original error is the one to report
            print(f"meshplan testbed: cleanup after a failed `up` also failed: {e}", file=sys.stderr)
        raise
    return tb


def _kill_ns_processes(ns: str) -> None:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def testbed_down(prefix: str = "t", *, state_dir=None) -> list[str]:
    """Remove testbed ``prefix``: its processes, namespaces and state file. Idempotent.

    Returns the namespaces removed; TestbedError when one could not be removed.
    """
    _check_prefix(prefix)
    path = _state_path(prefix, state_dir)
    present = _matching_netns(prefix)
    for ns in present:
        _kill_ns_processes(ns)
    for ns in present:
        _run(["ip", "netns", "del", ns], check=False)
    still = _matching_netns(prefix)
    if still:
        raise TestbedError(f"could not remove namespaces {still}; delete them with `ip netns del`")
    path.unlink(missing_ok=True)
    return present


def read_counters(testbed: Testbed) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(node, nic): (tx_bytes, rx_bytes)}`` of every NIC, read inside each node namespace."""
    counters = {}
    for i in range(testbed.nodes):
        links = json.loads(_run(["ip", "-n", testbed.node_ns(i), "-s", "-j", "link", "show"]).stdout)
        stats = {link["ifname"]: link["stats64"] for link in links}
        for k in range(testbed.nics_per_node):
            s = stats.get(testbed.ifname(k))
            if s is None:
                raise TestbedError(f"{testbed.ifname(k)} missing in {testbed.node_ns(i)}")
            counters[(i, k)] = (int(s["tx"]["bytes"]), int(s["rx"]["bytes"]))
    return counters


def counter_delta(before: Mapping, after: Mapping) -> dict[tuple[int, int], tuple[int, int]]:
    """Per-NIC ``(tx, rx)`` bytes moved between two :func:`read_counters` readings."""
    return {key: (after[key][0] - tx, after[key][1] - rx) for key, (tx, rx) in before.items()}


def main_up(nodes: int, nics: int, rate_mbit: float, prefix: str = "t", state_dir=None,
            echo: Callable[[str], None] = print) -> tuple[int, Optional[Testbed]]:
    """``meshplan testbed up``: ConfigError for bad input; (0, the testbed) when up, (1, None)
    (message on stderr) otherwise."""
    try:
        tb = testbed_up(prefix, nodes, nics, rate_mbit, state_dir=state_dir)
    except TestbedError as e:
        print(f"error: testbed: {e}", file=sys.stderr)
        return 1, None
    echo(f"testbed '{tb.prefix}': {tb.nodes} nodes x {tb.nics_per_node} NICs at {tb.rate_mbit:g} Mbit/s "
         f"(tbf burst {tb.burst_bytes} B), rail bridges and the spine (10.77.<rail>.254) in {tb.fabric_ns}; "
         f"state {tb.state_path}")
    for i in range(tb.nodes):
        echo(f"  {tb.node_ns(i)}: " + ", ".join(f"nic{k}={tb.addr(i, k)}" for k in range(tb.nics_per_node)))
    return 0, tb


def main_down(prefix: str = "t", state_dir=None, echo: Callable[[str], None] = print) -> tuple[int, list[str]]:
    """``meshplan testbed down``: (0, the namespaces removed) when nothing of ``prefix`` is
    left, (1, []) otherwise."""
    try:
        removed = testbed_down(prefix, state_dir=state_dir)
    except TestbedError as e:
        print(f"error: testbed: {e}", file=sys.stderr)
        return 1, []
    echo(f"testbed '{prefix}': removed {len(removed)} namespaces" + (f" ({', '.join(removed)})" if removed else ""))
    return 0, removed
