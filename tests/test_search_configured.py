"""``meshplan search`` says where the config's own [mesh] ranks (issue 11 follow-up): the
candidate that is the same run, planned by the search's exact model, or why none is."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.candidate import candidate_config
from meshplan.search.driver import search
from meshplan.search.reasons import UNDECIDED
from tests.cli_run import run_main
from tests.conftest import without_torch_ring

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _cfg(name: str, training: dict | None = None, narrow: dict | None = None):
    cfg = load_config(EXAMPLES / name)
    return replace(cfg, training=cfg.training.model_copy(update=training or {}),
                   search=cfg.search.model_copy(update=narrow or {}))


#: Every recompute policy listed (under torch the default leaves Megatron's selective out,
#: searchtie), so the space is the one these findings were made on.
ALL_RECOMPUTE = {"recompute": ["none", "selective", "full", "op"]}


@pytest.fixture(scope="module")
def mini():
    """The 8-GPU example (llama3-8b, dp_shard 4 x tp 2, mb 1, recompute none, zero3), searched whole,
    top 3 (the rows are distinct meshes, so a top 10 plans far enough to rank the mesh exactly), without
    torch's CP ring merges (:func:`tests.conftest.without_torch_ring`: the rank cases below were found
    before they were counted; with them 34 cp meshes fall behind the mesh)."""
    with pytest.MonkeyPatch.context() as patch:
        without_torch_ring(patch)
        return search(_cfg("mini_2x4_tp2-dp4.toml", narrow=ALL_RECOMPUTE | {"top": 3}), workers=1)


def test_configured_step_is_the_plan_and_step_commands_own(mini):
    """Its step is what ``meshplan step`` predicts for the config (build_plan + step_time with the
    default Overlap), to the bit: the search's exact model, not an estimate."""
    cfg = _cfg("mini_2x4_tp2-dp4.toml")
    st = step_time(build_plan(cfg), Overlap())
    mine = mini.configured
    assert mine.status == "ranked"
    assert mine.step_s == st.step_s and mine.tokens_per_s == st.tokens_per_s
    row = candidate_config(mini.config, mini.candidates, mine.index)
    assert (row.mesh.names, row.mesh.shape, row.training.micro_batch, row.training.recompute) == \
        (["dp_shard", "tp"], [4, 2], 1, "none")


@pytest.fixture(scope="module")
def mini_top45(mini):
    """The same search with ``--top 45``: the ranking plans more, so more candidates near the
    memory limit are decided."""
    cfg = mini.config
    with pytest.MonkeyPatch.context() as patch:
        without_torch_ring(patch)
        return search(replace(cfg, search=cfg.search.model_copy(update={"top": 45})), workers=1)


def test_configured_rank_counts_the_faster_feasible(mini):
    """Rank #40-#45 of the 716 feasible (a real run, top 3): the eager DTensor TP host's pace
    (kernels.toml [host]) adds 43 ms to its step (7.381 -> 7.424 s); 37 unplanned candidates have
    a step-time lower bound below it, of which :data:`RANK_MAX` (32) are planned and 5 are left
    as the range; it is slower than the top's last row (7.026 s), so no row. 209 candidates near
    the memory limit are undecided (settle_max 32), 13 with a lower bound below its step: the
    line says so, the rank is among the decided. (Top 10 before the rows were distinct meshes:
    #40-#41 of 717, 205 undecided, 9 below; the rows now reach further, so top 3.)"""
    mine = mini.configured
    assert (mine.rank, mine.rank_hi, mine.feasible) == (40, 45, mini.counts()["feasible"]) == (40, 45, 716)
    faster = [e for i, e in mini.exact.items() if mini.code[i] == -1 and e.step_s is not None and e.step_s < mine.step_s]
    assert 0 < len(faster) <= 39 and mine.step_s > mini.top[-1].step_s and mine.row is None
    undecided = np.flatnonzero(mini.code == UNDECIDED)
    below = int((mini.est.step_lo[undecided] < mine.step_s).sum())
    assert (mine.undecided, mine.undecided_below) == (len(undecided), below) == (209, 13)
    # 7.424 s against the top's 6.998 s (dp_shard 8): 7.424 / 6.998 - 1 = 6.09%
    assert round(mini.top[0].step_s, 3) == 6.998
    assert mine.line() == ("your mesh (dp_shard 4 x tp 2): 7.424 s, 70,617 tokens/s, rank #40-#45 of 716 feasible by "
                           "step time, 209 undecided near the memory limit not ranked (6.09% longer than the top's; "
                           "5 feasible candidates with a step-time lower bound below its step left unplanned: 32 are "
                           "planned for the rank; 13 of the undecided have a step-time lower bound below its step and "
                           "could rank ahead if planned: [search] settle_max plans more)")


