"""Mixture-of-experts layer of the runtime model and its expert parallelism (EP).

:class:`MoE` replaces the MLP of an MoE layer (``ModelSpec.is_moe_layer``)::

    layers.<i>.moe.router                      Linear (hidden -> experts), no bias
    layers.<i>.moe.experts.{w_gate, w_up}      (experts, expert_ffn, hidden), SwiGLU as the dense MLP
    layers.<i>.moe.experts.w_down              (experts, hidden, expert_ffn)
    layers.<i>.moe.shared.{w_gate, w_up, w_down}   always-on shared experts (width
                                               shared_experts x shared_expert_ffn), if any

Routing (Mixtral, Jiang et al. 2024, eq. 1): top-k of the router logits, softmax over those
k; then one of two dispatches, as the plan's routing says (:func:`set_routing`,
:meth:`meshplan.compute.routing.RoutingOptions.of`):

- **dropless** (a plan's default, torchtitan's and Megatron-LM's): every routed copy is computed. The
  ``T * top_k`` copies are sorted by expert (stable, so token order within an expert); with
  EP the ranks first exchange their per-expert counts (``all_to_all_single`` of ``experts``
  int64, equal splits of ``experts / ep``; no gradient), then send each peer the copies for its
  experts with those split sizes (``all_to_all_single_autograd`` with ``input_split_sizes`` =
  this rank's counts summed per peer, ``output_split_sizes`` = the received counts summed per
  source), regroup rank-major (source, local expert) segments expert-major, run each local
  expert on its rows, and send the outputs back with the splits swapped: torchtitan's
  ``AllToAllTokenDispatcher`` (``_token_count_exchange``, ``_dispatch_token_exchange``,
  ``_permute``, ``_combine_token_exchange``; pytorch/torchtitan b5bcd76
  ``torchtitan/models/common/token_dispatcher.py``). Each expert's rows are one GEMM chain
  (:meth:`Experts.forward` with ``counts``), as ``torch._grouped_mm`` over the count offsets
  computes them there (``GroupedExperts``, ``torchtitan/models/common/moe.py``). gloo runs
  uneven ``all_to_all_single`` on CPU (torch 2.13). The dispatch sends ``T * top_k`` rows
  whatever the routing; the combine sends what this rank received, ``T * top_k`` rows per rank
  on average (the plan's balanced expectation).
- **capacity** (Switch Transformer, Fedus et al. 2021, capacity factor f =
  ``training.moe_capacity_factor``): each expert takes at most ``C = ceil(f * T * top_k / experts)``
  token copies of the ``T`` tokens of this rank (:func:`meshplan.compute.routing.expert_capacity`),
  in token order; copies beyond C are dropped (their output is 0), empty slots are zero
  padding. The dispatch buffer is therefore always ``(experts, C, hidden)``, whatever the
  router decides, and the all-to-all sizes are known before the run (meshplan's collective
  table, :func:`meshplan.comm.ep_rows.ep_rows`).

EP (:func:`~meshplan.runtime.execution.moe_parallel.apply_ep`): the rank at position ``j`` of its ``ep`` group keeps experts
``j*E/ep .. (j+1)*E/ep - 1``; dispatch and combine are
``torch.distributed._functional_collectives.all_to_all_single_autograd`` (the backward of
each is an all-to-all of the same size, splits swapped; gloo runs it), with capacity equal
splits of ``E/ep * C * hidden`` elements per peer. The recorder sees every one as ``_c10d_functional::all_to_all_single``
on the ep group. Expert weights form their own
FSDP2 unit over ``efsdp`` of the expert mesh (torchtitan), see
:func:`meshplan.runtime.execution.parallelize.parallelize`.

TP with MoE layers (:func:`~meshplan.runtime.execution.moe_parallel.apply_moe_tp`, ``tp > 1``, ``etp = 1``): the experts stay whole on
each ep rank and the tp ranks split the tokens instead (torchtitan's token-split sequence
parallel for experts; :func:`meshplan.compute.shapes.layer_gemms`): each tp rank routes, dispatches
and combines only its ``T = b*s/tp`` tokens. Under SP those are its own sequence shard
(b, s/tp, h), which is also the block's output layout, so the routed path has no tp
collective; without SP it takes its tp-th of the replicated (b*s, h) tokens (a DTensor
``Replicate -> Shard(0)``: a slice, whose backward all-gathers the input gradient) and
all-gathers the routed outputs back to every tp rank (``Shard(0) -> Replicate``, whose
backward is a slice). The router weight is replicated over tp (``SequenceParallel`` on the
token dim), so its gradient, a sum over each rank's own tokens, is a Partial DTensor that
FSDP2 all-reduces over tp; shared experts are split like the dense MLP (colwise, rowwise).
That is torchtitan's layout with ep > 1; at ep 1 torchtitan shards the experts over tp instead
(etp = tp, :func:`~meshplan.runtime.execution.moe_parallel.apply_experts_over_tp`): every tp rank
routes all the tokens through its f/tp slice of each expert and the Partial outputs are reduced.

>>> from meshplan.spec.model import ModelSpec
>>> spec = ModelSpec(layers=1, hidden=16, ffn=32, q_heads=2, vocab=10, experts=4, top_k=2, expert_ffn=8)
>>> moe = MoE(spec)
>>> moe(torch.randn(2, 3, 16)).shape, moe.capacity(6)
(torch.Size([2, 3, 16]), 3)
>>> moe.dropless = True
>>> moe(torch.randn(2, 3, 16)).shape
torch.Size([2, 3, 16])
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.compute.routing import RoutingOptions, expert_capacity
from meshplan.errors import ConfigError
from meshplan.spec.model import ModelSpec


class Experts(nn.Module):
    """The routed experts this rank holds, as stacked weights; ``forward`` maps (experts
    held, tokens per expert, hidden) to the same shape. ``full_rows``/``offset``: experts
    of the whole model and the index of the first one held here (EP), used by
    ``Transformer.init_weights`` to draw the full tensors and keep this rank's rows."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, h, f = spec.experts, spec.hidden, spec.moe_ffn
        self.gated = spec.gated_mlp
        if self.gated:
            self.w_gate = nn.Parameter(torch.empty(e, f, h))
        self.w_up = nn.Parameter(torch.empty(e, f, h))
        self.w_down = nn.Parameter(torch.empty(e, h, f))
        self.full_rows, self.offset = e, 0
        self.grad_scale = 1.0  # 1/ep under EP, see apply_ep

    def _w(self, name: str, scaled: bool = True) -> torch.Tensor:
        w = getattr(self, name)
        if hasattr(w, "to_local"):  # a DTensor (etp = tp: this rank's slice of the expert width)
            w = w.to_local()
        return w if self.grad_scale == 1.0 or not scaled else _ScaleGrad.apply(w, self.grad_scale)

    def forward(self, x: torch.Tensor, counts: Optional[list[int]] = None) -> torch.Tensor:
        """``x`` (experts held, rows per expert, hidden), or with ``counts`` (dropless) the
        rows of every held expert one after another, (sum(counts), hidden), ``counts[i]`` of
        expert i; the output has the shape of ``x``."""
        if counts is None:
            up = torch.bmm(x, self._w("w_up").transpose(1, 2))
            act = F.silu(torch.bmm(x, self._w("w_gate").transpose(1, 2))) * up if self.gated else F.gelu(up)
            return torch.bmm(act, self._w("w_down").transpose(1, 2))
        def mm(t, name):
            return _GroupedMM.apply(t, self._w(name, scaled=False), tuple(counts), self.grad_scale)

        up = mm(x, "w_up")
        act = F.silu(mm(x, "w_gate")) * up if self.gated else F.gelu(up)
        return mm(act, "w_down")


