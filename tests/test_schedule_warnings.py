"""ZB-V and DualPipeV with FSDP2 over a data axis and reshard_after_forward true under framework torch:
torch 2.13 computes no weight gradient for a layer unit resharded after its forward where the schedule
splits its backward (measured by tests/test_zbv_fsdp_torch.py and ``meshplan validate``, which refuses
the mesh). plan, step and compare print the same one-line warning with its fix (one source:
:meth:`meshplan.pipeline.vshape.VShaped.warnings` through :func:`meshplan.plan_runtime.runtime_warnings`),
export writes it in its header; the same meshes with reshard_after_forward false, a mesh without FSDP2
over a data axis and one without pp get none. No recompute here: torch's split backward with
activation checkpointing has its own warning (tests/test_split_backward_ac.py)."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.pipeline.vshape import RESHARD_DEFECT
from meshplan.plan import build_plan
from meshplan.plan_runtime import config_warnings
from meshplan.runtime.execution.pipelined import unsupported

MODEL = {"catalog": "llama3-8b"}


def tables(schedule="zbv", sharding="zero3", shape=(2, 2, 2), **training):
    """The V meshes' tables, reshard_after_forward written true (unset it is false under pp, torchtitan's
    default, which has no warning)."""
    return {"model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "sharding": sharding,
                         "recompute": "none", "reshard_after_forward": True, **training},
            "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": list(shape), "virtual_stages": 2,
                     "pp_schedule": schedule, "sequence_parallel": True}}


def warning(schedule: str) -> str:
    return (f"{schedule} with FSDP2 over a data axis and reshard_after_forward true under framework torch: "
            f"{RESHARD_DEFECT}; meshplan validate refuses this mesh; fix: training.reshard_after_forward = false "
            "(torchtitan's default under pp)")


WARNING = warning("zbv")


def toml(path, t) -> str:
    """``t`` as a meshplan TOML at ``path`` (flat tables of strings, ints and lists)."""
    def value(x):
        return f'"{x}"' if isinstance(x, str) else "[" + ", ".join(value(i) for i in x) + "]" \
            if isinstance(x, list) else str(x).lower() if isinstance(x, bool) else str(x)
    path.write_text("".join(f"[{k}]\n" + "".join(f"{kk} = {value(vv)}\n" for kk, vv in v.items()) + "\n"
                            for k, v in t.items()))
    return str(path)


def cli_out(main, capsys, *argv) -> str:
    """What ``meshplan *argv`` printed (stdout and stderr, :func:`flat`); it must exit 0."""
    with pytest.raises(SystemExit) as done:
        main(list(argv))
    got = capsys.readouterr()
    assert done.value.code in (0, None), got.err
    return flat(got.out + got.err)


def flat(s: str) -> str:
    return " ".join(s.split())


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_the_warning_is_the_v_modules_and_validates_refusal_quotes_it(schedule):
    cfg = config_from_dict(tables(schedule))
    assert config_warnings(cfg) == (warning(schedule),)
    plan = build_plan(cfg)
    assert warning(schedule) in plan.notes
    assert unsupported(plan.mesh, cfg.training, schedule, cfg.model) == (
        f"{schedule} with FSDP2 over a data axis and reshard_after_forward true: {RESHARD_DEFECT}; "
        "fix: training.reshard_after_forward = false (torchtitan's default under pp)")
    kept = config_from_dict(tables(schedule, reshard_after_forward=False))
    assert unsupported(build_plan(kept).mesh, kept.training, schedule, kept.model) is None


@pytest.mark.parametrize("t", [tables(reshard_after_forward=False), tables("dualpipev", reshard_after_forward=False),
                               tables(sharding="zero1", zero12_engine="deepspeed"), tables(shape=(2, 1, 4)),
                               tables(shape=(1, 4, 2)), tables("1f1b", shape=(2, 4, 1))])
def test_no_warning_without_the_defect(t):
    """Parameters kept gathered after forward (torchtitan's default under pp); zero1 is no FSDP2;
    dp_shard 1 shards over no data axis; pp 1 runs no schedule; interleaved 1F1B runs full backwards."""
    assert config_warnings(config_from_dict(t)) == ()


def test_plan_step_compare_and_export_print_it(tmp_path, capsys):
    from meshplan.cli import main

    zbv, kept = toml(tmp_path / "zbv.toml", tables()), toml(tmp_path / "kept.toml", tables(reshard_after_forward=False))

    def out(*argv) -> str:
        return cli_out(main, capsys, *argv)

    assert f"note {WARNING}" in out("plan", zbv)
    assert f"note: {WARNING}" in out("step", zbv)
    assert "reshard_after_forward true under framework torch" not in out("plan", kept)
    both = out("compare", zbv, kept, "--out", str(tmp_path / "cmp"))
    assert f"warning (zbv): {WARNING}" in both and "warning (kept)" not in both
    assert f"warning: {WARNING}" in out("export", zbv, "--to", "torchtitan", "-o", str(tmp_path / "job.toml"))
    assert f"# warning: {WARNING}\n" in (tmp_path / "job.toml").read_text()


def test_memory_fix_does_not_propose_the_defect():
    """A plan's ``fix:`` variants (meshplan.plan_fix) offer reshard_after_forward true to a mesh kept
    gathered under 1F1B, never under ZB-V or DualPipeV with FSDP2 over a data axis, where it would
    bring this warning (pp 2 x dp_shard 4, tp 1; recompute full, tp x2 and pp x2 stay)."""
    from meshplan.plan_fix import _variants

    def words(schedule: str, v: int) -> list[str]:
        t = tables(schedule, shape=(2, 4, 1), reshard_after_forward=False)
        t["mesh"]["virtual_stages"] = v
        return [w for w, _ in _variants(build_plan(config_from_dict(t)))]

    rest = ["recompute full", "tp x2 (pp 2 x dp_shard 2 x tp 2)", "pp x2 (pp 4 x dp_shard 2)"]
    assert words("1f1b", 1) == rest[:1] + ["reshard_after_forward true"] + rest[1:]
    assert words("zbv", 2) == words("dualpipev", 2) == rest
