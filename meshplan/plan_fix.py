"""What would bring a plan that does not fit under usable memory (issue 11 follow-up: ``meshplan
plan`` of an infeasible mesh ends with a ``fix:`` line).

:func:`memory_fix` re-plans a few variants of the config, each one knob of the memory model
changed (at most :data:`MAX_VARIANTS`, in this order): ``grad_accumulation = "sync"`` where it is
``no_sync`` or ``no_sync_unsharded`` (FSDP2's ``set_requires_gradient_sync(False)`` keeps every
unit's unsharded gradients, and with ``no_sync_unsharded`` its parameters, across the step's
micro-batches; sync reduce-scatters them after each), ``recompute = "full"`` (activations
of a layer freed after its forward, only its input kept), half the micro-batch (activations
scale with it), each sharding above the configured one that the framework runs (:func:`_sharded`:
``zero1`` where an engine runs it, ``zero3``: parameters, gradients and optimizer state sharded over
every data rank, DDP's ``dp_replicate`` folded into ``dp_shard``) or, already sharded, ``reshard_after_forward = true`` (under
DeepSpeed's ZeRO-3 engine also its memory knobs, hpZ off first: :func:`_deepspeed_variants`) (not under a V-shaped schedule
whose runtime would then get the gradients wrong, rule ``v-reshard``:
:func:`meshplan.pipeline.vshape.reshard_defect`), twice the tp degree and
twice the pp degree (each taken from the data axis; tp only inside a node), then context
parallelism taken from the data axis, or from pp where the data axis has one rank (:func:`meshplan.plan_fix_cp.cp_variant`:
the smallest cp, 2, 4 or 8 times the configured, that fits; activations per rank scale with 1 / cp while FSDP still shards the state
over dp_shard x cp; where none fits, the largest the rules take when its peak is the lowest of
the line's, and, where nothing fits and activations dominate the peak, why no cp is offered:
newcomer trial 21 #4, Mixtral-8x7B at seq 10,000,000). Each is planned
by :func:`meshplan.plan.build_plan`, the same memory timeline as the plan and the same rules (cp
must split the sequence into 2 x cp chunks and, with SP, its share over tp, :mod:`meshplan.spec.axes.cp`
and :mod:`~meshplan.spec.axes.tp`; DeepSpeed's engines have no cp), and its peak (the
most loaded stage's) is printed where it is lower than the plan's (pp x2 can raise it: 1F1B
keeps pp micro-batches' activations on stage 0 and the data axis shards the state less). Beside those, HSDP's data axes re-split on the same nodes (:func:`_resplit_variant`, newcomer trial
27 #B), and for an MoE model the smallest larger ep that fits, 15% free first (:func:`meshplan.plan_fix_ep.ep_variant`:
ep shards the routed experts, which every other variant leaves whole on each rank; newcomer trial nc58 #1), and under
Megatron Core the data loader's s x s attention mask not built (:func:`meshplan.plan_fix_mask.mask_variant`, also
beside the cap: 64 GiB at seq 262144; newcomer trial nc59 #1). Only
those that fit are offered, each with its step as ``meshplan step`` predicts it
(:func:`meshplan.schedule.steptime.step_time`, about 0.1 s a variant for Llama-3-70B on 64 GPUs),
the fastest first, one under 15% of usable memory free marked ``tight``
(:func:`meshplan.memory.headroom.tight`, the search's headroom rule): Llama-3-70B at seq 32768, dp_shard 8 x tp 8 without recompute on 8 dgx-h100
(121.3 GiB) fits with cp 4 (dp_shard 2 x cp 4 x tp 8, 43.4 GiB) at a shorter step than with
recompute full (25.0 GiB), which replays every layer's forward. A variant that lowers the peak but
not under usable memory is never offered as a fix: where none fits, such variants close the line,
``over the usable 71.2 GiB, no fix alone: recompute full -> peak 99.0 GiB`` (newcomer trial 27 #B;
Llama-3-405B at dp_shard 8 x tp 8 on 8 dgx-h100, tests/test_fix_lines.py). When none fits alone, the knobs together (not the mesh),
and when that does not fit either, the fewest nodes that would, the same mesh with its data
axis grown with the nodes (:mod:`meshplan.plan_fix_nodes`: at most
:data:`~meshplan.plan_fix_nodes.MAX_NODE_PLANS` node counts tried upwards with the configured
global batch, then at most :data:`~meshplan.plan_fix_nodes.MAX_GROWN_PLANS` doubled and
bisected). A global
batch caps dp at global_batch / micro_batch (:mod:`meshplan.spec.axes.dp`); past that cap the
node counts are planned with the smallest global batch dp splits, and the line names
``training.global_batch`` and the batch the nodes found need (newcomer trial: Llama-3-405B at
dp_shard 8 x tp 8, global batch 8, on 8 dgx-h100 nodes fits from 13 nodes at global batch 13).
Beside those, not counted in :data:`MAX_VARIANTS`, torchtitan's per-layer AC
(``recompute = "layer"``, every ``ac_freq``-th layer checkpointed in full) at the largest
``ac_freq`` that fits (:func:`_layer_variant`; not under Megatron-LM, which has no such policy):
fewer layers replayed than ``full``, so a shorter step where it fits (newcomer: Mixtral-8x22B
under torchtitan, whose line offered full, tp 2 or cp 2, never the setting a torchtitan user
tries first).
Under ``[memory] reserved_verdict = true`` what decides the fit is the caching allocator's reserved
peak plus the communication buffers (:attr:`meshplan.memory.timeline.Timeline.verdict_bytes`), so
the line compares, orders and prints those (``-> reserved peak 47.3 GiB``), not the peaks incl. communication buffers.
The search's own fix for its no-feasible-mesh verdict names the same knobs
(:data:`meshplan.report.search_fix._FIXES` ``memory``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.keymap import OWN, KeyMap
from meshplan.pipeline.registry import get as get_schedule
from meshplan.plan import Plan
from meshplan.plan_fix_cp import cp_variant
from meshplan.plan_fix_ep import ep_variant
from meshplan.plan_fix_mask import mask_variant
from meshplan.plan_fix_nodes import fewest_nodes, nodes_words
from meshplan.memory.headroom import headroom_words
from meshplan.plan_variant import DATA_AXES, folded, mesh_words, planned, resplit, variant_mesh
from meshplan.schedule.steptime import step_time
from meshplan.units import GiB

#: Variants planned at most (each a whole build_plan: about 0.1-1 s): grad_accumulation, recompute,
#: micro_batch, zero1 and zero3 (Megatron-LM under DDP), tp and pp.
MAX_VARIANTS = 7


def _moved(plan: Plan, axis: str) -> Optional[dict[str, int]]:
    """The mesh with ``axis`` twice as large and the data axis half (None where it cannot)."""
    deg = plan.axis_degrees()
    data = next((n for n in DATA_AXES if deg.get(n, 1) > 1 and deg[n] % 2 == 0), None)
    if data is None or plan.spec.rank_to_gpu is not None:
        return None
    if axis == "tp" and deg.get("tp", 1) * 2 > plan.config.cluster.node.gpus:
        return None
    if axis == "pp" and plan.spec.pp_layer_split is not None:
        return None
    out = dict(deg)
    out[data] //= 2
    if axis not in out:
        out = {axis: 1, **out} if axis == "pp" else {**out, axis: 1}
    out[axis] *= 2
    return out


def _defect_resharded(plan: Plan) -> bool:
    """Whether ``reshard_after_forward = true`` would give ``plan``'s schedule a runtime warning
    (:meth:`~meshplan.pipeline.base.PipelineSchedule.warnings`: ZB-V and DualPipeV under FSDP2 over a
    data axis, rule ``v-reshard``), so the memory fix must not propose it."""
    t, mesh = plan.config.training, plan.mesh
    data = t.sharding in ("zero3", "hsdp") and mesh.degree("fsdp") * mesh.degree("dp_replicate") > 1
    return bool(get_schedule(plan.spec.pp_schedule).warnings(t.framework, plan.pp, data, True))


def _variants(plan: Plan, keys: KeyMap = OWN) -> list[tuple[str, Config]]:
    """(words, config) of each single-knob variant, in the module docstring's order, its words in
    ``keys``' names (:mod:`meshplan.keymap`)."""
    cfg, t = plan.config, plan.config.training
    out: list[tuple[str, Config]] = []
    if t.grad_accumulation != "sync":  # no_sync keeps unsharded gradients (and no_sync_unsharded parameters) a step
        out.append((keys.setting("grad_accumulation sync"),
                    replace(cfg, training=t.model_copy(update={"grad_accumulation": "sync"}))))
    if t.recompute != "full" or t.recompute_num_layers is not None:  # block recompute: every layer instead
        out.append((keys.setting("recompute full"), replace(cfg, training=t.model_copy(
            update={"recompute": "full", "recompute_num_layers": None}))))
    if t.micro_batch > 1:
        mb = t.micro_batch // 2 if t.micro_batch % 2 == 0 else 1
        out.append((keys.amount("micro_batch", mb),
                    replace(cfg, training=t.model_copy(update={"micro_batch": mb}))))
    if t.sharding in ("none", "zero1", "zero2") and t.zero12_engine == "megatron" and t.zero0_engine == "ddp":
        out += _sharded(plan, keys)
    elif t.sharding in ("zero3", "hsdp") and not t.reshard_after_forward and not _defect_resharded(plan):
        out.append((keys.setting("reshard_after_forward true"),
                    replace(cfg, training=t.model_copy(update={"reshard_after_forward": True}))))
    for axis in ("tp", "pp"):
        moved = _moved(plan, axis)
        if moved is not None:
            out.append((f"{keys.axis(axis)} x2 ({mesh_words(moved, keys)})",
                        replace(cfg, mesh=variant_mesh(plan, moved))))
    return out[:MAX_VARIANTS] + _deepspeed_variants(plan, keys) + mask_variant(plan, keys)


