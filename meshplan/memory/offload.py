"""DeepSpeed ZeRO-Offload of the optimizer (``training.offload_optimizer = "cpu"``): which state
leaves the GPU, what the host holds per rank, and the host-side rates the step is timed with.

What DeepSpeed does (deepspeedai/DeepSpeed at edaa7221267243c7be7fb49c5d5f5c4fb97b4641):

- **Stages 1 and 2** (``runtime/zero/stage_1_and_2.py``). With ``offload_optimizer.device = "cpu"``
  (:187-191) the optimizer's device is ``'cpu'`` (:238) and ``contiguous_gradients`` is forced on
  (:260). The fp32 master partition is cloned to the host (``single_partition_of_fp32_groups``,
  :492-509, pinned when ``pin_memory``, DeepSpeed's default true, ``offload_config.py:75``), with a
  host buffer of the partition in the parameters' 16-bit dtype
  (``param_buffer_of_bit16_for_cpu_offload_groups``, :498-507) and an fp32 gradient partition on the
  host (``initialize_optimizer_states``, :839-844). The GPU keeps no gradient partition:
  ``copy_grads_in_partition`` (:1650-1668) returns before ``grads_in_partition`` is allocated. During
  the backward, ``reduce_ipg_grads`` (:1691-1756) copies each reduced bucket's parameters of the
  rank's partition to the host: at the accumulation boundary each gradient is cast to fp32 on the GPU
  and copied into the fp32 host partition (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``,
  :1590-1605, ``non_blocking``); with more than one micro-batch every micro-batch also copies the
  16-bit gradient to a host accumulator (``async_accumulate_grad_in_cpu_via_gpu``, :1516-1560: from the
  second on, host->GPU, add, GPU->host; ``accumulated_grads_in_cpu``, one whole parameter in its dtype).
  The copies run on ``reduction_stream`` under ``overlap_comm`` and on the current (compute) stream
  without it (:1719-1729; the dedicated copy stream is disabled there). ``step`` (:2320-2343) runs
  DeepSpeedCPUAdam on the host partition, casts the fp32 master into the 16-bit host buffer on the
  host and copies it into the GPU partition (``non_blocking``, from pinned memory), then all-gathers.
  The GPU also holds ``temp_grad_buffer_for_gpu_offload`` from init (:558-593: the largest
  parameter's elements, 16-bit; :func:`gpu_staging_entries`, in the memory timeline).
- **Stage 3** (``runtime/zero/stage3.py``): ``self.device`` is ``cpu`` (:328), so the gradient
  partition buffer ``grad_partitions_flat_buffer`` (:742-746, ``grad_accum_dtype``, pinned) lives on
  the host; ``fp32_partitioned_groups_flat`` (:1107-1111) and the fp32 gradient of each sub-group
  (``subgroup_gradient_buffer``, :1287-1292) too. ``partition_grads`` (:1886-1932), on
  ``reduce_and_partition_stream`` (:1591, a side stream under ``overlap_comm``, DeepSpeed's stage-3
  default true), copies each reduce-scattered partition into the host buffer (``non_blocking``; from
  the second micro-batch host->GPU, add, GPU->host) and at the boundary its fp32 cast into the fp32
  gradient (``_offload_grad_partition_at_boundary``, :1393-1407). ``step`` runs DeepSpeedCPUAdam one
  sub-group at a time (``_optimizer_step``, :1185-1207) and copies the fp32 result into the 16-bit
  GPU partition (``_reassign_or_swap_out_partitioned_parameters``, :2585-2593: a blocking ``copy_``
  host->GPU; torch converts on the host side for a blocking CPU->CUDA copy, so 16-bit bytes cross).

So each rank's host holds, per element of its partition (:func:`host_bytes_per_element`): the fp32
master (4 B), Adam's two fp32 moments (8 B, DeepSpeedCPUAdam's state on the parameter's device), the
fp32 gradient (4 B) -- 16 B -- plus one 16-bit staging partition (2 B: the bit16 buffer at stages 1/2,
the gradient partition buffer at stage 3), plus at stages 1/2 with more than one micro-batch the
16-bit gradient accumulator (2 B). The GPU keeps the 16-bit parameters (sharded at stage 3),
and at stage 1 the 16-bit gradients (``param.grad``, whole).

Not modelled: ``offload_optimizer.ratio`` < 1 (stage 3's partial offload, default 1.0,
``offload_config.py:99``), ``super_offload`` (default false), device ``nvme`` and ``offload_param``
(refused on import). The ZeRO-Offload paper's one-step delayed parameter update (DPU) has no switch
in DeepSpeed at edaa722 (no such key): every step waits for its CPU step.
"""

from __future__ import annotations

from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.spec.cluster import NodeSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes

