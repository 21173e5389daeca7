"""A lower and an upper bound on the memory-timeline peak (:mod:`meshplan.memory.timeline`)
of many search candidates at once: arrays (candidates, stages), bytes.

Terms (sizes from :mod:`meshplan.search.memory`): init = persistent state less FSDP's
sharded gradients (they appear at each unit's first reduce-scatter) + NCCL buffers +
workspace; ``w`` chunk passes in flight at the first backward (1F1B ``min(pp - k, m)``,
interleaved: Megatron's warm-up + 1); A the saved activations of a layer; an FSDP unit u
is held as its all-gather output and as the unsharded copy (:mod:`meshplan.memory.unit_events`).

- **Lower bound**: the largest of running totals the timeline passes through, each
  computed from terms certainly live then: (F) the end of the ``w``-th forward: init + the
  saved activations of the ``w`` passes + the root units kept gathered (and, without
  ``reshard_after_forward``, the layers kept gathered from those forwards, also at H); (P) the first
  backward's first and second layer at their largest backward step (recomputed
  activations, the step's working set and the gradients written so far, the layer's copy
  and the next layer's prefetched output, the previous unit's reduce-scatter input);
  (Q) the same once every unit has its sharded gradient; (H) the loss's backward on the
  last stage; (W) the last layer of the ``w``-th forward with its working set, its copy
  and (FSDP2 keeps it till the next copy-out) its all-gather output; (S) the
  optimizer step (all state + its foreach temporaries); (A) where FSDP reduces after the
  last micro-batch (pp > 1, ``training.grad_accumulation``), the end of the first backward:
  init + the other passes' saved activations + the kept roots + its chunk's layers'
  unsharded accumulators and (but under ``no_sync``) their gathered copies; with vpp > 1
  and m > pp, at the end of chunk 0's first backward, init + the kept roots + the passes
  in flight + every chunk's accumulators (and gathered layers without
  ``reshard_after_forward``: under torch's window at vpp > 3, those of the chunks the timeline
  holds then, :func:`~meshplan.search.gather_passes.chunks_held`, at most the window's 3).
- **Per-layer AC** (``layer`` rows): each layer keeps ``none``'s saved activations or
  ``full``'s (checkpointed); the lower bound counts ``none``'s on the layers a pass surely
  keeps (:func:`meshplan.search.layer_replays.kept_in_flight`: torchtitan checkpoints every
  ``ac_freq``-th block it wraps; interleaved, each chunk's passes in flight), ``full``'s on
  the others; every other field takes the
  smaller of the two, the upper bound the larger.
- **Block recompute** (``block`` rows, Megatron-LM's first b layers of each chunk checkpointed):
  each field as per-layer AC's; the lower bound at a given b (``bounds``' ``block``, the search's
  :func:`~meshplan.search.block_bounds.least_block`) counts none's on the ``max(n - b, 0)``
  layers each pass in flight keeps whole (:func:`meshplan.search.layer_replays.kept_layers`),
  without it none: a bound for every b.
- **Split-backward schedules** (ZB-V, DualPipeV, ZB-H1: ``Stages.vshape``): the lower bound keeps F and W
  without the embedding's, the head's and the kept roots' terms; the upper bound counts the
  head's saved activations once per pass in flight. ZB-H1 (``Stages.lag``): the upper bound adds its
  lagging W passes' output gradients (``lag`` x (dense layers x ``d_wgrad`` + MoE layers x ``m_wgrad``), on
  the head's stage the final norm's ``h_wgrad`` and the logits gradient's excess) and the lower bound the logits gradient's shortfall against the loss terms per
  pass in flight, the timeline's ``w_lag`` and ``head_lag`` (:mod:`meshplan.memory.wlag`). ZB-V and DualPipeV
  (``Stages.v_lag``): the upper bound adds ``v_lag`` chunk passes of the longest chunk at the larger layer kind's
  output gradients (and the final norm's on the head's stage), the most the timeline's per-pass levels hold
  (:func:`meshplan.memory.wlag.cooldown_lag_levels`); the lower bound's F and W terms are forwards, where none lags.
- **Uneven chunks** (the Llama 3 split with vpp > 1: a stage's chunks differ by one layer):
  every lower-bound term grows with a chunk's layers and takes the stage's shortest chunk
  (``Stages.n_chunk``), the upper bound its longest (``n_chunk_hi``).
- **Upper bound**: all state + NCCL buffers + workspace + the saved activations of ``w``
  passes of the longest chunk at the largest layer kind (embedding terms each pass; head terms once: the last
  stage runs a head pass's backward right after its forward) + the root units (copy and
  all-gather output) + ``2 + max(1, prefetch)`` layer units (a copy, its output kept in
  forward and the prefetched ones; when layers stay gathered every layer's copy and ``2 + depth``
  outputs) + every accumulator with ``fsdp_reduce = "after_last"`` + the largest phase: a
  layer's backward (dY, its largest step with the gradients written, the previous unit's
  reduce input), a unit's reduce (its gradient and reduce input), the loss's backward, the
  embedding's gradient, a forward's working set; the gradient bucket without FSDP; or (S) if larger.

The bounds mirror the timeline's event order; a change there can move them. The search
plans exactly every candidate within ``[search] memory_margin`` of usable memory and checks
every plan it makes against them; tests check them against
:func:`meshplan.plan.build_plan` on every candidate of small worlds.
"""

