"""The words of a restart on fewer nodes (:mod:`meshplan.restart`): planned step and
throughput lost, idle GPUs, runner-up, the batch arithmetic, what changes in the pipeline,
and what the checkpoint and the data loader need.

Resharding on load (a mesh of other degrees reads the same checkpoint): DCP
(torch.distributed.checkpoint) saves each tensor's shards with their offsets in the global
tensor and ``load`` has "each rank only read data for their local shards" (pytorch/pytorch
torch/distributed/checkpoint/state_dict_loader.py@f13d1e6, ``load``; the default load planner
maps the saved chunks onto the new ones); Megatron-Core's dist-checkpointing keys every
``ShardedTensor`` by its global shape and offset (NVIDIA/Megatron-LM
megatron/core/dist_checkpointing/mapping.py@00caa53), layers by their global index, so a
load at other tp/pp/dp degrees reads its own layers' pieces. DeepSpeed's ZeRO checkpoint is
not: each data-parallel rank saves its own partition (``zero_pp_rank_{dp_rank}`` files,
deepspeedai/DeepSpeed deepspeed/runtime/engine.py@edaa722, ``_get_zero_ckpt_name``), and a load at
another dp goes through the universal checkpoint: ``deepspeed/checkpoint/ds_to_universal.py
--input_folder --output_folder`` (same commit) merges the partitions (and tp slices) per
parameter, and ``"checkpoint": {"load_universal": true}`` (deepspeed/runtime/constants.py
``LOAD_UNIVERSAL_CHECKPOINT``) loads them at the new degrees (:func:`checkpoint_engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from meshplan.spec.accuracy import REMESH_MARGIN, RESTART_MARGIN
from meshplan.units import counted

if TYPE_CHECKING:
    from meshplan.restart_meshes import Proposal


def result_notes(top: Proposal, ranked: list[Proposal], smaller: list[str], world: int, left: int, mesh,
                 gpus_per_node: int, old_step: Optional[tuple[float, float]], varied: bool = False,
                 old_infeasible: str = "") -> list[str]:
    """Planned step and throughput lost, idle GPUs and one other mesh: the best keeping the global
    batch when the proposal changes it, else the larger mesh changing it, else the runner-up (or
    why none: ``smaller``, the smaller meshes the evaluator refused; ``varied``: pp was varied too).
    ``old_infeasible``: why the plan before the loss does not run (its ``infeasible:`` reason);
    then no throughput is lost against it, and the line says so instead of a percentage."""
    notes = []
    if top.step_s is not None and top.tokens_per_s is not None and top.peak_bytes is not None:
        line = (f"planned step {top.step_s:.2f} s, {top.tokens_per_s:,.0f} tokens/s, memory peak "
                f"{top.peak_bytes / 2 ** 30:.1f} GiB")
        if old_infeasible:
            line += f" (the {world}-GPU plan does not run, {old_infeasible}: no throughput to lose against it)"
        elif old_step:
            lost = 1 - top.tokens_per_s / old_step[1]
            words = f"{lost:.1%} of the throughput lost" if lost >= 0 else f"{-lost:.1%} more throughput"
            line += (f": {words} (the {world}-GPU plan: "
                     f"step {old_step[0]:.2f} s, {old_step[1]:,.0f} tokens/s)")
        notes.append(line)
        if old_step and not old_infeasible and top.tokens_per_s > old_step[1]:
            notes.append(faster_text(top, world, old_step))
    alt = [p for p in ranked if not p.keeps_global_batch and p is not top]
    if left > top.gpus:
        notes.append(idle_text(top.gpus, left, gpus_per_node))
        if top.keeps_global_batch and alt and alt[0].gpus > top.gpus:
            notes.append(contract_cap_text(top))
    others = [p for p in ranked[1:] if p.keeps_global_batch]
    if not top.keeps_global_batch and others:  # one alternative at most: the other contract first
        notes.append(f"alternative keeping the global batch: {others[0].summary()}")
    elif alt and alt[0].gpus > top.gpus:
        notes.append(f"with a different global batch (changes the optimisation): {alt[0].summary()}")
    elif others:
        notes.append(f"runner-up: {others[0].summary()}")
    elif smaller:
        notes.append(f"runner-up: none (the next, {smaller[0]})")
    else:
        what = "mesh" if varied else "data-parallel degree"
        notes.append(f"runner-up: none (no other {what} keeps the global batch"
                     + (f" and ep {mesh.ep} x etp {mesh.etp} valid)" if mesh.ep * mesh.etp > 1 else ")"))
    return notes


def axis_moves(old: dict, new: dict, changed, printed: dict, kept_experts=()) -> str:
    """How the mesh after the loss differs from the configured one, axis by axis, in the
    mesh line's names (``printed``: :func:`meshplan.spec.mesh_words.shown_names`): the axes that
    shrink and grow with their degrees before and after, and the axes of degree > 1 that keep
    theirs. ``old``/``new``: {axis: degree} before and after (an axis missing is degree 1);
    ``changed``: the axes whose degree changed, in the mesh's order; ``kept_experts``: (name,
    degree) of ep and etp > 1 when they are not among the axes (the restart keeps them).

    >>> axis_moves({"dp_shard": 8, "tp": 8}, {"dp_shard": 7, "tp": 8}, ("dp_shard",), {})
    'shrunk: dp_shard 8 -> 7; kept: tp 8'
    >>> axis_moves({"dp_shard": 8, "tp": 8}, {"pp": 7, "dp_shard": 1, "cp": 2, "tp": 4}, ("pp", "dp_shard", "cp", "tp"),
    ...            {"dp_shard": "dp"}, (("ep", 8),))
    'shrunk: dp 8 -> 1, tp 8 -> 4; grown: pp 1 -> 7, cp 1 -> 2; kept: ep 8'
    """
    name = lambda n: printed.get(n, n)
    move = lambda n: f"{name(n)} {old.get(n, 1)} -> {new.get(n, 1)}"
    shrunk = [move(n) for n in changed if new.get(n, 1) < old.get(n, 1)]
    grown = [move(n) for n in changed if new.get(n, 1) > old.get(n, 1)]
    kept = [f"{name(n)} {d}" for n, d in list(new.items()) + list(kept_experts) if d > 1 and n not in changed]
    parts = [("shrunk", shrunk), ("grown", grown), ("kept", kept)]
    return "; ".join(f"{label}: {', '.join(axes)}" for label, axes in parts if axes)


#: What a refusal of the job's kind (:func:`kind_refusal`) starts with: the restart's refused list
#: holds these after the larger meshes refused, and the head line names the first larger one only.
KIND_REFUSED = "the job's kind "


def kind_refusal(p: Proposal, why: str) -> str:
    """A mesh of the job's kind whose plan failed, with the contract it was planned at and why
    (one line of the refused list).

    >>> from types import SimpleNamespace as N
    >>> kind_refusal(N(mesh_text=lambda: "dp_shard 24 x ep 8", gpus=24, contract="global_batch 256 -> 240"),
    ...              "expert_ffn must divide by efsdp 3")
    "the job's kind dp_shard 24 x ep 8 (24 GPUs, global_batch 256 -> 240): expert_ffn must divide by efsdp 3"
    """
    return f"{KIND_REFUSED}{p.mesh_text()} ({p.gpus} GPUs{', ' + p.contract if p.contract else ''}): {why}"


#: How a line names :data:`~meshplan.spec.accuracy.REMESH_MARGIN` and where it comes from.
REMESH_WORDS = f"{REMESH_MARGIN:.1%} remesh margin (the step model's largest mean error when it was set, docs/fidelity.md)"


def kind_words(p: Proposal) -> str:
    """The job's kind in words: its model-parallel degrees (:func:`~meshplan.restart_rank.same_kind`)."""
    tp, cp = p.tp_cp
    kept = [f"pp {p.pp}", f"tp {tp}", f"cp {cp}"] + [f"{a} {d}" for a, d in (("ep", p.ep), ("etp", p.etp)) if d > 1]
    return f"{', '.join(kept[:-1])} and {kept[-1]} kept, only the data axes shrunk"


