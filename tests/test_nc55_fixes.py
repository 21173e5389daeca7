"""Newcomer trial nc55's findings (/work/prompts/nc55-report.md), each checked through the CLI
as the user ran it: #1 ``import auto`` of a TOML that does not parse, #2 the ``fix:`` of a -1 that
cannot be inferred, #3 the exit code of a tp the model refuses in a torchtitan file, #6 the launch
scripts' exit code, #10 ``compare`` of two global batches, #13 a number option that does not
parse, #14 the import note on ``checkpoint.enable``."""

from __future__ import annotations

import json

import pytest

from tests.cli_run import run_cli


# ---------------------------------------------------------------- #13 numbers that do not parse

@pytest.mark.parametrize("args,line", [
    # an int option: typer's pydantic "Input should be a valid integer, unable to parse string as an
    # integer" was printed inside "Invalid value for '--nodes': ..." (nc55 #13)
    (["plan", "x.toml", "--nodes", "abc"],
     "error: --nodes: 'abc' is not an integer; fix: give --nodes a whole number; see meshplan plan --help"),
    (["plan", "x.toml", "--seq-len=4k"],
     "error: --seq-len: '4k' is not an integer; fix: give --seq-len a whole number; see meshplan plan --help"),
    # a float option (reliability's storage bandwidth): pydantic's "valid number"
    (["reliability", "x.toml", "--write-gbps", "fast"],
     "error: --write-gbps: 'fast' is not a number; fix: give --write-gbps a number (digits, a decimal point, "
     "an exponent); see meshplan reliability --help"),
])
def test_a_number_option_that_does_not_parse_is_one_line_in_our_words(args, line, capsys):
    code, out, err = run_cli(args, capsys)
    assert (code, out) == (2, "")
    head, cmd = line.split("; see meshplan ")
    assert len(err.splitlines()) == 1 and err.startswith(head + "; see ") and err.endswith(f" {cmd}\n"), err


# ---------------------------------------------------------------- #14 checkpoint.enable listed unused

_TT = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
"""


@pytest.mark.parametrize("table,note", [
    # enable = false (the trial's llama3_70b.toml): no checkpoint saved, both keys unused, and why
    ("[checkpoint]\nenable = false\ninterval = 500\n",
     "note: torchtitan: checkpoint: enable = false (torchtitan's default): the job saves no checkpoint, so "
     "checkpoint.enable and checkpoint.interval are listed unused; with enable = true meshplan reads the interval as "
     "[reliability] checkpoint_interval_steps (meshplan reliability sets it beside the optimal interval)"),
    # only an interval: enable unset is torchtitan's default False (job_config.py class Checkpoint)
    ("[checkpoint]\ninterval = 100\n",
     "note: torchtitan: checkpoint: enable unset (torchtitan's default, false): the job saves no checkpoint, so "
     "checkpoint.interval is listed unused; with enable = true meshplan reads the interval as [reliability] "
     "checkpoint_interval_steps (meshplan reliability sets it beside the optimal interval)"),
    # enable = true: the interval is read (checkpoint_interval_steps = 100), neither key unused, no note
    ("[checkpoint]\nenable = true\ninterval = 100\n", None),
])
def test_checkpoint_keys_listed_unused_say_why(table, note, tmp_path, capsys):
    job, out = tmp_path / "job.toml", tmp_path / "plan.toml"
    job.write_text(_TT + table)
    code, said, err = run_cli(["import", "torchtitan", job, "--cluster", "dgx-h100", "--nodes", "1", "-o", out], capsys)
    assert code == 0, err
    err = said + err  # the notes, wherever the command prints them
    written = out.read_text()
    unused = next((line for line in err.splitlines() if "fields meshplan does not use" in line), "")
    notes = [line for line in err.splitlines() if line.startswith("note: torchtitan: checkpoint:")]
    if note is None:
        assert notes == [] and "checkpoint." not in unused and "checkpoint_interval_steps = 100" in written
    else:
        assert notes == [note] and "checkpoint.interval" in unused and "checkpoint_interval_steps =" not in written


# ---------------------------------------------------------------- #6 the launch scripts' exit status

def test_launch_scripts_refuse_with_the_exit_status_the_docs_give(tmp_path):
    """README's launch row and docs/commands.md say the scripts exit 1 on a host that is not the
    plan's node; torchrun.sh exited 2 (bind.sh 1). Every refusal of either script is now exit 1."""
    from pathlib import Path

    from meshplan.placement.assign import place
    from meshplan.placement.launch import LaunchOptions, write_launch
    from meshplan.catalog import system

    write_launch(tmp_path, place(system("dgx-h100", 2), 16),
                 LaunchOptions(program=("python", "t.py"), hosts=("gpu-a", "gpu-b"), rdzv_endpoint="gpu-a:1"))
    for script in ("torchrun.sh", "bind.sh"):
        text = (tmp_path / script).read_text()
        assert "exit 2" not in text and "exit 1" in text, script
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert "`torchrun.sh` and `bind.sh` exit 1 (one line) on a host that is not the node the plan puts there" in readme
    assert "of the plan, no node rank at all (several nodes) or no rendezvous endpoint: one line and exit 1, as bind.sh" \
        in (root / "docs" / "commands.md").read_text().replace("\n  ", " ")


