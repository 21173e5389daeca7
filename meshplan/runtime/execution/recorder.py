"""Record every collective a rank issues, in order, with its group's ranks and its bytes.

:class:`CollectiveRecorder` is a ``TorchDispatchMode``. It sees the functional collectives
DTensor lowers to (``_c10d_functional.*``) and the in-place c10d ops that FSDP2 and
``torch.distributed`` call (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``,
``c10d.allreduce_``, ``c10d.send``, ...). On a DTensor it returns ``NotImplemented``, so
DTensor's own dispatch runs first and the mode sees the plain collectives it issues.

Each record is normalised to meshplan's vocabulary (``all-gather``, ``reduce-scatter``,
``all-reduce``, ``all-to-all``, ``broadcast``, ``send``, ``recv``) with ``size_bytes`` the
full buffer as nccl-tests prints it: the gathered output of an all-gather, the input of a
reduce-scatter, the buffer of an all-reduce or broadcast, the send buffer of an all-to-all,
the tensor of a send or recv. Compare at this level: gloo runs a reduce-scatter as an
all-reduce underneath, so gloo's own names and sizes differ from NCCL's.

Usage::

    with CollectiveRecorder() as rec:
        rec.phase = "forward"; loss = model(x).sum()
        rec.phase = "backward"; loss.backward()
    rec.records  # list[Collective], in issue order
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
           torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8", torch.int8: "int8",
           torch.bool: "bool"}

# op name (namespace::name) -> (meshplan op, which tensor argument holds the full buffer)
# "out": the output tensor(s), "in": the input tensor(s).
_OPS = {
    "_c10d_functional::all_gather_into_tensor": ("all-gather", "out"),
    "_c10d_functional::all_gather_into_tensor_out": ("all-gather", "out"),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all-gather", "out"),
    "_c10d_functional::reduce_scatter_tensor": ("reduce-scatter", "in"),
    "_c10d_functional::reduce_scatter_tensor_out": ("reduce-scatter", "in"),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce-scatter", "in"),
    "_c10d_functional::all_reduce": ("all-reduce", "in"),
    "_c10d_functional::all_reduce_": ("all-reduce", "in"),
    "_c10d_functional::all_reduce_coalesced": ("all-reduce", "in"),
    "_c10d_functional::all_reduce_coalesced_": ("all-reduce", "in"),
    "_c10d_functional::all_to_all_single": ("all-to-all", "in"),
    "_c10d_functional::broadcast": ("broadcast", "in"),
    "_c10d_functional::broadcast_": ("broadcast", "in"),
    "_c10d_functional::isend": ("send", "in"),
    "_c10d_functional::irecv": ("recv", "in"),
    "c10d::_allgather_base_": ("all-gather", "out"),
    "c10d::allgather_": ("all-gather", "out"),
    "c10d::allgather_into_tensor_coalesced_": ("all-gather", "out"),
    "c10d::allgather_coalesced_": ("all-gather", "out"),
    "c10d::_reduce_scatter_base_": ("reduce-scatter", "in"),
    "c10d::reduce_scatter_": ("reduce-scatter", "in"),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce-scatter", "in"),
    "c10d::allreduce_": ("all-reduce", "in"),
    "c10d::allreduce_coalesced_": ("all-reduce", "in"),
    "c10d::alltoall_base_": ("all-to-all", "in"),
    "c10d::alltoall_": ("all-to-all", "in"),
    "c10d::broadcast_": ("broadcast", "in"),
    "c10d::send": ("send", "in"),
    "c10d::recv_": ("recv", "in"),
    "c10d::recv_any_source_": ("recv", "in"),
}
# Argument positions (schema order) of input/output tensors for the c10d ops whose first
# argument is the output: the rest take their input (or in-place buffer) first.
_OUT_FIRST = {"c10d::_allgather_base_", "c10d::allgather_", "c10d::allgather_into_tensor_coalesced_",
              "c10d::allgather_coalesced_", "c10d::_reduce_scatter_base_", "c10d::reduce_scatter_",
              "c10d::reduce_scatter_tensor_coalesced_", "c10d::alltoall_base_", "c10d::alltoall_"}


@dataclass(frozen=True)
class Collective:
    """One collective as issued by this rank.

    ``op``: meshplan's name; ``torch_op``: the dispatcher op; ``group``: global ranks of the
    group, in group order; ``size_bytes``: the full buffer (see the module docstring);
    ``in_shapes``/``out_shapes``: tensor shapes as issued; ``phase``: the label set on the
    recorder when it was issued ("forward", "backward", "step", ...); ``entry_s``: wall-clock
    time (``time.time()``, seconds since the epoch) when this rank issued it, before the op
    ran: its arrival at the collective (the arrival skew of
    :mod:`meshplan.runtime.validation.staged`; one clock for every rank of a host).
    """

    op: str
    torch_op: str
    group: tuple[int, ...]
    size_bytes: int
    dtype: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    phase: str = ""
    entry_s: float = 0.0

    @property
    def group_size(self) -> int:
        return len(self.group)


def group_ranks(pg: Any) -> tuple[int, ...]:
    """Global ranks of a process group given as a ProcessGroup or a group name."""
    if isinstance(pg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(pg)
    elif isinstance(pg, torch._C.ScriptObject):  # a boxed ProcessGroup, as c10d ops receive it
        pg = torch._C._distributed_c10d.ProcessGroup.unbox(pg)
    return tuple(dist.get_process_group_ranks(pg))


def _tensors(x) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _group_arg(name: str, args, kwargs) -> Any:
    if name.startswith("_c10d_functional::"):
        return kwargs.get("group_name", args[-1])
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch._C.ScriptObject) or type(a).__name__ == "ProcessGroup":
            return a
    raise ValueError(f"no process group among the arguments of {name}")


def describe(name: str, args, kwargs, out) -> Collective:
    """A :class:`Collective` for dispatcher op ``name`` called with ``args`` returning ``out``."""
    op, full = _OPS[name]
    if name.startswith("_c10d_functional::"):
        ins, outs = _tensors(args[0]), _tensors(out)
    elif name in _OUT_FIRST:
        ins, outs = _tensors(args[1]), _tensors(args[0])
    else:  # in-place on its first argument
        ins = outs = _tensors(args[0])
    ref = outs if full == "out" else ins
    size = sum(t.numel() * t.element_size() for t in ref)
    dtype = _DTYPES.get(ref[0].dtype, str(ref[0].dtype).removeprefix("torch.")) if ref else ""
    return Collective(op=op, torch_op=name, group=group_ranks(_group_arg(name, args, kwargs)),
                      size_bytes=int(size), dtype=dtype,
                      in_shapes=tuple(tuple(t.shape) for t in ins), out_shapes=tuple(tuple(t.shape) for t in outs))


class CollectiveRecorder(TorchDispatchMode):
    """Dispatch mode that appends a :class:`Collective` to ``records`` for every collective
    op it sees (``wait_tensor`` and barriers are not collectives of the plan and are
    skipped). Set ``phase`` to label what follows."""

    def __init__(self):
        super().__init__()
        self.records: list[Collective] = []
        self.phase = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        entry = time.time()  # the rank's arrival, before the collective can wait for its peers
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in _OPS:
            rec = describe(name, args, kwargs, out)
            self.records.append(Collective(**{**rec.__dict__, "phase": self.phase, "entry_s": entry}))
        return out
