"""Findings of newcomer trial 7 (issue 11): each test failed on main before its fix."""

import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import run_main as _main, plan_file as _plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Mixtral 8x7B under Megatron-LM, tp 2 x ep 8 on 4 DGX H100 nodes, without sequence parallelism.
MIXTRAL_ARGS = """--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
--num-attention-heads 32 --group-query-attention --num-query-groups 8 --kv-channels 128
--swiglu --normalization RMSNorm --position-embedding-type rope
--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000
--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall
--tensor-model-parallel-size 2 --expert-model-parallel-size 8
--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--micro-batch-size 1 --global-batch-size 256 --seq-length 4096 --bf16 --use-flash-attn
"""
MIXTRAL_TOML = """[model]
catalog = "mixtral-8x7b"
[cluster]
system = "dgx-h100"
nodes = 4
[training]
framework = "megatron"
global_batch = 256
seq_len = 4096
micro_batch = 1
sharding = "zero1"
recompute = "full"
[mesh]
names = ["dp", "tp", "ep"]
shape = [16, 2, 8]
sequence_parallel = {sp}
"""
SP_REASON = ("framework megatron: MoE with tp 2 (ep 8) needs sequence parallelism (Megatron-LM's MoELayer raises "
             "ValueError in training without it); fix: set [mesh] sequence_parallel = true (--sequence-parallel)")


def test_megatron_moe_with_tp_needs_sequence_parallel(tmp_path):
    off, on = tmp_path / "off.toml", tmp_path / "on.toml"
    off.write_text(MIXTRAL_TOML.format(sp="false"))
    on.write_text(MIXTRAL_TOML.format(sp="true"))
    assert _plan(off).reasons == (SP_REASON,)
    assert SP_REASON not in _plan(on).reasons
    # the same rule under framework torch does not apply (torch's MoE tp runs either way)
    torch_toml = tmp_path / "torch.toml"
    torch_toml.write_text(MIXTRAL_TOML.format(sp="false").replace('"megatron"', '"torch"'))
    assert SP_REASON not in _plan(torch_toml).reasons
    # export --to megatron refuses it (exit 2, one line), whatever the config's framework
    assert _main("export", torch_toml, "--to", "megatron", "-o", tmp_path / "x.args") == 2
    assert not (tmp_path / "x.args").exists()


def test_megatron_args_moe_tp_without_sp_is_infeasible(tmp_path, capsys):
    args = tmp_path / "mixtral.args"
    args.write_text(MIXTRAL_ARGS)
    assert _main("plan", args, "--cluster", "dgx-h100", "--nodes", 4) == 1
    # in the arguments' own words since ttkeys: the fix is the flag, not [mesh] sequence_parallel
    args_reason = SP_REASON.replace("set [mesh] sequence_parallel = true (--sequence-parallel)", "set --sequence-parallel")
    assert f"infeasible: {args_reason}" in capsys.readouterr().err.splitlines()


def test_moe_note_says_how_tokens_per_rank_follow_from_etp(tmp_path):
    """The args import keeps Megatron-LM's default etp = tp (2), and so does a TOML under
    framework megatron without etp (issue 11); given etp 1 it is 1, and the notes say what etp
    changes. Megatron-Core's MoEAlltoAllTokenDispatcher (NVIDIA/Megatron-LM d98e8a6,
    token_dispatcher.py:705-724) routes and all-to-alls each rank's own SP shard at any etp:
    T = b s/cp / tp = 1 x 4096 / 2 = 2048 (before moeetp f09458e3 the note said 4096 x etp / tp,
    4096 at etp 2). At etp 2 the received rows are then all-gathered over etp (dispatch_postprocess,
    :741-751): dropless balanced, a rank receives T x top_k = 2048 x 2 = 4096 rows (512 from each
    of ep 8 peers), gathered 2 x 4096 = 8192 rows x hidden 4096 x 2 B (bf16) = 67,108,864 B."""
    args = tmp_path / "mixtral.args"
    args.write_text(MIXTRAL_ARGS.replace("--tensor-model-parallel-size 2", "--tensor-model-parallel-size 2 "
                                         "--sequence-parallel"))
    toml = tmp_path / "on.toml"
    toml.write_text(MIXTRAL_TOML.format(sp="true").replace('["dp", "tp", "ep"]', '["dp", "tp", "ep", "etp"]')
                    .replace("[16, 2, 8]", "[16, 2, 8, 1]"))
    out = tmp_path / "imported.toml"
    assert _main("import", "megatron", args, "--cluster", "dgx-h100", "--nodes", 4, "-o", out) == 0
    plans = [_plan(p).notes for p in (out, toml)]
    notes = [[n for n in ns if n.startswith("MoE dropless")][0] for ns in plans]
    assert "tokens per rank T = 4096 local tokens / tp 2 = 2048," in notes[0]
    assert "tokens per rank T = 4096 local tokens / tp 2 = 2048," in notes[1]
    gathers = [[n for n in ns if n.startswith("MoE etp")] for ns in plans]
    assert gathers[0] == ["MoE etp 2 (Megatron-LM): each rank's 4096 received rows all-gathered over etp, "
                          "2 x 4096 = 8192 rows x hidden 4096 x 2 B = 67,108,864 B for the expert GEMMs, and their "
                          "output reduce-scattered back before the combine (the etp rows)"]
    assert gathers[1] == []


