"""The loss's logits-sized tensors in the memory timeline against torch's own allocations.

torchtitan 9dec370 (the commit of its Dec 2024 H100 tables) runs the loss eagerly,
``train.py`` lines 131-134 and 303-308::

    loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1)); del pred; loss.backward()

Each test runs that loss with torch 2.13 on CPU under ``torch.profiler`` (``profile_memory``:
every allocation and free of the CPU allocator, in order) on the tiny plan's own shapes (8
tokens, vocabulary 128 or its tp-2 shard 64), keeps the logits-sized events (a bf16 logits
tensor is 2 KiB there, an fp32 one 4 KiB; the labels, the scalar loss and the per-token
statistics are at most 64 B) and compares four running totals, in fp32 logits ``lf``, with
the plan's events from the output GEMM's logits to the loss's last free: the forward's peak,
what the forward leaves for backward, the backward's peak, and what is left after it (the
bf16 gradient of the logits, which the output layer's backward then reads).
"""

from __future__ import annotations

import json

import pytest

from meshplan.memory.workingset import head_sizes
from tests.test_memory_timeline import MEM, plan_of

torch = pytest.importorskip("torch")
F = torch.nn.functional

TOK, V = 8, 128  # the tiny plan's tokens per micro-batch and vocabulary (tests/test_memory_timeline.py)
LF = 4 * TOK * V  # one fp32 logits tensor at tp 1, 4,096 B
BIG = 1024  # logits-sized events are >= 1 KiB here; everything else (labels, scalars) is <= 64 B
AFTER = "head backward: logits gradient freed"  # the output layer's backward read it: not the loss's


def _torch_totals(run, tmp_path) -> list[int]:
    """Running totals (bytes) of the logits-sized allocations and frees of ``run()``, in order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    ev = sorted((e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == "[memory]"),
                key=lambda e: e["ts"])
    out, total = [], 0
    for e in ev:
        if abs(e["args"]["Bytes"]) >= BIG:
            total += e["args"]["Bytes"]
            out.append(total)
    return out


def _eager_loss(local_vocab: int, parallel: bool):
    """torchtitan 9dec370's loss on bf16 logits of the tiny plan's shape; under ``loss_parallel``
    with the logits a DTensor sharded on the vocabulary (one rank: the local decomposition each
    of tp ranks runs, torch/distributed/tensor/parallel/loss.py)."""
    z = torch.randn(1, TOK, local_vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, local_vocab, (1, TOK))

    def run():
        pred = z * 1.0  # stands for the output layer's GEMM output (bf16)
        if parallel:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import DTensor, Shard
            from torch.distributed.tensor.parallel import loss_parallel
            pred = DTensor.from_local(pred, init_device_mesh("cpu", (1,)), [Shard(2)])
            with loss_parallel():
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
                del pred
                loss.backward()
        else:
            loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
            del pred
            loss.backward()
    return run


def _plan_totals(p) -> list[int]:
    """Running totals of the plan's loss events (micro-batch 0, from the head's logits to the
    logits gradient the output layer's backward reads), the saved event counted for its loss
    terms only, less the per-token loss term (13 B a token): the final norm's and the output
    layer's saved inputs are not the loss's, and torch's per-token tensors are under ``BIG``."""
    cfg = p.config
    hs = head_sizes(cfg.model, cfg.training, p.mesh, cfg.memory)
    out, total = [], 0
    for e in p.timeline.events():
        if e.microbatch != 0 or e.layer is not None or e.label.startswith(AFTER):
            continue
        d = e.delta_bytes
        if e.label.startswith("head: final norm and output inputs"):
            d = hs["head_loss_saved"] - 13 * TOK
        elif e.label.startswith("loss backward: kept logits"):
            d = -(hs["head_loss_saved"] - 13 * TOK)
        elif not e.label.startswith(("head: logits", "loss ", "head backward: logits")):
            continue
        if d:
            total += d
            out.append(total)
    return out


def _summary(totals: list[int], forward_end: int, lf: int) -> tuple[float, ...]:
    """(forward peak, left by the forward, backward peak, left after) in ``lf``; the forward's
    totals are ``totals[:forward_end]``."""
    fwd, bwd = totals[:forward_end], totals[forward_end:]
    return max(fwd) / lf, fwd[-1] / lf, max(bwd) / lf, bwd[-1] / lf


