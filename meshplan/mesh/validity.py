"""Validity of a resolved mesh against the model and the training contract.

Every failure is a one-line reason with the numbers; every convention applied (KV-head
replication, vocabulary padding, batch arithmetic) is a note, so the output says which
convention it uses. The rules and their texts are the axes' own (one module per axis under
:mod:`meshplan.spec.axes`; the search evaluates the same predicates on all candidates at
once, :func:`meshplan.search.reasons.first_reason`); this module runs them in order. Batch arithmetic: ``dp`` is replicate x shard only, without cp
(handed case C1): micro-batches per step = global_batch / (micro_batch * dp). The pipeline
schedule's own rules (e.g. interleaved 1F1B's m a multiple of pp) are its module's
(:meth:`meshplan.pipeline.base.PipelineSchedule.reasons`); the plan appends them.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import isqrt

from meshplan.errors import ConfigError
from meshplan.limits import MAX_MICRO_BATCHES, MAX_PIPELINE_UNITS, over
from meshplan.mesh.resolve import Mesh, given_pairs
from meshplan.mesh.layers import VirtualStage, looped, stage_layers, vpp_from_chunk
from meshplan.spec.axes import KNOWN_AXES
from meshplan.spec.axes.base import AxisDegrees
from meshplan.spec.axes.dp import micro_batches
from meshplan.spec.axes.registry import rules
from meshplan.spec.axes.tp import TP
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec


@dataclass(frozen=True)
class Validity:
    """``reasons``: why the mesh is infeasible (empty if valid); ``notes``: conventions
    applied; ``stages``: layers per stage per chunk (None when invalid);
    ``micro_batches``: per optimizer step per dp rank (0 when invalid)."""

    reasons: tuple[str, ...]
    notes: tuple[str, ...]
    stages: list[list[list[int]]] | None
    micro_batches: int
    vpp: int


def degrees(mesh: Mesh, training: TrainingSpec, vpp: int) -> AxisDegrees:
    """The degrees the axis rules read (:class:`~meshplan.spec.axes.base.AxisDegrees`) of
    ``mesh``: ``dps`` is the mesh's shard axis (dp_shard, or dp when the mesh names one data
    axis), so dps x cp x tp is the dense block the experts re-factor; axes of the mesh that
    are not among the attributes (user-named or newly registered) go to ``extra``."""
    cp, tp = mesh.degree("cp"), mesh.degree("tp")
    extra = {n: mesh.degree(n) for n in mesh.layout.names if n not in KNOWN_AXES}
    return AxisDegrees(pp=mesh.degree("pp"), dpr=mesh.degree("dp_replicate"), dps=mesh.block_size // (cp * tp),
                       dp=mesh.dp, cp=cp, tp=tp, ep=mesh.ep, etp=mesh.etp, mb=training.micro_batch, vpp=vpp,
                       sp=mesh.sequence_parallel, extra=extra)


def check(model: ModelSpec, training: TrainingSpec, mesh: Mesh, spec: MeshSpec,
          virtual_stage: VirtualStage = looped) -> Validity:
    """All model and batch checks of ``mesh``: every registered axis's rules in their order
    (:func:`meshplan.spec.axes.registry.rules`), the layer split where the pp rule stands,
    then the limits on micro-batches and pipeline units; see the module docstring."""
    reasons: list[str] = []
    notes: list[str] = []
    pp = mesh.degree("pp")
    stages, vpp = None, spec.virtual_stages
    d = degrees(mesh, training, vpp)
    for rule in rules():
        if rule.key == "layers":  # the exact split (pp_layer_split, layers_per_virtual_stage), not the search form
            stages, vpp = _stages(model, spec, pp, reasons, virtual_stage)
        elif rule.check is not None:
            r, n = rule.check(model, training, d)
            reasons += r
            notes += n
    micro = micro_batches(training.global_batch, training.micro_batch, mesh.dp)
    if micro > MAX_MICRO_BATCHES:
        reasons.append(f"{micro} micro-batches per step: {over('micro-batches', micro)}; raise training.micro_batch "
                       f"or the data-parallel degree")
    elif pp * vpp * micro > MAX_PIPELINE_UNITS:
        reasons.append(f"pp {pp} x vpp {vpp} x {micro} micro-batches = {pp * vpp * micro} pipeline units: "
                       f"{over('pipeline units', pp * vpp * micro)}; raise training.micro_batch or the data-parallel "
                       f"degree")
    return Validity(tuple(reasons), tuple(notes), stages if not isinstance(stages, str) else None, micro, vpp)


def unresolved_reasons(model: ModelSpec, training: TrainingSpec, spec: MeshSpec) -> tuple[str, ...]:
    """Why the tp ``spec`` gives cannot split ``model`` whatever the world: the tp axis's own rules
    (heads, torch_kv_heads, ffn and, with sequence parallelism and cp given, seq_tp:
    :data:`meshplan.spec.axes.tp.TP`) at that tp, for a mesh whose -1 the other degrees leave
    nothing to infer (empty for any other mesh, or a tp of -1). Such a mesh is the mesh's fault,
    infeasible (exit 1), before it is malformed input: docs/commands.md "Exit codes", "degrees that
    do not divide the model ... are the mesh's" (newcomer trial nc55 #3: tp 3 of a 64-head model on
    512 GPUs was exit 2 from a torchtitan file, exit 1 on 24 GPUs).

    >>> m = ModelSpec(layers=80, hidden=8192, ffn=28672, q_heads=64, kv_heads=8, vocab=128256)
    >>> t = TrainingSpec(global_batch=512, seq_len=8192)
    >>> unresolved_reasons(m, t, MeshSpec(names=["dp_shard", "tp"], shape=[-1, 3]))
    ('q_heads 64 is not divisible by tp 3', 'ffn 28672 is not divisible by tp 3')
    >>> unresolved_reasons(m, t, MeshSpec(names=["dp_shard", "tp"], shape=[-1, 8]))
    ()
    """
    pairs = dict(given_pairs(spec))
    tp, cp = pairs.get("tp", 1), pairs.get("cp", 1)
    if -1 not in pairs.values() or tp < 2:
        return ()
    d = AxisDegrees(pp=1, dpr=1, dps=1, dp=1, cp=max(cp, 1), tp=tp, ep=1, etp=1, mb=training.micro_batch, vpp=1,
                    sp=spec.sequence_parallel and cp != -1)
    out: list[str] = []
    for rule in TP.rules:
        if rule.check is not None:
            out += rule.check(model, training, d)[0]
    return tuple(out)


def _stages(model, spec, pp, reasons, virtual_stage):
    vpp = spec.virtual_stages
    if spec.layers_per_virtual_stage:
        vpp = vpp_from_chunk(model.layers, pp, spec.layers_per_virtual_stage)
        if isinstance(vpp, str):
            reasons.append(vpp)
            return None, 1
    stages = stage_layers(model.layers, pp, vpp, spec.pp_layer_split, virtual_stage)
    if isinstance(stages, str):
        reasons.append(stages)
        return None, vpp
    return stages, vpp


def input_error(model: ModelSpec, training: TrainingSpec, mesh: Mesh, spec: MeshSpec) -> ConfigError | None:
    """The input error of a config whose fields restate a count other fields fix and get it
    wrong (None when they agree): ``mesh.pp_layer_split`` must partition the model's layers
    (pp or pp x vpp entries, none negative, summing to ``model.layers``), and
    ``training.global_batch`` must be a whole number of ``micro_batch x dp`` sequences. The
    CLI refuses them as malformed input (exit 2, naming the field and the values that work);
    :func:`check` keeps them as reasons, so the search rejects generated candidates (rule
    ``batch``) as it rejects any other.

    >>> from meshplan.spec.mesh import MeshSpec as S
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> m, t = ModelSpec(layers=30, hidden=64, ffn=64, q_heads=4, vocab=8), TrainingSpec(global_batch=1000, seq_len=8)
    >>> spec = S(names=["pp", "dp"], shape=[4, 2], pp_layer_split=[8, 8, 8, 8])
    >>> print(input_error(m, t, resolve_mesh(spec, 8), spec))
    mesh.pp_layer_split: [8, 8, 8, 8] sums to 32, but the model has 30 layers: give 4 entries summing to 30, e.g. [7, 8, 8, 7]
    >>> spec = S(names=["dp"], shape=[256])
    >>> print(input_error(m, t, resolve_mesh(spec, 256), spec))
    training.global_batch: 1000 is not divisible by micro_batch 1 x dp 256 = 256; use a multiple of 256 (768 or 1024)
    >>> print(input_error(m, t.model_copy(update={"global_batch": 64, "micro_batch": 3}), resolve_mesh(S(names=["dp"], shape=[8]), 8), S(names=["dp"], shape=[8])))
    training.global_batch: 64 is not divisible by micro_batch 3 x dp 8 = 24; use a multiple of 24 (48 or 72), or micro_batch 2 or 4
    """
    split, pp, layers = spec.pp_layer_split, mesh.degree("pp"), model.layers
    if split:
        vpp = spec.virtual_stages
        what = (f"has {len(split)} entries for pp {pp}" + (f" (or {pp * vpp}, one per virtual stage)" if vpp > 1 else "")
                if len(split) not in (pp, pp * vpp) else
                f"sums to {sum(split)}, but the model has {layers} layers" if sum(split) != layers else
                "has a negative entry" if min(split) < 0 else "")
        if what:
            return ConfigError("mesh.pp_layer_split", f"{split} {what}: give {pp} entries summing to {layers}, e.g. "
                               f"{even_split(layers, pp)}")
    gb, mb, dp = training.global_batch, training.micro_batch, mesh.dp
    q = mb * dp
    if gb % q == 0:
        return None
    near = nearest_multiples(gb, q)
    per = gb // dp if gb % dp == 0 else 0  # sequences per dp rank: micro_batch must divide it
    small = [k for k in range(1, isqrt(per) + 1) if per % k == 0]
    mbs = sorted({d for k in small for d in (k, per // k)}, key=lambda k: (abs(k - mb), k))[:2]
    alt = f", or micro_batch {' or '.join(map(str, sorted(mbs)))}" if mbs else ""
    return ConfigError("training.global_batch", f"{gb} is not divisible by micro_batch {mb} x dp {dp} = {q}; use a "
                       f"multiple of {q} ({' or '.join(map(str, near))}){alt}")


def nearest_multiples(n: int, q: int) -> list[int]:
    """The positive multiples of ``q`` either side of ``n`` (the ``use a multiple of`` of a batch
    that does not divide).

    >>> nearest_multiples(1000, 256), nearest_multiples(256, 512)
    ([768, 1024], [512])
    """
    return [m for m in ((n // q) * q, (n // q + 1) * q) if m > 0]


def even_split(layers: int, pp: int) -> list[int]:
    """``layers`` over ``pp`` stages as evenly as possible, the extra layers on the middle
    stages (the first and last stage also hold the embedding and the output layer).

    >>> even_split(30, 4), even_split(32, 4), even_split(7, 2)
    ([7, 8, 8, 7], [8, 8, 8, 8], [4, 3])
    """
    base, extra = divmod(layers, pp)
    middle_first = sorted(range(pp), key=lambda k: (-min(k, pp - 1 - k), k))[:extra]
    return [base + (k in middle_first) for k in range(pp)]
