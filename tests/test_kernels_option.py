"""--kernels FILE (and a config's [kernels] files): a `bench gemm --grid` fragment laid over the
catalog's kernel data for one run (issue 11): its bf16 points replace the catalog's, the step's
compute moves by what the model's GEMMs take, and the step names the data it used; bad input is
one line naming --kernels."""

import json
import shutil
from pathlib import Path

import pytest

from meshplan import catalog
from meshplan.compute.gemm import gemm_time
from meshplan.compute.kernel_fragment import kernel_data, with_kernel_files
from meshplan.compute.measured import kernel_data as catalog_kernel_data
from meshplan.errors import ConfigError
from tests.cli_run import plan_file, run_main

grid = pytest.importorskip("meshplan.runtime.bench.grid")  # fragment_toml: the writer `bench --grid` uses (torch)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "mini_2x4_tp2-dp4.toml"  # llama3-8b, 1 x 8 H100, dp_shard 4 x tp 2, pp 1, m 16
GPU = "h100-sxm5-80gb"


def _fragment(tmp_path, gpu=GPU, factor=0.5, source="meshplan bench gemm on test GPU, torch x, 2026-12-04",
              name="half.toml") -> Path:
    """A kernels.toml fragment for ``gpu`` whose bf16 points are the catalog's x ``factor``."""
    pts = [[m, n, k, rate * factor, key] for m, n, k, rate, key in catalog_kernel_data(gpu).gemm["bf16"]]
    path = tmp_path / name
    path.write_text(grid.fragment_toml(gpu, source, gemm={"bf16": pts}))
    return path


def _step_json(tmp_path, *args, name="step.json") -> dict:
    out = tmp_path / name
    assert run_main("step", CONFIG, "--json", out, *args) == 0
    return json.loads(out.read_text())


def test_half_rates_double_a_measured_gemm(tmp_path):
    """At a shape the catalog measured (H100 4096x2048x4096, S4) the GEMM takes 2 M N K over half
    the catalog's rate: the fragment's point, not the catalog's, is read."""
    gpu = catalog.gpu(GPU)
    rate = next(p[3] for p in catalog_kernel_data(GPU).gemm["bf16"] if tuple(p[:3]) == (4096, 2048, 4096))
    over, warns = with_kernel_files(gpu, [_fragment(tmp_path)])
    assert warns == [] and len(over.kernels) == 1
    assert gemm_time(over, 4096, 2048, 4096).seconds == pytest.approx(2 * 4096 * 2048 * 4096 / (rate / 2 * 1e12))
    assert gemm_time(gpu, 4096, 2048, 4096).seconds == pytest.approx(2 * 4096 * 2048 * 4096 / (rate * 1e12))
    assert kernel_data(over).gemm["fp8"] == catalog_kernel_data(GPU).gemm["fp8"]  # other dtypes: the catalog's
    assert kernel_data(over).attention == catalog_kernel_data(GPU).attention


