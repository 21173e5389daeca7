"""``fix:`` lines for a mesh the rules refuse (newcomer trial 16 #3), each fix checked by the same
validation before it is printed (:func:`valid_reason`: :func:`meshplan.plan.build_plan` without
the memory timelines, so the mesh resolves and passes every axis rule; memory is the plan's own
verdict, with its own ``fix:`` line, :mod:`meshplan.plan_fix`).

- :func:`experts_fix`: routed experts that ep does not divide (``experts 6 are not divisible by
  ep 8``): the ep degrees that divide the experts and that the re-factored dense block
  (dp_shard x cp x tp = efsdp x ep x etp, :mod:`meshplan.spec.axes.ep`) takes, each with what
  moves: the experts per ep rank and efsdp, the dense mesh unchanged (ep re-factors it, it is not
  a factor of the world); the degrees that divide the experts but fail a rule named with that rule.
- :func:`split_fix`: layers that pp does not divide and no ``mesh.pp_layer_split`` (``61 layers do not
  divide into pp 16 stages``): the split to give, the one the job's framework sets (Megatron-LM's
  ``--decoder-first/last-pipeline-num-layers`` with their values; torch a balanced split).
- :func:`heads_fix`: tp that does not split the attention heads (handed case C6, ``kv_heads 10 vs
  tp 4``): the tp degrees dividing the world that satisfy the rule (``q_heads % tp == 0`` and
  ``kv_heads % tp == 0`` or ``tp % kv_heads == 0``), each with the mesh it makes (a data axis takes
  the ranks tp gives up) and checked by :func:`valid_reason`.
- :func:`vpp_fix`: layers per stage that vpp (or ``mesh.layers_per_virtual_stage``) does not
  divide (handed case C8, ``20 layers per stage (40 / pp 2) do not divide into vpp 12``): the vpp
  degrees (or chunk sizes) that divide the layers per stage, and the interleaved split where one
  exists.
- :func:`seq_fix`: a sequence that cp's load-balanced split does not cut into 2 x cp chunks
  (``seq_len 131080 is not divisible by 2 * cp (32)``): the nearest divisible seq_len values and
  the divisors of cp that split it, each checked by :func:`valid_reason`.
- :func:`mesh_checker`: the predicate :func:`meshplan.mesh.resolve.world_error` checks its
  rescaled shape and its node count with, so ``shape = [21, 3]`` of Mixtral-8x7B on 32 GPUs is not
  told ``shape [32, 3]`` (ep 3 does not divide 8 experts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

from meshplan.config import Config
from meshplan.errors import ConfigError
from meshplan.keymap import OWN, KeyMap
from meshplan.interop.megatron_pipeline import ACCOUNT, first_last_flags
from meshplan.mesh.layers import balanced_split, ends_short_split, first_last_split
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.plan import Infeasible, build_plan
from meshplan.spec.axes.tp import heads_reason
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.wording import expert_data_axis
from meshplan.units import counted


def valid_reason(cfg: Config) -> Optional[str]:
    """Why ``cfg``'s mesh is refused (its plan's first reason, or the config error it raises),
    None where it resolves and passes every rule (memory not planned)."""
    try:
        p = build_plan(cfg, memory=False, reports=False)
    except (ConfigError, ValueError) as e:
        return str(e)
    return (p.reasons[0] if p.reasons else "refused") if isinstance(p, Infeasible) else None


def mesh_checker(cfg: Config) -> Callable[[MeshSpec, Optional[int]], Optional[str]]:
    """``check(spec, nodes)``: :func:`valid_reason` of ``cfg`` with its mesh ``spec`` (and, given,
    ``nodes`` nodes), for :func:`meshplan.mesh.resolve.world_error`'s fixes."""

    def check(spec: MeshSpec, nodes: Optional[int] = None) -> Optional[str]:
        cluster = cfg.cluster if nodes is None else cfg.cluster.model_copy(update={"nodes": nodes})
        return valid_reason(replace(cfg, mesh=spec, cluster=cluster))

    return check


