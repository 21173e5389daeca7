"""The pp rows of the collective table (:func:`meshplan.comm.collectives.collective_table`):
the pipeline's sends and receives, Megatron-LM's scatter/gather of them over tp, and the tied
embedding's gradient all-reduce between the first and last stage.

- PP: per micro-batch, one send of the activation for every chunk that is not the model's
  last and one receive for every chunk that is not its first (``2 vpp - first - last``), in
  forward, and the same for gradients in backward. The tensor sent is the residual stream as
  the TP plan leaves it between layers: a plain tensor (row-parallel outputs are local), so
  with SP each tp rank sends its own sequence shard (b * s/tp * h) to its peer of the next
  stage, and without SP every tp rank sends the whole (b, s, h) activation (no Megatron
  scatter/gather across tp): measured with ``torch.distributed.pipelining`` 2.13.
  With cp the activation is this rank's b * s/cp * h (its two chunks; /tp under SP).
  Each transfer moves between one pair, the stage's rank and its peer stage's at the same position
  on the other axes: the stage's rows are timed on the pairs of its first boundary that crosses
  nodes, else of its first (NVLink where both stages share a node, the sender's NIC where not;
  :func:`stage_pairs`; their cadence names it and the NVLink boundaries' time where the stage has
  both, :func:`timed_boundary`), the pipeline simulator
  times every boundary on its own (:func:`boundary_seconds`).
- Tied embeddings with pp > 1 (embedding on the first stage, its copy as the output layer on
  the last): once per step, after the schedule, the two copies' gradients are all-reduced
  (sum) over the embedding group, the first and last rank of a pp group (Megatron-LM
  ``finalize_model_grads._allreduce_word_embedding_grads``); the buffer is the rank's local
  gradient (:func:`_tied_grad_bytes`), since FSDP2 has already reduced it over the data axes
  (``meshplan.runtime.execution.pipelined_stage``, measured with torch 2.13 on gloo).
"""

from __future__ import annotations

import numpy as np

from meshplan.comm.row import groups_path, path_time
from meshplan.comm.stage_context import StageContext
from meshplan.mesh.resolve import Mesh
from meshplan.mesh.tpsplit import fsdp_padded_numel, padded_vocab
from meshplan.pipeline.registry import get as get_schedule
from meshplan.pipeline.sim_types import boundary_of
from meshplan.spec.training import TrainingSpec
from meshplan.units import dtype_bytes


def pp_rows(add, c: StageContext) -> None:
    """The stage's pp rows (the table's builder for pp; none with pp 1): the sends and receives
    of each micro-batch (:meth:`~meshplan.pipeline.base.PipelineSchedule.p2p_per_microbatch`),
    under Megatron-LM's scatter/gather (:func:`scatter_gather`) 1/tp of the activation each
    and a tp all-gather per receive, and the tied embedding's gradient all-reduce."""
    t, mesh, m = c.training, c.mesh, c.model
    dt = t.compute_dtype
    pp = mesh.degree("pp")
    if pp <= 1:
        return
    tp = mesh.degree("tp")
    sg = scatter_gather(t, mesh, c.act_bytes)
    sent = c.act_bytes / (tp if mesh.sequence_parallel or sg else 1)
    # one send per chunk whose next virtual stage is on another rank, one receive per chunk whose
    # previous one is (the schedule's chunk map: looped 2 vpp - first - last; a V turns locally on pp - 1)
    n = get_schedule(c.schedule).p2p_per_microbatch(pp, c.vpp, c.stage)
    pairs, which = stage_pairs(c), timed_boundary(c, sent)  # its first boundary across nodes' pairs (None: the axis's)
    on = {} if pairs is None else {"ranks": tuple(mesh.group_of(0, "pp")), "groups": pairs}
    cadence = "every micro-batch per chunk boundary" + which
    add("pp", "forward", "send/recv", sent, dt, n, cadence, "next stage's forward", **on)
    add("pp", "backward", "send/recv", sent, dt, n, cadence, "previous stage's backward", **on)
    if sg:  # each receive is the 1/tp slice a tp peer also received: all-gathered over tp
        add("tp", "forward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
            "the received chunk's forward")
        add("tp", "backward", "all-gather", c.act_bytes, dt, n, f"every {SCATTER_GATHER_CADENCE}",
            "the received chunk's backward")
    if m.tied_embeddings and (c.first or c.last) and not (c.first and c.last):  # first and last pp rank
        pp0 = mesh.group_of(0, "pp")
        add("pp", "step", "all-reduce", _tied_grad_bytes(c), t.grad_dtype, 0,
            "once per step (tied embedding gradients, first and last stage)", "optimizer step", depth=0,
            per_step=1, ranks=(pp0[0], pp0[-1]))


