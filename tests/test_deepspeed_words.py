"""A DeepSpeed user's plan in DeepSpeed's terms (newcomer findings, issue 11): the memory kinds
(ZeRO-3 parameter all-gather, partitioned parameters, ZeRO-1/2 gradient partitions and buckets,
never FSDP), "no pipeline" where pp = 1 in every output that names the schedule, the capacity
row of DeepSpeed's ZeRO-2, and what ``search --export N --to deepspeed`` writes of a row or why it
cannot (meshplan.spec.wording, meshplan.interop.foreign)."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace

import pytest

from meshplan.cli import main
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export
from meshplan.interop.foreign import load_any
from meshplan.interop.search_export import search_row_refusal
from meshplan.memory.constraints import constraints, estimate
from meshplan.mesh.layers import stage_layers
from meshplan.mesh.resolve import resolve_mesh
from meshplan.plan_runtime import export_refusals
from meshplan.report.search import export_lines
from meshplan.search.driver import search
from meshplan.search.space import candidate_config
from meshplan.spec.mesh import MeshSpec
from meshplan.units import GiB
from tests.conftest import EXAMPLES

OPTS = ImportOptions(cluster="dgx-h100", nodes=2, model="llama3-8b", seq_len=4096)
DS_OPTS = ["--cluster", "dgx-h100", "--nodes", "2", "--model", "llama3-8b", "--seq-len", "4096"]
ZERO2 = EXAMPLES / "deepspeed_zero2_16xh100.json"
PSI = 8_030_261_248  # llama3-8b parameters (the plan's "8,030,261,248" elements per rank unpartitioned)


def _zero3(tmp_path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1,
                                "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "gradient_clipping": 1.0}))
    return path


def _out(argv, capsys, code: int = 0) -> str:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in argv])
    assert (done.value.code or 0) == code
    return " ".join(re.sub("[│┃]", " ", capsys.readouterr().out).split())  # rich wraps long lines and cells


def test_zero3_memory_kinds_speak_deepspeed(tmp_path, capsys):
    memory = _out(["memory", _zero3(tmp_path), *DS_OPTS, "--out", tmp_path / "m"], capsys)
    for what in ("params 0.93 3% 0.93 ZeRO-3 partitioned parameters (1/16 on each rank of the data-parallel group)",
                 "grads 0.93 3% 0.93 ZeRO-3 gradient partition (1/16 on each rank of the data-parallel group, from "
                 "each reduce-scatter)",
                 # max: max live, 1e9 x 2 B, held once the prefetch has run ahead: the unit computed (the
                 # head's 1,050,681,344 B, a layer's 436,224,000 B) and what is prefetched past it up to max
                 # live, run on to the end of the parameter that reaches it (coordinator :457): past a layer
                 # 3 layers and 255,104,000 B end in w_up, 318,783,488 B into the layer: 436,224,000 +
                 # 3 x 436,224,000 + 318,783,488 = 2,063,679,488 B = 1.92 GiB (spec.deepspeed_memory.
                 # deepspeed_ahead_bytes; 1.86 GiB, max live to the byte, before that run was modelled;
                 # 1.07 GiB, the head plus one 5e7 x 2 B bucket, before the timeline prefetched as the step does)
                 "gathered_params 0.98 3% 1.92 ZeRO-3 parameter all-gather: the layers' full parameters (current + "
                 "prefetched)",
                 # DeepSpeed's ipg buffer, 5e8 x 2 B (bf16) = 0.93 GiB from init (peak in the forward), on top
                 # of the layer's 1.96 GiB in the backward
                 "grad_buffers 0.93 3% 2.89 a layer's full gradients, the ZeRO-3 reduce-scatter's input and the ipg "
                 "buffer (reduce_bucket_size, contiguous_gradients)",
                 # the caption: the timeline's prefetch runs up to max live (was 'prefetch 50,000,000
                 # parameters (stage3_prefetch_bucket_size; 1,000,000,000 live at most)')
                 "prefetch up to 1,000,000,000 parameters live (stage3_max_live_parameters; "
                 "stage3_prefetch_bucket_size 50,000,000), ZeRO-3 gradient reduce-scatter per_microbatch,",
                 "llama3-8b, dp_shard 16, no pipeline, micro-batch 1 x seq 4096",  # ZeRO-3 shards the parameters
                 "Stage 0: one step, no pipeline, 16 micro-batches"):
        assert what in memory, what
    assert "FSDP" not in memory and "1f1b" not in memory


def test_zero2_example_memory_kinds_speak_deepspeed(tmp_path, capsys):
    memory = _out(["memory", ZERO2, *DS_OPTS, "--out", tmp_path / "m"], capsys)
    for what in ("params 14.96 31% 14.96 parameters, whole on every rank (ZeRO stage 2 does not partition them)",
                 "grads 0.93 2% 0.93 ZeRO-2 gradient partition (1/16 on each rank of the data-parallel group, each "
                 "bucket's reduced gradients copied in)",
                 "optimizer 3.74 8% 3.74 optimizer states, ZeRO-2 partition (1/16 on each rank",
                 "grad_buffers 2.79 6% 2.79 gradient buckets (reduce_bucket_size) and the bucket being all-reduced",
                 "ZeRO-2 gradient all-reduces every micro-batch"):
        assert what in memory, what
    assert "FSDP" not in memory and "1f1b" not in memory and "gathered_params" not in memory
    # 14.96 GiB = 2 B x PSI (bf16, whole); 0.93 GiB = 2 B x PSI / 16
    assert f"{2 * PSI / GiB:.2f}" == "14.96" and f"{2 * PSI / 16 / GiB:.2f}" == "0.93"


def test_torch_plan_keeps_fsdp_words(tmp_path, capsys):
    memory = _out(["memory", EXAMPLES / "mini_2x4_tp2-dp4.toml", "--out", tmp_path / "m"], capsys)
    assert "FSDP all-gathered layers (current + prefetched)" in memory and "FSDP reduce per_microbatch" in memory
    assert "ZeRO" not in memory and "one step, no pipeline, " in memory


def test_step_and_html_say_no_pipeline_at_pp_1(tmp_path, capsys):
    step = _out(["step", ZERO2, *DS_OPTS], capsys)
    assert re.search(r"^step \d+\.\d\d ms \(no pipeline, m 16\); critical stage 0", step)
    page = tmp_path / "z3.html"
    _out(["plan", _zero3(tmp_path), *DS_OPTS, "--html", page], capsys)
    text = html.unescape(re.sub(r"<[^>]+>", " ", page.read_text()))
    text = " ".join(text.split())
    assert "(no pipeline, m 16)" in text and "1f1b" not in text
    # 1.92 GiB, max live run on to w_up's end (above; 1.86 before that run was modelled)
    assert "gathered_params 0.98 1.92 ZeRO-3 parameter all-gather: the layers' full parameters" in text
    assert "sharding zero3 (DeepSpeed ZeRO stage 3: partitions the optimizer states, gradients and parameters" in text


def test_a_pipeline_keeps_its_schedule(capsys):
    step = _out(["step", EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args", "--cluster", "dgx-h100", "--nodes",
                 "2"], capsys)
    assert re.search(r"^step \d+\.\d\d ms \(1f1b, p 2, m 32, v 1\);", step)


def test_zero2_capacity_row_by_hand(capsys, monkeypatch):
    """ZeRO-2 partitions the gradients, not the parameters: per rank 2 PSI (bf16 parameters)
    + (2 + 4 + 8) PSI / 16 (bf16 gradients, fp32 master, Adam moments) = 23,087,001,088 B,
    2 PSI x 15/16 = 15,056,739,840 B below ZeRO-1 (gradients whole), with the same activations
    and nothing gathered."""
    cfg = load_any(ZERO2, opts=OPTS)
    t, m = cfg.training, cfg.model
    mesh = resolve_mesh(MeshSpec(names=["dp_shard"], shape=[16]), 16)
    stages = stage_layers(m.layers, 1)
    e1, e2 = (estimate(m, t.model_copy(update={"sharding": s}), mesh, stages, 16) for s in ("zero1", "zero2"))
    assert e2.state_bytes == 2 * PSI + 14 * PSI // 16 == 23_087_001_088
    assert e1.state_bytes - e2.state_bytes == 2 * PSI * 15 // 16 == 15_056_739_840
    assert e2.activation_bytes == e1.activation_bytes and e2.gathered_bytes == 0
    rows = [r.text for r in constraints(m, t, cfg.cluster, 16).rows if r.kind == "capacity"]
    assert [r.split(",")[0] for r in rows[1:]] == ["sharding none", "sharding zero1", "sharding zero2",
                                                   "sharding zero3"]
    assert rows[3] == ("sharding zero2, recompute none (first estimate): smallest split (tp inside a node) that "
                       f"fits is tp 1 x pp 1 (peak {e2.total_bytes / GiB:.1f} GiB)") and f"{e2.total_bytes / GiB:.1f}" == "44.0"
    monkeypatch.setenv("COLUMNS", "400")  # the rows unwrapped
    plan = _out(["plan", ZERO2, *DS_OPTS], capsys)
    # the plan's own setting's row is the memory timeline's (meshplan/plan_capacity.py), its peak the verdict's
    assert "sharding zero2, recompute none (this plan's setting, memory timeline): smallest split (tp inside a node) " \
           "that fits is tp 1 x pp 1: this mesh, timeline peak 47.97 GiB, fits" in plan
    assert "stage 0: state 21.50 GiB + activations 22.54 GiB = 44.04 GiB" in plan  # nothing gathered: no term
    assert "gathered" not in plan.split("first estimate")[1].splitlines()[0]


@pytest.mark.parametrize("narrow", [{}, {"recompute": ["selective"]},
                                    {"recompute": ["selective"], "sharding": ["zero2"]}])
def test_search_and_export_agree_on_what_deepspeed_does_not_express(narrow):
    """Every row the search line names is one whose --export --to deepspeed header lists those
    fields; the rows it does not name export whole; recompute's line says where it goes. A
    DeepSpeed config searches one data axis, so one mesh and one row (the rows are distinct meshes,
    9db001f): row 1 at recompute none exports whole (no line), and the search narrowed to selective
    recompute, at zero3 or zero2, has its row 1 named for training.recompute. (nc52fixC: ZeRO-3's
    cross-node all-gathers and reduce-scatters now hold 16 of the H100's 132 SMs beside the compute,
    row_shares.nccl_net_channels: the example's ZeRO-3 run 5.752 -> 6.003 s, read from the model, past
    its ZeRO-2 run, 5.798 s, whose bucket all-reduces run beside no kernel: row 1 is zero2 where the search
    is not narrowed to a sharding, at recompute none and at selective alike.)"""
    cfg = load_any(ZERO2, opts=OPTS, require_mesh=False)
    r = search(replace(cfg, search=cfg.search.model_copy(update=narrow)))
    lines = export_lines(r)
    assert len(lines) == (1 if narrow else 0)
    named: dict[int, list[str]] = {}
    for part in "".join(lines).removeprefix("--export N --to deepspeed: ").split("; "):
        got = re.match(r"rows? ([\d, ]+) not expressed: (.*)", part)
        if got:
            for k in got.group(1).split(", "):
                named[int(k)] = got.group(2).split(", ")
    assert bool(named) == bool(narrow) and all(f == ["training.recompute"] for f in named.values())
    assert [r.candidates.label(e.index).split(", ")[2:] for e in r.top] == [
        ["none" if not narrow else "selective", "vpp 1", narrow.get("sharding", ["zero2"])[0]]]
    for k, e in enumerate(r.top, 1):
        row = candidate_config(r.config, r.candidates, e.index)
        _, head = export(row, "deepspeed", "search")
        lost = [h.split(": ")[1] for h in head if h.startswith("not expressed in deepspeed")]
        assert sorted(lost) == sorted(named.get(k, [])), k
        if row.training.recompute == "selective":
            assert ("not expressed in deepspeed: training.recompute: 'selective' -> 'none' (DeepSpeed's JSON does not "
                    "choose activation checkpointing, the model code does: apply activation checkpointing of the "
                    "attention core only (the model code's deepspeed.checkpointing.checkpoint around it, flash kernels "
                    "included) there)") in head
        if row.training.sharding == "zero3":  # ZeRO-3 has no gradient bucket: the ZeRO-2 config's is no loss
            assert not [h for h in head if h.startswith("not expressed in deepspeed: memory")]
    if narrow:
        assert lines[0].endswith("training.recompute: DeepSpeed's JSON does not choose activation checkpointing, the "
                                 "model code does (the export header names the policy to apply; full reads "
                                 "back with import --gradient-checkpointing, the HF Trainer's "
                                 "--gradient_checkpointing, anything else as none)")


def _tp_config(tp: int, sharding: str = "zero1"):
    return config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                             "training": {"global_batch": 32, "seq_len": 4096, "sharding": sharding,
                                          "zero12_engine": "deepspeed"},
                             "mesh": {"names": ["dp_shard", "tp"], "shape": [16 // tp, tp]}})


def _refused(c):
    return {t: export_refusals(c, t) for t in ("meshplan", "torchtitan", "megatron", "deepspeed")}


def test_a_tp_row_under_deepspeeds_engine_names_the_first_row_deepspeed_takes():
    rows = [_tp_config(2), _tp_config(4), _tp_config(1), _tp_config(1, "zero2")]
    assert search_row_refusal(3, rows, "deepspeed", _refused) is None
    assert search_row_refusal(1, rows, "deepspeed", _refused) == (
        "row 1 cannot be written --to deepspeed: a DeepSpeed config applies to ZeRO over one data axis, without "
        "TP/PP/CP/EP or HSDP; this mesh has tp 2 (zero1); row 3 is the first row it takes (--export 3), or export row 1 "
        "--to megatron")  # Megatron-DeepSpeed's --deepspeed --zero-stage 1 keeps DeepSpeed's ZeRO-1 (megatron_deepspeed)
    assert search_row_refusal(1, rows[:2], "deepspeed", _refused).split("; ")[2] == (
        "none of the 2 rows shown exports --to deepspeed, or export row 1 --to megatron")
    with pytest.raises(ConfigError, match="--to: a DeepSpeed config applies to ZeRO over one data axis"):
        export(rows[0], "deepspeed", "x")  # export alone keeps its own refusal


def test_search_export_of_a_tp_row_is_one_line(tmp_path, capsys):
    path = tmp_path / "ds_tp.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 2\n[training]\n'
                    'global_batch = 32\nseq_len = 4096\nsharding = "zero1"\nzero12_engine = "deepspeed"\n'
                    '[search]\npp = [1]\ndp_replicate = [1]\ncp = [1]\ntp = [1, 2]\nsharding = ["zero1", "zero2"]\n'
                    'recompute = ["selective"]\nmicro_batch = [1]\n')
    r = search(config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
                                 "training": {"global_batch": 32, "seq_len": 4096, "sharding": "zero1",
                                              "zero12_engine": "deepspeed"},
                                 "search": {"pp": [1], "dp_replicate": [1], "cp": [1], "tp": [1, 2],
                                            "sharding": ["zero1", "zero2"], "recompute": ["selective"],
                                            "micro_batch": [1]}}, require_mesh=False))
    tps = [int(r.candidates.degree("tp")[e.index]) for e in r.top]
    n, first = tps.index(2) + 1, tps.index(1) + 1
    with pytest.raises(SystemExit) as done:
        main(["search", str(path), "--export", str(n), "--to", "deepspeed", "-o", str(tmp_path / "row.json")])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and not (tmp_path / "row.json").exists()
    assert err.startswith(f"error: --export: row {n} cannot be written --to deepspeed: a DeepSpeed config applies to "
                          f"ZeRO over one data axis, without TP/PP/CP/EP or HSDP; this mesh has tp 2 (")
    assert f"row {first} is the first row it takes (--export {first})" in err
