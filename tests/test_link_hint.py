"""Newcomer trial hints19: ``meshplan step`` on Llama-3.1-70B at dp_shard 64 x tp 8 on 64
dgx-a100-40gb (micro_batch 1, full recompute, global batch 512: 8 micro-batches).

1. Under ``--overlap-tp`` the hints are the config as written (TP blocking), so each hint's step is
   what ``step`` prints for the config with that hint set; before, they were stepped under the ideal
   overlap (reshard_after_forward false 26.3 s, micro_batch 2 25.6 s) while the configs so changed
   step 27.95 s and 28.42 s (28.20 s until the A100 NVLink curve carried all of S15's rows: at micro_batch 2
   the SP tp all-gathers and reduce-scatters are 8192 x 2 x 8192 x 2 B = 256 MiB, S15's own 256M row,
   194.07 GB/s all-reduce busbw, 1213.6 us each, where the line from its 128M to its 512M row gave 205.0
   GB/s, 1149.0 us).
2. Plain ``step`` exposes fsdp 7.6% and tp 15.7% of its 30.05 s step, under both hints' rules,
   yet each node's NICs are busy 22.15 s of the 23.05 s window with FSDP traffic: one line says so
   with the FSDP knobs re-planned (:mod:`meshplan.schedule.link_hint`), and one says why the TP
   hint is silent (async TP's hidden tp becomes fsdp wait).

Llama-3.1-70B has Llama-3-70B's shapes (its config.json differs in rope_scaling and the context,
which change no cost), so the catalog's ``llama3-70b`` stands for it. Every step compared here
is one ``meshplan step`` run of a config file.
"""

from __future__ import annotations

import re

import pytest

from meshplan.plan import build_plan
from meshplan.config import config_from_dict, load_config
from meshplan.schedule import link_hint
from meshplan.schedule.steptime import step_time
from meshplan.schedule.verdict import rebuilt_step, stream_of
from tests.cli_run import run_main
from tests.configs import job_toml
from tests.conftest import EXAMPLES

#: kvheads: planned with ``[memory] kv_expanded`` true, K and V repeated to the q heads before SDPA (torchtitan
#: before ff0829c): the repeat_kv copies the by-hand chains below count (the default, false, drops them: the
#: trial's step 33173.31 -> 33120.24 ms, -53.07 ms, its 8 micro-batches' copies on the critical path).
TRIAL = job_toml("llama3-70b", system="dgx-a100-40gb", nodes=64,
                 training={"global_batch": 512, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3",
                           "reshard_after_forward": True, "param_dtype": "fp32", "compute_dtype": "bf16",
                           "reduce_dtype": "fp32", "recompute": "full"},
                 mesh={"names": ["dp_shard", "tp"], "shape": [64, 8], "sequence_parallel": True}) \
    + "\n[memory]\nkv_expanded = true\n"


def _config(tmp_path, name: str = "trial", extra: str = ""):
    """The trial's config in ``tmp_path``, each ``key = value`` line of ``extra`` set in [training]
    (replacing the key's line where the trial has one), as a user edits the file."""
    text = TRIAL
    for line in extra.splitlines():
        key = line.split(" = ")[0]
        text, n = re.subn(rf"^{key} = .*$", line, text, flags=re.M)
        text = text if n else text.replace("[mesh]", f"{line}\n\n[mesh]")
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def _step(capsys, *argv) -> list[str]:
    """The lines ``meshplan step ARGV`` prints (exit 0)."""
    assert run_main("step", *argv) == 0
    return capsys.readouterr().out.splitlines()


def _step_ms(lines: list[str]) -> float:
    """The step (ms) on ``step``'s first line."""
    return float(re.match(r"step ([\d.]+) ms", lines[0]).group(1))


def _hints(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("hint:")]


KNOBS = {"training.reshard_after_forward = false": "reshard_after_forward = false",
         "training.micro_batch = 2": "micro_batch = 2"}


