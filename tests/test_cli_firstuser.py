"""What a fresh user trying the README found (second trial): --calibration on step, compare and
search; a --schedule refusal naming --schedule; compare's unresolved mesh and tensor-degree
advice; reliability's restart note when no micro-batch works; the file modes the README states.

Calibration fixture: ``meshplan calibrate`` of tests/data/nccl/all_reduce_perf_8nodes-x1gpu.txt
(exact alpha 20 us, beta 40 GB/s per NIC, see tests/data/nccl/README.md)."""

from __future__ import annotations

import json
import os
import stat
import re
from pathlib import Path

import pytest

from meshplan.cli import main
from tests.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
NCCL = ROOT / "tests" / "data" / "nccl"
SEED, TP4 = EXAMPLES / "seed-64gpu.toml", EXAMPLES / "seed-64gpu-tp4.toml"


def run(argv, capsys) -> tuple[int, str, str]:
    """``meshplan ARGV`` in this process: (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return done.value.code or 0, out.out, out.err


@pytest.fixture
def nic_cal(tmp_path, capsys) -> Path:
    path = tmp_path / "cal.toml"
    rc, _, err = run(["calibrate", NCCL / "all_reduce_perf_8nodes-x1gpu.txt", "--out", path], capsys)
    assert rc == 0, err
    return path


def _cells(text: str, *keys: str) -> list[str]:
    """The cells of the one rich-table row holding every key."""
    rows = [line for line in text.splitlines() if "│" in line and all(k in line for k in keys)]
    assert len(rows) >= 1, keys
    return [c.strip() for c in rows[0].split("│")[1:-1]]


def _step_ms(text: str) -> float:
    return float(re.search(r"^step ([\d.]+) ms", text, flags=re.M).group(1))  # under --calibration's header line


def _duration_ms(text: str, stream: str, phase: str, op: str) -> float:
    """``duration`` of the first ``stream phase op`` line of step's collective readiness list."""
    for line in text.splitlines():
        f = line.split()
        if f[:3] == [stream, phase, op]:
            return float(f[5])
    raise AssertionError(f"{stream} {phase} {op} not in step's output")


def test_step_and_compare_take_plan_calibration(nic_cal, capsys):
    """The seed (8 nodes x 8 GPUs, 2 NICs per node) with the NIC calibrated at 40 GB/s: each
    rank's bus bandwidth over the network is 2 NICs x 40 GB/s / 8 GPUs = 10 GB/s, below the
    catalog's measured 11.8 GB/s, so the FSDP collectives and the step get longer. A layer's
    all-gather (213,942,272 B over dp_shard 8) sends 7/8 of it: 187,199,488 B / 10 GB/s =
    18.72 ms plus latency; step's duration of that collective is at least plan's table time and at
    most twice it. (nicshare: it was the table time; under torch FSDP2 issues its reduce-scatters on
    their own stream, torch 2.13 _fsdp_param_group.py 89-92, so a backward all-gather runs beside the
    previous layer's reduce-scatter on the same NIC, the two at their max-min fair shares: each
    demand at most 1, its share at least 1/2, so at least half its speed; nothing else of this mesh
    crosses the NIC (tp 8 is inside a node). 29.838 ms of the 18.73 ms table time here.)"""
    rc, plain, _ = run(["step", SEED], capsys)
    assert rc == 0
    rc, cal, err = run(["step", SEED, "--calibration", nic_cal], capsys)
    assert rc == 0, err
    assert _step_ms(cal) > _step_ms(plain) * 1.1
    rc, plan_text, _ = run(["plan", SEED, "--calibration", nic_cal], capsys)
    assert rc == 0
    row = _cells(plan_text, "dp_shard", "backward", "all-gather", "213,942,272")
    time_us, busbw = float(row[-3].replace(",", "")), row[-1]
    assert busbw == "10.0"
    assert time_us == pytest.approx(187_199_488 / 10e9 * 1e6, rel=1e-3)
    shown = _duration_ms(cal, "fsdp", "backward", "all-gather")
    assert time_us / 1e3 - 1e-3 <= shown <= 2 * time_us / 1e3 + 1e-3
    assert _duration_ms(plain, "fsdp", "backward", "all-gather") < shown
    # compare applies it to both configs: the seed's step is step's calibrated one
    rc, text, err = run(["compare", SEED, TP4, "--calibration", nic_cal, "--out", nic_cal.parent / "cmp"], capsys)
    assert rc == 0, err
    assert _cells(text, "step time (s)")[1] == f"{_step_ms(cal) / 1e3:.3f}"


