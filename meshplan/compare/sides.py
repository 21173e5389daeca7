"""One side of ``meshplan compare``: a plan's numbers (:class:`Side`, :func:`side_of`: step,
MFU, peak memory, GEMMs and their efficiency, bytes per link, exposed communication), whether two
plans are one mesh (:func:`same_mesh`), and the workload both must share
(:func:`check_workload`: a one-line error names the first field that differs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from meshplan.compute.gemm import gemm_time
from meshplan.compare.differences import Differences, config_differences, knob
from meshplan.errors import ConfigError
from meshplan.mesh.layers import stage_layers
from meshplan.mesh.validity import degrees
from meshplan.pipeline.registry import get as get_schedule
from meshplan.plan import Infeasible, Plan
from meshplan.memory.headroom import headroom_words
from meshplan.schedule.rank_timeline import Overlap
from meshplan.schedule.stage_traffic import LINKS, busiest_stage, stage_label, stage_link_bytes
from meshplan.schedule.steptime import StepTime, step_time, workload_of
from meshplan.schedule.workload import plan_step_gemms
from meshplan.search.candidate import megatron_split, stage_split
from meshplan.search.columns import PIPELINE, candidate_schedule, reshard_acts
from meshplan.search.step_parts import compute_split
from meshplan.search.tie_key import OTHER_SCHEDULE, tie_key
from meshplan.spec.mesh_words import mesh_text
from meshplan.units import GB


@dataclass(frozen=True)
class Side:
    """One mesh's numbers. ``link_bytes``: bytes one rank sends per step by link class,
    "nvlink" and "network", on the stage whose rank sends the most on that class
    (:func:`~meshplan.schedule.stage_traffic.busiest_stage`; ``link_stage`` names it per class:
    a MoE model's dense stage 0 sends no ep all-to-all; the stage's table: size x busbw factor x
    count, each row split over the links it uses, :attr:`~meshplan.comm.row.CollectiveRow.link_bytes`); ``exposed_s``: exposed communication of
    the critical stage by stream; ``gemms``: (name, M, N, K, efficiency): each forward GEMM
    (:func:`~meshplan.schedule.workload.plan_step_gemms`: framework megatron's Q, K and V as one
    fused ``qkv``) and its efficiency as the step times it (:func:`~meshplan.compute.gemm.gemm_time`: the catalog's
    measured points for the GPU and dtype, interpolated, with --kernels files laid over them; the
    shape model only for a GPU or dtype without points); ``simplicity``: the
    search's tie key of the mesh and its settings (:func:`plan_tie_key`)."""

    name: str
    plan: Plan | Infeasible
    feasible: bool
    reasons: tuple[str, ...]
    step_s: Optional[float] = None
    mfu: Optional[float] = None
    peak_bytes: Optional[float] = None
    usable_bytes: Optional[float] = None
    gemms: tuple = ()
    link_bytes: dict = field(default_factory=dict)
    exposed_s: dict = field(default_factory=dict)
    step: Optional[StepTime] = None
    simplicity: tuple[int, ...] = (0, 0, 0)
    link_stage: dict = field(default_factory=dict)

    @property
    def headroom(self) -> str:
        """``tight: 2.6 GiB = 3.9% of the usable 67.1 GiB free, under 15%`` for a side that fits with
        a tight peak (:func:`meshplan.memory.headroom.headroom_words`, the rule the search's headroom
        tiers order by); "" otherwise."""
        if not self.feasible or self.peak_bytes is None or self.usable_bytes is None:
            return ""
        return headroom_words(self.peak_bytes, self.usable_bytes, self.plan.config.memory.fragmentation_fraction)

    @property
    def compute_split_s(self) -> Optional[dict[str, float]]:
        """This side's compute by kernel kind, seconds per step on its critical stage
        (:func:`~meshplan.search.step_parts.compute_split` with the SM contention its own part,
        ``SM contention (NCCL channels)``: the five add up to the step's compute); None without
        a step (an infeasible or unresolved side)."""
        if self.step is None or isinstance(self.plan, Infeasible):
            return None
        return compute_split(self.plan, self.step, contention=True)

    @property
    def resolved(self) -> bool:
        """Whether the mesh resolved to a plan (groups, stages, collectives); an unresolved one
        has no quantity to show ("-" in every row)."""
        return not isinstance(self.plan, Infeasible)

    def stage_of(self, kind: str) -> str:
        """``stage 1``: the stage of :attr:`link_bytes`'s ``kind``
        (:func:`~meshplan.schedule.stage_traffic.stage_label`); empty at pp 1 or unresolved."""
        if isinstance(self.plan, Infeasible) or kind not in self.link_stage:
            return ""
        return stage_label(self.link_stage[kind], self.plan.pp)

    def gb_sent(self, kind: str) -> str:
        """GB one rank sends per step on link class ``kind``, or "-" when unresolved."""
        return f"{self.link_bytes.get(kind, 0) / GB:.1f}" if self.resolved else "-"

    @property
    def mesh_text(self) -> str:
        """The mesh as every output names it (:func:`meshplan.spec.mesh_words.mesh_text`: the axes of
        degree > 1, ep and etp among them, the data axis named by the sharding): a plan spelled
        ``dp_shard 4 x tp 2`` and its Megatron-LM export imported back (``dp 4 x tp 2``) print the
        same words; "unresolved" without a mesh."""
        m = self.plan.mesh
        if not m:
            return "unresolved"
        return mesh_text(m.layout.names, m.layout.shape, self.plan.config.training.sharding, m.ep, m.etp)

    @property
    def mesh_key(self) -> str:
        """:attr:`mesh_text` with a lone data axis named ``dp`` whatever the sharding names it
        (``dp_shard 4 x tp 2`` under zero3 and ``dp 4 x tp 2`` under zero1 are one mesh: the
        sharding is a knob of its own), a lone ``dp_replicate`` too."""
        data = ("dp", "dp_shard", "dp_replicate")
        words = self.mesh_text.split(" x ")
        if sum(w.split(" ")[0] in data for w in words) != 1:
            return self.mesh_text
        return " x ".join("dp " + w.split(" ")[1] if w.split(" ")[0] in data else w for w in words)


