"""``meshplan search`` under DeepSpeed ZeRO-Offload (``training.offload_optimizer = "cpu"``) on a node
whose host memory binds: the search's rule ``host`` (meshplan/search/host_memory.py, over numpy arrays)
rejects exactly the candidates ``plan`` rejects for host memory
(meshplan/memory/offload_host.py, one home for the formula), with the plan's words, checked
against build_plan on every candidate that passes the validity rules (issue 11's leftover)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from meshplan import catalog
from meshplan.config import config_from_dict
from meshplan.errors import ConfigError
from meshplan.memory import constraints as cons
from meshplan.plan import build_plan
from meshplan.report.search import count_lines, rejected_lines
from meshplan.report.search_header import header_lines
from meshplan.search.driver import search
from meshplan.search.buffer_bounds import offload_staging_bytes
from meshplan.search.host_memory import host_reasons
from meshplan.search.memory import Tables
from meshplan.search.space import CODE, OK, SHARDING, candidate_config
from tests.test_search import SMALL, gpu

#: The node's host memory, GB: between the 18 B and 20 B a partition element rows need (below).
HOST_GB = 9.5


def _config(host_gb=HOST_GB):
    """SMALL (tests/test_search.py: 8 layers, hidden 2048, ffn 5632, 16 q / 4 KV heads of 128, vocab 32000,
    untied) on one DGX H100 node (8 GPUs, the catalog's node with ``host_memory_gb`` ``host_gb``) whose HBM
    is 6 GB (so that GPU memory rejects some rows too); DeepSpeed's ZeRO-2 with offload_optimizer cpu, so
    the search plans zero1/zero2 under DeepSpeed's ZeRO-1/2 and zero3 under its ZeRO-3 (all offloaded),
    hsdp under FSDP2 (nothing offloaded); global batch 16: micro-batches per step 16 / (mb x dp)."""
    node = catalog.node("dgx-h100").model_dump() | {"host_memory_gb": host_gb}
    return config_from_dict({
        "model": SMALL, "cluster": {"gpu": gpu(6.0), "nodes": 1, "node": node, "network": "superpod-ndr-su32"},
        "training": {"global_batch": 16, "seq_len": 2048, "sharding": "zero2", "zero12_engine": "deepspeed",
                     "param_dtype": "bf16", "offload_optimizer": "cpu"},
        "search": {"settle_max": 1_000_000, "micro_batch": [1, 2], "recompute": ["none", "full"], "top": 3}},
        require_mesh=False)


@pytest.fixture(scope="module")
def searched():
    """The search, build_plan's reasons (None: feasible) and planned peaks (bytes) of every candidate that
    passed the validity rules (the search's codes OK, memory, host, gemm)."""
    cfg = _config()
    r = search(cfg, workers=1)
    late = np.isin(r.code, [OK, CODE["memory"], CODE["host"], CODE["gemm"]])
    plans, peaks, cache = {}, {}, {}
    for i in np.flatnonzero(late).tolist():
        cc = candidate_config(cfg, r.candidates, i)
        if cc.training not in cache:
            cache[cc.training] = cons.constraints(cc.model, cc.training, cc.cluster, cc.cluster.world)
        p = build_plan(cc, cache[cc.training])
        plans[i] = None if p.feasible else p.reasons
        peaks[i] = max(tl.peak.total_bytes for tl in p.timelines)
    return cfg, r, plans, peaks


def _host(reasons) -> tuple:
    return tuple(x for x in reasons or () if x.startswith("host memory: "))


def test_search_rejects_for_host_memory_what_plan_rejects(searched):
    """Every candidate past the validity rules: the search rejects it (memory or host) exactly where
    build_plan does; rule ``host`` exactly where the plan's reasons hold the host reason and the GPU
    memory lower bound did not reject it first (a row over both stays ``memory``, the plan's first
    reason); and the search's words for each row (from its vectorised partition and bytes) are the
    plan's host reason, to the character, whether it fits or not."""
    cfg, r, plans, _ = searched
    memory, host, gemm = CODE["memory"], CODE["host"], CODE["gemm"]
    assert len(plans) > 100 and (r.code == OK).any()
    for i, reasons in plans.items():
        label = r.candidates.label(i)
        assert (reasons is None) == (r.code[i] in (OK, gemm)), (label, reasons)
        if r.code[i] == host:
            assert _host(reasons), (label, reasons)
        elif _host(reasons):
            assert r.code[i] == memory and any("usable" in x for x in reasons), (label, reasons)
        assert host_reasons(cfg, r.est.host_numel, r.est.host_per_element, i) == _host(reasons), label


def test_host_rows_by_hand(searched):
    """Which rows the host rejects, by hand. A rank's partition is about the model over the 8 GPUs
    whatever the mesh (pp x tp x dp = 8 on one node), 491,816,960 parameters / 8 (tp 1, dp 8: layers
    8 x (q 2048 x 2048 + k, v 2 x 2048 x 512 + o 2048 x 2048 + MLP 3 x 2048 x 5632 + norms 2 x 2048) =
    360,742,912, embedding and output 2 x 32,000 x 2048 = 131,072,000, final norm 2048), so the node's 8
    ranks need about 491.8e6 x the bytes per element: 18 B (16 of fp32 state + the bf16 staging
    partition: zero3, and zero1/zero2 at one micro-batch a step) = 8.85 GB, fitting 9.5 GB; 20 B (zero1
    and zero2 with more than one micro-batch: DeepSpeed's bf16 gradient accumulator) = 9.84 GB, over it.
    hsdp rows (FSDP2) offload nothing. So rule ``host`` holds exactly the zero1/zero2 rows with 16 / (mb x
    dp) > 1 that GPU memory did not reject first."""
    cfg, r, plans, _ = searched
    c = r.candidates
    idx = np.array(sorted(plans))
    steps = cfg.training.global_batch // (c.mb[idx] * c.dp[idx])
    twenty = np.isin(c.sh[idx], [SHARDING.index("zero1"), SHARDING.index("zero2")]) & (steps > 1)
    not_memory = r.code[idx] != CODE["memory"]
    assert ((r.code[idx] == CODE["host"]) == (twenty & not_memory)).all()
    assert (r.code[idx] == CODE["host"]).sum() > 10 and (~twenty & (r.code[idx] == OK)).any()


def test_one_candidate_by_hand(searched):
    """dp 4 x tp 2, mb 1, none, zero2 (DeepSpeed's ZeRO-2): per rank at tp 2, a layer's weights
    (2048 x 2048 x 2 + 2048 x 512 x 2 + 2048 x 5632 x 3) / 2 = 22,544,384 plus its two norms 4,096
    (replicated) = 22,548,480; 8 layers 180,387,840, embedding and output 2 x 32,000 x 2048 / 2 =
    65,536,000, final norm 2048: 245,925,888; over dp 4 61,481,472 a rank. 16 / (1 x 4) = 4 micro-batches:
    20 B an element, 1.23 GB a rank, 8 ranks 9.84 GB > 9.5 GB. The plan's reason, the search's rule, and
    the best rejected line (the plan's words) agree."""
    cfg, r, plans, _ = searched
    c = r.candidates
    i = next(i for i in plans if c.label(i) == "dp 4 x tp 2, mb 1, none, vpp 1, zero2")
    assert r.est.host_numel[i] == 61_481_472 and r.est.host_per_element[i] == 20
    why = ("host memory: 8 ranks x 1.2 GB (61,481,472 params x 20 B) = 9.8 GB > the node's 9.5 GB "
           "(cluster.node.host_memory_gb); shard over more ranks (more nodes) or set offload_optimizer = \"none\"")
    assert r.code[i] == CODE["host"] and plans[i] == (why,)
    text = "\n".join(header_lines(r) + rejected_lines(r) + count_lines(r))
    assert "host memory (ZeRO-Offload, cluster.node.host_memory_gb)" in text
    assert "rejected, rule 'host' (host memory: ZeRO-Offload's host state" in text
    # the best rejected row is this one (the closest to fitting GPU memory of those faster than the
    # top), printed with the plan's words (docs/commands.md quotes the line)
    assert r.best_rejected is not None and r.best_rejected.index == i and r.best_rejected.reasons == (why,)
    assert f"best rejected: {c.label(i)}: {why}" in text


def test_top_fits_the_host_and_a_roomy_node_rejects_none(searched):
    """No row of the top is one the plan rejects for host memory; on the catalog's 2 TB the rule
    rejects nothing (8 x 61.5e6 x 20 B = 9.8 GB)."""
    _, r, plans, _ = searched
    assert r.top and all(plans[e.index] is None for e in r.top)
    roomy = search(_config(2000.0), workers=1)
    assert roomy.counts()["host"] == 0


def test_node_without_host_memory_is_named():
    """A node that states no host memory under offload: the search raises the plan's error, naming
    cluster.node.host_memory_gb (never a default)."""
    cfg = _config()
    cfg = replace(cfg, cluster=cfg.cluster.model_copy(
        update={"node": cfg.cluster.node.model_copy(update={"host_memory_gb": None})}))
    with pytest.raises(ConfigError, match="cluster.node.host_memory_gb"):
        search(cfg, workers=1)


def test_memory_bounds_hold_with_the_gpu_staging_buffer(searched):
    """ZeRO-Offload at stages 1/2 keeps DeepSpeed's ``temp_grad_buffer_for_gpu_offload`` on the GPU from
    init (memory.offload.gpu_staging_entries): the largest parameter on the rank, 16-bit. SMALL at tp 2:
    the embedding, 32,000 x 2048 / 2 = 32,768,000 elements x 2 B = 65,536,000 B (at tp 1 131,072,000 B);
    none on zero3 rows (stage 3) or hsdp rows (FSDP2). The search's memory bounds count it
    (search.buffer_bounds.offload_staging_bytes; before, every zero1/zero2 row's planned peak sat up to
    that much above its upper bound, which could admit a row plan rejects): every planned peak lies within
    the bounds, with the search's margin."""
    cfg, r, _, peaks = searched
    c, m = r.candidates, cfg.search.memory_margin
    staging = offload_staging_bytes(cfg, Tables(cfg), c)
    zero12 = np.isin(c.sh, [SHARDING.index("zero1"), SHARDING.index("zero2")])
    assert set(staging[zero12 & (c.tp == 2)].tolist()) == {65_536_000}
    assert set(staging[zero12 & (c.tp == 1)].tolist()) == {131_072_000} and not staging[~zero12].any()
    for i, peak in peaks.items():
        assert r.est.peak_lo[i] / (1 + m) <= peak <= r.est.peak_hi[i] * (1 + m), c.label(i)
    assert not [n for n in r.notes if "outside the memory bounds" in n]
