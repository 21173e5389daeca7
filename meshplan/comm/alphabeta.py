"""Alpha-beta cost of one collective, and nccl-tests' algbw/busbw convention.

For a ring (or pairwise) algorithm over n ranks on a buffer of S bytes (S is the full
buffer, as nccl-tests' ``size``):

=============== ========== ===========================
op              steps      bytes each rank sends
=============== ========== ===========================
all-reduce      2(n-1)     2(n-1)/n * S
all-gather      n-1        (n-1)/n * S
reduce-scatter  n-1        (n-1)/n * S
all-to-all      n-1        (n-1)/n * S
broadcast       n-1        S
send/recv       1          S
=============== ========== ===========================

    t = base + steps * alpha_step + bytes_sent / (bandwidth * protocol_efficiency)

minimised over NCCL's protocols LL, LL128 and Simple. ``base`` and ``alpha_step`` are
NCCL's latency model (NVIDIA/nccl src/graph/tuning.cc, ring; see the catalog and
../shared/reference/public-facts.md); protocol efficiencies: LL sends 4 data bytes per
8-byte line (0.5), LL128 120 of 128 bytes (0.9375), Simple 1 (NCCL protocol definitions).
``busbw = algbw * bytes_sent / S`` (nccl-tests doc/PERFORMANCE.md), ``algbw = S / t``.

Handed case C12: n 8, S 14 GB, 50 GB/s per rank: all-reduce sends 24.5 GB, 0.49 s.

>>> round(ring_time("all-reduce", 8, 14e9, 50e9, latency=NO_LATENCY), 4)
0.49
>>> busbw_factor("all-reduce", 8), busbw_factor("all-gather", 8)
(1.75, 0.875)
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "send/recv")


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: base latency and per-step latency (seconds) on NVLink and on the
    network, and the fraction of link bandwidth it carries data at."""

    name: str
    base_s: float
    step_nvlink_s: float
    step_network_s: float
    efficiency: float


#: NCCL ring latencies (us) from src/graph/tuning.cc (public-facts.md); efficiencies from
#: the LL (8-byte line, 4 data bytes) and LL128 (128-byte line, 120 data bytes) formats.
NCCL_RING = (
    Protocol("LL", 6.6e-6, 0.6e-6, 2.7e-6, 0.5),
    Protocol("LL128", 14.0e-6, 1.9e-6, 4.0e-6, 120 / 128),
    Protocol("Simple", 8.4e-6, 3.4e-6, 14.0e-6, 1.0),
)
NO_LATENCY = (Protocol("ideal", 0.0, 0.0, 0.0, 1.0),)
#: gloo (torch's CPU backend) has one protocol: each ring step costs the link's own latency
#: (the per-step values 3.4 us / 14 us are the references ``latency_scale`` is taken against,
#: so the scaled step equals the link's ``latency_us``), no base, full bandwidth.
GLOO_RING = (Protocol("gloo", 0.0, 3.4e-6, 14.0e-6, 1.0),)


def steps(op: str, n: int) -> int:
    """Algorithm steps of ``op`` over ``n`` ranks (ring or pairwise)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    if n <= 1:
        return 0
    return {"all-reduce": 2 * (n - 1), "send/recv": 1}.get(op, n - 1)


def busbw_factor(op: str, n: int) -> float:
    """bytes each rank sends / S: 2(n-1)/n all-reduce, (n-1)/n all-gather, reduce-scatter and
    all-to-all, 1 broadcast and send/recv (nccl-tests doc/PERFORMANCE.md)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    if op in ("broadcast", "send/recv"):
        return 1.0
    if n <= 1:
        return 0.0
    return (2.0 if op == "all-reduce" else 1.0) * (n - 1) / n


