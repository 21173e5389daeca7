"""The [mesh] table of a TOML config to its :class:`~meshplan.spec.mesh.MeshSpec`
(:mod:`meshplan.config` reads the file and checks the tables together): axis names made
canonical (:func:`read_mesh`: ``fsdp`` is ``dp_shard``, aliases renamed with a note), the names
as written (:func:`axes_of`), and the expert-tensor-parallel degree a mesh leaves out filled as
each framework defaults it (:func:`megatron_etp`: Megatron-LM's etp = tp; :func:`torch_etp`:
torchtitan's etp = tp at ep 1), with a note.
"""

from __future__ import annotations

from meshplan.config_errors import build
from meshplan.errors import ConfigError
from meshplan.spec.axes import canonical_names
from meshplan.spec.mesh import MeshSpec


def read_mesh(t: dict) -> tuple[MeshSpec, tuple[str, ...]]:
    """The [mesh] table with canonical axis names (aliases renamed, close slips refused
    unless in ``custom_axes``) and the notes of what was renamed."""
    spec = build(MeshSpec, t, "mesh")
    if spec.names is not None:
        given, field = list(spec.names), "mesh.names"
    else:  # MeshSpec: names + shape or order + degrees
        given, field = [n.strip() for n in (spec.order or "").split("-")], "mesh.order"
    stray = [n for n in spec.custom_axes if n not in given]
    if stray:
        raise ConfigError("mesh.custom_axes", f"{stray[0]!r} is not an axis of the mesh ({', '.join(given)}); "
                          f"list only axes the mesh names")
    names, notes = canonical_names(given, spec.custom_axes, field)
    if spec.names is not None:
        return spec.model_copy(update={"names": list(names)}), notes
    renamed = dict(zip(given, names))
    degrees = {renamed.get(k, k): v for k, v in (spec.degrees or {}).items()}
    return spec.model_copy(update={"order": "-".join(names), "degrees": degrees}), notes


def axes_of(spec: MeshSpec | None) -> list[str]:
    """The axis names of ``spec`` as written (names, or the order string's; none without a mesh)."""
    if spec is None:
        return []
    return list(spec.names) if spec.names is not None else [n.strip() for n in (spec.order or "").split("-") if n.strip()]


def megatron_etp(spec: MeshSpec, notes: tuple[str, ...]) -> tuple[MeshSpec, tuple[str, ...]]:
    """Under ``framework = "megatron"`` a mesh with ep > 1 and no ``etp`` gets etp = tp, as
    Megatron-LM defaults ``--expert-tensor-parallel-size`` to the tensor-parallel size
    (``if args.expert_tensor_parallel_size is None: args.expert_tensor_parallel_size =
    args.tensor_model_parallel_size``, megatron/training/arguments.py:587-588 at NVIDIA/Megatron-LM
    d98e8a6), with a note; the same default :func:`meshplan.interop.megatron.read` takes. A given
    etp (1 included) is kept; ``framework = "torch"`` has its own default (:func:`torch_etp`:
    tp at ep 1, else 1, :data:`meshplan.spec.axes.moe_tp.TORCH_ETP`).

    >>> s, n = megatron_etp(MeshSpec(names=["dp", "tp", "ep"], shape=[16, 2, 8]), ())
    >>> s.names, s.shape, n[0].split(",")[0]
    (['dp', 'tp', 'ep', 'etp'], [16, 2, 8, 2], 'mesh.etp not given: 2')
    """
    deg = dict(zip(spec.names, spec.shape or [])) if spec.names is not None else dict(spec.degrees or {})
    tp = deg.get("tp", 1)
    if "etp" in deg or deg.get("ep", 1) <= 1 or tp <= 1:
        return spec, notes
    note = (f"mesh.etp not given: {tp}, the tp degree, as Megatron-LM defaults --expert-tensor-parallel-size to "
            f"--tensor-model-parallel-size (framework megatron); for experts without tp write in [mesh] "
            f"{_etp_one(spec, deg)}")
    return _with_etp(spec, deg, tp), (*notes, note)


def _etp_one(spec: MeshSpec, deg: dict[str, int]) -> str:
    """The [mesh] lines of ``spec`` with etp 1 added, as the user writes them (the fix text of
    :func:`megatron_etp`'s note; ``etp = 1`` alone in [mesh] is no key: etp is an axis).

    >>> _etp_one(MeshSpec(names=["dp", "tp", "ep"], shape=[16, 2, 8]), {})
    'names = ["dp", "tp", "ep", "etp"] and shape = [16, 2, 8, 1]'
    >>> _etp_one(MeshSpec(order="tp-ep-dp", degrees={"tp": 2, "ep": 8, "dp": 16}), {"tp": 2, "ep": 8, "dp": 16})
    'degrees = {tp = 2, ep = 8, dp = 16, etp = 1}'
    """
    if spec.names is not None:
        names = ", ".join(f'"{n}"' for n in [*spec.names, "etp"])
        return f"names = [{names}] and shape = [{', '.join(str(d) for d in [*(spec.shape or []), 1])}]"
    return "degrees = {" + ", ".join(f"{k} = {v}" for k, v in (deg | {"etp": 1}).items()) + "}"


def torch_etp(spec: MeshSpec, notes: tuple[str, ...]) -> tuple[MeshSpec, tuple[str, ...]]:
    """Under ``framework = "torch"`` an MoE model's mesh with ep 1, tp > 1 and no ``etp`` gets
    etp = tp, what torchtitan at b5bcd76 runs (:func:`meshplan.spec.axes.moe_tp.torch_etp`: each routed
    expert sharded over tp like a dense MLP), with a note; a given etp is kept (the rule
    ``torch_etp`` refuses one other than tp). The torch twin of :func:`megatron_etp`.

    >>> s, n = torch_etp(MeshSpec(names=["dp_shard", "tp"], shape=[4, 2]), ())
    >>> s.names, s.shape, n[0].split(",")[0]
    (['dp_shard', 'tp', 'etp'], [4, 2, 2], 'mesh.etp not given: 2')
    """
    deg = dict(zip(spec.names, spec.shape or [])) if spec.names is not None else dict(spec.degrees or {})
    tp = deg.get("tp", 1)
    if "etp" in deg or deg.get("ep", 1) != 1 or tp <= 1:
        return spec, notes
    note = (f"mesh.etp not given: {tp}, the tp degree, as torchtitan at ep 1 shards every routed expert over tp "
            f"(w1/w3 Shard(1), w2 Shard(2); framework torch, moe_sharding.py at b5bcd76)")
    return _with_etp(spec, deg, tp), (*notes, note)


def _with_etp(spec: MeshSpec, deg: dict[str, int], etp: int) -> MeshSpec:
    """``spec`` with an ``etp`` axis of degree ``etp`` added as the user wrote the mesh: appended to
    ``names``/``shape``, or first in ``order`` with ``degrees`` (``deg``, the degrees as written).

    >>> _with_etp(MeshSpec(names=["dp", "tp"], shape=[4, 2]), {}, 2).shape
    [4, 2, 2]
    """
    if spec.names is not None:
        return spec.model_copy(update={"names": [*spec.names, "etp"], "shape": [*(spec.shape or []), etp]})
    return spec.model_copy(update={"order": f"etp-{spec.order}", "degrees": deg | {"etp": etp}})