def _deepspeed_variants(plan: Plan, keys: KeyMap = OWN) -> list[tuple[str, Config]]:
    """(words, config) of DeepSpeed ZeRO-3's memory knobs the plan models (``zero3_engine =
    "deepspeed"``; none otherwise), not counted in :data:`MAX_VARIANTS`: hpZ off
    (``zero_hpz_partition_size = 1``: no secondary copy of the parameters,
    :func:`~meshplan.memory.buffers.hpz_secondary_bytes`, params x 2 B / g a rank; every later
    gather over the world again), ``stage3_max_reuse_distance`` 0 (``[memory]
    deepspeed_max_reuse_elements``: nothing kept gathered from a layer's forward to its backward,
    :func:`~meshplan.memory.deepspeed_fetch.deepspeed_reuse`) and ``stage3_prefetch_bucket_size`` 0
    (``[memory] deepspeed_prefetch_elements``: no prefetch, the next layer's parameters not gathered
    ahead). One that does not lower the peak is dropped by :func:`memory_fix`. Newcomer trial 52:
    Llama-3-70B under ZeRO-3 with hpZ 8 on 8 nodes of A100 40GB (44.4 GiB, 35.5 usable) was told
    32 nodes would fit while hpZ off plans at 28.0 GiB on its 8."""
    cfg, t, m = plan.config, plan.config.training, plan.config.memory
    if t.sharding != "zero3" or t.zero3_engine != "deepspeed":
        return []
    out: list[tuple[str, Config]] = []
    if t.zero_hpz_partition_size > 1:
        out.append((f"{keys.field('training.zero_hpz_partition_size')} 1 (hpZ off: no secondary copy of the "
                    "parameters)", replace(cfg, training=t.model_copy(update={"zero_hpz_partition_size": 1}))))
    if m.deepspeed_max_reuse_elements != 0:
        out.append(("stage3_max_reuse_distance 0 ([memory] deepspeed_max_reuse_elements = 0)",
                    replace(cfg, memory=m.model_copy(update={"deepspeed_max_reuse_elements": 0}))))
    if m.deepspeed_prefetch_elements != 0:
        out.append(("stage3_prefetch_bucket_size 0 ([memory] deepspeed_prefetch_elements = 0: no prefetch)",
                    replace(cfg, memory=m.model_copy(update={"deepspeed_prefetch_elements": 0}))))
    return out


