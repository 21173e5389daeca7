"""Checkpoints that move between meshes: DCP for tensors, a meshplan JSON file beside it for
the mesh and for state whose meaning depends on the data-parallel degree (handed case C13).

Layout of a checkpoint folder ``P``::

    P/dcp/            torch.distributed.checkpoint (DCP) files: {"model": ..., "optim": ...}
                      from get_state_dict, keyed by fully qualified names, so any mesh can load them
    P/meshplan.json   written last, atomically, by rank 0: the saving mesh (names, shape, world,
                      dp degree), the step, dp-independent state, and per-dp-rank state

A folder without ``meshplan.json`` is incomplete (a save that died) and is refused.

What DCP reshards and what it cannot:

- Parameters and optimizer moments are DTensors; DCP stores each global tensor once with
  its shards' offsets and loads any other sharding of the same global tensor bit-exactly.
  meshplan's runtime model keeps ``w_gate`` and ``w_up`` as separate Linear layers, each
  Colwise-sharded, so their global tensors do not depend on tp.
- A *fused* gate/up weight (Megatron ``linear_fc1``) is stored per tp rank as
  [gate_i; up_i]; the global tensor DCP sees at tp 2 is [g0 g1 u0 u1 g2 g3 u2 u3], which is
  not the tp 1 weight [g0 g1 g2 g3 u0 u1 u2 u3] (NVIDIA-NeMo/Megatron-Bridge issue 5637).
  :func:`unfuse_gate_up` and :func:`refuse_gate_up` convert between the two.
- KV heads replicated past ``kv_heads`` (tp > kv_heads) are saved once per real head and
  loaded into every copy (:func:`dcp_view`), so the checkpoint has the real model's KV shape
  at any tp.
- Per-dp-rank state (a data-loader position per dp rank) has no meaning at another dp
  degree: spreading 4 positions over 2 ranks drops or repeats samples. Loading it at another
  dp degree raises :class:`~meshplan.errors.CheckpointError` unless the caller explicitly
  discards it (``discard_dp_state=True``).

Fused gate/up at tp 2 (C13), rank 0 holds [w0 w1 v0 v1], rank 1 [w2 w3 v2 v3]:

>>> r0, r1 = torch.tensor([0, 1, 10, 11]), torch.tensor([2, 3, 12, 13])
>>> torch.cat((r0, r1)).tolist()          # the ranks concatenated: wrong at tp 1
[0, 1, 10, 11, 2, 3, 12, 13]
>>> unfuse_gate_up([r0, r1], tp=2).tolist()
[0, 1, 2, 3, 10, 11, 12, 13]
>>> [t.tolist() for t in refuse_gate_up(unfuse_gate_up([r0, r1], tp=2), tp=4)]
[[0, 10], [1, 11], [2, 12], [3, 13]]
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from meshplan.atomic_write import write_json_atomic
from meshplan.errors import CheckpointError, ConfigError
from meshplan.mesh.resolve import Mesh
from meshplan.runtime.execution.kvsync import dedup_kv_state
from meshplan.spec.mesh_words import mesh_text

META_NAME = "meshplan.json"
DCP_DIR = "dcp"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- fused gate/up


def unfuse_gate_up(shards: Sequence[torch.Tensor], tp: int, dim: int = 0) -> torch.Tensor:
    """The tp-independent fused weight [gate; up] from ``tp`` per-rank shards [gate_i; up_i]
    (each rank's shard is its slice of gate followed by its slice of up along ``dim``).
    Pure tensor ops. Raises ConfigError for a wrong shard count or odd/unequal shards."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or len(shards) != tp:
        raise ConfigError("tp", f"{len(shards)} shards for tp {tp}; pass one fused shard per tp rank")
    sizes = {s.shape[dim] for s in shards}
    if len(sizes) != 1 or next(iter(sizes)) % 2:
        raise ConfigError("shards", f"shard sizes along dim {dim} are {sorted(sizes)}; each must hold "
                                    "equal gate and up halves")
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([g for g, _ in halves] + [u for _, u in halves], dim=dim)


def refuse_gate_up(full: torch.Tensor, tp: int, dim: int = 0) -> list[torch.Tensor]:
    """Per-rank fused shards [gate_i; up_i] for ``tp`` ranks from the tp-independent fused
    weight [gate; up]; the inverse of :func:`unfuse_gate_up`. Raises ConfigError when the
    size along ``dim`` is not divisible by 2 * tp."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or full.shape[dim] % (2 * tp):
        raise ConfigError("tp", f"fused size {full.shape[dim]} along dim {dim} is not divisible by 2 * tp "
                                f"({tp!r}); gate and up must split evenly")
    gate, up = full.chunk(2, dim=dim)
    return [torch.cat((g, u), dim=dim) for g, u in zip(gate.chunk(tp, dim=dim), up.chunk(tp, dim=dim))]


# --------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``meshplan.json`` holds. ``dp``: data-parallel degree (dp_replicate x
    dp_shard); ``dp_state``: name -> one JSON value per dp rank (index = dp rank);
    ``state``: dp-independent JSON values (e.g. consumed samples)."""

    mesh_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    world: int
    dp: int
    step: int
    dp_state: dict[str, list] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def mesh_text(self) -> str:
        """``dp_shard 2 x tp 2``: every saved axis, named as saved (:func:`meshplan.spec.mesh_words.mesh_text`)."""
        return mesh_text(self.mesh_names, self.mesh_shape, keep=tuple(self.mesh_names))

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> "CheckpointMeta":
        """Checked construction from parsed JSON; CheckpointError naming ``where``."""
        keys = {f for f in cls.__dataclass_fields__}
        if not isinstance(doc, dict) or set(doc) - keys or doc.get("version") != FORMAT_VERSION:
            raise CheckpointError(where, f"not a meshplan checkpoint file of version {FORMAT_VERSION}; "
                                         "save it again with meshplan.runtime.execution.checkpoint")
        try:
            meta = cls(**{**doc, "mesh_names": tuple(doc["mesh_names"]), "mesh_shape": tuple(doc["mesh_shape"])})
        except (KeyError, TypeError) as err:
            raise CheckpointError(where, f"missing or bad field ({err}); save it again") from None
        bad = [k for k, v in meta.dp_state.items() if not isinstance(v, list) or len(v) != meta.dp]
        if bad:
            raise CheckpointError(where, f"dp_state {bad[0]!r} must hold one value per dp rank ({meta.dp})")
        return meta


def dp_rank(mesh: Mesh, rank: int) -> int:
    """Index of ``rank`` in its data-parallel group (0 when dp is 1).

    >>> from meshplan.spec.mesh import MeshSpec
    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> m = resolve_mesh(MeshSpec(names=["dp_shard", "tp"], shape=[2, 2]), world=4)
    >>> [dp_rank(m, r) for r in range(4)]
    [0, 0, 1, 1]
    """
    if mesh.dp == 1:
        return 0
    return mesh.group_of(rank, "dp").index(rank)


def check_resume(meta: CheckpointMeta, mesh: Mesh, where: str, discard_dp_state: bool = False) -> None:
    """Raise CheckpointError when ``meta`` holds per-dp-rank state and ``mesh`` has another dp
    degree (C13), unless ``discard_dp_state``. Pure: no process group needed."""
    if not meta.dp_state or meta.dp == mesh.dp or discard_dp_state:
        return
    names = ", ".join(repr(k) for k in sorted(meta.dp_state))
    new = mesh_text(mesh.layout.names, mesh.layout.shape, keep=mesh.layout.names)
    raise CheckpointError(where, f"saved at dp {meta.dp} ({meta.mesh_text}), loading at dp {mesh.dp} ({new}): "
                                 f"{names} holds one value per dp rank ({meta.dp} values) and cannot be resharded "
                                 f"to {mesh.dp} dp ranks without dropping or repeating data; resume at dp "
                                 f"{meta.dp}, or pass discard_dp_state=True to restart the data loaders")


def read_meta(path) -> CheckpointMeta:
    """The ``meshplan.json`` of checkpoint folder ``path``; CheckpointError when absent."""
    p = Path(path) / META_NAME
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(str(p.parent), f"no {META_NAME}: not a meshplan checkpoint, or its save did not "
                                             "finish; use another checkpoint") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(str(p), f"invalid JSON ({err.msg}); the file is damaged") from None
    return CheckpointMeta.from_dict(doc, str(p))


# --------------------------------------------------------------------------- save / load


def _gather_dp_state(mesh: Mesh, local: Mapping[str, Any], where: str) -> dict[str, list]:
    """One value per dp rank from every rank's ``local`` (all_gather_object over the world);
    ranks of one dp rank (its tp/cp/pp peers) must agree."""
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, dict(local))
    names = set(got[0])
    out: dict[str, list] = {k: [None] * mesh.dp for k in sorted(names)}
    for rank, values in enumerate(got):
        if set(values) != names:
            raise CheckpointError(where, f"rank {rank} gives dp_state keys {sorted(values)}, rank 0 {sorted(names)}")
        d = dp_rank(mesh, rank)
        for k, v in values.items():
            if out[k][d] is not None and out[k][d] != v:
                raise CheckpointError(where, f"dp_state {k!r}: ranks of dp rank {d} disagree ({out[k][d]!r} vs "
                                             f"{v!r}); pass the same value on every rank of a dp rank")
            out[k][d] = v
    return out


