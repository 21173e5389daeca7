"""torchtitan's op-level selective AC with tp > 1 (sequence parallel): its policy saves the
reduce-scatters' outputs (``_c10d_functional.reduce_scatter_tensor`` is in ``_save_list``) but
not the all-gathers', so the recompute replays each block's all-gather (torchtitan 820504e
``models/llama3/parallelize_llama.py``).

Llama 3 8B at tp 8 x dp_shard 8, one sequence of 8,192 tokens: the SP all-gather is 8,192 x
4,096 x 2 B = 67,108,864 B; two per layer are replayed: 64 more backward all-gathers per step,
each fully exposed under blocking TP.
"""

from __future__ import annotations

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.memory.activations import layer_terms
from meshplan.memory.layer_dims import LayerDims
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time


def _plan(recompute: str, sp: bool = True):
    t = {"global_batch": 8, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3", "recompute": recompute,
         "torch_compile": True}
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 8},
                            "training": t, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 8], "world": 64,
                                                    "sequence_parallel": sp}})
    return build_plan(cfg)


def _tp_rows(p) -> dict:
    return {(r.phase, r.op): r for r in p.stage(0).collectives if r.axis == "tp"}


def test_table_replays_the_all_gathers():
    """Backward all-gathers: selective's plus 2 per layer (32 layers); reduce-scatters unchanged."""
    op, sel = _tp_rows(_plan("op")), _tp_rows(_plan("selective"))
    assert op["forward", "all-gather"].size_bytes == 8192 * 4096 * 2
    assert op["backward", "all-gather"].per_step - sel["backward", "all-gather"].per_step == 64
    assert op["backward", "reduce-scatter"].per_step == sel["backward", "reduce-scatter"].per_step
    assert op["forward", "all-gather"].per_step == sel["forward", "all-gather"].per_step


def test_step_exposes_the_replayed_gathers():
    """Blocking TP: exposed tp grows by 64 all-gathers at the table's per-call time."""
    p_op, p_sel = _plan("op"), _plan("selective")
    ag = _tp_rows(p_op)["forward", "all-gather"].time_s
    grown = step_time(p_op).exposed_s["tp"] - step_time(p_sel).exposed_s["tp"]
    assert grown == pytest.approx(64 * ag, rel=1e-9)


def test_memory_keeps_the_scattered_outputs():
    """With tp 8 under SP: the two reduce-scatter outputs (s/t x h each) are kept beside the
    saved mms; the gathered inputs are not."""
    dims = LayerDims(s=8192, b=1, h=4096, a=32, g=8, d=128, f=14336, gated=True, dropout=False)
    terms = {t.name: t.size_bytes for t in layer_terms(dims, tp=8, sp=True, recompute="op", flash=True)}
    assert terms["wo reduce-scatter output (saved)"] == terms["w_down reduce-scatter output (saved)"] \
        == 2 * 8192 // 8 * 4096
    assert terms["layer input (checkpoint)"] == 2 * 8192 // 8 * 4096
    assert terms["w_gate output (saved mm)"] == 2 * 8192 * 14336 // 8
    assert not any("gathered" in n for n in terms)
    at_tp1 = {t.name for t in layer_terms(dims, tp=1, recompute="op", flash=True)}
    assert not any("reduce-scatter" in n for n in at_tp1)


def test_without_sequence_parallel_is_refused():
    with pytest.raises(ConfigError, match=r"^training.recompute: 'op' .* with tp > 1 is planned with sequence "
                                          r"parallelism"):
        _plan("op", sp=False)


def test_search_note_gives_the_true_reason_for_cp_1():
    """The search plans op at any tp since nc57 #7 (its step-time bound replays op as the timeline does,
    tp all-gathers repeated, closing collectives saved, checked at tp > 1 in tests/test_search_op_sac.py),
    and only at cp = 1, where plan refuses it. With cp 1 in the whole space (8 GPUs, seq 1024, [search] cp
    [1]) there is no note; with cp > 1 rows the note names cp, not tp."""
    from meshplan.search.settings_notes import settings_notes
    from meshplan.search.space import RECOMPUTE, enumerate_candidates

    base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
            "training": {"global_batch": 8, "seq_len": 1024}}
    cfg = config_from_dict(base | {"search": {"recompute": ["full", "op"], "cp": [1]}}, require_mesh=False)
    c = enumerate_candidates(cfg)
    op = c.rc == RECOMPUTE.index("op")
    assert set(c.tp[op].tolist()) == {1, 2, 4, 8}
    assert not [n for n in settings_notes(cfg, c) if n.startswith("recompute 'op'")]
    cfg = config_from_dict(base | {"search": {"recompute": ["full", "op"]}}, require_mesh=False)
    c = enumerate_candidates(cfg)
    op = c.rc == RECOMPUTE.index("op")
    assert (c.cp[op] == 1).all() and (c.cp > 1).any() and (c.tp[op] > 1).any()
    note = [n for n in settings_notes(cfg, c) if n.startswith("recompute 'op'")]
    assert note == ["recompute 'op' (torchtitan's op-level selective AC) is searched on candidates with cp = 1 "
                    "only (any tp, ep, multi-head latent attention too): with cp > 1 plan refuses it (which CP "
                    "collectives its replay runs is not modelled)"]
