"""Newcomer trial nc58 (an MoE practitioner): the memory ``fix:`` line offers an MoE mesh more expert
parallelism (#1: Mixtral-8x7B at ep 1 was offered pp x2 and full recompute, both tight, never ep; each
peak is the plan of the config edited by hand); a Megatron-LM flag one word from the ep or top-k flag is
refused (#2); torchtitan's Python-config name of the EP backend in a job TOML is refused (#7)."""

from __future__ import annotations

from dataclasses import replace

from meshplan.config import load_config
from meshplan.interop.foreign import ImportOptions, load_any
from meshplan.interop.keymaps import keymap_of
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.plan_fix_ep import ep_variant
from meshplan.units import GiB
from tests.configs import TP4_MB2

#: Mixtral-8x7B on 32 dgx-h100 as Megatron-LM runs it: pp 4 x dp 64, distributed optimizer, no
#: recompute, the experts unsplit (ep 1).
MIXTRAL_EP1 = """
[model]
catalog = "mixtral-8x7b"
[cluster]
system = "dgx-h100"
nodes = 32
[training]
global_batch = 1024
seq_len = 4096
micro_batch = 1
sharding = "zero1"
recompute = "none"
param_dtype = "bf16"
grad_reduce_dtype = "fp32"
framework = "megatron"
moe_dropless = true
[mesh]
names = ["pp", "dp"]
shape = [4, 64]
"""

#: One routed expert of Mixtral-8x7B: w1, w3 (4096 x 14336) and w2 (14336 x 4096), config.json sizes.
EXPERT = 3 * 4096 * 14336


def _expert_state_bytes(ep: int) -> int:
    """A stage-0 rank's routed-expert state at ``ep`` by hand: 8 layers (32 / pp 4) x 8 / ep experts,
    bf16 parameter 2 B + fp32 main gradient 4 B each unsharded (Megatron-LM's DDP buffer), fp32 master
    4 B + Adam's two fp32 moments 8 B sharded over the expert data axis, dp 64 / ep ranks."""
    params = 8 * (8 // ep) * EXPERT
    return params * 6 + params * 12 // (64 // ep)


def _at_ep(cfg, ep: int):
    return build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["pp", "dp", "ep"],
                                                                     "shape": [4, 64, ep]})))


def test_mixtral_at_ep1_is_offered_the_smallest_ep_that_keeps_15_percent_free(tmp_path):
    """ep 1 -> 2 removes 8 layers x 4 experts of state: 69,759,664,128 - 35,936,796,672 B = 31.5 GiB,
    ep 1 -> 4 removes 69,759,664,128 - 19,025,362,944 B = 47.25 GiB (:func:`_expert_state_bytes`); the
    rest of the peak (dense state, activations: the same copies per rank at any ep under balanced
    routing) moves by under 0.5 GiB. From ep 1's 100.1 GiB: ep 2 about 68.6 GiB, over 0.85 x 71.2 =
    60.5 GiB (fits, tight); ep 4 about 52.9 GiB (15% free): the line offers ep 4 first, with its own plan's
    peak, before pp x2 and recompute full, both tight."""
    path = tmp_path / "mixtral_ep1.toml"
    path.write_text(MIXTRAL_EP1, encoding="utf-8")
    cfg = load_config(path)
    one, two, four = build_plan(cfg), _at_ep(cfg, 2), _at_ep(cfg, 4)
    assert not one.feasible and two.feasible and four.feasible
    assert _expert_state_bytes(1) - _expert_state_bytes(2) == 33_822_867_456
    assert _expert_state_bytes(1) - _expert_state_bytes(4) == 50_734_301_184
    peak = {k: p.timeline.peak.total_bytes for k, p in ((1, one), (2, two), (4, four))}
    for k in (2, 4):
        assert abs(peak[1] - peak[k] - (_expert_state_bytes(1) - _expert_state_bytes(k))) < 0.5 * GiB
    usable = one.timeline.usable_bytes
    assert usable - peak[2] < 0.15 * usable <= usable - peak[4]  # ep 2 tight, ep 4 not
    line = memory_fix(one)
    assert line.startswith(f"fix: ep 4 (2 experts per ep rank; the dense mesh unchanged) -> peak "
                           f"{peak[4] / GiB:.1f} GiB (fits; step ")
    assert "pp x2 (pp 8 x dp 32)" in line and "recompute full" in line