def peers(schedule, pp: int, vpp: int, stage: int) -> dict[int, int]:
    """{peer stage: chunk boundaries per micro-batch} of ``stage`` in one direction: for each local
    chunk, its previous virtual stage's rank (a forward receive, a backward send) and its next one's
    (a forward send, a backward receive) when that is another rank; the counts add up to
    :meth:`~meshplan.pipeline.base.PipelineSchedule.p2p_per_microbatch`. Looped (interleaved),
    stage 0's chunk k > 0 receives from stage pp - 1's chunk k - 1 (the wrap); a V turns on pp - 1.

    >>> [peers(get_schedule("1f1b"), 4, 1, s) for s in range(4)]
    [{1: 1}, {0: 1, 2: 1}, {1: 1, 3: 1}, {2: 1}]
    >>> [peers(get_schedule("interleaved_1f1b"), p, 2, s) for p, s in ((4, 0), (4, 3), (2, 0))]
    [{1: 2, 3: 1}, {2: 2, 0: 1}, {1: 3}]
    >>> peers(get_schedule("zbv"), 4, 2, 3)
    {2: 2}
    """
    out: dict[int, int] = {}
    for k in range(vpp):
        j = schedule.virtual_stage(k, stage, pp, vpp)
        for nb in (j - 1, j + 1):
            if 0 <= nb < pp * vpp and (t := schedule.stage_of(nb, pp, vpp)) != stage:
                out[t] = out.get(t, 0) + 1
    return out


def _crossed(c: StageContext) -> list[int]:
    """The boundaries the stage's transfers cross (:func:`peers`), sorted; a middle stage's (the middle
    table, shared by stages 1 .. pp - 2): 0 .. pp - 2, its chunks handing on to its neighbours only."""
    pp = c.mesh.degree("pp")
    if 0 < c.stage < pp - 1:
        return list(range(pp - 1))
    return sorted({int(boundary_of(c.stage, t, pp)) for t in peers(get_schedule(c.schedule), pp, c.vpp, c.stage)})


def timed_boundary(c: StageContext, size_bytes: float) -> str:
    """Words after the pp rows' cadence where the stage's boundaries take different links: which
    boundary times the rows (:func:`stage_pairs`: the first across nodes) and what those on NVLink
    take for a ``size_bytes`` send (:func:`boundary_seconds`, as the simulated step times them;
    below about 617 KiB on dgx-h100 an NVLink pair is the slower: a NIC pair's 9.3 us + S at 47.10
    GB/s under the NVLink pair's flat 22.72 us), where ``c`` has the placement;
    "" where they all take one link. Stage 0 of pp 4, two stages a node, interleaved (boundary 0
    inside, the wrap 3 across), 32 MiB: ``; timed on boundary 3 (stage 3 -> 0, across nodes);
    its boundary 0 on NVLink takes 111.0 us``."""
    pp = c.mesh.degree("pp")
    if c.domain is None or pp <= 1:
        return ""
    crossed = _crossed(c)
    pairs = boundary_pairs(c.mesh)
    apart = [b for b in crossed if (c.domain[pairs[b][:, 0]] != c.domain[pairs[b][:, 1]]).any()]
    inside = [b for b in crossed if b not in apart]
    if not apart or not inside:
        return ""
    b, whose = apart[0], "their" if 0 < c.stage < pp - 1 else "its"
    head = f"; timed on boundary {b} (stage {b} -> {(b + 1) % pp}, across nodes); {whose} "
    if c.placement is None or c.cluster is None:
        return head + f"{_listed(inside, len(crossed))} on NVLink"
    secs = boundary_seconds(c.mesh, c.placement, c.cluster, size_bytes)
    by: dict = {}
    for x in inside:
        by.setdefault(round(float(secs[x]) * 1e6, 1), []).append(x)
    return head + ", ".join(f"{_listed(xs, len(crossed))} on NVLink {'take' if len(xs) > 1 else 'takes'} {t:.1f} us"
                            for t, xs in by.items())


