"""Every malformed input is a one-line ConfigError naming the field and the fix."""

import copy

import pytest

from meshplan.errors import ConfigError
from meshplan.plan import build_plan
from meshplan.config import config_from_dict, load_config
from tests.cli_run import run_captured

BASE = {
    "model": {"catalog": "llama3-8b"},
    "cluster": {"system": "dgx-h100", "nodes": 1},
    "training": {"global_batch": 8, "seq_len": 1024},
    "mesh": {"names": ["dp_shard", "tp"], "shape": [4, 2]},
}


def with_(path, value):
    d = copy.deepcopy(BASE)
    *head, last = path.split(".")
    t = d
    for k in head:
        t = t[k]
    if value is None:
        del t[last]
    else:
        t[last] = value
    return d


CASES = [
    (with_("model.hiddn", 4096), "model.hiddn", "unknown key in [model]; did you mean hidden?"),
    # issue 11 (newcomer trial 5): 41 allowed keys and no suggestion for a misspelled one
    (with_("training.globl_batch", 8), "training.globl_batch", "unknown key in [training]; did you mean "
     "global_batch?"),
    (with_("training.colour", 8), "training.colour", "unknown key in [training]; allowed keys: "),
    (with_("training.pp_schedule", "1f1b"), "training.pp_schedule",
     "unknown key in [training]; pp_schedule belongs in [mesh]: move it there (mesh.pp_schedule)"),
    (with_("model.hidden", "wide"), "model.hidden", "Input should be a valid integer"),
    (with_("model.layers", 0), "model.layers", "greater than 0"),
    # newcomer trial: pydantic's bare "Input should be greater than 0", now with the bound and the fix
    (with_("training.seq_len", -8192), "training.seq_len",
     "must be greater than 0 (got -8192); give training.seq_len a positive value"),
    (with_("model.catalog", "llama9"), "model.catalog", "unknown model 'llama9'; known: deepseek-v2, deepseek-v2-lite, deepseek-v3, gpt3-175b"),
    # newcomer trial 21 #7: the values closest first (was pydantic's "Input should be 'none', 'selective', ...")
    (with_("training.recompute", "partial"), "training.recompute",
     "\"partial\" is not one of its values (the values, closest first: 'layer', 'selective', 'op', 'full', 'none')"),
    (with_("training.global_batch", None), "training.global_batch", "required key missing in [training]"),
    (with_("mesh.shape", [8]), "mesh", "2 names but 1 degrees in shape; give one degree per name"),
    (with_("training.memory_reserve", 1.5), "training.memory_reserve", "less than 1"),
    (with_("cluster.system", "dgx-z"), "cluster.system", "unknown node 'dgx-z'; known: dgx-a100"),
    (with_("cluster.nodes", None), "cluster.nodes", "required with system"),
    (with_("cluster.nodes", 0), "cluster.nodes", "must be a whole number of nodes, at least 1; got 0"),
    (with_("cluster.gpu", "h900"), "cluster.gpu", "unknown gpu 'h900'; known: a100-sxm-40gb, a100-sxm-80gb"),
    (with_("cluster.colour", "red"), "cluster.colour", "unknown key beside system"),
    # newcomer trial nc61 #3: a network engineer's own network beside a catalog system had no way out;
    # node = NAME in place of system takes the same node and GPU with the network (docs/input.md)
    (with_("cluster.network", "superpod-hdr-su20"), "cluster.network",
     'unknown key beside system (allowed: system, nodes, gpu, fabric, nic); fix: write node = "dgx-h100" in '
     'place of system = "dgx-h100", the same catalog node and GPU with network beside it'),
    (with_("cluster.node", "dgx-a100"), "cluster.node", 'fix: give system = "dgx-h100" or node = NAME, not both'),
    # newcomer trial nc61 #5: nic = { ... } is copied onto every NIC of the node; the error named the copy
    # (cluster.node.nics.0.transport), a path the user never wrote. An Ethernet NIC NCCL drives is RoCE.
    (with_("cluster.nic", {"transport": "ethernet"}), "cluster.nic.transport",
     '"ethernet" is "roce" here (an Ethernet NIC that NCCL drives over RDMA, RoCEv2): set transport = "roce" '
     "(the values: 'infiniband' or 'roce')"),
    (with_("cluster.nic", {"transport": "eth2"}), "cluster.nic.transport",
     "\"eth2\" is not one of its values (the values, closest first: 'roce', 'infiniband')"),
    (with_("cluster.nic", {"rate_gbit_per_s": 0}), "cluster.nic.rate_gbit_per_s", "must be greater than 0"),
    ({**BASE, "cluster": {"node": "dgx-h100", "nodes": 1, "network": "superpod-hdr-su20",
                          "nic": {"transport": "ethernet"}}}, "cluster.nic.transport", 'set transport = "roce"'),
    (with_("mesh.order", "tp-dp"), "mesh", "give either names + shape"),
    (with_("mesh.shape", None), "mesh", "names and shape must both be given"),
    # newcomer words20: [mesh.degrees] alone gave no fix; both forms named with an example
    ({**BASE, "mesh": {"degrees": {"tp": 2, "dp_shard": 4}}}, "mesh",
     'order and degrees must both be given: order = "tp-dp_shard" (Megatron, fastest first) with [mesh.degrees] '
     'tp = 2, dp_shard = 4; or names + shape (outermost first): names = ["dp_shard", "tp"], shape = [4, 2]'),
    (with_("extra", {}), "extra", "unknown table"),
    (with_("mesh", None), "mesh", "missing table [mesh]"),
]