class SharedExperts(nn.Module):
    """Shared experts as one MLP of width ``shared_experts x shared_expert_ffn`` (no bias)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f = spec.hidden, (spec.shared_expert_ffn or spec.moe_ffn) * spec.shared_experts
        self.gated = spec.gated_mlp
        if self.gated:
            self.w_gate = nn.Linear(h, f, bias=False)
        self.w_up = nn.Linear(h, f, bias=False)
        self.w_down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = F.silu(self.w_gate(x)) * self.w_up(x) if self.gated else F.gelu(self.w_up(x))
        return self.w_down(act)


class MoE(nn.Module):
    """Router, dropless or capacity dispatch, experts (local, or over EP with all-to-all), combine,
    plus the shared experts; (batch, seq, hidden) in and out. See the module docstring."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.n_experts, self.top_k = spec.experts, spec.top_k
        self.router = nn.Linear(spec.hidden, spec.experts, bias=False)
        self.experts = Experts(spec)
        if spec.shared_experts:
            self.shared = SharedExperts(spec)
        self.ep_group = None  # set by apply_ep
        self.ep = 1
        self.tp_mesh, self.sp, self.token_split = None, False, 1  # set by apply_moe_tp
        self.experts_over_tp = False  # set by apply_experts_over_tp (ep 1, etp = tp)
        self.capacity_factor, self.dropless = 1.0, False  # set by set_routing
        self.expert_counts: Optional[torch.Tensor] = None  # dropless: (E,) copies routed here, summed over calls

    def capacity(self, tokens: int) -> int:
        """Token copies each expert takes from ``tokens`` tokens of this rank:
        ``ceil(capacity_factor x tokens x top_k / experts)``, from the static token count, so
        every rank of the ep group sizes the same all-to-all."""
        return expert_capacity(tokens, self.top_k, self.n_experts, self.capacity_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts_over_tp:
            from meshplan.runtime.execution.moe_etp import experts_over_tp_forward

            return experts_over_tp_forward(self, x)
        if self.tp_mesh is not None:
            return self._tp_forward(x)
        b, s, h = x.shape
        t = x.reshape(b * s, h)
        out = self._routed(t)
        if hasattr(self, "shared"):
            out = out + self.shared(t)
        return out.view(b, s, h)

    def _logits(self, t: torch.Tensor) -> torch.Tensor:
        """Router logits (T, experts); under ``experts_over_tp`` from the replicated weight's local
        value, its gradient ``Partial`` over tp (apply_experts_over_tp)."""
        if not self.experts_over_tp:
            return self.router(t)
        from torch.distributed.tensor import Partial

        return F.linear(t, self.router.weight.to_local(grad_placements=[Partial()]))

    def _routed(self, t: torch.Tensor) -> torch.Tensor:
        """Routed experts' output (T, h) for this rank's tokens ``t`` (T, h)."""
        h = t.shape[-1]
        e, k, cap = self.n_experts, self.top_k, self.capacity(t.shape[0])
        gate, idx = torch.topk(self._logits(t).float(), k, dim=-1)  # (T, k)
        gate = gate.softmax(dim=-1).to(t.dtype)
        if self.dropless:
            return self._dropless(t, gate, idx)
        flat = idx.reshape(-1)  # copy i*k + j: token i, its j-th expert
        pos = (F.one_hot(flat, e).cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1)  # order within its expert
        keep = (pos < cap).to(t.dtype)
        slot = flat * cap + pos.clamp(max=cap - 1)  # a dropped copy adds 0 to a taken slot
        src = t.repeat_interleave(k, dim=0) * keep[:, None]
        buf = t.new_zeros(e * cap, h).index_add(0, slot, src)
        y = self._run_experts(buf, cap)  # (E * C, h), in this rank's slot order
        return (y[slot] * (gate.reshape(-1) * keep)[:, None]).view(-1, k, h).sum(dim=1)

    def _dropless(self, t: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Dropless dispatch (module docstring) of ``t`` (T, h) with ``gate``/``idx`` (T, k)."""
        k, h = self.top_k, t.shape[-1]
        flat = idx.reshape(-1)  # copy i*k + j: token i, its j-th expert
        order = torch.argsort(flat, stable=True)  # copies in expert order
        counts = torch.bincount(flat, minlength=self.n_experts)  # (E,) int64
        seen = counts.detach()  # the router's load, read by validate (take_expert_counts)
        self.expert_counts = seen.clone() if self.expert_counts is None else self.expert_counts + seen
        y = self._run_dropless(t[order // k], counts)  # (T k, h) in expert order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return (y[back] * gate.reshape(-1)[:, None]).view(-1, k, h).sum(dim=1)

    def _run_dropless(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the expert-sorted copies ``x`` (T k, h); ``counts`` (E,) per expert."""
        if self.ep_group is None:
            return self.experts(x, counts.tolist())
        from torch.distributed._functional_collectives import (all_to_all_single, all_to_all_single_autograd,
                                                               wait_tensor)

        ep, local = self.ep, self.n_experts // self.ep
        with torch.no_grad():  # recv[r, i]: copies source rank r sends to local expert i
            recv = wait_tensor(all_to_all_single(counts, None, None, self.ep_group)).view(ep, local)
        send_splits, recv_splits = counts.view(ep, local).sum(1).tolist(), recv.sum(1).tolist()
        got = wait_tensor(all_to_all_single_autograd(x, recv_splits, send_splits, self.ep_group))  # dispatch
        segs = torch.split(got, recv.reshape(-1).tolist())  # (source, local expert), rank-major
        by_expert = [segs[r * local + i] for i in range(local) for r in range(ep)]
        y = self.experts(torch.cat(by_expert), recv.t().sum(1).tolist())  # expert-major rows
        outs = torch.split(y, recv.t().reshape(-1).tolist())  # (local expert, source)
        y = torch.cat([outs[i * ep + r] for r in range(ep) for i in range(local)])  # rank-major again
        return wait_tensor(all_to_all_single_autograd(y, send_splits, recv_splits, self.ep_group))  # combine

    def _tp_forward(self, x: torch.Tensor) -> torch.Tensor:
        """tp > 1: route this rank's tp-th of the tokens (see the module docstring). ``x``:
        under SP this rank's sequence shard (b, s/tp, h), else the replicated (b, s, h)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if isinstance(x, DTensor):  # SP: the SequenceParallel norm's Shard(1) output
            x = x.to_local()
        b, s, h = x.shape
        if self.sp:
            out = self._routed(x.reshape(b * s, h)).view(b, s, h)
        else:
            if (b * s) % self.token_split:
                raise ConfigError("training.seq_len", f"micro_batch x seq_len = {b * s} tokens do not split over "
                                  f"tp {self.token_split} for the experts")
            mesh = self.tp_mesh
            mine = DTensor.from_local(x.reshape(b * s, h), mesh, [Replicate()], run_check=False)
            mine = mine.redistribute(mesh, [Shard(0)]).to_local()  # backward: all-gather of the input gradient
            y = DTensor.from_local(self._routed(mine), mesh, [Shard(0)], run_check=False)
            out = y.redistribute(mesh, [Replicate()]).to_local().view(b, s, h)  # all-gather; backward: a slice
        if hasattr(self, "shared"):  # colwise/rowwise: all-gather + reduce-scatter (SP) or all-reduces
            out = out + self.shared(x)
        return out

    def _run_experts(self, buf: torch.Tensor, cap: int) -> torch.Tensor:
        e, h = self.n_experts, buf.shape[-1]
        if self.ep_group is None:
            return self.experts(buf.view(e, cap, h)).reshape(e * cap, h)
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        ep, local = self.ep, e // self.ep
        recv = wait_tensor(all_to_all_single_autograd(buf, None, None, self.ep_group))  # dispatch
        x = recv.view(ep, local, cap, h).transpose(0, 1).reshape(local, ep * cap, h)
        y = self.experts(x).view(local, ep, cap, h).transpose(0, 1).reshape(e * cap, h)
        return wait_tensor(all_to_all_single_autograd(y, None, None, self.ep_group))  # combine


def set_routing(model: nn.Module, routing: RoutingOptions) -> None:
    """Every MoE layer of ``model`` dispatches as ``routing`` says
    (:meth:`~meshplan.compute.routing.RoutingOptions.of` the plan's training): dropless, or
    ``ceil(capacity_factor x T x top_k / experts)`` copies per expert. A stated hottest-expert
    share is the plan's assumption about the router, not a dispatch setting."""
    for moe in moe_layers(model):
        moe.capacity_factor, moe.dropless = routing.capacity_factor, routing.dropless


def take_expert_counts(model: nn.Module) -> dict[str, list[int]]:
    """Per MoE module name (``layers.<i>.moe``), the token copies this rank's router sent to
    each of the ``experts`` experts (all of them, not only the ones held here) in the dropless
    dispatches since the last call, then zeroed: ``meshplan validate`` writes the recorded
    step's and reports the router's imbalance (:mod:`meshplan.runtime.validation.routerload`).
    A replayed forward (activation checkpointing) routes the same copies again, doubling that
    layer's counts alike. Capacity-routed layers are left out."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.expert_counts is not None:
            out[name] = [int(x) for x in m.expert_counts.tolist()]
            m.expert_counts = None
    return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of ``model`` in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_params(model: nn.Module) -> Optional[list]:
    """Parameters of every ``Experts`` module (routed experts), in order."""
    return [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]


class _GroupedMM(torch.autograd.Function):
    """``x`` (sum(counts), k), rows ``counts[i]`` of expert i, times ``w[i]``^T, ``w`` (E, n, k):
    (sum(counts), n), as ``torch._grouped_mm`` over the count offsets computes it for torchtitan's
    ``GroupedExperts``, here one ``aten::mm`` per expert written into one output (the GEMM events
    validate's breakdown reads). Backward allocates what grouped_mm's does: one input gradient and
    one weight gradient (E, n, k), each expert's rows written by its own mm, the weight's times
    ``scale`` in place (torchtitan divides the experts' gradient inside FSDP2's reduce-scatter,
    ``set_gradient_divide_factor``: no extra copy). Indexing ``w[i]`` per expert instead made
    autograd's SelectBackward allocate a zero (E, n, k) gradient per expert and sum them: at world 4
    of ``tests/data/validate_mixtral_ep2_fsdp.toml`` five 3,670,016 B ``Temp`` storages at once,
    validate's temporaries +1698% against the plan (which models grouped_mm's bytes)."""

    @staticmethod
    def forward(ctx, x, w, counts, scale):
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.scale = counts, scale
        out = x.new_empty(x.shape[0], w.shape[1])
        for i, (a, b) in enumerate(_bounds(counts)):
            torch.mm(x[a:b], w[i].t(), out=out[a:b])
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None  # an expert without rows: 0
        for i, (a, b) in enumerate(_bounds(ctx.counts)):
            if gx is not None:
                torch.mm(grad[a:b], w[i], out=gx[a:b])
            if gw is not None and b > a:
                torch.mm(grad[a:b].t(), x[a:b], out=gw[i])
        if gw is not None and ctx.scale != 1.0:
            gw.mul_(ctx.scale)
        return gx, gw, None, None


def _bounds(counts) -> list[tuple[int, int]]:
    """Row ranges of consecutive groups of ``counts`` rows: ``_bounds((2, 0, 3))`` -> [(0, 2), (2, 2), (2, 5)]."""
    out, a = [], 0
    for c in counts:
        out.append((a, a + c))
        a += c
    return out


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None