def _sharded(plan: Plan, keys: KeyMap = OWN) -> list[tuple[str, Config]]:
    """(words, config) of each sharding above the configured one that the framework runs, as the
    search enumerates them: ``zero1`` where an engine runs it
    (:attr:`~meshplan.spec.training.TrainingSpec.has_zero1_engine`: Megatron-LM's distributed optimizer,
    not torch without DeepSpeed's), ``zero3`` always; not ``zero2``, which the search enumerates under
    DeepSpeed's engine alone (torch and Megatron-LM run it as their FSDP, the zero3 row), a config
    this branch does not take (``zero12_engine = "megatron"``). Each over every data rank (:func:`~meshplan.plan_variant.folded`: DDP's
    ``dp_replicate`` becomes the ``dp_shard`` that ZeRO shards over, its words naming the new mesh
    where it changes). Newcomer trial 27 #A: Llama-3-8B under DDP over ``dp_replicate 32`` (121.8 GiB)
    was told that nothing fits on up to 4 nodes while ``sharding = "zero3"`` over dp_shard 32 plans at
    8.7 GiB."""
    cfg, t = plan.config, plan.config.training
    renamed = {("dp_shard" if n == "dp" else n): d for n, d in plan.axis_degrees().items()}  # Megatron's dp
    deg = folded(renamed)
    words = mesh_words(deg, keys)  # "" at one data rank (world 1 under DDP): nothing moves
    moved = f" ({words})" if words and words != mesh_words(renamed, keys) else ""
    out = []
    for sh in ("zero1", "zero3")[1 if t.sharding != "none" else 0:]:
        u = t.model_copy(update={"sharding": sh})
        if sh == "zero1" and not u.has_zero1_engine:
            continue
        out.append((keys.setting(f"sharding {sh}") + moved, replace(cfg, mesh=variant_mesh(plan, deg), training=u)))
    return out


