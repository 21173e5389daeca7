"""What the V-shaped schedules share (:mod:`.zbv`, :mod:`.dualpipev`): two model chunks per
rank placed as a V (torch ``generate_stage_to_rank_mapping(style="v")``): rank s holds virtual
stages s (chunk 0, going down the ranks) and ``2p - 1 - s`` (chunk 1, coming back), so rank 0
holds the first and the last virtual stage (the embedding and the output layer, the loss),
rank p - 1 hands its chunk-0 output to its own chunk 1 without a send, and the pipeline's
p2p pattern is one neighbour each way for ranks 0 and p - 1, two for the others.

>>> [[VShaped().virtual_stage(c, s, 4, 2) for c in range(2)] for s in range(4)]
[[0, 7], [1, 6], [2, 5], [3, 4]]
>>> VShaped().last_stage(4, 2), [VShaped().p2p_per_microbatch(4, 2, s) for s in range(4)]
(0, [2, 4, 4, 2])
"""

from __future__ import annotations

import numpy as np

from meshplan.pipeline.base import PipelineSchedule


class VShaped(PipelineSchedule):
    """A schedule with a V-shaped chunk placement (zig-zag: even chunks run down the ranks,
    odd chunks back up); its subclasses hold exactly two chunks (``reasons``)."""

    virtual_stages = True
    splits_backward = True
    chunks = 2

    def virtual_stage(self, chunk, s, p: int, v: int):
        """``chunk p + s`` for an even chunk, ``chunk p + p - 1 - s`` for an odd one (ints or
        arrays)."""
        down, up = chunk * p + s, chunk * p + p - 1 - s
        if isinstance(chunk, np.ndarray) or isinstance(s, np.ndarray):
            return np.where(np.asarray(chunk) % 2 == 0, down, up)
        return down if chunk % 2 == 0 else up

    def reasons(self, p: int, m: int, v: int, framework: str = "torch") -> list[str]:
        if v == self.chunks:
            return []
        return [f"{self.title} needs virtual_stages = 2 (two chunks per rank, a V), got {v}"]
