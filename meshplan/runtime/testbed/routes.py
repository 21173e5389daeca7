"""Routing between the rails of a netns testbed (:mod:`meshplan.runtime.testbed.netns`): a spine.

Rail ``k`` is the subnet 10.77.<k>.0/24 on bridge ``br<k>`` of the fabric namespace. The
fabric namespace is also the spine router: IPv4 forwarding on, and bridge ``br<k>`` holds
the rail's gateway 10.77.<k>.254 (:func:`spine_addr`). In node ``i``'s namespace, traffic
*from* NIC ``k``'s address uses NIC ``k`` (source policy routing, one table per NIC):

    rule  pref 100+k  from 10.77.<k>.<i+1>  lookup 100+k
    table 100+k:      10.77.<k>.0/24 dev nic<k>                  (same rail: the rail bridge)
                      10.77.0.0/16 via 10.77.<k>.254 dev nic<k>  (another rail: up to the spine)

So a socket bound to nicA of node i reaches nicB of node j through nicA, the spine and
j's nicB, and the reply comes back the same way; same-rail traffic stays on its rail
bridge; traffic between two addresses of one node is local (loopback, no NIC counter
moves). A socket that is not bound (no source address yet) follows the main table, whose
connected routes send it out the NIC on the destination's rail. gloo binds its listening
socket to GLOO_SOCKET_IFNAME's address but not the socket it connects from, so the
testbed run binds those (:mod:`meshplan.runtime.testbed.nics`). Reverse-path filtering is
off in every node namespace. The spine itself is not rate-limited: each NIC's two veth
ends are (tbf), as in a non-blocking fabric.
"""

from __future__ import annotations

RAIL_TABLE_BASE = 100   # routing table (and rule preference) of NIC k in a node namespace: 100 + k
SPINE_HOST = 254        # last octet of each rail's gateway on the spine (nodes use 1..253)


def spine_addr(rail: int) -> str:
    """Gateway of rail ``rail`` on the spine (the fabric namespace's bridge ``br<rail>``).

    >>> spine_addr(1)
    '10.77.1.254'
    """
    return f"10.77.{rail}.{SPINE_HOST}"


def fabric_lines(rails: int) -> list[str]:
    """``ip -batch`` lines for the fabric namespace: each rail bridge gets its gateway.

    >>> fabric_lines(2)
    ['addr add 10.77.0.254/24 dev br0', 'addr add 10.77.1.254/24 dev br1']
    """
    return [f"addr add {spine_addr(k)}/24 dev br{k}" for k in range(rails)]


def node_lines(node_addrs: list[str]) -> list[str]:
    """``ip -batch`` lines for one node namespace whose NIC ``k`` has ``node_addrs[k]``
    (see the module docstring).

    >>> node_lines(["10.77.0.2", "10.77.1.2"])[:3]
    ['rule add from 10.77.0.2 lookup 100 pref 100', 'route add 10.77.0.0/24 dev nic0 src 10.77.0.2 table 100', 'route add 10.77.0.0/16 via 10.77.0.254 dev nic0 src 10.77.0.2 table 100']
    """
    lines = []
    for k, addr in enumerate(node_addrs):
        t = RAIL_TABLE_BASE + k
        lines += [f"rule add from {addr} lookup {t} pref {t}",
                  f"route add 10.77.{k}.0/24 dev nic{k} src {addr} table {t}",
                  f"route add 10.77.0.0/16 via {spine_addr(k)} dev nic{k} src {addr} table {t}"]
    return lines


FORWARD_ON = "echo 1 > /proc/sys/net/ipv4/ip_forward"
RP_FILTER_OFF = ("echo 0 > /proc/sys/net/ipv4/conf/all/rp_filter && "
                 "echo 0 > /proc/sys/net/ipv4/conf/default/rp_filter")


def add_spine(tb, batch, run) -> None:
    """Make the fabric namespace of ``tb`` the spine and route every node through it.

    ``batch(tool, ns, lines)`` and ``run(argv)`` are the testbed's command runners; call
    after the NICs are up (the routes name them).
    """
    run(["ip", "netns", "exec", tb.fabric_ns, "sh", "-c", FORWARD_ON])
    batch("ip", tb.fabric_ns, fabric_lines(tb.nics_per_node))
    for i in range(tb.nodes):
        run(["ip", "netns", "exec", tb.node_ns(i), "sh", "-c", RP_FILTER_OFF])
        batch("ip", tb.node_ns(i), node_lines([tb.addr(i, k) for k in range(tb.nics_per_node)]))
