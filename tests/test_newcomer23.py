"""Findings of newcomer trial 23 (input handling): each test failed before its fix.

#1: ``--force`` replaced the command's own input (``step job.sh --json job.sh --force`` wrote
JSON over the launch script). Every command that writes (every command with ``--force``) is run
with an output that is one of its inputs: refused in one line naming the option, the input's
bytes unchanged.
"""

from __future__ import annotations

import inspect
import shutil

import pytest

from meshplan import cli
from tests.cli_run import run_main
from tests.conftest import EXAMPLES

DATA = EXAMPLES.parent / "tests" / "data"

#: (command line with {toml} (a meshplan TOML), {sh} (Megatron-LM arguments), {log} (an NCCL_DEBUG
#: log), {nccl} (nccl-tests output), {topo}, {cal}, {kern} files; the input the output names; the
#: option refused). Every command with --force has a row (test_every_writer_has_a_case).
SAME_FILE = [
    ("plan {toml} --json {toml} --force", "toml", "--json"),
    ("plan {toml} --html {toml} --force", "toml", "--html"),
    ("plan {toml} --topology {topo} --json {topo} --force", "topo", "--json"),
    ("plan {toml} --calibration {cal} --json {cal} --force", "cal", "--json"),
    ("plan {toml} --kernels {kern} --html {kern} --force", "kern", "--html"),
    ("report {toml} --out {toml} --force", "toml", "--out"),
    ("groups {toml} --json {toml} --force", "toml", "--json"),
    ("memory {toml} --json {toml} --force", "toml", "--json"),
    ("step {sh} --cluster dgx-a100 --nodes 2 --json {sh} --force", "sh", "--json"),
    ("step {toml} --trace {toml} --force", "toml", "--trace"),
    ("reliability {toml} --json {toml} --force", "toml", "--json"),
    ("compare {toml} {toml2} --html {toml2} --force", "toml2", "--html"),
    ("search {toml} --json {toml} --force", "toml", "--json"),
    ("search {toml} --export 1 --to megatron -o {toml} --force", "toml", "-o"),
    ("import auto {sh} --cluster dgx-a100 --nodes 2 -o {sh} --force", "sh", "-o"),
    ("import auto {sh} --cluster dgx-a100 --nodes 2 --json {sh} --force", "sh", "--json"),
    ("export {toml} --to megatron -o {toml} --force", "toml", "-o"),
    ("nccl-check {toml} {log} --json {log} --force", "log", "--json"),
    ("place {toml} --bindings {toml} --force", "toml", "--bindings"),
    ("launch {toml} --json {toml} --force", "toml", "--json"),
    ("calibrate {nccl} --out {nccl} --force", "nccl", "--out"),
    ("calibrate {nccl} --json {nccl} --force", "nccl", "--json"),
    ("bench gemm {toml} --out {toml} --force", "toml", "--out"),
    ("bench attention {toml} --json {toml} --force", "toml", "--json"),
    ("bench rank {toml} --out {toml} --force", "toml", "--out"),
    ("validate {toml} --json {toml} --force", "toml", "--json"),
    ("validate-slice {toml} {toml2} --testbed mp --json {toml} --force", "toml", "--json"),
]

#: Commands with --force that read no file a user gives: nothing of theirs can be an input.
NO_INPUT = {"catalog", "comm", "up", "down"}


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """Copies of one file of each kind under ``tmp_path``: {placeholder: path}; run from
    ``tmp_path`` (a default output under out/ lands there)."""
    monkeypatch.chdir(tmp_path)
    files = {"toml": EXAMPLES / "mini_2x4_tp2-dp4.toml", "toml2": EXAMPLES / "mini_2x4_tp4-dp2.toml",
             "sh": EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args",
             "log": DATA / "nccl" / "dgx-h100x2_world16_dp2_ok.log",
             "nccl": DATA / "nccl" / "all_reduce_perf_8xh200_s3.txt",
             "topo": DATA / "topo" / "seed-8gpu-2nic_topo-m.txt"}
    out = {k: shutil.copy(src, tmp_path / f"{k}{src.suffix or '.sh'}") for k, src in files.items()}
    (tmp_path / "cal.toml").write_text("# a calibration someone kept\n")
    (tmp_path / "kern.toml").write_text("# a kernels table someone kept\n")
    return {k: str(v) for k, v in out.items()} | {"cal": str(tmp_path / "cal.toml"), "kern": str(tmp_path / "kern.toml")}


