"""What a restart says about the job's kind (issue 11 follow-ups, newcomer trial): each plan of
the kind that fails is refused with its reason, one line each (and in ``Restart.refused``); a
line names the kind and both throughputs where the 5% rule (RESTART_MARGIN) passes over it; no
schedule is named for a pipeline added to a pp 1 job, which ran none."""

from dataclasses import replace

import pytest

from meshplan.mesh.resolve import resolve_mesh
from meshplan.restart import PipelineRule, restart_on_fewer_nodes
from meshplan.restart_text import pipeline_note
from meshplan.spec.mesh import MeshSpec

SEED = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[8, 8]), world=64)
OOM = "peak 90.0 GiB > 67.1 GiB usable"


def _restart(evaluate):
    """The seed's dp_shard 8 x tp 8 (global batch 512, micro_batch 1, 80 layers, pp varied) loses a
    node: 56 GPUs, tp 8, pp x dp <= 7 (tests/test_restart_kind.py derives every mesh)."""
    return restart_on_fewer_nodes(SEED, 1, gpus_per_node=8, global_batch=512, micro_batch=1,
                                  pipeline=PipelineRule(80, 1), evaluate=evaluate)


def _ideal(p, gain=1.0):
    """Stand-in plan: 1000 tokens/s per ideal GPU (GPUs x m / (m + pp - 1)), x ``gain`` at pp > 1."""
    return replace(p, step_s=1.0, tokens_per_s=1000 * p.ideal * (gain if p.pp > 1 else 1.0), peak_bytes=0.0)


def test_each_failed_plan_of_the_kind_is_refused_with_its_reason():
    """Every pp 1 plan fails (memory, stand-in). The kind (dp_shard x tp 8, pp 1) is tried at its
    largest mesh keeping 512, dp 4 on 32 GPUs, and at all 56 GPUs, dp 7 with 512 // 7 x 7 = 511:
    both were dropped silently; now each is refused on a line of its own, with its contract, after
    the larger meshes refused (none: pp 7 x dp 1 uses all 56), and the head line names none."""
    r = _restart(lambda p: OOM if p.pp == 1 else _ideal(p))
    assert all(p.pp > 1 for p in r.proposals)
    assert r.refused == (f"the job's kind dp_shard 4 x tp 8 (32 GPUs): {OOM}",
                         f"the job's kind dp_shard 7 x tp 8 (56 GPUs, global_batch 512 -> 511): {OOM}")
    assert [n for n in r.notes if n.startswith("refused: ")] == [f"refused: {x}" for x in r.refused]
    assert r.lines()[0] == "restart: world 64 -> 56; mesh dp_shard 8 x tp 8 -> pp 7 x dp_shard 1 x tp 8 (shrunk: " \
                           "dp_shard 8 -> 1; grown: pp 1 -> 7; kept: tp 8)"
    assert not [n for n in r.notes if "passed over" in n]  # no plan of the kind to pass over


def test_only_the_failed_plan_of_the_kind_is_refused():
    """dp 7 (511, 56 GPUs) fails, dp 4 (32 GPUs, 32,000 tokens/s) plans: one refusal line; and
    pp 7 x dp 1 (55,351) passes over dp 4 (73.0% more), said in its line."""
    r = _restart(lambda p: OOM if (p.pp, p.dp) == (1, 7) else _ideal(p))
    assert r.refused == (f"the job's kind dp_shard 7 x tp 8 (56 GPUs, global_batch 512 -> 511): {OOM}",)
    assert [(p.pp, p.dp) for p in r.proposals if p.pp == 1] == [(1, 4)]
    assert ("the job's kind (the job's axes and pp 1, tried first): dp_shard 4 x tp 8 on 32 GPUs plans 32,000 "
            "tokens/s; passed over: pp 7 (layers per stage 11, 12 x 3, 11 x 3) x tp 8 on 56 GPUs plans 55,351 "
            "tokens/s, 73.0% more, over the 5% restart margin; it is the proposal") in r.notes


@pytest.mark.parametrize("gain, passed", [(1.04, False), (1.08, True)])
def test_a_line_names_the_kind_the_5pct_rule_passes_over(gain, passed):
    """The kind's plan: dp 7 at 511, 56 x 1000 = 56,000 tokens/s (dp 4, 32,000, is over 5% slower).
    pp 7 x dp 1 keeps 512 at 56 x 512 / 518 x 1000 x gain: x 1.04 = 57,565 (2.8% more, within 5%:
    the kind stays first, no line); x 1.08 = 59,779 (6.7% more: pp 7 proposed, and a line names
    the kind passed over with both throughputs)."""
    r = _restart(lambda p: _ideal(p, gain))
    lines = [n for n in r.notes if "passed over" in n]
    assert (r.proposals[0].pp == 7) == passed
    assert lines == (["the job's kind (the job's axes and pp 1, tried first): dp_shard 7 x tp 8 on 56 GPUs, "
                      "global_batch 512 -> 511, plans 56,000 tokens/s; passed over: pp 7 (layers per stage 11, 12 "
                      "x 3, 11 x 3) x tp 8 on 56 GPUs plans 59,779 tokens/s, 6.7% more, over the 5% restart "
                      "margin; it is the proposal"]
                     if passed else [])
    assert not r.refused  # every plan of the kind ran


