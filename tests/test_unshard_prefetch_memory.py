"""The memory timeline holds each chunk's unsharded parameters from torch's UNSHARD (a prefetch up
to 2 distinct chunks ahead of the op that needs it) to its RESHARD, as torch 2.13's lowered
action list does (:func:`meshplan.pipeline.unshard_window.unsharded`, read by the memory timeline,
the step timeline and the search's memory bound).

The oracle is torch's own lowering: ``_add_unshard_reshard`` (torch/distributed/pipelining/
schedules.py) on the compute actions ``ScheduleInterleaved1F1B`` builds (``pipeline_order``, on
fake stages as tests/test_schedule_registry.py builds them, no process group).
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.distributed.pipelining import schedules as S

from meshplan.config import load_config
from meshplan.memory.passes import KINDS
from meshplan.pipeline.registry import get
from meshplan.pipeline.unshard_window import held_after, held_spans, unshards_before, unsharded
from meshplan.plan import build_plan
from tests.configs import job_toml
from tests.test_schedule_registry import FakeStage

#: local chunks of p 2, m 2, v 4, rank 0 (F0.c0 F1.c0 F0.c1 ... B1.c0)
ORDER = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3, 2, 2, 1, 1, 0, 0]


def torch_lowered(p: int, m: int, v: int, rank: int) -> tuple[list[tuple[str, int]], list[int]]:
    """(torch's lowered actions of ``rank`` as (kind, local chunk), kind ``U``, ``R`` or ``C``
    (compute), and the compute ops' local chunks): ``_add_unshard_reshard`` of its compute
    actions. None when torch refuses (m, p) (its rounds must divide the micro-batches)."""
    sched = get("interleaved_1f1b")
    stages = [FakeStage(sched.virtual_stage(c, rank, p, v), p * v, p, rank, []) for c in range(v)]
    chunk_of = {st.stage_index: c for c, st in enumerate(stages)}
    run = S.ScheduleInterleaved1F1B(stages, m)
    kind = {S.UNSHARD: "U", S.RESHARD: "R"}
    actions = [(kind.get(a.computation_type, "C"), chunk_of[a.stage_index])
               for a in S._add_unshard_reshard(run.pipeline_order[rank])]
    return actions, [c for k, c in actions if k == "C"]


def rule_lowered(ops: list[int]) -> list[tuple[str, int]]:
    """meshplan's rule as the same action list: before op ``k`` the RESHARDs of the spans ending
    at op ``k - 1`` and the UNSHARDs issued before op ``k`` (:func:`held_spans`), then the op; after
    the last op the RESHARDs of the spans ending there."""
    spans = held_spans(ops)
    out: list[tuple[str, int]] = []
    for k, c in enumerate(ops):
        out += [("R", ops[b]) for _, b, a in spans if a == k - 1]
        out += [("U", ops[b]) for i, b, _ in spans if i == k]
        out.append(("C", c))
    return out + [("R", ops[b]) for _, b, a in spans if a == len(ops) - 1]


def counts(actions: list[tuple[str, int]]) -> list[int]:
    """Unsharded chunks after each UNSHARD / RESHARD action (UNSHARD adds one, RESHARD removes one)."""
    out, n = [], 0
    for kind, _ in actions:
        if kind != "C":
            n += 1 if kind == "U" else -1
            out.append(n)
    return out


def _active_per_op(actions: list[tuple[str, int]]) -> list[set]:
    """The chunks torch holds UNSHARDed while each compute action runs."""
    active: set = set()
    out = []
    for kind, c in actions:
        if kind == "U":
            active = active | {c}
        elif kind == "R":
            active = active - {c}
        else:
            out.append(set(active))
    return out


def test_counts_after_each_action_are_torchs():
    """p 2..4, m 4..8 (those torch builds: its rounds must divide m, so p 2 m 5 and 7 and p 3 m 7
    are refused: 12 of 15), v 4..6, every rank (12 x 3 x ranks = 99 orders): after each UNSHARD /
    RESHARD torch's lowering inserts, the chunks meshplan's rule holds number torch's; during each
    compute op they are the same chunks (:func:`unsharded`'s column)."""
    checked = 0
    for p in (2, 3, 4):
        for m in range(4, 9):
            for v in (4, 5, 6):
                for r in range(p):
                    try:
                        actions, ops = torch_lowered(p, m, v, r)
                    except ValueError as e:
                        assert "multiple" in str(e) and (p, m) in ((2, 5), (2, 7), (3, 7)), (p, m, e)
                        continue
                    assert counts(rule_lowered(ops)) == counts(actions), (p, m, v, r)
                    held = unsharded(ops)
                    assert [set(np.flatnonzero(held[:, k]).tolist()) for k in range(len(ops))] == \
                        _active_per_op(actions), (p, m, v, r)
                    assert not held[:, len(ops)].any()  # all RESHARDed after the last op
                    checked += 1
    assert checked == 3 * (3 * 2 + 4 * 3 + 5 * 4)  # v x (p 2: 3 m x 2 ranks, p 3: 4 m x 3, p 4: 5 m x 4)


def test_hand_derived_p2_m2_v4():
    """Interleaved 1F1B, p 2, m 2, v 4, rank 0: ops F0.c0 F1.c0 F0.c1 F1.c1 F0.c2 F1.c2 F0.c3
    F1.c3 B0.c3 B1.c3 B0.c2 B1.c2 B0.c1 B1.c1 B0.c0 B1.c0 (local chunks :data:`ORDER`). Before
    each op torch holds the first 3 distinct chunks from it on:
    - op 0: {0, 1, 2}: UNSHARD 0, 1, 2 (counts 1, 2, 3);
    - op 2: {1, 2, 3}: RESHARD 0 (2), UNSHARD 3 (3), 3 only ahead of ops 2-5 (chunks 1 and 2);
    - op 10 (B0.c2): {2, 1, 0}, op 9 had {3, 2, 1}: RESHARD 3 (2), UNSHARD 0 (3): chunk 0's
      all-gathers 4 ops ahead of B0.c0 (op 14), past 2 distinct chunks (2 and 1);
    - op 12: {1, 0}: RESHARD 2 (2); op 14: {0}: RESHARD 1 (1); after op 15: RESHARD 0 (0).
    Held right after op i (active at i and at i + 1): op 1: {1, 2} = 2; op 8: {3, 2, 1} = 3;
    op 10: {2, 1, 0} = 3 (chunk 0 prefetched: without it 2)."""
    assert [u.chunk for u in get("interleaved_1f1b").order(2, 2, 4, 0)] == ORDER
    want = [1, 2, 3, 2, 3, 2, 3, 2, 1, 0]
    assert counts(rule_lowered(ORDER)) == want == counts(torch_lowered(2, 2, 4, 0)[0])
    assert held_spans(ORDER) == [(0, 0, 1), (0, 2, 13), (0, 4, 11), (2, 6, 9), (10, 14, 15)]
    assert unshards_before(ORDER)[0] == (0, 1, 2) and unshards_before(ORDER)[10] == (0,)
    assert [held_after(ORDER, i) for i in (1, 8, 10)] == [2, 3, 3]


#: Llama-3-8B (catalog): one layer's parameters, 4096 x (4096 + 2 x 1024 + 4096) (q, k, v, o with
#: 8 KV heads of 128) + 3 x 4096 x 14,336 (MLP) + 2 x 4096 (norms) = 218,112,000; bf16 2 B each
LAYER_BYTES = 2 * (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096)
#: its embedding, 128,256 x 4096 in bf16
EMBEDDING_BYTES = 2 * 128256 * 4096


@pytest.fixture(scope="module")
def p2_v4_plan(tmp_path_factory):
    """Llama-3-8B on 8 H100, pp 2 x dp_shard 4, interleaved 1F1B at vpp 4 (32 layers: 4 a
    chunk), 8 sequences: m = 8 / dp 4 = 2 micro-batches, zero3 kept gathered from forward to
    backward (meshplan's default under pp)."""
    path = tmp_path_factory.mktemp("prefetch") / "job.toml"
    path.write_text(job_toml(training={"global_batch": 8, "seq_len": 2048, "micro_batch": 1, "sharding": "zero3"},
                             mesh={"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": "interleaved_1f1b",
                                   "virtual_stages": 4}), encoding="utf-8")
    return build_plan(load_config(path))


def test_timeline_holds_each_chunk_from_its_unshard(p2_v4_plan):
    """Stage 0 of :func:`p2_v4_plan` (its order is :data:`ORDER`): gathered parameters at the end
    of each op's pass, by hand from :func:`test_hand_derived_p2_m2_v4`'s windows, with L =
    218,112,000 x 2 B = 436,224,000 B a layer, a chunk 4 L = 1,744,896,000 B, E = 128,256 x 4096
    x 2 B = 1,050,673,152 B chunk 0's embedding unit:
    - op 0: chunks 0, 1, 2 (0 copied out, 1 and 2 as all-gather outputs) + E = 12 L + E = 6,285,361,152;
    - op 1: chunk 0 RESHARDed before op 2: 8 L = 3,489,792,000;
    - ops 2-8: chunk 3 UNSHARDed before op 2: 12 L = 5,234,688,000;
    - op 9 (chunk 3's last backward: its reduce reshards it): 8 L = 3,489,792,000;
    - op 10: chunk 0 UNSHARDed before it: 12 L + E = 6,285,361,152 (before prefetchmem the
      timeline gathered chunk 0 at op 14 only: 3,489,792,000 here);
    - ops 11, 12: chunk 2 done: 8 L + E = 4,540,465,152; ops 13, 14: chunk 1 done: 4 L + E =
      2,795,569,152; op 15: nothing.
    And on both stages, after every op: the layers held are :func:`held_after`'s chunks x 4 L."""
    L, E = LAYER_BYTES, EMBEDDING_BYTES
    assert (L, E) == (436_224_000, 1_050_673_152)
    want = [12 * L + E, 8 * L] + [12 * L] * 7 + [8 * L, 12 * L + E] + [8 * L + E] * 2 + [4 * L + E] * 2 + [0]
    assert want[:2] == [6_285_361_152, 3_489_792_000] and want[11] == 4_540_465_152 and want[13] == 2_795_569_152
    k = KINDS.index("gathered_params")
    for stage, tl in enumerate(p2_v4_plan.timelines):
        run = tl.running()
        ops = [p for p in tl.passes if p.phase in ("forward", "backward")]
        chunks = [p.chunk for p in ops]
        ends = [p.first_event + len(tl.templates[p.template]) - 1 for p in ops]
        layers = [sum(e.delta_bytes for e in tl.events() if e.kind == "gathered_params" and e.layer is not None
                      and e.t_index <= t) for t in ends]
        assert layers == [held_after(chunks, i) * 4 * L for i in range(len(ops))], stage
        if stage == 0:
            assert chunks == ORDER
            assert [int(run[t, k]) for t in ends] == want
