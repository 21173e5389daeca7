"""ZB-V with FSDP2 over a data axis under framework torch: torch 2.13's ScheduleZBVZeroBubble
reduce-scatters one of pp rank 0's two layer units and never the other (measured by
``meshplan validate``, which refuses the mesh). plan, step and compare print the same warning
(one source: :meth:`meshplan.pipeline.zbv.ZBVZeroBubble.warnings` through
:func:`meshplan.plan_runtime.runtime_warnings`), export writes it in its header; DualPipeV (which
reduces both units), a mesh without FSDP2 over a data axis and one without pp get none. No
recompute here: torch's split backward with activation checkpointing has its own warning
(tests/test_split_backward_ac.py)."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.pipeline.zbv import FSDP2_DEFECT
from meshplan.plan import build_plan
from meshplan.plan_runtime import config_warnings
from meshplan.runtime.execution.pipelined import unsupported

MODEL = {"catalog": "llama3-8b"}


def tables(schedule="zbv", sharding="zero3", shape=(2, 2, 2), **training):
    return {"model": MODEL, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "sharding": sharding,
                         "recompute": "none", **training},
            "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": list(shape), "virtual_stages": 2,
                     "pp_schedule": schedule, "sequence_parallel": True}}


WARNING = (f"zbv with FSDP2 over a data axis under framework torch: {FSDP2_DEFECT}; meshplan validate refuses this "
           "mesh, and the predicted gradients, collectives and step are not what torch runs")


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


def test_the_warning_is_the_zbv_modules_and_validates_refusal_quotes_it():
    cfg = config_from_dict(tables())
    assert config_warnings(cfg) == (WARNING,)
    plan = build_plan(cfg)
    assert WARNING in plan.notes
    assert FSDP2_DEFECT in unsupported(plan.mesh, cfg.training, "zbv", cfg.model)


@pytest.mark.parametrize("t", [tables("dualpipev"), tables(sharding="zero1", zero12_engine="deepspeed"), tables(shape=(2, 1, 4)),
                               tables(shape=(1, 4, 2))])
def test_no_warning_without_the_defect(t):
    """DualPipeV reduces both units; zero1 is no FSDP2; dp_shard 1 shards over no data axis; pp 1
    runs no schedule."""
    assert config_warnings(config_from_dict(t)) == ()


def test_plan_step_compare_and_export_print_it(tmp_path, capsys):
    from meshplan.cli import main

    zbv, dpv = toml(tmp_path / "zbv.toml", tables()), toml(tmp_path / "dpv.toml", tables("dualpipev"))

    def out(*argv) -> str:
        return cli_out(main, capsys, *argv)

    assert f"note {WARNING}" in out("plan", zbv)
    assert f"note: {WARNING}" in out("step", zbv)
    assert WARNING not in out("plan", dpv)
    both = out("compare", zbv, dpv, "--out", str(tmp_path / "cmp"))
    assert f"warning (zbv): {WARNING}" in both and "warning (dpv)" not in both
    assert f"warning: {WARNING}" in out("export", zbv, "--to", "torchtitan", "-o", str(tmp_path / "job.toml"))
    assert f"# warning: {WARNING}\n" in (tmp_path / "job.toml").read_text()
