"""Wording and defaults a newcomer tripped on (issue 11, newcomer trial 3, findings 6 and 7):
each test runs the command and asserts the text it prints."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshplan.cli import app, main
from tests.conftest import EXAMPLES

#: Llama 3 8B on one DGX H100 at dp 4 x tp 2, ZeRO-1, full recompute; each test sets the runtime.
ZERO1 = """[model]
catalog = "llama3-8b"

[cluster]
system = "dgx-h100"
nodes = 1

[training]
global_batch = 64
seq_len = 8192
micro_batch = 1
sharding = "{sharding}"
recompute = "full"
{extra}

[mesh]
names = ["{axis}", "tp"]
shape = [4, 2]
sequence_parallel = true
"""


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "1000"})


def _config(tmp_path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _train_line(out: str) -> str:
    return next(x for x in out.splitlines() if x.startswith("train "))


@pytest.mark.parametrize("mine, extra, words", [
    ("torch", "", 'recompute full (torchtitan full activation checkpointing (activation_checkpoint.mode = "full": every '
         "TransformerBlock's input kept, the block recomputed in backward))"),
    ("megatron", 'framework = "megatron"', "recompute full (Megatron-LM full recompute (--recompute-granularity full "
     "--recompute-method uniform --recompute-num-layers 1: every layer's input kept, the layer recomputed in "
     "backward))"),
    ("deepspeed", 'zero12_engine = "deepspeed"', "recompute full (DeepSpeed activation checkpointing "
     "(deepspeed.checkpointing.checkpoint on every transformer layer: its input kept, the layer recomputed in "
     "backward))"),
])
def test_full_recompute_in_the_runtimes_own_words(tmp_path, mine, extra, words):
    """Finding 1: under torch (FSDP2, ZeRO-3) the plan header named Megatron-LM's flag first;
    each runtime (torch, megatron and DeepSpeed at ZeRO-1) now names its own setting, and only it."""
    sharding, axis = ("zero3", "dp_shard") if mine == "torch" else ("zero1", "dp")
    cfg = ZERO1.format(extra=extra, sharding=sharding, axis=axis)
    r = _cli("plan", _config(tmp_path, cfg))
    assert r.exit_code == 0, r.output
    line = _train_line(r.output)
    assert words in line
    others = {"torch": "activation_checkpoint.mode", "megatron": "--recompute-granularity",
              "deepspeed": "deepspeed.checkpointing"}
    assert [k for k, v in others.items() if v in line] == [mine]


def test_overlap_tp_that_saves_nothing_names_the_stream_the_step_waits_on():
    """Finding 2: the seed's 64-GPU mesh (tp 4, FSDP over the network) is bound by fsdp: the
    ideal TP overlap hides 14028.31 - 3561.00 ms of tp and the step stays 324728.40 ms. (nicshare4: the
    step 331379.79 -> 324728.40 ms under FSDP2's reduce-scatters beside the all-gathers, each backward unit
    103.440 ms shorter x 64 and the last tail 31.203 ms shorter, tests/test_compare.py
    test_same_mesh_other_recompute_is_weighed_as_the_knob; the ideal overlap's exposed fsdp 272012.83 ->
    265361.45 ms by the same 6651.38 ms (to the printed 0.01). Exposed tp is the same to 1e-9 ms (14028.3139 blocking): its
    printed 0.01 ms moves with the parts line's rounding to the step's total, largest remainder,
    StepTime.shown_ms, as the other parts' remainders moved.) (nc52fixC: the FSDP all-gathers and
    reduce-scatters cross the 8 nodes and now hold 16 of the H100's 132 SMs while they run,
    row_shares.nccl_net_channels: 6099.58 ms of SM contention, compute 55805.95 -> 61905.53 ms, the
    step 324728.40 -> 324731.95 ms (test_compare's seed pair: each backward unit 0.055 ms longer), and
    under the ideal overlap the longer compute hides more of the fsdp stream: exposed fsdp 265361.45 ->
    259265.42 ms; the saving still 0.00 ms.) (kvheads: the repeat_kv copies are planned only with
    ``[memory] kv_expanded``, false here: Llama-3-70B's SDPA reads its 1 local KV head as it is
    (enable_gqa); 2.034 ms of copies a micro-batch x 64 and the SM contention they met: compute
    61905.53 -> 61762.21 ms, the fsdp stream still the bound: the step the same, exposed fsdp
    259265.42 -> 259408.74 ms.)"""
    r = _cli("step", EXAMPLES / "seed-64gpu.toml", "--overlap-tp")
    line = next(x for x in r.output.splitlines() if x.startswith("tp overlap (--overlap-tp)"))
    assert line.endswith("exposed tp 3561.00 ms (blocking: 14028.31 ms), compute 61762.21 ms (blocking: 61762.21 ms), "
                         "step 324731.95 ms (blocking: 324731.95 ms): saves 0.00 ms per step: the step is bound by the "
                         "fsdp stream (exposed fsdp 259408.74 ms on stage 0), which the compute stream waits for "
                         "either way: the tp time hidden becomes fsdp wait")
    assert "exposed communication on stage 0: fsdp 259408.74 ms, tp 3561.00 ms" in r.output


def test_overlap_tp_that_saves_time_gives_no_reason():
    r = _cli("step", EXAMPLES / "mini_2x4_tp2-dp4.toml", "--overlap-tp")
    line = next(x for x in r.output.splitlines() if x.startswith("tp overlap (--overlap-tp)"))
    # eager DTensor TP's host pace (kernels.toml [host]) takes part of what the overlap hides: before it,
    # step 7128.18 ms (blocking: 7381.43 ms): saves 253.25 ms. (nicshare: both 8.46 ms shorter, the saving the
    # same: FSDP2's reduce-scatters on their own stream, each layer's re-gather beside the previous layer's
    # reduce-scatter, the backward's kernels under fewer SM-holding intervals, -0.528 ms a backward x 16
    # micro-batches, test_search_configured's 7.424 -> 7.416 s; 7336.75 / 7424.41 before). (kvheads: no
    # repeat_kv copies without [memory] kv_expanded, the SDPA reading the 4 local KV heads as they are: each
    # layer's 2 x 41,943,040 B forward and backward at 2.97 TB/s, 56.5 us, 1.808 ms a micro-batch, half of it
    # taken back by the eager DTensor host pace the device cannot outrun (28.92 ms over 16 micro-batches with
    # the pace zeroed): 7328.29 / 7415.95 -> 7313.82 / 7401.49 ms)
    assert line.endswith("step 7313.82 ms (blocking: 7401.49 ms): saves 87.67 ms per step")


def test_deepseek_bubble_headline_says_what_it_is_and_the_critical_stages_idle():
    """Finding 3: DeepSeek-V3 (pp 16, 1F1B, m 120): 0.1217 idle/ideal is the schedule's bubble on
    the busiest stage (stages 1-14 tie within float noise: 4 is listed); stage 0, where the step ends, is idle
    33044.49 of 46272.87 ms: 0.7141 of the step, 33044.49 / (46272.87 - 33044.49) = 2.4980 as
    idle/ideal, printed beside it. (Dropless routing with its count all-gathers timed, issue 11
    moemore: before, capacity factor 1 and no count exchange, 32991.72 of 46223.70 ms. fid175:
    Megatron-LM 2022's p2p calls' syncs, stage 0's 120 + 15 calls x 3 x 4.7 us = 1.90 ms of compute
    13013.91 -> 13015.81 ms, and the last stage's loss scale multiply and its backward, 120 x 9.4 us
    there, of which 0.01 ms reaches stage 0's bubble: the step 46270.96 -> 46272.87 ms; the tie among
    stages 1-14 now falls on 4, was 10. recomp48: the shared expert's activation counted at its own
    width, 2,048, not its fused gate/up GEMM's 4,096 columns (compute.elementwise.activation_elements):
    per MoE layer and micro-batch its forward, full recompute's replay and backward move 8,388,608 x
    2 B x (3 + 3 + 5) = 184.5 MB less, 62 us at H100's Triad 2.97 TB/s, so stages 1-14 (4 MoE layers
    each) take 343.24 -> 342.99 ms per micro-batch; stage 0's bubble carries that about 133 times (120
    micro-batches and the 13 stages between): 33044.49 -> 33011.37 ms, step 46272.87 -> 46239.76 ms,
    stage 0 idle 33011.37 / 46239.76 = 0.7139, 33011.37 / 13228.39 = 2.4955 as idle/ideal; the tie
    among stages 1-14 now falls on 12.) mcore48: the example plans Megatron Core (megatron_runtime
    "core"): stage 0's get_batch per micro-batch (b 1, s 4096, tp 1: no broadcast) copies tokens,
    labels and position ids (32,768 B each, 3 x (0.5201 + 5.7) us over PCIe 5.0), the loss mask
    (16,384 B, 0.2601 + 5.7) and the loader's boolean mask (16,777,216 B, 266.3050 + 5.7): 296.6254 us,
    where 2022 copied 32,776 B (6.2203 us), built the mask on the GPU (ones, tril, < 0.5: 67, 134 and
    84 MB at Triad 2.97 TB/s, 22.5956 + 45.1912 + 28.2445 us), the loss mask and position ids at the
    4.7 us floor, and synchronised 6 times in forward and 2 in backward: 149.2516 us; 120 x 147.3738 us
    = +17.6849 ms; the 11 step timers' 22 syncs (-0.1034 ms) and 2 of the 3 syncs of each of stage 0's
    135 p2p calls (-1.2690 ms) go: compute 13015.81 + 17.6849 - 1.3724 = 13032.12 (13032.13 printed,
    from unrounded parts); the middle stages run no get_batch at all, so stage 0 waits less: bubble
    33044.49 -> 33007.38 ms; the step 46272.87 -> 46252.08 ms; stages 1-14 now tie exactly, the first
    (1) listed. Merged (int, both): the two effects add, the bubble 33044.49 - 33.12 (recomp48) - 37.11 (mcore48)
    = 32974.26 (32974.27 printed, from unrounded parts); stages 1-14 342.99 ms less their get_batch
    (0.15 ms) = 342.84 ms a micro-batch; the step 13032.13 + 32974.27 + 43.00 + 169.57 = 46218.97 ms;
    stage 0 idle 32974.27 / 46218.97 = 0.7134 of the step, 32974.27 / 13244.70 = 2.4896 as idle/ideal."""
    r = _cli("step", EXAMPLES / "deepseek-v3_2048xh100_pp16-ep64-dp128.toml")
    head = next(x for x in r.output.splitlines() if x.startswith("bubble "))
    assert head.startswith("bubble 0.1217 as idle/ideal, 0.1085 as idle/total (the schedule's bubble fraction, on the "
                           "busiest stage 1, pipeline only; the step's parts below are on stage 0, where the step "
                           "ends: bubble 32974.27 ms is its idle, 0.7134 of the step (2.4896 as idle/ideal))")
    assert "step on stage 0 = compute 13032.13 + bubble 32974.27 + exposed dp 43.00 + exposed pp 169.57 = 46218.97 ms" \
        in r.output
    per_core = 3 * (0.5201 + 5.7) + 0.2601 + 5.7 + 266.3050 + 5.7
    per_2022 = 6.2203 + 22.5956 + 45.1912 + 28.2445 + 2 * 4.7 + 6 * 4.7 + 2 * 4.7
    assert (round(per_core, 4), round(per_2022, 4)) == (296.6254, 149.2516)
    assert round(13015.81 + (120 * (per_core - per_2022) - 22 * 4.7 - 135 * 2 * 4.7) / 1e3, 2) == 13032.12
    assert round(33044.49 - 33.12 - 37.11, 2) == 32974.26
    assert round(32974.27 / 46218.97, 4) == 0.7134 and round(32974.27 / (46218.97 - 32974.27), 4) == 2.4896


def test_deepspeed_search_labels_the_engine_rule_by_the_engine_planned(tmp_path):
    """Finding 4: a search of the DeepSpeed ZeRO-2 example (current DeepSpeed's ZeRO-1/2 engine,
    zero3_engine left at fsdp2), widened to pp and cp 1 or 2, named ``zero3_engine deepspeed-2021``
    first in the engine rule's label; it names the engine planned alone, each engine's rule with
    its own rows (issue 11: 216 zero1/zero2 rows by ZeRO-1/2's rule, 240 zero3 rows by ZeRO-3's, 456 in all:
    228 before the search varied DeepSpeed ZeRO++ hpZ, which doubles the 12 zero3 rows of dp_shard 16 kept
    gathered, the only ones of that rule with the data axis the world of 2 nodes: search/space.py hpz_applies)."""
    path = _deepspeed_zero2(tmp_path)
    path.write_text(path.read_text().replace("pp = [1]", "pp = [1, 2]").replace("\ncp = [1]", "\ncp = [1, 2]"))
    r = _cli("search", path)
    out = " ".join(r.output.split())
    assert ("rejected, rule 'engine' (zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 "
            "with zero2, overlap_comm, vpp > 1 or a schedule other than 1F1B): 216") in out
    assert ("rejected, rule 'engine' (zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 "
            "or parameters kept gathered): 240") in out
    assert "deepspeed-2021" not in r.output


def test_search_names_the_zero12_data_axis_dp_as_plan_does(tmp_path):
    """Finding 5: the DeepSpeed ZeRO-2 example imports to mesh ``dp 16`` and ``plan`` prints ``mesh
    (dp 16)``; its search listed the same zero1/zero2 meshes as ``dp_shard 16``. Now ZeRO-1/2 runs
    (replicated parameters) say ``dp 16``, ZeRO-3 runs (sharded) ``dp_shard 16``; the predicted
    steps are those of before the rename (5.798 s for the zero2 run). Since the rows are distinct
    meshes (9db001f) the one data axis is one row, its zero3 run (5.752 s, the lowest peak within 1%);
    the zero1/zero2 runs are its variants (``--json`` top_variants), and a search narrowed to
    zero1/zero2 lists the zero2 run as row 1. (nc52fixC: DeepSpeed ZeRO-3's overlapped gathers and
    reduce-scatters cross the 2 nodes and now hold 16 of 132 SMs beside the compute: its run 5.752 ->
    6.003 s (test_deepspeed_zero3_knobs), more than 1% over the zero1 run's 5.761 s, so no longer in
    the row; ZeRO-1/2 reduce their buckets at the step's end, beside no compute, unchanged. Row 1 is
    the dp 16 zero2 run, 5.798 s, first of the two within 1% by the search's tie rule, its variant the zero1 run.)"""
    ds = _deepspeed_zero2(tmp_path)
    plan = _cli("plan", ds).output
    assert "mesh (dp 16)  canonical ('dp',)" in plan
    r = _cli("search", ds, "--json", tmp_path / "s.json")
    rows = _table_rows(r.output)
    # the zero3 row is DeepSpeed's ZeRO-3, without FSDP2's compute-stream copies (zero3_engine "deepspeed"),
    # copying out only its prefetched part (5.768 s when it copied out every gathered byte)
    # kvheads: 5.798 -> 5.769 s, no repeat_kv copies ([memory] kv_expanded false: HF's SDPA takes the 8 KV
    # heads with enable_gqa): 2 x 2 x 41,943,040 B a layer at 2.97 TB/s, 56.5 us x 32 layers x 16 micro-batches
    assert [(x[1].strip(), x[5].strip(), x[8].strip()) for x in rows] == [("dp 16", "zero2", "5.769")]
    doc = json.loads((tmp_path / "s.json").read_text())
    runs = {(next(a for a in ("dp", "dp_shard") if a in v["mesh"]), v["sharding"]): round(v["step_s"], 3)
            for v in doc["top_variants"]}
    # within 1% of row 1's 5.769 s (5.761 and 5.798 before kvheads, the same 28.9 ms less); the zero3 run is not
    assert runs == {("dp", "zero1"): 5.732}
    # the variants line names that run in its own words, under row 1's dp 16
    line = " ".join(r.output.split("row 1's mesh (dp 16)", 1)[1].split("goodput (Daly")[0].split())
    assert "1a mb 1, none, vpp 1, zero1 (5.732 s" in line
    narrowed = tmp_path / "zero12.toml"
    narrowed.write_text(ds.read_text().replace('sharding = ["zero1", "zero2", "zero3"]',
                                               'sharding = ["zero1", "zero2"]'))
    r = _cli("search", narrowed, "--export", "1", "--to", "meshplan", "-o", tmp_path / "row1.toml")
    assert r.exit_code == 0, r.output
    rows = _table_rows(r.output)
    assert [(x[1].strip(), x[5].strip(), x[8].strip()) for x in rows] == [("dp 16", "zero2", "5.769")]  # as above
    assert "mesh (dp 16)" in _cli("plan", tmp_path / "row1.toml").output


def _table_rows(output: str) -> list[list[str]]:
    """The top table's rows of a search's text, as (#, mesh, mb, recompute, vpp, sharding, knobs, peak, step)."""
    lines = [x for x in output.splitlines() if x.startswith("│ ") and x.split("│")[1].strip().isdigit()]
    return [x.split("│")[1:10] for x in lines]


def _deepspeed_zero2(tmp_path) -> Path:
    """The DeepSpeed ZeRO-2 example imported to a TOML (Llama 3 8B, 2 DGX H100, dp 16, seq 4096)."""
    r = _cli("import", "deepspeed", EXAMPLES / "deepspeed_zero2_16xh100.json", "--model", "llama3-8b", "--cluster",
             "dgx-h100", "--nodes", "2", "--seq-len", "4096", "-o", tmp_path / "ds.toml")
    assert r.exit_code == 0, r.output
    return tmp_path / "ds.toml"


def test_zero2_plan_prints_no_zero3_leftovers(tmp_path):
    """Finding 6: a ZeRO-2 plan (nothing gathered, no pipeline) printed a prefetch setting, a
    "layers gathered ... 0.00 GiB" term and, in the HTML report, a pipeline timeline at pp 1.
    The estimate is the ZeRO paper's stage-2 state, 2 psi + (2 + 12) psi / 16 with psi
    8.03026e9 = 2.3087e10 B = 21.50 GiB, plus the activations (no recompute: the JSON has no activation_checkpointing section); the zero3 mini example keeps both."""
    ds = _deepspeed_zero2(tmp_path)
    out = _cli("plan", ds).output
    assert ("first estimate (constraints, before the timeline): stage 0: state 21.50 GiB + activations 22.54 GiB "
            "= 44.04 GiB") in out.splitlines()
    assert "prefetch" not in out and "gathered" not in out.split("first estimate")[1].split("\n")[0]
    assert 2 * 8.03026e9 + 14 * 8.03026e9 / 16 == pytest.approx(21.50 * 2**30, rel=1e-3)
    zero3 = _cli("plan", EXAMPLES / "mini_2x4_tp2-dp4.toml").output
    assert "+ gathered FSDP layers 0.41 GiB = 37.90 GiB" in zero3 and "prefetch 1 unit(s)" in zero3
    r = _cli("report", ds, "--out", tmp_path / "ds.html")
    assert r.exit_code == 0, r.output
    page = (tmp_path / "ds.html").read_text()
    assert "Step time" in page and "Predicted pipeline timeline" not in page and "pipeline timeline" not in page


@pytest.mark.parametrize("schedule", ["gpipe", "zbv"])
def test_schedule_at_pp_1_says_it_changes_nothing(schedule):
    """Finding 7: ``step --schedule`` at pp 1 was taken silently (zbv refused for its virtual
    stages); like ``--overlap-tp`` at tp 1, one note and exit 0, the step that of no schedule."""
    plain = _cli("step", EXAMPLES / "mini_2x4_tp2-dp4.toml")
    r = _cli("step", EXAMPLES / "mini_2x4_tp2-dp4.toml", "--schedule", schedule)
    assert r.exit_code == 0, r.output
    notes = [x for x in r.output.splitlines() if x.startswith("note: --schedule")]
    assert notes == [f"note: --schedule {schedule} changes nothing: pp 1 has no pipeline to schedule"]
    # 7424.41 ms before nicshare: 16 micro-batches x -0.528 ms (test_overlap_tp_that_saves_time_gives_no_reason);
    # 7415.95 before kvheads: no repeat_kv copies (the same test)
    first = "step 7401.49 ms (no pipeline, m 16); critical stage 0; mesh dp_shard 4 x tp 2"
    assert r.output.splitlines()[0] == plain.output.splitlines()[0] == first


def test_launch_defaults_under_out_and_points_at_its_own_choose(tmp_path, monkeypatch, capsys):
    """Finding 8: ``launch`` without ``--out`` wrote ``launch/`` in the current folder (README:
    defaults go under out/), and its warning sent the user to ``place --choose``. tp 4 as the
    outer axis on 2 DGX H100 nodes: each tp group {0, 4, 8, 12} spans both nodes."""
    cfg = _config(tmp_path, ZERO1.format(extra="", sharding="zero3", axis="dp_shard")
                  .replace("nodes = 1", "nodes = 2").replace('names = ["dp_shard", "tp"]', 'names = ["tp", "dp_shard"]')
                  .replace("shape = [4, 2]", "shape = [4, 4]"), "across.toml")
    monkeypatch.chdir(tmp_path)
    r = _cli("launch", cfg, "--", "python", "train.py")
    assert r.exit_code == 0, r.output
    folder = Path("out/launch/across")
    assert sorted(p.name for p in folder.iterdir()) == ["bind.sh", "bindings.json", "job.sbatch", "torchrun.sh"]
    assert not Path("launch").exists() and f"wrote {folder / 'bind.sh'}" in r.output
    warning = next(x for x in r.output.splitlines() if x.startswith("warning: tp 4 fits the 8-GPU node"))
    assert warning.endswith("put tp innermost (meshplan launch --choose)") and "place --choose" not in r.output
    assert _cli("launch", cfg, "--", "python", "train.py").exit_code == 0  # uxsmall: its own folder, unchanged
    (folder / "notes.txt").write_text("mine")  # the folder now holds a file meshplan did not write: refused
    with pytest.raises(SystemExit) as again:  # main(): the error as the shell shows it, exit 2
        main(["launch", str(cfg), "--", "python", "train.py"])
    assert again.value.code == 2 and capsys.readouterr().err.strip() == (
        f"error: --out: {folder} exists; choose another path or pass --force to replace it (meshplan replaces "
        f"only what it wrote under out/ itself, unchanged since)")
    assert (folder / "notes.txt").read_text() == "mine"
    assert _cli("launch", cfg, "--force", "--", "python", "train.py").exit_code == 0


def test_no_feasible_line_and_html_split_the_engine_rule_as_the_counts(tmp_path):
    """Issue 11 (newcomer trial 6) item 2: the DeepSpeed ZeRO-2 example searched at cp 2 only
    (neither DeepSpeed engine runs cp > 1): 48 candidates, 24 zero1/zero2 rows refused by
    ZeRO-1/2's rule and 24 zero3 rows (12 x reshard_after_forward true/false) by ZeRO-3's. The
    counts split them; the no-feasible-mesh line, its JSON and the HTML page showed one 'engine'
    rule of 48 with both texts joined."""
    import html
    import json
    import re
    path = _deepspeed_zero2(tmp_path)
    path.write_text(path.read_text().replace("\ncp = [1]", "\ncp = [2]"))
    r = _cli("search", path, "--html", tmp_path / "s.html", "--json", tmp_path / "s.json")
    z12 = ("zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 with zero2, overlap_comm, "
           "vpp > 1 or a schedule other than 1F1B")
    z3 = "zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 or parameters kept gathered"
    line = f"no feasible mesh: of 48 candidates rule 'engine' rejected 24 ({z12}), 'engine' 24 ({z3}); fix: "
    out = " ".join(r.output.split())
    assert r.exit_code == 1 and line in out and f"rejected, rule 'engine' ({z12}): 24" in out \
        and f"rejected, rule 'engine' ({z3}): 24" in out
    doc = json.loads((tmp_path / "s.json").read_text())["no_feasible_mesh"]
    assert doc["rules"] == [{"rule": "engine", "rejected": 24, "text": z12}, {"rule": "engine", "rejected": 24, "text": z3}]
    page = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", (tmp_path / "s.html").read_text())).split())
    assert line in page and f"engine 24 {z12} engine 24 {z3}" in page
    assert f"{z12} 24 50.0%" in page and f"{z3} 24 50.0%" in page and "; zero3 rows" not in page
