"""Findings of newcomer trial 32 (issue 11; a DeepSpeed user planning a 34B Llama-style model on
128 A100 40GB): each test failed on main before its fix."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from meshplan import catalog

from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.foreign import load_any
from tests.cli_run import run_captured
from tests.configs import job_toml, megatron_deepspeed_script
from tests.docs_text import docs_text
from tests.test_interop import DS
from tests.test_interop_strict import DSOPTS


def _hpz_json(tmp_path, stage: int, hpz: int):
    d = json.loads(DS.read_text())
    d["zero_optimization"] |= {"stage": stage, "zero_hpz_partition_size": hpz}
    f = tmp_path / "hpz.json"
    f.write_text(json.dumps(d))
    return f


def test_deepspeed_hpz_is_planned_not_dropped(tmp_path):
    """ZeRO++ hpZ (zero_hpz_partition_size, a secondary bf16 parameter partition within the node,
    backward all-gathers inside it; arXiv 2306.10209). Trial 32 found it listed among the fields
    meshplan does not use while plain ZeRO-3 was planned and export wrote the key back, so the
    exported JSON ran hpZ while the plan was plain ZeRO-3; it was then refused by name. Now
    (meshplan.comm.zeropp) it is read into training.zero_hpz_partition_size and planned: the
    import succeeds with the key, and neither the unused list nor a refusal names it."""
    cfg = load_any(_hpz_json(tmp_path, 3, 8), opts=DSOPTS)
    assert cfg.training.zero_hpz_partition_size == 8
    assert not any("zero_hpz_partition_size" in n for n in cfg.notes)
    r = run_captured("import", "deepspeed", _hpz_json(tmp_path, 3, 8), "--cluster", "dgx-h100", "--nodes", 2,
                     "--model", "llama3-8b", "--seq-len", 4096, "-o", tmp_path / "hpz.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "zero_hpz_partition_size = 8" in (tmp_path / "hpz.toml").read_text()


def test_deepspeed_hpz_of_one_plans_plain_zero3_and_stage2_does_not_read_it(tmp_path):
    """Size 1 is DeepSpeed's default (no secondary partition): read at stage 3, nothing planned;
    stages 1-2 never read the key (DeepSpeed passes it to stage 3 only): listed as unused."""
    three = load_any(_hpz_json(tmp_path, 3, 1), opts=DSOPTS)
    assert three.training.sharding == "zero3" and three.training.zero_hpz_partition_size == 1
    assert not any("zero_hpz_partition_size" in n for n in three.notes)
    two = load_any(_hpz_json(tmp_path, 2, 8), opts=DSOPTS)
    assert two.training.sharding == "zero2" and two.training.zero_hpz_partition_size == 1
    assert "zero_optimization.zero_hpz_partition_size" in two.notes[-1]  # read, not used


def test_hsdp_with_deepspeed_zero3_engine_says_what_hsdp_is():
    """HSDP gathers parameters (within dp_shard): the error used to say it "has no parameter
    gathers". It now names the conflict (DeepSpeed's ZeRO-3 engine runs sharding zero3 only)."""
    d = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
         "training": {"global_batch": 16, "seq_len": 1024, "sharding": "hsdp", "zero3_engine": "deepspeed"},
         "mesh": {"names": ["dp_replicate", "dp_shard"], "shape": [2, 8]}}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert "no parameter gathers" not in str(e.value)
    assert "sharding 'hsdp' is FSDP2's hybrid sharding (gathers within dp_shard" in str(e.value)
    assert str(e.value).endswith('remove the key to plan FSDP2, or set sharding = "zero3"')


def test_compare_names_every_differing_workload_field(tmp_path):
    """z3_4nic.toml against mds_4nic.toml differed in training.grad_reduce_dtype and memory.dropout;
    the error named the first and said "(and 1 more workload fields)". Each field now comes with
    its two values (the first four; the rest counted)."""
    mesh = {"names": ["dp_shard"], "shape": [8]}
    a = job_toml(training={"global_batch": 8, "seq_len": 1024, "grad_reduce_dtype": "bf16"}, mesh=mesh)
    b = job_toml(training={"global_batch": 8, "seq_len": 1024, "grad_reduce_dtype": "fp32"}, mesh=mesh)
    (tmp_path / "a.toml").write_text(a)
    (tmp_path / "b.toml").write_text(b + "[memory]\ndropout = true\n")
    r = run_captured("compare", tmp_path / "a.toml", tmp_path / "b.toml", "--out", tmp_path / "cmp")
    assert r.returncode == 2
    assert r.stderr == ("error: compare: training.grad_reduce_dtype differs: a bf16, b fp32; memory.dropout differs: "
                        "a false, b true; compare weighs two plans of one workload: give both the same "
                        "training.grad_reduce_dtype, memory.dropout; only the mesh and the plan's knobs (micro_batch, "
                        "recompute, sharding ...) may differ; to weigh two workloads (a before/after that changes "
                        "the batch), run meshplan step on each (tokens/s per GPU and MFU compare them), or meshplan "
                        "search on one for its best mesh\n")  # the way out added by nc55 #10


