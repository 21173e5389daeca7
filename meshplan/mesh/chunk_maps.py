"""The V-shaped schedules' chunk map (:func:`v_shaped`) and the layers per model part (virtual
stage, in model order) of a split under a chunk map (:func:`virtual_counts`): what a framework's
per-model-part setting (torchtitan's ``module_fqns_per_model_part``) lists, whose rank holds which
part being the schedule's map, not the looped one, for ZB-V and DualPipeV."""

from __future__ import annotations

from typing import Optional, Union

from meshplan.mesh.layers import VirtualStage, looped, stage_layers


def v_shaped(chunk: int, stage: int, pp: int, vpp: int) -> int:
    """The V map of the V-shaped schedules (ZB-V, DualPipeV): even chunks run down the ranks
    (``chunk * pp + stage``), odd ones back up (``chunk * pp + pp - 1 - stage``), so with two
    chunks rank s holds virtual stages s and ``2 pp - 1 - s``: torch's
    ``generate_stage_to_rank_mapping(style="v")`` (torch/distributed/pipelining/_utils.py, torch
    2.13) and torchtitan's ``_get_pp_rank_to_stage_indices_mapping`` (pytorch/torchtitan b5bcd76
    ``distributed/pipeline_parallel.py``: ``zip(range(pp), range(num_stages - 1, pp - 1, -1))``);
    :meth:`meshplan.pipeline.vshape.VShaped.virtual_stage` is the same map over arrays.

    >>> [[v_shaped(c, s, 4, 2) for c in range(2)] for s in range(4)]
    [[0, 7], [1, 6], [2, 5], [3, 4]]
    """
    return chunk * pp + (stage if chunk % 2 == 0 else pp - 1 - stage)


def virtual_counts(layers: int, pp: int, vpp: int, split: Optional[list[int]],
                   virtual_stage: VirtualStage = looped) -> Union[list[int], str]:
    """Layers per virtual stage in model order (the model's first layers first: torchtitan's model
    parts, ``module_fqns_per_model_part``'s order) of the per-stage or per-virtual-stage ``split``
    (None: even) as :func:`~meshplan.mesh.layers.stage_layers` assigns them under
    ``virtual_stage``'s chunk map; a one-line reason where the layers cannot be assigned. Under a V
    a stage's chunks are virtual stages s and ``2 pp - 1 - s``, not s and ``pp + s``: 10 layers as
    [4, 6] at pp 2 (each stage's layers over its two chunks, stage 0's first chunk the short one)
    are parts [2, 3, 2, 3] looped, [2, 3, 3, 2] in a V.

    >>> virtual_counts(10, 2, 2, [4, 6]), virtual_counts(10, 2, 2, [4, 6], v_shaped)
    ([2, 3, 2, 3], [2, 3, 3, 2])
    """
    at = stage_layers(layers, pp, vpp, split, virtual_stage)
    if isinstance(at, str):
        return at
    counts = [0] * (pp * vpp)
    for k in range(pp):
        for c in range(vpp):
            counts[virtual_stage(c, k, pp, vpp)] = len(at[k][c])
    return counts


def chunk_map(schedule: Optional[str]) -> VirtualStage:
    """The chunk map of meshplan schedule ``schedule`` (``mesh.pp_schedule``): :func:`v_shaped`
    for the V-shaped ``zbv`` and ``dualpipev`` (:data:`meshplan.pipeline.vshape.VShaped`), else
    :func:`~meshplan.mesh.layers.looped`.

    >>> chunk_map("zbv") is v_shaped, chunk_map("interleaved_1f1b") is looped, chunk_map(None) is looped
    (True, True, True)
    """
    return v_shaped if schedule in ("zbv", "dualpipev") else looped