#: DeepSpeedCPUAdam's update rate per CPU core, parameters a second: Ren et al., "ZeRO-Offload:
#: Democratizing Billion-Scale Model Training" (USENIX ATC'21, arXiv 2101.06840), Table 4 "Adam
#: latency (s) for PyTorch (PT) and CPU-Adam" (section 6.2.4; Table 3 there is the model configurations),
#: CPU-Adam column: 1, 2, 4, 8, 10 billion parameters in 0.22, 0.51, 1.03, 2.41, 2.57 s (PT-CPU 1.39,
#: 2.75, 5.71, 11.93, 14.76 s), read from the table's image in Elvin-Ma/ai_papers at 75574b0e
#: (zero/images/zero-offload-table4.jpg; the arXiv PDF itself was not reachable here). Host: the
#: paper's Table 2, one DGX-2 node, "2 Intel Xeon Platinum 8168 Processors", 1.5 TB DDR4-2666; 24 cores
#: each (Intel's product page): 48 cores. Per core = parameters / (latency x 48): 94.7, 81.7, 80.9,
#: 69.2, 81.1e6 for the five rows; the 10B row, 10e9 / (2.57 x 48) = 81.1e6, is the rows' median and
#: the largest size (the 1B row's 94.7e6 the outlier). Assumed, as the paper does not say: the
#: benchmark ran one process over all 48 cores (section 5.1: "OMP multithreading ... multiple cores
#: and threads"), and "billion" is 1e9 (if 2^30, as DeepSpeed's tests/perf/adam_test1.py sizes its
#: "1B", every rate is 7.4% higher). The paper's CPU-Adam is its AVX-512 build (section 5.1: "AVX512
#: SIMD instruction set and an unroll width of 8"; DeepSpeed's docs/_pages/training.md at edaa722:
#: the 5.1x-6.5x over torch's Adam is "Using AVX-512"); DeepSpeed builds AVX2 by default and the AMD
#: EPYC 7742 (DGX A100) runs AVX2: not rescaled, because the table's rate is not SIMD-bound: 30 B a
#: parameter (reads 16: fp32 parameter, gradient, two moments; writes 14: those three and the 16-bit
#: copy) x 10e9 / 2.57 s = 117 GB/s, 46% of the DGX-2 host's DRAM peak (2 sockets x 6 channels x
#: DDR4-2666 21.3 GB/s = 256 GB/s), so the measured rate sits nearer the DRAM bound than the FMA bound
#: (81.1e6 a core at 2.7 GHz is 33 cycles a parameter), and whether the 48 cores or the DRAM set it the
#: table does not tell. Scaled by the cores each GPU's rank has (:func:`cores_per_gpu`), taken as
#: linear in cores. The host's DRAM does not bind first on the catalog's DGX nodes (checked, not
#: modelled): an EPYC 7742 socket's 8 channels of DDR4-3200 (AMD's product page: 204.8 GB/s) shared
#: by 4 GPUs give 1.7e9 parameters a second each at 30 B, above the 16 cores' 1.3e9.
CPU_ADAM_PARAMS_PER_S_PER_CORE = 10e9 / 2.57 / 48

#: Bytes per partition element of the fp32 state DeepSpeed keeps on the host (module docstring):
#: master 4 + Adam exp_avg 4 + exp_avg_sq 4 + fp32 gradient 4.
HOST_FP32_STATE_BYTES = 16


def offloads(training: TrainingSpec) -> bool:
    """True when ``training`` offloads the optimizer to the host (a ZeRO sharding with
    ``offload_optimizer = "cpu"``; :class:`TrainingSpec` refuses it outside DeepSpeed's engines).

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed", offload_optimizer="cpu")
    >>> offloads(t), offloads(t.model_copy(update={"offload_optimizer": "none"}))
    (True, False)
    """
    return training.offload_optimizer == "cpu" and training.sharding in ("zero1", "zero2", "zero3")


def gpu_offloaded_kinds(training: TrainingSpec) -> tuple[str, ...]:
    """The state kinds (:mod:`meshplan.memory.state`) that leave the GPU: the master and optimizer
    states, and the gradient partition at stages 2 and 3 (stage 1 keeps ``param.grad`` whole).

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", offload_optimizer="cpu")
    >>> gpu_offloaded_kinds(t), gpu_offloaded_kinds(t.model_copy(update={"sharding": "zero1"}))
    (('master', 'optimizer', 'grads'), ('master', 'optimizer'))
    """
    if not offloads(training):
        return ()
    return ("master", "optimizer") + (("grads",) if training.sharding in ("zero2", "zero3") else ())


