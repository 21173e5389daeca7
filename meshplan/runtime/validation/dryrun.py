"""One process standing in for one rank of a planned mesh: the collectives that rank would
issue in one training step, recorded without running any real communication.

Flow (the one that works on torch 2.13, see shared/reference/torch-2.13-on-cpu.md):

1. fake process group: ``init_process_group("fake", store=FakeStore(), rank=R, world_size=W)``;
2. DeviceMesh from the meshplan mesh (:func:`~meshplan.runtime.execution.parallelize.init_mesh`);
3. the model under ``torch.device("meta")``, then TP and FSDP2 with no fake mode active
   (``fully_shard`` inside FakeTensorMode fails in ``DeviceMesh._concatenate``);
4. ``model.to_empty(device="cpu")`` inside ``FakeTensorMode(allow_non_fake_inputs=True)``,
   then forward, loss, backward and an optimizer step under
   :class:`~meshplan.runtime.execution.recorder.CollectiveRecorder`.

The process group is destroyed in a ``finally``, so a failed run leaves none behind.
Collectives on the fake group return the right shapes and garbage values.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from meshplan.compute.routing import RoutingOptions
from meshplan.errors import ConfigError
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import padded_vocab
from meshplan.runtime.execution.model import Transformer
from meshplan.runtime.execution.kvsync import kv_replica_sync
from meshplan.runtime.execution.parallelize import check_groups, init_mesh, parallelize
from meshplan.runtime.execution.recorder import Collective, CollectiveRecorder
from meshplan.runtime.execution.trainstep import adamw, set_accumulation
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec


@dataclass(frozen=True)
class DryRun:
    """What one simulated rank did: its collectives in order (phases ``forward``,
    ``backward``, ``step``), the DeviceMesh group differences (empty when all agree) and
    notes on what was built."""

    rank: int
    records: list[Collective]
    group_differences: list[str]
    notes: list[str] = field(default_factory=list)


@contextlib.contextmanager
def fake_process_group(world: int, rank: int = 0):
    """A fake default process group of ``world`` ranks seen from ``rank``; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions keyed by DeviceMesh, and two meshes of equal layout
    compare equal across process groups: a second dry run in the same process would reuse the
    first run's mesh and resolve a destroyed group. Clear the caches between runs."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def dry_run(model_spec: ModelSpec, training: TrainingSpec, mesh: Mesh, rank: int = 0,
            loss_parallel: bool = True, mixed_precision: bool = False, optimizer_step: bool = True,
            vocab: Optional[int] = None, micro_batches: int = 1) -> DryRun:
    """Record the collectives ``rank`` issues in one step (``micro_batches`` micro-batches of
    ``training.micro_batch`` x ``training.seq_len`` tokens, accumulated as
    ``training.grad_accumulation`` says) of ``model_spec`` on ``mesh``.

    ``vocab``: embedding rows; default meshplan's padded vocabulary
    (:func:`meshplan.mesh.tpsplit.padded_vocab`), so parameter bytes match the plan.
    ``mixed_precision``: FSDP2 casts parameters to ``training.compute_dtype`` and reduces in
    ``training.reduce_dtype``; otherwise everything is fp32.
    """
    tp = mesh.degree("tp")
    if not 0 <= rank < mesh.world:
        raise ConfigError("rank", f"rank {rank} is outside 0..{mesh.world - 1}")
    if mesh.sequence_parallel and training.seq_len % tp:
        raise ConfigError("training.seq_len", f"seq_len {training.seq_len} is not divisible by tp {tp} "
                          "(sequence parallelism splits the sequence over tp)")
    if model_spec.is_moe and RoutingOptions.of(training).dropless:
        raise ConfigError("training.moe_dropless", "dropless MoE routing sizes its all-to-alls from exchanged token "
                          "counts, which the dry run's fake process group does not return; set "
                          "training.moe_capacity_factor (e.g. 1.0) for a dry run, or run validate (gloo)")
    v = vocab or padded_vocab(model_spec.vocab, training.vocab_pad_divisor, tp)
    notes = [f"vocab {model_spec.vocab} -> {v} rows"] if v != model_spec.vocab else []
    if training.recompute == "selective":
        notes.append("recompute 'selective' runs as none: no layer is recomputed")
    with fake_process_group(mesh.world, rank):
        dm = init_mesh(mesh, "cpu")
        diffs = check_groups(dm, mesh)
        with torch.device("meta"):
            model = Transformer(model_spec, vocab=v, tp=tp, recompute=training.layer_recomputed)
        if model.kv_heads != model_spec.n_kv_heads:
            notes.append(f"KV heads copied {model_spec.n_kv_heads} -> {model.kv_heads} for tp {tp}")
        parallelize(model, dm, mesh, training, loss_parallel=loss_parallel, mixed_precision=mixed_precision)
        kv_sync = kv_replica_sync([model], model_spec, mesh)
        if hasattr(model, "expert_mesh"):
            from meshplan.runtime.execution.moe_parallel import check_expert_groups

            diffs += check_expert_groups(model.expert_mesh, mesh)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            records = _step(model, training, loss_parallel and tp > 1, optimizer_step, mesh.degree("cp"),
                            micro_batches, kv_sync)
    return DryRun(rank=rank, records=records, group_differences=diffs, notes=notes)


def _step(model, training: TrainingSpec, loss_parallel: bool, optimizer_step: bool, cp: int = 1,
          micro_batches: int = 1, kv_sync=None) -> list[Collective]:
    """Forward, loss (fp32, on vocabulary-sharded logits under loss parallel) and backward of
    each micro-batch (FSDP2's accumulation mode set before each:
    :func:`~meshplan.runtime.execution.trainstep.set_accumulation`), then the AdamW step of
    ``training.optimizer_impl`` (:func:`~meshplan.runtime.execution.trainstep.adamw`), each
    labelled as a phase of the recorder. ``cp``: the rank holds ``seq_len / cp`` tokens of
    each sequence (:mod:`meshplan.runtime.execution.cp`). ``kv_sync``: the replicated KV
    heads' gradient all-reduces (:mod:`meshplan.runtime.execution.kvsync`), in phase
    ``step`` before the optimizer (also without ``optimizer_step``)."""
    b, s = training.micro_batch, training.seq_len // cp
    tokens = torch.zeros(b, s, dtype=torch.long)
    labels = torch.zeros(b, s, dtype=torch.long)
    opt = adamw(model.parameters(), training) if optimizer_step else None
    lp = contextlib.nullcontext
    if loss_parallel:
        from torch.distributed.tensor.parallel import loss_parallel as lp
    with CollectiveRecorder() as rec:
        for mb in range(micro_batches):
            set_accumulation(model, training, mb, micro_batches)
            rec.phase = "forward"
            with lp():
                logits = model(tokens)
                rec.phase = "loss"
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                rec.phase = "backward"
                loss.backward()
        rec.phase = "step"
        if kv_sync is not None:
            kv_sync()
        if opt is not None:
            opt.step()
            opt.zero_grad()
    return rec.records
