"""``export --to torchtitan`` as a torchtitan Python config (nc57 #6: from a config_registry.py the
export wrote a v0.2.2 job TOML, which torchtitan from 9810191 does not read, and dropped the values
the .py stated): meshplan/interop/torchtitan_pywrite.py, torchtitan_pycode.py.

Each written file is run here against a stand-in ``torchtitan`` package (:class:`_Stub`: every name
imported from ``torchtitan.*`` is a recorder, a call returns ``(name, args, kwargs)``), so a name the
file does not import, or imports from nowhere, fails; the tree it returns is compared with the values
derived by hand, and the file imported back is the plan it was written from (the round trip).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path

import pytest

from cli_run import run_main as _main
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences

DATA = Path(__file__).parent / "data"
REGISTRY = DATA / "ttpy" / "llama3" / "config_registry.py.txt"
B5 = DATA / "ttpy" / "llama3" / "config_registry_b5bcd76.py.txt"
H100 = ("--cluster", "dgx-h100", "--nodes")

#: A llama3 70B job in torchtitan b5bcd76's names (its llama3_70b of models/llama3/config_registry.py with
#: pp 2 Interleaved1F1B, float8, compile and async TP, as nc57's new_registry.py): 1 x 8192 tokens a
#: micro-batch, 8 pp micro-batches, 256 x 8192 tokens a step; a dataset meshplan does not read.
B5_70B = '''
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.optimizer import default_adamw
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.components.data import ConcatThenSplitPackingConfig, GrainDataLoader
from torchtitan.trainer import Trainer

from . import model_registry


def llama3_70b() -> Trainer.Config:
    return Trainer.Config(
        hf_assets_path="./assets/hf/Llama-3.1-70B",
        model_spec=model_registry("70B", converters=[Float8LinearConverter.Config(filter_fqns=["lm_head"])]),
        optimizer=default_adamw(lr=1.5e-4),
        training=TrainingConfig(num_tokens_per_microbatch_per_dp_rank=8192, max_context_length=8192,
                                num_tokens_per_train_step=256 * 8192, steps=1000, disable_cuda_graphs=True),
        dataloader=GrainDataLoader.Config(dataset=ConcatThenSplitPackingConfig(dataset=DATASETS["c4"])),
        parallelism=ParallelismConfig(tensor_parallel_degree=8, pipeline_parallel_degree=2,
                                      pipeline_parallel_schedule="Interleaved1F1B", num_pp_microbatches=8),
        checkpoint=CheckpointManager.Config(interval=500),
        activation_checkpoint=FullAC.Config(),
        compile=CompileConfig(enable=True, enable_async_tensor_parallel=True),
    )
'''


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``torchtitan.*`` as modules whose every attribute is a recorder (:func:`_rec`)."""

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] == "torchtitan" \
            else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = lambda attr: _rec(attr)  # type: ignore[method-assign]
        return module

    def exec_module(self, module):
        pass


def _rec(name: str):
    """A callable named ``name``: called, ``(name, args, kwargs)``; ``.Config`` another, named
    ``name.Config``; ``name["k"]`` its text."""
    class Rec:
        def __call__(self, *args, **kwargs):
            return (name, args, kwargs)

        def __getattr__(self, attr):
            return _rec(f"{name}.{attr}")

        def __getitem__(self, key):
            return f"{name}[{key!r}]"
    return Rec()


def _run(path: Path, function: str):
    """The tree function ``function`` of the written file returns, run against :class:`_Stub`."""
    stub = _Stub()
    sys.meta_path.insert(0, stub)
    try:
        scope: dict = {}
        exec(compile(path.read_text(), str(path), "exec"), scope)  # noqa: S102 - our own written file
        return scope[function]()
    finally:
        sys.meta_path.remove(stub)
        for m in [m for m in sys.modules if m.split(".")[0] == "torchtitan"]:
            del sys.modules[m]


def _same_plan(source: Path, written: Path, function: str, nodes: int, source_function: str | None = None):
    """The written file imported back plans what the source does (no field differs)."""
    opts = dict(cluster="dgx-h100", nodes=nodes)
    a = load_any(source, "torchtitan", ImportOptions(**opts, job_config=source_function or function))
    b = load_any(written, "torchtitan", ImportOptions(**opts, job_config=function))
    assert differences(a, b) == []