def _halves(totals: list[int], lf: int) -> list[float]:
    return [t / lf for t in totals]


#: what torch 2.13 allocated, running totals in lf (logits-sized events only), by hand:
#: tp 1: bf16 logits (0.5), .float() (1.5), log_softmax (2.5), the copy freed as the loss returns
#: (1.5), ``del pred`` (1); nll_loss_backward (2), _log_softmax_backward_data (3), the nll gradient
#: and the kept output freed (2, 1), the upcast's bf16 gradient (1.5), the fp32 one freed (0.5);
#: then ``z * 1.0``'s backward (its gradient for z, 1; the incoming one freed, 0.5), not the loss's.
EAGER_TP1 = [0.5, 1.5, 2.5, 1.5, 1.0, 2.0, 3.0, 2.0, 1.0, 1.5, 0.5, 1.0, 0.5]
#: tp 2 (one rank's shard): bf16 logits, .float(), x - max, exp (3.5), exp freed after its sum
#: (2.5), the output (3.5), x - max freed (2.5), the copy (1.5), ``del pred`` (1); backward
#: zeros_like (2), exp (3), their sum (4), zeros freed (3), the product (4), exp and the sum freed
#: (3, 2), the kept output freed (1), the bf16 gradient (1.5), the fp32 one freed (0.5); then z's.
EAGER_TP2 = [0.5, 1.5, 2.5, 3.5, 2.5, 3.5, 2.5, 1.5, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0, 3.0, 2.0, 1.0, 1.5, 0.5,
             1.0, 0.5]
EAGER = {**MEM, "cross_entropy": "torch"}  # torch's eager loss, as a torchtitan job TOML states it


def test_eager_loss_tp1_against_torch(tmp_path):
    """tp 1, lf = 8 x 128 x 4 B: torch allocates :data:`EAGER_TP1`: forward peak 2.5 lf (the
    GEMM's bf16 logits 0.5, the ``.float()`` copy 1 and log_softmax's output 1, kept), 1 lf left
    for backward; backward peak 3 lf (nll and log-softmax gradients beside the kept output), the
    bf16 logits gradient 0.5 lf left. The plan (``memory.cross_entropy = "torch"``, what a
    torchtitan job TOML without a compiled loss states) gives the same four; before the ``.float()`` copy was planned
    its forward peak was 1.5 lf."""
    torch.manual_seed(0)
    measured = _torch_totals(_eager_loss(V, False), tmp_path)
    assert _halves(measured, LF) == EAGER_TP1
    want = _summary(measured[:11], 5, LF)
    assert want == (2.5, 1.0, 3.0, 0.5)
    planned = _plan_totals(plan_of(memory=EAGER))
    assert _summary(planned, planned.index(LF) + 1, LF) == want


