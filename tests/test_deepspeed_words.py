"""A DeepSpeed user's plan in DeepSpeed's terms (newcomer findings, issue 11): the memory kinds
(ZeRO-3 parameter all-gather, partitioned parameters, ZeRO-1/2 gradient partitions and buckets,
never FSDP) and "no pipeline" where pp = 1 in every output that names the schedule
(meshplan.spec.wording)."""

from __future__ import annotations

import html
import json
import re

import pytest

from meshplan.cli import main
from meshplan.interop.common import ImportOptions
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
                 "gathered_params 0.98 3% 2.36 ZeRO-3 parameter all-gather: the layers' full parameters (current + "
                 "prefetched)",
                 "grad_buffers 0.00 0% 1.96 a layer's full gradients, the ZeRO-3 reduce-scatter's input",
                 "prefetch 1 unit(s), ZeRO-3 gradient reduce-scatter per_microbatch,",
                 "llama3-8b, dp 16, no pipeline, micro-batch 1 x seq 4096",
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
    assert "gathered_params 0.98 2.36 ZeRO-3 parameter all-gather: the layers' full parameters" in text
    assert "sharding zero3 (DeepSpeed ZeRO stage 3: partitions the optimizer states, gradients and parameters" in text


def test_a_pipeline_keeps_its_schedule(capsys):
    step = _out(["step", EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args", "--cluster", "dgx-h100", "--nodes",
                 "2"], capsys)
    assert re.search(r"^step \d+\.\d\d ms \(1f1b, p 2, m 32, v 1\);", step)