def test_a_9810191_function_is_written_in_its_names_with_its_other_settings(tmp_path, capsys):
    """llama3_8b_tp2 (builds on llama3_8b_128k, seq 8192, cp 1, SAC every 2nd layer) on one dgx-h100:
    world 8 / tp 2 = dp_shard 4 (the source's -1 resolved, listed as written otherwise); local batch 1,
    global 64 (64 / (1 x 4) = 16 accumulation steps), seq 8192; the float8 converter with fp8
    all-gather (a 9810191 field) kept under model_converters, and float8 TP, which 9810191 applies for
    any Float8LinearConverter, comes back on: nothing is "not expressed" (the v0.2.2 TOML lost fp8_tp).
    Kept as the source states them: steps 2000, lr 1e-5, warmup 50, dataset c4, hf_assets_path,
    checkpoint interval 200; the function is written whole (no call of llama3_8b_128k)."""
    out = tmp_path / "job.py"
    assert _main("export", REGISTRY, "--config", "llama3_8b_tp2", *H100, 1, "--to", "torchtitan", "-o", out) == 0
    err = capsys.readouterr().out
    assert "not expressed" not in err and "parallelism.data_parallel_shard_degree -1 -> 4" in err
    assert "carried unchanged from" in err and "lr_scheduler, dataloader" in err and "training.steps" in err
    name, args, kw = _run(out, "llama3_8b_tp2")
    assert name == "Trainer.Config" and args == ()
    assert kw["training"][2] | {} == {"local_batch_size": 1, "global_batch_size": 64, "seq_len": 8192, "max_norm": 1.0,
                                      "steps": 2000, "dtype": "float32", "mixed_precision_param": "bfloat16",
                                      "mixed_precision_reduce": "float32"}
    par = kw["parallelism"][2]
    assert (par["data_parallel_shard_degree"], par["tensor_parallel_degree"], par["context_parallel_degree"],
            par["pipeline_parallel_degree"]) == (4, 2, 1, 1)
    assert kw["activation_checkpoint"] == ("ActivationCheckpointConfig", (), {"mode": "selective",
                                                                             "selective_ac_option": "2"})
    assert kw["model_spec"] == ("model_registry", ("8B",), {})
    f8 = kw["model_converters"][2]["converters"][0]
    assert f8[0] == "Float8LinearConverter.Config" and f8[2]["enable_fsdp_float8_all_gather"] is True
    assert f8[2]["filter_fqns"] == ["output"]
    assert kw["optimizer"][2] == {"name": "AdamW", "lr": 1e-5, "implementation": "fused"}
    assert kw["lr_scheduler"] == ("LRSchedulersContainer.Config", (), {"warmup_steps": 50})
    assert kw["dataloader"] == ("HuggingFaceTextDataLoader.Config", (), {"dataset": "c4"})
    assert kw["hf_assets_path"] == "./assets/hf/Llama-3.1-8B"
    assert kw["checkpoint"][2] == {"enable": True, "interval": 200}
    assert kw["compile"][2] == {"enable": True, "components": ["model", "loss"]}
    assert "llama3_8b_128k" not in out.read_text() and "from torchtitan.models.llama3 import model_registry" in \
        out.read_text()
    _same_plan(REGISTRY, out, "llama3_8b_tp2", 1)


def test_the_sources_assets_path_stays_when_the_model_is_given_by_name(tmp_path, capsys):
    """--model llama3-8b names the model, so the import reads no hf_assets_path and the plan holds
    none; the source's "./assets/hf/Llama-3.1-8B" is still what the job loads its tokenizer from, so it
    is carried as written, not dropped and then listed as torchtitan's default test tokenizer (found
    on the nc57 registry at integration)."""
    team = tmp_path / "team"  # a team's own folder: not a torchtitan model's name, so --model is needed
    team.mkdir()
    (team / "config_registry.py").write_text(REGISTRY.read_text())
    out = tmp_path / "job.py"
    assert _main("export", team / "config_registry.py", "--config", "llama3_8b_tp2", *H100, 1, "--model", "llama3-8b",
                 "--to", "torchtitan", "-o", out) == 0
    err = capsys.readouterr().out
    assert "hf_assets_path" not in err.split("written otherwise")[1].split("\n")[0]
    assert "tests/assets/tokenizer" not in err
    assert _run(out, "llama3_8b_tp2")[2]["hf_assets_path"] == "./assets/hf/Llama-3.1-8B"