def ring_time(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float,
              network: bool = False, latency=NCCL_RING, latency_scale: float = 1.0) -> float:
    """Seconds for ``op`` over ``n`` ranks on a ``size_bytes`` buffer, each rank sending at
    ``bandwidth_bytes_per_s`` on its slowest link; ``network`` picks the per-step latency,
    ``latency_scale`` scales it (a calibrated link's per-step latency / NCCL's Simple value).
    See the module docstring for the formula and sources. 0 for n <= 1."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    sent = busbw_factor(op, n) * size_bytes
    k = steps(op, n)
    return min(p.base_s + k * latency_scale * (p.step_network_s if network else p.step_nvlink_s)
               + sent / (bandwidth_bytes_per_s * p.efficiency) for p in latency)


def algbw(size_bytes: float, time_s: float) -> float:
    """nccl-tests algbw = S / t (bytes/s)."""
    return size_bytes / time_s if time_s > 0 else 0.0


def busbw(op: str, n: int, size_bytes: float, time_s: float) -> float:
    """nccl-tests busbw = algbw * busbw_factor(op, n) (bytes/s)."""
    return algbw(size_bytes, time_s) * busbw_factor(op, n)


#: NCCL tree latencies (us) from src/graph/tuning.cc (public-facts.md), LL / LL128 / Simple.
NCCL_TREE = (
    Protocol("LL", 6.8e-6, 0.6e-6, 5.0e-6, 0.5),
    Protocol("LL128", 14.0e-6, 1.25e-6, 8.5e-6, 120 / 128),
    Protocol("Simple", 8.4e-6, 4.0e-6, 14.0e-6, 1.0),
)
#: NVLS all-reduce bus bandwidth over the NVLink per-direction rate: 480 GB/s busbw measured on
#: 8x H200 with NVLink SHARP against the 450 GB/s link (togethercomputer/together-nccl-tests;
#: stas00/ml-engineering network README; public-facts.md).
NVLS_GAIN = 480 / 450


def tree_time(n: int, size_bytes: float, bandwidth_bytes_per_s: float, network: bool = True,
              latency_scale: float = 1.0) -> float:
    """All-reduce on NCCL's double binary tree: ``2 ceil(log2 n)`` steps (reduce up, broadcast
    down) at the tree latencies, the same bytes per rank as the ring (each tree carries half
    the buffer both ways)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    depth = 2 * max(1, (n - 1).bit_length())
    sent = busbw_factor("all-reduce", n) * size_bytes
    return min(p.base_s + depth * latency_scale * (p.step_network_s if network else p.step_nvlink_s)
               + sent / (bandwidth_bytes_per_s * p.efficiency) for p in NCCL_TREE)


def collective_time(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float, kind: str,
                    nvls: bool = False, latency_scale: float = 1.0, nodes: int = 1,
                    intra_bandwidth_bytes_per_s: float = 0.0, library: str = "nccl") -> tuple[str, float]:
    """(algorithm, seconds): the fastest of the algorithms NCCL can run for ``op`` on a path of
    ``kind`` ("nvlink" inside a node or NVLink domain, "network" across ``nodes`` nodes):

    - ``ring`` (:func:`ring_time`), every op;
    - ``NVLS`` for all-reduce inside an NVSwitch domain with in-switch reduction (``nvls``):
      the ring's bytes at ``NVLS_GAIN`` x the link rate, after the Simple base latency plus
      two NVLink steps (an assumption: NCCL's NVLS latency is not in public-facts.md);
    - ``tree`` for all-reduce across nodes (:func:`tree_time`): fewer latency steps;
    - ``hierarchical`` across nodes with ``n / nodes`` > 1 ranks per node: reduce-scatter
      inside the node (NVLink), the op across nodes on 1/g of the buffer, all-gather inside.

    ``library`` other than "nccl" (gloo): the ring only, with :data:`GLOO_RING`'s single protocol
    (per step exactly the link's latency, full bandwidth); a reduce-scatter costs an all-reduce
    of its full buffer, since ProcessGroupGloo runs it as one (torch 2.13; measured on the
    testbed: 105 ms against 52 ms for an all-gather of the same 107 kB buffer over 4 ranks).

    >>> collective_time("all-reduce", 8, 1 << 30, 450e9, "nvlink", nvls=True)[0]
    'NVLS'
    >>> collective_time("all-reduce", 64, 4096, 50e9, "network", nodes=64)[0]
    'tree'
    """
    network = kind == "network"
    if library != "nccl":  # gloo runs rings only, with one protocol; reduce-scatter as a full all-reduce
        run = "all-reduce" if op == "reduce-scatter" else op
        return "ring", ring_time(run, n, size_bytes, bandwidth_bytes_per_s, network, GLOO_RING, latency_scale)
    best = ("ring", ring_time(op, n, size_bytes, bandwidth_bytes_per_s, network, latency_scale=latency_scale))
    if n <= 1:
        return best
    options = []
    if op == "all-reduce" and kind == "nvlink" and nvls:
        sent = busbw_factor(op, n) * size_bytes
        # latency assumed: the Simple ring base plus one NVLink step up to the switch and one down
        lat = NCCL_RING[2].base_s + 2 * latency_scale * NCCL_RING[2].step_nvlink_s
        options.append(("NVLS", lat + sent / (bandwidth_bytes_per_s * NVLS_GAIN)))
    if op == "all-reduce" and network:
        options.append(("tree", tree_time(n, size_bytes, bandwidth_bytes_per_s, True, latency_scale)))
    g = n // max(nodes, 1)
    if network and nodes > 1 and g > 1 and intra_bandwidth_bytes_per_s and op in ("all-reduce", "all-gather",
                                                                                  "reduce-scatter"):
        intra = intra_bandwidth_bytes_per_s
        inter = ring_time(op, nodes, size_bytes / g, bandwidth_bytes_per_s / g, True, latency_scale=latency_scale)
        local = {"all-reduce": ("reduce-scatter", "all-gather"), "all-gather": ("all-gather",),
                 "reduce-scatter": ("reduce-scatter",)}[op]
        options.append(("hierarchical", inter + sum(ring_time(o, g, size_bytes, intra) for o in local)))
    for name, t in options:
        if t < best[1]:
            best = (name, t)
    return best
