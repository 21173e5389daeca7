"""One verdict everywhere (issue 11, deliver 4): the capacity row of a plan's own sharding and
recompute comes from the memory timeline (meshplan/plan_capacity.py) and never contradicts the
plan's verdict; the other capacity rows say they are first estimates.

The newcomer's case: a torchtitan job TOML for Llama-3-70B (FSDP, tp 8, local batch 2, seq 8192,
compile on, activation checkpointing "none") on 8 dgx-h100. Before this change `plan` printed
`sharding zero3, recompute none: no tp x pp split of 64 GPUs fits | infeasible` (first estimate
16.43 + 51.71 + 0.40 = 68.53 GiB > 67.06 usable) above a timeline peak of 65.04 GiB, feasible
(64.83 GiB since the import states torchtitan's compiled loss: below).
Usable is now the H100's runtime total, 79.11 GiB x 0.9 = 71.2 GiB, above the estimate: the
library test recreates the case at a 15% reserve (79.11 x 0.85 = 67.24 GiB, between the two).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from meshplan.cli import main
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.memory.constraints import ESTIMATE, constraints
from meshplan.plan import Plan, build_plan
from meshplan.plan_capacity import checked, smallest_split
from meshplan.units import GiB
from tests.conftest import EXAMPLES
from tests.configs import TP4_MB2, seed_mb2_toml

H100_8 = ImportOptions(cluster="dgx-h100", nodes=8)
#: The foreign examples and the options their header comments plan them with.
FOREIGN = {"torchtitan_llama3-8b_8xh100.toml": ImportOptions(cluster="dgx-h100", nodes=1),
           "megatron_llama3-8b_16xh100_tp2-pp2.args": ImportOptions(cluster="dgx-h100", nodes=2),
           "deepspeed_zero2_16xh100.json": ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b",
                                                        seq_len=4096)}


def _newcomer(tmp_path: Path, ac: str) -> Path:
    """The newcomer's torchtitan TOML, written from the 8B example: 70B, tp 8, local batch 2,
    compile on, activation checkpointing ``ac`` (a [activation_checkpoint] table's lines)."""
    text = (EXAMPLES / "torchtitan_llama3-8b_8xh100.toml").read_text()
    text = text.replace('flavor = "8B"', 'flavor = "70B"').replace("local_batch_size = 1", "local_batch_size = 2")
    text = text.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 8")
    text = text.split("[activation_checkpoint]")[0] + f"[activation_checkpoint]\n{ac}\n\n[compile]\nenable = true\n"
    path = tmp_path / "llama3-70b_tt.toml"
    path.write_text(text)
    return path


def _megatron_inputs(cfg):
    """``cfg`` with ``[memory] sp_gathered_input`` false: the case's numbers below were derived with
    the tp GEMMs keeping the sequence shard of their input (Megatron-LM's accounting). Since newcomer
    trial 53 the torchtitan import sets it true (torch's ColwiseParallel keeps the all-gathered
    input): 2 x 16,384 x 8192 x 2 B x 7/8 = 448 MiB more a layer at tp 8, 35 GiB over 80 layers, and
    no split of the case fits; these tests are about the capacity row agreeing with the timeline."""
    return replace(cfg, memory=cfg.memory.model_copy(update={"sp_gathered_input": False}))


def _own(plan) -> tuple[str, str]:
    rows = [r for r in plan.constraints.rows if "(this plan's setting, memory timeline)" in r.text]
    assert len(rows) == 1, [r.text for r in plan.constraints.rows]
    return rows[0].text, rows[0].requires


def _row_says_fits(text: str) -> bool:
    """The row's verdict on the plan's own mesh: ``this mesh, timeline peak X GiB, fits`` or
    ``this mesh (tp T x pp P): timeline peak X GiB, fits`` / ``..., does not fit``."""
    own = text.split("this mesh", 1)[1]
    assert own.endswith(("fits", "does not fit")), text
    return not own.endswith("does not fit")


def test_newcomer_row_agrees_with_the_timeline(tmp_path):
    """The estimate (state 16.43 + activations 51.71 + two gathered layers 0.40 = 68.53 GiB)
    says no split fits at a 15% reserve (79.11 x 0.85 = 67.24 GiB usable); the timeline's peak
    fits 67.24 GiB: the row is now the timeline's. The peak was 65.04 GiB at the head's forward
    under Megatron's loss terms (bf16 logits beside kept fp32 ones); the job compiles the loss
    ([compile] components' default), which the import now states (``memory.cross_entropy =
    "compiled"``: the bf16 logits kept, no fp32 copy, tests/test_loss_memory.py), 16,384 tokens x
    16,032 local vocabulary (128,256 / tp 8) x 4 B = 1,050,673,152 B = 0.98 GiB less there (64.06
    GiB), so the peak is layer 79's backward, 64.83 GiB (its unsharded w_in gradient), where no
    loss tensor is left (the same under both terms; the sharded gradients 4.11 GiB appear only
    at the first reduce-scatter). tp 1, 2 and 4 leave dp 64, 32 and 16 for a global batch of 16 sequences of 2:
    the batch rule refuses them, so tp 8 x pp 1 (this mesh) is the smallest split."""
    cfg = _megatron_inputs(load_any(_newcomer(tmp_path, 'mode = "none"'), opts=H100_8))
    cfg = replace(cfg, training=cfg.training.model_copy(update={"memory_reserve": 0.15}))
    t = cfg.training
    assert (t.sharding, t.recompute, t.micro_batch, t.torch_compile) == ("zero3", "none", 2, True)
    assert 64.83 * GiB < 79.11 * GiB * 0.85 < 68.53 * GiB
    estimated = {r.text: r.requires for r in constraints(cfg.model, t, cfg.cluster, 64).rows}
    assert estimated[f"sharding zero3, recompute none{ESTIMATE}: no tp x pp split of 64 GPUs fits"] == "infeasible"
    plan = checked(build_plan(cfg))
    assert isinstance(plan, Plan) and plan.feasible
    assert f"{plan.timeline.peak.total_bytes / GiB:.2f}" == "64.83" and plan.timeline.peak.layer == 79
    assert f"{plan.constraints.estimate.total_bytes / GiB:.2f}" == "68.53"
    assert _own(plan) == ("sharding zero3, recompute none (this plan's setting, memory timeline): smallest split (tp "
                          "inside a node) that fits is tp 8 x pp 1: this mesh, timeline peak 64.83 GiB, fits",
                          "tp*pp >= 8")
    assert not any(r.text.startswith("sharding zero3") and r.requires == "infeasible" for r in plan.constraints.rows)


def test_newcomer_op_sac_row_agrees(tmp_path):
    """Op-level SAC: the first estimate 60.1 GiB, the timeline's peak 55.88 GiB (layer 79's
    backward; 55.98 GiB at the head's forward under Megatron's loss terms, 0.98 GiB of fp32 logits
    more than the compiled loss keeps: the test above); both fit, the row prints the timeline's."""
    cfg = _megatron_inputs(load_any(_newcomer(tmp_path, 'mode = "selective"\nselective_ac_option = "op"'), opts=H100_8))
    plan = checked(build_plan(cfg))
    assert plan.feasible and f"{plan.constraints.estimate.total_bytes / GiB:.1f}" == "60.1"
    text, requires = _own(plan)
    assert text.endswith("tp 8 x pp 1: this mesh, timeline peak 55.88 GiB, fits") and requires == "tp*pp >= 8"


def test_newcomer_plan_command_prints_no_contradiction(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # each row on one line
    with pytest.raises(SystemExit) as done:  # the import, then its [memory] as _megatron_inputs says
        main(["import", "auto", str(_newcomer(tmp_path, 'mode = "none"')), "--cluster", "dgx-h100", "--nodes", "8",
              "-o", str(tmp_path / "mp.toml")])
    assert (done.value.code or 0) == 0
    job = tmp_path / "mp.toml"
    job.write_text(job.read_text().replace("sp_gathered_input = true", "sp_gathered_input = false"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["plan", str(job)])
    assert (done.value.code or 0) == 0
    out = " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())
    assert "sharding zero3, recompute none (this plan's setting, memory timeline): smallest split" in out
    assert "this mesh, timeline peak 64.83 GiB, fits tp*pp >= 8" in out  # test_newcomer_row_agrees_with_the_timeline
    assert "sharding zero3, recompute none: no tp x pp split" not in out
    # at the 10% reserve the importer writes, usable 79.11 x 0.9 = 71.2 GiB: DDP's state per rank fits
    # only split 64 ways (no split fit the datasheet's 67.1 GiB)
    assert (f"sharding none, recompute none{ESTIMATE}: smallest split (tp inside a node) that fits is tp 8 x pp 8 "
            f"(peak 68.6 GiB) tp*pp >= 64") in out


def test_smallest_split_is_found_by_memory_not_by_this_mesh(tmp_path):
    """tests/configs.py TP4_MB2 (Llama-3-70B, dp_shard 16 x tp 4, micro-batch 2, selective recompute):
    its own timeline peak 121.51 GiB is over 79.11 x 0.9 = 71.20 usable, and tp 8 x pp 1 (the seed's
    mesh at micro-batch 2, configs.seed_mb2_toml, 69.11 GiB) is the smallest split that fits; the row
    says both, and requires tp*pp >= 8. At micro-batch 1 the tp-4 file's own mesh is the smallest."""
    plan = checked(build_plan(load_any(TP4_MB2)))
    assert not plan.feasible
    text, requires = _own(plan)
    assert text.endswith("smallest split (tp inside a node) that fits is tp 8 x pp 1 (timeline peak 69.11 GiB); "
                         "this mesh (tp 4 x pp 1): timeline peak 121.51 GiB, over usable 71.20 GiB, does not fit")
    assert requires == "tp*pp >= 8"
    (tmp_path / "seed-mb2.toml").write_text(seed_mb2_toml())
    seed = build_plan(load_any(tmp_path / "seed-mb2.toml"))
    assert smallest_split(plan) == (8, 1, seed.timeline.peak.total_bytes)
    tp4 = checked(build_plan(load_any(EXAMPLES / "seed-64gpu-tp4.toml")))  # 69.72 GiB, fits 71.20
    assert tp4.feasible and _own(tp4) == ("sharding zero3, recompute selective (this plan's setting, memory timeline): "
                                          "smallest split (tp inside a node) that fits is tp 4 x pp 1: this mesh, "
                                          "timeline peak 69.72 GiB, fits", "tp*pp >= 4")


def _examples():
    for path in sorted(EXAMPLES.iterdir()):
        if path.name in FOREIGN:
            yield path, FOREIGN[path.name]
        elif path.suffix == ".toml":
            yield path, None


@pytest.mark.parametrize("path,opts", list(_examples()), ids=lambda v: getattr(v, "name", ""))
def test_own_row_says_fits_iff_the_verdict_does(path, opts):
    """Over every example config: the plan's own setting's capacity row says this mesh fits iff
    the plan is feasible, names the timeline peak the verdict read, and requires ``infeasible``
    only where nothing fits."""
    cfg = load_any(path, opts=opts or ImportOptions(), foreign=opts is not None)
    plan = checked(build_plan(cfg))
    assert isinstance(plan, Plan)
    text, requires = _own(plan)
    assert _row_says_fits(text) == plan.feasible, text
    assert f"timeline peak {plan.timeline.peak.total_bytes / GiB:.2f} GiB" in text
    assert (requires == "infeasible") == (not plan.feasible and "no tp x pp split" in text)
    others = [r for r in plan.constraints.rows if r.kind == "capacity" and r.text.startswith("sharding")
              and r.text != text]
    assert all(ESTIMATE in r.text for r in others)


def _deepseek_as(tmp_path: Path, name: str, names: str, shape: str, split: str) -> Plan:
    """examples/deepseek-v3_2048xh100_pp16-ep64-dp128.toml (framework megatron, zero1, full recompute,
    micro-batch 1, seq 4096, global batch 15360 on 256 dgx-h100) with its [mesh] names, shape and
    pp_layer_split replaced, planned."""
    text = (EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml").read_text()
    text = text.replace('names = ["pp", "dp_shard", "ep"]', f"names = {names}\nsequence_parallel = true")
    text = text.replace("shape = [16, 128, 64]", f"shape = {shape}")
    text = re.sub(r"(?m)^pp_layer_split = .*$", f"pp_layer_split = {split}", text)
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    plan = build_plan(load_any(path))
    assert isinstance(plan, Plan)
    return plan


def test_smallest_split_plans_uneven_layer_splits(tmp_path):
    """Newcomer trial nc62, finding 1: DeepSeek-V3's 61 layers divide by no pp of 2-16 but 1, so every
    split at a pp other than the example's own 16 was planned with no pp_layer_split, refused (`61
    layers do not divide into pp 2 stages`) and skipped: the row read `smallest split (tp inside a node)
    that fits is tp 1 x pp 16: this mesh` and required tp*pp >= 16, though pp 4 alone fits (52.77 GiB of
    71.20 usable at [15, 16, 16, 14], below). Each pp is now planned with the split a search candidate at that pp has, under framework
    megatron Megatron-LM's --decoder-first/last-pipeline-num-layers cut (mesh.layers.first_last_split),
    derived here by hand: every middle stage ceil(61 / pp) layers, the pp x ceil - 61 layers short taken
    off the ends, the last one more where odd: pp 2: ceil 31, 1 short -> [31, 30]; pp 4: ceil 16,
    3 short -> [15, 16, 16, 14].

    The splits in order of tp x pp, tp largest first, etp kept at the example's 1 (every other axis as
    the plan's, module docstring): 1 (dp 2048 does not divide the 15,360 sequences: refused); 2: tp 2 x
    pp 1 (all 61 layers on each rank, not planned to fit), tp 1 x pp 2 (written below: 89.94 GiB > 71.20
    usable); 4: tp 4 x pp 1, then tp 2 x pp 2, the first that fits. Each peak is the plan of the same
    mesh written as a user writes it (etp 1 given: Megatron-LM's default etp is tp)."""
    usable = 79.11 * 0.9  # GiB: the H100's 79.11 GiB less the example's 10% reserve
    own = checked(build_plan(load_any(EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")))
    text, requires = _own(own)
    assert requires == "tp*pp >= 4"
    assert "smallest split (tp inside a node) that fits is tp 2 x pp 2 (timeline peak " in text
    assert text.endswith("this mesh (tp 1 x pp 16): timeline peak 20.47 GiB, fits")
    tp2pp2 = _deepseek_as(tmp_path, "tp2pp2", '["pp", "dp_shard", "ep", "etp", "tp"]', "[2, 512, 64, 1, 2]", "[31, 30]")
    assert tp2pp2.feasible and tp2pp2.timeline.peak.total_bytes / GiB < usable
    assert smallest_split(own) == (2, 2, tp2pp2.timeline.peak.total_bytes)
    assert f"tp 2 x pp 2 (timeline peak {tp2pp2.timeline.peak.total_bytes / GiB:.2f} GiB)" in text
    tp1pp2 = _deepseek_as(tmp_path, "tp1pp2", '["pp", "dp_shard", "ep"]', "[2, 1024, 64]", "[31, 30]")
    assert not tp1pp2.feasible and tp1pp2.timeline.peak.total_bytes / GiB > usable
    pp4 = _deepseek_as(tmp_path, "pp4", '["pp", "dp_shard", "ep"]', "[4, 512, 64]", "[15, 16, 16, 14]")
    assert pp4.feasible and pp4.timeline.peak.total_bytes / GiB < usable
