"""FSDP units of a pipeline stage and the bytes each gathers, reduces and keeps, on one rank.

FSDP units: every layer, plus the stage's embedding (stage 0) and head (final norm and
output on the last stage, the output counted as in :mod:`meshplan.memory.state`); on a
stage that holds both in one chunk (pp 1) they are one unit, FSDP2's root (``root``;
:mod:`meshplan.memory.unit_events`), except under torchtitan's units
(:attr:`~meshplan.spec.training.TrainingSpec.torchtitan_units`, untied): the embedding and the
head apart, the embedding resharded after forward as the layers are (``embedding_reshards``,
at every pp; tied under pp the first stage's embedding stays gathered, as torchtitan's tied
branch wraps it).
Gathered bytes are the tp-local unsharded elements in the compute dtype (FSDP2
``MixedPrecisionPolicy(param_dtype)``); the reduce-scatter input is in the reduce dtype.
The sharded gradients of :func:`~meshplan.memory.state.state_bytes` are split over the
units in proportion to their elements (exact total).
An MoE layer's unit holds its routed experts: under ep > 1 a second parameter group, all-gathered
apart over efsdp but with the layer, unsharded, prefetched (backward; forward under torchtitan's
explicit prefetch, :func:`explicit_forward_prefetch`) and resharded with it (torchtitan
b5bcd76's per-parameter mesh; the rank timeline's ``efsdp AG``), so the memory holds the next
layer's experts whenever it holds the next layer; under ep 1 one group (:func:`deferred_group`).
"""

from __future__ import annotations

from meshplan.mesh.layers import last_stage
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import experts_apart, local_numel, padded_vocab
from meshplan.spec.model import ModelSpec
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes
from meshplan.memory.pass_sizes import Unit
from meshplan.memory.state import StateBytes


ROOT_NAME = "root (embedding, final norm, output)"


def fsdp_active(training: TrainingSpec, mesh: Mesh) -> dict[str, bool]:
    """Whether each group's parameters are FSDP-sharded (gathered before use)."""
    on = training.sharding in ("zero3", "hsdp")
    return {"dense": on and mesh.degree("fsdp") > 1, "expert": on and mesh.degree("efsdp") > 1}


def deferred_group(training: TrainingSpec, mesh: Mesh) -> bool:
    """Whether an MoE layer's unit gathers its routed experts as a second parameter group (FSDP2
    as torchtitan wraps it, ``TrainingSpec.torchtitan_units``, under ep > 1:
    torchtitan ``apply_fsdp_to_decoder`` at b5bcd76 puts them on the expert mesh, a group of their
    own after the block's dense one, in parameter order; :func:`meshplan.mesh.tpsplit.experts_apart`),
    both FSDP-sharded: its forward copy-out then keeps only the experts' all-gather output, as
    torch 2.13's ``FSDPParamGroup.wait_for_unshard`` keeps the last group's until the next copy-out."""
    active = fsdp_active(training, mesh)
    return training.torchtitan_units and active["dense"] and active["expert"] and experts_apart(mesh)


def explicit_forward_prefetch(training: TrainingSpec, mesh: Mesh) -> bool:
    """torchtitan under ep > 1 prefetches in forward explicitly (``apply_fsdp_to_decoder`` at
    b5bcd76: ``set_modules_to_forward_prefetch([next block])``, the embedding's [block 0], the last
    block's [norm, output]): each unit's all-gather issued at the previous unit's start, as the rank
    timeline issues the next layer's (and its experts') all-gathers. Forward only: full recompute's
    replay prefetches nothing (torchtitan's ``checkpoint_wrapper`` is inside the block's unit,
    ``activation_checkpoint.py`` 152-176, and the block's state is in pre-backward, torch 2.13
    ``_fsdp_state.py`` 295-303), so no backward all-gather is added (tests/test_forward_prefetch_recompute.py)."""
    return training.torchtitan_units and mesh.ep > 1 and any(fsdp_active(training, mesh).values())


