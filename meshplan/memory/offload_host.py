"""Host memory of DeepSpeed's ZeRO-Offload (:mod:`meshplan.memory.offload`) per rank and per
node, and the plan's reason when a node's ranks need more than its CPU memory
(``cluster.node.host_memory_gb``, from the node's datasheet).
"""

from __future__ import annotations

from math import ceil

from meshplan.errors import ConfigError
from meshplan.memory.offload import host_bytes_per_element, offloads
from meshplan.memory.state import SHARD_AXIS, StateBytes, state_bytes
from meshplan.mesh.resolve import Mesh
from meshplan.spec.cluster import NodeSpec
from meshplan.spec.training import TrainingSpec


def partition_elements(state: StateBytes, mesh: Mesh) -> int:
    """Elements of the rank's optimizer partition: each group's parameters over its sharding axis
    (``ceil(n / fsdp)`` dense, ``ceil(n / efsdp)`` expert; :data:`~meshplan.memory.state.SHARD_AXIS`),
    the partition every ZeRO stage gives each rank's optimizer."""
    return sum(ceil(state.params.count(g) / mesh.degree(axis)) for g, axis in SHARD_AXIS.items()
               if state.params.count(g))


def host_bytes(state: StateBytes, mesh: Mesh, training: TrainingSpec, accum_steps: int) -> int:
    """Host bytes one rank of ``state``'s stage keeps: its partition x
    :func:`~meshplan.memory.offload.host_bytes_per_element` (0 without offload)."""
    return partition_elements(state, mesh) * host_bytes_per_element(training, accum_steps)


def host_memory_reasons(states, mesh: Mesh, training: TrainingSpec, node: NodeSpec, accum_steps: int) -> tuple[str, ...]:
    """The one-line reason when a node's ranks need more host memory than ``node.host_memory_gb``
    (the most loaded stage's rank x the node's GPUs: every rank of a node on that stage, exact at
    pp 1, DeepSpeed's case); () when it fits or nothing is offloaded. ConfigError when the node
    states no host memory (unknown hardware is never a default).

    32 ranks of a 70.55e9-parameter model at ZeRO-3: ceil(70.55e9 / 32) x 18 B = 39.7 GB a rank,
    8 a node 317 GB: fits a DGX A100's 1 TB."""
    if not offloads(training) or not states:
        return ()
    if node.host_memory_gb is None:
        raise ConfigError("cluster.node.host_memory_gb", f"node {node.name!r} states no host memory, which "
                          "offload_optimizer = \"cpu\" fills; write the node inline in [cluster] with host_memory_gb = its CPU "
                          "memory in GB, from its datasheet (docs/input.md)")
    need, have, words = _node_need(states, mesh, training, node, accum_steps)
    if need <= have:
        return ()
    return (f"host memory: {words} > the node's {have / 1e9:.0f} GB (cluster.node.host_memory_gb); shard over more "
            f"ranks (more nodes) or set offload_optimizer = \"none\"",)


def host_memory_note(states, mesh: Mesh, training: TrainingSpec, node: NodeSpec, accum_steps: int) -> tuple[str, ...]:
    """The plan's note of a ZeRO-Offload that fits its node's host memory (what each rank and node
    keep there, of how much); () without offload or when it does not fit (the reason says it)."""
    if not offloads(training) or not states or node.host_memory_gb is None:
        return ()
    need, have, words = _node_need(states, mesh, training, node, accum_steps)
    return () if need > have else (f"ZeRO-Offload host memory: {words} of the node's {have / 1e9:.0f} GB "
                                   "(pinned: fp32 master, Adam moments and gradients, a 16-bit staging partition)",)


def _node_need(states, mesh: Mesh, training: TrainingSpec, node: NodeSpec, accum_steps: int) -> tuple[float, float, str]:
    """(host bytes a node's ranks need, the node's, the arithmetic in words): the most loaded stage's
    rank x the node's GPUs."""
    top = max(states, key=lambda s: host_bytes(s, mesh, training, accum_steps))
    rank = host_bytes(top, mesh, training, accum_steps)
    need = rank * node.gpus
    return need, (node.host_memory_gb or 0.0) * 1e9, (
        f"{node.gpus} ranks x {rank / 1e9:.1f} GB ({partition_elements(top, mesh):,} params x "
        f"{host_bytes_per_element(training, accum_steps)} B) = {need / 1e9:.1f} GB")


def saved_states(states, model, mesh: Mesh, training: TrainingSpec, stages) -> tuple:
    """The per-stage state a checkpoint saves, wherever it lives: ``states`` (the GPU's) where
    nothing is offloaded, else :func:`~meshplan.memory.state.state_bytes` as if on the GPU
    (DeepSpeed's ``save_checkpoint`` writes the host's fp32 master and Adam moments as it would the
    GPU's: ``runtime/engine.py:5409-5411`` at edaa722, ``_save_zero_checkpoint`` saves
    ``self.optimizer.state_dict()``)."""
    if not offloads(training):
        return tuple(states)
    return tuple(state_bytes(model, mesh, training.model_copy(update={"offload_optimizer": "none"}), stages))