def test_megatron_args_name_the_ep_flag(tmp_path):
    """The same job as Megatron-LM arguments without --expert-model-parallel-size: the fix names the flag."""
    args = tmp_path / "mixtral.args"
    args.write_text(
        "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
        "--num-query-groups 8 --kv-channels 128 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 "
        "--position-embedding-type rope --rotary-base 1000000 --max-position-embeddings 32768 "
        "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000 --attention-dropout 0.0 "
        "--hidden-dropout 0.0 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --use-distributed-optimizer "
        "--micro-batch-size 1 --global-batch-size 1024 --seq-length 4096 --bf16 --use-flash-attn\n", encoding="utf-8")
    cfg = load_any(args, "megatron", ImportOptions(cluster="dgx-h100", nodes=32))
    plan = build_plan(cfg)
    words, fixed = ep_variant(plan, keymap_of(plan.config))
    assert words == "--expert-model-parallel-size 4 (2 experts per ep rank; the dense mesh unchanged)"
    assert fixed.mesh.ep == 4 and fixed.feasible


def test_no_ep_variant_for_a_dense_model_or_an_ep_at_the_experts():
    """A dense model has no experts to split; Mixtral at ep 8 holds one expert a layer already."""
    assert ep_variant(build_plan(load_config(TP4_MB2))) is None


def test_no_ep_variant_at_one_expert_per_rank(tmp_path):
    path = tmp_path / "mixtral_ep1.toml"
    path.write_text(MIXTRAL_EP1, encoding="utf-8")
    assert ep_variant(_at_ep(load_config(path), 8)) is None


def test_megatron_ep_and_topk_flags_under_other_names_are_refused(tmp_path, capsys):
    """nc58 #2: ``--expert-parallel-size 8`` (one word short of ``--expert-model-parallel-size``) was a
    note and the job planned at ep 1 (100.1 GiB, infeasible, a fix without ep); ``--moe-topk`` planned
    Megatron-LM's default top-2 whatever it said. Megatron-LM's argparse (``parse_args``,
    ``allow_abbrev=False``) refuses both, so the job cannot start: exit 2, one line naming the flag."""
    from tests.cli_run import run_cli
    base = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
            "--num-experts 8 --seq-length 4096 --micro-batch-size 1 --global-batch-size 1024 --bf16 ")
    for wrong, right in (("--expert-parallel-size 8", "--expert-model-parallel-size"),
                         ("--moe-topk 1", "--moe-router-topk")):
        args = tmp_path / "job.args"
        args.write_text(base + wrong + "\n", encoding="utf-8")
        code, _, err = run_cli(["plan", args, "--cluster", "dgx-h100", "--nodes", "32"], capsys)
        flag = wrong.split()[0]
        assert code == 2 and err.strip() == (
            f"error: {flag}: not a Megatron-LM flag (its parser refuses it); did you mean {right}? "
            "(meshplan reads that one: misspelt, the setting would stay at its default)")


def test_torchtitan_job_toml_moe_comm_backend_names_the_job_toml_key(tmp_path, capsys):
    """nc58 #7: ``parallelism.moe_comm_backend = "deepep"`` (the Python configs' name) in a job TOML was
    only in the unused list and the job planned with the standard all-to-all; torchtitan's job TOML
    reads the backend as ``parallelism.expert_parallel_comm_backend`` (job_config.py:474 at e347b1e)."""
    from tests.cli_run import run_cli
    job = tmp_path / "job.toml"
    job.write_text('[model]\nname = "deepseek_v3"\nflavor = "16B"\n[training]\nlocal_batch_size = 1\nseq_len = 4096\n'
                   '[parallelism]\nexpert_parallel_degree = 8\nmoe_comm_backend = "deepep"\n', encoding="utf-8")
    code, _, err = run_cli(["plan", job, "--cluster", "dgx-h100", "--nodes", "1"], capsys)
    assert code == 2 and err.strip() == (
        "error: parallelism.moe_comm_backend: not a torchtitan job-TOML key (the name torchtitan's Python configs give "
        "the backend, model_registry(..., moe_comm_backend=)); in a job TOML write "
        "parallelism.expert_parallel_comm_backend = 'deepep'")


QWEN3_OP = ('[model]\nname = "qwen3"\nflavor = "30B-A3B"\n[training]\nlocal_batch_size = 4\nglobal_batch_size = 1024\n'
            'seq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = -1\nexpert_parallel_degree = 8\n'
            '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n[compile]\nenable = true\n')


