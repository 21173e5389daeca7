"""DeepEP's buffers in the memory model (``training.moe_dispatcher = "deepep"``): the bytes one rank's
``deep_ep.Buffer`` allocates, as Megatron-LM's ``fused_a2a.get_buffer`` (NVIDIA/Megatron-LM d98e8a6)
sizes it from DeepEP's size hints (deepseek-ai/DeepEP 92fe2de ``csrc/config.hpp`` lines 52-100, the
configs of ``deep_ep/buffer.py`` lines 245-287), derived here by hand at the DeepSeek-V3 example."""

from __future__ import annotations


import numpy as np

from meshplan.config import load_config
from meshplan.memory import sizes
from meshplan.memory.deepep_buffers import buffer_bytes, hidden_bytes
from meshplan.memory.timeline import memory_timeline
from meshplan.plan import build_plan
from tests.configs import example_toml

NAME = "deepseek-v3_2048xh100_pp16-ep64-dp128.toml"
MiB = 2**20


def _by_hand_ep64() -> tuple[int, int, int]:
    """(NVL, RDMA, total) at ep 64, h 7168 bf16: 10 channels (20 SMs / 2), 8 NVLink ranks, 8 RDMA ranks;
    dispatch (32, 288, 8, 128) and combine (1, 288, 8, 128) chunk tokens, so both hints agree."""
    h = 7168 * 2
    token = h + 8 + 128 * 8 + 128 * 4 + 128 * 4  # hidden, SourceMeta, top-k idx (int64) and weights, scales
    nvl = 10 * 8 * (2 * 8 + 3) * 4 + 10 * 8 * 288 * token
    nvl = -(-nvl // 128) * 128
    rdma = 10 * 8 * (8 * 2 + 2) * 2 * 4 + 10 * 8 * 128 * (token + 16) * 2
    rdma = -(-rdma // 128) * 128
    return nvl, rdma, nvl + rdma + 8 * (4 + 8 + 8) + 32 * MiB


def test_deepseek_v3_ep64_buffer_by_hand():
    nvl, rdma, total = _by_hand_ep64()
    assert (nvl, rdma, total) == (377_677_824, 336_047_360, 747_279_776)
    b = buffer_bytes(hidden_bytes(7168, 2), 64)
    assert (b.nvl_bytes, b.rdma_bytes, b.total_bytes) == (nvl, rdma, total)


def test_inside_one_node_no_rdma_and_unknown_sizes_have_no_config():
    # 8 ranks: one RDMA rank, get_rdma_buffer_size_hint returns 0; NVL 10 x 8 x 5 x 4 + 10 x 8 x 256 tokens
    token = 14336 + 8 + 1024 + 512 + 512
    b = buffer_bytes(14336, 8)
    assert (b.nvl_bytes, b.rdma_bytes) == (-(-(1600 + 20480 * token) // 128) * 128, 0)
    assert buffer_bytes(14336, 12) is None and buffer_bytes(14336, 256) is None


def test_rdma_chunk_tokens_round_up_to_the_sent_chunk():
    # 16 ranks: dispatch sends 20-token chunks, so Config rounds its 128 RDMA chunk tokens up to 140
    # (combine: 12 -> 132); the larger hint is the dispatch's
    token = 14336 + 8 + 1024 + 512 + 512 + 16
    rdma = 10 * 2 * 18 * 8 + 2 * 10 * 2 * 140 * token
    assert buffer_bytes(14336, 16).rdma_bytes == -(-rdma // 128) * 128 == 91_887_744


def _peaks(tmp_path, monkeypatch, without: bool) -> dict[int, tuple[int, int]]:
    if without:
        monkeypatch.setattr(sizes, "rank_buffer", lambda *a, **k: None)
    f = tmp_path / "c.toml"
    f.write_text(example_toml(NAME, moe_dispatcher="deepep"))
    p = build_plan(load_config(f))
    out = {}
    for k in (0, 1, 15):
        pk = memory_timeline(p, k).peak
        out[k] = (pk.total_bytes, pk.by_kind["comm_buffers"])
    return out


def test_the_example_peak_moves_by_exactly_the_buffer(tmp_path, monkeypatch):
    with_buf = _peaks(tmp_path, monkeypatch, False)
    without = _peaks(tmp_path, monkeypatch, True)
    _, _, total = _by_hand_ep64()
    # stage 0 holds the three dense layers only: it never dispatches, so it never creates a Buffer
    assert with_buf[0] == without[0]
    for k in (1, 15):
        assert with_buf[k][0] - without[k][0] == total
        assert with_buf[k][1] - without[k][1] == total
    # stage 1's peak, 22,724,070,816 B with the buffer: before it, 21,976,791,040 B
    assert with_buf[1][0] == 22_724_070_816 and without[1][0] == 21_976_791_040


def test_only_deepep_allocates_the_buffer_in_init(tmp_path):
    def init_labels(dispatcher):
        f = tmp_path / f"{dispatcher}.toml"
        f.write_text(example_toml(NAME, moe_dispatcher=dispatcher))
        return [e[3] for e in memory_timeline(build_plan(load_config(f)), 1).templates[0]]
    assert sum("DeepEP buffer over ep x etp 64" in w for w in init_labels("deepep")) == 1
    assert not any("DeepEP" in w for w in init_labels("alltoall"))


def test_search_memory_bounds_hold_with_the_buffer():
    """The search's memory bounds count the buffer on the MoE stages
    (:func:`meshplan.search.memory.deepep_bytes`): on a small MoE on one node (every ep x etp group
    of 2, 4 or 8 ranks has a DeepEP config) no exact peak exceeds the upper bound; without the term
    207 of the rows did. The lower bound is at or under the exact peak on every row (buffer or not), no margin:
    under framework megatron 60 rows' lower bound was above it, with the alltoall dispatcher too,
    until the search counted the experts' communicator only where the plan keeps them apart
    (cd98ab97, :func:`meshplan.mesh.tpsplit.experts_apart_degrees`)."""
    from tests.test_search import MOE, config, plan_all
    from meshplan.search.driver import search

    cfg = config(1, 2.0, model=MOE, training={"framework": "megatron", "moe_dispatcher": "deepep"},
                 micro_batch=[1, 2], recompute=["selective"], top=5)
    r = search(cfg, workers=1)
    plans = plan_all(cfg, r)
    m, c = cfg.search.memory_margin, r.candidates
    checked = 0
    for i, (_, _, peak, _) in enumerate(plans):
        if peak is not None and np.isfinite(r.est.peak_lo[i]):
            assert r.est.peak_lo[i] <= peak, (c.label(i), r.est.peak_lo[i], peak)
        if peak is not None and np.isfinite(r.est.peak_hi[i]) and c.ep[i] * c.etp[i] > 1:
            assert peak <= r.est.peak_hi[i] * (1 + m), c.label(i)
            checked += 1
    assert checked > 100
