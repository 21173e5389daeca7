"""The pipeline-schedule registry (meshplan.pipeline): every registered schedule's op order
per rank equals the order torch.distributed.pipelining's own class for it runs (the class
named by the registry), on CPU without a process group; its warm-up count equals torch's;
the simulation's dependencies follow the schedule's chunk-to-virtual-stage map.

The torch side, read two ways:

- single-stage schedules (``PipelineScheduleSingle``: ScheduleGPipe, Schedule1F1B) run
  their order as code in ``_step_microbatches``; the test runs it on a fake stage that
  records each ``forward_one_chunk`` / ``backward_one_chunk`` call (no communication: every
  ``get_*_ops`` returns no op). Their ``pipeline_order`` IR is not what runs, and torch
  2.13's Schedule1F1B IR numbers the last rank's forwards 1..m instead of 0..m-1, so it is
  not used.
- multi-stage schedules (``_PipelineScheduleRuntime``: ScheduleInterleaved1F1B,
  ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) execute
  ``pipeline_order_with_comms``; the test takes its compute actions (F, full backward B,
  input-gradient I, weight-gradient W) with their stage index (the virtual stage) and
  micro-batch. An ``OVERLAP_F_B`` action (DualPipeV) runs its sub-actions in order (torch's
  runtime without a custom function), so it is read as them; in a schedule that splits the
  backward, torch's full backward (DualPipeV's) is meshplan's B immediately followed by its W.
"""

import pytest
import torch
from torch.distributed.pipelining import schedules as S

from meshplan.errors import ConfigError
from meshplan.memory.inflight import in_flight_chunks
from meshplan.pipeline.base import PipelineSchedule, Unit
from meshplan.pipeline.registry import SCHEDULES, get
from meshplan.pipeline.sim_types import dependency
from meshplan.pipeline.simulate import PipelineSpec, simulate
from meshplan.spec.mesh import MeshSpec, Schedule


class FakeStage:
    """The attributes a torch schedule reads from a stage, and a log of computations."""

    def __init__(self, index: int, n_stages: int, p: int, rank: int, log: list):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, p, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = torch.nn.Module()
        self.log = log

    def __getattr__(self, name):
        if name.startswith("get_") and name.endswith("_ops"):  # p2p ops: none
            return lambda *a, **k: []
        raise AttributeError(name)

    def forward_one_chunk(self, i, *a, **k):
        self.log.append(("F", i, self.stage_index))

    def backward_one_chunk(self, i, **k):
        self.log.append(("B", i, self.stage_index))

    def perform_reduce_grad(self, *a):
        pass

    def clear_runtime_states(self):
        pass


KIND = {S.FORWARD: "F", S.FULL_BACKWARD: "B", S.BACKWARD_INPUT: "I", S.BACKWARD_WEIGHT: "W"}


def torch_order(sched: PipelineSchedule, p: int, m: int, v: int, rank: int) -> list[tuple]:
    """(kind, micro-batch, virtual stage) of every computation ``rank`` runs under the
    registry's torch class for ``sched``."""
    cls = getattr(S, sched.torch_class)
    log: list = []
    if issubclass(cls, S.PipelineScheduleSingle):
        run = cls(FakeStage(rank, p, p, rank, log), m)
        run._initialize_stage = lambda *a, **k: None  # shape inference and p2p warm-up: no process group
        run._step_microbatches()
        return log
    stages = [FakeStage(sched.virtual_stage(c, rank, p, v), p * v, p, rank, log) for c in range(v)]
    run = cls(stages, m)
    out = []
    for a in run.pipeline_order_with_comms[rank]:
        for x in (a.sub_actions if a is not None and a.computation_type == S.OVERLAP_F_B else (a,)):
            if x is None or x.computation_type not in KIND:
                continue
            if x.computation_type == S.FULL_BACKWARD and sched.splits_backward:
                out += [("I", x.microbatch_index, x.stage_index), ("W", x.microbatch_index, x.stage_index)]
            else:
                out.append((KIND[x.computation_type], x.microbatch_index, x.stage_index))
    return out


def meshplan_order(sched: PipelineSchedule, p: int, m: int, v: int, s: int) -> list[tuple]:
    """The same triples from meshplan's order; a split backward's B is torch's I."""
    kind = {"F": "F", "W": "W", "B": "I" if sched.splits_backward else "B"}
    return [(kind[u.kind], u.mb, sched.virtual_stage(u.chunk, s, p, v)) for u in sched.order(p, m, v, s)]


