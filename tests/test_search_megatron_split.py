"""The layer splits a search under Megatron-LM plans (newcomer trial 17): where pp does not divide
the layers, the one Megatron-LM's --decoder-first/last-pipeline-num-layers set (middle stages even,
meshplan.mesh.layers.first_last_split, the restart's rule too), or the pp rejected by rule 'split'.

Trial 17: DeepSeek-V3 (61 layers) under framework megatron listed its top rows at pp 32 with the
balanced split [1, 2 x 29, 1, 1], which `--export 1 --to megatron` refused (the middle stages
differ). tests/data/deepseek-v3_512xh100_megatron.toml is that search narrowed to 10 candidates.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from meshplan.config import config_from_dict, load_config
from meshplan.interop.tomlout import meshplan_tables
from meshplan.mesh.resolve import resolve_mesh
from meshplan.interop import megatron
from meshplan.interop.common import ImportOptions
from meshplan.interop.export import not_expressed
from meshplan.mesh.layers import first_last_sets, first_last_split
from meshplan.report.search import export_lines
from meshplan.search.candidate import stage_split
from meshplan.search.driver import search
from meshplan.search.memory import stage_layout
from meshplan.search.space import CODE, OK, candidate_config, short_ok
from tests.cli_run import run_main

CONFIG = Path(__file__).parent / "data" / "deepseek-v3_512xh100_megatron.toml"
#: Megatron-LM's cut of 61 layers at pp 16: ceil(61 / 16) = 4 a middle stage, 16 x 4 - 61 = 3 short,
#: 1 off the first and 2 off the last (the odd one on the last): DeepSeek-V3's own [3, 4 x 14, 2].
DEEPSEEK_PP16 = [3] + [4] * 14 + [2]


def test_first_last_split_of_61_layers_by_hand():
    """pp 16: DEEPSEEK_PP16. pp 32: ceil 2 leaves 64 - 61 = 3 short, 1 off the first and 2 off the
    last: the last none; floor 1 a middle stage leaves 61 - 30 = 29 for the ends, over 2: none.
    pp 30: ceil 3 leaves 29 short (an end none); floor 2 leaves 61 - 60 = 1, on the first stage:
    [3, 2 x 28, 2], no stage over ceil(61 / 30) = 3. The balanced split torch gets at pp 16 puts the
    13 extra layers on the first 13 middle stages: [3, 4 x 13, 3, 3], which Megatron-LM cannot set."""
    assert first_last_split(61, 16) == DEEPSEEK_PP16
    assert first_last_split(61, 32) is None
    assert first_last_split(61, 30) == [3] + [2] * 28 + [2]
    assert stage_split(61, 16, 1) == [3] + [4] * 13 + [3, 3] and not first_last_sets(stage_split(61, 16, 1))
    assert stage_split(61, 16, 1, first_last=True) == DEEPSEEK_PP16


@pytest.fixture(scope="module")
def result():
    cfg = load_config(CONFIG, require_mesh=False)
    return cfg, search(cfg, workers=1)


def test_pp32_is_rejected_by_rule_split_and_pp16_planned_with_megatrons_cut(result):
    """10 candidates, 5 a pp (dp x tp = 512 / pp: tp 1; tp 2 with etp 1 or 2, each with tp overlap
    off and on; ep 8 divides dp x tp 32 and 16): every pp 32 one rejected by rule 'split' (no Llama 3
    row either: its split of 63 slots at pp 32 leaves the last stage none), every pp 16 one planned
    with DEEPSEEK_PP16, which the memory and step bounds count too (stage_layout)."""
    cfg, r = result
    c = r.candidates
    assert len(c) == 10 and int((c.pp == 32).sum()) == 5 and not c.us.any()
    assert (r.code[c.pp == 32] == CODE["split"]).all()
    assert (r.code[c.pp == 16] == OK).all()
    assert r.top and all(int(c.pp[e.index]) == 16 for e in r.top)
    for e in r.top:
        assert candidate_config(cfg, c, e.index).mesh.pp_layer_split == DEEPSEEK_PP16
    st = stage_layout(cfg, c.take(np.flatnonzero(c.pp == 16)), 16)
    assert (st.n == np.array(DEEPSEEK_PP16)[None, :]).all()
    counts = r.counts()
    assert counts["split"] == 5 and counts["feasible"] == 5


def test_every_row_exports_to_megatron(result):
    """Row 1 writes DeepSeek-V3's split as the two flags and gives every field back; no row is
    refused (before: rows 1-8 at pp 32 were, 'first and last stage apart from an even split')."""
    cfg, r = result
    row = candidate_config(cfg, r.candidates, r.top[0].index)
    args = megatron.write(row)
    assert "--decoder-first-pipeline-num-layers 3" in args and "--decoder-last-pipeline-num-layers 2" in args
    assert not_expressed(row, "megatron", {"megatron": None}) == ([], None)
    assert export_lines(r) == []


def test_llama3_split_under_megatron_only_where_its_flags_set_it_and_it_is_new(result):
    """At vpp 1 the Llama 3 split (61 + 2 = 63 slots) at pp 16 is [3, 4 x 14, 2], Megatron-LM's cut
    itself: no row of its own; at pp 8 [7, 8 x 6, 6], the cut again. 60 layers at pp 4 (62 slots):
    [14, 16, 16, 14], which the flags set and which differs from the even split: a row. Under torch
    pp 16's is new (the balanced split differs)."""
    cfg, _ = result
    assert not short_ok(cfg, np.array([16, 8]), 1).any()
    sixty = cfg.model.model_copy(update={"layers": 60, "dense_layers": 3})
    assert short_ok(replace(cfg, model=sixty), np.array([4]), 1).all()
    torch = cfg.training.model_copy(update={"framework": "torch"})
    assert short_ok(replace(cfg, training=torch), np.array([16]), 1).all()