def test_overlap_tp_hints_are_the_config_as_written(tmp_path, capsys):
    """``step --overlap-tp`` prints the same ``hint:`` lines as ``step``, after a note naming the
    written config's step, and each hinted step is the step of the config edited so, as ``step``
    prints it (27.95 s and 28.42 s, not the 26.3 s and 25.6 s of the whole-GEMM overlap, when the FSDP
    knobs were hinted; nc49 #11 renamed it from "ideal bound": it is a what-if, not a bound).
    (nicshare4: the written step 30052.45 -> 28323.06 ms under FSDP2's
    reduce-scatters on their own stream sharing the NIC max-min: a backward layer's reduce-scatter
    (22.7564 ms alone, demand 0.7404) and the next layer's all-gather (11.4665 ms, 0.7347) ran one
    after the other, 34.223 ms a layer; now side by side, each at half the NIC: the all-gather 11.4665 x
    0.7347 / 0.5 = 16.848 ms, the reduce-scatter 0.315 ms alone (the copy-out), 16.848 ms at 0.5 /
    0.7404 (11.378 ms of its work) and its 11.064 ms left alone: 28.227 ms, under the layer's 31.03 ms of
    backward compute, which now paces the layer. Each micro-batch's backward unit 2767.518 -> 2554.020
    ms, x 8, the last tail 49.353 -> 27.954 ms: -1729.38 ms. So the step is no longer fsdp-bound: the
    whole-GEMM overlap's step is shorter (26692.93 ms), the async TP hint fires (26.64 s, -5.9%) and the link
    line re-plans the FSDP knobs to none more than 1% shorter: reshard_after_forward false 28.10 s,
    micro_batch 2 28.49 s, each the edited config's step.)
    (es50: torchtitan's full AC replays each layer's closing tp reduce-scatter in backward, 8192 x 8192 x 2
    B = 128 MiB, the table's 0.66718 ms; backward tp reduce-scatters 241 -> 321 a micro-batch. Traced with
    the units' own durations (old rule against new on this config): each of the 8 backward units is 79 x
    0.66718 ms longer, the forward units unchanged, the critical path the same 17 units; exposed tp + 640
    x 0.66718 ms (4714.02 -> 5141.01 ms) and exposed fsdp - 8 x 0.66718 ms (553.31 -> 547.98 ms): one of
    each unit's 80 replays falls in a wait for FSDP the step already had (which layer's: not traced here;
    in the H100 dp16 example, test_link_spill, L79's and L0's copy-in waits). So the step 28323.06 + 632 x
    0.66718 = 28744.72 ms. The edited configs, each ``step``'s run: async TP (compiled: no closing
    collective replayed) 26.64 s unchanged, -7.3%; reshard_after_forward false 28.10 -> 28.53 s and
    micro_batch 2 28.49 -> 29.00 s, both moved by their own replays, not derived here.)
    (nc52fixC: the FSDP all-gathers and reduce-scatters cross nodes and hold NCCL's network rings while
    they run, 2 x 8 HDR NICs = 16 of the A100's 108 SMs (row_shares.nccl_net_channels), beside nearly
    all the compute: the SM contention 8.31 -> 4573.09 ms (read from the model), compute 23055.73 ->
    27620.52 ms, and the longer compute hides more FSDP waits, exposed fsdp 547.98 -> 411.78 ms: the step
    28744.72 + 4564.78 - 136.20 = 33173.31 ms. The edited configs, each ``step``'s run (their own
    contention, not derived here): async TP 26.64 -> 30.31 s; reshard_after_forward false 28.53 -> 31.15 s,
    micro_batch 2 29.00 -> 31.18 s, now each more than 1% shorter than the written config.)"""
    cfg = _config(tmp_path)
    plain = _step(capsys, cfg)
    ideal = _step(capsys, cfg, "--overlap-tp")
    assert _step_ms(plain) == 33173.31 and _step_ms(ideal) < _step_ms(plain)
    rs = next(r for r in build_plan(load_config(cfg)).stage(0).collectives
              if (r.axis, r.phase, r.op) == ("tp", "backward", "reduce-scatter"))
    assert rs.per_microbatch == 321 and round(rs.time_s * 1e3, 5) == 0.66718
    assert round(30052.45 - 8 * (2767.518 - 2554.020) - (49.353 - 27.954), 1) == round(28323.06, 1)
    assert round(28323.06 + 8 * 79 * rs.time_s * 1e3, 2) == 28744.72   # before nc52fixC
    st = step_time(build_plan(load_config(cfg)))
    assert round(st.contention_s() * 1e3, 2) == 4573.09 and st.shown_ms()["exposed fsdp"] == "411.78"
    assert 28744.72 + (4573.09 - 8.31) - (547.98 - 411.78) == pytest.approx(_step_ms(plain), abs=0.02)  # printed figures
    assert (round(11.4665 * 0.7347 / 0.5, 2), round(0.315 + 16.848 + 22.7564 - 0.315 - 16.848 * 0.5 / 0.7404, 2)) \
        == (16.85, 28.23)
    assert _hints(ideal) == _hints(plain) and len(_hints(plain)) == 2
    note = ("note: the verdict and hint lines below are the config as written, TP blocking (step 33173.31 ms), not "
            "--overlap-tp's whole-GEMM overlap: a hint's step is what step prints for the config with it set")
    assert note in ideal and note not in plain
    tp = next(h for h in _hints(ideal) if h.startswith("hint: exposed tp"))
    edited = _config(tmp_path, "async", "tp_comm_overlap = true\ntorch_compile = true\n")
    assert re.search(r": step ([\d.]+) s \(", tp).group(1) == f"{_step_ms(_step(capsys, edited)) / 1e3:.2f}" == "30.31"
    link = next(h for h in _hints(ideal) if "bound by the NICs" in h)
    hinted = dict(re.findall(r"(reshard_after_forward|micro_batch) = (?:false|2) \(step ([\d.]+) s", link))
    hinted = {k + (" false" if k.startswith("reshard") else " 2"): v for k, v in hinted.items()}
    for words, setting in KNOBS.items():
        edited = _config(tmp_path, setting.split()[0], setting + "\n")
        assert hinted[setting.replace(" = ", " ")] == f"{_step_ms(_step(capsys, edited)) / 1e3:.2f}"
    assert hinted == {"reshard_after_forward false": "31.15", "micro_batch 2": "31.18"}


