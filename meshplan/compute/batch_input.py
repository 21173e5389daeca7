"""A micro-batch's token ids on their way from the data loader to the embedding, per framework
(the home of that technique; :mod:`meshplan.compute.ops`' conventions). Each framework moves the
batch with blocking transfers the GPU waits on, so each is on the step's critical path:

- **torch** (torchtitan): ``batch_generator`` (pytorch/torchtitan 42b0beb, June 2025,
  ``torchtitan/train.py``; at b5bcd76 the same ``value.to(self.device)`` /
  ``labels.to(self.device)`` moved into ``trainer.py`` ``train_step``) copies the inputs and the
  labels to the GPU with ``.to(device)``, two int64 tensors of ``micro_batch x seq_len``
  (``datasets/hf_datasets.py``: ``torch.LongTensor``, ``input = x[:-1]``, ``label = x[1:]``)
  from pageable memory (the data loader sets no ``pin_memory``): ``copy_`` without
  ``non_blocking`` synchronises the stream, so the GPU drains, waits for each copy and then for
  the host to issue its next kernel (one issue floor). :func:`torch_batch_copy`.
- **Megatron-LM 2022** (NVIDIA/Megatron-LM 2755bcb ``pretrain_gpt.py`` ``get_batch`` ->
  ``mpu/data.py`` ``broadcast_data(['text'], data, torch.int64)``; today's
  ``megatron/training/utils.py`` ``get_batch_on_this_tp_rank``, d086a2e, broadcasts each of
  tokens, labels, loss mask, attention mask and position ids after ``cuda(non_blocking=True)``
  copies instead: not modelled): the tp group's rank 0 copies the flattened batch to the GPU
  (``torch.cat(...).cuda()``, ``micro_batch x (seq_len + 1)`` int64, pageable), and two
  broadcasts over the tp group carry the key sizes (``_MAX_DATA_DIM`` = 5 int64 for the one
  key) and then the data. At tp 1 the group is the rank alone: no broadcast is charged.
  :func:`megatron_batch_transfers` (the broadcasts' seconds come from the tp group's link,
  :func:`meshplan.schedule.workload.chunk_costs`).

A copy takes the host link's latency plus its bytes at the link's bandwidth
(:func:`host_copy_seconds`; the node's catalog ``pcie`` entry, PCIe line rate: pageable copies
are not faster than it).
"""

from __future__ import annotations

from meshplan.compute.ops import Op, Workload
from meshplan.spec.cluster import LinkSpec

#: Bytes of one token id in both frameworks' batches (int64).
TOKEN_BYTES = 8
#: Megatron-LM's ``mpu/data.py`` ``_MAX_DATA_DIM``: int64 sizes broadcast per key.
MEGATRON_MAX_DATA_DIM = 5


def host_copy_seconds(nbytes: float, host: LinkSpec) -> float:
    """One blocking host-to-device copy of ``nbytes``: ``host.latency_s + nbytes /
    host.bandwidth_bytes_per_s`` (seconds).

    >>> from meshplan.spec.cluster import LinkSpec
    >>> round(host_copy_seconds(63e3, LinkSpec(name="pcie", bandwidth_gb_per_s=63.0, latency_us=5.7)) * 1e6, 3)
    6.7
    """
    return host.latency_s + nbytes / host.bandwidth_bytes_per_s


def torch_batch_copy(w: Workload, host: LinkSpec, issue_s: float) -> Op:
    """torchtitan's two blocking ``.to(device)`` copies of a micro-batch (module docstring):
    ``2 x host_copy_seconds(8 b s) + issue_s`` (the GPU idles until the host issues again),
    charged once per micro-batch in the first stage's embedding forward. Under pp torchtitan
    copies the whole local batch once per step (the pipeline schedule splits it): the same bytes,
    but the two latencies and the issue floor counted once per micro-batch here, an overcount of
    at most ``(micro-batches - 1) x (2 x latency + issue_s)`` per step (16.1 us each on PCIe 5.0).

    Llama 3 8B micro-batch 1 x 8192 over PCIe 5.0 x16 (63 GB/s, 5.7 us), 4.7 us floor: each copy
    65,536 B, 1.040 + 5.7 us; 2 x 6.740 + 4.7 = 18.18 us:

    >>> from meshplan.spec.cluster import LinkSpec
    >>> pcie5 = LinkSpec(name="pcie", bandwidth_gb_per_s=63.0, latency_us=5.7)
    >>> op = torch_batch_copy(Workload(seq_len=8192), pcie5, 4.7e-6)
    >>> round(op.seconds * 1e6, 2), op.size_bytes
    (18.18, 131072)
    """
    per = TOKEN_BYTES * w.micro_batch * w.seq_len
    return Op("batch to device", "embed", "forward", "overhead", 2 * host_copy_seconds(per, host) + issue_s,
              size_bytes=2 * per, note=f"inputs and labels .to(device), 2 x {per} B over {host.name}, blocking")


def megatron_broadcast_bytes(micro_batch: int, seq_len: int) -> tuple[int, int]:
    """Bytes of ``broadcast_data``'s two tp broadcasts (module docstring): the sizes
    (``5 x 8``) and the data (``8 b (s + 1)``).

    >>> megatron_broadcast_bytes(4, 2048)
    (40, 65568)
    """
    return MEGATRON_MAX_DATA_DIM * TOKEN_BYTES, TOKEN_BYTES * micro_batch * (seq_len + 1)


#: ``broadcast_data``'s two tp broadcasts in their order (:func:`megatron_broadcast_bytes`'s): each
#: a row of the collective table (:func:`meshplan.comm.tp_rows.get_batch_rows`, under its
#: :data:`GET_BATCH_CADENCES` text) and the rank timeline's group of its event
#: (:func:`meshplan.schedule.rank_timeline.forward_unit`).
BROADCAST_GROUPS = ("get_batch sizes", "get_batch data")
#: Cadence of each broadcast's row: Megatron-LM 2022 runs ``get_batch`` in every chunk's forward
#: (``forward_step`` per model chunk) on every stage.
GET_BATCH_CADENCES = {g: f"every micro-batch and chunk (Megatron {g})" for g in BROADCAST_GROUPS}


#: The op of :func:`megatron_batch_transfers` that is communication: the step's timeline runs it on
#: the tp stream, blocking, so that its time is exposed tp, not compute
#: (:func:`meshplan.schedule.rank_timeline.forward_unit`).
BATCH_BROADCASTS = "get_batch broadcasts"


def megatron_batch_transfers(w: Workload, host: LinkSpec, broadcast_s: float) -> list[Op]:
    """Megatron-LM 2022's ``get_batch`` transfers (module docstring): rank 0's blocking copy of
    the batch, and the two tp broadcasts taking ``broadcast_s`` seconds together (0 at tp 1)."""
    data = megatron_broadcast_bytes(w.micro_batch, w.seq_len)[1]
    ops = [Op("get_batch copy to device", "embed", "forward", "overhead", host_copy_seconds(data, host),
              size_bytes=data, note=f"tp rank 0 torch.cat(...).cuda(), {data} B over {host.name}, blocking")]
    if w.tp > 1:
        ops.append(Op(BATCH_BROADCASTS, "embed", "forward", "overhead", broadcast_s,
                      note=f"broadcast_data: sizes and data over the tp group of {w.tp}"))
    return ops
