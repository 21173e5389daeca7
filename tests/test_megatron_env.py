"""CUDA_DEVICE_MAX_CONNECTIONS for Megatron-LM (megaenv finding 1): Megatron-LM's validate_args
(arguments.py at d98e8a6, lines 1453-1479) asserts it is "1" with tp or cp > 1 on GPUs before
Blackwell unless Torch FSDP2 or Megatron FSDP runs, where (lines 1048, 1166) it asserts it is not
"1". The import reads it from a launch script and lists its other exports, the export writes it in
its header and carries the others, and launch's torchrun.sh sets it for a Megatron-LM plan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.interop.megatron_env import max_connections
from tests.cli_run import run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ARGS = EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args"  # Llama 3 8B, tp 2 x pp 2, zero1, on 2 dgx-h100
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor\n"
ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def _script(tmp_path: Path, exports: str, extra: str = "", name: str = "job.sh") -> Path:
    """The example's flags as a torchrun launch script on 2 nodes after ``exports`` lines."""
    flags = " ".join(line for line in (ARGS.read_text() + extra).splitlines() if not line.startswith("#"))
    f = tmp_path / name
    f.write_text(f"#!/bin/bash\n{exports}torchrun --nnodes 2 --nproc_per_node 8 pretrain_gpt.py {flags}\n")
    return f


def _read(path: Path, cluster: str = "dgx-h100"):
    from meshplan.interop import megatron
    from meshplan.interop.common import ImportOptions
    return megatron.read(path.read_text(), ImportOptions(cluster=cluster))


@pytest.mark.parametrize("gpu, tp, cp, fsdp, need", [
    ("h100-sxm5-80gb", 2, 1, False, "1"), ("a100-sxm-80gb", 1, 2, False, "1"), ("h200-sxm-141gb", 1, 1, False, None),
    ("b200-sxm-180gb", 8, 2, False, None), ("b200-gb200-186gb", 2, 1, False, None),
    ("h100-sxm5-80gb", 8, 1, True, "unset"), ("b200-sxm-180gb", 1, 1, True, "unset"),
    ("mi300x-oam-192gb", 8, 1, False, "1"), ("some-new-gpu", 2, 1, False, "1")])
def test_the_rule_is_megatron_lms(gpu, tp, cp, fsdp, need):
    """validate_args: "1" where tp or cp > 1 before compute capability 10 without FSDP; not "1"
    (unset) under FSDP whatever tp, cp and the GPU; nothing required otherwise. A GPU meshplan's
    table lacks is taken as before Blackwell (1 is what Megatron-LM asserts there and allowed after)."""
    value, why = max_connections(gpu, tp, cp, fsdp)
    assert value == need
    assert ("not in meshplan's table" in why) == (gpu == "some-new-gpu")


def test_import_reads_the_variable_and_lists_the_other_exports(tmp_path):
    imp = _read(_script(tmp_path, f"export {ENV}=1\nexport NCCL_IB_TIMEOUT=19 NCCL_DEBUG=WARN\n"))
    assert imp.unused == ("--lr", "--train-iters", "--tokenizer-type", "export NCCL_IB_TIMEOUT", "export NCCL_DEBUG")
    assert f"export {ENV}=1 in the script: read (Megatron-LM asserts it is 1 with tp 2 on GPUs before Blackwell " \
           f"(h100-sxm5-80gb: compute capability 9)); export --to megatron and meshplan launch write it by that " \
           f"rule" in imp.notes
    # a script that does not export it, or exports another value, is told what Megatron-LM asserts
    missing = _read(_script(tmp_path, "", name="none.sh")).notes
    assert any(n.startswith(f"{ENV} not exported by the script: Megatron-LM asserts it is 1 with tp 2")
               for n in missing)
    wrong = _read(_script(tmp_path, f"export {ENV}=32\n", name="32.sh")).notes
    assert any(n.startswith(f"export {ENV}=32 in the script: Megatron-LM asserts it is 1") and "set it to 1" in n
               for n in wrong)
    fsdp = _read(_script(tmp_path, f"export {ENV}=1\n", FSDP, name="fsdp.sh")).notes
    assert any(n.startswith(f"export {ENV}=1 in the script: Megatron-LM asserts it is not 1 under --use-megatron-fsdp")
               for n in fsdp)
    # on Blackwell nothing is asserted: no note for a script without it
    assert not any(ENV in n for n in _read(_script(tmp_path, "", name="b.sh"), "dgx-b200").notes)