def _together(plan: Plan, variants: list[tuple[str, Config]]) -> tuple[str, Config]:
    """The knob variants (not the mesh ones, tp x2 and pp x2: those alone whose training and
    memory options are the config's) applied at once."""
    cfg = plan.config
    update: dict = {}
    memory: dict = {}
    mesh, words = cfg.mesh, []
    last = max((i for i, (_, v) in enumerate(variants) if v.training.sharding != cfg.training.sharding), default=-1)
    for i, (w, v) in enumerate(variants):
        if (v.training == cfg.training and v.memory == cfg.memory) or \
                (v.training.sharding != cfg.training.sharding and i != last):
            continue  # the mesh alone, or a sharding other than the most sharded
        words.append(w)
        update |= {k: val for k, val in v.training.model_dump().items() if val != cfg.training.model_dump()[k]}
        memory |= {k: val for k, val in v.memory.model_dump().items() if val != cfg.memory.model_dump()[k]}
        mesh = v.mesh if v.mesh != cfg.mesh else mesh
    return " + ".join(words), replace(cfg, mesh=mesh, training=cfg.training.model_copy(update=update),
                                      memory=cfg.memory.model_copy(update=memory))


def _layer_fits(plan: Plan, k: int) -> Optional[Plan]:
    """``plan``'s config at ``recompute = "layer"``, ``ac_freq = k`` planned, where it fits (None
    otherwise, or where the rules refuse it)."""
    t = plan.config.training
    p = planned(replace(plan.config, training=t.model_copy(update={"recompute": "layer", "ac_freq": k})))
    return p if p is not None and p.feasible else None