# ---------------------------------------------------------------- #2 the fix of a -1 that cannot be inferred

_70B_64N = """[model]
catalog = "llama3-70b"
[cluster]
system = "dgx-h100"
nodes = 64
[training]
global_batch = 512
seq_len = 8192
micro_batch = 8
sharding = "zero3"
recompute = "full"
[mesh]
names = {names}
shape = {shape}
sequence_parallel = true
"""


@pytest.mark.parametrize("command", ["plan", "export"])
def test_minus_one_fix_offers_only_what_the_plan_accepts(command, tmp_path, capsys):
    """The trial's imported Llama 3 70B job (64 dgx-h100 = 512 GPUs, global batch 512, micro-batch 8)
    with pp 3 x tp 8 = 24, which does not divide 512, so dp_shard = -1 has nothing to infer. With tp 8
    kept, pp must divide 512 / 8 = 64: 1, 2, 4, 8, 16, 32, 64; the plan's layer rule keeps those
    dividing the 80 layers (80 / 32 = 2.5 and 80 / 64 = 1.25 are refused without a pp_layer_split),
    so pp 1, 2, 4, 8 or 16. 24 ranks fill lcm(24, 8) = 24 GPUs, 3 nodes, but there pp 3 splits 80
    layers into 26.67 a stage, refused too: no cluster.nodes fix (main offered pp 32, 64 and
    cluster.nodes = 3). ``export`` gives the same line as ``plan``."""
    cfg = tmp_path / "pp3.toml"
    cfg.write_text(_70B_64N.format(names='["pp", "dp_shard", "tp"]', shape="[3, -1, 8]"))
    extra = ["--to", "megatron", "-o", tmp_path / "m.args"] if command == "export" else []
    code, out, err = run_cli([command, cfg, *extra], capsys)
    assert (code, out) == (2, "")
    assert err == ("error: mesh.shape: dp_shard = -1 cannot be inferred: pp 3 x tp 8 = 24 does not divide the "
                   "cluster's 512 GPUs; fix: pp 1, 2, 4, 8 or 16 (a divisor of 512 / tp 8 that the plan's rules accept)\n")


# ---------------------------------------------------------------- #3 a tp the model refuses: exit 1 in every format

def _titan_70b_tp3(tmp_path):
    """The shipped torchtitan example as the trial's bad_tp.toml: Llama 3 70B (64 q heads, 8 KV heads,
    ffn 28672), tensor_parallel_degree 3, data_parallel_shard_degree -1."""
    from tests.conftest import EXAMPLES
    text = (EXAMPLES / "torchtitan_llama3-8b_8xh100.toml").read_text()
    assert 'flavor = "8B"' in text and "tensor_parallel_degree = 1" in text
    p = tmp_path / "bad_tp.toml"
    p.write_text(text.replace('flavor = "8B"', 'flavor = "70B"').replace("tensor_parallel_degree = 1",
                                                                          "tensor_parallel_degree = 3"))
    return p


#: 64 dgx-h100 = 512 GPUs; 512 = 3 x 170 + 2, so dp_shard -1 has nothing to infer, and tp 3 divides neither
#: the 64 q heads (64 = 3 x 21 + 1) nor ffn 28672 (= 3 x 9557 + 1): the model's fault first, exit 1
TT_TP3 = ("infeasible: parallelism.tensor_parallel_degree: tp 3 does not divide q_heads 64, ffn 28672 or the node's "
          "8 GPUs (tp splits the attention heads and the MLP over its ranks, a group inside a node); use 1, 2, 4 or 8")