def test_half_rate_fragment_adds_the_catalog_gemm_time_to_the_step(tmp_path, no_host_pace):
    """Every bf16 GEMM of the step is compute-bound, so at half the rates each takes twice its
    catalog time, and the step's compute grows by the catalog time of its GEMMs: per micro-batch
    the stage's 32 layers' and the output layer's GEMM ops (forward, dgrad, wgrad), times the 16
    micro-batches (global batch 64 / dp 4 / micro-batch 1); nothing else moves. (Without the eager
    DTensor TP host's pace, whose waits the slower GEMMs would partly fill.)"""
    from meshplan.schedule.workload import chunk_costs, workload_of

    p = plan_file(CONFIG)
    chunk = chunk_costs(p, workload_of(p))[0][0]
    ops = [o for c in chunk.layers + (chunk.head,) for o in c.ops if o.kind == "gemm"]
    assert len(ops) == 32 * 21 + 3 and p.micro_batches == 64 // 4 // 1
    gemm_s = p.micro_batches * sum(o.seconds for o in ops)

    base = _step_json(tmp_path)
    half = _step_json(tmp_path, "--kernels", _fragment(tmp_path), name="half.json")
    assert half["step_parts_s"]["compute"] - base["step_parts_s"]["compute"] == pytest.approx(gemm_s, rel=1e-9)
    assert half["exposed_s"] == pytest.approx(base["exposed_s"], rel=1e-9)
    assert base["kernels"] == {"line": "kernels: catalog", "files": []}
    import jsonschema
    from meshplan.report.json_docs import schema_of

    for doc in (base, half):  # the kernels entry is in step's schema
        jsonschema.Draft202012Validator(schema_of("step")).validate(doc)
    frag = tmp_path / "half.toml"
    assert half["kernels"]["files"] == [{"path": str(frag), "source": "meshplan bench gemm on test GPU, torch x, 2026-12-04"}]
    # since nc54 #14 the line counts the file's points against the plan's GEMM shapes: llama3-8b at tp 2
    # has 6 forward shapes (wq, wk = wv, wo, w1 = w3, w2, output), 2 data-gradient shapes not among
    # them and 6 weight-gradient ones (tests/test_gemm_table_use.py derives the 14 at tp 4); the
    # fragment is the catalog's 21 H100 bf16 points halved
    assert half["kernels"]["line"] == (f"kernels: {frag} (meshplan bench gemm on test GPU, torch x, 2026-12-04; bf16: "
                                       "21 points for the plan's 14 bf16 GEMM shapes, in place of the catalog's 21)")


def test_step_text_names_the_kernel_data(tmp_path, capsys):
    assert run_main("step", CONFIG) == 0
    assert "\nkernels: catalog\n" in capsys.readouterr().out
    frag = _fragment(tmp_path)
    assert run_main("step", CONFIG, "--kernels", frag) == 0
    assert f"\nkernels: {frag} (meshplan bench gemm on test GPU" in capsys.readouterr().out
    assert run_main("plan", CONFIG, "--kernels", frag) == 0  # plan (report, compare, search): only with a file
    assert capsys.readouterr().out.startswith(f"kernels: {frag} (meshplan bench gemm on test GPU")
    assert run_main("plan", CONFIG) == 0
    assert "kernels:" not in capsys.readouterr().out


def test_config_kernels_files_are_relative_to_the_config(tmp_path):
    (tmp_path / "measured").mkdir()
    _fragment(tmp_path / "measured")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.read_text() + '\n[kernels]\nfiles = ["measured/half.toml"]\n')
    out = tmp_path / "cfg.json"
    assert run_main("step", cfg, "--json", out) == 0
    doc = json.loads(out.read_text())
    flag = _step_json(tmp_path, "--kernels", tmp_path / "measured" / "half.toml", name="flag.json")
    assert doc["step_parts_s"]["compute"] == flag["step_parts_s"]["compute"]
    assert [f["path"] for f in doc["kernels"]["files"]] == [str(tmp_path / "measured" / "half.toml")]


