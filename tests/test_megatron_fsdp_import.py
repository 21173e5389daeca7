"""Megatron-LM imports in Megatron-LM's own terms (newcomer trial 7, issue 11): the four
``--data-parallel-sharding-strategy`` values of Megatron FSDP, the sharded data axis named
``dp_shard``, the distributed optimizer's dp x cp group, and etp defaulting to tp."""

from pathlib import Path

import pytest
from cli_run import run_main as _main, plan_file as _plan
from test_newcomer21 import MIXTRAL_ARGS

from meshplan.config import config_from_dict
from meshplan.interop import megatron
from meshplan.interop.common import ImportOptions

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

MIXTRAL_TOML = """[model]
catalog = "mixtral-8x7b"
[cluster]
system = "dgx-h100"
nodes = 4
[training]
framework = "{framework}"
global_batch = 256
seq_len = 4096
sharding = "zero1"
recompute = "full"
[mesh]
names = ["dp", "tp", "ep"{etp_name}]
shape = [16, 2, 8{etp}]
sequence_parallel = true
"""


@pytest.mark.parametrize("framework, etp_name, etp, want", [
    ("megatron", "", "", 2),  # Megatron-LM: --expert-tensor-parallel-size defaults to tp (arguments.py:587-588)
    ("torch", "", "", 1),  # torchtitan's expert_tensor_parallel_degree defaults to 1
    ("megatron", ', "etp"', ", 1", 1),  # a given etp is kept
])
def test_megatron_toml_etp_defaults_to_tp(tmp_path, framework, etp_name, etp, want):
    path = tmp_path / "mix.toml"
    path.write_text(MIXTRAL_TOML.format(framework=framework, etp_name=etp_name, etp=etp))
    plan = _plan(path)
    assert plan.mesh.etp == want
    # MoE tokens per rank (compute.routing.routed_tokens): Megatron-LM routes each rank's own SP shard
    # at any etp, T = 4096 / tp 2 = 2048 (token_dispatcher.py:705-724 at d98e8a6; the etp ranks then
    # all-gather what they received, moeetp f09458e3); torch at etp 1: T = 4096 x etp 1 / tp 2 = 2048
    note = [n for n in plan.notes if n.startswith("MoE dropless")][0]
    assert ("tokens per rank T = 4096 local tokens / tp 2 = 2048," if framework == "megatron" else
            "tokens per rank T = 4096 local tokens x etp 1 / tp 2 = 2048,") in note
    # the etp all-gather only at etp 2: T x top_k = 2048 x 2 = 4096 received rows, 2 x 4096 = 8192 gathered
    assert [n.split(",")[0] for n in plan.notes if n.startswith("MoE etp")] == (
        ["MoE etp 2 (Megatron-LM): each rank's 4096 received rows all-gathered over etp"] if want == 2 else [])
    said = [n for n in plan.config.notes if n.startswith("mesh.etp not given")]
    assert said == (["mesh.etp not given: 2, the tp degree, as Megatron-LM defaults --expert-tensor-parallel-size "
                     "to --tensor-model-parallel-size (framework megatron); for experts without tp write in [mesh] "
                     'names = ["dp", "tp", "ep", "etp"] and shape = [16, 2, 8, 1]'] if want == 2 else [])


@pytest.mark.parametrize("mesh", ['names = ["dp", "tp", "ep"]\nshape = [16, 2, 8]',
                                  'order = "tp-ep-dp"\ndegrees = {tp = 2, ep = 8, dp = 16}'])