def with_ep(spec: MeshSpec, ep: int, axis: str = "ep") -> MeshSpec:
    """``spec`` with the degree ``ep`` on ``axis`` (ep or etp; names + shape, the axis appended
    where the names lack it, or Megatron degrees)."""
    if spec.names is not None and spec.shape is not None:
        if axis not in spec.names:
            return spec.model_copy(update={"names": [*spec.names, axis], "shape": [*spec.shape, ep]})
        return spec.model_copy(update={"shape": [ep if n == axis else d for n, d in zip(spec.names, spec.shape)]})
    return spec.model_copy(update={"degrees": {**(spec.degrees or {}), axis: ep}})


def _field(spec: MeshSpec, axis: str = "ep") -> str:
    """The config field that holds the new degree: ``mesh.shape [32, 2]`` or ``[mesh.degrees] ep = 2``."""
    if spec.names is not None:
        return f"mesh.shape {spec.shape}"
    return f"[mesh.degrees] {axis} = {(spec.degrees or {})[axis]}"


def _etp_fix(cfg: Config, block: int, ep: int, etp: int) -> list[str]:
    """Where ep * etp does not divide the dense block: the largest etp below the configured one
    (a divisor of it) whose mesh :func:`valid_reason` accepts with ep kept, as a one-item list
    (empty where none is). Megatron-LM's etp defaults to tp, so tp 2 x ep 8 on 8 GPUs asks for
    16 ranks per expert group; ``--expert-tensor-parallel-size 1`` keeps ep 8 (newcomer trial 21 #2)."""
    e = cfg.model.experts
    if cfg.mesh is None or e % ep:
        return []
    for k in sorted((d for d in range(1, etp) if etp % d == 0), reverse=True):
        spec = with_ep(cfg.mesh, k, "etp")
        if valid_reason(replace(cfg, mesh=spec)) is None:
            split = "the experts without tensor parallelism" if k == 1 else f"each expert's GEMMs split {k} ways"
            return [f"etp {k} ({_field(spec, 'etp')}: ep kept, {counted(e // ep, 'expert')} per ep rank, "
                    f"{expert_data_axis(cfg.training.sharding)} {block // (ep * k)}; {split})"]
    return []


def _ep_of(spec: MeshSpec) -> int:
    """The ep degree ``spec`` gives (1 where it has no ep axis)."""
    if spec.names is not None and spec.shape is not None:
        return dict(zip(spec.names, spec.shape)).get("ep", 1)
    return (spec.degrees or {}).get("ep", 1)


def _dense_mesh(plan: Infeasible) -> Optional[Mesh]:
    """The plan's resolved mesh or, where ep * etp does not divide the dense block (no mesh
    resolved), its mesh at ep 1: the dense axes that block is made of (None where that does not
    resolve either: the degrees do not make the world)."""
    if plan.mesh is not None or plan.config.mesh is None:
        return plan.mesh
    mesh = resolve_mesh(with_ep(plan.config.mesh, 1), plan.world)
    return mesh if isinstance(mesh, Mesh) else None