def _listed(bs: list[int], of: int) -> str:
    """``boundary 0``, ``boundaries 0, 2``, ``boundaries 0, 2, 4, 6 .. (32 of 127)``."""
    shown = ", ".join(map(str, bs[:4])) + (f" .. ({len(bs)} of {of})" if len(bs) > 4 else "")
    return f"boundar{'y' if len(bs) == 1 else 'ies'} {shown}"


def stage_pairs(c: StageContext):
    """The pairs (n_groups, 2) whose path times the stage's pp send/recv rows: of the boundaries its
    transfers cross (:func:`peers`; the middle table, shared by stages 1 .. pp - 2
    (:func:`meshplan.plan.table_stage`), every middle stage's), the first whose pairs do not all
    share an NVLink domain (``c.domain``), else the first: the network where any transfer crosses
    nodes (the slower link from about 617 KiB a send on dgx-h100; :func:`timed_boundary` gives the
    NVLink ones' time), NVLink only where every transfer stays on it, so the table's link loads (the network rows,
    :mod:`meshplan.schedule.netload`) count what they did on the pp axis. The pipeline simulator
    times each boundary on its own pairs (:func:`boundary_seconds`). None without ``c.domain``
    (the pp axis's path) or a peer. pp 4 with 2 stages a node (0-1 and 2-3 on NVLink): stage 0 its
    NVLink pair, the middle table (stage 1's across to 2, stage 2's) and stage 3 theirs."""
    if c.domain is None:
        return None
    crossed = _crossed(c)
    if not crossed:
        return None
    pairs = boundary_pairs(c.mesh)
    apart = [b for b in crossed if (c.domain[pairs[b][:, 0]] != c.domain[pairs[b][:, 1]]).any()]
    return pairs[(apart or crossed)[0]]


def boundary_pairs(mesh: Mesh) -> np.ndarray:
    """Each stage boundary's pairs of ranks, shape (pp, n_groups, 2): boundary b the rank of stage b
    and the rank of stage b + 1 of every pp group (the same position on the other axes), boundary
    pp - 1 the looped schedules' wrap from the last stage to stage 0 (the boundaries of
    :func:`meshplan.pipeline.sim_types.boundary_of`).

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> boundary_pairs(resolve_mesh(MeshSpec(names=["pp", "tp"], shape=[3, 2]), 6)).tolist()
    [[[0, 2], [1, 3]], [[2, 4], [3, 5]], [[4, 0], [5, 1]]]
    """
    groups = mesh.groups("pp")
    return np.stack([groups, np.roll(groups, -1, axis=1)], axis=-1).transpose(1, 0, 2)


def boundary_links(mesh: Mesh, placement) -> np.ndarray:
    """Each stage boundary's link on its ranks, shape (pp,) (:func:`boundary_pairs`' order, the wrap
    last): 0, NVLink, where every pair shares an NVLink domain; 1, the network, else: the rank's own
    NIC whichever boundary it crosses (the sender's NIC, as :func:`boundary_seconds` times a pair
    across nodes); :attr:`~meshplan.pipeline.sim_types.PipelineSpec.p2p_link`.

    >>> from meshplan.mesh.resolve import resolve_mesh
    >>> from meshplan.spec.mesh import MeshSpec
    >>> from types import SimpleNamespace
    >>> mesh = resolve_mesh(MeshSpec(names=["pp", "tp"], shape=[4, 2]), 8)  # stages 0-1 on node 0, 2-3 on node 1
    >>> boundary_links(mesh, SimpleNamespace(domain=np.arange(8) // 4)).tolist()
    [0, 1, 0, 1]
    """
    dom = placement.domain[boundary_pairs(mesh)]
    return np.where((dom[..., 0] == dom[..., 1]).all(axis=1), 0, 1)