def test_configured_in_the_top_is_ranked_by_step_not_by_row(no_torch_ring):
    """The mini example kept gathered (training.reshard_after_forward false) is row #9 of the top
    table, its mesh's first setting by the tie rule (rows are distinct meshes), but 27 feasible
    candidates have a shorter exact step (a real run): 8 rows of the table and other settings of
    their meshes: rank #28, row 9 beside it. 736 feasible, 174 undecided, none with a lower bound
    below its step. At the default reshard its mesh's row is named instead. Without torch's CP ring
    merges (:func:`tests.conftest.without_torch_ring`), as the case was found."""
    r = search(_cfg("mini_2x4_tp2-dp4.toml", training={"reshard_after_forward": False}, narrow=ALL_RECOMPUTE),
               workers=1)
    mine = r.configured
    assert mine.row == 9 and r.top[8].index == mine.index
    assert sum(e.step_s < mine.step_s for e in r.top) == 8
    faster = [i for i, e in r.exact.items() if r.code[i] == -1 and e.step_s is not None and e.step_s < mine.step_s]
    assert len(faster) == 27 and (mine.rank, mine.rank_hi) == (28, 28)
    assert (mine.feasible, mine.undecided, mine.undecided_below) == (736, 174, 0) == \
        (r.counts()["feasible"], r.counts()["undecided"], 0)
    assert mine.line() == ("your mesh (dp_shard 4 x tp 2): 7.297 s, 71,846 tokens/s, rank #28 of 736 feasible by "
                           "step time, 174 undecided near the memory limit not ranked (row #9 in the top table, whose "
                           "tie rule orders meshes within 1% toward fewer axes, lower degrees and fewer settings; "
                           "4.27% longer than the top's; no undecided candidate could rank ahead: their step-time "
                           "lower bounds are not below its step)")
    resharded = search(_cfg("mini_2x4_tp2-dp4.toml", narrow=ALL_RECOMPUTE), workers=1).configured
    assert resharded.row is None and "its mesh is row #9 in the top table, at other settings (one row per " \
        "distinct mesh)" in resharded.line()


def test_configured_range_bounds_the_rank_among_the_decided(mini, mini_top45):
    """The top-3 run's #40-#45 holds for its own 716 feasible: the --top 45 run planned every one
    of them with a lower bound below the step; 39 are faster (#40). Of its 13 undecided with a
    lower bound below, that run found 4 feasible and faster: 40 + 4 = the #44 it gives."""
    step = mini.configured.step_s
    known = {j: e.step_s for ex in (mini.exact, mini_top45.exact) for j, e in ex.items() if e.step_s is not None}
    feasible = np.flatnonzero(mini.code == -1)
    assert not [j for j in feasible if j not in known and mini.est.step_lo[j] < step]
    assert 1 + sum(known.get(j, np.inf) < step for j in feasible) == 40
    undecided = np.flatnonzero(mini.code == UNDECIDED)
    below = undecided[mini.est.step_lo[undecided] < step]
    assert sum(mini_top45.code[j] == -1 and known.get(j, np.inf) < step for j in below) == 4
    assert (mini_top45.configured.rank, mini_top45.configured.rank_hi) == (44, 44)


def test_mesh_in_another_axis_order_is_not_a_candidate():
    """tp outermost (tp across the ranks' slowest stride) is not the searched order."""
    cfg = _cfg("mini_2x4_tp4-across-nodes.toml", narrow={"tp": [4], "pp": [1], "cp": [1], "micro_batch": [1]})
    r = search(cfg, workers=1)
    assert r.configured.status == "absent"
    # newcomer trial 16 #4: planned as given (the search's model: build_plan + step_time), not searched
    step = step_time(build_plan(cfg), Overlap()).step_s
    assert r.configured.line() == ("your mesh (tp 4 x dp_shard 2) is not among the candidates: axis order (tp, "
                                   "dp_shard): the search orders (pp, dp_replicate, dp_shard, cp, tp), tp innermost; "
                                   f"planned as given (not searched): {step:.3f} s, {r.configured.tokens_per_s:,.0f} "
                                   "tokens/s, would rank #3 of 6 feasible by step time")


def test_mesh_outside_the_search_table_names_the_field():
    """[search] micro_batch 2 leaves out the config's micro-batch 1."""
    r = search(_cfg("mini_2x4_tp2-dp4.toml", narrow={"tp": [2], "pp": [1], "cp": [1], "micro_batch": [2]}), workers=1)
    assert r.configured.status == "absent"
    assert r.configured.reason == ("micro_batch 1 is not searched (searched with the rest of the mesh: 2; widen "
                                   "[search] micro_batch)")


