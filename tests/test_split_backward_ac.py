"""torch's split-backward (zero-bubble) schedules with activation checkpointing: torchtitan issue
#773 (open, bug and release_blocking) measured InterleavedZeroBubble at 13 tokens/s per GPU
against Interleaved1F1B's 128 on 512 GPUs, and found it slower only with AC; pytorch issue
#136766 (closed; pytorch PR #138119 cut the memory) ran out of memory. plan and step warn on the
combination (:func:`meshplan.pipeline.split_backward_ac.split_backward_ac_warning`) and the bubble hint tries
no zero-bubble schedule under AC. A newcomer's trial: the hint on
examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml (recompute full) suggested zb_h1."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.pipeline.split_backward_ac import SPLIT_BACKWARD_AC, split_backward_ac_warning
from meshplan.plan_runtime import config_warnings
from meshplan.schedule import bubble_hint as bh
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import rebuilt_step
from meshplan.spec.training import TrainingSpec
from tests.cli_run import run_main
from tests.conftest import EXAMPLES

LLAMA405B = EXAMPLES / "llama3-405b_16384xh100_tp8-pp16-dp128.toml"


def _t(**kw) -> TrainingSpec:
    return TrainingSpec(global_batch=8, seq_len=16, **kw)


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv", "dualpipev"])
@pytest.mark.parametrize("kw,mode", [({"recompute": "full"}, "full"), ({"recompute": "layer", "ac_freq": 2}, "selective"),
                                     ({"recompute": "op"}, "selective"),
                                     ({"recompute": "selective", "flash_attention": False}, "full")])
def test_every_split_backward_schedule_under_every_torchtitan_ac_mode_warns(schedule, kw, mode):
    """The torchtitan mode is the one export --to torchtitan writes (selective without flash
    attention exports as mode full)."""
    line, = split_backward_ac_warning(_t(**kw), schedule, 4)
    assert line.startswith(f"{schedule} with activation checkpointing (recompute {kw['recompute']!r}: "
                           f'torchtitan activation_checkpoint.mode = "{mode}") under framework torch: ')
    assert SPLIT_BACKWARD_AC in line and "#773" in line and "#136766" in line


@pytest.mark.parametrize("training,schedule,pp", [
    (_t(recompute="none"), "zb_h1", 4),             # no AC
    (_t(recompute="selective"), "zbv", 4),          # flash attention: torchtitan mode none
    (_t(recompute="full"), "1f1b", 4),              # backward not split
    (_t(recompute="full"), "interleaved_1f1b", 4),
    (_t(recompute="full"), "zb_h1", 1),             # no pipeline
    (_t(recompute="full", framework="megatron"), "zb_h1", 4)])  # not torch's runtime
def test_no_warning_without_both(training, schedule, pp):
    assert split_backward_ac_warning(training, schedule, pp) == ()


def _zb_h1_405b():
    cfg = load_config(LLAMA405B)
    return dataclasses.replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_schedule": "zb_h1"}))


def test_plan_and_step_print_it(tmp_path, capsys):
    """The trial's file switched to zb_h1 (its recompute full): the warning is a note of plan and
    step, and the one line of config_warnings. As written the plan is infeasible since ZB-H1's lagging
    W passes are counted (meshplan.memory.wlag): stage 14 (8 layers, lag min(m 16, s + 1) = 15) holds
    15 x 8 layers x 859,832,320 B of output gradients (405B at tp 8 with SP, s 8192: 2 B x (2 x 1024 x
    16384 + 8192 x (16 x 128 + 2 x 128) + 2 x 8192 x 16384 + 2 x 8192 x 6656)) = 96.1 GiB, plus 16
    micro-batches x 8 layers x 2 s h / t = 33,554,432 B of checkpointed inputs = 4.0 GiB, over its 71.2
    GiB usable: plan exits 1 with the note; step prints no notes for a plan that does not fit, so it
    runs plan's own fix, cp 2 (dp_shard 64), where each of those tensors holds half the tokens."""
    cfg = _zb_h1_405b()
    line, = config_warnings(cfg)
    assert line == split_backward_ac_warning(cfg.training, "zb_h1", 16)[0]
    text = LLAMA405B.read_text().replace("sequence_parallel = true", 'sequence_parallel = true\npp_schedule = "zb_h1"')
    fit = text.replace('names = ["pp", "dp_shard", "tp"]', 'names = ["pp", "dp_shard", "cp", "tp"]') \
        .replace("shape = [16, 128, 8]", "shape = [16, 64, 2, 8]")
    for cmd, body, code in (("plan", text, 1), ("step", fit, 0)):
        path = tmp_path / f"zb_{cmd}.toml"
        path.write_text(body)
        assert run_main(cmd, path) == code, cmd
        assert line in " ".join(capsys.readouterr().out.split()), cmd


def test_the_hint_on_the_trials_file_tries_no_zero_bubble_schedule():
    """The file's recompute full: the hint's knobs are interleaved 1F1B (v 2 and 4) and pp 8
    only (micro_batch is 1, none halved), its line lists them fastest first; with recompute none
    zb_h1, ZB-V and DualPipeV are tried again with reshard_after_forward false (FSDP2 over dp_shard,
    resharded after forward: written true here, their warning's fix)."""
    plan = build_plan(load_config(LLAMA405B))
    words = [w for w, _, _ in bh.bubble_knobs(plan)]
    assert [w.split(" (")[0].split(",")[0] for w in words] == [
        "mesh.virtual_stages = 2", "mesh.virtual_stages = 4", "pp 8 x dp_shard 256"]
    line, = bh.bubble_hint(plan, step_time(plan), rebuilt_step(plan, step_time))
    assert "zb_h1" not in line and "dualpipev" not in line
    steps = [float(part.split(" s,")[0]) for part in line.split("(step ")[1:]]
    assert steps == sorted(steps) and len(steps) == 3
    cfg = load_config(LLAMA405B)
    # reshard_after_forward written true, as the file planned it before unset meant false under pp
    no_ac = build_plan(dataclasses.replace(cfg, training=cfg.training.model_copy(update={
        "recompute": "none", "reshard_after_forward": True})))
    no_ac_words = [w for w, _, _ in bh.bubble_knobs(no_ac)]
    # zb_h1 too with reshard_after_forward false: torch's ScheduleInterleavedZeroBubble splits the backward
    # of stages 1..p-1 as ZB-V does, and leaves a unit resharded after forward no weight gradient
    # (meshplan.pipeline.zb_h1.RESHARD_DEFECT, measured in tests/test_zbh1_fsdp_torch.py)
    assert [w for w in no_ac_words if '"zb_h1"' in w] == [
        'mesh.pp_schedule = "zb_h1", training.reshard_after_forward = false']
    assert [w for w in no_ac_words if '"zbv"' in w or '"dualpipev"' in w] == [
        f'mesh.pp_schedule = "{s}", mesh.virtual_stages = 2, training.reshard_after_forward = false'
        for s in ("zbv", "dualpipev")]
