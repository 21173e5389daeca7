"""step's lines on the collectives and the links of the critical stage's ranks (the ``step``
command, :mod:`meshplan.cli.step_cmd`, prints them after the critical path): each collective
kind's first occurrence with its ready time, deadline, duration and slack
(:func:`~meshplan.schedule.readiness.timings`), the streams whose collectives share a NIC
(:mod:`meshplan.schedule.nic_sharing`), and the load on each NVLink, NIC and rail uplink per step
(:func:`~meshplan.schedule.linkload.edge_loads`), with where a network edge's traffic goes when it
does not fit (:mod:`meshplan.schedule.link_spill`) and the table of a stage whose ranks send more.
"""

from __future__ import annotations

from meshplan.cli.common import _echo
from meshplan.comm.calibration_replaced import capacity_words
from meshplan.schedule.link_spill import network_spill, other_stage_loads, spill_line, stage_fits
from meshplan.schedule.linkload import edge_loads
from meshplan.schedule.netload import pxn_line
from meshplan.schedule.nic_sharing import concurrent_lines
from meshplan.schedule.readiness import p2p_calls, step_rows, timings
from meshplan.schedule.stage_traffic import traffic_words


def print_links(p, st, step_fn) -> None:
    """Readiness of each collective kind, concurrency and the load on each physical edge, and,
    where a network edge does not fit its window, where its traffic goes
    (:mod:`meshplan.schedule.link_spill`; ``step_fn``: re-plans' steps, for async TP's)."""

    _echo("collectives on stage 0, first occurrence (ms from step start): ready, deadline, duration, slack "
          "(deadline - ready - duration: 0 when the next op waits for it, < 0 exposed; a cp K/V all-gather's "
          "deadline is the end of the Q projection it runs beside; under torch's ring attention a K/V all-gather or "
          "dK/dV shift (send/recv) runs beside the SDPA step after it, whose end is its deadline, and each layer's "
          "last shift, waited for at once, is in the parts line's exposed cp; under Transformer Engine's p2p ring "
          "(Megatron-LM's) each K/V or dK/dV send/recv runs beside the attention step it precedes, whose end is its "
          "deadline; a step row names the plan rows it stands for by their cadence, 'rows:'; 'one event for N "
          "calls': a layer's SP norm-weight gradient all-reduces merged, duration their sum)")
    for t in timings(st):
        rows = step_rows(p, t)
        _echo(f"  {st.named(t.stream):13s} {t.phase:8s} {t.op:15s} {t.ready_s * 1e3:10.3f} {t.deadline_s * 1e3:10.3f} "
                   f"{t.duration_s * 1e3:9.3f} {t.slack_s * 1e3:10.3f}" + (f"  (rows: {rows})" if rows else "")
              + (f"  (issued {t.issued})" if t.issued else "") + _merged(t))
    if sends := p2p_calls(st):
        _echo(f"  not listed: pp send/recv between stages (stage 0 sends {sends} per schedule run): counted in the "
              f"parts line's exposed pp (their transfers; a blocking call's wait for its partner stage is bubble)")
    for line in concurrent_lines(st):
        _echo(line)
    other = other_stage_loads(p, st)
    more = "" if other is None or stage_fits(other[1]) else " and a NIC or uplink of it does not fit"
    where = "" if other is None else f"; stage {other[0]}'s ranks send more{more}: its table follows"
    loads = _print_edge_table(p, st, 0, edge_loads(p, st), where)
    spill = network_spill(p, st) if not stage_fits(loads) else None
    if spill is not None:
        _echo(f"  {spill_line(p, st, spill, step_fn)}")
    if other is not None:  # the stage whose links are loaded most (meshplan.schedule.stage_traffic)
        _print_edge_table(p, st, other[0], other[1], f"; {traffic_words(p, other[0])}")


def _merged(t) -> str:
    """A first-occurrence row's note where its event stands for several calls of the plan's table
    (:attr:`~meshplan.schedule.readiness.Timing.calls`), with the time of one (nc54 #9)."""
    if t.calls == 1.0:
        return ""
    return f"  (one event for {t.calls:.3g} calls, {t.duration_s / t.calls * 1e3:.4f} ms each)"


def _print_edge_table(p, st, stage: int, loads: list, more: str) -> list:
    """The edge-load table of ``stage``, ``loads`` (:func:`~meshplan.schedule.linkload.edge_loads`),
    its header naming the stage, its first rank and node, ``more`` after them; ``loads``."""
    window = f"{loads[0].interval_s:.3f} s of the {st.step_s:.3f} s step" if loads else "none"
    rank = st.example_ranks[stage]
    _echo(f"edge load per step on stage {stage} (rank {rank}, node {int(p.placement.node[rank])}{more}) (busy = "
          f"bytes / capacity; the window it must fit in: stage {stage}'s compute time, its forward, backward and "
          f"recompute kernels ({window}: not the step), and per layer the layer's forward + backward time)")
    _echo(f"  {capacity_words(p.config.cluster)}")
    for e in loads:
        verdict = "fits" if e.fits else "DOES NOT FIT"
        _echo(f"  {e.edge:36s} {e.bytes_per_step / 1e9:10.1f} GB  busy {e.busy_s:8.3f} s of {e.interval_s:8.3f} s; "
                   f"per layer {e.per_layer_bytes / e.capacity_bytes_per_s * 1e3:8.3f} of "
                   f"{e.layer_interval_s * 1e3:8.3f} ms: {verdict}")
    for line in pxn_line(p, p.stage(stage).collectives) if loads else []:
        _echo(line)
    return loads