from __future__ import annotations

import numpy as np

from meshplan.spec.deepspeed_reuse import DEEPSPEED_MAX_REUSE_ELEMENTS
from meshplan.pipeline.base import per_round
from meshplan.pipeline.interleaved import INTERLEAVED
from meshplan.pipeline.unshard_window import pipeline_window
from meshplan.search.gather_passes import chunks_held
from meshplan.search.layer_replays import block_rows, kept_in_flight, kept_layers
from meshplan.search.buffer_bounds import bucket_bytes, hpz_bytes, ipg_bytes, offload_staging_bytes, userbuffers_bytes
from meshplan.search.memory import Stages, Tables, comm_axes, deepep_bytes, lookup, split
from meshplan.search.candidate import accumulates
from meshplan.search.columns import LAYER_AC_FREQ, SHARDING, Candidates, bound_recompute
from meshplan.config import Config
from meshplan.spec.axes.base import Dim
from meshplan.units import dtype_bytes

ACT = ("saved", "rework", "fwd", "bwd", "single", "peak0", "peakg")
HEAD = ("embedding_saved", "head_saved", "head_loss_saved", "logits_temp", "logits_extra", "loss_grad_extra",
        "logits_grad_temp", "dy", "final_norm_work", "embedding_grad_extra", "loss_grad_kept",
        "embedding_backward_work")
#: The lagging W passes' output gradients a layer (dense, MoE) and the head's final norm hold (search.memory)
WGRAD = ("d_wgrad", "m_wgrad", "h_wgrad")


