"""The unit bounds of each stage, per candidate (:func:`unit_bounds`: forward and backward units,
their FSDP gathers and reductions, the embedding and head, p2p, tail and stage end), raised to
eager DTensor TP's host pace (:func:`~meshplan.search.host_pace.host_pace_floor`), on one layer's chain
(:mod:`meshplan.search.layer_chains`). The module docstring of :mod:`meshplan.search.timing`
states what they keep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from meshplan.config import Config
from meshplan.search.comm_bounds import comm_times, fsdp_copies
from meshplan.search.gather_passes import (deepspeed_backward_shares, expert_gathers, head_regathers, head_unit_apart,
                                           gathering_passes)
from meshplan.search.host_pace import host_pace_floor  # its home before: workload's docstring names it here
from meshplan.search.memory import Stages
from meshplan.search.nic_bounds import two_queues_s
from meshplan.search.sm_bound import SmTerms, backward_sm_bound, forward_sm_bound, gather_chain, sm_terms
from meshplan.search.columns import MIXED, bound_recompute
# chains: the tests import it from here too, where it lived before layer_chains
from meshplan.search.layer_chains import chains, layer_ops, stage_chains  # noqa: F401
from meshplan.search.layer_replays import extra_replays, layer_rows, more_replays, replayed_layers
from meshplan.search.space import Candidates, accumulates
from meshplan.search.step_end_bound import final_reduce_tail, fsdp2_rs_wait, reduce_flow_shop_s, stage_end_bound
from meshplan.search.time_tables import TimeTables


def _col(a) -> np.ndarray:
    """``a`` as a column (candidates, 1), to broadcast against a stage's (candidates, pp)."""
    return np.asarray(a)[:, None]


@dataclass(frozen=True)
class _Terms:
    """The terms a stage's unit bounds are built of (:func:`unit_bounds`), seconds per candidate:
    one layer's lower chains ``cf``, ``cb`` and the replay's extra ``df``, ``db`` (candidates, pp);
    the FSDP terms of a unit that gathers and reduces every pass (``ag``, ``rs``, ``ag_b``, copies
    ``co``, ``ci``, ``e_ci``) and of a gathering pass or the last gradient unit (``_p``: pp > 1 or
    under accumulation, ``lazy``), the experts' first gather ``e_ag``, DeepSpeed's backward shares
    (``ds_tot``, ``ds_1``), the head's backward off its chunk's first gather at pp 1 (``hb1``), the
    head's reduce-scatter ``head_rs`` and the reductions a last gradient unit waits for (``waits``,
    ``rs_p``, ``ar_p``, ``rs_wait``); ``ag_nic``, ``rs_nic``, ``head_rs_nic``: the NIC seconds of ``ag_b``,
    ``rs`` and ``head_rs`` (:func:`~meshplan.search.time_tables.coll_nic_s`); (candidates, 1) unless said."""
    c: Candidates
    cf: np.ndarray
    cb: np.ndarray
    df: np.ndarray
    db: np.ndarray
    lazy: np.ndarray
    piped: np.ndarray
    ag: np.ndarray
    rs: np.ndarray
    ag_p: np.ndarray
    keep: np.ndarray
    ag_b: np.ndarray
    ds_tot: np.ndarray
    ds_1: np.ndarray
    e_ag: np.ndarray
    co: np.ndarray
    ci: np.ndarray
    co_p: np.ndarray
    ci_p: np.ndarray
    e_ci: np.ndarray
    e_ci_p: np.ndarray
    hb1: np.ndarray
    head_rs: np.ndarray
    waits: np.ndarray
    rs_p: np.ndarray
    ar_p: np.ndarray
    red_nic: tuple  # (rs_p's, ar_p's) NIC seconds: the two queues share the NIC (step_end_bound.reduce_flow_shop_s)
    rs_wait: np.ndarray  # FSDP2 copy-ins wait for the previous reduce-scatter (bool; step_end_bound.fsdp2_rs_wait)
    ag_nic: np.ndarray
    rs_nic: np.ndarray
    head_rs_nic: np.ndarray
    sm: SmTerms  # the SM contention bounds' terms (sm_bound.sm_terms)

    def replays_f(self, n, plus=0):
        """A chunk of n layers adds its replays' extra to n per-layer lower chains (``plus``: a chunk
        that replays one more than the fewest, layer_replays); 0.0 on other rows."""
        return replayed_layers(self.c, n, plus) * self.df

    def replays_b(self, n, plus=0):
        """:meth:`replays_f` of the backward."""
        return replayed_layers(self.c, n, plus) * self.db

    def ds_n(self, n):
        """DeepSpeed ZeRO-3's backward gather shares summed over n layers (n where it keeps none)."""
        return np.where(np.isnan(self.ds_tot), n, self.ds_tot)