def _error(capsys, *argv) -> str:
    assert run_main(*argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_missing_file_is_one_line_naming_kernels(tmp_path, capsys):
    err = _error(capsys, "step", CONFIG, "--kernels", tmp_path / "nope.toml")
    assert err.startswith("error: --kernels: no file") and "bench gemm --grid" in err


def test_fragment_of_another_gpu_names_both(tmp_path, capsys):
    err = _error(capsys, "plan", CONFIG, "--kernels", _fragment(tmp_path, gpu="a100-sxm-80gb"))
    assert err.startswith("error: --kernels:") and "describes GPU a100-sxm-80gb" in err
    assert "the config uses h100-sxm5-80gb" in err


def test_malformed_fragment_names_kernels_and_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[gpu.h100-sxm5-80gb]\nsource = "s"\n[gpu.h100-sxm5-80gb.gemm]\nbf16 = [[1, 2]]\n')
    err = _error(capsys, "search", CONFIG, "--kernels", bad)
    assert err.startswith("error: --kernels:") and "gpu.h100-sxm5-80gb.gemm.bf16[0]" in err


def test_cpu_measured_fragment_warns_and_runs(tmp_path, capsys):
    src = "meshplan bench gemm on x86_64 (CPU: describes this CPU, not a GPU), torch x, 2026-12-04"
    assert run_main("step", CONFIG, "--kernels", _fragment(tmp_path, source=src)) == 0
    io = capsys.readouterr()
    warn = [line for line in io.err.splitlines() if line.startswith("warning: --kernels")]
    assert len(warn) == 1 and "measured on the CPU" in warn[0] and "h100-sxm5-80gb" in warn[0]
    assert "kernels: " + str(tmp_path / "half.toml") in io.out


def test_gpu_table_refuses_a_kernels_key(capsys):
    from meshplan.config import config_from_dict

    gpu = catalog.gpu(GPU).model_dump() | {"kernels": []}
    with pytest.raises(ConfigError, match=r"cluster.gpu.kernels: .*\[kernels\] files"):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1, "gpu": gpu},
                          "training": {"global_batch": 8, "seq_len": 128}, "mesh": {"names": ["dp_shard"], "shape": [8]}})


def test_compare_refuses_configs_with_different_kernel_files(tmp_path, capsys):
    _fragment(tmp_path)
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(CONFIG.read_text() + '\n[kernels]\nfiles = ["half.toml"]\n')
    shutil.copy(CONFIG, b)
    err = _error(capsys, "compare", a, b, "--out", tmp_path / "cmp")
    assert err.startswith("error: kernels.files:") and "same [kernels] files" in err


def test_search_times_its_candidates_with_the_config_kernels(tmp_path):
    """The search plans with the [kernels] files: its top row's step is what `step` predicts for
    that row exported (the export keeps the [kernels] files, absolute, and the catalog node by
    name), and it is not the catalog's."""
    _fragment(tmp_path)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.read_text() + '\n[kernels]\nfiles = ["half.toml"]\n')
    row, doc = tmp_path / "row1.toml", tmp_path / "search.json"
    assert run_main("search", cfg, "--top", 1, "--export", 1, "--to", "meshplan", "-o", row, "--json", doc) == 0
    text = row.read_text()
    assert 'system = "dgx-h100"' in text and f'[kernels]\nfiles = ["{(tmp_path / "half.toml").resolve()}"]' in text
    top = json.loads(doc.read_text())["top"][0]["step_s"]
    out = tmp_path / "row1.json"
    assert run_main("step", row, "--json", out) == 0
    assert json.loads(out.read_text())["step_s"] == pytest.approx(top, rel=1e-12)
    catalog_doc = tmp_path / "catalog.json"
    assert run_main("search", CONFIG, "--top", 1, "--json", catalog_doc) == 0
    assert json.loads(catalog_doc.read_text())["top"][0]["step_s"] < top


