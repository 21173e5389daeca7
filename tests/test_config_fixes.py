"""Newcomer trial 16 #3: the ``fix:`` of a config the rules refuse names only what the same
validation accepts, and another tool's name for a sharding value is named in the error's one line.
Mixtral-8x7B (8 experts of width 14336, hidden 4096) as examples/mixtral-8x7b_32xh100_ep8-dp32.toml
holds it, on 4 dgx-h100 nodes (32 GPUs) unless said."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.mesh.resolve import world_error
from meshplan.plan import Plan, build_plan
from tests.cli_run import run_main

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixtral-8x7b_32xh100_ep8-dp32.toml"


def _config(tmp_path, name: str, **edits: str) -> Path:
    """The example with each ``old=new`` text edit (keys are labels only), written to ``name``."""
    text = EXAMPLE.read_text()
    for old, new in edits.values():
        assert old in text
        text = text.replace(old, new)
    f = tmp_path / name
    f.write_text(text)
    return f


def _last_err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_experts_not_divisible_by_ep_lists_the_ep_degrees_that_divide_them(tmp_path, capsys):
    """experts = 6 at ep 8: 6's divisors above 1 are 2, 3, 6; ep x etp must divide the dense
    block dp_shard 32, which 3 and 6 do not: ep 2 alone, 6 / 2 = 3 experts per ep rank, efsdp
    32 / 2 = 16, the dense mesh unchanged; 3 and 6 named with the rule that refuses them."""
    f = _config(tmp_path, "e6.toml", e=('catalog = "mixtral-8x7b"', 'catalog = "mixtral-8x7b"\nexperts = 6'))
    assert run_main("plan", f) == 1
    infeasible, fix = _last_err(capsys)[-2:]
    assert infeasible == "infeasible: experts 6 are not divisible by ep 8"
    assert fix.startswith("fix: ep must divide the 6 experts: ep 2 (mesh.shape [32, 2]: 3 experts per ep rank, "
                          "efsdp 16; the dense mesh unchanged) (refused: ep 3: ep(3) * etp(1) = 3 does not divide "
                          "dp_shard(32) = 32; ")
    assert "; ep 6: ep(6) * etp(1) = 6 does not divide dp_shard(32) = 32" in fix
    cfg = load_config(f)
    fixed = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [32, 2]})), memory=False)
    assert isinstance(fixed, Plan) and fixed.reasons == ()


def test_on_48_gpus_ep_3_and_6_and_ep_2_is_refused_by_the_dim_1_rule(tmp_path, capsys):
    """6 nodes (dp_shard 48, global batch 240): ep 3 (efsdp 16) and ep 6 (efsdp 8) fit the block;
    both shard the experts on dim 1 (efsdp x ep = 48 > 6), where 14336 and 4096 divide by 16 and
    8. ep 2 (efsdp 24) does too, but 4096 is not divisible by 24: refused with that rule."""
    f = _config(tmp_path, "e6-48.toml", e=('catalog = "mixtral-8x7b"', 'catalog = "mixtral-8x7b"\nexperts = 6'),
                n=("nodes = 4", "nodes = 6"), s=("[32, 8]", "[48, 8]"), b=("global_batch = 256", "global_batch = 240"))
    assert run_main("step", f) == 1
    fix = _last_err(capsys)[-1]
    assert fix.startswith("fix: ep must divide the 6 experts: ep 3 (mesh.shape [48, 3]: 2 experts per ep rank, efsdp "
                          "16; the dense mesh unchanged); or ep 6 (mesh.shape [48, 6]: 1 expert per ep rank, efsdp 8; "
                          "the dense mesh unchanged) (refused: ep 2: routed experts sharded on dim 1 (efsdp 24 x ep 2 > "
                          "experts 6")


def test_world_fix_is_checked_by_the_plans_rules(tmp_path, capsys):
    """shape [21, 3] on 32 GPUs: rescaling dp_shard gives [32, 3], which the rules refuse (ep 3
    does not divide the block of 32, nor the 8 experts); the nearest ep dividing 32 are 2 and 4,
    the larger first: [32, 4] (4 divides 8), which plans without a reason. mesh.world = 21
    (ep 3 with 8 experts) is refused and not offered. Without the check the fix was [32, 3]."""
    f = _config(tmp_path, "s21.toml", s=("[32, 8]", "[21, 3]"))
    assert run_main("plan", f) == 2
    err = _last_err(capsys)
    assert len(err) == 1 and err[0] == (
        "error: mesh.shape: dp_shard 21 = 21 ranks, but the cluster has 32 GPUs; fix: shape [32, 4] (dp_shard = 32 / 1 "
        "= 32; ep 3 -> 4 (at ep 3: ep(3) * etp(1) = 3 does not divide dp_shard(32) = 32; rule: (dp_shard * cp * tp) % "
        "(ep * etp) == 0); or -1 there to infer it)")
    cfg = load_config(f)
    unchecked = str(world_error(cfg.mesh, 32, 8))
    assert "fix: shape [32, 3]" in unchecked and "or mesh.world = 21" in unchecked
    fixed = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [32, 4]})), memory=False)
    assert isinstance(fixed, Plan) and fixed.reasons == ()


def test_world_fix_prints_the_shape_in_the_users_own_entries(tmp_path, capsys):
    """names [dp_shard, tp], shape [21, 2] on 32 GPUs (framework torch, ep 1): the reader appends
    etp = tp = 2 (torchtitan's ep 1 default), but the fix names the user's two entries: dp_shard =
    32 / tp 2 = 16, ``shape [16, 2]`` (it printed the filled-in [16, 2, 2]); compare's infeasible
    line (the resolver's reason) likewise. A user who wrote etp ([21, 2, 2]) is told [16, 2, 2].
    Megatron-LM at ep 8 ([21, 2, 8], etp filled in as tp): [16, 2, 8], not [16, 2, 8, 2]."""
    two = _config(tmp_path, "t2.toml", n=('["dp_shard", "ep"]', '["dp_shard", "tp"]'), s=("[32, 8]", "[21, 2]"))
    fix = "fix: shape {} (dp_shard = 32 / tp 2 = 16; or -1 there to infer it)"
    assert run_main("plan", two) == 2
    assert _last_err(capsys)[-1:] == ["error: mesh.shape: dp_shard 21 x tp 2 = 42 ranks, but the cluster has 32 GPUs; "
                                 + fix.format("[16, 2]")]
    assert load_config(two).filled_axes == ("etp",)
    assert build_plan(load_config(two)).reasons == (
        "dp_shard(21) * tp(2) = 42 != world(32); " + fix.format("[16, 2]"),)
    three = _config(tmp_path, "t3.toml", n=('["dp_shard", "ep"]', '["dp_shard", "tp", "etp"]'),
                    s=("[32, 8]", "[21, 2, 2]"))
    assert run_main("plan", three) == 2
    assert _last_err(capsys)[-1].endswith(fix.format("[16, 2, 2]")) and load_config(three).filled_axes == ()
    mega = _config(tmp_path, "m.toml", n=('["dp_shard", "ep"]', '["dp_shard", "tp", "ep"]'),
                   s=("shape = [32, 8]", "shape = [21, 2, 8]\nsequence_parallel = true"),
                   f=("[training]", '[training]\nframework = "megatron"'))
    assert run_main("plan", mega) == 2
    assert _last_err(capsys)[-1].endswith(fix.format("[16, 2, 8]"))


def test_other_tools_sharding_names_say_meshplans_value(tmp_path, capsys):
    """``sharding = "fsdp"`` (and FSDP1's SHARD_GRAD_OP) is one line naming meshplan's value."""
    f = _config(tmp_path, "fsdp.toml", s=('sharding = "zero3"', 'sharding = "fsdp"'))
    assert run_main("plan", f) == 2
    err = _last_err(capsys)
    assert len(err) == 1 and err[0] == (
        'error: training.sharding: "fsdp" is "zero3" here (FSDP2 fully_shard: parameters, gradients and optimizer '
        'state sharded over the data axis): set sharding = "zero3" (the values: \'none\', \'zero1\', \'zero2\', '
        '\'zero3\' or \'hsdp\')')
    f = _config(tmp_path, "sgo.toml", s=('sharding = "zero3"', 'sharding = "SHARD_GRAD_OP"'))
    assert run_main("plan", f) == 2
    assert 'set sharding = "zero3" with reshard_after_forward = false' in _last_err(capsys)[0]
    f = _config(tmp_path, "typo.toml", s=('sharding = "zero3"', 'sharding = "zero4"'))
    assert run_main("plan", f) == 2
    assert _last_err(capsys)[0] == ("error: training.sharding: \"zero4\" is not one of its values; did you mean "
                                    "'zero3'? (the values, closest first: 'zero3', 'zero1', 'zero2', 'none', 'hsdp')")
