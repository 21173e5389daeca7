"""zero1 over a data axis under framework torch without DeepSpeed's engine: no torch engine runs
meshplan's zero1 (Megatron-LM's distributed optimizer), the search rejects it (rule 'framework'),
and plan, step, compare and export warn with the fix (one source:
:data:`meshplan.plan_runtime.ZERO1_WITHOUT_ENGINE` through :func:`meshplan.plan_runtime.runtime_warnings`)."""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.plan_runtime import ZERO1_WITHOUT_ENGINE, config_warnings
from meshplan.search.space import zero1_refused
from tests.test_schedule_warnings import cli_out, toml


def tables(shape=(8, 2), sharding="zero1", **training):
    """A newcomer's config: llama3-8b on 2 DGX H100 nodes, dp_shard 8 x tp 2 with SP."""
    return {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": sharding,
                         "recompute": "selective", **training},
            "mesh": {"names": ["dp_shard", "tp"], "shape": list(shape), "sequence_parallel": True}}


def test_warned_where_the_search_rejects_it():
    cfg = config_from_dict(tables())
    assert zero1_refused(cfg.training)  # the search's rule 'framework' rejects this row
    assert config_warnings(cfg) == (ZERO1_WITHOUT_ENGINE,)
    plan = build_plan(cfg)
    assert plan.feasible and ZERO1_WITHOUT_ENGINE in plan.notes  # still planned: a warning, not a refusal
    for fix in ("sharding zero3 with reshard_after_forward = false", 'framework = "megatron"',
                'zero12_engine = "deepspeed"'):
        assert fix in ZERO1_WITHOUT_ENGINE


@pytest.mark.parametrize("t", [tables(framework="megatron"), tables(zero12_engine="deepspeed"),
                               tables(sharding="zero3"), tables(shape=(1, 16))])
def test_no_warning_where_an_engine_runs_it(t):
    """Megatron-LM's distributed optimizer; DeepSpeed's ZeRO-1; FSDP2; no data axis (dp_shard 1:
    zero1 shards nothing, every engine runs it as plain data parallelism of one rank)."""
    cfg = config_from_dict(t)
    assert ZERO1_WITHOUT_ENGINE not in config_warnings(cfg)


def test_plan_step_compare_and_export_print_it(tmp_path, capsys):
    from meshplan.cli import main

    z1 = toml(tmp_path / "z1.toml", tables())
    z3 = toml(tmp_path / "z3.toml", tables(sharding="zero3"))

    def out(*argv) -> str:
        return cli_out(main, capsys, *argv)

    assert f"note {ZERO1_WITHOUT_ENGINE}" in out("plan", z1)
    assert f"note: {ZERO1_WITHOUT_ENGINE}" in out("step", z1)
    assert ZERO1_WITHOUT_ENGINE not in out("plan", z3)
    both = out("compare", z1, z3, "--out", str(tmp_path / "cmp"))
    assert f"warning (z1): {ZERO1_WITHOUT_ENGINE}" in both and "warning (z3)" not in both
    assert f"warning: {ZERO1_WITHOUT_ENGINE}" in out("export", z1, "--to", "megatron", "-o", str(tmp_path / "job.sh"))