def test_fragment_attention_rows_go_before_the_frameworks_kernels(tmp_path):
    """A `bench attention --grid` fragment's SDPA rows are what torch runs on the user's GPU: they
    take precedence over the catalog's FA2 rows torch's SDPA is otherwise timed with (its
    `prefer` first), at the flash-attention FLOP convention (forward 4 B S^2 H d / 2 causal,
    backward 2.5x); a GEMM-only fragment leaves the attention rows as they were."""
    from meshplan.compute.measured import attention_seconds
    from meshplan.compute.kernel_choices import SDPA_KERNELS
    from meshplan.compute.shapes import Attention

    rows = [dict(kernel="SDPA", pass_=p, mask="causal", head_dim=128, dtype="bf16", seq=[4096, 16384],
                 tflops=[r, r], source="bench") for p, r in (("fwd", 300.0), ("bwd", 200.0))]
    frag = tmp_path / "att.toml"
    frag.write_text(grid.fragment_toml(GPU, "meshplan bench attention on test GPU", attention=rows))
    over, _ = with_kernel_files(catalog.gpu(GPU), [frag])
    a = Attention(batch=1, q_heads=16, kv_heads=4, seq_q=8192, seq_kv=8192, head_dim=128)
    flops = 4 * 8192 * 8192 * 16 * 128 / 2
    f, b, how = attention_seconds(kernel_data(over), a, prefer=SDPA_KERNELS)
    assert f == pytest.approx(flops / 300e12) and b == pytest.approx(2.5 * flops / 200e12) and "SDPA" in how
    _, _, before = attention_seconds(catalog_kernel_data(GPU), a, prefer=SDPA_KERNELS)
    assert "FA2" in before and "SDPA" not in before
    gemm_only, _ = with_kernel_files(catalog.gpu(GPU), [_fragment(tmp_path)])
    assert attention_seconds(kernel_data(gemm_only), a, prefer=SDPA_KERNELS)[2] == before


def _host_file(tmp_path, body: str, name="host.toml") -> Path:
    """A kernels file for the config's GPU with a [host] table ``body`` (no GEMM points: the
    [host] table alone is something to read)."""
    path = tmp_path / name
    path.write_text(f'[gpu.{GPU}]\nsource = "meshplan bench rank on test GPU"\n\n[host]\n{body}')
    return path


def test_host_table_replaces_the_catalog_pace_and_names_the_file(tmp_path, capsys):
    """A [host] table (as `bench rank --kernels-out` writes it, grid.fragment_toml) replaces
    kernels.toml's (4.65, 5.37) ms per block and keeps everything else the catalog's; the step's
    host line names the file instead of M1. Under MINI (torch eager, tp 4) the pace sets the step."""
    text = grid.fragment_toml(GPU, "meshplan bench rank on test GPU",
                              host={"dtensor_tp_block_forward_s": 9.3e-3, "dtensor_tp_block_backward_s": 10.74e-3})
    path = tmp_path / "host.toml"
    path.write_text(text)
    gpu, _ = with_kernel_files(catalog.gpu(GPU), [path])
    data, base = kernel_data(gpu), catalog_kernel_data(GPU)
    assert data.dtensor_tp_block_s == (9.3e-3, 10.74e-3) and base.dtensor_tp_block_s == (4.65e-3, 5.37e-3)
    assert data.dtensor_tp_source == f"your kernels file {path}"
    assert (data.gemm, data.attention, data.kernel_issue_s) == (base.gemm, base.attention, base.kernel_issue_s)
    mini = ROOT / "examples" / "mini_2x4_tp4-dp2.toml"
    assert run_main("step", mini, "--kernels", path) == 0
    host = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host:"))
    assert f"issues a block in 9.30 ms forward, 10.74 ms backward (your kernels file {path})" in host
    assert run_main("step", mini) == 0
    host = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host:"))
    assert "4.65 ms forward, 5.37 ms backward (measured on the H200 machine's host, torch 2.11: kernels.toml [host], M1)" \
        in host


@pytest.mark.parametrize("body, field, says", [
    ("dtensor_tp_block_forward_s = -4e-3\ndtensor_tp_block_backward_s = 5e-3\n", "host.dtensor_tp_block_forward_s",
     "-0.004; must be a positive, finite number of seconds per transformer block"),
    ("dtensor_tp_block_forward_s = 4e-3\ndtensor_tp_block_backward_s = nan\n", "host.dtensor_tp_block_backward_s",
     "nan; must be a positive, finite"),
    ("dtensor_tp_block_forward_s = 4e-3\ndtensor_tp_block_backward_s = \"5 ms\"\n", "host.dtensor_tp_block_backward_s",
     "'5 ms'; must be a positive"),
    ("dtensor_tp_block_forward_s = 4e-3\n", "host.dtensor_tp_block_backward_s",
     "missing; give [host] dtensor_tp_block_forward_s and dtensor_tp_block_backward_s"),
    ("dtensor_tp_block_forward_s = 4e-3\ndtensor_tp_block_backward_s = 5e-3\nkernel_issue_s = 5e-6\n",
     "host.kernel_issue_s", "unknown key; give [host] dtensor_tp_block_forward_s and"),
])
def test_bad_host_table_is_one_line_naming_the_field(tmp_path, capsys, body, field, says):
    err = _error(capsys, "step", CONFIG, "--kernels", _host_file(tmp_path, body))
    assert err.startswith(f"error: --kernels: {field}: {says}")


