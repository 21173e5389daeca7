"""Where the config's own ``[mesh]`` ranks among the search's candidates (issue 11 follow-up:
``meshplan search`` ignores the mesh for the search, then says where it stands).

:func:`find` maps the config's mesh and training knobs to the candidate that is the same run
(its columns, then :func:`~meshplan.search.candidate.candidate_config` of that row compared
with the config), or says why no candidate is. :func:`configured` evaluates that candidate
with the search's own exact model (:class:`~meshplan.search.exact.Planner`, ``SIMULATE``:
``build_plan`` + ``step_time(plan, Overlap())``) and ranks it by step time: #N = 1 + the
feasible candidates whose exact step is shorter, also where it is listed in the top (whose rows
follow the tie rule, so its row is given beside the rank, never as it). Feasible candidates whose
step-time lower bound is below its step and that the search did not plan are planned here
(the step alone, on the search's own worker processes where it passes its pool), lowest bound
first, at most ``[search] rank_max`` of them (default 32); beyond that
the rank is a range, ``between #lo and #hi``: each candidate left could be faster or not, so the
range is as wide as their count, whichever are planned (a plan moves one end by one), and the line
says how many and that ``rank_max`` plans more (newcomer trial 16: ``#162-#2,546 of 5,857`` for a
70B cp search said neither; planning them all there costs minutes). The rank is among
the feasible candidates the search decided: those left undecided near the memory limit
(``[search] settle_max``) are counted apart, with how many of them have a step-time lower bound
below its step (planned, those could rank ahead). Where the config's settings are not its mesh's
fastest searched setting, the line adds the mesh at that setting
(:mod:`meshplan.search.configured_best`, newcomer trial 26 #1: a micro-batch 1 read as the mesh's
173% gap to the top). None of it changes the search's result (its own planner and pool).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.mesh.layers import stage_layers
from meshplan.mesh.resolve import Infeasible as Unresolved, Mesh, resolve_mesh
from meshplan.plan import Plan, build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.unit_sim import Overlap
from meshplan.search.candidate import candidate_config
from meshplan.search.columns import LAYER_AC_FREQ, PIPELINE, RECOMPUTE, SHARDING, Candidates
from meshplan.search.configured_best import best_words, fastest_setting, setting_words
from meshplan.search.configured_row import table_row
from meshplan.memory.constraints import usable_bytes
from meshplan.search.explain import relative
from meshplan.search.exact import SIMULATE, STEP_ALONE, Exact, Planner, Pool
from meshplan.search.rank import mesh_of
from meshplan.search.space_recompute import searched_recompute
from meshplan.search.reasons import CODE, OK, REASONS, UNDECIDED, reason_texts
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.search import TIE
from meshplan.spec.axes.registry import search_axes

@dataclass(frozen=True)
class Configured:
    """The config's mesh among the candidates: ``mesh`` as printed (``dp_shard 8 x tp 8``);
    ``status`` ``ranked`` (``step_s``, ``tokens_per_s``, ``rank`` .. ``rank_hi`` by step time of
    ``feasible``; ``row`` in the top table or None; ``undecided`` candidates near the memory limit
    not ranked, ``undecided_below`` of them with a step-time lower bound below ``step_s``),
    ``infeasible`` or ``not_ranked`` (``reason``; a step where planned) or ``absent``
    (``reason``: why no candidate is this run); ``rank_max`` the ``[search] rank_max`` the rank
    planned with; ``would_row``: where ``absent`` and planned as given, the row of the top table it
    would take (:func:`~meshplan.search.configured_row.table_row`), None where it would follow every
    row shown or the top is not proven; ``best_index``, ``best_settings``, ``best_step_s``: where
    ranked and its settings are not its mesh's fastest searched setting
    (:func:`~meshplan.search.configured_best.fastest_setting`), that candidate, what it runs
    otherwise (``mb 4, full``) and its step (seconds), else None."""

    mesh: str
    status: str
    reason: Optional[str] = None
    step_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    rank: Optional[int] = None
    rank_hi: Optional[int] = None
    feasible: Optional[int] = None
    index: Optional[int] = None
    row: Optional[int] = None
    undecided: Optional[int] = None
    undecided_below: Optional[int] = None
    rank_max: Optional[int] = None
    would_row: Optional[int] = None
    best_index: Optional[int] = None
    best_settings: Optional[str] = None
    best_step_s: Optional[float] = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def line(self) -> str:
        """The line printed after the top table (``reason`` holds the notes in parentheses).

        >>> Configured("dp_shard 4 x tp 2", "ranked", "5.47% longer than the top's", 7.381, 71028.4, 40, 40, 717).line()
        "your mesh (dp_shard 4 x tp 2): 7.381 s, 71,028 tokens/s, rank #40 of 717 feasible by step time (5.47% longer than the top's)"
        >>> Configured("dp_shard 8 x tp 8", "ranked", None, 331.38, 12657.0, 80, 965, 1118, undecided=27).line()
        'your mesh (dp_shard 8 x tp 8): 331.380 s, 12,657 tokens/s, rank between #80 and #965 of 1,118 feasible by step time, 27 undecided near the memory limit not ranked'
        >>> print(Configured("cp 4 x tp 8", "absent", "cp before dp_shard", 50.0, 9000.0, 162, 2546, 5857,
        ...                  rank_max=32).line())  # doctest: +NORMALIZE_WHITESPACE
        your mesh (cp 4 x tp 8) is not among the candidates: cp before dp_shard; planned as given (not searched):
        50.000 s, 9,000 tokens/s, would rank between #162 and #2,546 of 5,857 feasible by step time (2,384 feasible
        candidates with a step-time lower bound below its step not planned, each could rank ahead: [search] rank_max
        32 planned the first by bound, each plan more narrows the range by one)
        """
        if self.status == "absent" and self.step_s is not None:  # planned as given (_as_given)
            lo, hi = self.rank or 0, self.rank_hi or 0  # set with step_s
            tail = f" ({left_words(hi - lo, self.rank_max)})" if hi > lo else ""
            row = "" if self.would_row is None else \
                f"be row #{self.would_row} of the top table (its step and peak against the rows', tiers applied), "
            return (f"your mesh ({self.mesh}) is not among the candidates: {self.reason}; planned as given (not "
                    f"searched): {self.step_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s, would {row}rank "
                    f"{rank_words(lo, hi)} of {self.feasible:,} feasible by step time{tail}")
        if self.status == "absent":
            return f"your mesh ({self.mesh}) is not among the candidates: {self.reason}"
        if self.status == "infeasible":
            return f"your mesh ({self.mesh}): infeasible: {self.reason}"
        step = f"{self.step_s:.3f} s, {self.tokens_per_s:,.0f} tokens/s"
        if self.status == "not_ranked":
            return f"your mesh ({self.mesh}): {step}, not ranked: {self.reason}"
        rank = rank_words(self.rank or 0, self.rank_hi or 0)  # set when ranked
        apart = f", {self.undecided:,} undecided near the memory limit not ranked" if self.undecided else ""
        why = "" if self.reason is None else f" ({self.reason})"
        return f"your mesh ({self.mesh}): {step}, rank {rank} of {self.feasible:,} feasible by step time{apart}{why}"


def rank_words(lo: int, hi: int) -> str:
    """A rank, or the range the unplanned candidates leave.

    >>> rank_words(4, 4), rank_words(162, 2546)
    ('#4', 'between #162 and #2,546')
    """
    return f"#{lo:,}" if lo == hi else f"between #{lo:,} and #{hi:,}"


def left_words(left: int, rank_max: Optional[int]) -> str:
    """What the range means: ``left`` candidates not planned, each of which could rank ahead, and
    the ``[search] rank_max`` that plans more (:func:`_rank`)."""
    many = "s" if left > 1 else ""
    return (f"{left:,} feasible candidate{many} with a step-time lower bound below its step not planned, each could "
            f"rank ahead: [search] rank_max {rank_max} planned the first by bound, each plan more narrows the range "
            "by one")


def _mesh_words(spec: MeshSpec, world: int) -> str:
    """The config's mesh in its order (``tp 4 x dp_shard 2``; Megatron's degrees as given), a -1
    resolved where the mesh resolves."""
    pairs = list(zip(spec.names, spec.shape or []) if spec.names is not None else (spec.degrees or {}).items())
    try:
        mesh = resolve_mesh(spec, spec.world or world)
    except ConfigError:
        mesh = None
    if isinstance(mesh, Mesh):
        pairs = [(n, mesh.ep if n == "ep" else mesh.etp if n == "etp" else mesh.degree(n)) for n, _ in pairs]
    return " x ".join(f"{n} {d}" for n, d in pairs)


def find(cfg: Config, spec: MeshSpec, c: Candidates) -> int | str:
    """The index of the candidate that runs ``cfg``'s mesh ``spec`` and knobs as the config does,
    or why none does (one clause naming the field)."""
    t = cfg.training
    try:
        mesh = resolve_mesh(spec, spec.world or cfg.cluster.world, gpus_per_node=cfg.cluster.node.gpus)
    except ConfigError as e:
        return str(e)
    if isinstance(mesh, Unresolved):
        return "; ".join(mesh.reasons)
    if (spec.world or cfg.cluster.world) != cfg.cluster.world:
        return f"mesh.world {spec.world} < the cluster's {cfg.cluster.world} GPUs: the search uses them all"
    t = t.at_pp(mesh.degree("pp"))  # reshard_after_forward unset: this mesh's default, as its plan resolves it
    cfg = replace(cfg, training=t)
    if t.sharding not in SHARDING:
        return f"training.sharding {t.sharding!r}: the search shards ({', '.join(SHARDING)})"
    if t.recompute not in RECOMPUTE:
        return f"training.recompute {t.recompute!r}: the search tries {', '.join(RECOMPUTE)}"
    if t.recompute == "layer" and t.ac_freq != LAYER_AC_FREQ:
        return (f"training.ac_freq {t.ac_freq}: the search tries recompute 'layer' at ac_freq {LAYER_AC_FREQ} "
                "(torchtitan's default selective_ac_option)")
    dps = mesh.degree("dp") // mesh.degree("dp_replicate")
    want = {"pp": mesh.degree("pp"), "dpr": mesh.degree("dp_replicate"), "dps": dps, "cp": mesh.degree("cp"),
            "tp": mesh.degree("tp"), "ep": mesh.ep, "etp": mesh.etp}
    want = {col.column: want.get(col.column, mesh.degree(str(n))) for n, col in search_axes()}
    words = {col.column: str(n) for n, col in search_axes()}
    fsdp = t.sharding in ("zero3", "hsdp")
    want |= {"mb": t.micro_batch, "rc": RECOMPUTE.index(t.recompute),
             "vpp": spec.virtual_stages, "sh": SHARDING.index(t.sharding), "ov": int(t.tp_comm_overlap),
             "ps": PIPELINE.index(str(spec.pp_schedule)) if str(spec.pp_schedule) in PIPELINE[1:] else 0}
    want |= {"hz": t.zero_hpz_partition_size if t.knob_acts("zero_hpz_partition_size")[0] else 1} if c.hz is not None else {}
    words |= {"mb": "micro_batch", "rc": "recompute", "vpp": "virtual_stages", "sh": "sharding", "ov": "tp_comm_overlap",
              "ps": "pp_schedule", "rf": "reshard_after_forward", "us": "pp_layer_split", "hz": "zero_hpz_partition_size"}
    sel = np.ones(len(c), bool)
    for key, value in want.items():
        col = c.degree(key) if key in c.more else getattr(c, key)
        now = sel & (col == value)
        if not now.any():
            return _op_limit(cfg, mesh, key, value) or _absent(words[key], key, value, np.unique(col[sel]))
        sel = now
    # reshard_after_forward unset (resolved at pp above) where the search does not vary it (nothing FSDP-sharded over
    # a data axis, the rows' neutral true): it changes nothing gathered, so any row's value is this run's
    unset = "reshard_after_forward" not in t.model_fields_set
    acts = fsdp & (c.reshard_varied | (not unset))
    rf = np.where(acts, int(t.reshard_after_forward), c.rf)
    why: Optional[str] = f"reshard_after_forward {str(t.reshard_after_forward).lower()} is not searched with this mesh"
    for i in np.flatnonzero(sel & (c.rf == rf)):
        mine = cfg if acts[i] else replace(cfg, training=t.model_copy(update={"reshard_after_forward": bool(c.rf[i])}))
        why = _differs(mine, spec, candidate_config(cfg, c, int(i)))
        if why is None:
            return int(i)
    return why or ""


def _op_limit(cfg: Config, mesh: Mesh, key: str, value: int) -> Optional[str]:
    """Why recompute "op", which ``[search] recompute`` lists, is not searched at ``mesh``: the search
    plans it only at tp = cp = 1 (:func:`meshplan.search.space_recompute.op_recompute_ok`); None
    for another column or value, or where that is not the reason."""
    if key != "rc" or RECOMPUTE[value] != "op" or "op" not in searched_recompute(cfg):
        return None
    over = [f"{n} {mesh.degree(n)}" for n in ("tp", "cp") if mesh.degree(n) > 1]
    if not over:
        return None
    return (f"recompute op is searched only at tp = cp = 1 (its step-time bound is not checked otherwise); this "
            f"mesh has {', '.join(over)}")


def _absent(word: str, key: str, value: int, searched) -> str:
    """Why no candidate has column ``key`` at ``value`` (``searched``: the values there are)."""
    name = {"rc": RECOMPUTE, "sh": SHARDING, "ps": PIPELINE}.get(key)
    show = (lambda v: name[v] if 0 <= v < len(name) else "?") if name else str
    table = {"mb": "micro_batch", "rc": "recompute", "sh": "sharding", "vpp": "vpp"}.get(key, word)
    widen = "hpZ is searched where the data axis is the world" if key == "hz" else f"widen [search] {table}"  # space.hpz_applies
    return (f"{word} {show(int(value))} is not searched (searched with the rest of the mesh: "
            f"{'/'.join(show(int(v)) for v in searched)}; {widen})")


def _differs(cfg: Config, a: MeshSpec, row: Config) -> Optional[str]:
    """The first field where the candidate's plan input ``row`` runs otherwise than ``cfg`` (mesh ``a``)."""
    b = row.mesh
    if b is None:
        return "no mesh"
    if a.rank_to_gpu is not None:
        return "mesh.rank_to_gpu is set: the search places ranks node-major"
    if a.sequence_parallel != b.sequence_parallel:
        return (f"mesh.sequence_parallel {str(a.sequence_parallel).lower()}: the search runs SP exactly when "
                "tp > 1")
    mine, theirs = (_order(s, cfg.cluster.world) for s in (a, b))
    if mine != theirs:  # the data axis by either name (dp under ZeRO-1/2); degree-1 axes left out
        return (f"axis order ({', '.join(mine)}): the search orders (pp, dp_replicate, dp_shard, cp, tp), "
                "tp innermost")
    split_a = _per_virtual(cfg, a)  # per virtual stage both: a Megatron import's [1, 2, .., 2, 1] is the
    if split_a != _per_virtual(cfg, b) and len(set(split_a or [0])) > 1:  # search's per-stage Llama 3 split
        return f"mesh.pp_layer_split {a.pp_layer_split}: the search splits evenly or as Llama 3 (lighter ends)"
    if a.pp_schedule != b.pp_schedule:
        return f"mesh.pp_schedule {a.pp_schedule}: the search runs this mesh with {b.pp_schedule}"
    if a.loss_parallel != b.loss_parallel:
        return "mesh.loss_parallel false: the search plans loss parallel"
    ta, tb = cfg.training.model_dump(), row.training.model_dump()
    diff = [k for k in ta if ta[k] != tb.get(k)]
    if diff:
        return f"training.{diff[0]} {ta[diff[0]]!r}: the search plans this mesh with {tb.get(diff[0])!r}"
    return None


