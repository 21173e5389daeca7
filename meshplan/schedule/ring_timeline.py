"""The context-parallel rings on the rank timeline, torch's ring attention (``training.cp_attention
= "ring"``, the rows of :func:`meshplan.spec.axes.cp.ring_rows`) and Transformer Engine's p2p ring
(``"p2p"``, Megatron-LM's default, :func:`meshplan.spec.axes.cp.p2p_rows`): the attention block's
core as the ring's ``cp`` steps, torch's each ``1/cp`` of its attention calls (and its ring kernels,
:data:`RING_OPS`), TE's each its own call and correction kernels (:mod:`meshplan.compute.te_ring`),
torch's K/V all-gather beside the first (or, under ``training.cp_rotate = "alltoall"``, a K/V shift
beside each step: :func:`a2a_forward`, :func:`a2a_backward`) and its fp32 dK/dV shifts beside the
next, TE's sends each beside its own step (:func:`ring_forward`, :func:`ring_backward`), called by
:mod:`meshplan.schedule.layer_timeline`.

The attention block under CP as :mod:`meshplan.schedule.layer_timeline` calls it: its seconds by
part (:func:`cp_parts`), its forward and backward (:func:`cp_attention_forward`,
:func:`cp_attention_backward`), all-gather CP's K/V all-gather after the K/V projections and its
dK/dV reduce-scatter beside the Q and K/V projections' input gradients, or a ring's steps.
"""

from __future__ import annotations

from typing import Optional

from meshplan.compute.ops import Cost
from meshplan.compute.ring_attention import GRAD_ACCUMULATION, MERGE
from meshplan.compute.te_ring import CORRECTION, GRAD_CORRECTION
from meshplan.schedule.row_groups import CP_KV_SHIFT, CP_PACKED
from meshplan.schedule.unit_sim import StreamSim

#: The ops of the cp rings that run as their ``cp`` steps (:mod:`meshplan.compute.ring_attention`):
#: the attention calls, torch's ring merge and gradient accumulation kernels, Transformer
#: Engine's corrections (:mod:`meshplan.compute.te_ring`).
RING_OPS = ("attention", MERGE, GRAD_ACCUMULATION, CORRECTION, GRAD_CORRECTION)
#: Name suffix of the compute event after a TE ring step's wait (:func:`p2p_steps`).
RING_AFTER = " ring step after its wait"

#: Name suffixes of the compute events of a ring's steps (:func:`ring_cp`) that a cp
#: collective runs beside: a forward attention call, a backward one (each ``1/cp`` of the calls' seconds).
RING_CALL, RING_CALL_B = " ring call", " ring call B"
#: Name of the last dK/dV shift of a layer's ring backward, which nothing overlaps.
LAST_SHIFT = "cp dK/dV last shift"
#: Name of a compiled ring backward's other dK/dV shifts, each waited for at once (:func:`compiled_ring_backward`).
BLOCKING_SHIFT = "cp dK/dV shift (waited at once)"
#: Name of a compiled ring backward's K/V all-gather, waited for at once (:func:`compiled_ring_backward`).
BLOCKING_GATHER = "cp K/V all-gather (waited at once)"


def ring_cp(s: StreamSim) -> bool:
    """Whether the stage's table has a ring's rows (send/recv in backward: torch's dK/dV shifts,
    :func:`meshplan.spec.axes.cp.ring_rows`, or TE's p2p sends, :func:`p2p_cp`): the timeline
    issues what the table counts."""
    return s.c.get("cp", "backward", "send/recv") > 0


def p2p_cp(s: StreamSim) -> bool:
    """Whether the stage's table has Transformer Engine's p2p ring rows (send/recv in forward,
    :func:`meshplan.spec.axes.cp.p2p_rows`; torch's ring gathers K and V in forward)."""
    return s.c.get("cp", "forward", "send/recv") > 0


def a2a_cp(s: StreamSim) -> bool:
    """Whether the stage's table has torch's ring K/V shifts (``training.cp_rotate = "alltoall"``,
    :func:`meshplan.spec.axes.cp.alltoall_kv_rows`): the ring rotates K/V by send/recv, no all-gather."""
    return s.c.get("cp", "forward", "send/recv", CP_KV_SHIFT) > 0


