"""Megatron-LM users' error and fix lines (megaenv findings 2-4): a world its parallel-size flags do
not divide, a ``--num-layers-per-virtual-pipeline-stage`` that does not divide a stage and the
memory fix's sharding are said in Megatron-LM's flags, with values that work."""

from __future__ import annotations

import pytest
from pathlib import Path

from tests.cli_run import run_main

#: Llama 3 70B's flags (80 layers, hidden 8192) at tp 8 on 4 dgx-h100, DDP (no sharding), no recompute.
LLAMA70B = """torchrun --nnodes 4 --nproc_per_node 8 pretrain_gpt.py \\
  --tensor-model-parallel-size 8 --pipeline-model-parallel-size 1 {extra} \\
  --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \\
  --group-query-attention --num-query-groups 8 --swiglu --seq-length 4096 --max-position-embeddings 8192 \\
  --micro-batch-size 1 --global-batch-size 128 --bf16 --sequence-parallel \\
  --untie-embeddings-and-output-weights --normalization RMSNorm --position-embedding-type rope --vocab-size 128256
"""


def _script(tmp_path: Path, extra: str = "", name: str = "job.sh") -> Path:
    f = tmp_path / name
    f.write_text(LLAMA70B.format(extra=extra))
    return f


def test_memory_fix_names_megatron_fsdp_flags_and_they_fit(tmp_path, capsys):
    """Finding 4: DDP's 159.7 GiB peak does not fit; the fix's sharding variant is the flags
    ``export --to megatron`` writes for zero3 (Megatron FSDP, optim_grads_params), not meshplan's
    ``sharding zero3``, and those flags added to the script plan to the peak the fix printed."""
    assert run_main("plan", _script(tmp_path), "--cluster", "dgx-h100") == 1
    fix = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fix: ")]
    flags = ("--use-megatron-fsdp --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params "
             "--overlap-grad-reduce --overlap-param-gather --ckpt-format fsdp_dtensor")
    assert len(fix) == 1 and fix[0].startswith(f"fix: {flags} -> peak 50.0 GiB (fits; step ")
    assert "sharding zero3" not in fix[0]
    assert run_main("plan", _script(tmp_path, flags, "fsdp.sh"), "--cluster", "dgx-h100") == 0
    assert "this mesh (tp 8 x pp 1): timeline peak 50.04 GiB, fits" in capsys.readouterr().out


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LLAMA8B = EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args"  # 32 layers at pp 2: 16 per stage


def _chunked(tmp_path: Path, per_chunk: int) -> Path:
    f = tmp_path / f"chunk{per_chunk}.args"
    f.write_text(LLAMA8B.read_text() + f"--num-layers-per-virtual-pipeline-stage {per_chunk}\n")
    return f


def test_virtual_stage_layers_that_do_not_divide_a_stage_get_the_values_that_do(tmp_path, capsys):
    """Finding 3: 5 layers per virtual stage do not divide Llama 3 8B's 32 / pp 2 = 16 layers per
    stage (Megatron-LM asserts they do); the fix lists 16's divisors below 16, and each of them
    imports as 16 / value virtual stages per rank."""
    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    assert run_main("plan", _chunked(tmp_path, 5), "--cluster", "dgx-h100", "--nodes", "2") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --num-layers-per-virtual-pipeline-stage: 5 does not divide the 32 layers / pp 2 = 16 per stage "
        "(Megatron-LM asserts it does); fix: --num-layers-per-virtual-pipeline-stage 1, 2, 4 or 8 (16, 8, 4 or 2 "
        "virtual stages per rank), or drop it for no interleaving (16, the whole stage)")
    for per_chunk, vpp in ((1, 16), (2, 8), (4, 4), (8, 2)):
        cfg = load_any(_chunked(tmp_path, per_chunk), opts=ImportOptions(cluster="dgx-h100", nodes=2))
        assert (cfg.mesh.virtual_stages, cfg.mesh.pp_schedule) == (vpp, "interleaved_1f1b")


def _read(text: str, nodes: int | None = None):
    from meshplan.interop import megatron
    from meshplan.interop.common import ImportOptions
    return megatron.read(text, ImportOptions(cluster="dgx-h100", nodes=nodes))


def test_world_error_names_the_flag_that_fails_and_values_that_divide(tmp_path, capsys):
    """Finding 2: Llama 3 70B at tp 8 x pp 7 = 56 on 192 dgx-h100 (1,536 GPUs; 1536 / 56 is not
    whole). tp alone cannot fix it (7 does not divide 1536), pp can: the divisors of 1536 / 8 = 192
    nearest 7 that divide the 80 layers are 4 and 8; the node counts nearest 192 whose GPUs are a
    multiple of 56 are multiples of 56 / gcd(56, 8) = 7: 189 and 196. Each value imports."""
    f = _script(tmp_path, "--pipeline-model-parallel-size 7")  # the later flag wins, as in Megatron-LM
    assert run_main("plan", f, "--cluster", "dgx-h100", "--nodes", "192") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --pipeline-model-parallel-size: --tensor-model-parallel-size 8 x --pipeline-model-parallel-size 7 = "
        "56 does not divide the world, --nodes 192 x 8 GPUs = 1536; Megatron-LM runs dp = world / (tp x cp x pp); "
        "fix: --pipeline-model-parallel-size 4 or 8 (each divides 1536 / 8 = 192 and the 80 layers), or --nodes 189 "
        "or 196 (multiples of 56 GPUs)")
    text = f.read_text()
    for pp in (4, 8):
        mesh = _read(text.replace("--pipeline-model-parallel-size 7", f"--pipeline-model-parallel-size {pp}"),
                     192).tables["mesh"]
        assert dict(zip(mesh["names"], mesh["shape"])) == {"pp": pp, "dp": 1536 // (8 * pp), "tp": 8}
    for nodes in (189, 196):
        assert _read(text, nodes).tables["mesh"]["shape"] == [7, nodes * 8 // 56, 8]


def test_world_error_of_a_launch_scripts_node_count_gives_node_counts(tmp_path):
    """Finding 2 with NNODES=100 in the script: tp 8 x pp 16 = 128 does not divide 800 GPUs; pp,
    the largest degree, at the divisors of 800 / 8 = 100 nearest 16 that divide 80 layers: 10 and 20;
    nodes: multiples of 128 / 8 = 16 nearest 100: 96 and 112. tp 3 alone: tp 2 or 4 (dividing the
    node's 8 GPUs), nodes multiples of 3."""
    from meshplan.errors import ConfigError
    text = "NNODES=100\n" + LLAMA70B.format(extra="--pipeline-model-parallel-size 16").replace(
        "--nnodes 4", "--nnodes $NNODES")
    with pytest.raises(ConfigError) as e:
        _read(text)
    assert e.value.field == "--pipeline-model-parallel-size"
    assert e.value.message.endswith("fix: --pipeline-model-parallel-size 10 or 20 (each divides 800 / 8 = 100 and "
                                    "the 80 layers), or --nodes 96 or 112 (multiples of 128 GPUs)")
    with pytest.raises(ConfigError) as e:
        _read(text.replace("--tensor-model-parallel-size 8", "--tensor-model-parallel-size 3")
              .replace("--pipeline-model-parallel-size 16", ""))
    assert str(e.value) == ("--tensor-model-parallel-size: --tensor-model-parallel-size 3 does not divide the world, "
                            "--nodes 100 x 8 GPUs = 800; Megatron-LM runs dp = world / (tp x cp x pp); fix: "
                            "--tensor-model-parallel-size 2 or 4 (each divides 800), or --nodes 99 or 102 "
                            "(multiples of 3 GPUs)")