_SPELLING = {"names", "shape", "order", "degrees"}


def same_mesh(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible) -> bool:
    """Whether two plans have the same mesh: equal [mesh] tables, or the same resolved
    layout (names, degrees, ep, etp) spelled differently with every other [mesh] field equal
    (``pp_layer_split`` as it acts: the even split written out, as a Megatron-LM export's
    ``--decoder-first/last-pipeline-num-layers`` read back, is the unset one).

    >>> from meshplan.config import config_from_dict
    >>> from meshplan.plan import build_plan
    >>> base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...         "training": {"global_batch": 8, "seq_len": 1024}}
    >>> a = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2]}}))
    >>> b = build_plan(config_from_dict({**base, "mesh": {"order": "tp-dp_shard", "degrees": {"tp": 2, "dp_shard": 4}}}))
    >>> c = build_plan(config_from_dict({**base, "mesh": {"names": ["dp_shard", "tp"], "shape": [2, 4]}}))
    >>> same_mesh(a, b), same_mesh(a, c)
    (True, False)
    """
    ma, mb = plan_a.spec, plan_b.spec
    if ma == mb:
        return True
    if plan_a.mesh is None or plan_b.mesh is None:
        return False
    la, lb = plan_a.mesh, plan_b.mesh
    rest = _SPELLING | {"pp_layer_split"}  # the split as it acts (_split): an explicit even split is unset
    return ((la.layout.names, la.layout.shape, la.ep, la.etp) == (lb.layout.names, lb.layout.shape, lb.ep, lb.etp)
            and ma.model_dump(exclude=rest) == mb.model_dump(exclude=rest)
            and _split(plan_a, ma.pp_layer_split) == _split(plan_b, mb.pp_layer_split))


def side_of(name: str, plan: Plan | Infeasible, overlap: Optional[Overlap] = None) -> Side:
    """Numbers of one plan; the step time only for a plan that resolved its stages."""
    if isinstance(plan, Infeasible):
        return Side(name, plan, False, plan.reasons)
    gpu, w = plan.config.cluster.gpu, workload_of(plan)  # each GEMM in its dtype (float8 Linears: fp8)
    gemms = tuple((g.name, g.m, g.n, g.k, gemm_time(gpu, g.m, g.n, g.k, w.gemm_dtype(g.name), g.count).efficiency)
                  for g in plan_step_gemms(plan))  # as the step times it (megatron: one fused qkv), not the shape model alone
    per = stage_link_bytes(plan)  # each stage's rank: its rows' bytes on the links they use
    used = [kind for kind in LINKS if any(kind in d for d in per)]
    stages = {kind: busiest_stage(per, kind) for kind in used}  # the stage sending the most, per link class
    links = {kind: per[s][kind] for kind, s in stages.items()}
    tl = plan.timeline
    st = step_time(plan, overlap or Overlap())
    return Side(name, plan, plan.feasible, plan.reasons, st.step_s, st.mfu, tl.peak.total_bytes,
                tl.usable_bytes, gemms, links, dict(st.exposed_s), st, plan_tie_key(plan), stages)


