"""Newcomer trial 29 (a torchtitan user, Llama-3.1-70B at 128k tokens on 256 H200): what it found,
each fixed and asserted here on a small job of the same kind.

1. ``meshplan compare`` of a bf16 config against its float8 twin exited 2 with ``training.linear_dtype
   differs: job_bf16 None, job fp8``: a Python None in a user message, and a refusal of a comparison
   both of whose plans are complete (the float8 GEMMs are timed at the fp8 peak, memory in full).
   ``linear_dtype`` is now a knob compared as ``recompute`` is: a row, named in the verdict's reasons.
2. ``meshplan import torchtitan`` mapped flavor 70B to catalog llama3-70b (8,192 positions), so every
   command warned of seq_len 131072: the import carries the context torchtitan runs the flavor at.
   It also listed ``checkpoint.interval`` as unused: the file spelled
   ``enable_checkpoint`` (torchtitan's name before cd337db); it is read as ``enable`` and the
   interval round-trips through [reliability] checkpoint_interval_steps.
3. ``meshplan step job_pp4.toml --schedule interleaved_1f1b`` said "set the config's virtual stages"
   without naming the key: it names ``mesh.virtual_stages`` and a value that runs.
"""

from __future__ import annotations

import json
import tomllib

from tests.cli_run import run_cli
from tests.configs import job_toml

#: Llama-3-8B on one dgx-h100, FSDP over 8 GPUs (torchtitan's default: zero3, the head not
#: converted to float8, filter_fqns = ["output"]).
_TRAINING = {"global_batch": 8, "seq_len": 1024}
_MESH = {"names": ["dp_shard"], "shape": [8]}