def kind_passed_text(kind: Proposal, proposal: Proposal) -> str:
    """Why the job's kind is not proposed: what ``kind`` is (its pp, tp and cp kept,
    :func:`~meshplan.restart_rank.same_kind`), its plan, and the proposal, which changes pp, tp or
    cp and plans more than :data:`~meshplan.spec.accuracy.REMESH_MARGIN` more tokens/s
    (:func:`~meshplan.restart_rank.kind_passed`).

    >>> from types import SimpleNamespace as N
    >>> P = lambda text, gpus, tps, contract="": N(mesh_text=lambda: text, gpus=gpus, tokens_per_s=tps, tp_cp=(2, 1), ep=1,
    ...                                          contract=contract, keeps_global_batch=not contract, pp=int(text[3]), etp=1)
    >>> kind_passed_text(P("pp 2 x dp 2 x tp 2", 8, 77847.7), P("pp 1 x dp 4 x tp 2", 8, 104260.3))
    ... # doctest: +NORMALIZE_WHITESPACE
    "the job's kind (pp 2, tp 2 and cp 1 kept, only the data axes shrunk; tried first): pp 2 x dp 2 x tp 2 on 8 GPUs
    plans 77,848 tokens/s; passed over: pp 1 x dp 4 x tp 2 on 8 GPUs plans 104,260 tokens/s, 33.9% more, over the
    29.4% remesh margin (the step model's largest mean error when it was set, docs/fidelity.md); it is the proposal"
    """
    k, f = kind.tokens_per_s or 0.0, proposal.tokens_per_s or 0.0
    at = lambda p: f"{p.mesh_text()} on {p.gpus} GPUs" + (f", {p.contract}," if p.contract else "")
    return (f"{KIND_REFUSED}({kind_words(kind)}; tried first): {at(kind)} plans {k:,.0f} tokens/s; passed over: "
            f"{at(proposal)} plans {f:,.0f} tokens/s, {f / k - 1:.1%} more, over the {REMESH_WORDS}; it is the proposal")


