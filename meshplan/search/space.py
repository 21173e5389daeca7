"""The search space of ``meshplan search``: every mesh of a config's model, cluster and
training contract, as columns of numpy arrays, and the validity rules of
:mod:`meshplan.mesh.validity` evaluated on all of them at once.

Axis order and placement. A candidate's mesh is always in the canonical order
``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first, tp innermost (stride 1), with
ranks placed node-major (rank r on node ``r // gpus_per_node``): tp groups are consecutive
ranks inside an NVLink domain, cp and the FSDP axis (dp_shard x cp) come next, and the
rarely communicating pp outermost. This is the order torchtitan's ``ParallelDims`` builds
and the only one searched: other orders put a less frequent axis on the faster links. For
MoE models ``ep`` and ``etp`` (1 or tp) re-factor the dense block ``dp_shard x cp x tp``
(:mod:`meshplan.mesh.resolve`). Axes of degree 1 are left out of the mesh.

Dimensions (each narrowed by :class:`~meshplan.spec.search.SearchOptions`):

- degrees: every factorization of the world over the registered dense axes (five today:
  :func:`~meshplan.spec.axes.registry.search_axes`), tp <= ``max_tp``;
- sequence parallel: on exactly when tp > 1;
- micro-batch sizes; recompute none, selective, full, and under a framework that has it
  (:attr:`~meshplan.spec.training.TrainingSpec.has_op_recompute`: torch with FSDP2)
  torchtitan's op-level selective AC ``op`` where meshplan plans it (:func:`op_recompute_ok`);
- virtual stages: 1, and when pp > 1 divides the layers the divisors of layers / pp up to
  ``max_vpp``, run with interleaved 1F1B; vpp 1 runs 1F1B. When pp does not divide the
  layers the stages get :func:`~meshplan.mesh.layers.balanced_split` (first and last stage
  one layer fewer), as the Llama 3 405B example does; with vpp > 1 such a pp is searched
  with the Llama 3 split only (below);
- sharding: zero1 and zero3 with dp_replicate 1, and zero2 (dp_replicate 1) where DeepSpeed's
  engine runs the config's ZeRO (:func:`zero2_searched`); hsdp (zero3 inside dp_shard x cp,
  replicated over dp_replicate) with dp_replicate > 1. zero1 with dp_replicate > 1 is not
  searched: meshplan's collective table reduces ZeRO-1 gradients over the FSDP axis only;
  zero1 without a data axis (dp_shard x cp 1) is its zero3 twin's run and left out
  (:func:`no_data_axis_twin`); under ``framework = "torch"`` without DeepSpeed's engine zero1
  is rejected, rule ``framework`` (:func:`zero1_refused`);
- ``training.reshard_after_forward`` true and false where parameters are FSDP-sharded
  (zero3 or hsdp with a shard degree > 1);
- ``training.tp_comm_overlap`` off and on where tp > 1 (Megatron-LM ``--tp-comm-overlap``);
- the pipeline schedule (``[search] pp_schedules``): 1F1B / interleaved 1F1B (``ps`` 0), and
  where asked with pp > 1 and vpp 2 the V-shaped ZB-V (1) and DualPipeV (2);
- with pp >= 3, also :func:`ends_short_split` (first and last stage lighter by the embedding
  and the output layer, Llama 3's rule): with vpp 1 where it differs from the default split;
  with vpp > 1 (interleaved 1F1B) where (layers + 2) / (pp x vpp) is a whole number >= 1
  (Llama 3's rule: the embedding and the output layer each take a layer's slot, every virtual
  stage the same slots), each stage's layers spread over its chunks by
  :func:`~meshplan.mesh.layers.stage_layers` (the short chunks at the model's ends: 14
  layers, pp 4, vpp 2 give stages 3, 4, 4, 3 and virtual stages 1, 2, 2, 2 | 2, 2, 2, 1), as
  Llama 3 405B ran its 126 layers at pp 16 (Dubey et al. 2024, 3.3.2). The V-shaped schedules keep even chunks. The bounds take the stage's
  shortest chunk (``Stages.n_chunk``) where a smaller count lowers them and its longest
  (``n_chunk_hi``) where a larger one raises them.

>>> from meshplan.config import config_from_dict
>>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
>>> c = enumerate_candidates(cfg)
>>> len(c), int(c.tp.max())  # 1,536 none/selective/full without the knobs (reshard, short ends; tp
...                            # overlap only with torch_compile), + 240 with op (tp = cp = 1); 32 + 2 layers
...                            # are not a multiple of pp x vpp: no short-ends interleaved candidate; less
...                            # 184 zero1 rows without a data axis (pp x tp = 8: 46 a micro-batch), their
...                            # zero3 twins kept (no_data_axis_twin)
(2348, 8)
>>> int((c.rc == RECOMPUTE.index("op")).sum()), int(c.tp[c.rc == RECOMPUTE.index("op")].max())  # 16 at pp 8 left
(224, 1)
>>> candidate_config(cfg, c, 0).mesh.names, SHARDING[c.sh[0]]  # ZeRO-1: its data axis is dp (axis_shown)
(['dp'], 'zero1')
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from math import prod
from typing import Mapping, Optional

import numpy as np

from meshplan.mesh.layers import balanced_split, ends_short_split  # noqa: F401 (the search's name for it)
from meshplan.config import Config
from meshplan.pipeline.registry import get
from meshplan.spec.axes.base import divisors
from meshplan.spec.axes.registry import AXES, rules, search_axes
from meshplan.spec.axes.tp import max_tp
from meshplan.spec.mesh import MeshSpec, Schedule
from meshplan.spec.training import TrainingSpec, deepspeed_grad_dtype
from meshplan.spec.wording import data_axis, mesh_text

RECOMPUTE = ("none", "selective", "full", "op")
#: Searched shardings (the ``sh`` column); zero2 last, so that adding it kept the others' codes.
SHARDING = ("zero1", "zero3", "hsdp", "zero2")

#: The pipeline schedules' own rules the search evaluates (each schedule's ``refused`` under
#: ``training.framework``: :meth:`OneFOneB.refused`, torch's m >= pp for candidates with vpp 1;
#: :meth:`Interleaved1F1B.refused`, m a multiple of pp under Megatron-LM or of torch's rounds
#: max(1, m // pp), for candidates with vpp > 1; :meth:`DualPipeV.refused`: m >= 2 pp, torch
#: ScheduleDualPipeV), then the rules applied after the plan's checks.
_SCHEDULE_REASONS = (
    ("runs", "training.pp_schedule_runs does not divide the micro-batches (pp > 1)"),
    ("1f1b", "1F1B: micro-batches fewer than pp (torch Schedule1F1B)"),
    ("interleaved", "interleaved 1F1B: micro-batches not a multiple of pp (megatron) or of torch's rounds"),
    ("dualpipev", "DualPipeV: micro-batches fewer than 2 pp"),
    ("engine", "zero3_engine deepspeed or deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered; "
               "zero12_engine deepspeed: cp > 1, ep > 1, or pp > 1 with zero2, overlap_comm, vpp > 1 or a schedule "
               "other than 1F1B"),
    ("framework", "zero1 under framework torch: no torch engine shards the optimizer alone (torchtitan cannot run it)"),
)
_LATE_REASONS = (
    ("memory", "memory peak > usable"),
    ("gemm", "local GEMM efficiency below the threshold"),
)


def reason_table() -> tuple[tuple[str, str], ...]:
    """Rejection categories (key, summary), in the order build_plan finds them: every
    registered axis's rules with a vectorised form, in their order (mesh resolution, then
    :func:`meshplan.mesh.validity.check`), then the schedules' rules, then the memory timeline
    and the search's own GEMM rule."""
    axis = tuple((r.key, r.summary) for r in rules() if r.bad is not None)
    return axis + _SCHEDULE_REASONS + _LATE_REASONS


