"""The step's TP hint with the TP overlap already on (newcomer trial 57 #8,
meshplan/schedule/tp_hint.py ``overlapped_hint``): torchtitan b5bcd76's Llama-3-70B
(tests/data/nc57b/llama3/config_registry.py.txt ``llama3_70b``, the trial's new_registry.py: pp 2
Interleaved1F1B x dp_shard 4 x tp 8 on 8 dgx-h100, float8, full AC, compile and async TP on), imported as
tests/data/nc57b/tt_70b_asynctp.toml. Its step printed neither a ``hint:`` nor a ``note: no tp hint``
although exposed tp is 21.8% of it. Each hinted step is compared with the same config edited by hand
and planned directly."""

from __future__ import annotations

import tomllib
from pathlib import Path

from meshplan.config import config_from_dict
from meshplan.memory.constraints import usable_bytes
from meshplan.plan import build_plan
from meshplan.schedule.steptime import step_time
from meshplan.schedule.tp_hint import remaining, tp_hint, tp_moves
from meshplan.schedule.verdict import rebuilt_step
from meshplan.units import GiB

TOML = Path(__file__).parent / "data" / "nc57b" / "tt_70b_asynctp.toml"


def _data(**training) -> dict:
    data = tomllib.loads(TOML.read_text())
    data["training"] |= training
    return data


def _plan(data: dict):
    return build_plan(config_from_dict(data))


def test_the_moves_halve_tp_onto_dp_shard():
    """tp 8 -> 4, 2, 1, the factor on dp_shard (4 -> 8, 16, 32): world 2 x 4 x 8 = 64 each time."""
    words = [w for w, _, _ in tp_moves(_plan(_data()))]
    assert words == ["mesh pp 2 x dp_shard 8 x tp 4", "mesh pp 2 x dp_shard 16 x tp 2", "mesh pp 2 x dp_shard 32"]


def test_async_tp_on_and_exposed_tp_over_the_share_gets_the_smaller_tp_re_planned():
    """The trial's parts line: exposed tp 8744.31 ms of a 40121.65 ms step = 21.8% >= 15%, with
    tp_comm_overlap on: no overlap knob is left, so the mesh is re-planned. The config edited by hand to
    pp 2 x dp_shard 8 x tp 4 (shape [2, -1, 4]) steps 34.89 s, 34.89 / 40.12 - 1 = -13.0% (> 1% shorter),
    its exposed tp 3.53 s (half the TP group, and its TP collectives on the same NVLink: about half as much
    to move a rank), peak 66.4 GiB under the 71.2 GiB usable (the H100's 79.11 GiB x 0.9): the hint. tp 2 peaks at
    83.8 GiB (the activations a rank grow as tp shrinks under sequence parallelism): not shown."""
    p = _plan(_data())
    st = step_time(p)
    assert (st.shown_ms()["exposed tp"], st.shown_ms()["step"]) == ("8744.31", "40121.65")
    tp4 = _data()
    tp4["mesh"]["shape"] = [2, -1, 4]
    by_hand = step_time(_plan(tp4))
    assert f"{by_hand.step_s:.2f} {by_hand.exposed_s['tp']:.2f}" == "34.89 3.53"
    line, = tp_hint(p, st, rebuilt_step(p, step_time))
    assert line == ("hint: exposed tp is 21.8% of the step (8.74 s of 40.12 s) with training.tp_comm_overlap already "
                    "on (torchtitan's async TP): shorter with mesh pp 2 x dp_shard 8 x tp 4 (step 34.89 s, "
                    f"{by_hand.step_s / st.step_s - 1:+.1%}, exposed tp 3.53 s, peak 66.4 GiB fits)")
    assert f"{by_hand.step_s / st.step_s - 1:+.1%}" == "-13.0%"
    assert line.hint.stream == "tp" and round(line.hint.share, 3) == 0.218


def test_when_no_smaller_tp_fits_the_note_names_what_stays_exposed():
    """With 25% of HBM reserved (79.11 x 0.75 = 59.3 GiB usable) tp 4's 66.4 GiB and tp 2's 83.8 GiB do
    not fit and tp 1 is slower (+22.4%, not clearly shorter: its memory not planned): a note with what async TP leaves
    exposed under torch (the unfused backward reduce-scatters, meshplan.compute.asynctp) and each outcome."""
    p = _plan(_data(memory_reserve=0.25))
    assert round(usable_bytes(p.config.cluster, p.config.training) / GiB, 1) == 59.3
    st = step_time(p)
    line, = tp_hint(p, st, rebuilt_step(p, step_time))
    assert line.startswith("note: no tp hint: exposed tp is 21.8% of the step (8.74 s of 40.12 s) with "
                           "training.tp_comm_overlap already on (torchtitan's async TP): " + remaining("torch", True))
    assert line.endswith("; none of a smaller tp re-planned fits with a step more than 1% shorter: mesh pp 2 x "
                         "dp_shard 8 x tp 4: peak 66.4 GiB, does not fit; mesh pp 2 x dp_shard 16 x tp 2: peak 83.8 GiB, "
                         "does not fit; mesh pp 2 x dp_shard 32: step 49.12 s (+22.4%), not 1% shorter (59.3 GiB usable "
                         "per GPU)")


def test_the_step_command_names_the_files_own_key(capsys):
    """Through the CLI on the registry itself, the hint line names the file's key for the overlap:
    b5bcd76's CompileConfig(enable_async_tensor_parallel=True), compile.enable_async_tensor_parallel."""
    from tests.cli_run import run_main
    code = run_main("step", TOML.parent / "llama3" / "config_registry.py.txt", "--config", "llama3_70b",
                    "--cluster", "dgx-h100", "--nodes", "8")
    out = capsys.readouterr().out
    assert code == 0
    assert ("hint: exposed tp is 21.8% of the step (8.74 s of 40.12 s) with compile.enable_async_tensor_parallel "
            "already on (torchtitan's async TP): shorter with mesh pp 2 x dp_shard 8 x tp 4") in out