def _four_nic_cluster() -> str:
    """docs/input.md's example of a node the catalog lacks (8 A100 40GB, 4 HDR NICs, one per GPU
    pair: newcomer 32's nodes), as the docs give it (the third of the docs' [cluster] examples; the fourth,
    RoCE NICs, is tests/test_h800.py's)."""
    blocks = re.findall(r"```toml\n(\[cluster\].*?)```", docs_text(), re.S)
    assert len(blocks) == 4 and "4 HDR NICs" in blocks[2]
    return blocks[2]


def _job(cluster: str) -> dict:
    d = tomllib.loads('[model]\ncatalog = "llama3-8b"\n' + cluster)
    return {**d, "training": {"global_batch": 128, "seq_len": 4096, "sharding": "zero3"},
            "mesh": {"names": ["dp_shard"], "shape": [128]}}


def test_inline_node_names_catalog_network_and_curve():
    """An inline [cluster] may name a catalog network and a catalog busbw curve where the tables
    go (the loader resolves them: spec/ does not read the catalog). Was: pydantic's "Input should be
    a valid list" and "Input should be a valid dictionary or instance of BusbwCurve"."""
    cfg = config_from_dict(_job(_four_nic_cluster()))
    c = cfg.cluster
    assert [t.model_dump() for t in c.network] == [t.model_dump() for t in catalog.network("superpod-hdr-su20")]
    assert c.node.busbw["nvlink"] == catalog.busbw_curve("a100-nvlink3-ring")
    assert set(c.node.busbw) == {"nvlink"}  # the 8-NIC nic curve left out, as the docs say
    # 4 NICs x 200 Gb/s for 8 GPUs: each NIC shared by a GPU pair
    assert [n.gpus for n in c.node.nics] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert c.world == 16 * 8
    named = _job('[cluster]\nnodes = 2\ngpu = "a100-sxm-40gb"\nnode = "dgx-a100-40gb"\nnetwork = "superpod-hdr-su20"\n')
    assert config_from_dict(named).cluster.node == catalog.node("dgx-a100-40gb")  # a catalog node by name


@pytest.mark.parametrize("old,new,field,start", [
    ('network = "superpod-hdr-su20"', "network = 3", "cluster.network", "give a catalog network name"),
    ('network = "superpod-hdr-su20"', 'network = "superpod-hdr"', "cluster.network", "unknown network 'superpod-hdr'"),
    ('busbw = { nvlink = "a100-nvlink3-ring" }', "busbw = { nvlink = 3 }", "cluster.node.busbw.nvlink",
     "give a catalog curve name"),
    ('"a100-nvlink3-ring"', '"a100-nvlink3"', "cluster.node.busbw.nvlink", "unknown busbw curve 'a100-nvlink3'"),
    ('busbw = { nvlink = "a100-nvlink3-ring" }', 'busbw = "a100-nvlink3-ring"', "cluster.node.busbw",
     "give a table of link class -> catalog curve name"),  # was pydantic's "Input should be a valid dictionary"
])
def test_inline_cluster_wrong_forms_are_one_line_errors(old, new, field, start):
    text = _four_nic_cluster()
    assert old in text
    with pytest.raises(ConfigError) as e:
        config_from_dict(_job(text.replace(old, new)))
    assert (e.value.field, e.value.message[:len(start)]) == (field, start)
    assert "\n" not in str(e.value) and "Input should be" not in str(e.value)


def test_inline_node_of_another_type_is_a_one_line_error():
    """``node = 3`` was pydantic's "Input should be a valid dictionary or instance of NodeSpec"; now
    both forms are named, as for ``network``."""
    bad = _job('[cluster]\nnodes = 2\ngpu = "a100-sxm-40gb"\nnode = 3\nnetwork = "superpod-hdr-su20"\n')
    with pytest.raises(ConfigError) as e:
        config_from_dict(bad)
    assert (e.value.field, e.value.message[:28]) == ("cluster.node", "give a catalog node name (me")
    assert "\n" not in str(e.value) and "Input should be" not in str(e.value)


def _import_mds(tmp_path, script: str):
    (tmp_path / "train.sh").write_text(script)
    return run_captured("import", "megatron", tmp_path / "train.sh", "--model", "llama3-8b", "--cluster", "dgx-h100",
                        "-o", tmp_path / "mds.toml", cwd=tmp_path)


