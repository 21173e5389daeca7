"""nc56's trial: ``zb_h1`` (torch's ScheduleInterleavedZeroBubble at one stage per rank) with FSDP2 over
a data axis and ``reshard_after_forward`` true was planned, hinted and exported with no warning, while
torch 2.13's split backward leaves the stages after the first no weight gradient
(tests/test_zbh1_fsdp_torch.py measures it: stage 1's gradient None at pp 2; exact with it false).
The warning is :meth:`meshplan.pipeline.zb_h1.ZBH1.warnings`, the V-shaped schedules' condition
(:func:`meshplan.pipeline.vshape.reshard_defect`) on zb_h1's own words."""

from __future__ import annotations

import pytest

from meshplan.pipeline.registry import get
from meshplan.pipeline.zb_h1 import RESHARD_DEFECT
from tests.cli_run import run_cli

#: Llama-3-8B on one dgx-h100: pp 2 x dp_shard 2 x tp 2, FSDP2 (zero3) over dp_shard 2, zb_h1;
#: 16 sequences / (micro-batch 1 x dp 2) = 8 micro-batches >= pp 2, a multiple of torch's
#: rounds max(1, 8 // 2) = 4, so the schedule itself is feasible.
JOB = """[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 1
[training]
global_batch = 16
seq_len = 4096
micro_batch = 1
sharding = "zero3"
recompute = "none"
reshard_after_forward = {rf}
[mesh]
names = ["pp", "dp_shard", "tp"]
shape = [2, 2, 2]
sequence_parallel = true
pp_schedule = "zb_h1"
"""

WARNING = ("zb_h1 with FSDP2 over a data axis and reshard_after_forward true under framework torch: "
           + RESHARD_DEFECT + "; fix: training.reshard_after_forward = false (torchtitan's default under pp)")


def test_the_condition_is_the_v_schedules_four():
    """Torch, p > 1, FSDP2 over a data axis, resharded after forward: each one off, no warning
    (at p 1 there is no split backward; Megatron-LM runs no zb_h1; without a data axis FSDP2
    swaps nothing; kept gathered, the I finds the unsharded weights in the graph)."""
    zb = get("zb_h1")
    assert zb.warnings("torch", 2, True, True) == (WARNING,)
    for args in (("torch", 1, True, True), ("megatron", 2, True, True), ("torch", 2, False, True),
                 ("torch", 2, True, False)):
        assert zb.warnings(*args) == (), args
    # 1F1B and interleaved 1F1B run full backwards: no such warning
    assert get("1f1b").warnings("torch", 2, True, True) == get("interleaved_1f1b").warnings("torch", 2, True, True) == ()


@pytest.mark.parametrize("cmd", ["plan", "step"])
def test_plan_and_step_warn_only_when_resharded(tmp_path, capsys, cmd):
    for rf, want in (("true", True), ("false", False)):
        cfg = tmp_path / f"zb_{rf}.toml"
        cfg.write_text(JOB.format(rf=rf))
        code, out, _ = run_cli([cmd, cfg], capsys)
        assert code == 0
        assert (WARNING in " ".join(out.split())) is want, (cmd, rf)


def test_export_writes_the_warning_in_the_torchtitan_header(tmp_path, capsys):
    """torchtitan's fsdp_reshard_after_forward = "always" with InterleavedZeroBubble: the file says why
    it trains wrong, as a V-shaped schedule's export does."""
    cfg = tmp_path / "zb.toml"
    cfg.write_text(JOB.format(rf="true"))
    code, _, _ = run_cli(["export", cfg, "--to", "torchtitan", "-o", tmp_path / "tt.toml"], capsys)
    assert code == 0
    text = (tmp_path / "tt.toml").read_text()
    assert 'pipeline_parallel_schedule = "InterleavedZeroBubble"' in text
    assert 'fsdp_reshard_after_forward = "always"' in text
    header = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("#"))
    assert "warning: zb_h1 with FSDP2 over a data axis and reshard_after_forward true" in header
