"""The notes ``meshplan search`` prints on the config's settings that apply to some
candidates only (:mod:`meshplan.search.driver`): where ``training.grad_accumulation``,
``fp8_all_gather``, the DeepSpeed and Megatron-LM engine knobs, ``pp_schedule_runs`` or
recompute ``op`` do not apply, the candidates planned without them, and the fix where a
setting rejects a whole sharding (zero1 under torch).
"""

from __future__ import annotations

import numpy as np

from meshplan.config import Config
from meshplan.search.candidate import accumulates
from meshplan.search.columns import FSDP_SHARDINGS, SHARDING, ZERO12, Candidates
from meshplan.search.reasons import zero1_refused
from meshplan.search.space_recompute import layer_for_op


def settings_notes(cfg: Config, c: Candidates) -> list[str]:
    """Where ``training.grad_accumulation``, ``training.fp8_all_gather``, ``training.zero3_engine`` or
    ``training.pp_schedule_runs`` does not apply to
    every candidate (:func:`meshplan.search.candidate.candidate_config`), one line saying how those
    candidates were planned; where ``recompute = "op"`` is searched on some candidates only (cp = 1:
    :func:`meshplan.search.space_recompute.op_recompute_ok`), one line saying so; under torchtitan, that
    ``selective`` is not searched (:func:`meshplan.search.space_recompute.searched_recompute`), or, where
    ``[search] recompute`` lists it, that it is searched (plan accepts it under torch, so the
    search does not refuse it) and what torchtitan runs of it."""
    t, out = cfg.training, []
    fsdp = np.isin(c.sh, FSDP_SHARDINGS)
    if t.grad_accumulation != "sync" and not accumulates(cfg, c.pp, c.sh).all():
        out.append(f"training.grad_accumulation {t.grad_accumulation!r} applies to candidates with pp 1 and FSDP "
                   "(zero3, hsdp); the others are planned with 'sync' (with pp > 1 torch.distributed.pipelining "
                   "reduces once per step itself; ZeRO-1 reduces once per step)")
    if cfg.memory.fsdp_reduce is not None:
        out.append(f"[memory] fsdp_reduce {cfg.memory.fsdp_reduce!r} is not searched: each candidate reduces as its "
                   "pp and grad_accumulation say (after the last micro-batch with pp > 1, as "
                   "torch.distributed.pipelining does)")
    out += _engine_notes(cfg, c) + _recompute_notes(cfg, c)
    if t.pp_schedule_runs > 1:
        out.append(f"training.pp_schedule_runs {t.pp_schedule_runs} applies to candidates with pp > 1: each runs its "
                   f"micro-batches as {t.pp_schedule_runs} pipeline schedules (a candidate whose micro-batches it does "
                   "not divide is rejected); with pp 1 it changes nothing")
    if (t.overlap_grad_reduce or t.overlap_param_gather) and not (c.sh == SHARDING.index("zero1")).all():
        out.append("training.overlap_grad_reduce and overlap_param_gather are Megatron-LM's DDP-buffer flags (zero1 "
                   "candidates); the others are planned without them (Megatron FSDP forces its own overlap)")
    if t.fp8_all_gather and not (fsdp & (c.dps > 1)).all():
        out.append("training.fp8_all_gather applies to FSDP candidates (zero3, hsdp) with dp_shard > 1 (torchtitan's "
                   "dp_shard_enabled; at dp_shard 1 FSDP gathers over cp in the compute dtype); zero1 candidates "
                   "gather no parameters with FSDP2; the others are planned without it (their Linear GEMMs still in fp8)")
    return out


