"""torchtitan's pipeline splits (branch ttvsched): the module-name lists meshplan writes for the V-shaped
schedules (ZBVZeroBubble, DualPipeV) placed as torch and torchtitan place them (nc59), and torchtitan's
default cut among the splits ``meshplan search`` plans for a torchtitan config (nc57 #7a).

torch's V placement (torch 2.13, torch/distributed/pipelining/_utils.py ``generate_stage_to_rank_mapping``
with ``style="v"``, the map ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` build in their constructors):
stage index i goes to rank i on the way down (i < pp), the rank stays put at the turn, and comes back
up, so rank s holds stages s and 2 pp - 1 - s. torchtitan b5bcd76 ``distributed/pipeline_parallel.py``
``_get_pp_rank_to_stage_indices_mapping``: ``zip(range(pp), range(num_stages - 1, pp - 1, -1))[rank]``,
the same pairs, and its ``module_fqns_per_model_part[i]`` is stage index i's module list (model order)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshplan.config import config_from_dict
from meshplan.mesh.chunk_maps import v_shaped, virtual_counts


def test_v_map_is_torchs_stage_to_rank_mapping():
    """meshplan's V map (mesh.chunk_maps.v_shaped, and the pipeline's VShaped over arrays) against
    torch's own ``generate_stage_to_rank_mapping(pp, 2 pp, style="v")`` at pp 1..8, and torchtitan's
    pairs written out by hand at pp 4: (0, 7), (1, 6), (2, 5), (3, 4)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from meshplan.pipeline.vshape import VShaped
    for pp in range(1, 9):
        torch_map = generate_stage_to_rank_mapping(pp, 2 * pp, style="v")
        ours = {v_shaped(c, s, pp, 2): s for s in range(pp) for c in range(2)}
        assert ours == torch_map, pp
        assert all(VShaped().virtual_stage(c, s, pp, 2) == v_shaped(c, s, pp, 2) for s in range(pp) for c in range(2))
    assert [tuple(v_shaped(c, s, 4, 2) for c in range(2)) for s in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]


@pytest.mark.heavy
def test_v_map_is_what_torchs_v_schedules_build():
    """The two V schedule objects themselves, built on CPU over a fake process group of 4 ranks (rank 1's
    stages 1 and 6, 8 micro-batches): their ``stage_index_to_group_rank`` is the V map."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore
    pp, rank = 4, 1
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pp)
    try:
        for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
            stages = [PipelineStage(torch.nn.Linear(4, 4), i, 2 * pp, torch.device("cpu"))
                      for i in (v_shaped(0, rank, pp, 2), v_shaped(1, rank, pp, 2))]
            sched = cls(stages, n_microbatches=2 * pp, loss_fn=lambda out, target: out.sum())
            assert sched.stage_index_to_group_rank == {v_shaped(c, s, pp, 2): s for s in range(pp) for c in range(2)}
    finally:
        dist.destroy_process_group()


def _zbv_8b(split, schedule="zbv"):
    """Llama-3-8B (32 layers) at pp 2 x dp_shard 4 on one dgx-h100, 2 chunks a stage, ``split`` per stage
    (reshard_after_forward false: the V schedules' FSDP2 defect, pipeline.vshape.RESHARD_DEFECT)."""
    return config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 32, "seq_len": 4096, "micro_batch": 1, "reshard_after_forward": False},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": schedule, "virtual_stages": 2,
                 "pp_layer_split": split}})


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedule_export_lists_the_parts_as_a_v(schedule):
    """[14, 18] at pp 2 with 2 chunks a stage: stage 0's 14 layers as 7 + 7, stage 1's 18 as 9 + 9
    (mesh.layers.stage_layers spreads a stage's layers evenly over its chunks). Under a V stage 0 holds
    model parts 0 and 3, stage 1 parts 1 and 2, so the parts in model order are [7, 9, 9, 7]: torchtitan
    then gives rank 0 parts 0 and 3 (7 + 7 = 14) and rank 1 parts 1 and 2 (9 + 9 = 18), the plan's split.
    Before this branch the export listed them looped, [7, 9, 7, 9], which torchtitan's V runs as 16 + 16.
    The fix line's own cut (first/last less tried in torchtitan_split.LESS's order 1, 0, 2, 3, the first
    before the last): first 2, last 1 give 32 + 2 + 1 = 35 slots in 4 parts, 8 each and the 3 over on
    the first three parts (torchtitan's ``stage_idx < extra_layers``): [9 - 2, 9, 9, 8 - 1] = [7, 9, 9, 7]."""
    from meshplan.interop.torchtitan_split import split_setting
    from meshplan.interop.torchtitan_write import write
    from meshplan.interop.tomlout import meshplan_tables
    cfg = _zbv_8b([14, 18], schedule)
    parts = write(cfg)["parallelism"]["module_fqns_per_model_part"]
    assert [sum(m.startswith("layers.") for m in p) for p in parts] == [7, 9, 9, 7]
    assert parts[0][:2] == ["tok_embeddings", "layers.0"] and parts[1][0] == "layers.7"
    assert parts[3] == [f"layers.{j}" for j in range(25, 32)] + ["norm", "output"]
    ranks = {s: [v_shaped(c, s, 2, 2) for c in range(2)] for s in range(2)}
    assert [sum(len(parts[j]) - (j == 0) - 2 * (j == 3) for j in ranks[s]) for s in range(2)] == [14, 18]
    assert meshplan_tables(cfg)["mesh"]["pp_layer_split"] == [14, 18]  # meshplan's own export: per stage kept
    assert split_setting(32, [14, 18], 2, False, v_shape=True) == (
        "parallelism.pipeline_parallel_first_stage_less_layers = 2, "
        "parallelism.pipeline_parallel_last_stage_less_layers = 1")
    assert split_setting(32, [14, 18], 2, False).startswith("parallelism.module_fqns_per_model_part")  # looped


