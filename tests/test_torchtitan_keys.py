"""torchtitan job TOML users' findings (ttkeys): torchtitan's ETP checked, errors and fix
lines on a torchtitan file in the file's own keys, and an MoE model read through
``model.hf_assets_path`` exported back.

ETP (ttetp): meshplan's torch framework follows pytorch/torchtitan b5bcd76, where c4b409a (#3167,
2026-04-30) had removed expert tensor parallelism: with ep > 1 the routed experts are ``Shard(0)``
on ep and whole otherwise, the tp ranks splitting the tokens (``moe_sharding.py``:29-47, 71-86),
meshplan's etp 1 (:data:`meshplan.spec.axes.moe_tp.TORCH_ETP`). Before it (aeb3a4b to c4b409a^)
``ParallelDims`` allowed etp 1 or tp. Mixtral-8x7B (8 experts, expert width 14336) at dp_shard 8 x
tp 4 (32 GPUs) with ep 4: etp 2 and etp 4 (= tp) break the rule under torch, etp 1 does not, and
under megatron (whose expert tp is free) etp 2 and 4 do not either (14336 / 4 = 3584, and
32 / (4 x 4) = 2 efsdp ranks: the other expert rules hold).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cli_run import run_main as _main
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.torchtitan import read
from meshplan.plan import Infeasible, build_plan

HF = Path(__file__).parent / "data" / "hf"

WHOLE = ("torchtitan has no expert tensor parallelism since c4b409a (#3167, 2026-04-30): with ep > 1 each routed "
         "expert is whole on its ep rank and the tp ranks split the tokens (etp 1; moe_sharding.py at b5bcd76)")


def _mixtral(etp: int, framework: str = "torch", ep: int = 4):
    return config_from_dict({
        "model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "recompute": "full",
                     "framework": framework},
        "mesh": {"names": ["dp_shard", "tp", "ep", "etp"], "shape": [8, 4, ep, etp], "sequence_parallel": True}})


@pytest.mark.parametrize("etp", [2, 4])
def test_torch_etp_rule_refuses_etp_above_1_with_ep(etp):
    """etp 2, and etp 4 = tp (which torchtitan ran before c4b409a), with ep 4 under torch (no
    training.op_sac_policy: the plan targets b5bcd76): infeasible with the rule's reason naming the commit and the
    fix; for etp = tp the fix names the revision that runs it too (newcomer trial 50, #3)."""
    bad = build_plan(_mixtral(etp), memory=False, reports=False)
    assert isinstance(bad, Infeasible)
    v022 = ", or training.op_sac_policy = \"238fa99\" (torchtitan <= v0.2.2, which runs etp = tp)" if etp == 4 else ""
    assert (f"framework torch: etp {etp} with tp 4 and ep 4: {WHOLE}; fix: etp 1 in mesh.shape, or "
            "training.framework = \"megatron\"" + v022) in bad.reasons


def test_torch_etp_rule_refuses_etp_1_at_ep_1_with_tp():
    """etp 1 at ep 1 with tp 4 under torch: torchtitan at b5bcd76 shards the experts over tp there
    (``expert_param_placement_dense``), so etp 1 would plan what it does not run: infeasible with
    the fix etp 4; a mesh leaving etp out gets etp 4 with a note (config_mesh.torch_etp)."""
    bad = build_plan(_mixtral(1, ep=1), memory=False, reports=False)
    assert isinstance(bad, Infeasible)
    assert any(r.startswith("framework torch: etp 1 with tp 4 and ep 1: torchtitan at ep 1 shards every routed "
                            "expert over tp") and r.endswith("fix: etp 4 in mesh.shape (or leave etp out), or "
                                                             "training.framework = \"megatron\"") for r in bad.reasons)
    cfg = config_from_dict({**_RAW, "mesh": {"names": ["dp_shard", "tp"], "shape": [8, 4], "sequence_parallel": True}})
    assert (cfg.mesh.names, cfg.mesh.shape) == (["dp_shard", "tp", "etp"], [8, 4, 4])
    assert cfg.notes[-1].startswith("mesh.etp not given: 4, the tp degree")


_RAW = {"model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "recompute": "full"}}


def test_torch_etp_rule_keeps_etp_1_megatron_and_ep_1():
    """etp 1 under torch, etp 2 and 4 under megatron, and etp 4 at ep 1 under torch (torchtitan
    shards the experts over tp when ep is 1) are not refused by the rule."""
    for cfg in (_mixtral(1), _mixtral(2, "megatron"), _mixtral(4, "megatron"), _mixtral(4, ep=1)):
        p = build_plan(cfg, memory=False, reports=False)
        assert not any("c4b409a" in r for r in getattr(p, "reasons", ())), p


def test_torch_search_space_has_etp_1_only_with_ep():
    """The search's candidates for Mixtral on 4 dgx-h100 (32 GPUs): under torch every row with
    ep > 1 has etp 1 and every ep 1 row etp = tp (torchtitan's dense family at ep 1,
    :func:`meshplan.spec.axes.moe_tp.torch_etp`); under megatron an ep > 1 row with tp 4 has etp 4
    too and ep 1 rows keep etp 1 and tp."""
    from meshplan.search.space import enumerate_candidates
    for framework, want in (("torch", {1}), ("megatron", {1, 4})):
        c = enumerate_candidates(_mixtral(1, framework))
        assert (c.ep > 1).any() and set(c.etp[c.ep > 1].tolist()) == ({1} if framework == "torch" else {1, 2, 4, 8})
        assert set(c.etp[(c.ep > 1) & (c.tp == 4)].tolist()) == want
        assert set(c.etp[(c.ep == 1) & (c.tp == 4)].tolist()) == ({4} if framework == "torch" else {1, 4})
        assert set(c.etp[(c.ep == 1) & (c.tp == 2)].tolist()) == ({2} if framework == "torch" else {1, 2})


TT_ETP = """\
[model]
name = "mixtral"
flavor = "8x7B"
hf_assets_path = "{hf}"
[training]
local_batch_size = 1
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 4
expert_parallel_degree = {ep}
expert_tensor_parallel_degree = {etp}
"""


#: What torchtitan v0.2.2 (the job TOML's torchtitan) runs with ep > 1: ``ParallelDims._validate``,
#: torchtitan/distributed/parallel_dims.py:58-59 at e347b1e, ``assert etp == tp or etp == 1, "Currently we
#: only support ETP=TP or ETP=1"``; etp = tp is ``ExpertTensorParallel`` (llama4/infra/parallelize.py:578-580).
V022 = ("planned as torchtitan v0.2.2 runs it (ETP = TP, each routed expert sharded over tp: parallel_dims.py:58-59 "
        "at e347b1e; training.op_sac_policy = \"238fa99\", the TOML-reading torchtitan); c4b409a (2026-04-30) removed "
        f"it: {WHOLE}, so for a later torchtitan set expert_tensor_parallel_degree = 1")


@pytest.mark.parametrize("command", ["plan", "step"])
def test_torchtitan_file_with_etp_tp_plans_as_v022(tmp_path, capsys, command):
    """The users' file (ep 4, etp 4 = tp 4) is a valid v0.2.2 job TOML (etp = tp: parallel_dims.py:59
    at e347b1e): read with a note naming the difference and planned as v0.2.2 runs it (newcomer trial 50, #3:
    the import names that torchtitan, training.op_sac_policy "238fa99"), so no ``torch_etp`` reason: a
    feasible plan (exit 0; its peak 24.8 GiB fits an H100), not infeasible (1) nor a malformed-input error (2).
    ``search`` is left out here: it reads the file the same way and takes minutes on 2 cores."""
    job = tmp_path / "job.toml"
    job.write_text(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", ep=4, etp=4))
    assert _main(command, job, "--cluster", "dgx-h100", "--nodes", 4) == 0
    out, err = capsys.readouterr()
    assert ("note: torchtitan: parallelism.expert_tensor_parallel_degree = 4 with expert_parallel_degree 4: "
            f"{V022}") in err.splitlines()
    assert f"framework torch: etp 4 with tp 4 and ep 4: {WHOLE}" not in out + err
    assert "error:" not in out + err


def test_torchtitan_file_with_etp_neither_1_nor_tp_is_an_error(tmp_path, capsys):
    """etp 2 with tp 4 and ep 4: v0.2.2 asserts etp is 1 or tp (parallel_dims.py:58-59 at e347b1e), so
    the file is one line naming the key and both values it takes (exit 2)."""
    job = tmp_path / "job.toml"
    job.write_text(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", ep=4, etp=2))
    assert _main("plan", job, "--cluster", "dgx-h100", "--nodes", 4) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: parallelism.expert_tensor_parallel_degree: 2 with expert_parallel_degree 4 and tensor_parallel_degree "
        "4: torchtitan v0.2.2 runs 1 or the tp degree there (\"Currently we only support ETP=TP or ETP=1\", "
        "parallel_dims.py:58-59 at e347b1e); fix: expert_tensor_parallel_degree = 1 or 4")


def test_torchtitan_file_with_etp_1_or_ep_1_reads_with_a_note():
    """etp 1 with ep 4, and etp 4 with ep 1 (torchtitan shards the experts over tp at ep 1), are
    read as they are, each with a note naming c4b409a; etp 3 with ep 4 is the reader's error."""
    for ep, etp in ((4, 1), (1, 4)):
        got = read(tomllib.loads(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", ep=ep, etp=etp)), Path("."),
                   ImportOptions(cluster="dgx-h100", nodes=4))
        mesh = got.tables["mesh"]
        assert dict(zip(mesh["names"], mesh["shape"])).get("etp", 1) == etp
        assert (f"parallelism.expert_tensor_parallel_degree = {etp}: read as etp {etp}; torchtitan up to v0.2.2 "
                "reads the key (meshplan export keeps it); c4b409a (#3167, 2026-04-30) removed it with expert "
                "tensor parallelism, so delete it for a torchtitan after that commit") in got.notes  # was cut mid-sentence
    with pytest.raises(ConfigError, match=r"^parallelism\.expert_tensor_parallel_degree: 3 with expert_parallel"):
        read(tomllib.loads(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", ep=4, etp=3)), Path("."),
             ImportOptions(cluster="dgx-h100", nodes=4))


def test_export_to_torchtitan_etp():
    """export writes no expert_tensor_parallel_degree at etp 1 (ep 4: v0.2.2's default 1, job_config.py:464
    at e347b1e); etp 4 = tp 4 with ep 4 (a megatron-framework mesh), which v0.2.2 runs (parallel_dims.py:59),
    is written as expert_tensor_parallel_degree = 4 with the note naming b5bcd76's difference; etp 2 with
    tp 4 and ep 4 is refused with v0.2.2's rule; and ep 4 x etp 4 = 16 must divide dp_shard x cp x tp
    (v0.2.2's efsdp = 8 x 1 x 4 / 16 = 2 here, parallel_dims.py:138), so dp_shard 2 (2 x 4 = 8) is refused
    (by the mesh's own rule, the same as v0.2.2's)."""
    from dataclasses import replace
    from meshplan.interop.torchtitan_write import etp_note, write
    src = (("name", "mixtral"), ("flavor", "8x7B"), ("hf_assets_path", "assets/mx"))
    par = write(replace(_mixtral(1), source_model=src))["parallelism"]
    assert par["expert_parallel_degree"] == 4 and "expert_tensor_parallel_degree" not in par
    par = write(replace(_mixtral(4, "megatron"), source_model=src))["parallelism"]
    assert (par["expert_parallel_degree"], par["tensor_parallel_degree"], par["expert_tensor_parallel_degree"]) == (4, 4, 4)
    assert etp_note(par)[0].startswith("note: expert_tensor_parallel_degree = 4 (= tp, ep 4): torchtitan v0.2.2 shards "
                                       "each routed expert over etp too")
    with pytest.raises(ConfigError, match=r"^--to: etp 2 with tp 4 and ep 4: torchtitan v0.2.2 runs etp 1 or tp with "
                                          r"ep > 1 \(ParallelDims, parallel_dims.py:58-59 at e347b1e\); set etp 1 in "
                                          r"\[mesh\] to export it$"):
        write(replace(_mixtral(2, "megatron"), source_model=src))
    small = config_from_dict({**_RAW, "cluster": {"system": "dgx-h100", "nodes": 1}, "training": {
        **_RAW["training"], "framework": "megatron"}, "mesh": {"names": ["dp_shard", "tp", "ep", "etp"],
                                                               "shape": [2, 4, 4, 4], "sequence_parallel": True}})
    with pytest.raises(ConfigError, match=r"ep\(4\) \* etp\(4\) = 16 does not divide dp_shard\(2\) \* tp\(4\) = 8"):
        write(replace(small, source_model=src))
    # ep 1: etp = tp 4 is torchtitan's own layout, written without the removed key; a megatron
    # mesh's etp 1 there would run as etp 4 under torchtitan, so it is refused
    par = write(replace(_mixtral(4, ep=1), source_model=src))["parallelism"]
    assert (par["expert_parallel_degree"], par["tensor_parallel_degree"]) == (1, 4)
    assert "expert_tensor_parallel_degree" not in par
    with pytest.raises(ConfigError, match=r"^--to: etp 1 with tp 4 at ep 1: torchtitan at ep 1 shards every routed "
                                          r"expert over tp .*; set etp 4 in \[mesh\] to export it$"):
        write(replace(_mixtral(1, "megatron", ep=1), source_model=src))


MX = """\
[model]
name = "mixtral"
flavor = "8x7B"
hf_assets_path = "assets/mx"
[training]
local_batch_size = 1
seq_len = 4096
global_batch_size = 64
[parallelism]
data_parallel_shard_degree = -1
expert_parallel_degree = 8
"""


@pytest.fixture()
def mx(tmp_path):
    """The users' MoE job TOML, its model read through a relative ``model.hf_assets_path``."""
    (tmp_path / "assets" / "mx").mkdir(parents=True)
    (tmp_path / "assets" / "mx" / "config.json").write_text((HF / "mixtral-8x7b-v0.1" / "config.json").read_text())
    job = tmp_path / "mx.toml"
    job.write_text(MX)
    return job


def test_torchtitan_moe_read_through_hf_assets_path_exports_back(mx, capsys):
    """``export --to torchtitan`` of it was refused ('torchtitan knows models by flavor'); now the
    file's [model] name, flavor and hf_assets_path are written back as the user wrote them, the
    round trip re-reads the model with --model (the folder is relative to where torchtitan runs),
    and nothing of the model is listed as not expressed."""
    out = mx.parent / "r.toml"
    assert _main("export", mx, "--cluster", "dgx-h100", "--nodes", 4, "--to", "torchtitan", "-o", out) == 0
    config = (mx.parent / "assets" / "mx" / "config.json").resolve()
    doc = tomllib.loads(out.read_text())
    assert doc["model"] == {"name": "mixtral", "flavor": "8x7B", "hf_assets_path": "assets/mx"}
    head = capsys.readouterr().out
    assert f"import with: meshplan import torchtitan FILE --cluster dgx-h100 --nodes 4 --model {config}" in head
    assert "not expressed in torchtitan" not in head
    assert doc["parallelism"]["expert_parallel_degree"] == 8


def test_torchtitan_moe_search_export_is_not_refused(mx):
    """``search --export 1 --to torchtitan`` refused the file before the search; the refusal
    now takes the file's model names (a llama3 flavor is not needed)."""
    from meshplan.interop.foreign import load_any
    from meshplan.interop.search_export import search_export_refusal
    cfg = load_any(mx, None, ImportOptions(cluster="dgx-h100", nodes=4), require_mesh=False)
    assert cfg.source_model == (("name", "mixtral"), ("flavor", "8x7B"), ("hf_assets_path", "assets/mx"))
    assert search_export_refusal(cfg, "torchtitan") is None


def test_imported_toml_with_source_exports_the_model_back(mx, capsys):
    """The meshplan TOML that ``import`` wrote (hf_config, [source] naming the job TOML) exports
    the same [model] as the job TOML itself; without the [source] it is one line saying that torchtitan has
    no Mixtral and why Megatron-LM refuses this one (torchtitan's default recompute, 'layer')."""
    toml = mx.parent / "mx_plan.toml"
    assert _main("import", "torchtitan", mx, "--cluster", "dgx-h100", "--nodes", 4, "-o", toml) == 0
    out = mx.parent / "r.toml"
    assert _main("export", toml, "--to", "torchtitan", "-o", out) == 0
    assert tomllib.loads(out.read_text())["model"] == {"name": "mixtral", "flavor": "8x7B", "hf_assets_path": "assets/mx"}
    bare = mx.parent / "bare.toml"
    bare.write_text(toml.read_text().split("\n[source]\n")[0] + "\n")
    capsys.readouterr()
    assert _main("export", bare, "--to", "torchtitan", "-o", mx.parent / "x.toml") == 2
    config = (mx.parent / "assets" / "mx" / "config.json").resolve()
    err = capsys.readouterr().err.strip().splitlines()
    # ttexport: was "... set model.name = \"transformers_modeling_backend\" with flavor \"full\" ... (torchtitan's HF
    # backend, dense models) ...", a flavor that runs no MoE; and "all refuse it" without Megatron-LM's reason
    assert len(err) == 1 and err[0].startswith(
        f"error: --to: model 'MixtralForCausalLM-46.7B' (Hugging Face config {config}, model_type mixtral) has no "
        f"torchtitan [model] name and flavor: torchtitan v0.2.2 (e347b1e, the job TOML's) has no Mixtral model "
        f"(torchtitan/models: llama3, llama4, deepseek_v3, qwen3, gpt_oss, flux), and its transformers_modeling_backend "
        f"runs dense configs only (flavors debugmodel, full); nor has b5bcd76, whose full_moe flavor fixes "
        f"Qwen3-30B-A3B's sizes (dim 2048, 48 layers, 128 experts top 8) over the config's; torchtitan, Megatron-LM "
        f"and DeepSpeed all refuse it (--to megatron: Megatron-LM has no flag for torchtitan's recompute 'layer'")


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


GB = """\
[model]
name = "llama3"
flavor = "8B"
[training]
local_batch_size = 1
global_batch_size = 256
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
"""


def test_torchtitan_batch_error_names_the_file_keys(tmp_path, capsys):
    """global_batch_size 256 on 64 dgx-h100 (dp_shard -1 = 512): 256 is no multiple of local 1 x
    dp 512; the nearest multiple above is 512 (0 below is none), and 256 / 512 sequences per rank
    offers no local batch. In the file's keys, not training.global_batch / micro_batch."""
    job = tmp_path / "gb.toml"
    job.write_text(GB)
    assert _main("plan", job, "--cluster", "dgx-h100", "--nodes", 64) == 2
    assert _err(capsys)[-1] == ("error: training.global_batch_size: 256 is not divisible by training.local_batch_size 1 "
                                "x dp 512 = 512; use a multiple of 512 (512)")


def test_torchtitan_batch_error_with_pp(tmp_path, capsys):
    """nc57 #3: 70B pp 2 x tp 8 on 8 dgx-h100 (dp_shard -1 = 64 / 16 = 4), local_batch_size 4,
    global_batch_size 100: torchtitan asserts 100 % (4 x 4) == 0 (v0.2.2 train.py:203); with pp the
    micro-batch is pipeline_parallel_microbatch_size 1, so meshplan's rule on micro_batch x dp (100 / 4)
    passed, the note said "100 = 6 x local_batch_size 4 x dp 4" (96) and plan blamed pp_schedule_runs.
    Now the file's keys and the multiples of 16 around 100: 96 (6 steps) or 112 (7)."""
    job = tmp_path / "gb.toml"
    job.write_text(GB.replace('flavor = "8B"', 'flavor = "70B"').replace("local_batch_size = 1", "local_batch_size = 4")
                   .replace("global_batch_size = 256", "global_batch_size = 100")
                   + 'tensor_parallel_degree = 8\npipeline_parallel_degree = 2\npipeline_parallel_schedule = "1F1B"\n'
                   + "pipeline_parallel_microbatch_size = 1\n")
    assert _main("plan", job, "--cluster", "dgx-h100", "--nodes", 8) == 2
    assert _err(capsys)[-1] == ("error: training.global_batch_size: 100 is not divisible by training.local_batch_size 4 "
                                "x dp 4 = 16; use a multiple of 16 (96 or 112)")
    job.write_text(job.read_text().replace("global_batch_size = 100", "global_batch_size = 96"))
    _main("plan", job, "--cluster", "dgx-h100", "--nodes", 8)   # 96 = 6 x 16: read, 6 schedules of 4
    out = capsys.readouterr()
    assert "training.global_batch_size 96 = 6 x local_batch_size 4 x dp 4: torchtitan runs 6 gradient-accumulation " \
           "steps, each a pipeline schedule of 4 micro-batches" in out.out + out.err and "error:" not in out.err


def test_torchtitan_experts_fix_names_expert_parallel_degree(mx, capsys):
    """Mixtral's 8 experts at ep 16 (dp_shard -1 = 32 on 4 nodes): the fix offers ep 2, 4, 8 (the
    divisors of 8 other than 16 that divide the dense block 32) as the key to set, not mesh.shape."""
    mx.write_text(MX.replace("expert_parallel_degree = 8", "expert_parallel_degree = 16"))
    assert _main("plan", mx, "--cluster", "dgx-h100", "--nodes", 4) == 1
    err = _err(capsys)
    assert err[-2:] == [
        "infeasible: experts 8 are not divisible by ep 16",
        "fix: ep must divide the 8 experts: parallelism.expert_parallel_degree = 2 (4 experts per ep rank, efsdp 16; "
        "the dense mesh unchanged); or parallelism.expert_parallel_degree = 4 (2 experts per ep rank, efsdp 8; the "
        "dense mesh unchanged); or parallelism.expert_parallel_degree = 8 (1 expert per ep rank, efsdp 4; the dense "
        "mesh unchanged)"]


MEM = """\
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 2
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 2
[activation_checkpoint]
mode = "none"
"""


def test_torchtitan_memory_fix_names_the_file_keys(tmp_path, capsys):
    """Llama-3-70B at dp_shard 4 x tp 2, local batch 2, no AC on one node does not fit: the fix's
    knobs are activation_checkpoint.mode = "full", training.local_batch_size 1 and the degrees' keys.
    At seq 8192, 2 nodes (dp 8 at local batch 1: global 8) fit at 71.0 GiB of 79.11 x 0.9 = 71.2 GiB
    usable, within the batch (70.9 GiB before nc53 #1: the import's ``[memory] sp_gathered_input``
    keeps the output layer's all-gathered input, 8192 x 8192 x 2 B = 128 MiB, where the sequence
    shard, 64 MiB, was counted: +0.06 GiB; the full-AC layers keep their input only); at seq 16384 they do not, and the batch cap names
    training.global_batch_size (8 = 2 x 4, torchtitan's -1 default). (At the datasheet's 67.1 GiB the
    seq-8192 job needed more nodes than the batch allowed, and its line named the cap.)"""
    job = tmp_path / "mem.toml"
    job.write_text(MEM)
    assert _main("plan", job, "--cluster", "dgx-h100", "--nodes", 1) == 1
    fix = _err(capsys)[-1]
    # nothing fits: the variants close the line, after its fix, as no fix alone (newcomer trial 27 #B)
    assert "no fix alone: activation_checkpoint.mode = \"full\" -> peak " in fix
    assert "; training.local_batch_size 1 -> peak " in fix
    assert "; tensor_parallel_degree x2 (data_parallel_shard_degree 2 x tensor_parallel_degree 4) -> peak " in fix
    assert ("2 nodes would (activation_checkpoint.mode = \"full\" + training.local_batch_size 1, "
            "data_parallel_shard_degree 8 x tensor_parallel_degree 2: peak 71.0 GiB)") in fix
    long = tmp_path / "mem16.toml"
    long.write_text(MEM.replace("seq_len = 8192", "seq_len = 16384"))
    assert _main("plan", long, "--cluster", "dgx-h100", "--nodes", 1) == 1
    capped = _err(capsys)[-1]
    assert "training.global_batch_size 8 caps dp at 4 (training.global_batch_size / training.local_batch_size 2)" in capped
    for line in (fix, capped):
        for meshplan_words in ("recompute full", "micro_batch", "training.global_batch ", "dp_shard 2"):
            assert meshplan_words not in line


def test_megatron_batch_error_names_the_flags(tmp_path, capsys):
    """The example arguments (tp 2 x pp 2 on 16 GPUs: dp 4) with --global-batch-size 130: 130 % 4
    = 2, the multiples of 4 either side 128 and 132; 130 / 4 is no whole per-rank batch."""
    args = tmp_path / "mg.args"
    args.write_text((Path(__file__).parents[1] / "examples" / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text()
                    .replace("--global-batch-size 128", "--global-batch-size 130"))
    assert _main("plan", args, "--cluster", "dgx-h100", "--nodes", 2) == 2
    assert _err(capsys)[-1] == ("error: --global-batch-size: 130 is not divisible by --micro-batch-size 1 x dp 4 = 4; "
                                "use a multiple of 4 (128 or 132)")


HINT = """\
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 1
global_batch_size = 512
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
[activation_checkpoint]
mode = "none"
"""


def test_torchtitan_step_hint_names_the_file_keys(tmp_path, capsys):
    """Llama-3-70B at dp_shard 32 x tp 8 (32 nodes), 16 micro-batches: FSDP's re-gathers give a
    hint whose knobs are written as the job TOML sets them: parallelism.fsdp_reshard_after_forward
    = "never" (not training.reshard_after_forward = false, whose value torchtitan does not take)
    and training.local_batch_size; grad_accumulation has no torchtitan key and keeps its name.
    On DGX H200: since nc53 #1 the import keeps the tp all-gathered inputs of wq/wk/wv and w1/w3
    (``[memory] sp_gathered_input``), 2 x (8192 x 8192 - 8192 x 8192 / 8) x 2 B = 224 MiB more a layer
    and micro-batch, 80 x 224 MiB = 17.5 GiB (reshard-never peak 48.1 -> 65.7 GiB), so local batch
    2 (59.3 + 2 x 17.5 = 94.3 GiB) no longer fits an H100's usable 71.2 GiB; an H200 holds it (94.5 GiB)."""
    job = tmp_path / "hint.toml"
    job.write_text(HINT)
    assert _main("step", job, "--cluster", "dgx-h200", "--nodes", 32) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("hint: exposed fsdp")]
    assert len(hint) == 1
    assert 'parallelism.fsdp_reshard_after_forward = "never" (step ' in hint[0]
    assert "training.local_batch_size = 2 (step " in hint[0]
    assert "reshard_after_forward = false" not in hint[0] and "micro_batch" not in hint[0]
