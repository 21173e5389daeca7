"""torch 2.13's single-stage schedules wait on their pipeline p2p where meshplan's simulation
waits (``PipelineSpec.torch_p2p``, :meth:`meshplan.pipeline.base.PipelineSchedule.torch_p2p_calls`,
chosen for ``framework = "torch"`` by :func:`meshplan.schedule.overlap_policy.p2p_mode`).

The torch side is torch's own ``_step_microbatches`` run on a fake stage (as
tests/test_schedule_registry.py runs it, no process group) whose ``get_*_ops`` return one
tagged op per cross-stage input and output, with ``_batch_p2p`` patched to record each batch it
posts and each ``wait`` on it: per unit, whether its receive is posted and waited right before
it, whether its output is posted right after it and waited before the next unit, and which ops
are posted together in one waited batch (1F1B's fused send + receive).
"""

from typing import NamedTuple

import numpy as np
import pytest
from torch.distributed.pipelining import schedules as S

from meshplan.pipeline.fast import simulate_arrays
from meshplan.pipeline.registry import get
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.schedule.overlap_policy import p2p_mode
from meshplan.schedule.pipeline_exposure import pp_hold_split, stage_bubble
from meshplan.spec.mesh import Schedule
from meshplan.spec.training import TrainingSpec


class Op(NamedTuple):
    """A fake p2p op: ``side`` send or recv, ``kind`` F (activation) or B (gradient), ``mb``."""

    side: str
    kind: str
    mb: int
    peer: int  # _sorted_batch_p2p (GPipe) groups by it


class Stage:
    """The attributes torch's single-stage schedules read, one op per cross-stage transfer."""

    def __init__(self, s: int, p: int, log: list):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = s, p, p, s
        self.is_first, self.is_last, self.log = s == 0, s == p - 1, log

    def _op(self, side, kind, mb, skip):
        return [] if skip else [Op(side, kind, mb, self.stage_index + (1 if (side, kind) in
                                                                          (("send", "F"), ("recv", "B")) else -1))]

    def get_fwd_recv_ops(self, i):
        return self._op("recv", "F", i, self.is_first)

    def get_fwd_send_ops(self, i):
        return self._op("send", "F", i, self.is_last)

    def get_bwd_recv_ops(self, i):
        return self._op("recv", "B", i, self.is_last)

    def get_bwd_send_ops(self, i):
        return self._op("send", "B", i, self.is_first)

    def forward_one_chunk(self, i, *a, **k):
        self.log.append(("unit", "F", i))

    def backward_one_chunk(self, i, **k):
        self.log.append(("unit", "B", i))

    def perform_reduce_grad(self, *a):
        pass


class Work:
    def __init__(self, ops, log):
        self.ops, self.log = tuple(ops), log

    def wait(self):
        self.log.append(("wait", self.ops))


def torch_log(monkeypatch, cls, p: int, m: int, s: int) -> list:
    """Stage ``s``'s computations, posted batches and waits, in torch's order."""
    log: list = []
    monkeypatch.setattr(S, "_batch_p2p", lambda ops, desc=None: (log.append(("post", tuple(ops))) or
                                                                 [Work(ops, log)]) if ops else [])
    run = cls(Stage(s, p, log), m)
    run._initialize_stage = lambda *a, **k: None
    run._step_microbatches()
    return log


def torch_calls(log: list):
    """From a log: (per unit in order: its output posted in the gap right after it and waited
    there (None: no output op), its input posted and waited in the gap right before it (None: no
    input op)); per gap (gap g before unit g), the ops of the batches posted and waited there)."""
    posted, waited, unit_at, gap = {}, {}, {}, 0
    for ev in log:
        if ev[0] == "unit":
            unit_at[(ev[1], ev[2])] = gap
            gap += 1
        elif ev[0] == "post":
            posted.update({op: gap for op in ev[1]})
        else:
            waited.update({op: gap for op in ev[1] if op not in waited})
    order = sorted(unit_at, key=unit_at.get)
    sent, received = [], []
    for kind, mb in order:
        k = unit_at[(kind, mb)]
        out = [op for op in posted if op.side == "send" and (op.kind, op.mb) == (kind, mb)]
        inp = [op for op in posted if op.side == "recv" and (op.kind, op.mb) == (kind, mb)]
        sent.append(None if not out else (posted[out[0]] == k + 1, waited[out[0]] == k + 1))
        received.append(None if not inp else (posted[inp[0]] == k, waited[inp[0]] == k))
    fused: dict = {}
    for ev in log:
        if ev[0] == "post" and all(waited[op] == posted[op] for op in ev[1]):
            fused.setdefault(posted[ev[1][0]], []).append(frozenset(ev[1]))
    return order, sent, received, fused


