"""The search space of ``meshplan search``: every mesh of a config's model, cluster and
training contract, as columns of numpy arrays, and the validity rules of
:mod:`meshplan.mesh.validity` evaluated on all of them at once.

Axis order and placement. A candidate's mesh is always in the canonical order
``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first, tp innermost (stride 1), with
ranks placed node-major (rank r on node ``r // gpus_per_node``): tp groups are consecutive
ranks inside an NVLink domain, cp and the FSDP axis (dp_shard x cp) come next, and the
rarely communicating pp outermost. This is the order torchtitan's ``ParallelDims`` builds
and the only one searched: other orders put a less frequent axis on the faster links. For
MoE models ``ep`` and ``etp`` (1 or tp; 1 with ep > 1 under framework torch, torchtitan having
no ETP since c4b409a: :func:`~meshplan.spec.axes.ep.etp_values`) re-factor the dense block ``dp_shard x cp x tp``
(:mod:`meshplan.mesh.resolve`). Axes of degree 1 are left out of the mesh.

Dimensions (each narrowed by :class:`~meshplan.spec.search.SearchOptions`):

- degrees: every factorization of the world over the registered dense axes (five today:
  :func:`~meshplan.spec.axes.registry.search_axes`), tp <= ``max_tp``, and under an MoE model the
  expert axes' degrees (:mod:`meshplan.search.space_degrees`);
- sequence parallel: on exactly when tp > 1;
- micro-batch sizes; recompute none, full, Megatron-LM's selective (not by default where
  torchtitan is the runtime, which has no option for it:
  :func:`~meshplan.search.space_recompute.searched_recompute`), and under a framework that has it
  (:attr:`~meshplan.spec.training.TrainingSpec.has_op_recompute`: torch with FSDP2) torchtitan's
  op-level selective AC ``op`` where meshplan plans it
  (:func:`~meshplan.search.space_recompute.op_recompute_ok`), and where the planner refuses ``op``
  for the model (ep > 1, MLA) torchtitan's per-layer AC ``layer`` at ac_freq 2
  (:func:`~meshplan.search.space_recompute.layer_for_op`); under ``training.framework = "megatron"``
  Megatron-LM's block recompute ``block``, one row per mesh whose n the exact planner picks
  (:mod:`~meshplan.search.block_recompute`);
- virtual stages: 1, and when pp > 1 divides the layers the divisors of layers / pp up to
  ``max_vpp``, run with interleaved 1F1B; vpp 1 runs 1F1B. When pp does not divide the
  layers the stages get :func:`~meshplan.mesh.layers.balanced_split` (first and last stage
  one layer fewer), as the Llama 3 405B example does; with vpp > 1 such a pp is searched
  with the Llama 3 split only (below);
- sharding: zero1 and zero3 with dp_replicate 1, and zero2 (dp_replicate 1) where DeepSpeed's
  engine runs the config's ZeRO (:func:`zero2_searched`); hsdp (zero3 inside dp_shard x cp,
  replicated over dp_replicate) with dp_replicate > 1; an hsdp row that shards nothing (dp_shard x
  cp 1, no expert shard) is DDP, named ``ddp`` (:attr:`~meshplan.search.columns.Candidates.replicated`),
  and rejected under ``framework = "torch"``, rule ``replicate``. zero1 with dp_replicate > 1 is not
  searched: meshplan's collective table reduces ZeRO-1 gradients over the FSDP axis only;
  zero1 without a data axis (dp_shard x cp 1) is its zero3 twin's run and left out
  (:func:`no_data_axis_twin`); under ``framework = "torch"`` without DeepSpeed's engine zero1
  is rejected, rule ``framework`` (:func:`zero1_refused`);
- ``training.reshard_after_forward`` true and false where parameters are FSDP-sharded
  (zero3 or hsdp with a shard degree > 1);
- ``training.tp_comm_overlap`` off and on where tp > 1 (Megatron-LM ``--tp-comm-overlap``);
- DeepSpeed ZeRO++ hpZ's ``training.zero_hpz_partition_size`` (column ``hz``): the config's, the
  node's GPU count and 1 on the zero3 rows DeepSpeed's ZeRO-3 runs whose data axis is the whole
  world over more than one node, or the config sets hpZ (:func:`hpz_applies`), 1 elsewhere;
- the pipeline schedule (``[search] pp_schedules``): 1F1B / interleaved 1F1B (``ps`` 0), and
  where asked with pp > 1 and vpp 2 the V-shaped ZB-V (1) and DualPipeV (2), with pp > 1 and vpp 1
  ZB-H1 (3) (:func:`_expand_schedules`);
- with pp >= 3, also :func:`ends_short_split` (first and last stage lighter by the embedding
  and the output layer, Llama 3's rule): with vpp 1 where it differs from the default split;
  with vpp > 1 (interleaved 1F1B) where (layers + 2) / (pp x vpp) is a whole number >= 1
  (Llama 3's rule: the embedding and the output layer each take a layer's slot, every virtual
  stage the same slots), each stage's layers spread over its chunks by
  :func:`~meshplan.mesh.layers.stage_layers` (the short chunks at the model's ends: 14
  layers, pp 4, vpp 2 give stages 3, 4, 4, 3 and virtual stages 1, 2, 2, 2 | 2, 2, 2, 1), as
  Llama 3 405B ran its 126 layers at pp 16 (Dubey et al. 2024, 3.3.2). The V-shaped schedules keep even chunks.
  For a torchtitan file the vpp 1 row of this kind is torchtitan's default cut instead, where it is
  not the default split already (which splits, and which torchtitan cuts are not searched and why:
  :func:`~meshplan.search.candidate.torchtitan_cut`). The bounds take the stage's
  shortest chunk (``Stages.n_chunk``) where a smaller count lowers them and its longest
  (``n_chunk_hi``) where a larger one raises them.

>>> from meshplan.config import config_from_dict
>>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
>>> c = enumerate_candidates(cfg)
>>> len(c), int(c.tp.max())  # 1,024 none/full without the knobs (reshard, short ends; tp overlap
...                            # only with torch_compile), + 240 with op (tp = cp = 1); 32 + 2 layers are
...                            # not a multiple of pp x vpp: no short-ends interleaved candidate; less zero1
...                            # rows without a data axis, their zero3 twins kept (no_data_axis_twin); no
...                            # selective under torchtitan (searched_recompute): 2,348 with it, whose
...                            # 2,124 rows other than op were a third each none, selective, full (-708);
...                            # op at tp > 1 too since nc57 #7 (op_recompute_ok: cp = 1): + 144, one op row
...                            # per none row at cp 1 and tp > 1
(1784, 8)
>>> # one per none row at cp 1: 224 at tp 1 (16 at pp 8 left) + 144 at tp 2, 4, 8
>>> op = c.rc == RECOMPUTE.index("op")
>>> int(op.sum()), int((op & (c.tp == 1)).sum()), int(c.tp[op].max())
(368, 224, 8)
>>> candidate_config(cfg, c, 0).mesh.names, SHARDING[c.sh[0]]  # ZeRO-1: its data axis is dp (axis_shown)
(['dp'], 'zero1')
"""

