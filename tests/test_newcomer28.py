"""Findings of newcomer trial 28 (issue 11; Megatron-Core MoE Mixtral-8x22B on 512 H100): each
test failed on main before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.catalog import system
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import export, user_source
from meshplan.interop.foreign import load_any
from meshplan.interop.megatron import read
from meshplan.mesh.resolve import resolve_mesh
from meshplan.placement.choice import choose_placement
from meshplan.spec.mesh import MeshSpec
from meshplan.spec.model import ModelSpec

from cli_run import run_cli
from configs import MIXTRAL_8X22B as MIXTRAL_SHAPE, job_toml

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


# 3 ------------------------------------------------------------------ active parameters beside the total

#: The trial's Mixtral 8x22B as its Megatron-LM script gives it (train_mixtral_8x22b.sh): the shape of
#: tests/configs.py's MIXTRAL_8X22B (its config.json), named.
MIXTRAL_8X22B = {"name": "mixtral-8x22b", **MIXTRAL_SHAPE}


def test_active_parameters_of_mixtral_8x22b_by_hand(tmp_path, capsys):
    """Active parameters, a token's (attention, norms, router, top-2 of 8 routed experts; embedding
    and output as in the total), were never printed for an MoE model. By hand, per layer:
    attention q 6144 x 48 x 128 = 37,748,736, k and v 6144 x 8 x 128 = 6,291,456 each, o 6144 x 6144
    = 37,748,736: 88,080,384; two experts' SwiGLU 2 x 3 x 6144 x 16384 = 603,979,776; router 6144 x 8
    = 49,152; two RMSNorms 2 x 6144 = 12,288; so 692,121,600 a layer, x 56 = 38,758,809,600; plus the
    embedding and the untied output 2 x 32768 x 6144 = 402,653,184 and the final norm 6144:
    39,161,468,928 (the trial's own count). The total has all 8 experts: 6 x 3 x 6144 x 16384 =
    1,811,939,328 more a layer, 56 x that = 101,468,602,368 more: 140,630,071,296 (Mistral AI:
    "141B parameters", "39B active")."""
    m = ModelSpec(**MIXTRAL_8X22B)
    layer = (6144 * 48 * 128 + 2 * 6144 * 8 * 128 + 6144 * 6144) + 2 * 3 * 6144 * 16384 + 6144 * 8 + 2 * 6144
    assert layer == 692_121_600
    assert m.active_param_count() == 56 * layer + 2 * 32768 * 6144 + 6144 == 39_161_468_928
    assert m.param_count() == 39_161_468_928 + 56 * 6 * 3 * 6144 * 16384 == 140_630_071_296
    job = tmp_path / "job.toml"
    job.write_text(job_toml(MIXTRAL_8X22B, nodes=64, training={"global_batch": 1024, "seq_len": 4096,
                                                               "sharding": "zero1", "framework": "megatron"},
                            mesh={"names": ["pp", "dp", "tp", "ep"], "shape": [8, 32, 2, 8],
                                  "sequence_parallel": True}))
    _, out, _ = run_cli(["plan", job], capsys)
    assert ", vocab 32768, 140.63 B params, 8 experts top-2\n        39.16 B active per token (attention, norms, " \
           "router, the top-2 of 8 routed experts; embedding and output as in the total)\n" in out
    # catalog model: Mixtral 8x7B, 32 x (41,943,040 + 2 x 3 x 4096 x 14336 + 4096 x 8 + 2 x 4096) + 2 x 32000 x 4096
    # + 4096 = 12,879,925,248 active of 46,702,792,704 (meshplan.spec.params.active_param_count's docstring)
    _, out, _ = run_cli(["catalog", "model"], capsys)
    assert ("  params: 46.70 B; 12.88 B active per token (attention, norms, router, the top-2 of 8 routed experts; "
            "embedding and output as in the total)") in out.splitlines()
    assert "  params: 70.55 B" in out.splitlines()  # a dense model: its total alone


# 4 ------------------------------------------------------------------ validate: every refusal in one run

def _trial_job(tmp_path, **training) -> Path:
    """The trial's job.toml (Megatron-LM import of train_mixtral_8x22b.sh): pp 8 x dp 32 x tp 2, ep 8, etp 1."""
    job = tmp_path / "job.toml"
    job.write_text(job_toml(MIXTRAL_8X22B, nodes=64, training={
        "global_batch": 1024, "seq_len": 4096, "sharding": "zero1", "recompute": "selective", "framework": "megatron",
        "overlap_grad_reduce": True, "overlap_param_gather": True, **training},
        mesh={"names": ["pp", "dp", "tp", "ep", "etp"], "shape": [8, 32, 2, 8, 1], "sequence_parallel": True,
              "virtual_stages": 7, "pp_schedule": "interleaved_1f1b"}))
    return job


def test_validate_prints_every_refusal_once_with_fixes_the_other_checks_accept(tmp_path, capsys):
    """The trial's validate refused its job five times, one refusal a run, and twice suggested a fix
    the next check refused. Now one run prints them all, and every fix holds. By hand: world 8 is not
    a multiple of pp 8 x tp 2 = 16; world 16 gives dp 16 / 16 = 1, a block dp 1 x tp 2 = 2 that ep 8
    does not divide; the smallest dp whose block holds ep 8 is 8 / gcd(8, tp 2) = 4, world 16 x 4 = 64.
    framework "megatron": the fix names the two Megatron-LM keys framework "torch" refuses. zero1: of
    the shardings the runtime builds, none (DDP) is refused at tp 2 > 1 and hsdp without a
    dp_replicate axis, so zero3 alone is named. With those fixes world 64 has no refusal left."""
    pytest.importorskip("torch")
    from meshplan.config import load_config
    from meshplan.runtime.validation.options import Options
    from meshplan.runtime.validation.refusals import refusals

    code, _, err = run_cli(["validate", _trial_job(tmp_path), "--worlds", "8,16", "--out", tmp_path / "v"], capsys)
    tail = "; validate a mesh without it (the plan itself does not need the runtime)"
    assert code == 2 and err.splitlines() == [
        "error: --worlds: world 8 is not a multiple of pp 8 * tp 2 = 16; the data axis dp absorbs the world size, the "
        "other axes keep their degrees: the smallest world is --worlds 64 (dp 4), or a multiple of it",
        "error: --worlds: world 16 makes dp(1) * tp(2) = 2, which ep 8 x etp 1 = 8 does not divide (rule: (dp_shard "
        "* cp * tp) % (ep * etp) == 0); validate keeps ep and etp at the config's degrees and re-sizes only the data "
        "axis dp: the smallest world that holds ep 8 is --worlds 64 (dp 4), or a multiple of it",
        # each refusal names its own field since newcomer trial 48 #5 (was "mesh" for all)
        "error: training.framework: worlds 8, 16: the runtime cannot build this mesh: training.framework is 'megatron': validate "
        "runs torch.distributed, which issues torch's collectives; set framework = \"torch\" and remove "
        "overlap_grad_reduce, overlap_param_gather (Megatron-LM's only) to validate this mesh" + tail,
        "error: training.sharding: worlds 8, 16: the runtime cannot build this mesh: sharding 'zero1': ZeRO-1/2 (a sharded "
        "optimizer) is not built; use zero3 (FSDP2 over the data axes, as torchtitan)" + tail]
    assert not (tmp_path / "v").exists()  # nothing written before the refusals
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    cfg = load_config(_trial_job(fixed, framework="torch", sharding="zero3", overlap_grad_reduce=False,
                                 overlap_param_gather=False))
    assert refusals(cfg, Options(worlds=(64,))) == []
