"""The ``host:`` line of a ``--kernels`` file's eager DTensor TP pace that the device never waits
for (:func:`host_not_binding`), so the user sees the file's ``[host]`` table was applied; the
binding case is :meth:`meshplan.schedule.step_summary.StepTime.host_line`'s own, the hint to
compile :mod:`meshplan.schedule.host_hint`'s. Imports nothing of the schedule: step_summary uses it."""

from __future__ import annotations


def host_not_binding(st) -> list[str]:
    """The ``host:`` line of ``st`` (a :class:`~meshplan.schedule.step_summary.StepTime` whose
    compute stream never waits for the host: :meth:`~meshplan.schedule.step_summary.StepTime.host_wait_s`
    rounds to 0) when a kernels file set eager DTensor TP's pace (forward/backward seconds a
    block, ``--kernels``' ``[host]``), beside the kernels of one block of the critical stage
    (its first chunk with layers: forward; backward = input + weight gradients,
    :class:`~meshplan.compute.ops.Cost`): those and the block's exposed collectives take longer
    than the pace, so the user sees the file was applied. None for the catalog's pace (no news)
    or where no pace applies (Megatron-LM, compiled blocks, tp 1). MINI tp 4 with a 2.00/2.50 ms
    pace: kernels 1.93/4.06 ms a block (tests/test_kernels_option.py)."""
    w = st.units.w
    f, b = w.dtensor_host_s
    if not w.dtensor_host_source.startswith("your kernels file") or f <= 0:
        return []
    layer = next((c.layers[0] for c in st.units.chunks[st.critical_stage] if c.layers), None)
    if layer is None:
        return []
    kf = layer.seconds("forward")
    kb = layer.seconds("backward_input") + layer.seconds("backward_weight")
    return [f"host: pace {f * 1e3:.2f}/{b * 1e3:.2f} ms a block (forward/backward) from "
            f"{w.dtensor_host_source}: not binding (the device never waits for the host: a block's kernels, "
            f"{kf * 1e3:.2f}/{kb * 1e3:.2f} ms, and its exposed collectives take longer)"]
