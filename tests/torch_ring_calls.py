"""Run torch 2.13's own context-parallel ring attention (``_templated_ring_attention`` and its
backward) on one rank (rank 1) of a fake process group of cp 4, CPU flash SDPA, bf16 q of shape
(1, 4, 8, 16) and k, v of (1, kv_heads, 8, 16) (2: grouped heads as SDPA's ``enable_gqa`` passes them,
which torch 2.13's CPU flash kernel reads as they are; 4: repeated to the q heads), and record the functional collectives it issues (all-gathers and
all_to_all_single) with their input bytes: what tests/test_cp_ring.py and tests/test_cp_alltoall.py
compare with the collective table's cp rows. Needs torch (callers importorskip it first)."""

from __future__ import annotations

from typing import Optional


def ring_calls(rotate: Optional[str] = None, kv_heads: int = 4) -> tuple[list, list]:
    """(forward calls, backward calls), each a list of (op name, input bytes); ``rotate``: torch's
    ``set_rotate_method`` for the run ("allgather", "alltoall"; None keeps torch's), restored after;
    ``kv_heads``: K's and V's heads (of 4 q heads)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] in (
                    "all_gather_into_tensor", "all_to_all_single"):
                self.calls.append((func.__name__.split(".")[0], args[0].numel() * args[0].element_size()))
            return func(*args, **(kwargs or {}))

    cp, (b, h, n, d) = 4, (1, 4, 8, 16)
    before = ring._cp_options.rotate_method
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=cp)
    try:
        if rotate is not None:
            ring.set_rotate_method(rotate)
        q = torch.randn(b, h, n, d, dtype=torch.bfloat16)
        k, v = (torch.randn(b, kv_heads, n, d, dtype=torch.bfloat16) for _ in range(2))
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        def bwd(query, key, value, out, logsumexp, is_causal, grad_out):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, logsumexp, 0.0, bool(is_causal))

        with Calls() as f:
            out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, fwd, q, k, v, is_causal=True)
        with Calls() as g:
            ring._templated_ring_attention_backward(dist.group.WORLD, 2, bwd, torch.randn_like(q), "grad_out", q, k, v,
                                                    out, lse, True)
    finally:
        ring._cp_options.rotate_method = before
        dist.destroy_process_group()
    return f.calls, g.calls
