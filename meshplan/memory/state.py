"""Persistent model state per rank: parameters, gradients, fp32 master copy, optimizer state.

Two accountings are kept apart and labelled:

- **framework accounting** (:func:`state_bytes`, :func:`stage_state_bytes`): exact
  per-rank element counts from the model's tensors (:meth:`ModelSpec.layer_tensors` and
  friends, split by :func:`~meshplan.mesh.tpsplit.local_numel`) times the dtypes of the
  :class:`TrainingSpec`;
- closed-form estimates, in :mod:`meshplan.memory.state_estimates`: **textbook accounting
  (ZeRO paper)** (:func:`~meshplan.memory.state_estimates.zero_textbook_bytes`) and
  **Megatron's estimate** (:func:`~meshplan.memory.state_estimates.megatron_estimate`).

Conventions (framework accounting):

- Stage 0 holds the input embedding; the last stage holds the final norm and the output
  layer. With tied embeddings and pp > 1 the last stage keeps its own copy of the output
  weight (Megatron convention); with pp == 1 a tied output is counted once.
- The vocabulary is padded: ``padded_vocab(model.vocab, training.vocab_pad_divisor, tp)``.
- Dense tensors are split by tp, expert tensors by ep x etp (``local_numel``).
- Which state is sharded over data parallelism: ``none`` nothing; ``zero1`` master and
  optimizer; ``zero2`` + gradients; ``zero3`` and ``hsdp`` + parameters.
- Dense state is sharded over the ``fsdp`` axis (dp_shard x cp, or dp x cp for a mesh with
  a single ``dp`` axis; dp_replicate never shards). Expert state is sharded over ``efsdp``
  = (dp_shard x cp x tp) / (ep x etp) (torchtitan ``ParallelDims``). Megatron-Core shards
  expert optimizer state over expert-data-parallel = world / (etp x ep x pp), which is
  dp_replicate x efsdp: the two agree when dp_replicate is 1; with dp_replicate > 1
  meshplan treats dp_replicate as replicas of the sharded state for dense and expert
  alike (Megatron's ``num_distributed_optimizer_instances``).
- A shard of n elements over d ranks holds ``ceil(n / d)`` elements on the most loaded
  rank, taken over the stage's flat buffer of each group (dense, expert), as Megatron's
  distributed optimizer pads its contiguous buffer. (FSDP2 pads each tensor's sharded dim
  instead, which can add up to d - 1 rows per tensor; not modelled. The routed experts'
  sharded dim is torchtitan's, dim 1 past efsdp x ep > experts
  (:func:`~meshplan.mesh.tpsplit.fsdp_shard_len`), so e.g. one Mixtral expert per rank over
  efsdp 4 pads nothing and its shard is this count, as the collective table's all-gather.)
- Transient state (ZeRO-3 all-gathered parameters, reduce-scatter buffers) is not
  persistent and belongs to the memory timeline, not here.

Worked example (handed case C9: tiny GPT at tp 2, pp 2, dp 4, sharded optimizer):

>>> from meshplan.spec.model import ModelSpec
>>> from meshplan.spec.training import TrainingSpec
>>> from meshplan.spec.mesh import MeshSpec
>>> from meshplan.mesh.resolve import resolve_mesh
>>> from meshplan.mesh.layers import stage_layers
>>> tiny = ModelSpec(layers=4, hidden=16, ffn=64, gated_mlp=False, q_heads=4, vocab=32,
...                  tied_embeddings=True, norm="layernorm")
>>> mesh = resolve_mesh(MeshSpec(names=["pp", "dp", "tp"], shape=[2, 4, 2]), world=16)
>>> train = TrainingSpec(global_batch=8, seq_len=16, sharding="zero1", vocab_pad_divisor=1)
>>> [p.total for p in stage_params(tiny, mesh, train, stage_layers(4, 2))]
[3456, 3488]
>>> top = most_loaded(state_bytes(tiny, mesh, train, stage_layers(4, 2)))
>>> top.stage, top.total_bytes, top.bytes_per_param("dense")
(1, 31392, 9.0)
>>> print("\\n".join(top.lines()))
stage 1, framework accounting (explicit dtypes): 3488 params per rank
  layers 3072, norms 160, embedding 0, output 256 (tied copy)
  params dense: 3488 x 2 B = 6976 B (not sharded)
  grads dense: 3488 x 4 B = 13952 B (not sharded)
  master dense: ceil(3488 / fsdp 4) = 872 x 4 B = 3488 B
  optimizer dense: ceil(3488 / fsdp 4) = 872 x 8 B = 6976 B
  total 31392 B
>>> from meshplan.memory.state_estimates import megatron_estimate
>>> megatron_estimate(tiny, mesh, train).size_bytes
30600.0
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Optional, Union

from meshplan.compute.shapes import local_split
from meshplan.errors import ConfigError
from meshplan.mesh.layers import last_stage
from meshplan.mesh.resolve import Mesh
from meshplan.spec.axes.base import Dim
from meshplan.spec.model import ModelSpec, Tensor
from meshplan.spec.training import TrainingSpec
from meshplan.mesh.tpsplit import local_numel, padded_vocab
from meshplan.memory import te_fp8
from meshplan.memory.offload import gpu_offloaded_kinds
from meshplan.units import dtype_bytes

FRAMEWORK_LABEL = "framework accounting (explicit dtypes)"

#: State kinds sharded over data parallelism, per ``TrainingSpec.sharding``.
SHARDED_KINDS = {
    "none": (),
    "zero1": ("master", "optimizer"),
    "zero2": ("master", "optimizer", "grads"),
    "zero3": ("master", "optimizer", "grads", "params"),
    "hsdp": ("master", "optimizer", "grads", "params"),
}
#: Data-parallel axis that shards each parameter group.
SHARD_AXIS = {"dense": "fsdp", "expert": "efsdp"}
STATE_KINDS = ("params", "grads", "master", "optimizer")


@dataclass(frozen=True)
class StageParams:
    """Parameters held by ONE rank of pipeline stage ``stage``, before data-parallel sharding.

    Counts are elements: ``layer_params`` (transformer-layer weights other than norms, dense
    and expert), ``norm_params`` (layer norms, qk-norms and the final norm, replicated over
    tp), ``embedding_params`` (input and learned position embeddings, stage 0),
    ``output_params`` (output layer on the last stage; ``tied_copy`` when it is the copy of
    a tied embedding). ``expert_params`` is the part of ``layer_params`` split by ep x etp;
    ``fp8_params`` the part that is Transformer Engine's fp8 linear weights (framework megatron
    with ``linear_dtype = "fp8"``: :func:`meshplan.memory.te_fp8.is_weight`), dense.
    """

    stage: int
    layer_ids: tuple[int, ...]
    layer_params: int
    norm_params: int
    embedding_params: int
    output_params: int
    expert_params: int
    tied_copy: bool = False
    fp8_params: int = 0

    @property
    def total(self) -> int:
        return self.layer_params + self.norm_params + self.embedding_params + self.output_params

    @property
    def dense(self) -> int:
        return self.total - self.expert_params

    def count(self, group: str) -> int:
        """Elements of ``group`` ("dense" or "expert")."""
        return self.expert_params if group == "expert" else self.dense


def _is_norm(t: Tensor) -> bool:
    return "norm" in t.name  # attn_norm, mlp_norm, q_norm, final_norm and their biases


def stage_params(model: ModelSpec, mesh: Mesh, training: TrainingSpec,
                 stages: Union[list, str]) -> list[StageParams]:
    """Exact parameters per rank for each stage of ``stages`` (``pipeline.stage_layers``:
    ``stages[k][chunk] = [layer, ...]``). Raises ConfigError if ``stages`` is a reason."""
    if isinstance(stages, str):
        raise ConfigError("pipeline", stages)
    split = local_split(mesh)  # the tensor dims the registered axes divide (heads, ffn and vocab: one tp)
    tp, ep, etp = split[Dim.HEADS], split[Dim.EXPERTS], split[Dim.EXPERT_FFN]
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, split[Dim.VOCAB])
    pp = len(stages)
    out = []
    per_layer: dict[bool, dict[str, int]] = {}  # a layer's tensors differ only by is_moe_layer
    moe_of: dict[int, bool] = {}
    last = last_stage(stages)  # the output layer's stage (0 under a V)
    for k, chunks in enumerate(stages):
        ids = tuple(i for chunk in chunks for i in chunk)
        counts = {"layer": 0, "norm": 0, "expert": 0, "fp8": 0, "embedding": 0, "output": 0}
        n_moe = 0
        for i in ids:
            if i not in moe_of:
                moe_of[i] = model.is_moe_layer(i)
                if moe_of[i] not in per_layer:
                    per_layer[moe_of[i]] = _layer_counts(model, i, tp, ep, etp, training)
            n_moe += moe_of[i]
        for moe, n_layers in ((False, len(ids) - n_moe), (True, n_moe)):  # integer sums: n x one layer's counts
            for key, n in per_layer.get(moe, {}).items():
                counts[key] += n_layers * n
        if k == 0:
            counts["embedding"] = sum(local_numel(t, model, tp) for t in model.embedding_tensors(pv))
        tied_copy = False
        if k == last:
            for t in model.head_tensors(pv):
                if _is_norm(t):
                    counts["norm"] += local_numel(t, model, tp)
                elif not t.tied or pp > 1:
                    counts["output"] += local_numel(t, model, tp)
                    tied_copy = t.tied
        out.append(StageParams(stage=k, layer_ids=ids, layer_params=counts["layer"],
                               norm_params=counts["norm"], embedding_params=counts["embedding"],
                               output_params=counts["output"], expert_params=counts["expert"],
                               tied_copy=tied_copy, fp8_params=counts["fp8"]))
    return out


def _layer_counts(model: ModelSpec, layer: int, tp: int, ep: int, etp: int, training: TrainingSpec) -> dict[str, int]:
    """Elements per rank of one transformer layer: ``layer`` (non-norm), ``norm``, ``expert``,
    ``fp8`` (Transformer Engine's fp8 linear weights, :func:`meshplan.memory.te_fp8.is_weight`)."""
    out = {"layer": 0, "norm": 0, "expert": 0, "fp8": 0}
    for t in model.layer_tensors(layer):
        n = local_numel(t, model, tp, ep, etp, training.framework)
        out["norm" if _is_norm(t) else "layer"] += n
        out["expert"] += n if t.expert else 0
        out["fp8"] += n if te_fp8.is_weight(training, t) and not t.expert else 0
    return out


@dataclass(frozen=True)
class StateItem:
    """One kind of state of one parameter group on one rank.

    ``kind``: params, grads, master or optimizer; ``group``: dense or expert; ``numel``:
    elements per rank before data-parallel sharding; ``axis``/``divisor``: the axis that
    shards it and its degree ("" and 1 when not sharded); ``bytes_per_element``: dtype
    bytes (optimizer: states x dtype bytes, 8 for Adam in fp32); ``what``: the part of the
    group where a kind is split by dtype (under ``--fp8-param-gather`` the dense parameters:
    Transformer Engine's fp8 weights at 1 B, :mod:`meshplan.memory.te_fp8`, and the rest).
    """

    kind: str
    group: str
    numel: int
    axis: str
    divisor: int
    bytes_per_element: int
    what: str = ""

    @property
    def name(self) -> str:
        """``params dense``, ``params dense (TE fp8 weights)``: kind, group and part."""
        return f"{self.kind} {self.group}" + (f" ({self.what})" if self.what else "")

    @property
    def count(self) -> int:
        """Elements on the most loaded rank: ``ceil(numel / divisor)``."""
        return ceil(self.numel / self.divisor)

    @property
    def size_bytes(self) -> int:
        return self.count * self.bytes_per_element

    def line(self) -> str:
        if self.divisor == 1:
            return (f"{self.name}: {self.numel} x {self.bytes_per_element} B = "
                    f"{self.size_bytes} B (not sharded)")
        return (f"{self.name}: ceil({self.numel} / {self.axis} {self.divisor}) = "
                f"{self.count} x {self.bytes_per_element} B = {self.size_bytes} B")


@dataclass(frozen=True)
class StateBytes:
    """Persistent state of one rank of stage ``stage``, item by item (bytes); ``params``:
    the exact counts behind it (``params.total`` elements per rank before sharding)."""

    stage: int
    params: StageParams
    items: tuple[StateItem, ...]
    label: str = FRAMEWORK_LABEL

    @property
    def total_bytes(self) -> int:
        return sum(i.size_bytes for i in self.items)

    def bytes_of(self, kind: Optional[str] = None, group: Optional[str] = None) -> int:
        """Bytes of the items matching ``kind`` and ``group`` (None matches all)."""
        return sum(i.size_bytes for i in self.items
                   if kind in (None, i.kind) and group in (None, i.group))

    def bytes_per_param(self, group: str) -> float:
        """Bytes per parameter of ``group`` on this rank (state bytes / unsharded count)."""
        n = self.params.count(group)
        return self.bytes_of(group=group) / n if n else 0.0

    def lines(self) -> list[str]:
        """Printable derivation, one line per item."""
        p = self.params
        head = [f"stage {self.stage}, {self.label}: {p.total} params per rank",
                f"  layers {p.layer_params}, norms {p.norm_params}, embedding {p.embedding_params}, "
                f"output {p.output_params}{' (tied copy)' if p.tied_copy else ''}"
                f"{f' (expert {p.expert_params} of the layers)' if p.expert_params else ''}"]
        return head + ["  " + i.line() for i in self.items] + [f"  total {self.total_bytes} B"]


def _bytes_per_element(kind: str, training: TrainingSpec) -> int:
    """Bytes per element of ``kind`` on the GPU: 0 for a kind ZeRO-Offload keeps on the host
    (:func:`meshplan.memory.offload.gpu_offloaded_kinds`; there: :mod:`meshplan.memory.offload_host`)."""
    if kind in gpu_offloaded_kinds(training):
        return 0
    if kind == "params":
        return dtype_bytes(training.param_dtype)
    if kind == "grads":
        return dtype_bytes(training.grad_dtype)
    if kind == "master":
        return training.master_bytes
    return training.optimizer_states * dtype_bytes(training.optimizer_dtype)


def stage_state_bytes(params: StageParams, mesh: Mesh, training: TrainingSpec) -> StateBytes:
    """Bytes per rank of stage ``params.stage`` by kind and group (framework accounting).

    Each item: ``ceil(numel / divisor) * bytes_per_element``; the divisor is the degree of
    ``fsdp`` (dense) or ``efsdp`` (expert) for the kinds ``training.sharding`` shards,
    else 1. Kinds with no bytes (no master copy, SGD without momentum) are left out.
    """
    return _stage_state_bytes(params, _item_specs(mesh, training))


#: The parts of the dense parameters under ``--fp8-param-gather`` (:func:`_item_specs`): TE's fp8
#: weights and the rest, each with its own bytes per element.
FP8_PART, OTHER_PART = "TE fp8 weights", "other"


def _item_specs(mesh: Mesh, training: TrainingSpec) -> tuple[tuple[str, str, str, int, int, str], ...]:
    """(group, kind, axis, divisor, bytes per element, part) of every item with bytes, in
    :func:`stage_state_bytes`'s order: what every stage of one mesh shares. ``part`` "" for the
    whole group; under ``--fp8-param-gather`` the dense parameters in two parts, :data:`FP8_PART`
    at :func:`meshplan.memory.te_fp8.param_bytes_per_element` and :data:`OTHER_PART`."""
    sharded = SHARDED_KINDS[training.sharding]
    out = []
    for group in ("dense", "expert"):
        for kind in STATE_KINDS:
            per = _bytes_per_element(kind, training)
            if per == 0:
                continue
            axis = SHARD_AXIS[group] if kind in sharded else ""
            divisor = mesh.degree(axis) if axis else 1
            axis = axis if divisor > 1 else ""
            if kind == "params" and group == "dense" and training.fp8_param_gather and te_fp8.applies(training):
                out.append((group, kind, axis, divisor, te_fp8.param_bytes_per_element(True, per), FP8_PART))
                out.append((group, kind, axis, divisor, per, OTHER_PART))
            else:
                out.append((group, kind, axis, divisor, per, ""))
    return tuple(out)


def _stage_state_bytes(params: StageParams, specs: tuple) -> StateBytes:
    numel = {"dense": params.count("dense"), "expert": params.count("expert")}
    part = {"": lambda g: numel[g], FP8_PART: lambda g: params.fp8_params,
            OTHER_PART: lambda g: numel[g] - params.fp8_params}
    items = tuple(StateItem(kind, group, part[p](group), axis, divisor, per, p if params.fp8_params else "")
                  for group, kind, axis, divisor, per, p in specs if part[p](group))
    return StateBytes(stage=params.stage, params=params, items=items)


def state_bytes(model: ModelSpec, mesh: Mesh, training: TrainingSpec,
                stages: Union[list, str]) -> list[StateBytes]:
    """:func:`stage_state_bytes` of every stage of ``stages`` (``pipeline.stage_layers``),
    one :class:`StateBytes` per stage. Raises ConfigError if ``stages`` is a reason."""
    specs = _item_specs(mesh, training)
    return [_stage_state_bytes(p, specs) for p in stage_params(model, mesh, training, stages)]


def most_loaded(states: list[StateBytes]) -> StateBytes:
    """The stage with the largest total bytes (the earliest stage on a tie)."""
    return max(states, key=lambda s: (s.total_bytes, -s.stage))