def test_the_etp_notes_fix_followed_literally_gives_etp_1(tmp_path, mesh):
    """Handed case C9 under megatron with MoE: the note's fix was "give mesh etp = 1", and ``etp = 1``
    in [mesh] is an unknown key. The note now quotes the [mesh] lines to write; written as they
    stand (each replacing the line of its key: names and shape, or degrees), the config reads with etp 1 and
    no note; ``etp = 1`` as a key of [mesh] names the same lines."""
    from meshplan.config import load_config
    from meshplan.errors import ConfigError

    path = tmp_path / "mix.toml"
    head = MIXTRAL_TOML.split("[mesh]")[0] + "[mesh]\nsequence_parallel = true\n"
    path.write_text(head.format(framework="megatron") + mesh + "\n")
    cfg = load_config(path)
    (note,) = [n for n in cfg.notes if n.startswith("mesh.etp not given")]
    fix = note.split("for experts without tp write in [mesh] ")[1]
    lines = dict(ln.split(" = ", 1) for ln in mesh.split("\n"))  # the note's lines replace the same keys
    lines |= dict(ln.split(" = ", 1) for ln in fix.split(" and "))
    path.write_text(head.format(framework="megatron") + "\n".join(f"{k} = {v}" for k, v in lines.items()) + "\n")
    fixed = load_config(path)
    deg = (dict(zip(fixed.mesh.names, fixed.mesh.shape)) if fixed.mesh.names else fixed.mesh.degrees)
    assert deg == {"dp": 16, "tp": 2, "ep": 8, "etp": 1}
    assert not [n for n in fixed.notes if n.startswith("mesh.etp not given")]
    path.write_text(head.format(framework="megatron") + mesh + "\netp = 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == f"mesh.etp: unknown key in [mesh]; etp is a mesh axis: write {fix}"


def test_megatron_zero1_groups_name_the_dp_cp_group(tmp_path, capsys):
    """cp 2 x tp 2 x dp 4 on 16 GPUs: the derived dp x cp group (8 ranks, 0,2,...,14) is where
    the distributed optimizer shards; torchtitan's name for it, fsdp, stays under torch (the import's
    Megatron-LM-only keys removed with the framework: overlap_grad_reduce, megatron_runtime)."""
    args = tmp_path / "z1.args"
    args.write_text((EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text().replace(
        "--pipeline-model-parallel-size 2", "--context-parallel-size 2 --cp-comm-type all_gather"))
    assert _main("groups", args, "--cluster", "dgx-h100", "--nodes", 2) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "0,2,4,6,8,10,12,14 " in line]
    assert [r.split("│")[1].strip() for r in rows] == ["dp x cp (distributed optimizer)", "loss"]
    toml = tmp_path / "z1.toml"
    assert _main("import", "megatron", args, "--cluster", "dgx-h100", "--nodes", 2, "-o", toml) == 0
    torch = tmp_path / "torch.toml"
    torch.write_text(toml.read_text().replace('framework = "megatron"', 'framework = "torch"').replace(
        "overlap_grad_reduce = true\n", "").replace('megatron_runtime = "core"\n', ""))  # Megatron-LM's keys
    capsys.readouterr()
    assert _main("groups", torch) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "0,2,4,6,8,10,12,14 " in line]
    assert [r.split("│")[1].strip() for r in rows] == ["fsdp", "loss"]


#: Megatron FSDP's --data-parallel-sharding-strategy (megatron/core/distributed/fsdp/src/megatron_fsdp/
#: param_and_grad_buffer.py:2325-2345 at NVIDIA/Megatron-LM d98e8a6) -> (sharding, megatron_fsdp key, data axis).
STRATEGIES = {"no_shard": ("none", True, "dp"), "optim": ("zero1", True, "dp"),
              "optim_grads": ("zero2", False, "dp"), "optim_grads_params": ("zero3", False, "dp_shard")}