CASES = [(Schedule.ONE_F_ONE_B, p, m) for p, m in ((2, 2), (2, 4), (3, 7), (4, 4), (4, 8))] + \
        [(Schedule.GPIPE, p, m) for p, m in ((2, 1), (2, 4), (4, 3))]


@pytest.mark.parametrize("name,p,m", CASES)
def test_waits_are_torchs(monkeypatch, name, p, m):
    """Per unit of every stage: its input is posted and waited in the call right before it
    (lead 1, received with a wait); its output is posted right after it (delay 0) and waited
    there exactly where meshplan's send is not asynchronous; the ops waited in one gap are one
    batch (1F1B's fused send + receive) and equal the waited sides meshplan puts in that call."""
    sched = get(name)
    for s in range(p):
        order, sent, received, fused = torch_calls(torch_log(monkeypatch, getattr(S, sched.torch_class), p, m, s))
        mine = sched.order(p, m, 1, s)
        assert [(u.kind, u.mb) for u in mine] == order
        delay, lead, send_async, recv_async = sched.torch_p2p_calls(p, m, 1, s, len(mine))
        assert (delay == 0).all() and (lead == 1).all()
        for k, (out, inp) in enumerate(zip(sent, received)):
            if out is not None:
                assert out == (True, not send_async[k]), (name, p, m, s, k)
            if inp is not None:
                assert inp == (True, True) and not recv_async[k], (name, p, m, s, k)
        for g, batches in fused.items():  # gap g: after unit g - 1, before unit g
            # 1F1B: one batch_isend_irecv, one wait; GPipe after its last forward: that send's
            # wait, then the first backward's receive (one call in meshplan: the docstring's why)
            assert len(batches) == 1 or (name is Schedule.GPIPE and g == m and len(batches) == 2), (s, g, batches)
            want = {("send",) + (mine[g - 1].kind, mine[g - 1].mb)} if g and sent[g - 1] and not send_async[g - 1] \
                else set()
            want |= {("recv", mine[g].kind, mine[g].mb)} if g < len(mine) and received[g] else set()
            assert {op[:3] for b in batches for op in b} == want, (s, g)


def test_1f1b_fuses_the_forward_send_with_the_next_backward_receive(monkeypatch):
    """p 2, m 4, stage 0 (torch's 2 warm-up forwards): F0's send is posted alone and waited after
    F1 (torch line 1081); F1's, F2's and F3's go with the next backward's receive in one batch
    waited at once (1105); B2 of the cool-down receives alone (1153)."""
    log = torch_log(monkeypatch, S.Schedule1F1B, 2, 4, 0)
    seq = [(e[0],) + ((e[1], e[2]) if e[0] == "unit" else tuple((o.side, o.kind, o.mb) for o in e[1])) for e in log]
    assert seq[:8] == [("unit", "F", 0), ("post", ("send", "F", 0)), ("unit", "F", 1), ("wait", ("send", "F", 0)),
                       ("post", ("send", "F", 1), ("recv", "B", 0)), ("wait", ("send", "F", 1), ("recv", "B", 0)),
                       ("unit", "B", 0), ("unit", "F", 2)]


def _hand_spec(torch_calls: bool) -> PipelineSpec:
    return PipelineSpec("1f1b", 2, 4, forward_s=1.0, backward_s=2.0, p2p_s=0.5, blocking_p2p=torch_calls,
                        torch_p2p=torch_calls)