@pytest.mark.slow
def test_search_takes_calibration(tmp_path, capsys):
    """A slower NVLink (8x A100 nccl-tests S15, beta about 209 GB/s, against the H100 catalog
    curve) makes the searched top mesh slower, and its step time is what step predicts for
    the exported row under the same calibration."""
    nv = tmp_path / "nv.toml"
    assert run(["calibrate", NCCL / "all_reduce_perf_8xa100_s15.txt", "--out", nv], capsys)[0] == 0
    mini = EXAMPLES / "mini_2x4_tp2-dp4.toml"
    rc, _, _ = run(["search", mini, "--top", "1", "--json", tmp_path / "a.json"], capsys)
    assert rc == 0
    row = tmp_path / "row.toml"
    rc, _, err = run(["search", mini, "--top", "1", "--json", tmp_path / "b.json", "--calibration", nv,
                      "--export", "1", "--to", "meshplan", "-o", row], capsys)
    assert rc == 0, err
    top = [json.loads((tmp_path / f).read_text())["top"][0]["step_s"] for f in ("a.json", "b.json")]
    assert top[1] > top[0]
    rc, text, err = run(["step", row, "--calibration", nv], capsys)
    assert rc == 0, err
    assert _step_ms(text) == pytest.approx(top[1] * 1e3, abs=0.01)


def test_calibration_help_is_the_same_on_every_command(capsys):
    helps = []
    for cmd in ("plan", "step", "compare", "search"):
        rc, text, _ = run([cmd, "--help"], capsys)
        assert rc == 0
        flat = " ".join(text.replace("│", " ").split())
        # the option's row, not a mention in the command's text (step's names --calibration)
        helps.append(flat[flat.index("--calibration <path>"):].split(" --")[0])
    assert len(set(helps)) == 1 and "meshplan calibrate" in helps[0]


def test_schedule_refusal_names_the_option(tmp_path, capsys):
    # Megatron-LM has no ZB-V (its schedules: 1F1B, interleaved 1F1B)
    rc, out, err = run(["step", EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args", "--cluster", "dgx-h100",
                        "--nodes", "2", "--schedule", "zbv"], capsys)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == ("error: --schedule: zbv is not a Megatron-LM schedule (training.framework "
                                    "\"megatron\" runs 1f1b, or interleaved_1f1b with virtual stages: "
                                    "get_forward_backward_func in megatron/core/pipeline_parallel/schedules.py); use "
                                    "one of them, or training.framework = \"torch\"")
    # the same mesh run by torch: ZB-V's own rule
    toml = tmp_path / "t.toml"
    toml.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 2\n[training]\n'
                    'global_batch = 128\nseq_len = 8192\nsharding = "zero1"\n[mesh]\nnames = ["pp", "dp", "tp"]\n'
                    'shape = [2, 4, 2]\nsequence_parallel = true\n')
    rc, out, err = run(["step", toml, "--schedule", "zbv"], capsys)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == ("error: --schedule: zbv: ZB-V needs virtual_stages = 2 (two chunks per rank, a "
                                    "V), got 1; choose a schedule this mesh allows, or set mesh.virtual_stages = 2 "
                                    "(32 layers / (pp 2 x 2) = 8 per virtual stage)")  # llama3-8b's 32 layers


