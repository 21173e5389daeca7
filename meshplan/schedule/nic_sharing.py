"""What sharing NICs costs the collectives that run at once (``meshplan step``'s ``concurrent:``
lines): the seconds per step a stream's network collectives ran longer because another stream's,
running at the same time (earlier or later issued), held a share of the same NICs (:mod:`~meshplan.schedule.unit_events`,
the shares from :func:`~meshplan.schedule.comm_times.nic_share`). The lengthening is in the
timeline: the parts line's exposure holds what of it the compute stream waited for.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from meshplan.schedule.linkload import concurrency


def nic_waits(st, stage: int = 0) -> dict[tuple[str, str], float]:
    """{(stream, other stream): seconds per step} that ``stage``'s collectives of the stream ran
    longer sharing their NICs with the other's (:attr:`~meshplan.schedule.unit_sim.UnitSim.nic_wait`
    of each of the stage's units, every schedule run)."""
    res = st.pipeline
    keys, idx = st.unit_index if st.unit_index else st.units.index(res.flat)
    counts = np.bincount(idx[res.stage_slice(stage)], minlength=len(keys))
    out: defaultdict[tuple[str, str], float] = defaultdict(float)
    for k, n in zip(keys, counts.tolist()):
        for pair, sec in (st.units.by_key(k).nic_wait.items() if n else ()):
            out[pair] += st.runs * n * sec
    return dict(out)


def concurrent_lines(st, stage: int = 0) -> list[str]:
    """One ``concurrent:`` line per pair of streams whose collectives overlap on ``stage``
    (:func:`~meshplan.schedule.linkload.concurrency`), with what sharing NICs cost each of the two
    (:func:`nic_waits`), or that it cost nothing; then one per stream whose collectives of two
    queues shared NICs (the gradient reduction's pieces shown on the group they run over, beside
    that group's own collectives: a ZeRO-1 reduce-scatter over dp x cp beside the cp ring's sends;
    FSDP2's reduce-scatters beside its all-gathers, both shown on fsdp: ``Overlap.fsdp_rs_queue``)."""
    waits = nic_waits(st, stage)
    out = []
    for (a, b), sec in sorted(concurrency(st, stage).items()):
        paid = _paid(st, waits, ((a, b), (b, a)))
        how = (f"sharing NICs lengthens {paid} per step ({LATER})" if paid else
               "nothing charged: they do not both cross a NIC, or its line rate carries both; NVLink and copy "
               "engines are not shared in the model")
        out.append(f"concurrent: {st.named(a)} and {st.named(b)} overlap {sec * 1e3:.1f} ms per step ({how})")
    for a in sorted({a for a, b in waits if a == b}):
        if paid := _paid(st, waits, ((a, a),)):
            out.append(f"concurrent: {st.named(a)}'s collectives of two queues ({TWO_QUEUES}): sharing NICs "
                       f"lengthens {paid} per step ({LATER})")
    return out


#: Which two queues of one stream's collectives meet on its NICs.
TWO_QUEUES = ("its own and the gradient reduction's pieces over its group, or FSDP2's all-gathers and "
              "reduce-scatters on their two streams")


#: How the lengthening is charged (:func:`~meshplan.schedule.nic_fair.nic_waits`).
LATER = ("each runs at its max-min fair share of the NIC while they run together, the earlier slowed by the later "
         "too; the parts line's exposure holds what compute waited for")


def _paid(st, waits: dict, pairs) -> str:
    """``cp's collectives by 12.3 ms`` for each (stream, other) of ``pairs`` lengthened 0.1 ms or
    more per step (:func:`nic_waits`), joined by ``and``; "" for none."""
    return " and ".join(f"{st.named(x)}'s collectives by {waits[(x, y)] * 1e3:.1f} ms" for x, y in pairs
                        if round(waits.get((x, y), 0.0) * 1e4) > 0)
