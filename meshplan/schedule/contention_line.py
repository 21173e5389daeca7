"""The ``SM contention:`` line of ``meshplan step``: how much of the compute part is kernels
slowed by the collectives they overlap (:meth:`~meshplan.schedule.step_summary.StepTime.contention_s`).

Why it is a line of its own (calib37): the compute part is the kernels' own time plus this
slowdown, and the slowdown grows and shrinks with the overlapped collectives' length, so a
``--calibration`` of the NVLink (which changes only collectives) moves the compute part by
exactly the change of this figure. The mechanism: NCCL runs one thread block per channel, each
resident on one SM for the whole collective, so an NVLink collective holds
``fabric.nccl_channels / gpu.sms`` of the SMs while it runs (NVIDIA/nccl-tests issue #100: 24
channels on an HGX A100, 108 SMs: 22%) and a network one its NCCL channels over the SMs (rings 2
x NICs, a send/recv ceil(NIC GB/s / 14): DGX H100 16 and 4 of 132;
:func:`~meshplan.schedule.row_shares.nccl_net_channels`; :func:`~meshplan.schedule.comm_times.nccl_sm_share`),
and the kernels it overlaps progress at the rest (:meth:`~meshplan.schedule.unit_sim.StreamSim.compute`).
"""

from __future__ import annotations


def contention_line(st) -> list[str]:
    """``SM contention: ...`` for the step ``st`` (a :class:`~meshplan.schedule.step_summary.StepTime`)
    when its contention is 0.01 ms or more, else none; the share printed is the largest of the
    critical stage's collectives."""
    slow = st.contention_s()
    if round(slow * 1e5) <= 0:
        return []
    s = st.critical_stage
    share = max(st.units.comms[s].share.values(), default=0.0)
    rest = st.parts_s()["compute"] - slow
    return [f"SM contention: compute on stage {s} includes {slow * 1e3:.2f} ms of kernels slowed by the collectives "
            f"they overlap: a collective's NCCL channels hold up to {share:.0%} of the SMs while it runs (one thread "
            "block per channel over SMs: catalog nccl_channels on NVLink, NCCL's rings 2 x NICs and send/recv "
            "ceil(NIC GB/s / 14) over the network; NVIDIA/nccl-tests issue #100, NVIDIA/nccl src/graph/connect.cc, "
            "src/graph/paths.cc), so this time moves with "
            f"those collectives' length (a --calibration of the link moves it; compute less it, {rest * 1e3:.2f} ms, "
            "does not)"]
