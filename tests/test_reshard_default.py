"""``training.reshard_after_forward`` unset follows the runtime at each mesh's pp: false under
framework torch with FSDP2 and pp > 1, as torchtitan's ``fsdp_reshard_after_forward = "default"``
runs it (``not pp_enabled``, pytorch/torchtitan b5bcd76 torchtitan/distributed/fsdp.py:124-133), true
elsewhere (pp 1, Megatron FSDP, DeepSpeed's ZeRO-3); a value written is kept
(:meth:`meshplan.spec.training.TrainingSpec.at_pp`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.config import config_from_dict
from meshplan.interop.torchtitan_write import write
from meshplan.plan import build_plan
from meshplan.schedule.reshard_note import reshard_default_note
from meshplan.search.configured_find import find
from meshplan.search.space import enumerate_candidates
from meshplan.spec.training import TrainingSpec

#: Llama-3-8B (32 layers) on one dgx-h100 at pp 2 x dp_shard 2 x tp 2: 16 layers per stage, global
#: batch 16 over dp 2 at micro-batch 1: 8 micro-batches per step.
BASE = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 16, "seq_len": 4096, "micro_batch": 1, "sharding": "zero3", "recompute": "none"},
        "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 2], "sequence_parallel": True}}


def _cfg(mesh=None, search=None, **training):
    d = {**BASE, "training": {**BASE["training"], **training}, "mesh": {**BASE["mesh"], **(mesh or {})}}
    return config_from_dict(d | ({"search": search} if search else {}))


def _gathers(plan) -> dict[str, int]:
    """Per step on stage 0: the layers' FSDP all-gathers by phase (``every layer`` rows)."""
    return {r.phase: r.per_step for r in plan.collectives["stage 0"]
            if r.axis == "dp_shard" and r.op == "all-gather" and r.cadence == "every layer"}


def test_unset_under_torch_pp_plans_as_false():
    """By hand: with false each of a stage's 16 layers is all-gathered once in the step's first
    forward and kept to its last backward (torch's pipeline reshards at the step's end): 16 forward
    gathers, none in backward. Unset plans exactly that (the same tables and memory as false written);
    true gathers again in backward."""
    unset, false, true = (build_plan(_cfg(**kw)) for kw in ({}, {"reshard_after_forward": False},
                                                            {"reshard_after_forward": True}))
    assert unset.micro_batches == 8 and [len(s[0]) for s in unset.stages] == [16, 16]
    assert _gathers(unset) == _gathers(false) == {"forward": 16}
    assert unset.collectives == false.collectives
    assert unset.timeline.peak.total_bytes == false.timeline.peak.total_bytes
    assert "backward" in _gathers(true) and _gathers(true)["forward"] > 16
    assert not unset.config.training.reshard_after_forward and true.config.training.reshard_after_forward


def test_the_note_says_which_value_and_why_only_when_defaulted():
    unset = build_plan(_cfg())
    assert reshard_default_note(unset) == (
        "note: training.reshard_after_forward unset: planned false, torchtitan's default under pp 2 "
        "(fsdp_reshard_after_forward = \"default\" is not pp_enabled: torchtitan b5bcd76 distributed/fsdp.py:124-133), "
        "each chunk's parameters kept gathered from its forward to its backward (no backward all-gather); set it "
        "to true to reshard after forward")
    for given in (True, False):
        assert reshard_default_note(build_plan(_cfg(reshard_after_forward=given))) is None
    assert reshard_default_note(build_plan(_cfg(mesh={"names": ["dp_shard", "tp"], "shape": [4, 2]}))) is None