CASES = {
    Schedule.GPIPE: [(1, 3, 1), (2, 1, 1), (2, 4, 1), (4, 3, 1), (4, 8, 1)],
    Schedule.ONE_F_ONE_B: [(2, 2, 1), (2, 5, 1), (3, 7, 1), (4, 4, 1), (4, 8, 1)],
    Schedule.INTERLEAVED_1F1B: [(2, 2, 2), (2, 4, 2), (3, 6, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4),
                                # torch's rounds max(1, m // p) other than m / p: one round of m (m < 2p),
                                # two of 5 (m 10), three of 5 (m 15 at p 5)
                                (4, 6, 2), (4, 10, 2), (4, 3, 2), (4, 2, 2), (3, 4, 2), (4, 5, 3), (5, 15, 2)],
    Schedule.ZB_H1: [(2, 2, 1), (2, 6, 1), (3, 9, 1), (4, 2, 1), (3, 2, 1), (4, 4, 1), (4, 8, 1), (4, 12, 1),
                     (4, 6, 1), (4, 10, 1)],
    Schedule.ZBV: [(2, 1, 2), (2, 2, 2), (2, 3, 2), (2, 4, 2), (2, 7, 2), (3, 4, 2), (3, 9, 2), (4, 5, 2),
                   (4, 8, 2), (4, 16, 2), (8, 16, 2)],
    Schedule.DUALPIPEV: [(2, 4, 2), (2, 5, 2), (2, 9, 2), (3, 6, 2), (3, 7, 2), (4, 8, 2), (4, 11, 2),
                         (4, 16, 2), (5, 12, 2), (8, 16, 2)],
}


def test_every_schedule_is_registered_and_compared():
    assert set(SCHEDULES) == set(Schedule) == set(CASES)
    assert all(SCHEDULES[name].name is name for name in Schedule)


@pytest.mark.parametrize("name,p,m,v", [(n, *c) for n, cases in CASES.items() for c in cases])
def test_order_per_rank_equals_torch(name, p, m, v):
    sched = get(name)
    for rank in range(p):
        assert meshplan_order(sched, p, m, v, rank) == torch_order(sched, p, m, v, rank), (name, p, m, v, rank)


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_under_torch_only():
    """torch's Schedule1F1B refuses m < p (its __init__ raises), so framework torch makes it a
    reason; Megatron-LM's 1F1B warms up min(p - s - 1, m) and runs it (GPipe's order)."""
    with pytest.raises(ValueError, match="greater than"):
        S.Schedule1F1B(FakeStage(0, 4, 4, 0, []), 2)
    S.Schedule1F1B(FakeStage(0, 4, 4, 0, []), 4)  # m == p: accepted
    one = get("1f1b")
    assert one.reasons(4, 2, 1) == ["1F1B needs micro-batches (2) >= pp (4) (torch Schedule1F1B)"]
    assert one.reasons(4, 4, 1) == [] and one.reasons(4, 2, 1, "megatron") == []
    assert [u.kind for u in one.order(4, 2, 1, 0)] == ["F", "F", "B", "B"]
    assert get("gpipe").reasons(4, 2, 1) == []  # ScheduleGPipe has no such rule
    S.ScheduleGPipe(FakeStage(0, 4, 4, 0, []), 2)


def _torch_refuses(cls, stages, m) -> bool:
    try:
        cls(stages, m)
    except ValueError as e:
        assert "multiple of the number of rounds" in str(e)
        return True
    return False


@pytest.mark.parametrize("name", [Schedule.INTERLEAVED_1F1B, Schedule.ZB_H1])
def test_rounds_rule_is_torchs(name):
    """meshplan refuses exactly the m torch's class refuses (its rounds max(1, m // p) must
    divide m; p 2, m 5: 2 rounds; p 4, m 9: 2 rounds) for p 2..5 and m 1..3p+2, under
    framework torch; Megatron-LM's interleaved rule is p | m."""
    sched = get(name)
    v = 2 if sched.virtual_stages else 1
    for p in range(2, 6):
        for m in range(1, 3 * p + 3):
            stages = [FakeStage(sched.virtual_stage(c, 0, p, v), p * v, p, 0, []) for c in range(v)]
            refused = _torch_refuses(getattr(S, sched.torch_class), stages, m)
            assert bool(sched.refused(p, m)) == refused == bool(sched.reasons(p, m, v)), (name, p, m)
    assert "multiple of torch's rounds max(1, m // pp 4) = 2" in get(name).reasons(4, 9, v)[0]
    if name == Schedule.INTERLEAVED_1F1B:
        assert sched.reasons(4, 6, 2, "megatron") == ["interleaved 1F1B needs micro-batches (6) divisible by pp (4) "
                                                      "(Megatron-LM)"]
        assert sched.reasons(4, 8, 2, "megatron") == []


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (4, 8, 2), (4, 4, 3), (8, 16, 4), (3, 9, 2), (4, 6, 2), (4, 10, 2),
                                   (4, 3, 2), (5, 15, 3)])