def bounds(cfg: Config, tables: Tables, c: Candidates, st: Stages, s: dict,
           block=None) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bound of each stage's timeline peak, bytes (candidates, pp); ``block``
    (candidates,): the b of ``block`` rows the lower bound holds at (None: every b)."""
    t, o = cfg.training, cfg.memory
    col = lambda a: a[:, None]
    fields = tuple(f"{p}{f}" for p in ("d_", "m_") for f in ACT)
    # per-layer AC (``layer``): each layer is checkpointed in full or keeps everything, so each
    # field is between the two policies' (the same lookup for every other policy)
    a, b = (lookup([split(c, Dim.HEADS), split(c, Dim.SEQUENCE), c.mb, bound_recompute(c.rc, r),
                    split(c, Dim.EXPERTS), split(c, Dim.EXPERT_FFN)], tables.acts, fields + HEAD + WGRAD)
            for r in ("none", "full"))  # Tables.acts has every field (head_sizes' keys)
    hs = {f: col(a[f]) for f in HEAD}
    u = units(cfg, tables, c, st)
    by = {k: {f: (col(fn(a["d_" + f], b["d_" + f])), col(fn(a["m_" + f], b["m_" + f]))) for f in ACT}
          for k, fn in (("lo", np.minimum), ("hi", np.maximum))}
    has_d, has_m = (st.n - st.n_moe) > 0, st.n_moe > 0
    pick = lambda d, x, fn: np.where(has_d & has_m, fn(d, x), np.where(has_m, x, d))
    peak = {k: pick(*_layer_peak(by[k], u, k), np.minimum if k == "lo" else np.maximum) for k in ("lo", "hi")}
    lo = {f: pick(*by["lo"][f], np.minimum) for f in ("saved", "rework", "fwd")}
    # a layer row's layers not checkpointed keep none's saved activations: each of those the
    # passes in flight surely hold (layer_replays.kept_in_flight) adds none's excess over the smaller field
    kept = pick(col(a["d_saved"]), col(a["m_saved"]), np.minimum)
    lo["kept"] = np.maximum(kept - lo["saved"], 0)
    hi = {f: pick(*by["hi"][f], np.maximum) for f in ("saved", "rework", "fwd", "bwd")}
    fixed = col(comm_axes(cfg, c)) * o.comm_bytes_per_group + o.workspace_bytes + col(ipg_bytes(cfg, c)) + deepep_bytes(cfg, c, st) \
        + hpz_bytes(cfg, c, s) + col(userbuffers_bytes(cfg, c)) + col(offload_staging_bytes(cfg, tables, c))
    opt_temp = o.optimizer_temp_bytes(t, s["optimizer"])
    at_step = s["total"] + fixed + opt_temp
    # a unit without FSDP-sharded dense parameters never allocates its share of the dense
    # gradients in the timeline (only expert units are sharded then)
    never = np.where(u["fsdp"] & ~u["act_d"], s["grads_dense"], 0)
    # ZB-H1 on the head's stage: every micro-batch in flight may hold the logits gradient for its W in
    # place of the loss terms (the timeline's head_lag; lower where those are larger)
    head_lag = np.where(st.lag > 0, st.last * st.w * np.minimum(hs["logits_grad_temp"] - hs["head_loss_saved"], 0), 0)
    lower = np.maximum(_lower(cfg, c, st, s, u, lo, peak["lo"], hs, fixed, block) + head_lag, at_step - never)
    # ZB-H1's lagging W passes (meshplan.memory.wlag): their layers' output gradients (dense, MoE), and on the
    # head's stage the final norm's and the logits gradient where it exceeds the loss terms freed: w_lag, head_lag
    lag = st.lag * ((st.n - st.n_moe) * col(a["d_wgrad"]) + st.n_moe * col(a["m_wgrad"])
                    + st.last * col(a["h_wgrad"]) + st.last * np.maximum(hs["logits_grad_temp"] - hs["head_loss_saved"], 0))
    # ZB-V's, DualPipeV's lagging W passes (meshplan.memory.wlag.cooldown_lag_levels): each a chunk pass of the
    # stage's longest chunk, every layer at the larger kind's output gradients, the final norm's on the head's stage
    lag = lag + st.v_lag * (st.n_chunk_hi * pick(col(a["d_wgrad"]), col(a["m_wgrad"]), np.maximum)
                            + st.last * col(a["h_wgrad"]))
    upper = np.maximum(_upper(cfg, c, st, s, u, hi, peak["hi"], hs, fixed) + lag, at_step)
    f = o.fragmentation_fraction
    if f:
        lower = lower + (f * lower).astype(np.int64)
        upper = upper + (f * upper).astype(np.int64) + 1
    return lower, upper


def _layer_peak(kinds: dict, u: dict, which: str) -> tuple[np.ndarray, np.ndarray]:
    """(dense, MoE) largest running total of one layer's backward steps above the layer's
    start, recomputed activations included: with the step gradients when FSDP holds them
    (a one-step layer holds its unit's whole unsharded gradient). The lower bound (``which``
    ``lo``) leaves the gradients out on rows whose DeepSpeed ZeRO-3 moves them into its ipg
    buffer (``ipg``; :func:`meshplan.memory.buffers.ipg_elements`: all but tensors larger than it)."""
    out = []
    held = u["act_d"] & ~u["ipg"] if which == "lo" else u["act_d"]
    for j, unit in ((0, u["grad_d"]), (1, u["grad_m"])):
        single = kinds["single"][j] > 0
        unit = np.where(u["ipg"], 0, unit) if which == "lo" else unit
        steps = np.where(held, kinds["peakg"][j], kinds["peak0"][j])
        out.append(kinds["rework"][j] + np.where(single, kinds["bwd"][j] + unit, steps))
    return out[0], out[1]


def _saved(lo: dict, layers: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Lower bound of the saved activations of ``layers`` layers of which ``kept`` (or more)
    a ``layer`` row keeps whole, bytes (candidates, pp): every layer at least ``lo["saved"]``,
    each kept one ``lo["kept"]`` more (none's saved activations)."""
    return layers * lo["saved"] + np.maximum(kept, 0) * lo["kept"]


