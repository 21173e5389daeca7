"""Validity of a resolved mesh against the model and the training contract.

Every failure is a one-line reason with the numbers; every convention applied (KV-head
replication, vocabulary padding, batch arithmetic) is a note, so the output says which
convention it uses. Batch arithmetic: ``dp`` is replicate x shard only, without cp
(handed case C1): micro-batches per step = global_batch / (micro_batch * dp). The pipeline
schedule's own rules (e.g. interleaved 1F1B's m a multiple of pp) are its module's
(:meth:`meshplan.pipeline.base.PipelineSchedule.reasons`); the plan appends them.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.limits import MAX_MICRO_BATCHES, MAX_PIPELINE_UNITS, over
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.layers import VirtualStage, looped, stage_layers, vpp_from_chunk
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.mesh.tpsplit import heads_reason, local_heads, padded_vocab


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


def check(model: ModelSpec, training: TrainingSpec, mesh: Mesh, spec: MeshSpec,
          virtual_stage: VirtualStage = looped) -> Validity:
    """All model and batch checks of ``mesh``; see the module docstring."""
    reasons: list[str] = []
    notes: list[str] = []
    tp, cp, pp = mesh.degree("tp"), mesh.degree("cp"), mesh.degree("pp")
    _heads(model, tp, reasons, notes)
    _widths(model, mesh, reasons)
    v = padded_vocab(model.vocab, training.vocab_pad_divisor, tp)
    if v != model.vocab:
        notes.append(f"vocab padded {model.vocab} -> {v} = ceil(V / ({training.vocab_pad_divisor} * tp {tp})) "
                     f"* {training.vocab_pad_divisor * tp} ({v // tp} per tp rank); memory and FLOPs use "
                     f"{v}, the loss uses {model.vocab}")
    stages, vpp = _stages(model, spec, pp, reasons, virtual_stage)
    _experts(model, training, mesh, reasons, notes)
    _sequence(training, mesh, cp, tp, reasons, notes)
    micro = _batch(training, mesh, reasons, notes)
    if micro > MAX_MICRO_BATCHES:
        reasons.append(f"{micro} micro-batches per step: {over('micro-batches', micro)}; raise training.micro_batch "
                       f"or the data-parallel degree")
    elif pp * vpp * micro > MAX_PIPELINE_UNITS:
        reasons.append(f"pp {pp} x vpp {vpp} x {micro} micro-batches = {pp * vpp * micro} pipeline units: "
                       f"{over('pipeline units', pp * vpp * micro)}; raise training.micro_batch or the data-parallel "
                       f"degree")
    return Validity(tuple(reasons), tuple(notes), stages if not isinstance(stages, str) else None, micro, vpp)


def _heads(model, tp, reasons, notes):
    r = heads_reason(model, tp)
    if r:
        reasons.append(r)
        return
    q, kv, rep = local_heads(model, tp)
    if rep > 1:
        notes.append(f"kv_heads {model.n_kv_heads} < tp {tp}: KV heads replicated {rep}x (tp ranks "
                     f"{{{rep}i..{rep}i+{rep - 1}}} hold KV head i; the model still has {model.n_kv_heads} "
                     f"KV heads); each rank holds {q} q heads and {kv * model.d_head} K and V features")


def _widths(model, mesh, reasons):
    tp, etp = mesh.degree("tp"), mesh.etp
    if model.ffn % tp and (not model.is_moe or model.dense_layers):
        reasons.append(f"ffn {model.ffn} is not divisible by tp {tp}")
    if model.is_moe and model.moe_ffn % etp:
        reasons.append(f"expert_ffn {model.moe_ffn} is not divisible by etp {etp}")


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


def _experts(model, training, mesh, reasons, notes):
    if mesh.ep > 1 and not model.is_moe:
        reasons.append(f"ep {mesh.ep} on a dense model ({model.name} has no experts)")
    elif model.is_moe and model.experts % mesh.ep:
        reasons.append(f"experts {model.experts} are not divisible by ep {mesh.ep}")
    elif model.is_moe:
        _token_split(training, mesh, reasons)
        notes.append(f"experts: {model.experts} / ep {mesh.ep} = {model.experts // mesh.ep} per rank; "
                     f"expert mesh efsdp {mesh.degree('efsdp')} x ep {mesh.ep} x etp {mesh.etp}")


def _token_split(training, mesh, reasons):
    """The tp ranks split a micro-batch's ``b * s/cp`` tokens ``tp/etp`` ways before routing
    (:mod:`meshplan.runtime.execution.moe`): an uneven split gives the ranks different token
    counts, so ranks sizing their expert capacity from them would send all-to-alls of
    different sizes and hang; the split must be even."""
    tp, etp, cp = mesh.degree("tp"), mesh.etp, mesh.degree("cp")
    tok = training.micro_batch * (training.seq_len // cp)
    if tp > etp and (tok * etp) % tp:
        reasons.append(f"MoE: micro_batch x seq_len / cp = {tok} tokens do not split evenly over tp {tp} / etp "
                       f"{etp} = {tp // etp} ranks before routing; the ranks would size different expert "
                       "capacities and hang on mismatched all-to-all shapes")


def _sequence(training, mesh, cp, tp, reasons, notes):
    s = training.seq_len
    if cp > 1:
        if s % (2 * cp):
            reasons.append(f"seq_len {s} is not divisible by 2 * cp ({2 * cp}) for load-balanced causal CP")
        else:
            notes.append(f"cp {cp}: each rank holds {s // cp} tokens per sequence as 2 chunks of {s // (2 * cp)} "
                         f"(load-balanced causal split)")
    if mesh.sequence_parallel and (s // max(cp, 1)) % tp:
        reasons.append(f"sequence parallel: local seq {s // cp} (seq_len {s} / cp {cp}) is not divisible by tp {tp}")


def _batch(training, mesh, reasons, notes) -> int:
    dp, mb, gb = mesh.dp, training.micro_batch, training.global_batch
    if gb % (mb * dp):
        reasons.append(f"global_batch {gb} is not divisible by micro_batch {mb} * dp {dp} = {mb * dp}")
        return 0
    m = gb // (mb * dp)
    notes.append(f"micro-batches per step = global_batch {gb} / (micro_batch {mb} * dp {dp}) = {m} "
                 f"(dp = replicate x shard, cp excluded)")
    return m