def test_op_sac_words_say_the_ep_all_to_alls_are_replayed_where_the_table_replays_them(tmp_path, capsys):
    """nc58 #6: a torchtitan v0.2.2 qwen3 job under op SAC (op_sac_policy 238fa99): its save list
    (models/qwen3/infra/parallelize.py 39-54 at 238fa99) has no all_to_all_single, so the replay issues the
    dispatch and combine again: per MoE layer 2 forward all-to-alls, 2 backward (their gradients) + 2
    replayed = 4 (the table), and the recompute words now say so instead of "ep all-to-all outputs saved".
    Each all-to-all: 4 x 4096 tokens x top-8 x hidden 2048 x 2 B = 536,870,912 B."""
    from tests.cli_run import run_cli
    job = tmp_path / "qwen3.toml"
    job.write_text(QWEN3_OP, encoding="utf-8")
    code, out, _ = run_cli(["plan", job, "--cluster", "dgx-h100", "--nodes", "32"], capsys)
    flat = " ".join(out.split())
    assert code == 0
    assert ("tp reduce-scatter outputs saved; the ep all-to-alls replayed with the MoE layer (this model's save list "
            "at this op_sac_policy has no all_to_all_single)") in flat
    assert "ep all-to-all outputs saved" not in flat
    plan = build_plan(load_any(job, None, ImportOptions(cluster="dgx-h100", nodes=32)))
    rows = [r for r in plan.collectives["stage 0"] if r.axis == "ep" and r.size_bytes == 4 * 4096 * 8 * 2048 * 2]
    assert {r.phase: r.per_layer for r in rows} == {"forward": 2.0, "backward": 4.0}


def test_op_sac_words_keep_saved_where_the_save_list_has_the_all_to_all():
    """deepseek_v3 (MLA) at 238fa99 saves all_to_all_single (models/deepseek_v3/infra/parallelize.py 41);
    b5bcd76 saves it for every model: the words keep "ep all-to-all outputs saved"."""
    from meshplan.catalog import model
    from meshplan.compute.recompute import op_replays_ep
    from meshplan.spec.recompute_words import recompute_words
    from meshplan.spec.training import TrainingSpec
    t = TrainingSpec(global_batch=8, seq_len=16, recompute="op", op_sac_policy="238fa99")
    ds = model("deepseek-v3")
    assert not op_replays_ep(ds, t)
    assert "and ep all-to-all outputs saved" in recompute_words(t, "torch", replays_ep=op_replays_ep(ds, t))


def test_megatron_export_runs_the_grouped_gemm_the_plan_times(tmp_path, capsys):
    """nc58 #5: the plan times a rank's routed experts as one grouped GEMM, but ``export --to megatron``
    wrote no ``--moe-grouped-gemm`` (a switch, off by default in Megatron-LM d98e8a6: SequentialMLP, one
    GEMM per local expert in turn), and the import listed the flag as unused. Mixtral-8x7B at ep 2:
    8 / 2 = 4 local experts a layer. The export writes the flag; the file without it is noted."""
    from tests.cli_run import run_cli
    src = tmp_path / "mixtral_ep2.toml"
    src.write_text(MIXTRAL_EP1.replace('names = ["pp", "dp"]\nshape = [4, 64]', 'names = ["pp", "dp", "ep"]\n'
                                       'shape = [4, 64, 2]'), encoding="utf-8")
    out = tmp_path / "mixtral.args"
    code, _, err = run_cli(["export", src, "--to", "megatron", "-o", out], capsys)
    assert code == 0, err
    flags = out.read_text(encoding="utf-8").splitlines()
    assert "--moe-grouped-gemm" in flags and "--expert-model-parallel-size 2" in flags
    cfg = load_any(out, "megatron", ImportOptions(cluster="dgx-h100", nodes=32))
    assert not any("moe-grouped-gemm" in n for n in cfg.notes)  # read: neither a note nor unused
    out.write_text("\n".join(f for f in flags if f != "--moe-grouped-gemm") + "\n", encoding="utf-8")
    cfg = load_any(out, "megatron", ImportOptions(cluster="dgx-h100", nodes=32))
    assert ("megatron: --moe-grouped-gemm not given: Megatron-LM runs SequentialMLP, the 4 local experts of a layer "
            "one GEMM after another; planned as one grouped GEMM (TEGroupedMLP): add --moe-grouped-gemm") in cfg.notes


