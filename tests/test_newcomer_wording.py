"""Issue 11 follow-ups of a newcomer trial: the wording of search, export, import, calibrate and
bench (one test per finding, asserting the text a user reads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.search.explain import _largest_split
from tests.fsdp2_tail import tail_of

ROOT = Path(__file__).resolve().parents[1]


def test_largest_compute_part_share_is_of_the_unrounded_gap():
    """Finding 2: a part 1 ms of a 1.22 ms compute gap read ``= 100% of the gap``. Here GEMMs
    30 vs 31 ms (1 ms) of compute 50 vs 51.22 ms: 1 / 1.22 = 0.8197, printed 82%, with both
    differences printed so that the share can be checked."""
    a = {"compute": 0.05, "compute_split": {"GEMMs": 0.03, "other": 0.02}}
    b = {"compute": 0.05122, "compute_split": {"GEMMs": 0.031, "other": 0.02022}}
    assert _largest_split(a, b) == "largest: GEMMs 30 ms vs 31 ms = 1 ms of the 1.22 ms gap (82%)"


@pytest.mark.slow
def test_largest_compute_part_of_the_mini_search():
    """The mini example's model on dp_shard 8 at micro-batch 1 against micro-batch 2 (once the
    search's #2; the search's rows are distinct meshes now, so the pair is planned here): the copies
    on the compute stream are issued per micro-batch, so they halve at micro-batch 2 (8 -> 4
    micro-batches), 297 -> 149 ms, and that part's share is of the unrounded compute gap, 148.58 of
    242.84 ms = 61%, with both differences printed so that the share can be checked. Under nic49
    (FSDP2's reduce-scatters on their own stream, one in flight: schedule/unit_events.py, grad_reduce.py
    rs_buffer_wait) the compute of both shrinks in its 'other' part (compute_split's remainder, where
    the slowdown of kernels run beside NCCL's SMs lands), by hand (tests/fsdp2_tail.py's inputs): at
    each backward's end the embedding unit's copy-in (1.0613 ms) used to start beside layer 0's
    reduce-scatter (2.0944 ms, NVLink, 24 of the H100's 132 SMs held: row_shares.nccl_sm_share) once the
    embedding's gradient was done (1.3524 ms at micro-batch 1, 1.4076 at 2), so it ran w = 0.7421 ms
    (0.6868) at 1 - 24/132 of its speed, w x 24/132 = 0.1349 ms (0.1249) of SM contention; now it waits
    for the reduce-scatter (w exposed on fsdp) and runs alone. Micro-batch 1 (8 micro-batches)
    6964.823 -> 6963.744 ms (8 x 0.1349 = -1.079 ms), micro-batch 2 (4) 6721.981 -> 6721.482 ms (4 x
    0.1249 = -0.500 ms), from main's computes (6.964823338 and 6.721981332 s). The gap 242.84 ->
    242.26 ms prints 242 ms; the copies' 148.58 ms (unchanged: GEMMs, attention and
    copies are the same to the bit) of it is 61.3%, still 61%.
    kvheads: derived with K and V repeated to the q heads (torchtitan's ``repeat_kv`` before ff0829c), so
    planned with ``[memory] kv_expanded = true``; at the default no repeat_kv copies run (6.963744 ->
    6.934822 s at micro-batch 1, read from the model) and the FSDP2 copies this is about are unchanged."""
    from dataclasses import replace
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.search.step_parts import compute_split, step_breakdown
    cfg = load_config(ROOT / "examples" / "mini_2x4_tp2-dp4.toml")
    cfg = replace(cfg, memory=cfg.memory.model_copy(update={"kv_expanded": True}))   # kvheads (docstring)
    mesh = cfg.mesh.model_copy(update={"names": ["dp_shard"], "shape": [8], "sequence_parallel": False,
                                       "loss_parallel": False})

    def described(mb):
        plan = build_plan(replace(cfg, mesh=mesh, training=cfg.training.model_copy(update={"micro_batch": mb})))
        st = step_time(plan, Overlap())
        return {"compute": step_breakdown(st)["compute"], "compute_split": compute_split(plan, st), "plan": plan}
    one, two = described(1), described(2)
    for got, main_s, m in ((one, 6.964823338, 8), (two, 6.721981332, 4)):   # nic49 (docstring)
        tail = tail_of(got["plan"])[0]
        assert tail.m == m and tail.copy_in > tail.w > 0   # the copy-in outlasts the reduce-scatter's rest
        assert got["compute"] == pytest.approx(main_s - m * 24 / 132 * tail.w, abs=2e-9)
    copies = "copies on the compute stream"
    assert two["compute_split"][copies] == pytest.approx(one["compute_split"][copies] / 2, rel=1e-4)
    assert _largest_split(one, two) == ("largest: copies on the compute stream 297 ms vs 149 ms = 149 ms of the "
                                        "242 ms gap (61%)")


def test_megatron_fsdp_without_ckpt_format_says_unset():
    """Finding 3: a Megatron FSDP import without --ckpt-format noted ``--ckpt-format torch_dist``,
    a value the file does not give: it says the format is unset (Megatron-LM's default applies);
    a format given is still named."""
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.megatron import read
    args = ((ROOT / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text()
            .replace("--use-distributed-optimizer", "--use-megatron-fsdp").replace("--pipeline-model-parallel-size 2", ""))
    opts = ImportOptions(cluster="dgx-h100", nodes=2)
    (note,) = [n for n in read(args, opts).notes if "--ckpt-format" in n]
    assert note == ("--ckpt-format unset (Megatron-LM's default applies) with --use-megatron-fsdp: Megatron-LM (d98e8a6) "
                    "asserts --ckpt-format fsdp_dtensor under Megatron FSDP (arguments.py); planned all the same, add "
                    "--ckpt-format fsdp_dtensor to run it")
    (note,) = [n for n in read(args + "--ckpt-format torch\n", opts).notes if "--ckpt-format" in n]
    assert note.startswith("--ckpt-format torch with --use-megatron-fsdp: ")


def test_megatron_export_says_recompute_activations_is_expressed(tmp_path, capsys):
    """Finding 4: ``export --to megatron`` of the example arguments listed ``--recompute-activations
    (switch) -> dropped`` while it wrote ``--recompute-granularity selective``, which is what
    Megatron-LM makes of the switch (arguments.py ``validate_args``)."""
    from cli_run import run_main
    out = tmp_path / "again.args"
    code = run_main("export", ROOT / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args", "--cluster",
                    "dgx-h100", "--nodes", "2", "--to", "megatron", "-o", out)
    text = out.read_text()
    assert code == 0 and "\n--recompute-granularity selective\n" in text and "\n--recompute-activations" not in text
    (line,) = [h for h in text.splitlines() if h.startswith("# written otherwise")]
    assert line.endswith("(the plan's value or spelling): --recompute-activations (switch) -> expressed as "
                         "--recompute-granularity selective")


S3 = ROOT / "tests" / "data" / "nccl" / "all_reduce_perf_8xh200_s3.txt"


def test_calibrate_one_size_log_counts_sizes(tmp_path, capsys):
    """Finding 5: an nccl-tests log of one size (S3's 1 MiB row alone) said ``2 usable rows``
    (its out-of-place and in-place columns): it counts the sizes a fit needs, 1 of 2."""
    from cli_run import run_main
    lines = S3.read_text().splitlines()
    one = tmp_path / "one.txt"
    one.write_text("\n".join(ln for ln in lines if ln.startswith("#") or ln.split()[0] == "1048576") + "\n")
    code = run_main("calibrate", one, "--out", tmp_path / "c.toml")
    assert (code, capsys.readouterr().err) == (2, "error: one.txt: 1 usable size (1048576 B); measure at least two "
                                                  "sizes (nccl-tests -b 8 -e 1G -f 2)\n")


def test_calibrate_reports_a_missing_input_before_an_existing_out(tmp_path, capsys):
    """Finding 7: with --out an existing file and the log missing, calibrate said ``--out ... exists``
    first; the input is checked first (and --out is still refused, unchanged, for a good input)."""
    from cli_run import run_main
    out = tmp_path / "c.toml"
    out.write_text("mine\n")
    code = run_main("calibrate", tmp_path / "missing.txt", "--out", out)
    assert (code, capsys.readouterr().err) == (2, f"error: NCCL_TESTS_OUTPUT: no such file "
                                                  f"'{tmp_path / 'missing.txt'}'; pass nccl-tests output (stdout text "
                                                  "or -J JSON)\n")
    code = run_main("calibrate", S3, "--out", out)
    assert code == 2 and capsys.readouterr().err.startswith(f"error: --out: {out} exists; ")
    assert out.read_text() == "mine\n"


def _without(path: Path, prefix: str, tmp_path: Path, extra: str = "") -> Path:
    out = tmp_path / path.name
    out.write_text("".join(ln for ln in path.read_text().splitlines(True) if not ln.startswith(prefix)) + extra)
    return out


def test_seq_len_notes_are_the_same_for_torchtitan_and_megatron(tmp_path):
    """Finding 6: --seq-len says the same on a torchtitan and a Megatron-LM import: it replaces the
    file's value (both examples hold 8192), or stands where the file has none. Without either,
    torchtitan's own default (job_config.py ``Training.seq_len = 2048``) is planned and said so,
    while Megatron-LM has none: a one-line error naming --seq-length and --seq-len."""
    from meshplan.errors import ConfigError
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    tt = ROOT / "examples" / "torchtitan_llama3-8b_8xh100.toml"
    mg = ROOT / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args"
    opts = lambda nodes, seq=None: ImportOptions(cluster="dgx-h100", nodes=nodes, seq_len=seq)
    seq_notes = lambda cfg: [n for n in cfg.notes if "seq" in n.split(":", 1)[1].split(";")[0]]
    assert seq_notes(load_any(tt, opts=opts(1, 4096))) == ["torchtitan: --seq-len 4096 replaces training.seq_len 8192"]
    assert seq_notes(load_any(mg, opts=opts(2, 4096))) == ["megatron: --seq-len 4096 replaces --seq-length 8192"]
    tt0 = _without(tt, "seq_len", tmp_path)
    mg0 = _without(mg, "--micro-batch-size", tmp_path, "--micro-batch-size 1 --global-batch-size 128\n")
    cfg = load_any(tt0, opts=opts(1, 4096))
    assert cfg.training.seq_len == 4096 and seq_notes(cfg) == [
        "torchtitan: --seq-len 4096: training.seq_len not in the job TOML"]
    cfg = load_any(mg0, opts=opts(2, 4096))
    assert cfg.training.seq_len == 4096 and seq_notes(cfg) == ["megatron: --seq-len 4096: --seq-length not in the arguments"]
    cfg = load_any(tt0, opts=opts(1))
    assert cfg.training.seq_len == 2048 and seq_notes(cfg) == [
        "torchtitan: training.seq_len not in the job TOML: torchtitan's default 2048 planned; give --seq-len N for another"]
    with pytest.raises(ConfigError) as e:
        load_any(mg0, opts=opts(2))
    assert str(e.value) == "--seq-length: not in the arguments; add it or give --seq-len"


@pytest.mark.parametrize("cmd, table, toml", [("gemm", "CSV table for --gemm-table", "out/bench/gemm.toml"),
                                              ("attention", "JSON table for --gemm-table", "out/bench/attention.toml")])
def test_bench_out_help_names_the_grid_fragment(cmd, table, toml):
    """Finding 8: ``bench gemm --help`` said --out is a CSV table, but with --grid it is the kernels.toml
    fragment (``_grid_out``: the default path with .toml); ``bench attention`` said JSON alike."""
    from typer.testing import CliRunner

    from meshplan.cli import app
    text = " ".join(CliRunner().invoke(app, ["bench", cmd, "--help"], env={"COLUMNS": "400"}).output.split())
    assert (f"--out <path> {table}, or with --grid a kernels.toml fragment (default with --grid {toml}; both under "
            f"out/, which git ignores) [default: {toml[:-5]}.{'csv' if cmd == 'gemm' else 'json'}]") in text
