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

On a link class without a measured curve (line rate):

    t = base + steps * alpha_step + bytes_sent / (bandwidth * protocol_efficiency)

minimised over NCCL's protocols LL, LL128 and Simple. ``base`` and ``alpha_step`` are
NCCL's latency model (:data:`meshplan.comm.nccl_protocols.NCCL_LATENCY_US`, NVIDIA/nccl
src/graph/tuning.cc; public-facts.md and public-microbenchmarks.md 4e); protocol efficiencies: LL sends 4 data bytes per 8-byte
line (0.5), LL128 120 of 128 bytes (0.9375), Simple 1 (NCCL protocol definitions).
``busbw = algbw * bytes_sent / S`` (nccl-tests doc/PERFORMANCE.md), ``algbw = S / t``.

On a link class with a measured nccl-tests curve (catalog ``nccl.toml``), alpha is NCCL's
latency (fastest protocol) and beta the bus bandwidth of the measurement's bandwidth term at
size S (:func:`measured_time`):

    t = lat(n) + bytes_sent / (beta(S) * bandwidth / line_rate)
    beta(S) = f S / (t_meas(S) - lat(n_ref))

where ``t_meas`` is the measured time of the curve's op over its n_ref ranks (``f =
busbw_factor`` of that op), linear in S between two measured sizes (the alpha-beta line
through them), and ``bandwidth / line_rate`` scales the curve to a path with another share of
the links; across nodes it scales the size too (:func:`read_bytes`): ``beta`` is read at ``S' =
S line_rate / bandwidth``, where each of the run's links carried the bytes this collective puts
on the path's (a 2 x 8-GPU run's 8 NICs per node for one rank per node: at 8 S; at S each NIC
carried an eighth of it). At the measured rank count and line rate the predicted busbw equals
the measured one at every measured size; at other rank counts busbw is kept (nccl-tests'
convention) and the latency is NCCL's for that many steps. Outside the measured sizes: below the smallest,
``t_meas`` runs linearly from ``lat(n_ref)`` at S = 0 to the first measurement (NCCL's latency
plus the first measurement's bandwidth term), held at the first measurement where ``lat(n_ref)``
exceeds it (latency-bound: the measurement wins, :func:`measured_time`); above the largest, it
continues along the last segment (the plateau's slope).

Handed case C12: n 8, S 14 GB, 50 GB/s per rank: all-reduce sends 24.5 GB, 0.49 s.

>>> from meshplan.comm.nccl_protocols import NO_LATENCY
>>> round(ring_time("all-reduce", 8, 14e9, 50e9, latency=NO_LATENCY), 4)
0.49
>>> busbw_factor("all-reduce", 8), busbw_factor("all-gather", 8)
(1.75, 0.875)
"""

from __future__ import annotations

import bisect
from itertools import accumulate
from typing import Optional

from meshplan.comm.nccl_protocols import CALIBRATED, NCCL_RING, NCCL_TREE, REFERENCE_STEP_S, Protocol
from meshplan.spec.cluster import BusbwCurve
from meshplan.units import GB, US

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "broadcast", "send/recv")


def steps(op: str, n: int) -> int:
    """Algorithm steps of ``op`` over ``n`` ranks (ring or pairwise)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; known: {OPS}")
    if n <= 1:
        return 0
    return {"all-reduce": 2 * (n - 1), "send/recv": 1}.get(op, n - 1)


def step_latency(latency: float, op: str, n: int) -> float:
    """A fitted per-call alpha ``latency`` of ``op`` over ``n`` ranks per algorithm step
    (:func:`steps`), in its unit: what a calibrated link's ``latency_us`` holds
    (:class:`meshplan.comm.calibration.CalibratedLink`) and a curve read at its own alpha takes.

    >>> step_latency(28.0, "all-reduce", 8), step_latency(30.0, "all-to-all", 16)
    (2.0, 2.0)
    """
    return latency / max(steps(op, n), 1)


def own_alpha(curve: BusbwCurve, network: bool, fallback: float) -> tuple[tuple[Protocol, ...], float]:
    """(protocols, latency scale) a calibrated class's curve of its own run (its ``a2a`` or per-op
    curve) is read at: its run's fitted alpha (``curve.latency_us``, ``meshplan calibrate``) per step,
    one protocol with no base (:data:`CALIBRATED`), so at the run's op and ranks the latency is that
    alpha; a curve without one (a file of before it) at ``fallback``, the class fit's scale.

    >>> c = BusbwCurve(op="all-to-all", ranks=16, line_gb_per_s=50.0, sizes_bytes=[1], busbw_gb_per_s=[1.0],
    ...                source="x", latency_us=30.0)
    >>> round(own_alpha(c, True, 1.0)[1] * REFERENCE_STEP_S["network"] * 1e6, 6)
    2.0
    """
    if curve.latency_us is None:
        return CALIBRATED, fallback
    return CALIBRATED, step_latency(curve.latency_us * US, curve.op, curve.ranks) / REFERENCE_STEP_S[
        "network" if network else "nvlink"]


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


def measured_time(curve: BusbwCurve, size_bytes: float, sent_bytes: float, latency_s: float,
                  reference_latency_s: float, bandwidth_bytes_per_s: float,
                  read_bytes: Optional[float] = None) -> float:
    """Seconds for a rank to send ``sent_bytes`` of a ``size_bytes`` collective, read from the
    measured ``curve`` at ``S' = read_bytes`` (default ``size_bytes``; the module docstring):

        t = latency_s + sent_bytes / (beta(S') * bandwidth / line)
        beta(S') = f S' / (t_meas(S') - reference_latency_s)

    ``t_meas``: the curve's times ``t_i = f S_i / busbw_i`` (``f = busbw_factor(curve.op,
    curve.ranks)``) after the point (0, ``reference_latency_s``), joined by straight lines in S
    and continued along the last segment beyond the largest size, each ``t_i`` raised to the
    largest time before it (measured rows are flat between 64 KiB and 1 MiB and can dip: a
    larger buffer is never modelled faster than a smaller one); ``beta`` is infinite where
    ``t_meas`` does not exceed the latency. ``latency_s`` and ``reference_latency_s``: NCCL's
    latency (or a calibrated run's fitted alpha) for this group and for the curve's rank count
    (same algorithm and link); ``line``: the curve's ``line_gb_per_s``.

    Below the smallest logged size ``S_1`` the collective is latency-bound: no smaller buffer
    takes longer than the logged ``t_1`` (a larger one's measured time), and none less than the
    latency. Where the latency exceeds ``t_1`` (a least-squares alpha, whose intercept the large
    sizes pull up, above the smallest logged time; or NCCL's model above a fast fabric's
    measurement) the measurement wins: the reference latency is lowered to ``t_1``, and
    ``latency_s`` by the same ratio (the per-step latency lowered alike), so ``t_meas`` holds
    ``t_1`` from S = 0 to ``S_1`` and the logged point is met exactly at its own size; otherwise
    ``t_meas`` runs linearly from the latency at S = 0 to ``t_1``. Either way the time is
    continuous at ``S_1`` and never falls as S grows.

    8-GPU A100 all-reduce of 192 MiB, between the S15 rows 128M (176.9 GB/s) and 256M (194.07):
    t(128M) = 1.75 * 2^27 / 176.9e9 = 1327.8 us, t(256M) = 2420.6 us, half way: 1874.2 us,
    busbw 1.75 * 192 MiB / 1874.2 us = 188.0 GB/s.

    >>> from meshplan.catalog import busbw_curve
    >>> c = busbw_curve("a100-nvlink3-ring")
    >>> t = measured_time(c, 3 * 2**26, 1.75 * 3 * 2**26, 15e-6, 15e-6, 300e9)
    >>> round(t * 1e6, 1), round(1.75 * 3 * 2**26 / t / 1e9, 1)
    (1874.2, 188.0)
    """
    f, line = busbw_factor(curve.op, curve.ranks), curve.line_gb_per_s * GB
    read = size_bytes if read_bytes is None else read_bytes
    sizes = [0.0] + [float(x) for x in curve.sizes_bytes]
    logged = [f * x / (b * GB) for x, b in zip(curve.sizes_bytes, curve.busbw_gb_per_s)]
    if 0 < logged[0] < reference_latency_s:  # the smallest logged time bounds the latency (latency-bound)
        latency_s, reference_latency_s = latency_s * logged[0] / reference_latency_s, logged[0]
    times = list(accumulate([reference_latency_s] + logged, max))  # a larger buffer is never faster
    k = max(0, min(bisect.bisect_right(sizes, read) - 1, len(sizes) - 2))
    t_meas = times[k] + (times[k + 1] - times[k]) * (read - sizes[k]) / (sizes[k + 1] - sizes[k])
    spent = t_meas - reference_latency_s  # the measurement's bandwidth term
    if spent <= 0 or read <= 0:
        return latency_s
    return latency_s + sent_bytes * line * spent / (f * read * bandwidth_bytes_per_s)


def rank_factor(curve: Optional[BusbwCurve], n: int) -> float:
    """busbw over ``n`` ranks / busbw over the curve's ranks, from the curve's ``rank_counts``
    table (linear in n between its counts, the end values beyond them); 1 without a table.

    NVLS on H200 (S16, 8 GiB): 4 GPUs 363.3 GB/s against 8 GPUs 473.1: 0.768.

    >>> from meshplan.catalog import busbw_curve
    >>> round(rank_factor(busbw_curve("h200-nvlink4-nvls"), 4), 3)
    0.768
    """
    if curve is None or not curve.rank_counts:
        return 1.0
    counts, bus = curve.rank_counts, curve.rank_busbw_gb_per_s

    def at(k: int) -> float:
        if k <= counts[0] or k >= counts[-1]:
            return bus[0] if k <= counts[0] else bus[-1]
        j = bisect.bisect_right(counts, k) - 1
        return bus[j] + (bus[j + 1] - bus[j]) * (k - counts[j]) / (counts[j + 1] - counts[j])

    return at(n) / at(curve.ranks)


def read_bytes(curve: Optional[BusbwCurve], size_bytes: float, bandwidth_bytes_per_s: float, shared: bool) -> float:
    """The size ``curve`` is read at for a ``size_bytes`` collective: ``S line / bandwidth`` where
    ``shared`` (across nodes, module docstring), else S. The 2 x 8 H200 all-gather log of 8 NICs
    (line 8 x 42.78 GB/s) for one rank per node on its 42.78 GB/s NIC: 64 MiB at 512 MiB."""
    if curve is None or not shared:
        return size_bytes
    return size_bytes * curve.line_gb_per_s * GB / bandwidth_bytes_per_s


def algorithm_time(size_bytes: float, sent_bytes: float, k: int, network: bool, bandwidth_bytes_per_s: float,
                   latency=NCCL_RING, latency_scale: float = 1.0, curve: Optional[BusbwCurve] = None,
                   k_ref: int = 0, shared: bool = False) -> float:
    """The module docstring's two formulas for one algorithm of ``k`` latency steps (``k_ref``
    at the curve's rank count; every algorithm of :mod:`meshplan.comm.nccl_algorithms` is timed by it):
    line rate minimised over ``latency``'s protocols, or the
    measured ``curve`` with the fastest protocol's latency, read at ``S line / bandwidth`` where
    ``shared`` (a ring or tree across nodes on its share of the curve's NICs), else at S."""
    def lat(p: Protocol, steps_: int) -> float:
        return p.base_s + steps_ * latency_scale * (p.step_network_s if network else p.step_nvlink_s)

    if curve is None:
        return min(lat(p, k) + sent_bytes / (bandwidth_bytes_per_s * p.efficiency) for p in latency)
    return measured_time(curve, size_bytes, sent_bytes, min(lat(p, k) for p in latency),
                         min(lat(p, k_ref) for p in latency), bandwidth_bytes_per_s,
                         read_bytes(curve, size_bytes, bandwidth_bytes_per_s, shared))


def ring_time(op: str, n: int, size_bytes: float, bandwidth_bytes_per_s: float,
              network: bool = False, latency=NCCL_RING, latency_scale: float = 1.0,
              curve: Optional[BusbwCurve] = None) -> float:
    """Seconds for ``op`` over ``n`` ranks on a ``size_bytes`` buffer, each rank sending at
    ``bandwidth_bytes_per_s`` on its slowest link; ``network`` picks the per-step latency,
    ``latency_scale`` scales it (a calibrated link's per-step latency / NCCL's Simple value);
    ``curve``: the link's measured nccl-tests curve. See the module docstring for the formulas
    and sources. 0 for n <= 1."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    k_ref = steps(curve.op, curve.ranks) if curve else 0
    return algorithm_time(size_bytes, busbw_factor(op, n) * size_bytes, steps(op, n), network, bandwidth_bytes_per_s,
                 latency, latency_scale, curve, k_ref, shared=network)


def algbw(size_bytes: float, time_s: float) -> float:
    """nccl-tests algbw = S / t (bytes/s)."""
    return size_bytes / time_s if time_s > 0 else 0.0


def busbw(op: str, n: int, size_bytes: float, time_s: float) -> float:
    """nccl-tests busbw = algbw * busbw_factor(op, n) (bytes/s)."""
    return algbw(size_bytes, time_s) * busbw_factor(op, n)


def _tree_depth(n: int) -> int:
    return 2 * max(1, (n - 1).bit_length())


def tree_time(n: int, size_bytes: float, bandwidth_bytes_per_s: float, network: bool = True,
              latency_scale: float = 1.0, curve: Optional[BusbwCurve] = None) -> float:
    """All-reduce on NCCL's double binary tree: ``2 ceil(log2 n)`` steps (reduce up, broadcast
    down) at the tree latencies, the same bytes per rank as the ring (each tree carries half
    the buffer both ways)."""
    if n <= 1 or size_bytes <= 0:
        return 0.0
    k_ref = _tree_depth(curve.ranks) if curve else 0
    return algorithm_time(size_bytes, busbw_factor("all-reduce", n) * size_bytes, _tree_depth(n), network,
                 bandwidth_bytes_per_s, NCCL_TREE, latency_scale, curve, k_ref, shared=network)
