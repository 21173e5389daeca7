"""Findings of the nc51 newcomer trial (a capacity planner: Llama-3-405B on H100 IB, H200 RoCE and
A100 clusters under Megatron-LM), one test each; the trial's H200 config is
``tests/data/nc52b/b_h200.toml`` (192 nodes x 8 H200, pp 16 x dp 12 x tp 8, framework megatron)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.cli_run import run_cli

DATA = Path(__file__).parent / "data" / "nc52b"


def _with(tmp_path, name: str, old: str, new: str) -> Path:
    """``b_h200.toml`` with ``old`` replaced by ``new``, written to ``tmp_path/NAME.toml``."""
    text = (DATA / "b_h200.toml").read_text(encoding="utf-8")
    assert old in text
    out = tmp_path / f"{name}.toml"
    out.write_text(text.replace(old, new), encoding="utf-8")
    return out


def test_megatron_runtime_said(tmp_path, capsys):
    """#1: ``framework = "megatron"`` with ``megatron_runtime`` unset models Megatron-LM 2022 (2755bcb)
    without saying so. Now plan and step print one line naming it, the other generation, and the key;
    the --json carries it. The trial's model is Llama 3 405B (catalog: RoPE, SwiGLU, 8 KV heads of 128),
    none of which Megatron-LM 2022 has (``git grep`` of ``rotary``, ``swiglu``, ``num-query-groups`` under
    ``megatron/`` at 2755bcb finds nothing), so the line names them, in the model's order: RoPE, SwiGLU,
    GQA (8 of 128 heads); sharding zero1 is not listed (2755bcb ``megatron/arguments.py:785`` has
    ``--use-distributed-optimizer``). With ``megatron_runtime = "core"`` the line names Megatron Core at
    d98e8a6, set, and no feature."""
    code, out, err = run_cli(["plan", DATA / "b_h200.toml", "--json", tmp_path / "p.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "p.json").read_text())["megatron_runtime"]
    assert (doc["runtime"], doc["set"]) == ("2022", False)
    assert doc["core_only_features"] == ["RoPE (--position-embedding-type rope)", "SwiGLU (--swiglu)",
                                         "GQA (--num-query-groups 8 of 128 heads)"]
    assert "2755bcb" in doc["revision"] and doc["other"]["runtime"] == "core" and "d98e8a6" in doc["other"]["revision"]
    said = " ".join(out.split())  # rich wraps the line
    assert "megatron runtime: Megatron-LM 2022 (NVIDIA/Megatron-LM 2755bcb" in said
    assert 'set training.megatron_runtime = "core" to model it' in said
    core = _with(tmp_path, "core", 'framework = "megatron"', 'framework = "megatron"\nmegatron_runtime = "core"')
    code, out, err = run_cli(["step", core, "--json", tmp_path / "s.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())["megatron_runtime"]
    assert (doc["runtime"], doc["set"], doc["core_only_features"]) == ("core", True, [])
    line = next(x for x in out.splitlines() if x.startswith("megatron runtime:"))
    assert 'Megatron Core (NVIDIA/Megatron-LM d98e8a6) (training.megatron_runtime = "core")' in line
    assert 'set training.megatron_runtime = "2022" to model it' in line
    torch = _with(tmp_path, "torch", 'framework = "megatron"', 'framework = "torch"')
    code, out, err = run_cli(["plan", torch, "--json", tmp_path / "t.json"], capsys)
    assert json.loads((tmp_path / "t.json").read_text())["megatron_runtime"] is None
    assert "megatron runtime:" not in out


def test_train_time_days(tmp_path, capsys):
    """#2: a capacity planner asks how long N tokens take. ``step --tokens 15e12`` prints it and --json has
    it in seconds. By hand from the --json: tokens/s = global batch 2016 x seq 8192 = 16,515,072 tokens per
    step / step_s (53.94 s when written: 306,188 tokens/s), so 15e12 tokens take 15e12 x step_s / 16,515,072
    s (567.0 days at 53.94 s); with interruptions, wall = that / goodput, the goodput
    ``meshplan reliability`` prints for the same config at the same storage and restart defaults
    (2000 GB/s, 600 s; 98.81% when written, 573.9 days). With ``[reliability] checkpoint_interval_steps =
    100`` the goodput is the job's interval's (``job_interval.goodput`` of reliability --json)."""
    code, out, err = run_cli(["step", DATA / "b_h200.toml", "--tokens", "15e12", "--json", tmp_path / "s.json"], capsys)
    assert code == 0, err
    doc = json.loads((tmp_path / "s.json").read_text())
    tt, step_s = doc["train_time"], doc["step_s"]
    assert abs(tt["compute_s"] - 15e12 * step_s / (2016 * 8192)) < 1e-6 * tt["compute_s"]
    code, _, err = run_cli(["reliability", DATA / "b_h200.toml", "--json", tmp_path / "r.json"], capsys)
    rel = json.loads((tmp_path / "r.json").read_text())
    assert tt["goodput"] == rel["goodput"] and tt["wall_s"] == tt["compute_s"] / rel["goodput"]
    line = next(x for x in out.splitlines() if x.startswith("train time:"))
    assert f"{tt['compute_s'] / 86400:.1f} days of steps ({tt['wall_s'] / 86400:.1f} days at goodput" in line
    job = _with(tmp_path, "job", "[mesh]", "[reliability]\ncheckpoint_interval_steps = 100\n[mesh]")
    run_cli(["step", job, "--tokens", "15e12", "--json", tmp_path / "j.json"], capsys)
    run_cli(["reliability", job, "--json", tmp_path / "rj.json"], capsys)
    got = json.loads((tmp_path / "j.json").read_text())["train_time"]
    assert got["goodput"] == json.loads((tmp_path / "rj.json").read_text())["job_interval"]["goodput"]
    assert "job's interval (100 steps" in got["goodput_at"]
    code, out, err = run_cli(["step", DATA / "b_h200.toml", "--tokens", "0"], capsys)
    assert code == 2 and "--tokens" in err and len(err.strip().splitlines()) == 1


def _dp_busbw(tmp_path, capsys, name: str, nic: str) -> tuple[float, str]:
    """busbw (B/s) of stage 0's per-step dp reduce-scatter in ``plan --json`` of ``b_h200.toml`` with
    ``nic`` added to its [cluster] (none: ""), and ``step``'s stdout of the same config."""
    cfg = _with(tmp_path, name, 'gpu = "h200-sxm-141gb"', f'gpu = "h200-sxm-141gb"\n{nic}')
    code, _, err = run_cli(["plan", cfg, "--json", tmp_path / f"{name}.json"], capsys)
    assert code == 0, err
    rows = next(iter(json.loads((tmp_path / f"{name}.json").read_text())["collectives"].values()))
    rs = next(r for r in rows if r["axis"] == "dp_shard" and r["op"] == "reduce-scatter")
    return rs["busbw_bytes_per_s"], run_cli(["step", cfg], capsys)[1]