from __future__ import annotations

from dataclasses import fields
from typing import Mapping

import numpy as np

from meshplan.config import Config
from meshplan.mesh.layers import ends_short_split, first_last_sets
from meshplan.spec.axes.registry import search_axes
from meshplan.spec.axes.tp import max_tp  # noqa: F401 (the search's name for it)
# the search's names, importable from here (their homes: columns, reasons, candidate)
from meshplan.search.columns import (FSDP_SHARDINGS, PIPELINE, RECOMPUTE, SEARCHED, SHARDING,  # noqa: F401
                                     ZERO12, Candidates, axis_shown, candidate_schedule, world_of)
from meshplan.search.reasons import (CODE, OK, REASONS, first_reason, reason_table,  # noqa: F401
                                     reason_texts, zero1_refused)
from meshplan.search.candidate import (accumulates, candidate_config, megatron_split,  # noqa: F401
                                       sharding_knobs, sharding_training, stage_split, titan_split)
from meshplan.search.space_degrees import dense_meshes, expert_meshes
from meshplan.search.space_recompute import layer_for_op, layer_rows, op_recompute_ok, searched_recompute
from meshplan.search.block_recompute import block_searched, chunk_layers


def _vpp_ok(layers: int, pp: np.ndarray, v: int) -> np.ndarray:
    """Whether v virtual stages are searched with pp stages (see the module docstring)."""
    if v == 1:
        return np.ones(pp.shape, dtype=bool)
    return (pp > 1) & (layers % pp == 0) & ((layers // np.maximum(pp, 1)) % v == 0)


def short_ok(cfg: Config, pp: np.ndarray, vpp) -> np.ndarray:
    """Where the Llama 3 split (:func:`ends_short_split`) is a candidate of its own, per row of
    pipeline degree ``pp`` and virtual stages ``vpp`` (arrays; one call of ends_short_split per
    distinct pair). Under ``training.framework = "megatron"`` at vpp 1 only where Megatron-LM's
    ``--decoder-first/last-pipeline-num-layers`` set it (:func:`~meshplan.mesh.layers.first_last_sets`)
    and it differs from the default split (:func:`stage_split`, Megatron-LM's cut, which it equals
    wherever pp does not divide the layers and it is set: 61 layers at pp 8 give [7, 8 x 6, 6] both
    ways); with vpp > 1 it is Megatron-LM's ``--account-for-embedding/loss-in-pipeline-split``. For a
    torchtitan file (:func:`~meshplan.search.candidate.titan_split`) at vpp 1 the row's split is
    torchtitan's own cut (:func:`~meshplan.search.candidate.torchtitan_cut`), a candidate where it
    differs from the default split (balanced, or even where pp divides the layers)."""
    pp = np.asarray(pp, dtype=np.int64)
    vpp = np.broadcast_to(np.asarray(vpp, dtype=np.int64), pp.shape)
    if not pp.size:
        return np.zeros(pp.shape, dtype=bool)
    layers, megatron, titan = cfg.model.layers, megatron_split(cfg), titan_split(cfg)

    def ok(p: int, v: int) -> bool:
        if titan and v == 1:  # torchtitan's own cut where it is not the default (balanced) split already
            cut = stage_split(layers, p, 1, short=True, titan=True)
            return cut is not None and cut != (stage_split(layers, p, 1) or [layers // p] * p)
        split = ends_short_split(layers, p, v)
        if split is None or v > 1 or not megatron:
            return split is not None
        return first_last_sets(split) and split != stage_split(layers, p, 1, first_last=True)

    return lookup_pairs(pp, vpp, ok)


def lookup_pairs(a: np.ndarray, b: np.ndarray, fn) -> np.ndarray:
    """``fn(a, b)`` (a bool) once per distinct pair of the int arrays ``a``, ``b``, broadcast back."""
    code = a * (int(b.max()) + 1) + b
    keys, inv = np.unique(code, return_inverse=True)
    span = int(b.max()) + 1
    vals = np.array([fn(int(k // span), int(k % span)) for k in keys.tolist()], dtype=bool)
    return vals[inv.reshape(-1)]


def enumerate_candidates(cfg: Config) -> Candidates:
    """The whole search space of ``cfg`` (module docstring), before any rule."""
    o, layers = cfg.search, cfg.model.layers
    meshes = expert_meshes(cfg, dense_meshes(cfg))
    vpps = o.vpp if o.vpp is not None else list(range(1, o.max_vpp + 1))
    blocks = []
    for sh in (s for s in o.sharding if s != "zero2" or zero2_searched(cfg.training)):
        keep = meshes[:, 1] > 1 if sh == "hsdp" else meshes[:, 1] == 1
        for v in vpps:
            even = _vpp_ok(layers, meshes[:, 0], v)
            # vpp > 1 where only the Llama 3 split fills the chunks (pp does not divide the layers):
            # kept with a flag, searched with ``us`` 1 only (below)
            sel = keep & (even | short_ok(cfg, meshes[:, 0], v))
            if sel.any():
                blocks.append(np.hstack([meshes[sel], np.full((int(sel.sum()), 1), v),
                                         np.full((int(sel.sum()), 1), SHARDING.index(sh)), even[sel, None]]))
    names = [col.column for _, col in search_axes()]
    base = np.vstack(blocks) if blocks else np.zeros((0, len(names) + 3), dtype=np.int64)
    mbs = np.array(sorted(set(o.micro_batch)), dtype=np.int64)
    stand_in = layer_for_op(cfg)
    rcs = np.array(sorted({RECOMPUTE.index(r) for r in searched_recompute(cfg) + ["layer"] * stand_in
                           + ["block"] * block_searched(cfg)}), dtype=np.int64)
    n, a, b = len(base), len(mbs), len(rcs)
    rows = np.repeat(base, a * b, axis=0)
    c = rows.T
    cols = {name: c[k] for k, name in enumerate(names)}
    cols.update(mb=np.tile(np.repeat(mbs, b), n), rc=np.tile(rcs, n * a), vpp=c[len(names)], sh=c[len(names) + 1],
                even=c[len(names) + 2])
    op = cols["rc"] == RECOMPUTE.index("op")
    if op.any():
        keep = ~op | op_recompute_ok(cfg, cols["tp"], cols["cp"], cols["ep"])
        cols = {k: v[keep] for k, v in cols.items()}
    if stand_in:  # layer beside op at ep > 1 and with MLA (layer_rows)
        keep = (cols["rc"] != RECOMPUTE.index("layer")) | layer_rows(cfg, cols["ep"])
        cols = {k: v[keep] for k, v in cols.items()}
    fsdp = np.isin(cols["sh"], FSDP_SHARDINGS) & ((cols["dps"] * cols["cp"] > 1) | (
        cfg.model.is_moe & (cols["dps"] * cols["cp"] * cols["tp"] > cols["ep"] * cols["etp"])))
    cols = _expand(cols, "rf", _flags(o.reshard_after_forward, True), fsdp, 1)
    # torch's async TP needs torch.compile (TrainingSpec): without it tp_comm_overlap stays off
    cols = _expand(cols, "ov", _flags(o.tp_comm_overlap, False) if overlap_searched(cfg.training) else [0],
                   cols["tp"] > 1, 0)
    cols = _expand(cols, "hz", hpz_values(cfg), hpz_applies(cfg, cols), 1)
    cols = _expand(cols, "us", _flags(o.uneven_stages, False), short_ok(cfg, cols["pp"], cols["vpp"]), 0)
    keep = (cols["us"] > 0) | (cols["even"] > 0)  # vpp > 1 with pp not dividing the layers: the short ends only
    cols = {k: v[keep] for k, v in cols.items() if k != "even"}
    cols = _expand_schedules(cols, o.pp_schedules)
    keep = ~no_data_axis_twin(cfg, cols)
    cols = {k: v[keep] for k, v in cols.items()}
    own = {f.name for f in fields(Candidates)} - {"hz"}
    more = {k: v for k, v in cols.items() if k not in own and k != "hz"}
    block = block_searched(cfg)  # a block row's n, picked by the exact planner, counts its largest chunk's layers
    return Candidates(**{k: v for k, v in cols.items() if k in own}, more=more, moe=cfg.model.is_moe,
                      rd=reshard_defaults(cfg, cols["sh"], cols["pp"]), hz=cols["hz"],
                      rn=np.zeros(len(cols["pp"]), dtype=np.int64) if block else None,
                      rm=np.zeros(len(cols["pp"]), dtype=np.int64) if block else None,
                      rk=chunk_layers(cfg, cols["pp"], cols["vpp"], cols["us"]) if block else None)


def _expand_schedules(cols: dict, schedules) -> dict:
    """``cols`` with the ``ps`` column (:data:`PIPELINE`): each row with pp > 1 once per schedule of
    ``schedules`` (``[search] pp_schedules``) that runs at its vpp and split: 1F1B (interleaved 1F1B
    with vpp > 1) everywhere, the V-shaped ones at vpp 2 with the default (even) chunks (their chunk
    map puts the model's ends on one stage, which the Llama 3 split's lighter first and last stage
    does not fit), ZB-H1 at vpp 1 with either split (1F1B's chunk map: torch builds it with one stage
    per rank, :func:`meshplan.spec.mesh.multi_stage_refusal` refuses more); a row no listed schedule
    runs is left out, and the pp 1 rows are kept once (``ps`` 0).

    >>> cols = {"pp": np.array([1, 2, 2, 2]), "vpp": np.array([1, 1, 2, 2]), "us": np.array([0, 1, 0, 1])}
    >>> out = _expand_schedules(cols, ["1f1b", "zbv", "zb_h1"])
    >>> list(zip(out["pp"].tolist(), out["vpp"].tolist(), out["ps"].tolist()))
    [(1, 1, 0), (2, 1, 0), (2, 1, 3), (2, 2, 0), (2, 2, 1), (2, 2, 0)]
    >>> _expand_schedules(cols, ["zb_h1"])["ps"].tolist()
    [0, 3]
    """
    piped = cols["pp"] > 1
    runs = {"1f1b": piped, "zbv": piped & (cols["vpp"] == 2) & (cols["us"] == 0),
            "dualpipev": piped & (cols["vpp"] == 2) & (cols["us"] == 0), "zb_h1": piped & (cols["vpp"] == 1)}
    parts = [np.flatnonzero(~piped)] + [np.flatnonzero(runs[name]) for name in PIPELINE if name in schedules]
    codes = [np.zeros(parts[0].size, dtype=np.int64)] + [np.full(rows.size, PIPELINE.index(name), dtype=np.int64)
                                                          for name, rows in zip([x for x in PIPELINE if x in schedules],
                                                                                parts[1:])]
    idx, ps = np.concatenate(parts), np.concatenate(codes)
    order = np.lexsort((ps, idx))  # each row's schedules next to it, in PIPELINE's order
    out = {k: v[idx[order]] for k, v in cols.items()}
    out["ps"] = ps[order]
    return out


def hpz_values(cfg: Config) -> list[int]:
    """The hpZ g the search tries (:func:`hpz_applies`): ``[search] zero_hpz_partition_size`` where
    given (in its order, once each: ``[1]`` holds hpZ off), else the config's
    ``zero_hpz_partition_size`` first (the enumeration's order breaks ties), then the node's GPU count
    (g the GPUs of one node, the paper's and DeepSpeed's tutorial's setting: the secondary group on
    NVLink), then 1 (no secondary partition).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 2},
    ...     "training": {"global_batch": 16, "seq_len": 1024, "sharding": "zero3", "zero3_engine": "deepspeed"}},
    ...     require_mesh=False)
    >>> hpz_values(cfg)
    [1, 8]
    >>> from dataclasses import replace
    >>> from meshplan.spec.search import SearchOptions
    >>> hpz_values(replace(cfg, search=SearchOptions(zero_hpz_partition_size=[8, 8])))
    [8]
    """
    held = cfg.search.zero_hpz_partition_size
    return list(dict.fromkeys(held if held else [cfg.training.zero_hpz_partition_size, cfg.cluster.node.gpus, 1]))


def hpz_applies(cfg: Config, cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """The rows the search varies hpZ on: zero3 under DeepSpeed's ZeRO-3 of today
    (:attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine` ``deepspeed``; its 2021
    engine and FSDP2 have no ZeRO++), the data axis the whole world (DeepSpeed builds the secondary
    groups from consecutive world ranks: :func:`meshplan.plan_checks.check_zeropp`) and spanning
    more than one node: on one node hpZ's group of the node's GPUs is the primary group, so it only
    adds the secondary partition and its copy (varied there too where the config or ``[search]
    zero_hpz_partition_size`` sets hpZ). Every g of :func:`hpz_values` must divide the data
    axis (``_ensure_divisibility``)."""
    if cfg.training.searched_zero3_engine != "deepspeed":
        return np.zeros(cols["sh"].shape, dtype=bool)
    fsdp, node = cols["dps"] * cols["cp"], cfg.cluster.node.gpus
    whole = (cols["tp"] == 1) & (cols["ep"] == 1) & (cols["dpr"] == 1) & (cols["pp"] == 1) & (cols["cp"] == 1)
    divides = np.ones(fsdp.shape, dtype=bool)
    for g in hpz_values(cfg):
        divides &= fsdp % g == 0
    # the config's own g, or a g [search] holds, on one node too
    wide = (fsdp > node) | (max([cfg.training.zero_hpz_partition_size] + (cfg.search.zero_hpz_partition_size or [])) > 1)
    return (cols["sh"] == SHARDING.index("zero3")) & whole & wide & divides


def reshard_defaults(cfg: Config, sh: np.ndarray, pp: np.ndarray) -> np.ndarray:
    """``reshard_after_forward``'s default (1/0) of rows of sharding ``sh`` (:data:`SHARDING`
    indices) and pipeline degree ``pp``: :meth:`~meshplan.spec.training.TrainingSpec.reshard_default`
    of the training each row runs (:func:`~meshplan.search.candidate.sharding_training`: its
    sharding and engine), the one rule the plan resolves an unset value by. The tie rule and the
    labels weigh a row's setting against it (:mod:`meshplan.search.rank`).

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...     "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
    >>> z3, z1 = SHARDING.index("zero3"), SHARDING.index("zero1")
    >>> reshard_defaults(cfg, np.array([z3, z3, z1]), np.array([1, 2, 2])).tolist()
    [1, 0, 1]
    """
    t = cfg.training
    if not len(sh):
        return np.ones(0, dtype=np.int64)
    return lookup_pairs(sh, pp, lambda s, p: sharding_training(t, SHARDING[s]).reshard_default(p)).astype(np.int64)


def no_data_axis_twin(cfg: Config, cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """The zero1 (and zero2) rows of the columns ``cols`` (:class:`Candidates`' names) that are
    the same run as a zero3 row beside them, which the search keeps instead: no data axis shards
    anything (dp_shard x cp 1, and no routed expert sharded over efsdp; dp_replicate is 1 there),
    so they plan the same state and no data-parallel collective, and the zero3 one (FSDP2) zeroes
    no gradient buffer (:data:`meshplan.schedule.optimizer_step.ZEROED_GRAD_BUFFER`): its step is
    never longer, the one the tie rule prefers (llama3-8b, pp 2 x tp 4, mb 1, full: 1.36137 s
    against zero1's 1.36272 s, the same peak). Only where ``[search] sharding`` has zero3 and its
    engine is FSDP2 (DeepSpeed's 2021 engine rejects zero3 with pp > 1)."""
    sh = cols["sh"]
    if "zero3" not in cfg.search.sharding or cfg.training.zero3_engine != "fsdp2":
        return np.zeros(sh.shape, dtype=bool)
    fsdp = cols["dps"] * cols["cp"]
    efsdp = np.maximum(fsdp * cols["tp"] // np.maximum(cols["ep"] * cols["etp"], 1), 1)
    return np.isin(sh, ZERO12) & (fsdp == 1) & ((efsdp == 1) | (not cfg.model.is_moe))


def overlap_searched(training) -> bool:
    """Whether the search varies ``training.tp_comm_overlap``: under Megatron-LM (not Megatron-DeepSpeed,
    whose parser has no ``--tp-comm-overlap``: :attr:`~meshplan.spec.training_engines.TrainingEngines.megatron_deepspeed`),
    and under torch with ``torch_compile`` (torchtitan's async TP needs torch.compile)."""
    return (training.framework == "megatron" and not training.megatron_deepspeed) or training.torch_compile


def _flags(allowed, default: bool) -> list[int]:
    """Values of a boolean dimension as 0/1, ``default`` first (None: both)."""
    vals = [default, not default] if allowed is None else sorted(set(allowed), key=lambda x: x != default)
    return [int(x) for x in vals]


def _expand(cols: dict, key: str, values: list[int], applies: np.ndarray, neutral: int) -> dict:
    """Each row where ``applies`` once per value of the new column ``key``, in order; the
    other rows once, with ``neutral``."""
    reps = np.where(applies, len(values), 1)
    idx = np.repeat(np.arange(applies.size), reps)
    pos = np.arange(idx.size) - np.repeat(np.cumsum(reps) - reps, reps)
    out = {k: v[idx] for k, v in cols.items()}
    out[key] = np.where(applies[idx], np.asarray(values, dtype=np.int64)[pos % len(values)], neutral)
    return out


def zero2_searched(training) -> bool:
    """Whether the search enumerates sharding ``zero2``: DeepSpeed's ZeRO-2, where the config's
    ZeRO runs DeepSpeed's engine (``training.zero12_engine = "deepspeed"``, what a DeepSpeed
    stage 1 or 2 config imports to, or a DeepSpeed stage 3 config's ``zero3_engine = "deepspeed"``:
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero12_engine`): it models both stages
    (:mod:`meshplan.comm.deepspeed_zero12`), so a ZeRO-1 config's search weighs ZeRO-2 and the other
    way round. Elsewhere it is not
    searched: torch has no ZeRO-2 engine (FSDP2 with ``reshard_after_forward`` false, the
    ZeRO-2-like run, is the zero3 candidate kept gathered) and Megatron-LM's is its FSDP.

    >>> from meshplan.spec.training import TrainingSpec
    >>> zero2_searched(TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed"))
    True
    >>> zero2_searched(TrainingSpec(global_batch=8, seq_len=16, framework="megatron"))
    False
    """
    return training.searched_zero12_engine == "deepspeed"
