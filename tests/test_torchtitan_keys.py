"""torchtitan job TOML users' findings (ttkeys): torchtitan's ETP rule checked, errors and fix
lines on a torchtitan file in the file's own keys, and an MoE model read through
``model.hf_assets_path`` exported back.

The ETP rule is torchtitan's ``ParallelDims._validate`` from aeb3a4b (#1555) to e347b1e: with
ep > 1, etp must be 1 or tp (:data:`meshplan.spec.axes.ep.TORCH_ETP`). Mixtral-8x7B (8 experts,
expert width 14336) at dp_shard 8 x tp 4 (32 GPUs) with ep 4: etp 2 breaks it, etp 1 and 4 do
not (14336 / 4 = 3584, and 32 / (4 x 4) = 2 efsdp ranks: the other expert rules hold).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from cli_run import run_main as _main
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.torchtitan import read
from meshplan.plan import Infeasible, build_plan

HF = Path(__file__).parent / "data" / "hf"

ETP_REASON = ("framework torch: etp 2 with tp 4 and ep 4: torchtitan's ParallelDims asserts ETP == TP or ETP == 1 "
              "when ep > 1 (\"Currently we only support ETP=TP or ETP=1\"); fix: etp 1 or 4 in mesh.shape, or "
              "training.framework = \"megatron\"")


def _mixtral(etp: int, framework: str = "torch"):
    return config_from_dict({
        "model": {"catalog": "mixtral-8x7b"}, "cluster": {"system": "dgx-h100", "nodes": 4},
        "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "recompute": "full",
                     "framework": framework},
        "mesh": {"names": ["dp_shard", "tp", "ep", "etp"], "shape": [8, 4, 4, etp], "sequence_parallel": True}})


def test_torch_etp_rule_refuses_etp_neither_1_nor_tp():
    """etp 2 with tp 4 under torch: infeasible with the rule's reason; etp 1 and 4 (= tp) are
    not refused by it; framework megatron (whose expert tp is free) neither."""
    bad = build_plan(_mixtral(2), memory=False, reports=False)
    assert isinstance(bad, Infeasible) and ETP_REASON in bad.reasons
    for cfg in (_mixtral(1), _mixtral(4), _mixtral(2, "megatron")):
        p = build_plan(cfg, memory=False, reports=False)
        assert not any("torch_etp" in r or "ETP=TP" in r for r in getattr(p, "reasons", ())), p


TT_ETP = """\
[model]
name = "mixtral"
flavor = "8x7B"
hf_assets_path = "{hf}"
[training]
local_batch_size = 1
seq_len = 4096
[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 4
expert_parallel_degree = 4
expert_tensor_parallel_degree = {etp}
"""


@pytest.mark.parametrize("command", ["plan", "step", "search"])
def test_torchtitan_file_with_etp_neither_1_nor_tp_is_an_error(tmp_path, capsys, command):
    """The users' file (ep 4, etp 2, tp 4) exited 0 from ``meshplan step``; now every command
    reading it says in one line which key and what to set (exit 2), as torchtitan asserts."""
    job = tmp_path / "job.toml"
    job.write_text(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", etp=2))
    assert _main(command, job, "--cluster", "dgx-h100", "--nodes", 4) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: parallelism.expert_tensor_parallel_degree: 2 with tensor_parallel_degree 4 and "
                       "expert_parallel_degree 4: torchtitan's ParallelDims asserts ETP == TP or ETP == 1 when ep > 1 "
                       "(\"Currently we only support ETP=TP or ETP=1\"); fix: expert_tensor_parallel_degree = 1 or 4")


def test_torchtitan_file_with_etp_equal_tp_reads():
    """etp = tp is read as it is; etp 3 (neither) is the reader's error."""
    doc = tomllib.loads(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", etp=4))
    mesh = read(doc, Path("."), ImportOptions(cluster="dgx-h100", nodes=4)).tables["mesh"]
    assert dict(zip(mesh["names"], mesh["shape"])) == {"dp_shard": -1, "tp": 4, "ep": 4, "etp": 4}  # -1 kept
    with pytest.raises(ConfigError, match=r"^parallelism\.expert_tensor_parallel_degree: 3 "):
        read(tomllib.loads(TT_ETP.format(hf=HF / "mixtral-8x7b-v0.1", etp=3)), Path("."),
             ImportOptions(cluster="dgx-h100", nodes=4))