def test_compare_of_deepspeed_jsons_hints_model_and_seq_len(capsys):
    js = EXAMPLES / "deepspeed_zero2_16xh100.json"
    assert _main("compare", js, js) == 2
    err = capsys.readouterr().err
    assert f"run meshplan import deepspeed {js} --cluster NODE --nodes N --model M --seq-len S -o plan.toml" in err


def test_stage0_search_note_names_only_searched_shardings(tmp_path):
    from meshplan.config import load_config
    from meshplan.search.settings_notes import settings_notes
    from meshplan.search.space import enumerate_candidates
    js = tmp_path / "ds0.json"
    # fp16: bf16 at stage 0 is BF16_Optimizer (sharding zero1), not DeepSpeed without ZeRO
    js.write_text((EXAMPLES / "deepspeed_zero2_16xh100.json").read_text().replace('"stage": 2', '"stage": 0')
                  .replace('"bf16": {"enabled": true}', '"fp16": {"enabled": true}'))
    out = tmp_path / "z0.toml"
    assert _main("import", "deepspeed", js, "--cluster", "dgx-h100", "--nodes", 2, "--model", "llama3-8b",
                 "--seq-len", 8192, "-o", out) == 0
    cfg = load_config(out, require_mesh=False)
    assert "hsdp" not in cfg.search.sharding
    note = [n for n in settings_notes(cfg, enumerate_candidates(cfg)) if n.startswith("training.zero0_engine")]
    assert note and note[0].endswith("(zero_optimization.stage 1, 2, 3 of the same runtime)")


def test_minus_one_error_drops_pp_1():
    from meshplan.mesh.resolve import world_error
    from meshplan.spec.mesh import MeshSpec
    e = world_error(MeshSpec(names=["dp", "pp", "tp"], shape=[-1, 1, 16]), 8, 8)
    assert str(e) == ("mesh.shape: dp = -1 cannot be inferred: tp 16 does not divide the cluster's 8 GPUs; "
                      "fix: tp 1, 2, 4 or 8 (a divisor of 8), or cluster.nodes = 2 (16 GPUs)")


def test_lost_nodes_on_one_node_is_singular(tmp_path, capsys):
    path = tmp_path / "one.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                    '[training]\nglobal_batch = 8\nseq_len = 4096\n[mesh]\nnames = ["dp_shard"]\nshape = [8]\n')
    assert _main("reliability", path, "--write-gbps", 5, "--read-gbps", 5, "--restart-overhead-s", 60,
                 "--lost-nodes", 2) == 2
    assert "is more than the cluster's 1 node\n" in capsys.readouterr().err


def test_help_texts_are_whole_sentences():
    from typer.testing import CliRunner

    from meshplan import cli
    r = CliRunner().invoke(cli.app, ["import", "--help"], env={"COLUMNS": "200"})
    words = " ".join(r.output.split())  # the option column's width moves the wrapping (nc52d: --gradient-checkpointing)
    assert "(omitted or -: print it to stdout)" in words and "(default, or -" not in words
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "torchtitan_h100.py"
    h = subprocess.run([sys.executable, bench, "--help"], capture_output=True, text=True, timeout=120,
                       env={"COLUMNS": "1000", "PYTHONPATH": str(bench.parents[1])})
    assert "(no constant of the model is fitted to these; ../shared/reference/published-runs-dev.md is the " \
           "development set)." in h.stdout, h.stdout + h.stderr


def test_search_without_a_feasible_mesh_gives_the_verdict_on_stderr(tmp_path, capsys):
    """stdout keeps its report (scripts reading it still work); stderr gets the
    'infeasible: ...' line ``meshplan --help`` promises for exit 1."""
    path = tmp_path / "c.toml"
    path.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                    '[training]\nglobal_batch = 12\nseq_len = 4096\nframework = "torch"\n'
                    '[search]\nsharding = ["zero1"]\npp = [1]\ncp = [1]\ndp_replicate = [1]\ntp = [1, 2]\n'
                    'micro_batch = [1, 2]\nrecompute = ["full"]\n')
    assert _main("search", path) == 1
    out, err = capsys.readouterr()
    assert out.startswith("no feasible mesh: of 4 candidates") or "\nno feasible mesh: of 4 candidates" in out
    timing, verdict = err.splitlines()  # the search's wall time is stderr's too (measured: not in the report)
    assert timing.startswith("timing: the search took ") and timing.endswith(" s of wall time on this machine (it "
                                                                             "varies by machine; not part of the plan "
                                                                             "or the report)")
    assert verdict == ("infeasible: no feasible mesh: of 4 candidates rule 'batch' rejected 3 (global_batch not "
                       "divisible by micro_batch * dp), 'framework' 1; fix: set training.global_batch to a multiple of "
                       "micro_batch x dp for some [search] micro_batch and dp")