def experts_fix(plan: Infeasible) -> Optional[str]:
    """The ``fix:`` line of a mesh whose ep does not divide the model's routed experts, or whose
    ep * etp does not divide the dense block dp_shard * cp * tp (None otherwise): each ep > 1
    dividing the experts whose mesh :func:`valid_reason` accepts (so dividing the block too),
    with the experts per ep rank and efsdp (``edp`` under DDP and ZeRO-1/2, as the plan names that
    group: :func:`~meshplan.spec.wording.expert_data_axis`; "efsdp" there before newcomer trial nc62
    #3); the other divisors with the rule that refuses them;
    ep 1 (no expert parallelism) where no ep > 1 is accepted. Where the block refuses ep * etp and
    a smaller etp with ep kept fits (:func:`_etp_fix`), that etp first.

    Mixtral-8x7B's layers with ``experts = 6`` at dp_shard 32 x ep 8 (32 GPUs): ep 2 (3 experts
    per rank, efsdp 16); ep 3 and 6 divide 6 but not the dense block of 32. DeepSeek-V3's 256
    experts at pp 16 x dp 128 x ep 48 (newcomer trial 17 #1): ep 2, 4, ..., 128, which divide
    both; ep 256 refused by the block (tests/test_config_fixes.py).
    """
    cfg, mesh = plan.config, _dense_mesh(plan)
    if mesh is None or cfg.mesh is None or not cfg.model.is_moe:
        return None
    e, block, ep, etp = cfg.model.experts, mesh.block_size, _ep_of(cfg.mesh), mesh.etp
    block_bad = block % (ep * etp) != 0
    if e % ep == 0 and not block_bad:
        return None
    edp = expert_data_axis(cfg.training.sharding)
    good: list[str] = _etp_fix(cfg, block, ep, etp) if block_bad else []
    bad: list[str] = []
    for k in (k for k in range(2, e + 1) if e % k == 0 and k != ep):
        spec = with_ep(cfg.mesh, k)
        why = valid_reason(replace(cfg, mesh=spec))
        if why is None:
            good.append(f"ep {k} ({_field(spec)}: {counted(e // k, 'expert')} per ep rank, {edp} "
                        f"{block // (k * etp)}; the dense mesh unchanged)")
        else:
            bad.append(f"ep {k}: {why}")
    if not good and valid_reason(replace(cfg, mesh=with_ep(cfg.mesh, 1))) is None:
        good.append(f"ep 1 ({_field(with_ep(cfg.mesh, 1))}: every rank holds all {e} experts, no expert parallelism)")
    if not good:
        return None
    refused = f" (refused: {'; '.join(bad)})" if bad else ""
    also = f" and ep * etp({etp}) must divide {mesh.block_expr} = {block}" if block_bad else ""
    return f"fix: ep must divide the {e} experts{also}: {'; or '.join(good)}{refused}"