def test_interleaved_warmup_is_torchs(p, m, v):
    """torch's ``_get_warmup_ops`` (factor 2) with its micro-batches per round
    ``m // max(1, m // p)`` (p when p divides m: Megatron-Core's min(m v, 2(p - s - 1) +
    (v - 1) p); 6 at p 4, m 6; 5 at m 10); the memory module's in-flight count is that + 1."""
    sched = get(Schedule.INTERLEAVED_1F1B)
    g = m // max(1, m // p)
    for s in range(p):
        warm = S._get_warmup_ops(s, v, g, p, m, multiply_factor=2)
        assert sched.warmup(p, m, v, s) == warm
        assert in_flight_chunks(s, p, m, v) == min(m * v, warm + 1)


def test_torch_classes_exist_and_validate_builds_the_tested_ones():
    for sched in SCHEDULES.values():
        assert issubclass(getattr(S, sched.torch_class), S._PipelineSchedule)
    assert [str(s) for s, x in SCHEDULES.items() if x.runs_in_validate] == ["gpipe", "1f1b", "interleaved_1f1b", "zbv",
                                                                             "dualpipev"]


class VShape(PipelineSchedule):
    """A V-shaped placement (torch's ``style="v"``): rank s holds virtual stages s and
    2p - 1 - s, so rank 0 holds the first and the last."""

    name = Schedule.INTERLEAVED_1F1B
    virtual_stages = True

    def virtual_stage(self, chunk, s, p, v):
        return s if chunk == 0 else 2 * p - 1 - s


def test_dependencies_follow_the_schedules_map():
    """p 2, v 2. Looped: rank 0 holds virtual stages 0 and 2; its chunk-1 F waits for F of
    virtual stage 1 (rank 1). V-shaped: rank 0 holds 0 and 3; its chunk-1 F waits for F of
    virtual stage 2 (rank 1's chunk 1), and its chunk-1 B is the last virtual stage's: it
    waits for its own F."""
    looped = get(Schedule.INTERLEAVED_1F1B)
    assert dependency(looped, Unit("F", 0, 1), 0, 2, 2) == ("F", 0, 1)
    assert dependency(looped, Unit("B", 0, 1), 0, 2, 2) == ("B", 0, 3)
    v = VShape()
    assert dependency(v, Unit("F", 0, 1), 0, 2, 2) == ("F", 0, 2)
    assert dependency(v, Unit("B", 0, 1), 0, 2, 2) == ("F", 0, 3)
    assert dependency(v, Unit("B", 0, 1), 1, 2, 2) == ("B", 0, 3)
    assert dependency(v, Unit("W", 0, 0), 1, 2, 2) == ("B", 0, 1)


def test_one_chunk_schedules_run_their_chunked_order_with_virtual_stages():
    assert get("1f1b").for_chunks(1) is Schedule.ONE_F_ONE_B
    assert get("1f1b").for_chunks(2) is get("zb_h1").for_chunks(2) is Schedule.INTERLEAVED_1F1B
    assert get("gpipe").for_chunks(2) is Schedule.GPIPE
    assert get("interleaved_1f1b").for_chunks(3) is Schedule.INTERLEAVED_1F1B


def test_names_parse_to_the_enum_and_unknown_names_are_config_errors():
    assert MeshSpec(names=["pp"], shape=[2], pp_schedule="zb_h1").pp_schedule is Schedule.ZB_H1
    assert MeshSpec(names=["pp"], shape=[2]).pp_schedule is Schedule.ONE_F_ONE_B
    assert PipelineSpec("interleaved_1f1b", p=2, m=2, v=2).schedule is Schedule.INTERLEAVED_1F1B
    with pytest.raises(ConfigError, match=r"mesh\.pp_schedule: unknown schedule 'dualpipe'"):
        get("dualpipe")


