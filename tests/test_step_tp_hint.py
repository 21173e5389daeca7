"""The step's exposed-TP ``hint:`` line (newcomer trial 16 #2, meshplan/schedule/tp_hint.py): the
config re-planned with ``training.tp_comm_overlap`` (and ``torch_compile`` under torch where it
is off), shown where exposed tp is 15% of the step or more and the re-plan is more than 1%
shorter. Each hinted step is compared with the same config edited by hand and planned directly."""

from __future__ import annotations

import tomllib

import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.tp_hint import tp_hint
from meshplan.schedule.verdict import rebuilt_step
from meshplan.schedule.workload import chunk_costs, workload_of
from tests.cli_run import run_main
from tests.conftest import EXAMPLES

MINI = EXAMPLES / "mini_2x4_tp4-dp2.toml"
DP16 = EXAMPLES / "llama3-70b_128xh100_dp16-tp8.toml"


def _plan(path, **training):
    data = tomllib.loads(path.read_text())
    data["training"] |= training
    return build_plan(config_from_dict(data))


def _hint(p):
    return tp_hint(p, step_time(p), rebuilt_step(p, step_time))


def test_compiled_mini_mesh_is_told_async_tp_and_its_step():
    """Llama-3-8B, dp_shard 2 x tp 4, compiled: exposed tp 1288.41 ms of a 7933.67 ms step =
    16.2% >= 15% (the parts line's figures). With tp_comm_overlap (compile already on, so the one knob) the config planned by
    hand steps 7.41 s, 6.6% shorter (> 1%), its exposed tp 0.50 s, peak 27.2 GiB. 7908.43 ms since FSDP2's
    reduce-scatters run on their own stream (Overlap.fsdp_rs_queue, torch 2.13 _fsdp_param_group.py 89-92):
    each layer's all-gather is issued beside the previous layer's reduce-scatter instead of after it (L30's
    at 7.301 ms, not 7.938 ms), so the two hold their SMs at once and the backward's kernels run under
    fewer collective-holding intervals: the backward unit's SM contention 2.2604 -> 1.4716 ms, the unit
    161.398 -> 160.610 ms, x 32 micro-batches = -25.24 ms of compute (6627.52 -> 6602.28 ms); exposed tp
    and fsdp unchanged (1288.41, 17.74 ms), so 16.3% of the step and the same hint, -6.3%. (kvheads: no
    repeat_kv copies, ``[memory] kv_expanded`` false: 2 x 41,943,040 B a layer at tp 4, 28.24 us x 32 layers x
    32 micro-batches = 28.92 ms: the step 7908.43 -> 7879.50 ms, compute 6602.28 -> 6573.36 ms, exposed tp
    1288.41 -> 1288.40 ms (the parts' rounding); async TP's 7.41 -> 7.38 s: 16.4%, -6.4%.)"""
    p = _plan(MINI, torch_compile=True)
    st = step_time(p)
    shown = st.shown_ms()  # the parts line's figures
    assert (shown["exposed tp"], shown["step"]) == ("1288.40", "7879.50")
    on = step_time(_plan(MINI, torch_compile=True, tp_comm_overlap=True))
    assert f"{on.step_s:.2f} {on.exposed_s['tp']:.2f}" == "7.38 0.50"
    line, = _hint(p)
    assert line == ("hint: exposed tp is 16.4% of the step (1.29 s of 7.88 s): shorter with training.tp_comm_overlap = "
                    "true (torchtitan's async TP, parallelism.enable_async_tensor_parallel, which needs torch.compile): "
                    f"step 7.38 s ({on.step_s / st.step_s - 1:+.1%}), exposed tp 1.29 -> 0.50 s, peak 27.2 GiB fits")
    assert f"{on.step_s / st.step_s - 1:+.1%}" == "-6.4%"