def test_b5bcd76_names_fold_the_batch_into_tokens_as_the_source(tmp_path, capsys):
    """nc57 #6's b5bcd76 70B job on 8 dgx-h100 (world 64): pp 2 x tp 8 -> dp_shard 64 / 16 = 4; 8192
    tokens a micro-batch = 1 sequence of max_context_length 8192; 8 pp micro-batches; 2097152 tokens a
    step = 256 sequences (256 / (8 x 4) = 8 schedule runs): written back as
    num_tokens_per_microbatch_per_dp_rank 8192, num_pp_microbatches 8, num_tokens_per_train_step
    2097152, the numbers the user had to work out. The output Linear is lm_head (b3cf840), in the
    converter's filter and in the 4 model parts (Interleaved1F1B: 2 per rank; 80 layers + the
    embedding and output counted as a layer each: 82 // 4 = 20, +1 for the first two, less the ends:
    20, 21, 20, 19); async TP under compile; model_compile_enabled True (compile of the model on);
    the dataset (``DATASETS["c4"]``, source text) kept with its imports."""
    src = tmp_path / "llama3" / "reg.py"
    src.parent.mkdir()
    src.write_text(B5_70B)
    out = tmp_path / "job70.py"
    assert _main("export", src, *H100, 8, "--to", "torchtitan", "-o", out, "--name", "llama3_70b_pp2") == 0
    assert "not expressed" not in capsys.readouterr().out
    _, _, kw = _run(out, "llama3_70b_pp2")
    tr, par = kw["training"][2], kw["parallelism"][2]
    assert (tr["num_tokens_per_microbatch_per_dp_rank"], tr["max_context_length"], tr["num_tokens_per_train_step"],
            tr["steps"], tr["disable_cuda_graphs"]) == (8192, 8192, 2097152, 1000, True)
    assert "local_batch_size" not in tr and "pipeline_parallel_microbatch_size" not in par
    assert (par["data_parallel_shard_degree"], par["tensor_parallel_degree"], par["pipeline_parallel_degree"],
            par["num_pp_microbatches"], par["pipeline_parallel_schedule"]) == (4, 8, 2, 8, "Interleaved1F1B")
    parts = par["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [20, 21, 20, 19]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    assert "disable_loss_parallel" not in par and "enable_async_tensor_parallel" not in par  # not b5bcd76 fields
    assert kw["compile"][2] == {"enable": True, "enable_async_tensor_parallel": True, "components": ["model", "loss"]}
    assert kw["activation_checkpoint"] == ("FullAC.Config", (), {})
    assert kw["model_spec"] == ("model_registry", ("70B",), {"converters": [
        ("Float8LinearConverter.Config", (), {"filter_fqns": ["lm_head"], "model_compile_enabled": True})]})
    assert kw["optimizer"] == ("default_adamw", (), {"lr": 1.5e-4})
    assert kw["dataloader"] == ("GrainDataLoader.Config", (), {
        "dataset": ("ConcatThenSplitPackingConfig", (), {"dataset": "DATASETS['c4']"})})
    _same_plan(src, out, "llama3_70b_pp2", 8, "llama3_70b")


def test_from_a_plan_the_py_suffix_writes_b5bcd76s_names(tmp_path, capsys):
    """A meshplan TOML (llama3-70b on 16 dgx-h100, dp 16 x tp 8, full AC) with -o FILE.py: b5bcd76's
    names (the newest read), the function named after the file; what no value states is listed with
    torchtitan's defaults. The plan's 238fa99 model code (three q/k/v GEMMs) is not b5bcd76's (one
    wqkv): the round trip says so, as the TOML export's note did."""
    out = tmp_path / "run.py"
    assert _main("export", "examples/llama3-70b_128xh100_dp16-tp8.toml", "--to", "torchtitan", "-o", out) == 0
    err = capsys.readouterr().out
    assert "not stated, set before running" in err and "training.steps (10000)" in err
    assert "not expressed in torchtitan: training.op_sac_policy: '238fa99' -> 'b5bcd76'" in err
    _, _, kw = _run(out, "llama3_70b_128xh100_dp16_tp8")
    par = kw["parallelism"][2]
    assert (par["data_parallel_shard_degree"], par["tensor_parallel_degree"]) == (16, 8)
    assert kw["model_spec"] == ("model_registry", ("70B",), {})


def test_what_cannot_be_written_is_one_line_and_nothing_is_overwritten(tmp_path, capsys):
    """Layer SAC every 2nd layer has no b5bcd76 class (c5d93d1: -o FILE.py of a plan writes b5bcd76's names); -o's suffix against the revision;
    --name for a job TOML or not a Python name; an existing -o is refused (as every export's)."""
    def err(*argv):
        code = _main("export", *argv)
        return code, capsys.readouterr().err.strip().splitlines()

    plan = tmp_path / "tp2.toml"  # the 9810191 job imported: layer SAC every 2nd layer (ac_freq 2)
    assert _main("import", "torchtitan", REGISTRY, "--config", "llama3_8b_tp2", *H100, 1, "-o", plan) == 0
    # its [source] is the 9810191 .py, written back in its own names (ttexport): b5bcd76's asked for by name
    code, lines = err(plan, "--to", "torchtitan", "-o", tmp_path / "a.py", "--torchtitan-revision", "b5bcd76")
    assert code == 2 and lines[-1].startswith("error: --torchtitan-revision: activation_checkpoint mode 'selective', "
                                              "selective_ac_option '2': torchtitan b5bcd76 has op-level SAC")
    code, lines = err(B5, *H100, 1, "--config", "llama3_8b_tp2", "--to", "torchtitan", "-o", tmp_path / "a.toml",
                      "--torchtitan-revision", "b5bcd76")
    assert code == 2 and lines[-1].endswith("torchtitan b5bcd76 reads a Python config function; name it a.py")
    code, lines = err(B5, *H100, 1, "--config", "llama3_8b_tp2", "--to", "torchtitan", "-o", tmp_path / "a.toml",
                      "--name", "x")
    assert code == 2 and lines[-1].startswith("error: --name: names the function of a torchtitan Python config")
    code, lines = err(B5, *H100, 1, "--config", "llama3_8b_tp2", "--to", "torchtitan", "-o", tmp_path / "a.py",
                      "--name", "1-x")
    assert code == 2 and "is not a Python function name" in lines[-1]
    mine = tmp_path / "mine.py"
    mine.write_text("# the user's\n")
    code, lines = err(B5, *H100, 1, "--config", "llama3_8b_tp2", "--to", "torchtitan", "-o", mine)
    assert code == 2 and mine.read_text() == "# the user's\n"


def test_a_name_of_the_source_function_is_refused_naming_the_field(tmp_path, capsys):
    """The b5bcd76 file's ``model_compile_enabled=(compile_config.enable and ...)`` is written as the
    plan's literal (True: compile of the model on); an unread value that uses a local of the function
    (``dump_folder=base + "/outputs"``) has no such name in the written function: one line naming the
    field."""
    src = tmp_path / "llama3" / "reg.py"
    src.parent.mkdir()
    src.write_text(B5.read_text().replace("        compile=compile_config,\n",
                                          "        compile=compile_config,\n"
                                          "        dump_folder=base + \"/outputs\",\n")
                   .replace("    compile_config = CompileConfig(", "    base = \"/runs\"\n    compile_config = CompileConfig("))
    code = _main("export", src, "--config", "llama3_8b_tp2", *H100, 1, "--to", "torchtitan", "-o", tmp_path / "o.py")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: dump_folder: uses 'base'")
    assert not (tmp_path / "o.py").exists()
    out = tmp_path / "b5.py"
    assert _main("export", B5, "--config", "llama3_8b_tp2", *H100, 1, "--to", "torchtitan", "-o", out) == 0
    body = "\n".join(line for line in out.read_text().splitlines() if not line.startswith("#"))  # the header
    assert "model_compile_enabled=True" in body and "compile_config" not in body
    _same_plan(B5, out, "llama3_8b_tp2", 1)


@pytest.mark.parametrize("argv", [("-o", "-"), ("-o", "{tmp}/x.toml")])
def test_the_job_toml_stays_for_toml_and_stdout_follows_the_source(tmp_path, capsys, argv):
    """``-o x.toml`` from a .py still writes v0.2.2's job TOML (what the suffix asks); ``-o -`` from
    a .py writes its Python (the source's own names)."""
    o = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _main("export", REGISTRY, "--config", "llama3_8b_tp2", *H100, 1, "--to", "torchtitan", *o) == 0
    text = capsys.readouterr().out if o[1] == "-" else Path(o[1]).read_text()
    assert ("def llama3_8b_tp2() -> Trainer.Config:" in text) == (o[1] == "-")
    assert ("[parallelism]" in text) == (o[1] != "-")


def test_fields_set_on_torchtitans_default_objects(tmp_path, capsys):
    """``config.metrics.log_freq = 5`` on a base that has no metrics= is written as
    ``MetricsProcessor.Config(log_freq=5)`` (Trainer.Config's default class of the field); on
    ``dataloader``, whose default class (BaseDataLoader.Config) is no loader to run, one line naming it.
    tp 2 on 8 GPUs: dp_shard 4; local batch 2 and no global: torchtitan's -1, local x dp = 8."""
    src = tmp_path / "llama3" / "reg.py"
    src.parent.mkdir()
    src.write_text('from torchtitan.config import TrainingConfig\nfrom torchtitan.trainer import Trainer\n'
                   'from . import model_registry\n\n\ndef base():\n    return Trainer.Config(model_spec=model_registry('
                   '"8B"), training=TrainingConfig(local_batch_size=2, seq_len=8192))\n\n\ndef job():\n'
                   '    config = base()\n    config.metrics.log_freq = 5\n    config.parallelism.tensor_parallel_degree = 2\n'
                   '    return config\n\n\ndef job2():\n    config = base()\n    config.dataloader.dataset = "c4"\n'
                   '    return config\n')
    out = tmp_path / "o.py"
    assert _main("export", src, "--config", "job", *H100, 1, "--to", "torchtitan", "-o", out) == 0
    _, _, kw = _run(out, "job")
    assert kw["metrics"] == ("MetricsProcessor.Config", (), {"log_freq": 5})
    assert (kw["training"][2]["local_batch_size"], kw["training"][2]["global_batch_size"]) == (2, 8)
    assert kw["parallelism"][2]["data_parallel_shard_degree"] == 4
    _same_plan(src, out, "job", 1)
    capsys.readouterr()
    assert _main("export", src, "--config", "job2", *H100, 1, "--to", "torchtitan", "-o", tmp_path / "p.py") == 2
    assert capsys.readouterr().err.strip().endswith("error: dataloader: set on torchtitan's default object "
                                                    "(config.dataloader.dataset = ...), whose class meshplan does not "
                                                    "know here: write dataloader=ClassName.Config(...) in the source "
                                                    "to export it")


def test_another_revisions_names_for_a_registry_are_refused_and_the_toml_says_how(tmp_path, capsys):
    """A 9810191 function asked for in b5bcd76's names: its kept values (OptimizersContainer.Config(name=,
    lr=), which b5bcd76's optimizer has no field for) cannot follow, one line says what to do; its
    job TOML (-o FILE.toml) names -o FILE.py in a note."""
    code = _main("export", REGISTRY, "--config", "llama3_8b_128k", *H100, 4, "--to", "torchtitan", "-o",
                 tmp_path / "x.py", "--torchtitan-revision", "b5bcd76")
    out = capsys.readouterr()
    assert code == 2 and out.err.strip().splitlines()[-1].startswith(
        "error: --torchtitan-revision: b5bcd76: config_registry.py.txt is written in torchtitan 9810191's names")
    assert _main("export", REGISTRY, "--config", "llama3_8b_128k", *H100, 4, "--to", "torchtitan", "-o",
                 tmp_path / "x.toml") == 0
    assert "-o FILE.py writes its function back in its own names" in capsys.readouterr().out


def test_from_a_job_toml_two_keys_are_carried_and_the_others_named(tmp_path, capsys):
    """tests/data/nc53/tt_8b_128k.toml (v0.2.2: 8B, 128k, cp 16 x tp 2 on 16 dgx-h200, world 128: dp_shard
    128 / 32 = 4) as 9810191's Python: hf_assets_path and training.steps 2000 have the same field there and
    are carried; [lr_scheduler], dump_folder, optimizer.lr, training.dataset (a dataloader's since
    9810191) and the rotate method (its default, allgather) are named in one line, not carried. The plan
    comes back but for float8 TP: v0.2.2 leaves it off for the converter named "quantize.linear.float8"
    (the TOML's import: fp8_tp false), 9810191 applies it for any Float8LinearConverter
    (models/llama3/parallelize.py:90-100), which the header's round trip says."""
    toml, out = DATA / "nc53" / "tt_8b_128k.toml", tmp_path / "cpt.py"
    assert _main("export", toml, "--cluster", "dgx-h200", "--nodes", 16, "--to", "torchtitan", "-o", out,
                 "--torchtitan-revision", "9810191") == 0
    err = capsys.readouterr().out
    assert "not carried from " in err and err.split("not carried from ")[1].split("\n")[0].endswith(
        "(torchtitan v0.2.2's keys; write them in the function by hand): [lr_scheduler], job.dump_folder, "
        "optimizer.lr, training.dataset, parallelism.context_parallel_rotate_method")
    _, _, kw = _run(out, "tt_8b_128k")  # named after the TOML
    assert kw["hf_assets_path"] == "./assets/hf/Llama-3.1-8B" and kw["training"][2]["steps"] == 2000
    par = kw["parallelism"][2]
    assert (par["data_parallel_shard_degree"], par["context_parallel_degree"], par["tensor_parallel_degree"]) == \
        (4, 16, 2)
    a = load_any(toml, "torchtitan", ImportOptions(cluster="dgx-h200", nodes=16))
    b = load_any(out, "torchtitan", ImportOptions(cluster="dgx-h200", nodes=16, job_config="tt_8b_128k"))
    assert differences(a, b) == ["training.fp8_tp: False -> True"]
    assert "not expressed in torchtitan: training.fp8_tp: False -> True" in err
