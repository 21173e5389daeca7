"""One rank of a planned mesh on the local device (issue 11 item 8): the rank's real kernels and
memory for its local shapes, the other ranks stood in for by torch's fake process group, a few
layers; per-layer forward and backward time and the peak memory against the plan's.

**The reduced plan** and its prediction (:mod:`meshplan.runtime.validation.one_rank_plan`:
:func:`~meshplan.runtime.validation.one_rank_plan.reduced_data`,
:func:`~meshplan.runtime.validation.one_rank_plan.predict`): a few layers, no pipeline axis, one
micro-batch, the local machine's node type.

**The run** (:func:`run`): fake process group of the reduced mesh's world seen from ``rank``,
DeviceMesh, the runtime model (:class:`meshplan.runtime.execution.model.Transformer`) built on the
meta device, split by :func:`meshplan.runtime.execution.parallelize.parallelize` with FSDP2 mixed
precision, materialised on ``device``, parameters drawn Normal(0, 0.02) locally (norm weights 1;
no full tensors: a 405B layer's would not fit the host quickly), AdamW. ``warmup`` untimed steps,
then ``steps`` timed ones; the medians are reported. Collectives on the fake group return at once
with garbage values (FSDP2's copy-in and copy-out kernels around them still run): the measured
times are the rank's compute with no communication, set against the prediction's compute.

Per layer, CUDA events (``time.perf_counter`` after a synchronise on the CPU): forward from the
block's forward pre-hook to its forward hook (a call during backward is the recompute replay, kept
apart); backward from the gradient of the block's output (a hook on that tensor) to the gradient of
its input, which includes the replay. Peak memory: ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` over the last timed step (reset before it); not measured on the CPU.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from meshplan.compute.kernel_fragment import with_kernel_files
from meshplan.config import config_from_dict
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.runtime.validation.one_rank_plan import RUN_MEMORY, predict, reduced_data
from meshplan.runtime.validation.rank_profile import held_bytes, profiled

#: Node type per local device name (``torch.cuda.get_device_name``), for ``system="auto"``.
SYSTEMS = {"H200": "dgx-h200", "H100": "dgx-h100", "A100": "dgx-a100"}


def local_system(device: str) -> Optional[str]:
    """The catalog node type of the local CUDA device (:data:`SYSTEMS`), None on the CPU or an unknown GPU."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((s for k, s in SYSTEMS.items() if k in name), None)


