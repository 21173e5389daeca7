"""A cluster written inline in ``[cluster]`` (README's forms: ``gpu = {...}``, ``node = {...}``,
``fabric = {...}``) through export, search --export and the commands that read a cluster
(newcomer finding 2: export re-imported its file with the node's *name* as ``--cluster``, so
``box`` or ``a100-4nic`` was an unknown catalog node). The workstation and the A800 fabric are
README's own blocks, read from README so that they cannot drift; the DeepSpeed case is a real
import of examples/deepspeed_zero2_16xh100.json with its [cluster] replaced by an inline
A100 40GB node with 4 NICs.

Hand values: A100 40GB holds 40e9 B = 37.25 GiB, less the 10% reserve 33.5 GiB usable; Llama
3 8B's checkpoint is 8.03e9 parameters x (4 B fp32 master + 8 B Adam moments) = 96.4 GB; the
interruption rate 419 / (54 d x 16384 GPUs) = 0.000474 per GPU-day (Llama 3, arXiv 2407.21783
3.3.4), 0.000947 per day on README's 2 GPUs."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.interop.export import export, reimport_options
from meshplan.interop.foreign import read_foreign
from tests.cli_run import run_main
from tests.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[1]
DS_JSON = ROOT / "examples" / "deepspeed_zero2_16xh100.json"


def readme_cluster(marker: str) -> str:
    """The documentation's ```toml block whose first line holds ``marker`` (its [cluster] table;
    README's "Input", now docs/input.md)."""
    blocks = re.findall(r"```toml\n(.*?)```", docs_text(), flags=re.S)
    found = [b for b in blocks if marker in b.splitlines()[0]]
    assert len(found) == 1, marker
    return found[0]


#: Llama 3 8B, FSDP over README's two-GPU workstation (bf16 parameters: DeepSpeed's keys hold them).
TRAINING = """
[model]
catalog = "llama3-8b"

[training]
global_batch = 64
micro_batch = 1
seq_len = 2048
sharding = "zero3"
recompute = "full"
param_dtype = "bf16"

[mesh]
names = ["dp_shard"]
shape = [{dp}]
"""

#: An A100 40GB node with 4 HDR NICs, inline (NVIDIA A100 datasheet: A100 40GB SXM, 40 GB HBM2 at
#: 1,555 GB/s, dense BF16 312 TFLOP/s; 108 SMs: A100 architecture whitepaper).
A100_4NIC = (
    '[cluster]\nnodes = 2\n'
    'gpu = { name = "a100-sxm-40gb", peak_tflops = { bf16 = 312.0 }, hbm_gb = 40, hbm_bandwidth_tb_per_s = 1.555, '
    'sms = 108, source = "NVIDIA A100 datasheet (A100 40GB SXM)" }\n'
    'node = { name = "a100-4nic", gpus = 8, source = "test cluster", '
    'fabric = { name = "nvlink3", bandwidth_gb_per_s = 300.0, latency_us = 3.4 }, '
    'pcie = { name = "pcie4", bandwidth_gb_per_s = 31.5, latency_us = 5.7 }, '
    'sockets = [{ gpus = [0, 1, 2, 3], cores = 64 }, { gpus = [4, 5, 6, 7], cores = 64 }], '
    'nics = [' + ", ".join(f'{{ name = "mlx5_{k}", rate_gbit_per_s = 200.0, gpus = [{2 * k}, {2 * k + 1}], '
                           f'rail = {k} }}' for k in range(4)) + '] }\n'
    'network = [{ name = "leaf", latency_us = 5.0 }]\n')


