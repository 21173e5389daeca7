"""The search's V-shaped rows (zbv, dualpipev) under activation checkpointing with framework torch:
kept and ranked (neither torchtitan nor torch refuses the combination: meshplan/search/split_ac.py
cites where), counted once by a note naming torchtitan issue #773 and pytorch issue #136766, a
warning under the table where row 1 is one, and the export's header repeating the plan's warning.

The space (8 GPUs of 6 GB, the 8-layer model of tests/test_search.py, micro-batch 4, zero3 kept
gathered after forward, tp 1, cp 1): pp 2 (dp_shard 4) has vpp 1, 2, 4 (the divisors of 8 / 2) and ZB-V
and DualPipeV at vpp 2, 5 candidates per recompute; pp 4 (dp_shard 2) has vpp 1, 2 and the two V rows,
4; pp 1 (dp_shard 8) 1. The V rows are 2 schedules x 2 pp = 4 per recompute, all kept:
``reshard_after_forward`` false, so rule ``v-reshard`` (tests/test_search_v_reshard.py), which would
reject every one of them resharded (FSDP2 over dp_shard), takes none.

Each W of a V row under eager full AC replays its checkpointed layer's forward once per parameter group
(torch 2.13, measured: meshplan.memory.wlag.weight_groups, 9 for this Llama-style layer), so full AC under
ZB-V now loses to interleaved 1F1B here, and the tests that need a V row on row 1 search the V schedules
alone (V_ONLY).

Since the memory timeline counts the V schedules' lagging W passes (tests/test_vshape_memory.py), the two
pp 2 V rows under full AC exceed the 5.4e9 B usable: one layer's output gradients at micro-batch 4 x seq
2048 are g = 2 B x 8192 tokens x (2 x 2048 norms + 2048 + 2 x 512 q k v + 2048 wo + 2 x 5632 w1 w3 +
2048 w2) = 369,098,752 B (meshplan.memory.wlag), and stage 0's head chunk (2 layers and the final norm's
8192 x 2048 x 2 B = 33,554,432) holds them at its W: 5,013,710,848 B (ZB-V's peak before, at the head's
forward) + 2 g + 33,554,432 = 5,785,462,784 B; DualPipeV's stage 0 the same. At pp 4 (one layer a chunk)
the head chunk's W holds g + 33,554,432: 5,268,733,952 B on both, under 5.4e9 (ZB-V's stage 3, 7 lagging
chunk passes, 4,975,067,136 B). So 2 of the 4 full V rows fit, both at pp 4, and DualPipeV's (0.354 s
against ZB-V's 0.379 s) is the V-only row 1 (DPV_PP4)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshplan.report.search import table_lines
from meshplan.report.search_clear import clear_lines
from meshplan.report.search_lines import split_ac_lines
from meshplan.search.driver import search
from meshplan.search.candidate import candidate_config
from meshplan.search.reasons import CODE, OK
from meshplan.search.space import enumerate_candidates
from meshplan.search.split_ac import split_ac_rows
from test_search import config

SPACE = dict(micro_batch=[4], tp=[1], cp=[1], sharding=["zero3"], reshard_after_forward=[False],
             tp_comm_overlap=[False], uneven_stages=[False], pp_schedules=["1f1b", "zbv", "dualpipev"])
ZBV_PP2 = "pp 2 x dp_shard 4, mb 4, full, vpp 2, zero3, zbv"  # kept gathered: pp 2's default (searchraf: was tagged)
DPV_PP4 = "pp 4 x dp_shard 2, mb 4, full, vpp 2, zero3, dualpipev"
VPP4_PP2 = "pp 2 x dp_shard 4, mb 4, full, vpp 4, zero3"
V_ONLY = ["zbv", "dualpipev"]  # no 1F1B or interleaved row to rank above the V rows


def _search(pp, recompute=("none", "full"), schedules=None, **training):
    """Ranked by step alone (``headroom_tier = false``): the ZB-V row keeps under 15% of the usable
    memory free, and the headroom tiers would show its mesh at vpp 4 instead (trial 23), with no
    V schedule for these tests to warn about. ``schedules``: ``[search] pp_schedules`` (SPACE's if None)."""
    space = dict(SPACE, pp_schedules=schedules) if schedules else SPACE
    return search(config(1, 6.0, training=training or None, pp=pp, recompute=list(recompute), headroom_tier=False,
                         **space), workers=1)


def test_rows_counted_by_recompute_mode():
    """Of 4 recompute policies x 10 candidates, the 4 V rows at op (torchtitan mode "selective")
    and the 4 at full: 8. selective is Megatron-LM's core-attention recompute, written to torchtitan as
    mode "none" with flash attention (not counted) and "full" without it (counted: 12)."""
    for flash, want in ((True, 8), (False, 12)):
        cfg = config(1, 6.0, training={"flash_attention": flash}, pp=[1, 2, 4],
                     recompute=["none", "selective", "op", "full"], **SPACE)
        c = enumerate_candidates(cfg)
        rows = split_ac_rows(cfg.training, c)
        assert len(c) == 40 and int(rows.sum()) == want
        assert set(c.ps[rows].tolist()) == {1, 2} and set(c.pp[rows].tolist()) == {2, 4}
        assert not rows[c.ps == 0].any()


@pytest.fixture(scope="module")
def v_top():
    """pp 2 and 4 only (9 candidates per recompute): the recompute-none rows exceed 6 GB (9 of 18
    rejected for memory), so every row shown runs full recompute."""
    return _search([2, 4])


@pytest.fixture(scope="module")
def v_only():
    """The V schedules alone at pp 2 and 4: row 1 is DualPipeV at pp 4 with full recompute (the pp 2 V rows
    exceed usable memory with their lagging W passes: module docstring)."""
    return _search([2, 4], schedules=V_ONLY)


def test_kept_ranked_and_noted_once(v_top):
    """The 4 full V rows are kept and planned, 2 of them (pp 4) fit (the pp 2 ones exceed usable memory
    with their lagging W passes' output gradients: module docstring), ranked below interleaved 1F1B at vpp 4.
    The layer's forward is t_r = 1.411 ms (micro-batch 4 x seq 2048 = 8192 tokens; GEMMs 2 x 8192 x
    45.09e6 weights = 7.39e11 FLOP in 0.959 ms, 0.78 of the 989.4 TFLOP/s peak at these shapes; SDPA
    0.089 ms; eager RMSNorm, RoPE, SiLU, adds 0.363 ms), and ZB-V's W of each of the rank's 4 layers
    (pp 2, 2 chunks of 2) and 4 micro-batches (64 / dp_shard 4 / mb 4) replays it 9 times (2 norms, wq,
    wk, wv, wo, w_gate, w_up, w_down: weight_groups): 4 x 4 x 9 x 1.411 ms = 0.203 s more per rank, on
    the critical path of a schedule whose W fill the bubbles (ZB-V's step went 0.124 -> 0.327 s), so
    interleaved 1F1B at vpp 4 (0.132 s: no split backward, no W replays) ranks first."""
    r = v_top
    # 9 recompute-none rows over memory as before, and the two pp 2 V rows under full AC (5,785,462,784 B)
    assert r.counts()["feasible"] == 7 and r.counts()["memory"] == 11 and r.counts()["v-reshard"] == 0
    assert r.candidates.label(r.top[0].index) == VPP4_PP2
    steps = {r.candidates.label(e.index): e.step_s for e in r.exact.values()}
    t_r = _layer_forward_s(r, ZBV_PP2)
    assert round(t_r * 1e3, 3) == 1.411
    assert steps[ZBV_PP2] > 4 * 4 * 9 * t_r > steps[VPP4_PP2] == r.top[0].step_s  # 0.327 > 0.203 > 0.132 s
    rows = split_ac_rows(r.config.training, r.candidates)
    assert int(rows.sum()) == 4 and (r.code[rows] == OK).sum() == 2  # the 2 full V rows at pp 4 fit
    assert not (r.code == CODE["v-reshard"]).any()
    (note,) = [n for n in r.notes if "#773" in n]
    assert note.startswith("4 candidates (2 feasible) run zbv/dualpipev with activation checkpointing")
    assert "pytorch issue #136766" in note and "[search] recompute = [\"none\"]" in note
    assert split_ac_lines(r) == []  # row 1 runs no V schedule


def _layer_forward_s(r, label) -> float:
    """The forward seconds of the first layer of the candidate ``label`` (a full AC layer's replay)."""
    from meshplan.plan import build_plan
    from meshplan.schedule.workload import chunk_costs, workload_of

    (i,) = [k for k in range(len(r.candidates.pp)) if r.candidates.label(k) == label]
    plan = build_plan(candidate_config(r.config, r.candidates, i))
    c = chunk_costs(plan, workload_of(plan))[0][0].layers[0]
    assert c.seconds("backward_input", recompute=True) == c.seconds("forward")  # eager full AC replays it all
    return c.seconds("forward")


def test_row_1_carries_the_warning(v_only):
    """The line says what the step counts of the slowdown: W's forward replays (eager torch, full AC)."""
    (line,) = split_ac_lines(v_only)
    assert line.startswith(f"warning: row 1 ({DPV_PP4}) runs dualpipev with activation checkpointing (recompute 'full': "
                           "torchtitan activation_checkpoint.mode = \"full\") under framework torch")
    assert "torchtitan issue #773" in line and line.endswith(
        "; the predicted step counts one cause measured on torch 2.13 (each W replays a checkpointed layer's forward "
        "once per parameter group, 9 for a Llama layer), no other")
    assert line in table_lines(v_only)  # the text and the --html page; the pointer is test_search_clear.py's


def test_warning_names_the_first_row_without_it():
    """With pp 1 searched (the V schedules alone beside it), row 1 is dp_shard 8 (no pipeline): no
    warning; the same rows with the DualPipeV row put first: the warning, and the one pointer
    (tests/test_search_clear.py) names dp_shard 8 as the first row shown clear, with both steps."""
    r = _search([1, 2, 4], schedules=V_ONLY)
    labels = [r.candidates.label(e.index) for e in r.top]
    assert labels[0] == "dp_shard 8, mb 4, full, vpp 1, zero3, keep gathered" and labels[1] == DPV_PP4
    assert split_ac_lines(r) == [] and any("#773" in n for n in r.notes)
    swapped = replace(r, top=[r.top[1], r.top[0], *r.top[2:]])
    (line,) = split_ac_lines(swapped)
    assert line.startswith(f"warning: row 1 ({DPV_PP4}) runs dualpipev with activation checkpointing")
    (pointer,) = clear_lines(swapped)
    assert f"; row 2 is the first row shown with none of them ({labels[0]}: peak " in pointer
    assert f"; step {r.top[0].step_s:.3f} s, " in pointer and f"than row 1's {r.top[1].step_s:.3f} s); " in pointer


def test_no_note_without_activation_checkpointing():
    r = _search([2, 4], recompute=("none",))
    assert not split_ac_rows(r.config.training, r.candidates).any()
    assert not any("#773" in n for n in r.notes) and split_ac_lines(r) == []


def test_search_export_repeats_the_plan_warning(tmp_path, capsys):
    from tests.cli_run import run_main

    path = tmp_path / "zbv.toml"
    path.write_text(_toml())
    assert run_main("search", path, "--export", 1, "--to", "meshplan", "-o", tmp_path / "row1.toml") == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert f"warning: row 1 ({DPV_PP4}) runs dualpipev with activation checkpointing" in flat
    head = ("# warning: dualpipev with activation checkpointing (recompute 'full': torchtitan activation_checkpoint.mode = "
            "\"full\") under framework torch: torch's zero-bubble schedules with activation checkpointing are reported "
            "far slower than interleaved 1F1B (torchtitan issue #773")
    assert head in (tmp_path / "row1.toml").read_text()


def _toml() -> str:
    """The v_only search as a config file (the CLI's input)."""
    search_keys = dict(SPACE, pp=[2, 4], recompute=["none", "full"], settle_max=1_000_000, headroom_tier=False,
                       pp_schedules=V_ONLY)

    def val(v):
        if isinstance(v, bool):
            return str(v).lower()
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return f'"{v}"' if isinstance(v, str) else str(v)

    return "\n".join([
        "[model]", 'name = "small"', "layers = 8", "hidden = 2048", "ffn = 5632", "q_heads = 16", "kv_heads = 4",
        "head_dim = 128", "vocab = 32000", "[cluster]", 'system = "dgx-h100"', "nodes = 1", "[cluster.gpu]",
        'name = "h100-small-hbm"', "peak_tflops = { bf16 = 989.4 }", "hbm_gb = 6.0", "hbm_bandwidth_tb_per_s = 3.35",
        "sms = 132", "max_gemm_fraction = 0.803", 'source = "test"', "[training]", "global_batch = 64",
        "seq_len = 2048", "[search]", *(f"{k} = {val(v)}" for k, v in search_keys.items())]) + "\n"