def _layer_variant(plan: Plan, keys: KeyMap = OWN) -> Optional[tuple[str, Plan]]:
    """(words, plan) of torchtitan's per-layer AC (``recompute = "layer"``: every ``ac_freq``-th
    of a rank's layers checkpointed in full, :meth:`~meshplan.spec.training.TrainingSpec.layer_recomputed`)
    at the largest ``ac_freq`` that fits, so the fewest layers replayed (None where none from 2 up
    fits, under Megatron-LM, which has no such policy (:mod:`meshplan.plan_checks`), or where the
    config recomputes every layer already). torchtitan takes any whole ``selective_ac_option``
    k >= 1 (its ``activation_checkpoint.py``: "a positive int representing layer frequency"); k = 1
    is ``full``, and a k above the most layers a stage holds, n, checkpoints none. A larger k
    checkpoints fewer layers (``n // k``), so the peak does not fall as k grows but where the
    positions move at one count: bisected over 2 .. n (or below the configured ac_freq), about
    log2(n) plans (Mixtral-8x22B's 56 layers: 6), then the larger k of the same count tried.

    Llama-3-8B at seq 12288, dp_shard 8, recompute none (tests/test_plan_fix.py): each checkpointed
    layer keeps its input (s h x 2 B) of the 2,065,170,432 B it stored, 1,964,507,136 B less; the
    peak 89.0 GB over 72.0 GB usable needs 9 of the 32 layers: ac_freq 3 (10 layers), not 4 (8).
    """
    t = plan.config.training
    if t.framework == "megatron" or t.recompute == "full":
        return None
    n = max(sum(len(c) for c in stage) for stage in plan.stages)
    top = min(n, t.ac_freq - 1 if t.recompute == "layer" else n)
    lo, hi = 2, top
    best: Optional[tuple[int, Plan]] = None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = _layer_fits(plan, mid)
        if p is None:
            hi = mid - 1
        else:
            best, lo = (mid, p), mid + 1
    if best is None:
        return None
    k, p = best
    for j in range(k + 1, min(top, n // (n // k)) + 1):  # as many layers checkpointed, later positions (ac_freq 16 of
        q = _layer_fits(plan, j)               # 80 layers: 15, 31, .., 79, the last layer's replay at the peak)
        if q is not None:
            k, p = j, q
    return f"{keys.setting(f'recompute layer ac_freq {k}')} (every {_nth(k)} layer of a stage in full)", p


def _nth(k: int) -> str:
    """``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    tail = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{tail}"


def _resplit_variant(plan: Plan, keys: KeyMap = OWN) -> Optional[tuple[str, Plan]]:
    """(words, plan) of HSDP's data axes re-split on the same nodes: ``dp_replicate`` / k and
    ``dp_shard`` x k (:func:`~meshplan.plan_variant.resplit`) for the smallest k of 2, 4, 8, ... whose
    plan fits (the state shards k times thinner; the fewest replicas moved, so the most all-reduce
    over replicas kept); None where the mesh has no replica axis beside dp_shard or none fits (at most
    log2(dp_replicate) plans). Newcomer trial 27 #B: a 30B model at dp_replicate 32 x dp_shard 8 on
    32 dgx-a100 (81.0 GiB) fits at dp_replicate 16 x dp_shard 16, where the line offered tp x2 (73.6
    GiB, over usable) and 64 nodes."""
    deg = plan.axis_degrees()
    if plan.config.training.sharding not in ("zero3", "hsdp") or plan.spec.rank_to_gpu is not None:
        return None
    k = 2
    while (moved := resplit(deg, k)) is not None:
        p = planned(replace(plan.config, mesh=variant_mesh(plan, moved)))
        if p is not None and p.feasible:
            return f"{mesh_words(moved, keys)} (the data axes re-split on the same nodes)", p
        k *= 2
    return None


def _step_s(p: Plan) -> Optional[float]:
    """The predicted step of a fitting variant, as ``meshplan step`` gives it (None where the
    step model refuses it)."""
    try:
        return step_time(p).step_s
    except (ConfigError, ValueError):
        return None


def _parts(found: list[tuple[str, Plan]]) -> tuple[list[str], list[str]]:
    """(fits, rest): the words and peak of each variant that fits, the fastest first with its step,
    one that keeps under 15% of the usable memory free marked ``tight`` (the search's headroom rule,
    :func:`meshplan.memory.headroom.tight`; newcomer trial 27 #C); and of those
    that do not fit, in :func:`_variants`' order (never offered as a fix: newcomer trial 27 #B)."""
    steps = {w: _step_s(p) for w, p in found if p.feasible}
    heads = {w: _headroom(p) for w, p in found if p.feasible}
    fit = sorted((f for f in found if f[1].feasible), key=lambda f: (steps[f[0]] is None, steps[f[0]] or 0.0))
    fits = []
    for words, p in fit:
        s, tight = steps[words], f"; {heads[words]}" if heads[words] else ""
        tail = f" (fits{tight})" if s is None else f" (fits; step {s:.1f} s{tight})"
        fits.append(f"{words} -> {p.timeline.verdict_words()}{tail}")
    return fits, [f"{w} -> {p.timeline.verdict_words()}" for w, p in found if not p.feasible]


def _headroom(p: Plan) -> str:
    """A fitting variant's headroom words where it is tight (:func:`meshplan.memory.headroom.headroom_words`)."""
    return headroom_words(p.timeline.verdict_bytes, p.timeline.usable_bytes, p.config.memory.fragmentation_fraction)


def memory_fix(plan: Plan, keys: KeyMap = OWN) -> Optional[str]:
    """The ``fix:`` line of a plan whose memory timeline does not fit (None when it fits):
    each variant with its planned peak (those that fit first, fastest first, with their step),
    or the knobs together and the fewest nodes; its settings, batch fields and degrees in
    ``keys``' names (a foreign file's: :func:`meshplan.interop.keymaps.keymap_of`)."""
    if plan.feasible:
        return None
    usable = plan.timeline.usable_bytes
    variants = _variants(plan, keys)
    now = plan.timeline.verdict_bytes
    found: list[tuple[str, Plan]] = []
    for words, cfg in variants:
        p = planned(cfg)
        if p is None or p.timeline.verdict_bytes >= now:  # no fix: it does not lower the peak (pp x2 may raise it)
            continue
        found.append((words, p))
    lowered = {w for w, _ in found}  # a [memory] knob (DeepSpeed's) that lowers nothing is not applied with the rest
    variants = [(w, v) for w, v in variants if v.memory == plan.config.memory or w in lowered]
    layer = _layer_variant(plan, keys)
    if layer is not None:
        found.append(layer)
    ep = ep_variant(plan, keys)
    if ep is not None and ep[1].timeline.verdict_bytes < now:
        found.append(ep)
    cp, cp_why = cp_variant(plan, keys)
    if cp is not None and (cp[1].feasible or all(cp[1].timeline.verdict_bytes < p.timeline.verdict_bytes
                                                  for _, p in found)):
        found.append(cp)  # a cp that does not fit: where it lowers the peak the most (long sequences)
    data = _resplit_variant(plan, keys)
    if data is not None:
        found.append(data)
    fits, rest = _parts(found)
    usable_words = f" (usable {usable / GiB:.1f} GiB)"
    if fits:
        return f"fix: {'; '.join(fits)}{usable_words}"
    words, cfg = _together(plan, variants)
    both = planned(cfg) if " + " in words else None  # one knob alone is printed already
    if both is not None:
        all_fit, all_rest = _parts([(f"all of {words}", both)])
        if all_fit:
            return f"fix: {all_fit[0]}{usable_words}{_short(rest, usable)}"
        rest += all_rest
    nodes = (f"{cp_why}; " if cp_why else "") + nodes_words(plan, fewest_nodes(plan, cfg), words, keys)
    return f"fix: {nodes}{_short(rest, usable)}"


def _short(rest: list[str], usable: float) -> str:
    """The variants that lower the peak but not under ``usable`` bytes, after the line's fix and
    named as no fix (newcomer trial 27 #B: ``tp x2 -> peak 73.6 GiB`` was offered first over the usable
    memory, then 67.1 GiB, 80e9 B x 0.9; 71.3 GiB now, 79.25 GiB x 0.9); "" where there are none."""
    return f"; over the usable {usable / GiB:.1f} GiB, no fix alone: {'; '.join(rest)}" if rest else ""