def test_megatron_ep_overlap_flag_is_noted_not_modelled(tmp_path):
    """nc58 #4: ``--overlap-moe-expert-parallel-comm`` was only in the unused list while step's ep hint
    (DeepSeek-V3, pp 16 x ep 64: 'costs the critical stage 25.67 s ... ep 8 -47.8%') assumed every ep
    all-to-all exposed. Now a note says the overlap is not modelled and the exposed ep an upper bound;
    at ep 1 (no all-to-all) nothing is said."""
    def notes(ep: int) -> tuple[str, ...]:
        args = tmp_path / f"ep{ep}.args"
        args.write_text("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
                        "--num-experts 8 --moe-router-topk 2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "
                        f"--expert-model-parallel-size {ep} --overlap-moe-expert-parallel-comm --seq-length 4096 "
                        "--micro-batch-size 1 --global-batch-size 1024 --bf16 --vocab-size 32000\n", encoding="utf-8")
        return load_any(args, "megatron", ImportOptions(cluster="dgx-h100", nodes=32)).notes
    line = ("megatron: --overlap-moe-expert-parallel-comm not modelled: the ep all-to-alls are planned as exposed as "
            "without it, so step's exposed ep (and an ep hint built on it) is an upper bound")
    assert line in notes(8)
    assert not any("overlap-moe-expert-parallel-comm" in n for n in notes(1))


LLAMA_RUNS = """
[model]
catalog = "llama3-8b"
[cluster]
system = "dgx-h100"
nodes = 2
[training]
global_batch = 56
seq_len = 8192
micro_batch = 1
sharding = "zero3"
recompute = "full"
pp_schedule_runs = 14
[mesh]
names = ["pp", "dp_shard"]
shape = [4, 4]
pp_schedule = "interleaved_1f1b"
virtual_stages = 2
"""


def test_bubble_hint_offers_fewer_schedule_runs(tmp_path, capsys):
    """nc58 #3: torchtitan's accumulation under pp (local_batch_size 1: each of the step's runs one
    micro-batch) idled 95% of a DeepSeek-V3 step with no hint naming it. Here 56 sequences / dp 4 = 14
    micro-batches in 14 runs of 1. Fewer runs r (dividing 14) whose 14 / r torch's ScheduleInterleaved1F1B
    takes (rounds = max(1, m // pp), m % rounds == 0): r 1, m 14: rounds 3, 14 % 3 = 2, refused; r 2, m 7:
    rounds 1, taken. The hint's step is the config edited by hand to pp_schedule_runs = 2."""
    from meshplan.schedule.steptime import step_time
    from meshplan.units import step_seconds
    from tests.cli_run import run_cli
    path = tmp_path / "runs.toml"
    path.write_text(LLAMA_RUNS, encoding="utf-8")
    code, out, _ = run_cli(["step", path], capsys)
    flat = " ".join(out.split())
    edited = load_config(path)
    edited = replace(edited, training=edited.training.model_copy(update={"pp_schedule_runs": 2}))
    want = step_seconds(step_time(build_plan(edited)).step_s)
    assert code == 0
    assert ("pp 4, 14 micro-batches per step in 14 schedule runs of 1): shorter with training.pp_schedule_runs = 2 "
            f"(2 schedule runs of 7 micro-batches) (step {want},") in flat


def test_bubble_hint_in_a_b5bcd76_registry_names_num_pp_microbatches(tmp_path):
    """The same 14 runs of 1 read from a b5bcd76 config registry (torchtitan, op_sac_policy b5bcd76): that
    revision has no training.local_batch_size (batch in tokens, keymaps.keymap_of); its micro-batches a run
    are parallelism.num_pp_microbatches, so the hint's r 2 is 14 / 2 = 7 of them (the 9810191 words would
    say local_batch_size = 1 x 14 / 2 = 7 too, under another key)."""
    from meshplan.schedule.bubble_hint import _one_run
    path = tmp_path / "runs.toml"
    path.write_text(LLAMA_RUNS, encoding="utf-8")
    base = load_config(path)
    old = replace(base, origin="torchtitan")
    new = replace(old, training=old.training.model_copy(update={"op_sac_policy": "b5bcd76"}))
    assert _one_run(build_plan(new))[0][0].startswith("parallelism.num_pp_microbatches = 7 (training.pp_schedule_runs 2:")
    assert _one_run(build_plan(old))[0][0].startswith("training.local_batch_size = 7 (training.pp_schedule_runs 2:")
    assert _one_run(build_plan(base))[0][0].startswith("training.pp_schedule_runs = 2 (2 schedule runs of 7")