HOST_ONLY = "[host]\ndtensor_tp_block_forward_s = 2.0e-3\ndtensor_tp_block_backward_s = 2.5e-3\n"


@pytest.mark.parametrize("gpu", [GPU, "a100-sxm-80gb"])
def test_host_table_alone_applies_to_any_gpu(tmp_path, gpu):
    """A file with the [host] table alone (no [gpu.<id>]) is read for whatever GPU the plan uses:
    its pace replaces the catalog's, GEMM and attention data stay the catalog's."""
    path = tmp_path / "host.toml"
    path.write_text(HOST_ONLY)
    over, warns = with_kernel_files(catalog.gpu(gpu), [path])
    data, base = kernel_data(over), catalog_kernel_data(gpu)
    assert warns == [] and data.dtensor_tp_block_s == (2.0e-3, 2.5e-3)
    assert data.dtensor_tp_source == f"your kernels file {path}"
    assert (data.gemm, data.attention) == (base.gemm, base.attention)


def test_empty_file_still_wants_a_gpu_or_host_table(tmp_path, capsys):
    path = tmp_path / "empty.toml"
    path.write_text("# nothing\n")
    err = _error(capsys, "step", CONFIG, "--kernels", path)
    assert err.startswith("error: --kernels:") and "expected exactly one [gpu.<id>] table" in err
    assert "or a [host] table alone" in err


def test_host_pace_not_binding_is_said_on_the_host_line(tmp_path, capsys):
    """MINI (eager, tp 4): a 2.00/2.50 ms pace is under the device's time per block (forward
    kernels 1.92 ms plus exposed tp collectives; backward kernels 4.05 ms; 1.93 and 4.06 with the repeat_kv
    copies, 14.1 us each way at tp 4, before kvheads), so the device never
    waits; the host line says the file's pace was applied and is not binding, with the block's
    kernel times (the step's own layer Cost of stage 0)."""
    from meshplan.schedule.workload import chunk_costs, workload_of

    path = tmp_path / "host.toml"
    path.write_text(HOST_ONLY)
    mini = ROOT / "examples" / "mini_2x4_tp4-dp2.toml"
    assert run_main("step", mini, "--kernels", path) == 0
    out = capsys.readouterr().out.splitlines()
    p = plan_file(mini)
    layer = chunk_costs(p, workload_of(p))[0][0].layers[0]
    kf, kb = layer.seconds("forward"), layer.seconds("backward_input") + layer.seconds("backward_weight")
    assert (round(kf * 1e3, 2), round(kb * 1e3, 2)) == (1.92, 4.05)  # the catalog's H100 kernels, under the pace's sum
    assert [x for x in out if x.startswith("host:")] == [
        f"host: pace 2.00/2.50 ms a block (forward/backward) from your kernels file {path}: not binding (the device "
        f"never waits for the host: a block's kernels, 1.92/4.05 ms, and its exposed collectives take longer)"]
    assert f"kernels: {path} ([host] pace alone, for any GPU)" in out
    assert run_main("step", mini) == 0  # the catalog's pace binds here: the usual line
    assert "waiting for the host" in next(x for x in capsys.readouterr().out.splitlines() if x.startswith("host:"))