#: The ``engine`` rule's words per (sharding family, engine) (:data:`_SCHEDULE_REASONS` holds them all,
#: for a table that names no config): current DeepSpeed's ZeRO-1/2 engine (``zero12_engine``), its
#: ZeRO-3 (``zero3_engine = "deepspeed"``, which a DeepSpeed ZeRO-1/2 search plans its zero3 rows
#: with: :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`) and the ZeRO-3 of 2021.
_ENGINE_TEXT = {("zero12", "deepspeed"): "zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 "
                                         "with zero2, overlap_comm, vpp > 1 or a schedule other than 1F1B",
                ("zero3", "deepspeed"): "zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 "
                                        "or parameters kept gathered",
                ("zero3", "deepspeed-2021"): "zero3_engine deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered"}


def reason_texts(training) -> dict[str, str]:
    """:data:`REASONS` as a dict, the ``engine`` rule labelled by the engine(s) ``training``
    actually plans (``zero12_engine = "deepspeed"``, the zero3 rows' engine
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`), so a search of current
    DeepSpeed's ZeRO-1/2 does not name the 2021 ZeRO-3 engine.

    >>> from meshplan.spec.training import TrainingSpec
    >>> reason_texts(TrainingSpec(global_batch=8, seq_len=16, sharding="zero2", zero12_engine="deepspeed"))["engine"]
    "zero12_engine deepspeed (DeepSpeed's ZeRO-1/2): cp > 1, ep > 1, or pp > 1 with zero2, overlap_comm, vpp > 1 or a schedule other than 1F1B; zero3 rows under DeepSpeed's ZeRO-3 (zero3_engine deepspeed): pp > 1, cp > 1 or parameters kept gathered"
    >>> reason_texts(TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed-2021"))["engine"]
    'zero3_engine deepspeed-2021: pp > 1, cp > 1 or parameters kept gathered'
    """
    engines = engine_texts(training)
    text = dict(REASONS)
    if engines:
        text["engine"] = "; ".join(engines.values())
    return text


