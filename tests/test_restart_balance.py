"""Which pipeline degrees a restart proposes (newcomer trial 16): only those whose layers split as
the job's framework sets them and balanced enough (meshplan.restart_degrees.PipelineRule.runs).

Trial 16: Llama-3-70B (80 layers) at dp_shard 16 x cp 4 x tp 4 on 32 dgx-h100 lost a node and
was offered pp 31 x cp 2 x tp 4 (stages of 2 or 3 layers) and pp 15 x cp 4 x tp 4 (5 or 6).
"""

from __future__ import annotations

from meshplan.mesh.layers import balanced_split, first_last_split, split_balance
from meshplan.mesh.resolve import resolve_mesh
from meshplan.restart import PipelineRule, restart_on_fewer_nodes
from meshplan.restart_degrees import BALANCE, DegreeRule
from meshplan.spec.mesh import MeshSpec


def test_first_last_split_by_hand():
    """Megatron-LM's cut: ceil(80 / pp) a middle stage, pp x ceil - 80 off the ends, the last one
    more when odd. pp 7: 12 a stage, 84 - 80 = 4, 2 off each end. pp 27: 3, 81 - 80 = 1 off the
    last. pp 41: 2, 82 - 80 = 2, one off each. pp 31: 3, 93 - 80 = 13 > 2 x 2 (an end keeps a
    layer): none. pp 2 with 61 layers: 31, 1 off the last."""
    assert first_last_split(80, 7) == [10, 12, 12, 12, 12, 12, 10]
    assert first_last_split(80, 27) == [3] * 26 + [2]
    assert first_last_split(80, 41) == [1] + [2] * 39 + [1]
    assert first_last_split(80, 31) is None and first_last_split(61, 2) == [31, 30]


def test_split_balance_by_hand():
    """The mean stage over the heaviest, the better of the layers alone and the layers with one
    more on the first and the last stage (the embedding, the output layer). Even: 1. pp 31's
    balanced split [2, 3 x 18, 2 x 12] (balanced_split: the 18 extra layers on middle stages):
    80 / (31 x 3) = 0.860, (80 + 2) / (31 x 3) = 0.882 (ends 3 and 3 slots). pp 15's [5, 6 x 5,
    5 x 9]: 80 / 90 = 0.889, 82 / 90 = 0.911. pp 7's [11, 12 x 3, 11 x 3]: 80 / 84 = 0.952, its
    slots 12, 12, 12, 12, 11, 11, 12: 82 / 84 = 0.976. Llama 3 405B's [7, 8 x 14, 7]: 128 / 128."""
    assert split_balance(None, 80, 16) == 1.0
    assert balanced_split(80, 31) == [2] + [3] * 18 + [2] * 12
    assert abs(split_balance(balanced_split(80, 31), 80, 31) - 82 / 93) < 1e-12
    assert balanced_split(80, 15) == [5] + [6] * 5 + [5] * 9
    assert abs(split_balance(balanced_split(80, 15), 80, 15) - 82 / 90) < 1e-12
    assert abs(split_balance(balanced_split(80, 7), 80, 7) - 82 / 84) < 1e-12
    assert split_balance([7] + [8] * 14 + [7], 126, 16) == 1.0
    assert BALANCE == 0.95


def test_runs_by_framework():
    """torchtitan takes any split (module_fqns_per_model_part); Megatron-LM's flags set the first
    and last stage only, so its middle stages must be even. Both need the balance >= 0.95."""
    torch, megatron = PipelineRule(80, 1), PipelineRule(80, 1, framework="megatron")
    seven = balanced_split(80, 7)  # [11, 12, 12, 12, 11, 11, 11]: middles 12 and 11
    assert torch.runs(seven, 7) and not megatron.runs(seven, 7)
    assert megatron.runs(first_last_split(80, 7), 7)  # [10, 12 x 5, 10]: 82 / 84
    assert not torch.runs(balanced_split(80, 15), 15) and not torch.runs(balanced_split(80, 31), 31)
    assert megatron.splits_for(7) == [(10, 12, 12, 12, 12, 12, 10)] and torch.splits_for(7) == [tuple(seven)]
    assert isinstance(torch.splits_for(31), str) and isinstance(megatron.splits_for(15), str)