def test_split_backward_is_the_schedules_property():
    """ZB-H1 (splits_backward) simulates B and W as separate units: with F = B = W = 1,
    p 2, m 2 the step is m(F+B+W) + (p-1)(F+B-W) = 6 + 1 = 7 (Qi et al. 3.1); 1F1B runs B+W
    as one unit: (m + p - 1)(F + B + W) = 9."""
    zb = simulate(PipelineSpec("zb_h1", p=2, m=2, forward_s=1, backward_s=1, weight_s=1))
    one = simulate(PipelineSpec("1f1b", p=2, m=2, forward_s=1, backward_s=1, weight_s=1))
    assert (zb.step_s, one.step_s) == (7.0, 9.0)
    assert {e.args["kind"] for e in zb.events} == {"F", "B", "W"} and {e.args["kind"] for e in one.events} == {"F", "B"}


@pytest.mark.parametrize("name", [Schedule.ZBV, Schedule.DUALPIPEV])
def test_v_shaped_map_is_torchs(name):
    """The chunk map equals torch's ``generate_stage_to_rank_mapping(style="v")``: rank 0
    holds virtual stages 0 and 2p - 1 (the embedding and the output layer), so the output
    layer's stage is 0; p2p per micro-batch each way: 2 on the end ranks (rank p - 1 hands
    chunk 0's output to its own chunk 1), 4 on the others."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    sched = get(name)
    for p in (2, 3, 4, 8):
        torch_map = generate_stage_to_rank_mapping(p, 2 * p, style="v")
        assert {sched.virtual_stage(c, s, p, 2): s for s in range(p) for c in range(2)} == torch_map
        assert sched.last_stage(p, 2) == 0
        assert [sched.p2p_per_microbatch(p, 2, s) for s in range(p)] == [2] + [4] * (p - 2) + [2]
    assert get(Schedule.INTERLEAVED_1F1B).last_stage(4, 2) == 3


@pytest.mark.parametrize("name", [Schedule.ZBV, Schedule.DUALPIPEV])
def test_v_shaped_in_flight_is_the_orders_peak(name):
    """Chunk forwards held at the peak (F done, B not yet), counted on the order itself, equal
    the schedule's closed form (read by the memory timeline and the search): ZB-V 2p, DualPipeV
    2p + 1, at most the 2m there are."""
    sched = get(name)
    for p in (2, 3, 4, 6):
        for m in ((1, 2, 3, 5, 8, 13) if name is Schedule.ZBV else (2 * p, 2 * p + 1, 3 * p + 2)):
            for s in range(p):
                live = top = 0
                for u in sched.order(p, m, 2, s):
                    live += {"F": 1, "B": -1, "W": 0}[u.kind]
                    top = max(top, live)
                assert int(sched.in_flight(p, m, 2, s)) == top, (name, p, m, s)
    assert int(get(Schedule.ZBV).in_flight(4, 8, 2, 3)) == 8 and int(get(Schedule.DUALPIPEV).in_flight(4, 8, 2, 3)) == 9


@pytest.mark.parametrize("name", [Schedule.ZBV, Schedule.DUALPIPEV])
def test_v_shaped_bubble_with_equal_f_b_w(name):
    """F = B = W = 1 per stage and micro-batch (1/2 per chunk), no p2p: each rank idles
    (p - 1) / 2 (its first forward waits for that many chunk forwards), bubble (p - 1) / (6m),
    the schedule's ``bubble``; 1F1B's is (p - 1) / m. Unequal times have no closed form (NaN)."""
    sched = get(name)
    for p, m in ((2, 4), (4, 8), (4, 16), (8, 16)):
        r = simulate(PipelineSpec(name, p=p, m=m, v=2, forward_s=1, backward_s=1, weight_s=1))
        assert r.step_s == 3 * m + (p - 1) / 2
        assert r.bubble == pytest.approx(sched.bubble(p, m, 2, 1, 1, 1)) == pytest.approx((p - 1) / (6 * m))
    assert sched.bubble(4, 8, 2, 1, 2, 0) != sched.bubble(4, 8, 2, 1, 2, 0)  # NaN


def test_v_shaped_feasibility():
    assert get("zbv").reasons(4, 8, 1) == ["ZB-V needs virtual_stages = 2 (two chunks per rank, a V), got 1"]
    assert get("dualpipev").reasons(4, 7, 2) == ["DualPipeV needs micro-batches (7) >= 2 pp (8) (torch ScheduleDualPipeV)"]
    assert get("dualpipev").reasons(4, 8, 2) == [] and get("zbv").reasons(4, 3, 2) == []
    with pytest.raises(ConfigError, match="DualPipeV needs micro-batches"):
        PipelineSpec("dualpipev", p=4, m=6, v=2)
