"""How DeepSpeed's ``PipelineModule`` splits Megatron-DeepSpeed's ``GPTModelPipe`` over pipeline
stages: ``mesh.pp_layer_split`` of a Megatron-DeepSpeed import under DeepSpeed's PipelineEngine
(``training.pp_engine = "deepspeed"``).

Read in microsoft/DeepSpeed v0.6.5 (8164ea9e6d35dfbbe62b0f15448daf05268b9e81): ``runtime/pipe/module.py``
``_partition_layers`` (363-391): with ``partition_method = "type:REGEX"`` each layer spec weighs 1 if
``REGEX`` (case-insensitive) finds its class name (``_find_layer_type``, 285-305: a ``LayerSpec``'s
``typename.__name__``, a function's ``__name__``), else 0, and ``ds_utils.partition_balanced``
(``runtime/utils.py:563-663``) cuts the specs into contiguous parts: a binary search (to within
``eps`` 1e-3) for the smallest bottleneck, the heaviest part's weight, that a greedy probe can meet,
then that probe's cut: part p ends at the first spec whose running weight reaches the previous
part's end weight plus the bottleneck (``bisect_left`` on the inclusive prefix sums, the last part
taking the rest). :func:`balanced` is that rule, written anew.

The specs of ``GPTModelPipe`` (bigscience-workshop/Megatron-DeepSpeed 3d5d151,
``megatron/model/gpt_model.py`` ``GPTModelPipe.__init__``; microsoft/Megatron-DeepSpeed's is the same
up to the last spec): ``_to_float16``, the embedding (``TiedLayerSpec`` of ``EmbeddingPipe``), a
transpose ``<lambda>``, one ``ParallelTransformerLayerPipe`` per layer, the ``undo`` transpose, the
final ``MixedFusedLayerNorm`` and the tied output embedding (``EmbeddingPipe`` again). The method is
``--pp-partition-method`` where the script gives it (BigScience's fork; BLOOM-176B ran
``'type:transformer|embedding'``: ``[embed | 5 blocks]``, 10 x 6 blocks, ``[5 blocks | embed]`` at 70
layers and pp 12, as its tr11-176B-ml README shows), else ``type:transformer`` (``gpt_model.py``
``partition_method = 'type:transformer'``). Under ``type:transformer`` the layers of a stage are
``ceil``-sized greedily from the first stage, so 70 layers over 12 stages are eleven stages of 6 and
a last stage of 4, not Megatron-LM's even split.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from itertools import accumulate
from typing import Sequence

from meshplan.errors import ConfigError

#: ``GPTModelPipe``'s specs before and after the transformer layers (module docstring).
BEFORE = ("_to_float16", "EmbeddingPipe", "<lambda>")
AFTER = ("undo", "MixedFusedLayerNorm", "EmbeddingPipe")
LAYER = "ParallelTransformerLayerPipe"
#: BigScience's partition method for BLOOM-176B (tr11-176B-ml.slurm): the embeddings counted as layers.
EMBEDDING_METHOD = "type:transformer|embedding"
#: The tolerance of DeepSpeed's binary search (``partition_balanced``'s ``eps``).
EPS = 1e-3


def _probe(prefix: Sequence[float], parts: int, bottleneck: float) -> tuple[list[int], bool]:
    """The greedy cut of the specs whose inclusive prefix weights are ``prefix`` into ``parts`` parts,
    each at most ``bottleneck`` heavier than where the previous one ended; whether it fits."""
    n, cut, target = len(prefix), [0] + [len(prefix)] * parts, bottleneck
    for p in range(1, parts):
        cut[p] = bisect_left(prefix, target, lo=cut[p - 1])
        if cut[p] == n:
            return cut, prefix[-1] - prefix[cut[p - 1]] < bottleneck
        target = prefix[cut[p] - 1] + bottleneck
    return cut, target >= prefix[-1]


def balanced(weights: Sequence[float], parts: int) -> list[int]:
    """The ``parts + 1`` boundaries DeepSpeed's ``partition_balanced`` gives ``weights`` (module
    docstring); at most one spec a part when there are no more specs than parts.

    >>> balanced([1] * 10, 3), balanced([1, 1, 1, 1, 4], 2), balanced([1, 1], 3)
    ([0, 4, 8, 10], [0, 4, 5], [0, 1, 2, 2])
    """
    n = len(weights)
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    prefix = list(accumulate(weights))
    lower, upper = prefix[-1] / parts, float(prefix[-1])
    while upper > lower + EPS:
        mid = lower + (upper - lower) / 2
        if _probe(prefix, parts, mid)[1]:
            upper = mid
        else:
            lower = mid + EPS
    return _probe(prefix, parts, upper)[0]


def pipe_split(layers: int, pp: int, method: str = "type:transformer") -> list[int]:
    """Transformer layers on each of ``pp`` stages when DeepSpeed partitions ``GPTModelPipe`` of
    ``layers`` layers by ``method`` (module docstring); ConfigError naming ``--pp-partition-method``
    for a method other than ``type:REGEX`` or a regex that finds no spec.

    >>> pipe_split(70, 12), pipe_split(70, 12, "type:transformer|embedding")
    ([6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 4], [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5])
    >>> pipe_split(96, 8)
    [12, 12, 12, 12, 12, 12, 12, 12]
    """
    if not method.lower().startswith("type:"):
        raise ConfigError("--pp-partition-method", f"{method!r}: meshplan reads DeepSpeed's 'type:REGEX' methods "
                                                   f"(runtime/pipe/module.py); use e.g. 'type:transformer'")
    try:
        found = re.compile(method.split(":", 1)[1], re.IGNORECASE)
    except re.error as e:
        raise ConfigError("--pp-partition-method", f"{method!r} is not a regular expression ({e})") from None
    names = [*BEFORE, *[LAYER] * layers, *AFTER]
    weights = [1 if found.search(name) else 0 for name in names]
    if not any(weights):
        raise ConfigError("--pp-partition-method", f"{method!r} finds no layer of GPTModelPipe (DeepSpeed raises "
                                                   f"\"found no valid layers to partition\"); use 'type:transformer'")
    cut = balanced(weights, pp)
    first = len(BEFORE)
    return [sum(first <= i < first + layers for i in range(cut[s], cut[s + 1])) for s in range(pp)]
