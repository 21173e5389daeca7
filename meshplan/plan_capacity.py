"""The capacity row of a plan's own setting, from the memory timeline: the one verdict.

:func:`meshplan.memory.constraints.constraints` sizes the capacity rows before any mesh with a
first estimate (state + activations + gathered layers) that is neither a lower nor an upper
bound of the timeline peak: Llama-3-70B, FSDP, tp 8, micro-batch 2, seq 8192, no activation
checkpointing on 8 dgx-h100 estimates 68.53 GiB (sharded gradients counted from the start, two
gathered layers) where the timeline's peak is 65.04 GiB of 67.06 usable (the gradients appear at
the first reduce-scatter, after the forward's peak). Those rows are labelled first estimates;
this module replaces the row of the plan's own sharding and recompute by one computed with
:func:`meshplan.plan.build_plan`'s timeline, so that it never contradicts the plan's verdict:

- the smallest tp x pp (tp inside a node, tp largest first at each tp*pp, the data axis taking
  the rest, every other axis, setting and option of the config as they are) whose timeline peak
  fits, each split the plan's own rules accept; at a pp other than the plan's, 1F1B with one
  chunk per stage and the layers split as a search candidate at that pp is
  (:func:`~meshplan.mesh.layers.restart_split`: even where pp divides the layers, else
  :func:`~meshplan.mesh.layers.balanced_split`, under framework megatron the cut of its
  ``--decoder-first/last-pipeline-num-layers``, :func:`~meshplan.mesh.layers.first_last_split`;
  a pp with no such split is not tried). Before newcomer trial nc62 the split was left unset
  there, so every pp not dividing the layers was refused and skipped: DeepSeek-V3's 61 layers
  (``examples/deepseek-v3_2048xh100_pp16-ep64-dp128.toml``) read "smallest split ... tp 1 x pp
  16: this mesh" (tp*pp >= 16) where tp 2 x pp 2 fits;
- this mesh's own peak and verdict (the plan's, not re-planned).

Cost: one plan per split tried (about 30-60 ms at 64 ranks); splits the validity rules refuse
(batch, heads, layers) cost about 1 ms.
"""

from __future__ import annotations

from dataclasses import replace

from meshplan.errors import ConfigError
from meshplan.memory import constraints as cons
from meshplan.memory.constraints import ESTIMATE
from meshplan.mesh.layers import restart_split
from meshplan.plan import Infeasible, Plan, build_plan
from meshplan.spec.axes import canonical_names
from meshplan.spec.mesh import Schedule
from meshplan.spec.mesh_words import data_axis
from meshplan.units import GiB


def own_row_prefix(sharding: str, recompute: str) -> str:
    """The start of a capacity row's text for ``sharding`` and ``recompute``
    (:func:`meshplan.memory.constraints._capacity_row` writes the same).

    >>> own_row_prefix("zero3", "none")
    'sharding zero3, recompute none'
    """
    return f"sharding {sharding}, recompute {recompute}"


def checked(plan: Plan | Infeasible) -> Plan | Infeasible:
    """``plan`` with its own setting's capacity row computed from the memory timeline (see the
    module docstring); an :class:`Infeasible` (no timeline) as it is."""
    if not isinstance(plan, Plan):
        return plan
    t = plan.config.training
    found = smallest_split(plan)
    row = own_capacity_row(plan, found)
    prefix = own_row_prefix(t.sharding, t.recompute)
    rows = list(plan.constraints.rows)
    at = next((i for i, r in enumerate(rows) if r.kind == "capacity" and r.text.startswith(prefix + ESTIMATE)), None)
    if at is not None:  # in its place
        rows[at] = row
    else:  # a setting without an estimated row (hsdp, an MoE model): after the usable-HBM row
        rows.insert(next((i + 1 for i, r in enumerate(rows) if r.kind == "capacity"), 0), row)
    axes, unforced = moe_axes(plan, found)
    return replace(plan, constraints=replace(plan.constraints, rows=tuple(rows), axes=axes, unforced=unforced))


def moe_axes(plan: Plan, found: tuple[int, int, float] | None) -> tuple[dict[str, str], tuple[str, ...]]:
    """``plan``'s axis reasons and unforced axes, with the tp and pp lines that
    :data:`~meshplan.memory.constraints.MOE_UNKNOWN` left open (an MoE model, no first estimate)
    answered from ``found``, the capacity row's smallest split (:func:`smallest_split`, which
    tries tp*pp ascending, tp largest first): the split without the axis (pp 1 at this tp, tp 1
    at this pp) was tried before ``found`` and did not fit, so the axis is needed for memory; or
    it is ``found``, so memory fits without it; else (not tried: a smaller split fits first) the
    line stays open. DeepSeek-V3's example (tp 1 x pp 16, smallest split tp 2 x pp 2): pp
    1 at tp 1 does not fit, so pp is needed (newcomer trial nc62 #2)."""
    axes, unforced = dict(plan.constraints.axes), list(plan.constraints.unforced)
    if found is None:
        return axes, tuple(unforced)
    tp, pp, gpus = plan.mesh.degree("tp"), plan.mesh.degree("pp"), plan.config.cluster.node.gpus
    f_tp, f_pp = found[0], found[1]
    for axis, (w_tp, w_pp) in (("pp", (tp, 1)), ("tp", (1, pp))):
        if axes.get(axis) != cons.MOE_UNKNOWN:
            continue
        if w_tp <= gpus and (w_tp * w_pp, -w_tp) < (f_tp * f_pp, -f_tp):
            axes[axis] = (f"capacity: without it tp {w_tp} x pp {w_pp} does not fit (memory timeline; the smallest "
                          f"split that fits is tp {f_tp} x pp {f_pp}, the capacity row)")
        elif (w_tp, w_pp) == (f_tp, f_pp):
            axes[axis] = (f"solves no stated constraint (without it tp {w_tp} x pp {w_pp} fits, the capacity row's "
                          "smallest split, and the batch allows it)")
            unforced.append(axis)
    return axes, tuple(unforced)


