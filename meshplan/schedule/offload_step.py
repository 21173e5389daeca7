"""The step-end rows of DeepSpeed's ZeRO-Offload (``training.offload_optimizer = "cpu"``;
what runs where: :mod:`meshplan.memory.offload`), in place of the GPU optimizer step:

- ``offload: gradient copies to host (exposed)``: the backward's device->host copies of the rank's
  gradient partition (:func:`grad_copy_bytes`) at :func:`~meshplan.memory.offload.host_link_bytes_per_s`.
  DeepSpeed issues them per reduced bucket on its reduction stream under ``overlap_comm`` (stage 3's
  ``reduce_and_partition_stream``, stages 1/2's ``reduction_stream``), beside the backward compute:
  exposed only what outlasts the stage's backward units; without ``overlap_comm`` on the compute
  stream: all exposed.
- ``offload: CPU Adam (DeepSpeedCPUAdam)``: :func:`~meshplan.memory.offload.cpu_adam_s` over the
  rank's partition; the GPU waits for it (no delayed update in DeepSpeed).
- ``offload: updated params host->GPU``: the 16-bit partition back over the same link, after the
  CPU step and before stage 1/2's all-gather and stage 3's next gathers.

Counted on the compute row: the GPU idles through all three (the copies' PCIe link is no NCCL stream).
"""

from __future__ import annotations

from meshplan.memory.offload import CPU_ADAM_PARAMS_PER_S_PER_CORE, cpu_adam_s, host_link_bytes_per_s, offloads
from meshplan.memory.offload_host import partition_elements
from meshplan.units import dtype_bytes


def grad_copy_bytes(partition: int, training, micro_batches: int) -> int:
    """Bytes one rank copies between GPU and host for its gradients in one step (both directions):
    the fp32 copy at the accumulation boundary (4 B an element), and the 16-bit gradient partition
    (``grad_dtype``) each micro-batch (stage 3 always; stages 1/2 only with more than one
    micro-batch), which from the second micro-batch on is read back first (host->GPU, add, GPU->host).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed", offload_optimizer="cpu")
    >>> grad_copy_bytes(100, t, 1), grad_copy_bytes(100, t, 3)  # 100 x (4 + 2), 100 x (4 + 2 x 3 + 2 x 2)
    (600, 1400)
    >>> z2 = t.model_copy(update={"sharding": "zero2", "zero3_engine": "fsdp2", "zero12_engine": "deepspeed"})
    >>> grad_copy_bytes(100, z2, 1), grad_copy_bytes(100, z2, 3)
    (400, 1400)
    """
    g = dtype_bytes(training.grad_dtype)
    per_mb = training.sharding == "zero3" or micro_batches > 1
    return partition * (4 + (g * micro_batches + g * (micro_batches - 1) if per_mb else 0))


def offload_steps(plan, s: int, mine) -> list[tuple[str, float, str]]:
    """(name, seconds, stream) of stage ``s``'s ZeRO-Offload rows (module docstring), ``mine`` its
    compute events (the backward units, kinds B and W, cover the overlapped copies); [] without offload."""
    c = plan.config
    t, node = c.training, c.cluster.node
    if not offloads(t):
        return []
    n = partition_elements(plan.state[s], plan.mesh)
    bw = host_link_bytes_per_s(node)
    copies = grad_copy_bytes(n, t, plan.micro_batches) / bw
    if t.overlaps_comm:  # DeepSpeed's overlap_comm in effect (its default per stage)
        backward = sum(e.dur_s for e in mine if e.args.get("kind") in ("B", "W"))
        copies = max(0.0, copies - backward)
    return [("offload: gradient copies to host (exposed)", copies, "compute"),
            ("offload: CPU Adam (DeepSpeedCPUAdam)", cpu_adam_s(n, node), "compute"),
            ("offload: updated params host->GPU", n * dtype_bytes(t.param_dtype) / bw, "compute")]


def offload_line(summary) -> list[str]:
    """``offload: ...``: the critical stage's ZeRO-Offload rows (:func:`offload_steps`), each in ms, which
    the parts line counts in ``compute`` (the GPU waits for them); [] without them."""
    rows = [e for e in summary.post_events if e.stage == summary.critical_stage and e.name.startswith("offload: ")]
    if not rows:
        return []
    words = ", ".join(f"{e.name[len('offload: '):]} {e.dur_s * 1e3:.2f} ms" for e in rows)
    if not any("gradient copies" in e.name for e in rows):  # a row of 0 s is not placed (step_end.stage_end)
        words = "gradient copies to host hidden behind the backward (overlap_comm), " + words
    return [f"offload (DeepSpeed ZeRO-Offload, in compute above: the GPU waits): {words}; "
            f"{sum(e.dur_s for e in rows) * 1e3:.2f} ms in all (meshplan.memory.offload: the rates and their sources; "
            f"assumed: CPU Adam at {CPU_ADAM_PARAMS_PER_S_PER_CORE / 1e6:.1f}e6 parameters/s a core with "
            "--bind_cores_to_rank, ZeRO-Offload's Table 4 rate on a DGX-2's 48 Xeon cores taken as linear in "
            "cores, and PCIe at line rate)"]
