"""Fix and error lines of a newcomer trial (findings 1-4): each names what the user typed
(the option, the foreign format's key) and the real limit (memory, or the global batch's cap
on the data axis), with values derived by hand or from the plans themselves."""

from __future__ import annotations

from pathlib import Path

from meshplan import catalog
from meshplan.units import GiB
from tests.cli_run import run_main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TT = EXAMPLES / "torchtitan_llama3-8b_8xh100.toml"
NODES = ", ".join(catalog.names("node"))


#: What an unknown --cluster node's error adds since nc52fixC (newcomer trial 52 #16): the inline route.
INLINE = "; or give a TOML file whose [cluster] writes the node inline (--cluster node.toml)"


def test_unknown_cluster_names_the_option_and_the_closest_node(capsys):
    """Finding 4: ``--cluster dgx-h10`` is one edit from dgx-h100 (difflib ratio 14/15); the
    error names ``--cluster``, not the catalog's ``node``. dgx-h999 is close to none (ratio
    10/16 < 0.75): no guess. ``--gpu`` likewise."""
    assert run_main("plan", TT, "--cluster", "dgx-h10", "--nodes", "1") == 2
    assert capsys.readouterr().err == (f"error: --cluster: unknown node 'dgx-h10'; did you mean 'dgx-h100'? "
                                       f"known: {NODES}{INLINE}\n")
    assert run_main("plan", TT, "--cluster", "dgx-h999", "--nodes", "1") == 2
    assert capsys.readouterr().err == f"error: --cluster: unknown node 'dgx-h999'; known: {NODES}{INLINE}\n"
    assert run_main("plan", TT, "--cluster", "dgx-h100", "--nodes", "1", "--gpu", "h100-sxm5-80g") == 2
    assert capsys.readouterr().err.startswith("error: --gpu: unknown gpu 'h100-sxm5-80g'; did you mean "
                                              "'h100-sxm5-80gb'? known: a100-sxm-40gb, a100-sxm-80gb, ")


def test_unknown_cluster_in_another_case_or_a_part_of_names_is_guessed(capsys):
    """Newcomer trial: ``--cluster DGX-H100`` is dgx-h100 but for case (guessed first); ``h100``
    is too far from every node for difflib (ratio 8/12 against dgx-h100) but is part of two
    node names: both are offered."""
    assert run_main("plan", TT, "--cluster", "DGX-H100", "--nodes", "1") == 2
    assert capsys.readouterr().err == (f"error: --cluster: unknown node 'DGX-H100'; did you mean 'dgx-h100'? "
                                       f"known: {NODES}{INLINE}\n")
    assert run_main("plan", TT, "--cluster", "h100", "--nodes", "1") == 2
    assert capsys.readouterr().err == (f"error: --cluster: unknown node 'h100'; did you mean 'dgx-h100' or "
                                       f"'grand-teton-h100'? known: {NODES}{INLINE}\n")


def _torchtitan(tmp_path, shard: int, tp: int) -> Path:
    f = tmp_path / "tt.toml"
    f.write_text(TT.read_text().replace("data_parallel_shard_degree = -1", f"data_parallel_shard_degree = {shard}")
                 .replace("tensor_parallel_degree = 1", f"tensor_parallel_degree = {tp}"))
    return f


def test_torchtitan_degrees_off_the_world_are_refused_in_torchtitan_keys(tmp_path, capsys):
    """Finding 3: dp_shard 8 x tp 8 = 64 ranks on --nodes 16 x 8 = 128 GPUs: the error line
    itself names parallelism.data_parallel_shard_degree = 128 / 8 = 16 and --nodes 64 / 8 = 8,
    no meshplan key (mesh.shape, cluster.nodes); the notes before it stay."""
    f = _torchtitan(tmp_path, 8, 8)
    assert run_main("plan", f, "--cluster", "dgx-h100", "--nodes", "16") == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: parallelism.data_parallel_shard_degree: data_parallel_shard_degree 8 x "
                       "tensor_parallel_degree 8 = 64 ranks, but --nodes 16 x 8 GPUs = 128; torchtitan refuses that "
                       "at start-up (ParallelDims); fix: data_parallel_shard_degree = 16 (128 / tensor_parallel_degree "
                       "8; or -1 to infer it), or --nodes 8 (64 GPUs)")
    assert [line for line in err if line.startswith("error:")] == err[-1:]
    # 3 x 2 = 6 ranks fill no whole number of 8-GPU nodes: the degree alone, 8 / 2 = 4
    assert run_main("plan", _torchtitan(tmp_path, 3, 2), "--cluster", "dgx-h100", "--nodes", "1") == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "= 6 ranks, but --nodes 1 x 8 GPUs = 8; torchtitan refuses that at start-up (ParallelDims); fix: "
        "data_parallel_shard_degree = 4 (8 / tensor_parallel_degree 2; or -1 to infer it)")