def boundary_seconds(mesh: Mesh, placement, cluster, size_bytes: float) -> np.ndarray:
    """Seconds of one pp send/recv of ``size_bytes`` across each stage boundary, shape (pp,)
    (:func:`boundary_pairs`' order, the wrap last): each boundary on its own pairs' path
    (:func:`~meshplan.comm.row.groups_path` of its pairs, all running at once: NVLink where every
    pair shares an NVLink domain, else the network, the sender's NIC), timed as a table row is
    (:func:`~meshplan.comm.row.path_time`, a pair: n 2). pp 28 x cp 2 x tp 2 on dgx-h100: stages
    2k and 2k + 1 share a node (NVLink pair), 2k + 1 -> 2k + 2 cross (a NIC pair). Each distinct
    path is found and timed once."""
    pairs = boundary_pairs(mesh)
    inside = boundary_links(mesh, placement) == 0
    times: dict = {}
    out = np.empty(len(pairs))
    # a path is a function of its pairs' nodes (relative to the first), NICs and rails: boundaries
    # alike in those share it (pp 128 across 16-GPU strides: one path, not 128); the NVLink ones the fabric's
    node = placement.node[pairs]
    alike = np.concatenate([(node - node[:, :1, :1]).reshape(len(pairs), -1), placement.nic[pairs].reshape(len(pairs), -1),
                            placement.rail[pairs].reshape(len(pairs), -1)], axis=1)
    paths: dict = {}
    for b in range(len(pairs)):
        key = b"" if inside[b] else alike[b].tobytes()
        if key not in paths:
            paths[key] = groups_path(pairs[b], placement, cluster)
        path = paths[key]
        if path not in times:
            times[path] = path_time("send/recv", 2, size_bytes, path, cluster)[1]
        out[b] = times[path]
    return out


#: Cadence of the tp all-gather rebuilding a pp receive (read by the rank timeline's comm_kind).
SCATTER_GATHER_CADENCE = "pp receive, scatter/gather"


def scatter_gather(training: TrainingSpec, mesh: Mesh, act_bytes: int) -> bool:
    """Whether pipeline sends use Megatron-LM's scatter/gather: each of the tp ranks sends
    ``1/tp`` of the activation over the pp link and the receivers all-gather the slices over
    tp (NVLink inside a node): Megatron-LM 2022 ``_communicate``
    (``--scatter-gather-tensors-in-pipeline``, on by default) with tp > 1, without sequence
    parallelism (its activation is already split over tp) and when the activation's elements
    divide by tp (else it sends the whole tensor). torch's pipelining sends the whole tensor.
    """
    tp = mesh.degree("tp")
    elements = act_bytes // max(dtype_bytes(training.compute_dtype), 1)
    return training.framework == "megatron" and tp > 1 and not mesh.sequence_parallel and elements % tp == 0


def _tied_grad_bytes(c: StageContext) -> int:
    """Bytes of one rank's gradient of a tied embedding copy (padded vocab x hidden split
    over tp, then dim 0 over fsdp under FSDP2: ``ceil(rows / fsdp)`` rows; a last shard of
    uneven rows is smaller) in the main-gradient dtype ``training.grad_dtype`` (Megatron-LM
    all-reduces the fp32 main gradients, like the data-parallel reduction beside it)."""
    t, mesh = c.training, c.mesh
    tp = mesh.degree("tp")
    emb = c.model.embedding_tensors(padded_vocab(c.model.vocab, t.vocab_pad_divisor, tp))[0]
    fsdp = mesh.degree("fsdp") if t.sharding in ("zero3", "hsdp") else 1
    return fsdp_padded_numel(emb, c.model, fsdp, tp) // fsdp * dtype_bytes(t.grad_dtype)