def a2a_forward(s: StreamSim, name: str, phase: str, core: float, sdpa: float) -> None:
    """torch's ring forward (or a checkpointed layer's replay, ``phase`` "backward") under
    ``rotate_method`` ALL_TO_ALL (:func:`meshplan.spec.axes.cp.alltoall_kv_rows`): at each of the
    ``cp`` steps the wait for the K/V sent at the step before, then the step's own send of them
    (all but the last step), then its SDPA call (``sdpa / cp``) beside that send; the rest of the
    core after the last call. Each send waits for the one before (the rank sends what it received)."""
    cp, send = s.w.cp, None
    for i in range(cp):
        if send is not None:
            s.compute("K/V wait", 0.0, [send])
        send = s.comm("cp", phase, "send/recv", "cp K/V shift", CP_KV_SHIFT, after=[s.last]) if i < cp - 1 else None
        s.compute(name + RING_CALL, sdpa / cp)
    s.compute(name + " core", core - sdpa)


def ring_forward(s: StreamSim, name: str, phase: str, core: float, sdpa: float, steps: tuple = ()) -> None:
    """The forward (``phase`` "forward", or "backward": a checkpointed layer's replay) core of
    block ``name`` (``core`` seconds, ``sdpa`` of them the ring's steps), after the Q, K and V
    projections. torch: ``_templated_ring_attention`` issues the K/V all-gather before its first
    SDPA call and waits for it before the second. TE's p2p ring (:func:`p2p_steps`, ``steps``: its
    seconds by step): ``cp - 1`` K/V sends, one beside each step but the last, then the rest of the core."""
    if p2p_cp(s):
        p2p_steps(s, name + RING_CALL, phase, sdpa, p2p_sends(s.w.cp, "forward"), steps, two_streams=True)
        s.compute(name + " core", core - sdpa)
        return
    if a2a_cp(s):
        a2a_forward(s, name, phase, core, sdpa)
        return
    ring = s.comm("cp", phase, "all-gather", "cp K/V all-gather", after=[s.last])
    s.compute(name + RING_CALL, sdpa / s.w.cp)
    s.compute(name + " core", core - sdpa / s.w.cp, [ring])


def p2p_sends(cp: int, phase: str) -> list[Optional[tuple[str, str]]]:
    """(table group, event name) of the send/recv at each of the ``cp`` steps of Transformer
    Engine's p2p ring (:func:`meshplan.spec.axes.cp.p2p_rows`), None where a step sends nothing:
    ``phase`` "forward" (also a replay) K and V at all but the last; "backward" K and V, ``cp - 2``
    K and V with dK and dV (:data:`~meshplan.schedule.row_groups.CP_PACKED`), then dK and dV.

    >>> [x and x[1] for x in p2p_sends(3, "forward")]
    ['cp K/V send/recv', 'cp K/V send/recv', None]
    >>> [x and x[1] for x in p2p_sends(3, "backward")]
    ['cp K/V send/recv', 'cp K/V+dK/dV send/recv', 'cp dK/dV send/recv']
    """
    kv: Optional[tuple[str, str]] = ("", "cp K/V send/recv")
    if phase == "forward":
        return [kv] * (cp - 1) + [None]
    packed: Optional[tuple[str, str]] = (CP_PACKED, "cp K/V+dK/dV send/recv")
    return [kv] + [packed] * (cp - 2) + [("", "cp dK/dV send/recv")]


