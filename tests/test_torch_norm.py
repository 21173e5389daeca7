"""torchtitan's pre-2025 RMSNorm run eagerly (``training.torch_norm = "decomposed"``,
``model.norm_type = "rmsnorm"`` at torchtitan 9dec370; :func:`meshplan.compute.torch_eager.rmsnorm_bytes`).

By hand, Llama 3 8B at micro-batch 2 x 8192 tokens on one GPU (no tp): each norm runs over
16,384 rows of 4,096 bf16 values, 67,108,864 elements. Forward: upcast (2 + 4 B), pow (4 + 4),
mean (4), x * rstd (4 + 4), downcast (4 + 2), * weight (2 + 2): 36 B an element, plus the
per-row + eps and rsqrt (8 B a row each): 2,416,181,248 B in 8 kernels. Backward: * weight's
input gradient (2 + 2) and weight gradient (4 + 2, then the sum over rows 2), the downcast's
gradient (2 + 4), x * rstd's two products (4 + 4, 8 + 4) and the sum over h (4), mean's
gradient (4), pow's x^1 copy (4 + 4), 2 x (4 + 4) and product (8 + 4), the two gradients of the
upcast accumulated (8 + 4) and cast back (4 + 2): 92 B an element, plus rsqrt's gradient (8 +
8 + 12 B a row): 6,174,474,240 B in 16 kernels. The fused kernel: 268,435,456 B forward
(read and write 2 B) and 402,653,184 B backward (3 passes).
"""

from __future__ import annotations

import pytest

from meshplan import catalog
from meshplan.compute.embed_head import head_cost
from meshplan.compute.layer import layer_cost
from meshplan.compute.ops import Workload
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.schedule.workload import workload_of
from meshplan.plan import build_plan

from tests.test_float8_linears import TT

M, H100 = catalog.model("llama3-8b"), catalog.gpu("h100-sxm5-80gb")
N, ROWS = 16384 * 4096, 16384


def norm_bytes(cost, prefix: str, phase: str, recompute: bool = False) -> tuple[float, int]:
    ops = [o for o in cost.ops if o.name.startswith(prefix) and o.phase == phase and o.recompute == recompute]
    return sum(o.size_bytes for o in ops), len(ops)


def test_decomposed_norm_kernels_by_hand():
    w = Workload(seq_len=8192, micro_batch=2, recompute="op", torch_eager=True, decomposed_norm=True)
    c = layer_cost(M, H100, w)
    for norm in ("attn norm", "mlp norm"):
        assert norm_bytes(c, norm, "forward") == (2_416_181_248, 8)
        assert norm_bytes(c, norm, "backward_input") == (6_174_474_240, 16)
        # op-level AC replays the norm's forward kernels before the backward (nothing of it is saved)
        assert norm_bytes(c, norm, "backward_input", recompute=True) == (2_416_181_248, 8)
    assert norm_bytes(head_cost(M, H100, w), "final norm", "forward") == (2_416_181_248, 8)
    fused = layer_cost(M, H100, Workload(seq_len=8192, micro_batch=2, recompute="op", torch_eager=True))
    assert norm_bytes(fused, "attn norm", "forward") == (268_435_456, 1)
    assert norm_bytes(fused, "attn norm", "backward_input") == (402_653_184, 1)
    # each kernel at least the issue floor: the per-row ones cost a floor each, not 0
    rsqrt = next(o for o in c.ops if o.name == "attn norm rsqrt")
    assert rsqrt.size_bytes == 8 * ROWS and rsqrt.seconds > 0


def titan(tmp_path, norm_type: str | None, compile_: bool = False):
    text = TT.read_text()
    if norm_type:
        text = text.replace('flavor = "8B"\n', f'flavor = "8B"\nnorm_type = "{norm_type}"\n')
    if compile_:
        text += '\n[compile]\nenable = true\n'
    f = tmp_path / "t.toml"
    f.write_text(text)
    return load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))


def test_torchtitan_norm_type_is_read(tmp_path):
    assert titan(tmp_path, "rmsnorm").training.torch_norm == "decomposed"
    assert titan(tmp_path, "fused_rmsnorm").training.torch_norm == "fused"
    assert titan(tmp_path, None).training.torch_norm == "fused"  # today's torchtitan: nn.RMSNorm
    with pytest.raises(ConfigError, match=r"^model.norm_type: 'rms'; torchtitan's choices were layernorm, "
                                          r"np_layernorm, rmsnorm, fused_rmsnorm$"):
        titan(tmp_path, "rms")


def test_compiled_or_eager(tmp_path):
    """Eager: the decomposed kernels; compiled: inductor fuses the chain (the fused kernel)."""
    eager = workload_of(build_plan(titan(tmp_path, "rmsnorm")))
    compiled = workload_of(build_plan(titan(tmp_path, "rmsnorm", compile_=True)))
    assert (eager.decomposed_norm, compiled.decomposed_norm) == (True, False)


def test_megatron_has_no_torch_norm():
    with pytest.raises(ConfigError, match=r"torch_norm is the RMSNorm module of framework \"torch\""):
        config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
                          "training": {"global_batch": 8, "seq_len": 2048, "framework": "megatron",
                                       "torch_norm": "decomposed"},
                          "mesh": {"names": ["dp"], "shape": [8]}})


def test_kernel_list_matches_torch_autograd():
    """The kernels torch runs for torchtitan 9dec370's RMSNorm expression, forward and backward,
    logged at the dispatcher (torch 2.13 on CPU; views and detaches launch nothing): the 6
    per-element and 2 per-row forward kernels and the 13 + 3 backward ones of rmsnorm_bytes."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshplan.compute.torch_eager import RMSNORM_ROW_KERNELS, rmsnorm_bytes

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in ("detach", "view", "expand"):
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    weight = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    with Log() as f:
        xf = x.float()
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * weight
    grad = torch.ones_like(y)
    with Log() as b:
        y.backward(grad)
    assert f.ops == ["_to_copy", "pow", "mean", "add", "rsqrt", "mul", "_to_copy", "mul"]
    assert b.ops == ["mul", "mul", "sum", "_to_copy", "mul", "mul", "sum", "pow", "mul", "mul", "div", "pow", "mul",
                     "mul", "add", "_to_copy"]
    fwd, bwd = rmsnorm_bytes(2)
    assert (len(fwd) + len(RMSNORM_ROW_KERNELS[0]), len(bwd) + len(RMSNORM_ROW_KERNELS[1])) == (len(f.ops), len(b.ops))
