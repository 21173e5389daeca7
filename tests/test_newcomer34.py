"""Findings of newcomer trial 34 (issue 11; a Megatron-LM user on 128 x 8 H200, scripts in
tests/data/nc34/: theirs and two of Megatron-LM's examples at d98e8a6): each test failed on main
before its fix."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, user_source
from meshplan.interop.foreign import load_any
from meshplan.interop.launch import parse_launch
from meshplan.interop.megatron import SWITCHES
NC34 = Path(__file__).parent / "data" / "nc34"
H200 = ImportOptions(cluster="dgx-h200", nodes=128)
TORCHRUN = ("--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port")


def test_torchrun_options_in_a_bash_array_are_the_launchers():
    """Finding 1. ``DISTRIBUTED_ARGS=(--nproc_per_node 8 ... )`` expanded by ``torchrun
    ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py`` (Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh):
    bash puts the array's words where it is expanded, between torchrun and the script, so they are
    torchrun's. Was: read where the array is defined, as pretrain_gpt.py's flags, and ``--master_addr
    $(scontrol show hostnames ... | head -n 1)`` cut at its first space ('$(scontrol')."""
    text = (NC34 / "train_llama3_70b.sh").read_text().replace(
        "--master_addr $MASTER_ADDR", '--master_addr $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
    args, launcher = parse_launch(text, SWITCHES)
    assert not set(TORCHRUN) & set(args)
    assert launcher["--master_addr"] == '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'
    assert (launcher["--nproc_per_node"], launcher["--node_rank"], launcher["--master_port"]) == (
        "8", "${SLURM_NODEID:-0}", "6000")
    assert (args["--tensor-model-parallel-size"], args["--num-layers"], args["--save"]) == (
        "4", "80", "/lustre/ckpt/llama3-70b")  # MODEL_ARGS etc. still the script's


def test_export_writes_no_torchrun_option(capsys):
    """Finding 1, the export: the flags carried from the script are pretrain_gpt.py's only (the
    newcomer's l70.export.sh had --nproc_per_node 8, --node_rank '${SLURM_NODEID:-0}' and
    --master_addr '$(scontrol')."""
    src = NC34 / "train_llama3_70b.sh"
    cfg = load_any(src, "megatron", H200)
    assert not any(f in n for n in cfg.notes for f in TORCHRUN[:1] + TORCHRUN[2:])  # not "fields not used"
    text, _ = export(cfg, "megatron", str(src), user_source(src, "megatron"))
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in body if line.split(" ")[0] in TORCHRUN]
    assert "--tensorboard-dir /lustre/tb/llama3-70b" in body


def test_vpp_chunk_flag_counts_the_embedding_and_loss_layers():
    """Finding 2. Megatron-LM arguments.py 953-975 (d98e8a6) adds one layer for each of
    --account-for-embedding/loss-in-pipeline-split before its checks: (126 + 2) / pp 8 = 16 per
    stage, / --num-layers-per-virtual-pipeline-stage 2 = vpp 8; each virtual stage 128 / 64 = 2
    slots, the first and last giving one to the embedding and the loss: [1, 2 x 62, 1]. Was refused:
    126 does not divide over pp 8."""
    cfg = load_any(NC34 / "train_llama3_405b.sbatch", "megatron", H200)
    assert (cfg.mesh.virtual_stages, cfg.mesh.pp_schedule) == (8, "interleaved_1f1b")
    assert cfg.mesh.pp_layer_split == [1] + [2] * 62 + [1]
    bad = (NC34 / "train_llama3_405b.sbatch").read_text().replace("pipeline-stage 2", "pipeline-stage 3")
    with pytest.raises(ConfigError, match=r"^--num-layers-per-virtual-pipeline-stage: 3 does not divide the 126 "
                                          r"layers \+ embedding \+ loss = 128 / pp 8 = 16 per stage"):
        load_any(_write(bad), "megatron", H200)


def _write(text: str, name: str = "job.sh") -> Path:
    d = Path(tempfile.mkdtemp())
    (d / name).write_text(text)
    return d / name


def test_megatron_fp8_example_reads_the_branch_that_runs():
    """Finding 3. examples/llama/train_llama3_8b_h100_fp8.sh (d98e8a6): DTYPE="fp8" makes its first
    if add --fp8-format hybrid; TOKENIZER_ARG=${3:-"MOCK"} (no argument given) takes the mock-data
    branch, whose quoted items ("--num-workers 1", "--vocab-size 128256") the unquoted
    ${DATA_ARGS_LIST[@]} splits into words (bash word splitting), so Megatron-LM sees --vocab-size
    128256. Llama 3 8B: 32 layers, hidden 4096; 1 node of 8: dp 8."""
    cfg = load_any(NC34 / "train_llama3_8b_h100_fp8.sh", "megatron", ImportOptions(cluster="dgx-h100"))
    assert (cfg.model.layers, cfg.model.hidden, cfg.model.vocab, cfg.training.linear_dtype) == (32, 4096, 128256, "fp8")
    assert (cfg.mesh.names, cfg.mesh.shape, cfg.cluster.nodes) == (["dp"], [8], 1)
    assert not any("--tokenizer-model" in n for n in cfg.notes)  # the real-data branch is not read


def test_quoted_array_item_is_one_word_as_argparse_sees_it():
    """Finding 3. "${ARR[@]}" keeps "--num-workers 1" one word; CPython's argparse (_parse_optional:
    "if it contains a space, it was meant to be a positional") leaves it unrecognized and Megatron-LM's
    parse_args exits: refused, naming the flag."""
    text = ('A=("--num-layers 32" --bf16)\ntorchrun pretrain_gpt.py "${A[@]}" --hidden-size 4096 '
            '--num-attention-heads 32 --seq-length 4096 --vocab-size 128256\n')
    with pytest.raises(ConfigError, match=r"^--num-layers: '--num-layers 32' reaches pretrain_gpt.py as one word"):
        load_any(_write(text), "megatron", ImportOptions(cluster="dgx-h100"))


def test_if_with_an_unknown_test_is_refused_with_its_line():
    """Finding 3: an if whose test meshplan cannot evaluate, choosing flags: a one-line error naming
    its line; an if that sets no flag (the example's pretrain_gpt.py check) is skipped."""
    text = ('#!/bin/bash\nif [ -n "$SLURM_JOB_ID" ]; then\n  TP=8\nelse\n  TP=4\nfi\n'
            'torchrun pretrain_gpt.py --tensor-model-parallel-size $TP\n')
    with pytest.raises(ConfigError, match=r"^megatron: line 2: 'if \[ -n \"\$SLURM_JOB_ID\" \]' chooses flags"):
        load_any(_write(text), "megatron", ImportOptions(cluster="dgx-h100"))


def test_export_of_a_default_is_carried_back_unchanged():
    """Finding 3: ``export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}`` is carried into the export's
    header as written (was '${NCCL_IB_TIMEOUT:-19}' in single quotes: the literal string), and
    ``CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}`` is read as 1 (not "set it to 1")."""
    text = (NC34 / "train_llama3_70b.sh").read_text().replace(
        "NCCL_IB_TIMEOUT=19", "NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}").replace(
        "CUDA_DEVICE_MAX_CONNECTIONS=1", "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}")
    src = _write(text)
    cfg = load_any(src, "megatron", H200)
    note = next(n for n in cfg.notes if "CUDA_DEVICE_MAX_CONNECTIONS" in n)
    assert ": read (" in note and "set it to 1" not in note
    _, head = export(cfg, "megatron", str(src), user_source(src, "megatron"))
    line = next(h for h in head if h.startswith("environment carried"))
    assert line.endswith("export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19} NCCL_IB_QPS_PER_CONNECTION=4 "
                         "NVTE_FWD_LAYERNORM_SM_MARGIN=16 NVTE_BWD_LAYERNORM_SM_MARGIN=16")


def test_recompute_modules_beyond_core_attn_are_read():
    """Finding 4. ``--recompute-granularity selective --recompute-modules core_attn mlp``: Megatron-LM's
    TransformerConfig.recompute_modules (default ["core_attn"], transformer_config.py 560, 1940 at
    d98e8a6) also replays the MLP. Was: ``mlp`` dropped (one value read of an nargs="+" flag) and the plan
    made as core_attn alone; then refused in one line, as meshplan's selective recompute modelled the
    attention core only. Now both are read (``training.recompute_modules``, what each keeps and replays:
    tests/test_recompute_modules.py); a name Megatron-LM does not have is still one line."""
    src = NC34 / "train_llama3_70b_recompute_modules.sh"
    cfg = load_any(src, "megatron", H200)
    assert (cfg.training.recompute, cfg.training.recompute_modules) == ("selective", ("core_attn", "mlp"))
    assert not any("--recompute-modules" in n for n in cfg.notes)  # read, not "not used"
    with pytest.raises(ConfigError, match=r"^--recompute-modules: core_attn ffn: 'ffn' is not a Megatron-LM "
                                          r"recompute module; use core_attn, moe_act"):
        load_any(_write(src.read_text().replace("core_attn mlp", "core_attn ffn")), "megatron", H200)


def test_nccl_nvls_enable_0_times_the_all_reduce_on_the_ring():
    """Finding 5. ``export NCCL_NVLS_ENABLE=0`` (the 405B sbatch): NCCL sets up no NVLS (nccl
    src/transport/nvls.cc:262, ``if (!ncclParamNvlsEnable() ...) return``), so the tp all-reduce of
    128 MiB on 8 H200s runs on the NVLink ring. Was: listed as "not used" and timed on NVLS."""
    from meshplan.plan import build_plan
    cfg = load_any(NC34 / "train_llama3_405b.sbatch", "megatron", H200)
    assert cfg.cluster.node.fabric.nvls is False
    assert not any("export NCCL_NVLS_ENABLE" in n and "not use" in n for n in cfg.notes)
    rows = [r for table in build_plan(cfg, memory=False).collectives.values() for r in table]
    algos = {r.algorithm for r in rows if r.axis == "tp" and r.op == "all-reduce"}
    assert "NVLS" not in algos and "ring" in algos


def test_launch_carries_the_scripts_nccl_and_nvte_exports(tmp_path):
    """Finding 5: launch's torchrun.sh exports the script's NCCL_* / NVTE_* variables (it already set
    CUDA_DEVICE_MAX_CONNECTIONS), a ``${NAME:-default}`` in that form."""
    from tests.cli_run import run_main
    src = tmp_path / "train.sh"
    src.write_text((NC34 / "train_llama3_70b.sh").read_text().replace(
        "NCCL_IB_TIMEOUT=19", "NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}"))
    toml = tmp_path / "l70.toml"
    assert run_main("import", "megatron", src, "--cluster", "dgx-h200", "--nodes", "128", "-o", toml) == 0
    assert run_main("launch", toml, "--out", tmp_path / "out", "--", "python", "pretrain_gpt.py") == 0
    text = (tmp_path / "out" / "torchrun.sh").read_text()
    for line in ("export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}", "export NCCL_IB_QPS_PER_CONNECTION=4",
                 "export NVTE_FWD_LAYERNORM_SM_MARGIN=16", "export CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert line in text.splitlines()


def test_search_compares_the_llama3_split_per_virtual_stage():
    """Finding 7. The 405B sbatch's split per virtual stage, [1, 2 x 62, 1] (pp 8 x vpp 8, 128 slots of
    2), is the search's Llama 3 candidate per stage: ends_short_split(126, 8, 8) = balanced 128 / 8 = 16
    less one at each end, [15, 16 x 6, 15], spread over 8 chunks with the short ones at the model's ends:
    [1, 2, ..., 2, 1] again. Was: compared literally, so "the user's mesh is not among the candidates"."""
    from dataclasses import replace as dc_replace
    from meshplan.mesh.layers import ends_short_split
    from meshplan.search.configured_find import _differs
    cfg = load_any(NC34 / "train_llama3_405b.sbatch", "megatron", H200)
    per_stage = ends_short_split(126, 8, 8)
    assert per_stage == [15] + [16] * 6 + [15]
    row = dc_replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_layer_split": per_stage}))
    assert _differs(cfg, cfg.mesh, row) is None
    other = dc_replace(cfg, mesh=cfg.mesh.model_copy(update={"pp_layer_split": [16] * 8}))
    assert _differs(cfg, cfg.mesh, other).startswith("mesh.pp_layer_split [1, 2, 2")


def test_place_names_megatrons_dp_cp_group_as_plan_does(tmp_path, capsys):
    """Finding 8. The 70B plan (Megatron-LM, zero1: the distributed optimizer over dp 32 x cp 2 = 64)
    named that group ``fsdp 64`` in place's table and lines, ``dp x cp (distributed optimizer)`` in
    plan's groups table (meshplan.spec.wording.group_words): one name now."""
    from tests.cli_run import run_cli
    toml = tmp_path / "l70.toml"
    cfg_src = tmp_path / "train.sh"
    cfg_src.write_text((NC34 / "train_llama3_70b.sh").read_text())
    assert run_cli(["import", "megatron", cfg_src, "--cluster", "dgx-h200", "--nodes", "128", "-o", toml], capsys)[0] == 0
    code, out, _ = run_cli(["place", toml], capsys)
    assert code == 0
    assert "dp x cp (distributed optimizer) 64 spans 32 nodes" in out
    assert not [line for line in out.splitlines() if line.strip().startswith("fsdp ") or " fsdp " in line]


def test_calibrate_takes_the_test_per_file(tmp_path, capsys):
    """Finding 6. The newcomer's logs predate nccl-tests' '# Collective test starting' banner (dafb704,
    2025-06): all_gather rows (redop none, root -1, busbw/algbw 7/8 = 0.875 over 8 ranks) fit all_gather
    and alltoall alike, and --op applied to every log, so ``--op all_gather`` read the all_reduce log
    (busbw/algbw 2 x 7/8 = 1.750) as all-gather and failed on its rank count. Now ``FILE:TEST`` names
    one log's test, and --op meant for one log refuses another whose rows fit another test, naming it."""
    from tests.cli_run import run_cli
    logs = sorted((NC34 / "nccl").glob("*.txt"))
    ag = next(p for p in logs if p.name.startswith("all_gather"))
    out = ["--out", tmp_path / "c.toml", "--force"]
    code, _, err = run_cli(["calibrate", *logs, "--op", "all_gather", *out], capsys)
    assert code == 2 and "all_reduce_perf_1x8h200.txt: read as all-gather (--op), but its rows (redop sum, root -1, " \
        "busbw/algbw 1.750 over 8 ranks) fit all_reduce_perf" in err
    code, text, err = run_cli(["calibrate", f"{ag}:all_gather", *[p for p in logs if p != ag], *out], capsys)
    assert code == 0, err
    assert "all_gather_perf_1x8h200.txt: nvlink all-gather over 8 ranks" in text
    assert "all_reduce_perf_1x8h200.txt: nvlink all-reduce over 8 ranks" in text
    own = [f"{p}:{p.name.split('_perf')[0]}" for p in logs]  # each log its own test: --op reads none
    code, text, _ = run_cli(["calibrate", *own, "--op", "alltoall", *out], capsys)
    assert code == 0 and "--op all-to-all: read no log" in text


def test_if_tests_joined_by_or_and_and_are_evaluated():
    """Finding 3: the fp8 example's data test is ``[[ A == MOCK ]] || [[ B == MOCK ]] || [[ -z A ]]``:
    with A=real and B=MOCK (bash: false || true) the mock branch runs; with ``&&`` (false && true) the
    else branch does."""
    script = ('A=real\nB=MOCK\nif [[ "$A" == "MOCK" ]] {op} [[ "$B" == "MOCK" ]]; then\n  X=(--vocab-size 1)\n'
              'else\n  X=(--vocab-size 2)\nfi\ntorchrun pretrain_gpt.py ${{X[@]}}\n')
    assert parse_launch(script.format(op="||"))[0] == {"--vocab-size": "1"}
    assert parse_launch(script.format(op="&&"))[0] == {"--vocab-size": "2"}


def test_megatrons_gpt3_example_gives_torchrun_its_array():
    """Finding 1 on Megatron-LM's own examples/gpt3/train_gpt3_175b_distributed.sh (d98e8a6), whose
    ``torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${GPT_MODEL_ARGS[@]} ...`` the newcomer copied:
    --nproc_per_node $GPUS_PER_NODE (8) and --nnodes $NUM_NODES (1) are torchrun's; the model's 96 layers
    pretrain_gpt.py's."""
    args, launcher = parse_launch((NC34 / "train_gpt3_175b_distributed.sh").read_text(), SWITCHES)
    assert (launcher["--nproc_per_node"], launcher["--nnodes"]) == ("8", "1")
    assert not set(TORCHRUN) & set(args) and args["--num-layers"] == "96"