def engine_texts(training) -> dict[str, str]:
    """The ``engine`` rule's words per sharding family (``zero12``, ``zero3``) of the engines
    ``training`` plans, so a count can name the rule that rejected its rows alone."""
    planned = {("zero12", training.searched_zero12_engine), ("zero3", training.searched_zero3_engine)}
    return {k[0]: _ENGINE_TEXT[k] for k in _ENGINE_TEXT if k in planned}


#: :func:`reason_table` of the registered axes.
REASONS = reason_table()
OK = -1
CODE = {key: i for i, (key, _) in enumerate(REASONS)}


@dataclass(frozen=True)
class Candidates:
    """One row per candidate; every column an int64 array. ``rc`` indexes
    :data:`RECOMPUTE`, ``sh`` indexes :data:`SHARDING`; ``rf``: reshard_after_forward (1/0),
    ``ov``: tp_comm_overlap (1/0), ``us``: the stages' layers by :func:`ends_short_split` (1)
    or the default split (0; :func:`stage_split`); ``ps`` indexes :data:`PIPELINE` (the
    pipeline schedule). The degree columns are the registered axes' search columns
    (:func:`meshplan.spec.axes.registry.search_axes`); one registered without an attribute
    here sits in ``more``."""

    pp: np.ndarray
    dpr: np.ndarray
    dps: np.ndarray
    cp: np.ndarray
    tp: np.ndarray
    ep: np.ndarray
    etp: np.ndarray
    mb: np.ndarray
    rc: np.ndarray
    vpp: np.ndarray
    sh: np.ndarray
    rf: np.ndarray
    ov: np.ndarray
    us: np.ndarray
    ps: np.ndarray
    more: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.pp.size)

    def take(self, idx) -> "Candidates":
        cols = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "more"}
        return Candidates(**cols, more={k: v[idx] for k, v in self.more.items()})

    def degree(self, column: str) -> np.ndarray:
        """The degree column of a registered axis by its search column name (``tp``,
        ``dps``, or a column in ``more``)."""
        return self.more[column] if column in self.more else getattr(self, column)

    @property
    def fsdp2(self) -> np.ndarray:
        """FSDP2 shards the parameters (zero3 or hsdp), the column the ep axis's
        ``expert_dim1`` rule reads (:func:`meshplan.spec.axes.ep._fsdp2`)."""
        return (self.sh == SHARDING.index("zero3")) | (self.sh == SHARDING.index("hsdp"))

    @property
    def sp(self) -> np.ndarray:
        """Sequence parallel: on exactly where tp > 1."""
        return self.tp > 1

    @property
    def dp(self) -> np.ndarray:
        """Batch data-parallel degree: dp_replicate x dp_shard (cp excluded)."""
        return self.dpr * self.dps

    @property
    def fsdp(self) -> np.ndarray:
        """Dense shard degree: dp_shard x cp."""
        return self.dps * self.cp

    @property
    def efsdp(self) -> np.ndarray:
        """Expert shard degree: dp_shard x cp x tp / (ep x etp) (integer where valid)."""
        return np.maximum(self.dps * self.cp * self.tp // (self.ep * self.etp), 1)

    def label(self, i: int) -> str:
        """``pp 16 x dp_shard 128 x tp 8, mb 1, full, vpp 1, zero3`` (the mesh as
        :func:`meshplan.spec.wording.mesh_text` prints it), then ``, keep gathered``
        (reshard_after_forward false), ``, tp overlap`` and ``, short end stages`` where they apply."""
        names, degs = zip(*((n, int(self.degree(col.column)[i])) for n, col in search_axes()))
        mesh = mesh_text(names, degs, SHARDING[self.sh[i]])
        extra = "".join(t for on, t in ((not self.rf[i], ", keep gathered"), (self.ov[i], ", tp overlap"),
                                         (self.us[i], ", short end stages"), (self.ps[i], f", {PIPELINE[self.ps[i]]}"))
                        if on)
        return (f"{mesh}, mb {int(self.mb[i])}, {RECOMPUTE[self.rc[i]]}, vpp {int(self.vpp[i])}, "
                f"{SHARDING[self.sh[i]]}{extra}")


def axis_shown(name, sharding: str) -> str:
    """A search axis's name in a candidate's mesh: the data axis ``dp_shard`` is ``dp`` under
    ZeRO-1/2 (:func:`meshplan.spec.wording.data_axis`), as ``plan`` prints the mesh a Megatron-LM
    or DeepSpeed config imports to (the search columns keep ``dp_shard``; ``--json``'s ``mesh``
    keys and the text follow this rule, :func:`meshplan.spec.wording.mesh_text`).

    >>> axis_shown("dp_shard", "zero2"), axis_shown("dp_shard", "zero3"), axis_shown("tp", "zero1")
    ('dp', 'dp_shard', 'tp')
    """
    return data_axis(sharding) if str(name) == "dp_shard" else str(name)


def _allowed(values, allowed) -> list[int]:
    return [v for v in values if allowed is None or v in allowed]


def dense_meshes(cfg: Config) -> np.ndarray:
    """Every dense mesh with product = world, one column per registered dense search axis in
    mesh order (``(pp, dp_replicate, dp_shard, cp, tp)``): array (k, axes). Each axis takes
    the divisors of the world the outer axes leave (``[search]`` narrows them, its ``bound``
    caps them), the remainder axis (dp_shard) what is left."""
    o, world = cfg.search, cfg.cluster.world
    cols = [c for n, c in search_axes() if not AXES[n].expert]
    free = [k for k, c in enumerate(cols) if not c.remainder]
    rest = [k for k, c in enumerate(cols) if c.remainder]
    caps = [(c.bound(cfg) if c.bound is not None else None) or world for c in cols]  # a degree is at most the world
    out: list[tuple[int, ...]] = []

    def walk(j: int, left: int, row: list[int]) -> None:
        if j == len(free):
            if not rest and left != 1:  # no remainder axis: the free ones must make the world
                return
            full = list(row) + [left] * len(rest)  # one remainder axis takes what is left
            degs = [0] * len(cols)
            for k, v in zip(free + rest, full):
                degs[k] = v
            ok = all(_option_ok(o, cols[k], degs[k]) for k in rest)
            if ok and all(degs[k] <= caps[k] for k in range(len(cols))):
                out.append(tuple(degs))
            return
        col = cols[free[j]]
        for v in _allowed(divisors(left), getattr(o, col.option, None)):
            walk(j + 1, left // v, row + [v])

    walk(0, world, [])
    return np.array(out, dtype=np.int64).reshape(-1, len(cols))


def _option_ok(o, col, v: int) -> bool:
    allowed = getattr(o, col.option, None)
    return allowed is None or v in allowed


def _expert_meshes(cfg: Config, dense: np.ndarray) -> np.ndarray:
    """Dense meshes x every registered expert axis's degrees: (k, dense + expert axes).
    Dense models: each expert axis 1."""
    dense_cols = [c.column for n, c in search_axes() if not AXES[n].expert]
    experts = [c for n, c in search_axes() if AXES[n].expert]
    if not cfg.model.is_moe:
        return np.hstack([dense, np.ones((len(dense), len(experts)), dtype=np.int64)])
    o, rows = cfg.search, []
    for d in dense:
        named = dict(zip(dense_cols, (int(x) for x in d)))
        combos: list[tuple[int, ...]] = [()]
        for col in experts:
            combos = [c + (v,) for c in combos for v in _allowed(col.values(cfg, named) if col.values else [1],
                                                               getattr(o, col.option, None))]
        rows += [(*d, *c) for c in combos]
    return np.array(rows, dtype=np.int64).reshape(-1, len(dense_cols) + len(experts))


def _vpp_ok(layers: int, pp: np.ndarray, v: int) -> np.ndarray:
    """Whether v virtual stages are searched with pp stages (see the module docstring)."""
    if v == 1:
        return np.ones(pp.shape, dtype=bool)
    return (pp > 1) & (layers % pp == 0) & ((layers // np.maximum(pp, 1)) % v == 0)


def short_ok(cfg: Config, pp: np.ndarray, vpp) -> np.ndarray:
    """Where the Llama 3 split (:func:`ends_short_split`) is a candidate of its own, per row of
    pipeline degree ``pp`` and virtual stages ``vpp`` (arrays; one call of ends_short_split per
    distinct pair)."""
    pp = np.asarray(pp, dtype=np.int64)
    vpp = np.broadcast_to(np.asarray(vpp, dtype=np.int64), pp.shape)
    if not pp.size:
        return np.zeros(pp.shape, dtype=bool)
    return lookup_pairs(pp, vpp, lambda p, v: ends_short_split(cfg.model.layers, p, v) is not None)


def lookup_pairs(a: np.ndarray, b: np.ndarray, fn) -> np.ndarray:
    """``fn(a, b)`` (a bool) once per distinct pair of the int arrays ``a``, ``b``, broadcast back."""
    code = a * (int(b.max()) + 1) + b
    keys, inv = np.unique(code, return_inverse=True)
    span = int(b.max()) + 1
    vals = np.array([fn(int(k // span), int(k % span)) for k in keys.tolist()], dtype=bool)
    return vals[inv.reshape(-1)]


def op_recompute_ok(cfg: Config, tp: np.ndarray, cp: np.ndarray, ep: np.ndarray) -> np.ndarray:
    """Where ``recompute = "op"`` is searched: tp = cp = ep = 1 and no multi-head latent attention.
    :func:`meshplan.plan.build_plan` refuses cp or ep > 1 (which CP and EP collectives its replay
    runs is not modelled) and MLA (which of its mms the policy saves is not modelled); it plans
    tp > 1 with sequence parallelism (the replay repeats the tp all-gathers, the reduce-scatters'
    outputs are saved), which the search leaves out: its step-time bound
    (:func:`meshplan.search.timing.chains`) replays op as full recompute, tp reduce-scatters
    included, which the policy saves: no lower bound of such a plan's step.

    >>> from meshplan.config import config_from_dict
    >>> cfg = config_from_dict({"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...                         "training": {"global_batch": 8, "seq_len": 1024}}, require_mesh=False)
    >>> op_recompute_ok(cfg, np.array([1, 2, 1]), np.array([1, 1, 2]), np.array([1, 1, 1])).tolist()
    [True, False, False]
    """
    return (tp == 1) & (cp == 1) & (ep == 1) & (not cfg.model.is_mla)


def enumerate_candidates(cfg: Config) -> Candidates:
    """The whole search space of ``cfg`` (module docstring), before any rule."""
    o, layers = cfg.search, cfg.model.layers
    meshes = _expert_meshes(cfg, dense_meshes(cfg))
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
    rcs = np.array(sorted(RECOMPUTE.index(r) for r in set(o.recompute) if r != "op" or cfg.training.has_op_recompute),
                   dtype=np.int64)
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
    fsdp = np.isin(cols["sh"], FSDP_SHARDINGS) & ((cols["dps"] * cols["cp"] > 1) | (
        cfg.model.is_moe & (cols["dps"] * cols["cp"] * cols["tp"] > cols["ep"] * cols["etp"])))
    cols = _expand(cols, "rf", _flags(o.reshard_after_forward, True), fsdp, 1)
    # torch's async TP needs torch.compile (TrainingSpec): without it tp_comm_overlap stays off
    cols = _expand(cols, "ov", _flags(o.tp_comm_overlap, False) if overlap_searched(cfg.training) else [0],
                   cols["tp"] > 1, 0)
    cols = _expand(cols, "us", _flags(o.uneven_stages, False), short_ok(cfg, cols["pp"], cols["vpp"]), 0)
    keep = (cols["us"] > 0) | (cols["even"] > 0)  # vpp > 1 with pp not dividing the layers: the short ends only
    cols = {k: v[keep] for k, v in cols.items() if k != "even"}
    piped = cols["pp"] > 1
    # the V-shaped schedules take the default (even) chunks: their chunk map puts the model's
    # ends on one stage, which the Llama 3 split's lighter first and last stage does not fit
    cols = _expand(cols, "ps", [PIPELINE.index(x) for x in PIPELINE if x in o.pp_schedules],
                   piped & (cols["vpp"] == 2) & (cols["us"] == 0), 0)
    if "1f1b" not in o.pp_schedules:  # only the V-shaped schedules with pp > 1
        keep = ~piped | (cols["ps"] > 0)
        cols = {k: v[keep] for k, v in cols.items()}
    keep = ~no_data_axis_twin(cfg, cols)
    cols = {k: v[keep] for k, v in cols.items()}
    own = {f.name for f in fields(Candidates)}
    return Candidates(**{k: v for k, v in cols.items() if k in own}, more={k: v for k, v in cols.items() if k not in own})


def no_data_axis_twin(cfg: Config, cols: Mapping[str, np.ndarray]) -> np.ndarray:
    """The zero1 (and zero2) rows of the columns ``cols`` (:class:`Candidates`' names) that are
    the same run as a zero3 row beside them, which the search keeps instead: no data axis shards
    anything (dp_shard x cp 1, and no routed expert sharded over efsdp; dp_replicate is 1 there),
    so they plan the same state and no data-parallel collective, and the zero3 one (FSDP2) zeroes
    no gradient buffer (:data:`meshplan.schedule.steptime.ZEROED_GRAD_BUFFER`): its step is
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
    """Whether the search varies ``training.tp_comm_overlap``: under Megatron-LM, and under torch
    with ``torch_compile`` (torchtitan's async TP needs torch.compile)."""
    return training.framework == "megatron" or training.torch_compile


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


#: The searched shardings DeepSpeed's ZeRO-1/2 engine runs (``training.zero12_engine``).
ZERO12 = (SHARDING.index("zero1"), SHARDING.index("zero2"))


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


def zero1_refused(training) -> bool:
    """Whether the search rejects zero1 candidates under ``training`` (rule ``framework``): where
    no engine runs meshplan's zero1 (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`;
    plan and step warn instead, :func:`meshplan.plan.runtime_warnings`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> [zero1_refused(TrainingSpec(global_batch=8, seq_len=16, **kw)) for kw in
    ...  ({}, {"framework": "megatron"}, {"sharding": "zero1", "zero12_engine": "deepspeed"})]
    [True, False, False]
    """
    return not training.has_zero1_engine


def first_reason(cfg: Config, c: Candidates) -> np.ndarray:
    """Code (index into :func:`reason_table`, :data:`REASONS` for the registered axes) of
    the first rule each candidate breaks, in build_plan's order, or :data:`OK`; the memory
    and GEMM rules are applied later. The axes' rules are their :attr:`Rule.bad` predicates
    (the ones :func:`meshplan.mesh.validity.check` runs on one mesh) over the columns."""
    m, t = cfg.model, cfg.training
    micro = t.global_batch // np.maximum(c.mb * c.dp, 1)
    runs = np.where(c.pp > 1, t.pp_schedule_runs, 1)  # build_plan's run_reasons: each run is one schedule
    run_micro = micro // runs
    checks = [(r.key, r.bad(m, t, c)) for r in rules() if r.bad is not None] + [
        ("runs", micro % runs != 0),
        # the schedules' own micro-batch rules (their refused, as build_plan's reasons): 1F1B
        # with vpp 1, interleaved 1F1B with vpp > 1, DualPipeV
        ("1f1b", (c.pp > 1) & (c.ps == 0) & (c.vpp == 1) & get(SEARCHED).refused(c.pp, run_micro, t.framework)),
        ("interleaved", (c.ps == 0) & (c.vpp > 1)
         & get(get(SEARCHED).for_chunks(2)).refused(c.pp, run_micro, t.framework)),
        ("dualpipev", (c.ps == PIPELINE.index("dualpipev")) & get("dualpipev").refused(c.pp, run_micro, t.framework)),
        # build_plan and TrainingSpec: DeepSpeed's pipeline engine refuses ZeRO 3 (pp 1 only), no
        # all-gather CP, and its ZeRO-3 re-gathers in backward (reshard_after_forward is an FSDP2 knob)
        ("engine", ((t.searched_zero3_engine != "fsdp2") & (c.sh == SHARDING.index("zero3"))
                    & ((c.pp > 1) | (c.cp > 1) | (c.rf == 0)))
         # DeepSpeed's ZeRO-1 and ZeRO-2 (comm.deepspeed_zero12.check_mesh; dp_replicate 1 here):
         # its pipeline engine refuses ZeRO-2 and overlap_comm and runs 1F1B only (check_schedule)
         # (overlap_comm as given, else stages 1 and 2's default false: TrainingSpec.overlaps_comm)
         | ((t.searched_zero12_engine == "deepspeed") & np.isin(c.sh, ZERO12)
            & ((c.cp > 1) | (c.ep > 1) | ((c.pp > 1) & (bool(t.overlap_comm) | (c.sh == SHARDING.index("zero2"))
                                                          | (c.vpp > 1) | (c.ps != 0)))))),
        ("framework", zero1_refused(t) & (c.sh == SHARDING.index("zero1"))),
    ]
    code = {key: i for i, (key, _) in enumerate(reason_table())}
    out = np.full(len(c), OK, dtype=np.int64)
    for key, bad in reversed(checks):
        out[np.broadcast_to(bad, out.shape)] = code[key]
    return out


#: The schedule the search plans a candidate with by default (a candidate with vpp > 1 runs
#: its ``chunked`` order, interleaved 1F1B).
SEARCHED = Schedule.ONE_F_ONE_B

#: Values of the ``ps`` column: the default family, then the V-shaped schedules
#: (``[search] pp_schedules``).
PIPELINE = ("1f1b", "zbv", "dualpipev")


def candidate_schedule(vpp: int, ps: int = 0) -> Schedule:
    """The schedule of a candidate with ``vpp`` chunks per rank and schedule column ``ps``:
    :data:`SEARCHED` with vpp 1, its ``chunked`` order (interleaved 1F1B) with vpp > 1; the
    V-shaped one ``ps`` names (:data:`PIPELINE`).

    >>> candidate_schedule(1), candidate_schedule(2), candidate_schedule(2, 1)
    (<Schedule.ONE_F_ONE_B: '1f1b'>, <Schedule.INTERLEAVED_1F1B: 'interleaved_1f1b'>, <Schedule.ZBV: 'zbv'>)
    """
    return Schedule(PIPELINE[ps]) if ps else get(SEARCHED).for_chunks(vpp)


def stage_split(layers: int, pp: int, vpp: int, short: bool = False):
    """``pp_layer_split`` of a candidate: :func:`ends_short_split` when ``short`` (per stage,
    with vpp > 1 spread over the chunks by :func:`~meshplan.mesh.layers.stage_layers`); else None
    when pp divides the layers (even stages) or vpp > 1, else
    :func:`~meshplan.mesh.layers.balanced_split`."""
    if short:
        return ends_short_split(layers, pp, vpp)
    if pp == 1 or vpp > 1 or layers % pp == 0 or pp > layers:
        return None
    return balanced_split(layers, pp)


#: The searched shardings whose parameters FSDP2 shards (zero3, hsdp): the ones
#: ``training.fp8_all_gather`` and ``training.grad_accumulation`` apply to.
FSDP_SHARDINGS = tuple(i for i, s in enumerate(SHARDING) if s in ("zero3", "hsdp"))


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
    without FSDP (ZeRO-1 gathers no parameters; the float8 GEMMs stay),
    ``reshard_head_after_forward`` off without FSDP or ``reshard_after_forward``, and the
    fields of its sharding (:func:`sharding_knobs`), as
    :class:`~meshplan.spec.training.TrainingSpec` requires of a config."""
    t, out = cfg.training, dict[str, object]()
    if t.grad_accumulation != "sync" and not accumulates(cfg, c.pp[i], c.sh[i]):
        out["grad_accumulation"] = "sync"
    if t.fp8_all_gather and int(c.sh[i]) not in FSDP_SHARDINGS:
        out["fp8_all_gather"] = False
    if t.reshard_head_after_forward and (int(c.sh[i]) not in FSDP_SHARDINGS or not c.rf[i]):
        out["reshard_head_after_forward"] = False  # torchtitan's "always" reshards what FSDP2 shards
    return out | sharding_knobs(t, SHARDING[c.sh[i]])


def sharding_knobs(t: TrainingSpec, sharding: str) -> dict:
    """The training fields that change with the searched ``sharding`` of a row searched from
    the config's training ``t`` (the row's engine and what follows from it):
    ``zero3_engine`` back to ``fsdp2`` outside sharding zero3 (DeepSpeed's engine is for ZeRO
    stage 3; with it ``grad_dtype`` back to its default where it is the parameter dtype, the
    engine's default; ``contiguous_gradients`` off), its zero1 and zero2 rows under DeepSpeed's
    ZeRO-1/2 (``zero12_engine = "deepspeed"``,
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero12_engine`; ``overlap_comm`` as
    given, else the stage's DeepSpeed default),
    ``zero12_engine`` back to ``megatron`` (and ``overlap_comm`` off) outside zero1 and zero2, its
    zero3 rows under DeepSpeed's ZeRO-3 (``zero3_engine = "deepspeed"``,
    :attr:`~meshplan.spec.training.TrainingSpec.searched_zero3_engine`),
    ``overlap_grad_reduce`` / ``overlap_param_gather`` off outside zero1 (Megatron-LM's DDP-buffer
    flags). The plan's (:func:`candidate_config`) and the memory bound's
    (:func:`meshplan.search.bounds.bounds`, through :func:`sharding_training`).

    >>> from meshplan.spec.training import TrainingSpec
    >>> t = TrainingSpec(global_batch=8, seq_len=16, zero3_engine="deepspeed", grad_dtype="bf16")
    >>> sorted(sharding_knobs(t, "zero1").items())
    [('contiguous_gradients', None), ('grad_dtype', 'bf16'), ('zero12_engine', 'deepspeed'), ('zero3_engine', 'fsdp2')]
    """
    out = dict[str, object]()
    if t.contiguous_gradients and sharding != "zero3":
        out["contiguous_gradients"] = False  # DeepSpeed ZeRO-3's gradient path
    if t.zero3_engine != "fsdp2" and sharding != "zero3":
        out["zero3_engine"] = "fsdp2"
        if t.grad_dtype == t.param_dtype:  # DeepSpeed's gradient partition dtype back to FSDP2's default
            out["grad_dtype"] = type(t).model_fields["grad_dtype"].default
        if t.searched_zero12_engine == "deepspeed" and sharding in ("zero1", "zero2"):  # DeepSpeed's own ZeRO-1/2
            out |= {"zero12_engine": "deepspeed", "contiguous_gradients": None, "grad_dtype": deepspeed_grad_dtype(
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
    if sharding != "zero1":  # Megatron-LM's DDP-buffer flags (the search has no none); FSDP forces them
        out |= {k: False for k in ("overlap_grad_reduce", "overlap_param_gather") if getattr(t, k)}
    return out


def sharding_training(t: TrainingSpec, sharding: str) -> TrainingSpec:
    """The training ``t`` as a row of ``sharding`` runs it: ``sharding`` and
    :func:`sharding_knobs` (the fields that do not depend on the row's other columns)."""
    return t.model_copy(update={"sharding": sharding, **sharding_knobs(t, sharding)})


def candidate_config(cfg: Config, c: Candidates, i: int) -> Config:
    """The plan input of candidate ``i``: ``cfg`` with its mesh (canonical order, degree-1
    axes left out, SP on when tp > 1, its pipeline schedule, its layer split) and the
    candidate's micro-batch, recompute, sharding, reshard_after_forward and tp_comm_overlap
    in the training contract; ``grad_accumulation`` and ``fp8_all_gather`` where they apply
    (:func:`_training_knobs`); ``[memory] fsdp_reduce`` unset, so each candidate reduces as its
    pp and grad_accumulation say (:meth:`~meshplan.spec.memory.MemoryOptions.fsdp_reduce_for`)."""
    degs = [(axis_shown(n, SHARDING[c.sh[i]]), c.degree(col.column)) for n, col in search_axes()]
    named = [(n, int(a[i])) for n, a in degs if a[i] > 1] or [("dp_shard", 1)]
    pp, vpp, tp = int(c.pp[i]), int(c.vpp[i]), int(c.tp[i])
    mesh = MeshSpec(names=[n for n, _ in named], shape=[d for _, d in named], sequence_parallel=tp > 1,
                    virtual_stages=vpp, pp_layer_split=stage_split(cfg.model.layers, pp, vpp, bool(c.us[i])),
                    pp_schedule=candidate_schedule(vpp, int(c.ps[i])))
    training = cfg.training.model_copy(update={"micro_batch": int(c.mb[i]), "recompute": RECOMPUTE[c.rc[i]],
                                               "sharding": SHARDING[c.sh[i]],
                                               "reshard_after_forward": bool(c.rf[i]),
                                               "tp_comm_overlap": bool(c.ov[i]), **_training_knobs(cfg, c, i)})
    memory = cfg.memory.model_copy(update={"fsdp_reduce": None})  # each candidate's own rule (fsdp_reduce_for)
    return replace(cfg, mesh=mesh, training=training, memory=memory)


def world_of(c: Candidates, i: int) -> int:
    """Ranks of candidate ``i``: the product of its dense degrees (expert axes re-factor them)."""
    return prod(int(c.degree(col.column)[i]) for n, col in search_axes() if not AXES[n].expert)