def _export(tmp_path: Path, src: Path, *opts) -> list[str]:
    out = tmp_path / (src.stem + ".args")
    assert run_main("export", src, "--cluster", *opts, "--to", "megatron", "-o", out, "--force") == 0
    return [line for line in out.read_text().splitlines() if line.startswith("# environment")]


def test_export_writes_it_where_the_launch_environment_goes(tmp_path):
    src = _script(tmp_path, f"export {ENV}=1\nexport NCCL_IB_TIMEOUT=19\n")
    assert _export(tmp_path, src, "dgx-h100") == [
        f"# environment: export {ENV}=1 before launching: Megatron-LM asserts it is 1 with tp 2 on GPUs before "
        f"Blackwell (h100-sxm5-80gb: compute capability 9) (arguments.py validate_args at Megatron-LM d98e8a6); "
        f"meshplan launch's torchrun.sh sets it",
        f"# environment carried unchanged from {src}: export NCCL_IB_TIMEOUT=19"]
    # Blackwell asserts nothing: only the carried export; Megatron FSDP: the unset line, not the export
    assert _export(tmp_path, src, "dgx-b200") == [
        f"# environment carried unchanged from {src}: export NCCL_IB_TIMEOUT=19"]
    fsdp = _export(tmp_path, _script(tmp_path, "", FSDP, name="fsdp.sh"), "dgx-h100")
    assert len(fsdp) == 1 and fsdp[0].startswith(f"# environment: unset {ENV} (or set it above 1)")


def _launched(tmp_path: Path, config: Path, *opts) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS as the ranks of ``meshplan launch CONFIG`` get it: torchrun.sh run
    with a fake torchrun that prints it, started from an environment that has it at 32."""
    out = tmp_path / ("launch-" + config.stem)
    assert run_main("launch", config, *opts, "--out", out, "--force", "--", "python", "pretrain_gpt.py") == 0
    fake = tmp_path / "faketorchrun"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c \"import os; print(os.environ.get('{ENV}', 'unset'))\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "TORCHRUN": str(fake), "MESHPLAN_RDZV_ENDPOINT": "h:1", "NODE_RANK": "0", ENV: "32"}
    return subprocess.run(["sh", str(out / "torchrun.sh")], capture_output=True, text=True, env=env,
                          timeout=30).stdout.strip()


def test_launch_sets_it_for_a_megatron_plan(tmp_path):
    toml = tmp_path / "job.toml"
    assert run_main("import", "auto", _script(tmp_path, ""), "--cluster", "dgx-h100", "-o", toml) == 0
    assert _launched(tmp_path, toml) == "1"
    fsdp = tmp_path / "fsdp.toml"
    assert run_main("import", "auto", _script(tmp_path, "", FSDP, name="f.sh"), "--cluster", "dgx-h100", "-o",
                    fsdp) == 0
    assert _launched(tmp_path, fsdp) == "unset"
    # a torch plan (torchtitan) at tp 2: Megatron-LM's rule does not apply, the environment is left as it is
    assert _launched(tmp_path, EXAMPLES / "mini_2x4_tp2-dp4.toml") == "32"


def test_search_export_writes_it_too(tmp_path):
    """search --export --to megatron goes through the same export: a row at tp 2 on H100 (the
    example imported, [search] held at tp 2, pp 1, zero1) gets the export line in its header."""
    toml = tmp_path / "s.toml"
    assert run_main("import", "auto", ARGS, "--cluster", "dgx-h100", "--nodes", "2", "-o", toml) == 0
    toml.write_text(toml.read_text() + '\n[search]\ntp = [2]\npp = [1]\nsharding = ["zero1"]\ntop = 1\n')
    out = tmp_path / "row1.args"
    assert run_main("search", toml, "--export", "1", "--to", "megatron", "-o", out) == 0
    lines = out.read_text().splitlines()
    assert "--tensor-model-parallel-size 2" in lines and "--use-megatron-fsdp" not in lines
    assert [line for line in lines if line.startswith("# environment")] == [
        f"# environment: export {ENV}=1 before launching: Megatron-LM asserts it is 1 with tp 2 on GPUs before "
        f"Blackwell (h100-sxm5-80gb: compute capability 9) (arguments.py validate_args at Megatron-LM d98e8a6); "
        f"meshplan launch's torchrun.sh sets it"]