def _per_virtual(cfg: Config, spec: MeshSpec) -> Optional[list[int]]:
    """Layers per virtual stage (``chunk * pp + stage``) of ``spec``'s ``pp_layer_split``, given per
    stage or per virtual stage (:func:`~meshplan.mesh.layers.stage_layers` spreads the former as the
    plan does), so that the same layout compares equal (newcomer trial 34 finding 7); the split as
    given where the mesh does not resolve or assign, None without one."""
    if not spec.pp_layer_split:
        return None
    mesh = resolve_mesh(spec, cfg.cluster.world)
    if isinstance(mesh, Unresolved):
        return list(spec.pp_layer_split)
    pp, vpp = mesh.degree("pp"), spec.virtual_stages or 1
    layers = stage_layers(cfg.model.layers, pp, vpp, list(spec.pp_layer_split))
    if isinstance(layers, str):
        return list(spec.pp_layer_split)
    return [len(layers[k][c]) for c in range(vpp) for k in range(pp)]


def _order(spec: MeshSpec, world: int) -> tuple[str, ...]:
    """The axes of degree > 1 of ``spec`` in its order, the data axis by one name (dp_shard)."""
    mesh = resolve_mesh(spec, world)
    if isinstance(mesh, Unresolved):
        return ()
    return tuple("dp_shard" if n == "dp" else n for n in mesh.layout.names if mesh.degree(n) > 1)


