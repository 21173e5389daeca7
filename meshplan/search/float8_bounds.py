"""The tp all-reduces a dense layer's float8 casts wait for, seconds per search candidate, for the
step-time lower bound (:func:`meshplan.search.comm_bounds.comm_times`' ``amax_f``, ``amax_b``, chained
with the layer by :mod:`meshplan.search.layer_chains`): the collective table's rows
(:mod:`meshplan.comm.tp_rows`), which the rank timeline waits for one after the other before the block
(:func:`meshplan.schedule.layer_waits.amax_wait`), under each way torch runs float8 Linears at tp > 1:

- torchao's float8 TP (tensorwise, ``training.fp8_tp``): one 8 B amax a cast of a tp shard
  (:func:`meshplan.compute.float8_tp_reduces.tp_amax_per_layer`), forward counted as with ``fp8_all_gather`` (the
  fewer: Llama 4 against 11), a lower bound;
- tensorwise under plain TP (``fp8_tp = false``): one 8 B amax a cast of a tp-sharded DTensor, exactly,
  at each row's ``fp8_all_gather`` (:func:`plain_tp_counts`);
- rowwise under plain TP (``fp8_recipe = "rowwise"``): one fp64 scale a token of the rank's micro-batch,
  or one a hidden unit, exactly (:func:`rowwise_times`).

A fully recomputed layer replays its forward's (the chains add ``amax_f`` to the replay).
"""

from __future__ import annotations

import numpy as np

from meshplan.comm.tp_rows import FLOAT8_AMAX_BYTES
from meshplan.compute import float8, float8_tp_reduces
from meshplan.compute.dtensor_sp import float8_tp
from meshplan.compute.ops import Workload
from meshplan.compute.kernel_choices import float8_gemms
from meshplan.config import Config
from meshplan.search.columns import FSDP_SHARDINGS, Candidates
from meshplan.search.time_tables import TimeTables, coll_times


def amax_times(cfg: Config, tt: TimeTables, c: Candidates, seq: np.ndarray) -> dict[str, np.ndarray]:
    """``amax_f``, ``amax_b``: seconds of a dense layer's float8 tp all-reduces in forward and backward
    per candidate (module docstring); ``seq``: the ways the sequence is split (cp), per candidate."""
    m, t = cfg.model, cfg.training
    one = np.ones_like(c.tp)
    names = float8_gemms(m, t).get("float8_gemms", frozenset()) if float8_tp(m, t) else frozenset()
    n_f, n_b = plain_tp_counts(cfg, c, *float8_tp_reduces.tp_amax_per_layer(names, True))
    amax = np.where(c.tp > 1, coll_times(tt, "all-reduce", c.tp, one * FLOAT8_AMAX_BYTES, one), 0.0)
    rw_f, rw_b = rowwise_times(cfg, tt, c, seq)
    return {"amax_f": n_f * amax + rw_f, "amax_b": n_b * amax + rw_b}


def _workload(cfg: Config) -> Workload:
    """The config's float8 Linears as a Workload at tp 2, standing for any tp > 1 in
    :mod:`meshplan.compute.float8`'s rules (the rows at tp 1 get no all-reduce: ``c.tp > 1``), as
    :func:`meshplan.comm.tp_rows._workload` builds a stage's."""
    t = cfg.training
    return Workload(seq_len=t.seq_len, tp=2, megatron_ops=t.framework == "megatron", **float8_gemms(cfg.model, t))


def plain_tp_counts(cfg: Config, c: Candidates, n_f: int, n_b: int):
    """(forward, backward) amax all-reduces per dense layer of each candidate: tensorwise float8 Linears
    under torch's plain TP (``training.fp8_tp = false``: :func:`meshplan.compute.float8.tensorwise_plain_tp`)
    the plan's own count, :func:`~meshplan.compute.float8_tp_reduces.plain_tp_amax_per_layer` at the row's
    ``fp8_all_gather`` (the config's, on FSDP rows with dp_shard > 1:
    :func:`meshplan.search.candidate._training_knobs`; Llama 2 or 9 forward, 5 backward), as
    :func:`meshplan.comm.tp_rows.tp_rows` issues them; elsewhere ``n_f``, ``n_b`` (float8 TP's, or 0)."""
    w = _workload(cfg)
    if not float8.tensorwise_plain_tp(cfg.model, w):
        return n_f, n_b
    gathered = cfg.training.fp8_all_gather & np.isin(c.sh, FSDP_SHARDINGS) & (c.dps > 1)
    (f1, b1), (f0, b0) = (float8_tp_reduces.plain_tp_amax_per_layer(w.float8_gemms, g) for g in (True, False))
    return np.where(gathered, f1, f0), np.where(gathered, b1, b0)


def rowwise_times(cfg: Config, tt: TimeTables, c: Candidates, seq: np.ndarray) -> tuple:
    """(forward, backward) seconds per dense layer of the rowwise float8 scales' tp all-reduces under
    plain TP (:func:`meshplan.compute.float8.rowwise_tp`; 0 elsewhere): per layer
    :func:`~meshplan.compute.float8_tp_reduces.rowwise_tp_per_layer` calls of each kind (Llama 2 forward, 5
    backward), one fp64 scale a token of the rank's micro-batch (mb x s / cp) or one a hidden unit, as
    :func:`meshplan.comm.tp_rows._rowwise_scale_rows` sizes them."""
    m, t = cfg.model, cfg.training
    w = _workload(cfg)
    if not float8.rowwise_tp(m, w):
        return 0.0, 0.0
    one = np.ones_like(c.tp)
    n_f, n_b = float8_tp_reduces.rowwise_tp_per_layer(w.float8_gemms)
    tokens = c.mb * (t.seq_len // seq) * FLOAT8_AMAX_BYTES
    both = coll_times(tt, "all-reduce", c.tp, tokens, one) + coll_times(tt, "all-reduce", c.tp,
                                                                         one * m.hidden * FLOAT8_AMAX_BYTES, one)
    both = np.where(c.tp > 1, both, 0.0)
    return n_f * both, n_b * both