def test_mesh_a_rule_rejects_is_infeasible_with_the_rule():
    """zero1 under framework torch: the search's rule 'framework' (plan only warns)."""
    r = search(_cfg("mini_2x4_tp2-dp4.toml", training={"sharding": "zero1"},
                    narrow={"tp": [2], "pp": [1], "cp": [1], "micro_batch": [1], "recompute": ["none"]}), workers=1)
    assert r.configured.status == "infeasible"
    assert r.configured.line().startswith("your mesh (dp_shard 4 x tp 2): infeasible: rule 'framework': zero1 under "
                                          "framework torch")


def test_mesh_over_memory_is_infeasible_with_the_plans_reason():
    """micro_batch 8, recompute none: the planned peak's own reason, as ``plan`` prints it."""
    cfg = _cfg("mini_2x4_tp2-dp4.toml", training={"micro_batch": 8},
               narrow={"tp": [2], "pp": [1], "cp": [1], "micro_batch": [8], "recompute": ["none"]})
    r = search(cfg, workers=1)
    p = build_plan(cfg)
    assert not p.feasible and r.configured.status == "infeasible"
    assert r.configured.reason == "; ".join(p.reasons)


def test_json_holds_configured(tmp_path, capsys):
    """``--json`` holds the same fields as ``configured``; none without a [mesh]."""
    out = tmp_path / "s.json"
    toml = tmp_path / "c.toml"
    text = (EXAMPLES / "mini_2x4_tp2-dp4.toml").read_text()
    toml.write_text(text + "\n[search]\ntp = [2]\npp = [1]\ncp = [1]\nmicro_batch = [1]\n")
    assert run_main("search", toml, "--json", out) == 0
    doc = json.loads(out.read_text())
    assert list(jsonschema.Draft202012Validator(schema_of("search")).iter_errors(doc)) == []
    d = doc["configured"]
    assert (d["mesh"], d["status"], d["rank"], d["rank_hi"]) == ("dp_shard 4 x tp 2", "ranked", d["rank"], d["rank"])
    assert f"your mesh (dp_shard 4 x tp 2): {d['step_s']:.3f} s" in capsys.readouterr().out
    toml.write_text(text.split("[mesh]")[0] + "[search]\ntp = [2]\npp = [1]\ncp = [1]\nmicro_batch = [1]\n")
    assert run_main("search", toml, "--json", out, "--force") == 0
    assert "configured" not in json.loads(out.read_text())


def test_mesh_with_a_schedule_the_search_does_not_run_is_not_a_candidate():
    """pp 2 under GPipe: the search runs pp 2 with 1F1B, another run."""
    cfg = _cfg("mini_2x4_tp2-dp4.toml", narrow={"tp": [2], "pp": [2], "cp": [1], "micro_batch": [1],
                                               "recompute": ["none"]})
    mesh = cfg.mesh.model_copy(update={"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 2], "pp_schedule": "gpipe"})
    r = search(replace(cfg, mesh=mesh), workers=1)
    as_given = build_plan(replace(cfg, mesh=mesh))  # newcomer trial 16 #4: planned as given, here over memory
    assert not as_given.feasible and as_given.reasons[0].startswith("peak 406.0 GiB at forward of the head")
    assert r.configured.line() == ("your mesh (pp 2 x dp_shard 2 x tp 2) is not among the candidates: mesh.pp_schedule "
                                   "gpipe: the search runs this mesh with 1f1b; as given: infeasible: "
                                   + "; ".join(as_given.reasons))


def test_op_recompute_outside_its_searched_meshes_names_the_limit():
    """Newcomer trial 15: a 70B job at dp_shard 32 x tp 8 with recompute "op", [search] recompute
    ["op", "selective"], read "recompute op is not searched (searched with the rest of the mesh:
    selective; widen [search] recompute)", though op was listed: the search plans op only at
    tp = cp = ep = 1 without MLA (search.space.op_recompute_ok), which this mesh (tp 8) is not.
    Where op is not listed, the line still says to widen [search] recompute."""
    from meshplan.search.configured import find
    from meshplan.search.space import enumerate_candidates
    cfg = _cfg("llama3-70b_256xh100_dp32-tp8.toml", training={"recompute": "op"},
               narrow={"recompute": ["op", "selective"], "tp": [8], "pp": [1], "cp": [1]})
    assert find(cfg, cfg.mesh, enumerate_candidates(cfg)) == (
        "recompute op is searched only at tp = cp = ep = 1 without multi-head latent attention (its step-time "
        "bound does not hold otherwise); this mesh has tp 8")
    cfg = replace(cfg, search=cfg.search.model_copy(update={"recompute": ["selective"]}))
    assert find(cfg, cfg.mesh, enumerate_candidates(cfg)) == (
        "recompute op is not searched (searched with the rest of the mesh: selective; widen [search] recompute)")