def test_pp1_megatron_and_deepspeed_keep_true():
    pp1 = build_plan(_cfg(mesh={"names": ["dp_shard", "tp"], "shape": [4, 2]}))
    assert pp1.config.training.reshard_after_forward and "backward" in _gathers(pp1)
    megatron = build_plan(_cfg(framework="megatron"))  # Megatron FSDP reshards every unit after forward
    assert megatron.config.training.reshard_after_forward and "backward" in _gathers(megatron)
    t = TrainingSpec(global_batch=16, seq_len=4096, zero3_engine="deepspeed")  # DeepSpeed ZeRO-3 gathers again
    assert t.at_pp(2).reshard_after_forward and t.reshard_default(2)
    head = TrainingSpec(global_batch=16, seq_len=4096, reshard_head_after_forward=True)  # torchtitan's "always"
    assert head.at_pp(2).reshard_after_forward


def test_each_mesh_resolves_its_own_pp():
    """A plan's training keeps the field unset, so another mesh of the same config resolves again."""
    plan = build_plan(_cfg())
    assert "reshard_after_forward" not in plan.config.training.model_fields_set
    flat = build_plan(replace(plan.config, mesh=plan.config.mesh.model_copy(
        update={"names": ["dp_shard", "tp"], "shape": [4, 2]})))
    assert flat.config.training.reshard_after_forward


@pytest.mark.parametrize("training, pp, policy", [
    ({}, 2, "default"), ({"reshard_after_forward": True}, 2, "always"), ({"reshard_after_forward": False}, 2, "default"),
    ({}, 1, "default"), ({"reshard_after_forward": False}, 1, "never")])
def test_torchtitan_export_writes_default_where_it_is_torchtitans(training, pp, policy):
    mesh = {} if pp == 2 else {"names": ["dp_shard", "tp"], "shape": [4, 2]}
    assert write(_cfg(mesh=mesh, **training))["parallelism"]["fsdp_reshard_after_forward"] == policy


NARROW = {"pp": [2], "tp": [2], "cp": [1], "dp_replicate": [1], "micro_batch": [1], "recompute": ["none"],
          "sharding": ["zero3"], "uneven_stages": [False], "vpp": [1]}


def test_search_row_of_a_pp_mesh_is_false_unless_written_or_narrowed():
    """The search varies the knob (both rows kept); the config's own row is the false one when it is
    unset under pp 2, the true one when written true, and none when [search] allows true only."""
    unset = _cfg(search=NARROW)
    c = enumerate_candidates(unset)
    assert sorted(c.rf.tolist()) == [0, 1]
    assert int(c.rf[find(unset, unset.mesh, c)]) == 0
    true = _cfg(search=NARROW, reshard_after_forward=True)
    assert int(c.rf[find(true, true.mesh, c)]) == 1
    only_true = _cfg(search=NARROW | {"reshard_after_forward": [True]})
    assert find(only_true, only_true.mesh, enumerate_candidates(only_true)) == \
        "reshard_after_forward false is not searched with this mesh"


def test_search_row_without_a_data_axis_is_found_unset():
    """pp 2 x tp 4 shards nothing over a data axis: the search does not vary the knob there (its rows
    carry true, which gathers nothing), and the unset config is still that row."""
    cfg = _cfg(mesh={"names": ["pp", "tp"], "shape": [2, 4]}, search=NARROW | {"tp": [4]})
    c = enumerate_candidates(cfg)
    i = find(cfg, cfg.mesh, c)
    assert isinstance(i, int) and not c.reshard_varied[i]


def test_an_unset_v_schedule_under_pp_has_no_reshard_warning():
    """ZB-V at pp 2 x dp_shard 2: torch 2.13's defect needs units resharded after forward
    (pipeline.vshape.RESHARD_DEFECT); unset is false there, so neither the plan nor the config's
    warnings (export's header) name it; written true, both do."""
    from meshplan.pipeline.vshape import RESHARD_DEFECT
    from meshplan.plan_runtime import config_warnings
    v = {"pp_schedule": "zbv", "virtual_stages": 2}
    unset, true = _cfg(mesh=v), _cfg(mesh=v, reshard_after_forward=True)
    assert not [w for w in config_warnings(unset) + build_plan(unset).notes if RESHARD_DEFECT in w]
    assert [w for w in config_warnings(true) if RESHARD_DEFECT in w]
    assert [w for w in build_plan(true).notes if RESHARD_DEFECT in w]