@pytest.mark.parametrize("line,kept,option", SAME_FILE, ids=[" ".join(w for w in c[0].split() if "{" not in w) for c in SAME_FILE])
def test_force_never_replaces_an_input(inputs, capsys, line, kept, option):
    """Trial 23 #1: an output that is one of the command's inputs is refused even with --force, in
    one line naming the option and the fix; the input's bytes are unchanged."""
    before = open(inputs[kept], "rb").read()
    code = run_main(*line.format(**inputs).split())
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {option}: choose another path: {option} is the "), err[0]
    assert "being read" in err[0] and "--force never replaces an input" in err[0]
    assert open(inputs[kept], "rb").read() == before


def test_the_source_of_an_imported_toml_is_not_replaced_by_its_export(inputs, tmp_path, capsys):
    """Trial 23 #1: ``export job.toml -o job.sh --force`` where job.sh is job.toml's [source]
    (read to carry its flags) is refused, job.sh unchanged."""
    toml = tmp_path / "job.toml"
    assert run_main("import", "auto", inputs["sh"], "--cluster", "dgx-a100", "--nodes", "2", "-o", toml) == 0
    before = open(inputs["sh"], "rb").read()
    capsys.readouterr()
    assert run_main("export", toml, "--to", "megatron", "-o", inputs["sh"], "--force") == 2
    assert capsys.readouterr().err.startswith("error: -o: choose another path: -o is the [source] of job.toml being "
                                              "read")
    assert open(inputs["sh"], "rb").read() == before


def test_a_folder_holding_an_input_is_not_replaced_whole(tmp_path):
    """A folder output replaced whole (validate, validate-slice, compare evidence, bench comm) is
    refused when it holds an input; --force still replaces any other."""
    from meshplan.errors import ConfigError
    from meshplan.fileio import check_destination
    from meshplan.fileread import command_inputs
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "job.toml").write_text("x")
    with command_inputs([(ev / "job.toml", "CONFIG")]):
        with pytest.raises(ConfigError, match=r"--out: choose another folder: --out .*/ev holds .*job.toml, the CONFIG"):
            check_destination(ev, "--out", force=True, folder=True, replaced=True)
        assert check_destination(ev, "--out", force=True, folder=True) == ev  # files written into it, not replaced
    assert check_destination(ev, "--out", force=True, folder=True, replaced=True) == ev


def test_every_writer_has_a_case():
    """Each command with --force is in :data:`SAME_FILE` (or reads no user file)."""
    writers = {name for _, name, fn in cli.COMMANDS if "force" in inspect.signature(fn).parameters}
    covered = {line.split()[1 if line.startswith("bench") else 0] for line, _, _ in SAME_FILE}
    assert writers - NO_INPUT <= covered, writers - NO_INPUT - covered
    assert NO_INPUT <= writers


# --------------------------------------------------------------------------- #2 DeepSpeed sub-block keys

DS_OPTS = dict(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)