def test_eager_config_gets_torch_compile_with_async_tp():
    """examples/llama3-70b_128xh100_dp16-tp8.toml is eager: async TP needs torch.compile, so the
    re-plan sets both (the config edited so by hand: 1.48 s against 1.65 s, -10.7%); exposed tp is
    328.57 ms of 1652.08 ms = 19.9% (before es50 and nc52fixC 300.97 ms of 1437.39 ms = 20.9%, -2.0%;
    1460.14 ms, 20.6% and 1.44 s, -1.6% while FSDP2's reduce-scatters
    shared the all-gathers' queue: on their own stream, Overlap.fsdp_rs_queue, the next layer's prefetch
    no longer waits behind each reduce-scatter, the two sharing the NIC instead: the backward unit
    1040.775 -> 1025.970 ms, its exposed fsdp 25.341 -> 10.557 ms, and its reduce-scatter tail past it
    18.448 -> 10.504 ms: -14.805 - 7.944 = -22.75 ms of the step).
    es50: torchtitan's full AC runs ``early_stop=False``, so each of the 80 layers' eager replay re-runs
    its closing tp reduce-scatter (128 MiB, the table's 0.34073 ms; backward tp reduce-scatters 241 ->
    321 a micro-batch, 1 micro-batch): exposed tp + 80 x 0.34073 = + 27.26 ms (on int, without nc52fixC:
    300.97 -> 328.23 ms, the step 1437.39 + 78 x 0.34073 = 1463.97 ms, two replays falling in FSDP waits).
    nc52fixC: fsdp's cross-node all-gathers and reduce-scatters hold 16 of the H100's 132 SMs while they
    run (NCCL's 2 rings per NIC, row_shares.nccl_net_channels), beside nearly all the compute (on the
    branch without es50: the step 1437.39 -> 1631.43 ms, 197.96 ms of SM contention, exposed tp 301.31 ms,
    exposed fsdp 27.90 ms). Both (the merge): exposed tp 301.31 + 80 x 0.34073 = 328.57 ms, exposed fsdp
    27.90 ms as on the branch (the longer compute hides the FSDP waits the replays fell in), and the SM
    contention 197.96 -> 191.36 ms, read from the model: the replayed reduce-scatters run on the compute
    stream, so the fsdp collectives beside them overlap 27.26 ms less kernel time; the step
    1631.43 + 27.26 - 6.60 = 1652.08 ms (compute 1295.61 + 27.90 + 328.57). The compiled config (its
    partitioner drops the closing collective from the replay) is the branch's, 1475.23 ms:
    1475.23 / 1652.08 - 1 = -10.7%, and 328.57 / 1652.08 = 19.9% (>= 15%)."""
    p = _plan(DP16)
    st = step_time(p)
    rs = next(r for r in p.stage(0).collectives if r.axis == "tp" and (r.phase, r.op) == ("backward", "reduce-scatter"))
    assert rs.per_microbatch == 321 and round(rs.time_s * 1e3, 5) == 0.34073
    assert round((st.exposed_s["tp"] - 80 * rs.time_s) * 1e3, 2) == 301.31
    # kvheads: the repeat_kv copies gone (3 x 12.71 us a layer x 80 = 3.05 ms, test_link_spill): the step 1652.08 ->
    # 1649.03 ms, its contention 191.36 -> 191.35 ms; async TP's 1475.23 -> 1472.21 ms, still -10.7%
    assert round(st.contention_s() * 1e3, 2) == 191.35 and st.shown_ms()["exposed fsdp"] == "27.90"
    assert round(st.step_s * 1e3, 2) == 1649.03  # the docstring's sum less the copies, to the printed figures' rounding:
    assert 1631.43 + 80 * rs.time_s * 1e3 - (197.96 - 191.36) - 3.05 == pytest.approx(st.step_s * 1e3, abs=0.03)
    both = step_time(_plan(DP16, torch_compile=True, tp_comm_overlap=True))
    line, = _hint(p)
    assert line.startswith("hint: exposed tp is 19.9% of the step (0.33 s of 1.65 s): shorter with "
                           "training.tp_comm_overlap = true, training.torch_compile = true (")
    assert f"step {both.step_s:.2f} s (-10.7%)" in line and f"{both.step_s:.2f}" == "1.47"
    assert round(1472.21 / 1649.03 - 1, 3) == -0.107


