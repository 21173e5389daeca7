"""DeepSpeed ZeRO-Offload's host memory (``training.offload_optimizer = "cpu"``) of many search
candidates at once: the rule ``host`` the plan applies to one mesh
(:func:`meshplan.memory.offload_host.host_memory_reasons`), over numpy arrays.

The formula has one home, :mod:`meshplan.memory.offload_host`: a rank's optimizer partition
(:func:`~meshplan.memory.offload_host.partition_numel`: ``ceil(dense / fsdp) + ceil(expert / efsdp)``
elements of its stage, the most loaded stage's taken), times the host bytes per element of the row's
sharding and accumulation steps (:func:`~meshplan.memory.offload.host_bytes_per_element`, called once
per distinct pair), times the node's GPUs (:func:`~meshplan.memory.offload_host.node_need_bytes`),
against the node's ``host_memory_gb`` (:func:`~meshplan.memory.offload_host.node_host_bytes`). The
element counts are the search's exact state (:func:`meshplan.search.memory.state`), so the verdict is
the plan's, row for row (``tests/test_search_offload.py``); the reason words too
(:func:`host_reasons`).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.memory.offload import host_bytes_per_element
from meshplan.memory.offload_host import host_reason, node_host_bytes, node_need_bytes, partition_numel
from meshplan.search.candidate import sharding_training
from meshplan.search.columns import SHARDING, Candidates


def host_state(cfg: Config, c: Candidates, micro_batches: np.ndarray, s: dict) -> tuple[np.ndarray, np.ndarray]:
    """(partition elements of the most loaded stage's rank, host bytes per element) per candidate,
    int64 (candidates,), of ``c`` (one pp group) with its per-stage state ``s``
    (:func:`meshplan.search.memory.state`: ``dense_numel``, ``expert_numel``, (candidates, pp)) and its
    micro-batches per step ``micro_batches`` (candidates,): the plan's accumulation steps. The bytes
    are 0 on rows that offload nothing (hsdp rows, FSDP2's; a config without offload)."""
    part = partition_numel([s["dense_numel"], s["expert_numel"]], [c.fsdp[:, None], c.efsdp[:, None]])
    per = np.zeros(len(c), dtype=np.int64)
    keys = np.stack([c.sh, micro_batches], axis=1)
    for sh, m in np.unique(keys, axis=0).tolist():  # a few distinct (sharding, steps) pairs
        per[(c.sh == sh) & (micro_batches == m)] = host_bytes_per_element(
            sharding_training(cfg.training, SHARDING[sh]), m)
    return np.asarray(part, dtype=np.int64).max(axis=1), per


def host_over(cfg: Config, partition: np.ndarray, per_element: np.ndarray) -> np.ndarray:
    """Where a node's ranks need more host memory than the node's (bool, (candidates,)): the plan's
    rule ``host`` (:func:`meshplan.memory.offload_host.host_reason`). All False where no row offloads;
    ConfigError (naming ``cluster.node.host_memory_gb``) where some does and the node states no host
    memory, as ``plan`` raises. NaN-free: rows a rule rejected carry 0 bytes."""
    if not (per_element > 0).any():
        return np.zeros(len(partition), dtype=bool)
    node = cfg.cluster.node
    return node_need_bytes(partition, per_element, node) > node_host_bytes(node)


def host_reasons(cfg: Config, partition: np.ndarray, per_element: np.ndarray, i: int) -> tuple[str, ...]:
    """Candidate ``i``'s host reason in the plan's words (:func:`~meshplan.memory.offload_host.host_reason`
    of its numbers), () where it fits or offloads nothing."""
    if per_element[i] <= 0:
        return ()
    return host_reason(int(partition[i]), int(per_element[i]), cfg.cluster.node)