def _ds(tmp_path, **blocks):
    """examples/deepspeed_zero2_16xh100.json with ``blocks`` merged into its tables, as a file."""
    import json
    doc = json.loads((EXAMPLES / "deepspeed_zero2_16xh100.json").read_text())
    for table, keys in blocks.items():
        doc[table] = doc.get(table, {}) | keys
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("table,key,right", [
    ("zero_optimization", "overlap_com", "overlap_comm"),
    ("zero_optimization", "contiguous_gradient", "contiguous_gradients"),
    ("zero_optimization", "reduce_bucket_sise", "reduce_bucket_size"),
    ("zero_optimization", "round_robin_gradient", "round_robin_gradients"),
    ("fp16", "loss_scal", "loss_scale"),
    ("bf16", "immediate_grad_updat", "immediate_grad_update"),
])
def test_a_misspelt_deepspeed_field_is_an_error(tmp_path, table, key, right):
    """Trial 23 #2: DeepSpeed's DeepSpeedZeroConfig / DeepSpeedFP16Config / DeepSpeedBF16Config
    forbid extra keys (pydantic extra="forbid"), so a near miss of one of their fields is an
    error naming the field, whether meshplan reads it (overlap_comm) or not (round_robin_gradients)."""
    from meshplan.errors import ConfigError
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    with pytest.raises(ConfigError) as err:
        load_any(_ds(tmp_path, **{table: {key: True}}), opts=ImportOptions(**DS_OPTS))
    assert err.value.field == f"{table}.{key}"
    assert f"did you mean {table}.{right}?" in err.value.message
    assert ("meshplan reads" in err.value.message) == (right in ("overlap_comm", "contiguous_gradients",
                                                                  "reduce_bucket_size"))


def test_real_deepspeed_keys_and_free_tables_stay_unused(tmp_path):
    """A real DeepSpeed field meshplan does not use, a far-off key, and a near miss inside a table
    DeepSpeed does not validate strictly (activation_checkpointing, optimizer.params) are listed
    as unused, not refused."""
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import read_foreign
    path = _ds(tmp_path, zero_optimization={"round_robin_gradients": True, "my_comment": "x"},
               activation_checkpointing={"partition_activation": True},
               optimizer={"type": "AdamW", "params": {"lrr": 1e-4}})
    unused = read_foreign(path, "deepspeed", ImportOptions(**DS_OPTS)).unused
    assert {"zero_optimization.round_robin_gradients", "zero_optimization.my_comment",
            "activation_checkpointing.partition_activation", "optimizer.params.lrr"} <= set(unused)


# --------------------------------------------------------------------------- #3 DeepSpeed's hjson

COMMENTED = """{
  // DeepSpeed reads this file with hjson: comments and trailing commas run
  "train_batch_size": 256,
  "train_micro_batch_size_per_gpu": 1,
  "gradient_accumulation_steps": 16,
  "zero_optimization": {
    "stage": 2,  # hjson takes this comment too
    "overlap_comm": true,
    "reduce_bucket_size": 500000000,
  },
  "bf16": {"enabled": true},
  "gradient_clipping": 1.0,
  "steps_per_print": 10,
}
"""