def _layer_chains(cfg: Config, tt: TimeTables, c: Candidates, st: Stages,
                  cm: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(``cf``, ``cb``, ``df``, ``db``): one layer's lower (forward, backward) chain per stage and,
    under torchtitan's per-layer AC, a replayed layer's extra over it (0 on other rows)."""
    # torch: each block's input-gradient TP collective follows its weight gradients, async TP or
    # not (it fuses no such reduce-scatter: compute.asynctp.unfused_overlap); Megatron-LM runs
    # it beside them (Overlap.tp_grad)
    serial = np.full(len(c), cfg.training.framework != "megatron")
    cf, cb = stage_chains(cfg, tt, c, st, cm, serial)
    # torchtitan's per-layer AC (``layer``): a layer replayed in full costs at least full's chain,
    # the others none's; per layer the lower of the two (``cf``, ``cb``) and, on the chunk's
    # replayed layers (replayed_layers), the replay's extra (``df``, ``db``; 0 on other rows)
    df, db = np.zeros_like(cf), np.zeros_like(cb)
    if np.isin(c.rc, MIXED).any():  # block rows too: per layer the lower of the two, their least n's replays
        ff, fb = stage_chains(cfg, tt, replace(c, rc=bound_recompute(c.rc, "full")), st, cm, serial)
        df, db = np.maximum(ff - cf, 0.0), np.maximum(fb - cb, 0.0)
        cf, cb = np.minimum(cf, ff), np.minimum(cb, fb)
    return cf, cb, df, db


def _head_backward(cfg: Config, c: Candidates, st: Stages, cm: dict, od: dict, cp: dict,
                   post: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(``head_b``: the head's backward in its unit, ``hb``: what a gathering backward of the
    head's chunk takes off its first gather, ``hb1``: the same at pp 1, every backward)."""
    head_b0 = st.last * (_col(od["head_b"]) + post)
    # training.reshard_head_after_forward (torchtitan's "always", pp 1 under sync): each backward
    # starts with the [norm, output] unit's all-gather, exposed, then its copy-out before the
    # head's backward; the last layer's prefetched gather queues behind it on the FSDP stream
    # (backward_pass.backward_unit; test_reshard_policy's backward by hand)
    again = head_regathers(cfg, c)
    h_co = st.last * _col(cp["head_out"]) * again
    head_b = head_b0 + st.last * _col(cm["head_ag"]) * again + h_co
    # torchtitan's [norm, output] unit (every pp): its pre-backward prefetches the last layer's
    # all-gather before the head's backward runs (backward_pass.backward_unit), so a gathering
    # backward pass of the head's chunk exposes its first gather less the head's backward
    # (``b_extra_head``: the head chunk's gathering backwards only, step_lower_bound)
    hb = (head_b0 + h_co) * head_unit_apart(cfg, c)  # the head's copy-out too: the last layer's gather starts after it
    hb1 = hb * _col((c.pp == 1) & (c.vpp == 1))  # pp 1: every backward of the head's chunk gathers (sync)
    # there the head's reduce-scatter, issued after its backward, runs on the FSDP stream between
    # the last layer's prefetched all-gather and the next layer's (every micro-batch under sync)
    return head_b, hb, hb1


def _terms(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, cm: dict, cp: dict, hb1: np.ndarray,
           od: dict) -> _Terms:
    """The :class:`_Terms` of the candidates' stages (``cp``: FSDP2's copies, ``hb1``:
    :func:`_head_backward`'s, ``od``: a dense layer's ops)."""
    m = cfg.model
    cf, cb, df, db = _layer_chains(cfg, tt, c, st, cm)
    # with pp > 1 a unit gathers only when it finds its chunk sharded and reduce-scatters only
    # on the chunk's last gradient unit (comm.fsdp_rows.fsdp_gather_flags): no FSDP term in
    # the per-unit cores; the gathering units' extra (``f_extra``, ``b_extra``, reduce-scatters
    # left out) is counted once per gathering pass (``g_f``, ``g_b``) in step_lower_bound
    # MoE models: routed experts gather over efsdp in their own units, which ``fsdp_ag`` (the
    # dense unit's) does not bound from below: no extra counted (measured: pp 4 x dp_shard 2
    # Mixtral-shaped, bound 0.1% above the simulated step with it)
    # pp 1 under training.grad_accumulation (``accumulates``) follows the same flags: a pass
    # gathers only when it finds the units sharded, the last gradient unit alone reduces
    lazy = (c.pp > 1) | accumulates(cfg, c.pp, c.sh)
    ag, rs = (_col(np.where(lazy, 0.0, cm[k])) for k in ("fsdp_ag", "fsdp_rs"))
    # reshard_after_forward false: the table has no backward all-gather, so the layers'
    # reduce-scatters queue on the fsdp stream without holding up a gather (they end in the tail)
    keep = _col(c.rf > 0)
    # DeepSpeed ZeRO-3 at pp 1: its backward gathers what stage3_max_reuse_distance did not keep
    # (none of a kept layer, twice a layer under full recompute at a short distance): the
    # shares summed (``ds_n``, for n) and the last layer's (``ds_1``, the first exposed)
    ds_tot, ds_last = deepspeed_backward_shares(cfg, c)
    # a MoE layer's forward that finds its experts sharded waits for their efsdp all-gather where
    # nothing prefetched it: the chunk's first layer's, issued when it starts (the others go out
    # beside the next layer's and may hide: rank_timeline.forward_unit), counted where every layer
    # is MoE (the chunk's first one then is); with pp 1 every forward gathers, with pp > 1 the
    # gathering passes (``f_extra``)
    first = np.minimum(expert_gathers(st, c), 1) if m.is_moe and m.dense_layers == 0 else 0
    # FSDP2's copies on the compute stream (fsdp_copies): a gathering pass's copy-out before each
    # layer's compute, a reducing pass's copy-in after it; every pass with pp 1 under sync (the
    # backward's copy-out only when it gathers again: reshard_after_forward), else the gathering
    # passes (``f_extra``, ``b_extra``) and the chunk's last gradient unit (``b_red``)
    # the routed experts' own unit (efsdp > 1): its copy-in after each MoE layer's backward that
    # reduces (grad_reduce.unit_reduce, _perform_reduce_grad), in the chunk with the fewest of them
    moe_n = expert_gathers(st, c) if m.is_moe else 0
    # pp > 1 (torch's PipelineStage, grad_reduce.perform_reduce_grad): a chunk's last gradient
    # unit, unless it ends the stage's order, holds the compute stream until its layers' FSDP
    # reductions are done: per layer a copy-in (compute stream), then its reduce-scatter (fsdp
    # stream), then its HSDP all-reduce (dp_replicate stream), each stream serial and the first
    # copy-in after the unit's last backward. n identical jobs through three serial stages take at
    # least the three of one job plus (n - 1) x the longest (a flow shop,
    # step_end_bound.reduce_flow_shop_s; FSDP2's copy-in waits for the previous reduce-scatter,
    # rs_wait: copy-in and reduce-scatter one stage): ``b_wait``, the unit's time past its compute (at least
    # ``b_red``). Dense models with one schedule run only (the tail's ``fsdp_red`` restriction; with
    # runs > 1 the DAG's last micro-batch is not each run's)
    waits = _col((c.pp > 1) & (not m.is_moe or m.dense_layers == 0) & (cfg.training.pp_schedule_runs == 1))
    co, ci = _col(np.where(lazy, 0.0, cp["out"])), _col(np.where(lazy, 0.0, cp["in"]))
    return _Terms(c=c, cf=cf, cb=cb, df=df, db=db, lazy=lazy, piped=_col(lazy & (not m.is_moe)), ag=ag, rs=rs,
                  ag_p=_col(np.where(lazy, cm["fsdp_ag"], 0.0)), keep=keep, ag_b=ag * keep, ds_tot=ds_tot,
                  ds_1=np.where(np.isnan(ds_last), 1.0, ds_last),
                  e_ag=_col(cm["efsdp_ag"]) * first if m.is_moe else np.zeros_like(st.n, dtype=np.float64),
                  co=co, ci=ci, co_p=_col(np.where(lazy, cp["out"], 0.0)), ci_p=_col(np.where(lazy, cp["in"], 0.0)),
                  e_ci=moe_n * _col(np.where(lazy, 0.0, cp["e_in"])), e_ci_p=moe_n * _col(np.where(lazy, cp["e_in"], 0.0)),
                  hb1=hb1, head_rs=_col(cm["head_rs"]), waits=waits, rs_p=_col(cm["fsdp_rs"]),
                  ar_p=_col(cm["hsdp_ar"]), red_nic=(_col(cm["fsdp_rs_nic"]), _col(cm["hsdp_ar_nic"])),
                  rs_wait=_col(fsdp2_rs_wait(cfg, c)),
                  ag_nic=_col(np.where(lazy, 0.0, cm["fsdp_ag_nic"])) * keep,
                  rs_nic=_col(np.where(lazy, 0.0, cm["fsdp_rs_nic"])), head_rs_nic=_col(cm["head_rs_nic"]),
                  sm=sm_terms(cfg, c, cm, od, cp["out"], lazy, fsdp2_rs_wait(cfg, c)))


def _cores(t: _Terms, n, plus=0) -> dict[str, np.ndarray]:
    """One chunk of n layers (``plus``: one replay more): each term grows with n (a longer chunk's
    bound is never lower); a chunk of none (the embedding or the output layer alone,
    stage_layers) has no layer term. The forward also at least FSDP2's gather chain with its
    copy-outs; both at least their kernels slowed by FSDP2's collectives (:mod:`~meshplan.search.sm_bound`)."""
    cf_c, cb_c = t.cf + t.co, t.cb + t.co * t.keep + t.ci
    has = n >= 1
    nf_c, nb_c = n * cf_c + t.replays_f(n, plus), n * cb_c + t.replays_b(n, plus)
    f_sm = np.maximum(gather_chain(t.ag, t.co, cf_c, n), forward_sm_bound(t.sm, t.ag, t.co, n))
    return {"f_core": has * np.maximum(np.maximum(t.ag + nf_c, f_sm), nf_c + _col(~t.lazy) * t.e_ag),
            "b_core": has * np.maximum(np.maximum(np.maximum(t.ag_b * t.ds_1 - t.hb1, 0.0) + nb_c + t.e_ci,
                                                  _fsdp_backward(t, n) + cb_c - t.hb1),
                                       backward_sm_bound(t.sm, t.ag_b, t.rs, t.co * t.keep, t.ci, n)),
            "b_red": has * (n * t.ci_p + t.e_ci_p),
            "b_wait": np.maximum(has * (n * t.ci_p + t.e_ci_p), t.waits * reduce_flow_shop_s(n, t.ci_p, t.rs_p, t.ar_p, t.rs_wait,
                                                                                         *t.red_nic))}


def _fsdp_backward(t: _Terms, n) -> np.ndarray:
    """Seconds from a backward unit's start (less the head's backward, ``hb1``, beside its first gather)
    before its last layer's chain can start, on the FSDP collectives it waits for (``n`` layers; a unit
    that gathers and reduces every pass): the n all-gathers, the reduce-scatters of the first n - 2
    layers backward and, where its unit comes first, the head's. One queue (Megatron
    FSDP, DeepSpeed ZeRO-3): their sum. FSDP2 (``rs_wait``, ``Overlap.fsdp_rs_queue``): two streams
    that run at once (torch 2.13 ``_fsdp_param_group.py`` lines 89-92), each serial, all done by then
    (the layer before the last copies its gradient in after the reduce-scatter before it, one in
    flight: :func:`~meshplan.schedule.grad_reduce.rs_buffer_wait`), sharing the NIC:
    :func:`~meshplan.search.nic_bounds.two_queues_s`. The sum, taken for FSDP2 too before, was above
    the timeline: Llama-3-70B's dp_shard 16 x tp 8 on 16 dgx-h100, resharded, no recompute, bound
    1.43520 s against 1.43236 s simulated (tests/test_search_bound_holds.py)."""
    head = (t.hb1 > 0) * t.keep * (n >= 2)
    k = np.maximum(n - 2, 0) * t.keep
    ag, rs = t.ds_n(n) * t.ag_b, k * t.rs + head * t.head_rs
    two = two_queues_s([(t.ds_n(n), t.ag_b, t.ag_nic)], [(k, t.rs, t.rs_nic), (head, t.head_rs, t.head_rs_nic)])
    return np.where(t.rs_wait, two, ag + rs)


def _extra(t: _Terms, n, hb) -> tuple[np.ndarray, np.ndarray]:
    """A gathering pass's extra over its chunk of n >= 1 layers (forward, backward less ``hb``);
    it shrinks as the chunk's replays grow: at one more than the fewest, valid for any chunk of n
    (per-layer AC: the lower of the short and the long chunk's, :func:`_chunk_bounds`)."""
    cf, cb, ag_p, co_p = t.cf, t.cb, t.ag_p, t.co_p
    rf, rb = t.replays_f(n, 1), t.replays_b(n, 1)
    f = np.maximum(t.piped * (np.maximum(ag_p + n * (cf + co_p) + rf, n * ag_p + cf + co_p) - (n * cf + rf)),
                   _col(t.lazy) * t.e_ag + n * co_p)
    b = np.maximum(t.piped * (np.maximum(np.maximum(ag_p - hb, 0.0) + n * (cb + co_p) + rb,
                                         n * ag_p + cb + co_p - hb) - (n * cb + rb)), n * co_p)
    return f, b


def _chunk_bounds(t: _Terms, st: Stages, hb: np.ndarray) -> dict[str, np.ndarray]:
    """The chunk cores at the stage's shortest chunk and its longest, chunk 0's, the gathering
    passes' extras (``hb``: :func:`_head_backward`'s) and, under per-layer AC, the ``_x`` cores of a
    chunk with one replay more (:func:`unit_bounds`' keys)."""
    c, n = t.c, st.n_chunk
    lo, hi = _cores(t, n), _cores(t, st.n_chunk_hi)
    lay = layer_rows(c) > 0
    # the Llama 3 split with vpp > 1: ``n_long`` chunks of the stage hold n_chunk_hi layers, the
    # others n_chunk (stage_layers: stage 0's last chunks, the other stages' first ones); chunk
    # 0's units (the fill and the drain) are long on every stage but the first where any is
    n_long = st.n - c.vpp[:, None] * n
    # per-layer AC rows: the lower of the short and the long chunk's extra (each chunk's own
    # replays may make the long one's the lower); other rows at the shortest chunk
    extra_lo = lambda n, hb: _extra(t, n, hb) if not lay.any() else tuple(
        np.where(lay, np.minimum(e, e_hi), e) for e, e_hi in zip(_extra(t, n, hb),
                                                                 _extra(t, np.maximum(st.n_chunk_hi, 1), hb)))
    long0 = (n_long > 0) & (st.k > 0)
    out = {**lo, "f_core_hi": hi["f_core"], "b_core_hi": hi["b_core"], "b_red_hi": hi["b_red"], "b_wait_hi": hi["b_wait"], "n_long": n_long,
           "f_core0": np.where(long0, hi["f_core"], lo["f_core"]), "b_core0": np.where(long0, hi["b_core"], lo["b_core"]),
           # at the shortest chunk that holds layers (the passes of an empty one are left out:
           # step_lower_bound); a gathering backward of the head's chunk takes the head's
           # backward off its first gather (``b_extra_head``), the other chunks' do not
           **dict(zip(("f_extra", "b_extra"), extra_lo(np.maximum(n, 1), 0.0))),
           "b_extra_head": extra_lo(np.maximum(n, 1), hb)[1]}
    return out


def _tail(cfg: Config, tt: TimeTables, st: Stages, s: dict, cm: dict, cp: dict, t: _Terms,
          out: dict) -> None:
    """Add ``end`` (the stage's step end), ``root_extra`` (the roots' copies) and ``tail`` (the
    last unit beyond its duration) to ``out``, in place."""
    m, c, n = cfg.model, t.c, st.n_chunk
    one = _col(c.vpp) == 1
    b0 = out["b_core0"] + out["emb_b"] + one * out["head_b"]
    out["end"], red = stage_end_bound(cfg, tt, c, st, s, cm)
    # the last unit issues its chunk's pieces of the per-step reduction: 1/vpp of it
    # the last unit reduces its chunk's FSDP gradients (every unit with pp 1, the chunk's last
    # gradient unit with pp > 1): its first layer's reduce-scatter (and HSDP all-reduce after it)
    # starts when that layer's backward ends, after every layer of the unit (``b_core``); only
    # the embedding's gradient (in ``b0``) still runs beside them. Dense units only: with dense
    # and MoE layers the unit sizes differ
    fsdp_red = _col(cm["fsdp_rs"] + cm["hsdp_ar"]) * (not m.is_moe or m.dense_layers == 0)
    # pp 1 under accumulation: the root's copy-out in each forward that gathers it and its copy-in
    # once, in the last unit after its layers' reduce-scatters are issued, which it may overlap:
    # not counted in the tail too (with pp > 1 the root's copies are left out)
    root_in = _col(cp["root_in"]) * _col(t.lazy & (c.pp == 1))
    # pp > 1: the end units' copies once per step each (torchtitan's units, or the V's two
    # roots): the first forward finds them sharded (copy-out), perform_reduce_grad copies their
    # gradients in (the embedding's first, [norm, output]'s after the layers'); the embedding's
    # copy-out in a forward that gathers it again is left out
    ends = st.first * _col(cp["emb_out"] + cp["emb_in"]) + st.last * _col(cp["head_out"] + cp["head_in"])
    out["root_extra"] = root_in + (gathering_passes(cfg, c, st, root=True)[0] * _col(cp["root_out"]) * _col(t.lazy)
                                   if st.k.shape[1] == 1 else ends * _col(c.pp > 1))
    # chunk 0's pieces of the per-step reduction: its layers' share (grad_reduce.reduce_pieces:
    # S / the stage's layers per layer), 1 / vpp with even chunks
    long0 = (out["n_long"] > 0) & (st.k > 0)
    n0 = np.where(long0, st.n_chunk_hi, n)
    has0 = n0 >= 1  # chunk 0 holds layers (stage 0's may hold the embedding alone)
    out["tail"] = np.maximum(np.maximum(one * out["head_b"] + has0 * (t.ag_b + t.cb) + red * n0 / np.maximum(st.n, 1),
                                        one * out["head_b"] + out["b_core0"] + has0 * fsdp_red) - b0 - root_in, 0.0)
    # pp > 1: the unit that ends the stage's order (chunk 0's) reduces its layers after its end
    out["tail"] = np.maximum(out["tail"], has0 * t.waits * final_reduce_tail(n0, t.ci_p, t.rs_p, t.ar_p, t.rs_wait,
                                                                                              *t.red_nic))


def unit_bounds(cfg: Config, tt: TimeTables, c: Candidates, st: Stages, s: dict) -> dict[str, np.ndarray]:
    """Per-stage lower bounds (candidates, pp), seconds: ``f_core``, ``b_core`` (one chunk's
    layers, forward and backward), the embedding's and the head's extra time in their
    chunk's units (``emb_f``, ``emb_b``, ``head_f``, ``head_b``), a gathering pass's extra
    (``f_extra``, ``b_extra``; ``b_extra_head``: a gathering backward of the head's chunk, its
    first gather less the head's backward; ``g_f``, ``g_b`` such passes per step; ``empty_end``:
    the stage's end chunk holds no layer), the extra of each chunk's
    last gradient unit (``b_red``: FSDP2's copy-ins where that unit alone reduces; ``b_wait``: with
    pp > 1 its copy-ins and reductions, which it waits for unless it ends the stage's order), each at
    the stage's shortest chunk, and at its longest (``f_core_hi``, ``b_core_hi``, ``b_red_hi``,
    ``b_wait_hi``; ``n_long``
    chunks of that length, ``f_core0``, ``b_core0`` chunk 0's: the Llama 3 split with vpp > 1), the p2p send
    ``p2p`` (candidates, 1), the last unit's ``tail`` beyond its duration and the stage's ``end``
    (optimizer step, exposed ZeRO-1 all-gather); module docstring."""
    cm = comm_times(cfg, tt, c)
    od = layer_ops(cfg, tt, c, False)
    cp = fsdp_copies(cfg, tt.tables, c)
    pre, post = _col(cm["tp_sp"]), _col(np.maximum(cm["tp_sp"], cm["tp_ar"]))
    head_b, hb, hb1 = _head_backward(cfg, c, st, cm, od, cp, post)
    t = _terms(cfg, tt, c, st, cm, cp, hb1, od)
    lazy = t.lazy
    g_f, g_b = gathering_passes(cfg, c, st)
    out = {**_chunk_bounds(t, st, hb),
           "g_f": g_f, "g_b": g_b, "empty_end": st.n_chunk == 0,
           "emb_f": st.first * (_col(od["emb_f"]) + post + _col(np.where(lazy, 0.0, cp["root_out"]))),
           "emb_b": st.first * (_col(od["emb_bw"]) + _col(np.where(lazy, 0.0, cp["root_in"]))),
           "head_f": st.last * (pre + _col(od["head_f"]) + _col(cm["loss"])),
           "head_b": head_b, "p2p": _col(cm["p2p"])}
    lay = layer_rows(c) > 0
    n, n_long = st.n_chunk, out["n_long"]
    if lay.any():  # per-layer AC: the cores of a chunk with one replay more (``_x``, layer_replays)
        lo_x, hi_x = _cores(t, n, 1), _cores(t, st.n_chunk_hi, 1)
        out |= {"f_core_x": lo_x["f_core"], "b_core_x": lo_x["b_core"], "f_core_hi_x": hi_x["f_core"],
                "b_core_hi_x": hi_x["b_core"]}
    # the roots' copy-outs a forward may run under the host's issue: on the stages holding them
    # (pp 1's root unit, the embedding's on stage 0, [norm, output]'s on the head's stage)
    roots = (st.first | st.last) * _col(cp["root_out"]) + st.first * _col(cp["emb_out"]) + st.last * _col(cp["head_out"])
    host_pace_floor(cfg, c, st, out, roots)
    # the stage's chunks that replay one layer more than their length's fewest
    out["more_replays"] = np.zeros(st.n.shape)
    if lay.any():
        more = {k[:-2]: out.pop(k) for k in ("f_core_x", "b_core_x", "f_core_hi_x", "b_core_hi_x")}
        out["more_replays"] = more_replays(out, more, extra_replays(c, st.n, n, n_long), n, n_long, c.vpp)
    _tail(cfg, tt, st, s, cm, cp, t, out)
    return out