def configured(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
               top: list[Exact], workers: int | Pool = 1, proven: bool = True) -> Configured:
    """Where ``cfg``'s mesh ranks (module docstring): ``code``, ``step_lo``, ``exact``, ``top``
    the search's verdicts, step-time lower bounds, exact evaluations and ranked top; ``workers``:
    processes for the rank's plans, or the search's open :class:`~meshplan.search.exact.Pool` of
    ``cfg`` and ``c`` (its workers' caches warm; left open)."""
    if cfg.mesh is None:
        raise ValueError("configured: the config has no [mesh]")
    words = _mesh_words(cfg.mesh, cfg.cluster.world)
    i = find(cfg, cfg.mesh, c)
    if isinstance(i, str):
        return _as_given(cfg, c, code, step_lo, exact, words, i, workers, top if proven else [])
    texts = reason_texts(cfg.training)
    k = int(code[i])
    if k >= 0 and REASONS[k][0] not in ("memory", "gemm"):
        return Configured(words, "infeasible", f"rule '{REASONS[k][0]}': {texts[REASONS[k][0]]}", index=i)
    planner = Planner(cfg, c)
    e = exact.get(i)
    if e is None or not e.complete or e.step_s is None:
        e = planner((i, SIMULATE))
    if not e.feasible or e.step_s is None:
        return Configured(words, "infeasible", "; ".join(e.reasons), index=i)
    if k == CODE["gemm"]:
        return Configured(words, "not_ranked", "local GEMM efficiency below the threshold ([search] "
                          "min_gemm_efficiency)", e.step_s, e.tokens_per_s, index=i)
    feasible = int((code == OK).sum()) + (k in (UNDECIDED, CODE["memory"]))
    undecided = np.flatnonzero(code == UNDECIDED)
    undecided = undecided[undecided != i]
    below = int((step_lo[undecided] < e.step_s).sum())
    row = next((n for n, t in enumerate(top, 1) if t.index == i), None)
    mesh_row = next((n for n, t in enumerate(top, 1) if mesh_of(c, t.index) == mesh_of(c, i)), None)
    n = cfg.search.rank_max
    lo, hi = _rank(c, code, step_lo, exact, e.step_s, i, planner, workers, n)
    best = fastest_setting(cfg, c, code, step_lo, exact, top, i, e, planner)
    best = None if best is None or best.index == i or best.step_s is None else best
    notes = _notes(row, e.step_s, top, k, hi - lo, len(undecided), below, mesh_row, n)
    b_words = None if best is None else setting_words(c, i, best.index)
    if best is not None and top:
        at = len(notes) - (k != OK) - bool(hi - lo) - bool(len(undecided))  # after the step against the top's
        notes.insert(at, best_words(b_words or "", float(best.step_s or 0), top, best.index))
    return Configured(words, "ranked", "; ".join(notes) or None, e.step_s, e.tokens_per_s, lo, hi, feasible, i, row,
                      len(undecided), below, n, best_index=None if best is None else best.index,
                      best_settings=b_words, best_step_s=None if best is None else best.step_s)