@dataclass
class LayerClock:
    """Event pairs of each block per step: ``forward``, ``recompute`` and ``backward`` lists of
    (start, end) per block index, read after a synchronise by :meth:`seconds`."""

    device: str
    phase: str = "forward"
    marks: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)  # host seconds to issue forward / backward
    memory: dict = field(default_factory=dict)  # bytes: at the step's start, peak by the forward's end

    def stamp(self):
        if self.device.startswith("cuda"):
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, kind: str, i: int, which: int, stamp) -> None:
        self.marks.setdefault((kind, i), [None, None])[which] = stamp

    def seconds(self) -> dict:
        """kind -> per block seconds (blocks with both ends only)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        out: dict = {}
        for (kind, i), (a, b) in sorted(self.marks.items(), key=lambda x: x[0][1]):
            if a is None or b is None:
                continue
            s = a.elapsed_time(b) / 1e3 if self.device.startswith("cuda") else b - a
            out.setdefault(kind, []).append(s)
        return out


def _hook_blocks(model, clock: LayerClock) -> list:
    """Forward pre/post hooks on every block; tensor hooks for backward (module docstring)."""
    handles = []
    for i, block in enumerate(model.layers.values()):
        def pre(mod, args, i=i):
            kind = "recompute" if clock.phase == "backward" else "forward"
            clock.add(kind, i, 0, clock.stamp())
            x = args[0] if args else None
            if kind == "forward" and isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(lambda g, i=i: clock.add("backward", i, 1, clock.stamp()))

        def post(mod, args, out, i=i):
            kind = "recompute" if clock.phase == "backward" else "forward"
            clock.add(kind, i, 1, clock.stamp())
            if kind == "forward" and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g, i=i: clock.add("backward", i, 0, clock.stamp()))

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return handles


@torch.no_grad()
def _fill(model) -> None:
    """Parameters Normal(0, 0.02) on each rank's local shard, norm weights 1: random values, not
    zeros, which ran a bf16 GEMM 13% faster on an H200 (the device notes' METHOD.md, 2026-10-28)."""
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if "norm" in name:
            local.fill_(1.0)
        else:
            local.normal_(0.0, 0.02)


@dataclass
class Measured:
    """Median seconds per layer over the timed steps and blocks; bytes of the last timed step."""

    forward_s: Optional[float]
    backward_s: Optional[float]
    recompute_s: Optional[float]
    step_s: float
    peak_allocated_bytes: Optional[int]  # None: not measured (CPU; recompute: non-reentrant
    # checkpoint stops its replay early, so the block's forward hook does not fire: inside backward)
    peak_reserved_bytes: Optional[int]
    per_step: list = field(default_factory=list)
    held: dict = field(default_factory=dict)
    profile: dict = field(default_factory=dict)


def measure(cfg, plan, rank: int = 0, device: str = "cuda", warmup: int = 2, steps: int = 3,
            profile: bool = False) -> Measured:
    """Run the reduced config's rank ``rank`` (module docstring) and time it; ``profile``: one more
    step under torch.profiler, its kernels summed by kind (:func:`~meshplan.runtime.validation.rank_profile.kernel_kind`)."""
    from meshplan.runtime.validation.dryrun import fake_process_group

    mesh = plan.mesh
    cuda = device.startswith("cuda")
    with fake_process_group(mesh.world, rank), warnings.catch_warnings():
        # FSDP2 warns that the embedding returns a view (an in-place op on it would skip the
        # all-gather hook): the runtime model makes none (x = x + ...), so it says nothing here
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        model = _rank_model(cfg, mesh, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        clock = LayerClock(device)
        handles = _hook_blocks(model, clock)
        tokens, labels = _batch(cfg, mesh, rank, device)
        train = lambda: _train_step(model, opt, tokens, labels, mesh.degree("tp") > 1, clock)
        mem: tuple[Optional[int], Optional[int]] = (None, None)
        held: dict = {}
        extra: dict = {}
        try:
            per_step = _timed_steps(train, clock, warmup, steps, cuda)
            if cuda:
                mem = (int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved()))
                held = held_bytes(model, opt)
            if profile:
                extra = profiled(train, cuda)
                extra["host_forward_s"], extra["host_backward_s"] = clock.host["forward"], clock.host["backward"]
        finally:
            for h in handles:
                h.remove()

    def med(kind: str) -> Optional[float]:
        vals = [x for st in per_step for x in st.get(kind, [])]
        return statistics.median(vals) if vals else None

    return Measured(forward_s=med("forward"), backward_s=med("backward"), recompute_s=med("recompute"),
                    step_s=statistics.median(st["step_s"] for st in per_step), peak_allocated_bytes=mem[0],
                    peak_reserved_bytes=mem[1], per_step=per_step, held=held, profile=extra)


def _rank_model(cfg, mesh, device: str):
    """The reduced model of one rank on ``device``: built on the meta device, split by
    :func:`~meshplan.runtime.execution.parallelize.parallelize` over the (fake) DeviceMesh (mixed
    precision on CUDA), materialized and filled (:func:`_fill`)."""
    from meshplan.runtime.execution.model import Transformer
    from meshplan.runtime.execution.parallelize import init_mesh, parallelize

    t, tp = cfg.training, mesh.degree("tp")
    cuda = device.startswith("cuda")
    dm = init_mesh(mesh, "cuda" if cuda else "cpu")
    with torch.device("meta"):
        model = Transformer(cfg.model, vocab=padded_vocab(cfg.model.vocab, t.vocab_pad_divisor, tp), tp=tp,
                            recompute=t.layer_recomputed)
    parallelize(model, dm, mesh, t, loss_parallel=tp > 1, mixed_precision=cuda)
    model.to_empty(device=device)
    _fill(model)
    return model


def _batch(cfg, mesh, rank: int, device: str):
    """(tokens, labels) of one micro-batch on the rank's sequence shard (seq_len / cp), shape
    (micro_batch, seq_len / cp), random from a generator seeded with ``rank``."""
    b, s = cfg.training.micro_batch, cfg.training.seq_len // mesh.degree("cp")
    gen = torch.Generator(device=device).manual_seed(rank)
    tokens = torch.randint(0, cfg.model.vocab, (b, s), device=device, generator=gen)
    labels = torch.randint(0, cfg.model.vocab, (b, s), device=device, generator=gen)
    return tokens, labels


def _timed_steps(train, clock: LayerClock, warmup: int, steps: int, cuda: bool) -> list[dict]:
    """``warmup`` steps, then ``steps`` timed ones (CUDA events on CUDA, the host clock on CPU;
    the peak memory counters reset before the last): per timed step its seconds, the host's
    forward and backward seconds, the blocks' seconds by kind and the memory marks (bytes)."""
    per_step: list = []
    for k in range(warmup + steps):
        if cuda and k == warmup + steps - 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        clock.marks.clear()
        t0 = clock.stamp()
        train()
        t1 = clock.stamp()
        secs = clock.seconds()
        step = t0.elapsed_time(t1) / 1e3 if cuda else t1 - t0
        if k >= warmup:
            per_step.append(dict(step_s=step, host_forward_s=clock.host["forward"],
                                 host_backward_s=clock.host["backward"], **{kind: v for kind, v in secs.items()},
                                 **{f"memory_{x}_bytes": v for x, v in clock.memory.items()}))
    return per_step


def _train_step(model, opt, tokens, labels, loss_parallel: bool, clock: LayerClock) -> None:
    """Forward, cross entropy (loss-parallel at tp > 1), backward, AdamW step, zero_grad."""
    lp: contextlib.AbstractContextManager = contextlib.nullcontext()
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as _lp

        lp = _lp()
    clock.phase = "forward"
    cuda = clock.device.startswith("cuda")
    if cuda:
        clock.memory["start"] = torch.cuda.memory_allocated()
    with lp:
        h0 = time.perf_counter()
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())  # torchtitan: fp32 loss
        h1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
            clock.memory["forward_peak"] = torch.cuda.max_memory_allocated()
        clock.phase = "backward"
        h2 = time.perf_counter()
        loss.backward()
        clock.host.update(forward=h1 - h0, backward=time.perf_counter() - h2)
    clock.phase = "step"
    opt.step()
    opt.zero_grad(set_to_none=True)


