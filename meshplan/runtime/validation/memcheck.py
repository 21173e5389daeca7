"""meshplan's memory timeline checked against PyTorch's own accounting.

One process stands in for one rank of a planned mesh on the fake process group (as
:mod:`meshplan.runtime.validation.dryrun`): a small Llama-style model from the config's ``[model]``
is split with DTensor TP/SP and FSDP2/HSDP by
:func:`~meshplan.runtime.execution.parallelize.parallelize` and trained for two steps (forward,
loss, backward, AdamW step, ``zero_grad``). The second step runs under
``torch.distributed._tools.FSDPMemTracker``: the timeline models the steady state, where
the optimizer state exists from the start. :func:`compare` sets its numbers beside
:func:`~meshplan.memory.timeline.memory_timeline` of the same config: the peak, and the
maximum of each kind over the step (each kind's model checked at its own worst moment;
the kinds at the peak are shown too). Tracker categories become meshplan kinds by
:data:`~meshplan.memory.timeline.TRACKER_CATEGORIES`.

The prediction's ``[memory]`` table is what this run does (:data:`TORCH_CPU_MEMORY`): no
NCCL buffers and no fragmentation are tracked
(:data:`~meshplan.memory.timeline.UNTRACKED_KINDS`), a CPU has no cuBLAS workspace, fp32
throughout (no mixed precision: logits fp32), no dropout, one micro-batch, the AdamW of
``training.optimizer_impl`` (:func:`~meshplan.runtime.execution.trainstep.adamw`, fused by default;
its temporaries are :meth:`~meshplan.spec.memory.MemoryOptions.optimizer_temp_states_for`'s:
fused none, foreach one optimizer state), torch's cross entropy, and the torch variants of
:mod:`meshplan.memory.activations` (all-gathered SP inputs kept, ``rms_norm`` decomposed on
CPU, K/V repeated before SDPA, the embedding gradient over the whole vocabulary).

Findings on torch 2.13 (CPU):

- FSDPMemTracker works with FSDP2 + DTensor on the fake process group, on real CPU tensors
  (the default here: tiny models, no cost) and under ``FakeTensorMode`` (``fake=True``),
  with two caveats for the latter: the first optimizer step re-creates its state several
  times (so the first step runs outside the tracker here, which then registers the
  sharded parameters and the optimizer state when it enters), and DTensor's sharding
  propagation runs in the ambient fake mode, so the tracker counts its global-shape meta
  tensors (loss-parallel ``_log_softmax`` / ``nll_loss`` handlers: two logits-sized
  phantoms). Under real tensors neither happens.
- MemTracker raises on a second iteration unless ``reset_mod_stats()`` is called; a fresh
  tracker for the second step avoids that and keeps its peak to that step.
- Labels are refined, bytes are not: :class:`_Tracker`
  (:class:`~meshplan.runtime.execution.memtracker.LabelledMemTracker`, shared with the validate
  worker) logs every update of the tracker's running snapshot and :func:`_relabelled_kinds`
  (:func:`~meshplan.runtime.execution.memtracker.relabelled_kinds`) re-reads it with each storage under the
  last label the tracker gave it (an all-gather output, a gradient or a reduce-scatter
  input is labelled some ops after its allocation; FSDPMemTracker installs no gradient
  hooks, so autograd's unsharded gradients are ``Temp`` until a post-accumulate-grad hook
  here labels them), an ``Activation`` allocated and freed within the forward (or within
  one recompute) read as a temporary, and the optimizer step's allocations as temporaries
  (its state exists in the steady state). The peak is the tracker's own; the largest
  total of the log is kept beside it as a check (``own_peak_bytes``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from meshplan.config import Config
from meshplan.memory.timeline import COMPARISON_GROUPS, TRACKER_CATEGORIES, UNTRACKED_KINDS, Timeline, tracker_to_kinds
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.runtime.execution.memtracker import LabelledMemTracker as _Tracker, category_label as _label
from meshplan.runtime.execution.memtracker import RS_COPY_KIND, relabelled_kinds as _relabelled_kinds
from meshplan.runtime.execution.model import Transformer
from meshplan.runtime.execution.parallelize import init_mesh, parallelize
from meshplan.runtime.execution.trainstep import adamw
from meshplan.runtime.validation.dryrun import fake_process_group
from meshplan.units import KiB

#: ``[memory]`` table of what the torch CPU run does (see the module docstring).
TORCH_CPU_MEMORY = dict(nccl_buffsize_bytes=0, workspace_bytes=0, fragmentation_fraction=0.0,
                        logits_dtype="fp32", dropout=False, cross_entropy="torch", sp_gathered_input=True,
                        unfused_norm=True, kv_expanded=True, embedding_grad_full_vocab=True)
#: Kinds compared, in print order (the untracked ones are zero on both sides).
COMPARED_KINDS = ("params", "optimizer", "grads", "gathered_params", "grad_buffers", "activations", "temporaries")

@dataclass(frozen=True)
class Measured:
    """FSDPMemTracker's view of the second step on one rank: its peak (``peak_bytes``) and
    bytes per tracker category there (``peak_by_category``, the tracker's own labels);
    with the refined labels, bytes per meshplan kind at the peak (``peak_by_kind``) and the
    maximum of each kind over the step (``max_by_kind``). ``own_peak_bytes`` is the largest
    total over every tracker update, equal to ``peak_bytes`` unless the tracker missed one.
    ``step_temp_bytes``: the most bytes of temporaries allocated by the optimizer step alive
    at once (:func:`_step_temporaries`)."""

    peak_bytes: int
    peak_by_category: dict
    peak_by_kind: dict
    max_by_kind: dict
    own_peak_bytes: int
    step_temp_bytes: int = 0


def _step(model, opt, b: int, s: int, loss_parallel: bool, tracker: Optional[_Tracker] = None) -> None:
    """One training step; the logits are dropped before backward (as torchtitan's ``del pred``).
    ``tracker.phase`` follows it."""
    tokens = torch.zeros(b, s, dtype=torch.long)
    labels = torch.zeros(b, s, dtype=torch.long)
    lp = contextlib.nullcontext()
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as _lp

        lp = _lp()
    with lp:
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        _mark(tracker, "backward")
        loss.backward()
    del loss
    _mark(tracker, "step")
    opt.step()
    opt.zero_grad(set_to_none=True)


def _mark(tracker, phase: str) -> None:
    if tracker is not None:
        tracker.phase = phase


def measure(config: Config, rank: int = 0, fake: bool = False) -> Measured:
    """Run two steps of ``config`` as ``rank`` on the fake process group and return the
    tracker's view of the second. ``fake``: tensors under FakeTensorMode (no compute; see
    the module docstring for what that adds to the loss); default real CPU tensors."""
    plan = _plan(config)
    mesh, t = plan.mesh, config.training
    if plan.micro_batches != 1:
        raise ValueError(f"{plan.micro_batches} micro-batches: the check runs one; set global_batch = micro_batch x dp")
    tp = mesh.degree("tp")
    v = padded_vocab(config.model.vocab, t.vocab_pad_divisor, tp)
    with fake_process_group(mesh.world, rank):
        dm = init_mesh(mesh, "cpu")
        with torch.device("meta"):
            model = Transformer(config.model, vocab=v, tp=tp, recompute=t.layer_recomputed)
        parallelize(model, dm, mesh, t)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model.to_empty(device="cpu")
            opt = adamw(model.parameters(), t)
            _step(model, opt, t.micro_batch, t.seq_len, tp > 1)
            return _tracked_step(model, opt, t.micro_batch, t.seq_len, tp > 1)


def _tracked_step(model, opt, b: int, s: int, loss_parallel: bool) -> Measured:
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError("nothing is FSDP-sharded: the check needs dp_shard x dp_replicate > 1")
    mt = _Tracker(model, opt)
    handles = mt.label_grads(model)
    try:
        with mt:
            _step(model, opt, b, s, loss_parallel, mt)
    finally:
        for h in handles:
            h.remove()
    snap = next(iter(mt.get_tracker_snapshot("peak").values()), {})
    cats = {_label(k): int(v) for k, v in snap.items() if k != "Total" and v}
    kmax, top, at_top = _relabelled_kinds(mt.log)
    return Measured(peak_bytes=int(snap.get("Total", 0)), peak_by_category=cats, peak_by_kind=at_top,
                    max_by_kind=kmax, own_peak_bytes=top, step_temp_bytes=_step_temporaries(mt.log))


def _step_temporaries(log) -> int:
    """Bytes: the largest sum of the live temporaries (tracker label ``Temp``) that the
    optimizer step allocated, over a :class:`_Tracker` log of (storage, delta bytes, label,
    phase); foreach AdamW's ``torch._foreach_sqrt(exp_avg_sqs)`` is one optimizer state,
    fused AdamW allocates none (:meth:`~meshplan.spec.memory.MemoryOptions.optimizer_temp_states_for`)."""
    born, cur, top = set(), 0, 0
    for w, delta, label, phase in log:
        if phase == "step" and delta > 0 and label in TRACKER_CATEGORIES["temporaries"]:
            born.add(w)
        if w in born:
            cur += delta
            top = max(top, cur)
    return top


def predicted_step_temporaries(tl: Timeline) -> int:
    """Bytes: the largest sum of the temporaries the timeline's optimizer step holds at once
    (:func:`meshplan.memory.sizes.step_entries`)."""
    cur, top = 0, 0
    for e in tl.events():
        if e.phase == "step" and e.kind == "temporaries":
            cur += e.delta_bytes
            top = max(top, cur)
    return top


def _plan(config: Config) -> Plan:
    """The plan of one of the check's configs; ValueError when it has none."""
    plan = build_plan(config)
    if isinstance(plan, Infeasible):
        raise ValueError("the check needs a resolved plan: " + "; ".join(plan.reasons))
    return plan


def predict(config: Config) -> Timeline:
    """meshplan's timeline of the (single) stage of ``config``."""
    plan = _plan(config)
    if len(plan.timelines) != 1:
        raise ValueError("the check covers one pipeline stage (pp 1)")
    return plan.timelines[0]


@dataclass(frozen=True)
class KindRow:
    """One compared quantity, bytes on one rank."""

    kind: str
    predicted_bytes: int
    measured_bytes: int

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured; 0 when both are 0."""
        if not self.measured_bytes:
            return 0.0 if not self.predicted_bytes else float("inf")
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


@dataclass(frozen=True)
class Comparison:
    """Predicted beside measured for one configuration, bytes on one rank: ``kinds`` the
    maximum of each kind over the step (each kind's model checked at its own worst moment),
    ``peak`` the largest total, ``at_peak`` the kinds at each side's peak (the two peaks
    can fall on different events), ``step_temporaries`` the optimizer step's own temporaries
    (hidden in ``kinds``' temporaries by the larger working sets of backward)."""

    name: str
    kinds: tuple
    at_peak: tuple
    peak: KindRow
    where_predicted: str
    measured: Measured
    step_temporaries: Optional[KindRow] = None

    def worst_kind(self) -> KindRow:
        """The kind with the largest relative error of its maximum."""
        return max(self.kinds, key=lambda r: abs(r.rel_error))


def _meshplan_kinds(by_kind: dict) -> dict:
    """meshplan kinds as the tracker can see them: ``master`` (none without mixed
    precision) with params, the (CPU: zero) workspace with temporaries, untracked dropped."""
    out = {k: by_kind.get(k, 0) for k in COMPARED_KINDS}
    out["params"] += by_kind.get("master", 0)
    out["temporaries"] += by_kind.get("workspace", 0)
    return out


def compare(config: Config, name: str = "", rank: int = 0, fake: bool = False) -> Comparison:
    """:func:`predict` and :func:`measure` of ``config`` side by side."""
    tl = predict(config)
    m = measure(config, rank=rank, fake=fake)
    pmax, ppeak = _meshplan_kinds(tl.max_by_kind), _meshplan_kinds(tl.peak.by_kind)
    extra = sorted(set(m.max_by_kind) - set(COMPARED_KINDS))  # "other": a category meshplan lacks
    kinds = tuple(KindRow(k, pmax.get(k, 0), m.max_by_kind.get(k, 0)) for k in COMPARED_KINDS + tuple(extra))
    at_peak = tuple(KindRow(k, ppeak.get(k, 0), m.peak_by_kind.get(k, 0)) for k in COMPARED_KINDS + tuple(extra))
    untracked = sum(tl.peak.by_kind.get(k, 0) for k in UNTRACKED_KINDS)
    return Comparison(name=name or config.model.name, kinds=kinds, at_peak=at_peak,
                      peak=KindRow("peak", tl.peak.total_bytes - untracked, m.peak_bytes),
                      where_predicted=tl.peak.where(), measured=m,
                      step_temporaries=KindRow("step temporaries", predicted_step_temporaries(tl), m.step_temp_bytes))


def table(comparisons, at_peak: bool = False) -> str:
    """Predicted vs measured, KiB: the maximum of each kind and the peak, one block per
    configuration (``at_peak``: the kinds at the peak as well)."""
    head = f"{'configuration / kind':<30} {'predicted KiB':>14} {'measured KiB':>13} {'error':>8}"
    lines = [head, "-" * len(head)]
    for c in comparisons:
        lines.append(f"{c.name}  (meshplan peak at {c.where_predicted})")
        rows = [(f"max {r.kind}", r) for r in c.kinds] + [("PEAK", c.peak)]
        rows += [("optimizer step temporaries", c.step_temporaries)] if c.step_temporaries else []
        if at_peak:
            rows += [(f"at peak: {r.kind}", r) for r in c.at_peak]
        for label, r in rows:
            lines.append(f"  {label:<28} {r.predicted_bytes / KiB:>14.1f} {r.measured_bytes / KiB:>13.1f} "
                         f"{r.rel_error:>+8.1%}")
    return "\n".join(lines)


#: The bound a validate run's kind rows are held to: each kind's maximum within 20% (the
#: loose bound of ``tests/test_memory_vs_tracker.py``: the timeline models the working set of
#: a whole layer pass, the tracker sees single ops), parameters and gradients exact.
KIND_TOLERANCE = 0.20


def memory_kind_rows(tl: Timeline, record: dict, rank: int) -> list[dict]:
    """Validate's memory rows by kind, bytes on ``rank`` (the rank of the largest peak).

    With the worker's relabelled record (``max_by_kind_bytes``, FSDP2 on CPU:
    :func:`~meshplan.runtime.execution.memtracker.relabelled_kinds`) one row per compared
    kind, each side's maximum of that kind over the step, as :func:`compare` does on the fake
    process group: like with like, since each storage has its final label (an unsharded
    gradient is ``grad_buffers``, not ``Temp``) and neither side's row depends on the moment
    of the other's peak. Without it (MemTracker, pipeline stages) the tracker's own labels at
    its peak, grouped, with a note saying the rows can disagree while the total agrees."""
    if "max_by_kind_bytes" in record:
        want, got = _meshplan_kinds(tl.max_by_kind), record["max_by_kind_bytes"]
        extra = sorted(set(got) - set(COMPARED_KINDS))
        note = ("each side's maximum of this kind over the step (meshplan's kinds; tracker storages under their "
                f"final labels, runtime.execution.memtracker.relabelled_kinds); the state and FSDP's buffers are the "
                f"same tensors on both sides, the working sets expected within {KIND_TOLERANCE:.0%}")
        at = lambda k: (f"; measured max in {record['max_by_kind_phase'][k]}"
                        if k in record.get("max_by_kind_phase", {}) else "")
        rows = [_kind_row(f"memory max: {k}", want.get(k, 0), got.get(k, 0), rank,
                          note + _KIND_NOTES.get(k, "") + at(k)) for k in COMPARED_KINDS]
        return rows + [_kind_row(f"memory max: {k}", None, got[k], rank, _EXTRA_NOTES.get(k, "a category meshplan "
                                 "lacks: not predicted")) for k in extra]
    if "by_category_bytes" not in record:
        return []
    got, want = tracker_to_kinds(record["by_category_bytes"]), tl.by_group()
    note = ("at each side's own peak, the tracker's own labels (it labels unsharded gradients and gathered "
            "parameters late: the rows can disagree while the total agrees)")
    return [_kind_row(f"peak memory: {g}", want.get(g), sum(got.get(k, 0) for k in kinds), rank, note)
            for g, kinds in COMPARISON_GROUPS.items()]


#: What a kind's row leaves out, measured on validate's CPU runs (examples/mini_2x4_tp2-dp4.toml, world 4).
_ROUTED = ("; an MoE layer's routed rows at the plan's routing (balanced unless training.moe_hottest_expert_share), "
           "the run's at its router's counts (the router rows)")
_KIND_NOTES = {"temporaries": "; the plan's working sets and the optimizer step's of training.optimizer_impl "
                              "(the worker runs that AdamW: runtime.execution.trainstep.adamw)" + _ROUTED,
               "activations": _ROUTED}
_EXTRA_NOTES = {RS_COPY_KIND: "not predicted: a temporary the size of each reduce-scatter's input that gloo's "
                             "reduce-scatter allocates (CPU runs only; absent on the fake process group, "
                             "memtracker.RS_COPY_KIND); without it temporaries compare like with like"}


def params_gate(rows: list[dict]) -> list[str]:
    """One line when the ``memory max: params`` row (the relabelled FSDP2 record) is more than
    :data:`KIND_TOLERANCE` off the plan either way; empty otherwise or without the row. The
    parameters are state, the same tensors on both sides (equal to the byte on the FSDP2 runs
    tests/test_validate_memory_kinds.py and tests/test_validate_moe.py check), so a larger error
    is a rank holding other parameters than the plan (or a tensor the tracker does not see as
    one), not noise: always gated, as the checkpoint bytes are.
    Before ``memtracker.outside_fsdp`` the experts at efsdp 1 were never labelled: -95% at world
    2 of tests/data/validate_mixtral_ep2_fsdp.toml, and the run PASSED.

    >>> params_gate([dict(quantity="memory max: params", unit="B", predicted=23_210_496,
    ...                   measured=1_190_400, error=1_190_400 / 23_210_496 - 1)])
    ['memory max: params: measured 1.19e+06 B vs predicted 2.321e+07 (-95%, tolerance 20%): the rank holds other parameters than the plan']
    """
    return [f"{r['quantity']}: measured {r['measured']:.4g} {r['unit']} vs predicted {r['predicted']:.4g} "
            f"({r['error']:+.0%}, tolerance {KIND_TOLERANCE:.0%}): the rank holds other parameters than the plan"
            for r in rows if r["quantity"] == "memory max: params" and r.get("error") is not None
            and abs(r["error"]) > KIND_TOLERANCE]


def _kind_row(quantity: str, predicted, measured: int, rank: int, note: str) -> dict:
    return dict(quantity=quantity, unit="B", predicted=predicted, measured=measured, measured_min=None, rank=rank,
                error=(measured / predicted - 1) if predicted else None, note=note)