def test_megatron_degrees_off_the_world_name_its_flags():
    """Megatron-LM infers dp = world / (tp x cp x pp), so its reader never builds such a mesh;
    a Megatron config whose mesh was changed to dp 3 (pp 2 x dp 3 x tp 2 = 12 on 16 GPUs) is
    refused with its flags and --nodes, dp having no flag."""
    from dataclasses import replace

    from meshplan.interop.common import ImportOptions
    from meshplan.interop.foreign import load_any
    from meshplan.interop.world_words import foreign_world_error
    from meshplan.mesh.resolve import world_error
    cfg = load_any(EXAMPLES / "megatron_llama3-8b_16xh100_tp2-pp2.args", opts=ImportOptions(cluster="dgx-h100",
                                                                                           nodes=2))
    assert cfg.origin == "megatron" and (cfg.mesh.names, cfg.mesh.shape) == (["pp", "dp", "tp"], [2, 4, 2])
    cfg = replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [2, 3, 2]}))
    bad = world_error(cfg.mesh, cfg.cluster.world, cfg.cluster.node.gpus)
    assert str(bad).startswith("mesh.shape: pp 2 x dp 3 x tp 2 = 12 ranks")
    assert str(foreign_world_error(cfg, bad)) == (
        "--nodes: --pipeline-model-parallel-size 2 x dp 3 x --tensor-model-parallel-size 2 = 12 ranks, but --nodes 2 x "
        "8 GPUs = 16; Megatron-LM runs dp = world / (tp x cp x pp); fix: degrees whose product is 16")
    assert foreign_world_error(replace(cfg, origin=""), bad) is bad


def _405b(tmp_path, nodes: int, shard: int, global_batch: int) -> Path:
    """examples/llama3-70b_256xh100_dp32-tp8.toml with Llama-3-405B on ``nodes`` dgx-h100 at
    dp_shard ``shard`` x tp 8 and ``global_batch`` sequences (micro_batch 1, selective recompute)."""
    text = (EXAMPLES / "llama3-70b_256xh100_dp32-tp8.toml").read_text()
    f = tmp_path / f"405b-{nodes}.toml"
    f.write_text(text.replace('"llama3-70b"', '"llama3-405b"').replace("nodes = 32", f"nodes = {nodes}")
                 .replace("global_batch = 512", f"global_batch = {global_batch}")
                 .replace("shape = [32, 8]", f"shape = [{shard}, 8]"))
    return f


def _at(cfg, nodes: int, global_batch: int):
    """``cfg`` with recompute full on ``nodes`` nodes at dp_shard ``nodes`` x tp 8, planned."""
    from dataclasses import replace

    from meshplan.plan import build_plan
    return build_plan(replace(cfg, cluster=cfg.cluster.model_copy(update={"nodes": nodes}),
                              training=cfg.training.model_copy(update={"recompute": "full",
                                                                       "global_batch": global_batch}),
                              mesh=cfg.mesh.model_copy(update={"shape": [nodes, 8]})))


