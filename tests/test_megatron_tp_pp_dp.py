"""nc56's trial: Megatron-LM's ``--use-tp-pp-dp-mapping`` (megatron/training/arguments.py at d98e8a6: "ranks
initialize order is changed from tp-cp-ep-dp-pp to tp-cp-ep-pp-dp"; initialize.py passes that ``order`` to
``initialize_model_parallel``) was listed among the flags meshplan does not use, so the import planned
Megatron-LM's default ranks; and ``export --to megatron`` refused a dp-outside-pp mesh that Megatron-LM
runs with the flag. Ranks by hand from the order string (fastest first):

- default tp-cp-ep-dp-pp, tp 2, dp 4, pp 2: rank = tp + 2 dp + 8 pp -> rank 0's pp group {0, 8} (two
  nodes of 8 GPUs: the stage-to-stage send crosses the network), its dp group {0, 2, 4, 6};
- tp-cp-ep-pp-dp: rank = tp + 2 pp + 4 dp -> pp group {0, 2} (one node: NVLink), dp group {0, 4, 8, 12}.
"""

from __future__ import annotations

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import write
from meshplan.interop.megatron_mesh import TP_PP_DP, mesh_table
from meshplan.plan import build_plan
from tests.conftest import EXAMPLES

ARGS = (EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text()
H100x2 = ImportOptions(cluster="dgx-h100", nodes=2)


def _load(tmp_path, extra: str = ""):
    f = tmp_path / "job.args"
    f.write_text(ARGS + extra + "\n")
    return load_any(f, "megatron", H100x2)


@pytest.mark.parametrize("mapped, names, pp0, dp0, path", [
    (False, ["pp", "dp", "tp"], [0, 8], [0, 2, 4, 6], "network"),
    (True, ["dp", "pp", "tp"], [0, 2], [0, 4, 8, 12], "nvlink")])
def test_import_plans_megatron_lms_ranks(tmp_path, mapped, names, pp0, dp0, path):
    cfg = _load(tmp_path, f" {TP_PP_DP}" if mapped else "")
    assert list(cfg.mesh.names) == names and not any(TP_PP_DP in n for n in cfg.notes)
    plan = build_plan(cfg)
    assert plan.mesh.group_of(0, "pp") == pp0 and plan.mesh.group_of(0, "dp") == dp0
    assert {r.path.kind for r in plan.collectives["stage 0"] if r.axis == "pp"} == {path}


def test_export_writes_the_flag_only_for_dp_outside_pp(tmp_path):
    assert TP_PP_DP in write(_load(tmp_path, f" {TP_PP_DP}"))
    assert TP_PP_DP not in write(_load(tmp_path))


def test_expert_parallelism_with_the_flag_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        mesh_table({TP_PP_DP: True}, {"tp": 2, "pp": 2, "cp": 1, "ep": 2, "etp": 1}, 4, "zero1")
    assert err.value.field == TP_PP_DP