def _as_given(cfg: Config, c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact],
              words: str, why: str, workers: int | Pool, top: list[Exact]) -> Configured:
    """A mesh no candidate runs (``why``), planned as the config gives it with the search's exact model
    (``build_plan`` + ``step_time(plan, Overlap())``, as :class:`~meshplan.search.exact.Planner`), not
    added to the searched set: its step, the row of the top table ``top`` it would take
    (:func:`~meshplan.search.configured_row.table_row`; none from an empty ``top``, a top not proven)
    and where that step would rank among the feasible candidates (:func:`_rank`); ``why`` alone where
    it does not plan or fit."""
    try:
        plan = build_plan(cfg)
    except ConfigError as e:
        return Configured(words, "absent", f"{why}; as given it does not plan: {e}")
    if not isinstance(plan, Plan) or not plan.feasible:
        return Configured(words, "absent", f"{why}; as given: infeasible: {'; '.join(plan.reasons)}")
    st = step_time(plan, Overlap())
    n = cfg.search.rank_max
    lo, hi = _rank(c, code, step_lo, exact, st.step_s, -1, Planner(cfg, c), workers, n)
    row = table_row(st.step_s, plan.timeline.peak.total_bytes, top, usable_bytes(cfg.cluster, cfg.training),
                    cfg.memory.fragmentation_fraction, cfg.search.headroom_tier)
    return Configured(words, "absent", why, st.step_s, st.tokens_per_s, lo, hi, int((code == OK).sum()), rank_max=n,
                      would_row=row)


