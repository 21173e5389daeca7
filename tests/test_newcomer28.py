"""Findings of newcomer trial 28 (issue 11; Megatron-Core MoE Mixtral-8x22B on 512 H100): each
test failed on main before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.catalog import system
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import export, load_any, user_source
from meshplan.interop.megatron import read
from meshplan.mesh.resolve import resolve_mesh
from meshplan.placement.choice import choose_placement
from meshplan.spec.mesh import MeshSpec

ROOT = Path(__file__).resolve().parents[1]
EX = ROOT / "examples"


# 1 ------------------------------------------------------------------ --ckpt-format beside --async-save

def test_megatron_export_keeps_the_ckpt_format_async_save_needs(tmp_path):
    """The trial's script gave ``--ckpt-format torch_dist --async-save``; its export wrote
    ``--async-save`` (carried, not read) and dropped ``--ckpt-format`` (read for the Megatron FSDP
    check, so not carried, and written only under Megatron FSDP). NVIDIA/Megatron-LM d98e8a6 saves
    asynchronously in torch_dist, torch_dcp and fsdp_dtensor only (megatron/training/
    checkpointing.py:764-775 raises NotImplementedError otherwise), so the user's format is carried
    as given: the exported file holds ``--ckpt-format torch_dist`` then ``--async-save`` (the file's
    order), no "written otherwise" line lists it, and the import's note names the worker
    Megatron-LM turns async save off without (arguments.py:1814-1820)."""
    src = tmp_path / "job.args"
    src.write_text((EX / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text()
                   + "--ckpt-format torch_dist --async-save\n")
    opts = ImportOptions(cluster="dgx-h100", nodes=2)
    text, header = export(load_any(src, opts=opts), "megatron", str(src), user_source(src))
    lines = text.splitlines()
    assert lines[-2:] == ["--ckpt-format torch_dist", "--async-save"]
    assert f"carried unchanged from {src}: --lr, --train-iters, --tokenizer-type, --ckpt-format, --async-save" in header
    assert not any("--ckpt-format" in h for h in header if h.startswith("written otherwise"))
    notes = read(src.read_text(), opts).notes
    assert ("--async-save without --use-persistent-ckpt-worker: Megatron-LM (d98e8a6) warns and turns async save off "
            "(arguments.py:1814-1820), so each save blocks training: add --use-persistent-ckpt-worker") in notes
    # the legacy format cannot save asynchronously at all: carried as given, and the import says so
    legacy = read(src.read_text().replace("torch_dist", "torch"), opts).notes
    assert [n for n in legacy if n.startswith("--async-save")] == [
        "--async-save with --ckpt-format torch: Megatron-LM (d98e8a6) raises NotImplementedError at the first save "
        "(checkpointing.py:764-768, no async save of legacy checkpoints): use --ckpt-format torch_dist"]


def test_megatron_export_under_megatron_fsdp_writes_its_own_format(tmp_path):
    """Where the plan runs Megatron FSDP the export writes ``--ckpt-format fsdp_dtensor``, which
    Megatron-LM asserts there (arguments.py:1169-1170 at d98e8a6), once: the user's torch_dist is
    not carried beside it, and is listed as written otherwise; a user's fsdp_dtensor without Megatron
    FSDP (asserted only with it, arguments.py:1675-1676) is dropped, not carried."""
    base = (EX / "megatron_llama3-8b_16xh100_tp2-pp2.args").read_text().replace("--pipeline-model-parallel-size 2",
                                                                                  "--pipeline-model-parallel-size 1")
    opts = ImportOptions(cluster="dgx-h100", nodes=2)
    fsdp = tmp_path / "fsdp.args"
    fsdp.write_text(base.replace("--use-distributed-optimizer", "--use-megatron-fsdp --data-parallel-sharding-strategy "
                                 "optim_grads_params") + "--ckpt-format torch_dist --async-save\n")
    text, header = export(load_any(fsdp, opts=opts), "megatron", str(fsdp), user_source(fsdp))
    assert [f for f in text.splitlines() if f.startswith("--ckpt-format")] == ["--ckpt-format fsdp_dtensor"]
    assert any("--ckpt-format torch_dist -> fsdp_dtensor" in h for h in header if h.startswith("written otherwise"))
    ddp = tmp_path / "ddp.args"
    ddp.write_text(base + "--ckpt-format fsdp_dtensor\n")
    text, header = export(load_any(ddp, opts=opts), "megatron", str(ddp), user_source(ddp))
    assert not any(f.startswith("--ckpt-format") for f in text.splitlines())
    assert any("--ckpt-format fsdp_dtensor -> dropped" in h for h in header if h.startswith("written otherwise"))


# 2 ------------------------------------------------------------------ place's pp line follows the tally

@pytest.mark.parametrize("pp_gb,line", [
    # the trial's tally (place.txt: tp 30.6 GB, pp 22.5 GB, dp 2.4 GB): dp sends less than pp, and its groups
    # {r, r + 8} join nodes 0-1 as pp's {r, r + 16} join nodes 0 and 2 (node-major, 8 GPUs a node)
    (22.5, "pp 2: each micro-batch crosses a stage boundary once each way (1f1b); its 22.5 GB per rank is not the "
           "lightest traffic: dp 2.4 GB sends less and crosses nodes too; groups span 2 node(s) where the mesh's rank "
           "order puts them, not for being light (meshplan place --choose weighs the orders)"),
    # pp at 1.0 GB, below dp's 2.4 GB and tp's 30.6 GB: the lightest, and said so
    (1.0, "pp 2: each micro-batch crosses a stage boundary once each way (1f1b), the lightest traffic; groups span "
          "2 node(s)"),
])
def test_place_pp_line_is_lightest_only_where_the_tally_says_so(pp_gb, line):
    """place said "pp 8: ... the lightest traffic" beside its own tally "ep 39.5 GB, tp 30.6 GB, pp
    22.5 GB, efsdp 11.1 GB, dp 2.4 GB" (/work/trial28/place.txt). pp 2 x dp 2 x tp 8 on 4 DGX H100
    nodes, the placement as given (node-major, not searched), with the trial's bytes per rank as
    weights: the words follow the numbers."""
    mesh = resolve_mesh(MeshSpec(names=["pp", "dp", "tp"], shape=[2, 2, 8]), world=32)
    c = choose_placement(mesh, system("dgx-h100", 4), weights={"tp": 30.6e9, "pp": pp_gb * 1e9, "dp": 2.4e9},
                         search=False, source="collective table")
    assert [d for d in c.decisions if d.startswith("pp 2:")] == [line]