def _lower(cfg, c, st, s, u, lo, layer_peak, hs, fixed, block=None) -> np.ndarray:
    """The largest of the running totals F, P, Q, H, W of the module docstring (``block``:
    :func:`bounds`')."""
    o, F = cfg.memory, u["fsdp"]
    per_mb = u["per_mb"]
    init = s["total"] - np.where(F, s["grads"], 0) + fixed
    v = c.vpp[:, None]
    g = per_round(c.pp[:, None], st.m_run)  # interleaved: micro-batches per round (pp when pp divides m)
    c0 = np.where(v == 1, st.w, INTERLEAVED.chunk_forwards(g, v, st.w))  # chunk-0 passes in flight
    # torch's window of 3 local stages evicts chunks at vpp > 3 (pipeline.unshard_window): a root
    # unit, or a chunk's layers kept from its forward, may then hold its shard only: not counted
    window = pipeline_window(cfg.training.framework, 2)  # vpp > 1 runs with pp > 1
    evicts = (v > window) & (window > 0)
    kept = np.where(F & ~evicts, u["roots_g"], 0)
    # layer rows: the layers kept whole in the w passes in flight
    kw = kept_in_flight(c, st.n_chunk, st.n_chunk_hi, g, st.w, st.vshape, block=block)
    one = lo["saved"] + (kw >= 1) * lo["kept"]  # one layer's saved activations (at most) of those
    f_end = init + _saved(lo, st.w * st.n_chunk, kw) + st.first * c0 * hs["embedding_saved"] + st.last * hs["head_saved"] + kept
    # DeepSpeed ZeRO-3 rows (``ds3``) prefetch up to max live (memory.deepspeed_fetch.deepspeed_prefetch)
    # and keep no all-gather output through a forward: neither counted
    pf = (o.prefetch_layers >= 1) & ~u["ds3"]
    near = lambda n: np.where(F, u["unit_min_g"] * (1 + ((n >= 2) & pf)), 0)
    head_reduce = np.where(F & ~u["root"], st.last * u["head"] * u["r"], 0).astype(np.int64)
    # P1/P2: the first backward's layers (after the head's backward on the last stage)
    base = f_end - st.last * hs["head_saved"] + hs["dy"] - np.where(F & ~u["root"], st.last * u["head_g"], 0)
    base = base + np.where(u["root"] & F & ~u["ipg"], u["early"], 0)
    p1 = base + head_reduce + near(st.n_chunk) + layer_peak
    reduce = np.where(F & per_mb, u["reduce_min"], 0)
    p2 = base - one + reduce + near(st.n_chunk - 1) + layer_peak
    out = np.maximum(np.maximum(f_end, p1), np.where(st.n_chunk >= 2, p2, 0))
    out = _loss_backward(out, c, st, u, hs, f_end, head_reduce, pf)
    out = _last_forward(out, cfg, c, st, u, lo, init, kw, evicts)
    if per_mb.any():
        out = np.where(per_mb, np.maximum(out, _steady(cfg, c, st, s, u, lo, layer_peak, hs, fixed, near, reduce,
                                                       block)), out)
    out = _accumulators(out, cfg, c, st, u, lo, init, kept, kw, g, window, evicts, block)
    # V-shaped schedules (ZB-V, DualPipeV): only the terms that hold for any order, F and W
    # without the embedding's, the head's and the kept roots' shares (the w-th forward may be
    # either chunk's, and DualPipeV's first backward comes before its peak)
    plain = init + _saved(lo, st.w * st.n_chunk, kw)
    keep_output = _keeps_output(cfg, c, u)
    pw_v = init + _saved(lo, st.w * st.n_chunk - 1, kw - 1) + np.where(F, u["unit_min_g"] * (1 + keep_output), 0) + lo["fwd"]
    return np.where(st.vshape, np.maximum(plain, pw_v), out)


