"""Newcomer trial 48 (a torchtitan MoE user: DeepSeek-V3 16B / Qwen3-30B-A3B on 64 x 8 H100), findings
fixed on branch nc48fix2; each test failed before its fix. The trial's files: /work/nc48/mine (copies under
tests/data/nc48b/ where a test reads one)."""

from __future__ import annotations

from math import comb
from pathlib import Path

import pytest

from configs import job_toml
from cli_run import run_cli, step_json
from meshplan import catalog
from meshplan.compute.flops import torchtitan_flops_per_token
from meshplan.spec.model import ModelSpec

#: A small MoE + MLA model: hidden 64, 4 heads, q latent 16, kv latent 8, qk 6 + rope 2, v 4; layer 0
#: dense (SwiGLU ffn 128), layer 1 8 routed experts of width 32 (top 2) and one shared of width 32; vocab 100.
TINY = ModelSpec(layers=2, hidden=64, ffn=128, q_heads=4, vocab=100, q_lora_rank=16, kv_lora_rank=8,
                 qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=4, experts=8, top_k=2, expert_ffn=32,
                 shared_experts=1, shared_expert_ffn=32, dense_layers=1)


def test_torchtitan_moe_mla_flops_by_hand():
    """Finding 4 (Medium): step printed no torchtitan MFU for an MoE or MLA model ("meshplan prints
    nothing for a MoE job that can be set directly beside torchtitan's log"). torchtitan v0.2.2 (e347b1e)
    counts them with ``get_moe_model_nparams_and_flops`` (``torchtitan/models/utils.py``:434-498;
    deepseek_v3's ``get_nparams_and_flops``, ``models/deepseek_v3/model/args.py``:118-124, passes
    ``head_dims = qk_nope + qk_rope + v``): ``6 (N_dense - N_emb + router + shared + experts x top_k // E)
    + 6 l h head_dims t``.

    By hand: MLA wq_a 64 x 16 = 1,024, q norm 16, wq_b 16 x 4 x 8 = 512, wkv_a 64 x (8 + 2) = 640, kv norm
    8, wkv_b 8 x 4 x (6 + 4) = 320, wo 4 x 4 x 64 = 1,024: 3,544; two norms 128. Layer 0: + MLP 3 x 64 x 128
    = 24,576: 28,248. Layer 1: + router 64 x 8 = 512, experts 3 x 8 x 64 x 32 = 49,152, shared 3 x 64 x 32
    = 6,144: 59,480. Embedding and output 2 x 6,400, final norm 64: N = 100,592. Active non-embedding:
    100,592 - 6,400 - 49,152 + 49,152 x 2 // 8 (12,288) = 57,328. At t 16: 6 x 57,328 + 6 x 2 x 4 x
    (6 + 2 + 4) x 16 = 343,968 + 9,216 = 353,184."""
    assert TINY.param_count() == 100_592
    assert torchtitan_flops_per_token(TINY, 16) == 353_184


#: DeepSeek-V2-Lite's shape (torchtitan's deepseek_v3 16B flavor) at 2 layers: layer 0 dense, layer 1 MoE.
V2_LITE_2L = job_toml({"catalog": "deepseek-v2-lite", "layers": 2}, training={"global_batch": 8, "seq_len": 4096},
                      mesh={"names": ["dp_shard"], "shape": [8]})


