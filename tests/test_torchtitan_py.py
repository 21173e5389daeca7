"""torchtitan's Python job configs (newcomer finding nc55 #7), read without running them
(meshplan/interop/torchtitan_py.py, torchtitan_pyjob.py).

tests/data/ttpy/llama3/config_registry.py.txt is a config registry in torchtitan 9810191's form
(pytorch/torchtitan 9810191 ``torchtitan/models/llama3/config_registry.py``; field names of
``torchtitan/config/configs.py`` there): ``llama3_8b_128k`` is tests/data/nc53/tt_8b_128k.toml (a
v0.2.2 job TOML: Llama 3.1 8B, 128k, cp 16 x tp 2, float8, full AC, compile) written as a
``Trainer.Config(...)``; ``llama3_8b_tp2`` builds on it (``config = llama3_8b_128k()`` and three
``config.a.b = ...`` lines). config_registry_b5bcd76.py.txt is the tp 2 job in b5bcd76's names
(token counts of 73aed7f, ``SelectiveAC.Config()`` of c5d93d1, converters given to ``model_registry``).
The folder is named llama3: ``from . import model_registry`` there is torchtitan's llama3 model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_run import run_main as _main
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any, read_foreign
from meshplan.interop.tomlout import resolved

DATA = Path(__file__).parent / "data"
REGISTRY = DATA / "ttpy" / "llama3" / "config_registry.py.txt"
B5 = DATA / "ttpy" / "llama3" / "config_registry_b5bcd76.py.txt"
H200x16 = dict(cluster="dgx-h200", nodes=16)


def _read(path: Path, name: str | None, **opts):
    return read_foreign(path, "torchtitan", ImportOptions(**(opts or H200x16), job_config=name))


def test_registry_function_is_read_as_its_job_toml():
    """llama3_8b_128k() and tt_8b_128k.toml state the same job; 9810191's classes keep v0.2.2's field
    names, so every table is the TOML's but one key: the TOML names the converter
    "quantize.linear.float8", for which v0.2.2's parallelize leaves float8 TP off (fp8_tp = false),
    while 9810191 applies float8 TP for any Float8LinearConverter (models/llama3/parallelize.py:90-100:
    find_float8_linear_config, tensorwise here): fp8_tp left at its default, on. By hand: world
    16 x 8 = 128, dp_shard -1 kept ([-1, 16, 2]); global batch 64, micro-batch 1, seq 128 x 1024 =
    131072 (SEQ_LEN, a module-level name); AC full; compile on; float8 with the output filtered."""
    py = _read(REGISTRY, "llama3_8b_128k")
    toml = read_foreign(DATA / "nc53" / "tt_8b_128k.toml", "torchtitan", ImportOptions(**H200x16))
    assert toml.tables["training"].pop("fp8_tp") is False and "fp8_tp" not in py.tables["training"]
    assert py.tables == toml.tables
    t, m = py.tables["training"], py.tables["mesh"]
    assert (t["global_batch"], t["micro_batch"], t["seq_len"], t["recompute"]) == (64, 1, 131072, "full")
    assert (m["names"], m["shape"]) == (["dp_shard", "cp", "tp"], [-1, 16, 2])
    assert (t["linear_dtype"], t["fp8_output_layer"], t["fp8_all_gather"], t["op_sac_policy"]) == \
        ("fp8", False, True, "238fa99")
    assert py.tables["reliability"] == {"checkpoint_interval_steps": 200}
    assert set(py.unused) == {"training.steps", "model.hf_assets_path", "optimizer.lr", "lr_scheduler.warmup_steps",
                              "dataloader.dataset"}  # the TOML's own, less [job] (the .py has none)
    assert not any("float8 TP off" in n for n in py.notes)


def test_a_function_building_on_another_applies_its_assignments():
    """llama3_8b_tp2(): config = llama3_8b_128k(); seq_len = 8192; context_parallel_degree = 1;
    activation_checkpoint = ActivationCheckpointConfig(mode="selective", selective_ac_option="2"):
    on 2 x 8 H100s the mesh is dp_shard -1 x tp 2 (16 / 2 = 8), every 2nd layer checkpointed (v0.2.2's
    option "2": recompute layer, ac_freq 2), the rest of llama3_8b_128k kept (global 64, float8)."""
    imp = _read(REGISTRY, "llama3_8b_tp2", cluster="dgx-h100", nodes=2)
    t, m = imp.tables["training"], imp.tables["mesh"]
    assert (t["seq_len"], t["recompute"], t["ac_freq"], t["global_batch"], t["linear_dtype"]) == \
        (8192, "layer", 2, 64, "fp8")
    assert (m["names"], m["shape"]) == (["dp_shard", "tp"], [-1, 2])
    cfg = load_any(REGISTRY, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=2, job_config="llama3_8b_tp2"))
    assert resolved(cfg).derivation[0] == "dp_shard = 16 / (tp 2) = 8"


def test_b5bcd76_names_plan_the_same_batch_as_b5bcd76_runs_it():
    """b5bcd76's tp 2 job: num_tokens_per_microbatch_per_dp_rank 1 x 8192 over max_context_length 8192
    is 1 sequence per micro-batch; num_tokens_per_train_step 64 x 8192 a global batch of 64; so the
    batch, sequence and mesh are llama3_8b_tp2's. SelectiveAC.Config() is per-op SAC (op), FullAC.Config()
    full; planned as b5bcd76 (op_sac_policy "b5bcd76"); float8 without float8 TP (b5bcd76 has none:
    fp8_tp false) or float8 all-gather (its Float8LinearConverter.Config has no such field), the
    output filtered by its b5bcd76 name lm_head (fp8_output_layer false)."""
    imp = _read(B5, "llama3_8b_tp2", cluster="dgx-h100", nodes=2)
    old = _read(REGISTRY, "llama3_8b_tp2", cluster="dgx-h100", nodes=2)
    t = imp.tables["training"]
    for key in ("global_batch", "micro_batch", "seq_len", "sharding", "linear_dtype", "fp8_output_layer"):
        assert t[key] == old.tables["training"][key], key
    assert imp.tables["mesh"] == old.tables["mesh"]
    assert (t["recompute"], t["op_sac_policy"], t["fp8_tp"], t.get("fp8_all_gather", False)) == \
        ("op", "b5bcd76", False, False)
    assert _read(B5, "llama3_8b_tp2_full_ac", cluster="dgx-h100", nodes=2).tables["training"]["recompute"] == "full"
    assert any("FlexAttention" in n for n in imp.notes)


def _registry(tmp_path: Path, body: str, model: str = "llama3") -> Path:
    folder = tmp_path / model
    folder.mkdir(exist_ok=True)
    path = folder / "config_registry.py"
    path.write_text("from torchtitan.config import ParallelismConfig, TrainingConfig\nfrom torchtitan.trainer import "
                    "Trainer\nfrom . import model_registry\n\n" + body)
    return path


def _error(path: Path, name: str | None = None) -> str:
    with pytest.raises(ConfigError) as e:
        read_foreign(path, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1, job_config=name))
    line = str(e.value)
    assert "\n" not in line and "Traceback" not in line
    return line


JOB = ("def job():\n    return Trainer.Config(model_spec=model_registry(\"8B\"), training=TrainingConfig({}), "
       "parallelism=ParallelismConfig({}))\n")


def test_a_value_read_that_is_not_a_literal_is_one_line_naming_it(tmp_path):
    """tensor_parallel_degree=tp() (a call) and seq_len=SEQ (a name the file imports, not binds):
    meshplan cannot know them without running the file: the line names the field and asks for the
    literal; a name bound in the file (SEQ = 4096 at module level) is read."""
    line = _error(_registry(tmp_path, JOB.format("seq_len=8192", "tensor_parallel_degree=tp()")))
    assert line.startswith("parallelism.tensor_parallel_degree: 'tp(...)' is not read without running the file")
    assert "write its value as a literal" in line
    line = _error(_registry(tmp_path, "from x import SEQ\n" + JOB.format("seq_len=SEQ", "")))
    assert line.startswith("training.seq_len: 'SEQ' is not read")
    ok = _read(_registry(tmp_path, "SEQ = 2 * 2048\n" + JOB.format("seq_len=SEQ", "")), None, cluster="dgx-h100",
               nodes=1)
    assert ok.tables["training"]["seq_len"] == 4096


def test_an_unknown_field_is_one_line_naming_the_close_one(tmp_path):
    """TrainingConfig(seq_length=8192): no field of torchtitan's TrainingConfig (9810191 or b5bcd76),
    which itself raises TypeError: the line names it and seq_len."""
    line = _error(_registry(tmp_path, JOB.format("seq_length=8192", "")))
    assert line == ("training.seq_length: not a field of torchtitan's TrainingConfig (9810191 or b5bcd76); did you "
                    "mean seq_len?")


def test_an_unknown_trainer_field_is_refused_not_skipped(tmp_path):
    """nc57 #1: Trainer.Config(parallel_config=ParallelismConfig(...)) is no field of torchtitan's
    Trainer.Config (torchtitan/trainer.py: 9810191 lines 57-76, b5bcd76 70-91; a dataclass, which raises
    TypeError): it was listed as unused and the job planned as pure FSDP. Now one line listing the fields
    (no close one: difflib's ratio of parallel_config to parallelism is 2 x 9 / 26 = 0.69 < 0.75);
    activation_checkpointing= gets activation_checkpoint."""
    body = JOB.replace("parallelism=ParallelismConfig", "parallel_config=ParallelismConfig")
    line = _error(_registry(tmp_path, body.format("seq_len=8192", "tensor_parallel_degree=8")))
    assert line.startswith("parallel_config: not a field of torchtitan's Trainer.Config (9810191 or b5bcd76); its "
                           "fields: model_spec, hf_assets_path, ")
    assert ", parallelism, " in line
    body = JOB.replace("parallelism=ParallelismConfig({})", "activation_checkpointing=ActivationCheckpointConfig()")
    line = _error(_registry(tmp_path, body.format("seq_len=8192")))
    assert line == ("activation_checkpointing: not a field of torchtitan's Trainer.Config (9810191 or b5bcd76); did "
                    "you mean activation_checkpoint?")


def test_the_model_folder_is_the_files_own_however_the_path_is_typed(tmp_path, monkeypatch):
    """nc57 #2: ``from . import model_registry`` takes torchtitan's model from the file's folder. Read
    as a bare file name from inside a qwen3/ folder the folder was '' and the job was planned as the
    default llama3; now the path is resolved: qwen3's flavor 8B is refused as it is by its full path,
    and a llama3/ folder gives llama3-8b either way."""
    for model, catalog in (("llama3", "llama3-8b"), ("qwen3", None)):
        path = _registry(tmp_path, JOB.format("seq_len=8192", ""), model=model)
        monkeypatch.chdir(path.parent)
        for p in (path, Path(path.name), Path("..") / model / path.name):
            if catalog:
                assert _read(p, None, cluster="dgx-h100", nodes=1).tables["model"]["catalog"] == catalog
            else:
                assert _error(p).startswith("model_spec: torchtitan model 'qwen3' flavor '8B' is not one meshplan maps")


def test_several_functions_need_config_and_a_wrong_name_gets_the_close_one():
    """The registry holds two functions: without --config the line lists them; a near name is offered."""
    line = _error(REGISTRY)
    assert line.startswith("--config: ") and "defines 2 config functions (llama3_8b_128k, llama3_8b_tp2)" in line
    assert _error(REGISTRY, "llama3_8b_tp") == (f"--config: 'llama3_8b_tp' is not a function of {REGISTRY}; did you "
                                               f"mean llama3_8b_tp2?")


def test_statements_that_depend_on_a_run_and_mixed_names_are_refused(tmp_path):
    """An ``if`` in the function (line 7: three import lines and a blank before ``def``), and
    9810191's seq_len beside b5bcd76's max_context_length."""
    body = "def job():\n    config = base()\n    if True:\n        config.training.steps = 1\n    return config\n"
    assert "line 7: 'if True:' is not read" in _error(_registry(tmp_path, body))
    line = _error(_registry(tmp_path, JOB.format("seq_len=8192, max_context_length=8192", "")))
    assert line.startswith("training.seq_len: torchtitan 9810191's name beside b5bcd76's training.max_context_length")


def test_a_base_function_of_another_file_is_named(tmp_path):
    """torchtitan_recipes (b5bcd76 torchtitan_recipes/tests/h100.py 9-26) builds on functions it imports:
    ``config = llama3_debugmodel()`` of torchtitan.models.llama3.config_registry, then ``config.a.b = ...``.
    meshplan reads one file: the line names the function, its module and the two ways out."""
    body = ("from torchtitan.models.llama3.config_registry import llama3_debugmodel\n\n"
            "def tp2():\n    config = llama3_debugmodel()\n    config.parallelism.tensor_parallel_degree = 2\n"
            "    return config\n")
    line = _error(_registry(tmp_path, body))
    assert line.endswith("line 10: tp2() builds on llama3_debugmodel() of torchtitan.models.llama3.config_registry, "
                         f"which meshplan does not read from {tmp_path / 'llama3' / 'config_registry.py'}: import "
                         "that file with --config llama3_debugmodel, or write the job's Trainer.Config(...) in this one")


def test_float8_tp_is_noted_for_9810191s_names():
    """llama3_8b_tp2 (float8, tp 2, tensorwise): planned with float8 TP as 9810191 runs it; the note names
    1786292 (#2963), after which torchtitan has no float8 TP."""
    imp = _read(REGISTRY, "llama3_8b_tp2", cluster="dgx-h100", nodes=2)
    assert "fp8_tp" not in imp.tables["training"]
    assert any(n.startswith("float8 TP planned on") and "1786292" in n for n in imp.notes)


def test_cli_import_and_step_of_a_registry(tmp_path, capsys):
    """``import torchtitan FILE --config NAME`` writes the TOML (its [source] naming the file and the
    function, which export -o FILE.py of the TOML writes back: ttexport), ``import auto`` detects it,
    ``step`` plans it; --config on a job TOML is refused."""
    out = tmp_path / "tp2.toml"
    assert _main("import", "torchtitan", REGISTRY, "--config", "llama3_8b_tp2", "--cluster", "dgx-h100", "--nodes", 2,
                 "-o", out) == 0
    text = out.read_text()
    assert '[source]\npath = "' in text and 'config = "llama3_8b_tp2"' in text and 'recompute = "layer"' in text and "ac_freq = 2" in text
    assert _main("import", "auto", B5, "--config", "llama3_8b_tp2", "--cluster", "dgx-h100", "--nodes", 2) == 0
    assert _main("step", B5, "--config", "llama3_8b_tp2", "--cluster", "dgx-h100", "--nodes", 2) == 0
    capsys.readouterr()
    assert _main("import", "torchtitan", DATA / "nc53" / "tt_8b_128k.toml", "--config", "x", "--cluster",
                 "dgx-h100", "--nodes", 2) == 2
    assert "--config: only for a torchtitan config_registry.py" in capsys.readouterr().err


def test_a_torchtitan_override_on_the_command_line_says_where_to_write_it(capsys):
    """nc57 #5: ``--parallelism.tensor_parallel_degree 8`` (torchtitan's tyro override) was click's
    "No such option ...; see --help": now one line saying overrides are not read and where the value
    goes in the file; another unknown option keeps click's words."""
    assert _main("import", "auto", REGISTRY, "--config", "llama3_8b", "--cluster", "dgx-h100", "--nodes", 2,
                 "--parallelism.tensor_parallel_degree", 8) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --parallelism.tensor_parallel_degree: torchtitan's command-line overrides are not read; fix: write it "
        "in the job file: config.parallelism.tensor_parallel_degree = VALUE in the config function (config_registry.py), "
        "or tensor_parallel_degree under [parallelism] in a job TOML")
    assert _main("plan", REGISTRY, "--nodez", 3) == 2
    assert "No such option: --nodez" in capsys.readouterr().err


def test_torchtitans_config_dump_is_refused_naming_the_registry(tmp_path):
    """torchtitan's ``debug.save_config_file`` JSON (Trainer.Config.to_dict, b5bcd76 trainer.py:201-238)
    is not read (its activation checkpoint class is gone): one line naming the registry route."""
    dump = tmp_path / "job_config.json"
    dump.write_text('{"hf_assets_path": "x", "model_spec": {"name": "llama3", "flavor": "8B"}, "parallelism": {}}')
    with pytest.raises(ConfigError) as e:
        load_any(dump, None, ImportOptions(cluster="dgx-h100", nodes=1))
    assert "torchtitan's dump of a resolved job config (debug.save_config_file) is not read" in str(e.value)
    assert "--config NAME" in str(e.value)


@pytest.mark.parametrize("base, line, recompute", [
    ("seq_len=8192", 'config.activation_checkpoint.selective_ac_option = "op"', "op"),
    ("seq_len=8192", 'config.activation_checkpoint.mode = "full"', "full"),
    ("max_context_length=8192", "config.activation_checkpoint.preserve_rng_state = False", "op"),
])
def test_a_field_set_on_the_default_activation_checkpoint(tmp_path, base, line, recompute):
    """``config.activation_checkpoint.k = v`` on torchtitan's default object: 9810191's
    ActivationCheckpointConfig() (mode "selective", option "2" unless set: configs.py:260-263 there)
    takes option "op" (per-op SAC, cp 1) or mode "full"; b5bcd76's default SelectiveAC.Config()
    (trainer.py:108) stays per-op SAC whatever its other fields."""
    body = (f"def base():\n    return Trainer.Config(model_spec=model_registry(\"8B\"), training=TrainingConfig({base}))"
            f"\n\ndef job():\n    config = base()\n    {line}\n    return config\n")
    imp = _read(_registry(tmp_path, body), "job", cluster="dgx-h100", nodes=1)
    assert imp.tables["training"]["recompute"] == recompute


def _moe_registry(tmp_path: Path, backend: str) -> Path:
    body = (f"def job():\n    return Trainer.Config(model_spec=model_registry(\"16B\", moe_comm_backend=\"{backend}\"),"
            f" training=TrainingConfig(max_context_length=4096, num_tokens_per_microbatch_per_dp_rank=16384), "
            f"parallelism=ParallelismConfig(expert_parallel_degree=8))\n")
    return _registry(tmp_path, body, "deepseek_v3")


def test_moe_backend_deepep_and_hybridep(tmp_path):
    """b5bcd76's deepseek_v3 model_registry takes moe_comm_backend (models/deepseek_v3/__init__.py:616-629):
    "deepep" is read as the job TOML's expert_parallel_comm_backend (training.moe_dispatcher deepep),
    "hybridep" refused as that key is, the line naming the .py's field. 16384 tokens / 4096 = micro-batch 4;
    deepseek_v3 16B is deepseek-v2-lite."""
    read = _read(_moe_registry(tmp_path, "deepep"), None, cluster="dgx-h100", nodes=1)
    assert read.tables["model"] == {"catalog": "deepseek-v2-lite"}
    assert read.tables["training"]["moe_dispatcher"] == "deepep" and read.tables["training"]["micro_batch"] == 4
    line = _error(_moe_registry(tmp_path, "hybridep"))
    assert line.startswith("model_spec moe_comm_backend: 'hybridep' runs HybridEP's")