def kind_kept_text(top: Proposal, faster: Optional[Proposal]) -> str:
    """Why the proposal, of the job's kind (:func:`~meshplan.restart_rank.kind_kept`), comes
    first: the least-disruptive mesh, and the fastest mesh changing pp, tp or cp (``faster``, None
    when none plans more tokens/s) within :data:`~meshplan.spec.accuracy.REMESH_MARGIN` (or beyond
    it, changing the global batch the kind keeps: :func:`~meshplan.restart_rank.remeshes`).

    >>> from types import SimpleNamespace as N
    >>> top = N(pp=16, tp_cp=(8, 1), ep=1, etp=1, tokens_per_s=1230460.0)
    >>> kind_kept_text(top, N(mesh_text=lambda: "pp 1 x dp_shard 2048 x tp 4", gpus=8192, tokens_per_s=1371080.0,
    ...                       contract="")) # doctest: +NORMALIZE_WHITESPACE
    "why: the job's kind, the least-disruptive mesh (pp 16, tp 8 and cp 1 kept, only the data axes shrunk); the
    fastest mesh changing pp, tp or cp, pp 1 x dp_shard 2048 x tp 4 on 8192 GPUs, plans 1,371,080 tokens/s, 11.4%
    more, within the 29.4% remesh margin (the step model's largest mean error when it was set, docs/fidelity.md)"
    """
    head = f"why: the job's kind, the least-disruptive mesh ({kind_words(top)})"
    if faster is None:
        return head + "; no mesh changing pp, tp or cp plans more tokens/s"
    f = faster.tokens_per_s or 0.0
    gain = f / (top.tokens_per_s or 1.0) - 1  # over the margin only where it changes a global batch the kind keeps
    return (f"{head}; the fastest mesh changing pp, tp or cp, {faster.mesh_text()} on {faster.gpus} GPUs"
            + (f" ({faster.contract})" if faster.contract else "") + f", plans {f:,.0f} tokens/s, {gain:.1%} more, "
            + (f"within the {REMESH_WORDS}" if gain <= REMESH_MARGIN else f"over the {REMESH_WORDS}, but it changes "
               "the global batch, which the kind keeps"))