def test_v_counts_of_a_per_virtual_stage_split_are_as_given():
    """A split per virtual stage is in model order under either map (mesh.layers.stage_layers): the parts
    are the split as written; its per-stage sums under a V pair the ends: [3, 4, 4, 5] gives stage 0
    3 + 5 = 8, stage 1 4 + 4 = 8."""
    assert virtual_counts(16, 2, 2, [3, 4, 4, 5], v_shaped) == [3, 4, 4, 5]
    from meshplan.interop.tomlout import meshplan_tables
    cfg = config_from_dict({
        "model": {"catalog": "llama3-8b"}, "cluster": {"system": "dgx-h100", "nodes": 1},
        "training": {"global_batch": 32, "seq_len": 4096, "micro_batch": 1, "reshard_after_forward": False},
        "mesh": {"names": ["pp", "dp_shard"], "shape": [2, 4], "pp_schedule": "zbv", "virtual_stages": 2,
                 "pp_layer_split": [7, 9, 9, 7]}})
    # the per-stage [14, 18] spreads back to [7, 9, 9, 7] under the V: written per stage
    assert meshplan_tables(cfg)["mesh"]["pp_layer_split"] == [14, 18]


def test_torchtitan_default_cut_by_hand():
    """torchtitan's default cut at one stage a rank (b5bcd76 ``_generate_llm_fqn_per_model_part``, first and
    last stage less 1 each): layers + 2 slots, (layers + 2) // pp a stage, the remainder one each on the
    first stages, then the embedding's slot off stage 0 and the norm + output's off the last.
    80 layers at pp 3: 82 = 3 x 27 + 1, so [28 - 1, 27, 27 - 1] = [27, 27, 26].
    126 layers at pp 16: 128 = 16 x 8, so [8 - 1, 8 x 14, 8 - 1] = [7, 8 x 14, 7].
    32 layers at pp 4: 34 = 4 x 8 + 2, so [9 - 1, 9, 8, 8 - 1] = [8, 9, 8, 7].
    The first two are the search's default split already (balanced: 80 = 3 x 26 + 2, the two over on
    the middle stage and then stage 0; 126 = 16 x 7 + 14, the 14 over on the 14 middle stages), so a
    torchtitan file gets no extra row there; the third is neither the even split nor Llama 3's [7, 9, 9, 7]
    (34 slots, the 2 over on the middle stages), so a torchtitan file's short-ends row is it."""
    from meshplan.interop.torchtitan_tables import default_split
    from meshplan.search.candidate import stage_split, torchtitan_cut
    for layers, pp, want in ((80, 3, [27, 27, 26]), (126, 16, [7] + [8] * 14 + [7]), (32, 4, [8, 9, 8, 7])):
        assert torchtitan_cut(layers, pp) == want == default_split(pp, layers)  # the import's rule, the same
        assert stage_split(layers, pp, 1, short=True, titan=True) == want
    assert stage_split(80, 3, 1) == [27, 27, 26] and stage_split(126, 16, 1) == [7] + [8] * 14 + [7]
    assert stage_split(32, 4, 1) is None and stage_split(32, 4, 1, short=True) == [7, 9, 9, 7]


def _searched(catalog: str, origin: str):
    from dataclasses import replace
    cfg = config_from_dict({"model": {"catalog": catalog}, "cluster": {"system": "dgx-h100", "nodes": 1},
                            "training": {"global_batch": 64, "seq_len": 4096, "framework": "torch"}},
                           require_mesh=False)
    return replace(cfg, origin=origin)