def own_capacity_row(plan: Plan, found: tuple[int, int, float] | None) -> cons.ConstraintRow:
    """The capacity row of ``plan``'s sharding and recompute, from the timeline: the smallest
    split that fits (``found``, :func:`smallest_split`'s) and this mesh's peak; ``requires`` ``tp*pp >= N`` (N of the smallest split
    that fits), ``this mesh`` where only the plan's own mesh fits, else ``infeasible``."""
    t, world, mesh = plan.config.training, plan.world, plan.mesh
    usable = plan.constraints.usable_bytes
    own_tp, own_pp = mesh.degree("tp"), mesh.degree("pp")
    peak = plan.timeline.peak.total_bytes
    verdict = "fits" if plan.feasible else f"over usable {usable / GiB:.2f} GiB, does not fit"
    own = f"this mesh (tp {own_tp} x pp {own_pp}): timeline peak {peak / GiB:.2f} GiB, {verdict}"
    head = f"{own_row_prefix(t.sharding, t.recompute)} (this plan's setting, memory timeline)"
    if found is None:
        return cons.ConstraintRow("capacity", f"{head}: no tp x pp split of {world} GPUs fits; {own}",
                                  "this mesh" if plan.feasible else "infeasible")
    tp, pp, split_peak = found
    at = (f": this mesh, timeline peak {peak / GiB:.2f} GiB, fits" if (tp, pp) == (own_tp, own_pp) else
          f" (timeline peak {split_peak / GiB:.2f} GiB); {own}")
    return cons.ConstraintRow("capacity", f"{head}: smallest split (tp inside a node) that fits is tp {tp} x pp {pp}{at}",
                              f"tp*pp >= {tp * pp}")


def smallest_split(plan: Plan) -> tuple[int, int, float] | None:
    """(tp, pp, peak bytes) of the smallest tp*pp whose plan fits, tp largest first at each
    tp*pp (kept inside one node), the other axes as ``plan``'s; None where none does. The plan's
    own degrees are answered by ``plan`` itself."""
    mesh, gpus = plan.mesh, plan.config.cluster.node.gpus
    own_tp, own_pp = mesh.degree("tp"), mesh.degree("pp")
    rest = plan.world // (own_tp * own_pp * mesh.degree(_data(plan)))  # the axes a split keeps
    room = plan.world // rest
    no_rows = cons.Constraints((), plan.constraints.usable_bytes)
    for mp in _divisors(room):
        for tp in [d for d in _divisors(mp) if d <= gpus][::-1]:
            pp = mp // tp
            if (tp, pp) == (own_tp, own_pp):
                if plan.feasible:
                    return tp, pp, plan.timeline.peak.total_bytes
                continue
            try:
                p = build_plan(_split_config(plan, tp, pp, room // mp), no_rows, reports=False)
            except ConfigError:  # a split no runtime runs (plan_checks) or one the order cannot say
                continue
            if isinstance(p, Plan) and p.feasible:
                return tp, pp, p.timeline.peak.total_bytes
    return None


def _data(plan: Plan) -> str:
    """The data axis the split's rest goes to: the config's ``dp`` or ``dp_shard`` (the
    sharding's name, :func:`~meshplan.spec.mesh_words.data_axis`, when it has neither)."""
    names = [str(n) for n in plan.mesh.layout.names]
    return next((n for n in ("dp_shard", "dp") if n in names), data_axis(plan.config.training.sharding))


def _split_config(plan: Plan, tp: int, pp: int, data: int):
    """``plan``'s config with tp, pp and the data axis set (the other axes kept); where pp
    is not the plan's, the default 1F1B schedule, one chunk per stage and the layer split a
    search candidate at that pp has (module docstring; :class:`ConfigError` where there is none,
    which :func:`smallest_split` skips)."""
    spec = plan.config.mesh
    assert spec is not None  # a plan's config has its mesh
    degrees = {"tp": tp, "pp": pp, _data(plan): data}
    if spec.names is not None:
        names = list(canonical_names([str(n) for n in spec.names])[0])  # fsdp -> dp_shard, as the plan's
        shape = list(spec.shape or [])
        for axis, d in degrees.items():
            if axis in names:
                shape[names.index(axis)] = d
            elif d > 1:  # in torchtitan's order: pp outermost, tp innermost, the data axis after pp
                at = 0 if axis == "pp" else len(names) if axis == "tp" else int(bool(names) and names[0] == "pp")
                names.insert(at, axis)
                shape.insert(at, d)
        update: dict = {"names": names, "shape": shape}
    else:  # Megatron order + degrees: an axis the order does not name stays out (degree 1)
        order = (spec.order or "").split("-")
        update = {"degrees": {**(spec.degrees or {}), **{a: d for a, d in degrees.items() if a in order or d > 1}}}
    update["sequence_parallel"] = spec.sequence_parallel if tp == plan.mesh.degree("tp") else tp > 1
    update["rank_to_gpu"] = None
    if pp != plan.mesh.degree("pp"):
        layers, megatron = plan.config.model.layers, plan.config.training.framework == "megatron"
        split = restart_split(layers, pp, 1, first_last=megatron)
        if isinstance(split, str):
            raise ConfigError("mesh.pp_layer_split", split)
        update |= {"pp_schedule": Schedule.ONE_F_ONE_B, "virtual_stages": 1, "pp_layer_split": split}
    return replace(plan.config, mesh=spec.model_copy(update=update))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
