"""Findings of newcomer trial 24 (wording): each test failed before its fix.

#1: a torchtitan job TOML with ``fsdp_reshard_after_forward`` unset or ``"default"`` under pp was
imported as an explicit ``reshard_after_forward = false``, so the plan never said that the value
was torchtitan's per-pp default (``"default"`` is ``not pp_enabled``, torchtitan b5bcd76
distributed/fsdp.py:124-133). It is now left unset (``TrainingSpec.reshard_default`` resolves it
per mesh), ``"always"`` -> true, ``"never"`` -> false.
"""

from __future__ import annotations

import pytest

from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.interop.roundtrip import differences
from tests.cli_run import run_main

#: Llama-3-70B, pp 4 (Interleaved1F1B, 2 stages per rank), FSDP over the rest, TP 8: the trial's job.
TT70 = """\
[model]
name = "llama3"
flavor = "70B"
[training]
local_batch_size = 8
seq_len = 8192
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 8
pipeline_parallel_degree = 4
pipeline_parallel_schedule = "Interleaved1F1B"
"""
H100_32 = ImportOptions(cluster="dgx-h100", nodes=32)


def _job(tmp_path, policy):
    f = tmp_path / "tt.toml"
    f.write_text(TT70 + (f'fsdp_reshard_after_forward = "{policy}"\n' if policy else ""))
    return f


@pytest.mark.parametrize("policy, given, at_pp4, at_pp1", [
    (None, False, False, True), ("default", False, False, True),  # not pp_enabled, per mesh
    ("always", True, True, True), ("never", True, False, False)])
def test_torchtitan_reshard_default_left_unset(tmp_path, policy, given, at_pp4, at_pp1):
    t = load_any(_job(tmp_path, policy), opts=H100_32).training
    assert ("reshard_after_forward" in t.model_fields_set) == given
    assert (t.at_pp(4).reshard_after_forward, t.at_pp(1).reshard_after_forward) == (at_pp4, at_pp1)


def test_torchtitan_reshard_default_note_and_round_trip(tmp_path, capsys):
    job = _job(tmp_path, "default")
    assert run_main("plan", job, "--cluster", "dgx-h100", "--nodes", "32") == 0
    out = capsys.readouterr().out
    assert ('note: parallelism.fsdp_reshard_after_forward = "default": planned false under pp 4 ("default" is '
            'not pp_enabled: torchtitan b5bcd76 distributed/fsdp.py:124-133), each chunk\'s parameters kept '
            'gathered from its forward to its backward') in out
    back = tmp_path / "back.toml"
    assert run_main("export", job, "--to", "torchtitan", "--cluster", "dgx-h100", "--nodes", "32", "-o", back) == 0
    assert 'fsdp_reshard_after_forward = "default"' in back.read_text()
    assert differences(load_any(job, opts=H100_32), load_any(back, opts=H100_32)) == []