def test_a_deepspeed_json_with_comments_plans_like_one_without(tmp_path, capsys):
    """Trial 23 #3: DeepSpeed reads its config with hjson.load (runtime/config.py), so a // comment
    and trailing commas run there; meshplan plans the file exactly as the plain JSON
    examples/deepspeed_zero2_16xh100.json (the same values), every line of the output the same."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = shutil.copy(EXAMPLES / "deepspeed_zero2_16xh100.json", tmp_path / "a" / "ds.json")
    commented = tmp_path / "b" / "ds.json"
    commented.write_text(COMMENTED)
    opts = ["--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096"]
    outs = []
    for path in (plain, commented):
        assert run_main("plan", path, *opts) == 0
        out = capsys.readouterr()
        outs.append((out.out.replace(str(path), "ds.json"), out.err.replace(str(path), "ds.json")))
    assert outs[0] == outs[1]
    assert "zero2" in outs[0][0] or "ZeRO" in outs[0][0]


def test_a_key_given_twice_in_a_deepspeed_config_is_still_refused(tmp_path):
    """The duplicate-key check holds under hjson, as DeepSpeed's own object_pairs_hook
    (dict_raise_error_on_duplicate_keys) refuses it."""
    from meshplan.errors import ConfigError
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    path = tmp_path / "ds.json"
    path.write_text(COMMENTED.replace('"stage": 2,', '"stage": 2, "stage": 3,'))
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage: given twice in .*ds\.json"):
        load_any(path, opts=ImportOptions(**DS_OPTS))


# --------------------------------------------------------------------------- #4 Megatron-LM's flag list

MEGATRON_OPTS = dict(cluster="dgx-h100", nodes=2)


def _megatron(extra: str):
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.megatron import read
    text = (EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text() + "\n" + extra + "\n"
    return read(text, ImportOptions(**MEGATRON_OPTS))


def test_a_misspelt_megatron_flag_it_does_not_use_is_an_error():
    """Trial 23 #4: --lr-decay-stlye is not one of Megatron-LM's flags (its argparse refuses it);
    two edits from --lr-decay-style, it is an error naming that flag."""
    from meshplan.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        _megatron("--lr-decay-stlye cosine")
    assert err.value.field == "--lr-decay-stlye"
    assert "did you mean --lr-decay-style? (a Megatron-LM flag meshplan does not use)" in err.value.message
    with pytest.raises(ConfigError, match=r"did you mean --sequence-parallel\? \(meshplan reads that one"):
        _megatron("--sequence-paralel")


def test_real_megatron_flags_stay_unused_and_others_are_named():
    """A real Megatron-LM flag meshplan does not use is listed as unused; a flag far from every
    Megatron-LM flag (a training script's own) is listed and named in a note."""
    imp = _megatron("--lr-decay-style cosine --my-own-flag 3")
    assert {"--lr-decay-style", "--my-own-flag"} <= set(imp.unused)
    assert [n for n in imp.notes if n.startswith("not flags of Megatron-LM")] == [
        "not flags of Megatron-LM d98e8a64dd: --my-own-flag (its parser refuses them unless your training script "
        "adds them)"]


def test_the_flag_list_is_megatrons_and_holds_what_meshplan_reads():
    """The shipped list: 877 flags (Megatron-LM d98e8a64dd's parser, as tools/megatron_flag_list.py
    builds it); every flag meshplan reads is in it except torchrun's --nnodes, --use-custom-fsdp
    (its name before af28b5a) and Megatron-DeepSpeed's --deepspeed, --zero-stage and the switch
    --no-pipeline-parallel (meshplan/interop/megatron_deepspeed.py; --checkpoint-activations is still in
    Megatron-LM's parser), and BigScience's fork's --pp-partition-method (bigscience-workshop/Megatron-DeepSpeed
    megatron/arguments.py:578: DeepSpeed's partition method of GPTModelPipe, read since the BLOOM audit);
    newcomer trial 52: microsoft/Megatron-DeepSpeed f4157be's own model flags (megatron/arguments.py:623-652:
    --num-key-value-heads, --rotary-position-embeddings-theta, --layernorm-epsilon; those refused when they
    shape the model otherwise, --num-experts-switch, --ds-sequence-parallel-size, DeepSpeed-MoE's --topk,
    --expert-interval and --mlp-type) and its flash switches (927-935: --use-flash-attn-v1, -v2, -triton,
    -builder), each in its parser's list (tools/megatron_deepspeed_flag_list.py)."""
    import tomllib
    from meshplan.interop.megatron import SWITCHES, USED
    from meshplan.interop.megatron_known import megatron_flags
    doc = tomllib.loads((EXAMPLES.parent / "meshplan" / "interop" / "megatron_flag_list.toml").read_text())
    assert "d98e8a64dd" in doc["source"] and len(doc["flags"]) == 877 == len(megatron_flags())
    assert set(doc["switches"]) <= set(doc["flags"])
    from meshplan.interop.megatron_deepspeed_args import mds_flags
    mds = {"--num-key-value-heads", "--rotary-position-embeddings-theta", "--layernorm-epsilon", "--num-experts-switch",
           "--ds-sequence-parallel-size", "--topk", "--expert-interval", "--mlp-type", "--use-flash-attn-v1",
           "--use-flash-attn-v2", "--use-flash-attn-triton", "--use-flash-attn-builder"}
    assert mds <= mds_flags()[0]
    assert USED - megatron_flags() == {"--nnodes", "--use-custom-fsdp", "--deepspeed", "--zero-stage",
                                       "--no-pipeline-parallel", "--pp-partition-method"} | mds
    assert SWITCHES - set(doc["switches"]) == {"--standalone", "--use-custom-fsdp", "--deepspeed",
                                               "--no-pipeline-parallel", "--use-flash-attn-v1", "--use-flash-attn-v2",
                                               "--use-flash-attn-triton", "--use-flash-attn-builder"}


# --------------------------------------------------------------------------- #5 wording


def test_a_deepspeed_batch_that_disagrees_says_what_to_set():
    """Trial 23 #5: train_batch_size 1000 against 1 x 16 x dp 64 = 1024 has a fix: the product,
    or the accumulation steps that give 1000 where they are whole (none here: leave it out)."""
    from meshplan.errors import ConfigError
    from meshplan.interop.deepspeed_batch import batch
    with pytest.raises(ConfigError) as err:
        batch({"train_batch_size": 1000, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16}, 64)
    assert err.value.message == ("1000 != train_micro_batch_size_per_gpu 1 x gradient_accumulation_steps 16 x dp 64 = "
                                 "1024; fix: train_batch_size = 1024 (1 x 16 x dp 64), or leave it out and DeepSpeed "
                                 "derives it")
    with pytest.raises(ConfigError, match=r"fix: train_batch_size = 512 \(2 x 4 x dp 64\), or "
                                          r"gradient_accumulation_steps = 8 \(1024 / \(2 x dp 64\)\)$"):
        batch({"train_batch_size": 1024, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 64)
    with pytest.raises(ConfigError, match=r"fix: train_batch_size = 1024 \(a multiple of 16 x dp 64 = 1024\)$"):
        batch({"train_batch_size": 1000, "gradient_accumulation_steps": 16}, 64)


def test_the_distributed_optimizer_shard_is_labelled_with_megatrons_axis(capsys):
    """Trial 23 #5: the Megatron-LM example (tp 2 x pp 2 on 16 GPUs: dp 4, --use-distributed-optimizer)
    shards its master weights and optimizer state over dp: the table says "dp (4)", never fsdp."""
    args = EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args"
    run_main("plan", args, "--cluster", "dgx-h100", "--nodes", "2")
    rows = [line for line in capsys.readouterr().out.splitlines() if " master " in line or " optimizer " in line]
    assert rows and all(line.rstrip(" │").endswith("dp (4)") for line in rows), rows
    assert not [line for line in rows if "fsdp" in line]


def test_an_unknown_node_on_a_named_network_says_how_to_describe_it():
    """Trial 23 #5: dgx-h100-roce is dgx-h100 on RoCE: the error says how to write a node on its own
    network inline (docs/input.md); a plain misspelling gets no such line."""
    from meshplan import catalog
    from meshplan.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        catalog.node("dgx-h100-roce")
    assert "did you mean 'dgx-h100'?" in err.value.message
    assert err.value.message.endswith("; a dgx-h100-roce on RoCE is not a catalog system: describe it in [cluster] "
                                      "without system, as gpu, nodes, node = { ..., nics = [...] } (its NICs' "
                                      "rate_gbit_per_s) and network = [...] (its tiers' latency_us, oversubscription), "
                                      "the catalog node's values as a start (meshplan catalog node), docs/input.md "
                                      "\"Input: inline clusters\"")
    with pytest.raises(ConfigError) as err:
        catalog.node("dgx-h10")
    assert "not a catalog system" not in err.value.message
    assert "Input: inline clusters" in (EXAMPLES.parent / "docs" / "input.md").read_text().splitlines()[0]
