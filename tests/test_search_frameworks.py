"""``meshplan search --framework a,b`` (issue 11 item 7, newcomer trial 32 #5: "DeepSpeed ZeRO-3 vs
Megatron-DeepSpeed TP+PP, which for my model?"): each framework's candidates planned with its own
runtime's rules, one ranking across them, each row naming its framework, the top against #2
naming the framework difference; and Megatron-DeepSpeed's ds config read beside its script."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.search.driver import search
from meshplan.search.frameworks import cross_search, framework_config, framework_names
from tests.cli_run import run_captured
from tests.test_cli_json import validate

DATA = Path(__file__).parent / "data" / "megatron_deepspeed"
SMALL = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-a100-40gb", "nodes": 2},
         "training": {"global_batch": 64, "seq_len": 4096},
         "search": {"micro_batch": [1], "recompute": ["full"], "pp": [1, 2], "tp": [1, 2]}}


def _search(c, progress=None):
    return search(c, workers=1)


@pytest.fixture(scope="module")
def cross():
    cfg = config_from_dict(SMALL, require_mesh=False)
    return cfg, cross_search(cfg, ("deepspeed", "megatron_deepspeed"), _search)


def test_each_framework_searches_what_its_runtime_runs(cross):
    """deepspeed: ZeRO over one data axis (pp = tp = cp = 1; 16 GPUs: dp_shard 16 at zero1,
    zero2, zero3 resharded and kept gathered, the zero3 ones each at DeepSpeed ZeRO++ hpZ g 1 and 8,
    the data axis the world of 2 nodes: search/space.py hpz_applies = 6 candidates). megatron_deepspeed: Megatron's
    TP and PP under DeepSpeed's engines, which reject ZeRO-2/3 beside pp > 1 (DeepSpeed's
    PipelineEngine asserts stage < 2): no row with pp 2 is zero2 or zero3; no hsdp, no cp, and no
    candidate with tp overlap or short end stages (Megatron-DeepSpeed has neither flag)."""
    _, x = cross
    ds, mds = x.results["deepspeed"], x.results["megatron_deepspeed"]
    assert len(ds.candidates) == 6 and sorted(ds.candidates.hz.tolist()) == [1, 1, 1, 1, 8, 8]
    assert all(int(ds.candidates.pp[e.index]) == int(ds.candidates.tp[e.index]) == 1 for e in ds.top)
    c = mds.candidates
    assert mds.counts()["engine"] > 0
    assert not any(int(c.pp[e.index]) > 1 and c.sharding_word(e.index) != "zero1" for e in mds.top)
    assert all(int(c.cp[e.index]) == 1 and c.sharding_word(e.index) != "hsdp" for e in mds.top)
    # no --tp-comm-overlap, no --decoder-first/last-pipeline-num-layers in its arguments.py
    assert not (c.ov.any() or c.us.any())


def test_one_ranking_the_top_framework_from_the_step_parts(cross):
    """By hand from the two rows' step parts (seconds on the critical stage, adding to the step):
    megatron_deepspeed dp_shard 16 zero3, compute 4.8337 + exposed ZeRO 0.0751 = 4.9088 s;
    deepspeed dp_shard 16 zero3 (the same mesh and the same DeepSpeed ZeRO-3 engine), compute
    5.0253 + exposed ZeRO 0.0400 = 5.0654 s. 5.0654 / 4.9088 - 1 = 3.2% > the 1% tie band, so
    the shorter step decides: Megatron-DeepSpeed first, by its compute (Megatron-LM's fused
    kernels around the same GEMMs: 0.192 s less), less the 0.035 s more of exposed ZeRO. Each
    row's step is its own framework's search's (the same candidate, planned alone). Before the
    fix in :func:`meshplan.schedule.overlap_policy.config_overlap`, Megatron-DeepSpeed's ZeRO-3
    reduce-scatters were placed after the backward as Megatron-LM's own (0.487 s exposed), where
    DeepSpeed's engine runs them (``model.backward``) overlapped. (nc52fixC: the ZeRO-3 gathers and
    reduce-scatters over the 2 nodes now hold 16 of the A100's 108 SMs beside the compute (dgx-a100-40gb:
    8 HDR NICs, 2 rings each; row_shares.nccl_net_channels): compute 4.8337 -> 4.9769 s (+0.1432) and
    5.0253 -> 5.1794 s (+0.1541), exposed ZeRO 0.0751 and 0.0399 s; steps 5.0520 and 5.2192 s, 5.2192 /
    5.0520 - 1 = 3.3%, the same order, by compute 0.2025 s less, less 0.0352 s more exposed. With nc52d's
    reduce-scatters per ipg bucket of 5e8 elements (fewer, larger calls than one per layer, less time
    beside the compute): compute 4.9764 and 5.1789 s (0.5 ms less SM contention each, read from the
    model; without the contention the buckets moved neither by 0.1 ms), exposed 0.0751 and 0.0399 s,
    steps 5.0515 and 5.2188 s, still 3.3% apart.) (kvheads: DeepSpeed's HF Llama runs no repeat_kv copies
    under [memory] kv_expanded false (its SDPA reads the 8 KV heads): 4 micro-batches x 32 layers x 3 ops
    (forward, replay, backward) of 2 x 4096 x (32 + 8) x 128 x 2 B = 83,886,080 B, ~61 us each at the A100's
    achieved HBM rate, compute 5.1789 -> 5.1552 s (-23.7 ms, read from the model); Megatron-LM's kernels never
    ran them, 4.9764 s unchanged; steps 5.0515 and 5.1951 s, 2.8% apart, the same order.)"""
    cfg, x = cross
    a, b = x.rows[0], x.rows[1]
    assert (a.framework, b.framework) == ("megatron_deepspeed", "deepspeed")
    for r in (a, b):
        parts = r.exact.breakdown
        assert sum(v for k, v in parts.items() if k != "step") == pytest.approx(parts["step"], rel=1e-9)
        assert r.result.candidates.label(r.exact.index).startswith("dp_shard 16, mb 1, full, vpp 1, zero3")
    assert a.exact.breakdown["compute"] == pytest.approx(4.9764, abs=5e-5)
    assert b.exact.breakdown["compute"] == pytest.approx(5.1552, abs=5e-5)   # kvheads (docstring)
    assert a.exact.breakdown["exposed fsdp"] < 0.1  # DeepSpeed's overlap_comm, not Megatron's post-backward reduce
    assert b.exact.step_s / a.exact.step_s - 1 > 0.01
    assert x.decided_by.startswith("shorter step by more than 1%")
    alone = search(framework_config(cfg, "deepspeed", keep_mesh=False), workers=1)
    assert alone.top[0].step_s == pytest.approx(b.exact.step_s, rel=1e-12)
    steps = [r.exact.step_s for r in x.rows]
    assert steps == sorted(steps) or x.decided_by  # one order across frameworks


def test_cli_rows_name_their_framework_and_the_line_the_difference(tmp_path):
    """The text table's framework column, the top-vs-#2 line naming the framework difference,
    and --json's framework per row and framework_difference."""
    (tmp_path / "c.toml").write_text(
        '[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-a100-40gb"\nnodes = 2\n'
        '[training]\nglobal_batch = 64\nseq_len = 4096\n'
        '[search]\nmicro_batch = [1]\nrecompute = ["full"]\npp = [1, 2]\ntp = [1, 2]\n')
    r = run_captured("search", tmp_path / "c.toml", "--framework", "deepspeed,megatron_deepspeed", "--top", "3",
                     "--json", tmp_path / "o.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "framework megatron_deepspeed vs deepspeed (" in r.stdout
    d = json.loads((tmp_path / "o.json").read_text())
    assert [t["framework"] for t in d["top"][:2]] == ["megatron_deepspeed", "deepspeed"]
    assert d["top_vs_runner_up"]["framework_difference"].startswith("framework megatron_deepspeed vs deepspeed")
    assert set(d["frameworks"]) == {"deepspeed", "megatron_deepspeed"}
    assert validate("search", d) == []  # search's schema, its across-frameworks form
    assert validate("search", {k: v for k, v in d.items() if k != "decided_by"}) != []  # which requires it
    toml = (tmp_path / "c.toml").read_text().replace('tp = [1, 2]\n', 'tp = [1, 2]\nframeworks = ["deepspeed", '
                                                     '"megatron_deepspeed"]\n')
    (tmp_path / "c.toml").write_text(toml)  # [search] frameworks: the same search without the option
    r2 = run_captured("search", tmp_path / "c.toml", "--top", "3", cwd=tmp_path)
    assert r2.returncode == 0 and r2.stdout == r.stdout.replace("wrote " + str(tmp_path / "o.json") + "\n", "")


def test_export_of_a_cross_framework_row_is_its_framework_s(tmp_path):
    """--export 1 --to megatron of the 16-GPU case's row 1 (megatron_deepspeed dp_shard 16 zero3,
    the ranking test's) writes Megatron-DeepSpeed's --deepspeed --zero-stage 3 at tp 1 and pp 1, the
    header naming the framework; no Megatron FSDP line (DeepSpeed's engine shards: its export
    writes no --use-megatron-fsdp, so CUDA_DEVICE_MAX_CONNECTIONS is no concern)."""
    (tmp_path / "c.toml").write_text(
        '[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-a100-40gb"\nnodes = 2\n'
        '[training]\nglobal_batch = 64\nseq_len = 4096\n'
        '[search]\nmicro_batch = [1]\nrecompute = ["full"]\npp = [1, 2]\ntp = [1, 2]\n')
    r = run_captured("search", tmp_path / "c.toml", "--framework", "deepspeed,megatron_deepspeed", "--top", "3",
                     "--export", "1", "--to", "megatron", "-o", tmp_path / "row1.sh", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "row1.sh").read_text()
    assert "row 1 (megatron_deepspeed)" in text.splitlines()[0]
    flags = [line.strip() for line in text.splitlines() if line.startswith("--")]
    for f in ("--deepspeed", "--zero-stage 3", "--tensor-model-parallel-size 1", "--pipeline-model-parallel-size 1"):
        assert f in flags
    assert "--use-megatron-fsdp" not in flags and "CUDA_DEVICE_MAX_CONNECTIONS" not in text


def test_framework_refusals_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        framework_names("deepspeed,fsdp")
    assert e.value.field == "--framework"
    cfg = config_from_dict(SMALL | {"search": {"tp": [2]}}, require_mesh=False)
    with pytest.raises(ConfigError) as e:
        framework_config(cfg, "deepspeed")  # DeepSpeed's engine runs no tp: nothing left to search
    assert e.value.field == "search.tp"
    (tmp_path / "c.toml").write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                                     '[training]\nglobal_batch = 8\nseq_len = 4096\n')
    r = run_captured("search", tmp_path / "c.toml", "--framework", "torch,megatron", "--export", "1b", "--to",
                     "megatron", "-o", tmp_path / "x.sh", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --export: not with several frameworks")
    assert r.stderr.count("\n") == 1


def test_megatron_deepspeed_reads_its_ds_config_beside_the_script(tmp_path):
    """train_mds.sh gives --deepspeed_config ds_zero1.json --zero-stage 1 and no --micro-batch-size;
    ds_zero1.json (beside it) sets reduce_bucket_size 2e8, communication_data_type fp32,
    overlap_comm false and train_micro_batch_size_per_gpu 2: the plan takes them (DeepSpeed's
    defaults would be 5e8 elements, the model's bf16, false, and Megatron's micro-batch 1)."""
    opts = ImportOptions(model="llama3-8b", cluster="dgx-h100")
    cfg = load_any(DATA / "train_mds.sh", "megatron", opts, require_mesh=False)
    t = cfg.training
    assert (t.sharding, t.zero12_engine, t.micro_batch, t.global_batch) == ("zero1", "deepspeed", 2, 64)
    assert (t.grad_reduce_dtype, t.overlap_comm, cfg.memory.grad_bucket_elements) == ("fp32", False, 200_000_000)
    assert any("read from" in n and "ds_zero1.json" in n for n in cfg.notes)
    assert any("give the script --micro-batch-size 2 too" in n for n in cfg.notes)  # Megatron-DeepSpeed asserts it
    shutil.copy(DATA / "train_mds.sh", tmp_path / "train_mds.sh")  # the script alone: a note, DeepSpeed's defaults
    cfg = load_any(tmp_path / "train_mds.sh", "megatron", opts, require_mesh=False)
    assert (cfg.training.micro_batch, cfg.training.gradient_reduce_dtype) == (1, "bf16")
    assert any("ds_zero1.json is not read" in n and "no such file beside the script" in n for n in cfg.notes)


@pytest.mark.parametrize("edit,field", [({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
                                        ({"train_micro_batch_size_per_gpu": 4}, "train_micro_batch_size_per_gpu")])
def test_ds_config_disagreeing_with_the_flags_is_refused(tmp_path, edit, field):
    d = json.loads((DATA / "ds_zero1.json").read_text()) | edit
    (tmp_path / "ds_zero1.json").write_text(json.dumps(d))
    script = (DATA / "train_mds.sh").read_text().replace("--global-batch-size 64", "--micro-batch-size 2 "
                                                         "--global-batch-size 64")
    (tmp_path / "train_mds.sh").write_text(script)
    with pytest.raises(ConfigError) as e:
        load_any(tmp_path / "train_mds.sh", "megatron", ImportOptions(model="llama3-8b", cluster="dgx-h100"),
                 require_mesh=False)
    assert e.value.field == field


def test_a_deepspeed_json_searched_by_framework_drops_its_importer_narrowing(tmp_path):
    """examples/deepspeed_zero2_16xh100.json read directly: its import narrows [search] to ZeRO over
    one data axis and sets overlap_comm (DeepSpeed's zero_optimization knob). Under --framework
    megatron_deepspeed that narrowing is the importer's, not the user's: tp 2 and pp 2 are searched;
    under --framework torch overlap_comm (which FSDP2 has not) is left out, with a note, instead of
    the training's error."""
    from meshplan.search.frameworks import dropped_note
    ex = Path(__file__).resolve().parents[1] / "examples" / "deepspeed_zero2_16xh100.json"
    cfg = load_any(ex, "deepspeed", ImportOptions(model="llama3-8b", cluster="dgx-h100", nodes=2, seq_len=4096),
                   require_mesh=False)
    assert cfg.search.tp == [1] and cfg.training.overlap_comm is True
    mds = framework_config(cfg, "megatron_deepspeed")
    assert mds.search.tp is None and mds.search.pp is None and mds.search.cp == [1]
    torch = framework_config(cfg, "torch")
    assert torch.training.overlap_comm is None and torch.training.framework == "torch"
    assert dropped_note(cfg, "torch").startswith("--framework torch runs without training.overlap_comm")
    assert dropped_note(cfg, "deepspeed") == ""


@pytest.mark.parametrize("training, dropped", [
    ({"framework": "megatron", "megatron_runtime": "core", "dataloader_attention_mask": False},
     {"torch": ["megatron_runtime", "dataloader_attention_mask"], "deepspeed": ["megatron_runtime",
      "dataloader_attention_mask"], "megatron_deepspeed": ["megatron_runtime", "dataloader_attention_mask"],
      "megatron": []}),
    ({"framework": "megatron", "sharding": "zero1", "zero12_engine": "deepspeed", "pp_engine": "deepspeed"},
     {"torch": ["pp_engine"], "megatron": ["pp_engine"], "deepspeed": ["pp_engine"], "megatron_deepspeed": []}),
    ({"sharding": "zero3", "zero3_engine": "deepspeed", "zero_hpz_partition_size": 8, "zero_quantized_weights": True},
     {"torch": ["zero_hpz_partition_size", "zero_quantized_weights"],
      "megatron": ["zero_hpz_partition_size", "zero_quantized_weights"], "deepspeed": [], "megatron_deepspeed": []}),
])
def test_the_session_s_runtime_keys_are_dropped_where_another_runtime_is_searched(training, dropped):
    """Review rv48: a config with Megatron Core's generation (mcore48), DeepSpeed's PipelineEngine
    (bloom48) or ZeRO++ (zeropp48) searched under --framework across runtimes stopped at the first
    framework that does not run the key ("error: training: megatron_runtime is the Megatron-LM
    generation ...; framework 'torch'" under torch; pp_engine's error under megatron; the ZeRO++
    error under torch's FSDP2). Each is now another runtime's knob, left out of that framework's
    search with a note, as overlap_comm is: megatron_runtime and its mask outside Megatron-LM
    (Megatron-DeepSpeed runs 2022's get_batch, the unset default), pp_engine outside
    Megatron-DeepSpeed, ZeRO++ outside DeepSpeed; each framework's config then loads."""
    from meshplan.search.frameworks import dropped_keys
    cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                            "training": {"global_batch": 64, "seq_len": 4096, **training},
                            "mesh": {"names": ["dp"], "shape": [16]}})
    assert {n: dropped_keys(cfg.training, n) for n in dropped} == dropped
    for name in dropped:
        framework_config(cfg, name, keep_mesh=False)  # no ConfigError


@pytest.mark.parametrize("value", ["abc", None, True])
def test_zero_optimization_not_an_object_is_a_one_line_error_naming_it(tmp_path, value):
    """A ds config whose zero_optimization is no object: DeepSpeed's own reader fails on a string or
    null and reads a bare true as its deprecated form (stage 1). Before: a DeepSpeed JSON imported
    directly raised AttributeError ('str' object has no attribute 'get': a traceback), and
    Megatron-DeepSpeed's ds config read it as stage 0 and blamed zero_optimization.stage ("0 in
    ds_zero1.json but --zero-stage 1"); now both name zero_optimization and ask for the object."""
    d = json.loads((DATA / "ds_zero1.json").read_text()) | {"zero_optimization": value}
    (tmp_path / "ds_zero1.json").write_text(json.dumps(d))
    shutil.copy(DATA / "train_mds.sh", tmp_path / "train_mds.sh")
    with pytest.raises(ConfigError) as e:
        load_any(tmp_path / "train_mds.sh", "megatron", ImportOptions(model="llama3-8b", cluster="dgx-h100"),
                 require_mesh=False)
    assert e.value.field == "zero_optimization" and "give a JSON object of ZeRO keys" in e.value.message
    r = run_captured("import", "deepspeed", tmp_path / "ds_zero1.json", "--cluster", "dgx-h100", "--nodes", 2,
                     "--model", "llama3-8b", "--seq-len", 4096, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: zero_optimization: {value!r}: give a JSON object of ZeRO keys")


def test_megatron_deepspeed_zero1_rows_run_deepspeed_s_pipeline_engine(cross):
    """Megatron-DeepSpeed under ``--deepspeed`` builds ``GPTModelPipe`` and DeepSpeed's PipelineEngine
    runs it at any pp unless ``--no-pipeline-parallel`` (pp 1 only; microsoft/Megatron-DeepSpeed 0782d75
    ``pretrain_gpt.py`` ``model_provider``, 060fb40 ``megatron/arguments.py``): its import sets
    ``pp_engine = "deepspeed"`` (:func:`meshplan.interop.megatron_deepspeed.deepspeed_engine`), so the
    search's zero1 rows must too; its zero3 rows stay ``framework`` (the engine asserts stage < 2).
    The pp 2 x dp 8 zero1 row is planned as the same mesh with the import's keys (``framework =
    "megatron"``, ``zero12_engine`` and ``pp_engine = "deepspeed"``): the same step. Before, the row ran
    Megatron-LM's own schedule, send and receive of a 1F1B step paired in one call: exposed pp 19.59 ms
    where the PipelineEngine's separate blocking calls expose 34.82 ms (step 5834.39 -> 5849.54 ms)."""
    from meshplan.search.candidate import candidate_config
    cfg, x = cross
    mds = x.results["megatron_deepspeed"]
    c, rows = mds.candidates, {mds.candidates.label(e.index).split(", mb")[0]: e for e in mds.top}
    engines = {k: candidate_config(mds.config, c, e.index).training.pp_engine for k, e in rows.items()}
    assert engines["pp 2 x dp 8"] == "deepspeed" and engines["dp_shard 16"] == "framework"
    mine = config_from_dict({**SMALL, "mesh": {"names": ["pp", "dp"], "shape": [2, 8]}, "training": {
        **SMALL["training"], "recompute": "full", "framework": "megatron", "sharding": "zero1",
        "zero12_engine": "deepspeed", "pp_engine": "deepspeed", "param_dtype": "bf16", "grad_dtype": "bf16"}})
    from meshplan.plan import build_plan
    from meshplan.schedule.steptime import step_time
    assert rows["pp 2 x dp 8"].step_s == pytest.approx(step_time(build_plan(mine)).step_s, rel=1e-12)
    assert rows["pp 2 x dp 8"].breakdown["exposed pp"] == pytest.approx(0.03482, abs=5e-6)


def test_megatron_deepspeed_framework_config_runs_the_pipeline_engine_at_zero1():
    """A ZeRO-1 config searched under ``--framework megatron_deepspeed`` is Megatron-DeepSpeed's
    ``--deepspeed --zero-stage 1`` without ``--no-pipeline-parallel``: ``pp_engine = "deepspeed"``, as
    its import; a ZeRO-3 one is ``--no-pipeline-parallel`` (pp 1), its own engine."""
    z1 = config_from_dict({**SMALL, "training": {**SMALL["training"], "sharding": "zero1"}}, require_mesh=False)
    assert framework_config(z1, "megatron_deepspeed").training.pp_engine == "deepspeed"
    assert framework_config(z1, "megatron").training.pp_engine == "framework"
    z3 = config_from_dict(SMALL, require_mesh=False)
    assert framework_config(z3, "megatron_deepspeed").training.pp_engine == "framework"
