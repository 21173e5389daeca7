"""Newcomer trial 23's findings on choosing and explaining a mesh.

1. A DeepSpeed ZeRO-3 JSON with ``"overlap_comm": false``: the ``step`` hint re-planned only the
   micro-batch, while ``overlap_comm`` (every all-gather and reduce-scatter off the compute stream)
   was the larger gain and never named. Llama 3 8B on 2 x 8 H100 (dgx-h100), seq 4096, global batch
   256, micro-batch 1: dp_shard 16, 256 / (1 x 16) = 16 micro-batches per step.
"""

from __future__ import annotations

import json
from dataclasses import replace

from meshplan.interop.common import ImportOptions
from meshplan.interop.file_words import file_words
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import exposed_hint, rebuilt_step
from meshplan.units import GiB, step_seconds

OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)


def _deepspeed(tmp_path, **zero):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, **zero}, "bf16": {"enabled": True}}))
    return load_any(path, opts=OPTS)


def _replanned(plan, update):
    alt = build_plan(replace(plan.config, training=plan.config.training.model_copy(update=update)))
    return step_time(alt).step_s, alt.timeline.peak.total_bytes / GiB


def test_zero3_hint_names_overlap_comm_when_off_best_first(tmp_path):
    """Off, the hint re-plans ``overlap_comm = true`` beside the doubled micro-batch, each with the
    step its own re-plan predicts, the shortest first, in the JSON's keys; on (the stage-3 default)
    it is not a knob."""
    cfg = _deepspeed(tmp_path, overlap_comm=False)
    plan = build_plan(cfg)
    st = step_time(plan)
    assert plan.micro_batches == 256 // (1 * 16) == 16
    [line] = exposed_hint(plan, st, rebuilt_step(plan, step_time))
    line = file_words(cfg, line)
    overlap, overlap_peak = _replanned(plan, {"overlap_comm": True})
    micro, micro_peak = _replanned(plan, {"micro_batch": 2})
    # overlapped, the ZeRO collectives leave the compute stream: more of the exposed time goes than
    # with half the micro-batches, whose gathers are still serial with compute
    assert overlap < micro < st.step_s
    assert line.endswith(
        f": shorter with zero_optimization.overlap_comm = true (step {step_seconds(overlap)}, "
        f"{overlap / st.step_s - 1:+.1%}, peak {overlap_peak:.1f} GiB fits); train_micro_batch_size_per_gpu = 2 "
        f"(step {step_seconds(micro)}, {micro / st.step_s - 1:+.1%}, peak {micro_peak:.1f} GiB fits)")
    on = build_plan(_deepspeed(tmp_path))
    on_lines = exposed_hint(on, step_time(on), rebuilt_step(on, step_time))
    assert not any("overlap_comm" in x for x in on_lines)
