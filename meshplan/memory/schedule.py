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

from ..errors import ConfigError

Op = tuple[str, int, int]
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def stage_ops(schedule: str, stage: int, pp: int, m: int, vpp: int = 1) -> list[Op]:
    """Passes of stage ``stage`` in execution order (see the module docstring)."""
    if schedule not in SCHEDULES:
        raise ConfigError("mesh.pp_schedule", f"{schedule!r} is not one of {SCHEDULES}")
    if schedule == "gpipe":
        fwd = [("forward", c, j) for j in range(m) for c in range(vpp)]
        return fwd + [("backward", c, j) for j in range(m) for c in reversed(range(vpp))]
    if vpp > 1:
        return _interleaved(stage, pp, m, vpp)
    warm = min(pp - stage - 1, m)
    ops: list[Op] = [("forward", 0, j) for j in range(warm)]
    for j in range(m - warm):
        ops += [("forward", 0, warm + j), ("backward", 0, j)]
    return ops + [("backward", 0, j) for j in range(m - warm, m)]


def _virtual(i: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of the i-th forward or backward chunk pass (Megatron-LM
    ``get_model_chunk_id`` and ``get_microbatch_id_in_model_chunk``)."""
    within = i % (pp * vpp)
    chunk = within // pp
    return (chunk if forward else vpp - 1 - chunk), (i // (pp * vpp)) * pp + i % pp


def _interleaved(stage: int, pp: int, m: int, vpp: int) -> list[Op]:
    total = m * vpp
    warm = min(total, 2 * (pp - stage - 1) + (vpp - 1) * pp)
    ops: list[Op] = [("forward", *_virtual(i, pp, vpp, True)) for i in range(warm)]
    for j in range(total - warm):
        ops.append(("forward", *_virtual(warm + j, pp, vpp, True)))
        ops.append(("backward", *_virtual(j, pp, vpp, False)))
    return ops + [("backward", *_virtual(j, pp, vpp, False)) for j in range(total - warm, total)]


def max_in_flight(ops: list[Op]) -> int:
    """Most chunk passes forwarded and not yet backwarded at any point of ``ops``."""
    live = top = 0
    for phase, _, _ in ops:
        live += 1 if phase == "forward" else -1
        top = max(top, live)
    return top
