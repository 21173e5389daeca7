"""Per-rank traffic figures are the stage whose ranks send the most, named (a newcomer's finding:
``compare`` of DeepSeek-V3 at pp 16, ep 8 against ep 16, printed stage 0's network and NVLink
bytes for both, the same figure, while stage 0 holds only the dense layers and sends no ep
all-to-all). The home: :mod:`meshplan.schedule.stage_traffic`.

The model here, by hand: DeepSeek-V2-Lite's shapes (hidden 2048, 16 heads of MLA: q 2048 x
3072, kv_a 2048 x 576 and its norm 512, kv_b 512 x 4096, o 2048 x 2048; vocab 102,400; 64
routed experts of width 512, top 6, no shared expert) on 2 layers, the first dense (ffn 10,944),
pp 2 (stage 0: embedding + the dense layer; stage 1: the MoE layer + the output layer) x
dp_shard 16 on 4 dgx-h100 (each stage on 2 nodes of 8), ep 16 (across stage 1's 2 nodes) or ep 8
(inside a node). zero1 under Megatron-LM, micro-batch 1 x seq 4,096, global batch 64: 4
micro-batches, no recompute.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshplan.config import config_from_dict
from meshplan.plan import build_plan
from meshplan.report.json_docs import schema_of
from meshplan.schedule.stage_traffic import busiest_stage, stage_link_bytes, traffic_stage
from tests.cli_run import run_main

MB = 4  # micro-batches per step: 64 / (dp_shard 16 x micro_batch 1)
ACT = 4096 * 2048 * 2  # one micro-batch's activations, bf16: a pp send
A2A = 4096 * 6 * 2048 * 2  # an ep all-to-all buffer S: tokens x top_k x hidden, bf16
ATTN = 2048 * 3072 + 2048 * 576 + 512 + 512 * 4096 + 2048 * 2048 + 2 * 2048  # MLA + its layer's 2 norms
P0 = 102400 * 2048 + ATTN + 3 * 2048 * 10944  # stage 0: embedding, the dense layer
P1 = ATTN + 64 * 2048 + 2048 + 2048 * 102400  # stage 1: the MoE layer's attention, router, final norm, head
# zero1 over dp_shard 16 on 2 nodes, ring: a rank sends 15/16 S, 1/8 of it through the NIC
# (reduce-scatter of fp32 gradients, all-gather of bf16 parameters); pp: 4 sends each way, S each
DP = {0: 15 / 16 / 8 * (4 + 2) * P0, 1: 15 / 16 / 8 * (4 + 2) * P1}
PP = 2 * MB * ACT
# ep 16 over 2 nodes: each all-to-all sends 8 of its 16 slices S/16 off the node; 2 forward and 2
# backward per MoE layer per micro-batch; the dropless counts' all-gather (16 ranks x 64 experts,
# int64, 8,192 B) hierarchical: 1/2 of S/8 across, once per forward all-to-all pair (4 calls)
EP16 = 4 * MB * A2A * 8 / 16 + MB * (16 * 64 * 8) / 8 / 2
# ep 8: the all-to-alls stay inside a node; the experts' gradients go over efsdp 2 = 16 / 8 (one
# rank per node): 8 experts x 3 x 2048 x 512 parameters, ring of 2 sends S/2 (fp32 + bf16)
EFSDP8 = (4 + 2) * 8 * 3 * 2048 * 512 / 2


def small_moe(ep: int) -> dict:
    return {"model": {"catalog": "deepseek-v2-lite", "layers": 2, "dense_layers": 1, "expert_ffn": 512,
                      "shared_experts": 0},
            "cluster": {"system": "dgx-h100", "nodes": 4},
            "training": {"global_batch": 64, "seq_len": 4096, "micro_batch": 1, "sharding": "zero1",
                         "recompute": "none", "framework": "megatron"},
            "mesh": {"names": ["pp", "dp_shard", "ep"], "shape": [2, 16, ep]}}


def _toml(d: dict) -> str:
    def v(x):
        return json.dumps(x) if not isinstance(x, bool) else str(x).lower()
    return "\n".join(f"[{t}]\n" + "\n".join(f"{k} = {v(x)}" for k, x in body.items()) for t, body in d.items()) + "\n"


@pytest.fixture(scope="module")
def ep16():
    return build_plan(config_from_dict(small_moe(16)))


def test_each_stage_s_network_bytes_by_hand(ep16):
    """Stage 0: 204.4 MB of zero1 + 134.2 MB of pp = 338,631,848 B; stage 1: 1,096,755,784 B, of
    which 805.3 MB the ep all-to-alls; stage 1 is the stage shown."""
    assert (P0, P1) == (290722304, 223615488)
    per = stage_link_bytes(ep16)
    assert per[0]["network"] == pytest.approx(DP[0] + PP, rel=1e-12) == 338631848
    assert per[1]["network"] == pytest.approx(DP[1] + PP + EP16, rel=1e-12) == 1096755784
    assert traffic_stage(ep16) == 1 and busiest_stage(per, "network") == 1


def test_compare_prints_stage_1s_bytes_and_names_it(tmp_path, capsys):
    """compare ep 8 (A) against ep 16 (B): both sides' network figure is stage 1's (ep 8: zero1 +
    efsdp + pp = 366,944,840 B; ep 16: 1,096,755,784 B), not stage 0's 338,631,848 B, and the
    line, the table and --json name the stage."""
    for ep in (8, 16):
        (tmp_path / f"ep{ep}.toml").write_text(_toml(small_moe(ep)))
    doc_path = tmp_path / "c.json"
    assert run_main("compare", tmp_path / "ep8.toml", tmp_path / "ep16.toml", "--out", tmp_path / "cmp",
                    "--json", doc_path) in (0, 1)
    out = " ".join(capsys.readouterr().out.split())
    assert ("network bytes sent per rank per step (the stage whose ranks send the most): ep8 0.4 GB (stage 1), "
            "ep16 1.1 GB (stage 1)") in out
    doc = json.loads(doc_path.read_text())
    jsonschema.Draft202012Validator(schema_of("compare")).validate(doc)
    a, b = doc["a"], doc["b"]
    assert a["sent_bytes_per_step_by_link"]["network"] == pytest.approx(DP[1] + PP + EFSDP8, rel=1e-12) == 366944840
    assert b["sent_bytes_per_step_by_link"]["network"] == pytest.approx(DP[1] + PP + EP16, rel=1e-12)
    assert a["sent_bytes_stage_by_link"]["network"] == b["sent_bytes_stage_by_link"]["network"] == 1
    rows = {r[0]: r[1:] for r in doc["table"]}
    assert rows["network bytes sent per rank per step: stage (the stage whose ranks send the most)"] == [1, 1]


def test_step_shows_stage_1s_links_and_bytes(tmp_path, capsys):
    """step: stage 1's edge-load table follows stage 0's though every link fits, its header
    naming why; --json's ``sent_bytes_per_step`` is stage 1's (ep: 16 all-to-alls x 15/16 S +
    4 counts all-gathers x 15/16 x 8,192 B), ``sent_bytes_stage`` 1."""
    (tmp_path / "ep16.toml").write_text(_toml(small_moe(16)))
    assert run_main("step", tmp_path / "ep16.toml", "--json", tmp_path / "s.json") == 0
    out = capsys.readouterr().out
    assert "edge load per step on stage 0 (rank 0, node 0; stage 1's ranks send more: its table follows)" in out
    assert ("edge load per step on stage 1 (rank 16, node 2; the stage whose ranks send the most, 1.1 GB per rank "
            "per step over the network against stage 0's 0.3 GB)") in out
    doc = json.loads((tmp_path / "s.json").read_text())
    jsonschema.Draft202012Validator(schema_of("step")).validate(doc)
    assert doc["sent_bytes_stage"] == 1 and doc["other_stage_links"]["stage"] == 1
    assert doc["sent_bytes_per_step"]["ep"] == pytest.approx(4 * MB * A2A * 15 / 16 + MB * 8192 * 15 / 16, rel=1e-12)
