"""A pipeline split as torchtitan sets it (newcomer trial nc58 #3b): a ``fix:`` or ``hint:`` line
gives meshplan's ``mesh.pp_layer_split`` as layers per stage (``[7, 8, 8, 8, 8, 8, 8, 6]``), but
torchtitan has no key of layer counts per stage. Its ``parallelism.module_fqns_per_model_part`` takes
one list of module names per model part (virtual stage), ``tok_embeddings`` on the first and the
norm and the output Linear on the last (pytorch/torchtitan b5bcd76 ``config/configs.py``:187,
``distributed/pipeline_parallel.py`` ``_generate_llm_fqn_per_model_part``, the same keys at
238fa99 ``config/job_config.py``:367-389). Without it torchtitan cuts ``pp`` model parts (2 x pp
for a multi-stage schedule, or ``ceil((layers + first + last) / pipeline_parallel_layers_per_stage)``)
evenly over ``layers + first + last`` slots, the embedding counted as
``pipeline_parallel_first_stage_less_layers`` (default 1) and the norm + output as
``pipeline_parallel_last_stage_less_layers`` (1): :func:`~meshplan.interop.torchtitan_tables.default_split`.

:func:`split_setting` writes those two counts (and ``pipeline_parallel_layers_per_stage`` where the
parts are not torchtitan's default number) where torchtitan's own cut gives the split, else the
module names, as ``export --to torchtitan`` writes them (:func:`~meshplan.interop.torchtitan_tables.model_parts`,
the output Linear ``lm_head`` at b5bcd76, ``output`` before). The parts are in model order
(part i holds the layers after part i - 1's), each stage's layers spread over its chunks as the plan
spreads them (:func:`~meshplan.mesh.layers.stage_layers`) under the schedule's chunk map: part
``chunk x pp + stage`` looped, but under ZBVZeroBubble and DualPipeV rank s holds parts s and
``2 pp - 1 - s`` (torchtitan b5bcd76 ``_get_pp_rank_to_stage_indices_mapping``, torch's
``generate_stage_to_rank_mapping(style="v")``: :func:`~meshplan.mesh.chunk_maps.v_shaped`), so a
stage's two chunks are the parts at both ends of the V, not s and pp + s."""

from __future__ import annotations

import json
import math
from typing import Optional

from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_tables import default_split, model_parts
from meshplan.mesh.chunk_maps import v_shaped, virtual_counts
from meshplan.mesh.layers import looped

#: The first/last_stage_less_layers values tried for torchtitan's own cut (its default 1 each).
LESS = (1, 0, 2, 3)


def parts_of(layers: int, split: list[int], chunks: int, v_shape: bool = False) -> Optional[list[int]]:
    """Layers per model part (virtual stage, in model order) of the per-stage ``split`` with
    ``chunks`` chunks a stage, placed looped (part chunk x pp + stage) or, ``v_shape``, as a V
    (ZBVZeroBubble, DualPipeV: module docstring); None where the layers cannot be assigned.

    >>> parts_of(61, [7, 8, 8, 8, 8, 8, 8, 6], 2)
    [3, 4, 4, 4, 4, 4, 4, 3, 4, 4, 4, 4, 4, 4, 4, 3]
    >>> parts_of(10, [4, 6], 2), parts_of(10, [4, 6], 2, v_shape=True)  # V: stage 0 holds parts 0 and 3
    ([2, 3, 2, 3], [2, 3, 3, 2])
    """
    counts = virtual_counts(layers, len(split), chunks, split, v_shaped if v_shape else looped)
    return None if isinstance(counts, str) else counts


def _own_cut(layers: int, parts: list[int], chunks: int) -> Optional[str]:
    """torchtitan's keys that cut ``parts`` itself (module docstring), or None."""
    n = len(parts)
    for first in LESS:
        for last in LESS:
            try:
                if default_split(n, layers, first, last) != parts:
                    continue
            except ConfigError:
                continue
            keys = [f"parallelism.pipeline_parallel_first_stage_less_layers = {first}",
                    f"parallelism.pipeline_parallel_last_stage_less_layers = {last}"]
            if chunks > 2:  # more parts than torchtitan's default: the layers per part that make n of them
                per = next((k for k in range(1, layers + first + last + 1)
                            if math.ceil((layers + first + last) / k) == n), None)
                if per is None:
                    return None
                keys.append(f"parallelism.pipeline_parallel_layers_per_stage = {per}")
            return ", ".join(keys)
    return None


def split_setting(layers: int, split: list[int], chunks: int, lm_head: bool, own_cut: bool = True,
                  v_shape: bool = False) -> Optional[str]:
    """torchtitan's setting of the per-stage ``split`` of ``layers`` layers with ``chunks`` chunks a
    stage (module docstring); ``lm_head``: the output Linear's name at b5bcd76; ``own_cut``: whether
    torchtitan's own cut may be named (not for InterleavedZeroBubble at one stage a rank, which it cuts
    only from the names: :mod:`meshplan.interop.torchtitan`); ``v_shape``: the schedule is ZBVZeroBubble
    or DualPipeV (the parts placed as a V: :func:`parts_of`). None where the layers cannot be
    assigned (the caller keeps meshplan's words).

    Llama-3-8B's 32 layers at pp 2 as [15, 17]: torchtitan's cut of 32 + 2 + 0 = 34 slots in 2 is 17
    each, the first less the embedding's 2: first/last less 2 and 0. DeepSeek-V3's 61 at pp 8 x 2
    chunks as [7, 8, 8, 8, 8, 8, 8, 6]: parts [3, 4 x 6, 3, 4 x 7, 3] (stage 7's 6 layers 3 and 3);
    torchtitan's cuts of 16 parts put every short part at the ends ([3, 4 x 14, 2] by default), so the
    names, 16 lists.

    >>> split_setting(32, [15, 17], 1, False)
    'parallelism.pipeline_parallel_first_stage_less_layers = 2, parallelism.pipeline_parallel_last_stage_less_layers = 0'
    >>> split_setting(6, [1, 1, 4], 1, True)
    'parallelism.module_fqns_per_model_part = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2", "layers.3", "layers.4", "layers.5", "norm", "lm_head"]]'
    >>> tt = split_setting(61, [7, 8, 8, 8, 8, 8, 8, 6], 2, False)
    >>> tt.count("], ["), tt.endswith('["layers.58", "layers.59", "layers.60", "norm", "output"]]')
    (15, True)
    """
    parts = parts_of(layers, split, chunks, v_shape)
    if parts is None or sum(parts) != layers:
        return None
    own = _own_cut(layers, parts, chunks) if own_cut else None
    if own is not None:
        return own
    names = [[("lm_head" if m == "output" and lm_head else m) for m in part] for part in model_parts(parts)]
    return f"parallelism.module_fqns_per_model_part = {json.dumps(names)}"
