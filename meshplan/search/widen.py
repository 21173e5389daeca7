"""What a narrowed ``[search] cp`` or ``ep`` hides when no candidate fits (newcomer trial 16: ``plan``'s
``fix:`` line tries context parallelism, :func:`meshplan.plan_fix_cp.cp_variant`, while the search's
no-feasible-mesh fix never named it; nc58 #1b: the same for more expert parallelism of an MoE model,
:func:`meshplan.plan_fix_ep.ep_variant`, which shards the routed experts: each rank holds experts / ep
of every MoE layer's, while the dense mesh stays as it is).

Context parallelism splits the sequence over cp ranks, so each rank holds 1 / cp of a layer's
activations while FSDP still shards the state over dp_shard x cp (:mod:`meshplan.spec.axes.cp`):
at a long sequence it is what fits without replaying the forward. Where the config narrows
``[search] cp`` (``cp = [1]``) and nothing fits while memory rejected some, :func:`widen` runs the
same search with ``cp`` left to every degree the rules allow, for the fastest row only (``top = 1``,
nothing settled near the memory limit: the counts of that search are not printed), and keeps that
row as the result's ``widened`` (:class:`~meshplan.search.driver.Widened`), which the
no-feasible-mesh fix names first (:mod:`meshplan.report.search_fix`). The narrowed candidates are a
subset of the widened ones with the same verdicts, so the row found has a cp the narrowed list left
out. ``meshplan search`` runs it after the search, only on the no-feasible-mesh path: a search that
finds a row never pays for it.

Llama-3-70B at seq 32768, global batch 512 on 8 dgx-h100 with ``[search] recompute = ["none"]`` and
``cp = [1]``: no candidate fits (without recompute every layer keeps its activations of 32768
tokens, split over tp 8 at most); widened, pp 2 x cp 4 x tp 8 fits (tests/test_search_widen.py).
``[search] ep`` is widened the same way where the model is MoE (each axis its own search; the ep row
named first). Mixtral-8x7B at pp 4 x dp 64 with ``ep = [1]`` (and cp, tp narrowed to 1): ep 1 keeps all
8 experts of its 8 layers on every rank, 63 GiB of their bf16 parameters and fp32 gradients alone, so
nothing fits; every ep, ep 2 or more fits (tests/test_nclose_fixes.py).

Under Megatron Core, where the data loader's ``b x 1 x s x s`` bool attention mask is 1 GiB or more
at the smallest ``[search] micro_batch`` (:mod:`meshplan.plan_fix_mask`: seq >= 32768 at micro-batch
1), the same search runs with ``training.dataloader_attention_mask = false``
(``--no-create-attention-mask-in-dataloader``) as the result's ``widened_mask`` (``axis`` "mask"),
which the fix names before every other (newcomer trial nc59 #1: ``plan``'s fix named the flag, the
search's did not).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

from meshplan.compute.batch_input import core_key_bytes
from meshplan.config import Config
from meshplan.memory.constraints import state_floor_fix
from meshplan.plan_fix_mask import MIN_GAIN
from meshplan.search.driver import SearchResult, Widened, search


def worth_widening(r: SearchResult, axis: str = "cp") -> bool:
    """Whether :func:`widened_axis` may help ``r``: no row, ``[search]``'s ``axis`` list narrowed (ep: of
    an MoE model) and some candidate rejected for memory, but not where the model state alone exceeds
    usable memory fully sharded over every GPU (:func:`~meshplan.memory.constraints.state_floor_fix`:
    no cp or ep helps)."""
    cfg = r.config
    return (not r.top and getattr(cfg.search, axis) is not None and r.counts()["memory"] > 0
            and (axis != "ep" or cfg.model.is_moe) and state_floor_fix(cfg.model, cfg.training, cfg.cluster) is None)


def widened_axis(cfg: Config, axis: str = "cp", workers: Optional[int] = None) -> Optional[Widened]:
    """The fastest row of ``cfg``'s search with ``[search]``'s ``axis`` list left out (every degree
    the rules allow), ``top`` 1 and ``settle_max`` 0, ``[mesh]`` dropped (its line is not printed);
    None where that search finds none either."""
    o = cfg.search
    wide = replace(cfg, mesh=None, search=o.model_copy(update={axis: None, "top": 1, "settle_max": 0}))
    r = search(wide, workers=workers)
    e = r.top[0] if r.top else None
    if e is None or e.step_s is None:
        return None
    c = r.candidates
    return Widened(tuple(getattr(o, axis) or ()), int(c.cp[e.index]), c.label(e.index), e.step_s, e.peak_bytes,
                   axis, int(c.ep[e.index]))


def mask_bytes(cfg: Config) -> int:
    """Bytes of Megatron Core's data-loader mask at the smallest ``[search] micro_batch``:
    ``b x s x s`` (1 B a bool element; :mod:`meshplan.plan_fix_mask`); 0 where none is built
    (another framework or generation, or ``dataloader_attention_mask = false``)."""
    t = cfg.training
    if not t.core_attention_mask:
        return 0
    return core_key_bytes("attention_mask", min(cfg.search.micro_batch), t.seq_len)


def worth_unmasking(r: SearchResult) -> bool:
    """Whether :func:`unmasked` may help ``r``: no row, some candidate rejected for memory, a mask of
    :data:`~meshplan.plan_fix_mask.MIN_GAIN` or more (:func:`mask_bytes`), and a model state that
    fits fully sharded (:func:`~meshplan.memory.constraints.state_floor_fix`)."""
    cfg = r.config
    return (not r.top and r.counts()["memory"] > 0 and mask_bytes(cfg) >= MIN_GAIN
            and state_floor_fix(cfg.model, cfg.training, cfg.cluster) is None)


def unmasked(cfg: Config, workers: Optional[int] = None) -> Optional[Widened]:
    """The fastest row of ``cfg``'s search without the data loader's mask (its ``[search]`` lists
    kept; ``top`` 1, ``settle_max`` 0, ``[mesh]`` dropped); None where that search finds none either."""
    t = cfg.training.model_copy(update={"dataloader_attention_mask": False})
    wide = replace(cfg, mesh=None, training=t, search=cfg.search.model_copy(update={"top": 1, "settle_max": 0}))
    r = search(wide, workers=workers)
    e = r.top[0] if r.top else None
    if e is None or e.step_s is None:
        return None
    c = r.candidates
    return Widened((), int(c.cp[e.index]), c.label(e.index), e.step_s, e.peak_bytes, "mask", int(c.ep[e.index]))


def widen(r: SearchResult, workers: Optional[int] = None) -> SearchResult:
    """``r`` with ``widened`` (cp) and ``widened_ep`` set where :func:`worth_widening` (their wall times
    as ``timings["widen cp"]`` and ``["widen ep"]``, seconds, apart from the search's ``wall_s``), and
    ``widened_mask`` where :func:`worth_unmasking` (``timings["widen mask"]``); ``r`` itself, unchanged,
    otherwise."""
    for axis in ("cp", "ep"):
        if not worth_widening(r, axis):
            continue
        t0 = time.perf_counter()
        found = widened_axis(r.config, axis, workers)
        if axis == "cp":
            r.widened = found
        else:
            r.widened_ep = found
        r.timings[f"widen {axis}"] = time.perf_counter() - t0
    if worth_unmasking(r):
        t0 = time.perf_counter()
        r.widened_mask = unmasked(r.config, workers)
        r.timings["widen mask"] = time.perf_counter() - t0
    return r
