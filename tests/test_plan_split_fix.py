"""The ``fix:`` line of a pipeline whose pp the model's layers do not divide, without a
``mesh.pp_layer_split`` (newcomer trial 17 #2, meshplan.plan_fix_rules.split_fix): the split the
framework sets. tests/data/deepseek-v3_512xh100_megatron.toml (DeepSeek-V3, 61 layers) with a mesh.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import Plan, build_plan
from meshplan.plan_fix_rules import split_fix
from tests.cli_run import run_main

DATA = Path(__file__).parent / "data" / "deepseek-v3_512xh100_megatron.toml"


def _config(tmp_path, shape: list[int], framework: str = "megatron") -> Path:
    """The data config with ``[mesh] names = [pp, dp_shard, ep]`` of ``shape`` under ``framework``."""
    text = DATA.read_text().replace('framework = "megatron"', f'framework = "{framework}"')
    f = tmp_path / f"ds-{framework}-{shape[0]}.toml"
    f.write_text(text + f'\n[mesh]\nnames = ["pp", "dp_shard", "ep"]\nshape = {shape}\n')
    return f


def _fits(f: Path, split: list[int]) -> bool:
    cfg = load_config(f)
    p = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_layer_split": split})), memory=False)
    return isinstance(p, Plan) and p.reasons == ()


def test_megatron_fix_is_its_first_last_flags(tmp_path, capsys):
    """61 layers at pp 16: ceil(61 / 16) = 4 a middle stage, 64 - 61 = 3 short, 1 off the first and 2
    off the last: [3, 4 x 14, 2], the flags 3 and 2; planned with it the mesh passes every rule."""
    f = _config(tmp_path, [16, 32, 8])
    assert run_main("plan", f) == 1
    infeasible, fix = capsys.readouterr().err.strip().splitlines()[-2:]
    assert infeasible.startswith("infeasible: 61 layers do not divide into pp 16 stages")
    split = [3] + [4] * 14 + [2]
    assert fix == (f"fix: 61 layers over pp 16: give mesh.pp_layer_split = {split} (Megatron-LM: "
                   f"--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2)")
    assert _fits(f, split)


def test_torch_fix_is_a_balanced_split(tmp_path, capsys):
    """Under torch the 61 - 48 = 13 layers over 3 a stage go to the first 13 middle stages
    (balanced_split): [3, 4 x 13, 3, 3], which torchtitan takes as module_fqns_per_model_part."""
    f = _config(tmp_path, [16, 32, 8], "torch")
    assert run_main("plan", f) == 1
    fix = capsys.readouterr().err.strip().splitlines()[-1]
    split = [3] + [4] * 13 + [3, 3]
    assert fix == (f"fix: 61 layers over pp 16: give mesh.pp_layer_split = {split} (torchtitan's "
                   f"module_fqns_per_model_part, which export --to torchtitan writes)")
    assert _fits(f, split)


def test_megatron_pp32_has_no_split_to_give(tmp_path, capsys):
    """pp 32: 2 a middle stage leave 61 - 60 = 1 for both ends, 1 leave 31 (first_last_split: none)."""
    f = _config(tmp_path, [32, 16, 8])
    assert run_main("plan", f) == 1
    fix = capsys.readouterr().err.strip().splitlines()[-1]
    assert fix == ("fix: 61 layers over pp 32: no split Megatron-LM sets (--decoder-first/last-pipeline-num-layers "
                   "spread the middle stages evenly and leave an end stage no layer); choose another pp")


def test_no_fix_that_the_rules_refuse_or_where_pp_divides(tmp_path):
    """Each fix is planned before it is printed: under torch with 256 sequences, 256 / dp 32 = 8
    micro-batches, fewer than torch's Schedule1F1B takes at pp 16 (Megatron-LM runs them), the
    split does not make the mesh pass, so no split line; pp 1: none."""
    cfg = load_config(_config(tmp_path, [16, 32, 8], "torch"))
    few = replace(cfg, training=cfg.training.model_copy(update={"global_batch": 256}))
    bad = build_plan(few, memory=False)
    assert not isinstance(bad, Plan) and any("divide into pp 16" in r for r in bad.reasons)
    assert split_fix(bad) is None and split_fix(build_plan(cfg, memory=False)) is not None
    one = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [1, 512, 8]})), memory=False)
    assert split_fix(one) is None


def test_torch_interleaved_without_a_split_names_llama3s_rule(tmp_path):
    """61 layers at pp 16 x vpp 2 under torch: Llama 3's rule wants (61 + 2) / (16 x 2) = 63 / 32
    slots a virtual stage, not whole, so ends_short_split gives none and the line says why (handed
    case C8's re-run: it said "no split gives every chunk a layer", which 61 layers over 32 chunks
    could)."""
    f = _config(tmp_path, [16, 32, 8], "torch")
    cfg = load_config(f)
    cfg = replace(cfg, mesh=cfg.mesh.model_copy(update={"virtual_stages": 2, "pp_schedule": "interleaved_1f1b"}))
    plan = build_plan(cfg, memory=False)
    assert not isinstance(plan, Plan) or plan.reasons
    assert split_fix(plan) == ("fix: 61 layers over pp 16 x vpp 2: no interleaved split the planner takes: Llama 3's "
                               "rule (the embedding and the output layer each a layer's slot) needs layers + 2 a "
                               "multiple of pp x vpp; choose another pp or vpp")
