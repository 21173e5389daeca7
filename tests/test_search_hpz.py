"""The search varies DeepSpeed ZeRO++ hpZ (meshplan/search/space.py hpz_values, hpz_applies): the
config's zero_hpz_partition_size, the node's GPU count and 1, on the zero3 rows DeepSpeed's ZeRO-3
runs whose data axis is the whole world over more than one node (DeepSpeed builds the secondary
groups from consecutive world ranks, utils/groups.py _create_zero_param_parallel_group at edaa722).

The cluster of every test: benchmarks/zeropp_sanity.py's HGX A100 node with one 100 Gb/s NIC (the
low-bandwidth setting ZeRO++ targets), 2 nodes; Llama 3 8B, seq 2048, global batch 32, full
recompute, micro-batch 1, zero3 under DeepSpeed's engine, [search] pp 1 and cp 1."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np

from meshplan.config import config_from_dict
from meshplan.search.driver import search
from meshplan.search.space import SHARDING, candidate_config, enumerate_candidates

NODE = tomllib.loads((Path(__file__).parents[1] / "benchmarks" / "zeropp" / "llama3-70b_384xa100_1nic100g.toml")
                     .read_text())["cluster"]


def _cfg(nodes: int = 2, engine: str = "deepspeed", **training):
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {**NODE, "nodes": nodes},
        "mesh": {"names": ["dp_shard"], "shape": [8 * nodes]},
        "training": {"global_batch": 16 * nodes, "seq_len": 2048, "micro_batch": 1, "sharding": "zero3",
                     "zero3_engine": engine, "recompute": "full", **training},
        "search": {"sharding": ["zero3"], "micro_batch": [1], "recompute": ["full"], "pp": [1], "cp": [1]}})


def test_rule_hpz_varied_where_the_data_axis_is_the_world():
    """2 nodes of 8: the meshes are dp_shard 16 / tp, tp 1, 2, 4, 8 (4); each FSDP-sharded, so
    reshard_after_forward true and false (8 rows). hpZ g = 1 (the config's) and 8 (the node's
    GPUs) on the two dp_shard 16 rows only (tp > 1: the data axis is not the world): 10 rows, the
    hpZ 8 ones labelled so, and each row's plan input carries its g. On one node (dp_shard 8 is the
    node: hpZ's group would be the primary one) and under FSDP2 (no ZeRO++) nothing is varied."""
    cfg = _cfg()
    c = enumerate_candidates(cfg)
    assert len(c) == 10
    hpz = sorted((int(c.tp[i]), int(c.rf[i]), c.hpz(i)) for i in range(len(c)) if c.hpz(i) > 1)
    assert hpz == [(1, 0, 8), (1, 1, 8)]
    assert sorted(set(c.hz[c.tp == 1].tolist())) == [1, 8] and set(c.hz[c.tp > 1].tolist()) == {1}
    i = next(i for i in range(len(c)) if c.hpz(i) == 8)
    assert c.label(i).endswith(", hpZ 8")
    assert candidate_config(cfg, c, i).training.zero_hpz_partition_size == 8
    assert set(enumerate_candidates(_cfg(1)).hz.tolist()) == {1}
    assert set(enumerate_candidates(_cfg(engine="fsdp2")).hz.tolist()) == {1}


def test_search_output_names_hpz_as_the_tops_difference():
    """On one 100 Gb/s NIC per 8 GPUs, a world-wide gather of a layer's 436 MB (bf16) crosses the NIC
    every pass; with hpZ 8 only micro-batch 0's forward does, every later gather runs on NVLink:
    the top is dp_shard 16 at hpZ 8, and its step is shorter than the config's own mesh without it.
    #2 is another mesh (dp_shard 8 x tp 2, where hpZ cannot run); the line that compares them names
    hpZ beside the data axis in the exposed ZeRO data-parallel part, as the top row's knobs do."""
    r = search(_cfg())
    c, top = r.candidates, r.top[0]
    assert c.hpz(top.index) == 8 and int(c.tp[top.index]) == 1
    plain = next(e for e in r.exact.values() if c.hpz(e.index) == 1 and int(c.tp[e.index]) == 1 and c.rf[e.index])
    assert top.step_s < plain.step_s
    line = r.explanation.line()
    assert "zero_hpz_partition_size 8 vs 1" in line
    z3 = [i for i in r.exact if SHARDING[c.sh[i]] == "zero3"]
    assert all(candidate_config(r.config, c, i).training.zero_hpz_partition_size == c.hpz(i) for i in z3)
    assert np.isin(c.hz, [1, 8]).all()


def _held(values):
    """``_cfg()`` with ``[search] zero_hpz_partition_size`` set, read as a TOML's table would be."""
    cfg = _cfg()
    return config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {**NODE, "nodes": 2},
                             "mesh": {"names": ["dp_shard"], "shape": [16]},
                             "training": cfg.training.model_dump(exclude_unset=True),
                             "search": {**cfg.search.model_dump(exclude_unset=True),
                                        "zero_hpz_partition_size": values}})


def test_search_switch_holds_hpz():
    """tt50: ``[search] zero_hpz_partition_size`` holds hpZ as ``reshard_after_forward`` holds its knob.
    The 2-node space of test_rule_hpz_varied_where_the_data_axis_is_the_world is 8 meshes-and-reshard
    rows plus one more hpZ value on each of the 2 dp_shard 16 rows (10); held at [8] those 2 rows take
    g 8 only (8 rows: dp_shard 16 at hpZ 8, the tp > 1 rows at 1, where hpZ cannot run); held at [1] none
    runs hpZ (8 rows). The config's own g (1, unset) is then not searched at its mesh, and the configured
    line says which [search] field holds it; the narrowing line names the held values."""
    from meshplan.report.search_header import narrowed_lines
    from meshplan.search.configured_find import find
    eight = enumerate_candidates(_held([8]))
    assert len(eight) == 8
    assert sorted(set(eight.hz[eight.tp == 1].tolist())) == [8] and set(eight.hz[eight.tp > 1].tolist()) == {1}
    off = enumerate_candidates(_held([1]))
    assert len(off) == 8 and set(off.hz.tolist()) == {1}
    cfg = _held([8])
    why = find(cfg, cfg.mesh, eight)
    assert isinstance(why, str) and why.startswith("zero_hpz_partition_size 1 is not searched")
    assert "[search] zero_hpz_partition_size" in why
    assert narrowed_lines(cfg.search)[0].endswith("zero_hpz_partition_size 8, micro_batch 1, recompute full, "
                                                  "sharding zero3")


def test_search_switch_bad_value_is_one_line():
    """A g below 1 is an error naming the field, one line."""
    from meshplan.errors import ConfigError
    import pytest
    with pytest.raises(ConfigError, match="search.zero_hpz_partition_size") as e:
        _held([0])
    assert "\n" not in str(e.value)