def _notes(row: Optional[int], step_s: float, top: list[Exact], k: int, left: int, undecided: int,
           below: int, mesh_row: Optional[int] = None, rank_max: Optional[int] = None) -> list[str]:
    """The clauses in parentheses after the rank: its ``row`` in the top table (the tie rule's
    order, not the rank), or the row of its mesh listed at other settings (``mesh_row``: the rows
    are distinct meshes), ``step_s`` against the top's, a verdict reached here (code ``k``), the
    ``left`` feasible candidates unplanned (:func:`left_words`, ``rank_max``) and the ``below`` of the
    ``undecided`` whose step-time
    lower bound is below ``step_s``."""
    out = [f"row #{row:,} in the top table, whose tie rule orders meshes within {TIE:.0%} toward fewer axes, lower "
           "degrees and fewer settings"] if row is not None else [] if mesh_row is None else [
        f"its mesh is row #{mesh_row:,} in the top table, at other settings (one row per distinct mesh)"]
    out += [relative(step_s / top[0].step_s - 1, "the top's")] if row != 1 and top and top[0].step_s else []
    out += [] if k == OK else ["near the memory limit, planned here: it fits"]
    out += [left_words(left, rank_max)] if left else []
    if undecided and below:
        out.append(f"{below:,} of the undecided ha{'ve' if below > 1 else 's'} a step-time lower bound below its "
                   "step and could rank ahead if planned: [search] settle_max plans more")
    elif undecided:
        out.append("no undecided candidate could rank ahead: their step-time lower bounds are not below its step")
    return out