def test_megatron_deepspeed_engine_and_checkpoint_activations_are_read_and_written_back(tmp_path):
    """Megatron-DeepSpeed's --deepspeed --zero-stage 1 is DeepSpeed's ZeRO-1 engine
    (zero12_engine = "deepspeed"), its --checkpoint-activations full recompute of every layer
    (--checkpoint-num-layers default 1). Was: both listed as unused, planned as sharding "none"
    and recompute "none", and the export wrote --use-distributed-optimizer beside the carried
    --deepspeed --zero-stage 1 --checkpoint-activations, and --use-flash-attn beside the carried
    --use-flash-attn-v2 (FlashAttention 1 and 2 both asked for)."""
    r = _import_mds(tmp_path, megatron_deepspeed_script(zero_stage=1, pp=2))
    assert r.returncode == 0, r.stderr
    cfg = load_any(tmp_path / "mds.toml")
    t = cfg.training
    assert (t.sharding, t.zero12_engine, t.recompute, t.framework) == ("zero1", "deepspeed", "full", "megatron")
    assert t.gradient_reduce_dtype == "bf16"  # DeepSpeed's default communication_data_type: the model's dtype
    header = (tmp_path / "mds.toml").read_text()
    unused = header.split("fields meshplan does not use: ")[1].split("\n")[0]
    assert not {"--deepspeed", "--zero-stage", "--checkpoint-activations"} & set(unused.split(", "))
    assert "ds_zero1.json is not read: its zero_optimization.stage must be 1" in header
    r = run_captured("export", tmp_path / "mds.toml", "--to", "megatron", "-o", tmp_path / "out.sh", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    flags = [line.split()[0] for line in (tmp_path / "out.sh").read_text().splitlines()
             if line.startswith("--")]
    assert len(flags) == len(set(flags))  # no flag twice
    for present in ("--deepspeed", "--zero-stage", "--checkpoint-activations", "--use-flash-attn-v2",
                    "--deepspeed_config"):
        assert present in flags
    for absent in ("--use-distributed-optimizer", "--recompute-granularity", "--use-flash-attn",
                   "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"):
        assert absent not in flags


def test_checkpoint_activations_alone_is_full_recompute(tmp_path):
    script = megatron_deepspeed_script().replace("--deepspeed --deepspeed_config ds_zero1.json --zero-stage 1", "")
    assert "--deepspeed " not in script
    assert _import_mds(tmp_path, script).returncode == 0
    t = load_any(tmp_path / "mds.toml").training
    assert (t.sharding, t.zero12_engine, t.recompute) == ("none", "megatron", "full")
    assert "Megatron-LM d98e8a6 refuses it" in (tmp_path / "mds.toml").read_text()  # validate_args asserts


@pytest.mark.parametrize("script,start", [
    (megatron_deepspeed_script(zero_stage=2, pp=2), "error: --zero-stage: 2 at --pipeline-model-parallel-size 2: "
                                                    "DeepSpeed's PipelineEngine refuses ZeRO-2 and ZeRO-3"),
    (megatron_deepspeed_script(extra="--use-distributed-optimizer"),
     "error: --deepspeed: given with --use-distributed-optimizer"),
    (megatron_deepspeed_script().replace("--zero-stage 1", ""), "error: --zero-stage: not given with --deepspeed"),
    (megatron_deepspeed_script().replace("--zero-stage 1", "--zero-stage"),
     "error: --zero-stage: given without a value; give --zero-stage N"),
    (megatron_deepspeed_script(zero_stage=3, pp=1), "error: --zero-stage: 3 without --no-pipeline-parallel: "
                                                    "Megatron-DeepSpeed builds its model as a PipelineModule even at pp 1"),
    (megatron_deepspeed_script(pp=2, extra="--no-pipeline-parallel"),
     "error: --no-pipeline-parallel: given at --pipeline-model-parallel-size 2: Megatron-DeepSpeed asserts pp 1"),
])
def test_megatron_deepspeed_refusals_are_one_line(tmp_path, script, start):
    r = _import_mds(tmp_path, script)
    assert r.returncode == 2 and r.stderr.startswith(start) and r.stderr.count("\n") == 1


def test_megatron_deepspeed_zero3_at_pp1_is_deepspeed_zero3(tmp_path):
    """ZeRO-3 runs under Megatron-DeepSpeed only with --no-pipeline-parallel (GPTModel, not
    GPTModelPipe, whose PipelineEngine asserts stage < 2 at any pp: Megatron-DeepSpeed 0782d75
    pretrain_gpt.py model_provider, DeepSpeed 0050fda runtime/pipe/engine.py); without it the import
    refuses (test above). The export writes the flag back beside --zero-stage 3, so the script it
    writes runs; before, it wrote --deepspeed --zero-stage 3 alone, which the engine refuses."""
    r = _import_mds(tmp_path, megatron_deepspeed_script(zero_stage=3, pp=1, extra="--no-pipeline-parallel"))
    assert r.returncode == 0, r.stderr
    cfg = load_any(tmp_path / "mds.toml")
    assert (cfg.training.sharding, cfg.training.zero3_engine) == ("zero3", "deepspeed")
    assert cfg.mesh.names == ["dp_shard", "tp"]  # ZeRO-3 shards the parameters over the data axis
    assert "--no-pipeline-parallel" not in (tmp_path / "mds.toml").read_text().split("unused")[-1]
    r = run_captured("export", tmp_path / "mds.toml", "--to", "megatron", "-o", tmp_path / "out.sh", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    flags = (tmp_path / "out.sh").read_text().split()
    assert "--no-pipeline-parallel" in flags and flags[flags.index("--zero-stage") + 1] == "3"