def test_compare_weighs_float8_against_bf16(tmp_path, capsys):
    """bf16 against float8 Linears with the float8 all-gather (trial 29's job_bf16.toml against
    job.toml): exit 0; one knob, ``training.linear_dtype``, bf16 (unset: the Linears run in the
    compute dtype, bf16) against fp8; ``fp8_all_gather`` (false on the bf16 side, where it cannot
    be set) is no second knob: it refines float8 and acts only where both sides run it. The
    caption names each side's GEMM dtypes: llama's seven Linears (wq, wk, wv, wo, w_gate, w_up,
    w_down) in fp8 and the head (``output``, excluded by default) in bf16, and MFU's peaks: H100
    SXM dense 989 TFLOP/s bf16 and 1979 TFLOP/s fp8 (NVIDIA H100 datasheet, half the sparse
    1979 and 3958)."""
    (tmp_path / "bf16.toml").write_text(job_toml(training=_TRAINING, mesh=_MESH))
    (tmp_path / "fp8.toml").write_text(job_toml(training={**_TRAINING, "linear_dtype": "fp8",
                                                          "fp8_all_gather": True}, mesh=_MESH))
    code, out, err = run_cli(["compare", tmp_path / "bf16.toml", tmp_path / "fp8.toml", "--out", tmp_path / "o",
                              "--json", tmp_path / "c.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["knobs"] == [{"knob": "training.linear_dtype", "a": "bf16", "b": "fp8"}]
    assert ["training.linear_dtype", "bf16", "fp8"] in doc["table"]
    text = " ".join(out.split())
    assert ("same mesh (dp_shard 8); the plans differ in training.linear_dtype bf16 against fp8 (bf16 against fp8): "
            "the difference comes from these knobs, not from the mesh") in text
    assert ("(M,N,K) eff: forward GEMM FLOP/s over the 989 TFLOP/s bf16, 1979 TFLOP/s fp8 dense peak" in text)
    assert ("each over its own dtype's peak: bf16 bf16 every GEMM; fp8 fp8 wq, wk, wv, wo, w_gate, w_up, w_down, "
            "bf16 output; MFU over bf16's bf16, fp8's fp8 peak") in text
    assert "None" not in out + err


def test_interleaved_schedule_refusal_names_the_key_and_a_value_that_works(tmp_path, capsys):
    """``step --schedule interleaved_1f1b`` of a pp 4 mesh with one chunk per rank (trial 29's
    job_pp4.toml: "set the config's virtual stages", no key): the fix names mesh.virtual_stages and
    the fewest chunks that run, 2 (Llama-3-8B's 32 layers / (pp 4 x 2) = 4 per virtual stage; 8
    micro-batches = global_batch 8 / (micro_batch 1 x dp 1), a multiple of torch's rounds max(1,
    8 // 4) = 2); the config with that value runs the schedule."""
    mesh = {"names": ["pp", "tp"], "shape": [4, 2]}
    (tmp_path / "pp4.toml").write_text(job_toml(training=_TRAINING, mesh=mesh))
    code, _, err = run_cli(["step", tmp_path / "pp4.toml", "--schedule", "interleaved_1f1b"], capsys)
    assert code == 2
    assert err == ("error: --schedule: interleaved_1f1b: interleaved 1F1B needs virtual_stages > 1; choose a schedule "
                   "this mesh allows, or set mesh.virtual_stages = 2 (32 layers / (pp 4 x 2) = 4 per virtual "
                   "stage)\n")
    (tmp_path / "vpp2.toml").write_text(job_toml(training=_TRAINING, mesh={**mesh, "virtual_stages": 2}))
    code, _, err = run_cli(["step", tmp_path / "vpp2.toml", "--schedule", "interleaved_1f1b"], capsys)
    assert code == 0, err


#: A torchtitan job TOML of before cd337db (2025-08-22), whose [checkpoint] still spells
#: ``enable_checkpoint`` (trial 29's tt_70b_128k.toml, at Llama-3-8B on one node).
_TT_OLD_CHECKPOINT = """[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
[checkpoint]
enable_checkpoint = true
folder = "checkpoint"
interval = 200
"""


def test_torchtitan_checkpoint_interval_round_trips(tmp_path, capsys):
    """``checkpoint.enable_checkpoint = true`` (``enable``'s name before torchtitan cd337db) with
    ``interval = 200``: imported as [reliability] checkpoint_interval_steps = 200 (no longer listed
    as unused), exported back in the file's spelling with the folder carried; the plan's interval
    edited to 300 is the exported one, and the header says so."""
    (tmp_path / "tt.toml").write_text(_TT_OLD_CHECKPOINT)
    code, _, err = run_cli(["import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", "1",
                            "-o", tmp_path / "j.toml"], capsys)
    assert code == 0, err
    text = (tmp_path / "j.toml").read_text()
    assert "[reliability]\ncheckpoint_interval_steps = 200\n" in text
    assert "checkpoint.interval" not in text and "checkpoint.enable_checkpoint" not in text  # not "unused"
    for interval in (200, 300):
        (tmp_path / "j.toml").write_text(text.replace("checkpoint_interval_steps = 200",
                                                      f"checkpoint_interval_steps = {interval}"))
        out = tmp_path / f"e{interval}.toml"
        code, _, err = run_cli(["export", tmp_path / "j.toml", "--to", "torchtitan", "-o", out], capsys)
        assert code == 0, err
        written = tomllib.loads(out.read_text())
        assert written["checkpoint"] == {"enable_checkpoint": True, "folder": "checkpoint", "interval": interval}
    assert "checkpoint.interval 200 -> 300" in (tmp_path / "e300.toml").read_text()


def test_torchtitan_flavor_runs_at_the_jobs_context(tmp_path, capsys):
    """llama3 flavor 8B at training.seq_len 16384: catalog llama3-8b states Meta-Llama-3-8B's 8192
    positions, but torchtitan's llama3 flavors are Llama 3.1 (131072 positions, RoPE scaled: b5bcd76
    models/llama3/__init__.py:267) sized to the job's sequence (b5bcd76 models/common/decoder.py:218-230;
    e347b1e model/args.py:49-55): the import names catalog llama3.1-8b (nc59 #4; before it, llama3-8b with
    ``max_position = 16384``), the plan warns of no missing positions, and the export writes flavor "8B"
    back (not a custom flavor of another max_position)."""
    (tmp_path / "tt.toml").write_text(_TT_OLD_CHECKPOINT.replace("seq_len = 8192", "seq_len = 16384"))
    code, _, err = run_cli(["import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", "1",
                            "-o", tmp_path / "j.toml"], capsys)
    assert code == 0, err
    text = (tmp_path / "j.toml").read_text()
    assert '[model]\ncatalog = "llama3.1-8b"\n\n' in text  # 16384 <= its 131072: no max_position
    assert ("# note: torchtitan: model.catalog = 'llama3.1-8b' (Llama 3.1: 131072 positions, RoPE scaled): "
            "training.seq_len 16384 is past Llama 3's 8192, and torchtitan's llama3 flavors are Llama 3.1") in text
    code, out, err = run_cli(["plan", tmp_path / "j.toml"], capsys)
    assert code == 0, err
    assert "max_position" not in out + err
    code, _, err = run_cli(["export", tmp_path / "j.toml", "--to", "torchtitan", "-o", tmp_path / "e.toml"], capsys)
    assert code == 0, err
    model = tomllib.loads((tmp_path / "e.toml").read_text())["model"]
    assert (model["name"], model["flavor"]) == ("llama3", "8B")
    assert not (tmp_path / "e.py").exists()


def test_torchtitan_flavor_context_with_a_malformed_seq_len_is_a_one_line_error(tmp_path, capsys):
    """A job TOML whose ``training.seq_len`` is no whole number (``"long"``, ``16384.5``) or above its
    bound (100,000,000 > 2^24 = 16,777,216, meshplan.limits.MAX_SEQ_LEN) is malformed input: exit 2 and
    one line naming ``training.seq_len``, never a traceback from comparing it with the flavor's
    positions, nor an error on ``model.max_position`` (which the user did not write, set from seq_len
    above the flavor's 8192 positions: that line blamed it for 100,000,000)."""
    for bad in ('"long"', "16384.5", "100000000"):
        (tmp_path / "tt.toml").write_text(_TT_OLD_CHECKPOINT.replace("seq_len = 8192", f"seq_len = {bad}"))
        code, out, err = run_cli(["import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100",
                                  "--nodes", "1", "-o", tmp_path / "j.toml"], capsys)
        assert code == 2
        assert err.startswith("error: training.seq_len: ") and err.count("\n") == 1, err
        assert not (tmp_path / "j.toml").exists()


def test_torchtitan_export_names_the_checkpoint_keys_it_carries(tmp_path, capsys):
    """The export's header said ``carried unchanged from tt.toml ...: [checkpoint]`` beside
    ``checkpoint.interval 200 -> 300``: the table was not carried unchanged, its interval (and
    enable) being the plan's. It names the keys carried as they were, ``checkpoint.folder`` (the
    only other key of _TT_OLD_CHECKPOINT's [checkpoint]), and not the table."""
    (tmp_path / "tt.toml").write_text(_TT_OLD_CHECKPOINT)
    code, _, err = run_cli(["import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", "1",
                            "-o", tmp_path / "j.toml"], capsys)
    assert code == 0, err
    text = (tmp_path / "j.toml").read_text()
    (tmp_path / "j.toml").write_text(text.replace("checkpoint_interval_steps = 200", "checkpoint_interval_steps = 300"))
    code, _, err = run_cli(["export", tmp_path / "j.toml", "--to", "torchtitan", "-o", tmp_path / "e.toml"], capsys)
    assert code == 0, err
    head = [x for x in (tmp_path / "e.toml").read_text().splitlines() if x.startswith("# carried unchanged from ")]
    assert len(head) == 1 and head[0].endswith(": checkpoint.folder"), head


def test_interleaved_refusal_names_a_value_for_an_uneven_layer_split(tmp_path, capsys):
    """The same refusal for a model whose layers are no multiple of pp x v but split by
    mesh.pp_layer_split, as examples/llama3-405b_16384xh100_tp8-pp16-dp128.toml (126 layers at pp 16,
    [7, 8 x 14, 7]): it named no value ("set mesh.virtual_stages to chunks per rank that
    interleaved_1f1b runs at pp 4"), since 30 layers / (pp 4 x 2) = 3.75 is not whole, while the plan
    gives each stage's 7 or 8 layers to its 2 chunks (mesh.layers.stage_layers: 3 + 4, 4 + 4, 4 + 4,
    4 + 3). It names 2, and the config with that value runs the schedule."""
    model = {"catalog": "llama3-8b", "layers": 30}
    mesh = {"names": ["pp", "tp"], "shape": [4, 2], "pp_layer_split": [7, 8, 8, 7]}
    (tmp_path / "pp4.toml").write_text(job_toml(model, training=_TRAINING, mesh=mesh))
    code, _, err = run_cli(["step", tmp_path / "pp4.toml", "--schedule", "interleaved_1f1b"], capsys)
    assert code == 2
    assert err == ("error: --schedule: interleaved_1f1b: interleaved 1F1B needs virtual_stages > 1; choose a schedule "
                   "this mesh allows, or set mesh.virtual_stages = 2 (mesh.pp_layer_split's layers of each stage over "
                   "its 2 chunks)\n")
    (tmp_path / "vpp2.toml").write_text(job_toml(model, training=_TRAINING, mesh={**mesh, "virtual_stages": 2}))
    code, _, err = run_cli(["step", tmp_path / "vpp2.toml", "--schedule", "interleaved_1f1b"], capsys)
    assert code == 0, err


def test_torchtitan_interval_in_seconds_is_not_read_as_steps(tmp_path, capsys):
    """The older job TOMLs this import now reads (``enable_checkpoint``) include torchtitan's argparse
    config, whose ``checkpoint.interval_type = "seconds"`` makes ``interval`` seconds ("in steps or
    seconds depending on --checkpoint.interval_type"). 600 seconds were imported as
    checkpoint_interval_steps = 600; now no [reliability] interval is read and the keys are listed
    unused (reliability then plans Daly's interval alone)."""
    (tmp_path / "tt.toml").write_text(_TT_OLD_CHECKPOINT.replace("interval = 200", 'interval_type = "seconds"\n'
                                                                                    "interval = 600"))
    code, _, err = run_cli(["import", "torchtitan", tmp_path / "tt.toml", "--cluster", "dgx-h100", "--nodes", "1",
                            "-o", tmp_path / "j.toml"], capsys)
    assert code == 0, err
    text = (tmp_path / "j.toml").read_text()
    assert "checkpoint_interval_steps =" not in text  # no value written (nc55 #14's note names the key)
    assert "interval_type = 'seconds': the interval counts seconds, not the steps meshplan plans" in text
    assert ("# note: torchtitan: fields meshplan does not use: checkpoint.enable_checkpoint, checkpoint.folder, "
            "checkpoint.interval_type, checkpoint.interval\n") in text
