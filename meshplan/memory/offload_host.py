"""Host memory of DeepSpeed's ZeRO-Offload (:mod:`meshplan.memory.offload`) per rank and per
node, and the plan's reason when a node's ranks need more than its CPU memory
(``cluster.node.host_memory_gb``, from the node's datasheet).
"""

from __future__ import annotations

from meshplan.errors import ConfigError
from meshplan.memory.offload import host_bytes_per_element, offloads
from meshplan.memory.state import SHARD_AXIS, StateBytes, state_bytes
from meshplan.mesh.resolve import Mesh
from meshplan.spec.cluster import NodeSpec
from meshplan.spec.training import TrainingSpec


def partition_numel(counts, degrees):
    """Elements of a rank's optimizer partition from each group's elements ``counts`` and its
    sharding degree ``degrees`` (pairwise): ``ceil(n / d)`` summed. Python ints for one mesh
    (:func:`partition_elements`) or numpy int arrays broadcast over the search's candidates
    (:func:`meshplan.search.memory.host_state`): the one formula of both.

    >>> partition_numel([13_088, 0], [4, 1]), partition_numel([10, 7], [4, 2])
    (3272, 7)
    """
    return sum(-(-n // d) for n, d in zip(counts, degrees))


def partition_elements(state: StateBytes, mesh: Mesh) -> int:
    """Elements of the rank's optimizer partition: each group's parameters over its sharding axis
    (``ceil(n / fsdp)`` dense, ``ceil(n / efsdp)`` expert; :data:`~meshplan.memory.state.SHARD_AXIS`),
    the partition every ZeRO stage gives each rank's optimizer (:func:`partition_numel`)."""
    groups = [g for g in SHARD_AXIS if state.params.count(g)]
    return partition_numel([state.params.count(g) for g in groups], [mesh.degree(SHARD_AXIS[g]) for g in groups])


def host_bytes(state: StateBytes, mesh: Mesh, training: TrainingSpec, accum_steps: int) -> int:
    """Host bytes one rank of ``state``'s stage keeps: its partition x
    :func:`~meshplan.memory.offload.host_bytes_per_element` (0 without offload)."""
    return partition_elements(state, mesh) * host_bytes_per_element(training, accum_steps)


def node_need_bytes(partition, per_element, node: NodeSpec):
    """Host bytes a node's ranks need (B): one rank's ``partition`` elements x ``per_element`` bytes
    (:func:`~meshplan.memory.offload.host_bytes_per_element`) x the node's GPUs, every rank of the node
    on the most loaded stage (exact at pp 1, DeepSpeed's case). Ints, or numpy arrays over the search's
    candidates (:func:`meshplan.search.memory.host_state`).

    >>> from meshplan.catalog import node
    >>> node_need_bytes(2_204_803_328, 18, node("dgx-a100-40gb")) / 1e9  # 70B over 32 ranks, ZeRO-3
    317.491679232
    """
    return partition * per_element * node.gpus


def node_host_bytes(node: NodeSpec) -> float:
    """The node's host memory, bytes (``host_memory_gb`` x 1e9, its datasheet's); ConfigError when
    the node states none (unknown hardware is never a default)."""
    if node.host_memory_gb is None:
        raise ConfigError("cluster.node.host_memory_gb", f"node {node.name!r} states no host memory, which "
                          "offload_optimizer = \"cpu\" fills; write the node inline in [cluster] with host_memory_gb = its CPU "
                          "memory in GB, from its datasheet (docs/input.md)")
    return node.host_memory_gb * 1e9


def host_reason(partition: int, per_element: int, node: NodeSpec) -> tuple[str, ...]:
    """The one-line reason when a node's ranks, one rank's ``partition`` elements at ``per_element``
    bytes each (:func:`node_need_bytes`), need more host memory than the node's
    (:func:`node_host_bytes`); () when they fit. The plan's (:func:`host_memory_reasons`) and the
    search's words for one candidate (:func:`meshplan.search.memory.host_reasons`)."""
    need, have = node_need_bytes(partition, per_element, node), node_host_bytes(node)
    if need <= have:
        return ()
    return (f"host memory: {_words(partition, per_element, node)} > the node's {_gb(have)} GB "
            f"(cluster.node.host_memory_gb); shard over more ranks (more nodes) or set offload_optimizer = \"none\"",)


def host_memory_reasons(states, mesh: Mesh, training: TrainingSpec, node: NodeSpec, accum_steps: int) -> tuple[str, ...]:
    """The one-line reason when a node's ranks need more host memory than ``node.host_memory_gb``
    (the most loaded stage's rank x the node's GPUs: every rank of a node on that stage, exact at
    pp 1, DeepSpeed's case); () when it fits or nothing is offloaded. ConfigError when the node
    states no host memory (unknown hardware is never a default).

    32 ranks of a 70.55e9-parameter model at ZeRO-3: ceil(70.55e9 / 32) x 18 B = 39.7 GB a rank,
    8 a node 317 GB: fits a DGX A100's 1 TB."""
    if not offloads(training) or not states:
        return ()
    return host_reason(_top_partition(states, mesh), host_bytes_per_element(training, accum_steps), node)


def host_memory_note(states, mesh: Mesh, training: TrainingSpec, node: NodeSpec, accum_steps: int) -> tuple[str, ...]:
    """The plan's note of a ZeRO-Offload that fits its node's host memory (what each rank and node
    keep there, of how much); () without offload or when it does not fit (the reason says it)."""
    if not offloads(training) or not states or node.host_memory_gb is None:
        return ()
    partition, per = _top_partition(states, mesh), host_bytes_per_element(training, accum_steps)
    have = node_host_bytes(node)
    return () if node_need_bytes(partition, per, node) > have else (
        f"ZeRO-Offload host memory: {_words(partition, per, node)} of the node's {_gb(have)} GB "
        "(pinned: fp32 master, Adam moments and gradients, a 16-bit staging partition)",)


def _top_partition(states, mesh: Mesh) -> int:
    """The partition elements of the most loaded stage's rank (the host bytes per element are the
    same on every stage)."""
    return max(partition_elements(s, mesh) for s in states)


def _gb(size_bytes: float) -> str:
    """The node's host memory in GB as its datasheet (and ``host_memory_gb``) gives it, to 0.01 GB,
    no trailing zeros: a 9.5 GB node is not printed as 10 GB beside a 9.8 GB need.

    >>> _gb(1000e9), _gb(9.5e9), _gb(9.25e9)
    ('1000', '9.5', '9.25')
    """
    return f"{size_bytes / 1e9:.2f}".rstrip("0").rstrip(".")


def _words(partition: int, per_element: int, node: NodeSpec) -> str:
    """The node's need in words: ``8 ranks x 39.7 GB (2,204,803,328 params x 18 B) = 317.5 GB``."""
    rank = partition * per_element
    return (f"{node.gpus} ranks x {rank / 1e9:.1f} GB ({partition:,} params x {per_element} B) = "
            f"{node_need_bytes(partition, per_element, node) / 1e9:.1f} GB")


def saved_states(states, model, mesh: Mesh, training: TrainingSpec, stages) -> tuple:
    """The per-stage state a checkpoint saves, wherever it lives: ``states`` (the GPU's) where
    nothing is offloaded, else :func:`~meshplan.memory.state.state_bytes` as if on the GPU
    (DeepSpeed's ``save_checkpoint`` writes the host's fp32 master and Adam moments as it would the
    GPU's: ``runtime/engine.py:5409-5411`` at edaa722, ``_save_zero_checkpoint`` saves
    ``self.optimizer.state_dict()``)."""
    if not offloads(training):
        return tuple(states)
    return tuple(state_bytes(model, mesh, training.model_copy(update={"offload_optimizer": "none"}), stages))
