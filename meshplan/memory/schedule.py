"""Order of forward and backward passes on one pipeline stage during one training step.

An op is ``(phase, chunk, microbatch)``: the forward or backward pass of model chunk
``chunk`` (virtual stage; 0 without interleaving) of this stage for one micro-batch.

- ``gpipe`` (Huang et al. 2019): every forward, then every backward; a stage holds all m.
- ``1f1b`` (Narayanan et al. SC'21, 2.2.1; PipeDream-Flush): stage k runs
  ``min(pp - k - 1, m)`` warm-up forwards, then alternates one forward and one backward,
  then drains the backwards; it holds ``min(m, pp - k)`` micro-batches at its peak.
- ``interleaved_1f1b`` (Narayanan et al. 2.2.2, Megatron-LM
  ``forward_backward_pipelining_with_interleaving``): ``m vpp`` chunk passes; warm-up
  ``min(m vpp, 2 (pp - k - 1) + (vpp - 1) pp)``; forward pass i runs chunk
  ``(i mod pp vpp) // pp`` on micro-batch ``(i // (pp vpp)) pp + i mod pp``, backward pass i
  the chunk ``vpp - 1 -`` that. Megatron's special case m == pp (all forwards first) is not
  reproduced; the warm-up formula is :func:`~meshplan.memory.activations.in_flight_chunks`.
  Any stage with vpp > 1 uses this order.
- ``zb_h1`` (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", ZB-H1): splits the
  backward into input (B) and weight (W) gradients and delays W on later stages; its peak
  over all stages stays 1F1B's (the first stage's ``pp`` micro-batches). Modelled here in
  1F1B order with B and W together: the first stage is exact; on stage k > 0 the inputs of
  the weight-gradient GEMMs of up to k delayed W passes are not counted (an underestimate
  there, bounded by stage 0's peak).

>>> stage_ops("1f1b", stage=2, pp=4, m=3)
[('forward', 0, 0), ('forward', 0, 1), ('backward', 0, 0), ('forward', 0, 2), ('backward', 0, 1), ('backward', 0, 2)]
>>> [max_in_flight(stage_ops("1f1b", k, 4, 8)) for k in range(4)], max_in_flight(stage_ops("gpipe", 0, 4, 8))
([4, 3, 2, 1], 8)
>>> max_in_flight(stage_ops("interleaved_1f1b", 0, 4, 8, vpp=2)), max_in_flight(stage_ops("interleaved_1f1b", 3, 4, 8, vpp=2))
(11, 5)
"""

from __future__ import annotations

from meshplan.errors import ConfigError

Op = tuple[str, int, int]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def stage_ops(schedule: str, stage: int, pp: int, m: int, vpp: int = 1) -> list[Op]:
    """Passes of stage ``stage`` in execution order: :func:`meshplan.pipeline.simulate.stage_order`
    (the one implementation of every schedule), its F units as forward passes, its B units
    as backward passes (ZB-H1's W units are folded into their B, see the module docstring)."""
    from meshplan.pipeline.simulate import stage_order

    if schedule not in SCHEDULES:
        raise ConfigError("mesh.pp_schedule", f"{schedule!r} is not one of {SCHEDULES}")
    if schedule == "zb_h1" or (schedule == "1f1b" and vpp > 1):
        schedule = "interleaved_1f1b" if vpp > 1 else "1f1b"
    if vpp > 1 and schedule != "gpipe":
        schedule = "interleaved_1f1b"
    phase = {"F": "forward", "B": "backward"}
    return [(phase[u.kind], u.chunk, u.mb) for u in stage_order(schedule, pp, m, vpp, stage) if u.kind in phase]


def max_in_flight(ops: list[Op]) -> int:
    """Most chunk passes forwarded and not yet backwarded at any point of ``ops``."""
    live = top = 0
    for phase, _, _ in ops:
        live += 1 if phase == "forward" else -1
        top = max(top, live)
    return top
