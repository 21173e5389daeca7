"""torch's InterleavedZeroBubble is treated the same by every entry point (a newcomer found a
torchtitan job refuse it while ``--schedule`` took it and then blamed zb_h1). meshplan's zb_h1
is ``ScheduleInterleavedZeroBubble`` at one stage per rank (the same order as torch 2.13's:
tests/test_schedule_registry.py); with more stages per rank (2 by default in torchtitan,
``_get_pipeline_metadata``: ``stages_per_rank = 1 if is_single_stage_schedule else 2``) it is
refused in the same words under ``mesh.pp_schedule``, ``--schedule`` and
``parallelism.pipeline_parallel_schedule``."""

from __future__ import annotations

import pytest

from meshplan.errors import ConfigError
from meshplan.interop.common import ImportOptions
from meshplan.interop.foreign import load_any
from meshplan.spec.mesh import Schedule, parse_schedule
from tests.cli_run import run_main

REFUSAL = ("InterleavedZeroBubble (zb_h1) with 2 stages per rank is not planned by meshplan: it plans torch's "
           "ScheduleInterleavedZeroBubble with one stage per rank only (zb_h1, the same order); use Interleaved1F1B, "
           "ZBVZeroBubble or DualPipeV, or one stage per rank")
MESH = ('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\nglobal_batch = 64\n'
        'seq_len = 8192\nmicro_batch = 1\nsharding = "zero3"\nrecompute = "none"\n[mesh]\n'
        'names = ["pp", "dp_shard", "tp"]\nshape = [2, 2, 2]\nsequence_parallel = true\n')


def _titan(tmp_path, schedule: str, extra: str = "") -> object:
    f = tmp_path / "tt.toml"
    f.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\nseq_len = 8192\n'
                 '[parallelism]\ndata_parallel_shard_degree = -1\npipeline_parallel_degree = 2\n'
                 f'pipeline_parallel_schedule = "{schedule}"\n{extra}')
    return f


def test_torchtitan_job_refuses_it_at_torchtitans_two_stages_per_rank(tmp_path, capsys):
    assert run_main("plan", _titan(tmp_path, "InterleavedZeroBubble"), "--cluster", "dgx-h100", "--nodes", 1) == 2
    assert capsys.readouterr().err == f"error: parallelism.pipeline_parallel_schedule: {REFUSAL}\n"


def test_schedule_option_and_field_refuse_it_at_two_stages_per_rank_in_the_same_words(tmp_path, capsys):
    f = tmp_path / "v2.toml"
    f.write_text(MESH + 'virtual_stages = 2\npp_schedule = "interleaved_1f1b"\n')
    for name in ("InterleavedZeroBubble", "zb_h1", "ZB-H1"):
        assert run_main("step", f, "--schedule", name) == 2
        assert capsys.readouterr().err == f"error: --schedule: {REFUSAL}\n"
    g = tmp_path / "v2zb.toml"
    g.write_text(MESH + 'virtual_stages = 2\npp_schedule = "InterleavedZeroBubble"\n')
    assert run_main("plan", g) == 2
    assert capsys.readouterr().err == f"error: mesh.pp_schedule: {REFUSAL}\n"


def test_one_stage_per_rank_is_zb_h1_everywhere(tmp_path):
    """torchtitan runs it with one stage per rank only when module_fqns_per_model_part gives pp
    parts (its stages-per-rank check is on the generated split); 8B: 32 layers."""
    parts = ('module_fqns_per_model_part = [["tok_embeddings", ' + ", ".join(f'"layers.{i}"' for i in range(16))
             + '], [' + ", ".join(f'"layers.{i}"' for i in range(16, 32)) + ', "norm", "output"]]\n')
    cfg = load_any(_titan(tmp_path, "InterleavedZeroBubble", parts), opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert (cfg.mesh.pp_schedule, cfg.mesh.virtual_stages, cfg.mesh.pp_layer_split) == (Schedule.ZB_H1, 1, [16, 16])
    assert parse_schedule("InterleavedZeroBubble") is parse_schedule("ScheduleInterleavedZeroBubble") is Schedule.ZB_H1


def test_layers_per_stage_of_one_stage_per_rank_is_torchtitans_refusal(tmp_path):
    # (32 + 1 + 1) / 17 = 2 stages over pp 2: torchtitan refuses a multi-stage schedule with 1 per rank
    f = _titan(tmp_path, "interleavedzerobubble", "pipeline_parallel_layers_per_stage = 17\n")
    with pytest.raises(ConfigError) as e:
        load_any(f, opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert str(e.value) == ("parallelism.pipeline_parallel_layers_per_stage: interleavedzerobubble with 1 stage per "
                            "rank: torchtitan refuses a multi-stage schedule with fewer than 2; give "
                            "module_fqns_per_model_part with 2 parts for one stage per rank")


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "zbvzerobubble"])
def test_zbv_spellings_are_zbv_in_the_reader_and_the_field(tmp_path, name):
    cfg = load_any(_titan(tmp_path, name), opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert (cfg.mesh.pp_schedule, cfg.mesh.virtual_stages) == (Schedule.ZBV, 2)
    assert parse_schedule(name) is parse_schedule("ScheduleZBVZeroBubble") is Schedule.ZBV


def test_the_reader_takes_no_class_name_torch_does_not(tmp_path):
    """torch's get_schedule_class has no "ScheduleZBVZeroBubble" key, so torchtitan would not run it."""
    with pytest.raises(ConfigError, match=r"^parallelism.pipeline_parallel_schedule: 'ScheduleZBVZeroBubble' is not "):
        load_any(_titan(tmp_path, "ScheduleZBVZeroBubble"), opts=ImportOptions(cluster="dgx-h100", nodes=1))


def test_zerobubble_alone_names_no_schedule_anywhere(tmp_path):
    """"ZeroBubble" is neither a torch get_schedule_class key nor a meshplan name: refused, not
    guessed as zb_h1 or zbv."""
    with pytest.raises(ValueError, match=r"^unknown schedule 'ZeroBubble'; use gpipe"):
        parse_schedule("ZeroBubble")
    with pytest.raises(ConfigError) as e:
        load_any(_titan(tmp_path, "ZeroBubble"), opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert str(e.value) == ("parallelism.pipeline_parallel_schedule: 'ZeroBubble' is not planned by meshplan; use one "
                            "of GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, DualPipeV, or InterleavedZeroBubble with "
                            "one stage per rank")


def test_export_writes_zb_h1_as_torchtitan_runs_it_and_reads_it_back(tmp_path, capsys):
    """export --to torchtitan: InterleavedZeroBubble with module_fqns_per_model_part of pp 2 parts
    (one stage per rank); imported back, zb_h1 at vpp 1 with the same split."""
    import tomllib
    f = tmp_path / "zb.toml"
    f.write_text(MESH + 'pp_schedule = "zb_h1"\n')
    out = tmp_path / "tt.toml"
    assert run_main("export", f, "--to", "torchtitan", "-o", out) == 0
    par = tomllib.loads(out.read_text())["parallelism"]
    assert par["pipeline_parallel_schedule"] == "InterleavedZeroBubble"
    assert [sum(m.startswith("layers.") for m in part) for part in par["module_fqns_per_model_part"]] == [16, 16]
    cfg = load_any(out, opts=ImportOptions(cluster="dgx-h100", nodes=1))
    assert (cfg.mesh.pp_schedule, cfg.mesh.virtual_stages, cfg.mesh.pp_layer_split) == (Schedule.ZB_H1, 1, [16, 16])