@pytest.mark.parametrize("command", [["plan"], ["step"], ["import", "torchtitan"], ["import", "auto"]])
def test_torchtitan_tp_the_model_refuses_is_infeasible_exit_1(command, tmp_path, capsys):
    out = tmp_path / "x.toml"
    extra = ["-o", out] if command[0] == "import" else ["--json", tmp_path / "x.json"]
    code, said, err = run_cli([*command, _titan_70b_tp3(tmp_path), "--cluster", "dgx-h100", "--nodes", "64", *extra],
                              capsys)
    assert (code, said, err) == (1, "", TT_TP3 + "\n")
    if command[0] == "import":  # no mesh, no global batch: no meshplan TOML written
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_tp.toml"]
        return
    # plan/step given --json: no plan exists, so the error document (meshplan.error/v1) with exit_code 1 and
    # the stderr line exactly (nc55 #8's document, a CI gate reads the refusal as JSON whatever the exit)
    doc = json.loads((tmp_path / "x.json").read_text())
    assert (doc["schema"], doc["command"], doc["exit_code"]) == ("meshplan.error/v1", command[0], 1)
    assert doc["error"]["field"] == "parallelism.tensor_parallel_degree"
    assert doc["error"]["line"] == TT_TP3 and doc["error"]["fix"] == "use 1, 2, 4 or 8"


def test_meshplan_toml_with_the_same_tp_is_infeasible_exit_1_too(tmp_path, capsys):
    """The meshplan side of the same mistake ([-1, 3] of the 70B job on 512 GPUs), exit 2 before
    (the -1's world error, whose fix offered tp 1 ... 512 and cluster.nodes = 3): the tp rules'
    reasons, as on 24 GPUs where the -1 resolves (q heads, ffn; with SP 8192 = 3 x 2730 + 2 is no
    multiple of 3), then the -1. The JSON is written, feasible false."""
    import json
    cfg = tmp_path / "tp3.toml"
    cfg.write_text(_70B_64N.format(names='["dp_shard", "tp"]', shape="[-1, 3]"))
    code, said, err = run_cli(["plan", cfg, "--json", tmp_path / "p.json"], capsys)
    reasons = ["q_heads 64 is not divisible by tp 3", "ffn 28672 is not divisible by tp 3",
               "sequence parallel: local seq = seq_len 8192 / cp 1 = 8192 is not a multiple of tp 3",
               "dp_shard = -1 cannot be inferred: world 512 is not divisible by tp 3 = 3"]
    assert code == 1 and err.splitlines() == [f"infeasible: {r}" for r in reasons]
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["feasible"] is False and doc["reasons"] == reasons


# ---------------------------------------------------------------- #1 import auto of a TOML that does not parse

@pytest.mark.parametrize("text,says", [
    # the trial's bad_syntax.toml: torchtitan's llama3 job with "seq_len = = 8192" on its line 6 here;
    # tomllib stops at the second "=" (Invalid value), which parse_toml names by its key and line
    ("[job]\ndump_folder = \"./outputs\"\n[model]\nname = \"llama3\"\n[training]\nseq_len = = 8192\n",
     "config: {p}: not valid TOML (training.seq_len (line 6): Invalid value)"),
    # "[model" with no "]": tomllib's own words, with the line and column
    ("[model\ncatalog = \"llama3-8b\"\n",
     "config: {p}: not valid TOML (Expected ']' at the end of a table declaration (at line 1, column 7))"),
    ("", "config: {p} is empty (no table, no key): give the torchtitan job TOML, Megatron-LM arguments or DeepSpeed "
         "JSON to import"),
    ("# only a comment\n\n", "config: {p} is empty (no table, no key): give the torchtitan job TOML, Megatron-LM "
                             "arguments or DeepSpeed JSON to import"),
])
def test_import_auto_says_a_toml_does_not_parse_before_guessing_its_format(text, says, tmp_path, capsys):
    p = tmp_path / "job.toml"
    p.write_text(text)
    code, out, err = run_cli(["import", "auto", p, "--cluster", "dgx-h100", "--nodes", "1", "-o", tmp_path / "x.toml"],
                             capsys)
    assert (code, out, err) == (2, "", f"error: {says.format(p=p)}\n")
    if text.startswith("[job]"):  # the same line as import torchtitan and plan of the file
        for argv in (["import", "torchtitan", p, "--cluster", "dgx-h100", "--nodes", "1"], ["plan", p]):
            assert run_cli(argv, capsys)[2] == err
    assert not (tmp_path / "x.toml").exists()


def test_import_auto_of_a_meshplan_toml_still_names_format(tmp_path, capsys):
    from tests.conftest import EXAMPLES
    cfg = EXAMPLES / "mini_2x4_tp2-dp4.toml"
    code, out, err = run_cli(["import", "auto", cfg], capsys)
    assert (code, err) == (2, f"error: --format: {cfg} is already a meshplan TOML\n")