def units(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, state: StateBytes, ipg: int = 0) -> dict:
    """:class:`Unit` per unit key of stage ``state.stage`` (see the module docstring). ``ipg``: the
    elements of DeepSpeed ZeRO-3's ipg buffer when the engine copies each gradient into it
    (:func:`meshplan.memory.buffers.ipg_elements`; 0: none): a unit's unsharded gradient
    (``grad_unsharded``, ``early``) then counts only its tensors of more than ``ipg`` elements, which
    stay where autograd wrote them; the others are in the buffer the timeline holds from init."""
    numels = _unit_numels(model, training, mesh, stages, state.stage, ipg)
    active, split = fsdp_active(training, mesh), deferred_group(training, mesh)
    head = {}
    if "embedding" in numels and "head" in numels and len(stages[state.stage]) == 1 \
            and (model.tied_embeddings or not training.torchtitan_units):  # one FSDP2 root (torchtitan: two units)
        emb, head = numels.pop("embedding"), numels.pop("head")
        numels = {"root": {g: emb[g] + head[g] for g in emb}, **numels}
    comp, red = dtype_bytes(training.compute_dtype), dtype_bytes(training.fsdp_reduce_dtype)  # the table's
    shares = {g: _split(state.bytes_of("grads", g), [n[g] for n in numels.values()]) for g in ("dense", "expert")}
    out = {}
    for i, (key, n) in enumerate(numels.items()):
        gathered = sum(n[g] for g in active if active[g])
        name = f"layer {key}" if isinstance(key, int) else ROOT_NAME if key == "root" else key
        early = sum(head[g + "_grad"] for g in active if active[g]) * comp if key == "root" else 0
        held = sum(n[g + "_grad"] for g in active if active[g])  # outside DeepSpeed's ipg buffer
        gbytes = sum(n[g + "_gather"] for g in active if active[g])  # float8 Linear weights: 1 byte each
        out[key] = Unit(name=name, layer=key if isinstance(key, int) else None, gathered=gbytes,
                        grad_unsharded=held * comp, reduce_input=gathered * red,
                        grads=sum(shares[g][i] for g in shares), early=early,
                        deferred=n["expert_gather"] if split and n["expert"] else 0)
    return out


def _split(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, integers summing exactly to it.

    >>> _split(10, [1, 1, 1])
    [3, 3, 4]
    """
    s, out, prev = sum(weights), [], 0
    acc = 0
    for w in weights:
        acc += w
        cur = total * acc // s if s else 0
        out.append(cur - prev)
        prev = cur
    return out


def _numel(tensors, model: ModelSpec, mesh: Mesh, training: TrainingSpec, ipg: int = 0) -> dict[str, int]:
    """Elements per group (dense, expert), under ``{group}_gather`` their bytes in the dtype FSDP2
    all-gathers each weight in (``training.gather_dtype``: float8 Linear weights), under
    ``{group}_grad`` the elements whose unsharded gradient is held outside an ipg buffer of ``ipg``
    elements (all with ``ipg`` 0; else the tensors of more than ``ipg`` elements, :func:`units`)."""
    out = {"dense": 0, "expert": 0, "dense_gather": 0, "expert_gather": 0, "dense_grad": 0, "expert_grad": 0}
    for t in tensors:
        g, n = "expert" if t.expert else "dense", local_numel(t, model, mesh.degree("tp"), mesh.ep, mesh.etp)
        out[g] += n
        out[g + "_gather"] += n * dtype_bytes(training.gather_dtype(t))
        out[g + "_grad"] += n if not ipg or n > ipg else 0
    return out


def _unit_numels(model: ModelSpec, training: TrainingSpec, mesh: Mesh, stages, k: int, ipg: int = 0) -> dict:
    """Elements per unit and group (dense, expert) on one rank of stage ``k`` (:func:`_numel`)."""
    pv = padded_vocab(model.vocab, training.vocab_pad_divisor, mesh.degree("tp"))
    pp = len(stages)
    cache: dict[bool, dict] = {}
    out: dict = {}
    if k == 0:
        out["embedding"] = _numel(model.embedding_tensors(pv), model, mesh, training, ipg)
    for layer in (i for chunk in stages[k] for i in chunk):
        moe = model.is_moe_layer(layer)
        if moe not in cache:
            cache[moe] = _numel(model.layer_tensors(layer), model, mesh, training, ipg)
        out[layer] = cache[moe]
    if k == last_stage(stages):  # the output layer's stage (0 under a V)
        head = [t for t in model.head_tensors(pv) if not t.tied or pp > 1 or t.name.endswith("norm")]
        out["head"] = _numel(head, model, mesh, training, ipg)
    return out
