"""Pipeline schedule names as users of torch.distributed.pipelining, torchtitan and Megatron-LM
type them (newcomer trial 12, item 1: ``--schedule 1F1B`` was refused while torchtitan's
reader took the same name): ``mesh.pp_schedule``, ``step --schedule`` and
``search.pp_schedules`` accept the same spellings, and refuse any other with the same one line
listing the accepted names."""

import copy

import pytest

from meshplan.cli import main
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.spec.mesh import LOOPED_BFS_REFUSAL, MeshSpec, Schedule, parse_schedule
from meshplan.spec.search import SearchOptions

#: torch's get_schedule_class keys (torch/distributed/pipelining/schedules.py) and the class
#: names, with the schedule meshplan plans for each (InterleavedZeroBubble is torch's ZB1P,
#: meshplan's zb_h1: see meshplan/pipeline/zb_h1.py).
TORCH = [("GPipe", Schedule.GPIPE), ("1F1B", Schedule.ONE_F_ONE_B), ("Interleaved1F1B", Schedule.INTERLEAVED_1F1B),
         ("InterleavedZeroBubble", Schedule.ZB_H1), ("ZBVZeroBubble", Schedule.ZBV), ("DualPipeV", Schedule.DUALPIPEV),
         ("ScheduleInterleaved1F1B", Schedule.INTERLEAVED_1F1B), ("interleaved1f1b", Schedule.INTERLEAVED_1F1B)]
#: Megatron-LM's words (schedules.py function names; Narayanan et al. SC21 2.2.1) and the
#: zero-bubble paper's (Qi et al. 2023).
OTHERS = [("PipeDream-Flush", Schedule.ONE_F_ONE_B), ("interleaved", Schedule.INTERLEAVED_1F1B),
          ("forward_backward_pipelining_with_interleaving", Schedule.INTERLEAVED_1F1B),
          ("forward_backward_pipelining_without_interleaving", Schedule.ONE_F_ONE_B),
          ("ZB-H1", Schedule.ZB_H1), ("ZB-V", Schedule.ZBV), ("interleaved-1f1b", Schedule.INTERLEAVED_1F1B)]
ACCEPTED = ("use gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev, or torch.distributed.pipelining's GPipe, 1F1B, "
            "Interleaved1F1B, InterleavedZeroBubble (= zb_h1, one stage per rank), ZBVZeroBubble, DualPipeV (any case)")

PP2 = {"model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
       "training": {"global_batch": 64, "seq_len": 8192, "micro_batch": 1, "sharding": "zero3",
                    "recompute": "full"},
       "mesh": {"names": ["pp", "dp_shard", "tp"], "shape": [2, 2, 2], "sequence_parallel": True}}


@pytest.mark.parametrize("name,schedule", TORCH + OTHERS)
def test_every_spelling_parses_to_its_schedule(name, schedule):
    assert parse_schedule(name) is schedule
    assert MeshSpec(names=["pp"], shape=[2], pp_schedule=name).pp_schedule is schedule
    assert MeshSpec(names=["pp"], shape=[2], pp_schedule=name).model_dump()["pp_schedule"] == schedule.value


@pytest.mark.parametrize("name", ["dualpipe", "zb_h2", "PipelineScheduleMulti", "1f1b2", "schedule"])
def test_other_names_are_one_line_errors_listing_the_accepted_ones(name):
    with pytest.raises(ValueError) as e:
        parse_schedule(name)
    assert str(e.value) == f"unknown schedule {name!r}; {ACCEPTED}"
    d = copy.deepcopy(PP2)
    d["mesh"]["pp_schedule"] = name
    with pytest.raises(ConfigError) as c:
        config_from_dict(d)
    assert (c.value.field, c.value.message) == ("mesh.pp_schedule", str(e.value))


def test_a_name_that_is_not_a_string_is_refused():
    d = copy.deepcopy(PP2)
    d["mesh"]["pp_schedule"] = 3
    with pytest.raises(ConfigError) as c:
        config_from_dict(d)
    assert c.value.field == "mesh.pp_schedule"
    assert c.value.message == f"give a schedule's name as a string (got 3); {ACCEPTED}"


