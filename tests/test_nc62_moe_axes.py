"""Newcomer trial nc62 #2: an MoE plan's axes. :func:`meshplan.memory.constraints.estimate` has no
expert activations, so an MoE model has no first estimate; an axis the batch allows dropping was
still said to solve "no stated constraint (memory fits and the batch allows it without it)", which
the DeepSeek-V3 example's pp 16 contradicted (its capacity row: pp 1 does not fit). Without an
estimate the line now says that it does not know and points at the capacity row."""

from __future__ import annotations

from pathlib import Path

from meshplan.config import load_config
from meshplan.memory.constraints import MOE_UNKNOWN
from meshplan.plan import build_plan

MIXTRAL = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"


def test_moe_axes_claim_no_memory_verdict_without_an_estimate(tmp_path):
    """Mixtral-8x7B on 32 H100s as pp 2 x dp_shard 16 (ep 8 re-factoring dp_shard), zero1, global
    batch 256, micro-batch 1: the batch needs tp*pp*cp >= ceil(32 x 1 / 256) = 1, so pp 2 is not
    forced by the batch (without it tp*pp*cp = 1 >= 1); memory has no first estimate for an MoE
    model, so neither pp nor dp_shard may claim that memory fits without them."""
    text = MIXTRAL.read_text().replace('names = ["dp_shard", "ep"]', 'names = ["pp", "dp_shard", "ep"]')
    text = text.replace("shape = [32, 8]", "shape = [2, 16, 8]").replace('sharding = "zero3"', 'sharding = "zero1"')
    path = tmp_path / "mixtral_pp2.toml"
    path.write_text(text)
    plan = build_plan(load_config(path))
    axes = plan.constraints.axes
    assert axes["pp"] == MOE_UNKNOWN
    assert "memory fits" not in axes["pp"] and "capacity row" in axes["pp"]
    assert "pp" not in plan.constraints.unforced  # not known to solve nothing
    assert axes["dp_shard"] == ("throughput: 16 batch shards (memory: no first estimate for an MoE model, "
                                "see the capacity row)")


def _mixtral(tmp_path, nodes: int, names: list[str], shape: list[int]):
    text = MIXTRAL.read_text().replace("nodes = 4", f"nodes = {nodes}").replace('sharding = "zero3"', 'sharding = "zero1"')
    text = text.replace('names = ["dp_shard", "ep"]', f"names = {names}".replace("'", '"'))
    path = tmp_path / f"mixtral_{nodes}_{'x'.join(map(str, shape))}.toml"
    path.write_text(text.replace("shape = [32, 8]", f"shape = {shape}"))
    return build_plan(load_config(path))


def test_plan_answers_the_moe_pp_line_from_the_capacity_row(tmp_path):
    """The plan command's plan (:func:`meshplan.plan_capacity.checked`) answers the open pp line from
    the capacity row's smallest split. Mixtral-8x7B, zero1, 16 H100s (2 nodes), pp 2 x dp_shard 8:
    without pp the mesh is tp 1 x pp 1 (dp_shard 16), which the timeline does not fit (built below,
    infeasible), and the smallest split that fits is tp 2 x pp 1 (tp*pp 2, tp largest first); so pp
    is needed for memory. On 32 H100s (pp 2 x dp_shard 16) tp 1 x pp 1 (dp_shard 32) fits (built
    below), the smallest split itself: pp solves no stated constraint."""
    from meshplan.plan_capacity import checked, smallest_split

    plan = _mixtral(tmp_path, 2, ["pp", "dp_shard", "ep"], [2, 8, 8])
    assert not _mixtral(tmp_path, 2, ["dp_shard", "ep"], [16, 8]).feasible  # pp 1 at tp 1 does not fit
    assert smallest_split(plan)[:2] == (2, 1)
    done = checked(plan).constraints
    assert done.axes["pp"] == ("capacity: without it tp 1 x pp 1 does not fit (memory timeline; the smallest split "
                               "that fits is tp 2 x pp 1, the capacity row)")
    assert "pp" not in done.unforced

    plan = _mixtral(tmp_path, 4, ["pp", "dp_shard", "ep"], [2, 16, 8])
    assert _mixtral(tmp_path, 4, ["dp_shard", "ep"], [32, 8]).feasible  # pp 1 at tp 1 fits
    done = checked(plan).constraints
    assert done.axes["pp"] == ("solves no stated constraint (without it tp 1 x pp 1 fits, the capacity row's smallest "
                               "split, and the batch allows it)")
    assert done.unforced == ("pp",)