def changer_refusal(changer: Proposal, as_configured: str, ranked: list[Proposal], unplanned: list) -> tuple[str, int]:
    """Why the largest mesh does not keep the contract (``as_configured``), and whether it runs
    with the changed one (the alternative) or not (its refusal, taken from ``unplanned``: the
    changer is evaluated last)."""
    why = f"{changer.mesh_text()} ({changer.gpus} GPUs): {as_configured}"
    ran = [p for p in ranked if (p.names, p.shape, p.contract) == (changer.names, changer.shape, changer.contract)]
    if ran and ranked[0] is not ran[0] and not ranked[0].keeps_global_batch:  # kind_first chose another changer
        return why + (f"; with {changer.contract}: {ran[0].tokens_per_s or 0.0:,.0f} tokens/s, not over "
                      f"{REMESH_MARGIN:.1%} more than the job's kind"), changer.gpus
    if any(not p.keeps_global_batch for p in ranked):
        return why + " (the alternative below changes the global batch)", changer.gpus
    return why + f"; with {changer.contract}: {unplanned.pop()[0].split(': ', 1)[1]}", changer.gpus


def kind_notes(passed: Optional[tuple[Proposal, Proposal]], kept: Optional[tuple[Proposal, Optional[Proposal]]],
               refused: list[tuple[str, int]]) -> list[str]:
    """Why the proposal comes first: a line where the job's kind was passed over (``passed``: its plan
    and the proposal, :func:`kind_passed_text`) or kept first (``kept``: :func:`kind_kept_text`); then one
    line per plan of the kind that failed (``refused``, from :func:`kind_refusal`)."""
    why = [kind_passed_text(*passed)] if passed else [kind_kept_text(*kept)] if kept else []
    return why + [f"refused: {r}" for r, _ in refused]


def faster_text(top: Proposal, world: int, old_step: tuple[float, float]) -> str:
    """Why a restart on fewer GPUs plans more tokens/s than the full-size plan: the original mesh
    plans slowly (its step against the restart mesh's), not that losing a node helps; said only
    when the gain exceeds :data:`~meshplan.spec.accuracy.RESTART_MARGIN`, else that the two are within
    that margin (12,657 -> 12,900 tokens/s: 1.9%).

    >>> from types import SimpleNamespace as N
    >>> faster_text(N(step_s=73.12, gpus=56, mesh_text=lambda: "pp 7 x tp 8", tokens_per_s=57000.0), 64,
    ...             (331.38, 12657.0))  # doctest: +NORMALIZE_WHITESPACE
    'the original mesh is the problem, not the lost node: the 64-GPU plan takes 331.38 s a step, pp 7 x tp 8
    takes 73.12 s on 56 GPUs; run `meshplan search` on the original cluster for a faster full-size mesh'
    >>> faster_text(N(step_s=73.12, gpus=56, mesh_text=lambda: "pp 7 x tp 8", tokens_per_s=12900.0), 64,
    ...             (331.38, 12657.0))  # doctest: +NORMALIZE_WHITESPACE
    "pp 7 x tp 8 on 56 GPUs plans 1.9% more tokens/s than the 64-GPU plan, within the 5% restart margin (a
    judgement, not the model's measured error): the original mesh is not shown to be the problem"
    """
    gain = (top.tokens_per_s or 0.0) / old_step[1] - 1  # planned (result_notes calls it with a number)
    if gain <= RESTART_MARGIN:
        return (f"{top.mesh_text()} on {top.gpus} GPUs plans {gain:.1%} more tokens/s than the {world}-GPU plan, "
                f"within the {RESTART_MARGIN:.0%} restart margin (a judgement, not the model's measured error): the "
                "original mesh is not shown to be the problem")
    return (f"the original mesh is the problem, not the lost node: the {world}-GPU plan takes {old_step[0]:.2f} s a "
            f"step, {top.mesh_text()} takes {top.step_s:.2f} s on {top.gpus} GPUs; run `meshplan search` on the "
            "original cluster for a faster full-size mesh")