def test_step_prints_torchtitan_mfu_for_deepseek_v3_16b_shape(tmp_path, capsys):
    """Finding 4: ``step`` and ``--json torchtitan_mfu`` for torchtitan's DeepSeek-V3 16B shape
    (DeepSeek-V2-Lite's: hidden 2048, 16 heads, no q latent, kv latent 512, qk 128 + 64, v 128; 64
    experts of 1408, top 6, 2 shared of 1408, layer 0 dense of 10944; vocab 102,400), 2 layers, t 4096.

    By hand: MLA wq 2048 x 16 x 192 = 6,291,456, wkv_a 2048 x 576 = 1,179,648, kv norm 512, wkv_b
    512 x 16 x 256 = 2,097,152, wo 16 x 128 x 2048 = 4,194,304: 13,763,072; norms 4,096. Layer 0 + MLP
    3 x 2048 x 10944 = 67,239,936: 81,007,104. Layer 1 + router 2048 x 64 = 131,072, experts 3 x 64 x
    2048 x 1408 = 553,648,128, shared 3 x 2048 x 2816 = 17,301,504: 584,847,872. Embedding, output
    2 x 209,715,200, final norm 2,048: N = 1,085,287,424. Active non-embedding 1,085,287,424 - 209,715,200
    - 553,648,128 + 553,648,128 x 6 // 64 (51,904,512) = 373,828,608. FLOP/token 6 x 373,828,608 + 6 x
    2 x 16 x 320 x 4096 = 2,242,971,648 + 251,658,240 = 2,494,629,888. tps = 8 x 4096 / (step x 8 GPUs);
    MFU = FLOP/token x tps / 989e12 (H100 SXM, get_peak_flops)."""
    fpt = 6 * (1_085_287_424 - 209_715_200 - 553_648_128 + 553_648_128 * 6 // 64) + 6 * 2 * 16 * 320 * 4096
    assert fpt == 2_494_629_888
    assert torchtitan_flops_per_token(catalog.model("deepseek-v2-lite").model_copy(update={"layers": 2}), 4096) == fpt
    doc, out = step_json(tmp_path, capsys, V2_LITE_2L, "v2lite")
    tps = 8 * 4096 / (doc["step_s"] * 8)
    want = fpt * tps / 989e12
    assert doc["torchtitan_mfu"] == pytest.approx(want, rel=1e-12)
    line = next(x for x in out.splitlines() if x.startswith("torchtitan's MFU formula: "))
    assert line.startswith(f"torchtitan's MFU formula: {want * 100:.2f}% ")
    assert "2,494,629,888 FLOP/token" in line and f"{tps:,.0f} tokens/s per GPU (its log's tps)" in line
    assert "top_k 6 / 64" in line


NC48 = Path(__file__).parent / "data" / "nc48b"
#: torchtitan's DeepSeek-V3 16B shape at 2 layers on one DGX H100, dp_shard 8 x ep 8 (ep borrowed from dp_shard).
V2_LITE_EP8 = job_toml({"catalog": "deepseek-v2-lite", "layers": 2},
                       training={"global_batch": 8, "seq_len": 4096, "moe_dispatcher": "deepep"},
                       mesh={"names": ["dp_shard", "ep"], "shape": [8, 8]})


def test_torch_runs_deepep_as_torchtitan_does(tmp_path, capsys):
    """Finding 2 (High): ``moe_dispatcher = "deepep"`` under framework torch errored "framework 'torch' has
    none", though torchtitan e347b1e (v0.2.2) runs DeepEP's same V1 normal kernels with
    ``expert_parallel_comm_backend = "deepep"`` (``torchtitan/distributed/deepep/deepep.py``: ``buffer.dispatch``
    / ``combine``, the Buffer sized as Megatron-LM's ``fused_a2a.get_buffer``). Now it plans DeepEP's dispatch
    (meshplan.comm.deepep). At ep 8 in one node, 64 experts of which rank r holds 8, top 6 uniform: a token
    reaches a rank with probability 1 - C(56, 6) / C(64, 6), 8 x that = 4.5355 distinct ranks, of which
    7/8 over NVLink: 3.97 fan-out copies; none crosses a node."""
    ranks = 8 * (1 - comb(56, 6) / comb(64, 6))
    assert f"{ranks * 7 / 8:.2f}" == "3.97"
    doc, out = step_json(tmp_path, capsys, V2_LITE_EP8, "deepep")
    line = next(x for x in out.splitlines() if x.startswith("note: deepep dispatch modelled"))
    assert "0.00 of 6 copies per token cross nodes" in line and "3.97 NVLink fan-out copies" in line


def test_torch_deepep_refused_at_ep_1_as_torchtitan(tmp_path, capsys):
    """Finding 2: torchtitan raises "DeepEP requires expert parallelism (ep_degree > 1)" (e347b1e
    ``models/deepseek_v3/infra/parallelize.py``:100-106): one line naming the field, exit 2."""
    cfg = tmp_path / "ep1.toml"
    cfg.write_text(V2_LITE_EP8.replace("[8, 8]", "[8, 1]"), encoding="utf-8")
    code, out, err = run_cli(["plan", cfg], capsys)
    assert code == 2
    assert err.strip().splitlines() == ["error: training.moe_dispatcher: ep 1: torchtitan raises \"DeepEP requires "
                                        "expert parallelism (ep_degree > 1)\"; set mesh ep > 1 or "
                                        "training.moe_dispatcher = \"alltoall\""]


def test_import_maps_expert_parallel_comm_backend(tmp_path, capsys):
    """Finding 2: the trial's ``dsv3_deepep.toml`` (``[parallelism] expert_parallel_comm_backend = "deepep"``,
    torchtitan's ``job_config.py``:474 at e347b1e: ``Literal["standard", "deepep"]``) was imported with the key
    in the unused list and planned as torch's all-to-all; now ``moe_dispatcher = "deepep"``, and export writes
    the key back. "hybridep" (torchtitan's later Python configs, HybridEP for GB200 NVL72) is refused in one
    line: no job TOML takes it and meshplan does not model it."""
    out_toml = tmp_path / "dd.toml"
    code, out, err = run_cli(["import", "torchtitan", NC48 / "dsv3_deepep.toml", "--cluster", "dgx-h100",
                              "--nodes", "64", "-o", out_toml], capsys)
    assert code == 0, err
    assert 'moe_dispatcher = "deepep"' in out_toml.read_text(encoding="utf-8")
    assert "expert_parallel_comm_backend" not in out + err
    back = tmp_path / "back.toml"
    code, _, err = run_cli(["export", out_toml, "--to", "torchtitan", "-o", back], capsys)
    assert code == 0, err
    assert 'expert_parallel_comm_backend = "deepep"' in back.read_text(encoding="utf-8")
    hyb = tmp_path / "hyb.toml"
    hyb.write_text((NC48 / "dsv3_deepep.toml").read_text(encoding="utf-8").replace('"deepep"', '"hybridep"'),
                   encoding="utf-8")
    code, _, err = run_cli(["import", "torchtitan", hyb, "--cluster", "dgx-h100", "--nodes", "64"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: parallelism.expert_parallel_comm_backend: 'hybridep' runs HybridEP's")


def test_step_says_the_experts_run_in_the_compute_dtype(tmp_path, capsys):
    """Finding 6: torchtitan's ``quantize.grouped_mm.float8`` (fqns ["experts"]: torchao's fp8 grouped GEMMs of
    the routed experts) was only an import note; the step showed fp8 MFU with no word of the experts. The
    catalog (kernels.toml) has no measured fp8 grouped-GEMM rate, so the experts stay timed in the compute
    dtype (TrainingSpec.float8_linear converts nn.Linear weights only: the experts' GEMM names are not
    among LINEAR_WEIGHTS), and the step now says so. Without fp8, or for a dense model, no such line."""
    fp8 = V2_LITE_2L.replace("[training]\n", '[training]\nlinear_dtype = "fp8"\n', 1)
    _, out = step_json(tmp_path, capsys, fp8, "fp8")
    want = ("note: float8: the routed experts' grouped GEMMs are timed in bf16 (the float8 converter converts "
            "nn.Linear layers only); torchtitan's quantize.grouped_mm.float8 converter, which runs them in fp8, is not "
            "modelled: the catalog has no measured fp8 grouped-GEMM rate")
    assert want in out.splitlines()
    _, out = step_json(tmp_path, capsys, V2_LITE_2L, "bf16")
    assert "grouped GEMMs are timed" not in out


NCCL = NC48 / "nccl"  # the trial's INVENTED nccl-tests 2.18.3 logs (its gen_nccl.py wrote them; not copied)


def test_calibrate_takes_1_and_8_node_logs_in_one_call(tmp_path, capsys):
    """Finding 9: a 1-node and an 8-node (8 ranks per host) log could not go in one call: the 8-node run
    needs --link nic, which then applied to the 1-node run too. A run whose '#  Rank' lines name one host
    crossed no NIC, so --link nic now leaves it nvlink, with a note. rs_1n.txt's fit stays nvlink's 353.26
    GB/s; rs_8n.txt's nic fit 338.33 / 8 NICs = 42.29 GB/s per NIC (the trial's separate calls gave the
    same two figures)."""
    out_toml = tmp_path / "both.toml"
    code, out, err = run_cli(["calibrate", NCCL / "rs_1n.txt", NCCL / "rs_8n.txt", "--system", "dgx-h100",
                              "--link", "nic", "--out", out_toml], capsys)
    assert code == 0, err
    assert ("rs_1n.txt: ran on one host (gpu-001): --link nic is for the runs over several hosts; read as nvlink, "
            "the link it crossed") in out.splitlines()
    text = out_toml.read_text(encoding="utf-8")
    assert "[link.nvlink]" in text and "[link.nic]" in text
    assert "bandwidth_gb_per_s = 353.3" in text and "bandwidth_gb_per_s = 42.29" in text


def test_calibrate_warns_a_nic_fit_far_below_line_rate(tmp_path, capsys):
    """Finding 9: the trial's first 8-node all-gather log (busbw 45.77 GB/s over 64 ranks, 8 per host)
    is 45.77 / 8 = 5.72 GB/s per NIC, 11% of an NDR NIC's 50 GB/s (400 Gb/s), and was fitted without a word.
    A ring over NDR reaches 92-96% (catalog nccl.toml ib-ndr-400-8nic, nccl-tests issue #290); below half
    (calibrate_nics.LOW_SHARE, a plain ratio) a warning names sockets or the wrong HCAs. The healthy log
    (43.53 per NIC, 87%) gets none."""
    assert f"{45.77 / 8:.2f}" == "5.72" and f"{5.72 / 50:.0%}" == "11%"
    code, out, err = run_cli(["calibrate", NCCL / "ag_8n_slow.txt", "--system", "dgx-h100", "--link", "nic",
                              "--out", tmp_path / "slow.toml"], capsys)
    assert code == 0, err
    warn = [x for x in out.splitlines() if x.startswith("warning: ag_8n_slow.txt: nic 5.72 GB/s per NIC is 11% of "
                                                        "the 50 GB/s line rate of dgx-h100's NICs (400 Gb/s)")]
    assert len(warn) == 1 and "sockets" in warn[0] and "HCAs" in warn[0]
    code, out, err = run_cli(["calibrate", NCCL / "ag_8n.txt", "--system", "dgx-h100", "--link", "nic",
                              "--out", tmp_path / "ok.toml"], capsys)
    assert code == 0 and "warning:" not in out


def test_calibrate_says_what_the_dropped_all_gather_log_times(tmp_path, capsys):
    """Finding 9: with reduce_scatter and all_gather logs over 8 nodes, the kept fit is the slower, the
    reduce-scatter's 42.29 GB/s per NIC (one busbw for the three ring ops, nccl-tests doc/PERFORMANCE.md);
    the all-gather's curve was written to the file but timed nothing, and the note only said "dropped".
    Now the note says its curve times nothing and which file times all-gather; since newcomer 51 (nc52a)
    each fit with its ranks and hosts, per NIC, and the dropped one's difference: 43.53 / 42.29 - 1 = +2.9%."""
    code, out, err = run_cli(["calibrate", NCCL / "rs_8n.txt", NCCL / "ag_8n.txt", "--system", "dgx-h100",
                              "--link", "nic", "--out", tmp_path / "nic.toml"], capsys)
    assert code == 0, err
    kept = next(x for x in out.splitlines() if x.startswith(
        "nic: kept rs_8n.txt (reduce-scatter over 64 ranks on 8 hosts, 42.29 GB/s per NIC)"))
    assert ("ag_8n.txt (all-gather over 64 ranks on 8 hosts, 43.53 GB/s per NIC: faster than the kept one; a "
            "collective over every link waits for the slowest; +2.9% against it; NCCL runs the three ring ops on one "
            "ring, one busbw (nccl-tests doc/PERFORMANCE.md), so one fit times them: its curve is written to the file "
            "but times nothing: rs_8n.txt's fit and curve time all-reduce, all-gather and reduce-scatter across "
            "nodes; to time them from ag_8n.txt, pass it without rs_8n.txt)") in kept


#: torchtitan's DeepSeek-V3 16B shape at 2 layers on 4 DGX H100 (one scalable unit of superpod-ndr-su32),
#: dp_shard 32 x ep 32: each ep group spans the 4 nodes, 8 members on each, one on every rail.
V2_LITE_EP32 = job_toml({"catalog": "deepseek-v2-lite", "layers": 2}, nodes=4,
                        training={"global_batch": 32, "seq_len": 4096},
                        mesh={"names": ["dp_shard", "ep"], "shape": [32, 32]})


def test_pxn_keeps_all_to_all_on_rails_inside_a_scalable_unit(tmp_path, capsys):
    """Finding 7: the rail uplinks carried each cross-node all-to-all send between GPUs of different local
    index (7/8 of them with one member per rail), as if it went NIC -> leaf -> spine -> leaf. NCCL's PXN
    (NCCL_PXN_DISABLE 0 and NCCL_P2P_PXN_LEVEL 2, defaults: NVIDIA/nccl 5067397 src/graph/search.cc:1398-1470)
    sends to a peer through the NIC local to the GPU of the peer's local index, relayed over NVLink, so on a
    rail-optimized fabric every send stays on the peer's rail: inside one scalable unit (4 nodes of a
    32-node SU) nothing reaches the spine. By hand: the ep rows' uplink share was 7/8 (8 rails, a peer on
    another node on the sender's rail 1 time in 8); now 0, and the 4 nodes' ring rows (dp_shard 32 over 4
    nodes, rails aligned) never crossed, so no uplink row at all. Node 0's NICs carry what they did (each
    sends 1/8 of the node's off-node bytes either way: the peers sit on all 8 rails alike)."""
    doc, out = step_json(tmp_path, capsys, V2_LITE_EP32, "ep32")
    links = {x["edge"]: x["bytes_per_step"] for x in doc["links"]}
    assert not [e for e in links if "uplinks to spine" in e], links
    nics = [v for e, v in links.items() if " NIC " in e]
    assert len(nics) == 8 and max(nics) == pytest.approx(min(nics), rel=1e-12)
    assert any(x.startswith("  all-to-all across nodes routed as NCCL's PXN does") for x in out.splitlines())
    cfg = tmp_path / "ep32.toml"  # place says so too (its spine bytes count an all-to-all's leaf crossings only)
    cfg.write_text(V2_LITE_EP32, encoding="utf-8")
    code, out, err = run_cli(["place", cfg], capsys)
    assert code == 0, err
    assert any(x.startswith("  - ep's all-to-all across nodes: NCCL's PXN") for x in out.splitlines()), out


def test_step_names_torchtitans_host_sync_before_each_all_to_all(tmp_path, capsys):
    """Finding 10: torchtitan's ExpertParallel._token_dispatch (e347b1e
    torchtitan/distributed/expert_parallel.py:102-135) copies the all-to-all's split sizes to the host with
    ``non_blocking=False`` ("would incur a device-to-host sync") before every dispatch; step said nothing.
    Now a note counts them: DeepSeek-V2-Lite's shape at 2 layers (layer 1 the one MoE layer), global batch 8
    over dp_shard 8 (1 micro-batch), ep 8: 1 sync per step; under full recompute the layer's forward runs
    twice: 2. At the catalog's issue floor (kernels.toml [host] kernel_issue_s 4.7 us) 0.0047 and 0.0094 ms.
    Under DeepEP (no split sizes on the host) no note."""
    a2a = V2_LITE_EP8.replace('moe_dispatcher = "deepep"\n', "")
    for text, n in ((a2a, 1), (a2a.replace("[training]\n", '[training]\nrecompute = "full"\n', 1), 2)):
        _, out = step_json(tmp_path, capsys, text, f"sync{n}")
        line = next(x for x in out.splitlines() if "split sizes to the host" in x)
        assert (f"{n} device-to-host syncs per step on stage 0" in line
                and f"4.7 us) that is {n * 4.7e-3:.3g} ms per step" in line), line
    _, out = step_json(tmp_path, capsys, V2_LITE_EP8, "deepep")
    assert "split sizes to the host" not in out
