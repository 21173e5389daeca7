"""A foreign config's degrees that do not make the world, refused in its own words (newcomer
trial finding 3): :func:`meshplan.mesh.resolve.world_error` names meshplan's keys
(``mesh.shape``, ``cluster.nodes``), which a torchtitan job file or Megatron-LM arguments do
not have. :func:`foreign_world_error` says the same in one line with the format's keys and
meshplan's import options: torchtitan's ``parallelism.*_degree`` (its ``ParallelDims``
asserts their product is the world size), Megatron-LM's parallel-size flags (it infers dp =
world / (tp x cp x pp), so only the node count can be off), DeepSpeed's data axis (the world
itself), and ``--nodes`` for the cluster.
"""

from __future__ import annotations

from math import prod
from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.megatron import PARALLEL
from meshplan.interop.torchtitan import DEGREES
from meshplan.mesh.axes import EXPERT_AXES

#: Each format's key for a mesh axis (None: the format infers that axis and has no key for it).
KEYS = {"torchtitan": {axis: f"parallelism.{key}" for key, axis in DEGREES.items()},
        "megatron": {axis: flag for flag, axis in PARALLEL.items()},
        "deepspeed": {}}
#: Why each format refuses a product that is not the world (torchtitan/distributed/parallel_dims.py,
#: ``ParallelDims._validate``; Megatron-LM: parallel_state.initialize_model_parallel derives dp).
REFUSAL = {"torchtitan": "torchtitan refuses that at start-up (ParallelDims)",
           "megatron": "Megatron-LM runs dp = world / (tp x cp x pp)",
           "deepspeed": "DeepSpeed runs one data-parallel rank per GPU"}
_DATA_AXES = ("dp_shard", "dp", "dp_replicate")


def foreign_world_error(cfg: Config, bad: ConfigError) -> ConfigError:
    """``bad`` (:func:`~meshplan.mesh.resolve.world_error` of ``cfg``) in the words of the
    format ``cfg`` was read from (``cfg.origin``); ``bad`` itself for a meshplan TOML or where
    the degrees' product is the world (a -1 the readers resolve first).

    Fix: the first data axis the format has a key for, rescaled to the world (the torchtitan
    example on 16 dgx-h100 nodes: ``data_parallel_shard_degree = 16 (128 / tensor_parallel_degree
    8)``), then the node count whose GPUs the product fills (``--nodes 8 (64 GPUs)``)."""
    keys, spec = KEYS.get(cfg.origin), cfg.mesh
    if keys is None or spec is None or spec.names is None or spec.shape is None:
        return bad
    dense = [(n, d) for n, d in zip(spec.names, spec.shape) if n not in EXPERT_AXES]
    world, gpus, total = cfg.cluster.world, cfg.cluster.node.gpus, prod(d for _, d in dense)
    if total == world or min(d for _, d in dense) < 1:
        return bad
    short = {a: k.removeprefix("parallelism.") for a, k in keys.items()}
    expr = " x ".join(f"{short.get(n, n)} {d}" for n, d in dense if d > 1) or "1"
    axis = _rescaled(dense, keys, world, total)
    fixes = []
    if axis is not None:
        rest = total // dict(dense)[axis]
        others = " x ".join(f"{short.get(n, n)} {d}" for n, d in dense if n != axis and d > 1) or "1"
        infer = "; or -1 to infer it" if cfg.origin == "torchtitan" and axis == "dp_shard" else ""
        fixes.append(f"{short[axis]} = {world // rest} ({world} / {others}{infer})")
    if total % gpus == 0:
        fixes.append(f"--nodes {total // gpus} ({total} GPUs)")
    field = keys[axis] if axis is not None else "--nodes"
    return ConfigError(field, f"{expr} = {total} ranks, but --nodes {cfg.cluster.nodes} x {gpus} GPUs = {world}; "
                       f"{REFUSAL[cfg.origin]}; fix: " + (", or ".join(fixes) or
                                                          f"degrees whose product is {world}"))


def _rescaled(dense: list[tuple[str, int]], keys: dict[str, str], world: int, total: int) -> Optional[str]:
    """The first data axis with a key in the format whose degree, the others kept, can make
    ``world`` ranks; None when none can."""
    degrees = dict(dense)
    return next((a for a in _DATA_AXES if a in degrees and a in keys and degrees[a] > 0
                 and world % (total // degrees[a]) == 0), None)