def test_trial16_restart_proposes_no_pp_15_or_31():
    """The trial's mesh, dp_shard 16 x cp 4 x tp 4 (256 GPUs, global batch 512, micro_batch 1),
    loses a node: 248 GPUs. With tp 4 and cp 2 or 4 (8 or 16 GPUs a replica) the GPUs hold pp
    up to 31; the 80 layers split balanced enough at pp 1-10, 12, 14, 16, 17, 20, 21, 27 and 28
    (torch; 11 and 13 are 82 / 88 and 82 / 91, 15 and 31 above). Without an evaluator ranked by
    GPUs: pp 31 x cp 2 x tp 4 (248 GPUs, the trial's proposal) is gone, and so is pp 15 x cp 4 x
    tp 4 (240). The largest mesh keeping the global batch takes 224 GPUs: pp 7 x dp_shard 2 x cp
    4 x tp 4 (m = 512 / 2 = 256, [11, 12 x 3, 11 x 3]) first by the ideal throughput; 248 GPUs
    only at dp_shard 31 x cp 2 x tp 4, global batch 512 -> 31 x 16 = 496 (the other contract).
    """
    mesh = resolve_mesh(MeshSpec(names=["dp_shard", "cp", "tp"], shape=[16, 4, 4]), world=256)
    rule = PipelineRule(80, 1)
    allowed = [pp for pp in range(1, 32) if not isinstance(rule.splits_for(pp), str)]
    assert allowed == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 17, 20, 21, 27, 28]
    r = restart_on_fewer_nodes(mesh, 1, gpus_per_node=8, global_batch=512, micro_batch=1, pipeline=rule,
                               degrees=DegreeRule(((4, 4), (4, 2))))
    pps = {p.pp for p in r.proposals}
    assert not pps & {11, 13, 15, 31} and not [t for t in r.refused if t.startswith(("pp 15 ", "pp 31 "))]
    top = r.proposals[0]
    assert (top.shape, top.gpus, top.micro_batches) == ((7, 2, 4, 4), 224, 256)
    assert top.pp_layer_split == (11, 12, 12, 12, 11, 11, 11)
    assert [(p.gpus, p.global_batch) for p in r.proposals if not p.keeps_global_batch] == [(248, 496)]


def test_trial16_lines_name_the_layer_split():
    """The same restart under Megatron-LM: its cut at pp 7 is [10, 12 x 5, 10] (84 - 80 = 4 off
    the ends), at pp 14 [4, 6 x 12, 4] (84 - 80 = 4), at pp 3 [27, 27, 26]; each mesh's text names
    it after pp (the proposal's own in its pipeline line), and pp 1 names none."""
    mesh = resolve_mesh(MeshSpec(names=["dp_shard", "cp", "tp"], shape=[16, 4, 4]), world=256)
    r = restart_on_fewer_nodes(mesh, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                               pipeline=PipelineRule(80, 1, framework="megatron"), degrees=DegreeRule(((4, 4), (4, 2))))
    assert [p.summary() for p in r.proposals[:2]] + [r.proposals[3].summary(), r.proposals[-1].summary()] == [
        "pp 7 (12 layers per stage, 10 on the first and the last) x dp_shard 2 x cp 4 x tp 4 on 224 GPUs, "
        "contract kept",
        "pp 14 (6 layers per stage, 4 on the first and the last) x cp 4 x tp 4 on 224 GPUs, contract kept",
        "pp 3 (27 layers per stage, 26 on the last) x dp_shard 4 x cp 4 x tp 4 on 192 GPUs, contract kept",
        "dp_shard 31 x cp 2 x tp 4 on 248 GPUs, global_batch 512 -> 496"]
    assert "pipeline: pp 1 -> 7, layers per stage 10, 12 x 5, 10" in r.notes


TRIAL16 = """
[model]
catalog = "llama3-70b"

[cluster]
system = "dgx-h100"
nodes = 32

[training]
global_batch = 512
seq_len = 8192
micro_batch = 1
sharding = "zero3"
reshard_after_forward = true
param_dtype = "fp32"
compute_dtype = "bf16"
reduce_dtype = "fp32"
recompute = "selective"
memory_reserve = 0.10

[mesh]
names = ["dp_shard", "cp", "tp"]
shape = [16, 4, 4]
sequence_parallel = true
"""


def test_trial16_cli_restart_is_planned_at_a_balanced_pp(tmp_path, capsys):
    """The trial's job as meshplan plans it (torch, FSDP2 zero3): before the rule the restart was
    pp 31 x cp 2 x tp 4 on all 248 GPUs ([2, 3 x 18, 2 x 12]). Now no line names pp 15 or 31; the
    proposal is a balanced pp 7 on 224 GPUs (m = 512 / 4 = 128 micro-batches), its split in its
    pipeline line and after pp where another line names it."""
    from meshplan.cli import main
    cfg = tmp_path / "llama3-70b_256xh100_dp16-cp4-tp4.toml"
    cfg.write_text(TRIAL16)
    try:
        main(["reliability", str(cfg), "--lost-nodes", "1", "--write-gbps", "100", "--read-gbps", "100",
              "--restart-overhead-s", "300"])
    except SystemExit as done:
        assert not done.code
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("restart:"))
    assert lines[head].startswith("restart: world 256 -> 224 (248 GPUs left); mesh dp_shard 16 x cp 4 x tp 4 -> pp 7 x "
                                  "dp_shard 4 x cp 2 x tp 4 (shrunk: dp_shard 16 -> 4, cp 4 -> 2; grown: pp 1 -> 7")
    assert "- pipeline: pp 1 -> 7, layers per stage 11, 12 x 3, 11 x 3" in lines
    assert any("passed over: pp 7 (layers per stage 11, 12 x 3, 11 x 3) x dp_shard 4 x cp 2 x tp 4 on 224 GPUs" in line
               for line in lines)
    assert not [line for line in lines[head:] if "pp 15 " in line or "pp 31 " in line]