def test_no_hint_under_the_share_or_within_one_percent_or_already_on():
    """The eager mini mesh exposes 12.3% on tp (< 15%): none. The trial's mesh, Llama-3-70B at seq
    32768, dp_shard 2 x cp 4 x tp 8, full recompute, compiled, exposes 16.4% but async TP's
    decomposed GEMMs add back most of what it hides (step 36.79 -> 36.72 s, -0.2%, within 1%):
    no hint, a note saying so (its exposed tp 6.03 -> 3.85 s, compute 2.33 s more). A config with tp_comm_overlap on: none.
    (Was 16.3%, 36.98 -> 36.91 s, before torch's ring SDPA calls were rated one by one,
    meshplan.compute.ring_attention.ring_seconds: cp rank 0 at L 8,192, 8 heads, one causal call
    (FA2 333/318 TFLOP/s at S 8192) and 3 unmasked 4096 x 8192 (fwd 370, bwd 310 at 4,096 queries)
    against one causal 8192 x 32768 call at 335/322, forward twice under full AC: -90.6 us a layer,
    x 80 layers x 20 micro-batches = -0.145 s of the -0.147 s.) (Was 36.83 -> 36.76 s before the block
    was one cp rank's, meshplan.compute.ring_attention.slowest_rank: rank 0's SDPA as above, now with
    rank 0's ring bytes, compiled, in Q elements: forward 12 + 3 x 9 + 4 x 2 = 47, backward 12 + 27 +
    (16 + 3 x 10) x 2 = 131, the forward replayed by full AC: 2 x 47 + 131 = 225, where rank 3's
    2 x 50 + 134 = 234 were counted: -9 x 8 heads x 8192 x 128 B / 2.97 TB/s = -25.4 us a layer,
    x 80 x 20 = -0.041 s.) Since torch's ring traffic is the table's (issue 11, cp_attention "ring":
    spec.axes.cp.ring_rows) the trial's mesh, cp 4 across nodes, exposes 10.54 s of cp a step (0.36 s
    under all-gather CP's rows; the compute unchanged): 36.79 - 0.36 + 10.54 = 46.97 s, of which tp is
    12.8%, under the share: no hint. Under all-gather CP (cp_attention = "allgather", without the ring's
    kernels: 35.92 s) it exposes 16.8% and async TP gives 35.85 s (-0.2%): the note. Since the rank
    timeline shares NICs (schedule/nic_fair.py NicBook) the ring's K/V all-gathers, issued beside
    the prefetched FSDP all-gathers on the same NICs, run at most at their fair half: exposed cp 10.54 ->
    15.99 s, the step 52.41 s, of which tp (6.03 s) is 11.5%, under the share: no hint (async TP +0.0%);
    all-gather CP's gathers likewise, exposed cp 0.36 -> 1.07 s, 36.63 s, tp 16.5%: the note, 36.56 s.
    Since FSDP2's reduce-scatters run on their own stream (Overlap.fsdp_rs_queue) and sharing is max-min
    fair both ways (nic_fair.NicBook, the earlier slowed by the later too), a backward's reduce-scatters
    run beside its prefetched all-gathers and the ring's K/V transfers on the same NICs: each backward
    unit's exposed cp 538.0 -> 699.1 ms, fsdp 0 -> 7.3 ms (the unit 1873.62 -> 2041.96 ms): exposed cp
    15.99 -> 19.76 s, fsdp 0.19 -> 0.33 s, the step 56.32 s, of which tp (6.03 s) is 10.7%: no hint
    (async TP +0.3%: its decomposed GEMMs, compute +2.33 s, outweigh the 2.18 s of tp it hides); all-gather
    CP: exposed cp 1.07 -> 1.48 s, 37.17 s, tp 16.2%: the note, 37.10 s.
    Since all-gather CP's one causal 8192 x 32768 call is rated at its loop lengths
    (meshplan.compute.attention: the backward's blocks of keys loop over the rank's 8,192 queries,
    FA2 bwd 318 at S 8192 where 322 was held from 16k): 2.5 x 4 pair (1/318 - 1/322) = +53.7 us a
    layer, x 80 x 20 = +0.086 s of compute: 36.71 s, tp 16.4%, the note, 36.65 s. (nicshare4: both
    together, all-gather CP's step 37.17 + 0.086 = 37.26 s, tp 16.2%, the note, 37.10 + 0.086 = 37.19 s;
    the ring's step unchanged, its calls rated at their own loop lengths already.)
    Since torch.compile's ring backward waits its K/V all-gather and every dK/dV shift at once
    (schedule.ring_timeline.compiled_ring_backward; the trial's mesh is compiled): per layer and
    micro-batch the backward's gather (2.152 ms over the NICs, the table's) and its 4 shifts (1.434 ms
    each), 7.888 ms, are all exposed, of which the ring's steps hid part before: exposed cp 15.99 ->
    23.63 s (+7.64 s, at most 80 x 20 x 7.888 ms = 12.62 s), the step 60.06 s, of which tp (6.03 s)
    is 10.0%, under the share: no hint (async TP +0.0%, 60.07 s) (cp50, without NIC sharing).
    Both together (the merge of nic50 and cp50): the compiled backward's blocking waits add the same
    +7.64 s of exposed cp on top of NIC sharing's 19.76 s (the gather and shifts now wait at once, so
    what NIC sharing slowed is waited for either way): exposed cp 27.40 s, the step 56.32 + 7.64 =
    63.97 s, of which tp (6.03 s) is 9.4%: no hint (async TP +0.2%, 64.11 s).
    nc52fixC: NCCL's network collectives now hold their channels' SMs as the NVLink ones do (16 of 132
    on a DGX H100, row_shares.nccl_net_channels), and this mesh's fsdp and cp collectives cross nodes:
    the ring's compute gains 2.58 s of SM contention, the step 63.97 -> 65.94 s, exposed cp 27.40 ->
    26.81 s (more of it beside the longer compute), tp 6.03 s = 9.1%: no hint (async TP +0.6%, 66.31 s).
    All-gather CP's K/V gathers cross nodes too (3.86 s of contention): its exposed cp
    1.48 -> 1.14 s, the step 40.75 s, tp 6.03 s = 14.8%, under the share: no hint and no note (async TP 41.02 s)."""
    eager = _plan(MINI)
    st = step_time(eager)
    assert round(st.exposed_s["tp"] / st.step_s, 3) == 0.123 and _hint(eager) == []
    data = tomllib.loads((EXAMPLES / "seed-64gpu.toml").read_text())
    data["cluster"]["system"] = "dgx-h100"
    data["training"] |= {"seq_len": 32768, "global_batch": 40, "recompute": "full", "torch_compile": True}
    data["mesh"] |= {"names": ["dp_shard", "cp", "tp"], "shape": [2, 4, 8]}
    # kvheads: at the 1 local KV head the ring's default moves (enable_gqa) exposed cp collapses, the step 41.93 s,
    # tp 14.4% of it, still under the share: no hint; the figures below are at K and V repeated to the 8 q heads
    # ([memory] kv_expanded true), the sizes they were derived at
    at_kv = build_plan(config_from_dict(data))
    st = step_time(at_kv)
    assert round(st.step_s, 2) == 41.93 and round(st.exposed_s["tp"] / st.step_s, 3) == 0.144 and _hint(at_kv) == []
    data["memory"] = {"kv_expanded": True}
    trial = build_plan(config_from_dict(data))
    st = step_time(trial)
    data["training"]["tp_comm_overlap"] = True
    on = step_time(build_plan(config_from_dict(data)))
    assert round(st.exposed_s["tp"] / st.step_s, 3) == 0.091 and f"{on.step_s / st.step_s - 1:+.1%}" == "+0.6%"
    # 56.32, 19.76 before the compiled backward waited its ring collectives (60.06, 23.63 with it, without
    # NIC sharing; 52.41, 15.99 with neither); 46.97, 10.54 before NIC sharing
    assert (round(st.step_s, 2), round(st.exposed_s["cp"], 2)) == (65.94, 26.81)  # 63.97, 27.40 before nc52fixC
    assert 0 < st.exposed_s["cp"] - 19.76 <= 80 * 20 * (2.152 + 4 * 1.434) * 1e-3
    assert round(56.32 + (23.63 - 15.99), 2) == 63.96 and round(19.76 + 23.63 - 15.99, 2) == 27.40  # the two add
    pair = 8 * 8192 ** 2 * 256
    layer = 2 * pair * (1 / 333 + 3 / 370 - 4 / 335) + 2.5 * pair * (1 / 318 + 3 / 310 - 4 / 322)
    assert round(80 * 20 * layer / 1e12, 3) == -0.145
    merge = -9 * 8 * 8192 * 128 / 2.97e12
    assert round(80 * 20 * merge, 3) == -0.041
    assert _hint(trial) == []  # under the share
    assert f"{on.step_s:.2f} {on.exposed_s['tp']:.2f}" == "66.31 3.85"  # 64.11 before nc52fixC, 60.07 cp50 alone, 56.47 nic50 alone, 52.43 neither
    ring = st
    data["training"] |= {"tp_comm_overlap": False, "cp_attention": "allgather"}
    gather = build_plan(config_from_dict(data))
    st = step_time(gather)
    # ring against all-gather CP: compute differs by the ring's SDPA calls rated one by one (layer, above)
    # and rank 0's compiled ring bytes, 225 n_q a layer (n_q = 8 x 8192 x 128) at 2.97 TB/s: 80 x 20 x
    # (-90.6 + 635.5) us = -0.145 + 1.017 = 0.872 s, less all-gather CP's backward at L (+0.086 s): 0.786 s;
    # every other part but exposed cp the same
    n_q = 8 * 8192 * 128
    layer_ag = layer - 2.5 * pair * 4 * (1 / 318 - 1 / 322)   # all-gather CP's backward at L (S 8192): 318
    hand = 80 * 20 * (layer_ag / 1e12 + 225 * n_q / 2.97e12)
    assert round(80 * 20 * (layer - layer_ag) / 1e12, 3) == 0.086 and round(hand, 3) == 0.786
    # and, since nc52fixC, each side's SM contention under its network collectives (the ring's fsdp and
    # shifts 2.58 s, all-gather CP's fsdp and K/V gathers 3.86 s): 0.786 - 1.274 = -0.488 s
    slow = ring.contention_s() - st.contention_s()
    assert round(slow, 3) == -1.274
    assert ring.parts_s()["compute"] - st.parts_s()["compute"] == pytest.approx(hand + slow, abs=5e-4)
    assert {k: v for k, v in ring.parts_s().items() if k not in ("compute", "exposed cp")} == pytest.approx(
        {k: v for k, v in st.parts_s().items() if k not in ("compute", "exposed cp")}, rel=1e-12)
    # so the ringrank step (36.98 - 0.145 - 0.041 = 36.79 s) is the ring's step with all-gather CP's exposed cp
    # (36.79 before NIC sharing; since, all-gather CP's own exposed cp is 0.36 -> 1.07 s: its gathers beside FSDP's)
    assert round(36.98 - 0.145 - 0.041, 2) == 36.79 and round(st.exposed_s["cp"], 2) == 1.14  # 1.48 before nc52fixC, 1.07 before fsdp_rs_queue
    assert round(ring.step_s - ring.exposed_s["cp"] + st.exposed_s["cp"], 2) == 40.27  # 65.94 - 26.81 + 1.14 (38.04 before nc52fixC)
    data["training"]["tp_comm_overlap"] = True
    on = step_time(build_plan(config_from_dict(data)))
    # all-gather CP: exposed tp 6.03 s of 40.75 s = 14.8%, under the share since nc52fixC: no hint and no
    # note (16.2% of 37.26 s before: the note, async TP's decomposed GEMMs, hints19 #2)
    assert round(st.exposed_s["tp"] / st.step_s, 3) == 0.148 and _hint(gather) == []
    assert f"{on.step_s:.2f} {on.exposed_s['tp']:.2f}" == "41.02 3.85"  # 37.19 before nc52fixC, 35.85 before NIC sharing, 36.56 before fsdp_rs_queue, 37.10 before the call's loop lengths
    assert _hint(_plan(MINI, torch_compile=True, tp_comm_overlap=True)) == []