def _rank(c: Candidates, code: np.ndarray, step_lo: np.ndarray, exact: dict[int, Exact], step_s: float, i: int,
          planner: Planner, workers: int | Pool, rank_max: int = 32) -> tuple[int, int]:
    """(lowest, highest) rank of a step of ``step_s``: 1 + the feasible candidates with a shorter
    exact step; those unplanned whose lower bound is below it planned (:data:`~meshplan.search.exact.STEP_ALONE`:
    the step, to the bit the search's), lowest bound first, up to ``rank_max`` (``[search] rank_max``),
    the rest (and any plan that gives no step) left as the range: highest - lowest = those left.
    ``workers``: a process count (a pool of them forked here, closed after) or an open pool, used as it is."""
    feasible = np.flatnonzero(code == OK)
    steps = {j: exact[j].step_s for j in feasible.tolist() if j in exact and exact[j].step_s is not None}
    open_ = [j for j in feasible.tolist() if j not in steps and j != i and step_lo[j] < step_s]
    open_.sort(key=lambda j: (step_lo[j], j))
    todo, left = open_[:rank_max], len(open_) - min(len(open_), rank_max)
    pool = workers if isinstance(workers, Pool) else Pool(planner, workers)
    try:
        for r in pool.map([(j, STEP_ALONE) for j in todo]):
            if r.step_s is not None:
                steps[r.index] = r.step_s
            else:  # no step: it may be faster, so it widens the range
                left += 1
    finally:
        if pool is not workers:
            pool.close()
    faster = sum(1 for j, s in steps.items() if j != i and s is not None and s < step_s)
    return faster + 1, faster + 1 + left
