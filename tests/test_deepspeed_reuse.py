"""DeepSpeed ZeRO-3's coordinator at the grain of one parameter (:mod:`meshplan.spec.deepspeed_reuse`,
edaa722 ``partitioned_param_coordinator.py``): the prefetch's run past ``stage3_max_live_parameters``
(the limit checked before a parameter is taken, :457) and ``stage3_max_reuse_distance`` (:653-662),
with values derived by hand on a 4-layer model of known parameter sizes, and the JSON key read and
written back (issue dsreuse)."""

from __future__ import annotations

import json

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.deepspeed_carry import not_planned
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.spec.deepspeed_reuse import frontier_bytes, prefetch_taken, reuse_kept

#: one layer's parameters in trace order, elements: 1,000 in all
LAYER = (100, 200, 300, 400)


def test_prefetch_runs_past_the_limit_by_less_than_one_parameter():
    """The loop takes a parameter while fewer than the room are taken: the run ends on the first
    parameter that reaches the room. Room 1 takes the 100, room 101 the 100 and the 200 (199 past),
    room 601 all four (399 past); a run that ends exactly on a boundary takes nothing more."""
    assert [prefetch_taken(r, LAYER) for r in (1, 100, 101, 300, 301, 601)] == [100, 100, 300, 300, 600, 1000]
    for room in range(1, 1001):
        taken = prefetch_taken(room, LAYER)
        assert 0 <= taken - room < max(LAYER)  # past by less than one parameter, never short
    # across layers: 2 whole layers, then 250 into the third ends after its second parameter
    assert frontier_bytes(2250, LAYER) == 2300 and frontier_bytes(2000, LAYER) == 2000
    assert frontier_bytes(2001, LAYER) == 2100


def test_reuse_distance_keeps_the_last_layers_across_the_turn():
    """Distance 1,500 (1.5 layers), head 100, no recompute: between parameter j of the last layer's
    forward and its backward lie the rest of the layer twice and the head twice: 2 x (900, 700,
    400, 0) + 200 = 2000, 1600, 1000, 200, so the 300 and the 400 are kept (700); the layer before
    adds 2 x 1,000: none. The output layer is reused at once (0 < 1,500). Saved per micro-batch:
    700 + 100 all-gathered elements."""
    r = reuse_kept(LAYER, 4, (100,), 1500, False, persist_below=0)
    assert (r.layers, r.head, r.replay, r.at_turn, r.saved) == ((0, 0, 0, 700), 100, 0, 800, 800)
    # at the last layer's backward: kept 800 + the layer's other 300 fetched; max live 2,000 tops up
    assert r.gathered_at_turn(LAYER, 500) == 1100 and r.gathered_at_turn(LAYER, 2000) == 2000
    # a distance of 1e9 keeps every layer (the first one's first parameter: 2 x 900 + 6,000 + 200 = 8,000)
    everything = reuse_kept(LAYER, 4, (100,), 10**9, False, persist_below=0)
    assert everything.layers == (1000,) * 4 and everything.saved == 4100
    # 8,000 is not under 8,000: the first layer's first parameter is the one let go
    assert reuse_kept(LAYER, 4, (100,), 8000, False, persist_below=0).layers == (900, 1000, 1000, 1000)
    assert reuse_kept(LAYER, 4, (100,), 0, False, persist_below=0).saved == 0


def test_reuse_distance_under_full_recompute():
    """Full recompute, distance 1,500: forward -> replay of the last layer, 1,000 - n_j + 200 (1,100
    .. 800): all of it; of the others (+ 2,000) none. Replay -> backward, every layer: 2 x (900, 700,
    400, 0) = 1800, 1400, 800, 0: the last three, 900. Saved: 1,000 + 100 + 4 x 900 = 4,700; at
    distance 0, 2 gathers per layer in backward as before."""
    r = reuse_kept(LAYER, 4, (100,), 1500, True, persist_below=0)
    assert (r.layers, r.head, r.replay, r.saved) == ((0, 0, 0, 1000), 100, 900, 4700)
    assert reuse_kept(LAYER, 4, (100,), 0, True, persist_below=0).saved == 0


def test_persistent_parameters_count_in_the_distance_but_are_not_kept():
    """A norm of 50 elements under the persistence threshold (100): never partitioned, so not
    kept, but its 50 are traversed: with the norm first, the last layer's 400 sits 2 x 0 + 2 x 100
    from its backward and the 300 at 2 x 400 + 200 = 1,000 < 1,050."""
    r = reuse_kept((50,) + LAYER, 4, (100,), 1050, False, persist_below=100)
    assert r.layers[-1] == 700 and r.head == 100
    assert reuse_kept((50,) + LAYER, 4, (100,), 1000, False, persist_below=100).layers[-1] == 400


def _load(tmp_path, **zero):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3, **zero}, "bf16": {"enabled": True}}))
    return load_any(path, opts=ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096))


def test_max_reuse_distance_is_read_and_written_back(tmp_path):
    cfg = _load(tmp_path, stage3_max_reuse_distance=5e7)
    assert cfg.memory.deepspeed_max_reuse_elements == 50_000_000
    assert "zero_optimization.stage3_max_reuse_distance" not in not_planned(
        {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 5e7}})
    back = json.loads(export(cfg, "deepspeed", "x")[0])["zero_optimization"]
    assert back["stage3_max_reuse_distance"] == 50_000_000
    assert _load(tmp_path, max_reuse_distance=0).memory.deepspeed_max_reuse_elements == 0
    unset = _load(tmp_path)
    assert unset.memory.deepspeed_max_reuse_elements is None
    assert "stage3_max_reuse_distance" not in json.loads(export(unset, "deepspeed", "x")[0])["zero_optimization"]


def test_bad_max_reuse_distance_names_the_key_and_the_fix(tmp_path):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, stage3_max_reuse_distance=-1)
    assert str(e.value).startswith("zero_optimization.stage3_max_reuse_distance: must be a whole number")
    assert "\n" not in str(e.value)