def test_etp_1_beside_tp_comes_back_from_megatron_args(result):
    """A row at tp 2, ep 8, etp 1 writes --expert-tensor-parallel-size 1; read back it is etp 1, not
    the tp 2 a [mesh] without etp gets under megatron (Megatron-LM's default): before, the export
    listed `not expressed in megatron: mesh.etp` and at tp 4 x ep 16 on dp 8 the round trip did not
    resolve (ep 16 x etp 4 = 64 over a block of 32) and `search` stopped with that error."""
    cfg, r = result
    c = r.candidates
    i = next(int(i) for i in np.flatnonzero((c.pp == 16) & (c.tp == 2) & (c.etp == 1)))
    row = candidate_config(cfg, c, i)
    args = megatron.write(row)
    assert "--tensor-model-parallel-size 2" in args and "--expert-tensor-parallel-size 1" in args
    mesh = megatron.read("\n".join(args) + "\n", ImportOptions(cluster="dgx-h100", nodes=64)).tables["mesh"]
    assert dict(zip(mesh["names"], mesh["shape"]))["etp"] == 1
    assert not_expressed(row, "megatron", {"megatron": None}) == ([], None)


def test_no_feasible_mesh_names_rule_split_and_its_fix(tmp_path, capsys):
    """[search] pp = [32] alone: the 5 pp 32 candidates all rejected by rule 'split', the verdict's fix
    names what widens the search."""
    f = tmp_path / "pp32.toml"
    f.write_text(CONFIG.read_text().replace("pp = [16, 32]", "pp = [32]"))
    assert run_main("search", f) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("infeasible: no feasible mesh: of 5 candidates rule 'split' rejected 5 (framework megatron:")
    assert line.endswith("fix: let search.pp reach a pp the layers divide or one Megatron-LM's first/last split sets "
                         "(meshplan.mesh.layers.first_last_split), or set training.framework = \"torch\" (torchtitan "
                         "takes any split)")


def test_a_row_at_etp_1_beside_tp_exports_to_meshplan_as_itself(result):
    """The meshplan TOML of that row names etp = 1: a [mesh] without etp reads back under megatron as
    etp = tp 2 (before: `search --export 1 --to meshplan` wrote pp 16 x dp 16 x tp 2 x ep 8 and
    `plan` of the file planned ... x etp 2, another mesh)."""
    cfg, r = result
    c = r.candidates
    i = next(int(i) for i in np.flatnonzero((c.pp == 16) & (c.tp == 2) & (c.etp == 1)))
    tables = meshplan_tables(candidate_config(cfg, c, i))
    assert dict(zip(tables["mesh"]["names"], tables["mesh"]["shape"]))["etp"] == 1
    back = config_from_dict(tables)
    assert resolve_mesh(back.mesh, back.cluster.world).etp == 1