def p2p_steps(s: StreamSim, call: str, phase: str, sdpa: float, sends: list[Optional[tuple[str, str]]],
              steps: tuple = (), two_streams: bool = False) -> None:
    """Transformer Engine's p2p ring steps (``AttnFuncWithCPAndKVP2P``, :func:`meshplan.spec.axes.cp.p2p_rows`):
    at step ``i`` the send/recv ``sends[i]`` (:func:`p2p_sends`; row ``phase``) issued on the cp
    stream before the step's own work beside it (``call``: ``steps[i]``' first part, the step's
    attention call at its shape and TE's kernels before the wait,
    :func:`meshplan.compute.te_ring.te_rank`) and waited for after it, then the step's work
    after the wait (``steps[i]``' second part: the backward's dK/dV accumulation into the received
    buffer, the forward's output corrections after its last step): each exposes ``max(send -
    beside, 0)``. ``sdpa``: the steps' seconds; any of them ``steps`` does not place (a call not
    rated by step) is spread equally over the ``cp`` steps beside their sends.

    Each send waits for the one before it (the cp stream's order: it sends what that one
    received) and, on the backward's one stream, for all the work before it; with
    ``two_streams`` (the forward and its replay: TE alternates two flash streams,
    :mod:`meshplan.compute.te_ring`) the send of step ``i`` is issued from call ``i``'s stream,
    whose last work is call ``i - 2`` (with its lse correction), so it waits for that call, not
    for call ``i - 1``; the calls stay in series on the compute stream (they share the SMs)."""
    cp = s.w.cp
    steps = steps or ((0.0, 0.0),) * cp
    extra = (sdpa - sum(a + b for a, b in steps)) / cp
    after_name = call.split(RING_CALL)[0] + RING_AFTER
    entry = s.last
    calls: list = []  # each step's call event
    for i, (x, (beside, after)) in enumerate(zip(sends, steps)):
        dep = ([calls[i - 2]] if i >= 2 else [entry]) if two_streams else [s.last]
        send = None if x is None else s.comm("cp", phase, "send/recv", x[1], x[0], after=dep)
        calls.append(s.compute(call, beside + extra))
        if send is not None:
            s.compute("K/V wait", 0.0, [send])
        if after > 0:
            s.compute(after_name, after)


def ring_backward(s: StreamSim, name: str, rest: float, sdpa: float, replay: float, wait: list,
                  steps: tuple = (), replay_steps: tuple = ()) -> None:
    """A ring's attention core backward (:func:`ring_cp`): ``rest`` seconds of the core's backward
    off the steps (wo's input gradient, RoPE, a recomputed core's forward) first, after ``wait``,
    then the steps (``sdpa``: their seconds).

    torch's ring attention (:func:`meshplan.spec.axes.cp.ring_rows`): its own K/V all-gather
    issued before the first of ``cp`` SDPA backward calls (``sdpa``: their seconds and the ring's
    accumulation kernels, ``1/cp`` each) and waited for before the second; after each call the
    fp32 dK/dV shift to the next rank, waited for after the next call; the last one after the
    loop, exposed. TE's p2p ring (:func:`p2p_steps`): ``replay`` of ``rest``, the forward a
    selective recompute replays (Megatron-LM's checkpointed core attention), runs as its
    forward's steps with their sends (``replay_steps``), then the backward's ``cp`` steps
    (``steps``), each beside its send: K/V, ``cp - 2`` K/V with dK/dV, dK/dV."""
    cp, step = s.w.cp, sdpa / s.w.cp
    if p2p_cp(s):
        s.compute(name + " core B", rest - replay, wait)
        if replay > 0:
            p2p_steps(s, name + RING_CALL, "backward", replay, p2p_sends(cp, "forward"), replay_steps, two_streams=True)
        p2p_steps(s, name + RING_CALL_B, "backward", sdpa, p2p_sends(cp, "backward"), steps)
        return
    s.compute(name + " core B", rest, wait)
    if not s.w.torch_eager:
        compiled_ring_backward(s, name, step, a2a_cp(s))
        return
    if a2a_cp(s):
        a2a_backward(s, name, step)
        return
    ring = s.comm("cp", "backward", "all-gather", "cp K/V all-gather", after=[s.last])
    s.compute(name + RING_CALL_B, step)
    shift = s.comm("cp", "backward", "send/recv", "cp dK/dV shift" if cp > 1 else LAST_SHIFT, after=[s.last])
    for k in range(1, cp):
        s.compute(name + RING_CALL_B, step, [ring])
        s.compute("dK/dV wait", 0.0, [shift])
        shift = s.comm("cp", "backward", "send/recv", LAST_SHIFT if k == cp - 1 else "cp dK/dV shift", after=[s.last])
    s.compute("dK/dV wait", 0.0, [shift])