def _fsdp_args(tmp_path, strategy: str) -> Path:
    """The Llama 3 8B example (tp 2, pp 2, dp 4 on 16 H100) under Megatron FSDP."""
    text = (EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text().replace(
        "--use-distributed-optimizer --overlap-grad-reduce",
        f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}")
    path = tmp_path / f"{strategy}.args"
    path.write_text(text)
    return path


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_megatron_fsdp_strategies_import_as_what_they_are_and_export_back(tmp_path, strategy):
    from meshplan.config import load_config
    from meshplan.interop.export import export, reimport_options
    from meshplan.interop.foreign import load_any
    sharding, fsdp, data = STRATEGIES[strategy]
    toml = tmp_path / "imported.toml"
    assert _main("import", "megatron", _fsdp_args(tmp_path, strategy), "--cluster", "dgx-h100", "--nodes", 2,
                 "-o", toml) == 0
    cfg = load_config(toml)
    assert (cfg.training.sharding, cfg.training.megatron_fsdp, cfg.mesh.names) == (sharding, fsdp, ["pp", data, "tp"])
    text, _ = export(cfg, "megatron", "test")
    lines = text.splitlines()
    assert "--use-megatron-fsdp" in lines and f"--data-parallel-sharding-strategy {strategy}" in lines
    # Megatron FSDP's optimizer (NVIDIA/Megatron-LM d98e8a6 sets it itself for v1; before ab43d43 it had to be
    # given): written beside --use-megatron-fsdp, and the re-import below still reads Megatron FSDP, not DDP
    assert lines.index("--use-distributed-optimizer") == lines.index("--use-megatron-fsdp") + 1
    back = tmp_path / "back.args"
    back.write_text(text)
    again = load_any(back, "megatron", reimport_options(cfg, "megatron"))
    assert again.training == cfg.training
    assert (again.mesh.names, again.mesh.shape) == (cfg.mesh.names, cfg.mesh.shape)


@pytest.mark.parametrize("strategy, words", [
    ("no_shard", "sharding none (Megatron FSDP, --data-parallel-sharding-strategy no_shard)"),
    ("optim", "sharding zero1 (Megatron FSDP, --data-parallel-sharding-strategy optim)")])
def test_megatron_fsdp_no_shard_and_optim_plan_as_ddp_named_as_fsdp(tmp_path, strategy, words):
    """no_shard and optim keep the whole gradient buffer and reduce it once per step, as Megatron
    DDP and its distributed optimizer do (is_delay_grad_reduce, megatron_fsdp.py:326-337): the
    same step time as the DDP plan of the same mesh, but the output names Megatron FSDP."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.report.text import print_plan
    from meshplan.schedule.steptime import step_time
    from meshplan.schedule.unit_sim import Overlap
    from meshplan.spec.wording import reduce_words
    toml = tmp_path / "fsdp.toml"
    assert _main("import", "megatron", _fsdp_args(tmp_path, strategy), "--cluster", "dgx-h100", "--nodes", 2,
                 "-o", toml) == 0
    cfg = load_config(toml)
    from dataclasses import replace
    ddp = replace(cfg, training=cfg.training.model_copy(update={"megatron_fsdp": False}))
    a, b = build_plan(cfg), build_plan(ddp)
    assert step_time(a, Overlap()).step_s == step_time(b, Overlap()).step_s
    assert [t.peak for t in a.timelines] == [t.peak for t in b.timelines]
    op = "all-reduce" if strategy == "no_shard" else "reduce-scatter (optim)"
    assert reduce_words(cfg.training, "", "x") == f"Megatron FSDP gradient {op} after the last micro-batch's backward"
    from rich.console import Console
    con = Console(width=400, record=True)
    print_plan(a, console=con)
    assert words + "," in con.export_text()


def test_megatron_fsdp_key_needs_framework_megatron(tmp_path):
    from meshplan.config import load_config
    from meshplan.errors import ConfigError
    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                    'global_batch = 8\nseq_len = 4096\nsharding = "zero1"\nmegatron_fsdp = true\n'
                    'zero12_engine = "deepspeed"\n[mesh]\nnames = ["dp"]\nshape = [8]\n')
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "megatron_fsdp is Megatron-LM's --use-megatron-fsdp" in str(e.value) and "\n" not in str(e.value)


def test_sharded_data_axis_is_dp_shard_in_every_table(tmp_path):
    """Megatron FSDP optim_grads_params (zero3) over dp 4: the mesh line, the groups table and the
    collective table all say dp_shard, as a DeepSpeed ZeRO-3 import does; a TOML that spells the
    axis dp prints it so too."""
    from meshplan.config import load_config
    from meshplan.plan import build_plan
    from meshplan.report.text import print_plan
    from rich.console import Console
    toml = tmp_path / "z3.toml"
    assert _main("import", "megatron", _fsdp_args(tmp_path, "optim_grads_params"), "--cluster", "dgx-h100",
                 "--nodes", 2, "-o", toml) == 0
    spelt_dp = tmp_path / "dp.toml"
    spelt_dp.write_text(toml.read_text().replace('"dp_shard"', '"dp"'))
    for path in (toml, spelt_dp):
        con = Console(width=400, record=True)
        print_plan(build_plan(load_config(path)), console=con)
        out = con.export_text()
        assert "mesh (pp 2 x dp_shard 4 x tp 2)" in out
        cells = [line.split("│")[1].strip() for line in out.splitlines() if line.count("│") > 5]
        assert "dp_shard" in cells and "dp" not in cells  # groups table
        # collective table: FSDP's gathers and reduce-scatters over the 4 data ranks
        rows = [line for line in out.splitlines() if "all-gather │ 4 │" in line or "reduce-scatter │ 4 │" in line]
        assert rows and {r.split("│")[1].strip() for r in rows} == {"dp_shard"}


def test_megatron_etp_defaults_to_tp_at_ep_1_too():
    """Megatron-LM sets ``--expert-tensor-parallel-size`` to the tp size when it is absent, whatever
    ep (``if args.expert_tensor_parallel_size is None: ... = args.tensor_model_parallel_size``,
    megatron/training/arguments.py:587-588 at NVIDIA/Megatron-LM d98e8a6). Mixtral arguments at tp 2
    without --expert-model-parallel-size (ep 1) read as etp 2, as Megatron-LM runs them; with the flag
    at 1 as etp 1, and that plan exports the flag, since without it Megatron-LM would run etp 2.
    Before, the import read etp 1 at ep 1 and the export left the flag out."""
    text = MIXTRAL_ARGS.replace("--expert-model-parallel-size 8 ", "")
    one = text.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 1")
    meshes, written = [], []
    for t in (text, one):
        tables = megatron.read(t, ImportOptions(cluster="dgx-h100", nodes=4)).tables
        meshes.append(dict(zip(tables["mesh"]["names"], tables["mesh"]["shape"])))
        written.append([a for a in megatron.write(config_from_dict(tables)) if a.startswith("--expert")])
    assert meshes == [{"dp": 16, "tp": 2, "etp": 2}, {"dp": 16, "tp": 2}]  # 4 nodes x 8 GPUs = 32 = dp 16 x tp 2
    assert written == [["--expert-tensor-parallel-size 2"], ["--expert-tensor-parallel-size 1"]]
