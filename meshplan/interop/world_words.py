"""A foreign config's degrees that do not make the world, refused in its own words (newcomer
trial finding 3): :func:`meshplan.mesh.resolve.world_error` names meshplan's keys
(``mesh.shape``, ``cluster.nodes``), which a torchtitan job file or Megatron-LM arguments do
not have. :func:`foreign_world_error` says the same in one line with the format's keys and
meshplan's import options: torchtitan's ``parallelism.*_degree`` (its ``ParallelDims``
asserts their product is the world size), Megatron-LM's parallel-size flags (it infers dp =
world / (tp x cp x pp), so only the node count can be off), DeepSpeed's data axis (the world
itself), and ``--nodes`` for the cluster. :func:`megatron_world_error` is the same line for
Megatron-LM arguments whose product does not divide the world, raised by its reader (dp is
inferred, so the fix is the product's largest flag at a value that divides, or a node count).
"""

from __future__ import annotations

from math import gcd, prod
from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.megatron_flags import PARALLEL
from meshplan.interop.torchtitan_mesh import DEGREES
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


def megatron_world_error(deg: dict[str, int], world: int, nodes: int, layers: int = 0) -> ConfigError:
    """Megatron-LM's tp x cp x pp (``deg``) that does not divide ``world`` (``nodes`` of world /
    nodes GPUs), in one line with the product's flags and, as :func:`foreign_world_error`'s fix,
    concrete values: the largest-degree flag that can fix it alone, at the values nearest its own
    that divide world / the others (a pp among those dividing ``layers`` too, when any; a tp among
    those dividing a node's GPUs), named as the error's field; then the node counts nearest
    ``nodes`` whose world is a multiple of the product (the field where no flag can fix it alone).
    Llama 3 70B at tp 8 x pp 7 on 192 8-GPU nodes:

    >>> print(megatron_world_error({"tp": 8, "cp": 1, "pp": 7}, 1536, 192, 80))
    --pipeline-model-parallel-size: --tensor-model-parallel-size 8 x --pipeline-model-parallel-size 7 = 56 does \
not divide the world, --nodes 192 x 8 GPUs = 1536; Megatron-LM runs dp = world / (tp x cp x pp); fix: \
--pipeline-model-parallel-size 4 or 8 (each divides 1536 / 8 = 192 and the 80 layers), or --nodes 189 or 196 \
(multiples of 56 GPUs)
    """
    gpus, flag_of = world // nodes, {axis: flag for flag, axis in PARALLEL.items()}
    dense = prod(deg[a] for a in ("tp", "cp", "pp"))
    expr = " x ".join(f"{flag_of[a]} {deg[a]}" for a in ("tp", "cp", "pp") if deg[a] > 1)
    fixes, field = [], "--nodes"
    for axis in sorted((a for a in ("tp", "cp", "pp") if deg[a] > 1), key=lambda a: -deg[a]):
        rest = dense // deg[axis]
        values = [v for v in _divisors(world // rest) if v != deg[axis] and (axis != "tp" or gpus % v == 0)]
        fit = [v for v in values if axis == "pp" and layers and layers % v == 0]
        if world % rest or not values:
            continue
        also = f" and the {layers} layers" if fit else ""
        field = flag_of[axis]
        whole = f"{world} / {rest} = {world // rest}" if rest > 1 else f"{world}"
        fixes.append(f"{field} {_either(_nearest(fit or values, deg[axis]))} (each divides {whole}{also})")
        break
    step = dense // gcd(dense, gpus)
    counts = [n for n in (nodes // step * step, (nodes // step + 1) * step) if n >= step]
    fixes.append(f"--nodes {_either(counts)} (multiples of {dense} GPUs)")
    expr += f" = {dense}" if " x " in expr else ""
    return ConfigError(field, f"{expr} does not divide the world, --nodes {nodes} x {gpus} GPUs = "
                       f"{world}; {REFUSAL['megatron']}; fix: " + ", or ".join(fixes))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(values: list[int], degree: int) -> list[int]:
    """The largest of ``values`` below ``degree`` and the smallest above it (those there are)."""
    below, above = [v for v in values if v < degree], [v for v in values if v > degree]
    return below[-1:] + above[:1]


def _either(values: list[int]) -> str:
    return " or ".join(map(str, values))