def test_step_prints_the_hint_and_its_json_verdict_holds_it(tmp_path, capsys):
    """``meshplan step`` prints the line among its hints and ``--json``'s verdict lists it."""
    import json
    cfg = tmp_path / "mini-compiled.toml"
    cfg.write_text(MINI.read_text().replace("[training]", "[training]\ntorch_compile = true"))
    assert run_main("step", cfg, "--json", tmp_path / "s.json") == 0
    out = capsys.readouterr().out
    hint = next(line for line in out.splitlines() if line.startswith("hint: exposed tp"))
    assert hint in json.loads((tmp_path / "s.json").read_text())["verdict"]


def test_megatron_runs_its_own_overlap_without_compile():
    """The trial's mesh under framework megatron (bf16 parameters, no torch.compile): exposed tp
    5550.65 ms of a 30286.17 ms step = 18.3% (5502.85 before calib37 put Megatron-LM 2022's get_batch tp
    broadcasts, 0.75 ms, on tp instead of compute); Megatron-LM's --tp-comm-overlap (the config edited
    by hand: tp_comm_overlap alone) 27.43 s, -9.4%. (tep2p: cp 4 runs Megatron-LM's default, Transformer
    Engine's p2p ring, not all-gather CP: the step was 30546.22 = compute 24351.09 + exposed cp 308.09 +
    fsdp 383.44 + tp 5503.60; now compute 24352.08 + fsdp 383.44 + tp 5550.65, cp 0: each K/V send of
    4 MiB runs beside an attention step; tp +47.05 ms: the QKV input's re-gather for its weight gradient,
    which ran beside the K/V projections' wait for the dK/dV reduce-scatter, now waits alone before them;
    compute +0.99 ms: the NVLink tp collectives' SM share over other kernels; the hint was 18.0%, 27.44 s, -10.2%.)
    (ringshape: TE's ring's 4 calls per layer rated at their shapes, L 32768 / 4 = 8,192, 8 q heads of d 128,
    pair = 2 x 8192^2 x 8 x 128 FLOP a call; cp rank 0: forward the causal L x L at 602 and 3 L/2 x L
    over 8,192 keys at 646, backward 559 and 3 x 542 over 4,096 queries; before, one causal call at the
    held 616 / 561. Forward pair (1/602 + 3/646 - 4/616) = -25.90 us, twice under full AC; backward 2.5
    pair (1/559 + 3/542 - 4/561) = +66.61 us: +14.81 us a layer, x 80 layers x 20 micro-batches = +23.70 ms:
    the step 30286.17 -> 30309.87 ms; tp_comm_overlap 27.43 -> 27.46 s, still -9.4%.)
    (tering2: TE's correction kernels counted, as memory-bound ops at H100's Triad, each kernel floored
    at the 4.7 us issue floor (their bytes by hand: test_te_ring_steps.py): on the slowest cp rank the
    forward's lse and output corrections 55.959 us + the K/V ring buffer copy 4.700 us = 60.659 us,
    replayed under full AC; the backward's dQ/dK/dV accumulation 83.718 us + its K/V buffer copy
    4.700 us = 88.418 us: 2 x 60.659 + 88.418 = 209.736 us a layer, x 80 layers x 20 micro-batches
    = +335.58 ms of compute, nothing else moving (the calls per step sum to the same; exposed tp and
    fsdp unchanged): the step 30309.87 -> 30645.45 ms; with tp_comm_overlap the same kernels, 27.46 ->
    27.79 s: -9.3% (27.79 / 30.65 - 1), exposed tp 18.1% of the step (5.55 / 30.65).) (nicshare: under max-min
    sharing both ways, nic_fair.NicBook, the FSDP all-gathers and reduce-scatters are slowed by the K/V
    sends beside them too, where before only the sends were: with tp_comm_overlap the backward's fsdp
    queue (a reduce-scatter of 7.975 ms and an all-gather of 4.000 ms a layer against 12.6 ms of
    compute before tering2, some 0.6 ms of slack a layer, 0.15 ms more with TE's correction kernels)
    loses part of that slack to the sends' share of the NIC: exposed fsdp 383.44 -> 582.07 ms, compute
    26396.39 and exposed tp 1011.49 ms unchanged, so the step 27791.32 -> 27989.95 ms (+198.63 ms, the
    fsdp exposure's move alone; 790.61 ms before tering2's 0.149 ms of compute a backward layer gave the
    fsdp queue more slack): 27.99 s, -8.7% (27.99 / 30.65 - 1). Without tp_comm_overlap the fsdp queue
    has the slack of the exposed tp: 30645.45 ms unchanged. Its backward unit settles at the 3rd pass
    (unit_sim.settle).)
    27.79 s: -9.3% (27.79 / 30.65 - 1), exposed tp 18.1% of the step (5.55 / 30.65).)
    (testreams: TE runs the forward's softmax_lse corrections of steps 0-2 on its other flash stream
    beside calls 1-3 (context_parallel.py lines 1678, 1919; compute.te_ring.side_stream): 3 floored
    4.7 us kernels hidden, the forward's corrections 60.659 -> 46.559 us, replayed under full AC:
    2 x 14.1 us x 80 x 20 = -45.12 ms, the step 30645.45 -> 30600.33 ms; tp_comm_overlap 27.75 s,
    -9.3%, exposed tp 18.1% (5.55 / 30.60).)
    (175B audit: Megatron-LM's backward_step scales the loss, optimizer.scale_loss, a multiply and its
    backward on the last stage, here every rank at pp 1: 2 x 4.7 us x 20 micro-batches = +0.188 ms,
    the step 30600.33 -> 30600.52 ms.)
    (nicshare4, both together: with tp_comm_overlap compute 26396.39 - 45.12 + 0.188 = 26351.45 ms and
    exposed tp 1011.49 ms as main's; the step is compute + exposed fsdp + exposed tp, so it less its
    exposed fsdp is main's 27746.38 - 383.44 = 27362.94 ms. Exposed fsdp 582.07 -> 604.35 ms: the
    backward's replayed forward is 2 x 14.1 us a layer shorter (testreams), 45.12 ms of compute a step
    less for the NIC-shared fsdp queue to hide under, of which 22.28 ms now shows (at most all 45.12
    ms can: the queue's own work is unchanged): 27.97 s, -8.6% (27.97 / 30.60 - 1).)
    (nc52fixC: NCCL's network collectives now hold their channels' SMs, 16 of 132 on a DGX H100
    (row_shares.nccl_net_channels), and this mesh's fsdp gathers and reduce-scatters and TE's K/V sends
    cross nodes, beside most of the compute: SM contention 3018.12 ms, compute 24666.43 -> 27298.46 ms,
    exposed fsdp 383.44 -> 383.33 ms, the step 30600.52 -> 33232.44 ms; exposed tp 5550.65 ms unchanged,
    16.7% of the step; with tp_comm_overlap compute 29576.27 ms (3912.59 ms of contention), exposed
    fsdp 604.35 -> 383.33 ms (the longer compute hides the queue again), tp 1011.49 ms: 30.97 s, -6.8%.)"""
    data = tomllib.loads((EXAMPLES / "seed-64gpu.toml").read_text())
    data["cluster"]["system"] = "dgx-h100"
    data["training"] |= {"seq_len": 32768, "global_batch": 40, "recompute": "full", "framework": "megatron",
                         "param_dtype": "bf16"}
    data["mesh"] |= {"names": ["dp_shard", "cp", "tp"], "shape": [2, 4, 8]}
    p = build_plan(config_from_dict(data))
    st = step_time(p)
    pair = 2 * 8192 ** 2 * 8 * 128
    per_layer = (2 * pair * (1 / 602e12 + 3 / 646e12 - 4 / 616e12)
                 + 2.5 * pair * (1 / 559e12 + 3 / 542e12 - 4 / 561e12))
    assert round(80 * 20 * per_layer * 1e3, 2) == round(30309.87 - 30286.17, 2) == 23.70
    layer = chunk_costs(p, workload_of(p, False))[0][0].layers[0]
    te = {(o.phase, o.name): o.seconds for o in layer.ops if o.name.startswith("cp p2p")}
    fwd = te[("forward", "cp p2p out correction")] + te[("forward", "cp p2p K/V buffer copy")]
    bwd = te[("backward_input", "cp p2p gradient correction")] + te[("backward_input", "cp p2p K/V buffer copy")]
    assert [round(x * 1e6, 3) for x in (fwd, bwd)] == [46.559, 88.418]   # 60.659 before testreams: 3 x 4.7 us
    assert sum(te.values()) == pytest.approx(2 * fwd + bwd, rel=1e-12)   # the forward's replayed once
    assert round(80 * 20 * (2 * fwd + bwd) * 1e3, 2) == round(30600.33 - 30309.87, 2) == 290.46
    assert (st.shown_ms()["exposed tp"], st.shown_ms()["step"]) == ("5550.65", "33232.44")   # 30600.33 + 0.188 before nc52fixC
    assert "exposed cp" not in st.shown_ms()
    data["training"]["tp_comm_overlap"] = True
    on = step_time(build_plan(config_from_dict(data)))
    line, = _hint(p)
    assert line.startswith("hint: exposed tp is 16.7% of the step (5.55 s of 33.23 s): shorter with "
                           "training.tp_comm_overlap = true (Megatron-LM's --tp-comm-overlap, Transformer Engine "
                           f"userbuffers): step {on.step_s:.2f} s (-6.8%), exposed tp 5.55 -> {on.exposed_s['tp']:.2f} s")
    assert f"{on.step_s:.2f}" == "30.97"  # 27.97 before nc52fixC, 27.79 before nicshare, 27.99 before testreams
    assert {k: f"{v * 1e3:.2f}" for k, v in on.exposed_s.items() if v} == {"fsdp": "383.33", "tp": "1011.49"}
    # the step less its exposed fsdp is compute + exposed tp: 29576.27 + 1011.49 ms (27746.38 - 383.44 =
    # 27362.94 before nc52fixC's 3912.59 ms of network SM contention)
    assert on.step_s * 1e3 - on.exposed_s["fsdp"] * 1e3 == pytest.approx(29576.27 + 1011.49, abs=0.01)  # each to 0.01 ms
    assert 0 < 604.35 - 582.07 < 45.12