def plan_tie_key(plan: Plan) -> tuple[int, ...]:
    """The search's tie key of a resolved plan (:func:`meshplan.search.tie_key.tie_key`): its
    mesh's degrees by search column, and its settings as a search candidate holds them:
    recompute (``block`` for ``full`` with ``recompute_num_layers``), tp overlap, vpp, reshard_after_forward (against its default at the plan's pp,
    :meth:`~meshplan.spec.training.TrainingSpec.reshard_default`; no setting where it gathers
    nothing, :func:`~meshplan.search.columns.reshard_acts`), the layer split (off its default when
    it is neither the even split nor the search's default split,
    :func:`~meshplan.search.candidate.stage_split`, Megatron-LM's first/last cut under
    ``framework = "megatron"``, e.g. the short end stages) and the pipeline
    schedule (:data:`~meshplan.search.columns.PIPELINE`'s index; 1F1B or its interleaved order
    is 0, a schedule the search does not try :data:`~meshplan.search.tie_key.OTHER_SCHEDULE`; any
    with pp 1). A schedule the search does not try (GPipe) counts as one setting off the
    default like one it tries: the count is of what the user sets to get the run, here
    ``mesh.pp_schedule`` away from its default 1f1b (torchtitan's ``pipeline_parallel_schedule``
    default "1F1B"), whether or not the search enumerates it; at pp 1 the schedule runs nothing
    and counts nothing (tests/test_compare_settings.py)."""
    t, spec, pp, vpp = plan.config.training, plan.spec, plan.pp, plan.vpp
    deg = degrees(plan.mesh, t, vpp)  # the search's columns (pp, dpr, dps, cp, tp, ep, etp)
    split = _split(plan, spec.pp_layer_split)
    uneven = split is not None and split != stage_split(plan.config.model.layers, pp, vpp,
                                                        first_last=megatron_split(plan.config))
    name = spec.pp_schedule.value
    schedule = (0 if pp == 1 or spec.pp_schedule == candidate_schedule(vpp) else
                PIPELINE.index(name) if name in PIPELINE else OTHER_SCHEDULE)
    acts = reshard_acts(t.sharding in ("zero3", "hsdp"), deg.dps, deg.cp, deg.tp, deg.ep, deg.etp,
                        plan.config.model.is_moe)
    # Megatron-LM's block recompute (full on the first recompute_num_layers of each chunk): the search's "block"
    rc = "block" if t.recompute == "full" and t.recompute_num_layers is not None else t.recompute
    return tie_key(deg.degree, rc, t.tp_comm_overlap, vpp, t.reshard_after_forward if acts else None,
                   uneven, schedule, t.reshard_default(pp))


#: How many differing workload fields the error of :func:`check_workload` names with their values
#: (the rest counted).
WORKLOAD_SHOWN = 4


def check_workload(plan_a: Plan | Infeasible, plan_b: Plan | Infeasible,
                   names: tuple[str, str] = ("A", "B")) -> Differences:
    """The two configs' :class:`~meshplan.compare.differences.Differences`; a ConfigError naming each
    workload field that differs (the first :data:`WORKLOAD_SHOWN`, the rest counted; one when the
    cluster differs) with its two values (a comparison weighs plans of one workload
    on one cluster: a faster GPU or a larger batch is not a better mesh); the line says what to run
    instead: ``meshplan step`` on each side, or ``meshplan search`` on one (newcomer trial nc55 #10)."""
    d = config_differences(plan_a.config, plan_b.config)
    d = Differences(d.workload, tuple(k for k in d.knobs if k[0] != "mesh.pp_layer_split"
                                      or _split(plan_a, k[1]) != _split(plan_b, k[2])))
    if d.workload:
        cluster = d.workload[0][0].startswith("cluster.")  # one cluster field says it: the hint names [cluster]
        shown = d.workload[:1 if cluster else WORKLOAD_SHOWN]
        more = f" (and {len(d.workload) - len(shown)} more workload fields)" if len(d.workload) > len(shown) else ""
        each = "; ".join(f"{where} differs: {names[0]} {_short(va)}, {names[1]} {_short(vb)}"
                         for where, va, vb in shown)
        fields = ", ".join(where for where, _, _ in shown) + (" ..." if more else "")
        ca, cb = plan_a.config.cluster, plan_b.config.cluster
        hint = (f"give both the same [cluster] ({names[0]} is on {ca.name}, {names[1]} on {cb.name}), or run "
                f"meshplan step on each to compare clusters" if cluster else
                f"give both the same {fields}; only the mesh and the plan's knobs (micro_batch, recompute, "
                f"sharding ...) may differ; to weigh two workloads (a before/after that changes the batch), run "
                f"meshplan step on each (tokens/s per GPU and MFU compare them), or meshplan search on one for its "
                f"best mesh")
        raise ConfigError("compare", f"{each}{more}; compare weighs two plans of one workload: {hint}")
    return d


def _split(plan: Plan | Infeasible, split: Optional[list[int]]) -> Optional[list[int]]:
    """``mesh.pp_layer_split`` as it acts: None (unset) when the plan's stages are the even
    split the same mesh gets without one, so an explicit ``[12, ..., 12]`` equal to the
    default is no knob that differs."""
    if split is None or not isinstance(plan, Plan):
        return split
    cfg = plan.config
    even = stage_layers(cfg.model.layers, plan.pp, plan.vpp,
                        virtual_stage=get_schedule(plan.spec.pp_schedule).virtual_stage)
    return None if even == plan.stages else split


def _short(v: Any) -> str:
    """A config value for a one-line message as the TOML spells it: tables and long lists
    abridged, an unset field ``unset`` (no Python ``None`` in a user's message).

    >>> _short(None), _short(True), _short([1, 2])
    ('unset', 'true', '[1, 2]')
    """
    if v is None or isinstance(v, bool):
        return knob(v)
    text = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."