def _loss_backward(out, c, st, u, hs, f_end, head_reduce, pf) -> np.ndarray:
    """``out`` raised to H (module docstring): the loss's and the head's backward on the last
    stage, at the end of the forwards ``f_end``; ``head_reduce``, ``pf``: :func:`_lower`'s."""
    F, per_mb = u["fsdp"], u["per_mb"]
    v = c.vpp[:, None]
    # H: the loss's backward on the last stage
    # torch's cross entropy (loss_grad_kept > 0) frees its transients and the kept log-softmax
    # before the compute-dtype logits gradient (memory.passes._torch_loss_backward)
    torch_ce = hs["loss_grad_kept"] > 0
    h1 = f_end + hs["loss_grad_extra"] + np.where(torch_ce, 0, hs["logits_grad_temp"])
    h1 = np.maximum(h1, np.where(torch_ce, f_end - hs["head_loss_saved"] + hs["loss_grad_kept"]
                                 + hs["logits_grad_temp"], 0))
    h2 = f_end - hs["head_loss_saved"] + hs["logits_grad_temp"] + hs["dy"] + np.where(F & pf, u["unit_min_g"], 0)
    # FSDP2 without reshard_after_forward keeps every layer it forwarded gathered until its
    # backward (gather_passes: only a chunk's first pass gathers): at the end of the w-th forward
    # and at the head's backward, before any layer's backward, the stage's layers at vpp 1, the
    # running chunk's at least otherwise (torch's window keeps it); F, P and W count one or two
    # of them (``near``, ``gathered``), so only F and H1 add them
    kg = np.where(F & ~u["ds3"] & (c.rf[:, None] == 0), np.where(v == 1, st.n, st.n_chunk) * u["unit_min_g"], 0)
    out = np.maximum(out, np.maximum(f_end + kg, np.where(st.last, h1 + kg, 0)))
    out = np.maximum(out, np.where(st.last, np.maximum(h1, h2), 0))
    # torchtitan's [norm, output] unit at pp 1: its reduce-scatter input allocated right after
    # the head's backward, beside its unsharded gradient, every layer's activations still saved
    # and, without reshard_after_forward, every layer still gathered (else the next one prefetched)
    kept_layers = (c.rf == 0)[:, None]
    h3 = f_end - hs["head_saved"] + hs["dy"] + np.where(u["ipg"], 0, u["head"]) + head_reduce \
        + np.where(F, np.where(kept_layers, st.n * u["unit_min_g"], np.where(pf, u["unit_min_g"], 0)), 0)
    out = np.maximum(out, np.where(st.last & F & ~u["root"] & u["pp1"] & per_mb, h3, 0))
    return out


def _keeps_output(cfg, c, u) -> np.ndarray:
    """Where a unit's all-gather output stays till the next copy-out in forward: FSDP2 keeps it,
    explicitly prefetched or not (memory.unit_events); of an MoE layer whose experts gather apart
    under torchtitan (ep > 1) only theirs: not counted there; DeepSpeed ZeRO-3 (``ds3``) keeps none."""
    split = (c.ep > 1)[:, None] & cfg.training.torchtitan_units if cfg.model.is_moe else False
    return ~u["ds3"] & ~split


def _last_forward(out, cfg, c, st, u, lo, init, kw, evicts) -> np.ndarray:
    """``out`` raised to W (module docstring): the w-th forward's last layer with its working set
    (``init``, ``kw``, ``evicts``: :func:`_lower`'s)."""
    F = u["fsdp"]
    # W: the w-th forward's last layer with its working set
    keep_output = _keeps_output(cfg, c, u)
    gathered = np.where(F, ~evicts * st.first * (u["emb_g"] * u["emb_kept"] + np.where(u["root"], u["head_g"], 0))
                        + u["unit_min_g"] * (1 + keep_output), 0)
    pw = init + _saved(lo, st.w * st.n_chunk - 1, kw - 1) + gathered + lo["fwd"]
    return np.maximum(out, pw)