def a2a_backward(s: StreamSim, name: str, step: float) -> None:
    """torch's eager ring backward under ``rotate_method`` ALL_TO_ALL (torch 2.13
    ``_templated_ring_attention_backward``, lines 519-627 of
    ``distributed/tensor/experimental/_context_parallel/_attention.py``): at step ``i`` the wait
    for the K/V sent at step ``i - 1``, the K/V send of step ``i`` (all but the last), the SDPA
    backward call (``step`` seconds, with its ring kernels), the wait for the dK/dV shift of step
    ``i - 1``, then this step's fp32 dK/dV shift; the last waited for after the loop (exposed).
    Both rotaters run on the cp process group, one stream: beside call ``i`` the dK/dV shift of
    step ``i - 1`` then the K/V send of step ``i``, and call ``i + 1`` waits for both."""
    kv = shift = None
    cp = s.w.cp
    for i in range(cp):
        if kv is not None:
            s.compute("K/V wait", 0.0, [kv])
        kv = s.comm("cp", "backward", "send/recv", "cp K/V shift", CP_KV_SHIFT, after=[s.last]) if i < cp - 1 else None
        s.compute(name + RING_CALL_B, step)
        if shift is not None:
            s.compute("dK/dV wait", 0.0, [shift])
        shift = s.comm("cp", "backward", "send/recv", LAST_SHIFT if i == cp - 1 else "cp dK/dV shift", after=[s.last])
    s.compute("dK/dV wait", 0.0, [shift])


def compiled_ring_backward(s: StreamSim, name: str, step: float, alltoall: bool = False) -> None:
    """torch's ring backward under torch.compile (``s.w.torch_eager`` false: torchtitan compiles
    each TransformerBlock, ``fullgraph=True``, so AOTAutograd traces ``_templated_ring_attention_backward``
    through DTensor's dispatch into the block's backward graph): ``cp`` SDPA backward calls of
    ``step`` seconds each (with their ring kernels), the K/V all-gather and every fp32 dK/dV shift
    BLOCKING, each waited for at once, in inductor's order: call 0, the gather and its wait, then per
    step its shift and wait before the next call; the last shift ends the core.

    Source: ``torch/distributed/_functional_collectives.py`` ``_maybe_wrap_tensor`` (torch 2.13;
    the same since 2023): while tracing, every functional collective (``all_gather_tensor``,
    ``permute_tensor``'s ``all_to_all_single``) is followed by ``wait_tensor`` at once, so the
    rotaters' later ``next_buffer`` waits nothing; where each wait then runs is inductor's
    scheduler's choice. ``torch/_inductor/config.py``: ``reorder_for_compute_comm_overlap = False``,
    ``reorder_for_peak_memory = True`` (torch 2.13's defaults; turned on by default in pytorch
    PR #137467, Oct 2024; torchtitan's SimpleFSDP turns it off in 46dc201f3, Mar 2025, so it was on
    then; torch 1963fc8 of Dec 2024, the T2 rows' commit, not read). Measured on torch 2.13 (CPU,
    inductor, fake process group, ``_templated_ring_attention_backward`` with the CPU flash op,
    d 128: cp 2, 4, 8 at ranks 0 and cp - 1): in every generated backward the gather comes after
    the first SDPA backward call and its wait right after it, and each ``all_to_all_single`` is
    followed directly by its ``wait_tensor``, no call between; with ``reorder_for_peak_memory``
    off, the order is the eager one (:func:`ring_backward`: the gather beside call 0, each shift
    beside the next call). The forward's gather stays beside the first call in both orders
    (:func:`ring_forward`), as does a replayed forward's (not measured in the joint graph).

    ``alltoall`` (``training.cp_rotate``): no gather; each of the ``cp - 1`` K/V shifts
    (``kv_rotater``'s ``permute_tensor``, an ``all_to_all_single`` too) waited for at once after
    the call it precedes in eager order, by the same rule (the order inductor gives them was not
    measured; every wait blocking, the order moves no exposure): ``(cp - 1) K + cp X`` exposed."""
    cp = s.w.cp
    s.compute(name + RING_CALL_B, step)
    if alltoall:
        kv = s.comm("cp", "backward", "send/recv", "cp K/V shift (waited at once)", CP_KV_SHIFT, after=[s.last])
        s.compute("K/V wait", 0.0, [kv])
    else:
        ring = s.comm("cp", "backward", "all-gather", BLOCKING_GATHER, after=[s.last])
        s.compute("K/V wait", 0.0, [ring])
    for k in range(cp):
        if k:
            s.compute(name + RING_CALL_B, step)
        if alltoall and 0 < k < cp - 1:
            kv = s.comm("cp", "backward", "send/recv", "cp K/V shift (waited at once)", CP_KV_SHIFT, after=[s.last])
            s.compute("K/V wait", 0.0, [kv])
        shift = s.comm("cp", "backward", "send/recv", LAST_SHIFT if k == cp - 1 else BLOCKING_SHIFT, after=[s.last])
        s.compute("dK/dV wait", 0.0, [shift])