def test_roce_nics(tmp_path, capsys):
    """#3: a user with 400G RoCEv2 NICs could not say so. ``[cluster] nic = { transport = "roce" }`` (beside a
    catalog ``node``, or ``system``) marks every NIC RoCE; ``rate_gbit_per_s`` sets their line rate. No public
    nccl-tests sweep over RoCEv2 was found, so no RoCE efficiency is invented: the NICs are timed on the node's
    catalog curve ib-ndr-400-8nic (NDR InfiniBand, 376 of 400 GB/s busbw per node at 8 GiB, 94%: nccl-tests
    issue #290) read against their own line rate, and step prints that assumption with the calibrate pointer.
    By hand: the dp reduce-scatter's groups span 12 nodes, one rank per node on its own NIC, so its busbw is
    0.94 x 400 Gb/s / 8 = 47.0 GB/s (NCCL's latency, 12 ring steps at 14 us x 0.357, moves it under 0.1% at
    12.2 GB); the same with transport "roce" (nothing changes but the note); at rate_gbit_per_s 200,
    0.94 x 25 = 23.5 GB/s."""
    ib, out_ib = _dp_busbw(tmp_path, capsys, "ib", "")
    roce, out = _dp_busbw(tmp_path, capsys, "roce", 'nic = { transport = "roce" }')
    half, _ = _dp_busbw(tmp_path, capsys, "half", 'nic = { transport = "roce", rate_gbit_per_s = 200.0 }')
    assert abs(ib - 47.0e9) < 0.005 * 47.0e9 and roce == ib
    assert abs(half - 23.5e9) < 0.005 * 23.5e9
    note = next(x for x in out.splitlines() if x.startswith("note: NICs RoCEv2"))
    assert "ib-ndr-400-8nic, measured on InfiniBand (376 of 400 GB/s busbw at 8.00 GiB, 94%)" in note
    assert "an assumption" in note and "--calibration (meshplan calibrate)" in note
    assert "RoCEv2" not in out_ib
    bad = _with(tmp_path, "bad", 'gpu = "h200-sxm-141gb"', 'gpu = "h200-sxm-141gb"\nnic = { speed = 400 }')
    code, _, err = run_cli(["plan", bad], capsys)
    assert code == 2 and "cluster.nic.speed: unknown key; allowed: transport, rate_gbit_per_s" in err


def test_catalog_network_assumed(capsys):
    """#4: the trial could not tell which catalog fabric sizes are read and which assumed. Now each network
    entry lists the tier values its source does not give (``assumed``) and ``meshplan catalog network`` prints
    every tier's values, those marked "(assumed)". By reading the sources: seed-rails' seed names no switch
    (its leaf's size and both tiers' oversubscription assumed), gb200-ndr-fabric's leaf/spine sizes are "not
    taken" (one non-blocking tier assumed), Azure ND MI300X v5 publishes a non-blocking fat tree but no tier
    sizes (nodes_per_domain assumed); the SuperPOD leaves (32 nodes per SU for H100 and B200, 20 for A100:
    NVIDIA's reference architectures) are read, so unmarked. The tiers themselves are unchanged (no behaviour
    change): superpod-hdr-su20's leaf still 20 nodes."""
    from meshplan import catalog
    code, out, err = run_cli(["catalog", "network"], capsys)
    assert code == 0, err
    tiers = {n: line for n, line in zip(catalog.names("network"),
                                        [x for x in out.splitlines() if x.startswith("  tiers: ")])}
    assert tiers["seed-rails"] == ("  tiers: leaf latency_us 14, oversubscription 1 (assumed), nodes_per_domain 0 "
                                   "(assumed); spine latency_us 14, oversubscription 1 (assumed), nodes_per_domain 0")
    assert tiers["azure-nd-mi300x-v5-ib"].endswith("oversubscription 1, nodes_per_domain 0 (assumed)")
    assert tiers["gb200-ndr-fabric"].count("(assumed)") == 2
    assert all("(assumed)" not in tiers[n] for n in ("superpod-ndr-su32", "superpod-b200-ndr-su32", "superpod-hdr-su20"))
    assert [t.nodes_per_domain for t in catalog.network("superpod-hdr-su20")] == [20, 0]
    for name in catalog.names("network"):  # an entry whose source says "assumed" lists what (or names the node)
        src = catalog.entry("network", name)["source"]
        assert ("assumed" in src) == bool(catalog.network_assumed(name)) or "dgx-h200" in src, name