def _accumulators(out, cfg, c, st, u, lo, init, kept, kw, g, window, evicts, block=None) -> np.ndarray:
    """``out`` raised to A (module docstring): FSDP's unsharded gradient accumulators at the end of
    the first backward, and with more than one interleaved round at chunk 0's (``init``, ``kept``,
    ``kw``, ``g``, ``window``, ``evicts``: :func:`_lower`'s)."""
    F, per_mb = u["fsdp"], u["per_mb"]
    v = c.vpp[:, None]
    # A: FSDP reducing after the last micro-batch (pp > 1, or grad_accumulation), the end of
    # the first backward: its chunk's unsharded reduce-dtype accumulators and (unless no_sync
    # reshards after backward) its layers still gathered, the other passes' saved activations
    keeps = (c.pp[:, None] > 1) | (cfg.training.grad_accumulation != "no_sync")  # no_sync: pp-1 candidates only
    after = F & ~per_mb
    # the roots' accumulators: the head's in the last stage's first backward, the embedding's
    # at the end of chunk 0's (the first backward's when vpp is 1)
    head_acc, emb_acc = st.last * u["head"] * u["r"], st.first * u["emb"] * u["r"]
    # one pass's kept layers off kw: a layer row's most, n - n // k; a block row's n - b
    one = np.where(block_rows(c) > 0, kept_layers(c, st.n_chunk, block), st.n_chunk - st.n_chunk // LAYER_AC_FREQ)
    acc = init + _saved(lo, (st.w - 1) * st.n_chunk, kw - one) + kept \
        + np.where(after, st.n_chunk * (u["reduce_min"] + keeps * u["unit_min_g"])
                   + (head_acc + (v == 1) * emb_acc).astype(np.int64), 0)
    # interleaved with more than one round (m > g): chunk 0's first backward comes before the
    # last chunk's last one, so at its end every chunk holds its accumulators (and, without
    # reshard_after_forward, its gathered layers)
    rounds = (v > 1) & (st.m_run > g)
    # (under torch's window at vpp > 3: the chunks the timeline holds then, gather_passes.chunks_held:
    # at most the window's, prefetched ones counted as the timeline counts their all-gather outputs)
    sel = evicts & (c.rf[:, None] == 0) & rounds.any(axis=1, keepdims=True) & after.any(axis=1, keepdims=True)
    whole = np.where(evicts, chunks_held(c, st, window, sel) * st.n_chunk, st.n)
    every = np.where(c.rf[:, None] > 0, st.n_chunk, whole) * keeps * u["unit_min_g"]
    done = (v - 1) * g + 1  # backwards run by then; the passes still in flight:
    live = np.maximum(np.minimum(st.w - 1, st.m_run * v - done), 0)  # steady state w - 1, fewer in the cool-down
    held_all = st.n * u["reduce_min"] + every + (head_acc + emb_acc).astype(np.int64)
    kl = kept_in_flight(c, st.n_chunk, st.n_chunk_hi, g, live, st.vshape, done, block)
    acc_all = init + kept + _saved(lo, live * st.n_chunk, kl) + np.where(after & rounds, held_all, 0)
    return np.maximum(out, np.maximum(acc, acc_all))


def _steady(cfg, c, st, s, u, lo, layer_peak, hs, fixed, near, reduce, block=None) -> np.ndarray:
    """Q: the first backward after every unit's first reduce-scatter (all sharded gradients
    allocated), at its first and second layer (roots not counted)."""
    v = c.vpp[:, None]
    total = st.m_run * v
    j = np.where(v == 1, 1, per_round(c.pp[:, None], st.m_run) * v)  # interleaved: one round of g v backwards
    live = np.minimum(total - j, st.w)
    # every unit's sharded gradient is allocated by then when the dense group is sharded (a
    # unit without FSDP-sharded parameters never allocates its share: not counted)
    init = s["total"] - np.where(u["fsdp"] & ~u["act_d"], s["grads"], 0) + fixed
    kl = kept_in_flight(c, st.n_chunk, st.n_chunk_hi, per_round(c.pp[:, None], st.m_run), live, st.vshape, j, block)
    base = init + _saved(lo, live * st.n_chunk, kl) + hs["dy"]
    q1 = base + near(st.n_chunk) + layer_peak
    q2 = base - lo["saved"] - (kl >= 1) * lo["kept"] + reduce + near(st.n_chunk - 1) + layer_peak
    q = np.where(st.n_chunk >= 2, np.maximum(q1, q2), q1)
    return np.where(total > j, q, 0)


def _upper(cfg, c, st, s, u, hi, layer_peak, hs, fixed) -> np.ndarray:
    """All state + the saved activations of ``w`` passes + the root units (copy and
    all-gather output) + the largest phase, each phase holding every transient it can at
    its largest (module docstring)."""
    o, F = cfg.memory, u["fsdp"]
    r = u["r"]
    # head terms once per pass in flight under a V (its chunk-1 passes), else once
    # each pass in flight at the stage's longest chunk (the Llama 3 split's chunks differ by one)
    acts = st.w * (st.n_chunk_hi * hi["saved"] + st.first * hs["embedding_saved"]) \
        + np.where(st.vshape, st.w, 1) * st.last * hs["head_saved"]
    depth = max(1, o.prefetch_layers, getattr(o, "forward_prefetch_layers", 0))
    few = u["per_mb"] & (c.rf[:, None] > 0)  # the candidate's reshard_after_forward
    # copies and outputs of layers: with every layer kept gathered, its n copies and at most
    # 2 + depth all-gather outputs (the current unit's, the previous one's until this copy-out,
    # the prefetched ones: memory.unit_events UnitEvents._unshard)
    held = np.where(few, (2 + depth) * u["unit_max"], np.minimum(2 * st.n, st.n + 2 + depth) * u["unit_max"])
    # DeepSpeed ZeRO-3: the units held and what its prefetch holds past them reach max live and run
    # on to the end of the parameter reaching it, one parameter past at most, the largest unsplit one
    # bounding it (spec.deepspeed_memory.deepspeed_ahead_bytes), and a prefetched part's torch.cat
    # copy, a bucket at most, is beside them at its wait (memory.deepspeed_fetch.deepspeed_fetch)
    ds3 = o.deepspeed_prefetch_bytes(cfg.training.model_copy(update={"sharding": "zero3", "zero3_engine": "deepspeed"}))
    if ds3:
        m, t = cfg.model, cfg.training
        one = max(x.numel * dtype_bytes(t.gather_dtype(x)) for i in {0, m.layers - 1} for x in m.layer_tensors(i))
        # stage3_max_reuse_distance d keeps parameters past max live across the forward -> backward
        # turn: the earliest kept one has under d elements used after it (each twice, or its layer's
        # rest once under recompute), so the kept ones are at most d/2 elements and a layer; the
        # layer computed beside them (spec.deepspeed_reuse.reuse_kept, memory.deepspeed_fetch)
        d = o.deepspeed_max_reuse_elements
        kept = (DEEPSPEED_MAX_REUSE_ELEMENTS if d is None else d) // 2 * dtype_bytes(t.param_dtype) + u["unit_max"]
        held = np.where(u["ds3"], np.maximum(held, np.maximum(ds3[1], kept + u["unit_max"]) + one) + ds3[0], held)
    red = lambda x: (x * r).astype(np.int64)
    accum = np.where(u["per_mb"], 0, red(st.n * u["unit_max"] + u["roots"]) + u["unit_max"])
    in_flight = red(np.maximum(u["unit_max"], np.maximum(u["head"], u["emb"])))
    layer = hs["dy"] + layer_peak + in_flight
    unit_reduce = hs["dy"] + u["unit_max"] + red(u["unit_max"])
    loss = st.last * (hs["dy"] + hs["loss_grad_extra"] + hs["logits_grad_temp"] + hs["final_norm_work"]
                      + u["head"] + red(u["head"]))
    emb = st.first * (hs["dy"] + hs["embedding_grad_extra"] + hs["embedding_backward_work"] + u["emb"]
                      + red(u["emb"]) + in_flight)
    fwd = hi["fwd"] + st.last * (hs["logits_temp"] + hs["logits_extra"])
    phase = np.maximum(np.maximum(layer, np.where(F, unit_reduce, 0)), np.maximum(np.where(F, loss, 0), emb))
    phase = np.maximum(phase, fwd)
    phase = np.maximum(phase, hs["dy"] + hi["rework"] + hi["bwd"])
    fsdp_terms = np.where(F, 2 * u["roots"] + held + accum, bucket_bytes(cfg, c, s))
    # Megatron Core's data-loader mask, b x s x s B on the end stages through their end chunks' forward
    # (memory.sizes.batch_mask_bytes): beside any phase at most
    mask = np.maximum(st.first, st.last) * (c.mb[:, None] * cfg.training.seq_len ** 2) \
        if cfg.training.core_attention_mask else 0
    return s["total"] + fixed + acts + fsdp_terms + phase + mask


def units(cfg: Config, tables: Tables, c: Candidates, st: Stages) -> dict:
    """FSDP unit bytes (compute dtype) per stage: smallest and largest layer unit, the
    embedding and head units (``roots``: those the stage keeps gathered from its forward;
    ``root``: pp 1, one unit), each layer kind's unsharded gradient, the smallest reduce
    input, ``r`` = reduce / compute dtype bytes, and ``fsdp``: the stage has FSDP units."""
    m, t = cfg.model, cfg.training
    col = lambda a: a[:, None]
    comp = dtype_bytes(t.compute_dtype)
    r = dtype_bytes(t.fsdp_reduce_dtype) / comp  # the table's reduce-scatter dtype
    on = (c.sh == SHARDING.index("zero3")) | (c.sh == SHARDING.index("hsdp"))
    act_d, act_e = col(on & (c.fsdp > 1)), col(on & (c.efsdp > 1))
    z = np.zeros_like(c.tp)
    dl = lookup([c.tp, c.ep, c.etp, z], tables.layer, ("dense", "expert"))
    ml = lookup([c.tp, c.ep, c.etp, z + 1], tables.layer, ("dense", "expert")) if m.is_moe else dl
    rt = lookup([c.tp], lambda tp: dict(zip(("emb", "norm", "out"), tables.roots(tp)[:3])), ("emb", "norm", "out"))
    out_on = col(rt["out"]) * ((not m.tied_embeddings) or (st.k.shape[1] > 1))
    ud = (col(dl["dense"]) * act_d + col(dl["expert"]) * act_e) * comp
    um = (col(ml["dense"]) * act_d + col(ml["expert"]) * act_e) * comp
    has_d, has_m = (st.n - st.n_moe) > 0, st.n_moe > 0
    umin = np.where(has_d & has_m, np.minimum(ud, um), np.where(has_m, um, ud))
    umax = np.where(has_d & has_m, np.maximum(ud, um), np.where(has_m, um, ud))
    emb, head = col(rt["emb"]) * act_d * comp, (col(rt["norm"]) + out_on) * act_d * comp
    # torchtitan's units (TrainingSpec.torchtitan_units, untied): the embedding and [norm,
    # output] are two units even at pp 1, the embedding resharded after forward with the layers
    # at every pp (tied: one unit at pp 1; under pp the first stage's embedding kept gathered)
    titan = t.framework == "torch" and t.zero3_engine != "deepspeed-2021" and not t.fsdp_root_unit and \
        not m.tied_embeddings
    root = np.broadcast_to(((c.pp == 1) & (c.vpp == 1) & (not titan))[:, None], st.n.shape)
    # training.reshard_head_after_forward (torchtitan's "always", candidates with
    # reshard_after_forward): neither end kept gathered from its forward
    again = t.reshard_head_after_forward
    emb_kept = col(np.broadcast_to(not titan and not again, c.rf.shape) | (c.rf == 0))
    # DeepSpeed ZeRO-3 at pp 1 with stage3_max_reuse_distance 0 releases the output layer after its
    # forward (memory.deepspeed_fetch.deepspeed_reuse: ReuseBytes.head_kept)
    ds0 = (c.sh == SHARDING.index("zero3")) & (c.pp == 1) & (c.vpp == 1) & (
        t.searched_zero3_engine == "deepspeed" and cfg.memory.deepspeed_max_reuse_elements == 0)
    head_kept = col((np.broadcast_to(not again, c.rf.shape) | (c.rf == 0)) & ~ds0)
    # all-gather outputs and their copies in the gather dtype (float8 Linear weights under
    # fp8_all_gather: units.units' ``gathered``); gradients and reduce inputs by elements
    dg = lookup([c.tp, c.ep, c.etp, z], tables.layer, ("dense_gather", "expert_gather"))
    mg = lookup([c.tp, c.ep, c.etp, z + 1], tables.layer, ("dense_gather", "expert_gather")) if m.is_moe else dg
    rg = lookup([c.tp], tables.roots_gather, ("emb", "norm", "out"))
    gd = col(dg["dense_gather"]) * act_d + col(dg["expert_gather"]) * act_e
    gm = col(mg["dense_gather"]) * act_d + col(mg["expert_gather"]) * act_e
    emb_g = col(rg["emb"]) * act_d
    head_g = (col(rg["norm"]) + col(rg["out"]) * ((not m.tied_embeddings) or (st.k.shape[1] > 1))) * act_d
    # FSDP reduces per micro-batch with pp 1 and grad_accumulation sync only
    # (MemoryOptions.fsdp_reduce_for, as memory.sizes.stage_sizes runs it); candidates outside
    # accumulates() are planned with sync (search.candidate.candidate_config)
    per_mb = col((c.pp == 1) & ~accumulates(cfg, c.pp, c.sh))
    return {"unit_min": umin, "unit_max": umax, "emb": emb, "head": head, "roots": st.first * emb + st.last * head,
            "root": root, "early": head, "grad_d": ud, "grad_m": um, "reduce_min": (umin * r).astype(np.int64),
            "r": r, "act_d": act_d, "fsdp": act_d | (act_e & has_m),
            "unit_min_g": np.where(has_d & has_m, np.minimum(gd, gm), np.where(has_m, gm, gd)), "emb_g": emb_g,
            "head_g": head_g, "roots_g": st.first * emb_g * emb_kept + st.last * head_g * head_kept,
            "per_mb": per_mb, "ipg": col(ipg_bytes(cfg, c) > 0),
            "ds3": col((c.sh == SHARDING.index("zero3")) & (t.searched_zero3_engine == "deepspeed")),
            "emb_kept": emb_kept, "pp1": np.broadcast_to(((c.pp == 1) & (c.vpp == 1))[:, None], st.n.shape)}