def run(data: dict, layers: int = 2, rank: int = 0, device: str = "cuda", system: Optional[str] = "auto",
        warmup: int = 2, steps: int = 3, profile: bool = False, kernels: tuple = ()) -> dict:
    """Reduce ``data`` (a parsed config), predict (with ``kernels`` files laid over the reduced GPU's
    data, as ``--kernels`` does: their ``[host]`` pace too), measure; the evidence as a JSON-able dict
    with ``error`` = measured / predicted - 1 per figure, and per layer time the kernels' alone
    (``kernels``: :func:`meshplan.runtime.validation.host_pace.host_bound_passes` reads it)."""
    sysname = local_system(device) if system == "auto" else system
    cfg = config_from_dict(reduced_data(data, layers, sysname))
    if kernels:
        gpu = with_kernel_files(cfg.cluster.gpu, kernels)[0]
        cfg = replace(cfg, cluster=cfg.cluster.model_copy(update={"gpu": gpu}))
    plan, p = predict(cfg)
    m = measure(cfg, plan, rank, device, warmup, steps, profile)
    rows = {}
    for key in ("forward_s", "backward_s", "recompute_s", "peak_allocated_bytes", "peak_reserved_bytes"):
        pv, mv = getattr(p, key), getattr(m, key)
        rows[key] = dict(predicted=pv, measured=mv, error=(mv / pv - 1) if (mv is not None and pv) else None)
    for key, k in zip(("forward_s", "backward_s"), p.kernels_s):  # the kernels alone: host_pace.host_bound_passes
        rows[key]["kernels"] = k
    rows["peak_allocated_bytes"].update(_without_harness(rows["peak_allocated_bytes"], m.held, p.peak_by_kind))
    return dict(device=_device_name(device), torch=torch.__version__, gpu_catalog=p.gpu, layers=layers, rank=rank,
                mesh=dict(names=list(plan.mesh.layout.names), shape=list(plan.mesh.layout.shape)),
                micro_batch=cfg.training.micro_batch, seq_len=cfg.training.seq_len, peak_where=p.peak_where,
                rows=rows, step_s=m.step_s, per_step=m.per_step, memory=RUN_MEMORY,
                predicted_peak_by_kind=p.peak_by_kind, host=_host_lines(m.per_step), held=m.held,
                profile=m.profile)