def _engine_notes(cfg: Config, c: Candidates) -> list[str]:
    """:func:`settings_notes`' lines on the engines: where ``training.zero3_engine``,
    ``zero0_engine`` or ``zero12_engine`` does not apply to every candidate's sharding, how those
    candidates were planned (hsdp candidates with FSDP2, named only where searched); zero1
    rejected under torch (:func:`~meshplan.search.reasons.zero1_refused`)."""
    t, out = cfg.training, []
    hsdp = ", hsdp candidates with FSDP2" if (c.sh == SHARDING.index("hsdp")).any() else ""  # only what is searched
    if t.zero3_engine == "deepspeed" and not (c.sh == SHARDING.index("zero3")).all():
        out.append("training.zero3_engine 'deepspeed' applies to zero3 candidates with pp 1; zero1 and zero2 "
                   "candidates are planned with DeepSpeed's ZeRO-1/2 (zero12_engine 'deepspeed': the same runtime at "
                   "another zero_optimization.stage)" + hsdp)
    elif t.zero3_engine != "fsdp2" and not (c.sh == SHARDING.index("zero3")).all():
        out.append(f"training.zero3_engine {t.zero3_engine!r} applies to zero3 candidates with pp 1; zero1 and hsdp "
                   "candidates are planned with FSDP2")
    if t.zero0_engine == "deepspeed":
        out.append("training.zero0_engine 'deepspeed' (DeepSpeed without ZeRO, stage 0) is not a search row: the "
                   "search has no unsharded candidate (meshplan plan plans it); zero1 and zero2 candidates are planned "
                   "with DeepSpeed's ZeRO-1/2 and zero3 with its ZeRO-3 (zero_optimization.stage 1, 2, 3 of the same "
                   "runtime)" + hsdp)
    if t.zero12_engine != "megatron" and not np.isin(c.sh, ZERO12).all():
        out.append(f"training.zero12_engine {t.zero12_engine!r} applies to zero1 and zero2 candidates (DeepSpeed's "
                   "ZeRO-1 and ZeRO-2: bucket all-reduces, ranked by the Megatron-style estimate, planned exactly as "
                   "DeepSpeed runs them); zero3 candidates are planned with DeepSpeed's ZeRO-3 (zero3_engine "
                   "'deepspeed', pp 1)" + hsdp)
    if "zero1" in cfg.search.sharding and zero1_refused(t) and (c.sh == SHARDING.index("zero1")).any():
        out.append("zero1 is rejected under training.framework \"torch\" (rule 'framework'): torch and torchtitan "
                   "have no engine that shards the optimizer state alone; set training.zero12_engine = \"deepspeed\" "
                   "(DeepSpeed's ZeRO-1) or framework = \"megatron\" (its distributed optimizer) to search it")
    return out


def _recompute_notes(cfg: Config, c: Candidates) -> list[str]:
    """:func:`settings_notes`' lines on recompute under torch: ``selective`` not searched (or searched
    because ``[search] recompute`` lists it, and what torchtitan runs of it); ``op`` searched on
    candidates with cp = 1 only (:func:`meshplan.search.space_recompute.op_recompute_ok`), with
    ``layer`` beside it where :func:`~meshplan.search.space_recompute.layer_for_op` adds it."""
    t, out = cfg.training, []
    if t.has_op_recompute and "selective" in cfg.search.recompute and "recompute" not in cfg.search.model_fields_set:
        out.append("recompute 'selective' is not searched under training.framework \"torch\": it is Megatron-LM's "
                   "core-attention recompute, which torchtitan has no option for; searched: none, op (torchtitan's "
                   "op-level selective AC) and full; torchtitan's per-layer selective AC ('layer', every 2nd layer, "
                   "its default) with ep > 1 or multi-head latent attention, beside op, and elsewhere "
                   "where [search] recompute lists it (not by default: it adds about 25% to a dense search's time)")
    elif t.has_op_recompute and "selective" in cfg.search.recompute:  # listed: searched, as plan accepts it under torch
        out.append("recompute 'selective' is searched because [search] recompute lists it: Megatron-LM's "
                   "core-attention recompute, which meshplan plan accepts under training.framework \"torch\" but "
                   "torchtitan has no option for (--export --to torchtitan writes such a row as mode \"none\", "
                   "\"full\" without flash attention); for torchtitan's own options list none, op, layer, full")
    if "op" in cfg.search.recompute and t.has_op_recompute and (c.cp > 1).any():
        out.append("recompute 'op' (torchtitan's op-level selective AC) is searched on candidates with cp = 1 "
                   "only (any tp, ep, multi-head latent attention too): with cp > 1 plan refuses it (which CP "
                   "collectives its replay runs is not modelled)"
                   + ("; with ep > 1 or multi-head latent attention 'layer' (every 2nd layer in full) is searched "
                      "beside it" if layer_for_op(cfg) and ((c.ep > 1).any() or cfg.model.is_mla) else ""))
    return out
