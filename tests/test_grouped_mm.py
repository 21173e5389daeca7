"""The runtime's dropless expert GEMM (runtime.execution.moe._GroupedMM): the per-expert products
of the loop it replaced, its gradients by finite differences, the experts' gradient times the
EP scale, and one (E, n, k) weight gradient, not SelectBackward's zero one per expert
(validate's MoE temporaries, tests/test_validate_memory_kinds.py)."""

import pytest

torch = pytest.importorskip("torch")

from meshplan.runtime.execution.moe import _GroupedMM  # noqa: E402

COUNTS = (4, 0, 6)  # expert 1 gets no rows: its weight gradient is 0


def test_grouped_mm_equals_the_per_expert_loop_and_scales_the_weight_gradient():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = _GroupedMM.apply(x, w, COUNTS, 0.5)
    dy = torch.randn(10, 4, generator=g, dtype=torch.float64)
    y.backward(dy)
    x2, w2 = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([x2[:4] @ w2[0].t(), x2[4:] @ w2[2].t()])
    ref.backward(dy)
    assert torch.equal(y, ref)
    assert torch.allclose(w.grad, 0.5 * w2.grad) and w.grad[1].abs().sum() == 0
    assert torch.autograd.gradcheck(lambda a, b: _GroupedMM.apply(a, b, COUNTS, 1.0), (x.detach().requires_grad_(),
                                                                                  w.detach().requires_grad_()))


def test_grouped_mm_backward_allocates_one_weight_gradient():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):  # the storages of (E, n, k)-sized outputs in backward
        full: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == (3, 4, 8):
                Sizes.full.add(out.untyped_storage().data_ptr())
            return out

    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 4, 8, requires_grad=True)
    y = _GroupedMM.apply(x, w, COUNTS, 0.5)
    with Sizes():
        y.backward(torch.ones(10, 4))
    # zeros_like(w), then scaled and kept as w.grad in place; the per-expert w[i] loop allocated
    # 5 here (SelectBackward's zeros per expert, 3, and autograd's 2 sums)
    assert len(Sizes.full) == 1
