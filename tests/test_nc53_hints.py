"""Newcomer trial 53 (long-context torchtitan, Llama 3.1 70B at 128k on 16 dgx-h200): #5, a step
whose exposed time is mostly CP gets a ``hint:`` line of CP moves, each re-planned
(:mod:`meshplan.schedule.cp_hint`); #7, a seq_len that cp's load-balanced split does not cut into
2 x cp chunks gets a ``fix:`` line (:func:`meshplan.plan_fix_rules.seq_fix`). Expected values come
from the model itself (each move's config written here by hand, planned and stepped) and from the
divisibility by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import config_from_dict
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.plan import build_plan
from meshplan.plan_fix_rules import seq_fix
from meshplan.schedule.cp_hint import cp_hint, cp_knobs
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import rebuilt_step
from meshplan.units import step_seconds
from tests.cli_run import run_captured

DATA = Path(__file__).parent / "data" / "nc53b"
H200 = ImportOptions(cluster="dgx-h200", nodes=16)
GQA = dict(layers=2, hidden=64, ffn=256, gated_mlp=False, q_heads=4, kv_heads=2, vocab=256)


def test_seq_fix_on_the_trials_file():
    """tests/data/nc53b/bad_seq.toml: seq_len 131,080 at cp 16 x tp 8 with sequence parallelism.
    The rules need seq_len % (2 x 16) == 0 and (seq_len / 16) % 8 == 0: a multiple of 128. Below:
    131,080 // 128 x 128 = 131,072; above 131,200. No cp of 16's divisors takes 131,080: with tp 8
    it needs 8 x cp | 131,080 = 8 x 16,385, 16,385 odd, so cp 1 only (not offered: cp > 1 moves)."""
    out = run_captured("plan", str(DATA / "bad_seq.toml"), "--cluster", "dgx-h200", "--nodes", "16")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        "fix: seq_len 131080 must split into 2 x cp = 32 chunks (load-balanced causal CP): "
        "training.seq_len 131072 or 131200")


def test_seq_fix_offers_the_cp_that_splits_it():
    """GQA toy on 8 GPUs, dp_shard 2 x cp 4, no tp, seq_len 36: 2 x cp = 8 does not divide 36
    (36 = 4 x 8 + 4): 32 or 40; cp 2 (2 x 2 = 4 divides 36), dp_shard taking the freed 2: shape [4, 2]."""
    cfg = config_from_dict({"model": GQA, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 36, "micro_batch": 1},
                            "mesh": {"names": ["dp_shard", "cp"], "shape": [2, 4]}})
    assert seq_fix(build_plan(cfg)) == ("fix: seq_len 36 must split into 2 x cp = 8 chunks (load-balanced causal CP): "
                                        "training.seq_len 32 or 40; or cp 2 (mesh.shape [4, 2])")
    fits = config_from_dict({"model": GQA, "cluster": {"system": "dgx-h100", "nodes": 1},
                             "training": {"global_batch": 8, "seq_len": 32, "micro_batch": 1},
                             "mesh": {"names": ["dp_shard", "cp"], "shape": [2, 4]}})
    assert seq_fix(build_plan(fits)) is None


def test_cp_hint_lists_the_moves_each_replanned():
    """The trial's job (tests/data/nc53b/tt_70b_128k.toml, cp 16 x tp 8, all-gather rotation): exposed
    cp 352.68 s of a 510.08 s step, 69.1%, the largest stream. The moves (cp_knobs): tp is at the
    node's 8 GPUs, so each smaller cp gives its factor to dp_shard (cp 8, 4, 2, 1: dp_shard 2, 4, 8,
    16), then the other rotation. Each mesh written here by hand, planned and stepped: the line
    lists the three fastest, cp 1 (dp_shard 16 x tp 8) first, each with its step and exposed cp.
    After the merge with nc52fixC (NCCL's network rings hold 16 of the H200's 132 SMs while they run): the
    kernels beside the cp gathers run slower, so part of what was exposed cp is now compute: exposed cp
    352.68 -> 350.92 s, the step 510.08 -> 510.16 s, 68.8% (read from the model). The job names the float8
    converter "quantize.linear.float8", which torchtitan v0.2.2's parallelize does not take for float8 TP
    (parallelize.py:77 at 73a0e69: ``"float8" in job_config.model.converters``): planned with plain TP
    (training.fp8_tp = false), the tp all-gathers move bf16 (twice the bytes) and each tp-sharded amax is
    all-reduced, exposed tp 16.45 -> 20.90 s; the casts of the gathered tensors add compute, 141.65 ->
    143.84 s, beside which more of the cp gathers hide: exposed cp 350.92 -> 348.56 s, the step 510.16 ->
    514.43 s, 67.8% (read from the model; with fp8_tp = true the numbers above come back).
    (kvheads: planned here with ``[memory] kv_expanded`` true, K and V at the 8 local q heads (repeat_kv,
    torchtitan before ff0829c), the traffic every figure below was read at; the job's own v0.2.2 moves its 1
    KV head (enable_gqa, what the import plans): exposed cp 348.56 -> 51.03 s (the step 514.43 -> 222.63 s), 8x
    smaller gathers and shifts.)"""
    cfg = load_any(DATA / "tt_70b_128k.toml", opts=H200)
    assert round(step_time(build_plan(cfg)).exposed_s["cp"], 2) == 51.03
    cfg = replace(cfg, memory=cfg.memory.model_copy(update={"kv_expanded": True}))
    plan = build_plan(cfg)
    st = step_time(plan)
    assert not cfg.training.fp8_tp
    assert round(st.exposed_s["cp"], 2) == 348.56 and round(st.step_s, 2) == 514.43
    assert [w for w, _, _ in cp_knobs(plan)] == [
        "mesh dp_shard 2 x cp 8 x tp 8", "mesh dp_shard 4 x cp 4 x tp 8", "mesh dp_shard 8 x cp 2 x tp 8",
        "mesh dp_shard 16 x tp 8", "training.cp_rotate = \"alltoall\""]
    (line,) = cp_hint(plan, st, rebuilt_step(plan, step_time))
    assert line.startswith("hint: exposed cp is 67.8% of the step (348.56 s of 514.43 s; cp 16, ring with the "
                           "allgather rotation): shorter with mesh dp_shard 16 x tp 8 (step ")
    by_hand = {}
    for dp, cp in ((16, 1), (8, 2), (4, 4)):
        alt = step_time(build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [dp, cp, 8]}))))
        by_hand[cp] = alt
        words = ("mesh dp_shard 16 x tp 8" if cp == 1 else f"mesh dp_shard {dp} x cp {cp} x tp 8")
        assert (f"{words} (step {step_seconds(alt.step_s)}, {alt.step_s / st.step_s - 1:+.1%}, exposed cp "
                f"{alt.exposed_s.get('cp', 0.0):.2f} s, peak") in line
    assert by_hand[1].step_s < by_hand[2].step_s < by_hand[4].step_s < st.step_s / 2
    assert line.index("dp_shard 16 x tp 8") < line.index("cp 2 x") < line.index("cp 4 x")


def test_no_cp_hint_where_cp_exposes_little():
    """Llama-3-8B at seq 8192 on one dgx-h100, dp_shard 4 x cp 2 (NVLink): cp's exposure is far under
    15% of the step (or not the largest stream): no line, nothing re-planned."""
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 8, "seq_len": 8192, "micro_batch": 1},
                            "mesh": {"names": ["dp_shard", "cp"], "shape": [4, 2]}})
    plan = build_plan(cfg)
    st = step_time(plan)
    assert st.exposed_s.get("cp", 0.0) < 0.15 * st.step_s
    assert cp_hint(plan, st, rebuilt_step(plan, step_time)) == []
