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
- **Megatron-LM 2022** (``training.megatron_runtime`` "2022", unset; NVIDIA/Megatron-LM 2755bcb
  ``pretrain_gpt.py`` ``get_batch`` -> ``mpu/data.py`` ``broadcast_data(['text'], data, torch.int64)``),
  in every chunk's forward on every stage: the tp group's rank 0 copies the flattened batch to the GPU
  (``torch.cat(...).cuda()``, ``micro_batch x (seq_len + 1)`` int64, pageable), and two
  broadcasts over the tp group carry the key sizes (``_MAX_DATA_DIM`` = 5 int64 for the one
  key) and then the data. At tp 1 the group is the rank alone: no broadcast is charged.
  :func:`megatron_batch_transfers` (the broadcasts' seconds come from the tp group's link,
  :func:`meshplan.schedule.workload.chunk_costs`).
- **Megatron Core** (``megatron_runtime = "core"``; NVIDIA/Megatron-LM d98e8a64dd ``pretrain_gpt.py:110-160``
  ``get_batch``, ``megatron/core/utils.py:2167-2330`` ``get_batch_on_this_tp_rank``; since d086a2e):
  only the first chunk of the first stage and the last chunk of the last stage
  (:func:`core_batch_chunk`); tp rank 0 copies each tensor of the batch to the GPU
  (``.cuda(non_blocking=True)`` from the pinned data loader: queued on the compute stream, which
  waits for it), the int64 tokens, labels and position ids, the fp32 loss mask and, unless
  ``--no-create-attention-mask-in-dataloader``, the boolean ``[b, 1, s, s]`` attention mask the data
  loader built (:data:`CORE_KEY_BYTES`), and broadcasts over tp those its stage uses, one
  broadcast each, in the order :func:`core_broadcast_keys` gives. :func:`core_batch_transfers`.

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


#: Bytes per token of Megatron Core's batch tensors (d98e8a64dd ``core/datasets/gpt_dataset.py``
#: ``__getitem__`` and ``_get_ltor_masks_and_position_ids``: ``text.long()``, ``loss_mask`` float,
#: ``position_ids`` long; the mask, ``< 0.5`` of an ``(s, s)`` tril, is bool: 1 B x s per token).
CORE_KEY_BYTES = {"tokens": 8, "labels": 8, "loss_mask": 4, "position_ids": 8, "attention_mask": 1}


def core_broadcast_keys(pp: int, first: bool, last: bool, mask: bool) -> tuple[str, ...]:
    """The tensors Megatron Core's ``get_batch_on_this_tp_rank`` broadcasts over tp, in its order
    (``megatron/core/utils.py:2257-2300`` at d98e8a64dd): at pp 1 tokens, labels, loss mask,
    position ids; on the first stage tokens and position ids; on the last labels and loss mask;
    then the attention mask where the data loader built it (``mask``). None on a middle stage.

    >>> core_broadcast_keys(1, True, True, True)
    ('tokens', 'labels', 'loss_mask', 'position_ids', 'attention_mask')
    >>> core_broadcast_keys(4, True, False, False), core_broadcast_keys(4, False, True, True), core_broadcast_keys(4, False, False, True)
    (('tokens', 'position_ids'), ('labels', 'loss_mask', 'attention_mask'), ())
    """
    if pp == 1:
        keys: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
    elif first or last:
        keys = ("tokens", "position_ids") if first else ("labels", "loss_mask")
    else:
        return ()
    return keys + (("attention_mask",) if mask else ())


def core_key_bytes(key: str, micro_batch: int, seq_len: int) -> int:
    """Bytes of one batch tensor (:data:`CORE_KEY_BYTES`): ``bytes x b x s``, the mask ``b x s x s``.

    >>> core_key_bytes("loss_mask", 2, 8), core_key_bytes("attention_mask", 1, 8192)
    (64, 67108864)
    """
    per_token = CORE_KEY_BYTES[key] * (seq_len if key == "attention_mask" else 1)
    return per_token * micro_batch * seq_len


def core_batch_chunk(stage: int, chunk: int, first: int, last: int, chunks: int) -> bool:
    """Whether Megatron Core runs ``get_batch`` in chunk ``chunk`` of stage ``stage``
    (``is_first_or_last_pipeline_stage(vp_stage)``, ``training/utils/common_utils.py:515-525`` at
    d98e8a64dd): the first chunk of the ``first`` stage, the last of the ``last`` stage.

    >>> [core_batch_chunk(s, c, 0, 3, 2) for s, c in ((0, 0), (0, 1), (1, 0), (3, 0), (3, 1))]
    [True, False, False, False, True]
    """
    return (stage, chunk) in ((first, 0), (last, chunks - 1))


#: Cadence of each of Megatron Core's broadcast rows (:func:`meshplan.comm.tp_rows.get_batch_rows`), by key: also
#: the group of its row and event.
CORE_CADENCES = {k: f"every micro-batch, first and last stage (Megatron Core get_batch {k})" for k in CORE_KEY_BYTES}


def core_batch_transfers(w: Workload, host: LinkSpec, keys: tuple[str, ...], broadcast_s: float) -> list[Op]:
    """Megatron Core's ``get_batch`` transfers (module docstring) on a chunk that broadcasts ``keys``
    (:func:`core_broadcast_keys`): tp rank 0's copy of every tensor of the batch, each
    :func:`host_copy_seconds`, and the broadcasts taking ``broadcast_s`` seconds together (none at
    tp 1). Llama 3 8B, b 1, s 8192, mask on, PCIe 5.0 x16 (63 GB/s, 5.7 us): tokens, labels and position
    ids 65,536 B each (1.040 + 5.7 us), the loss mask 32,768 B (0.520 + 5.7), the mask 67,108,864 B
    (1065.220 + 5.7): 3 x 6.740 + 6.220 + 1070.920 = 1097.36 us.

    >>> from meshplan.spec.cluster import LinkSpec
    >>> pcie5 = LinkSpec(name="pcie", bandwidth_gb_per_s=63.0, latency_us=5.7)
    >>> ops = core_batch_transfers(Workload(seq_len=8192, tp=2, core_attention_mask=True), pcie5, ("tokens",), 1e-5)
    >>> round(ops[0].seconds * 1e6, 2), ops[1].name
    (1097.36, 'get_batch broadcasts')
    """
    mask = w.core_attention_mask
    sizes = [core_key_bytes(k, w.micro_batch, w.seq_len) for k in CORE_KEY_BYTES if mask or k != "attention_mask"]
    ops = [Op("get_batch copies to device", "embed", "forward", "overhead",
              sum(host_copy_seconds(n, host) for n in sizes), size_bytes=sum(sizes),
              note=f"tp rank 0 .cuda(non_blocking=True) of {len(sizes)} tensors over {host.name}")]
    if w.tp > 1 and keys:
        ops.append(Op(BATCH_BROADCASTS, "embed", "forward", "overhead", broadcast_s,
                      note=f"{', '.join(keys)} broadcast over the tp group of {w.tp}"))
    return ops


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
