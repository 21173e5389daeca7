"""Full recompute's first forward under Megatron-LM 2022 runs under ``torch.no_grad()``
(``CheckpointFunction``, NVIDIA/Megatron-LM 2755bcb ``megatron/mpu/random.py`` 310-321) with the
TorchScript bias-dropout-add called without ``enable_grad`` (``model/transformer.py`` 592-596), so
nvfuser fuses ``aten::dropout`` without autodiff and writes no bool mask (pytorch 004700b
``torch/csrc/jit/codegen/cuda/parser.cpp``: only ``native_dropout``'s rule outputs the mask).
Values derived by hand from the bytes and the catalog's A100 Triad (BabelStream, S3: 1.70 TB/s)."""

from dataclasses import replace

import pytest

from meshplan import catalog
from meshplan.compute.layer import layer_cost, layer_costs
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import framework_kernels
from meshplan.spec.training import TrainingSpec

A100 = catalog.gpu("a100-sxm-80gb")
GPT22B = catalog.model("megatron-22b")
W22 = Workload(seq_len=2048, micro_batch=4, tp=8, flash=False, dropout=True, megatron_ops=True, no_grad_bda=True,
               fused_qkv=True, fp32_wgrad_accumulation=True, framework="megatron")


def _bda(cost, phase, recompute=False):
    return [o for o in cost.ops if o.name.startswith("residual add + dropout") and o.phase == phase
            and o.recompute == recompute]


def test_first_forward_of_full_recompute_writes_no_bias_dropout_add_mask():
    """22B layer, tp 8, micro-batch 4, no SP (Korthikanti Table 4's "full" row): each of the two
    bias-dropout-adds covers rows x h = 4 x 2048 x 6144 = 50,331,648 elements. With autograd
    (no recompute, and full recompute's replay in backward): x, residual read and out written in
    fp16 plus the bool mask, 7 B an element = 352,321,536 B, / 1.70e12 B/s = 207.25 us. Under
    no_grad: 6 B = 301,989,888 B = 177.64 us, 29.61 us less each, 59.22 us less a layer forward."""
    both = layer_costs(GPT22B, A100, W22, ("none", "full"))
    none, full = both["none"], both["full"]
    n = 4 * 2048 * 6144
    assert [o.size_bytes for o in _bda(none, "forward")] == [7 * n, 7 * n]
    assert [o.size_bytes for o in _bda(full, "forward")] == [6 * n, 6 * n]
    assert [o.seconds for o in _bda(full, "forward")] == pytest.approx([6 * n / 1.70e12] * 2)
    assert none.forward_s - full.forward_s == pytest.approx(2 * n / 1.70e12)  # 59.2 us
    assert none.forward_s - full.forward_s == pytest.approx(59.22e-6, abs=0.01e-6)
    # the replay runs with grad: its mask is written, as in the plain forward
    assert [o.size_bytes for o in _bda(full, "backward_input", True)] == [7 * n, 7 * n]
    assert full.seconds("backward_input", recompute=True) == pytest.approx(none.forward_s)


def test_mask_follows_the_rank_rows_with_sequence_parallel():
    """With SP each rank's bias-dropout-add covers rows / tp = 1,024 rows: the mask saved is
    1,024 x 6,144 B = 6,291,456 B an op (forward 7 B -> 6 B an element, 44,040,192 -> 37,748,736 B)."""
    c = layer_cost(GPT22B, A100, replace(W22, sp=True, recompute="full"))
    assert [o.size_bytes for o in _bda(c, "forward")] == [6 * 1024 * 6144] * 2


def test_only_megatron_2022_without_deepspeed_pipe_and_with_dropout():
    """Megatron-DeepSpeed forks call the fused function under ``torch.enable_grad()`` (autodiff:
    mask written; bigscience-workshop/Megatron-DeepSpeed 06dc2d7 ``megatron/model/transformer.py``, "re-enable
    torch grad to enable fused optimization"), so a DeepSpeed engine (pipeline or ZeRO) keeps the mask; Core is not claimed; without
    dropout there is no mask to leave out; selective recompute runs its first forward with grad."""
    t = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", grad_dtype="fp32")
    assert framework_kernels(t)["no_grad_bda"] is True
    assert framework_kernels(t.model_copy(update={"megatron_runtime": "core"}))["no_grad_bda"] is False
    assert framework_kernels(t.model_copy(update={"pp_engine": "deepspeed"}))["no_grad_bda"] is False
    zero3 = TrainingSpec(global_batch=8, seq_len=16, framework="megatron", sharding="zero3", zero3_engine="deepspeed-2021")
    assert framework_kernels(zero3)["no_grad_bda"] is False  # SC'21's Megatron-DeepSpeed (2021)
    assert framework_kernels(TrainingSpec(global_batch=8, seq_len=16))["no_grad_bda"] is False
    n = 4 * 2048 * 6144
    no_dropout = layer_cost(GPT22B, A100, replace(W22, dropout=False, recompute="full"))
    assert [o.size_bytes for o in _bda(no_dropout, "forward")] == []
    assert [o.size_bytes for o in no_dropout.ops if o.name == "residual add" and o.phase == "forward"] == [6 * n] * 2
    sel = layer_cost(GPT22B, A100, replace(W22, recompute="selective"))
    assert [o.size_bytes for o in _bda(sel, "forward")] == [7 * n, 7 * n]