_CP_PART = {"wk": "kv", "wv": "kv", "wq": "q", "wq_a": "q", "wq_b": "q", "wkv_a": "kv", "wkv_b": "kv"}


def cp_parts(c: Cost, phase: str, recompute: Optional[bool]) -> dict:
    """Seconds of the attention block's ops of ``phase`` by part: ``kv`` (wk, wv, and RoPE and
    torch's repeat_kv in forward; MLA: wkv_a, wkv_b), ``q`` (wq; MLA: wq_a, wq_b), ``out`` (wo in forward), ``core``
    (the rest; in backward also wo's input gradient and RoPE, which precede dK/dV), ``sdpa``, the
    part of ``core`` a cp ring runs as its steps (:data:`RING_OPS`), and ``replay``, the part a
    selective recompute replays in backward (``recompute`` None), which Transformer Engine's p2p
    ring runs as its forward's steps; ``steps`` and ``replay_steps``: the (beside, after) seconds
    by step of those ring ops that carry them (:attr:`~meshplan.compute.ops.Op.steps`, TE's ring),
    () where none does. Op names from :mod:`meshplan.compute.ops`."""
    fwd = phase == "forward" or recompute
    out: dict = dict.fromkeys(("kv", "q", "core", "out", "sdpa", "replay"), 0.0)
    out["steps"] = out["replay_steps"] = ()
    for o in c.ops:
        if o.block != "attn" or o.phase != phase or recompute not in (None, o.recompute):
            continue
        base = o.name.split(" ")[0].split(".")[0]
        part = _CP_PART.get(base, "core")
        if fwd and base in ("rope", "repeat_kv", "wo"):
            part = "out" if base == "wo" else "kv"
        out[part] += o.seconds
        ring = o.name.removesuffix(" (recompute)") in RING_OPS and bool(o.recompute) == bool(recompute)
        out["sdpa"] += o.seconds if ring else 0.0  # not a recomputed core's forward before the backward's steps
        replayed = recompute is None and o.recompute and o.name.removesuffix(" (recompute)") in RING_OPS
        out["replay"] += o.seconds if replayed else 0.0
        for key, on in (("steps", ring), ("replay_steps", replayed)):
            if on and o.steps:
                out[key] = _add_steps(out[key], o.steps)
    return out


def step_seconds(parts: dict, which: str, cp: int) -> float:
    """The seconds of one ring step a search bound may set beside each send (``which``: "sdpa"
    or "replay" of :func:`cp_parts`' ``parts``): ``1/cp`` of them on torch's ring (equal steps);
    on TE's (``parts`` has its steps) the longest step's part beside its send (:func:`p2p_steps`),
    so that ``k max(send - step, 0)`` never exceeds the timeline's sum over the steps.

    >>> step_seconds({"sdpa": 6.0, "steps": ()}, "sdpa", 3)
    2.0
    >>> step_seconds({"sdpa": 6.0, "steps": ((3.0, 0.5), (1.0, 0.0), (1.5, 0.0))}, "sdpa", 3)
    3.0
    """
    steps = parts["steps" if which == "sdpa" else "replay_steps"]
    if not steps:
        return parts[which] / cp
    extra = (parts[which] - sum(a + b for a, b in steps)) / cp
    return max(a for a, _ in steps) + extra


def _add_steps(a: tuple, b: tuple) -> tuple:
    """Two ops' (beside, after) seconds by step (:attr:`~meshplan.compute.ops.Op.steps`) added."""
    if not a:
        return tuple(b)
    return tuple((x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b))


