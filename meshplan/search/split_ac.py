"""The search's candidates that run a split-backward (zero-bubble) pipeline schedule with
activation checkpointing under ``training.framework = "torch"``: the rows plan, step and export
warn about (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_warning`, the one source of the rule
and its words), over all candidates at once (:func:`split_ac_rows`), and the note the search
prints once about them (:func:`split_ac_notes`).

They are kept and ranked, not rejected: neither torch nor torchtitan refuses the combination.
torchtitan's ``pipeline_llm`` and ``_build_pipeline_schedule`` (torchtitan/distributed/
pipeline_parallel.py at pytorch/torchtitan b5bcd76, August 2026) raise on no activation
checkpointing setting, and its own zero-bubble test recipes, ``llama3_debugmodel_pp4_zero_bubble``
(InterleavedZeroBubble) and ``llama3_debugmodel_pp2_zbv`` (ZBVZeroBubble), set ``FullAC``
(torchtitan_recipes/tests/features.py). torch's ``ScheduleInterleavedZeroBubble`` and
``ScheduleZBVZeroBubble`` refuse only compiled stages (``_check_torch_compile_compatibility``,
pytorch PR #162511) and run the input and weight gradients as two autograd calls
(``backward_one_chunk(full_backward=False)``, then ``backward_weight_one_chunk``: torch/distributed/
pipelining/schedules.py), and a checkpointed region recomputes on every distinct backward
(pytorch PR #166536, which adds ``torch.utils.checkpoint.GraphExecGroup`` to recompute once; the
pipelining schedules read do not enter one). What such a run is reported to do, torchtitan
issue #773 (open) and pytorch issue #136766, is :data:`meshplan.pipeline.split_backward_ac.SPLIT_BACKWARD_AC`.

The search plans them where asked (``[search] pp_schedules``: zbv, dualpipev, zb_h1), less the rows with FSDP2 over a data axis and ``reshard_after_forward`` true, which it
rejects whatever the recompute (rule ``v-reshard``: torch 2.13 gets their gradients wrong,
:data:`meshplan.pipeline.vshape.RESHARD_DEFECT`) and the rows with recompute op, which it rejects
(rule ``split-op``: torch 2.13 raised in W, :data:`meshplan.pipeline.split_backward_ac.OP_AC_RAISES`); the note does not
count either, since they are not kept;
under ``training.framework = "megatron"`` they are an error before the search
(:func:`meshplan.pipeline.registry.check_searched`), so no row there is one.
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.pipeline.split_backward_ac import SPLIT_BACKWARD_AC, split_backward_ac_warning
from meshplan.search.columns import PIPELINE, RECOMPUTE, Candidates
from meshplan.search.reasons import CODE, OK


def split_ac_table(training) -> np.ndarray:
    """(len(RECOMPUTE), len(PIPELINE)) bool: whether a candidate with pp > 1 at that recompute
    (``rc``) and pipeline schedule (``ps``) takes :func:`~meshplan.pipeline.split_backward_ac.split_backward_ac_warning`
    under ``training`` (framework torch, a schedule that splits the backward, a torchtitan
    activation_checkpoint.mode other than none: full, op, layer, and selective without flash
    attention). One call per cell, not per candidate.

    >>> from meshplan.spec.training import TrainingSpec
    >>> split_ac_table(TrainingSpec(global_batch=8, seq_len=16)).astype(int).tolist()  # rows none..block
    [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]]
    >>> split_ac_table(TrainingSpec(global_batch=8, seq_len=16, framework="megatron")).any()
    np.False_
    """
    # a block row runs full on its first n layers (recompute_num_layers, Megatron-LM's only)
    return np.array([[bool(split_backward_ac_warning(training.model_copy(update={"recompute": "full" if rc == "block"
                                                                                 else rc}), ps, 2))
                      for ps in PIPELINE] for rc in RECOMPUTE], dtype=bool)


def split_ac_rows(training, c: Candidates) -> np.ndarray:
    """Bool per candidate of ``c``: pp > 1 and :func:`split_ac_table` at its ``rc`` and ``ps``."""
    return split_ac_table(training)[c.rc, c.ps] & (c.pp > 1)


def split_ac_notes(cfg: Config, c: Candidates, code: np.ndarray) -> list[str]:
    """One line where some candidate of ``c`` is such a row (:func:`split_ac_rows`) not rejected by
    rule ``v-reshard`` or ``split-op`` (``code``; those are not kept): how many, how many of them feasible (``code``
    :data:`~meshplan.search.reasons.OK`), that they are ranked by the schedule's step with W's forward
    replays counted under eager full or layer AC (:func:`meshplan.pipeline.split_backward_ac.w_replay_words`) and the
    rest of the reported slowdown not, the sources and the fix."""
    rows = split_ac_rows(cfg.training, c) & (code != CODE["v-reshard"]) & (code != CODE["split-op"])
    n = int(rows.sum())
    if not n:
        return []
    scheds = "/".join(PIPELINE[k] for k in sorted(set(c.ps[rows].tolist())))
    return [f"{n:,} candidates ({int((rows & (code == OK)).sum()):,} feasible) run {scheds} with activation "
            "checkpointing (a torchtitan activation_checkpoint.mode other than none) under training.framework "
            "\"torch\": kept and ranked by the schedule's step (W's forward replays counted under eager full or "
            "layer AC, the rest of the reported slowdown not), since neither "
            f"torchtitan nor torch refuses them: {SPLIT_BACKWARD_AC}; to leave them out, set [search] recompute "
            f"= [\"none\"] or drop {_listed(scheds.split('/'))} from [search] pp_schedules"]


def _listed(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``.

    >>> _listed(["zbv"]), _listed(["zbv", "zb_h1"]), _listed(["zbv", "dualpipev", "zb_h1"])
    ('zbv', 'zbv and zb_h1', 'zbv, dualpipev and zb_h1')
    """
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
