"""A search candidate as a plan input (:func:`candidate_config`): the config with the row's mesh,
layer split, schedule and training columns, and the training fields that change with the row's
sharding and engine (:func:`sharding_knobs`, :func:`sharding_training`, which the memory bound
shares) or do not apply to it (:func:`accumulates`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.interop.torchtitan_tables import default_split
from meshplan.mesh.layers import balanced_split, ends_short_split, first_last_split
from meshplan.search.columns import FSDP_SHARDINGS, LAYER_AC_FREQ, RECOMPUTE, SHARDING, Candidates, axis_shown, candidate_schedule
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.training import TrainingSpec
from meshplan.spec.training_checks import zeropp_keys_set
from meshplan.spec.training_fields import deepspeed_grad_dtype

def torchtitan_cut(layers: int, pp: int) -> Optional[list[int]]:
    """Layers per stage as torchtitan cuts ``layers`` over ``pp`` single-stage parts by default
    (:func:`~meshplan.interop.torchtitan_tables.default_split` with its first/last stage less 1 each:
    ``layers + 2`` slots, ``(layers + 2) // pp`` a stage, the remainder one each on the first stages,
    the embedding's slot off the first and the norm + output's off the last; pytorch/torchtitan b5bcd76
    ``distributed/pipeline_parallel.py`` ``_generate_llm_fqn_per_model_part``); None where a stage
    would hold no layer. With ``r = (layers + 2) % pp`` it is :func:`~meshplan.mesh.layers.balanced_split`
    where r is 0 or 1 and :func:`ends_short_split` where r is 0 or pp - 1, neither else (pp >= 4):
    80 layers at pp 3 and 126 at pp 16 are the default (balanced) split, Llama-3-8B's 32 at pp 4 is
    [8, 9, 8, 7], which for a torchtitan file (:func:`titan_split`) is the ``us`` row's split.

    torchtitan's default cut of 2 x pp parts for a multi-stage schedule is searched only where it is
    Llama 3's rule, ``(layers + 2) % (pp x vpp)`` 0 at pp >= 3 (the same parts): its other cuts give a
    stage chunks two layers apart (80 layers at pp 2 x vpp 2: [20, 21, 20, 19], stage 1 holding 21 and
    19), which the bounds' chunk terms (a stage's chunks at most one layer apart: ``Stages.n_chunk``,
    ``n_chunk_hi`` of :mod:`meshplan.search.memory`) do not cover; such a configured mesh is planned
    exactly and ranked beside the candidates (``your mesh ... would rank``).

    >>> torchtitan_cut(80, 3), torchtitan_cut(126, 16) == [7] + [8] * 14 + [7], torchtitan_cut(32, 4)
    ([27, 27, 26], True, [8, 9, 8, 7])
    """
    try:
        split = default_split(pp, layers)
    except ConfigError:
        return None
    return split if pp <= layers and min(split) >= 1 else None


def titan_split(cfg: Config) -> bool:
    """Whether the search plans ``cfg``'s short-ends candidates (column ``us``) at vpp 1 with
    torchtitan's own default cut (:func:`torchtitan_cut`) rather than Llama 3's rule
    (:func:`ends_short_split`): a torchtitan file under framework torch, read directly
    (``cfg.origin``) or through an import's [source] table, whose job torchtitan splits so unless it
    lists module names (newcomer trial nc57 #7a)."""
    return cfg.training.framework == "torch" and (
        cfg.origin == "torchtitan" or (cfg.source is not None and cfg.source[1] == "torchtitan"))


def stage_split(layers: int, pp: int, vpp: int, short: bool = False, first_last: bool = False,
                titan: bool = False):
    """``pp_layer_split`` of a candidate: :func:`ends_short_split` when ``short`` (per stage,
    with vpp > 1 spread over the chunks by :func:`~meshplan.mesh.layers.stage_layers`), with
    ``titan`` (:func:`titan_split`) and vpp 1 :func:`torchtitan_cut`; else None
    when pp divides the layers (even stages) or vpp > 1, else
    :func:`~meshplan.mesh.layers.balanced_split`, or with ``first_last`` (``training.framework =
    "megatron"``, :func:`megatron_split`) :func:`~meshplan.mesh.layers.first_last_split`, the only
    uneven split Megatron-LM's ``--decoder-first/last-pipeline-num-layers`` set (where it has none,
    an end stage left no layer, the search rejects the row, rule ``split``,
    :func:`meshplan.search.reasons.first_reason`, and the balanced split stands in).

    DeepSeek-V3's 61 layers at pp 16: the extra layers on the middle stages, or Megatron-LM's cut
    (its middle stages even, the shortfall of 3 off the ends: DeepSeek-V3's own [3, 4 x 14, 2]):

    >>> stage_split(61, 16, 1)[-3:], stage_split(61, 16, 1, first_last=True)[-3:]
    ([4, 3, 3], [4, 4, 2])
    """
    if short:
        return torchtitan_cut(layers, pp) if titan and vpp == 1 else ends_short_split(layers, pp, vpp)
    if pp == 1 or vpp > 1 or layers % pp == 0 or pp > layers:
        return None
    return (first_last and first_last_split(layers, pp)) or balanced_split(layers, pp)


def megatron_split(cfg: Config) -> bool:
    """Whether the search plans ``cfg``'s candidates with Megatron-LM's layer split
    (:func:`stage_split`'s ``first_last``): under ``training.framework = "megatron"``."""
    return cfg.training.framework == "megatron"


def accumulates(cfg: Config, pp, sh) -> np.ndarray:
    """Whether candidates of pipeline degree ``pp`` and sharding ``sh`` (arrays or ints) run
    ``training.grad_accumulation`` when it is not ``sync``: pp 1 and FSDP (zero3, hsdp). With pp
    > 1 torch.distributed.pipelining turns gradient sync and reshard-after-backward off itself
    (:func:`meshplan.plan.build_plan` refuses the key there) and ZeRO-1 reduces once per step
    anyway: those candidates are planned with ``sync`` (:func:`candidate_config`).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 1024, "grad_accumulation": "no_sync"}}, require_mesh=False)
    >>> accumulates(cfg, np.array([1, 1, 2]), np.array([SHARDING.index(s) for s in ("zero3", "zero1", "zero3")]))
    array([ True, False, False])
    """
    on = (np.asarray(pp) == 1) & np.isin(sh, FSDP_SHARDINGS)
    return on & (cfg.training.grad_accumulation != "sync")


def _training_knobs(cfg: Config, c: Candidates, i: int) -> dict:
    """The training fields of candidate ``i`` where a config setting does not apply to it:
    ``grad_accumulation`` back to ``sync`` outside :func:`accumulates`, ``fp8_all_gather`` off
    without FSDP (ZeRO-1 gathers no parameters; the float8 GEMMs stay) or at dp_shard 1
    (:meth:`~meshplan.spec.training.TrainingSpec.at_dp_shard`, torchtitan's rule), ``fp8_param_gather`` off
    outside zero1 (Megatron-LM's distributed optimizer's),
    ``reshard_head_after_forward`` off without FSDP or ``reshard_after_forward``, the
    fields of its sharding (:func:`sharding_knobs`), as
    :class:`~meshplan.spec.training.TrainingSpec` requires of a config, and on a zero3 row under
    DeepSpeed's ZeRO-3 its hpZ g (:attr:`~meshplan.search.columns.Candidates.hz`)."""
    t, out = cfg.training, dict[str, object]()
    if t.grad_accumulation != "sync" and not accumulates(cfg, c.pp[i], c.sh[i]):
        out["grad_accumulation"] = "sync"
    if t.fp8_all_gather and (int(c.sh[i]) not in FSDP_SHARDINGS or not t.at_dp_shard(int(c.dps[i])).fp8_all_gather):
        out["fp8_all_gather"] = False
    if t.fp8_param_gather and SHARDING[c.sh[i]] != "zero1":
        out["fp8_param_gather"] = False  # Megatron-LM's distributed optimizer's (training_checks)
    if t.reshard_head_after_forward and (int(c.sh[i]) not in FSDP_SHARDINGS or not c.rf[i]):
        out["reshard_head_after_forward"] = False  # torchtitan's "always" reshards what FSDP2 shards
    out |= sharding_knobs(t, SHARDING[c.sh[i]])
    if c.hz is not None and SHARDING[c.sh[i]] == "zero3" and t.searched_zero3_engine == "deepspeed":
        out["zero_hpz_partition_size"] = c.hpz(i)
    return out


def sharding_knobs(t: TrainingSpec, sharding: str) -> dict:
    """The training fields that change with the searched ``sharding`` of a row searched from
    the config's training ``t`` (the row's engine and what follows from it):
    ``zero3_engine`` back to ``fsdp2`` outside sharding zero3 (DeepSpeed's engine is for ZeRO
    stage 3; with it ``grad_dtype`` back to its default where it is the parameter dtype, the
    engine's default; ``contiguous_gradients`` off), its zero1 and zero2 rows under DeepSpeed's
    ZeRO-1/2 (``zero12_engine = "deepspeed"``,
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero12_engine`; ``overlap_comm`` and
    ``contiguous_gradients`` as given, DeepSpeed's one key for every stage, else the stage's
    DeepSpeed default),
    ``zero12_engine`` back to ``megatron`` (and ``overlap_comm`` off) outside zero1 and zero2, its
    zero3 rows under DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``,
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`),
    ``zero0_engine`` back to ``ddp`` (DeepSpeed without ZeRO, a stage 0 config: its zero1/zero2 and
    zero3 rows under DeepSpeed's engines, with DeepSpeed's gradient dtype), ``overlap_grad_reduce`` /
    ``overlap_param_gather`` off outside zero1 (Megatron-LM's DDP-buffer flags), and ``pp_engine``
    back to ``framework`` there (DeepSpeed's PipelineEngine runs ZeRO-0/1 only: a Megatron-DeepSpeed
    ZeRO-2/3 row is ``--no-pipeline-parallel``), its zero1 rows under
    :attr:`~meshplan.spec.training.TrainingSpec.searched_pp_engine` (Megatron-DeepSpeed's: DeepSpeed's
    PipelineEngine, ``pp_engine = "deepspeed"``, whatever the config's own sharding). The plan's (:func:`candidate_config`) and the memory bound's
    (:func:`meshplan.search.bounds.bounds`, through :func:`sharding_training`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed", grad_dtype="bf16", contiguous_gradients=False)
    >>> sorted(sharding_knobs(t, "zero1").items())
    [('grad_dtype', 'bf16'), ('zero12_engine', 'deepspeed'), ('zero3_engine', 'fsdp2')]
    >>> z2 = TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed", contiguous_gradients=True)
    >>> (sharding_training(t, "zero2").contiguous_grads, "contiguous_gradients" in sharding_knobs(z2, "zero1"),
    ...  sharding_knobs(z2, "hsdp")["contiguous_gradients"])
    (False, False, False)
    """
    out = dict[str, object]()
    deepspeed12 = t.searched_zero12_engine == "deepspeed" and sharding in ("zero1", "zero2")
    if t.contiguous_gradients and sharding != "zero3" and not deepspeed12:
        out["contiguous_gradients"] = False  # DeepSpeed's key: no other engine reads it
    if t.zero3_engine != "fsdp2" and sharding != "zero3":
        out["zero3_engine"] = "fsdp2"
        out |= {k: type(t).model_fields[k].default for k in zeropp_keys_set(t)}  # ZeRO++: stage 3's
        if t.grad_dtype == t.param_dtype:  # DeepSpeed's gradient partition dtype back to FSDP2's default
            out["grad_dtype"] = type(t).model_fields["grad_dtype"].default
        if deepspeed12:  # DeepSpeed's own ZeRO-1/2, the config's contiguous_gradients (one key for every stage)
            out |= {"zero12_engine": "deepspeed", "grad_dtype": deepspeed_grad_dtype(
                {"zero1": 1, "zero2": 2}[sharding], t.param_dtype,
                None if t.grad_dtype == t.param_dtype else t.grad_dtype)}
        elif t.overlap_comm is not None:
            out["overlap_comm"] = None  # no DeepSpeed engine on this row
    if t.zero12_engine != "megatron" and sharding not in ("zero1", "zero2"):  # DeepSpeed's ZeRO-1/2 engine
        out |= {"zero12_engine": "megatron"}
        if sharding == "zero3":  # DeepSpeed's own ZeRO-3, not FSDP2
            out["zero3_engine"] = t.searched_zero3_engine
        else:
            out["overlap_comm"] = None
    if t.zero0_engine != "ddp":  # DeepSpeed without ZeRO: every searched row is sharded, under DeepSpeed's own
        out["zero0_engine"] = "ddp"  # ZeRO-1/2 or ZeRO-3 (hsdp: FSDP2), as a stage 1, 2 or 3 config's rows
        stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(sharding)
        if stage is not None:
            out |= {"zero12_engine" if stage < 3 else "zero3_engine": "deepspeed",
                    "grad_dtype": deepspeed_grad_dtype(stage, t.param_dtype)}
    if sharding != "zero1":  # Megatron-LM's DDP-buffer flags (the search has no none); FSDP forces them
        out |= {k: False for k in ("overlap_grad_reduce", "overlap_param_gather") if getattr(t, k)}
        if t.pp_engine == "deepspeed":  # DeepSpeed's PipelineEngine refuses ZeRO-2/3: such a row runs
            out["pp_engine"] = "framework"  # Megatron-DeepSpeed's --no-pipeline-parallel, pp 1
    elif t.searched_pp_engine != t.pp_engine:  # Megatron-DeepSpeed's ZeRO-1 rows: GPTModelPipe under
        out["pp_engine"] = t.searched_pp_engine  # DeepSpeed's PipelineEngine, as its import plans them
    return out


def sharding_training(t: TrainingSpec, sharding: str) -> TrainingSpec:
    """The training ``t`` as a row of ``sharding`` runs it: ``sharding`` and
    :func:`sharding_knobs` (the fields that do not depend on the row's other columns)."""
    return t.model_copy(update={"sharding": sharding, **sharding_knobs(t, sharding)})


def candidate_config(cfg: Config, c: Candidates, i: int, block: Optional[int] = None) -> Config:
    """The plan input of candidate ``i``: ``cfg`` with its mesh (canonical order, degree-1
    axes left out, SP on when tp > 1, its pipeline schedule, its layer split) and the
    candidate's micro-batch, recompute (``layer`` at :data:`~meshplan.search.columns.LAYER_AC_FREQ`, ``full``
    of every layer; a ``block`` row as ``full`` with ``recompute_num_layers`` n, Megatron-LM's block
    recompute: ``block`` where given, the exact planner's bisection, else the row's picked n,
    :attr:`~meshplan.search.columns.Candidates.rn`, else 1 before it is picked; n 0 is ``none``), sharding, reshard_after_forward and tp_comm_overlap
    in the training contract; ``grad_accumulation`` and ``fp8_all_gather`` where they apply
    (:func:`_training_knobs`); ``[memory] fsdp_reduce`` unset, so each candidate reduces as its
    pp and grad_accumulation say (:meth:`~meshplan.spec.memory.MemoryOptions.fsdp_reduce_for`)."""
    degs = [(axis_shown(n, SHARDING[c.sh[i]]), c.degree(col.column)) for n, col in search_axes()]
    named = [(n, int(a[i])) for n, a in degs if a[i] > 1] or [("dp_shard", 1)]
    pp, vpp, tp = int(c.pp[i]), int(c.vpp[i]), int(c.tp[i])
    mesh = MeshSpec(names=[n for n, _ in named], shape=[d for _, d in named], sequence_parallel=tp > 1,
                    virtual_stages=vpp, pp_layer_split=stage_split(cfg.model.layers, pp, vpp, bool(c.us[i]),
                                                  megatron_split(cfg), titan_split(cfg)),
                    pp_schedule=candidate_schedule(vpp, int(c.ps[i])))
    rc, n = RECOMPUTE[c.rc[i]], None
    if rc == "block":
        n = block if block is not None else (c.block_layers(i) or 1)
        rc, n = ("full", n) if n else ("none", None)
    training = cfg.training.model_copy(update={"micro_batch": int(c.mb[i]), "recompute": rc,
                                               "ac_freq": LAYER_AC_FREQ if rc == "layer" else 1,
                                               "recompute_num_layers": n,  # None: every layer under full
                                               "sharding": SHARDING[c.sh[i]],
                                               "reshard_after_forward": bool(c.rf[i]),
                                               "tp_comm_overlap": bool(c.ov[i]), **_training_knobs(cfg, c, i)})
    memory = cfg.memory.model_copy(update={"fsdp_reduce": None})  # each candidate's own rule (fsdp_reduce_for)
    return replace(cfg, mesh=mesh, training=training, memory=memory)


def as_written(row: Config, cfg: Config) -> Config:
    """The search row ``row`` (:func:`candidate_config` of ``cfg``) with its [training] counting as
    given (``model_fields_set``) the fields ``cfg``'s training was given and the row's fields off their
    default, not each searched knob at its default: what an export writes of it
    (:func:`meshplan.interop.tomlout.training_table`: the user's keys and the row's settings, without
    ``ac_freq = 1`` or ``tp_comm_overlap = false`` the user never wrote). Values unchanged; a field
    off its default stays given, so :meth:`~meshplan.spec.training.TrainingSpec.at_pp` keeps the row's
    ``reshard_after_forward``."""
    t, fields = row.training, TrainingSpec.model_fields
    off = {k for k in t.model_fields_set if getattr(t, k) != fields[k].default}
    given = (set(cfg.training.model_fields_set) | off) & set(fields)
    return replace(row, training=TrainingSpec.model_construct(_fields_set=given, **dict(t)))
