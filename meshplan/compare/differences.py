"""What two configs of ``meshplan compare`` differ in besides the mesh layout
(:func:`config_differences`): the workload ([model], the cluster, the [training] and [memory]
fields that are not design choices), which must agree for a comparison, and the plan's knobs,
which the verdict weighs; each field as it acts (defaults that resolve from other fields filled
in, a knob only where it applies to both sides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.compare.engine_grads import GRAD_DTYPE, engine_grad_dtype
from meshplan.config import Config
from meshplan.mesh.resolve import Mesh, resolve_mesh
from meshplan.spec.memory import MEMORY_KNOBS
from meshplan.spec.training_knobs import PLAN_KNOBS


# [mesh] fields that spell the layout (compared as the resolved layout, :func:`meshplan.compare.same_mesh`)
# or only name it; every other [mesh] field is a knob of the plan (schedule, virtual stages, layer split,
# sequence and loss parallelism, rank order).
_MESH_SPELLING = ("names", "shape", "order", "degrees", "world", "custom_axes")

#: Knobs that act only where a mesh axis has degree > 1, with that axis: the pipeline's schedule, its
#: virtual stages, layer split and schedule runs per step (plan.py: one schedule run at pp 1) at pp 1;
#: sequence parallelism, loss parallelism (the logits sharded over tp) and tp's communication overlap
#: at tp 1. Such a knob is no difference where the axis is 1 on either side, as a training knob that
#: does not apply to a side's sharding (:meth:`~meshplan.spec.training_knobs.TrainingKnobs.knob_acts`).
AXIS_KNOBS = {"mesh.pp_schedule": "pp", "mesh.virtual_stages": "pp", "mesh.layers_per_virtual_stage": "pp",
              "mesh.pp_layer_split": "pp", "training.pp_schedule_runs": "pp", "mesh.sequence_parallel": "tp",
              "mesh.loss_parallel": "tp", "training.tp_comm_overlap": "tp", "training.cp_attention": "cp"}


@dataclass(frozen=True)
class Differences:
    """What two configs of ``meshplan compare`` differ in, besides the mesh layout.
    ``workload``: (field, A's value, B's value) where the workload differs (the model's
    architecture, :meth:`~meshplan.spec.model.ModelSpec.architecture`, not its name: a catalog
    model and the same layers, widths and heads imported as ``megatron-args`` agree; the cluster
    but its free-text name and sources, the [training] fields outside
    :data:`~meshplan.spec.training_knobs.PLAN_KNOBS`, the [memory] assumptions outside
    :data:`~meshplan.spec.memory.MEMORY_KNOBS`); ``knobs``: the same for the plan's design
    choices (those knobs and the [mesh] fields besides the layout), values as in the specs;
    ``training.grad_dtype`` is one of them where each side's is its engine's own and the engines
    differ (:func:`~meshplan.compare.engine_grads.engine_grad_dtype`).

    >>> from meshplan.config import config_from_dict
    >>> base = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
    ...         "training": {"global_batch": 8, "seq_len": 1024}, "mesh": {"names": ["dp_shard"], "shape": [8]}}
    >>> a = config_from_dict(base)
    >>> b = config_from_dict({**base, "training": {"global_batch": 8, "seq_len": 1024, "recompute": "full"}})
    >>> c = config_from_dict({**base, "cluster": {"system": "dgx-a100", "nodes": 1}})
    >>> config_differences(a, b).knobs, config_differences(a, c).workload[0]
    ((('training.recompute', 'selective', 'full'),), ('cluster.gpu.name', 'h100-sxm5-80gb', 'a100-sxm-80gb'))
    """

    workload: tuple[tuple[str, Any, Any], ...]
    knobs: tuple[tuple[str, Any, Any], ...]


def _architecture(c: Config) -> dict:
    """The model's :meth:`~meshplan.spec.model.ModelSpec.architecture`, without ``max_position``
    where it sets no weight (RoPE, ALiBi: how far the run's positions reach, not a cost; a learned
    table's rows are weights): newcomer trial 49's import of ``--max-position-embeddings 32768``
    (llama3-70b, max_position 32768) was refused beside catalog llama3-70b at the same seq_len
    (``model.max_position differs``). A side whose seq_len is past its max_position is warned by
    ``plan`` (:func:`meshplan.plan_runtime.position_warning`)."""
    arch = c.model.architecture()
    return arch if c.model.position_embedding == "learned" else {k: v for k, v in arch.items() if k != "max_position"}


def config_differences(a: Config, b: Config) -> Differences:
    """:class:`Differences` of two configs (each field's path from its table, ``training.recompute``)."""
    work = _leaf_differences("model", _architecture(a), _architecture(b))  # not its name
    work += _leaf_differences("cluster", a.cluster.model_dump(exclude={"name"}), b.cluster.model_dump(exclude={"name"}))
    ta, tb = _training_as_it_acts(a.training), _training_as_it_acts(b.training)
    work += [(f"training.{k}", ta[k], tb[k]) for k in ta if k not in PLAN_KNOBS and ta[k] != tb[k]]
    # a knob as it acts, and only where it applies to both sides (TrainingSpec.knob_acts: a DeepSpeed
    # ZeRO-2 plan's zero3_engine default is no difference from a ZeRO-3 plan's engine)
    acts = [(k, a.training.knob_acts(k), b.training.knob_acts(k)) for k in PLAN_KNOBS]
    knobs = [(f"training.{k}", x[1], y[1]) for k, x, y in acts if x[0] and y[0] and x[1] != y[1]]
    if a.mesh is not None and b.mesh is not None:
        ma, mb = a.mesh.model_dump(exclude=set(_MESH_SPELLING)), b.mesh.model_dump(exclude=set(_MESH_SPELLING))
        knobs += [(f"mesh.{k}", ma[k], mb[k]) for k in ma if ma[k] != mb[k]]
    oa, ob = a.memory.model_dump(), b.memory.model_dump()
    work += [(f"memory.{k}", oa[k], ob[k]) for k in oa if k not in MEMORY_KNOBS and oa[k] != ob[k]]
    # as the training knobs above: as it acts (DeepSpeed's reduce_bucket_size unset: its 5e8; ZeRO-3's
    # prefetch sizes unset: 5e7, 1e9) and only where it applies to both sides (MemoryOptions.knob_acts)
    macts = [(k, a.memory.knob_acts(k, a.training), b.memory.knob_acts(k, b.training)) for k in MEMORY_KNOBS]
    knobs += [(f"memory.{k}", x[1], y[1]) for k, x, y in macts if x[0] and y[0] and x[1] != y[1]]
    if engine_grad_dtype(a.training, b.training):  # each side's engine's own gradients: part of the engine choice
        knobs += [k for k in work if k[0] == GRAD_DTYPE]
        work = [k for k in work if k[0] != GRAD_DTYPE]
    la, lb = _mesh(a), _mesh(b)
    knobs = [k for k in knobs if k[0] not in AXIS_KNOBS or _axis_acts(la, k[0]) and _axis_acts(lb, k[0])]
    return Differences(tuple(work), tuple(knobs))


def _mesh(config: Config) -> Mesh | None:
    """The config's resolved mesh, None where it has none or it does not resolve (every knob then acts)."""
    if config.mesh is None:
        return None
    mesh = resolve_mesh(config.mesh, config.cluster.world, config.cluster.node.gpus)
    return mesh if isinstance(mesh, Mesh) else None


def _axis_acts(mesh: Mesh | None, knob: str) -> bool:
    """Whether ``knob`` of :data:`AXIS_KNOBS` acts on ``mesh``: its axis has degree > 1 (or the mesh is unknown)."""
    return mesh is None or mesh.degree(AXIS_KNOBS[knob]) > 1


def _training_as_it_acts(t: Any) -> dict[str, Any]:
    """``[training]`` dumped with the defaults that resolve from other fields filled in, so that
    an unset field and its explicit default agree: the gradients' reduce dtype (unset: a default of
    framework and param_dtype, so unset on a torch plan and "fp32" on the same plan exported to
    Megatron-LM and imported back agree) and the MoE routing (:attr:`TrainingSpec.moe_routing
    <meshplan.spec.training.TrainingSpec.moe_routing>`: unset is dropless, as Megatron-LM's and
    torchtitan's defaults, so unset and ``moe_dropless = true`` agree; a dropless plan has no
    capacity factor) and the clipping norm (:attr:`~meshplan.spec.training.TrainingSpec.clip_norm`:
    unset is 1.0, so unset and 1.0 agree).

    >>> from meshplan.spec.training import TrainingSpec
    >>> d = _training_as_it_acts(TrainingSpec(global_batch=8, seq_len=4096))
    >>> d["moe_dropless"], d["moe_capacity_factor"]
    (True, None)
    """
    d = t.model_dump()
    d["grad_reduce_dtype"], d["grad_clip_norm"] = t.gradient_reduce_dtype, t.clip_norm
    factor, dropless = t.moe_routing
    d["moe_dropless"], d["moe_capacity_factor"] = dropless, None if dropless else factor
    return d


def _leaf_differences(where: str, a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """(path, a, b) of every leaf (nested tables and equal-length lists walked) where two dumped
    specs differ; ``source`` texts (citations) are not compared."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a if k != "source" for d in _leaf_differences(f"{where}.{k}", a[k], b[k])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _leaf_differences(f"{where}[{i}]", x, y)]
    return [] if a == b else [(where, a, b)]


def knob(v: Any) -> str:
    """A knob's value as its TOML spelling (``true``, ``40, 40``; ``unset`` for None; a tuple, as
    ``recompute_modules`` holds its TOML list, as that list).

    >>> knob(None), knob(True), knob(("core_attn", "mlp"))
    ('unset', 'true', '[core_attn, mlp]')
    """
    if v is None:
        return "unset"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return f"[{', '.join(map(str, v))}]" if len(v) <= 8 else f"[{len(v)} values]"
    return str(v)