def test_compare_shows_dash_for_every_quantity_of_an_unresolved_mesh(tmp_path, capsys):
    """The seed with mesh shape [8, 16] needs 128 GPUs of 64: no groups, no collectives, so
    no traffic either (it printed 0.0 GB per link)."""
    bad = tmp_path / "impossible.toml"
    bad.write_text(SEED.read_text().replace("shape = [8, 8]", "shape = [8, 16]"))
    rc, text, err = run(["compare", TP4, bad, "--out", tmp_path / "cmp"], capsys)
    # tp4 fits (peak 69.7 GiB <= 79.11 GiB x 0.9 = 71.2 GiB usable, catalog device_memory_gib): a mesh
    # that fits wins, exit 0 (docs/commands.md "Exit codes"); it was 1 while neither fit (67.1 GiB usable)
    assert rc == 0
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if line.startswith("│")]
    assert rows[0] == ["mesh", "dp_shard 16 x tp 4", "unresolved"]
    assert [r[0] for r in rows[2:7]] == ["step time (s)", "MFU", "peak memory (GiB)", "network GB/rank/step",
                                         "nvlink GB/rank/step"]
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    st = step_time(build_plan(load_config(TP4)))  # the feasible side shows its own step's values
    assert [r[1] for r in rows[2:4]] == [f"{st.step_s:.3f}", f"{st.mfu:.1%}"]
    # torchtitan's FSDP2 units: peak at the head's reduce-scatter (70.2 GiB with one root unit),
    # bytes up by the embedding's backward re-gather (1961.0 and 4315.7 GB before). The vocabulary
    # unpadded (framework torch: 128256 rows, not Megatron's 128512 at tp 4) sends 64 x 8192 =
    # 524,288 elements less per vocab tensor and micro-batch: embedding 2 bf16 gathers + an fp32
    # reduce-scatter, output 1 + 1: 14 B x 524,288 x 15/16 x 32 micro-batches = 0.220 GB, 8/15 on
    # NVLink and 7/15 over the network (2 ranks per node): 1968.4 -> 1968.3, 4324.2 -> 4324.0
    assert [r[1] for r in rows[4:7]] == ["69.7", "1968.3", "4324.0"]
    assert all(r[2] == "-" for r in rows[2:]) and len(rows) == 15  # 8 GEMMs shown for tp4, "-" for impossible
    flat = " ".join(text.split())
    assert "- network bytes sent per rank per step: seed-64gpu-tp4 1968.3 GB, impossible -" in flat
    assert "- nvlink bytes sent per rank per step: seed-64gpu-tp4 4324.0 GB, impossible -" in flat
    assert "0.0" not in flat
    # with a side that fits, the other's reason is in the verdict's reasons (stdout), stderr stays empty
    assert "verdict: seed-64gpu-tp4 (rejected: impossible)" in flat and err == ""
    assert "- impossible (unresolved) is infeasible: dp_shard(8) * tp(16) = 128 != world(64)" in flat


def test_place_bindings_script_is_0755_and_json_0644_as_the_readme_says(tmp_path, capsys):
    """README: every file 0644, the shell scripts 0755 (launch's are checked in test_launch.py),
    whatever the umask (0077 here, which mkstemp-style writes would keep)."""
    mini = EXAMPLES / "mini_2x4_tp2-dp4.toml"
    old = os.umask(0o077)
    try:
        for fmt, want in (("sh", 0o755), ("json", 0o644)):
            path = tmp_path / f"b.{fmt}"
            rc, _, err = run(["place", mini, "--bindings", path, "--format", fmt], capsys)
            assert rc == 0, err
            assert stat.S_IMODE(path.stat().st_mode) == want
    finally:
        os.umask(old)
    readme = " ".join(docs_text().split())
    assert ("Every file is written 0644, except the shell scripts, written 0755 so they run as they are: `launch`'s "
            "`bind.sh`, `torchrun.sh` and `job.sbatch`, and `place --bindings PATH --format sh`") in readme
