"""Every shipped example plans, and none prints a warning about itself: a runtime warning
(:func:`meshplan.plan_runtime.config_warnings`, printed as a note by ``plan`` and ``step``: e.g.
sharding zero1 under framework torch, which no torch engine runs) or a ``warning:`` line. An
example that demonstrates a warning is listed in :data:`DEMONSTRATES` with the warning's first
words (none today). Foreign configs get the cluster their header names."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from meshplan.cli import app
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.plan_runtime import config_warnings
from tests.conftest import EXAMPLES
from tests.configs import TP4_MB2

#: Import options of the foreign examples, as each file's header says to plan it.
FOREIGN = {"torchtitan_llama3-8b_8xh100.toml": ImportOptions(cluster="dgx-h100", nodes=1),
           "megatron_llama3-8b_16xh100_tp2-pp2.args": ImportOptions(cluster="dgx-h100", nodes=2),
           "deepspeed_zero2_16xh100.json": ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b",
                                                         seq_len=4096)}
#: Examples documented as demonstrating a warning: file name -> the warning's first words.
DEMONSTRATES: dict[str, str] = {}
NAMES = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".toml", ".args", ".json"))


def _args(name: str) -> list[str]:
    o = FOREIGN.get(name)
    if o is None:
        return []
    extra = ["--model", o.model, "--seq-len", str(o.seq_len)] if o.model else []
    return ["--cluster", str(o.cluster), "--nodes", str(o.nodes)] + extra


def test_the_list_is_the_folder():
    assert len(NAMES) == 14 and set(FOREIGN) <= set(NAMES) and set(DEMONSTRATES) <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_example_plans_without_warning_about_itself(name):
    cfg = load_any(EXAMPLES / name, opts=FOREIGN.get(name, ImportOptions()))
    warnings = config_warnings(cfg)
    if name in DEMONSTRATES:
        assert [w for w in warnings if w.startswith(DEMONSTRATES[name])], warnings
        return
    assert warnings == ()
    # seed-64gpu-tp4-mb2, the seed's tp-4 alternative at micro-batch 2, does not fit (tests/configs.py
    # TP4_MB2: peak 121.5 GiB > 71.2 GiB usable): exit 1; every other example fits (seed-64gpu-tp4 too)
    fits = build_plan(cfg).feasible
    r = CliRunner().invoke(app, ["plan", str(EXAMPLES / name)] + _args(name), env={"COLUMNS": "400"})
    assert r.exit_code == (0 if fits else 1) and fits == (name != TP4_MB2.name), r.output
    assert not [x for x in r.output.splitlines() if "warning:" in x.lower()], r.output


def test_a_zero1_example_under_torch_would_be_caught():
    """The check can fail: the DeepSeek-V3 example under framework torch (as shipped before)
    has zero1's no-engine warning."""
    cfg = load_any(EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    torch = cfg.training.model_copy(update={"framework": "torch"})
    from dataclasses import replace
    (w,) = config_warnings(replace(cfg, training=torch))
    assert w.startswith("sharding zero1 under framework torch: no torch engine shards the optimizer state alone")