def test_link_bound_line_from_the_nics_bytes(tmp_path, capsys):
    """Each node's 8 NICs carry one rank's FSDP traffic each (dp_shard's ring across nodes, one
    member per GPU, each GPU on its rail's NIC): the sum of rank 0's fsdp rows' bytes per step,
    138.93 GB forward all-gather (134.78 the layers' + 2 x 2.07 the embedding's and output's),
    136.86 GB backward all-gather, 277.86 GB reduce-scatter (fp32) = 553.6 GB at 200 Gb/s = 25 GB/s:
    22.15 s, 96% of the 23.05 s window (stage 0's compute time). The knobs re-planned are the
    FSDP hint's, those that fit and are more than 1% shorter (no_sync's peak 36.9 GiB does not fit
    the 35.5 GiB usable, the A100 40GB's runtime total 42,298,834,944 B x 0.9 = 38,068,951,449.6 B (33.5
    GiB at the datasheet's 40e9 B before hbmswitch); no_sync_unsharded, 51.7 GiB, likewise). Under NIC
    sharing (test_overlap_tp_hints_are_the_config_as_written: the step 28.32 s, each backward layer
    paced by its compute) neither fitting knob is 1% shorter (reshard_after_forward false 28.10 s,
    micro_batch 2 28.49 s): the line says none fits, where it listed 27.95 s (-7.0%) and 28.42 s
    (-5.4%) of a 30.05 s step. (es50: the step 28.32 -> 28.74 s, + 632 x 0.66718 ms
    replayed closing tp reduce-scatters, test_overlap_tp_hints_are_the_config_as_written's trace; the NICs'
    bytes and the window unchanged: the replays are tp, on NVLink, and the window is compute only.)
    (nc52fixC: the window is stage 0's compute time, which now holds the 4573.09 ms of SM contention
    the FSDP rings' 16 of 108 SMs add (test_overlap_tp_hints_are_the_config_as_written): 23.052 ->
    27.616 s, read from the edge-load table, so the NICs are busy 22.15 / 27.62 = 80% of it (96%
    before), still at LINK_BOUND_SHARE 0.8 or over; the step 33.17 s, against which reshard_after_forward
    false (31.15 s, -6.1%) and micro_batch 2 (31.18 s, -6.0%), each the edited config's step, are now
    more than 1% shorter and fit: the line lists them. The FSDP hint stays silent: exposed fsdp
    411.78 ms, 1.2% of the step.)"""
    cfg = _config(tmp_path)
    plan = build_plan(load_config(cfg))
    assert plan.timeline.usable_bytes == 42_298_834_944 * 0.9
    sent = sum(r.sent_bytes_per_step for r in plan.stage(0).collectives if stream_of(r) == "fsdp")
    assert f"{sent / 1e9:.1f}" == "553.6"
    busy = sent / (200e9 / 8)
    lines = _step(capsys, cfg)
    window = re.search(r"\(([\d.]+) s of the [\d.]+ s step: not the step\)", "\n".join(lines)).group(1)
    assert (f"{busy:.2f}", window) == ("22.15", "27.616")
    line = next(x for x in lines if "the step is bound by" in x)
    assert line.startswith(
        f"hint: the step is bound by the NICs' traffic: node 0's NICs (8 of 8 alike, each 553.6 GB per step) busy "
        f"{busy:.2f} s of the 27.62 s window ({busy / float(window):.0%}; stage 0's compute time, the edge-load "
        f"table's; the step is 33.17 s) with fsdp backward reduce-scatter 277.9 GB, fsdp forward all-gather 138.9 GB, "
        f"fsdp backward all-gather 136.9 GB: shorter with training.reshard_after_forward = false (step 31.15 s, -6.1%, "
        f"peak 21.0 GiB fits); training.micro_batch = 2 (step 31.18 s, -6.0%, peak 7.0 GiB fits)")
    # (kvheads: micro_batch 2's peak 6.9 -> 7.0 GiB under kv_expanded true, its saved K and V at the 8 local q heads)
    assert f"{busy / float(window):.0%}" == "80%" and round(1 - 31.15 / 33.17, 3) == 0.061
    # the FSDP hint stays silent: exposed fsdp 2.0% < 15% (7.6% of 30.05 s before NIC sharing: 2282.59 ms)
    assert "exposed fsdp 411.78" in lines[2] and 411.78 / 33173.31 < 0.15  # 547.98 before nc52fixC
    assert not [x for x in lines if x.startswith("hint: exposed fsdp")]