def split_fix(plan: Infeasible, keys: KeyMap = OWN) -> Optional[str]:
    """The ``fix:`` line of a pipeline whose pp (and vpp) the model's layers do not divide and
    whose config gives no ``mesh.pp_layer_split`` (None otherwise): the split the framework sets,
    checked by :func:`valid_reason`. Under ``training.framework = "megatron"``, at vpp 1
    :func:`~meshplan.mesh.layers.first_last_split` with its ``--decoder-first/last-pipeline-num-layers``
    (:func:`~meshplan.interop.megatron_pipeline.first_last_flags`; where it has none, that no split
    with even middle stages exists at this pp), with vpp > 1 Llama 3's
    :func:`~meshplan.mesh.layers.ends_short_split` with ``--account-for-embedding/loss-in-pipeline-split``;
    under torch :func:`~meshplan.mesh.layers.balanced_split` at vpp 1 (torchtitan takes any split,
    ``export --to torchtitan`` writes it as ``module_fqns_per_model_part``), the same Llama 3 split
    with vpp > 1.

    DeepSeek-V3's 61 layers at pp 16 (tests/test_plan_split_fix.py): Megatron-LM's [3, 4 x 14, 2];
    torch's [3, 4 x 13, 3, 3]. The pp degree and the split's field in ``keys``' names (a foreign
    file's: :func:`meshplan.interop.keymaps.keymap_of`; ``pipeline_parallel_degree 16``).
    """
    cfg, mesh = plan.config, plan.mesh
    spec = cfg.mesh
    if mesh is None or spec is None or spec.pp_layer_split is not None or spec.layers_per_virtual_stage:
        return None
    layers, pp, vpp = cfg.model.layers, mesh.degree("pp"), spec.virtual_stages
    if pp < 2 or pp > layers or (layers % pp == 0 and (layers // pp) % vpp == 0):
        return None
    megatron = cfg.training.framework == "megatron"
    split = ends_short_split(layers, pp, vpp) if vpp > 1 else first_last_split(layers, pp) if megatron \
        else balanced_split(layers, pp)
    head = f"fix: {layers} layers over {keys.axis('pp')} {pp}" + (f" x vpp {vpp}" if vpp > 1 else "")
    if split is None and not megatron:
        return (f"{head}: no interleaved split the planner takes: Llama 3's rule (the embedding and the output "
                f"layer each a layer's slot) needs layers + 2 a multiple of pp x vpp; choose another pp or vpp")
    if split is None:
        rule = ("--account-for-embedding/loss-in-pipeline-split need layers + 2 a multiple of pp x vpp" if vpp > 1
                else "--decoder-first/last-pipeline-num-layers spread the middle stages evenly and leave an end "
                     "stage no layer")
        return f"{head}: no split Megatron-LM sets ({rule}); choose another pp"
    why = valid_reason(replace(cfg, mesh=spec.model_copy(update={"pp_layer_split": split})))
    if why is not None:
        return None
    if megatron:
        flags = [f"--num-virtual-stages-per-pipeline-rank {vpp}", *ACCOUNT] if vpp > 1 else first_last_flags(split)
        how = f"Megatron-LM: {' '.join(flags)}"
    else:  # a torchtitan file: its own setting (module names, or the counts of its own cut: keys.split_setting)
        how = f"layers per stage {split}" if keys.splits is not None else \
            "torchtitan's module_fqns_per_model_part, which export --to torchtitan writes"
    return f"{head}: give {keys.split_setting(split, vpp)} ({how})"


#: The data axes that take the ranks a smaller tp gives up (:func:`heads_fix`), first found first.
DATA_AXES = ("dp_shard", "dp", "dp_replicate")


def _with_degrees(spec: MeshSpec, new: dict[str, int]) -> MeshSpec:
    """``spec`` with the degrees ``new`` on axes it names (names + shape, or order + degrees)."""
    if spec.names is not None and spec.shape is not None:
        return spec.model_copy(update={"shape": [new.get(n, d) for n, d in zip(spec.names, spec.shape)]})
    return spec.model_copy(update={"degrees": {**(spec.degrees or {}), **new}})


def _retp(spec: MeshSpec, tp: int, old: int, name: str = "tp") -> Optional[MeshSpec]:
    """``spec`` at tp (axis ``name``) ``tp`` with the world kept: an axis given as -1 infers it, else the first
    data axis (:data:`DATA_AXES`) takes ``old / tp`` times its degree (None where none can)."""
    pairs = dict(zip(spec.names, spec.shape)) if spec.names is not None and spec.shape is not None \
        else dict(spec.degrees or {})
    if -1 in pairs.values():
        return _with_degrees(spec, {name: tp})
    for axis in (a for a in DATA_AXES if a in pairs):
        if (pairs[axis] * old) % tp == 0:
            return _with_degrees(spec, {name: tp, axis: pairs[axis] * old // tp})
    return None


def _mesh_words(spec: MeshSpec) -> str:
    """The mesh field of a fix: ``mesh.shape [4, 2]`` or ``mesh.degrees {'dp': 4, 'tp': 2}``."""
    return f"mesh.shape {spec.shape}" if spec.names is not None else f"mesh.degrees {spec.degrees}"


def _either(items: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return ", ".join(items[:-1]) + (" or " if len(items) > 1 else "") + items[-1]


def _tp_choice(keys: KeyMap, spec: MeshSpec, new: MeshSpec, tp: int, name: str = "tp") -> str:
    """One choice of :func:`heads_fix`, ``tp 2 (mesh.shape [4, 2])``; in ``keys``' names the
    degrees it changes where the file has keys for them (``tensor_parallel_degree 2
    (parallelism.data_parallel_shard_degree = 4, parallelism.tensor_parallel_degree = 2)``), said
    once where tp alone changes (``--tensor-model-parallel-size 2``)."""
    change = None if spec.names is None else keys.mesh_change(spec.names, spec.shape or [], new.shape or [])
    if change is not None and change == keys.degree_setting(name, tp):
        return change
    return f"{keys.axis(name)} {tp} ({change or _mesh_words(new)})"


#: Multiples of 2 x cp tried each way from the configured seq_len (:func:`seq_fix`): the other rules
#: (sequence parallel's share over tp) may need a larger multiple.
SEQ_STEPS = 64


def seq_fix(plan: Infeasible, keys: KeyMap = OWN) -> Optional[str]:
    """The ``fix:`` line of a sequence that cp's load-balanced causal split does not cut into
    ``2 x cp`` chunks (rule ``seq_cp``, :mod:`meshplan.spec.axes.cp`; None otherwise; newcomer
    trial 53 #7): the nearest ``seq_len`` below and above, multiples of ``2 x cp`` (at most
    :data:`SEQ_STEPS` of them each way), that every rule takes, then the divisors of the configured
    cp that split the sequence (a data axis takes the ranks, :func:`_retp`), each checked by
    :func:`valid_reason` (with sequence parallelism ``s / cp`` must be a multiple of tp too).

    The trial's seq_len 131,080 at cp 16 x tp 8 with SP: seq_len a multiple of 2 x 16 and of
    16 x 8, 128: 131,072 (1,024 x 128) or 131,200; no cp: 131,080 = 8 x 16,385 takes tp 8 x cp
    only at cp 1 (16,385 is odd) (tests/test_nc53_hints.py)."""
    cfg, mesh, spec = plan.config, plan.mesh, plan.config.mesh
    s = cfg.training.seq_len
    if mesh is None or spec is None or mesh.degree("cp") <= 1 or s % (2 * mesh.degree("cp")) == 0:
        return None
    cp = mesh.degree("cp")
    lo, field = s // (2 * cp) * (2 * cp), keys.field("training.seq_len")
    ok = lambda v: v > 0 and valid_reason(replace(cfg, training=cfg.training.model_copy(update={"seq_len": v}))) is None
    below = next((v for v in range(lo, max(lo - SEQ_STEPS * 2 * cp, 0), -2 * cp) if ok(v)), None)
    above = next((v for v in range(lo + 2 * cp, lo + (SEQ_STEPS + 1) * 2 * cp, 2 * cp) if ok(v)), None)
    seqs = [str(v) for v in (below, above) if v is not None]
    good = [f"{field} {_either(seqs)}"] if seqs else []
    for c in (c for c in range(cp - 1, 1, -1) if cp % c == 0 and s % (2 * c) == 0):
        new = _retp(spec, c, cp, "cp")
        if new is not None and valid_reason(replace(cfg, mesh=new)) is None:
            good.append(_tp_choice(keys, spec, new, c, "cp"))
    if not good:
        return None
    return f"fix: seq_len {s} must split into 2 x cp = {2 * cp} chunks (load-balanced causal CP): {'; or '.join(good)}"


def heads_fix(plan: Infeasible, keys: KeyMap = OWN) -> Optional[str]:
    """The ``fix:`` line of a mesh whose tp does not split the attention heads (None otherwise):
    each tp dividing the world with ``q_heads % tp == 0`` and (``kv_heads % tp == 0`` or
    ``tp % kv_heads == 0``) (:func:`~meshplan.spec.axes.tp.heads_reason`, handed case C6) whose mesh
    (:func:`_retp`: a data axis takes the ranks) :func:`valid_reason` accepts.

    C6's 40 q / 10 KV heads at dp 2 x tp 4 on 8 GPUs: tp 1, 2, 4, 8 divide the world; 4 and 8 fail
    the KV rule (10 % 4, 4 % 10; 10 % 8, 8 % 10): tp 1 (mesh.shape [8, 1]) or tp 2 ([4, 2])
    (tests/test_handed_cli.py). The choices in ``keys``' names (:func:`_tp_choice`).
    """
    cfg, mesh, spec = plan.config, plan.mesh, plan.config.mesh
    if mesh is None or spec is None or heads_reason(cfg.model, mesh.degree("tp")) is None:
        return None
    old, q, kv = mesh.degree("tp"), cfg.model.q_heads, cfg.model.n_kv_heads
    good = []
    for t in (t for t in range(1, plan.world + 1) if plan.world % t == 0 and t != old):
        new = None if heads_reason(cfg.model, t) else _retp(spec, t, old)
        if new is not None and valid_reason(replace(cfg, mesh=new)) is None:
            good.append(_tp_choice(keys, spec, new, t))
    if not good:
        return None
    return (f"fix: tp must divide q_heads {q} and divide or be a multiple of kv_heads {kv} (of the divisors of the "
            f"world {plan.world}): {'; or '.join(good)}")


def _chunk_mismatch(layers: int, pp: int, spec: MeshSpec) -> bool:
    """Whether pp divides ``layers`` but the vpp (or the chunk size) of ``spec`` does not divide
    the layers per stage."""
    if pp < 2 or layers % pp:
        return False
    per = layers // pp
    chunk = spec.layers_per_virtual_stage
    return bool(per % chunk) if chunk else spec.virtual_stages > 1 and per % spec.virtual_stages != 0


def vpp_fix(plan: Infeasible, keys: KeyMap = OWN) -> Optional[str]:
    """The ``fix:`` line of an interleaved pipeline whose vpp (or ``mesh.layers_per_virtual_stage``)
    does not divide the layers per stage ``layers / pp`` (None otherwise; pp not dividing the
    layers is :func:`split_fix`'s): the vpp degrees v > 1 dividing ``layers / pp`` (the chunk sizes
    c < layers / pp dividing it, vpp = layers / pp / c), each checked by :func:`valid_reason`; under
    torch the vpp kept with uneven chunks (:func:`_uneven_chunks`) (handed case C8).

    40 layers at pp 2, vpp 12 (20 a stage): vpp 2, 4, 5, 10 or 20; under torch also
    ``pp_layer_split = [20, 20]`` with chunks of 1 and 2 layers. 80 layers at pp 16 with 2 layers
    a chunk (5 a stage): layers_per_virtual_stage 1 (vpp 5) (tests/test_handed_cli.py).
    """
    cfg, mesh, spec = plan.config, plan.mesh, plan.config.mesh
    if mesh is None or spec is None or spec.pp_layer_split is not None:
        return None
    layers, pp = cfg.model.layers, mesh.degree("pp")
    if not _chunk_mismatch(layers, pp, spec):
        return None
    per, chunk = layers // pp, spec.layers_per_virtual_stage
    head = f"fix: {layers} layers over {keys.axis('pp')} {pp} = {per} a stage"
    sizes = [c for c in range(1, per) if per % c == 0] if chunk else [v for v in range(2, per + 1) if per % v == 0]
    field = keys.field("mesh.layers_per_virtual_stage" if chunk else "mesh.virtual_stages")
    good = []
    for k in sizes:
        update = {"layers_per_virtual_stage": k} if chunk else {"virtual_stages": k}
        if valid_reason(replace(cfg, mesh=spec.model_copy(update=update))) is None:
            good.append(f"{k} (vpp {per // k})" if chunk else str(k))
    what = f"{field} {_either(good)}, a divisor of {per}" if good else ""
    also = _uneven_chunks(plan, per, keys) if not chunk else ""
    if not what and not also:
        return None
    return f"{head}: {'; or '.join(x for x in (what, also) if x)}"


def _uneven_chunks(plan: Infeasible, per: int, keys: KeyMap) -> str:
    """Under framework torch, the vpp kept with uneven chunks: ``mesh.pp_layer_split`` of ``per``
    layers on each of the pp stages, each stage's layers spread over its vpp chunks as evenly as
    they go (:func:`~meshplan.mesh.layers.stage_layers`; torchtitan builds any split, which
    ``export --to torchtitan`` writes as ``module_fqns_per_model_part``), where :func:`valid_reason`
    accepts it (every chunk a layer); empty otherwise. Megatron-LM takes no such split (Megatron-Core
    chunks a stage evenly, or Llama 3's split of :func:`~meshplan.mesh.layers.ends_short_split`,
    which needs pp x vpp to divide layers + 2: never with pp >= 3 dividing the layers)."""
    cfg, spec = plan.config, plan.config.mesh
    if cfg.training.framework == "megatron" or spec is None or plan.mesh is None:
        return ""
    pp, vpp = plan.mesh.degree("pp"), spec.virtual_stages
    split = [per] * pp
    if valid_reason(replace(cfg, mesh=spec.model_copy(update={"pp_layer_split": split}))) is not None:
        return ""
    chunks = f"chunks of {per // vpp} and {per // vpp + 1} layers"
    if keys.splits is not None:  # a torchtitan file: its own setting (nc58 #3b)
        return f"{keys.split_setting(split, vpp)} with vpp {vpp} kept (layers per stage {split}; {chunks})"
    return f"mesh.pp_layer_split = {split} with vpp {vpp} kept ({chunks}; torchtitan's module_fqns_per_model_part)"