def _without_harness(row: dict, held: dict, by_kind: dict) -> dict:
    """The measured peak less what this harness holds between steps beyond the plan's cuBLAS
    workspace (``held`` other bytes: its own token ids, more cuBLAS workspaces and, in its
    loss-parallel runs, ~1 GB that outlives the step), which the timed step's peak still holds:
    ``harness_held_bytes``, ``measured_without_harness`` and its ``error_without_harness``. On
    an H200 (benchmarks/gpu_h200 run 3) that error was 2-6 MB of the peak on all six meshes.
    Empty when not measured (CPU)."""
    if row["measured"] is None or "other_bytes" not in held:
        return {}
    extra = max(0, held["other_bytes"] - by_kind.get("workspace", 0))
    m = row["measured"] - extra
    return dict(harness_held_bytes=extra, measured_without_harness=m,
                error_without_harness=m / row["predicted"] - 1 if row["predicted"] else None)


def _host_lines(per_step: list) -> dict:
    """Median host seconds to issue the forward and the backward, beside the device's seconds of
    all blocks' forward and backward: a host that issues slower than the device runs leaves the
    device waiting (the measured times are then the host's)."""
    def med(key):
        vals = [st[key] for st in per_step if key in st]
        return statistics.median(vals) if vals else None

    def total(kind):
        vals = [sum(st.get(kind, [])) for st in per_step if st.get(kind)]
        return statistics.median(vals) if vals else None

    return dict(forward_issue_s=med("host_forward_s"), backward_issue_s=med("host_backward_s"),
                blocks_forward_s=total("forward"), blocks_backward_s=total("backward"))


def _device_name(device: str) -> str:
    from meshplan.runtime.bench.gemm import device_name

    return device_name(device)


def summary(ev: dict) -> str:
    """The evidence as lines for a person: predicted, measured, error per figure."""
    mesh = " x ".join(f"{n} {s}" for n, s in zip(ev["mesh"]["names"], ev["mesh"]["shape"]))
    lines = [f"one rank ({ev['rank']}) of {mesh}, {ev['layers']} layers, micro-batch {ev['micro_batch']} x "
             f"seq {ev['seq_len']} on {ev['device']} (torch {ev['torch']}; predicted for {ev['gpu_catalog']})",
             f"{'figure':<24} {'predicted':>12} {'measured':>12} {'error':>8}"]
    for key, r in ev["rows"].items():
        unit, scale = ("ms", 1e3) if key.endswith("_s") else ("GiB", 1 / 2**30)
        fmt = (lambda x: "-" if x is None else f"{x * scale:.3f}")
        err = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(f"{key.replace('_s', ' / layer').replace('_bytes', ''):<24} {fmt(r['predicted']):>9} {unit} "
                     f"{fmt(r['measured']):>9} {unit} {err:>8}")
    pk = ev["rows"]["peak_allocated_bytes"]
    if pk.get("measured_without_harness") is not None:
        lines.append(f"peak_allocated without the harness's held {pk['harness_held_bytes'] / 2**30:.3f} GiB: "
                     f"{pk['measured_without_harness'] / 2**30:.3f} GiB ({pk['error_without_harness']:+.1%})")
    h = ev.get("host") or {}
    if h.get("forward_issue_s") is not None and h.get("blocks_forward_s"):
        lines.append(f"host issue: forward {h['forward_issue_s'] * 1e3:.2f} ms (blocks on the device "
                     f"{h['blocks_forward_s'] * 1e3:.2f} ms), backward {h['backward_issue_s'] * 1e3:.2f} ms (blocks "
                     f"{(h['blocks_backward_s'] or 0) * 1e3:.2f} ms)")
    return "\n".join(lines)


__all__ = ["local_system", "measure", "run", "summary"]