def test_search_rows_of_a_torchtitan_file_take_its_default_cut():
    """Where the split column ``us`` gets a row of its own (search.space.short_ok) and what its plan input
    and memory bound split (candidate_config, memory.stage_layout): for a torchtitan file at vpp 1
    torchtitan's cut (test_torchtitan_default_cut_by_hand), for a meshplan TOML Llama 3's rule."""
    import numpy as np

    from meshplan.search.memory import stage_layout
    from meshplan.search.space import candidate_config, enumerate_candidates, short_ok
    titan, own = _searched("llama3-8b", "torchtitan"), _searched("llama3-8b", "")
    # 32 layers: pp 3 cuts 34 = 3 x 11 + 1 as [11, 11, 10], the balanced split (32 = 3 x 10 + 2: stage 1,
    # then stage 0); pp 5 34 = 5 x 6 + 4 as [6, 7, 7, 7, 5], not balanced [6, 7, 7, 6, 6]; pp 2 [16, 16] even
    assert short_ok(titan, np.array([3, 4, 5, 2]), 1).tolist() == [False, True, True, False]
    assert short_ok(_searched("llama3-70b", "torchtitan"), np.array([3]), 1).tolist() == [False]  # 80: balanced
    assert short_ok(_searched("llama3-405b", "torchtitan"), np.array([16]), 1).tolist() == [False]
    for cfg, want in ((titan, [8, 9, 8, 7]), (own, [7, 9, 9, 7])):
        c = enumerate_candidates(cfg)
        rows = np.flatnonzero((c.pp == 4) & (c.vpp == 1) & (c.us == 1))
        assert rows.size and all(candidate_config(cfg, c, int(i)).mesh.pp_layer_split == want for i in rows)
        assert stage_layout(cfg, c.take(rows[:1]), 4).n.tolist() == [want]  # the bounds' stages the same


def test_search_ranks_an_imported_torchtitan_pp_job_as_it_runs(tmp_path):
    """nc57 #7a: a torchtitan job of Llama-3-8B at pp 4 (1F1B, its default cut [8, 9, 8, 7] as the import
    reads it) was 'absent' from its search ('the search splits evenly or as Llama 3'); now that split is
    a candidate's and the configured mesh is ranked among them."""
    from dataclasses import replace

    from meshplan.interop.foreign import ImportOptions, load_any
    from meshplan.search.driver import search
    from meshplan.spec.search import SearchOptions
    job = tmp_path / "tt8b_pp4.toml"
    job.write_text('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n'
                   'global_batch_size = 64\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = -1\n'
                   'pipeline_parallel_degree = 4\npipeline_parallel_microbatch_size = 1\n'
                   '[activation_checkpoint]\nmode = "full"\n')
    cfg = load_any(job, "torchtitan", ImportOptions(cluster="dgx-h100", nodes=1))
    assert cfg.mesh is not None and cfg.mesh.pp_layer_split == [8, 9, 8, 7]
    narrow = SearchOptions(pp=[4], tp=[1], cp=[1], micro_batch=[1], recompute=["full"], sharding=["zero3"], vpp=[1])
    mine = search(replace(cfg, search=narrow), workers=1).configured
    assert mine is not None and mine.status == "ranked", mine


def test_search_export_keeps_the_torchtitan_py_values(tmp_path, capsys):
    """``search --export N --to torchtitan -o FILE.py`` of an import of newcomer trial nc57's b5bcd76 registry
    (llama3_8b; its [source] names the .py and the function) keeps what the .py states and meshplan does not
    plan, as ``export`` of the same TOML does (tests/test_nclose_fixes.py): hf_assets_path
    "./assets/hf/Llama-3.1-8B", 1000 steps, default_adamw(lr=3e-4), the checkpoint every 500 steps, none of
    them torchtitan's defaults ("./tests/assets/tokenizer", 10000, 8e-4). Searching the .py itself
    (``--config llama3_8b``) keeps them too. Before this branch both wrote b5bcd76's names with the defaults."""
    from tests.cli_run import run_cli
    folder = tmp_path / "llama3"
    folder.mkdir()
    reg = folder / "config_registry.py"
    reg.write_text((Path(__file__).parent / "data" / "nc57b" / "llama3" / "config_registry.py.txt").read_text())
    toml = tmp_path / "j8.toml"
    assert run_cli(["import", "auto", reg, "--config", "llama3_8b", "--cluster", "dgx-h100", "--nodes", "1",
                    "-o", toml], capsys)[0] == 0
    toml.write_text(toml.read_text() + "\n[search]\ntp = [2]\npp = [1]\ncp = [1]\nmicro_batch = [2]\n")
    for args, out in (([toml], tmp_path / "s8.py"),
                      ([reg, "--config", "llama3_8b", "--cluster", "dgx-h100", "--nodes", "1"], tmp_path / "s9.py")):
        code, stdout, stderr = run_cli(["search", *args, "--top", "1", "--export", "1", "--to", "torchtitan",
                                        "-o", out], capsys)
        text = out.read_text()
        assert code == 0 and "def llama3_8b() -> Trainer.Config:" in text
        assert 'hf_assets_path="./assets/hf/Llama-3.1-8B"' in text and "steps=1000," in text
        assert "default_adamw(lr=0.0003)" in text and "interval=500" in text and 3e-4 == 0.0003
        assert ": optimizer, training.steps, checkpoint.enable, checkpoint.interval, hf_assets_path" in stdout + stderr