def save_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, *, step: int,
                    dp_state: Optional[Mapping[str, Any]] = None, state: Optional[Mapping[str, Any]] = None,
                    overwrite: bool = False) -> CheckpointMeta:
    """Save model and optimizer with DCP under ``path/dcp``, then ``path/meshplan.json``.
    Collective: every rank calls it. ``dp_state``: this rank's JSON values whose meaning
    depends on the dp degree (e.g. ``{"loader_position": 4096}``); ``state``: JSON values
    that do not. An existing checkpoint is refused unless ``overwrite`` (its meta file is
    removed first, so a save that dies leaves an incomplete folder, never a stale one)."""
    path, rank = Path(path), dist.get_rank()
    if mesh.world != dist.get_world_size():
        raise ConfigError("mesh", f"mesh world {mesh.world} != process group world {dist.get_world_size()}")
    if (path / META_NAME).exists() and not overwrite:
        raise CheckpointError(str(path), "a checkpoint exists here; choose another folder or pass overwrite=True")
    per_dp = _gather_dp_state(mesh, dp_state or {}, str(path))
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        (path / META_NAME).unlink(missing_ok=True)
    dist.barrier()
    model_sd, optim_sd = dcp_view(model, *get_state_dict(model, optimizer))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / DCP_DIR))
    meta = CheckpointMeta(tuple(mesh.layout.names), tuple(mesh.layout.shape), mesh.world, mesh.dp, int(step),
                          per_dp, dict(state or {}))
    if rank == 0:
        write_json_atomic(path / META_NAME, asdict(meta))
    dist.barrier()
    return meta


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_checkpoint` returns: the saved meta, and this rank's per-dp-rank
    values (``None`` when discarded or when none were saved)."""

    meta: CheckpointMeta
    dp_state: Optional[dict[str, Any]]


def load_checkpoint(path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, *,
                    discard_dp_state: bool = False) -> Loaded:
    """Load ``path`` into ``model`` and ``optimizer`` as sharded on ``mesh`` (any degrees and
    world size). Collective. Checks the meta file first (:func:`check_resume`), so a dp
    mismatch raises CheckpointError on every rank before any tensor moves."""
    path = Path(path)
    meta = read_meta(path)
    check_resume(meta, mesh, str(path), discard_dp_state)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load(dict(zip(("model", "optim"), dcp_view(model, model_sd, optim_sd))), checkpoint_id=str(path / DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    mine = None
    if meta.dp_state and meta.dp == mesh.dp and not discard_dp_state:
        d = dp_rank(mesh, dist.get_rank())
        mine = {k: v[d] for k, v in meta.dp_state.items()}
    return Loaded(meta, mine)


# --------------------------------------------------------------------------- comparison


def dcp_view(model: torch.nn.Module, msd: dict, osd: dict) -> tuple[dict, dict]:
    """The state dicts as DCP saves and loads them, every tensor the model's and the
    optimizer's own (no copy): routed experts as the global tensor of all experts
    (:func:`ep_global`), replicated KV heads once per real head
    (:func:`meshplan.runtime.execution.kvsync.dedup_kv_state`)."""
    return dedup_kv_state(model, *ep_global(model, msd, osd))


def ep_global(model: torch.nn.Module, msd: dict, osd: dict) -> tuple[dict, dict]:
    """The state dicts with every routed expert's DTensor (model weights and optimizer
    states, keys with ``moe.experts.``) as the global tensor of all ``experts`` rows.

    FSDP2 shards a rank's ``E / ep`` local experts over efsdp, so its DTensor describes only
    them: the ranks of different ep groups then hold DTensors of the same key, global shape
    and offsets, and DCP's planner takes them for replicas and writes one (measured by
    ``meshplan validate``: a 4-rank dp_shard 4 x ep 2 run wrote half the experts). Here each
    becomes a DTensor on the (other dims, ep, efsdp) mesh placed ``Shard(0)`` over ep, then
    its own placement over efsdp (``Shard(0)``: rows ``ep_index x E/ep + efsdp_index x
    E/ep/efsdp`` of the ``E``-row tensor; ``Shard(1)`` past efsdp x ep > experts: this ep
    rank's ``E/ep`` rows, its efsdp slice of dim 1). At efsdp 1 FSDP2 leaves the experts out
    (plain tensors, ``ignored_params``): every ep rank then saved the same key at offset 0 and
    DCP kept one rank's experts (``meshplan validate`` at dp_shard 8 x ep 8, world 8: 3.2-6.0 MB
    written per rank against 16.0 MB). Each becomes a DTensor ``Shard(0)`` on the 1-D ep mesh,
    the experts as torchtitan holds them at efsdp 1 (``torchtitan/distributed/expert_parallel.py``
    ``ExpertParallel._partition_fn``: ``distribute_tensor(param, ep_mesh, [Shard(0)])``, FSDP2
    adding efsdp only when it is > 1); 0-dim states (AdamW's ``step``) stay as they are. The
    local tensors are shared (no copy), so a ``dcp.load`` into the
    returned dicts loads the model's and the optimizer's own tensors. Without ep > 1: the
    dicts unchanged."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard

    edm = getattr(model, "expert_mesh", None)
    if edm is None or "ep" not in (edm.mesh_dim_names or ()) or edm["ep"].size() == 1:
        return msd, osd
    names, ep = list(edm.mesh_dim_names), edm["ep"].size()
    meshes: dict = {}

    def convert(v):
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0:  # efsdp 1: ep alone
            shape = torch.Size((v.shape[0] * ep,) + tuple(v.shape[1:]))
            stride = torch.empty(shape, device="meta").stride()
            return DTensor.from_local(v, edm["ep"], [Shard(0)], run_check=False, shape=shape, stride=stride)
        if not isinstance(v, DTensor) or "efsdp" not in (v.device_mesh.mesh_dim_names or ()):
            return v
        key = tuple(v.device_mesh.mesh_dim_names)
        new = [n for n in key if n != "efsdp"] + ["ep", "efsdp"]
        if key not in meshes:  # every rank builds it, in the same key order
            order = [names.index(n) for n in new] + [i for i, n in enumerate(names) if n not in new]
            grid = edm.mesh.permute(order).reshape([edm.mesh.shape[names.index(n)] for n in new])
            meshes[key] = DeviceMesh(edm.device_type, grid, mesh_dim_names=tuple(new))
        pl = [p for n, p in zip(key, v.placements) if n != "efsdp"] + [Shard(0), v.placements[key.index("efsdp")]]
        shape = torch.Size((v.shape[0] * ep,) + tuple(v.shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(v.to_local(), meshes[key], pl, run_check=False, shape=shape, stride=stride)

    msd = {k: convert(v) if "moe.experts." in k else v for k, v in msd.items()}
    state = {k: ({n: convert(t) for n, t in s.items()} if "moe.experts." in str(k) else s)
             for k, s in osd.get("state", {}).items()}
    return msd, {**osd, "state": state}


def measure_dcp(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder, rank: int) -> dict:
    """One DCP save of ``{"model", "optim"}`` (``get_state_dict``) into ``folder`` (shared by
    all ranks, ``FileSystemWriter``), then one load back into the same state: seconds of each
    on this rank (between barriers) and the bytes of the files this rank wrote
    (``__<rank>_*.distcp``: the shards DCP's planner gave it, replicated ones deduplicated)."""
    folder = Path(folder)
    msd, osd = dcp_view(model, *get_state_dict(model, optimizer))
    state = {"model": msd, "optim": osd}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(folder))
    save_s = time.perf_counter() - t0
    dist.barrier()
    written = sum(f.stat().st_size for f in folder.glob(f"__{rank}_*.distcp"))
    t0 = time.perf_counter()
    dcp.load(state, checkpoint_id=str(folder))
    load_s = time.perf_counter() - t0
    dist.barrier()
    return {"rank": rank, "save_s": save_s, "load_s": load_s, "bytes_written": written,
            "files": sorted(f.name for f in folder.glob(f"__{rank}_*.distcp"))}


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    return value


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every model and optimizer tensor as a full (unsharded) CPU tensor, keyed
    ``model.<fqn>`` and ``optim.<fqn>.<state>`` (``exp_avg``, ``exp_avg_sq``, ``step``).
    Collective (``full_tensor`` all-gathers), same order on every rank."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = {f"model.{k}": _full(v) for k, v in model_sd.items()}
    for fqn, st in optim_sd["state"].items():
        out.update({f"optim.{fqn}.{k}": _full(v) for k, v in st.items()})
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def bitwise_differences(want: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """Keys, dtypes, shapes and bytes that differ between two :func:`full_state` results
    (bytes, not values: -0.0 differs from 0.0, equal NaNs agree). Empty when identical."""
    out = [f"{k}: missing after load" for k in want if k not in got]
    out += [f"{k}: not in the saved state" for k in got if k not in want]
    for k in want.keys() & got.keys():
        a, b = want[k], got[k]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                out.append(f"{k}: {a!r} != {b!r}")
        elif a.dtype != b.dtype or a.shape != b.shape:
            out.append(f"{k}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        elif not torch.equal(_bytes(a), _bytes(b)):
            out.append(f"{k}: values differ (max abs {(a.double() - b.double()).abs().max().item():.3g})")
    return sorted(out)