def test_loss_parallel_tp2_against_torch(tmp_path):
    """tp 2 under ``loss_parallel`` (torchtitan's default with tp > 1), a rank's vocabulary shard
    64, lf = 8 x 64 x 4 B: torch allocates :data:`EAGER_TP2` on one rank of a DTensor mesh (the
    max and sum all-reduces are per token, under ``BIG``): forward peak 3.5 lf, 1 left, backward
    peak 4 lf (``(zeros_like(x) + exp(x)) * grad_output`` beside the kept output), 0.5 left. The
    plan at tp 2 the same; before the copy was planned its forward peak was 2.5 lf."""
    import torch.distributed as dist
    torch.manual_seed(0)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        measured = _torch_totals(_eager_loss(V // 2, True), tmp_path)
    finally:
        dist.destroy_process_group()
    lf = LF // 2
    assert _halves(measured, lf) == EAGER_TP2
    want = _summary(measured[:19], 9, lf)
    assert want == (3.5, 1.0, 4.0, 0.5)
    planned = _plan_totals(plan_of(mesh=dict(names=["dp_shard", "tp"], shape=[2, 2], world=4), memory=EAGER))
    assert _summary(planned, planned.index(lf) + 1, lf) == want


@pytest.mark.slow
def test_compiled_loss_against_inductor(tmp_path):
    """The same loss under torch.compile (CPU inductor: 10-60 s to compile on this machine, hence slow):
    AOTAutograd's partition saves the bf16 logits themselves and two fp32 values a token, and
    the backward graph writes the bf16 gradient alone: forward 0.5 lf (the GEMM's output, no
    new logits-sized tensor), 0.5 left, backward 0.5 + 0.5 = 1 lf, 0.5 left. The plan under
    ``torch_compile`` with ``memory.cross_entropy = "compiled"`` (a torchtitan job TOML that
    compiles the loss) keeps bf16 logits and writes one bf16 gradient: the same four. (Megatron's terms, which
    it took before, keep fp32 logits beside the bf16 ones: 1.5 lf forward.)"""
    torch.manual_seed(0)
    z = torch.randn(1, TOK, V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (1, TOK))
    loss_fn = torch.compile(lambda pred, y: F.cross_entropy(pred.flatten(0, 1).float(), y.flatten(0, 1)))

    def run():
        pred = z * 1.0
        loss = loss_fn(pred, labels)
        del pred
        loss.backward()
    run()  # compiles
    z.grad = None
    measured = _torch_totals(run, tmp_path)
    # pred (0.5), the backward graph's bf16 gradient (1), the saved pred freed (0.5); then z's
    assert _halves(measured, LF) == [0.5, 1.0, 0.5, 1.0, 0.5]
    want = _summary(measured[:3], 1, LF)
    assert want == (0.5, 0.5, 1.0, 0.5)
    planned = _plan_totals(plan_of(torch_compile=True, memory={**MEM, "cross_entropy": "compiled"}))
    assert _summary(planned, planned.index(LF // 2) + 1, LF) == want


def test_stated_megatron_loss_unchanged():
    """``memory.cross_entropy = "megatron"`` (the default; the tests' MEM states it): Megatron's in-place
    vocab-parallel loss keeps the fp32 logits beside the bf16 ones (1.5 lf), writes one bf16
    gradient beside them in backward (1.5 lf): the terms a torchtitan import took before."""
    assert MEM["cross_entropy"] == "megatron"
    planned = _plan_totals(plan_of())
    assert _summary(planned, planned.index(LF) + 1, LF) == (1.5, 1.0, 1.5, 0.5)


def test_eager_loss_is_fp32_whatever_logits_dtype_says(tmp_path):
    """torch's eager loss runs on ``pred.float()``: ``log_softmax(self, class_dim, self.scalar_type())``
    (aten ``cross_entropy_loss_symint``) keeps an fp32 output, and ``nll_loss_backward`` and
    ``_log_softmax_backward_data(grad, result, dim, self.scalar_type())`` (derivatives.yaml) write fp32
    gradients: torch allocates :data:`EAGER_TP1` (tp 1) whatever ``memory.logits_dtype`` says, as it knows
    nothing of it. The plan with ``logits_dtype = "bf16"`` (a Megatron-only option) must give the same four
    in lf = 8 x 128 x 4 B: (2.5, 1.0, 3.0, 0.5). Before it gave (2.0, 0.5, 1.5, 0.5), the log-softmax
    and both gradients sized at 2 B (0.5 lf each): forward 0.5 bf16 logits + 1 copy + 0.5, 0.5 kept;
    backward 0.5 kept + 0.5 + 0.5. tp 2 (loss_parallel, lf = 8 x 64 x 4 B): :data:`EAGER_TP2`'s
    (3.5, 1.0, 4.0, 0.5) as measured by :func:`test_loss_parallel_tp2_against_torch` (x - max, exp,
    zeros_like and the product are fp32 too; before (2.5, 0.5, 2.0, 0.5))."""
    torch.manual_seed(0)
    measured = _torch_totals(_eager_loss(V, False), tmp_path)
    want = _summary(measured[:11], 5, LF)
    assert want == (2.5, 1.0, 3.0, 0.5)
    bf16 = {**EAGER, "logits_dtype": "bf16"}
    planned = _plan_totals(plan_of(memory=bf16))
    assert _summary(planned, planned.index(LF) + 1, LF) == want
    lf = LF // 2
    want2 = _summary([round(x * lf) for x in EAGER_TP2[:19]], 9, lf)
    assert want2 == (3.5, 1.0, 4.0, 0.5)
    planned = _plan_totals(plan_of(mesh=dict(names=["dp_shard", "tp"], shape=[2, 2], world=4), memory=bf16))
    assert _summary(planned, planned.index(lf) + 1, lf) == want2
