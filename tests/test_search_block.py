"""Megatron-LM's block recompute as a search knob (search.block_recompute): under framework megatron
each mesh is tried at ``block`` beside none and full, at the smallest n that fits
(``--recompute-method block --recompute-num-layers n``: the first n layers of each model chunk
checkpointed, NVIDIA/Megatron-LM d98e8a6 megatron/core/recompute.py:167-182).

The hand case: tests/test_block_recompute.py's model G with 8 layers (hidden 16, gated MLP 64, 4
heads of 4, bf16, flash, seq 8, micro-batch 1, tp 1) under framework megatron, ZeRO-1 over dp 8 at
pp 1: one micro-batch in flight. A layer keeps 5248 B whole and 256 B (its input) checkpointed
(that file's docstring: Korthikanti et al. 2022 Table 2 terms), so each layer checkpointed lowers
the saved activations by 5248 - 256 = 4992 B. The peak is reached at the head's backward (every
layer's activations still saved, the replay's working set not yet there), so the planned peak of
block n is none's less n x 4992 B, for every n from 0 (none) to 8 (every layer, full's peak).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.block_bounds import block_lower
from meshplan.search.block_recompute import chunk_layers
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import RECOMPUTE
from meshplan.search.driver import search
from meshplan.search.estimate import refine
from meshplan.search.memory import Tables
from meshplan.search.reasons import CODE, OK
from tests.cli_run import run_main

from tests.test_activation_checkpointing import G
from test_search import SMALL, config, refused

#: Bytes a checkpointed layer of G keeps less than a whole one (module docstring).
DELTA = 5248 - 256
G8 = dict(G, layers=8, name="g8")
#: The one mesh: dp 8 (ZeRO-1), pp 1, micro-batch 1.
ONE = {"pp": [1], "tp": [1], "cp": [1], "dp_replicate": [1], "micro_batch": [1], "sharding": ["zero1"],
       "vpp": [1]}


def _cfg(hbm_gb: float = 80.0, headroom_tier: bool = False, **search_table):
    train = {"global_batch": 32, "seq_len": 8, "framework": "megatron", "memory_reserve": 0.0}
    gpu = {"name": "h100-test-hbm", "peak_tflops": {"bf16": 989.4}, "hbm_gb": hbm_gb,
           "hbm_bandwidth_tb_per_s": 3.35, "sms": 132, "max_gemm_fraction": 0.803, "source": "test"}
    return config_from_dict({"model": G8, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": gpu},
                             "training": train,
                             "search": ONE | {"headroom_tier": headroom_tier} | search_table}, require_mesh=False)


def _peak(cfg, recompute: str, n=None) -> float:
    mesh = {"names": ["dp"], "shape": [8]}
    d = config_from_dict({"model": G8, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": cfg.cluster.gpu.model_dump()},
                          "training": {"global_batch": 32, "seq_len": 8, "framework": "megatron", "sharding": "zero1",
                                       "memory_reserve": 0.0, "micro_batch": 1, "recompute": recompute,
                                       "recompute_num_layers": n}, "mesh": mesh})
    return build_plan(d).timeline.peak.total_bytes


def test_peak_falls_by_one_layer_a_block():
    """Block n's planned peak is none's less n x 4992 B for n = 1 to 7 (module docstring). At n = 8,
    full, the head's backward holds 8 x 4992 B less still, and the peak moves to the backward of a
    replayed layer, above that (39,400 B below none's, 536 B short of 8 x 4992), yet below block 7's."""
    cfg = _cfg()
    none, full = _peak(cfg, "none"), _peak(cfg, "full")
    peaks = [_peak(cfg, "full", n) for n in range(1, 8)]
    assert [none - p for p in peaks] == [n * DELTA for n in range(1, 8)]
    assert none - 8 * DELTA < full < peaks[-1]


def test_smallest_block_that_fits_wins():
    """With usable memory 2,500 B above block 3's peak (none's less 3 x 4992 B), block 2's peak
    (4992 B higher) does not fit and block 3 does: the search's row is ``block 3/8`` (its n picked by
    the bisection over memory plans), its peak none's less 14,976 B, and its step lies between none's,
    which does not fit, and full's; ``meshplan step`` of it counts 3 layers' forward replayed."""
    hbm = (_peak(_cfg(), "none") - 3 * DELTA + 2500) / 1e9
    cfg = _cfg(hbm)
    r = search(cfg, workers=1)
    c, row = r.candidates, r.top[0]
    i = row.index
    assert RECOMPUTE[c.rc[i]] == "block" and row.block == 3 and c.block_layers(i) == 3
    assert c.label(i).startswith("dp 8, mb 1, block 3/8, vpp 1, zero1")
    assert row.peak_bytes == _peak(cfg, "none") - 3 * DELTA
    rows = {RECOMPUTE[c.rc[k]]: k for k in range(len(c))}
    assert r.code[rows["none"]] == CODE["memory"] and r.code[rows["full"]] == OK
    steps = {k: r.exact[rows[k]].step_s if rows[k] in r.exact else None for k in ("none", "full")}
    none_step = step_time(build_plan(candidate_config(cfg, c, rows["none"])), Overlap()).step_s
    full_step = steps["full"] or step_time(build_plan(candidate_config(cfg, c, rows["full"])), Overlap()).step_s
    assert none_step < row.step_s < full_step
    plan = build_plan(candidate_config(cfg, c, i))
    assert plan.config.training.recompute_num_layers == 3
    st = step_time(plan, Overlap())
    forward = st.units.chunks[0][0].layers[0].seconds(phase="forward")
    assert st.recompute_s() == pytest.approx(3 * forward, rel=1e-12)


def test_headroom_tier_picks_the_smallest_clear_block():
    """Under [search] headroom_tier (the default) the row's n is the smallest whose peak keeps 15% of
    the usable memory free: with usable memory set so that 0.85 x usable lies 2,500 B above block 5's
    peak, block 5 (not block 1, which fits but is tight) is picked."""
    none = _peak(_cfg(), "none")
    usable = (none - 5 * DELTA + 2500) / 0.85
    assert none <= usable  # none fits, tight: block adds a clear setting
    r = search(_cfg(usable / 1e9, headroom_tier=True), workers=1)
    best = [e for e in r.exact.values() if e.block is not None and e.feasible]
    assert [e.block for e in best] == [5]


def test_export_writes_block_flags_and_torchtitan_refuses(tmp_path, capsys):
    """--export --to megatron writes --recompute-method block --recompute-num-layers 3, --to meshplan
    keeps recompute_num_layers = 3; export of that run (under Megatron FSDP) --to torchtitan or
    deepspeed is refused in one line naming the field: torchtitan checkpoints every layer or every
    k-th, never the first n (plan_runtime.block_recompute_refusal), and a DeepSpeed JSON holds no
    recompute."""
    hbm = (_peak(_cfg(), "none") - 3 * DELTA + 2500) / 1e9
    path = tmp_path / "s.toml"
    path.write_text(f'[model]\nname = "g8"\nlayers = 8\nhidden = 16\nffn = 64\ngated_mlp = true\nq_heads = 4\n'
                    f'vocab = 128\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[cluster.gpu]\nname = "t"\n'
                    f'peak_tflops = {{bf16 = 989.4}}\nhbm_gb = {hbm!r}\nhbm_bandwidth_tb_per_s = 3.35\nsms = 132\n'
                    f'max_gemm_fraction = 0.803\nsource = "test"\n[training]\nglobal_batch = 32\nseq_len = 8\n'
                    f'framework = "megatron"\nmemory_reserve = 0.0\n[search]\npp = [1]\ntp = [1]\ncp = [1]\n'
                    f'dp_replicate = [1]\nmicro_batch = [1]\nsharding = ["zero1"]\nvpp = [1]\nheadroom_tier = false\n')
    assert run_main("search", path, "--export", 1, "--to", "megatron", "-o", tmp_path / "m.sh") == 0
    flags = (tmp_path / "m.sh").read_text()
    assert "--recompute-granularity full" in flags and "--recompute-method block" in flags
    assert "--recompute-num-layers 3" in flags
    assert run_main("search", path, "--export", 1, "--to", "meshplan", "-o", tmp_path / "m.toml") == 0
    assert "recompute_num_layers = 3\n" in (tmp_path / "m.toml").read_text()
    fsdp = tmp_path / "f.toml"  # the same run under Megatron FSDP (zero3), which torchtitan's FSDP2 could shard
    fsdp.write_text((tmp_path / "m.toml").read_text().replace('sharding = "zero1"', 'sharding = "zero3"')
                    .replace('names = ["dp"]', 'names = ["dp_shard"]'))
    capsys.readouterr()
    for to in ("torchtitan", "deepspeed"):
        assert run_main("export", fsdp, "--to", to, "-o", tmp_path / f"out.{to}") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{to}'s runtime refuses block recompute" in err[0], err
        assert "training.recompute_num_layers 3 is Megatron-LM's block recompute" in err[0]
        assert not (tmp_path / f"out.{to}").exists()


def test_block_listed_outside_megatron_is_refused():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"model": G8, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": {"global_batch": 32, "seq_len": 8}, "search": {"recompute": ["none", "block"]}},
                         require_mesh=False)
    assert e.value.field == "search.recompute" and "Megatron-LM's block recompute" in str(e.value)


@pytest.mark.parametrize("hbm_gb", [6.0, 3.0])
def test_block_bounds_hold_at_every_n(hbm_gb):
    """The bounds of a ``block`` row hold whatever n the planner picks: on test_search's small
    Llama-style model (8 layers) on 8 H100s with 6 GB (every row's least n, ``rm``, 0: none's bound
    fits), and with 3 GB (rows' least n 1, 2 and 4; where it is 1 or more the step bound counts that
    many replays per chunk, above none's), under framework megatron (pp 1, 2, 4, vpp 1, 2; chunks of 8 down to 1
    layers), every block row planned at every n from 1 to its largest chunk's layers less one: the
    memory lower bound at that n (block_bounds.block_lower) <= the planned peak <= the upper bound,
    a plan below the row's least n does not fit, and the step lower bound (counting the least n's
    replays), vectorised and refined, <= the simulated step of every plan that fits. The rows whose
    chunks hold one layer are rejected (n 1 is full), by rule ``block`` where no earlier rule did,
    and so is every row whose least n is its largest chunk (only full fits there)."""
    cfg = config(1, hbm_gb, micro_batch=[1], training={"framework": "megatron"}, recompute=["none", "full", "block"],
                 vpp=[1, 2], tp=[1, 2])
    r = search(cfg, workers=1)
    c = r.candidates
    block = np.flatnonzero(c.rc == RECOMPUTE.index("block"))
    assert (c.rk[block] == chunk_layers(cfg, c.pp[block], c.vpp[block], c.us[block])).all()
    one = block[c.rk[block] <= 1]
    assert len(one) and (r.code[one] != OK).all() and (r.code[one] == CODE["block"]).any()  # or an earlier rule
    whole = block[(c.rm[block] >= c.rk[block]) & (c.rk[block] > 1) & (r.code[block] != CODE["memory"])]
    assert (r.code[whole] == CODE["block"]).all() and (len(whole) > 0) == (hbm_gb < 6)
    # rows the rule block drops are checked too where they carry bounds (test_search.refused skips them)
    rows = [int(i) for i in block if c.rk[i] > 1 and (r.code[i] == CODE["block"] or not refused(r, int(i)))
            and np.isfinite(r.est.step_lo[i])]
    est = copy.deepcopy(r.est)
    refine(cfg, c, est, np.array(rows))
    checked, tables = {"fits": 0, "least": 0, "below": 0}, Tables(cfg)
    for i in rows:
        for n in range(1, int(c.rk[i])):
            plan = build_plan(candidate_config(cfg, c, i, block=n))
            peak = plan.timeline.peak.total_bytes
            assert r.est.peak_lo[i] <= peak * (1 + 1e-9) and peak <= r.est.peak_hi[i] * (1 + 1e-9), (i, n)
            assert block_lower(cfg, tables, c.take([i]), np.array([n]))[0] <= peak * (1 + 1e-9), (i, n)
            assert n >= c.rm[i] or not plan.feasible, (i, n)
            checked["below"] += n < c.rm[i]
            if plan.feasible:
                s = step_time(plan, Overlap()).step_s
                assert r.est.step_lo[i] <= s * (1 + 1e-9) and est.step_lo[i] <= s * (1 + 1e-9), (i, n)
                checked["fits"] += 1
                checked["least"] += bool(c.rm[i] >= 1)
    assert checked["fits"] >= 20 if hbm_gb == 6 else checked["least"] >= 3 and checked["below"] >= 3, checked
    least = np.array([i for i in rows if c.rm[i] >= 1])
    assert (len(least) > 0) == (hbm_gb < 6)
    if len(least):  # the replays counted raise the bound (refined from 0 both ways: rm as set, rm 0)
        est.step_lo[least], zero = 0.0, copy.deepcopy(est)
        zero.step_lo[least] = 0.0
        refine(cfg, c, est, least)
        refine(cfg, replace(c, rm=np.zeros_like(c.rm)), zero, least)
        assert (est.step_lo[least] > zero.step_lo[least]).all()