def run(argv, capsys) -> tuple[int, str, str]:
    """``meshplan ARGV`` in this process: (exit status, stdout, stderr)."""
    rc = run_main(*argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def workstation(tmp_path) -> Path:
    """README's "everything inline" workstation with Llama 3 8B at dp_shard 2."""
    path = tmp_path / "box.toml"
    path.write_text(readme_cluster("# everything inline") + TRAINING.format(dp=2))
    return path


@pytest.fixture
def a800(tmp_path) -> Path:
    """README's dgx-a100 with its NVLink at 200 GB/s each way (4 nodes), Llama 3 8B at dp_shard 32."""
    path = tmp_path / "a800.toml"
    path.write_text(readme_cluster("NVLink at 200 GB/s") + TRAINING.format(dp=32))
    return path


@pytest.fixture
def ds_inline(tmp_path, capsys) -> Path:
    """examples/deepspeed_zero2_16xh100.json imported (2 dgx-a100, llama3-8b, seq 4096), its
    [cluster] then written inline as :data:`A100_4NIC`; the JSON beside it ([source])."""
    src = tmp_path / "ds.json"
    src.write_text(DS_JSON.read_text())
    out = tmp_path / "ds30b_40g.toml"
    rc, _, err = run(["import", "deepspeed", src, "--cluster", "dgx-a100", "--nodes", 2, "--model", "llama3-8b",
                      "--seq-len", 4096, "-o", out], capsys)
    assert rc == 0, err
    text = out.read_text()
    catalog_table = '[cluster]\nsystem = "dgx-a100"\nnodes = 2\n'
    assert catalog_table in text
    out.write_text(text.replace(catalog_table, A100_4NIC))
    return out


@pytest.mark.parametrize("to", ["meshplan", "torchtitan", "megatron", "deepspeed"])
def test_readme_workstation_exports(workstation, tmp_path, capsys, to):
    """Every format writes README's workstation; the header names it as 1x box and says how to
    import it (no --cluster box: box is no catalog node); the re-import holds the same cluster."""
    out = tmp_path / f"out.{to}"
    rc, stdout, err = run(["export", workstation, "--to", to, "-o", out], capsys)
    assert rc == 0, err
    assert "unknown node" not in err and "--cluster box" not in stdout
    cfg = load_config(workstation)
    if to == "meshplan":
        assert load_config(out).cluster == cfg.cluster
        return
    assert ("import with: meshplan import " + to + " FILE --cluster NODE --nodes 1") in stdout
    assert "then replace plan.toml's [cluster] with this plan's (1x box is not a catalog node:" in stdout
    back = config_from_dict(read_foreign(out, to, reimport_options(cfg, to)).tables)
    assert back.cluster == cfg.cluster
    assert (back.cluster.world, back.cluster.node.name, back.cluster.gpu.peak_flops("bf16")) == (2, "box", 989.4e12)


def test_fabric_override_round_trip_keeps_its_fabric(a800):
    """README's A800 nodes: dgx-a100 with NVLink at 200 GB/s. The round trip carries that fabric
    (the step before and after compares like with like), not the catalog's 300 GB/s."""
    cfg = load_config(a800)
    assert cfg.cluster.node.fabric.bandwidth_bytes_per_s == 200e9
    for to in ("torchtitan", "megatron", "deepspeed"):
        opts = reimport_options(cfg, to)
        assert opts.cluster == cfg.cluster
        text, head = export(cfg, to, str(a800))
        assert head[0] == f"meshplan export of {a800} (llama3-8b on 4x dgx-a100)"
        assert f"import with: meshplan import {to} FILE --cluster dgx-a100 --nodes 4" in head[1]
        assert "then replace plan.toml's [cluster] with this plan's (4x dgx-a100 differs from the catalog's" in head[1]
        path = a800.with_suffix({"torchtitan": ".tt.toml", "megatron": ".args", "deepspeed": ".json"}[to])
        path.write_text(text)
        back = config_from_dict(read_foreign(path, to, opts).tables)
        assert back.cluster.node.fabric.bandwidth_bytes_per_s == 200e9 and back.cluster.world == 32


def test_catalog_cluster_keeps_its_import_line(tmp_path):
    """A catalog node unchanged is still re-imported (and named) by its name."""
    path = tmp_path / "h100.toml"
    path.write_text('[cluster]\nsystem = "dgx-h100"\nnodes = 1\n' + TRAINING.format(dp=8))
    opts = reimport_options(load_config(path), "megatron")
    assert (opts.cluster, opts.nodes, opts.gpu) == ("dgx-h100", 1, None)
    _, head = export(load_config(path), "megatron", str(path))
    assert "import with: meshplan import megatron FILE --cluster dgx-h100 --nodes 1" in head


@pytest.mark.parametrize("to", ["meshplan", "torchtitan", "megatron", "deepspeed"])
def test_deepspeed_import_inline_a100_exports(ds_inline, tmp_path, capsys, to):
    """The newcomer's case: a DeepSpeed-imported TOML with an inline A100 40GB node exports to
    every format that takes ZeRO-2 (torchtitan refuses ZeRO-2 itself, not the cluster); the
    DeepSpeed file carries the JSON's steps_per_print."""
    out = tmp_path / f"out.{to}"
    rc, stdout, err = run(["export", ds_inline, "--to", to, "-o", out], capsys)
    assert "unknown node" not in err
    if to == "torchtitan":
        assert rc == 2 and err.startswith("error: --to: torchtitan shards with FSDP2 (zero3, hsdp) or replicates")
        return
    assert rc == 0, err
    if to == "deepspeed":
        assert json.loads(out.read_text())["steps_per_print"] == 10
    if to != "meshplan":
        assert "FILE --cluster NODE --nodes 2" in stdout and "(2x a100-4nic is not a catalog node:" in stdout
        cfg = load_config(ds_inline)
        back = config_from_dict(read_foreign(out, to, reimport_options(cfg, to)).tables)
        assert back.cluster == cfg.cluster and back.cluster.gpu.hbm_bytes == 40e9


def test_search_of_inline_deepspeed_import_keeps_your_mesh(ds_inline, capsys):
    """search prints the table and the "your mesh" line (it exited 2 on the cluster before):
    dp 16 at ZeRO-2 does not fit the 33.5 GiB usable of a 40 GB A100."""
    rc, out, err = run(["search", ds_inline], capsys)
    assert rc == 0, err
    line = next(x for x in out.splitlines() if x.startswith("your mesh"))
    assert line.startswith("your mesh (dp 16): infeasible: peak ")
    assert line.endswith("> 33.5 GiB usable (37.3 GiB - 10% reserve)")


@pytest.mark.parametrize("to", ["meshplan", "torchtitan", "megatron", "deepspeed"])
def test_search_export_inline(ds_inline, tmp_path, capsys, to):
    """search --export 1 --to T writes row 1 (ZeRO-3 over dp_shard 16) in every format."""
    out = tmp_path / f"row1.{to}"
    rc, stdout, err = run(["search", ds_inline, "--export", 1, "--to", to, "-o", out], capsys)
    assert rc == 0, err
    assert out.is_file() and "unknown node" not in err
    if to == "meshplan":
        row = load_config(out)
        assert row.cluster == load_config(ds_inline).cluster and row.training.sharding == "zero3"
        assert tomllib.loads(out.read_text())["mesh"] == {"names": ["dp_shard"], "shape": [16]}


def test_commands_read_inline_cluster(workstation, tmp_path, capsys):
    """place, launch, reliability, report and compare on README's workstation, each with a value
    of that cluster (fp32 parameters, as the bf16 ones' extra fp32 master copy does not fit 2 GPUs)."""
    workstation.write_text(workstation.read_text().replace('param_dtype = "bf16"\n', ""))
    rc, out, err = run(["place", workstation], capsys)
    assert rc == 0, err
    assert re.search(r"^  rank 1: node 0 LOCAL_RANK 1 RANK 1 GPU 1 .* NIC eth0;", out, flags=re.M)
    rc, out, err = run(["launch", workstation, "--out", tmp_path / "launch", "--", "python", "train.py"], capsys)
    assert rc == 0, err
    assert "--nnodes=1 --nproc-per-node=2 " in (tmp_path / "launch" / "torchrun.sh").read_text()
    rc, out, err = run(["reliability", workstation], capsys)
    assert rc == 0, err
    assert "2 GPUs x 0.000474 interruptions per GPU-day = 0.000947 per day" in out
    assert "checkpoint 96.4 GB on disk" in out
    rc, out, err = run(["report", workstation, "--out", tmp_path / "r.html"], capsys)
    assert rc == 0, err
    assert "box" in (tmp_path / "r.html").read_text()
    other = tmp_path / "box-none.toml"
    other.write_text(workstation.read_text().replace('recompute = "full"', 'recompute = "none"'))
    rc, out, err = run(["compare", workstation, other, "--out", tmp_path / "cmp"], capsys)
    assert rc == 0, err
    assert "unknown node" not in err + out