def host_bytes_per_element(training: TrainingSpec, accum_steps: int) -> int:
    """Host bytes per element of the rank's partition (module docstring): 16 B of fp32 state, the
    16-bit staging partition (the parameters' dtype at stages 1/2, ``grad_dtype`` at stage 3), and at
    stages 1/2 with ``accum_steps`` > 1 the 16-bit gradient accumulator; 0 without offload.

    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero3", zero3_engine="deepspeed", offload_optimizer="cpu")
    >>> host_bytes_per_element(t, 1), host_bytes_per_element(t, 4)
    (18, 18)
    >>> z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", offload_optimizer="cpu")
    >>> host_bytes_per_element(z2, 1), host_bytes_per_element(z2, 4)
    (18, 20)
    """
    if not offloads(training):
        return 0
    stage3 = training.sharding == "zero3"
    staging = dtype_bytes(training.grad_dtype if stage3 else training.param_dtype)
    accumulator = dtype_bytes(training.param_dtype) if not stage3 and accum_steps > 1 else 0
    return HOST_FP32_STATE_BYTES + staging + accumulator


def cores_per_gpu(node: NodeSpec) -> float:
    """CPU cores per GPU on the node's least-provisioned socket (cores / GPUs of that socket): the
    share one rank's DeepSpeedCPUAdam threads get when every rank steps at once, as DeepSpeed's
    launcher gives them with ``--bind_cores_to_rank`` (docs/_tutorials/zero-offload.md:77-80 at
    edaa722: physical cores divided evenly among ranks, OMP_NUM_THREADS set to each share); without it
    the ranks' OpenMP threads oversubscribe the cores, slower than this (not modelled). DGX A100: 64 / 4 = 16.

    >>> from meshplan.catalog import node
    >>> cores_per_gpu(node("dgx-a100-40gb")), cores_per_gpu(node("dgx-h100"))
    (16.0, 14.0)
    """
    return min(s.cores / len(s.gpus) for s in node.sockets if s.gpus)


def host_link_bytes_per_s(node: NodeSpec) -> float:
    """One GPU's host copy bandwidth (bytes/s, one direction): the node's PCIe link (``node.pcie``,
    the PCI-SIG line rate) shared by the GPUs under one PCIe switch when every rank copies at once.
    Assumed: each switch reaches the CPU over one link of that rate, and the GPUs under it are the
    GPUs its NICs list (DGX A100: 2 GPUs a switch, 31.5 / 2 = 15.75 GB/s each; DGX H100: one GPU a
    NIC, 63 GB/s). NIC traffic (GPUDirect RDMA) stays below the switch and is not counted against it.

    >>> from meshplan.catalog import node
    >>> host_link_bytes_per_s(node("dgx-a100-40gb")) / 1e9, host_link_bytes_per_s(node("dgx-h100")) / 1e9
    (15.75, 63.0)
    """
    sharing = max((len(n.gpus) for n in node.nics), default=1)
    return node.pcie.bandwidth_gb_per_s * 1e9 / max(sharing, 1)


def cpu_adam_s(partition_elements: int, node: NodeSpec) -> float:
    """Seconds of one rank's DeepSpeedCPUAdam step over ``partition_elements`` parameters at
    :data:`CPU_ADAM_PARAMS_PER_S_PER_CORE` x :func:`cores_per_gpu`.

    >>> from meshplan.catalog import node
    >>> round(cpu_adam_s(2_000_000_000, node("dgx-a100-40gb")), 3)  # 2e9 / (81.1e6 x 16)
    1.542
    """
    return partition_elements / (CPU_ADAM_PARAMS_PER_S_PER_CORE * cores_per_gpu(node))


def gpu_staging_entries(model: ModelSpec, training: TrainingSpec, mesh: Mesh) -> tuple:
    """The memory timeline's init entry of stages 1/2's ``temp_grad_buffer_for_gpu_offload``
    (stage_1_and_2.py:558-593 at edaa722: ``largest_param_numel`` over the rank's parameters, in the
    parameters' dtype, allocated at init and kept); () at stage 3 or without offload. Llama-3-70B at
    tp 1: the embedding, 128,256 x 8,192 = 1,050,673,152 x 2 B = 2.10 GB.

    >>> from meshplan.catalog import model
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", param_dtype="bf16",
    ...                  vocab_pad_divisor=1, offload_optimizer="cpu")
    >>> gpu_staging_entries(model("llama3-70b"), t, resolve_mesh(MeshSpec(names=["dp"], shape=[8]), world=8))[0][2]
    2101346304
    """
    if not offloads(training) or training.sharding == "zero3":
        return ()
    tp, ep, etp = mesh.degree("tp"), mesh.ep, mesh.etp
    vocab = padded_vocab(model.vocab, training.vocab_pad_divisor, tp)
    tensors = model.embedding_tensors(vocab) + model.head_tensors(vocab) + [
        t for i in range(model.layers) for t in model.layer_tensors(i)]
    largest = max(local_numel(t, model, tp, ep, etp, training.framework) for t in tensors)
    return ((None, "grad_buffers", largest * dtype_bytes(training.param_dtype),
             f"ZeRO-Offload's GPU gradient staging buffer (temp_grad_buffer_for_gpu_offload): the largest "
             f"parameter, {largest:,} x {dtype_bytes(training.param_dtype)} B, allocated at init"),)