def test_link_share_is_the_named_threshold(tmp_path, monkeypatch):
    """The line appears at :data:`LINK_BOUND_SHARE` = the NICs' busy share and not just above it."""
    plan = build_plan(load_config(_config(tmp_path)))
    st = step_time(plan)
    share = 22.14574 / 27.61646  # busy / window, as the edge-load table holds them (to 1e-5; 23.0517 before nc52fixC)
    fast = rebuilt_step(plan, step_time)
    monkeypatch.setattr(link_hint, "LINK_BOUND_SHARE", share * (1 - 1e-4))
    assert len(link_hint.link_bound_hint(plan, st, fast)) == 1
    monkeypatch.setattr(link_hint, "LINK_BOUND_SHARE", share * (1 + 1e-4))
    assert link_hint.link_bound_hint(plan, st, fast) == []


def test_tp_hint_speaks_once_fsdp_stops_absorbing_it(tmp_path, capsys):
    """Exposed tp is 4.71 s of 30.05 s (15.7% >= 15%), but the config with async TP (and torch.compile,
    which it needs), stepped by ``step``, was 30.03 s: its exposed tp fell to 0.87 s while its exposed
    fsdp rose 2.28 -> 5.47 s, and a note said so instead of a hint. Under NIC sharing (the step 28.32
    s, test_overlap_tp_hints_are_the_config_as_written) the reduce-scatters run beside the all-gathers,
    so the tp async TP hides no longer turns into fsdp wait: 26.64 s, exposed tp 0.87 s, exposed fsdp
    0.55 -> 2.08 s (not 5.47), -5.9%: a hint. (The note's case: tests/test_step_tp_hint.py.)
    es50: eager full AC replays each layer's closing tp reduce-scatter (test_overlap_tp_hints_are_the_config_as_written
    traces it): exposed tp 4714.02 + 640 x 0.66718 = 5141.01 ms of 28744.72 ms, 17.9%; the compiled config
    replays none, 26.64 s unchanged: -7.3%.
    nc52fixC: both configs' compute now holds the FSDP rings' SM contention (16 of the A100's 108 SMs,
    test_overlap_tp_hints_are_the_config_as_written): the written step 33173.31 ms, exposed tp 5141.01 ms
    unchanged, 15.5% (>= 15%); async TP's step 26.64 -> 30.31 s, its exposed fsdp 2.08 -> 0.42 s (its
    longer compute hides the gathers), both read from the model: -8.6%, still a hint."""
    cfg = _config(tmp_path)
    lines = _step(capsys, cfg)
    on = _step(capsys, _config(tmp_path, "async", "tp_comm_overlap = true\ntorch_compile = true\n"))
    parts = dict(re.findall(r"exposed (\w+) ([\d.]+)", on[2]))
    assert (f"{_step_ms(on) / 1e3:.2f}", f"{float(parts['tp']) / 1e3:.2f}", f"{float(parts['fsdp']) / 1e3:.2f}") \
        == ("30.31", "0.87", "0.42")
    assert not [x for x in lines if x.startswith("note: no tp hint")]
    hint = next(x for x in lines if x.startswith("hint: exposed tp"))
    assert hint.startswith(
        "hint: exposed tp is 15.5% of the step (5.14 s of 33.17 s): shorter with training.tp_comm_overlap = true, "
        "training.torch_compile = true (torchtitan's async TP, parallelism.enable_async_tensor_parallel, which needs "
        "torch.compile): step 30.31 s (-8.6%), exposed tp 5.14 -> 0.87 s")
    assert f"{_step_ms(on) / _step_ms(lines) - 1:.1%}" == "-8.6%"
    assert round((4714.02e-3 + 640 * 0.66718e-3) / 33173.31e-3, 3) == 0.155


