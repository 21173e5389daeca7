"""Megatron-LM's overlapped pipeline send/recv (``overlap_p2p_comm``, on unless
``--no-overlap-p2p-communication``; ``training.pp_p2p_overlap``) under the interleaved schedule:
the steady state's sends and receives are issued without waiting and each receive is waited for
just before its unit; the warm-up and cool-down calls still wait (NVIDIA/Megatron-LM d98e8a6,
megatron/core/pipeline_parallel/schedules.py ``forward_backward_pipelining_with_interleaving``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshplan.config import load_config
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import read, write
from meshplan.pipeline.fast import flat_units, rendezvous, simulate_arrays, spec_durations
from meshplan.pipeline.rounds import run_rounds, run_rounds_general
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.plan import build_plan
from meshplan.schedule.overlap_policy import p2p_mode
from meshplan.schedule.pipeline_exposure import pp_hold_split
from meshplan.schedule.steptime import step_time
from meshplan.spec.mesh import Schedule
from meshplan.spec.training import TrainingSpec

FIDELITY = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity"


def _spec(overlap: bool) -> PipelineSpec:
    return PipelineSpec("interleaved_1f1b", 2, 4, v=2, forward_s=1.0, backward_s=2.0, p2p_s=0.25,
                        blocking_p2p=True, overlap_p2p=overlap)


def _exposed_pp(res, s: int) -> float:
    """Stage s's exposed pp: its waited calls' transfers, and for each unit that waited for an
    asynchronous receive that wait up to one transfer (the rest of a wait is bubble)."""
    split = pp_hold_split(res, s)
    sl = res.stage_slice(s)
    via = res.via_at(np.arange(sl.start, sl.stop))
    received = np.where(via, np.minimum(res.spec.p2p_s, res.wait[sl]), 0.0)
    return split.lead_transfer_s + float(split.transfer_s.sum()) + float(received.sum())


def test_hand_case_with_and_without_overlap():
    """p 2, v 2, m 4; a chunk's F 0.5 s, B 1 s; one transfer 0.25 s. Stage 0 (warm-up W = 2 (p -
    s - 1) + (v - 1) p = 4): F0.c0 F1.c0 F0.c1 F1.c1 | F2.c0 B0.c1 F3.c0 B1.c1 F2.c1 B0.c0 F3.c1
    B1.c0 | B2.c1 B3.c1 B2.c0 B3.c0; stage 1 (W = 2): F0.c0 F1.c0 | F0.c1 B0.c1 F1.c1 B1.c1 F2.c0
    B0.c0 F3.c0 B1.c0 F2.c1 B2.c1 F3.c1 B3.c1 | B2.c0 B3.c0. Busy 12 s on each stage.

    With overlap: the warm-up calls wait as before: s0 F0.c0 0-0.5, call 0.75 (s1's first receive
    posted at 0); F1.c0 0.75-1.25 and s1 F0.c0 0.75-1.25, calls 1.5; s0 F0.c1 1.5-2.0, s1 F1.c0
    1.5-2.0, calls 2.25: s0 F1.c1 2.25-2.75, s1 F0.c1 2.25-2.75. s1 then runs its steady state
    back to back (B0.c1 2.75-3.75, F1.c1 3.75-4.25: its input left s0 at 2.75, here at 3.0, ...
    B3.c1 ends 11.25). s0's call after F1.c1 sends it (s1 posted that receive at 2.75): 3.0;
    F2.c0 3.0-3.5; B0.c1 waits for s1's B0.c1 gradient, 3.75 + 0.25 = 4.0 (0.5 s: 0.25 exposed
    pp, 0.25 bubble), 4.0-5.0; the next six units back to back to 9.5 (each input already there).
    Cool-down: B2.c1's gradient, posted by s1's B2.c1 at 9.75: 10.0 (0.25 exposed, 0.25 bubble),
    10.0-11.0; its waited call meets s1's receive posted after B3.c1 (11.25): 11.5 (0.25 bubble,
    0.25 transfer); B3.c1 11.5-12.5, call 12.75 (s1's call after B2.c0 at 12.5); B2.c0
    12.75-13.75, call 14.0 (s1's after B3.c0); B3.c0 14.0-15.0. Step 15.0 = 12 busy + 2.25
    exposed pp (4 warm-up calls and 3 cool-down calls x 0.25, 2 waits x 0.25) + 0.75 bubble.

    Without (Megatron-LM 2022's waited calls, tests/test_megatron_p2p.py): s0's calls carry
    0.25 x 4 (warm-up), 0.5 x 3 (steady-state calls sending a forward output and an input
    gradient through the one NIC), 0.25 x 4 (the last warm-up-phase call and the cool-down's):
    3.5 s exposed, 1.5 s bubble (1.0 after F1.c1 waiting for s1's F0.c1 + B0.c1, 0.5 after
    B2.c1): step 17.0."""
    for overlap, step, exposed, starts0 in (
            (True, 15.0, 2.25, [0.0, 0.75, 1.5, 2.25, 3.0, 4.0, 5.0, 5.5, 6.5, 7.0, 8.0, 8.5, 10.0, 11.5, 12.75, 14.0]),
            (False, 17.0, 3.5, None)):
        spec = _spec(overlap)
        ref, arr = simulate(spec), simulate_arrays(spec)
        assert ref.step_s == arr.step_s == step
        assert arr.start.tolist() == [e.start_s for s in range(2) for e in ref.events
                                      if e.stage == s and e.stream == "compute"]
        assert _exposed_pp(arr, 0) == pytest.approx(exposed, abs=1e-12)
        assert step - 12.0 - exposed == pytest.approx(0.75 if overlap else 1.5, abs=1e-12)  # bubble
        if starts0:
            assert arr.start[:16].tolist() == starts0
    # the overlapped steady state keeps stage 1 busy from 2.25 to 11.25 without a gap
    r = simulate_arrays(_spec(True))
    assert r.start[16 + 2:16 + 14].tolist() == [2.25 + 1.5 * (k // 2) + 0.5 * (k % 2) for k in range(12)]


def test_fast_and_reference_agree_under_overlap():
    """Both simulations, bitwise, on interleaved cases whose transfers are shorter and longer than
    a chunk's unit (the receive's post then binds: the wait is a whole transfer)."""
    for p, m, v, p2p in [(4, 8, 2, 0.1), (4, 8, 3, 0.7), (3, 6, 2, 0.5), (2, 4, 2, 3.0), (8, 16, 2, 0.2)]:
        spec = PipelineSpec("interleaved_1f1b", p, m, v=v, p2p_s=p2p, blocking_p2p=True, overlap_p2p=True)
        ref, arr = simulate(spec), simulate_arrays(spec)
        assert arr.step_s == ref.step_s
        assert arr.start.tolist() == [e.start_s for s in range(p) for e in ref.events
                                      if e.stage == s and e.stream == "compute"]
        assert [(e.stage, e.name) for e in arr.critical_path] == [(e.stage, e.name) for e in ref.critical_path]
        assert arr.step_s < simulate(replace(spec, overlap_p2p=False)).step_s


def test_general_round_loop_runs_the_overlap_too():
    """The round loop for any times (``run_rounds_general``: a done table) gives the lean loop's
    times on the overlapped calls."""
    spec = PipelineSpec("interleaved_1f1b", 3, 6, v=2, p2p_s=0.5, blocking_p2p=True, overlap_p2p=True)
    f = flat_units(spec.schedule, spec.p, spec.m, spec.v)
    n = len(f.dep)
    pairs = rendezvous(spec, f)
    dur = spec_durations(spec, f)
    local = replace(f, dep=np.where(f.cross, n, f.dep))
    lean = run_rounds(local, dur, np.zeros(n), pairs, spec.p2p_s)
    general = run_rounds_general(local, dur, np.zeros(n), pairs, spec.p2p_s)
    for a, b in zip(lean[:4], general[:4]):
        assert a.tolist() == b.tolist()
    assert general[0].tolist() == [e.start_s for s in range(3) for e in simulate(spec).events
                                   if e.stage == s and e.stream == "compute"]


def test_mode_by_framework_and_schedule():
    """Megatron-LM: interleaved overlaps by default; 1F1B never (arguments.py turns it off, and
    the non-interleaved schedule raises if set); the warm-up flush leaves no waited call; torch
    stays asynchronous under its multi-stage runtime (its single-stage 1F1B and GPipe:
    tests/test_torch_p2p_waits.py). (blocking_p2p, overlap_p2p, torch_p2p)."""
    meg = TrainingSpec(global_batch=8, seq_len=16, framework="megatron")
    off = meg.model_copy(update={"pp_p2p_overlap": False})
    flush = meg.model_copy(update={"pp_p2p_overlap_warmup_flush": True})
    assert p2p_mode(meg, Schedule.INTERLEAVED_1F1B) == (True, True, False)
    assert p2p_mode(off, Schedule.INTERLEAVED_1F1B) == (True, False, False)
    assert p2p_mode(flush, Schedule.INTERLEAVED_1F1B) == (False, False, False)
    assert p2p_mode(meg.model_copy(update={"pp_p2p_overlap": True}), Schedule.ONE_F_ONE_B) == (True, False, False)
    assert p2p_mode(TrainingSpec(global_batch=8, seq_len=16), Schedule.INTERLEAVED_1F1B) == (False, False, False)


@pytest.mark.parametrize("update,word", [
    ({"pp_p2p_overlap": False}, "pp_p2p_overlap = false is Megatron-LM's --no-overlap-p2p-communication"),
    ({"framework": "megatron", "pp_p2p_overlap": False, "pp_p2p_overlap_warmup_flush": True},
     "pp_p2p_overlap_warmup_flush is Megatron-LM's --overlap-p2p-communication-warmup-flush")])
def test_refused_settings_name_the_field(update, word):
    with pytest.raises(ValueError, match=word):
        TrainingSpec(global_batch=8, seq_len=16, **update)


ARGS = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152
--seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--num-layers-per-virtual-pipeline-stage 2 --sequence-parallel --recompute-granularity selective
--use-distributed-optimizer --micro-batch-size 1 --global-batch-size 1536 --bf16 --use-flash-attn
"""
A100x128 = ImportOptions(cluster="dgx-a100", nodes=128)


def _import(tmp_path, extra: str = ""):
    f = tmp_path / "gpt3.args"
    f.write_text(ARGS + extra)
    return load_any(f, "megatron", A100x128)


def test_import_both_flags_and_export_them_back(tmp_path):
    """GPT-3 175B, tp 8, pp 16, 2 layers per virtual stage (v 3): unset overlap is on; the flag
    turns it off; the warm-up flush is read; each is written back and none is listed unused."""
    on = _import(tmp_path)
    assert on.training.pp_p2p_overlap is None and not on.training.pp_p2p_overlap_warmup_flush
    off = _import(tmp_path, "--no-overlap-p2p-communication\n")
    flush = _import(tmp_path, "--overlap-p2p-communication-warmup-flush\n")
    assert off.training.pp_p2p_overlap is False and flush.training.pp_p2p_overlap_warmup_flush
    both = ARGS + "--no-overlap-p2p-communication --overlap-p2p-communication-warmup-flush --lr 1e-4\n"
    assert read(both.replace(" --overlap-p2p-communication-warmup-flush", ""), A100x128).unused == ("--lr",)
    assert "--no-overlap-p2p-communication" in write(off) and "--no-overlap-p2p-communication" not in write(on)
    assert "--overlap-p2p-communication-warmup-flush" in write(flush)
    with pytest.raises(ConfigError, match="--overlap-p2p-communication-warmup-flush"):
        _import(tmp_path, "--no-overlap-p2p-communication --overlap-p2p-communication-warmup-flush\n")


def test_the_newcomers_run_exposes_less_pp_with_overlap(tmp_path):
    """The newcomer's GPT-3 175B run: with Megatron-LM's default overlap the steady state's
    transfers hide behind the units between them; exposed pp is then the warm-up and cool-down
    calls, the receives the compute did not hide, and the tied embedding's all-reduce."""
    on, off = (build_plan(_import(tmp_path, x)) for x in ("", "--no-overlap-p2p-communication\n"))
    a, b = step_time(on), step_time(off)
    assert a.pipeline.spec.overlap_p2p and not b.pipeline.spec.overlap_p2p
    assert a.exposed_s["pp"] < 0.5 * b.exposed_s["pp"] and a.step_s < b.step_s
    assert any(n.startswith("pipeline p2p: Megatron-LM overlap_p2p_comm on") for n in a.notes)
    assert any(n.startswith("pipeline p2p: every send/recv call waited") for n in off.notes)


def test_pp2_interleaved_without_overlap_is_infeasible(tmp_path):
    """Megatron-LM asserts pp > 2 for interleaving without overlap (arguments.py:1005-1009): the
    175B fidelity config at pp 2 (2 nodes, global batch 8) is infeasible with the reason, and
    feasible on that count with the overlap on."""
    text = (FIDELITY / "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml").read_text()
    text = text.replace("shape = [8, 8]", "shape = [2, 8]").replace("nodes = 8", "nodes = 2")
    text = text.replace("global_batch = 64", "global_batch = 8")
    f = tmp_path / "pp2.toml"
    f.write_text(text)
    cfg = load_config(f)
    why = "interleaved 1F1B at pp 2 needs Megatron-LM's p2p overlap"
    assert any(r.startswith(why) for r in build_plan(cfg).reasons)
    on = replace(cfg, training=cfg.training.model_copy(update={"pp_p2p_overlap": None}))
    assert not any(r.startswith(why) for r in build_plan(on).reasons)


def test_fidelity_runs_did_not_overlap():
    """Korthikanti et al. 2022 ran Megatron-LM of 2022, before overlap_p2p_comm (f9283c5,
    2023-05-31): the D3/D4 configs say so, and their step is the waited calls' model."""
    for name in ("full-recompute", "sp-selective"):
        cfg = load_config(FIDELITY / f"megatron-175b_64xa100_tp8-pp8-vpp3_{name}.toml")
        assert cfg.training.pp_p2p_overlap is False
        spec = step_time(build_plan(cfg)).pipeline.spec
        assert spec.blocking_p2p and not spec.overlap_p2p


def test_search_rejects_pp2_interleaved_without_overlap_as_the_plan_does():
    """The search's rule 'interleaved' holds on the pp 2 interleaved rows of the 175B D4 config
    that no earlier rule rejects, with pp_p2p_overlap = false, and on none with it on; a row's plan
    gives the same reason."""
    from meshplan.search.candidate import candidate_config
    from meshplan.search.reasons import CODE, OK, first_reason
    from meshplan.search.space import enumerate_candidates
    cfg = load_config(FIDELITY / "megatron-175b_64xa100_tp8-pp8-vpp3_sp-selective.toml")
    codes = {}
    for overlap in (None, False):
        c_cfg = replace(cfg, training=cfg.training.model_copy(update={"pp_p2p_overlap": overlap}))
        c = enumerate_candidates(c_cfg)
        codes[overlap] = first_reason(c_cfg, c)
    micro = cfg.training.global_batch // np.maximum(c.mb * c.dp, 1)
    pp2 = (c.pp == 2) & (c.vpp > 1) & (c.ps == 0) & (micro % 2 == 0)  # pp 2 divides m: Megatron's other rule
    assert not (codes[None][pp2] == CODE["interleaved"]).any()
    rows = np.flatnonzero(pp2 & (codes[None] == OK))
    assert len(rows) > 0 and (codes[False][rows] == CODE["interleaved"]).all()
    assert (codes[False][~pp2] == codes[None][~pp2]).all()
    plan = build_plan(candidate_config(c_cfg, c, int(rows[0])))  # the last: overlap off
    assert any(r.startswith("interleaved 1F1B at pp 2 needs") for r in plan.reasons)