def cp_attention_forward(s: StreamSim, name: str, cp: tuple, cp_phase: str, waits: list, tp_ov: list) -> None:
    """The attention block ``name``'s forward under CP (``cp``: its K/V proj, Q proj, core, out
    proj, SDPA calls and ring kernels seconds, :func:`cp_parts`; ``cp_phase``: the cp rows' phase,
    "backward" for a checkpointed layer's replay): the K/V projections first (after ``waits``,
    the tp all-gather opening the block unless TP overlaps), then torch's ring (wq, then the
    gather beside the first SDPA call, :func:`ring_forward`) or all-gather CP's K/V all-gather
    issued beside the Q projection, the core waiting for it; the out projection last, the
    block's overlapped tp collectives ``tp_ov`` beside it. With Megatron-LM's fused QKV GEMM
    (``Workload.fused_qkv``; its seconds shared among wq, wk, wv,
    :func:`meshplan.compute.kernel_time.qkv_fused_ops`) no Q projection runs apart: Transformer
    Engine's all-gather (``gather_along_first_dim`` in ``AttnFuncWithCPAndKVAllGather.forward``,
    blocking) follows the one GEMM and the core waits for it, nothing beside it."""
    kv, q, core, out, sdpa, steps = cp
    if s.w.fused_qkv and not ring_cp(s):  # Megatron-LM: one linear_qkv GEMM, then TE's blocking gather
        s.compute(name + " QKV proj", kv + q, waits)
        ring = s.comm("cp", cp_phase, "all-gather", "cp K/V all-gather", after=[s.last])
        s.compute(name + " core", core, [ring])
        s.compute(name + " out proj", out, [], tp_ov)
        return
    s.compute(name + " K/V proj", kv, waits)
    if ring_cp(s):
        s.compute(name + " Q proj", q)
        ring_forward(s, name, cp_phase, core, sdpa, steps)
    else:
        ring = s.comm("cp", cp_phase, "all-gather", "cp K/V all-gather", after=[s.last])
        s.compute(name + " Q proj", q)
        s.compute(name + " core", core, [ring])
    s.compute(name + " out proj", out, [], tp_ov)


def cp_attention_backward(s: StreamSim, name: str, cp: tuple, t_w_row: float, pre, regather: bool):
    """The attention block ``name``'s input gradients under CP (``cp``: core incl. wo and RoPE,
    Q proj, K/V proj, the SDPA calls' and a selective recompute's replayed calls' seconds;
    ``t_w_row``: wo's weight gradient, computed with its input gradient before the core;
    ``pre``: the tp collective opening the block): a ring's backward (:func:`ring_backward`)
    between the core and the projections, or all-gather CP's dK/dV reduce-scatter issued after
    the core, the K/V projections' input gradients waiting for it (with Megatron-LM's fused QKV
    GEMM, the whole QKV input gradient: TE's ``reduce_scatter_along_first_dim`` blocks). With ``regather``
    (Megatron-LM's SP re-gather for the weight gradients) the tp all-gather is issued after the
    ring (Megatron-LM under TE's p2p ring: during the QKV input gradient) or after the
    reduce-scatter, and returned; None otherwise. Under Megatron-LM (Transformer Engine's
    all-gather CP, :func:`meshplan.spec.axes.cp.cp_rows`) after wo's and the core's other
    gradients: a selective recompute's replayed attention (``replay`` seconds) after its own
    gather, then the attention backward (``sdpa``) after the gather TE's backward issues."""
    core, q, kv, sdpa, replay, steps, replay_steps = cp
    ag = None
    if ring_cp(s):
        ring_backward(s, name, core - sdpa + t_w_row, sdpa, replay, [pre], steps, replay_steps)
        if regather:
            ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)")
        s.compute(name + " Q proj B", q)
        s.compute(name + " K/V proj B", kv)
        return ag
    if s.w.framework == "megatron":  # TE's all-gather CP: the replayed core's gather, then its backward's own
        s.compute(name + " core B", core + t_w_row - replay - sdpa, [pre])
        if replay > 0:
            again = s.comm("cp", "backward", "all-gather", "cp K/V all-gather (replayed core)", after=[s.last])
            s.compute(name + " replayed core", replay, [again])
        own = s.comm("cp", "backward", "all-gather", "cp K/V all-gather (backward)", after=[s.last])
        s.compute(name + " attention B", sdpa, [own])
    else:
        s.compute(name + " core B", core + t_w_row, [pre])
    rs = s.comm("cp", "backward", "reduce-scatter", "cp dK/dV reduce-scatter", after=[s.last])
    ag = s.comm("tp", "backward", "all-gather", "tp all-gather (input again, for wgrad)") if regather else None
    if s.w.fused_qkv:  # the fused QKV input gradient reads dQ, dK and dV together: it waits for the reduce-scatter
        s.compute(name + " QKV proj B", q + kv, [rs])
        return ag
    s.compute(name + " Q proj B", q)
    s.compute(name + " K/V proj B", kv, [rs])
    return ag