@pytest.mark.parametrize("data,field,text", CASES, ids=[c[1] + ":" + c[2][:20] for c in CASES])
def test_config_error_names_field(data, field, text):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert e.value.field == field
    assert text in e.value.message
    assert "\n" not in str(e.value)


def test_world_larger_than_cluster():
    d = with_("mesh.shape", [8, 2])
    d["mesh"]["world"] = 16
    with pytest.raises(ConfigError) as e:
        build_plan(config_from_dict(d))
    assert str(e.value) == ("mesh.world: 16 ranks but the cluster has 8 GPUs (1 node x 8); "
                            "use fewer ranks or more nodes")
    # without an explicit world, a product above the cluster is an infeasible result
    assert build_plan(config_from_dict(with_("mesh.shape", [8, 2]))).reasons == (
        "dp_shard(8) * tp(2) = 16 != world(8); fix: shape [4, 2] (dp_shard = 8 / tp 2 = 4; or -1 there to infer it), "
        "or cluster.nodes = 2 (16 GPUs)",)


def test_bad_rank_to_gpu():
    cfg = config_from_dict(with_("mesh.rank_to_gpu", [0, 1, 2, 3, 4, 5, 6, 6]))
    with pytest.raises(ConfigError) as e:
        build_plan(cfg)
    assert e.value.field == "mesh.rank_to_gpu"


def test_infeasible_is_a_result_not_an_error():
    plan = build_plan(config_from_dict(with_("mesh.shape", [3, 2])))
    assert not plan.feasible
    assert plan.reasons == ("dp_shard(3) * tp(2) = 6 != world(8); fix: shape [4, 2] (dp_shard = 8 / tp 2 = 4; "
                            "or -1 there to infer it), or mesh.world = 6 (use 6 of the 8 GPUs)",)
    plan = build_plan(config_from_dict(with_("mesh.shape", [1, 8])))  # llama3-8b: 8 kv heads, 32 q: fine
    assert plan.feasible, plan.reasons
    bad = with_("mesh.shape", [1, 8])
    bad["model"] = {"catalog": "llama3-8b", "q_heads": 12, "kv_heads": 4, "head_dim": 128}
    plan = build_plan(config_from_dict(bad))
    assert not plan.feasible and plan.reasons[0] == "q_heads 12 is not divisible by tp 8"