def test_no_schedule_named_for_a_pipeline_added_to_a_pp1_job():
    """pp 1 -> 7 (80 layers, balanced 11, 12 x 3, 11 x 3): the job ran no pipeline schedule, so the
    line names none ('(the configured schedule)' before); pp 2 -> 4 keeps the schedule it ran."""
    from types import SimpleNamespace as N
    top = N(pp=7, pp_layer_split=(11, 12, 12, 12, 11, 11, 11))
    assert pipeline_note(N(layers=80, pp=1, split=None, vpp=1), top) == [
        "pipeline: pp 1 -> 7, layers per stage 11, 12 x 3, 11 x 3"]
    assert pipeline_note(N(layers=32, pp=2, split=None, vpp=1), N(pp=4, pp_layer_split=None)) == [
        "pipeline: pp 2 -> 4, layers per stage 16 x 2 -> 8 x 4 (the schedule kept)"]


@pytest.mark.heavy
def test_megatron_example_names_the_kind_passed_over(capsys):
    """The Megatron example (Llama-3-8B pp 2 x dp 4 x tp 2 on 2 dgx-h100, global batch 128) loses a
    node: 8 GPUs. The kind, pp 2 x dp 2 x tp 2, plans 77,848 tokens/s; pp 1 x dp 4 x tp 2 plans
    84,260, 84,260 / 77,848 - 1 = 8.2% more (over 5%): proposed, and the line says so (planned by
    this planner, the newcomer trial's numbers)."""
    from pathlib import Path
    from meshplan.cli import main
    ex = Path(__file__).resolve().parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"
    with pytest.raises(SystemExit):
        main(["reliability", str(ex), "--cluster", "dgx-h100", "--nodes", "2", "--write-gbps", "100",
              "--read-gbps", "200", "--restart-overhead-s", "300"])
    lines = capsys.readouterr().out.splitlines()
    assert "restart: world 16 -> 8; mesh pp 2 x dp 4 x tp 2 -> pp 1 x dp 4 x tp 2 (shrunk: pp 2 -> 1; kept: dp 4, tp 2)" in lines
    assert ("- the job's kind (the job's axes and pp 2, tried first): pp 2 x dp 2 x tp 2 on 8 GPUs plans 77,848 "
            "tokens/s; passed over: pp 1 x dp 4 x tp 2 on 8 GPUs plans 84,260 tokens/s, 8.2% more, over the "
            "5% restart margin; it is the proposal") in lines


#: A Megatron-LM Llama-3-70B job (newcomer trial): tp 8 with SP, pp 4 interleaved (5 layers per
#: virtual stage: vpp 4), dp 4 on 16 dgx-h100, global batch 512, micro-batch 1.
MEGATRON_70B = """--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672
--num-attention-heads 64 --group-query-attention --num-query-groups 8 --kv-channels 128
--swiglu --normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 500000
--max-position-embeddings 8192 --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256
--attention-dropout 0.0 --hidden-dropout 0.0
--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 4
--num-layers-per-virtual-pipeline-stage 5 --use-distributed-optimizer --overlap-grad-reduce --recompute-activations
--micro-batch-size 1 --global-batch-size 512 --seq-length 8192 --bf16 --use-flash-attn
"""


def test_megatron_70b_passed_over_line_relates_the_kind_to_the_proposal(tmp_path, capsys):
    """Losing a node leaves 120 GPUs. The proposal pp 2 x dp 4 x tp 8 (64 GPUs) keeps 512; the job's
    kind (pp 4, its axes) is tried first: at dp 3 on 96 GPUs the interleaved schedule needs micro-batches
    a multiple of pp 4, 512 // 3 = 170 -> 168, global batch 168 x 3 = 504; pp 5 x dp 3 on 120 GPUs takes
    170 (a multiple of 5), 510, and plans over 5% more tokens/s. The line printed 'the job's kind pp 4 x dp 3
    ... passed over: pp 5 x dp 3', neither the proposal; now it says the kind was tried first, why it was
    passed over, and why the proposal comes first instead (it keeps the global batch, the other two do not)."""
    import json
    from meshplan.cli import main
    args = tmp_path / "m70.args"
    args.write_text(MEGATRON_70B)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit):
        main(["reliability", str(args), "--cluster", "dgx-h100", "--nodes", "16", "--write-gbps", "100",
              "--read-gbps", "100", "--restart-overhead-s", "600", "--json", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert "mesh pp 4 x dp 4 x tp 8 -> pp 2 x dp 4 x tp 8 (shrunk: pp 4 -> 2; kept: dp 4, tp 8)" in lines[
        next(i for i, x in enumerate(lines) if x.startswith("restart:"))]
    props = {tuple(p["shape"]): p for p in json.loads(out.read_text())["restart"]["proposals"]}
    kind, faster, top = props[(4, 3, 8)], props[(5, 3, 8)], props[(2, 4, 8)]
    assert (kind["contract"], faster["contract"], top["contract"]) == (
        "global_batch 512 -> 504", "global_batch 512 -> 510", "")
    gain = faster["tokens_per_s"] / kind["tokens_per_s"] - 1
    assert gain > 0.05 and top["tokens_per_s"] < kind["tokens_per_s"]
    assert (f"- the job's kind (the job's axes and pp 4, tried first): pp 4 x dp 3 x tp 8 on 96 GPUs, global_batch "
            f"512 -> 504, plans {kind['tokens_per_s']:,.0f} tokens/s; passed over: pp 5 (16 layers per stage) x dp 3 x tp 8 "
            f"on 120 GPUs, "
            f"global_batch 512 -> 510, plans {faster['tokens_per_s']:,.0f} tokens/s, {gain:.1%} more, over the "
            f"5% restart margin; the proposal, pp 2 (40 layers per stage) x dp 4 x tp 8 on 64 GPUs "
            f"({top['tokens_per_s']:,.0f} tokens/s), comes first as the fastest mesh keeping the global batch") in lines