def test_knobs_not_replanned_twice_and_no_line_on_one_node(capsys, tmp_path):
    """Where the FSDP hint already re-planned the knobs (examples/llama3-70b_256xh100_dp32-tp8.toml at
    recompute "none"), the link line points to it; a one-node mesh (no NIC traffic, NVLink lightly
    loaded) gets none. (nc52fixC: at the example's own selective recompute the FSDP rings' SM contention,
    16 of the H100's 132 SMs beside the compute, 3099.56 ms, hides FSDP waits: exposed fsdp 5755.22 ->
    3195.84 ms, 13.5% of its 23.75 s step, under the FSDP hint's 15%, so the link line there re-plans the
    knobs itself, as a hint. Without recompute the compute is shorter and exposed fsdp 16.0% of the step
    (read from the model): the FSDP hint speaks and the link line is the note pointing to it.)"""
    cfg = tmp_path / "dp32_none.toml"
    text = (EXAMPLES / "llama3-70b_256xh100_dp32-tp8.toml").read_text()
    cfg.write_text(text.replace('recompute = "selective"', 'recompute = "none"'))
    assert 'recompute = "none"' in cfg.read_text()
    selective = _step(capsys, EXAMPLES / "llama3-70b_256xh100_dp32-tp8.toml")
    assert not [x for x in selective if x.startswith("hint: exposed fsdp")]
    assert [x for x in selective if x.startswith("hint: the step is bound by the NICs' traffic")]
    lines = _step(capsys, cfg)
    # kvheads: 16.0 -> 16.1% (3.8 s of 23.74 s), the example's default kv_expanded false: no repeat_kv copies, a
    # shorter compute beside the same fsdp traffic
    assert next(x for x in lines if x.startswith("hint: exposed fsdp")).startswith("hint: exposed fsdp is 16.1% of the step")
    i = next(k for k, x in enumerate(lines) if x.startswith("hint: exposed fsdp"))
    # (the tp note sits between since NIC sharing: async TP -0.6% there, -0.4% before)
    j = next(k for k, x in enumerate(lines) if x.startswith("note: the step is bound by the NICs' traffic"))
    assert j > i and lines[j].startswith("note: the step is bound by the NICs' traffic: node 0's NICs (8 of 8 alike, "
                                         "each 1089.7 GB per step)")
    assert lines[j].endswith("; the FSDP knobs that cut it: the line above")  # the hint line, above it
    one = build_plan(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                                       "training": {"global_batch": 8, "seq_len": 1024},
                                       "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2]}}))
    assert link_hint.link_bound_hint(one, step_time(one), None) == []