def test_toml_and_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no file"):
        load_config(tmp_path / "nope.toml")
    p = tmp_path / "bad.toml"
    p.write_text("[model\nx=1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(p)


def test_hf_config_relative_path(tmp_path):
    from tests.conftest import ROOT
    src = ROOT / "tests" / "data" / "hf"
    cfg_json = next(src.rglob("config.json"))
    p = tmp_path / "c.toml"
    p.write_text(f'[model]\nhf_config = "{cfg_json}"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                 '[training]\nglobal_batch = 8\nseq_len = 512\n[mesh]\nnames = ["dp_shard"]\nshape = [8]\n')
    assert load_config(p).model.layers > 0


def test_cli_error_is_one_line_without_traceback(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\ncatalog = "llama3-8b"\nwidth = 3\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                 '[training]\nglobal_batch = 8\nseq_len = 512\n[mesh]\nnames = ["dp_shard"]\nshape = [8]\n')
    r = run_captured("plan", p)  # in-process: an exception out of main fails here as a traceback would
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: model.width: unknown key in [model]")


@pytest.mark.parametrize("path,value,field", [
    ("mesh.sequence_parallel", "yes", "mesh.sequence_parallel"),
    ("mesh.shape", [4, "2"], "mesh.shape.1"),
    ("training.seq_len", "1024", "training.seq_len"),
])
def test_strict_types(path, value, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict(with_(path, value))
    assert e.value.field == field


def test_misspelled_required_key_is_named_as_unknown():
    d = with_("training.global_batch", None)
    d["training"]["global_bach"] = 8
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert e.value.field == "training.global_bach"
    assert "unknown key in [training]" in e.value.message


def test_world_mismatch_names_the_fix():
    """The seed's mesh written shape [8, 4] on 64 GPUs: the reason gives the shape and the
    cluster that fit, with their arithmetic."""
    from tests.conftest import EXAMPLES
    cfg = load_config(EXAMPLES / "seed-64gpu.toml")
    bad = cfg.mesh.model_copy(update={"shape": [8, 4]})
    from dataclasses import replace
    plan = build_plan(replace(cfg, mesh=bad))
    assert plan.reasons == ("dp_shard(8) * tp(4) = 32 != world(64); fix: shape [16, 4] (dp_shard = 64 / tp 4 = 16; "
                            "or -1 there to infer it), or cluster.nodes = 4 (32 GPUs)",)
    fixed = build_plan(replace(cfg, mesh=cfg.mesh.model_copy(update={"shape": [16, 4]})))
    assert fixed.mesh is not None and fixed.world == 64
    # two other axes: their product in brackets, 64 / (pp 4 * tp 8) = 2 (not "64 / pp 4 * tp 8")
    three = cfg.mesh.model_copy(update={"names": ["pp", "dp_shard", "tp"], "shape": [4, 4, 8]})
    assert build_plan(replace(cfg, mesh=three)).reasons[0].startswith(
        "pp(4) * dp_shard(4) * tp(8) = 128 != world(64); fix: shape [4, 2, 8] (dp_shard = 64 / (pp 4 * tp 8) = 2; ")
    # Megatron spelling: the fix names [mesh.degrees]; no axis rescales to 3 x 5 = 15 of 8
    d = with_("mesh", None)
    d["mesh"] = {"order": "tp-dp_shard", "degrees": {"tp": 2, "dp_shard": 2}}
    assert build_plan(config_from_dict(d)).reasons[0].endswith(
        "fix: [mesh.degrees] dp_shard = 4 (8 / tp 2; or -1 to infer it), or mesh.world = 4 (use 4 of the 8 GPUs)")
    assert "fix: degrees whose product is 8 (no single axis" in build_plan(
        config_from_dict(with_("mesh.shape", [3, 5]))).reasons[0]


def test_field_names_of_cluster_and_hf_config(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[model]\nhf_config = "nope/config.json"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
                 '[training]\nglobal_batch = 8\nseq_len = 512\n[mesh]\nnames = ["dp_shard"]\nshape = [8]\n')
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == (f"model.hf_config: no such file {tmp_path / 'nope' / 'config.json'} (relative to the "
                            "TOML file's folder); give a config.json or its directory")
    (tmp_path / "nope").mkdir()
    (tmp_path / "nope" / "config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.field == "model.hf_config" and e.value.message.startswith("model_type: missing from")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(e.value) == f"config: {str(tmp_path)!r} is a directory; give a TOML config file (it holds c.toml)"


def test_mistyped_axis_is_an_error_unless_custom(tmp_path):
    """A name close to a known axis is an error naming the match and the fix (issue 12 item 6);
    listed in mesh.custom_axes it plans as a user-named axis, without a warning."""
    from meshplan.spec.axes import canonical_names
    with pytest.raises(ConfigError) as e:
        canonical_names(["TP", "dp-shard", "cfg"], field="mesh.order")
    assert str(e.value) == ("mesh.order: 'TP' is not a standard axis; did you mean 'tp'? If it is an axis of your own "
                            "(rank math only, no model semantics), list it in mesh.custom_axes = ['TP']")
    assert canonical_names(["dp_shard", "cfg"]) == (("dp_shard", "cfg"), ())
    p = tmp_path / "c.toml"
    body = ('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n'
            '[training]\nglobal_batch = 8\nseq_len = 512\n[mesh]\nnames = ["dp_shard", "tq"]\nshape = [4, 2]\n')
    p.write_text(body)
    r = run_captured("groups", p, "--rank", "0")  # in-process; the console script's no-traceback line: above
    assert r.returncode == 2
    assert r.stderr.startswith("error: mesh.names: 'tq' is not a standard axis; did you mean 'tp'?")
    assert r.stderr.count("\n") == 1
    p.write_text(body + 'custom_axes = ["tq"]\n')
    r = run_captured("groups", p, "--rank", "0")
    assert (r.returncode, r.stderr) == (0, "")


def test_config_error_survives_pickling():
    # the search evaluates candidates in worker processes, which send a ConfigError back to
    # the parent pickled; it must arrive with its field and message (not a TypeError)
    import pickle

    from meshplan.errors import CheckpointError, ConfigError

    for cls in (ConfigError, CheckpointError):
        e = pickle.loads(pickle.dumps(cls("training.zero3_engine", "use pp 1")))
        assert type(e) is cls and e.field == "training.zero3_engine" and e.message == "use pp 1"
        assert str(e) == "training.zero3_engine: use pp 1"


@pytest.mark.parametrize("schedules,named", [(["1f1b", "zbv"], "zbv is not a Megatron-LM schedule"),
                                             (["dualpipev"], "dualpipev is not a Megatron-LM schedule"),
                                             (["zbv", "dualpipev"], "zbv, dualpipev are not Megatron-LM schedules")])
def test_megatron_search_of_schedules_it_does_not_run(schedules, named, tmp_path, capsys):
    """Megatron-LM runs 1F1B and interleaved 1F1B only: searching ZB-V or DualPipeV under it is
    refused up front, naming search.pp_schedules (it was a mesh.pp_schedule error from the
    middle of the search, after the candidates were estimated)."""
    from meshplan.cli import main
    from meshplan.pipeline.registry import check_searched
    from meshplan.search.driver import search
    d = with_("training.framework", "megatron")
    del d["mesh"]
    d["search"] = {"pp_schedules": schedules, "pp": [2], "tp": [1]}
    with pytest.raises(ConfigError) as e:
        search(config_from_dict(d, require_mesh=False))
    assert e.value.field == "search.pp_schedules" and named in e.value.message
    assert e.value.message.endswith('remove them from the list, or set training.framework = "torch"'.replace(
        "them", "them" if "are" in named else "it"))
    assert "1f1b, or interleaved_1f1b with virtual stages" in e.value.message
    p = tmp_path / "c.toml"
    p.write_text('[model]\ncatalog = "llama3-8b"\n[cluster]\nsystem = "dgx-h100"\nnodes = 1\n[training]\n'
                 'global_batch = 8\nseq_len = 1024\nframework = "megatron"\n[search]\npp_schedules = '
                 + str(schedules).replace("'", '"') + "\n")
    with pytest.raises(SystemExit) as done:
        main(["search", str(p)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and err.startswith("error: search.pp_schedules: ")
    check_searched(schedules, "torch")  # torch's pipelining runs them
    check_searched(["1f1b"], "megatron")  # Megatron-LM's own (interleaved with vpp > 1)


def _plan_and_step_refuse(d: dict, path, capsys, start: str) -> None:
    """``plan`` and ``step`` of config dict ``d`` (written as TOML to ``path``) both exit 2 with one
    error line starting ``start``."""
    from meshplan.cli import main
    path.write_text("".join(f"[{k}]\n" + "".join(f"{kk} = {v!r}\n".replace("'", '"') for kk, v in t.items())
                            for k, t in d.items()))
    for cmd in ("plan", "step"):
        with pytest.raises(SystemExit) as done:
            main([cmd, str(path)])
        err = capsys.readouterr().err
        assert done.value.code == 2 and err.count("\n") == 1 and err.startswith(start)


def test_layer_recompute_under_megatron_is_refused(tmp_path, capsys):
    """torchtitan's every-ac_freq-th-layer AC has no Megatron-LM flag (uniform recomputes every
    layer, block the first n of each stage): plan and step refuse it under framework megatron
    naming training.recompute, as ``export --to megatron`` does (it was planned silently), and
    plan it under torch."""
    d = with_("training.recompute", "layer")
    d["training"].update({"ac_freq": 2, "framework": "megatron"})
    with pytest.raises(ConfigError) as e:
        build_plan(config_from_dict(d))
    assert e.value.field == "training.recompute" and "\n" not in str(e.value)
    assert e.value.message.startswith("'layer' is torchtitan's per-layer selective AC (every ac_freq-th layer in "
                                      "full), which framework \"megatron\" does not have")
    assert e.value.message.endswith("use 'full' (every layer: 'layer' with ac_freq 1), 'selective' or 'none', or "
                                    "framework \"torch\"")
    _plan_and_step_refuse(d, tmp_path / "layer.toml", capsys, "error: training.recompute: 'layer'")
    d["training"]["framework"] = "torch"
    assert build_plan(config_from_dict(d)).feasible


@pytest.mark.parametrize("training,named,fix", [
    ({"framework": "megatron"}, 'framework "megatron"', 'or framework "torch"'),
    ({"sharding": "zero3", "zero3_engine": "deepspeed-2021"}, 'zero3_engine "deepspeed-2021"',
     'or zero3_engine "fsdp2"')])
def test_op_recompute_without_the_runtime_is_refused(training, named, fix, tmp_path, capsys):
    """torchtitan's op-level SAC has no Megatron-LM flag and no DeepSpeed ZeRO-3 of 2021: plan and
    step refuse it naming training.recompute, as ``[search] recompute`` (the same words) and
    ``export --to megatron`` do (it was planned silently)."""
    d = with_("training.recompute", "op")
    d["training"].update(training)
    d["mesh"] = {"names": ["dp_shard"], "shape": [8]}
    with pytest.raises(ConfigError) as e:
        build_plan(config_from_dict(d))
    assert e.value.field == "training.recompute"
    assert e.value.message.startswith(f"'op' is torchtitan's op-level selective AC, which {named} does not have")
    assert e.value.message.endswith(fix) and "\n" not in str(e.value)
    d["search"] = {"recompute": ["op"]}
    with pytest.raises(ConfigError, match=f"which {named} does not have"):  # the search's words
        config_from_dict(d)
    del d["search"]
    _plan_and_step_refuse(d, tmp_path / "op.toml", capsys, "error: training.recompute: 'op'")


def test_torchtitan_import_errors_name_the_wrong_key(tmp_path, capsys):
    """Newcomer trial: a torchtitan job TOML with ``model.name = "llama4"`` is refused naming
    model.name (not model.flavor) and the names meshplan knows; ``training.seq_len = -8192`` is
    one line naming training.seq_len with the fix, not pydantic's bare message."""
    from pathlib import Path

    from tests.cli_run import run_main

    tt = (Path(__file__).resolve().parents[1] / "examples" / "torchtitan_llama3-8b_8xh100.toml").read_text()
    f = tmp_path / "tt.toml"
    f.write_text(tt.replace('name = "llama3"', 'name = "llama4"'))
    assert run_main("plan", f, "--cluster", "dgx-h100", "--nodes", "1") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model.name: torchtitan model 'llama4' is not one meshplan knows by name "
                          "(supported: llama3, deepseek_v3, qwen3) and model.hf_assets_path has no config.json; "
                          "give one of those names with its flavor") and len(err.splitlines()) == 1
    f.write_text(tt.replace("seq_len = 8192", "seq_len = -8192"))
    assert run_main("plan", f, "--cluster", "dgx-h100", "--nodes", "1") == 2
    assert capsys.readouterr().err == ("error: training.seq_len: must be greater than 0 (got -8192); give "
                                       "training.seq_len a positive value\n")


def test_network_fix_offered_beside_system_works():
    """nc61 #3: the fix the cluster.network error offers, applied, plans the same node and GPU on the
    named network: dgx-h100 (8 x h100-sxm5-80gb, 8 NICs) on superpod-hdr-su20's tiers (leaf of 20 nodes)."""
    data = with_("cluster.network", "superpod-hdr-su20")
    with pytest.raises(ConfigError):
        config_from_dict(data)
    data["cluster"]["node"] = data["cluster"].pop("system")
    cluster = config_from_dict(data).cluster
    assert (cluster.node.name, cluster.gpu.name, len(cluster.node.nics)) == ("dgx-h100", "h100-sxm5-80gb", 8)
    assert [t.nodes_per_domain for t in cluster.network] == [20, 0]
