"""How concurrent network collectives share a NIC (issue 11 item 2): max-min fair sharing of the
NIC's capacity given each one's demand (:func:`max_min_shares`), which the unit's event-ordered run
(:mod:`~meshplan.schedule.unit_events`) applies at every event to the network collectives running
(an earlier one slowed by a later one from the later one's start), and what the sharing cost each
stream (:func:`nic_waits`).

The rule's source: NCCL gives concurrent communicators no priority. Each posts its transfers on its
own queue pairs and the NIC serves them together: two concurrent nccl-tests broadcasts on one link
each ran at half the link's rate and together at its rate (NVIDIA/nccl issue #204); NCCL splits a
transfer over its channels' connections, two per NIC, to keep it near the NIC's rate (issue #438).
A collective's demand is the share of the NIC it holds alone (its bytes through the NIC at the
line rate over its time, :func:`~meshplan.schedule.comm_times.nic_share`): one that leaves the NIC
idle part of its time (latency, NVLink phases) holds less and is slowed less. Work-conserving: the
NIC's capacity not used by a collective whose demand is under the fair level goes to the others,
and while the demands running exceed the NIC it is full.
"""

from __future__ import annotations

from bisect import bisect_left

#: Two times closer than this (seconds) are the same time.
EPS_S = 1e-12


def max_min_shares(demands) -> list[float]:
    """The share of a NIC of capacity 1 that each collective of ``demands`` running together gets
    under max-min fairness (water-filling): in ascending order of demand each gets its demand while
    it is under the level ``capacity left / collectives left``, the rest get the level.

    Demands 0.75 and 0.8: the level 1/2 under both, each gets half (the NIC full); 0.2 beside 0.9:
    0.2 gets all it wants, 0.9 the 0.8 left; three at 1.0: a third each; 0.3 and 0.5: room for both.

    >>> max_min_shares([0.75, 0.8]), max_min_shares([0.9, 0.2]), max_min_shares([0.3, 0.5])
    ([0.5, 0.5], [0.8, 0.2], [0.3, 0.5])
    >>> [round(x, 6) for x in max_min_shares([1.0, 1.0, 1.0])]
    [0.333333, 0.333333, 0.333333]
    """
    order = sorted(range(len(demands)), key=demands.__getitem__)
    out, cap = [0.0] * len(demands), 1.0
    for k, i in enumerate(order):
        level = cap / (len(order) - k)
        if demands[i] > level:
            for rest in order[k:]:
                out[rest] = level
            return out
        out[i] = demands[i]
        cap -= demands[i]
    return out


def nic_waits(nets) -> dict:
    """{(stream, other stream): seconds}: each network collective's lengthening (its end less its
    start and its seconds alone) charged to the streams of the collectives it ran beside, by
    demand x overlap. ``nets``: (start, end, seconds alone, demand, shown stream, queue) each, in
    issue order (a queue's run one after another: starts and ends ascending). One issued infinitely
    early (start -inf) is not lengthened.

    The all-gather (0.75, 10 ms alone) from 0 to 12.667 ms beside the cp send (0.8, 5 ms alone)
    from 1 to 9 ms (test_nic_sharing): fsdp 2.667 ms beside cp, cp 3 ms beside fsdp.

    >>> w = nic_waits([(0.0, 0.012667, 0.010, 0.75, "fsdp", "fsdp"), (0.001, 0.009, 0.005, 0.8, "cp", "cp")])
    >>> {k: round(v * 1e3, 3) for k, v in w.items()}
    {('fsdp', 'cp'): 2.667, ('cp', 'fsdp'): 3.0}
    """
    by_queue: dict[str, list[int]] = {}
    starts: dict[str, list[float]] = {}
    for j, n in enumerate(nets):
        by_queue.setdefault(n[5], []).append(j)
        starts.setdefault(n[5], []).append(n[0])
    out: dict = {}
    for j, (a, b, work, _, who, _) in enumerate(nets):
        late = b - a - work
        if not late > EPS_S:  # nan: issued infinitely early
            continue
        weights: dict = {}
        for q, idx in by_queue.items():  # the collectives but j whose intervals meet (a, b)
            for k in reversed(idx[:bisect_left(starts[q], b)]):
                if nets[k][1] <= a:
                    break
                if k != j:
                    o = nets[k]
                    weights[o[4]] = weights.get(o[4], 0.0) + o[3] * (min(o[1], b) - max(o[0], a))
        total = sum(weights.values())
        for other, w in weights.items():
            if w > 0:
                out[(who, other)] = out.get((who, other), 0.0) + late * w / total
    return out