def _step(tmp_path, capsys, *args, schedule=None):
    lines = ['[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
             'global_batch = 64\nseq_len = 8192\nmicro_batch = 1\nsharding = "zero3"\nrecompute = "full"\n[mesh]\n'
             'names = ["pp", "dp_shard", "tp"]\nshape = [2, 2, 2]\nsequence_parallel = true\n']
    if schedule is not None:
        lines.append(f'pp_schedule = "{schedule}"\n')
    p = tmp_path / f"pp2_{schedule}.toml"
    p.write_text("".join(lines))
    try:
        main(["step", str(p), *args])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_option_and_the_field_take_torchs_names_with_the_same_result(tmp_path, capsys):
    """``--schedule 1F1B``, ``--schedule 1f1b`` and ``pp_schedule = "1F1B"`` print the same step
    (1F1B's), and ``InterleavedZeroBubble`` the one of ``zb_h1``, not 1F1B's. Under this config's eager
    full AC ZB-H1's is the longer: each W replays its checkpointed layer's forward once per parameter
    group (9 for a Llama layer, meshplan.memory.wlag.weight_groups, measured on torch 2.13), 32
    micro-batches (64 / dp_shard 2) x 16 layers a stage x 9 replays of a forward whose GEMMs alone are
    2 x 8192 tokens x 109.05e6 weights (Llama-3-8B's 218.1e6 a layer / tp 2) = 1.787e12 FLOP, 1.81 ms
    at the H100's 989.4 TFLOP/s peak: more than 8.3 s. (The step has ZB-H1 at 27.42 s against 1F1B's
    9.94 s: its forward is 3.84 ms with SDPA, eager elementwise ops and the GEMMs' efficiency, 17.69 s of
    replays; before they were timed the split backward's bubble fill made ZB-H1 the shorter, 9.84 s.)"""
    code, canonical, _ = _step(tmp_path, capsys, "--schedule", "1f1b")
    assert code == 0 and canonical.startswith("step ") and "(1f1b, p 2, m 32, v 1)" in canonical.splitlines()[0]
    assert _step(tmp_path, capsys, "--schedule", "1F1B")[:2] == (0, canonical)
    assert _step(tmp_path, capsys, schedule="1F1B")[:2] == (0, canonical)
    code, zb, _ = _step(tmp_path, capsys, "--schedule", "InterleavedZeroBubble")
    assert code == 0 and "(zb_h1, p 2, m 32, v 1)" in zb.splitlines()[0]
    assert _step(tmp_path, capsys, schedule="ZB-H1")[:2] == (0, zb)
    step = [float(t.splitlines()[0].split()[1]) for t in (zb, canonical)]  # ms
    gemm_floor_s = 2 * 8192 * 109.05e6 / 989.4e12
    assert round(gemm_floor_s * 1e3, 2) == 1.81
    assert (step[0] - step[1]) / 1e3 > 32 * 16 * 9 * gemm_floor_s


def test_the_option_refuses_as_the_field_does(tmp_path, capsys):
    code, out, err = _step(tmp_path, capsys, "--schedule", "dualpipe")
    assert (code, out) == (2, "")
    assert err == f"error: --schedule: unknown schedule 'dualpipe'; {ACCEPTED}\n"
    # torch's ScheduleLoopedBFS: known, refused with why (nc56 #5; tests/test_looped_bfs_refused.py)
    code, out, err = _step(tmp_path, capsys, "--schedule", "LoopedBFS")
    assert (code, out, err) == (2, "", f"error: --schedule: {LOOPED_BFS_REFUSAL}\n")


def test_search_schedules_take_the_same_spellings():
    assert SearchOptions(pp_schedules=["1F1B", "ZBVZeroBubble", "DualPipeV"]).pp_schedules == ["1f1b", "zbv",
                                                                                               "dualpipev"]
    # torch's InterleavedZeroBubble is searched as zb_h1 (one stage per rank; nc56 #3)
    assert SearchOptions(pp_schedules=["InterleavedZeroBubble"]).pp_schedules == ["zb_h1"]
    with pytest.raises(ValueError, match=r"'Interleaved1F1B': the search plans interleaved 1F1B as 1f1b on "
                                         r"candidates with vpp > 1 \(\[search\] vpp\); write \"1f1b\""):
        SearchOptions(pp_schedules=["Interleaved1F1B"])
    with pytest.raises(ValueError, match=r"'GPipe' \(gpipe\) is not searched; the search plans 1f1b, zbv, "
                                         r"dualpipev and zb_h1"):
        SearchOptions(pp_schedules=["GPipe"])
    with pytest.raises(ValueError, match=r"LoopedBFS \(torch ScheduleLoopedBFS\) is not planned by meshplan"):
        SearchOptions(pp_schedules=["LoopedBFS"])
