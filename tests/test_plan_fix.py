"""``meshplan plan`` of a mesh over memory ends with a ``fix:`` line (issue 11 follow-up): each
variant's peak is the plan of the config edited by hand."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from meshplan.config import load_config
from meshplan.plan import build_plan
from meshplan.plan_fix import memory_fix
from meshplan.units import GiB
from tests.cli_run import plan_file, run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _gib(plan) -> str:
    return f"{plan.timeline.peak.total_bytes / GiB:.1f} GiB"


def test_fix_lists_each_variant_with_the_peak_its_own_plan_gives():
    """seed-64gpu-tp4 (dp_shard 16 x tp 4) peaks at 69.7 > 67.1 GiB. Its tp x2 variant is the
    seed's own mesh, examples/seed-64gpu.toml (dp_shard 8 x tp 8, all else equal): the printed
    peak is that file's plan's; recompute full and pp x2 are the file edited by hand, pp x2 left out
    as it raises the peak."""
    p = plan_file(EXAMPLES / "seed-64gpu-tp4.toml")
    cfg = p.config
    full = build_plan(replace(cfg, training=cfg.training.model_copy(update={"recompute": "full"})))
    seed = plan_file(EXAMPLES / "seed-64gpu.toml")
    piped = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"names": ["pp", "dp_shard", "tp"],
                                                                      "shape": [2, 8, 4]})))
    assert not p.feasible and full.feasible and seed.feasible and not piped.feasible
    assert (_gib(full), _gib(seed), _gib(piped)) == ("22.0 GiB", "43.3 GiB", "97.3 GiB")
    # pp x2 raises the peak (97.3 > 69.7 GiB): no fix, left out
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits); tp x2 (dp_shard 8 x tp 8) -> peak "
                             f"{_gib(seed)} (fits) (usable 67.1 GiB)")


def test_micro_batch_variant_halves_it(tmp_path):
    """micro_batch 4 and recompute none on the seed (peak 121.3 GiB): recompute full and micro_batch 2 are
    offered at their plans' peaks; pp x2 (131.8 GiB) raises it and is left out."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("micro_batch = 1", "micro_batch = 4") \
        .replace('recompute = "selective"', 'recompute = "none"')
    f = tmp_path / "seed-mb4.toml"
    f.write_text(text)
    p = plan_file(f)
    half = build_plan(replace(p.config, training=p.config.training.model_copy(update={"micro_batch": 2})))
    full = build_plan(replace(p.config, training=p.config.training.model_copy(update={"recompute": "full"})))
    assert not p.feasible and not half.feasible and full.feasible
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(full)} (fits); micro_batch 2 -> peak {_gib(half)} "
                             "(usable 67.1 GiB)")


def test_no_variant_fits_gives_the_fewest_nodes(tmp_path):
    """Llama-3-70B on one node (dp_shard 1 x tp 8): even recompute full peaks at 133.6 GiB; with it,
    2 nodes (dp_shard 2) do not fit, 3 cannot split the global batch 512, 4 (dp_shard 4) fit."""
    text = (EXAMPLES / "seed-64gpu.toml").read_text().replace("nodes = 8", "nodes = 1").replace("[8, 8]", "[1, 8]")
    f = tmp_path / "one-node.toml"
    f.write_text(text)
    p = plan_file(f)
    cfg = load_config(f)

    def at(nodes: int):
        return build_plan(replace(cfg, cluster=cfg.cluster.model_copy(update={"nodes": nodes}),
                                  training=cfg.training.model_copy(update={"recompute": "full"}),
                                  mesh=cfg.mesh.model_copy(update={"shape": [nodes, 8]})))
    assert not at(1).feasible and not at(2).feasible and at(4).feasible
    assert memory_fix(p) == (f"fix: recompute full -> peak {_gib(at(1))} (usable 67.1 GiB); does not fit even at the "
                             f"most memory-saving settings on 1 node: 4 nodes would (recompute full, dp_shard 4 x tp 8: "
                             f"peak {_gib(at(4))})")


def test_plan_cli_prints_fix_after_the_verdict(capsys):
    """The fix follows the ``infeasible:`` line on stderr; exit 1; a mesh that fits prints none."""
    assert run_main("plan", EXAMPLES / "seed-64gpu-tp4.toml") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith("infeasible: peak 69.7 GiB") and err[-1].startswith("fix: recompute full -> peak 22.0")
    assert run_main("plan", EXAMPLES / "seed-64gpu.toml") == 0
    assert "fix:" not in capsys.readouterr().err