def test_global_batch_cap_on_dp_is_named_with_the_nodes_and_batch_that_fit(tmp_path, monkeypatch):
    """Finding 1: Llama-3-405B, dp_shard 8 x tp 8, global batch 8 on 8 nodes. Recompute full
    peaks at 99.0 GiB; more nodes need dp > 8 = global_batch / micro_batch, which the batch rule
    refuses (the search used to stop there, "on up to 16 nodes"). With the batch raised to
    dp: 11 nodes (global batch 11) peak at 73.3 GiB, over 79.11 x 0.9 = 71.2 GiB usable, 12 (global
    batch 12) fit at 67.6 GiB, and 16 (global batch 16, the trial's hand check) fit at 52.0 GiB. (At the
    datasheet's 67.1 GiB usable 12 nodes did not fit, and 13 were named.)"""
    from meshplan.plan_fix import memory_fix
    from tests.cli_run import plan_file
    p = plan_file(_405b(tmp_path, 8, 8, 8))
    cfg = p.config
    assert _at(cfg, 16, 8).reasons == ("global_batch 8 is not divisible by micro_batch 1 * dp 16 = 16",)
    p11, p12, p16 = _at(cfg, 11, 11), _at(cfg, 12, 12), _at(cfg, 16, 16)
    assert not p11.feasible and p12.feasible and p16.feasible
    gib = [f"{x.timeline.peak.total_bytes / GiB:.1f}" for x in (_at(cfg, 8, 8), p11, p12, p16)]
    assert gib[0] == "99.0" and float(gib[1]) > 71.2 and gib[2] == "67.6" and gib[3] == "52.0"
    cap = "training.global_batch 8 caps dp at 8 (global_batch / micro_batch 1)"
    # the fix first, the variant over usable memory after it as none (newcomer trial 27 #B)
    assert memory_fix(p) == (f"fix: does not fit even at the most memory-saving settings on 8 nodes, and {cap}: 12 "
                             f"nodes would with training.global_batch 12 (recompute full, dp_shard 12 x tp 8: peak "
                             f"{gib[2]} GiB); over the usable 71.2 GiB, no fix alone: recompute full -> peak 99.0 GiB")
    # on 2 nodes: 4 and 8 nodes split the batch 8 and do not fit; past 8 the same 12 nodes (the nodes part: the
    # variants over usable memory follow it, newcomer trial 27 #B: recompute full first, its peak the plan of
    # recompute full on those 2 nodes, each one over usable memory and under the mesh's own peak)
    two = plan_file(_405b(tmp_path, 2, 2, 8))
    nodes, tail = memory_fix(two).split("; over the usable 71.2 GiB, no fix alone: ")
    assert nodes.endswith(f"on 2 nodes, and {cap}: 12 nodes would with training.global_batch 12 (recompute full, "
                          f"dp_shard 12 x tp 8: peak {gib[2]} GiB)")
    _over_usable(tail, two, f"recompute full -> peak {_at(two.config, 2, 8).timeline.peak.total_bytes / GiB:.1f} GiB")
    # one doubling and no bisection: the first count found, 16 nodes at the trial's global batch 16
    monkeypatch.setattr("meshplan.plan_fix_nodes.MAX_GROWN_PLANS", 1)
    assert memory_fix(p) == (f"fix: does not fit even at the most memory-saving settings on 8 nodes, and {cap}: 16 "
                             f"nodes would with training.global_batch 16 (recompute full, dp_shard 16 x tp 8: peak "
                             f"52.0 GiB); over the usable 71.2 GiB, no fix alone: recompute full -> peak 99.0 GiB")
    # 1 node, global batch 2: 2 nodes (dp 2) tried, the cap reached; the one plan left, 4 nodes (global batch 4),
    # does not fit
    one = plan_file(_405b(tmp_path, 1, 1, 2))
    nodes, tail = memory_fix(one).split("; over the usable 71.2 GiB, no fix alone: ")
    assert nodes.endswith(
        "does not fit at the most memory-saving settings on up to 4 nodes either (data axis grown with the nodes; "
        "training.global_batch 2 caps dp at 2 (global_batch / micro_batch 1): past it the global batch raised to a "
        "multiple of micro_batch x dp)")
    _over_usable(tail, one, f"recompute full -> peak {_at(one.config, 1, 2).timeline.peak.total_bytes / GiB:.1f} GiB")


def _over_usable(tail: str, plan, first: str) -> None:
    """The variants a fix line lists after ``no fix alone:`` (newcomer trial 27 #B): ``first`` opens them,
    and each lowers the mesh's peak but stays over the 71.2 GiB usable (the H100's runtime total 79.11 GiB x 0.9 = 71.20 GiB)."""
    assert tail.startswith(first)
    own = plan.timeline.peak.total_bytes / GiB
    for variant in tail.split("; "):
        peak = float(variant.rsplit(" -> peak ", 1)[1].removesuffix(" GiB"))
        assert 79.11 * 0.9 < peak < own, (variant, own)


def test_search_whose_model_state_exceeds_memory_fully_sharded_names_the_gpus_it_needs(tmp_path, capsys):
    """Finding 2: Llama-3-405B (405,853,388,800 parameters) at 16 B each (fp32 parameters and
    gradients, two fp32 Adam moments) is 6,493,654,220,800 B; over 16 GPUs 377.98 GiB per rank,
    past 79.11 GiB x 0.9 = 76,449,344,126.976 B = 71.20 GiB usable (the H100's runtime total), so no
    batch fits. 6,493,654,220,800 / 84 = 77,305,407,390 B = 72.00 GiB does not fit, / 85 =
    76,395,931,998 B = 71.15 GiB does: 85 GPUs, 11 dgx-h100 nodes (at 80e9 x 0.9 B it took 91, 12). The search's rule 'batch'
    rejects the most candidates (global batch 12), yet the fix names memory, not the batch."""
    from meshplan.config import load_config
    from meshplan.memory.constraints import sharded_state_bytes, state_floor_fix
    f = _405b(tmp_path, 2, 2, 12)
    f.write_text(f.read_text().split("[mesh]")[0])
    cfg = load_config(f, require_mesh=False)
    m, t = cfg.model, cfg.training
    assert m.param_count() == 405_853_388_800 and sharded_state_bytes(m, t, 1) == 16 * 405_853_388_800
    assert sharded_state_bytes(m, t, 16) == 16 * 405_853_388_800 / 16
    fix = ("add nodes: the model state alone is 378.0 GiB per rank even fully sharded (zero3 over all 16 GPUs) > 71.2 "
           "GiB usable, whatever the batch; the state fits fully sharded from 85 GPUs (11 nodes of 8) on, activations "
           "not counted")
    assert state_floor_fix(m, t, cfg.cluster) == fix
    assert state_floor_fix(m, t, cfg.cluster.model_copy(update={"nodes": 11})) is None
    assert state_floor_fix(m, t, cfg.cluster.model_copy(update={"nodes": 10})) is not None
    assert run_main("search", f) == 1
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("infeasible: no feasible mesh"))
    assert "rule 'batch' rejected" in line and line.endswith(f"; fix: {fix}")