def test_hand_case_1f1b_pp2_m4():
    """1F1B, p 2, m 4, F 1 s, B 2 s, one transfer 0.5 s, torch's calls. Stage 0: F0 F1 B0 F2 B1
    F3 B2 B3; stage 1: F0 B0 F1 B1 F2 B2 F3 B3. A transfer runs once both calls are posted (each
    at the end of the unit before it), a call ends when its transfers do.

    s0 F0 0-1 (its send posted alone, no wait), F1 1-2; the call after F1 (send F1 + receive B0)
    is posted at 2. s1: its receive of F0, posted at 0, meets F0's send posted at 1: F0 1.5-2.5,
    B0 2.5-4.5; its call after B0 (send B0 + receive F1) posted 4.5: both calls end at 4.5 +
    0.5 = 5.0 (s0 waited 2.5 for s1, and s1's F1 waits for its input although s0 finished F1 at
    2: the send is in the fused call). s0 B0 5-7, F2 7-8; s1 F1 5-6, B1 6-8: calls after F2 and
    B1 both posted at 8, end 8.5. s0 B1 8.5-10.5, F3 10.5-11.5; s1 F2 8.5-9.5, B2 9.5-11.5: both
    at 11.5, end 12. s0 B2 12-14; s1 F3 12-13, B3 13-15, its send posted alone and waited at
    the step's end (torch line 1172: stage 1 ends at 15.5); s0's receive of B3
    (posted at 14, alone: cool-down) ends max(14, 15) + 0.5 = 15.5: B3 15.5-17.5. Step 17.5 s.

    Stage 0 (critical) busy 4 x (1 + 2) = 12 s, idle 5.5 s: exposed pp its four waited calls'
    transfers (after F1, F2, F3 and B2), 4 x 0.5 = 2 s; bubble the rest, 3.5 s (2.5 s waiting
    for stage 1's B0, 1 s for its B3). torch's ``bubble`` (idle / ideal) 5.5 / 12.
    Asynchronous sends (meshplan before torch's waits were modelled): s1's F1 4.5 (its input
    there at 2.5), step 17.0 s."""
    starts = [[0.0, 1.0, 5.0, 7.0, 8.5, 10.5, 12.0, 15.5], [1.5, 2.5, 5.0, 6.0, 8.5, 9.5, 12.0, 13.0]]
    spec = _hand_spec(True)
    arr, ref = simulate_arrays(spec), simulate(spec)
    assert arr.start.tolist() == sum(starts, [])
    for s in range(2):
        assert [e.start_s for e in ref.events if e.stage == s and e.stream == "compute"] == starts[s]
    assert arr.step_s == ref.step_s == 17.5
    split = pp_hold_split(arr, 0)
    assert split.transfer_s.tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.5, 0.0]
    assert split.wait_s.tolist() == [0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert split.lead_transfer_s + float(split.transfer_s.sum()) == 2.0  # exposed pp (no asynchronous receive)
    # stage 1 is held 0.5 s after B3 by its last send (waited at the end) and not after F0 (F0's
    # send under Megatron-LM 2022's calls would wait: s0's F1 at 1.5); in the steady state a fused
    # call's send and receive meet the same peer call, so its receive alone already binds
    assert arr.hold[arr.stage_slice(1)].tolist() == [0.0, 0.5, 0.0, 0.5, 0.0, 0.5, 0.0, 0.5]
    assert arr.hold[arr.stage_slice(0)][0] == 0.0
    assert stage_bubble(arr, 0) == 3.5 and arr.bubble == 5.5 / 12
    assert simulate_arrays(_hand_spec(False)).step_s == simulate(_hand_spec(False)).step_s == 17.0


def test_framework_torch_blocks_its_single_stage_schedules_only():
    """torch's GPipe and 1F1B wait in place (PipelineScheduleSingle); the multi-stage runtime's
    schedules (interleaved 1F1B, ZB-H1, ZB-V, DualPipeV) wait a receive at its compute only."""
    t = TrainingSpec(global_batch=8, seq_len=16)
    assert {s: tuple(p2p_mode(t, s)) for s in Schedule} == {
        Schedule.GPIPE: (True, False, True), Schedule.ONE_F_ONE_B: (True, False, True),
        **{s: (False, False, False) for s in (Schedule.INTERLEAVED_1F1B, Schedule.ZB_H1, Schedule.ZBV,
                                              Schedule.DUALPIPEV)}}
    assert [issubclass(getattr(S, get(s).torch_class), S.PipelineScheduleSingle) for s in Schedule] == \
        [get(s).torch_waits for s in Schedule]


def test_torch_p2p_is_refused_without_a_single_stage_schedule():
    from meshplan.errors import ConfigError
    with pytest.raises(ConfigError, match="torch_p2p needs blocking_p2p"):
        PipelineSpec("zbv", 2, 4, v=2, blocking_p2p=True, torch_p2p=True)
    with pytest.raises(ConfigError, match="torch_p2p needs blocking_p2p"):
        PipelineSpec("1f1b", 2, 4, torch_p2p=True)
    assert np.array_equal(PipelineSpec("1f1b", 2, 4, blocking_p2p=True, torch_p2p=True).p2p_calls(0, 8)[2],
                          [True, False, False, False, False, False, True, False])  # F0 and B2 (F0 F1 B0 F2 B1 F3 B2 B3)