def contract_cap_text(top: Proposal) -> str:
    """Why a mesh keeping the global batch uses fewer GPUs than are left: ``global_batch =
    micro_batch x dp x micro-batches`` lets dp divide ``global_batch / micro_batch`` only (a
    larger mesh changes the global batch).

    >>> from types import SimpleNamespace as N
    >>> p = N(global_batch=2048, micro_batch=1, dp=2048, gpus=8192, micro_batches=1)
    >>> contract_cap_text(p)  # doctest: +NORMALIZE_WHITESPACE
    'fewer GPUs by the batch contract: global batch 2048 / micro_batch 1 = 2048 micro-batches a step, so dp
    divides 2048 (at most 2048, 1 micro-batch each); dp 2048 takes 8192 GPUs, a larger dp changes the global batch'
    """
    total = top.global_batch // top.micro_batch
    return (f"fewer GPUs by the batch contract: global batch {top.global_batch} / micro_batch {top.micro_batch} = "
            f"{total} micro-batches a step, so dp divides {total} (at most {total}, 1 micro-batch each); dp {top.dp} "
            f"takes {top.gpus} GPUs, a larger dp changes the global batch")


def idle_text(used: int, left: int, gpus_per_node: int) -> str:
    """Which GPUs a mesh of ``used`` ranks leaves idle on ``left`` GPUs (node-major ranks:
    rank r on node r // gpus_per_node of the nodes left).

    >>> idle_text(1024, 2040, 8)  # doctest: +NORMALIZE_WHITESPACE
    '1016 of the 2040 GPUs left sit idle (spares for the next failure): the mesh takes nodes 0-127
    of the 255 nodes left (node-major); idle: nodes 128-254'
    >>> idle_text(12, 24, 8)  # doctest: +NORMALIZE_WHITESPACE
    '12 of the 24 GPUs left sit idle (spares for the next failure): the mesh takes node 0 and GPUs
    0-3 of node 1 of the 3 nodes left (node-major); idle: GPUs 4-7 of node 1 and node 2'
    """
    nodes, full, part = -(-left // gpus_per_node), used // gpus_per_node, used % gpus_per_node
    span = lambda a, b: f"node {a}" if a == b else f"nodes {a}-{b}"
    took = ([span(0, full - 1)] if full else []) + ([f"GPUs 0-{part - 1} of node {full}"] if part else [])
    first_idle = full + (1 if part else 0)
    idle = ([f"GPUs {part}-{gpus_per_node - 1} of node {full}"] if part else []) + (
        [span(first_idle, nodes - 1)] if first_idle < nodes else [])
    return (f"{left - used} of the {left} GPUs left sit idle (spares for the next failure): the mesh takes "
            f"{' and '.join(took)} of the {nodes} nodes left (node-major); idle: {' and '.join(idle)}")


def batch_notes(top: Proposal, as_configured: str, others_keep: bool = False) -> list[str]:
    """The proposal's batch arithmetic and what its contract change means (``as_configured``:
    why its data-parallel degree breaks the contract as configured; ``others_keep``: a mesh of
    another kind or fewer GPUs keeps the global batch, :func:`~meshplan.restart_rank.kind_first`)."""
    line = (f"global batch {top.global_batch} = micro_batch {top.micro_batch} x dp {top.dp} x "
            f"{counted(top.micro_batches, 'micro-batch')}")
    if top.contract.startswith("global_batch"):
        which = ((f"the meshes that keep it change the job's kind or plan over {RESTART_MARGIN:.0%} fewer tokens/s "
                  "(the alternative)")
                 if others_keep else "no mesh of these GPUs keeps the global batch")
        line += f" ({top.contract}: as configured, {as_configured}; {which}, a different one changes the optimisation)"
    elif top.contract:
        line += f" ({top.contract}: the global batch is kept)"
    return [line]


def checkpoint_engine(training) -> str:
    """Which runtime saves and loads the checkpoint: "deepspeed" (``sharding`` zero3 under
    ``zero3_engine`` deepspeed or deepspeed-2021, or zero1/zero2/none under ``zero12_engine``
    deepspeed, as an imported DeepSpeed JSON sets), "megatron" (``framework`` megatron), else
    "dcp" (torch.distributed.checkpoint).

    >>> from types import SimpleNamespace as N
    >>> [checkpoint_engine(N(sharding=s, zero3_engine=z3, zero12_engine=z12, framework=f)) for s, z3, z12, f in [
    ...     ("zero3", "deepspeed", "torch", "torch"), ("zero2", "fsdp2", "deepspeed", "torch"),
    ...     ("zero3", "fsdp2", "deepspeed", "torch"), ("zero1", "fsdp2", "megatron", "megatron")]]
    ['deepspeed', 'deepspeed', 'dcp', 'megatron']
    """
    if training.sharding == "zero3":
        deepspeed = training.zero3_engine in ("deepspeed", "deepspeed-2021")
    else:
        deepspeed = training.zero12_engine == "deepspeed"
    return "deepspeed" if deepspeed else "megatron" if training.framework == "megatron" else "dcp"


#: How each checkpoint engine (:func:`checkpoint_engine`) loads a checkpoint saved at other degrees (module docstring).
RESHARD = {
    "dcp": "resharded on load ({}): DCP (torch.distributed.checkpoint) saves each shard at its offset in the global "
           "tensor and each rank reads its new shards",
    "megatron": "resharded on load ({}): Megatron-Core dist-checkpointing keys each shard by its global offset and "
                "each rank reads its new shards",
    "deepspeed": "not loadable as saved ({}): DeepSpeed saves the ZeRO state per data-parallel rank (zero_pp_rank_* "
                 "files); convert it with DeepSpeed's deepspeed/checkpoint/ds_to_universal.py --input_folder "
                 "--output_folder and load the universal checkpoint (\"checkpoint\": {{\"load_universal\": true}})",
}


def state_notes(changed, old_dp: int, new_dp: int, dataloader_state: str, words: str = "", engine: str = "dcp"):
    """(checkpoint reshards, data-loader state loads, notes): any changed axis but
    dp_replicate changes the shards (under DeepSpeed any changed axis: its ZeRO partitions span
    every data-parallel rank), loaded by ``engine``'s path (:data:`RESHARD`); ``words``: the
    changed axes as the mesh text names them (default: their names)."""
    reshard = any(n != "dp_replicate" or engine == "deepspeed" for n in changed)
    moved = RESHARD[engine].format(f"{words or ', '.join(changed)} changed")
    notes = ["checkpoint: " + (moved if reshard else "replicas hold identical shards: load without resharding")]
    ok = dataloader_state == "global" or new_dp == old_dp
    if dataloader_state == "global":
        notes.append("data loader: a global consumed-samples counter rebuilds each rank's position")
    elif ok:
        notes.append("data loader: per-rank state loads unchanged (same dp)")
    else:
        notes.append(f"data loader: per-rank state saved at dp {old_dp} cannot be resharded to dp {new_dp}: loading "
                     f"it must raise, never drop or repeat samples; restart from a global sample index")
    return reshard, ok, notes


def pipeline_note(rule, top: Proposal, splits=()) -> list[str]:
    """What a restart at another pp runs: the layers per stage before and after (``rule``: the
    :class:`~meshplan.restart_degrees.PipelineRule`, its configured pp and split, None: even),
    the schedule and vpp kept (from pp 1, which ran no schedule, no schedule named); at pp 1, no
    pipeline. ``splits``: the mesh's planned splits,
    fastest first (:func:`~meshplan.restart_rank.rank`), each named with its tokens/s where
    more than one was planned.

    >>> from types import SimpleNamespace as N
    >>> rule = N(layers=61, pp=16, split=(3,) + (4,) * 14 + (2,), vpp=1)
    >>> pipeline_note(rule, N(pp=8, pp_layer_split=(7, 8, 8, 8, 8, 8, 8, 6)))
    ['pipeline: pp 16 -> 8, layers per stage 3, 4 x 14, 2 -> 7, 8 x 6, 6 (the schedule kept)']
    >>> pipeline_note(N(layers=32, pp=1, split=None, vpp=1), N(pp=4, pp_layer_split=None))
    ['pipeline: pp 1 -> 4, layers per stage 8 x 4']
    >>> pipeline_note(N(layers=32, pp=2, split=None, vpp=1), N(pp=1, pp_layer_split=None))
    ['pipeline: pp 2 -> 1: no pipeline']
    >>> two = [N(pp_layer_split=(7, 9, 9, 7), tokens_per_s=2e5), N(pp_layer_split=None, tokens_per_s=1.9e5)]
    >>> pipeline_note(N(layers=32, pp=2, split=None, vpp=1), N(pp=4, pp_layer_split=(7, 9, 9, 7)), two)
    ... # doctest: +NORMALIZE_WHITESPACE
    ['pipeline: pp 2 -> 4, layers per stage 16 x 2 -> 7, 9 x 2, 7 (the schedule kept); the fastest of 2 splits
    planned: 7, 9 x 2, 7 at 200,000 tokens/s, 8 x 4 at 190,000']
    """
    if top.pp == rule.pp:
        return []
    if top.pp == 1:
        return [f"pipeline: pp {rule.pp} -> 1: no pipeline"]
    words = lambda s, pp: run_text(s or [rule.layers // pp] * pp)
    new = words(top.pp_layer_split, top.pp)
    kept = "the schedule" + (f" and vpp {rule.vpp}" if rule.vpp > 1 else "")
    line = (f"pipeline: pp 1 -> {top.pp}, layers per stage {new}" if rule.pp == 1 else  # pp 1 ran no schedule
            f"pipeline: pp {rule.pp} -> {top.pp}, layers per stage {words(rule.split, rule.pp)} -> {new} ({kept} kept)")
    if len(splits) > 1:
        each = [f"{words(g.pp_layer_split, top.pp)} at {g.tokens_per_s:,.0f}" for g in splits]
        line += f"; the fastest of {len(splits)} splits planned: {each[0]} tokens/s, {', '.join(each[1:])}"
    return [line]


def split_words(split, layers: int, pp: int) -> str:
    """Layers per stage ``split`` (None: even over ``layers``) in the few words a mesh line
    carries after its pp (:meth:`~meshplan.restart_meshes.Proposal.mesh_text`): the middle
    stages' layers and an end stage that differs, the only uneven form Megatron-LM's flags set,
    else each run (:func:`run_text`).

    >>> split_words(None, 80, 16), split_words([3] * 26 + [2], 80, 27), split_words([1] + [2] * 39 + [1], 80, 41)
    ('5 layers per stage', '3 layers per stage, 2 on the last', '2 layers per stage, 1 on the first and the last')
    >>> split_words([3] + [4] * 14 + [2], 61, 16), split_words([31, 30], 61, 2)
    ('4 layers per stage, 3 on the first, 2 on the last', '31 layers per stage, 30 on the last')
    >>> split_words([11, 12, 12, 12, 11, 11, 11], 80, 7)
    'layers per stage 11, 12 x 3, 11 x 3'
    """
    s = list(split) if split is not None else [layers // pp] * pp
    middle = s[1:-1] or [max(s)]
    if len(set(middle)) > 1:
        return f"layers per stage {run_text(s)}"
    ends = [f"{n} on the {end}" for n, end in ((s[0], "first"), (s[-1], "last")) if n != middle[0]]
    if len(ends) == 2 and s[0] == s[-1]:
        ends = [f"{s[0]} on the first and the last"]
    return ", ".join([f"{counted(middle[0], 'layer')} per stage"] + ends)


def run_text(split) -> str:
    """``11, 12 x 3, 11 x 3``: each run of equal layers per stage with its length."""
    return ", ".join(f"{n} x {c}" if c > 1 else str(n) for n, c in _runs(split))


def _runs(split) -> list[tuple[int, int]]:
    """(value, count) of each run of equal entries: [3, 4, 4, 2] -> [(3, 1), (4, 2), (2, 1)]."""
    out: list[tuple[int, int]] = []
    for n in split:
        if out and out[-1][0] == n:
            out[-1] = (n, out[-1][1] + 1)
        else:
            out.append((n, 1))
    return out
